"""Data-parallel training: ``torchrun --nproc-per-node 2 -m layerleap train medusa`` (two CPU
processes, gloo) gives the weights of a one-process run up to the order of the gradient sums, and
only rank 0 writes files."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from safetensors.torch import load_file

from layerleap.cli import main
from layerleap.train.distributed import Ranks


def test_ranks_share_a_batch():
    items = list(range(5))
    assert Ranks(0, 2).share(items) == ([0, 2, 4], 0.6)
    assert Ranks(1, 2).share(items) == ([1, 3], 0.4)
    assert Ranks().share(items) == (items, 1.0) and Ranks().main and not Ranks(1, 2).main


def test_two_processes_equal_one(tmp_path, char_model_dir):
    from safetensors.torch import save_file

    chunks = tmp_path / "chunks.safetensors"
    save_file({"chunks": torch.randint(0, 100, (12, 8), generator=torch.Generator().manual_seed(0))}, str(chunks))
    args = ["train", "medusa", "--model", str(char_model_dir), "--chunks", str(chunks), "--heads", "2"]
    args += ["--steps", "3", "--batch-size", "5", "--seq-len", "8", "--lr", "0.01"]
    one, two = tmp_path / "one" / "m.safetensors", tmp_path / "two" / "m.safetensors"
    assert main(args + ["--threads", "1", "--out", str(one)]) == 0
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(
        run + ["-m", "layerleap"] + args + ["--out", str(two)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    a = load_file(str(one) + ".ckpt.safetensors")  # fp32 weights and optimizer moments
    b = load_file(str(two) + ".ckpt.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6, msg=k)
    assert any(not torch.equal(v, torch.zeros_like(v)) for k, v in a.items() if k.startswith("param."))
    assert sorted(p.name for p in two.parent.iterdir()) == ["m.safetensors", "m.safetensors.ckpt.safetensors"]


def test_only_rank_0_writes_the_chunks(tmp_path, char_model_dir, monkeypatch, capsys):
    from safetensors.torch import save_file

    import layerleap.commands.hidden_transfer as ht

    chunks = tmp_path / "chunks.safetensors"
    save_file({"chunks": torch.randint(0, 100, (4, 8), generator=torch.Generator().manual_seed(0))}, str(chunks))
    args = ["train", "medusa", "--model", str(char_model_dir), "--chunks", str(chunks), "--seq-len", "8"]
    args += ["--threads", "1", "--out", str(tmp_path / "m.safetensors")]
    monkeypatch.setattr(ht, "init_from_env", lambda device: Ranks(1, 2))
    assert main(args + ["--save-chunks", str(tmp_path / "again.safetensors")]) == 0
    assert not (tmp_path / "again.safetensors").exists() and "wrote" not in capsys.readouterr().out
    monkeypatch.setattr(ht, "init_from_env", lambda device: Ranks(0, 2))
    assert main(args + ["--save-chunks", str(tmp_path / "again.safetensors")]) == 0
    assert (tmp_path / "again.safetensors").is_file()
