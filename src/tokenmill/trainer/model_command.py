"""`tokenmill model info`: the parameter counts and compute of a model shape (configs/models/*.yaml)."""

from __future__ import annotations

import argparse
import json

from tokenmill.errors import UsageError
from tokenmill.units import format_count, parse_count


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `tokenmill model` to the `tokenmill` parser."""
    parser = subparsers.add_parser("model", help="inspect model shapes (configs/models/*.yaml)")
    model_sub = parser.add_subparsers(dest="model_command", metavar="ACTION")
    info = model_sub.add_parser(
        "info",
        help="parameter counts (total, active, stored) and the compute of a model shape",
        description="Counts follow Marin's convention: total = projection matrices with the embedding and "
        "head, active = those one token uses without them, stored = every number a checkpoint holds. "
        "Compute at --tokens (default: the shape's reference run): forecast_compute = C as Marin's "
        "ladder forecast prices it (no head, attention over the full span), train_flops = C + the head. "
        "flops_per_token is the MFU convention. See docs/trainer.md.",
    )
    info.add_argument("config", help="a model shape, e.g. configs/models/marin-535b-a23b.yaml")
    info.add_argument(
        "--tokens", help="training tokens, e.g. 18.75T (default: the shape's reference_run, if it has one)"
    )
    info.add_argument("--seq-len", type=int, help="training sequence length (default: the model's)")
    info.add_argument("--json", action="store_true", help="print JSON (exact integers)")
    info.set_defaults(handler=_model_info)
    parser.set_defaults(handler=lambda args: parser.print_help() or 2)


def _model_info(args: argparse.Namespace) -> int:
    from tokenmill.trainer.config import load_model_config
    from tokenmill.trainer.flops import model_info

    try:
        cfg = load_model_config(args.config)
        tokens = parse_count(args.tokens) if args.tokens else None
    except ValueError as error:
        raise UsageError(str(error)) from error
    info = model_info(cfg, tokens, args.seq_len)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    moe = cfg.moe
    kv = f"{cfg.n_kv_heads} kv"
    if cfg.global_kv_heads is not None:
        kv = f"kv {cfg.n_kv_heads} local / {cfg.global_kv_heads} global, {cfg.stored_kv_heads} stored"
    n_global = sum(cfg.is_global(layer) for layer in range(cfg.n_layers))
    attention = f"{n_global} of them global" if cfg.sliding_window else "all global"
    latent = f" in a {moe.latent_dim} latent" if moe.latent_dim else ""
    print(
        f"{cfg.name}: {format_count(info['total_params'], 4)} total, "
        f"{format_count(info['active_params'], 4)} active "
        f"({info['total_params']:,} with the embedding and head; {info['active_params']:,} without)"
    )
    print(
        f"  {cfg.n_layers} layers ({attention}), d_model {cfg.d_model}, {cfg.n_heads} heads ({kv}) x "
        f"{cfg.head_dim}, {moe.n_experts} experts top-{moe.top_k} x {moe.expert_hidden}{latent} + "
        f"{moe.n_shared_experts} shared x {moe.shared_hidden_width}, vocab {cfg.vocab_size}"
    )
    print(
        f"  stored {info['stored_params']:,} (embedding + head {info['embedding_params']:,}; norms, gates, "
        f"SConv and the router bias {info['other_stored_params']:,})"
    )
    if info["tokens"] is not None:
        run = info["reference_run"]
        from_run = run and not tokens
        source = (
            f" ({run['steps']:,} steps x {run['batch_size']:,} x {info['seq_len']:,})" if from_run else ""
        )
        print(
            f"  {info['tokens']:,} tokens{source}: forecast compute {info['forecast_compute']:.4e} "
            f"(no head, attention over the full span), with the head {info['train_flops']:.4e}"
        )
    print(
        f"  MFU FLOPs per token {info['flops_per_token']:.4g} (6 x matmul weights + causal attention "
        f"{info['attention_flops_per_token']:.4g} at seq_len {info['seq_len']}; "
        f"head {info['head_flops_per_token']:.4g} apart)"
    )
    return 0
