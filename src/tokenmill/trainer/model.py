"""The decoder-only mixture-of-experts transformer, as plain functions over a pytree of parameters.

Read top to bottom: parameters, then the pieces (GatedNorm, rotary positions, short convolution, attention),
then one layer, then the whole model and its loss. Every layer is pre-norm: x + attention(norm(x)), then
x + moe(norm(x)), where norm is RMSNorm, followed by GatedNorm when the shape has it.

One code path serves both families of configs/models: the DeepSeek-V3-style shapes use the defaults, and
Marin's 535B-A23B family turns on, field by field, the pieces config.py lists (every RMSNorm followed by a
GatedNorm, an embedding norm, half interleaved RoPE on windowed layers only, plain QK-norm with qk_mult,
local/global KV heads, XSA, the attention gate, SConv, latent experts, the final-logit z-loss).

Parameters are fp32. `dtype` is the compute dtype: matmul inputs are cast to it (bf16 on accelerators),
while norms, rotary angles, the router and the loss stay in fp32.

The router bias is not a parameter: it is passed separately (`router_bias`, [n_layers, n_experts]) so that
no gradient or optimizer ever touches it, and it is checkpointed next to the parameters.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from tokenmill.trainer.config import ModelConfig
from tokenmill.trainer.moe import (
    BATCH_AXES,
    MoEStats,
    constrain,
    init_matrix,
    init_moe_params,
    moe_block,
    output_std,
    rms_norm,
)

Params = dict[str, Any]

__all__ = ["attention", "forward", "init_params", "init_router_bias", "layer_forward", "loss_fn", "rms_norm"]


# --- parameters -----------------------------------------------------------------------------------------


def init_params(key: jax.Array, cfg: ModelConfig) -> Params:
    """Every weight of the model, fp32, as nested dicts (a list of layers). Optional pieces are present
    only when the shape has them, so a parameter count is a count of what the model really uses."""
    d, std, out_std = cfg.d_model, cfg.weight_std, output_std(cfg)
    kv_width = cfg.stored_kv_heads * cfg.head_dim
    key_embed, key_head, *layer_keys = jax.random.split(key, 2 + cfg.n_layers)

    def matrix(k: jax.Array, shape: tuple[int, ...], scale: float) -> jax.Array:
        return init_matrix(cfg, k, shape, scale)

    def gated_norm(k: jax.Array) -> Params:
        key_down, key_up = jax.random.split(k)
        rank = cfg.gated_norm_rank
        return {"down": matrix(key_down, (d, rank), std), "up": matrix(key_up, (rank, d), std)}

    def sconv(channels: int) -> jax.Array:
        # [kernel, channels]: tap 0 is the current token; identity at init (tap 0 = 1, the others 0).
        return jnp.zeros((cfg.sconv_kernel, channels), jnp.float32).at[0].set(1.0)

    def layer(key: jax.Array) -> Params:
        kq, kk, kv, ko, kmoe = jax.random.split(key, 5)
        attn = {
            "wq": matrix(kq, (d, cfg.n_heads * cfg.head_dim), std),
            "wk": matrix(kk, (d, kv_width), std),
            "wv": matrix(kv, (d, kv_width), std),
            "wo": matrix(ko, (cfg.n_heads * cfg.head_dim, d), out_std),
        }
        if cfg.qk_norm and cfg.qk_norm_learnable:
            attn["q_norm"] = jnp.ones((cfg.head_dim,))
            attn["k_norm"] = jnp.ones((cfg.head_dim,))
        if cfg.attn_gate:
            attn["gate"] = jnp.zeros((d, cfg.n_heads), jnp.float32)  # 2 * sigmoid(0) = 1: no gating at init
        for site in ("k", "v"):
            if site in cfg.sconv_sites:
                attn[f"sconv_{site}"] = sconv(kv_width)
        params = {
            "attn_norm": jnp.ones((d,)),
            "attn": attn,
            "mlp_norm": jnp.ones((d,)),
            "moe": init_moe_params(kmoe, cfg),
        }
        if cfg.gated_norm_rank:
            # Folded-in keys: shapes without GatedNorm draw exactly the weights they always did.
            params["attn_gated_norm"] = gated_norm(jax.random.fold_in(key, 1))
            params["mlp_gated_norm"] = gated_norm(jax.random.fold_in(key, 2))
        for site in ("attn", "mlp"):
            if site in cfg.sconv_sites:
                params[f"sconv_{site}"] = sconv(d)
        return params

    params = {
        "embed": matrix(key_embed, (cfg.vocab_size, d), std),
        "layers": [layer(k) for k in layer_keys],
        "final_norm": jnp.ones((d,)),
        "lm_head": matrix(key_head, (d, cfg.vocab_size), std),
    }
    if cfg.embed_norm:
        params["embed_norm"] = jnp.ones((d,))
    if cfg.gated_norm_rank:
        if cfg.embed_norm:
            params["embed_gated_norm"] = gated_norm(jax.random.fold_in(key, 1))
        params["final_gated_norm"] = gated_norm(jax.random.fold_in(key, 2))
    return params


def init_router_bias(cfg: ModelConfig) -> jax.Array:
    """Zero bias for every layer's router: [n_layers, n_experts], fp32."""
    return jnp.zeros((cfg.n_layers, cfg.moe.n_experts), jnp.float32)


# --- pieces ---------------------------------------------------------------------------------------------


def gated_norm(params: Params, x: jax.Array) -> jax.Array:
    """GatedNorm: x * sigmoid(W_up silu(W_down x)), a low-rank per-channel gate with no bias."""
    hidden = jax.nn.silu(x @ params["down"].astype(x.dtype))
    return x * jax.nn.sigmoid(hidden @ params["up"].astype(x.dtype))


def norm(x: jax.Array, scale: jax.Array, gate: Params | None, eps: float) -> jax.Array:
    """The residual stream's normalisation: RMSNorm, then GatedNorm when the shape has one here."""
    x = rms_norm(x, scale, eps)
    return x if gate is None else gated_norm(gate, x)


def rotary(
    x: jax.Array, positions: jax.Array, theta: float, dims: int | None = None, interleaved: bool = False
) -> jax.Array:
    """Rotate pairs of channels of x [B, S, heads, head_dim] by position-dependent angles (RoPE).

    Only the first `dims` channels (default all) rotate; pair i turns at theta^(-i / (dims/2)) radians per
    position. The pairs are (i, i + dims/2) or, interleaved, (2i, 2i + 1).

    Positions run along the packed sequence rather than restarting per document: attention never crosses a
    document boundary, and RoPE only sees differences of positions, so the two are equivalent.
    """
    dims = dims or x.shape[-1]
    half = dims // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions[:, :, None, None].astype(jnp.float32) * freqs  # [B, S, 1, half]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    turning = x[..., :dims].astype(jnp.float32)
    if interleaved:
        x1, x2 = turning[..., 0::2], turning[..., 1::2]
        turned = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(turning.shape)
    else:
        x1, x2 = turning[..., :half], turning[..., half:]
        turned = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    if dims == x.shape[-1]:
        return turned.astype(x.dtype)
    return jnp.concatenate([turned.astype(x.dtype), x[..., dims:]], axis=-1)


def short_conv(x: jax.Array, weight: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """SConv: causal depthwise convolution of x [B, S, C] with weight [kernel, C] along the sequence.

    out[t] = sum over lags l of weight[l] * x[t - l], where a tap that reaches before the start of the row
    or into another document contributes nothing, so no information crosses a document boundary.
    """
    s = x.shape[1]
    weight = weight.astype(x.dtype)
    out = weight[0] * x
    for lag in range(1, weight.shape[0]):
        shifted = jnp.pad(x, ((0, 0), (lag, 0), (0, 0)))[:, :s]
        shifted_ids = jnp.pad(segment_ids, ((0, 0), (lag, 0)), constant_values=-1)[:, :s]
        same_document = (shifted_ids == segment_ids)[..., None]
        out = out + weight[lag] * jnp.where(same_document, shifted, jnp.zeros_like(shifted))
    return out


def attention(
    params: Params,
    x: jax.Array,
    segment_ids: jax.Array,
    cfg: ModelConfig,
    layer: int,
) -> jax.Array:
    """Causal grouped-query attention of one layer, blocked across documents, windowed on local layers.

    In order: projections (SConv on K/V where configured), the layer's KV heads (the first ones stored),
    QK-norm, rotary positions (where the layer has them), qk_mult, attention, XSA, the headwise gate, and
    the output projection.
    """
    b, s, _ = x.shape
    dtype = x.dtype
    heads, head_dim, kv_heads = cfg.n_heads, cfg.head_dim, cfg.kv_heads(layer)
    window = cfg.window(layer)
    q = (x @ params["wq"].astype(dtype)).reshape(b, s, heads, head_dim)
    k = x @ params["wk"].astype(dtype)
    v = x @ params["wv"].astype(dtype)
    if "sconv_k" in params:
        k = short_conv(k, params["sconv_k"], segment_ids)
    if "sconv_v" in params:
        v = short_conv(v, params["sconv_v"], segment_ids)
    # K and V are stored at the larger of the local and global head counts; this layer uses the first ones.
    k = k.reshape(b, s, cfg.stored_kv_heads, head_dim)[:, :, :kv_heads]
    v = v.reshape(b, s, cfg.stored_kv_heads, head_dim)[:, :, :kv_heads]
    if cfg.qk_norm:
        # Normalising queries and keys bounds the attention logits, which keeps large-LR training stable.
        q = rms_norm(q, params.get("q_norm"), cfg.qk_eps)
        k = rms_norm(k, params.get("k_norm"), cfg.qk_eps)
    if cfg.rotary(layer):
        positions = jnp.broadcast_to(jnp.arange(s), (b, s))
        q = rotary(q, positions, cfg.rope_theta, cfg.rope_dims, cfg.rope_interleaved)
        k = rotary(k, positions, cfg.rope_theta, cfg.rope_dims, cfg.rope_interleaved)
    if cfg.qk_mult != 1.0:
        q = q * jnp.asarray(cfg.qk_mult, dtype)
    # A query may only look at keys of its own document: [B, 1, S, S], broadcast over heads.
    same_document = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None, :, :]
    out = jax.nn.dot_product_attention(
        q,
        k,
        v,
        mask=same_document,
        is_causal=True,
        local_window_size=(window - 1, 0) if window else None,
    )  # [B, S, heads, head_dim]
    if cfg.xsa:
        # Exclusive self-attention: z = y - (y.v / |v|^2) v per head, with v the token's own value.
        own_value = jnp.repeat(v, heads // kv_heads, axis=2)  # query head h reads KV head h // group
        along = jnp.sum(out * own_value, axis=-1, keepdims=True)
        out = out - along / (jnp.sum(own_value * own_value, axis=-1, keepdims=True) + 1e-6) * own_value
    if cfg.attn_gate:
        gate = 2 * jax.nn.sigmoid(x @ params["gate"].astype(dtype))  # [B, S, heads]
        out = out * gate[..., None]
    return out.reshape(b, s, heads * head_dim) @ params["wo"].astype(dtype)


# --- the model ------------------------------------------------------------------------------------------


def layer_forward(
    params: Params,
    x: jax.Array,
    segment_ids: jax.Array,
    router_bias: jax.Array,
    cfg: ModelConfig,
    layer: int,
) -> tuple[jax.Array, MoEStats]:
    """One pre-norm block: attention then mixture of experts, each added to the residual stream
    (through SConv first where the shape has it)."""
    h = norm(x, params["attn_norm"], params.get("attn_gated_norm"), cfg.norm_eps)
    y = attention(params["attn"], h, segment_ids, cfg, layer)
    if "sconv_attn" in params:
        y = short_conv(y, params["sconv_attn"], segment_ids)
    x = x + y
    h = norm(x, params["mlp_norm"], params.get("mlp_gated_norm"), cfg.norm_eps)
    y, stats = moe_block(params["moe"], h, router_bias, cfg.moe, cfg.norm_eps)
    if "sconv_mlp" in params:
        y = short_conv(y, params["sconv_mlp"], segment_ids)
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
    if cfg.embed_norm:
        x = norm(x, params["embed_norm"], params.get("embed_gated_norm"), cfg.norm_eps)
    all_stats = []
    for layer, layer_params in enumerate(params["layers"]):
        x, stats = layer_forward(layer_params, x, segment_ids, router_bias[layer], cfg, layer)
        all_stats.append(stats)
    x = norm(x, params["final_norm"], params.get("final_gated_norm"), cfg.norm_eps)
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
    """Next-token cross-entropy on tokens [B, S+1], plus the optional router and final-logit losses.

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
    if cfg.logit_z_loss:
        # Keeps the log-partition of the output near zero, so the logits cannot drift up together.
        objective = objective + cfg.logit_z_loss * jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    return objective, (cross_entropy, stats)
