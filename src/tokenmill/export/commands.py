"""`tokenmill export hf` and `tokenmill import hf` (docs/export.md): a run's checkpoint to a Hugging Face
model folder, and such a folder back to a checkpoint that `tokenmill train --checkpoint.init_from` continues
from.
"""

from __future__ import annotations

import argparse
import logging
import posixpath

from tokenmill.errors import UsageError

log = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `tokenmill export` and `tokenmill import` to the `tokenmill` parser."""
    export = subparsers.add_parser("export", help="export a trained checkpoint (Hugging Face format)")
    export_sub = export.add_subparsers(dest="export_command", metavar="FORMAT")
    hf = export_sub.add_parser(
        "hf",
        help="a run's checkpoint as a Hugging Face model folder (transformers' Dots1ForCausalLM)",
        description="Write a run's checkpoint (the latest, --step N, or the one --run names) as a Hugging "
        "Face model folder: config.json, sharded model-*.safetensors with model.safetensors.index.json, the "
        "tokenizer's files, generation_config.json and tokenmill_export.json (the run, step, hashes and "
        "every file's sha256). The DeepSeek-style family loads in transformers as Dots1ForCausalLM with no "
        "custom code; the Marin family through the modeling file tokenmill ships in the folder "
        "(trust_remote_code=True). See docs/export.md.",
    )
    hf.add_argument(
        "--run", required=True, help="a run folder (runs/NAME) or runs/NAME/checkpoints/STEP; or gs://"
    )
    hf.add_argument("--step", type=int, help="the checkpoint's step (default: the latest)")
    hf.add_argument("--output", required=True, help="the model folder to write (local or gs://)")
    hf.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="tensor dtype (default: bf16)")
    hf.add_argument(
        "--tokenizer",
        help="the tokenizer.json the run's tokens were made with (checked against the run's tokenizer "
        "sha256; default: tokenizer.json beside the run's data.tokens folder, when its hash matches)",
    )
    hf.add_argument(
        "--max-shard-size", default="5G", help="largest safetensors shard: 5G (the default), 500M, 2GiB"
    )
    hf.add_argument(
        "--architecture",
        choices=["auto", "dots1", "tokenmill"],
        default="auto",
        help="dots1: transformers' stock Dots1ForCausalLM (options it lacks are refused by name); tokenmill: "
        "the modeling file tokenmill ships (trust_remote_code=True; the Marin family); auto (default): "
        "dots1 where it expresses the model, else tokenmill",
    )
    hf.add_argument("--overwrite", action="store_true", help="replace an earlier export in --output")
    hf.set_defaults(handler=_export_hf)

    imp = subparsers.add_parser("import", help="import a model folder back into a checkpoint")
    import_sub = imp.add_subparsers(dest="import_command", metavar="FORMAT")
    ihf = import_sub.add_parser(
        "hf",
        help="a folder `tokenmill export hf` wrote, as a checkpoint to continue training from",
        description="Read an exported Hugging Face folder back (every file checked against its export "
        "record) and write OUTPUT/checkpoints/STEP: the same parameters and router bias, with a fresh "
        "optimizer state for the run configuration --config gives (default: the trainer's defaults). "
        "Continue with `tokenmill train ... --checkpoint.init_from OUTPUT`. See docs/export.md.",
    )
    ihf.add_argument("folder", help="the exported model folder (local or gs://)")
    ihf.add_argument("--output", required=True, help="a new folder for the checkpoint (runs/NAME-imported)")
    ihf.add_argument(
        "--config", help="the run configuration that will continue (its optimizer's state layout)"
    )
    ihf.set_defaults(handler=_import_hf)


def _export_hf(args: argparse.Namespace) -> int:
    from tokenmill.export.hf import export_hf
    from tokenmill.export.run import ExportError, load_checkpoint
    from tokenmill.units import parse_byte_size

    try:
        shard_bytes = parse_byte_size(args.max_shard_size)
        checkpoint = load_checkpoint(args.run, args.step)
        tokenizer = args.tokenizer or default_tokenizer(checkpoint)
        record = export_hf(
            checkpoint,
            args.output,
            args.dtype,
            tokenizer,
            args.overwrite,
            shard_bytes,
            architecture=args.architecture,
        )
    except (ExportError, ValueError, OSError) as error:
        raise UsageError(f"export hf --run {args.run}: {error}") from error
    print(
        f"exported {record['run']} step {record['step']} ({record['dtype']}) to {args.output}: "
        f"{len(record['files']) + 1} files"
    )
    return 0


def default_tokenizer(checkpoint) -> str | None:
    """tokenizer.json beside the run's token folder (as `make demo` lays them out) when its sha256 is the
    one the run trained with; None otherwise (the exporter then asks for --tokenizer if the run had one)."""
    from tokenmill import storage

    tokens = (checkpoint.record.get("data") or {}).get("tokens")
    if not tokens or not checkpoint.tokenizer_sha256:
        return None
    candidate = storage.join(posixpath.dirname(tokens.rstrip("/")) or ".", "tokenizer.json")
    if storage.exists(candidate) and storage.file_sha256(candidate) == checkpoint.tokenizer_sha256:
        log.info("tokenizer: %s (its sha256 is the run's)", candidate)
        return candidate
    return None


def _import_hf(args: argparse.Namespace) -> int:
    from tokenmill.export.checkpoint import write_imported_checkpoint
    from tokenmill.export.run import ExportError

    try:
        path = write_imported_checkpoint(args.folder, args.output, args.config)
    except (ExportError, ValueError, OSError) as error:
        raise UsageError(f"import hf {args.folder}: {error}") from error
    print(f"imported {args.folder} into {path}; continue with --checkpoint.init_from {args.output}")
    return 0
