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
self-spec.draft_len=4`` adds layerleap methods (names from ``layerleap.METHODS``).  A ``draft=`` or
``small=`` option names a model (a packaged name or a folder), loaded in each dtype as ``layerleap
bench`` loads it; a ``speculative`` method whose draft is a packaged model also adds llama.cpp
speculative decoding with that model's GGUF as the draft (``--llama-draft``, ``--llama-draft-tokens``,
``--llama-draft-confidence``; the drafter is ``llamacpp_engine.LlamaDraft``, ours, since the binding
ships only prompt lookup):

    python benchmarks/llamacpp_vs_layerleap.py --model qwen2.5-coder-1.5b --dtypes q4 --threads 1,2 \\
        --methods greedy,prompt-lookup,speculative --opt speculative.draft=qwen2.5-coder-0.5b

``--prompt-set short-chat`` takes the shortest first turn of each of Spec-Bench's eight MT-bench
categories instead of the first Spec-Bench prompts.  ``--prefill 512`` times the prompt pass alone
on prompts of exactly 512 token ids, and ``--memory`` the resident memory of each engine after
loading, while decoding and after a generation, each engine in a process of its own (``llamacpp_engine.py``).  The
JSON report (written atomically after every prompt) records the CPU model and flags, the versions,
the thread counts, the load average before and after, and the command line.
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
from layerleap.eval.bench import check_spec, parse_methods
from layerleap.datasets import Prompt, spec_bench
from layerleap.decoding import chat_token_ids
from layerleap.errors import LayerleapError
from layerleap.eval.quality import common_prefix
from layerleap.files import atomic_write, write_json
from layerleap.options import ModelLoader, resolve_models
from llamacpp_engine import LlamaCpp
from layerleap.core.loading import PACKAGED, _gguf_parts, cache_root

LLAMA_GREEDY, LLAMA_LOOKUP = "llama.cpp greedy", "llama.cpp lookup"
SPEC_BENCH_FIVE = ("summarization", "qa", "translation", "math_reasoning", "writing")
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
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
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
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
            out.append(int(stat.read_text(encoding="utf-8").rsplit(")", 1)[1].split()[16]))
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


# -- the run --------------------------------------------------------------------------------------
@dataclass
class Setup:
    gguf: Path
    prompts: list[Prompt]
    prompt_ids: list[list[int]]
    models: dict[str, layerleap.Transformer]  # dtype -> model
    methods: dict[str, tuple[str, dict]]  # label -> (method, options as given: a draft model by name)
    resolved: dict[str, dict[str, tuple[str, dict]]]  # dtype -> label -> (method, options, models loaded)
    max_new_tokens: int
    lookup: tuple[int, int] | None
    llama_draft: tuple[str, int, float] | None  # (packaged model, most tokens a round, confidence stop)


def llama_spec_label(draft: str) -> str:
    return f"llama.cpp speculative ({draft} draft)"


def llama_engines(s: Setup, threads: int, n_ctx: int) -> dict[str, LlamaCpp]:
    """llama.cpp greedy, with prompt lookup, with a draft model: the ones the run asks for."""
    engines = {LLAMA_GREEDY: LlamaCpp(s.gguf, threads, n_ctx)}
    if s.lookup:
        engines[LLAMA_LOOKUP] = LlamaCpp(s.gguf, threads, n_ctx, lookup=s.lookup)
    if s.llama_draft:
        name, tokens, confidence = s.llama_draft
        engines[llama_spec_label(name)] = LlamaCpp(s.gguf, threads, n_ctx, draft=(gguf_file(name), tokens, confidence))
    return engines


def run_threads(s: Setup, threads: int, report: dict, save) -> None:
    """Every prompt at one thread count, interleaved: llama.cpp (greedy, lookup, draft model), then layerleap."""
    from tqdm.auto import tqdm

    torch.set_num_threads(threads)
    n_ctx = max(len(p) for p in s.prompt_ids) + s.max_new_tokens + 16
    engines = llama_engines(s, threads, n_ctx)
    report["config"]["llama_cpp_params"][str(threads)] = {k: e.params for k, e in engines.items()}
    shortest = min(s.prompt_ids, key=len)
    for e in engines.values():  # warm-up: page in the weights, first-call set-up
        e.generate(shortest, WARMUP_TOKENS)
    for dtype, model in s.models.items():
        for name, options in s.resolved[dtype].values():
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
                        eng.method,
                        eng.params["draft"] or {},
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
                for mlabel, (name, options) in s.resolved[dtype].items():
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
                            dict(s.methods[mlabel][1]),
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
    for e in engines.values():
        e.close()


# -- prefill alone ----------------------------------------------------------------------------------
def run_prefill(s: Setup, threads: int, repeat: int, report: dict, save) -> None:
    """The prompt pass alone (the time to the first token of a one-token generation) of every prompt,
    ``repeat`` rounds, interleaved per prompt: llama.cpp, then each layerleap dtype."""
    torch.set_num_threads(threads)
    llama = LlamaCpp(s.gguf, threads, max(len(p) for p in s.prompt_ids) + 16)
    report["config"]["llama_cpp_params"][str(threads)] = {LLAMA_GREEDY: llama.params}
    engines = {LLAMA_GREEDY: lambda ids: llama.generate(ids, 1)[2]}
    for dtype, model in s.models.items():
        engines[f"layerleap {dtype} greedy"] = lambda ids, m=model: layerleap.generate(
            m, ids, "greedy", 1, stop_at_eos=False
        ).stats["ttft_s"]
    for prefill in engines.values():  # warm-up
        prefill(s.prompt_ids[0])
    block = {"threads": threads, "torch_threads": torch.get_num_threads(), "load_before": load_average()}
    for r in range(repeat):
        for i, ids in enumerate(s.prompt_ids):
            for label, prefill in engines.items():
                load = load_average()
                secs = prefill(ids)
                report["records"].append(
                    {
                        "threads": threads,
                        "round": r,
                        "prompt_index": i,
                        "label": label,
                        "prompt_tokens": len(ids),
                        "prefill_s": secs,
                        "tokens_per_s": len(ids) / secs,
                        "load_before": load,
                    }
                )
            save()
    block["load_after"] = load_average()
    report["config"]["thread_blocks"].append(block)
    llama.close()


def summarize_prefill(records: list[dict]) -> list[dict]:
    """Per thread count and engine: the summed tokens over the summed time, the best run, and the ratio
    to llama.cpp's summed time."""
    out = []
    for threads, label in dict.fromkeys((r["threads"], r["label"]) for r in records):
        rs = [r for r in records if r["threads"] == threads and r["label"] == label]
        ref = sum(r["prefill_s"] for r in records if r["threads"] == threads and r["label"] == LLAMA_GREEDY)
        secs = sum(r["prefill_s"] for r in rs)
        out.append(
            {
                "threads": threads,
                "label": label,
                "runs": len(rs),
                "tokens": sum(r["prompt_tokens"] for r in rs),
                "prefill_s": secs,
                "tokens_per_s": sum(r["prompt_tokens"] for r in rs) / secs,
                "best_tokens_per_s": max(r["tokens_per_s"] for r in rs),
                "vs_llamacpp": ref / secs,
            }
        )
    return out


def prefill_table(summary: list[dict]) -> str:
    lines = ["| threads | engine | runs | prefill tok/s | best run tok/s | vs llama.cpp |", "|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(
            f"| {s['threads']} | {s['label']} | {s['runs']} | {s['tokens_per_s']:.0f} | "
            f"{s['best_tokens_per_s']:.0f} | {s['vs_llamacpp']:.2f}× |"
        )
    return "\n".join(lines)


# -- memory -----------------------------------------------------------------------------------------
def memory_specs(s: Setup, args) -> dict[str, dict]:
    """One probe per engine (``llamacpp_engine.py``): llama.cpp greedy and with its draft model, then
    every layerleap dtype and method, on the longest prompt."""
    ids = max(s.prompt_ids, key=len)
    base = {"ids": ids, "new_tokens": s.max_new_tokens, "threads": args.threads[0]}
    gguf_bytes = s.gguf.stat().st_size
    llama = {**base, "engine": "llama.cpp", "gguf": str(s.gguf), "n_ctx": len(ids) + s.max_new_tokens + 16}
    specs = {LLAMA_GREEDY: {**llama, "file_bytes": gguf_bytes}}
    if s.llama_draft:
        name, tokens, confidence = s.llama_draft
        path = gguf_file(name)
        specs[llama_spec_label(name)] = {
            **llama,
            "draft_gguf": str(path),
            "draft_tokens": tokens,
            "draft_confidence": confidence,
            "file_bytes": gguf_bytes + path.stat().st_size,
        }
    for dtype in s.models:
        for label, (name, options) in s.methods.items():
            drafts = [gguf_file(v).stat().st_size for v in options.values() if isinstance(v, str) and v in PACKAGED]
            specs[f"layerleap {dtype} {label}"] = {
                **base,
                "engine": "layerleap",
                "model": args.model,
                "dtype": dtype,
                "method": name,
                "options": options,
                "file_bytes": gguf_bytes + sum(drafts),
            }
    return specs


def run_memory(s: Setup, args, report: dict, save) -> None:
    """Each engine in its own process, one after another (``llamacpp_engine.py`` prints its readings)."""
    import json
    import subprocess

    probe = Path(__file__).with_name("llamacpp_engine.py")
    for label, spec in memory_specs(s, args).items():
        print(f"memory: {label} …", file=sys.stderr, flush=True)
        done = subprocess.run([sys.executable, str(probe), json.dumps(spec)], capture_output=True, text=True)
        if done.returncode != 0:
            raise LayerleapError(f"the memory probe of {label} failed: {done.stderr.strip()[-2000:]}")
        out = json.loads(done.stdout.strip().splitlines()[-1])
        report["records"].append(
            {
                "label": label,
                "file_bytes": spec["file_bytes"],
                "prompt_tokens": len(spec["ids"]),
                "new_tokens": spec["new_tokens"],
                "threads": spec["threads"],
                **out,
            }
        )
        save()


def memory_table(records: list[dict]) -> str:
    """Resident memory in MB; "model" is the growth from after the imports to the largest reading while
    decoding (the KV cache live), set against the weight files plus the KV cache the engine allocated."""
    lines = [
        "| engine | after imports | after load | while decoding | after generation | peak "
        "| model (decoding − imports) | of it file-backed | after malloc_trim | GGUF file(s) | KV cache "
        "| model / (file + KV) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        mb = {k: r[k]["VmRSS"] / 1e6 for k in ("after_imports", "after_load", "while_decoding", "after_generate")}
        own = mb["while_decoding"] - mb["after_imports"]
        own_file = (r["while_decoding"]["RssFile"] - r["after_imports"]["RssFile"]) / 1e6
        lines.append(
            f"| {r['label']} | {mb['after_imports']:.0f} | {mb['after_load']:.0f} | {mb['while_decoding']:.0f} | "
            f"{mb['after_generate']:.0f} | {r['after_generate']['VmHWM'] / 1e6:.0f} | {own:.0f} | "
            f"{own_file:.0f} | {r['after_trim']['VmRSS'] / 1e6:.0f} | {r['file_bytes'] / 1e6:.0f} | "
            f"{r['kv_bytes'] / 1e6:.1f} | {own * 1e6 / (r['file_bytes'] + r['kv_bytes']):.2f}× |"
        )
    return "\n".join(lines)


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
    ap.add_argument(
        "--prompt-set",
        choices=("spec-bench", "short-chat"),
        default="spec-bench",
        help="spec-bench: the first prompts of each category; short-chat: the shortest first turns of "
        "Spec-Bench's eight MT-bench categories (default spec-bench)",
    )
    ap.add_argument(
        "--categories",
        default=None,
        help=f"Spec-Bench categories (default {','.join(SPEC_BENCH_FIVE)}; with --prompt-set short-chat "
        f"{','.join(MT_BENCH)})",
    )
    ap.add_argument("--prompts", type=int, default=1, help="prompts per category")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--no-chat", action="store_true", help="raw prompt text instead of the chat template")
    ap.add_argument("--no-lookup", action="store_true", help="skip llama.cpp's prompt lookup decoding")
    ap.add_argument("--lookup-ngram", type=int, default=2, help="LlamaPromptLookupDecoding max_ngram_size")
    ap.add_argument("--lookup-tokens", type=int, default=10, help="LlamaPromptLookupDecoding num_pred_tokens")
    ap.add_argument(
        "--llama-draft",
        default=None,
        choices=sorted(PACKAGED),
        help="add llama.cpp speculative decoding with this packaged model as the draft (default: the "
        "draft= of a speculative method of --methods, where it names a packaged model)",
    )
    ap.add_argument(
        "--llama-draft-tokens",
        type=int,
        default=None,
        help="most tokens the llama.cpp draft model proposes a round (default: the speculative method's "
        "draft_len, else its default 20)",
    )
    ap.add_argument(
        "--llama-draft-confidence",
        type=float,
        default=None,
        help="the llama.cpp draft stops after a token below this probability (default: the speculative "
        "method's min_confidence, else its default 0.4; 0 = off)",
    )
    ap.add_argument(
        "--prefill",
        type=int,
        default=None,
        metavar="N",
        help="time the prompt pass alone on prompts of exactly N token ids (raw text, no chat template), "
        "llama.cpp against each layerleap dtype, instead of generating",
    )
    ap.add_argument("--repeat", type=int, default=3, help="--prefill: rounds over the prompts (default 3)")
    ap.add_argument(
        "--memory",
        action="store_true",
        help="measure each engine's resident memory after loading, while decoding and after a generation of "
        "the longest prompt, each in its own process, instead of timing",
    )
    ap.add_argument("--json", default=None, help="write the report here (atomically, after every prompt)")
    args = ap.parse_args(argv)
    if args.prompts < 1 or args.max_new_tokens < 2 or (args.llama_draft_tokens or 1) < 1 or args.repeat < 1:
        ap.error("--prompts, --llama-draft-tokens and --repeat must be >= 1, --max-new-tokens >= 2")
    if args.prefill is not None and (args.prefill < 2 or args.memory):
        ap.error("--prefill takes a prompt length >= 2, and not with --memory")
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
    models, resolved = {}, {}
    for d in dtypes:  # draft= and small= name a model: loaded once per dtype, as `layerleap bench` does
        loader = ModelLoader(d)
        models[d] = loader(args.model)
        for label, (name, opts) in methods.items():
            check_spec(label, name, opts, models[d].config)
        resolved[d] = {lb: (name, resolve_models(name, opts, loader)) for lb, (name, opts) in methods.items()}
    tok = models[dtypes[0]].tokenizer
    prompts = select_prompts(args)
    if args.prefill:
        ids = prefill_ids(tok, prompts, args.prefill)
    else:
        ids = [
            chat_token_ids(tok, [{"role": "user", "content": p.text}], add_generation_prompt=True)
            if not args.no_chat
            else tok(p.text)["input_ids"]
            for p in prompts
        ]
    spec = next((o for n, o in methods.values() if n == "speculative"), {})
    draft = args.llama_draft or (spec["draft"] if spec.get("draft") in PACKAGED else None)
    tokens = args.llama_draft_tokens or int(spec.get("draft_len", 20))
    confidence = args.llama_draft_confidence
    confidence = float(spec.get("min_confidence", 0.4)) if confidence is None else confidence
    return Setup(
        gguf,
        prompts,
        ids,
        models,
        methods,
        resolved,
        args.max_new_tokens,
        None if args.no_lookup else (args.lookup_ngram, args.lookup_tokens),
        (draft, tokens, confidence) if draft else None,
    )


def select_prompts(args) -> list[Prompt]:
    """Spec-Bench's first ``--prompts`` of each category, or (short-chat) the ``--prompts`` shortest
    first turns of each category (by characters, then id): by default the eight MT-bench ones."""
    if args.prompt_set == "spec-bench":
        return spec_bench(categories=(args.categories or ",".join(SPEC_BENCH_FIVE)).split(","), n=args.prompts)
    out = []
    for c in (args.categories or ",".join(MT_BENCH)).split(","):
        out += sorted(spec_bench(categories=[c]), key=lambda p: (len(p.text), p.id))[: args.prompts]
    return out


def prefill_ids(tok, prompts: list[Prompt], length: int) -> list[list[int]]:
    """As many prompts of exactly ``length`` token ids as ``prompts`` holds: consecutive windows of
    the prompts' raw texts joined by blank lines (repeated where they are too short)."""
    ids = tok("\n\n".join(p.text for p in prompts))["input_ids"]
    ids = ids * -(-length * len(prompts) // len(ids))
    return [ids[i * length : (i + 1) * length] for i in range(len(prompts))]


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
        "chat": not args.no_chat and not args.prefill,
        "prompt_set": args.prompt_set,
        "mode": "memory" if args.memory else f"prefill {args.prefill}" if args.prefill else "generate",
        "llama_draft": dict(zip(("model", "tokens", "min_confidence"), s.llama_draft)) if s.llama_draft else None,
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
        f"{len(s.prompt_ids)} prompts ({args.prompt_set}"
        + (f", {args.prefill} tokens each, prefill alone)" if args.prefill else f") × {s.max_new_tokens} tokens")
        + (", memory" if args.memory else ""),
        flush=True,
    )
    try:
        if args.memory:
            run_memory(s, args, report, save)
        for threads in args.threads if not args.memory else []:
            if args.prefill:
                run_prefill(s, threads, args.repeat, report, save)
            else:
                run_threads(s, threads, report, save)
        report["complete"] = True
    except KeyboardInterrupt:
        print("interrupted: the report holds the prompts that finished", file=sys.stderr)
    except LayerleapError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg["load_after"] = load_average()
    cfg["torch_threads_after"] = torch.get_num_threads()
    if args.memory:
        save()
        print(memory_table(report["records"]))
    elif args.prefill:
        report["summary"] = summarize_prefill(report["records"])
        save()
        print(prefill_table(report["summary"]))
    else:
        report["summary"] = summarize(report["records"])
        save()
        print(prompt_table(report["records"]), "", summary_table(report["summary"]), sep="\n")
    niced = sorted({r.get("nice_before", 0) for r in report["records"]} - {0})
    print(
        f"load average before {cfg['load_before']}, after {cfg['load_after']}"
        + (f"; some runs had a thread at nice {niced} (slowed by the system)" if niced else "")
    )
    if args.json:
        print(f"report: {args.json}")
    return 0 if report["complete"] else 130


if __name__ == "__main__":
    sys.exit(main())
