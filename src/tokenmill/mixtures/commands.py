"""`tokenmill mixture check|plan|diff|schema`: the command line of the mixtures stage.

Registration only declares arguments; pydantic and the planner are imported inside the handlers so that
`tokenmill --help` stays quick. Every spec problem becomes a UsageError of one line that names the file,
the YAML path and the line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import TYPE_CHECKING, Any

from tokenmill.errors import UsageError

if TYPE_CHECKING:
    from tokenmill.formats.plan import MixturePlan
    from tokenmill.formats.tokens import TokenCounts
    from tokenmill.mixtures.spec import Mixture


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `tokenmill mixture` and its actions to the `tokenmill` parser."""
    parser = subparsers.add_parser(
        "mixture",
        help="mixture specs (mixtures/*.yaml): check, plan, diff, schema; search: swarm, run, fit, propose",
        description=(
            "Validate, plan and compare mixture specs: phases with token budgets and weights over "
            "domain x quality cells, resolved against tokens/counts.json. See docs/mixtures.md."
        ),
    )
    actions = parser.add_subparsers(dest="mixture_action", metavar="ACTION")
    parser.actions = actions  # tokenmill.swarm.commands adds the search's actions (swarm, run, fit, ...)
    parser.set_defaults(handler=lambda args: parser.print_help() or 2)

    check = actions.add_parser(
        "check",
        help="validate specs (and plan them when their counts are known)",
        description="Validate each FILE; where its token counts are known (declared, --counts, or the spec's "
        "counts: file), also plan it, so that max_epochs and block rounding are checked too.",
    )
    check.add_argument("files", nargs="+", metavar="FILE")
    check.add_argument("--counts", metavar="PATH", help="tokens/counts.json to plan against")
    check.set_defaults(handler=run_check)

    plan = actions.add_parser(
        "plan",
        help="tokens, epochs and steps per phase and source",
        description="Resolve FILE against token counts: per phase, each source's weight, tokens, tokens "
        "available and epochs, and the phase's steps, start and end step (whole mixture blocks).",
        epilog="example: tokenmill mixture plan mixtures/demo.yaml "
        "--counts out/demo/tokens/counts.json --json",
    )
    plan.add_argument("file", metavar="FILE")
    plan.add_argument(
        "--counts",
        metavar="PATH",
        help="tokens/counts.json (default: the spec's counts: file if it exists, else declared counts)",
    )
    plan.add_argument("--json", action="store_true", help="print the plan as JSON (docs/formats.md)")
    plan.add_argument("--output", metavar="PATH", help="also write the JSON plan to PATH")
    plan.set_defaults(handler=run_plan)

    diff = actions.add_parser(
        "diff",
        help="what changed in tokens and epochs between two specs or revisions",
        description="Plan A and B and show what changed per phase and source: tokens, epochs, weights, "
        "steps. A and B are files, or git revisions written REV:PATH (HEAD~1:mixtures/x.yaml).",
    )
    diff.add_argument("a", metavar="A")
    diff.add_argument("b", metavar="B")
    diff.add_argument("--counts", metavar="PATH", help="tokens/counts.json to plan both against")
    diff.add_argument("--json", action="store_true", help="print the differences as JSON")
    diff.set_defaults(handler=run_diff)

    schema = actions.add_parser(
        "schema",
        help="JSON Schema of mixture specs, for editors",
        description="Print the JSON Schema of mixtures/*.yaml. With the YAML language server, save it and "
        "start a spec with `# yaml-language-server: $schema=<path to the schema>`.",
    )
    schema.add_argument("--output", metavar="PATH", help="write to PATH instead of standard output")
    schema.set_defaults(handler=run_schema)


def _usage(error: Exception) -> UsageError:
    file = getattr(error, "file", None)
    return UsageError(f"{file}: {error}" if file else str(error))


def _git_show(spec: str) -> str:
    if ":" not in spec:  # a parent reached by '..' out of the revision's folder: read the working tree
        try:
            with open(spec, encoding="utf-8") as handle:
                return handle.read()
        except OSError as error:
            raise UsageError(f"cannot read {spec}: {error}") from None
    revision, path = spec.split(":", 1)
    target = path if path.startswith(("/", "./")) else "./" + path
    try:
        result = subprocess.run(
            ["git", "show", f"{revision}:{target}"], capture_output=True, text=True, check=False, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise UsageError(f"{spec}: cannot run git: {error}") from None
    if result.returncode != 0:
        raise UsageError(f"{spec}: not a file, and git cannot show it: {result.stderr.strip()}")
    return result.stdout


def _load(arg: str) -> Mixture:
    """A spec from a file, or from git when written REV:PATH and no such file exists."""
    from tokenmill.mixtures.errors import MixtureError
    from tokenmill.mixtures.spec import load_mixture, load_mixture_text

    try:
        if os.path.exists(arg) or ":" not in arg:
            return load_mixture(arg)
        return load_mixture_text(_git_show(arg), arg, read=_git_show)
    except MixtureError as error:
        raise _usage(error) from None


def _counts(mixture: Mixture, path: str | None) -> tuple[TokenCounts | None, str | None]:
    """The counts to plan against and where they came from: --counts, else the spec's counts: file."""
    from tokenmill.mixtures.errors import MixtureError
    from tokenmill.mixtures.plan import load_counts

    chosen = path or (
        mixture.counts_path if mixture.counts_path and os.path.exists(mixture.counts_path) else None
    )
    if chosen is None:
        return None, None
    try:
        return load_counts(chosen), chosen
    except MixtureError as error:
        raise _usage(error) from None


def _tokens_dir(counts_file: str | None) -> str | None:
    """The tokens folder of a counts.json: where external evaluation sets are (eval/<name>/)."""
    return os.path.dirname(os.path.abspath(counts_file)) if counts_file else None


def _plan(mixture: Mixture, counts_arg: str | None) -> tuple[MixturePlan, str | None]:
    from tokenmill.mixtures.errors import MixtureError, NeedsCounts
    from tokenmill.mixtures.plan import plan_mixture

    counts, counts_file = _counts(mixture, counts_arg)
    try:
        return plan_mixture(mixture, counts, _tokens_dir(counts_file)), counts_file
    except NeedsCounts as error:
        if mixture.counts_path:
            raise UsageError(
                f"{mixture.file}: planning needs token counts, and its counts file {mixture.counts_path} "
                "does not exist yet: run the tokenize stage first, or pass --counts"
            ) from None
        raise _usage(error) from None
    except MixtureError as error:
        raise _usage(error) from None


def run_check(args: argparse.Namespace) -> int:
    from tokenmill.mixtures.errors import MixtureError, NeedsCounts
    from tokenmill.mixtures.plan import plan_mixture

    for file in args.files:
        mixture = _load(file)
        counts, counts_file = _counts(mixture, args.counts)
        kind = f"{len(mixture.phases)} phases, {len(mixture.sources)} sources"
        try:
            plan = plan_mixture(mixture, counts, _tokens_dir(counts_file))
        except NeedsCounts:
            print(f"{file}: ok ({mixture.name}: {kind}; not planned: it needs token counts, give --counts)")
            continue
        except MixtureError as error:
            raise _usage(error) from None
        against = counts_file or "declared counts"
        evaluated = f", {len(plan.evaluation)} evaluation sets" if plan.evaluation is not None else ""
        print(
            f"{file}: ok ({mixture.name}: {kind}, {plan.total_steps:,} steps{evaluated}, planned against "
            f"{against})"
        )
        for warning in plan.warnings:
            print(f"{file}: warning: {warning}", file=sys.stderr)
    return 0


def run_plan(args: argparse.Namespace) -> int:
    mixture = _load(args.file)
    plan, counts_file = _plan(mixture, args.counts)
    document = plan.to_json()
    if args.output:
        _write(args.output, json.dumps(document, indent=2) + "\n")
    if args.json:
        print(json.dumps(document, indent=2))
    else:
        print(render_plan(plan, counts_file))
    for warning in plan.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return 0


def _write(path: str, text: str) -> None:
    from tokenmill import storage

    storage.write_bytes(path, text.encode("utf-8"))


def run_diff(args: argparse.Namespace) -> int:
    from tokenmill.mixtures.diff import diff_plans

    plan_a, _ = _plan(_load(args.a), args.counts)
    plan_b, _ = _plan(_load(args.b), args.counts)
    changes = diff_plans(plan_a, plan_b)
    if args.json:
        print(json.dumps(changes, indent=2))
    else:
        print(render_diff(changes, args.a, args.b))
    return 0


def run_schema(args: argparse.Namespace) -> int:
    from tokenmill.mixtures.spec import mixture_json_schema

    text = json.dumps(mixture_json_schema(), indent=2) + "\n"
    if args.output:
        _write(args.output, text)
    else:
        sys.stdout.write(text)
    return 0


# ---------------------------------------------------------------------------------------------------------
# Text rendering


def _fc(value: float) -> str:
    from tokenmill.units import format_count

    return format_count(float(value), 4)


def _table(header: list[str], rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = []
    for row in [header, *rows]:
        cells = [row[0].ljust(widths[0])] + [
            cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)
        ]
        lines.append(indent + "  ".join(cells).rstrip())
    return lines


def render_plan(plan: MixturePlan, counts_file: str | None = None) -> str:
    """The plan as text: a header, one table per phase, then the run totals per source."""
    asked = "budgeted (phase shares and epochs refer to it)" if plan.total_steps_given else "asked"
    lines = [
        f"{plan.name}: {_fc(plan.total_tokens)} tokens {asked}, {_fc(plan.planned_tokens)} planned in "
        f"{plan.total_steps:,} steps of {plan.tokens_per_step:,} tokens ({plan.batch_size:,} x "
        f"{plan.sequence_length:,}){' (total_steps)' if plan.total_steps_given else ''}; mixture blocks of "
        f"{plan.block_size:,} sequences, boundaries every {plan.block_steps:,} step(s)",
        f"tokenizer {plan.tokenizer}; tokens available from {counts_file or 'declared counts'}"
        + (" (illustrative)" if plan.illustrative else "")
        + f"; shortfall: {plan.shortfall}",
    ]
    if plan.provenance:
        source = plan.provenance
        lines.append(f"from {source['repository']} {source['path']} at {source['commit']}")
    if plan.slice:
        lines.append(
            f"slice of {plan.slice.of} ({_fc(plan.slice.of_total_tokens)} tokens): "
            "each source scaled to "
            f"{plan.slice.fraction:.4%} of its tokens, so it repeats as often as in the full run"
        )
    for phase in plan.phases:
        lines.append("")
        partial = (
            f" and {phase.partial_block_sequences:,} sequences of one more"
            if phase.partial_block_sequences
            else ""
        )
        lines.append(
            f"phase {phase.name}: steps {phase.start_step:,} to {phase.end_step:,} ({phase.steps:,} steps, "
            f"{phase.blocks:,} blocks{partial}), {_fc(phase.tokens)} tokens "
            f"(asked {_fc(phase.tokens_requested)})"
        )
        rows = [
            [
                source.name,
                f"{source.weight:.4f}",
                f"{source.weight_requested:.4f}",
                _fc(source.tokens),
                _fc(source.tokens_available),
                f"{source.epochs:.3f}",
            ]
            for source in phase.sources
        ]
        lines.extend(_table(["source", "weight", "asked", "tokens", "available", "epochs"], rows))
    lines.append("")
    lines.append("run totals")
    counted = plan.tokens_from == "counts.json"
    rows = [
        [
            total.name,
            _fc(total.tokens),
            _fc(total.tokens_available),
            f"{total.epochs:.3f}",
            f"{total.max_epochs:g}",
            *([str(len(total.cells))] if counted else []),
        ]
        for total in plan.sources.values()
    ]
    header = ["source", "tokens", "available", "epochs", "max_epochs", *(["cells"] if counted else [])]
    lines.extend(_table(header, rows))
    if plan.evaluation is not None:
        lines.append("")
        lines.append("evaluation sets (zero training weight)")

        def counted_or_not(value: int | None) -> str:
            return "-" if value is None else _fc(value)

        rows = [
            [
                item.name,
                item.kind,
                str(len(item.cells)) if item.kind == "heldout" else "-",
                "-" if item.documents is None else f"{item.documents:,}",
                counted_or_not(item.tokens),
                counted_or_not(item.bytes),
            ]
            for item in plan.evaluation
        ]
        lines.extend(_table(["set", "kind", "cells", "documents", "tokens", "bytes"], rows))
    return "\n".join(lines)


def _change(name: str, values: list[Any]) -> str:
    old, new = values
    if name == "epochs" or name == "max_epochs":
        return f"epochs {old:.3f} -> {new:.3f}" if name == "epochs" else f"max_epochs {old:g} -> {new:g}"
    if name == "weight":
        return f"weight {old:.4f} -> {new:.4f}"
    if isinstance(old, int | float) and isinstance(new, int | float) and not isinstance(old, bool):
        if name in ("tokens", "tokens_available", "total_tokens", "planned_tokens", "tokens_per_step"):
            delta = new - old
            percent = f", {delta / old:+.1%}" if old else ""
            sign = "+" if delta >= 0 else "-"
            return f"{name} {_fc(old)} -> {_fc(new)} ({sign}{_fc(abs(delta))}{percent})"
        return f"{name} {old:,} -> {new:,}"
    return f"{name} {old} -> {new}"


def render_diff(changes: dict[str, Any], label_a: str, label_b: str) -> str:
    """The output of diff_plans as text, one line per changed phase or source."""
    lines = [f"{label_a} ({changes['a']}) -> {label_b} ({changes['b']})"]
    for name, values in changes["fields"].items():
        lines.append(f"  {_change(name, values)}")
    if not (changes["fields"] or changes["phases"] or changes["sources"]):
        lines.append("  no change in steps, tokens or epochs")
        return "\n".join(lines)
    width = max(
        [len(s["name"]) for p in changes["phases"] for s in p["sources"]]
        + [len(s["name"]) for s in changes["sources"]]
        + [0]
    )
    for phase in changes["phases"]:
        details = "; ".join(_change(name, values) for name, values in phase["changes"].items())
        lines.append(f"phase {phase['name']} ({phase['status']})" + (f": {details}" if details else ""))
        for source in phase["sources"]:
            details = "; ".join(_change(name, values) for name, values in source["changes"].items())
            lines.append(f"  {source['name'].ljust(width)}  {source['status']}: {details}")
    if changes["sources"]:
        lines.append("run totals")
        for source in changes["sources"]:
            details = "; ".join(_change(name, values) for name, values in source["changes"].items())
            lines.append(f"  {source['name'].ljust(width)}  {source['status']}: {details}")
    return "\n".join(lines)
