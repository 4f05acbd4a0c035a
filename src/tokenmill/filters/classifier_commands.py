"""`tokenmill classifier train`: fastText domain and quality classifiers for curate."""

from __future__ import annotations

import argparse

from tokenmill.errors import UsageError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("classifier", help="train the fastText domain and quality classifiers")
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
    metrics = card.holdout_metrics
    print(
        f"{card.name} ({card.kind}): {card.data.train:,} train / {card.data.holdout:,} held out; "
        f"held-out accuracy {metrics.accuracy:.3f}"
    )
    print(f"  {'label':<16} {'precision':>9} {'recall':>7} {'support':>8}")
    for label, entry in metrics.labels.items():
        print(f"  {label:<16} {entry.precision:>9.3f} {entry.recall:>7.3f} {entry.support:>8,}")
    calibration = card.calibration
    if calibration is not None:
        domains = ", ".join(calibration.domains)
        print(f"  calibration: {calibration.documents:,} documents, cuts for {domains}")
    written = [MODEL_FILE, CARD] + ([CALIBRATION] if calibration is not None else [])
    print(f"wrote {args.output}/{', '.join(written)}")
    return 0
