"""The rounding of a q4 product's activations split between a team's threads, or on thread 0 alone,
timed against each other in one process (``team_settings``' ``rounds``; the same bits either way): a
call of S new tokens after a cached prompt, the two settings in turn within every round, the best of
the rounds kept.

    python benchmarks/q4_team_rounding.py --threads 2 --sizes 1,2,4,8 --rounds 40
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch

from call_cost_any import primed_calls

import layerleap
from layerleap.core import native


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--sizes", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    mod = native.module()
    if mod is None or len(mod.team_settings()) < 4:
        raise SystemExit("needs the native layers of this source: run `layerleap native --build`")
    model = layerleap.load("smollm2-135m", dtype="q4")
    sizes = [int(s) for s in args.sizes.split(",")]
    settings = {"team rounds": 1, "thread 0 rounds": 0}
    times = {(k, s): [] for k in settings for s in sizes}
    was = mod.team_settings()
    try:
        with torch.inference_mode():
            call = primed_calls(model, sizes, args.context)
            for s in sizes:
                outs = []
                for rounds in settings.values():
                    mod.team_settings(-1, -1, rounds)
                    outs.append(call(s))
                assert torch.equal(outs[0], outs[1]), f"S={s}: the settings give other bits"
            for _ in range(args.rounds):
                for s in sizes:
                    for key, rounds in settings.items():
                        mod.team_settings(-1, -1, rounds)
                        t = time.perf_counter()
                        call(s)
                        times[key, s].append(time.perf_counter() - t)
    finally:
        mod.team_settings(was[0], was[1], was[3])
    print(
        f"q4, {args.threads} threads, context {args.context}, best of {args.rounds} rounds, "
        f"{platform.processor() or platform.machine()}, load average {os.getloadavg()[0]:.2f}"
    )
    for s in sizes:
        a, b = (min(times[k, s]) * 1e3 for k in settings)
        print(f"  S={s:<3} team rounds {a:6.2f} ms   thread 0 rounds {b:6.2f} ms   ({(b - a) * 1e3:+.0f} us)")


if __name__ == "__main__":
    main()
