"""Low-rank fine-tunes that the lossy methods' papers assume, written as model variants.

Two objectives, both trained against the base model's own next-token distributions (self-distillation:
the targets are the frozen base model's, on its own greedy answers to ShareGPT prompts,
``data.self_distilled``, and on ShareGPT answers), both training low-rank deltas ``(alpha / r) B A`` on
every decoder layer's projections (``drafters.variants``; ``B`` starts at zero, so step 0 is the base
model).  The base is the same weights with the deltas switched off, so no second copy is held.

- ``skipdecode`` (SkipDecode §3.1): the model runs with the skipping policy on (``train.skipdecode``'s
  ``skip_hidden``: the prompt through every layer, generated position ``n`` through the warm-up layers
  and the top ``b(n) - warmup``); loss KL(base ‖ skipping model) on the answer positions.
- ``calm`` (CALM's backbone training, Schuster et al. 2022 §5): every layer predicts the next token
  through the shared final norm and LM head; loss ``Σ_i w_i KL(base ‖ layer i)`` with ``w_i ∝ i`` over
  the layers ``i >= min_layer`` (CALM's weighted sum, with the base model's distribution as the
  target in place of the one-hot label).  Each step draws ``layers_per_step`` layers with
  probability ``∝ i`` and averages their losses: the same objective in expectation at a fraction of
  the LM-head cost (a 49152-word head costs eight decoder layers).  The last layer's term keeps the
  full model's own predictions where they were.

Both add ``anchor`` × KL(base ‖ variant at full depth) when ``anchor`` > 0: the deltas are merged into
every layer, so a variant trained only on its fast path also rewords the full model's output, which
a quality budget measured against the base model's greedy text then loses (``docs/QUALITY.md``).

The loop (``train.loop``) saves the deltas and AdamW's state every ``save_every`` steps and on
Ctrl-C, and rewrites the variant file each time, so the file is always loadable and its budget
(steps, tokens, seconds) says what it has had; running again resumes, a larger ``steps`` extends (the
same model, settings and examples: another is refused).
"""

from __future__ import annotations

import json
import random
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import validate as V
from ..drafters import variants, weights
from ..errors import LayerleapError
from ..files import check_replace
from ..methods.skipdecode import check_budget_range, target_config
from .loop import Checkpoint, LoopConfig, Schedule, epoch_batch, tf32_products
from .loop import train as run_loop
from .skipdecode import TrainConfig as SkipConfig
from .skipdecode import active_mask, make_batch, skip_hidden
from .state_cache import data_hash

OBJECTIVES = ("skipdecode", "calm")


class VariantTrainError(LayerleapError, ValueError):
    pass


@dataclass
class VariantConfig:
    objective: str = "skipdecode"
    rank: int = 16
    alpha: float = 32.0
    target_speedup: float = 2.0  # skipdecode: Table 2's configuration
    min_exit_layer: int | None = None
    max_exit_layer: int | None = None
    warmup: int | None = None
    min_layer: int = 4  # calm: the lowest layer that learns to predict
    layers_per_step: int = 4  # calm: layers drawn per step
    anchor: float = 0.0  # weight of KL(base ‖ variant at full depth), which keeps the full model's output
    steps: int = 1000
    batch_size: int = 4
    lr: float = 2e-4
    lr_warmup_steps: int = 10
    gen_len: int = 64
    seed: int = 0
    save_every: int = 10
    grad_clip: float = 1.0

    def check(self, n_layers: int) -> VariantConfig:
        if self.objective not in OBJECTIVES:
            raise VariantTrainError(f"unknown objective {self.objective!r}: choose {' or '.join(OBJECTIVES)}")
        with V.raising(VariantTrainError):
            for k in ("rank", "steps", "batch_size", "gen_len", "save_every", "layers_per_step"):
                V.integer(getattr(self, k), k, 1)
            V.integer(self.min_layer, "min_layer", 1, n_layers)
            V.integer(self.lr_warmup_steps, "lr_warmup_steps", 0)
            V.learning_rate(self.lr)
            V.number(self.alpha, "alpha", 0, lo_open=True)
            V.number(self.grad_clip, "grad_clip", 0)
            V.number(self.anchor, "anchor", 0)
            V.seed(self.seed)
        out = VariantConfig(**asdict(self))
        if out.objective == "skipdecode":
            cfg = target_config(n_layers, out.target_speedup)
            out.min_exit_layer = cfg.min_exit_layer if out.min_exit_layer is None else out.min_exit_layer
            out.max_exit_layer = cfg.max_exit_layer if out.max_exit_layer is None else out.max_exit_layer
            out.warmup = cfg.warmup if out.warmup is None else out.warmup
            try:
                check_budget_range(n_layers, out.min_exit_layer, out.max_exit_layer, out.warmup)
            except LayerleapError as e:
                raise VariantTrainError(str(e)) from None
        return out


# -- the deltas -------------------------------------------------------------------------------------
class Deltas:
    """Trainable ``A`` ``[r, in]`` (small random) and ``B`` ``[out, r]`` (zero) for every projection of
    every layer, added to the projections' outputs by forward hooks while ``enabled``."""

    def __init__(self, model, rank: int, alpha: float, seed: int):
        self.rank, self.alpha, self.enabled = rank, alpha, True
        self.layers = list(range(model.config.n_layers))
        g = torch.Generator().manual_seed(seed)
        self.tensors: dict[str, torch.Tensor] = {}
        self._hooks = []
        for layer in self.layers:
            for name in variants.PROJECTIONS:
                lin = variants.projection(model, layer, name)
                ka, kb = variants.delta_names(layer, name)
                dev = lin.weight.device  # drawn on the CPU: the same deltas on every device
                a = torch.randn(rank, lin.in_features, generator=g) / lin.in_features**0.5
                self.tensors[ka] = a.to(dev).requires_grad_(True)
                self.tensors[kb] = torch.zeros(lin.out_features, rank, device=dev, requires_grad=True)
                self._hooks.append(lin.register_forward_hook(self._hook(self.tensors[ka], self.tensors[kb])))

    def _hook(self, a: torch.Tensor, b: torch.Tensor):
        scale = self.alpha / self.rank

        def add(_mod, inputs, out):
            if not self.enabled:
                return out
            return out + scale * F.linear(F.linear(inputs[0], a), b)  # x A^T B^T: [..., out]

        return add

    @contextmanager
    def off(self):
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()

    def build(self) -> dict:
        return {
            "rank": self.rank,
            "alpha": self.alpha,
            "layers": self.layers,
            "projections": list(variants.PROJECTIONS),
        }


# -- objectives -------------------------------------------------------------------------------------
def all_hidden(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Hidden states ``[B, T, D]`` after every layer (causal, no cache)."""
    B, T = ids.shape
    h = model.embed(ids)
    cos, sin = model._rope(torch.arange(T, device=ids.device).unsqueeze(0).expand(B, -1), h.dtype)
    out = []
    for layer, blk in enumerate(model.layers):
        h = blk(h, cos, sin, layer, None, None)
        out.append(h)
    return out


def calm_layers(n_layers: int, min_layer: int, k: int, rng: random.Random) -> list[int]:
    """``k`` layers (1-based: the number of layers run) drawn with probability ``∝ i`` from
    ``[min_layer, n_layers]``."""
    pool = list(range(min_layer, n_layers + 1))
    return rng.choices(pool, weights=pool, k=k)


def _skip_cfg(cfg: VariantConfig, n_layers: int) -> SkipConfig:
    """The policy ``make_batch`` lays out (every layer everywhere for ``calm``)."""
    if cfg.objective == "calm":
        return SkipConfig(min_exit_layer=n_layers, max_exit_layer=n_layers, warmup=0, gen_len=cfg.gen_len)
    return SkipConfig(
        target_speedup=cfg.target_speedup,
        min_exit_layer=cfg.min_exit_layer,
        max_exit_layer=cfg.max_exit_layer,
        warmup=cfg.warmup,
        gen_len=cfg.gen_len,
    )


def objective(model, deltas: Deltas, examples, cfg: VariantConfig):
    """``loss(step)`` for ``train.loop``."""
    d = model.config.n_layers
    pad = model.config.eos_token_ids[0] if model.config.eos_token_ids else 0
    skip = _skip_cfg(cfg, d)

    def loss(step: int) -> torch.Tensor:
        idx = epoch_batch(step, len(examples), cfg.batch_size, cfg.seed).tolist()
        ids, budgets, rows, cols, _ = make_batch(examples, idx, d, skip, 0, pad)
        ids, rows, cols = ids.to(model.device), rows.to(model.device), cols.to(model.device)
        every = torch.ones(d, *ids.shape, dtype=torch.bool)  # [d, B, T]: every layer at every position
        with torch.no_grad(), deltas.off():  # the base model's own next-token distributions: the targets
            th = skip_hidden(model, ids, every)[rows, cols]  # [N, D]
            tlogp = F.log_softmax(model.logits(th.unsqueeze(0))[0], -1)  # [N, V]
        if cfg.objective == "calm":
            hs = all_hidden(model, ids)
            picks = calm_layers(d, cfg.min_layer, cfg.layers_per_step, random.Random(cfg.seed * 100003 + step))
            drawn = sum(_kl(model.logits(hs[i - 1][rows, cols].unsqueeze(0))[0], tlogp) for i in picks) / len(picks)
            return drawn + (
                cfg.anchor * _kl(model.logits(hs[-1][rows, cols].unsqueeze(0))[0], tlogp) if cfg.anchor else 0
            )
        h = skip_hidden(model, ids, active_mask(d, budgets, cfg.warmup))[rows, cols]  # [N, D]
        skipping = _kl(model.logits(h.unsqueeze(0))[0], tlogp)
        if not cfg.anchor:
            return skipping
        full = skip_hidden(model, ids, every)[rows, cols]  # [N, D]
        return skipping + cfg.anchor * _kl(model.logits(full.unsqueeze(0))[0], tlogp)

    return loss


def _kl(logits: torch.Tensor, tlogp: torch.Tensor) -> torch.Tensor:
    """KL(base ‖ model) per position, averaged: ``logits`` ``[N, V]``, ``tlogp`` the base's log-probabilities."""
    return F.kl_div(F.log_softmax(logits, -1), tlogp, log_target=True, reduction="batchmean")


# -- the run ----------------------------------------------------------------------------------------
@dataclass
class VariantResult:
    out: str
    steps_done: int
    resumed_from: int
    losses: list
    seconds: float
    config: dict


def train_variant(
    model,
    out: str | Path,
    cfg: VariantConfig,
    examples,
    data: str,
    command: str | None = None,
    max_seconds: float | None = None,
    progress: bool = True,
) -> VariantResult:
    """Train deltas for ``model`` (left unchanged) on ``examples`` (prompt ids, answer ids); write the
    variant file ``out`` (and its state ``out`` + ``.state.safetensors``; resumed from when present)."""
    out = Path(out)
    cfg = cfg.check(model.config.n_layers)
    check_replace(out, variants.KIND, "out")  # before any work, not when the weights are written
    examples = [(list(p), list(c)[: cfg.gen_len]) for p, c in examples if c]
    if not examples:
        raise VariantTrainError("no training examples (every answer was empty)")
    fingerprint = model.fingerprint  # of the base weights, before anything changes
    model.unpack()
    model.requires_grad_(False)
    deltas = Deltas(model, cfg.rank, cfg.alpha, cfg.seed)
    state = out.with_name(out.name + ".state.safetensors")
    settings = json.dumps(asdict(cfg), sort_keys=True)
    free = {"steps", "save_every"}

    data_key = data_hash([part for p, c in examples for part in (p, c)])

    def check(meta: dict) -> None:
        old = {k: v for k, v in json.loads(meta.get("settings", "{}")).items() if k not in free}
        new = {k: v for k, v in asdict(cfg).items() if k not in free}
        if old != new:
            raise VariantTrainError(f"{state} holds a run with other settings: use another --out or the same settings")
        if meta.get("fingerprint", fingerprint) != fingerprint:
            raise VariantTrainError(f"{state} holds a run of another model: use another --out or the same model")
        if meta.get("data", data_key) != data_key:
            raise VariantTrainError(
                f"{state} holds a run on other training examples: use another --out or the same data to resume"
            )

    n_tokens = sum(len(p) + len(c) for p, c in examples) / len(examples)
    positions = sum(len(c) for _, c in examples) / len(examples)

    def save(step: int, losses: list, seconds: float) -> None:
        budget = weights.Budget(
            data,
            int(positions * cfg.batch_size * step),
            step,
            seconds,  # the loop's training time over all calls, as the state records it
            ckpt.meta["machine"],  # a resumed run's: every call's machine
            command or weights.command_line(),
        )
        extra = {
            "train_config": json.dumps(asdict(cfg)),
            "final_loss": f"{sum(losses[-20:]) / max(1, len(losses[-20:])):.4f}" if losses else None,
            "examples": str(len(examples)),
            "mean_sequence": f"{n_tokens:.1f}",
            "objective": cfg.objective,
        }
        tensors = {k: v.detach().clone() for k, v in deltas.tensors.items()}
        weights.write(
            out, _Fp(model, fingerprint), variants.KIND, deltas.build(), tensors, budget, extra, dtype=torch.bfloat16
        )

    machine = weights.machine(model.device)
    ckpt = Checkpoint(
        state,
        {"settings": settings, "fingerprint": fingerprint, "data": data_key, "machine": machine},
        check,
        weights=True,
        on_save=save,
        what="variant training state",
        fix="delete it (or choose another --out) to start again",
    )
    loop = LoopConfig(
        cfg.steps,
        Schedule(cfg.lr, cfg.lr_warmup_steps),
        0.0,
        (0.9, 0.99),
        cfg.grad_clip,
        cfg.save_every,
        max_seconds=max_seconds,
        loss_digits=5,
        desc=f"finetune variant {cfg.objective}",
        progress=progress,
    )
    model.train()
    try:
        with tf32_products(model.device):  # as the drafter trainers do: fp32 weights, TF32 products
            res = run_loop(dict(deltas.tensors), objective(model, deltas, examples, cfg), loop, ckpt)
    finally:
        model.eval()
        deltas.remove()
    if not out.is_file():  # a finished state resumed after the variant file was removed: no step saved it
        save(res.step, res.losses, res.seconds)
    return VariantResult(str(out), res.step, res.start, res.losses, res.seconds, asdict(cfg))


class _Fp:
    """The model as ``weights.write`` sees it: the base model's fingerprint and name."""

    def __init__(self, model, fingerprint: str):
        self.fingerprint, self.config = fingerprint, model.config


__all__ = [
    "OBJECTIVES",
    "Deltas",
    "VariantConfig",
    "VariantResult",
    "VariantTrainError",
    "all_hidden",
    "calm_layers",
    "train_variant",
]
