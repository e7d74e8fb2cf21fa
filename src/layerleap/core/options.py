"""Method options, each declared once: its name, type, default, bounds and meaning.

A method lists the options it takes (``register(..., options=(DRAFT_LEN, EXIT_LAYER.but(default=None)))``)
and ``check`` is the one checker that runs those declarations: ``generate`` (the Python API), the CLI's
``--opt`` and method flags, the server's ``layerleap.options``, bench, sweep and exactness all call it,
and ``layerleap methods`` prints the same declarations.  A shared option (``exit_layer``, ``draft_len``,
``tree``, ``head``, ...) is declared here once and reused with its one message; a method may change its
default (``.but(default=...)``), or narrow its bounds where its algorithm needs it (PPD's d̄ >= d/2).

Bounds may depend on the model (``exit_layer`` in ``[1, n_layers - 1]``): ``ModelBound``.  ``check``
without a model checks everything else (type, fixed bounds, choices, files), which the CLI does before
loading the model; with the model's config it checks the model-dependent bounds too.

Values: integers accept any ``numbers.Integral`` but ``bool``; floats refuse ``bool``, nan and (unless
the option gives ``inf`` a meaning) infinities; ``None`` only where the option says what it means.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import numbers
import os
from dataclasses import dataclass
from typing import Callable

from .. import validate as V
from .config import ModelConfig
from .tree import TreeError, parse_tree


class OptionError(V.InputError):
    """A method option with a bad name or value: the message names the problem and the fix."""


REQUIRED = inspect.Parameter.empty  # the default of an option that has none (as in a signature)


@dataclass(frozen=True)
class ModelBound:
    """A bound that depends on the model: ``fn(config)``, written ``text`` in listings; ``least``: what
    it is at least on any model, ``most``: at most (checked before the model loads)."""

    fn: Callable[[ModelConfig], int | float]
    text: str
    least: int = 1
    most: int | None = None

    def __str__(self) -> str:
        return self.text


N_LAYERS = ModelBound(lambda c: c.n_layers, "n_layers")
LAST_EXIT = ModelBound(lambda c: c.n_layers - 1, "n_layers-1")
HALF_DEPTH = ModelBound(lambda c: (c.n_layers + 1) // 2, "ceil(n_layers/2)")
CONTEXT = ModelBound(lambda c: c.max_position, "context")
MAX_CANDIDATES = 64  # top-k candidates verified side by side; their attention masks grow with k²
CANDIDATES = ModelBound(
    lambda c: min(c.vocab_size, MAX_CANDIDATES), f"min(vocab_size, {MAX_CANDIDATES})", most=MAX_CANDIDATES
)

KINDS = ("int", "float", "bool", "text", "choice", "tree", "int_list", "model", "weights", "any")


@dataclass(frozen=True)
class Option:
    """One method option.  ``kind``: int, float, bool, text, choice (one of ``choices``), tree (a tree
    shape, or one of ``choices``: a tree chosen while decoding), int_list, model (a second model: a loaded
    one, or a name or folder on the CLI), weights (one of ``choices``, a weights file, or a loaded object)
    or any (unchecked: a method registered without declarations).  ``none``: what None means ('' = not allowed)."""

    name: str
    kind: str
    help: str
    default: object = None
    lo: int | float | ModelBound | None = None
    hi: int | float | ModelBound | None = None
    lo_open: bool = False
    choices: tuple[str, ...] = ()
    none: str = ""
    inf: str = ""  # float: what inf means ('' = refused)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"option {self.name}: kind {self.kind!r} is not one of {', '.join(KINDS)}")

    def but(self, **changes) -> Option:
        """The same option with another default or narrower bounds (one method's use of it)."""
        return dataclasses.replace(self, **changes)

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    # -- bounds -----------------------------------------------------------------------------------
    def bounds(self, config: ModelConfig | None = None) -> tuple:
        """(lo, hi), a model-dependent one resolved with ``config`` or None without it."""

        def one(b, low: bool):
            if isinstance(b, ModelBound):
                return b.fn(config) if config is not None else (b.least if low else b.most)
            return b

        return one(self.lo, True), one(self.hi, False)

    def bounds_text(self) -> str:
        if self.kind == "tree" and self.choices:
            return "a tree | " + " | ".join(self.choices)
        if self.kind == "choice" or (self.kind == "weights" and self.choices):
            return " | ".join(self.choices) + (" | a file" if self.kind == "weights" else "")
        return V._bounds(self.lo, self.hi, self.lo_open).strip().removeprefix("in ")

    def describe(self) -> dict:
        """What ``layerleap methods`` prints."""
        return {
            "type": self.kind,
            "default": None if self.required else self.default,
            "required": self.required,
            "bounds": self.bounds_text(),
            "none": self.none,
            "inf": self.inf,
            "meaning": self.help,
        }

    # -- the check --------------------------------------------------------------------------------
    def check(self, value, config: ModelConfig | None = None):
        """``value`` as the method gets it, or an ``OptionError`` naming the bounds and the meaning.
        Without ``config``, model-dependent bounds are left for the check with the model."""
        if value is None and self.none:
            return None
        return _CHECKS[self.kind](self, value, config)

    def fail(self, want: str, value, config: ModelConfig | None = None) -> OptionError:
        """The one message of this option: the bounds (resolved on the model where they depend on it),
        what None means, the value given and the meaning."""
        on_model = [b for b in (self.lo, self.hi) if isinstance(b, ModelBound)] if config is not None else []
        model = f" ({', '.join(f'{b} = {b.fn(config)}' for b in on_model)} on this model)" if on_model else ""
        none = f" or none ({self.none})" if self.none else ""
        return OptionError(f"{self.name} must be {want}{model}{none}, got {V.show(value)}: {self.help}")

    def _range(self, config) -> str:
        lo, hi = self.bounds(config) if config is not None else (self.lo, self.hi)  # named, not resolved
        return V._bounds(lo, hi, self.lo_open)

    def _in_bounds(self, v, config) -> bool:
        lo, hi = self.bounds(config)
        if lo is not None and (v <= lo if self.lo_open else v < lo):
            return False
        return hi is None or v <= hi

    def arg(self) -> Callable[[str], object]:
        """This option as an argparse ``type`` (the model-independent checks; the same message)."""
        return V._as_arg(lambda t: self.check(self.parse(t)), label=self.name)

    def list_arg(self, none: bool = False) -> Callable[[str], list]:
        """A comma list of values of this option as an argparse ``type`` (``none``: 'none' or '' is [])."""
        return V._as_arg(lambda t: V._items(t, none, lambda x: self.check(self.parse(x))), label=f"{self.name} list")

    def parse(self, text: str):
        """A command-line value as the API would pass it, read by this option's kind: None for 'none' or
        'null' where the option allows it; the text itself for a text, choice, model or weights option (a
        file named ``1`` stays a name); else as ``parse_text`` reads it (a number, true/false, a list or
        JSON), one integer of an int_list option as a list of one."""
        if text.strip().lower() in ("none", "null"):
            return None if self.none else text  # (refused by the check, as the word given)
        if self.kind in ("text", "choice", "model", "weights"):
            return text
        value = parse_text(text)
        if self.kind == "int_list" and isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return [value]
        return value


def parse_text(text: str):
    """A command-line value read without a declaration: bool (true/false), none, int, float; JSON when it
    starts with ``[`` or ``{``; a list of numbers when it has commas (``30,28,26``); else the text itself."""
    stripped = text.strip()
    if stripped[:1] in ("[", "{"):
        try:
            return json.loads(stripped)
        except (json.JSONDecodeError, RecursionError) as e:  # RecursionError: brackets nested too deep
            why = e.msg if isinstance(e, json.JSONDecodeError) else "brackets nested too deep"
            raise OptionError(
                f"option value {text[:40]!r}{'...' if len(text) > 40 else ''} starts like JSON but is not ({why}): "
                "fix it, e.g. [[0], [1], [0, 0]]"
            ) from None
    if "," in stripped:
        items = [parse_text(t) for t in stripped.split(",")]
        if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in items):
            return items
    low = stripped.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _int(o: Option, value, config):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not o._in_bounds(int(value), config):
        raise o.fail(f"an integer{o._range(config)}", value, config)
    return int(value)


def _float(o: Option, value, config):
    ok = not isinstance(value, bool) and isinstance(value, numbers.Real)
    v = V.as_float(value) if ok else None
    ok = ok and v == v and (abs(v) != float("inf") or (bool(o.inf) and v > 0)) and o._in_bounds(v, config)
    if not ok:
        extra = f"; inf: {o.inf}" if o.inf else ""
        raise o.fail(f"a finite number{o._range(config)}{extra}", value, config)
    return v


def _bool(o: Option, value, config):
    if not isinstance(value, bool):
        raise o.fail("true or false", value)
    return value


def _text(o: Option, value, config):
    if not isinstance(value, str):
        raise o.fail("text", value)
    with V.raising(OptionError):
        return V.text(value, o.name)


def _choice(o: Option, value, config):
    if not isinstance(value, str) or value not in o.choices:
        raise o.fail(f"one of {', '.join(o.choices)}", value)
    return value


def _tree(o: Option, value, config):
    if isinstance(value, str) and value.strip() in o.choices:  # a named tree ("dynamic")
        return value.strip()
    try:
        parse_tree(value)
    except TreeError as e:
        named = f" (or {' or '.join(map(repr, o.choices))})" if o.choices else ""  # the named trees are a fix too
        raise OptionError(f"{o.name}: {e}{named}") from None
    return value


def _int_list(o: Option, value, config):
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or not value:
        raise o.fail(f"a non-empty list of integers{o._range(config)}", value, config)
    for v in value:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not o._in_bounds(int(v), config):
            raise o.fail(f"a list of integers{o._range(config)}", value, config)
    return [int(v) for v in value]


MODEL_WANT = "a model (layerleap.load(...); on the command line a model name or folder)"


def _model(o: Option, value, config):
    if isinstance(value, str) and not value.strip():
        raise o.fail(MODEL_WANT, value)
    if isinstance(value, (str, os.PathLike)):
        with V.raising(OptionError):
            V.path(value, o.name)
    elif value is None or isinstance(value, (bytes, bool, numbers.Number, list, tuple, dict)):
        raise o.fail(MODEL_WANT, value)
    return value  # a loaded model is checked against the main one by the method (companion.check_pair)


def _weights(o: Option, value, config):
    if isinstance(value, str) and value in o.choices:
        return value
    if isinstance(value, str) and not value.strip():  # no file named: the choices are the fix, not "a path"
        raise o.fail(_one_of(o, "an existing weights file"), value)
    if isinstance(value, (str, os.PathLike)):
        with V.raising(OptionError):
            p = V.path(value, o.name)
        if not p.is_file():
            raise o.fail(_one_of(o, "an existing weights file"), value)
        return value
    if isinstance(value, (bytes, bool, numbers.Number, list, tuple, dict)):
        raise o.fail(_one_of(o, "a weights file", "loaded weights"), value)
    return value  # a loaded head or drafter: the method checks it fits the model


def _one_of(o: Option, *more: str) -> str:
    """ "one of" the option's named choices and ``more``; "none" is left to ``fail``, said once with its meaning."""
    items = [c for c in o.choices if not (o.none and c == "none")] + list(more)
    return "one of " + (", ".join(items) if o.none else ", ".join(items[:-1]) + " or " + items[-1])


_CHECKS = {
    "int": _int,
    "float": _float,
    "bool": _bool,
    "text": _text,
    "any": lambda o, value, config: value,
    "choice": _choice,
    "tree": _tree,
    "int_list": _int_list,
    "model": _model,
    "weights": _weights,
}


def infer(fn: Callable) -> tuple[Option, ...]:
    """Declarations read from the keyword options of ``fn(run, ...)``'s signature, for a method registered
    without them: the kind from the default's type (int, float, bool, text; any other default, None or
    none: unchecked)."""
    kinds = {bool: "bool", int: "int", float: "float", str: "text"}
    out = []
    for p in list(inspect.signature(fn).parameters.values())[1:]:
        kind = kinds.get(type(p.default), "any")
        out.append(Option(p.name, kind, "(undeclared)", default=p.default, none="allowed" if kind == "any" else ""))
    return tuple(out)


# -- the shared options -------------------------------------------------------------------------------
def per_dtype(model, table: dict):
    """``table``'s entry (a tree, a draft length, ...) for the model's weight format: a method's per-dtype
    default (fp32's entry for a format the table lacks)."""
    return table.get(model.dtype_name, table["float32"])


MAX_DRAFT_LEN = 256  # drafts per round; more only wastes calls on rejected tokens
MAX_NGRAM = 32  # the n-gram index keeps every n-gram of min_ngram..max_ngram tokens: memory grows with n
SCHEDULES = ("constant", "heuristic")
DECAYS = ("linear", "power")
HEADS = ("auto", "shared", "trained")

EXIT_LAYER = Option(
    "exit_layer",
    "int",
    "the drafting layer: layers [0, exit_layer) and an exit head predict early",
    lo=1,
    hi=LAST_EXIT,
    none="half the depth",
)
DRAFT_LEN = Option("draft_len", "int", "γ: the most tokens drafted per round", lo=1, hi=MAX_DRAFT_LEN)
ADAPTIVE = Option(
    "adaptive",
    "bool",
    "cut each round's chain to the length with the most expected tokens per unit of call cost, from the "
    "row's running acceptance and this machine's call-cost curve (draft_len stays the most)",
    default=None,
    none="on where a 2-token call costs x1.10 or more of a 1-token one (q4 with torch's int4 kernel; fp32 not)",
)
MIN_CONFIDENCE = Option(
    "min_confidence",
    "float",
    "stop drafting after a draft whose top probability is below it; 0 = off",
    default=0.0,
    lo=0.0,
    hi=1.0,
)
SCHEDULE = Option(
    "schedule",
    "choice",
    "constant: γ = draft_len; heuristic: γ starts at draft_len, +2 after a fully accepted round, -1 otherwise "
    "(at least 1; no upper limit but the tokens left)",
    default="constant",
    choices=SCHEDULES,
)
HEAD = Option(
    "head",
    "weights",
    "the exit head: auto (trained if shipped, else shared), shared, trained, or a heads file",
    default="auto",
    choices=HEADS,
)
TREE = Option(
    "tree",
    "tree",
    "the draft tree: top-k per depth ('2,1,1') or rank paths ('0;1;0.0')",
    none="the weight format's tuned tree",
)
TREE_DYNAMIC = TREE.but(
    help="the draft tree: top-k per depth ('2,1,1'), rank paths ('0;1;0.0') or 'dynamic' (each round the "
    "paths of the highest product of draft probabilities, EAGLE-2; tree_nodes of them)",
    choices=("dynamic",),
)
MAX_TREE_NODES = 64  # a dynamic tree's most nodes; the draft steps' top-64 each
TREE_NODES = Option(
    "tree_nodes",
    "int",
    "tree='dynamic': the draft nodes each round verifies",
    lo=1,
    hi=MAX_TREE_NODES,
    none="chosen each round: the count (up to 16) with the most expected tokens per unit of call cost",
)
TREE_DEPTH = Option(
    "tree_depth",
    "int",
    "tree='dynamic': the most draft steps along a path (Hidden Transfer: the pseudo steps every node gets)",
    lo=1,
    hi=MAX_DRAFT_LEN,
    none="the method's tuned depth: hidden-transfer 1 (each step costs every node a pseudo state), medusa every step",
)
MAX_NGRAM_OPT = Option("max_ngram", "int", "the longest n-gram looked up", default=4, lo=1, hi=MAX_NGRAM)
MIN_NGRAM = Option(
    "min_ngram", "int", "the shortest n-gram looked up (<= max_ngram)", lo=1, hi=MAX_NGRAM, none="the dtype's tuned one"
)
K = Option("k", "int", "the sub-processes, one early candidate each", default=1, lo=1, hi=CANDIDATES)
THRESHOLD = Option("threshold", "float", "exit once cos(h_l, h_(l-1)) reaches it; above 1 never exits", default=0.95)
DECAY = Option("decay", "choice", "how the layer budget falls along the sequence", default="linear", choices=DECAYS)
DRAFT_MODEL = Option("draft", "model", "the draft model (same tokenizer)", default=REQUIRED)
TRANSFER = Option(
    "transfer",
    "weights",
    "Hidden Transfer projections: trained (shipped) or a weights file",
    default="trained",
    choices=("trained",),
)
DRAFT_VOCAB = Option(
    "draft_vocab",
    "weights",
    "the tokens a draft scores: auto (the shipped set of frequent tokens, else all), full (the whole vocabulary) "
    "or a draft-vocabulary file; verification scores the whole vocabulary",
    default="auto",
    choices=("auto", "full"),
)
CORPUS = Option(
    "corpus",
    "weights",
    "where the prompt and output hold no match, draft from this datastore of the model's own answers: auto "
    "(the shipped one for this model, if any), none, or a corpus file (layerleap train corpus)",
    default="auto",
    choices=("auto", "none"),
    none="no corpus",
)
CORPUS_DRAFT_LEN = Option(
    "corpus_draft_len",
    "int",
    "the most tokens a round drafts from the corpus (<= draft_len applies too)",
    lo=1,
    hi=MAX_DRAFT_LEN,
    none="the dtype's tuned one",
)
MEDUSA_HEADS = Option(
    "heads", "weights", "Medusa heads: trained (shipped) or a weights file", default="trained", choices=("trained",)
)
WIDTH = Option(
    "width",
    "int",
    "the first draft's top-k verified side by side in a tree (the chain goes on from the top one)",
    lo=1,
    hi=MAX_CANDIDATES,
    none="the weight format's tuned width: fp32/bf16 3, q4 1",
)
EAGLE_HEAD = Option(
    "eagle_head",
    "weights",
    "the EAGLE head: trained (shipped) or a weights file",
    default="trained",
    choices=("trained",),
)
AUTO_MEDUSA = Option(
    "medusa",
    "weights",
    "Medusa heads for auto's Medusa calls: auto (the shipped ones, if any, except in q4 or with the EAGLE head), "
    "none, or a weights file",
    default="auto",
    choices=("auto", "none"),
    none="no Medusa calls",
)
AUTO_EAGLE = Option(
    "eagle",
    "weights",
    "the EAGLE head for auto's EAGLE calls: auto (the shipped one, if any, except in q4 where this machine's "
    "call-cost curve makes a second token cost x1.10 or more), none, or a weights file",
    default="auto",
    choices=("auto", "none"),
    none="no EAGLE calls",
)
MIN_EXIT_LAYER = Option(
    "min_exit_layer", "int", "the fewest layers a token runs (its exit budget)", default=1, lo=1, hi=N_LAYERS
)
MAX_EXIT_LAYER = Option("max_exit_layer", "int", "the most layers a token runs (its exit budget)", lo=1, hi=N_LAYERS)


def check(
    name: str,
    declared: tuple[Option, ...],
    options: dict,
    config: ModelConfig | None = None,
    cli: str = "",
    partial: bool = False,
) -> dict:
    """``options`` of method ``name`` checked against its declarations -> the checked values (ints as
    ``int``, floats as ``float``).  Unknown names and missing required options are refused; values are
    checked as ``Option.check`` does (model-dependent bounds only with ``config``).  ``cli``: the prefix
    of the option on the command line (bench's ``LABEL.``), for the fix the message names.  ``partial``:
    a missing required option is left for later (a calibration that sets it)."""
    by_name = {o.name: o for o in declared}
    unknown = sorted(set(options) - set(by_name), key=str)
    if unknown:
        raise OptionError(
            f"method {name!r} has no option {', '.join(map(str, unknown))}; its options: {', '.join(by_name) or 'none'}"
            " (`layerleap methods` lists them)"
        )
    missing = [o.name for o in declared if o.required and o.name not in options and not partial]
    if missing:
        raise OptionError(
            f"method {name!r} needs the option {missing[0]}: add --opt {cli}{missing[0]}=VALUE (in Python: "
            f"{missing[0]}=...)"
        )
    return {k: by_name[k].check(v, config) for k, v in options.items()}
