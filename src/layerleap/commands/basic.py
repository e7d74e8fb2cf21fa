"""The basic subcommands: ``generate``, ``score``, ``methods``, ``info``, ``bench`` and ``demo``.

stdout carries the results (one JSON object with ``--json``); loading messages and progress go to
stderr.  Bad input raises ``LayerleapError`` (``cli.main`` turns it into one line and exit code 2);
argparse rejects malformed numbers the same way.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import textwrap
import time
import warnings
from pathlib import Path

import torch

from ..eval import bench, roofline
from ..core import cost_curve, kernels
from .. import validate as V, workload
from . import command
from ..datasets import read_prompts_file, spec_bench, spec_bench_categories
from ..decoding import (
    MAX_BATCH,
    MAX_LOGIT_BIAS,
    METHODS,
    BudgetWarning,
    Decoding,
    GenerationError,
    check_processors,
    generate,
    get_method,
    sampling_choice,
    score,
)
from ..methods.budget import LOSSY, check_has_budget, check_quality
from ..errors import LayerleapError
from ..core.grammar import Grammar
from ..core.logprobs import MAX_TOP
from ..core.loading import DEFAULT_MODEL, DTYPES, check_model
from ..core.run import row_seed
from ..core.text import MAX_STOPS
from ..files import json_text, reading
from ..options import ModelLoader, resolve_models, to_device
from ..eval.report import write_html_report
from ..streaming import stream

DEMO_PROMPT = "Explain in two sentences why the sky is blue."
DEMO_CATEGORIES = "qa,summarization"
DEMO_SAMPLING = {"temperature": 0.7, "top_p": 0.9, "seed": 0}  # for the method that samples by default
DEMO_HTML = "layerleap-demo.html"


# -- shared arguments and helpers -------------------------------------------------------------------
_positive_int = V.positive_int  # the argparse types of every command live in layerleap.validate
_model_arg = V.tagged(V._as_arg(lambda t: check_model(t, ""), label="model"), "in")


def _device(text: str) -> str:
    """``--device``: a torch device that exists here."""
    import torch

    try:
        dev = torch.device(text.strip())
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{V.show(text)} is not a torch device: write cpu or cuda") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text}: no CUDA device here: use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text}: layerleap runs on cpu or cuda")
    return text.strip()


def _model_args(p, dtype: str = "float32") -> None:
    p.add_argument(
        "--model",
        type=_model_arg,
        default=DEFAULT_MODEL,
        help=f"packaged model name or Hugging Face folder (default {DEFAULT_MODEL})",
    )
    p.add_argument("--dtype", default=dtype, choices=list(DTYPES), help=f"weight dtype (default {dtype})")
    p.add_argument(
        "--device", type=_device, default="cpu", help="torch device for the model(s), e.g. cuda (default cpu)"
    )
    p.add_argument("--threads", type=V.threads_arg, default=None, help="torch threads (default: all cores)")
    p.add_argument(
        "--variant",
        type=V.tagged(V.path_arg, "in"),
        default=None,
        help="a fine-tuned variant of --model: a .safetensors file of `layerleap finetune variant`, or the "
        "name of a variant shipped in layerleap/data/variants/MODEL/ (none ships for smollm2-135m)",
    )


DO_SAMPLE_HELP = "sample (a sampling flag above implies it; a method that decodes greedily only refuses both)"
BENCH_DO_SAMPLE_HELP = (
    "every method of the run that can sample samples (without it the sampling flags above apply to the methods "
    "that sample by default, such as sample; the others decode greedily, greedy among them)"
)


def _sampling_args(p, do_sample_help: str = DO_SAMPLE_HELP) -> None:
    p.add_argument("--temperature", type=V.temperature_arg, default=None, help="sampling temperature (default 1.0)")
    p.add_argument("--top-k", type=V.nonneg_int, default=None, help="keep the k most likely tokens (default 0: off)")
    p.add_argument(
        "--top-p",
        type=V.float_arg(0.0, 1.0, lo_open=True),
        default=None,
        help="nucleus sampling mass (default 1.0: off)",
    )
    p.add_argument("--seed", type=V.seed_arg, default=None, help=f"random seed for sampling (0 .. {V.SEED_MAX})")
    p.add_argument(
        "--do-sample",
        action="store_true",
        default=None,
        help=do_sample_help,
    )


def _sampling(args) -> dict:
    keys = (
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "typical_p",
        "seed",
        "do_sample",
    )  # (--min-p, --typical-p: generate's)
    return {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}


def _logit_bias_text(text: str) -> tuple[int, float]:
    token, sep, bias = text.partition("=")
    if not sep:
        raise V.InputError(f"must be TOKEN_ID=BIAS (e.g. 2=-100), got {V.show(text)}")
    t = V.integer(V._int_text(token, 0), "the token id", 0)
    b = V.number(V._float_text(bias, "number"), "the bias", -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
    return t, b


_logit_bias_arg = V._as_arg(_logit_bias_text, label="TOKEN_ID=BIAS")


def _processor_args(p) -> None:
    """The logits processors over each row's history, and the min-p warp (``generate``'s arguments)."""
    p.add_argument(
        "--min-p",
        type=V.probability_arg,
        default=None,
        help="sampling: drop the tokens less likely than this share of the likeliest one (default 0: off)",
    )
    p.add_argument(
        "--typical-p",
        type=V.float_arg(0.0, 1.0, lo_open=True),
        default=None,
        help="typical sampling: keep the tokens whose surprisal is nearest the entropy, up to this much probability "
        "(default 1.0: off)",
    )
    p.add_argument(
        "--repetition-penalty",
        type=V.positive_float,
        default=None,
        help="divide a positive logit (multiply another) of every token of the prompt and the text so far by it "
        "(default 1.0: off; 1.1-1.3 discourage repeats)",
    )
    for name, what in (("presence", "once if the token is in the text so far"), ("frequency", "once per time it is")):
        p.add_argument(
            f"--{name}-penalty",
            type=V.float_arg(-2.0, 2.0),
            default=None,
            help=f"subtract this from a token's logit {what} (in [-2, 2]; default 0: off)",
        )
    p.add_argument(
        "--logit-bias",
        action="append",
        type=_logit_bias_arg,
        metavar="TOKEN_ID=BIAS",
        help="add BIAS (in [-100, 100]) to the token's logit (repeatable; -100 bans the token)",
    )
    p.add_argument(
        "--min-tokens",
        type=V.nonneg_int,
        default=None,
        help="forbid the end-of-sequence tokens until the text holds this many tokens (default 0)",
    )
    p.add_argument(
        "--allowed-token-ids",
        action="extend",
        nargs="+",
        type=V.nonneg_int,
        metavar="TOKEN_ID",
        help="choose only among these token ids (default: all)",
    )
    p.add_argument(
        "--bad-words",
        action="extend",
        nargs="+",
        metavar="WORD",
        help="words the text never completes: their tokens, as they are and after a space (vLLM's bad_words)",
    )
    p.add_argument(
        "--no-repeat-ngram-size",
        type=V.nonneg_int,
        default=None,
        metavar="N",
        help="no N tokens in a row occur twice in the prompt and the text (transformers'; default 0: off)",
    )


PROCESSOR_FLAGS = {
    "repetition_penalty": "--repetition-penalty",
    "presence_penalty": "--presence-penalty",
    "frequency_penalty": "--frequency-penalty",
    "logit_bias": "--logit-bias",
    "min_tokens": "--min-tokens",
    "allowed_token_ids": "--allowed-token-ids",
    "bad_words": "--bad-words",
    "no_repeat_ngram_size": "--no-repeat-ngram-size",
}


def _processors(args, grammar, model=None) -> dict:
    """``generate``'s logits-processor arguments from the flags, checked against the method and
    ``--max-new-tokens`` before the model loads (the token ids against its vocabulary after: with
    ``model``, loaded)."""
    procs = {k: getattr(args, k) for k in PROCESSOR_FLAGS if getattr(args, k) is not None}
    if "logit_bias" in procs:
        procs["logit_bias"] = dict(procs["logit_bias"])  # a token given twice: the last bias
    tok = {} if model is None else {"tokenizer": model.tokenizer}
    try:
        vocab = None if model is None else model.config.vocab_size
        check_processors(get_method(args.method), vocab, args.max_new_tokens, grammar, **tok, **procs)
    except GenerationError as e:
        msg = str(e).replace(f"max_new_tokens={args.max_new_tokens}", f"--max-new-tokens {args.max_new_tokens}")
        msg = msg.replace("max_new_tokens", "--max-new-tokens")
        for k, flag in PROCESSOR_FLAGS.items():
            msg = msg.replace(f"{k}=", f"{flag} ").replace(k, flag)
        raise LayerleapError(msg.replace("use one that can", "use --method with one that can")) from None
    return procs


def _check_sampling(method: str, args) -> dict:
    """``generate``'s sampling arguments from the flags, with ``do_sample`` decided: any sampling flag
    written asks for sampling (``--temperature 1.0`` too); one that ``method`` would ignore is refused
    before loading (``decoding.sampling_choice``)."""
    sampling = _sampling(args)
    given = {k: v for k, v in sampling.items() if k != "do_sample"}
    return {**sampling, "do_sample": sampling_choice(get_method(method), getattr(args, "do_sample", None), given)}


def _given(args, *flags: str) -> list[str]:
    """Those of ``flags`` written on the command line (``args.argv``; a flag's full spelling)."""
    words = {a.split("=", 1)[0] for a in getattr(args, "argv", []) if a.startswith("--")}
    return [f for f in flags if f in words]


def _refuse_unused(args, flags: tuple[str, ...], why: str) -> None:
    """A flag that would be ignored ``why`` (e.g. "with --measure") is refused, never ignored."""
    used = _given(args, *flags)
    if used:
        raise LayerleapError(f"{', '.join(used)}: not used {why}: drop {'it' if len(used) == 1 else 'them'}")


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _state_cache_arg(p, who: str) -> None:
    """``--state-cache [DIR]`` of the trainers whose heads read a fixed layer of the frozen backbone
    (``train.state_cache``); ``who``: what the option does in this command."""
    from ..train.state_cache import default_root

    p.add_argument(
        "--state-cache",
        type=V.out_dir_arg,
        nargs="?",
        const=str(default_root()),
        default=None,
        metavar="DIR",
        help=f"{who}: keep the frozen backbone's hidden states in DIR (default {default_root()}), keyed by model, "
        "dtype, layers and data; the first pass stores them (bf16 shards) and later epochs and runs read them "
        "instead of running the model",
    )


def _threads(n: int | None) -> int:
    n = n or os.cpu_count() or 1
    torch.set_num_threads(n)
    return n


def _load(args, name: str | None = None):
    """The model ``--model`` (or ``name``) with ``--dtype`` (and ``--variant``, for ``--model`` only), on
    ``--device``."""
    from ..drafters.variants import load as load_variant

    variant = getattr(args, "variant", None) if name is None else None
    name = name or args.model
    t = time.perf_counter()
    model = to_device(
        load_variant(name, dtype=args.dtype, progress=_say, variant=variant), getattr(args, "device", "cpu")
    )
    _say(f"loaded {name}{f' variant {variant}' if variant else ''} ({args.dtype}) in {time.perf_counter() - t:.1f} s")
    _check_sizes(model, args)
    return model


def _need_tokenizer(model, args) -> None:
    """Commands that read text prompts need the model's tokenizer: say so, with the fix, right after loading."""
    if model.tokenizer is None:
        raise LayerleapError(
            f"--model {args.model} has no tokenizer (no tokenizer.json or tokenizer_config.json beside its weights): "
            "copy the tokenizer files of the model it was made from into its folder"
        )


def _check_sizes(model, args) -> None:
    """The arguments whose limits depend on the model (``--max-new-tokens``, ``--context``, ``--max-prompt-tokens``),
    checked before any heavy work."""
    ctx = model.config.max_position
    for opt in ("max_new_tokens", "context", "max_prompt_tokens"):
        n = getattr(args, opt, None)
        if isinstance(n, int) and n >= ctx:
            raise LayerleapError(
                f"--{opt.replace('_', '-')} {n} is beyond {model.config.name}'s context of {ctx} "
                f"tokens: give at most {ctx - 1}"
            )


def _ram_mb() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    except (ValueError, OSError, AttributeError):
        return 4096


def _start_with_methods(args, methods: bench.MethodSpecs):
    """Print the command, set the threads, load ``--model`` and the models that ``methods``' options
    name -> (threads, model, methods with those models loaded)."""
    print(f"$ {_command_line(args)}", flush=True)
    threads = _threads(args.threads)
    model = _load(args)
    _need_tokenizer(model, args)
    for label, (name, opts) in methods.items():  # the bounds on the model, before a second model loads
        bench.check_spec(label, name, opts, model.config)
    loader = _loader(args)
    return threads, model, {lb: (name, resolve_models(name, opts, loader)) for lb, (name, opts) in methods.items()}


def _loader(args) -> ModelLoader:
    """Loads the models that method options name (``--opt draft=NAME``) like ``--model``."""
    return ModelLoader(args.dtype, getattr(args, "device", "cpu"), progress=_say)


def _command_line(args) -> str:
    return shlex.join(["layerleap", *getattr(args, "argv", [])])


def _csv(text: str | None) -> list[str] | None:
    items = [s.strip() for s in (text or "").split(",") if s.strip()]
    return items or None


def _read_prompts(
    path: str | None, categories: list[str] | None, n: int | None, offset: int = 0, note: bool = False
) -> list:
    """Spec-Bench prompts: ``n`` per category after ``offset``.  A category named in ``categories`` that
    has none left is refused (a table without it would not say so); with ``note``, a category that gives
    fewer than ``n`` is said on stderr."""
    prompts = spec_bench(path, categories, n, offset)  # raises LayerleapError for an unreadable file
    where = path or "the shipped Spec-Bench"
    after = f" after --offset {offset}" if offset else ""
    got = {c: sum(p.category == c for p in prompts) for c in categories or spec_bench_categories(path)}
    empty = [c for c, k in got.items() if not k]
    if not prompts or (categories and empty):
        held = {c: sum(p.category == c for p in spec_bench(path, [c])) for c in empty}
        what = (
            f"no prompts of {', '.join(empty)} left in {where}{after} (it holds "
            f"{', '.join(f'{k} of {c}' for c, k in held.items())})"
            if categories
            else f"no prompts left in {where}{after} (its categories hold at most {max(held.values())})"
        )
        raise LayerleapError(
            f"{what}: lower --offset"
            + (" or leave them out of --categories" if categories and len(empty) < len(got) else "")
        )
    short = {c: k for c, k in got.items() if n is not None and k < n}
    if note and short:
        _say(
            f"note: {', '.join(f'{c} gives {k}' for c, k in short.items())} of the {n} prompts per category "
            f"asked ({where} holds no more{after})"
        )
    return prompts


def _check_writable(path: str | None, flag: str = "--json") -> None:
    """Try writing ``path`` (a temporary sibling is created and removed)."""
    if path:
        V.output_file(path, flag)


def _model_line(model, threads: int) -> str:
    from importlib.metadata import version  # the version without importing `transformers` (35 MB)

    return (
        f"model {model.config.name} ({model.dtype_name}), threads {threads}, "
        f"torch {torch.__version__}, transformers {version('transformers')}, {os.cpu_count()} cores"
    )


# -- generate ---------------------------------------------------------------------------------------
@command("generate", help="generate text from a prompt (or a file of prompts) with one decoding method")
def _setup_generate(p):
    _model_args(p)
    p.add_argument(
        "--method",
        default="greedy",
        help=f"decoding method: {', '.join(METHODS)} (default greedy; "
        "`layerleap methods` lists them with their options)",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--prompt", type=V.text_arg, help="the prompt text ('-' reads stdin, UTF-8, less its final newline)"
    )
    src.add_argument(
        "--prompts-file",
        type=V.in_stream_arg,
        metavar="FILE",
        help="prompts decoded as one batch (one after another, said on stderr, for a method that does "
        "not batch): FILE.jsonl holds a JSON string or an object with 'prompt', 'text', 'content' or "
        "Spec-Bench 'turns' a line, or with OpenAI's chat 'messages' (one conversation, in the chat template); "
        "any other file (a pipe too: <(...), /dev/stdin) one prompt a line",
    )
    p.add_argument("--max-new-tokens", type=_positive_int, default=64)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    _stop_args(p)
    _sampling_args(p)
    _processor_args(p)
    _opt_arg(p, "NAME=VALUE", "a method option (repeatable)")
    p.add_argument(
        "--quality",
        type=V.float_arg(0.0, 1.0, lo_open=True),
        default=None,
        help="lossy methods (skipdecode, calm, early-exit, bild): the share of greedy's quality to keep; "
        "runs the setting `layerleap calibrate` chose for it (default: the calibrated 0.95 setting "
        "where one exists, unless --opt sets the method's knobs)",
    )
    _grammar_args(p)
    p.add_argument(
        "--logprobs",
        type=V.int_arg(0, MAX_TOP),
        default=None,
        metavar="N",
        help=f"after the text, each token's log probability (the model's own, before sampling's warps and a "
        f"grammar's mask) and the N likeliest tokens there (0 .. {MAX_TOP}; 0: the token's alone); in --json, "
        "a 'logprobs' list",
    )
    out = p.add_mutually_exclusive_group()
    out.add_argument("--stream", action="store_true", help="print the text as tokens are accepted")
    out.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (text, token_ids, finish_reason, stats; logprobs with --logprobs) per prompt, "
        "one a line",
    )


def _stop_args(p) -> None:
    p.add_argument(
        "--stop",
        action="append",
        type=_stop_arg,
        metavar="TEXT",
        help=f"end the text before TEXT, which is not printed (repeatable, at most {MAX_STOPS}; "
        "the text as written: in bash, $'\\n\\n' is two newlines)",
    )
    p.add_argument(
        "--stop-token-ids",
        action="extend",
        nargs="+",
        type=V.nonneg_int,
        metavar="TOKEN_ID",
        help="end the text before any of these token ids (not printed; --min-tokens holds them off)",
    )


def _stops(args) -> dict:
    """``generate``'s ``stop`` and ``stop_token_ids`` from the flags (those given)."""
    out = {"stop": args.stop, "stop_token_ids": args.stop_token_ids}
    return {k: v for k, v in out.items() if v}


def _check_stops(args) -> None:
    if args.stop and len(args.stop) > MAX_STOPS:
        raise LayerleapError(f"--stop is given {len(args.stop)} times, more than {MAX_STOPS}: keep at most {MAX_STOPS}")


def _stop_text(text: str) -> str:
    V.text(text, "")
    if not text:
        raise V.InputError("is empty: give the text to stop at (in bash, $'\\n\\n' for two newlines)")
    return text


_stop_arg = V._as_arg(_stop_text, label="stop text")


def _grammar_args(p) -> None:
    """Structured output: one grammar the text must follow (``layerleap.Grammar``)."""
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--json-schema",
        metavar="SCHEMA",
        help="structured output: JSON that this JSON schema describes (a file, or the schema itself, {...})",
    )
    g.add_argument("--json-object", action="store_true", help="structured output: a JSON object")
    g.add_argument("--regex", metavar="PATTERN", help="structured output: text the regular expression matches")
    g.add_argument("--grammar", metavar="FILE", help="structured output: text of a GBNF (root ::= ...) or Lark grammar")


def _grammar(args):
    """The grammar the flags ask for, or None (read and checked before the model loads)."""
    grammar = _grammar_asked(args)
    return grammar.check() if grammar is not None else None


def _grammar_asked(args):
    if args.json_object:
        return Grammar.json()
    if args.regex is not None:
        return Grammar.regex(args.regex)
    if args.json_schema is not None:
        return Grammar.json(_json_schema(args.json_schema))
    if args.grammar is not None:
        return Grammar.gbnf(_text_file(args.grammar, "grammar file", "give a readable GBNF or Lark file"))
    return None


def _text_file(path: str, what: str, fix: str) -> str:
    """The UTF-8 text of a file a flag names, read within the input size limit (``/dev/zero`` must not grow
    the process)."""
    p = Path(path)
    if not p.exists() or p.is_dir():
        raise LayerleapError(f"{what} {path} {'is a folder' if p.is_dir() else 'not found'}: {fix}")
    with reading(path, what, fix):
        return V.utf8(V.read_bounded(p, f"{what} {path}"), f"{what} {path}")


def _json_schema(text: str) -> str:
    """``--json-schema``'s schema: the value itself when it reads as JSON ({...}, and [...], true or false,
    which ``Grammar.json`` refuses as no schema), else the text of the file it names."""
    t = text.strip()
    if not t:
        raise LayerleapError("--json-schema is empty: give a JSON schema file or the schema itself ({...})")
    if t[0] in "{[" or t in ("true", "false"):
        return text
    return _text_file(text, "JSON schema file", "give a readable JSON file or the schema itself")


def _opt_arg(p, metavar: str, what: str) -> None:
    p.add_argument(
        "--opt",
        action="append",
        metavar=metavar,
        help=f"{what}; a value is read as its option is declared: text for a file, model or choice "
        "option (head=1 names a file 1), else an int, float, true/false, none, a list when it has commas "
        "(schedule=30,28,26, tree=2,1,1), JSON when it starts with [ or {; draft= and small= name a model "
        "(a packaged name or a folder), loaded with --dtype and --device",
    )


def _stats_line(stats: dict, threads: int) -> str:
    ttft = f", first token {stats['ttft_s']:.3f} s" if stats.get("ttft_s") is not None else ""
    return (
        f"[{stats['method']}] {stats['new_tokens']} tokens in {stats['wall_s']:.2f} s "
        f"({stats['tokens_per_s']:.1f} tok/s{ttft}), {stats['model_calls']} model calls, "
        f"{stats['layers_per_token']:.1f} layers/token, {stats['tokens_per_call']:.2f} tokens/call, "
        f"threads {threads}"
    )


def _generate_prompts(args) -> list[str] | str:
    if args.prompts_file:
        prompts = read_prompts_file(args.prompts_file)
        if args.stream and len(prompts) > 1:
            raise LayerleapError(
                f"--stream prints one prompt's text as it comes; {args.prompts_file} holds "
                f"{len(prompts)}: drop --stream, or use --prompt"
            )
        return prompts
    prompt = _read_stdin() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        raise LayerleapError("the prompt is empty: give some text with --prompt")
    return prompt


def _read_stdin() -> str:
    if sys.stdin is None:
        raise LayerleapError("--prompt - reads stdin, but stdin is closed: pipe the prompt in or give it as text")
    data = V.read_bounded(sys.stdin.buffer, "the prompt on stdin (--prompt -)", "LAYERLEAP_MAX_PROMPT_MB")
    text = V.utf8(data, "the prompt on stdin").removeprefix("\ufeff")  # a byte-order mark is no text
    # the final newline ends the text's last line (echo, a file): it is no part of the prompt
    return text[:-2] if text.endswith("\r\n") else text.removesuffix("\n")


def _method_options(method: str, items: list[str] | None, quality: float | None = None) -> dict:
    """``--opt NAME=VALUE`` items of ``generate``, checked by the method's declarations (names, types, the
    bounds that do not depend on the model; a model-valued one must name a model) before any model is
    loaded.  With ``--quality`` a missing option is left to the calibration (or generate names the fix)."""
    options = bench.parse_assignments(items, method=method)
    get_method(method).check_options(options, partial=quality is not None)
    check_has_budget(method, quality)
    if quality is not None:
        check_quality(quality)  # whole hundredths, before the model loads
    _check_model_options(method, options)
    return options


def _check_model_options(method: str, options: dict, label: str = "") -> None:
    for k in get_method(method).models:
        if isinstance(options.get(k), str):
            check_model(options[k], f"--opt {label + '.' if label else ''}{k}")


@_setup_generate
def run_generate(args) -> int:
    options = _method_options(args.method, args.opt, args.quality)  # fail before loading the model
    sampling = _check_sampling(args.method, args)
    _check_stops(args)
    prompts = _generate_prompts(args)
    if isinstance(prompts, list) and get_method(args.method).batched and len(prompts) > MAX_BATCH:
        raise LayerleapError(
            f"--prompts-file {args.prompts_file} holds {len(prompts):,} prompts, beyond the {MAX_BATCH:,} that "
            f"method {args.method!r} decodes as one batch: split the file into several"
        )
    grammar = _grammar(args)
    if grammar is not None and not get_method(args.method).grammar:
        follow = ", ".join(n for n, m in METHODS.items() if m.grammar)
        raise LayerleapError(f"method {args.method!r} cannot follow a grammar: use --method with one of {follow}")
    procs = _processors(args, grammar)
    threads = _threads(args.threads)
    model = _load(args)
    _need_tokenizer(model, args)
    get_method(args.method).check_options(options, model.config, partial=args.quality is not None)
    kwargs = {**sampling, **procs, **resolve_models(args.method, options, _loader(args))}
    kwargs.update(_stops(args))
    if grammar is not None:
        kwargs["grammar"] = grammar
    if args.quality is not None:
        kwargs["quality"] = args.quality
    if args.logprobs is not None:
        kwargs["logprobs"] = args.logprobs
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", BudgetWarning)
        code = _generate(args, model, prompts, kwargs, threads)
    for msg in dict.fromkeys(str(w.message) for w in said if issubclass(w.category, BudgetWarning)):
        _say(msg)
    return code


def _generate(args, model, prompts, kwargs: dict, threads: int) -> int:
    if args.stream:
        s = stream(
            model,
            prompts[0] if isinstance(prompts, list) else prompts,
            args.method,
            args.max_new_tokens,
            chat=args.chat,
            **kwargs,
        )
        shown = False
        try:
            for piece in s:
                print(piece, end="", flush=True)
                shown = shown or bool(piece)
        except (KeyboardInterrupt, LayerleapError):  # the text so far ends its line before the error's
            if shown:
                print(flush=True)
            raise
        print()
        _print_logprobs(s.result)
        print(_stats_line(s.result.stats, threads))
        return 0
    res = _generate_with_progress(model, prompts, args, kwargs)
    for r in res if isinstance(res, list) else [res]:
        if args.json:
            print(json_text(r.to_dict()))
        else:
            print(r.text)
            _print_logprobs(r)
            print(_stats_line(r.stats, threads))
    return 0


def _print_logprobs(r) -> None:
    """``--logprobs``: one line a token: its log probability, its text (quoted) and the likeliest tokens."""
    for e in r.logprobs or ():
        top = "  ".join(f"{t.text!r} {t.logprob:.4f}" for t in e.top)
        print(f"{e.logprob:10.4f}  {e.text!r}" + (f"   top: {top}" if top else ""))


def _generate_with_progress(model, prompts, args, kwargs):
    """``generate``, with a tqdm bar of the new tokens on stderr (a long generation shows it is alive).
    A list of prompts decodes as one batch, or, for a method that does not batch, one prompt after
    another (said on stderr), prompt ``i`` seeded as its row of a batch would be (``seed + i``)."""
    from tqdm.auto import tqdm

    many = isinstance(prompts, list)
    calls = [(prompts, kwargs)]
    if many and not get_method(args.method).batched:
        _say(
            f"method {args.method!r} decodes one prompt at a time: decoding the {len(prompts)} prompts one after "
            "another"
        )
        seed = kwargs.get("seed")
        calls = [
            ([p], kwargs if seed is None else {**kwargs, "seed": row_seed(seed, i)}) for i, p in enumerate(prompts)
        ]
    bar = tqdm(
        total=(len(prompts) if many else 1) * args.max_new_tokens,
        desc=f"generate ({args.method})",
        unit="tok",
        leave=False,
    )
    results, done = [], 0
    try:
        for call, call_kwargs in calls:
            d = Decoding(model, call, args.method, args.max_new_tokens, chat=args.chat, **call_kwargs)
            for _ in d:
                bar.update(done + sum(len(d.tokens(i)) for i in range(len(d.prompt_ids))) - bar.n)
            results += d.results
            done += sum(len(r.token_ids) for r in d.results)
    finally:
        bar.close()
    return results if many else results[0]


# -- score ------------------------------------------------------------------------------------------
@command("score", help="the log probability of each token of a prompt under the model (its log-likelihood)")
def _setup_score(p):
    _model_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--prompt", type=V.text_arg, help="the text to score ('-' reads stdin, UTF-8, less its final newline)"
    )
    src.add_argument(
        "--prompts-file",
        type=V.in_stream_arg,
        metavar="FILE",
        help="texts scored as one batch, read as generate --prompts-file reads them",
    )
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument(
        "--top",
        type=V.int_arg(0, MAX_TOP),
        default=0,
        metavar="N",
        help=f"the N likeliest tokens at each position too (0 .. {MAX_TOP}; default 0)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (logprobs: one per token from the second, with its rank; logprob: their sum) "
        "per prompt, one a line",
    )


@_setup_score
def run_score(args) -> int:
    prompts = _generate_prompts(argparse.Namespace(prompts_file=args.prompts_file, prompt=args.prompt, stream=False))
    if isinstance(prompts, list) and len(prompts) > MAX_BATCH:
        raise LayerleapError(
            f"--prompts-file {args.prompts_file} holds {len(prompts):,} prompts, beyond the {MAX_BATCH:,} scored as "
            "one batch: split the file into several"
        )
    _threads(args.threads)
    model = _load(args)
    _need_tokenizer(model, args)
    many = isinstance(prompts, list)
    scored = score(model, prompts, args.top, chat=args.chat)
    for entries in scored if many else [scored]:
        total = sum(e.logprob for e in entries)
        if args.json:
            print(json_text({"logprob": total, "logprobs": [e.to_dict() for e in entries]}))
            continue
        for e in entries:
            top = "  ".join(f"{t.text!r} {t.logprob:.4f}" for t in e.top)
            print(f"{e.logprob:10.4f}  {e.text!r}  rank {e.rank}" + (f"   top: {top}" if top else ""))
        print(
            f"{len(entries)} token{'' if len(entries) == 1 else 's'} scored: log probability {total:.4f}"
            + (f" ({total / len(entries):.4f} a token)" if entries else "")
        )
    return 0


# -- methods ----------------------------------------------------------------------------------------
@command("methods", help="the decoding methods: options and defaults, whether exact, whether they batch and sample")
def _setup_methods(p):
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _option_text(o) -> str:
    """One option as ``layerleap methods`` lists it: name=default, type, bounds, what None means, meaning."""
    default = "required" if o.required else "none" if o.default is None else str(o.default)
    kind = "a model" if o.kind == "model" else o.kind
    bounds = f" {o.bounds_text()}" if o.bounds_text() else ""
    none = "".join(f"; {w}: {m}" for w, m in (("none", o.none), ("inf", o.inf)) if m)
    return f"{o.name}={default} ({kind}{bounds}{none}): {o.help}"


def methods_table() -> dict:
    """Every registered method: its options (defaults, and each one's type, bounds and meaning) and flags."""
    from ..decoding import METHODS as registry

    return {
        name: {
            "exact": m.exact,
            "batches": m.batched,
            "samples": m.sampling,
            "samples_by_default": m.default_sample,
            "grammar": m.grammar,
            "prompt_cache": m.prompt_cache,
            "options": {o.name: (None if o.required else o.default) for o in m.declared},
            "required": [o.name for o in m.declared if o.required],
            "model_options": list(m.models),
            "option_specs": {o.name: o.describe() for o in m.declared},
            "description": m.description,
        }
        for name, m in registry.items()
    }


@_setup_methods
def run_methods(args) -> int:
    from ..decoding import METHODS as registry

    if args.json:
        print(json_text(methods_table(), default=str))
        return 0
    yes = {True: "yes", False: "-"}
    print(f"{'method':16} {'exact':5} {'batches':7} {'samples':7} {'grammar':7} {'prefix':6}  description")
    for name, m in registry.items():
        flags = f"{yes[m.exact]:5} {yes[m.batched]:7} {yes[m.sampling]:7} {yes[m.grammar]:7} {yes[m.prompt_cache]:6}"
        print(f"{name:16} {flags}  {m.description}")
        for o in m.declared:
            print(f"{'':18}--opt {_option_text(o)}")
    print(
        "\nexact: its greedy output equals plain greedy decoding token for token (tested); batches: decodes a list "
        "of prompts as one batch (the others refuse more than one prompt); samples: supports temperature/top-k/top-p "
        "sampling (--do-sample, or any sampling flag); grammar: follows a grammar (structured output: "
        "generate(..., grammar=layerleap.Grammar...), the server's response_format); prefix: reuses a prompt cache "
        "(generate(..., prompt_cache=layerleap.PromptCache()), the server's --prompt-cache-mb; the others run "
        "their whole prompt).  Options go in as --opt "
        "NAME=VALUE (generate(..., NAME=VALUE) in Python); n_layers, vocab_size and context are the model's."
    )
    return 0


# -- info -------------------------------------------------------------------------------------------
@command("info", help="model facts, measured memory bandwidth and the decoding roofline")
def _setup_info(p):
    _model_args(p)
    p.add_argument(
        "--context", type=_positive_int, default=512, help="tokens in the KV cache for the roofline (default 512)"
    )
    p.add_argument(
        "--buffer-mb",
        type=V.int_arg(1, _ram_mb() // 4, "; at most a quarter of this machine's memory"),
        default=256,
        help="bandwidth test buffer (default 256 MB)",
    )
    p.add_argument("--repeats", type=V.int_arg(1, 1000), default=5, help="bandwidth timings, best kept (default 5)")
    p.add_argument(
        "--call-cost",
        action="store_true",
        help="also time one model call over 1 to 8 and 16 new tokens at a 256-token context, and save the "
        "curve for this machine: prompt lookup's and auto's chain cuts and the dynamic trees then price "
        "their calls by it",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def model_info(model, threads: int, context: int, buffer_mb: int, repeats: int) -> dict:
    c = model.config
    bw = roofline.measure_bandwidth(model.dtype, buffer_mb, repeats, cols=c.hidden_size)
    params = model.n_params()
    return {
        "model": c.name,
        "source": model.source,
        "model_type": c.model_type,
        "fingerprint": model.fingerprint,
        "dtype": model.dtype_name,
        "threads": threads,
        "cpu": kernels.cpu_signature(),
        "layers": c.n_layers,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "heads": c.n_heads,
        "kv_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "vocab_size": c.vocab_size,
        "max_position": c.max_position,
        "tie_embeddings": c.tie_embeddings,
        "parameters": params,
        "weight_bytes": model.weight_bytes() if model.dtype_name == "q4" else params * model.dtype.itemsize,
        "resident_weight_bytes": model.weight_bytes(),
        "kv_bytes_per_token": roofline.kv_bytes_per_token(model),
        "bandwidth": vars(bw),
        "roofline": roofline.roofline(model, bw, context).to_dict(),
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
        (
            "bandwidth",
            f"{bw['sum_gbs']:.1f} GB/s x.sum(), {bw['gemv_gbs']:.1f} GB/s gemv (F.linear of 1 row by "
            f"{'x'.join(map(str, bw['gemv_shape']))} {'column' if bw['column_major'] else 'row'}-major; "
            f"{bw['buffer_mb']:.0f} MB {bw['dtype']}, best of {bw['repeats']})",
        ),
        (
            "read/token",
            f"{_mb(rl['bytes_per_token'])} = {_mb(rl['weight_bytes_per_token'])} weights + "
            f"{rl['context']} × {rl['kv_bytes_per_token'] / 1e3:.1f} KB KV cache",
        ),
        (
            "roofline",
            f"{rl['ms_per_token_gemv']:.1f} ms/token = {rl['tokens_per_s_gemv']:.1f} tok/s at gemv "
            f"bandwidth; {rl['ms_per_token_sum']:.1f} ms/token = {rl['tokens_per_s_sum']:.1f} tok/s "
            f"at x.sum() bandwidth",
        ),
    ]
    return "\n".join(f"{k:<12} {v}" for k, v in rows)


@_setup_info
def run_info(args) -> int:
    threads = _threads(args.threads)
    model = _load(args)
    d = model_info(model, threads, args.context, args.buffer_mb, args.repeats)
    cc = roofline.call_cost(model, sizes=cost_curve.SIZES) if args.call_cost else None
    if cc is not None:
        d["call_cost"] = cc.to_dict()
        busy = cc.other_cpu_share is not None and cc.other_cpu_share > roofline.BUSY_SHARE
        kept = busy and cost_curve.saved(model) is not None  # a disturbed curve never replaces a saved one
        d["call_cost"]["saved"] = not kept and cost_curve.save(
            model, {p["new_tokens"]: p["ratio"] for p in cc.points}, cc.points[0]["ms"]
        )
        d["call_cost"]["kept_saved"] = kept
    if args.json:
        print(json_text(d))
    else:
        print(format_info(d))
        if cc is not None:
            print(roofline.format_call_cost(cc, d["roofline"]["ms_per_token_sum"]))
            where = cost_curve.cache_root() / cost_curve.FILE
            if d["call_cost"]["saved"]:
                print(f"saved for this machine in {where}")
            elif d["call_cost"]["kept_saved"]:
                print(f"not saved: other processes were running; the curve saved in {where} stays")
                print("(measure again when the machine is idle)")
            else:
                print(f"not saved: {where} cannot be written; set LAYERLEAP_CACHE to a writable folder")
    return 0


# -- bench ------------------------------------------------------------------------------------------
@command("bench", help="time methods against greedy and transformers on Spec-Bench prompts")
def _setup_bench(p):
    _model_args(p)
    p.add_argument(
        "--methods",
        type=V.names_arg,
        default=None,
        help="comma-separated METHOD or LABEL=METHOD (default: every "
        "method that needs no extra model); plain greedy is always run as the reference",
    )
    p.add_argument(
        "--categories", type=V.names_arg, default=None, help="comma-separated Spec-Bench categories (default: all)"
    )
    p.add_argument("--prompts", type=_positive_int, default=1, help="prompts per category (default 1)")
    p.add_argument(
        "--offset",
        type=V.int_arg(0, 1_000_000),
        default=0,
        help="skip this many prompts of each category first (default 0): held-out prompts for a second run",
    )
    p.add_argument("--max-new-tokens", type=_positive_int, default=64)
    p.add_argument(
        "--data", type=V.in_file_arg, default=None, help="a Spec-Bench question.jsonl (default: the shipped copy)"
    )
    workload.add_args(p)
    p.add_argument(
        "--baseline-hf",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time transformers generate on the same weights (default on)",
    )
    p.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    _sampling_args(p, BENCH_DO_SAMPLE_HELP)
    _opt_arg(
        p,
        "METHOD.NAME=VALUE",
        "a method option; METHOD is a label or a method name, NAME what follows the last dot (repeatable; a "
        "label's own option overrides its method's)",
    )
    p.add_argument(
        "--hf-extra",
        action="append",
        metavar="lookup[:N]|early-exit:E",
        help="also time transformers' prompt lookup (N draft tokens, default 10) or its "
        "assistant_early_exit=E self-speculative decoding (repeatable)",
    )
    p.add_argument(
        "--call-cost",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure the call-cost curve into the report first (default on, ~5 s)",
    )
    p.add_argument(
        "--quality",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure each lossy method's quality beside its speed: agreement with greedy's text, the "
        "reference score where the data has one, perplexity against greedy's (default on)",
    )
    p.add_argument(
        "--repeat",
        type=V.int_arg(1, 20),
        default=1,
        metavar="N",
        help="run each prompt's methods N rounds, round-robin, and keep each one's fastest run "
        "(for a shared, busy machine; default 1, at most 20)",
    )
    p.add_argument(
        "--json", metavar="OUT.json", type=V.report_arg, default=None, help="write the report here (after every prompt)"
    )
    p.add_argument(
        "--html",
        metavar="OUT.html",
        type=V.html_arg,
        default=None,
        help="also write the report as one self-contained HTML page with charts",
    )


def _bench_header(args, model, threads: int, n_prompts: int, methods: bench.MethodSpecs | None = None) -> str:
    head = f"{_model_line(model, threads)}\n{n_prompts} prompts × {args.max_new_tokens} new tokens"
    sampling = _sampling(args)
    sampled = [label for label, (name, _) in (methods or {}).items() if bench.samples(name, sampling)]
    if sampled:  # which rows sample, and how: the others decode greedily
        warps = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in sampling.items() if k != "do_sample") or "defaults"
        head += f"\nsampling ({warps}): {', '.join(sampled)}; the other rows decode greedily"
    return head


def _usable(model, methods: bench.MethodSpecs) -> bench.MethodSpecs:
    usable, skipped = bench.probe_methods(model, methods)
    for label, why in skipped.items():
        _say(f"skipping {label}: {why}")
    return usable


@_setup_bench
def run_bench(args) -> int:
    methods = bench.parse_methods(args.methods or ",".join(bench.runnable_methods()), args.opt)
    for label, (name, options) in methods.items():
        _check_model_options(name, options, label)
    _check_bench_sampling(methods, _sampling(args))
    if not args.baseline_hf:
        _refuse_unused(args, ("--hf-extra",), "with --no-baseline-hf (it times transformers beside its greedy)")
    cats = _csv(args.categories)
    prompts = _read_prompts(args.data, cats, args.prompts, args.offset, note=True)
    shipped = not args.data or spec_bench(args.data) == spec_bench(None)  # a copy of it: the same splits
    overlap = bench.calibration_overlap(methods, cats, args.prompts, args.offset) if shipped else None
    if overlap:
        _say(f"note: {overlap}")
    threads, model, methods = _start_with_methods(args, methods)
    if not args.methods:  # the default set: leave out methods that cannot run on their defaults
        methods = _usable(model, methods)
    hf_extra = {}
    for text in args.hf_extra or []:
        label, options = bench.parse_hf_extra(text, model.config.n_layers)
        if label in hf_extra:
            raise LayerleapError(f"--hf-extra {text}: {label} is given twice: give each transformers baseline once")
        hf_extra[label] = options
    runs = (len(methods) + 1 + bool(args.baseline_hf) + len(hf_extra)) * len(prompts) * args.repeat
    workload.check(args, workload.decoding(model, runs, args.max_new_tokens))
    print(_bench_header(args, model, threads, len(prompts), methods), flush=True)
    result = bench.run_bench(
        model,
        methods,
        prompts,
        args.max_new_tokens,
        hf_baseline=args.baseline_hf,
        chat=args.chat,
        sampling=_sampling(args),
        out=args.json,
        config={"command": _command_line(args)},
        call_cost=args.call_cost,
        hf_extra=hf_extra,
        repeat=args.repeat,
        quality=args.quality,
    )
    return _finish(result, args.json, args.html)


def _check_bench_sampling(methods: bench.MethodSpecs, sampling: dict) -> None:
    """Sampling flags apply to the methods of the run that sample (``bench.samples``): refuse them when
    none does, rather than ignore them."""
    if sampling and not any(bench.samples(name, sampling) for name, _ in methods.values()):
        flags = ", ".join("--" + k.replace("_", "-") for k in sampling)
        raise LayerleapError(
            f"{flags}: no method of this run samples ({', '.join(methods)}): add a method that samples by "
            "default (sample), or --do-sample for every method that can sample"
        )


def _finish(result: bench.BenchResult, out: str | None, html: str | None = None) -> int:
    """Print the table (and any failed runs), write the HTML page; the exit code: 130 interrupted, 1
    when a run failed, else 0."""
    print(result.table())
    for line in bench.failure_lines(result.failures):
        _say(line)
    share = result.config.get("other_cpu_share")
    if share is not None and share > roofline.BUSY_SHARE:
        print(f"other processes used {share:.0%} of the CPUs during the run: its times include their work")
    if out:
        print(f"wrote {out}")
    if html:
        write_html_report(result.to_dict(), html)
        print(f"wrote {html}")
    if result.interrupted:
        _say(f"interrupted: {result.prompts_done} of {result.config['n_prompts']} prompts finished")
        return 130
    return 1 if result.failures else 0


# -- demo -------------------------------------------------------------------------------------------
@command(
    "demo",
    help="every built-in method that needs no second model on one chat prompt, a small benchmark "
    "against transformers, and its HTML report",
)
def _setup_demo(p):
    _model_args(p)
    p.add_argument("--prompt", type=V.text_arg, default=DEMO_PROMPT, help="the chat prompt every method answers")
    p.add_argument(
        "--categories", type=V.names_arg, default=DEMO_CATEGORIES, help=f"bench categories (default {DEMO_CATEGORIES})"
    )
    p.add_argument("--max-new-tokens", type=_positive_int, default=32)
    p.add_argument("--json", metavar="OUT.json", type=V.report_arg, default=None, help="write the bench report here")
    p.add_argument(
        "--html",
        metavar="OUT.html",
        type=V.html_arg,
        default=DEMO_HTML,
        help=f"the bench report as an HTML page (default {DEMO_HTML})",
    )
    workload.add_args(p)


def method_blocks(results: dict, width: int | None = None, quality: dict | None = None) -> str:
    """Each generation as a block: its method, exactness and speed (and a lossy method's quality,
    ``quality[label]``), then its text, wrapped."""
    width = min(100, width or shutil.get_terminal_size((100, 24)).columns)
    blocks = []
    for label, r in results.items():
        s = r.stats
        exact = " (greedy-exact)" if get_method(s["method"]).exact and label != "sample" else ""
        head = (
            f"{label}: {s['new_tokens']} tokens, {s['tokens_per_s']:.1f} tok/s, "
            f"{s['tokens_per_call']:.2f} tokens/call, {s['layers_per_token']:.1f} layers/token{exact}"
        )
        if quality and label in quality:
            head += f"\n  {quality[label]}"
        body = [line for para in r.text.strip().splitlines() for line in (textwrap.wrap(para, width - 2) or [""])]
        blocks.append("\n".join([head] + ["  " + line for line in body]))
    return "\n\n".join(blocks)


def demo_quality(model, res, greedy, said=()) -> str:
    """One line: a lossy method's calibrated budget, its agreement with greedy's text and the full
    model's perplexity of its text against greedy's (and the budget's note when no faster setting met it)."""
    from ..eval import calibrate as C

    b = res.stats.get("quality_budget")
    parts = [f"calibrated to keep {b['quality']:.0%} of greedy's quality" if b else "not calibrated (its own defaults)"]
    if greedy is not None:
        agree = C.agreement(res.text, greedy.text)
        ppl = C.perplexity(model, res.prompt_ids, res.token_ids) / C.perplexity(
            model, greedy.prompt_ids, greedy.token_ids
        )
        parts.append(f"agreement with greedy {agree:.2f}, perplexity {ppl:.2f}x greedy's")
    parts += [str(w.message) for w in said if issubclass(w.category, BudgetWarning)]
    return "; ".join(parts)


@_setup_demo
def run_demo(args) -> int:
    t0 = time.perf_counter()
    if not args.prompt.strip():
        raise LayerleapError("--prompt is empty: give the chat prompt every method answers (or leave it out)")
    methods = bench.runnable_methods()
    prompts = _read_prompts(None, _csv(args.categories), 1)
    print(f"$ {_command_line(args)}", flush=True)
    threads = _threads(args.threads)
    model = _load(args)
    _need_tokenizer(model, args)
    methods = _usable(model, methods)
    bench_runs = (len(methods) + 1 + 1) * len(prompts)  # as bench: each method, greedy and transformers
    workload.check(args, workload.decoding(model, len(methods) + bench_runs, args.max_new_tokens))
    print(_model_line(model, threads))
    print(f"methods: {', '.join(methods)}; sampling: {DEMO_SAMPLING}\n\nprompt (chat): {args.prompt}\n")
    shown = {}
    for label, (name, options) in methods.items():
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always", BudgetWarning)
            sampling = DEMO_SAMPLING if bench.samples(name, DEMO_SAMPLING) else {}
            shown[label] = generate(model, args.prompt, name, args.max_new_tokens, chat=True, **sampling, **options)
        quality = {label: demo_quality(model, shown[label], shown.get("greedy"), said)} if name in LOSSY else None
        print(method_blocks({label: shown[label]}, quality=quality) + "\n", flush=True)
    print(
        f"bench: {len(prompts)} Spec-Bench prompts ({args.categories}) × {args.max_new_tokens} new tokens, "
        f"chat, each method then transformers, per prompt",
        flush=True,
    )
    result = bench.run_bench(
        model,
        methods,
        prompts,
        args.max_new_tokens,
        chat=True,
        sampling=DEMO_SAMPLING,
        out=args.json,
        config={"command": _command_line(args)},
    )
    rc = _finish(result, args.json, args.html)
    if rc != 130:  # an interrupted bench said so, with the prompts it finished (its report holds those)
        print(f"demo finished in {time.perf_counter() - t0:.0f} s; the report: {Path(args.html).resolve()}")
    return rc
