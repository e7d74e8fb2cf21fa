"""Self-distilled training data decoded on a GPU in large batches, in the format of `layerleap train
data --self-distill` (JSON lines {prompt, completion, model}), for the device run
(benchmarks/device_train_selfdistill.sh).  The machine there has no ShareGPT package, so the prompts
travel pre-tokenized: `--save-prompts FILE` writes them here, `--prompts FILE` reads them there.

  python benchmarks/device_self_distill.py --save-prompts .devcarry/prompts.safetensors --n 16000
  python benchmarks/device_self_distill.py --save-prompts .devcarry/prompts.safetensors --later-turns --n 24000
  python benchmarks/device_self_distill.py --prompts .devcarry/prompts.safetensors --out sd.jsonl \\
      --device cuda --batch 1024 --gen-len 64

The decoding is `layerleap.train.data.self_distilled`: the output is rewritten atomically after
every batch, so a run stopped at any point (the device script's `timeout`) leaves a whole file, and
a rerun with the same --out decodes only the rest."""

from __future__ import annotations

import argparse
import sys
import time


def later_turn_prompts(tok, n: int, max_prompt: int, min_chars: int = 24) -> list[list[int]]:
    """Prompt ids of up to ``n`` ShareGPT human turns after the first, each alone in the chat template:
    text that the first-turn prompts (`sharegpt_questions`) never show.  Turns shorter than
    ``min_chars`` ("continue", "more") and texts seen before (a first turn too) are passed over; the
    conversations are taken in the package's order, and the kept turns shuffled with seed 0."""
    import random

    from layerleap.datasets import sharegpt_conversations
    from layerleap.train.data import chat_token_ids

    seen: set[str] = set()
    texts: list[str] = []
    for conv in sharegpt_conversations(limit=None):
        humans = [(t.get("value") or "").strip() for t in conv if t.get("from") == "human"]
        seen.update(humans[:1])
        for text in humans[1:]:
            if len(text) >= min_chars and text not in seen:
                seen.add(text)
                texts.append(text)
    random.Random(0).shuffle(texts)
    out = []
    for text in texts:
        if len(out) >= n:
            break
        p = chat_token_ids(tok, [{"role": "user", "content": text}], add_generation_prompt=True)
        if len(p) <= max_prompt:
            out.append(p)
    return out


def save_prompts(path: str, n: int, max_prompt: int, later_turns: bool = False) -> None:
    import torch
    from safetensors.torch import save_file

    import layerleap
    from layerleap.train.data import sharegpt_questions

    tok = layerleap.load("smollm2-135m").tokenizer
    prompts = later_turn_prompts(tok, n, max_prompt) if later_turns else sharegpt_questions(tok, n, max_prompt)
    flat = torch.tensor([t for p in prompts for t in p], dtype=torch.int32)
    lens = torch.tensor([len(p) for p in prompts], dtype=torch.int32)
    save_file({"ids": flat, "lens": lens}, path, metadata={"max_prompt": str(max_prompt)})
    print(f"{len(prompts)} prompts, {flat.numel()} tokens -> {path}")


def read_prompts(path: str) -> list[list[int]]:
    from safetensors.torch import load_file

    t = load_file(path)
    ids, out, at = t["ids"].tolist(), [], 0
    for n in t["lens"].tolist():
        out.append(ids[at : at + n])
        at += n
    return out


def decode(args) -> None:
    import layerleap
    from layerleap.train.data import self_distilled

    model = layerleap.load("smollm2-135m", dtype=args.dtype, device=args.device)
    prompts = sorted(read_prompts(args.prompts), key=len)  # prompts of like length together: less padding
    k, n = (int(x) for x in args.part.split("/"))
    prompts = prompts[k - 1 :: n]  # part k of n: the processes of one GPU share its prompts
    t0 = time.perf_counter()
    pairs = self_distilled(
        model,
        args.out,
        len(prompts),
        gen_len=args.gen_len,
        batch=args.batch,
        prompts=prompts,
        temperature=args.temperature,
        seed=args.seed,
    )
    el = time.perf_counter() - t0
    tokens = sum(len(c) for _, c in pairs)
    print(f"{len(pairs)} answers, {tokens} tokens in {el:.1f}s ({tokens / el:.0f} tok/s)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--save-prompts")
    ap.add_argument("--n", type=int, default=16000)
    ap.add_argument("--max-prompt", type=int, default=96)
    ap.add_argument(
        "--later-turns",
        action="store_true",
        help="--save-prompts: the human turns after the first, each alone (other text than the first turns)",
    )
    ap.add_argument("--prompts")
    ap.add_argument("--out")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--part", default="1/1", help="decode only part K/N of the prompts (N processes on one GPU)")
    ap.add_argument("--temperature", type=float, help="sample the answers at this temperature (default: greedy)")
    ap.add_argument("--seed", type=int, default=0, help="sampling: prompt i samples with seed + i")
    args = ap.parse_args(argv)
    if args.save_prompts:
        save_prompts(args.save_prompts, args.n, args.max_prompt, args.later_turns)
    elif args.prompts and args.out:
        decode(args)
    else:
        ap.error("give --save-prompts FILE, or --prompts FILE --out FILE.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
