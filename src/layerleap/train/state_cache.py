"""The frozen backbone's hidden states on disk: computed once, read back by every later epoch and run.

Heads that read a fixed layer's states of a frozen backbone (Medusa heads: the last layer; exit and
lens heads: their layer and the last) need the backbone only for those states.  A ``StateCache``
keeps, for every training item (a chunk or a sequence of token ids), the states after some layers
``[n, D]`` and the item's token ids, in shards of ``shard_items`` items:
``<root>/<model>-<fingerprint>/<model dtype>-layers<l,..>-<key hash>/shard-00000.safetensors``.

The key is the model's fingerprint and dtype (fp32, bf16 and q4 states differ), the layers, the
storage dtype and a hash of every item's token ids (the data, its order and the sequence length), so
another model or other data gets a folder of its own and builds its states afresh.  A shard is
written, atomically, once all its items are computed; an interrupted run leaves whole shards only,
and a rerun computes the missing ones.  A shard whose recorded key or token ids differ from what the
run asks for is refused in one line, never read.  Logits are never stored: the target distribution
comes from the last layer's state through the frozen final norm and unembedding (49152 values a
token for SmolLM2, against 576).

Hidden Transfer's projections cannot train from cached states alone: their pseudo states run through
the layers above ``t_1`` with gradients, so each step runs those layers.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from collections import OrderedDict
from pathlib import Path
import torch

from ..errors import LayerleapError
from ..files import cache_root, reading, save_safetensors

FORMAT = "layerleap-state-cache-1"
SHARD_ITEMS = 64  # items per shard (64 chunks of 128 tokens of SmolLM2's last layer: 9.4 MB in bf16)
LOADED = 8  # shards held in memory at once (the items are read in order: the rest wait on disk)


class StateCacheError(LayerleapError, ValueError):
    pass


def default_root() -> Path:
    """Where ``--state-cache`` without a folder keeps the states: ``<cache root>/states``."""
    return cache_root() / "states"


def data_hash(items: list[list[int]]) -> str:
    """A hash of the items' token ids, their lengths and their order."""
    h = hashlib.sha256()
    for ids in items:
        h.update(len(ids).to_bytes(8, "little"))
        h.update(torch.tensor(ids, dtype=torch.int64).numpy().tobytes())
    return h.hexdigest()


@torch.inference_mode()
def backbone_states(model, ids: torch.Tensor, layers: list[int]) -> dict[int, torch.Tensor]:
    """``{layer: [B, N, D]}`` (the model's dtype): the states after each of ``layers`` (sorted) for
    ``ids`` ``[B, N]``, one causal pass."""
    B, N = ids.shape
    pos = torch.arange(N, device=model.device).unsqueeze(0).expand(B, -1)
    h, done, out = model.embed(ids.to(model.device)), 0, {}
    for layer in layers:
        h = model.run_layers(h, done, layer, pos)
        done = layer
        out[layer] = h
    return out


class StateCache:
    """The states after ``layers`` of ``model`` for each of ``items`` (token id lists), stored in
    ``dtype`` under ``root`` (see the module's text)."""

    def __init__(self, root, model, layers, items: list[list[int]], dtype=torch.bfloat16, shard_items=SHARD_ITEMS):
        self.model, self.items, self.dtype, self.shard_items = model, items, dtype, shard_items
        self.layers = sorted(set(int(x) for x in layers))
        key = {
            "format": FORMAT,
            "model": model.fingerprint,
            "model_dtype": model.dtype_name,
            "layers": self.layers,
            "dtype": str(dtype).removeprefix("torch."),
            "data": data_hash(items),
            "items": len(items),
            "shard_items": shard_items,
        }
        self.key = json.dumps(key, sort_keys=True)
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", model.config.name or "model")
        tag = hashlib.sha256(self.key.encode()).hexdigest()[:16]
        layers_txt = ",".join(map(str, self.layers))
        self.dir = (
            Path(root).expanduser()
            / f"{name}-{model.fingerprint[:16]}"
            / f"{model.dtype_name}-layers{layers_txt}-{tag}"
        )
        self._shards: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()  # the last LOADED shards used
        self._pending: dict[int, dict[int, dict[int, torch.Tensor]]] = {}  # shard -> item -> layer -> [n, D]
        self.computed = 0  # items this process ran through the backbone

    # -- shards ------------------------------------------------------------------------------------
    @property
    def n_shards(self) -> int:
        return -(-len(self.items) // self.shard_items)

    def shard_path(self, s: int) -> Path:
        return self.dir / f"shard-{s:05d}.safetensors"

    def _span(self, s: int) -> range:
        return range(s * self.shard_items, min(len(self.items), (s + 1) * self.shard_items))

    def cached_items(self) -> int:
        """Items whose shard is on disk."""
        return sum(len(self._span(s)) for s in range(self.n_shards) if self.shard_path(s).is_file())

    def complete(self) -> bool:
        return all(self.shard_path(s).is_file() for s in range(self.n_shards))

    def describe(self) -> str:
        """One line: where the cache is and how much of it is there."""
        have, n = self.cached_items(), len(self.items)
        if have == n:
            return f"state cache {self.dir}: all {n} items cached, the backbone does not run"
        if have == 0:
            return f"state cache {self.dir}: none cached for this model and data yet; the first pass stores them"
        return f"state cache {self.dir}: {have} of {n} items cached; the first pass stores the rest"

    def _keep(self, s: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self._shards[s] = tensors
        self._shards.move_to_end(s)
        while len(self._shards) > LOADED:
            self._shards.popitem(last=False)
        return tensors

    def _load(self, s: int) -> dict[str, torch.Tensor] | None:
        if s in self._shards:
            return self._keep(s, self._shards[s])
        path = self.shard_path(s)
        if not path.is_file():
            return None
        from safetensors import safe_open

        fix = f"delete {self.dir} to rebuild it"
        with reading(path, "state cache shard", fix), safe_open(str(path), "pt") as f:
            if (f.metadata() or {}).get("key") != self.key:
                raise StateCacheError(f"state cache shard {path} was written for another model or data: {fix}")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        span = self._span(s)
        ids = torch.cat([torch.tensor(self.items[i], dtype=torch.int32) for i in span])
        if not torch.equal(tensors.get("ids", torch.empty(0)), ids) or len(tensors.get("lengths", ())) != len(span):
            raise StateCacheError(f"state cache shard {path} holds other token ids than this data: {fix}")
        return self._keep(s, tensors)

    def _write(self, s: int) -> None:
        span = self._span(s)
        got = self._pending.pop(s)
        tensors = {f"layer{x}": torch.cat([got[i][x] for i in span]) for x in self.layers}
        tensors["ids"] = torch.cat([torch.tensor(self.items[i], dtype=torch.int32) for i in span])
        tensors["lengths"] = torch.tensor([len(self.items[i]) for i in span], dtype=torch.int64)
        save_safetensors(self.shard_path(s), tensors, {"format": FORMAT, "key": self.key})
        self._keep(s, tensors)

    def derived(self, name: str, compute) -> torch.Tensor:
        """A tensor computed from the whole cache (``compute()``), stored beside the shards under the
        same key (``<name>.safetensors``) and read back by later runs."""
        path = self.dir / f"{name}.safetensors"
        if path.is_file():
            from safetensors import safe_open

            fix = f"delete {self.dir} to rebuild it"
            with reading(path, "state cache file", fix), safe_open(str(path), "pt") as f:
                if (f.metadata() or {}).get("key") != self.key:
                    raise StateCacheError(f"state cache file {path} was written for another model or data: {fix}")
                return f.get_tensor(name)
        value = compute()
        save_safetensors(path, {name: value}, {"format": FORMAT, "key": self.key})
        return value

    # -- items -------------------------------------------------------------------------------------
    def get(self, i: int) -> dict[int, torch.Tensor] | None:
        """Item ``i``'s states ``{layer: [n_i, D]}`` in the storage dtype, or None when not stored."""
        s = i // self.shard_items
        if s in self._pending and i in self._pending[s]:
            return self._pending[s][i]
        tensors = self._load(s)
        if tensors is None:
            return None
        lengths = tensors["lengths"].tolist()
        k = i - s * self.shard_items
        a = sum(lengths[:k])
        return {x: tensors[f"layer{x}"][a : a + lengths[k]] for x in self.layers}

    def put(self, i: int, states: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Store item ``i``'s states ``{layer: [n_i, D]}`` (its shard is written once complete); ->
        them in the storage dtype."""
        s = i // self.shard_items
        kept = {x: states[x].detach().to(self.dtype).cpu().contiguous() for x in self.layers}
        self._pending.setdefault(s, {})[i] = kept
        if len(self._pending[s]) == len(self._span(s)):
            self._write(s)
        return kept

    def states(self, idx: list[int]) -> dict[int, torch.Tensor]:
        """``{layer: [B, N, D]}`` in the storage dtype for items ``idx`` (of one length): read where
        stored, else run through the backbone (together) and stored."""
        got = {i: self.get(i) for i in dict.fromkeys(idx)}
        missing = [i for i, v in got.items() if v is None]
        if missing:
            h = backbone_states(self.model, torch.tensor([self.items[i] for i in missing]), self.layers)
            for r, i in enumerate(missing):
                got[i] = self.put(i, {x: h[x][r] for x in self.layers})
            self.computed += len(missing)
        return {x: torch.stack([got[i][x] for i in idx]) for x in self.layers}

    def compute(self, batch: int = 8, report=None) -> None:
        """Run every item not stored through the backbone and store it, shard by shard, ``batch`` items of
        similar length together (right-padded: causal attention keeps each item's states its own, up to
        the rounding of the batched products); ``report(shard, tokens)`` after each shard."""
        for s in range(self.n_shards):
            todo = sorted((i for i in self._span(s) if self.get(i) is None), key=lambda i: len(self.items[i]))
            for b in range(0, len(todo), batch):
                idx = todo[b : b + batch]
                n = max(len(self.items[i]) for i in idx)
                ids = torch.tensor([self.items[i] + [0] * (n - len(self.items[i])) for i in idx])
                h = backbone_states(self.model, ids, self.layers)
                for r, i in enumerate(idx):
                    self.put(i, {x: h[x][r, : len(self.items[i])] for x in self.layers})
                self.computed += len(idx)
            if report is not None:
                report(s, sum(len(self.items[i]) for i in todo))

    def fill(self, progress: bool = True) -> dict[int, torch.Tensor]:
        """Every item's states (computed one item at a time where not stored) ->
        ``{layer: [sum n_i, D]}`` in the storage dtype, the items one after another."""
        from tqdm import tqdm

        bar = tqdm(
            total=sum(map(len, self.items)),
            desc="cache hidden states",
            unit="tok",
            disable=not progress,
            file=sys.stderr,
            dynamic_ncols=True,
        )
        parts: dict[int, list[torch.Tensor]] = {x: [] for x in self.layers}
        for i, ids in enumerate(self.items):
            got = self.states([i])
            for x in self.layers:
                parts[x].append(got[x][0])
            bar.update(len(ids))
        bar.close()
        return {
            x: torch.cat(v) if v else torch.zeros(0, self.model.config.hidden_size, dtype=self.dtype)
            for x, v in parts.items()
        }
