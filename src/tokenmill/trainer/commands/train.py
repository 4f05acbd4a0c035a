"""`tokenmill train`: train one phase of a run from a run configuration and the flags that override it.

The flags are generated from `RunConfig`'s fields (tokenmill.trainer.run.config), one per setting, named by
its place in the configuration: `--optimizer.lr`, `--data.phase`, `--model.moe.dispatch`. No flag has a
default of its own: an unset flag leaves the configuration's value, and the defaults are in that module
alone. The command resolves the configuration once (`resolve_run_config`) and hands it to `train()`.
"""

from __future__ import annotations

import argparse
import logging
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, BeforeValidator
from pydantic.fields import FieldInfo

from tokenmill import storage
from tokenmill.errors import FormatError, UsageError
from tokenmill.formats.plan import MixturePlan, read_plan
from tokenmill.trainer.data.batch import BatchSource
from tokenmill.trainer.run.config import ResolvedRun, RunConfig
from tokenmill.units import format_count

log = logging.getLogger(__name__)

# Where the help puts each part of the configuration.
GROUPS = {
    "": ("run", "The run configuration: --config FILE, then any flag below overrides one of its fields."),
    "optimizer": (
        "optimizer",
        "Defaults follow the recipe. With muonh (the default for the Marin family: latent experts or "
        "GatedNorm, configs/models/marin-*.yaml): Marin's run as trained, the learning-rate heuristic for "
        "this run's tokens, width and batch, a linear schedule with 1% warmup down to 0.05, no "
        "clipping, no weight decay. Otherwise AdamW at 3e-3, wsd with 10 warmup steps, clipping at 1, "
        "weight decay 0.1.",
    ),
    "schedule": ("schedule", None),
    "data": ("data", None),
    "mesh": ("mesh", None),
    "checkpoint": ("checkpoints", None),
    "logging": ("logging", None),
    "evaluation": ("evaluation", "Held-out evaluation (docs/trainer.md): when, how much, which dispatch."),
    "guard": ("guard", 'Skipped steps and rollbacks (docs/trainer.md, "A run\'s bad hours").'),
    "watchdog": (
        "watchdog",
        'Preemption (exit 75) and hangs (exit 76): docs/trainer.md, "A run\'s bad hours".',
    ),
    "model": ("model shape", "Change one field of the --model file's shape (configs/models/*.yaml)."),
}
SET = "set:"  # prefix of the argparse destinations of generated flags


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `tokenmill train` to the `tokenmill` parser."""
    parser = subparsers.add_parser(
        "train",
        usage="%(prog)s [--config FILE] [--model FILE] [--output DIR] [--SECTION.FIELD VALUE ...]",
        help="train one phase of a mixture with the JAX MoE trainer",
        description="Train a phase of a mixture (or synthetic data) into runs/NAME: metrics.jsonl, "
        "config.json (this run's configuration, resolved: `--config runs/NAME/config.json` trains it "
        "again), checkpoints/. Rerunning the same command resumes from the latest checkpoint. A later "
        "phase (midtraining) continues from the previous phase's last checkpoint in the same --output "
        "(or --checkpoint.init_from), with its own mixture and the decay part of the schedule. Settings "
        "come from "
        "--config (configs/runs/*.yaml), then from the flags. See docs/trainer.md.",
    )
    groups = {section: parser.add_argument_group(title, text) for section, (title, text) in GROUPS.items()}
    run = groups[""]
    run.add_argument(
        "--config",
        metavar="FILE",
        help="a run configuration: configs/runs/*.yaml, or a run's config.json to train it again",
    )
    run.add_argument(
        "--model",
        dest="model_file",
        metavar="FILE",
        help="model shape, configs/models/*.yaml (or model: in --config)",
    )
    groups["mesh"].add_argument(
        "--mesh",
        dest="mesh_sizes",
        metavar="DATA,FSDP,EXPERT",
        help="the three sizes at once, e.g. 1,-1,8 (one may be -1: the rest of the devices)",
    )
    for path, info in _settings(RunConfig):
        section = path.split(".")[0] if "." in path else ""
        _add_flag(groups[section], path, info)
    # Where this process stands in a multi-host job: facts of one launch, not of the run, so flags only.
    hosts = parser.add_argument_group(
        "several hosts",
        "Every process runs the same command; each fact comes from its flag, else from "
        "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID, else from the scheduler (SLURM's srun, "
        "a JobSet's completion index). Any of them implies --distributed. `tokenmill launch` writes the job.",
    )
    hosts.add_argument("--coordinator", metavar="HOST[:PORT]", help="process 0's address (port default 8476)")
    hosts.add_argument("--num-processes", type=int, metavar="N", help="processes in the job")
    hosts.add_argument("--process-id", type=int, metavar="I", help="this process's id, 0..N-1")
    run.add_argument(
        "--allow-data-change",
        action="store_true",
        help="resume even though the plan, seed, tokenizer, batch or model differ from the checkpoint's "
        "(refused otherwise); config.json's history records the change and the step it took effect",
    )
    parser.set_defaults(handler=_train)


def _settings(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    """(dotted path, field) of every setting: the leaves of the configuration's sections."""
    for name, info in model.model_fields.items():
        section = _section(info.annotation)
        if section is not None:
            yield from _settings(section, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", info


def _section(annotation: Any) -> type[BaseModel] | None:
    """The model class in `X` or `X | None`, if the field is a section rather than a setting."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _add_flag(group: argparse._ArgumentGroup, path: str, info: FieldInfo) -> None:
    options: dict[str, Any] = {"dest": SET + path, "default": argparse.SUPPRESS}
    annotation = _without_none(info.annotation)
    origin = typing.get_origin(annotation)
    if annotation is bool:
        options["action"] = argparse.BooleanOptionalAction
    elif origin is typing.Literal:
        choices = typing.get_args(annotation)
        options.update(choices=choices, type=type(choices[0]))
    elif any(isinstance(item, BeforeValidator) for item in info.metadata):
        options.update(type=str, metavar=path.rsplit(".", 1)[-1].upper())  # the field parses it (e.g. 200G)
    elif annotation in (int, float, str):
        options.update(type=annotation, metavar=path.rsplit(".", 1)[-1].upper())
    else:  # lists and mappings of the model's shape: written as YAML, e.g. '[k, v]'
        options.update(type=yaml.safe_load, metavar="YAML")
    options["help"] = None if path.startswith("model.") else _help(info)
    group.add_argument(f"--{path}", **options)


def _without_none(annotation: Any) -> Any:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        others = [item for item in typing.get_args(annotation) if item is not type(None)]
        if len(others) == 1:
            return others[0]
    return annotation


def _help(info: FieldInfo) -> str:
    text = (info.description or "").replace("%", "%%")
    default = info.get_default()
    if default is not None and default is not False and "default" not in text:
        text += f" (default: {default})"
    return text


def overrides_of(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the command line gives, by dotted path (`--optimizer.lr 1e-3`: {"optimizer.lr": 1e-3})."""
    given = {dest[len(SET) :]: value for dest, value in vars(args).items() if dest.startswith(SET)}
    if getattr(args, "model_file", None):
        given["model"] = args.model_file
    if getattr(args, "mesh_sizes", None):
        parts = args.mesh_sizes.split(",")
        try:
            sizes = [int(part) for part in parts]
        except ValueError:
            sizes = []
        if len(sizes) != 3:
            raise UsageError(f"--mesh {args.mesh_sizes!r}: expected three integers data,fsdp,expert")
        given.update(zip(("mesh.data", "mesh.fsdp", "mesh.expert"), sizes, strict=True))
    return given


def run_config_of(args: argparse.Namespace) -> RunConfig:
    """The run configuration of a `tokenmill train` command line: --config's file, then the flags."""
    from tokenmill.trainer.run.config import RunConfigError, build_run_config, read_run_config_file

    try:
        raw = read_run_config_file(args.config) if args.config else {}
        return build_run_config(raw, overrides_of(args), args.config)
    except RunConfigError as error:
        raise UsageError(str(error)) from error


def _train(args: argparse.Namespace) -> int:
    from tokenmill.trainer.data.batch import check_source
    from tokenmill.trainer.run.distributed import DistributedSetupError, maybe_initialize_distributed
    from tokenmill.trainer.run.loop import train
    from tokenmill.trainer.run.resume import TrainingError
    from tokenmill.trainer.run.watchdog import Preempted

    run = run_config_of(args)
    if run.model is None:
        raise UsageError("give --model FILE (or model: in the --config file)")
    if not run.output:
        raise UsageError("give --output DIR (or output: in the --config file)")
    data = run.data
    if not data.synthetic and not (data.mixture or data.plan):
        raise UsageError("give --data.mixture (or --data.plan) to train on token shards, or --data.synthetic")
    try:
        maybe_initialize_distributed(
            run.mesh.distributed, args.coordinator, args.num_processes, args.process_id
        )
    except DistributedSetupError as error:
        raise UsageError(str(error)) from error

    resolved = _resolve(run)
    config = resolved.config
    log.info("optimizer %s, schedule %s", config.optimizer.model_dump(), config.schedule.model_dump())
    source = _source(resolved)
    try:
        expected = None if config.data.synthetic else config.data.tokenizer_sha256
        check_source(source, resolved.model.vocab_size, expected)
    except ValueError as error:
        raise UsageError(str(error)) from error
    try:
        rows = train(resolved, source, allow_data_change=args.allow_data_change)
    except ValueError as error:
        raise UsageError(str(error)) from error
    except TrainingError as error:
        print(f"tokenmill train: {error}")
        return 1
    except Preempted as error:
        # 75: checkpointed after SIGTERM/SIGINT; the launch outputs requeue on it (docs/operations.md).
        print(f"tokenmill train: preempted: {error}; rerun to resume")
        return error.exit_code
    if rows:
        first, last = rows[0], rows[-1]
        print(
            f"{config.output}: phase {config.data.phase} steps {first['step']}..{last['step']}, "
            f"loss {first['loss']:.4f} -> {last['loss']:.4f}, {format_count(last['tokens'])} tokens"
        )
    return 0


def _resolve(run: RunConfig) -> ResolvedRun:
    """The run resolved once against its plan (and the shards' folder and tokenizer the plan names)."""
    from tokenmill.trainer.run.config import Phase, RunConfigError, phases_from_plan, resolve_run_config

    data, plan = run.data, None
    if data.mixture or data.plan:
        plan, tokens = _load_plan(run)
        phases = phases_from_plan(plan)
        tokenizer = data.tokenizer_sha256 or _expected_tokenizer_sha256(plan, tokens)
        run = run.with_values({"data.tokens": tokens, "data.tokenizer_sha256": tokenizer})
    elif run.schedule.steps is None:
        raise UsageError("--data.synthetic without a plan needs --schedule.steps")
    else:
        phases = [Phase(data.phase, 0, run.schedule.steps)]
    try:
        return resolve_run_config(run, phases, plan)
    except RunConfigError as error:
        raise UsageError(str(error)) from error


def _source(run: ResolvedRun) -> BatchSource:
    """This process's batches: synthetic tokens, or the sampler over the plan's token shards."""
    import jax

    from tokenmill.trainer.data.batch import SyntheticSource

    config = run.config
    if config.data.synthetic:
        return SyntheticSource(
            run.model.vocab_size,
            config.data.sequence_length,
            config.data.batch_size,
            config.seed,
            jax.process_index(),
            jax.process_count(),
        )
    return _mixture_source(run, jax.process_index(), jax.process_count())


def _load_plan(run: RunConfig) -> tuple[MixturePlan, str | None]:
    """The mixture plan (docs/formats.md, "Mixture plan") and the token shards directory: data.tokens,
    else (with a mixture) the folder of the mixture's own `counts:` file.

    With data.plan, the plan file is read through its format (an error names the file and the field);
    with data.mixture, the plan is made here against the shards' counts.json."""
    data = run.data
    if data.plan:
        try:
            return read_plan(data.plan), data.tokens
        except OSError as error:
            raise UsageError(f"cannot read plan {data.plan}: {error.strerror or error}") from error
        except FormatError as error:
            raise UsageError(f"cannot read plan {error}") from error
    from tokenmill.mixtures import load_counts, load_mixture, plan_mixture

    tokens = data.tokens
    try:
        mixture = load_mixture(data.mixture)
        if not tokens:
            if not mixture.counts_path:
                raise UsageError(
                    f"{data.mixture} names no counts: file; pass --data.tokens DIR (with counts.json)"
                )
            tokens = str(Path(mixture.counts_path).parent)
        counts = storage.join(tokens, "counts.json")
        plan = plan_mixture(
            mixture, load_counts(counts if storage.is_local(counts) else storage.local_copy(counts))
        )
    except (ValueError, OSError) as error:  # MixtureError is a ValueError
        raise UsageError(f"cannot plan {data.mixture}: {error}") from error
    return plan, tokens


def _mixture_source(run: ResolvedRun, process_index: int, process_count: int) -> BatchSource:
    from tokenmill.trainer.data.remote import RemoteOptions
    from tokenmill.trainer.data.sampler import MixtureSource, PrefetchedBatches

    plan, data, seed = run.plan, run.config.data, run.config.seed
    if not data.tokens:
        raise UsageError("training on a mixture needs --data.tokens (the token shards directory)")
    try:
        remote = RemoteOptions(cache_bytes=data.shard_cache, cache_dir=data.shard_cache_dir)
        source = PrefetchedBatches(
            MixtureSource.from_plan(
                plan,
                data.phase,
                data.tokens,
                seed,
                process_index,
                process_count,
                reader=data.reader,
                remote=remote,
                verify_shards=data.verify_shards,
            )
        )
    except (ValueError, OSError) as error:
        raise UsageError(f"cannot read the mixture's token shards: {error}") from error
    log.info("data: %r", source)
    return source


def _expected_tokenizer_sha256(plan: MixturePlan, tokens: str | None) -> str | None:
    """The tokenizer hash the mixture was planned for: the plan's own, else the shards catalog's."""
    if plan.tokenizer_sha256:
        return plan.tokenizer_sha256
    if tokens:
        from tokenmill.formats.tokens import COUNTS, read_counts

        path = storage.join(tokens, COUNTS)
        if storage.exists(path):
            catalog = read_counts(path).tokenizer
            return (catalog.sha256 if catalog else None) or None
    return None
