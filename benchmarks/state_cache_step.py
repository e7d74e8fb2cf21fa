"""Seconds per Medusa training step with the backbone running against reading its states from a
``--state-cache`` (``train.state_cache``), interleaved in one process: step ``k`` of each kind runs
back to back on the same batch, so both see the same load.  Also the backbone's pass alone (what the
cache saves) and the time to read a batch's states back.

The batches are the first ones ``layerleap train medusa --data self-distill`` trains on (the same
chunks, seed and order); their states go to ``--state-cache`` (a folder), filled by this script's
first pass when not there yet.

PYTHONPATH=src python benchmarks/state_cache_step.py --threads 1 --steps 8 --batch-size 4 --seq-len 128
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time

import torch

import layerleap
from layerleap.drafters import medusa_transfer as drafters
from layerleap.files import write_json
from layerleap.train import medusa_transfer as mt
from layerleap.train.data import load_self_distilled, self_distilled_chunks
from layerleap.train.state_cache import StateCache, backbone_states


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=8, help="timed steps of each kind")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--data", default="self-distill")
    p.add_argument("--state-cache", default=None, help="folder for the states (default: a temporary one)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = layerleap.load(args.model)
    model.requires_grad_(False)
    eos = model.config.eos_token_ids[0] if model.config.eos_token_ids else 0
    _, pairs = load_self_distilled(model, args.data)
    chunks = self_distilled_chunks(pairs, args.seq_len, 0, eos)[: args.steps * args.batch_size]
    root = args.state_cache or tempfile.mkdtemp(prefix="state-cache-")
    store = StateCache(root, model, [model.config.n_layers], chunks, shard_items=args.batch_size)
    heads = drafters.get_drafter(model, "medusa", "trained")
    heads.train().requires_grad_(True)
    n = model.config.n_layers
    times: dict[str, list[float]] = {"live": [], "cached": [], "backbone": [], "read": []}
    for k in range(args.steps):
        idx = list(range(k * args.batch_size, (k + 1) * args.batch_size))
        ids = torch.tensor([chunks[i] for i in idx])
        store.states(idx)  # fill (untimed) where not stored yet
        for kind in ("live", "cached"):
            heads.zero_grad(set_to_none=True)
            t = time.perf_counter()
            if kind == "live":
                loss = mt.medusa_loss(model, heads, ids)
            else:
                fresh = StateCache(root, model, [n], chunks, shard_items=args.batch_size)  # read from disk
                loss = mt.medusa_loss(model, heads, ids, fresh.states(idx)[n])
            loss.backward()
            times[kind].append(time.perf_counter() - t)
        t = time.perf_counter()
        backbone_states(model, ids, [n])
        times["backbone"].append(time.perf_counter() - t)
        t = time.perf_counter()
        StateCache(root, model, [n], chunks, shard_items=args.batch_size).states(idx)
        times["read"].append(time.perf_counter() - t)
        print(f"step {k}: " + "  ".join(f"{key} {v[-1]:.2f} s" for key, v in times.items()), file=sys.stderr)
    med = {k: statistics.median(v) for k, v in times.items()}
    report = {
        "command": "PYTHONPATH=src python benchmarks/state_cache_step.py " + shlex.join(argv or sys.argv[1:]),
        "threads": args.threads,
        "batch": f"{args.batch_size} x {args.seq_len} tokens",
        "median_s": med,
        "live_over_cached": med["live"] / med["cached"],
        "all_s": times,
    }
    print(json.dumps(report, indent=1))
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
