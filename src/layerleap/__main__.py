"""The ``layerleap`` command: the console script runs ``run``, as does ``python -m layerleap ...``
(not ``python -m layerleap.cli``, which would load the CLI module twice).

``run`` installs the Ctrl-C handling (``layerleap.interrupts``) before anything heavy is imported,
so an interrupt at any moment (importing torch, parsing, loading, converting, decoding, training)
ends with one line and exit code 130."""

import os
import signal
import sys


def run() -> None:
    try:  # a Ctrl-C while the handling itself is imported ends the same way
        from . import interrupts

        interrupts.install()
        from .cli import main

        code = main()
    except KeyboardInterrupt:  # outside a command: importing the commands or parsing
        print("layerleap: interrupted", file=sys.stderr)
        code = 130
    except BrokenPipeError:  # stdout closed early (| head): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 141
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # shutting down: no traceback from a late Ctrl-C
    sys.exit(code)


if __name__ == "__main__":
    run()
