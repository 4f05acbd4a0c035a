"""The mixture-of-experts block: routed SwiGLU experts (two single-device dispatches), the optional latent
projection around them (LatentMoE) and the shared experts.

"capacity" dispatch: GShard-style one-hot einsums with a fixed buffer per expert (tokens past it are dropped
and counted); "dropless": tokens sorted by expert through jax.lax.ragged_dot, nothing dropped. On a mesh
with an `expert` axis larger than one the routed experts run expert-parallel instead (expert_parallel.py),
and these dispatches are the reference it is tested against. Routing is router.py.

Shapes: B batch, S sequence, D d_model (or latent_dim inside the routed experts), E experts, k top_k,
H expert hidden, C capacity per expert per row.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from tokenmill.trainer.model import expert_parallel
from tokenmill.trainer.model.layers import Params, constrain, init_matrix, output_std, rms_norm, swiglu
from tokenmill.trainer.model.router import MoEStats, Routing, route
from tokenmill.trainer.model.shape import ModelConfig, MoEConfig


def init_moe_params(key: jax.Array, cfg: ModelConfig) -> Params:
    """Router, routed experts ([E, ...] stacked), latent projections and shared experts of one layer, fp32."""
    m, d = cfg.moe, cfg.d_model
    keys = jax.random.split(key, 7)
    std, out_std = cfg.weight_std, output_std(cfg)
    width = m.latent_dim or d  # what the routed experts read and write

    def normal(k: jax.Array, shape: tuple[int, ...], scale: float) -> jax.Array:
        return init_matrix(cfg, k, shape, scale)

    params = {
        "router": normal(keys[0], (d, m.n_experts), std),
        "w_gate": normal(keys[1], (m.n_experts, width, m.expert_hidden), std),
        "w_up": normal(keys[2], (m.n_experts, width, m.expert_hidden), std),
        # With a latent space, latent_up is what writes into the residual stream, not w_down.
        "w_down": normal(keys[3], (m.n_experts, m.expert_hidden, width), std if m.latent_dim else out_std),
    }
    if m.latent_dim:
        # Keys folded in rather than split: shapes without these pieces draw the same weights as before.
        key_down, key_up = jax.random.split(jax.random.fold_in(key, 1), 2)
        params["latent_down"] = normal(key_down, (d, m.latent_dim), std)
        params["latent_norm"] = jnp.ones((m.latent_dim,), jnp.float32)
        params["latent_up"] = normal(key_up, (m.latent_dim, d), out_std)
    if m.shared_hidden_total and m.separate_shared_experts:
        hidden = m.shared_expert_hidden
        # A list of separate SwiGLUs; the keys keep the fused names so that sharding treats them alike.
        params["shared_experts"] = [
            {
                "shared_gate": normal(kg, (d, hidden), std),
                "shared_up": normal(ku, (d, hidden), std),
                "shared_down": normal(kd, (hidden, d), out_std),
            }
            for kg, ku, kd in jax.random.split(jax.random.fold_in(key, 2), (m.n_shared_experts, 3))
        ]
    elif m.shared_hidden_total:
        params["shared_gate"] = normal(keys[4], (d, m.shared_hidden_total), std)
        params["shared_up"] = normal(keys[5], (d, m.shared_hidden_total), std)
        params["shared_down"] = normal(keys[6], (m.shared_hidden_total, d), out_std)
    return params


def expert_capacity(tokens_per_row: int, m: MoEConfig) -> int:
    """Slots per expert per batch row: capacity_factor x the balanced share, at most one per token."""
    return max(1, min(tokens_per_row, math.ceil(m.capacity_factor * tokens_per_row * m.top_k / m.n_experts)))


def capacity_dispatch(
    x: jax.Array, routing: Routing, params: Params, m: MoEConfig
) -> tuple[jax.Array, jax.Array]:
    """Run the experts with a fixed buffer per expert per batch row; returns (y [B, S, D], dropped count).

    Each batch row is its own dispatch group, so the result does not depend on how the batch is sharded.
    Within a row, first choices claim buffer slots before second choices (GShard's priority), so a full
    expert drops a token's weaker choices first.
    """
    b, s, d = x.shape
    k, e = m.top_k, m.n_experts
    capacity = expert_capacity(s, m)
    ids = routing.expert_ids.reshape(b, s, k)
    weights = routing.weights.reshape(b, s, k)

    chosen = jax.nn.one_hot(ids, e, dtype=jnp.int32)  # [B, S, k, E]
    slot_major = chosen.transpose(0, 2, 1, 3).reshape(b, k * s, e)
    position = (jnp.cumsum(slot_major, axis=1) - 1).reshape(b, k, s, e).transpose(0, 2, 1, 3)
    position = jnp.sum(position * chosen, axis=-1)  # [B, S, k]: this assignment's slot in its expert
    kept = position < capacity
    dropped = jnp.sum(~kept)

    slot = jax.nn.one_hot(position, capacity, dtype=x.dtype) * kept[..., None].astype(x.dtype)
    chosen = chosen.astype(x.dtype)
    dispatch = jnp.einsum("bske,bskc->bsec", chosen, slot)
    combine = jnp.einsum("bske,bskc,bsk->bsec", chosen, slot, weights.astype(x.dtype))

    expert_in = jnp.einsum("bsec,bsd->ebcd", dispatch, x)
    # The all-to-all: tokens leave their batch shard for the device that holds their expert (the scope
    # names the partitioner's collective for `model compile`'s count, run/collectives.py).
    with jax.named_scope(expert_parallel.DISPATCH_SCOPE):
        expert_in = constrain(expert_in, "expert", ("data", "fsdp"), None, None)
    hidden = jax.nn.silu(jnp.einsum("ebcd,edh->ebch", expert_in, params["w_gate"].astype(x.dtype)))
    hidden = hidden * jnp.einsum("ebcd,edh->ebch", expert_in, params["w_up"].astype(x.dtype))
    expert_out = jnp.einsum("ebch,ehd->ebcd", hidden, params["w_down"].astype(x.dtype))
    with jax.named_scope(expert_parallel.DISPATCH_SCOPE):
        expert_out = constrain(expert_out, "expert", ("data", "fsdp"), None, None)
    y = jnp.einsum("bsec,ebcd->bsd", combine, expert_out)
    return y, dropped


def dropless_dispatch(
    x: jax.Array, routing: Routing, params: Params, m: MoEConfig
) -> tuple[jax.Array, jax.Array]:
    """Run every assignment: sort (token, expert) pairs by expert and use grouped matmuls (ragged_dot).

    On a multi-device mesh this runs under XLA's automatic partitioner, which is correct but not an
    expert-parallel all-to-all; the capacity dispatch is the one that shards by expert explicitly.
    """
    b, s, d = x.shape
    k, e = m.top_k, m.n_experts
    flat_x = x.reshape(b * s, d)
    flat_ids = routing.expert_ids.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)
    token_of = order // k
    sorted_x = flat_x[token_of]
    group_sizes = jnp.bincount(flat_ids, length=e).astype(jnp.int32)

    def grouped(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        return jax.lax.ragged_dot(lhs, rhs.astype(lhs.dtype), group_sizes)

    hidden = jax.nn.silu(grouped(sorted_x, params["w_gate"])) * grouped(sorted_x, params["w_up"])
    out = grouped(hidden, params["w_down"])
    out = out * routing.weights.reshape(-1)[order][:, None].astype(out.dtype)
    y = jnp.zeros_like(flat_x).at[token_of].add(out)
    return y.reshape(b, s, d), jnp.zeros((), jnp.int32)


def moe_block(
    params: Params, x: jax.Array, bias: jax.Array, m: MoEConfig, norm_eps: float = 1e-5
) -> tuple[jax.Array, MoEStats]:
    """The MoE MLP of one layer: x [B, S, D] -> y [B, S, D], plus routing statistics.

    With a latent space the router reads x, the routed experts read RMSNorm(x @ latent_down) and their
    weighted sum is mapped back by latent_up; the shared experts read x.

    The routed experts run expert-parallel (expert_parallel.py: every device routes its own tokens and an
    all-to-all carries them to the experts' devices) when the ambient mesh has an `expert` axis larger than
    one and `moe.expert_parallel` is on; otherwise the dispatches above run, which are the reference that
    the expert-parallel path is tested against. The latent projections and the shared experts are dense
    and stay with XLA's automatic partitioner either way.
    """
    b, s, d = x.shape
    expert_in = x
    if m.latent_dim:
        # Narrow before dispatch so that the all-to-all carries latent_dim-wide rows both ways; the norm
        # keeps the experts' input scale independent of latent_down's.
        expert_in = x @ params["latent_down"].astype(x.dtype)
        expert_in = rms_norm(expert_in, params["latent_norm"], norm_eps)
    if expert_parallel.enabled(m):
        y, stats = expert_parallel.routed_experts(params, x, expert_in, bias, m)
    else:
        routing = route(x.reshape(b * s, d), params["router"], bias, m)
        dispatch = capacity_dispatch if m.dispatch == "capacity" else dropless_dispatch
        y, dropped = dispatch(expert_in, routing, params, m)
        stats = MoEStats(routing.load, dropped, routing.quantile_bias, routing.balance_loss, routing.z_loss)
    if m.latent_dim:
        y = y @ params["latent_up"].astype(x.dtype)
    shared = params.get("shared_experts", [params] if m.shared_hidden_total else [])
    for expert in shared:
        y = y + swiglu(
            x,
            expert["shared_gate"].astype(x.dtype),
            expert["shared_up"].astype(x.dtype),
            expert["shared_down"].astype(x.dtype),
        )
    return y, stats
