"""The decoder-only mixture-of-experts transformer, as plain functions over a pytree of parameters.

Read top to bottom: parameters, then the pieces (GatedNorm, rotary positions, short convolution, attention),
then one layer, then the whole model and its loss. Every layer is pre-norm: x + attention(norm(x)), then
x + moe(norm(x)), where norm is RMSNorm, followed by GatedNorm when the shape has it.

One code path serves both families of configs/models: the DeepSeek-V3-style shapes use the defaults, and
Marin's 535B-A23B family turns on, field by field, the pieces shape.py lists (every RMSNorm followed by a
GatedNorm, an embedding norm, half interleaved RoPE on windowed layers only, plain QK-norm with qk_mult,
local/global KV heads, XSA, the attention gate, SConv, latent experts, the final-logit z-loss).

Parameters are fp32. `dtype` is the compute dtype: matmul inputs are cast to it (bf16 on accelerators),
while norms, rotary angles, the router and the loss stay in fp32.

The router bias is not a parameter: it is passed separately (`router_bias`, [n_layers, n_experts]) so that
no gradient or optimizer ever touches it, and it is checkpointed next to the parameters.

Layers are stored stacked and run under jax.lax.scan, so that compile time does not grow with depth. The
layers are cut into groups whose attention schedule repeats (`ModelConfig.layer_groups`: Marin's body is
three local layers and one global one, repeated n_layers / 4 times, plus any layers left over as a group of
one pass). `params["layers"][g][p]` is the layer at position p of group g's body, every leaf with a leading
axis of the group's repeats: layer `start + r * period + p` is slice r. This is the only layout; code that
wants one layer's weights takes `layer_params(params, cfg, layer)`. Each layer can be rematerialised in the
backward pass by the policy `cfg.remat` names (`remat_layer`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from tokenmill.trainer.model.layers import BATCH_AXES, constrain, init_matrix, output_std, rms_norm
from tokenmill.trainer.model.moe import init_moe_params, moe_block
from tokenmill.trainer.model.router import MoEStats
from tokenmill.trainer.model.shape import LayerGroup, ModelConfig, RematPolicy

Params = dict[str, Any]

__all__ = [
    "attention",
    "forward",
    "init_params",
    "init_router_bias",
    "layer_axes",
    "layer_forward",
    "layer_params",
    "loss_fn",
    "output_losses",
    "remat_layer",
    "trunk",
]

# The key under which the stacked layers live; every leaf below it has one leading (repeat) axis.
LAYERS = "layers"


# --- parameters -----------------------------------------------------------------------------------------


def init_params(key: jax.Array, cfg: ModelConfig) -> Params:
    """Every weight of the model, fp32, as nested dicts, the layers stacked by group (the module docstring).
    Optional pieces are present only when the shape has them, so a parameter count is a count of what the
    model really uses. Layer i draws from the i-th key whatever the grouping, so the weights do not depend
    on how the layers are grouped."""
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

    layer_keys = jnp.stack(layer_keys)
    stacked = [
        [
            # vmap draws exactly what layer(key) draws key by key, but traces the layer once.
            jax.vmap(layer)(layer_keys[group.start + position :: group.period][: group.repeats])
            for position in range(group.period)
        ]
        for group in cfg.layer_groups()
    ]
    params = {
        "embed": matrix(key_embed, (cfg.vocab_size, d), std),
        LAYERS: stacked,
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


def layer_axes(path: tuple) -> int:
    """Leading axes a parameter at this pytree path has beyond its per-layer shape: 1 under the stacked
    layers (the repeat axis), 0 elsewhere. The optimizer and the sharding treat those axes as a batch."""
    first = path[0] if path else None
    return 1 if getattr(first, "key", None) == LAYERS else 0


def layer_params(params: Params, cfg: ModelConfig, layer: int) -> Params:
    """One layer's weights, unstacked: the dict `layer_forward` takes (for tests and inspection)."""
    for index, group in enumerate(cfg.layer_groups()):
        if group.start <= layer < group.start + group.n_layers:
            repeat, position = divmod(layer - group.start, group.period)
            return jax.tree.map(lambda leaf, r=repeat: leaf[r], params[LAYERS][index][position])
    raise IndexError(f"layer {layer} outside 0..{cfg.n_layers - 1}")


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
    block = block_size(s, cfg.attention_block)
    if block == s:
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
    else:
        out = blocked_attention(q, k, v, segment_ids, window, block)
    if cfg.xsa:
        # Exclusive self-attention: z = y - (y.v / |v|^2) v per head, with v the token's own value.
        own_value = jnp.repeat(v, heads // kv_heads, axis=2)  # query head h reads KV head h // group
        along = jnp.sum(out * own_value, axis=-1, keepdims=True)
        out = out - along / (jnp.sum(own_value * own_value, axis=-1, keepdims=True) + 1e-6) * own_value
    if cfg.attn_gate:
        gate = 2 * jax.nn.sigmoid(x @ params["gate"].astype(dtype))  # [B, S, heads]
        out = out * gate[..., None]
    return out.reshape(b, s, heads * head_dim) @ params["wo"].astype(dtype)


def blocked_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, window: int | None, block: int
) -> jax.Array:
    """Causal, document-blocked (and windowed) attention `block` queries at a time: q [B, S, heads, dim],
    k and v [B, S, kv_heads, dim] -> [B, S, heads, dim].

    Each block of queries attends to every key under an explicit mask (the causal, window and document
    rules of the unblocked call), so its scores are [B, heads, block, S] rather than [B, heads, S, S]; the
    block is recomputed in the backward pass (jax.checkpoint), so no S x S array is ever kept.
    """
    b, s, heads, head_dim = q.shape
    blocks = s // block
    positions = jnp.arange(s)

    def one_block(q_block: jax.Array, segments: jax.Array, offset: jax.Array) -> jax.Array:
        query_positions = offset + jnp.arange(block)
        allowed = positions[None, :] <= query_positions[:, None]
        if window:
            allowed = allowed & (positions[None, :] > query_positions[:, None] - window)
        mask = allowed[None, None] & (segments[:, :, None] == segment_ids[:, None, :])[:, None]
        return jax.nn.dot_product_attention(q_block, k, v, mask=mask)

    step = jax.checkpoint(one_block)
    inputs = (
        q.reshape(b, blocks, block, heads, head_dim).swapaxes(0, 1),
        segment_ids.reshape(b, blocks, block).swapaxes(0, 1),
        jnp.arange(blocks) * block,
    )
    _, out = jax.lax.scan(lambda carry, xs: (carry, step(*xs)), None, inputs)
    return out.swapaxes(0, 1).reshape(b, s, heads, head_dim)


# --- the model ------------------------------------------------------------------------------------------


def compute_weights(params: Params, dtype: Any) -> Params:
    """One layer's matrices in the compute dtype, the router and the norm scales left in fp32.

    Every matrix is cast to the residual stream's dtype where it is used anyway; casting the layer's
    whole slice first, on the device that holds each shard, means the partitioner gathers bf16 shards
    (half the bytes of fp32 on the wire and in memory) and that layout changes for the backward pass's
    matmuls are made on the per-layer bf16 copy, not on a transposed fp32 copy of every layer's stack.
    It runs inside the layer's jax.checkpoint, so what the scan keeps for the backward pass is still the
    fp32 slice it reads anyway, never a second copy of the weights.
    """

    def cast(path: tuple, leaf: jax.Array) -> jax.Array:
        keep = leaf.ndim < 2 or any(getattr(entry, "key", None) == "router" for entry in path)
        return leaf if keep else leaf.astype(dtype)

    return jax.tree_util.tree_map_with_path(cast, params)


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
    params = compute_weights(params, x.dtype)
    h = norm(x, params["attn_norm"], params.get("attn_gated_norm"), cfg.norm_eps)
    y = attention(params["attn"], h, segment_ids, cfg, layer)
    if "sconv_attn" in params:
        y = short_conv(y, params["sconv_attn"], segment_ids)
    x = x + y.astype(x.dtype)
    h = norm(x, params["mlp_norm"], params.get("mlp_gated_norm"), cfg.norm_eps)
    y, stats = moe_block(params["moe"], h, router_bias, cfg.moe, cfg.norm_eps)
    if "sconv_mlp" in params:
        y = short_conv(y, params["sconv_mlp"], segment_ids)
    # The residual stream keeps the compute dtype: an fp32 block output (fp32 combine weights) would
    # promote it, and with it every activation saved for the backward pass, to fp32.
    x = constrain(x + y.astype(x.dtype), BATCH_AXES, None, None)
    return x, stats


def remat_layer(policy: RematPolicy) -> Any:
    """`layer_forward` wrapped in jax.checkpoint with the named policy (see config.RematPolicy).

    "offload" moves the saved matmul outputs to pinned host memory and back for the backward pass; a
    backend without host memory spaces fails to compile it with XLA's own error.
    """
    if policy == "none":
        return layer_forward
    policies = {
        "full": jax.checkpoint_policies.nothing_saveable,
        "dots_saveable": jax.checkpoint_policies.dots_saveable,
        # Weight matmuls only (no batch dimension in the contraction): attention's score and value products
        # are recomputed, the projections' outputs go to the host.
        "offload": jax.checkpoint_policies.offload_dot_with_no_batch_dims(
            offload_src="device", offload_dst="pinned_host"
        ),
    }
    saved = policies[policy]

    def rematerialised(
        params: Params,
        x: jax.Array,
        segment_ids: jax.Array,
        router_bias: jax.Array,
        cfg: ModelConfig,
        layer: int,
    ) -> tuple[jax.Array, MoEStats]:
        # cfg and the layer index are closed over: they choose the layer's shapes, not its values.
        def run(params: Params, x: jax.Array, segment_ids: jax.Array, router_bias: jax.Array):
            return layer_forward(params, x, segment_ids, router_bias, cfg, layer)

        return jax.checkpoint(run, policy=saved)(params, x, segment_ids, router_bias)

    return rematerialised


def run_group(
    group_params: list[Params],
    x: jax.Array,
    segment_ids: jax.Array,
    router_bias: jax.Array,
    cfg: ModelConfig,
    group: LayerGroup,
) -> tuple[jax.Array, MoEStats]:
    """The group's layers as one jax.lax.scan over its repeats; the body runs its `period` layers in order.

    router_bias: [group.n_layers, E] for the group's layers in order. Returns the residual stream and the
    MoE statistics of the group's layers, in layer order ([group.n_layers, ...]).
    """
    block = remat_layer(cfg.remat)
    bias = router_bias.reshape(group.repeats, group.period, -1)

    def body(x: jax.Array, xs: tuple[list[Params], jax.Array]) -> tuple[jax.Array, MoEStats]:
        layers, layer_bias = xs
        all_stats = []
        for position, weights in enumerate(layers):
            # The layer index fixes this position's kind, the same on every repeat by construction.
            x, stats = block(weights, x, segment_ids, layer_bias[position], cfg, group.layer(0, position))
            all_stats.append(stats)
        return x, jax.tree.map(lambda *leaves: jnp.stack(leaves), *all_stats)

    x, stats = jax.lax.scan(body, x, (group_params, bias))
    # [repeats, period, ...] -> [repeats * period, ...]: layer start + r * period + p is row r * period + p.
    return x, jax.tree.map(lambda leaf: leaf.reshape(group.n_layers, *leaf.shape[2:]), stats)


def trunk(
    params: Params,
    router_bias: jax.Array,
    tokens: jax.Array,
    segment_ids: jax.Array,
    cfg: ModelConfig,
    dtype: Any = jnp.float32,
) -> tuple[jax.Array, MoEStats]:
    """The final-normed hidden states [B, S, D] for tokens [B, S] (what the output head reads), and the MoE
    statistics stacked over layers."""
    x = params["embed"][tokens].astype(dtype)
    x = constrain(x, BATCH_AXES, None, None)
    if cfg.embed_norm:
        x = norm(x, params["embed_norm"], params.get("embed_gated_norm"), cfg.norm_eps)
    all_stats = []
    for group, group_params in zip(cfg.layer_groups(), params[LAYERS], strict=True):
        bias = router_bias[group.start : group.start + group.n_layers]
        x, stats = run_group(group_params, x, segment_ids, bias, cfg, group)
        all_stats.append(stats)
    x = norm(x, params["final_norm"], params.get("final_gated_norm"), cfg.norm_eps)
    return x, jax.tree.map(lambda *leaves: jnp.concatenate(leaves), *all_stats)


def forward(
    params: Params,
    router_bias: jax.Array,
    tokens: jax.Array,
    segment_ids: jax.Array,
    cfg: ModelConfig,
    dtype: Any = jnp.float32,
) -> tuple[jax.Array, MoEStats]:
    """Logits [B, S, vocab] (fp32) for tokens [B, S], and the MoE statistics stacked over layers."""
    x, stats = trunk(params, router_bias, tokens, segment_ids, cfg, dtype)
    return jnp.dot(x, params["lm_head"].astype(x.dtype), preferred_element_type=jnp.float32), stats


def block_size(length: int, block: int | None) -> int:
    """The largest divisor of `length` that is at most `block` (None: the whole length)."""
    if not block or block >= length:
        return length
    return next(size for size in range(block, 0, -1) if length % size == 0)


def output_losses(
    x: jax.Array, head: jax.Array, targets: jax.Array, cfg: ModelConfig
) -> tuple[jax.Array, jax.Array]:
    """Mean cross-entropy of targets [B, S] under the logits x @ head, and the mean squared log-partition
    (the final-logit z-loss), computed `cfg.loss_block` positions at a time.

    The [B, S, vocab] logits are the largest activation of a model with a large vocabulary (Marin's rungs:
    33.6 GB fp32 per device for 16 rows of 4,096 tokens at vocab 128,256, several times over in the backward
    pass). Blocked, each block's logits are made, reduced to two numbers per token and dropped, and made
    again in the backward pass (jax.checkpoint), so only [B, block, vocab] is ever alive.
    """
    b, s, d = x.shape
    block = block_size(s, cfg.loss_block)
    head = head.astype(x.dtype)

    def losses(x_block: jax.Array, target_block: jax.Array) -> tuple[jax.Array, jax.Array]:
        logits = jnp.dot(x_block, head, preferred_element_type=jnp.float32)
        log_partition = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, target_block[..., None], axis=-1)[..., 0]
        return jnp.sum(log_partition - picked), jnp.sum(log_partition**2)

    if block == s:
        cross_entropy, z = losses(x, targets)
    else:
        blocks = s // block
        xs = x.reshape(b, blocks, block, d).swapaxes(0, 1)
        ts = targets.reshape(b, blocks, block).swapaxes(0, 1)
        step = jax.checkpoint(losses)

        def body(carry: tuple, inputs: tuple) -> tuple[tuple, None]:
            ce, z = step(*inputs)
            return (carry[0] + ce, carry[1] + z), None

        zero = jnp.zeros((), jnp.float32)
        (cross_entropy, z), _ = jax.lax.scan(body, (zero, zero), (xs, ts))
    return cross_entropy / (b * s), z / (b * s)


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
    x, stats = trunk(params, router_bias, inputs, segment_ids[:, :-1], cfg, dtype)
    cross_entropy, logit_z = output_losses(x, params["lm_head"], targets, cfg)
    objective = cross_entropy
    if cfg.moe.load_balance_loss:
        objective = objective + cfg.moe.load_balance_loss * stats.balance_loss.mean()
    if cfg.moe.z_loss:
        objective = objective + cfg.moe.z_loss * stats.z_loss.mean()
    if cfg.logit_z_loss:
        # Keeps the log-partition of the output near zero, so the logits cannot drift up together.
        objective = objective + cfg.logit_z_loss * logit_z
    return objective, (cross_entropy, stats)
