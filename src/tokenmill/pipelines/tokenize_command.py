"""The `tokenmill tokenize` subcommand: curated cells through the Beam tokenize pipeline
(tokenmill.pipelines.tokenize) into token shards and tokens/counts.json. The tokenizer's own subcommands
and `tokenize-eval`, which need no Beam, are tokenmill.tokenize.commands."""

from __future__ import annotations

import argparse

from tokenmill import storage
from tokenmill.tokenize.commands import DEFAULT_BATCH_DOCUMENTS, load_command_tokenizer
from tokenmill.units import format_count

# Kept equal to tokenmill.tokenize.heldout's defaults (not imported: it pulls in numpy).
DEFAULT_HELDOUT_FRACTION = 0.005
DEFAULT_HELDOUT_MAX_TOKENS = "4M"
DEFAULT_HELDOUT_MIN_DOCUMENTS = 1


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `tokenmill tokenize` to the `tokenmill` parser."""
    from tokenmill.pipelines.options import add_runner_arguments

    tokenize = subparsers.add_parser(
        "tokenize",
        help="tokenize curated cells into token shards and tokens/counts.json",
        description=(
            "Tokenize every curated cell (curated/domain=<d>/quality=<q>/*.parquet) with a Hugging Face "
            "tokenizer.json: one token shard per Parquet file (part-<n>.bin/.idx, uint16 when the vocabulary "
            "fits, else uint32, end-of-text after each document), a manifest.json per cell, each cell's "
            "held-out slice for evaluation (<cell>/heldout/, chosen by a hash of the document ids), then "
            "tokens/counts.json. Resumable: a rerun with --resume keeps shards that are complete and "
            "verified and redoes the rest; --overwrite starts over. See docs/tokenize.md."
        ),
    )
    tokenize.add_argument("--input", required=True, help="curated/ folder (output of `tokenmill curate`)")
    tokenize.add_argument("--output", required=True, help="tokens/ folder to write")
    tokenize.add_argument(
        "--tokenizer",
        required=True,
        help="Hugging Face tokenizer.json (from `tokenmill tokenizer train`, or any other)",
    )
    tokenize.add_argument(
        "--tokenizer-name",
        help="name recorded in manifests (default: from the tokenizer's "
        ".meta.json, else the file or folder name)",
    )
    tokenize.add_argument(
        "--eos-token",
        help="end-of-text token (default: the first of <|endoftext|>, "
        "<|end_of_text|>, </s>, <eos>, <|eos|> that the tokenizer has)",
    )
    tokenize.add_argument(
        "--batch-documents",
        type=int,
        default=DEFAULT_BATCH_DOCUMENTS,
        help=f"documents per encode_batch call (default {DEFAULT_BATCH_DOCUMENTS})",
    )
    tokenize.add_argument(
        "--progress-seconds",
        type=float,
        default=30.0,
        help="seconds between progress lines on a local run (0: none; default 30)",
    )
    tokenize.add_argument(
        "--repeat-by-cluster-size",
        type=int,
        metavar="CAP",
        help="write each document min(dup_cluster_size, CAP) times (the documents it stands for: itself, "
        "its exact copies and near duplicates; FineWeb-2's upsampling by cluster size); counts.json counts "
        "the repeated tokens. Default: every document once",
    )
    heldout = tokenize.add_argument_group(
        "held-out slices", "per cell, whole documents set aside for evaluation, chosen by a hash of their id"
    )
    heldout.add_argument(
        "--heldout-fraction",
        type=float,
        default=DEFAULT_HELDOUT_FRACTION,
        help="documents whose id hash falls below this fraction are held out "
        f"(default {DEFAULT_HELDOUT_FRACTION}; 0 turns held-out slices off)",
    )
    heldout.add_argument(
        "--heldout-max-tokens",
        default=DEFAULT_HELDOUT_MAX_TOKENS,
        help="cap per cell: candidates past it (in hash order) are reserved, neither trained on nor "
        f"evaluated (default {DEFAULT_HELDOUT_MAX_TOKENS})",
    )
    heldout.add_argument(
        "--heldout-min-documents",
        type=int,
        default=DEFAULT_HELDOUT_MIN_DOCUMENTS,
        help="a cell too small for the fraction holds out at least this many documents, the lowest hashes, "
        f"never more than half the cell (default {DEFAULT_HELDOUT_MIN_DOCUMENTS})",
    )
    rerun = tokenize.add_mutually_exclusive_group()
    rerun.add_argument(
        "--resume",
        action="store_true",
        help="finish or redo an earlier run in --output: keep its shards that are complete and verified for "
        "this input and tokenizer, tokenize the rest (refused if it holds shards this run would not write)",
    )
    rerun.add_argument(
        "--overwrite",
        action="store_true",
        help="delete an earlier run's files in --output (counts.json, cell folders' shards, markers, "
        "manifests) before this run; without --resume or --overwrite such a folder is refused",
    )
    add_runner_arguments(tokenize)
    for action in tokenize._actions:
        if action.dest == "workers":
            # Tokenize's own default (tokenmill.pipelines.tokenize.default_local_workers).
            action.help = (
                "local worker processes (default: one per 8 cores, at most one per shard: each worker's "
                "encode_batch already uses every core); on Dataflow, --num_workers"
            )
    tokenize.set_defaults(handler=_tokenize)


def _tokenize(args: argparse.Namespace) -> int:
    from tokenmill.errors import UsageError

    if args.runner == "dataflow":
        local = [flag for flag in ("input", "output", "tokenizer") if storage.is_local(getattr(args, flag))]
        if local:
            raise UsageError(
                "--runner dataflow reads and writes through cloud storage: give gs:// paths for "
                + ", ".join(f"--{flag}" for flag in local)
            )
    elif not storage.exists(args.input):
        raise UsageError(f"input not found: {args.input}")
    if args.batch_documents <= 0:
        raise UsageError("--batch-documents must be positive")
    if args.repeat_by_cluster_size is not None and args.repeat_by_cluster_size < 1:
        raise UsageError(f"--repeat-by-cluster-size must be at least 1, got {args.repeat_by_cluster_size}")
    args.heldout_rule = _heldout_rule(args)
    _, info = load_command_tokenizer(args.tokenizer, args.tokenizer_name, args.eos_token)

    from tokenmill.pipelines.tokenize import TokenizeError, run_tokenize

    try:
        summary = run_tokenize(args, args.tokenizer, info)
    except TokenizeError as error:
        raise UsageError(str(error)) from error
    if getattr(args, "dry_run", False):
        print("dry run: the job graph was built and validated, nothing was submitted")
        return 0
    written = summary.get("shards_written", 0)
    kept = summary.get("shards_kept", 0)
    seconds = summary["seconds"]
    new_tokens = summary.get("tokens_written", 0)
    print(
        f"tokenized {summary['cells']} cells, {summary['shards']} shards ({written} written, {kept} kept "
        f"as complete): {summary['documents']:,} documents, {summary['tokens']:,} tokens "
        f"({format_count(summary['tokens'])})"
    )
    rate = new_tokens / max(seconds, 1e-9)
    print(
        f"{new_tokens:,} tokens written in {seconds:.1f} s ({rate:,.0f} tokens/s); "
        f"tokenizer {info.name} (sha256 {info.sha256[:12]}…), {info.dtype}, end-of-text {info.eos_id}"
    )
    if args.heldout_rule.active:
        print(
            f"held out: {summary.get('heldout_documents', 0):,} documents, "
            f"{summary.get('heldout_tokens', 0):,} tokens (in <cell>/heldout/); "
            f"{summary.get('reserved_documents', 0):,} candidates past the per-cell cap reserved"
        )
    print(f"catalog: {storage.join(args.output, 'counts.json')}")
    return 0


def _heldout_rule(args: argparse.Namespace):
    from tokenmill.errors import UsageError
    from tokenmill.tokenize.heldout import make_rule
    from tokenmill.units import parse_count

    if not 0 <= args.heldout_fraction < 1:
        raise UsageError(f"--heldout-fraction {args.heldout_fraction} is not in [0, 1)")
    if args.heldout_min_documents < 0:
        raise UsageError("--heldout-min-documents must be >= 0")
    try:
        max_tokens = parse_count(args.heldout_max_tokens)
    except ValueError as error:
        raise UsageError(f"--heldout-max-tokens: {error}") from None
    return make_rule(args.heldout_fraction, max_tokens, args.heldout_min_documents)
