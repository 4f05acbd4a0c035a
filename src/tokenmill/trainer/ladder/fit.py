"""Fitting a ladder: loss against compute over the trained rungs, and the forecast of the target's loss.

Two procedures:

- "shared" (the default): L(C) = E + A_f * C^(-alpha) with the irreducible loss E and the exponent alpha
  shared by every fraction f and one coefficient A_f per fraction, C the trainer's FLOPs;
- "marin" (the reference run's own forecast): L = E + A_f * C^(-alpha_f) with E fixed (1.5) and A_f and
  alpha_f fitted separately at every 5% of training, a straight line in log(L - E) against log C, C being
  Marin's forecast compute (no head, full-span attention).

Both fit any logged metric (tokenmill.trainer.ladder.metric): by default the held-out macro bits per
byte (Marin's: the held-out macro loss) where the runs evaluate, the training loss otherwise; ladder.json
names it. Both forecast the target's value at the same fractions of its compute, with a band from a
parametric bootstrap. docs/ladder.md explains the choices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenmill.trainer.ladder.metric import TRAINING_LOSS, Metric, choose_metric
from tokenmill.trainer.ladder.runs import DEFAULT_FRACTIONS, DEFAULT_WINDOW, Point, RunCurve, matched_points
from tokenmill.trainer.ladder.spec import FORMAT_VERSION, LadderError

# Marin's procedure (experiments/grug/moe_hero_ep/plot_scaling_ladder.py): every 5%, asymptote 1.5.
MARIN_FRACTIONS = tuple(round(0.05 * i, 2) for i in range(1, 21))
MARIN_WINDOW = 0.05
MARIN_ASYMPTOTE = 1.5
PROCEDURES = ("shared", "marin")
CURVE_POINTS = 48


@dataclass
class Fit:
    """L = E + exp(a[f] - alpha * (ln C - x0)), i.e. A_f = exp(a[f]) * exp(x0)^alpha."""

    E: float
    alpha: float
    a: np.ndarray
    x0: float
    rss: float
    converged: bool

    def predict(self, flops: np.ndarray | float, group: np.ndarray | int) -> np.ndarray:
        x = np.log(np.asarray(flops, dtype=float)) - self.x0
        return self.E + np.exp(self.a[group] - self.alpha * x)

    def coefficient(self, group: int) -> float:
        """A_f in L = E + A_f * C^-alpha (C in FLOPs)."""
        return float(math.exp(self.a[group] + self.alpha * self.x0))


_E_GRID = np.linspace(0.0, 0.995, 40)
_ALPHA_GRID = np.geomspace(0.005, 3.0, 60)
ALPHA_BOUNDS = (1e-4, 5.0)


def _start(x: np.ndarray, y: np.ndarray, onehot: np.ndarray) -> np.ndarray:
    """The best (E, alpha) on a grid, each A_f solved in closed form (for fixed E and alpha it is linear)."""
    es = float(y.min()) * _E_GRID
    z = np.exp(-_ALPHA_GRID[:, None] * x[None, :])  # [alpha, point]
    r = y[None, :] - es[:, None]  # [E, point], >= 0
    num = np.einsum("ep,ap,pf->eaf", r, z, onehot)
    den = np.einsum("ap,pf->af", z * z, onehot)
    coef = np.maximum(num / den[None], 1e-300)
    pred = es[:, None, None] + np.einsum("eaf,ap,pf->eap", coef, z, onehot)
    rss = ((pred - y) ** 2).sum(-1)
    e, a = np.unravel_index(int(np.argmin(rss)), rss.shape)
    return np.concatenate([[es[e], _ALPHA_GRID[a]], np.log(coef[e, a])])


def fit_power_law(flops: np.ndarray, loss: np.ndarray, group: np.ndarray, groups: int) -> Fit:
    """Least squares of L = E + A_g * C^-alpha over points in `groups` groups, E in [0, min L], alpha > 0.

    Parameterised as E + exp(a_g - alpha * (ln C - x0)) with x0 the mean ln C, so that the parameters are of
    order one whatever the units of C. A grid over (E, alpha) gives the start (for fixed E and alpha the A_g
    are linear, solved exactly), scipy's bounded trust-region least squares polishes it.
    """
    from scipy.optimize import least_squares

    flops, loss = np.asarray(flops, dtype=float), np.asarray(loss, dtype=float)
    x0 = float(np.log(flops).mean())
    x = np.log(flops) - x0
    onehot = np.zeros((len(x), groups))
    onehot[np.arange(len(x)), group] = 1.0
    theta0 = _start(x, loss, onehot)
    upper_e = max(float(loss.min()), 1e-9)
    lower = np.concatenate([[0.0, ALPHA_BOUNDS[0]], np.full(groups, -80.0)])
    upper = np.concatenate([[upper_e, ALPHA_BOUNDS[1]], np.full(groups, 80.0)])
    theta0 = np.clip(theta0, lower, upper)

    def residuals(theta: np.ndarray) -> np.ndarray:
        return theta[0] + np.exp(theta[2:][group] - theta[1] * x) - loss

    def jacobian(theta: np.ndarray) -> np.ndarray:
        term = np.exp(theta[2:][group] - theta[1] * x)
        jac = np.zeros((len(x), 2 + groups))
        jac[:, 0] = 1.0
        jac[:, 1] = -x * term
        jac[np.arange(len(x)), 2 + group] = term
        return jac

    result = least_squares(residuals, theta0, jac=jacobian, bounds=(lower, upper), method="trf", max_nfev=400)
    theta = result.x if result.cost <= 0.5 * float((residuals(theta0) ** 2).sum()) else theta0
    rss = float((residuals(theta) ** 2).sum())
    return Fit(float(theta[0]), float(theta[1]), np.array(theta[2:]), x0, rss, bool(result.success))


def _run_record(run: RunCurve, final_flops: float) -> dict[str, Any]:
    """A run as ladder.json lists it, with its final compute in the fit's convention."""
    return {
        "path": run.path,
        "name": run.name,
        "planned_steps": run.planned_steps,
        "last_step": int(run.steps[-1]),
        "final_flops": final_flops,
        **run.info,
    }


def _point_record(point: Point, fitted: float) -> dict[str, Any]:
    """A matched (run, fraction) point as ladder.json lists it, with the law's value there."""
    return {
        "run": point.run,
        "fraction": point.fraction,
        "step": point.step,
        "flops": point.flops,
        "loss": point.loss,
        "loss_se": point.loss_se,
        "window": point.window,
        "fitted": fitted,
    }


def _percentiles(values: np.ndarray, level: float) -> tuple[np.ndarray, np.ndarray]:
    tail = (1 - level) / 2 * 100
    return np.percentile(values, tail, axis=0), np.percentile(values, 100 - tail, axis=0)


def fit_ladder(
    runs: list[RunCurve],
    target: dict[str, Any],
    fractions: tuple[float, ...] | None = None,
    window: float | None = None,
    bootstrap: int = 400,
    seed: int = 0,
    level: float = 0.95,
    target_run: RunCurve | None = None,
    procedure: str = "shared",
    asymptote: float = MARIN_ASYMPTOTE,
    metric: str | None = None,
) -> dict[str, Any]:
    """Fit the ladder and forecast the target: the ladder.json document (docs/ladder.md).

    procedure: "shared" (E and alpha shared by all fractions, fitted) or "marin" (E fixed at `asymptote`,
    A and alpha fitted separately at each fraction). fractions and window default to the procedure's.
    metric: the logged metric to fit, by name (tokenmill.trainer.ladder.metric); None: the procedure's
    held-out macro metric when every run has it, else the training loss.
    """
    if procedure not in PROCEDURES:
        raise LadderError(f"unknown procedure {procedure!r} ({' or '.join(PROCEDURES)})")
    chosen, why = choose_metric(metric, procedure, {run.path: run.evals for run in runs})
    if metric is None and chosen.evaluated:
        chosen, why = _dense_enough(runs, chosen, why, procedure, fractions, window)
    result = _fit(
        runs, target, fractions, window, bootstrap, seed, level, target_run, procedure, asymptote, chosen
    )
    result["metric"] = chosen.to_json(why)
    return result


def _dense_enough(
    runs: list[RunCurve],
    chosen: Metric,
    why: str,
    procedure: str,
    fractions: tuple[float, ...] | None,
    window: float | None,
) -> tuple[Metric, str]:
    """The default evaluation metric if every run evaluated it at every fraction where its training loss
    has a point, else the training loss, saying which runs evaluated too rarely (a fit of the end points
    alone would be a different fit from the one asked for)."""
    marin = procedure == "marin"
    fractions = fractions or (MARIN_FRACTIONS if marin else DEFAULT_FRACTIONS)
    window = window if window is not None else (MARIN_WINDOW if marin else DEFAULT_WINDOW)
    if not all(0 < f <= 1 for f in fractions):
        return chosen, why  # the fit says what is wrong with them
    sparse = [
        run.path
        for run in runs
        if len(matched_points(run, fractions, window, metric=chosen)[0])
        < len(matched_points(run, fractions, window)[0])
    ]
    if not sparse:
        return chosen, why
    return Metric(TRAINING_LOSS), (
        f"default: {', '.join(sparse)} evaluated {chosen.name} less often than the fractions need (within "
        f"{window:.0%} of the planned steps before each), so every run is fitted on training loss (give "
        f"--metric {chosen.name} to fit the evaluations there are)"
    )


def _fit(  # fit_ladder's work, once the metric is chosen
    runs: list[RunCurve],
    target: dict[str, Any],
    fractions: tuple[float, ...] | None,
    window: float | None,
    bootstrap: int,
    seed: int,
    level: float,
    target_run: RunCurve | None,
    procedure: str,
    asymptote: float,
    metric: Metric,
) -> dict[str, Any]:
    marin = procedure == "marin"
    fractions = fractions or (MARIN_FRACTIONS if marin else DEFAULT_FRACTIONS)
    window = window if window is not None else (MARIN_WINDOW if marin else DEFAULT_WINDOW)
    if len(runs) < 3:
        raise LadderError(
            f"a ladder fit needs at least 3 runs, got {len(runs)}"
            + (f" ({', '.join(r.path for r in runs)})" if runs else "")
        )
    if not 0 < level < 1:
        raise LadderError(f"--level must be between 0 and 1, not {level}")
    bad = [f for f in fractions if not 0 < f <= 1]
    if bad or not fractions:
        raise LadderError(f"fractions must be in (0, 1], got {', '.join(map(str, fractions)) or 'none'}")
    fractions = tuple(sorted(set(fractions)))
    if marin:
        return _fit_marin(
            runs, target, fractions, window, bootstrap, seed, level, target_run, asymptote, metric
        )
    points: list[Point] = []
    warnings: list[str] = []
    for run in runs:
        got, missing = matched_points(run, fractions, window, metric=metric)
        points += got
        warnings += missing
    used = [f for f in fractions if any(p.fraction == f for p in points)]
    params = 2 + len(used)
    if len({p.run for p in points}) < 3 or len(points) < params:
        raise LadderError(
            f"too few points to fit: {len(points)} from {len({p.run for p in points})} runs "
            f"for {params} parameters (E, alpha and one A per fraction); train the rungs further"
        )
    if used[-1] != fractions[-1]:
        warnings.append(
            f"no run reached {fractions[-1]:.0%} of its planned steps: the forecast stops at {used[-1]:.0%}"
        )
    index = {f: i for i, f in enumerate(used)}
    c = np.array([p.flops for p in points])
    y = np.array([p.loss for p in points])
    se = np.array([p.loss_se for p in points])
    g = np.array([index[p.fraction] for p in points])
    fit = fit_power_law(c, y, g, len(used))
    fitted = fit.predict(c, g)
    dof = len(points) - params
    # Noise for the parametric bootstrap: each point's own standard error, plus the scatter around the fit
    # beyond it (misfit) when there are spare degrees of freedom to measure it.
    excess = max(0.0, fit.rss / dof - float(np.mean(se**2))) if dof > 0 else 0.0
    sigma = np.sqrt(se**2 + excess)
    if dof == 0:
        warnings.append(
            "the fit is exactly determined (as many points as parameters): the band carries the noise of "
            "the smoothed losses only, not the misfit of the law"
        )

    target_flops = float(target["flops"])
    forecast_c = np.array([f * target_flops for f in used])
    forecast_g = np.arange(len(used))
    curve_c = np.geomspace(float(c.min()), max(target_flops, float(c.max())), CURVE_POINTS)
    final = len(used) - 1
    central = fit.predict(forecast_c, forecast_g)
    central_curve = fit.predict(curve_c, np.full(CURVE_POINTS, final))

    rng = np.random.default_rng(seed)
    samples, curves, params_b, failed = [], [], [], 0
    for _ in range(bootstrap):
        yb = fitted + sigma * rng.standard_normal(len(y))
        try:
            fb = fit_power_law(c, yb, g, len(used))
        except (ValueError, FloatingPointError):
            failed += 1
            continue
        predicted = fb.predict(forecast_c, forecast_g)
        if not np.all(np.isfinite(predicted)):
            failed += 1
            continue
        samples.append(predicted)
        curves.append(fb.predict(curve_c, np.full(CURVE_POINTS, final)))
        params_b.append((fb.E, fb.alpha, fb.coefficient(final)))
    if samples:
        low, high = _percentiles(np.array(samples), level)
        curve_low, curve_high = _percentiles(np.array(curves), level)
        p_low, p_high = _percentiles(np.array(params_b), level)
    else:
        low, high, curve_low, curve_high = central, central, central_curve, central_curve
        p_low = p_high = np.array([fit.E, fit.alpha, fit.coefficient(final)])

    result: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "procedure": "shared",
        "compute": "trainer",
        "law": "L(C) = E + A_f * C^-alpha; E and alpha shared, one A_f per fraction of training",
        "fractions": list(used),
        "window": window,
        "runs": [_run_record(run, float(run.flops[-1])) for run in runs],
        "points": [_point_record(p, float(fitted[i])) for i, p in enumerate(points)],
        "fit": {
            "E": fit.E,
            "alpha": fit.alpha,
            "A": {str(f): fit.coefficient(i) for f, i in index.items()},
            "E_band": [float(p_low[0]), float(p_high[0])],
            "alpha_band": [float(p_low[1]), float(p_high[1])],
            "A_final_band": [float(p_low[2]), float(p_high[2])],
            "rss": fit.rss,
            "points": len(points),
            "parameters": params,
            "dof": dof,
            "residual_sd": math.sqrt(fit.rss / dof) if dof > 0 else None,
            "converged": fit.converged,
        },
        "band": {
            "method": "parametric bootstrap: refit on fitted values plus Gaussian noise of each point's "
            "standard error and the excess residual variance; percentile interval",
            "level": level,
            "replicates": bootstrap,
            "failed": failed,
            "seed": seed,
            "noise_sd": [float(s) for s in sigma],
            "excess_sd": math.sqrt(excess),
        },
        "target": dict(target),
        "forecast": [
            {
                "fraction": f,
                "flops": float(forecast_c[i]),
                "loss": float(central[i]),
                "low": float(low[i]),
                "high": float(high[i]),
            }
            for i, f in enumerate(used)
        ],
        "curve": [
            {
                "flops": float(cc),
                "loss": float(central_curve[i]),
                "low": float(curve_low[i]),
                "high": float(curve_high[i]),
            }
            for i, cc in enumerate(curve_c)
        ],
        "warnings": warnings,
    }
    result["final"] = dict(result["forecast"][-1])
    if target_run is not None:
        actual, missing = matched_points(target_run, tuple(used), window, metric=metric)
        result["target"]["run"] = target_run.path
        result["actual"] = [
            {"fraction": p.fraction, "step": p.step, "flops": p.flops, "loss": p.loss, "loss_se": p.loss_se}
            for p in actual
        ]
        result["warnings"] += [f"target run: {message}" for message in missing]
        run_flops = float(target_run.flops[0]) / (int(target_run.steps[0]) + 1) * target_run.planned_steps
        if abs(run_flops / target_flops - 1) > 0.01:
            result["warnings"].append(
                f"target run {target_run.path} plans {run_flops:.3e} FLOPs, the target {target_flops:.3e}"
            )
    return result


# ---------------------------------------------------------------------------------------------------------
# Marin's procedure


def fit_fixed_asymptote(compute: np.ndarray, loss: np.ndarray, asymptote: float) -> tuple[float, float]:
    """A and alpha of L = E + A * C^-alpha for a given E: least squares of log(L - E) on log C."""
    slope, intercept = np.polyfit(np.log(compute), np.log(loss - asymptote), 1)
    return float(math.exp(intercept)), float(-slope)


def _fit_marin(
    runs: list[RunCurve],
    target: dict[str, Any],
    fractions: tuple[float, ...],
    window: float,
    bootstrap: int,
    seed: int,
    level: float,
    target_run: RunCurve | None,
    asymptote: float,
    metric: Metric,
) -> dict[str, Any]:
    """Marin's forecast (plot_scaling_ladder.py): at every fraction f, L = E + A_f * C^-alpha_f through the
    rungs' points with E fixed, C Marin's forecast compute; the target's loss at f is the law at f x its C.

    The band is a parametric bootstrap like the shared procedure's: each fraction refitted on its fitted
    losses plus Gaussian noise of each point's standard error and the fraction's excess residual variance.
    """
    warnings: list[str] = []
    priced = all(run.forecast_per_step is not None for run in runs)
    convention = "forecast" if priced else "trainer"
    if not priced:
        unpriced = ", ".join(run.path for run in runs if run.forecast_per_step is None)
        warnings.append(
            f"no model to price Marin's compute in {unpriced}: the fit uses the trainer's FLOPs instead"
        )
    if metric.measure != "loss" and asymptote == MARIN_ASYMPTOTE:
        warnings.append(
            f"the fixed asymptote {asymptote:g} is Marin's, a loss in nats; {metric.label} is on another "
            "scale (give --asymptote in its units)"
        )
    points: list[Point] = []
    for run in runs:
        got, missing = matched_points(run, fractions, window, convention, metric)
        points += got
        warnings += missing
    low_points = [p for p in points if p.loss <= asymptote]
    for p in low_points:
        warnings.append(
            f"{p.run}: {metric.label} {p.loss:.4f} at {p.fraction:.0%} is not above the asymptote "
            f"{asymptote:g}; that point is left out"
        )
    points = [p for p in points if p.loss > asymptote]
    by_fraction = {f: [p for p in points if p.fraction == f] for f in fractions}
    used = [f for f in fractions if len({p.run for p in by_fraction[f]}) >= 2]
    for f in fractions:
        if f not in used:
            warnings.append(f"fewer than 2 runs have a point at {f:.0%}: no law there")
    if not used:
        why = "train the rungs further"
        if low_points:
            why = (
                f"{len(low_points)} points of {metric.label} are not above the asymptote {asymptote:g} "
                "(give --asymptote below them" + (", or fit a loss" if metric.measure != "loss" else "") + ")"
            )
        raise LadderError(f"too few points to fit: no fraction has points from 2 runs; {why}")
    if used[-1] != fractions[-1]:
        warnings.append(f"the forecast stops at {used[-1]:.0%}: no law at {fractions[-1]:.0%}")

    if convention == "forecast" and target.get("forecast_compute") is not None:
        target_compute = float(target["forecast_compute"])
    else:
        target_compute = float(target["flops"])
    rng = np.random.default_rng(seed)
    laws: dict[float, tuple[float, float]] = {}
    samples: dict[float, list[tuple[float, float]]] = {}
    fitted_of: dict[Point, float] = {}
    noise: dict[Point, float] = {}
    rss_total, dof_total, failed = 0.0, 0, 0
    for f in used:
        group = by_fraction[f]
        c = np.array([p.flops for p in group])
        y = np.array([p.loss for p in group])
        se = np.array([p.loss_se for p in group])
        a, alpha = fit_fixed_asymptote(c, y, asymptote)
        laws[f] = (a, alpha)
        fitted = asymptote + a * c**-alpha
        rss = float(((y - fitted) ** 2).sum())
        dof = len(group) - 2
        rss_total += rss
        dof_total += dof
        excess = max(0.0, rss / dof - float(np.mean(se**2))) if dof > 0 else 0.0
        sigma = np.sqrt(se**2 + excess)
        for p, value, sd in zip(group, fitted, sigma, strict=True):
            fitted_of[p], noise[p] = float(value), float(sd)
        samples[f] = []
        for _ in range(bootstrap):
            yb = fitted + sigma * rng.standard_normal(len(y))
            if np.any(yb <= asymptote):
                failed += 1
                continue
            samples[f].append(fit_fixed_asymptote(c, yb, asymptote))

    def law(f: float, compute: np.ndarray | float, a: float | None = None, alpha: float | None = None):
        a_f, alpha_f = laws[f]
        return asymptote + (a_f if a is None else a) * np.asarray(compute) ** -(
            alpha_f if alpha is None else alpha
        )

    forecast = []
    for f in used:
        compute = f * target_compute
        replicas = np.array([law(f, compute, a, alpha) for a, alpha in samples[f]])
        low, high = _percentiles(replicas, level) if len(replicas) else (law(f, compute), law(f, compute))
        forecast.append(
            {
                "fraction": f,
                "flops": compute,
                "loss": float(law(f, compute)),
                "low": float(low),
                "high": float(high),
            }
        )
    final = used[-1]
    curve_c = np.geomspace(
        min(p.flops for p in points), max(target_compute, max(p.flops for p in points)), CURVE_POINTS
    )
    central_curve = law(final, curve_c)
    if samples[final]:
        curves = np.array([law(final, curve_c, a, alpha) for a, alpha in samples[final]])
        curve_low, curve_high = _percentiles(curves, level)
        params = np.array(samples[final])
        (a_low, alpha_low), (a_high, alpha_high) = _percentiles(params, level)
    else:
        curve_low = curve_high = central_curve
        a_low = a_high = laws[final][0]
        alpha_low = alpha_high = laws[final][1]
    if dof_total == 0:
        warnings.append(
            "every fraction's law is exactly determined (2 runs): the band carries the noise of the smoothed "
            "losses only, not the misfit of the law"
        )
    target_record = dict(target)
    target_record["trainer_flops"] = target.get("flops")
    target_record["flops"] = target_compute
    result: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "procedure": "marin",
        "compute": convention,
        "law": f"L(C) = {asymptote:g} + A_f * C^-alpha_f; asymptote fixed, A_f and alpha_f fitted separately "
        "at each fraction of training (log-log least squares)",
        "fractions": list(used),
        "window": window,
        "runs": [_run_record(run, run.compute(int(run.steps[-1]), convention)) for run in runs],
        "points": [_point_record(p, fitted_of[p]) for p in points if p.fraction in laws],
        "fit": {
            "E": asymptote,
            "E_fixed": True,
            "alpha": laws[final][1],
            "alphas": {str(f): laws[f][1] for f in used},
            "A": {str(f): laws[f][0] for f in used},
            "E_band": [asymptote, asymptote],
            "alpha_band": [float(alpha_low), float(alpha_high)],
            "A_final_band": [float(a_low), float(a_high)],
            "rss": rss_total,
            "points": sum(len(by_fraction[f]) for f in used),
            "parameters": 2 * len(used),
            "dof": dof_total,
            "residual_sd": math.sqrt(rss_total / dof_total) if dof_total > 0 else None,
            "converged": True,
        },
        "band": {
            "method": "parametric bootstrap per fraction: refit on fitted values plus Gaussian noise of each "
            "point's standard error and the fraction's excess residual variance; percentile interval",
            "level": level,
            "replicates": bootstrap * len(used),
            "failed": failed,
            "seed": seed,
            "noise_sd": [noise[p] for p in points if p in noise],
        },
        "target": target_record,
        "forecast": forecast,
        "curve": [
            {
                "flops": float(cc),
                "loss": float(central_curve[i]),
                "low": float(curve_low[i]),
                "high": float(curve_high[i]),
            }
            for i, cc in enumerate(curve_c)
        ],
        "warnings": warnings,
    }
    result["final"] = dict(forecast[-1])
    if target_run is not None:
        actual, missing = matched_points(target_run, tuple(used), window, convention, metric)
        result["target"]["run"] = target_run.path
        result["actual"] = [
            {"fraction": p.fraction, "step": p.step, "flops": p.flops, "loss": p.loss, "loss_se": p.loss_se}
            for p in actual
        ]
        result["warnings"] += [f"target run: {message}" for message in missing]
    return result
