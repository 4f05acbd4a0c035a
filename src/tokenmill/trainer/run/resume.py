"""Where a phase starts: resumed from this run's latest checkpoint, continued from an earlier phase's (or
another run's, --checkpoint.init_from), or fresh; a checkpoint of other data or another model is refused
unless
--allow-data-change, and the change is recorded (docs/trainer.md, "Resuming").
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from tokenmill.errors import FormatError
from tokenmill.formats.plan import MixturePlan
from tokenmill.formats.runs import CONFIG, read_run_record
from tokenmill.trainer.run.checkpoint import Change, Checkpointer, identity_changes, plan_sha256_of
from tokenmill.trainer.run.config import Phase, ResolvedRun

log = logging.getLogger(__name__)


class TrainingError(Exception):
    """Training cannot go on (a NaN loss, a checkpoint from the wrong phase); the message says what to do."""


def restore_or_start(
    fresh: Callable[[], dict],
    layout: Any,
    checkpoints: Checkpointer,
    run: ResolvedRun,
    identity: dict | None = None,
    allow_data_change: bool = False,
) -> tuple[dict, int, dict, list[Change]]:
    """Resume this phase, continue from an earlier phase's checkpoint, or start fresh.

    Before a checkpoint of this run is restored, its record is compared with `identity` (run_identity):
    a different plan, seed, tokenizer, batch or model is refused with a TrainingError naming each change,
    unless allow_data_change; a different mesh or process count is logged. A checkpoint of another run
    (--checkpoint.init_from) is checked for the model only.

    Returns (state, global step to start at, the checkpoint's meta record or {}, the changes resumed
    across)."""
    phase, plan = run.phase, run.plan
    names = [p.name for p in run.phases]
    phase_index = names.index(phase.name)
    latest = checkpoints.latest_step()
    if latest is not None:
        meta = checkpoints.read_meta(latest)
        changes = _check_identity(
            checkpoints, latest, meta, identity, allow_data_change, plan, other_run=False
        )
        restored, meta = checkpoints.restore(latest, layout)
        ckpt_phase = meta.get("phase", phase.name)
        if ckpt_phase == phase.name:
            log.info("resuming phase %s from step %d", phase.name, latest)
            return restored, latest, meta, changes
        if ckpt_phase in names and names.index(ckpt_phase) < phase_index:
            return _continue(restored, ckpt_phase, latest, phase), phase.start_step, meta, changes
        raise TrainingError(
            f"the latest checkpoint in {checkpoints.directory} is from phase {ckpt_phase!r}, which does not "
            f"come before phase {phase.name!r}; use a new --output"
        )
    init_from = run.config.checkpoint.init_from
    if init_from:
        source = Checkpointer(Path(init_from) / "checkpoints", read_only=True)
        step = source.latest_step()
        if step is None:
            raise TrainingError(f"--checkpoint.init_from {init_from}: no checkpoint in {source.directory}")
        changes = _check_identity(
            source, step, source.read_meta(step), identity, allow_data_change, plan, other_run=True
        )
        restored, meta = source.restore(step, layout)
        source.close()
        state = _continue(restored, meta.get("phase", "?"), step, phase)
        return state, phase.start_step, meta, changes
    if phase.start_step > 0:
        raise TrainingError(
            f"phase {phase.name!r} starts at step {phase.start_step} and continues from the previous phase: "
            f"train it into the same --output as that phase, or pass --checkpoint.init_from RUN_DIR"
        )
    return fresh(), 0, {}, []


def _check_identity(
    checkpoints: Checkpointer,
    step: int,
    meta: dict,
    identity: dict | None,
    allow_data_change: bool,
    plan: MixturePlan | None,
    other_run: bool,
) -> list[Change]:
    """The changes between a checkpoint's record and this run (see `restore_or_start`); raises
    TrainingError for a refused one."""
    if identity is None:
        return []
    where = checkpoints.path(step)
    if "seed" not in meta:
        log.warning("%s was saved before checkpoints recorded their plan, seed and model: not checked", where)
        return []
    saved_plan = _recorded_plan(checkpoints.directory.parent, meta.get("plan_sha256"))
    current_plan = plan.to_json() if plan is not None else None
    refused, allowed = identity_changes(meta, identity, saved_plan, current_plan)
    if other_run:
        # Another run's checkpoint: its data and seed are its own; only the model must be this one.
        allowed += [change for change in refused if change.what != "model"]
        refused = [change for change in refused if change.what == "model"]
    for change in allowed:
        log.info("resuming %s across a change that leaves the data and model as they were: %s", where, change)
    if refused and not allow_data_change:
        raise TrainingError(
            f"{where} was trained with a different configuration: {'; '.join(map(str, refused))}. "
            f"Resuming would train the steps after {step} on other data or another model than the steps "
            "before. Use a new --output, restore the earlier settings, or pass --allow-data-change to "
            "continue and record the change in config.json's history"
        )
    for change in refused:
        log.warning("resuming %s across a change (--allow-data-change): %s", where, change)
    return refused + allowed


def _recorded_plan(run_dir: Path, sha256: str | None) -> dict | None:
    """The plan of that hash among those the run's config.json records (to name what changed in it)."""
    path = run_dir / CONFIG
    if sha256 is None or not path.exists():
        return None
    try:
        record = read_run_record(str(path))
    except (OSError, FormatError):
        return None
    candidates = [entry.plan for entry in reversed(record.history or [])] + [record.plan]
    return next((p for p in candidates if p is not None and plan_sha256_of(p) == sha256), None)


def _continue(state: dict, from_phase: str, from_step: int, phase: Phase) -> dict:
    if from_step != phase.start_step:
        log.warning(
            "phase %s starts at step %d but the %s checkpoint is at step %d; continuing from it at step %d",
            phase.name,
            phase.start_step,
            from_phase,
            from_step,
            phase.start_step,
        )
    log.info("phase %s continues from %s's checkpoint at step %d", phase.name, from_phase, from_step)
    state = dict(state)
    state["step"] = jax.device_put(jnp.asarray(phase.start_step, jnp.int32), state["step"].sharding)
    return state
