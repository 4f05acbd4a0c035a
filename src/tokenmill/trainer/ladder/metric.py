"""Which logged metric a ladder fit fits, by name (docs/ladder.md, "Metric").

  loss                               the training loss of metrics.jsonl, smoothed at each fraction
  eval:<set>:<measure>[:<dispatch>]  an evaluation record of eval.jsonl (tokenmill.formats.evals):
                                     <set> a set's name (heldout/domain=web, paloma-c4) or an average's
                                     (heldout_macro, macro, micro); <measure> loss or bits_per_byte;
                                     <dispatch> dropless (the default) or capacity

Without --metric a fit takes the held-out macro bits per byte (the shared procedure) or the held-out macro
loss (Marin's, whose fixed asymptote is a loss in nats) when every run has those records, and the training
loss otherwise; `choose_metric` says which and why, and ladder.json records it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenmill.formats.evals import AVERAGES, EVAL, EvalRecord
from tokenmill.formats.runs import METRICS
from tokenmill.trainer.ladder.spec import LadderError

TRAINING_LOSS = "loss"
MEASURES = ("loss", "bits_per_byte")
DISPATCHES = ("dropless", "capacity")
DEFAULT_EVAL = {"shared": "eval:heldout_macro:bits_per_byte", "marin": "eval:heldout_macro:loss"}
SYNTAX = "loss, or eval:<set>:<loss|bits_per_byte>[:dropless|capacity], e.g. eval:heldout_macro:bits_per_byte"
AVERAGE_LABELS = {"heldout_macro": "held-out macro", "macro": "macro", "micro": "micro"}
MEASURE_LABELS = {"loss": "loss", "bits_per_byte": "bits per byte"}


@dataclass(frozen=True)
class Metric:
    """A logged metric: the training loss, or one measure of one evaluation set (or average) and dispatch."""

    name: str  # as written back: `loss` or `eval:<set>:<measure>` (`:capacity` only when not dropless)
    set: str | None = None
    measure: str = "loss"
    dispatch: str | None = None

    @property
    def evaluated(self) -> bool:
        return self.set is not None

    @property
    def label(self) -> str:
        """The metric in words: "training loss", "held-out macro bits per byte", "paloma-c4 loss"."""
        if not self.evaluated:
            return "training loss"
        what = AVERAGE_LABELS.get(self.set or "", self.set)
        return f"{what} {MEASURE_LABELS[self.measure]}" + (
            " (capacity)" if self.dispatch == "capacity" else ""
        )

    def values(self, records: Sequence[EvalRecord]) -> list[tuple[int, float]]:
        """(step, value) of this metric in a run's evaluation records, in step order."""
        return sorted(
            (r.step, value)
            for r in records
            if r.set == self.set
            and r.dispatch == self.dispatch
            and (value := r.metric(self.measure)) is not None
        )

    def to_json(self, chosen: str) -> dict[str, Any]:
        """ladder.json's `metric`: what the fit fitted, where it was read, and why it was chosen."""
        return {
            "name": self.name,
            "label": self.label,
            "source": EVAL if self.evaluated else METRICS,
            "set": self.set,
            "measure": self.measure,
            "dispatch": self.dispatch,
            "chosen": chosen,
        }


def parse_metric(text: str) -> Metric:
    """A metric from its name (module docstring); LadderError says the syntax."""
    text = text.strip()
    if text == TRAINING_LOSS:
        return Metric(TRAINING_LOSS)
    if not text.startswith("eval:"):
        raise LadderError(f"--metric {text!r}: not a metric name ({SYNTAX})")
    parts = text.removeprefix("eval:").split(":")
    dispatch = "dropless"
    if len(parts) >= 3 and parts[-1] in DISPATCHES:
        dispatch = parts.pop()
    if len(parts) < 2 or parts[-1] not in MEASURES:
        raise LadderError(f"--metric {text!r}: the measure is loss or bits_per_byte ({SYNTAX})")
    measure = parts.pop()
    name = ":".join(parts)  # a set's name may itself hold a colon
    if not name:
        raise LadderError(f"--metric {text!r}: no evaluation set named ({SYNTAX})")
    canonical = f"eval:{name}:{measure}" + (f":{dispatch}" if dispatch != "dropless" else "")
    return Metric(canonical, name, measure, dispatch)


def choose_metric(
    given: str | None, procedure: str, evals: dict[str, Sequence[EvalRecord]]
) -> tuple[Metric, str]:
    """The metric to fit and why: `given` (--metric) if any, checked against every run's records; else the
    procedure's held-out macro metric when every run has it, else the training loss.

    evals: each run's path and its evaluation records (empty without eval.jsonl)."""
    if given:
        metric = parse_metric(given)
        if metric.evaluated:
            lacking = [path for path, records in evals.items() if not metric.values(records)]
            if lacking:
                raise LadderError(
                    f"--metric {metric.name}: no such evaluation records in {', '.join(lacking)} "
                    f"({EVAL}: sets {_sets_of(evals, lacking[0])})"
                )
        return metric, "given with --metric"
    metric = parse_metric(DEFAULT_EVAL.get(procedure, DEFAULT_EVAL["shared"]))
    lacking = [path for path, records in evals.items() if not metric.values(records)]
    if not lacking:
        return metric, f"default: every run has held-out evaluation records ({EVAL})"
    if len(lacking) < len(evals):
        return Metric(TRAINING_LOSS), (
            f"default: {', '.join(lacking)} {'has' if len(lacking) == 1 else 'have'} no {metric.name} in "
            f"{EVAL}, so every run is fitted on training loss (give --metric to fit the others' evaluations)"
        )
    return Metric(TRAINING_LOSS), f"default: no run has held-out evaluation records ({EVAL})"


def _sets_of(evals: dict[str, Sequence[EvalRecord]], path: str) -> str:
    names = sorted({r.set for r in evals[path]} - set(AVERAGES)) + [
        a for a in AVERAGES if a in {r.set for r in evals[path]}
    ]
    return ", ".join(names) if names else f"none; the run has no {EVAL}"
