"""The basic subcommands: ``generate``, ``info``, ``bench`` and ``demo``.

stdout carries the results (one JSON object with ``--json``); loading messages and progress go to
stderr.  Bad input raises ``LayerleapError`` (``cli.main`` turns it into one line and exit code 2);
argparse rejects malformed numbers the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import textwrap
import time
from itertools import zip_longest

import torch

from .. import bench, methods as _builtin_methods, roofline  # noqa: F401  (registers the built-in methods)
from .. import validate as V
from ..cli import command
from ..datasets import spec_bench
from ..decoding import METHODS, generate, get_method
from ..errors import LayerleapError
from ..loading import DEFAULT_MODEL, check_model, load

DTYPES = ("float32", "bfloat16")
DEMO_PROMPT = "Explain in two sentences why the sky is blue."
DEMO_CATEGORIES = "qa,summarization"
DEMO_SAMPLING = {"temperature": 0.7, "top_p": 0.9, "seed": 0}  # greedy methods ignore these


# -- shared arguments and helpers -------------------------------------------------------------------
_positive_int = V.positive_int  # the argparse types of every command live in layerleap.validate
_model_arg = V._as_arg(lambda t: check_model(t, ""), label="model")


def _model_args(p, dtype: str = "float32") -> None:
    p.add_argument("--model", type=_model_arg, default=DEFAULT_MODEL, help=f"packaged model name or Hugging "
                   f"Face folder (default {DEFAULT_MODEL})")
    p.add_argument("--dtype", default=dtype, choices=DTYPES, help=f"weight dtype (default {dtype})")
    p.add_argument("--threads", type=V.threads_arg, default=None, help="torch threads (default: all cores)")


def _sampling_args(p) -> None:
    p.add_argument("--temperature", type=V.positive_float, default=None, help="sampling temperature (default 1.0)")
    p.add_argument("--top-k", type=V.nonneg_int, default=None, help="keep the k most likely tokens (default 0: off)")
    p.add_argument("--top-p", type=V.float_arg(0.0, 1.0, lo_open=True), default=None,
                   help="nucleus sampling mass (default 1.0: off)")
    p.add_argument("--seed", type=V.seed_arg, default=None, help=f"random seed for sampling (0 .. {V.SEED_MAX})")


def _sampling(args) -> dict:
    keys = ("temperature", "top_k", "top_p", "seed")
    return {k: getattr(args, k) for k in keys if getattr(args, k) is not None}


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _threads(n: int | None) -> int:
    n = n or os.cpu_count() or 1
    torch.set_num_threads(n)
    return n


def _load(args):
    """Load ``--model``, then check the sizes that depend on it (``--max-new-tokens``, ``--context``)
    before any heavy work."""
    t = time.perf_counter()
    model = load(args.model, dtype=args.dtype, progress=_say)
    _say(f"loaded {args.model} ({args.dtype}) in {time.perf_counter() - t:.1f} s")
    _check_sizes(model, args)
    return model


def _check_sizes(model, args) -> None:
    """The arguments whose limits depend on the model (``--max-new-tokens``, ``--context``)."""
    ctx = model.config.max_position
    for opt in ("max_new_tokens", "context"):
        n = getattr(args, opt, None)
        if isinstance(n, int) and n >= ctx:
            raise LayerleapError(f"--{opt.replace('_', '-')} {n} is beyond {model.config.name}'s context of {ctx} "
                                 f"tokens: give at most {ctx - 1}")


def _ram_mb() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    except (ValueError, OSError, AttributeError):
        return 4096


def _command_line(args) -> str:
    return shlex.join(["layerleap", *getattr(args, "argv", [])])


def _csv(text: str | None) -> list[str] | None:
    items = [s.strip() for s in (text or "").split(",") if s.strip()]
    return items or None


def _read_prompts(path: str | None, categories: list[str] | None, n: int) -> list:
    prompts = spec_bench(path, categories, n)  # raises LayerleapError for an unreadable file
    if not prompts:
        raise LayerleapError(f"no prompts selected from {path or 'the shipped Spec-Bench'}")
    return prompts


def _check_writable(path: str | None, name: str = "output") -> None:
    """Try writing ``path`` (a temporary sibling is created and removed)."""
    if path:
        V.output_file(path, name)


def _model_line(model, threads: int) -> str:
    import transformers
    return (f"model {model.config.name} ({str(model.dtype).removeprefix('torch.')}), threads {threads}, "
            f"torch {torch.__version__}, transformers {transformers.__version__}, {os.cpu_count()} cores")


# -- generate ---------------------------------------------------------------------------------------
@command("generate", help="generate text from a prompt with one decoding method")
def _setup_generate(p):
    _model_args(p)
    p.add_argument("--method", default="greedy", help=f"decoding method: {', '.join(METHODS)} (default greedy)")
    p.add_argument("--prompt", type=V.text_arg, required=True, help="the prompt text ('-' reads stdin, UTF-8)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=64)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    _sampling_args(p)
    p.add_argument("--opt", action="append", metavar="NAME=VALUE", help="a method option (repeatable); values "
                   "are read as int, float, true/false or text")
    p.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")


def _stats_line(stats: dict, threads: int) -> str:
    ttft = f", first token {stats['ttft_s']:.3f} s" if stats.get("ttft_s") is not None else ""
    return (f"[{stats['method']}] {stats['new_tokens']} tokens in {stats['wall_s']:.2f} s "
            f"({stats['tokens_per_s']:.1f} tok/s{ttft}), {stats['model_calls']} model calls, "
            f"{stats['layers_per_token']:.1f} layers/token, {stats['tokens_per_call']:.2f} tokens/call, "
            f"threads {threads}")


@_setup_generate
def run_generate(args) -> int:
    options = _method_options(args.method, args.opt)  # fail before loading the model
    prompt = _read_stdin() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        raise LayerleapError("the prompt is empty: give some text with --prompt")
    threads = _threads(args.threads)
    model = _load(args)
    options = _load_model_options(options, args.dtype)
    res = generate(model, prompt, args.method, args.max_new_tokens, chat=args.chat,
                   **{**_sampling(args), **options})
    if args.json:
        print(json.dumps(res.to_dict()))
    else:
        print(res.text)
        print(_stats_line(res.stats, threads))
    return 0


MODEL_OPTIONS = ("draft", "small")  # method options that take a second model (a name or folder on the CLI)


def _method_options(method: str, items: list[str] | None) -> dict:
    """``--opt NAME=VALUE`` items of ``generate``, checked against the method's options."""
    allowed = get_method(method).options()
    options = dict(bench.parse_assignments(items))
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise LayerleapError(f"method {method!r} has no option {', '.join(unknown)}; its options: "
                             f"{', '.join(allowed) or 'none'}")
    missing = bench.required_options(method, options)
    if missing:
        raise LayerleapError(f"method {method!r} needs the option {missing[0]}: add --opt {missing[0]}=VALUE")
    for k in MODEL_OPTIONS:
        if isinstance(options.get(k), str):
            check_model(options[k], f"--opt {k}")
    return options


def _load_model_options(options: dict, dtype: str) -> dict:
    """Model-valued options given as names or folders, loaded (same dtype as --model)."""
    out = dict(options)
    for k in MODEL_OPTIONS:
        if isinstance(out.get(k), str):
            out[k] = load(out[k], dtype=dtype, progress=_say)
            _say(f"loaded {options[k]} as {k}=")
    return out


def _read_stdin() -> str:
    if sys.stdin is None:
        raise LayerleapError("--prompt - reads stdin, but stdin is closed: pipe the prompt in or give it as text")
    return V.utf8(sys.stdin.buffer.read(), "the prompt on stdin")


# -- info -------------------------------------------------------------------------------------------
@command("info", help="model facts, measured memory bandwidth and the decoding roofline")
def _setup_info(p):
    _model_args(p)
    p.add_argument("--context", type=_positive_int, default=512,
                   help="tokens in the KV cache for the roofline (default 512)")
    p.add_argument("--buffer-mb", type=V.int_arg(1, _ram_mb() // 4, "; at most a quarter of this machine's memory"),
                   default=256, help="bandwidth test buffer (default 256 MB)")
    p.add_argument("--repeats", type=V.int_arg(1, 1000), default=5, help="bandwidth timings, best kept (default 5)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def model_info(model, threads: int, context: int, buffer_mb: int, repeats: int) -> dict:
    c = model.config
    bw = roofline.measure_bandwidth(model.dtype, buffer_mb, repeats, cols=c.hidden_size)
    params = model.n_params()
    return {
        "model": c.name, "source": model.source, "model_type": c.model_type, "fingerprint": model.fingerprint,
        "dtype": str(model.dtype).removeprefix("torch."), "threads": threads,
        "layers": c.n_layers, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "heads": c.n_heads, "kv_heads": c.n_kv_heads, "head_dim": c.head_dim, "vocab_size": c.vocab_size,
        "max_position": c.max_position, "tie_embeddings": c.tie_embeddings,
        "parameters": params, "weight_bytes": params * model.dtype.itemsize,
        "resident_weight_bytes": model.weight_bytes(),
        "kv_bytes_per_token": roofline.kv_bytes_per_token(model),
        "bandwidth": vars(bw), "roofline": roofline.roofline(model, bw, context).to_dict(),
    }


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def format_info(d: dict) -> str:
    bw, rl = d["bandwidth"], d["roofline"]
    rows = [
        ("model", f"{d['model']} ({d['model_type']}, fingerprint {d['fingerprint']})"),
        ("source", d["source"] or "-"),
        ("dtype", f"{d['dtype']}, threads {d['threads']}"),
        ("layers", d["layers"]),
        ("hidden size", f"{d['hidden_size']} (MLP {d['intermediate_size']})"),
        ("heads", f"{d['heads']} query, {d['kv_heads']} key/value, head dim {d['head_dim']}"),
        ("vocab", d["vocab_size"]),
        ("context", d["max_position"]),
        ("parameters", f"{d['parameters'] / 1e6:.1f} M"),
        ("weights", f"{_mb(d['weight_bytes'])} ({_mb(d['resident_weight_bytes'])} resident)"),
        ("KV cache", f"{d['kv_bytes_per_token'] / 1e3:.1f} KB per token"),
        ("bandwidth", f"{bw['sum_gbs']:.1f} GB/s x.sum(), {bw['gemv_gbs']:.1f} GB/s gemv (F.linear of 1 row by "
                      f"{'x'.join(map(str, bw['gemv_shape']))} {'column' if bw['column_major'] else 'row'}-major; "
                      f"{bw['buffer_mb']:.0f} MB {bw['dtype']}, best of {bw['repeats']})"),
        ("read/token", f"{_mb(rl['bytes_per_token'])} = {_mb(rl['weight_bytes_per_token'])} weights + "
                       f"{rl['context']} × {rl['kv_bytes_per_token'] / 1e3:.1f} KB KV cache"),
        ("roofline", f"{rl['ms_per_token_gemv']:.1f} ms/token = {rl['tokens_per_s_gemv']:.1f} tok/s at gemv "
                     f"bandwidth; {rl['ms_per_token_sum']:.1f} ms/token = {rl['tokens_per_s_sum']:.1f} tok/s "
                     f"at x.sum() bandwidth"),
    ]
    return "\n".join(f"{k:<12} {v}" for k, v in rows)


@_setup_info
def run_info(args) -> int:
    threads = _threads(args.threads)
    model = _load(args)
    d = model_info(model, threads, args.context, args.buffer_mb, args.repeats)
    print(json.dumps(d) if args.json else format_info(d))
    return 0


# -- bench ------------------------------------------------------------------------------------------
@command("bench", help="time methods against greedy and transformers on Spec-Bench prompts")
def _setup_bench(p):
    _model_args(p)
    p.add_argument("--methods", default=None, help="comma-separated METHOD or LABEL=METHOD (default: every "
                   "method that needs no extra model); plain greedy is always run as the reference")
    p.add_argument("--categories", default=None, help="comma-separated Spec-Bench categories (default: all)")
    p.add_argument("--prompts", type=_positive_int, default=1, help="prompts per category (default 1)")
    p.add_argument("--max-new-tokens", type=_positive_int, default=64)
    p.add_argument("--data", type=V.in_file_arg, default=None,
                   help="a Spec-Bench question.jsonl (default: the shipped copy)")
    p.add_argument("--baseline-hf", action=argparse.BooleanOptionalAction, default=True,
                   help="also time transformers generate on the same weights (default on)")
    p.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    _sampling_args(p)
    p.add_argument("--opt", action="append", metavar="METHOD.NAME=VALUE",
                   help="a method option; METHOD is a label or a method name (repeatable)")
    p.add_argument("--json", metavar="OUT.json", type=V.report_arg, default=None,
                   help="write the report here (after every prompt)")


def _bench_header(args, model, threads: int, n_prompts: int) -> str:
    return f"{_model_line(model, threads)}\n{n_prompts} prompts × {args.max_new_tokens} new tokens"


def _usable(model, methods: bench.MethodSpecs) -> bench.MethodSpecs:
    usable, skipped = bench.probe_methods(model, methods)
    for label, why in skipped.items():
        _say(f"skipping {label}: {why}")
    return usable


@_setup_bench
def run_bench(args) -> int:
    methods = bench.parse_methods(args.methods or ",".join(bench.runnable_methods()), args.opt)
    for name, options in methods.values():
        for k in MODEL_OPTIONS:
            if isinstance(options.get(k), str):
                check_model(options[k], f"--opt {name}.{k}")
    prompts = _read_prompts(args.data, _csv(args.categories), args.prompts)
    print(f"$ {_command_line(args)}", flush=True)
    threads = _threads(args.threads)
    model = _load(args)
    methods = {label: (name, _load_model_options(options, args.dtype)) for label, (name, options) in methods.items()}
    if not args.methods:  # the default set: leave out methods that cannot run on their defaults
        methods = _usable(model, methods)
    print(_bench_header(args, model, threads, len(prompts)), flush=True)
    result = bench.run_bench(model, methods, prompts, args.max_new_tokens, hf_baseline=args.baseline_hf,
                             chat=args.chat, sampling=_sampling(args), out=args.json,
                             config={"command": _command_line(args)})
    return _finish(result, args.json)


def _finish(result: bench.BenchResult, out: str | None) -> int:
    print(result.table())
    if out:
        print(f"wrote {out}")
    if result.interrupted:
        _say(f"interrupted: {result.prompts_done} of {result.config['n_prompts']} prompts finished")
        return 130
    return 0


# -- demo -------------------------------------------------------------------------------------------
@command("demo", help="side-by-side generation and a small benchmark on the embedded model")
def _setup_demo(p):
    _model_args(p)
    p.add_argument("--prompt", type=V.text_arg, default=DEMO_PROMPT,
                   help="the chat prompt of the side-by-side generation")
    p.add_argument("--categories", default=DEMO_CATEGORIES, help=f"bench categories (default {DEMO_CATEGORIES})")
    p.add_argument("--max-new-tokens", type=_positive_int, default=48)
    p.add_argument("--json", metavar="OUT.json", type=V.report_arg, default=None, help="write the bench report here")


def side_by_side(results: dict, width: int | None = None) -> str:
    """Texts of several generations in columns, each headed by its method and speed."""
    width = width or shutil.get_terminal_size((120, 24)).columns
    col = max(24, (width - 3 * (len(results) - 1)) // max(1, len(results)))
    columns = []
    for label, r in results.items():
        head = f"{label}: {r.stats['new_tokens']} tokens, {r.stats['tokens_per_s']:.1f} tok/s"
        body = [line for para in r.text.strip().splitlines() for line in (textwrap.wrap(para, col) or [""])]
        columns.append([head[:col], "-" * min(col, len(head))] + body)
    return "\n".join(" | ".join(c.ljust(col) for c in cells).rstrip()
                     for cells in zip_longest(*columns, fillvalue=""))


@_setup_demo
def run_demo(args) -> int:
    t0 = time.perf_counter()
    methods = bench.runnable_methods()
    prompts = _read_prompts(None, _csv(args.categories), 1)
    print(f"$ {_command_line(args)}", flush=True)
    threads = _threads(args.threads)
    model = _load(args)
    methods = _usable(model, methods)
    print(_model_line(model, threads))
    print(f"methods: {', '.join(methods)}; sampling: {DEMO_SAMPLING}\n\nprompt (chat): {args.prompt}\n")
    shown = {m: generate(model, args.prompt, m, args.max_new_tokens, chat=True, **DEMO_SAMPLING)
             for m in ("greedy", "sample") if m in methods}
    print(side_by_side(shown))
    print(f"\nbench: {len(prompts)} Spec-Bench prompts ({args.categories}) × {args.max_new_tokens} new tokens, "
          f"chat, each method then transformers, per prompt", flush=True)
    result = bench.run_bench(model, methods, prompts, args.max_new_tokens, chat=True, sampling=DEMO_SAMPLING,
                             out=args.json, config={"command": _command_line(args)})
    rc = _finish(result, args.json)
    print(f"demo finished in {time.perf_counter() - t0:.0f} s")
    return rc
