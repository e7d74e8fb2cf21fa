"""Every method from the command line: `layerleap methods`, option values that are lists, trees and
model names, `--prompts-file`, `--device`, and `serve`'s argument checks (on a tiny random model)."""

from __future__ import annotations

import json

import pytest
from test_cli import cli

import layerleap
from layerleap.eval import bench
from layerleap import generate
from layerleap.decoding import METHODS


@pytest.fixture(scope="module")
def tiny(tiny_hf_dir):
    return layerleap.load_folder(tiny_hf_dir)


def test_methods_lists_every_method_with_flags(capsys):
    rc, out, _ = cli(capsys, "methods")
    assert rc == 0
    rows = {line.split()[0]: line.split()[1:4] for line in out.splitlines()[1:] if line[:1].strip()}
    layerleap.get_method("greedy")
    assert set(METHODS) <= set(rows)
    assert rows["greedy"] == ["yes", "yes", "-"] and rows["sample"] == ["-", "yes", "yes"]
    assert rows["self-spec"] == ["yes", "yes", "yes"] and rows["bild"] == ["-", "yes", "yes"]
    assert rows["ppd"] == ["yes", "-", "-"]
    assert "draft=required (a model)" in out and "tree=none (tree" in out
    rc, out, _ = cli(capsys, "methods", "--json")
    table = json.loads(out)
    assert table["speculative"]["exact"] and table["speculative"]["required"] == ["draft"]
    assert table["speculative"]["model_options"] == ["draft"] and table["bild"]["model_options"] == ["small"]
    assert table["skipdecode"]["batches"] and table["skipdecode"]["options"]["warmup"] == 1


@pytest.mark.parametrize(
    "text,value",
    [
        ("30,28,26", [30, 28, 26]),
        ("2,1,1", [2, 1, 1]),
        ("0.5,1", [0.5, 1]),
        ("[[0], [1], [0, 0]]", [[0], [1], [0, 0]]),
        ('{"a": 1}', {"a": 1}),
        ("0;1;0.0", "0;1;0.0"),
        ("a,b", "a,b"),
        ("7", 7),
    ],
)
def test_option_values(text, value):
    assert bench.parse_value(text) == value


def test_bad_json_option_value():
    with pytest.raises(layerleap.LayerleapError, match="starts like JSON"):
        bench.parse_value("[1, 2")


@pytest.mark.parametrize(
    "method,opts,kwargs",
    [
        ("skipdecode", ["schedule=4,3,3,2,2"], {"schedule": [4, 3, 3, 2, 2]}),
        ("medusa", ["tree=2,1"], {"tree": [2, 1]}),
        ("medusa", ["tree=[[0],[1],[0,0]]"], {"tree": [[0], [1], [0, 0]]}),
    ],
)
def test_list_and_tree_options_reach_the_method(capsys, tiny_hf_dir, tiny, method, opts, kwargs, monkeypatch):
    if method == "medusa":  # a random drafter stands in for the shipped heads of the real model
        from layerleap.drafters import medusa_transfer as drafters

        heads = drafters.new_drafter(tiny, "medusa", steps=2)
        monkeypatch.setattr(drafters, "get_drafter", lambda model, kind, spec: heads)
        kwargs = {**kwargs, "heads": heads}
    argv = [
        "generate",
        "--model",
        tiny_hf_dir,
        "--prompt",
        "Hello",
        "--max-new-tokens",
        6,
        "--method",
        method,
        "--json",
    ]
    rc, out, err = cli(capsys, *argv, *[a for o in opts for a in ("--opt", o)])
    assert rc == 0, err
    assert json.loads(out)["token_ids"] == generate(tiny, "Hello", method, 6, **kwargs).token_ids


def test_draft_option_names_a_model(capsys, tiny_hf_dir, tiny):
    """--opt draft=FOLDER loads the draft model (here the same tiny model: speculative stays exact)."""
    rc, out, err = cli(
        capsys,
        "generate",
        "--model",
        tiny_hf_dir,
        "--prompt",
        "Hello",
        "--max-new-tokens",
        8,
        "--method",
        "speculative",
        "--opt",
        f"draft={tiny_hf_dir}",
        "--opt",
        "draft_len=3",
        "--json",
    )
    assert rc == 0, err
    res = json.loads(out)
    assert res["token_ids"] == generate(tiny, "Hello", "greedy", 8).token_ids and res["stats"]["acceptance"] == 1.0
    assert "for a method option" in err
    rc, out, err = cli(
        capsys,
        "generate",
        "--model",
        tiny_hf_dir,
        "--prompt",
        "Hello",
        "--method",
        "bild",
        "--opt",
        "small=/no/such/model",
    )
    assert rc == 2 and "small" in err and "/no/such/model" in err and "unknown model" in err


def test_bench_loads_a_named_draft(capsys, tiny_hf_dir, tmp_path):
    out = tmp_path / "b.json"
    rc, _, err = cli(
        capsys,
        "bench",
        "--model",
        tiny_hf_dir,
        "--methods",
        "speculative",
        "--categories",
        "qa",
        "--max-new-tokens",
        4,
        "--opt",
        f"speculative.draft={tiny_hf_dir}",
        "--no-baseline-hf",
        "--json",
        out,
    )
    assert rc == 0, err
    report = json.loads(out.read_text())
    assert report["config"]["methods"]["speculative"]["options"]["draft"] == str(tiny_hf_dir)
    assert report["summary"]["speculative"]["matches_greedy"] == "1/1"


@pytest.mark.parametrize(
    "name,content",
    [
        ("p.jsonl", '"Hello there"\n{"prompt": "Second one"}\n\n{"turns": ["Third", "ignored"]}\n{"text": "Fourth"}\n'),
        ("P.JSONL", '"Hello there"\n{"prompt": "Second one"}\n\n{"turns": ["Third", "ignored"]}\n{"text": "Fourth"}\n'),
        ("p.txt", "Hello there\nSecond one\n\nThird\nFourth\n"),
    ],
)
def test_prompts_file_decodes_a_batch(capsys, tiny_hf_dir, tiny, tmp_path, name, content):
    f = tmp_path / name
    f.write_text(content)
    rc, out, err = cli(capsys, "generate", "--model", tiny_hf_dir, "--prompts-file", f, "--max-new-tokens", 5, "--json")
    assert rc == 0, err
    got = [json.loads(line) for line in out.splitlines()]
    texts = ["Hello there", "Second one", "Third", "Fourth"]
    want = generate(tiny, texts, "greedy", 5)
    assert [g["token_ids"] for g in got] == [w.token_ids for w in want]
    assert {g["stats"]["batch"] for g in got} == {4}  # one batch


@pytest.mark.parametrize("method", ["calm", "ppd"])
def test_prompts_file_with_a_method_that_does_not_batch(capsys, tiny_hf_dir, tiny, tmp_path, method):
    f = tmp_path / "p.txt"
    f.write_text("Hello there\nSecond one\nThird\n")
    rc, out, err = cli(
        capsys,
        "generate",
        "--model",
        tiny_hf_dir,
        "--prompts-file",
        f,
        "--max-new-tokens",
        5,
        "--method",
        method,
        "--json",
    )
    assert rc == 0, err
    assert f"method {method!r} decodes one prompt at a time: decoding the 3 prompts one after another" in err
    got = [json.loads(line) for line in out.splitlines()]
    assert [g["token_ids"] for g in got] == [
        generate(tiny, t, method, 5).token_ids for t in ["Hello there", "Second one", "Third"]
    ]
    assert {g["stats"]["batch"] for g in got} == {1}


def test_prompts_file_one_at_a_time_seeds_prompt_i_as_its_row_of_a_batch(capsys, tiny_hf_dir, tiny, tmp_path):
    """A sampled method that does not batch decodes prompt i with seed + i, as a batch's row i samples: the
    same prompt twice gives two samples, not one sample twice."""
    f = tmp_path / "p.txt"
    f.write_text("Hello there\nHello there\nThird\n")
    args = ["--prompts-file", f, "--max-new-tokens", 6, "--method", "calm", "--temperature", 1.5, "--seed", 7]
    rc, out, err = cli(capsys, "generate", "--model", tiny_hf_dir, *args, "--json")
    assert rc == 0, err
    got = [json.loads(line)["token_ids"] for line in out.splitlines()]
    want = [
        generate(tiny, t, "calm", 6, temperature=1.5, seed=7 + i).token_ids
        for i, t in enumerate(["Hello there", "Hello there", "Third"])
    ]
    assert got == want and got[0] != got[1]


BAD = [
    (["--prompts-file", "{DIR}/none.jsonl"], "not found"),
    (["--prompts-file", "{DIR}/bad.jsonl"], "bad.jsonl:2 is not JSON"),
    (["--prompts-file", "{DIR}/nofield.jsonl"], "nofield.jsonl:1"),
    (["--prompts-file", "{DIR}/empty.txt"], "holds no prompts"),
    (["--prompts-file", "{DIR}/two.txt", "--stream"], "--stream prints one prompt"),
    (["--prompt", "hi", "--stream", "--json"], "not allowed with"),
    (["--prompt", "hi", "--prompts-file", "{DIR}/two.txt"], "not allowed with"),
    (["--prompt", "hi", "--device", "cuda:7"], "device"),
    (["--prompt", "hi", "--device", "warp-drive"], "device"),
    (["--prompt", "hi", "--opt", "tree=[1,"], "starts like JSON"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_generate_input(capsys, tiny_hf_dir, tmp_path, args, message):
    (tmp_path / "bad.jsonl").write_text('"ok"\n{oops\n')
    (tmp_path / "nofield.jsonl").write_text('{"question": "x"}\n')
    (tmp_path / "empty.txt").write_text("\n  \n")
    (tmp_path / "two.txt").write_text("a\nb\n")
    argv = [a.replace("{DIR}", str(tmp_path)) for a in args]
    rc, _, err = cli(capsys, "generate", "--model", tiny_hf_dir, *argv)
    assert rc == 2 and message in err and "Traceback" not in err


@pytest.mark.parametrize(
    "args,message",
    [
        (["--method", "nope"], "unknown method"),
        (["--port", "70000"], "--port"),
        (["--method", "greedy", "--opt", "tree=2"], "has no option tree"),
        (["--opt", "nosuch=2"], "has no option nosuch"),
    ],
)
def test_serve_refuses_bad_arguments_before_serving(capsys, tiny_hf_dir, args, message):
    rc, _, err = cli(capsys, "serve", "--model", tiny_hf_dir, *args)
    assert rc == 2 and message in err


@pytest.mark.parametrize(
    "command",
    [
        "generate",
        "score",
        "info",
        "bench",
        "demo",
        "serve",
        "train heads",
        "sweep bild",
        "align",
        "eval ppd-parallel",
        "eval skipdecode",
        "finetune skipdecode",
    ],
)
def test_every_model_command_takes_model_dtype_device(command):
    from layerleap.cli import build_parser

    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices
    p = sub[command.split()[0]]
    if " " in command:
        p = p._subparsers._group_actions[0].choices[command.split()[1]]
    flags = {s for a in p._actions for s in a.option_strings}
    assert {"--model", "--dtype", "--device"} <= flags
    dtype = next(a for a in p._actions if "--dtype" in a.option_strings)
    assert set(dtype.choices) == set(layerleap.core.loading.DTYPES)


def test_serve_on_port_0_prints_the_port_it_listens_on(tiny_hf_dir):
    """``serve --port 0`` binds a free port before the model loads and prints that port, where it answers."""
    import re
    import signal
    import time
    import urllib.request

    from subprocs import Proc, layerleap_cmd

    pytest.importorskip("uvicorn")
    pytest.importorskip("fastapi")
    argv = [*layerleap_cmd(), "serve", "--model", str(tiny_hf_dir), "--host", "127.0.0.1", "--port", "0"]
    p = Proc([*argv, "--no-access-log"])
    try:
        p.wait_for(r"on http://127\.0\.0\.1:\d+/v1")
        port = int(re.search(r"on http://127\.0\.0\.1:(\d+)/v1", p.text_err()).group(1))
        assert port != 0
        end, status = time.monotonic() + 60, None
        while status is None and time.monotonic() < end:
            try:
                status = urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status
            except OSError:
                time.sleep(0.1)
        assert status == 200, p.text_err()[-2000:]
    finally:
        p.send(signal.SIGINT)
        rc, _, err = p.finish(60)
    assert rc == 130 and "Traceback" not in err, err[-2000:]  # Ctrl-C's exit, as before


def test_prompts_file_reads_a_messages_line_as_one_conversation(capsys, tiny_hf_dir, tiny, tmp_path):
    """A .jsonl line with OpenAI's chat "messages" is one conversation, decoded in the chat template as
    ``generate`` decodes a list of messages; text lines beside it stay text; a method that does not batch
    and --stream take it too."""
    chat = [{"role": "system", "content": "Be short."}, {"role": "user", "content": "Name a colour"}]
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"messages": chat}) + '\n"Hello there"\n' + json.dumps({"messages": chat[1:]}) + "\n")
    rc, out, err = cli(capsys, "generate", "--model", tiny_hf_dir, "--prompts-file", f, "--max-new-tokens", 5, "--json")
    assert rc == 0, err
    want = generate(tiny, [chat, "Hello there", chat[1:]], "greedy", 5)
    assert [json.loads(line)["token_ids"] for line in out.splitlines()] == [w.token_ids for w in want]
    rc, out, err = cli(
        capsys, "generate", "--model", tiny_hf_dir, "--prompts-file", f, "--max-new-tokens", 5, "--method", "calm"
    )
    assert rc == 0, err
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"messages": chat}) + "\n")
    args = ["--prompts-file", one, "--max-new-tokens", 5, "--stream"]
    rc, out, err = cli(capsys, "generate", "--model", tiny_hf_dir, *args)
    assert rc == 0, err
    assert out.startswith(want[0].text + "\n")


@pytest.mark.parametrize(
    "line,message",
    [
        ('{"messages": []}', "p.jsonl:2: 'messages' is empty"),
        ('{"messages": "hi"}', "p.jsonl:2: 'messages' is not a list"),
        ('{"messages": [{"role": "user"}]}', "p.jsonl:2: message 0 is not an object with text 'role' and 'content'"),
        ('{"messages": [{"role": " ", "content": "x"}]}', "p.jsonl:2: message 0's role is empty"),
        ('{"messages": [{"role": "user", "content": "x"}], "prompt": "y"}', "p.jsonl:2 has both 'messages' and"),
    ],
)
def test_prompts_file_refuses_a_bad_messages_line_by_its_number(capsys, tiny_hf_dir, tmp_path, line, message):
    f = tmp_path / "p.jsonl"
    f.write_text('"fine"\n' + line + "\n")
    rc, _, err = cli(capsys, "generate", "--model", tiny_hf_dir, "--prompts-file", f, "--max-new-tokens", 2)
    assert rc == 2 and message in err and "Traceback" not in err, err
