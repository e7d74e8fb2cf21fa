"""Training the drafters: the loss falls on a tiny model, a run resumes from its checkpoint to the
same weights, the files carry the model's fingerprint, and training matches decoding (the drafts the
trained weights produce are the ones the decoder uses)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_model

from layerleap.drafters import medusa_transfer as drafters
from layerleap.train import medusa_transfer as train_drafters
from layerleap.train.medusa_transfer import TrainConfig, TrainError


def _chunks(vocab, n=8, seq=12, seed=0):
    """A learnable stream: a repeating pattern with noise, so tokens ahead are predictable."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(3, vocab, (7,), generator=g)
    out = []
    for _ in range(n):
        start = int(torch.randint(0, 7, (1,), generator=g))
        out.append([int(base[(start + i) % 7]) for i in range(seq)])
    return out


METHOD = {"transfer": ("hidden-transfer", "transfer"), "medusa": ("medusa", "heads"), "eagle": ("eagle", "eagle_head")}


@pytest.mark.parametrize("kind", ["transfer", "medusa", "eagle"])
def test_training_lowers_the_loss(tmp_path, kind):
    model = random_model("llama-mha-untied", seed=2)
    chunks = _chunks(model.config.vocab_size)
    cfg = TrainConfig(
        kind=kind,
        layers=[1, 2],
        steps_ahead=2,
        train_steps=25,
        seq_len=12,
        batch_size=2,
        lr=3e-2,
        warmup=2,
        save_every=10,
    )
    fresh = drafters.new_drafter(model, kind, layers=[1, 2], steps=2)
    before = train_drafters.eval_loss(model, fresh, chunks)
    report = train_drafters.train(model, tmp_path / f"{kind}.safetensors", cfg, chunks=chunks, progress=False)
    trained = drafters.load_drafter(model, report["out"], kind)
    after = train_drafters.eval_loss(model, trained, chunks)
    assert after < 0.7 * before, f"{kind}: loss {before:.3f} -> {after:.3f}"
    assert report["tokens"] == 25 * 2 * 12
    # trained weights decode greedily, token for token
    from tiny_models import naive_greedy
    from layerleap import generate

    prompt = chunks[0][:5]
    method, option = METHOD[kind]
    shape = {"draft_len": 3} if kind == "eagle" else {"tree": "2,1"}
    res = generate(model, prompt, method, 10, stop_at_eos=False, **shape, **{option: trained})
    assert res.token_ids == naive_greedy(model, prompt, 10)


def test_resume_gives_the_same_weights(tmp_path):
    model = random_model("llama-gqa-tied", seed=4)
    chunks = _chunks(model.config.vocab_size, seed=1)
    cfg = TrainConfig(kind="transfer", layers=[2, 3], train_steps=8, seq_len=12, batch_size=1, lr=1e-2, save_every=2)
    full = train_drafters.train(model, tmp_path / "full.safetensors", cfg, chunks=chunks, progress=False)
    # an interrupted run: stop after 4 steps (a checkpoint at 4), then run again to 8
    part = TrainConfig(**{**cfg.__dict__, "train_steps": 4})
    train_drafters.train(model, tmp_path / "resumed.safetensors", part, chunks=chunks, progress=False)
    resumed = train_drafters.train(model, tmp_path / "resumed.safetensors", cfg, chunks=chunks, progress=False)
    assert resumed["losses"] == full["losses"]
    a = drafters.load_drafter(model, full["out"], "transfer").state_dict()
    b = drafters.load_drafter(model, resumed["out"], "transfer").state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k])
    other = random_model("llama-gqa-tied", seed=5)
    with pytest.raises(drafters.DrafterError, match="another model"):
        drafters.load_drafter(other, full["out"], "transfer")
    with pytest.raises(TrainError, match="another model"):
        train_drafters.train(other, tmp_path / "full.safetensors", cfg, chunks=chunks, progress=False)
    with pytest.raises(TrainError, match="layers"):
        train_drafters.train(
            model,
            tmp_path / "full.safetensors",
            TrainConfig(**{**cfg.__dict__, "layers": [1, 3]}),
            chunks=chunks,
            progress=False,
        )


def test_a_run_resumed_on_another_machine_records_both(tmp_path, monkeypatch):
    from layerleap.drafters import weights

    model = random_model("llama-gqa-tied", seed=4)
    chunks, out = _chunks(model.config.vocab_size, seed=1), tmp_path / "m.safetensors"
    for steps, machine in ((2, "cpu A"), (4, "cpu B"), (6, "cpu B")):
        monkeypatch.setattr(weights, "machine", lambda device, m=machine: m)
        cfg = _small("medusa", train_steps=steps)
        train_drafters.train(model, out, cfg, chunks=chunks, progress=False)
        want = "cpu A" if steps == 2 else "cpu A; then cpu B"
        assert drafters.read_meta(out)["machine"] == want


def test_a_resume_with_another_warmup_grad_clip_or_state_dtype_is_refused_and_an_older_state_resumes(tmp_path):
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    model = random_model("llama-gqa-tied", seed=4)
    chunks, out = _chunks(model.config.vocab_size, seed=1), tmp_path / "m.safetensors"
    cache = {"state_cache": str(tmp_path / "states")}
    train_drafters.train(model, out, _small("medusa", train_steps=2, **cache), chunks=chunks, progress=False)
    for key, value in (("warmup", 5), ("grad_clip", 0.5), ("state_dtype", "float32")):
        with pytest.raises(TrainError, match=f"made with {key}="):
            cfg = _small("medusa", train_steps=4, **cache, **{key: value})
            train_drafters.train(model, out, cfg, chunks=chunks, progress=False)
    ckpt = tmp_path / "m.safetensors.ckpt.safetensors"  # a state whose settings lack the three: it resumes
    with safe_open(ckpt, "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    config = {k: v for k, v in json.loads(meta["config"]).items() if k not in ("warmup", "grad_clip", "state_dtype")}
    save_file(tensors, ckpt, {**meta, "config": json.dumps(config)})
    res = train_drafters.train(model, out, _small("medusa", train_steps=4, **cache), chunks=chunks, progress=False)
    assert res["resumed_from"] == 2
    plain = tmp_path / "plain.safetensors"  # no state cache: state_dtype shapes nothing, so it may differ
    train_drafters.train(model, plain, _small("medusa", train_steps=2), chunks=chunks, progress=False)
    cfg = _small("medusa", train_steps=4, state_dtype="float32")
    assert train_drafters.train(model, plain, cfg, chunks=chunks, progress=False)["resumed_from"] == 2


def test_a_resume_with_other_settings_is_refused_in_the_flags_given(tmp_path, char_model_dir, capsys):
    """A checkpoint of other settings names them as the command line gives them (--heads, --unroll,
    --init, --attention), with the flag that resumes it."""
    import torch
    from safetensors.torch import save_file

    from layerleap.cli import main

    chunks = tmp_path / "chunks.safetensors"
    save_file({"chunks": torch.randint(0, 100, (4, 8), generator=torch.Generator().manual_seed(0))}, str(chunks))
    base = ["--model", str(char_model_dir), "--threads", "1", "--chunks", str(chunks), "--seq-len", "8"]
    m, e = str(tmp_path / "m.safetensors"), str(tmp_path / "e.safetensors")
    init = str(tmp_path / "init.safetensors")
    assert main(["train", "medusa", *base, "--heads", "2", "--steps", "1", "--out", init]) == 0
    assert main(["train", "medusa", *base, "--heads", "2", "--steps", "1", "--init", init, "--out", m]) == 0
    assert main(["train", "eagle", *base, "--unroll", "2", "--steps", "1", "--out", e]) == 0
    capsys.readouterr()
    for argv, want in (
        (
            ["medusa", "--heads", "3", "--out", m],
            "made with --heads 2 (this run: --heads 3): give --heads 2",
        ),
        (["medusa", "--heads", "2", "--out", m], f"made with --init {init} (this run: no --init): give --init {init}"),
        (["eagle", "--unroll", "3", "--out", e], "made with --unroll 2 (this run: --unroll 3): give --unroll 2"),
        (
            ["eagle", "--unroll", "2", "--attention", "--out", e],
            "no --attention (this run: --attention): drop --attention",
        ),
    ):
        assert main(["train", argv[0], *base, "--steps", "2", *argv[1:]]) == 2
        err = capsys.readouterr().err
        assert want in err and "Traceback" not in err, err


def test_a_resume_from_an_init_file_that_changed_is_refused(tmp_path):
    """A run resumes only from the --init file it started from: the weights came from its old content,
    and the budget the written file adds to is the file's own (read again on the resume)."""
    model = random_model("llama-gqa-tied", seed=4)
    chunks = _chunks(model.config.vocab_size, seed=1)
    a, c = tmp_path / "a.safetensors", tmp_path / "c.safetensors"
    train_drafters.train(model, a, _small("medusa", train_steps=2), chunks=chunks, progress=False)
    cfg = _small("medusa", train_steps=2, init=str(a))
    train_drafters.train(model, c, cfg, chunks=chunks, progress=False)
    cfg = _small("medusa", train_steps=4, init=str(a))
    assert train_drafters.train(model, c, cfg, chunks=chunks, progress=False)["resumed_from"] == 2
    assert drafters.read_meta(c)["steps"] == "6"  # a's 2 and c's 4
    train_drafters.train(model, a, _small("medusa", train_steps=4), chunks=chunks, progress=False)  # a changes
    with pytest.raises(TrainError, match="started from another --init .*a.safetensors .the file has changed"):
        train_drafters.train(model, c, _small("medusa", train_steps=6, init=str(a)), chunks=chunks, progress=False)


def test_an_init_file_that_does_not_fit_is_refused_before_the_data_is_read(
    tmp_path, char_model_dir, monkeypatch, capsys
):
    """--init of another kind or shape is refused before ShareGPT is read and tokenized (minutes on a
    large --conversations), with the fix."""
    import layerleap.commands.hidden_transfer as ht
    from layerleap.cli import main

    base = ["--model", str(char_model_dir), "--threads", "1", "--seq-len", "8", "--steps", "1"]
    init = str(tmp_path / "init.safetensors")
    assert main(["train", "medusa", *base, "--heads", "2", "--out", init]) == 0
    capsys.readouterr()

    def read(*a, **k):
        raise AssertionError("ShareGPT read before --init was checked")

    monkeypatch.setattr(ht, "stream_chunks", read)
    for argv, want in (
        (["medusa", "--heads", "3"], "holds medusa weights for --heads 2, not --heads 3: give --heads 2"),
        (["eagle"], "is not a file of the EAGLE head"),
    ):
        assert main(["train", *argv, *base, "--init", init, "--out", str(tmp_path / "x.safetensors")]) == 2
        err = capsys.readouterr().err
        assert want in err and "Traceback" not in err, err


def test_draft_accuracy_counts_the_greedy_tokens():
    """Medusa heads at zero predict the next token again: their step-1 top-1 is right exactly where
    the greedy text repeats a token (X_{j+2} == argmax at j == X_{j+1})."""
    model = random_model("llama-gqa-tied", seed=11, scale=2.0)
    from tiny_models import naive_greedy

    prompt = [5, 6, 7]
    seq = prompt + naive_greedy(model, prompt, 20)
    heads = drafters.new_drafter(model, "medusa", steps=1)
    acc = train_drafters.draft_accuracy(model, heads, [(len(prompt), seq)], topk=(1,))
    js = range(len(prompt) - 1, len(seq) - 2)
    want = sum(seq[j + 2] == seq[j + 1] for j in js) / len(js)
    assert acc[1]["n"] == len(js) and acc[1][1] == pytest.approx(want)


def test_draft_accuracy_of_steps_past_a_short_text_is_none_and_prints():
    """A greedy text of 2 new tokens leaves step 3 (the token 4 ahead) no position and step 2 none
    after the last prompt position's: those steps report n = 0 and no accuracy (not a crash), and the
    table of ``eval drafters`` prints them."""
    from layerleap.commands.hidden_transfer import accuracy_table

    model = random_model("llama-gqa-tied", seed=11, scale=2.0)
    prompt = [5, 6, 7]
    heads = drafters.new_drafter(model, "medusa", steps=3)
    for new in (1, 2, 3):
        seq = prompt + [1] * new
        acc = train_drafters.draft_accuracy(model, heads, [(len(prompt), seq)])
        for i in (1, 2, 3):
            assert acc[i]["n"] == max(0, new - i)
            assert (acc[i][1] is None) == (new <= i)
        table = accuracy_table({"medusa": acc})
        assert len(table.splitlines()) == 4


def _small(kind, **kw) -> TrainConfig:
    return TrainConfig(
        **{
            "kind": kind,
            "layers": [1, 2],
            "steps_ahead": 2,
            "train_steps": 4,
            "seq_len": 12,
            "batch_size": 1,
            "lr": 1e-2,
            "warmup": 0,
            "save_every": 2,
            **kw,
        }
    )


@pytest.mark.parametrize("kind", ["transfer", "medusa"])
def test_init_starts_from_the_files_weights_and_adds_its_budget(tmp_path, kind):
    """``init``: the first step's loss is the loss of the file's weights (not of fresh ones), and the
    written file's budget is the two runs' total, each run's own recorded beside it."""
    import json

    from layerleap.drafters import weights

    model = random_model("llama-mha-untied", seed=2)
    chunks = _chunks(model.config.vocab_size, seed=3)
    first = train_drafters.train(model, tmp_path / "a.safetensors", _small(kind), chunks=chunks, progress=False)
    a = drafters.load_drafter(model, first["out"], kind)
    fresh = drafters.new_drafter(model, kind, layers=[1, 2], steps=2)
    at_file = train_drafters.eval_loss(model, a, chunks[:1])  # step 0's batch: chunk 0
    assert abs(at_file - train_drafters.eval_loss(model, fresh, chunks[:1])) > 1e-3
    cfg = _small(kind, train_steps=3, init=first["out"])
    second = train_drafters.train(model, tmp_path / "b.safetensors", cfg, chunks=chunks, progress=False)
    assert second["losses"][0] == pytest.approx(at_file, abs=2e-5)

    meta_a, meta_b = drafters.read_meta(first["out"]), drafters.read_meta(second["out"])
    assert int(meta_b["tokens"]) == int(meta_a["tokens"]) + 3 * 12 == 7 * 12
    assert int(meta_b["steps"]) == 7
    assert float(meta_b["train_s"]) == pytest.approx(float(meta_a["train_s"]) + second["train_s"], abs=0.15)
    before, run = json.loads(meta_b[weights.INIT_FROM]), json.loads(meta_b[weights.THIS_RUN])
    assert before == {"file": "a.safetensors", **weights.budget_of(meta_a)}
    assert (run["tokens"], run["steps"]) == ("36", "3")
    assert meta_b["data"] == f"{meta_a['data']}; then {run['data']}"
    assert meta_b["machine"] == f"{meta_a['machine']}; then {run['machine']}"
    # a third run from the second keeps the whole chain
    third = train_drafters.train(
        model,
        tmp_path / "c.safetensors",
        _small(kind, train_steps=1, init=second["out"]),
        chunks=chunks,
        progress=False,
    )
    meta_c = drafters.read_meta(third["out"])
    assert int(meta_c["tokens"]) == 8 * 12
    assert json.loads(json.loads(meta_c[weights.INIT_FROM])[weights.INIT_FROM])["file"] == "a.safetensors"
    table = weights.table({"a": meta_a, "b": meta_b})
    assert "| init_from | not recorded | a.safetensors: 48 tokens, 4 steps" in table
    assert "| this_run | not recorded | 36 tokens, 3 steps" in table


def test_init_of_another_kind_shape_or_model_is_refused(tmp_path):
    model = random_model("llama-mha-untied", seed=2)
    chunks = _chunks(model.config.vocab_size, seed=3)
    t = train_drafters.train(model, tmp_path / "t.safetensors", _small("transfer"), chunks=chunks, progress=False)
    m = train_drafters.train(model, tmp_path / "m.safetensors", _small("medusa"), chunks=chunks, progress=False)
    cases = [
        (_small("medusa", init=t["out"]), "--init: .* is not a file of Medusa heads"),
        (_small("transfer", init=m["out"]), "--init: .* is not a file of Hidden Transfer projections"),
        (_small("transfer", layers=[1, 3], init=t["out"]), "for --layers 1,2, not .*give --layers 1,2"),
        (_small("medusa", steps_ahead=3, init=m["out"]), "for --heads 2, not .*give --heads 2"),
    ]
    for cfg, msg in cases:
        with pytest.raises(TrainError, match=msg):
            train_drafters.train(model, tmp_path / "x.safetensors", cfg, chunks=chunks, progress=False)
    other = random_model("llama-mha-untied", seed=9)
    with pytest.raises(TrainError, match="--init: .*another model"):
        train_drafters.train(
            other, tmp_path / "x.safetensors", _small("transfer", init=t["out"]), chunks=chunks, progress=False
        )
    assert not (tmp_path / "x.safetensors").exists()


def _greedy_seq(model, prompt, n):
    from tiny_models import naive_greedy

    return prompt + naive_greedy(model, prompt, n)


def test_transfer_trace_and_pseudo_cosine():
    """The trace sees each layer from t_1 to the last once, its last states are the pass's output, its
    real rows are those of a plain pass; the cosines are those of the states computed directly."""
    model = random_model("llama-gqa-tied", seed=3)
    proj = drafters.new_drafter(model, "transfer", layers=[1, 2])
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in proj.proj:
            p.weight.add_(0.3 * torch.randn(p.weight.shape, generator=g))
    prompt = [5, 6, 7, 8]
    seq = _greedy_seq(model, prompt, 8)
    N, L = len(seq), model.config.n_layers
    ids = torch.tensor([seq])
    seen = {}
    with torch.no_grad():
        real, pseudo = train_drafters.transfer_outputs(model, proj, ids, trace=lambda x, h: seen.setdefault(x, h))
        plain = {x: model.run_layers(model.embed(ids), 0, x, torch.arange(N)[None]) for x in range(1, L + 1)}
    assert sorted(seen) == list(range(1, L + 1))
    assert seen[1].shape[1] == 2 * N and seen[2].shape[1] == seen[L].shape[1] == 3 * N  # step 2 joins at t_2
    torch.testing.assert_close(seen[L][:, N:].reshape(1, 2, N, -1), pseudo)
    for x in seen:
        torch.testing.assert_close(seen[x][:, :N], plain[x], atol=1e-5, rtol=1e-5)
    cos = train_drafters.pseudo_cosine(model, proj, [(len(prompt), seq)])
    assert sorted(cos["pseudo"][1]) == list(range(1, L + 1)) and sorted(cos["pseudo"][2]) == list(range(2, L + 1))
    js = torch.arange(len(prompt) - 1, N - 2 - 1)
    assert cos["n"][2] == len(js)
    h2 = plain[2][0]  # step 2's pseudo state at its layer is W_2 h_j, compared with h_{j+2}
    with torch.no_grad():
        want = torch.nn.functional.cosine_similarity(proj.transfer(2, h2[js]), h2[js + 2], dim=-1).mean()
    assert cos["pseudo"][2][2] == pytest.approx(float(want), abs=1e-5)
    copy = torch.nn.functional.cosine_similarity(plain[L][0, js], plain[L][0, js + 2], dim=-1).mean()
    assert cos["copy"][2][L] == pytest.approx(float(copy), abs=1e-5)


def test_masked_pseudo_states_change_only_later_steps():
    """Figure 7's ablation: step 1 has no earlier pseudo state, so masking leaves it; step 2 changes."""
    model = random_model("llama-gqa-tied", seed=5, scale=2.0)
    proj = drafters.new_drafter(model, "transfer", layers=[1, 1])
    seq = _greedy_seq(model, [4, 9, 2], 10)
    ids = torch.tensor(seq)
    on = train_drafters.step_logits(model, proj, ids)
    off = train_drafters.step_logits(model, proj, ids, see_earlier=False)
    torch.testing.assert_close(on[0], off[0])
    assert (on[1] - off[1]).abs().max() > 1e-3


def test_early_exit_heads_predict_ahead():
    """``ahead_cache`` pairs a state with the final state ``ahead`` positions on in the same sequence;
    an early exit at a layer scores its heads on that layer's state; trained on a repeating stream
    its step-2 head learns the token two ahead."""
    from layerleap.drafters.exit_heads import new_head
    from layerleap.train import exit_heads as eh

    model = random_model("llama-gqa-tied", seed=6, scale=4.0)
    L = model.config.n_layers
    seqs = [[3, 4, 5, 6, 7], [8, 9, 10]]
    cache = eh.cache_hidden(model, seqs, [2], progress=False)
    cache[eh.TOP_KEY] = eh.final_top_ids(model, cache[L], 4)
    two = eh.ahead_cache(cache, [5, 3], 2, L)
    assert len(two[L]) == 3 + 1  # no pair crosses into the next sequence
    for k, src, dst in ((2, [0, 1, 2, 5], None), (L, None, [2, 3, 4, 7]), (eh.TOP_KEY, None, [2, 3, 4, 7])):
        torch.testing.assert_close(two[k], cache[k][src or dst])
    assert eh.ahead_cache(cache, [5, 3], 0, L) is cache
    with pytest.raises(eh.TrainHeadsError, match="lengths"):
        eh.ahead_cache(cache, [5, 4], 1, L)
    shared = [new_head(model, 2, "shared") for _ in range(2)]
    seq = torch.tensor(seqs[0])
    got = train_drafters.step_logits(model, train_drafters.EarlyExit(2, shared), seq)
    h = model.run_layers(model.embed(seq[None]), 0, 2, torch.arange(5)[None])
    torch.testing.assert_close(got, model.logits(h)[0].expand(2, -1, -1))
    # trained on the model's own greedy text, the step-2 head learns the token two after the next
    g = torch.Generator().manual_seed(1)
    text = [_greedy_seq(model, torch.randint(3, 40, (3,), generator=g).tolist(), 21) for _ in range(12)]
    cache = eh.cache_hidden(model, text, [2], progress=False)
    cache[eh.TOP_KEY] = eh.final_top_ids(model, cache[L], 4)
    cfg = eh.HeadTrainConfig(
        layers=(2,), tokens=len(cache[L]), epochs=30, batch_tokens=64, negatives=8, candidates=4, lr=1e-2
    )
    res = eh.train_heads(model, cfg, cache=eh.ahead_cache(cache, [24] * 12, 2, L), progress=False)
    refs = [(3, t) for t in text]
    before = train_drafters.draft_accuracy(model, train_drafters.EarlyExit(2, shared), refs, (1,))
    after = train_drafters.draft_accuracy(model, train_drafters.EarlyExit(2, [shared[0], res.heads[2]]), refs, (1,))
    assert after[2][1] > before[2][1] + 0.2, (before, after)


def test_cache_hidden_batches_give_each_sequence_its_own_states():
    """Sequences cached together (right-padded, in length order) get the states each gets alone, in
    the order given; batches stay within the padded-token budget."""
    from layerleap.train import exit_heads as eh

    model = random_model("llama-gqa-tied", seed=3)
    L = model.config.n_layers
    seqs = [[3, 4, 5, 6, 7, 8], [9], [10, 11, 12], [13, 14, 15, 16], [17, 18]]
    alone = eh.cache_hidden(model, seqs, [1], progress=False, pass_tokens=1)
    together = eh.cache_hidden(model, seqs, [1], progress=False, pass_tokens=64)
    assert sorted(alone) == sorted(together) == [1, L]
    for x in (1, L):
        assert together[x].shape == (sum(map(len, seqs)), model.config.hidden_size)
        torch.testing.assert_close(together[x].float(), alone[x].float(), atol=2e-2, rtol=2e-2)
    batches = eh._length_batches(seqs, 8)
    assert sorted(i for b in batches for i in b) == list(range(5))
    assert all(max(len(seqs[i]) for i in b) * len(b) <= 8 or len(b) == 1 for b in batches)
    assert len(batches) < len(seqs)
