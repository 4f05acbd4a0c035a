"""The mixture-of-experts block: a router picks top_k experts per token, SwiGLU experts run, outputs combine.

What is here, top to bottom:
- `rms_norm`, shared with model.py (the latent experts normalise their input too).
- `route`: fp32 router scores (sigmoid or softmax); the router bias shifts which experts are chosen but not
  the weights they are combined with, so it never receives a gradient (DeepSeek-V3's auxiliary-loss-free
  balancing). The bias is added to the scores or, with `bias_space: logit`, to the logits (Marin). It also
  returns the per-expert load, the quantile-balancing bias and the optional balance and z losses.
- two dispatches, chosen by `moe.dispatch`: "capacity" (GShard-style one-hot einsums with a fixed buffer per
  expert; tokens past the buffer are dropped and counted; fast on CPU and trivially shardable) and "dropless"
  (tokens sorted by expert and run through jax.lax.ragged_dot grouped matmuls; nothing dropped).
- `moe_block`: routing, the optional latent projection around the routed experts (LatentMoE), the dispatch
  and the shared experts. On a mesh with an `expert` axis larger than one the routing and the routed
  experts run expert-parallel instead (expert_parallel.py: shard_map, all-to-all); the two dispatches here
  are the single-device reference it is tested against.
- `update_router_bias`: the bias update applied after each optimizer step, outside the optimizer.

Shapes: B batch, S sequence, D d_model (or latent_dim inside the routed experts), E experts, k top_k,
H expert hidden, C capacity per expert per row.
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


def rms_norm(x: jax.Array, scale: jax.Array | None, eps: float) -> jax.Array:
    """RMSNorm in fp32 (the mean of squares underflows in bf16), returned in x's dtype; no scale: plain."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if scale is not None:
        normed = normed * scale
    return normed.astype(x.dtype)


def init_matrix(cfg: ModelConfig, key: jax.Array, shape: tuple[int, ...], std: float) -> jax.Array:
    """One fp32 weight matrix: normal, or truncated at +-3 standard units (then scaled), times std."""
    if cfg.init_truncated:
        return std * jax.random.truncated_normal(key, -3.0, 3.0, shape, jnp.float32)
    return std * jax.random.normal(key, shape, jnp.float32)


def output_std(cfg: ModelConfig) -> float:
    """Init std of matrices that write into the residual stream."""
    # Smaller, so that the residual stream does not grow with depth (GPT-2's trick), unless turned off.
    std = cfg.weight_std
    return std / math.sqrt(2 * cfg.n_layers) if cfg.init_scale_outputs else std


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
    if m.shared_width and m.separate_shared_experts:
        hidden = m.shared_hidden_width
        # A list of separate SwiGLUs; the keys keep the fused names so that sharding treats them alike.
        params["shared_experts"] = [
            {
                "shared_gate": normal(kg, (d, hidden), std),
                "shared_up": normal(ku, (d, hidden), std),
                "shared_down": normal(kd, (hidden, d), out_std),
            }
            for kg, ku, kd in jax.random.split(jax.random.fold_in(key, 2), (m.n_shared_experts, 3))
        ]
    elif m.shared_width:
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


def histogram_upper_quantile(
    values: jax.Array, rank: float, bins: int, axis_names: tuple[str, ...] = ()
) -> jax.Array:
    """Per column of values [T, E], the v with `rank` of the T values at or above it, from a histogram.

    One grid for all columns: `bins` equal bins over the values' overall [min, max]. Counts are taken per
    column, and the answer is interpolated linearly inside the bin where the count from the top crosses
    `rank`. Marin's estimator. Inside shard_map, `axis_names` are the mesh axes the tokens are split over:
    each device bins its own rows, and the range (a pmin and a pmax) and the counts (E x bins, one psum) are
    reduced across them, so the answer is the global batch's whatever the number of tokens; `rank` is then
    a rank in the global batch.
    """
    t, e = values.shape
    lo = jnp.min(values)
    hi = jnp.max(values)
    if axis_names:
        lo, hi = jax.lax.pmin(lo, axis_names), jax.lax.pmax(hi, axis_names)
    hi = jnp.maximum(hi, lo + 1e-6)  # all-equal values would give zero-width bins
    width = (hi - lo) / bins
    index = jnp.clip(((values - lo) / width).astype(jnp.int32), 0, bins - 1)
    flat = (jnp.arange(e, dtype=jnp.int32)[None, :] * bins + index).reshape(-1)
    counts = jnp.bincount(flat, length=e * bins).reshape(e, bins).astype(jnp.float32)
    if axis_names:
        counts = jax.lax.psum(counts, axis_names)
    from_top = jnp.cumsum(counts[:, ::-1], axis=-1)[:, ::-1]  # values in bins >= b
    # The highest bin whose count from the top still reaches the rank (from_top never increases).
    crossing = jnp.clip(jnp.sum(from_top >= rank, axis=-1) - 1, 0, bins - 1)
    at_or_above = jnp.take_along_axis(from_top, crossing[:, None], axis=-1)[:, 0]
    in_bin = jnp.take_along_axis(counts, crossing[:, None], axis=-1)[:, 0]
    return lo + width * crossing + width * (at_or_above - rank) / jnp.maximum(in_bin, 1.0)


def route(
    x: jax.Array, router: jax.Array, bias: jax.Array, m: MoEConfig, axis_names: tuple[str, ...] = ()
) -> Routing:
    """Choose top_k experts for each of T tokens x [T, D] (see the module docstring).

    The choices are per token, so they need only this device's tokens. Inside shard_map, `axis_names` are
    the mesh axes the tokens are split over, and the statistics (load, quantile bias, balance and z losses)
    are reduced across them so that balancing sees the global batch: one psum of the [E] load, plus the
    histogram's reductions for quantile balancing. Nothing of size [global tokens, E] is formed.
    """
    # fp32 because top-k choices flip on small differences and the z-loss squares the logits.
    logits = x.astype(jnp.float32) @ router.astype(jnp.float32)
    scores = jax.nn.sigmoid(logits) if m.score_fn == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    # The quantity the bias shifts: top-k of (logit + b) and of (sigmoid(logit) + b) are different routings.
    unbiased = logits if m.bias_space == "logit" else scores
    biased = unbiased + jax.lax.stop_gradient(bias)
    top = min(m.top_k + 1, m.n_experts) if m.balancing == "quantile" else m.top_k
    top_values, top_ids = jax.lax.top_k(biased, top)
    expert_ids = top_ids[:, : m.top_k]
    weights = jnp.take_along_axis(scores, expert_ids, axis=-1)
    if m.normalize_weights:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-9)
    weights = weights * m.route_scale

    # A bincount rather than a one-hot sum: no [T, k, E] array, k times the size of the scores.
    load = jnp.bincount(expert_ids.reshape(-1), length=m.n_experts).astype(jnp.float32)
    n_tokens = expert_ids.shape[0]
    if axis_names:
        load = jax.lax.psum(load, axis_names)
        n_tokens = n_tokens * math.prod(jax.lax.axis_size(name) for name in axis_names)

    if m.balancing == "quantile":
        # Token t takes expert e iff unbiased[t, e] + bias[e] beats the best biased value it did not take
        # (the (k+1)-th, its cutoff). The bias that gives expert e exactly a k/E share of tokens is therefore
        # the k/E quantile of (cutoff - unbiased) over tokens, i.e. minus the upper k/E quantile of the
        # margins (unbiased - cutoff). Centred, since only differences between biases matter.
        cutoff = jax.lax.stop_gradient(top_values[:, m.top_k])
        if m.quantile_bins:
            margins = jax.lax.stop_gradient(unbiased) - cutoff[:, None]
            rank = n_tokens * m.top_k / m.n_experts
            quantile_bias = -histogram_upper_quantile(margins, rank, m.quantile_bins, axis_names)
        elif axis_names:
            raise ValueError(
                "quantile balancing without quantile_bins takes an exact quantile over the whole batch, "
                "which expert parallelism never gathers on one device: set moe.quantile_bins (Marin: "
                "10000), or moe.expert_parallel: false"
            )
        else:
            required = cutoff[:, None] - jax.lax.stop_gradient(unbiased)
            quantile_bias = jnp.quantile(required, m.top_k / m.n_experts, axis=0)
        quantile_bias = quantile_bias - quantile_bias.mean()
    else:
        quantile_bias = jnp.zeros((m.n_experts,), jnp.float32)

    n_assignments = n_tokens * m.top_k
    fraction = jax.lax.stop_gradient(load) / n_assignments
    probs = scores / (scores.sum(-1, keepdims=True) + 1e-9)
    mean_probs = probs.mean(0)
    z_loss = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    if axis_names:
        # Every device holds the same number of tokens, so the mean of means is the global mean.
        mean_probs, z_loss = jax.lax.pmean((mean_probs, z_loss), axis_names)
    balance_loss = m.n_experts * jnp.sum(fraction * mean_probs)
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
    # Imported here: expert_parallel builds on route() and the Routing/MoEStats types of this module.
    from tokenmill.trainer import expert_parallel

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
    shared = params.get("shared_experts", [params] if m.shared_width else [])
    for expert in shared:
        y = y + swiglu(
            x,
            expert["shared_gate"].astype(x.dtype),
            expert["shared_up"].astype(x.dtype),
            expert["shared_down"].astype(x.dtype),
        )
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
