"""The native extension built for other CPUs' instruction sets (``LAYERLEAP_NATIVE_MARCH``): a CPU runs a
build for fewer instructions than it has, so the AVX2 paths (``x86-64-v3``: AVX2, FMA, no AVX-512) and
the portable ones (``x86-64``) run on an AVX-512 machine too.  Each target's build is compared with the
default build on fixed random inputs (``march_outputs.py``: block products of every width and scale
format, attention (on random shapes, masks and dtypes too), the layers of tiny fp32, bf16 and q4 models):
the block products bit for bit on every build, everything else bit for bit where both builds fuse
multiply-adds, else within float rounding.

Opt-in, a build takes a minute or two: ``LAYERLEAP_TEST_MARCH=x86-64-v3,x86-64`` names the targets
(commas or spaces)
(``make test-march`` runs this and the native tests on each target's build)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import layerleap
from layerleap.core import native
from layerleap.errors import LayerleapError

TARGETS = [t for t in re.split(r"[,\s]+", os.environ.get("LAYERLEAP_TEST_MARCH", "")) if t]

TESTS = Path(__file__).parent
SRC = Path(layerleap.__file__).parents[1]
# what a target's build must hold, where the target says (-march took effect)
KNOWN = {
    "x86-64-v3": ({"avx2", "fma", "f16c"}, {"avx512f", "avx512vnni", "avxvnni"}),
    "x86-64": (set(), {"avx2", "fma", "f16c", "avx512f"}),
}


def _env(march: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "LAYERLEAP_NATIVE_MARCH"}
    if march:
        env["LAYERLEAP_NATIVE_MARCH"] = march
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
    return env


def _outputs(march: str | None, tmp_path: Path) -> dict:
    """march_outputs.py's results under the build for ``march`` (None: the default build)."""
    out = tmp_path / f"{march or 'default'}.pt"
    run = subprocess.run(
        [sys.executable, str(TESTS / "march_outputs.py"), str(out)],
        env=_env(march),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if run.returncode != 0 and march is None and "no native build" in run.stderr:
        pytest.skip("the default native build is missing: run `layerleap native --build`")
    assert run.returncode == 0, run.stderr[-3000:]
    return torch.load(out)


def _expected_paths(features: set[str]) -> list[str]:
    paths = ["avx512-vnni"] if {"avx512f", "avx512bw", "avx512vnni"} <= features else []
    if {"avx2", "f16c", "fma"} <= features:
        paths.append("avx2-vnni" if "avxvnni" in features else "avx2")
    return [*paths, "portable"]


def test_each_target_builds_into_a_folder_of_its_own(monkeypatch):
    """The default build keeps its folder; another target's has a tag of its own (the kernel choices
    remembered per build keep them apart too); a value that is no target is refused."""
    monkeypatch.delenv(native.MARCH_ENV, raising=False)
    default = native.build_dir()
    assert native.march() == "native" and not default.name.endswith("native")
    dirs = {default}
    for target in ("x86-64-v3", "x86-64", "znver4"):
        monkeypatch.setenv(native.MARCH_ENV, target)
        assert native.march() == target and native.build_dir().name.endswith(f"-{target}")
        dirs.add(native.build_dir())
    assert len(dirs) == 4 and len({d.name[:12] for d in dirs}) == 4
    monkeypatch.setenv(native.MARCH_ENV, " ")
    assert native.build_dir() == default
    for bad in ("x86-64 -O0", "-fplugin=x", "a;b", "x" * 80):
        monkeypatch.setenv(native.MARCH_ENV, bad)
        with pytest.raises(LayerleapError, match="LAYERLEAP_NATIVE_MARCH"):
            native.build_dir()


@pytest.mark.skipif(not TARGETS, reason="opt-in: LAYERLEAP_TEST_MARCH=x86-64-v3,x86-64 (builds)")
@pytest.mark.parametrize("target", TARGETS or ["x86-64-v3"])
def test_a_build_for_another_target_gives_the_default_builds_results(target, tmp_path):
    build = subprocess.run(
        [sys.executable, "-m", "layerleap", "native", "--build", "--json"],
        env=_env(target),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert build.returncode == 0, f"-march={target}: {build.stderr[-3000:]}"
    want = _outputs(None, tmp_path)
    got = _outputs(target, tmp_path)
    assert got["build"] != want["build"] and got["build"].endswith(f"-{target}")  # a folder of its own
    features = set(got["features"])
    assert got["paths"] == _expected_paths(features)
    must, must_not = KNOWN.get(target, (set(), set()))
    assert must <= features and not (must_not & features), (target, sorted(features))
    fused_alike = ("fma" in features) == ("fma" in want["features"])
    assert got["tensors"].keys() == want["tensors"].keys()
    differ = []
    for name, w in want["tensors"].items():
        g = got["tensors"][name]
        assert g.dtype == w.dtype and g.shape == w.shape, name
        if torch.equal(g, w):
            continue
        differ.append(name)
        # exact integer sums and std::fma: the same bits on every build
        assert not name.startswith("blocks/"), f"{name}: block products differ on -march={target}"
        assert not fused_alike, f"{name}: differs on -march={target}, both builds fusing multiply-adds"
        # within float rounding: of fp32 sums, and where the result is rounded to bf16 or fp16, of that (a sum a
        # little off can round to the neighbouring value)
        rtol, atol = (1e-3, 1e-4) if w.dtype == torch.float32 else (1e-2, 1e-3)
        torch.testing.assert_close(g.float(), w.float(), rtol=rtol, atol=atol, msg=f"{name} on -march={target}")
    # the comparison compared something: the block products of every format, attention and the layers
    assert sum(n.startswith("blocks/") for n in want["tensors"]) >= 48
    assert sum(n.startswith("attend/random/") for n in want["tensors"]) >= 90
    assert len(differ) < len(want["tensors"])
