"""Scaling ladders: lay out rungs from a model family, fit loss against compute, forecast the big run.

  spec  configs/ladders/*.yaml: the rungs' model shapes, the target, the big mixture, the tokens rule
  plan  each rung's tokens, steps, compute, optimizer and mixture slice (`tokenmill ladder plan`)
  metric  which logged metric a fit fits (training loss, or an evaluation of eval.jsonl), by name
  runs  the trained rungs' metrics.jsonl, eval.jsonl and config.json, their metric at matched fractions
  fit   L(C) = E + A*C^-alpha over the rungs and the target's forecast with a band (`tokenmill ladder fit`)

docs/ladder.md explains the choices. Nothing here imports JAX.
"""

from tokenmill.trainer.ladder.fit import (
    MARIN_ASYMPTOTE,
    MARIN_FRACTIONS,
    MARIN_WINDOW,
    PROCEDURES,
    Fit,
    fit_fixed_asymptote,
    fit_ladder,
    fit_power_law,
)
from tokenmill.trainer.ladder.metric import Metric, choose_metric, parse_metric
from tokenmill.trainer.ladder.plan import plan_ladder, target_from_model, target_of
from tokenmill.trainer.ladder.runs import (
    DEFAULT_FRACTIONS,
    DEFAULT_WINDOW,
    Point,
    RunCurve,
    evaluated_points,
    matched_points,
    read_run,
    smoothed_loss,
)
from tokenmill.trainer.ladder.spec import FORMAT_VERSION, Ladder, LadderError, LadderSpec, load_ladder

__all__ = [
    "DEFAULT_FRACTIONS",
    "DEFAULT_WINDOW",
    "FORMAT_VERSION",
    "MARIN_ASYMPTOTE",
    "MARIN_FRACTIONS",
    "MARIN_WINDOW",
    "PROCEDURES",
    "Fit",
    "Ladder",
    "LadderError",
    "LadderSpec",
    "Metric",
    "Point",
    "RunCurve",
    "choose_metric",
    "evaluated_points",
    "fit_fixed_asymptote",
    "fit_ladder",
    "fit_power_law",
    "load_ladder",
    "matched_points",
    "parse_metric",
    "plan_ladder",
    "read_run",
    "smoothed_loss",
    "target_from_model",
    "target_of",
]
