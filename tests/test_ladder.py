"""The scaling ladder: rung plans for the shipped family, slices that repeat sources as the big run does, the
fit on synthetic loss curves with known parameters (noise-free and noisy, with band coverage), the command
line's errors, and the forecast on the run page; fits of held-out evaluation metrics on eval.jsonl rows
written through tokenmill.formats.evals, and the default metric. One slow test trains three tiny rungs for
real."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tokenmill.cli import main
from tokenmill.formats.evals import averages, eval_line, set_record
from tokenmill.mixtures import load_mixture, plan_mixture
from tokenmill.samples.report_inputs import ReportInputs, make_report_inputs
from tokenmill.trainer.ladder import MARIN_FRACTIONS, RunCurve, fit_ladder, load_ladder, plan_ladder, read_run
from tokenmill.trainer.model.flops import count_params, flops_per_token, forecast_flops_per_token
from tokenmill.trainer.model.shape import load_model_config

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


# --- Marin's procedure -----------------------------------------------------------------------------------

# A law per fraction g of training, in Marin's compute: L = 1.5 + A(g) * C^-alpha(g).
MARIN_MODELS = ("tiny-rung-24", "tiny-rung-32", "tiny-rung-48", "tiny")
MARIN_STEPS = (400, 600, 800, 1200)
MARIN_TARGET_C = 1e16


def marin_law(compute: np.ndarray | float, g: np.ndarray | float) -> np.ndarray:
    return 1.5 + 60.0 * (1 + np.asarray(g)) * np.asarray(compute) ** -(0.12 + 0.04 * np.asarray(g))


def marin_runs(root: Path, sigma: float = 0.0, seed: int = 0, with_model: bool = True) -> list[Path]:
    """Run folders whose config.json holds the real model shape, so the fit can price Marin's C."""
    rng = np.random.default_rng(seed)
    paths = []
    for name, planned in zip(MARIN_MODELS, MARIN_STEPS, strict=True):
        cfg = load_model_config(REPO / "configs" / "models" / f"{name}.yaml")
        per_step = forecast_flops_per_token(cfg, cfg.sequence_length) * 1024
        s = np.arange(planned)
        loss = marin_law(per_step * (s + 1), (s + 1) / planned) + sigma * rng.standard_normal(planned)
        curve = RunCurve(name, name, s, loss, (s + 1) * flops_per_token(cfg) * 1024.0, planned, 1)
        root_run = write_run(root / name, curve)
        config = json.loads((root_run / "config.json").read_text())
        if with_model:
            config["model"] = cfg.model_dump()
        config["plan"]["sequence_length"] = cfg.sequence_length
        (root_run / "config.json").write_text(json.dumps(config))
        paths.append(root_run)
    return paths


def test_marin_procedure_recovers_a_law_per_fraction(tmp_path: Path) -> None:
    runs = [read_run(str(path)) for path in marin_runs(tmp_path)]
    assert all(run.forecast_per_step for run in runs)
    target = {"name": "t", "flops": 5e15, "forecast_compute": MARIN_TARGET_C}
    result = fit_ladder(runs, target, procedure="marin", bootstrap=20)
    assert result["procedure"] == "marin" and result["compute"] == "forecast"
    assert result["fractions"] == [round(0.05 * i, 2) for i in range(1, 21)]
    fit = result["fit"]
    assert fit["E"] == 1.5 and fit["E_fixed"] and fit["parameters"] == 40 and fit["points"] == 80
    for g in (0.25, 0.5, 1.0):
        assert fit["alphas"][str(g)] == pytest.approx(0.12 + 0.04 * g, rel=2e-2)
        assert fit["A"][str(g)] == pytest.approx(60 * (1 + g), rel=0.1)
    # The forecast at each fraction is the law at that fraction of the target's C.
    assert result["target"]["flops"] == MARIN_TARGET_C and result["target"]["trainer_flops"] == 5e15
    for item in result["forecast"]:
        assert item["flops"] == pytest.approx(item["fraction"] * MARIN_TARGET_C)
        # (Early on the smoothing window reaches back to where the curve is far from straight.)
        if item["fraction"] >= 0.15:
            assert item["loss"] == pytest.approx(float(marin_law(item["flops"], item["fraction"])), rel=2e-3)
    # Points are priced in Marin's C: the run's C per step times the steps done.
    point = next(p for p in result["points"] if p["fraction"] == 1.0 and p["run"].endswith("tiny"))
    assert point["flops"] == pytest.approx(runs[-1].forecast_per_step * 1200)


def test_marin_procedure_on_noisy_curves_brackets_the_truth(tmp_path: Path) -> None:
    runs = [read_run(str(path)) for path in marin_runs(tmp_path, sigma=0.02, seed=5)]
    target = {"flops": 1.0, "forecast_compute": MARIN_TARGET_C}
    final = fit_ladder(runs, target, procedure="marin", bootstrap=200, seed=2)["final"]
    truth = float(marin_law(MARIN_TARGET_C, 1.0))
    assert final["low"] <= truth <= final["high"] and final["low"] < final["loss"] < final["high"]


def test_marin_procedure_without_a_model_falls_back_and_says_so(tmp_path: Path) -> None:
    runs = [read_run(str(path)) for path in marin_runs(tmp_path, with_model=False)]
    result = fit_ladder(runs, {"flops": 1e16}, procedure="marin", fractions=(0.5, 1.0), bootstrap=0)
    assert result["compute"] == "trainer" and result["fractions"] == [0.5, 1.0]
    assert any("trainer's FLOPs instead" in warning for warning in result["warnings"])
    with pytest.raises(ValueError, match="unknown procedure"):
        fit_ladder(runs, {"flops": 1e16}, procedure="chinchilla")


def test_marin_procedure_leaves_out_points_below_the_asymptote(tmp_path: Path) -> None:
    runs = [read_run(str(path)) for path in marin_runs(tmp_path)]
    floor = float(runs[-1].loss[-1]) + 1e-3  # the largest rung ends below it, the others do not
    result = fit_ladder(runs, {"flops": 1e16}, procedure="marin", asymptote=floor, bootstrap=0)
    assert any(f"is not above the asymptote {floor:g}" in warning for warning in result["warnings"])
    assert all(point["loss"] > floor for point in result["points"])
    assert result["fractions"][-1] == 1.0  # three rungs are left at 100%: still a law there


def test_fit_command_with_marins_procedure(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    runs = marin_runs(tmp_path / "ladder")
    model = str(REPO / "configs" / "models" / "tiny-marin.yaml")
    args = ["ladder", "fit", *map(str, runs), "--procedure", "marin", "--target-model", model,
            "--target-tokens", "10G", "--bootstrap", "20"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "Marin's procedure, C Marin's forecast C" in out and "L = 1.5 + A_f * C^-alpha_f" in out
    ladder = json.loads((tmp_path / "ladder" / "ladder.json").read_text())
    cfg = load_model_config(REPO / "configs" / "models" / "tiny-marin.yaml")
    assert ladder["target"]["flops"] == forecast_flops_per_token(cfg, cfg.sequence_length) * 10 * 10**9
    assert len(ladder["forecast"]) == 20 and ladder["fit"]["E"] == 1.5


# --- planning ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def marin_plan() -> dict:
    return plan_ladder(load_ladder(MARIN))


# Marin's ladder as run (launch_scaling_ladder.py): racks, steps, and plot_scaling_ladder.py's C constants.
MARIN_RUNGS = {
    "d768": (1, 11_420, 2.649679880270119e19),
    "d1024": (2, 15_276, 1.7261182741798453e20),
    "d1536": (6, 15_128, 1.3813258500033133e21),
    "d2048": (11, 20_072, 7.741814947656449e21),
}
HERO_C = 2.6108941613772703e24


def test_marin_ladder_is_the_ladder_as_run(marin_plan: dict) -> None:
    assert marin_plan["tokens_per_active_param"] == 791 and marin_plan["round_to"] == "steps"
    assert [rung["name"] for rung in marin_plan["rungs"]] == list(MARIN_RUNGS)
    for rung in marin_plan["rungs"]:
        racks, steps, c = MARIN_RUNGS[rung["name"]]
        assert (rung["racks"], rung["batch_size"], rung["sequence_length"]) == (racks, racks * 1024, 4096)
        # steps = round(791 x active / (racks x 1,024 x 4,096)), exactly the reference's.
        assert rung["steps"] == steps == round(791 * rung["active_params"] / (racks * 1024 * 4096))
        assert rung["tokens"] == steps * racks * 1024 * 4096
        assert rung["forecast_compute"] == pytest.approx(c, rel=1e-6)
        cfg = load_model_config(rung["model"])
        assert rung["active_params"] == count_params(cfg).active_params
        assert rung["flops"] == pytest.approx(flops_per_token(cfg, 4096) * rung["tokens"])
        # Midtraining from 80% of the steps, rounded down to a block boundary (49,152-sequence blocks).
        pre, mid = rung["phases"]
        multiple = 49_152 // math.gcd(49_152, racks * 1024)
        assert pre["end_step"] == mid["start_step"] == int(0.8 * steps) // multiple * multiple
        assert mid["end_step"] == steps
        # The shipped slices are exactly what the rule writes.
        assert rung["compare"]["steps"] == steps and rung["compare"]["tokens_difference"] == 0
        optimizer = rung["optimizer"]
        tokens_per_batch = racks * 1024 * 4096
        adam = 0.06602 * rung["tokens"] ** -0.395 * cfg.d_model**-0.15 * math.sqrt(tokens_per_batch)
        assert optimizer["adam_lr"] == pytest.approx(adam) and optimizer["lr"] == pytest.approx(13 / 3 * adam)
        assert optimizer["beta2"] == pytest.approx(
            min(0.9999, max(0.95, 0.999 ** (tokens_per_batch / 131_072)))
        )
        assert optimizer["warmup_steps"] == round(0.01 * steps) and optimizer["min_lr_ratio"] == 0.05
        assert not rung["warnings"]  # in particular: the model's reference_run agrees with the plan
    target = marin_plan["target"]
    assert target["steps"] == target["steps_by_rule"] == 390_251 and target["racks"] == 11
    assert target["tokens"] == 390_251 * 11_264 * 4096 == 18_005_144_633_344
    assert target["forecast_compute"] == pytest.approx(HERO_C, rel=1e-6)
    assert target["optimizer"]["warmup_steps"] == 3_903 and not target["warnings"]


def test_rung_slices_repeat_each_cell_as_the_budget_does(marin_plan: dict) -> None:
    """Simulated epoching against the 18.75T budget: a rung repeats every cell as often as the budget
    would; the hero (18.005T on the raw mixture) 96.03% as often."""
    full = plan_mixture(load_mixture(REPO / "mixtures" / "marin-535b-a23b.yaml")).to_json()
    hero_share = full["planned_tokens"] / full["total_tokens"]
    assert hero_share == pytest.approx(0.96027, rel=1e-5)
    for rung in marin_plan["rungs"]:
        plan = rung["plan"]
        assert plan["slice"]["fraction"] == rung["tokens"] / 18.75e12
        # Rounding a tiny slice's cells to whole sequences per block moves them a little; the big cells
        # are where the comparison is clean.
        big = [name for name, source in full["sources"].items() if source["tokens"] > 100e9]
        for name in big:
            ratio = plan["sources"][name]["epochs"] / full["sources"][name]["epochs"]
            assert ratio == pytest.approx(1 / hero_share, rel=0.02), (rung["name"], name)
        assert 0.03 < rung["epoch_gap"]["run"] < 0.2


def test_ladder_plan_writes_trainable_slice_specs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["ladder", "plan", str(MARIN), "--output", str(tmp_path / "plan"), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads((tmp_path / "plan" / "ladder-plan.json").read_text())
    for rung in printed["rungs"]:
        spec = load_mixture(rung["mixture_spec"])
        assert spec.slice is not None and spec.slice.of == "marin-535b-a23b"
        assert spec.total_steps == rung["steps"]
        planned = plan_mixture(spec)
        assert planned.planned_tokens == rung["tokens"] and planned.total_steps == rung["steps"]
    assert main(["ladder", "plan", str(MARIN)]) == 0
    table = capsys.readouterr().out
    for text in ("d768", "1.6B-A61M", "11,420", "390,251", "2.611e+24", "marin-ladder-48b", "3,903 warmup"):
        assert text in table, text


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
    assert "forecast final training loss" in html and f"{ladder['final']['loss']:.4f}" in html
    assert "training loss (loss)" in html  # the forecast names its metric
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


# --- held-out evaluation metrics ---------------------------------------------------------------------------

# The held-out macro bits per byte follows its own law (the training loss of the same runs follows the first
# law above, so a fit that read the wrong file would find E = 1.8).
EVAL_E, EVAL_A, EVAL_ALPHA = 0.7, 300.0, 0.15
HELDOUT = ("heldout/domain=code", "heldout/domain=web")
SPREAD = 0.05  # the web slice sits this far above the macro average, the code slice as far below


def write_evals(run: Path, steps: list[int], value: Callable[[int], float], measure: str) -> None:
    """eval.jsonl through tokenmill.formats.evals: two held-out slices at `steps` (steps trained) whose
    macro average of `measure` is value(step) exactly, and the averages."""
    lines = []
    for step in steps:
        records = []
        for name, offset in zip(HELDOUT, (-SPREAD, SPREAD), strict=True):
            tokens, num_bytes = 1000, 4100
            wanted = value(step) + offset
            nll = wanted * tokens if measure == "loss" else wanted * math.log(2) * num_bytes
            records.append(
                set_record(step=step, name=name, kind="heldout", nll_nats=nll, tokens=tokens,
                           num_bytes=num_bytes, sequences=4, phase="pretraining", tokens_trained=step * 1024)
            )  # fmt: skip
        lines += [eval_line(record) for record in [*records, *averages(records)]]
    (run / "eval.jsonl").write_text("".join(lines))


def eval_law(compute: float) -> float:
    return EVAL_E + EVAL_A * compute**-EVAL_ALPHA


def evaluated_runs(root: Path, every: float = 0.05, without: tuple[int, ...] = ()) -> list[Path]:
    """The synthetic rungs, each evaluated every `every` of its planned steps (none for rungs `without`)."""
    paths = synthetic_runs(root, 0.02, 7, True)
    for index, (path, (planned, step_flops)) in enumerate(zip(paths, RUNGS, strict=True)):
        if index not in without:
            stride = round(every * planned)
            write_evals(path, list(range(stride, planned + 1, stride)),
                        lambda s, f=step_flops: eval_law(s * f), "bits_per_byte")  # fmt: skip
    return paths


def test_default_metric_is_the_held_out_macro_bits_per_byte_and_the_fit_recovers_its_law(
    tmp_path: Path,
) -> None:
    runs = [read_run(str(path)) for path in evaluated_runs(tmp_path)]
    result = fit_ladder(runs, {"flops": TARGET}, bootstrap=20)
    metric = result["metric"]
    assert metric["name"] == "eval:heldout_macro:bits_per_byte" and metric["source"] == "eval.jsonl"
    assert metric["label"] == "held-out macro bits per byte" and metric["chosen"].startswith("default")
    fit = result["fit"]
    # Evaluations are read as they are (no smoothing): the law comes back to float precision.
    assert fit["E"] == pytest.approx(EVAL_E, rel=1e-4)
    assert fit["alpha"] == pytest.approx(EVAL_ALPHA, rel=1e-4)
    for fraction in ("0.25", "0.5", "0.75", "1.0"):
        assert fit["A"][fraction] == pytest.approx(EVAL_A, rel=1e-3)
    assert result["final"]["loss"] == pytest.approx(eval_law(TARGET), rel=1e-5)
    # Each point is the evaluation at the step completing its fraction, priced at its own compute.
    point = next(p for p in result["points"] if p["fraction"] == 0.5 and p["run"].endswith("rung-2"))
    assert point["step"] == 800 and point["flops"] == pytest.approx(800 * RUNGS[2][1])
    assert not result["warnings"]


def test_an_evaluation_set_by_name(tmp_path: Path) -> None:
    runs = [read_run(str(path)) for path in evaluated_runs(tmp_path)]
    result = fit_ladder(runs, {"flops": TARGET}, bootstrap=0, metric="eval:heldout/domain=web:bits_per_byte")
    assert result["metric"]["chosen"] == "given with --metric"
    assert result["metric"]["label"] == "heldout/domain=web bits per byte"
    assert result["fit"]["E"] == pytest.approx(EVAL_E + SPREAD, rel=1e-4)  # the slice sits SPREAD higher
    training = fit_ladder(runs, {"flops": TARGET}, bootstrap=0, metric="loss")
    assert training["metric"]["source"] == "metrics.jsonl"
    assert training["fit"]["E"] == pytest.approx(E, rel=0.05)  # the training loss's own law
    with pytest.raises(ValueError, match="no such evaluation records in .*rung-0.*heldout/domain=code"):
        fit_ladder(runs, {"flops": TARGET}, metric="eval:paloma-c4:loss")
    with pytest.raises(ValueError, match="loss or bits_per_byte"):
        fit_ladder(runs, {"flops": TARGET}, metric="eval:heldout_macro:perplexity")


def test_without_evaluations_the_default_is_training_loss_and_says_so(tmp_path: Path) -> None:
    none = [read_run(str(path)) for path in synthetic_runs(tmp_path / "none", 0.0, 0, False)]
    result = fit_ladder(none, {"flops": TARGET}, bootstrap=0)
    assert result["metric"]["name"] == "loss" and result["metric"]["label"] == "training loss"
    assert result["metric"]["chosen"] == "default: no run has held-out evaluation records (eval.jsonl)"
    some = [read_run(str(path)) for path in evaluated_runs(tmp_path / "some", without=(1,))]
    result = fit_ladder(some, {"flops": TARGET}, bootstrap=0)
    assert (
        result["metric"]["name"] == "loss"
        and "rung-1 has no eval:heldout_macro" in result["metric"]["chosen"]
    )


def test_marin_procedure_on_held_out_macro_loss_at_every_5_percent(tmp_path: Path) -> None:
    paths = marin_runs(tmp_path)
    for path, planned in zip(paths, MARIN_STEPS, strict=True):
        per_step = read_run(str(path)).forecast_per_step
        # Evaluated every 5%, except the largest rung: every 10% (a run that evaluates less often).
        stride = round((0.1 if planned == MARIN_STEPS[-1] else 0.05) * planned)
        write_evals(path, list(range(stride, planned + 1, stride)),
                    lambda s, c=per_step, p=planned: float(marin_law(c * s, s / p)), "loss")  # fmt: skip
    runs = [read_run(str(path)) for path in paths]
    target = {"name": "t", "flops": 5e15, "forecast_compute": MARIN_TARGET_C}
    # By default a rung that evaluated too rarely for the fractions sends the fit to training loss, and
    # the fit says which rung; named with --metric, the evaluations there are are fitted.
    default = fit_ladder(runs, target, procedure="marin", bootstrap=0)
    assert default["metric"]["name"] == "loss"
    assert default["metric"]["chosen"].startswith(
        f"default: {paths[-1]} evaluated eval:heldout_macro:loss less"
    )
    result = fit_ladder(runs, target, procedure="marin", bootstrap=20, metric="eval:heldout_macro:loss")
    assert result["metric"]["name"] == "eval:heldout_macro:loss"
    fit = result["fit"]
    # Evaluations are not smoothed: the law per fraction comes back at every fraction, 5% included.
    for g in MARIN_FRACTIONS:
        assert fit["alphas"][str(g)] == pytest.approx(0.12 + 0.04 * g, rel=1e-6)
        assert fit["A"][str(g)] == pytest.approx(60 * (1 + g), rel=1e-5)
    for item in result["forecast"]:
        assert item["loss"] == pytest.approx(float(marin_law(item["flops"], item["fraction"])), rel=1e-6)
    # The rung evaluated every 10% has points at 10%, 20%, ... only; each 5% between is left out, said.
    largest = [p["fraction"] for p in result["points"] if p["run"].endswith("/tiny")]
    assert largest == [round(0.1 * i, 2) for i in range(1, 11)]
    skipped = [w for w in result["warnings"] if "evaluated less often" in w]
    assert len(skipped) == 10 and all("/tiny:" in w for w in skipped)


def test_fit_command_says_its_metric_and_the_page_names_it(
    tmp_path: Path, capsys: pytest.CaptureFixture, report_inputs: ReportInputs
) -> None:
    runs = evaluated_runs(tmp_path / "ladder")
    target = write_run(
        tmp_path / "target",
        synthetic_curve("target", 1000, TARGET / 1000, 0.02, np.random.default_rng(4), True),
    )
    write_evals(target, list(range(50, 1001, 50)), lambda s: eval_law(s * TARGET / 1000), "bits_per_byte")
    args = ["ladder", "fit", *map(str, runs), "--target-run", str(target), "--bootstrap", "20"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert (
        "metric: held-out macro bits per byte (eval:heldout_macro:bits_per_byte), default: every run" in out
    )
    ladder = json.loads((tmp_path / "ladder" / "ladder.json").read_text())
    assert ladder["metric"]["name"] == "eval:heldout_macro:bits_per_byte"
    assert [a["step"] for a in ladder["actual"]] == [250, 500, 750, 1000]
    assert ladder["actual"][-1]["loss"] == pytest.approx(eval_law(TARGET), rel=1e-9)
    # --metric loss on the same runs: the training loss, and the command says so.
    assert main([*args, "--metric", "loss", "--output", str(tmp_path / "loss.json")]) == 0
    assert "metric: training loss (loss), given with --metric" in capsys.readouterr().out
    # On runs without eval.jsonl an evaluation metric is refused, naming the run and the file.
    plain = synthetic_runs(tmp_path / "plain", 0.0, 0, False)
    error = fit_error(capsys, *map(str, plain), "--target", "1e24", "--metric", "eval:heldout_macro:loss")
    assert f"no such evaluation records in {plain[0]}" in error and "no eval.jsonl" in error
    assert "not a metric name" in fit_error(capsys, *map(str, plain), "--target", "1e24", "--metric", "bpb")

    common = ["report", "--curated", str(report_inputs.curate), "--tokens", str(report_inputs.tokens),
              "--plan", str(report_inputs.plan)]  # fmt: skip
    site = tmp_path / "site"
    ladder_path = str(tmp_path / "ladder" / "ladder.json")
    assert main([*common, "--output", str(site), "--run", str(target), "--ladder", ladder_path]) == 0
    html = (site / "run.html").read_text()
    assert "held-out macro bits per byte (eval:heldout_macro:bits_per_byte)" in html
    assert "forecast final held-out macro bits per byte" in html
    assert 'The <a href="#ladder-forecast">scaling-ladder forecast</a> below is of the held-out macro' in html
    forecast = re.search(r'data-chart="Forecast against this run">(.*?)</figure>', html, re.S)
    assert forecast and 'aria-label="Forecast against this run"' in forecast.group(1)
    assert "held-out macro bits per byte</text>" in forecast.group(1)  # its y axis: the metric
    assert 'data-chart="Held-out macro bits per byte against training compute"' in html


# --- for real (slow) ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_three_tiny_rungs_trained_and_fitted(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`tokenmill train` on synthetic data for the demo's three rung shapes, then `tokenmill ladder fit`."""
    ladder = load_ladder(DEMO)
    runs = []
    for model, steps in zip(ladder.rung_models, (30, 40, 60)):
        run = tmp_path / Path(model).stem
        assert main(["train", "--data.synthetic", "--model", model, "--schedule.steps", str(steps),
                     "--output", str(run), "--checkpoint.every", "1000"]) == 0  # fmt: skip
        runs.append(str(run))
    assert main(["ladder", "fit", *runs, "--ladder", str(DEMO), "--bootstrap", "50"]) == 0
    result = json.loads((tmp_path / "ladder.json").read_text())
    assert result["fit"]["points"] == 12
    assert all(math.isfinite(item["loss"]) for item in result["forecast"])
    assert result["target"]["name"] == "tiny"
    capsys.readouterr()
