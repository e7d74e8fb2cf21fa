"""The training loop every trainer runs: its schedule, a run interrupted at any step and rerun ends
with the weights of an uninterrupted one, the state file refuses another run's state, and the
time and loss records add up over calls."""

from __future__ import annotations

import math

import pytest
import torch

from safetensors.torch import load_file

from layerleap.errors import LayerleapError
from layerleap.train.loop import Checkpoint, LoopConfig, Schedule, epoch_batch, train

TARGET = torch.randn(40, 4, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "schedule, want",
    [
        (Schedule(1.0), [1.0] * 6),
        (Schedule(1.0, warmup=2), [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]),
        (Schedule(1.0, warmup=2, decay=True), [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]),
        (Schedule(1.0, decay=True), [1.0, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6]),
    ],
)
def test_schedule(schedule, want):
    assert [schedule.at(s, 6) for s in range(6)] == pytest.approx(want)


def test_epoch_batches_cover_the_data_once_per_epoch():
    for epoch in range(2):
        seen = torch.cat([epoch_batch(epoch * 3 + s, 10, 4, seed=1) for s in range(3)])
        assert sorted(seen.tolist()) == list(range(10))
    assert not torch.equal(epoch_batch(0, 10, 4, 1), epoch_batch(3, 10, 4, 1))  # a new order each epoch


def _run(path, stop_at=None, steps=9, parts=1, **kw):
    """A linear least-squares fit with ``parts`` losses a step; Ctrl-C in the ``stop_at``-th loss call."""
    w = torch.zeros(4, 4, requires_grad=True)
    calls = [0]

    def loss(step):
        calls[0] += 1
        if calls[0] == stop_at:
            raise KeyboardInterrupt
        idx = epoch_batch(step, len(TARGET), 8, seed=0)
        return [((TARGET[idx] @ w - TARGET[idx]) ** 2).mean() * (i + 1) for i in range(parts)]

    cfg = LoopConfig(steps, Schedule(0.05, warmup=2, decay=True), grad_clip=0.5, save_every=4, progress=False, **kw)
    ck = Checkpoint(path, {"run": "a"}) if path else None
    run = train({"w": w}, (lambda s: loss(s)[0]) if parts == 1 else loss, cfg, ck)
    return w.detach().clone(), run, calls[0]


@pytest.mark.parametrize("stop_at", [1, 3, 5, 8, 9])
@pytest.mark.parametrize("parts", [1, 2])
def test_interrupted_and_rerun_equals_uninterrupted(tmp_path, stop_at, parts):
    full, whole, _ = _run(None, parts=parts)
    path = tmp_path / "state.safetensors"
    with pytest.raises(KeyboardInterrupt):
        _run(path, stop_at=stop_at, parts=parts)
    assert path.is_file() == (stop_at > 1)  # the finished steps were saved on the interrupt
    w, run, calls = _run(path, parts=parts)
    assert run.start == stop_at - 1 and calls == 9 - run.start and run.step == 9
    assert run.losses == whole.losses
    torch.testing.assert_close(w, full, rtol=0, atol=0)
    assert not list(tmp_path.glob(".*tmp*"))


def test_stop_after_max_seconds_and_times(tmp_path):
    path = tmp_path / "s.safetensors"
    _, part, _ = _run(path, stop_after=3)
    assert part.step == 3 and len(part.losses) == 3 and part.seconds > 0
    _, rest, _ = _run(path)
    assert rest.start == 3 and len(rest.losses) == 9 and rest.seconds >= part.seconds
    _, done, calls = _run(path)  # nothing left: no step, the same records
    assert calls == 0 and done.start == done.step == 9 and done.seconds == rest.seconds
    _, timed, _ = _run(tmp_path / "t.safetensors", max_seconds=1e-9)
    assert timed.step == 0 and not (tmp_path / "t.safetensors").exists()  # out of time before the first step


def test_state_belongs_to_its_run(tmp_path):
    path = tmp_path / "s.safetensors"
    _run(path, stop_after=2)

    def refuse(meta):
        if meta["run"] != "b":
            raise LayerleapError("another run")

    with pytest.raises(LayerleapError, match="another run"):
        train(
            {"w": torch.zeros(4, 4, requires_grad=True)},
            lambda s: torch.zeros(()),
            LoopConfig(3, Schedule(0.1), progress=False),
            Checkpoint(path, check=refuse),
        )
    from layerleap.files import save_safetensors

    path.unlink()  # save_safetensors would not replace training state with tensors of no kind
    save_safetensors(path, {"x": torch.zeros(1)}, {"step": "1"})  # a state file of another layout
    with pytest.raises(LayerleapError, match="another version of layerleap: delete it"):
        _run(path)
    path.write_text("garbage")
    with pytest.raises(LayerleapError, match="checkpoint .* cannot be read"):
        _run(path)


def test_a_state_past_the_steps_asked_for_is_refused(tmp_path):
    path = tmp_path / "state.safetensors"
    with pytest.raises(KeyboardInterrupt):
        _run(path, stop_at=8)  # its state saved at step 4 (save_every), then at the interrupt
    with pytest.raises(LayerleapError, match=r"is at step \d+, past the 3 steps asked for"):
        _run(path, steps=3)
    _run(path)  # the steps it was made with finish it


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_loss_that_is_not_finite_stops_the_run_before_the_update(tmp_path, bad):
    from layerleap.train.loop import DivergedError

    path = tmp_path / "state.safetensors"
    w = torch.zeros(4, requires_grad=True)

    def loss(step):
        return ((w - 1) ** 2).sum() * (bad if step == 3 else 1.0)

    cfg = LoopConfig(6, Schedule(0.1), grad_clip=1.0, save_every=2, progress=False)
    with pytest.raises(DivergedError, match=r"loss of step 4 is (nan|inf).*weights of step 3 are kept"):
        train({"w": w}, loss, cfg, Checkpoint(path))
    assert torch.isfinite(w).all()  # the weights of step 3, not made from the bad loss
    kept = w.detach().clone()
    w2 = torch.zeros(4, requires_grad=True)
    run = train(
        {"w": w2}, lambda s: ((w2 - 1) ** 2).sum(), LoopConfig(3, Schedule(0.1), progress=False), Checkpoint(path)
    )
    assert run.start == 3 and len(run.losses) == 3 and all(map(math.isfinite, run.losses))
    torch.testing.assert_close(w2.detach(), kept, rtol=0, atol=0)  # the saved state is the last good step's


@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_finite_loss_with_gradients_that_are_not_stops_the_run_before_the_update(tmp_path, clip):
    from layerleap.train.loop import DivergedError

    path = tmp_path / "state.safetensors"
    w = torch.ones(3, requires_grad=True)

    def loss(step):  # step 3: the loss is 0, its gradient 0.5 / sqrt(0) = inf
        return torch.sqrt(w[0] - w[0].detach()) if step == 2 else ((w - 2) ** 2).sum()

    cfg = LoopConfig(5, Schedule(0.1), grad_clip=clip, save_every=1, progress=False)
    with pytest.raises(DivergedError, match=r"gradients of step 3 are not finite \(norm inf; its loss is 0.0\)"):
        train({"w": w}, loss, cfg, Checkpoint(path))
    assert torch.isfinite(w).all()  # the weights of step 2, not made from the bad gradients
    kept = w.detach().clone()
    w2 = torch.ones(3, requires_grad=True)
    run = train(
        {"w": w2}, lambda s: ((w2 - 2) ** 2).sum(), LoopConfig(2, Schedule(0.1), progress=False), Checkpoint(path)
    )
    assert run.start == 2
    torch.testing.assert_close(w2.detach(), kept, rtol=0, atol=0)  # the saved state is the last good step's


def _global_rng() -> tuple:
    import random

    import numpy as np

    return torch.get_rng_state(), random.getstate(), np.random.get_state()[1].tobytes()


def test_training_leaves_the_callers_global_rng_as_it_was(tmp_path):
    """A training function seeds its own run (the same weights for a seed, whatever came before), and the
    caller's global RNG (torch's, Python's, numpy's) is as it was when the function returns."""
    from tiny_models import random_model

    from layerleap.train import exit_heads, medusa_transfer, skipdecode

    model = random_model("llama-gqa-tied", seed=0)
    vocab = model.config.vocab_size
    seqs = torch.randint(3, vocab, (4, 12), generator=torch.Generator().manual_seed(0)).tolist()
    examples = [(s[:4], s[4:10]) for s in seqs]

    def heads(i: int):
        cfg = exit_heads.HeadTrainConfig(layers=(1,), tokens=1000, epochs=1, batch_tokens=16, init="identity")
        return lambda: exit_heads.train_heads(model, cfg, seqs=seqs, progress=False).heads[1].state_dict()

    def drafter(i: int):
        cfg = medusa_transfer.TrainConfig(kind="medusa", layers=[1], steps_ahead=2, train_steps=2, seq_len=12)
        out = tmp_path / f"m{i}.safetensors"
        return lambda: load_file(medusa_transfer.train(model, out, cfg, chunks=seqs, progress=False)["out"])

    def finetune(i: int):
        student, teacher = random_model("llama-gqa-tied", seed=0), random_model("llama-gqa-tied", seed=0)
        cfg = skipdecode.TrainConfig(min_exit_layer=1, max_exit_layer=2, warmup=1, batch_size=2, steps=1, gen_len=6)

        def run():
            skipdecode.finetune(student, tmp_path / f"s{i}", cfg, examples, teacher, progress=False)
            return student.state_dict()

        return run

    for fn in (heads, drafter, finetune):
        first, run = fn(0)(), fn(1)  # the models are made (and seeded) first
        torch.manual_seed(123)
        before = _global_rng()
        second = run()  # another global state before it: the same run
        after = _global_rng()
        assert torch.equal(before[0], after[0]) and before[1:] == after[1:], fn.__name__
        assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first), fn.__name__


def test_tf32_products_are_on_for_a_cuda_device_inside_the_block_only():
    """A trainer turns TF32 products on for its CUDA run and gives the caller its setting back (also when
    the run raises); on another device nothing changes.  torch's flag reads and sets without a GPU."""
    from layerleap.train.loop import tf32_products

    matmul = torch.backends.cuda.matmul
    for callers in (False, True):
        matmul.allow_tf32 = callers
        try:
            with tf32_products(torch.device("cpu")):
                assert matmul.allow_tf32 is callers
            with pytest.raises(KeyError), tf32_products(torch.device("cuda")):
                assert matmul.allow_tf32 is True
                raise KeyError("the run fails")
            assert matmul.allow_tf32 is callers
        finally:
            matmul.allow_tf32 = False


def test_tf32_products_keep_a_setting_made_through_torchs_newer_api():
    """A caller who set ``fp32_precision`` (torch then refuses to read ``allow_tf32``) gets it back as set."""
    import subprocess
    import sys

    if not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        pytest.skip("this torch has no fp32_precision")
    code = (
        "import torch\n"
        "from layerleap.train.loop import tf32_products\n"
        "m = torch.backends.cuda.matmul\n"
        "m.fp32_precision = 'ieee'\n"
        "with tf32_products(torch.device('cuda')):\n"
        "    assert m.fp32_precision == 'tf32', m.fp32_precision\n"
        "assert m.fp32_precision == 'ieee', m.fp32_precision\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("trainer", ["drafter", "variant"])
def test_a_cuda_training_run_leaves_the_callers_tf32_setting_as_it_was(tmp_path, monkeypatch, trainer):
    """The trainers use TF32 products on CUDA (here: the device check made to say CUDA, on the CPU); when
    they return, the caller's setting is as it was."""
    from tiny_models import random_model

    from layerleap.train import loop, medusa_transfer, variant

    seen = []

    def as_on_cuda(device):
        seen.append(device)
        return loop.tf32_products(torch.device("cuda"))

    model = random_model("llama-gqa-tied", seed=0)
    if trainer == "drafter":
        monkeypatch.setattr(medusa_transfer, "tf32_products", as_on_cuda)
        seqs = torch.randint(3, model.config.vocab_size, (4, 12), generator=torch.Generator().manual_seed(0))
        cfg = medusa_transfer.TrainConfig(kind="medusa", layers=[1], steps_ahead=2, train_steps=2, seq_len=12)
        medusa_transfer.train(model, tmp_path / "m.safetensors", cfg, chunks=seqs.tolist(), progress=False)
    else:
        monkeypatch.setattr(variant, "tf32_products", as_on_cuda)
        cfg = variant.VariantConfig(objective="calm", rank=2, steps=2, batch_size=2, gen_len=4, min_layer=1)
        variant.train_variant(model, tmp_path / "v.safetensors", cfg, [([1, 2, 3], [4, 5, 6])] * 2, "toy")
    assert seen
    assert torch.backends.cuda.matmul.allow_tf32 is False
