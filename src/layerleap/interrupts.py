"""Ctrl-C on the command line: one line and exit code 130 at any moment.

``install`` (called by the console script before anything heavy is imported) replaces Python's
SIGINT handler.  The first Ctrl-C raises ``KeyboardInterrupt`` and is remembered; later ones are
ignored while it unwinds (clean-up, saving a report, stopping sub-processes).  Inside ``deferred()``
(importing torch and the commands: a C extension interrupted half way can abort the process) the
interrupt waits until the block ends.  A library that swallows the ``KeyboardInterrupt`` or turns it
into another error cannot hide it: ``cli.main`` asks ``interrupted()`` before reporting, and a
process still running ``GRACE_S`` seconds after the Ctrl-C exits with code 130 anyway.

Nothing here acts unless ``install`` ran: the Python API keeps Python's own Ctrl-C behaviour."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import contextmanager

GRACE_S = 15.0  # how long the clean-up after a Ctrl-C may take
_state = {"installed": False, "at": None, "deferring": False}


def install() -> None:
    """Handle SIGINT as above (not when the process was started with SIGINT ignored)."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)
        _state["installed"] = True


def interrupted() -> bool:
    """Whether a Ctrl-C came since ``install``."""
    return _state["at"] is not None


@contextmanager
def deferred():
    """Hold a Ctrl-C that comes inside the block until the block ends."""
    before, came_before = _state["deferring"], interrupted()
    _state["deferring"] = True
    try:
        yield
    finally:
        _state["deferring"] = before
    if not before and not came_before and interrupted():  # held here: raise it now (once)
        raise KeyboardInterrupt


def _on_sigint(signum, frame):
    if _state["at"] is not None:
        return  # a second Ctrl-C: the first one is being handled
    _state["at"] = time.monotonic()
    threading.Thread(target=_last_resort, daemon=True, name="layerleap-interrupt").start()
    if not _state["deferring"]:
        raise KeyboardInterrupt


def _last_resort() -> None:
    time.sleep(GRACE_S)
    print("layerleap: interrupted", file=sys.stderr, flush=True)
    os._exit(130)
