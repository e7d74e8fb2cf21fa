"""The decoding API: ``generate`` and ``Decoding`` (the same call driven step by step).

Everything around a method is done here once for all methods: validation, tokenisation, batching,
statistics, timing, decoding text.  The method registry, the per-call ``Run`` context and the round
driver live in ``layerleap.core.run``; importing this module registers the built-in methods
(``layerleap.methods``), so ``METHODS`` (re-exported here) lists them all.
"""

from __future__ import annotations

import numbers
import os
import time
import warnings

import numpy as np
import torch

from . import methods  # noqa: F401  (registers the built-in methods)
from . import validate as V
from .core.cpu import release_freed_memory
from .core.model import Transformer
from .methods import budget
from .core.grammar import Grammar
from .core.logprobs import MAX_TOP, TokenLogprob, scores, typed
from .core.processors import NEUTRAL as PROCESSORS_NEUTRAL
from .core.prompt_cache import PromptCache
from .core.prompt_cache import check as check_prompt_cache
from .core.stats import RECORD_FIELDS, BudgetStats, Stats
from .core.text import StopText, TextPieces, check_stops, hold_off, tokens_through
from .core.run import (
    METHODS,
    GenerationConfig,
    GenerationError,
    LONG_PROMPT_PASS,
    GenerationResult,
    Method,
    Run,
    UnknownMethod,
    chat_token_ids,
    drive,
    register,
    rounds,
)

__all__ = [
    "generate",
    "score",
    "Grammar",
    "Decoding",
    "get_method",
    "METHODS",
    "GenerationConfig",
    "GenerationError",
    "GenerationResult",
    "Method",
    "Run",
    "Stats",
    "UnknownMethod",
    "chat_token_ids",
    "drive",
    "register",
    "rounds",
]


def get_method(name: str) -> Method:
    """The registered method ``name``, or an ``UnknownMethod`` (a ``GenerationError`` and ``KeyError``)
    naming the known ones."""
    if not isinstance(name, str):
        known = ", ".join(sorted(METHODS))
        raise UnknownMethod(f"a method is named by text, got {V.show(name)}: choose one of {known}")
    return METHODS[name]


GENERATE_ARGS = (
    "max_new_tokens", "temperature", "top_k", "top_p", "min_p", "typical_p", "seed", "do_sample", "stop_at_eos",
    "stop", "stop_token_ids", "chat", "quality", "grammar", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "logit_bias", "min_tokens", "allowed_token_ids", "bad_words", "no_repeat_ngram_size",
    "prompt_cache",
)  # fmt: skip
HF_ARGS = {  # `transformers` generate arguments and what says the same here
    "max_length": "max_new_tokens= (the new tokens, the prompt not counted)",
    "input_ids": "the token ids as the prompt: generate(model, ids, ...)",
    "attention_mask": "a list of prompts (each row is padded and masked for you)",
    "streamer": "layerleap.stream(model, prompt, ...) for the text as it comes",
    "num_return_sequences": "a list that repeats the prompt, with do_sample=True and a seed (row i samples seed + i)",
    "generation_config": "its fields as keyword arguments (max_new_tokens=..., temperature=...)",
    "eos_token_id": (
        "stop_token_ids= for more tokens that end the output (it ends before them: they are not kept), and "
        "stop_at_eos=False to go past the model's end-of-sequence tokens"
    ),
    "stop_strings": "stop= (a string or a list of strings; the text ends before the first one found)",
    "min_new_tokens": "min_tokens= (the end-of-sequence tokens are forbidden until the output holds that many)",
    "min_length": "min_tokens= (the new tokens, the prompt not counted)",
    "pad_token_id": "a list of prompts (each row is padded and masked for you)",
    "bos_token_id": "the prompt as token ids, with the BOS where you want one",
    "suppress_tokens": "bad_words=[[token id], ...] (a one-token word is never chosen)",
    "bad_words_ids": "bad_words= (a list of words, each text or a list of token ids)",
    "output_scores": "logprobs= (the chosen tokens' log probabilities and that many likeliest: result.logprobs)",
    "output_logits": "logprobs= (the chosen tokens' log probabilities and that many likeliest: result.logprobs)",
    "return_dict_in_generate": "the result's fields (text, token_ids, logprobs, finish_reason, stats)",
}


def _unknown_names(m: Method, options: dict) -> None:
    """Refuse an argument that is neither ``generate``'s nor the method's with what to write instead:
    ``transformers``' name for it, or the nearest name (a typo)."""
    import difflib

    known = [o.name for o in m.declared]
    for name in options:
        if name in known:
            continue
        if name in HF_ARGS:
            raise GenerationError(f"generate has no argument {name} (a transformers argument): use {HF_ARGS[name]}")
        near = difflib.get_close_matches(str(name), [*GENERATE_ARGS, *known], n=1, cutoff=0.75)
        if near:
            raise GenerationError(
                f"generate has no argument {name}, nor has method {m.name!r} that option: did you mean {near[0]}?"
            )


SAMPLING_ARGS = ("temperature", "top_k", "top_p", "min_p", "typical_p", "seed")
# values that change no distribution: they ask for nothing
NEUTRAL = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0}
PROCESSOR_ARGS = tuple(PROCESSORS_NEUTRAL)  # the logits processors over each row's history (``core.processors``)


def sampling_choice(m: Method, do_sample: bool | None, given: dict) -> bool:
    """Whether ``m`` samples.  ``do_sample`` decides when given; without it, a method samples when it
    samples by default or when any sampling argument is given (``given``: name -> value, those not None),
    as ``temperature=0.7`` alone means sampling.  A sampling argument a call would ignore is refused:
    given to a method that decodes greedily only, or a warp (temperature, top_k, top_p) with
    ``do_sample=False``; a seed with ``do_sample=False`` is allowed (it changes nothing), so that one
    set of arguments serves both choices.  (``min_p`` and ``typical_p`` are warps.)"""
    if do_sample is None:
        if given and not m.sampling:
            names = ", ".join(given)
            raise GenerationError(
                f"method {m.name!r} decodes greedily and would ignore {names}: use method 'sample' to sample "
                f"(--method sample), a sampling method ({', '.join(n for n, x in METHODS.items() if x.sampling)}), "
                f"or leave {names} out"
            )
        return m.default_sample or bool(given)
    warps = [k for k in given if k != "seed"]
    if not do_sample and warps:
        names = ", ".join(warps)
        raise GenerationError(f"do_sample=False decodes greedily and would ignore {names}: leave them out or sample")
    _check(not do_sample or m.sampling, f"method {m.name!r} decodes greedily only: drop do_sample=True (--do-sample)")
    return do_sample


# -- the public entry point --------------------------------------------------------------------
PROMPT_FORMS = (
    "a prompt is text (str), a list of token ids, a 1-D integer tensor or array, or a conversation (a list of "
    "messages, {'role': ..., 'content': ...}); a batch is a list of those or a 2-D integer tensor or array"
)


def _is_id(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _from_array(prompt):
    """A numpy array of token ids as a tensor (other values as they are)."""
    if isinstance(prompt, np.ndarray):
        if prompt.dtype.kind not in "iub":
            raise GenerationError(
                f"an array prompt must hold integer token ids, got dtype {prompt.dtype}: {PROMPT_FORMS}"
            )
        return torch.as_tensor(prompt)
    return prompt


def _encode_row(model: Transformer, prompts: list, i: int, chat: bool) -> list[int]:
    """Prompt ``i``'s token ids; in a batch, a refusal names which prompt it is."""
    try:
        return _encode(model, prompts[i], chat)
    except GenerationError as e:
        if len(prompts) == 1:
            raise
        raise GenerationError(f"prompt {i} of the batch: {e}") from None


def _is_conversation(prompt) -> bool:
    """Whether ``prompt`` is a list of messages (dicts), one conversation."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and any(isinstance(m, dict) for m in prompt)


def _no_template(tok, what: str) -> GenerationError | None:
    if tok is None:
        return GenerationError(
            f"this model has no tokenizer (its folder has no tokenizer files, or from_hf was given none): {what} "
            "needs one with a chat template: add the tokenizer files, or pass token ids"
        )
    if not getattr(tok, "chat_template", None):
        return GenerationError(f"this tokenizer has no chat template: {what} needs one; give the text as a prompt")
    return None


def _encode_conversation(model: Transformer, messages) -> list[int]:
    """A list of messages (``[{"role": "user", "content": "hi"}, ...]``) as token ids under the chat template,
    with the assistant's turn opened after them."""
    for k, m in enumerate(messages):
        if not isinstance(m, dict):
            raise GenerationError(
                f"a conversation is a list of messages (dicts with 'role' and 'content'); item {k} is "
                f"{V.show(m)}: make every item a message, or give a list of conversations for a batch"
            )
        for key in ("role", "content"):
            if key not in m:
                raise GenerationError(
                    f"message {k} has no {key!r}: a message is {{'role': 'user', 'content': 'text'}} "
                    f"(it has {', '.join(map(repr, m)) or 'no keys'})"
                )
            if not isinstance(m[key], str):
                raise GenerationError(f"message {k}'s {key} must be text (str), got {V.show(m[key])}")
            with V.raising(GenerationError):
                V.text(m[key], f"message {k}'s {key}")
        if not m["role"].strip():
            raise GenerationError(f"message {k}'s role is empty: name it ('system', 'user', 'assistant')")
    error = _no_template(model.tokenizer, "a conversation (a list of messages)")
    if error is not None:
        raise error
    return chat_token_ids(model.tokenizer, [dict(m) for m in messages], add_generation_prompt=True)


def _encode(model: Transformer, prompt, chat: bool) -> list[int]:
    prompt = _from_array(prompt)  # a row of a list of arrays
    if _is_conversation(prompt):
        return _encode_conversation(model, prompt)
    if isinstance(prompt, (bytes, bytearray)):
        raise GenerationError("the prompt is bytes: decode it to text first (prompt.decode('utf-8'))")
    if isinstance(prompt, str):
        V.text(prompt, "the prompt")
        if not prompt.strip():
            raise GenerationError("the prompt is empty: give some text to continue")
        tok = model.tokenizer
        if tok is None:
            raise GenerationError(
                "this model has no tokenizer (its folder has no tokenizer files, or from_hf was given none): pass "
                "token ids instead of text, add the tokenizer files, or give from_hf the tokenizer "
                "(layerleap.from_hf(hf_model, tokenizer))"
            )
        if chat:
            if not getattr(tok, "chat_template", None):
                raise GenerationError(
                    "this tokenizer has no chat template: decode the prompt as it is, without chat=True (--chat)"
                )
            ids = chat_token_ids(tok, [{"role": "user", "content": prompt}], add_generation_prompt=True)
        else:
            ids = tok(prompt)["input_ids"]
        return [int(i) for i in ids]
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool:
            raise GenerationError(
                f"a tensor prompt must be 1-D integer token ids, got a {prompt.dim()}-D "
                f"{str(prompt.dtype).removeprefix('torch.')} tensor: {PROMPT_FORMS}"
            )
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)) or not all(_is_id(i) for i in prompt):
        raise GenerationError(f"cannot read the prompt {V.show(prompt)}: {PROMPT_FORMS}")
    if chat:
        raise GenerationError(
            "chat=True wraps text in the chat template; token ids are used as given: drop chat=True or pass text"
        )
    ids = [int(i) for i in prompt]
    if not ids:
        raise GenerationError("the prompt is empty: give at least one token")
    bad = [i for i in ids if not 0 <= i < model.config.vocab_size]
    if bad:
        raise GenerationError(f"token ids {bad[:5]} are outside the vocabulary [0, {model.config.vocab_size})")
    return ids


MAX_BATCH = 4096  # prompts in one call


def _split_prompts(prompt) -> tuple[list, bool]:
    """-> (list of single prompts, whether a list was given)."""
    prompt = _from_array(prompt)  # token ids
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() == 2:
            if not prompt.shape[0]:
                raise GenerationError("the prompt tensor has no rows: give at least one prompt")
            V.at_most(prompt.shape[0], MAX_BATCH, "the batch", "split the prompts into several calls")
            return [prompt[i] for i in range(prompt.shape[0])], True
        if prompt.dim() != 1:
            raise GenerationError(
                f"a tensor prompt is 1-D (one prompt) or 2-D (a batch), got {prompt.dim()}-D: {PROMPT_FORMS}"
            )
        return [prompt], False
    if isinstance(prompt, (list, tuple)):
        if not prompt:
            raise GenerationError("the prompt list is empty: give at least one prompt or token")
        if all(_is_id(p) for p in prompt):
            return [list(prompt)], False
        if _is_conversation(prompt):  # one conversation (a list of conversations is a batch)
            return [list(prompt)], False
        V.at_most(len(prompt), MAX_BATCH, "the batch", "split the prompts into several calls")
        return list(prompt), True
    return [prompt], False


def batched_methods() -> list[str]:
    return [name for name, m in METHODS.items() if m.batched]


def one_at_a_time(method: str, n: int) -> str:
    """The refusal of a list of ``n`` prompts by a method that decodes one prompt at a time."""
    return (
        f"method {method!r} decodes one prompt at a time and was given {n}: call it once per prompt, or use a "
        f"method that batches ({', '.join(batched_methods())})"
    )


def _check(cond: bool, msg: str):
    if not cond:
        raise GenerationError(msg)


def generate(
    model: Transformer,
    prompt,
    method: str = "greedy",
    max_new_tokens: int = 64,
    *,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    typical_p: float | None = None,
    seed: int | None = None,
    do_sample: bool | None = None,
    stop_at_eos: bool = True,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    chat: bool = False,
    quality: float | None = None,
    grammar: Grammar | None = None,
    logprobs: int | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    logit_bias: dict[int, float] | None = None,
    min_tokens: int | None = None,
    allowed_token_ids: list[int] | None = None,
    bad_words: list[str | list[int]] | None = None,
    no_repeat_ngram_size: int | None = None,
    prompt_cache: PromptCache | None = None,
    **options,
):
    """Generate with ``method``; one prompt gives a ``GenerationResult``, a list gives a list.

    ``prompt`` is text, token ids (a list, a 1-D integer tensor or numpy array), a conversation (a list
    of messages, ``{"role": "user", "content": "hi"}``, always rendered with the chat template: ``chat``
    applies to text), or a list of those (or a 2-D integer tensor or array: one prompt a row).  A list
    decodes as one batch; a
    method that does not batch (``METHODS[name].batched`` is False) takes a list of one prompt only
    and refuses more with a ``GenerationError``.  Method options are keyword arguments (see
    ``layerleap.METHODS[name].options()``), checked by their declarations (``core.options``).

    ``do_sample``: None follows the method (``sample`` samples) unless ``temperature``, ``top_k``,
    ``top_p`` or ``seed`` is given, which makes a method that can sample sample and is refused by one
    that decodes greedily only (``sampling_choice``); nothing given is ignored, except a seed with
    ``do_sample=False`` (greedy decoding draws nothing).  A value that
    changes no distribution (temperature 1.0, top_k 0, top_p 1.0: the defaults) asks for nothing.

    ``stop``: a string or a list of at most ``core.text.MAX_STOPS`` (OpenAI's ``stop``, `transformers`'
    ``stop_strings``): a row ends as soon as its text holds one, its text before it (the stop string is
    not returned), its tokens through the one that completes it (``core.text``), finish_reason "stop"
    and ``stats.stop_string`` the string found.  ``stop_token_ids`` (a list of token ids, vLLM's): a row
    that chooses one ends before it (the token is not kept), finish_reason "stop", whatever ``stop_at_eos``;
    ``min_tokens`` holds them off as it holds off the end-of-sequence tokens.  (`transformers`'
    ``eos_token_id`` replaces the model's end tokens and keeps the one found in the output: not the same.)

    ``quality`` (lossy methods: ``skipdecode``, ``calm``, ``early-exit``, ``bild``): the share of
    greedy's quality to keep, e.g. 0.95; the method runs the setting ``layerleap calibrate`` chose for
    that budget on this model and dtype (``layerleap.methods.budget``).  Without it, a lossy method
    given none of its knobs runs its calibrated setting at 0.95 where a calibration file exists.
    ``result.stats["quality_budget"]`` names the setting and the file.

    ``grammar`` (structured output, ``layerleap.Grammar``: ``Grammar.json(schema)``, ``.regex``,
    ``.choice``, ``.gbnf``): every token is chosen from those the grammar allows, and a row ends where
    the grammar does.  Methods with ``METHODS[name].grammar`` follow one; the lossless ones stay
    lossless (greedy output equal to constrained greedy decoding).

    ``logprobs`` (None: off; 0 to ``core.logprobs.MAX_TOP``): ``result.logprobs`` holds one
    ``TokenLogprob`` per token of ``token_ids``: the token, its text, its log probability and the
    ``logprobs`` likeliest tokens at its position (``top``).  They are the model's own (the log-softmax of
    the logits the token was chosen from, before the processors, temperature, top-k, top-p and a grammar's mask), taken
    where the token is chosen, at no extra model call (``bild`` with ``alpha_rb=inf`` excepted: the chain
    it would leave unscored at the output's end is scored): a lossless method's are greedy's (within float
    rounding); a draft-and-verify method's are the verifying model's; those of a method that skips layers
    (``skipdecode``, ``early-exit``, ``calm``) are of the logits it chose from, its layers' own.  The
    logits processors below do not change them.

    Logits processors (``core.processors``), greedy or sampled, with the semantics of `transformers`, OpenAI
    and vLLM: ``repetition_penalty`` (> 0; over the prompt's and the output's tokens: a positive logit is
    divided by it, another multiplied), ``presence_penalty`` and ``frequency_penalty`` (in [-2, 2]; over the
    output's tokens: subtracted once if the token occurs, once per occurrence), ``logit_bias`` (``{token id:
    bias}``, biases in [-100, 100], added to the logits), ``min_tokens`` (the end-of-sequence tokens are
    forbidden until the output holds that many, and a stop string that ends in the text of the tokens before
    them does not count), ``allowed_token_ids`` (a list of token ids: no other token
    is chosen), ``bad_words`` (a list of words, each text or its token ids; vLLM's rule: a word's tokens,
    as it is and with a leading space, are never completed in the output: the word's last token is forbidden
    where the output ends with the tokens before it; the prompt is not read) and ``no_repeat_ngram_size`` (an
    integer n >= 0, `transformers`' rule: no n-gram occurs twice in the prompt and output together: a token is
    forbidden where the last n - 1 tokens were once followed by it); filters that leave a row no token to
    choose (with a grammar's mask too) raise a ``GenerationError`` naming them.  ``min_p`` (in [0, 1]) is a
    sampling warp beside top-k and top-p: the tokens less likely than ``min_p`` times the likeliest one are
    dropped; ``typical_p`` (in (0, 1], `transformers`' and llama.cpp's typical sampling, after min-p) keeps the
    tokens whose surprisal is nearest the distribution's entropy until they hold that much of the probability.
    Methods with ``METHODS[name].grammar`` apply the processors, the lossless ones staying lossless
    (greedy output equal to greedy decoding with the same processors); the others refuse them.  The defaults
    ask for nothing.

    Sampling: row ``i`` of a batch draws from its own ``torch.Generator`` seeded with ``seed + i``
    (modulo ``2**32``), so it samples exactly what that prompt decoded alone with that seed samples,
    whatever its batch-mates -- except ``auto`` with more than one kind of call (its batch shares each
    round's kind, and a tree verifies without the lookup chain), where a row can draw other drafts than
    its prompt alone and so sample other tokens, from the same distribution.  Without a seed, one base
    seed is drawn from torch's global generator (so ``torch.manual_seed`` makes the call reproducible)
    and the same rule applies.
    """
    d = Decoding(
        model,
        prompt,
        method,
        max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        typical_p=typical_p,
        seed=seed,
        do_sample=do_sample,
        stop_at_eos=stop_at_eos,
        stop=stop,
        stop_token_ids=stop_token_ids,
        chat=chat,
        quality=quality,
        grammar=grammar,
        logprobs=logprobs,
        repetition_penalty=repetition_penalty,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        logit_bias=logit_bias,
        min_tokens=min_tokens,
        allowed_token_ids=allowed_token_ids,
        bad_words=bad_words,
        no_repeat_ngram_size=no_repeat_ngram_size,
        prompt_cache=prompt_cache,
        **options,
    )
    for _ in d:
        pass
    return d.results if d.many else d.results[0]


def score(model: Transformer, prompt, top: int = 0, *, chat: bool = False):
    """The log probability of each token of ``prompt`` under ``model`` given the tokens before it (from the
    second token: the first has nothing before it): one ``TokenLogprob`` per token, with its rank there (1:
    the likeliest) and the ``top`` likeliest tokens (0 to ``core.logprobs.MAX_TOP``), as ``generate``'s
    ``logprobs`` reports generated tokens.  ``sum(t.logprob for t in score(model, text))`` is the text's
    log-likelihood (less its first token's).

    One prompt gives a list of ``TokenLogprob``, a list of prompts (scored as one left-padded batch) a list
    of those.  Prompts are what ``generate`` takes: text (``chat`` wraps it in the chat template), token
    ids, a conversation (rendered as ``generate`` renders it, the assistant's turn opened after it), or a
    list of those.

    A function of its own, not a ``generate`` argument: scoring generates nothing and every method's
    prompt pass is the same model's, so there is no method, budget or sampling to choose (``generate``
    would need ``max_new_tokens=0``, which no method decodes).  It is one prompt pass of the whole model,
    its hidden states unembedded a block of positions at a time (``core.logprobs.scores``)."""
    _check(
        isinstance(model, Transformer),
        f"model must be a layerleap model (layerleap.load(...)), got {type(model).__name__}",
    )
    prompts, many = _split_prompts(prompt)
    with V.raising(GenerationError):
        V.integer(top, "top", 0, MAX_TOP, hint=" (0: the prompt tokens' own log probabilities alone)")
        V.flag(chat, "chat")
    ids = [_encode_row(model, prompts, i, chat) for i in range(len(prompts))]
    ctx = model.config.max_position
    for i, p in enumerate(ids):
        _check(
            len(p) <= ctx,
            f"prompt {i} has {len(p)} tokens, beyond the model's context length {ctx}: shorten it",
        )
    _check_memory(model, [len(p) for p in ids], 0)
    run = Run(model, ids, GenerationConfig(max_new_tokens=0))
    longest = max(len(p) for p in ids)
    out = []
    with torch.inference_mode():
        h = run.prefill_at(model.new_cache(len(ids), longest), (run.n_layers,))[-1]  # [B, T, D]
        for row, p in enumerate(ids):
            out.append(scores(model.logits, h[row, longest - len(p) : longest - 1], p[1:], top, model.tokenizer))
    if sum(map(len, ids)) >= LONG_PROMPT_PASS:
        release_freed_memory()
    return out if many else out[0]


def _prepare(
    model: Transformer,
    prompt,
    method: str,
    max_new_tokens: int,
    temperature: float | None,
    top_k: int | None,
    top_p: float | None,
    seed: int | None,
    do_sample: bool | None,
    stop_at_eos: bool,
    chat: bool,
    options: dict,
    grammar: Grammar | None = None,
    logprobs: int | None = None,
    min_p: float | None = None,
    processors: dict | None = None,
    typical_p: float | None = None,
    stop_token_ids: list[int] | None = None,
) -> tuple[Method, list[list[int]], bool, GenerationConfig]:
    """Check ``generate``'s arguments -> (the method, the prompts' ids, whether a list was given, the config)."""
    _check(
        isinstance(model, Transformer),
        f"model must be a layerleap model (layerleap.load(...)), got {type(model).__name__}",
    )
    m = get_method(method)
    prompts, many = _split_prompts(prompt)
    _check(m.batched or len(prompts) == 1, one_at_a_time(m.name, len(prompts)))
    with V.raising(GenerationError):
        V.integer(max_new_tokens, "max_new_tokens", 1)
        if temperature is not None:
            hint = " (use method='greedy' for deterministic output)"
            V.number(temperature, "temperature", V.MIN_TEMPERATURE, hint=hint)
        if top_k is not None:
            V.integer(top_k, "top_k", 0, hint=" (0 = off)")
        if top_p is not None:
            V.number(top_p, "top_p", 0, 1, lo_open=True)
        if min_p is not None:
            V.number(min_p, "min_p", 0, 1, hint=" (0 = off)")
        if typical_p is not None:
            V.number(typical_p, "typical_p", 0, 1, lo_open=True, hint=" (1.0 = off)")
        if seed is not None:
            V.seed(seed)
        if do_sample is not None:
            V.flag(do_sample, "do_sample")
        V.flag(stop_at_eos, "stop_at_eos")
        V.flag(chat, "chat")
        if logprobs is not None:
            V.integer(logprobs, "logprobs", 0, MAX_TOP, hint=" (None: off; 0: the chosen tokens' only)")
        options.update(m.check_options(options, model.config))
    given = {
        k: v
        for k, v in zip(SAMPLING_ARGS, (temperature, top_k, top_p, min_p, typical_p, seed))
        if v is not None and NEUTRAL.get(k) != v
    }
    do_sample = sampling_choice(m, do_sample, given)
    _check_grammar(m, grammar)
    procs = check_processors(
        m, model.config.vocab_size, max_new_tokens, grammar, tokenizer=model.tokenizer, **(processors or {})
    )
    stops = () if stop_token_ids is None else _stop_token_ids(stop_token_ids, model.config.vocab_size)
    if stops and procs.get("min_tokens"):  # held off as the end-of-sequence tokens are
        procs["min_tokens_ids"] = stops

    ids = [_encode_row(model, prompts, i, chat) for i in range(len(prompts))]
    ctx = model.config.max_position
    window = getattr(model, "sliding_window", None)
    why = (
        " (the model's sliding window: layerleap runs full attention, the same only within the window)"
        if window
        else ""
    )
    for i, p in enumerate(ids):
        _check(
            len(p) + max_new_tokens <= ctx,
            f"prompt {i} has {len(p)} tokens; with max_new_tokens={V.show(max_new_tokens)} that exceeds the context "
            f"length {ctx}{why}: shorten the prompt or lower max_new_tokens",
        )
    _check_memory(model, [len(p) for p in ids], max_new_tokens)
    eos = model.eos_ids()
    d = GenerationConfig()
    gen = GenerationConfig(
        max_new_tokens,
        do_sample,
        d.temperature if temperature is None else float(temperature),
        d.top_k if top_k is None else int(top_k),
        d.top_p if top_p is None else float(top_p),
        None if seed is None else int(seed),  # numpy integers too: torch's generators take Python ints
        stop_at_eos,
        eos,
        grammar,
        None if logprobs is None else int(logprobs),
        0.0 if min_p is None else float(min_p),
        typical_p=1.0 if typical_p is None else float(typical_p),
        stop_token_ids=stops,
        **procs,
    )
    if grammar is not None:
        grammar.start(model, 1, eos)  # compiles it (kept): a bad grammar is refused here, before decoding
    return m, ids, many, gen


def grammar_methods() -> list[str]:
    return [name for name, m in METHODS.items() if m.grammar]


def _check_grammar(m: Method, grammar) -> None:
    _check(
        grammar is None or isinstance(grammar, Grammar),
        f"grammar must be a layerleap.Grammar (Grammar.json(schema), .regex, .choice, .gbnf), got {V.show(grammar)}",
    )
    _check(
        grammar is None or m.grammar,
        f"method {m.name!r} cannot follow a grammar: use one that can ({', '.join(grammar_methods())})",
    )


def check_processors(
    m: Method,
    vocab: int | None,
    max_new_tokens: int,
    grammar: Grammar | None = None,
    repetition_penalty=None,
    presence_penalty=None,
    frequency_penalty=None,
    logit_bias=None,
    min_tokens=None,
    allowed_token_ids=None,
    bad_words=None,
    no_repeat_ngram_size=None,
    tokenizer=None,
) -> dict:
    """The logits processors' arguments (None: not given) checked -> ``GenerationConfig``'s fields for those
    that ask for something (``logit_bias`` as (token id, bias) pairs, ids ascending, zero biases dropped;
    its ids, and ``allowed_token_ids``, checked against the vocabulary ``vocab``, unless None: before a
    command loads the model; ``bad_words`` as the token sequences of each word, with and without a leading
    space, by ``tokenizer``: before a command loads the model, the words are only checked).
    A method that cannot apply them at every token it keeps (``Method.grammar`` False) refuses them."""
    out = {}
    with V.raising(GenerationError):
        if repetition_penalty is not None:
            out["repetition_penalty"] = V.number(
                repetition_penalty,
                "repetition_penalty",
                0,
                lo_open=True,
                hint=" (1.0 = off; above 1 discourages repeats)",
            )
        for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
            if value is not None:
                out[name] = V.number(value, name, -2, 2, hint=" (0 = off)")
        if logit_bias is not None:
            out["logit_bias"] = _logit_bias(logit_bias, vocab)
        if min_tokens is not None:
            out["min_tokens"] = V.integer(min_tokens, "min_tokens", 0, hint=" (0 = off)")
            _check(
                out["min_tokens"] <= max_new_tokens,
                f"min_tokens={out['min_tokens']} exceeds max_new_tokens={max_new_tokens}: lower min_tokens or raise "
                "max_new_tokens",
            )
        if allowed_token_ids is not None:
            out["allowed_token_ids"] = _allowed_token_ids(allowed_token_ids, vocab)
        if bad_words is not None:
            out["bad_words"] = _bad_words(bad_words, vocab, tokenizer)
        if no_repeat_ngram_size is not None:
            out["no_repeat_ngram_size"] = V.integer(no_repeat_ngram_size, "no_repeat_ngram_size", 0, hint=" (0 = off)")
    out = {k: v for k, v in out.items() if v != PROCESSORS_NEUTRAL[k]}
    banned = {w[0] for w in out.get("bad_words", ()) if len(w) == 1}  # forbidden everywhere
    _check(
        not out.get("allowed_token_ids") or not set(out["allowed_token_ids"]) <= banned,
        "allowed_token_ids and bad_words leave no token to choose: allow a token that is not a bad word",
    )
    if out and not m.grammar:
        raise GenerationError(
            f"method {m.name!r} cannot apply {', '.join(out)} to every token it keeps: use one that can "
            f"({', '.join(grammar_methods())})"
        )
    _check(
        not out.get("min_tokens") or grammar is None,
        "min_tokens with a grammar: the grammar decides where the output ends: leave min_tokens out",
    )
    return out


MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a bias


def _logit_bias(value, vocab: int | None) -> tuple[tuple[int, float], ...]:
    """``{token id: bias}`` -> (id, bias) pairs, ids ascending, without the zero biases."""
    if not isinstance(value, dict):
        raise GenerationError(
            f"logit_bias must be a dict of token id -> bias in [-100, 100] ({{50256: -100}}), got {V.show(value)}"
        )
    out = {}
    for t, b in value.items():
        top = None if vocab is None else vocab - 1
        V.integer(t, f"logit_bias's token id {V.show(t)}", 0, top, hint=" (a token id of this model)")
        out[int(t)] = V.number(b, f"logit_bias[{int(t)}]", -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
    return tuple(sorted((t, b) for t, b in out.items() if b != 0))


def _allowed_token_ids(value, vocab: int | None) -> tuple[int, ...]:
    """A non-empty list of token ids -> the ids, ascending, once each."""
    if not isinstance(value, (list, tuple)) or not value:
        raise GenerationError(
            f"allowed_token_ids must be a non-empty list of token ids ([11, 13, 198]), got {V.show(value)}"
        )
    top = None if vocab is None else vocab - 1
    for t in value:
        V.integer(t, f"allowed_token_ids's token id {V.show(t)}", 0, top, hint=" (a token id of this model)")
    return tuple(sorted({int(t) for t in value}))


def _stop_token_ids(value, vocab: int | None) -> tuple[int, ...]:
    """A list of token ids (``stop_token_ids``) -> the ids, ascending, once each (an empty list: none)."""
    if not isinstance(value, (list, tuple)):
        raise GenerationError(f"stop_token_ids must be a list of token ids ([2, 32000]), got {V.show(value)}")
    top = None if vocab is None else vocab - 1
    with V.raising(GenerationError):
        for t in value:
            V.integer(t, f"stop_token_ids's token id {V.show(t)}", 0, top, hint=" (a token id of this model)")
    return tuple(sorted({int(t) for t in value}))


def _bad_words(value, vocab: int | None, tokenizer) -> tuple[tuple[int, ...], ...]:
    """A list of words -> the token sequences never completed.  A word given as text: vLLM's rule, its tokens
    as it is, and with a leading space where that makes a sequence of the same length that starts with
    another token; a word given as token ids: those."""
    words = 'a list of words, each a non-empty string or a non-empty list of token ids (["darn", [464, 318]])'
    if not isinstance(value, (list, tuple)) or not all(
        (isinstance(w, str) and w.strip()) or (isinstance(w, (list, tuple)) and w) for w in value
    ):
        raise GenerationError(f"bad_words must be {words}, got {V.show(value)}")
    top = None if vocab is None else vocab - 1
    out: list[tuple[int, ...]] = []
    for word in value:
        if not isinstance(word, str):
            for t in word:
                V.integer(t, f"bad_words's token id {V.show(t)}", 0, top, hint=" (a token id of this model)")
            seqs: tuple = (tuple(int(t) for t in word),)
        elif tokenizer is None:
            _check(
                vocab is None,
                f"bad_words: the word {word!r} is found by its tokens, and this model has no tokenizer: add its "
                "tokenizer files, or give the word as token ids",
            )
            continue  # before a command loads the model: the words are checked, the tokens come later
        else:
            plain = tuple(int(t) for t in tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(int(t) for t in tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            same = plain and spaced and spaced[0] != plain[0] and len(spaced) == len(plain)
            seqs = (plain, spaced) if same else (plain,)
        out += [q for q in seqs if q and q not in out]
    return tuple(out)


class BudgetWarning(UserWarning):
    """About a lossy method's quality budget: its calibration found no setting faster than greedy within
    it, there is no calibration for the model, or the calibration was priced on another machine."""


class Decoding:
    """One ``generate`` call, driven round by round: iterating yields, after each method round that
    added tokens, the indices of the prompts whose output grew (``tokens(i)`` reads it); once the
    iteration ends, ``results`` holds one ``GenerationResult`` per prompt (None before).  ``cancel(i)`` stops
    prompt ``i`` (it keeps what it has: a prompt cancelled before the decoding began has no tokens, no model
    calls and ``stats.batch`` 0).  The prompts decode as one batch (one ``Run``); a method that
    does not batch refuses more than one.  Arguments as ``generate``'s; bad ones raise
    ``GenerationError`` here."""

    def __init__(
        self,
        model: Transformer,
        prompt,
        method: str = "greedy",
        max_new_tokens: int = 64,
        *,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        typical_p: float | None = None,
        seed: int | None = None,
        do_sample: bool | None = None,
        stop_at_eos: bool = True,
        stop: str | list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        chat: bool = False,
        quality: float | None = None,
        grammar: Grammar | None = None,
        logprobs: int | None = None,
        repetition_penalty: float | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        logit_bias: dict[int, float] | None = None,
        min_tokens: int | None = None,
        allowed_token_ids: list[int] | None = None,
        bad_words: list[str | list[int]] | None = None,
        no_repeat_ngram_size: int | None = None,
        prompt_cache: PromptCache | None = None,
        **options,
    ):
        _unknown_names(get_method(method), options)
        with V.raising(GenerationError):
            self.prompt_cache = check_prompt_cache(prompt_cache)
        options, self.budget = (
            budget.resolve(model, get_method(method).name, options, quality)
            if isinstance(model, Transformer)
            else (options, None)
        )
        m, ids, self.many, self.gen = _prepare(
            model,
            prompt,
            method,
            max_new_tokens,
            temperature,
            top_k,
            top_p,
            seed,
            do_sample,
            stop_at_eos,
            chat,
            options,
            grammar,
            logprobs,
            min_p,
            dict(
                repetition_penalty=repetition_penalty,
                presence_penalty=presence_penalty,
                frequency_penalty=frequency_penalty,
                logit_bias=logit_bias,
                min_tokens=min_tokens,
                allowed_token_ids=allowed_token_ids,
                bad_words=bad_words,
                no_repeat_ngram_size=no_repeat_ngram_size,
            ),
            typical_p,
            stop_token_ids,
        )
        self.stops = check_stops(stop)
        _check(
            not self.stops or model.tokenizer is not None,
            "stop strings are found in the text, and this model has no tokenizer: add its tokenizer files, or "
            "leave stop out",
        )
        if self.budget is not None:
            note = budget.machine_note(self.budget, model)  # priced on another machine: once per file
            if note:
                warnings.warn(note, BudgetWarning, stacklevel=3)
        if self.budget is not None and not self.budget.faster_than_greedy:
            warnings.warn(self.budget.note, BudgetWarning, stacklevel=3)
        elif self.budget is None and isinstance(model, Transformer):
            note = budget.uncalibrated_note(model, m.name, options, quality)
            if note:
                warnings.warn(note, BudgetWarning, stacklevel=3)
        self.model, self.method, self.options, self.prompt_ids = model, m, options, ids
        self.results: list[GenerationResult | None] = [None] * len(ids)
        self._where: dict[int, tuple[Run, int]] = {}  # prompt index -> its run and row
        self._cancelled: set[int] = set()
        self._stopped: dict[int, tuple[int, str, str]] = {}  # prompt index -> (tokens kept, text, stop string)
        self._rounds = None  # the one iteration (a generator): iterating again resumes it
        self._broken = False  # it ended by an exception or was closed before the end
        self._typed: dict[int, list[TokenLogprob]] = {}  # prompt index -> its tokens' log probabilities read so far

    def __iter__(self):
        """The rounds, as one iterator however often this is called: a loop left with ``break``
        resumes where it stopped, and one after the end yields nothing (``results`` stay)."""
        if self._broken:
            raise GenerationError(
                "this decoding stopped before its end (an error, an interrupt or a closed iterator): "
                "start a new one (generate, stream or Decoding again)"
            )
        if self._rounds is None:
            self._rounds = self._iterate()
        return self._rounds

    def _iterate(self):
        try:
            yield from self._decode()
        except BaseException:
            self._broken = True
            for run, _ in self._where.values():
                run.kv = None  # its KV cache, held for the prompt cache: nothing is stored from a broken run
            raise

    def close(self) -> None:
        """Stop the decoding where it is and free its run (iterating it again is refused)."""
        if self._rounds is not None:
            self._rounds.close()
        if any(r is None for r in self.results):
            self._broken = True

    def _decode(self):
        group = [i for i in range(len(self.prompt_ids)) if i not in self._cancelled]  # cancelled before it started
        if group:
            reuse = self.prompt_cache if self.method.prompt_cache else None  # (the others run as without one)
            run = Run(self.model, [self.prompt_ids[i] for i in group], self.gen, indices=group, prompt_cache=reuse)
            self._where.update({i: (run, j) for j, i in enumerate(group)})
            seen = [0] * len(group)
            texts = [(TextPieces(self.model.tokenizer), StopText(self.stops)) for _ in group] if self.stops else None
            ended = False  # every row ended between two rounds (cancelled): the method ends at its next step
            for _ in rounds(self.method.fn, run, self.options):
                grew = [i for j, i in enumerate(group) if len(run.out[j]) > seen[j]]
                if texts is not None:
                    self._find_stops(run, group, texts, [j for j in range(len(group)) if len(run.out[j]) > seen[j]])
                seen = [len(o) for o in run.out]
                if grew:
                    yield grew
                if ended:  # a method that went on past run.done: stop it (without its own statistics)
                    break
                ended = run.done
            wall = time.perf_counter() - run.t0
            run.keep_prompts()
            if sum(map(len, run.prompts)) >= LONG_PROMPT_PASS:  # its buffers back to the OS (~1 ms)
                release_freed_memory()
            grew = [i for j, i in enumerate(group) if len(run.out[j]) > seen[j]]
            if texts is not None:  # every row has ended: its text is read to its last character
                self._find_stops(run, group, texts, list(range(len(group))), ended=True)
            for j, i in enumerate(group):
                self.results[i] = _result(self.model, run, j, wall, self.method.name, stop=self._stopped.get(i))
                if self.budget is not None:
                    self.results[i].stats.budget = BudgetStats(**self.budget.to_dict())
                if i in self._cancelled and run.reasons[j] == "cancelled":  # not a row that had ended before
                    self.results[i].stats.cancelled = True
            if grew:
                yield grew
        for i in range(len(self.prompt_ids)):
            if self.results[i] is None:  # cancelled before the decoding began: no tokens, no calls
                self.results[i] = self._unstarted(i)

    def _find_stops(self, run: Run, group: list[int], texts: list, rows: list[int], ended: bool = False) -> None:
        """Read the new text of ``rows`` for the stop strings (``core.text.StopText``, the server's rule); a row
        whose text holds one ends now, its tokens cut to the fewest that hold it (``tokens_through``: the
        run's output too, so the method's own figures count the tokens kept) and its text to what comes before
        it.  The text of a row that has ended (of every row once the decoding has ``ended``: a row cancelled,
        or left short by its method, keeps no tail unread) is read to its last character."""
        tok = self.model.tokenizer
        for j in rows:
            pieces, stop = texts[j]
            if stop.hit:
                continue
            hold_off(stop, self.gen.min_tokens, run.out[j], tok)  # no stop string before min_tokens, as the server
            stop.push(pieces.push(run.out[j]))
            if not stop.hit and (ended or run.finished[j]):
                text = tok.decode(run.out[j], skip_special_tokens=True)
                if text.startswith(pieces.sent):  # (else a tokenizer rewrote the text read: nothing more to read)
                    stop.push(pieces.finish(run.out[j]))
            if stop.hit:
                n = tokens_through(run.out[j], tok, stop.end)
                self._stopped[group[j]] = (n, pieces.sent[: stop.end - len(stop.string)], stop.string)
                run.cancel(j)
                del run.out[j][n:]  # what a round accepted past the stop string: not output, nor counted as such
                run.reasons[j] = "stop"  # and a row that ended in the same round (its budget, EOS) ended at the stop

    def _unstarted(self, i: int) -> GenerationResult:
        """Prompt ``i``'s result while it has not run: before the decoding began, or cancelled before it
        did (then finish_reason "cancelled" and ``stats.cancelled``); ``stats.batch`` is 0 (it ran in no
        batch)."""
        cancelled = i in self._cancelled
        stats = Stats(
            method=self.method.name,
            new_tokens=0,
            prompt_tokens=len(self.prompt_ids[i]),
            model_calls=0,
            layer_evals=0,
            prompt_layer_evals=0,
            layers_per_token=0.0,
            layer_calls=0,
            tokens_per_call=0.0,
            wall_s=0.0,
            tokens_per_s=0.0,
            ttft_s=None,
            batch=0,
            cancelled=cancelled,
        )
        if self.budget is not None:
            stats.budget = BudgetStats(**self.budget.to_dict())
        return GenerationResult(
            "", [], stats, list(self.prompt_ids[i]), "cancelled" if cancelled else None, self._no_logprobs()
        )

    def _no_logprobs(self) -> list | None:
        return None if self.gen.logprobs is None else []

    @property
    def started(self) -> bool:
        """Whether the decoding has begun: its run has made a model call.  A method's set-up comes before
        that (the checks of its options, the weights they name), so an error raised while this is False
        refuses the arguments, and one raised later is a failure of the decoding itself."""
        return any(run.model_calls > 0 for run, _ in self._where.values())

    def tokens(self, i: int) -> list[int]:
        """The new tokens of prompt ``i`` so far (a copy: it does not grow with the decoding, and changing it
        changes nothing)."""
        i = self._index(i, "tokens")
        if i not in self._where:
            return []
        run, row = self._where[i]
        return list(run.out[row][: self._stopped[i][0]] if i in self._stopped else run.out[row])

    def logprobs(self, i: int, start: int = 0) -> list[TokenLogprob] | None:
        """The log probabilities of prompt ``i``'s ``tokens(i)`` so far (one per token; from token ``start``
        on, counted from the end when negative, as a slice counts), or None without ``logprobs``."""
        i = self._index(i, "logprobs")
        with V.raising(GenerationError):
            start = V.integer(start, "start", hint=" (the index of the first token to report)")
        if self.gen.logprobs is None:
            return None
        if i not in self._where:
            return []
        run, row = self._where[i]
        n = len(self.tokens(i))  # (a stop string's cut leaves entries past the tokens)
        done = self._typed.setdefault(i, [])  # each entry typed once: reading them every round stays linear
        del done[n:]
        done += typed(run.logprobs[row][len(done) : n], self.model.tokenizer)
        return done[max(0, n + start) if start < 0 else start :]

    def finished(self, i: int) -> bool:
        """Whether prompt ``i`` has ended (its end-of-sequence token, its budget, a grammar's end, a stop
        string or a cancel) while the batch may still run."""
        i = self._index(i, "finished")
        if i not in self._where:
            return i in self._cancelled
        run, row = self._where[i]
        return run.finished[row]

    def grammar_done(self, i: int) -> bool:
        """Whether prompt ``i``'s grammar is complete: nothing but the end of the output may follow (False
        without a grammar)."""
        i = self._index(i, "grammar_done")
        if i not in self._where:
            return False
        run, row = self._where[i]
        return run.constraints is not None and run.constraints[row].stopped

    def result_so_far(self, i: int) -> GenerationResult:
        """Prompt ``i``'s result now (``results[i]`` once the iteration has ended): for a row that ended
        before its batch, its tokens and the loop's counts so far, without the method's own statistics,
        which a method records when the batch ends."""
        i = self._index(i, "result_so_far")
        if self.results[i] is not None:
            return self.results[i]
        if i not in self._where:
            return self._unstarted(i)
        run, row = self._where[i]
        r = _result(
            self.model, run, row, time.perf_counter() - run.t0, self.method.name, ended=False, stop=self._stopped.get(i)
        )
        r.token_ids = list(r.token_ids)
        return r

    def _index(self, i, what: str) -> int:
        n = len(self.prompt_ids)
        if isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i < n:
            raise GenerationError(f"{what} takes a prompt's index, an integer in [0, {n - 1}], got {V.show(i)}")
        return int(i)

    def cancel(self, i: int) -> None:
        """Stop prompt ``i`` between two rounds: it keeps the tokens it has (none when cancelled before the
        decoding began), with finish_reason "cancelled"; a prompt that has already ended keeps its result."""
        i = self._index(i, "cancel")
        self._cancelled.add(i)
        if i in self._where:
            run, row = self._where[i]
            run.cancel(row)


def _check_memory(model: Transformer, lengths: list[int], max_new_tokens: int) -> None:
    """Refuse a batch whose KV cache alone would take more than half of the machine's memory."""
    c = model.config
    per_token = 2 * c.n_layers * c.n_kv_heads * c.head_dim * model.dtype.itemsize
    rows = len(lengths)
    need = rows * (max(lengths) + max_new_tokens) * per_token
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    _check(
        need <= ram // 2,
        f"the KV cache of {rows} prompt(s) × {max(lengths) + max_new_tokens} positions needs "
        f"{need / 2**30:.1f} GiB, beyond half of this machine's {ram / 2**30:.0f} GiB: use fewer or shorter prompts "
        "per call, or lower max_new_tokens",
    )


def _result(
    model: Transformer,
    run: Run,
    row: int,
    wall: float,
    method: str,
    ended: bool = True,
    stop: tuple[int, str, str] | None = None,
) -> GenerationResult:
    """``row``'s result; ``stop``: (tokens kept, text, stop string) of a row a stop string ended."""
    toks = run.out[row] if stop is None else run.out[row][: stop[0]]
    n = len(toks)
    stats = Stats(
        method=method,
        new_tokens=n,
        prompt_tokens=len(run.prompts[row]),
        model_calls=run.model_calls,
        layer_evals=run.layer_evals[row],
        prompt_layer_evals=run.prompt_layer_evals[row],
        layers_per_token=run.layer_evals[row] / n if n else 0.0,
        layer_calls=run.layer_calls[row],
        tokens_per_call=n / max(1, run.model_calls),
        wall_s=wall,
        tokens_per_s=n / wall if wall > 0 else 0.0,
        ttft_s=(run.t_first - run.t0) if run.t_first is not None else None,
        batch=run.batch,
        cached_prompt_tokens=run.cached[row],
        stop_string=None if stop is None else stop[2],
        **{RECORD_FIELDS[kind]: records[row] for kind, records in run.records.items()},
    )
    if stop is not None:
        text = stop[1]
    else:
        text = model.tokenizer.decode(toks, skip_special_tokens=True) if model.tokenizer is not None else ""
    logprobs = None if run.logprobs is None else typed(run.logprobs[row][:n], model.tokenizer)
    return GenerationResult(text, toks, stats, list(run.prompts[row]), finish_reason(run, row, ended), logprobs)


def finish_reason(run: Run, row: int, ended: bool) -> str | None:
    """Why ``row`` ended (``GenerationResult.finish_reason``): None while it decodes; a row its method left
    unfinished when the decoding ``ended`` stopped short of its budget ("stop") or at it ("length")."""
    if run.reasons[row] is not None or not ended:
        return run.reasons[row]
    return "length" if len(run.out[row]) >= run.gen.max_new_tokens else "stop"
