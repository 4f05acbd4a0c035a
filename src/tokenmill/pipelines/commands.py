"""Subcommands of the Beam pipelines: `tokenmill curate`."""

from __future__ import annotations

import argparse
import logging
import time
from typing import TYPE_CHECKING

from tokenmill import storage
from tokenmill.corpora.paths import expand_inputs
from tokenmill.errors import UsageError

if TYPE_CHECKING:
    from tokenmill.formats.stats import CurateStats
    from tokenmill.pipelines.warm_workers import WarmWorkers

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
    parser.add_argument(
        "--dedupe-against",
        action="append",
        default=[],
        metavar="INDEX",
        help="an earlier run's dedupe index (OUTPUT/dedupe-index, or a `tokenmill dedupe-index merge` "
        "output), local or gs://; the recipe's exact_dedupe and fuzzy_dedupe stages remove this run's "
        "copies and near copies of what it kept (reasons earlier_duplicate, earlier_near_duplicate); "
        "repeatable",
    )
    add_runner_arguments(parser)
    parser.set_defaults(handler=run_curate)

    index = subparsers.add_parser(
        "dedupe-index", help="dedupe indexes of curate runs: merge them for --dedupe-against"
    )
    actions = index.add_subparsers(dest="action", required=True)
    merge = actions.add_parser(
        "merge",
        help="the union of dedupe indexes, as one index",
        description="Copy the runs of each INDEX (OUTPUT/dedupe-index of a curate run, or an earlier merge) "
        "into --output with one manifest, so a crawl can be deduped against all earlier ones; a run in "
        "two inputs is taken once. Indexes with different MinHash parameters are refused.",
    )
    merge.add_argument("indexes", nargs="+", metavar="INDEX")
    merge.add_argument("--output", required=True, help="the merged index's folder, local or gs://...")
    merge.set_defaults(handler=run_merge_indexes)


def run_merge_indexes(args: argparse.Namespace) -> int:
    from tokenmill.pipelines.dedupe_index import DedupeIndexError, merge_indexes

    try:
        manifest = merge_indexes(args.indexes, args.output)
    except DedupeIndexError as error:
        raise UsageError(str(error)) from None
    print(
        f"merged {len(args.indexes)} indexes into {args.output}: {len(manifest.runs)} runs, "
        f"{manifest.documents:,} documents"
    )
    return 0


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
    from tokenmill.pipelines.options import start_warm_workers

    # First, before Beam is imported here: the workers' template starts and imports while this process
    # builds the job.
    warm_workers = start_warm_workers(args, CURATE_WORKER_MODULES)
    try:
        return _run_curate(args, warm_workers)
    finally:
        if warm_workers is not None:
            warm_workers.close()


#: What a curate worker imports (Beam's worker itself comes with every worker).
CURATE_WORKER_MODULES = ("tokenmill.pipelines.curate",)


def _run_curate(args: argparse.Namespace, warm_workers: WarmWorkers | None) -> int:
    from tokenmill.corpora.paths import input_root
    from tokenmill.pipelines.curate import CurateRun, build_pipeline, clear_previous_output, stage_seconds
    from tokenmill.pipelines.options import make_pipeline
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
        dedupe_against=list(getattr(args, "dedupe_against", None) or []),
    )
    log.info(
        "curate: %d input files, recipe %s (%s), output %s, runner %s",
        len(inputs),
        recipe.name,
        " -> ".join(recipe.stage_names()),
        args.output,
        args.runner,
    )
    for index in run.dedupe_against:
        if index.rstrip("/").startswith(args.output.rstrip("/") + "/"):
            raise UsageError(
                f"--dedupe-against {index} is inside --output {args.output}, which this run replaces; "
                "copy or merge it elsewhere first (tokenmill dedupe-index merge)"
            )
    dry_run = bool(getattr(args, "dry_run", False))
    # A dry run builds the job and touches nothing, so it neither reads nor clears the output.
    earlier = [] if dry_run else check_output(args.output, args.overwrite)
    pipeline = make_pipeline(args, "curate", warm_workers)
    from tokenmill.pipelines.dedupe_index import DedupeIndexError

    try:
        build_pipeline(pipeline, run)
    except DedupeIndexError as error:
        raise UsageError(str(error)) from None
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
