"""The swarm page (tokenmill.reports.swarmpage, `tokenmill report --swarm`): built from a small synthetic
swarm folder written with the format models, so every number on the page can be checked against the records
that hold it; and opened in headless Chromium (marked `browser`).
"""

from __future__ import annotations

import hashlib
import html
import math
import re
from pathlib import Path

import pytest
import test_report_browser
from test_report_browser import console_errors, open_page, screenshot

from tokenmill.cli import main
from tokenmill.formats.evals import averages, eval_line, set_record
from tokenmill.formats.runs import metrics_line
from tokenmill.formats.swarm import (
    CurvePoint,
    LogLinearFit,
    MetricFit,
    ModelQuality,
    PredictedMetric,
    Proposal,
    ProxyResult,
    SwarmEvalSet,
    SwarmFit,
    SwarmManifest,
    SwarmProxy,
    SwarmSource,
    Validation,
    ValidationArm,
    write_fit,
    write_proposal,
    write_result,
    write_swarm,
    write_validation,
)
from tokenmill.reports import svg
from tokenmill.reports.swarmpage import build_swarm_page
from tokenmill.samples.report_inputs import make_report_inputs, report_args

browser = test_report_browser.browser  # the page tests' headless Chromium (a fixture), shared

SOURCES = ("web", "code", "math")
HELDOUT = ("heldout/domain=c00", "heldout/domain=c01")
EXTERNAL = ("paloma-c4",)
SETS = HELDOUT + EXTERNAL
KINDS = ("prior", "uniform", "base", "sampled", "sampled", "sampled", "sampled", "sampled")
FAILED = "proxy-006"
NOT_RUN = "proxy-007"
# Out-of-fold Spearman per metric and model, printed on the page with 3 decimals.
SPEARMAN = {"loglinear": 0.9137, "gp": 0.8462}


def proxy_weights(index: int) -> dict[str, float]:
    raw = [1.0 + ((index * 7 + k * 3) % 5) for k in range(len(SOURCES))]
    return {name: value / sum(raw) for name, value in zip(SOURCES, raw)}


def measured(weights: dict[str, float], name: str) -> float:
    """A made-up metric: more code lowers the held-out sets' bits per byte, more math the external set's."""
    offset = SETS.index(name) * 0.05 if name in SETS else 0.0
    helper = weights["math"] if name in EXTERNAL else weights["code"]
    return 1.2 + offset - 0.4 * helper + 0.1 * weights["web"]


def set_metrics(weights: dict[str, float]) -> dict[str, dict[str, float]]:
    values = {name: measured(weights, name) for name in SETS}
    metrics = {name: {"bits_per_byte": v, "loss": v * 2.1} for name, v in values.items()}
    for average, members in (("heldout_macro", HELDOUT), ("macro", SETS)):
        value = sum(values[m] for m in members) / len(members)
        metrics[average] = {"bits_per_byte": value, "loss": value * 2.1}
    return metrics


def write_run(run_dir: Path, weights: dict[str, float], steps: int = 40) -> None:
    """metrics.jsonl and eval.jsonl of a proxy run, through the formats' own line writers."""
    run_dir.mkdir(parents=True)
    lines = [
        metrics_line(
            {"step": step, "phase": "main", "loss": 4.0 * math.exp(-step / 15) + 2.0, "tokens": step * 512}
        )
        for step in range(1, steps + 1)
    ]
    (run_dir / "metrics.jsonl").write_text("".join(lines))
    records = []
    for step in (steps // 2, steps):
        scale = 1.0 + 0.2 * (steps - step) / steps
        sets = [
            set_record(
                step=step,
                name=name,
                kind="heldout" if name in HELDOUT else "external",
                nll_nats=measured(weights, name) * scale * math.log(2) * 4000,
                tokens=1000,
                num_bytes=4000,
                sequences=8,
                phase="main",
                tokens_trained=step * 512,
            )
            for name in SETS
        ]
        records += sets + averages(sets)
    (run_dir / "eval.jsonl").write_text("".join(eval_line(r) for r in records))


def write_job(root: Path, job: SwarmProxy, status: str | None) -> ProxyResult | None:
    """A job's run.yaml, and unless it has not run, its run folder and result.json."""
    (root / job.id).mkdir(parents=True, exist_ok=True)
    run_yaml = f"run: {job.id}\nseed: {job.seed}\n"
    (root / job.run_config).write_text(run_yaml)
    if status is None:
        return None
    write_run(root / job.run, job.weights)
    result = ProxyResult(
        id=job.id,
        status=status,
        run_config_sha256=hashlib.sha256(run_yaml.encode()).hexdigest(),
        seconds=75.0,
        steps=40 if status == "finished" else 12,
        tokens_trained=40 * 512,
        train_loss=2.3,
        metrics=set_metrics(job.weights) if status == "finished" else {},
        error="RuntimeError: out of memory" if status == "failed" else None,
    )
    write_result(str(root / job.id / "result.json"), result)
    return result


def make_swarm(root: Path, *, fitted: bool = True) -> dict:
    """A swarm folder of 8 proxies (6 finished, 1 failed, 1 not run), with fit, proposal and validation."""
    root.mkdir(parents=True)
    proxies = [
        SwarmProxy(
            id=f"proxy-{i:03d}",
            index=i,
            weights=proxy_weights(i),
            concentration=None if kind != "sampled" else (0.5 if i % 2 else 2.0),
            kind=kind,
            seed=i,
            mixture=f"proxy-{i:03d}/mixture.yaml",
            run_config=f"proxy-{i:03d}/run.yaml",
            run=f"proxy-{i:03d}/run",
        )
        for i, kind in enumerate(KINDS)
    ]
    manifest = SwarmManifest(
        format_version=1,
        name="demo-search",
        seed=0,
        base_mixture="mixtures/demo.yaml",
        base_mixture_sha256="ab" * 32,
        base_mixture_text="name: demo\n",
        run_config="configs/runs/swarm-proxy.yaml",
        tokens="out/demo/tokens",
        phase="main",
        phases=["main", "anneal"],
        phase_tokens=80_000_000,
        target_tokens=100_000_000,
        proxy_tokens=2_000_000,
        concentrations=[0.5, 2.0],
        sources=[
            SwarmSource(
                name=name,
                content=f"{k:064x}",
                cells=[f"{name}-q{q}" for q in range(2)],
                tokens_available=30_000_000,
                max_epochs=4.0,
                prior=1 / 3,
                base_weight=(0.5, 0.3, 0.2)[k],
                fixed_epochs=0.2,
            )
            for k, name in enumerate(SOURCES)
        ],
        evaluation=[
            SwarmEvalSet(name=name, kind="heldout" if name in HELDOUT else "external", content="cd" * 32)
            for name in SETS
        ],
        proxies=proxies,
        rejected_over_cap=3,
        rejected_duplicate=1,
        block_size=64,
        created_by="tokenmill mixture swarm mixtures/demo.yaml --proxies 8",
    )
    write_swarm(str(root / "swarm.json"), manifest)
    results = {}
    for job in proxies:
        status = None if job.id == NOT_RUN else "failed" if job.id == FAILED else "finished"
        results[job.id] = write_job(root, job, status)
    finished = [job for job in proxies if results[job.id] and results[job.id].status == "finished"]
    info = {"manifest": manifest, "proxies": proxies, "finished": finished}
    if not fitted:
        return info

    metric_fits = []
    for name in ["heldout_macro", "macro", *SETS]:
        for measure in ("bits_per_byte", "loss"):
            values = [results[job.id].metrics[name][measure] for job in finished]
            quality = [
                ModelQuality(
                    model=model,
                    spearman=spearman if name == "heldout_macro" and measure == "bits_per_byte" else 0.5,
                    r2=0.8123 if model == "loglinear" else 0.7011,
                    folds=5,
                    predicted=[
                        v * (1.01 if i % 2 else 0.99) + (0.002 if model == "gp" else 0.0)
                        for i, v in enumerate(values)
                    ],
                    learning_curve=[CurvePoint(proxies=n, spearman=0.6 + 0.05 * n) for n in (3, 4, 5, 6)]
                    if model == "loglinear"
                    else [],
                    stable_at=5 if model == "loglinear" else None,
                )
                for model, spearman in SPEARMAN.items()
            ]
            metric_fits.append(
                MetricFit(
                    metric=f"{name}:{measure}",
                    set=name,
                    measure=measure,
                    proxies=[job.id for job in finished],
                    measured=values,
                    loglinear=LogLinearFit(
                        floor=0.8,
                        intercept=-0.5,
                        effects={"web": 0.31, "code": -1.25 if name in HELDOUT else -0.4, "math": 0.05},
                    ),
                    quality=quality,
                )
            )
    fit = SwarmFit(
        format_version=1,
        swarm=manifest.name,
        sources=list(SOURCES),
        source_content={s.name: s.content for s in manifest.sources},
        evidence_reused=["math"],
        proxies_finished=len(finished),
        proxies_failed=[FAILED],
        metrics=metric_fits,
        warnings=[f"1 proxies failed and are left out: {FAILED}"],
    )
    write_fit(str(root / "fit.json"), fit)

    def predicted(value: float) -> list[PredictedMetric]:
        return [
            PredictedMetric(
                metric="heldout_macro:bits_per_byte",
                loglinear=value,
                loglinear_std=0.0042,
                gp=value + 0.003,
                gp_std=0.011,
            )
        ]

    proposal = Proposal(
        format_version=1,
        swarm=manifest.name,
        phase="main",
        objective={"heldout_macro:bits_per_byte": 1.0},
        kl_weight=0.01,
        model="loglinear",
        mixture="mixtures/demo-proposed.yaml",
        weights={"web": 0.2, "code": 0.6, "math": 0.2},
        prior={name: 1 / 3 for name in SOURCES},
        base={"web": 0.5, "code": 0.3, "math": 0.2},
        epochs={"web": 0.9, "code": 4.0, "math": 1.1},
        max_epochs={name: 4.0 for name in SOURCES},
        predicted=predicted(1.0312),
        predicted_prior=predicted(1.0857),
        predicted_base=predicted(1.1204),
        evidence_reused=["math"],
    )
    write_proposal(str(root / "proposal.json"), proposal)

    jobs, arms = [], []
    for arm, mean, std in (("proposal", 1.03, 0.002), ("prior", 1.06, 0.003), ("uniform", 1.035, 0.004)):
        runs = []
        for seed in (0, 1):
            job = SwarmProxy(
                id=f"{arm}-s{seed}",
                index=len(jobs),
                weights=proposal.weights if arm == "proposal" else proposal.prior,
                kind="validation",
                seed=seed,
                mixture=f"{arm}-s{seed}/mixture.yaml",
                run_config=f"{arm}-s{seed}/run.yaml",
                run=f"{arm}-s{seed}/run",
                compute_multiple=4.0,
            )
            write_job(root / "validation", job, "finished")
            jobs.append(job)
            runs.append(job.id)
        arms.append(
            ValidationArm(
                name=arm,
                weights=jobs[-1].weights,
                runs=runs,
                values=[mean - std / 2, mean + std / 2],
                mean=mean,
                std=std,
            )
        )
    validation = Validation(
        format_version=1,
        swarm=manifest.name,
        metric="heldout_macro:bits_per_byte",
        compute_multiple=4.0,
        seeds=[0, 1],
        jobs=jobs,
        arms=arms,
        margins={"prior": 0.03, "uniform": 0.005},
        beats={"prior": True, "uniform": False},
    )
    write_validation(str(root / "validation" / "validation.json"), validation)
    return {**info, "fit": fit, "proposal": proposal, "validation": validation}


def section(page: str, name: str) -> str:
    match = re.search(rf'<section id="{name}">(.*?)</section>', page, re.S)
    assert match, f"no section {name}"
    return match.group(1)


def svg_texts(fragment: str) -> list[str]:
    return [html.unescape(t) for t in re.findall(r"<text[^>]*>([^<]*)</text>", fragment)]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("swarm") / "demo-search"
    return root, make_swarm(root)


@pytest.fixture(scope="module")
def page(swarm: tuple[Path, dict], tmp_path_factory: pytest.TempPathFactory) -> Path:
    output = tmp_path_factory.mktemp("swarm-site")
    path = build_swarm_page(str(swarm[0]), str(output))
    assert path == str(output / "swarm.html")
    return output / "swarm.html"


def test_header_names_the_swarm_and_its_budgets(page: Path) -> None:
    text = page.read_text()
    assert "<title>Mixture search: demo-search</title>" in text
    header = html.unescape(section(text, "swarm"))
    assert "mixtures/demo.yaml" in header and "main (phase 1 of 2: main, anneal)" in header
    assert "8: 6 finished, 1 failed, 1 not finished" in header
    assert "100M tokens, 80M of them in main" in header and "2M tokens per proxy" in header
    assert "Evidence reused for math" in header and "evidence reused</span>" in header
    assert f"left out: {FAILED}" in header
    # Offline: no URL outside the page, nothing but the page's own hashed script.
    assert not re.search(r'(src|href)="(https?:)?//', text)
    assert text.count("<script") == 1


def test_predicted_against_measured(page: Path, swarm: tuple[Path, dict]) -> None:
    text = section(page.read_text(), "predictions")
    finished = swarm[1]["finished"]
    main = re.search(
        r'<figure class="swarm-chart scatter" data-metric="heldout_macro:bits_per_byte">(.*?)</figure>',
        text,
        re.S,
    )
    assert main, "no scatter of heldout_macro:bits_per_byte"
    chart = main.group(1)
    # One point per finished proxy and model, each named, and the y = x line.
    for model in ("log-linear", "Gaussian process"):
        group = re.search(rf'<g class="points" data-group="{model}">(.*?)</g>', chart, re.S).group(1)
        assert group.count("<circle") == len(finished)
        for job in finished:
            assert f"{job.id}: measured" in group
    assert 'class="diagonal"' in chart
    # Small multiples: one scatter per set and measure, the averages' loss too.
    metrics = set(re.findall(r'class="swarm-chart scatter" data-metric="([^"]+)"', text))
    assert metrics == {
        f"{n}:{m}" for n in ("heldout_macro", "macro", *SETS) for m in ("bits_per_byte", "loss")
    }
    # The quality table: Spearman of both models, R^2 and stable_at.
    row = re.search(r'<tr data-metric="heldout_macro:bits_per_byte">(.*?)</tr>', text, re.S).group(1)
    cells = re.findall(r"<td[^>]*>([^<]*)</td>", row)
    assert cells == ["heldout_macro:bits_per_byte", "0.914", "0.812", "5", "0.846", "0.701", "5", "6"]
    assert len(re.findall(r"<tr data-metric=", text)) == 2 * (len(SETS) + 2)


def test_proposed_weights_epochs_and_predictions(page: Path) -> None:
    text = section(page.read_text(), "proposal")
    chart = re.search(r'<div class="chart-box" id="weights-chart">(.*?)</div>', text, re.S).group(1)
    labels = svg_texts(chart)
    assert [label for label in labels if label in SOURCES] == list(SOURCES)  # in the search's order
    assert "proposed 60.0%" in labels and "prior 33.3%" in labels and "base 30.0%" in labels
    epochs = svg_texts(re.search(r'id="epochs-chart">(.*?)</div>', text, re.S).group(1))
    assert "4.00 of at most 4 epochs" in epochs and "0.90 of at most 4 epochs" in epochs
    code = re.search(r'<tr data-source="code">(.*?)</tr>', text, re.S).group(1)
    assert "60.0%" in code and "+30.0 pt" in code and "at cap" in code
    assert "at cap" not in re.search(r'<tr data-source="web">(.*?)</tr>', text, re.S).group(1)
    predicted = html.unescape(re.search(r'<table class="predicted">(.*?)</table>', text, re.S).group(1))
    assert (
        "1.0312 ± 0.0042" in predicted and "1.0857 ± 0.0042" in predicted and "1.1204 ± 0.0042" in predicted
    )
    assert "1.0342 ± 0.0110" in predicted  # the GP's mean and std at the proposal


def test_effects_heatmap(page: Path) -> None:
    text = section(page.read_text(), "effects")
    cells = re.findall(r'<rect class="heat-cell" data-cell="([^"]+)"', text)
    assert len(cells) == len(set(cells)) == (len(SETS) + 2) * len(SOURCES)
    assert {c.split("|")[1] for c in cells} == set(SOURCES)
    labels = svg_texts(text)
    assert "-1.25" in labels and "+0.31" in labels
    # Diverging: the helping effect is blue, the hurting one red.
    code = re.search(r'data-cell="heldout/domain=c00\|code"[^>]*fill="(#[0-9a-f]{6})"', text).group(1)
    web = re.search(r'data-cell="heldout/domain=c00\|web"[^>]*fill="(#[0-9a-f]{6})"', text).group(1)
    assert code == svg.DIVERGING[0]
    r, _, b = svg._hex_to_rgb(web)
    assert r > b


def test_proxies_curves_and_table(page: Path, swarm: tuple[Path, dict]) -> None:
    text = section(page.read_text(), "proxies")
    ids = re.findall(r'<tr data-proxy="([^"]+)">', text)
    assert ids == [job.id for job in swarm[1]["proxies"]]
    # A line per proxy with a run folder, named by its id; the validation runs have their own charts.
    loss = re.search(r'data-chart="Training loss, proxies">(.*?)</figure>', text, re.S).group(1)
    assert sorted(re.findall(r"<title>(proxy-\d+)</title>", loss)) == [f"proxy-{i:03d}" for i in range(7)]
    validation = re.search(r'data-chart="Training loss, validation runs">(.*?)</figure>', text, re.S).group(1)
    assert len(re.findall(r"<title>(\w+-s\d)</title>", validation)) == 6
    assert 'data-chart="heldout_macro bits per byte, proxies"' in text
    row = re.search(r'<tr data-proxy="proxy-003">(.*?)</tr>', text, re.S).group(1)
    job = swarm[1]["proxies"][3]
    final = set_metrics(job.weights)["heldout_macro"]["bits_per_byte"]
    assert f"{final:.4f}" in row and "finished" in row
    assert f"{job.weights['code']:.3f}" in row and ">0.5<" in row  # its weight and concentration
    failed = re.search(rf'<tr data-proxy="{FAILED}">(.*?)</tr>', text, re.S).group(1)
    # A failed proxy shows its latest evaluation (marked) and its error.
    assert "failed" in failed and "out of memory" in failed and "latest evaluation, step 40" in failed
    assert "not run" in re.search(rf'<tr data-proxy="{NOT_RUN}">(.*?)</tr>', text, re.S).group(1)


def test_validation_verdicts(page: Path) -> None:
    text = html.unescape(section(page.read_text(), "validation"))
    assert "The proposal beats the prior mixture" in text and "lower by 0.0300" in text
    assert "The proposal does not beat the uniform mixture" in text
    chart = re.search(r'<div class="chart-box" id="validation-chart">(.*?)</div>', text, re.S).group(1)
    assert "<title>proposal: 1.0300 ± 0.0020 over 2 seeds</title>" in chart
    for arm in ("proposal", "prior", "uniform"):
        assert svg_texts(chart).count(arm) == 2  # in the legend and at its tick
    prior = re.search(r'<tr data-arm="prior">(.*?)</tr>', text, re.S).group(1)
    assert "+0.0300" in prior and "the proposal beats it" in prior and "prior-s0, prior-s1" in prior
    assert "1.0585, 1.0615" in prior  # its value per seed


def test_same_swarm_same_bytes(page: Path, swarm: tuple[Path, dict], tmp_path: Path) -> None:
    again = build_swarm_page(str(swarm[0]), str(tmp_path))
    assert Path(again).read_bytes() == page.read_bytes()


def test_a_swarm_without_fit_or_proposal_still_builds(tmp_path: Path) -> None:
    root = tmp_path / "swarm"
    make_swarm(root, fitted=False)
    # A proxy whose run.yaml changed after its result: it runs again.
    (root / "proxy-004" / "run.yaml").write_text("run: changed\n")
    text = html.unescape(Path(build_swarm_page(str(root), str(tmp_path / "site"))).read_text())
    assert "Not fitted yet" in section(text, "predictions") and "Not fitted yet" in section(text, "effects")
    assert "No proposal yet" in section(text, "proposal")
    assert "No validation yet" in section(text, "validation")
    assert "8: 5 finished, 1 failed, 2 not finished" in section(text, "swarm")
    assert "stale" in re.search(r'<tr data-proxy="proxy-004">(.*?)</tr>', text, re.S).group(1)


def test_report_command_with_only_the_swarm(
    swarm: tuple[Path, dict], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "site"
    assert main(["report", "--swarm", str(swarm[0]), "--output", str(output)]) == 0
    assert sorted(p.name for p in output.iterdir()) == ["swarm.html"]
    assert "wrote" in capsys.readouterr().out
    text = (output / "swarm.html").read_text()
    assert 'href="index.html"' not in text and 'href="run.html"' not in text

    def fails(args: list[str], message: str) -> None:
        assert main(["report", *args]) == 2
        assert message in capsys.readouterr().err

    fails(["--swarm", str(tmp_path / "nope"), "--output", str(output)], "no such folder")
    fails(["--swarm", str(tmp_path), "--output", str(output)], "no swarm.json")
    fails(["--swarm", str(swarm[0]), "--run", str(tmp_path), "--output", str(output)], "--run belong")
    fails(["--swarm", str(swarm[0]), "--tokens", str(tmp_path), "--output", str(output)], "--curated")
    fails(["--output", str(output)], "--curated, --tokens, --mixture or --plan required")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "swarm.json").write_text('{"format_version": 1}')
    fails(["--swarm", str(broken), "--output", str(output)], "swarm.json")


def test_site_links_the_swarm_page(swarm: tuple[Path, dict], tmp_path: Path) -> None:
    inputs = make_report_inputs(tmp_path / "inputs")
    output = tmp_path / "site"
    assert main(report_args(inputs, output, "--swarm", str(swarm[0]))) == 0
    for name in ("index.html", "run.html", "swarm.html"):
        assert '<a href="swarm.html"' in (output / name).read_text(), name
    swarm_page = (output / "swarm.html").read_text()
    assert 'href="index.html"' in swarm_page and 'href="run.html"' in swarm_page
    # Built again without --swarm, the page goes with the rest of the old build.
    assert main(report_args(inputs, output)) == 0
    assert not (output / "swarm.html").exists()
    assert "swarm.html" not in (output / "index.html").read_text()


def test_scatter_chart() -> None:
    chart = svg.scatter_chart(
        [
            svg.Points("a <b>", [(1.0, 1.1), (2.0, float("nan")), (3.0, 2.9)], ["first <i>", "nan", "third"]),
            svg.Points("b", [(1.5, 1.4)]),
        ],
        title="t & u",
        x=svg.Axis("measured"),
        y=svg.Axis("predicted"),
        diagonal=True,
    )
    assert (
        "<b>" not in chart and "a &lt;b&gt;" in chart and "first &lt;i&gt;" in chart and "t &amp; u" in chart
    )
    assert chart.count("<circle") == 3 + 2  # two legend swatches, three finite points
    assert "nan" not in chart.lower()
    assert "b: 1.5, 1.4" in chart  # a point without a title is named by its group and values
    diagonal = re.search(r'class="diagonal" x1="([\d.]+)" x2="([\d.]+)" y1="([\d.]+)" y2="([\d.]+)"', chart)
    x1, x2, y1, y2 = (float(v) for v in diagonal.groups())
    # y = x across equal ranges: the line spans the plot's width and height in the same proportion.
    assert (x2 - x1) / (y1 - y2) == pytest.approx((420 - 60 - 26) / (340 - 42 - 40), rel=0.01)
    assert chart == svg.scatter_chart(
        [
            svg.Points("a <b>", [(1.0, 1.1), (2.0, float("nan")), (3.0, 2.9)], ["first <i>", "nan", "third"]),
            svg.Points("b", [(1.5, 1.4)]),
        ],
        title="t & u",
        x=svg.Axis("measured"),
        y=svg.Axis("predicted"),
        diagonal=True,
    )
    assert "no data" in svg.scatter_chart([svg.Points("x", [])], title="empty")


def test_diverging_scale() -> None:
    scale = svg.DivergingScale.for_values([-2.0, 0.5, float("nan")])
    assert scale.bound == 2.0
    assert scale.color(-2.0) == svg.DIVERGING[0] and scale.color(5.0) == svg.DIVERGING[-1]
    assert scale.color(0.0) == svg.DIVERGING[4]
    assert scale.ticks()[0] == -2.0 and scale.ticks()[-1] == 2.0 and 0.0 in scale.ticks()
    legend = svg.color_legend(scale, label="effect")
    assert "empty" not in legend and "log scale" not in legend


@pytest.mark.browser
def test_swarm_page_in_a_browser(browser, page: Path) -> None:
    open_page(browser, page)
    assert browser.title == "Mixture search: demo-search"
    browser.execute_script("document.querySelectorAll('details').forEach(d => d.open = true)")
    shot = screenshot(browser, "report-swarm.png")
    assert shot.stat().st_size > 10_000
    assert console_errors(browser) == []
    sizes = browser.execute_script(
        "return Array.from(document.querySelectorAll('svg.chart')).map(e => {"
        " const r = e.getBoundingClientRect();"
        " return [e.closest('section').id, e.getAttribute('class'), r.width, r.height]; })"
    )
    by_section: dict[str, int] = {}
    for section_id, kind, width, height in sizes:
        assert width > 0 and height > 0, (section_id, kind)
        by_section[section_id] = by_section.get(section_id, 0) + 1
    assert set(by_section) == {"predictions", "proposal", "effects", "proxies", "validation"}
    # Every point of the main scatter lies inside its plot frame.
    inside = browser.execute_script(
        "const svg = document.querySelector('figure[data-metric=\"heldout_macro:bits_per_byte\"] svg');"
        "const frame = svg.querySelector('rect').getBoundingClientRect();"
        "return Array.from(svg.querySelectorAll('g.points circle')).map(c => {"
        " const r = c.getBoundingClientRect(); const x = r.x + r.width / 2, y = r.y + r.height / 2;"
        " return x >= frame.left && x <= frame.right && y >= frame.top && y <= frame.bottom; })"
    )
    assert len(inside) == 12 and all(inside)
