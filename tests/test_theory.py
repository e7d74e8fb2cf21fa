"""PPD's theory (theory.py, `layerleap theory ppd`): the paper's own figures, the Monte-Carlo
simulation of the run model against Theorem 4.1, measured match rates against PPD's realised
p̂_correct, the trade-off plot and the command line."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import random_model

from layerleap import cli, generate
from layerleap.eval import theory


def test_equations_3_and_5_give_the_papers_figures():
    # §4.3: SQUAD + trained classifier, k = 5, p̂ = 74.15% at layer 20 of 40 -> 0.629 and 4.973
    f = theory.figures(40, 20, 5, 0.7415, 128)
    assert f["eq3_normalised_latency_per_token"] == pytest.approx(0.629, abs=5e-4)
    assert f["eq5_compute_per_time_unit"] == pytest.approx(4.973, abs=5e-4)
    # WMT, k = 1, shared classifier: p̂ = 21.63% -> 0.892 and 1.561 (the other end of the paper's range)
    g = theory.figures(40, 20, 1, 0.2163, 128)
    assert g["eq3_normalised_latency_per_token"] == pytest.approx(0.892, abs=5e-4)
    assert g["eq5_compute_per_time_unit"] == pytest.approx(1.561, abs=5e-4)
    assert g["eq6_normalised_compute_per_token"] == pytest.approx(
        g["eq3_normalised_latency_per_token"] * g["eq5_compute_per_time_unit"]
    )


def test_theorem_4_1_against_a_hand_computation():
    # d = 30, d̄ = 20, k = 3, ℓ = 5, p = 0.6: latency dℓ − (d − d̄)(ℓ − 1)p = 150 − 10·4·0.6 = 126;
    # compute = 126 + k(d − d̄)ℓ = 126 + 3·10·5 = 276.  E[N] = 1 + (ℓ − 1)(1 − p) = 2.6 runs of
    # T_X = d + (X − 1)d̄: d̄ℓ + (d − d̄)E[N] = 100 + 26 = 126, the proof's own sum.
    f = theory.figures(30, 20, 3, 0.6, 5)["theorem"]
    assert f["latency_units"] == pytest.approx(126.0) == 20 * 5 + 10 * 2.6
    assert f["compute_units"] == pytest.approx(276.0)
    assert f["greedy_units"] == 150
    assert f["normalised_latency_per_token"] == pytest.approx(126 / 150)
    assert f["compute_per_time_unit"] == pytest.approx(276 / 126)
    # ℓ ≫ 1: latency/token 1 − (10/30)·0.6 = 0.8, compute/token 0.8 + 3·10/30 = 1.8, per time unit 1.8 / 0.8
    a = theory.figures(30, 20, 3, 0.6, 5)["approximation"]
    assert a["normalised_latency_per_token"] == pytest.approx(0.8)
    assert a["normalised_compute_per_token"] == pytest.approx(1.8)
    assert a["compute_per_time_unit"] == pytest.approx(2.25)
    # eqs. 3, 5, 6 at d̄ = d/2, k = 2, p = 0.5: 1 − 0.25 = 0.75; (2 + 2 − 0.5)/(2 − 0.5) = 7/3; (2 + 2 − 0.5)/2 = 1.75
    g = theory.figures(40, 20, 2, 0.5, 100)
    assert g["eq3_normalised_latency_per_token"] == pytest.approx(0.75)
    assert g["eq5_compute_per_time_unit"] == pytest.approx(7 / 3)
    assert g["eq6_normalised_compute_per_token"] == pytest.approx(1.75)


def test_general_forms_reduce_to_equations_3_5_6_at_half_depth():
    for k in (1, 3, 5):
        for p in (0.0, 0.3, 0.9):
            assert theory.latency_per_token_general(40, 20, p) == pytest.approx(theory.eq3_latency_per_token(p))
            assert theory.compute_per_time_unit_general(40, 20, k, p) == pytest.approx(
                theory.eq5_compute_per_time_unit(k, p)
            )
            assert theory.compute_per_token_general(40, 20, k, p) == pytest.approx(theory.eq6_compute_per_token(k, p))


@pytest.mark.parametrize(
    "d,dbar,k,p,n",
    [
        (40, 20, 5, 0.7415, 128),
        (30, 15, 1, 0.3, 64),
        (30, 25, 3, 0.8, 16),
        (7, 4, 2, 0.5, 9),
        (30, 20, 1, 0.0, 32),
        (30, 20, 1, 1.0, 32),
    ],
)
def test_monte_carlo_agrees_with_theorem_4_1(d, dbar, k, p, n):
    sim = theory.simulate(d, dbar, k, p, n, trials=3000, seed=1)
    lat, comp = theory.theorem_latency(d, dbar, n, p), theory.theorem_compute(d, dbar, k, n, p)
    se = sim.sd_latency / sim.trials**0.5
    assert abs(sim.mean_latency - lat) <= 4 * se + 1e-9
    assert abs(sim.mean_compute - comp) <= 4 * se + 1e-9  # compute = latency + a constant k(d - d̄)ℓ
    assert sim.mean_latency == pytest.approx(lat, rel=0.01)
    assert sim.mean_runs == pytest.approx(1 + (n - 1) * (1 - p), rel=0.02, abs=0.05)  # E[N]


def test_simulation_is_not_the_theorem_when_p_is_wrong():
    """The check can fail: a simulation at another p is many standard errors off."""
    sim = theory.simulate(30, 15, 1, 0.6, 64, trials=2000, seed=0)
    se = sim.sd_latency / sim.trials**0.5
    assert abs(sim.mean_latency - theory.theorem_latency(30, 15, 64, 0.5)) > 10 * se


def test_match_rates_equal_ppds_realised_p_correct():
    model = random_model("llama-mha-untied", seed=11, scale=2.0)
    prompt = torch.randint(0, 97, (7,), generator=torch.Generator().manual_seed(4)).tolist()
    g = generate(model, prompt, "greedy", 20, stop_at_eos=False)
    rates = theory.match_rates(model, prompt, g.token_ids, [2, 3], [1, 2, 4], head="shared")
    for dbar in (2, 3):
        for k in (1, 2, 4):
            r = generate(model, prompt, "ppd", 20, stop_at_eos=False, exit_layer=dbar, k=k, head="shared")
            assert rates[dbar][k] == (r.stats["matches"], r.stats["trials"]), (dbar, k)
    assert rates[2][1][0] < rates[2][4][0]  # a larger k matches more often here


def test_plot_is_written(tmp_path):
    path = tmp_path / "fig" / "tradeoff.png"
    theory.plot_tradeoff({"qa": {1: 0.3, 3: 0.5, 5: 0.6}, "writing": {1: 0.2, 3: 0.4, 5: 0.45}}, 30, 15, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in path.parent.iterdir()] == ["tradeoff.png"]


def test_cli_prints_the_issues_figures(capsys):
    rc = cli.main(
        [
            "theory",
            "ppd",
            "--layers",
            "40",
            "--exit-layer",
            "20",
            "--k",
            "5",
            "--p-correct",
            "0.7415",
            "--tokens",
            "128",
            "--json",
            "--simulate",
            "500",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert round(out["eq3_normalised_latency_per_token"], 3) == 0.629
    assert round(out["eq5_compute_per_time_unit"], 3) == 4.973
    assert out["theorem"]["latency_units"] == pytest.approx(40 * 128 - 20 * 127 * 0.7415)
    assert abs(out["simulation"]["latency_vs_theorem"] - 1) < 0.01


def test_cli_rejects_bad_inputs(capsys):
    assert cli.main(["theory", "ppd", "--layers", "40", "--exit-layer", "10"]) == 2
    assert "exit-layer" in capsys.readouterr().err
    assert cli.main(["theory", "ppd", "--p-correct", "1.5"]) == 2
    assert "p-correct" in capsys.readouterr().err


def test_measure_refuses_a_head_file_without_the_exit_layers_before_decoding(
    capsys, monkeypatch, tmp_path, char_model_dir
):
    """``--measure --head FILE`` whose file has no head at one of ``--exit-layers``: refused in the
    command's flags before the first greedy reference is decoded."""
    import layerleap
    from layerleap import decoding
    from layerleap.drafters.exit_heads import new_head, save_heads

    model = layerleap.load_folder(char_model_dir)
    heads = tmp_path / "h2.safetensors"
    save_heads([new_head(model, 2, "lens")], heads)

    def no_decoding(*a, **kw):
        raise AssertionError("decoded before the head was checked")

    monkeypatch.setattr(decoding, "generate", no_decoding)
    argv = ["theory", "ppd", "--measure", "--model", str(char_model_dir), "--categories", "qa", "--prompts", "1"]
    rc = cli.main([*argv, "--max-new-tokens", "4", "--exit-layers", "2,3", "--ks", "1", "--head", str(heads)])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.strip().splitlines()[-1] == (
        f"layerleap theory ppd: error: --head {heads}: no heads at layers 3 (it has 2): give --exit-layers among "
        "them, --head shared, or a heads file trained there (`layerleap train heads`)"
    )
