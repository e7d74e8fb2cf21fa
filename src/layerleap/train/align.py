"""BiLD's prediction alignment (Kim et al. 2023, §3.5.1): teach the small model the large model's
greedy outputs on a calibration set of prompts, so it agrees with the large model more often and
BiLD rolls back less.

Two stages, each resumable:

1. ``calibrate``: the large model's greedy output for every calibration prompt, appended to a JSON
   file (rewritten atomically after each prompt; a rerun skips the prompts already there).
2. Training on (prompt, large output) with the cross-entropy of the large model's tokens (hard
   labels, as the paper), loss on the output positions only:

   - early-exit form (``align_exit_head``): an exit head for layer E, ``unembed(norm(h + A h))``
     with a trainable RMSNorm (initialised from the model's final norm) and a low-rank adapter ``A``
     (its output half initialised to zero, so training starts from the shared head; rank 64 by
     default: a full D x D matrix memorises a small calibration set); the unembedding and every
     layer stay frozen, so the large model (the full stack) is unchanged.  Saved as a heads file
     (``save_heads``), loaded by ``load_exit_head`` (``generate(..., method="bild", exit_layer=E, head=PATH)``).
   - two-model form (``align_small``): every weight of the small model; saved as a Hugging Face
     folder (config.json, model.safetensors, tokenizer files) that ``layerleap.load`` reads.

   A checkpoint (trainable weights, Adam moments, the step) is written atomically every
   ``save_every`` steps and on Ctrl-C next to the output (``train.loop``); a rerun with the same settings
   resumes from it, with the same data order.  Progress is a tqdm bar.

Weights are safetensors only, written through a temporary file and ``os.replace``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import validate as V
from ..core.model import Transformer
from ..core.weight_files import save_tokenizer
from ..decoding import generate
from ..drafters import weights
from ..drafters.exit_heads import AdapterHead, save_heads
from ..errors import LayerleapError
from ..files import read_json, replace_dir, save_safetensors, write_json
from .loop import Checkpoint, LoopConfig, LoopResult, Schedule, epoch_batch, items_seen, train as run_loop


class AlignError(LayerleapError, ValueError):
    pass


# -- stage 1: calibration outputs -----------------------------------------------------------------
def _prompt_key(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def calibrate(
    large: Transformer, prompts: list[str], path, max_new_tokens: int = 64, chat: bool = True, progress: bool = True
) -> list[dict]:
    """The large model's greedy output for each prompt, kept in ``path`` (JSON); resumable."""
    from tqdm.auto import tqdm

    path = Path(path)
    done: dict = {}
    if path.is_file():
        data = read_json(path, "calibration file", "delete it to start the calibration again", kind=None)
        records = data.get("records") if isinstance(data, dict) else None
        if not isinstance(records, list) or not all(isinstance(r, dict) and "key" in r for r in records):
            raise AlignError(f"{path} is not a calibration file: delete it or choose another --work")
        if (
            data.get("model") != large.fingerprint
            or data.get("max_new_tokens") != max_new_tokens
            or data.get("chat") != chat
        ):
            raise AlignError(f"{path} holds outputs of another model or settings: delete it or choose another --work")
        done = {r["key"]: r for r in data["records"]}
    records = []
    bar = tqdm(prompts, desc="calibration (large greedy)", unit="prompt", disable=not progress, leave=False)
    for text in bar:
        key = _prompt_key(text)
        if key not in done:
            r = generate(large, text, "greedy", max_new_tokens, chat=chat)
            done[key] = {"key": key, "prompt_ids": r.prompt_ids, "output_ids": r.token_ids}
            write_json(
                path,
                {
                    "model": large.fingerprint,
                    "max_new_tokens": max_new_tokens,
                    "chat": chat,
                    "records": list(done.values()),
                },
            )
        records.append(done[key])
    return records


# -- stage 2: training ---------------------------------------------------------------------------------
@dataclass
class TrainConfig:
    epochs: int = 4
    lr: float = 1e-3
    batch_tokens: int = 256  # output positions per step
    weight_decay: float = 0.0
    seed: int = 0
    save_every: int = 20  # steps
    rank: int = 64  # exit head adapter rank (0: full)
    val_every: int = 4  # every n-th calibration sequence is held out to measure agreement

    def check(self) -> None:
        with V.raising(AlignError):
            V.integer(self.epochs, "epochs", 1)
            V.learning_rate(self.lr)
            V.integer(self.batch_tokens, "batch_tokens", 1)
            V.number(self.weight_decay, "weight_decay", 0)
            V.seed(self.seed)
            V.integer(self.save_every, "save_every", 1)
            V.integer(self.rank, "rank", 0)
            V.integer(self.val_every, "val_every", 0)


def _ckpt_path(out: Path) -> Path:
    return out.with_name(out.name.rstrip("/") + ".ckpt.safetensors")


def _train(
    params: dict[str, torch.Tensor],
    loss_fn,
    n_items: int,
    cfg: TrainConfig,
    out: Path,
    tag: str,
    desc: str,
    progress: bool,
    machine: str,
) -> tuple[LoopResult, str]:
    """AdamW over ``params`` at a constant rate; ``loss_fn(batch_indices) -> loss``; ``n_items``
    examples, shuffled per epoch with a seeded generator (so a resumed run sees the same order).
    -> the run and its machines: ``machine``, after a resumed state's (``Checkpoint``)."""
    meta = {"tag": tag, "machine": machine}

    def check(saved: dict) -> None:
        if saved.get("tag") != tag:
            raise AlignError(
                f"checkpoint {_ckpt_path(out)} belongs to another alignment run (other model, data or "
                "settings): delete it to start again"
            )

    total = -(-n_items // cfg.batch_tokens) * cfg.epochs
    loop = LoopConfig(
        total, Schedule(cfg.lr), cfg.weight_decay, save_every=cfg.save_every, desc=desc, progress=progress
    )
    run = run_loop(
        params,
        lambda step: loss_fn(epoch_batch(step, n_items, cfg.batch_tokens, cfg.seed)),
        loop,
        Checkpoint(_ckpt_path(out), meta, check),
    )
    return run, meta["machine"]


def _tag(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _exit_states(model: Transformer, exit_layer: int, records: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer-E states of the positions that predict output tokens, and those tokens: ``[N, D]``, ``[N]``."""
    hs, ys = [], []
    with torch.no_grad():
        for r in records:
            seq = r["prompt_ids"] + r["output_ids"]
            if not r["output_ids"]:
                continue
            ids = torch.tensor([seq], device=model.device)
            pos = torch.arange(len(seq), device=model.device).unsqueeze(0)
            h = model.run_layers(model.embed(ids), 0, exit_layer, pos)[0]
            P = len(r["prompt_ids"])
            hs.append(h[P - 1 : len(seq) - 1].float().cpu())
            ys.append(torch.tensor(r["output_ids"]))
    if not hs:
        raise AlignError("the calibration outputs are empty: use more prompts or a larger --max-new-tokens")
    return torch.cat(hs), torch.cat(ys)


def agreement(head, h: torch.Tensor, y: torch.Tensor, chunk: int = 512) -> float:
    """The fraction of positions where ``head``'s argmax is the large model's token."""
    hits = 0
    with torch.inference_mode():
        for i in range(0, len(y), chunk):
            hits += int((head(h[i : i + chunk].unsqueeze(0))[0].argmax(-1).cpu() == y[i : i + chunk]).sum())
    return hits / max(1, len(y))


def split(records: list[dict], every: int) -> tuple[list[dict], list[dict]]:
    """(training, held-out): every ``every``-th record is held out (none when ``every`` < 2)."""
    if every < 2 or len(records) < 2:
        return records, []
    return (
        [r for i, r in enumerate(records) if i % every != every - 1],
        [r for i, r in enumerate(records) if i % every == every - 1],
    )


def align_exit_head(
    model: Transformer,
    exit_layer: int,
    records: list[dict],
    out,
    cfg: TrainConfig | None = None,
    progress: bool = True,
    command: str | None = None,
) -> dict:
    """Train and save an exit head for layer ``exit_layer``; -> a report: how often the head's argmax
    is the large model's greedy token, before (shared head) and after, on the training sequences and
    on held-out ones (``cfg.val_every``).  ``command``: what the file records as the command that
    made it (default: this process's command line)."""
    cfg = cfg or TrainConfig()
    cfg.check()
    n = model.config.n_layers
    if isinstance(exit_layer, bool) or not isinstance(exit_layer, int) or not 1 <= exit_layer < n:
        raise AlignError(f"exit layer must be an integer in [1, {n - 1}], got {exit_layer!r}")
    out = Path(out)
    train, held = split(records, cfg.val_every)
    h, y = _exit_states(model, exit_layer, train)
    hv, yv = _exit_states(model, exit_layer, held) if held else (h[:0], y[:0])
    head = AdapterHead(model, exit_layer, rank=cfg.rank).to(model.device)
    dev = model.device
    before = agreement(model.logits, h.to(model.dtype).to(dev), y)
    before_val = agreement(model.logits, hv.to(model.dtype).to(dev), yv) if held else None
    params = dict(head.named_parameters())
    tag = _tag(
        "exit",
        model.fingerprint,
        exit_layer,
        cfg.epochs,
        cfg.lr,
        cfg.batch_tokens,
        cfg.seed,
        cfg.rank,
        cfg.val_every,
        [r["key"] for r in records if "key" in r],
        len(y),
    )

    def loss_fn(idx):
        with torch.enable_grad():
            logits = head(h[idx].unsqueeze(0).to(dev))[0]
            return F.cross_entropy(logits.float(), y[idx].to(dev))

    desc = f"align exit head @ layer {exit_layer}"
    run, machines = _train(params, loss_fn, len(y), cfg, out, tag, desc, progress, weights.machine(dev))
    losses = run.losses[run.start :]
    head.eval()
    after = agreement(head, h.to(dev), y)
    after_val = agreement(head, hv.to(dev), yv) if held else None
    budget = weights.Budget(
        f"the model's greedy outputs on {len(train)} calibration prompts",
        items_seen(run.step, len(y), cfg.batch_tokens),
        run.step,
        run.seconds,
        machines,  # a resumed run's: every call's machine
        command or weights.command_line(),
    )
    save_heads(
        [head],
        out,
        {
            "rank": cfg.rank,
            "agreement_before": f"{before:.4f}",
            "agreement_after": f"{after:.4f}",
            "heldout_before": f"{before_val}",
            "heldout_after": f"{after_val}",
            "positions": len(y),
            "heldout_positions": len(yv),
        },
        budget=budget,
    )
    _ckpt_path(out).unlink(missing_ok=True)
    return {
        "out": str(out),
        "exit_layer": exit_layer,
        "positions": len(y),
        "heldout_positions": len(yv),
        "agreement_before": before,
        "agreement_after": after,
        "heldout_before": before_val,
        "heldout_after": after_val,
        "steps_run": len(losses),
        "final_loss": losses[-1] if losses else None,
    }


def align_small(
    small: Transformer, records: list[dict], out, cfg: TrainConfig | None = None, progress: bool = True
) -> dict:
    """Fine-tune every weight of ``small`` on the calibration outputs; save a Hugging Face folder at
    ``out``; -> a report.  ``cfg.batch_tokens`` counts output tokens per step (whole sequences)."""
    from ..core.loading import ours_to_hf

    cfg = cfg or TrainConfig(lr=1e-5)
    cfg.check()
    out = Path(out)
    # before training, not after it: an empty folder is filled, a model folder replaced, anything else kept
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / "config.json").is_file())):
        raise AlignError(f"{out} exists and is not a model folder: choose another --out")
    seqs = [r for r in records if r["output_ids"]]
    if not seqs:
        raise AlignError("the calibration outputs are empty: use more prompts or a larger --max-new-tokens")
    from ..core.loading import dense_copy

    trained = dense_copy(small, torch.float32).train().requires_grad_(True)  # a tied head stays one matrix
    params = dict(trained.named_parameters())

    def seq_loss(r):
        seq = torch.tensor([r["prompt_ids"] + r["output_ids"]], device=small.device)
        P = len(r["prompt_ids"])
        logits = trained(seq)[0, P - 1 : -1]
        return F.cross_entropy(logits.float(), seq[0, P:], reduction="sum"), len(r["output_ids"])

    def loss_fn(idx):
        with torch.enable_grad():
            total, count = 0.0, 0
            for i in idx.tolist():
                loss, n = seq_loss(seqs[i])
                total, count = total + loss, count + n
            return total / count

    per_step = max(1, cfg.batch_tokens // max(1, round(sum(len(r["output_ids"]) for r in seqs) / len(seqs))))
    step_cfg = TrainConfig(cfg.epochs, cfg.lr, per_step, cfg.weight_decay, cfg.seed, cfg.save_every, cfg.rank, 0)
    tag = _tag("small", small.fingerprint, cfg.epochs, cfg.lr, per_step, cfg.seed, [r.get("key") for r in seqs])
    with torch.inference_mode():
        before = _token_agreement(small, seqs)
    run, _ = _train(
        params, loss_fn, len(seqs), step_cfg, out, tag, "align small model", progress, weights.machine(small.device)
    )
    losses = run.losses[run.start :]
    trained.eval().requires_grad_(False)
    with torch.inference_mode():
        after = _token_agreement(trained, seqs)
    sd = {k: v.detach().clone() for k, v in ours_to_hf(trained).items()}

    def fill(tmp: Path):
        write_json(tmp / "config.json", small.config.to_hf(), indent=2)
        save_safetensors(tmp / "model.safetensors", sd, {"format": "pt"})
        src = Path(small.source) if small.source else None
        if src is not None and src.is_dir():
            for f in src.iterdir():
                if (
                    f.is_file()
                    and f.suffix.lower() != ".safetensors"
                    and f.name not in ("config.json",)
                    and f.suffix.lower() != ".gguf"
                ):
                    shutil.copy(f, tmp / f.name)
        elif small.tokenizer is not None:
            save_tokenizer(small.tokenizer, tmp)

    replace_dir(out, fill)
    _ckpt_path(out).unlink(missing_ok=True)
    return {
        "out": str(out),
        "sequences": len(seqs),
        "agreement_before": before,
        "agreement_after": after,
        "steps_run": len(losses),
        "final_loss": losses[-1] if losses else None,
    }


def _token_agreement(model: Transformer, seqs: list[dict]) -> float:
    hits = total = 0
    for r in seqs:
        seq = torch.tensor([r["prompt_ids"] + r["output_ids"]], device=model.device)
        P = len(r["prompt_ids"])
        pred = model(seq)[0, P - 1 : -1].argmax(-1)
        hits += int((pred == seq[0, P:]).sum())
        total += len(r["output_ids"])
    return hits / max(1, total)
