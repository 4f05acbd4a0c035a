"""`tokenmill mixture swarm | run | fit | propose | validate`: mixture search from the command line (added to
`tokenmill mixture`, whose other actions live in tokenmill.mixtures.commands)."""

from __future__ import annotations

import argparse
import hashlib
import logging
from pathlib import Path

from tokenmill import storage
from tokenmill.errors import UsageError
from tokenmill.units import parse_count

log = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the search's actions to `tokenmill mixture` (registered before this)."""
    actions = subparsers.choices["mixture"].actions

    swarm = actions.add_parser(
        "swarm",
        help="sample a swarm of proxy mixtures around a base mixture (mixture search, docs/search.md)",
        description="Sample N mixtures of one phase's sources (Dirichlet draws around the token-proportional "
        "prior, at a spread of concentrations; every one within each source's epoch cap at the base "
        "mixture's budget, no two alike) and write, per proxy, a mixture and a run configuration, plus "
        "swarm.json. The same command writes the same swarm.",
        epilog="example: tokenmill mixture swarm mixtures/demo-search.yaml --run-config configs/runs/"
        "swarm-proxy.yaml --tokens out/demo/tokens --proxies 32 --proxy-tokens 64K --output runs/swarm-demo",
    )
    swarm.add_argument(
        "base", metavar="BASE", help="the base mixture: its phase's sources are the dimensions"
    )
    swarm.add_argument("--run-config", required=True, metavar="FILE", help="the proxies' run configuration")
    swarm.add_argument("--output", required=True, metavar="DIR", help="the swarm's folder")
    swarm.add_argument("--proxies", type=int, default=32, metavar="N", help="proxies (default 32)")
    swarm.add_argument(
        "--proxy-tokens", required=True, metavar="TOKENS", help="one proxy's training budget: 64K, 2B, ..."
    )
    swarm.add_argument("--tokens", metavar="DIR", help="token shards (default: the base's counts: folder)")
    swarm.add_argument(
        "--phase", help="the phase to search (default: the first); the others keep their weights"
    )
    swarm.add_argument(
        "--seed", type=int, default=0, help="the sampling seed and the proxies' seed (default 0)"
    )
    swarm.add_argument(
        "--concentrations",
        metavar="C,C,...",
        help="Dirichlet concentrations cycled through, times sources x prior (default 0.2,0.5,1,2,5)",
    )
    swarm.add_argument("--overwrite", action="store_true", help="replace an existing swarm in --output")
    swarm.set_defaults(handler=run_swarm_command)

    run = actions.add_parser(
        "run",
        help="train a swarm's unfinished proxies on this machine (resumable)",
        description="Run the swarm's proxies on a pool of worker processes, each pinned to its share of the "
        "cores (and GPUs with --gpus); each proxy trains every phase and is evaluated at its end, dropless. "
        "Rerunning runs only what is unfinished. On a cluster: tokenmill launch slurm|jobset --swarm DIR.",
    )
    run.add_argument("swarm", metavar="SWARM", help="the swarm's folder")
    run.add_argument("--workers", type=int, default=1, help="proxies at a time (default 1)")
    run.add_argument(
        "--gpus", metavar="ID,ID,...", help="GPUs to split over the workers (CUDA_VISIBLE_DEVICES)"
    )
    run.add_argument("--limit", type=int, help="start at most this many proxies, then stop")
    run.set_defaults(handler=run_run_command)

    fit = actions.add_parser(
        "fit",
        help="fit each held-out metric of a swarm as a function of the weights (fit.json)",
        description="Collect the finished proxies' final evaluation and fit, per evaluation set and for the "
        "averages, a log-linear model (floor + exp(intercept + effects . weights), floor >= 0) and a "
        "Gaussian process; report their out-of-fold Spearman and R^2 (k-fold over proxies) and after how "
        "many proxies the fit stabilised. Refuses when a source's cells changed content since the swarm "
        "ran, unless --reuse-evidence.",
    )
    _evidence_arguments(fit)
    fit.add_argument("--folds", type=int, default=5, help="k of the k-fold (default 5)")
    fit.add_argument(
        "--measures",
        default="bits_per_byte",
        metavar="M,M",
        help="what to fit of each set: bits_per_byte, loss or both (default bits_per_byte)",
    )
    fit.set_defaults(handler=run_fit_command)

    propose = actions.add_parser(
        "propose",
        help="the mixture that minimises the fitted objective within every epoch cap",
        description="Optimise the fitted objective (default: held-out macro bits per byte) over the searched "
        "phase's weights, within each source's epoch cap at the target budget and with an optional pull "
        "toward the prior, and write the mixture (with its provenance), proposal.json (predicted metrics "
        "with their spread) and the diff against the base.",
    )
    _evidence_arguments(propose)
    propose.add_argument("--output", required=True, metavar="FILE", help="the proposed mixture's YAML")
    propose.add_argument(
        "--objective",
        action="append",
        metavar="METRIC[=WEIGHT]",
        help="a metric to minimise, SET:MEASURE (heldout_macro:bits_per_byte, heldout/domain=c00:loss); "
        "repeat for a weighted sum (default: heldout_macro:bits_per_byte)",
    )
    propose.add_argument("--kl-weight", type=float, default=0.0, help="pull toward the prior (default 0)")
    propose.set_defaults(handler=run_propose_command)

    validate = actions.add_parser(
        "validate",
        help="train the proposal, the prior and the uniform mixture longer, with several seeds",
        description="Train the proposal, the token-proportional and the uniform mixture at --compute x a "
        "proxy's tokens with each seed, and judge the proposal on the objective's first metric: it beats a "
        "mixture when its mean is lower by more than twice the seed standard deviation.",
    )
    validate.add_argument("swarm", metavar="SWARM")
    validate.add_argument("--compute", type=float, default=4.0, help="x a proxy's tokens (default 4)")
    validate.add_argument("--seeds", type=int, default=3, help="seeds per mixture (default 3)")
    validate.add_argument("--workers", type=int, default=1)
    validate.add_argument("--gpus", metavar="ID,ID,...")
    validate.add_argument("--metric", help="the metric judged (default: the proposal's objective's first)")
    validate.set_defaults(handler=run_validate_command)


def _evidence_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("swarm", metavar="SWARM", help="the swarm's folder")
    parser.add_argument(
        "--tokens", metavar="DIR", help="the corpus as it is now (default: the swarm's shards)"
    )
    parser.add_argument(
        "--base",
        metavar="FILE",
        help="the base mixture as it is now (default: the one the swarm recorded), e.g. with sources renamed",
    )
    parser.add_argument(
        "--reuse-evidence",
        action="store_true",
        help="use the proxies even though some sources' cells changed content (the record says which)",
    )
    parser.add_argument("--seed", type=int, default=0)


def _parse_gpus(text: str | None) -> tuple[str, ...]:
    return tuple(part for part in (text or "").split(",") if part)


def run_swarm_command(args: argparse.Namespace) -> int:
    from tokenmill.swarm.build import create_swarm
    from tokenmill.swarm.sample import DEFAULT_CONCENTRATIONS

    try:
        proxy_tokens = parse_count(args.proxy_tokens)
        concentrations = (
            tuple(float(c) for c in args.concentrations.split(","))
            if args.concentrations
            else DEFAULT_CONCENTRATIONS
        )
    except ValueError as error:
        raise UsageError(f"--proxy-tokens/--concentrations: {error}") from error
    manifest = create_swarm(
        args.base,
        args.run_config,
        args.output,
        args.proxies,
        proxy_tokens,
        seed=args.seed,
        phase=args.phase,
        tokens=args.tokens,
        concentrations=concentrations,
        overwrite=args.overwrite,
    )
    print(
        f"{args.output}: {len(manifest.proxies)} proxies of phase {manifest.phase} over "
        f"{len(manifest.sources)} sources ({', '.join(s.name for s in manifest.sources)}), "
        f"{manifest.proxy_tokens:,} tokens each; {manifest.rejected_over_cap} draws over an epoch cap and "
        f"{manifest.rejected_duplicate} duplicates redrawn; evaluated on {len(manifest.evaluation)} sets"
    )
    print(f"next: tokenmill mixture run {args.output} --workers N")
    return 0


def run_run_command(args: argparse.Namespace) -> int:
    from tokenmill.swarm.build import open_swarm
    from tokenmill.swarm.runner import run_jobs

    manifest = open_swarm(args.swarm)
    summary = run_jobs(
        args.swarm, args.swarm, manifest.proxies, args.workers, _parse_gpus(args.gpus), limit=args.limit
    )
    done = summary.skipped + len(summary.finished)
    print(
        f"{args.swarm}: {done} of {len(manifest.proxies)} proxies finished"
        + (f", {len(summary.failed)} failed: {', '.join(summary.failed)}" if summary.failed else "")
    )
    return 1 if summary.failed else 0


def _checked_evidence(args: argparse.Namespace):
    """The swarm, its sources' content now, and the recorded -> current source names; UsageError when the
    content changed and --reuse-evidence was not given."""
    from tokenmill.swarm.build import load_base, open_swarm, search_space
    from tokenmill.swarm.evidence import compare_sources, source_contents

    manifest = open_swarm(args.swarm)
    tokens = args.tokens or manifest.tokens
    if args.base:
        base = load_base(args.base, tokens, manifest.phase)
    else:
        from tokenmill.swarm.build import base_of

        base = base_of(manifest, tokens)
    names = search_space(base).names
    current = source_contents(base.plan, tokens, names)
    comparison = compare_sources(manifest.sources, current)
    reused: list[str] = []
    if not comparison.valid:
        if not args.reuse_evidence:
            raise UsageError(
                f"{args.swarm}: the swarm ran on other data: {comparison.describe()}. Its proxies say "
                "nothing "
                "about the new cells: run a new swarm, or give --reuse-evidence to use them anyway (the "
                "record says so)"
            )
        reused = comparison.changed + comparison.missing
        log.warning("reusing the evidence of changed sources: %s", comparison.describe())
    elif comparison.renamed:
        log.info("%s", comparison.describe())
    return manifest, base, comparison, current, reused


def run_fit_command(args: argparse.Namespace) -> int:
    from tokenmill.formats.swarm import write_fit
    from tokenmill.swarm.fit import fit_path, fit_swarm

    manifest, _, comparison, current, reused = _checked_evidence(args)
    # The content each of the swarm's sources has now (the fit's record; the swarm's own where it is gone).
    content = {s.name: current.get(comparison.names.get(s.name, ""), s.content) for s in manifest.sources}
    measures = tuple(m for m in args.measures.split(",") if m)
    unknown = [m for m in measures if m not in ("bits_per_byte", "loss")]
    if unknown or not measures:
        raise UsageError(f"--measures {args.measures!r}: bits_per_byte, loss or both")
    fit = fit_swarm(
        manifest,
        args.swarm,
        folds=args.folds,
        seed=args.seed,
        source_content=content,
        evidence_reused=reused,
        measures=measures,
    )
    write_fit(fit_path(args.swarm), fit)
    print(f"{fit_path(args.swarm)}: {len(fit.metrics)} metrics over {fit.proxies_finished} proxies")
    return 0


def run_propose_command(args: argparse.Namespace) -> int:
    from tokenmill.swarm.propose import propose

    manifest, base, comparison, _, reused = _checked_evidence(args)
    proposal = propose(args, manifest, base, comparison, reused)
    print(f"{args.output}: proposed weights of phase {proposal.phase}")
    width = max(len(name) for name in proposal.weights)
    for name, weight in proposal.weights.items():
        print(
            f"  {name:<{width}}  {weight:7.4f}  (prior {proposal.prior[name]:.4f}, "
            f"base {proposal.base[name]:.4f}, "
            f"{proposal.epochs[name]:.2f} of {proposal.max_epochs[name]:g} epochs)"
        )
    from tokenmill.mixtures.commands import render_diff

    print(render_diff(proposal.diff, manifest.base_mixture if not args.base else args.base, args.output))
    for predicted in proposal.predicted:
        print(
            f"  predicted {predicted.metric}: {predicted.loglinear:.4f} +- {predicted.loglinear_std:.4f} "
            f"(GP {predicted.gp:.4f} +- {predicted.gp_std:.4f})"
        )
    return 0


def run_validate_command(args: argparse.Namespace) -> int:
    from tokenmill.swarm.build import open_swarm
    from tokenmill.swarm.validate import validate

    manifest = open_swarm(args.swarm)
    result = validate(
        args.swarm,
        manifest,
        args.compute,
        list(range(args.seeds)),
        args.workers,
        _parse_gpus(args.gpus),
        args.metric,
    )
    print(f"{result.metric} at {result.compute_multiple:g}x a proxy's compute, {len(result.seeds)} seeds:")
    for arm in result.arms:
        print(
            f"  {arm.name:<9} {arm.mean:.4f} +- {arm.std:.4f}  ({', '.join(f'{v:.4f}' for v in arm.values)})"
        )
    for name, margin in result.margins.items():
        verdict = "beats" if result.beats[name] else "does not beat"
        print(f"  the proposal {verdict} {name} by {margin:+.4f} (2 sd: required)")
    return 0


def file_sha256(path: str) -> str:
    return (
        hashlib.sha256(Path(path).read_bytes()).hexdigest()
        if storage.is_local(path)
        else storage.file_sha256(path)
    )
