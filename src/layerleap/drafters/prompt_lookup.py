"""Prompt lookup (Saxena 2023; `transformers`' ``prompt_lookup_num_tokens``): drafts that need no
draft model and no training.

The last ``n`` tokens (``n`` from ``max_ngram`` down to ``min_ngram``) are looked up in the prompt
and the output so far (``NgramIndex``); the tokens that followed their latest earlier occurrence are
the draft, up to ``draft_len`` of them.  A copy is a deterministic, one-hot proposal.  Each row of a
batch keeps its own index; one call scores every row's chain.  With a ``Corpus`` (``CorpusIndex``,
REST's datastore of the model's own answers), a row whose prompt and output hold no match drafts
from the corpus instead."""

from __future__ import annotations

from ..core.run import Run
from ..core.stats import LookupStats
from ..core.tree import Candidates
from .base import Drafter
from .corpus import Corpus
from .lengths import LengthChooser, curve_for


class NgramIndex:
    """The latest start of every n-gram (``min_n <= n <= max_n``) of a growing token sequence that
    some token follows: n-grams ending at the last token are indexed once the next one arrives, so a
    lookup of the current suffix finds an earlier occurrence, never the suffix itself."""

    def __init__(self, tokens: list[int], min_n: int, max_n: int):
        self.tokens: list[int] = []
        self.min_n, self.max_n = min_n, max_n
        self.latest: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        seq = self.tokens
        for t in tokens:
            end = len(seq)  # index the n-grams ending at the current last token: t follows them
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.latest[tuple(seq[end - n : end])] = end - n
            seq.append(int(t))

    def draft(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest matching
        suffix (longest n first); [] when no suffix occurred before."""
        seq, end = self.tokens, len(self.tokens)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            start = self.latest.get(tuple(seq[end - n :]))
            if start is not None:
                return seq[start + n : start + n + k]
        return []


class CorpusIndex(NgramIndex):
    """An ``NgramIndex`` that, where the sequence holds no earlier occurrence of its suffix, drafts up
    to ``most`` tokens from a ``Corpus`` (REST's datastore) with the same n-gram bounds; ``from_corpus``
    counts those drafts."""

    def __init__(self, tokens: list[int], min_n: int, max_n: int, corpus: Corpus, most: int | None = None):
        self.corpus, self.most = corpus, most
        self.from_corpus = 0
        super().__init__(tokens, min_n, max_n)

    def draft(self, k: int) -> list[int]:
        chain = super().draft(k)
        if chain or k < 1:
            return chain
        chain = self.corpus.draft(self.tokens, k if self.most is None else min(k, self.most), self.min_n, self.max_n)
        self.from_corpus += bool(chain)
        return chain


def lookup_stats(counts, index: list[NgramIndex]) -> list[LookupStats]:
    """Per row: the rounds that found a draft and, where the row's index has a corpus, those drafted
    from it."""
    return [LookupStats(c.proposed, getattr(ix, "from_corpus", None)) for c, ix in zip(counts, index)]


def lookup_index(
    tokens: list[int], min_n: int, max_n: int, corpus: Corpus | None = None, most: int | None = None
) -> NgramIndex:
    """Prompt lookup's index of ``tokens``, drafting up to ``most`` tokens from ``corpus`` too where one
    is given."""
    return NgramIndex(tokens, min_n, max_n) if corpus is None else CorpusIndex(tokens, min_n, max_n, corpus, most)


class PromptLookup(Drafter):
    batched = True
    grammar_drafts = True  # under a grammar: the allowed part of the copy, then the forced tokens

    def __init__(
        self,
        run: Run,
        draft_len: int,
        min_ngram: int,
        max_ngram: int,
        adaptive: bool = False,
        corpus: Corpus | None = None,
        corpus_len: int | None = None,
    ):
        self.draft_len = draft_len
        super().__init__(run)
        self.index = [lookup_index(p, min_ngram, max_ngram, corpus, corpus_len) for p in run.prompts]
        self.lengths = LengthChooser(run.batch, curve_for(run.model), draft_len) if adaptive else None

    def round_tokens(self) -> int:
        return self.draft_len + 1  # the root and the draft

    def propose_row(self, row: int, root: int | None, budget: int) -> Candidates:
        chain = self.index[row].draft(min(self.draft_len, budget))
        return Candidates.chain(root, self.lengths.cut(row, chain) if self.lengths else chain)

    def update(self, cands, results) -> None:
        super().update(cands, results)
        for row, (ix, c, r) in enumerate(zip(self.index, cands, results)):
            if c is not None:
                drafts = c.tokens.tolist()
                ix.extend([drafts[j] for j in r[0]] + [r[1]])
                if self.lengths and c.root is not None:
                    self.lengths.observe(row, c.k, len(r[0]), r[1])
