"""`tokenmill eval`: score a run's checkpoint on evaluation sets, as the run itself does while it trains.

The run folder's config.json gives the model, the plan (whose evaluation sets are the default) and the
tokenizer; the checkpoint (latest, or --step) is restored into the train state's layout on this process's
devices (one, or a mesh) and scored by tokenmill.trainer.run.evaluate with the run's sequence length and
evaluation settings, so the records equal the run's own at that step. Sets whose shards were made with
another tokenizer are refused, the error naming both hashes.
"""

from __future__ import annotations

import argparse
import logging

from tokenmill.errors import UsageError

log = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `tokenmill eval` to the `tokenmill` parser."""
    parser = subparsers.add_parser(
        "eval",
        help="evaluate a run's checkpoint on its held-out slices and evaluation sets (loss, bits per byte)",
        description="Restore a checkpoint of a run (runs/NAME, local or gs://; the latest, or --step N) and "
        "score it on the plan's evaluation sets, or on those --set names (a set of the plan, an external "
        "set tokens/eval/NAME, or a cell's held-out slice heldout/CELL). Prints a table; --output writes "
        'the eval.jsonl records (docs/formats.md, "Evaluation"). See docs/trainer.md, "Held-out '
        'evaluation".',
    )
    parser.add_argument("run", help="the run folder (with config.json and checkpoints/)")
    parser.add_argument("--step", type=int, help="the checkpoint's step (default: the latest)")
    parser.add_argument(
        "--set", dest="sets", action="append", metavar="NAME", help="an evaluation set (repeatable)"
    )
    parser.add_argument("--tokens", help="the token shards folder (default: the run's data.tokens)")
    parser.add_argument("--sequences", type=int, help="sequences per set (default: the run's)")
    parser.add_argument(
        "--dispatch", choices=["dropless", "capacity", "both"], help="default: the run's evaluation.dispatch"
    )
    parser.add_argument(
        "--mesh", metavar="DATA,FSDP,EXPERT", help="mesh sizes (default: every device on fsdp)"
    )
    parser.add_argument("--output", metavar="PATH", help="write the records (JSON Lines) to PATH")
    parser.add_argument("--json", action="store_true", help="print the records as JSON Lines, not a table")
    parser.set_defaults(handler=_eval)


def _eval(args: argparse.Namespace) -> int:
    from tokenmill import storage
    from tokenmill.formats.evals import eval_line
    from tokenmill.trainer.run.evaluate import evaluate_checkpoint

    try:
        records = evaluate_checkpoint(
            args.run,
            step=args.step,
            sets=args.sets,
            tokens=args.tokens,
            sequences=args.sequences,
            dispatch=args.dispatch,
            mesh_text=args.mesh,
        )
    except (ValueError, KeyError, OSError) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        raise UsageError(f"tokenmill eval {args.run}: {message}") from error
    if args.output:
        with storage.atomic_write(args.output, "w") as handle:
            handle.writelines(eval_line(record) for record in records)
    if args.json:
        print("".join(eval_line(record) for record in records), end="")
    else:
        print(table(records))
    return 0


def table(records) -> str:
    """The records as a fixed-width table: one line per set and dispatch."""
    if not records:
        return "no evaluation sets"
    first = records[0]
    head = f"step {first.step}" + (f" ({first.phase})" if first.phase else "")
    lines = [head, f"{'set':<32} {'dispatch':<9} {'loss':>8} {'bits/byte':>10} {'tokens':>10} {'bytes':>11}"]
    for r in records:
        tokens = "" if r.tokens is None else str(r.tokens)
        num_bytes = "" if r.bytes is None else str(r.bytes)
        values = f"{r.loss:>8.4f} {r.bits_per_byte:>10.4f} {tokens:>10} {num_bytes:>11}"
        lines.append(f"{r.set:<32} {r.dispatch:<9} {values}")
    return "\n".join(lines)
