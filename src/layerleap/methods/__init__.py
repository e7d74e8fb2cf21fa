"""Built-in decoding methods; importing this package registers them."""

from . import baseline  # noqa: F401
