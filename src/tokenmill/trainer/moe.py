"""The mixture-of-experts block: a router picks top_k experts per token, SwiGLU experts run, outputs combine.

What is here, top to bottom:
- `route`: fp32 router scores (sigmoid or softmax); the router bias shifts which experts are chosen but not
  the weights they are combined with, so it never receives a gradient (DeepSeek-V3's auxiliary-loss-free
  balancing). It also returns the per-expert load and the optional balance and z losses.
- two dispatches, chosen by `moe.dispatch`: "capacity" (GShard-style one-hot einsums with a fixed buffer per
  expert; tokens past the buffer are dropped and counted; fast on CPU and trivially shardable) and "dropless"
  (tokens sorted by expert and run through jax.lax.ragged_dot grouped matmuls; nothing dropped).
- `update_router_bias`: the bias update applied after each optimizer step, outside the optimizer.

Shapes: B batch, S sequence, D d_model, E experts, k top_k, H expert hidden, C capacity per expert per row.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from tokenmill.trainer.config import ModelConfig, MoEConfig

Params = dict[str, jax.Array]

# Mesh axes that split the batch: the expert axis holds different tokens outside the MoE block (as in
# DeepSeek/MaxText expert parallelism), so every device works on its own slice of the batch.
BATCH_AXES = ("data", "fsdp", "expert")


def constrain(x: jax.Array, *spec: object) -> jax.Array:
    """Pin an activation's sharding when a mesh is set; a no-op in single-device code and tests."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec(*spec))


def init_moe_params(key: jax.Array, cfg: ModelConfig) -> Params:
    """Router, routed experts ([E, ...] stacked) and the fused shared experts of one layer, in fp32."""
    m, d = cfg.moe, cfg.d_model
    keys = jax.random.split(key, 7)
    std = cfg.init_std
    # Output projections start smaller so that the residual stream does not grow with depth (GPT-2's trick).
    out_std = std / math.sqrt(2 * cfg.n_layers)

    def normal(k: jax.Array, shape: tuple[int, ...], scale: float) -> jax.Array:
        return scale * jax.random.normal(k, shape, jnp.float32)

    params = {
        "router": normal(keys[0], (d, m.n_experts), std),
        "w_gate": normal(keys[1], (m.n_experts, d, m.expert_hidden), std),
        "w_up": normal(keys[2], (m.n_experts, d, m.expert_hidden), std),
        "w_down": normal(keys[3], (m.n_experts, m.expert_hidden, d), out_std),
    }
    if m.shared_width:
        params["shared_gate"] = normal(keys[4], (d, m.shared_width), std)
        params["shared_up"] = normal(keys[5], (d, m.shared_width), std)
        params["shared_down"] = normal(keys[6], (m.shared_width, d), out_std)
    return params


class Routing(NamedTuple):
    expert_ids: jax.Array  # [T, k] int32
    weights: jax.Array  # [T, k] fp32, the unbiased scores of the chosen experts
    load: jax.Array  # [E] fp32, routed assignments per expert (before any capacity drop)
    quantile_bias: jax.Array  # [E] fp32, the bias that would have balanced this batch (quantile balancing)
    balance_loss: jax.Array  # scalar, Switch-style E * sum(f * P); 1.0 when perfectly balanced
    z_loss: jax.Array  # scalar, mean squared log-partition of the router logits


def route(x: jax.Array, router: jax.Array, bias: jax.Array, m: MoEConfig) -> Routing:
    """Choose top_k experts for each of T tokens x [T, D] (see the module docstring)."""
    # fp32 because top-k choices flip on small differences and the z-loss squares the logits.
    logits = x.astype(jnp.float32) @ router.astype(jnp.float32)
    scores = jax.nn.sigmoid(logits) if m.score_fn == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    biased = scores + jax.lax.stop_gradient(bias)
    top = min(m.top_k + 1, m.n_experts) if m.balancing == "quantile" else m.top_k
    top_values, top_ids = jax.lax.top_k(biased, top)
    expert_ids = top_ids[:, : m.top_k]
    weights = jnp.take_along_axis(scores, expert_ids, axis=-1)
    if m.normalize_weights:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-9)
    weights = weights * m.route_scale

    chosen = jax.nn.one_hot(expert_ids, m.n_experts, dtype=jnp.float32)  # [T, k, E]
    load = chosen.sum((0, 1))

    if m.balancing == "quantile":
        # Token t takes expert e iff scores[t, e] + bias[e] beats the best score it did not take (the
        # (k+1)-th). The bias that gives expert e exactly a k/E share of tokens is therefore the k/E quantile
        # of (cutoff - score) over tokens. Centred, since only differences between biases matter.
        cutoff = jax.lax.stop_gradient(top_values[:, m.top_k])
        required = cutoff[:, None] - jax.lax.stop_gradient(scores)
        quantile_bias = jnp.quantile(required, m.top_k / m.n_experts, axis=0)
        quantile_bias = quantile_bias - quantile_bias.mean()
    else:
        quantile_bias = jnp.zeros((m.n_experts,), jnp.float32)

    n_assignments = expert_ids.shape[0] * m.top_k
    fraction = jax.lax.stop_gradient(load) / n_assignments
    probs = scores / (scores.sum(-1, keepdims=True) + 1e-9)
    balance_loss = m.n_experts * jnp.sum(fraction * probs.mean(0))
    z_loss = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    return Routing(expert_ids, weights, load, quantile_bias, balance_loss, z_loss)


def swiglu(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    """A dense SwiGLU MLP (the shared experts)."""
    return (jax.nn.silu(x @ gate) * (x @ up)) @ down


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
    # The all-to-all: tokens leave their batch shard for the device that holds their expert.
    expert_in = constrain(expert_in, "expert", ("data", "fsdp"), None, None)
    hidden = jax.nn.silu(jnp.einsum("ebcd,edh->ebch", expert_in, params["w_gate"].astype(x.dtype)))
    hidden = hidden * jnp.einsum("ebcd,edh->ebch", expert_in, params["w_up"].astype(x.dtype))
    expert_out = jnp.einsum("ebch,ehd->ebcd", hidden, params["w_down"].astype(x.dtype))
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


class MoEStats(NamedTuple):
    load: jax.Array  # [E]
    dropped: jax.Array  # scalar int32
    quantile_bias: jax.Array  # [E]
    balance_loss: jax.Array
    z_loss: jax.Array


def moe_block(params: Params, x: jax.Array, bias: jax.Array, m: MoEConfig) -> tuple[jax.Array, MoEStats]:
    """The MoE MLP of one layer: x [B, S, D] -> y [B, S, D], plus routing statistics."""
    b, s, d = x.shape
    routing = route(x.reshape(b * s, d), params["router"], bias, m)
    dispatch = capacity_dispatch if m.dispatch == "capacity" else dropless_dispatch
    y, dropped = dispatch(x, routing, params, m)
    if m.shared_width:
        y = y + swiglu(
            x,
            params["shared_gate"].astype(x.dtype),
            params["shared_up"].astype(x.dtype),
            params["shared_down"].astype(x.dtype),
        )
    stats = MoEStats(routing.load, dropped, routing.quantile_bias, routing.balance_loss, routing.z_loss)
    return y, stats


def update_router_bias(bias: jax.Array, load: jax.Array, quantile_bias: jax.Array, m: MoEConfig) -> jax.Array:
    """The balancing step, after the optimizer's: bias [L, E] from this step's load [L, E].

    "bias": DeepSeek-V3's b += gamma * sign(mean load - load): overloaded experts become less attractive,
    underloaded ones more, by a fixed step whatever the size of the imbalance.
    "quantile": move towards the bias that would have balanced this batch exactly.
    """
    if m.balancing == "bias":
        return bias + m.bias_rate * jnp.sign(load.mean(-1, keepdims=True) - load)
    if m.balancing == "quantile":
        return bias + m.quantile_rate * (quantile_bias - bias)
    return bias
