"""fastText classifiers that place documents in cells: a domain label and a quality bucket.

Training (`tokenmill classifier train`) reads labelled JSON Lines, drops exact and near duplicates
(`find_duplicates`: normalized-text hashes, then MinHash LSH over word 5-grams with every candidate
checked on its shingles), holds out a seeded split of what is left, trains a supervised fastText model
with the hyperparameters of a config (configs/classifiers/*.yaml; the bundled ones ship inside the
package, `default_config`), prints precision and recall per label on the held-out split, and writes
beside the model a card (labels, data hash, duplicates removed, metrics, parameters) through
`tokenmill.formats.cards`, which also reads the quality model's calibration back. fastText trains with
one thread, in a fresh process (`train_fasttext_fresh`): the same data must give the same model.

Quality is the probability of the model's positive label. Raw scores mean different things in different
content types (code and prose do not score alike), so a quality model carries a calibration: on a
calibration sample, per content type (the document's domain), the score's percentile is cut at the fixed
points 0.2, 0.4, 0.6, 0.8 into buckets 0..4, so that bucket 3 is "the fourth fifth of this type"
everywhere. Types missing from the calibration use the cuts over all of them (`*`). Calibration
documents that copy a training text are dropped first. `tokenmill classifier calibrate` does the same
for any fastText model (`calibrate_model`), one trained elsewhere included.

In curate, both are DocumentSteps: the model is loaded once per worker process (setup, through a
`SharedModel` that every copy of the step shares; local or gs://) and predicts a whole batch at a time,
on the head of each document that the model card's `max_chars` says (what it was trained and
calibrated on); a recipe that names a missing or corrupt model, one whose labels are not the recipe's
domains, or a max_chars the card contradicts, fails at load, before any pipeline starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
import unicodedata
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
from tokenmill.filters.base import Removal
from tokenmill.filters.minhash import MinHasher, jaccard
from tokenmill.filters.models import SharedModel, SharedModelStep
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
    read_card,
    write_calibration,
    write_card,
)

LABEL_PREFIX = "__label__"
MODEL_FILE = "model.bin"
QUANTILES = (0.2, 0.4, 0.6, 0.8)
#: What curate feeds a model whose card does not say (a bare .bin): fastText's input is the text's head.
DEFAULT_MAX_CHARS = 4000
#: Two texts whose word 5-gram sets have at least this Jaccard similarity are near duplicates: the same
#: document with a few words edited, a license with another copyright line.
NEAR_DUPLICATE_JACCARD = 0.7
#: Texts per LSH bucket that a newcomer is compared with (a bucket of a thousand copies costs no more).
BUCKET_MEMBERS = 16
#: Fewer calibration documents of one domain than this make its quintiles noise: the global cuts serve.
MIN_DOMAIN_DOCUMENTS = 25


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


def normalized_text(text: str) -> str:
    """The exact-duplicate form of a text: NFKC, case-folded, whitespace runs as one space."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


@dataclass
class Duplicates:
    """Of a list of texts, the ones to drop: each is an exact or near copy of an earlier text.

    `first[i]` is the index of the earliest text of i's group (i itself when i is kept).
    """

    first: list[int]
    exact: set[int]
    near: set[int]

    def kept(self) -> list[int]:
        return [index for index, first in enumerate(self.first) if first == index]


def find_duplicates(texts: list[str], similarity: float = NEAR_DUPLICATE_JACCARD) -> Duplicates:
    """Group exact copies (same `normalized_text`) and near copies (word 5-gram Jaccard >= `similarity`);
    every group keeps its earliest text.

    Near copies are found by MinHash LSH (tokenmill.filters.minhash, the fuzzy dedupe stage's hashing)
    with 20 bands of 5 rows: a pair at Jaccard 0.7 shares a band with probability 0.975, at 0.8 with
    0.9996; every candidate pair is then checked on its exact shingle sets, so no pair below `similarity`
    is merged. Groups are connected components (union-find with the smallest index as root), so a chain
    of near copies is one group. In one process: memory grows with the texts' shingles (about 8 bytes a
    word) and the candidate pairs; for labelled data and calibration samples (up to millions of short
    texts), not for a corpus (curate's fuzzy_dedupe stage is the distributed form).
    """
    parent = list(range(len(texts)))

    def root(index: int) -> int:
        while parent[index] != index:
            parent[index] = parent[parent[index]]
            index = parent[index]
        return index

    def union(a: int, b: int) -> None:
        ra, rb = root(a), root(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)

    exact_first: dict[bytes, int] = {}
    exact: set[int] = set()
    for index, text in enumerate(texts):
        key = hashlib.blake2b(normalized_text(text).encode("utf-8", "surrogatepass"), digest_size=16).digest()
        if key in exact_first:
            union(exact_first[key], index)
            exact.add(index)
        else:
            exact_first[key] = index
    distinct = sorted(exact_first.values())
    hasher = MinHasher(ngram=5, bands=20, rows=5, seed=7)
    shingles = {index: hasher.shingles(texts[index]) for index in distinct}
    # A band's bucket keeps up to BUCKET_MEMBERS texts to compare newcomers with: a near copy of A that
    # first meets B (another near copy of A, but further from it) still meets A in some bucket.
    buckets: dict[bytes, list[int]] = {}
    for low in range(0, len(distinct), 1024):
        chunk = distinct[low : low + 1024]
        signatures, present = hasher.signatures([texts[i] for i in chunk])
        for index, signature, has_shingles in zip(chunk, signatures, present):
            if not has_shingles:
                continue
            for key in hasher.band_keys(signature):
                members = buckets.setdefault(key, [])
                for other in members:
                    if root(other) != root(index) and jaccard(shingles[other], shingles[index]) >= similarity:
                        union(other, index)
                if len(members) < BUCKET_MEMBERS:
                    members.append(index)
    first = [root(index) for index in range(len(texts))]
    near = {index for index in range(len(texts)) if first[index] != index and index not in exact}
    return Duplicates(first=first, exact=exact, near=near)


def split_examples(
    examples: list[tuple[str, str]], holdout_fraction: float, seed: int
) -> tuple[list[tuple[str, str]], list[tuple[str, str]], Duplicates]:
    """(train, held out, the duplicates dropped): exact and near copies are dropped first, keeping the
    first of each group, then the rest is shuffled with `seed` and split, so no held-out text has a
    copy among the training texts."""
    duplicates = find_duplicates([text for text, _ in examples])
    unique = [examples[index] for index in duplicates.kept()]
    order = list(range(len(unique)))
    random.Random(seed).shuffle(order)
    holdout_size = max(1, int(len(order) * holdout_fraction))
    return [unique[i] for i in order[holdout_size:]], [unique[i] for i in order[:holdout_size]], duplicates


def quality_cuts(scores: np.ndarray) -> list[float]:
    return [float(cut) for cut in np.quantile(scores, QUANTILES)]


def quality_bucket(score: float, cuts: list[float]) -> int:
    return int(np.searchsorted(cuts, score, side="right"))


_TRAIN_SCRIPT = """
import json, sys
import fasttext
train_file, model_file, params = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
fasttext.train_supervised(train_file, thread=1, verbose=0, **params).save_model(model_file)
"""


def train_fasttext_fresh(train_file: str, model_file: str, params: dict[str, Any]) -> None:
    """fastText's supervised training, in a fresh Python process that imports nothing but fastText.

    In a process that has loaded other native libraries and allocated much, the same data, seed and
    one thread have been seen to diverge to NaN ("Encountered NaN") or give other bytes; in a fresh
    process the result depends on the data and the parameters alone. One thread: with more, fastText's
    lock-free updates make the model depend on thread timing.
    """
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", _TRAIN_SCRIPT, train_file, model_file, json.dumps(params)],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        message = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise ClassifierError(f"fastText training on {train_file} failed: {message}")


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
    """Train, evaluate on the held-out split, calibrate (quality), and write model, card and calibration.

    Exact and near duplicates are removed before the split (`find_duplicates`: a text and its copy on
    both sides would measure memory, not the model), and calibration documents that copy a training
    text are removed before the cuts; the card counts both.
    """
    examples = read_labelled(input_path, config.text_field, config.label_field)
    train, holdout, duplicates = split_examples(examples, config.holdout_fraction, config.seed)
    labels = sorted({label for _, label in train + holdout})
    if len(labels) < 2:
        raise ClassifierError(f"{input_path}: needs at least two labels, found {labels}")
    if config.kind == "quality" and config.positive_label not in labels:
        raise ClassifierError(f"{input_path}: positive_label {config.positive_label!r} is not among {labels}")

    os.makedirs(output, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", dir=output, delete=False) as handle:
        for text, label in train:
            handle.write(f"{LABEL_PREFIX}{label} {fasttext_text(text, config.max_chars)}\n")
        train_file = handle.name
    temporary = os.path.join(output, f"{storage.TEMPORARY_PREFIX}{MODEL_FILE}")
    try:
        train_fasttext_fresh(train_file, temporary, {"seed": config.seed, **config.fasttext.model_dump()})
    finally:
        os.remove(train_file)
    os.replace(temporary, os.path.join(output, MODEL_FILE))
    model = load_fasttext(os.path.join(output, MODEL_FILE))
    metrics = evaluate(model, holdout, config.max_chars)

    # A domain card has no calibration field at all (not a null one): to_json writes only the fields set.
    calibrated: dict[str, CalibrationSummary] = {}
    if config.kind == "quality":
        if not calibration_path:
            raise ClassifierError("a quality classifier needs --calibration (documents with their domain)")
        calibrated["calibration"] = calibrate(
            model,
            config.positive_label or "",
            calibration_path,
            output,
            max_chars=config.max_chars,
            text_field=config.text_field,
            domain_field=config.domain_field,
            domain_model=domain_model,
            training_texts=[text for text, _ in examples],
        )
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
            exact_duplicates_removed=len(duplicates.exact),
            near_duplicates_removed=len(duplicates.near),
        ),
        parameters={**config.fasttext.model_dump(), "thread": 1, "max_chars": config.max_chars},
        holdout_metrics=HoldoutMetrics.model_validate(metrics),
        model_sha256=storage.file_sha256(os.path.join(output, MODEL_FILE)),
        trained_by="tokenmill",
        **calibrated,
    )
    write_card(os.path.join(output, CARD), card)
    return TrainResult(card=card, output=output)


def calibrate(
    model,
    positive_label: str,
    path: str,
    output: str,
    max_chars: int,
    text_field: str = "text",
    domain_field: str = "domain",
    domain_model: str | None = None,
    training_texts: list[str] | None = None,
) -> CalibrationSummary:
    """Per-content-type cuts of the quality score, written to OUTPUT/calibration.json.

    A document's content type is its domain (the calibration file's `domain_field`, or what
    `domain_model` predicts). Within a content type the calibrated score is the raw score's percentile
    (its empirical CDF over the calibration documents of that type), and the buckets 0..4 are that
    percentile cut at the fixed points 0.2, 0.4, 0.6, 0.8, as the reference run cuts its quality score;
    calibration.json stores, per type, the raw score at each point. Before the cuts, documents that copy
    (exactly or nearly) one of `training_texts`, or an earlier calibration document, are dropped: a
    model scores its own training text higher than text it has not seen.
    """
    texts, domains = [], []
    for _, record in read_records(path, text_field):
        texts.append(record[text_field])
        domains.append(record.get(domain_field))
    training_texts = training_texts or []
    duplicates = find_duplicates(training_texts + texts)
    offset = len(training_texts)
    training_copies = duplicates_within = 0
    keep = []
    for index in range(len(texts)):
        first = duplicates.first[offset + index]
        if first < offset:
            training_copies += 1
        elif first != offset + index:
            duplicates_within += 1
        else:
            keep.append(index)
    texts = [texts[i] for i in keep]
    domains = [domains[i] for i in keep]
    if not texts:
        raise ClassifierError(f"{path}: no calibration documents left after removing training copies")
    if domain_model:
        classifier = DomainClassifier(domain_model)
        classifier.setup()
        documents = [{"text": text} for text in texts]
        classifier.apply(documents)
        domains = [document["domain"] for document in documents]
    if any(not isinstance(domain, str) for domain in domains):
        raise ClassifierError(
            f"{path}: every calibration record needs a {domain_field!r} field "
            "(or give --domain-model to label them)"
        )
    scores = np.array([s.get(positive_label, 0.0) for s in label_scores(model, texts, max_chars)])
    domains_array = np.array(domains)
    cuts = {ALL_DOMAINS: quality_cuts(scores)}
    for domain in sorted(set(domains)):
        mask = domains_array == domain
        if mask.sum() >= MIN_DOMAIN_DOCUMENTS:
            cuts[domain] = quality_cuts(scores[mask])
    calibration = Calibration(
        positive_label=positive_label,
        quantiles=list(QUANTILES),
        cuts=cuts,
        documents={d: int((domains_array == d).sum()) for d in sorted(set(domains))},
    )
    write_calibration(os.path.join(output, CALIBRATION), calibration)
    return CalibrationSummary(
        path=CALIBRATION,
        domains=sorted(cuts),
        documents=len(texts),
        training_copies_removed=training_copies,
        duplicates_removed=duplicates_within,
    )


def _training_texts(path: str, text_field: str) -> list[str]:
    return [record[text_field] for _, record in read_records(path, text_field)]


def calibrate_model(
    model_path: str,
    calibration_path: str,
    output: str,
    positive_label: str | None = None,
    max_chars: int | None = None,
    text_field: str = "text",
    domain_field: str = "domain",
    domain_model: str | None = None,
    exclude: list[str] | None = None,
    name: str | None = None,
) -> ClassifierCard:
    """Calibrate an existing fastText classifier (any `.bin`, or a folder with model.bin and maybe a
    card): OUTPUT gets model.bin (a copy, unless OUTPUT already holds it), calibration.json and a card.

    What the source card says (positive label, max_chars, training data) is the default; a bare `.bin`
    needs `positive_label` when it has more than two labels or none called `hq`. Texts in `exclude`
    (JSON Lines with `text_field`; by default the card's training data when that file is at hand) are
    removed from the calibration documents with their near copies.
    """
    source_file = _model_file(model_path)
    source_card = _read_card_if_any(_card_path(model_path))
    model = load_fasttext(source_file)
    labels = model_labels(model)
    if positive_label is None and source_card is not None and source_card.positive_label:
        positive_label = source_card.positive_label
    if positive_label is None:
        if "hq" in labels:
            positive_label = "hq"
        else:
            raise ClassifierError(
                f"{source_file}: which label is good text? give --positive-label (labels: {labels})"
            )
    if positive_label not in labels:
        raise ClassifierError(f"{source_file}: positive label {positive_label!r} is not among {labels}")
    card_chars = _card_max_chars(source_card)
    if max_chars is None:
        max_chars = card_chars or DEFAULT_MAX_CHARS
    if exclude is None:
        exclude = [source_card.data.path] if source_card and source_card.data else []
        exclude = [path for path in exclude if storage.exists(path)]
    training_texts = [text for path in exclude for text in _training_texts(path, text_field)]

    os.makedirs(output, exist_ok=True)
    target = os.path.join(output, MODEL_FILE)
    local_source = storage.local_copy(source_file)
    if not (os.path.exists(target) and os.path.samefile(local_source, target)):
        temporary = os.path.join(output, f"{storage.TEMPORARY_PREFIX}{MODEL_FILE}")
        shutil.copyfile(local_source, temporary)
        os.replace(temporary, target)
    summary = calibrate(
        model,
        positive_label,
        calibration_path,
        output,
        max_chars=max_chars,
        text_field=text_field,
        domain_field=domain_field,
        domain_model=domain_model,
        training_texts=training_texts,
    )
    if source_card is not None:
        card = source_card.model_copy(
            update={
                "parameters": {**source_card.parameters, "max_chars": max_chars},
                "calibration": summary,
                "positive_label": positive_label,
                "kind": "quality",
            }
        )
        if name:
            card = card.model_copy(update={"name": name})
    else:
        card = ClassifierCard(
            name=name or os.path.basename(source_file).removesuffix(".bin"),
            kind="quality",
            labels=labels,
            positive_label=positive_label,
            data=None,
            parameters={"dim": int(model.get_dimension()), "max_chars": max_chars},
            holdout_metrics=None,
            model_sha256=storage.file_sha256(target),
            calibration=summary,
            trained_by="external",
        )
    write_card(os.path.join(output, CARD), ClassifierCard.model_validate(card.to_json()))
    return card


def _card_path(model: str) -> str | None:
    """The card of a model folder, or of a `.../model.bin`; a .bin of another name has none (a
    model.json beside it describes model.bin, not it)."""
    if model.endswith(".bin") and model.rsplit("/", 1)[-1] != MODEL_FILE:
        return None
    return storage.join(_model_dir(model), CARD)


def _read_card_if_any(path: str | None) -> ClassifierCard | None:
    if path is None or not storage.exists(path):
        return None
    try:
        return read_card(path)
    except FormatError as error:
        raise ClassifierError(f"not a model card: {error}") from None


def _card_max_chars(card: ClassifierCard | None) -> int | None:
    value = card.parameters.get("max_chars") if card is not None else None
    return value if isinstance(value, int) and value > 0 else None


def resolve_max_chars(model: str, max_chars: int | None) -> int:
    """The characters of a document's head that the model reads: the model card's `max_chars` (what the
    model was trained and calibrated on); a bare .bin without a card reads DEFAULT_MAX_CHARS. A recipe
    value that differs from the card's is refused: the calibration's cuts hold only for that head."""
    card_chars = _card_max_chars(_read_card_if_any(_card_path(model)))
    if max_chars is not None and card_chars is not None and max_chars != card_chars:
        raise ClassifierError(
            f"{model}: max_chars {max_chars} differs from the model card's {card_chars} "
            "(its training and calibration read that many characters; leave max_chars out)"
        )
    return max_chars or card_chars or DEFAULT_MAX_CHARS


def _model_dir(model: str) -> str:
    return model.rsplit("/", 1)[0] if model.endswith(".bin") else model


def _model_file(model: str) -> str:
    return model if model.endswith(".bin") else storage.join(model, MODEL_FILE)


class DomainClassifier(SharedModelStep):
    """Label `domain` and `domain_score`; below `threshold` (or for empty text) the domain is `other`."""

    stage = "domain_classifier"

    def __init__(
        self,
        model: str,
        domains: list[str] | None = None,
        threshold: float = 0.5,
        other: str = "other",
        max_chars: int | None = None,
    ):
        self.model_path = _model_file(model)
        self.domains = list(domains) if domains else None
        self.threshold = threshold
        self.other = other
        self.max_chars = resolve_max_chars(model, max_chars)
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


class QualityClassifier(SharedModelStep):
    """Label `quality_score` (probability of good text) and `quality` (the domain-calibrated bucket 0..4).

    Runs after the domain classifier, whose domain picks the cuts; empty text scores 0 (bucket 0).
    """

    stage = "quality_classifier"

    def __init__(self, model: str, calibration: str | None = None, max_chars: int | None = None):
        self.model_path = _model_file(model)
        self.calibration_path = calibration or storage.join(_model_dir(model), CALIBRATION)
        self.max_chars = resolve_max_chars(model, max_chars)
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
