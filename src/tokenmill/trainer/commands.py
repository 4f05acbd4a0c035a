"""Subcommands of the trainer stage: `tokenmill train`, `tokenmill model info` and `tokenmill ladder`."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from tokenmill.cli import UsageError
from tokenmill.trainer.heuristic import HEURISTICS, MAY_RECIPE
from tokenmill.units import format_count, parse_count

log = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add this stage's subcommands to the `tokenmill` parser."""
    _register_train(subparsers)
    _register_model(subparsers)
    _register_ladder(subparsers)


# --- tokenmill model info -------------------------------------------------------------------------------


def _register_model(subparsers: argparse._SubParsersAction) -> None:
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
    data.add_argument(
        "--reader",
        choices=["auto", "direct", "mmap"],
        default="auto",
        help="how windows are read from the shards: direct (O_DIRECT with native AIO, for data larger "
        "than memory), mmap (memory maps and the page cache), or auto: direct where the system allows "
        "it (default: auto; no batch depends on it)",
    )

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

    opt = parser.add_argument_group(
        "optimizer and schedule",
        "Defaults follow the recipe. With muonh (the default for the Marin family: latent experts or "
        "GatedNorm, configs/models/marin-*.yaml): Marin's run as trained, the learning-rate heuristic for "
        "this run's tokens, width and batch, a linear schedule with 1% warmup down to 0.05, no clipping, no "
        "weight decay. Otherwise AdamW at 3e-3, wsd with 10 warmup steps, clipping at 1, weight decay 0.1.",
    )
    opt.add_argument(
        "--optimizer",
        choices=["adamw", "muon", "muonh"],
        help="default: muonh for the Marin family, else adamw",
    )
    opt.add_argument(
        "--lr-heuristic",
        choices=sorted(HEURISTICS),
        default=MAY_RECIPE.name,
        help="muonh's learning-rate rule (default %(default)s, marin-community/marin#5951)",
    )
    opt.add_argument("--lr", type=float, help="peak learning rate (muonh: of MuonH and AdamH)")
    opt.add_argument("--adam-lr", type=float, help="muonh: peak rate of the Adam group (embeddings, router)")
    opt.add_argument("--beta1", type=float, help="Adam's beta1 (default: the heuristic's, else 0.9)")
    opt.add_argument("--beta2", type=float, help="Adam's beta2 (default: the heuristic's, else 0.95)")
    opt.add_argument("--epsilon", type=float, help="Adam's epsilon (default: the heuristic's, else 1e-8)")
    opt.add_argument("--min-lr-ratio", type=float, help="final learning rate / peak (0.05 or 0.1)")
    opt.add_argument("--schedule", choices=["wsd", "linear"], help="default: linear (muonh) or wsd")
    opt.add_argument("--warmup-steps", type=int, help="default: 1%% of the steps (muonh) or 10")
    opt.add_argument("--decay-steps", type=int, help="wsd decay length (default: the last phase)")
    opt.add_argument("--total-steps", type=int, help="schedule length (default: the end of the last phase)")
    opt.add_argument("--weight-decay", type=float, help="default: 0 (muonh) or 0.1")
    opt.add_argument("--clip-norm", type=float, help="gradient global-norm clip, 0: none (default: 0 or 1)")

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

    total_steps = args.total_steps or phases[-1].end_step
    optimizer = _optimizer_settings(args, model_cfg, total_steps, batch_size * seq_len)

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
        lr=optimizer["lr"],
        min_lr_ratio=optimizer["min_lr_ratio"],
        warmup_steps=optimizer["warmup_steps"],
        schedule=optimizer["schedule"],
        decay_steps=args.decay_steps,
        total_steps=args.total_steps,
        optimizer=optimizer["optimizer"],
        weight_decay=optimizer["weight_decay"],
        clip_norm=optimizer["clip_norm"],
        adam_lr=optimizer["adam_lr"],
        beta1=optimizer["beta1"],
        beta2=optimizer["beta2"],
        epsilon=optimizer["epsilon"],
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
            "optimizer_defaults": optimizer.get("heuristic"),
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


def _optimizer_settings(args: argparse.Namespace, model_cfg, total_steps: int, tokens_per_batch: int) -> dict:
    """The optimizer and schedule: the command line's, else the recipe's defaults (see the group's help)."""
    from tokenmill.trainer.heuristic import is_marin_family, warmup_steps_for

    kind = args.optimizer or ("muonh" if is_marin_family(model_cfg) else "adamw")
    if kind == "muonh":
        tokens = total_steps * tokens_per_batch
        recipe = HEURISTICS[args.lr_heuristic].hyperparameters(tokens, model_cfg.d_model, tokens_per_batch)
        recipe["warmup_steps"] = warmup_steps_for(total_steps, recipe.pop("warmup_fraction"))
        recipe["heuristic"] = {"name": recipe["heuristic"], "tokens": tokens, "d_model": model_cfg.d_model,
                               "tokens_per_batch": tokens_per_batch}  # fmt: skip
    else:
        recipe = {"lr": 3e-3, "adam_lr": None, "beta1": 0.9, "beta2": 0.95, "epsilon": 1e-8,
                  "min_lr_ratio": 0.1, "schedule": "wsd", "warmup_steps": 10, "clip_norm": 1.0,
                  "weight_decay": 0.1, "heuristic": None}  # fmt: skip
    given = {"lr": args.lr, "adam_lr": args.adam_lr, "beta1": args.beta1, "beta2": args.beta2,
             "epsilon": args.epsilon, "min_lr_ratio": args.min_lr_ratio, "schedule": args.schedule,
             "warmup_steps": args.warmup_steps, "clip_norm": args.clip_norm,
             "weight_decay": args.weight_decay}  # fmt: skip
    recipe.update({key: value for key, value in given.items() if value is not None})
    if kind == "muonh" and args.lr is not None and args.adam_lr is None:
        recipe["adam_lr"] = args.lr * 3 / 13  # keep Marin's ratio when only the MuonH rate is given
    recipe["optimizer"] = kind
    log.info("optimizer %s", {k: v for k, v in recipe.items() if k != "heuristic"})
    return recipe


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
        source = MixtureSource(
            plan, args.phase, args.tokens_dir, args.seed, process_index, process_count, reader=args.reader
        )
    except (ValueError, OSError) as error:
        raise UsageError(f"cannot read the mixture's token shards: {error}") from error
    log.info("data: %r", source)
    return source


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


# --- tokenmill ladder -----------------------------------------------------------------------------------


def _register_ladder(subparsers: argparse._SubParsersAction) -> None:
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
        "--target-seq-len", type=int, help="the target's sequence length (default: the model's)"
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
    import os

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
                args.target_model, parse_count(args.target_tokens), args.target_seq_len
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
    print(
        f"ladder fit: {len(result['runs'])} runs, {result['fit']['points']} points at "
        f"{', '.join(f'{f:.0%}' for f in fractions)} of each run's planned steps "
        f"(loss smoothed over {result['window']:.0%} of its steps)"
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
        f"forecast for the target{name}, {target['flops']:.3e} FLOPs; {band['level']:.0%} band from "
        f"{band['replicates'] - band['failed']} bootstrap fits:"
    )
    actual = {p["fraction"]: p for p in result.get("actual", [])}
    for item in result["forecast"]:
        line = (
            f"  {item['fraction']:>4.0%}  {item['flops']:.3e} FLOPs  loss {item['loss']:.4f}  "
            f"[{item['low']:.4f}, {item['high']:.4f}]"
        )
        if item["fraction"] in actual:
            line += f"  actual {actual[item['fraction']]['loss']:.4f}"
        print(line)
    for warning in result["warnings"]:
        print(f"warning: {warning}")
