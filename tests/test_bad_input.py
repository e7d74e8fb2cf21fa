"""The bad-input table: hostile values for every command (from each ``--help``) and public function
(from each signature).  Each must fail cleanly before any heavy work: exit code 2 (the CLI) or a
``LayerleapError`` subclass (the API), one non-empty line that names the problem, no traceback.

CLI rows run in-process through ``layerleap.cli.main``; a few run as real subprocesses (undecodable
bytes on stdin and in argv, and the console script itself).  ``{NAME}`` in a row is a path made by
the ``places`` fixture (tiny models, broken model folders, files that are not what they claim).

Four kinds of fault have a rule each, checked in one place: an output never replaces an input or a
file of another kind (``cli.check_paths``, ``files.check_replace``: a test fails if any byte under
the folder changes), files and stdin are read up to a limit (``validate.read_bounded``), a run
estimated beyond ``--max-hours`` is refused (``workload``), and Ctrl-C during a heavy import waits
for the import (``interrupts.HEAVY``, in test_interrupts.py).

A fuzz pass (a script, not part of the suite) sent hostile values -- empty, negative, NaN, inf,
40-digit numbers, 5,000-character strings, undecodable bytes, NUL, ``~nosuchuser``, /dev/null,
/proc/self/mem, folders, the files of other arguments (hard links too) -- to every argument of every
command (2,058 command lines, in-process on a tiny model, each stopped after 8 s), to ``generate``,
``load``, every method option and ``save_safetensors`` (444 calls) and to both server routes (434
requests: every field with 16 values of the wrong kind, broken JSON, a 3 MB body).  The first
pass found 19 tracebacks: a name longer than the OS allows (now refused in ``validate.path``),
``~nosuchuser`` in ``--variant`` (pathlib's RuntimeError), ``--lr 1e40`` (Adam overflowed; learning
rates now lie in (0, 1]); rows for each are in the tables below.  The second pass: 2,936 inputs
over 3 surfaces, 0 tracebacks, 0 server errors (5xx), 0 changed input files; 2,731 clean refusals,
169 accepted (read as valid values), 2 weights replaced by weights of their kind (allowed), 34
stopped by the time limit while doing real work.  Left: ``theory
ppd`` without ``--measure`` accepts the ``--measure`` flags and ignores them, and the ``auto``
method's ``tree`` option accepts any value (method options are declared with their bounds in
``layerleap.options``' design)."""

from __future__ import annotations

import importlib
import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from subprocs import layerleap_cmd
from tiny_models import random_model, save_hf_folder

import layerleap
from layerleap import LayerleapError
from layerleap.cli import main

# -- fixtures: files that are not what they claim ---------------------------------------------------


def _break_folder(root, name, damage):
    folder = save_hf_folder(random_model(), root / name, shards=2)
    damage(folder)
    return folder


def _truncate(f):
    p = f / "model-00001-of-00002.safetensors"
    p.write_bytes(p.read_bytes()[:-100])


def _config(**changes):
    def damage(f):
        cfg = json.loads((f / "config.json").read_text())
        for k, v in changes.items():
            if v is None:
                cfg.pop(k)
            else:
                cfg[k] = v
        (f / "config.json").write_text(json.dumps(cfg))

    return damage


def _overlap(f):
    import struct

    p = f / "model-00001-of-00002.safetensors"
    b = p.read_bytes()
    n = struct.unpack("<Q", b[:8])[0]
    header = json.loads(b[8 : 8 + n])
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
    begin, end = header[names[1]]["data_offsets"]
    header[names[1]]["data_offsets"] = [0, end - begin]  # shares the first tensor's bytes
    text = json.dumps(header).encode()
    p.write_bytes(struct.pack("<Q", len(text)) + text + b[8 + n :])


def _duplicate(f):
    import shutil

    (f / "model.safetensors.index.json").unlink()
    shutil.copy(f / "model-00001-of-00002.safetensors", f / "copy.safetensors")


BROKEN = {
    "TRUNCATED": _truncate,
    "NOSHARD": lambda f: (f / "model-00002-of-00002.safetensors").unlink(),
    "BADCONFIG": lambda f: (f / "config.json").write_text('{"model_type": llama'),
    "BADTOKENIZER": lambda f: (f / "tokenizer.json").write_text('{"version": '),
    "BADHEADER": lambda f: (f / "model-00002-of-00002.safetensors").write_bytes(b"\xff" * 64),
    "SHAPES": _config(hidden_size=64),
    "NOHEADS": _config(num_attention_heads=None),
    "KV0": _config(num_key_value_heads=0),
    "HUGEVOCAB": _config(vocab_size=10**12),
    "GPT2": _config(model_type="gpt2"),
    "LISTCONFIG": lambda f: (f / "config.json").write_text("[1, 2]"),
    "BADINDEX": lambda f: (f / "model.safetensors.index.json").write_text('{"weight_map": 5}'),
    "OVERLAP": _overlap,
    "DUPLICATE": _duplicate,
    "ROPESTR": _config(rope_scaling="yes"),
    "EOSBAD": _config(eos_token_id=[1, "x"]),
    "EPSNAN": lambda f: (f / "config.json").write_text(
        (f / "config.json").read_text().replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": NaN')
    ),
    "BADTOKCONFIG": lambda f: (
        (f / "tokenizer.json").write_text("{}"),
        (f / "tokenizer_config.json").write_text('{"tokenizer_class": "NoSuchTokenizer"}'),
    ),
}


@pytest.fixture(scope="module")
def busy_port():
    """A port this process listens on (so a server cannot bind it)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture(scope="module")
def places(tmp_path_factory, char_model_dir, busy_port):
    root = tmp_path_factory.mktemp("bad_input")
    from layerleap.drafters import medusa_transfer as drafters

    tiny = layerleap.load_folder(char_model_dir)
    medusa = root / "medusa.safetensors"
    drafters.save_drafter(drafters.new_drafter(tiny, "medusa", steps=2), medusa)
    (root / "notes.txt").write_text("my notes\n")
    (root / "notes.json").write_text(json.dumps({"mine": [1, 2, 3]}))
    (root / "garbage.jsonl").write_text("{not json\n")
    (root / "calib.json").write_text("[1, 2]")
    (root / "ft").mkdir()
    (root / "ft" / "skipdecode_train.json").write_text("{bad")
    (root / "work").mkdir()
    (root / "work" / "state.safetensors").write_text("garbage")
    (root / "m.safetensors.ckpt.safetensors").write_text("garbage")
    (root / "weird.jsonl").write_text('{"question_id": "x", "category": 5, "turns": ["hi"]}\n')
    (root / "empty").mkdir()
    (root / "notmodel").mkdir()
    (root / "notmodel" / "keep.txt").write_text("x")
    from safetensors.torch import save_file

    save_file({"chunks": torch.arange(10)}, str(root / "chunks1d.safetensors"))
    save_file({"chunks": torch.arange(16).view(2, 8)}, str(root / "chunks.safetensors"))
    save_file({"chunks": torch.full((2, 8), 10**6)}, str(root / "chunksvocab.safetensors"))
    (root / "empty.jsonl").write_text("")
    notok = save_hf_folder(random_model(dict(vocab_size=128, max_position=2048)), root / "notok")  # no tokenizer
    other = random_model(dict(vocab_size=128, max_position=2048, hidden_size=48, n_heads=4, n_kv_heads=2))
    other.set_fingerprint(tiny.fingerprint)  # heads of another shape that claim to fit this model
    drafters.save_drafter(drafters.new_drafter(other, "medusa", steps=2), root / "medusa_shapes.safetensors")
    save_file({"chunks": torch.arange(6).view(2, 3)}, str(root / "short.safetensors"))
    nochat = Path(shutil.copytree(char_model_dir, root / "nochat"))
    (nochat / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((nochat / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (nochat / "tokenizer_config.json").write_text(json.dumps(cfg))
    out = {
        "NOCHAT": str(nochat),
        "D": str(char_model_dir),
        "EMPTYJSONL": str(root / "empty.jsonl"),
        "NOTOK": str(notok),
        "MEDUSA_SHAPES": str(root / "medusa_shapes.safetensors"),
        "T": str(root),
        "BUSYPORT": str(busy_port),
        "FILE": str(root / "notes.txt"),
        "NOTES_JSON": str(root / "notes.json"),
        "GARBAGE": str(root / "garbage.jsonl"),
        "WEIRD": str(root / "weird.jsonl"),
        "EMPTY": str(root / "empty"),
        "NOTMODEL": str(root / "notmodel"),
        "MEDUSA": str(medusa),
        "CHUNKS1D": str(root / "chunks1d.safetensors"),
        "CHUNKS": str(root / "chunks.safetensors"),
        "CHUNKSVOCAB": str(root / "chunksvocab.safetensors"),
        "SHORT": str(root / "short.safetensors"),
    }
    for name, damage in BROKEN.items():
        out[name] = str(_break_folder(root, name.lower(), damage))
    return out


def _fill(argv, places):
    out = []
    for a in argv:
        for k, v in places.items():
            a = a.replace("{" + k + "}", v)
        out.append(a)
    return out


# -- the command line -------------------------------------------------------------------------------
G = ["generate", "--model", "{D}", "--prompt", "hi", "--max-new-tokens", "2"]
M = ["--model", "{D}"]
SB = ["sweep", "bild", "--model", "{D}", "--exit-layer", "2", "--prompts", "1", "--max-new-tokens", "2"]
AL = ["align", "--model", "{D}", "--prompts", "1", "--max-new-tokens", "2"]
FT = ["finetune", "skipdecode", "--model", "{D}", "--steps", "1"]
TH = ["train", "heads", "--model", "{D}", "--tokens", "10"]
TM = ["train", "medusa", "--model", "{D}", "--steps", "1", "--seq-len", "8"]
TE = ["train", "eagle", "--model", "{D}", "--steps", "1", "--seq-len", "8"]
TT = ["train", "transfer", "--model", "{D}", "--steps", "1", "--seq-len", "8"]
MR = ["match-rate", "--model", "{D}", "--prompts", "1", "--max-new-tokens", "2"]
SV = ["heads", "sub-vocab", "--model", "{D}"]
EX = ["eval", "exactness", "--model", "{D}", "--prompts", "1", "--categories", "qa", "--max-new-tokens", "2"]

CLI = [
    # the command line itself
    ([], "the following arguments are required: COMMAND"),
    (["nope"], "invalid choice: 'nope'"),
    (["train"], "the following arguments are required: {heads,transfer,medusa,eagle,data,corpus}"),
    (["eval"], "the following arguments are required"),
    (["generate"], "one of the arguments --prompt --prompts-file is required"),
    (["generate", "--prompt"], "expected one argument"),
    (G + ["--bogus"], "unrecognized arguments: --bogus"),
    (["generate", "--model", "{D}", "--prompt", "hi", "--max-new", "2"], "unrecognized arguments: --max-new"),
    # generate: the model
    (["generate", "--model", "no-such-model", "--prompt", "hi"], "unknown model 'no-such-model'"),
    (["generate", "--model", "{FILE}", "--prompt", "hi"], "unknown model"),
    (["generate", "--model", "~nosuchuser/m", "--prompt", "hi"], "unknown model '~nosuchuser/m'"),
    (["generate", "--model", "{EMPTY}", "--prompt", "hi"], "has no config.json"),
    (["generate", "--model", "{TRUNCATED}", "--prompt", "hi"], "model-00001-of-00002.safetensors is truncated"),
    (["generate", "--model", "{NOSHARD}", "--prompt", "hi"], "lacks the shard(s) model-00002-of-00002.safetensors"),
    (["generate", "--model", "{BADCONFIG}", "--prompt", "hi"], "config.json is not valid JSON"),
    (["generate", "--model", "{BADTOKENIZER}", "--prompt", "hi"], "tokenizer.json is not valid JSON"),
    (
        ["generate", "--model", "{BADHEADER}", "--prompt", "hi"],
        "model-00002-of-00002.safetensors is not a safetensors file",
    ),
    (["generate", "--model", "{SHAPES}", "--prompt", "hi"], "config.json implies"),
    (["generate", "--model", "{NOHEADS}", "--prompt", "hi"], "num_attention_heads is missing"),
    (["generate", "--model", "{KV0}", "--prompt", "hi"], "num_key_value_heads must be a positive integer"),
    (["generate", "--model", "{HUGEVOCAB}", "--prompt", "hi"], "vocab_size must be a positive integer up to"),
    (["generate", "--model", "{GPT2}", "--prompt", "hi"], "unsupported architecture model_type='gpt2'"),
    (["generate", "--model", "{LISTCONFIG}", "--prompt", "hi"], "holds JSON list, not an object"),
    (["generate", "--model", "{BADINDEX}", "--prompt", "hi"], "has no weight_map"),
    (["generate", "--model", "{BADTOKCONFIG}", "--prompt", "hi"], "cannot load the tokenizer"),
    (["generate", "--model", "{OVERLAP}", "--prompt", "hi"], "does not start where the one before it ends"),
    (["generate", "--model", "{DUPLICATE}", "--prompt", "hi"], "keep one copy of the weights"),
    (["generate", "--model", "{ROPESTR}", "--prompt", "hi"], "rope_scaling must be an object"),
    (["generate", "--model", "{EOSBAD}", "--prompt", "hi"], "eos_token_id [1, 'x'] is not a token id"),
    (["generate", "--model", "{EPSNAN}", "--prompt", "hi"], "rms_norm_eps must be a positive number, got nan"),
    (G + ["--dtype", "int8"], "invalid choice: 'int8'"),
    # generate: the run
    (G + ["--method", "nope"], "unknown method 'nope'"),
    (["generate", "--model", "{D}", "--prompt", "  \n "], "the prompt is empty"),
    (["generate", "--model", "{D}", "--prompt", "bad \udcff text"], "is not valid UTF-8"),
    (G + ["--max-new-tokens", "0"], "must be a positive integer, got 0"),
    (G + ["--max-new-tokens", "-3"], "must be a positive integer"),
    (G + ["--max-new-tokens", "x"], "must be a positive integer, got 'x'"),
    (G + ["--max-new-tokens", "1e3"], "must be a positive integer"),
    (G + ["--max-new-tokens", "99999999"], "--max-new-tokens 99999999 is beyond tiny's context of 2048"),
    (G + ["--temperature", "0"], "must be a finite number >= 1e-06"),
    (G + ["--temperature", "nan"], "must be a finite number >= 1e-06, got nan"),
    (G + ["--method", "sample", "--temperature", "1e-320"], "must be a finite number >= 1e-06"),
    (G + ["--temperature", "inf"], "got inf"),
    (G + ["--temperature", "warm"], "must be a finite number"),
    (G + ["--top-k", "-1"], "must be an integer >= 0"),
    (G + ["--top-k", "1.5"], "must be an integer >= 0"),
    (G + ["--top-p", "0"], "must be a finite number in (0, 1]"),
    (G + ["--top-p", "1.5"], "must be a finite number in (0, 1]"),
    (G + ["--top-p", "nan"], "got nan"),
    (G + ["--seed", "-1"], "must be an integer in [0, 4294967295]"),
    (G + ["--seed", str(2**64)], "must be an integer in [0, 4294967295]"),
    (G + ["--seed", "9" * 40], "must be an integer in [0, 4294967295]"),
    (G + ["--seed", "1.5"], "must be an integer in [0, 4294967295]"),
    (G + ["--threads", "0"], "must be an integer in [1, "),
    (G + ["--threads", "100000"], "this machine has"),
    (G + ["--threads", "many"], "must be an integer in [1, "),
    (G + ["--opt", "k3"], "bad option 'k3': write NAME=VALUE"),
    (G + ["--opt", "=3"], "bad option '=3'"),
    (G + ["--opt", "k=3"], "method 'greedy' has no option k"),
    (G + ["--method", "sample", "--opt", "foo=1"], "method 'sample' has no option foo"),
    (G + ["--method", "medusa", "--opt", "heads={MEDUSA}", "--opt", "tree=100000"], "more than 512 nodes"),
    (G + ["--method", "medusa", "--opt", "heads={MEDUSA}", "--opt", "tree=1,1,1"], "the tree is 3 deep"),
    (G + ["--method", "medusa", "--opt", "heads={MEDUSA}", "--opt", "tree=a;b"], "cannot read the tree shape"),
    (G + ["--method", "medusa", "--opt", "heads={MEDUSA}", "--opt", "tree=0.1;2"], "has no parent"),
    (
        G + ["--method", "medusa", "--opt", "heads={MEDUSA}", "--opt", "tree=2,1", "--opt", "tree_nodes=4"],
        "tree_nodes shapes a dynamic tree only, and the tree is not one: give tree='dynamic' too",
    ),
    (
        G + ["--method", "medusa", "--opt", "heads={MEDUSA}", "--opt", "tree=dynamic", "--opt", "tree_nodes=0"],
        "tree_nodes must be an integer in [1, 64]",
    ),
    (G + ["--method", "auto", "--opt", "tree=dynamic"], "cannot read the tree shape 'dynamic'"),
    (G + ["--method", "medusa", "--opt", "heads={FILE}"], "cannot read Medusa heads"),
    (G + ["--method", "medusa"], "no shipped medusa weights fit tiny"),
    (G + ["--method", "hidden-transfer", "--opt", "transfer={MEDUSA}"], "transfer"),
    (
        G + ["--method", "skipdecode", "--opt", "target_speedup=nan"],
        "target_speedup must be a finite number in [1, n_layers]",
    ),
    (
        G + ["--method", "skipdecode", "--opt", "target_speedup=inf"],
        "target_speedup must be a finite number in [1, n_layers]",
    ),
    (
        G + ["--method", "skipdecode", "--opt", "target_speedup=0.5"],
        "target_speedup must be a finite number in [1, n_layers]",
    ),
    (G + ["--method", "skipdecode", "--opt", "power=nan"], "power must be a finite number > 0"),
    (G + ["--method", "skipdecode", "--opt", "max_len=true"], "max_len must be an integer in [2, context]"),
    (G + ["--method", "skipdecode", "--opt", "decay=cubic"], "decay must be one of linear, power, got 'cubic'"),
    (
        G + ["--method", "skipdecode", "--opt", "schedule=1234"],  # one number: a list of one
        "schedule must be a list of integers in [1, 4] (n_layers = 4 on this model) or none",
    ),
    (
        G + ["--method", "skipdecode", "--opt", "min_exit_layer=3", "--opt", "max_exit_layer=2"],
        "min_exit_layer=3 > max_exit_layer=2",
    ),
    (["generate", "--model", "{NOCHAT}", "--prompt", "hi", "--chat"], "no chat template: decode the prompt as it is"),
    # chat: the model and the start
    (["chat", "--model", "{NOCHAT}"], "has no chat template (tokenizer.chat_template): chat needs one"),
    (["chat", "--model", "{NOTOK}"], "has no tokenizer (no tokenizer.json"),
    (["chat", *M, "--bogus"], "unrecognized arguments: --bogus"),
    (["chat", *M, "--max-new-tokens", "0"], "--max-new-tokens"),
    (["chat", *M, "--max-new-tokens", "5000"], "--max-new-tokens 5000 is beyond tiny's context of 2048 tokens"),
    (["chat", *M, "--system"], "expected one argument"),
    (G + ["--method", "medusa", "--opt", "tree=false"], "a tree shape is top-k per depth"),
    (G + ["--method", "medusa", "--opt", "tree=0.0"], "a tree shape is top-k per depth"),
    (G + ["--method", "ppd", "--opt", "k=0"], "k must be an integer in [1, min(vocab_size, 64)], got 0"),
    (G + ["--method", "ppd", "--opt", "k=65"], "k must be an integer in [1, min(vocab_size, 64)], got 65"),
    (G + ["--method", "ppd", "--opt", "k=abc"], "k must be an integer in [1, min(vocab_size, 64)], got 'abc'"),
    (
        G + ["--method", "ppd", "--opt", "k=100000"],
        "k must be an integer in [1, min(vocab_size, 64)], got 100000",
    ),
    (
        G + ["--method", "ppd", "--opt", "exit_layer=1.5"],
        "exit_layer must be an integer in [ceil(n_layers/2), n_layers-1]",
    ),
    (G + ["--method", "self-spec", "--opt", "draft_len=100000"], "draft_len must be an integer in [1, 256]"),
    (
        G + ["--method", "self-spec", "--opt", "min_confidence=2"],
        "min_confidence must be a finite number in [0, 1], got 2",
    ),
    (G + ["--method", "self-spec", "--opt", "exit_layer=0"], "exit_layer must be an integer in [1, n_layers-1]"),
    (G + ["--method", "speculative"], "method 'speculative' needs the option draft: add --opt draft=VALUE"),
    (G + ["--method", "speculative", "--opt", "draft=no-such-model"], "--opt draft: unknown model 'no-such-model'"),
    (G + ["--method", "speculative", "--opt", "draft={D}", "--opt", "draft_len=0"], "draft_len must be an integer"),
    (G + ["--method", "speculative", "--opt", "draft={D}", "--opt", "schedule=fast"], "schedule must be one of"),
    (G + ["--method", "bild", "--opt", "alpha_fb=nan"], "alpha_fb must be a finite number in [0, 1], got nan"),
    (
        G + ["--method", "bild", "--opt", "alpha_rb=-1"],
        "alpha_rb must be a finite number >= 0; inf: never roll back, got -1",
    ),
    (G + ["--method", "bild", "--opt", "max_small=0"], "max_small must be an integer in [1, 256]"),
    (G + ["--method", "bild", "--opt", "max_small=1000000000"], "max_small must be an integer in [1, 256]"),
    (G + ["--method", "bild", "--opt", f"max_small={2**63 - 1}"], "max_small must be an integer in [1, 256]"),
    (G + ["--method", "bild", "--opt", "exit_layer=99"], "exit_layer must be an integer in [1, 3]"),
    (G + ["--method", "bild", "--opt", "small=no-such-model"], "--opt small: unknown model"),
    (G + ["--method", "calm", "--opt", "threshold=nan"], "threshold must be a finite number, got nan"),
    (
        G + ["--method", "calm", "--opt", "min_exit_layer=0"],
        "min_exit_layer must be an integer in [1, n_layers], got 0",
    ),
    (G + ["--method", "early-exit"], "needs the option exit_layer"),
    (
        G + ["--method", "early-exit", "--opt", "exit_layer=true"],
        "exit_layer must be an integer in [1, n_layers], got True",
    ),
    (G + ["--method", "sample", "--opt", "tree=1"], "has no option tree"),
    # methods
    (["methods", "--bogus"], "unrecognized arguments: --bogus"),
    (["methods", "greedy"], "unrecognized arguments: greedy"),
    (["native", "--bogus"], "unrecognized arguments: --bogus"),
    (["native", "build"], "unrecognized arguments: build"),
    (["cache", "clear"], "say what to delete: --stale"),
    (["cache", "clear", "--all", "--kind", "native"], "--all deletes every entry"),
    (["cache", "tidy"], "invalid choice: 'tidy'"),
    (["score"], "one of the arguments --prompt --prompts-file is required"),
    (["score", "--prompt", "hi", "--top", "99"], "must be an integer in [0, 20], got 99"),
    # serve (the address is tried before the model loads)
    (["serve", *M, "--port", "70000"], "must be an integer in [0, 65535]"),
    (["serve", *M, "--port", "-1"], "must be an integer in [0, 65535]"),
    (["serve", *M, "--port", "http"], "must be an integer in [0, 65535]"),
    (["serve", *M, "--host", "256.1.1.1"], "cannot serve on 256.1.1.1:8000"),
    (["serve", *M, "--host", "127.0.0.1", "--port", "{BUSYPORT}"], "cannot serve on 127.0.0.1:{BUSYPORT}"),
    (["serve", *M, "--max-tokens", "0"], "must be an integer in [1, 1000000]"),
    (["serve", *M, "--max-batch", "0"], "must be an integer in [1, 4096]"),
    (["serve", *M, "--max-running", "99999"], "must be an integer in [1, 1024]"),
    (["serve", *M, "--prompt-cache-mb", "-1"], "must be an integer in [0, 1048576], got -1 (0: no prompt cache)"),
    (["serve", *M, "--method", "nope"], "unknown method 'nope'"),
    (["serve", *M, "--port", "0", "--method", "auto", "--opt", "tree=1,1,1"], "tree= shapes Hidden Transfer's tree"),
    (["serve", *M, "--name", "bad \udcff"], "is not valid UTF-8"),
    (["serve", "--model", "{NOTOK}", "--port", "0"], "has no tokenizer (no tokenizer.json"),
    (
        ["serve", *M, "--port", "0", "--max-prompt-tokens", "2048"],
        "--max-prompt-tokens 2048 is beyond tiny's context of 2048",
    ),
    # info
    (["info", "--model", "no-such-model"], "unknown model"),
    (["info", *M, "--context", "0"], "must be a positive integer"),
    (["info", *M, "--context", "100000000"], "--context 100000000 is beyond tiny's context of 2048"),
    (["info", *M, "--buffer-mb", "0"], "must be an integer in [1, "),
    (["info", *M, "--buffer-mb", "10000000"], "a quarter of this machine's memory"),
    (["info", *M, "--repeats", "0"], "must be an integer in [1, 1000]"),
    (["info", *M, "--repeats", "5000"], "must be an integer in [1, 1000]"),
    # bench
    (["bench", *M, "--categories", "nope"], "unknown Spec-Bench categories ['nope']"),
    (["bench", *M, "--categories", ""], "argument --categories: '' names none: give a comma-separated list"),
    (["bench", *M, "--methods", ""], "argument --methods: '' names none"),
    (["bench", *M, "--methods", " , "], "argument --methods: ' , ' names none"),
    (EX + ["--methods", ""], "argument --methods: '' names none"),
    (["eval", "skipdecode", *M, "--categories", ","], "argument --categories: ',' names none"),
    (["bench", *M, "--methods", "greedy,nope"], "unknown method 'nope'"),
    (["bench", *M, "--methods", "a=greedy,a=sample"], "used twice"),
    (["bench", *M, "--opt", "greedy.k"], "bad option"),
    (["bench", *M, "--opt", "k=1"], "METHOD.NAME=VALUE"),
    (["bench", *M, "--repeat", "0"], "--repeat: must be an integer in [1, 20]"),
    (["bench", *M, "--repeat", "21"], "--repeat: must be an integer in [1, 20]"),
    (["bench", *M, "--opt", "other.k=1"], "names no method"),
    (["bench", *M, "--opt", "greedy.k=1"], "has no option k"),
    (["bench", *M, "--methods", "speculative"], "needs the option draft: add --opt speculative.draft=VALUE"),
    (["bench", *M, "--methods", "speculative", "--opt", "speculative.draft=nope"], "unknown model 'nope'"),
    (["bench", *M, "--prompts", "0"], "must be a positive integer"),
    (["bench", *M, "--data", "/no/such/question.jsonl"], "not found"),
    (["bench", *M, "--data", "{GARBAGE}"], "is not a Spec-Bench question.jsonl"),
    (["bench", *M, "--data", "{WEIRD}"], "question_id must be an integer"),
    (["bench", *M, "--methods", "=greedy"], "has an empty label"),
    (["bench", *M, "--methods", "greedy,g="], "method 'g=' names no method after '='"),
    (["bench", *M, "--html", "{T}/r.pdf"], "an HTML report must end in .html or .htm"),
    (["bench", *M, "--data", "{EMPTY}"], "is a folder"),
    (["bench", *M, "--json", "{EMPTY}"], "is a folder: give a file name"),
    (["bench", *M, "--json", "{FILE}"], "a JSON report must end in .json"),
    (["bench", *M, "--json", "{NOTES_JSON}"], "exists and is not a layerleap report"),
    (["bench", *M, "--json", "/proc/x/b.json"], "cannot be written"),
    (["bench", *M, "--json", "/dev/null"], "a JSON report must end in .json"),
    (["bench", *M, "--max-new-tokens", "5000", "--categories", "qa"], "beyond tiny's context"),
    (["bench", *M, "--temperature", "nan"], "got nan"),
    # demo
    (["demo", *M, "--categories", "nope"], "unknown Spec-Bench categories"),
    (["demo", *M, "--json", "{FILE}"], "must end in .json"),
    (["demo", *M, "--max-new-tokens", "0"], "must be a positive integer"),
    (["demo", *M, "--prompt", "\udcff"], "is not valid UTF-8"),
    # sweep bild
    (SB + ["--alpha-fb", "2"], "--alpha-fb: each item alpha_fb must be a finite number in [0, 1], got 2"),
    (SB + ["--alpha-fb", "nan"], "got nan"),
    (SB + ["--alpha-fb", "x"], "each item alpha_fb must be a finite number"),
    (SB + ["--alpha-fb", ",".join(["0.5"] * 101)], "beyond the limit of 100"),
    (
        SB + ["--alpha-fb", ",".join(f"0.{i:02d}" for i in range(30)), "--alpha-rb", ",".join(map(str, range(1, 31)))],
        "900 is beyond the limit of 200",
    ),
    (SB + ["--alpha-rb", "-1"], "--alpha-rb: each item alpha_rb must be a finite number >= 0"),
    (SB + ["--alpha-rb", "nan"], "got nan"),
    (SB + ["--draft-lens", "0"], "each item draft_len must be an integer in [1, 256]"),
    (SB + ["--draft-lens", "999"], "each item draft_len must be an integer in [1, 256]"),
    (SB + ["--speculative", "fast:2"], "schedule must be one of constant, heuristic"),
    (SB + ["--speculative", "heuristic"], "not SCHEDULE:γ[:MIN_CONFIDENCE]"),
    (SB + ["--speculative", "heuristic:x"], "not SCHEDULE:γ[:MIN_CONFIDENCE]"),
    (SB + ["--speculative", "constant:4:2"], "min_confidence must be a finite number in [0, 1]"),
    (
        SB + ["--exit-layer", "9"],
        "--exit-layer: exit_layer must be an integer in [1, 3] (n_layers-1 = 3 on this model)",
    ),
    (SB + ["--exit-layer", "0"], "exit_layer must be an integer in [1, n_layers-1]"),
    (["sweep", "bild", *M, "--small", "no-such-model"], "unknown model 'no-such-model'"),
    # calibrate, eval frontier, finetune variant
    (["calibrate", "nope"], "choose lossy methods from skipdecode"),
    (["calibrate", "skipdecode", *M, "--quality", "1.5"], "--quality: must be a finite number in (0, 1]"),
    (["calibrate", "skipdecode", *M, "--prompts", "0"], "--prompts: must be an integer in [1, 20]"),
    (
        ["calibrate", "calm", *M, "--check", "{T}/c.json", "--out", "{T}/nocal", "--quality", "0.9"],
        "no calibration of calm for tiny (float32): run `layerleap calibrate calm --model {D} --quality 0.9 "
        "--dtype float32 --out {T}/nocal` first",
    ),
    (["eval", "frontier", *M, "--grid", "base:nope", "--json", "{T}/f.json"], "--grid base:nope: choose a method"),
    (["eval", "frontier", *M, "--json", "{T}/f.json"], "the following arguments are required: --grid"),
    (
        ["finetune", "variant", *M, "--objective", "nope", "--out", "{T}/v.safetensors", "--data", "{T}/d.jsonl"],
        "argument --objective: invalid choice: 'nope'",
    ),
    (["sweep", "bild", *M, "--small", "{D}", "--head", "shared"], "--head chooses the exit head"),
    (
        SB + ["--head", "/no/such/head.safetensors"],
        "head must be one of auto, shared, trained or an existing weights file",
    ),
    (SB + ["--max-small", "x"], "max_small must be an integer in [1, 256] or none"),
    (SB + ["--max-small", "-1"], "max_small must be an integer in [1, 256] or none"),
    (SB + ["--json", "{FILE}"], "a JSON report must end in .json"),
    (SB + ["--json", "{NOTES_JSON}"], "exists and is not a layerleap report"),
    (SB + ["--plot", "{T}/x.xyz"], "a plot must end in one of .png"),
    (SB + ["--plot", "/proc/x.png"], "cannot be written"),
    (SB + ["--table", "{T}/x.html"], "a table must end in .md or .markdown or .txt"),
    (SB + ["--table", "{EMPTY}"], "is a folder"),
    (SB + ["--prompts", "0"], "must be a positive integer"),
    (SB + ["--data", "{GARBAGE}"], "is not a Spec-Bench question.jsonl"),
    (SB + ["--device", "tpu"], "is not a torch device"),
    (SB + ["--categories", "nope"], "unknown Spec-Bench categories"),
    # align
    (AL, "the following arguments are required: --out"),
    (AL + ["--out", "{T}/x.safetensors"], "choose the form: --exit-layer E"),
    (AL + ["--exit-layer", "2", "--out", "{T}/h.bin"], "a weights file must end in .safetensors"),
    (AL + ["--exit-layer", "2", "--out", "/proc/x.safetensors"], "cannot be written"),
    (AL + ["--small", "{D}", "--out", "{FILE}"], "is a file: give a folder"),
    (AL + ["--small", "{D}", "--out", "{NOTMODEL}"], "exists and is not a model folder"),
    (AL + ["--small", "{D}", "--head", "shared", "--out", "{T}/s"], "--head is not used by align"),
    (AL + ["--exit-layer", "2", "--out", "{T}/h.safetensors", "--offset", "-1"], "must be an integer >= 0"),
    (AL + ["--exit-layer", "2", "--out", "{T}/h.safetensors", "--epochs", "0"], "must be an integer in [1, 10000]"),
    (AL + ["--exit-layer", "2", "--out", "{T}/h.safetensors", "--lr", "0"], "must be a finite number in (0, 1]"),
    (AL + ["--exit-layer", "2", "--out", "{T}/h.safetensors", "--lr", "nan"], "got nan"),
    (AL + ["--exit-layer", "2", "--out", "{T}/h.safetensors", "--seed", "-5"], "must be an integer in [0, "),
    (AL + ["--exit-layer", "2", "--out", "{T}/h.safetensors", "--rank", "-1"], "must be an integer >= 0"),
    (AL + ["--exit-layer", "2", "--out", "{T}/h.safetensors", "--val-every", "-1"], "must be an integer >= 0"),
    (AL + ["--exit-layer", "2", "--out", "{T}/h.safetensors", "--batch-tokens", "0"], "must be a positive integer"),
    (AL + ["--exit-layer", "2", "--out", "{T}/h.safetensors", "--work", "{T}/c.txt"], "must end in .json"),
    (AL + ["--exit-layer", "2", "--out", "{T}/h.safetensors", "--offset", "1000"], "no calibration prompts selected"),
    (AL + ["--exit-layer", "2", "--out", "{T}/h.safetensors", "--work", "{T}/calib.json"], "is not a calibration file"),
    (AL + ["--exit-layer", "9", "--out", "{T}/h.safetensors"], "--exit-layer: exit_layer must be an integer in [1, 3]"),
    # finetune skipdecode
    (FT, "the following arguments are required: --out"),
    (FT + ["--out", "{FILE}"], "is a file: give a folder"),
    (FT + ["--out", "{T}/ft"], "fine-tuning state"),
    (FT + ["--out", "{D}"], "is also --model"),
    (FT + ["--out", "{NOTMODEL}"], "holds other files, not a fine-tuning run"),
    (FT + ["--out", "{T}/ft", "--gen-len", "100000"], "exceed the model's context of 2048"),
    (FT + ["--out", "/proc/ft"], "cannot be written"),
    (FT + ["--out", "{T}/ft", "--target-speedup", "7"], "invalid choice: 7 (choose from 2, 3, 4, 5)"),
    (FT + ["--out", "{T}/ft", "--lr", "nan"], "got nan"),
    (FT + ["--out", "{T}/ft", "--steps", "0"], "must be an integer in [1, 1000000]"),
    (FT + ["--out", "{T}/ft", "--batch-size", "5000"], "must be an integer in [1, 1024]"),
    (FT + ["--out", "{T}/ft", "--loss", "mse"], "invalid choice: 'mse'"),
    (FT + ["--out", "{T}/ft", "--warmup", "-1"], "warmup must be an integer in [0, n_layers], got -1"),
    (FT + ["--out", "{T}/ft", "--seed", str(2**40)], "must be an integer in [0, 4294967295]"),
    (FT + ["--out", "{T}/ft", "--min-exit-layer", "4", "--max-exit-layer", "2"], "min_exit_layer=4 > max_exit_layer=2"),
    # eval skipdecode / skipdecode-speed
    (["eval", "skipdecode", *M, "--targets", "7"], "each item must be an integer in [2, 5]"),
    (["eval", "skipdecode", *M, "--targets", "x"], "each item must be an integer in [2, 5]"),
    (["eval", "skipdecode", *M, "--finetuned", "2"], "write SPEEDUP=FOLDER"),
    (["eval", "skipdecode", *M, "--finetuned", "9={D}"], "write SPEEDUP=FOLDER"),
    (["eval", "skipdecode", *M, "--finetuned", "2=/no/such/folder"], "unknown model"),
    (["eval", "skipdecode", *M, "--calm-thresholds", "abc"], "each item must be a finite number"),
    (["eval", "skipdecode", *M, "--calm-thresholds", "nan"], "got nan"),
    (["eval", "skipdecode", *M, "--offset", "-1"], "must be an integer >= 0"),
    (["eval", "skipdecode", *M, "--json", "{T}/r.csv"], "must end in .json"),
    (["eval", "skipdecode", *M, "--table", "{T}/r.html"], "a table must end in"),
    (["eval", "skipdecode", *M, "--plot", "{T}/r.xyz"], "a plot must end in"),
    (["eval", "skipdecode", *M, "--categories", "nope", "--prompts", "1"], "unknown Spec-Bench categories"),
    (["eval", "skipdecode", *M, "--offset", "500", "--prompts", "1"], "no prompts left in category"),
    (["eval", "skipdecode-speed", *M, "--batch-sizes", "0"], "each item must be an integer in [1, 256]"),
    (["eval", "skipdecode-speed", *M, "--batch-sizes", "1000"], "each item must be an integer in [1, 256]"),
    (["eval", "skipdecode-speed", *M, "--repeats", "0"], "must be an integer in [1, 100]"),
    (["eval", "skipdecode-speed", *M, "--batch-sizes", "64", "--categories", "writing"], "the largest batch needs 64"),
    (["eval", "skipdecode-speed", *M, "--max-new-tokens", "1"], "times decoding after the first token, so give at"),
    # eval ppd-parallel / self-spec / head-cost / drafters
    (["eval", "ppd-parallel", *M, "--k", "64", "--threads", str(os.cpu_count() or 1)], "cores"),
    (["eval", "ppd-parallel", *M, "--k", "100000"], "k must be an integer in [1, min(vocab_size, 64)], got 100000"),
    (["eval", "ppd-parallel", *M, "--k", "0"], "k must be an integer in [1, min(vocab_size, 64)], got 0"),
    (["eval", "ppd-parallel", *M, "--head", "nosuch"], "head must be one of auto, shared, trained or an existing"),
    (["eval", "ppd-parallel", *M, "--head-on", "both"], "invalid choice: 'both'"),
    (["eval", "ppd-parallel", *M, "--json", "{FILE}"], "must end in .json"),
    (["eval", "self-spec", *M, "--exit-layer", "1000", "--prompts", "1"], "exit_layer must be an integer in [1, 3]"),
    (["eval", "self-spec", *M, "--draft-lens", "0"], "each item draft_len must be an integer in [1, 256]"),
    (["eval", "self-spec", *M, "--min-confidence", "2"], "must be a finite number in [0, 1]"),
    (["eval", "self-spec", *M, "--head", "nosuch"], "head must be one of auto, shared, trained"),
    (["eval", "self-spec", *M, "--exit-layer", "none"], "exit_layer must be an integer in [1, n_layers-1], got 'none'"),
    (["eval", "head-cost", *M, "--context", "100000000"], "beyond tiny's context"),
    (["eval", "head-cost", *M, "--vocab", "0"], "each item must be a positive integer"),
    (["eval", "head-cost", *M, "--vocab", "1000000"], "--vocab sizes must be in [1, 128]"),
    (["eval", "head-cost", *M, "--layers", "99", "--vocab", "8"], "--layers must be an integer in [1, 4]"),
    (["eval", "head-cost", *M, "--reps", "0"], "must be an integer in [1, 10000]"),
    (["eval", "head-cost", *M, "--freq-tokens", "0"], "must be an integer in [1, 10000000]"),
    (["eval", "drafters", *M], "no drafter to evaluate: add --transfer trained and/or --medusa trained"),
    (["eval", "drafters", *M, "--transfer", "nosuch"], "is neither one of trained nor an existing"),
    (["eval", "drafters", *M, "--medusa", "{FILE}", "--prompts", "1"], "cannot read Medusa heads"),
    (["eval", "drafters", *M, "--plot", "{T}/a.xyz"], "a plot must end in"),
    (["eval", "drafters", *M, "--device", "tpu"], "is not a torch device"),
    # eval exactness
    (EX + ["--methods", "sample"], "does not claim greedy-exactness"),
    (EX + ["--prompts", "some"], "must be all or a positive integer"),
    (EX + ["--prompts", "0"], "must be all or a positive integer"),
    (EX + ["--near-tie", "-1"], "must be a finite number >= 0"),
    (EX + ["--json", "{FILE}"], "must end in .json"),
    (EX + ["--draft", "no-such-model"], "unknown model"),
    (EX + ["--methods", "ppd", "--opt", "ppd.k=0"], "k must be an integer in [1, min(vocab_size, 64)], got 0"),
    # theory ppd
    (["theory", "ppd", "--simulate", "1000000000"], "must be an integer in [0, 50000000]"),
    (["theory", "ppd", "--simulate", "-5"], "must be an integer in [0, 50000000]"),
    (["theory", "ppd", "--simulate", "50000000"], "simulated tokens) 6,400,000,000 is beyond the limit of 50,000,000"),
    (["theory", "ppd", "--p-correct", "nan"], "must be a finite number in [0, 1], got nan"),
    (["theory", "ppd", "--p-correct", "2"], "must be a finite number in [0, 1]"),
    (["theory", "ppd", "--layers", "1"], "must be an integer in [2, 100000]"),
    (["theory", "ppd", "--layers", "100000000"], "must be an integer in [2, 100000]"),
    (["theory", "ppd", "--exit-layer", "100"], "--exit-layer must be in [20, 39]"),
    (["theory", "ppd", "--k", "0"], "must be an integer in [1, 100000]"),
    (["theory", "ppd", "--tokens", "0"], "must be an integer in [1, 1000000]"),
    (["theory", "ppd", "--tokens", "100000000"], "must be an integer in [1, 1000000]"),
    (["theory", "ppd", "--seed", "-1"], "must be an integer in [0, "),
    (["theory", "ppd", "--measure", *M, "--out", "{FILE}"], "is a file: give a folder"),
    (["theory", "ppd", "--measure", *M, "--exit-layers", "99", "--prompts", "1"], "--exit-layers must be in [2, 3]"),
    (["theory", "ppd", "--measure", *M, "--max-new-tokens", "1"], "--max-new-tokens 1 leaves no early prediction"),
    (
        ["theory", "ppd", "--measure", *M, "--exit-layers", "2", "--ks", "100000", "--prompts", "1"],
        "--ks must be an integer in [1, 128]",
    ),
    (["theory", "ppd", "--measure", *M, "--head", "nosuch"], "head must be one of auto, shared, trained"),
    # train heads
    (["train", "heads", *M, "--out", "{T}/h.safetensors"], "the following arguments are required: --layers"),
    (TH + ["--layers", "a,b", "--out", "{T}/h.safetensors"], "--layers: each item must be a positive integer"),
    (TH + ["--layers", "0", "--out", "{T}/h.safetensors"], "each item must be a positive integer"),
    (TH + ["--layers", "99", "--out", "{T}/h.safetensors"], "layers must be integers in [1, 3]"),
    (TH + ["--layers", "2,2", "--out", "{T}/h.safetensors"], "layers repeat"),
    (TH + ["--layers", "2", "--out", "{T}/h.pt"], "must end in .safetensors"),
    (TH + ["--layers", "2", "--out", "{EMPTY}"], "is a folder"),
    (TH + ["--layers", "2", "--out", "{T}/h.safetensors", "--tokens", "0"], "must be an integer in [1, 10000000]"),
    (TH + ["--layers", "2", "--out", "{T}/h.safetensors", "--lr", "nan"], "got nan"),
    (TH + ["--layers", "2", "--out", "{T}/h.safetensors", "--candidates", "-1"], "must be an integer >= 0"),
    (
        TH + ["--layers", "2", "--out", "{T}/h.safetensors", "--candidates", "1000000"],
        "candidates must be an integer in [0, 128]",
    ),
    (TH + ["--layers", "2", "--out", "{T}/h.safetensors", "--negatives", "-1"], "must be an integer >= 0"),
    (TH + ["--layers", "2", "--out", "{T}/h.safetensors", "--work", "{FILE}"], "is a file: give a folder"),
    (TH + ["--layers", "2", "--out", "{T}/h.safetensors", "--work", "{T}/work"], "training state"),
    (TH + ["--layers", "2", "--out", "{T}/h.safetensors", "--state-cache", "{FILE}"], "is a file: give a folder"),
    (TH + ["--layers", "2", "--out", "{T}/h.safetensors", "--json", "{FILE}"], "must end in .json"),
    (TH + ["--layers", "2", "--out", "{T}/h.safetensors", "--kind", "shared"], "invalid choice: 'shared'"),
    # train medusa / transfer
    (TM + ["--out", "{T}/m.bin"], "must end in .safetensors"),
    (TM + ["--out", "{T}/m.safetensors", "--heads", "0"], "must be an integer in [1, 64]"),
    (TM + ["--out", "{T}/m.safetensors", "--chunks", "{CHUNKS}"], "checkpoint"),
    (TM + ["--out", "{T}/m.safetensors", "--seq-len", "2"], "must be an integer in [4, 65536]"),
    (TM + ["--out", "{T}/m.safetensors", "--seq-len", "4096"], "seq_len must be an integer in [4, 2048]"),
    (TM + ["--out", "{T}/m.safetensors", "--lr", "0"], "must be a finite number in (0, 1]"),
    (TM + ["--out", "{T}/m.safetensors", "--chunks", "/no/such.safetensors"], "not found"),
    (TM + ["--out", "{T}/m.safetensors", "--chunks", "{GARBAGE}"], "cannot read chunks"),
    (TM + ["--out", "{T}/m.safetensors", "--chunks", "{CHUNKS1D}"], "does not hold token chunks"),
    (
        TM + ["--out", "{T}/m.safetensors", "--chunks", "{CHUNKS}", "--data", "self-distill"],
        "--data: not used with --chunks",
    ),
    (
        TM + ["--out", "{T}/m.safetensors", "--data", "self-distill", "--conversations", "5"],
        "--conversations: not used with --data self-distill",
    ),
    (TM + ["--out", "{T}/m.safetensors", "--chunks", "{CHUNKSVOCAB}"], "does not hold token chunks"),
    (TM + ["--out", "{T}/m.safetensors", "--save-chunks", "{T}/c.npy"], "must end in .safetensors"),
    (TM + ["--out", "{T}/m.safetensors", "--max-seconds", "0"], "must be a finite number > 0"),
    (TM + ["--out", "{T}/m.safetensors", "--state-cache", "{FILE}"], "is a file: give a folder"),
    (TT + ["--out", "{T}/t.safetensors", "--state-cache", "{T}/sc"], "--state-cache is for train medusa"),
    (TM + ["--out", "{T}/m.safetensors", "--max-seconds", "nan"], "got nan"),
    (TM + ["--out", "{T}/m.safetensors", "--device", "tpu"], "is not a torch device"),
    (TT + ["--out", "{T}/t.safetensors", "--layers", "x"], "each item must be a positive integer"),
    (TT + ["--out", "{T}/t.safetensors", "--layers", "2,99", "--chunks", "{CHUNKS}"], "transfer layers must be"),
    (
        TT + ["--out", "{T}/t.safetensors", "--chunks", "{CHUNKS}"],
        "got [15, 20, 25]: give --layers in that range, e.g.",
    ),
    # sizes with bounds: chunks too short for the steps ahead, a data file that is not one
    (
        TM + ["--out", "{T}/m.safetensors", "--chunks", "{SHORT}", "--heads", "3"],
        "hold 3 tokens each, fewer than --seq-len 8",
    ),
    (TM + ["--out", "{T}/m.safetensors", "--seq-len", "4", "--heads", "5"], "seq_len 4 leaves no target 5 steps ahead"),
    (TE + ["--out", "{T}/e.safetensors", "--heads", "2"], "--heads is for `layerleap train medusa`; train eagle takes"),
    (TE + ["--out", "{T}/e.safetensors", "--unroll", "0"], "must be an integer in [1, 64]"),
    (TM + ["--out", "{T}/m.safetensors", "--unroll", "2"], "--unroll is for `layerleap train eagle`"),
    (TT + ["--out", "{T}/t.safetensors", "--layers", "1,2,3", "--chunks", "{SHORT}"], "hold 3 tokens each"),
    (
        ["finetune", "variant", *M, "--objective", "calm", "--out", "{T}/v.safetensors", "--data", "{GARBAGE}"],
        "is not a self-distilled record",
    ),
    # runs of hours refused unless asked (--max-hours H or --yes)
    (
        SB
        + ["--prompts", "80", "--categories", "qa,writing,translation", "--max-new-tokens", "512"]
        + ["--alpha-fb", "0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1", "--alpha-rb", "1,2,3,4,5,6,7,8,9,10"],
        "this run would take at least",
    ),
    (SB + ["--max-hours", "0.000001"], "beyond the limit of 1e-06 h: add --max-hours 1 (or --yes)"),
    (TM + ["--out", "{T}/m.safetensors", "--steps", "1000000", "--batch-size", "1024", "--seq-len", "2048"], "583 h"),
    (TT + ["--out", "{T}/t.safetensors", "--layers", "2", "--max-hours", "1e-9"], "beyond the limit of 1e-09 h"),
    (
        TH + ["--layers", "2", "--out", "{T}/h.safetensors", "--tokens", "10000000", "--epochs", "10000"],
        "10,000 epochs",
    ),
    (["eval", "exactness", *M, "--prompts", "all", "--max-new-tokens", "2040", "--max-hours", "0.5"], "would take"),
    (["bench", *M, "--prompts", "100", "--repeat", "20", "--max-new-tokens", "1000"], "would take at least"),
    (["calibrate", "calm", *M, "--max-hours", "0.00001"], "beyond the limit of 1e-05 h"),
    (FT + ["--out", "{T}/ftx", "--steps", "1000000", "--batch-size", "1024"], "would take at least"),
    (
        ["finetune", "variant", *M, "--objective", "calm", "--out", "{T}/v.safetensors", "--data", "{T}/d.jsonl"]
        + ["--steps", "1000000", "--batch-size", "256"],
        "would take at least",
    ),
    (AL + ["--exit-layer", "2", "--out", "{T}/h.safetensors", "--max-hours", "1e-9"], "beyond the limit of 1e-09 h"),
    (MR + ["--layers", "2", "--heads", "shared", "--category", "qa", "--max-hours", "1e-9"], "beyond the limit"),
    (["eval", "self-spec", *M, "--exit-layer", "2", "--categories", "qa", "--max-hours", "1e-9"], "beyond the limit"),
    (
        ["eval", "frontier", *M, "--grid", "base:calm", "--json", "{T}/f.json", "--max-hours", "1e-9"],
        "beyond the limit",
    ),
    (["eval", "skipdecode", *M, "--prompts", "1", "--max-hours", "1e-9"], "24 runs × 64 tokens"),
    (
        ["eval", "skipdecode-speed", *M, "--batch-sizes", "1", "--targets", "2", "--max-hours", "1e-9"],
        "4 batched runs",
    ),
    (["eval", "drafters", *M, "--transfer", "trained", "--max-hours", "1e-9"], "drafted positions"),
    (["eval", "ppd-parallel", *M, "--prompts", "1", "--max-hours", "1e-9"], "beyond the limit of 1e-09 h"),
    (["demo", *M, "--max-hours", "1e-9"], "beyond the limit of 1e-09 h"),
    (
        ["theory", "ppd", "--measure", *M, "--exit-layers", "2", "--ks", "1", "--max-hours", "1e-9"],
        "greedy references × 64 tokens",
    ),
    (["theory", "ppd", "--max-hours", "5"], "--max-hours: not used without --measure"),
    (TM + ["--out", "{T}/m.safetensors", "--max-hours", "0"], "--max-hours: must be a finite number > 0"),
    (TM + ["--out", "{T}/m.safetensors", "--lr", "1e40"], "--lr: must be a finite number in (0, 1], got 1e+40"),
    (
        [
            "finetune",
            "variant",
            *M,
            "--objective",
            "calm",
            "--out",
            "{T}/v.safetensors",
            "--data",
            "{T}/d.jsonl",
            "--lr",
            "9" * 40,
        ],
        "--lr: must be a finite number in (0, 1]",
    ),
    (G + ["--variant", "x" * 300], "is too long for a path (a name at most 255 bytes)"),
    (["eval", "head-cost", *M, "--json", "x" * 5000 + ".json"], "is too long for a path"),
    (["calibrate", "calm", *M, "--variant", "~nosuch/x"], "no variant '~nosuch/x'"),
    (EX + ["--max-hours", "nan"], "--max-hours: must be a finite number > 0, got nan"),
    (["bench", *M, "--max-hours", "many"], "--max-hours: must be a finite number > 0"),
    # eval frontier
    (["eval", "frontier", *M, "--grid", "base:calm", "--json", "{NOTES_JSON}"], "exists and is not a layerleap report"),
    (["eval", "frontier", *M, "--grid", "base", "--json", "{T}/f.json"], "write MODEL:METHOD"),
    # match-rate
    (MR + ["--layers", "0"], "each item must be a positive integer"),
    (MR + ["--layers", "2,2", "--heads", "shared", "--category", "qa"], "layers 2 given twice: give each once"),
    (MR + ["--layers", "2", "--k", "1,3,1", "--heads", "shared", "--category", "qa"], "k 1 given twice"),
    (MR + ["--layers", "2", "--heads", "shared,shared", "--category", "qa"], "heads shared given twice"),
    (MR + ["--layers", "2", "--mode", "greedy,greedy"], "--mode greedy,greedy names a mode twice"),
    (MR + ["--layers", "2", "--heads", "{EMPTY}", "--category", "qa"], "'{EMPTY}' is a folder (exit heads)"),
    (MR + ["--layers", "99", "--heads", "shared", "--category", "qa"], "layers must be integers in [1, 4]"),
    (MR + ["--layers", "2", "--k", "0"], "each item must be a positive integer"),
    (
        MR + ["--layers", "2", "--k", "1000000", "--heads", "shared", "--category", "qa"],
        "k must be an integer in [1, 128]",
    ),
    (MR + ["--mode", "fast"], "--mode fast unknown"),
    (MR + ["--top-p", "0"], "must be a finite number in (0, 1]"),
    (MR + ["--temperature", "0"], "must be a finite number >= 1e-06"),
    (MR + ["--buckets", "0"], "must be an integer in [1, 1000]"),
    (MR + ["--layers", "2,3", "--position-layer", "1"], "--position-layer 1 is not among --layers"),
    (MR + ["--offset", "-1"], "must be an integer >= 0"),
    (MR + ["--spec-bench", "/no/such.jsonl"], "not found"),
    (MR + ["--json", "{FILE}"], "must end in .json"),
    (MR + ["--plot", "{T}/p.xyz"], "a plot must end in"),
    (MR + ["--category", "nope"], "unknown Spec-Bench categories"),
    (MR + ["--category", "writing", "--offset", "1000"], "no prompts left in category writing"),
    # train data / eval draft-vocab
    (["train", "data", "--model", "{D}"], "the following arguments are required: --self-distill"),
    (["train", "data", "--model", "{D}", "--self-distill", "0"], "must be an integer in [1, 1000000]"),
    (["train", "data", "--model", "{D}", "--self-distill", "2", "--batch", "0"], "must be an integer in [1, 1024]"),
    (
        ["train", "data", "--model", "{D}", "--self-distill", "2", "--temperature", "0"],
        "must be a finite number >= 1e-06",
    ),
    (
        ["train", "data", "--model", "{D}", "--self-distill", "2", "--seed", "-1"],
        "must be an integer in [0, 4294967295]",
    ),
    (
        ["train", "data", "--model", "{D}", "--self-distill", "2", "--seed", "3"],
        "--seed: not used without --temperature",
    ),
    (["train", "corpus", "--model", "{D}"], "the following arguments are required: --out"),
    (["train", "corpus", "--model", "{D}", "--out", "{T}/c.bin"], "must end in .safetensors"),
    (
        ["train", "corpus", "--model", "{D}", "--data", "{GARBAGE}", "--out", "{T}/c.safetensors"],
        "line 1 is not a self-distilled record",
    ),
    (["train", "corpus", "--model", "{D}", "--data", "nosuch", "--out", "{T}/c.safetensors"], "is neither one of"),
    (
        ["train", "corpus", "--model", "{D}", "--out", "{T}/c.safetensors", "--calibration-prompts", "21"],
        "must be an integer in [0, 20]",
    ),
    (["eval", "draft-vocab", "--model", "{D}", "--data", "{GARBAGE}"], "line 1 is not a self-distilled record"),
    (["eval", "draft-vocab", "--model", "{D}", "--data", "nosuch"], "is neither one of self-distill"),
    (["eval", "draft-vocab", "--model", "{D}", "--held-out", "1"], "must be a finite number in [0, 1)"),
    (["eval", "draft-vocab", "--model", "{D}", "--out", "{T}/v.bin"], "must end in .safetensors"),
    (["eval", "draft-vocab", "--model", "{D}", "--sizes", "0"], "each item must be a positive integer"),
    (["eval", "draft-vocab", "--model", "{D}", "--size", "128"], "a draft vocabulary is smaller than the vocabulary"),
    # heads sub-vocab
    (SV + ["--heads", "nosuch", "--vocab", "8", "--out", "{T}/s.safetensors"], "is neither one of trained"),
    (SV + ["--heads", "{FILE}", "--vocab", "8", "--out", "{T}/s.safetensors"], "cannot read exit heads"),
    (["heads", "info"], "the following arguments are required: FILE"),
    (["heads", "info", "{T}/nosuch.safetensors"], "not found (or not a file)"),
    (["heads", "info", "{CHUNKS}"], "is not a layerleap weights file"),
    (["heads", "info", "{FILE}"], "it is not a layerleap weights file"),
    (["heads", "info", "{MEDUSA}", "--json", "{FILE}"], "must end in .json"),
    (["heads", "upgrade", "{MEDUSA}"], "the following arguments are required: --out"),
    (["heads", "upgrade", "{FILE}", "--out", "{T}/u.safetensors"], "cannot read weights"),
    (["heads", "upgrade", "{MEDUSA}", "--out", "{T}/u.safetensors", "--budget", "speed=3"], "KEY one of data"),
    (["heads", "upgrade", "{MEDUSA}", "--out", "{T}/u.safetensors", "--budget", "steps=3"], "--budget needs --source"),
    (
        ["heads", "upgrade", "{MEDUSA}", "--out", "{T}/u.safetensors", "--budget", "tokens=50k", "--source", "a log"],
        "tokens is a whole number, 0 or more",
    ),
    (
        ["heads", "upgrade", "{MEDUSA}", "--out", "{T}/u.safetensors", "--budget", "train_s=nan", "--source", "a log"],
        "train_s is a number, 0 or more",
    ),
    (
        ["heads", "upgrade", "{MEDUSA}", "--out", "{T}/u.safetensors", "--budget", "machine=", "--source", "a log"],
        "give machine a value (machine=VALUE), or leave --budget machine out",
    ),
    (
        ["heads", "upgrade", "{MEDUSA}", "--out", "{T}/u.safetensors", "--budget", "data= ", "--source", "a log"],
        "give data a value",
    ),
    (["heads", "upgrade", "{CHUNKS}", "--out", "{T}/u.safetensors"], "is not a layerleap weights file"),
    (SV + ["--heads", "trained", "--vocab", "0", "--out", "{T}/s.safetensors"], "each item must be a positive integer"),
    (SV + ["--heads", "trained", "--vocab", "x", "--out", "{T}/s.safetensors"], "each item must be a positive integer"),
    (SV + ["--heads", "trained", "--vocab", "128", "--out", "{T}/s.safetensors"], "below the full vocabulary"),
    (SV + ["--heads", "trained", "--vocab", "8", "--out", "{T}/s.bin"], "must end in .safetensors"),
    (SV + ["--heads", "trained", "--vocab", "8,16", "--out", "{T}/s.safetensors"], "must contain {vocab}"),
    (
        SV + ["--heads", "trained", "--vocab", "8", "--out", "{T}/s.safetensors", "--json", "{FILE}"],
        "must end in .json",
    ),
    (SV + ["--heads", "trained", "--vocab", "8", "--out", "{T}/s.safetensors", "--storage", "int8"], "invalid choice"),
    # one declaration per option: the same message from every command (checked before loading: BEFORE_LOAD)
    (G + ["--method", "self-spec", "--opt", "draft_len=-1"], "draft_len must be an integer in [1, 256] or none"),
    (G + ["--method", "prompt-lookup", "--opt", "draft_len=-1"], "draft_len must be an integer in [1, 256] or none"),
    (G + ["--method", "auto", "--opt", "max_ngram=1000"], "max_ngram must be an integer in [1, 32], got 1000"),
    (G + ["--method", "prompt-lookup", "--opt", "min_ngram=3", "--opt", "max_ngram=2"], "min_ngram (3) must be <="),
    (G + ["--method", "self-spec", "--opt", "exit_layer=4"], "exit_layer must be an integer in [1, 3] (n_layers-1 = 3"),
    (G + ["--method", "bild", "--opt", "exit_layer=4"], "exit_layer must be an integer in [1, 3] (n_layers-1 = 3"),
    (G + ["--method", "ppd", "--opt", "exit_layer=1"], "exit_layer must be an integer in [2, 3] (ceil(n_layers/2) = 2"),
    (G + ["--method", "medusa", "--opt", "heads={MEDUSA_SHAPES}"], "do not fit this model: size mismatch for"),
    (["generate", "--model", "{NOTOK}", "--prompt", "hi"], "has no tokenizer (no tokenizer.json"),
    (["bench", *M, "--data", "{EMPTYJSONL}"], "holds no questions"),
    # sampling flags are used or refused, never ignored
    (
        G + ["--method", "greedy", "--temperature", "1.5"],
        "method 'greedy' decodes greedily and would ignore temperature",
    ),
    (G + ["--temperature", "1.5"], "use method 'sample' to sample (--method sample)"),
    (G + ["--method", "ppd", "--seed", "1"], "method 'ppd' decodes greedily and would ignore seed"),
    (G + ["--method", "ppd", "--do-sample"], "method 'ppd' decodes greedily only: drop do_sample=True (--do-sample)"),
    (["bench", *M, "--methods", "greedy,ppd", "--temperature", "0.5"], "--temperature: no method of this run samples"),
    (EX + ["--methods", "speculative"], "method speculative needs a second model: give --draft NAME"),
    (TM + ["--out", "{T}/m.safetensors", "--layers", "10"], "--layers is for `layerleap train transfer`"),
    (TT + ["--out", "{T}/t.safetensors", "--heads", "2"], "--heads is for `layerleap train medusa`"),
    (TT + ["--out", "{T}/t.safetensors", "--init", "{T}/nosuch.safetensors"], "not found (or not a file)"),
    (
        TT + ["--out", "{T}/t.safetensors", "--layers", "1", "--init", "{MEDUSA}"],
        "is not a file of Hidden Transfer projections",
    ),
    (["theory", "ppd", "--measure", *M, "--layers", "30"], "--layers: not used with --measure"),
    (["theory", "ppd", "--measure", *M, "--p-correct", "0.3", "--k", "2"], "--k, --p-correct: not used with --measure"),
    (["theory", "ppd", "--head", "shared"], "--head: not used without --measure: add --measure"),
    (["bench", *M, "--no-baseline-hf", "--hf-extra", "lookup"], "--hf-extra: not used with --no-baseline-hf"),
    (MR + ["--layers", "2", "--temperature", "0.5"], "--temperature: not used with --mode greedy"),
    (MR + ["--layers", "2", "--mode", "top-k", "--top-p", "0.5"], "--top-p: not used with --mode top-k"),
]


def _id(row) -> str:
    argv, _ = row
    return " ".join(a if len(a) < 30 else a[:27] + "…" for a in argv[:2] + argv[3:])[:90] or "(nothing)"


@pytest.mark.parametrize("argv, message", CLI, ids=[f"{i:03d} {_id(r)}" for i, r in enumerate(CLI)])
def test_cli(capsys, places, argv, message):
    rc = main(_fill(argv, places))
    out, err = capsys.readouterr()
    assert rc == 2, (rc, err[-2000:])
    assert "Traceback" not in out + err
    lines = [ln.split("\r")[-1] for ln in err.strip().splitlines()]
    errors = [ln for ln in lines if ": error: " in ln]
    assert len(errors) == 1 and errors[0] == lines[-1], err[-2000:]  # one line, the last
    assert _fill([message], places)[0] in lines[-1], lines[-1]
    assert len(lines[-1]) > len("layerleap x: error: ") + 10


def test_the_table_is_large_and_covers_every_command():
    from layerleap import cli

    cli.build_parser()
    covered = {" ".join(a[:2]) if " ".join(a[:2]) in cli._COMMANDS else a[0] for a, _ in CLI if a}
    assert set(cli._COMMANDS) <= covered, set(cli._COMMANDS) - covered
    assert len(CLI) + len(API) >= 150


# -- the Python API ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(places):
    return layerleap.load_folder(places["D"])


def _gen(prompt, **kw):
    return lambda m, p: layerleap.generate(m, prompt, **{"max_new_tokens": 2, **kw})


def _medusa(**kw):
    def run(m, p):
        from layerleap.drafters import medusa_transfer as drafters

        heads = drafters.new_drafter(m, "medusa", steps=2)
        return layerleap.generate(m, [1, 2, 3], "medusa", 2, heads=heads, **kw)

    return run


def _theory(**kw):
    from layerleap.eval import theory

    args = {"d": 40, "dbar": 20, "k": 1, "p": 0.5, "n_tokens": 128, **kw}
    return lambda m, p: theory.figures(args["d"], args["dbar"], args["k"], args["p"], args["n_tokens"])


def _train_drafter(out="m.safetensors", chunks=None, **kw):
    def run(m, p):
        from layerleap.train import medusa_transfer as train_drafters

        cfg = train_drafters.TrainConfig(kind="medusa", steps_ahead=1, train_steps=1, seq_len=8, **kw)
        given = [[1] * 8] if chunks is None else chunks
        return train_drafters.train(m, p["T"] + "/" + out, cfg, chunks=given, progress=False)

    return run


def _heads_cfg(**kw):
    def run(m, p):
        from layerleap.train.exit_heads import HeadTrainConfig

        return HeadTrainConfig(**{"layers": (2,), **kw}).check(m)

    return run


def _match_cfg(**kw):
    def run(m, p):
        from layerleap.eval.match_rate import MatchRateConfig

        return MatchRateConfig(**{"layers": (2,), "heads": ("shared",), **kw}).check(m)

    return run


def _exactness(methods, n=2, **kw):
    def run(m, p):
        from layerleap.datasets import spec_bench
        from layerleap.eval.exactness import run_exactness

        return run_exactness(m, methods, spec_bench(categories=["qa"], n=1), n, progress=False, **kw)

    return run


def _bench(**kw):
    def run(m, p):
        from layerleap.eval.bench import run_bench

        return run_bench(m, {}, ["hi"], **{"max_new_tokens": 2, "hf_baseline": False, "progress": False, **kw})

    return run


def _load(*args, **kw):
    return lambda m, p: layerleap.load(*(_fill([a], p)[0] if isinstance(a, str) else a for a in args), **kw)


API = [
    # load / load_folder / from_hf / to_hf
    (_load(123), "must be a path"),
    (_load(b"smollm2-135m"), "is bytes"),
    (_load(""), "is empty"),
    (_load("a\0b"), "NUL character"),
    (_load("no-such-model"), "unknown model 'no-such-model'"),
    (_load("{TRUNCATED}"), "is truncated"),
    (_load("{NOSHARD}"), "lacks the shard"),
    (_load("{BADCONFIG}"), "config.json is not valid JSON"),
    (_load("{D}", dtype="int8"), "unknown dtype 'int8'"),
    (_load("{D}", dtype=[]), "unknown dtype []"),
    (_load("{D}", dtype=torch.int8), "unknown dtype torch.int8"),
    (_load("{D}", progress=5), "progress must be a function"),
    (lambda m, p: layerleap.load_folder(p["FILE"]), "is not a folder"),
    (lambda m, p: layerleap.from_hf(object()), "from_hf takes a loaded transformers model"),
    (lambda m, p: layerleap.to_hf("tiny"), "to_hf takes a layerleap model"),
    # generate: the model, the method, the prompt
    (lambda m, p: layerleap.generate("tiny", "hi"), "model must be a layerleap model"),
    (lambda m, p: layerleap.generate(m, "hi", method=None), "a method is named by text, got None"),
    (lambda m, p: layerleap.generate(m, "hi", method=["greedy"]), "a method is named by text, got ['greedy']"),
    (_gen(b"Hello"), "the prompt is bytes: decode it"),
    (_gen(bytearray(b"Hello")), "the prompt is bytes"),
    (_gen(["hi", b"x"]), "the prompt is bytes"),
    (_gen(["hi", " "]), "prompt 1 of the batch: the prompt is empty"),
    (_gen("bad \udcff"), "is not valid UTF-8"),
    (_gen(torch.zeros(2, 2, 3, dtype=torch.long)), "1-D (one prompt) or 2-D (a batch), got 3-D"),
    (_gen(torch.tensor([1.0, 2.0])), "1-D integer token ids, got a 1-D float32 tensor"),
    (_gen(torch.tensor([True, False])), "got a 1-D bool tensor"),
    (_gen(torch.zeros(0, 4, dtype=torch.long)), "has no rows"),
    (_gen([1.5, 2.0]), "cannot read the prompt"),
    (_gen([True, 2]), "cannot read the prompt"),
    (_gen([[1, 2], "x", 3]), "cannot read the prompt 3"),
    (_gen(None), "cannot read the prompt None"),
    (_gen({"text": "hi"}), "cannot read the prompt"),
    (_gen(5), "cannot read the prompt 5"),
    (_gen([1, 2], chat=True), "chat=True wraps text"),
    (_gen([1, 49152]), "outside the vocabulary"),
    (_gen(["hi"] * 5000), "the batch 5,000 is beyond the limit of 4,096"),
    # generate: numbers and flags
    (_gen("hi", max_new_tokens=True), "max_new_tokens must be a positive integer, got True"),
    (_gen("hi", max_new_tokens=2.0), "max_new_tokens must be a positive integer, got 2.0"),
    (_gen("hi", max_new_tokens=10**9), "exceeds the context length"),
    (_gen("hi", temperature=math.nan), "temperature must be a finite number >= 1e-06, got nan"),
    (_gen("hi", method="sample", temperature=1e-320), "temperature must be a finite number >= 1e-06"),
    (_gen("hi", temperature=math.inf), "got inf"),
    (_gen("hi", temperature="1"), "temperature must be a finite number"),
    (_gen("hi", top_p=math.nan), "top_p must be a finite number in (0, 1]"),
    (_gen("hi", top_k=True), "top_k must be an integer >= 0"),
    (_gen("hi", seed=2**64), "seed must be an integer in [0, 4294967295]"),
    (_gen("hi", seed=-1), "seed must be an integer in [0, "),
    (_gen("hi", seed=1.5), "seed must be an integer"),
    (_gen("hi", do_sample="yes"), "do_sample must be True or False"),
    (_gen("hi", chat=1), "chat must be True or False"),
    (_gen("hi", stop_at_eos=None), "stop_at_eos must be True or False"),
    # method options
    (_medusa(draft_vocab=3), "draft_vocab must be one of auto, full, a weights file or loaded weights, got 3"),
    (_medusa(draft_vocab="/no/such.safetensors"), "draft_vocab must be one of auto, full or an existing weights file"),
    (_medusa(tree=100000), "more than 512 nodes"),
    (_medusa(tree=[(0,)] * 600), "beyond the limit of 512 nodes"),
    (_medusa(tree=[40000]), "the tree 40000 has more than 512 nodes"),
    (_medusa(tree=[(0,), (60000,)]), "draft ranks beyond the vocabulary"),
    (_medusa(tree="1,1,1"), "the tree is 3 deep"),
    (_medusa(tree=object()), "a tree shape is top-k per depth"),
    (
        _gen("hi", method="skipdecode", target_speedup=math.nan),
        "target_speedup must be a finite number in [1, 4] (n_layers = 4 on this model)",
    ),
    (_gen("hi", method="skipdecode", schedule="1234"), "schedule must be a non-empty list of integers in [1, 4]"),
    (_gen("hi", method="skipdecode", schedule=[math.inf]), "schedule must be a list of integers in [1, 4]"),
    (_gen("hi", method="calm", threshold=math.nan), "threshold must be a finite number, got nan"),
    (_gen("hi", method="self-spec", draft_len=10**6), "draft_len must be an integer in [1, 256]"),
    (_gen("hi", method="speculative", draft="tiny"), "draft= must be a layerleap model"),
    (
        _gen("hi", method="ppd", k=True),
        "k must be an integer in [1, 64] (min(vocab_size, 64) = 64 on this model), got True",
    ),
    (_gen("hi", method="medusa", tree=False), "a tree shape is top-k per depth ([2, 1, 1] or '2,1,1')"),
    (_gen("hi", method="medusa", tree=0.0), "a tree shape is top-k per depth ([2, 1, 1] or '2,1,1')"),
    (_gen("hi", method="medusa", heads=5), "heads must be one of trained, a weights file or loaded weights, got 5"),
    (_gen("hi", method="eagle", eagle_head=5), "eagle_head must be one of trained, a weights file or loaded"),
    (_gen("hi", method="eagle"), "no shipped eagle weights fit"),
    (  # "none" said once, with its meaning
        _gen("hi", method="auto", eagle="/no/such.safetensors"),
        "eagle must be one of auto, an existing weights file or none (no EAGLE calls), got",
    ),
    # the functions the commands use
    (_theory(p=math.nan), "--p-correct must be a finite number, got nan"),
    (_theory(d="40"), "--layers must be an integer"),
    (
        lambda m, p: importlib.import_module("layerleap.eval.theory").simulate(40, 20, 1, 0.5, 8, trials=0),
        "trials must be a positive integer",
    ),
    (_train_drafter(out="m.bin"), "must end in .safetensors"),
    (_train_drafter(lr=math.nan), "lr must be a finite number in (0, 1], got nan"),
    (_train_drafter(seed=-1), "seed must be an integer in [0, "),
    (_heads_cfg(lr=math.nan), "lr must be a finite number in (0, 1], got nan"),
    (_heads_cfg(layers=(99,)), "layers must be integers in [1, 3]"),
    (_heads_cfg(epochs=True), "epochs must be a positive integer, got True"),
    (
        lambda m, p: importlib.import_module("layerleap.train.align").TrainConfig(lr=math.nan).check(),
        "lr must be a finite number in (0, 1]",
    ),
    (
        lambda m, p: importlib.import_module("layerleap.train.skipdecode").TrainConfig(lr=math.inf).resolve(4),
        "lr must be a finite number in (0, 1], got inf",
    ),
    (_match_cfg(top_p=2.0), "top_p must be a finite number in (0, 1]"),
    (_match_cfg(ks=(10**6,)), "k must be an integer in [1, 128]"),
    (_exactness({"s": ("sample", {})}), "does not claim greedy-exactness"),
    (_exactness({"p": ("ppd", {})}, n=10**6), "max_new_tokens must be an integer in [1, 2047]"),
    (_exactness({"p": ("ppd", {})}, out="r.txt"), "must end in .json"),
    (_bench(max_new_tokens=0), "max_new_tokens must be a positive integer"),
    (_bench(out="/proc/x.json"), "cannot be written"),
    (
        lambda m, p: layerleap.core.loading.check_folder(__import__("pathlib").Path(p["BADHEADER"])),
        "is not a safetensors file",
    ),
    # sizes with bounds
    (_train_drafter(chunks=[[1]]), "token chunks of 1 tokens leave no target 1 steps ahead"),
    (_train_drafter(chunks=[]), "no token chunks to train on"),
    (_train_drafter(chunks=[[1] * 8, [1] * 9]), "token chunks must be lists of one length, got lengths [8, 9]"),
    (_train_drafter(chunks=[[1] * 8, 5]), "token chunks must be lists of one length"),
    # an existing file of another kind is never replaced
    (_train_drafter(out="chunks.safetensors"), "out {T}/chunks.safetensors exists and holds tensors without"),
    (
        lambda m, p: importlib.import_module("layerleap.files").save_safetensors(
            p["MEDUSA"], {"x": torch.zeros(1)}, {"kind": "transfer"}
        ),
        "exists and holds medusa, not transfer",
    ),
    (
        lambda m, p: importlib.import_module("layerleap.files").save_safetensors(p["MEDUSA"], {"x": torch.zeros(1)}),
        "holds medusa, not tensors without a layerleap kind",
    ),
    (
        lambda m, p: importlib.import_module("layerleap.files").save_safetensors(
            p["FILE"], {"x": torch.zeros(1)}, {"kind": "medusa"}
        ),
        "exists and is not a safetensors file",
    ),
    (
        lambda m, p: importlib.import_module("layerleap.files").check_distinct(
            [("out", Path(p["T"]))], [("data", Path(p["FILE"]))]
        ),
        "writing there could destroy the input",
    ),
    # found by the fuzzing pass
    (_gen(__import__("numpy").array(["a"])), "an array prompt must hold integer token ids"),
    (lambda m, p: layerleap.tiny_config(n_kv_heads=0), "n_kv_heads must be a positive integer, got 0"),
    (lambda m, p: layerleap.tiny_config(vocab_size="97"), "vocab_size must be a positive integer, got '97'"),
    (lambda m, p: layerleap.ModelConfig.from_hf("x"), "a Hugging Face config is a dict"),
    (
        lambda m, p: importlib.import_module("layerleap.eval.bench").run_bench(
            m, ["greedy"], ["hi"], 2, hf_baseline=False
        ),
        "methods must map labels to (method, options) pairs",
    ),
    (
        lambda m, p: importlib.import_module("layerleap.eval.bench").run_bench(m, {}, "hello", 2, hf_baseline=False),
        "prompts must be a list of prompts, got str",
    ),
    (lambda m, p: importlib.import_module("layerleap.datasets").spec_bench(n=-1), "n must be a positive integer"),
    (lambda m, p: importlib.import_module("layerleap.datasets").spec_bench(n=True), "n must be a positive integer"),
    (lambda m, p: importlib.import_module("layerleap.datasets").spec_bench(5), "path must be a path"),
    (
        lambda m, p: importlib.import_module("layerleap.eval.theory").simulate(40, 20, 1, 0.5, 128, trials=10**9),
        "is beyond the limit of 50,000,000",
    ),
    (_exactness(["ppd"]), "methods must map labels"),
    (
        lambda m, p: importlib.import_module("layerleap.eval.exactness").run_exactness(m, {}, "hello", 2),
        "prompts must be a list of Spec-Bench prompts",
    ),
    (
        lambda m, p: importlib.import_module("layerleap.files").save_figure(
            __import__("matplotlib.figure").figure.Figure(), p["T"] + "/x.xyz"
        ),
        "a plot must end in one of .png",
    ),
    (
        lambda m, p: importlib.import_module("layerleap.eval.sweep").run_sweep(m, [], "hello", 2, models={}),
        "prompts must be a list",
    ),
    (
        lambda m, p: importlib.import_module("layerleap.eval.match_rate").match_rate(
            m,
            "hello",
            importlib.import_module("layerleap.eval.match_rate").MatchRateConfig(layers=(2,), heads=("shared",)),
        ),
        "prompts must be a list of texts or token-id lists, got str",
    ),
    # one declaration per option, one checker (core.options); sampling arguments used or refused
    (
        _gen("hi", method="self-spec", draft_len=True),
        "draft_len must be an integer in [1, 256] or none (the dtype's tuned one), got True",
    ),
    (_gen("hi", method="self-spec", draft_len=__import__("numpy").int64(0)), "draft_len must be an integer"),
    (
        _gen("hi", method="prompt-lookup", draft_len=257),
        "draft_len must be an integer in [1, 256] or none (the dtype's tuned one), got 257",
    ),
    (_gen("hi", method="self-spec", exit_layer=4), "exit_layer must be an integer in [1, 3] (n_layers-1 = 3"),
    (_gen("hi", method="bild", alpha_rb=math.nan), "alpha_rb must be a finite number >= 0; inf: never roll back"),
    (_gen("hi", method="self-spec", min_confidence=math.inf), "min_confidence must be a finite number in [0, 1]"),
    (_gen("hi", method="skipdecode", decay="weird"), "decay must be one of linear, power, got 'weird'"),
    (_gen("hi", method="medusa", tree="a;b"), "tree: cannot read the tree shape 'a;b'"),
    (_gen("hi", method="speculative"), "method 'speculative' needs the option draft"),
    (_gen("hi", method="speculative", draft=None), "draft must be a model"),
    (_gen("hi", method="greedy", temperature=0.7), "method 'greedy' decodes greedily and would ignore temperature"),
    (_gen("hi", method="ppd", do_sample=True), "method 'ppd' decodes greedily only"),
    (_gen("hi", method="self-spec", do_sample=False, top_p=0.5), "do_sample=False decodes greedily and would ignore"),
    (lambda m, p: layerleap.METHODS["nosuch"], "unknown method 'nosuch': choose one of auto, bild"),
    (_load("{D}", device="cuda:99"), "device 'cuda:99'"),
    (_load("{D}", device="gpu"), "device 'gpu'"),
    (_load("{D}", device=5.5), "device must be text such as 'cpu' or 'cuda', got 5.5"),
    (lambda m, p: importlib.import_module("layerleap.datasets").spec_bench(p["EMPTYJSONL"]), "holds no questions"),
    (lambda m, p: importlib.import_module("layerleap.datasets").spec_bench(categories=""), "categories '' names none"),
    (lambda m, p: importlib.import_module("layerleap.datasets").spec_bench(categories=[]), "categories [] names none"),
    (_gen([1, 2], max_new_tokens=10**5000), "with max_new_tokens=an integer of 16610 bits that exceeds the context"),
    # a wrong object is named by a short one-line repr, not a model's many lines
    (lambda m, p: layerleap.generate(m, [1, 2], "self-spec", 2, head=m), "an ExitHead, got Transformer( (tok_emb"),
    (lambda m, p: layerleap.generate(m, [1, 2], "rest", 2, corpus=m), "a Corpus, got Transformer( (tok_emb"),
    (lambda m, p: layerleap.generate(m, [1, 2], "self-spec", 2, draft_vocab=m), "a DraftVocab, got Transformer( (tok"),
    (lambda m, p: layerleap.generate(m, [1, 2], "medusa", 2, heads=m), "a drafter object, got Transformer( (tok"),
]


@pytest.mark.parametrize("call, message", API, ids=[f"api{i:03d}" for i in range(len(API))])
def test_api(tiny, places, call, message):
    with pytest.raises(LayerleapError) as e:
        call(tiny, places)
    text = str(e.value)
    assert text and "\n" not in text and _fill([message], places)[0] in text, text


# -- real subprocesses ------------------------------------------------------------------------------
def _run(argv, stdin=None) -> subprocess.CompletedProcess:
    return subprocess.run(layerleap_cmd() + argv, input=stdin, capture_output=True, timeout=300)


@pytest.mark.parametrize(
    "argv, stdin, message",
    [
        (
            ["generate", "--model", "{D}", "--prompt", "-"],
            b"\xff\xfe\x80 not utf-8",
            "is not UTF-8 text (byte 0xff at offset 0)",
        ),
        (["generate", "--model", "{D}", "--prompt", b"caf\xe9"], None, "is not valid UTF-8 text"),
        (["generate", "--model", "{D}", "--prompt", "-"], b"\0" * 2_000_001, "is larger than the limit of 1 MB"),
        (["bench", "--model", "{D}", "--json", b"r\xff.json"], None, "is not valid UTF-8 text"),
    ],
)
def test_subprocess(places, argv, stdin, message):
    argv = [a if isinstance(a, bytes) else _fill([a], places)[0] for a in argv]
    p = _run(argv, stdin)
    err = p.stderr.decode(errors="replace").strip()
    assert p.returncode == 2 and p.stdout == b"" and "Traceback" not in err, err
    assert message in err.splitlines()[-1] and sum(": error: " in ln for ln in err.splitlines()) == 1, err


# -- model-independent checks come before the model loads ------------------------------------------
BEFORE_LOAD = [
    (["chat", *M, "--temperature", "0.5"], "method 'greedy' decodes greedily and would ignore temperature"),
    (["chat", *M, "--method", "nope"], "unknown method 'nope'"),
    (
        ["chat", *M, "--method", "self-spec", "--opt", "draft_len=-1"],
        "draft_len must be an integer in [1, 256] or none",
    ),
    (["chat", *M, "--load", "{T}/nosuch.json"], "cannot read conversation file"),
    (["chat", *M, "--load", "{GARBAGE}"], "is not valid JSON"),
    (["chat", *M, "--load", "{NOTES_JSON}"], "not a list of messages"),
    (MR + ["--layers", "2", "--heads", "shared", "--category", ","], "--category ',' names no category"),
    (
        ["train", "corpus", *M, "--out", "{T}/c.safetensors", "--calibration-prompts", "0", "--draft-len", "8"],
        "--draft-len: not used with --calibration-prompts 0",
    ),
    (
        ["train", "corpus", *M, "--out", "{T}/c.safetensors", "--calibration-prompts", "0", "--max-new-tokens", "8"],
        "--max-new-tokens: not used with --calibration-prompts 0",
    ),
    (
        ["finetune", "variant", *M, "--objective", "calm", "--target-speedup", "3", "--out", "{T}/v.safetensors"]
        + ["--data", "{T}/d.jsonl"],
        "--target-speedup: not used with --objective calm",
    ),
    (
        ["finetune", "variant", *M, "--objective", "skipdecode", "--min-layer", "2", "--layers-per-step", "2"]
        + ["--out", "{T}/v.safetensors", "--data", "{T}/d.jsonl"],
        "--min-layer, --layers-per-step: not used with --objective skipdecode",
    ),
    (AL + ["--exit-layer", "2", "--head", "shared", "--out", "{T}/h.safetensors"], "--head is not used by align"),
    (AL + ["--exit-layer", "2", "--head", "{MEDUSA}", "--out", "{T}/h2.safetensors"], "--head is not used"),
    (AL + ["--small", "{D}", "--rank", "8", "--out", "{T}/s"], "--rank: not used with --small"),
    (AL + ["--small", "{D}", "--val-every", "0", "--out", "{T}/s"], "--val-every: not used with --small"),
    (G + ["--quality", "0.9"], "method 'greedy' has no quality budget: quality= (--quality) applies to the lossy"),
    (G + ["--method", "calm", "--quality", "0.954"], "quality is a share in hundredths (0.95, 0.9, …), got 0.954"),
    (G + ["--regex", "("], "cannot compile the regex grammar: at 1(8): invalid regex"),
    (
        ["calibrate", "calm", *M, "--prompts", "1"],
        "3 prompts cannot certify any setting at epsilon=0.1, delta=0.1: give --prompts 8",
    ),
    (EX + ["--methods", "prompt-lookup", "--draft", "{D}"], "--draft: not used: no method of this run takes a draft"),
    (G + ["--json-schema", ""], "--json-schema is empty: give a JSON schema file or the schema itself"),
    (G + ["--json-schema", " [1]"], "a JSON schema is a JSON object, got list"),
    (G + ["--json-schema", "true"], "a JSON schema is a JSON object, got bool"),
    (G + ["--json-schema", "{T}"], "JSON schema file {T} is a folder: give a readable JSON file or the schema itself"),
    (G + ["--grammar", "{T}/nosuch.gbnf"], "grammar file {T}/nosuch.gbnf not found: give a readable GBNF or Lark"),
    (
        G + ["--method", "self-spec", "--opt", "draft_len=3", "--opt", "draft_len=4"],
        "--opt draft_len is given 2 times: give each option once",
    ),
    (["generate", *M, "--prompt", "-1e3"], "expected one argument: give it a value (one that starts with '-' is "),
    (["train", "data", *M, "--self-distill", "2", "--out", "{T}/a.csv"], "a JSON lines file must end in .jsonl"),
    (["train", "data", *M, "--self-distill", "2", "--out", "{T}"], "is a folder: give a file name"),
    (["train", "data", *M, "--self-distill", "2", "--out", "/proc/x.jsonl"], "cannot be written"),
    (["calibrate", "calm", *M, "--check", "{T}/c.json", "--extra", "1"], "--extra: not used with --check"),
    (
        [
            "calibrate",
            "calm",
            *M,
            "--check",
            "{T}/c.json",
            "--epsilon",
            "0.2",
            "--delta",
            "0.2",
            "--report",
            "{T}/r.json",
        ],
        "--report, --epsilon, --delta: not used with --check (it reads the calibration's): drop them",
    ),
    (G + ["--method", "medusa", "--opt", "tree=a;b"], "tree: cannot read the tree shape"),
    (G + ["--method", "medusa", "--opt", "tree=1000"], "more than 512 nodes"),
    (G + ["--method", "self-spec", "--opt", "draft_len=-1"], "draft_len must be an integer in [1, 256] or none"),
    (G + ["--method", "skipdecode", "--opt", "decay=weird"], "decay must be one of linear, power"),
    (G + ["--method", "calm", "--opt", "threshold=nan"], "threshold must be a finite number, got nan"),
    (G + ["--method", "self-spec", "--opt", "exit_layer=0"], "exit_layer must be an integer in [1, n_layers-1]"),
    (G + ["--method", "greedy", "--opt", "nosuch=1"], "method 'greedy' has no option nosuch"),
    (G + ["--method", "self-spec", "--opt", "head=/no/such/head.safetensors"], "head must be one of auto, shared"),
    (G + ["--method", "medusa", "--opt", "heads=/no/such.safetensors"], "heads must be one of trained or an existing"),
    (G + ["--method", "greedy", "--temperature", "1.5"], "would ignore temperature"),
    (G + ["--method", "ppd", "--do-sample"], "decodes greedily only"),
    (["demo", *M, "--prompt", ""], "--prompt is empty"),
    (["demo", *M, "--prompt", "  "], "--prompt is empty"),
    (["bench", *M, "--methods", "calm", "--opt", "calm.threshold=nan"], "threshold must be a finite number, got nan"),
    (["bench", *M, "--methods", "s=self-spec", "--opt", "s.draft_len=0"], "s: draft_len must be an integer"),
    (["bench", *M, "--methods", "greedy", "--top-k", "3"], "--top-k: no method of this run samples"),
    (["serve", *M, "--method", "self-spec", "--opt", "draft_len=0"], "draft_len must be an integer in [1, 256]"),
    (["serve", *M, "--method", "greedy", "--opt", "k=1"], "method 'greedy' has no option k"),
    (EX + ["--methods", "speculative"], "needs a second model: give --draft NAME"),
    (EX + ["--methods", "ppd", "--opt", "ppd.k=0"], "k must be an integer in [1, min(vocab_size, 64)], got 0"),
    (TM + ["--out", "{T}/m.safetensors", "--layers", "10"], "--layers is for `layerleap train transfer`"),
    (TM + ["--out", "{T}/m.safetensors", "--attention"], "--attention is for `layerleap train eagle`"),
    (TT + ["--out", "{T}/t.safetensors", "--attention"], "--attention is for `layerleap train eagle`"),
    (["eval", "self-spec", *M, "--draft-lens", "0"], "each item draft_len must be an integer in [1, 256]"),
    (["eval", "ppd-parallel", *M, "--k", "0"], "k must be an integer in [1, min(vocab_size, 64)], got 0"),
    (SB + ["--alpha-fb", "nan"], "alpha_fb must be a finite number in [0, 1]"),
]


@pytest.fixture
def no_loading(monkeypatch):
    """Every way a command loads a model, replaced by a recorder: a row that loads fails the test."""
    from layerleap.core import loading
    from layerleap.drafters import variants

    calls = []

    def refuse(*a, **kw):
        calls.append(a)
        raise AssertionError(f"the model was loaded: {a}")

    monkeypatch.setattr(variants, "load", refuse)
    monkeypatch.setattr(loading, "load", refuse)
    monkeypatch.setattr(loading, "load_folder", refuse)
    return calls


@pytest.mark.parametrize("argv, message", BEFORE_LOAD, ids=[f"{i:03d} {_id(r)}" for i, r in enumerate(BEFORE_LOAD)])
def test_refused_before_loading(capsys, places, no_loading, argv, message):
    test_cli(capsys, places, argv, message)
    assert not no_loading


def test_unknown_method_is_a_key_error():
    with pytest.raises(KeyError, match="unknown method 'nosuch'"):
        layerleap.METHODS["nosuch"]
    with pytest.raises(LayerleapError):
        layerleap.METHODS["nosuch"]
    assert "nosuch" not in layerleap.METHODS and layerleap.METHODS.get("nosuch") is None


# -- never overwrite an input -------------------------------------------------------------------------
# Every command compares its output paths with its input paths before any work (``cli.check_paths``):
# an output that is an input (by inode: hard and symbolic links too), a folder output that holds an
# input, two outputs that are one path, and an existing output of another kind are refused, and every
# byte under the folder stays as it was.


@pytest.fixture
def victims(tmp_path, char_model_dir):
    """A fresh folder of things a command must not destroy: ``{name: path}``."""
    import os
    import shutil

    from safetensors.torch import save_file

    from layerleap.drafters import medusa_transfer as drafters

    root = tmp_path / "v"
    model = root / "model"
    shutil.copytree(char_model_dir, model)
    drafters.save_drafter(
        drafters.new_drafter(layerleap.load_folder(model), "medusa", steps=2), root / "medusa.safetensors"
    )
    save_file({"chunks": torch.arange(16).view(2, 8)}, str(root / "chunks.safetensors"), {"kind": "token-chunks"})
    save_file({"x": torch.zeros(2)}, str(root / "plain.safetensors"))
    save_file({"x": torch.zeros(2)}, str(root / "h8.safetensors"), {"kind": "exit-heads"})
    save_file({"chunks": torch.arange(6).view(2, 3)}, str(root / "short.safetensors"), {"kind": "token-chunks"})
    os.link(root / "chunks.safetensors", root / "hardlink.safetensors")
    os.symlink(root / "chunks.safetensors", root / "symlink.safetensors")
    os.link(root / "medusa.safetensors", root / "medusa-link.json")
    (root / "README.md").write_text("# my notes\n")
    (root / "page.html").write_text("<html>mine</html>\n")
    (root / "report.json").write_text(json.dumps({"command": "layerleap bench", "mine": True}))
    (root / "table.md").write_text("`layerleap sweep bild` mine\n")
    (root / "plot.png").write_bytes(b"\x89PNG mine")
    (root / "ours.html").write_text("<p>Written by layerleap 1</p>\n")
    (root / "data.jsonl").write_text('{"prompt": [1, 2], "completion": [3]}\n')
    (root / "held").mkdir()
    shutil.copy(root / "chunks.safetensors", root / "c.safetensors.ckpt.safetensors")
    (root / "mo.safetensors.work").write_text("mine")
    (root / "held" / "v.safetensors").write_bytes(b"a variant of mine")
    return {"T": str(root), "M": str(model), **{p.stem.upper(): str(p) for p in root.iterdir() if p.is_file()}}


def _snapshot(root) -> dict:
    from pathlib import Path

    return {str(p): (p.read_bytes() if p.is_file() else None) for p in sorted(Path(root).rglob("*"))}


def _refused(argv, places, message, capsys):
    before = _snapshot(places["T"])
    rc = main(_fill(argv, places))
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, (rc, err[-2000:])
    assert _fill([message], places)[0] in err.strip().splitlines()[-1], err[-2000:]
    assert _snapshot(places["T"]) == before, "an input's bytes changed (or a file appeared)"


TTV = ["train", "transfer", "--model", "{M}", "--steps", "1", "--seq-len", "8", "--layers", "2"]
TMV = ["train", "medusa", "--model", "{M}", "--steps", "1", "--seq-len", "8"]
OVERWRITE = [
    # an output that is an input
    (TTV + ["--out", "{CHUNKS}", "--chunks", "{CHUNKS}"], "--out {CHUNKS} is also --chunks"),
    (TMV + ["--out", "{T}/m.safetensors", "--chunks", "{CHUNKS}", "--save-chunks", "{CHUNKS}"], "is also --chunks"),
    (TMV + ["--out", "{T}/m.safetensors", "--chunks", "{CHUNKS}", "--save-chunks", "{HARDLINK}"], "is also --chunks"),
    (TMV + ["--out", "{SYMLINK}", "--chunks", "{CHUNKS}"], "--out {SYMLINK} is also --chunks"),
    (TMV + ["--out", "{M}/model.safetensors"], "holds tensors"),
    (
        ["heads", "info", "{MEDUSA}", "--json", "{MEDUSA-LINK}"],
        "{MEDUSA-LINK} exists and is not a layerleap report",
    ),
    (["finetune", "skipdecode", "--model", "{M}", "--steps", "1", "--out", "{T}"], "--out {T} holds --model {M}"),
    (["finetune", "skipdecode", "--model", "{M}", "--steps", "1", "--out", "{M}"], "--out {M} is also --model"),
    (["theory", "ppd", "--measure", "--model", "{M}", "--out", "{M}"], "is also --model"),
    (
        [
            "heads",
            "sub-vocab",
            "--model",
            "{M}",
            "--heads",
            "{H8}",
            "--vocab",
            "8,16",
            "--out",
            "{T}/h{vocab}.safetensors",
        ],
        "--out {H8} is also --heads",
    ),
    (["calibrate", "calm", "--model", "{M}", "--out", "{T}"], "holds --model"),
    (["bench", "--model", "{M}", "--data", "{REPORT}", "--json", "{REPORT}"], "--json {REPORT} is also --data"),
    (
        ["eval", "frontier", "--model", "{M}", "--grid", "base:calm", "--json", "{T}/r.json"]
        + ["--with-variant", "v={PLOT}", "--plot", "{PLOT}"],
        "--plot {PLOT} is also --with-variant",
    ),
    # a file an output brings beside it (its checkpoint, work folder) that is an input
    (TMV + ["--out", "{T}/c.safetensors", "--chunks", "{T}/c.safetensors.ckpt.safetensors"], "--out's checkpoint"),
    (
        [
            "train",
            "heads",
            "--model",
            "{M}",
            "--layers",
            "2",
            "--out",
            "{T}/mo.safetensors",
            "--variant",
            "{T}/mo.safetensors.work",
        ],
        "--out's work folder",
    ),
    # two outputs that are one path
    (
        [
            "train",
            "heads",
            "--model",
            "{M}",
            "--layers",
            "2",
            "--out",
            "{T}/x.safetensors",
            "--work",
            "{T}/x.safetensors",
        ],
        "--out and --work name one path",
    ),
    (
        TMV + ["--out", "{T}/c.safetensors", "--save-chunks", "{T}/c.safetensors"],
        "--out and --save-chunks name one path",
    ),
    # an existing output of another kind
    (TTV + ["--out", "{MEDUSA}"], "--out {MEDUSA} exists and holds medusa, not transfer"),
    (TMV + ["--out", "{CHUNKS}"], "holds token-chunks, not medusa"),
    (TMV + ["--out", "{T}/m.safetensors", "--save-chunks", "{MEDUSA}"], "holds medusa, not token-chunks"),
    (TMV + ["--out", "{PLAIN}"], "holds tensors without a layerleap kind, not medusa"),
    (["heads", "upgrade", "{MEDUSA}", "--out", "{CHUNKS}"], "holds token-chunks, not medusa"),
    (["train", "heads", "--model", "{M}", "--layers", "2", "--out", "{MEDUSA}"], "holds medusa, not exit-heads"),
    (
        ["finetune", "variant", "--model", "{M}", "--objective", "calm", "--out", "{MEDUSA}", "--data", "{DATA}"],
        "not variant",
    ),
    (["align", "--model", "{M}", "--exit-layer", "2", "--out", "{MEDUSA}"], "holds medusa, not exit-heads"),
    (
        ["heads", "sub-vocab", "--model", "{M}", "--heads", "trained", "--vocab", "8", "--out", "{CHUNKS}"],
        "not exit-heads",
    ),
    (["sweep", "bild", "--model", "{M}", "--exit-layer", "2", "--table", "{README}"], "is not a layerleap table"),
    (["eval", "skipdecode", "--model", "{M}", "--table", "{README}"], "is not a layerleap table"),
    (["bench", "--model", "{M}", "--html", "{PAGE}"], "--html {PAGE} exists and is not a layerleap HTML report"),
    (["demo", "--model", "{M}", "--html", "{PAGE}"], "is not a layerleap HTML report"),
    (
        [
            "eval",
            "frontier",
            "--model",
            "{M}",
            "--grid",
            "base:calm",
            "--json",
            "{T}/r.json",
            "--plot",
            "{PLOT}",
            "--variant",
            "{PLOT}",
        ],
        "--plot {PLOT} is also --variant",
    ),
]


@pytest.mark.parametrize("argv, message", OVERWRITE, ids=[f"ow{i:02d} {_id(r)}" for i, r in enumerate(OVERWRITE)])
def test_no_command_overwrites_an_input(capsys, victims, argv, message):
    _refused(argv, victims, message, capsys)


REQUIRED = {  # the least each command needs to parse (the flag under test comes last and wins)
    "train heads": ["--layers", "2", "--out", "{T}/h.safetensors"],
    "align": ["--exit-layer", "2", "--out", "{T}/a.safetensors"],
    "finetune skipdecode": ["--out", "{T}/ft"],
    "finetune variant": ["--objective", "calm", "--out", "{T}/v.safetensors", "--data", "{T}/d.jsonl"],
    "heads sub-vocab": ["--heads", "trained", "--vocab", "8", "--out", "{T}/s.safetensors"],
    "train corpus": ["--out", "{T}/corpus.safetensors"],
    "train data": ["--self-distill", "2"],
    "train medusa": ["--out", "{T}/m.safetensors"],
    "train transfer": ["--out", "{T}/t.safetensors"],
    "train eagle": ["--out", "{T}/e.safetensors"],
    "eval frontier": ["--grid", "base:calm", "--json", "{T}/f.json"],
    "calibrate": ["calm"],
}
VICTIM = {  # a file each kind of output accepts as its own (so only the input rule can refuse it)
    "JSON report": "{REPORT}",
    "plot file": "{PLOT}",
    "JSON lines file": "{DATA}",
    "table file": "{TABLE}",
    "HTML report": "{OURS}",
    "weights file": None,  # by kind: below
    "folder": "{T}/held",
    "path": "{T}/held",
}


def _output_flags():
    import argparse

    from layerleap import cli

    cli.build_parser()
    for name, (_, setup, _) in cli._COMMANDS.items():
        p = argparse.ArgumentParser()
        setup(p)
        for _, flag, t in cli._path_args(p):
            if t.role == "out":
                yield name, flag, t


def _victim(name, flag, t):
    label = t.__name__
    if label == "weights file":
        kind = t.tags["kind"]
        kind = (
            {"train medusa": "medusa", "train transfer": "transfer", "train eagle": "eagle"}.get(name)
            if callable(kind)
            else kind
        )
        return {"medusa": "{MEDUSA}", "token-chunks": "{CHUNKS}"}.get(kind, "{T}/held/v.safetensors")
    return VICTIM[label]


@pytest.mark.parametrize(
    "name, flag, t",
    [x for x in _output_flags() if x[0] not in ("heads info", "heads upgrade")],
    ids=lambda x: getattr(x, "__name__", str(x)),
)
def test_every_output_flag_refuses_an_input(capsys, victims, name, flag, t):
    """Each output flag of each command, pointed at the file (or the folder of the file) also given as
    ``--variant``: refused before any work, every byte kept."""
    victim = _victim(name, flag, t)
    variant = "{T}/held/v.safetensors" if victim in ("{T}/held", "{T}/held/v.safetensors") else victim
    argv = [*name.split(), "--model", "{M}", *REQUIRED.get(name, []), "--variant", variant, flag, victim]
    _refused(argv, victims, f"{flag} {victim} {'holds' if victim == '{T}/held' else 'is also'} --variant", capsys)


def test_the_output_rule_is_not_in_the_way(capsys, victims):
    """Allowed: rewriting a weights file in place (``heads upgrade FILE --out FILE``), replacing an
    earlier output of the same kind, an output folder inside the model's folder."""
    from layerleap.files import check_distinct, check_replace
    from pathlib import Path

    assert main(_fill(["heads", "upgrade", "{MEDUSA}", "--out", "{MEDUSA}"], victims)) == 0
    check_replace(victims["MEDUSA"], "medusa")
    check_distinct([("--out", Path(victims["M"]) / "new")], [("--model", Path(victims["M"]))])
    check_distinct([("--json", Path(victims["T"]) / "r.json")], [("--data", Path(victims["T"]) / "nosuch.json")])


# -- sizes with bounds: a file or stdin is read up to a limit that an environment variable lifts ------
SIZES = [
    (
        {"LAYERLEAP_MAX_INPUT_MB": "0.000001"},
        G[:3] + ["--prompts-file", "{FILE}"],
        "is larger than the limit of 1e-06 MB",
    ),
    ({"LAYERLEAP_MAX_INPUT_MB": "0.000001"}, ["bench", *M, "--data", "{WEIRD}"], "set LAYERLEAP_MAX_INPUT_MB=MB"),
    ({"LAYERLEAP_MAX_INPUT_MB": "0.000001"}, SB + ["--data", "{WEIRD}"], "Spec-Bench file"),
    ({"LAYERLEAP_MAX_INPUT_MB": "0.000001"}, G + ["--grammar", "{FILE}"], "grammar file {FILE} is larger than"),
    ({"LAYERLEAP_MAX_INPUT_MB": "0.000001"}, G + ["--json-schema", "{FILE}"], "JSON schema file {FILE} is larger"),
    ({"LAYERLEAP_MAX_INPUT_MB": "lots"}, G[:3] + ["--prompts-file", "{FILE}"], "must be a number of megabytes"),
    ({"LAYERLEAP_MAX_INPUT_MB": "-1"}, G[:3] + ["--prompts-file", "{FILE}"], "must be a positive number of megabytes"),
    ({"LAYERLEAP_MAX_INPUT_MB": "nan"}, G[:3] + ["--prompts-file", "{FILE}"], "must be a positive number"),
    (
        {"LAYERLEAP_MAX_INPUT_MB": "0.000001"},
        ["finetune", "variant", *M, "--objective", "calm", "--out", "{T}/v.safetensors", "--data", "{GARBAGE}"],
        "--data {GARBAGE} is larger than the limit",
    ),
]


@pytest.mark.parametrize("env, argv, message", SIZES, ids=[f"size{i}" for i in range(len(SIZES))])
def test_size_limits(monkeypatch, capsys, places, env, argv, message):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    rc = main(_fill(argv, places))
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err[-2000:]
    assert _fill([message], places)[0] in err.strip().splitlines()[-1], err[-2000:]


def test_yes_runs_what_the_estimate_refuses(capsys, places, tmp_path):
    argv = TM + ["--out", str(tmp_path / "m.safetensors"), "--chunks", "{CHUNKS}", "--max-hours", "1e-9"]
    assert main(_fill(argv, places)) == 2
    assert "beyond the limit of 1e-09 h" in capsys.readouterr().err
    assert main(_fill(argv + ["--yes"], places)) == 0
    assert (tmp_path / "m.safetensors").is_file()


def test_the_estimate_refuses_hours_and_passes_the_defaults():
    """On a SmolLM2-135M-sized model (fp32, CPU): the defaults of the long commands start, the runs
    of hours in the examples are refused with their estimate."""
    import argparse

    from layerleap import workload

    class Model:  # what the estimate reads of a model
        device = torch.device("cpu")

        def n_params(self):
            return 134_515_008

        def parameters(self):
            return iter([torch.zeros(1)])

    m, args = Model(), argparse.Namespace(max_hours=workload.MAX_HOURS, yes=False)
    workload.check(args, workload.decoding(m, 8 * 480, 128))  # eval exactness: 7 lossless methods + greedy
    workload.check(args, workload.training(m, 60 * 1 * 128))  # train medusa's defaults
    workload.check(args, workload.decoding(m, 2 * (1 + 4 * 2 + 3 * 8), 64))  # eval skipdecode: 2 categories
    workload.check(args, workload.decoding(m, (4 + 1 + 1) * 2 * 5, 64))  # eval skipdecode-speed
    workload.check(args, workload.decoding(m, 8, 64), workload.training(m, 2 * 8 * 64))  # eval drafters, 2 drafters
    workload.check(args, workload.decoding(m, 3 * 5 * 2, 64))  # eval ppd-parallel
    workload.check(args, workload.decoding(m, 11 + 13 * 2, 32))  # demo: 11 methods, then bench on 2 prompts
    workload.check(args, workload.decoding(m, 5 * 3, 64))  # theory ppd --measure
    with pytest.raises(workload.TooLong, match=r"at least 47 h .*add --max-hours 48 \(or --yes\)"):
        workload.check(args, workload.decoding(m, (100 + 2 + 1) * 240, 512))  # a 10×10 BiLD grid, 240 prompts
    with pytest.raises(workload.TooLong, match="at least"):
        workload.check(args, workload.training(m, 1_000_000 * 1024 * 8192))
    workload.check(argparse.Namespace(max_hours=2.0, yes=True), workload.training(m, 10**15))
