"""Ctrl-C on the command line: one line and exit code 130 at any moment.

``install`` (called by the console script before anything heavy is imported) replaces Python's
SIGINT handler.  The first Ctrl-C raises ``KeyboardInterrupt`` and is remembered; later ones are
ignored while it unwinds (clean-up, saving a report, stopping sub-processes).  Inside ``deferred()``
(importing torch and the commands: a C extension interrupted half way can abort the process) the
interrupt waits until the block ends.  Every first import of a heavy library (``HEAVY``: matplotlib,
transformers, the metrics' libraries, safetensors, tqdm ...), wherever in the code it is, runs
inside ``deferred()`` too: ``install`` puts a finder first on ``sys.meta_path`` that wraps those
modules' ``exec_module`` (an import cut half way leaves submodules behind that break the next import,
or ends in the library's own traceback).  A library that swallows the ``KeyboardInterrupt`` or turns it
into another error cannot hide it: ``cli.main`` asks ``interrupted()`` before reporting, and a
process still running ``GRACE_S`` seconds after the Ctrl-C exits with code 130 anyway.

Nothing here acts unless ``install`` ran: the Python API keeps Python's own Ctrl-C behaviour.  The
one exception is ``terminate_as_interrupt``, which the training loop runs in: SIGTERM (from torchrun,
a job scheduler, ``timeout``) stops training as a Ctrl-C does, so the last step is saved."""

from __future__ import annotations

import importlib.abc
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager

GRACE_S = 15.0  # how long the clean-up after a Ctrl-C may take
HEAVY = frozenset(
    "torch numpy safetensors tokenizers transformers huggingface_hub tqdm matplotlib PIL rouge_score nltk "
    "sacrebleu absl scipy regex jinja2 yaml".split()
)  # libraries imported lazily whose import a Ctrl-C must not cut
_state = {"installed": False, "at": None, "deferring": False}


def install() -> None:
    """Handle SIGINT as above (not when the process was started with SIGINT ignored), and defer
    Ctrl-C during the imports of ``HEAVY`` libraries."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)
        _state["installed"] = True
        if not any(isinstance(f, _DeferredImports) for f in sys.meta_path):
            sys.meta_path.insert(0, _DeferredImports())


class _DeferredImports(importlib.abc.MetaPathFinder):
    """Finds a ``HEAVY`` module with the other finders and runs its loading inside ``deferred()``."""

    def __init__(self):
        self._finding = threading.local()

    def find_spec(self, fullname, path, target=None):
        if fullname.partition(".")[0] not in HEAVY or getattr(self._finding, "on", False):
            return None
        self._finding.on = True
        try:
            spec = next(
                (s for f in sys.meta_path if f is not self and (s := _spec(f, fullname, path, target)) is not None),
                None,
            )
        finally:
            self._finding.on = False
        run = getattr(getattr(spec, "loader", None), "exec_module", None)
        if run is not None and not getattr(run, "deferred", False):
            try:
                spec.loader.exec_module = _deferring(run)
            except (AttributeError, TypeError):  # a loader that takes no attributes: loaded as it is
                pass
        return spec


def _spec(finder, fullname, path, target):
    find = getattr(finder, "find_spec", None)
    return find(fullname, path, target) if find is not None else None


def _deferring(run):
    def exec_module(module):
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            return run(module)
        with deferred():
            run(module)

    exec_module.deferred = True
    return exec_module


def interrupted() -> bool:
    """Whether a Ctrl-C came since ``install``."""
    return _state["at"] is not None


def handled() -> None:
    """The Ctrl-C that came was handled where it came (``chat`` stops the answer it cut and goes on): the
    process is not ended for it, and the next one counts as a first one again."""
    _state["at"] = None


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


@contextmanager
def terminate_as_interrupt():
    """Inside the block, SIGTERM raises ``KeyboardInterrupt`` as a Ctrl-C does (later ones are ignored
    while it unwinds); the previous handler is back afterwards.  Only in the main thread (signals reach
    no other) and only where SIGTERM has its default action (it would kill the process unwound): a
    handler of the caller's own, or SIGTERM ignored, is left as it is."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return
    came = []

    def on_term(signum, frame):
        if came:
            return  # a second SIGTERM: the first one is being handled
        came.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _on_sigint(signum, frame):
    if _state["at"] is not None:
        return  # a second Ctrl-C: the first one is being handled
    _state["at"] = at = time.monotonic()
    threading.Thread(target=_last_resort, args=(at,), daemon=True, name="layerleap-interrupt").start()
    if not _state["deferring"]:
        raise KeyboardInterrupt


def _last_resort(at: float) -> None:
    time.sleep(GRACE_S)
    if _state["at"] != at:  # that Ctrl-C was handled (``handled``)
        return
    print("layerleap: interrupted", file=sys.stderr, flush=True)
    os._exit(130)
