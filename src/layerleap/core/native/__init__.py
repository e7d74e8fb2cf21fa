"""The decoder layers in C++ (``decoder.cpp``): the same ATen calls as ``model.py``'s Python path, in
the same order (a few bf16 steps done without ATen, rounded where ATen rounds), so every result is
equal bit for bit; a decoding step spends less time in the Python interpreter (about 3 ms of a
10 ms q4 step on 1 thread, ``docs/BENCHMARKS.md``).

It is compiled once per torch version, CPU and source (``torch.utils.cpp_extension``: a C++
compiler, ninja and torch's headers; about 30 s) by ``layerleap native --build`` (``make install``
runs it), and kept in ``<cache>/native``.  Until it is built, or where it cannot be, the model runs
its Python path; ``LAYERLEAP_NATIVE=0`` turns it off.  Nothing is compiled unasked.  A library cut
short (a build killed while linking, a full disk) counts as not built, and the next build makes it
again; two builds of one folder take turns, and a killed one leaves nothing that stalls the next.
A whole library that does not load (built for another torch or system, say) leaves the Python path
running too; ``status()["error"]`` and ``layerleap native`` say why in one line.

It is compiled for this CPU's instructions (``-march=native``: on a CPU with AVX-512 VNNI its AVX-512
paths, on one with AVX2 and FMA its AVX2 paths, else the portable C++).  ``LAYERLEAP_NATIVE_MARCH``
names another target for GCC's ``-march`` (``x86-64-v3``: the AVX2 paths, ``x86-64``: the portable
ones), kept in a folder of its own, built and used while the variable is set: so the paths of other
CPUs are built and tested on this one (``tests/test_native_march.py``).  A build for instructions this
CPU lacks (``alderlake``'s AVX-VNNI on a CPU without it) is not used: a warning names them, and the
Python path runs.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import operator
import os
import re
import shutil
import sys
import sysconfig
import weakref
from pathlib import Path

import torch

from ...files import cache_root

SOURCE = Path(__file__).with_name("decoder.cpp")
ENV = "LAYERLEAP_NATIVE"  # "0": never use the native layers
MARCH_ENV = "LAYERLEAP_NATIVE_MARCH"  # the compiler's -march target; unset: "native" (this CPU's)
_not_loaded: str | None = None  # why ``module()`` found a whole library it did not load (one line)


def march() -> str:
    """The ``-march`` target the extension is built and loaded for: ``$LAYERLEAP_NATIVE_MARCH`` or native."""
    value = os.environ.get(MARCH_ENV, "").strip() or "native"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}", value):
        from ...errors import LayerleapError

        raise LayerleapError(f"{MARCH_ENV}={value!r} is no -march target (letters, digits, '.', '_', '+', '-')")
    return value


def build_dir(target: str | None = None) -> Path:
    """Where this source, torch version, CPU and -march target's build lives (by default compiled for this
    CPU's instructions, keyed by them too; another target in a folder of its own, with a tag of its own).
    ``target``: that target's (``march()``'s when None)."""
    from ..cpu import cpu_features, cpu_signature

    target = march() if target is None else target
    # this CPU's instructions for a build for them; another target's build runs on any CPU that has its own
    mark = f"|{cpu_features()}" if target == "native" else f"|{target}"
    key = SOURCE.read_bytes() + cpu_signature().encode() + mark.encode()
    tag = hashlib.sha256(key).hexdigest()[:12]
    cap = torch.backends.cpu.get_cpu_capability().lower()
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    suffix = "" if target == "native" else f"-{target}"
    return cache_root() / "native" / f"{tag}-torch{torch.__version__.split('+')[0]}-{cap}-{py}{suffix}"


def _library(folder: Path) -> Path | None:
    hits = sorted(folder.glob("layerleap_decoder*.so"))
    return hits[0] if hits else None


# per ELF class (1: 32-bit, 2: 64-bit): the header's fields after e_version, a program header's fields, and
# where p_offset and p_filesz are among them
_ELF = {1: ("IIIIHHHHHH", "IIIIIIII", (1, 4)), 2: ("QQQIHHHHHH", "IIQQQQQQ", (2, 5))}


def _complete(lib: Path) -> bool:
    """Whether ``lib`` holds every byte its ELF headers name: a link killed half way or a full disk
    leaves a shorter file, and loading one kills the process (SIGBUS) instead of raising.  A file
    that is not ELF where builds are (Linux) counts as broken too; elsewhere only ELF files are checked."""
    import struct

    try:
        with open(lib, "rb") as f:
            data = f.read()
    except OSError:
        return False
    if data[:4] != b"\x7fELF":
        return bool(data) and not sys.platform.startswith("linux")
    if len(data) < 16 or data[4] not in _ELF or data[5] not in (1, 2):
        return False
    head, prog, (at_offset, at_size) = _ELF[data[4]]
    order = "<" if data[5] == 1 else ">"
    try:
        fields = struct.unpack_from(order + "HHI" + head, data, 16)
        _, phoff, shoff, _, _, phentsize, phnum, shentsize, shnum, _ = fields[3:]
        if phoff + phnum * phentsize > len(data) or shoff + shnum * shentsize > len(data):
            return False
        for i in range(phnum):
            ph = struct.unpack_from(order + prog, data, phoff + i * phentsize)
            if ph[at_offset] + ph[at_size] > len(data):
                return False
    except struct.error:
        return False
    return True


@contextlib.contextmanager
def ninja_on_path():
    """torch runs ``ninja`` from PATH: where none is there, the one ``pip install ninja`` (the ``native`` extra)
    put beside this Python, in a virtual environment run without activating it (as the Makefile runs it),
    is put on PATH while the block runs."""
    before = os.environ.get("PATH")
    if not shutil.which("ninja"):
        for folder in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
            if folder and shutil.which("ninja", path=folder):
                os.environ["PATH"] = os.pathsep.join(p for p in (folder, before) if p)
                break
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = before


def build(verbose: bool = False):
    """Compile ``decoder.cpp`` (or find it compiled) and load it; raises on a failed build.  The ``ninja``
    installed beside this Python is found without the environment activated (``ninja_on_path``)."""
    from filelock import FileLock
    from torch.utils.cpp_extension import load

    cxx = os.environ.get("CXX", "").strip() or "c++"  # the compiler torch runs
    if sys.platform != "win32" and shutil.which(cxx.split()[0]) is None:
        from ...errors import LayerleapError

        raise LayerleapError(f"no C++ compiler: {cxx.split()[0]!r} is not on PATH (install g++, or set CXX)")
    folder = build_dir()
    folder.mkdir(parents=True, exist_ok=True)
    # one build of a folder at a time, under a lock the system frees when its holder dies: torch's own
    # lock file ("lock", made with O_EXCL) is then only a killed build's leftover, which would make
    # every later build wait for it forever
    with FileLock(str(folder / "layerleap.lock")):
        (folder / "lock").unlink(missing_ok=True)
        lib = _library(folder)
        if lib is not None and not _complete(lib):  # ninja would take it (and its object file) as built
            for p in [lib, *folder.glob("*.o")]:
                p.unlink(missing_ok=True)
        with ninja_on_path():
            mod = load(
                "layerleap_decoder",
                [str(SOURCE)],
                extra_cflags=["-O3", f"-march={march()}", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(folder),
                verbose=verbose,
            )
    module.cache_clear()
    return mod


@functools.cache
def module():
    """The compiled module if it was built for this source, torch and CPU, else None (never builds).
    Why a whole library was not loaded: ``status()["error"]``."""
    global _not_loaded
    _not_loaded = None
    if os.environ.get(ENV, "").strip() == "0":
        return None
    lib = _library(build_dir()) if SOURCE.is_file() else None
    if lib is None or not _complete(lib):
        return None
    # the module's name is the file's: torch names a second build of one process "layerleap_decoder_v1"
    spec = importlib.util.spec_from_file_location(lib.name.split(".")[0], lib)
    try:
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    except (ImportError, OSError) as e:  # a library for another torch or system, unreadable, ...
        _not_loaded = f"{type(e).__name__}: {_first_line(e).replace(f'{lib}: ', '')}"
        return None
    lacking = _lacking(mod)
    if lacking:  # a target for another CPU (LAYERLEAP_NATIVE_MARCH): its first such instruction would kill the process
        import warnings

        _not_loaded = f"it uses instructions this CPU lacks ({', '.join(lacking)})"
        warnings.warn(
            f"the native layers in {lib.parent.name} use instructions this CPU lacks ({', '.join(lacking)}); "
            "the Python path runs",
            stacklevel=2,
        )
        return None
    return mod


def _first_line(e: Exception) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0][:300] if lines else "no message"


_CPUINFO_NAMES = {"avx512vnni": "avx512_vnni", "avxvnni": "avx_vnni"}  # build_features' names as /proc/cpuinfo's


def _lacking(mod) -> list[str]:
    """The instruction sets ``mod`` was compiled for (``build_features``) that this CPU lacks; none where
    the system does not name them (x86's /proc/cpuinfo does)."""
    from ..cpu import cpu_features

    have = set(cpu_features().split())
    if "sse2" not in have:  # not x86, or no /proc/cpuinfo
        return []
    return [f for f in getattr(mod, "build_features", list)() if _CPUINFO_NAMES.get(f, f) not in have]


def status() -> dict:
    lib = _library(build_dir())
    lib = lib if lib is not None and _complete(lib) else None
    in_use = module() is not None
    return {
        "built": lib is not None,
        "library": str(lib) if lib else None,
        "in_use": in_use,
        "error": _not_loaded if lib is not None and not in_use else None,  # why a built library is not loaded
        "disabled": os.environ.get(ENV, "").strip() == "0",
        "march": march(),
    }


# -- the arguments, made once per model --------------------------------------------------------------
_ARGS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_CHANGES = 0  # how many times a projection's weight or format may have changed (``formats_changed``)


def formats_changed() -> None:
    """Note that a projection's weight, bias or packed format, or a norm's weight, may have changed
    (``model.Linear`` and ``model.RMSNorm`` call it on every such assignment and move): ``layer_args``
    then checks its lists again."""
    global _CHANGES
    _CHANGES += 1


def _projection(lin) -> list[tuple] | None:
    """The entries (kind, a, b, bias, out, in) of a ``model.Linear`` for ``decoder.cpp``'s ``Proj``: one,
    or a stacked weight's own followed by its parts' (``kernels.StackWeight``); None for a format the
    C++ does not know."""
    fmt = lin.packed
    if fmt is None:
        return [(0, lin.weight, torch.empty(0), lin.bias, lin.out_features, lin.in_features)]
    proj = fmt.native_proj()
    if proj is None:
        return None
    return [(*proj, fmt.bias, fmt.out_features, fmt.in_features), *fmt.native_parts()]


_PACKED = operator.attrgetter("packed")


def layer_args(model, start: int, end: int):
    """The per-layer lists ``run_layers`` takes for layers ``[start, end)``, or None when a projection
    holds a format the C++ does not know.  Kept per model and layer range while the formats stay: while
    no projection changed anywhere (``formats_changed``) and the layers are the same, the kept lists
    come back without a look at the 4 projections of every layer (47 us a step on the q4 default,
    where the weights have just swept the caches)."""
    store = _ARGS.setdefault(model, {})
    blocks = tuple(model.layers._modules.values())[start:end]
    quick = store.get(("quick", start, end))
    if quick is not None and quick[0] == _CHANGES and quick[1] == blocks:
        return quick[2]
    changes = _CHANGES
    known = store.get(("linears", start, end))
    if known is None or known[0] != blocks:  # the projections, found once per layer range
        lins = [lin for blk in blocks for lin in (blk.attn.qkv, blk.attn.o, blk.mlp.gate_up, blk.mlp.down)]
        store[("linears", start, end)] = known = (blocks, lins)
    lins = known[1]
    # each projection's format, its packed weight or else its weight parameter, read past nn.Module's
    # attribute lookup (this runs on every call); held, not by id, so that none can be freed and its id reused
    formats = tuple(map(_PACKED, lins))
    if None in formats:
        formats = tuple(p if p is not None else lin._parameters["weight"] for p, lin in zip(formats, lins))
    # and the norms' weights: one assigned anew (``model.RMSNorm`` notes it) is passed anew
    norms = [w for blk in blocks for w in (blk.attn_norm.weight, blk.mlp_norm.weight)]
    formats += tuple(norms)
    held = store.get((start, end))
    if held is None or len(held[0]) != len(formats) or not all(map(operator.is_, held[0], formats)):
        projs = [_projection(lin) for lin in lins]
        args = None
        if all(p is not None for p in projs):
            args = (norms, *map(list, zip(*(entry for p in projs for entry in p))))
        store[(start, end)] = held = (formats, args)
    store[("quick", start, end)] = (changes, blocks, held[1])
    return held[1]


def after_layers(model, end: int) -> list[torch.Tensor]:
    """The LM head's block codes and scales when layers ``[.., end)`` end the model (``run_layers``' ``after``:
    a call run on a team streams part of them into the caches during its last layer), else none."""
    head = model.lm_head.packed
    proj = None if head is None or end != model.config.n_layers else head.native_proj()
    return [head.codes, head.dm] if proj is not None and proj[0] in (3, 4) else []  # BLOCKS, BLOCKS_FINE
