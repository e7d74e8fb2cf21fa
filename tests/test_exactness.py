"""Every method that claims exactness, in the settings where it claims it, against one reference:
a naive greedy loop (full no-cache forward per token).  One table, parametrized over methods, tiny
random configs and prompts (minbpe's habit); a new lossless method adds a row to EXACT.

``LAYERLEAP_TEST_DEVICE=cuda`` runs the same cases on a GPU (benchmarks/gpu_check.sh)."""

from __future__ import annotations

import os

import pytest
import torch
from tiny_models import CONFIGS, naive_greedy, random_model

from layerleap import generate
from layerleap.core import kernels
from layerleap.core.loading import quantize_model

DEVICE = os.environ.get("LAYERLEAP_TEST_DEVICE", "cpu")


def _random_drafter(model, kind: str, seed: int = 0, scale: float = 0.3, **config):
    """An untrained drafter, perturbed so that its drafts are neither trivial nor always right."""
    from layerleap.drafters import medusa_transfer as drafters

    d = drafters.new_drafter(model, kind, **config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            p.add_((torch.randn(p.shape, generator=g) * scale).to(p.device, p.dtype))
    return d


_CORPORA: dict[int, object] = {}


def _corpus(model):
    """REST's datastore for ``model``: the greedy continuations of the test prompts (drafts that are
    right) and copies with every third token changed (drafts that are wrong)."""
    from layerleap.drafters.corpus import Corpus

    if id(model) not in _CORPORA:
        V, seqs = model.config.vocab_size, []
        for seed, plen in PROMPTS:
            p = _prompt(V, plen, seed)
            s = p + generate(model, p, "greedy", 16, stop_at_eos=False).token_ids
            seqs += [s, [(t + 1) % V if i % 3 == 2 else t for i, t in enumerate(s)]]
        _CORPORA[id(model)] = Corpus(seqs, V)
    return _CORPORA[id(model)]


def _mid(m) -> int:
    return max(1, m.config.n_layers // 2)


# method -> [(label, options(model, other) -> dict)]; ``other`` is a second random model with the
# same vocabulary (a draft / small model).  Each setting must give the greedy tokens exactly.
EXACT = {
    "greedy": [("", lambda m, o: {})],
    "speculative": [
        ("defaults", lambda m, o: {"draft": o}),
        ("gamma1", lambda m, o: {"draft": o, "draft_len": 1, "min_confidence": 0.0}),
        ("gamma4", lambda m, o: {"draft": o, "draft_len": 4, "min_confidence": 0.0}),
        ("heuristic gamma1", lambda m, o: {"draft": o, "draft_len": 1, "schedule": "heuristic"}),
        (
            "heuristic gamma4 conf0.5",
            lambda m, o: {"draft": o, "draft_len": 4, "schedule": "heuristic", "min_confidence": 0.5},
        ),
        ("gamma6 conf0.9", lambda m, o: {"draft": o, "draft_len": 6, "min_confidence": 0.9}),
    ],
    "bild": [
        ("two-model rb<=ln2", lambda m, o: {"small": o, "alpha_fb": 0.6, "alpha_rb": 0.5, "max_small": 5}),
        ("early-exit rb<=ln2", lambda m, o: {"exit_layer": 1, "head": "shared", "alpha_fb": 0.6, "alpha_rb": 0.6}),
        ("always-fallback", lambda m, o: {"exit_layer": 1, "head": "shared", "alpha_fb": 1.0}),
    ],
    "skipdecode": [
        (
            "d..d warmup1",
            lambda m, o: {"min_exit_layer": m.config.n_layers, "max_exit_layer": m.config.n_layers, "warmup": 1},
        ),
        (
            "d..d warmup0",
            lambda m, o: {"min_exit_layer": m.config.n_layers, "max_exit_layer": m.config.n_layers, "warmup": 0},
        ),
    ],
    "early-exit": [("E=d", lambda m, o: {"exit_layer": m.config.n_layers})],
    "calm": [("never exits", lambda m, o: {"threshold": 1.5})],
    "ppd": [
        ("d/2 k1", lambda m, o: {"exit_layer": (m.config.n_layers + 1) // 2, "k": 1, "head": "shared"}),
        ("d-1 k3", lambda m, o: {"exit_layer": m.config.n_layers - 1, "k": 3, "head": "shared"}),
    ],
    "prompt-lookup": [
        ("defaults", lambda m, o: {}),
        ("k1 unigram", lambda m, o: {"draft_len": 1, "max_ngram": 1}),
        ("k4 bigram", lambda m, o: {"draft_len": 4, "max_ngram": 2}),
        ("k4 adaptive", lambda m, o: {"draft_len": 4, "adaptive": True}),
    ],
    "rest": [
        ("corpus", lambda m, o: {"corpus": _corpus(m)}),
        ("corpus k1 unigram", lambda m, o: {"corpus": _corpus(m), "draft_len": 1, "max_ngram": 1}),
        ("corpus k4 adaptive", lambda m, o: {"corpus": _corpus(m), "draft_len": 4, "adaptive": True}),
    ],
    "auto": [
        ("lookup only", lambda m, o: {"transfer": None}),
        ("lookup and corpus", lambda m, o: {"transfer": None, "corpus": _corpus(m)}),
        (
            "eagle and corpus",
            lambda m, o: {"transfer": None, "eagle": _random_drafter(m, "eagle", scale=0.05), "corpus": _corpus(m)},
        ),
        ("eagle", lambda m, o: {"transfer": None, "eagle": _random_drafter(m, "eagle", scale=0.05)}),
        (
            "attending eagle",
            lambda m, o: {"transfer": None, "eagle": _random_drafter(m, "eagle", scale=0.05, attention=True)},
        ),
        (
            "eagle and transfer 2,1",
            lambda m, o: {
                "tree": "2,1",
                "transfer": _random_drafter(m, "transfer", layers=[1, 1]),
                "eagle": _random_drafter(m, "eagle", scale=0.05),
            },
        ),
        (
            "adaptive 2,1",
            lambda m, o: {"tree": "2,1", "adaptive": True, "transfer": _random_drafter(m, "transfer", layers=[1, 1])},
        ),
        ("transfer 2,1", lambda m, o: {"tree": "2,1", "transfer": _random_drafter(m, "transfer", layers=[1, 1])}),
        (
            "transfer 1,1 k2",
            lambda m, o: {
                "tree": "1,1",
                "draft_len": 2,
                "max_ngram": 2,
                "transfer": _random_drafter(m, "transfer", layers=[1, 1]),
            },
        ),
    ],
    "medusa": [
        ("dynamic", lambda m, o: {"tree": "dynamic", "heads": _random_drafter(m, "medusa", scale=0.05, steps=3)}),
        (
            "dynamic n6 d2",
            lambda m, o: {
                "tree": "dynamic",
                "tree_nodes": 6,
                "tree_depth": 2,
                "heads": _random_drafter(m, "medusa", scale=0.05, steps=3),
            },
        ),
    ],
    "eagle": [
        ("gamma1", lambda m, o: {"eagle_head": _random_drafter(m, "eagle", scale=0.05), "draft_len": 1}),
        ("gamma4", lambda m, o: {"eagle_head": _random_drafter(m, "eagle", scale=0.05), "draft_len": 4}),
        (
            "gamma1 width3",
            lambda m, o: {"eagle_head": _random_drafter(m, "eagle", scale=0.05), "draft_len": 1, "width": 3},
        ),
        (
            "gamma3 width4",
            lambda m, o: {"eagle_head": _random_drafter(m, "eagle", scale=0.05), "draft_len": 3, "width": 4},
        ),
        (
            "attention gamma3 width2",
            lambda m, o: {
                "eagle_head": _random_drafter(m, "eagle", scale=0.05, attention=True),
                "draft_len": 3,
                "width": 2,
            },
        ),
        (
            "gamma5 conf0.3 full vocab",
            lambda m, o: {
                "eagle_head": _random_drafter(m, "eagle", scale=0.05),
                "draft_len": 5,
                "min_confidence": 0.3,
                "draft_vocab": "full",
            },
        ),
    ],
    "hidden-transfer": [
        (
            "dynamic",
            lambda m, o: {
                "tree": "dynamic",
                "transfer": _random_drafter(m, "transfer", scale=0.05, layers=[1, _mid(m)]),
            },
        ),
        (
            "dynamic n4 d1",
            lambda m, o: {
                "tree": "dynamic",
                "tree_nodes": 4,
                "tree_depth": 1,
                "transfer": _random_drafter(m, "transfer", scale=0.05, layers=[1, _mid(m)]),
            },
        ),
    ],
    "self-spec": [
        ("E1 gamma4", lambda m, o: {"exit_layer": 1, "draft_len": 4, "head": "shared"}),
        ("E=d-1 gamma2", lambda m, o: {"exit_layer": m.config.n_layers - 1, "draft_len": 2, "head": "shared"}),
        ("E1 heuristic", lambda m, o: {"exit_layer": 1, "draft_len": 2, "head": "shared", "schedule": "heuristic"}),
    ],
}
CASES = [(method, label, fn) for method, rows in EXACT.items() for label, fn in rows]


Q4_KERNELS = [k for k, ok in (("torch", kernels.int4_supported()), ("blocks", kernels.blocks_available())) if ok]
FORMATS = (
    ["dense"]
    + (["onednn"] if kernels.ONEDNN and DEVICE == "cpu" else [])
    + ([f"q4-{k}" for k in Q4_KERNELS] if DEVICE == "cpu" else [])
    + (["q4-blocks8"] if "blocks" in Q4_KERNELS and DEVICE == "cpu" else [])  # 8-bit activations
)


def _in_format(model, fmt: str):
    """The model with its weights as dense parameters, oneDNN's packed layout or 4-bit groups (with
    torch's int4 kernel or the native block kernel, with 15-bit activations or, ``q4-blocks8``, 8-bit)."""
    if fmt == "onednn":
        for lin in model.projections():
            lin.pack(kernels.OneDNNWeight(lin.weight.detach(), lin.bias))
        return model
    if fmt.startswith("q4-"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(kernels.Q4_ENV, fmt.removeprefix("q4-").removesuffix("8"))
            mp.setenv(kernels.Q4_ACTIVATIONS_ENV, "8" if fmt.endswith("8") else "15")
            return quantize_model(model)
    return model


@pytest.fixture(scope="module")
def models():
    """Untied heads and scale 2 give varied greedy tokens; ``other`` differs in seed only."""
    return {
        (name, fmt): (
            _in_format(random_model(name, seed=11, scale=2.0), fmt).to(DEVICE),
            _in_format(random_model(name, seed=5, scale=2.0), fmt).to(DEVICE),
        )
        for name in CONFIGS
        for fmt in FORMATS
    }


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [(0, 1), (1, 5), (2, 17)]  # (seed, length) of the random prompts


@pytest.mark.parametrize("seed,plen", PROMPTS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("method,label,options", CASES, ids=[f"{m}-{lab}" if lab else m for m, lab, _ in CASES])
def test_exact_methods_equal_naive_greedy(models, name, fmt, seed, plen, method, label, options):
    model, other = models[name, fmt]
    prompt = _prompt(model.config.vocab_size, plen, seed)
    # fp32: the naive no-cache loop; q4 (bf16 logits, where a different kernel path can flip a tie):
    # greedy decoding in the same dtype, which is what a lossless method promises to equal
    want = (
        naive_greedy(model, prompt, 12)
        if not fmt.startswith("q4")
        else generate(model, prompt, "greedy", 12, stop_at_eos=False).token_ids
    )
    got = generate(model, prompt, method, 12, stop_at_eos=False, **options(model, other))
    assert got.token_ids == want, f"{method} ({label}) differs from greedy on {name}"


@pytest.mark.skipif(DEVICE == "cpu", reason="compares a device against the CPU")
@pytest.mark.parametrize("name", list(CONFIGS))
def test_device_logits_match_cpu(models, name):
    from tiny_models import full_logits

    model, _ = models[name, "dense"]
    prompt = _prompt(model.config.vocab_size, 9, 3)
    cpu = random_model(name, seed=11, scale=2.0)
    torch.testing.assert_close(full_logits(model, prompt).cpu(), full_logits(cpu, prompt), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", FORMATS + (["bf16"] if DEVICE == "cpu" else []))
def test_trees_wider_than_a_row_by_row_call_equal_greedy(fmt):
    """Verification calls over more new tokens than ``ROW_BY_ROW_MAX`` (a 41-node tree, an EAGLE fan of
    20, Hidden Transfer's 10 nodes with their pseudo states) still give each verified token the logits of a
    one-token call: in q4 and bf16, where logits often tie, the output is greedy decoding's in the same
    format, token for token."""
    from layerleap.core.model import ROW_BY_ROW_MAX

    base = random_model("llama-mha-untied", seed=11, scale=2.0)
    model = (base.to(torch.bfloat16) if fmt == "bf16" else _in_format(base, fmt)).to(DEVICE)
    cases = [
        ("medusa", {"tree": "40", "heads": _random_drafter(model, "medusa", scale=0.05, steps=3)}),
        ("eagle", {"eagle_head": _random_drafter(model, "eagle", scale=0.05), "draft_len": 3, "width": 20}),
        ("hidden-transfer", {"tree": "3,2", "transfer": _random_drafter(model, "transfer", scale=0.05, layers=[1, 2])}),
    ]
    assert 40 > 20 > ROW_BY_ROW_MAX  # the cases' calls are wider than a row-by-row call
    for seed, plen in ((1, 7), (2, 19), (3, 3)):
        prompt = _prompt(model.config.vocab_size, plen, seed)
        want = generate(model, prompt, "greedy", 16, stop_at_eos=False).token_ids
        for method, options in cases:
            got = generate(model, prompt, method, 16, stop_at_eos=False, **options).token_ids
            assert got == want, f"{method} differs from greedy in {fmt} on prompt {seed}"
