"""Built-in decoding methods; importing this package registers them."""

from . import baseline  # noqa: F401
from . import skipdecode  # noqa: F401
from . import speculative  # noqa: F401
from . import bild  # noqa: F401
