"""Running the ``layerleap`` command (or a Python snippet) in a real subprocess, watching its stderr
for a marker line and sending it signals: for the interrupt and concurrent-conversion tests.

Imported as a plain module (pytest puts tests/ on sys.path); it holds no tests."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

TESTS = Path(__file__).parent


def layerleap_cmd() -> list[str]:
    script = Path(sys.executable).with_name("layerleap")
    return [str(script)] if script.exists() else [sys.executable, "-m", "layerleap"]


class Proc:
    """A subprocess whose stdout and stderr are collected by threads (so a full pipe never blocks it)."""

    def __init__(self, argv: list[str], env: dict | None = None, cwd=None, group: bool = False, stdin=None):
        full = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
            "LAYERLEAP_TEST_THREADS": "1",
            **(env or {}),
        }
        # group: its own process group, so that signal_group reaches its children too, as a terminal's Ctrl-C
        # Ctrl-C as a terminal gives it, even where the tests run as a background job (which ignores SIGINT)
        self.p = subprocess.Popen(
            argv,
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=full,
            cwd=cwd,
            start_new_session=group,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        self.out, self.err = bytearray(), bytearray()
        self._threads = [
            threading.Thread(target=self._pump, args=(s, b), daemon=True)
            for s, b in ((self.p.stdout, self.out), (self.p.stderr, self.err))
        ]
        for t in self._threads:
            t.start()

    @staticmethod
    def _pump(stream, buf: bytearray) -> None:
        for chunk in iter(lambda: stream.read1(4096), b""):
            buf.extend(chunk)

    def wait_for_library(self, name: str, timeout: float = 120.0) -> None:
        """Block until the process has mapped a shared library whose file name holds ``name`` (Linux:
        /proc/PID/maps), e.g. "libtorch" once it is importing torch; fail if it ends first."""
        end = time.monotonic() + timeout
        while time.monotonic() < end and self.p.poll() is None:
            try:
                if name in Path(f"/proc/{self.p.pid}/maps").read_text():
                    return
            except OSError:
                pass
            time.sleep(0.01)
        raise AssertionError(f"{name} was never loaded (exit {self.p.poll()}): {self.text_err()[-2000:]}")

    def wait_for(self, pattern: str, timeout: float = 120.0, stream: str = "err") -> None:
        """Block until ``pattern`` (a regex) shows up on stderr (or stdout); fail if the process ends or
        time runs out."""
        rx = re.compile(pattern.encode())
        buf = self.err if stream == "err" else self.out
        end = time.monotonic() + timeout
        while not rx.search(bytes(buf)):
            if self.p.poll() is not None:
                time.sleep(0.2)  # let the pump threads catch up
                if rx.search(bytes(buf)):
                    return
                raise AssertionError(f"exited ({self.p.returncode}) before {pattern!r}: {self.text_err()[-2000:]}")
            if time.monotonic() > end:
                self.p.kill()
                raise AssertionError(f"no {pattern!r} within {timeout} s: {self.text_err()[-2000:]}")
            time.sleep(0.05)

    def send(self, sig=signal.SIGINT) -> None:
        self.p.send_signal(sig)

    def signal_group(self, sig=signal.SIGINT) -> None:
        os.killpg(self.p.pid, sig)

    def finish(self, timeout: float = 120.0) -> tuple[int, str, str]:
        try:
            rc = self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            raise AssertionError(f"still running {timeout} s later: {self.text_err()[-2000:]}") from None
        for t in self._threads:
            t.join(10)
        return rc, bytes(self.out).decode(errors="replace"), self.text_err()

    def text_err(self) -> str:
        return bytes(self.err).decode(errors="replace")


def python(code: str, *args: str, env: dict | None = None) -> Proc:
    """Run a Python snippet (with tests/ importable) in a subprocess."""
    return Proc([sys.executable, "-c", code, *map(str, args)], env=env)


def last_line(text: str) -> str:
    """The last line as a terminal shows it: tqdm's carriage-return redraws folded away."""
    lines = [ln.split("\r")[-1] for ln in text.strip().splitlines()]
    return lines[-1] if lines else ""
