"""PPD's theory (Yang et al. 2023, §4): Theorem 4.1, the approximations of equations 3, 5 and 6, a
Monte-Carlo simulation of the run model that checks the theorem, measured match rates p̂_correct,
and the trade-off curves of Figures 3 and 4.

Units: one time unit = one layer of one token; compute = layer-units summed over every compute unit.
``d`` layers, early prediction at layer ``d̄`` (``d/2 <= d̄ < d``), ``k`` sub-processes, ``ℓ`` tokens,
``p`` = p_correct (one of the early top-k equals the final top-1, independently per token).

- Theorem 4.1: E[latency] = dℓ − (d − d̄)(ℓ − 1)p;  E[compute] = dℓ − (d − d̄)(ℓ − 1)p + k(d − d̄)ℓ.
- eq. 3 (ℓ ≫ 1, d̄ = d/2): latency per token ≈ d(1 − p/2)  (normalised: 1 − p/2).
- eq. 5: compute per time unit ≈ (k + 2 − p) / (2 − p).
- eq. 6: compute per token ≈ (2 + k − p) / 2 (normalised by d; eq. 3 × eq. 5).
The ``*_general`` forms give the same limits for any d̄ >= d/2 (they reduce to eqs. 3/5/6 at d̄ = d/2).
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass

import torch

from ..files import save_figure
from ..methods.ppd import Clock, theorem_compute, theorem_latency

SIMULATE_MAX = 50_000_000  # simulated tokens (trials x tokens) of ``simulate``: about 20 s on one core


# -- the approximations (Theorem 4.1 itself is in methods/ppd.py, which reports it) ----------------
def eq3_latency_per_token(p: float) -> float:
    """eq. 3, normalised by d: 1 − p/2 (d̄ = d/2, ℓ ≫ 1)."""
    return 1 - p / 2


def eq5_compute_per_time_unit(k: int, p: float) -> float:
    """eq. 5: (k + 2 − p) / (2 − p) compute units in use on average."""
    return (k + 2 - p) / (2 - p)


def eq6_compute_per_token(k: int, p: float) -> float:
    """eq. 6, normalised by d: (2 + k − p) / 2."""
    return (2 + k - p) / 2


def latency_per_token_general(d: int, dbar: int, p: float) -> float:
    """ℓ ≫ 1, any d̄ >= d/2, normalised by d: 1 − (1 − d̄/d)p (eq. 3 at d̄ = d/2)."""
    return 1 - (d - dbar) / d * p


def compute_per_token_general(d: int, dbar: int, k: int, p: float) -> float:
    """ℓ ≫ 1, normalised by d: 1 − (1 − d̄/d)p + k(1 − d̄/d) (eq. 6 at d̄ = d/2)."""
    return latency_per_token_general(d, dbar, p) + k * (d - dbar) / d


def compute_per_time_unit_general(d: int, dbar: int, k: int, p: float) -> float:
    """ℓ ≫ 1: compute per token over latency per token (eq. 5 at d̄ = d/2)."""
    return compute_per_token_general(d, dbar, k, p) / latency_per_token_general(d, dbar, p)


def check_inputs(d: int, dbar: int, k: int, p: float, n_tokens: int) -> None:
    from .. import validate as V
    from ..errors import LayerleapError

    V.integer(d, "--layers")
    V.integer(dbar, "--exit-layer")
    V.integer(k, "--k")
    V.number(p, "--p-correct")
    V.integer(n_tokens, "--tokens")
    if d < 2:
        raise LayerleapError(f"--layers must be at least 2, got {d}")
    if not (d + 1) // 2 <= dbar < d:
        raise LayerleapError(
            f"--exit-layer must be in [{(d + 1) // 2}, {d - 1}] (d/2 <= d̄ < d, as Theorem 4.1 assumes), got {dbar}"
        )
    if k < 1:
        raise LayerleapError(f"--k must be at least 1, got {k}")
    if not 0 <= p <= 1:
        raise LayerleapError(f"--p-correct must be a probability in [0, 1], got {p}")
    if n_tokens < 1:
        raise LayerleapError(f"--tokens must be at least 1, got {n_tokens}")


def figures(d: int, dbar: int, k: int, p: float, n_tokens: int) -> dict:
    """Every figure of the theory for one setting."""
    check_inputs(d, dbar, k, p, n_tokens)
    lat = theorem_latency(d, dbar, n_tokens, p)
    comp = theorem_compute(d, dbar, k, n_tokens, p)
    out = {
        "layers": d,
        "exit_layer": dbar,
        "k": k,
        "p_correct": p,
        "tokens": n_tokens,
        "theorem": {
            "latency_units": lat,
            "compute_units": comp,
            "greedy_units": d * n_tokens,
            "normalised_latency_per_token": lat / (d * n_tokens),
            "normalised_compute_per_token": comp / (d * n_tokens),
            "compute_per_time_unit": comp / lat,
        },
        "approximation": {
            "normalised_latency_per_token": latency_per_token_general(d, dbar, p),
            "compute_per_time_unit": compute_per_time_unit_general(d, dbar, k, p),
            "normalised_compute_per_token": compute_per_token_general(d, dbar, k, p),
        },
    }
    if 2 * dbar == d:
        out["eq3_normalised_latency_per_token"] = eq3_latency_per_token(p)
        out["eq5_compute_per_time_unit"] = eq5_compute_per_time_unit(k, p)
        out["eq6_normalised_compute_per_token"] = eq6_compute_per_token(k, p)
    return out


# -- Monte-Carlo simulation of the run model -------------------------------------------------------
@dataclass
class Simulation:
    trials: int
    mean_latency: float
    sd_latency: float
    mean_compute: float
    sd_compute: float
    mean_runs: float

    def to_dict(self) -> dict:
        return asdict(self)


def simulate(
    d: int, dbar: int, k: int, p: float, n_tokens: int, trials: int = 2000, seed: int = 0, progress: bool = False
) -> Simulation:
    """Generate ``trials`` sequences of ``n_tokens`` tokens on the pipeline schedule of ``methods/ppd.Clock``
    (the main process waits for a sub-process's result when it takes one over), each token's early
    prediction matching with probability ``p`` independently; the mean latency and compute estimate
    Theorem 4.1's expectations."""
    from tqdm.auto import tqdm

    from .. import validate as V

    check_inputs(d, dbar, k, p, n_tokens)
    V.integer(trials, "trials", 1)
    V.at_most(trials * n_tokens, SIMULATE_MAX, "trials × n_tokens (simulated tokens)", "lower trials or n_tokens")
    V.seed(seed)
    rng = random.Random(seed)
    lo = d - dbar
    lats, comps, runs = [], [], []
    for _ in tqdm(
        range(trials),
        desc="simulate",
        unit="seq",
        disable=not progress,
        leave=False,
        mininterval=0.5,
        miniters=max(1, trials // 100),
    ):
        clock, n_runs = Clock(), 1
        clock.run_main(dbar)  # x_0: the lower layers
        for t in range(n_tokens):
            clock.run_subs(k, lo)  # candidates for x_{t+1}
            clock.run_main(d - dbar)  # x_t: the upper layers -> x_{t+1}
            if t == n_tokens - 1:
                break
            if rng.random() < p:  # x_{t+1} equals a candidate: continue at layer d - d̄
                clock.run_main(dbar - lo, after=clock.sub_done)
            else:
                clock.run_main(dbar)
                n_runs += 1
        lats.append(clock.main)
        comps.append(clock.compute)
        runs.append(n_runs)

    def mean_sd(xs):
        m = sum(xs) / len(xs)
        return m, math.sqrt(sum((x - m) ** 2 for x in xs) / max(1, len(xs) - 1))

    (ml, sl), (mc, sc) = mean_sd(lats), mean_sd(comps)
    return Simulation(trials, ml, sl, mc, sc, sum(runs) / trials)


# -- measured match rates --------------------------------------------------------------------------
@torch.inference_mode()
def match_rates(
    model, prompt_ids: list[int], out_ids: list[int], layers: list[int], ks: list[int], head="auto"
) -> dict[int, dict[int, tuple[int, int]]]:
    """p̂_correct as PPD realises it, from one forward over the prompt and a greedy output: the exit
    head's top-k at layer d̄ of x_0 (the last prompt token) .. x_{ℓ-2} is compared with the next token
    x_1 .. x_{ℓ-1} (a match for x_ℓ saves nothing: it is never fed back).
    -> ``{d̄: {k: (matches, trials)}}``."""
    from ..drafters.exit_heads import get_head

    seq = list(prompt_ids) + list(out_ids[:-2])  # x_0 .. x_{ℓ-2} are the last n positions
    n = len(out_ids) - 1
    if n <= 0:
        return {L: {k: (0, 0) for k in ks} for L in layers}
    ids = torch.tensor([seq], device=model.device)
    pos = torch.arange(len(seq), device=model.device).unsqueeze(0)
    target = torch.tensor(out_ids[:-1])  # [n] x_1 .. x_{ℓ-1}
    h = model.embed(ids)
    done, out = 0, {}
    for L in sorted(layers):
        h = model.run_layers(h, done, L, pos)
        done = L
        top = get_head(model, L, head)(h[:, -n:])[0].topk(max(ks), -1).indices.cpu()  # [n, kmax]
        hit_rank = torch.where(top == target.unsqueeze(1), torch.arange(max(ks)), max(ks)).min(1).values  # [n]
        out[L] = {k: (int((hit_rank < k).sum()), n) for k in ks}
    return out


# -- Figures 3 and 4 ------------------------------------------------------------------------------
def plot_tradeoff(points: dict[str, dict[int, float]], d: int, dbar: int, path, title: str = "") -> None:
    """Figures 3 and 4 side by side: for every series (a category, by k: p̂) the approximate
    normalised latency per token against compute per time unit (left) and per token (right); grey
    lines are the same formulas over p ∈ [0, 1] for each k.  Written atomically as PNG."""
    from ..files import pyplot

    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    ks = sorted({k for s in points.values() for k in s})
    grid = [i / 100 for i in range(101)]
    for k in ks:
        lat = [latency_per_token_general(d, dbar, p) for p in grid]
        axes[0].plot([compute_per_time_unit_general(d, dbar, k, p) for p in grid], lat, color="0.85", lw=1)
        axes[1].plot([compute_per_token_general(d, dbar, k, p) for p in grid], lat, color="0.85", lw=1)
    for label, by_k in points.items():
        kk = sorted(by_k)
        lat = [latency_per_token_general(d, dbar, by_k[k]) for k in kk]
        for ax, fn in ((axes[0], compute_per_time_unit_general), (axes[1], compute_per_token_general)):
            xs = [fn(d, dbar, k, by_k[k]) for k in kk]
            ax.plot(xs, lat, marker="o", label=label)
            for x, y, k in zip(xs, lat, kk):
                ax.annotate(f"k={k}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    axes[0].set_xlabel("average compute units per time unit (eq. 5)")
    axes[1].set_xlabel("average compute per token, normalised by d (eq. 6)")
    for ax in axes:
        ax.set_ylabel("normalised latency per token (eq. 3)")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle(title or f"PPD trade-off, d={d}, d̄={dbar} (measured p̂_correct)")
    fig.tight_layout()
    save_figure(fig, path)
