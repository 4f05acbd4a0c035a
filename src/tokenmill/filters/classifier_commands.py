"""`tokenmill classifier train|calibrate`: fastText domain and quality classifiers for curate."""

from __future__ import annotations

import argparse

from tokenmill.errors import UsageError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "classifier", help="train fastText domain and quality classifiers, or calibrate any fastText model"
    )
    commands = parser.add_subparsers(dest="classifier_command", metavar="COMMAND", required=True)
    train = commands.add_parser(
        "train",
        help="train a classifier, report held-out precision/recall, write model.bin + model.json",
        description="Train a supervised fastText classifier from labelled JSON Lines ({text, label}). "
        "Writes OUTPUT/model.bin, OUTPUT/model.json (labels, data hash, held-out metrics, parameters) and, "
        "for --kind quality, OUTPUT/calibration.json (per-domain quality buckets 0..4).",
        epilog="example: tokenmill classifier train --kind domain --config configs/classifiers/domain.yaml "
        "--input data/classifiers/domain.jsonl --output models/domain",
    )
    train.add_argument("--kind", choices=("quality", "domain"), required=True)
    train.add_argument(
        "--config",
        help="hyperparameters YAML (default: the bundled configs/classifiers/<kind>.yaml, which ships inside "
        "the package)",
    )
    train.add_argument("--input", required=True, help="labelled JSON Lines")
    train.add_argument("--output", required=True, help="model folder")
    train.add_argument(
        "--calibration", help="quality: JSON Lines of documents with their domain, for the buckets"
    )
    train.add_argument("--domain-model", help="quality: label calibration documents with this domain model")
    train.set_defaults(handler=run_train)

    calibrate = commands.add_parser(
        "calibrate",
        help="calibrate an existing fastText quality model (any .bin): write calibration.json + model.json",
        description="Cut an existing fastText model's quality score into buckets 0..4 per content type "
        "(the documents' domain): within each type the score's percentile on the calibration documents, "
        "cut at 0.2, 0.4, 0.6, 0.8. Writes OUTPUT/model.bin (a copy), OUTPUT/calibration.json and "
        "OUTPUT/model.json, so that a recipe's `quality_classifier: {model: OUTPUT}` uses it. Calibration "
        "documents that copy a training text (--exclude, or the training data a tokenmill card names) or "
        "another calibration document are removed first, and counted in the card.",
        epilog="example: tokenmill classifier calibrate --model my-quality.bin --calibration docs.jsonl "
        "--output models/my-quality",
    )
    calibrate.add_argument("--model", required=True, help="a fastText .bin, or a folder with model.bin")
    calibrate.add_argument(
        "--calibration", required=True, help="JSON Lines of documents with their domain (the content type)"
    )
    calibrate.add_argument(
        "--output", required=True, help="local model folder to write (may be the --model folder)"
    )
    calibrate.add_argument(
        "--positive-label", help="the label whose probability is the score (default: the card's, or hq)"
    )
    calibrate.add_argument(
        "--max-chars",
        type=int,
        help="characters of each document the model reads (default: the card's, else 4000); curate "
        "feeds the model the same head",
    )
    calibrate.add_argument("--text-field", default="text")
    calibrate.add_argument("--domain-field", default="domain", help="the calibration file's domain field")
    calibrate.add_argument("--domain-model", help="label calibration documents with this domain model")
    calibrate.add_argument(
        "--exclude",
        action="append",
        help="JSON Lines of the model's training texts: their copies are not calibration documents "
        "(repeatable; default: the training data a tokenmill card names)",
    )
    calibrate.add_argument("--name", help="the card's name (default: the source card's, or the file name)")
    calibrate.set_defaults(handler=run_calibrate)


def run_train(args: argparse.Namespace) -> int:
    from tokenmill.filters.classifiers import (
        MODEL_FILE,
        ClassifierError,
        default_config,
        load_config,
        train_classifier,
    )
    from tokenmill.formats.cards import CALIBRATION, CARD

    config_path = args.config or default_config(args.kind)
    try:
        config = load_config(config_path)
        if config.kind != args.kind:
            raise UsageError(f"{config_path} is a {config.kind} config, not {args.kind}")
        result = train_classifier(config, args.input, args.output, args.calibration, args.domain_model)
    except ClassifierError as error:
        raise UsageError(str(error)) from None
    card = result.card
    metrics, data = card.holdout_metrics, card.data
    assert metrics is not None and data is not None
    print(
        f"{card.name} ({card.kind}): {data.train:,} train / {data.holdout:,} held out "
        f"({data.exact_duplicates_removed:,} exact and {data.near_duplicates_removed:,} near duplicates "
        f"removed first); held-out accuracy {metrics.accuracy:.3f}"
    )
    print(f"  {'label':<16} {'precision':>9} {'recall':>7} {'support':>8}")
    for label, entry in metrics.labels.items():
        print(f"  {label:<16} {entry.precision:>9.3f} {entry.recall:>7.3f} {entry.support:>8,}")
    calibration = card.calibration
    if calibration is not None:
        domains = ", ".join(calibration.domains)
        print(
            f"  calibration: {calibration.documents:,} documents ({calibration.training_copies_removed:,} "
            f"training copies, {calibration.duplicates_removed:,} repeats removed), cuts for {domains}"
        )
    written = [MODEL_FILE, CARD] + ([CALIBRATION] if calibration is not None else [])
    print(f"wrote {args.output}/{', '.join(written)}")
    return 0


def run_calibrate(args: argparse.Namespace) -> int:
    from tokenmill.filters.classifiers import MODEL_FILE, ClassifierError, calibrate_model
    from tokenmill.formats.cards import CALIBRATION, CARD

    if args.max_chars is not None and args.max_chars <= 0:
        raise UsageError(f"--max-chars must be positive, got {args.max_chars}")
    try:
        card = calibrate_model(
            args.model,
            args.calibration,
            args.output,
            positive_label=args.positive_label,
            max_chars=args.max_chars,
            text_field=args.text_field,
            domain_field=args.domain_field,
            domain_model=args.domain_model,
            exclude=args.exclude,
            name=args.name,
        )
    except ClassifierError as error:
        raise UsageError(str(error)) from None
    calibration = card.calibration
    assert calibration is not None
    print(
        f"{card.name}: calibrated on {calibration.documents:,} documents "
        f"({calibration.training_copies_removed or 0:,} training copies and "
        f"{calibration.duplicates_removed or 0:,} repeats removed); max_chars {card.parameters['max_chars']}"
    )
    print(f"  cuts for {', '.join(calibration.domains)}")
    print(f"wrote {args.output}/{', '.join([MODEL_FILE, CARD, CALIBRATION])}")
    return 0
