"""PPD's commands: ``theory ppd`` (Theorem 4.1, eqs. 3/5/6, a Monte-Carlo check, and with ``--measure``
the measured match rates and the trade-off plots of Figures 3 and 4) and ``eval ppd-parallel`` (PPD on
real processes against greedy, wall clock)."""

from __future__ import annotations

import time
from pathlib import Path

from ..eval import bench, theory
from .. import validate as V, workload
from ..core import options as O
from ..decoding import get_method
from ..methods.ppd import EXIT_LAYER as PPD_EXIT_LAYER
from ..files import json_text, write_json
from . import command
from .heads import _check_head_layers
from ..errors import LayerleapError
from .basic import (
    _check_sizes,
    _refuse_unused,
    _command_line,
    _csv,
    _load,
    _model_args,
    _positive_int,
    _read_prompts,
    _say,
    _threads,
)


SIMULATE_MAX = theory.SIMULATE_MAX
HEAD_ARG = O.HEAD.arg()


@command(
    "theory ppd",
    help="PPD's Theorem 4.1, equations 3/5/6, a Monte-Carlo check; --measure: match rates "
    "on a model and the trade-off plots (Figures 3, 4)",
)
def _setup_theory(p):
    p.add_argument(
        "--layers", type=V.int_arg(2, 100_000), default=40, help="d, the model's layers (default 40: Vicuna-13B)"
    )
    p.add_argument("--exit-layer", type=_positive_int, default=None, help="d̄, the early-prediction layer (default d/2)")
    p.add_argument("--k", type=V.int_arg(1, 100_000), default=1, help="sub-processes (default 1)")
    p.add_argument("--p-correct", type=V.probability_arg, default=0.5, help="match rate p (default 0.5)")
    p.add_argument("--tokens", type=V.int_arg(1, 1_000_000), default=128, help="ℓ, tokens generated (default 128)")
    p.add_argument(
        "--simulate",
        type=V.int_arg(0, SIMULATE_MAX),
        default=2000,
        metavar="N",
        help="Monte-Carlo sequences checking the theorem (default 2000; 0 = off)",
    )
    p.add_argument("--seed", type=V.seed_arg, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    m = p.add_argument_group("measuring match rates (--measure)")
    m.add_argument(
        "--measure",
        action="store_true",
        help="measure p̂_correct on a model over Spec-Bench prompts and "
        "draw the trade-off curves (the theorem's --layers, --exit-layer, --k, --p-correct, --tokens, "
        "--simulate, --seed and --json are then refused)",
    )
    _model_args(m)
    m.add_argument("--categories", type=V.names_arg, default="summarization,qa,translation,math_reasoning,writing")
    m.add_argument("--prompts", type=_positive_int, default=3, help="prompts per category (default 3)")
    m.add_argument("--max-new-tokens", type=_positive_int, default=64)
    m.add_argument(
        "--exit-layers", type=V.int_list_arg(1), default="15,20,25", help="d̄ values to measure (default 15,20,25)"
    )
    m.add_argument("--ks", type=V.int_list_arg(1), default="1,3,5", help="k values (default 1,3,5)")
    m.add_argument("--head", type=HEAD_ARG, default="auto", help="exit head: auto, shared, trained or a heads file")
    m.add_argument(
        "--out",
        type=V.out_dir_arg,
        default=None,
        metavar="DIR",
        help="write match_rates.json and tradeoff_d{d̄}.png here",
    )
    workload.add_args(m)


THEORY_ONLY = ("--layers", "--exit-layer", "--k", "--p-correct", "--tokens", "--simulate", "--seed", "--json")
MEASURE_ONLY = (
    *("--model", "--dtype", "--device", "--threads", "--variant", "--categories", "--prompts", "--max-new-tokens"),
    *("--exit-layers", "--ks", "--head", "--out", "--max-hours", "--yes"),
)


@_setup_theory
def run_theory(args) -> int:
    if args.measure:
        _refuse_unused(args, THEORY_ONLY, "with --measure (it measures the model's own d, d̄, k and p̂)")
        return _measure(args)
    _refuse_unused(args, MEASURE_ONLY, "without --measure: add --measure to measure match rates on a model")
    d = args.layers
    dbar = args.exit_layer or (d + 1) // 2
    out = theory.figures(d, dbar, args.k, args.p_correct, args.tokens)
    V.at_most(
        args.simulate * args.tokens,
        SIMULATE_MAX,
        "--simulate × --tokens (simulated tokens)",
        "lower --simulate or --tokens",
    )
    if args.simulate > 0:
        sim = theory.simulate(d, dbar, args.k, args.p_correct, args.tokens, args.simulate, args.seed, progress=True)
        se = sim.sd_latency / sim.trials**0.5
        out["simulation"] = {
            **sim.to_dict(),
            "latency_vs_theorem": sim.mean_latency / out["theorem"]["latency_units"],
            "compute_vs_theorem": sim.mean_compute / out["theorem"]["compute_units"],
            "latency_standard_errors": (sim.mean_latency - out["theorem"]["latency_units"]) / se if se > 0 else 0.0,
        }
    if args.json:
        print(json_text(out, indent=1))
        return 0
    th, ap = out["theorem"], out["approximation"]
    print(f"d={d} d̄={dbar} k={args.k} p_correct={args.p_correct} ℓ={args.tokens}")
    print(
        f"Theorem 4.1: latency {th['latency_units']:.1f} units (greedy {th['greedy_units']}), "
        f"compute {th['compute_units']:.1f}; normalised latency/token {th['normalised_latency_per_token']:.3f}, "
        f"compute/time unit {th['compute_per_time_unit']:.3f}"
    )
    print(
        f"ℓ ≫ 1 (eqs. 3/5/6{' generalised' if 2 * dbar != d else ''}): latency/token "
        f"{ap['normalised_latency_per_token']:.3f}, compute/time unit {ap['compute_per_time_unit']:.3f}, "
        f"compute/token {ap['normalised_compute_per_token']:.3f}"
    )
    if "simulation" in out:
        s = out["simulation"]
        print(
            f"Monte-Carlo ({s['trials']} sequences): latency {s['mean_latency']:.1f} "
            f"({s['latency_vs_theorem']:.4f}× the theorem, {s['latency_standard_errors']:+.1f} s.e.), "
            f"compute {s['mean_compute']:.1f} ({s['compute_vs_theorem']:.4f}×)"
        )
    return 0


def _measure(args) -> int:
    from tqdm.auto import tqdm

    from ..decoding import generate

    layers, ks = args.exit_layers, args.ks
    if args.out:  # it draws the trade-off plots there after the run
        V.plotting("--out")
    if args.max_new_tokens < 2:  # p̂ checks the candidates for x_1 .. x_{ℓ-1} (x_ℓ's save nothing): none for ℓ = 1
        raise LayerleapError(
            f"--max-new-tokens {args.max_new_tokens} leaves no early prediction to check (a match for the last "
            "token saves nothing, so it is not counted): give --max-new-tokens 2 or more"
        )
    prompts = _read_prompts(None, _csv(args.categories), args.prompts)
    threads = _threads(args.threads)
    model = _load(args)
    d = model.config.n_layers
    for L in layers:
        if not (d + 1) // 2 <= L < d:
            raise LayerleapError(
                f"--exit-layers must be in [{(d + 1) // 2}, {d - 1}] on {model.config.name} (d/2 <= d̄ < d, as "
                f"Theorem 4.1 assumes), got {L}"
            )
    for k in ks:
        V.integer(k, "--ks", 1, model.config.vocab_size, f" (the vocabulary of {model.config.name})")
    _check_head_layers(model, [args.head], layers, "--head", "--exit-layers")  # before any decoding
    workload.check(args, workload.decoding(model, len(prompts), args.max_new_tokens, "greedy references"))
    totals: dict = {}
    for pr in tqdm(prompts, desc="match rates", unit="prompt"):
        g = generate(model, pr.text, "greedy", args.max_new_tokens, stop_at_eos=False, chat=True)
        rates = theory.match_rates(model, g.prompt_ids, g.token_ids, layers, ks, args.head)
        for cat in (pr.category, "all"):
            for L, by_k in rates.items():
                for k, (m, n) in by_k.items():
                    t = totals.setdefault(cat, {}).setdefault(L, {}).setdefault(k, [0, 0])
                    t[0] += m
                    t[1] += n
    p_hat = {
        cat: {L: {k: m / n for k, (m, n) in by_k.items()} for L, by_k in by_L.items()} for cat, by_L in totals.items()
    }
    report = {
        "command": _command_line(args),
        "model": model.config.name,
        "layers": d,
        "threads": threads,
        "head": args.head,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "counts": totals,
        "p_correct": p_hat,
        "predicted": {
            cat: {
                L: {k: theory.figures(d, L, k, p, args.max_new_tokens) for k, p in by_k.items()}
                for L, by_k in by_L.items()
            }
            for cat, by_L in p_hat.items()
        },
    }
    for cat, by_L in p_hat.items():
        print(
            cat.ljust(16)
            + "  ".join(f"d̄={L}: " + " ".join(f"k{k} {p:.3f}" for k, p in by_k.items()) for L, by_k in by_L.items())
        )
    if args.out:
        out = Path(args.out)
        write_json(out / "match_rates.json", report)
        for L in layers:
            theory.plot_tradeoff(
                {cat: by_L[L] for cat, by_L in p_hat.items()},
                d,
                L,
                out / f"tradeoff_d{L}.png",
                f"PPD trade-off on {model.config.name}: d={d}, d̄={L}, head {args.head} "
                f"(p̂ from {len(prompts)} Spec-Bench prompts × {args.max_new_tokens} tokens)",
            )
        _say(f"wrote {out / 'match_rates.json'} and {len(layers)} plots")
    return 0


@command(
    "eval ppd-parallel",
    help="PPD on k+1 real processes (gloo) against greedy: wall clock, communication time apart, exactness",
)
def _setup_parallel(p):
    _model_args(p)
    p.add_argument("--exit-layer", type=PPD_EXIT_LAYER.arg(), default=None, help="d̄ (default d/2)")
    p.add_argument("--k", type=O.K.arg(), default=1, help="sub-processes (default 1: two processes)")
    p.add_argument("--head", type=HEAD_ARG, default="auto", help="exit head: auto, shared, trained or a heads file")
    p.add_argument(
        "--head-on",
        default="sub",
        choices=["sub", "main"],
        help="which process runs the exit head (main: as the paper; sub: off the critical path)",
    )
    p.add_argument("--categories", type=V.names_arg, default="summarization,qa,translation,math_reasoning,writing")
    p.add_argument("--prompts", type=_positive_int, default=2, help="prompts per category (default 2)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=64)
    p.add_argument("--json", metavar="OUT.json", type=V.report_arg, default=None, help="write the report here")
    workload.add_args(p)


@_setup_parallel
def run_parallel(args) -> int:
    import torch
    from tqdm.auto import tqdm

    from ..decoding import generate
    from ..eval.ppd_parallel import ParallelPPD

    prompts = _read_prompts(None, _csv(args.categories), args.prompts)
    if args.device != "cpu":
        raise LayerleapError(f"--device {args.device}: eval ppd-parallel runs PPD on CPU processes: drop --device")
    threads = args.threads or 1
    print(f"$ {_command_line(args)}", flush=True)
    records = []

    def before_start(model) -> None:  # greedy on one unit, PPD, greedy on all units: per prompt
        _check_sizes(model, args)
        workload.check(args, workload.decoding(model, 3 * len(prompts), args.max_new_tokens))

    with ParallelPPD(
        args.model,
        args.exit_layer,
        args.k,
        args.head,
        args.head_on,
        threads=threads,
        dtype=args.dtype,
        check=before_start,
    ) as ex:
        model = ex.model
        _say(f"{args.k + 1} processes × {threads} thread(s), d̄={ex.dbar}, head {ex.exit_head.kind} on {args.head_on}")
        ids0 = generate(model, prompts[0].text, "greedy", 4, chat=True).prompt_ids
        ex.generate(ids0, 8, stop_at_eos=False)  # warm-up
        ping = {name: ex.ping_pong(n) for name, n in ex.message_sizes().items()}
        _say("round trip, no computation: " + ", ".join(f"{k} {1e6 * v:.0f} µs" for k, v in ping.items()))
        for pr in tqdm(prompts, desc="ppd-parallel", unit="prompt"):
            torch.set_num_threads(threads)
            g = generate(model, pr.text, "greedy", args.max_new_tokens, stop_at_eos=False, chat=True)
            r = ex.generate(g.prompt_ids, args.max_new_tokens, stop_at_eos=False)
            torch.set_num_threads(threads * (args.k + 1))
            g_all = generate(model, pr.text, "greedy", args.max_new_tokens, stop_at_eos=False, chat=True)
            records.append(
                {
                    "category": pr.category,
                    "id": pr.id,
                    "prompt_tokens": len(g.prompt_ids),
                    "greedy_s": g.stats["wall_s"],
                    "greedy_all_cores_s": g_all.stats["wall_s"],
                    "greedy_ttft_s": g.stats["ttft_s"],
                    "equal": r.token_ids == g.token_ids,
                    **{k: v for k, v in r.stats.items() if k != "run_lengths"},
                }
            )
    torch.set_num_threads(threads)

    def tot(key, rs):
        return sum(r[key] for r in rs)

    summary = {}
    for cat in list(dict.fromkeys(r["category"] for r in records)) + ["all"]:
        rs = [r for r in records if cat in ("all", r["category"])]
        m, n = tot("matches", rs), tot("trials", rs)
        dec = tot("wall_s", rs) - tot("ttft_s", rs)
        gdec = tot("greedy_s", rs) - tot("greedy_ttft_s", rs)
        summary[cat] = {
            "prompts": len(rs),
            "p_correct": m / n if n else None,
            "speedup_vs_greedy_1unit": tot("greedy_s", rs) / tot("wall_s", rs),
            "speedup_vs_greedy_all_cores": tot("greedy_all_cores_s", rs) / tot("wall_s", rs),
            "decode_speedup_vs_greedy_1unit": gdec / dec if dec > 0 else None,
            "predicted_speedup_units": tot("greedy_units", rs) / tot("latency_units", rs),
            "comm_share": tot("comm_s", rs) / tot("wall_s", rs),
            "comm_ms_per_token": 1000 * tot("comm_s", rs) / tot("new_tokens", rs),
            "ppd_ms_per_token": 1000 * tot("wall_s", rs) / tot("new_tokens", rs),
            "greedy_ms_per_token": 1000 * tot("greedy_s", rs) / tot("new_tokens", rs),
            "equal": f"{sum(r['equal'] for r in rs)}/{len(rs)}",
        }
    print(
        f"{'category':16} {'p̂':>6} {'greedy ms/t':>11} {'ppd ms/t':>9} {'vs 1 unit':>9} {'vs all cores':>12} "
        f"{'units pred':>10} {'comm ms/t':>9} {'=greedy':>7}"
    )
    print("round trip without computation: " + ", ".join(f"{k} {1e6 * v:.0f} µs" for k, v in ping.items()))
    for cat, s in summary.items():
        print(
            f"{cat:16} {_num(s['p_correct'], '6.3f'):>6} {s['greedy_ms_per_token']:11.1f} {s['ppd_ms_per_token']:9.1f} "
            f"{s['speedup_vs_greedy_1unit']:8.2f}x {s['speedup_vs_greedy_all_cores']:11.2f}x "
            f"{s['predicted_speedup_units']:9.2f}x {s['comm_ms_per_token']:9.2f} {s['equal']:>7}"
        )
    if args.json:
        write_json(
            args.json,
            {
                "command": _command_line(args),
                "model": model.config.name,
                "k": args.k,
                "exit_layer": ex.dbar,
                "head_on": args.head_on,
                "threads_per_unit": threads,
                "cores": __import__("os").cpu_count(),
                "round_trip_s": ping,
                "load_average": __import__("os").getloadavg(),
                "summary": summary,
                "records": records,
            },
        )
        print(f"wrote {args.json}")
    return 0


def _num(x, spec: str) -> str:
    """``x`` formatted, or "-" for a figure with nothing to measure (no early prediction to check)."""
    return "-" if x is None else format(x, spec)


def selfspec_summary(records: list[dict], labels: list[str]) -> dict:
    """``eval self-spec``'s table, per category and "all": tokens/s and speed against greedy as ratios of
    summed time, acceptance (kept over proposed drafts), tokens per round and p_correct (matches over
    trials) as ratios of the prompts' summed counts, and how many outputs equal greedy's."""

    def ratio(xs, num, den):
        return bench.ratio_of_sums((r[num], r[den]) for r in xs if r.get(den) is not None)

    summary = {}
    for cat in list(dict.fromkeys(r["category"] for r in records)) + ["all"]:
        rs = [r for r in records if cat in ("all", r["category"])]
        g_wall = sum(r["wall_s"] for r in rs if r["label"] == "greedy")
        row = {}
        for lb in labels:
            xs = [r for r in rs if r["label"] == lb]
            wall, toks = sum(r["wall_s"] for r in xs), sum(r["tokens"] for r in xs)
            row[lb] = {
                "tokens_per_s": toks / wall,
                "vs_greedy": g_wall / wall,
                "acceptance": ratio(xs, "accepted", "drafted"),
                "tokens_per_round": ratio(xs, "tokens", "rounds"),
                "p_correct": ratio(xs, "matches", "trials"),
                "equal": f"{sum(r['equal'] for r in xs)}/{len(xs)}",
            }
        summary[cat] = row
    return summary


@command(
    "eval self-spec",
    help="self-spec and ppd against greedy and transformers' assistant_early_exit on the "
    "same model and layer, interleaved per prompt",
)
def _setup_selfspec(p):
    _model_args(p)
    p.add_argument(  # one layer for self-spec, PPD and transformers alike: no "none"
        "--exit-layer", type=O.EXIT_LAYER.but(none="").arg(), default=15, help="the drafting / early-prediction layer"
    )
    p.add_argument(
        "--draft-lens",
        type=O.DRAFT_LEN.list_arg(),
        default="2,4",
        help="self-spec draft lengths (default 2,4)",
    )
    p.add_argument(
        "--min-confidence",
        type=O.MIN_CONFIDENCE.arg(),
        default=0.5,
        help="also run self-spec with this adaptive stop (0 = skip that variant)",
    )
    p.add_argument("--head", type=HEAD_ARG, default="auto", help="exit head: auto, shared, trained or a heads file")
    p.add_argument("--categories", type=V.names_arg, default="summarization,qa,translation,math_reasoning,writing")
    p.add_argument("--prompts", type=_positive_int, default=1)
    p.add_argument("--max-new-tokens", type=_positive_int, default=64)
    p.add_argument("--json", metavar="OUT.json", type=V.report_arg, default=None)
    workload.add_args(p)


@_setup_selfspec
def run_selfspec(args) -> int:
    import torch
    from tqdm.auto import tqdm

    from ..eval.bench import HFBaseline
    from ..decoding import generate

    prompts = _read_prompts(None, _csv(args.categories), args.prompts)
    threads = _threads(args.threads)
    print(f"$ {_command_line(args)}", flush=True)
    model = _load(args)
    E = args.exit_layer
    get_method("self-spec").check_options({"exit_layer": E}, model.config)
    ours = {"greedy": ("greedy", {})}
    for g in args.draft_lens:
        ours[f"self-spec g{g}"] = ("self-spec", {"exit_layer": E, "draft_len": g, "head": args.head})
    if args.min_confidence > 0:
        g = max(args.draft_lens)
        ours[f"self-spec g{g} c{args.min_confidence}"] = (
            "self-spec",
            {"exit_layer": E, "draft_len": g, "head": args.head, "min_confidence": args.min_confidence},
        )
    if 2 * E >= model.config.n_layers:
        ours["ppd k1 (emulated)"] = ("ppd", {"exit_layer": E, "k": 1, "head": args.head})
    hf = HFBaseline(model)
    hf_variants = {"transformers greedy": {}}
    for g in args.draft_lens:
        hf_variants[f"transformers assistant_early_exit g{g}"] = {
            "assistant_early_exit": E,
            "num_assistant_tokens": g,
            "num_assistant_tokens_schedule": "constant",
        }
    runs = (len(ours) + len(hf_variants)) * len(prompts)
    workload.check(args, workload.decoding(model, runs, args.max_new_tokens))
    records = []

    def hf_run(ids, n, extra):
        t = torch.tensor([ids])
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.hf.generate(
                t, attention_mask=torch.ones_like(t), do_sample=False, max_new_tokens=n, min_new_tokens=n, **extra
            )
        return out[0, t.shape[1] :].tolist(), time.perf_counter() - t0

    warm = generate(model, prompts[0].text, "greedy", 4, chat=True)
    for _label, (name, opts) in ours.items():
        generate(model, prompts[0].text, name, 8, chat=True, stop_at_eos=False, **opts)
    for extra in hf_variants.values():
        hf_run(warm.prompt_ids, 8, extra)
    for pr in tqdm(prompts, desc="self-spec", unit="prompt"):
        ref = None
        for label, (name, opts) in ours.items():
            r = generate(model, pr.text, name, args.max_new_tokens, stop_at_eos=False, chat=True, **opts)
            ref = ref or r
            keep = {
                k: r.stats.get(k)
                for k in (
                    "head",
                    "acceptance",
                    "tokens_per_round",
                    "p_correct",
                    "layers_per_token",
                    "latency_units",
                    "greedy_units",
                    "ttft_s",
                    "drafted",
                    "accepted",
                    "rounds",
                    "trials",
                    "matches",
                )
            }
            records.append(
                {
                    "category": pr.category,
                    "id": pr.id,
                    "label": label,
                    "wall_s": r.stats["wall_s"],
                    "tokens": len(r.token_ids),
                    "equal": r.token_ids == ref.token_ids,
                    **keep,
                }
            )
        for label, extra in hf_variants.items():
            toks, wall = hf_run(ref.prompt_ids, args.max_new_tokens, extra)
            records.append(
                {
                    "category": pr.category,
                    "id": pr.id,
                    "label": label,
                    "wall_s": wall,
                    "tokens": len(toks),
                    "equal": toks == ref.token_ids,
                }
            )
    summary = selfspec_summary(records, list(ours) + list(hf_variants))
    for cat, row in summary.items():
        print(f"== {cat}")
        for lb, s in row.items():
            extra = "".join(
                f" {k} {s[k]:.3f}" for k in ("acceptance", "tokens_per_round", "p_correct") if s[k] is not None
            )
            print(f"  {lb:42} {s['tokens_per_s']:6.1f} tok/s {s['vs_greedy']:5.2f}x ={s['equal']}{extra}")
    if args.json:
        write_json(
            args.json,
            {
                "command": _command_line(args),
                "model": model.config.name,
                "threads": threads,
                "exit_layer": E,
                "summary": summary,
                "records": records,
            },
        )
        print(f"wrote {args.json}")
    return 0
