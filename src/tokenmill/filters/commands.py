"""Subcommands of the filters stage: `tokenmill decontam` (evaluation-set index for the decontam stage).

Each subcommand group has a `_register_<group>` function and its handlers below it; `register` calls
them in the order they appear in `tokenmill --help`. Handlers import their modules when they run.
"""

from __future__ import annotations

import argparse
import time

from tokenmill.cli import UsageError


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add this stage's subcommands to the `tokenmill` parser."""
    _register_decontam(subparsers)


# ------------------------------------------------------------------------------------------ decontam


def _register_decontam(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "decontam",
        help="index evaluation sets for the curate stage that removes contaminated documents",
        description="Decontamination against evaluation sets (docs/decontam.md).",
    )
    commands = parser.add_subparsers(dest="decontam_command", metavar="ACTION")
    index = commands.add_parser(
        "index",
        help="build the n-gram index of evaluation records",
        description=(
            "Read evaluation sets (JSON Lines, optionally .gz/.zst; one set per file, named after the file) "
            "and write an index of the normalized word n-grams of each record's fields, with records "
            "shorter than n words indexed whole. Every file is checked before anything is written: a bad "
            "line fails the command with its file and line number. Nothing is downloaded."
        ),
        epilog="example: tokenmill decontam index --evals 'evals/*.jsonl' --output decontam.index",
    )
    index.add_argument(
        "--evals",
        required=True,
        action="append",
        metavar="PATH_OR_GLOB",
        help="evaluation files: a path or glob, local or gs://...; repeatable",
    )
    index.add_argument("--output", required=True, help="the index file to write")
    index.add_argument(
        "--fields",
        default="question,answer",
        metavar="FIELD,FIELD",
        help="fields whose text is matched, joined in this order (dotted paths into nested "
        "objects; a trailing ? makes a field optional); default: question,answer",
    )
    index.add_argument(
        "--set-fields",
        action="append",
        default=[],
        metavar="SET=FIELD,FIELD",
        help="fields for one evaluation set (the file name without extensions); repeatable",
    )
    index.add_argument("--n", type=int, default=13, help="words per n-gram (default 13)")
    index.add_argument(
        "--min-words",
        type=int,
        default=6,
        help="records shorter than n words are matched whole if they have at least this many "
        "words (default 6); shorter ones are skipped and counted",
    )
    index.add_argument(
        "--template-records",
        type=int,
        default=10,
        help="drop n-grams that this many distinct records of one set share: the set's prompt "
        "template (default 10)",
    )
    index.set_defaults(handler=run_decontam_index)
    info = commands.add_parser("info", help="print an index's header: sets, record counts, sizes")
    info.add_argument("index", help="an index file written by `tokenmill decontam index`")
    info.set_defaults(handler=run_decontam_info)
    parser.set_defaults(handler=lambda args: parser.print_help() or 2)


def _parse_set_fields(values: list[str]):
    from tokenmill.filters.decontam import FieldSpec

    result = {}
    for value in values:
        name, sep, fields = value.partition("=")
        if not sep or not name.strip():
            raise UsageError(f"--set-fields {value!r}: expected SET=FIELD,FIELD")
        result[name.strip()] = FieldSpec.parse(fields)
    return result


def run_decontam_index(args: argparse.Namespace) -> int:
    from tokenmill.filters.decontam import (
        DecontamError,
        FieldSpec,
        build_index,
        expand_eval_paths,
        read_eval_sets,
    )

    started = time.monotonic()
    try:
        paths = expand_eval_paths(args.evals)
        eval_sets = read_eval_sets(paths, FieldSpec.parse(args.fields), _parse_set_fields(args.set_fields))
        index = build_index(
            eval_sets, n=args.n, min_words=args.min_words, template_records=args.template_records
        )
    except DecontamError as error:
        raise UsageError(str(error)) from None
    index.save(args.output)
    print(describe_index(index.header, args.output))
    print(f"written in {time.monotonic() - started:.1f}s")
    return 0


def run_decontam_info(args: argparse.Namespace) -> int:
    from tokenmill.filters.decontam import DecontamError, read_index_header

    try:
        header, _ = read_index_header(args.index)
    except DecontamError as error:
        raise UsageError(str(error)) from None
    print(describe_index(header, args.index))
    return 0


def describe_index(header: dict, path: str) -> str:
    """A few lines about an index: its settings, then one line per evaluation set."""
    arrays = header.get("arrays", {})
    size = sum(entry["length"] * int(entry["dtype"][-1]) for entry in arrays.values())
    lines = [
        f"{path}: format {header['format_version']}, n={header['n']}, {header['normalization']}, "
        f"{header['records']:,} records, {arrays.get('ngram_hash', {}).get('length', 0):,} n-gram entries, "
        f"{arrays.get('short_hash', {}).get('length', 0):,} short records, {size / 2**20:.1f} MiB of arrays",
    ]
    for entry in header["sets"]:
        lines.append(
            f"  {entry['name']}: {entry['records']:,} records ({entry['ngram_records']:,} by n-grams, "
            f"{entry['short_records']:,} whole, {entry['too_short']:,} too short to match, "
            f"{entry['duplicates']:,} duplicates, {entry['empty']:,} empty), {entry['ngrams']:,} n-grams, "
            f"{entry['template_ngrams']:,} template n-grams dropped; fields {','.join(entry['fields'])}"
        )
    return "\n".join(lines)
