"""Subcommands of the tokenize stage: `tokenmill tokenizer train|info` and `tokenmill tokenize`."""

from __future__ import annotations

import argparse
import json
import logging
import time

from tokenmill import storage
from tokenmill.units import format_count

log = logging.getLogger(__name__)
# Kept equal to tokenmill.tokenize.writer.DEFAULT_BATCH_DOCUMENTS (not imported: it pulls in numpy).
DEFAULT_BATCH_DOCUMENTS = 512


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add this stage's subcommands to the `tokenmill` parser."""
    from tokenmill.pipelines.options import add_runner_arguments

    tokenizer = subparsers.add_parser(
        "tokenizer",
        help="train or inspect a tokenizer",
        description="Train a byte-level BPE on curated text, or describe a Hugging Face tokenizer.json.",
    )
    tokenizer_commands = tokenizer.add_subparsers(dest="tokenizer_command", metavar="ACTION")
    tokenizer.set_defaults(handler=lambda args: tokenizer.print_help() or 2)

    train = tokenizer_commands.add_parser(
        "train",
        help="train a byte-level BPE tokenizer on curated Parquet text",
        description=(
            "Train a byte-level BPE (Hugging Face tokenizers) with <|endoftext|> as id 0 on the text "
            "column of curated Parquet files, streamed in batches. No normalizer: decoding gives back the "
            "exact text. Writes tokenizer.json and, beside it, <name>.meta.json with the tokenizer's "
            "name and sha256."
        ),
    )
    train.add_argument("--input", required=True, help="curated/ folder, a Parquet file, or a glob of them")
    train.add_argument("--output", required=True, help="tokenizer.json to write")
    train.add_argument(
        "--vocab-size", type=int, required=True, help="vocabulary size, special token included"
    )
    train.add_argument(
        "--max-documents",
        type=int,
        default=1_000_000,
        help="train on at most this many documents, spread over all files (default 1,000,000)",
    )
    train.add_argument(
        "--min-frequency", type=int, default=2, help="least count of a pair to merge (default 2)"
    )
    train.add_argument(
        "--name", help="name recorded in manifests (default tokenmill-bpe-<vocab>, e.g. tokenmill-bpe-8k)"
    )
    train.set_defaults(handler=_train)

    info = tokenizer_commands.add_parser(
        "info",
        help="print a tokenizer's name, sha256, vocabulary size, end-of-text id and shard dtype",
        description="Describe a Hugging Face tokenizer.json the way token manifests record it (JSON).",
    )
    info.add_argument("path", help="tokenizer.json")
    info.add_argument(
        "--eos-token",
        help="end-of-text token (default: the first of <|endoftext|>, "
        "<|end_of_text|>, </s>, <eos>, <|eos|> that the tokenizer has)",
    )
    info.set_defaults(handler=_info)

    tokenize = subparsers.add_parser(
        "tokenize",
        help="tokenize curated cells into token shards and tokens/counts.json",
        description=(
            "Tokenize every curated cell (curated/domain=<d>/quality=<q>/*.parquet) with a Hugging Face "
            "tokenizer.json: one token shard per Parquet file (part-<n>.bin/.idx, uint16 when the vocabulary "
            "fits, else uint32, end-of-text after each document), a manifest.json per cell, then "
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


def _load(path: str, name: str | None, eos_token: str | None):
    from tokenmill.errors import UsageError
    from tokenmill.tokenize.tokenizer import TokenizerError, load_tokenizer

    try:
        return load_tokenizer(path, name=name, eos_token=eos_token)
    except TokenizerError as error:
        raise UsageError(str(error)) from error


def _info(args: argparse.Namespace) -> int:
    _, info = _load(args.path, None, args.eos_token)
    record = {
        **info.manifest_entry(),
        "eos_id": info.eos_id,
        "eos_token": info.eos_token,
        "dtype": info.dtype,
    }
    print(json.dumps(record, indent=2, sort_keys=True))
    return 0


def _train(args: argparse.Namespace) -> int:
    from tokenmill.errors import UsageError
    from tokenmill.tokenize.tokenizer import (
        curated_parquet_files,
        describe,
        iter_text_batches,
        meta_path,
        train_byte_level_bpe,
        trained_name,
    )

    if args.vocab_size < 257:
        raise UsageError(
            f"--vocab-size {args.vocab_size} is too small: a byte-level BPE needs at least 257 "
            "(256 bytes and <|endoftext|>)"
        )
    if args.max_documents is not None and args.max_documents <= 0:
        raise UsageError("--max-documents must be positive")
    files = curated_parquet_files(args.input)
    if not files:
        raise UsageError(f"no Parquet files under {args.input}")
    seen = {"documents": 0, "characters": 0}

    def texts():
        for batch in iter_text_batches(files, args.max_documents):
            seen["documents"] += len(batch)
            seen["characters"] += sum(len(t) for t in batch)
            yield batch

    started = time.monotonic()
    log.info(
        "training a byte-level BPE of %d tokens on up to %s documents from %d files",
        args.vocab_size,
        f"{args.max_documents:,}",
        len(files),
    )
    tokenizer = train_byte_level_bpe(texts(), args.vocab_size, min_frequency=args.min_frequency)
    if seen["documents"] == 0:
        raise UsageError(f"no text in the Parquet files under {args.input}")
    data = tokenizer.to_str().encode("utf-8")
    storage.write_bytes(args.output, data)
    info = describe(tokenizer, data, args.output, name=args.name or trained_name(args.vocab_size))
    storage.write_json(
        meta_path(args.output),
        {
            **info.manifest_entry(),
            "eos_token": info.eos_token,
            "eos_id": info.eos_id,
            "requested_vocab_size": args.vocab_size,
            "min_frequency": args.min_frequency,
            "trained_on": {"input": args.input, "files": len(files), **seen},
        },
    )
    seconds = time.monotonic() - started
    note = (
        "" if info.vocab_size == args.vocab_size else f" (asked {args.vocab_size}: the text has fewer merges)"
    )
    print(
        f"wrote {args.output}: {info.name}, vocabulary {info.vocab_size}{note}, end-of-text "
        f"{info.eos_token!r} = {info.eos_id}, sha256 {info.sha256}"
    )
    print(
        f"trained on {seen['documents']:,} documents ({format_count(seen['characters'])} characters) "
        f"in {seconds:.1f} s"
    )
    return 0


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
    _, info = _load(args.tokenizer, args.tokenizer_name, args.eos_token)

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
    print(f"catalog: {storage.join(args.output, 'counts.json')}")
    return 0
