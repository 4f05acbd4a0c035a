"""Scaling ladders: lay out rungs from a model family, fit loss against compute, forecast the big run.

A ladder spec (configs/ladders/*.yaml) names a family of model shapes (the rungs), the big run they
forecast (the target), the big mixture and a tokens-per-active-parameter rule. `plan_ladder` gives each
rung its tokens (k x active parameters, rounded to whole mixture blocks, or with `round_to: steps` to
whole steps: Marin's round(k x active / tokens per step)), steps, compute (Marin's forecast C and the
trainer's FLOPs, `flops.py`), the optimizer settings Marin's heuristic gives it (Marin family), and its
mixture as a `slice_of` the big one, so that every source repeats as often as in the big run (simulated
epoching, docs/mixtures.md). A rung's batch may be given in racks of `sequences_per_rack` sequences.

`fit_ladder` reads the rungs' runs/NAME/metrics.jsonl and config.json after training, takes each rung's
smoothed loss at matched fractions of its planned steps, and fits one of two procedures:

- "shared" (the default): L(C) = E + A_f * C^(-alpha) with the irreducible loss E and the exponent alpha
  shared by every fraction f and one coefficient A_f per fraction, C the trainer's FLOPs;
- "marin" (the reference run's own forecast): L = E + A_f * C^(-alpha_f) with E fixed (1.5) and A_f and
  alpha_f fitted separately at every 5% of training, a straight line in log(L - E) against log C, C being
  Marin's forecast compute (no head, full-span attention).

Both forecast the target's loss at the same fractions of its compute, with a band from a parametric
bootstrap. docs/ladder.md explains the choices; nothing here imports JAX.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PositiveInt, ValidationError

from tokenmill import storage
from tokenmill.trainer.config import ModelConfig, load_model_config
from tokenmill.trainer.flops import count_params, flops_per_token, forecast_flops_per_token
from tokenmill.trainer.heuristic import MAY_RECIPE, is_marin_family, warmup_steps_for
from tokenmill.units import format_count, parse_count
from tokenmill.validation import validation_problems

FORMAT_VERSION = 1
DEFAULT_FRACTIONS = (0.25, 0.5, 0.75, 1.0)
DEFAULT_WINDOW = 0.1  # of a run's planned steps
# Marin's procedure (experiments/grug/moe_hero_ep/plot_scaling_ladder.py): every 5%, asymptote 1.5.
MARIN_FRACTIONS = tuple(round(0.05 * i, 2) for i in range(1, 21))
MARIN_WINDOW = 0.05
MARIN_ASYMPTOTE = 1.5
PROCEDURES = ("shared", "marin")
MIN_WINDOW_STEPS = 5
CURVE_POINTS = 48


class LadderError(ValueError):
    """A ladder spec, a run folder or a fit that cannot be used; the message names the file."""


# ---------------------------------------------------------------------------------------------------------
# The spec


def _count(value: Any) -> Any:
    return None if value is None else parse_count(value)


Count = Annotated[int, BeforeValidator(_count)]
Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]+$")]


class RungSpec(BaseModel):
    """One rung: a model of the family; tokens follow the ladder's rule unless given."""

    model_config = ConfigDict(extra="forbid")

    name: Name
    model: str
    tokens: Count | None = None
    sequence_length: PositiveInt | None = None
    batch_size: PositiveInt | None = None
    racks: PositiveInt | None = None  # batch_size = racks x the ladder's sequences_per_rack
    block_size: PositiveInt | None = None
    # A hand-written slice spec of the same rung (mixtures/marin-ladder-*.yaml), planned side by side.
    compare: str | None = None


class TargetSpec(BaseModel):
    """The big run the ladder forecasts."""

    model_config = ConfigDict(extra="forbid")

    model: str
    # default: the mixture's run, total_steps x tokens per step when it gives total_steps, else total_tokens
    tokens: Count | None = None
    sequence_length: PositiveInt | None = None  # default: the mixture's
    racks: PositiveInt | None = None  # its batch in racks: checked against the mixture's batch


class LadderSpec(BaseModel):
    """configs/ladders/*.yaml; paths are relative to the spec's file."""

    model_config = ConfigDict(extra="forbid")

    name: Name
    description: str | None = None
    mixture: str
    tokens_per_active_param: float = Field(gt=0)
    sequence_length: PositiveInt | None = None
    batch_size: PositiveInt | None = None
    block_size: PositiveInt | None = None
    sequences_per_rack: PositiveInt | None = None  # what a rung's `racks` multiplies
    # "blocks": a rung's tokens are rounded to whole mixture blocks (lcm of batch and block); "steps": to
    # whole steps, steps = round(k x active / tokens per step) (Marin), the last block possibly partial.
    round_to: Literal["blocks", "steps"] = "blocks"
    target: TargetSpec
    rungs: list[RungSpec] = Field(min_length=1)


@dataclass
class Ladder:
    """A validated spec with its paths resolved against the spec's folder."""

    file: str
    spec: LadderSpec
    mixture: str
    target_model: str
    rung_models: list[str]
    rung_compare: list[str | None]


def _relative(file: str, target: str) -> str:
    if os.path.isabs(target) or "://" in target:
        return target
    return os.path.normpath(os.path.join(os.path.dirname(file), target))


def load_ladder(path: str | os.PathLike[str]) -> Ladder:
    """Read and validate a ladder spec; LadderError names the file and the field."""
    path = os.fspath(path)
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        raise LadderError(f"{path}: cannot read the ladder spec ({error.strerror or error})") from error
    except yaml.YAMLError as error:
        raise LadderError(f"{path}: not valid YAML ({error})") from error
    if not isinstance(raw, dict):
        raise LadderError(f"{path}: a ladder spec is a mapping")
    try:
        spec = LadderSpec.model_validate(raw)
    except ValidationError as error:
        raise LadderError(f"{path}: {validation_problems(error, 'ladder')}") from error
    names = [rung.name for rung in spec.rungs]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise LadderError(f"{path}: rungs: duplicate names {', '.join(duplicates)}")
    for where, item in [
        *((f"rungs[{i}]", rung) for i, rung in enumerate(spec.rungs)),
        ("target", spec.target),
    ]:
        if item.racks is not None and spec.sequences_per_rack is None:
            raise LadderError(
                f"{path}: {where}.racks: give sequences_per_rack (sequences in one rack's batch)"
            )
        if item.racks is not None and getattr(item, "batch_size", None) is not None:
            raise LadderError(f"{path}: {where}: give racks or batch_size, not both")
    return Ladder(
        file=path,
        spec=spec,
        mixture=_relative(path, spec.mixture),
        target_model=_relative(path, spec.target.model),
        rung_models=[_relative(path, rung.model) for rung in spec.rungs],
        rung_compare=[_relative(path, rung.compare) if rung.compare else None for rung in spec.rungs],
    )


def _model(path: str) -> ModelConfig:
    try:
        return load_model_config(path)
    except ValueError as error:
        raise LadderError(str(error)) from error


def _racks_batch(spec: LadderSpec, racks: int | None) -> int | None:
    return racks * spec.sequences_per_rack if racks is not None and spec.sequences_per_rack else None


def target_of(ladder: Ladder) -> dict[str, Any]:
    """The target's model, tokens and compute. Tokens default to the mixture's run: total_steps x tokens per
    step when the mixture gives total_steps (the reference run: 390,251 steps, 18.005T tokens, of a mixture
    budgeted at 18.75T), else its total_tokens."""
    from tokenmill.mixtures import MixtureError, load_mixture

    spec = ladder.spec
    cfg = _model(ladder.target_model)
    tokens = spec.target.tokens
    seq_len = spec.target.sequence_length
    batch = _racks_batch(spec, spec.target.racks)
    steps = None
    warnings = []
    try:
        mixture = load_mixture(ladder.mixture)
    except MixtureError as error:
        raise LadderError(f"{ladder.file}: mixture: {error}") from error
    seq_len = seq_len or mixture.sequence_length
    if tokens is None:
        if mixture.total_steps is not None:
            steps = mixture.total_steps
            tokens = steps * mixture.batch_size * mixture.sequence_length
        else:
            tokens = mixture.total_tokens
        if batch is not None and batch != mixture.batch_size:
            warnings.append(
                f"{spec.target.racks} racks are {batch:,} sequences a step, the mixture's batch is "
                f"{mixture.batch_size:,}"
            )
    record = _target_record(cfg, ladder.target_model, tokens, seq_len, batch or mixture.batch_size)
    record["steps"] = steps
    record["racks"] = spec.target.racks
    record["steps_by_rule"] = max(
        1, round(spec.tokens_per_active_param * record["active_params"] / (record["batch_size"] * seq_len))
    )
    if steps is not None and record["steps_by_rule"] != steps:
        warnings.append(
            f"{spec.tokens_per_active_param:g} tokens per active parameter make {record['steps_by_rule']:,} "
            f"steps, the mixture plans {steps:,}"
        )
    record["warnings"] = warnings
    return record


def _optimizer_record(cfg: ModelConfig, steps: int, tokens_per_step: int) -> dict[str, Any] | None:
    """What `tokenmill train` defaults to for this run: Marin's heuristic for the Marin family, else None."""
    if not is_marin_family(cfg):
        return None
    settings = MAY_RECIPE.hyperparameters(steps * tokens_per_step, cfg.d_model, tokens_per_step)
    settings["warmup_steps"] = warmup_steps_for(steps, settings.pop("warmup_fraction"))
    return settings


def _target_record(
    cfg: ModelConfig, model_file: str, tokens: int, seq_len: int, batch_size: int | None = None
) -> dict[str, Any]:
    params = count_params(cfg)
    per_token = flops_per_token(cfg, seq_len)
    record = {
        "name": cfg.name,
        "model": model_file,
        "total_params": params.total_params,
        "active_params": params.active_params,
        "tokens": tokens,
        "sequence_length": seq_len,
        "tokens_per_active_param": tokens / params.active_params,
        "flops_per_token": per_token,
        "flops": per_token * tokens,
        "forecast_compute": forecast_flops_per_token(cfg, seq_len) * tokens,
    }
    if batch_size:
        record["batch_size"] = batch_size
        tokens_per_step = batch_size * seq_len
        if tokens % tokens_per_step == 0:
            record["optimizer"] = _optimizer_record(cfg, tokens // tokens_per_step, tokens_per_step)
    return record


def target_from_model(model_file: str, tokens: int, seq_len: int | None = None) -> dict[str, Any]:
    """The target record of `--target-model FILE --target-tokens N`."""
    cfg = _model(model_file)
    return _target_record(cfg, model_file, tokens, seq_len or cfg.seq_len)


# ---------------------------------------------------------------------------------------------------------
# Planning the rungs


def _slice_text(
    name: str,
    description: str,
    parent: str,
    tokens: int,
    seq: int | None,
    batch: int | None,
    block: int | None,
    steps: int | None = None,
) -> str:
    fields: dict[str, Any] = {"name": name, "description": description, "slice_of": parent}
    if steps is not None:
        fields["total_steps"] = steps
    else:
        fields["total_tokens"] = tokens
    for key, value in (("sequence_length", seq), ("batch_size", batch), ("block_size", block)):
        if value is not None:
            fields[key] = value
    rounded = "whole steps" if steps is not None else "whole mixture blocks"
    header = (
        "# Written by `tokenmill ladder plan`: a slice of the big mixture (simulated epoching), tokens from\n"
        f"# the ladder's tokens-per-active-parameter rule rounded to {rounded}.\n"
    )
    return header + yaml.safe_dump(fields, sort_keys=False, width=110)


def _epoch_gap(full: dict[str, Any], rung: dict[str, Any]) -> dict[str, float]:
    """Largest relative difference between a rung's and the full run's epochs, per phase and over the run."""

    def rel(a: float, b: float) -> float:
        return abs(a - b) / b if b > 0 else (0.0 if a == 0 else math.inf)

    run = max(
        (rel(rung["sources"][name]["epochs"], source["epochs"]) for name, source in full["sources"].items()),
        default=0.0,
    )
    phase = 0.0
    for full_phase, rung_phase in zip(full["phases"], rung["phases"], strict=True):
        theirs = {s["name"]: s["epochs"] for s in rung_phase["sources"]}
        for source in full_phase["sources"]:
            if source["tokens"] > 0:
                phase = max(phase, rel(theirs.get(source["name"], 0.0), source["epochs"]))
    return {"run": run, "phase": phase}


def plan_ladder(
    ladder: Ladder, counts: dict[str, Any] | None = None, output: str | None = None
) -> dict[str, Any]:
    """Each rung's model, parameters, tokens, FLOPs, steps and mixture slice plan (docs/ladder.md).

    counts: the parsed tokens/counts.json (None: the mixtures' declared counts). With `output`, each rung's
    slice spec is written there as RUNG.yaml (train it with `tokenmill train --mixture`), and planned from
    that file; without, the slices are planned in memory.
    """
    from tokenmill.mixtures import MixtureError, load_mixture, load_mixture_text, plan_mixture

    spec = ladder.spec
    k = spec.tokens_per_active_param
    try:
        mixture = load_mixture(ladder.mixture)
        if mixture.slice is not None:
            raise LadderError(f"{ladder.file}: mixture {ladder.mixture} is itself a slice; name the full run")
        full_plan = plan_mixture(mixture, counts).to_json()
    except MixtureError as error:
        raise LadderError(f"{ladder.file}: mixture: {error}") from error
    if output:
        os.makedirs(output, exist_ok=True)
    target = target_of(ladder)
    target["steps"] = full_plan["total_steps"] if spec.target.tokens is None else None
    rungs = []
    for rung, model_file, compare in zip(spec.rungs, ladder.rung_models, ladder.rung_compare, strict=True):
        cfg = _model(model_file)
        params = count_params(cfg)
        requested = rung.tokens if rung.tokens is not None else round(k * params.active_params)
        seq = rung.sequence_length or spec.sequence_length
        batch = rung.batch_size or _racks_batch(spec, rung.racks) or spec.batch_size
        block = rung.block_size or spec.block_size
        slice_name = f"{spec.name}-{rung.name}"
        description = f"rung {rung.name} of ladder {spec.name} ({cfg.name}), a slice of {mixture.name}"
        if requested > mixture.total_tokens:
            raise LadderError(
                f"{ladder.file}: rung {rung.name} asks {format_count(requested, 4)} tokens, more than the "
                f"big mixture's {format_count(mixture.total_tokens, 4)}; a rung is a slice of the big run"
            )
        try:
            # Round to whole mixture blocks (lcm(batch, block) sequences), the planner's granule, so that the
            # slice's fraction of the big run is exactly its planned tokens over the big run's.
            probe = load_mixture_text(
                _slice_text(slice_name, description, ladder.mixture, max(1, requested), seq, batch, block)
            )
            tokens_per_step = probe.batch_size * probe.sequence_length
            steps: int | None = None
            if spec.round_to == "steps":
                wanted = rung.tokens if rung.tokens is not None else k * params.active_params
                steps = max(1, round(wanted / tokens_per_step))
                tokens = steps * tokens_per_step
                if tokens > mixture.total_tokens:
                    raise LadderError(
                        f"{ladder.file}: rung {rung.name}: {steps:,} steps are {format_count(tokens, 4)} "
                        f"tokens, more than the big mixture's {format_count(mixture.total_tokens, 4)}"
                    )
            else:
                granule = math.lcm(probe.batch_size, probe.block_size) * probe.sequence_length
                tokens = min(max(granule, round(requested / granule) * granule), mixture.total_tokens)
            if output:
                spec_file = os.path.join(output, f"{rung.name}.yaml")
                parent = os.path.relpath(ladder.mixture, output)
                text = _slice_text(slice_name, description, parent, tokens, seq, batch, block, steps)
                Path(spec_file).write_text(text, encoding="utf-8")
                sliced = load_mixture(spec_file)
            else:
                spec_file = None
                sliced = load_mixture_text(
                    _slice_text(slice_name, description, ladder.mixture, tokens, seq, batch, block, steps)
                )
            plan = plan_mixture(sliced, counts).to_json()
        except MixtureError as error:
            raise LadderError(f"{ladder.file}: rung {rung.name}: {error}") from error
        seq_len = plan["sequence_length"]
        per_token = flops_per_token(cfg, seq_len)
        # The slice plan's own warnings are about the mixture (weights that round away in a block), the
        # same for every rung: the full plan's are printed once, a rung keeps only what is its own.
        warnings = [w for w in plan["warnings"] if w not in full_plan["warnings"]]
        if seq_len > cfg.seq_len:
            warnings.append(f"sequence length {seq_len} is longer than {cfg.name}'s seq_len {cfg.seq_len}")
        reference = getattr(cfg, "reference_run", None)
        if reference is not None and (reference.steps, reference.batch_size) != (
            plan["total_steps"],
            plan["batch_size"],
        ):
            warnings.append(
                f"{cfg.name}'s reference run is {reference.steps:,} steps of {reference.batch_size:,} "
                f"sequences, this plan {plan['total_steps']:,} of {plan['batch_size']:,}"
            )
        record: dict[str, Any] = {
            "name": rung.name,
            "model": model_file,
            "model_name": cfg.name,
            "total_params": params.total_params,
            "active_params": params.active_params,
            "tokens_requested": requested,
            "tokens": plan["planned_tokens"],
            "tokens_per_active_param": plan["planned_tokens"] / params.active_params,
            "sequence_length": seq_len,
            "batch_size": plan["batch_size"],
            "racks": rung.racks,
            "block_size": plan["block_size"],
            "steps": plan["total_steps"],
            "phases": [
                {
                    "name": p["name"],
                    "start_step": p["start_step"],
                    "end_step": p["end_step"],
                    "tokens": p["tokens"],
                }
                for p in plan["phases"]
            ],
            "flops_per_token": per_token,
            "flops": per_token * plan["planned_tokens"],
            "forecast_compute": forecast_flops_per_token(cfg, seq_len) * plan["planned_tokens"],
            "optimizer": _optimizer_record(cfg, plan["total_steps"], plan["tokens_per_step"]),
            "mixture_spec": spec_file,
            "slice_fraction": plan["slice"]["fraction"] if plan.get("slice") else None,
            "epochs": {name: source["epochs"] for name, source in plan["sources"].items()},
            "epoch_gap": _epoch_gap(full_plan, plan),
            "warnings": warnings,
            "plan": plan,
        }
        if compare:
            try:
                shipped = plan_mixture(load_mixture(compare), counts).to_json()
            except MixtureError as error:
                raise LadderError(f"{ladder.file}: rung {rung.name}: compare: {error}") from error
            record["compare"] = {
                "mixture": compare,
                "name": shipped["name"],
                "tokens": shipped["planned_tokens"],
                "steps": shipped["total_steps"],
                "batch_size": shipped["batch_size"],
                "tokens_difference": plan["planned_tokens"] / shipped["planned_tokens"] - 1,
                "epoch_gap": _epoch_gap(shipped, plan) if shipped.get("slice") else None,
            }
        rungs.append(record)
    result = {
        "format_version": FORMAT_VERSION,
        "name": spec.name,
        "description": spec.description,
        "spec": ladder.file,
        "mixture": ladder.mixture,
        "mixture_name": full_plan["name"],
        "mixture_tokens": full_plan["planned_tokens"],
        "tokens_per_active_param": k,
        "round_to": spec.round_to,
        "mixture_warnings": full_plan["warnings"],
        "full_epochs": {name: source["epochs"] for name, source in full_plan["sources"].items()},
        "target": target,
        "rungs": rungs,
    }
    if output:
        Path(output, "ladder-plan.json").write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    return result


# ---------------------------------------------------------------------------------------------------------
# Reading runs and taking matched points


@dataclass
class RunCurve:
    """The losses of one trained run (one rung), with what its config.json says it was meant to train."""

    path: str
    name: str
    steps: np.ndarray
    loss: np.ndarray
    flops: np.ndarray
    planned_steps: int
    block_steps: int
    info: dict[str, Any] = field(default_factory=dict)
    # Marin's forecast compute C of one step (no head, full-span attention), from the run's model and
    # tokens per step; None when config.json does not say enough to price it.
    forecast_per_step: float | None = None

    def compute(self, step: int, convention: str = "trainer") -> float:
        """Compute spent up to and including `step`: the trainer's logged FLOPs or Marin's forecast C."""
        if convention == "forecast":
            if self.forecast_per_step is None:
                raise LadderError(f"{self.path}: its config.json does not give the model to price Marin's C")
            return self.forecast_per_step * (step + 1)
        return float(self.flops[np.searchsorted(self.steps, step)])


def _forecast_per_step(config: dict[str, Any]) -> float | None:
    """C of one training step of the run in config.json, or None (an old run, or a synthetic one)."""
    plan = config.get("plan") or {}
    train = config.get("train") or {}
    seq_len = plan.get("sequence_length") or train.get("seq_len")
    tokens_per_step = plan.get("tokens_per_step") or (
        train.get("batch_size") * seq_len if train.get("batch_size") and seq_len else None
    )
    try:
        cfg = ModelConfig.model_validate(config.get("model") or {})
    except ValidationError:
        return None
    if not tokens_per_step:
        return None
    return float(forecast_flops_per_token(cfg, seq_len or cfg.seq_len) * tokens_per_step)


def read_run(path: str) -> RunCurve:
    """runs/NAME: metrics.jsonl (step, loss, cumulative flops) and config.json (planned steps, counts)."""
    path = path.rstrip("/") or path
    if not storage.exists(path):
        raise LadderError(f"{path}: no such run folder")
    metrics_path = storage.join(path, "metrics.jsonl")
    config_path = storage.join(path, "config.json")
    for file in (metrics_path, config_path):
        if not storage.exists(file):
            raise LadderError(f"{file}: no such file (is {path} a run folder written by `tokenmill train`?)")
    try:
        with storage.open_file(config_path, "rb") as handle:
            config = json.loads(handle.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise LadderError(f"{config_path}: not valid JSON ({error})") from error
    rows: dict[int, tuple[float, float]] = {}
    with storage.open_file(metrics_path, "rb") as handle:
        for number, line in enumerate(handle.read().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                step, loss, flops = int(row["step"]), float(row["loss"]), float(row["flops"])
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as error:
                raise LadderError(
                    f"{metrics_path}: line {number} is not a metrics row with step, loss and flops ({error})"
                ) from error
            if math.isfinite(loss) and math.isfinite(flops):
                rows[step] = (loss, flops)  # a rerun after a resume logs a step again: the last one counts
    if not rows:
        raise LadderError(f"{metrics_path}: no metrics logged")
    plan = config.get("plan") or {}
    planned = plan.get("total_steps") or (config.get("schedule") or {}).get("total_steps")
    if not planned:
        raise LadderError(f"{config_path}: no planned steps (plan.total_steps or schedule.total_steps)")
    steps = np.array(sorted(rows), dtype=np.int64)
    params = config.get("params") or {}
    return RunCurve(
        path=path,
        name=os.path.basename(path) or path,
        steps=steps,
        loss=np.array([rows[s][0] for s in steps.tolist()]),
        flops=np.array([rows[s][1] for s in steps.tolist()]),
        planned_steps=int(planned),
        block_steps=int(plan.get("block_steps") or 1),
        info={
            "model": (config.get("model") or {}).get("name"),
            "total_params": params.get("total_params"),
            "active_params": params.get("active_params"),
            "flops_per_token": config.get("flops_per_token"),
            "tokens_per_step": plan.get("tokens_per_step"),
            "mixture": plan.get("name"),
        },
        forecast_per_step=_forecast_per_step(config),
    )


@dataclass(frozen=True)
class Point:
    """A run's smoothed loss at a fraction of its planned steps, and the compute spent to get there."""

    run: str
    fraction: float
    step: int
    flops: float
    loss: float
    loss_se: float  # standard error of the smoothed loss, from the scatter in its window
    window: int  # steps it was smoothed over


def smoothed_loss(steps: np.ndarray, loss: np.ndarray, at: int, window: int) -> tuple[float, float, int]:
    """The loss at step `at` from a straight line fitted to the last `window` logged steps up to it.

    A trailing mean would lag behind a falling curve (by half a window); the line's value at its end does
    not, for curves that are straight over the window. Returns (loss, standard error, points used).
    """
    mask = (steps <= at) & (steps > at - window)
    x, y = steps[mask].astype(float), loss[mask]
    n = len(x)
    if n < 3:
        return float(y[-1]), 0.0, n
    xm = x.mean()
    sxx = float(((x - xm) ** 2).sum())
    slope = float(((x - xm) * (y - y.mean())).sum()) / sxx
    value = float(y.mean() + slope * (at - xm))
    resid = y - (y.mean() + slope * (x - xm))
    s2 = float((resid**2).sum()) / (n - 2)
    se = math.sqrt(s2 * (1 / n + (at - xm) ** 2 / sxx))
    return value, se, n


def matched_points(
    run: RunCurve,
    fractions: tuple[float, ...] = DEFAULT_FRACTIONS,
    window: float = DEFAULT_WINDOW,
    convention: str = "trainer",
) -> tuple[list[Point], list[str]]:
    """The run's points at each fraction of its planned steps; a warning for each fraction not reached.

    convention: the compute of a point, "trainer" (the logged FLOPs) or "forecast" (Marin's C)."""
    width = max(MIN_WINDOW_STEPS, run.block_steps, round(window * run.planned_steps))
    points, warnings = [], []
    logged = set(run.steps.tolist())
    for fraction in fractions:
        at = max(1, round(fraction * run.planned_steps)) - 1  # the 0-based step that completes the fraction
        if at not in logged:
            warnings.append(
                f"{run.path}: step {at} ({fraction:.0%} of {run.planned_steps} planned) is not logged "
                f"(last logged step {int(run.steps[-1])}); that point is left out"
            )
            continue
        loss, se, used = smoothed_loss(run.steps, run.loss, at, width)
        points.append(Point(run.path, fraction, at, run.compute(at, convention), loss, se, used))
    return points, warnings


# ---------------------------------------------------------------------------------------------------------
# The fit


@dataclass
class Fit:
    """L = E + exp(a[f] - alpha * (ln C - x0)), i.e. A_f = exp(a[f]) * exp(x0)^alpha."""

    E: float
    alpha: float
    a: np.ndarray
    x0: float
    rss: float
    converged: bool

    def predict(self, flops: np.ndarray | float, group: np.ndarray | int) -> np.ndarray:
        x = np.log(np.asarray(flops, dtype=float)) - self.x0
        return self.E + np.exp(self.a[group] - self.alpha * x)

    def coefficient(self, group: int) -> float:
        """A_f in L = E + A_f * C^-alpha (C in FLOPs)."""
        return float(math.exp(self.a[group] + self.alpha * self.x0))


_E_GRID = np.linspace(0.0, 0.995, 40)
_ALPHA_GRID = np.geomspace(0.005, 3.0, 60)
ALPHA_BOUNDS = (1e-4, 5.0)


def _start(x: np.ndarray, y: np.ndarray, onehot: np.ndarray) -> np.ndarray:
    """The best (E, alpha) on a grid, each A_f solved in closed form (for fixed E and alpha it is linear)."""
    es = float(y.min()) * _E_GRID
    z = np.exp(-_ALPHA_GRID[:, None] * x[None, :])  # [alpha, point]
    r = y[None, :] - es[:, None]  # [E, point], >= 0
    num = np.einsum("ep,ap,pf->eaf", r, z, onehot)
    den = np.einsum("ap,pf->af", z * z, onehot)
    coef = np.maximum(num / den[None], 1e-300)
    pred = es[:, None, None] + np.einsum("eaf,ap,pf->eap", coef, z, onehot)
    rss = ((pred - y) ** 2).sum(-1)
    e, a = np.unravel_index(int(np.argmin(rss)), rss.shape)
    return np.concatenate([[es[e], _ALPHA_GRID[a]], np.log(coef[e, a])])


def fit_power_law(flops: np.ndarray, loss: np.ndarray, group: np.ndarray, groups: int) -> Fit:
    """Least squares of L = E + A_g * C^-alpha over points in `groups` groups, E in [0, min L], alpha > 0.

    Parameterised as E + exp(a_g - alpha * (ln C - x0)) with x0 the mean ln C, so that the parameters are of
    order one whatever the units of C. A grid over (E, alpha) gives the start (for fixed E and alpha the A_g
    are linear, solved exactly), scipy's bounded trust-region least squares polishes it.
    """
    from scipy.optimize import least_squares

    flops, loss = np.asarray(flops, dtype=float), np.asarray(loss, dtype=float)
    x0 = float(np.log(flops).mean())
    x = np.log(flops) - x0
    onehot = np.zeros((len(x), groups))
    onehot[np.arange(len(x)), group] = 1.0
    theta0 = _start(x, loss, onehot)
    upper_e = max(float(loss.min()), 1e-9)
    lower = np.concatenate([[0.0, ALPHA_BOUNDS[0]], np.full(groups, -80.0)])
    upper = np.concatenate([[upper_e, ALPHA_BOUNDS[1]], np.full(groups, 80.0)])
    theta0 = np.clip(theta0, lower, upper)

    def residuals(theta: np.ndarray) -> np.ndarray:
        return theta[0] + np.exp(theta[2:][group] - theta[1] * x) - loss

    def jacobian(theta: np.ndarray) -> np.ndarray:
        term = np.exp(theta[2:][group] - theta[1] * x)
        jac = np.zeros((len(x), 2 + groups))
        jac[:, 0] = 1.0
        jac[:, 1] = -x * term
        jac[np.arange(len(x)), 2 + group] = term
        return jac

    result = least_squares(residuals, theta0, jac=jacobian, bounds=(lower, upper), method="trf", max_nfev=400)
    theta = result.x if result.cost <= 0.5 * float((residuals(theta0) ** 2).sum()) else theta0
    rss = float((residuals(theta) ** 2).sum())
    return Fit(float(theta[0]), float(theta[1]), np.array(theta[2:]), x0, rss, bool(result.success))


def _percentiles(values: np.ndarray, level: float) -> tuple[np.ndarray, np.ndarray]:
    tail = (1 - level) / 2 * 100
    return np.percentile(values, tail, axis=0), np.percentile(values, 100 - tail, axis=0)


def fit_ladder(
    runs: list[RunCurve],
    target: dict[str, Any],
    fractions: tuple[float, ...] | None = None,
    window: float | None = None,
    bootstrap: int = 400,
    seed: int = 0,
    level: float = 0.95,
    target_run: RunCurve | None = None,
    procedure: str = "shared",
    asymptote: float = MARIN_ASYMPTOTE,
) -> dict[str, Any]:
    """Fit the ladder and forecast the target: the ladder.json document (docs/ladder.md).

    procedure: "shared" (E and alpha shared by all fractions, fitted) or "marin" (E fixed at `asymptote`,
    A and alpha fitted separately at each fraction). fractions and window default to the procedure's.
    """
    if procedure not in PROCEDURES:
        raise LadderError(f"unknown procedure {procedure!r} ({' or '.join(PROCEDURES)})")
    marin = procedure == "marin"
    fractions = fractions or (MARIN_FRACTIONS if marin else DEFAULT_FRACTIONS)
    window = window if window is not None else (MARIN_WINDOW if marin else DEFAULT_WINDOW)
    if len(runs) < 3:
        raise LadderError(
            f"a ladder fit needs at least 3 runs, got {len(runs)}"
            + (f" ({', '.join(r.path for r in runs)})" if runs else "")
        )
    if not 0 < level < 1:
        raise LadderError(f"--level must be between 0 and 1, not {level}")
    bad = [f for f in fractions if not 0 < f <= 1]
    if bad or not fractions:
        raise LadderError(f"fractions must be in (0, 1], got {', '.join(map(str, fractions)) or 'none'}")
    fractions = tuple(sorted(set(fractions)))
    if marin:
        return _fit_marin(runs, target, fractions, window, bootstrap, seed, level, target_run, asymptote)
    points: list[Point] = []
    warnings: list[str] = []
    for run in runs:
        got, missing = matched_points(run, fractions, window)
        points += got
        warnings += missing
    used = [f for f in fractions if any(p.fraction == f for p in points)]
    params = 2 + len(used)
    if len({p.run for p in points}) < 3 or len(points) < params:
        raise LadderError(
            f"too few points to fit: {len(points)} from {len({p.run for p in points})} runs "
            f"for {params} parameters (E, alpha and one A per fraction); train the rungs further"
        )
    if used[-1] != fractions[-1]:
        warnings.append(
            f"no run reached {fractions[-1]:.0%} of its planned steps: the forecast stops at {used[-1]:.0%}"
        )
    index = {f: i for i, f in enumerate(used)}
    c = np.array([p.flops for p in points])
    y = np.array([p.loss for p in points])
    se = np.array([p.loss_se for p in points])
    g = np.array([index[p.fraction] for p in points])
    fit = fit_power_law(c, y, g, len(used))
    fitted = fit.predict(c, g)
    dof = len(points) - params
    # Noise for the parametric bootstrap: each point's own standard error, plus the scatter around the fit
    # beyond it (misfit) when there are spare degrees of freedom to measure it.
    excess = max(0.0, fit.rss / dof - float(np.mean(se**2))) if dof > 0 else 0.0
    sigma = np.sqrt(se**2 + excess)
    if dof == 0:
        warnings.append(
            "the fit is exactly determined (as many points as parameters): the band carries the noise of "
            "the smoothed losses only, not the misfit of the law"
        )

    target_flops = float(target["flops"])
    forecast_c = np.array([f * target_flops for f in used])
    forecast_g = np.arange(len(used))
    curve_c = np.geomspace(float(c.min()), max(target_flops, float(c.max())), CURVE_POINTS)
    final = len(used) - 1
    central = fit.predict(forecast_c, forecast_g)
    central_curve = fit.predict(curve_c, np.full(CURVE_POINTS, final))

    rng = np.random.default_rng(seed)
    samples, curves, params_b, failed = [], [], [], 0
    for _ in range(bootstrap):
        yb = fitted + sigma * rng.standard_normal(len(y))
        try:
            fb = fit_power_law(c, yb, g, len(used))
        except (ValueError, FloatingPointError):
            failed += 1
            continue
        predicted = fb.predict(forecast_c, forecast_g)
        if not np.all(np.isfinite(predicted)):
            failed += 1
            continue
        samples.append(predicted)
        curves.append(fb.predict(curve_c, np.full(CURVE_POINTS, final)))
        params_b.append((fb.E, fb.alpha, fb.coefficient(final)))
    if samples:
        low, high = _percentiles(np.array(samples), level)
        curve_low, curve_high = _percentiles(np.array(curves), level)
        p_low, p_high = _percentiles(np.array(params_b), level)
    else:
        low, high, curve_low, curve_high = central, central, central_curve, central_curve
        p_low = p_high = np.array([fit.E, fit.alpha, fit.coefficient(final)])

    result: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "procedure": "shared",
        "compute": "trainer",
        "law": "L(C) = E + A_f * C^-alpha; E and alpha shared, one A_f per fraction of training",
        "fractions": list(used),
        "window": window,
        "runs": [
            {
                "path": run.path,
                "name": run.name,
                "planned_steps": run.planned_steps,
                "last_step": int(run.steps[-1]),
                "final_flops": float(run.flops[-1]),
                **run.info,
            }
            for run in runs
        ],
        "points": [
            {
                "run": p.run,
                "fraction": p.fraction,
                "step": p.step,
                "flops": p.flops,
                "loss": p.loss,
                "loss_se": p.loss_se,
                "window": p.window,
                "fitted": float(fitted[i]),
            }
            for i, p in enumerate(points)
        ],
        "fit": {
            "E": fit.E,
            "alpha": fit.alpha,
            "A": {str(f): fit.coefficient(i) for f, i in index.items()},
            "E_band": [float(p_low[0]), float(p_high[0])],
            "alpha_band": [float(p_low[1]), float(p_high[1])],
            "A_final_band": [float(p_low[2]), float(p_high[2])],
            "rss": fit.rss,
            "points": len(points),
            "parameters": params,
            "dof": dof,
            "residual_sd": math.sqrt(fit.rss / dof) if dof > 0 else None,
            "converged": fit.converged,
        },
        "band": {
            "method": "parametric bootstrap: refit on fitted values plus Gaussian noise of each point's "
            "standard error and the excess residual variance; percentile interval",
            "level": level,
            "replicates": bootstrap,
            "failed": failed,
            "seed": seed,
            "noise_sd": [float(s) for s in sigma],
            "excess_sd": math.sqrt(excess),
        },
        "target": dict(target),
        "forecast": [
            {
                "fraction": f,
                "flops": float(forecast_c[i]),
                "loss": float(central[i]),
                "low": float(low[i]),
                "high": float(high[i]),
            }
            for i, f in enumerate(used)
        ],
        "curve": [
            {
                "flops": float(cc),
                "loss": float(central_curve[i]),
                "low": float(curve_low[i]),
                "high": float(curve_high[i]),
            }
            for i, cc in enumerate(curve_c)
        ],
        "warnings": warnings,
    }
    result["final"] = dict(result["forecast"][-1])
    if target_run is not None:
        actual, missing = matched_points(target_run, tuple(used), window)
        result["target"]["run"] = target_run.path
        result["actual"] = [
            {"fraction": p.fraction, "step": p.step, "flops": p.flops, "loss": p.loss, "loss_se": p.loss_se}
            for p in actual
        ]
        result["warnings"] += [f"target run: {message}" for message in missing]
        run_flops = float(target_run.flops[0]) / (int(target_run.steps[0]) + 1) * target_run.planned_steps
        if abs(run_flops / target_flops - 1) > 0.01:
            result["warnings"].append(
                f"target run {target_run.path} plans {run_flops:.3e} FLOPs, the target {target_flops:.3e}"
            )
    return result


# ---------------------------------------------------------------------------------------------------------
# Marin's procedure


def fit_fixed_asymptote(compute: np.ndarray, loss: np.ndarray, asymptote: float) -> tuple[float, float]:
    """A and alpha of L = E + A * C^-alpha for a given E: least squares of log(L - E) on log C."""
    slope, intercept = np.polyfit(np.log(compute), np.log(loss - asymptote), 1)
    return float(math.exp(intercept)), float(-slope)


def _fit_marin(
    runs: list[RunCurve],
    target: dict[str, Any],
    fractions: tuple[float, ...],
    window: float,
    bootstrap: int,
    seed: int,
    level: float,
    target_run: RunCurve | None,
    asymptote: float,
) -> dict[str, Any]:
    """Marin's forecast (plot_scaling_ladder.py): at every fraction f, L = E + A_f * C^-alpha_f through the
    rungs' points with E fixed, C Marin's forecast compute; the target's loss at f is the law at f x its C.

    The band is a parametric bootstrap like the shared procedure's: each fraction refitted on its fitted
    losses plus Gaussian noise of each point's standard error and the fraction's excess residual variance.
    """
    warnings: list[str] = []
    priced = all(run.forecast_per_step is not None for run in runs)
    convention = "forecast" if priced else "trainer"
    if not priced:
        unpriced = ", ".join(run.path for run in runs if run.forecast_per_step is None)
        warnings.append(
            f"no model to price Marin's compute in {unpriced}: the fit uses the trainer's FLOPs instead"
        )
    points: list[Point] = []
    for run in runs:
        got, missing = matched_points(run, fractions, window, convention)
        points += got
        warnings += missing
    low_points = [p for p in points if p.loss <= asymptote]
    for p in low_points:
        warnings.append(
            f"{p.run}: loss {p.loss:.4f} at {p.fraction:.0%} is not above the asymptote {asymptote:g}; "
            "that point is left out"
        )
    points = [p for p in points if p.loss > asymptote]
    by_fraction = {f: [p for p in points if p.fraction == f] for f in fractions}
    used = [f for f in fractions if len({p.run for p in by_fraction[f]}) >= 2]
    for f in fractions:
        if f not in used:
            warnings.append(f"fewer than 2 runs have a point at {f:.0%}: no law there")
    if not used:
        raise LadderError(
            "too few points to fit: no fraction has points from 2 runs; train the rungs further"
        )
    if used[-1] != fractions[-1]:
        warnings.append(f"the forecast stops at {used[-1]:.0%}: no law at {fractions[-1]:.0%}")

    if convention == "forecast" and target.get("forecast_compute") is not None:
        target_compute = float(target["forecast_compute"])
    else:
        target_compute = float(target["flops"])
    rng = np.random.default_rng(seed)
    laws: dict[float, tuple[float, float]] = {}
    samples: dict[float, list[tuple[float, float]]] = {}
    fitted_of: dict[Point, float] = {}
    noise: dict[Point, float] = {}
    rss_total, dof_total, failed = 0.0, 0, 0
    for f in used:
        group = by_fraction[f]
        c = np.array([p.flops for p in group])
        y = np.array([p.loss for p in group])
        se = np.array([p.loss_se for p in group])
        a, alpha = fit_fixed_asymptote(c, y, asymptote)
        laws[f] = (a, alpha)
        fitted = asymptote + a * c**-alpha
        rss = float(((y - fitted) ** 2).sum())
        dof = len(group) - 2
        rss_total += rss
        dof_total += dof
        excess = max(0.0, rss / dof - float(np.mean(se**2))) if dof > 0 else 0.0
        sigma = np.sqrt(se**2 + excess)
        for p, value, sd in zip(group, fitted, sigma, strict=True):
            fitted_of[p], noise[p] = float(value), float(sd)
        samples[f] = []
        for _ in range(bootstrap):
            yb = fitted + sigma * rng.standard_normal(len(y))
            if np.any(yb <= asymptote):
                failed += 1
                continue
            samples[f].append(fit_fixed_asymptote(c, yb, asymptote))

    def law(f: float, compute: np.ndarray | float, a: float | None = None, alpha: float | None = None):
        a_f, alpha_f = laws[f]
        return asymptote + (a_f if a is None else a) * np.asarray(compute) ** -(
            alpha_f if alpha is None else alpha
        )

    forecast = []
    for f in used:
        compute = f * target_compute
        replicas = np.array([law(f, compute, a, alpha) for a, alpha in samples[f]])
        low, high = _percentiles(replicas, level) if len(replicas) else (law(f, compute), law(f, compute))
        forecast.append(
            {
                "fraction": f,
                "flops": compute,
                "loss": float(law(f, compute)),
                "low": float(low),
                "high": float(high),
            }
        )
    final = used[-1]
    curve_c = np.geomspace(
        min(p.flops for p in points), max(target_compute, max(p.flops for p in points)), CURVE_POINTS
    )
    central_curve = law(final, curve_c)
    if samples[final]:
        curves = np.array([law(final, curve_c, a, alpha) for a, alpha in samples[final]])
        curve_low, curve_high = _percentiles(curves, level)
        params = np.array(samples[final])
        (a_low, alpha_low), (a_high, alpha_high) = _percentiles(params, level)
    else:
        curve_low = curve_high = central_curve
        a_low = a_high = laws[final][0]
        alpha_low = alpha_high = laws[final][1]
    if dof_total == 0:
        warnings.append(
            "every fraction's law is exactly determined (2 runs): the band carries the noise of the smoothed "
            "losses only, not the misfit of the law"
        )
    target_record = dict(target)
    target_record["trainer_flops"] = target.get("flops")
    target_record["flops"] = target_compute
    result: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "procedure": "marin",
        "compute": convention,
        "law": f"L(C) = {asymptote:g} + A_f * C^-alpha_f; asymptote fixed, A_f and alpha_f fitted separately "
        "at each fraction of training (log-log least squares)",
        "fractions": list(used),
        "window": window,
        "runs": [
            {
                "path": run.path,
                "name": run.name,
                "planned_steps": run.planned_steps,
                "last_step": int(run.steps[-1]),
                "final_flops": run.compute(int(run.steps[-1]), convention),
                **run.info,
            }
            for run in runs
        ],
        "points": [
            {
                "run": p.run,
                "fraction": p.fraction,
                "step": p.step,
                "flops": p.flops,
                "loss": p.loss,
                "loss_se": p.loss_se,
                "window": p.window,
                "fitted": fitted_of[p],
            }
            for p in points
            if p.fraction in laws
        ],
        "fit": {
            "E": asymptote,
            "E_fixed": True,
            "alpha": laws[final][1],
            "alphas": {str(f): laws[f][1] for f in used},
            "A": {str(f): laws[f][0] for f in used},
            "E_band": [asymptote, asymptote],
            "alpha_band": [float(alpha_low), float(alpha_high)],
            "A_final_band": [float(a_low), float(a_high)],
            "rss": rss_total,
            "points": sum(len(by_fraction[f]) for f in used),
            "parameters": 2 * len(used),
            "dof": dof_total,
            "residual_sd": math.sqrt(rss_total / dof_total) if dof_total > 0 else None,
            "converged": True,
        },
        "band": {
            "method": "parametric bootstrap per fraction: refit on fitted values plus Gaussian noise of each "
            "point's standard error and the fraction's excess residual variance; percentile interval",
            "level": level,
            "replicates": bootstrap * len(used),
            "failed": failed,
            "seed": seed,
            "noise_sd": [noise[p] for p in points if p in noise],
        },
        "target": target_record,
        "forecast": forecast,
        "curve": [
            {
                "flops": float(cc),
                "loss": float(central_curve[i]),
                "low": float(curve_low[i]),
                "high": float(curve_high[i]),
            }
            for i, cc in enumerate(curve_c)
        ],
        "warnings": warnings,
    }
    result["final"] = dict(forecast[-1])
    if target_run is not None:
        actual, missing = matched_points(target_run, tuple(used), window, convention)
        result["target"]["run"] = target_run.path
        result["actual"] = [
            {"fraction": p.fraction, "step": p.step, "flops": p.flops, "loss": p.loss, "loss_se": p.loss_se}
            for p in actual
        ]
        result["warnings"] += [f"target run: {message}" for message in missing]
    return result
