"""The training loop: build the state on the mesh, restore or start it, step, log, checkpoint, stop.

A train step is value_and_grad of the loss, the optimizer update, and apply; then, outside the optimizer,
the router-bias balancing update. Everything a step needs is in one state pytree
{step, params, opt_state, router_bias}, so that a checkpoint restores exactly the run it came from.

Steps are global: a run's phases (pretraining, then midtraining) count on from one another, the
learning-rate schedule is a function of the global step, and the data source gets the step within its phase.
Everything about a run but the data source comes in one `RunConfig` (run_config.py); the loop resolves it
(plan, recipe, mesh, peak FLOP/s) and writes the resolved configuration to runs/NAME/config.json.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from tokenmill.errors import FormatError
from tokenmill.formats.plan import MixturePlan
from tokenmill.formats.runs import (
    CONFIG,
    METRICS,
    metrics_line,
    parse_metrics_line,
    read_run_record,
    write_run_record,
)
from tokenmill.trainer import model
from tokenmill.trainer.checkpoint import Checkpointer
from tokenmill.trainer.config import ModelConfig
from tokenmill.trainer.data import Batch, BatchSource
from tokenmill.trainer.flops import count_params, flops_per_token, known_peak_flops, measure_matmul_flops
from tokenmill.trainer.moe import update_router_bias
from tokenmill.trainer.optim import Schedule, make_optimizer
from tokenmill.trainer.run_config import RunConfig, resolve_run_config
from tokenmill.trainer.sharding import (
    AXES,
    batch_sharding,
    make_mesh,
    param_shardings,
    parse_mesh_shape,
    state_shardings,
)

log = logging.getLogger(__name__)


class TrainingError(Exception):
    """Training cannot go on (a NaN loss, a checkpoint from the wrong phase); the message says what to do."""


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


def make_schedule(run: RunConfig, phases: list[Phase]) -> Schedule:
    """The learning rate over the run's global steps, from the configuration resolved against the phases."""
    run = resolve_run_config(run, phases)
    schedule = run.schedule
    return Schedule(
        schedule.kind,
        run.optimizer.lr,
        schedule.total_steps,
        schedule.warmup_steps,
        schedule.decay_steps,
        schedule.min_lr_ratio,
    )


def make_train_step(model_cfg: ModelConfig, tx: optax.GradientTransformation, schedule: Schedule, dtype: Any):
    """The step function (to be jitted): (state, tokens, segment_ids) -> (state, metrics)."""
    m = model_cfg.moe

    def train_step(state: dict, tokens: jax.Array, segment_ids: jax.Array) -> tuple[dict, dict]:
        def objective(params: dict) -> tuple[jax.Array, Any]:
            return model.loss_fn(params, state["router_bias"], tokens, segment_ids, model_cfg, dtype)

        (total_loss, (loss, stats)), grads = jax.value_and_grad(objective, has_aux=True)(state["params"])
        lr = schedule(state["step"])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"], learning_rate=lr)
        params = optax.apply_updates(state["params"], updates)
        router_bias = update_router_bias(state["router_bias"], stats.load, stats.quantile_bias, m)
        new_state = {
            "step": state["step"] + 1,
            "params": params,
            "opt_state": opt_state,
            "router_bias": router_bias,
        }

        assignments = tokens.shape[0] * (tokens.shape[1] - 1) * m.top_k
        metrics = {
            "loss": loss,
            "objective": total_loss,
            "lr": lr,
            "grad_norm": optax.tree.norm(grads),
            # Learned parameters only: the router bias is reported on its own (a spike in the norm of
            # everything once turned out to be the bias alone).
            "param_norm": optax.tree.norm(params),
            "router_bias_norm": jnp.linalg.norm(router_bias, axis=-1),
            "expert_load": stats.load / assignments,
            "drop_fraction": stats.dropped.sum() / (assignments * model_cfg.n_layers),
            "balance_loss": stats.balance_loss.mean(),
            "router_z_loss": stats.z_loss.mean(),
        }
        return new_state, metrics

    return train_step


class MetricsWriter:
    """metrics.jsonl (and Weights & Biases when configured), written by process 0 only."""

    def __init__(self, run_dir: Path, resume_step: int, wandb_project: str | None, config: dict):
        self.enabled = jax.process_index() == 0
        self.path = run_dir / METRICS
        self.wandb = None
        if not self.enabled:
            return
        if self.path.exists():
            # Steps logged after the checkpoint we resume from are about to be trained again; drop them so
            # that every step appears once.
            kept = [
                line for line in self.path.read_text().splitlines() if line and _step_of(line) < resume_step
            ]
            self.path.write_text("".join(line + "\n" for line in kept))
        self.file = self.path.open("a")
        project = wandb_project or os.environ.get("WANDB_PROJECT")
        if project:
            try:
                import wandb
            except ImportError:
                log.warning("Weights & Biases logging asked for, but wandb is not installed; skipping it")
            else:
                # WANDB_MODE=offline is honoured by wandb itself; `wandb sync` uploads later.
                self.wandb = wandb.init(project=project, name=run_dir.name, config=config, resume="allow")

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        self.file.write(metrics_line(row))
        self.file.flush()
        if self.wandb is not None:
            flat = {k: v for k, v in row.items() if isinstance(v, int | float) and v is not None}
            for layer, norm in enumerate(row["router_bias_norm"]):
                flat[f"router_bias_norm/layer{layer}"] = norm
            for layer, load in enumerate(row["expert_load"]):
                flat[f"expert_load_max/layer{layer}"] = max(load)
            self.wandb.log(flat, step=row["step"])

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            if self.wandb is not None:
                self.wandb.finish()


def _step_of(line: str) -> int:
    """The step of a metrics.jsonl line; -1 for a line that is not a metrics row (a write cut short)."""
    try:
        return parse_metrics_line(line, METRICS).step
    except FormatError:
        return -1


def _peak_flops(run: RunConfig, mesh_devices: int) -> float:
    if run.logging.peak_flops:
        return run.logging.peak_flops
    device = jax.devices()[0]
    known = known_peak_flops(device.device_kind)
    if known:
        return known * mesh_devices
    # CPU: simulated devices share the same cores, so one measured matmul peak covers the whole mesh.
    dtype = "bfloat16" if run.compute_dtype == "bfloat16" else "float32"
    return measure_matmul_flops(512, dtype, seconds=0.5)


def train(
    run: RunConfig,
    source: BatchSource,
    phases: list[Phase],
    plan: MixturePlan | None = None,
    stop_after: int | None = None,
) -> list[dict]:
    """Train the run's phase (resuming from its checkpoints) and return the metrics rows logged.

    stop_after: stop after this many steps as if killed (no final checkpoint), for resume drills and tests.
    """
    run = resolve_run_config(run, phases, plan)
    if not run.output:
        raise ValueError("no output folder: give --output (or output: in the run configuration)")
    model_cfg = run.model_shape
    phase = next(p for p in phases if p.name == run.data.phase)
    phase_index = phases.index(phase)
    target = phase.start_step + run.schedule.steps
    if target > phase.end_step:
        log.warning(
            "training %d steps, past the %d the plan gives phase %s",
            target - phase.start_step,
            phase.steps,
            phase.name,
        )
    batch_size, seq_len = run.data.batch_size, run.data.seq_len
    run_dir = Path(run.output)
    run_dir.mkdir(parents=True, exist_ok=True)

    n_devices = jax.device_count()
    mesh = make_mesh(parse_mesh_shape(run.mesh.text, n_devices))
    if batch_size % mesh.size:
        raise ValueError(f"batch size {batch_size} is not divisible by the {mesh.size} devices of the mesh")
    run = run.model_copy(
        update={"mesh": run.mesh.model_copy(update={axis: mesh.shape[axis] for axis in AXES})}
    )
    schedule = make_schedule(run, phases)

    with jax.set_mesh(mesh):
        init_fn, step_fn, shardings = compile_train_step(run, schedule, mesh)
        # The state's shapes and shardings: what a restore fills in, without building a fresh state first.
        layout = jax.tree.map(
            lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
            jax.eval_shape(init_fn, jax.random.key(run.seed)),
            shardings,
        )

        checkpoint = run.checkpoint
        checkpoints = Checkpointer(run_dir / "checkpoints", checkpoint.keep, checkpoint.asynchronous)
        state, start, meta = _restore_or_start(
            lambda: init_fn(jax.random.key(run.seed)), layout, checkpoints, run, phases, phase, phase_index
        )
        # Tokens and FLOPs actually trained so far in this run (a phase cut short leaves a gap in steps).
        tokens_seen, flops_done = int(meta.get("tokens", 0)), float(meta.get("flops", 0.0))
        if start >= target:
            log.info("phase %s is already at step %d (target %d): nothing to do", phase.name, start, target)
            checkpoints.close()
            return []

        tokens_per_step = batch_size * seq_len
        step_flops = flops_per_token(model_cfg, seq_len) * tokens_per_step
        peak = _peak_flops(run, mesh.size)
        run = run.model_copy(update={"logging": run.logging.model_copy(update={"peak_flops": peak})})
        settings = run.model_dump(mode="json")
        config_record = {
            # The resolved configuration first: `tokenmill train --config runs/NAME/config.json` reads it back
            # and skips the records after it.
            **settings,
            "params": count_params(model_cfg).as_dict(),
            "flops_per_token": flops_per_token(model_cfg, seq_len),
            "processes": jax.process_count(),
            "plan": plan.to_json() if plan is not None else None,
        }
        if jax.process_index() == 0:
            # One file per run: each phase's settings are kept under "phases", the latest also at the top.
            config_path = str(run_dir / CONFIG)
            previous = read_run_record(config_path).phases if os.path.exists(config_path) else None
            this_phase = {key: value for key, value in settings.items() if key != "model"}
            config_record["phases"] = {**(previous or {}), phase.name: this_phase}
            write_run_record(config_path, config_record)
        writer = MetricsWriter(run_dir, start, run.logging.wandb_project, config_record)

        def record(done: int) -> dict:
            return {"phase": phase.name, "step": done, "tokens": tokens_seen, "flops": flops_done}

        rows: list[dict] = []
        t0 = last = time.perf_counter()
        try:
            for step in range(start, target):
                batch = source.batch(step - phase.start_step)
                tokens, segment_ids = _global_batch(batch, mesh, batch_size, seq_len, model_cfg.vocab_size)
                state, metrics = step_fn(state, tokens, segment_ids)
                metrics = jax.device_get(metrics)
                now = time.perf_counter()
                loss = float(metrics["loss"])
                if not math.isfinite(loss):
                    checkpoints.wait()
                    good = checkpoints.latest_step()
                    where = f"{checkpoints.path(good)} (step {good})" if good is not None else "none"
                    raise TrainingError(
                        f"loss is {loss} at step {step} (phase {phase.name}); stopped without saving. "
                        f"Last good checkpoint: {where}"
                    )
                elapsed = now - last
                last = now
                tokens_seen += tokens_per_step
                flops_done += step_flops
                row = {
                    "step": step,
                    "phase": phase.name,
                    "loss": loss,
                    "lr": float(metrics["lr"]),
                    "tokens": tokens_seen,
                    "tokens_per_second": tokens_per_step / elapsed,
                    "flops": flops_done,
                    "mfu": step_flops / elapsed / peak,
                    "grad_norm": float(metrics["grad_norm"]),
                    "param_norm": float(metrics["param_norm"]),
                    "router_bias_norm": [float(x) for x in metrics["router_bias_norm"]],
                    "expert_load": [[round(float(x), 6) for x in layer] for layer in metrics["expert_load"]],
                    "drop_fraction": float(metrics["drop_fraction"]),
                    "time": now - t0,
                    "objective": float(metrics["objective"]),
                    "balance_loss": float(metrics["balance_loss"]),
                    "router_z_loss": float(metrics["router_z_loss"]),
                }
                writer.write(row)
                rows.append(row)
                done = step + 1
                if stop_after is not None and done - start >= stop_after:
                    if done % checkpoint.every == 0:
                        checkpoints.save(done, state, record(done))
                    log.info("stopping after %d steps as asked (simulated interruption)", stop_after)
                    break
                if done % checkpoint.every == 0 or done == target:
                    checkpoints.save(done, state, record(done))
                if step == start or done % 10 == 0 or done == target:
                    log.info(
                        "step %d loss %.4f lr %.2e grad %.3f drop %.3f %.0f tok/s",
                        step,
                        loss,
                        row["lr"],
                        row["grad_norm"],
                        row["drop_fraction"],
                        row["tokens_per_second"],
                    )
        finally:
            checkpoints.close()
            writer.close()
    return rows


# Jitted functions by (model, optimizer, schedule, dtype, mesh): a second phase or a resumed run in the same
# process (tests, notebooks) reuses the compiled step instead of compiling it again.
_COMPILED_STEPS: dict[tuple, tuple] = {}


def compile_train_step(run: RunConfig, schedule: Schedule, mesh: jax.sharding.Mesh) -> tuple:
    """(init_state, train_step, state shardings): jitted with explicit shardings, cached per configuration.

    run: resolved (`resolve_run_config`): the optimizer's settings are all given."""
    model_cfg, opt = run.model_shape, run.optimizer
    key = (model_cfg.model_dump_json(), opt.kind, opt.weight_decay, opt.clip_norm, opt.adam_lr, opt.beta1,
           opt.beta2, opt.epsilon, run.compute_dtype, schedule, mesh)  # fmt: skip
    if key in _COMPILED_STEPS:
        return _COMPILED_STEPS[key]
    dtype = jnp.bfloat16 if run.compute_dtype == "bfloat16" else jnp.float32
    # Shapes first, then shardings, then the real arrays are created directly in place on the mesh.
    abstract_params = jax.eval_shape(lambda key: model.init_params(key, model_cfg), jax.random.key(0))
    tx = make_optimizer(
        abstract_params,
        opt.kind,
        opt.weight_decay,
        opt.clip_norm,
        opt.beta1,
        opt.beta2,
        opt.epsilon,
        adam_lr_ratio=opt.adam_lr / opt.lr if opt.adam_lr and opt.lr else 3 / 13,
    )

    def init_state(key: jax.Array) -> dict:
        params = model.init_params(key, model_cfg)
        return {
            "step": jnp.zeros((), jnp.int32),
            "params": params,
            "opt_state": tx.init(params),
            "router_bias": model.init_router_bias(model_cfg),
        }

    abstract_state = jax.eval_shape(init_state, jax.random.key(0))
    shardings = state_shardings(abstract_state, param_shardings(abstract_params, mesh), mesh)
    init_fn = jax.jit(init_state, out_shardings=shardings)
    step_fn = jax.jit(
        make_train_step(model_cfg, tx, schedule, dtype),
        in_shardings=(shardings, batch_sharding(mesh), batch_sharding(mesh)),
        out_shardings=(shardings, None),
        donate_argnums=0,
    )
    _COMPILED_STEPS[key] = (init_fn, step_fn, shardings)
    return _COMPILED_STEPS[key]


def _restore_or_start(
    fresh: Callable[[], dict],
    layout: Any,
    checkpoints: Checkpointer,
    run: RunConfig,
    phases: list[Phase],
    phase: Phase,
    phase_index: int,
) -> tuple[dict, int, dict]:
    """Resume this phase, continue from an earlier phase's checkpoint, or start fresh.

    Returns (state, global step to start at, the checkpoint's meta record or {})."""
    names = [p.name for p in phases]
    latest = checkpoints.latest_step()
    if latest is not None:
        restored, meta = checkpoints.restore(latest, layout)
        ckpt_phase = meta.get("phase", phase.name)
        if ckpt_phase == phase.name:
            log.info("resuming phase %s from step %d", phase.name, latest)
            return restored, latest, meta
        if ckpt_phase in names and names.index(ckpt_phase) < phase_index:
            return _continue(restored, ckpt_phase, latest, phase), phase.start_step, meta
        raise TrainingError(
            f"the latest checkpoint in {checkpoints.directory} is from phase {ckpt_phase!r}, which does not "
            f"come before phase {phase.name!r}; use a new --output"
        )
    init_from = run.checkpoint.init_from
    if init_from:
        source = Checkpointer(Path(init_from) / "checkpoints", read_only=True)
        step = source.latest_step()
        if step is None:
            raise TrainingError(f"--init-from {init_from}: no checkpoint in {source.directory}")
        restored, meta = source.restore(step, layout)
        source.close()
        return _continue(restored, meta.get("phase", "?"), step, phase), phase.start_step, meta
    if phase.start_step > 0:
        raise TrainingError(
            f"phase {phase.name!r} starts at step {phase.start_step} and continues from the previous phase: "
            f"train it into the same --output as that phase, or pass --init-from RUN_DIR"
        )
    return fresh(), 0, {}


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


def _global_batch(
    batch: Batch, mesh: jax.sharding.Mesh, batch_size: int, seq_len: int, vocab_size: int
) -> tuple[jax.Array, jax.Array]:
    """Check this process's rows and assemble the global arrays sharded across the mesh."""
    rows = batch_size // jax.process_count()
    expected = (rows, seq_len + 1)
    if batch.tokens.shape != expected:
        raise ValueError(f"the data source gave a batch of shape {batch.tokens.shape}, expected {expected}")
    top = int(batch.tokens.max())
    if top >= vocab_size or int(batch.tokens.min()) < 0:
        raise ValueError(f"token id {top} is outside the model's vocabulary of {vocab_size}")
    sharding = batch_sharding(mesh)
    tokens = jax.make_array_from_process_local_data(sharding, batch.tokens.astype(np.int32))
    segments = jax.make_array_from_process_local_data(sharding, batch.segment_ids.astype(np.int32))
    return tokens, segments
