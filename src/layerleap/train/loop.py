"""The training loop every trainer runs: AdamW, a warm-up/decay schedule, gradient clipping,
checkpoint and resume, a progress bar and time records.

A trainer hands the loop its trainable tensors (by name) and its objective, ``loss(step)``: the loss
of step ``step``'s batch.  The trainer picks the batch from the step number, so a resumed run sees
the same data in the same order.  An objective may instead return several losses (one per head, say):
they are back-propagated one at a time, so one graph is alive at once, and recorded as their mean.

The state (the trainable tensors, unless the trainer keeps them itself; AdamW's moments; the step;
every step's loss; the training time) is written atomically to ``Checkpoint.path`` every
``save_every`` steps, when the call ends, and on Ctrl-C or SIGTERM (torchrun, job schedulers and
``timeout`` stop a run with it: in the main thread, where SIGTERM has its default action, it raises
``KeyboardInterrupt`` as Ctrl-C does) -- unless the interrupt came during the optimiser's update,
which leaves half-updated weights; the last saved state stays then.  Calling
again with the same checkpoint resumes from it and gives the weights of an uninterrupted run.  A
step whose loss or gradient norm is not finite (NaN, inf) raises ``DivergedError`` before the
update: the state of the steps before it is saved, never weights made from that step.

Data-parallel (``train.distributed``, under torchrun): the tensors start as rank 0's, each process's
objective returns its share's part of the batch loss, the gradients are summed over the processes
before every update, and only rank 0 writes the state.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from ..errors import LayerleapError
from ..files import reading, save_safetensors
from ..interrupts import terminate_as_interrupt
from . import distributed

FORMAT = "layerleap-train-state-1"


def keeps_callers_rng(fn: Callable) -> Callable:
    """``fn``, a training function that seeds torch's global RNG for its run (``torch.manual_seed(cfg.seed)``:
    the same weights for a seed, on every rank), with the caller's RNG state (the CPU's and every CUDA
    device's in use) put back when it returns or raises."""

    @functools.wraps(fn)
    def keeping(*args, **kwargs):
        devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=devices):
            return fn(*args, **kwargs)

    return keeping


@contextlib.contextmanager
def tf32_products(device) -> Iterator[None]:
    """TF32 matrix products on a CUDA ``device`` inside the block (what the trainers use: fp32 weights, TF32
    products), the caller's setting put back after it; nothing changes on another device.  The setting is
    kept through the API the caller set it with: torch's ``allow_tf32``, or its newer ``fp32_precision``
    (after which torch refuses to read ``allow_tf32``)."""
    if torch.device(device).type != "cuda":
        yield
        return
    matmul = torch.backends.cuda.matmul
    try:
        name, before, on = "allow_tf32", matmul.allow_tf32, True
    except RuntimeError:  # the caller set fp32_precision: torch refuses to mix the two
        name, before, on = "fp32_precision", matmul.fp32_precision, "tf32"
    setattr(matmul, name, on)
    try:
        yield
    finally:
        setattr(matmul, name, before)


class CheckpointError(LayerleapError, ValueError):
    pass


class DivergedError(LayerleapError, ArithmeticError):
    """A step's loss or gradient norm was not finite: the weights of the step before are kept (and saved)."""


@dataclass
class Schedule:
    """The learning rate at each step: linear warm-up over ``warmup`` steps (``lr * (step + 1) /
    warmup``), then constant, or with ``decay`` linear decay to 0 at the last step."""

    lr: float
    warmup: int = 0
    decay: bool = False

    def at(self, step: int, total: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        if not self.decay:
            return self.lr
        return self.lr * max(0.0, (total - step) / max(1, total - self.warmup))


@dataclass
class LoopConfig:
    steps: int  # the run's total steps (the schedule's horizon)
    schedule: Schedule
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 0.0  # 0: none; else the gradient norm of each clip group is clipped to it
    save_every: int = 50
    stop_after: int | None = None  # steps of this call at most
    max_seconds: float | None = None  # this call stops (and saves) after this long
    loss_digits: int | None = None  # recorded losses are rounded to this many digits
    desc: str = "train"
    progress: bool = True


@dataclass
class Checkpoint:
    """Where the state lives and what run it belongs to.  ``meta`` (strings) is written with the
    state; ``check(saved_meta)`` raises when a saved state is another run's.  A ``meta["machine"]`` (the
    machine this call trains on) becomes, on a resume, the machines of every call, the saved state's
    first (``weights.machines``): what the weights file's budget records.  ``weights=False``: the
    trainer saves its weights itself in ``on_save(step, losses, seconds)`` (called before the state is
    written; ``seconds``: the training time over all calls, the state's) and restores them before the
    loop starts."""

    path: Path
    meta: dict = field(default_factory=dict)
    check: Callable[[dict], None] | None = None
    weights: bool = True
    on_save: Callable[[int, list, float], None] | None = None
    what: str = "checkpoint"  # for the error when the file cannot be read
    fix: str = "delete it to start again"


@dataclass
class LoopResult:
    step: int  # steps done over all calls
    start: int  # the step this call began at (resumed from)
    losses: list[float]  # every step's loss over all calls
    seconds: float  # training time over all calls
    seconds_this_run: float


def train(
    params: dict[str, torch.Tensor],
    loss: Callable[[int], torch.Tensor | Iterable[torch.Tensor]],
    cfg: LoopConfig,
    ckpt: Checkpoint | None = None,
    clip_groups: list[list[torch.Tensor]] | None = None,
) -> LoopResult:
    """Train ``params`` (each ``requires_grad``) to lower ``loss``; resume from ``ckpt`` when it holds
    a state.  ``clip_groups``: the tensors whose gradient norm is clipped together (default: all)."""
    with terminate_as_interrupt():  # SIGTERM stops training as Ctrl-C does: the last finished step is saved
        return _train(params, loss, cfg, ckpt, clip_groups)


def _train(params, loss, cfg: LoopConfig, ckpt: Checkpoint | None, clip_groups) -> LoopResult:
    from tqdm import tqdm

    tensors = list(params.values())
    opt = torch.optim.AdamW(tensors, lr=cfg.schedule.lr, weight_decay=cfg.weight_decay, betas=cfg.betas)
    start, losses, prior = load_state(ckpt, params, opt) if ckpt and ckpt.path.is_file() else (0, [], 0.0)
    if start > cfg.steps:
        raise CheckpointError(
            f"{ckpt.what} {ckpt.path} is at step {start}, past the {cfg.steps} steps asked for: give at least "
            f"{start} steps to finish from it, or {ckpt.fix}"
        )
    ranks = distributed.ranks()
    distributed.broadcast(tensors)  # every process starts from rank 0's tensors
    end = cfg.steps if cfg.stop_after is None else min(cfg.steps, start + cfg.stop_after)
    groups = clip_groups or [tensors]
    step, saved, updating, seconds = start, start, False, prior
    bar = tqdm(
        total=cfg.steps,
        initial=start,
        desc=cfg.desc,
        unit="step",
        disable=not cfg.progress or not ranks.main,
        file=sys.stderr,
        dynamic_ncols=True,
    )
    t0 = time.perf_counter()

    def save():
        nonlocal saved
        if ckpt is not None and ranks.main:
            save_state(ckpt, params, opt, step, losses, seconds)
        saved = step

    def out_of_time() -> bool:  # every process stops at the same step
        over = bool(cfg.max_seconds and time.perf_counter() - t0 > cfg.max_seconds)
        return distributed.sum_value(float(over)) > 0 if ranks.world > 1 else over

    try:  # Ctrl-C or SIGTERM: a rerun resumes from the last finished step
        while step < end and not out_of_time():
            for g in opt.param_groups:
                g["lr"] = cfg.schedule.at(step, cfg.steps)
            opt.zero_grad(set_to_none=True)
            with torch.enable_grad():
                value = distributed.sum_value(backward(loss(step)))
            if not math.isfinite(value):  # every process sees the summed value, so all stop here
                raise DivergedError(
                    f"the loss of step {step + 1} is {value}: training diverged; the weights of step {step} are "
                    f"kept{f' in {ckpt.path}' if ckpt is not None else ''}: train again with a lower learning rate"
                )
            distributed.sum_gradients(tensors)
            norm = grad_norm(groups, cfg.grad_clip)  # every process holds the summed gradients: all stop here
            if not math.isfinite(norm):
                raise DivergedError(
                    f"the gradients of step {step + 1} are not finite (norm {norm}; its loss is {value}): training "
                    f"diverged; the weights of step {step} are kept{f' in {ckpt.path}' if ckpt is not None else ''}: "
                    "train again with a lower learning rate"
                )
            updating = True  # an interrupt from here to the bookkeeping's end leaves nothing to save
            opt.step()
            step += 1
            losses.append(round(value, cfg.loss_digits) if cfg.loss_digits is not None else value)
            seconds = prior + time.perf_counter() - t0
            updating = False
            bar.update(1)
            bar.set_postfix(loss=f"{value:.4f}")
            if step % cfg.save_every == 0:
                save()
    except (KeyboardInterrupt, DivergedError):
        if not updating and step > saved:
            save()
        raise
    finally:
        bar.close()
    if step > saved:
        save()
    return LoopResult(step, start, losses, seconds, time.perf_counter() - t0)


def grad_norm(groups: list[list[torch.Tensor]], clip: float) -> float:
    """The largest gradient norm of the groups, each group clipped to ``clip`` first (0: none).  A
    non-finite norm leaves the gradients unusable, never the weights: no update has been made yet."""
    norms = []
    for group in groups:
        grads = [t.grad for t in group if t.grad is not None]
        if not grads:
            continue
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(group, clip))
        else:
            norms.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
    return float(torch.stack(norms).max()) if norms else 0.0


def backward(out: torch.Tensor | Iterable[torch.Tensor]) -> float:
    """Back-propagate one loss, or several one at a time; -> the (mean) loss."""
    parts = [out] if torch.is_tensor(out) else out
    values = []
    for part in parts:
        part.backward()
        values.append(float(part.detach()))
    return sum(values) / len(values)


def epoch_batch(step: int, n: int, batch: int, seed: int) -> torch.Tensor:
    """Indices of step ``step``'s batch when ``n`` items are shuffled afresh every epoch (the order a
    function of the seed and the epoch, so nothing random needs saving)."""
    per_epoch = -(-n // batch)
    epoch, i = divmod(step, per_epoch)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch))
    return perm[i * batch : (i + 1) * batch]


def items_seen(steps: int, n: int, batch: int) -> int:
    """Items the first ``steps`` steps of ``epoch_batch`` draw (repeats counted): a file's tokens."""
    per_epoch = -(-n // batch)
    epochs, rest = divmod(steps, per_epoch)
    return epochs * n + min(n, rest * batch)


# -- the state file --------------------------------------------------------------------------------
def save_state(
    ckpt: Checkpoint,
    params: dict[str, torch.Tensor],
    opt: torch.optim.Optimizer,
    step: int,
    losses: list,
    seconds: float,
) -> None:
    if ckpt.on_save is not None:
        ckpt.on_save(step, losses, seconds)
    tensors = {f"param.{k}": v.detach().clone().contiguous().cpu() for k, v in params.items()} if ckpt.weights else {}
    sd = opt.state_dict()
    for i, st in sd["state"].items():
        for k, v in st.items():
            tensors[f"opt.{i}.{k}"] = (v if torch.is_tensor(v) else torch.tensor(v)).detach().clone().contiguous().cpu()
    meta = {
        **ckpt.meta,
        "format": FORMAT,
        "step": str(step),
        "losses": json.dumps(losses),
        "seconds": repr(float(seconds)),
        "param_groups": json.dumps(sd["param_groups"]),
    }
    save_safetensors(ckpt.path, tensors, meta)


def load_state(
    ckpt: Checkpoint, params: dict[str, torch.Tensor], opt: torch.optim.Optimizer
) -> tuple[int, list, float]:
    """Restore the tensors and the optimiser from ``ckpt``; -> (step, losses, seconds)."""
    from safetensors import safe_open

    with reading(ckpt.path, ckpt.what, ckpt.fix), safe_open(str(ckpt.path), "pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"{ckpt.what} {ckpt.path} was written by another version of layerleap: {ckpt.fix}")
        if ckpt.check is not None:
            ckpt.check(meta)
        if "machine" in ckpt.meta:
            from ..drafters.weights import machines

            ckpt.meta["machine"] = machines(meta.get("machine"), ckpt.meta["machine"])
        if ckpt.weights:
            with torch.no_grad():
                for k, p in params.items():
                    p.copy_(f.get_tensor(f"param.{k}"))
        state: dict = {}
        for key in f.keys():
            if key.startswith("opt."):
                _, i, name = key.split(".", 2)
                state.setdefault(int(i), {})[name] = f.get_tensor(key)
        opt.load_state_dict({"state": state, "param_groups": json.loads(meta["param_groups"])})
        return int(meta["step"]), json.loads(meta["losses"]), float(meta["seconds"])
