"""Fine-tuning for SkipDecode: train the model with the skipping policy switched on (the paper's §3.1).

Training runs the same policy as ``generate(method="skipdecode")``: every prompt position runs all
layers; the token at generated position ``n`` runs the ``warmup`` bottom layers and the top
``b(n) - warmup`` layers.  Because budgets never rise, the positions that run a layer form a prefix
of the sequence, so one layer is applied to the prefix ``h[:, :n_l]`` with causal attention and the
other positions carry their hidden state through unchanged -- exactly what decoding with the KV
cache computes (tested: ``skip_logits`` equals the decoder's logits).

Loss (``loss="kd"``, default): KL(base model ‖ skipping model) on the completion positions, the base
model being the frozen full-depth copy.  Quality is measured against the base model's greedy output,
so matching its distribution is the direct target; ``loss="ce"`` is the paper's cross-entropy on the
reference completion (ShareGPT's answer here).  The embedding/LM head (tied) and the final norm
stay frozen; the decoder blocks train.

``policy_prompt``: ``"own"`` starts the decay at each example's own prompt length (what decoding
does); ``"median"`` uses the median prompt length for every example (the paper's choice).

State (model folder plus optimiser and position) is written atomically every ``save_every`` steps and
on Ctrl-C (``train.loop``); running again with the same ``out`` resumes from it (the same base model,
settings and examples: another is refused).  Deterministic for
a seed (data order, initial state), up to float reduction order across thread counts.
"""

from __future__ import annotations

import json
import os
import random
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import validate as V
from ..errors import LayerleapError
from ..files import reading, save_safetensors, write_json
from .data import prompt_completions
from .loop import Checkpoint, LoopConfig, Schedule, keeps_callers_rng, train as run_loop
from .state_cache import data_hash
from ..methods.skipdecode import budget_at, check_budget_range, exit_layers, layer_ranges, target_config
from ..core.model import Transformer

STATE_JSON = "skipdecode_train.json"
# the loop's state; a subfolder: the loader reads every *.safetensors beside config.json
OPT_FILE = "train_state/optimizer.safetensors"
WEIGHTS = "model.safetensors"


class FinetuneError(LayerleapError, ValueError):
    pass


@dataclass
class TrainConfig:
    target_speedup: float = 2.0
    min_exit_layer: int | None = None  # None: Table 2's configuration for target_speedup
    max_exit_layer: int | None = None
    warmup: int | None = None
    steps: int = 30
    batch_size: int = 4
    lr: float = 5e-5
    weight_decay: float = 0.0
    lr_warmup_steps: int = 3
    gen_len: int = 64  # completion tokens per example = the decay horizon (generate's max_new_tokens)
    max_prompt: int = 96  # longer prompts are skipped
    loss: str = "kd"
    policy_prompt: str = "own"
    seed: int = 0
    n_examples: int = 512  # ShareGPT conversations read
    save_every: int = 10
    grad_clip: float = 1.0

    def resolve(self, n_layers: int) -> "TrainConfig":
        cfg = target_config(n_layers, self.target_speedup)
        out = TrainConfig(**asdict(self))
        # as decoding does: an exit layer given alone takes the other from the target, within the one given
        out.min_exit_layer, out.max_exit_layer = exit_layers(
            n_layers, self.min_exit_layer, self.max_exit_layer, self.target_speedup
        )
        out.warmup = cfg.warmup if self.warmup is None else self.warmup
        try:
            check_budget_range(n_layers, out.min_exit_layer, out.max_exit_layer, out.warmup)
        except LayerleapError as e:
            raise FinetuneError(str(e)) from None
        if out.loss not in ("kd", "ce"):
            raise FinetuneError(f"unknown loss {out.loss!r}: choose kd (match the base model) or ce (reference text)")
        if out.policy_prompt not in ("own", "median"):
            raise FinetuneError(f"unknown policy_prompt {out.policy_prompt!r}: choose own or median")
        with V.raising(FinetuneError):
            for k in ("steps", "batch_size", "gen_len", "max_prompt", "save_every", "n_examples"):
                V.integer(getattr(out, k), k, 1)
            V.integer(out.lr_warmup_steps, "lr_warmup_steps", 0)
            V.learning_rate(out.lr)
            V.number(out.weight_decay, "weight_decay", 0)
            V.number(out.grad_clip, "grad_clip", 0)
            V.seed(out.seed)
        return out


# -- the skipping forward pass -------------------------------------------------------------------
def position_budgets(n_layers: int, length: int, prompt_len: int, cfg: TrainConfig) -> list[int]:
    """Layers run at each position of a sequence: all for the prompt, the decaying budget after."""
    return [
        n_layers if t < prompt_len else budget_at(t - prompt_len, cfg.gen_len, cfg.min_exit_layer, cfg.max_exit_layer)
        for t in range(length)
    ]


def active_mask(n_layers: int, budgets: torch.Tensor, warmup: int) -> torch.Tensor:
    """``budgets`` ``[B, T]`` -> bool ``[n_layers, B, T]``: which positions run which layer."""
    act = torch.zeros(n_layers, *budgets.shape, dtype=torch.bool)
    for b in range(budgets.shape[0]):
        for t, bud in enumerate(budgets[b].tolist()):
            for s, e in layer_ranges(n_layers, int(bud), warmup):
                act[s:e, b, t] = True
    return act


def skip_hidden(model: Transformer, ids: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """Final hidden states ``[B, T, D]`` with layer ``l`` applied only where ``active[l]``.  The active
    positions of a layer must be a prefix of each row (monotone budgets)."""
    B, T = ids.shape
    h = model.embed(ids)
    pos = torch.arange(T, device=ids.device).unsqueeze(0).expand(B, -1)
    cos, sin = model._rope(pos, h.dtype)
    for layer, blk in enumerate(model.layers):
        act = active[layer].to(h.device)
        cols = act.any(0).nonzero()
        if len(cols) == 0:
            continue
        n = int(cols.max()) + 1
        out = blk(h[:, :n], cos[:, :n], sin[:, :n], layer, None, None)  # causal attention over the prefix
        h = torch.cat([torch.where(act[:, :n, None], out, h[:, :n]), h[:, n:]], 1)
    return h


def skip_logits(model: Transformer, ids: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    return model.logits(skip_hidden(model, ids, active))


def make_batch(examples, idx: list[int], n_layers: int, cfg: TrainConfig, median: int, pad_id: int):
    """Right-padded ids ``[B, T]``, active mask, and the (row, position) pairs that carry a loss with their
    target ids."""
    seqs = [examples[i][0] + examples[i][1] for i in idx]
    T = max(len(s) for s in seqs)
    ids = torch.full((len(idx), T), pad_id, dtype=torch.long)
    budgets = torch.full((len(idx), T), n_layers, dtype=torch.long)
    rows, cols, tgt = [], [], []
    for r, i in enumerate(idx):
        p, c = examples[i]
        s = p + c
        ids[r, : len(s)] = torch.tensor(s)
        start = len(p) if cfg.policy_prompt == "own" else median
        budgets[r] = torch.tensor(position_budgets(n_layers, T, start, cfg))
        for t in range(len(p) - 1, len(s) - 1):  # position t predicts token t+1 of the completion
            rows.append(r)
            cols.append(t)
            tgt.append(s[t + 1])
    return ids, budgets, torch.tensor(rows), torch.tensor(cols), torch.tensor(tgt)


# -- saving --------------------------------------------------------------------------------------
def save_model(model: Transformer, folder: Path, meta: dict | None = None) -> None:
    """A Hugging Face folder loadable by ``layerleap.load(folder)``: config.json, safetensors weights,
    the tokenizer; each file written atomically."""
    from ..core.loading import ours_to_hf

    folder.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().clone().contiguous() for k, v in ours_to_hf(model).items()}  # fused q/k/v share storage
    save_safetensors(folder / WEIGHTS, sd, {"format": "pt", **(meta or {})})
    write_json(folder / "config.json", model.config.to_hf())
    if model.tokenizer is not None and not (folder / "tokenizer_config.json").is_file():
        tmp = folder / f".tok.tmp{os.getpid()}"
        model.tokenizer.save_pretrained(tmp)
        for f in tmp.iterdir():
            os.replace(f, folder / f.name)
        tmp.rmdir()


# -- training ------------------------------------------------------------------------------------
@dataclass
class TrainResult:
    out: str
    steps_done: int
    resumed_from: int
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    config: dict = field(default_factory=dict)


def _trainable(model: Transformer) -> list[torch.nn.Parameter]:
    model.requires_grad_(False)
    params = [p for blk in model.layers for p in blk.parameters()]
    for p in params:
        p.requires_grad_(True)
    return params


@keeps_callers_rng
def finetune(
    model: Transformer,
    out: str | Path,
    cfg: TrainConfig,
    examples=None,
    teacher: Transformer | None = None,
    progress: bool = True,
    base_name: str | None = None,
) -> TrainResult:
    """Train ``model`` in place with the skipping policy; write the model folder ``out`` (resuming from
    the state there when its configuration matches)."""
    out = Path(out)
    d = model.config.n_layers
    cfg = cfg.resolve(d)
    model.unpack()  # packed kernel formats carry no gradient: train dense parameters
    if out.exists() and not out.is_dir():
        raise FinetuneError(f"{out} is a file: give a folder for the fine-tuned model")
    state_file = out / STATE_JSON
    if model.source and out.resolve() == Path(model.source).resolve():
        raise FinetuneError(
            f"{out} is the model's own folder: write the fine-tuned model to a new folder (rerun with "
            "the same --out to resume)"
        )
    if out.is_dir() and any(out.iterdir()) and not state_file.is_file():
        raise FinetuneError(f"{out} holds other files, not a fine-tuning run: choose a new folder")
    ctx = model.config.max_position
    if cfg.max_prompt + cfg.gen_len > ctx:
        raise FinetuneError(
            f"max_prompt {cfg.max_prompt} + gen_len {cfg.gen_len} tokens exceed the model's context of "
            f"{ctx}: lower --max-prompt or --gen-len"
        )
    base_fp = model.fingerprint  # of the base weights, before a resumed run's are loaded
    start_step = _restore(model, out, cfg, base_fp) if state_file.is_file() else 0
    if cfg.loss == "kd" and teacher is None:
        raise FinetuneError("loss kd needs the base model as teacher")
    tok = model.tokenizer
    if examples is None:
        if tok is None:
            raise FinetuneError("the model has no tokenizer: pass examples (prompt ids, completion ids)")
        examples = prompt_completions(tok, cfg.n_examples, cfg.max_prompt, cfg.gen_len)
    examples = [(list(p), list(c)[: cfg.gen_len]) for p, c in examples]
    data = data_hash([part for p, c in examples for part in (p, c)])
    if start_step and json.loads(state_file.read_text(encoding="utf-8")).get("data", data) != data:
        raise FinetuneError(
            f"{out} holds a run on other training examples: use another --out, or the same data to resume"
        )
    median = int(statistics.median(len(p) for p, _ in examples))
    pad_id = model.config.eos_token_ids[0] if model.config.eos_token_ids else 0

    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    order: list[int] = []
    while len(order) < cfg.steps * cfg.batch_size:
        perm = list(range(len(examples)))
        rng.shuffle(perm)
        order += perm

    params = _trainable(model)

    def loss(step: int) -> torch.Tensor:
        idx = order[step * cfg.batch_size : (step + 1) * cfg.batch_size]
        ids, budgets, rows, cols, tgt = make_batch(examples, idx, d, cfg, median, pad_id)
        h = skip_hidden(model, ids, active_mask(d, budgets, cfg.warmup))[rows, cols]  # [N, D] at the loss positions
        logits = model.logits(h.unsqueeze(0))[0]
        if cfg.loss == "ce":
            return F.cross_entropy(logits, tgt)
        with torch.no_grad():
            full = torch.ones(d, *ids.shape, dtype=torch.bool)
            th = skip_hidden(teacher, ids, full)[rows, cols]
            tlogp = F.log_softmax(teacher.logits(th.unsqueeze(0))[0], -1)
        return F.kl_div(F.log_softmax(logits, -1), tlogp, log_target=True, reduction="batchmean")

    def save(step: int, losses: list, seconds: float) -> None:  # the model folder, loadable at every checkpoint
        save_model(model, out, {"skipdecode": json.dumps({**asdict(cfg), "step": step})})
        write_json(
            state_file,
            {
                "config": asdict(cfg),
                "step": step,
                "losses": losses,
                "base": base_name,
                "base_fingerprint": base_fp,
                "data": data,
                "median_prompt": median,
                "n_examples": len(examples),
            },
        )

    def check(meta: dict) -> None:
        if int(meta["step"]) != start_step:
            raise FinetuneError(
                f"{out / OPT_FILE} is at step {meta['step']}, the model folder at {start_step}: "
                "delete the folder (or choose another --out) to start again"
            )

    ckpt = Checkpoint(
        out / OPT_FILE,
        {},
        check,
        weights=False,
        on_save=save,
        what="optimizer state",
        fix="delete the folder (or choose another --out) to start again",
    )
    # constant after warm-up: extending a run (more --steps) continues the same schedule
    loop = LoopConfig(
        cfg.steps,
        Schedule(cfg.lr, cfg.lr_warmup_steps),
        cfg.weight_decay,
        (0.9, 0.95),
        cfg.grad_clip,
        cfg.save_every,
        desc=f"finetune skipdecode {cfg.target_speedup:g}x",
        progress=progress,
    )
    model.train()
    try:
        run = run_loop({str(i): p for i, p in enumerate(params)}, loss, loop, ckpt)
    finally:
        model.eval()
        model.requires_grad_(False)
    return TrainResult(str(out), run.step, run.start, run.losses, run.seconds_this_run, asdict(cfg))


def _restore(model: Transformer, out: Path, cfg: TrainConfig, base_fp: str) -> int:
    """Load the fine-tuned weights of an earlier call from ``out`` (made from the base model of
    fingerprint ``base_fp``); -> the step it reached."""
    state_file = out / STATE_JSON
    with reading(state_file, "fine-tuning state", "delete the folder (or choose another --out) to start again"):
        st = json.loads(state_file.read_text(encoding="utf-8"))
        st["config"], st["step"], st["losses"]  # noqa: B018  (the fields a resume reads)
    free = ("steps", "save_every")  # a run may be extended or saved more often
    diff = sorted(
        k for k in set(st["config"]) | set(asdict(cfg)) if k not in free and st["config"].get(k) != asdict(cfg).get(k)
    )
    if diff:
        raise FinetuneError(
            f"{out} holds a run with other settings ({', '.join(diff)}): use another --out "
            "or the same settings to resume"
        )
    if st.get("base_fingerprint", base_fp) != base_fp:
        raise FinetuneError(
            f"{out} holds a fine-tune of another base model ({st.get('base')}): use another --out, or that model "
            "to resume"
        )
    if st["step"] >= cfg.steps:
        raise FinetuneError(
            f"{out} already finished {st['step']} steps: raise --steps to continue, or use another --out"
        )
    if not (out / OPT_FILE).is_file():
        raise FinetuneError(f"{out} lacks {OPT_FILE}: delete the folder (or choose another --out) to start again")
    from ..core.loading import _read_safetensors, hf_to_ours

    with reading(out, "fine-tuned weights in", "delete the folder (or choose another --out) to start again"):
        sd = hf_to_ours(_read_safetensors(out), model.config)
    with torch.no_grad():
        own = model.state_dict()
        for k, v in sd.items():
            own[k].copy_(v)
    return int(st["step"])


__all__ = [
    "TrainConfig",
    "TrainResult",
    "finetune",
    "skip_hidden",
    "skip_logits",
    "active_mask",
    "position_budgets",
    "save_model",
    "FinetuneError",
]
