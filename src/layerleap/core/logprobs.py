"""Log probabilities of the generated tokens (``generate(..., logprobs=N)``).

They are the model's own: ``log_softmax`` of the logits the token was chosen from, before the penalties,
biases and token filters, temperature, top-k, top-p and a grammar's mask (vLLM's default, "raw" log
probabilities), taken where the token is chosen, at no model call of their own: ``Run.choose`` for plain
decoding (and for the methods that skip layers, whose logits are those of the layers they ran), and the
verifying call's row that predicted each kept token for the draft-and-verify methods (a draft is scored by the
target's row at its parent).  So a lossless method's log probabilities are greedy's, within float rounding.

Each token gets its own log probability and, with ``N`` > 0, the ``N`` likeliest tokens at its position
(``MAX_TOP``: OpenAI's bound), likeliest first (equal ones by id, lowest first: greedy's pick leads).

A prompt's own tokens are scored the same way from the hidden states of its prompt pass (``scores``:
``layerleap.score``, the server's ``echo`` and ``prompt_logprobs``), each with its rank too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

MAX_TOP = 20  # the most alternatives a token reports (OpenAI's top_logprobs bound)
SCORE_ROWS = 256  # prompt positions unembedded at once when scoring (a [256, V] fp32 block, not [T, V])

Raw = tuple[int, float, tuple[tuple[int, float], ...]]  # (token, its log probability, ((id, log probability), ...))


@dataclass(frozen=True)
class TopLogprob:
    """One of the likeliest tokens at a position."""

    token: int
    text: str
    logprob: float

    def to_dict(self) -> dict:
        return {"token": self.token, "text": self.text, "logprob": self.logprob}


@dataclass(frozen=True)
class TokenLogprob:
    """A token, its text, its log probability and the likeliest tokens at its position; a scored prompt's
    token has its ``rank`` too (1: the likeliest there), a generated one None."""

    token: int
    text: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()
    rank: int | None = None

    def to_dict(self) -> dict:
        out = {
            "token": self.token,
            "text": self.text,
            "logprob": self.logprob,
            "top": [t.to_dict() for t in self.top],
        }
        return out if self.rank is None else out | {"rank": self.rank}


def capture(logits: torch.Tensor, tokens: list[int], top: int) -> list[Raw]:
    """``logits`` ``[n, V]`` (each row the one that chose the token of ``tokens`` at the same index) -> one
    ``Raw`` per token: its log probability and the ``top`` likeliest (id, log probability)."""
    if not tokens:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)  # [n, V]
    chosen, tops = _pick(lp, tokens, top)
    return [(int(t), float(c), tp) for t, c, tp in zip(tokens, chosen.squeeze(1).tolist(), tops)]


def _pick(lp: torch.Tensor, tokens: list[int], top: int) -> tuple[torch.Tensor, list[tuple]]:
    """Log probabilities ``lp`` ``[n, V]`` -> the tokens' own ``[n, 1]`` and each row's ``top`` likeliest
    ((id, log probability), ...), likeliest first."""
    chosen = lp.gather(1, torch.tensor(tokens, dtype=torch.long, device=lp.device).view(-1, 1))  # [n, 1]
    if top <= 0:
        return chosen, [()] * len(tokens)
    return chosen, _likeliest(lp, min(top, lp.shape[-1]))


def _likeliest(lp: torch.Tensor, top: int) -> list[tuple]:
    """Each row of ``lp`` ``[n, V]`` -> its ``top`` likeliest ((id, log probability), ...), likeliest first and
    equal ones by id, lowest first: the token greedy decoding picks among equals (``sampling.top_ids``) leads,
    and which of the equal ones at the last place are listed does not depend on ``topk``'s kernel."""
    vals, idx = lp.topk(min(top + 1, lp.shape[-1]), dim=-1)  # one more: is the last place shared?
    out = []
    for row, (i, v) in enumerate(zip(idx.tolist(), vals.tolist())):
        if len(v) > top and v[top] == v[top - 1]:  # all of the last one's equals, to list the lowest ids of
            (i,) = (lp[row] >= v[top - 1]).nonzero(as_tuple=True)
            i, v = i.tolist(), lp[row, i].tolist()
        out.append(tuple(sorted(zip(i, v), key=lambda e: (-e[1], e[0]))[:top]))
    return out


_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a byte-fallback token (core.text.BYTE_TOKEN; core.text imports core.run)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTES = _byte_decoder()


def token_text(tokenizer, token: int) -> str:
    """The text of one token ("" without a tokenizer)."""
    return "" if tokenizer is None else tokenizer.decode([token], skip_special_tokens=False)


def token_bytes(tokenizer, token: int, text: str | None = None) -> list[int]:
    """The UTF-8 bytes of one token: its text's (``text``, when known), or for a token that holds part of a
    character (its text a replacement character) the bytes of its byte-level piece (``Ġ``-style or
    ``<0xNN>``)."""
    text = token_text(tokenizer, token) if text is None else text
    if "\ufffd" not in text or tokenizer is None:
        return list(text.encode("utf-8"))
    piece = tokenizer.convert_ids_to_tokens(token)
    if isinstance(piece, str):
        m = _BYTE.fullmatch(piece)
        if m:
            return [int(m.group(1), 16)]
        if piece and all(c in _BYTES for c in piece):
            return [_BYTES[c] for c in piece]
    return list(text.encode("utf-8"))


def typed(raw: list[Raw], tokenizer) -> list[TokenLogprob]:
    """``Raw`` entries with their tokens' text."""
    texts: dict[int, str] = {}

    def text(t: int) -> str:
        if t not in texts:
            texts[t] = token_text(tokenizer, t)
        return texts[t]

    return [TokenLogprob(t, text(t), lp, tuple(TopLogprob(i, text(i), v) for i, v in top)) for t, lp, top in raw]


def scores(
    logits, h: torch.Tensor, tokens: list[int], top: int, tokenizer, rows: int = SCORE_ROWS
) -> list[TokenLogprob]:
    """The log probability of each of ``tokens`` under the hidden states ``h`` ``[n, D]`` (row ``k`` the state
    of the position before ``tokens[k]``), ``logits(h)`` unembedding a ``[1, m, D]`` block: each token's
    ``TokenLogprob`` with its rank (1 + the tokens likelier there) and the ``top`` likeliest.  ``rows``
    positions at a time, so a long prompt never holds its ``[n, V]`` logits at once."""
    raw: list[tuple[int, float, int, tuple]] = []
    for at in range(0, len(tokens), rows):
        lp = torch.log_softmax(logits(h[at : at + rows].unsqueeze(0))[0].float(), dim=-1)  # [m, V]
        part = tokens[at : at + rows]
        chosen, tops = _pick(lp, part, top)  # [m, 1]
        ranks = (lp > chosen).sum(dim=-1).add(1).tolist()
        raw += [(int(t), float(c), int(r), tp) for t, c, r, tp in zip(part, chosen.squeeze(1).tolist(), ranks, tops)]
    return [
        TokenLogprob(e.token, e.text, e.logprob, e.top, rank)
        for e, rank in zip(typed([(t, c, tp) for t, c, _, tp in raw], tokenizer), (r for _, _, r, _ in raw))
    ]
