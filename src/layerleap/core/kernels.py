"""Packed weight formats: the layouts that CPU kernels multiply fastest, behind one small interface.

A projection (``model.Linear``) holds either a dense ``[out, in]`` weight, multiplied with
``F.linear``, or one of these packed weights:

- ``OneDNNWeight``: fp32 or bf16 in oneDNN's blocked layout (``mkldnn._reorder_linear_weight``),
  multiplied by oneDNN's linear kernel.  It stays nearly flat from 1 to 16 rows, where ``F.linear``
  costs 1.4-3x more (see ``docs/BENCHMARKS.md``).  This is what makes a call over a few new tokens
  cost about one call.  Where a few more rows multiply faster than fewer (on the Zen 4 EPYC one fp32
  row cost about 1.25x four rows), a product runs padded with zero rows (``onednn_rows``).
- ``Int4Weight``: 4-bit codes in groups of 32 along the input with a scale and a zero per group
  (``w = (q - 8) * scale + zero``), multiplied by torch's int4 CPU kernel
  (``aten._weight_int4pack_mm_for_cpu``, bf16 activations).  GGUF Q4_1 and Q4_K blocks map onto it
  without re-quantizing; the kernel keeps scale and zero in bf16 (``docs/BENCHMARKS.md`` gives the
  error that costs).
- ``BlockWeight``: GGUF's blocks as stored (4-, 6- or 8-bit codes with their scales), multiplied by
  the native block kernel (``native/decoder.cpp``); ``StackWeight``: block weights of different
  types over consecutive output rows of one fused product.

Every format answers ``fmt(x)`` (``[..., in] -> [..., out]``), ``dense()`` (the weight as a dense
``[out, in]`` tensor) and ``nbytes``; ``Int4Weight`` also answers ``rows(ids)`` for embeddings.
Packed weights live on the CPU and carry no gradient: a product that needs one goes through
``_DenseBackward`` (the backward multiplies by the dense weight).
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import LayerleapError
from ..files import cache_root, locked, write_json
from .cpu import cpu_signature

ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
ONEDNN_DTYPES = (torch.float32, torch.bfloat16)
ONEDNN_BATCH_HINT = 16  # the row count oneDNN's layout is chosen for: 1..16 rows all run near the 1-row cost
ONEDNN_PAD_MAX = 8  # products over fewer rows than this may run padded with zero rows (``onednn_rows``)
GROUP = 32  # int4 group size along the input (GGUF's Q4_0/Q4_1 block, Q4_K's sub-block)
INT4_MAX_ROWS = 16  # above this many rows the int4 kernel takes a slow path: multiply 16 rows at a time


class KernelError(LayerleapError, ValueError):
    """A weight that a kernel cannot hold (wrong shape, device or dtype)."""


class RowIndexError(KernelError, IndexError):
    """Row ids outside a packed table (an embedding's token ids past its vocabulary), refused as
    ``nn.Embedding`` refuses them: the padding rows past the table's end hold no row."""


def _row_ids(ids: torch.Tensor, n: int) -> torch.Tensor:
    """``ids`` (any shape) flat, as int64, each checked to be a row of a table of ``n`` rows."""
    flat = ids.reshape(-1).long()
    if flat.numel():
        lo, hi = torch.aminmax(flat)
        if int(lo) < 0 or int(hi) >= n:
            bad = flat[(flat < 0) | (flat >= n)][:5].tolist()
            raise RowIndexError(f"row ids {bad} are outside the table's {n} rows (ids 0..{n - 1})")
    return flat


class _DenseBackward(torch.autograd.Function):
    """``fmt(x)`` forward, ``grad @ fmt.dense()`` backward: the packed weight stays frozen."""

    @staticmethod
    def forward(ctx, x, fmt):
        ctx.fmt = fmt
        return fmt.matmul(x)

    @staticmethod
    def backward(ctx, grad):
        w = ctx.fmt.dense().to(grad.dtype)
        return grad @ w, None


class PackedWeight:
    """What every packed format shares: shape, dtype, autograd through the dense weight."""

    out_features: int
    in_features: int
    dtype: torch.dtype  # the activations' dtype it multiplies
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            return _DenseBackward.apply(x, self)
        return self.matmul(x)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dense(self) -> torch.Tensor:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        raise NotImplementedError

    def native_proj(self) -> tuple[int, torch.Tensor, torch.Tensor] | None:
        """(kind, a, b) for ``decoder.cpp``'s ``Proj``, or None for a format the C++ does not know."""
        return None

    def native_parts(self) -> list[tuple]:
        """The ``Proj`` entries that follow this one's (a stacked weight's parts), none by default."""
        return []

    def _add_bias(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias.to(y.dtype)


# -- oneDNN ---------------------------------------------------------------------------------------
class OneDNNWeight(PackedWeight):
    """An fp32 or bf16 weight in oneDNN's blocked layout for its linear kernel."""

    def native_proj(self):
        return 1, self.packed, self.pad_table

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        batch_hint: int = ONEDNN_BATCH_HINT,
        pad_to: tuple[int, ...] | None = None,
    ):
        """``pad_to[m]``: how many rows a product over ``m`` rows runs at (zero rows appended, their
        results cut; counts from ``len(pad_to)`` on run as they are); None: this CPU's ``onednn_rows``,
        ``()``: every count as it is."""
        if not ONEDNN:
            raise KernelError("this torch build has no oneDNN: keep dense weights")
        if weight.device.type != "cpu" or weight.dtype not in ONEDNN_DTYPES or weight.dim() != 2:
            raise KernelError(
                f"oneDNN packs 2-D fp32/bf16 CPU weights, got {weight.dtype} {tuple(weight.shape)} on {weight.device}"
            )
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), batch_hint)
        self.bias = None if bias is None else bias.detach().to(weight.dtype).contiguous()
        self.pad_to = onednn_rows(self.dtype) if pad_to is None else tuple(pad_to)
        self.pad_table = torch.tensor(self.pad_to, dtype=torch.long)  # for decoder.cpp's Proj

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # [m, in]
        if x2.dtype != self.dtype:
            x2 = x2.to(self.dtype)
        m = x2.shape[0]
        to = self.pad_to[m] if m < len(self.pad_to) else m
        if to > m:
            x2 = torch.cat([x2, x2.new_zeros(to - m, self.in_features)])  # [to, in]
        y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")
        if to > m:
            y = y[:m]
        return y.view(*lead, self.out_features)

    def dense(self) -> torch.Tensor:
        return self.packed.to_dense()

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features * self.dtype.itemsize


# -- 4-bit groups ---------------------------------------------------------------------------------
@dataclass
class QuantizedRows:
    """A weight as unsigned 4-bit codes with one scale and minimum per group of ``GROUP`` inputs:
    ``w[n, k] = q[n, k] * scale[n, k // GROUP] + minimum[n, k // GROUP]``, all exact in fp32.
    This is GGUF's Q4_1 form (Q4_K's sub-blocks too) before any rounding a kernel needs."""

    q: torch.Tensor  # [N, K] uint8 in 0..15
    scale: torch.Tensor  # [N, K/GROUP] fp32
    minimum: torch.Tensor  # [N, K/GROUP] fp32

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dense(self) -> torch.Tensor:
        """``[N, K]`` fp32, exact."""
        N, K = self.q.shape
        g = self.q.view(N, K // GROUP, GROUP).float()
        return (g * self.scale.unsqueeze(-1) + self.minimum.unsqueeze(-1)).view(N, K)

    @staticmethod
    def cat(parts: list["QuantizedRows"]) -> "QuantizedRows":
        return QuantizedRows(
            torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), torch.cat([p.minimum for p in parts])
        )

    def take_rows(self, index: torch.Tensor) -> "QuantizedRows":
        return QuantizedRows(self.q[index], self.scale[index], self.minimum[index])


Q6_BLOCK = 256  # Q6_K's super-block: one fp16 scale per 256 inputs, an int8 one per 16


@dataclass
class Q6Rows:
    """GGUF's Q6_K as stored: ``w[n, k] = d[n, k // 256] * sc[n, k // 16] * (q[n, k] - 32)`` with 6-bit
    codes, int8 sub-block scales and fp16 super-block scales; ``dense()`` equals gguf's dequantization
    bit for bit (``d * sc`` first, exact in fp32, then times the code)."""

    q: torch.Tensor  # [N, K] uint8 in 0..63
    sc: torch.Tensor  # [N, K/16] int8
    d: torch.Tensor  # [N, K/256] fp32, each exactly an fp16

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dense(self) -> torch.Tensor:
        """``[N, K]`` fp32, exact."""
        n, k = self.q.shape
        dsc = self.d.repeat_interleave(Q6_BLOCK // 16, 1) * self.sc.float()  # [N, K/16]
        return (dsc.unsqueeze(-1) * (self.q.view(n, k // 16, 16).float() - 32)).view(n, k)

    @staticmethod
    def cat(parts: list["Q6Rows"]) -> "Q6Rows":
        return Q6Rows(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "sc", "d")))

    def take_rows(self, index: torch.Tensor) -> "Q6Rows":
        return Q6Rows(self.q[index], self.sc[index], self.d[index])


@dataclass
class MixedRows:
    """A fused weight whose row ranges come in different block types (GGUF Q4_K_M's Q4_K ``attn_q`` and
    ``attn_k`` over a Q6_K ``attn_v``): each part as stored, in row order; ``dense()`` stacks their
    exact values."""

    parts: list  # QuantizedRows or Q6Rows, [N_i, K] each, neighbours of different types

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    def dense(self) -> torch.Tensor:
        """``[N, K]`` fp32, exact."""
        return torch.cat([p.dense() for p in self.parts])

    @staticmethod
    def of(parts: list) -> "QuantizedRows | Q6Rows | MixedRows":
        """The rows of ``parts`` (QuantizedRows or Q6Rows) stacked: neighbours of one type joined, a
        single part's own type when they all share one."""
        runs: list[list] = []
        for p in parts:
            if runs and type(runs[-1][-1]) is type(p):
                runs[-1].append(p)
            else:
                runs.append([p])
        joined = [type(run[0]).cat(run) for run in runs]
        return joined[0] if len(joined) == 1 else MixedRows(joined)


class Int8Rows:
    """An embedding table as 8-bit codes with one scale per group of ``GROUP`` (GGUF's Q8_0:
    ``w = q * d``), looked up row by row; exact, ``dense()`` equals gguf's dequantization."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor):
        if codes.dim() != 2 or codes.shape[1] % GROUP or scale.shape != (codes.shape[0], codes.shape[1] // GROUP):
            raise KernelError(f"8-bit rows {tuple(codes.shape)} do not fit their scales {tuple(scale.shape)}")
        self.codes, self.scale = codes.to(torch.int8).contiguous(), scale.float().contiguous()
        self.out_features, self.in_features = codes.shape
        self.dtype, self.bias = torch.bfloat16, None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def _values(self, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        n = codes.shape[0]
        return (codes.view(n, -1, GROUP).float() * scale.unsqueeze(-1)).view(n, -1)

    def dense(self) -> torch.Tensor:
        """``[N, K]`` fp32, exact."""
        return self._values(self.codes, self.scale)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        flat = _row_ids(ids, self.out_features)
        return self._values(self.codes[flat], self.scale[flat]).to(torch.bfloat16).view(*ids.shape, self.in_features)

    def state(self) -> dict[str, torch.Tensor]:
        return {"int8": self.codes, "int8_scale": self.scale}

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scale.numel() * 4


def quantize(weight: torch.Tensor) -> QuantizedRows:
    """Asymmetric min-max 4-bit quantization of ``[N, K]`` in groups of ``GROUP`` along K (for
    weights that arrive dense, or in a GGUF block type that does not map onto 4-bit groups)."""
    N, K = weight.shape
    if K % GROUP:
        raise KernelError(f"4-bit weights need an input size that is a multiple of {GROUP}, got {K}")
    w = weight.detach().float().view(N, K // GROUP, GROUP)
    lo, hi = w.amin(-1), w.amax(-1)
    scale = (hi - lo) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = ((w - lo.unsqueeze(-1)) / safe.unsqueeze(-1)).round().clamp(0, 15).to(torch.uint8).view(N, K)
    return QuantizedRows(q, scale, lo)


@functools.cache
def _block_n() -> int:
    """The row block of torch's int4 packing on this CPU: 64 with AVX-512, else 32."""
    cap = torch.backends.cpu.get_cpu_capability().upper()
    return 64 if cap.startswith("AVX512") else 32


def _unpack_int4(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Invert ``aten._convert_weight_to_int4pack_for_cpu`` (``packed`` ``[n, k/2]`` uint8 -> codes
    ``[n, k]``).  Rows come in blocks of ``_block_n()``; a full AVX-512 block pairs rows d and
    d+32 in a byte (lanes 0-15 then 16-31), a full AVX2 block rows d and d+16, and a partial block
    (or a CPU without AVX) rows n and n+1."""
    bn = _block_n()
    wide = torch.backends.cpu.get_cpu_capability().upper() != "DEFAULT"
    flat = packed.reshape(-1)
    out = []
    for b0 in range(0, n, bn):
        size = min(bn, n - b0)
        blk = flat[b0 * k // 2 : (b0 + size) * k // 2].view(k, size // 2)  # [k, size/2] bytes
        lo, hi = blk & 0xF, blk >> 4
        if size == bn and wide:
            rows = torch.cat([lo, hi], dim=1)  # [k, size]: lo holds rows 0..size/2-1, hi the rest
        else:
            rows = torch.stack([lo, hi], dim=2).reshape(k, size)  # pairs (n, n+1)
        out.append(rows.t())
    return torch.cat(out).contiguous()


def packed_layout() -> str:
    """A name for torch's int4 packing on this CPU and torch version (packed weights are cached per layout)."""
    return f"{torch.backends.cpu.get_cpu_capability().lower()}-{_block_n()}-torch{torch.__version__.split('+')[0]}"


@functools.cache
def int4_supported() -> bool:
    """Whether torch's int4 CPU kernel runs here and ``_unpack_int4`` reads its layout back
    (checked once on a matrix with a full and a partial row block)."""
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return False
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (_block_n() + 16, 2 * GROUP), generator=g, dtype=torch.int32)
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    except RuntimeError:
        return False
    return torch.equal(_unpack_int4(packed, *q.shape).int(), q)


class Int4Weight(PackedWeight):
    """4-bit groups of 32 along the input for torch's int4 CPU kernel (bf16 activations).

    The output size is padded to a multiple of 64 with zero rows (the kernel's row blocks), and
    the padding is cut from every result.  Products over more than ``INT4_MAX_ROWS`` rows run 16
    rows at a time (the kernel's path for many rows is about 40x slower per row)."""

    def native_proj(self):
        return 2, self.packed, self.scale_zero

    def __init__(self, rows: QuantizedRows, bias: torch.Tensor | None = None):
        if not int4_supported():
            raise KernelError(
                "torch's int4 CPU kernel is not available here (torch build or CPU): use dtype float32 or bfloat16"
            )
        n, k = rows.q.shape
        if k % GROUP:
            raise KernelError(f"4-bit weights need an input size that is a multiple of {GROUP}, got {k}")
        pad = -n % 64
        q, scale, minimum = rows.q, rows.scale, rows.minimum
        if pad:
            q = torch.cat([q, torch.full((pad, k), 8, dtype=q.dtype)])
            scale = torch.cat([scale, scale.new_zeros(pad, k // GROUP)])
            minimum = torch.cat([minimum, minimum.new_zeros(pad, k // GROUP)])
        self.out_features, self.in_features, self.padded = n, k, n + pad
        self.dtype = torch.bfloat16
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)  # [N', K/2]
        zero = minimum + 8 * scale  # the kernel computes (q - 8) * scale + zero
        self.scale_zero = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)  # [K/G, N', 2]
        self.bias = None if bias is None else bias.detach().float()

    @classmethod
    def from_packed(
        cls, packed: torch.Tensor, scale_zero: torch.Tensor, out_features: int, bias: torch.Tensor | None = None
    ) -> "Int4Weight":
        """A weight from what ``packed`` and ``scale_zero`` held before (``state``), without repacking."""
        self = cls.__new__(cls)
        self.padded, self.in_features = packed.shape[0], packed.shape[1] * 2
        if scale_zero.shape != (self.in_features // GROUP, self.padded, 2) or out_features > self.padded:
            raise KernelError(
                f"packed 4-bit weight {tuple(packed.shape)} does not fit its scales "
                f"{tuple(scale_zero.shape)} and {out_features} outputs"
            )
        self.out_features, self.dtype = out_features, torch.bfloat16
        self.packed, self.scale_zero = packed.contiguous(), scale_zero.to(torch.bfloat16).contiguous()
        self.bias = None if bias is None else bias.detach().float()
        return self

    def state(self) -> dict[str, torch.Tensor]:
        """The tensors ``from_packed`` takes (the layout is this CPU's: see ``packed_layout``)."""
        out = {"packed": self.packed, "scale_zero": self.scale_zero}
        if self.bias is not None:
            out["bias"] = self.bias
        return out

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        if x2.shape[0] <= INT4_MAX_ROWS:
            y = mm(x2, self.packed, GROUP, self.scale_zero)
        else:
            y = torch.cat([mm(c, self.packed, GROUP, self.scale_zero) for c in x2.split(INT4_MAX_ROWS)])
        if self.padded != self.out_features:
            y = y[:, : self.out_features]
        return self._add_bias(y).view(*lead, self.out_features).to(x.dtype if x.is_floating_point() else y.dtype)

    def codes(self) -> torch.Tensor:
        """The 4-bit codes ``[N, K]`` uint8."""
        return _unpack_int4(self.packed, self.padded, self.in_features)[: self.out_features]

    def _scale_zero(self, index=None) -> tuple[torch.Tensor, torch.Tensor]:
        sz = self.scale_zero.float()  # [K/G, N', 2]
        if index is not None:
            sz = sz[:, index]
        else:
            sz = sz[:, : self.out_features]
        return sz[..., 0].t(), sz[..., 1].t()  # [N, K/G] each

    def dense(self) -> torch.Tensor:
        """``[N, K]`` bf16: what the kernel multiplies by (scale and zero as the kernel holds them)."""
        return self._dequantize(self.codes(), *self._scale_zero()).to(torch.bfloat16)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (any shape) dequantized, ``[*ids.shape, K]`` bf16: an embedding lookup."""
        flat = _row_ids(ids, self.out_features)
        codes = self._row_codes(flat)
        out = self._dequantize(codes, *self._scale_zero(flat)).to(torch.bfloat16)
        return out.view(*ids.shape, self.in_features)

    def _row_codes(self, idx: torch.Tensor) -> torch.Tensor:
        """Codes of rows ``idx`` ``[n] -> [n, K]`` read straight from the packed layout."""
        bn, k = _block_n(), self.in_features
        wide = torch.backends.cpu.get_cpu_capability().upper() != "DEFAULT"
        full_blocks = self.padded // bn  # padding makes every block full when bn divides 64
        blk = self.packed.reshape(full_blocks, k, bn // 2)  # [NB, K, bn/2]
        b, r = idx // bn, idx % bn
        if wide:
            slot, high = r % (bn // 2), r >= bn // 2
        else:
            slot, high = r // 2, r % 2 == 1
        byte = blk[b, :, slot]  # [n, K]
        return torch.where(high.unsqueeze(1), byte >> 4, byte & 0xF)

    @staticmethod
    def _dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        n, k = codes.shape
        g = codes.view(n, k // GROUP, GROUP).float() - 8
        return (g * scale.unsqueeze(-1) + zero.unsqueeze(-1)).view(n, k)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scale_zero.numel() * 2


# -- 4- and 8-bit blocks for the native kernel ---------------------------------------------------------
BLOCK_ROWS = 16  # output rows per block: one 64-byte vector holds 4 inputs of 16 rows


def _native_blocks():
    """The native module when it was built with ``block_matmul``, else None."""
    from . import native

    mod = native.module()
    return mod if mod is not None and hasattr(mod, "block_matmul") else None


def blocks_available() -> bool:
    return _native_blocks() is not None


Q4_ACTIVATIONS_ENV = "LAYERLEAP_Q4_ACTIVATIONS"  # "15" (the default) or "8": the block kernel's activation bits


def fine_activations() -> bool:
    """Whether ``BlockWeight`` rounds activations to 15 bits (``$LAYERLEAP_Q4_ACTIVATIONS`` unset or
    15) or to 8 bits (8: llama.cpp's rounding, half the multiplications, further from fp32)."""
    bits = os.environ.get(Q4_ACTIVATIONS_ENV, "").strip() or "15"
    if bits not in ("8", "15"):
        raise KernelError(
            f"{Q4_ACTIVATIONS_ENV} must be 8 or 15 (activation bits of the q4 block kernel), got {bits!r}"
        )
    return bits == "15"


def _exact_half(t: torch.Tensor) -> bool:
    h = t.half()
    return bool(torch.isfinite(h).all()) and torch.equal(h.float(), t.float())


SUPER = 8  # groups per super-block of 8-bit scale multipliers (Q4_K's 256 inputs)
SUPER_BYTES = 64 + SUPER * 32  # a block's super-block: fp16 D and M for 16 rows, then sc and mn per group
Q6_SUPER_BYTES = 32 + 16 * 16  # a 6-bit block's super-block: fp16 D for 16 rows, then int8 sc per 16 inputs


def _factor(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``v`` ``[R, 8]`` fp32 -> (``D`` ``[R]``, each exactly an fp16; ``c`` ``[R, 8]`` integers 0..255)
    with ``D * c == v`` exactly in fp32, or None where some row has none.  ``D`` is tried as the
    largest ``|v|`` over 63, 62, ... (Q4_K gives its largest sub-block scale the multiplier 63)."""
    top = v.gather(1, v.abs().argmax(1, keepdim=True)).squeeze(1)  # [R]
    D, c = torch.zeros_like(top), torch.zeros(v.shape, dtype=torch.uint8)
    todo = torch.nonzero(top != 0).squeeze(1)
    for most in range(63, 0, -1):
        if not len(todo):
            break
        t, vv = top[todo], v[todo]
        d = t / most
        q = torch.round(vv / d.unsqueeze(1))
        ok = (d.half().float() == d) & (d * most == t)
        ok &= ((q >= 0) & (q <= 255) & (d.unsqueeze(1) * q == vv)).all(1)
        D[todo[ok]], c[todo[ok]] = d[ok], q[ok].to(torch.uint8)
        todo = todo[~ok]
    return None if len(todo) else (D, c)


def _super_scales(dm: torch.Tensor) -> torch.Tensor:
    """fp32 ``[NB, G, 2, 16]`` -> ``[NB, G/8, 320]`` bytes (``native/decoder.cpp``'s super-block
    scales) when every 8 groups' scales and minimums are an fp16 times 8-bit multipliers, else ``dm``."""
    nb, g = dm.shape[:2]
    v = dm.view(nb, g // SUPER, SUPER, 2, BLOCK_ROWS).permute(0, 1, 3, 4, 2)  # [NB, S, 2, 16, 8]
    sample = _factor(v[:4].reshape(-1, SUPER))  # most fp32 scales are not products: tell early
    whole = None if sample is None else _factor(v.reshape(-1, SUPER))
    if whole is None:
        return dm
    D, c = whole
    pair = D.half().view(nb, g // SUPER, 2 * BLOCK_ROWS).view(torch.uint8)  # [NB, S, 64]
    mult = c.view(nb, g // SUPER, 2, BLOCK_ROWS, SUPER).permute(0, 1, 4, 2, 3).reshape(nb, g // SUPER, -1)
    return torch.cat([pair, mult], -1).contiguous()


class BlockWeight(PackedWeight):
    """A weight as GGUF stores it, 4-bit codes (Q4_0, Q4_1, Q4_K's sub-blocks) or 8-bit codes (Q8_0),
    with one scale and minimum per group of 32 inputs, laid out in blocks of 16 output rows for the
    native kernel (``native/decoder.cpp``, ``block_matmul``): ``w = code * scale + minimum``; or
    Q6_K's 6-bit codes (``bits=6``, ``from_q6``): ``w = D * sc * (code - 32)``, an int8 ``sc`` per 16
    inputs and an fp16 ``D`` per 256.

    Codes, scales and minimums are the file's own (scales in fp16 when every one is exactly an fp16,
    as Q4_0/Q4_1/Q8_0 store them; as Q4_K stores them where every 8 groups' scales and minimums are
    an fp16 times 8-bit multipliers, ``_super_scales``: 0.625 bits a weight; in fp32 otherwise), so
    ``dense()`` equals gguf's dequantization bit for bit.  The kernel rounds the activations per group
    of 32, to 15 bits (``fine``, the default: the next-token distribution as close to fp32's as torch's
    int4 kernel with bf16 activations gets) or to 8 bits as llama.cpp does (half the multiplications;
    ``$LAYERLEAP_Q4_ACTIVATIONS``, ``fine_activations``),
    and sums each group exactly in integers: a row's result depends only on that row, whatever the
    number of rows in a call.  ``rows(ids)`` looks rows up (an embedding table; a tied LM head shares it)."""

    def native_proj(self):
        return (4 if self.fine else 3), self.codes, self.dm  # decoder.cpp's BLOCKS_FINE / BLOCKS

    def __init__(
        self,
        codes: torch.Tensor,
        dm: torch.Tensor,
        out_features: int,
        bits: int,
        bias: torch.Tensor | None = None,
        fine: bool | None = None,
    ):
        nb, g = dm.shape[0], dm.shape[1] * (SUPER if dm.dtype == torch.uint8 else 1)
        per = bits if bits in (4, 6) else 8
        super_bytes = Q6_SUPER_BYTES if bits == 6 else SUPER_BYTES
        if (
            bits not in (4, 6, 8)
            or dm.shape[2:] != ((super_bytes,) if dm.dtype == torch.uint8 else (2, BLOCK_ROWS))
            or (bits == 6 and dm.dtype != torch.uint8)
            or codes.shape != (nb, g, per, BLOCK_ROWS, 4)
            or not (nb - 1) * BLOCK_ROWS < out_features <= nb * BLOCK_ROWS
        ):
            raise KernelError(
                f"block weight codes {tuple(codes.shape)} do not fit scales {tuple(dm.shape)}, "
                f"{bits} bits and {out_features} outputs"
            )
        self.codes, self.dm, self.bits = codes.to(torch.uint8).contiguous(), dm.contiguous(), bits
        self.out_features, self.in_features = out_features, g * GROUP
        self.dtype = torch.bfloat16
        self.bias = None if bias is None else bias.detach().float()
        self.fine = fine_activations() if fine is None else fine

    @classmethod
    def from_rows(cls, rows: QuantizedRows, bias: torch.Tensor | None = None) -> "BlockWeight":
        n, k = rows.q.shape
        if k % GROUP:
            raise KernelError(f"4-bit weights need an input size that is a multiple of {GROUP}, got {k}")
        blocks = cls._blocked(rows.q.to(torch.uint8), 8).view(-1, k // GROUP, 4, 2, BLOCK_ROWS, 4)
        codes = blocks[:, :, :, 0] | (blocks[:, :, :, 1] << 4)  # [NB, G, 4, 16, 4]
        return cls(codes, cls._scales(rows.scale, rows.minimum), n, 4, bias)

    @classmethod
    def from_q6(cls, rows: Q6Rows, bias: torch.Tensor | None = None) -> "BlockWeight":
        """GGUF's Q6_K as stored: 6-bit codes (low 4 bits as the 4-bit layout, high 2 bits packed four to
        a byte), int8 scales per 16 inputs and fp16 scales per 256 (``native/decoder.cpp``)."""
        n, k = rows.q.shape
        if k % Q6_BLOCK:
            raise KernelError(f"6-bit blocks need an input size that is a multiple of {Q6_BLOCK}, got {k}")
        b = cls._blocked(rows.q.to(torch.uint8), 8)  # [NB, G, 8, 16, 4]
        nb, g = b.shape[:2]
        low = (b & 0x0F).view(nb, g, 4, 2, BLOCK_ROWS, 4)
        high = (b >> 4).view(nb, g, 2, 4, BLOCK_ROWS, 4)
        high = high[:, :, :, 0] | (high[:, :, :, 1] << 2) | (high[:, :, :, 2] << 4) | (high[:, :, :, 3] << 6)
        codes = torch.cat([low[:, :, :, 0] | (low[:, :, :, 1] << 4), high], 2)  # [NB, G, 6, 16, 4]
        pad = -n % BLOCK_ROWS
        d, sc = rows.d.half(), rows.sc.to(torch.int8)
        if pad:
            d, sc = torch.cat([d, d.new_zeros(pad, d.shape[1])]), torch.cat([sc, sc.new_zeros(pad, sc.shape[1])])
        s = k // Q6_BLOCK
        d = d.view(nb, BLOCK_ROWS, s).permute(0, 2, 1).contiguous().view(torch.uint8)  # [NB, S, 32]
        sc = sc.view(nb, BLOCK_ROWS, s, 16).permute(0, 2, 3, 1).contiguous().view(torch.uint8)  # [NB, S, 16, 16]
        dm = torch.cat([d, sc.reshape(nb, s, -1)], -1)  # [NB, S, 288]
        return cls(codes, dm, n, 6, bias)

    @classmethod
    def from_int8(cls, rows: "Int8Rows") -> "BlockWeight":
        """GGUF's Q8_0 (``w = q * d``) as unsigned codes ``q + 128`` with the minimum ``-128 d``."""
        codes = cls._blocked((rows.codes.to(torch.int16) + 128).to(torch.uint8), 8)
        return cls(codes, cls._scales(rows.scale, -128 * rows.scale), rows.out_features, 8)

    @staticmethod
    def _blocked(q: torch.Tensor, per: int) -> torch.Tensor:
        """Codes ``[N, K]`` -> ``[NB, G, 8, 16, 4]``: block, group, run of 4 inputs, row, input."""
        n, k = q.shape
        pad = -n % BLOCK_ROWS
        if pad:
            q = torch.cat([q, q.new_zeros(pad, k)])
        return q.view(-1, BLOCK_ROWS, k // GROUP, per, 4).permute(0, 2, 3, 1, 4).contiguous()

    @staticmethod
    def _scales(scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
        """``[N, G]`` scales and minimums -> ``[NB, G, 2, 16]``, fp16 when that is exact; else, when every
        super-block of ``SUPER`` groups is an fp16 times 8-bit multipliers (Q4_K), ``[NB, G/8, 320]``
        bytes (``_super_scales``); else fp32."""
        n, g = scale.shape
        pad = -n % BLOCK_ROWS
        dm = torch.stack([scale.float(), minimum.float()], 1)  # [N, 2, G]
        if pad:
            dm = torch.cat([dm, dm.new_zeros(pad, 2, g)])
        dm = dm.view(-1, BLOCK_ROWS, 2, g).permute(0, 3, 2, 1).contiguous()  # [NB, G, 2, 16]
        if _exact_half(dm):
            return dm.half()
        return _super_scales(dm) if g % SUPER == 0 else dm

    def _dm_blocks(self, nb: torch.Tensor | None = None) -> torch.Tensor:
        """Scales and minimums ``[NB, G, 2, 16]`` fp32 (of blocks ``nb`` only, when given): exact."""
        dm = self.dm if nb is None else self.dm[nb]
        if dm.dtype != torch.uint8:
            return dm.float()
        n, s = dm.shape[:2]
        pair = dm[..., :64].contiguous().view(torch.float16).float().view(n, s, 1, 2, BLOCK_ROWS)  # D, M
        mult = dm[..., 64:].reshape(n, s, SUPER, 2, BLOCK_ROWS).float()  # sc, mn
        return (pair * mult).view(n, s * SUPER, 2, BLOCK_ROWS)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        mod = _native_blocks()
        if mod is None:
            raise KernelError("the native block kernel is not built: run `layerleap native --build`")
        y = mod.block_matmul(x.reshape(-1, self.in_features), self.codes, self.dm, self.out_features, self.fine, "")
        y = self._add_bias(y)
        return y.view(*lead, self.out_features).to(x.dtype if x.is_floating_point() else torch.bfloat16)

    def _codes_of(self, nb: torch.Tensor | None = None, lane: torch.Tensor | None = None) -> torch.Tensor:
        """Codes ``[n, K]`` of every row (or of rows ``nb * 16 + lane``, picked before unpacking)."""
        c = self.codes.permute(0, 3, 1, 2, 4)  # [NB, 16, G, 4, 6 or 8 vectors, 4]
        c = c.reshape(-1, *c.shape[2:])[: self.out_features] if nb is None else c[nb, lane]
        if self.bits == 6:  # vector 4 + j/4's bits 2(j%4), 2(j%4)+1: the high bits of inputs 4j..4j+3
            high = torch.stack([(c[:, :, 4:] >> (2 * i)) & 3 for i in range(4)], -2)  # [n, G, 2, 4, 4]
            c = c[:, :, :4]
        if self.bits in (4, 6):  # byte i's low nibbles: inputs 8i..8i+3, its high nibbles: 8i+4..8i+7
            c = torch.stack([c & 0x0F, c >> 4], -2)  # [n, G, 4, 2, 4]
        if self.bits == 6:
            c = c | (high.reshape(c.shape) << 4)
        return c.reshape(-1, self.in_features)

    def _q6_scales(self, nb=None, lane=None) -> torch.Tensor:
        """6 bits: the scales ``d * sc`` per 16 inputs, ``[n, K/16]`` fp32 (exact)."""
        dm = self.dm if nb is None else self.dm[nb]  # [NB or n, S, 288]
        m, s = dm.shape[:2]
        d = dm[..., :32].contiguous().view(torch.float16).float()  # [m, S, 16 rows]
        sc = dm[..., 32:].contiguous().view(torch.int8).view(m, s, 16, BLOCK_ROWS).float()  # [m, S, 16 sub, 16 rows]
        dsc = (d.unsqueeze(2) * sc).permute(0, 3, 1, 2).reshape(m, BLOCK_ROWS, -1)  # [m, 16 rows, K/16]
        return dsc.reshape(-1, dsc.shape[-1])[: self.out_features] if nb is None else dsc[torch.arange(m), lane]

    def _dense_of(self, nb=None, lane=None) -> torch.Tensor:
        codes = self._codes_of(nb, lane)
        if self.bits != 6:
            return self._values(codes, *self._dm_of(nb, lane))
        n, k = codes.shape
        return (self._q6_scales(nb, lane).unsqueeze(-1) * (codes.reshape(n, k // 16, 16).float() - 32)).reshape(n, k)

    def _dm_of(self, nb=None, lane=None) -> tuple[torch.Tensor, torch.Tensor]:
        dm = self._dm_blocks(nb).permute(0, 3, 1, 2)  # [NB or n, 16, G, 2]
        dm = dm.reshape(-1, *dm.shape[2:])[: self.out_features] if nb is None else dm[torch.arange(len(nb)), lane]
        return dm[..., 0], dm[..., 1]

    @staticmethod
    def _values(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
        n, k = codes.shape
        g = codes.view(n, k // GROUP, GROUP).float()
        return (g * scale.unsqueeze(-1) + minimum.unsqueeze(-1)).view(n, k)

    def dense(self) -> torch.Tensor:
        """``[N, K]`` fp32, exact (the file's own values)."""
        return self._dense_of()

    def dense_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``dense()[ids]`` for ids ``[n]`` (``[n, K]`` fp32, exact), unpacking only those rows."""
        flat = _row_ids(ids, self.out_features)
        return self._dense_of(flat // BLOCK_ROWS, flat % BLOCK_ROWS)

    def take_rows(self, ids: torch.Tensor) -> "BlockWeight":
        """Rows ``ids`` ``[n]`` of 8-bit blocks as a block weight of their own: their codes, scales and
        minimums as they are, so its ``dense()`` is ``dense_rows(ids)`` bit for bit, made without a
        dense copy."""
        if self.bits != 8:
            raise KernelError(f"take_rows takes 8-bit blocks, not {self.bits}-bit ones")
        flat = _row_ids(ids, self.out_features)
        nb, lane = flat // BLOCK_ROWS, flat % BLOCK_ROWS
        scale, minimum = self._dm_of(nb, lane)  # [n, G] each, fp32, exact
        codes = self._blocked(self._codes_of(nb, lane), 8)
        return BlockWeight(codes, self._scales(scale, minimum), len(flat), 8, fine=self.fine)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (any shape) dequantized, ``[*ids.shape, K]`` bf16: an embedding lookup."""
        flat = _row_ids(ids, self.out_features)
        nb, lane = flat // BLOCK_ROWS, flat % BLOCK_ROWS
        out = self._dense_of(nb, lane).to(torch.bfloat16)
        return out.view(*ids.shape, self.in_features)

    def state(self) -> dict[str, torch.Tensor]:
        out = {"codes": self.codes, "dm": self.dm, "bits": torch.tensor([self.bits])}
        if self.bias is not None:
            out["bias"] = self.bias
        return out

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.dm.numel() * self.dm.element_size()


class StackWeight(PackedWeight):
    """Block weights over consecutive output rows of one product: a fused weight whose parts have
    different block types (``MixedRows``, e.g. 4-bit ``q``/``k`` rows over 6-bit ``v`` rows), each
    part kept as stored.  ``matmul`` multiplies every part by the native kernel, puts the rows side by
    side, then adds the bias: a row's result is the one a single block weight holding that row gives
    (``native/decoder.cpp``'s ``STACK`` does the same calls)."""

    def native_proj(self):
        return 5, torch.empty(0), torch.empty(0)  # decoder.cpp's STACK, followed by its parts

    def native_parts(self) -> list[tuple]:
        """``decoder.cpp``'s ``Proj`` entries of the parts (kind, a, b, bias, out, in), in row order."""
        return [(*p.native_proj(), None, p.out_features, p.in_features) for p in self.parts]

    def __init__(self, parts: list[BlockWeight], bias: torch.Tensor | None = None):
        if not parts or any(not isinstance(p, BlockWeight) or p.bias is not None for p in parts):
            raise KernelError("a stacked weight holds block weights without their own bias")
        if len({p.in_features for p in parts}) != 1:
            raise KernelError(f"stacked block weights differ in inputs: {[p.in_features for p in parts]}")
        self.parts = parts
        self.out_features, self.in_features = sum(p.out_features for p in parts), parts[0].in_features
        self.dtype = torch.bfloat16
        self.bias = None if bias is None else bias.detach().float()

    @classmethod
    def from_mixed(cls, rows: MixedRows, bias: torch.Tensor | None = None) -> "StackWeight":
        return cls(
            [BlockWeight.from_q6(p) if isinstance(p, Q6Rows) else BlockWeight.from_rows(p) for p in rows.parts], bias
        )

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        mod = _native_blocks()
        if mod is None:
            raise KernelError("the native block kernel is not built: run `layerleap native --build`")
        x2 = x.reshape(-1, self.in_features)
        y = torch.cat([mod.block_matmul(x2, p.codes, p.dm, p.out_features, p.fine, "") for p in self.parts], 1)
        y = self._add_bias(y)
        return y.view(*lead, self.out_features).to(x.dtype if x.is_floating_point() else torch.bfloat16)

    def dense(self) -> torch.Tensor:
        """``[N, K]`` fp32, exact (the file's own values)."""
        return torch.cat([p.dense() for p in self.parts])

    def state(self) -> dict[str, torch.Tensor]:
        out = {"parts": torch.tensor([len(self.parts)])}
        for i, p in enumerate(self.parts):
            out.update({f"part{i}.{k}": v for k, v in p.state().items()})
            out[f"part{i}.out_features"] = torch.tensor([p.out_features])
        if self.bias is not None:
            out["bias"] = self.bias
        return out

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor]) -> "StackWeight":
        """The weight ``state()`` describes (the block layout is the same on every CPU)."""
        parts = [
            BlockWeight(
                state[f"part{i}.codes"],
                state[f"part{i}.dm"],
                int(state[f"part{i}.out_features"][0]),
                int(state[f"part{i}.bits"][0]),
            )
            for i in range(int(state["parts"][0]))
        ]
        return cls(parts, state.get("bias"))

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


# -- choosing a format per CPU -----------------------------------------------------------------------
TRIM_EVERY = 64 << 20  # bytes of weights moved into huge pages between two hand-backs of freed memory


def to_huge_pages(formats) -> None:
    """Moves the codes and scales of every ``BlockWeight`` among ``formats`` (a ``StackWeight``'s parts
    included; a weight met twice, a tied LM head, once) into one ``cpu.HugePageArena``, in place."""
    from .cpu import HugePageArena, release_freed_memory

    blocks: dict[int, BlockWeight] = {}
    for fmt in formats:
        for b in fmt.parts if isinstance(fmt, StackWeight) else [fmt]:
            if isinstance(b, BlockWeight):
                blocks.setdefault(id(b), b)
    arena = HugePageArena(sum(HugePageArena.size(t) for b in blocks.values() for t in (b.codes, b.dm)))
    moved = 0
    for b in blocks.values():  # one weight at a time: its old tensors are freed as it moves
        moved += b.codes.nbytes + b.dm.nbytes
        b.codes, b.dm = arena.place(b.codes), arena.place(b.dm)
        if moved >= TRIM_EVERY:  # glibc keeps freed heap pages resident: the load would peak at twice the weights
            release_freed_memory()
            moved = 0


TIMING = "rounds"  # how an entry of kernels.json was timed (``_best_of_rounds``); others are timed again


def _best_of_rounds(configs: dict, rounds: int = 7) -> dict:
    """``{key: seconds}``: the least time of each ``configs[key]`` (a list of calls run back to back) over
    ``rounds`` rounds that run every configuration once, in turn, after one round of warm-up.  Spreading
    each configuration's tries over the whole measurement keeps a burst of other work on a shared
    machine (which can make a two-thread product 40x slower while it lasts) from deciding a choice."""
    import time

    best = {key: float("inf") for key in configs}
    for r in range(rounds + 1):
        for key, fns in configs.items():
            t = time.perf_counter()
            for f in fns:
                f()
            if r:
                best[key] = min(best[key], time.perf_counter() - t)
    return best


def _decoder_stack(dtype: torch.dtype, mb: float, g: torch.Generator) -> list[torch.Tensor]:
    """Decoder-sized weights (3072x576, ``mb`` MB in all: more than a CPU's caches)."""
    n_mats = max(1, int(mb * 1e6 / (3072 * 576 * dtype.itemsize)))
    return [(torch.randn(3072, 576, generator=g) * 0.02).to(dtype) for _ in range(n_mats)]


def measure_onednn(dtype: torch.dtype, rows=(1, 8), mb: float = 96.0) -> dict:
    """Seconds for a stack of decoder-sized products (576x3072-like, ``mb`` MB of weights, more than
    a CPU's caches) with dense ``F.linear`` and with oneDNN's packed weights, at each row count."""
    g = torch.Generator().manual_seed(0)
    dense = _decoder_stack(dtype, mb, g)
    packed = [OneDNNWeight(w, pad_to=()) for w in dense]
    xs = {m: torch.randn(m, 576, generator=g).to(dtype) for m in rows}
    configs = {}
    for m, x in xs.items():
        configs[m, "dense"] = [lambda w=w, x=x: F.linear(x, w) for w in dense]
        configs[m, "onednn"] = [lambda p=p, x=x: p(x) for p in packed]
    with torch.inference_mode():
        best = _best_of_rounds(configs)
    return {m: {kind: best[m, kind] for kind in ("dense", "onednn")} for m in rows}


def measure_onednn_rows(dtype: torch.dtype, rows=range(1, ONEDNN_PAD_MAX + 1), mb: float = 96.0, rounds: int = 7):
    """``{m: seconds}``: the best of ``rounds`` for the stack of ``measure_onednn`` with oneDNN's packed
    weights over ``m`` rows, the row counts round-robin in each round (a disturbance hits all alike)."""
    import time

    g = torch.Generator().manual_seed(0)
    packed = [OneDNNWeight(w, pad_to=()) for w in _decoder_stack(dtype, mb, g)]
    xs = {m: torch.randn(m, 576, generator=g).to(dtype) for m in rows}
    best = {m: float("inf") for m in rows}
    with torch.inference_mode():
        for r in range(rounds + 1):  # the first round warms up
            for m, x in xs.items():
                t = time.perf_counter()
                for p in packed:
                    p(x)
                if r:
                    best[m] = min(best[m], time.perf_counter() - t)
    return best


def padded_rows(seconds: dict[int, float], margin: float = 0.05) -> tuple[int, ...]:
    """``rows[m]`` for ``m`` below the largest measured count: the count ``n >= m`` of least ``seconds``
    where it beats ``m``'s own time by more than ``margin`` (a small difference may be noise), else ``m``;
    ``rows[0] = 0``."""
    counts = sorted(seconds)
    out = [0]
    for m in range(1, counts[-1] + 1):
        if m not in seconds:
            out.append(m)
            continue
        n = min((c for c in counts if c >= m), key=lambda c: (seconds[c], c))
        out.append(n if seconds[n] < (1 - margin) * seconds[m] else m)
    return tuple(out)


KERNEL_ENV = "LAYERLEAP_KERNELS"  # "onednn" or "dense": skip the measurement


def _forced(env: str, choices: tuple[str, ...]) -> str:
    """``$env``'s kernel (one of ``choices``), or "" where it is unset or empty; any other value is
    refused (a misspelt name would otherwise leave the measurement to choose, unnoticed)."""
    value = os.environ.get(env, "").strip().lower()
    if value and value not in choices:
        raise KernelError(f"{env} must be {' or '.join(choices)} (or unset: measured), got {value!r}")
    return value


def _onednn_key(dtype: torch.dtype) -> str:
    return (
        f"{cpu_signature()} | torch {torch.__version__} | {str(dtype).removeprefix('torch.')} | "
        f"{torch.get_num_threads()} threads"
    )


def _known() -> dict:
    """``<cache>/kernels.json``: the choices measured so far ({} when there is none or it is unreadable)."""
    try:
        known = json.loads((cache_root() / "kernels.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # RecursionError: brackets nested past the parser's depth
        known = {}
    return known if isinstance(known, dict) else {}


def _remembered(key: str, ok, measure) -> dict:
    """``<cache>/kernels.json``'s entry ``key`` where ``ok(entry)``, else that entry updated with
    ``measure()``'s fields and saved (an unwritable cache only costs the measurement next time)."""
    path = cache_root() / "kernels.json"
    known = _known()
    entry = known.get(key) if isinstance(known.get(key), dict) else {}
    if not ok(entry):
        entry = {**entry, **measure()}
        try:
            with locked(path):  # read again: entries other processes saved while this one measured are kept
                known = _known()
                old = known.get(key) if isinstance(known.get(key), dict) else {}
                known[key] = {**old, **entry}
                write_json(path, known)
        except LayerleapError:
            pass
    return entry


def _measure_format(dtype: torch.dtype) -> dict:
    times = measure_onednn(dtype)
    total = {k: sum(t[k] for t in times.values()) for k in ("dense", "onednn")}
    return {"choice": min(total, key=total.get), "seconds": {str(m): t for m, t in times.items()}, "timing": TIMING}


def dense_format(dtype: torch.dtype, device: torch.device) -> str:
    """``"onednn"`` or ``"dense"``: how this CPU multiplies fp32/bf16 weights fastest.

    Measured once per CPU signature, torch version, dtype and thread count (``measure_onednn``, about
    a second) and remembered in ``<cache>/kernels.json``; ``$LAYERLEAP_KERNELS`` overrides."""
    if device.type != "cpu" or dtype not in ONEDNN_DTYPES or not ONEDNN:
        return "dense"
    forced = _forced(KERNEL_ENV, ("onednn", "dense"))
    if forced:
        return forced
    entry = _remembered(
        _onednn_key(dtype),
        lambda e: e.get("choice") in ("onednn", "dense") and e.get("timing") == TIMING,
        lambda: _measure_format(dtype),
    )
    return entry["choice"]


DRAFT_HEAD_MEASURED = 1 << 20  # weights of fewer elements are multiplied in one product, unmeasured


def draft_head_rows(weight: torch.Tensor) -> int:
    """The most rows to multiply by a drafter's unembedding rows ``weight`` ``[K, D]`` one at a time on
    a column-major weight before oneDNN's packed product over all of them is faster (0: always oneDNN).
    Drafts only propose (verification scores the full vocabulary in the model's own format), so any
    rounding will do; on the Zen 4 EPYC the packed product over 12,288 x 576 fp32 rows took 7.5-8 ms
    for one or two rows, ``F.linear`` on the column-major weight 1.1 ms for one row and 15 ms for two.
    Measured once per CPU signature, torch version, dtype, thread count and shape, and remembered in
    ``<cache>/kernels.json``; ``$LAYERLEAP_KERNELS`` forces one (dense: always row by row)."""
    if weight.device.type != "cpu":
        return 0  # an accelerator: one product over every row
    if weight.dtype not in ONEDNN_DTYPES or not ONEDNN:
        return 1 << 30
    forced = _forced(KERNEL_ENV, ("onednn", "dense"))
    if forced:
        return 0 if forced == "onednn" else 1 << 30
    K, D = weight.shape
    if K * D < DRAFT_HEAD_MEASURED:
        return 0  # small enough to stay in cache: one product, nothing to measure
    entry = _draft_head_entry(weight)
    return int(entry["onednn_s"] // entry["row_s"])


def draft_head_q8(weight: torch.Tensor) -> bool:
    """Whether a drafter's unembedding rows ``weight`` ``[K, D]`` are multiplied fastest as 8-bit blocks
    (``quantize_q8`` -> ``BlockWeight``, the native kernel: a quarter of fp32's bytes) rather than as
    ``draft_head_rows`` says.  Drafts only propose, so the 8-bit rounding changes no output of an exact
    method; on the Zen 5 EPYC (1 thread) one row over 12,288 x 576 rows took 0.09 ms as 8-bit blocks,
    0.19 ms in bf16 (oneDNN) and 0.65 ms in fp32.  Measured with ``draft_head_rows`` (same entry of
    ``<cache>/kernels.json``); never for small weights, on an accelerator, without the native kernel,
    or when ``$LAYERLEAP_KERNELS`` forces a dense kernel."""
    if not ONEDNN or not _q8_measurable([weight]):
        return False
    entry = _draft_head_entry(weight)
    return entry["q8_s"] < min(entry["row_s"], entry["onednn_s"])


def q8_products_faster(weights: list[torch.Tensor]) -> bool:
    """Whether one row through the dense products ``weights`` (``[N, K]`` each, frozen: a drafter's own
    layers) runs faster with each held as 8-bit blocks (``quantize_q8`` -> ``BlockWeight``) than with
    ``F.linear``: drafts only propose, so the rounding changes no exact method's output.  Measured once
    per CPU signature, torch version, dtype, thread count and shapes (``_best_of_rounds``), remembered
    in ``<cache>/kernels.json``; False for fewer than ``DRAFT_HEAD_MEASURED`` elements in all, on an
    accelerator, without the native kernel, for inputs not a multiple of ``GROUP`` or when
    ``$LAYERLEAP_KERNELS`` forces a dense kernel."""
    if not _q8_measurable(weights):
        return False
    shapes = ", ".join(f"{w.shape[0]}x{w.shape[1]}" for w in weights)

    def measure() -> dict:
        g = torch.Generator().manual_seed(0)  # not the caller's global generator
        xs = [torch.randn(1, w.shape[1], generator=g).to(w.dtype) for w in weights]
        blocks = [BlockWeight.from_int8(quantize_q8(w.detach())) for w in weights]
        configs = {
            "dense_s": [lambda w=w, x=x: F.linear(x, w) for w, x in zip(weights, xs)],
            "q8_s": [lambda b=b, x=x: b.matmul(x) for b, x in zip(blocks, xs)],
        }
        with torch.inference_mode():
            return {**_best_of_rounds(configs), "timing": TIMING}

    entry = _remembered(
        f"{_onednn_key(weights[0].dtype)} | q8 products {shapes}",
        lambda e: all(isinstance(e.get(k), float) for k in ("dense_s", "q8_s")) and e.get("timing") == TIMING,
        measure,
    )
    return entry["q8_s"] < entry["dense_s"]


def _q8_measurable(weights: list[torch.Tensor]) -> bool:
    """Whether 8-bit block copies of ``weights`` are worth timing against their dense products: CPU
    weights of ``DRAFT_HEAD_MEASURED`` elements or more in all, inputs a multiple of ``GROUP``, the
    native kernel built, and no dense kernel forced by ``$LAYERLEAP_KERNELS``."""
    return (
        bool(weights)
        and sum(w.numel() for w in weights) >= DRAFT_HEAD_MEASURED
        and all(w.device.type == "cpu" and w.dim() == 2 and w.shape[1] % GROUP == 0 for w in weights)
        and weights[0].dtype in ONEDNN_DTYPES
        and blocks_available()
        and not _forced(KERNEL_ENV, ("onednn", "dense"))
    )


def _draft_head_entry(weight: torch.Tensor) -> dict:
    K, D = weight.shape
    q8 = blocks_available() and D % GROUP == 0

    def ok(e: dict) -> bool:
        keys = ("row_s", "onednn_s", "q8_s") if q8 else ("row_s", "onednn_s")
        return all(_seconds(e.get(k)) for k in keys) and e.get("timing") == TIMING

    return _remembered(f"{_onednn_key(weight.dtype)} | draft head {K}x{D}", ok, lambda: _measure_draft_head(weight, q8))


def _measure_draft_head(weight: torch.Tensor, q8: bool) -> dict:
    """Seconds for one row by ``weight`` column-major (``F.linear``), by oneDNN's packed layout and
    (``q8``) as 8-bit blocks."""
    packed = OneDNNWeight(weight, pad_to=())
    cm = weight.t().contiguous().t()
    x = torch.randn(1, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
    configs = {"row_s": [lambda: F.linear(x, cm)] * 4, "onednn_s": [lambda: packed(x)] * 4}
    if q8:
        blocks = BlockWeight.from_int8(quantize_q8(weight))
        configs["q8_s"] = [lambda: blocks.matmul(x)] * 4
    with torch.inference_mode():
        return {**{key: seconds / 4 for key, seconds in _best_of_rounds(configs).items()}, "timing": TIMING}


def _seconds(t) -> bool:
    """Whether ``t`` (read from kernels.json) is a time: a finite positive float."""
    return isinstance(t, float) and math.isfinite(t) and t > 0


def _valid_rows(rows) -> bool:
    return (
        isinstance(rows, list)
        and len(rows) == ONEDNN_PAD_MAX + 1
        and all(type(n) is int and m <= n <= ONEDNN_PAD_MAX for m, n in enumerate(rows))
    )


def onednn_rows(dtype: torch.dtype) -> tuple[int, ...]:
    """``rows[m]``: the row count this CPU multiplies ``m`` rows at with ``OneDNNWeight`` (``m`` up to
    ``ONEDNN_PAD_MAX``; ``padded_rows`` of ``measure_onednn_rows``): oneDNN's kernel runs differently
    by row count, and on the Zen 4 EPYC one or two fp32 rows cost 1.2-1.4x four to six rows.

    Padding changes no row's result where a row's result is the same at both counts (on the Zen 4
    EPYC it is from 2 to 16 rows in fp32 and bf16, and a one-row fp32 product over 1536 inputs rounds
    differently from them: padded, a one-token call's products equal a verification call's rows).
    A single row never runs alone, even where that would be faster: it runs at the count two rows
    run at, so that a one-token call's products round as a verification call's rows do on any CPU
    (the lossless methods' token-for-token promise).

    Measured once per CPU signature, torch version, dtype and thread count (under a second) and
    remembered in ``<cache>/kernels.json`` beside ``dense_format``'s choice."""
    entry = _remembered(
        _onednn_key(dtype),
        lambda e: _valid_rows(e.get("rows")),
        lambda: {
            "rows": list(padded_rows(s := measure_onednn_rows(dtype))),
            "row_seconds": {str(m): t for m, t in s.items()},
        },
    )
    rows = list(entry["rows"])
    if len(rows) > 2 and rows[1] == 1:
        rows[1] = rows[2]
    return tuple(rows)


Q4_ENV = "LAYERLEAP_Q4_KERNEL"  # "blocks" or "torch": skip the measurement


def quantize_q8(weight: torch.Tensor) -> Int8Rows:
    """Symmetric 8-bit quantization of ``[N, K]`` in groups of ``GROUP`` (GGUF's Q8_0: ``d = amax / 127``
    rounded to fp16, ``q = round(w / d)``), for an LM head or embedding that arrives dense."""
    N, K = weight.shape
    if K % GROUP:
        raise KernelError(f"8-bit rows need an input size that is a multiple of {GROUP}, got {K}")
    w = weight.detach().float().view(N, K // GROUP, GROUP)
    d = (w.abs().amax(-1) / 127).half().float()
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = (w / safe.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8).view(N, K)
    return Int8Rows(q, d)


def measure_q4(rows=(1, 4, 8, 16), mb: float = 48.0) -> dict:
    """Seconds for a stack of decoder-sized 4-bit products (``mb`` MB of codes, 1536x576) with torch's
    int4 kernel and with the native block kernel, at each row count."""
    g = torch.Generator().manual_seed(0)
    n_mats = max(1, int(mb * 1e6 / (1536 * 576 // 2)))
    mats = [
        QuantizedRows(
            torch.randint(0, 16, (1536, 576), generator=g, dtype=torch.uint8),
            torch.rand(1536, 18, generator=g).half().float() * 0.01,
            -torch.rand(1536, 18, generator=g).half().float() * 0.1,
        )
        for _ in range(n_mats)
    ]
    blocks = [BlockWeight.from_rows(r) for r in mats]
    torch_int4 = [Int4Weight(r) for r in mats]
    configs = {}
    for m in rows:
        x = torch.randn(m, 576, generator=g).to(torch.bfloat16)
        configs[m, "torch"] = [lambda w=w, x=x: w(x) for w in torch_int4]
        configs[m, "blocks"] = [lambda w=w, x=x: w(x) for w in blocks]
    with torch.inference_mode():
        best = _best_of_rounds(configs, rounds=5)
    return {m: {kind: best[m, kind] for kind in ("torch", "blocks")} for m in rows}


def _q4_winner(times: dict) -> str:
    """The kernel faster at more of the row counts (the total time on a tie): one size that another
    process on a shared machine slowed does not decide alone."""
    wins = sum(t["blocks"] < t["torch"] for t in times.values())
    if 2 * wins != len(times):
        return "blocks" if 2 * wins > len(times) else "torch"
    total = {k: sum(t[k] for t in times.values()) for k in ("torch", "blocks")}
    return min(total, key=total.get)


def q4_format() -> str:
    """``"blocks"`` (the native kernel, ``BlockWeight``) or ``"torch"`` (``Int4Weight``): how this CPU
    multiplies 4-bit weights fastest over 1 to 16 rows.

    Only one kernel there: that one.  Both: measured once per CPU signature, torch version, native
    build, thread count and activation bits (``measure_q4``, a few seconds; the kernel faster at more
    of 1, 4, 8 and 16 rows wins, the sum over them on a tie)
    and remembered in ``<cache>/kernels.json``; ``$LAYERLEAP_Q4_KERNEL`` overrides.  The block kernel
    forced or remembered needs no check of torch's kernel (its trial product maps about 7 MB of
    torch's code that a load with the block kernel never runs)."""
    forced = _forced(Q4_ENV, ("blocks", "torch"))
    have_blocks = blocks_available()
    if have_blocks and (forced == "blocks" or not forced and _q4_ok(_known().get(_q4_key())) == "blocks"):
        return "blocks"
    have_torch = int4_supported()
    if not (have_blocks and have_torch):
        return "blocks" if have_blocks else "torch"
    if forced in ("blocks", "torch"):
        return forced
    entry = _remembered(_q4_key(), _q4_ok, _measure_q4_format)
    return entry["choice"]


def _q4_ok(entry) -> str | None:
    """A remembered ``q4_format`` entry's choice where it is one, timed as ``TIMING`` says, else None."""
    if isinstance(entry, dict) and entry.get("choice") in ("blocks", "torch") and entry.get("timing") == TIMING:
        return entry["choice"]
    return None


def _q4_key() -> str:
    """``q4_format``'s entry in ``<cache>/kernels.json``: CPU, torch, native build, threads, activation bits."""
    from . import native

    return (
        f"{cpu_signature()} | torch {torch.__version__} | q4 | native {native.build_dir().name[:12]} | "
        f"{torch.get_num_threads()} threads" + ("" if fine_activations() else " | 8-bit activations")
    )


def _measure_q4_format() -> dict:
    times = measure_q4()
    return {"choice": _q4_winner(times), "seconds": {str(m): t for m, t in times.items()}, "timing": TIMING}


def q4_weight(rows: QuantizedRows, bias: torch.Tensor | None = None) -> "BlockWeight | Int4Weight":
    """``rows`` in this CPU's 4-bit format (``q4_format``)."""
    return BlockWeight.from_rows(rows, bias) if q4_format() == "blocks" else Int4Weight(rows, bias)
