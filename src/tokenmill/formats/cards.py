"""Classifier models (docs/formats.md, "Classifier models"): the card `model.json` beside each fastText
`model.bin` (labels, training data, parameters, held-out metrics) and a quality model's
`calibration.json` (per-domain cuts of the score into quality buckets 0..4).
"""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from tokenmill.formats.base import Count, FormatModel, read_model, write_model

CARD = "model.json"
CALIBRATION = "calibration.json"
#: The calibration's key for cuts over all domains, used for a domain without its own.
ALL_DOMAINS = "*"


class TrainingData(FormatModel):
    """`examples` is what the file held; `train` + `holdout` is what was left after the exact and near
    duplicates (counted apart) were removed, before the split."""

    path: str
    sha256: str
    examples: Count
    train: Count
    holdout: Count
    seed: int
    exact_duplicates_removed: Count | None = None
    near_duplicates_removed: Count | None = None


class LabelMetrics(FormatModel):
    precision: float
    recall: float
    support: Count


class HoldoutMetrics(FormatModel):
    accuracy: float
    examples: Count
    labels: dict[str, LabelMetrics]


class CalibrationSummary(FormatModel):
    """What a quality card says of its calibration.json."""

    path: str
    domains: list[str]
    documents: Count
    #: Calibration documents dropped before the cuts: copies (exact or near) of a training text, and
    #: repeats of another calibration document.
    training_copies_removed: Count | None = None
    duplicates_removed: Count | None = None


class ClassifierCard(FormatModel):
    """model.json. `calibration` is there for a quality model only; `data` and `holdout_metrics` are
    null for a model trained elsewhere and calibrated by `tokenmill classifier calibrate` (its card says
    `trained_by: external`)."""

    name: str
    kind: Literal["domain", "quality"]
    labels: list[str]
    positive_label: str | None
    data: TrainingData | None
    parameters: dict[str, int | float | str]  # fastText's hyperparameters, by fastText's names
    holdout_metrics: HoldoutMetrics | None
    model_sha256: str
    calibration: CalibrationSummary | None = None
    trained_by: Literal["tokenmill", "external"] | None = None


class Calibration(FormatModel):
    """calibration.json: per domain (and `*` for all), the score at each quantile; n cuts give n + 1
    buckets."""

    positive_label: str
    quantiles: list[float]
    cuts: dict[str, list[float]]
    documents: dict[str, Count]

    @model_validator(mode="after")
    def _cuts_per_domain(self) -> Calibration:
        if ALL_DOMAINS not in self.cuts:
            raise ValueError(f"cuts: no '{ALL_DOMAINS}' entry (the cuts over all domains)")
        wrong = sorted(domain for domain, cuts in self.cuts.items() if len(cuts) != len(self.quantiles))
        if wrong:
            raise ValueError(
                f"cuts: {len(self.quantiles)} cuts per domain expected (one per quantile), not so for "
                f"{', '.join(wrong)}"
            )
        return self


def read_card(path: str) -> ClassifierCard:
    return read_model(ClassifierCard, path)


def write_card(path: str, card: ClassifierCard) -> None:
    write_model(path, card)


def read_calibration(path: str) -> Calibration:
    """calibration.json; FormatError names the file and what breaks the format (missing `*`, a wrong
    number of cuts)."""
    return read_model(Calibration, path)


def write_calibration(path: str, calibration: Calibration) -> None:
    write_model(path, calibration)
