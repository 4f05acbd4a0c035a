"""Subcommands of the filters stage: `tokenmill decontam` (evaluation-set index for the decontam stage).

Each subcommand group has a `_register_<group>` function and its handlers below it; `register` calls
them in the order they appear in `tokenmill --help`. Handlers import their modules when they run.
"""

from __future__ import annotations

import argparse
import time

from tokenmill.errors import UsageError

#: The layouts of tokenmill.filters.decontam.eval_sets (named here so that --help imports nothing).
LAYOUT_NAMES = ("question-choices-answer", "prompt-completion", "passage-question")


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
        help="build the index of evaluation records",
        description=(
            "Read evaluation sets (JSON Lines or JSON, optionally .gz/.zst, or Parquet; a set per file, "
            "or named: --evals NAME=GLOB) in the common benchmark layouts, and write an index of each "
            "record's words and rare 4-word anchors (records under --long-words words: their whole "
            "text). Every file is checked before anything is written: a bad record fails the command "
            "naming its file and line or row. Nothing is downloaded."
        ),
        epilog="example: tokenmill decontam index --evals 'evals/*.jsonl' --evals mmlu='mmlu/test-*.parquet' "
        "--output decontam.index",
    )
    index.add_argument(
        "--evals",
        action="append",
        default=[],
        metavar="[NAME=]PATH_OR_GLOB",
        help="evaluation files, local or gs://...: unnamed, a set per file named after the file; named, "
        "one set of every file matched; repeatable",
    )
    index.add_argument(
        "--sets",
        metavar="YAML",
        help="a file listing the sets: name, files, layout and field mapping of each (docs/decontam.md)",
    )
    index.add_argument("--output", required=True, help="the index file to write")
    index.add_argument(
        "--fields",
        default="auto",
        metavar="LAYOUT|FIELD,FIELD",
        help="how a record becomes text: auto (the layout read from the first record; default), a layout "
        "(" + ", ".join(LAYOUT_NAMES) + "), LAYOUT:role=field,..., or fields joined in order (dotted "
        "paths; a trailing ? makes a field optional)",
    )
    index.add_argument(
        "--set-fields",
        action="append",
        default=[],
        metavar="SET=SPEC",
        help="--fields for one evaluation set, e.g. hellaswag=question=ctx,choices=endings,answer=label; "
        "repeatable",
    )
    index.add_argument(
        "--long-words",
        type=int,
        default=13,
        help="records of at least this many words are matched edit-tolerantly, shorter ones whole "
        "(default 13)",
    )
    index.add_argument(
        "--min-words",
        type=int,
        default=6,
        help="shorter records are matched whole if they have at least this many words (default 6); "
        "shorter ones are skipped and counted",
    )
    index.add_argument(
        "--template-records",
        type=int,
        default=10,
        help="a 4-word run that this many distinct records of one set share is the set's template or a "
        "stock phrase: it neither finds nor counts towards an item (default 10)",
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
            raise UsageError(f"--set-fields {value!r}: expected SET=SPEC")
        result[name.strip()] = FieldSpec.parse(fields)
    return result


def run_decontam_index(args: argparse.Namespace) -> int:
    from tokenmill.filters.decontam import (
        DecontamError,
        FieldSpec,
        build_index,
        eval_set_sources,
        load_sets_file,
        read_eval_sets,
    )

    started = time.monotonic()
    if not args.evals and not args.sets:
        raise UsageError("name the evaluation sets: --evals PATH_OR_GLOB or --sets FILE")
    try:
        sources = load_sets_file(args.sets) if args.sets else []
        sources += eval_set_sources(
            args.evals, FieldSpec.parse(args.fields), _parse_set_fields(args.set_fields)
        )
        names = [source.name for source in sources]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise DecontamError(f"evaluation set named in --sets and --evals: {', '.join(twice)}")
        eval_sets = read_eval_sets(sources)
        index = build_index(
            eval_sets,
            long_words=args.long_words,
            min_words=args.min_words,
            template_records=args.template_records,
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
    anchors, words = (arrays.get(name, {}).get("length", 0) for name in ("anchor_hash", "words"))
    lines = [
        f"{path}: format {header['format_version']}, {header['normalization']}, {header['records']:,} "
        f"records (edit-tolerant from {header['long_words']} words, whole from {header['min_words']}), "
        f"{anchors:,} anchors, {words:,} words, {size / 2**20:.1f} MiB of arrays",
    ]
    for entry in header["sets"]:
        layout = f"layout {entry['layout']}, " if entry["layout"] else ""
        lines.append(
            f"  {entry['name']}: {entry['records']:,} records in {len(entry['files'])} file(s) "
            f"({entry['long_records']:,} long, {entry['short_records']:,} short, {entry['too_short']:,} too "
            f"short to match, {entry['template_only']:,} only template, {entry['duplicates']:,} duplicates, "
            f"{entry['empty']:,} empty), {entry['anchors']:,} anchors, {entry['template_anchors']:,} "
            f"template anchors dropped; {layout}fields {','.join(entry['fields'])}"
        )
    return "\n".join(lines)
