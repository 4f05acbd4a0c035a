"""The decoder-only mixture-of-experts transformer, as plain functions over a pytree of parameters.

Read top to bottom: parameters, then the pieces (RMSNorm, rotary positions, attention), then one layer, then
the whole model and its loss. Every layer is pre-norm: x + attention(norm(x)), then x + moe(norm(x)).

Parameters are fp32. `dtype` is the compute dtype: matmul inputs are cast to it (bf16 on accelerators),
while norms, rotary angles, the router and the loss stay in fp32.

The router bias is not a parameter: it is passed separately (`router_bias`, [n_layers, n_experts]) so that
no gradient or optimizer ever touches it, and it is checkpointed next to the parameters.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

from tokenmill.trainer.config import ModelConfig
from tokenmill.trainer.moe import BATCH_AXES, MoEStats, constrain, init_moe_params, moe_block

Params = dict[str, Any]


# --- parameters -----------------------------------------------------------------------------------------


def init_params(key: jax.Array, cfg: ModelConfig) -> Params:
    """Every weight of the model, fp32, as nested dicts (a list of layers)."""
    d, std = cfg.d_model, cfg.init_std
    out_std = std / math.sqrt(2 * cfg.n_layers)
    key_embed, key_head, *layer_keys = jax.random.split(key, 2 + cfg.n_layers)

    def layer(key: jax.Array) -> Params:
        kq, kk, kv, ko, kmoe = jax.random.split(key, 5)
        attn = {
            "wq": std * jax.random.normal(kq, (d, cfg.n_heads * cfg.head_dim)),
            "wk": std * jax.random.normal(kk, (d, cfg.n_kv_heads * cfg.head_dim)),
            "wv": std * jax.random.normal(kv, (d, cfg.n_kv_heads * cfg.head_dim)),
            "wo": out_std * jax.random.normal(ko, (cfg.n_heads * cfg.head_dim, d)),
        }
        if cfg.qk_norm:
            attn["q_norm"] = jnp.ones((cfg.head_dim,))
            attn["k_norm"] = jnp.ones((cfg.head_dim,))
        return {
            "attn_norm": jnp.ones((d,)),
            "attn": attn,
            "mlp_norm": jnp.ones((d,)),
            "moe": init_moe_params(kmoe, cfg),
        }

    return {
        "embed": std * jax.random.normal(key_embed, (cfg.vocab_size, d)),
        "layers": [layer(k) for k in layer_keys],
        "final_norm": jnp.ones((d,)),
        "lm_head": std * jax.random.normal(key_head, (d, cfg.vocab_size)),
    }


def init_router_bias(cfg: ModelConfig) -> jax.Array:
    """Zero bias for every layer's router: [n_layers, n_experts], fp32."""
    return jnp.zeros((cfg.n_layers, cfg.moe.n_experts), jnp.float32)


# --- pieces ---------------------------------------------------------------------------------------------


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in fp32 (the mean of squares underflows in bf16), returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * scale).astype(x.dtype)


def rotary(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate pairs of channels of x [B, S, heads, head_dim] by position-dependent angles (RoPE).

    Positions run along the packed sequence rather than restarting per document: attention never crosses a
    document boundary, and RoPE only sees differences of positions, so the two are equivalent.
    """
    half = x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions[:, :, None, None].astype(jnp.float32) * freqs  # [B, S, 1, half]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def attention(
    params: Params,
    x: jax.Array,
    segment_ids: jax.Array,
    cfg: ModelConfig,
    window: int | None,
) -> jax.Array:
    """Causal grouped-query attention, blocked across documents, optionally within a sliding window."""
    b, s, _ = x.shape
    dtype = x.dtype
    q = (x @ params["wq"].astype(dtype)).reshape(b, s, cfg.n_heads, cfg.head_dim)
    k = (x @ params["wk"].astype(dtype)).reshape(b, s, cfg.n_kv_heads, cfg.head_dim)
    v = (x @ params["wv"].astype(dtype)).reshape(b, s, cfg.n_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        # Normalising queries and keys bounds the attention logits, which keeps large-LR training stable.
        q = rms_norm(q, params["q_norm"], cfg.norm_eps)
        k = rms_norm(k, params["k_norm"], cfg.norm_eps)
    positions = jnp.broadcast_to(jnp.arange(s), (b, s))
    q, k = rotary(q, positions, cfg.rope_theta), rotary(k, positions, cfg.rope_theta)
    # A query may only look at keys of its own document: [B, 1, S, S], broadcast over heads.
    same_document = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None, :, :]
    out = jax.nn.dot_product_attention(
        q,
        k,
        v,
        mask=same_document,
        is_causal=True,
        local_window_size=(window - 1, 0) if window else None,
    )
    return out.reshape(b, s, cfg.n_heads * cfg.head_dim) @ params["wo"].astype(dtype)


# --- the model ------------------------------------------------------------------------------------------


def layer_forward(
    params: Params,
    x: jax.Array,
    segment_ids: jax.Array,
    router_bias: jax.Array,
    cfg: ModelConfig,
    layer: int,
) -> tuple[jax.Array, MoEStats]:
    """One pre-norm block: attention then mixture of experts, each added to the residual stream."""
    h = rms_norm(x, params["attn_norm"], cfg.norm_eps)
    x = x + attention(params["attn"], h, segment_ids, cfg, cfg.window(layer))
    h = rms_norm(x, params["mlp_norm"], cfg.norm_eps)
    y, stats = moe_block(params["moe"], h, router_bias, cfg.moe)
    x = constrain(x + y, BATCH_AXES, None, None)
    return x, stats


def forward(
    params: Params,
    router_bias: jax.Array,
    tokens: jax.Array,
    segment_ids: jax.Array,
    cfg: ModelConfig,
    dtype: Any = jnp.float32,
) -> tuple[jax.Array, MoEStats]:
    """Logits [B, S, vocab] (fp32) for tokens [B, S], and the MoE statistics stacked over layers."""
    x = params["embed"][tokens].astype(dtype)
    x = constrain(x, BATCH_AXES, None, None)
    all_stats = []
    for layer, layer_params in enumerate(params["layers"]):
        x, stats = layer_forward(layer_params, x, segment_ids, router_bias[layer], cfg, layer)
        all_stats.append(stats)
    x = rms_norm(x, params["final_norm"], cfg.norm_eps)
    logits = jnp.dot(x, params["lm_head"].astype(dtype), preferred_element_type=jnp.float32)
    stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *all_stats)
    return logits, stacked


def loss_fn(
    params: Params,
    router_bias: jax.Array,
    tokens: jax.Array,
    segment_ids: jax.Array,
    cfg: ModelConfig,
    dtype: Any = jnp.float32,
) -> tuple[jax.Array, tuple[jax.Array, MoEStats]]:
    """Next-token cross-entropy on tokens [B, S+1], plus the optional router losses.

    Returns (objective, (cross-entropy, stats)): the objective is what gradients follow; the cross-entropy
    alone is what gets logged as the loss.
    """
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits, stats = forward(params, router_bias, inputs, segment_ids[:, :-1], cfg, dtype)
    cross_entropy = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    objective = cross_entropy
    if cfg.moe.load_balance_loss:
        objective = objective + cfg.moe.load_balance_loss * stats.balance_loss.mean()
    if cfg.moe.z_loss:
        objective = objective + cfg.moe.z_loss * stats.z_loss.mean()
    return objective, (cross_entropy, stats)
