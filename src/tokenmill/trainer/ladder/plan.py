"""Planning a ladder: each rung's tokens (k x active parameters, rounded to whole mixture blocks, or with
`round_to: steps` to whole steps: Marin's round(k x active / tokens per step)), steps, compute (Marin's
forecast C and the trainer's FLOPs, flops.py), the optimizer settings Marin's heuristic gives it (Marin
family), and its mixture as a `slice_of` the big one, so that every source repeats as often as in the big
run (simulated epoching, docs/mixtures.md). A rung's batch may be given in racks of `sequences_per_rack`
sequences. The slices are built as mixture specs (objects), validated by the mixture planner, and written
as RUNG.yaml for `tokenmill train --data.mixture`.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import yaml

from tokenmill.mixtures.spec import MixtureSpec, mixture_from_spec
from tokenmill.trainer.ladder.spec import FORMAT_VERSION, Ladder, LadderError, racks_batch, read_model
from tokenmill.trainer.model.flops import count_params, flops_per_token, forecast_flops_per_token
from tokenmill.trainer.model.shape import ModelConfig
from tokenmill.trainer.run.heuristic import MAY_RECIPE, is_marin_family, warmup_steps_for
from tokenmill.units import format_count

# ---------------------------------------------------------------------------------------------------------
# The target


def target_of(ladder: Ladder) -> dict[str, Any]:
    """The target's model, tokens and compute. Tokens default to the mixture's run: total_steps x tokens per
    step when the mixture gives total_steps (the reference run: 390,251 steps, 18.005T tokens, of a mixture
    budgeted at 18.75T), else its total_tokens."""
    from tokenmill.mixtures import MixtureError, load_mixture

    spec = ladder.spec
    cfg = read_model(ladder.target_model)
    tokens = spec.target.tokens
    sequence_length = spec.target.sequence_length
    batch = racks_batch(spec, spec.target.racks)
    steps = None
    warnings = []
    try:
        mixture = load_mixture(ladder.mixture)
    except MixtureError as error:
        raise LadderError(f"{ladder.file}: mixture: {error}") from error
    sequence_length = sequence_length or mixture.sequence_length
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
    record = _target_record(cfg, ladder.target_model, tokens, sequence_length, batch or mixture.batch_size)
    record["steps"] = steps
    record["racks"] = spec.target.racks
    record["steps_by_rule"] = max(
        1,
        round(
            spec.tokens_per_active_param * record["active_params"] / (record["batch_size"] * sequence_length)
        ),
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
    cfg: ModelConfig, model_file: str, tokens: int, sequence_length: int, batch_size: int | None = None
) -> dict[str, Any]:
    params = count_params(cfg)
    per_token = flops_per_token(cfg, sequence_length)
    record = {
        "name": cfg.name,
        "model": model_file,
        "total_params": params.total_params,
        "active_params": params.active_params,
        "tokens": tokens,
        "sequence_length": sequence_length,
        "tokens_per_active_param": tokens / params.active_params,
        "flops_per_token": per_token,
        "flops": per_token * tokens,
        "forecast_compute": forecast_flops_per_token(cfg, sequence_length) * tokens,
    }
    if batch_size:
        record["batch_size"] = batch_size
        tokens_per_step = batch_size * sequence_length
        if tokens % tokens_per_step == 0:
            record["optimizer"] = _optimizer_record(cfg, tokens // tokens_per_step, tokens_per_step)
    return record


def target_from_model(model_file: str, tokens: int, sequence_length: int | None = None) -> dict[str, Any]:
    """The target record of `--target-model FILE --target-tokens N`."""
    cfg = read_model(model_file)
    return _target_record(cfg, model_file, tokens, sequence_length or cfg.sequence_length)


# ---------------------------------------------------------------------------------------------------------
# The rungs


def _slice_spec(
    name: str,
    description: str,
    parent: str,
    tokens: int,
    seq: int | None,
    batch: int | None,
    block: int | None,
    steps: int | None = None,
) -> MixtureSpec:
    """A rung's mixture: a slice of `parent` of `tokens` tokens, or of `steps` steps when given."""
    length = {"total_steps": steps} if steps is not None else {"total_tokens": tokens}
    return MixtureSpec(
        name=name,
        description=description,
        slice_of=parent,
        sequence_length=seq,
        batch_size=batch,
        block_size=block,
        **length,
    )


def _write_slice(path: str, spec: MixtureSpec) -> None:
    """RUNG.yaml: the slice spec, for `tokenmill train --data.mixture` and for people to read."""
    rounded = "whole steps" if spec.total_steps is not None else "whole mixture blocks"
    header = (
        "# Written by `tokenmill ladder plan`: a slice of the big mixture (simulated epoching), tokens from\n"
        f"# the ladder's tokens-per-active-parameter rule rounded to {rounded}.\n"
    )
    fields = spec.model_dump(exclude_none=True)
    Path(path).write_text(header + yaml.safe_dump(fields, sort_keys=False, width=110), encoding="utf-8")


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
    slice spec is written there as RUNG.yaml (train it with `tokenmill train --data.mixture`), and planned
    from
    that file; without, the slices are planned in memory.
    """
    from tokenmill.mixtures import MixtureError, load_mixture, plan_mixture

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
        cfg = read_model(model_file)
        params = count_params(cfg)
        requested = rung.tokens if rung.tokens is not None else round(k * params.active_params)
        seq = rung.sequence_length or spec.sequence_length
        batch = rung.batch_size or racks_batch(spec, rung.racks) or spec.batch_size
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
            probe = mixture_from_spec(
                _slice_spec(slice_name, description, ladder.mixture, max(1, requested), seq, batch, block)
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
            # Written next to the plan, a slice names its parent relative to its own file.
            spec_file = os.path.join(output, f"{rung.name}.yaml") if output else None
            parent = os.path.relpath(ladder.mixture, output) if output else ladder.mixture
            sliced_spec = _slice_spec(slice_name, description, parent, tokens, seq, batch, block, steps)
            sliced = mixture_from_spec(sliced_spec, spec_file)
            if spec_file:
                _write_slice(spec_file, sliced_spec)
            plan = plan_mixture(sliced, counts).to_json()
        except MixtureError as error:
            raise LadderError(f"{ladder.file}: rung {rung.name}: {error}") from error
        sequence_length = plan["sequence_length"]
        per_token = flops_per_token(cfg, sequence_length)
        # The slice plan's own warnings are about the mixture (weights that round away in a block), the
        # same for every rung: the full plan's are printed once, a rung keeps only what is its own.
        warnings = [w for w in plan["warnings"] if w not in full_plan["warnings"]]
        if sequence_length > cfg.sequence_length:
            warnings.append(
                f"sequence length {sequence_length} is longer than {cfg.name}'s sequence_length "
                f"{cfg.sequence_length}"
            )
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
            "sequence_length": sequence_length,
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
            "forecast_compute": forecast_flops_per_token(cfg, sequence_length) * plan["planned_tokens"],
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
