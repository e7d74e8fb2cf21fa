"""The trained drafters of the tree methods, their files and the shipped copies.

- ``TransferProjections`` (Hidden Transfer, §3.2): for transfer step ``i = 1..k`` a linear map
  ``W_i`` (``D x D``, initialised to the identity) applied at layer ``t_i`` (``layers[i - 1]``, the
  hidden state after ``t_i`` layers) turns a position's hidden state into the *pseudo* hidden state
  of the token ``i`` positions ahead.
- ``MedusaHeads`` (Cai et al. 2023, Medusa-1): head ``i`` maps the last layer's normalised state
  ``z`` to logits for the token ``i + 1`` ahead: ``unembed(z + SiLU(W_i z + b_i))``, ``W_i, b_i``
  zero at start, with the model's own unembedding (frozen, shared: only ``D x D`` per head).

Files: one weights file each (``drafters.weights``: the model's fingerprint and the training budget
in its metadata; a file made for another model is refused), written atomically.  Shipped files live
in ``layerleap/data/transfer/`` and ``layerleap/data/medusa/`` and are found by fingerprint.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import LayerleapError
from ..core.model import Transformer
from . import weights

DATA = Path(__file__).parent.parent / "data"
KINDS = ("transfer", "medusa")
TRAIN_COMMAND = {"transfer": "layerleap train transfer", "medusa": "layerleap train medusa"}


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


def new_drafter(model: Transformer, kind: str, **config) -> _Drafter:
    if kind == "transfer":
        return TransferProjections(model, config["layers"]).to(model.device)
    if kind == "medusa":
        return MedusaHeads(model, int(config["steps"])).to(model.device)
    raise DrafterError(f"unknown drafter kind {kind!r}: choose one of {', '.join(KINDS)}")


# -- files ----------------------------------------------------------------------------------------
def _builder(kind: str):
    def build(model: Transformer, config: dict, tensors: dict) -> _Drafter:
        drafter = new_drafter(model, kind, **config)
        drafter.load_state_dict({k: v.to(torch.float32) for k, v in tensors.items()})
        return drafter.to(model.device).eval().requires_grad_(False)

    return build


FILE_KINDS = {
    kind: weights.Kind(kind, what, TRAIN_COMMAND[kind], DrafterError, _builder(kind))
    for kind, what in (("transfer", "Hidden Transfer projections"), ("medusa", "Medusa heads"))
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
    cls = TransferProjections if kind == "transfer" else MedusaHeads
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
                f"({'transfer' if kind == 'transfer' else 'heads'}=PATH)"
            )
        return load_drafter(model, files[-1], kind)
    if isinstance(spec, (str, Path)):
        return load_drafter(model, spec, kind)
    raise DrafterError(f"{kind} weights must be 'trained', a weights file or a drafter object, got {spec!r}")
