"""Subcommands of the reports stage: `tokenmill report` builds the public data-overview site (and with
--swarm a mixture search's page, alone or beside it)."""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

from tokenmill import storage
from tokenmill.errors import UsageError
from tokenmill.units import format_count

if TYPE_CHECKING:
    from tokenmill.formats.plan import MixturePlan

log = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add this stage's subcommands to the `tokenmill` parser."""
    parser = subparsers.add_parser(
        "report",
        help="build the static data-overview site (and a run page, a swarm page)",
        description=(
            "Build a static site that opens from disk or a bucket: tokens per domain and quality, sample "
            "documents, the curation funnel, the mixture per phase, with --run the training curves and "
            "with --swarm a mixture search's page. --swarm and --output alone write only swarm.html."
        ),
    )
    # Required unless --swarm is given alone (checked in run_report).
    parser.add_argument("--curated", metavar="DIR", help="curate's output folder (or its curated/)")
    parser.add_argument("--tokens", metavar="DIR", help="tokenize's output folder (counts.json)")
    plan = parser.add_mutually_exclusive_group()
    plan.add_argument(
        "--mixture", metavar="FILE", help="mixture spec (YAML), planned against the tokens' counts"
    )
    plan.add_argument("--plan", metavar="FILE", help="a precomputed plan (`tokenmill mixture plan --json`)")
    previous = parser.add_mutually_exclusive_group()
    previous.add_argument(
        "--previous-mixture", metavar="FILE", help="an earlier mixture spec, to show what changed"
    )
    previous.add_argument(
        "--previous-plan", metavar="FILE", help="an earlier precomputed plan, to show what changed"
    )
    parser.add_argument(
        "--run", metavar="DIR", help="a run folder (runs/NAME) with metrics.jsonl: adds run.html"
    )
    parser.add_argument(
        "--ladder",
        metavar="FILE",
        help="a scaling-ladder fit (`tokenmill ladder fit`'s ladder.json) to draw on the run page "
        "(default: the run folder's ladder.json, if any)",
    )
    parser.add_argument(
        "--swarm",
        metavar="DIR",
        help="a mixture search's folder (`tokenmill mixture swarm`): adds swarm.html; alone (with --output) "
        "writes only swarm.html",
    )
    parser.add_argument(
        "--output", default="site", metavar="DIR", help="where to write the site (default: site)"
    )
    parser.add_argument(
        "--samples-per-cell", type=int, default=5, metavar="N", help="sample documents per cell"
    )
    parser.add_argument(
        "--preview-chars", type=int, default=400, metavar="N", help="characters shown per sample"
    )
    parser.add_argument(
        "--removed-examples", type=int, default=3, metavar="N", help="examples per removal reason"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the sample draws (default 0)")
    parser.add_argument("--title", default="Data overview", help="page title")
    parser.add_argument(
        "--domains-model",
        metavar="DIR",
        help="topic-domain model (`tokenmill domains train`): terms and examples of the cNN domains",
    )
    parser.add_argument(
        "--quality-model",
        metavar="DIR",
        help="quality model folder (or its calibration.json): the quality cut points per content type",
    )
    parser.set_defaults(handler=run_report)


def _load_plan_file(path: str, what: str) -> MixturePlan:
    from tokenmill.errors import FormatError
    from tokenmill.formats.plan import read_plan

    if not storage.exists(path):
        raise UsageError(f"{what} {path}: no such file")
    try:
        return read_plan(path)
    except FormatError as error:
        raise UsageError(f"{what} {error}") from error


def _plan_mixture(path: str, tokens: str) -> MixturePlan:
    """Plan a mixture spec against the tokens' counts.json with tokenmill.mixtures (imported only here)."""
    if not storage.exists(path):
        raise UsageError(f"mixture {path}: no such file")
    from tokenmill.formats.tokens import COUNTS, read_counts
    from tokenmill.mixtures import load_mixture, plan_mixture

    counts_path = storage.join(tokens, COUNTS)
    if not storage.exists(counts_path):
        raise UsageError(f"{tokens}: no counts.json here (expected the tokenize output folder)")
    try:
        return plan_mixture(load_mixture(path), read_counts(counts_path))
    except (ValueError, KeyError) as error:
        raise UsageError(f"mixture {path}: {error}") from error


def run_report(args: argparse.Namespace) -> int:
    from tokenmill.reports.inputs import InputError
    from tokenmill.reports.overview import OverviewOptions
    from tokenmill.reports.site import build_site

    for name in ("samples_per_cell", "preview_chars", "removed_examples"):
        if getattr(args, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be 0 or more")
    for flag, path in (
        ("--curated", args.curated),
        ("--tokens", args.tokens),
        ("--run", args.run),
        ("--swarm", args.swarm),
    ):
        if path is not None and not storage.exists(path):
            raise UsageError(f"{flag} {path}: no such folder")
    site_inputs = (args.curated, args.tokens, args.mixture or args.plan)
    if args.swarm and not any(site_inputs):
        return _swarm_only(args)
    missing = [
        flag
        for flag, given in zip(("--curated", "--tokens", "--mixture or --plan"), site_inputs)
        if not given
    ]
    if missing:
        raise UsageError(
            f"{', '.join(missing)} required: the overview is built from curate's and tokenize's output and "
            "a mixture (or give only --swarm and --output for the swarm page alone)"
        )
    if args.ladder is not None:
        if not storage.exists(args.ladder):
            raise UsageError(f"--ladder {args.ladder}: no such file")
        if args.run is None:
            raise UsageError("--ladder draws the forecast on the run page: give --run too")
    if args.plan:
        plan = _load_plan_file(args.plan, "plan")
    else:
        plan = _plan_mixture(args.mixture, args.tokens)
    previous = None
    if args.previous_plan:
        previous = _load_plan_file(args.previous_plan, "previous plan")
    elif args.previous_mixture:
        previous = _plan_mixture(args.previous_mixture, args.tokens)
    options = OverviewOptions(
        samples_per_cell=args.samples_per_cell,
        preview_chars=args.preview_chars,
        removed_examples=args.removed_examples,
        rejected_examples=args.removed_examples,
        seed=args.seed,
        domains_model=args.domains_model,
        quality_model=args.quality_model,
    )
    try:
        result = build_site(
            curated=args.curated,
            tokens=args.tokens,
            plan=plan,
            output=args.output,
            previous_plan=previous,
            run=args.run,
            options=options,
            title=args.title,
            ladder=args.ladder,
            swarm=args.swarm,
        )
    except InputError as error:
        raise UsageError(str(error)) from error
    total = format_count(sum(result.files.values()))
    pages = ", ".join(
        storage.join(args.output, page)
        for page in ("index.html", "run.html", "swarm.html")
        if page in result.files
    )
    print(
        f"wrote {pages}: {len(result.files)} files, {total}B (index.html {format_count(result.index_bytes)}B)"
    )
    return 0


def _swarm_only(args: argparse.Namespace) -> int:
    """`tokenmill report --swarm DIR --output DIR`: swarm.html alone, other files in the folder left as
    they are."""
    from tokenmill.reports.inputs import InputError
    from tokenmill.reports.swarmpage import build_swarm_page

    others = [
        flag
        for flag, given in (
            ("--previous-mixture", args.previous_mixture),
            ("--previous-plan", args.previous_plan),
            ("--run", args.run),
            ("--ladder", args.ladder),
        )
        if given
    ]
    if others:
        raise UsageError(
            f"{', '.join(others)} belong to the overview site: give --curated, --tokens and --mixture or "
            "--plan too"
        )
    try:
        path = build_swarm_page(args.swarm, args.output)
    except InputError as error:
        raise UsageError(str(error)) from error
    print(f"wrote {path}")
    return 0
