"""A run's checkpoint as plain arrays: the model shape, the parameters and router bias at one step, and the
identity the trainer recorded with them.

`--run` names a run folder (runs/NAME: config.json and checkpoints/) or one checkpoint in it
(runs/NAME/checkpoints/STEP), local or gs://. The run is resolved from its config.json as `tokenmill eval`
resolves it, and the checkpoint is restored through the trainer's Checkpointer into the train state's own
layout on this process's devices; only the parameters and the router bias are kept, as host NumPy arrays.
Memory: the whole train state (parameters and optimizer moments) is restored once, then the optimizer
state is dropped; about three times the parameters' fp32 bytes at the peak under AdamW.

Before any array is read, the checkpoint's recorded model (its `model_sha256`) is compared with the run's
config.json: a checkpoint of another model is refused, naming the fields that differ.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenmill import storage
from tokenmill.trainer.model.shape import ModelConfig

CHECKPOINT_STEP = re.compile(r"^(?P<run>.+?)/checkpoints/(?P<step>\d+)/?$")


class ExportError(ValueError):
    """A run, checkpoint or output folder that cannot be exported from or to; the message says why."""


@dataclass(frozen=True)
class RunCheckpoint:
    """One checkpoint of a run, on the host.

    params: the model's parameter pytree (nested dicts and lists of float32 NumPy arrays, layers stacked by
    group as model/transformer.py lays them out); router_bias: [n_layers, n_experts] float32.
    """

    run_dir: str
    step: int
    model: ModelConfig
    params: dict[str, Any]
    router_bias: np.ndarray
    meta: dict[str, Any]
    config_sha256: str
    record: dict[str, Any]

    @property
    def model_sha256(self) -> str | None:
        return self.meta.get("model_sha256")

    @property
    def plan_sha256(self) -> str | None:
        return self.meta.get("plan_sha256")

    @property
    def tokenizer_sha256(self) -> str | None:
        return self.meta.get("tokenizer_sha256") or (self.record.get("data") or {}).get("tokenizer_sha256")


def split_run_path(path: str) -> tuple[str, int | None]:
    """(run folder, step) of `--run`: a run folder, or runs/NAME/checkpoints/STEP (its step)."""
    path = path.rstrip("/")
    match = CHECKPOINT_STEP.match(path)
    if match:
        return match["run"], int(match["step"])
    return path, None


def load_checkpoint(path: str, step: int | None = None) -> RunCheckpoint:
    """The checkpoint of `path` (a run folder or one of its checkpoints) at `step` (default: the one the
    path names, else the latest). Raises ExportError for a folder that is no run, a run without
    checkpoints, a step it does not have, or a checkpoint whose model differs from the run's config.json."""
    import jax

    from tokenmill.formats.plan import plan_from_json
    from tokenmill.formats.runs import CONFIG, read_run_record
    from tokenmill.trainer.model.sharding import make_mesh, parse_mesh_shape
    from tokenmill.trainer.run.checkpoint import Checkpointer, canonical_sha256, differences, model_record
    from tokenmill.trainer.run.config import (
        Phase,
        RunConfigError,
        build_run_config,
        phases_from_plan,
        read_run_config_file,
        resolve_run_config,
    )
    from tokenmill.trainer.run.step import compile_train_step

    run_dir, named_step = split_run_path(path)
    if step is not None and named_step is not None and step != named_step:
        raise ExportError(f"--step {step} differs from the checkpoint {path} names (step {named_step})")
    step = named_step if step is None else step
    config_path = storage.join(run_dir, CONFIG)
    if not storage.exists(config_path):
        raise ExportError(f"{config_path}: missing (not a run folder of `tokenmill train`)")
    local = config_path if storage.is_local(config_path) else storage.local_copy(config_path)
    with open(local, "rb") as handle:
        config_sha256 = hashlib.sha256(handle.read()).hexdigest()
    try:
        record = read_run_record(local)
        config = build_run_config(read_run_config_file(local), {}, local)
        plan = plan_from_json(record.plan, config_path) if record.plan else None
        if plan is not None:
            phases = phases_from_plan(plan)
        else:
            steps = config.schedule.total_steps or config.schedule.steps or 1
            phases = [Phase(config.data.phase, 0, steps)]
        run = resolve_run_config(config, phases, plan)
    except (RunConfigError, ValueError) as error:
        raise ExportError(f"{config_path}: cannot read the run back: {error}") from error

    checkpoint_dir = storage.join(run_dir, "checkpoints")
    if not storage.exists(checkpoint_dir):
        raise ExportError(f"{run_dir}: the run has no checkpoints (no {checkpoint_dir})")
    mesh = make_mesh(parse_mesh_shape(None, jax.device_count()))
    with jax.set_mesh(mesh):
        checkpoints = Checkpointer(checkpoint_dir, read_only=True)
        try:
            steps = checkpoints.all_steps()
            if not steps:
                raise ExportError(f"{run_dir}: the run has no checkpoints ({checkpoint_dir} is empty)")
            step = checkpoints.latest_step() if step is None else step
            if step not in steps:
                listed = ", ".join(map(str, sorted(steps)))
                raise ExportError(f"{checkpoint_dir}: no checkpoint of step {step} (it has: {listed})")
            meta = checkpoints.read_meta(step)
            expected = canonical_sha256(model_record(run.model))
            if meta.get("model_sha256") and meta["model_sha256"] != expected:
                found = "; ".join(differences(meta.get("model"), model_record(run.model), "model"))
                raise ExportError(
                    f"checkpoint {checkpoints.path(step)} holds another model than {config_path} describes "
                    f"(model_sha256 {meta['model_sha256'][:12]} vs {expected[:12]}: {found or 'unknown'}); "
                    "export it with the run folder it was trained in"
                )
            init_fn, _, shardings = compile_train_step(run, mesh)
            layout = jax.tree.map(
                lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                jax.eval_shape(init_fn, jax.random.key(0)),
                shardings,
            )
            state, meta = checkpoints.restore(step, layout)
        except ValueError as error:
            if isinstance(error, ExportError):
                raise
            raise ExportError(f"{checkpoint_dir}: cannot restore step {step}: {error}") from error
        finally:
            checkpoints.close()
    params = jax.tree.map(lambda leaf: np.asarray(jax.device_get(leaf), np.float32), state["params"])
    router_bias = np.asarray(jax.device_get(state["router_bias"]), np.float32)
    return RunCheckpoint(
        run_dir=run_dir,
        step=int(step),
        model=run.model,
        params=params,
        router_bias=router_bias,
        meta=dict(meta),
        config_sha256=config_sha256,
        record=record.to_json(),
    )
