"""Where layerleap and llama.cpp part ways: for every layerleap run in a
``llamacpp_vs_layerleap.py`` report whose tokens differ from llama.cpp greedy's, both engines'
logits at the first differing position (same prefix: the prompt and the shared tokens), their top
two tokens, the margin between them and the largest |logit difference| (docs/BENCHMARKS.md).
Both sides evaluate the whole prefix in one pass here, not token by token as in the benchmark, so
in bf16 a near tie can come out the other way than it did there.

    python benchmarks/llamacpp_divergence.py docs/results/llamacpp_vs_layerleap_epyc_t1.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
import layerleap  # noqa: E402
from llamacpp_vs_layerleap import LLAMA_GREEDY, gguf_file  # noqa: E402


def ours_logits(model, ids: list[int]) -> np.ndarray:
    with torch.inference_mode():
        cache = model.new_cache(1, len(ids) + 1)
        h = model.run_layers(
            model.embed(torch.tensor([ids])), 0, model.config.n_layers, torch.arange(len(ids)).unsqueeze(0), cache
        )  # [1, S, D]
        return model.unembed(model.final_norm(h[:, -1:])).float().reshape(-1).numpy()  # [V]


def top2(x: np.ndarray) -> str:
    a, b = np.argsort(-x)[:2]
    return f"{a} {x[a]:.3f} / {b} {x[b]:.3f} (margin {x[a] - x[b]:.3f})"


def main() -> None:
    from llama_cpp import Llama

    report = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
    cfg = report["config"]
    torch.set_num_threads(1)
    llm = Llama(str(gguf_file(cfg["model"])), n_ctx=4096, n_batch=4096, n_threads=1, verbose=False)
    models: dict[str, layerleap.Transformer] = {}
    recs = report["records"]
    print("| prompt | layerleap dtype | first difference | llama.cpp top 2 | layerleap top 2 | max abs(Δ logit) |")
    print("|---|---|---|---|---|---|")
    for r in recs:
        if r["engine"] != "layerleap" or r["agree_llamacpp"] == r["new_tokens"]:
            continue
        ref = next(
            x
            for x in recs
            if x["label"] == LLAMA_GREEDY and x["threads"] == r["threads"] and x["prompt_index"] == r["prompt_index"]
        )
        model = models.get(r["dtype"]) or models.setdefault(r["dtype"], layerleap.load(cfg["model"], dtype=r["dtype"]))
        k = r["agree_llamacpp"]
        ids = report_prompt_ids(model, report, r) + ref["token_ids"][:k]
        llm.reset()
        llm.eval(ids)
        theirs = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(model.config.vocab_size,)).copy()
        ours = ours_logits(model, ids)
        print(
            f"| {r['category']} {r['prompt_id']} | {r['dtype']} | {k} | {top2(theirs)} | {top2(ours)} | "
            f"{np.abs(theirs - ours).max():.2f} |"
        )


def report_prompt_ids(model, report: dict, r: dict) -> list[int]:
    """The prompt ids the benchmark used: kept in the report, else the Spec-Bench prompt again under
    the chat template (or raw)."""
    from layerleap.datasets import spec_bench

    kept = report["config"]["prompts"][r["prompt_index"]].get("ids")
    if kept:
        return kept
    from layerleap.decoding import chat_token_ids

    p = next(p for p in spec_bench() if p.id == r["prompt_id"])
    if report["config"]["chat"]:
        return chat_token_ids(model.tokenizer, [{"role": "user", "content": p.text}], add_generation_prompt=True)
    return model.tokenizer(p.text)["input_ids"]


if __name__ == "__main__":
    main()
