"""A generic fast tokenizer without `transformers`: ``tokenizer.json`` through `tokenizers`, the chat
template through `jinja2`.

A model folder whose ``tokenizer_config.json`` names a generic fast tokenizer (one that
``tokenizer.json`` alone defines) gets a ``Tokenizer``: the calls the library makes (``__call__``,
``encode``, ``decode``, ``apply_chat_template`` on plain messages, the special tokens) give what
`transformers`' ``PreTrainedTokenizerFast`` gives, without importing `transformers` (about 35 MB of
memory and half a second of start-up).  Anything else (another attribute, a chat call with tools or
documents) builds that ``PreTrainedTokenizerFast`` once and forwards to it; ``.hf`` returns it.

``plain_tokenizer_config`` decides which folders qualify: a setting this class does not reproduce
(a truncation or padding rule, added special tokens missing from the vocabulary, clean-up of
spaces, a vocabulary over 100,000 tokens, which `transformers` may patch) keeps the folder on
`transformers`.  A folder of another tokenizer class qualifies by measurement instead
(``reproduces``): in the cache, where the converted GGUF models live, `transformers` loads it
once, and when this class gives the same ids, text and chat template on a probe set (Spec-Bench
questions, special tokens, random id sequences), a note beside the files (``VERIFIED``, holding
the files' digest) lets later loads skip `transformers`.
"""

from __future__ import annotations

import hashlib
import json
import random
from datetime import datetime
from pathlib import Path

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
PLAIN_KEYS = {  # tokenizer_config.json keys whose meaning this class reproduces
    "backend",
    "tokenizer_class",
    "is_local",
    "local_files_only",
    "model_max_length",
    "added_tokens_decoder",
    "chat_template",
    "errors",
    *SPECIAL_TOKENS,
}
FALSE_KEYS = ("add_prefix_space", "clean_up_tokenization_spaces", "extra_special_tokens", "additional_special_tokens")
VERIFIED = "layerleap-tokenizer.json"  # the probe's verdict on a cache folder, keyed by the files' digest
PROBE_QUESTIONS = Path(__file__).parents[1] / "data" / "spec_bench" / "question.jsonl"
PROBE_EXTRA = (
    "Hello <|im_start|> wörld,\n\n  spaces\t<|im_end|>",
    "",
    " ",
    "日本語 🎉",
    "a\u00a0b \r\n c",
    "</s><s>[INST]",
)
MAX_VOCAB = 100_000  # above it `transformers` may rewrite the pre-tokenizer (its Mistral regex patch)


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def backend(folder: Path):
    """``folder``'s ``tokenizer.json`` as a `tokenizers` object."""
    from tokenizers import Tokenizer as Backend

    return Backend.from_file(str(folder / "tokenizer.json"))


def plain_tokenizer_config(folder: Path, rust) -> dict | None:
    """``tokenizer_config.json`` of ``folder`` when ``Tokenizer`` reproduces `transformers` on it and
    on ``rust`` (its ``backend``), else None."""
    try:
        cfg = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(cfg, dict):
        return None
    extra = set(cfg) - PLAIN_KEYS
    extra -= {k for k in FALSE_KEYS if not cfg.get(k)}  # present but off
    if extra or rust.truncation is not None or rust.padding is not None:
        return None
    special = {t.content for t in rust.get_added_tokens_decoder().values() if t.special}
    named = {_token_text(cfg.get(k)) for k in SPECIAL_TOKENS} - {None}
    if rust.get_vocab_size(with_added_tokens=True) > MAX_VOCAB or not named <= special:
        return None
    return cfg if isinstance(_chat_template(folder, cfg), (str, type(None))) else None


def files_digest(folder: Path) -> str:
    """sha256 of the files that define a folder's tokenizer and of the `transformers` version that the
    probe compared with (read from its metadata, not imported)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        h = hashlib.sha256(version("transformers").encode())
    except PackageNotFoundError:
        h = hashlib.sha256(b"-")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        path = folder / name
        h.update(name.encode() + (path.read_bytes() if path.is_file() else b"-"))
    return h.hexdigest()


def verified_config(folder: Path) -> dict | None:
    """``tokenizer_config.json`` of a folder whose ``VERIFIED`` note says the probe passed for the
    files as they are now, else None."""
    try:
        note = json.loads((folder / VERIFIED).read_text(encoding="utf-8"))
        if note.get("reproduces") is not True or note.get("digest") != files_digest(folder):
            return None
        cfg = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, AttributeError, RecursionError):  # RecursionError: brackets nested too deep
        return None
    return cfg if isinstance(cfg, dict) and isinstance(_chat_template(folder, cfg), (str, type(None))) else None


def probe_texts() -> list[str]:
    """Every fourth Spec-Bench question shipped with the package, and special and odd strings."""
    rows = [json.loads(line) for line in PROBE_QUESTIONS.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [r["turns"][0] for r in rows[::4]] + list(PROBE_EXTRA)


def reproduces(ours: Tokenizer, theirs, texts: list[str], seed: int = 0) -> bool:
    """Whether ``ours`` gives ``theirs``' (a `transformers` tokenizer's) ids with and without special
    tokens, chat templates (three conversation shapes, with and without the generation prompt),
    decoded text of random id sequences, special tokens and vocabulary."""
    names = ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id", "all_special_ids", "special_tokens_map")
    if [getattr(ours, n) for n in names] != [getattr(theirs, n, None) for n in names]:
        return False
    if len(ours) != len(theirs) or ours.get_vocab() != theirs.get_vocab():
        return False
    for text in texts:
        for special in (True, False):
            want = list(theirs(text, add_special_tokens=special)["input_ids"])
            if ours.encode(text, add_special_tokens=special) != want:
                return False
        if theirs.chat_template is None:
            continue
        for msgs in (
            [{"role": "user", "content": text}],
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}],
            [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": text}],
        ):
            for gen in (True, False):
                kw = dict(add_generation_prompt=gen, tokenize=False)
                if ours.apply_chat_template(msgs, **kw) != theirs.apply_chat_template(msgs, **kw):
                    return False
    rng = random.Random(seed)
    for _ in range(len(texts)):
        ids = [rng.randrange(len(theirs)) for _ in range(rng.randrange(1, 40))]
        for skip in (True, False):
            if ours.decode(ids, skip_special_tokens=skip) != theirs.decode(ids, skip_special_tokens=skip):
                return False
    return True


def _chat_template(folder: Path, cfg: dict):
    path = folder / "chat_template.jinja"
    return path.read_text(encoding="utf-8") if path.is_file() else cfg.get("chat_template")


class Encoding(dict):
    """What ``Tokenizer(text)`` returns: ``input_ids`` and ``attention_mask``, as keys or attributes."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class Tokenizer:
    """``tokenizer.json`` and the chat template of a model folder (see the module's docstring)."""

    def __init__(self, folder: Path, cfg: dict, rust=None):
        self.folder = Path(folder)
        self.backend_tokenizer = rust if rust is not None else backend(self.folder)
        self.chat_template = _chat_template(self.folder, cfg)
        self.name_or_path = str(self.folder)
        self._hf = None
        self._template = None
        for name in SPECIAL_TOKENS:
            text = _token_text(cfg.get(name))
            setattr(self, name, text)
            setattr(self, name + "_id", None if text is None else self.backend_tokenizer.token_to_id(text))

    # --- what the library calls ---------------------------------------------------------------
    def encode(self, text: str, text_pair=None, add_special_tokens: bool = True, **kwargs) -> list[int]:
        if text_pair is not None or kwargs:  # pairs, truncation, return_tensors ...: `transformers`
            return self.hf.encode(text, text_pair, add_special_tokens=add_special_tokens, **kwargs)
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text=None, text_pair=None, *args, add_special_tokens: bool = True, **kwargs):
        if text_pair is not None or args or kwargs or text is None:
            return self.hf(text, text_pair, *args, add_special_tokens=add_special_tokens, **kwargs)
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens=add_special_tokens)
            return Encoding(input_ids=ids, attention_mask=[1] * len(ids))
        encs = self.backend_tokenizer.encode_batch(list(text), add_special_tokens=add_special_tokens)
        return Encoding(input_ids=[e.ids for e in encs], attention_mask=[[1] * len(e.ids) for e in encs])

    def decode(self, token_ids, skip_special_tokens: bool = False, **kwargs) -> str:
        if kwargs.get("clean_up_tokenization_spaces"):
            return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)
        if isinstance(token_ids, dict):
            token_ids = token_ids["input_ids"]
        if hasattr(token_ids, "tolist"):
            token_ids = token_ids.tolist()
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        return self.backend_tokenizer.decode([int(i) for i in token_ids], skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences, skip_special_tokens: bool = False, **kwargs) -> list[str]:
        return [self.decode(s, skip_special_tokens=skip_special_tokens, **kwargs) for s in sequences]

    def apply_chat_template(
        self, conversation, add_generation_prompt: bool = False, tokenize: bool = True, return_dict: bool = True, **kw
    ):
        """`transformers`' ``apply_chat_template`` for one conversation of ``{"role", "content"}``
        messages with string contents; anything else (tools, documents, batches, tensors, other
        template variables) goes to `transformers`."""
        plain = (
            not kw
            and isinstance(conversation, (list, tuple))
            and all(isinstance(m, dict) and set(m) <= {"role", "content"} for m in conversation)
            and all(isinstance(m.get("content"), str) and isinstance(m.get("role"), str) for m in conversation)
        )
        template = self._compiled_template() if plain and self.chat_template is not None else None
        if template is None:
            kw.update(add_generation_prompt=add_generation_prompt, tokenize=tokenize, return_dict=return_dict)
            return self.hf.apply_chat_template(conversation, **kw)
        text = template.render(
            messages=[dict(m) for m in conversation],
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens_map,
        )
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return Encoding(input_ids=ids, attention_mask=[1] * len(ids)) if return_dict else ids

    # --- the special tokens and the vocabulary ---------------------------------------------------
    @property
    def special_tokens_map(self) -> dict[str, str]:
        return {name: getattr(self, name) for name in SPECIAL_TOKENS if getattr(self, name) is not None}

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys(self.special_tokens_map.values()))

    @property
    def all_special_ids(self) -> list[int]:
        return [self.backend_tokenizer.token_to_id(t) for t in self.all_special_tokens]

    @property
    def vocab_size(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids, skip_special_tokens: bool = False):
        if skip_special_tokens:
            return self.hf.convert_ids_to_tokens(ids, skip_special_tokens=True)
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            return self.backend_tokenizer.token_to_id(tokens)
        return [self.backend_tokenizer.token_to_id(t) for t in tokens]

    # --- everything else: `transformers` ---------------------------------------------------------
    @property
    def hf(self):
        """The same tokenizer as `transformers`' ``PreTrainedTokenizerFast`` (built on first use)."""
        if self._hf is None:
            from transformers import PreTrainedTokenizerFast

            self._hf = PreTrainedTokenizerFast.from_pretrained(self.folder)
        return self._hf

    def save_pretrained(self, folder, **kwargs):
        return self.hf.save_pretrained(folder, **kwargs)

    def __getattr__(self, name):
        if name.startswith("__") or name in ("_hf", "folder"):
            raise AttributeError(name)
        return getattr(self.hf, name)

    def __repr__(self) -> str:
        return f"Tokenizer(folder={str(self.folder)!r}, vocab={len(self)})"

    def _compiled_template(self):
        """The compiled chat template, or None for one this environment cannot parse (a template
        with `transformers`' own ``{% generation %}`` tag)."""
        import jinja2

        if self._template is None:
            try:
                self._template = compile_chat_template(self.chat_template)
            except jinja2.TemplateSyntaxError:
                self._template = False
        return self._template or None


def compile_chat_template(source: str):
    """A chat template compiled as `transformers` compiles it: a sandboxed environment that trims
    blocks, with loop controls, a ``tojson`` that keeps non-ASCII text, ``raise_exception`` and
    ``strftime_now``."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
