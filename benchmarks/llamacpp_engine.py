"""The llama.cpp side of ``llamacpp_vs_layerleap.py`` (through ``llama-cpp-python``), and its memory probe.

This module imports neither torch nor layerleap at the top, so a memory probe of llama.cpp runs in a
process that holds llama.cpp alone:

    python benchmarks/llamacpp_engine.py '{"engine": "llama.cpp", "gguf": "...", "ids": [...], ...}'

prints one JSON line: the resident memory (VmRSS) after the imports, after loading, after one
generation, and the peak (VmHWM).  ``engine`` ``layerleap`` loads ``model`` with ``dtype`` instead.
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
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


GREEDY = {"top_k": 1, "top_p": 1.0, "min_p": 0.0, "temp": 0.0, "repeat_penalty": 1.0}


def take(llm, ids: list[int], n: int) -> list[int]:
    """The first ``n`` greedy tokens of ``llm.generate`` after ``ids`` (EOS does not stop it)."""
    out: list[int] = []
    for tok in llm.generate(ids, **GREEDY):
        out.append(int(tok))
        if len(out) == n:
            break
    return out


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


class LlamaDraft(LlamaDraftModel):
    """Speculative decoding's drafter as a second ``Llama`` (ours: the binding ships only prompt
    lookup as a draft model).  Each call gets the target's sequence so far (prompt, accepted tokens
    and the token the target just chose) and greedily drafts ``num_pred_tokens`` tokens with the
    draft GGUF through ``Llama.generate``.  That call keeps the draft's KV cache for the longest
    prefix it shares with the new sequence (``reset=True`` matches prefixes and removes the
    cache past it), so a round evaluates only what is new: the first call evaluates the whole
    prompt, later ones the one or two tokens after the last accepted draft token, then one token
    per further draft token.  Always ``num_pred_tokens`` tokens (no confidence stop), none past
    the context."""

    def __init__(self, path: Path, threads: int, n_ctx: int, num_pred_tokens: int):
        from llama_cpp import Llama

        self.llm = Llama(
            str(path),
            n_ctx=n_ctx,
            n_batch=n_ctx,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )
        self.n_ctx = n_ctx
        self.params = {"draft_gguf": Path(path).name, "num_pred_tokens": num_pred_tokens, "n_ctx": n_ctx}
        self.num_pred_tokens = num_pred_tokens
        self.calls = self.drafted = 0

    def __call__(self, input_ids, /, **kwargs):
        ids = [int(t) for t in input_ids]
        n = min(self.num_pred_tokens, self.n_ctx - len(ids) - 1)
        out = take(self.llm, ids, n) if n > 0 else []
        self.calls += 1
        self.drafted += len(out)
        return np.array(out, dtype=np.intc)

    def reset(self) -> None:
        self.llm.reset()
        self.calls = self.drafted = 0


class LlamaCpp:
    """One llama.cpp context on the GGUF file, greedy (temperature 0, top-k 1, no penalties); with
    ``lookup`` (max n-gram, tokens) the binding's prompt lookup drafts, with ``draft`` (a GGUF path,
    tokens) a second model does (``LlamaDraft``).  With a draft model the binding asks llama.cpp for
    the logits of every position, the prompt's included (``logits_all``), and copies them out."""

    def __init__(
        self,
        path: Path,
        threads: int,
        n_ctx: int,
        lookup: tuple[int, int] | None = None,
        draft: tuple[Path, int] | None = None,
    ):
        from llama_cpp import Llama

        self.method = "prompt-lookup" if lookup else "speculative" if draft else "greedy"
        if lookup:
            self.draft = CountingLookup(*lookup)
        elif draft:
            self.draft = LlamaDraft(draft[0], threads, n_ctx, draft[1])
        else:
            self.draft = None
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
            "draft": self.draft.params if self.draft else None,
        }

    def generate(self, prompt_ids: list[int], n: int) -> tuple[list[int], float, float]:
        """-> (n new token ids, wall s, time to the first token s); the whole prompt is evaluated
        anew every time (no prefix reuse from the previous call), the draft model's too."""
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
            if len(out) == n:
                break
        return out, time.perf_counter() - t0, ttft

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
def probe_llamacpp(spec: dict) -> dict:
    import llama_cpp  # noqa: F401  (the imports' memory belongs to the baseline)

    out = {"after_imports": resident()}
    draft = (Path(spec["draft_gguf"]), spec["draft_tokens"]) if spec.get("draft_gguf") else None
    eng = LlamaCpp(Path(spec["gguf"]), spec["threads"], spec["n_ctx"], draft=draft)
    out["after_load"] = resident()
    eng.generate(spec["ids"], spec["new_tokens"])
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
    layerleap.generate(model, spec["ids"], spec["method"], spec["new_tokens"], stop_at_eos=False, **options)
    out["after_generate"] = resident()
    out["after_trim"] = trimmed()
    slots = len(spec["ids"]) + spec["new_tokens"] + 1  # the cache a generation allocates (core/run.py)
    out["kv_bytes"] = sum(kv_bytes_per_token(m) * slots for m in loader.models.values())
    out["weight_bytes"] = sum(m.weight_bytes() for m in loader.models.values())
    return out


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    print(json.dumps((probe_llamacpp if spec["engine"] == "llama.cpp" else probe_layerleap)(spec)))
