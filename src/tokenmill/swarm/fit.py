"""`tokenmill mixture fit`: models of each held-out metric as a function of the searched phase's weights,
and how well they predict proxies they were not fitted on.

Two models per metric:

* **log-linear** (the form of Data Mixing Laws and Olmix): metric(w) = floor + exp(intercept + effect . w),
  floor constrained to [0, the smallest measured value), fitted by bounded least squares with a small ridge on
  the effects (the weights sum to 1, so effects are defined up to a constant; the ridge picks the smallest).
  An average over sets (`heldout_macro`, `macro`) is predicted as the mean of its sets' models, which is what
  the average is; a single exponential fitted to the average would send every proposal to a corner.
* **Gaussian process** (scikit-learn: a Matern kernel with one length scale per source plus white noise,
  targets normalized), which assumes no form and gives a standard deviation with each prediction.

Quality is measured out of fold: k-fold over the proxies (each proxy predicted by models that never saw it),
reported as Spearman rank correlation and R^2, with a learning curve (the log-linear model's out-of-fold
Spearman on growing subsets of the swarm) that says after how many proxies the fit stopped changing.

Cost: a fit is a least-squares problem of sources + 2 parameters over the proxies; every metric is fitted
(folds + 1) times plus the learning curve's fits: seconds for hundreds of proxies and sources.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import optimize, stats

from tokenmill import storage
from tokenmill.errors import UsageError
from tokenmill.formats.evals import AVERAGES
from tokenmill.formats.swarm import (
    CurvePoint,
    LogLinearFit,
    MetricFit,
    ModelQuality,
    ProxyResult,
    SwarmFit,
    SwarmManifest,
)
from tokenmill.swarm.runner import job_result

log = logging.getLogger(__name__)

MEASURES = ("bits_per_byte", "loss")
#: What a fit models by default: bits per byte (the loss of a set is the same ranking, in other units).
DEFAULT_MEASURES = ("bits_per_byte",)
DEFAULT_FOLDS = 5
RIDGE = 1e-3
STABLE_WITHIN = 0.05


# ---------------------------------------------------------------------------------------------------------
# The evidence: finished proxies with their weights and metrics.


@dataclass(frozen=True)
class Evidence:
    """The proxies a fit can use: weights (proxies x sources) and each metric's values."""

    sources: tuple[str, ...]
    proxies: tuple[str, ...]
    weights: np.ndarray
    values: dict[str, np.ndarray]  # metric name (set:measure) -> value per proxy
    set_kinds: dict[str, str]  # set -> heldout | external
    failed: tuple[str, ...]
    without_evaluation: tuple[str, ...]

    def members(self, metric: str) -> list[str]:
        """The per-set metrics an average is the mean of (itself for a set)."""
        name, measure = split_metric(metric)
        if name == "heldout_macro":
            return [f"{s}:{measure}" for s, kind in self.set_kinds.items() if kind == "heldout"]
        if name == "macro":
            return [f"{s}:{measure}" for s in self.set_kinds]
        return [metric]


def split_metric(metric: str) -> tuple[str, str]:
    name, _, measure = metric.rpartition(":")
    if measure not in MEASURES or not name:
        raise UsageError(f"metric {metric!r}: SET:MEASURE, MEASURE one of {', '.join(MEASURES)}")
    return name, measure


def collect(manifest: SwarmManifest, root: str, measures: Sequence[str] = MEASURES) -> Evidence:
    """Every proxy's result (each metric of `measures`); failed proxies and proxies without every
    evaluation set are left out (and named)."""
    sources = tuple(s.name for s in manifest.sources)
    set_kinds = {s.name: s.kind for s in manifest.evaluation}
    rows, ids, failed, missing = [], [], [], []
    results: list[ProxyResult] = []
    for job in manifest.proxies:
        result = job_result(root, job)
        if result is None:
            continue
        if result.status != "finished":
            failed.append(job.id)
            continue
        if any(name not in result.metrics for name in set_kinds):
            missing.append(job.id)
            continue
        ids.append(job.id)
        rows.append([job.weights.get(name, 0.0) for name in sources])
        results.append(result)
    values = {}
    for name in [*set_kinds, *(a for a in AVERAGES if a != "micro")]:
        for measure in measures:
            column = [r.metrics.get(name, {}).get(measure) for r in results]
            if column and all(v is not None for v in column):
                values[f"{name}:{measure}"] = np.array(column, dtype=float)
    return Evidence(
        sources,
        tuple(ids),
        np.array(rows, dtype=float).reshape(len(rows), len(sources)),
        values,
        set_kinds,
        tuple(failed),
        tuple(missing),
    )


# ---------------------------------------------------------------------------------------------------------
# The log-linear model.


@dataclass(frozen=True)
class LogLinear:
    floor: float
    intercept: float
    effects: np.ndarray

    def predict(self, weights: np.ndarray) -> np.ndarray:
        return self.floor + np.exp(self.intercept + np.atleast_2d(weights) @ self.effects)


def fit_loglinear(weights: np.ndarray, values: np.ndarray, ridge: float = RIDGE) -> LogLinear:
    """metric = floor + exp(intercept + effects . w), 0 <= floor < min(values), by bounded least squares."""
    n, k = weights.shape
    low = float(values.min())
    floor0 = 0.5 * low
    design = np.hstack([np.ones((n, 1)), weights])
    gap = np.log(np.maximum(values - floor0, 1e-12))
    start = np.linalg.lstsq(design.T @ design + ridge * np.eye(k + 1), design.T @ gap, rcond=None)[0]
    scale = float(np.mean(values))

    def residuals(params: np.ndarray) -> np.ndarray:
        floor, intercept, effects = params[0], params[1], params[2:]
        fitted = floor + np.exp(np.clip(intercept + weights @ effects, -50, 50))
        return np.concatenate([(fitted - values) / scale, np.sqrt(ridge) * effects])

    lower = np.full(k + 2, -np.inf)
    upper = np.full(k + 2, np.inf)
    lower[0], upper[0] = 0.0, max(low * (1 - 1e-6), 1e-12)
    x0 = np.concatenate([[min(floor0, upper[0] * 0.999)], start])
    solution = optimize.least_squares(residuals, x0, bounds=(lower, upper), method="trf")
    return LogLinear(float(solution.x[0]), float(solution.x[1]), solution.x[2:].copy())


@dataclass(frozen=True)
class Composed:
    """An average over sets, predicted as the mean of its sets' log-linear models."""

    parts: tuple[LogLinear, ...]

    def predict(self, weights: np.ndarray) -> np.ndarray:
        return np.mean([part.predict(weights) for part in self.parts], axis=0)


def fit_metric_loglinear(evidence: Evidence, metric: str, rows: np.ndarray) -> LogLinear | Composed:
    members = evidence.members(metric)
    models = tuple(fit_loglinear(evidence.weights[rows], evidence.values[m][rows]) for m in members)
    return models[0] if members == [metric] else Composed(models)


# ---------------------------------------------------------------------------------------------------------
# The Gaussian process.


@dataclass
class GaussianProcess:
    model: object

    def predict(self, weights: np.ndarray, return_std: bool = False):
        return self.model.predict(np.atleast_2d(weights), return_std=return_std)


def fit_gp(weights: np.ndarray, values: np.ndarray, seed: int = 0) -> GaussianProcess:
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.gaussian_process import GaussianProcessRegressor
    from sklearn.gaussian_process.kernels import ConstantKernel, Matern, WhiteKernel

    k = weights.shape[1]
    kernel = ConstantKernel(1.0, (1e-3, 1e3)) * Matern(
        length_scale=np.full(k, 0.5), length_scale_bounds=(1e-2, 1e2), nu=2.5
    ) + WhiteKernel(1e-2, (1e-6, 1.0))
    model = GaussianProcessRegressor(kernel, normalize_y=True, n_restarts_optimizer=2, random_state=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        model.fit(weights, values)
    return GaussianProcess(model)


# ---------------------------------------------------------------------------------------------------------
# Out-of-fold quality.


def folds_of(n: int, folds: int, seed: int) -> list[np.ndarray]:
    order = np.random.default_rng(seed).permutation(n)
    return [order[i::folds] for i in range(min(folds, n))]


def out_of_fold(
    n: int, folds: int, seed: int, fit_predict: Callable[[np.ndarray, np.ndarray], np.ndarray]
) -> np.ndarray:
    """Each row predicted by a model fitted on the other folds."""
    predicted = np.empty(n)
    for test in folds_of(n, folds, seed):
        train = np.setdiff1d(np.arange(n), test)
        predicted[test] = fit_predict(train, test)
    return predicted


def spearman(a: np.ndarray, b: np.ndarray) -> float | None:
    if len(a) < 3 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return None
    return float(stats.spearmanr(a, b).statistic)


def r_squared(measured: np.ndarray, predicted: np.ndarray) -> float | None:
    total = float(np.sum((measured - measured.mean()) ** 2))
    return None if total == 0 else 1.0 - float(np.sum((measured - predicted) ** 2)) / total


def learning_curve(
    evidence: Evidence, metric: str, folds: int, seed: int, repeats: int = 3
) -> list[CurvePoint]:
    """The log-linear model's out-of-fold Spearman on random subsets of growing size."""
    n, k = evidence.weights.shape
    sizes = sorted({*range(max(k + 2, 6), n, max(1, n // 8)), n})
    rng = np.random.default_rng(seed)
    points = []
    for size in sizes:
        if size > n:
            continue
        scores = []
        for _ in range(1 if size == n else repeats):
            subset = np.sort(rng.choice(n, size, replace=False)) if size < n else np.arange(n)
            values = evidence.values[metric][subset]

            def fit_predict(train: np.ndarray, test: np.ndarray, subset=subset) -> np.ndarray:
                return fit_metric_loglinear(evidence, metric, subset[train]).predict(
                    evidence.weights[subset[test]]
                )

            score = spearman(values, out_of_fold(size, folds, seed, fit_predict))
            if score is not None:
                scores.append(score)
        if scores:
            points.append(CurvePoint(proxies=size, spearman=round(float(np.mean(scores)), 6)))
    return points


def stable_at(points: Sequence[CurvePoint]) -> int | None:
    if not points:
        return None
    final = points[-1].spearman
    for i, point in enumerate(points):
        if all(abs(p.spearman - final) <= STABLE_WITHIN for p in points[i:]):
            return point.proxies
    return None


def fit_swarm(
    manifest: SwarmManifest,
    root: str,
    folds: int = DEFAULT_FOLDS,
    seed: int = 0,
    source_content: dict[str, str] | None = None,
    evidence_reused: Sequence[str] = (),
    measures: Sequence[str] = DEFAULT_MEASURES,
    progress: Callable[[str], None] = print,
) -> SwarmFit:
    """Fit every metric of the swarm's finished proxies (the SwarmFit record; `fit.json`)."""
    evidence = collect(manifest, root, measures)
    n, k = evidence.weights.shape
    notes = []
    if evidence.failed:
        notes.append(f"{len(evidence.failed)} proxies failed and are left out: {', '.join(evidence.failed)}")
    if evidence.without_evaluation:
        notes.append(
            f"{len(evidence.without_evaluation)} proxies lack an evaluation set and are left out: "
            + ", ".join(evidence.without_evaluation)
        )
    unfinished = len(manifest.proxies) - n - len(evidence.failed) - len(evidence.without_evaluation)
    if unfinished:
        notes.append(f"{unfinished} proxies have not run yet (tokenmill mixture run {root})")
    if n < k + 1:
        raise UsageError(
            f"{root}: {n} finished proxies with every evaluation set, fewer than the {k} sources + 1 a fit "
            f"needs{'; ' + '; '.join(notes) if notes else ''}"
        )
    if n < 2 * k:
        notes.append(f"only {n} proxies for {k} sources: the fit is loose below about {2 * k}; sample more")
    for note in notes:
        log.warning("%s", note)
    metrics = []
    for metric in evidence.values:
        measured = evidence.values[metric]
        everything = np.arange(n)
        loglinear = fit_metric_loglinear(evidence, metric, everything)
        oof_loglinear = out_of_fold(
            n,
            folds,
            seed,
            lambda train, test, metric=metric: fit_metric_loglinear(evidence, metric, train).predict(
                evidence.weights[test]
            ),
        )
        oof_gp = out_of_fold(
            n,
            folds,
            seed,
            lambda train, test, measured=measured: fit_gp(
                evidence.weights[train], measured[train], seed
            ).predict(evidence.weights[test]),
        )
        # The learning curve answers "is the swarm big enough" for what a mixture is judged by, the averages.
        is_average = split_metric(metric)[0] in AVERAGES
        curve = learning_curve(evidence, metric, folds, seed) if is_average else []
        record = _loglinear_record(loglinear, evidence.sources)
        quality = [
            ModelQuality(
                model="loglinear",
                spearman=spearman(measured, oof_loglinear),
                r2=r_squared(measured, oof_loglinear),
                folds=min(folds, n),
                predicted=[float(v) for v in oof_loglinear],
                learning_curve=curve,
                stable_at=stable_at(curve),
            ),
            ModelQuality(
                model="gp",
                spearman=spearman(measured, oof_gp),
                r2=r_squared(measured, oof_gp),
                folds=min(folds, n),
                predicted=[float(v) for v in oof_gp],
            ),
        ]
        name, measure = split_metric(metric)
        metrics.append(
            MetricFit(
                metric=metric,
                set=name,
                measure=measure,
                proxies=list(evidence.proxies),
                measured=[float(v) for v in measured],
                loglinear=record,
                quality=quality,
            )
        )
        progress(
            f"{metric}: out-of-fold Spearman log-linear {_fmt(quality[0].spearman)}, GP "
            f"{_fmt(quality[1].spearman)}; R^2 {_fmt(quality[0].r2)} / {_fmt(quality[1].r2)}"
        )
    return SwarmFit(
        format_version=1,
        swarm=manifest.name,
        sources=list(evidence.sources),
        source_content=source_content or {s.name: s.content for s in manifest.sources},
        evidence_reused=list(evidence_reused),
        proxies_finished=n,
        proxies_failed=list(evidence.failed),
        proxies_without_evaluation=list(evidence.without_evaluation),
        metrics=metrics,
        warnings=notes,
    )


def _loglinear_record(model: LogLinear | Composed, sources: Sequence[str]) -> LogLinearFit:
    """The fitted form; an average's is the mean of its parts' parameters (for the page's effects only:
    predictions use the parts)."""
    parts = model.parts if isinstance(model, Composed) else (model,)
    effects = np.mean([p.effects for p in parts], axis=0)
    return LogLinearFit(
        floor=float(np.mean([p.floor for p in parts])),
        intercept=float(np.mean([p.intercept for p in parts])),
        effects={name: float(e) for name, e in zip(sources, effects)},
    )


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def fit_path(root: str) -> str:
    from tokenmill.formats.swarm import FIT

    return storage.join(root, FIT)
