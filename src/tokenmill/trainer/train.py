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
import sys
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
    extend_history,
    history_entry,
    metrics_line,
    parse_metrics_line,
    read_run_record,
    write_run_record,
)
from tokenmill.trainer import model
from tokenmill.trainer.checkpoint import Change, Checkpointer, identity_changes, plan_sha256_of, run_identity
from tokenmill.trainer.config import ModelConfig
from tokenmill.trainer.data import Batch, BatchSource
from tokenmill.trainer.flops import count_params, flops_per_token, known_peak_flops, measure_matmul_flops
from tokenmill.trainer.moe import update_router_bias
from tokenmill.trainer.optim import LayerwiseOptimizer, Schedule, make_optimizer
from tokenmill.trainer.run_config import RunConfig, resolve_run_config
from tokenmill.trainer.sharding import (
    AXES,
    batch_sharding,
    device_memory,
    make_mesh,
    param_shardings,
    parse_mesh_shape,
    state_shardings,
)
from tokenmill.trainer.telemetry import StepTimer, Telemetry, capture_log, release_log

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


def make_train_step(
    model_cfg: ModelConfig,
    optimizer: LayerwiseOptimizer,
    schedule: Schedule,
    dtype: Any,
    microbatches: int = 1,
    grad_shardings: Any = None,
):
    """The step function (to be jitted): (state, tokens, segment_ids) -> (state, metrics).

    With `microbatches` N > 1 the batch runs as N microbatches under jax.lax.scan (gradient accumulation):
    each has a forward and a backward pass, their gradients are summed in fp32 (sharded as `grad_shardings`
    says, the parameters' layout), then the optimizer updates once with the sum scaled by 1/N (the scale
    is applied slice by slice inside the update: no averaged copy of the gradients is made). Microbatch i
    takes rows i, i+N, i+2N, ... so that each device's rows split evenly among the microbatches and no row
    moves between devices. Activation memory is that of B/N rows. The loss, the gradients and the router load
    (summed over microbatches: the bias update sees the whole batch's load) equal the one-pass step's up to
    float rounding, since every microbatch has the same number of tokens. Statistics that are not sums over
    tokens are averaged over microbatches: the balance loss, the router z-loss and quantile balancing's
    target bias (a batch quantile; the average of the microbatches' is close to, not equal to, the batch's).
    """
    m = model_cfg.moe

    def gradients(state: dict, tokens: jax.Array, segment_ids: jax.Array) -> tuple:
        def objective(params: dict) -> tuple[jax.Array, Any]:
            return model.loss_fn(params, state["router_bias"], tokens, segment_ids, model_cfg, dtype)

        return jax.value_and_grad(objective, has_aux=True)(state["params"])

    def accumulated(state: dict, tokens: jax.Array, segment_ids: jax.Array) -> tuple:
        if microbatches == 1:
            return *gradients(state, tokens, segment_ids), 1.0
        if tokens.shape[0] % microbatches:
            raise ValueError(f"{microbatches} microbatches do not divide a batch of {tokens.shape[0]} rows")

        def split(array: jax.Array) -> jax.Array:
            # Row r goes to microbatch r % N: a device's contiguous block of rows splits evenly.
            return array.reshape(-1, microbatches, *array.shape[1:]).swapaxes(0, 1)

        def keep_layout(grads: Any) -> Any:
            if grad_shardings is None:
                return grads
            return jax.lax.with_sharding_constraint(grads, grad_shardings)

        def body(carry: tuple, batch: tuple) -> tuple[tuple, None]:
            (total, (loss, stats)), grads = gradients(state, *batch)
            grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
            carry_total, carry_loss, carry_stats, carry_grads = carry
            summed = jax.tree.map(jnp.add, carry_grads, grads)
            return (carry_total + total, carry_loss + loss, jax.tree.map(jnp.add, carry_stats, stats),
                    keep_layout(summed)), None  # fmt: skip

        first = jax.eval_shape(gradients, state, split(tokens)[0], split(segment_ids)[0])
        (_, (_, stats_shape)), grads_shape = first
        stats_zero = jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, leaf.dtype), stats_shape)
        grads_zero = keep_layout(jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, jnp.float32), grads_shape))
        start = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), stats_zero, grads_zero)
        (total, loss, stats, grads), _ = jax.lax.scan(body, start, (split(tokens), split(segment_ids)))
        n = microbatches
        stats = stats._replace(
            quantile_bias=stats.quantile_bias / n,
            balance_loss=stats.balance_loss / n,
            z_loss=stats.z_loss / n,
        )
        return (total / n, (loss / n, stats)), grads, 1.0 / n

    def train_step(state: dict, tokens: jax.Array, segment_ids: jax.Array) -> tuple[dict, dict]:
        (total_loss, (loss, stats)), grads, grad_scale = accumulated(state, tokens, segment_ids)
        lr = schedule(state["step"])
        params, opt_state, grad_norm = optimizer.apply(
            grads, state["opt_state"], state["params"], lr, grad_scale
        )
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
            "grad_norm": grad_norm,
            # Learned parameters only: the router bias is reported on its own (a spike in the norm of
            # everything once turned out to be the bias alone).
            "param_norm": optax.tree.norm(params),
            "router_bias_norm": jnp.linalg.norm(router_bias, axis=-1),
            "expert_load": stats.load / assignments,
            # Per layer, the busiest expert's share x the number of experts (1.0: perfectly balanced).
            "expert_imbalance": stats.load.max(-1) * m.n_experts / jnp.maximum(stats.load.sum(-1), 1.0),
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
            for layer, imbalance in enumerate(row["expert_imbalance"]):
                flat[f"expert_imbalance/layer{layer}"] = imbalance
            self.wandb.log(flat, step=row["step"])

    @property
    def size(self) -> int:
        """Bytes of metrics.jsonl written so far: whole rows only, since every write is flushed."""
        return self.file.tell() if self.enabled and not self.file.closed else 0

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
    allow_data_change: bool = False,
) -> list[dict]:
    """Train the run's phase (resuming from its checkpoints) and return the metrics rows logged.

    stop_after: stop after this many steps as if killed (no final checkpoint), for resume drills and tests.
    allow_data_change: resume even though the plan, seed, tokenizer, batch or model differ from the
    checkpoint's (otherwise a TrainingError names what changed); config.json's history records it.
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
        identity = run_identity(run, plan, {axis: mesh.shape[axis] for axis in AXES}, jax.process_count())
        state, start, meta, changes = _restore_or_start(
            lambda: init_fn(jax.random.key(run.seed)),
            layout,
            checkpoints,
            run,
            phases,
            phase,
            phase_index,
            identity,
            allow_data_change,
            plan,
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
            # One file per run: each phase's settings are kept under "phases", the latest also at the top,
            # and every configuration the run has trained with under "history", with the step it began at.
            config_path = str(run_dir / CONFIG)
            previous = read_run_record(config_path) if os.path.exists(config_path) else None
            this_phase = {key: value for key, value in settings.items() if key != "model"}
            earlier_phases = (previous.phases if previous else None) or {}
            config_record["phases"] = {**earlier_phases, phase.name: this_phase}
            entry = history_entry(start, phase.name, settings, config_record["plan"], identity, changes)
            config_record["history"] = extend_history(previous, entry)
            write_run_record(config_path, config_record)
        # W&B gets the configuration in force; the history of earlier ones stays in config.json.
        settings_record = {key: value for key, value in config_record.items() if key != "history"}
        writer = MetricsWriter(run_dir, start, run.logging.wandb_project, settings_record)
        try:
            publisher = _live_publisher(run, run_dir) if writer.enabled else None
        except ValueError:
            checkpoints.close()
            writer.close()
            raise
        # runs/NAME/train.log, for the run page's tail (process 0, like metrics.jsonl).
        log_capture = capture_log(run_dir) if writer.enabled else None
        log.info(
            "phase %s: steps %d to %d on %d %s devices%s",
            phase.name,
            start,
            target,
            mesh.size,
            jax.devices()[0].device_kind,
            f" (from the checkpoint of step {meta['step']})" if "step" in meta else "",
        )
        if publisher is not None:
            log.info("publishing the run page to %s every %d steps", run.logging.publish, publisher.every)
        telemetry = Telemetry(jax.local_devices())
        timer = StepTimer()
        saved: int | None = None  # the latest checkpoint this process started
        done = start

        def record(done: int) -> dict:
            return {"phase": phase.name, "step": done, "tokens": tokens_seen, "flops": flops_done, **identity}

        rows: list[dict] = []
        t0 = last = time.perf_counter()
        try:
            for step in range(start, target):
                with timer.part("data"):
                    batch = source.batch(step - phase.start_step)
                    tokens, segment_ids = _global_batch(
                        batch, mesh, batch_size, seq_len, model_cfg.vocab_size
                    )
                with timer.part("compute"):
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
                    "expert_imbalance": [round(float(x), 4) for x in metrics["expert_imbalance"]],
                    "drop_fraction": float(metrics["drop_fraction"]),
                    "time": now - t0,
                    "objective": float(metrics["objective"]),
                    "balance_loss": float(metrics["balance_loss"]),
                    "router_z_loss": float(metrics["router_z_loss"]),
                    # Telemetry (docs/formats.md, "Runs"): keys a backend cannot read are left out.
                    "timestamp": time.time(),
                    "devices": mesh.size,
                    "tokens_per_second_per_device": tokens_per_step / elapsed / mesh.size,
                    **timer.take(elapsed),
                    **telemetry.sample(),
                }
                # The whole [layers, experts] load is 18k numbers a row for the 535B: written at the first
                # and last step of each run of this command and every expert_load_every steps.
                every = run.logging.expert_load_every
                if step in (start, target - 1) or (step - phase.start_step) % every == 0:
                    load = metrics["expert_load"]
                    row["expert_load"] = [[round(float(x), 6) for x in layer] for layer in load]
                writer.write(row)
                rows.append(row)
                done = step + 1
                if stop_after is not None and done - start >= stop_after:
                    if done % checkpoint.every == 0:
                        checkpoints.save(done, state, record(done))
                        saved = done
                    log.info("stopping after %d steps as asked (simulated interruption)", stop_after)
                    break
                if done % checkpoint.every == 0 or done == target:
                    with timer.part("checkpoint"):
                        checkpoints.save(done, state, record(done))
                    saved = done
                if publisher is not None and done < target and publisher.due(done, saved == done):
                    # A hand-over: the page is built and written in the background.
                    with timer.part("publish"):
                        publisher.submit(done, writer.size, target_step=target, checkpoint_step=saved)
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
            failure = sys.exc_info()[1]
            checkpoints.close()
            metrics_bytes = writer.size
            writer.close()
            telemetry.close()
            if publisher is not None:
                # The final version, also when training stopped on an error: a follower sees why.
                publisher.close(
                    done,
                    metrics_bytes,
                    state="finished" if failure is None and done == target else "stopped",
                    target_step=target,
                    checkpoint_step=saved,
                    message=f"{type(failure).__name__}: {failure}" if failure is not None else "",
                )
            if log_capture is not None:
                release_log(log_capture)
    return rows


def _live_publisher(run: RunConfig, run_dir: Path):
    """The background publisher of the run page when the run asks for one (logging.publish)."""
    if not run.logging.publish:
        return None
    from tokenmill.trainer.publish import LivePublisher, PublishError

    try:
        publisher = LivePublisher(
            run_dir,
            run.logging.publish,
            every=run.logging.publish_every,
            ladder=run.logging.publish_ladder,
            refresh_seconds=run.logging.publish_refresh,
        )
    except PublishError as error:
        raise ValueError(str(error)) from error
    return publisher


# Jitted functions by (model, optimizer, schedule, dtype, mesh): a second phase or a resumed run in the same
# process (tests, notebooks) reuses the compiled step instead of compiling it again.
_COMPILED_STEPS: dict[tuple, tuple] = {}


def compile_train_step(run: RunConfig, schedule: Schedule, mesh: jax.sharding.Mesh) -> tuple:
    """(init_state, train_step, state shardings): jitted with explicit shardings, cached per configuration.

    run: resolved (`resolve_run_config`): the optimizer's settings are all given. With
    `optimizer.state_memory: pinned_host` the optimizer state lives in the host's pinned memory: the
    update (optim.LayerwiseOptimizer) brings one slice of the layers' state to the device at a time and
    sends it back once updated.

    `tokenmill model compile` lowers the returned train_step with abstract arrays (`.lower(...)`), so the
    step it measures is this one."""
    model_cfg, opt = run.model_shape, run.optimizer
    key = (model_cfg.model_dump_json(), opt.model_dump_json(), run.compute_dtype, schedule, mesh)
    if key in _COMPILED_STEPS:
        return _COMPILED_STEPS[key]
    dtype = jnp.bfloat16 if run.compute_dtype == "bfloat16" else jnp.float32
    # Shapes first, then shardings, then the real arrays are created directly in place on the mesh.
    abstract_params = jax.eval_shape(lambda key: model.init_params(key, model_cfg), jax.random.key(0))
    rule = make_optimizer(
        opt.kind,
        opt.weight_decay,
        None,  # clipped by the LayerwiseOptimizer, which sees every gradient before any slice updates
        opt.beta1,
        opt.beta2,
        opt.epsilon,
        adam_lr_ratio=opt.adam_lr / opt.lr if opt.adam_lr and opt.lr else 3 / 13,
    )
    optimizer = LayerwiseOptimizer(rule, opt.clip_norm, opt.state_memory)

    def init_state(key: jax.Array) -> dict:
        params = model.init_params(key, model_cfg)
        return {
            "step": jnp.zeros((), jnp.int32),
            "params": params,
            "opt_state": optimizer.init(params),
            "router_bias": model.init_router_bias(model_cfg),
        }

    abstract_state = jax.eval_shape(init_state, jax.random.key(0))
    shardings = state_shardings(
        abstract_state, param_shardings(abstract_params, mesh), mesh, optimizer_memory=opt.state_memory
    )
    grad_shardings = device_memory(shardings["params"])
    step = make_train_step(model_cfg, optimizer, schedule, dtype, opt.microbatches, grad_shardings)
    init_fn = jax.jit(init_state, out_shardings=shardings)
    step_fn = jax.jit(
        step,
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
    identity: dict | None = None,
    allow_data_change: bool = False,
    plan: MixturePlan | None = None,
) -> tuple[dict, int, dict, list[Change]]:
    """Resume this phase, continue from an earlier phase's checkpoint, or start fresh.

    Before a checkpoint of this run is restored, its record is compared with `identity` (run_identity):
    a different plan, seed, tokenizer, batch or model is refused with a TrainingError naming each change,
    unless allow_data_change; a different mesh or process count is logged. A checkpoint of another run
    (--init-from) is checked for the model only.

    Returns (state, global step to start at, the checkpoint's meta record or {}, the changes resumed
    across)."""
    names = [p.name for p in phases]
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
    init_from = run.checkpoint.init_from
    if init_from:
        source = Checkpointer(Path(init_from) / "checkpoints", read_only=True)
        step = source.latest_step()
        if step is None:
            raise TrainingError(f"--init-from {init_from}: no checkpoint in {source.directory}")
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
            f"train it into the same --output as that phase, or pass --init-from RUN_DIR"
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
    """The changes between a checkpoint's record and this run (see `_restore_or_start`); raises
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
