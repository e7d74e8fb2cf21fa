"""The CPU this process runs on, as kernel choices and native builds are keyed."""

from __future__ import annotations

import functools

import torch


@functools.cache
def cpu_signature() -> str:
    """The CPU model and the ISA torch dispatches to, e.g. 'AMD EPYC (AVX512)': kernel choices are
    made, and cached, per signature."""
    name = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{name} ({torch.backends.cpu.get_cpu_capability()})"


def release_freed_memory() -> None:
    """Hand freed heap memory back to the OS (glibc's ``malloc_trim``; elsewhere nothing): glibc keeps
    the freed temporaries of a load or of a long prompt pass resident otherwise.  About a millisecond."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
