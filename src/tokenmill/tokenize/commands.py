"""Subcommands of the tokenize stage that need no Beam: `tokenmill tokenizer train|info` and
`tokenmill tokenize-eval`. `tokenmill tokenize` runs a Beam pipeline: tokenmill.pipelines.tokenize_command."""

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

    evalset = subparsers.add_parser(
        "tokenize-eval",
        help="tokenize text you bring into a named evaluation set (tokens/eval/<name>/)",
        description=(
            "Read any text (JSON Lines, Parquet or WARC; plain, .gz or .zst; local or gs://) with curate's "
            "readers, tokenize it as given with the run's tokenizer, and write a named evaluation set: "
            "<output>/eval/<name>/part-<n>.bin/.idx/.bytes per input file, manifest.json, and rejected/ for "
            "records that are not documents. A mixture names it under evaluation.sets. See docs/tokenize.md."
        ),
    )
    evalset.add_argument("--name", required=True, help="the set's name, e.g. paloma-c4")
    evalset.add_argument(
        "--input", required=True, nargs="+", help="input files or globs (local or gs://)", metavar="PATTERN"
    )
    evalset.add_argument(
        "--output", required=True, help="the run's tokens/ folder (the set goes to eval/<name>)"
    )
    evalset.add_argument("--tokenizer", required=True, help="the run's tokenizer.json")
    evalset.add_argument("--tokenizer-name", help="name recorded in the manifest (as for tokenize)")
    evalset.add_argument("--eos-token", help="end-of-text token (as for tokenize)")
    evalset.add_argument("--text-field", default="text", help="field holding the text (default text)")
    evalset.add_argument(
        "--id-field", default="id", help="field holding the id (default id; 'none': line numbers)"
    )
    evalset.add_argument(
        "--batch-documents",
        type=int,
        default=DEFAULT_BATCH_DOCUMENTS,
        help=f"documents per encode_batch call (default {DEFAULT_BATCH_DOCUMENTS})",
    )
    evalset.add_argument(
        "--max-record-bytes",
        default="64MiB",
        help="a record longer than this is rejected as record_too_large (default 64MiB, as curate)",
    )
    rerun_eval = evalset.add_mutually_exclusive_group()
    rerun_eval.add_argument(
        "--resume", action="store_true", help="keep the set's complete, verified shards and redo the rest"
    )
    rerun_eval.add_argument(
        "--overwrite", action="store_true", help="delete an earlier set of this name first"
    )
    evalset.set_defaults(handler=_tokenize_eval)


def load_command_tokenizer(path: str, name: str | None, eos_token: str | None):
    """(tokenizers.Tokenizer, TokenizerInfo) of a command's --tokenizer; a bad file is a UsageError."""
    from tokenmill.errors import UsageError
    from tokenmill.tokenize.tokenizer import TokenizerError, load_tokenizer

    try:
        return load_tokenizer(path, name=name, eos_token=eos_token)
    except TokenizerError as error:
        raise UsageError(str(error)) from error


def _info(args: argparse.Namespace) -> int:
    _, info = load_command_tokenizer(args.path, None, args.eos_token)
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


def _tokenize_eval(args: argparse.Namespace) -> int:
    from tokenmill.corpora.paths import expand_inputs, input_root
    from tokenmill.corpora.records import DuplicateIdError, InputFields
    from tokenmill.errors import UsageError
    from tokenmill.tokenize.evalsets import EvalSetError, make_eval_set, set_folder
    from tokenmill.units import parse_byte_size

    if args.batch_documents <= 0:
        raise UsageError("--batch-documents must be positive")
    try:
        max_record_bytes = parse_byte_size(args.max_record_bytes)
    except ValueError as error:
        raise UsageError(f"--max-record-bytes: {error}") from None
    tokenizer, info = load_command_tokenizer(args.tokenizer, args.tokenizer_name, args.eos_token)
    inputs = expand_inputs(args.input)
    fields = InputFields(text=args.text_field, id=None if args.id_field == "none" else args.id_field)
    started = time.monotonic()

    def progress(marker, written: bool) -> None:
        how = "tokenized" if written else "kept"
        rejected = sum(marker.rejected.values())
        log.info(
            "%s %s: %s documents, %s tokens%s",
            how,
            marker.source_files[0],
            f"{marker.documents:,}",
            f"{marker.tokens:,}",
            f", {rejected:,} rejected" if rejected else "",
        )

    try:
        manifest = make_eval_set(
            args.name,
            inputs,
            input_root(args.input),
            args.output,
            tokenizer,
            info,
            fields,
            overwrite=args.overwrite,
            resume=args.resume,
            batch_documents=args.batch_documents,
            max_record_bytes=max_record_bytes,
            on_file=progress,
        )
    except (EvalSetError, DuplicateIdError) as error:
        raise UsageError(str(error)) from None
    rejected = sum((manifest.rejected or {}).values())
    print(
        f"evaluation set {manifest.name}: {manifest.documents:,} documents, {manifest.tokens:,} tokens "
        f"({format_count(manifest.tokens)}), {manifest.bytes:,} UTF-8 bytes from {len(inputs)} files in "
        f"{time.monotonic() - started:.1f} s; tokenizer {info.name} (sha256 {info.sha256[:12]}…)"
    )
    if rejected:
        kinds = ", ".join(f"{kind} {count:,}" for kind, count in (manifest.rejected or {}).items())
        print(
            f"rejected {rejected:,} records ({kinds}): "
            f"{storage.join(set_folder(args.output, args.name), 'rejected')}"
        )
    print(f"manifest: {storage.join(set_folder(args.output, args.name), 'manifest.json')}")
    return 0
