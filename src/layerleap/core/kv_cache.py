"""A preallocated key/value cache written by slot, with a length per layer and per row.

Layout: ``k`` and ``v`` are ``[n_layers, batch, n_kv_heads, max_len, head_dim]``.  Row ``b`` of
layer ``l`` holds valid entries in slots ``[pad[b], lengths[l, b])``; slots below ``pad[b]`` belong
to left padding and are never attended to.  New tokens are appended at ``lengths[l, b]`` (their
rotary positions are passed separately, so tree nodes may share a position).  Rolling back is
``truncate``; keeping an accepted subset of the newest slots (a tree path) is ``compact``.
"""

from __future__ import annotations

import torch

from ..errors import LayerleapError


class CacheError(LayerleapError, ValueError):
    pass


class KVCache:
    def __init__(
        self, n_layers: int, batch: int, n_kv_heads: int, max_len: int, head_dim: int, dtype=torch.float32, device="cpu"
    ):
        shape = (n_layers, batch, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(n_layers, batch, dtype=torch.long)  # [L, B] filled slots
        self.pad = torch.zeros(batch, dtype=torch.long)  # [B] left-padding slots
        self.max_len = max_len

    @classmethod
    def for_model(cls, config, batch: int, max_len: int, dtype=torch.float32, device="cpu") -> "KVCache":
        return cls(config.n_layers, batch, config.n_kv_heads, max_len, config.head_dim, dtype, device)

    @property
    def n_layers(self) -> int:
        return self.k.shape[0]

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def length(self, layer: int = 0) -> int:
        """The filled length of ``layer``, which must be the same for every row."""
        lens = self.lengths[layer]
        n = int(lens[0])
        if self.batch > 1 and not bool((lens == n).all()):
            raise CacheError(f"rows of layer {layer} have different lengths {lens.tolist()}")
        return n

    # -- attention ------------------------------------------------------------------------
    def attention_mask(self, layer: int, n_new: int, new_mask: torch.Tensor | None):
        """Mask for ``n_new`` tokens appended to ``layer``: ``(mask [B,1,S,T] bool or None, T)``;
        None means causal (for one new token: attend to every slot).

        ``new_mask`` ``[S, S]`` or ``[B, S, S]`` says which new tokens see which (causal if None).
        """
        start = self.lengths[layer]  # [B]
        uniform = self.batch == 1 or bool((start == start[0]).all())
        s0 = int(start[0]) if uniform else int(start.max())
        total = s0 + n_new
        if total > self.max_len:
            raise CacheError(f"KV cache overflow: {total} slots needed, {self.max_len} allocated")
        no_pad = not bool(self.pad.any())
        if uniform and no_pad and new_mask is None and (n_new == 1 or s0 == 0):
            return None, total  # one token sees everything; a first chunk is plain causal
        dev = self.k.device
        if uniform and no_pad and new_mask is None:  # a chain: new token i sees the slots up to its own, s0 + i
            mask = torch.arange(total, device=dev) <= torch.arange(s0, total, device=dev).view(-1, 1)  # [S, T]
            return mask.expand(self.batch, 1, n_new, total), total
        if uniform and no_pad and (new_mask.dim() == 2 or new_mask.shape[0] == 1):  # one tree for every row
            return self._tree_mask(s0, new_mask.reshape(n_new, n_new)).expand(self.batch, 1, n_new, total), total
        key = torch.arange(total, device=dev)  # [T]
        st = start.to(dev).view(-1, 1, 1)  # [B,1,1]
        rel = key.view(1, 1, -1) - st  # [B,1,T] key offset from the row's first new slot
        qi = torch.arange(n_new, device=dev).view(1, -1, 1)  # [1,S,1]
        real = key.view(1, 1, -1) >= self.pad.to(dev).view(-1, 1, 1)  # [B,1,T] not left padding
        old = rel < 0
        if new_mask is None:
            new = (rel >= 0) & (rel <= qi)  # causal among the new tokens
        else:
            nm = new_mask.to(dev).bool()
            if nm.dim() == 2:
                nm = nm.unsqueeze(0)
            nm = nm.expand(self.batch, n_new, n_new)
            idx = rel.clamp(0, n_new - 1).expand(self.batch, n_new, total)
            new = (rel >= 0) & (rel < n_new) & torch.gather(nm, 2, idx)
        mask = ((old | new) & real) | (rel == qi)  # a token always sees itself (keeps padded rows finite)
        return mask.unsqueeze(1), total

    def _tree_mask(self, s0: int, new_mask: torch.Tensor) -> torch.Tensor:
        """``attention_mask``'s ``[S, s0 + S]`` for rows without padding that all start at ``s0``: every old
        slot, then ``new_mask`` ``[S, S]`` among the new tokens, each token seeing itself (the general rule's
        result, from three tensor operations instead of fifteen)."""
        n = new_mask.shape[0]
        mask = torch.ones(n, s0 + n, dtype=torch.bool, device=self.k.device)  # [S, T]
        new = mask[:, s0:]  # [S, S]
        new.copy_(new_mask)
        new.diagonal().fill_(True)
        return mask

    def write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, starts: list[int] | None = None) -> None:
        """Write ``[B, Hkv, S, D]`` keys/values at each row's current length (does not advance).
        ``starts`` (``[B]`` ints) is ``lengths[layer]`` when the caller has already read it."""
        starts = self.lengths[layer].tolist() if starts is None else starts
        n = k_new.shape[2]
        s0 = starts[0]
        if all(s == s0 for s in starts):
            self.k[layer].narrow(2, s0, n).copy_(k_new)
            self.v[layer].narrow(2, s0, n).copy_(v_new)
        else:
            for b, s in enumerate(starts):
                self.k[layer, b, :, s : s + n] = k_new[b]
                self.v[layer, b, :, s : s + n] = v_new[b]

    def advance(self, start: int, end: int, n_new: int) -> None:
        self.lengths[start:end].add_(n_new)  # in place through the view (no copy back)

    # -- rollback and compaction --------------------------------------------------------
    def truncate(self, length, layers: range | None = None) -> None:
        """Roll back to ``length`` slots (an int or a per-row ``[B]`` tensor) in ``layers``."""
        sl = self._layers(layers)
        if sl.start == sl.stop:
            return
        if isinstance(length, int):  # one length for every row: checked against the extremes
            if length < int(self.pad.max()) or length > int(self.lengths[sl].min()):
                raise CacheError(f"cannot truncate to {length}: outside [left padding, filled length]")
            self.lengths[sl] = length
            return
        new = torch.as_tensor(length)
        if new.is_floating_point() or new.is_complex() or new.dim() > 1 or new.numel() not in (1, self.batch):
            raise CacheError(
                f"cannot truncate to {length!r}: give an integer length or one per row ({self.batch} integers)"
            )
        new = new.to(torch.long).expand(self.batch)
        if bool((new < self.pad).any()) or bool((new > self.lengths[sl]).any()):
            raise CacheError(f"cannot truncate to {new.tolist()}: outside [left padding, filled length]")
        self.lengths[sl] = new

    def compact(self, start, keep, layers: range | None = None) -> None:
        """Keep only the new slots ``start + keep`` and move them to ``start .. start+K``; lengths
        become ``start + K``.  ``keep``: ``[K]`` (every row) or ``[B, K]`` offsets, increasing (a row of
        ``[B, K]`` may repeat its last offset as padding), or a list of ``B`` such ``[K_b]`` tensors (rows
        keeping different numbers of slots).  A kept slot must be filled in every layer of ``layers``,
        and ``start`` lie between the row's left padding and its filled length."""
        sl = self._layers(layers)
        if sl.start == sl.stop:
            return
        if isinstance(keep, torch.Tensor):
            keep = keep.to(torch.long)
            keep = list(keep.unsqueeze(0).expand(self.batch, -1) if keep.dim() == 1 else keep)
        if len(keep) != self.batch:
            raise CacheError(f"compact: give kept offsets for each of the {self.batch} rows, got {len(keep)}")
        starts = torch.as_tensor(start, dtype=torch.long).expand(self.batch).tolist()
        rows = [torch.as_tensor(keep[b]).reshape(-1).tolist() for b in range(self.batch)]
        filled = self.lengths[sl].min(dim=0).values.tolist()  # [B]: slots filled in every layer of the range
        # checked before any slot moves: a refused call changes nothing
        for b, (s, offsets) in enumerate(zip(starts, rows)):
            if not int(self.pad[b]) <= s <= filled[b]:
                raise CacheError(
                    f"compact: start {s} of row {b} is outside [left padding {int(self.pad[b])}, "
                    f"filled length {filled[b]}]"
                )
            if any(nxt < off or (nxt == off != offsets[-1]) for off, nxt in zip(offsets, offsets[1:])):
                raise CacheError(
                    f"compact: the kept offsets must increase (a row may repeat its last one as padding), "
                    f"got {offsets} for row {b}"
                )
            if offsets and (offsets[0] < 0 or s + offsets[-1] >= filled[b]):
                raise CacheError(
                    f"compact: row {b} keeps offsets {offsets} from slot {s}, but only its slots [{s}, {filled[b]}) "
                    "are filled: keep offsets in [0, filled length - start)"
                )
        for b, (s, offsets) in enumerate(zip(starts, rows)):
            for i, off in enumerate(offsets):  # increasing: slot s + off moves down to s + i, never one still unread
                if off != i:
                    for store in (self.k, self.v):
                        store[sl, b, :, s + i].copy_(store[sl, b, :, s + off])  # [L', Hkv, hd]
            self.lengths[sl, b] = s + len(offsets)

    def _layers(self, layers: range | None) -> slice:
        """``layers`` (all when None) as a slice of whole layers, refused when it is not a range within the cache."""
        if layers is None:
            return slice(0, self.n_layers)
        if not isinstance(layers, range) or layers.step != 1 or not 0 <= layers.start <= layers.stop <= self.n_layers:
            raise CacheError(f"layers must be a range within [0, {self.n_layers}] with step 1, got {layers!r}")
        return slice(layers.start, layers.stop)
