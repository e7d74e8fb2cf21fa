"""PPD on real processes (ppd_parallel.py): two processes over gloo give greedy's tokens on a tiny
random model, the clock statistics agree with the one-device emulation, start-up refuses more units
than cores, and no sub-process is left behind."""

from __future__ import annotations

import os

import pytest
import torch
from tiny_models import naive_greedy, random_model

from layerleap import generate
from layerleap.eval.ppd_parallel import ParallelError, ParallelPPD

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores")


@pytest.mark.parametrize("head_on", ["sub", "main"])
def test_two_processes_equal_greedy_and_the_emulation(head_on):
    model = random_model("llama-mha-untied", seed=11, scale=2.0)
    with ParallelPPD(model, exit_layer=2, k=1, head="shared", head_on=head_on) as ex:
        procs = list(ex.procs)
        matches = 0
        for seed, plen in ((0, 1), (1, 5), (2, 9)):
            prompt = torch.randint(0, 97, (plen,), generator=torch.Generator().manual_seed(seed)).tolist()
            r = ex.generate(prompt, 16, stop_at_eos=False)
            assert r.token_ids == naive_greedy(model, prompt, 16)
            emu = generate(model, prompt, "ppd", 16, stop_at_eos=False, exit_layer=2, k=1, head="shared")
            for key in ("matches", "trials", "runs", "latency_units", "compute_units"):
                assert r.stats[key] == emu.stats[key], key
            assert r.stats["comm_s"] >= 0 and r.stats["units"] == 2
            matches += r.stats["matches"]
        assert matches > 0  # sub-process results really were taken over
    assert all(not p.is_alive() for p in procs)  # closed cleanly


def test_more_units_than_cores_is_refused():
    model = random_model("llama-gqa-tied", seed=1)
    with pytest.raises(ParallelError, match="cores"):
        ParallelPPD(model, exit_layer=2, k=os.cpu_count() or 1)


def test_sub_processes_stop_when_the_main_process_errors():
    model = random_model("llama-gqa-tied", seed=1)
    ex = ParallelPPD(model, exit_layer=2, k=1, head="shared")
    procs = list(ex.procs)
    try:
        with ex:
            raise KeyboardInterrupt  # as Ctrl-C in the middle of a run
    except KeyboardInterrupt:
        pass
    for p in procs:
        p.join(timeout=20)
    assert all(not p.is_alive() for p in procs)


def test_sub_processes_exit_when_the_main_process_is_killed(tmp_path):
    """SIGKILL leaves the main process no chance to send a stop message: the sub-processes notice and exit."""
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "main.py"
    script.write_text(
        "import sys, time\n"
        f"sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r})\n"
        "from tiny_models import random_model\n"
        "from layerleap.eval.ppd_parallel import ParallelPPD\n"
        "if __name__ == '__main__':\n"
        "    ex = ParallelPPD(random_model('llama-gqa-tied', seed=1), exit_layer=2, k=1, head='shared')\n"
        "    print(ex.procs[0].pid, flush=True)\n"
        "    time.sleep(120)\n"
    )
    main = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    sub_pid = int(main.stdout.readline())
    main.send_signal(signal.SIGKILL)
    main.wait()
    for _ in range(40):
        try:
            os.kill(sub_pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.25)
    os.kill(sub_pid, signal.SIGKILL)
    pytest.fail("the sub-process outlived its main process by 10 s")


def test_close_in_the_middle_of_a_generation_stops_the_sub_processes():
    model = random_model("llama-gqa-tied", seed=1)
    ex = ParallelPPD(model, exit_layer=2, k=1, head="shared")
    procs = list(ex.procs)
    calls = {"n": 0}
    orig = model.logits

    def interrupt(h):  # Ctrl-C after a few tokens
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return orig(h)

    model.logits = interrupt
    try:
        with pytest.raises(KeyboardInterrupt):
            with ex:
                ex.generate([1, 2, 3], 20, stop_at_eos=False)
    finally:
        del model.logits
    for p in procs:
        p.join(timeout=20)
    assert all(not p.is_alive() for p in procs)


def test_ping_pong_measures_a_round_trip():
    model = random_model("llama-gqa-tied", seed=1)
    with ParallelPPD(model, exit_layer=2, k=1, head="shared") as ex:
        sizes = ex.message_sizes()
        assert sizes["kv_entries"] == 2 * 2 * model.config.n_kv_heads * model.config.head_dim
        t = ex.ping_pong(sizes["hidden_and_kv"], repeats=20)
        assert 0 < t < 1.0
        prompt = [3, 4, 5]  # the executor still generates after a ping-pong
        assert ex.generate(prompt, 6, stop_at_eos=False).token_ids == naive_greedy(model, prompt, 6)


def test_eval_ppd_parallel_with_one_new_token_prints_its_table(char_model_dir, tmp_path, capsys):
    """One new token: no early prediction to check (p̂ has no trials), shown as "-"; it was a TypeError."""
    import json

    from layerleap.cli import main

    out = tmp_path / "pp.json"
    argv = ["eval", "ppd-parallel", "--model", str(char_model_dir), "--k", "1", "--threads", "1", "--exit-layer", "2"]
    argv += ["--categories", "qa", "--prompts", "1", "--max-new-tokens", "1", "--json", str(out)]
    assert main(argv) == 0
    assert json.loads(out.read_text())["summary"]["all"]["p_correct"] is None
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("all "))
    assert line.split()[1] == "-"
