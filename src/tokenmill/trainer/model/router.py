"""The router of an MoE layer: which top_k experts each token goes to, the load statistics balancing reads,
and the router-bias update applied after each optimizer step.

The router bias shifts which experts are chosen but not the weights they are combined with, so it never
receives a gradient (DeepSeek-V3's auxiliary-loss-free balancing); it is added to the scores or, with
`bias_space: logit`, to the logits (Marin). docs/trainer.md, "Router balancing".
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from tokenmill.trainer.model.shape import MoEConfig


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


class MoEStats(NamedTuple):
    load: jax.Array  # [E]
    dropped: jax.Array  # scalar int32
    quantile_bias: jax.Array  # [E]
    balance_loss: jax.Array
    z_loss: jax.Array


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
