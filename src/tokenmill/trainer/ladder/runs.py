"""Reading trained rungs: each run's losses and cumulative FLOPs from runs/NAME/metrics.jsonl, its
evaluation records from eval.jsonl (when it has one), what its config.json says it was meant to train
(planned steps, model, tokens per step), and its metric at matched fractions of its planned steps: the
training loss smoothed, or an evaluation as it was recorded. `read_run` is the one reader of a run folder
here.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import ValidationError

from tokenmill import storage
from tokenmill.errors import FormatError
from tokenmill.formats.evals import EVAL, EvalRecord, read_eval
from tokenmill.formats.runs import CONFIG, METRICS, iter_metrics, read_run_record
from tokenmill.trainer.ladder.metric import Metric
from tokenmill.trainer.ladder.spec import LadderError
from tokenmill.trainer.model.flops import forecast_flops_per_token
from tokenmill.trainer.model.shape import ModelConfig

DEFAULT_FRACTIONS = (0.25, 0.5, 0.75, 1.0)
DEFAULT_WINDOW = 0.1  # of a run's planned steps
MIN_WINDOW_STEPS = 5


@dataclass
class RunCurve:
    """The losses of one trained run (one rung), with what its config.json says it was meant to train."""

    path: str
    name: str
    steps: np.ndarray
    loss: np.ndarray
    flops: np.ndarray
    planned_steps: int
    block_steps: int
    info: dict[str, Any] = field(default_factory=dict)
    # Marin's forecast compute C of one step (no head, full-span attention), from the run's model and
    # tokens per step; None when config.json does not say enough to price it.
    forecast_per_step: float | None = None
    evals: list[EvalRecord] = field(default_factory=list)  # eval.jsonl's records; [] without one

    def compute(self, step: int, convention: str = "trainer") -> float:
        """Compute spent up to and including `step`: the trainer's logged FLOPs or Marin's forecast C."""
        if convention == "forecast":
            if self.forecast_per_step is None:
                raise LadderError(f"{self.path}: its config.json does not give the model to price Marin's C")
            return self.forecast_per_step * (step + 1)
        return float(self.flops[np.searchsorted(self.steps, step)])

    def compute_after(self, trained: int, convention: str = "trainer") -> float:
        """Compute spent by `trained` steps (an evaluation's step counts steps trained, a metrics row's is
        the 0-based step): the row of step trained - 1 when it is logged, else that many steps at the
        run's FLOPs per step."""
        if convention == "forecast":
            return self.compute(trained - 1, convention)
        index = int(np.searchsorted(self.steps, trained - 1))
        if index < len(self.steps) and int(self.steps[index]) == trained - 1:
            return float(self.flops[index])
        return float(self.flops[-1]) / (int(self.steps[-1]) + 1) * trained


def _forecast_per_step(config: dict[str, Any]) -> float | None:
    """C of one training step of the run in config.json, or None (an old run, or a synthetic one)."""
    plan = config.get("plan") or {}
    # The run configuration's data section; runs of trainers before run configurations kept it as "train".
    data = config.get("data") or config.get("train") or {}
    sequence_length = plan.get("sequence_length") or data.get("sequence_length")
    tokens_per_step = plan.get("tokens_per_step") or (
        data.get("batch_size") * sequence_length if data.get("batch_size") and sequence_length else None
    )
    try:
        cfg = ModelConfig.model_validate(config.get("model") or {})
    except ValidationError:
        return None
    if not tokens_per_step:
        return None
    return float(forecast_flops_per_token(cfg, sequence_length or cfg.sequence_length) * tokens_per_step)


def read_run(path: str) -> RunCurve:
    """runs/NAME: metrics.jsonl (step, loss, cumulative flops) and config.json (planned steps, counts)."""
    path = path.rstrip("/") or path
    if not storage.exists(path):
        raise LadderError(f"{path}: no such run folder")
    metrics_path = storage.join(path, METRICS)
    config_path = storage.join(path, CONFIG)
    for file in (metrics_path, config_path):
        if not storage.exists(file):
            raise LadderError(f"{file}: no such file (is {path} a run folder written by `tokenmill train`?)")
    rows: dict[int, tuple[float, float]] = {}
    eval_path = storage.join(path, EVAL)
    try:
        evals = read_eval(eval_path) if storage.exists(eval_path) else []
        config = read_run_record(config_path).to_json()
        for number, row in iter_metrics(metrics_path):
            if row.loss is None or row.flops is None:
                raise LadderError(
                    f"{metrics_path}: line {number} is not a metrics row with step, loss and flops"
                )
            if math.isfinite(row.loss) and math.isfinite(row.flops):
                # A rerun after a resume logs a step again: the last one counts.
                rows[row.step] = (row.loss, row.flops)
    except FormatError as error:
        raise LadderError(str(error)) from error
    if not rows:
        raise LadderError(f"{metrics_path}: no metrics logged")
    plan = config.get("plan") or {}
    planned = plan.get("total_steps") or (config.get("schedule") or {}).get("total_steps")
    if not planned:
        raise LadderError(f"{config_path}: no planned steps (plan.total_steps or schedule.total_steps)")
    steps = np.array(sorted(rows), dtype=np.int64)
    params = config.get("params") or {}
    return RunCurve(
        path=path,
        name=os.path.basename(path) or path,
        steps=steps,
        loss=np.array([rows[s][0] for s in steps.tolist()]),
        flops=np.array([rows[s][1] for s in steps.tolist()]),
        planned_steps=int(planned),
        block_steps=int(plan.get("block_steps") or 1),
        info={
            "model": (config.get("model") or {}).get("name"),
            "total_params": params.get("total_params"),
            "active_params": params.get("active_params"),
            "flops_per_token": config.get("flops_per_token"),
            "tokens_per_step": plan.get("tokens_per_step"),
            "mixture": plan.get("name"),
        },
        forecast_per_step=_forecast_per_step(config),
        evals=evals,
    )


@dataclass(frozen=True)
class Point:
    """A run's smoothed loss at a fraction of its planned steps, and the compute spent to get there."""

    run: str
    fraction: float
    step: int
    flops: float
    loss: float
    loss_se: float  # standard error of the smoothed loss, from the scatter in its window
    window: int  # steps it was smoothed over


def smoothed_loss(steps: np.ndarray, loss: np.ndarray, at: int, window: int) -> tuple[float, float, int]:
    """The loss at step `at` from a straight line fitted to the last `window` logged steps up to it.

    A trailing mean would lag behind a falling curve (by half a window); the line's value at its end does
    not, for curves that are straight over the window. Returns (loss, standard error, points used).
    """
    mask = (steps <= at) & (steps > at - window)
    x, y = steps[mask].astype(float), loss[mask]
    n = len(x)
    if n < 3:
        return float(y[-1]), 0.0, n
    xm = x.mean()
    sxx = float(((x - xm) ** 2).sum())
    slope = float(((x - xm) * (y - y.mean())).sum()) / sxx
    value = float(y.mean() + slope * (at - xm))
    resid = y - (y.mean() + slope * (x - xm))
    s2 = float((resid**2).sum()) / (n - 2)
    se = math.sqrt(s2 * (1 / n + (at - xm) ** 2 / sxx))
    return value, se, n


def matched_points(
    run: RunCurve,
    fractions: tuple[float, ...] = DEFAULT_FRACTIONS,
    window: float = DEFAULT_WINDOW,
    convention: str = "trainer",
    metric: Metric | None = None,
) -> tuple[list[Point], list[str]]:
    """The run's points at each fraction of its planned steps; a warning for each fraction not reached.

    convention: the compute of a point, "trainer" (the logged FLOPs) or "forecast" (Marin's C).
    metric: the training loss (None), smoothed over `window`, or an evaluation metric (`evaluated_points`).
    """
    if metric is not None and metric.evaluated:
        return evaluated_points(run, metric, fractions, window, convention)
    width = max(MIN_WINDOW_STEPS, run.block_steps, round(window * run.planned_steps))
    points, warnings = [], []
    logged = set(run.steps.tolist())
    for fraction in fractions:
        at = max(1, round(fraction * run.planned_steps)) - 1  # the 0-based step that completes the fraction
        if at not in logged:
            warnings.append(
                f"{run.path}: step {at} ({fraction:.0%} of {run.planned_steps} planned) is not logged "
                f"(last logged step {int(run.steps[-1])}); that point is left out"
            )
            continue
        loss, se, used = smoothed_loss(run.steps, run.loss, at, width)
        points.append(Point(run.path, fraction, at, run.compute(at, convention), loss, se, used))
    return points, warnings


def evaluated_points(
    run: RunCurve,
    metric: Metric,
    fractions: tuple[float, ...],
    window: float,
    convention: str = "trainer",
) -> tuple[list[Point], list[str]]:
    """The run's evaluations of `metric` at each fraction of its planned steps: the evaluation nearest at
    or before the step that completes the fraction, `round(f x planned)` steps trained, if it lies within
    `window` of the planned steps before it; a warning for each fraction without one.

    The value is taken as recorded, not smoothed: an evaluation scores the same fixed batches every time,
    so it carries no step-to-step sampling noise to smooth away (its standard error is taken as 0; the
    bootstrap's noise is then the misfit of the law). A run that evaluated less often than `window` (Marin:
    every 5%) has no point at the fractions between its evaluations, and one evaluation never stands for
    two fractions.
    """
    values = [(step, value) for step, value in metric.values(run.evals) if step >= 1]
    width = max(1, round(window * run.planned_steps))
    points, warnings, used = [], [], set()
    last = values[-1][0] if values else None
    for fraction in fractions:
        at = max(1, round(fraction * run.planned_steps))
        where = f"step {at} ({fraction:.0%} of {run.planned_steps} planned)"
        before = [(step, value) for step, value in values if step <= at]
        if last is None or at > last:
            warnings.append(
                f"{run.path}: {where} has no evaluation of {metric.name} (last evaluation "
                + (f"at step {last})" if last is not None else "none)")
                + "; that point is left out"
            )
            continue
        step, value = before[-1] if before else (None, None)
        if step is None or at - step >= width or step in used:
            warnings.append(
                f"{run.path}: no evaluation of {metric.name} within {window:.0%} of the planned steps before "
                f"{where}"
                + (f", the last is at step {step}" if step is not None else "")
                + ": the run evaluated less often than that; that point is left out"
            )
            continue
        used.add(step)
        points.append(Point(run.path, fraction, step, run.compute_after(step, convention), value, 0.0, 1))
    return points, warnings
