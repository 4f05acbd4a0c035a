"""fastText classifiers that place documents in cells: a domain label and a quality bucket.

Training (`tokenmill classifier train`) reads labelled JSON Lines, holds out a seeded split, trains a
supervised fastText model with the hyperparameters of a config (configs/classifiers/*.yaml; the bundled
ones ship inside the package, `default_config`), prints precision and recall per label on the held-out
split, and writes beside the model a card (labels, data hash, metrics, parameters) through
`tokenmill.formats.cards`, which also reads the quality model's calibration back. fastText trains with
one thread: with more, its lock-free updates make the model depend on thread timing, and the same data
must give the same model.

Quality is the probability of the config's positive label. Raw scores mean different things in different
domains (code and prose do not score alike), so the quality model carries a calibration: on a calibration
sample, per domain, the score's quintiles cut it into buckets 0..4, so that bucket 3 is "the fourth fifth
of this domain" everywhere. Domains missing from the calibration use the cuts over all domains (`*`).

In curate, both are DocumentSteps: the model is loaded once per worker process (setup, through a
`SharedModel` that every copy of the step shares; local or gs://) and predicts a whole batch at a time;
a recipe that names a missing or corrupt model, or one whose labels are not the recipe's domains, fails
at load, before any pipeline starts.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field

from tokenmill import storage
from tokenmill.errors import FormatError
from tokenmill.filters.base import DocumentStep, Removal
from tokenmill.filters.models import SharedModel
from tokenmill.formats.cards import (
    ALL_DOMAINS,
    CALIBRATION,
    CARD,
    Calibration,
    CalibrationSummary,
    ClassifierCard,
    HoldoutMetrics,
    TrainingData,
    read_calibration,
    write_calibration,
    write_card,
)

LABEL_PREFIX = "__label__"
MODEL_FILE = "model.bin"
QUANTILES = (0.2, 0.4, 0.6, 0.8)


class ClassifierError(ValueError):
    """A classifier that cannot be trained or used; the message names the file and what is wrong."""


class FastTextParams(BaseModel):
    """fastText's supervised hyperparameters, with fastText's own names."""

    model_config = ConfigDict(extra="forbid")
    dim: int = Field(32, gt=0)
    epoch: int = Field(10, gt=0)
    lr: float = Field(0.5, gt=0)
    wordNgrams: int = Field(2, gt=0)  # noqa: N815 - fastText's name
    minCount: int = Field(1, gt=0)  # noqa: N815
    bucket: int = Field(200_000, gt=0)
    minn: int = Field(0, ge=0)
    maxn: int = Field(0, ge=0)
    loss: str = "softmax"


class ClassifierConfig(BaseModel):
    """configs/classifiers/<name>.yaml."""

    model_config = ConfigDict(extra="forbid")
    name: str
    kind: str = Field(pattern="^(quality|domain)$")
    text_field: str = "text"
    label_field: str = "label"
    holdout_fraction: float = Field(0.1, gt=0, lt=1)
    seed: int = 0
    max_chars: int = Field(4000, gt=0)
    positive_label: str | None = None  # quality: the label whose probability is the score
    domain_field: str = "domain"  # quality calibration: the calibration file's domain field
    fasttext: FastTextParams = FastTextParams()


def default_config(kind: str) -> Traversable:
    """The bundled hyperparameters of a `kind` classifier ("domain" or "quality"): configs/classifiers/
    <kind>.yaml, shipped inside the package (src/tokenmill/configs/, a copy that a test keeps equal to
    configs/), so that an installed tokenmill finds them without a checkout."""
    return resources.files("tokenmill").joinpath("configs", "classifiers", f"{kind}.yaml")


def load_config(path: str | Path | Traversable) -> ClassifierConfig:
    """A classifier config: a file, or a packaged one (`default_config`)."""
    if isinstance(path, str):
        path = Path(path)
    if not path.is_file():
        raise ClassifierError(f"classifier config not found: {path}")
    try:
        config = ClassifierConfig.model_validate(yaml.safe_load(path.read_text()) or {})
    except Exception as error:
        raise ClassifierError(f"{path}: {error}") from None
    if config.kind == "quality" and not config.positive_label:
        raise ClassifierError(f"{path}: a quality classifier needs positive_label (the label of good text)")
    return config


def fasttext_text(text: str, max_chars: int) -> str:
    """fastText reads one example per line: newlines become spaces; long texts are cut (the head decides)."""
    return " ".join(text[:max_chars].split())


def read_records(path: str, text_field: str) -> Iterator[tuple[int, dict]]:
    """(line number, record) of a JSON Lines file whose records carry a string `text_field`; a bad line is
    an error naming the file and line."""
    with storage.open_file(path, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise ClassifierError(f"{path}:{number}: not a JSON object: {error}") from None
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                raise ClassifierError(f"{path}:{number}: no string field {text_field!r}")
            yield number, record


def read_labelled(path: str, text_field: str, label_field: str) -> list[tuple[str, str]]:
    """(text, label) pairs from JSON Lines; a bad line is an error naming the file and line."""
    examples = []
    for number, record in read_records(path, text_field):
        label = record.get(label_field)
        if not isinstance(label, str) or not label or " " in label:
            raise ClassifierError(f"{path}:{number}: field {label_field!r} must be a label without spaces")
        examples.append((record[text_field], label))
    if not examples:
        raise ClassifierError(f"{path}: no labelled examples")
    return examples


def load_fasttext(path: str):
    """Load a fastText model from a local or remote (gs://...) path, with errors that name the file.

    fastText reads only local files: a remote model is downloaded once per machine (storage.local_copy).
    """
    import fasttext

    try:
        local = storage.local_copy(path)
    except FileNotFoundError:
        raise ClassifierError(f"fastText model not found: {path}") from None
    try:
        return fasttext.load_model(local)
    except Exception as error:
        raise ClassifierError(f"{path}: not a readable fastText model ({error})") from None


def model_labels(model) -> list[str]:
    return sorted(label.removeprefix(LABEL_PREFIX) for label in model.get_labels())


_LAST_BATCH: dict[tuple[str, int], str] = {}


def _prepared_lines(texts: list[str], max_chars: int) -> list[str]:
    """fastText lines for a batch; the domain and quality steps see the same batch one after the other,
    so the last batch's lines are kept and the second step does not prepare them again."""
    global _LAST_BATCH
    lines = [_LAST_BATCH.get((text, max_chars)) for text in texts]
    if any(line is None for line in lines):
        lines = [fasttext_text(text, max_chars) for text in texts]
        _LAST_BATCH = {(text, max_chars): line for text, line in zip(texts, lines)}
    return lines


def label_scores(model, texts: list[str], max_chars: int, k: int = -1) -> list[dict[str, float]]:
    """The top `k` labels' probabilities for each text (all with -1); empty texts get {} (callers give
    them a defined label). One predict call per batch: fastText's C++ loop, not Python's, goes per text."""
    prepared = _prepared_lines(texts, max_chars)
    nonempty = [index for index, text in enumerate(prepared) if text]
    results: list[dict[str, float]] = [{} for _ in texts]
    if nonempty:
        labels, probabilities = model.predict([prepared[i] for i in nonempty], k=k)
        for index, names, scores in zip(nonempty, labels, probabilities):
            results[index] = {
                name.removeprefix(LABEL_PREFIX): float(score) for name, score in zip(names, scores)
            }
    return results


def evaluate(model, examples: list[tuple[str, str]], max_chars: int) -> dict[str, Any]:
    """Accuracy and per-label precision/recall of top-1 predictions."""
    predicted = [
        max(scores, key=scores.get) if scores else None
        for scores in label_scores(model, [text for text, _ in examples], max_chars)
    ]
    truth = [label for _, label in examples]
    per_label = {}
    for label in sorted(set(truth) | {p for p in predicted if p}):
        true_positive = sum(1 for p, t in zip(predicted, truth) if p == t == label)
        predicted_count = sum(1 for p in predicted if p == label)
        actual_count = sum(1 for t in truth if t == label)
        per_label[label] = {
            "precision": round(true_positive / predicted_count, 4) if predicted_count else 0.0,
            "recall": round(true_positive / actual_count, 4) if actual_count else 0.0,
            "support": actual_count,
        }
    accuracy = sum(1 for p, t in zip(predicted, truth) if p == t) / len(truth)
    return {"accuracy": round(accuracy, 4), "examples": len(truth), "labels": per_label}


def quality_cuts(scores: np.ndarray) -> list[float]:
    return [float(cut) for cut in np.quantile(scores, QUANTILES)]


def quality_bucket(score: float, cuts: list[float]) -> int:
    return int(np.searchsorted(cuts, score, side="right"))


@dataclass
class TrainResult:
    card: ClassifierCard
    output: str


def train_classifier(
    config: ClassifierConfig,
    input_path: str,
    output: str,
    calibration_path: str | None = None,
    domain_model: str | None = None,
) -> TrainResult:
    """Train, evaluate on the held-out split, calibrate (quality), and write model, card and calibration."""
    import fasttext

    examples = read_labelled(input_path, config.text_field, config.label_field)
    labels = sorted({label for _, label in examples})
    if len(labels) < 2:
        raise ClassifierError(f"{input_path}: needs at least two labels, found {labels}")
    if config.kind == "quality" and config.positive_label not in labels:
        raise ClassifierError(f"{input_path}: positive_label {config.positive_label!r} is not among {labels}")
    order = list(range(len(examples)))
    random.Random(config.seed).shuffle(order)
    holdout_size = max(1, int(len(order) * config.holdout_fraction))
    holdout = [examples[i] for i in order[:holdout_size]]
    train = [examples[i] for i in order[holdout_size:]]

    os.makedirs(output, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", dir=output, delete=False) as handle:
        for text, label in train:
            handle.write(f"{LABEL_PREFIX}{label} {fasttext_text(text, config.max_chars)}\n")
        train_file = handle.name
    try:
        model = fasttext.train_supervised(
            train_file, thread=1, seed=config.seed, verbose=0, **config.fasttext.model_dump()
        )
    finally:
        os.remove(train_file)
    metrics = evaluate(model, holdout, config.max_chars)

    temporary = os.path.join(output, f"{storage.TEMPORARY_PREFIX}{MODEL_FILE}")
    model.save_model(temporary)
    os.replace(temporary, os.path.join(output, MODEL_FILE))

    # A domain card has no calibration field at all (not a null one): to_json writes only the fields set.
    calibrated: dict[str, CalibrationSummary] = {}
    if config.kind == "quality":
        if not calibration_path:
            raise ClassifierError("a quality classifier needs --calibration (documents with their domain)")
        calibrated["calibration"] = calibrate(model, config, calibration_path, domain_model, output)
    card = ClassifierCard(
        name=config.name,
        kind=config.kind,
        labels=labels,
        positive_label=config.positive_label,
        data=TrainingData(
            path=input_path,
            sha256=storage.file_sha256(input_path),
            examples=len(examples),
            train=len(train),
            holdout=len(holdout),
            seed=config.seed,
        ),
        parameters={**config.fasttext.model_dump(), "thread": 1, "max_chars": config.max_chars},
        holdout_metrics=HoldoutMetrics.model_validate(metrics),
        model_sha256=storage.file_sha256(os.path.join(output, MODEL_FILE)),
        **calibrated,
    )
    write_card(os.path.join(output, CARD), card)
    return TrainResult(card=card, output=output)


def calibrate(
    model, config: ClassifierConfig, path: str, domain_model: str | None, output: str
) -> CalibrationSummary:
    """Per-domain quintile cuts of the quality score, written to calibration.json; returns a summary."""
    texts, domains = [], []
    for _, record in read_records(path, config.text_field):
        texts.append(record[config.text_field])
        domains.append(record.get(config.domain_field))
    if domain_model:
        classifier = DomainClassifier(domain_model)
        classifier.setup()
        documents = [{"text": text} for text in texts]
        classifier.apply(documents)
        domains = [document["domain"] for document in documents]
    if any(not isinstance(domain, str) for domain in domains):
        raise ClassifierError(
            f"{path}: every calibration record needs a {config.domain_field!r} field "
            "(or give --domain-model to label them)"
        )
    scores = np.array(
        [s.get(config.positive_label, 0.0) for s in label_scores(model, texts, config.max_chars)]
    )
    domains_array = np.array(domains)
    cuts = {ALL_DOMAINS: quality_cuts(scores)}
    for domain in sorted(set(domains)):
        mask = domains_array == domain
        if mask.sum() >= 25:  # fewer documents than that make quintiles noise; the global cuts serve
            cuts[domain] = quality_cuts(scores[mask])
    calibration = Calibration(
        positive_label=config.positive_label or "",
        quantiles=list(QUANTILES),
        cuts=cuts,
        documents={d: int((domains_array == d).sum()) for d in sorted(set(domains))},
    )
    write_calibration(os.path.join(output, CALIBRATION), calibration)
    return CalibrationSummary(path=CALIBRATION, domains=sorted(cuts), documents=len(texts))


def _model_dir(model: str) -> str:
    return model.rsplit("/", 1)[0] if model.endswith(".bin") else model


def _model_file(model: str) -> str:
    return model if model.endswith(".bin") else storage.join(model, MODEL_FILE)


class DomainClassifier(DocumentStep):
    """Label `domain` and `domain_score`; below `threshold` (or for empty text) the domain is `other`."""

    stage = "domain_classifier"

    def __init__(
        self,
        model: str,
        domains: list[str] | None = None,
        threshold: float = 0.5,
        other: str = "other",
        max_chars: int = 4000,
    ):
        self.model_path = _model_file(model)
        self.domains = list(domains) if domains else None
        self.threshold = threshold
        self.other = other
        self.max_chars = max_chars
        self._shared_model = SharedModel(load_fasttext, self.model_path)
        self._model = None
        # Load now, so that a bad model fails before any pipeline starts (and in-process runs reuse it).
        labels = model_labels(self._shared_model.get())
        if self.domains is not None:
            unknown = sorted(set(labels) - set(self.domains) - {other})
            missing = sorted(set(self.domains) - set(labels) - {other})
            if unknown or missing:
                raise ClassifierError(
                    f"{self.model_path}: model labels {labels} do not match the recipe's domains "
                    f"{self.domains}"
                    + (f"; not in the recipe: {unknown}" if unknown else "")
                    + (f"; not in the model: {missing}" if missing else "")
                )
        self.labels = labels

    def setup(self) -> None:
        self._model = self._shared_model.get()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_model": None}  # a copy finds the model in its own process

    def apply(self, documents: list[dict]) -> list[Removal | None]:
        if self._model is None:
            self.setup()
        # Only the best label matters here; asking fastText for one saves sorting them all.
        for document, scores in zip(
            documents, label_scores(self._model, [d["text"] for d in documents], self.max_chars, k=1)
        ):
            if not scores:
                document["domain"], document["domain_score"] = self.other, 0.0
                continue
            label = max(scores, key=scores.get)
            score = scores[label]
            document["domain"] = label if score >= self.threshold else self.other
            document["domain_score"] = score
        return [None] * len(documents)


class QualityClassifier(DocumentStep):
    """Label `quality_score` (probability of good text) and `quality` (the domain-calibrated bucket 0..4).

    Runs after the domain classifier, whose domain picks the cuts; empty text scores 0 (bucket 0).
    """

    stage = "quality_classifier"

    def __init__(self, model: str, calibration: str | None = None, max_chars: int = 4000):
        self.model_path = _model_file(model)
        self.calibration_path = calibration or storage.join(_model_dir(model), CALIBRATION)
        self.max_chars = max_chars
        self._shared_model = SharedModel(load_fasttext, self.model_path)
        self._model = None
        self._shared_model.get()  # fail now, before any pipeline starts
        if not storage.exists(self.calibration_path):
            raise ClassifierError(
                f"quality calibration not found: {self.calibration_path} "
                "(train with --calibration, or name calibration: in the recipe)"
            )
        try:
            calibration = read_calibration(self.calibration_path)
        except FormatError as error:
            raise ClassifierError(f"not a calibration file: {error}") from None
        if len(calibration.quantiles) != len(QUANTILES):
            raise ClassifierError(
                f"{self.calibration_path}: {len(calibration.quantiles)} quantiles, but the quality buckets "
                f"0..{len(QUANTILES)} need {len(QUANTILES)} cuts per domain"
            )
        self.cuts = calibration.cuts
        self.positive_label = calibration.positive_label

    def setup(self) -> None:
        self._model = self._shared_model.get()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_model": None}  # a copy finds the model in its own process

    def apply(self, documents: list[dict]) -> list[Removal | None]:
        if self._model is None:
            self.setup()
        for document, scores in zip(
            documents, label_scores(self._model, [d["text"] for d in documents], self.max_chars)
        ):
            score = scores.get(self.positive_label, 0.0)
            cuts = self.cuts.get(document.get("domain") or ALL_DOMAINS, self.cuts[ALL_DOMAINS])
            document["quality_score"] = score
            document["quality"] = quality_bucket(score, cuts)
        return [None] * len(documents)
