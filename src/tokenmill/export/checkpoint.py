"""An exported model folder back into a tokenmill checkpoint, for `tokenmill train --checkpoint.init_from`.

The folder's parameters and router bias are read back (hf.import_hf: every file checked against the export
record) and saved through the trainer's Checkpointer as OUTPUT/checkpoints/STEP, STEP the exported one, in
the train state's layout of the run configuration that will continue (its optimizer decides the layout).
The optimizer state does not travel in a Hugging Face folder: it starts fresh (zero moments), as a run's
first step does. The checkpoint's record carries the model (so init_from checks that the continuing run
trains the same model), the export's plan and tokenizer hashes, its phase and tokens trained.
Memory: the parameters twice (read back, then placed) plus a fresh optimizer state.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tokenmill import storage
from tokenmill.export.run import ExportError


def write_imported_checkpoint(folder: str, output: str, config_path: str | None = None) -> str:
    """Write OUTPUT/checkpoints/STEP from the exported `folder`; returns that checkpoint's path.

    `config_path`: a run configuration (configs/runs/*.yaml or a run's config.json) whose model, if it
    names one, must be the exported model; default: the trainer's defaults for the exported model."""
    import jax
    import jax.numpy as jnp

    from tokenmill.export.hf import import_hf
    from tokenmill.trainer.model.sharding import make_mesh, parse_mesh_shape
    from tokenmill.trainer.run.checkpoint import Checkpointer, canonical_sha256, differences, model_record
    from tokenmill.trainer.run.config import Phase, build_run_config, read_run_config_file, resolve_run_config
    from tokenmill.trainer.run.step import compile_train_step

    cfg, params, router_bias, record = import_hf(folder)
    if storage.is_dir_nonempty(output):
        raise ExportError(f"{output} already holds files: import into a new folder")
    raw = read_run_config_file(config_path) if config_path else {}
    given = raw.get("model")
    config = build_run_config({**raw, "model": cfg.model_dump(mode="json")}, {}, config_path)
    if given is not None:
        named = build_run_config(raw, {}, config_path).model_shape
        if model_record(named) != model_record(cfg):
            found = "; ".join(differences(model_record(cfg), model_record(named), "model"))
            raise ExportError(f"{config_path} trains another model than {folder} holds: {found}")
    run = resolve_run_config(config, [Phase(config.data.phase, 0, config.schedule.steps or 1)])
    step = int(record["step"])
    mesh = make_mesh(parse_mesh_shape(None, jax.device_count()))
    with jax.set_mesh(mesh):
        init_fn, _, shardings = compile_train_step(run, mesh)
        state = init_fn(jax.random.key(run.config.seed))
        place = lambda value, like: jax.device_put(jnp.asarray(value, like.dtype), like.sharding)  # noqa: E731
        state["params"] = jax.tree.map(place, params, state["params"])
        state["router_bias"] = place(np.asarray(router_bias), state["router_bias"])
        state["step"] = place(np.asarray(step, np.int32), state["step"])
        model = model_record(cfg)
        meta = {
            "phase": record.get("phase"),
            "step": step,
            "tokens": record.get("tokens_trained") or 0,
            "plan_sha256": record.get("plan_sha256"),
            "seed": None,
            "tokenizer_sha256": (record.get("tokenizer") or {}).get("sha256"),
            "model_sha256": canonical_sha256(model),
            "model": model,
            "imported_from": folder,
        }
        directory = storage.join(output, "checkpoints")
        checkpoints = Checkpointer(directory if "://" in directory else Path(directory), async_save=False)
        checkpoints.save(step, state, meta)
        checkpoints.close()
    return storage.join(directory, str(step))
