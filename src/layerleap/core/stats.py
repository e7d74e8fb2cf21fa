"""The statistics of one generated sequence: ``Stats``, with method-specific figures in typed records.

Every result carries the figures every method has (tokens, model calls, layer evaluations, time);
a method adds its own as records: one record per row of the batch, handed to ``Run.record`` (a
record the whole batch shares is handed once to ``Run.record_all``).  ``Stats`` holds the row's
record of each kind, or None for a kind the method does not report.

Read them as attributes (``stats.draft.accepted``) or flat, as a read-only mapping
(``stats["accepted"]``): the flat form (``to_dict``) is what the CLI's ``--json``, the server's
``layerleap`` field and the benchmarks write.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields


def _optional():
    """A record field left out of the flat form while it is None."""
    return field(default=None, metadata={"optional": True})


@dataclass
class Record:
    """A method's own figures for one row."""

    def flat(self) -> dict:
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if not (f.metadata.get("optional") and v is None):
                out[f.name] = v
        return out


@dataclass
class DraftStats(Record):
    """The draft-and-verify loop (``methods.draft_verify``): ``rounds`` (target calls after the
    prompt pass while the row ran), ``drafted`` (the longest path proposed, summed), ``accepted``,
    ``acceptance`` (accepted / drafted: drafts after an end-of-sequence token are never accepted),
    ``tokens_per_round`` (the row's new tokens over ``rounds``: the prompt pass's token included)."""

    rounds: int
    drafted: int
    accepted: int
    acceptance: float | None
    tokens_per_round: float | None


@dataclass
class ExitStats(Record):
    """The early exit a drafter runs: ``exit_layer`` and the exit ``head`` used (None without one)."""

    exit_layer: int | None
    head: str | None


@dataclass
class SpeculativeStats(Record):
    """Speculative decoding's draft lengths: the longest and mean γ used, rounds cut by ``min_confidence``."""

    draft_len_max: int
    draft_len_mean: float | None
    confidence_stops: int


@dataclass
class SelfSpecStats(Record):
    """Self-speculative decoding: the exit head's rows the drafter decided on."""

    draft_steps: int


@dataclass
class EagleStats(Record):
    """The EAGLE head: head calls, each drafting one token for every drafting row (the whole batch's)."""

    head_steps: int


@dataclass
class LookupStats(Record):
    """Prompt lookup: rounds that found a draft; REST: of them, those drafted from the corpus."""

    lookups_hit: int
    corpus_drafts: int | None = _optional()


@dataclass
class TreeStats(Record):
    """The tree methods: nodes per tree, the root included (a dynamic tree: the mean a round; ``auto``: the mean
    a call verified, whatever its kind), accepted drafts per round, and Hidden Transfer's pseudo positions
    evaluated (the whole batch's)."""

    tree_nodes: int
    accepted_per_round: float | None
    pseudo_states: int | None = _optional()


@dataclass
class AutoStats(Record):
    """``auto``: rounds verified by plain calls (``lookup_rounds``: prompt lookup's chain), by
    transfer calls (``transfer_rounds``: Hidden Transfer's tree and the chain), by Medusa calls
    (``medusa_rounds``: Medusa's tree and the chain) and by EAGLE calls (``eagle_rounds``: the EAGLE
    head's drafts and the chain), and how often the choice changed (``mode_switches``)."""

    lookup_rounds: int
    transfer_rounds: int
    medusa_rounds: int
    eagle_rounds: int
    mode_switches: int


@dataclass
class CompanionStats(Record):
    """A second model's meters (``name`` "draft" or "small"), the whole batch's; flat as
    ``<name>_calls``, ``<name>_layer_evals``, ``<name>_prompt_layer_evals``."""

    name: str
    calls: int = 0
    layer_evals: int = 0
    prompt_layer_evals: int = 0

    def flat(self) -> dict:
        return {
            f"{self.name}_calls": self.calls,
            f"{self.name}_layer_evals": self.layer_evals,
            f"{self.name}_prompt_layer_evals": self.prompt_layer_evals,
        }


@dataclass
class BildStats(Record):
    """BiLD: small-model steps and tokens, the large model's passes (``large_calls`` = ``fallbacks`` +
    ``forced`` + ``final_checks``), rollbacks and the tokens they discarded, the large model's tokens."""

    small_steps: int
    small_tokens: int
    fallbacks: int
    forced: int
    final_checks: int
    rollbacks: int
    rolled_back: int
    large_tokens: int
    large_calls: int
    fallback_rate: float
    rollback_rate: float
    scored_drafts: int = 0  # draft tokens the large model's passes scored (a tree's every node)


@dataclass
class PPDStats(Record):
    """PPD's clock and early predictions (``methods.ppd``'s docstring names them)."""

    exit_layer: int
    k: int
    trials: int
    matches: int
    p_correct: float | None
    runs: int
    run_lengths: list[int]
    latency_units: int
    compute_units: int
    greedy_units: int
    theorem_latency_units: float
    theorem_compute_units: float
    latency_per_token: float | None = _optional()
    compute_per_token: float | None = _optional()
    normalised_latency: float | None = _optional()
    compute_per_time_unit: float | None = None
    head: str | None = _optional()

    def to_dict(self) -> dict:
        return self.flat()


@dataclass
class SkipStats(Record):
    """The early-exit methods: mean active layers per token and the speed-up it implies; SkipDecode's
    budgets per position, CALM's exit layers per token, the KV layers it filled and the saturation
    checks it made."""

    avg_active_layers: float
    budget_speedup: float
    budgets: tuple[int, ...] | None = _optional()
    exit_layers: tuple[int, ...] | None = _optional()
    kv_filled_layers: int | None = _optional()
    exit_checks: int | None = _optional()


@dataclass
class BudgetStats(Record):
    """The quality budget a lossy method ran at (``methods.budget``): the budget, the calibrated
    options, whether a setting faster than greedy met it, its modelled speed-up and the file; flat
    as one ``quality_budget`` mapping."""

    quality: float
    options: dict
    faster_than_greedy: bool
    modelled_speedup: float
    calibration: str

    def flat(self) -> dict:
        return {"quality_budget": {f.name: getattr(self, f.name) for f in fields(self)}}


@dataclass
class Stats(Mapping):
    """The statistics of one generated sequence (see the module docstring)."""

    method: str
    new_tokens: int
    prompt_tokens: int
    model_calls: int
    layer_evals: int
    prompt_layer_evals: int
    layers_per_token: float
    layer_calls: int  # model calls over a range of layers while the row decoded (the prompt's: one)
    tokens_per_call: float
    wall_s: float
    tokens_per_s: float
    ttft_s: float | None
    batch: int
    cached_prompt_tokens: int = 0  # prompt tokens whose keys and values came from a prompt cache (not run)
    cancelled: bool = False
    stop_string: str | None = None  # the stop string that ended the text (``generate``'s ``stop``)
    exit: ExitStats | None = None
    draft: DraftStats | None = None
    companion: CompanionStats | None = None
    speculative: SpeculativeStats | None = None
    self_spec: SelfSpecStats | None = None
    eagle: EagleStats | None = None
    lookup: LookupStats | None = None
    tree: TreeStats | None = None
    auto: AutoStats | None = None
    bild: BildStats | None = None
    ppd: PPDStats | None = None
    skip: SkipStats | None = None
    budget: BudgetStats | None = None

    def to_dict(self) -> dict:
        """The flat form: the common figures and every record's fields (``cancelled`` and ``stop_string``
        only when set)."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in RECORD_FIELDS.values():
                if v is not None:
                    out.update(v.flat())
            elif f.name not in ("cancelled", "stop_string") or v:
                out[f.name] = v
        return out

    def __getitem__(self, key: str):
        return self.to_dict()[key]

    def __iter__(self):
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.to_dict())


RECORD_FIELDS: dict[type, str] = {
    ExitStats: "exit",
    DraftStats: "draft",
    CompanionStats: "companion",
    SpeculativeStats: "speculative",
    SelfSpecStats: "self_spec",
    EagleStats: "eagle",
    LookupStats: "lookup",
    TreeStats: "tree",
    BildStats: "bild",
    PPDStats: "ppd",
    SkipStats: "skip",
    AutoStats: "auto",
    BudgetStats: "budget",
}
