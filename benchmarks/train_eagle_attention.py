"""Train the attending EAGLE head (``EagleHead(attention=True)``) on a CPU, from the frozen model's
cached states of self-distilled sequences, and measure its first draft against the head it started from.

1. Every sequence (a prompt and the model's own answer, whole) goes once through the backbone, eight
   of similar length at a time; the last layer's states are kept in a ``StateCache`` (bf16, resumable:
   ``--states``, by default ``<cache>/states``).
2. The head trains one draft step over whole sequences (each pair attends to the pairs before it,
   as it drafts), batches of about ``--tokens`` positions of similar length: the KL of its draft over
   the shipped draft vocabulary to the model's own distribution there, plus the smooth-L1 distance of
   its normalised state to the real one.  AdamW (0.9, 0.95), 50 warm-up steps, the rate falling
   linearly to 5% at ``--seconds``.  ``--init`` (default: the shipped head) starts it: a head without
   attention gives the block, the attention starting at zero output.
3. The file is written with its budget (``layerleap heads info``); ``--eval N`` then prints the first
   draft's teacher-forced top-1 on the model's greedy answers (64 tokens, past EOS) to N Spec-Bench
   prompts per category from the 11th (none of the benchmark tables'), for the start head and the
   trained one; ``--eval-only FILE ...`` measures heads without training.

  PYTHONPATH=src python benchmarks/train_eagle_attention.py --data FILE.jsonl --out eagle.safetensors \\
      --seconds 1500 [--init trained|FILE] [--lr 6e-4] [--tokens 4096] [--eval 8]
  PYTHONPATH=src python benchmarks/train_eagle_attention.py --eval-only trained eagle.safetensors --eval 8
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

import layerleap
from layerleap.datasets import spec_bench
from layerleap.drafters import medusa_transfer as drafters
from layerleap.drafters import weights
from layerleap.drafters.draft_vocab import get_draft_vocab
from layerleap.commands.hidden_transfer import greedy_sequences
from layerleap.train.data import answers_kind, load_self_distilled
from layerleap.train.medusa_transfer import start_from
from layerleap.train.state_cache import StateCache, default_root

REGRESSION = 1.0  # the feature regression's weight beside the KL (``train.medusa_transfer.REGRESSION``)


def fill_states(store: StateCache) -> None:
    """Every sequence's last-layer states into ``store`` (``StateCache.compute``, eight at a time), with
    progress."""
    t0, done, total = time.time(), 0, sum(map(len, store.items))

    def report(shard: int, tokens: int) -> None:
        nonlocal done
        done += tokens
        rate = done / max(time.time() - t0, 1e-9)
        print(
            f"states: shard {shard + 1}/{store.n_shards}, {done}/{total} tokens computed, {rate:.0f} tok/s", flush=True
        )

    store.compute(batch=8, report=report)


def batches(lengths: list[int], tokens: int) -> list[list[int]]:
    """Items grouped by length, each group at most ``tokens`` padded positions."""
    out, cur, longest = [], [], 0
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if cur and max(longest, lengths[i]) * (len(cur) + 1) > tokens:
            out.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, lengths[i])
    return out + ([cur] if cur else [])


def loss(model, head, rows, z, ids, mask):
    """One draft step over whole sequences: ``z`` ``[B, N, D]`` normalised states, ``ids`` ``[B, N]``,
    ``mask`` ``[B, N - 1]`` the pairs with a target; ``rows`` ``[K, D]`` the draft vocabulary's unembedding."""
    s = head.step(z[:, :-1], ids[:, 1:])  # [B, N-1, D]: the state of position j + 1 from pair j
    zs = model.final_norm(s)
    with torch.no_grad():
        teacher = (z[:, 1:] @ rows.T).log_softmax(-1)  # [B, N-1, K]
    student = (zs @ rows.T).log_softmax(-1)
    kl = F.kl_div(student, teacher, log_target=True, reduction="none").sum(-1)
    reg = F.smooth_l1_loss(zs, z[:, 1:], reduction="none").mean(-1)
    return ((kl + REGRESSION * reg) * mask).sum() / mask.sum()


def padded(model, store: StateCache, seqs, idx):
    L, D = model.config.n_layers, model.config.hidden_size
    n = max(len(seqs[i]) for i in idx)
    z = torch.zeros(len(idx), n, D)
    ids = torch.zeros(len(idx), n, dtype=torch.long)
    mask = torch.zeros(len(idx), n - 1)
    for r, i in enumerate(idx):
        k = len(seqs[i])
        z[r, :k] = model.final_norm(store.get(i)[L].float())
        ids[r, :k] = torch.tensor(seqs[i])
        mask[r, : k - 1] = 1
    return z, ids, mask


def first_draft_top1(model, head, vocab, sequences) -> tuple[float, int]:
    """Teacher-forced top-1 of the first draft at the answer positions of ``sequences`` (prompt length,
    prompt and greedy answer: ``greedy_sequences``)."""
    hits = count = 0
    with torch.inference_mode():
        for plen, seq in sequences:
            ids = torch.tensor([seq])
            N = ids.shape[1]
            z = model.final_norm(model.run_layers(model.embed(ids), 0, model.config.n_layers, torch.arange(N)[None]))
            top = vocab.token(vocab.logits(model.final_norm(head.step(z[:, :-1], ids[:, 1:]))[0]).argmax(-1))
            js = torch.arange(plen - 1, N - 2)  # pair j predicts x_{j+2}
            hits += int((top[js] == ids[0, js + 2]).sum())
            count += len(js)
    return hits / count, count


def evaluate(model, heads: dict, n: int) -> None:
    """Each head's first-draft top-1 on the model's greedy answers (64 tokens) to ``n`` Spec-Bench prompts
    per category from the 11th."""
    prompts = spec_bench(categories="summarization,qa,translation,math_reasoning,writing", n=n, offset=10)
    sequences = greedy_sequences(model, prompts, 64)
    vocab = get_draft_vocab(model, "auto")
    for name, head in heads.items():
        acc, count = first_draft_top1(model, head, vocab, sequences)
        print(f"first draft top-1, {name}: {acc:.1%} of {count} answer positions", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", help="self-distilled .jsonl (`layerleap train data --self-distill`)")
    ap.add_argument("--out")
    ap.add_argument("--seconds", type=float)
    ap.add_argument("--eval-only", nargs="+", default=None, help="only measure these heads ('trained': shipped)")
    ap.add_argument("--init", default="trained")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--states", default=None)
    ap.add_argument("--eval", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    model = layerleap.load("smollm2-135m")
    model.requires_grad_(False)
    if a.eval_only:
        evaluate(model, {f: drafters.get_drafter(model, "eagle", f) for f in a.eval_only}, a.eval or 8)
        return 0
    if not (a.data and a.out and a.seconds):
        ap.error("training needs --data, --out and --seconds (or --eval-only FILE ...)")
    path, pairs = load_self_distilled(model, a.data)
    seqs = [p + c for p, c in pairs]
    store = StateCache(a.states or default_root(), model, [model.config.n_layers], seqs, torch.bfloat16)
    print(store.describe(), flush=True)
    fill_states(store)
    head = drafters.new_drafter(model, "eagle", attention=True)
    init = drafters.shipped_files(model, "eagle")[-1] if a.init == "trained" else a.init
    meta = start_from(head, init)
    start = drafters.load_drafter(model, init, "eagle")
    head.train()
    vocab = get_draft_vocab(model, "auto")
    rows = model.head_weight()[vocab.ids].float()  # [K, D]
    groups = batches([len(s) for s in seqs], a.tokens)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(a.seed)
    t0, step, positions, losses = time.time(), 0, 0, []
    while time.time() - t0 < a.seconds:
        for g in torch.randperm(len(groups), generator=gen).tolist():
            spent = time.time() - t0
            if spent >= a.seconds:
                break
            for group in opt.param_groups:
                group["lr"] = a.lr * min(1.0, (step + 1) / 50) * max(0.05, 1 - spent / a.seconds)
            z, ids, mask = padded(model, store, seqs, groups[g])
            value = loss(model, head, rows, z, ids, mask)
            opt.zero_grad()
            value.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            positions += int(mask.sum())
            losses.append(value.item())
            if step % 50 == 0:
                recent = sum(losses[-50:]) / 50
                print(f"step {step}, {spent:.0f} s, {positions} positions, loss {recent:.4f}", flush=True)
    head.eval()
    seconds = time.time() - t0
    budget = weights.Budget(
        f"self-distilled: {len(pairs)} {answers_kind(path)} of {model.config.name} to ShareGPT prompts "
        f"({path.name}), whole sequences",
        positions,
        step,
        seconds,
        weights.machine("cpu"),
        weights.command_line(),
        meta,
    )
    drafters.save_drafter(
        head, a.out, {"lr": a.lr, "final_loss": sum(losses[-50:]) / max(1, len(losses[-50:]))}, budget=budget
    )
    print(f"wrote {a.out}: {step} steps, {positions} positions, {seconds:.0f} s", flush=True)
    if a.eval:
        evaluate(model, {"start head": start, "trained head": head}, a.eval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
