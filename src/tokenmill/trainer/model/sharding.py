"""One device mesh with data, fsdp and expert axes, and the explicit sharding of every array on it.

- data: plain data parallelism (replicated weights); across slices or hosts with slow links.
- fsdp: the batch is split and the weights are split too, gathered per layer when used (ZeRO-3).
- expert: routed experts are split by expert; outside the MoE block this axis splits the batch as well,
  and the dense matrices with fsdp's (so expert=64 alone is the reference run's EP64 over a rack).

The same code runs on one CPU (a 1x1x1 mesh) and on many hosts (after jax.distributed.initialize, see
tokenmill.trainer.run.distributed, the mesh spans every process's devices). Parameter shardings are written
out here by name; activations are pinned in transformer.py and moe.py with `constrain`, and XLA's
partitioner fills in the collectives.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tokenmill.trainer.model.layers import BATCH_AXES
from tokenmill.trainer.model.transformer import layer_axes

log = logging.getLogger(__name__)

AXES = ("data", "fsdp", "expert")


def parse_mesh_shape(text: str | None, n_devices: int) -> tuple[int, int, int]:
    """'data,fsdp,expert' sizes; one of them may be -1 (the rest of the devices). Default: all on fsdp."""
    if not text:
        return (1, n_devices, 1)
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError as error:
        raise ValueError(f"mesh {text!r}: expected three integers data,fsdp,expert") from error
    if len(sizes) != 3 or sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"mesh {text!r}: expected three positive sizes data,fsdp,expert (one may be -1)")
    if -1 in sizes:
        known = int(np.prod([s for s in sizes if s != -1]))
        if n_devices % known:
            raise ValueError(f"mesh {text!r} does not divide {n_devices} devices")
        sizes[sizes.index(-1)] = n_devices // known
    if int(np.prod(sizes)) > n_devices:
        raise ValueError(f"mesh {text!r} needs {int(np.prod(sizes))} devices, but {n_devices} are available")
    return tuple(sizes)  # type: ignore[return-value]


def make_mesh(shape: tuple[int, int, int], devices: list | None = None) -> Mesh:
    """A mesh with axes data, fsdp, expert over `devices` (default: all of them, every process's; a smaller
    mesh on one process takes the first devices, for comparing against fewer devices)."""
    size = int(np.prod(shape))
    if devices is None:
        devices = jax.devices()
        if size < len(devices):
            if jax.process_count() > 1:
                raise ValueError(
                    f"a mesh of {size} devices must use all {len(devices)} devices of a multi-host job"
                )
            devices = devices[:size]
    # Auto axes: shardings are given for parameters, state and batch, and pinned at a few activations;
    # XLA's partitioner propagates the rest (Explicit axes would demand a sharding on every operation).
    axis_types = (AxisType.Auto,) * len(AXES)
    if list(devices) == jax.devices():
        return jax.make_mesh(shape, AXES, axis_types=axis_types)
    return Mesh(np.asarray(devices).reshape(shape), AXES, axis_types=axis_types)


def _fits(dim: int, mesh: Mesh, axes: str | tuple[str, ...]) -> bool:
    names = (axes,) if isinstance(axes, str) else axes
    return dim % int(np.prod([mesh.shape[a] for a in names])) == 0


def _dense_axes(dim: int, mesh: Mesh) -> str | tuple[str, str] | None:
    """The axes a dense matrix's d_model side is split over: fsdp and expert together where they divide it.

    The expert axis splits the batch outside the MoE block, so a dense weight left whole on it would be a
    replica on every expert shard, with its gradient all-reduced over them: under expert parallelism across
    a rack (expert=64, fsdp=1) that is the 535B's 14B dense parameters in fp32 on every device, with their
    gradients and accumulator. Split over both axes it is ZeRO-3 over every device that holds other
    tokens, gathered per layer in bf16 like fsdp's shards. Only the data axis holds replicas."""
    if _fits(dim, mesh, ("fsdp", "expert")) and mesh.shape["expert"] > 1:
        return ("fsdp", "expert")
    return "fsdp" if _fits(dim, mesh, "fsdp") else None


def param_spec(path: tuple, leaf: Any, mesh: Mesh) -> P:
    """The sharding of one parameter, by name: experts by expert (and fsdp), matrices by fsdp on d_model.

    Stacked layers' leading repeat axis is never split: the scan takes one slice per step, and a split
    would make every device wait for the one holding that layer."""
    name = jax.tree_util.keystr(path)
    stacked = layer_axes(path)
    shape = leaf.shape[stacked:]
    return P(*([None] * stacked), *_layer_spec(name, shape, mesh))


def _layer_spec(name: str, shape: tuple[int, ...], mesh: Mesh) -> tuple:
    if name.endswith("['w_gate']") or name.endswith("['w_up']") or name.endswith("['w_down']"):
        experts = "expert" if _fits(shape[0], mesh, "expert") else None
        inner = "fsdp" if _fits(shape[1], mesh, "fsdp") else None
        return (experts, inner, None)
    if len(shape) == 2:
        # Shard the d_model side: rows of the input projections, columns of the embedding.
        d_axis = 1 if name.startswith("['embed']") else 0
        if name.endswith("['wo']") or name.endswith("['shared_down']"):
            d_axis = 1
        spec: list = [None, None]
        spec[d_axis] = _dense_axes(shape[d_axis], mesh)
        return tuple(spec)
    return ()  # norms' scales and other vectors: replicated, they are tiny


def param_shardings(params: Any, mesh: Mesh) -> Any:
    """NamedShardings for a parameter pytree (or any pytree shaped like one, such as Adam's moments)."""
    return jax.tree_util.tree_map_with_path(lambda p, x: NamedSharding(mesh, param_spec(p, x, mesh)), params)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows of the batch across every mesh axis; sequence positions stay together."""
    return NamedSharding(mesh, P(BATCH_AXES, None))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def state_shardings(state: Any, params_sharding: Any, mesh: Mesh, optimizer_memory: str = "device") -> Any:
    """Shardings for the whole train state {step, params, opt_state, router_bias, guard}.

    An optimizer-state leaf that holds one number per parameter (Adam's moments, Muon's momentum, under
    whatever wrapper optax puts them: a partition's masked trees, a chain's tuple) is found by its path,
    which ends with the parameter's path, and is sharded like that parameter. The layers' state
    (optim.LayerwiseOptimizer: `opt_state["layers"][g]` is group g's state, stacked over its repeats) ends
    with the parameter's path inside its group. Everything else (counts, the step, the router bias) is
    replicated. optimizer_memory "pinned_host" keeps the whole optimizer state in the host's pinned memory
    (the update brings it to the device a slice at a time), as the reference run did.
    """
    by_path = {
        jax.tree_util.keystr(path): (leaf.shape, sharding)
        for (path, leaf), sharding in zip(
            jax.tree_util.tree_flatten_with_path(state["params"])[0],
            jax.tree.leaves(params_sharding),
            strict=True,
        )
    }

    def optimizer_leaf(path: tuple, leaf: Any) -> NamedSharding:
        group = path[:2] if layer_axes(path) else ()  # ("layers", g)
        for start in range(len(path)):
            found = by_path.get(jax.tree_util.keystr(group + path[start:]))
            if found is not None and found[0] == leaf.shape:
                return found[1].with_memory_kind(optimizer_memory)
        return NamedSharding(mesh, P(), memory_kind=optimizer_memory)

    return {
        "step": replicated(mesh),
        "params": params_sharding,
        "opt_state": jax.tree_util.tree_map_with_path(optimizer_leaf, state["opt_state"]),
        "router_bias": replicated(mesh),
        # The step guard's window (run/guard.py), where the state has one: a few numbers, on every device.
        **({"guard": jax.tree.map(lambda _: replicated(mesh), state["guard"])} if "guard" in state else {}),
    }


def device_memory(shardings: Any) -> Any:
    """The same shardings in device memory: where the train step computes on state kept on the host."""
    return jax.tree.map(lambda sharding: sharding.with_memory_kind("device"), shardings)
