"""Expert parallelism: the routed experts of one MoE layer under jax.shard_map, tokens moved by all-to-all.

Used by `moe.moe_block` when the ambient mesh has an `expert` axis larger than one and `moe.expert_parallel`
is on; otherwise moe.py's single-device dispatches run, the reference this is tested against. Each device
routes its own tokens, sends each copy to its expert's device over the `expert` axis, runs SwiGLU there and
sends the results back: a dense "capacity" transport or jax.lax.ragged_all_to_all ("dropless", with a
capacity fallback where the backend lacks it). Layout, transports, memory and communication at scale:
docs/trainer.md, "Parallel layout".
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from tokenmill.trainer.model.layers import BATCH_AXES, Params
from tokenmill.trainer.model.router import MoEStats, Routing, route
from tokenmill.trainer.model.shape import MoEConfig

log = logging.getLogger(__name__)

EXPERT_AXIS = "expert"
# The named scope around the collectives that carry tokens to their experts and back: `tokenmill model
# compile` finds the dispatch's bytes by it in the compiled HLO's op_name (run/collectives.py).
DISPATCH_SCOPE = "expert_dispatch"

# "capacity": fixed cells; "capacity_dropless": the CPU fallback of dropless (cells that cannot overflow);
# "ragged": jax.lax.ragged_all_to_all; "ragged_emulated": the same exchange built from a dense all_to_all,
# for checking the ragged path's bookkeeping on backends without the collective (its buffers are E times
# the copies).
Transport = Literal["capacity", "capacity_dropless", "ragged", "ragged_emulated"]


def expert_axis_size() -> int:
    """The size of the ambient mesh's `expert` axis (1 without a mesh or without the axis)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or EXPERT_AXIS not in mesh.axis_names:
        return 1
    return int(mesh.shape[EXPERT_AXIS])


def enabled(m: MoEConfig) -> bool:
    """Whether moe_block runs the routed experts expert-parallel: an expert axis > 1 and the option on."""
    return m.expert_parallel and expert_axis_size() > 1


@functools.cache
def ragged_all_to_all_supported(platform: str) -> bool:
    """Whether XLA on `platform` compiles jax.lax.ragged_all_to_all: a one-device probe, compiled once.

    It runs in a thread of its own because it is usually asked while the train step is being traced, and
    the tracing thread's context (the ambient mesh, the trace) must not leak into the probe's compilation.
    """
    outcome: list[bool] = []
    probe_thread = threading.Thread(target=lambda: outcome.append(_compile_ragged_probe(platform)))
    probe_thread.start()
    probe_thread.join()
    return bool(outcome and outcome[0])


def _compile_ragged_probe(platform: str) -> bool:
    device = jax.devices(platform)[0]
    mesh = jax.sharding.Mesh(np.asarray([device]), ("probe",), axis_types=(jax.sharding.AxisType.Auto,))

    def probe(x: jax.Array) -> jax.Array:
        sizes = jnp.full((1,), x.shape[0], jnp.int32)
        offsets = jnp.zeros((1,), jnp.int32)
        return jax.lax.ragged_all_to_all(
            x, jnp.zeros_like(x), offsets, sizes, offsets, sizes, axis_name="probe"
        )

    mapped = jax.shard_map(probe, mesh=mesh, in_specs=P("probe"), out_specs=P("probe"))
    try:
        jax.jit(mapped).lower(jax.ShapeDtypeStruct((4, 2), jnp.float32)).compile()
    except Exception as error:  # XLA reports an unimplemented opcode as an error at compile time
        log.debug("ragged_all_to_all on %s: %s", platform, error)
        return False
    return True


def choose_transport(m: MoEConfig) -> Transport:
    """The transport `moe.dispatch` asks for on this backend (see the module docstring)."""
    if m.dispatch == "capacity":
        return "capacity"
    platform = jax.default_backend()
    if ragged_all_to_all_supported(platform):
        return "ragged"
    _log_fallback_once(platform, m.n_experts / m.top_k)
    return "capacity_dropless"


@functools.cache
def _log_fallback_once(platform: str, buffer_ratio: float) -> None:
    log.warning(
        "dropless dispatch: XLA on %s does not implement ragged_all_to_all, so the expert-parallel "
        "all-to-all uses capacity cells of one slot per local token (nothing is dropped; the buffer is "
        "E/k = %.1fx the routed copies)",
        platform,
        buffer_ratio,
    )


def shard_capacity(tokens: int, m: MoEConfig) -> int:
    """Slots per (sender shard x expert) cell: capacity_factor x the balanced share, at most one a token."""
    return max(1, min(tokens, math.ceil(m.capacity_factor * tokens * m.top_k / m.n_experts)))


def receive_rows(tokens: int, group_size: int, m: MoEConfig) -> int:
    """Rows of a device's ragged receive buffer, for `tokens` a device and `group_size` devices on the
    expert axis: the factor x the balanced share, or the worst case (every copy of the group comes here)."""
    worst = group_size * tokens * min(m.top_k, m.n_experts // group_size)
    if m.receive_capacity_factor is None:
        return worst
    return max(1, min(worst, math.ceil(m.receive_capacity_factor * tokens * m.top_k)))


def routed_experts(
    params: Params,
    x: jax.Array,
    expert_in: jax.Array,
    bias: jax.Array,
    m: MoEConfig,
    transport: Transport | None = None,
) -> tuple[jax.Array, MoEStats]:
    """Route x [B, S, D] and run the routed experts on expert_in [B, S, W] expert-parallel on the ambient
    mesh; returns (the combined routed output [B, S, W], the layer's statistics over the global batch).

    `transport` overrides the choice made from `m.dispatch` and the backend (tests use "ragged_emulated").
    """
    mesh = jax.sharding.get_abstract_mesh()
    n_experts_axis = expert_axis_size()
    token_axes = tuple(axis for axis in BATCH_AXES if axis in mesh.axis_names)
    n_token_shards = math.prod(int(mesh.shape[axis]) for axis in token_axes)
    if m.n_experts % n_experts_axis:
        raise ValueError(
            f"expert parallelism: {m.n_experts} experts do not split over an expert axis of {n_experts_axis}"
        )
    if x.shape[0] % n_token_shards:
        raise ValueError(
            f"expert parallelism: a batch of {x.shape[0]} rows does not split over the {n_token_shards} "
            f"devices of the batch axes {token_axes}"
        )
    transport = transport or choose_transport(m)
    rows = P(token_axes, None, None)
    by_expert = P(EXPERT_AXIS, None, None)
    body = functools.partial(_local_routed_experts, m=m, transport=transport, token_axes=token_axes)
    mapped = jax.shard_map(
        body,
        in_specs=(rows, rows, P(), P(), by_expert, by_expert, by_expert),
        out_specs=(rows, MoEStats(P(), P(), P(), P(), P())),
    )
    return mapped(x, expert_in, params["router"], bias, params["w_gate"], params["w_up"], params["w_down"])


class SortedCopies(NamedTuple):
    """A device's T*k token copies in expert order (first choices before second choices within an expert)."""

    expert: jax.Array  # [T*k] int32, ascending
    token: jax.Array  # [T*k] int32, the local token each copy is of
    weight: jax.Array  # [T*k] fp32 combine weight
    position: jax.Array  # [T*k] int32, the copy's place among its expert's copies on this device
    counts: jax.Array  # [E] int32 copies per expert
    starts: jax.Array  # [E] int32 where each expert's copies begin


def sort_copies(routing: Routing, n_experts: int) -> SortedCopies:
    """Sort the copies of routing [T, k] by expert: O(T k log) work and [T k] arrays, no one-hot."""
    t, k = routing.expert_ids.shape
    # Choice-major: the stable sort then keeps every first choice ahead of any second choice of an expert,
    # so a full cell drops tokens' weaker choices first (moe.capacity_dispatch's priority).
    flat = routing.expert_ids.T.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    expert = flat[order]
    counts = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
    starts = jnp.cumsum(counts) - counts
    token, choice = order % t, order // t
    weight = routing.weights[token, choice]
    position = jnp.arange(t * k, dtype=jnp.int32) - starts[expert]
    return SortedCopies(expert, token, weight, position, counts, starts)


def _local_routed_experts(
    x: jax.Array,
    expert_in: jax.Array,
    router: jax.Array,
    bias: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    m: MoEConfig,
    transport: Transport,
    token_axes: tuple[str, ...],
) -> tuple[jax.Array, MoEStats]:
    """One device's share, inside shard_map: its rows, its experts' weights [E/n, ...]."""
    b, s, d = x.shape
    width = expert_in.shape[-1]
    dtype = expert_in.dtype
    routing = route(x.reshape(b * s, d), router, bias, m, token_axes)
    copies = sort_copies(routing, m.n_experts)
    tokens = expert_in.reshape(b * s, width)
    weights = (w_gate.astype(dtype), w_up.astype(dtype), w_down.astype(dtype))
    if transport in ("capacity", "capacity_dropless"):
        capacity = b * s if transport == "capacity_dropless" else shard_capacity(b * s, m)
        rows, kept = capacity_exchange(tokens, copies, weights, capacity)
    else:
        rows, kept = ragged_exchange(tokens, copies, weights, m, emulated=transport == "ragged_emulated")
    # A dropped copy's row is zero already; the mask also keeps its weight out of the gradient.
    combine = jnp.where(kept, copies.weight, 0.0).astype(dtype)
    y = jax.ops.segment_sum(rows * combine[:, None], copies.token, num_segments=b * s)
    dropped = jax.lax.psum(jnp.sum(~kept).astype(jnp.int32), token_axes)
    stats = MoEStats(routing.load, dropped, routing.quantile_bias, routing.balance_loss, routing.z_loss)
    return y.reshape(b, s, width), stats


def _swiglu_experts(x: jax.Array, weights: tuple[jax.Array, jax.Array, jax.Array], spec: str) -> jax.Array:
    gate, up, down = weights
    inner, outer = spec.split("->")
    hidden = jax.nn.silu(jnp.einsum(f"{inner},lwh->{outer}", x, gate)) * jnp.einsum(
        f"{inner},lwh->{outer}", x, up
    )
    return jnp.einsum(f"{outer},lhw->{inner}", hidden, down)


def capacity_exchange(
    tokens: jax.Array,
    copies: SortedCopies,
    weights: tuple[jax.Array, jax.Array, jax.Array],
    capacity: int,
) -> tuple[jax.Array, jax.Array]:
    """The dense transport: [E, C, W] cells out, experts, cells back. Returns (each sorted copy's expert
    output [T*k, W], whether it was kept [T*k])."""
    n = jax.lax.axis_size(EXPERT_AXIS)
    n_local = weights[0].shape[0]
    n_experts, width = n * n_local, tokens.shape[-1]
    kept = copies.position < capacity
    slot = jnp.where(kept, copies.position, capacity)  # out of range: the scatter drops it
    cells = jnp.zeros((n_experts, capacity, width), tokens.dtype)
    cells = cells.at[copies.expert, slot].set(tokens[copies.token], mode="drop")
    # Experts are blocks of n_local on consecutive devices, as the weights are sharded: chunk j of the
    # expert dimension goes to device j, and what arrives is [(sender, local expert), C, W].
    with jax.named_scope(DISPATCH_SCOPE):
        arrived = jax.lax.all_to_all(cells, EXPERT_AXIS, 0, 0, tiled=True)
    arrived = arrived.reshape(n, n_local, capacity, width)
    out = _swiglu_experts(arrived, weights, "nlcw->nlch").reshape(n_experts, capacity, width)
    with jax.named_scope(DISPATCH_SCOPE):
        back = jax.lax.all_to_all(out, EXPERT_AXIS, 0, 0, tiled=True)  # [E, C, W] in this device's order
    rows = back[copies.expert, jnp.minimum(copies.position, capacity - 1)]
    return jnp.where(kept[:, None], rows, 0), kept


def emulated_ragged_all_to_all(
    operand: jax.Array,
    output: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    *,
    axis_name: str,
) -> jax.Array:
    """jax.lax.ragged_all_to_all's semantics from a dense all_to_all: every slice is padded to the operand's
    length, so the buffer is (number of slices) x the operand. For checking the ragged bookkeeping where XLA
    lacks the collective (CPU), not for scale."""
    length = operand.shape[0]
    row = jnp.arange(length, dtype=jnp.int32)
    source = jnp.minimum(input_offsets[:, None] + row, length - 1)
    sent = (row < send_sizes[:, None]).reshape(*source.shape, *(1,) * (operand.ndim - 1))
    packed = jnp.where(sent, operand[source], 0)
    arrived = jax.lax.all_to_all(packed, axis_name, 0, 0, tiled=True)
    placed_at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    target = jnp.where(row < recv_sizes[:, None], placed_at[:, None] + row, output.shape[0])
    return output.at[target].set(arrived, mode="drop")


def ragged_exchange(
    tokens: jax.Array,
    copies: SortedCopies,
    weights: tuple[jax.Array, jax.Array, jax.Array],
    m: MoEConfig,
    emulated: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """The ragged transport: exactly the routed copies out, grouped matmuls, back. Returns (each sorted
    copy's expert output [T*k, W], whether it was kept [T*k]).

    Receiver d lays out what it gets expert-major: for each of its experts l, the copies from sender 0,
    then sender 1, ..., so that the buffer is a sequence of per-expert groups for ragged_dot. Slice (s, l)
    therefore starts at (copies for d's experts before l, from everyone) + (copies for l from senders
    before s). Every device computes that layout from the all-gathered count matrix, so senders know where
    their slices land and what the receiver's limit R cuts off (the tail of the buffer, i.e. the last
    experts' last senders' last copies; within a slice the weaker choices).
    """
    n = jax.lax.axis_size(EXPERT_AXIS)
    me = jax.lax.axis_index(EXPERT_AXIS)
    n_local = weights[0].shape[0]
    n_experts, width = n * n_local, tokens.shape[-1]
    n_copies = copies.expert.shape[0]
    t = n_copies // m.top_k
    limit = receive_rows(t, n, m)

    with jax.named_scope(DISPATCH_SCOPE):
        counts = jax.lax.all_gather(copies.counts, EXPERT_AXIS)  # [sender, E]
    cells = counts.reshape(n, n, n_local)  # [sender, receiver, local expert]
    per_expert = cells.sum(0)  # [receiver, local expert]
    offset = (jnp.cumsum(per_expert, 1) - per_expert)[None] + (jnp.cumsum(cells, 0) - cells)
    kept_cells = jnp.clip(limit - offset, 0, cells)  # [sender, receiver, local expert]
    sender_starts = jnp.cumsum(counts, 1) - counts  # [sender, E]: where each expert's copies begin

    exchange = emulated_ragged_all_to_all if emulated else jax.lax.ragged_all_to_all
    send_sizes = kept_cells[me].reshape(n_experts)
    arriving = kept_cells[:, me].reshape(n * n_local)  # slice i = (sender i // n_local, expert i % n_local)
    with jax.named_scope(DISPATCH_SCOPE):
        arrived = exchange(
            tokens[copies.token],
            jnp.zeros((limit, width), tokens.dtype),
            copies.starts,
            send_sizes,
            offset[me].reshape(n_experts),
            arriving,
            axis_name=EXPERT_AXIS,
        )
    group_sizes = kept_cells[:, me].sum(0)  # [local expert]; rows past their sum are unused padding

    def grouped(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        return jax.lax.ragged_dot(lhs, rhs, group_sizes)

    gate, up, down = weights
    out = grouped(jax.nn.silu(grouped(arrived, gate)) * grouped(arrived, up), down)
    my_experts = me * n_local + jnp.arange(n_local, dtype=jnp.int32)
    with jax.named_scope(DISPATCH_SCOPE):
        back = exchange(
            out,
            jnp.zeros((n_copies, width), tokens.dtype),
            offset[:, me].reshape(n * n_local),
            arriving,
            jnp.take(sender_starts, my_experts, axis=1).reshape(n * n_local),
            send_sizes,
            axis_name=EXPERT_AXIS,
        )
    kept = copies.position < send_sizes[copies.expert]
    return back, kept
