"""The CPU this process runs on, as kernel choices and native builds are keyed."""

from __future__ import annotations

import ctypes
import functools
import os
import time
from typing import TypeVar

import torch

T = TypeVar("T")


@functools.cache
def cpu_signature() -> str:
    """The CPU model, its family and model numbers where the kernel gives them (one model name can
    cover generations: an "AMD EPYC" is a Zen 4 at family 25, a Zen 5 at 26) and the ISA torch
    dispatches to, e.g. 'AMD EPYC, family 26 model 2 (AVX512)': kernel choices are made, and native
    builds cached, per signature."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model") and key not in fields:
                    fields[key] = value.strip()
                if not line.strip() and fields:  # the first processor's block ends
                    break
    except OSError:
        pass
    name = fields.get("model name", "unknown CPU")
    if "cpu family" in fields and "model" in fields:
        name += f", family {fields['cpu family']} model {fields['model']}"
    return f"{name} ({torch.backends.cpu.get_cpu_capability()})"


# the x86 flags of instructions a compiler may use (others, such as a kernel's view of the CPU, may
# change with the kernel's version)
_X86_ISA = tuple(
    "avx amx sse ssse3 fma f16c bmi gfni vaes vpclmulqdq sha_ni aes pclmulqdq popcnt abm movbe adx".split()
)


@functools.cache
def cpu_features() -> str:
    """The first processor's instruction-set extensions (``/proc/cpuinfo``'s x86 ``flags`` of vector and
    bit instructions, ``Features`` on Arm), sorted; "" where the system does not say.  A build for this
    CPU's instructions (``-march=native``) is keyed by them beside ``cpu_signature``: one CPU model can
    come with some of its instructions hidden (a virtual machine's), and a build that uses one the CPU
    lacks dies on it (SIGILL)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    return " ".join(sorted(v for v in value.split() if v.startswith(_X86_ISA)))
                if key.strip() == "Features":
                    return " ".join(sorted(value.split()))
    except OSError:
        pass
    return ""


def release_freed_memory() -> None:
    """Hand freed heap memory back to the OS (glibc's ``malloc_trim``; elsewhere nothing): glibc keeps
    the freed temporaries of a load or of a long prompt pass resident otherwise.  About a millisecond."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def released(value: T) -> T:
    """``value``, after ``release_freed_memory``: for loaders whose temporaries (dequantized rows, a
    measured kernel's trials, an index's sort) would otherwise stay resident beside what they made."""
    release_freed_memory()
    return value


def _busy_cpu_seconds() -> float | None:
    """CPU seconds every process on this machine has spent since boot (``/proc/stat``'s first line:
    user, nice, system, irq, softirq and steal time), or None where the system does not say."""
    try:
        with open("/proc/stat", encoding="utf-8") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class OtherLoad:
    """How much of the machine's CPUs other processes used while a ``with`` block ran: ``share`` is
    their CPU seconds (every process's busy time, ``/proc/stat``, less this process's own) over the
    block's wall time times the CPU count, e.g. 0.5 on 2 cores when another job held one core
    throughout.  None where the system does not say (not Linux).  Timings taken at a share above a
    few percent measure the other work too."""

    def __init__(self):
        self.share: float | None = None
        self.seconds: float | None = None  # the other processes' CPU seconds

    def __enter__(self) -> OtherLoad:
        self._busy, self._own, self._wall = _busy_cpu_seconds(), _own_cpu_seconds(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        busy, wall = _busy_cpu_seconds(), time.perf_counter() - self._wall
        if busy is None or self._busy is None or wall <= 0:
            return
        self.seconds = max(0.0, (busy - self._busy) - (_own_cpu_seconds() - self._own))
        self.share = min(1.0, self.seconds / (wall * (os.cpu_count() or 1)))


def _own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


HUGE_PAGE = 1 << 21  # a transparent huge page on x86-64 (2 MB)


class HugePageArena:
    """One anonymous mapping of ``nbytes`` (plus a huge page, for alignment) advised for transparent huge
    pages (Linux's ``madvise(MADV_HUGEPAGE)``), into which ``place`` copies tensors side by side.  A
    product that streams a weight from it misses the TLB once per 2 MB instead of once per 4 KB (a
    one-token call of a 1.5B q4 model about 10% faster on a 2-core Zen 4, ``benchmarks/q4_huge_pages.py``).
    Where the system has no such advice, ``place`` returns the tensor."""

    def __init__(self, nbytes: int):
        import mmap

        self.buf, self.at = None, 0
        advice = getattr(mmap, "MADV_HUGEPAGE", None)
        if advice is None or nbytes <= 0:
            return
        try:
            # private: a shared anonymous mapping is shmem, whose huge pages a separate setting rules
            mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            mm.madvise(advice)
        except (OSError, ValueError):
            return
        buf = torch.frombuffer(mm, dtype=torch.uint8)  # keeps the mapping alive while a view lives
        start = -buf.data_ptr() % HUGE_PAGE
        self.buf, self.at, self.end = buf, start, start + nbytes

    @staticmethod
    def size(t: torch.Tensor | int) -> int:
        """The bytes ``t`` (a tensor or a byte count) takes in an arena (rounded up to a cache line)."""
        n = t if isinstance(t, int) else t.numel() * t.element_size()
        return -(-n // 64) * 64

    def take(self, nbytes: int) -> torch.Tensor | None:
        """The next ``nbytes`` of the arena as a uint8 tensor to fill (None when there is no arena or no room)."""
        if self.buf is None or self.at + self.size(nbytes) > self.end:
            return None
        out = self.buf[self.at : self.at + nbytes]
        self.at += self.size(nbytes)
        return out

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of ``t`` in the arena (``t`` itself when there is no arena or no room)."""
        n = t.numel() * t.element_size()
        room = self.take(n)
        if room is None:
            return t
        out = room.view(t.dtype).view(t.shape)
        if t.is_contiguous() and t.device.type == "cpu":
            # one thread's memmove: torch's copy forks a parallel region per tensor, and on a busy
            # machine each waits for a time slice (a 135M model's 242 tensors: 2.5 s instead of 0.2)
            ctypes.memmove(out.data_ptr(), t.data_ptr(), n)
        else:
            out.copy_(t)
        return out
