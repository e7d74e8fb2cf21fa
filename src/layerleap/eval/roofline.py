"""Machine and model facts for the memory-bound roofline of decoding.

Decoding one token reads every layer's weights, the final norm, the LM head and the KV cache of
the context, and does little arithmetic on them, so ``bytes read per token / memory bandwidth``
bounds the speed of plain (one token per model call) decoding.  Two bandwidths are measured: a
streaming reduction (``x.sum()``, the best case) and a one-row matrix product (``F.linear``, which
is what decoding does, in the layout the model stores its weights).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from ..core import cost_curve
from ..core.cpu import OtherLoad
from ..core.model import Transformer


@dataclass(frozen=True)
class Bandwidth:
    sum_gbs: float  # GB/s (1e9 bytes) of x.sum() over the buffer
    gemv_gbs: float  # GB/s of F.linear(one row, weight) over the same bytes
    buffer_mb: float
    dtype: str
    gemv_shape: tuple[int, int]  # [out, in] of the gemv weight
    column_major: bool  # the gemv weight's layout (fp32 decoding weights are column-major on CPU)
    repeats: int


def best_time(fn, repeats: int) -> float:
    """The fastest of ``repeats`` calls of ``fn`` (seconds), after one warm-up call."""
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure_bandwidth(
    dtype: torch.dtype = torch.float32,
    buffer_mb: float = 256,
    repeats: int = 5,
    cols: int = 4096,
    column_major: bool | None = None,
) -> Bandwidth:
    """Best-of-``repeats`` read bandwidth over a ``buffer_mb`` MB buffer of ``dtype``.

    The gemv weight is the same buffer viewed as ``[rows, cols]`` (``cols``: the input width, e.g.
    the model's hidden size); ``column_major`` (default: as ``Transformer.optimize_layout`` stores
    weights, i.e. for fp32) stores it transposed.  On a 2-core CPU VM a row-major fp32 weight with
    576 inputs streams ~11 GB/s, a column-major one ~21 GB/s, ``sum`` ~22-27 GB/s."""
    elt = torch.empty((), dtype=dtype).element_size()
    rows = max(1, int(buffer_mb * 1e6) // (elt * cols))
    buf = torch.ones(rows * cols, dtype=dtype)
    nbytes = buf.numel() * elt
    if column_major is None:
        column_major = dtype == torch.float32
    weight = buf.view(cols, rows).t() if column_major else buf.view(rows, cols)  # [rows, cols] either way
    x = torch.ones(1, cols, dtype=dtype)
    with torch.inference_mode():
        t_sum = best_time(buf.sum, repeats)
        t_gemv = best_time(lambda: F.linear(x, weight), repeats)
    return Bandwidth(
        nbytes / t_sum / 1e9,
        nbytes / t_gemv / 1e9,
        nbytes / 1e6,
        str(dtype).removeprefix("torch."),
        (rows, cols),
        column_major,
        repeats,
    )


def kv_bytes_per_token(model: Transformer) -> int:
    c = model.config
    return 2 * c.n_layers * c.n_kv_heads * c.head_dim * model.cache_dtype().itemsize


def weight_bytes_per_token(model: Transformer) -> int:
    """Weight bytes one full decoding step reads: every layer, the final norm and the LM head (the
    embedding table is only looked up, one row)."""
    norms = list(model.norm.parameters()) + [
        p for blk in model.layers for n in (blk.attn_norm, blk.mlp_norm) for p in n.parameters()
    ]
    total = sum(t.numel() * t.element_size() for t in norms)
    for lin in model.projections():
        if lin.packed is not None:
            total += lin.packed.nbytes
        else:
            total += sum(t.numel() * t.element_size() for t in (lin.weight, lin.bias) if t is not None)
    return total


@dataclass(frozen=True)
class Roofline:
    context: int  # tokens in the KV cache while decoding
    weight_bytes_per_token: int
    kv_bytes_per_token: int  # per cached token
    bytes_per_token: int  # weights + KV cache of `context` tokens
    ms_per_token_sum: float
    tokens_per_s_sum: float
    ms_per_token_gemv: float
    tokens_per_s_gemv: float

    def to_dict(self) -> dict:
        return asdict(self)


def roofline(model: Transformer, bw: Bandwidth, context: int = 256) -> Roofline:
    w, kv = weight_bytes_per_token(model), kv_bytes_per_token(model)
    total = w + kv * context
    ms_sum, ms_gemv = total / (bw.sum_gbs * 1e6), total / (bw.gemv_gbs * 1e6)
    return Roofline(context, w, kv, total, ms_sum, 1e3 / ms_sum, ms_gemv, 1e3 / ms_gemv)


# -- the cost of one model call over S new tokens -----------------------------------------------
CALL_COST_SIZES = (1, 2, 4, 8, 16)
BUSY_SHARE = 0.05  # other processes' share of the CPUs above which a measured curve is not saved over one


@dataclass(frozen=True)
class CallCost:
    """Milliseconds per model call over ``S`` new tokens (all layers and the LM head over every new
    position, as a verification call needs) at ``context`` cached tokens; ``ratio`` = ms(S) / ms(1).

    Each size is timed ``rounds`` times, round-robin over the sizes (so a disturbance hits every
    size alike), and the best time is kept: on a shared machine the minimum is the call's own cost."""

    context: int
    threads: int
    dtype: str
    rounds: int
    points: list[dict]  # [{"new_tokens": S, "ms": best, "median_ms": median, "ratio": ms / ms(S=1)}]
    other_cpu_share: float | None = None  # the CPUs' share other processes used meanwhile (``cpu.OtherLoad``)

    def to_dict(self) -> dict:
        return asdict(self)

    def ratio(self, new_tokens: int) -> float:
        return next(p["ratio"] for p in self.points if p["new_tokens"] == new_tokens)


def call_cost(
    model: Transformer, context: int = 256, sizes=CALL_COST_SIZES, rounds: int = 15, dtype_name: str | None = None
) -> CallCost:
    """Measure ``CallCost`` on ``model``: a cache holding ``context`` tokens, then calls over
    ``S`` new tokens (causal among themselves), each rolled back before the next."""
    with OtherLoad() as others:
        context, times = cost_curve.time_calls(model, context, sizes, rounds)
    best = {s: min(ts) * 1e3 for s, ts in times.items()}
    points = [
        {
            "new_tokens": s,
            "ms": round(best[s], 3),
            "median_ms": round(sorted(ts)[len(ts) // 2] * 1e3, 3),
            "ratio": round(best[s] / best[1], 3),
        }
        for s, ts in times.items()
    ]
    share = None if others.share is None else round(others.share, 3)
    return CallCost(context, torch.get_num_threads(), dtype_name or model.dtype_name, rounds, points, share)


def format_call_cost(cc: CallCost, roofline_ms: float | None = None) -> str:
    """The curve as text; with ``roofline_ms`` (one token's bytes / bandwidth) the share of the
    roofline that a one-token call reaches."""
    head = f"call cost at {cc.context} cached tokens ({cc.dtype}, {cc.threads} threads, best of {cc.rounds}):"
    rows = [f"  S={p['new_tokens']:<3} {p['ms']:8.2f} ms  x{p['ratio']:.2f}" for p in cc.points]
    if roofline_ms:
        rows[0] += f"  ({roofline_ms / cc.points[0]['ms']:.0%} of the roofline's {roofline_ms:.1f} ms)"
    if cc.other_cpu_share is not None and cc.other_cpu_share > BUSY_SHARE:
        rows.append(f"  (other processes used {cc.other_cpu_share:.0%} of the CPUs meanwhile)")
    return "\n".join([head] + rows)
