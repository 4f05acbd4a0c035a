"""The training loop: restore or start, then step, evaluate, record and checkpoint until the phase's target.

Steps are global: a run's phases (pretraining, then midtraining) count on from one another, the
learning-rate schedule is a function of the global step, and the data source gets the step within its
phase. `train()` takes the run resolved once (`config.ResolvedRun`); the step is built in step.py, the
restore in resume.py, metrics.jsonl in metrics.py.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np

from tokenmill.formats.events import excluded_steps
from tokenmill.formats.runs import (
    CONFIG,
    LOG,
    extend_history,
    history_entry,
    read_run_record,
    write_run_record,
)
from tokenmill.trainer.data.batch import Batch, BatchSource
from tokenmill.trainer.model.flops import (
    count_params,
    flops_per_token,
    known_peak_flops,
    measure_matmul_flops,
)
from tokenmill.trainer.model.sharding import AXES, batch_sharding, make_mesh, parse_mesh_shape
from tokenmill.trainer.run.checkpoint import Change, Checkpointer, run_identity
from tokenmill.trainer.run.config import ResolvedRun, RunConfig
from tokenmill.trainer.run.evaluate import EvalWriter, build_evaluator, due
from tokenmill.trainer.run.eventlog import EventLog
from tokenmill.trainer.run.guard import APPLIED, REASONS
from tokenmill.trainer.run.metrics import MetricsWriter
from tokenmill.trainer.run.resume import TrainingError, restore_or_start
from tokenmill.trainer.run.step import compile_train_step
from tokenmill.trainer.run.telemetry import StepTimer, Telemetry, capture_log, release_log
from tokenmill.trainer.run.watchdog import HANG_EXIT, REQUEUE_EXIT, Preempted, Preemption, Watchdog

log = logging.getLogger(__name__)


def train(
    run: ResolvedRun, source: BatchSource, stop_after: int | None = None, allow_data_change: bool = False
) -> list[dict]:
    """Train the run's phase (resuming from its checkpoints) and return the metrics rows logged.

    stop_after: stop after this many steps as if killed (no final checkpoint), for resume drills and tests.
    allow_data_change: resume even though the plan, seed, tokenizer, batch or model differ from the
    checkpoint's (otherwise a TrainingError names what changed); config.json's history records it.

    A step the guard skips (guard.py) is logged with `skipped` and recorded in events.jsonl; after
    guard.rollback_after skips in a row the last good checkpoint is restored and the steps since it are
    never trained (`_Rollback`). SIGTERM/SIGINT end the command with a checkpoint and `Preempted`; a step
    that does not complete in time ends the process (watchdog.py). Every such event goes to events.jsonl.
    """
    config, phase = run.config, run.phase
    if not config.output:
        raise ValueError("no output folder: give --output (or output: in the run configuration)")
    target = _target_step(run)
    run_dir = Path(config.output)
    run_dir.mkdir(parents=True, exist_ok=True)
    mesh = _mesh_of(config)
    with jax.set_mesh(mesh):
        init_fn, step_fn, shardings = compile_train_step(run, mesh)
        # Read before anything trains: a missing or mismatched evaluation set stops the run here.
        evaluator = build_evaluator(run, mesh)
        checkpoints = Checkpointer(
            run_dir / "checkpoints", config.checkpoint.keep, config.checkpoint.asynchronous
        )
        identity = run_identity(run, _mesh_sizes(mesh), jax.process_count())
        layout = _state_layout(init_fn, shardings, config.seed)
        state, start, meta, changes = _restore_or_start(run, init_fn, layout, checkpoints, identity,
                                                        allow_data_change)  # fmt: skip
        if start >= target:
            log.info("phase %s is already at step %d (target %d): nothing to do", phase.name, start, target)
            checkpoints.close()
            return []
        recorded = config.with_devices(_mesh_sizes(mesh), _peak_flops(config, mesh.size))
        outputs = _open_outputs(run, recorded, run_dir, start, identity, changes, checkpoints)
        evals = EvalWriter(run_dir, start, outputs.writer.wandb) if evaluator is not None else None
        progress = _Progress.resumed(run, meta, identity, mesh.size, recorded.logging.peak_flops)
        events = EventLog(run_dir, outputs.writer.wandb)
        # Steps never trained: the operator's, and every rollback's of this run (a resumed run skips them).
        excluded = set(config.guard.skip_steps) | excluded_steps(events.previous)
        events.add(
            "start", start,
            f"phase {phase.name} from step {start} to {target}"
            + (f", resumed from the checkpoint of step {meta['step']}" if "step" in meta else ", fresh"),
            phase=phase.name, resumed_from=meta.get("step"), previous=events.previous_end(),
        )  # fmt: skip
        if changes:
            events.add("change", start, "; ".join(map(str, changes)), changes=[str(c) for c in changes],
                       allowed=allow_data_change)  # fmt: skip
        log.info(
            "phase %s: steps %d to %d on %d %s devices%s",
            phase.name, start, target, mesh.size, jax.devices()[0].device_kind,
            f" (from the checkpoint of step {meta['step']})" if "step" in meta else "",
        )  # fmt: skip
        if outputs.publisher is not None:
            log.info(
                "publishing the run page to %s every %d steps",
                config.logging.publish,
                outputs.publisher.every,
            )
        rows: list[dict] = []
        done = start  # the step reached
        saves = _Saves(checkpoints, events, config.checkpoint.asynchronous)
        rollback = _Rollback(run, checkpoints, layout, events, saves)
        times = config.watchdog
        watchdog = Watchdog(
            run_dir / LOG if outputs.writer.enabled else None,
            on_hang=lambda seconds, first: (saves.poll(), events.add(
                "watchdog", done, f"no step completed within {seconds:.0f} s; stacks in {LOG}",
                seconds=seconds, first_step=first, exit_code=HANG_EXIT,
            )),
        )  # fmt: skip
        watchdog.arm(times.first_step_seconds, first=True)
        preemption = Preemption(
            times.preemption_seconds,
            on_abandon=lambda name: saves.poll() or events.add(
                "preemption", done, f"{name}: abandoned after {times.preemption_seconds:.0f} s; the latest "
                "complete checkpoint is where a rerun resumes", signal=name, exit_code=REQUEUE_EXIT,
            ),
        )  # fmt: skip
        evaluated = False
        try:
            with preemption:
                step = start
                while step < target:
                    if step in excluded:
                        last = step
                        while last + 1 < target and last + 1 in excluded:
                            last += 1
                        state = _at_step(state, last + 1)
                        events.add("excluded", step, f"steps {step}..{last} are not trained (a rollback's "
                                   "or guard.skip_steps)", skipped_from=step, skipped_to=last)  # fmt: skip
                        done = last + 1
                    else:
                        with outputs.timer.part("data"):
                            tokens, segment_ids = _global_batch(
                                source.batch(step - phase.start_step), mesh, run
                            )
                        with outputs.timer.part("compute"):
                            state, metrics = step_fn(state, tokens, segment_ids)
                            metrics = jax.device_get(metrics)
                        reason = int(metrics["skip_reason"])
                        if not config.guard.enabled:
                            _stop_on_a_bad_loss(metrics, step, run, checkpoints)
                        row = progress.row(step, metrics, outputs, first=step == start,
                                           last=step == target - 1)  # fmt: skip
                        outputs.writer.write(row)
                        rows.append(row)
                        done = step + 1
                        if reason != APPLIED:
                            events.add("skip", step, f"{REASONS[reason]}: loss {row['loss']:.4g}, gradient "
                                       f"norm {row['grad_norm']:.4g}", reason=REASONS[reason],
                                       loss=row["loss"], grad_norm=row["grad_norm"])  # fmt: skip
                            if rollback.due(int(metrics["consecutive_skips"])):
                                state, done = rollback.restore(step, int(metrics["consecutive_skips"]),
                                                               row["loss"], progress, excluded)  # fmt: skip
                        every = config.evaluation.every
                        if evaluator is not None and due(done, start, every, phase.end_step, target):
                            # After the step's row and before its checkpoint: a checkpoint's step has its
                            # records. The first evaluation compiles: it has the first step's time.
                            if not evaluated:
                                watchdog.arm(times.first_step_seconds, first=True)
                            began = time.perf_counter()
                            evals.write(
                                evaluator.evaluate(
                                    state["params"], state["router_bias"], done, phase.name,
                                    progress.tokens_seen,
                                )
                            )  # fmt: skip
                            evaluated = True
                            # The next row's throughput excludes it.
                            progress.last += time.perf_counter() - began
                    if stop_after is not None and done - start >= stop_after:
                        if done % config.checkpoint.every == 0:
                            saves.save(done, state, progress.record(done))
                        log.info("stopping after %d steps as asked (simulated interruption)", stop_after)
                        break
                    if done % config.checkpoint.every == 0 or done == target:
                        # Starting a save waits for the one before: a large state's write has the long time.
                        watchdog.arm(times.first_step_seconds)
                        with outputs.timer.part("checkpoint"):
                            saves.save(done, state, progress.record(done))
                    outputs.publish_if_due(done, target, saves.saved)
                    if rows and rows[-1]["step"] == done - 1 and (step == start or done % 10 == 0
                                                                  or done == target):  # fmt: skip
                        _log_step(rows[-1])
                    watchdog.arm(times.step_seconds)
                    saves.poll()
                    if _any_process(preemption.requested is not None):
                        _checkpoint_and_stop(preemption.requested or "a signal on another process", done,
                                             state, progress, saves, events)  # fmt: skip
                    step = done
        finally:
            failure = sys.exc_info()[1]
            # Closing waits for the checkpoint writes (the long time: a large state's write): a hang there
            # is a hang too.
            watchdog.arm(times.first_step_seconds)
            try:
                checkpoints.wait()
                saves.flush()
            except Exception:  # noqa: BLE001 (the failure being raised matters more)
                log.exception("waiting for the last checkpoint failed")
            if failure is None and done == target:
                events.add("finish", done, f"phase {phase.name} reached step {target}")
            elif failure is not None and not isinstance(failure, Preempted):
                events.add("stop", done, f"{type(failure).__name__}: {failure}", exit_code=1)
            if evals is not None:
                evals.close()
            outputs.close(checkpoints, done, target, saves.saved, failure=failure)
            watchdog.stop()
    return rows


def _state_layout(init_fn: Any, shardings: Any, seed: int) -> Any:
    """The train state's shapes and shardings, the layout a restore fills in (no state is built)."""
    return jax.tree.map(
        lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
        jax.eval_shape(init_fn, jax.random.key(seed)),
        shardings,
    )


def _at_step(state: dict, step: int) -> dict:
    """The state with its step counter at `step` (steps skipped without being computed)."""
    state = dict(state)
    state["step"] = jax.device_put(np.asarray(step, np.int32), state["step"].sharding)
    return state


def _any_process(flag: bool) -> bool:
    """Whether `flag` holds on any process: a signal that reached one host stops them all at the same step."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.max(multihost_utils.process_allgather(np.asarray([int(flag)], np.int32))))


@dataclass
class _Saves:
    """Checkpoint saves and their events: a save is recorded once it is complete on disk (an asynchronous
    one when the next save or the end waits for it), so a checkpoint cut short by a crash never is."""

    checkpoints: Checkpointer
    events: EventLog
    asynchronous: bool
    saved: int | None = None  # the latest checkpoint this command started
    pending: int | None = None  # started, not yet known complete

    def save(self, step: int, state: dict, record: dict) -> None:
        # Orbax waits for the save before this one anyway; waiting first records it before this one starts.
        self.checkpoints.wait()
        self.flush()
        self.checkpoints.save(step, state, record)
        self.saved = step
        if self.asynchronous:
            self.pending = step
        else:
            self._record(step)

    def poll(self) -> None:
        """Record the pending save if it has completed meanwhile (never waits)."""
        if self.pending is not None and not self.checkpoints.saving():
            self.flush()

    def flush(self) -> None:
        """Record the pending save: call after something waited for it."""
        if self.pending is not None:
            self._record(self.pending)
            self.pending = None

    def _record(self, step: int) -> None:
        self.events.add("checkpoint", step, f"checkpoint {step} complete", checkpoint=step)


@dataclass
class _Rollback:
    """After guard.rollback_after skipped steps in a row: restore the latest checkpoint at or before the
    first of them and never train the steps from it to the last skipped one (the data since the checkpoint
    is suspected, and training it again from the same state would give the same skips); at most
    guard.max_rollbacks times in a command, then a TrainingError stops the run."""

    run: ResolvedRun
    checkpoints: Checkpointer
    layout: Any
    events: EventLog
    saves: _Saves
    count: int = 0

    def due(self, consecutive: int) -> bool:
        after = self.run.config.guard.rollback_after
        return after > 0 and consecutive >= after

    def restore(self, step: int, consecutive: int, loss: float, progress: _Progress,
                excluded: set[int]) -> tuple[dict, int]:  # fmt: skip
        """(the restored state, its step counter at step + 1, and the step to go on from)."""
        phase, guard_config = self.run.phase, self.run.config.guard
        self.checkpoints.wait()
        self.saves.flush()
        first = step - consecutive + 1
        good = [s for s in self.checkpoints.all_steps() if phase.start_step <= s <= first]
        where = f"{self.checkpoints.path(max(good))} (step {max(good)})" if good else "none"
        if not good or self.count >= guard_config.max_rollbacks:
            why = "no checkpoint of this phase to roll back to" if not good else (
                f"{self.count} rollbacks already")  # fmt: skip
            raise TrainingError(
                f"loss is {loss} at step {step} (phase {phase.name}): {consecutive} steps skipped in a row "
                f"and {why}; stopped. Last good checkpoint: {where}"
            )
        self.count += 1
        back = max(good)
        state, meta = self.checkpoints.restore(back, self.layout)
        # The checkpoints after it hold the trajectory given up: a rerun must not resume from them.
        for later in self.checkpoints.all_steps():
            if later > back:
                self.checkpoints.delete(later)
        if self.saves.saved is not None and self.saves.saved > back:
            self.saves.saved = back
        excluded.update(range(back, step + 1))
        progress.tokens_seen = int(meta.get("tokens", progress.tokens_seen))
        progress.flops_done = float(meta.get("flops", progress.flops_done))
        self.events.add(
            "rollback", step,
            f"{consecutive} steps skipped in a row: restored checkpoint {back}; steps {back}..{step} are "
            "never trained", consecutive=consecutive, checkpoint=back, skipped_from=back, skipped_to=step,
        )  # fmt: skip
        return _at_step(state, step + 1), step + 1


def _checkpoint_and_stop(
    name: str, done: int, state: dict, progress: _Progress, saves: _Saves, events: EventLog
) -> None:
    """After a preemption signal: the state after `done` steps saved and complete, then Preempted."""
    if saves.saved != done:
        saves.save(done, state, progress.record(done))
    saves.checkpoints.wait()
    saves.flush()
    events.add("preemption", done, f"{name}: checkpoint {done} written; exit {REQUEUE_EXIT} to be requeued",
               signal=name, checkpoint=done, exit_code=REQUEUE_EXIT)  # fmt: skip
    raise Preempted(f"{name}: checkpointed at step {done}")


def _target_step(run: ResolvedRun) -> int:
    """The global step this command trains up to: the phase's start + schedule.steps."""
    phase = run.phase
    target = phase.start_step + run.config.schedule.steps
    if target > phase.end_step:
        log.warning(
            "training %d steps, past the %d the plan gives phase %s", target - phase.start_step, phase.steps,
            phase.name,
        )  # fmt: skip
    return target


def _mesh_of(config: RunConfig) -> jax.sharding.Mesh:
    mesh = make_mesh(parse_mesh_shape(config.mesh.text, jax.device_count()))
    if config.data.batch_size % mesh.size:
        raise ValueError(
            f"batch size {config.data.batch_size} is not divisible by the {mesh.size} devices of the mesh"
        )
    return mesh


def _mesh_sizes(mesh: jax.sharding.Mesh) -> dict[str, int]:
    return {axis: mesh.shape[axis] for axis in AXES}


def _restore_or_start(
    run: ResolvedRun,
    init_fn: Any,
    layout: Any,
    checkpoints: Checkpointer,
    identity: dict,
    allow_data_change: bool,
) -> tuple[dict, int, dict, list[Change]]:
    """resume.restore_or_start with the state's layout (shapes and shardings) as what a restore fills in,
    without building a fresh state first."""
    seed = run.config.seed
    fresh = lambda: init_fn(jax.random.key(seed))  # noqa: E731
    return restore_or_start(fresh, layout, checkpoints, run, identity, allow_data_change)


def _peak_flops(config: RunConfig, mesh_devices: int) -> float:
    if config.logging.peak_flops:
        return config.logging.peak_flops
    device = jax.devices()[0]
    known = known_peak_flops(device.device_kind)
    if known:
        return known * mesh_devices
    # CPU: simulated devices share the same cores, so one measured matmul peak covers the whole mesh.
    dtype = "bfloat16" if config.compute_dtype == "bfloat16" else "float32"
    return measure_matmul_flops(512, dtype, seconds=0.5)


def _write_config_record(
    run: ResolvedRun, recorded: RunConfig, run_dir: Path, start: int, identity: dict, changes: list[Change]
) -> dict:
    """runs/NAME/config.json (process 0): the configuration in force, then the records after it. Returns
    the record without its history, what Weights & Biases gets."""
    model_cfg, plan = run.model, run.plan
    settings = recorded.model_dump(mode="json")
    sequence = recorded.data.sequence_length
    config_record = {
        # The resolved configuration first: `tokenmill train --config runs/NAME/config.json` reads it back
        # and skips the records after it.
        **settings,
        "params": count_params(model_cfg).as_dict(),
        "flops_per_token": flops_per_token(model_cfg, sequence),
        "processes": jax.process_count(),
        "plan": plan.to_json() if plan is not None else None,
    }
    if jax.process_index() == 0:
        # One file per run: each phase's settings are kept under "phases", the latest also at the top,
        # and every configuration the run has trained with under "history", with the step it began at.
        config_path = str(run_dir / CONFIG)
        previous = read_run_record(config_path) if os.path.exists(config_path) else None
        this_phase = {key: value for key, value in settings.items() if key != "model"}
        earlier_phases = (previous.phases if previous else None) or {}
        config_record["phases"] = {**earlier_phases, run.phase.name: this_phase}
        entry = history_entry(start, run.phase.name, settings, config_record["plan"], identity, changes)
        config_record["history"] = extend_history(previous, entry)
        write_run_record(config_path, config_record)
    # W&B gets the configuration in force; the history of earlier ones stays in config.json.
    return {key: value for key, value in config_record.items() if key != "history"}


@dataclass
class _Outputs:
    """What a run writes besides checkpoints: metrics.jsonl, the live page, train.log, and the timings."""

    writer: MetricsWriter
    publisher: Any  # publish.LivePublisher, or None
    log_capture: Any
    telemetry: Telemetry = field(default_factory=lambda: Telemetry(jax.local_devices()))
    timer: StepTimer = field(default_factory=StepTimer)

    def publish_if_due(self, done: int, target: int, saved: int | None) -> None:
        if self.publisher is not None and done < target and self.publisher.due(done, saved == done):
            # A hand-over: the page is built and written in the background.
            with self.timer.part("publish"):
                self.publisher.submit(done, self.writer.size, target_step=target, checkpoint_step=saved)

    def close(
        self,
        checkpoints: Checkpointer,
        done: int,
        target: int,
        saved: int | None,
        failure: BaseException | None,
    ) -> None:
        checkpoints.close()
        metrics_bytes = self.writer.size
        self.writer.close()
        self.telemetry.close()
        if self.publisher is not None:
            # The final version, also when training stopped on an error: a follower sees why.
            self.publisher.close(
                done,
                metrics_bytes,
                state="finished" if failure is None and done == target else "stopped",
                target_step=target,
                checkpoint_step=saved,
                message=f"{type(failure).__name__}: {failure}" if failure is not None else "",
            )
        if self.log_capture is not None:
            release_log(self.log_capture)


def _open_outputs(
    run: ResolvedRun,
    recorded: RunConfig,
    run_dir: Path,
    start: int,
    identity: dict,
    changes: list[Change],
    checkpoints: Checkpointer,
) -> _Outputs:
    settings_record = _write_config_record(run, recorded, run_dir, start, identity, changes)
    writer = MetricsWriter(run_dir, start, recorded.logging.wandb_project, settings_record)
    try:
        publisher = _live_publisher(recorded, run_dir) if writer.enabled else None
    except ValueError:
        checkpoints.close()
        writer.close()
        raise
    # runs/NAME/train.log, for the run page's tail (process 0, like metrics.jsonl).
    log_capture = capture_log(run_dir) if writer.enabled else None
    return _Outputs(writer, publisher, log_capture)


def _live_publisher(config: RunConfig, run_dir: Path):
    """The background publisher of the run page when the run asks for one (logging.publish)."""
    if not config.logging.publish:
        return None
    from tokenmill.trainer.run.publish import LivePublisher, PublishError

    try:
        publisher = LivePublisher(
            run_dir,
            config.logging.publish,
            every=config.logging.publish_every,
            ladder=config.logging.publish_ladder,
            refresh_seconds=config.logging.publish_refresh,
        )
    except PublishError as error:
        raise ValueError(str(error)) from error
    return publisher


@dataclass
class _Progress:
    """Tokens and FLOPs actually trained so far in this run (a phase cut short leaves a gap in steps), and
    what each step adds: the counts of a metrics row and of a checkpoint's record."""

    run: ResolvedRun
    identity: dict
    devices: int
    tokens_seen: int
    flops_done: float
    tokens_per_step: int
    step_flops: float
    peak: float
    t0: float = field(default_factory=time.perf_counter)
    last: float = 0.0

    @classmethod
    def resumed(cls, run: ResolvedRun, meta: dict, identity: dict, devices: int, peak: float) -> _Progress:
        data = run.config.data
        tokens_per_step = data.batch_size * data.sequence_length
        step_flops = flops_per_token(run.model, data.sequence_length) * tokens_per_step
        progress = cls(run, identity, devices, int(meta.get("tokens", 0)), float(meta.get("flops", 0.0)),
                       tokens_per_step, step_flops, peak)  # fmt: skip
        progress.last = progress.t0
        return progress

    def record(self, done: int) -> dict:
        """A checkpoint's record at step `done`."""
        return {"phase": self.run.phase.name, "step": done, "tokens": self.tokens_seen,
                "flops": self.flops_done, **self.identity}  # fmt: skip

    def row(self, step: int, metrics: dict, outputs: _Outputs, first: bool, last: bool) -> dict:
        """The metrics.jsonl row of a step just taken (docs/formats.md, "Runs")."""
        now = time.perf_counter()
        elapsed, self.last = now - self.last, now
        reason = int(metrics.get("skip_reason", APPLIED))
        if reason == APPLIED:  # a skipped step's tokens were not trained on
            self.tokens_seen += self.tokens_per_step
            self.flops_done += self.step_flops
        row = {
            "step": step,
            "phase": self.run.phase.name,
            "loss": float(metrics["loss"]),
            "lr": float(metrics["lr"]),
            "tokens": self.tokens_seen,
            "tokens_per_second": self.tokens_per_step / elapsed,
            "flops": self.flops_done,
            "mfu": self.step_flops / elapsed / self.peak,
            "grad_norm": float(metrics["grad_norm"]),
            "param_norm": float(metrics["param_norm"]),
            "router_bias_norm": [float(x) for x in metrics["router_bias_norm"]],
            "expert_imbalance": [round(float(x), 4) for x in metrics["expert_imbalance"]],
            "drop_fraction": float(metrics["drop_fraction"]),
            "time": now - self.t0,
            "objective": float(metrics["objective"]),
            "balance_loss": float(metrics["balance_loss"]),
            "router_z_loss": float(metrics["router_z_loss"]),
            # Telemetry (docs/formats.md, "Runs"): keys a backend cannot read are left out.
            "timestamp": time.time(),
            "devices": self.devices,
            "tokens_per_second_per_device": self.tokens_per_step / elapsed / self.devices,
            **outputs.timer.take(elapsed),
            **outputs.telemetry.sample(),
        }
        if reason != APPLIED:
            row["skipped"] = REASONS[reason]
        health_every = self.run.config.logging.health_every
        if "health" in metrics and health_every and step % health_every == 0:
            row.update(_health_row(metrics["health"]))
        # The whole [layers, experts] load is 18k numbers a row for the 535B: written at the first and last
        # step of each run of this command and every expert_load_every steps.
        every = self.run.config.logging.expert_load_every
        if first or last or (step - self.run.phase.start_step) % every == 0:
            row["expert_load"] = [[round(float(x), 6) for x in layer] for layer in metrics["expert_load"]]
        return row


def _health_row(sampled: dict) -> dict:
    """health.py's sampled metrics as metrics.jsonl keys: lists per layer, numbers per other group."""

    def plain(value: Any) -> Any:
        value = np.asarray(value)
        return [round(float(x), 6) for x in value] if value.ndim else round(float(value), 6)

    return {
        "param_norms": {group: plain(value) for group, value in sampled["param_norms"].items()},
        "update_norms": {group: plain(value) for group, value in sampled["update_norms"].items()},
        "router_bias_change": plain(sampled["router_bias_change"]),
        "router_z_loss_layers": plain(sampled["router_z_loss_layers"]),
    }


def _stop_on_a_bad_loss(metrics: dict, step: int, run: ResolvedRun, checkpoints: Checkpointer) -> None:
    loss = float(metrics["loss"])
    if not math.isfinite(loss):
        checkpoints.wait()
        good = checkpoints.latest_step()
        where = f"{checkpoints.path(good)} (step {good})" if good is not None else "none"
        raise TrainingError(
            f"loss is {loss} at step {step} (phase {run.phase.name}); stopped without saving. "
            f"Last good checkpoint: {where}"
        )


def _log_step(row: dict) -> None:
    log.info(
        "step %d loss %.4f lr %.2e grad %.3f drop %.3f %.0f tok/s",
        row["step"], row["loss"], row["lr"], row["grad_norm"], row["drop_fraction"], row["tokens_per_second"],
    )  # fmt: skip


def _global_batch(batch: Batch, mesh: jax.sharding.Mesh, run: ResolvedRun) -> tuple[jax.Array, jax.Array]:
    """Check this process's rows and assemble the global arrays sharded across the mesh."""
    data, vocab_size = run.config.data, run.model.vocab_size
    rows = data.batch_size // jax.process_count()
    expected = (rows, data.sequence_length + 1)
    if batch.tokens.shape != expected:
        raise ValueError(f"the data source gave a batch of shape {batch.tokens.shape}, expected {expected}")
    top = int(batch.tokens.max())
    if top >= vocab_size or int(batch.tokens.min()) < 0:
        raise ValueError(f"token id {top} is outside the model's vocabulary of {vocab_size}")
    sharding = batch_sharding(mesh)
    tokens = jax.make_array_from_process_local_data(sharding, batch.tokens.astype(np.int32))
    segments = jax.make_array_from_process_local_data(sharding, batch.segment_ids.astype(np.int32))
    return tokens, segments
