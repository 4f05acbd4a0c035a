"""The swarm page (swarm.html) of a mixture search: what the proxies measured, how well the fitted models
predict it, the weights proposed and how the validation runs came out.

Built from the swarm folder's records (tokenmill.formats.swarm: swarm.json, each proxy's result.json,
fit.json, proposal.json, validation/validation.json) and the proxies' run folders (metrics.jsonl and
eval.jsonl, read as the run page reads them: only whole lines, so a swarm still training can be shown).
A swarm that is not fitted yet, or has no proposal or validation yet, still gets a page: those sections say
so. The page is rendered through the site's templates (`tokenmill.reports.site`), alone (`tokenmill report
--swarm DIR --output DIR`) or beside the overview and run pages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenmill import storage
from tokenmill.errors import FormatError
from tokenmill.formats.evals import EvalRecord, series
from tokenmill.formats.runs import METRICS, MetricsRow
from tokenmill.formats.swarm import (
    FIT,
    PROPOSAL,
    RESULT,
    SWARM,
    VALIDATION,
    MetricFit,
    PredictedMetric,
    Proposal,
    ProxyResult,
    SwarmFit,
    SwarmManifest,
    SwarmProxy,
    Validation,
    read_fit,
    read_proposal,
    read_result,
    read_swarm,
    read_validation,
)
from tokenmill.reports import svg
from tokenmill.reports.inputs import InputError
from tokenmill.reports.render import check_output, render_template
from tokenmill.reports.runpage import parse_metrics, read_evals
from tokenmill.units import format_count, format_duration

SWARM_PAGE = "swarm.html"
VALIDATION_FOLDER = "validation"  # tokenmill.swarm.validate.FOLDER, not imported: it pulls in the trainer
MAIN_METRIC = "heldout_macro:bits_per_byte"
AVERAGE_SETS = ("heldout_macro", "macro")  # the averages a fit models (micro is not fitted)
MODEL_LABELS = {"loglinear": "log-linear", "gp": "Gaussian process"}
MODEL_COLORS = {"loglinear": svg.CATEGORICAL[0], "gp": svg.CATEGORICAL[1]}
# Curves: the sampled proxies in one light color, the anchors and validation arms each in their own.
KIND_COLORS = {
    "sampled": "#93c5fd",
    "prior": "#4b5563",
    "uniform": "#16a34a",
    "base": "#ea580c",
    "proposal": "#1d4ed8",
}
WEIGHT_COLORS = {"proposed": "#2563eb", "prior": "#9ca3af", "base": "#fdba74"}
MEASURE_LABELS = {"bits_per_byte": "bits per byte", "loss": "loss (nats per token)"}


@dataclass
class JobState:
    """A proxy (or validation run) and what its folder holds now."""

    job: SwarmProxy
    status: str  # finished, failed, stale (its run.yaml changed since), running (metrics, no result), not run
    result: ProxyResult | None
    rows: list[MetricsRow]
    evals: list[EvalRecord]


def _read(reader: Any, path: str) -> Any:
    """A record, or None without its file; InputError names the file when it is not what it should be."""
    if not storage.exists(path):
        return None
    try:
        return reader(path)
    except FormatError as error:
        raise InputError(str(error)) from error


def _whole_metrics(run_dir: str) -> list[MetricsRow]:
    """The run folder's metrics rows, whole lines only (a proxy may be training while the page is built)."""
    path = storage.join(run_dir, METRICS)
    if not storage.exists(path):
        return []
    with storage.open_file(path, "rb") as handle:
        data = handle.read()
    try:
        return parse_metrics(data[: data.rfind(b"\n") + 1], path)
    except FormatError as error:
        raise InputError(str(error)) from error


def read_job(root: str, job: SwarmProxy) -> JobState:
    """One job's result, curves and status; `root` is the folder its files are relative to."""
    result = _read(read_result, storage.join(root, job.id, RESULT))
    run_dir = storage.join(root, job.run)
    rows = _whole_metrics(run_dir)
    evals = read_evals(run_dir)[0] if storage.exists(run_dir) else []
    config = storage.join(root, job.run_config)
    if result is not None:
        # As `tokenmill mixture run` judges it: a result of another run configuration runs again.
        current = storage.exists(config) and storage.file_sha256(config) == result.run_config_sha256
        status = result.status if current else "stale"
    else:
        status = "running" if rows else "not run"
    return JobState(job, status, result, rows, evals)


def _fmt(value: float | None, digits: int = 4) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def _spread(value: float | None, std: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{_fmt(value)} ± {_fmt(std)}" if std is not None else _fmt(value)


def _share(weight: float) -> str:
    return f"{100 * weight:.1f}%"


def _metric_label(metric: str) -> str:
    name, _, measure = metric.rpartition(":")
    return f"{name} {MEASURE_LABELS.get(measure, measure)}"


def _metric_order(fit: MetricFit) -> tuple[int, int, str]:
    """Averages first (held-out macro, then macro), then every set; bits per byte before loss."""
    rank = AVERAGE_SETS.index(fit.set) if fit.set in AVERAGE_SETS else len(AVERAGE_SETS)
    return (fit.measure != "bits_per_byte", rank, fit.set)


def _headline_set(manifest: SwarmManifest) -> str:
    return "heldout_macro" if any(s.kind == "heldout" for s in manifest.evaluation) else "macro"


def _final_value(state: JobState, name: str, measure: str) -> tuple[float | None, str]:
    """The job's final value of one set's measure, and where it comes from (its result, or the latest
    evaluation of a run that has not finished)."""
    if state.result is not None and state.status == "finished":
        value = state.result.metrics.get(name, {}).get(measure)
        if value is not None:
            return value, ""
    points = series(state.evals, name, measure)
    if points:
        return points[-1][2], f"latest evaluation, step {points[-1][0]:,}"
    return None, ""


# ---------------------------------------------------------------------------------------------------------
# The sections.


def build_header(
    manifest: SwarmManifest, states: Sequence[JobState], fit: SwarmFit | None, root: str
) -> dict[str, Any]:
    counts = {status: sum(s.status == status for s in states) for status in ("finished", "failed")}
    waiting = len(states) - counts["finished"] - counts["failed"]
    phase_index = manifest.phases.index(manifest.phase) if manifest.phase in manifest.phases else None
    phase = manifest.phase + (
        f" (phase {phase_index + 1} of {len(manifest.phases)}: {', '.join(manifest.phases)})"
        if phase_index is not None and len(manifest.phases) > 1
        else ""
    )
    facts = [
        ("swarm folder", root),
        ("base mixture", f"{manifest.base_mixture} (sha256 {manifest.base_mixture_sha256[:12]})"),
        ("searched phase", phase),
        (
            "target budget",
            f"{format_count(manifest.target_tokens)} tokens, "
            f"{format_count(manifest.phase_tokens)} of them in {manifest.phase}",
        ),
        ("proxy budget", f"{format_count(manifest.proxy_tokens)} tokens per proxy"),
        (
            "proxies",
            f"{len(states)}: {counts['finished']} finished, {counts['failed']} failed, "
            f"{waiting} not finished",
        ),
        ("Dirichlet concentrations", ", ".join(f"{c:g}" for c in manifest.concentrations)),
        (
            "samples rejected",
            f"{manifest.rejected_over_cap} over an epoch cap at the target budget, "
            f"{manifest.rejected_duplicate} equal to an earlier one at block granularity "
            f"({manifest.block_size} sequences)",
        ),
        ("token shards", manifest.tokens),
        ("proxy run configuration", manifest.run_config),
    ]
    if manifest.created_by:
        facts.append(("created by", manifest.created_by))
    if fit is None:
        evidence = "Not fitted yet: no evidence has been weighed (tokenmill mixture fit)."
    elif fit.evidence_reused:
        evidence = (
            f"Evidence reused for {', '.join(fit.evidence_reused)}: these sources' content changed since the "
            "proxies trained on it, and the fit kept their results because it was told to."
        )
    else:
        evidence = "Every source's content is what the proxies trained on: no evidence was reused."
    tiles = [
        (f"{len(states):,}", "proxies"),
        (f"{counts['finished']:,}", "finished"),
        (f"{counts['failed']:,}", "failed"),
        (f"{len(manifest.sources):,}", "sources searched"),
        (f"{len(manifest.evaluation):,}", "evaluation sets"),
    ]
    return {
        "facts": facts,
        "tiles": tiles,
        "evidence": evidence,
        "evidence_reused": bool(fit and fit.evidence_reused),
        "warnings": list(fit.warnings) if fit else [],
    }


def _scatter(metric: MetricFit, *, width: float, height: float, title: str = "") -> Any:
    groups = []
    for quality in metric.quality:
        label = MODEL_LABELS[quality.model]
        groups.append(
            svg.Points(
                label,
                list(zip(metric.measured, quality.predicted)),
                [
                    f"{proxy}: measured {_fmt(measured)}, predicted {_fmt(predicted)} ({label}, out of fold)"
                    for proxy, measured, predicted in zip(metric.proxies, metric.measured, quality.predicted)
                ],
                MODEL_COLORS[quality.model],
            )
        )
    return svg.scatter_chart(
        groups,
        title=title or _metric_label(metric.metric),
        x=svg.Axis("measured"),
        y=svg.Axis("predicted, out of fold"),
        diagonal=True,
        width=width,
        height=height,
    )


def build_predictions(fit: SwarmFit | None) -> dict[str, Any] | None:
    """Out-of-fold predictions against the measured values per metric and model, and their quality."""
    if fit is None or not fit.metrics:
        return None
    metrics = sorted(fit.metrics, key=_metric_order)
    averages = [m for m in metrics if m.set in AVERAGE_SETS and m.measure == "bits_per_byte"]
    per_set = {
        measure: [m for m in metrics if m.set not in AVERAGE_SETS and m.measure == measure]
        for measure in MEASURE_LABELS
    }
    main = [
        {"metric": m.metric, "svg": _scatter(m, width=460, height=380)} for m in (averages or metrics[:1])
    ]
    small = {
        measure: [{"metric": m.metric, "svg": _scatter(m, width=320, height=280, title=m.set)} for m in found]
        for measure, found in per_set.items()
        if found
    }
    average_losses = [m for m in metrics if m.set in AVERAGE_SETS and m.measure == "loss"]
    if average_losses:
        small["loss"] = [
            {"metric": m.metric, "svg": _scatter(m, width=320, height=280, title=m.set)}
            for m in average_losses
        ] + small.get("loss", [])
    table = []
    for m in metrics:
        quality = {q.model: q for q in m.quality}
        row = {"metric": m.metric, "proxies": len(m.proxies), "models": []}
        for model in MODEL_LABELS:
            q = quality.get(model)
            row["models"].append(
                {
                    "spearman": _fmt(q.spearman, 3) if q else "n/a",
                    "r2": _fmt(q.r2, 3) if q else "n/a",
                    "stable_at": str(q.stable_at) if q and q.stable_at is not None else "—",
                }
            )
        row["folds"] = max((q.folds for q in m.quality), default=0)
        table.append(row)
    curve = None
    headline = next((m for m in metrics if m.metric == MAIN_METRIC), metrics[0])
    loglinear = next((q for q in headline.quality if q.model == "loglinear"), None)
    if loglinear and loglinear.learning_curve:
        curve = svg.line_chart(
            [
                svg.Series(
                    "log-linear, out of fold",
                    [(float(p.proxies), p.spearman) for p in loglinear.learning_curve],
                    MODEL_COLORS["loglinear"],
                    markers=True,
                )
            ],
            title=f"Spearman of {_metric_label(headline.metric)} against proxies fitted",
            x=svg.Axis("proxies fitted"),
            y=svg.Axis("out-of-fold Spearman", high=1.0),
            vlines=[svg.VLine(float(loglinear.stable_at), "stable")] if loglinear.stable_at else [],
        )
    return {
        "main": main,
        "small": [(MEASURE_LABELS[measure], charts) for measure, charts in small.items()],
        "table": table,
        "models": [MODEL_LABELS[m] for m in MODEL_LABELS],
        "curve": curve,
        "curve_metric": headline.metric,
    }


def _predicted_rows(proposal: Proposal) -> list[dict[str, Any]]:
    def by_metric(found: list[PredictedMetric]) -> dict[str, PredictedMetric]:
        return {p.metric: p for p in found}

    at = {
        "proposal": by_metric(proposal.predicted),
        "prior": by_metric(proposal.predicted_prior),
        "base": by_metric(proposal.predicted_base),
    }
    rows = []
    for metric in [p.metric for p in proposal.predicted]:
        for model in MODEL_LABELS:
            cells = []
            for where in ("proposal", "prior", "base"):
                p = at[where].get(metric)
                if p is None:
                    cells.append("n/a")
                elif model == "loglinear":
                    cells.append(_spread(p.loglinear, p.loglinear_std))
                else:
                    cells.append(_spread(p.gp, p.gp_std))
            rows.append(
                {
                    "metric": metric,
                    "model": MODEL_LABELS[model],
                    "cells": cells,
                    "in_objective": metric in proposal.objective,
                }
            )
    return rows


def build_proposal(proposal: Proposal | None, manifest: SwarmManifest) -> dict[str, Any] | None:
    """The proposed weights against the prior and the base, the epochs they take, what they predict."""
    if proposal is None:
        return None
    # The search's order (records keep their keys sorted); a source only the proposal names comes last.
    names = _in_search_order(proposal.weights, manifest)
    bars = []
    for name in names:
        for kind, weights, label in (
            ("proposed", proposal.weights, name),
            ("prior", proposal.prior, ""),
            ("base", proposal.base, ""),
        ):
            weight = weights.get(name, 0.0)
            bars.append(svg.Bar(label, weight, f"{kind} {_share(weight)}", WEIGHT_COLORS[kind]))
    weights_chart = svg.bar_chart(bars, title=f"Weights of phase {proposal.phase}", width=720)
    rows, epoch_bars = [], []
    for name in names:
        epochs = proposal.epochs.get(name, 0.0)
        cap = proposal.max_epochs.get(name)
        at_cap = cap is not None and epochs >= cap * 0.99
        epoch_bars.append(
            svg.Bar(
                name,
                epochs,
                f"{epochs:.2f} of at most {cap:g} epochs" if cap is not None else f"{epochs:.2f} epochs",
                "#b91c1c" if at_cap else "#2563eb",
            )
        )
        weight, base = proposal.weights.get(name, 0.0), proposal.base.get(name, 0.0)
        rows.append(
            {
                "source": name,
                "proposed": _share(weight),
                "prior": _share(proposal.prior.get(name, 0.0)),
                "base": _share(base),
                "change": f"{100 * (weight - base):+.1f} pt",
                "epochs": f"{epochs:.2f}",
                "max_epochs": f"{cap:g}" if cap is not None else "—",
                "at_cap": at_cap,
            }
        )
    epochs_chart = svg.bar_chart(
        epoch_bars, title="Epochs at the target budget, every phase counted", width=720
    )
    return {
        "facts": [
            (
                "objective",
                ", ".join(f"{weight:g} x {metric}" for metric, weight in proposal.objective.items()),
            ),
            ("model optimised", MODEL_LABELS[proposal.model]),
            ("KL weight toward the prior", f"{proposal.kl_weight:g}"),
            ("mixture written", proposal.mixture),
            ("evidence reused", ", ".join(proposal.evidence_reused) or "none"),
        ],
        "weights_chart": weights_chart,
        "epochs_chart": epochs_chart,
        "weight_keys": [(kind, color) for kind, color in WEIGHT_COLORS.items()],
        "rows": rows,
        "predicted": _predicted_rows(proposal),
    }


def build_effects(fit: SwarmFit | None) -> dict[str, Any] | None:
    """The log-linear effects of bits per byte: evaluation sets (and their averages) by sources."""
    if fit is None:
        return None
    metrics = sorted((m for m in fit.metrics if m.measure == "bits_per_byte"), key=_metric_order)
    if not metrics:
        return None
    sources = list(fit.sources)
    cells = [
        svg.HeatCell(
            row=m.set,
            column=source,
            value=m.loglinear.effects.get(source, 0.0),
            label=f"{m.loglinear.effects.get(source, 0.0):+.2f}",
            title=f"{m.set} / {source}: effect {m.loglinear.effects.get(source, 0.0):+.4f} "
            f"(bits per byte = {m.loglinear.floor:.3f} + exp({m.loglinear.intercept:.3f} "
            "+ sum of effect x weight))",
            key=f"{m.set}|{source}",
        )
        for m in metrics
        for source in sources
        if source in m.loglinear.effects
    ]
    scale = svg.DivergingScale.for_values([c.value for c in cells])
    cell_width = max(78.0, min(160.0, svg.CHAR_WIDTH * max((len(s) for s in sources), default=4) + 14))
    return {
        "svg": svg.heatmap(
            [m.set for m in metrics],
            sources,
            cells,
            scale=scale,
            title="log-linear effect of each source's weight on each set's bits per byte",
            row_label="evaluation set",
            column_label="source (weight in the searched phase)",
            cell_width=cell_width,
        ),
        "legend": svg.color_legend(
            scale, label="effect per unit weight, in the exponent", gradient_id="effects-gradient"
        ),
    }


def _curve_color(job: SwarmProxy) -> str:
    if job.kind == "validation":
        return KIND_COLORS.get(job.id.partition("-s")[0], "#6b7280")
    return KIND_COLORS.get(job.kind, KIND_COLORS["sampled"])


def _curves_chart(states: Sequence[JobState], title: str, y: svg.Axis, points: Any, group_of: Any) -> Any:
    """One line per job (named by its id, drawn in its group's color) and one legend entry per group."""
    lines = [
        svg.Series(state.job.id, points(state), _curve_color(state.job), width=1.2, legend=False)
        for state in states
    ]
    groups: dict[str, str] = {}
    for state in states:
        groups.setdefault(group_of(state.job), _curve_color(state.job))
    # Pointless series that only name the groups in the legend (a line per proxy would crowd it).
    keys = [svg.Series(name, [], color) for name, color in groups.items()]
    return svg.line_chart([*keys, *lines], title=title, x=svg.Axis("step"), y=y)


def build_curves(
    manifest: SwarmManifest, states: Sequence[JobState], validation_states: Sequence[JobState]
) -> dict[str, Any]:
    """Every proxy's training loss and held-out curve, the validation runs', and the table of proxies."""
    headline = _headline_set(manifest)

    def loss(state: JobState) -> list[tuple[float, float | None]]:
        return [(float(r.step), r.loss) for r in state.rows]

    def evaluation(state: JobState) -> list[tuple[float, float | None]]:
        return [(float(step), value) for step, _, value in series(state.evals, headline, "bits_per_byte")]

    def proxy_group(job: SwarmProxy) -> str:
        return "sampled" if job.kind == "sampled" else f"{job.kind} ({job.id})"

    def arm_group(job: SwarmProxy) -> str:
        return job.id.partition("-s")[0]

    charts = []
    for group, jobs, group_of in (
        ("proxies", states, proxy_group),
        ("validation runs", validation_states, arm_group),
    ):
        if not any(s.rows or s.evals for s in jobs):
            continue
        charts.append(
            {
                "title": f"Training loss, {group}",
                "svg": _curves_chart(jobs, f"Training loss of the {group}", svg.Axis("loss"), loss, group_of),
            }
        )
        if any(s.evals for s in jobs):
            charts.append(
                {
                    "title": f"{headline} bits per byte, {group}",
                    "svg": _curves_chart(
                        jobs,
                        f"{headline} bits per byte of the {group}",
                        svg.Axis("bits per byte"),
                        evaluation,
                        group_of,
                    ),
                }
            )
    sources = [s.name for s in manifest.sources]
    rows = []
    for state in states:
        job, result = state.job, state.result
        value, note = _final_value(state, headline, "bits_per_byte")
        rows.append(
            {
                "id": job.id,
                "kind": job.kind,
                "concentration": f"{job.concentration:g}" if job.concentration is not None else "—",
                "seed": job.seed,
                "weights": [_fmt(job.weights.get(name, 0.0), 3) for name in sources],
                "weights_bar": svg.stacked_bar(
                    [
                        svg.Segment(name, job.weights.get(name, 0.0), _share(job.weights.get(name, 0.0)))
                        for name in sources
                    ],
                    width=160,
                    height=12,
                ),
                "status": state.status,
                "steps": f"{result.steps:,}"
                if result and result.steps is not None
                else (f"{state.rows[-1].step:,}" if state.rows else "—"),
                "seconds": format_duration(result.seconds) if result else "—",
                "final": _fmt(value),
                "final_note": note,
                "error": (result.error or "") if result and result.status == "failed" else "",
            }
        )
    return {
        "charts": charts,
        "headline": headline,
        "sources": sources,
        "source_keys": [(name, svg.category_color(i)) for i, name in enumerate(sources)],
        "rows": rows,
        "any_curves": bool(charts),
    }


def _in_search_order(weights: dict[str, float], manifest: SwarmManifest) -> list[str]:
    searched = [s.name for s in manifest.sources]
    return [name for name in searched if name in weights] + [name for name in weights if name not in searched]


def build_validation(validation: Validation | None, manifest: SwarmManifest) -> dict[str, Any] | None:
    """Each arm's mean and spread over the seeds, and whether the proposal beats the others."""
    if validation is None:
        return None
    by_name = {arm.name: arm for arm in validation.arms}
    proposal = by_name.get("proposal")
    arms = []
    for arm in validation.arms:
        margin = validation.margins.get(arm.name)
        beaten = validation.beats.get(arm.name)
        if arm.name == "proposal":
            verdict, badge = "", ""
        elif beaten:
            verdict, badge = "the proposal beats it", "good"
        else:
            verdict, badge = "the proposal is not shown better", "warn"
        arms.append(
            {
                "name": arm.name,
                "weights": ", ".join(
                    f"{name} {_share(arm.weights[name])}" for name in _in_search_order(arm.weights, manifest)
                ),
                "runs": ", ".join(arm.runs),
                "seed_values": ", ".join(_fmt(v) for v in arm.values),
                "mean": _fmt(arm.mean),
                "std": _fmt(arm.std),
                "margin": f"{margin:+.4f}" if margin is not None else "—",
                "verdict": verdict,
                "badge": badge,
            }
        )
    verdicts = []
    for name, beaten in validation.beats.items():
        other = by_name.get(name)
        margin = validation.margins.get(name, float("nan"))
        threshold = 2 * max(other.std if other else 0.0, proposal.std if proposal else 0.0)
        direction = "lower" if margin >= 0 else "higher"
        verdicts.append(
            {
                "name": name,
                "beats": beaten,
                "text": (
                    f"The proposal {'beats' if beaten else 'does not beat'} the {name} mixture: its mean "
                    f"{validation.metric} is {direction} by {abs(margin):.4f}, "
                    f"{'more' if beaten else 'not more'} than twice the larger seed standard deviation "
                    f"({threshold:.4f})."
                ),
            }
        )
    chart = None
    if validation.arms:
        # Means with one seed standard deviation either side, on an axis that shows their differences (bars
        # from zero would hide them).
        lines = []
        for index, arm in enumerate(validation.arms):
            color = KIND_COLORS.get(arm.name, "#6b7280")
            seeds = f"{len(arm.values)} seed{'s' if len(arm.values) != 1 else ''}"
            lines.append(svg.Series(arm.name, [(float(index), arm.mean)], color, markers=True))
            lines.append(
                svg.Series(
                    f"{arm.name}: {_fmt(arm.mean)} ± {_fmt(arm.std)} over {seeds}",
                    [(float(index), arm.mean - arm.std), (float(index), arm.mean + arm.std)],
                    color,
                    width=2.5,
                    legend=False,
                )
            )
        arm_names = [arm.name for arm in validation.arms]

        def arm_tick(value: float) -> str:
            index = round(value)
            return arm_names[index] if abs(value - index) < 1e-9 and 0 <= index < len(arm_names) else ""

        chart = svg.line_chart(
            lines,
            title=f"{validation.metric}: mean ± one seed std per arm",
            x=svg.Axis("arm", low=-0.5, high=len(arm_names) - 0.5, format=arm_tick),
            y=svg.Axis(validation.metric),
            width=560,
            height=280,
        )
    return {
        "metric": validation.metric,
        "compute_multiple": f"{validation.compute_multiple:g}",
        "seeds": ", ".join(str(s) for s in validation.seeds),
        "jobs": len(validation.jobs),
        "arms": arms,
        "verdicts": verdicts,
        "chart": chart,
    }


# ---------------------------------------------------------------------------------------------------------
# The page.


def build_swarm(swarm_dir: str) -> dict[str, Any]:
    """The swarm page's content from a swarm folder; InputError when swarm.json is missing or a record is
    not what its format says."""
    manifest_path = storage.join(swarm_dir, SWARM)
    if not storage.exists(manifest_path):
        raise InputError(f"{swarm_dir}: no {SWARM} here (expected a folder of `tokenmill mixture swarm`)")
    manifest: SwarmManifest = _read(read_swarm, manifest_path)
    fit: SwarmFit | None = _read(read_fit, storage.join(swarm_dir, FIT))
    proposal: Proposal | None = _read(read_proposal, storage.join(swarm_dir, PROPOSAL))
    validation_root = storage.join(swarm_dir, VALIDATION_FOLDER)
    validation: Validation | None = _read(read_validation, storage.join(validation_root, VALIDATION))
    states = [read_job(swarm_dir, job) for job in manifest.proxies]
    validation_states = [read_job(validation_root, job) for job in validation.jobs] if validation else []
    return {
        "name": manifest.name,
        "phase": manifest.phase,
        "header": build_header(manifest, states, fit, swarm_dir),
        "predictions": build_predictions(fit),
        "proposal": build_proposal(proposal, manifest),
        "effects": build_effects(fit),
        "curves": build_curves(manifest, states, validation_states),
        "validation": build_validation(validation, manifest),
    }


def render_swarm_page(content: dict[str, Any], *, has_overview: bool = False, run_name: str = "") -> bytes:
    """swarm.html from `build_swarm`'s content; the navigation links the overview and run pages beside it
    when the site has them."""
    return render_template(
        "swarm.html.j2",
        title=f"Mixture search: {content['name']}",
        page="swarm",
        s=content,
        has_overview=has_overview,
        has_run=bool(run_name),
        run_name=run_name,
        swarm_name=content["name"],
    )


def build_swarm_page(swarm_dir: str, output_dir: str) -> str:
    """Write output_dir/swarm.html for the swarm folder `swarm_dir` and return its path. Other files in
    `output_dir` are left alone; a folder holding something other than an earlier report is refused."""
    content = build_swarm(swarm_dir)
    check_output(output_dir)
    path = storage.join(output_dir, SWARM_PAGE)
    storage.write_bytes(path, render_swarm_page(content))
    return path
