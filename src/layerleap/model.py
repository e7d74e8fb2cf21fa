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

import hashlib

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .kv_cache import KVCache


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_tables(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[max_position, head_dim]`` in fp32 (the Hugging Face 'default' rope)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    t = torch.arange(config.max_position, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = c.n_heads, c.n_kv_heads, c.head_dim
        self.qkv = nn.Linear(c.hidden_size, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim, bias=c.qkv_bias)
        self.o = nn.Linear(c.n_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x, cos, sin, layer: int, cache: KVCache | None, mask) -> torch.Tensor:
        B, S, _ = x.shape
        q, k, v = self.qkv(x).split([self.n_heads * self.hd, self.n_kv * self.hd, self.n_kv * self.hd], dim=-1)
        q = q.view(B, S, self.n_heads, self.hd).transpose(1, 2)  # [B, H, S, hd]
        k = k.view(B, S, self.n_kv, self.hd).transpose(1, 2)  # [B, Hkv, S, hd]
        v = v.view(B, S, self.n_kv, self.hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if cache is not None:
            cache.write(layer, k, v)
            total = mask.shape[-1] if mask is not None else int(cache.lengths[layer, 0]) + S
            k = cache.k[layer, :, :, :total]
            v = cache.v[layer, :, :, :total]
        if mask is None and cache is None and S > 1:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv != self.n_heads)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_kv != self.n_heads)
        return self.o(y.transpose(1, 2).reshape(B, S, self.n_heads * self.hd))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.inter = c.intermediate_size
        self.gate_up = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

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
        cos = self.rope_cos[positions].unsqueeze(1).to(h.dtype)  # [B, 1, S, hd]
        sin = self.rope_sin[positions].unsqueeze(1).to(h.dtype)
        S = h.shape[1]
        attn_mask, prev_len = None, None
        if cache is None and mask is not None:
            m = mask if mask.dim() == 3 else mask.unsqueeze(0)
            attn_mask = m.unsqueeze(1)  # [B|1, 1, S, S]
        for layer in range(start, end):
            if cache is not None:
                lens = cache.lengths[layer]
                if prev_len is None or not torch.equal(lens, prev_len):
                    attn_mask, _ = cache.attention_mask(layer, S, mask)
                    prev_len = lens.clone()
            h = self.layers[layer](h, cos, sin, layer, cache, attn_mask)
        if cache is not None:
            cache.advance(start, end, S)
        return h

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h)

    def unembed(self, h: torch.Tensor) -> torch.Tensor:
        """``[B, S, D]`` normalised hidden states -> ``[B, S, V]`` logits (fp32)."""
        return self.lm_head(h).float()

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.unembed(self.final_norm(h))

    def forward(self, ids: torch.Tensor, positions: torch.Tensor | None = None, cache: KVCache | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """All layers: ``[B, S]`` ids -> ``[B, S, V]`` logits."""
        if positions is None:
            positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand(ids.shape[0], -1)
        h = self.run_layers(self.embed(ids), 0, self.config.n_layers, positions, cache, mask)
        return self.logits(h)

    # -- facts -----------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embeddings.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.weight.device

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache.for_model(self.config, batch, max_len, self.dtype, self.device)

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def weight_bytes(self) -> int:
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
