"""Ahead-of-time compile of one train step, measured: what `tokenmill model compile` reports.

`compile_report` lowers and compiles the very step `tokenmill train` runs (step.compile_train_step) with
abstract arrays on the current (simulated) devices, so no parameter is allocated, and reads XLA's memory
plan and FLOP count, and what the step's collectives move (collectives.py) with the time that takes at a
link bandwidth next to the compute at an MFU; `executed_flops` is the model's own count of what that step
executes, to compare. docs/trainer.md, "Compiling ahead of time".
"""

from __future__ import annotations

import math
import time
from typing import Any

from tokenmill.trainer.model import expert_parallel
from tokenmill.trainer.model.flops import count_params, flops_per_token, per_token_gate_matrices, xla_flops
from tokenmill.trainer.model.moe import expert_capacity
from tokenmill.trainer.model.sharding import AXES, batch_sharding, make_mesh
from tokenmill.trainer.model.transformer import block_size
from tokenmill.trainer.run import optim
from tokenmill.trainer.run.collectives import (
    DEFAULT_LINK,
    DEFAULT_MFU,
    LINK_PRESETS,
    ParameterShapes,
    communication,
    estimate_times,
    parse_link,
)
from tokenmill.trainer.run.config import Phase, RunConfig, resolve_run_config
from tokenmill.trainer.run.step import compile_train_step

# How far XLA's FLOP count may be from the model's count of the executed step before the report flags it.
FLOPS_TOLERANCE = 0.25


def compile_report(
    cfg: Any,
    mesh_axes: dict[str, int],
    batch_size: int,
    sequence_length: int | None,
    device_memory: int,
    remat: str | None = None,
    optimizer: str | None = None,
    optimizer_state: str = "device",
    compute_dtype: str = "bfloat16",
    microbatches: int = 1,
    probe_microbatches: bool = True,
    link: str = DEFAULT_LINK,
    mfu: float = DEFAULT_MFU,
    peak_flops: float | None = None,
    count_communication: bool = True,
) -> dict:
    """Compile one train step of `cfg` on the current JAX devices (which must number the mesh's size) with
    abstract arrays, and measure it: the dict `model compile --json` prints.

    The report's `communication` (when `count_communication`): the bytes per device the step's
    collectives move, by what they serve (collectives.communication), and their time at `link` (a preset
    of LINK_PRESETS or GB/s per device and direction) next to the step's compute at `mfu` of `peak_flops`
    per device (default: the preset's chip, a GB200 for a plain number), for the MFU count of the step's
    FLOPs. Reading it holds the compiled HLO's text and its parse (tens of MB for the 535B) for a moment.

    When the step does not fit and each device still runs more than one row per microbatch, the step is
    compiled once more at one row per device per microbatch (`probe_microbatches`): the two totals give the
    bytes that grow with the rows a device runs at once and the bytes that do not, from which the
    suggestions estimate the total at every microbatch count (exact at both ends, interpolated between)."""
    import jax
    import jax.numpy as jnp

    if remat is not None:
        cfg = cfg.model_copy(update={"remat": remat})
    sequence_length = sequence_length or cfg.sequence_length
    steps = cfg.reference_run.steps if cfg.reference_run else 1000  # only the learning-rate rule reads it
    phases = [Phase("pretraining", 0, steps)]
    run = RunConfig(
        model=cfg,
        compute_dtype=compute_dtype,
        data={"synthetic": True, "batch_size": batch_size, "sequence_length": sequence_length},
        mesh=mesh_axes,
        optimizer={"kind": optimizer, "state_memory": optimizer_state, "microbatches": microbatches},
    )
    resolved = resolve_run_config(run, phases)
    mesh = make_mesh(tuple(mesh_axes[axis] for axis in AXES))
    with jax.set_mesh(mesh):
        init_fn, step_fn, shardings = compile_train_step(resolved, mesh)
        state = jax.tree.map(
            lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
            jax.eval_shape(init_fn, jax.random.key(0)),
            shardings,
        )
        batch = jax.ShapeDtypeStruct(
            (batch_size, sequence_length + 1), jnp.int32, sharding=batch_sharding(mesh)
        )
        start = time.perf_counter()
        compiled = step_fn.lower(state, batch, batch).compile()
        compile_seconds = time.perf_counter() - start

    devices = mesh.size
    memory = compiled.memory_analysis()
    host_state = sum(
        math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
        for leaf in jax.tree.leaves(state)
        if leaf.sharding.memory_kind == "pinned_host"
    )
    xla_host = memory.host_argument_size_in_bytes + memory.host_temp_size_in_bytes
    # A backend that does not account host buffers apart (the CPU backend: all its memory is the host's)
    # counts the host-resident state among the arguments and outputs; take it out of the device's share.
    counted_in_device = host_state if memory.host_argument_size_in_bytes == 0 else 0
    arguments = memory.argument_size_in_bytes - counted_in_device
    outputs = memory.output_size_in_bytes - counted_in_device
    aliased = max(0, memory.alias_size_in_bytes - counted_in_device)
    temps = memory.temp_size_in_bytes
    # Donated state is updated in place: an aliased output takes no memory beyond its argument.
    total = arguments + outputs - aliased + temps
    raw_flops, loop_flops = xla_flops(compiled)
    model_flops = flops_per_token(cfg, sequence_length) * batch_size * sequence_length
    communicated = None
    if count_communication:
        communicated = communication(compiled.as_text(), ParameterShapes.from_params(state["params"]))
        preset, bandwidth, preset_peak = parse_link(link)
        peak = peak_flops or preset_peak or LINK_PRESETS[DEFAULT_LINK]["peak_flops"]
        communicated["link"] = {
            "preset": preset,
            "description": LINK_PRESETS[preset]["link"] if preset else None,
            "bandwidth_bytes_per_second": bandwidth,
            "peak_flops_per_device": peak,
            "mfu": mfu,
        }
        communicated.update(
            estimate_times(communicated["bytes_per_device"], bandwidth, model_flops, devices, peak, mfu)
        )
    executed = executed_flops(
        cfg,
        mesh_axes,
        batch_size,
        sequence_length,
        microbatches,
        state["params"],
        resolved.config.optimizer.kind,
    )
    xla_total = loop_flops * devices
    fits = total <= device_memory
    report = {
        "model": cfg.name,
        "devices": devices,
        "mesh": dict(mesh_axes),
        "batch_size": batch_size,
        "sequence_length": sequence_length,
        "tokens_per_step": batch_size * sequence_length,
        "microbatches": microbatches,
        "layer_groups": [group._asdict() for group in cfg.layer_groups()],
        "dispatch": _dispatch_used(cfg, mesh_axes),
        "remat": cfg.remat,
        "optimizer": resolved.config.optimizer.kind,
        "optimizer_state": optimizer_state,
        "compute_dtype": compute_dtype,
        "bytes_per_device": {
            "arguments": arguments,
            "outputs": outputs,
            "aliased": aliased,
            "temps": temps,
            "total": total,
            "host": max(host_state, xla_host),
        },
        "xla_flops_per_step": loop_flops * devices,
        "xla_cost_analysis_flops_per_step": raw_flops * devices,
        "model_flops_per_step": model_flops,
        "model_flops_executed": executed["total"],
        "model_flops_executed_parts": {key: value for key, value in executed.items() if key != "total"},
        "flops_ratio": xla_total / model_flops if model_flops else None,
        "flops_ratio_executed": xla_total / executed["total"] if executed["total"] else None,
        "flops_agree": bool(executed["total"]) and abs(xla_total / executed["total"] - 1) <= FLOPS_TOLERANCE,
        "communication": communicated,
        "compile_seconds": round(compile_seconds, 2),
        "device_memory": device_memory,
        "fits": fits,
        "margin_bytes": device_memory - total,
    }
    rows = batch_size // (devices * microbatches)
    by_microbatches: dict[int, float] = {}
    if not fits and probe_microbatches and rows > 1:
        # The other end: one row per device at a time. Bytes do not grow quite linearly with the rows (XLA
        # reuses more at fewer), so the fewest rows, where a step that barely fits lies, are measured.
        probe = compile_report(
            cfg, mesh_axes, batch_size, sequence_length, device_memory, remat, optimizer, optimizer_state,
            compute_dtype, batch_size // devices, probe_microbatches=False, count_communication=False,
        )  # fmt: skip
        per_row = (total - probe["bytes_per_device"]["total"]) / (rows - 1)
        fixed = total - per_row * rows
        report["bytes_per_device_model"] = {"fixed": fixed, "per_row_of_a_microbatch": per_row}
        by_microbatches = {
            count: fixed + per_row * (batch_size // (devices * count))
            for count in range(microbatches, batch_size // devices + 1)
            if (batch_size // devices) % count == 0
        }
    report["suggestions"] = (
        []
        if fits
        else _suggestions(cfg, state, total - device_memory, optimizer_state, by_microbatches, rows)
    )
    report["suggestions_estimated_totals"] = by_microbatches
    return report


def executed_flops(
    cfg: Any,
    mesh_axes: dict[str, int],
    batch_size: int,
    sequence_length: int,
    microbatches: int,
    abstract_params: Any,
    optimizer: str,
) -> dict[str, float]:
    """The model's count of what the compiled step executes, by part (FLOPs per step, all devices), to
    compare with XLA's: unlike `flops_per_token` (the MFU convention) it counts

    - the matrices' forward again in the backward pass under `remat: full` (8 x params per token, not 6);
    - attention over every key: the blocked and the unblocked attention compute all S scores of a query
      under a mask (the causal and window rules save nothing), and a blocked attention's block is
      recomputed once more in the backward pass (its jax.checkpoint);
    - the routed experts' padding: the capacity transport runs every one of its E x C slots, capacity
      factor x (more with the one-slot-per-token CPU fallback), and the single-device capacity dispatch's
      one-hot dispatch and combine einsums;
    - the output head (6 x d_model x vocab per token, 8 when the loss is blocked: recomputed);
    - Newton-Schulz (muon, muonh): per matrix m x n (m <= n) and iteration 4 m^2 n + 2 m^3.
    """
    import jax
    import optax

    tokens = batch_size * sequence_length
    counts = count_params(cfg)
    m = cfg.moe
    remat_full = cfg.remat == "full"
    passes = 8 if remat_full else 6  # forward, (forward again,) backward x 2
    routed_active = counts.routed_expert_params * m.top_k / m.n_experts
    dense = counts.active_params + per_token_gate_matrices(cfg) - routed_active
    ep = getattr(m, "expert_parallel", False) and mesh_axes["expert"] > 1
    local_tokens = tokens // (math.prod(mesh_axes.values()) * microbatches)
    width = m.latent_dim or cfg.d_model
    dispatch_einsums = 0.0
    if ep and m.dispatch == "capacity":
        slots = m.n_experts * expert_parallel.shard_capacity(local_tokens, m)
        padding = slots / (local_tokens * m.top_k)
    elif ep:  # dropless: ragged where the backend has it, else the fallback of one slot per local token
        padding = m.n_experts / m.top_k if jax_platform() == "cpu" else 1.0
    elif m.dispatch == "capacity":
        capacity = expert_capacity(sequence_length, m)
        padding = m.n_experts * capacity / (sequence_length * m.top_k)
        # "bsec,bsd->ebcd" and "bsec,ebcd->bsd": 2 E C W FLOPs each per token forward, in every layer;
        # training runs the forward passes / 2 times over (3 or 4).
        forward = 2 * (2 * m.n_experts * capacity * width)
        dispatch_einsums = tokens * cfg.n_layers * forward * passes / 2
    else:
        padding = 1.0
    matrices = tokens * passes * (dense + routed_active * padding)
    blocked = block_size(sequence_length, cfg.attention_block) < sequence_length
    attention_passes = 3 + remat_full + blocked
    attention = tokens * cfg.n_layers * 4 * sequence_length * cfg.n_heads * cfg.head_dim * attention_passes
    head_passes = 8 if block_size(sequence_length, cfg.loss_block) < sequence_length else 6
    head = tokens * head_passes * cfg.d_model * cfg.vocab_size
    newton_schulz = 0.0
    if optimizer in ("muon", "muonh"):
        if optimizer == "muonh":
            orthogonalised = jax.tree.map(
                lambda group: group == "muonh", optim.optimizer_groups(abstract_params)
            )
        else:
            orthogonalised = jax.tree.map(
                lambda dims: dims is not None,
                optim._muon_dims(abstract_params),
                is_leaf=lambda node: node is None or isinstance(node, optax.contrib.MuonDimensionNumbers),
            )
        steps = len(optim.QUINTIC_NS_COEFFICIENTS)
        for chosen, leaf in zip(
            jax.tree.leaves(orthogonalised), jax.tree.leaves(abstract_params), strict=True
        ):
            if not chosen:
                continue
            small, large = sorted(leaf.shape[-2:])
            matrices_in_leaf = math.prod(leaf.shape[:-2])
            newton_schulz += matrices_in_leaf * steps * (4 * small * small * large + 2 * small**3)
    parts = {
        "matrices": matrices,
        "dispatch_einsums": dispatch_einsums,
        "attention": attention,
        "output_head": head,
        "newton_schulz": newton_schulz,
    }
    return {**parts, "total": sum(parts.values())}


def jax_platform() -> str:
    import jax

    return jax.default_backend()


def _dispatch_used(cfg: Any, mesh_axes: dict[str, int]) -> str:
    """The MoE dispatch this step runs: expert-parallel when the model asks for it and the mesh has an
    expert axis (trainer/model/expert_parallel.py), else moe.dispatch under XLA's automatic partitioner."""
    moe = cfg.moe
    if getattr(moe, "expert_parallel", False) and mesh_axes["expert"] > 1:
        return f"expert_parallel/{moe.dispatch}"
    return moe.dispatch


def _suggestions(
    cfg: Any,
    state: Any,
    over: int,
    optimizer_state: str,
    by_microbatches: dict[int, float],
    rows: int,
) -> list[str]:
    """What would bring the step under the device's memory, largest known saving first; gradient
    accumulation with the estimated per-device total at each microbatch count (`by_microbatches`, from two
    compiles: bytes = fixed + per-row x rows a device runs at once)."""
    import jax

    tips = []
    # The device's memory: the estimate at the current count is this step's total.
    limit = max(by_microbatches.values(), default=0.0) - over
    if by_microbatches:
        fitting = [count for count, total in by_microbatches.items() if total <= limit]
        estimates = ", ".join(f"{count}: {total / 1e9:.0f} GB" for count, total in by_microbatches.items())
        verdict = (
            f"{fitting[0]} is the fewest that fits"
            if fitting
            else "none fits alone: combine with the options below"
        )
        tips.append(
            f"--microbatches N (optimizer.microbatches) shrinks the activations ({verdict}); estimated total "
            f"per device by N: {estimates}"
        )
    elif rows == 1:
        tips.append(
            "--microbatches cannot shrink the activations further: each device already runs one row at "
            "a time; the rest is parameters, gradients and the optimizer update"
        )
    if optimizer_state == "device":
        opt_bytes = sum(
            math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
            for leaf in jax.tree.leaves(state["opt_state"])
        )
        with_microbatches = [count for count, total in by_microbatches.items() if total - opt_bytes <= limit]
        if opt_bytes >= over:
            verdict = "enough"
        elif with_microbatches:
            verdict = f"enough with --microbatches {with_microbatches[0]}"
        else:
            verdict = "not enough alone"
        tips.append(
            f"--optimizer-state pinned_host (optimizer.state_memory) moves {opt_bytes / 1e9:.1f} GB per "
            f"device of optimizer state to the host ({verdict})"
        )
    if cfg.remat in ("none", "dots_saveable"):
        tips.append("--remat full (model remat: full) keeps only each layer's input for the backward pass")
    if cfg.remat != "offload":
        tips.append("--remat offload keeps the saved matmul outputs in pinned host memory")
    tips.append("more devices on fsdp or expert split parameters and optimizer state further")
    tips.append("a smaller per-device batch shrinks the activations (temps) in proportion")
    return tips
