"""Subcommands of the Beam pipelines: `tokenmill curate`."""

from __future__ import annotations

import argparse
import logging
import os
import time
from typing import TYPE_CHECKING

from tokenmill import storage
from tokenmill.errors import UsageError

if TYPE_CHECKING:
    from tokenmill.formats.stats import CurateStats

log = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    from tokenmill.pipelines.options import add_runner_arguments

    parser = subparsers.add_parser(
        "curate",
        help="raw corpora -> curated Parquet cells, removed documents, rejected input, stats.json",
        description=(
            "Read raw corpora (JSON Lines, plain/.gz/.zst; Parquet; WARC, plain/.gz), normalize, run the "
            "recipe's stages (language id, exact and fuzzy dedupe, domain and quality classifiers, "
            "per-domain filter chains, decontamination, datatrove heuristic filters, ...) and write "
            "OUTPUT/curated/domain=<d>/quality=<q>/, OUTPUT/removed/stage=<s>/reason=<r>/, "
            "OUTPUT/rejected/ and OUTPUT/stats.json. Reruns give identical output; an OUTPUT that holds an "
            "earlier run is refused unless --overwrite."
        ),
        epilog="example: tokenmill curate --recipe configs/curate/web.yaml --input 'raw/*.jsonl.zst' "
        "--output out/",
    )
    parser.add_argument("--recipe", required=True, help="curation recipe YAML (configs/curate/*.yaml)")
    parser.add_argument(
        "--input",
        required=True,
        action="append",
        metavar="PATH_OR_GLOB",
        help="input files: a path or glob, local or gs://... (format by extension); repeatable",
    )
    parser.add_argument("--output", required=True, help="output folder, local or gs://...")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier run's output in --output (curated/, removed/, rejected/, stats.json; "
        "nothing else there is touched); without it such a folder is refused",
    )
    add_runner_arguments(parser)
    parser.set_defaults(handler=run_curate)


def expand_inputs(patterns: list[str]) -> list[str]:
    """Every file the patterns name, in sorted order; a pattern that matches nothing is an error."""
    files: list[str] = []
    for pattern in patterns:
        matches = storage.expand_glob(pattern)
        if not matches:
            is_folder = storage.is_local(pattern) and os.path.isdir(storage.local_path(pattern))
            what = "is a folder; give a glob such as DIR/*.jsonl.zst" if is_folder else "matches no file"
            raise UsageError(f"--input {pattern!r} {what}")
        files.extend(matches)
    return sorted(dict.fromkeys(files))


def earlier_run_parts(output: str) -> list[str]:
    """The parts of an earlier curate run that `output` holds (a folder with files, or stats.json)."""
    from tokenmill.pipelines.curate import OUTPUT_PARTS

    found = []
    for part in OUTPUT_PARTS:
        path = storage.join(output, part)
        if storage.exists(path) if part.endswith(".json") else storage.is_dir_nonempty(path):
            found.append(part)
    return found


def check_output(output: str, overwrite: bool) -> list[str]:
    """Refuse an output folder that holds an earlier run unless `overwrite`; returns the parts found.

    A new run's files beside an old run's (old `part-*-of-M` files, a stale stats.json) would be taken
    for one output, so they are never mixed: the caller clears the parts before the run starts.
    """
    earlier = earlier_run_parts(output)
    if earlier and not overwrite:
        raise UsageError(
            f"--output {output} holds an earlier curate run ({', '.join(earlier)}); pass --overwrite to "
            "delete it before this run, or give another folder"
        )
    return earlier


def run_curate(args: argparse.Namespace) -> int:
    from tokenmill.pipelines.curate import CurateRun, build_pipeline, clear_previous_output, stage_seconds
    from tokenmill.pipelines.options import make_pipeline
    from tokenmill.pipelines.readers import input_root
    from tokenmill.pipelines.recipe import RecipeError, load_recipe

    try:
        recipe = load_recipe(args.recipe)
    except RecipeError as error:
        raise UsageError(str(error)) from None
    inputs = expand_inputs(args.input)
    run = CurateRun(
        recipe=recipe,
        recipe_path=args.recipe,
        inputs=inputs,
        output=args.output,
        input_root=input_root(args.input),
    )
    log.info(
        "curate: %d input files, recipe %s (%s), output %s, runner %s",
        len(inputs),
        recipe.name,
        " -> ".join(recipe.stage_names()),
        args.output,
        args.runner,
    )
    dry_run = bool(getattr(args, "dry_run", False))
    # A dry run builds the job and touches nothing, so it neither reads nor clears the output.
    earlier = [] if dry_run else check_output(args.output, args.overwrite)
    pipeline = make_pipeline(args, "curate")
    build_pipeline(pipeline, run)
    if earlier:  # only once the job graph is built: a recipe or graph error leaves the old output alone
        log.info("--overwrite: removing the earlier run's %s from %s", ", ".join(earlier), args.output)
        clear_previous_output(args.output)
    started = time.monotonic()
    result = pipeline.run()
    result.wait_until_finish()
    elapsed = time.monotonic() - started
    if dry_run or result.state != "DONE":  # any runner that waited for the job: its output is there
        log.info("submitted; state %s", result.state)
        return 0
    from tokenmill.formats.stats import STATS, read_stats

    stats = read_stats(storage.join(args.output, STATS))
    print(summary(stats, elapsed))
    seconds = stage_seconds(result)
    if seconds:
        print(
            "  CPU seconds inside each step: "
            + ", ".join(
                f"{stage} {value:.2f}" for stage, value in sorted(seconds.items(), key=lambda item: -item[1])
            )
        )
    if not stats.balanced:
        print("ERROR: documents read != kept + removed + rejected; see stats.json")
        return 1
    return 0


def summary(stats: CurateStats, elapsed: float) -> str:
    read = stats.read.documents
    lines = [
        f"curate done in {elapsed:.1f}s: {read:,} documents read ({read / max(elapsed, 1e-9):,.0f}/s), "
        f"{stats.kept.documents:,} kept, {stats.removed.documents:,} removed, "
        f"{stats.rejected.documents:,} rejected; balanced: {stats.balanced}",
        f"  kept: {stats.kept.characters:,} characters, ~{stats.kept.tokens_estimated:,} tokens "
        f"in {len(stats.cells)} cells",
    ]
    for key, entry in stats.removed_by_reason.items():
        lines.append(f"  removed {key}: {entry.documents:,}")
    for kind, rejected in stats.rejected_by_error.items():
        lines.append(f"  rejected {kind}: {rejected.documents:,}")
    return "\n".join(lines)
