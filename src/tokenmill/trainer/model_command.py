"""`tokenmill model info` and `tokenmill model compile`: what a model shape (configs/models/*.yaml) counts and
computes, and whether one train step of it fits a device, found ahead of time on simulated devices.

`model compile` lowers and compiles the very train step `tokenmill train` runs (train.compile_train_step:
forward, backward, optimizer, router-bias update) for N devices with abstract arrays, so no parameter is
allocated: the 535B shape compiles on a laptop. The simulated devices are XLA host devices, so the command
sets XLA_FLAGS itself before JAX starts (or re-runs itself in a fresh process when JAX has already started
with other devices). What it reports is what XLA planned for one device of that mesh: argument, output and
temporary buffers, and XLA's FLOP count, next to the model's own count (tokenmill.trainer.flops).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from typing import Any

from tokenmill.errors import UsageError
from tokenmill.units import format_count, parse_count


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `tokenmill model` to the `tokenmill` parser."""
    parser = subparsers.add_parser("model", help="inspect model shapes (configs/models/*.yaml)")
    model_sub = parser.add_subparsers(dest="model_command", metavar="ACTION")
    info = model_sub.add_parser(
        "info",
        help="parameter counts (total, active, stored) and the compute of a model shape",
        description="Counts follow Marin's convention: total = projection matrices with the embedding and "
        "head, active = those one token uses without them, stored = every number a checkpoint holds. "
        "Compute at --tokens (default: the shape's reference run): forecast_compute = C as Marin's "
        "ladder forecast prices it (no head, attention over the full span), train_flops = C + the head. "
        "flops_per_token is the MFU convention. See docs/trainer.md.",
    )
    info.add_argument("config", help="a model shape, e.g. configs/models/marin-535b-a23b.yaml")
    info.add_argument(
        "--tokens", help="training tokens, e.g. 18.75T (default: the shape's reference_run, if it has one)"
    )
    info.add_argument("--seq-len", type=int, help="training sequence length (default: the model's)")
    info.add_argument("--json", action="store_true", help="print JSON (exact integers)")
    info.set_defaults(handler=_model_info)
    compile_ = model_sub.add_parser(
        "compile",
        help="compile one train step ahead of time on N simulated devices: memory per device and FLOPs",
        description="Lowers and compiles one full train step (forward, backward, optimizer, router-bias "
        "update) for --devices simulated host devices with abstract arrays (nothing is allocated), and "
        "prints XLA's bytes per device (arguments, outputs, temporaries, their total, and the optimizer "
        "state kept in pinned host memory), XLA's FLOPs per step summed over devices next to the model's "
        "own count, the compile time, and whether it fits --device-memory. See docs/trainer.md.",
    )
    compile_.add_argument("config", help="a model shape, e.g. configs/models/marin-535b-a23b.yaml")
    compile_.add_argument("--devices", type=int, required=True, help="simulated devices (the mesh's size)")
    compile_.add_argument(
        "--mesh",
        help="axis sizes, e.g. fsdp=8,expert=8 (axes data, fsdp, expert; unnamed ones are 1, one may be -1; "
        "default: every device on fsdp)",
    )
    compile_.add_argument("--batch-size", type=int, required=True, help="sequences per step (global)")
    compile_.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's)")
    compile_.add_argument(
        "--microbatches",
        type=int,
        default=1,
        help="gradient accumulation (optimizer.microbatches): the batch runs as N microbatches of "
        "batch-size/N sequences, then one update; activations shrink about N-fold",
    )
    compile_.add_argument(
        "--device-memory",
        default="186GB",
        help="memory of one device to compare against, e.g. 186GB (GB200, the default), 80GiB, 141GB",
    )
    compile_.add_argument("--remat", choices=["none", "full", "dots_saveable", "offload"], help=(
        "rematerialisation policy (default: the model config's remat)"
    ))  # fmt: skip
    compile_.add_argument(
        "--optimizer", choices=["adamw", "muon", "muonh"], help="default: as `tokenmill train` picks it"
    )
    compile_.add_argument(
        "--optimizer-state",
        choices=["device", "pinned_host"],
        default="device",
        help="where the optimizer state lives between steps (pinned_host: as the reference run)",
    )
    compile_.add_argument(
        "--compute-dtype", choices=["float32", "bfloat16"], default="bfloat16", help="matmul precision"
    )
    compile_.add_argument("--json", action="store_true", help="print JSON")
    compile_.set_defaults(handler=_model_compile)
    parser.set_defaults(handler=lambda args: parser.print_help() or 2)


def _model_info(args: argparse.Namespace) -> int:
    from tokenmill.trainer.config import load_model_config
    from tokenmill.trainer.flops import model_info

    try:
        cfg = load_model_config(args.config)
        tokens = parse_count(args.tokens) if args.tokens else None
    except ValueError as error:
        raise UsageError(str(error)) from error
    info = model_info(cfg, tokens, args.seq_len)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    moe = cfg.moe
    kv = f"{cfg.n_kv_heads} kv"
    if cfg.global_kv_heads is not None:
        kv = f"kv {cfg.n_kv_heads} local / {cfg.global_kv_heads} global, {cfg.stored_kv_heads} stored"
    n_global = sum(cfg.is_global(layer) for layer in range(cfg.n_layers))
    attention = f"{n_global} of them global" if cfg.sliding_window else "all global"
    latent = f" in a {moe.latent_dim} latent" if moe.latent_dim else ""
    print(
        f"{cfg.name}: {format_count(info['total_params'], 4)} total, "
        f"{format_count(info['active_params'], 4)} active "
        f"({info['total_params']:,} with the embedding and head; {info['active_params']:,} without)"
    )
    print(
        f"  {cfg.n_layers} layers ({attention}), d_model {cfg.d_model}, {cfg.n_heads} heads ({kv}) x "
        f"{cfg.head_dim}, {moe.n_experts} experts top-{moe.top_k} x {moe.expert_hidden}{latent} + "
        f"{moe.n_shared_experts} shared x {moe.shared_hidden_width}, vocab {cfg.vocab_size}"
    )
    print(
        f"  stored {info['stored_params']:,} (embedding + head {info['embedding_params']:,}; norms, gates, "
        f"SConv and the router bias {info['other_stored_params']:,})"
    )
    if info["tokens"] is not None:
        run = info["reference_run"]
        from_run = run and not tokens
        source = (
            f" ({run['steps']:,} steps x {run['batch_size']:,} x {info['seq_len']:,})" if from_run else ""
        )
        print(
            f"  {info['tokens']:,} tokens{source}: forecast compute {info['forecast_compute']:.4e} "
            f"(no head, attention over the full span), with the head {info['train_flops']:.4e}"
        )
    print(
        f"  MFU FLOPs per token {info['flops_per_token']:.4g} (6 x matmul weights + causal attention "
        f"{info['attention_flops_per_token']:.4g} at seq_len {info['seq_len']}; "
        f"head {info['head_flops_per_token']:.4g} apart)"
    )
    return 0


# --- model compile ------------------------------------------------------------------------------------------

_BYTE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip
_AXES = ("data", "fsdp", "expert")
# How far XLA's FLOP count may be from the model's count of the executed step before the report flags it.
FLOPS_TOLERANCE = 0.25
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def parse_bytes(text: str) -> int:
    """'186GB' (decimal), '80GiB' (binary) or a plain number of bytes."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]I?B|B)?\s*", text.upper())
    if not match:
        raise ValueError(f"not a memory size: {text!r} (expected e.g. 186GB or 80GiB)")
    return int(float(match.group(1)) * _BYTE_UNITS[match.group(2) or ""])


def parse_mesh_axes(text: str | None, devices: int) -> dict[str, int]:
    """'fsdp=8,expert=8' -> {data: 1, fsdp: 8, expert: 8}; their product must be the device count."""
    if not text:
        return {"data": 1, "fsdp": devices, "expert": 1}
    sizes = dict.fromkeys(_AXES, 1)
    for part in text.split(","):
        name, _, value = part.partition("=")
        name = name.strip()
        if name not in _AXES or not value.strip().lstrip("-").isdigit():
            raise ValueError(f"--mesh {text!r}: expected AXIS=SIZE pairs with axes {', '.join(_AXES)}")
        sizes[name] = int(value)
    free = [name for name, size in sizes.items() if size == -1]
    if len(free) > 1 or any(size == 0 or size < -1 for size in sizes.values()):
        raise ValueError(f"--mesh {text!r}: sizes must be positive, one of them may be -1")
    known = math.prod(size for size in sizes.values() if size != -1)
    if free:
        if devices % known:
            raise ValueError(f"--mesh {text!r} does not divide {devices} devices")
        sizes[free[0]] = devices // known
    if math.prod(sizes.values()) != devices:
        raise ValueError(f"--mesh {text!r} has {math.prod(sizes.values())} devices, not --devices {devices}")
    return sizes


def _model_compile(args: argparse.Namespace) -> int:
    from tokenmill.trainer.config import load_model_config

    try:
        cfg = load_model_config(args.config)
        device_memory = parse_bytes(args.device_memory)
        mesh = parse_mesh_axes(args.mesh, args.devices)
    except ValueError as error:
        raise UsageError(str(error)) from error
    if args.devices <= 0 or args.batch_size <= 0 or args.microbatches <= 0:
        raise UsageError("--devices, --batch-size and --microbatches must be positive")
    if args.batch_size % (args.devices * args.microbatches):
        raise UsageError(
            f"--batch-size {args.batch_size} does not split into {args.microbatches} microbatches over "
            f"{args.devices} devices"
        )
    if not _simulated_devices_ready(args.devices):
        return _rerun_with_devices(args)
    report = compile_report(
        cfg,
        mesh,
        args.batch_size,
        args.seq_len,
        device_memory,
        remat=args.remat,
        optimizer=args.optimizer,
        optimizer_state=args.optimizer_state,
        compute_dtype=args.compute_dtype,
        microbatches=args.microbatches,
    )
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_compile_report(report))
    return 0


def _simulated_devices_ready(devices: int) -> bool:
    """Make sure JAX will start with `devices` CPU devices: set XLA_FLAGS before it starts; False when it
    has already started with another device set (the caller then re-runs the command in a new process)."""
    if "jax" in sys.modules:
        from jax._src import xla_bridge

        if xla_bridge.backends_are_initialized():
            import jax

            return jax.default_backend() == "cpu" and jax.device_count() == devices
    flags = [
        flag for flag in os.environ.get("XLA_FLAGS", "").split() if not flag.startswith(_DEVICE_COUNT_FLAG)
    ]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"{_DEVICE_COUNT_FLAG}={devices}"])
    # Simulated devices are host devices: an accelerator here would be used instead and is not what is asked.
    os.environ["JAX_PLATFORMS"] = "cpu"
    return True


def _rerun_with_devices(args: argparse.Namespace) -> int:
    """JAX already runs with other devices in this process (a notebook, a test): run the same command in a
    fresh interpreter, whose JAX starts with the simulated devices."""
    argv = ["model", "compile", args.config, "--devices", str(args.devices),
            "--batch-size", str(args.batch_size), "--device-memory", args.device_memory,
            "--optimizer-state", args.optimizer_state, "--compute-dtype", args.compute_dtype,
            "--microbatches", str(args.microbatches)]  # fmt: skip
    for flag, value in (("--mesh", args.mesh), ("--seq-len", args.seq_len), ("--remat", args.remat),
                        ("--optimizer", args.optimizer)):  # fmt: skip
        if value is not None:
            argv += [flag, str(value)]
    if args.json:
        argv.append("--json")
    env = {key: value for key, value in os.environ.items() if key not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    done = subprocess.run([sys.executable, "-m", "tokenmill", *argv], env=env, check=False)
    return done.returncode


def compile_report(
    cfg: Any,
    mesh_axes: dict[str, int],
    batch_size: int,
    seq_len: int | None,
    device_memory: int,
    remat: str | None = None,
    optimizer: str | None = None,
    optimizer_state: str = "device",
    compute_dtype: str = "bfloat16",
    microbatches: int = 1,
    probe_microbatches: bool = True,
) -> dict:
    """Compile one train step of `cfg` on the current JAX devices (which must number the mesh's size) with
    abstract arrays, and measure it: the dict `model compile --json` prints.

    When the step does not fit and each device still runs more than one row per microbatch, the step is
    compiled once more at one row per device per microbatch (`probe_microbatches`): the two totals give the
    bytes that grow with the rows a device runs at once and the bytes that do not, from which the
    suggestions estimate the total at every microbatch count (exact at both ends, interpolated between)."""
    import jax
    import jax.numpy as jnp

    from tokenmill.trainer.flops import flops_per_token
    from tokenmill.trainer.run_config import RunConfig, resolve_run_config
    from tokenmill.trainer.sharding import batch_sharding, make_mesh
    from tokenmill.trainer.train import Phase, compile_train_step, make_schedule

    if remat is not None:
        cfg = cfg.model_copy(update={"remat": remat})
    seq_len = seq_len or cfg.seq_len
    steps = cfg.reference_run.steps if cfg.reference_run else 1000  # only the learning-rate rule reads it
    phases = [Phase("pretraining", 0, steps)]
    run = RunConfig(
        model=cfg,
        compute_dtype=compute_dtype,
        data={"synthetic": True, "batch_size": batch_size, "seq_len": seq_len},
        mesh=mesh_axes,
        optimizer={"kind": optimizer, "state_memory": optimizer_state, "microbatches": microbatches},
    )
    run = resolve_run_config(run, phases)
    mesh = make_mesh(tuple(mesh_axes[axis] for axis in _AXES))
    with jax.set_mesh(mesh):
        init_fn, step_fn, shardings = compile_train_step(run, make_schedule(run, phases), mesh)
        state = jax.tree.map(
            lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
            jax.eval_shape(init_fn, jax.random.key(0)),
            shardings,
        )
        batch = jax.ShapeDtypeStruct((batch_size, seq_len + 1), jnp.int32, sharding=batch_sharding(mesh))
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
    model_flops = flops_per_token(cfg, seq_len) * batch_size * seq_len
    executed = executed_flops(
        cfg, mesh_axes, batch_size, seq_len, microbatches, state["params"], run.optimizer.kind
    )
    xla_total = loop_flops * devices
    fits = total <= device_memory
    report = {
        "model": cfg.name,
        "devices": devices,
        "mesh": dict(mesh_axes),
        "batch_size": batch_size,
        "seq_len": seq_len,
        "tokens_per_step": batch_size * seq_len,
        "microbatches": microbatches,
        "layer_groups": [group._asdict() for group in cfg.layer_groups()],
        "dispatch": _dispatch_used(cfg, mesh_axes),
        "remat": cfg.remat,
        "optimizer": run.optimizer.kind,
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
            cfg, mesh_axes, batch_size, seq_len, device_memory, remat, optimizer, optimizer_state,
            compute_dtype, batch_size // devices, probe_microbatches=False,
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
    seq_len: int,
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

    from tokenmill.trainer import expert_parallel, optim
    from tokenmill.trainer.flops import _per_token_gate_matrices, count_params
    from tokenmill.trainer.model import block_size
    from tokenmill.trainer.moe import expert_capacity

    tokens = batch_size * seq_len
    counts = count_params(cfg)
    m = cfg.moe
    remat_full = cfg.remat == "full"
    passes = 8 if remat_full else 6  # forward, (forward again,) backward x 2
    routed_active = counts.routed_expert_params * m.top_k / m.n_experts
    dense = counts.active_params + _per_token_gate_matrices(cfg) - routed_active
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
        capacity = expert_capacity(seq_len, m)
        padding = m.n_experts * capacity / (seq_len * m.top_k)
        # "bsec,bsd->ebcd" and "bsec,ebcd->bsd": 2 E C W FLOPs each per token forward, in every layer;
        # training runs the forward passes / 2 times over (3 or 4).
        forward = 2 * (2 * m.n_experts * capacity * width)
        dispatch_einsums = tokens * cfg.n_layers * forward * passes / 2
    else:
        padding = 1.0
    matrices = tokens * passes * (dense + routed_active * padding)
    blocked = block_size(seq_len, cfg.attention_block) < seq_len
    attention_passes = 3 + remat_full + blocked
    attention = tokens * cfg.n_layers * 4 * seq_len * cfg.n_heads * cfg.head_dim * attention_passes
    head_passes = 8 if block_size(seq_len, cfg.loss_block) < seq_len else 6
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
    expert axis (trainer/expert_parallel.py), else moe.dispatch under XLA's automatic partitioner."""
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


def xla_flops(compiled: Any) -> tuple[float, float]:
    """(XLA's cost analysis of the compiled step, the same with every loop body counted per iteration), per
    device.

    XLA's HloCostAnalysis counts a while loop's body once, whatever its trip count, so a scanned model's
    layers would count as one group. The second figure adds, for each while loop with a known trip count,
    (trips - 1) x the matmul FLOPs of its body (nested loops multiply), read from the compiled HLO: the
    matmuls are the FLOPs that matter, the body's elementwise work is counted once as XLA does.
    """
    analysis = compiled.cost_analysis()
    if isinstance(analysis, list):  # older JAX: one dict per executable
        analysis = analysis[0]
    raw = float(analysis.get("flops", 0.0))
    dots, calls = _hlo_dot_flops(compiled.as_text())
    once = _weighted(dots, calls, per_trip=False)
    per_trip = _weighted(dots, calls, per_trip=True)
    return raw, raw + per_trip - once


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"^\s*([\w\-]+)\((.*)$")
_SHAPE = re.compile(r"^[a-z0-9]+\[([0-9,]*)\]")
_CALLEES = re.compile(
    r"(calls|to_apply|body|branch_computations|called_computations)=\{?([^}),]+(?:,\s*%[\w.\-]+)*)"
)
_TRIPS = re.compile(r'"known_trip_count":\{"n":"([0-9]+)"')


def _hlo_dot_flops(text: str) -> tuple[dict[str, float], dict[str, list[tuple[str, int]]]]:
    """Per computation of an HLO module's text: the FLOPs of its dot instructions (2 x output elements x
    contracted size), and the computations it calls with their trip counts (a while body: its known trip
    count; anything else: 1)."""
    dots: dict[str, float] = {}
    calls: dict[str, list[tuple[str, int]]] = {}
    shapes: dict[str, list[int]] = {}
    current = None
    entry = None
    for line in text.splitlines():
        head = _COMPUTATION.match(line)
        if head and not line.startswith(" "):
            current = head.group(1)
            if line.startswith("ENTRY"):
                entry = current
            dots.setdefault(current, 0.0)
            calls.setdefault(current, [])
            # Parameters declared in the signature: "name: f32[2,3]".
            for name, dims in re.findall(r"([\w.\-]+):\s*[a-z0-9]+\[([0-9,]*)\]", line):
                shapes[name] = [int(d) for d in dims.split(",") if d]
            continue
        instruction = _INSTRUCTION.match(line)
        if current is None or not instruction:
            continue
        name, value = instruction.groups()
        shape_text, after = _split_shape(value)
        operation = _OPCODE.match(after)
        if not operation:
            continue
        opcode, rest = operation.groups()
        shape = _SHAPE.match(shape_text)
        if shape:
            shapes[name] = [int(d) for d in shape.group(1).split(",") if d]
        if opcode == "dot" and shape:
            operands = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
            contracting = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", rest)
            lhs = shapes.get(operands[0]) if operands else None
            if lhs is not None and contracting:
                contracted = math.prod(lhs[int(d)] for d in contracting.group(1).split(",") if d)
                dots[current] += 2.0 * math.prod(shapes[name]) * contracted
        trips = _TRIPS.search(rest)
        for kind, names in _CALLEES.findall(rest):
            for callee in re.findall(r"%?([\w.\-]+)", names):
                calls[current].append((callee, int(trips.group(1)) if kind == "body" and trips else 1))
    calls["__entry__"] = [(entry, 1)] if entry else []
    return dots, calls


def _split_shape(value: str) -> tuple[str, str]:
    """'f32[2,3]{1,0} dot(...)' -> ('f32[2,3]{1,0}', ' dot(...)'); a tuple shape '(s32[], f32[2]) while(...)'
    is taken whole, up to its closing parenthesis."""
    if value.startswith("("):
        depth = 0
        for index, char in enumerate(value):
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth == 0:
                return value[: index + 1], value[index + 1 :]
        return value, ""
    shape, _, after = value.partition(" ")
    return shape, after


def _weighted(dots: dict[str, float], calls: dict[str, list[tuple[str, int]]], per_trip: bool) -> float:
    """The entry computation's dot FLOPs with callees included, loop bodies once or once per trip."""
    memo: dict[str, float] = {}

    def cost(name: str) -> float:
        if name not in memo:
            memo[name] = dots.get(name, 0.0) + sum(
                (trips if per_trip else 1) * cost(callee) for callee, trips in calls.get(name, [])
            )
        return memo[name]

    return cost("__entry__")


def format_compile_report(report: dict) -> str:
    """The human-readable form of `compile_report`'s dict."""
    gb = 1e9
    memory = report["bytes_per_device"]
    mesh = ",".join(f"{axis}={size}" for axis, size in report["mesh"].items())
    lines = [
        f"{report['model']}: one train step on {report['devices']} devices (mesh {mesh}), "
        f"{report['batch_size']:,} x {report['seq_len']:,} tokens in {report['microbatches']} "
        f"microbatch{'es' if report['microbatches'] > 1 else ''}, dispatch {report['dispatch']}, "
        f"remat {report['remat']}, {report['optimizer']} with its state on {report['optimizer_state']}, "
        f"{report['compute_dtype']} compute",
        f"  compile_seconds      {report['compile_seconds']:.1f}",
        "  bytes_per_device     "
        + ", ".join(
            f"{key} {memory[key] / gb:.2f} GB" for key in ("arguments", "outputs", "temps", "total", "host")
        ),
        f"  xla_flops_per_step   {report['xla_flops_per_step']:.4e} (summed over devices; XLA's cost "
        f"analysis alone, loop bodies once: {report['xla_cost_analysis_flops_per_step']:.4e})",
        f"  model_flops_per_step {report['model_flops_per_step']:.4e} (the MFU count: 6 x active params + "
        f"causal attention, no head; XLA / this = {report['flops_ratio']:.3f})",
        f"  model_flops_executed {report['model_flops_executed']:.4e} (what the step runs: "
        + ", ".join(f"{key} {value:.3e}" for key, value in report["model_flops_executed_parts"].items())
        + f"; XLA / this = {report['flops_ratio_executed']:.3f}, "
        + ("within" if report["flops_agree"] else "NOT within")
        + f" {FLOPS_TOLERANCE:.0%})",
    ]
    limit = report["device_memory"]
    if report["fits"]:
        lines.append(
            f"  fits: {memory['total'] / gb:.1f} GB of {limit / gb:.0f} GB per device "
            f"({report['margin_bytes'] / gb:.1f} GB to spare)"
        )
    else:
        lines.append(
            f"  DOES NOT FIT: {memory['total'] / gb:.1f} GB per device, "
            f"{-report['margin_bytes'] / gb:.1f} GB over {limit / gb:.0f} GB. Options:"
        )
        lines += [f"    - {tip}" for tip in report["suggestions"]]
    return "\n".join(lines)
