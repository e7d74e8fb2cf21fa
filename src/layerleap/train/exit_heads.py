"""Training exit heads (PPD §4.3's "classifier trained for an intermediate layer", a tuned lens).

The backbone stays frozen.  Training has two phases:

1. **Cache.** Text runs through the model once (no grad); the hidden states after every training
   layer and after the last layer are kept, ``[N, D]`` per layer (bf16 in memory and on disk).  All
   layers then train from the same cache, so adding a layer costs only its head's products.
2. **Train.** Each step takes ``batch_tokens`` cached positions; the target is the final layer's own
   next-token distribution at that position, recomputed from the cached final state.  Loss ``kl``
   (default): ``KL(p_final || q_head)``; ``ce``: cross-entropy on the final layer's argmax.  AdamW
   with Appendix A's settings where they carry over (weight decay 0, warm-up ratio 0.04 then linear
   decay, epochs over the data); the learning rate is Appendix A's 2e-5 for the ``full`` kind, 1e-3
   for the ``lens`` kind (a fresh ``D x D`` map trained on ~10^5 tokens, not 3 epochs of ShareGPT).

A ``lens`` starts from a ridge regression of the final state's direction on the layer's state
(``init="lstsq"``, closed form, a few seconds) or from the identity (``init="identity"``: the
shared head).

State (heads, optimiser, step, losses) is written atomically to ``work/state.safetensors`` every
``save_every`` steps and on Ctrl-C (``train.loop``) and the cache to ``work/cache.safetensors`` once
(or, with ``state_cache``, to a ``train.state_cache`` folder that later runs on the same model and
data read instead of running the backbone);
running again with the same ``work`` folder and settings resumes and gives the same heads as an
uninterrupted run (same thread count).  Both files record the hash of the sequences trained on: a resume
on other sequences is refused, and one that gives none (``seqs=None``) trains on the cache's and writes
the state with their hash, so that the next resume is checked the same way.  The data order is a
function of (seed, epoch), so nothing random is carried in the state.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ..files import reading, save_safetensors
from . import distributed
from .data import conversation_seqs
from .loop import Checkpoint, LoopConfig, Schedule, epoch_batch, items_seen, keeps_callers_rng, train
from .state_cache import StateCache, backbone_states, data_hash
from ..drafters import weights
from ..drafters.exit_heads import ExitHead, HeadError, LensHead, new_head, save_heads
from .. import validate as V
from ..core.model import Transformer

CACHE_FILE = "cache.safetensors"
STATE_FILE = "state.safetensors"
TOP_KEY = "final_top"
LOSSES = ("kl", "ce")
INITS = ("lstsq", "identity")
DEFAULT_LR = {"lens": 1e-3, "full": 2e-5}


class TrainHeadsError(HeadError):
    pass


@dataclass
class HeadTrainConfig:
    layers: tuple[int, ...] = (15,)
    kind: str = "lens"
    loss: str = "kl"
    tokens: int = 50_000  # training positions cached
    epochs: int = 2
    batch_tokens: int = 256
    lr: float | None = None  # None: DEFAULT_LR[kind]
    weight_decay: float = 0.0  # Appendix A
    warmup_ratio: float = 0.04  # Appendix A
    grad_clip: float = 1.0
    seq_len: int = 512  # a conversation is cut after this many tokens (and at the model's context: ``check``)
    init: str = "lstsq"
    ridge: float = 1e-2
    lstsq_tokens: int = 50_000  # positions the ridge regression fits
    candidates: int = 16  # per position: the final layer's top-k ids join the step's candidate set (0: full vocabulary)
    negatives: int = 1024  # random vocabulary ids added to each step's candidate set
    seed: int = 0
    save_every: int = 50
    skip_conversations: int = 0  # ShareGPT conversations skipped first (held-out splits)
    data: str = "sharegpt"  # what the positions are: ShareGPT conversations, or a label of the given sequences

    def check(self, model: Transformer) -> "HeadTrainConfig":
        n = model.config.n_layers
        if not self.layers:
            raise TrainHeadsError("no layers to train: give e.g. --layers 10,15,20")
        bad = [x for x in self.layers if isinstance(x, bool) or not isinstance(x, int) or not 1 <= x <= n - 1]
        if bad:
            raise TrainHeadsError(
                f"layers must be integers in [1, {n - 1}] (layer {n} is the final layer, whose "
                f"own head is the target), got {', '.join(map(str, bad))}"
            )
        if len(set(self.layers)) != len(self.layers):
            raise TrainHeadsError(f"layers repeat: {self.layers}")
        if self.kind not in DEFAULT_LR:
            raise TrainHeadsError(f"cannot train head kind {self.kind!r}: choose lens or full (shared has no weights)")
        if self.loss not in LOSSES:
            raise TrainHeadsError(
                f"unknown loss {self.loss!r}: choose kl (the final layer's distribution) or ce (its argmax)"
            )
        if self.init not in INITS:
            raise TrainHeadsError(f"unknown init {self.init!r}: choose {' or '.join(INITS)}")
        V_ = model.config.vocab_size
        with V.raising(TrainHeadsError):
            V.integer(self.candidates, "candidates", 0, V_, " (the vocabulary)")
            V.integer(self.negatives, "negatives", 0, 10_000_000)
            for k in ("tokens", "epochs", "batch_tokens", "seq_len", "save_every", "lstsq_tokens"):
                V.integer(getattr(self, k), k, 1)
            V.integer(self.skip_conversations, "skip_conversations", 0)
            if self.lr is not None:
                V.learning_rate(self.lr)
            V.number(self.warmup_ratio, "warmup_ratio", 0, 1, hi_open=True)
            V.number(self.weight_decay, "weight_decay", 0)
            V.number(self.grad_clip, "grad_clip", 0)
            V.number(self.ridge, "ridge", 0)
            V.seed(self.seed)
        self.seq_len = min(self.seq_len, model.config.max_position)  # no sequence runs past the context
        return self

    @property
    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else DEFAULT_LR[self.kind]

    def steps(self, n_tokens: int) -> int:
        return self.epochs * math.ceil(n_tokens / self.batch_tokens)


@torch.inference_mode()
def cache_hidden(
    model: Transformer, seqs: list[list[int]], layers, progress: bool = True, pass_tokens: int | None = None
) -> dict[int, torch.Tensor]:
    """``{layer: [N, D] bf16}`` for each training layer and the last layer (``n_layers``): the
    hidden state after that layer at every position of every sequence, in the sequences' order.
    Sequences of similar length run together, right-padded, in causal passes of at most
    ``pass_tokens`` padded tokens (none: 32,768 on a GPU, 2,048 on the CPU); a position never sees
    the padding after it, so a batch gives each sequence's own states."""
    from tqdm import tqdm

    n = model.config.n_layers
    want = sorted(set(layers) | {n})
    budget = pass_tokens or (32768 if model.device.type == "cuda" else 2048)
    got: dict[int, dict[int, torch.Tensor]] = {}  # sequence -> layer -> [n_i, D]
    bar = tqdm(
        total=sum(map(len, seqs)),
        desc="cache hidden states",
        unit="tok",
        disable=not progress,
        file=sys.stderr,
        dynamic_ncols=True,
    )
    for batch in _length_batches(seqs, budget):
        T = max(len(seqs[i]) for i in batch)
        ids = torch.zeros(len(batch), T, dtype=torch.long)  # [B, T], right-padded
        for row, i in enumerate(batch):
            ids[row, : len(seqs[i])] = torch.tensor(seqs[i], dtype=torch.long)
        h = backbone_states(model, ids, want)
        for row, i in enumerate(batch):
            # a copy: not an inference tensor
            got[i] = {x: h[x][row, : len(seqs[i])].to(torch.bfloat16, copy=True).cpu() for x in want}
            bar.update(len(seqs[i]))
    bar.close()
    empty = torch.zeros(0, model.config.hidden_size, dtype=torch.bfloat16)
    return {x: torch.cat([got[i][x] for i in range(len(seqs))]) if seqs else empty for x in want}


def _length_batches(seqs: list[list[int]], budget: int) -> list[list[int]]:
    """Indices of ``seqs`` in batches of similar length, each at most ``budget`` padded tokens
    (a longer sequence alone)."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    out: list[list[int]] = []
    for i in order:
        if out and len(seqs[i]) * (len(out[-1]) + 1) <= budget:
            out[-1].append(i)
        else:
            out.append([i])
    return out


@torch.inference_mode()
def final_top_ids(model: Transformer, final: torch.Tensor, k: int, chunk: int = 512) -> torch.Tensor:
    """``[N, k]`` int32: the final layer's top-k token ids at each cached position."""
    rows = (final[i : i + chunk].to(model.device, model.dtype) for i in range(0, len(final), chunk))
    out = [model.logits(x.unsqueeze(0))[0].topk(k, -1).indices.cpu().to(torch.int32) for x in rows]
    return torch.cat(out) if out else torch.zeros(0, k, dtype=torch.int32)


def ahead_cache(cache: dict, lengths: list[int], ahead: int, n_layers: int) -> dict:
    """A ``cache_hidden`` cache (with ``final_top_ids`` under ``TOP_KEY``, if present) of sequences of
    ``lengths`` tokens re-paired so that each intermediate state at position ``j`` faces the final
    state at ``j + ahead`` of the same sequence: heads trained on it predict the token ``ahead``
    positions after the next one (the Hidden Transfer paper's early-exit baseline, Figure 3).
    ``ahead=0`` returns the cache unchanged."""
    if ahead == 0:
        return cache
    if sum(lengths) != len(cache[n_layers]):
        raise TrainHeadsError(f"the lengths sum to {sum(lengths)}, the cache holds {len(cache[n_layers])} positions")
    src, dst, start = [], [], 0
    for n in lengths:
        src.append(torch.arange(start, start + max(0, n - ahead)))  # j with j + ahead in the sequence
        dst.append(src[-1] + ahead)
        start += n
    src, dst = torch.cat(src), torch.cat(dst)
    return {k: v[dst] if k in (n_layers, TOP_KEY) else v[src] for k, v in cache.items()}


# -- lens initialisation ---------------------------------------------------------------------------
def lstsq_init_(head: LensHead, x: torch.Tensor, final: torch.Tensor, ridge: float = 1e-2) -> None:
    """Set the lens so that ``h + W h + b`` fits the direction of the final state (scaled to the
    input's size, since the final norm removes the scale): ridge regression in closed form."""
    x = x.float()
    y = final.float()
    rx = x.pow(2).mean(-1, keepdim=True).sqrt()
    y = y / y.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-6) * rx
    X = torch.cat([x, torch.ones(len(x), 1)], 1)  # [N, D+1]
    A = X.T @ X
    A += ridge * A.diagonal().mean() * torch.eye(len(A))
    sol = torch.linalg.solve(A, X.T @ y)  # [D+1, D]: y ~ X sol
    D = x.shape[1]
    with torch.no_grad():
        head.proj.weight.copy_(sol[:D].T - torch.eye(D))
        head.proj.bias.copy_(sol[D])


# -- losses and evaluation ---------------------------------------------------------------------------
def target_logp(model: Transformer, final: torch.Tensor) -> torch.Tensor:
    """Final-layer log-probabilities ``[N, V]`` from cached final states ``[N, D]``."""
    with torch.no_grad():
        return F.log_softmax(model.logits(final.to(model.device, model.dtype).unsqueeze(0))[0].float(), -1)


def head_loss(
    head: ExitHead, x: torch.Tensor, tlogp: torch.Tensor, loss: str, cand: torch.Tensor | None = None
) -> torch.Tensor:
    """KL(target || head) or CE on the target's argmax; with ``cand`` (vocabulary ids, the target's
    argmax among them) both distributions are renormalised over those ids (a sampled softmax)."""
    x = x.to(head.model.device, head.model.dtype).unsqueeze(0)
    logits = (head(x) if cand is None else head.logits_at(x, cand))[0].float()
    if loss == "ce":
        return F.cross_entropy(logits, tlogp.argmax(-1))
    return F.kl_div(F.log_softmax(logits, -1), tlogp, log_target=True, reduction="batchmean")


def step_candidates(top: torch.Tensor, vocab: int, negatives: int, gen: torch.Generator) -> torch.Tensor:
    """The step's vocabulary subset: every batch position's top ids plus ``negatives`` random ids."""
    neg = torch.randint(0, vocab, (negatives,), generator=gen)
    return torch.unique(torch.cat([top.reshape(-1).long(), neg]))


def target_logp_at(model: Transformer, final: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        hn = model.final_norm(final.to(model.device, model.dtype)).float()
        return F.log_softmax(F.linear(hn, model.head_weight()[cand].float()), -1)


@torch.no_grad()
def agreement(head: ExitHead, x: torch.Tensor, final: torch.Tensor, ks=(1,), chunk: int = 512) -> dict:
    """On cached states: top-k agreement of the head with the final layer's top-1, KL(final || head)
    and the cross-entropy of the head on the final layer's argmax."""
    model = head.model
    hits = {k: 0 for k in ks}
    kl = ce = 0.0
    for i in range(0, len(x), chunk):
        t = target_logp(model, final[i : i + chunk])
        q = F.log_softmax(head(x[i : i + chunk].to(model.device, model.dtype).unsqueeze(0))[0].float(), -1)
        top1 = t.argmax(-1, keepdim=True)
        topk = q.topk(max(ks), -1).indices
        for k in ks:
            hits[k] += int((topk[:, :k] == top1).any(-1).sum())
        kl += float(F.kl_div(q, t, log_target=True, reduction="sum"))
        ce += float(F.nll_loss(q, top1[:, 0], reduction="sum"))
    n = max(1, len(x))
    return {**{f"top{k}": hits[k] / n for k in ks}, "kl": kl / n, "ce": ce / n, "tokens": len(x)}


# -- files ---------------------------------------------------------------------------------------------
def _config_key(cfg: HeadTrainConfig, fingerprint: str) -> str:
    free = ("save_every",)
    return json.dumps(
        {**{k: v for k, v in asdict(cfg).items() if k not in free}, "model": fingerprint}, sort_keys=True, default=list
    )


def _same_data(meta: dict, seqs) -> bool:
    """Whether a cache or state made from the sequences ``meta`` records was made from ``seqs`` (None: the
    caller gives none and takes what the work folder holds)."""
    return seqs is None or meta.get("seqs") == data_hash(seqs)


def _cache_key(cfg: HeadTrainConfig, fingerprint: str) -> str:
    keys = ("layers", "tokens", "seq_len", "skip_conversations", "candidates", "data")
    return json.dumps(
        {**{k: getattr(cfg, k) for k in keys}, "layers": sorted(cfg.layers), "model": fingerprint}, sort_keys=True
    )


def load_or_build_cache(
    model: Transformer,
    cfg: HeadTrainConfig,
    work: Path | None,
    seqs=None,
    progress: bool = True,
    timing: dict | None = None,
    state_cache=None,
) -> dict[int, torch.Tensor]:
    """The hidden-state cache, from ``work`` if it holds one for these settings.  ``timing`` (a dict)
    gets ``"seconds"``: the time it took to build the cache (recorded in the file, so a resumed run
    reports the original build time, not the time to read it back), and ``"seqs"``: the hash of the
    sequences the cache holds (``data_hash``; "" for a cache read back that does not record it).
    ``state_cache``: a folder (``train.state_cache``) that keeps the states for later runs instead of
    ``work``."""
    key = _cache_key(cfg, model.fingerprint)
    path = work / CACHE_FILE if work is not None and state_cache is None else None
    timing = {} if timing is None else timing
    if state_cache is not None:
        return _from_state_cache(model, cfg, seqs, state_cache, progress, timing)
    if path is not None and path.is_file():
        from safetensors import safe_open

        with reading(path, "hidden-state cache"), safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            if meta.get("key") == key and _same_data(meta, seqs):  # a data file that changed builds a new one
                timing["seconds"] = float(meta.get("seconds", 0.0))
                timing["seqs"] = meta.get("seqs", "")
                return {(k if k == TOP_KEY else int(k.removeprefix("layer"))): f.get_tensor(k) for k in f.keys()}
    t0 = time.perf_counter()
    seqs = _sequences(model, cfg, seqs)
    timing["seqs"] = data_hash(seqs)
    cache = cache_hidden(model, seqs, cfg.layers, progress)
    if cfg.candidates:
        cache[TOP_KEY] = final_top_ids(model, cache[model.config.n_layers], cfg.candidates)
    timing["seconds"] = time.perf_counter() - t0
    if path is not None and distributed.ranks().main:
        save_safetensors(
            path,
            {(k if k == TOP_KEY else f"layer{k}"): v for k, v in cache.items()},
            {"key": key, "seconds": repr(timing["seconds"]), "seqs": timing["seqs"]},
        )
    return cache


def _sequences(model: Transformer, cfg: HeadTrainConfig, seqs):
    if seqs is not None:
        return seqs
    if model.tokenizer is None:
        raise TrainHeadsError("the model has no tokenizer: pass token sequences (seqs=)")
    return conversation_seqs(model.tokenizer, cfg.tokens, cfg.seq_len, cfg.skip_conversations)


def _from_state_cache(model: Transformer, cfg: HeadTrainConfig, seqs, root, progress: bool, timing: dict):
    """``load_or_build_cache`` from a ``StateCache`` under ``root``: the backbone runs only for the
    sequences not stored there yet, and the final layer's top ids are stored beside them."""
    t0 = time.perf_counter()
    seqs = _sequences(model, cfg, seqs)
    timing["seqs"] = data_hash(seqs)
    store = StateCache(root, model, [*cfg.layers, model.config.n_layers], seqs)
    if progress:
        print(store.describe(), file=sys.stderr, flush=True)
    cache: dict = store.fill(progress)
    if cfg.candidates:
        final = cache[model.config.n_layers]
        cache[TOP_KEY] = store.derived(
            f"final_top{cfg.candidates}", lambda: final_top_ids(model, final, cfg.candidates)
        )
    timing["seconds"] = time.perf_counter() - t0
    timing["backbone_items"] = store.computed
    return cache


# -- training --------------------------------------------------------------------------------------------
@dataclass
class HeadTrainResult:
    heads: dict[int, ExitHead]
    steps: int
    resumed_from: int
    tokens: int
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0  # training time over all calls (a resumed run adds the earlier calls' time)
    cache_seconds: float = 0.0  # time to build the hidden-state cache (when read back from work: the original build)
    config: dict = field(default_factory=dict)
    machine: str = ""  # the machines of every call, a resumed state's first (""; this one's)


def _objective(model: Transformer, cfg: HeadTrainConfig, cache: dict, heads: list[ExitHead]):
    """``loss(step)``: each head's loss on the step's batch of cached positions, one at a time (a
    ``[B, V]`` graph alive at once)."""
    final = cache[model.config.n_layers]
    ranks = distributed.ranks()

    def loss(step: int):
        batch = epoch_batch(step, len(final), cfg.batch_tokens, cfg.seed)
        idx, weight = batch[ranks.rank :: ranks.world], len(batch[ranks.rank :: ranks.world]) / len(batch)
        if not len(idx):  # no positions for this process this step
            return [torch.zeros((), requires_grad=True)]
        cand = None
        if cfg.candidates:  # the whole batch's candidate set, on every process
            gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
            cand = step_candidates(cache[TOP_KEY][batch], model.config.vocab_size, cfg.negatives, gen)
            tlogp = target_logp_at(model, final[idx], cand.to(model.device))
            cand = cand.to(model.device)
        else:
            tlogp = target_logp(model, final[idx])
        return (weight * head_loss(h, cache[h.layer][idx], tlogp, cfg.loss, cand) for h in heads)

    return loss


def _checkpoint(
    work: Path | None, cfg: HeadTrainConfig, fingerprint: str, data: str = "", given: bool = False, machine: str = ""
) -> Checkpoint | None:
    """The training state in ``work`` of a run on the sequences whose hash is ``data`` (``data_hash``; ""
    where unknown: a cache given, or read back without its hash).  ``given``: the caller gave the
    sequences, and the state must have been made on them; without them a state whose data is known
    must have been made on the sequences trained on.  The state written records ``data``, else the
    resumed state's, so that a resume without sequences keeps the hash for the next resume.  Its
    ``meta["machine"]``: ``machine``, after a resumed state's machines (``Checkpoint``)."""
    if work is None:
        return None
    key = _config_key(cfg, fingerprint)
    made = {"key": key, "seqs": data, "machine": machine}

    def check(meta: dict) -> None:
        saved = meta.get("seqs", "")
        same = saved == data if given else not saved or not data or saved == data
        if meta.get("key") != key or not same:
            raise TrainHeadsError(
                f"{work} holds a run with other settings, data or another model: use another "
                "work folder, or the same settings and data to resume"
            )
        made["seqs"] = data or saved

    return Checkpoint(
        work / STATE_FILE, made, check, what="training state", fix="delete the work folder to start again"
    )


@keeps_callers_rng
def train_heads(
    model: Transformer,
    cfg: HeadTrainConfig,
    work: str | Path | None = None,
    seqs=None,
    progress: bool = True,
    stop_after: int | None = None,
    cache: dict | None = None,
    state_cache=None,
) -> HeadTrainResult:
    """Train one head per layer in ``cfg.layers`` on ``model`` (frozen).  ``seqs``: token id lists
    to train on (default: those of the work folder's cache for these settings, else ShareGPT in the
    chat template).  ``work``: the folder for the cache and
    the resumable state (None: in memory only).  ``stop_after``: stop after this many steps of this
    call (to test resumption).  ``cache``: a hidden-state cache to train on instead (``cache_hidden``
    with ``TOP_KEY`` when ``cfg.candidates``, e.g. from ``ahead_cache``).  ``state_cache``: a folder
    keeping the hidden states for later runs (``train.state_cache``; the work folder then holds the
    training state only)."""
    cfg.check(model)
    model.requires_grad_(False)
    work = Path(work) if work is not None else None
    if work is not None:
        if work.exists() and not work.is_dir():
            raise TrainHeadsError(f"work folder {work} is a file: give a folder")
        work.mkdir(parents=True, exist_ok=True)
    timing: dict = {"seconds": 0.0, "seqs": data_hash(seqs) if seqs is not None else ""}
    if cache is None:
        cache = load_or_build_cache(model, cfg, work, seqs, progress, timing, state_cache)
    final = cache[model.config.n_layers]
    N = len(final)
    total = cfg.steps(N)

    torch.manual_seed(cfg.seed)
    heads = [new_head(model, x, cfg.kind).train() for x in cfg.layers]
    if cfg.kind == "lens" and cfg.init == "lstsq":
        g = torch.Generator().manual_seed(cfg.seed)
        idx = torch.randperm(N, generator=g)[: min(N, cfg.lstsq_tokens)]
        for h in heads:
            lstsq_init_(h, cache[h.layer][idx], final[idx], cfg.ridge)
    warm = max(1, round(cfg.warmup_ratio * total)) if cfg.warmup_ratio > 0 else 0
    loop = LoopConfig(
        total,
        Schedule(cfg.learning_rate, warm, decay=True),
        cfg.weight_decay,
        grad_clip=cfg.grad_clip,
        save_every=cfg.save_every,
        stop_after=stop_after,
        loss_digits=6,
        progress=progress,
        desc=f"train {cfg.kind} heads {','.join(map(str, cfg.layers))}",
    )
    params = {f"{h.layer}.{k}": p for h in heads for k, p in h.named_parameters()}
    machine = weights.machine(model.device)
    ckpt = _checkpoint(work, cfg, model.fingerprint, timing["seqs"], given=seqs is not None, machine=machine)
    run = train(
        params, _objective(model, cfg, cache, heads), loop, ckpt, clip_groups=[list(h.parameters()) for h in heads]
    )
    for h in heads:
        h.eval().requires_grad_(False)
    return HeadTrainResult(
        {h.layer: h for h in heads},
        run.step,
        run.start,
        N,
        run.losses,
        run.seconds,
        timing["seconds"],
        asdict(cfg),
        ckpt.meta["machine"] if ckpt is not None else machine,
    )


def save_trained(
    result: HeadTrainResult,
    path,
    meta: dict | None = None,
    dtype: torch.dtype = torch.float32,
    command: str | None = None,
):
    """Save the result's heads with the training budget and settings in the file's metadata.
    ``command``: the command recorded as the one that made the file (default: this process's)."""
    heads = [result.heads[x] for x in sorted(result.heads)]
    model = heads[0].model
    cfg = result.config
    data = cfg.get("data", "sharegpt")
    budget = weights.Budget(
        f"{weights.SHAREGPT}: {result.tokens} positions of whole conversations, chat template"
        if data == "sharegpt"
        else f"{data}: {result.tokens} positions of prompts and answers, chat template",
        items_seen(result.steps, result.tokens, cfg["batch_tokens"]),
        result.steps,
        result.seconds,
        result.machine or weights.machine(model.device),  # a resumed run's: every call's machine
        command or weights.command_line(),
    )
    info = {
        "positions": result.tokens,
        "epochs": cfg["epochs"],
        "cache_s": round(result.cache_seconds, 1),
        "train_config": json.dumps(cfg, default=list),
        "final_loss": result.losses[-1] if result.losses else None,
    }
    return save_heads(heads, path, meta={**info, **(meta or {})}, dtype=dtype, budget=budget)


__all__ = [
    "HeadTrainConfig",
    "HeadTrainResult",
    "train_heads",
    "save_trained",
    "cache_hidden",
    "agreement",
    "lstsq_init_",
    "ahead_cache",
    "TrainHeadsError",
]
