"""`auto` against its parts, per Spec-Bench category, interleaved per prompt: this tree's `auto`, the
`auto` drafter of another git revision (``--ref``), Medusa, prompt lookup and greedy, each prompt's
methods in a rotating order, every output checked against greedy's.  For tuning the chooser on
held-out prompts (``--offset 20``: the benchmark tables use the first prompts of each category).

    python benchmarks/auto_chooser_ab.py --ref main --offset 20 --prompts 3 --threads 1

(writing has 10 prompts: it starts at ``--small-offset``, 3.)

Prints, per category and over all, each method's summed greedy wall time over its own (end to end),
and the same in process CPU time (at one thread, less disturbed by other jobs on the machine; the
chooser itself times rounds by the wall clock).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import subprocess
import sys
import time


def drafter_at(ref: str):
    """``AutoDrafter`` as ``drafters/auto.py`` defines it at git revision ``ref``."""
    src = subprocess.run(
        ["git", "show", f"{ref}:src/layerleap/drafters/auto.py"], capture_output=True, text=True, check=True
    ).stdout
    spec = importlib.util.spec_from_loader(f"layerleap.drafters._auto_{abs(hash(ref))}", loader=None)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "layerleap.drafters"
    sys.modules[spec.name] = mod  # (dataclasses look their module up)
    exec(compile(src, f"{ref}:auto.py", "exec"), mod.__dict__)
    return mod.AutoDrafter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--ref", action="append", default=[], help="also time `auto` as this git revision has it (label auto-REF)"
    )
    ap.add_argument("--offset", type=int, default=20)
    ap.add_argument(
        "--small-offset",
        type=int,
        default=3,
        help="the offset in a category with too few prompts for --offset (writing has 10; the tables use 3)",
    )
    ap.add_argument("--prompts", type=int, default=3, help="prompts per category")
    ap.add_argument("--categories", default="summarization,qa,translation,math_reasoning,writing")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--methods",
        default="auto,medusa,prompt-lookup",
        help="comma-separated METHOD or LABEL=METHOD:KEY=VALUE[:KEY=VALUE] (e.g. auto-nt=auto:transfer=none)",
    )
    args = ap.parse_args()

    import torch

    import layerleap
    from layerleap.datasets import spec_bench
    from layerleap.methods import auto as auto_method

    torch.set_num_threads(args.threads)
    model = layerleap.load("smollm2-135m", dtype=args.dtype)
    ours = auto_method.AutoDrafter
    labels = {}
    for spec in args.methods.split(","):
        label, _, rest = spec.partition("=")
        meth, *opts = (rest or label).split(":")
        labels[label] = (meth, ours, dict(o.split("=", 1) for o in opts))
    for ref in args.ref:
        labels[f"auto-{ref}"] = ("auto", drafter_at(ref), {})
    labels["greedy"] = ("greedy", ours, {})
    prompts = []
    for cat in args.categories.split(","):
        got = spec_bench(categories=cat, n=args.prompts, offset=args.offset)
        prompts += (
            got if len(got) == args.prompts else spec_bench(categories=cat, n=args.prompts, offset=args.small_offset)
        )
    for meth, drafter, opts in labels.values():  # warm up every path
        auto_method.AutoDrafter = drafter
        layerleap.generate(model, "Hello there.", meth, 8, chat=True, **opts)
    wall = collections.defaultdict(lambda: collections.defaultdict(float))
    cpu = collections.defaultdict(lambda: collections.defaultdict(float))
    rounds = collections.defaultdict(lambda: collections.defaultdict(int))
    names = list(labels)
    for i, p in enumerate(prompts):
        order = names[i % len(names) :] + names[: i % len(names)]
        outs = {}
        for lab in order:
            meth, drafter, opts = labels[lab]
            auto_method.AutoDrafter = drafter
            t, c = time.perf_counter(), time.process_time()
            r = layerleap.generate(model, p.text, meth, args.max_new_tokens, chat=True, **opts)
            s, c = time.perf_counter() - t, time.process_time() - c
            outs[lab] = r.token_ids
            for k in (p.category, "all"):
                wall[k][lab] += s
                cpu[k][lab] += c
                for st in ("lookup_rounds", "transfer_rounds", "medusa_rounds", "eagle_rounds"):
                    rounds[(k, lab)][st] += r.stats.get(st, 0) or 0
        bad = [lab for lab, o in outs.items() if o != outs["greedy"]]
        print(f"{i + 1}/{len(prompts)} {p.category} {p.id}" + (f" DIFFERS: {bad}" if bad else ""), flush=True)
    auto_method.AutoDrafter = ours
    shown = [lab for lab in names if lab != "greedy"]
    for name, times in (("wall", wall), ("process CPU time", cpu)):
        print(f"{name}: category | " + " | ".join(shown))
        for k, w in times.items():
            print(f"{k} | " + " | ".join(f"{w['greedy'] / w[lab]:.3f}" for lab in shown))
    for (k, lab), r in rounds.items():
        if lab.startswith("auto"):
            print(k, lab, "rounds:", " ".join(f"{m.split('_')[0]}={n}" for m, n in r.items()))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
