"""A reduced draft vocabulary (FR-Spec, Zhao et al. 2025; EAGLE-3's draft vocabulary): drafters score
only the ``K`` tokens the model itself emits most often, not the whole vocabulary.

Every drafter here ends in the model's unembedding: a ``[V, D]`` product per drafted position
(49,152 x 576 on SmolLM2-135M, about a fifth of a whole decode step).  With a draft vocabulary the
draft logits are ``z @ W[ids].T`` over the ``K`` ids only (``DraftVocab.logits``) and a draft's index
maps back through ``ids`` (``DraftVocab.token``).  Verification is untouched (the target's logits
over the full vocabulary), so every exact method stays exact: a token outside the set is simply
never drafted.  Under sampling a step drafter's distribution is the subset's softmax with zero mass
elsewhere (``VocabHead``), which is the distribution the drafts are drawn from: still lossless.

A draft-vocabulary file is a safetensors file holding ``ids`` (int64 ``[K]``, most frequent first)
and metadata: ``format`` (``layerleap-draft-vocab-1``), ``fingerprint`` and ``model`` (the model it
was counted for; another model is refused), ``size`` (K), ``data`` (what was counted), ``tokens``
(tokens counted), ``coverage`` (share of the counted tokens inside the set), ``command``.  ``layerleap
eval draft-vocab`` measures coverage and cost per K and writes one; the shipped copies live in
``layerleap/data/draft_vocab/`` and are found by fingerprint (``get_draft_vocab(model, "auto")``).

The methods' option ``draft_vocab``: ``"auto"`` (the shipped set for this model, or the full
vocabulary where none ships), ``"full"`` (off), or a draft-vocabulary file.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from .. import validate as V
from ..core import kernels
from ..core.cpu import released
from ..core.model import Transformer
from ..errors import LayerleapError
from ..files import read_made_for, save_safetensors
from ..loaded import per_model, shipped_or_file
from .exit_heads import ExitHead

FORMAT = "layerleap-draft-vocab-1"
SHIPPED_DIR = Path(__file__).parent.parent / "data" / "draft_vocab"
CHOICES = ("auto", "full")  # besides a file
COMMAND = "layerleap eval draft-vocab"


class DraftVocabError(LayerleapError, ValueError):
    """A draft vocabulary that cannot be made or loaded: the message names the problem and the fix."""


class DraftRows:
    """A ``K x D`` unembedding (rows of an LM head) for drafts: ``x`` ``[.., D]`` -> ``[.., K]``.  Where
    ``kernels.draft_head_q8`` measured it fastest, the rows are kept as 8-bit blocks for the native
    kernel (drafts only propose: the rounding changes no exact method's output).  Otherwise up to
    ``kernels.draft_head_rows`` rows are multiplied one at a time by the column-major weight, more at
    once in oneDNN's packed layout (on a CPU where oneDNN serves; on an accelerator one dense product
    over every row), whichever this CPU runs faster, so one draft row costs about ``K / V`` of the full
    product, or less."""

    def __init__(self, weight: torch.Tensor):
        w = weight.detach().contiguous()
        self.dtype = w.dtype
        self.q8 = kernels.BlockWeight.from_int8(kernels.quantize_q8(w)) if kernels.draft_head_q8(w) else None
        self.row_by_row = 0 if self.q8 is not None else kernels.draft_head_rows(w)
        cpu = w.device.type == "cpu"
        self.column_major = None if self.q8 is not None else w.t().contiguous().t() if cpu else w  # [K, D] as [D, K]
        dense = cpu and kernels.ONEDNN and self.q8 is None and self.row_by_row < 1 << 30
        self.packed = kernels.OneDNNWeight(w) if dense else None

    @classmethod
    def of_head(cls, model: Transformer, ids: torch.Tensor) -> "DraftRows":
        """The rows ``ids`` of ``model``'s LM head.  A head held as 8-bit blocks (q4's) gives its own
        blocks of those rows where 8-bit rows are this CPU's fastest (``kernels.draft_head_q8``, asked
        with a stand-in of their shape: the answer depends on nothing else), so no dense copy of the
        rows is made; otherwise the rows dequantized, as ``DraftRows(model.head_rows(ids))``."""
        packed = model.lm_head.packed
        if isinstance(packed, kernels.BlockWeight) and packed.bits == 8:
            shape_of = torch.zeros(1, packed.in_features).expand(len(ids), -1)  # fp32 as head_rows gives; no memory
            if kernels.draft_head_q8(shape_of):
                return cls._of_blocks(packed.take_rows(ids), torch.float32)
        return cls(model.head_rows(ids))

    @classmethod
    def _of_blocks(cls, q8: kernels.BlockWeight, dtype: torch.dtype) -> "DraftRows":
        """Rows held as the 8-bit blocks ``q8`` alone (``dtype``: what their products are cast to)."""
        out = object.__new__(cls)
        out.dtype, out.row_by_row, out.column_major, out.packed, out.q8 = dtype, 0, None, None, q8
        return out

    def first(self, n: int) -> "DraftRows | None":
        """The first ``n`` rows on their own, sharing these rows' 8-bit blocks (no copy, nothing measured
        again), or None where they are not held as 8-bit blocks or ``n`` cuts a block of rows."""
        if self.q8 is None or n % kernels.BLOCK_ROWS or not 0 < n <= self.q8.out_features:
            return None
        q8, nb = self.q8, n // kernels.BLOCK_ROWS
        return self._of_blocks(kernels.BlockWeight(q8.codes[:nb], q8.dm[:nb], n, q8.bits, fine=q8.fine), self.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [n, D]
        n = rows.shape[0]
        if self.q8 is not None:
            out = self.q8.matmul(rows.float()).to(x.dtype)
        elif self.packed is not None and n > self.row_by_row:
            out = self.packed(rows)
        elif 1 < n <= self.row_by_row:
            out = torch.cat([F.linear(rows[i : i + 1], self.column_major) for i in range(n)])
        else:
            out = F.linear(rows, self.column_major)
        return out.reshape(*x.shape[:-1], -1)


class DraftVocab:
    """The ``K`` token ids ``ids`` drafters score, and ``head``, the unembedding rows ``[K, D]`` they
    multiply by (the model's LM head rows in the layout ``DraftRows`` measured fastest here: a q4
    head's own 8-bit blocks of those rows, or the rows dense)."""

    def __init__(self, model: Transformer, ids, meta: dict | None = None, head: DraftRows | None = None):
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        V = model.config.vocab_size
        if len(ids) == 0 or int(ids.min()) < 0 or int(ids.max()) >= V or len(torch.unique(ids)) != len(ids):
            raise DraftVocabError(f"a draft vocabulary must be distinct token ids in [0, {V}), got {len(ids)} ids")
        self.model = model
        self.ids = ids.to(model.device)  # [K]
        self.head = DraftRows.of_head(model, self.ids) if head is None else head  # [K, D]
        self.meta = dict(meta or {})
        self._id_list: list[int] | None = None  # ids as ints, once asked for (``tokens``)
        self._firsts: dict[int, DraftVocab] = {}  # ``first``'s, by size

    @property
    def size(self) -> int:
        return len(self.ids)

    def first(self, size: int) -> "DraftVocab":
        """The draft vocabulary of the first ``size`` ids (a file's ids are most frequent first), made once
        (its rows this one's first where they are 8-bit blocks, ``DraftRows.first``); this one where it
        holds no more."""
        if size >= self.size:
            return self
        if size not in self._firsts:
            meta = {**self.meta, "size": str(size)}
            self._firsts[size] = DraftVocab(self.model, self.ids[:size], meta, self.head.first(size))
        return self._firsts[size]

    def logits(self, z: torch.Tensor) -> torch.Tensor:
        """Normalised last-layer states ``z`` ``[.., D]`` -> fp32 logits ``[.., K]`` over the ids."""
        return self.head(z.to(self.head.dtype)).float()

    def token(self, index: torch.Tensor) -> torch.Tensor:
        """Indices into the ids (any shape) -> token ids of the full vocabulary."""
        return self.ids.to(index.device)[index]

    def tokens(self, index: list[int]) -> list[int]:
        """``token`` for a list of indices, as ints."""
        if self._id_list is None:
            self._id_list = self.ids.tolist()
        return [self._id_list[i] for i in index]

    def scatter(self, sub: torch.Tensor) -> torch.Tensor:
        """``[.., K]`` logits -> ``[.., V]`` with -inf outside the ids."""
        out = sub.new_full((*sub.shape[:-1], self.model.config.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.ids.to(sub.device), sub)


class VocabHead:
    """An exit head restricted to a draft vocabulary: ``h [B, S, D]`` -> logits ``[B, S, V]``, the
    head's own over the ids and -inf elsewhere.  The head's trained parts are used as they are; only
    its last product shrinks to ``K x D``."""

    def __init__(self, head: ExitHead, vocab: DraftVocab):
        self.head, self.vocab = head, vocab
        own = head.own_unembedding()  # None: the model's, whose rows the vocabulary holds already
        self.rows = vocab.head if own is None else DraftRows(own.detach()[vocab.ids])  # K x D
        self.layer, self.kind, self.dtype = head.layer, head.kind, self.rows.dtype

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        z = self.head.normed(h)
        return self.vocab.scatter(self.rows(z.to(self.dtype)).float())


def with_draft_vocab(head, vocab: DraftVocab | None):
    """``head`` restricted to ``vocab`` (an ``ExitHead`` not already cut to a sub-vocabulary), else as is."""
    if vocab is None or not isinstance(head, ExitHead) or head.vocab is not None:
        return head
    return VocabHead(head, vocab)


# -- counting -------------------------------------------------------------------------------------
def rank_tokens(token_lists, vocab_size: int, then=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order [V], counts [V])``: every id, most frequent in ``token_lists`` first; ties (the ids
    never seen among them) by their count in ``then`` (other token lists, e.g. text), then by id."""
    counts = _counts(token_lists, vocab_size)
    second = _counts(then or [], vocab_size)
    score = counts.double() * (float(second.max()) + 1) + second.double()
    return torch.argsort(-score, stable=True), counts


def _counts(token_lists, vocab_size: int) -> torch.Tensor:
    flat = torch.tensor([t for ts in token_lists for t in ts], dtype=torch.long)
    return torch.bincount(flat, minlength=vocab_size)[:vocab_size]


def coverage(ids: torch.Tensor, token_lists) -> float:
    """The share of the tokens in ``token_lists`` that lie in ``ids``."""
    flat = torch.tensor([t for ts in token_lists for t in ts], dtype=torch.long)
    if len(flat) == 0:
        return 0.0
    return float(torch.isin(flat, ids.cpu()).float().mean())


# -- files ----------------------------------------------------------------------------------------
def save(path, model: Transformer, ids: torch.Tensor, meta: dict) -> Path:
    """Write a draft-vocabulary file atomically (``meta``: data, tokens, coverage, command, ...)."""
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
    DraftVocab(model, ids)  # checks the ids
    full = {
        **{k: v for k, v in meta.items() if v is not None},
        "format": FORMAT,
        "kind": "draft-vocab",
        "fingerprint": model.fingerprint,
        "model": model.config.name,
        "size": str(len(ids)),
    }
    return save_safetensors(path, {"ids": ids}, full)


def read(model: Transformer, path) -> DraftVocab:
    """A draft vocabulary from a file written by ``save``; refuses a foreign file or another model."""
    what = "draft-vocabulary"
    ids, meta = read_made_for(path, FORMAT, "ids", model.fingerprint, what, COMMAND, DraftVocabError)
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex() or ids.dim() != 1:
        raise DraftVocabError(
            f"{path} holds ids of dtype {str(ids.dtype).removeprefix('torch.')} and shape {list(ids.shape)}, "
            f"not a list of integer token ids: write it again with `{COMMAND}`"
        )
    try:
        return DraftVocab(model, ids, meta)
    except DraftVocabError as e:
        raise DraftVocabError(f"{path}: {e}: write it again with `{COMMAND}`") from None


def load(model: Transformer, path) -> DraftVocab:
    """``read`` once per model and file."""
    return per_model(model, "draft vocab", path, lambda: released(read(model, path)))


def get_draft_vocab(model: Transformer, spec="auto") -> DraftVocab | None:
    """The ``draft_vocab`` option: "auto" (the shipped set for this model, None where none ships),
    "full" (None: the whole vocabulary), a draft-vocabulary file, or a ``DraftVocab`` of this model."""
    if isinstance(spec, DraftVocab):
        if spec.model is not model:
            raise DraftVocabError("the given draft vocabulary is for another model: make one for this model")
        return spec
    return shipped_or_file(
        model,
        spec,
        "full",
        SHIPPED_DIR,
        load,
        lambda: DraftVocabError(
            f"draft_vocab must be 'auto', 'full', a draft-vocabulary file or a DraftVocab, got {V.show(spec)}"
        ),
    )
