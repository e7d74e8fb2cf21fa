"""Self-distilled training data decoded on a GPU in large batches, in the format of `layerleap train
data --self-distill` (JSON lines {prompt, completion, model}), for the device run
(benchmarks/device_train_selfdistill.sh).  The machine there has no ShareGPT package, so the prompts
travel pre-tokenized: `--save-prompts FILE` writes them here, `--prompts FILE` reads them there.

  python benchmarks/device_self_distill.py --save-prompts .devcarry/prompts.safetensors --n 16000
  python benchmarks/device_self_distill.py --prompts .devcarry/prompts.safetensors --out sd.jsonl \\
      --device cuda --batch 1024 --gen-len 64 --max-seconds 90 [--start FILE.jsonl]

--start: an existing self-distilled file of the same model; its answers are kept and its prompts
skipped.  The output is rewritten atomically after every batch, so a run stopped at any point
leaves a whole file."""

from __future__ import annotations

import argparse
import json
import sys
import time


def save_prompts(path: str, n: int, max_prompt: int) -> None:
    import torch
    from safetensors.torch import save_file

    import layerleap
    from layerleap.train.data import sharegpt_questions

    tok = layerleap.load("smollm2-135m").tokenizer
    prompts = sharegpt_questions(tok, n, max_prompt)
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
    from layerleap.decoding import generate
    from layerleap.files import write_text
    from layerleap.train.data import read_self_distilled

    t0 = time.perf_counter()
    model = layerleap.load("smollm2-135m", dtype=args.dtype, device=args.device)
    fp = model.fingerprint
    done = read_self_distilled(args.start, fp) if args.start else []
    seen = {tuple(p) for p, _ in done}
    todo = [p for p in read_prompts(args.prompts) if tuple(p) not in seen]
    # longest prompts together: less left padding per batch
    todo.sort(key=len)
    print(f"model loaded in {time.perf_counter() - t0:.1f}s; {len(done)} answers kept, {len(todo)} prompts to answer")
    t0 = time.perf_counter()
    new = 0
    for i in range(0, len(todo), args.batch):
        if time.perf_counter() - t0 > args.max_seconds:
            break
        chunk = todo[i : i + args.batch]
        res = generate(model, chunk, "greedy", args.gen_len)
        done += [(p, [int(t) for t in r.token_ids]) for p, r in zip(chunk, res)]
        new += sum(len(r.token_ids) for r in res)
        write_text(args.out, "".join(json.dumps({"prompt": p, "completion": c, "model": fp}) + "\n" for p, c in done))
        el = time.perf_counter() - t0
        print(f"{len(done)} answers, {new} new tokens in {el:.1f}s ({new / el:.0f} tok/s)", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--save-prompts")
    ap.add_argument("--n", type=int, default=16000)
    ap.add_argument("--max-prompt", type=int, default=96)
    ap.add_argument("--prompts")
    ap.add_argument("--out")
    ap.add_argument("--start")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--max-seconds", type=float, default=90)
    args = ap.parse_args(argv)
    if args.save_prompts:
        save_prompts(args.save_prompts, args.n, args.max_prompt)
    elif args.prompts and args.out:
        decode(args)
    else:
        ap.error("give --save-prompts FILE, or --prompts FILE --out FILE.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
