"""A training run's configuration: configs/runs/*.yaml, `tokenmill train --config`, and runs/NAME/config.json.

One frozen pydantic model, `RunConfig`, holds every setting of a run (model shape, optimizer, schedule,
data, mesh, checkpoints, logging); every default lives here, and the command line's flags are generated
from these fields (`--optimizer.lr`). `resolve_run_config` fills in what a field leaves unset from the plan,
the model and the recipe, once, into a `ResolvedRun`: what `train()` takes and runs/NAME/config.json
records, so that `tokenmill train --config runs/NAME/config.json` trains the same run again.

Paths in a run configuration are taken as the command line takes them: relative to the working directory
`tokenmill train` runs in. No JAX here: the command line validates a configuration before JAX starts.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from tokenmill.errors import FormatError
from tokenmill.formats.plan import MixturePlan
from tokenmill.formats.runs import RECORD_KEYS, read_run_record
from tokenmill.trainer.model.shape import ModelConfig, load_model_config
from tokenmill.trainer.run.heuristic import (
    ADAM_TO_MUONH_LR_RATIO,
    HEURISTICS,
    MAY_RECIPE,
    is_marin_family,
    warmup_steps_for,
)
from tokenmill.units import parse_count
from tokenmill.validation import validation_problems

# Keys a run's config.json adds to the resolved configuration (RECORD_KEYS, formats/runs.py): facts about the
# run, not settings. Reading a config.json back skips them.
DEFAULT_BATCH_SIZE = 8


class RunConfigError(ValueError):
    """A run configuration that cannot be used; the message names the file (or flag) and the field."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, refusing a key given twice: safe_load keeps the last one, so a pasted
    `lr:` would silently win over the one above it."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {seen[key]})", key_node.start_mark
                )
            seen[key] = line
        return super().construct_mapping(node, deep)


def _count(value: Any) -> Any:
    return None if value is None else parse_count(value)


Count = Annotated[int, BeforeValidator(_count)]


class Section(BaseModel):
    """A part of the run configuration: unknown keys are errors, so a misspelt setting never goes unread;
    frozen, so that a resolved configuration cannot change on the way to the loop."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class OptimizerConfig(Section):
    """The optimizer; a field left unset takes the recipe's value (see `resolve_run_config`)."""

    kind: Literal["adamw", "muon", "muonh"] | None = Field(
        None, description="default: muonh for the Marin family (latent experts or GatedNorm), else adamw"
    )
    lr_heuristic: Literal[tuple(HEURISTICS)] = Field(  # type: ignore[valid-type]
        MAY_RECIPE.name, description="muonh's learning-rate rule (marin-community/marin#5951)"
    )
    lr: float | None = Field(
        None, description="peak learning rate (muonh: of MuonH and AdamH; default: the heuristic's, or 3e-3)"
    )
    adam_lr: float | None = Field(
        None,
        description="muonh: peak rate of the Adam group, embeddings and router (default: the heuristic's, "
        "or lr x 3/13 when lr is given)",
    )
    beta1: float | None = Field(None, description="Adam's beta1 (default: the heuristic's, else 0.9)")
    beta2: float | None = Field(None, description="Adam's beta2 (default: the heuristic's, else 0.95)")
    epsilon: float | None = Field(None, description="Adam's epsilon (default: the heuristic's, else 1e-8)")
    weight_decay: float | None = Field(None, description="default: 0 (muonh) or 0.1")
    clip_norm: float | None = Field(None, description="gradient global-norm clip, 0: none (default: 0 or 1)")
    state_memory: Literal["device", "pinned_host"] = Field(
        "device",
        description="where the optimizer state lives between steps: device memory, or the host's pinned "
        "memory (brought to the device a layer slice at a time for the update, as the reference run kept it)",
    )
    microbatches: int = Field(
        1,
        ge=1,
        description="gradient accumulation: the step's batch runs as this many equal microbatches (one "
        "forward and backward each, gradients summed in fp32), then one optimizer update; activation "
        "memory shrinks in proportion, the batch size the optimizer sees does not",
    )


class ScheduleConfig(Section):
    """How long this phase trains and the learning rate over the run's global steps."""

    steps: int | None = Field(
        None, gt=0, description="train this phase up to this many steps (default: all the plan gives it)"
    )
    kind: Literal["wsd", "linear"] | None = Field(None, description="default: linear (muonh) or wsd")
    total_steps: int | None = Field(
        None, gt=0, description="the schedule's length (default: the end of the last phase)"
    )
    warmup_steps: int | None = Field(None, ge=0, description="default: 1% of the steps (muonh) or 10")
    decay_steps: int | None = Field(
        None, ge=0, description="wsd's decay (default: the last phase, or the last 20% of a one-phase run)"
    )
    min_lr_ratio: float | None = Field(None, ge=0, description="final rate / peak (default: 0.05 or 0.1)")


class DataConfig(Section):
    """What the run trains on: a phase of a mixture planned against token shards, or synthetic tokens."""

    mixture: str | None = Field(None, description="mixture spec (mixtures/*.yaml), planned against tokens")
    plan: str | None = Field(None, description="a saved plan (`tokenmill mixture plan --json`) instead")
    tokens: str | None = Field(
        None,
        description="token shards directory with counts.json, local or gs://BUCKET/... (read with ranged "
        "requests, nothing copied first; default: the mixture's counts:)",
    )
    phase: str = Field("pretraining", description="the phase to train")
    synthetic: bool = Field(False, description="train on synthetic data (no shards needed)")
    batch_size: int | None = Field(
        None, gt=0, description=f"sequences per step (default: the plan's, else {DEFAULT_BATCH_SIZE})"
    )
    sequence_length: int | None = Field(
        None, gt=0, description="tokens per sequence (default: the plan's, else the model's)"
    )
    tokenizer_sha256: str | None = Field(
        None, description="refuse shards made with any other tokenizer (default: the plan's or the shards')"
    )
    reader: Literal["auto", "direct", "mmap"] = Field(
        "auto",
        description="how windows are read: direct (O_DIRECT with native AIO, for data larger than memory), "
        "mmap (memory maps and the page cache), auto: direct where the system allows it (no batch depends "
        "on it)",
    )
    shard_cache: Count = Field(
        0,
        ge=0,
        description="local disk kept for gs:// shards read over and over (small sources), e.g. 200G; each "
        "is downloaded once its ranged reads have cost as much, checked against its manifest's sha256; 0 "
        "keeps none",
    )
    shard_cache_dir: str | None = Field(
        None,
        description="where that cache lives (default: $TOKENMILL_CACHE_DIR, else ~/.cache/tokenmill, "
        "remote-files/token-shards)",
    )
    verify_shards: bool = Field(
        False,
        description="before training, check every shard's sha256 against its manifest (reads all of them; "
        "with gs:// shards each process checks its share). Sizes are always checked",
    )


class MeshConfig(Section):
    """The device mesh: parameters shard over fsdp, experts over expert, batch rows over data and fsdp."""

    data: int = Field(
        1, description="data-parallel size; one of the three may be -1, the rest of the devices"
    )
    fsdp: int = Field(-1, description="parameter-sharding size (default: every device left)")
    expert: int = Field(1, description="expert-parallel size")
    distributed: bool = Field(False, description="call jax.distributed.initialize() first (several hosts)")

    @model_validator(mode="after")
    def _check(self) -> MeshConfig:
        sizes = (self.data, self.fsdp, self.expert)
        if sizes.count(-1) > 1 or any(size == 0 or size < -1 for size in sizes):
            raise ValueError(
                f"mesh sizes {sizes}: each positive, or one of them -1 (the rest of the devices)"
            )
        return self

    @property
    def text(self) -> str:
        """'data,fsdp,expert', the form `parse_mesh_shape` reads."""
        return f"{self.data},{self.fsdp},{self.expert}"


class CheckpointConfig(Section):
    """Orbax checkpoints under runs/NAME/checkpoints; a rerun resumes from the latest."""

    every: int = Field(100, gt=0, description="save every this many steps (and at the phase's last)")
    keep: int = Field(3, gt=0, description="checkpoints kept")
    asynchronous: bool = Field(True, description="save in the background while training goes on")
    init_from: str | None = Field(
        None, description="start this phase from another run folder's latest checkpoint"
    )


class LoggingConfig(Section):
    """runs/NAME/metrics.jsonl and train.log, always; Weights & Biases when a project is given; the live
    run page when a publish destination is given."""

    peak_flops: float | None = Field(
        None,
        gt=0,
        description="peak FLOP/s of the whole mesh for MFU (default: the data sheet's, or measured)",
    )
    wandb_project: str | None = Field(
        None, description="also log to Weights & Biases (if installed; WANDB_MODE=offline ok)"
    )
    publish: str | None = Field(
        None,
        description="republish the run page (run.html and data/run/) into this folder or gs:// prefix while "
        'training, from a background thread (docs/reports.md, "Live run page")',
    )
    publish_every: int = Field(
        100, gt=0, description="publish every this many steps (and at every checkpoint)"
    )
    expert_load_every: int = Field(
        100,
        gt=0,
        description="write every layer's per-expert load into metrics.jsonl every this many steps (and at "
        "the first and last step); every row has each layer's expert_imbalance",
    )
    health_every: int = Field(
        100,
        ge=0,
        description="every this many global steps, write per-layer health into metrics.jsonl: parameter "
        "and update norms per parameter group, the router bias's change and the router z-loss per layer "
        "(0: never)",
    )
    publish_refresh: int = Field(
        60,
        ge=0,
        description="the published page reloads itself this often in the browser, seconds (0: never)",
    )
    publish_ladder: str | None = Field(
        None,
        description="a scaling-ladder fit (`tokenmill ladder fit`'s ladder.json) drawn against the live loss "
        "(default: the run folder's ladder.json, if any)",
    )


class EvaluationConfig(Section):
    """Held-out evaluation while training (docs/trainer.md, "Held-out evaluation"): the plan's evaluation
    sets (or those named) scored at fixed points into runs/NAME/eval.jsonl. A run without a plan, or whose
    plan names no evaluation sets, evaluates nothing."""

    every: int = Field(
        0, ge=0, description="evaluate every this many global steps (0: only at the phase's end and the end)"
    )
    sequences: int = Field(
        64,
        gt=0,
        description="sequences of data.sequence_length tokens per set at most: whole documents in a fixed "
        "order, the same at every evaluation and in every run of the same sets",
    )
    dispatch: Literal["dropless", "capacity", "both"] | None = Field(
        None,
        description="how the routed experts run when scoring: dropless, capacity (as in training), or both "
        "(default: both when the model trains with capacity, else dropless)",
    )
    sets: list[str] | None = Field(
        None,
        description="the sets to score, by name (default: the plan's evaluation sets); a name not in the "
        "plan may be an external set (tokens/eval/NAME) or heldout/CELL",
    )
    rows: int | None = Field(
        None, gt=0, description="sequences per evaluation batch (default: a training microbatch's rows)"
    )


class GuardConfig(Section):
    """The spike and non-finite guard (run/guard.py) and what follows a run of skipped steps
    (docs/trainer.md, "A run's bad hours"). `guard: off` in a file turns it off."""

    enabled: bool = Field(
        True, description="skip a step whose loss or gradient norm is non-finite or a spike"
    )
    sigmas: float = Field(
        6.0, gt=0, description="a spike: above mean + this many standard deviations of the window"
    )
    window: int = Field(128, gt=1, description="the last this many applied steps make the window")
    warmup: int = Field(64, ge=1, description="no spike is called before the window holds this many steps")
    rollback_after: int = Field(
        3,
        ge=0,
        description="after this many skipped steps in a row, restore the last good checkpoint and continue "
        "past the steps since it (0: never roll back)",
    )
    max_rollbacks: int = Field(
        3, ge=0, description="stop (exit code 1) at the rollback after this many in one command"
    )
    skip_steps: list[int] = Field(
        [],
        description="global steps never trained on (their data is skipped, the step counter moves on): an "
        "operator's exclusion by hand; a rollback's are read from events.jsonl",
    )

    @model_validator(mode="before")
    @classmethod
    def _switch(cls, value: Any) -> Any:
        # YAML reads `guard: off` as false.
        if isinstance(value, bool):
            return {"enabled": value}
        if isinstance(value, str) and value.lower() in ("off", "on"):
            return {"enabled": value.lower() == "on"}
        return value


class WatchdogConfig(Section):
    """Preemption and hangs (docs/trainer.md, "A run's bad hours"): on SIGTERM or SIGINT the step in flight
    finishes, a checkpoint is written and the command exits with the requeue code (75); a run with no step
    completed in time dumps every thread's stack into train.log and exits with code 76."""

    first_step_seconds: float = Field(
        3600.0,
        ge=0,
        description="seconds the first step of a command (it compiles), the first evaluation and each "
        "checkpoint's save or final wait may take (0: no limit)",
    )
    step_seconds: float = Field(
        900.0, ge=0, description="seconds every later step (with its evaluation) may take (0: no limit)"
    )
    preemption_seconds: float = Field(
        120.0,
        gt=0,
        description="after SIGTERM/SIGINT, the step and the checkpoint must be done within this; otherwise "
        "the step is abandoned (the latest checkpoint stays the one to resume) and the command exits 75",
    )


class RunConfig(Section):
    """A training run: configs/runs/*.yaml, or a run's own config.json once resolved."""

    output: str | None = Field(None, description="run folder, e.g. runs/NAME")
    seed: int = Field(0, description="seed of the initial weights and of the batches")
    compute_dtype: Literal["float32", "bfloat16"] = Field("float32", description="matmul precision")
    model: ModelConfig | None = Field(
        None, description="the model shape: a configs/models/*.yaml file, or the shape itself"
    )
    optimizer: OptimizerConfig = OptimizerConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    data: DataConfig = DataConfig()
    mesh: MeshConfig = MeshConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    logging: LoggingConfig = LoggingConfig()
    evaluation: EvaluationConfig = EvaluationConfig()
    guard: GuardConfig = GuardConfig()
    watchdog: WatchdogConfig = WatchdogConfig()

    def with_devices(self, mesh: Mapping[str, int], peak_flops: float) -> RunConfig:
        """A copy with the devices' facts filled in, the mesh's sizes and the peak FLOP/s: what the loop
        records in config.json once it knows the devices."""
        return self.model_copy(
            update={
                "mesh": self.mesh.model_copy(update=dict(mesh)),
                "logging": self.logging.model_copy(update={"peak_flops": peak_flops}),
            }
        )

    def with_values(self, values: Mapping[str, Any]) -> RunConfig:
        """A copy with dotted fields set (`{"optimizer.lr": 1e-3}`), validated again."""
        return _validate(set_dotted(self.model_dump(), values), "the settings given")

    @property
    def model_shape(self) -> ModelConfig:
        """The model, which a run cannot do without; RunConfigError when none is given."""
        if self.model is None:
            raise RunConfigError("no model: give --model FILE (or model: in the run configuration)")
        return self.model


@dataclass(frozen=True)
class Phase:
    """One phase of a run, in global steps: [start_step, end_step)."""

    name: str
    start_step: int
    end_step: int

    @property
    def steps(self) -> int:
        return self.end_step - self.start_step


def phases_from_plan(plan: MixturePlan) -> list[Phase]:
    """The phases of a mixture plan, in order (the format guarantees at least one)."""
    return [Phase(phase.name, phase.start_step, phase.end_step) for phase in plan.phases]


@dataclass(frozen=True)
class ResolvedRun:
    """A run configuration resolved once against its phases, plan and recipe (`resolve_run_config`): every
    setting given but the devices' facts (the mesh's -1 size, the peak FLOP/s), which the loop records
    where it starts. What `train()` takes; nothing resolves it again."""

    config: RunConfig
    phases: tuple[Phase, ...]
    plan: MixturePlan | None = None

    @property
    def phase(self) -> Phase:
        """The phase this run trains (data.phase)."""
        return next(phase for phase in self.phases if phase.name == self.config.data.phase)

    @property
    def model(self) -> ModelConfig:
        return self.config.model_shape


def set_dotted(raw: dict[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """`raw` with each dotted key (`optimizer.lr`) set, creating the sections it passes through."""
    raw = copy.deepcopy(raw)
    for dotted, value in values.items():
        node = raw
        parts = dotted.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise RunConfigError(f"{dotted}: {'.'.join(parts[: i + 1])} is not a section")
            node = child
        node[parts[-1]] = value
    return raw


def _validate(raw: Any, source: str) -> RunConfig:
    if not isinstance(raw, dict):
        raise RunConfigError(
            f"{source}: a run configuration is a mapping of sections (model, optimizer, ...)"
        )
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as error:
        raise RunConfigError(f"{source}: {validation_problems(error, 'run')}") from error


def read_run_config_file(path: str) -> dict[str, Any]:
    """The settings of a configs/runs/*.yaml file or of a run's config.json (its records left out).

    Raises RunConfigError naming the file and, for an unknown or bad field, the field."""
    try:
        if path.endswith(".json"):
            # A run's config.json: read through its format, which checks the records the trainer added.
            raw = read_run_record(path).to_json()
        else:
            raw = yaml.load(Path(path).read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except OSError as error:
        raise RunConfigError(
            f"{path}: cannot read the run configuration ({error.strerror or error})"
        ) from error
    except FormatError as error:
        raise RunConfigError(str(error)) from error
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f"line {mark.line + 1}: " if mark else ""
        problem = " ".join(part for part in (error.context, error.problem) if part)
        raise RunConfigError(f"{path}: not valid YAML: {where}{problem}") from error
    except yaml.YAMLError as error:
        raise RunConfigError(f"{path}: not valid YAML ({error})") from error
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RunConfigError(f"{path}: a run configuration is a mapping of sections (model, optimizer, ...)")
    if path.endswith(".json"):
        if "train" in raw and "optimizer" not in raw:
            raise RunConfigError(
                f"{path}: written by a tokenmill before run configurations (it has train:, not optimizer:, "
                "schedule: and data:); give its settings as flags"
            )
        raw = {key: value for key, value in raw.items() if key not in RECORD_KEYS}
    # Validate the file on its own first, so that its mistakes are reported against it, not the flags.
    _validate(_with_model_file(raw, path), path)
    return raw


def _with_model_file(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """`raw` with a model given as a file path replaced by the shape that file holds."""
    model = raw.get("model")
    if not isinstance(model, str | Path):
        return raw
    try:
        shape = load_model_config(model)
    except ValueError as error:
        raise RunConfigError(f"{source}: model: {error}") from error
    return {**raw, "model": shape.model_dump(mode="json")}


def build_run_config(
    raw: Mapping[str, Any] | None = None,
    overrides: Mapping[str, Any] | None = None,
    source: str | None = None,
) -> RunConfig:
    """A RunConfig from a file's settings (`read_run_config_file`) and dotted overrides that win over them.

    `model` may be a path in either; the shape is read from it before the overrides of its fields
    (`model.moe.dispatch`) apply. `source` names the file in errors."""
    overrides = dict(overrides or {})
    model_fields = {key: value for key, value in overrides.items() if key.startswith("model.")}
    others = {key: value for key, value in overrides.items() if key not in model_fields}
    where = "the command line" if source is None else f"{source} with the command line's settings"
    merged = _with_model_file(set_dotted(dict(raw or {}), others), where)
    if model_fields and not isinstance(merged.get("model"), dict):
        raise RunConfigError(f"{', '.join(sorted(model_fields))}: no model to change: give --model FILE too")
    return _validate(set_dotted(merged, model_fields), where)


def resolve_run_config(
    run: RunConfig, phases: Sequence[Phase], plan: MixturePlan | None = None
) -> ResolvedRun:
    """Every unset field filled in, as this run will train: what runs/NAME/config.json records.

    Batch and sequence length come from the plan (else 8 sequences of the model's length); the optimizer
    and schedule from the recipe: Marin's heuristic for this run's tokens, width and batch for the Marin
    family (MuonH, a linear schedule with 1% warmup down to 0.05, no clipping, no weight decay), otherwise
    AdamW at 3e-3, wsd with 10 warmup steps, clipping at 1 and weight decay 0.1. A field already set is
    kept, so resolving a resolved configuration changes nothing. The mesh and the peak FLOP/s depend on the
    devices and are recorded by the training loop. Raises RunConfigError when the settings disagree.
    """
    model = run.model_shape
    data, schedule, given = run.data, run.schedule, run.optimizer
    by_name = {phase.name: phase for phase in phases}
    if data.phase not in by_name:
        raise RunConfigError(f"phase {data.phase!r} is not in the plan (phases: {', '.join(by_name)})")
    phase = by_name[data.phase]
    planned_batch = plan.batch_size if plan is not None else None
    if planned_batch and data.batch_size and data.batch_size != planned_batch:
        raise RunConfigError(
            f"batch size {data.batch_size} (--data.batch_size) differs from the plan's {planned_batch}"
        )
    batch_size = data.batch_size or planned_batch or DEFAULT_BATCH_SIZE
    if batch_size % given.microbatches:
        raise RunConfigError(
            f"optimizer.microbatches {given.microbatches} does not divide the batch of {batch_size} sequences"
        )
    sequence_length = (
        data.sequence_length or (plan.sequence_length if plan is not None else None) or model.sequence_length
    )
    if sequence_length > model.sequence_length:
        raise RunConfigError(
            f"sequence length {sequence_length} is longer than the model's sequence_length "
            f"{model.sequence_length}"
        )

    total = schedule.total_steps or phases[-1].end_step
    tokens_per_batch = batch_size * sequence_length
    kind = given.kind or ("muonh" if is_marin_family(model) else "adamw")
    if kind == "muonh":
        recipe = HEURISTICS[given.lr_heuristic].hyperparameters(
            total * tokens_per_batch, model.d_model, tokens_per_batch
        )
        recipe["warmup_steps"] = warmup_steps_for(total, recipe.pop("warmup_fraction"))
    else:
        recipe = {"lr": 3e-3, "adam_lr": None, "beta1": 0.9, "beta2": 0.95, "epsilon": 1e-8,
                  "min_lr_ratio": 0.1, "schedule": "wsd", "warmup_steps": 10, "clip_norm": 1.0,
                  "weight_decay": 0.1}  # fmt: skip

    def pick(value: Any, key: str) -> Any:
        return recipe[key] if value is None else value

    lr = pick(given.lr, "lr")
    adam_lr = given.adam_lr
    if adam_lr is None:
        # Given only the MuonH rate, keep Marin's ratio rather than the heuristic's Adam rate.
        adam_lr = (
            lr * ADAM_TO_MUONH_LR_RATIO if kind == "muonh" and given.lr is not None else recipe["adam_lr"]
        )
    if schedule.decay_steps is not None:
        decay = schedule.decay_steps
    elif len(phases) > 1:
        decay = phases[-1].steps  # midtraining is the decay
    else:
        decay = max(1, total // 5)
    warmup = min(pick(schedule.warmup_steps, "warmup_steps"), max(0, total - decay))
    evaluated = "both" if model.moe.dispatch == "capacity" else "dropless"
    resolved = run.model_copy(
        update={
            "optimizer": OptimizerConfig(
                kind=kind,
                lr_heuristic=given.lr_heuristic,
                lr=lr,
                adam_lr=adam_lr,
                beta1=pick(given.beta1, "beta1"),
                beta2=pick(given.beta2, "beta2"),
                epsilon=pick(given.epsilon, "epsilon"),
                weight_decay=pick(given.weight_decay, "weight_decay"),
                clip_norm=pick(given.clip_norm, "clip_norm"),
                state_memory=given.state_memory,
                microbatches=given.microbatches,
            ),
            "schedule": ScheduleConfig(
                steps=schedule.steps if schedule.steps is not None else phase.steps,
                kind=pick(schedule.kind, "schedule"),
                total_steps=total,
                warmup_steps=warmup,
                decay_steps=min(decay, total - warmup),
                min_lr_ratio=pick(schedule.min_lr_ratio, "min_lr_ratio"),
            ),
            "data": data.model_copy(update={"batch_size": batch_size, "sequence_length": sequence_length}),
            # Both dispatches when the model trains with capacity: the training one and the comparable one.
            "evaluation": run.evaluation.model_copy(
                update={"dispatch": run.evaluation.dispatch or evaluated}
            ),
        }
    )
    return ResolvedRun(resolved, tuple(phases), plan)
