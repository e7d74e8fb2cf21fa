"""The trained drafters of the tree methods, their files and the shipped copies.

- ``TransferProjections`` (Hidden Transfer, §3.2): for transfer step ``i = 1..k`` a linear map
  ``W_i`` (``D x D``, initialised to the identity) applied at layer ``t_i`` (``layers[i - 1]``, the
  hidden state after ``t_i`` layers) turns a position's hidden state into the *pseudo* hidden state
  of the token ``i`` positions ahead.
- ``MedusaHeads`` (Cai et al. 2023, Medusa-1): head ``i`` maps the last layer's normalised state
  ``z`` to logits for the token ``i + 1`` ahead: ``unembed(z + SiLU(W_i z + b_i))``, ``W_i, b_i``
  zero at start, with the model's own unembedding (frozen, shared: only ``D x D`` per head).
- ``EagleHead`` (after Li et al. 2024, EAGLE, §4): one head drafts a chain feature by feature.  From
  a position's normalised last-layer state ``z_j`` and the embedding of the token after it,
  ``x_{j+1}``, it predicts the state of position ``j + 1``: ``s = u + MLP(u)``,
  ``u = W [z_j; e(x_{j+1}) / rms]``; ``final_norm(s)`` through the model's own unembedding drafts
  ``x_{j+2}`` and feeds the next step with that draft.  ``attention=False``: a residual SwiGLU block
  on the one position, no cache of its own.  ``attention=True``: EAGLE's decoder layer, the block after
  a causal attention layer over the earlier positions' ``u`` (``u <- u + Attn(norm(u))``, the model's
  head counts and rope), whose keys and values the drafter keeps per row (``HeadCache``).

Files: one weights file each (``drafters.weights``: the model's fingerprint and the training budget
in its metadata; a file made for another model is refused), written atomically.  Shipped files live
in ``layerleap/data/transfer/`` and ``layerleap/data/medusa/`` and are found by fingerprint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .. import validate as V
from ..errors import LayerleapError
from ..core import kernels
from ..core.cpu import release_freed_memory
from ..core.model import Transformer, apply_rope
from . import weights

DATA = Path(__file__).parent.parent / "data"
KINDS = ("transfer", "medusa", "eagle")
TRAIN_COMMAND = {
    "transfer": "layerleap train transfer",
    "medusa": "layerleap train medusa",
    "eagle": "layerleap train eagle",
}


class DrafterError(LayerleapError, ValueError):
    """Drafter weights that cannot be made or loaded: the message names the problem and the fix."""


class _Drafter(nn.Module):
    kind = ""

    def __init__(self, model: Transformer):
        super().__init__()
        self._model = [model]  # a list: the frozen backbone is neither a submodule nor saved

    @property
    def model(self) -> Transformer:
        return self._model[0]

    CONFIG: tuple[str, ...] = ()  # the attributes that rebuild it: ``new_drafter(model, kind, **config())``

    @property
    def steps(self) -> int:
        raise NotImplementedError

    def config(self) -> dict:
        return {k: getattr(self, k) for k in self.CONFIG}


class TransferProjections(_Drafter):
    """``W_i`` at layer ``t_i`` for steps ``i = 1..k``; ``layers`` non-decreasing, in ``[1, n_layers - 1]``."""

    kind = "transfer"
    CONFIG = ("layers",)

    def __init__(self, model: Transformer, layers: list[int]):
        super().__init__(model)
        L = model.config.n_layers
        layers = [int(t) for t in layers]
        if not layers or any(not 1 <= t < L for t in layers) or layers != sorted(layers):
            raise DrafterError(
                f"transfer layers must be a non-decreasing list in [1, {L - 1}] (one per step), got {layers}"
            )
        self.layers = layers
        D = model.config.hidden_size
        self.proj = nn.ModuleList(nn.Linear(D, D, bias=False) for _ in layers)
        with torch.no_grad():
            for p in self.proj:
                p.weight.copy_(torch.eye(D))

    @property
    def steps(self) -> int:
        return len(self.layers)

    def transfer(self, step: int, h: torch.Tensor) -> torch.Tensor:
        """Pseudo states of transfer step ``step`` (1-based) from hidden states ``h`` ``[.., D]`` after
        layer ``t_step``."""
        w = self.proj[step - 1].weight
        return F.linear(h.to(w.dtype), w).to(h.dtype)


class MedusaHeads(_Drafter):
    """``k`` residual heads on the last layer's normalised state, predicting tokens 2..k+1 ahead."""

    kind = "medusa"
    CONFIG = ("steps",)

    def __init__(self, model: Transformer, steps: int):
        super().__init__(model)
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise DrafterError(f"Medusa needs at least one head, got {steps!r}")
        D = model.config.hidden_size
        self.heads = nn.ModuleList(nn.Linear(D, D, bias=True) for _ in range(steps))
        with torch.no_grad():
            for p in self.heads:
                p.weight.zero_()
                p.bias.zero_()

    @property
    def steps(self) -> int:
        return len(self.heads)

    def state(self, step: int, z: torch.Tensor) -> torch.Tensor:
        """What head ``step`` (1-based: the token ``step + 1`` ahead) feeds the unembedding, ``[.., D]``,
        from normalised last-layer states ``z`` ``[.., D]``."""
        lin = self.heads[step - 1]
        z32 = z.to(lin.weight.dtype)
        return (z32 + F.silu(lin(z32))).to(self.model.dtype)

    def logits(self, step: int, z: torch.Tensor) -> torch.Tensor:
        """Logits ``[.., V]`` of head ``step`` from normalised last-layer states ``z`` ``[.., D]``."""
        return self.model.unembed(self.state(step, z))


@dataclass
class HeadCache:
    """One row's keys and values of an attending EAGLE head: ``[Hkv, L, hd]`` each, for the pairs at
    positions ``1..L`` (the pair of a position's state and the token after it sits at that token's
    position); the next pair's position is ``L + 1``."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def length(self) -> int:
        return int(self.k.shape[1])

    def extended(self, k: torch.Tensor, v: torch.Tensor) -> "HeadCache":
        """This cache with the entries ``k``, ``v`` ``[Hkv, n, hd]`` after its own."""
        return HeadCache(torch.cat([self.k, k], dim=1), torch.cat([self.v, v], dim=1))


class EagleHead(_Drafter):
    """One head that drafts a chain of any length: ``step(z, x)`` maps normalised last-layer states
    ``z`` and the tokens ``x`` after them to the states of the next positions (module docstring).
    ``hidden``: the SwiGLU block's width; ``attention``: EAGLE's attention over the earlier positions
    before the block.  At start it copies ``z`` (``W = [I, 0]``, the block's and the attention's outputs
    zero), so an untrained head drafts the token after the last one again."""

    kind = "eagle"
    CONFIG = ("hidden", "attention")
    MOST_STEPS = 64  # the longest chain a round drafts (one head serves every step)

    def __init__(self, model: Transformer, hidden: int, attention: bool = False):
        super().__init__(model)
        if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1:
            raise DrafterError(f"the EAGLE head's hidden width must be a positive integer, got {hidden!r}")
        if not isinstance(attention, bool):
            raise DrafterError(f"the EAGLE head's attention must be true or false, got {attention!r}")
        c = model.config
        D = c.hidden_size
        self.hidden, self.attention = hidden, attention
        self.fc = nn.Linear(2 * D, D, bias=False)
        if attention:
            self.n_heads, self.n_kv, self.hd = c.n_heads, c.n_kv_heads, c.head_dim
            self.attn_norm = nn.Parameter(torch.ones(D))
            self.qkv = nn.Linear(D, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim, bias=False)
            self.o = nn.Linear(c.n_heads * c.head_dim, D, bias=False)
        self.norm = nn.Parameter(torch.ones(D))
        self.gate_up = nn.Linear(D, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, D, bias=False)
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, :D].copy_(torch.eye(D))
            self.down.weight.zero_()
            if attention:
                self.o.weight.zero_()

    @property
    def steps(self) -> int:
        return self.MOST_STEPS

    def step(self, z: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Normalised states ``z`` ``[.., D]`` and the tokens after them ``x`` ``[..]`` -> the next
        positions' states ``[.., D]`` (before the final norm, in the model's dtype).  An attending head:
        ``z`` ``[B, N, D]`` are a sequence's positions ``0..N-1``, each attending to those before it
        (as it trains; decoding uses ``step_rows``)."""
        products = self._products()
        u = self._pair(z, x, products[0])
        if self.attention:
            pos = torch.arange(1, u.shape[-2] + 1, device=u.device)
            q, k, v = self._qkv(u, pos)  # [B, H | Hkv, N, hd]
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # [B, H, N, hd]
            u = u + self.o(y.transpose(-3, -2).flatten(-2))
        return self._block(u, products)

    def step_rows(
        self, z: torch.Tensor, x: torch.Tensor, caches: list[HeadCache]
    ) -> tuple[torch.Tensor, list[HeadCache]]:
        """An attending head's next states ``[R, D]`` for rows' normalised states ``z`` ``[R, D]`` and the
        tokens after them ``x`` ``[R]``, each pair at its row's next position, attending to its row's
        ``caches[r]`` and itself -> (the states, each row's cache with the pair added)."""
        products = self._products()
        u = self._pair(z, x, products[0])  # [R, D]
        ys, out = [], []
        for r, cache in enumerate(caches):
            pos = torch.tensor([cache.length + 1], device=u.device)
            q, k, v = self._qkv(u[r : r + 1], pos)  # [H | Hkv, 1, hd]
            grown = cache.extended(k, v)
            ys.append(F.scaled_dot_product_attention(q, grown.k, grown.v, enable_gqa=True).flatten(-3))
            out.append(grown)
        u = u + self.o(torch.stack(ys).reshape(len(caches), -1))
        return self._block(u, products), out

    def entries(self, z: torch.Tensor, x: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values ``[Hkv, n, hd]`` of ``n`` pairs (normalised states ``z`` ``[n, D]``, the
        tokens after them ``x`` ``[n]``) at positions ``start..start + n - 1``: a pair's entry depends on
        the pair alone."""
        u = self._pair(z, x, self._products()[0])
        _, k, v = self._qkv(u, torch.arange(start, start + u.shape[0], device=u.device), queries=False)
        return k, v

    def _pair(self, z: torch.Tensor, x: torch.Tensor, fc) -> torch.Tensor:
        """``u = W [z; e(x) / rms]`` ``[.., D]`` in the head's dtype (``fc``: the product, ``_products``)."""
        w = self.fc.weight
        # the fused F.rms_norm in fp32 is bitwise x * rsqrt(mean(x^2) + eps) (times the weight): one kernel
        e = F.rms_norm(self.model.embed(x).to(w.dtype), (w.shape[0],), eps=1e-6)  # [.., D]
        return fc(torch.cat([z.to(w.dtype), e], dim=-1)).to(w.dtype)

    def _qkv(self, u: torch.Tensor, pos: torch.Tensor, queries: bool = True):
        """``u`` ``[.., N, D]`` at positions ``pos`` ``[N]`` -> rotated queries ``[.., H, N, hd]`` (None
        without ``queries``), rotated keys and values ``[.., Hkv, N, hd]``."""
        H, Hkv = self.n_heads, self.n_kv
        a = F.rms_norm(u, (u.shape[-1],), self.attn_norm, eps=1e-6)
        w = self.qkv.weight if queries else self.qkv.weight[H * self.hd :]
        heads = F.linear(a, w).unflatten(-1, (-1, self.hd))  # [.., N, (H) + 2 Hkv, hd]
        cos, sin = self.model._rope(pos.unsqueeze(0), heads.dtype)  # [1, N, 1, hd]
        cos, sin = cos[0], sin[0]
        if not queries:
            k = apply_rope(heads[..., :Hkv, :], cos, sin)
            return None, k.transpose(-3, -2), heads[..., Hkv:, :].transpose(-3, -2)
        qk = apply_rope(heads[..., : H + Hkv, :], cos, sin)
        q, k = qk[..., :H, :].transpose(-3, -2), qk[..., H:, :].transpose(-3, -2)
        return q, k, heads[..., H + Hkv :, :].transpose(-3, -2)

    def _block(self, u: torch.Tensor, products) -> torch.Tensor:
        """``u + SwiGLU(norm(u))`` in the model's dtype (``products``: ``_products``)."""
        _, gate_up, down = products
        w = self.fc.weight
        v = F.rms_norm(u, (w.shape[0],), self.norm, eps=1e-6)
        gate, up = gate_up(v).to(w.dtype).chunk(2, dim=-1)
        return (u + down(F.silu(gate) * up).to(w.dtype)).to(self.model.dtype)

    def native_step(self, vocab):
        """``(z, x) -> (final_norm(step(z, x)), vocab.logits(...))`` in one call of the native module
        (``decoder.cpp``'s ``eagle_step``: the same kernels, so the same bits), or None where it does not
        serve: no native module, products not held as 8-bit blocks (``_products``), no 8-bit draft
        vocabulary (``draft_vocab.DraftRows``), or a model not in bf16 on a CPU."""
        from ..core import native

        if torch.is_grad_enabled():
            return None
        # (vocab, the module, the model's dtype, the weights and their versions, the step): a round's check
        # in a few attribute reads while nothing it was made from changed
        quick = self.__dict__.get("_native_quick")
        ws = (self.fc.weight, self.gate_up.weight, self.down.weight)
        key = (vocab, native.module(), self.model.dtype)
        if quick is not None and all(a is b for a, b in zip(key, quick[:3])):
            if all(w is held and _version(w) == v for w, (held, v) in zip(ws, quick[3])):
                return quick[4]
        step = self._native_step(vocab)
        self.__dict__["_native_quick"] = (*key, tuple((w, _version(w)) for w in ws), step)
        return step

    def _native_step(self, vocab):
        """``native_step`` made anew from its checks (see there)."""
        from ..core import native

        mod, model = native.module(), self.model
        rows = getattr(getattr(vocab, "head", None), "q8", None)
        if mod is None or rows is None or not hasattr(mod, "eagle_step"):
            return None
        if self.attention:  # its drafts attend to the row's cache: the step in torch (``step_rows``)
            return None
        if model.dtype != torch.bfloat16 or model.device.type != "cpu" or self.norm.dtype != torch.float32:
            return None
        blocks = [getattr(p, "__self__", None) for p in self._products()]
        if not all(isinstance(b, kernels.BlockWeight) and b.fine == rows.fine for b in blocks):
            return None
        ws = [t for b in (*blocks, rows) for t in (b.codes, b.dm)]
        outs = [b.out_features for b in (*blocks, rows)]
        eps = model.norm.eps
        norm, final = self.norm.detach(), model.norm.weight.detach()

        def step(z: torch.Tensor, x: torch.Tensor):
            e = model.embed(x).reshape(z.shape)
            return mod.eagle_step(z, e, ws, outs, norm, final, eps, rows.fine)

        return step

    def _products(self):
        """The three products: the layers themselves while they train, else, where this CPU measures it
        faster (``kernels.q8_products_faster``), 8-bit block copies of the frozen weights (made again if
        a weight changes)."""
        layers = (self.fc, self.gate_up, self.down)
        ws = [m.weight for m in layers]
        if any(w.requires_grad for w in ws) or torch.is_grad_enabled() and self.training:
            return layers
        key = tuple((w.data_ptr(), _version(w)) for w in ws)
        held = getattr(self, "_q8", None)
        if held is None or held[0] != key:
            q8 = kernels.q8_products_faster(ws)
            blocks = [kernels.BlockWeight.from_int8(kernels.quantize_q8(w.detach())) for w in ws] if q8 else None
            self._q8 = held = (key, [b.matmul for b in blocks] if blocks else layers)
            release_freed_memory()  # the measurement's and the quantization's temporaries
        return held[1]


def _version(w: torch.Tensor) -> int:
    """``w``'s in-place change counter; -1 for an inference tensor, which cannot change in place."""
    return -1 if w.is_inference() else w._version


def new_drafter(model: Transformer, kind: str, **config) -> _Drafter:
    if kind == "transfer":
        return TransferProjections(model, config["layers"]).to(model.device)
    if kind == "medusa":
        return MedusaHeads(model, int(config["steps"])).to(model.device)
    if kind == "eagle":
        hidden = config.get("hidden") or model.config.intermediate_size
        return EagleHead(model, int(hidden), bool(config.get("attention", False))).to(model.device)
    raise DrafterError(f"unknown drafter kind {kind!r}: choose one of {', '.join(KINDS)}")


# -- files ----------------------------------------------------------------------------------------
def _builder(kind: str):
    def build(model: Transformer, config: dict, tensors: dict) -> _Drafter:
        drafter = new_drafter(model, kind, **config)
        for name, t in tensors.items():
            weights.finite_float(name, t)
        drafter.load_state_dict({k: v.to(torch.float32) for k, v in tensors.items()})
        return drafter.to(model.device).eval().requires_grad_(False)

    return build


FILE_KINDS = {
    kind: weights.Kind(kind, what, TRAIN_COMMAND[kind], DrafterError, _builder(kind))
    for kind, what in (
        ("transfer", "Hidden Transfer projections"),
        ("medusa", "Medusa heads"),
        ("eagle", "the EAGLE head"),
    )
}


def save_drafter(
    drafter: _Drafter, path, meta: dict | None = None, dtype=torch.bfloat16, budget: weights.Budget | None = None
) -> Path:
    """Write ``drafter`` to a weights file (``dtype``, bf16 by default: a few MB), atomically."""
    return weights.write(path, drafter.model, drafter.kind, drafter.config(), drafter.state_dict(), budget, meta, dtype)


def read_meta(path) -> dict:
    """A weights file's metadata (``weights.read_meta``: an earlier format's keys mapped onto today's)."""
    return weights.read_meta(path, DrafterError, "train them again", "drafter weights")


def load_drafter(model: Transformer, path, kind: str) -> _Drafter:
    """A drafter from a file written by ``save_drafter``; refuses another kind or another model.
    Read once per model and file (``weights.load``)."""
    return weights.load(model, path, _file_kind(kind))


def _file_kind(kind: str) -> weights.Kind:
    if kind not in FILE_KINDS:
        raise DrafterError(f"unknown drafter kind {kind!r}: choose one of {', '.join(KINDS)}")
    return FILE_KINDS[kind]


def shipped_files(model: Transformer, kind: str) -> list[Path]:
    return weights.shipped(model, DATA / kind, _file_kind(kind))


def get_drafter(model: Transformer, kind: str, spec="trained") -> _Drafter:
    """``spec``: "trained" (the shipped weights for this model), a path to a weights file, or a drafter
    of this model."""
    cls = {"transfer": TransferProjections, "medusa": MedusaHeads, "eagle": EagleHead}[_file_kind(kind).name]
    if isinstance(spec, _Drafter):
        if not isinstance(spec, cls) or spec.model is not model:
            raise DrafterError(
                f"the given drafter is not {kind} weights of this model: pass {cls.__name__} made for it"
            )
        return spec
    if spec == "trained":
        files = shipped_files(model, kind)
        if not files:
            raise DrafterError(
                f"no shipped {kind} weights fit {model.config.name} (fingerprint {model.fingerprint}): "
                f"train them with `{TRAIN_COMMAND[kind]}` and pass the file "
                f"({'heads' if kind == 'medusa' else kind}=PATH)"
            )
        return load_drafter(model, files[-1], kind)
    if isinstance(spec, (str, Path)):
        return load_drafter(model, spec, kind)
    raise DrafterError(f"{kind} weights must be 'trained', a weights file or a drafter object, got {V.show(spec)}")
