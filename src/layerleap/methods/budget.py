"""Quality budgets of the lossy methods: the settings ``layerleap calibrate`` tests, and its results.

A lossy method (``skipdecode``, ``calm``, ``early-exit``, ``bild``) trades quality for speed through
its knobs.  ``PATHS[method](n_layers)`` is the one ordered sequence of settings calibration walks,
from the most conservative (greedy's own output) to the most aggressive: Learn-then-Test's fixed
sequence.  ``layerleap calibrate`` (``layerleap.eval.calibrate``) measures each setting on a
calibration split and writes what it chose to a calibration file, one per model fingerprint, dtype
and method::

    $LAYERLEAP_CACHE/calibration/<fingerprint>/<dtype>/<method>.json   (the user's own runs)
    layerleap/data/calibration/<fingerprint>/<dtype>/<method>.json     (shipped with the package)

``calibrated(model, method, quality)`` reads the setting chosen for a budget (the user's file first,
then the shipped one); ``generate(..., quality=0.95)`` runs it, and a lossy method called with none
of its knobs runs its calibrated setting at ``DEFAULT_QUALITY`` when a file exists for the model,
else its own defaults with a warning (``uncalibrated_note``).  A user's file used on another CPU model
or thread count than the one that priced its settings still runs, with a warning once per file in a
process (``machine_note``).
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..core.cpu import cpu_signature
from ..core.run import GenerationError
from ..errors import LayerleapError
from ..files import cache_root, read_json

DEFAULT_QUALITY = 0.95  # the budget a lossy method's defaults keep (when a calibration file exists)
SHIPPED = Path(__file__).resolve().parent.parent / "data" / "calibration"
FORMAT = 1


def _skipdecode(d: int) -> list[dict]:
    """SkipDecode budgets from the full model down: ``min_exit_layer`` m from d to d/3, ``max_exit_layer``
    halfway between m and d, a warm-up of 4 layers (fewer when the budget is smaller)."""
    out = []
    for m in range(d, max(1, d // 3) - 1, -1):
        hi = min(d, m + (d - m) // 2)
        out.append({"min_exit_layer": m, "max_exit_layer": hi, "warmup": min(4, m)})
    return out


def _early_exit(d: int) -> list[dict]:
    return [{"exit_layer": e} for e in range(d, max(1, d // 2) - 1, -1)]


CALM_THRESHOLDS = (1.01, 0.9999, 0.9995, 0.999, 0.998, 0.995, 0.99, 0.98, 0.97, 0.95, 0.9, 0.8)


def _calm(d: int) -> list[dict]:
    """CALM's confidence threshold from "never exits" (a cosine above 1) down, exits allowed from two
    thirds of the depth."""
    return [{"threshold": t, "min_exit_layer": max(1, 2 * d // 3)} for t in CALM_THRESHOLDS]


BILD_PATH = (  # (alpha_fb, alpha_rb, max_small)
    (1.0, 0.69, 10),  # always fall back: the large model takes every step, greedy's tokens at greedy's cost
    (0.0, 0.69, 1),  # one small token a round, kept only where it is the large model's own: greedy's tokens
    (0.2, 0.69, 10),  # runs of confident small tokens, still greedy's tokens
    (0.5, 0.69, 10),
    (0.0, 1.0, 1),
    (0.5, 1.0, 10),
    (0.0, 1.5, 1),
    (0.5, 1.5, 10),
    (0.5, 2.0, 10),
    (0.5, 3.0, 10),
    (0.4, 3.0, 10),
    (0.3, 4.0, 10),
    (0.2, 5.0, 10),
    (0.1, 8.0, 10),
)


def _bild(d: int) -> list[dict]:
    """BiLD (its default small model: the EAGLE head where the model ships one, else the early-exit form)
    from always falling back (greedy's output, no small step), through the settings whose rollback at
    ln 2 keeps greedy's output, to rare fallback and lenient rollback."""
    return [{"alpha_fb": fb, "alpha_rb": rb, "max_small": n} for fb, rb, n in BILD_PATH]


PATHS = {"skipdecode": _skipdecode, "early-exit": _early_exit, "calm": _calm, "bild": _bild}
LOSSY = tuple(PATHS)
# methods whose first setting decodes greedy's tokens at greedy's cost (tested: SkipDecode's full budget,
# an exit after the last layer, BiLD always falling back), so calibration reuses greedy's outputs for it
FIRST_IS_GREEDY = ("skipdecode", "early-exit", "bild")


def knobs(method: str, n_layers: int) -> set[str]:
    """The options calibration sets for ``method``."""
    return {k for s in PATHS[method](n_layers) for k in s}


def check_quality(quality) -> float:
    if (
        isinstance(quality, bool)
        or not isinstance(quality, (int, float))
        or not 0 < quality <= 1  # nan compares false (math.isnan of an int past float's range overflows)
    ):
        raise GenerationError(
            f"quality must be the share of greedy's quality to keep, in (0, 1] (e.g. 0.95), got {quality!r}"
        )
    if abs(quality * 100 - round(quality * 100)) > 1e-9:
        raise GenerationError(
            f"quality is a share in hundredths (0.95, 0.9, …), got {quality!r}: calibrations are kept per hundredth, "
            f"so give {math.floor(quality * 100) / 100:.2f} or {math.ceil(quality * 100) / 100:.2f}"
        )
    return float(quality)


def budget_key(quality: float) -> str:
    """A budget's key in a calibration file: its hundredths (``check_quality`` refuses finer ones)."""
    return f"{quality:.2f}"


def calibration_path(fingerprint: str, dtype: str, method: str, root: Path | None = None) -> Path:
    root = cache_root() / "calibration" if root is None else root
    return root / fingerprint / dtype / f"{method}.json"


@dataclass(frozen=True)
class Calibrated:
    """The setting a calibration file chose for one budget."""

    method: str
    quality: float
    options: dict
    faster_than_greedy: bool  # a setting faster than greedy met the budget
    speedup: float  # modelled: greedy's step time over the setting's, its layer passes, calls and checks priced
    # as measured on the calibrating machine (``eval.step_cost``)
    path: str
    note: str  # one line for the user
    # what priced it, as the budget's run recorded it: "cpu" (``cpu_signature``) and "threads" where it did
    priced_on: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "quality": self.quality,
            "options": self.options,
            "faster_than_greedy": self.faster_than_greedy,
            "modelled_speedup": self.speedup,
            "calibration": self.path,
        }


_TOLD: set[str] = set()  # the calibration files whose machine has been compared in this process


def machine_differences(priced_on: dict) -> list[str]:
    """How this machine differs from the one that priced a calibration's settings (``Calibrated.priced_on``):
    its CPU model and its torch thread count, each where the calibration recorded it."""
    out = []
    cpu, threads = priced_on.get("cpu"), priced_on.get("threads")
    if isinstance(cpu, str) and cpu != cpu_signature():
        out.append(f"the CPU is {cpu_signature()}, not {cpu}")
    if isinstance(threads, int) and not isinstance(threads, bool) and threads != torch.get_num_threads():
        out.append(f"torch runs {torch.get_num_threads()} threads, not {threads}")
    return out


def machine_note(cal: Calibrated, model) -> str | None:
    """One line, the first time in this process that ``cal``'s file is used on a machine other than the one
    that priced it (another CPU model or thread count): what differs, and the command that calibrates here.
    None otherwise, and for the file's later uses.  The step costs that chose the fastest setting keeping
    the budget are that machine's, so here another setting may be faster."""
    if cal.path in _TOLD:
        return None
    _TOLD.add(cal.path)
    differs = machine_differences(cal.priced_on)
    if not differs:
        return None
    key = budget_key(cal.quality)
    return (
        f"{cal.method}: the calibration {cal.path} was priced on another machine ({'; '.join(differs)}), so the "
        f"setting it chose may not be the fastest here that keeps quality {key}; run "
        f"`{calibrate_command(model, cal.method, key, torch.get_num_threads())}` to price "
        "it on this one"
    )


def read_calibration(path: Path) -> dict | None:
    if not path.is_file():
        return None
    data = read_json(path, "calibration file", "delete it and run layerleap calibrate again", kind=None)
    if not isinstance(data, dict) or not isinstance(data.get("budgets"), dict):
        raise LayerleapError(f"calibration file {path} has no 'budgets': delete it and run layerleap calibrate again")
    return data


def calibration_files(model, method: str) -> list[Path]:
    """The user's calibration file of ``method`` on ``model``, then the shipped one."""
    return [
        calibration_path(model.fingerprint, model.dtype_name, method, root)
        for root in (cache_root() / "calibration", SHIPPED)
    ]


def calibrated(model, method: str, quality: float) -> Calibrated | None:
    """The calibrated setting of ``method`` on ``model`` (its fingerprint and dtype) at ``quality``,
    or None when no calibration file has that budget."""
    key = budget_key(quality)
    for path in calibration_files(model, method):
        data = read_calibration(path)
        if data is None or key not in data["budgets"]:
            continue
        b = data["budgets"][key]
        if not isinstance(b, dict):
            raise _damaged(path, key, f"holds JSON {type(b).__name__}, not an object")
        config = b.get("config") if isinstance(b.get("config"), dict) else {}
        # the shipped files' machine is written in docs/QUALITY.md; a user's own file is compared with this one
        shipped = SHIPPED in path.parents
        priced_on = {} if shipped else {k: config[k] for k in ("cpu", "threads") if k in config}
        chosen = b.get("chosen")
        settings = b.get("settings")
        if chosen is None and isinstance(settings, list) and settings and isinstance(settings[0], dict):
            first = settings[0]  # no setting met the budget: the most conservative one, said as such
            _check_options(path, key, method, first.get("options", {}))
            note = (
                f"{method}: no setting meets quality {key} on {model.config.name} ({model.dtype_name}), not even "
                f"its most conservative, {_show(first.get('options', {}))} (it lost {first.get('losses')} of "
                f"{b.get('prompts')} calibration prompts); running that one"
                + (
                    f" (the base model without variant {model.variant} decodes greedy's own output)"
                    if getattr(model, "variant", None)
                    else ""
                )
            )
            return Calibrated(method, quality, dict(first.get("options", {})), False, 1.0, str(path), note, priced_on)
        if not isinstance(chosen, dict) or not isinstance(chosen.get("options"), dict):
            raise LayerleapError(
                f"calibration file {path}: budget {key} has no chosen setting: delete it and run "
                "layerleap calibrate again"
            )
        _check_options(path, key, method, chosen["options"])
        fast = bool(b.get("faster_than_greedy"))
        speed = chosen.get("modelled_speedup", 1.0)
        if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not 0 < speed < math.inf:
            raise _damaged(path, key, f"has the modelled speedup {speed!r}, not a positive number")
        speed = float(speed)
        note = (
            f"{method} at quality {key}: {_show(chosen['options'])} (modelled {speed:.2f}x greedy's step)"
            if fast
            else f"{method}: no setting faster than greedy meets quality {key} on {model.config.name} "
            f"({model.dtype_name}); running the fastest one that does, {_show(chosen['options'])}"
        )
        return Calibrated(method, quality, dict(chosen["options"]), fast, speed, str(path), note, priced_on)
    return None


def _damaged(path: Path, key: str, what: str) -> LayerleapError:
    return LayerleapError(f"calibration file {path}: budget {key} {what}: delete it and run layerleap calibrate again")


def _check_options(path: Path, key: str, method: str, options) -> None:
    """A calibration file's setting names only ``method``'s knobs (the options calibration sets)."""
    if not isinstance(options, dict):
        raise _damaged(path, key, f"has options {type(options).__name__}, not an object")
    unknown = sorted(set(options) - knobs(method, 1))
    if unknown:
        raise _damaged(path, key, f"sets {', '.join(map(str, unknown))}, which {method}'s calibration never sets")


def _show(options: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in options.items())


def _given(model, method: str, options: dict) -> list[str]:
    """The options given that a calibration of ``method`` would set (or, SkipDecode's own ways to choose
    them, replace)."""
    mine = knobs(method, model.config.n_layers)
    if method == "skipdecode":  # its own ways of choosing the budgets, and the decay's shape the calibration ran
        mine = mine | {"schedule", "target_speedup", "decay", "power", "max_len"}
    if method == "bild" and (
        options.get("small") is not None
        or "exit_layer" in options
        or options.get("eagle", "auto") != "auto"
        or options.get("head", "auto") != "auto"
    ):
        mine = mine | {"small", "exit_layer", "eagle", "head"}  # a calibration holds for its default small model only
    return sorted(mine & set(options))


def _runs_as_given(model, method: str, options: dict) -> bool:
    """True when ``options`` already choose the setting (a knob, or SkipDecode's own schedule)."""
    return bool(_given(model, method, options))


def uncalibrated_note(model, method: str, options: dict, quality) -> str | None:
    """One line for a lossy method that runs its own defaults because no calibration file exists for
    ``model`` in its dtype (none of its knobs given, no ``quality``): their quality is unmeasured
    there, and on a small model they can print unreadable text.  None otherwise."""
    if method not in PATHS or quality is not None or _runs_as_given(model, method, options):
        return None
    if calibrated(model, method, DEFAULT_QUALITY) is not None:
        return None
    return (
        f"{method}: no calibration for {model.config.name} ({model.dtype_name}), so it runs its uncalibrated "
        f"defaults, whose quality is unmeasured here; run `{calibrate_command(model, method)}` to "
        f"get a setting that keeps {DEFAULT_QUALITY:.0%} of greedy's quality"
    )


def calibrate_command(model, method: str, quality=None, threads: int | None = None) -> str:
    """The ``layerleap calibrate`` command line that calibrates ``method`` for ``model`` in its dtype: with
    ``--model`` (and ``--variant``) where it is not the default model, which the command would calibrate."""
    from ..core.loading import DEFAULT_MODEL, PACKAGED

    name, variant = model.config.name, getattr(model, "variant_file", None)
    flags = [("--model", None if name == DEFAULT_MODEL else name if name in PACKAGED else model.source or name)]
    flags += [("--variant", variant), ("--quality", quality), ("--dtype", model.dtype_name), ("--threads", threads)]
    return shlex.join(["layerleap", "calibrate", method, *(w for f, v in flags if v is not None for w in (f, str(v)))])


def check_has_budget(method: str, quality) -> None:
    """A ``quality`` given to a method without quality budgets is refused (checked without the model)."""
    if quality is not None and method not in PATHS:
        raise GenerationError(
            f"method {method!r} has no quality budget: quality= (--quality) applies to the lossy methods "
            f"({', '.join(LOSSY)}); the others are greedy-exact or sample"
        )


def resolve(model, method: str, options: dict, quality) -> tuple[dict, Calibrated | None]:
    """The options ``method`` runs with, and the calibration they came from.  ``quality`` given: the
    calibrated setting for that budget (an error naming ``layerleap calibrate`` when there is none;
    an option that calibration sets may not be given too).  ``quality`` None and none of the
    method's knobs given: the calibrated setting at ``DEFAULT_QUALITY`` when a file exists, else the
    method's own defaults."""
    if method not in PATHS:
        check_has_budget(method, quality)
        return options, None
    given = _given(model, method, options)
    if quality is None:
        if _runs_as_given(model, method, options):
            return options, None
        cal = calibrated(model, method, DEFAULT_QUALITY)
        return ({**options, **cal.options}, cal) if cal else (options, None)
    quality = check_quality(quality)
    if given:
        raise GenerationError(
            f"quality={quality} chooses {method}'s {', '.join(sorted(knobs(method, model.config.n_layers)))}: "
            f"drop {', '.join(given)} or drop quality"
        )
    cal = calibrated(model, method, quality)
    if cal is None:
        raise GenerationError(
            f"{method} has no calibration at quality {budget_key(quality)} for {model.config.name} "
            f"({model.dtype_name}): run `{calibrate_command(model, method, quality)}`"
        )
    return {**options, **cal.options}, cal
