"""The llama.cpp side of ``llamacpp_vs_layerleap.py`` (through ``llama-cpp-python``), and its memory probe.

This module imports neither torch nor layerleap at the top, so a memory probe of llama.cpp runs in a
process that holds llama.cpp alone:

    python benchmarks/llamacpp_engine.py '{"engine": "llama.cpp", "gguf": "...", "ids": [...], ...}'

prints one JSON line: the resident memory (VmRSS) after the imports, after loading, while decoding
(the largest reading between tokens or rounds, the KV cache live), after one generation, and the
peak (VmHWM).  ``engine`` ``layerleap`` loads ``model`` with ``dtype`` instead.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

try:
    from llama_cpp.llama_speculative import LlamaDraftModel
except ImportError:  # the benchmark says how to install llama-cpp-python before it needs it
    LlamaDraftModel = object


def trimmed() -> dict:
    """``resident()`` after glibc's ``malloc_trim(0)`` hands freed heap pages back to the system (what
    stays is live data; the difference is memory the allocator kept after it was freed)."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return resident()


def resident() -> dict:
    """This process's resident memory now, its anonymous and file-backed parts, and its peak, bytes
    (Linux ``/proc/self/status``)."""
    out = {}
    for line in Path("/proc/self/status").read_text(encoding="utf-8").splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


GREEDY = {"top_k": 1, "top_p": 1.0, "min_p": 0.0, "temp": 0.0, "repeat_penalty": 1.0}


class CountingLookup:
    """The binding's ``LlamaPromptLookupDecoding``, counting its calls (one per model call after the
    prompt) and the tokens it proposed."""

    def __init__(self, max_ngram_size: int, num_pred_tokens: int):
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.inner = LlamaPromptLookupDecoding(max_ngram_size=max_ngram_size, num_pred_tokens=num_pred_tokens)
        self.params = {"max_ngram_size": max_ngram_size, "num_pred_tokens": num_pred_tokens}
        self.calls = self.drafted = 0

    def __call__(self, input_ids, /, **kwargs):
        out = self.inner(input_ids, **kwargs)
        self.calls += 1
        self.drafted += len(out)
        return out


def open_llama(path: Path, threads: int, n_ctx: int, **extra):
    """A llama.cpp context on ``path``: a batch of the whole context, ``threads`` for decoding and
    for the prompt, quiet."""
    from llama_cpp import Llama

    return Llama(
        str(path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False, **extra
    )


class LlamaDraft(LlamaDraftModel):
    """Speculative decoding's drafter as a second ``Llama`` on the draft GGUF (ours: the binding ships
    only prompt lookup as a draft model), drafting as layerleap's ``speculative`` does by default.

    Each call gets the target's sequence so far (prompt, accepted tokens, and the token the target
    just chose).  The draft context keeps its KV cache for the longest prefix it shares with that
    sequence and evaluates only the rest (``Llama.eval`` drops the cache past ``n_tokens``): the
    whole prompt on the first call, later the tokens after the last draft token the target kept
    (one or two).  Then it drafts greedily, one ``eval`` of one token each, up to ``num_pred_tokens``
    tokens, and stops after a token whose draft probability (softmax of the draft's logits, read with
    ``llama_get_logits_ith``) is below ``min_confidence``: that token is still proposed, as layerleap
    does (0 turns the stop off).  The last proposed token is not evaluated by the draft model; the
    next call evaluates it if the target keeps it."""

    def __init__(self, path: Path, threads: int, n_ctx: int, num_pred_tokens: int, min_confidence: float = 0.0):
        self.llm = open_llama(path, threads, n_ctx)
        self.n_ctx, self.n_vocab = n_ctx, self.llm.n_vocab()
        self.num_pred_tokens, self.min_confidence = num_pred_tokens, min_confidence
        self.params = {
            "draft_gguf": Path(path).name,
            "num_pred_tokens": num_pred_tokens,
            "min_confidence": min_confidence,
            "n_ctx": n_ctx,
        }
        self.calls = self.drafted = 0

    def _next(self) -> tuple[int, float]:
        """The draft's greedy token after what it has evaluated, and its probability."""
        import llama_cpp

        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.n_vocab,))
        tok = int(logits.argmax())
        return tok, float(1.0 / np.exp(logits - logits[tok]).sum())

    def __call__(self, input_ids, /, **kwargs):
        ids = [int(t) for t in input_ids]
        have = self.llm.input_ids[: self.llm.n_tokens]
        keep = 0
        while keep < min(len(have), len(ids) - 1) and have[keep] == ids[keep]:
            keep += 1
        self.llm.n_tokens = keep  # the next eval drops the draft's cache past the shared prefix
        self.llm.eval(ids[keep:])
        out: list[int] = []
        room = min(self.num_pred_tokens, self.n_ctx - len(ids) - 1)
        while len(out) < room:
            tok, p = self._next()
            out.append(tok)
            if p < self.min_confidence or len(out) == room:
                break
            self.llm.eval([tok])
        self.calls += 1
        self.drafted += len(out)
        return np.array(out, dtype=np.intc)

    def reset(self) -> None:
        self.llm.reset()
        self.calls = self.drafted = 0


class LlamaCpp:
    """One llama.cpp context on the GGUF file, greedy (temperature 0, top-k 1, no penalties).  With
    ``lookup`` (max n-gram, tokens) the binding's prompt lookup drafts; with ``draft`` (a GGUF path,
    most tokens a round, confidence stop) a second model does (``LlamaDraft``).  With either, the
    binding asks llama.cpp for the logits of every position, the prompt's included
    (``logits_all``), and copies them out."""

    def __init__(
        self,
        path: Path,
        threads: int,
        n_ctx: int,
        lookup: tuple[int, int] | None = None,
        draft: tuple[Path, int, float] | None = None,
    ):
        self.method = "prompt-lookup" if lookup else "speculative" if draft else "greedy"
        if lookup:
            self.draft = CountingLookup(*lookup)
        elif draft:
            self.draft = LlamaDraft(draft[0], threads, n_ctx, *draft[1:])
        else:
            self.draft = None
        self.llm = open_llama(path, threads, n_ctx, draft_model=self.draft)
        self.params = {
            "n_ctx": n_ctx,
            "n_batch": self.llm.n_batch,
            "n_ubatch": self.llm.context_params.n_ubatch,
            "n_threads": threads,
            "n_threads_batch": threads,
            "flash_attn": "binding default (off)",
            "draft": self.draft.params if self.draft else None,
        }

    def generate(self, prompt_ids: list[int], n: int, each=None) -> tuple[list[int], float, float]:
        """-> (n new token ids, wall s, time to the first token s); the whole prompt is evaluated
        anew every time (no prefix reuse from the previous call), the draft model's too.  ``each()``,
        when given, is called after every token."""
        self.llm.reset()
        if isinstance(self.draft, CountingLookup):
            self.draft.calls = self.draft.drafted = 0
        elif self.draft is not None:
            self.draft.reset()
        out: list[int] = []
        t0 = time.perf_counter()
        ttft = 0.0
        for tok in self.llm.generate(prompt_ids, **GREEDY):
            if not out:
                ttft = time.perf_counter() - t0
            out.append(int(tok))
            if each is not None:
                each()
            if len(out) == n:
                break
        return out, time.perf_counter() - t0, ttft

    def close(self) -> None:
        """Free both contexts now (a thread count's engines go before the next one's load)."""
        self.llm.close()
        if isinstance(self.draft, LlamaDraft):
            self.draft.llm.close()

    def counters(self) -> dict:
        """Model calls (the prompt's included) and drafted tokens of the last ``generate`` (the
        binding asks the draft model once before every model call after the prompt)."""
        return {"model_calls": self.draft.calls + 1, "drafted": self.draft.drafted} if self.draft else {}


def kv_bytes(llm) -> int:
    """The KV cache llama.cpp allocates for a context: every slot of ``n_ctx``, f16 keys and values."""
    md = llm.metadata
    arch = md["general.architecture"]
    n_layer = int(md[f"{arch}.block_count"])
    n_head = int(md[f"{arch}.attention.head_count"])
    n_kv = int(md.get(f"{arch}.attention.head_count_kv", n_head))
    head_dim = int(md.get(f"{arch}.attention.key_length", int(md[f"{arch}.embedding_length"]) // n_head))
    return 2 * n_layer * n_kv * head_dim * 2 * llm.n_ctx()


# -- the memory probe (one engine per process) ----------------------------------------------------
class LargestReading:
    """``resident()`` at its largest VmRSS over the calls (``largest.reading``)."""

    def __init__(self):
        self.reading: dict = {}

    def __call__(self) -> None:
        now = resident()
        if now["VmRSS"] > self.reading.get("VmRSS", -1):
            self.reading = now


def probe_llamacpp(spec: dict) -> dict:
    import llama_cpp  # noqa: F401  (the imports' memory belongs to the baseline)

    out = {"after_imports": resident()}
    draft = (
        (Path(spec["draft_gguf"]), spec["draft_tokens"], spec["draft_confidence"]) if spec.get("draft_gguf") else None
    )
    eng = LlamaCpp(Path(spec["gguf"]), spec["threads"], spec["n_ctx"], draft=draft)
    out["after_load"] = resident()
    largest = LargestReading()
    eng.generate(spec["ids"], spec["new_tokens"], each=largest)
    out["while_decoding"] = largest.reading
    out["after_generate"] = resident()
    out["after_trim"] = trimmed()
    out["kv_bytes"] = kv_bytes(eng.llm) + (kv_bytes(eng.draft.llm) if draft else 0)
    out["n_ctx"] = eng.llm.n_ctx()
    return out


def probe_layerleap(spec: dict) -> dict:
    import torch

    import layerleap
    from layerleap.eval.roofline import kv_bytes_per_token
    from layerleap.options import ModelLoader, resolve_models

    torch.set_num_threads(spec["threads"])
    out = {"after_imports": resident()}
    loader = ModelLoader(spec["dtype"])
    model = loader(spec["model"])
    options = resolve_models(spec["method"], spec.get("options", {}), loader)
    out["after_load"] = resident()
    largest = LargestReading()
    for _ in layerleap.Decoding(model, spec["ids"], spec["method"], spec["new_tokens"], stop_at_eos=False, **options):
        largest()  # after each round (a generation's buffers go back to the system when it ends)
    out["while_decoding"] = largest.reading
    out["after_generate"] = resident()
    out["after_trim"] = trimmed()
    slots = len(spec["ids"]) + spec["new_tokens"] + 1  # the cache a generation allocates (core/run.py)
    out["kv_bytes"] = sum(kv_bytes_per_token(m) * slots for m in loader.models.values())
    out["weight_bytes"] = sum(m.weight_bytes() for m in loader.models.values())
    return out


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    print(json.dumps((probe_llamacpp if spec["engine"] == "llama.cpp" else probe_layerleap)(spec)))
