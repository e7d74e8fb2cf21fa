"""Drafts replayed on recorded greedy text: the tokens a verification call would give, without the model.

``replay(sequences, make_index, draft_len)`` walks each ``(prompt_len, ids)`` greedy sequence as a
draft-and-verify loop would: at each round the index drafts up to ``draft_len`` tokens from what
precedes, the longest prefix that the greedy text agrees with is kept plus one token, and the index
learns them.  Since greedy verification keeps exactly that, the tokens per call are those a decode
would give (up to a decode's stops), at no model cost."""

from __future__ import annotations

from typing import Callable


def replay(sequences, make_index: Callable, draft_len: int) -> dict:
    """``{"calls", "tokens", "tokens_per_call", "drafted", "accepted"}`` over every sequence's answer."""
    calls = tokens = drafted = accepted = 0
    for prompt_len, ids in sequences:
        index = make_index(list(ids[:prompt_len]))
        t = prompt_len
        while t < len(ids):
            draft = index.draft(min(draft_len, len(ids) - t - 1)) if t + 1 < len(ids) else []
            a = 0
            while a < len(draft) and draft[a] == ids[t + a]:
                a += 1
            index.extend(ids[t : t + a + 1])
            t, calls, tokens = t + a + 1, calls + 1, tokens + a + 1
            drafted, accepted = drafted + len(draft), accepted + a
    return {
        "calls": calls,
        "tokens": tokens,
        "tokens_per_call": tokens / calls if calls else 0.0,
        "drafted": drafted,
        "accepted": accepted,
    }
