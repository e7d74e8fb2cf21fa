"""A layer-addressable Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU).

Every stage is callable on its own, and the hidden state between layers is a plain tensor::

    h = model.embed(ids)                                   # [B, S] -> [B, S, D]
    h = model.run_layers(h, 0, 12, positions, cache)      # layers [0, 12)
    h = model.run_layers(h, 12, model.config.n_layers, positions, cache)
    logits = model.unembed(model.final_norm(h))           # [B, S, V]

Positions (for the rotary embedding), the attention mask over the new tokens and the KV cache are
passed explicitly; the model keeps no decoding state of its own.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels, native
from ..errors import LayerleapError
from .config import ModelConfig
from .kv_cache import CacheError, KVCache


class PositionError(LayerleapError, IndexError):
    """A rotary position past the model's context length."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def __setattr__(self, name: str, value) -> None:
        if name == "weight":
            native.formats_changed()  # the native layers' argument lists hold the weight (``native.layer_args``)
        super().__setattr__(name, value)

    def _apply(self, fn, recurse=True):
        native.formats_changed()  # a moved or cast weight may be a new tensor
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # as Hugging Face's LlamaRMSNorm: normalise in fp32, cast back, then scale.  In fp32 the fused
        # F.rms_norm is bitwise equal to weight * (x * rsqrt(mean(x^2) + eps)) and one kernel.
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, x.shape[-1:], self.weight, eps=self.eps)
        if x.dtype == torch.bfloat16 and x.numel() <= NATIVE_NORM_ROWS * x.shape[-1] and _native_cpu(x):
            # a few bf16 rows (drafters' states): the same bits in one native call, not four ATen ones
            return native.module().rms_norm(x.contiguous(), self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)


NATIVE_NORM_ROWS = 64  # decoder.cpp's rms_norm: its own bf16 loop up to this many rows (else ATen's, the same bits)


def _native_cpu(x: torch.Tensor) -> bool:
    """Whether the native module is built with ``rms_norm`` and can take ``x``: on a CPU, outside autograd."""
    if x.device.type != "cpu" or torch.is_grad_enabled():
        return False
    mod = native.module()
    return mod is not None and hasattr(mod, "rms_norm")


ROPE_ROWS = 1024  # positions a model's rope tables cover at first; they double as longer calls need them


def rope_rows(config: ModelConfig, need: int = ROPE_ROWS) -> int:
    """Rows of rope tables that cover positions ``[0, need)``: a power of two, at most ``max_position``."""
    return min(config.max_position, 1 << max(need - 1, 1).bit_length())


def rope_tables(config: ModelConfig, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin ``[rows, head_dim]`` in fp32 (the Hugging Face 'default' rope) for
    positions ``[0, rows)``, by default ``rope_rows(config)``; a row's values do not depend on ``rows``.

    ``rotate_half(x) * sin == roll(x, hd/2) * sin_signed`` exactly, with the first half of
    ``sin_signed`` negated, so applying the rotation takes one roll instead of split + cat + neg."""
    dim = config.head_dim
    cpu = torch.device("cpu")  # on the CPU also inside a meta-device context (see ``skip_meta_init``)
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=cpu).float() / dim))
    t = torch.arange(rope_rows(config) if rows is None else rows, dtype=torch.int64, device=cpu).float()
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = emb.sin()
    sin[:, : dim // 2] = -sin[:, : dim // 2]
    return emb.cos(), sin


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX tiles, e.g. Sapphire Rapids)."""
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except (AttributeError, RuntimeError):  # a torch without these probes: assume not
        return False


def fp32_detour(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether bf16/fp16 matrix products and attention should run in fp32 here: on a CPU without native
    bf16 (AVX2 EPYC: bf16 matrix kernels ~7x, attention 4-6x slower than fp32).  A CPU with
    AVX512-BF16/AMX keeps bf16 (there the detour is ~8x slower: docs/BENCHMARKS.md)."""
    return device.type == "cpu" and dtype != torch.float32 and not (dtype == torch.bfloat16 and cpu_has_native_bf16())


def linear(lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``lin(x)`` with a dense weight: ``F.linear``, except that a product over many rows of bf16/fp16
    runs in fp32 where ``fp32_detour`` says so (700 rows x 576 -> 3072 on the AVX2 EPYC: 128 ms in
    bf16 against 18 ms with the weight converted on the fly)."""
    if x.numel() // x.shape[-1] >= 16 and fp32_detour(x.dtype, x.device):
        b = lin.bias.float() if lin.bias is not None else None
        return F.linear(x.float(), lin.weight.float(), b).to(x.dtype)
    return F.linear(x, lin.weight, lin.bias)


def _moves(fn, dtype: torch.dtype) -> bool:
    """Whether ``Module._apply``'s ``fn`` would move a CPU tensor of ``dtype`` or change its dtype."""
    probe = torch.zeros(1, dtype=dtype)
    out = fn(probe)
    return out.device != probe.device or out.dtype != probe.dtype


# skip_meta_init: a weight on the meta device is a placeholder that a loader assigns, so ``Linear`` and
# ``Embedding`` draw no random values for it.  Drawing them on meta tensors would go through torch's
# reference decompositions, which import its compiler stack (torch._dynamo, sympy: 70 MB, 1 s).


class Linear(nn.Linear):
    """``nn.Linear`` whose weight may be packed for a CPU kernel (``kernels``: oneDNN's layout or
    4-bit groups).  While packed, ``weight`` and ``bias`` are None (the packed weight holds both),
    ``dense_weight()`` gives the weight back and ``unpack()`` restores a dense parameter.  Moving
    or casting the module (``.to``, ``.float()``) unpacks it first."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:  # see ``skip_meta_init``
            super().reset_parameters()

    packed: kernels.PackedWeight | None = None

    def __setattr__(self, name: str, value) -> None:
        if name in ("packed", "weight", "bias"):
            native.formats_changed()  # the native layers' argument lists look again (``native.layer_args``)
        super().__setattr__(name, value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self, x) if self.packed is None else self.packed(x)

    def pack(self, fmt: kernels.PackedWeight) -> None:
        self.packed = fmt
        self.weight = None
        self.bias = None

    def unpack(self) -> None:
        if self.packed is None:
            return
        fmt, self.packed = self.packed, None
        self.weight = nn.Parameter(fmt.dense(), requires_grad=False)
        self.bias = None if fmt.bias is None else nn.Parameter(fmt.bias.to(self.weight.dtype), requires_grad=False)

    def dense_weight(self) -> torch.Tensor:
        return self.weight if self.packed is None else self.packed.dense()

    def dense_bias(self) -> torch.Tensor | None:
        return self.bias if self.packed is None else self.packed.bias

    @property
    def format(self) -> str:
        return "dense" if self.packed is None else type(self.packed).__name__.removesuffix("Weight").lower()

    def _apply(self, fn, recurse=True):
        if self.packed is not None and _moves(fn, self.packed.dtype):
            self.unpack()
        native.formats_changed()  # a moved or cast parameter may be a new tensor
        return super()._apply(fn, recurse)


ROW_CACHE = 4096  # dequantized rows a packed embedding keeps (bf16: 4.7 MB on SmolLM2-135M)
ROW_CACHE_IDS = 8  # lookups of up to this many ids go through it (decoding steps, not prompts)


class Embedding(nn.Embedding):
    """``nn.Embedding`` whose table may be packed (4-bit groups, possibly shared with a tied LM head,
    or 8-bit rows): rows are dequantized as they are looked up.  A decoding step's few ids are served
    from the rows dequantized before (up to ``ROW_CACHE``, then it starts over): dequantizing a row
    element by element gives the same values alone as in any batch, and a lookup of one row costs one
    copy, not the twenty small tensor operations of unpacking it (90 us a step on the q4 default
    on a Zen 5 EPYC, where the model's weights have just swept the caches)."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:  # see ``skip_meta_init``
            super().reset_parameters()

    packed: kernels.Int4Weight | kernels.Int8Rows | kernels.BlockWeight | None = None
    _rows: tuple = (None, {})  # (the packed table, its rows by id)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return super().forward(ids)
        if not 0 < ids.numel() <= ROW_CACHE_IDS or ids.device.type != "cpu" or torch.is_grad_enabled():
            return self.packed.rows(ids)
        table, rows = self._rows
        if table is not self.packed or len(rows) > ROW_CACHE:
            rows = {}
            self.__dict__["_rows"] = (self.packed, rows)  # not a submodule, parameter or buffer
        flat = ids.reshape(-1).tolist()
        for t in flat:
            if t not in rows:
                rows[t] = self.packed.rows(torch.tensor([t], dtype=torch.long))[0]
        return torch.stack([rows[t] for t in flat]).view(*ids.shape, -1)

    def pack(self, fmt) -> None:
        self.packed = fmt
        self.weight = None

    def dense_weight(self) -> torch.Tensor:
        return self.weight if self.packed is None else self.packed.dense()

    def _apply(self, fn, recurse=True):
        if self.packed is not None and _moves(fn, self.packed.dtype):
            self.packed, self.weight = None, nn.Parameter(self.packed.dense(), requires_grad=False)
        return super()._apply(fn, recurse)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed


class Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = c.n_heads, c.n_kv_heads, c.head_dim
        self.qkv = Linear(c.hidden_size, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim, bias=c.qkv_bias)
        self.o = Linear(c.n_heads * c.head_dim, c.hidden_size, bias=False)

    def project(self, x, cos, sin):
        """``[B, S, D]`` -> rotated q ``[B, H, S, hd]``, rotated k and v ``[B, Hkv, S, hd]``.
        ``cos``/``sin`` are ``[B, S, 1, hd]``."""
        B, S, _ = x.shape
        H, Hkv = self.n_heads, self.n_kv
        heads = self.qkv(x).view(B, S, H + 2 * Hkv, self.hd)
        qk = apply_rope(heads[:, :, : H + Hkv], cos, sin)
        return qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2), heads[:, :, H + Hkv :].transpose(1, 2)

    def forward(self, x, cos, sin, layer: int, cache: KVCache | None, keys: Keys | None) -> torch.Tensor:
        B, S, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        if cache is not None:
            k, v = keys.store(cache, layer, k, v)  # [B, Hkv, total, hd]
            if q.dtype != k.dtype:
                q = q.to(k.dtype)  # attention runs in the cache's dtype (fp32 on CPU, see new_cache)
        y = attend(q, k, v, keys).transpose(1, 2).reshape(B, S, self.n_heads * self.hd)  # [B, S, H*hd]
        return self.o(y if y.dtype == x.dtype else y.to(x.dtype))


@dataclass
class Keys:
    """What ``S`` new tokens attend to in one layer (the same for every layer whose lengths agree).

    ``starts``: each row's first new cache slot (None without a cache); ``total``: keys ``[0, total)``
    are read; ``mask`` ``[B, 1, S, total]`` bool (True = may attend), or None: every key for one new
    token, causal for a first chunk; ``folded``: the mask repeated for grouped query heads folded
    into the query axis (``[B, 1, g*S, total]``), made once per call.  When every row starts at the
    same slot, ``store`` writes through views of the whole cache made once per call."""

    starts: list[int] | None
    total: int
    mask: torch.Tensor | None
    groups: int = 1
    chain: bool = False  # the new tokens see every earlier slot and each other causally (no padding, no tree)
    folded: torch.Tensor | None = None
    views: tuple[torch.Tensor, torch.Tensor] | None = None  # cache.k/v[:, :, :, :total] when rows agree

    def __post_init__(self):
        if self.mask is not None and self.groups > 1:
            self.folded = self.mask.repeat(1, 1, self.groups, 1)

    @property
    def uniform(self) -> bool:
        """Every row starts at the same slot."""
        return self.starts is not None and all(s == self.starts[0] for s in self.starts)

    def store(self, cache: KVCache, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write new ``k``/``v`` ``[B, Hkv, S, hd]`` into ``layer`` -> its keys/values ``[B, Hkv, total, hd]``."""
        start = self.starts[0]
        if all(s == start for s in self.starts):
            if self.views is None:
                self.views = cache.k[:, :, :, : self.total], cache.v[:, :, :, : self.total]
            kl, vl = self.views[0][layer], self.views[1][layer]
            kl.narrow(2, start, k.shape[2]).copy_(k)
            vl.narrow(2, start, v.shape[2]).copy_(v)
            return kl, vl
        cache.write(layer, k, v, self.starts)
        return cache.k[layer, :, :, : self.total], cache.v[layer, :, :, : self.total]


def _native_ok(h: torch.Tensor, lengths: list[list[int]]) -> bool:
    """Whether ``native``'s C++ layers can take this call: built, on CPU, outside autograd, and every
    row of every layer in the range at the same length (the common case of decoding)."""
    if h.device.type != "cpu" or torch.is_grad_enabled() or native.module() is None:
        return False
    first = lengths[0]
    return all(n == first[0] for n in first) and all(row == first for row in lengths)


ROW_BY_ROW_MAX = 16  # multi-token calls up to this size attend one new token at a time (see ``attend``)


# the most new tokens of a bf16/fp16 call appended to the cache that attend row by row: every chain the
# options allow (draft_len <= 256, plus the last kept token) and trees of as many nodes.  Past 128 rows
# ``attend_rows`` costs more than ``F.scaled_dot_product_attention`` (x1.4 at 256, x1.9 at 512 new tokens
# over 1024 keys on a Zen 4 core), so a server's 512-token prefill chunks keep the latter
APPENDED_ROWS_MAX = 257


def rows_attend_max(dtype: torch.dtype, appended: bool) -> int:
    """The most new tokens a call attends row by row with the native ``attend_rows`` (``attend``):
    ``APPENDED_ROWS_MAX`` in bf16/fp16 (q4 included) for a call appended to a cache that holds tokens (a
    verification call: a tree past 16 nodes, or Hidden Transfer's pass over a tree's pseudo states, otherwise
    rounds apart from greedy decoding at a near-tie); ``ROW_BY_ROW_MAX`` in fp32 and for a prompt pass."""
    return APPENDED_ROWS_MAX if appended and dtype != torch.float32 else ROW_BY_ROW_MAX


def _appended(starts) -> bool:
    """Whether a call's new tokens follow tokens already in the cache (a verification call, not a prompt pass)."""
    return starts is not None and max(starts) > 0


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: Keys | None) -> torch.Tensor:
    """Scaled dot-product attention of ``q`` ``[B, H, S, hd]`` over ``k``/``v`` ``[B, Hkv, T, hd]``.

    With grouped-query attention the ``g = H / Hkv`` query heads that share a key head are folded
    into the query axis (``[B, Hkv, g*S, hd]``), which computes the same dot products in one plain
    attention call: on CPU that is up to 5x faster than ``enable_gqa`` for a few new tokens.  A
    first chunk without a mask (plain causal) keeps ``is_causal``, which folding would break.

    With the ``native`` layers built, calls on a CPU over up to ``rows_attend_max`` new tokens use its
    ``attend_rows``: each query row visits, in order, exactly the keys its mask allows (in fp32), so a
    row's result depends only on its query and the keys it sees, in every dtype and for chains and
    trees alike (on this CPU it is also 2-4x faster than ``F.scaled_dot_product_attention`` for a
    few tokens).  That is ``ROW_BY_ROW_MAX`` new tokens, and up to ``APPENDED_ROWS_MAX`` (257) in bf16/fp16
    (q4 included) for a call appended to a cache that already holds tokens (a verification call: a chain
    or a tree of drafts, Hidden Transfer's pseudo states), so in bf16 and q4, whose packed projections give
    a row the same result whatever the row count, a tree wider than ``ROW_BY_ROW_MAX`` still verifies each
    token with the logits a one-token call gives it (up to 128 new tokens it costs no more than
    ``F.scaled_dot_product_attention``; a prompt pass keeps the latter).  fp16 weights are not packed: its
    matrix products round a row differently at another row count, so there a verification call can part
    from greedy decoding at a near-tie.
    Without it, in bf16/fp16 a call over ``1 < S <= ROW_BY_ROW_MAX`` new tokens appended
    to a cache attends one new token at a time, each to exactly the keys it sees (``[0, start + i]``): the same
    attention call, on the same inputs, that decoding that token alone makes.  The kernel's results for a row
    depend on how many rows and keys a call has, and with bf16 logits (ties within one rounding step
    are common) that alone made a verified token differ from greedy decoding's; this way the rows of
    a verification call equal greedy decoding's bit for bit wherever the new tokens form a chain
    (the packed projections of fp32, bf16 and q4 already give a row the same result whatever the row count).  In fp32,
    where a tie within rounding is rare, one call serves all rows (row by row cost 8-15% more at
    4-8 new tokens)."""
    B, H, S, hd = q.shape
    g = H // k.shape[1]
    if keys is None:  # no cache: causal over these S tokens
        return F.scaled_dot_product_attention(q, k, v, is_causal=S > 1, enable_gqa=g > 1)
    if keys.mask is None and S > 1:  # causal over exactly these S keys (no cache, or an empty one)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=g > 1)
    rows_max = rows_attend_max(q.dtype, _appended(keys.starts))
    if S <= rows_max and q.device.type == "cpu" and native.module() is not None:
        return native.module().attend_rows(
            q, k if k.dtype == q.dtype else k.to(q.dtype), v if v.dtype == q.dtype else v.to(q.dtype), keys.mask
        )
    if 1 < S <= ROW_BY_ROW_MAX and keys.uniform and q.dtype != torch.float32:
        first = keys.total - S + 1  # keys the first new token sees
        rows = []
        for i in range(S):
            m = None if keys.chain else keys.mask[:, :, i : i + 1, : first + i]
            rows.append(_attend_folded(q[:, :, i : i + 1], k[:, :, : first + i], v[:, :, : first + i], m, g))
        return torch.cat(rows, dim=2)
    return _attend_folded(q, k, v, keys.mask, g, keys.folded)


def _attend_folded(q, k, v, mask, g: int, folded=None) -> torch.Tensor:
    B, H, S, hd = q.shape
    if g == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if mask is not None and folded is None:
        folded = mask.repeat(1, 1, g, 1)
    y = F.scaled_dot_product_attention(q.reshape(B, k.shape[1], g * S, hd), k, v, attn_mask=folded)
    return y.reshape(B, H, S, hd)  # a view on the CPU; CUDA's kernels may return other strides


class MLP(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.inter = c.intermediate_size
        self.gate_up = Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down = Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).split(self.inter, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.attn = Attention(c)
        self.mlp_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, h, cos, sin, layer, cache, keys: Keys | None):
        h = h + self.attn(self.attn_norm(h), cos, sin, layer, cache, keys)
        return h + self.mlp(self.mlp_norm(h))


class Transformer(nn.Module):
    """The decoder.  ``tokenizer`` and ``source`` are metadata attached by the loader."""

    def __init__(self, config: ModelConfig, tokenizer=None, source: str | None = None):
        super().__init__()
        self.config = config
        self.tokenizer = tokenizer
        self.source = source  # a Hugging Face folder with the same weights, when there is one
        c = config
        self.tok_embeddings = Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_embeddings:
            self.lm_head.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(c)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._fingerprint: str | None = None
        # end tokens beside config.eos_token_ids that the loader found (a folder's generation_config.json,
        # a GGUF file's end-of-turn tokens): where generation ends, not part of the fingerprint
        self.extra_eos_ids: tuple[int, ...] = ()
        # the sliding-window span that bounds config.max_position below the checkpoint's own context
        # (``config.sliding_window_bound``), for the error that names it
        self.sliding_window: int | None = None

    def eos_ids(self) -> tuple[int, ...]:
        """The token ids generation ends on, as `transformers`' ``generate`` and llama.cpp end: the config's
        ``eos_token_ids``, the tokenizer's end token and ``extra_eos_ids``, each once."""
        eos = tuple(self.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos += (int(self.tokenizer.eos_token_id),)
        return tuple(dict.fromkeys(eos + tuple(self.extra_eos_ids)))

    # -- the separately callable stages ----------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """``[B, S]`` token ids -> ``[B, S, D]`` hidden states."""
        return self.tok_embeddings(ids)

    def run_layers(
        self,
        h: torch.Tensor,
        start: int,
        end: int,
        positions: torch.Tensor,
        cache: KVCache | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Apply layers ``[start, end)`` to ``h`` ``[B, S, D]`` at ``positions`` ``[B, S]``.

        With a cache, the new keys/values are appended at each row's length in each layer and the
        lengths advance by S.  ``mask`` (``[S, S]`` or ``[B, S, S]`` bool, True = may attend) says
        which new tokens see which; None means causal.  Earlier cache slots are always visible
        (except left padding).
        """
        if not 0 <= start <= end <= self.config.n_layers:
            raise ValueError(f"layer range [{start}, {end}) is outside [0, {self.config.n_layers}]")
        if start == end:
            return h
        cos, sin = self._rope(positions, h.dtype, None if cache is None else cache.max_len)
        S = h.shape[1]
        groups = self.config.n_heads // self.config.n_kv_heads
        if cache is None:
            if mask is not None:  # a bool mask on h's device, as the cache's masks are (a float one would add)
                mask = mask.to(h.device, torch.bool)
            m = None if mask is None else (mask if mask.dim() == 3 else mask.unsqueeze(0)).unsqueeze(1)
            keys = Keys(None, S, m, groups)  # [B|1, 1, S, S]
            for layer in range(start, end):
                h = self.layers[layer](h, cos, sin, layer, None, keys)
            return h
        lengths = cache.lengths[start:end].tolist()  # [L', B] as ints: one read for the whole call
        if _native_ok(h, lengths):
            out = self._native_layers(h, start, end, cos, sin, cache, mask, lengths[0][0])
            if out is not None:
                cache.advance(start, end, S)
                return out
        chain = mask is None and not bool(cache.pad.any())
        keys = None
        for layer in range(start, end):
            if keys is None or lengths[layer - start] != lengths[layer - start - 1]:
                m, total = cache.attention_mask(layer, S, mask)  # one mask while lengths agree
                keys = Keys(lengths[layer - start], total, m, groups, chain)
            h = self.layers[layer](h, cos, sin, layer, cache, keys)
        cache.advance(start, end, S)
        return h

    def _native_layers(self, h, start: int, end: int, cos, sin, cache: KVCache, mask, s0: int):
        """Layers ``[start, end)`` by ``native``'s C++ (the same calls as the Python path: equal results),
        or None when a projection's format is not one it takes."""
        args = native.layer_args(self, start, end)
        if args is None:
            return None
        c = self.config
        m, total = cache.attention_mask(start, h.shape[1], mask)
        g = c.n_heads // c.n_kv_heads
        rows_max = rows_attend_max(h.dtype, s0 > 0)  # see ``attend``
        # the folded mask serves only calls over more new tokens than attend row by row
        folded = m.repeat(1, 1, g, 1) if m is not None and g > 1 and h.shape[1] > rows_max else None
        k, v = cache.k[start:end, :, :, :total], cache.v[start:end, :, :, :total]
        return native.module().run_layers(
            h,
            cos,
            sin,
            k,
            v,
            s0,
            m,
            folded,
            c.n_heads,
            c.n_kv_heads,
            c.head_dim,
            c.intermediate_size,
            c.rms_norm_eps,
            fp32_detour(h.dtype, h.device),
            rows_max,
            *args,
            native.after_layers(self, end),
        )

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype, bound: int | None = None):
        """cos, sign-folded sin ``[B, S, 1, hd]`` at ``positions`` ``[B, S]``, all below ``bound`` when it
        is given (a cache's slots: no scan of ``positions``); the tables grow to cover them."""
        rows, full = self.rope_cos.shape[0], self.config.max_position
        if rows < full:
            if positions.device.type != "cpu" or self.rope_cos.device.type != "cpu":
                need = full  # an index out of range cannot be caught on an accelerator: the whole table, once
            else:
                need = bound if bound is not None else int(positions.max()) + 1 if positions.numel() else 0
            if need > rows:
                self._grow_rope(need)
        cos_t, sin_t = self._rope_in(dtype)
        if positions.numel() == 1 and positions.device.type == "cpu":  # a decoding step: one row of each table
            i = int(positions)
            if 0 <= i < cos_t.shape[0]:
                shape = (*positions.shape, 1, cos_t.shape[1])  # [B, S, 1, hd]
                return cos_t[i : i + 1].view(shape), sin_t[i : i + 1].view(shape)
        try:
            cos, sin = cos_t[positions], sin_t[positions]
        except IndexError:  # a position at or past ``bound``: the whole table (past it, the context)
            if self.rope_cos.shape[0] < full:
                self._grow_rope(full)
                cos_t, sin_t = self._rope_in(dtype)
            try:
                cos, sin = cos_t[positions], sin_t[positions]
            except IndexError:
                raise PositionError(
                    f"positions {int(positions.min())}..{int(positions.max())} reach past the model's context "
                    f"length {full} (positions 0..{full - 1}): shorten the input"
                ) from None
        return cos.unsqueeze(2), sin.unsqueeze(2)

    def _rope_in(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The rope tables in ``dtype`` (each value converted as ``.to(dtype)`` converts it), kept while the
        tables stay: a step indexes them without converting its rows again."""
        cos, sin = self.rope_cos, self.rope_sin
        held = self.__dict__.get("_rope_in_dtypes")  # (the tables they come from, dtype -> (cos, sin))
        if held is None or held[0] is not cos or held[1] is not sin:
            held = (cos, sin, {})  # not a buffer: made again when the tables grow or move
            self.__dict__["_rope_in_dtypes"] = held
        if dtype not in held[2]:
            held[2][dtype] = (cos.to(dtype), sin.to(dtype))
        return held[2][dtype]

    def _grow_rope(self, need: int) -> None:
        """Rope tables for ``rope_rows(config, need)`` positions, in the tables' dtype and device."""
        cos, sin = rope_tables(self.config, rope_rows(self.config, need))
        old = self.rope_cos
        self.rope_cos, self.rope_sin = cos.to(old.device, old.dtype), sin.to(old.device, old.dtype)

    def fill_kv(self, h: torch.Tensor, start: int, end: int, positions: torch.Tensor, cache: KVCache) -> None:
        """Write keys/values of layers ``[start, end)`` computed from one hidden state ``h`` ``[B, S, D]``
        (as if every layer's input were ``h``), without running the layers; lengths advance by S.
        CALM-style early exit uses it to give skipped layers cache entries from the exit state."""
        if int(cache.lengths[start:end].max()) + h.shape[1] > cache.max_len:
            raise CacheError(f"KV cache overflow: {h.shape[1]} more slots do not fit in {cache.max_len}")
        cos, sin = self._rope(positions, h.dtype, cache.max_len)
        for layer in range(start, end):
            blk = self.layers[layer]
            _, k, v = blk.attn.project(blk.attn_norm(h), cos, sin)
            cache.write(layer, k, v, cache.lengths[layer].tolist())
        cache.advance(start, end, h.shape[1])

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h)

    def unembed(self, h: torch.Tensor) -> torch.Tensor:
        """``[B, S, D]`` normalised hidden states -> ``[B, S, V]`` logits (fp32)."""
        return self.lm_head(h).float()

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        out = self._native_logits(h)
        return self.unembed(self.final_norm(h)) if out is None else out

    NATIVE_LOGITS_ROWS = 64  # decoder.cpp's FUSED_ROWS: the most rows its bf16 products round themselves

    def _native_logits(self, h: torch.Tensor) -> torch.Tensor | None:
        """``unembed(final_norm(h))`` in one call of the native module (``decoder.cpp``'s ``final_logits``: the
        same kernels and roundings, so the same bits) for a few bf16 rows and a block LM head without bias on
        a CPU, without autograd; else None."""
        head = self.lm_head.packed
        if not isinstance(head, kernels.BlockWeight) or head.bias is not None or h.dtype != torch.bfloat16:
            return None
        rows = h.numel() // h.shape[-1]
        if rows > self.NATIVE_LOGITS_ROWS or h.device.type != "cpu" or torch.is_grad_enabled():
            return None
        mod = native.module()
        if mod is None or not hasattr(mod, "final_logits") or self.norm.weight.dtype != torch.bfloat16:
            return None
        out = mod.final_logits(
            h.reshape(rows, h.shape[-1]).contiguous(),  # -1 cannot stand for D when there are no rows
            self.norm.weight,
            self.norm.eps,
            head.codes,
            head.dm,
            head.out_features,
            head.fine,
        )
        return out.view(*h.shape[:-1], head.out_features)

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        mask: torch.Tensor | None = None,
        logits_from: int = 0,
    ) -> torch.Tensor:
        """All layers: ``[B, S]`` ids -> ``[B, S - logits_from, V]`` logits of the positions from
        ``logits_from`` on (a long prompt's pass needs the last one only: ``-1``).  Positions default to
        continuing the cache (``lengths - pad``), or ``0 .. S-1`` without one."""
        if positions is None:
            base = torch.zeros(1, 1, dtype=torch.long) if cache is None else (cache.lengths[0] - cache.pad).unsqueeze(1)
            positions = (base + torch.arange(ids.shape[1])).expand(ids.shape[0], -1).to(ids.device)
        h = self.run_layers(self.embed(ids), 0, self.config.n_layers, positions, cache, mask)
        return self.logits(h[:, logits_from:] if logits_from else h)

    # -- facts -----------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        """The dtype of activations (and of dense weights): the norms are always dense in it."""
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype_name(self) -> str:
        """``"float32"``, ``"bfloat16"``, ... or ``"q4"`` when the projections hold 4-bit weights."""
        if any(
            isinstance(lin.packed, kernels.Int4Weight) or getattr(lin.packed, "bits", 0) in (4, 6)
            for lin in self.projections()
        ):
            return "q4"
        return str(self.dtype).removeprefix("torch.")

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype | None = None) -> KVCache:
        """A cache for ``batch`` rows of ``max_len`` slots, in ``cache_dtype()`` unless ``dtype`` says."""
        return KVCache.for_model(self.config, batch, max_len, dtype or self.cache_dtype(), self.device)

    def cache_dtype(self) -> torch.dtype:
        """The activations' dtype, or fp32 where ``fp32_detour`` says so (the cache is small next to the
        weights; with AVX512-BF16/AMX an fp32 cache made attention 41% of a 700-token bf16 prefill)."""
        return torch.float32 if fp32_detour(self.dtype, self.device) else self.dtype

    def projections(self) -> list[Linear]:
        """Every matrix product of a step: each layer's qkv, o, gate_up and down, then the LM head."""
        per_layer = [m for blk in self.layers for m in (blk.attn.qkv, blk.attn.o, blk.mlp.gate_up, blk.mlp.down)]
        return per_layer + [self.lm_head]

    PROJECTIONS = ("qkv.weight", "o.weight", "gate_up.weight", "down.weight", "lm_head.weight")

    @staticmethod
    def column_major(dtype: torch.dtype, device_type: str) -> bool:
        """Whether dense fp32 projections multiply fastest column-major: on a CPU where
        ``kernels.dense_format`` keeps dense weights (``F.linear``'s one-row fp32 product was 1.4-1.8x
        faster on a column-major weight on the AVX2 EPYC)."""
        return (
            dtype == torch.float32
            and device_type == "cpu"
            and kernels.dense_format(dtype, torch.device(device_type)) == "dense"
        )

    def optimize_layout(self) -> "Transformer":
        """Hold each projection in the format that multiplies fastest here (``kernels.dense_format``):
        oneDNN's packed layout, or a dense weight (column-major for fp32, see ``column_major``).

        A tied LM head that is packed or column-major gets its own copy (the embedding lookup keeps
        the row-major table).  4-bit weights stay as they are.  Results are the same up to float
        rounding order."""
        # rope tables are computed in fp32 and cast once, as Hugging Face casts them per call
        self.rope_cos, self.rope_sin = self.rope_cos.to(self.dtype), self.rope_sin.to(self.dtype)
        fmt = kernels.dense_format(self.dtype, self.device)
        col = self.column_major(self.dtype, self.device.type)
        rows = kernels.onednn_rows(self.dtype) if fmt == "onednn" else None  # measured once, not per weight
        for lin in self.projections():
            if lin.packed is not None:
                continue
            w = lin.weight.detach()
            if fmt == "onednn":
                lin.pack(kernels.OneDNNWeight(w, lin.bias, pad_to=rows))
                continue
            w = w.t().contiguous().t() if col else w.contiguous()
            if lin is self.lm_head and self.config.tie_embeddings and not col and self.tok_embeddings.packed is None:
                w = self.tok_embeddings.weight
            if not isinstance(w, nn.Parameter):
                w = nn.Parameter(w, requires_grad=lin.weight.requires_grad)
            lin.weight = w
        return self

    def unpack(self) -> "Transformer":
        """Dense ``nn.Parameter`` weights everywhere (for training the model's own weights, or
        export); a tied LM head shares the embedding table again."""
        for lin in self.projections():
            lin.unpack()
        if self.tok_embeddings.packed is not None:
            self.tok_embeddings.weight = nn.Parameter(self.tok_embeddings.packed.dense(), requires_grad=False)
            self.tok_embeddings.packed = None
        if self.config.tie_embeddings:
            self.lm_head.weight = self.tok_embeddings.weight
        return self

    def head_weight(self) -> torch.Tensor:
        """The LM head as a dense ``[V, D]`` matrix (the embedding table when tied and dense)."""
        if self.config.tie_embeddings and self.tok_embeddings.packed is None:
            return self.tok_embeddings.weight
        return self.lm_head.dense_weight()

    def head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """``head_weight()[ids]`` for ids ``[n]``: of a packed block head only those rows are unpacked
        (not all ``V``), as a drafter's reduced vocabulary needs."""
        packed = self.lm_head.packed
        if isinstance(packed, kernels.BlockWeight):
            return packed.dense_rows(ids)
        return self.head_weight().detach()[ids]

    def dense_state(self) -> dict[str, torch.Tensor]:
        """Every weight under its ``state_dict`` name, dense (packed weights unpacked; a tied head
        appears under both names, as in ``state_dict``)."""
        out = {}
        for name, mod in self.named_modules():
            if isinstance(mod, (Linear, Embedding)):
                out[f"{name}.weight"] = mod.dense_weight()
                if isinstance(mod, Linear) and mod.dense_bias() is not None:
                    out[f"{name}.bias"] = mod.dense_bias()
            elif isinstance(mod, RMSNorm):
                out[f"{name}.weight"] = mod.weight
        return out

    def n_params(self) -> int:
        """Parameters of the model as defined (a tied LM head counts once, even when it holds a
        separate copy)."""
        n = sum(
            lin.in_features * lin.out_features + (0 if lin.dense_bias() is None else lin.dense_bias().numel())
            for lin in self.projections()
        )
        n += sum(mod.weight.numel() for mod in self.modules() if isinstance(mod, RMSNorm))
        if not self.config.tie_embeddings:
            n += self.config.vocab_size * self.config.hidden_size
        return n

    def weight_bytes(self) -> int:
        """Bytes of weights held in memory (packed formats and a separate tied-head copy included)."""
        seen, total = set(), 0
        for mod in self.modules():
            packed = getattr(mod, "packed", None) if isinstance(mod, (Linear, Embedding)) else None
            if packed is not None and id(packed) not in seen:
                seen.add(id(packed))
                total += packed.nbytes
        for p in self.parameters():
            total += p.numel() * p.element_size()
        return total

    def set_fingerprint(self, fingerprint: str) -> None:
        """Name the checkpoint when the dense weights are not at hand to hash (a loader that packs
        weights as it reads them computes ``fingerprint_of`` on the exact source values first)."""
        self._fingerprint = fingerprint

    @property
    def fingerprint(self) -> str:
        """A short hash of the config and a sample of every weight: heads trained for one model
        refuse to load into another.  The same for every dtype of one checkpoint."""
        if self._fingerprint is None:
            self._fingerprint = fingerprint_of(self.config, self.dense_state())
        return self._fingerprint


def fingerprint_of(config: ModelConfig, weights) -> str:
    """``Transformer.fingerprint`` from ``weights`` (a mapping, or ``(name, tensor)`` pairs yielded
    one at a time): the config and every 4096th-or-so value of each weight rounded to bf16."""
    facts = {k: v for k, v in config.to_dict().items() if k != "name"}
    hsh = hashlib.sha256(repr(sorted(facts.items())).encode())
    items = weights.items() if isinstance(weights, dict) else weights
    for name, p in sorted(items, key=lambda kv: kv[0]):
        flat = p.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 4096)].to(torch.bfloat16).float()  # same for fp32 and bf16 copies
        sample = sample + 0.0  # -0.0 -> 0.0: a 4-bit block's zero has either sign, by how it is dequantized
        hsh.update(name.encode())
        hsh.update(str(tuple(p.shape)).encode())
        hsh.update(sample.cpu().numpy().tobytes())
    return hsh.hexdigest()[:16]
