"""Subcommands of the trainer stage: `tokenmill train` and `tokenmill model info`."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from tokenmill.cli import UsageError
from tokenmill.units import format_count, parse_count

log = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add this stage's subcommands to the `tokenmill` parser."""
    _register_train(subparsers)
    _register_model(subparsers)


# --- tokenmill model info -------------------------------------------------------------------------------


def _register_model(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("model", help="inspect model shapes (configs/models/*.yaml)")
    model_sub = parser.add_subparsers(dest="model_command", metavar="ACTION")
    info = model_sub.add_parser(
        "info",
        help="parameter counts (total and active) and training FLOPs of a model shape",
        description="Parameter counts exclude embeddings and the output head (reported apart); training "
        "FLOPs = 6 x active parameters x tokens + attention. See docs/trainer.md.",
    )
    info.add_argument("config", help="a model shape, e.g. configs/models/hero-535b-a23b.yaml")
    info.add_argument("--tokens", help="training tokens, e.g. 18.75T: also print the total FLOPs")
    info.add_argument("--seq-len", type=int, help="training sequence length (default: the model's)")
    info.add_argument("--json", action="store_true", help="print JSON")
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
    print(
        f"{cfg.name}: {format_count(info['total_params'])} total, "
        f"{format_count(info['active_params'])} active"
    )
    print(
        f"  {cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads} heads ({cfg.n_kv_heads} kv) x "
        f"{cfg.head_dim}, {moe.n_experts} experts top-{moe.top_k} x {moe.expert_hidden} + "
        f"{moe.n_shared_experts} shared, vocab {cfg.vocab_size}"
    )
    print(
        f"  embeddings + head {format_count(info['embedding_params'])} (not in the counts above); "
        f"with them {format_count(info['total_params_with_embeddings'])} total, "
        f"{format_count(info['active_params_with_embeddings'])} active"
    )
    print(
        f"  training FLOPs per token {info['flops_per_token']:.4g} "
        f"(6 x active {6 * info['active_params']:.4g} + attention {info['attention_flops_per_token']:.4g} "
        f"at seq_len {info['seq_len']})"
    )
    if tokens is not None:
        print(f"  {format_count(tokens, 4)} tokens: {info['total_flops']:.3e} FLOPs")
    return 0


# --- tokenmill train ------------------------------------------------------------------------------------


def _register_train(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train one phase of a mixture with the JAX MoE trainer",
        description="Train a phase of a mixture (or synthetic data) into runs/NAME: metrics.jsonl, "
        "config.json, "
        "checkpoints/. Rerunning the same command resumes from the latest checkpoint. A later phase "
        "(midtraining) continues from the previous phase's last checkpoint in the same --output "
        "(or --init-from), with its own mixture and the decay part of the schedule.",
    )
    data = parser.add_argument_group("data")
    data.add_argument("--mixture", help="mixture spec (mixtures/*.yaml), planned against --tokens")
    data.add_argument(
        "--plan", help="a saved plan (`tokenmill mixture plan --json` output) instead of --mixture"
    )
    data.add_argument(
        "--tokens",
        dest="tokens_dir",
        help="token shards directory with counts.json (default: the mixture's counts:)",
    )
    data.add_argument("--phase", default="pretraining", help="phase to train (default: pretraining)")
    data.add_argument("--synthetic", action="store_true", help="train on synthetic data (no shards needed)")
    data.add_argument("--tokenizer-sha256", help="refuse shards made with any other tokenizer")

    run = parser.add_argument_group("run")
    run.add_argument("--model", required=True, help="model shape, configs/models/*.yaml")
    run.add_argument("--output", required=True, help="run directory, e.g. runs/NAME")
    run.add_argument("--steps", type=int, help="train this phase up to this many steps (default: the plan's)")
    run.add_argument("--batch-size", type=int, help="sequences per step (default: the plan's, else 8)")
    run.add_argument(
        "--seq-len", type=int, help="tokens per sequence (default: the plan's, else the model's)"
    )
    run.add_argument("--seed", type=int, default=0)
    run.add_argument(
        "--mesh", help="mesh sizes data,fsdp,expert; one may be -1 (default: all devices on fsdp)"
    )
    run.add_argument("--dispatch", choices=["capacity", "dropless"], help="override the model's MoE dispatch")
    run.add_argument("--compute-dtype", choices=["float32", "bfloat16"], default="float32")
    run.add_argument("--distributed", action="store_true", help="call jax.distributed.initialize() first")

    opt = parser.add_argument_group("optimizer and schedule")
    opt.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw")
    opt.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    opt.add_argument("--min-lr-ratio", type=float, default=0.1, help="final learning rate / peak")
    opt.add_argument("--schedule", choices=["wsd", "linear"], default="wsd")
    opt.add_argument("--warmup-steps", type=int, default=10)
    opt.add_argument("--decay-steps", type=int, help="wsd decay length (default: the last phase)")
    opt.add_argument("--total-steps", type=int, help="schedule length (default: the end of the last phase)")
    opt.add_argument("--weight-decay", type=float, default=0.1)
    opt.add_argument("--clip-norm", type=float, default=1.0)

    ckpt = parser.add_argument_group("checkpoints and logging")
    ckpt.add_argument("--checkpoint-every", type=int, default=100)
    ckpt.add_argument("--keep-checkpoints", type=int, default=3)
    ckpt.add_argument("--init-from", help="start this phase from another run directory's latest checkpoint")
    ckpt.add_argument("--peak-flops", type=float, help="peak FLOP/s of the whole mesh for MFU")
    ckpt.add_argument(
        "--wandb-project", help="also log to Weights & Biases (if installed; WANDB_MODE=offline ok)"
    )
    parser.set_defaults(handler=_train)


def _train(args: argparse.Namespace) -> int:
    from tokenmill.trainer.config import load_model_config
    from tokenmill.trainer.data import SyntheticSource, check_source
    from tokenmill.trainer.sharding import maybe_initialize_distributed
    from tokenmill.trainer.train import Phase, TrainConfig, TrainingError, phases_from_plan, train

    try:
        model_cfg = load_model_config(args.model)
    except ValueError as error:
        raise UsageError(str(error)) from error
    if args.dispatch:
        model_cfg = model_cfg.model_copy(
            update={"moe": model_cfg.moe.model_copy(update={"dispatch": args.dispatch})}
        )
    if not args.synthetic and not (args.mixture or args.plan):
        raise UsageError("give --mixture (or --plan) to train on token shards, or --synthetic")
    maybe_initialize_distributed(force=args.distributed)

    import jax

    plan = _load_plan(args) if (args.mixture or args.plan) else None
    if plan is not None:
        phases = phases_from_plan(plan)
        batch_size = args.batch_size or int(plan.get("batch_size") or 8)
        seq_len = args.seq_len or int(plan.get("sequence_length") or model_cfg.seq_len)
        if plan.get("batch_size") and args.batch_size and args.batch_size != int(plan["batch_size"]):
            raise UsageError(f"--batch-size {args.batch_size} differs from the plan's {plan['batch_size']}")
    else:
        if args.steps is None:
            raise UsageError("--synthetic without a plan needs --steps")
        phases = [Phase(args.phase, 0, args.steps)]
        batch_size = args.batch_size or 8
        seq_len = args.seq_len or model_cfg.seq_len
    if seq_len > model_cfg.seq_len:
        raise UsageError(f"sequence length {seq_len} is longer than the model's seq_len {model_cfg.seq_len}")
    if args.phase not in {p.name for p in phases}:
        raise UsageError(
            f"phase {args.phase!r} is not in the plan (phases: {', '.join(p.name for p in phases)})"
        )

    if args.synthetic:
        source = SyntheticSource(
            model_cfg.vocab_size, seq_len, batch_size, args.seed, jax.process_index(), jax.process_count()
        )
        expected_sha = None
    else:
        source = _mixture_source(plan, args, jax.process_index(), jax.process_count())
        expected_sha = args.tokenizer_sha256 or _expected_tokenizer_sha256(plan, args)
    try:
        check_source(source, model_cfg.vocab_size, expected_sha)
    except ValueError as error:
        raise UsageError(str(error)) from error

    cfg = TrainConfig(
        output=args.output,
        phase=args.phase,
        steps=args.steps,
        batch_size=batch_size,
        seq_len=seq_len,
        seed=args.seed,
        lr=args.lr,
        min_lr_ratio=args.min_lr_ratio,
        warmup_steps=args.warmup_steps,
        schedule=args.schedule,
        decay_steps=args.decay_steps,
        total_steps=args.total_steps,
        optimizer=args.optimizer,
        weight_decay=args.weight_decay,
        clip_norm=args.clip_norm,
        compute_dtype=args.compute_dtype,
        mesh=args.mesh,
        checkpoint_every=args.checkpoint_every,
        keep_checkpoints=args.keep_checkpoints,
        init_from=args.init_from,
        peak_flops=args.peak_flops,
        wandb_project=args.wandb_project,
        extra={
            "mixture": args.mixture,
            "plan_file": args.plan,
            "tokens": args.tokens_dir,
            "synthetic": args.synthetic,
            "model_file": args.model,
        },
    )
    try:
        rows = train(model_cfg, cfg, source, phases, plan)
    except ValueError as error:
        raise UsageError(str(error)) from error
    except TrainingError as error:
        print(f"tokenmill train: {error}")
        return 1
    if rows:
        first, last = rows[0], rows[-1]
        print(
            f"{args.output}: phase {args.phase} steps {first['step']}..{last['step']}, "
            f"loss {first['loss']:.4f} -> {last['loss']:.4f}, {format_count(last['tokens'])} tokens"
        )
    return 0


def _load_plan(args: argparse.Namespace) -> dict:
    """The mixture plan as the JSON of `tokenmill mixture plan --json` (docs/formats.md).

    With --mixture, the plan is made here against the shards' counts.json: --tokens, else the mixture's own
    `counts:` path. Sets args.tokens_dir when it came from the mixture.
    """
    if args.plan:
        try:
            return json.loads(Path(args.plan).read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise UsageError(f"cannot read plan {args.plan}: {error}") from error
    try:
        from tokenmill.mixtures import load_counts, load_mixture, plan_mixture
    except ImportError as error:
        raise UsageError(
            "the mixture planner (tokenmill.mixtures) is not available in this checkout "
            f"({error}); pass a saved plan with --plan, or use --synthetic"
        ) from error
    try:
        mixture = load_mixture(args.mixture)
        if not args.tokens_dir:
            counts_path = getattr(mixture, "counts_path", None)
            if not counts_path:
                raise UsageError(
                    f"{args.mixture} names no counts: file; pass --tokens DIR (with counts.json)"
                )
            args.tokens_dir = str(Path(counts_path).parent)
        plan = plan_mixture(mixture, load_counts(Path(args.tokens_dir) / "counts.json"))
    except (ValueError, OSError) as error:  # MixtureError is a ValueError
        raise UsageError(f"cannot plan {args.mixture}: {error}") from error
    return plan.to_json() if hasattr(plan, "to_json") else dict(plan)


def _mixture_source(plan: dict, args: argparse.Namespace, process_index: int, process_count: int):
    try:
        from tokenmill.trainer.sampler import MixtureSource
    except ImportError as error:
        raise UsageError(
            "the mixture sampler (tokenmill.trainer.sampler.MixtureSource, issue 7) is not available in this "
            f"checkout ({error}); train with --synthetic until it lands"
        ) from error
    if not args.tokens_dir:
        raise UsageError("training on a mixture needs --tokens (the token shards directory)")
    try:
        return MixtureSource(plan, args.phase, args.tokens_dir, args.seed, process_index, process_count)
    except (ValueError, OSError) as error:
        raise UsageError(f"cannot read the mixture's token shards: {error}") from error


def _expected_tokenizer_sha256(plan: dict, args: argparse.Namespace) -> str | None:
    """The tokenizer hash the mixture was planned for: the plan's own, else the shards catalog's."""
    for key in ("tokenizer_sha256",):
        if plan.get(key):
            return str(plan[key])
    tokenizer = plan.get("tokenizer")
    if isinstance(tokenizer, dict) and tokenizer.get("sha256"):
        return str(tokenizer["sha256"])
    if args.tokens_dir:
        path = Path(args.tokens_dir) / "counts.json"
        if path.exists():
            catalog = json.loads(path.read_text()).get("tokenizer") or {}
            return catalog.get("sha256") or None
    return None
