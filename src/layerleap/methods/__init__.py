"""Built-in decoding methods; importing this package registers them."""

from . import baseline  # noqa: F401
from . import skipdecode  # noqa: F401
from . import speculative  # noqa: F401
from . import bild  # noqa: F401
from . import medusa  # noqa: F401
from . import hidden_transfer  # noqa: F401
from . import eagle  # noqa: F401
from . import ppd  # noqa: F401
from . import self_spec  # noqa: F401
from . import prompt_lookup  # noqa: F401
from . import rest  # noqa: F401
from . import auto  # noqa: F401
