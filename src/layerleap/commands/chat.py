"""``layerleap chat``: a conversation in the model's chat template, one turn a line.

A turn's answer streams as it is decoded (``layerleap.stream``) and joins the history, which every
later turn sends whole (the system message first; its prompt pass reuses the keys and values of what the
last turn ran: ``layerleap.PromptCache``, for the methods that can).  On a terminal the prompt line has ``readline``'s
editing and history; from a pipe each line is a turn and the answers are printed, one after another.
Lines that start with ``/`` are commands (``CHAT_HELP``).  Messages about the chat (errors, dropped
turns, a loaded file) go to stderr; answers and ``/stats`` to stdout.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import warnings
from pathlib import Path

from .. import interrupts, validate as V
from ..core.prompt_cache import PromptCache
from ..core.run import chat_token_ids
from ..decoding import METHODS, BudgetWarning, _stop_token_ids, get_method
from ..errors import LayerleapError
from ..files import read_json, write_json
from ..options import resolve_models
from ..streaming import stream
from . import command
from .basic import (
    _check_sampling,
    _check_stops,
    _load,
    _loader,
    _method_options,
    _model_args,
    _need_tokenizer,
    _opt_arg,
    _positive_int,
    _processor_args,
    _processors,
    _sampling_args,
    _say,
    _stats_line,
    _stop_args,
    _stops,
    _threads,
)

ROLES = ("system", "user", "assistant")
CHAT_HELP = """commands:
  /help               this list
  /reset              clear the conversation (the system message stays)
  /system [TEXT]      set the system message (without TEXT: drop it)
  /method NAME [k=v]  switch the decoding method, with its options (as --method and --opt)
  /stats              the last answer: tokens, tokens/s, tokens per model call, prompt tokens reused, acceptance
  /save FILE.json     write the conversation as JSON messages
  /load FILE.json     read a conversation written by /save (a JSON list of messages)
  /quit               end the chat (so do Ctrl-D and Ctrl-C at the prompt)
Ctrl-C while an answer streams stops it: the text printed so far stays in the conversation as the
answer (nothing printed: the turn is dropped).  To send a message that starts with /, write // for
its first / (//etc sends /etc)."""


# -- the command line -------------------------------------------------------------------------------
@command("chat", help="chat with a model in its chat template: type a turn, the answer streams (/help: commands)")
def _setup_chat(p):
    p.epilog = CHAT_HELP
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    _model_args(p)
    p.add_argument(
        "--method",
        default="greedy",
        help=f"decoding method: {', '.join(METHODS)} (default greedy; `layerleap methods` lists them with their "
        "options; /method switches it)",
    )
    p.add_argument("--system", type=V.text_arg, default=None, metavar="TEXT", help="the system message")
    p.add_argument(
        "--max-new-tokens", type=_positive_int, default=256, help="the longest answer, in tokens (default 256)"
    )
    p.add_argument(
        "--load",
        type=V.tagged(V.path_arg, "in"),
        default=None,
        metavar="FILE",
        help="start from a conversation that /save wrote (a JSON list of messages)",
    )
    _stop_args(p)
    _sampling_args(p)
    _processor_args(p)
    _opt_arg(p, "NAME=VALUE", "a method option (repeatable)")


@_setup_chat
def run_chat(args) -> int:
    options = _method_options(args.method, args.opt)  # everything that can fail before loading the model
    sampling = _check_sampling(args.method, args)
    _check_stops(args)
    procs = _processors(args, None)
    loaded = read_conversation(args.load, "--load") if args.load is not None else None
    threads = _threads(args.threads)
    model = _load(args)
    _need_tokenizer(model, args)
    if not getattr(model.tokenizer, "chat_template", None):
        raise LayerleapError(
            f"--model {args.model} has no chat template (tokenizer.chat_template): chat needs one; "
            "continue text with `layerleap generate` instead"
        )
    get_method(args.method).check_options(options, model.config)
    _processors(args, None, model)  # the token ids against the model's vocabulary: not at every turn
    if args.stop_token_ids:
        try:
            _stop_token_ids(args.stop_token_ids, model.config.vocab_size)
        except LayerleapError as e:
            raise LayerleapError(str(e).replace("stop_token_ids", "--stop-token-ids")) from None
    kwargs = {**sampling, **procs, **resolve_models(args.method, options, _loader(args))}
    kwargs.update(_stops(args))
    chat = Chat(model, args, threads, kwargs)
    if args.system is not None:
        chat.system = args.system
    if loaded is not None:
        chat.take(loaded, args.load)
    return chat.run()


# -- conversation files -----------------------------------------------------------------------------
def read_conversation(path, name: str = "/load") -> list[dict]:
    """The messages of a conversation file (what ``/save`` writes: a JSON list of ``{"role", "content"}``;
    an object with ``"messages"`` too), checked: a ``LayerleapError`` names the problem and the fix."""
    p = V.path(path, name)
    fix = 'give a file that /save wrote: [{"role": "user", "content": "..."}, ...]'
    if p.is_dir():
        raise LayerleapError(f"{name} {p} is a folder: {fix}")
    value = read_json(p, "conversation file", fix, kind=None)
    if isinstance(value, dict) and "messages" in value:
        value = value["messages"]
    if not isinstance(value, list):
        raise LayerleapError(f"conversation file {p} holds JSON {type(value).__name__}, not a list of messages: {fix}")
    out = []
    for k, m in enumerate(value):
        where = f"conversation file {p}: message {k}"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise LayerleapError(f"{where} is not {{'role': text, 'content': text}} (got {V.show(m)}): {fix}")
        if m["role"] not in ROLES:
            raise LayerleapError(f"{where} has role {m['role']!r}: a role is one of {', '.join(ROLES)}")
        if m["role"] == "system" and k:
            raise LayerleapError(f"{where} is a system message: only the first message may be one")
        V.text(m["content"], f"{where}'s content")
        turn = len(out) - (1 if out and out[0]["role"] == "system" else 0)  # its place after the system message
        if m["role"] != "system" and m["role"] != ROLES[1 + turn % 2]:
            raise LayerleapError(
                f"{where} has role {m['role']!r} where {ROLES[1 + turn % 2]!r} belongs: a conversation alternates "
                "user and assistant messages, a user's first (after the system message)"
            )
        out.append({"role": m["role"], "content": m["content"]})
    if out and out[-1]["role"] == "user":
        raise LayerleapError(
            f"conversation file {p} ends with a user message, which has no answer: drop it from the file (and type it "
            "after loading)"
        )
    return out


def _is_conversation_file(p: Path) -> bool:
    try:
        read_conversation(p)
    except LayerleapError:
        return False
    return True


# -- the chat ---------------------------------------------------------------------------------------
class Chat:
    """The conversation and the decoding settings of one ``layerleap chat``."""

    def __init__(self, model, args, threads: int, kwargs: dict):
        self.model, self.args, self.threads = model, args, threads
        self.method, self.kwargs = args.method, kwargs
        self.system: str | None = None
        self.history: list[dict] = []  # user and assistant messages, oldest first
        self.last = None  # the last answer's Stats; "interrupted" when Ctrl-C cut it
        self.dropped_said = False
        self.notes_said: set[str] = set()  # the budget notes said (each once)
        self.tty = sys.stdin is not None and sys.stdin.isatty()
        self.lines_read = 0  # from a pipe
        # each turn's prompt pass runs only what the last turn did not (the methods that reuse a prompt cache)
        self.cache = PromptCache()

    # -- the loop
    def run(self) -> int:
        if sys.stdin is None:
            raise LayerleapError("chat reads the turns from stdin, but stdin is closed: run it in a terminal or pipe")
        if self.tty:
            try:
                import readline  # noqa: F401  (input() edits the line and keeps a history)
            except ImportError:
                pass
            _say(f"chat with {self.model.config.name} ({self.method}): /help lists the commands, Ctrl-D ends it")
        while True:
            try:
                line = self._read()
            except KeyboardInterrupt:  # Ctrl-C at the prompt ends the chat
                interrupts.handled()
                if self.tty:
                    print(file=sys.stderr)
                return 0
            if line is None:
                return 0
            if not line.strip():
                continue
            if line.startswith("/") and not line.startswith("//"):
                if self.command(line.strip()) == "quit":
                    return 0
                continue
            self.turn(line.removeprefix("/"))

    def _read(self) -> str | None:
        """The next line (None at the end of the input), without its newline."""
        if self.tty:
            try:
                return input(">>> ")
            except EOFError:
                print(file=sys.stderr)
                return None
            except UnicodeDecodeError:
                self.error("the line is not valid UTF-8: type it again")
                return ""
        data = sys.stdin.buffer.readline()
        if not data:
            return None
        if not self.lines_read:  # a byte-order mark (a file saved on Windows) is no text
            data = data.removeprefix(b"\xef\xbb\xbf")
        self.lines_read += 1
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            self.error("a line on stdin is not valid UTF-8: give UTF-8 text (the line is skipped)")
            return ""
        return text.removesuffix("\n").removesuffix("\r")

    def error(self, msg: str) -> None:
        print(f"layerleap chat: error: {msg}", file=sys.stderr, flush=True)

    # -- one turn
    def messages(self) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system is not None else []
        return head + self.history

    def context(self) -> tuple[int, str]:
        """The context the conversation and an answer must fit, and whose it is: the model's, or a second
        model's (a draft) when that one's is shorter."""
        ctx, whose = self.model.config.max_position, "the model's"
        for key in get_method(self.method).models:
            other = getattr(self.kwargs.get(key), "config", None)
            if other is not None and other.max_position < ctx:
                ctx, whose = other.max_position, f"the {key} model's"
        return ctx, whose

    def fit(self) -> list[dict] | None:
        """The conversation as sent: the oldest turns dropped (the system message kept) until it and the
        answer fit the model's context (``context``); None when the last message alone does not (the history
        is then left as it was)."""
        (ctx, whose), most = self.context(), self.args.max_new_tokens
        tok = self.model.tokenizer
        head = [{"role": "system", "content": self.system}] if self.system is not None else []
        history = self.history
        while True:
            messages = head + history
            n = len(chat_token_ids(tok, messages, add_generation_prompt=True))
            if n + most <= ctx:
                break
            if len(history) <= 1:
                return None
            cut = next((i for i in range(1, len(history)) if history[i]["role"] == "user"), None)
            history = history[cut if cut is not None else len(history) - 1 :]
        if history is not self.history:
            self.history = history
            if not self.dropped_said:
                self.dropped_said = True
                _say(
                    f"note: the conversation and an answer of --max-new-tokens {most} are beyond {whose} context "
                    f"of {ctx} tokens: the oldest turns are dropped (the system message stays)"
                )
        return messages

    def turn(self, text: str) -> None:
        self.history.append({"role": "user", "content": text})
        shown, said = [], []
        try:
            messages = self.fit()
            if messages is None:
                alone = self.messages()[: 1 if self.system is not None else 0] + self.history[-1:]
                n = len(chat_token_ids(self.model.tokenizer, alone, add_generation_prompt=True))
                self.history.pop()
                ctx, whose = self.context()
                self.error(
                    f"this message is {n} tokens in the chat template (the system message included); with "
                    f"--max-new-tokens {self.args.max_new_tokens} that exceeds {whose} context of "
                    f"{ctx}: shorten it (or the system message), or lower --max-new-tokens"
                )
                return
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always", BudgetWarning)
                s = stream(
                    self.model, messages, self.method, self.args.max_new_tokens, prompt_cache=self.cache, **self.kwargs
                )
                for piece in s:
                    print(piece, end="", flush=True)
                    shown.append(piece)
        except KeyboardInterrupt:
            self._stopped(shown, said)
            return
        except LayerleapError as e:
            if interrupts.interrupted():  # a library turned the Ctrl-C into this error: it stopped the answer
                self._stopped(shown, said)
                return
            if shown:
                print(flush=True)
            if self.history and self.history[-1]["role"] == "user":
                self.history.pop()
            self.error(str(e))
            return
        print(flush=True)
        self._notes(said)
        self.last = s.result.stats
        self._answer(s.result.text)

    def _stopped(self, shown: list[str], said: list) -> None:
        """Ctrl-C stopped the answer: the text printed so far is the answer, and the chat goes on."""
        interrupts.handled()
        if shown:
            print(flush=True)
        self._notes(said)
        _say("[stopped]")
        self.last = "interrupted"
        self._answer("".join(shown))

    def _notes(self, said: list) -> None:
        """The budget notes of a lossy method (``BudgetWarning``), each once a chat, after the answer's line."""
        for msg in dict.fromkeys(str(w.message) for w in said if issubclass(w.category, BudgetWarning)):
            if msg not in self.notes_said:
                self.notes_said.add(msg)
                _say(msg)

    def _answer(self, text: str) -> None:
        if text:
            self.history.append({"role": "assistant", "content": text})
        else:  # nothing to keep: the turn goes too, so that users and assistants alternate
            self.history.pop()

    # -- the commands
    def command(self, line: str) -> str | None:
        name, _, rest = line.partition(" ")
        rest = rest.strip()
        if name in ("/quit", "/exit", "/bye"):
            return "quit"
        if name in ("/help", "/?"):
            print(CHAT_HELP, flush=True)
        elif name == "/reset":
            self.history = []
            self.last = None
            self.dropped_said = False
            _say("the conversation is cleared")
        elif name == "/system":
            self.system = rest or None
            _say("the system message is set" if rest else "the system message is dropped")
        elif name == "/method":
            self.switch(rest)
        elif name == "/stats":
            self.stats()
        elif name in ("/save", "/load"):
            if not rest:
                self.error(f"{name} needs a file: {name} FILE.json")
                return None
            try:
                self.save(rest) if name == "/save" else self.take(read_conversation(rest), rest)
            except LayerleapError as e:
                self.error(str(e))
        else:
            self.error(f"unknown command {name}: /help lists the commands (start a message with // to send /)")
        return None

    def switch(self, rest: str) -> None:
        try:
            words = shlex.split(rest)
        except ValueError as e:
            self.error(f"/method {rest}: {e}: write /method NAME [option=value ...]")
            return
        if not words:
            self.error(f"/method needs a method name: one of {', '.join(METHODS)}")
            return
        name, items = words[0], words[1:]
        try:
            options = _method_options(name, items or None)
            sampling = _check_sampling(name, self.args)
            procs = _processors(argparse.Namespace(**{**vars(self.args), "method": name}), None)
            get_method(name).check_options(options, self.model.config)
            models = resolve_models(name, options, _loader(self.args))
        except LayerleapError as e:
            self.error(str(e))
            return
        self.method = name
        self.kwargs = {**sampling, **procs, **models, **_stops(self.args)}
        _say(f"method {name}" + (f" ({' '.join(items)})" if items else ""))

    def stats(self) -> None:
        if self.last is None:
            print("no answer yet", flush=True)
            return
        if self.last == "interrupted":
            print("the last answer was stopped (Ctrl-C): it has no stats", flush=True)
            return
        st = self.last
        line = _stats_line(st, self.threads)
        if st.cached_prompt_tokens:
            line += f", {st.cached_prompt_tokens} prompt tokens reused"
        if st.draft is not None and st.draft.acceptance is not None:
            line += f", acceptance {st.draft.acceptance:.2f} ({st.draft.accepted}/{st.draft.drafted} drafts)"
        print(line, flush=True)

    def save(self, where: str) -> None:
        p = V.output_file(where, "/save", (".json",), "conversation file")
        if p.is_file() and p.stat().st_size and not _is_conversation_file(p):
            raise LayerleapError(
                f"/save {p} exists and is not a conversation file: choose another file name (or delete it)"
            )
        write_json(p, self.messages())
        _say(f"saved {len(self.messages())} messages to {p}")

    def take(self, messages: list[dict], where) -> None:
        """Continue the conversation ``messages`` (a system message in it replaces the one set)."""
        if messages and messages[0]["role"] == "system":
            self.system, messages = messages[0]["content"], messages[1:]
        self.history = list(messages)
        self.last = None
        _say(f"loaded {len(messages)} messages from {where}")
