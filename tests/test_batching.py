"""A list of prompts on tiny random models: a method that batches decodes it as one batch, each row
as it would decode alone (greedy, and sampled under the per-row seeding rule); a method that does
not batch refuses more than one prompt.  ``LAYERLEAP_TEST_DEVICE=cuda`` runs them on a GPU
(benchmarks/gpu_check.sh)."""

from __future__ import annotations

import dataclasses
import inspect
import os

import pytest
import torch
from tiny_models import random_model

from layerleap import GenerationError, Transformer, generate
from layerleap.core.run import row_seed
from layerleap.decoding import METHODS

DEVICE = os.environ.get("LAYERLEAP_TEST_DEVICE", "cpu")
BATCHED = [name for name, m in METHODS.items() if m.batched]
ONE_AT_A_TIME = [name for name, m in METHODS.items() if not m.batched]
# options a batched method needs on a 3-layer tiny model (a new batched method with a required
# option must be added here)
OPTIONS = {
    "early-exit": {"exit_layer": 2},
    "skipdecode": {"min_exit_layer": 1, "max_exit_layer": 3},
    "medusa": {"tree": "2,1"},
    "hidden-transfer": {"tree": "2,1"},
    "eagle": {"draft_len": 3, "width": 2},
    "speculative": {"draft_len": 3, "schedule": "heuristic", "min_confidence": 0.3},
}
# untrained drafters for the tree methods, perturbed so that drafts are sometimes right, sometimes not
DRAFTERS = {
    "medusa": ("heads", "medusa", {"steps": 2}),
    "hidden-transfer": ("transfer", "transfer", {"layers": [1, 2]}),
    "eagle": ("eagle_head", "eagle", {}),
}
_MADE: dict = {}


def _drafter(model: Transformer, name: str) -> dict:
    if name == "speculative":  # the model's first two layers and its head: drafts often, not always, right
        key = (id(model), name)
        if key not in _MADE:
            draft = Transformer(dataclasses.replace(model.config, n_layers=2)).eval().requires_grad_(False)
            draft.to(model.device)
            draft.load_state_dict(
                {k: v for k, v in model.state_dict().items() if not k.startswith("layers.") or int(k.split(".")[1]) < 2}
            )
            _MADE[key] = draft
        return {"draft": _MADE[key]}
    if name not in DRAFTERS:
        return {}
    option, kind, config = DRAFTERS[name]
    key = (id(model), name)
    if key not in _MADE:
        from layerleap.drafters import medusa_transfer

        d = medusa_transfer.new_drafter(model, kind, **config)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in d.parameters():
                p.add_((torch.randn(p.shape, generator=g) * 0.3).to(p.device))
        _MADE[key] = d
    return {option: _MADE[key]}


RAGGED = [[5, 9, 2, 7, 7, 1, 3, 8, 30], [11], [4, 4, 60, 2], [17, 3, 3, 3, 3, 3, 90]]


@pytest.fixture(scope="module")
def model() -> Transformer:
    return random_model("llama-mha-untied", seed=11, scale=2.0, n_layers=3).to(DEVICE)


def with_eos(model: Transformer, eos: int) -> Transformer:
    m = Transformer(dataclasses.replace(model.config, eos_token_ids=(eos,))).eval().requires_grad_(False)
    m.load_state_dict(model.state_dict())
    return m.to(model.device)


def options(name: str, model: Transformer) -> dict:
    missing = [
        k
        for k, v in METHODS[name].options().items()
        if v is inspect.Parameter.empty and k not in {**OPTIONS.get(name, {}), **_drafter(model, name)}
    ]
    assert not missing, f"add {name}'s required options {missing} to OPTIONS"
    return {**OPTIONS.get(name, {}), **_drafter(model, name)}


def test_every_method_says_whether_it_batches():
    assert {"greedy", "sample", "skipdecode", "early-exit"} <= set(BATCHED)
    assert ONE_AT_A_TIME, "every method batches: drop the refusal tests"


@pytest.mark.parametrize("prompts", [RAGGED[:2], torch.tensor([[1, 2, 3], [4, 5, 6]])], ids=["list", "2-D tensor"])
@pytest.mark.parametrize("name", ONE_AT_A_TIME)
def test_a_method_that_does_not_batch_refuses_a_list(model, name, prompts):
    with pytest.raises(GenerationError) as e:
        generate(model, prompts, name, 4)  # refused before its options are read
    msg = str(e.value)
    assert "\n" not in msg and f"method {name!r} decodes one prompt at a time and was given 2" in msg
    assert "call it once per prompt, or use a method that batches (greedy, sample" in msg


@pytest.mark.parametrize("name", ["calm", "self-spec"])
def test_a_list_of_one_prompt_is_a_batch_of_one(model, name):
    one = generate(model, [RAGGED[0]], name, 6, stop_at_eos=False)
    assert isinstance(one, list) and len(one) == 1
    assert one[0].token_ids == generate(model, RAGGED[0], name, 6, stop_at_eos=False).token_ids


def _alone(model, name, prompts, n, **kw):
    """Each prompt decoded alone, seeded as its row of a batch would be."""
    seed = kw.pop("seed", None)
    return [
        generate(model, p, name, n, **kw, **({} if seed is None else {"seed": row_seed(seed, i)})).token_ids
        for i, p in enumerate(prompts)
    ]


@pytest.mark.parametrize("name", BATCHED)
def test_a_batched_method_decodes_each_row_as_alone(model, name):
    """Ragged prompts; an EOS id from the first row's output makes rows finish at different times."""
    kw = dict(options(name, model), do_sample=False) if METHODS[name].sampling else dict(options(name, model))
    full = _alone(model, name, RAGGED, 12, stop_at_eos=False, **kw)
    assert [r.token_ids for r in generate(model, RAGGED, name, 12, stop_at_eos=False, **kw)] == full
    m = with_eos(model, full[0][3])
    kw = dict(kw, **_drafter(m, name))
    alone = _alone(m, name, RAGGED, 12, **kw)
    assert len({len(t) for t in alone}) > 1  # the rows end at different times
    assert [r.token_ids for r in generate(m, RAGGED, name, 12, **kw)] == alone


@pytest.mark.parametrize(
    "name,prompts,kw",
    [
        ("self-spec", [[5, 9, 2], [11, 3, 4]], {"exit_layer": 1, "draft_len": 1}),
        ("self-spec", [[11], [4]], {"exit_layer": 2, "draft_len": 4}),
        ("bild", RAGGED[:3], {"exit_layer": 1}),
    ],
)
def test_an_early_exit_batch_decodes_to_the_end_of_the_context(name, prompts, kw):
    """Rows that reach the context's last position beside rows a round behind: the early exit's
    padded slots stay within the context, and each row decodes as alone."""
    m = random_model("llama-mha-untied", seed=11, scale=2.0, n_layers=3, max_position=24).to(DEVICE)
    kw = dict(kw, head="shared", stop_at_eos=False)
    n = m.config.max_position - max(map(len, prompts))
    batch = [r.token_ids for r in generate(m, prompts, name, n, **kw)]
    assert batch == _alone(m, name, prompts, n, **kw)
    assert all(len(t) == n for t in batch)


SAMPLING_BATCHED = [name for name in BATCHED if METHODS[name].sampling]


@pytest.mark.parametrize("seed", [0, 7, 2**32 - 2])
@pytest.mark.parametrize("name", SAMPLING_BATCHED)
def test_a_sampled_row_equals_its_prompt_alone_with_the_row_seed(model, name, seed):
    """Row i of a batch seeded with s samples what its prompt alone samples with seed s + i (mod 2**32)."""
    kw = dict(options(name, model), do_sample=True, temperature=1.5, stop_at_eos=False)
    batch = [r.token_ids for r in generate(model, RAGGED, name, 12, seed=seed, **kw)]
    assert batch == _alone(model, name, RAGGED, 12, seed=seed, **kw)
    assert len({tuple(t) for t in batch}) == len(batch)


@pytest.mark.parametrize("name", SAMPLING_BATCHED)
def test_a_sampled_row_does_not_depend_on_its_batch_mates(model, name):
    kw = dict(options(name, model), do_sample=True, temperature=1.5, stop_at_eos=False, seed=3)
    a = generate(model, RAGGED, name, 12, **kw)
    b = generate(model, [[8, 8, 1], RAGGED[1], [2] * 11, RAGGED[3]], name, 12, **kw)
    assert [a[1].token_ids, a[3].token_ids] == [b[1].token_ids, b[3].token_ids]
    assert a[0].token_ids != b[0].token_ids


def test_unseeded_sampling_follows_torch_manual_seed(model):
    kw = dict(do_sample=True, temperature=1.5, stop_at_eos=False)
    torch.manual_seed(5)
    a = [r.token_ids for r in generate(model, RAGGED, "sample", 10, **kw)]
    torch.manual_seed(5)
    assert [r.token_ids for r in generate(model, RAGGED, "sample", 10, **kw)] == a
    assert len({tuple(t) for t in a}) == len(a)


def test_greedy_draws_no_random_numbers(model):
    torch.manual_seed(1)
    generate(model, RAGGED, "greedy", 4)
    after = torch.rand(1)
    torch.manual_seed(1)
    assert torch.rand(1) == after
