"""llama.cpp (through `llama-cpp-python`) against layerleap on the very same GGUF file.

For every prompt, at each thread count: llama.cpp greedy, llama.cpp's prompt lookup decoding
(the binding's ``LlamaPromptLookupDecoding`` as ``draft_model``), then layerleap's methods in each
dtype, all on the same prompt token ids (layerleap's tokenizer and chat template) and each producing
exactly ``--max-new-tokens`` tokens (EOS stops neither engine: layerleap runs with
``stop_at_eos=False``, and llama.cpp's token generator never checks EOS, unlike its completion
API).  Reported per prompt and summed: end-to-end tok/s, the time to the first token (prefill),
decode tok/s (the tokens after the first over the time after it) and the token agreement with
llama.cpp greedy (the first position where the tokens differ).  llama.cpp runs the GGUF's own
quantized weights; layerleap loads the same file through its converter in the dtype asked for.

    make llamacpp   # = pip install -e '.[llamacpp]': builds llama.cpp from source, ~8 min on 2 cores
    python benchmarks/llamacpp_vs_layerleap.py --dtypes float32,bfloat16 --threads 1,2 \\
        --categories summarization,qa,translation,math_reasoning,writing --prompts 1 --max-new-tokens 64 \\
        --json docs/results/llamacpp_vs_layerleap.json

``--dtypes`` takes any dtype that ``layerleap.load`` accepts; ``--methods greedy,self-spec --opt
self-spec.draft_len=4`` adds layerleap methods (names from ``layerleap.METHODS``).  The JSON report
(written atomically after every prompt) records the CPU model and flags, the versions, the thread
counts, the load average before and after, and the command line.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch

import layerleap
from layerleap.eval.bench import parse_methods
from layerleap.datasets import Prompt, spec_bench
from layerleap.decoding import chat_token_ids
from layerleap.errors import LayerleapError
from layerleap.eval.quality import common_prefix
from layerleap.files import atomic_write, write_json
from layerleap.core.loading import PACKAGED, _gguf_parts, cache_root

LLAMA_GREEDY, LLAMA_LOOKUP = "llama.cpp greedy", "llama.cpp lookup"
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")
WARMUP_TOKENS = 8


# -- the GGUF file and the machine ------------------------------------------------------------------
def gguf_file(name: str) -> Path:
    """The packaged model's GGUF as one file: the shipped file itself, or its chunks joined once into
    the layerleap cache (``<cache>/<name>-<size in hex>.gguf``, written atomically)."""
    if name not in PACKAGED:
        raise LayerleapError(f"unknown packaged model {name!r}: choose one of {', '.join(PACKAGED)}")
    parts = _gguf_parts(PACKAGED[name])
    if len(parts) == 1:
        return parts[0]
    size = sum(p.stat().st_size for p in parts)
    out = cache_root() / f"{name}-{size:x}.gguf"
    if not out.is_file() or out.stat().st_size != size:

        def join(tmp: Path) -> None:
            with open(tmp, "wb") as dst:
                for p in parts:
                    with open(p, "rb") as src:
                        shutil.copyfileobj(src, dst, 16 << 20)

        print(f"joining {len(parts)} chunks into {out} …", file=sys.stderr, flush=True)
        atomic_write(out, join)
    return out


def cpu_info() -> dict:
    """CPU model, family/model numbers and the vector-extension flags that matter here."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() not in fields:
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    flags = set(fields.get("flags", "").split())
    return {
        "model_name": fields.get("model name", platform.processor() or "?"),
        "vendor": fields.get("vendor_id"),
        "family": fields.get("cpu family"),
        "model": fields.get("model"),
        "flags": {f: f in flags for f in CPU_FLAGS},
        "cores": os.cpu_count(),
    }


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def thread_nice() -> list[int]:
    """The nice value of each of this process's threads (a thread niced below its peers stalls the
    others at every barrier on a busy machine, so a report says when that happened)."""
    out = []
    for stat in Path("/proc/self/task").glob("*/stat"):
        try:
            out.append(int(stat.read_text().rsplit(")", 1)[1].split()[16]))
        except (OSError, IndexError, ValueError):
            pass
    return sorted(out)


# -- one measured run -----------------------------------------------------------------------------
@dataclass
class Record:
    threads: int
    prompt_index: int
    prompt_id: int
    category: str
    prompt_tokens: int
    label: str
    engine: str
    dtype: str  # layerleap's dtype; for llama.cpp the GGUF's own weights
    method: str
    options: dict
    new_tokens: int
    wall_s: float
    ttft_s: float
    load_before: list[float]
    nice_before: int  # the highest nice value among the process's threads
    token_ids: list[int] = field(default_factory=list)
    counters: dict = field(default_factory=dict)  # model calls, drafted tokens where the engine tells
    agree_llamacpp: int | None = None  # leading tokens equal to llama.cpp greedy's (= new_tokens: all)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s

    @property
    def decode_tokens_per_s(self) -> float:
        return (self.new_tokens - 1) / (self.wall_s - self.ttft_s)

    def to_dict(self) -> dict:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s, "decode_tokens_per_s": self.decode_tokens_per_s}


class CountingLookup:
    """The binding's ``LlamaPromptLookupDecoding``, counting its calls (one per model call after the
    prompt) and the tokens it proposed."""

    def __init__(self, max_ngram_size: int, num_pred_tokens: int):
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.inner = LlamaPromptLookupDecoding(max_ngram_size=max_ngram_size, num_pred_tokens=num_pred_tokens)
        self.calls = self.drafted = 0

    def __call__(self, input_ids, /, **kwargs):
        out = self.inner(input_ids, **kwargs)
        self.calls += 1
        self.drafted += len(out)
        return out


class LlamaCpp:
    """One llama.cpp context on the GGUF file, greedy (temperature 0, top-k 1, no penalties)."""

    def __init__(self, path: Path, threads: int, n_ctx: int, lookup: tuple[int, int] | None = None):
        from llama_cpp import Llama

        self.draft = CountingLookup(*lookup) if lookup else None
        self.llm = Llama(
            str(path),
            n_ctx=n_ctx,
            n_batch=n_ctx,
            n_threads=threads,
            n_threads_batch=threads,
            draft_model=self.draft,
            verbose=False,
        )
        self.params = {
            "n_ctx": n_ctx,
            "n_batch": self.llm.n_batch,
            "n_ubatch": self.llm.context_params.n_ubatch,
            "n_threads": threads,
            "n_threads_batch": threads,
            "flash_attn": "binding default (off)",
            "lookup": {"max_ngram_size": lookup[0], "num_pred_tokens": lookup[1]} if lookup else None,
        }

    def generate(self, prompt_ids: list[int], n: int) -> tuple[list[int], float, float]:
        """-> (n new token ids, wall s, time to the first token s); the whole prompt is evaluated
        anew every time (no prefix reuse from the previous call)."""
        self.llm.reset()
        if self.draft is not None:
            self.draft.calls = self.draft.drafted = 0
        out: list[int] = []
        t0 = time.perf_counter()
        ttft = 0.0
        for tok in self.llm.generate(prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            if not out:
                ttft = time.perf_counter() - t0
            out.append(int(tok))
            if len(out) == n:
                break
        return out, time.perf_counter() - t0, ttft

    def counters(self) -> dict:
        """Model calls (the prompt's included) and drafted tokens of the last ``generate`` (lookup only:
        the binding asks the draft model once before every model call after the prompt)."""
        return {"model_calls": self.draft.calls + 1, "drafted": self.draft.drafted} if self.draft else {}


# -- the run --------------------------------------------------------------------------------------
@dataclass
class Setup:
    gguf: Path
    prompts: list[Prompt]
    prompt_ids: list[list[int]]
    models: dict[str, layerleap.Transformer]  # dtype -> model
    methods: dict[str, tuple[str, dict]]
    max_new_tokens: int
    lookup: tuple[int, int] | None


def run_threads(s: Setup, threads: int, report: dict, save) -> None:
    """Every prompt at one thread count, interleaved: llama.cpp (greedy, lookup), then layerleap."""
    from tqdm.auto import tqdm

    torch.set_num_threads(threads)
    n_ctx = max(len(p) for p in s.prompt_ids) + s.max_new_tokens + 16
    engines = {LLAMA_GREEDY: LlamaCpp(s.gguf, threads, n_ctx)}
    if s.lookup:
        engines[LLAMA_LOOKUP] = LlamaCpp(s.gguf, threads, n_ctx, s.lookup)
    report["config"]["llama_cpp_params"][str(threads)] = {k: e.params for k, e in engines.items()}
    shortest = min(s.prompt_ids, key=len)
    for e in engines.values():  # warm-up: page in the weights, first-call set-up
        e.generate(shortest, WARMUP_TOKENS)
    for model in s.models.values():
        for name, options in s.methods.values():
            layerleap.generate(model, shortest, name, WARMUP_TOKENS, stop_at_eos=False, **options)
    block = {
        "threads": threads,
        "torch_threads": torch.get_num_threads(),
        "load_before": load_average(),
        "thread_nice_before": thread_nice(),
    }
    runs = len(s.prompts) * (len(engines) + len(s.models) * len(s.methods))
    with tqdm(total=runs, desc=f"{threads} thread(s)", unit="run", leave=False) as bar:
        for i, (prompt, ids) in enumerate(zip(s.prompts, s.prompt_ids)):
            recs = []
            for label, eng in engines.items():
                bar.set_postfix_str(f"{prompt.category} {label}")
                load, nice = load_average(), max(thread_nice(), default=0)
                toks, wall, ttft = eng.generate(ids, s.max_new_tokens)
                recs.append(
                    Record(
                        threads,
                        i,
                        prompt.id,
                        prompt.category,
                        len(ids),
                        label,
                        "llama.cpp",
                        "gguf",
                        "greedy" if label == LLAMA_GREEDY else "prompt-lookup",
                        eng.params["lookup"] or {},
                        len(toks),
                        wall,
                        ttft,
                        load,
                        nice,
                        toks,
                        eng.counters(),
                    )
                )
                bar.update()
            for dtype, model in s.models.items():
                for mlabel, (name, options) in s.methods.items():
                    label = f"layerleap {dtype} {mlabel}"
                    bar.set_postfix_str(f"{prompt.category} {label}")
                    load, nice = load_average(), max(thread_nice(), default=0)
                    t0 = time.perf_counter()
                    res = layerleap.generate(model, ids, name, s.max_new_tokens, stop_at_eos=False, **options)
                    wall = time.perf_counter() - t0
                    recs.append(
                        Record(
                            threads,
                            i,
                            prompt.id,
                            prompt.category,
                            len(ids),
                            label,
                            "layerleap",
                            dtype,
                            name,
                            dict(options),
                            len(res.token_ids),
                            wall,
                            res.stats["ttft_s"],
                            load,
                            nice,
                            list(res.token_ids),
                            {"model_calls": res.stats["model_calls"]},
                        )
                    )
                    bar.update()
            ref = recs[0].token_ids
            for r in recs:
                r.agree_llamacpp = common_prefix(r.token_ids, ref)  # = the first differing position
            report["records"].extend(r.to_dict() for r in recs)
            save()
    block["load_after"] = load_average()
    block["thread_nice_after"] = thread_nice()
    report["config"]["thread_blocks"].append(block)


def summarize(records: list[dict]) -> list[dict]:
    """Per thread count and label: summed tokens and times, the rates they give, the ratio to
    llama.cpp greedy's summed wall time, and how many prompts matched llama.cpp greedy throughout."""
    out = []
    keys = list(dict.fromkeys((r["threads"], r["label"]) for r in records))
    for threads, label in keys:
        rs = [r for r in records if r["threads"] == threads and r["label"] == label]
        ref = [r for r in records if r["threads"] == threads and r["label"] == LLAMA_GREEDY]
        tokens, wall, ttft = (sum(r[k] for r in rs) for k in ("new_tokens", "wall_s", "ttft_s"))
        out.append(
            {
                "threads": threads,
                "label": label,
                "prompts": len(rs),
                "new_tokens": tokens,
                "wall_s": wall,
                "ttft_s": ttft,
                "tokens_per_s": tokens / wall,
                "decode_tokens_per_s": (tokens - len(rs)) / (wall - ttft),
                "vs_llamacpp": sum(r["wall_s"] for r in ref) / wall if ref else None,
                "same_as_llamacpp": sum(r["agree_llamacpp"] == r["new_tokens"] for r in rs),
                "mean_agree_llamacpp": sum(r["agree_llamacpp"] for r in rs) / len(rs),
            }
        )
    return out


def prompt_table(records: list[dict]) -> str:
    lines = [
        "| threads | prompt | prompt tokens | engine | tok/s | TTFT s | decode tok/s | agree |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| {r['threads']} | {r['category']} {r['prompt_id']} | {r['prompt_tokens']} | {r['label']} | "
            f"{r['tokens_per_s']:.1f} | {r['ttft_s']:.3f} | {r['decode_tokens_per_s']:.1f} | "
            f"{r['agree_llamacpp']}/{r['new_tokens']} |"
        )
    return "\n".join(lines)


def summary_table(summary: list[dict]) -> str:
    lines = [
        "| threads | engine | tok/s | vs llama.cpp | TTFT s (sum) | decode tok/s | = llama.cpp | agree (mean) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        vs = "-" if s["vs_llamacpp"] is None else f"{s['vs_llamacpp']:.2f}×"
        lines.append(
            f"| {s['threads']} | {s['label']} | {s['tokens_per_s']:.1f} | {vs} | {s['ttft_s']:.2f} | "
            f"{s['decode_tokens_per_s']:.1f} | {s['same_as_llamacpp']}/{s['prompts']} | "
            f"{s['mean_agree_llamacpp']:.1f} |"
        )
    return "\n".join(lines)


# -- command line ---------------------------------------------------------------------------------
def _int_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or any(x < 1 for x in out):
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return out


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", choices=sorted(PACKAGED))
    ap.add_argument(
        "--dtypes",
        "--dtype",
        default="float32",
        help="layerleap dtypes, comma-separated: any that layerleap.load accepts (default float32)",
    )
    ap.add_argument("--threads", type=_int_list, default=[1], help="thread counts, comma-separated (default 1)")
    ap.add_argument("--methods", default="greedy", help="layerleap methods, comma-separated (LABEL=METHOD allowed)")
    ap.add_argument("--opt", action="append", default=[], metavar="METHOD.NAME=VALUE", help="a method option")
    ap.add_argument("--categories", default="summarization,qa,translation,math_reasoning,writing")
    ap.add_argument("--prompts", type=int, default=1, help="Spec-Bench prompts per category")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--no-chat", action="store_true", help="raw prompt text instead of the chat template")
    ap.add_argument("--no-lookup", action="store_true", help="skip llama.cpp's prompt lookup decoding")
    ap.add_argument("--lookup-ngram", type=int, default=2, help="LlamaPromptLookupDecoding max_ngram_size")
    ap.add_argument("--lookup-tokens", type=int, default=10, help="LlamaPromptLookupDecoding num_pred_tokens")
    ap.add_argument("--json", default=None, help="write the report here (atomically, after every prompt)")
    args = ap.parse_args(argv)
    if args.prompts < 1 or args.max_new_tokens < 2:
        ap.error("--prompts must be >= 1 and --max-new-tokens >= 2")
    return args


def prepare(args) -> Setup:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        raise LayerleapError(
            "this benchmark needs llama-cpp-python: run `make llamacpp` (or pip install -e "
            "'.[llamacpp]'; it builds llama.cpp from source, ~8 minutes on 2 cores)"
        ) from None
    methods = parse_methods(args.methods, args.opt)
    gguf = gguf_file(args.model)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not dtypes:
        raise LayerleapError("no dtype given: e.g. --dtypes float32,bfloat16")
    models = {d: layerleap.load(args.model, dtype=d) for d in dtypes}
    tok = next(iter(models.values())).tokenizer
    prompts = spec_bench(categories=args.categories.split(","), n=args.prompts)
    ids = [
        chat_token_ids(tok, [{"role": "user", "content": p.text}], add_generation_prompt=True)
        if not args.no_chat
        else tok(p.text)["input_ids"]
        for p in prompts
    ]
    return Setup(
        gguf,
        prompts,
        ids,
        models,
        methods,
        args.max_new_tokens,
        None if args.no_lookup else (args.lookup_ngram, args.lookup_tokens),
    )


def machine(s: Setup, args) -> dict:
    import llama_cpp
    import transformers

    return {
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "cpu": cpu_info(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "layerleap": layerleap.__version__,
        "llama_cpp_python": llama_cpp.__version__,
        "llama_cpp_system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
        "model": args.model,
        "gguf": str(s.gguf),
        "gguf_bytes": s.gguf.stat().st_size,
        "dtypes": list(s.models),
        "threads": args.threads,
        "methods": {k: {"method": n, "options": o} for k, (n, o) in s.methods.items()},
        "max_new_tokens": s.max_new_tokens,
        "chat": not args.no_chat,
        "n_prompts": len(s.prompts),
        "prompts": [
            {"id": p.id, "category": p.category, "tokens": len(i), "ids": i} for p, i in zip(s.prompts, s.prompt_ids)
        ],
        "llama_cpp_params": {},
        "thread_blocks": [],
        "load_before": load_average(),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        s = prepare(args)
    except LayerleapError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report = {"config": machine(s, args), "records": [], "complete": False}
    save = (lambda: write_json(args.json, report)) if args.json else (lambda: None)
    cfg = report["config"]
    print(
        f"{cfg['cpu']['model_name']} (family {cfg['cpu']['family']}, model {cfg['cpu']['model']}), "
        f"flags {', '.join(f for f, on in cfg['cpu']['flags'].items() if on)}; load {cfg['load_before']}\n"
        f"llama-cpp-python {cfg['llama_cpp_python']}, torch {cfg['torch']}; {s.gguf.name}; "
        f"{len(s.prompts)} prompts × {s.max_new_tokens} tokens",
        flush=True,
    )
    try:
        for threads in args.threads:
            run_threads(s, threads, report, save)
        report["complete"] = True
    except KeyboardInterrupt:
        print("interrupted: the report holds the prompts that finished", file=sys.stderr)
    cfg["load_after"] = load_average()
    cfg["torch_threads_after"] = torch.get_num_threads()
    report["summary"] = summarize(report["records"])
    save()
    print(prompt_table(report["records"]), "", summary_table(report["summary"]), sep="\n")
    niced = sorted({r["nice_before"] for r in report["records"]} - {0})
    print(
        f"load average before {cfg['load_before']}, after {cfg['load_after']}"
        + (f"; some runs had a thread at nice {niced} (slowed by the system)" if niced else "")
    )
    if args.json:
        print(f"report: {args.json}")
    return 0 if report["complete"] else 130


if __name__ == "__main__":
    sys.exit(main())
