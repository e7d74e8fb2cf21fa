"""``python -m layerleap ...`` is the ``layerleap`` command (``python -m layerleap.cli`` would load the
CLI module twice, and the subcommands would register with the other copy)."""

import sys

from .cli import main

sys.exit(main())
