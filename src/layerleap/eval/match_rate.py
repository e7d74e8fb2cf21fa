"""The match rate p̂_correct (PPD §4.3, Table 2; by token position, Tables 6-8; sampling, Appendix B).

For every generated token, does the early top-k at layer ``d̄`` (through an exit head) contain the
token the full model produced?  With greedy decoding that token is the final layer's top-1 (Table 2);
with top-k / top-p sampling it is the sampled token (Appendix B: the early candidates PPD would
launch must contain what the model actually emits).

The text is generated first (``layerleap.generate``); one causal pass over prompt + output then
gives the hidden state after each probed layer at each generating position (the same states as
incremental decoding, up to float rounding order).  ``match_rate`` returns every count, so callers
(PPD's theory plots) can use measured rates.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from .. import validate as V
from ..errors import LayerleapError
from ..files import save_figure
from ..drafters.exit_heads import ExitHead, get_head
from ..core.model import Transformer
from ..core.run import row_seed

MODES = ("greedy", "top-k", "top-p")


class MatchRateError(LayerleapError, ValueError):
    pass


@dataclass
class MatchRateConfig:
    layers: tuple[int, ...] = (15, 25)
    ks: tuple[int, ...] = (1, 3, 5)
    heads: tuple[str, ...] = ("shared", "trained")  # "shared", "trained", "auto" or a heads file
    mode: str = "greedy"
    max_new_tokens: int = 64
    top_k: int = 50  # top-k sampling's k
    top_p: float = 0.9
    temperature: float = 1.0
    seed: int = 0
    buckets: int = 8  # token-position groups (Tables 6-8 use 8 groups of 2 for 16 tokens)
    chat: bool = True

    def check(self, model: Transformer) -> "MatchRateConfig":
        n = model.config.n_layers
        bad = [x for x in self.layers if isinstance(x, bool) or not isinstance(x, int) or not 1 <= x <= n]
        if not self.layers or bad:
            raise MatchRateError(f"layers must be integers in [1, {n}], got {list(self.layers)}")
        if not self.ks or any(not isinstance(k, int) or k < 1 for k in self.ks):
            raise MatchRateError(f"k must be positive integers, got {list(self.ks)}")
        if self.mode not in MODES:
            raise MatchRateError(f"unknown mode {self.mode!r}: choose {', '.join(MODES)}")
        if not self.heads:
            raise MatchRateError("no heads: give e.g. shared,trained")
        for name, items in (("layers", self.layers), ("k", self.ks), ("heads", self.heads)):
            twice = sorted({x for x in items if list(items).count(x) > 1}, key=str)
            if twice:  # a repeated layer or k would be counted twice over
                raise MatchRateError(f"{name} {', '.join(map(str, twice))} given twice: give each once")
        with V.raising(MatchRateError):
            V.integer(self.max_new_tokens, "max_new_tokens", 1, model.config.max_position - 1)
            V.integer(self.buckets, "buckets", 1)
            for k in self.ks:
                V.integer(k, "k", 1, model.config.vocab_size, " (the vocabulary)")
            V.integer(self.top_k, "top_k", 1)
            V.number(self.top_p, "top_p", 0, 1, lo_open=True)
            V.number(self.temperature, "temperature", V.MIN_TEMPERATURE)
            V.seed(self.seed)
        return self


@dataclass
class MatchRateResult:
    config: dict
    tokens: int  # generated tokens compared
    prompts: int
    # rates[head][layer][k] = p̂_correct; hits likewise (counts)
    rates: dict = field(default_factory=dict)
    hits: dict = field(default_factory=dict)
    # by_position[head][layer][k] = [rate per bucket]; bucket_edges = first position of each bucket
    by_position: dict = field(default_factory=dict)
    bucket_tokens: list = field(default_factory=list)
    bucket_edges: list = field(default_factory=list)
    greedy_mismatch: int = 0  # greedy tokens that differ from the teacher-forced argmax (float rounding)

    def to_dict(self) -> dict:
        return asdict(self)


def resolve_heads(model: Transformer, names, layers) -> dict[str, dict[int, ExitHead]]:
    """``{name: {layer: head}}``; "trained" must ship for every layer (a clear error otherwise)."""
    return {str(name): {x: get_head(model, x, name) for x in layers} for name in names}


@torch.inference_mode()
def layer_states(model: Transformer, ids: list[int], layers) -> dict[int, torch.Tensor]:
    """One causal pass: ``{layer: [S, D]}`` hidden states after each layer in ``layers`` (and the last)."""
    n = model.config.n_layers
    t = torch.tensor([ids], dtype=torch.long, device=model.device)
    pos = torch.arange(len(ids), device=model.device).unsqueeze(0)
    h, done, out = model.embed(t), 0, {}
    for x in sorted(set(layers) | {n}):
        h = model.run_layers(h, done, x, pos)
        done = x
        out[x] = h[0]
    return out


def bucket_edges(max_new_tokens: int, buckets: int) -> list[int]:
    width = max(1, -(-max_new_tokens // buckets))
    return list(range(0, max_new_tokens, width))


@torch.inference_mode()
def match_rate(
    model: Transformer, prompts, cfg: MatchRateConfig, heads: dict | None = None, progress: bool = True
) -> MatchRateResult:
    """p̂_correct for each head, layer and k over ``prompts`` (texts or token-id lists)."""
    from tqdm import tqdm
    import sys
    from ..decoding import generate

    cfg.check(model)
    with V.raising(MatchRateError):
        prompts = V.items(prompts, "prompts", "texts or token-id lists")
    heads = heads if heads is not None else resolve_heads(model, cfg.heads, cfg.layers)
    edges = bucket_edges(cfg.max_new_tokens, cfg.buckets)
    kmax = max(cfg.ks)
    hits = {h: {x: {k: 0 for k in cfg.ks} for x in cfg.layers} for h in heads}
    pos_hits = {h: {x: {k: [0] * len(edges) for k in cfg.ks} for x in cfg.layers} for h in heads}
    pos_n = [0] * len(edges)
    total, mismatch = 0, 0
    sampling = (
        {}
        if cfg.mode == "greedy"
        else {
            "do_sample": True,
            "temperature": cfg.temperature,
            "seed": cfg.seed,
            **({"top_k": cfg.top_k} if cfg.mode == "top-k" else {"top_p": cfg.top_p}),
        }
    )
    method = "greedy" if cfg.mode == "greedy" else "sample"
    for i, p in enumerate(
        tqdm(list(prompts), desc=f"match rate ({cfg.mode})", disable=not progress, file=sys.stderr, dynamic_ncols=True)
    ):
        if sampling:
            sampling["seed"] = row_seed(cfg.seed, i)
        res = generate(model, p, method, cfg.max_new_tokens, chat=cfg.chat and isinstance(p, str), **sampling)
        out = list(res.token_ids)
        if not out:
            continue
        ids = list(res.prompt_ids) + out
        P, G = len(res.prompt_ids), len(out)
        states = layer_states(model, ids, cfg.layers)
        rows = slice(P - 1, P - 1 + G)  # position t predicts token t + 1
        emitted = torch.tensor(out, device=model.device)
        if cfg.mode == "greedy":
            final = model.logits(states[model.config.n_layers][rows].unsqueeze(0))[0]
            target = final.argmax(-1)
            mismatch += int((target != emitted).sum())
        else:
            target = emitted
        width = max(1, -(-cfg.max_new_tokens // cfg.buckets))
        b = torch.tensor([min(len(edges) - 1, t // width) for t in range(G)])
        for j in range(len(edges)):
            pos_n[j] += int((b == j).sum())
        for name, by_layer in heads.items():
            for x in cfg.layers:
                top = by_layer[x](states[x][rows].unsqueeze(0))[0].topk(kmax, -1).indices  # [G, kmax]
                for k in cfg.ks:
                    ok = (top[:, :k] == target[:, None]).any(-1).cpu()
                    hits[name][x][k] += int(ok.sum())
                    for j in range(len(edges)):
                        pos_hits[name][x][k][j] += int(ok[b == j].sum())
        total += G
    rates = {h: {x: {k: hits[h][x][k] / max(1, total) for k in cfg.ks} for x in cfg.layers} for h in heads}
    by_pos = {
        h: {
            x: {k: [pos_hits[h][x][k][j] / pos_n[j] if pos_n[j] else None for j in range(len(edges))] for k in cfg.ks}
            for x in cfg.layers
        }
        for h in heads
    }
    return MatchRateResult(asdict(cfg), total, len(prompts), rates, hits, by_pos, pos_n, edges, mismatch)


# -- reports ------------------------------------------------------------------------------------------
def table(res: MatchRateResult, title: str = "") -> str:
    """Table 2's layout: one row per (k, head), one column per layer."""
    cfg = res.config
    layers = cfg["layers"]
    lines = [title] if title else []
    lines.append(f"{'k':>3} {'head':<10}" + "".join(f"{'L' + str(x):>9}" for x in layers))
    for k in cfg["ks"]:
        for h in res.rates:
            lines.append(f"{k:>3} {h[:10]:<10}" + "".join(f"{100 * res.rates[h][x][k]:>8.2f}%" for x in layers))
    return "\n".join(lines)


def position_table(res: MatchRateResult, layer: int) -> str:
    """Tables 6-8's layout at one layer: one row per (k, head), one column per token-position group."""
    edges, G = res.bucket_edges, res.config["max_new_tokens"]
    spans = [f"{a + 1}-{(edges[j + 1] if j + 1 < len(edges) else G)}" for j, a in enumerate(edges)]
    header = f"{'k':>3} {'head':<10}" + "".join(f"{s:>8}" for s in spans) + f"{'total':>8}"
    lines = [f"layer {layer}, by token position", header]
    for k in res.config["ks"]:
        for h in res.rates:
            cells = "".join(f"{'-':>8}" if r is None else f"{100 * r:>7.1f}%" for r in res.by_position[h][layer][k])
            lines.append(f"{k:>3} {h[:10]:<10}{cells}{100 * res.rates[h][layer][k]:>7.1f}%")
    return "\n".join(lines)


def plot(results: dict[str, MatchRateResult], path) -> None:
    """p̂_correct against layer, one line per (head, k), one panel per result (category or mode)."""
    from ..files import pyplot

    plt = pyplot()
    n = len(results)
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 3.6), squeeze=False, sharey=True)
    styles = {0: "-", 1: "--", 2: ":", 3: "-."}
    for ax, (name, res) in zip(axes[0], results.items()):
        layers = res.config["layers"]
        for hi, h in enumerate(res.rates):
            for ki, k in enumerate(res.config["ks"]):
                ax.plot(
                    layers,
                    [100 * res.rates[h][x][k] for x in layers],
                    styles.get(hi, "-"),
                    marker="o",
                    color=f"C{ki}",
                    label=f"{h}, k={k}",
                )
        ax.set_title(f"{name} ({res.tokens} tokens)")
        ax.set_xlabel("layer d̄")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("p̂_correct (%)")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    save_figure(fig, path)


__all__ = [
    "MatchRateConfig",
    "MatchRateResult",
    "match_rate",
    "table",
    "position_table",
    "plot",
    "MODES",
    "MatchRateError",
    "resolve_heads",
    "layer_states",
]


# -- cost ---------------------------------------------------------------------------------------------
@torch.inference_mode()
def head_cost(
    model: Transformer,
    layers,
    heads: dict[str, ExitHead | None] | None = None,
    context: int = 128,
    reps: int = 30,
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """Seconds per decode step (one token, KV cache at ``context``) of the layers up to each layer in
    ``layers``, and of each exit head on one row; the head's overhead is ``head / layers(l)``.
    Steps of the layers and of the heads are interleaved rep by rep (shared-machine noise hits both)."""
    import time

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, context + 1), generator=g).to(model.device)
    cache = model.new_cache(1, context + 2)
    pos = torch.arange(context, device=model.device).unsqueeze(0)
    model.run_layers(model.embed(ids[:, :context]), 0, model.config.n_layers, pos, cache)
    h0 = model.embed(ids[:, context:])
    pos1 = torch.tensor([[context]], device=model.device)
    heads = heads or {}
    t_layers = {x: [] for x in layers}
    t_heads = {name: [] for name in heads}
    hx = None
    from tqdm.auto import tqdm

    for _ in tqdm(range(reps + 2), desc="head cost", unit="rep", disable=not progress, leave=False):
        for x in layers:
            t = time.perf_counter()
            hx = model.run_layers(h0, 0, x, pos1, cache)
            t_layers[x].append(time.perf_counter() - t)
            cache.truncate(context)
        for name, head in heads.items():
            t = time.perf_counter()
            head(hx)
            t_heads[name].append(time.perf_counter() - t)
    med = lambda v: sorted(v[2:])[len(v[2:]) // 2]  # noqa: E731  (median after 2 warm-up reps)
    lay = {x: med(v) for x, v in t_layers.items()}
    hd = {name: med(v) for name, v in t_heads.items()}
    return {
        "context": context,
        "reps": reps,
        "layers_s": lay,
        "heads_s": hd,
        "overhead": {name: {x: hd[name] / lay[x] for x in layers} for name in heads},
    }
