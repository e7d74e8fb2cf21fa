"""Training Hidden Transfer projections and Medusa heads (§3.3), backbone frozen, on ShareGPT.

Both learn the same thing from the same token chunks: the model's own next-token distribution
``i`` positions further on.  For a chunk ``X_0..X_{N-1}`` the frozen model gives at every position
``j`` the distribution ``P_j`` of ``X_{j+1}``; the drafter's step ``i`` at source ``j`` gives
``Q_{j,i}`` for ``X_{j+i+1}``, and the loss is ``KL(P_{j+i} || Q_{j,i})`` averaged over the sources
with a target (``j + i <= N - 1``) and the steps.  ``init``: start from a weights file's drafter
(same kind, model and shape) instead of a fresh one; the written file's budget adds to that file's.

- Transfer: the chunk runs as a chain with pseudo states for every position, the attention rules
  and positions of decoding (``tree.pseudo_mask``); layers ``[0, t_1)`` run without gradients,
  the rest with gradients into ``W_i`` only.  The real rows of the same pass give ``P`` (detached),
  so training sees exactly what decoding computes.  (The paper trains each step on its own, a step-2
  pseudo state seeing the real state of the position before it; here it sees the step-1 pseudo
  state instead, as it does when decoding.)
- EAGLE head: the same pass's states, unrolled ``steps_ahead`` steps as decoding runs it: step
  ``i`` feeds the head its own step ``i - 1`` output (the real ``z_j`` at step 1) and the data's
  token ``x_{j+i}``, and its state stands for position ``j + i``: the loss is the KL above against
  ``P_{j+i}`` plus a smooth-L1 pull of its normalised state towards the real ``z_{j+i}`` (EAGLE's
  feature regression), averaged over the steps.  It trains from ``state_cache`` as Medusa does.
- Medusa: one no-gradient pass gives the last layer's normalised states ``z`` and ``P``; the heads
  train on ``z``.  With ``state_cache`` (a folder) the last layer's states of each chunk are stored
  the first time the chunk is seen (``train.state_cache``) and read back by every later epoch and
  run, so the backbone runs once per chunk; ``P`` is recomputed from them through the frozen final
  norm and unembedding.  The states are rounded to ``state_dtype`` on the first pass too, so a run
  gives the same weights whether the cache was empty or full.  Hidden Transfer cannot: its pseudo
  states run through the layers above ``t_1``.

Chunks: ShareGPT conversations in the model's chat template, concatenated with EOS between them and
cut into ``seq_len`` tokens; the order is shuffled with ``seed``.  State (weights, Adam moments,
step) is written atomically every ``save_every`` steps and on Ctrl-C to ``<out>.ckpt.safetensors``
(``train.loop``); running again with the same ``out`` resumes.  The final weights go to ``out`` in
bf16, a weights file with the model's fingerprint and the training budget (``drafters.weights``).
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ..drafters import medusa_transfer as drafters, weights
from ..core import tree as tree_mod
from ..errors import LayerleapError
from ..files import check_replace
from . import distributed
from .data import stream_chunks
from .loop import Checkpoint, LoopConfig, Schedule, keeps_callers_rng, tf32_products, train as run_loop
from .state_cache import StateCache, backbone_states, data_hash
from .. import validate as V
from ..core.model import Transformer


class TrainError(LayerleapError, ValueError):
    pass


@dataclass
class TrainConfig:
    kind: str = "transfer"
    layers: list[int] = field(default_factory=lambda: [15, 20, 25])  # transfer: t_i per step
    steps_ahead: int = 3  # medusa: number of heads; eagle: draft steps unrolled
    train_steps: int = 200
    seq_len: int = 128
    batch_size: int = 1  # chunks per step
    lr: float = 1e-3
    warmup: int = 10
    seed: int = 0
    n_conversations: int = 2000
    save_every: int = 20
    grad_clip: float = 1.0
    max_seconds: float | None = None  # stop (and save) after this long, whatever train_steps says
    init: str | None = None  # a weights file of this kind, model and shape to start from (else fresh)
    state_cache: str | None = None  # medusa: a folder for the last layer's states (``train.state_cache``)
    state_dtype: str = "bfloat16"  # the dtype the cached states are stored in
    attention: bool = False  # eagle: EAGLE's attention over the earlier positions (``EagleHead.attention``)


def check_config(cfg: TrainConfig, model: Transformer) -> None:
    """Refuse settings that cannot train on ``model`` (before any data is read)."""
    if cfg.kind not in drafters.KINDS:
        raise TrainError(f"unknown drafter kind {cfg.kind!r}: choose one of {', '.join(drafters.KINDS)}")
    with V.raising(TrainError):
        V.integer(cfg.train_steps, "train_steps", 1)
        V.integer(cfg.seq_len, "seq_len", 4, model.config.max_position, " (the model's context)")
        V.integer(cfg.batch_size, "batch_size", 1)
        V.integer(cfg.steps_ahead, "steps_ahead", 1, 64)
        V.integer(cfg.warmup, "warmup", 0)
        V.integer(cfg.n_conversations, "n_conversations", 1)
        V.integer(cfg.save_every, "save_every", 1)
        V.learning_rate(cfg.lr)
        V.number(cfg.grad_clip, "grad_clip", 0, lo_open=True)
        V.seed(cfg.seed)
        if cfg.max_seconds is not None:
            V.number(cfg.max_seconds, "max_seconds", 0, lo_open=True)
    if cfg.state_cache is not None:
        if cfg.kind == "transfer":
            raise TrainError(
                "--state-cache is for train medusa and train eagle: Hidden Transfer's pseudo states run through the "
                "layers above t_1 at every step, so its projections cannot train from cached states: drop --state-cache"
            )
        if cfg.state_dtype not in ("bfloat16", "float32"):
            raise TrainError(f"state_dtype {cfg.state_dtype!r}: choose bfloat16 or float32")
        if distributed.ranks().world > 1:
            raise TrainError("--state-cache trains in one process: run it without torchrun, or drop --state-cache")
    if cfg.attention and cfg.kind != "eagle":
        raise TrainError(f"--attention is for train eagle, not train {cfg.kind}: drop --attention")
    L = model.config.n_layers
    layers = cfg.layers
    if cfg.kind == "transfer" and (  # before any data is read (the default 15,20,25 fits a 30-layer model)
        not isinstance(layers, (list, tuple))
        or not layers
        or any(isinstance(t, bool) or not isinstance(t, int) or not 1 <= t < L for t in layers)
        or list(layers) != sorted(layers)
    ):
        example = ",".join(str(max(1, min(L - 1, t * L // 30))) for t in (15, 20, 25))
        raise TrainError(
            f"transfer layers must be a non-decreasing list in [1, {L - 1}] on {model.config.name} ({L} layers), one "
            f"per step, got {cfg.layers}: give --layers in that range, e.g. {example}"
        )
    if cfg.seq_len <= _steps(cfg):
        raise TrainError(
            f"seq_len {cfg.seq_len} leaves no target {_steps(cfg)} steps ahead: give --seq-len above {_steps(cfg)}"
        )
    if cfg.init:  # a file of another kind, model or shape is refused before the data is read too
        start_from(_new_drafter(model, cfg), cfg.init)


def _new_drafter(model: Transformer, cfg: TrainConfig) -> drafters._Drafter:
    """A fresh drafter of ``cfg``'s kind and shape."""
    try:
        return drafters.new_drafter(model, cfg.kind, layers=cfg.layers, steps=cfg.steps_ahead, attention=cfg.attention)
    except drafters.DrafterError as e:
        raise TrainError(str(e)) from None


def _steps(cfg: TrainConfig) -> int:
    """How many tokens ahead the drafter predicts (Medusa's heads, Hidden Transfer's layers)."""
    return len(cfg.layers) if cfg.kind == "transfer" else cfg.steps_ahead


def check_chunks(chunks, cfg: TrainConfig) -> None:
    """Refuse token chunks that cannot train (before training): none, ragged, or too short for a
    target ``_steps(cfg)`` tokens ahead."""
    if not isinstance(chunks, list) or not chunks:
        raise TrainError("no token chunks to train on: give a non-empty list of equal-length token-id lists")
    lengths = {len(c) if isinstance(c, (list, tuple)) else -1 for c in chunks}
    if -1 in lengths or len(lengths) > 1:
        raise TrainError(f"token chunks must be lists of one length, got lengths {sorted(lengths)[:5]}")
    (n,) = lengths
    if n <= _steps(cfg):
        raise TrainError(
            f"token chunks of {n} tokens leave no target {_steps(cfg)} steps ahead: give chunks longer than "
            f"{_steps(cfg)} tokens (--seq-len, or --save-chunks with a larger one)"
        )


# -- losses -------------------------------------------------------------------------------------------
def _kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Mean over rows of KL(softmax(teacher) || softmax(student)); both ``[R, V]``."""
    t = F.log_softmax(teacher_logits.float(), -1)
    s = F.log_softmax(student_logits.float(), -1)
    return (t.exp() * (t - s)).sum(-1).mean()


def pairs(n: int, steps: int):
    """(step i, sources j with a target j + i <= n - 1) for i = 1..steps."""
    return [(i, torch.arange(0, n - i)) for i in range(1, steps + 1)]


def transfer_outputs(
    model: Transformer,
    proj: drafters.TransferProjections,
    ids: torch.Tensor,
    steps: int | None = None,
    see_earlier: bool = True,
    trace=None,
):
    """One training pass over ``ids`` ``[B, N]``, each row a chain with pseudo states for every
    position -> (real last-layer states ``[B, N, D]``, pseudo last-layer states ``[B, steps, N, D]``);
    gradients reach ``proj`` only.  ``see_earlier=False``: a pseudo state does not see the earlier
    steps' pseudo states (``tree.pseudo_mask``, the paper's "masked" ablation).  ``trace(layer, h)``,
    if given, is called with the states ``h`` ``[B, S, D]`` after each ``layer`` in ``[t_1, L]``
    (real rows first, then the pseudo states of the steps with ``t_i <= layer``, step-major)."""
    steps = proj.steps if steps is None else steps
    B, N = ids.shape
    chain = tree_mod.chain(N - 1)
    sources = list(range(N))
    mask = tree_mod.pseudo_mask(chain.mask, sources, steps, see_earlier).to(model.device)  # [S, S]
    pos = tree_mod.pseudo_offsets(chain.depths, sources, steps).unsqueeze(0).expand(B, -1).to(model.device)
    bounds = proj.layers[:steps] + [model.config.n_layers]
    with torch.no_grad():
        h = model.run_layers(model.embed(ids.to(model.device)), 0, bounds[0], pos[:, :N])
    layer = bounds[0]
    for i in range(steps):
        h = torch.cat([h, proj.transfer(i + 1, h[:, :N])], dim=1)
        S = h.shape[1]
        end = bounds[i + 1]
        h = _run_traced(model, h, layer, end, pos[:, :S], mask[:S, :S], trace)
        layer = end
    if trace is not None:
        trace(layer, h)
    return h[:, :N], h[:, N:].reshape(B, steps, N, -1)


def _run_traced(model: Transformer, h, start: int, end: int, pos, mask, trace):
    """``model.run_layers`` over ``[start, end)``; with ``trace``, one layer at a time, ``trace(l, h)``
    before layer ``l`` runs (the states after ``l`` layers)."""
    if trace is None:
        return model.run_layers(h, start, end, pos, None, mask)
    for layer in range(start, end):
        trace(layer, h)
        h = model.run_layers(h, layer, layer + 1, pos, None, mask)
    return h


def transfer_loss(model: Transformer, proj: drafters.TransferProjections, ids: torch.Tensor) -> torch.Tensor:
    """``ids`` ``[B, N]`` -> the mean KL over steps and sources with a target."""
    real, pseudo = transfer_outputs(model, proj, ids)
    with torch.no_grad():
        teacher = model.logits(real)  # [B, N, V]
    losses = [
        _kl(teacher[:, j + i].flatten(0, 1), model.logits(pseudo[:, i - 1, j]).flatten(0, 1))
        for i, j in pairs(ids.shape[1], proj.steps)
    ]
    return torch.stack(losses).mean()


@torch.no_grad()
def last_states(model: Transformer, ids: torch.Tensor, last: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The last layer's normalised states ``[B, N, D]`` of ``ids`` ``[B, N]`` and the model's logits
    there ``[B, N, V]``, from ``last`` (the states before the final norm, a ``StateCache``'s) or, without
    it, from a backbone pass."""
    if last is None:
        last = backbone_states(model, ids, [model.config.n_layers])[model.config.n_layers]
    z = model.final_norm(last.to(model.device, model.dtype))
    return z, model.unembed(z)


def medusa_loss(
    model: Transformer, heads: drafters.MedusaHeads, ids: torch.Tensor, last: torch.Tensor | None = None
) -> torch.Tensor:
    """``ids`` ``[B, N]`` -> the mean KL over heads and sources with a target.  ``last``: the last
    layer's states ``[B, N, D]`` of ``ids`` (before the final norm), from a ``StateCache``; without
    it the backbone runs."""
    N = ids.shape[1]
    z, teacher = last_states(model, ids, last)
    losses = [
        _kl(teacher[:, j + i].flatten(0, 1), heads.logits(i, z[:, j]).flatten(0, 1)) for i, j in pairs(N, heads.steps)
    ]
    return torch.stack(losses).mean()


REGRESSION = 1.0  # the weight of the EAGLE head's feature regression beside its KL


def eagle_loss(
    model: Transformer, head: drafters.EagleHead, ids: torch.Tensor, last: torch.Tensor | None = None, steps: int = 3
) -> torch.Tensor:
    """``ids`` ``[B, N]`` -> the mean over ``steps`` unrolled draft steps of the KL to the model's next-token
    distribution and ``REGRESSION`` times the smooth-L1 distance of the head's normalised state to the
    real one (module docstring).  ``last`` as ``medusa_loss``'s."""
    N = ids.shape[1]
    z, teacher = last_states(model, ids, last)
    ids = ids.to(model.device)
    z_in, losses = z, []
    for i in range(1, min(steps, N - 1) + 1):
        n = N - i  # sources j = 0..n-1: the state of position j + i from that of j + i - 1 and token x_{j+i}
        zi = model.final_norm(head.step(z_in[:, :n], ids[:, i:]))  # [B, n, D]
        kl = _kl(teacher[:, i:].flatten(0, 1), model.unembed(zi).flatten(0, 1))
        losses.append(kl + REGRESSION * F.smooth_l1_loss(zi.float(), z[:, i:].float()))
        z_in = zi
    return torch.stack(losses).mean()


def loss_fn(kind: str, steps: int = 3):
    if kind == "eagle":
        return lambda model, head, ids, last=None: eagle_loss(model, head, ids, last, steps)
    return transfer_loss if kind == "transfer" else medusa_loss


# -- training ----------------------------------------------------------------------------------------
def start_from(drafter: drafters._Drafter, path) -> dict:
    """Copy the weights of file ``path`` (``drafter``'s kind, model and shape) into ``drafter``;
    -> the file's metadata, its name under "file" (the budget the written file adds to)."""
    try:
        loaded = drafters.load_drafter(drafter.model, path, drafter.kind)
    except drafters.DrafterError as e:
        raise TrainError(f"--init: {e}") from None
    grows = drafter.kind == "eagle" and drafter.attention and not loaded.attention and loaded.hidden == drafter.hidden
    if loaded.config() != drafter.config() and not grows:
        if drafter.kind == "eagle":
            raise TrainError(
                f"--init {path} holds an EAGLE head {loaded.hidden} wide"
                f"{' with attention' if loaded.attention else ''}, not {drafter.hidden}"
                f"{' with attention' if drafter.attention else ''}: give a head made for this model and shape "
                "(a head without attention may start one with), or train from scratch without --init"
            )
        flag = "--layers" if drafter.kind == "transfer" else "--heads"
        have, want = (",".join(map(str, d.layers)) if d.kind == "transfer" else str(d.steps) for d in (loaded, drafter))
        raise TrainError(
            f"--init {path} holds {drafter.kind} weights for {flag} {have}, not {flag} {want}: "
            f"give {flag} {have}, or train from scratch without --init"
        )
    with torch.no_grad():  # an EAGLE head without attention into one with: the attention starts at zero output
        drafter.load_state_dict(loaded.state_dict(), strict=not grows)
    return {**drafters.read_meta(path), "file": Path(path).name}


def _ckpt_path(out: Path) -> Path:
    return out.with_name(out.name + ".ckpt.safetensors")


# the settings a resumed run must share with its checkpoint (a rerun may change the others)
RESUME_KEYS = (
    "kind",
    "layers",
    "steps_ahead",
    "seq_len",
    "seed",
    "lr",
    "batch_size",
    "init",
    "attention",
    "warmup",
    "grad_clip",
    "state_dtype",
)
LATER_KEYS = ("warmup", "grad_clip", "state_dtype")  # a state whose settings lack one resumes (nothing to compare)
FLAGS = {"layers": "--layers", "seq_len": "--seq-len", "seed": "--seed", "lr": "--lr", "batch_size": "--batch-size"}


def _setting(key: str, value, kind: str) -> str:
    """A resumed setting as the command line gives it (``--heads 3``, no ``--init``), else ``key=value``."""
    if key == "steps_ahead" and kind in ("medusa", "eagle"):
        return f"{'--unroll' if kind == 'eagle' else '--heads'} {value}"
    if key in ("init", "attention"):
        return f"--{key}{f' {value}' if isinstance(value, str) else ''}" if value else f"no --{key}"
    if key in FLAGS:
        return f"{FLAGS[key]} {','.join(map(str, value)) if isinstance(value, list) else value}"
    return f"{key}={value!r}"


def _file_hash(path) -> str:
    """A hash of a file's bytes: the ``--init`` file a checkpoint started from (a few MB)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _checkpoint(out: Path, cfg: TrainConfig, fingerprint: str, data: str, machine: str, init: str = "") -> Checkpoint:
    """The run's checkpoint; a resumed run must share its model, ``RESUME_KEYS`` settings, data
    (``data``: a hash of the token chunks, ``state_cache.data_hash``) and ``--init`` file (``init``: a
    hash of its bytes, ``_file_hash``; the budget the written file adds to is that file's).  Its
    ``meta["machine"]``: the machines of every call, a resumed state's first (``Checkpoint``)."""
    path = _ckpt_path(out)

    def check(meta: dict) -> None:
        if meta.get("fingerprint") != fingerprint:
            raise TrainError(f"checkpoint {path} belongs to another model: delete it or choose another --out")
        saved, now = json.loads(meta["config"]), asdict(cfg)
        for key in RESUME_KEYS:
            if key not in saved and key in LATER_KEYS:
                continue
            if key == "state_dtype" and not (saved.get("state_cache") or now.get("state_cache")):
                continue  # without a state cache the states are not stored, so their dtype shapes nothing
            if saved.get(key) != now.get(key):
                was, asked = (_setting(key, v.get(key), v.get("kind")) for v in (saved, now))
                fix = f"drop {asked}" if was.startswith("no ") else f"give {was}"
                raise TrainError(
                    f"checkpoint {path} was made with {was} (this run: {asked}): {fix} to resume, or delete it to "
                    "start again"
                )
        if meta.get("data", data) != data:
            raise TrainError(
                f"checkpoint {path} was made on other training data (other token chunks): give the same data to "
                "resume, or delete it to start again"
            )
        if meta.get("init_file", init) != init:
            raise TrainError(
                f"checkpoint {path} started from another --init {cfg.init} (the file has changed since): give the "
                "file it started from to resume, or delete the checkpoint to start again"
            )

    meta_out = {"config": json.dumps(asdict(cfg)), "fingerprint": fingerprint, "data": data, "machine": machine}
    if init:
        meta_out["init_file"] = init
    return Checkpoint(path, meta_out, check)


@keeps_callers_rng
def train(
    model: Transformer,
    out,
    cfg: TrainConfig,
    chunks: list[list[int]] | None = None,
    progress: bool = True,
    data: str | None = None,
    command: str | None = None,
) -> dict:
    """Train a drafter of ``cfg.kind``; -> a report (losses, tokens, seconds).  Resumes from ``out``'s
    checkpoint when there is one.  ``data`` and ``command``: what the weights file records as the data
    (default: ShareGPT, or "given chunks") and the command that made it (default: this process's)."""
    out = Path(out)
    check_config(cfg, model)
    with V.raising(TrainError):
        V.weights_file(out, "out")
    check_replace(out, cfg.kind, "out")  # before any work, not when the weights are written
    torch.manual_seed(cfg.seed)
    model.requires_grad_(False)
    drafter = _new_drafter(model, cfg)
    init = start_from(drafter, cfg.init) if cfg.init else None
    drafter.train()
    if chunks is not None and data is None:
        data = "given token chunks"
    if chunks is None:
        tok = model.tokenizer
        if tok is None:
            raise TrainError("training on ShareGPT needs a model with a tokenizer")
        eos = model.config.eos_token_ids[0] if model.config.eos_token_ids else 0
        chunks = stream_chunks(tok, cfg.n_conversations, cfg.seq_len, cfg.seed, eos)
    check_chunks(chunks, cfg)
    params = dict(drafter.named_parameters())
    for p in params.values():
        p.requires_grad_(True)
    lf = loss_fn(cfg.kind, cfg.steps_ahead)
    ranks = distributed.ranks()
    with tf32_products(model.device):
        store = _state_cache(model, cfg, chunks, progress)

    def loss(step: int) -> torch.Tensor:
        idx = [(step * cfg.batch_size + b) % len(chunks) for b in range(cfg.batch_size)]
        mine, weight = ranks.share(idx)  # this process's rows (all of them without torchrun)
        if not mine:
            return torch.zeros((), requires_grad=True)
        ids = torch.tensor([chunks[i] for i in mine], dtype=torch.long)
        if store is not None:
            return weight * lf(model, drafter, ids, store.states(mine)[model.config.n_layers])
        return weight * lf(model, drafter, ids)

    loop = LoopConfig(
        cfg.train_steps,
        Schedule(cfg.lr, cfg.warmup),
        grad_clip=cfg.grad_clip,
        save_every=cfg.save_every,
        max_seconds=cfg.max_seconds,
        loss_digits=5,
        desc=f"train {cfg.kind}",
        progress=progress,
    )
    init_file = _file_hash(cfg.init) if cfg.init else ""
    ckpt = _checkpoint(out, cfg, model.fingerprint, data_hash(chunks), weights.machine(model.device), init_file)
    with tf32_products(model.device):
        run = run_loop(params, loss, loop, ckpt)
    if store is not None and progress:
        print(store.describe(), file=sys.stderr, flush=True)
    n = len(chunks[0])  # the chunks' own length (a caller's chunks may be shorter than cfg.seq_len)
    tokens = run.step * cfg.batch_size * n
    budget = weights.Budget(
        f"{data or weights.SHAREGPT}: {len(chunks)} chunks of {n} tokens",
        tokens,
        run.step,
        run.seconds,
        ckpt.meta["machine"],  # a resumed run's: every call's machine
        command or weights.command_line(),
        init,
    )
    meta = {
        "seq_len": cfg.seq_len,
        "batch_size": cfg.batch_size,
        "lr": cfg.lr,
        "seed": cfg.seed,
        "final_loss": run.losses[-1] if run.losses else None,
    }
    if ranks.main:
        drafters.save_drafter(drafter, out, meta, budget=budget)
    return {
        "out": str(out),
        "losses": run.losses,
        "tokens": tokens,
        "train_steps": run.step,
        "kind": cfg.kind,
        "train_s": run.seconds,
        "seconds_this_run": run.seconds_this_run,
        "resumed_from": run.start,
        **meta,
        "data": budget.data,
        **({"state_cache": str(store.dir), "backbone_chunks": store.computed} if store is not None else {}),
    }


def _state_cache(model: Transformer, cfg: TrainConfig, chunks, progress: bool) -> StateCache | None:
    """The last layer's states of ``chunks`` under ``cfg.state_cache`` (None: the backbone runs every step)."""
    if cfg.state_cache is None:
        return None
    store = StateCache(cfg.state_cache, model, [model.config.n_layers], chunks, getattr(torch, cfg.state_dtype))
    if progress:
        print(store.describe(), file=sys.stderr, flush=True)
    return store


@torch.no_grad()
def eval_loss(model: Transformer, drafter, chunks: list[list[int]]) -> float:
    """Mean training loss of ``drafter`` over ``chunks`` (held out)."""
    lf = loss_fn(drafter.kind)
    return sum(float(lf(model, drafter, torch.tensor([c]))) for c in chunks) / len(chunks)


# -- draft accuracy (the paper's Figure 3 and Figures 5-7) -----------------------------------------
@dataclass
class EarlyExit:
    """The paper's early-exit baseline (Figure 3): LM heads on the state after one intermediate
    ``layer``, head ``i`` (1-based) trained to predict the token ``i + 1`` ahead, i.e. ``i`` tokens
    after the next one (exit heads trained with ``train.exit_heads.ahead_cache``)."""

    layer: int
    heads: list  # [steps] exit heads at ``layer``
    kind = "early-exit"

    @property
    def steps(self) -> int:
        return len(self.heads)


@torch.no_grad()
def step_logits(model: Transformer, drafter, ids: torch.Tensor, see_earlier: bool = True) -> torch.Tensor:
    """Draft logits ``[steps, N, V]`` at every position of one sequence ``ids`` ``[N]``: step ``i`` at
    position ``j`` predicts token ``j + i + 1`` (one pass, as decoding computes it).  ``see_earlier``:
    Hidden Transfer's mask (``transfer_outputs``)."""
    ids = ids.unsqueeze(0)
    if drafter.kind == "transfer":
        _, pseudo = transfer_outputs(model, drafter, ids, see_earlier=see_earlier)
        return model.logits(pseudo[0])
    N = ids.shape[1]
    last = drafter.layer if drafter.kind == "early-exit" else model.config.n_layers
    h = model.run_layers(
        model.embed(ids.to(model.device)), 0, last, torch.arange(N, device=model.device).unsqueeze(0)
    )  # [1, N, D]
    if drafter.kind == "early-exit":
        return torch.stack([head(h)[0] for head in drafter.heads])
    z = model.final_norm(h)[0]
    return torch.stack([drafter.logits(i, z) for i in range(1, drafter.steps + 1)])


@torch.no_grad()
def draft_accuracy(
    model: Transformer, drafter, sequences: list[tuple[int, list[int]]], topk=(1, 3, 5), see_earlier: bool = True
) -> dict:
    """Top-K accuracy per step on greedy text: ``sequences`` are (prompt length, prompt + the model's
    greedy continuation); at every continuation position ``j`` (and the last prompt position), step
    ``i``'s top-K is checked against the greedy token ``j + i + 1``.  -> {step: {K: accuracy, "n": count}}.
    ``see_earlier``: Hidden Transfer's mask (``transfer_outputs``)."""
    hits = {i: {k: 0 for k in topk} for i in range(1, drafter.steps + 1)}
    count = {i: 0 for i in hits}
    for plen, seq in sequences:
        ids = torch.tensor(seq, dtype=torch.long)
        lg = step_logits(model, drafter, ids, see_earlier)  # [steps, N, V]
        top = lg.topk(max(topk), dim=-1).indices.cpu()  # [steps, N, Kmax]
        for i in hits:
            js = torch.arange(plen - 1, max(plen - 1, len(seq) - i - 1))  # none where the text ends too soon
            if js.numel() == 0:
                continue
            want = ids[js + i + 1].unsqueeze(1)
            for k in topk:
                hits[i][k] += int((top[i - 1, js, :k] == want).any(-1).sum())
            count[i] += js.numel()
    return {i: {**{k: hits[i][k] / count[i] if count[i] else None for k in topk}, "n": count[i]} for i in hits}


@torch.no_grad()
def pseudo_cosine(model: Transformer, proj: drafters.TransferProjections, sequences: list[tuple[int, list[int]]]):
    """The paper's Figure 4 on greedy text (``sequences`` as in ``draft_accuracy``): at each layer
    ``l`` from ``t_i`` to the last, the mean cosine similarity of step ``i``'s pseudo state made at
    position ``j`` with the real state of position ``j + i`` (the token it stands for), over the same
    positions ``j`` as ``draft_accuracy``.  Also ``copy``: the cosine of the real state at ``j``
    itself with that of ``j + i`` (what a pseudo state would score if it were a copy of its source).
    -> {"pseudo": {step: {layer: cos}}, "copy": {step: {layer: cos}}, "n": {step: count}}."""
    sums: dict = {"pseudo": {}, "copy": {}}  # key -> step -> layer -> sum of cosines
    count = {i: 0 for i in range(1, proj.steps + 1)}
    for plen, seq in sequences:
        transfer_outputs(
            model, proj, torch.tensor([seq], dtype=torch.long), trace=_cosine_sums(sums, proj, plen, len(seq))
        )
        for i in count:
            count[i] += max(0, len(seq) - i - plen)
    out = {
        key: {i: {lay: v / count[i] for lay, v in sorted(d.items())} for i, d in by.items()} for key, by in sums.items()
    }
    return {**out, "n": count}


def _cosine_sums(sums: dict, proj: drafters.TransferProjections, plen: int, N: int):
    """The ``transfer_outputs`` trace of ``pseudo_cosine`` for one sequence of ``N`` tokens, adding
    into ``sums``."""

    def trace(layer: int, h: torch.Tensor) -> None:
        real = h[0, :N].float()  # [N, D]
        for i in range(1, proj.steps + 1):
            if layer < proj.layers[i - 1] or N - i - plen <= 0:
                continue
            js = torch.arange(plen - 1, N - i - 1)  # sources j with the target j + i
            pseudo = h[0, N + (i - 1) * N + js].float()  # [len(js), D]
            for key, x in (("pseudo", pseudo), ("copy", real[js])):
                by_layer = sums[key].setdefault(i, {})
                by_layer[layer] = by_layer.get(layer, 0.0) + F.cosine_similarity(x, real[js + i], dim=-1).sum().item()

    return trace
