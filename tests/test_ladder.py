"""The scaling ladder: rung plans for the shipped family, slices that repeat sources as the big run does, the
fit on synthetic loss curves with known parameters (noise-free and noisy, with band coverage), the command
line's errors, and the forecast on the run page. One slow test trains three tiny rungs for real."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from tokenmill.cli import main
from tokenmill.mixtures import load_mixture, plan_mixture
from tokenmill.trainer.config import load_model_config
from tokenmill.trainer.flops import count_params, flops_per_token
from tokenmill.trainer.ladder import RunCurve, fit_ladder, load_ladder, plan_ladder, read_run

sys.path.insert(0, str(Path(__file__).parent))
from report_fixtures import ReportInputs, make_report_inputs  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MARIN = REPO / "configs" / "ladders" / "marin.yaml"
DEMO = REPO / "configs" / "ladders" / "demo.yaml"

# The synthetic law: L = E + A * C^-alpha at the end of training (C in FLOPs), three rungs a decade of
# compute apart in all, forecast 2.5 decades beyond the largest, at the reference's 2.7e24 FLOPs.
E, A, ALPHA = 1.8, 1200.0, 0.15
RUNGS = ((400, 5e16), (800, 2e17), (1600, 8e17))  # (planned steps, FLOPs per step)
TARGET = 2.7e24
TRUTH = E + A * TARGET**-ALPHA


def synthetic_loss(flops: np.ndarray, fraction: np.ndarray, shaped: bool) -> np.ndarray:
    """On the law at every point (A_f = A), or shaped: A_f = A * sqrt(f), runs stopped early sit higher
    relative to their compute, as under a schedule that decays at the end."""
    return E + A * (np.sqrt(fraction) if shaped else 1.0) * flops**-ALPHA


def synthetic_curve(
    name: str, steps: int, step_flops: float, sigma: float, rng: np.random.Generator, shaped: bool
) -> RunCurve:
    s = np.arange(steps)
    flops = (s + 1) * step_flops
    loss = synthetic_loss(flops, (s + 1) / steps, shaped) + sigma * rng.standard_normal(steps)
    return RunCurve(name, name, s, loss, flops, steps, 1)


def write_run(root: Path, curve: RunCurve, tokens_per_step: int = 1024) -> Path:
    """A run folder as `tokenmill train` writes it (docs/formats.md, "Runs"): only the keys the fit reads."""
    root.mkdir(parents=True)
    rows = [
        {"step": int(s), "phase": "pretraining", "loss": float(loss), "flops": float(flops),
         "tokens": int(s + 1) * tokens_per_step}
        for s, loss, flops in zip(curve.steps, curve.loss, curve.flops)
    ]  # fmt: skip
    (root / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    step_flops = float(curve.flops[0])
    config = {
        "model": {"name": root.name},
        "params": {"total_params": 1000, "active_params": 100},
        "flops_per_token": step_flops / tokens_per_step,
        "schedule": {"total_steps": curve.planned_steps},
        "plan": {"name": "synthetic", "total_steps": curve.planned_steps, "block_steps": 1,
                 "tokens_per_step": tokens_per_step},
    }  # fmt: skip
    (root / "config.json").write_text(json.dumps(config))
    return root


def synthetic_runs(root: Path, sigma: float, seed: int, shaped: bool) -> list[Path]:
    rng = np.random.default_rng(seed)
    return [
        write_run(root / f"rung-{i}", synthetic_curve(f"rung-{i}", steps, flops, sigma, rng, shaped))
        for i, (steps, flops) in enumerate(RUNGS)
    ]


# --- the fit ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shaped", [False, True])
def test_fit_recovers_a_known_law_without_noise(tmp_path: Path, shaped: bool) -> None:
    runs = [read_run(str(path)) for path in synthetic_runs(tmp_path, 0.0, 0, shaped)]
    result = fit_ladder(runs, {"flops": TARGET}, bootstrap=20)
    fit = result["fit"]
    # The smoothing line's value at the end of a window of a convex curve is a hair high: 0.1% here.
    assert fit["E"] == pytest.approx(E, rel=5e-3)
    assert fit["alpha"] == pytest.approx(ALPHA, rel=5e-3)
    assert fit["A"]["1.0"] == pytest.approx(A, rel=2e-2)
    if shaped:
        assert fit["A"]["0.25"] == pytest.approx(A * 0.5, rel=2e-2)
    assert result["final"]["loss"] == pytest.approx(TRUTH, rel=1e-3)
    assert result["fit"]["points"] == 12 and result["fit"]["dof"] == 6
    assert [f["fraction"] for f in result["forecast"]] == [0.25, 0.5, 0.75, 1.0]
    assert result["forecast"][0]["flops"] == pytest.approx(0.25 * TARGET)


def test_fit_with_as_many_points_as_parameters_says_so(tmp_path: Path) -> None:
    runs = [read_run(str(path)) for path in synthetic_runs(tmp_path, 0.0, 0, False)]
    result = fit_ladder(runs, {"flops": TARGET}, fractions=(1.0,), bootstrap=20)
    assert result["fit"]["dof"] == 0 and result["fit"]["residual_sd"] is None
    assert result["final"]["loss"] == pytest.approx(TRUTH, rel=2e-3)
    assert any("exactly determined" in warning for warning in result["warnings"])


def test_fit_on_noisy_curves_is_close_and_its_band_covers_the_truth(tmp_path: Path) -> None:
    runs = [read_run(str(path)) for path in synthetic_runs(tmp_path, 0.05, 1, True)]
    result = fit_ladder(runs, {"flops": TARGET}, bootstrap=200, seed=1)
    fit = result["fit"]
    assert abs(fit["alpha"] - ALPHA) < 0.03 and abs(fit["E"] - E) < 0.15
    final = result["final"]
    assert final["low"] < final["loss"] < final["high"]
    assert final["low"] <= TRUTH <= final["high"]
    assert fit["E_band"][0] <= E <= fit["E_band"][1]
    assert fit["alpha_band"][0] <= ALPHA <= fit["alpha_band"][1]
    # The per-point noise the bootstrap used is the smoothing's standard error, of the right size: the
    # 0.05 per-step noise over windows of 40 to 160 steps, read off a line's end (about 2 / sqrt(n)).
    assert 0.003 < np.median(result["band"]["noise_sd"]) < 0.03


def test_band_coverage_over_seeds() -> None:
    covered, seeds = 0, 12
    for seed in range(seeds):
        rng = np.random.default_rng(100 + seed)
        runs = [synthetic_curve(f"r{i}", s, f, 0.05, rng, True) for i, (s, f) in enumerate(RUNGS)]
        final = fit_ladder(runs, {"flops": TARGET}, bootstrap=100, seed=seed)["final"]
        covered += final["low"] <= TRUTH <= final["high"]
    # A 95% band: 12 draws cover the truth at least 10 times with probability 0.98 when it is right.
    assert covered >= 10, f"the 95% band covered the truth in {covered} of {seeds} synthetic ladders"


def test_fit_leaves_out_fractions_a_run_has_not_reached(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    curves = [synthetic_curve(f"r{i}", s, f, 0.0, rng, False) for i, (s, f) in enumerate(RUNGS)]
    short = curves[2]
    cut = 1000  # of 1600 planned: reaches 25% and 50% only
    curves[2] = RunCurve("r2", "r2", short.steps[:cut], short.loss[:cut], short.flops[:cut], 1600, 1)
    result = fit_ladder(curves, {"flops": TARGET}, bootstrap=0)
    assert result["fit"]["points"] == 10
    assert sum("is not logged" in w for w in result["warnings"]) == 2
    assert result["final"]["loss"] == pytest.approx(TRUTH, rel=2e-3)


# --- planning ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def marin_plan() -> dict:
    return plan_ladder(load_ladder(MARIN))


def test_marin_rule_matches_the_reference_rungs(marin_plan: dict) -> None:
    shipped_tokens = {"rung-1.6b-a61m": 48e9, "rung-4.0b-a162m": 128e9, "rung-11.5b-a481m": 381e9,
                      "rung-27.7b-a1.2b": 926e9}  # fmt: skip
    assert marin_plan["tokens_per_active_param"] == 780
    for rung in marin_plan["rungs"]:
        # The reference's own rungs imply about 780 tokens per active parameter...
        assert 770 < shipped_tokens[rung["name"]] / rung["active_params"] < 790
        # ...and the rule lands within about 1% of the shipped slices.
        assert rung["compare"]["tokens"] == pytest.approx(shipped_tokens[rung["name"]], rel=1e-3)
        assert abs(rung["compare"]["tokens_difference"]) < 0.011
        assert rung["tokens"] == pytest.approx(780 * rung["active_params"], rel=1e-3)
        # Tokens are whole mixture blocks (2048 sequences of 4096), so steps are whole too.
        assert rung["tokens"] % (2048 * 4096) == 0
        assert rung["steps"] * rung["batch_size"] * rung["sequence_length"] == rung["tokens"]
        cfg = load_model_config(rung["model"])
        assert rung["active_params"] == count_params(cfg).active_params
        assert rung["flops"] == pytest.approx(flops_per_token(cfg, 4096) * rung["tokens"])
        assert [p["name"] for p in rung["phases"]] == ["pretraining", "midtraining"]
    flops = [rung["flops"] for rung in marin_plan["rungs"]]
    assert flops == pytest.approx([2.18e19, 1.60e20, 1.33e21, 7.70e21], rel=0.01)
    assert [rung["steps"] for rung in marin_plan["rungs"]] == [45_560, 60_612, 89_894, 111_342]
    target = marin_plan["target"]
    assert target["tokens"] == 18_750_000_000_000 and target["flops"] == pytest.approx(2.76e24, rel=0.005)


def test_rung_slices_repeat_each_source_as_the_big_run_does(marin_plan: dict) -> None:
    full = plan_mixture(load_mixture(REPO / "mixtures" / "marin-535b-a23b.yaml")).to_json()
    for rung in marin_plan["rungs"]:
        plan = rung["plan"]
        assert plan["slice"]["fraction"] == pytest.approx(rung["tokens"] / full["planned_tokens"], rel=1e-3)
        for name, source in full["sources"].items():
            assert plan["sources"][name]["epochs"] == pytest.approx(source["epochs"], rel=1e-4)
        for ours, theirs in zip(plan["phases"], full["phases"]):
            epochs = {s["name"]: s["epochs"] for s in ours["sources"]}
            for source in theirs["sources"]:
                assert epochs[source["name"]] == pytest.approx(source["epochs"], rel=1e-3)
        assert rung["epoch_gap"]["run"] < 1e-4 and rung["epoch_gap"]["phase"] < 1e-3


def test_ladder_plan_writes_trainable_slice_specs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["ladder", "plan", str(MARIN), "--output", str(tmp_path / "plan"), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads((tmp_path / "plan" / "ladder-plan.json").read_text())
    for rung in printed["rungs"]:
        spec = load_mixture(rung["mixture_spec"])
        assert spec.slice is not None and spec.slice.of == "marin-535b-a23b"
        assert plan_mixture(spec).planned_tokens == rung["tokens"]
    assert main(["ladder", "plan", str(MARIN)]) == 0
    table = capsys.readouterr().out
    assert "rung-1.6b-a61m" in table and "marin-ladder-48b" in table and "2.76e+24" in table


def test_demo_ladder_is_on_the_demo_runs_rule() -> None:
    ladder = load_ladder(DEMO)
    tiny = count_params(load_model_config(ladder.target_model)).active_params
    assert ladder.spec.tokens_per_active_param == pytest.approx(320_000 / tiny, rel=0.01)
    for model in ladder.rung_models:
        assert count_params(load_model_config(model)).active_params < tiny


# --- the command line ------------------------------------------------------------------------------------


def fit_error(capsys: pytest.CaptureFixture, *args: str) -> str:
    assert main(["ladder", "fit", *args]) == 2
    return capsys.readouterr().err


def test_fit_errors_name_the_path(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert "give the rungs' run folders" in fit_error(capsys, "--target", "1e24")
    missing = tmp_path / "rung-*"
    assert f"{missing}: no such run folder" in fit_error(capsys, str(missing), "--target", "1e24")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert f"{empty / 'metrics.jsonl'}: no such file" in fit_error(capsys, str(empty), "--target", "1e24")
    runs = synthetic_runs(tmp_path / "runs", 0.0, 0, False)
    (runs[0] / "config.json").unlink()
    assert f"{runs[0] / 'config.json'}: no such file" in fit_error(
        capsys, *map(str, runs), "--target", "1e24"
    )
    with (runs[1] / "metrics.jsonl").open("a") as handle:
        handle.write("{not json\n")
    assert f"{runs[1] / 'metrics.jsonl'}: line 801" in fit_error(capsys, str(runs[1]), "--target", "1e24")
    (runs[2] / "metrics.jsonl").write_text("")
    assert f"{runs[2] / 'metrics.jsonl'}: no metrics logged" in fit_error(
        capsys, str(runs[2]), "--target", "1"
    )
    good = synthetic_runs(tmp_path / "good", 0.0, 0, False)
    assert "at least 3 runs" in fit_error(capsys, *map(str, good[:2]), "--target", "1e24")
    assert "give the target" in fit_error(capsys, *map(str, good))
    assert "go together" in fit_error(capsys, *map(str, good), "--target-model", str(DEMO))
    bad_spec = tmp_path / "ladder.yaml"
    bad_spec.write_text(
        "name: x\nmixture: m.yaml\ntokens_per_active_param: -1\ntarget: {model: m}\nrungs: []\n"
    )
    assert main(["ladder", "plan", str(bad_spec)]) == 2
    err = capsys.readouterr().err
    assert str(bad_spec) in err and "tokens_per_active_param" in err and "rungs" in err
    assert main(["ladder", "plan", str(tmp_path / "nope.yaml")]) == 2
    assert str(tmp_path / "nope.yaml") in capsys.readouterr().err


@pytest.fixture(scope="module")
def report_inputs(tmp_path_factory: pytest.TempPathFactory) -> ReportInputs:
    return make_report_inputs(tmp_path_factory.mktemp("report-inputs"))


def test_fit_command_and_the_forecast_on_the_run_page(
    tmp_path: Path, capsys: pytest.CaptureFixture, report_inputs: ReportInputs
) -> None:
    runs = synthetic_runs(tmp_path / "ladder", 0.02, 3, True)
    # The target run: the same law at the target's compute, trained (here: written) to its end.
    target = write_run(
        tmp_path / "target",
        synthetic_curve("target", 1000, TARGET / 1000, 0.02, np.random.default_rng(4), True),
    )
    args = [
        "ladder",
        "fit",
        *map(str, runs),
        "--target",
        "2.7e24",
        "--target-run",
        str(target),
        "--bootstrap",
        "50",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "forecast for the target" in out and "actual" in out and "wrote" in out
    written = tmp_path / "ladder" / "ladder.json"  # default: the runs' common parent
    ladder = json.loads(written.read_text())
    assert len(ladder["actual"]) == 4 and ladder["target"]["run"] == str(target)
    assert ladder["final"]["low"] <= ladder["actual"][-1]["loss"] <= ladder["final"]["high"]
    # Seeded: the same inputs give the same file.
    assert main([*args, "--output", str(tmp_path / "again.json")]) == 0
    assert (tmp_path / "again.json").read_bytes() == written.read_bytes()

    def report(output: Path, *extra: str) -> Path:
        common = ["report", "--curated", str(report_inputs.curate), "--tokens", str(report_inputs.tokens)]
        assert main([*common, "--plan", str(report_inputs.plan), "--output", str(output), *extra]) == 0
        return output

    site = report(tmp_path / "site", "--run", str(target), "--ladder", str(written))
    html = (site / "run.html").read_text()
    assert 'id="ladder-forecast"' in html
    assert 'data-chart="Loss against training compute"' in html
    assert 'data-chart="Forecast against this run"' in html  # the page's run is the target
    assert "forecast final loss" in html and f"{ladder['final']['loss']:.4f}" in html
    assert (site / "data" / "run" / "ladder.json").read_bytes() == written.read_bytes()
    again = report(tmp_path / "site-again", "--run", str(target), "--ladder", str(written))
    assert (again / "run.html").read_bytes() == (site / "run.html").read_bytes()
    # A run folder holding a ladder.json shows it without --ladder; a run that is not the target gets only
    # the compute chart.
    (runs[0] / "ladder.json").write_bytes(written.read_bytes())
    html = (report(tmp_path / "site-found", "--run", str(runs[0])) / "run.html").read_text()
    assert 'id="ladder-forecast"' in html and "Forecast against this run" not in html
    # Without a run page there is nowhere to draw it.
    common = ["report", "--curated", str(report_inputs.curate), "--tokens", str(report_inputs.tokens)]
    assert main([*common, "--plan", str(report_inputs.plan), "--output", str(tmp_path / "x"),
                 "--ladder", str(written)]) == 2  # fmt: skip
    assert "give --run too" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{}")
    assert main([*common, "--plan", str(report_inputs.plan), "--output", str(tmp_path / "y"),
                 "--run", str(target), "--ladder", str(tmp_path / "bad.json")]) == 2  # fmt: skip
    assert f"{tmp_path / 'bad.json'}: not a ladder fit" in capsys.readouterr().err


# --- for real (slow) ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_three_tiny_rungs_trained_and_fitted(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`tokenmill train` on synthetic data for the demo's three rung shapes, then `tokenmill ladder fit`."""
    ladder = load_ladder(DEMO)
    runs = []
    for model, steps in zip(ladder.rung_models, (30, 40, 60)):
        run = tmp_path / Path(model).stem
        assert main(["train", "--synthetic", "--model", model, "--steps", str(steps), "--output", str(run),
                     "--checkpoint-every", "1000"]) == 0  # fmt: skip
        runs.append(str(run))
    assert main(["ladder", "fit", *runs, "--ladder", str(DEMO), "--bootstrap", "50"]) == 0
    result = json.loads((tmp_path / "ladder.json").read_text())
    assert result["fit"]["points"] == 12
    assert all(math.isfinite(item["loss"]) for item in result["forecast"])
    assert result["target"]["name"] == "tiny"
    capsys.readouterr()
