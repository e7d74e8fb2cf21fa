"""The bad-input table: hostile values for every command (from each ``--help``) and public function
(from each signature).  Each must fail cleanly before any heavy work: exit code 2 (the CLI) or a
``LayerleapError`` subclass (the API), one non-empty line that names the problem, no traceback.

CLI rows run in-process through ``layerleap.cli.main``; a few run as real subprocesses (undecodable
bytes on stdin and in argv, and the console script itself).  ``{NAME}`` in a row is a path made by
the ``places`` fixture (tiny models, broken model folders, files that are not what they claim)."""

from __future__ import annotations

import importlib
import json
import math
import subprocess

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
    out = {
        "D": str(char_model_dir),
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
TT = ["train", "transfer", "--model", "{D}", "--steps", "1", "--seq-len", "8"]
MR = ["match-rate", "--model", "{D}", "--prompts", "1", "--max-new-tokens", "2"]
SV = ["heads", "sub-vocab", "--model", "{D}"]
EX = ["eval", "exactness", "--model", "{D}", "--prompts", "1", "--categories", "qa", "--max-new-tokens", "2"]

CLI = [
    # the command line itself
    ([], "the following arguments are required: COMMAND"),
    (["nope"], "invalid choice: 'nope'"),
    (["train"], "the following arguments are required: {heads,transfer,medusa,data}"),
    (["eval"], "the following arguments are required"),
    (["generate"], "one of the arguments --prompt --prompts-file is required"),
    (["generate", "--prompt"], "expected one argument"),
    (G + ["--bogus"], "unrecognized arguments: --bogus"),
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
    (G + ["--method", "medusa", "--opt", "heads={FILE}"], "cannot read Medusa heads"),
    (G + ["--method", "medusa"], "no shipped medusa weights fit tiny"),
    (G + ["--method", "hidden-transfer", "--opt", "transfer={MEDUSA}"], "transfer"),
    (G + ["--method", "skipdecode", "--opt", "target_speedup=nan"], "target_speedup must be a number in [1, 4]"),
    (G + ["--method", "skipdecode", "--opt", "target_speedup=inf"], "target_speedup must be a number in [1, 4]"),
    (G + ["--method", "skipdecode", "--opt", "target_speedup=0.5"], "target_speedup must be a number in [1, 4]"),
    (G + ["--method", "skipdecode", "--opt", "power=nan"], "power must be a finite number > 0"),
    (G + ["--method", "skipdecode", "--opt", "max_len=true"], "max_len=True must be an integer"),
    (G + ["--method", "skipdecode", "--opt", "decay=cubic"], "unknown decay 'cubic'"),
    (G + ["--method", "skipdecode", "--opt", "schedule=1234"], "schedule must be a list of integer exit layers"),
    (
        G + ["--method", "skipdecode", "--opt", "min_exit_layer=3", "--opt", "max_exit_layer=2"],
        "min_exit_layer=3 > max_exit_layer=2",
    ),
    (G + ["--method", "ppd", "--opt", "k=0"], "k must be an integer >= 1"),
    (G + ["--method", "ppd", "--opt", "k=abc"], "k must be an integer >= 1"),
    (G + ["--method", "ppd", "--opt", "k=100000"], "more than the vocabulary"),
    (G + ["--method", "ppd", "--opt", "exit_layer=1.5"], "exit_layer (d̄) must be an integer in [2, 3]"),
    (G + ["--method", "self-spec", "--opt", "draft_len=100000"], "draft_len must be an integer in [1, 256]"),
    (G + ["--method", "self-spec", "--opt", "min_confidence=2"], "min_confidence must be a probability"),
    (G + ["--method", "self-spec", "--opt", "exit_layer=0"], "exit_layer must be an integer in [1, 3]"),
    (G + ["--method", "speculative"], "method 'speculative' needs the option draft: add --opt draft=VALUE"),
    (G + ["--method", "speculative", "--opt", "draft=no-such-model"], "--opt draft: unknown model 'no-such-model'"),
    (G + ["--method", "speculative", "--opt", "draft={D}", "--opt", "draft_len=0"], "draft_len must be an integer"),
    (G + ["--method", "speculative", "--opt", "draft={D}", "--opt", "schedule=fast"], "schedule must be one of"),
    (G + ["--method", "bild", "--opt", "alpha_fb=nan"], "alpha_fb must be a probability"),
    (G + ["--method", "bild", "--opt", "alpha_rb=-1"], "alpha_rb must be a cross-entropy"),
    (G + ["--method", "bild", "--opt", "max_small=0"], "max_small must be an integer >= 1"),
    (G + ["--method", "bild", "--opt", "exit_layer=99"], "exit_layer must be an integer in [1, 3]"),
    (G + ["--method", "bild", "--opt", "small=no-such-model"], "--opt small: unknown model"),
    (G + ["--method", "calm", "--opt", "threshold=nan"], "threshold must be a number"),
    (G + ["--method", "calm", "--opt", "min_exit_layer=0"], "min_exit_layer must be an integer in [1, 4]"),
    (G + ["--method", "early-exit"], "needs the option exit_layer"),
    (G + ["--method", "early-exit", "--opt", "exit_layer=true"], "exit_layer must be an integer in [1, 4], got True"),
    (G + ["--method", "sample", "--opt", "tree=1"], "has no option tree"),
    # methods
    (["methods", "--bogus"], "unrecognized arguments: --bogus"),
    (["methods", "greedy"], "unrecognized arguments: greedy"),
    (["native", "--bogus"], "unrecognized arguments: --bogus"),
    (["native", "build"], "unrecognized arguments: build"),
    # serve (the address is tried before the model loads)
    (["serve", *M, "--port", "70000"], "must be an integer in [0, 65535]"),
    (["serve", *M, "--port", "-1"], "must be an integer in [0, 65535]"),
    (["serve", *M, "--port", "http"], "must be an integer in [0, 65535]"),
    (["serve", *M, "--host", "256.1.1.1"], "cannot serve on 256.1.1.1:8000"),
    (["serve", *M, "--host", "127.0.0.1", "--port", "{BUSYPORT}"], "cannot serve on 127.0.0.1:{BUSYPORT}"),
    (["serve", *M, "--max-tokens", "0"], "must be an integer in [1, 1000000]"),
    (["serve", *M, "--max-batch", "0"], "must be an integer in [1, 4096]"),
    (["serve", *M, "--max-running", "99999"], "must be an integer in [1, 1024]"),
    (["serve", *M, "--method", "nope"], "unknown method 'nope'"),
    (["serve", *M, "--name", "bad \udcff"], "is not valid UTF-8"),
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
    (["bench", *M, "--methods", "greedy,nope"], "unknown method 'nope'"),
    (["bench", *M, "--methods", "a=greedy,a=sample"], "used twice"),
    (["bench", *M, "--opt", "greedy.k"], "bad option"),
    (["bench", *M, "--opt", "k=1"], "METHOD.NAME=VALUE"),
    (["bench", *M, "--repeat", "0"], "--repeat: must be an integer in [1, 20]"),
    (["bench", *M, "--repeat", "21"], "--repeat: must be an integer in [1, 20]"),
    (["bench", *M, "--opt", "other.k=1"], "names no method"),
    (["bench", *M, "--opt", "greedy.k=1"], "has no option k"),
    (["bench", *M, "--methods", "speculative"], "needs option draft"),
    (["bench", *M, "--methods", "speculative", "--opt", "speculative.draft=nope"], "unknown model 'nope'"),
    (["bench", *M, "--prompts", "0"], "must be a positive integer"),
    (["bench", *M, "--data", "/no/such/question.jsonl"], "not found"),
    (["bench", *M, "--data", "{GARBAGE}"], "is not a Spec-Bench question.jsonl"),
    (["bench", *M, "--data", "{WEIRD}"], "question_id must be an integer"),
    (["bench", *M, "--methods", "=greedy"], "has an empty label"),
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
    (SB + ["--alpha-fb", "2"], "--alpha-fb: each item must be a finite number in [0, 1], got 2"),
    (SB + ["--alpha-fb", "nan"], "got nan"),
    (SB + ["--alpha-fb", "x"], "each item must be a finite number"),
    (SB + ["--alpha-fb", ",".join(["0.5"] * 101)], "beyond the limit of 100"),
    (
        SB + ["--alpha-fb", ",".join(f"0.{i:02d}" for i in range(30)), "--alpha-rb", ",".join(map(str, range(1, 31)))],
        "900 is beyond the limit of 200",
    ),
    (SB + ["--alpha-rb", "-1"], "--alpha-rb: each item must be a finite number >= 0"),
    (SB + ["--alpha-rb", "nan"], "got nan"),
    (SB + ["--draft-lens", "0"], "each item must be an integer in [1, 256]"),
    (SB + ["--draft-lens", "999"], "each item must be an integer in [1, 256]"),
    (SB + ["--speculative", "fast:2"], "schedule must be one of 'constant', 'heuristic'"),
    (SB + ["--speculative", "heuristic"], "not SCHEDULE:γ[:MIN_CONFIDENCE]"),
    (SB + ["--speculative", "heuristic:x"], "not SCHEDULE:γ[:MIN_CONFIDENCE]"),
    (SB + ["--speculative", "constant:4:2"], "min_confidence must be a probability"),
    (SB + ["--exit-layer", "9"], "--exit-layer must be in [1, 3]"),
    (SB + ["--exit-layer", "0"], "must be a positive integer"),
    (["sweep", "bild", *M, "--small", "no-such-model"], "unknown model 'no-such-model'"),
    # calibrate, eval frontier, finetune variant
    (["calibrate", "nope"], "choose lossy methods from skipdecode"),
    (["calibrate", "skipdecode", *M, "--quality", "1.5"], "--quality: must be a finite number in (0, 1]"),
    (["calibrate", "skipdecode", *M, "--prompts", "0"], "--prompts: must be an integer in [1, 20]"),
    (["eval", "frontier", *M, "--grid", "base:nope", "--json", "{T}/f.json"], "--grid base:nope: choose a method"),
    (["eval", "frontier", *M, "--json", "{T}/f.json"], "the following arguments are required: --grid"),
    (
        ["finetune", "variant", *M, "--objective", "nope", "--out", "{T}/v.safetensors", "--data", "{T}/d.jsonl"],
        "argument --objective: invalid choice: 'nope'",
    ),
    (["sweep", "bild", *M, "--small", "{D}", "--head", "shared"], "--head chooses the exit head"),
    (SB + ["--head", "/no/such/head.safetensors"], "is neither one of auto, shared, trained nor an existing"),
    (SB + ["--max-small", "x"], "must be an integer in [1, 10000]"),
    (SB + ["--max-small", "-1"], "must be an integer in [1, 10000]"),
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
    (AL + ["--exit-layer", "2", "--out", "{T}/h.safetensors", "--lr", "0"], "must be a finite number > 0"),
    (AL + ["--exit-layer", "2", "--out", "{T}/h.safetensors", "--lr", "nan"], "got nan"),
    (AL + ["--exit-layer", "2", "--out", "{T}/h.safetensors", "--seed", "-5"], "must be an integer in [0, "),
    (AL + ["--exit-layer", "2", "--out", "{T}/h.safetensors", "--rank", "-1"], "must be an integer >= 0"),
    (AL + ["--exit-layer", "2", "--out", "{T}/h.safetensors", "--val-every", "-1"], "must be an integer >= 0"),
    (AL + ["--exit-layer", "2", "--out", "{T}/h.safetensors", "--batch-tokens", "0"], "must be a positive integer"),
    (AL + ["--exit-layer", "2", "--out", "{T}/h.safetensors", "--work", "{T}/c.txt"], "must end in .json"),
    (AL + ["--exit-layer", "2", "--out", "{T}/h.safetensors", "--offset", "1000"], "no calibration prompts selected"),
    (AL + ["--exit-layer", "2", "--out", "{T}/h.safetensors", "--work", "{T}/calib.json"], "is not a calibration file"),
    (AL + ["--exit-layer", "9", "--out", "{T}/h.safetensors"], "--exit-layer must be in [1, 3]"),
    # finetune skipdecode
    (FT, "the following arguments are required: --out"),
    (FT + ["--out", "{FILE}"], "is a file: give a folder"),
    (FT + ["--out", "{T}/ft"], "fine-tuning state"),
    (FT + ["--out", "{D}"], "is the --model folder"),
    (FT + ["--out", "{NOTMODEL}"], "holds other files, not a fine-tuning run"),
    (FT + ["--out", "{T}/ft", "--gen-len", "100000"], "exceed the model's context of 2048"),
    (FT + ["--out", "/proc/ft"], "cannot be written"),
    (FT + ["--out", "{T}/ft", "--target-speedup", "7"], "invalid choice: 7 (choose from 2, 3, 4, 5)"),
    (FT + ["--out", "{T}/ft", "--lr", "nan"], "got nan"),
    (FT + ["--out", "{T}/ft", "--steps", "0"], "must be an integer in [1, 1000000]"),
    (FT + ["--out", "{T}/ft", "--batch-size", "5000"], "must be an integer in [1, 1024]"),
    (FT + ["--out", "{T}/ft", "--loss", "mse"], "invalid choice: 'mse'"),
    (FT + ["--out", "{T}/ft", "--warmup", "-1"], "must be an integer >= 0"),
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
    # eval ppd-parallel / self-spec / head-cost / drafters
    (["eval", "ppd-parallel", *M, "--k", "100000"], "cores"),
    (["eval", "ppd-parallel", *M, "--k", "0"], "must be a positive integer"),
    (["eval", "ppd-parallel", *M, "--head", "nosuch"], "is neither one of auto, shared, trained"),
    (["eval", "ppd-parallel", *M, "--head-on", "both"], "invalid choice: 'both'"),
    (["eval", "ppd-parallel", *M, "--json", "{FILE}"], "must end in .json"),
    (["eval", "self-spec", *M, "--exit-layer", "1000", "--prompts", "1"], "exit_layer must be an integer in [1, 3]"),
    (["eval", "self-spec", *M, "--draft-lens", "0"], "each item must be an integer in [1, 256]"),
    (["eval", "self-spec", *M, "--min-confidence", "2"], "must be a finite number in [0, 1]"),
    (["eval", "self-spec", *M, "--head", "nosuch"], "is neither one of"),
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
    (EX + ["--methods", "ppd", "--opt", "ppd.k=0"], "k must be an integer >= 1"),
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
    (["theory", "ppd", "--measure", *M, "--exit-layers", "99", "--prompts", "1"], "--exit-layer must be in [2, 3]"),
    (
        ["theory", "ppd", "--measure", *M, "--exit-layers", "2", "--ks", "100000", "--prompts", "1"],
        "--ks must be an integer in [1, 128]",
    ),
    (["theory", "ppd", "--measure", *M, "--head", "nosuch"], "is neither one of"),
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
    (TH + ["--layers", "2", "--out", "{T}/h.safetensors", "--json", "{FILE}"], "must end in .json"),
    (TH + ["--layers", "2", "--out", "{T}/h.safetensors", "--kind", "shared"], "invalid choice: 'shared'"),
    # train medusa / transfer
    (TM + ["--out", "{T}/m.bin"], "must end in .safetensors"),
    (TM + ["--out", "{T}/m.safetensors", "--heads", "0"], "must be an integer in [1, 64]"),
    (TM + ["--out", "{T}/m.safetensors", "--chunks", "{CHUNKS}"], "checkpoint"),
    (TM + ["--out", "{T}/m.safetensors", "--seq-len", "2"], "must be an integer in [4, 65536]"),
    (TM + ["--out", "{T}/m.safetensors", "--seq-len", "4096"], "seq_len must be an integer in [4, 2048]"),
    (TM + ["--out", "{T}/m.safetensors", "--lr", "0"], "must be a finite number > 0"),
    (TM + ["--out", "{T}/m.safetensors", "--chunks", "/no/such.safetensors"], "not found"),
    (TM + ["--out", "{T}/m.safetensors", "--chunks", "{GARBAGE}"], "cannot read chunks"),
    (TM + ["--out", "{T}/m.safetensors", "--chunks", "{CHUNKS1D}"], "does not hold token chunks"),
    (TM + ["--out", "{T}/m.safetensors", "--chunks", "{CHUNKSVOCAB}"], "does not hold token chunks"),
    (TM + ["--out", "{T}/m.safetensors", "--save-chunks", "{T}/c.npy"], "must end in .safetensors"),
    (TM + ["--out", "{T}/m.safetensors", "--max-seconds", "0"], "must be a finite number > 0"),
    (TM + ["--out", "{T}/m.safetensors", "--max-seconds", "nan"], "got nan"),
    (TM + ["--out", "{T}/m.safetensors", "--device", "tpu"], "is not a torch device"),
    (TT + ["--out", "{T}/t.safetensors", "--layers", "x"], "each item must be a positive integer"),
    (TT + ["--out", "{T}/t.safetensors", "--layers", "2,99", "--chunks", "{CHUNKS}"], "transfer layers must be"),
    # match-rate
    (MR + ["--layers", "0"], "each item must be a positive integer"),
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


def _train_drafter(out="m.safetensors", **kw):
    def run(m, p):
        from layerleap.train import medusa_transfer as train_drafters

        cfg = train_drafters.TrainConfig(kind="medusa", steps_ahead=1, train_steps=1, seq_len=8, **kw)
        return train_drafters.train(m, p["T"] + "/" + out, cfg, chunks=[[1] * 8], progress=False)

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
    (lambda m, p: layerleap.generate(m, "hi", method=None), "unknown method None"),
    (lambda m, p: layerleap.generate(m, "hi", method=["greedy"]), "unknown method ['greedy']"),
    (_gen(b"Hello"), "the prompt is bytes: decode it"),
    (_gen(bytearray(b"Hello")), "the prompt is bytes"),
    (_gen(["hi", b"x"]), "the prompt is bytes"),
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
    (_medusa(draft_vocab=3), "draft_vocab must be 'auto', 'full', a draft-vocabulary file"),
    (_medusa(draft_vocab="/no/such.safetensors"), "no such draft-vocabulary file"),
    (_medusa(tree=100000), "more than 512 nodes"),
    (_medusa(tree=[(0,)] * 600), "beyond the limit of 512 nodes"),
    (_medusa(tree=[40000]), "the tree 40000 has more than 512 nodes"),
    (_medusa(tree=[(0,), (60000,)]), "draft ranks beyond the vocabulary"),
    (_medusa(tree="1,1,1"), "the tree is 3 deep"),
    (_medusa(tree=object()), "a tree shape is top-k per depth"),
    (_gen("hi", method="skipdecode", target_speedup=math.nan), "target_speedup must be a number in [1, 4]"),
    (_gen("hi", method="skipdecode", schedule="1234"), "schedule must be a list of integer exit layers"),
    (_gen("hi", method="skipdecode", schedule=[math.inf]), "schedule must be a list of integer exit layers"),
    (_gen("hi", method="calm", threshold=math.nan), "threshold must be a number"),
    (_gen("hi", method="self-spec", draft_len=10**6), "draft_len must be an integer in [1, 256]"),
    (_gen("hi", method="speculative", draft="tiny"), "draft= must be a layerleap model"),
    (_gen("hi", method="ppd", k=True), "k must be an integer >= 1"),
    (_gen("hi", method="medusa", heads=5), "medusa weights must be 'trained', a weights file or a drafter"),
    # the functions the commands use
    (_theory(p=math.nan), "--p-correct must be a finite number, got nan"),
    (_theory(d="40"), "--layers must be an integer"),
    (
        lambda m, p: importlib.import_module("layerleap.eval.theory").simulate(40, 20, 1, 0.5, 8, trials=0),
        "trials must be a positive integer",
    ),
    (_train_drafter(out="m.bin"), "must end in .safetensors"),
    (_train_drafter(lr=math.nan), "lr must be a finite number > 0, got nan"),
    (_train_drafter(seed=-1), "seed must be an integer in [0, "),
    (_heads_cfg(lr=math.nan), "lr must be a finite number > 0, got nan"),
    (_heads_cfg(layers=(99,)), "layers must be integers in [1, 3]"),
    (_heads_cfg(epochs=True), "epochs must be a positive integer, got True"),
    (
        lambda m, p: importlib.import_module("layerleap.train.align").TrainConfig(lr=math.nan).check(),
        "lr must be a finite number > 0",
    ),
    (
        lambda m, p: importlib.import_module("layerleap.train.skipdecode").TrainConfig(lr=math.inf).resolve(4),
        "lr must be a finite number > 0, got inf",
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
]


@pytest.mark.parametrize("call, message", API, ids=[f"api{i:03d}" for i in range(len(API))])
def test_api(tiny, places, call, message):
    with pytest.raises(LayerleapError) as e:
        call(tiny, places)
    text = str(e.value)
    assert text and "\n" not in text and message in text, text


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
        (["bench", "--model", "{D}", "--json", b"r\xff.json"], None, "is not valid UTF-8 text"),
    ],
)
def test_subprocess(places, argv, stdin, message):
    argv = [a if isinstance(a, bytes) else _fill([a], places)[0] for a in argv]
    p = _run(argv, stdin)
    err = p.stderr.decode(errors="replace").strip()
    assert p.returncode == 2 and p.stdout == b"" and "Traceback" not in err, err
    assert message in err.splitlines()[-1] and sum(": error: " in ln for ln in err.splitlines()) == 1, err
