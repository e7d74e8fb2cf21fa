"""One base class for the errors a user can fix: the CLI prints their message and exits with 2."""


class LayerleapError(Exception):
    """Bad input or a missing resource; the message names the problem and the fix."""
