"""Building and loading the native layers (``layerleap.core.native``) without a compiler run: a broken
library in the cache is never loaded and is built again, a killed build's lock file does not stall the
next build, a library torch named for a second build of one process loads, and a failed build is one
line that says why."""

from __future__ import annotations

import importlib.util
import struct
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.utils.cpp_extension

from layerleap.cli import main
from layerleap.core import native
from layerleap.errors import LayerleapError


def _elf(filesz: int) -> bytes:
    """A 64-bit little-endian ELF file of 120 bytes (the header and one loadable segment of ``filesz``
    bytes from the start): whole where ``filesz`` is 120 at most, else short of what it names."""
    ident = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    header = struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, 64, 0, 0, 64, 56, 1, 64, 0, 0)
    return ident + header + struct.pack("<IIQQQQQQ", 1, 5, 0, 0, 0, filesz, filesz, 4096)


@pytest.fixture
def cache(monkeypatch, tmp_path) -> Path:
    """An empty cache, this source's build folder in it, nothing loaded yet."""
    monkeypatch.setenv("LAYERLEAP_CACHE", str(tmp_path))
    monkeypatch.delenv(native.ENV, raising=False)
    monkeypatch.delenv(native.MARCH_ENV, raising=False)
    native.module.cache_clear()
    yield native.build_dir()
    native.module.cache_clear()


def _spy_loads(monkeypatch) -> list[str]:
    """The module names ``native.module`` loads a library under (a stand-in module each, nothing run)."""
    names: list[str] = []

    class Loader(importlib.abc.Loader):
        def create_module(self, spec):
            return types.ModuleType(spec.name)

        def exec_module(self, module):
            pass

    def spec(name, location):
        names.append(name)
        return importlib.util.spec_from_loader(name, Loader())

    monkeypatch.setattr(importlib.util, "spec_from_file_location", spec)
    return names


def test_the_check_knows_a_real_library_and_a_truncated_copy(tmp_path):
    real = Path(torch._C.__file__)
    assert native._complete(real)
    short = tmp_path / "layerleap_decoder.so"
    short.write_bytes(real.read_bytes()[: real.stat().st_size // 2])
    assert not native._complete(short)
    assert native._complete(_write(tmp_path / "whole.so", _elf(120)))
    assert not native._complete(_write(tmp_path / "short.so", _elf(4096)))
    if sys.platform.startswith("linux"):
        assert not native._complete(_write(tmp_path / "zeros.so", bytes(4096)))
    assert not native._complete(_write(tmp_path / "empty.so", b""))


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_a_truncated_library_is_neither_loaded_nor_called_built(cache, monkeypatch):
    """Loading a library cut short (a link killed half way, a full disk) kills the process with SIGBUS:
    it counts as not built, and the Python path runs."""
    names = _spy_loads(monkeypatch)
    _write(cache / "layerleap_decoder.so", _elf(4096))
    assert native.module() is None and names == []
    st = native.status()
    assert not st["built"] and st["library"] is None and not st["in_use"]


def test_a_whole_library_that_fails_to_load_says_why(cache, monkeypatch, capsys):
    """A complete library that the loader refuses (another system's, say) leaves the Python path, and
    ``layerleap native`` says why in one line."""
    lib = _write(cache / "layerleap_decoder.so", _elf(120))  # whole, but no shared object to load
    assert native.module() is None
    st = native.status()
    assert st["built"] and not st["in_use"] and st["error"].startswith(("ImportError: ", "OSError: "))
    assert str(lib) not in st["error"]  # the path is printed once, beside the state
    assert main(["native"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith(f"native decoder layers: built, not loaded: {st['error']} (")
    native.module.cache_clear()
    monkeypatch.setenv(native.ENV, "0")
    assert native.status()["error"] is None  # turned off: nothing failed


def test_a_library_of_a_second_build_in_one_process_loads_under_its_own_name(cache, monkeypatch):
    """torch names the library of a second build in one process (another target, another source)
    ``layerleap_decoder_v1``, and its init function after that name."""
    names = _spy_loads(monkeypatch)
    _write(cache / "layerleap_decoder_v1.so", _elf(120))
    mod = native.module()
    assert names == ["layerleap_decoder_v1"] and mod is not None and mod.__name__ == "layerleap_decoder_v1"


def test_a_build_replaces_a_broken_library_and_a_killed_builds_lock(cache, monkeypatch):
    """torch's lock file left by a killed build would make the build wait forever, and ninja would take
    a truncated library (and its object file) as built: both are removed before torch builds."""
    _write(cache / "layerleap_decoder.so", _elf(4096))
    _write(cache / "decoder.o", b"half")
    _write(cache / "lock", b"")
    seen = {}

    def load(name, sources, build_directory, **kw):
        seen["left"] = sorted(p.name for p in Path(build_directory).iterdir() if not p.name.endswith(".lock"))
        return types.ModuleType(name)

    monkeypatch.setenv("CXX", sys.executable)  # a program on PATH: the compiler check passes
    monkeypatch.setattr(torch.utils.cpp_extension, "load", load)
    native.build()
    assert seen["left"] == []


def test_a_build_keeps_a_whole_library(cache, monkeypatch):
    _write(cache / "layerleap_decoder.so", _elf(120))
    seen = {}

    def load(name, sources, build_directory, **kw):
        seen["left"] = sorted(p.name for p in Path(build_directory).iterdir() if not p.name.endswith(".lock"))
        return types.ModuleType(name)

    monkeypatch.setenv("CXX", sys.executable)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", load)
    native.build()
    assert seen["left"] == ["layerleap_decoder.so"]


def test_no_compiler_is_said_so_before_torch_tries(cache, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda *a, **kw: pytest.fail("torch was asked to build"))
    with pytest.raises(LayerleapError, match=r"no C\+\+ compiler: 'c\+\+' is not on PATH"):
        native.build()


TORCH_FAILURE = (
    "Error building extension 'layerleap_decoder': [1/2] c++ -MMD -MF decoder.o.d -DTORCH_EXTENSION_NAME="
    "layerleap_decoder " + "-isystem /some/long/include/path " * 12 + "-c decoder.cpp -o decoder.o \n"
    "FAILED: decoder.o \nc++ -MMD -MF decoder.o.d " + "-isystem /some/long/include/path " * 12 + "\n"
    "decoder.cpp:12:3: error: 'foo' was not declared in this scope\n"
    "ninja: build stopped: subcommand failed.\n"
)


@pytest.mark.parametrize(
    "error, said",
    [
        (RuntimeError(TORCH_FAILURE), "RuntimeError: decoder.cpp:12:3: error: 'foo' was not declared in this scope"),
        (
            RuntimeError(
                TORCH_FAILURE.replace(
                    "decoder.cpp:12:3: error: 'foo' was not declared in this scope", "/bin/sh: 1: c++: not found"
                )
            ),
            "RuntimeError: /bin/sh: 1: c++: not found",
        ),
        (
            RuntimeError("Ninja is required to load C++ extensions"),
            "RuntimeError: Ninja is required to load C++ extensions",
        ),
        (LayerleapError("no C++ compiler: 'c++' is not on PATH"), "(no C++ compiler: 'c++' is not on PATH)"),
    ],
)
def test_a_failed_build_is_one_line_saying_why(monkeypatch, capsys, error, said):
    def build(verbose=False):
        raise error

    monkeypatch.setattr(native, "build", build)
    assert main(["native", "--build"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err and "layerleap keeps running its Python path" in err
    assert err.startswith("layerleap native: error: the native layers could not be built (")


def test_a_build_for_this_cpu_is_keyed_by_its_instructions(cache, monkeypatch):
    """One CPU model can come with instructions hidden (a virtual machine's): a build for this CPU's
    instructions (``-march=native``) made where AVX-512 VNNI was on is not loaded where it is off.  A
    build for a named target runs on any CPU that has the target's instructions."""
    from layerleap.core import cpu

    monkeypatch.setattr(cpu, "cpu_features", lambda: "avx avx2 avx512_vnni avx512f fma")
    with_vnni = native.build_dir()
    monkeypatch.setattr(cpu, "cpu_features", lambda: "avx avx2 avx512f fma")
    assert native.build_dir() != with_vnni
    monkeypatch.setenv(native.MARCH_ENV, "x86-64-v3")
    v3 = native.build_dir()
    monkeypatch.setattr(cpu, "cpu_features", lambda: "avx avx2 avx512_vnni avx512f fma")
    assert native.build_dir() == v3


def test_cpu_features_are_the_instruction_set_flags(monkeypatch):
    import io

    from layerleap.core import cpu

    text = "processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu vme avx2 sse4_2 fma hypervisor avx512_vnni pti\n"
    monkeypatch.setattr(cpu, "open", lambda path, **kw: io.StringIO(text), raising=False)
    assert cpu.cpu_features.__wrapped__() == "avx2 avx512_vnni fma sse4_2"
    arm = "processor\t: 0\nFeatures\t: fp asimd sve2 i8mm\n"
    monkeypatch.setattr(cpu, "open", lambda path, **kw: io.StringIO(arm), raising=False)
    assert cpu.cpu_features.__wrapped__() == "asimd fp i8mm sve2"


def test_a_build_for_instructions_this_cpu_lacks_is_not_used(cache, monkeypatch):
    """A target for another CPU (``LAYERLEAP_NATIVE_MARCH=alderlake`` on a CPU without AVX-VNNI) builds,
    but its block kernel would die on its first VNNI instruction (SIGILL): the Python path runs, with a
    warning that says why."""
    from layerleap.core import cpu

    class Loader(importlib.abc.Loader):
        def create_module(self, spec):
            mod = types.ModuleType(spec.name)
            mod.build_features = lambda: ["avx2", "avxvnni", "fma", "f16c"]
            return mod

        def exec_module(self, module):
            pass

    monkeypatch.setattr(
        importlib.util, "spec_from_file_location", lambda n, p: importlib.util.spec_from_loader(n, Loader())
    )
    monkeypatch.setenv(native.MARCH_ENV, "alderlake")
    _write(native.build_dir() / "layerleap_decoder.so", _elf(120))
    monkeypatch.setattr(cpu, "cpu_features", lambda: "avx avx2 avx512_vnni avx512f f16c fma sse sse2")
    native.module.cache_clear()
    with pytest.warns(UserWarning, match=r"use instructions this CPU lacks \(avxvnni\); the Python path runs"):
        assert native.module() is None
    monkeypatch.setattr(cpu, "cpu_features", lambda: "avx avx2 avx_vnni f16c fma sse sse2")
    native.module.cache_clear()
    assert native.module() is not None
    monkeypatch.setattr(cpu, "cpu_features", lambda: "")  # not x86, or no /proc/cpuinfo: nothing to compare
    native.module.cache_clear()
    assert native.module() is not None
