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

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .kv_cache import CacheError, KVCache


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # as Hugging Face's LlamaRMSNorm: normalise in fp32, cast back, then scale.  In fp32 the fused
        # F.rms_norm is bitwise equal to weight * (x * rsqrt(mean(x^2) + eps)) and one kernel.
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, x.shape[-1:], self.weight, eps=self.eps)
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)


def rope_tables(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin ``[max_position, head_dim]`` in fp32 (the Hugging Face 'default' rope).

    ``rotate_half(x) * sin == roll(x, hd/2) * sin_signed`` exactly, with the first half of
    ``sin_signed`` negated, so applying the rotation takes one roll instead of split + cat + neg."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    t = torch.arange(config.max_position, dtype=torch.int64).float()
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
    return (device.type == "cpu" and dtype != torch.float32
            and not (dtype == torch.bfloat16 and cpu_has_native_bf16()))


def linear(lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``lin(x)``, except that a product over many rows runs in fp32 where ``fp32_detour`` says so
    (700 rows x 576 -> 3072 on the AVX2 EPYC: 128 ms in bf16 against 18 ms with the weight converted
    on the fly); one-row products stay in the weights' dtype."""
    if x.numel() // x.shape[-1] >= 16 and fp32_detour(x.dtype, x.device):
        b = lin.bias.float() if lin.bias is not None else None
        return F.linear(x.float(), lin.weight.float(), b).to(x.dtype)
    return lin(x)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed


class Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = c.n_heads, c.n_kv_heads, c.head_dim
        self.qkv = nn.Linear(c.hidden_size, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim, bias=c.qkv_bias)
        self.o = nn.Linear(c.n_heads * c.head_dim, c.hidden_size, bias=False)

    def project(self, x, cos, sin):
        """``[B, S, D]`` -> rotated q ``[B, H, S, hd]``, rotated k and v ``[B, Hkv, S, hd]``.
        ``cos``/``sin`` are ``[B, S, 1, hd]``."""
        B, S, _ = x.shape
        heads = linear(self.qkv, x).view(B, S, self.n_heads + 2 * self.n_kv, self.hd)
        qk = apply_rope(heads[:, :, : self.n_heads + self.n_kv], cos, sin).transpose(1, 2)
        q, k = qk.split([self.n_heads, self.n_kv], dim=1)
        return q, k, heads[:, :, self.n_heads + self.n_kv:].transpose(1, 2)

    def forward(self, x, cos, sin, layer: int, cache: KVCache | None, mask) -> torch.Tensor:
        B, S, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        if cache is not None:
            cache.write(layer, k, v)
            total = mask.shape[-1] if mask is not None else int(cache.lengths[layer, 0]) + S
            k = cache.k[layer, :, :, :total]
            v = cache.v[layer, :, :, :total]
            q = q.to(k.dtype)  # attention runs in the cache's dtype (fp32 on CPU, see new_cache)
        if mask is None and S > 1:  # causal over exactly these S keys (no cache, or an empty one)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv != self.n_heads)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_kv != self.n_heads)
        return linear(self.o, y.transpose(1, 2).reshape(B, S, self.n_heads * self.hd).to(x.dtype))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.inter = c.intermediate_size
        self.gate_up = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        gate, up = linear(self.gate_up, x).split(self.inter, dim=-1)
        return linear(self.down, F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.attn = Attention(c)
        self.mlp_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, h, cos, sin, layer, cache, mask):
        h = h + self.attn(self.attn_norm(h), cos, sin, layer, cache, mask)
        return h + self.mlp(self.mlp_norm(h))


class Transformer(nn.Module):
    """The decoder.  ``tokenizer`` and ``source`` are metadata attached by the loader."""

    def __init__(self, config: ModelConfig, tokenizer=None, source: str | None = None):
        super().__init__()
        self.config = config
        self.tokenizer = tokenizer
        self.source = source  # a Hugging Face folder with the same weights, when there is one
        c = config
        self.tok_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_embeddings:
            self.lm_head.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(c)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._fingerprint: str | None = None

    # -- the separately callable stages ----------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """``[B, S]`` token ids -> ``[B, S, D]`` hidden states."""
        return self.tok_embeddings(ids)

    def run_layers(self, h: torch.Tensor, start: int, end: int, positions: torch.Tensor,
                   cache: KVCache | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
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
        cos, sin = self._rope(positions, h.dtype)
        S = h.shape[1]
        attn_mask = None
        if cache is None and mask is not None:
            m = mask if mask.dim() == 3 else mask.unsqueeze(0)
            attn_mask = m.unsqueeze(1)  # [B|1, 1, S, S]
        same = cache is None or bool((cache.lengths[start:end] == cache.lengths[start]).all())
        for layer in range(start, end):
            if cache is not None and (layer == start or not same):
                attn_mask, _ = cache.attention_mask(layer, S, mask)  # one mask while lengths agree
            h = self.layers[layer](h, cos, sin, layer, cache, attn_mask)
        if cache is not None:
            cache.advance(start, end, S)
        return h

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos, sign-folded sin ``[B, S, 1, hd]`` at ``positions`` ``[B, S]``."""
        return self.rope_cos[positions].unsqueeze(2).to(dtype), self.rope_sin[positions].unsqueeze(2).to(dtype)

    def fill_kv(self, h: torch.Tensor, start: int, end: int, positions: torch.Tensor, cache: KVCache) -> None:
        """Write keys/values of layers ``[start, end)`` computed from one hidden state ``h`` ``[B, S, D]``
        (as if every layer's input were ``h``), without running the layers; lengths advance by S.
        CALM-style early exit uses it to give skipped layers cache entries from the exit state."""
        if int(cache.lengths[start:end].max()) + h.shape[1] > cache.max_len:
            raise CacheError(f"KV cache overflow: {h.shape[1]} more slots do not fit in {cache.max_len}")
        cos, sin = self._rope(positions, h.dtype)
        for layer in range(start, end):
            blk = self.layers[layer]
            _, k, v = blk.attn.project(blk.attn_norm(h), cos, sin)
            cache.write(layer, k, v)
        cache.advance(start, end, h.shape[1])

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h)

    def unembed(self, h: torch.Tensor) -> torch.Tensor:
        """``[B, S, D]`` normalised hidden states -> ``[B, S, V]`` logits (fp32)."""
        return linear(self.lm_head, h).float()

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.unembed(self.final_norm(h))

    def forward(self, ids: torch.Tensor, positions: torch.Tensor | None = None, cache: KVCache | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """All layers: ``[B, S]`` ids -> ``[B, S, V]`` logits.  Positions default to continuing the
        cache (``lengths - pad``), or ``0 .. S-1`` without one."""
        if positions is None:
            base = (cache.lengths[0] - cache.pad).unsqueeze(1) if cache is not None else torch.zeros(1, 1, dtype=torch.long)
            positions = (base + torch.arange(ids.shape[1])).expand(ids.shape[0], -1).to(ids.device)
        h = self.run_layers(self.embed(ids), 0, self.config.n_layers, positions, cache, mask)
        return self.logits(h)

    # -- facts -----------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embeddings.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.weight.device

    def new_cache(self, batch: int, max_len: int, dtype: torch.dtype | None = None) -> KVCache:
        """A cache for ``batch`` rows of ``max_len`` slots, in ``cache_dtype()`` unless ``dtype`` says."""
        return KVCache.for_model(self.config, batch, max_len, dtype or self.cache_dtype(), self.device)

    def cache_dtype(self) -> torch.dtype:
        """The weights' dtype, or fp32 where ``fp32_detour`` says so (the cache is small next to the
        weights; with AVX512-BF16/AMX an fp32 cache made attention 41% of a 700-token bf16 prefill)."""
        return torch.float32 if fp32_detour(self.dtype, self.device) else self.dtype

    PROJECTIONS = ("qkv.weight", "o.weight", "gate_up.weight", "down.weight", "lm_head.weight")

    @staticmethod
    def column_major(dtype: torch.dtype, device_type: str) -> bool:
        """Whether projections multiply fastest column-major (fp32 on CPU) for this dtype/device."""
        return dtype == torch.float32 and device_type == "cpu"

    def optimize_layout(self) -> "Transformer":
        """Store each projection in the memory layout that multiplies fastest for the dtype.

        Shapes stay ``[out, in]`` as in ``nn.Linear``; only strides change.  On CPU a one-row fp32
        product runs 1.4-1.8x faster when ``weight.T`` is contiguous (column-major weight), while
        bf16/fp16 kernels want the row-major layout.  A tied fp32 LM head gets its own
        column-major copy (the embedding lookup keeps the row-major matrix).  Results are the same
        up to float rounding order."""
        col = self.column_major(self.dtype, self.device.type)
        # rope tables are computed in fp32 and cast once, as Hugging Face casts them per call
        self.rope_cos, self.rope_sin = self.rope_cos.to(self.dtype), self.rope_sin.to(self.dtype)
        linears = [m for blk in self.layers for m in (blk.attn.qkv, blk.attn.o, blk.mlp.gate_up, blk.mlp.down)]
        for lin in linears + [self.lm_head]:
            w = lin.weight.detach()
            w = w.t().contiguous().t() if col else w.contiguous()
            if lin is self.lm_head and self.config.tie_embeddings and not col:
                w = self.tok_embeddings.weight
            lin.weight = nn.Parameter(w, requires_grad=lin.weight.requires_grad) if not isinstance(w, nn.Parameter) else w
        return self

    def n_params(self) -> int:
        """Parameters of the model as defined (a tied LM head counts once, even when the fp32 layout
        keeps a separate copy of it)."""
        n = sum(p.numel() for p in self.parameters())
        if self.config.tie_embeddings and self.lm_head.weight is not self.tok_embeddings.weight:
            n -= self.lm_head.weight.numel()
        return n

    def weight_bytes(self) -> int:
        """Bytes of weights held in memory (a separate tied-head copy included)."""
        return sum(p.numel() * p.element_size() for p in self.parameters())

    @property
    def fingerprint(self) -> str:
        """A short hash of the config and a sample of every weight: heads trained for one model
        refuse to load into another."""
        if self._fingerprint is None:
            facts = {k: v for k, v in self.config.to_dict().items() if k != "name"}
            hsh = hashlib.sha256(repr(sorted(facts.items())).encode())
            for name, p in sorted(self.state_dict().items()):
                flat = p.detach().reshape(-1).to(torch.bfloat16).float()  # same for fp32 and bf16 copies
                hsh.update(name.encode())
                hsh.update(str(tuple(p.shape)).encode())
                hsh.update(flat[:: max(1, flat.numel() // 4096)].cpu().numpy().tobytes())
            self._fingerprint = hsh.hexdigest()[:16]
        return self._fingerprint
