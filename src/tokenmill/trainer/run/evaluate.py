"""Held-out evaluation of a model's parameters: the summed negative log-likelihood of fixed sequences
(data/evaluation.py) per set, turned into the records of eval.jsonl (formats/evals.py).

One step function per dispatch, jitted once with the training batch's sharding (rows across every mesh
axis) and the parameters' shardings: every set is cut into batches of the same shape, so neither another
set nor another evaluation compiles again (`Evaluator.compiled_shapes` counts the programs). The forward
is the model's (transformer.trunk) with the MoE dispatch replaced: "dropless" (every routed assignment
runs, nothing dropped: the default, since capacity-limited evaluation scores a batch ordered by domain
worse than the model is) and "capacity" (the training dispatch with its buffer per expert; reported as
such, with the fraction of assignments dropped, when the run trains with capacity). The negative
log-likelihood per token is computed in fp32 from fp32 logits, `loss_block` positions at a time as in
training, masked where a window is padding, and summed per batch on the device; the batches' sums are
fetched once per set and added in float64.

Cost: one forward per batch (about a third of a train step's FLOPs per token), no optimizer; the batches
are dispatched one after another without waiting, so evaluation holds the step loop only for its own
compute and one fetch per set.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tokenmill import storage
from tokenmill.formats.evals import EVAL, EvalRecord, averages, eval_line, iter_eval, set_record
from tokenmill.formats.runs import CONFIG, read_run_record, write_run_record
from tokenmill.trainer.data.evaluation import EvalSequences
from tokenmill.trainer.model import transformer
from tokenmill.trainer.model.shape import ModelConfig
from tokenmill.trainer.model.sharding import batch_sharding, param_shardings, replicated

log = logging.getLogger(__name__)

DISPATCHES = ("dropless", "capacity")


def with_dispatch(model_cfg: ModelConfig, dispatch: str) -> ModelConfig:
    """The model with its routed experts dispatched as named (the weights are the same)."""
    if model_cfg.moe.dispatch == dispatch:
        return model_cfg
    return model_cfg.model_copy(update={"moe": model_cfg.moe.model_copy(update={"dispatch": dispatch})})


def masked_nll(x: jax.Array, head: jax.Array, targets: jax.Array, mask: jax.Array, block: int | None):
    """Summed negative log-likelihood (fp32) of targets [B, S] under the logits x @ head where mask is 1,
    `block` positions at a time so that only [B, block, vocab] logits are ever alive."""
    b, s, d = x.shape
    size = transformer.block_size(s, block)
    head = head.astype(x.dtype)

    def nll(x_block: jax.Array, target_block: jax.Array, mask_block: jax.Array) -> jax.Array:
        logits = jnp.dot(x_block, head, preferred_element_type=jnp.float32)
        log_partition = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, target_block[..., None], axis=-1)[..., 0]
        return jnp.sum((log_partition - picked) * mask_block)

    if size == s:
        return nll(x, targets, mask)
    blocks = s // size

    def split(array: jax.Array) -> jax.Array:
        return array.reshape(b, blocks, size, *array.shape[2:]).swapaxes(0, 1)

    def body(total: jax.Array, inputs: tuple) -> tuple[jax.Array, None]:
        return total + nll(*inputs), None

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (split(x), split(targets), split(mask)))
    return total


def make_eval_step(model_cfg: ModelConfig, dtype: Any):
    """(params, router_bias, tokens, segment_ids, mask) -> (summed nll, dropped assignments): to be jitted."""

    def eval_step(params: dict, router_bias: jax.Array, tokens: jax.Array, segment_ids: jax.Array,
                  mask: jax.Array) -> tuple[jax.Array, jax.Array]:  # fmt: skip
        x, stats = transformer.trunk(
            params, router_bias, tokens[:, :-1], segment_ids[:, :-1], model_cfg, dtype
        )
        total = masked_nll(x, params["lm_head"], tokens[:, 1:], mask, model_cfg.loss_block)
        return total, jnp.sum(stats.dropped)

    return eval_step


def default_rows(batch_size: int, microbatches: int, mesh: jax.sharding.Mesh) -> int:
    """Rows of an evaluation batch: those of one training microbatch (what fits a forward and backward
    fits a forward), at least one per device."""
    rows = max(batch_size // microbatches, 1)
    return max(mesh.size, rows - rows % mesh.size)


class Evaluator:
    """Scores fixed evaluation sequences with one compiled step per dispatch, on a mesh."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        sets: Sequence[EvalSequences],
        mesh: jax.sharding.Mesh,
        rows: int,
        dispatches: Sequence[str] = ("dropless",),
        compute_dtype: str = "float32",
    ) -> None:
        unknown = [d for d in dispatches if d not in DISPATCHES]
        if unknown or not dispatches:
            raise ValueError(f"evaluation dispatch {unknown or dispatches}: expected some of {DISPATCHES}")
        if rows % mesh.size:
            raise ValueError(f"evaluation batch of {rows} rows does not divide over {mesh.size} devices")
        widths = {s.tokens.shape[1] for s in sets}
        if len(widths) > 1:
            raise ValueError(f"evaluation sets of different sequence lengths {sorted(widths)}")
        self.model_cfg, self.sets, self.mesh, self.rows = model_cfg, list(sets), mesh, rows
        self.dispatches = tuple(dispatches)
        dtype = jnp.bfloat16 if compute_dtype == "bfloat16" else jnp.float32
        rows_sharding = batch_sharding(mesh)
        # The training state's layout of the parameters: a train step's output is taken as it is.
        abstract = jax.eval_shape(lambda key: transformer.init_params(key, model_cfg), jax.random.key(0))
        params_in = param_shardings(abstract, mesh)
        self._steps = {
            dispatch: jax.jit(
                make_eval_step(with_dispatch(model_cfg, dispatch), dtype),
                in_shardings=(params_in, replicated(mesh), rows_sharding, rows_sharding, rows_sharding),
                out_shardings=(replicated(mesh), replicated(mesh)),
            )
            for dispatch in self.dispatches
        }
        self._sharding = rows_sharding
        self._params_sharding = params_in
        self._bias_sharding = replicated(mesh)

    def compiled_shapes(self) -> dict[str, int]:
        """Programs compiled so far per dispatch (one each once anything is evaluated)."""
        return {dispatch: step._cache_size() for dispatch, step in self._steps.items()}

    def _array(self, local: np.ndarray) -> jax.Array:
        return jax.make_array_from_process_local_data(self._sharding, local)

    def sums(self, params: dict, router_bias: jax.Array, dispatch: str, sequences: EvalSequences):
        """(summed nll in nats, dropped assignments) of one set: its batches dispatched without waiting,
        their sums fetched once."""
        step = self._steps[dispatch]
        outputs = [
            step(params, router_bias, self._array(b.tokens), self._array(b.segment_ids), self._array(b.mask))
            for b in sequences.batches(self.rows, jax.process_index(), jax.process_count())
        ]
        fetched = jax.device_get(outputs)
        return sum(float(nll) for nll, _ in fetched), sum(int(dropped) for _, dropped in fetched)

    def evaluate(
        self,
        params: dict,
        router_bias: jax.Array,
        step: int,
        phase: str | None = None,
        tokens_trained: int | None = None,
    ) -> list[EvalRecord]:
        """The records of one evaluation point: per dispatch, each set's record then the averages."""
        records: list[EvalRecord] = []
        m = self.model_cfg.moe
        # Parameters laid out otherwise (made outside the train step) move once; the train state's do not.
        params = jax.device_put(params, self._params_sharding)
        router_bias = jax.device_put(router_bias, self._bias_sharding)
        for dispatch in self.dispatches:
            started = time.perf_counter()
            point = []
            for sequences in self.sets:
                nll, dropped = self.sums(params, router_bias, dispatch, sequences)
                # Every routed assignment of the batches, padding rows included (they are routed too).
                width = sequences.tokens.shape[1] - 1
                assignments = sequences.num_batches(self.rows) * self.rows * width * m.top_k
                point.append(
                    set_record(
                        step=step,
                        name=sequences.name,
                        kind=sequences.kind,  # type: ignore[arg-type]
                        nll_nats=nll,
                        tokens=sequences.scored_tokens,
                        num_bytes=sequences.num_bytes,
                        sequences=sequences.sequences,
                        dispatch=dispatch,
                        phase=phase,
                        tokens_trained=tokens_trained,
                        drop_fraction=dropped / (assignments * self.model_cfg.n_layers),
                    )
                )
            seconds = time.perf_counter() - started
            point += averages(point)
            records += [record.model_copy(update={"seconds": seconds}) for record in point]
        return records


def summary(records: Sequence[EvalRecord]) -> dict[str, Any]:
    """The short form of one evaluation point for the run record and the log: step, and per dispatch the
    averages' loss and bits per byte."""
    if not records:
        return {}
    out: dict[str, Any] = {"step": records[0].step, "tokens_trained": records[0].tokens_trained}
    for record in records:
        if record.kind == "average":
            out.setdefault(record.dispatch, {})[record.set] = {
                "loss": record.loss,
                "bits_per_byte": record.bits_per_byte,
            }
    return out


class EvalWriter:
    """runs/NAME/eval.jsonl (formats/evals.py), written by process 0, each evaluation point's records in one
    write and flush; and Weights & Biases, through the metrics writer's run, when that is on.

    On resume from the checkpoint of step S, records of steps after S are dropped first (the file is
    rewritten atomically): those points are evaluated again on the way, so a resumed run's file holds the
    same records as an uninterrupted run's, each once."""

    def __init__(self, run_dir: Path, resume_step: int, wandb: Any = None) -> None:
        self.enabled = jax.process_index() == 0
        self.path = run_dir / EVAL
        self.record_path = run_dir / CONFIG
        self.wandb = wandb
        self.latest: list[EvalRecord] = []
        if not self.enabled:
            return
        if self.path.exists():
            kept = [record for _, record in iter_eval(str(self.path)) if record.step <= resume_step]
            with storage.atomic_write(str(self.path), "w") as handle:
                handle.writelines(eval_line(record) for record in kept)
            self.latest = [r for r in kept if r.step == kept[-1].step] if kept else []
        self.file = self.path.open("a")

    def write(self, records: Sequence[EvalRecord]) -> None:
        self.latest = list(records)
        if not self.enabled or not records:
            return
        self.file.write("".join(eval_line(record) for record in records))
        self.file.flush()
        if self.record_path.exists():
            # The run record carries the latest point's averages (what a glance at a run wants).
            document = read_run_record(str(self.record_path)).to_json()
            document["evaluation_latest"] = summary(records)
            write_run_record(str(self.record_path), document)
        for r in records:
            if (
                r.kind == "average"
                and r.average == "heldout_macro"
                or (r.average == "macro" and len(records) == 3)
            ):
                log.info(
                    "eval step %d %s %s: loss %.4f, %.4f bits per byte", r.step, r.dispatch, r.set, r.loss,
                    r.bits_per_byte,
                )  # fmt: skip
        if self.wandb is not None:
            values = {}
            for r in records:
                values[f"eval/{r.dispatch}/{r.set}/loss"] = r.loss
                values[f"eval/{r.dispatch}/{r.set}/bits_per_byte"] = r.bits_per_byte
            self.wandb.log(values, step=records[0].step)

    def close(self) -> None:
        if self.enabled:
            self.file.close()


def dispatches_of(dispatch: str, model_cfg: ModelConfig) -> tuple[str, ...]:
    """The dispatches an evaluation setting names: dropless, capacity, both, or (None) the default:
    dropless, and capacity too when the model trains with it."""
    if dispatch == "both" or (dispatch is None and model_cfg.moe.dispatch == "capacity"):
        return DISPATCHES
    return (dispatch or "dropless",)


def due(done: int, start: int, every: int, phase_end: int, target: int) -> bool:
    """Whether the loop evaluates after `done` steps: every `every` steps (0: never by count), at the
    end of the phase and at the end of this command's steps (the phase's, or schedule.steps')."""
    if done <= start:
        return False
    return (every > 0 and done % every == 0) or done in (phase_end, target)


def build_evaluator(
    run: Any,
    mesh: jax.sharding.Mesh,
    tokens_dir: str | None = None,
    names: Sequence[str] | None = None,
) -> Evaluator | None:
    """The evaluator of a resolved run (config.ResolvedRun) with its `evaluation` settings: the plan's
    evaluation sets (or evaluation.sets, or `names`), evaluation.sequences each, the run's sequence length
    and tokenizer; None when the run evaluates nothing (no plan, or a plan without evaluation sets)."""
    from tokenmill.trainer.data.evaluation import load_sequences, local_sets_folder

    config = run.config
    settings = config.evaluation
    names = names or settings.sets
    if run.plan is None or not (names or run.plan.evaluation):
        return None
    tokens_dir = tokens_dir or config.data.tokens
    if not tokens_dir:
        raise ValueError("evaluation needs the token shards folder (data.tokens)")
    tokens_dir = local_sets_folder(tokens_dir)  # gs://: a local mirror of the (small) evaluation sets
    expected = config.data.tokenizer_sha256 or run.plan.tokenizer_sha256
    sequences = load_sequences(
        run.plan, tokens_dir, config.data.sequence_length, settings.sequences, names, expected
    )
    rows = settings.rows or default_rows(config.data.batch_size, config.optimizer.microbatches, mesh)
    log.info(
        "evaluation: %d sets (%s), %d sequences of %d tokens at most each, batches of %d rows, %s",
        len(sequences), ", ".join(s.name for s in sequences), settings.sequences, config.data.sequence_length,
        rows, "/".join(dispatches_of(settings.dispatch, run.model)),
    )  # fmt: skip
    return Evaluator(
        run.model, sequences, mesh, rows, dispatches_of(settings.dispatch, run.model), config.compute_dtype
    )


def evaluate_checkpoint(
    run_dir: str,
    step: int | None = None,
    sets: Sequence[str] | None = None,
    tokens: str | None = None,
    sequences: int | None = None,
    dispatch: str | None = None,
    mesh_text: str | None = None,
) -> list[EvalRecord]:
    """`tokenmill eval`: the records of a run's checkpoint (the latest, or `step`) on its evaluation sets.

    The run is read back from its config.json (settings and plan) and resolved as `tokenmill train` does;
    the checkpoint is restored into the train state's layout on a mesh of this process's devices."""
    from tokenmill.formats.plan import plan_from_json
    from tokenmill.formats.runs import CONFIG, read_run_record
    from tokenmill.trainer.model.sharding import make_mesh, parse_mesh_shape
    from tokenmill.trainer.run.checkpoint import Checkpointer
    from tokenmill.trainer.run.config import (
        build_run_config,
        phases_from_plan,
        read_run_config_file,
        resolve_run_config,
    )
    from tokenmill.trainer.run.step import compile_train_step

    config_path = storage.join(run_dir, CONFIG)
    if not storage.exists(config_path):
        raise ValueError(f"{config_path}: missing (not a run folder of `tokenmill train`)")
    local = config_path if storage.is_local(config_path) else storage.local_copy(config_path)
    record = read_run_record(local)
    if not record.plan:
        raise ValueError(f"{config_path}: the run trained without a mixture plan: it has no evaluation sets")
    plan = plan_from_json(record.plan, config_path)
    overrides = {"evaluation.sequences": sequences, "evaluation.dispatch": dispatch}
    config = build_run_config(
        read_run_config_file(local), {k: v for k, v in overrides.items() if v is not None}, local
    )
    run = resolve_run_config(config, phases_from_plan(plan), plan)
    mesh = make_mesh(parse_mesh_shape(mesh_text, jax.device_count()))
    with jax.set_mesh(mesh):
        init_fn, _, shardings = compile_train_step(run, mesh)
        checkpoints = Checkpointer(storage.join(run_dir, "checkpoints"), read_only=True)
        try:
            step = checkpoints.latest_step() if step is None else step
            if step is None or step not in checkpoints.all_steps():
                steps = ", ".join(map(str, checkpoints.all_steps())) or "none"
                raise ValueError(f"{checkpoints.directory}: no checkpoint of step {step} (it has: {steps})")
            evaluator = build_evaluator(run, mesh, tokens, sets)
            if evaluator is None:
                raise ValueError(f"{config_path}: the plan names no evaluation sets; give --set NAME")
            layout = jax.tree.map(
                lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                jax.eval_shape(init_fn, jax.random.key(0)),
                shardings,
            )
            state, meta = checkpoints.restore(step, layout)
        finally:
            checkpoints.close()
        return evaluator.evaluate(
            state["params"], state["router_bias"], step, meta.get("phase"), meta.get("tokens")
        )
