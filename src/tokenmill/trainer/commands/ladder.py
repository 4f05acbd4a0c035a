"""`tokenmill ladder plan` and `tokenmill ladder fit`: a scaling ladder's rungs, then its forecast."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from tokenmill.errors import UsageError
from tokenmill.units import format_count, parse_count


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `tokenmill ladder` to the `tokenmill` parser."""
    parser = subparsers.add_parser(
        "ladder",
        help="scaling ladder: plan rungs from a model family, fit loss against compute, forecast a big run",
        description="Plan the rungs of a scaling ladder (configs/ladders/*.yaml) and, once they are trained, "
        "fit L(C) = E + A*C^-alpha to their losses and forecast the big run (the shared-exponent procedure, "
        "or Marin's: E fixed at 1.5, a law per 5% of training). See docs/ladder.md.",
    )
    sub = parser.add_subparsers(dest="ladder_command", metavar="ACTION")
    plan = sub.add_parser(
        "plan",
        help="each rung's tokens (k x active parameters), steps, FLOPs and mixture slice",
        description="Lay out the rungs of a ladder spec: tokens from the tokens-per-active-parameter rule "
        "(rounded to whole mixture blocks, or to whole steps), compute (Marin's forecast C and the "
        "trainer's FLOPs), steps, the optimizer settings Marin's heuristic gives (Marin family) and each "
        "rung's mixture as a slice of the big one (every source repeats as often as at the big run's "
        "budget).",
    )
    plan.add_argument("spec", help="a ladder spec, e.g. configs/ladders/marin.yaml")
    plan.add_argument(
        "--counts",
        help="tokens/counts.json to plan against (default: the mixture's counts: file if it "
        "exists, else the declared counts)",
    )
    plan.add_argument(
        "--output", metavar="DIR", help="write each rung's slice spec (RUNG.yaml) and ladder-plan.json here"
    )
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(handler=_ladder_plan)

    fit = sub.add_parser(
        "fit",
        help="fit loss against compute over trained rungs and forecast the target's loss",
        description="Read each run's metrics.jsonl and config.json, take the smoothed loss at matched "
        "fractions of each run's planned steps, fit L(C) = E + A_f*C^-alpha (--procedure shared: E and alpha "
        "shared, one A per fraction, C the trainer's FLOPs; --procedure marin: E fixed, A and alpha per "
        "fraction at every 5%, C Marin's forecast compute) and forecast the target's loss with a bootstrap "
        "band. Writes ladder.json.",
    )
    fit.add_argument("runs", nargs="*", metavar="RUN_DIR", help="the rungs' run folders, e.g. runs/rung-*/")
    target = fit.add_argument_group("target (one of)")
    target.add_argument("--target", metavar="FLOPS", help="the target's training FLOPs, e.g. 2.7e24")
    target.add_argument(
        "--target-model", metavar="FILE", help="the target's model shape (with --target-tokens)"
    )
    target.add_argument("--target-tokens", metavar="N", help="the target's training tokens, e.g. 18.75T")
    target.add_argument(
        "--target-sequence-length", type=int, help="the target's sequence length (default: the model's)"
    )
    target.add_argument("--ladder", metavar="SPEC", help="take the target from a ladder spec")
    target.add_argument(
        "--target-run",
        metavar="DIR",
        help="the target's own run folder: its compute if no other target is "
        "given, and its actual losses at the same fractions, to compare with the forecast",
    )
    fit.add_argument(
        "--procedure",
        choices=["shared", "marin"],
        default="shared",
        help="shared: E and alpha shared by all fractions; marin: the reference run's forecast, E fixed "
        "(--asymptote), A and alpha fitted separately at each fraction (default %(default)s)",
    )
    fit.add_argument(
        "--metric",
        metavar="NAME",
        help="the logged metric to fit: loss (training loss, smoothed) or eval:SET:MEASURE[:DISPATCH] from "
        "the runs' eval.jsonl, SET an evaluation set or average (heldout_macro, macro, micro), MEASURE loss "
        "or bits_per_byte, DISPATCH dropless (default) or capacity (default: eval:heldout_macro:"
        "bits_per_byte, marin eval:heldout_macro:loss, when every run has it; loss otherwise)",
    )
    fit.add_argument(
        "--asymptote", type=float, default=1.5, help="marin: the fixed irreducible loss (default %(default)s)"
    )
    fit.add_argument(
        "--fractions",
        help="fractions of each run's planned steps (default 0.25,0.5,0.75,1; marin: every 0.05)",
    )
    fit.add_argument(
        "--window",
        type=float,
        help="smoothing window, a fraction of each run's planned steps (default 0.1; marin 0.05; at least 5 "
        "steps and one mixture block)",
    )
    fit.add_argument("--bootstrap", type=int, default=400, help="bootstrap replicates (default %(default)s)")
    fit.add_argument("--level", type=float, default=0.95, help="band coverage (default %(default)s)")
    fit.add_argument("--seed", type=int, default=0, help="bootstrap seed (default %(default)s)")
    fit.add_argument(
        "--output",
        metavar="PATH",
        help="where to write the fit: a .json file or a folder (ladder.json in it); "
        "default: ladder.json in the runs' common parent folder",
    )
    fit.add_argument("--json", action="store_true", help="print the fit as JSON instead of a table")
    fit.set_defaults(handler=_ladder_fit)
    parser.set_defaults(handler=lambda args: parser.print_help() or 2)


def _ladder_plan(args: argparse.Namespace) -> int:
    from tokenmill.trainer.ladder import LadderError, load_ladder, plan_ladder

    try:
        ladder = load_ladder(args.spec)
        counts = _ladder_counts(args.counts, ladder.mixture)
        result = plan_ladder(ladder, counts, args.output)
    except LadderError as error:
        raise UsageError(str(error)) from error
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
        return 0
    _print_ladder_plan(result)
    if args.output:
        print(f"wrote {len(result['rungs'])} slice specs and ladder-plan.json to {args.output}")
    return 0


def _ladder_counts(path: str | None, mixture_file: str) -> dict | None:
    """The counts.json to plan against: --counts, else the mixture's own counts: file when it exists."""
    from tokenmill.mixtures import MixtureError, load_counts, load_mixture

    try:
        if path:
            return load_counts(path)
        counts_path = load_mixture(mixture_file).counts_path
        return load_counts(counts_path) if counts_path and Path(counts_path).exists() else None
    except MixtureError as error:
        raise UsageError(str(error)) from error


def _print_ladder_plan(result: dict) -> None:
    target = result["target"]
    rounded = "whole steps" if result.get("round_to") == "steps" else "whole mixture blocks"
    print(
        f"ladder {result['name']}: {len(result['rungs'])} rungs, {result['tokens_per_active_param']:g} "
        f"tokens per active parameter (rounded to {rounded}), slices of {result['mixture']} "
        f"({format_count(result['mixture_tokens'], 4)} tokens)"
    )

    def batch(item: dict) -> str:
        """racks x sequences per rack x sequence length, or batch x sequence length."""
        if not item.get("batch_size"):
            return ""
        racks = item.get("racks")
        sequences = f"{racks} x {item['batch_size'] // racks:,}" if racks else f"{item['batch_size']:,}"
        return f"{sequences} x {item['sequence_length']:,}"

    header = ("rung", "model", "total", "active", "tokens", "tok/active", "sequences x length", "steps",
              "C forecast", "FLOPs")  # fmt: skip
    rows = []
    for rung in result["rungs"]:
        rows.append(
            (
                rung["name"],
                rung["model_name"],
                format_count(rung["total_params"], 4),
                format_count(rung["active_params"], 4),
                format_count(rung["tokens"], 4),
                f"{rung['tokens_per_active_param']:.1f}",
                batch(rung),
                f"{rung['steps']:,}",
                f"{rung['forecast_compute']:.4g}",
                f"{rung['flops']:.3g}",
            )
        )
    steps = target.get("steps")
    rows.append(
        (
            "target",
            target["name"],
            format_count(target["total_params"], 4),
            format_count(target["active_params"], 4),
            format_count(target["tokens"], 4),
            f"{target['tokens_per_active_param']:.1f}",
            batch(target) or f"{target['sequence_length']}",
            f"{steps:,}" if steps else "",
            f"{target['forecast_compute']:.4g}",
            f"{target['flops']:.3g}",
        )
    )
    widths = [max(len(str(row[i])) for row in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        print(
            "  "
            + "  ".join(
                str(cell).ljust(w) if i < 2 else str(cell).rjust(w)
                for i, (cell, w) in enumerate(zip(row, widths))
            )
        )
    print(
        "  C forecast: Marin's compute (no head, full-span attention); FLOPs: the trainer's counter "
        "(6 x active + causal attention), what MFU and the shared fit use"
    )
    for label, item in [*((rung["name"], rung) for rung in result["rungs"]), ("target", target)]:
        optimizer = item.get("optimizer")
        if optimizer:
            print(
                f"  {label}: muonh lr {optimizer['lr']:.4g} (adam {optimizer['adam_lr']:.4g}), "
                f"beta1 {optimizer['beta1']:g}, beta2 {optimizer['beta2']:.4g}, "
                f"epsilon {optimizer['epsilon']:.3g}, {optimizer['warmup_steps']:,} warmup steps, "
                f"linear to {optimizer['min_lr_ratio']:g} ({optimizer['heuristic']})"
            )
    for rung in result["rungs"]:
        phases = ", ".join(f"{p['name']} {p['start_step']:,}-{p['end_step']:,}" for p in rung["phases"])
        gap = rung["epoch_gap"]
        line = (
            f"  {rung['name']}: steps {phases}; slice {rung['slice_fraction']:.4g} of the big run's budget; "
            f"epochs per source within {100 * gap['run']:.2g}% of the big run's "
            f"(per phase {100 * gap['phase']:.2g}%)"
        )
        compare = rung.get("compare")
        if compare:
            line += (
                f"; shipped {compare['name']}: {format_count(compare['tokens'], 4)} tokens, "
                f"{compare['steps']:,} steps of {compare['batch_size']:,}, "
                f"rule {100 * compare['tokens_difference']:+.1f}%"
            )
        print(line)
        for warning in rung["warnings"]:
            print(f"  warning: {rung['name']}: {warning}")
    for warning in target.get("warnings", []):
        print(f"  warning: target: {warning}")
    if result.get("mixture_warnings"):
        print(
            f"  the mixture's plan has {len(result['mixture_warnings'])} warnings, the same in every slice "
            f"(`tokenmill mixture plan {result['mixture']}` lists them)"
        )
    names = list(result["full_epochs"])
    if len(names) > 24:
        print(f"epochs of each of the {len(names)} sources: --json (full_epochs, rungs[].epochs)")
    elif names:
        print("epochs per source over the run (big run, then each rung):")
        width = max(len(n) for n in ["source", *names])
        labels = ["big run", *(r["name"] for r in result["rungs"])]
        columns = [max(9, len(label)) for label in labels]
        print("  " + "source".ljust(width) + "  " + "  ".join(x.rjust(w) for x, w in zip(labels, columns)))
        for name in names:
            values = [result["full_epochs"][name], *(r["epochs"].get(name, 0.0) for r in result["rungs"])]
            print("  " + name.ljust(width) + "  " + "  ".join(f"{v:{w}.4f}" for v, w in zip(values, columns)))


def _ladder_fit(args: argparse.Namespace) -> int:
    from tokenmill.trainer.ladder import (
        LadderError,
        fit_ladder,
        load_ladder,
        read_run,
        target_from_model,
        target_of,
    )

    if not args.runs:
        raise UsageError("give the rungs' run folders, e.g. runs/ladder/rung-*/")
    try:
        given = args.fractions.split(",") if args.fractions else []
        fractions = tuple(float(f) for f in given if f.strip()) or None
    except ValueError as error:
        raise UsageError(f"--fractions: not a list of numbers: {args.fractions!r}") from error
    if args.bootstrap < 0:
        raise UsageError("--bootstrap must be 0 or more")
    given = [name for name, value in (("--target", args.target), ("--target-model", args.target_model),
                                      ("--ladder", args.ladder)) if value]  # fmt: skip
    if len(given) > 1:
        raise UsageError(f"give one target: {' and '.join(given)} both given")
    if bool(args.target_model) != bool(args.target_tokens):
        raise UsageError("--target-model and --target-tokens go together")
    try:
        runs = [read_run(path) for path in args.runs]
        target_run = read_run(args.target_run) if args.target_run else None
        if args.target:
            try:
                flops = float(args.target)
            except ValueError:
                flops = float(parse_count(args.target))
            if not flops > 0:
                raise UsageError(f"--target must be a positive number of FLOPs, not {args.target!r}")
            target = {"name": None, "flops": flops}
        elif args.target_model:
            target = target_from_model(
                args.target_model, parse_count(args.target_tokens), args.target_sequence_length
            )
        elif args.ladder:
            target = target_of(load_ladder(args.ladder))
        elif target_run is not None:
            target = {
                "name": target_run.info.get("model"),
                "flops": float(target_run.flops[0])
                / (int(target_run.steps[0]) + 1)
                * target_run.planned_steps,
            }
            if target_run.forecast_per_step is not None:
                target["forecast_compute"] = target_run.forecast_per_step * target_run.planned_steps
        else:
            raise UsageError(
                "give the target: --target FLOPS, --target-model with --target-tokens, --ladder "
                "SPEC or --target-run DIR"
            )
        result = fit_ladder(
            runs,
            target,
            fractions,
            args.window,
            args.bootstrap,
            args.seed,
            args.level,
            target_run,
            procedure=args.procedure,
            asymptote=args.asymptote,
            metric=args.metric,
        )
    except (LadderError, ValueError) as error:
        raise UsageError(str(error)) from error
    output = args.output
    if not output and all("://" not in run.path for run in runs):
        parents = {os.path.dirname(os.path.abspath(run.path)) for run in runs}
        output = os.path.relpath(os.path.join(os.path.commonpath(sorted(parents)), "ladder.json"))
    elif not output:
        output = "ladder.json"  # runs in a bucket: write here
    elif not output.endswith(".json"):
        output = os.path.join(output, "ladder.json")
    os.makedirs(os.path.dirname(output) or ".", exist_ok=True)
    Path(output).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
        return 0
    _print_ladder_fit(result)
    print(f"wrote {output}")
    return 0


def _print_ladder_fit(result: dict) -> None:
    fractions = result["fractions"]
    metric = result["metric"]
    print(f"metric: {metric['label']} ({metric['name']}), {metric['chosen']}")
    taken = (
        f"the evaluation nearest at or before each, within {result['window']:.0%} of its steps"
        if metric["source"] == "eval.jsonl"
        else f"loss smoothed over {result['window']:.0%} of its steps"
    )
    print(
        f"ladder fit: {len(result['runs'])} runs, {result['fit']['points']} points at "
        f"{', '.join(f'{f:.0%}' for f in fractions)} of each run's planned steps ({taken})"
    )
    by_run: dict[str, dict[float, dict]] = {}
    for point in result["points"]:
        by_run.setdefault(point["run"], {})[point["fraction"]] = point
    header = ["run", "steps", "FLOPs", *(f"L@{f:.0%}" for f in fractions)]
    rows = []
    for run in result["runs"]:
        mine = by_run.get(run["path"], {})
        rows.append(
            [run["path"], f"{run['planned_steps']:,}", f"{run['final_flops']:.3g}"]
            + [f"{mine[f]['loss']:.4f}" if f in mine else "-" for f in fractions]
        )
    widths = [max(len(str(row[i])) for row in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        print(
            "  "
            + "  ".join(
                str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(row, widths))
            )
        )
    fit = result["fit"]
    sd = f"residual sd {fit['residual_sd']:.4g}, " if fit["residual_sd"] is not None else ""
    if result.get("procedure") == "marin":
        laws = ", ".join(
            f"{float(f):.0%} A {fit['A'][f]:.4g} alpha {fit['alphas'][f]:.4f}" for f in fit["alphas"]
        )
        compute = "Marin's forecast C" if result.get("compute") == "forecast" else "the trainer's FLOPs"
        print(
            f"fit (Marin's procedure, C {compute}): L = {fit['E']:g} + A_f * C^-alpha_f per fraction: {laws} "
            f"({sd}{fit['dof']} degrees of freedom); final alpha band "
            f"[{fit['alpha_band'][0]:.4f}, {fit['alpha_band'][1]:.4f}]"
        )
    else:
        a = ", ".join(f"A@{float(f):.0%} {value:.4g}" for f, value in fit["A"].items())
        print(
            f"fit: L(C) = E + A_f * C^-alpha: E {fit['E']:.4f} [{fit['E_band'][0]:.4f}, "
            f"{fit['E_band'][1]:.4f}], alpha {fit['alpha']:.4f} [{fit['alpha_band'][0]:.4f}, "
            f"{fit['alpha_band'][1]:.4f}], {a} ({sd}{fit['dof']} degrees of freedom)"
        )
    target = result["target"]
    name = f" ({target['name']}, {format_count(target['tokens'], 4)} tokens)" if target.get("tokens") else ""
    band = result["band"]
    print(
        f"forecast for the target{name}: {metric['label']} at {target['flops']:.3e} FLOPs; "
        f"{band['level']:.0%} band from "
        f"{band['replicates'] - band['failed']} bootstrap fits:"
    )
    actual = {p["fraction"]: p for p in result.get("actual", [])}
    for item in result["forecast"]:
        line = (
            f"  {item['fraction']:>4.0%}  {item['flops']:.3e} FLOPs  {item['loss']:.4f}  "
            f"[{item['low']:.4f}, {item['high']:.4f}]"
        )
        if item["fraction"] in actual:
            line += f"  actual {actual[item['fraction']]['loss']:.4f}"
        print(line)
    for warning in result["warnings"]:
        print(f"warning: {warning}")
