"""Marin's 535B-A23B block, checked against an independent NumPy implementation of its equations.

The reference below is written from the block's definition (docs/trainer.md, "The Marin family"), in
float64 with explicit loops where that is clearer, and shares nothing with transformer.py/moe.py but the
parameter pytree it reads its weights from. The JAX model runs in fp32; the two agree to ~1e-5.
Also here: documents stay apart with every piece on, every new parameter gets a gradient, and the tiny
configs train with the pieces on and off.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokenmill.trainer.data.batch import SyntheticSource
from tokenmill.trainer.model import transformer
from tokenmill.trainer.model.shape import ModelConfig, MoEConfig, load_model_config
from tokenmill.trainer.run.config import Phase, RunConfig, resolve_run_config
from tokenmill.trainer.run.loop import train

MODELS = Path(__file__).resolve().parents[1] / "configs" / "models"
QUANTILE_BINS = 64  # few bins, so fp32 vs float64 rounding never moves a margin across a bin edge
#: Unoptimised CPU code generation for the programs compiled here, which run a few times on tiny shapes:
#: compiling at LLVM's default level took about twice as long (test_expert_parallel.py sets the same level
#: for its processes). The results differ from the default level's in the last bit at most.
QUICK_COMPILE = {"xla_backend_optimization_level": 0}


def marin_block_config(dispatch: str = "dropless") -> ModelConfig:
    """Two layers: 0 is local (window 4, 2 KV heads, half RoPE), 1 is global (the last; 1 KV head, NoPE)."""
    return ModelConfig(
        name="marin-block", vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, global_kv_heads=1,
        head_dim=8, sequence_length=16, sliding_window=4, global_every=4, rope_theta=10_000, rope_dims=4,
        rope_interleaved=True, rope_on_global_layers=False, qk_norm=True, qk_norm_learnable=False,
        qk_norm_eps=1e-6, qk_mult=1.3, embed_norm=True, gated_norm_rank=8, xsa=True, attn_gate=True,
        sconv_sites=["k", "v", "attn", "mlp"], sconv_kernel=4, logit_z_loss=1e-4, init_gain=0.5,
        init_truncated=True, init_scale_outputs=False,
        moe=MoEConfig(
            n_experts=8, top_k=2, expert_hidden=12, latent_dim=16, n_shared_experts=2,
            shared_expert_hidden=10, separate_shared_experts=True, score_fn="sigmoid", normalize_weights=True,
            route_scale=2.5,
            balancing="quantile", bias_space="logit", quantile_bins=QUANTILE_BINS, dispatch=dispatch,
            capacity_factor=100.0,
        ),
    )  # fmt: skip


def fixed_weights(cfg: ModelConfig, seed: int = 0):
    """Every leaf of the model's pytree replaced by fixed random values (gates and SConv far from their
    identity init, norm scales away from 1), and a non-zero router bias, as float32 JAX arrays."""
    rng = np.random.default_rng(seed)
    structure = jax.eval_shape(lambda key: transformer.init_params(key, cfg), jax.random.key(0))

    def draw(path, leaf):
        if leaf.ndim - transformer.layer_axes(path) == 1:  # a vector per layer (stacked layers add an axis)
            return (1.0 + 0.2 * rng.standard_normal(leaf.shape)).astype(np.float32)
        fan_in = leaf.shape[-2]
        return (rng.standard_normal(leaf.shape) / np.sqrt(fan_in)).astype(np.float32)

    params = jax.tree_util.tree_map_with_path(draw, structure)
    bias = (0.5 * rng.standard_normal((cfg.n_layers, cfg.moe.n_experts))).astype(np.float32)
    return jax.tree.map(jnp.asarray, params), jnp.asarray(bias)


def segments(batch: int, seq: int) -> np.ndarray:
    """Documents of uneven lengths: row 0 splits at 5, row 1 at 9 and 13."""
    ids = np.zeros((batch, seq), np.int32)
    ids[0, 5:] = 1
    ids[1, 9:] = 1
    ids[1, 13:] = 2
    return ids


# --- the reference, in NumPy --------------------------------------------------------------------------


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def silu(x):
    return x * sigmoid(x)


def np_rms_norm(x, scale, eps):
    out = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return out if scale is None else out * scale


def np_gated_norm(x, p):
    """x * sigmoid(W_up silu(W_down x))."""
    return x * sigmoid(silu(x @ p["down"]) @ p["up"])


def np_sconv(x, weight, seg):
    """out[b, t] = sum_lag weight[lag] * x[b, t - lag], only over earlier tokens of the same document."""
    b, s, _ = x.shape
    out = np.zeros_like(x)
    for row in range(b):
        for t in range(s):
            for lag in range(weight.shape[0]):
                if t - lag >= 0 and seg[row, t - lag] == seg[row, t]:
                    out[row, t] += weight[lag] * x[row, t - lag]
    return out


def np_half_rope(x, theta, dims):
    """x [B, S, heads, head_dim]: pair (2i, 2i+1) of the first `dims` channels turns pos theta^(-2i/dims)."""
    out = x.copy()
    for pos in range(x.shape[1]):
        for i in range(dims // 2):
            angle = pos * theta ** (-i / (dims // 2))
            a, b = x[:, pos, :, 2 * i], x[:, pos, :, 2 * i + 1]
            out[:, pos, :, 2 * i] = a * np.cos(angle) - b * np.sin(angle)
            out[:, pos, :, 2 * i + 1] = b * np.cos(angle) + a * np.sin(angle)
    return out


def np_attention(p, x, seg, cfg, is_global):
    b, s, d = x.shape
    heads, hd = cfg.n_heads, cfg.head_dim
    stored = max(cfg.n_kv_heads, cfg.global_kv_heads)
    kv_heads = cfg.global_kv_heads if is_global else cfg.n_kv_heads
    q = (x @ p["wq"]).reshape(b, s, heads, hd)
    k = np_sconv(x @ p["wk"], p["sconv_k"], seg).reshape(b, s, stored, hd)[:, :, :kv_heads]
    v = np_sconv(x @ p["wv"], p["sconv_v"], seg).reshape(b, s, stored, hd)[:, :, :kv_heads]
    q, k = np_rms_norm(q, None, 1e-6), np_rms_norm(k, None, 1e-6)
    if not is_global:
        q, k = np_half_rope(q, cfg.rope_theta, cfg.rope_dims), np_half_rope(k, cfg.rope_theta, cfg.rope_dims)
    q = 1.3 * q
    out = np.zeros((b, s, heads, hd))
    group = heads // kv_heads
    for row in range(b):
        for h in range(heads):
            g = h // group  # query head h reads KV head h // group
            for i in range(s):
                keys = [
                    j
                    for j in range(i + 1)
                    if seg[row, j] == seg[row, i] and (is_global or i - j < cfg.sliding_window)
                ]
                logits = np.array([q[row, i, h] @ k[row, j, g] for j in keys]) / np.sqrt(hd)
                weights = np.exp(logits - logits.max())
                weights /= weights.sum()
                y = sum(w * v[row, j, g] for w, j in zip(weights, keys, strict=True))
                own = v[row, i, g]
                y = y - (y @ own) / (own @ own + 1e-6) * own  # XSA
                out[row, i, h] = 2 * sigmoid(x[row, i] @ p["gate"][:, h]) * y  # headwise gate
    return out.reshape(b, s, heads * hd) @ p["wo"]


def np_swiglu(x, gate, up, down):
    return (silu(x @ gate) * (x @ up)) @ down


def np_upper_quantile(margins, rank, bins):
    """Per expert, v with `rank` margins at or above it: histogram on one [min, max] grid, linear in a bin."""
    lo, hi = margins.min(), max(margins.max(), margins.min() + 1e-6)
    width = (hi - lo) / bins
    betas = []
    for column in margins.T:
        counts = np.zeros(bins)
        for value in column:
            counts[min(int((value - lo) / width), bins - 1)] += 1
        above = 0.0  # margins in the bins above the current one
        for b in range(bins - 1, -1, -1):
            if above + counts[b] >= rank:
                # The crossing bin: its counts spread evenly, the value where the count reaches the rank.
                betas.append(lo + width * (b + 1) - width * (rank - above) / max(counts[b], 1))
                break
            above += counts[b]
        else:
            betas.append(lo)
    return np.array(betas)


def np_moe(p, h, bias, m, eps):
    b, s, d = h.shape
    x = h.reshape(b * s, d)
    logits = x @ p["router"]
    biased = logits + bias
    order = np.argsort(-biased, axis=-1, kind="stable")
    chosen = order[:, : m.top_k]
    cutoff = np.take_along_axis(biased, order[:, m.top_k : m.top_k + 1], axis=-1)
    weights = sigmoid(np.take_along_axis(logits, chosen, axis=-1))
    weights = 2.5 * weights / weights.sum(-1, keepdims=True)
    latent = np_rms_norm(x @ p["latent_down"], p["latent_norm"], eps)
    routed = np.zeros_like(latent)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], chosen[t], strict=True):
            routed[t] += w * np_swiglu(latent[t], p["w_gate"][e], p["w_up"][e], p["w_down"][e])
    y = routed @ p["latent_up"]
    for shared in p["shared_experts"]:
        y = y + np_swiglu(x, shared["shared_gate"], shared["shared_up"], shared["shared_down"])
    beta = np_upper_quantile(logits - cutoff, x.shape[0] * m.top_k / m.n_experts, m.quantile_bins)
    next_bias = -beta - np.mean(-beta)
    load = np.bincount(chosen.reshape(-1), minlength=m.n_experts)
    return y.reshape(b, s, d), next_bias, load


def np_layer(p, x, seg, bias, cfg, layer):
    is_global = (layer + 1) % cfg.global_every == 0 or layer == cfg.n_layers - 1
    h = np_gated_norm(np_rms_norm(x, p["attn_norm"], cfg.norm_eps), p["attn_gated_norm"])
    x = x + np_sconv(np_attention(p["attn"], h, seg, cfg, is_global), p["sconv_attn"], seg)
    h = np_gated_norm(np_rms_norm(x, p["mlp_norm"], cfg.norm_eps), p["mlp_gated_norm"])
    y, next_bias, load = np_moe(p["moe"], h, bias, cfg.moe, cfg.norm_eps)
    return x + np_sconv(y, p["sconv_mlp"], seg), next_bias, load


def np_loss(p, bias, tokens, seg, cfg):
    """Cross-entropy of next tokens, and that plus the final-logit z-loss."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    x = p["embed"][inputs]
    x = np_gated_norm(np_rms_norm(x, p["embed_norm"], cfg.norm_eps), p["embed_gated_norm"])
    for layer in range(cfg.n_layers):
        x, _, _ = np_layer(transformer.layer_params(p, cfg, layer), x, seg[:, :-1], bias[layer], cfg, layer)
    x = np_gated_norm(np_rms_norm(x, p["final_norm"], cfg.norm_eps), p["final_gated_norm"])
    logits = x @ p["lm_head"]
    top = logits.max(-1, keepdims=True)
    log_partition = (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))[..., 0]
    picked = np.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    cross_entropy = np.mean(log_partition - picked)
    return logits, cross_entropy, cross_entropy + cfg.logit_z_loss * np.mean(log_partition**2)


def as_float64(tree):
    return jax.tree.map(lambda leaf: np.asarray(leaf, np.float64), tree)


# --- the checks -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_block_matches_the_numpy_reference(dispatch):
    cfg = marin_block_config(dispatch)
    params, bias = fixed_weights(cfg)
    seg = segments(2, cfg.sequence_length)
    x = jax.random.normal(jax.random.key(7), (2, cfg.sequence_length, cfg.d_model))
    reference = as_float64(params)
    for layer in range(cfg.n_layers):  # 0: local, half RoPE, 2 KV heads; 1: global (last), NoPE, 1 KV head
        run = jax.jit(
            lambda p, x, b, layer=layer: transformer.layer_forward(p, x, jnp.asarray(seg), b, cfg, layer),
            compiler_options=QUICK_COMPILE,
        )
        out, stats = run(transformer.layer_params(params, cfg, layer), x, bias[layer])
        expected, next_bias, load = np_layer(
            transformer.layer_params(reference, cfg, layer),
            np.asarray(x, np.float64),
            seg,
            np.asarray(bias[layer], np.float64),
            cfg,
            layer,
        )
        np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(stats.load), load)
        np.testing.assert_allclose(np.asarray(stats.quantile_bias), next_bias, rtol=1e-5, atol=1e-5)
        assert int(stats.dropped) == 0


def test_model_loss_with_the_final_logit_z_loss_matches_the_numpy_reference():
    cfg = marin_block_config()
    params, bias = fixed_weights(cfg, seed=1)
    tokens = jax.random.randint(jax.random.key(3), (2, cfg.sequence_length + 1), 0, cfg.vocab_size)
    seg = np.concatenate([segments(2, cfg.sequence_length), segments(2, cfg.sequence_length)[:, -1:]], axis=1)
    objective, (cross_entropy, _) = jax.jit(
        lambda p, b, t, s: transformer.loss_fn(p, b, t, s, cfg), compiler_options=QUICK_COMPILE
    )(params, bias, tokens, jnp.asarray(seg))
    logits, _ = jax.jit(
        lambda p, b, t, s: transformer.forward(p, b, t, s, cfg), compiler_options=QUICK_COMPILE
    )(params, bias, tokens[:, :-1], jnp.asarray(seg[:, :-1]))
    ref_logits, ref_ce, ref_objective = np_loss(
        as_float64(params), np.asarray(bias), np.asarray(tokens), seg, cfg
    )
    np.testing.assert_allclose(np.asarray(logits), ref_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(cross_entropy), ref_ce, rtol=1e-5)
    np.testing.assert_allclose(float(objective), ref_objective, rtol=1e-5)
    assert float(objective) > float(cross_entropy)  # the z-loss is in the objective, not the logged loss


def test_documents_stay_apart_with_every_piece_on():
    cfg = marin_block_config()
    params, bias = fixed_weights(cfg, seed=2)
    seg = jnp.asarray(segments(2, cfg.sequence_length))
    tokens = jax.random.randint(jax.random.key(4), (2, cfg.sequence_length), 0, cfg.vocab_size)
    forward = jax.jit(
        lambda t: transformer.forward(params, bias, t, seg, cfg)[0], compiler_options=QUICK_COMPILE
    )
    # Rewrite the last token of row 0's first document (position 4): SConv's taps and attention reach
    # positions 5.. only if they cross the boundary.
    changed = tokens.at[0, 4].set((tokens[0, 4] + 1) % cfg.vocab_size)
    before, after = forward(tokens), forward(changed)
    np.testing.assert_allclose(before[0, 5:], after[0, 5:], atol=1e-6)
    assert not np.allclose(before[0, 4], after[0, 4])
    np.testing.assert_allclose(before[1], after[1], atol=1e-6)


def test_init_and_every_parameter_gets_a_gradient_from_it():
    cfg = marin_block_config()
    params = jax.jit(lambda key: transformer.init_params(key, cfg), compiler_options=QUICK_COMPILE)(
        jax.random.key(0)
    )
    layer = transformer.layer_params(params, cfg, 0)
    # The attention gate starts at 1 (W_gate = 0) and SConv as the identity (tap 0 = 1).
    assert not np.any(np.asarray(layer["attn"]["gate"]))
    np.testing.assert_array_equal(np.asarray(layer["sconv_attn"])[:, 0], [1, 0, 0, 0])
    # Every matrix: truncated normal at 3 standard units, std 0.5/sqrt(d), outputs not scaled down.
    std = 0.5 / np.sqrt(cfg.d_model)
    matrices = {"wq": layer["attn"]["wq"], "wo": layer["attn"]["wo"], "w_down": layer["moe"]["w_down"],
                "latent_up": layer["moe"]["latent_up"], "lm_head": params["lm_head"]}  # fmt: skip
    for name, leaf in matrices.items():
        values = np.asarray(leaf)
        assert np.abs(values).max() <= 3 * std + 1e-7, name
        assert 0.85 * std < values.std() < 1.05 * std, name  # a +-3 truncation keeps 98.7% of the std
    bias = transformer.init_router_bias(cfg)
    tokens = jax.random.randint(jax.random.key(5), (2, cfg.sequence_length + 1), 0, cfg.vocab_size)
    seg = jnp.zeros_like(tokens)

    def loss(p):
        return transformer.loss_fn(p, bias, tokens, seg, cfg)[0]

    grads = jax.jit(jax.grad(loss), compiler_options=QUICK_COMPILE)(params)
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    silent = [jax.tree_util.keystr(path) for path, grad in flat if not np.any(np.asarray(grad))]
    assert not silent, silent


# tiny-marin trains in make test-slow (the default suite's budget); its forward is checked above.
@pytest.mark.parametrize("config", [pytest.param("tiny-marin.yaml", marks=pytest.mark.slow), "tiny.yaml"])
def test_tiny_configs_train(tmp_path, config):
    cfg = load_model_config(MODELS / config).model_copy(update={"sequence_length": 64})
    settings = RunConfig(
        output=str(tmp_path / "run"),
        model=cfg,
        data={"batch_size": 4},
        optimizer={"kind": "adamw", "lr": 3e-3},
        schedule={"warmup_steps": 2},
        logging={"peak_flops": 1e9},
        checkpoint={"every": 1000},
    )
    source = SyntheticSource(cfg.vocab_size, cfg.sequence_length, 4, 0, active_vocab=64)
    rows = train(resolve_run_config(settings, [Phase("pretraining", 0, 12)]), source)
    losses = [row["loss"] for row in rows]
    assert len(rows) == 12 and all(np.isfinite(losses))
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.3, losses
    # The balancing moved the router bias.
    assert any(norm > 0 for norm in rows[-1]["router_bias_norm"])
