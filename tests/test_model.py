"""The MoE transformer's pieces: shapes, dispatch equivalence, dropped-token accounting, router balancing,
document blocking and sliding windows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokenmill.trainer.model import moe, router, transformer
from tokenmill.trainer.model.flops import count_params
from tokenmill.trainer.model.shape import ModelConfig, MoEConfig


def tiny(n_layers: int = 2, **moe_overrides) -> ModelConfig:
    moe_cfg = dict(n_experts=8, top_k=2, expert_hidden=32, n_shared_experts=1, capacity_factor=1.25)
    moe_cfg.update(moe_overrides)
    return ModelConfig(
        name="test",
        vocab_size=128,
        d_model=32,
        n_layers=n_layers,
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
        sequence_length=32,
        sliding_window=8,
        sliding_window_layers=[0],
        moe=MoEConfig(**moe_cfg),
    )


#: Unoptimised CPU code generation for the model programs compiled here, which run once or twice on tiny
#: shapes: compiling at LLVM's default level took about twice as long (test_expert_parallel.py sets the
#: same level for its processes). The results differ from the default level's in the last bit at most.
QUICK_COMPILE = {"xla_backend_optimization_level": 0}


def init(cfg: ModelConfig, seed: int = 0):
    return jax.jit(lambda key: transformer.init_params(key, cfg), compiler_options=QUICK_COMPILE)(
        jax.random.key(seed)
    )


def forward(cfg: ModelConfig, params, bias, tokens, segments):
    return jax.jit(lambda p, b, t, s: transformer.forward(p, b, t, s, cfg), compiler_options=QUICK_COMPILE)(
        params, bias, tokens, segments
    )


def random_batch(cfg: ModelConfig, batch: int = 2, seed: int = 1):
    tokens = jax.random.randint(jax.random.key(seed), (batch, cfg.sequence_length + 1), 1, cfg.vocab_size)
    # Two documents per row: the first 12 tokens, then the rest.
    segments = jnp.broadcast_to((jnp.arange(cfg.sequence_length + 1) >= 12).astype(jnp.int32), tokens.shape)
    return tokens, segments


def test_shapes_and_parameter_count():
    cfg = tiny()
    params = init(cfg)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    counts = count_params(cfg)
    # Stored = the pytree plus the router bias; total = its matrices (norm scales are the difference).
    assert n_params + cfg.n_layers * cfg.moe.n_experts == counts.stored_params
    # A vector is one-dimensional per layer: stacked layers carry one more (repeat) axis.
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    vectors = sum(x.size for path, x in leaves if x.ndim - transformer.layer_axes(path) == 1)
    assert n_params - vectors == counts.total_params
    tokens, segments = random_batch(cfg)
    logits, stats = forward(cfg, params, transformer.init_router_bias(cfg), tokens[:, :-1], segments[:, :-1])
    assert logits.shape == (2, cfg.sequence_length, cfg.vocab_size) and logits.dtype == jnp.float32
    assert stats.load.shape == (cfg.n_layers, cfg.moe.n_experts)
    # Every token makes top_k assignments in every layer.
    np.testing.assert_allclose(stats.load.sum(-1), 2 * cfg.sequence_length * cfg.moe.top_k)
    assert stats.dropped.shape == (cfg.n_layers,)


def test_bf16_compute_keeps_fp32_params_and_close_loss():
    cfg = tiny(n_layers=1, capacity_factor=8.0)
    params = init(cfg)
    tokens, segments = random_batch(cfg)
    bias = transformer.init_router_bias(cfg)

    def loss(dtype):
        return jax.jit(
            lambda p: transformer.loss_fn(p, bias, tokens, segments, cfg, dtype)[1][0],
            compiler_options=QUICK_COMPILE,
        )(params)

    loss32, loss16 = loss(jnp.float32), loss(jnp.bfloat16)
    assert abs(float(loss32) - float(loss16)) < 0.05
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))


def test_capacity_and_dropless_agree_when_nothing_is_dropped():
    roomy, dropless = tiny(1, capacity_factor=100.0), tiny(1, dispatch="dropless")
    params = init(roomy)
    tokens, segments = random_batch(roomy)
    bias = transformer.init_router_bias(roomy)

    def loss_and_grad(cfg):
        return jax.jit(
            jax.value_and_grad(lambda p: transformer.loss_fn(p, bias, tokens, segments, cfg)[0]),
            compiler_options=QUICK_COMPILE,
        )(params)

    (loss_a, grad_a), (loss_b, grad_b) = loss_and_grad(roomy), loss_and_grad(dropless)
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grad_a), jax.tree.leaves(grad_b), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_dropped_tokens_are_counted_and_get_no_expert_output():
    b, s, d = 3, 16, 8
    cfg = tiny(n_shared_experts=0, expert_hidden=16).model_copy(update={"d_model": d})
    m = cfg.moe
    capacity = moe.expert_capacity(s, m)
    assert capacity == 5  # ceil(1.25 * 16 * 2 / 8)
    params = moe.init_moe_params(jax.random.key(0), cfg)
    params["router"] = jnp.zeros((d, 8))
    x = jax.random.normal(jax.random.key(1), (b, s, d))
    # A skewed router: every token picks experts 0 and 1.
    bias = jnp.array([1.0, 0.5, 0, 0, 0, 0, 0, 0])
    routing = jax.jit(lambda x: router.route(x.reshape(b * s, d), params["router"], bias, m))(x)
    assert set(np.unique(routing.expert_ids)) == {0, 1}
    np.testing.assert_array_equal(routing.load, [b * s, b * s, 0, 0, 0, 0, 0, 0])

    y, dropped = jax.jit(lambda x, r: moe.capacity_dispatch(x, r, params, m))(x, routing)
    # Per row, each of the two experts keeps `capacity` of its 16 tokens.
    assert int(dropped) == b * 2 * (s - capacity)
    # Tokens past both experts' buffers get nothing from the routed experts; the first ones do.
    assert np.all(np.asarray(y[:, capacity:]) == 0)
    assert np.all(np.abs(np.asarray(y[:, :capacity])).sum(-1) > 0)
    # Dropless runs them all.
    y_all, none_dropped = jax.jit(lambda x, r: moe.dropless_dispatch(x, r, params, m))(x, routing)
    assert int(none_dropped) == 0
    np.testing.assert_allclose(y_all[:, :capacity], y[:, :capacity], atol=1e-6)


def _skewed_router(e: int = 8, d: int = 16, t: int = 512):
    x = jax.random.normal(jax.random.key(0), (t, d))
    weights = 0.3 * jax.random.normal(jax.random.key(1), (d, e))
    weights = weights.at[:, 0].add(0.5).at[:, 1].add(0.3)  # experts 0 and 1 favoured
    # Skew through a constant offset too: x's mean feature is positive.
    return x + 0.5, weights


@pytest.mark.parametrize(
    "balancing, bias_space, bins",
    [
        ("bias", "score", None),
        ("quantile", "score", None),
        ("quantile", "logit", None),
        ("quantile", "logit", 10_000),
    ],
)
def test_balancing_bias_evens_out_a_skewed_router(balancing, bias_space, bins):
    m = MoEConfig(
        n_experts=8, top_k=2, expert_hidden=8, balancing=balancing, bias_rate=0.01, bias_space=bias_space,
        quantile_bins=bins,
    )  # fmt: skip
    x, weights = _skewed_router()
    fair = x.shape[0] * m.top_k / m.n_experts

    @jax.jit
    def balance(bias):
        def step(bias, _):
            r = router.route(x, weights, bias, m)
            return router.update_router_bias(bias[None], r.load[None], r.quantile_bias[None], m)[0], None

        return jax.lax.scan(step, bias, None, length=300)[0]

    start = router.route(x, weights, jnp.zeros(8), m).load
    bias = balance(jnp.zeros(8))
    end = router.route(x, weights, bias, m).load
    assert float(start.max()) > 2.5 * fair  # really skewed to begin with
    assert float(end.max()) < 1.25 * fair and float(end.min()) > 0.75 * fair
    # The bias changes which experts are chosen but never the weights they get: those are raw scores.
    r = router.route(x, weights, bias, m)
    scores = jax.nn.sigmoid(x @ weights)
    chosen = jnp.take_along_axis(scores, r.expert_ids, -1)
    np.testing.assert_allclose(r.weights, chosen / chosen.sum(-1, keepdims=True), rtol=1e-5)


def test_router_bias_receives_no_gradient():
    cfg = tiny(n_layers=1)
    params = init(cfg)
    tokens, segments = random_batch(cfg)
    bias = jax.random.normal(jax.random.key(3), (cfg.n_layers, cfg.moe.n_experts))
    grad = jax.jit(
        jax.grad(lambda b: transformer.loss_fn(params, b, tokens, segments, cfg)[0]),
        compiler_options=QUICK_COMPILE,
    )(bias)
    assert not np.any(np.asarray(grad))


def test_attention_is_blocked_across_documents():
    cfg = tiny(dispatch="dropless")  # capacity dispatch couples the tokens of a row through the buffers
    params = init(cfg)
    tokens, segments = random_batch(cfg, batch=1)
    bias = transformer.init_router_bias(cfg)
    changed = tokens.at[:, :12].set((tokens[:, :12] + 7) % cfg.vocab_size)  # rewrite document one
    logits_a, _ = forward(cfg, params, bias, tokens[:, :-1], segments[:, :-1])
    logits_b, _ = forward(cfg, params, bias, changed[:, :-1], segments[:, :-1])
    np.testing.assert_allclose(logits_a[:, 12:], logits_b[:, 12:], atol=1e-5)
    assert not np.allclose(logits_a[:, :12], logits_b[:, :12])


def test_sliding_window_sees_only_recent_tokens():
    cfg = tiny()
    attn = transformer.layer_params(init(cfg), cfg, 0)["attn"]
    x = jax.random.normal(jax.random.key(1), (1, cfg.sequence_length, cfg.d_model))
    segments = jnp.zeros((1, cfg.sequence_length), jnp.int32)
    x2 = x.at[:, 0].add(1.0)
    window = cfg.window(0)
    local = jax.jit(
        lambda x: transformer.attention(attn, x, segments, cfg, 0), compiler_options=QUICK_COMPILE
    )
    a, b = local(x), local(x2)
    np.testing.assert_allclose(a[:, window:], b[:, window:], atol=1e-6)
    assert not np.allclose(a[:, window - 1], b[:, window - 1])
    # Global attention (layer 1) does see the first token from everywhere.
    assert cfg.window(1) is None
    full = jax.jit(lambda x: transformer.attention(attn, x, segments, cfg, 1), compiler_options=QUICK_COMPILE)
    g_a, g_b = full(x), full(x2)
    assert not np.allclose(g_a[:, -1], g_b[:, -1])


def test_histogram_quantile_is_within_a_bin_of_the_exact_one():
    t, e, k, bins = 4096, 8, 2, 1000
    values = jax.random.normal(jax.random.key(0), (t, e))
    values = values.at[:, 1].set(0.25)  # one expert's margins all equal
    values = values.at[0, 2].set(50.0)  # one outlier stretches the shared grid 10x
    rank = t * k / e
    estimate = np.asarray(jax.jit(lambda v: router.histogram_upper_quantile(v, rank, bins))(values))
    width = float(values.max() - values.min()) / bins
    exact = np.sort(np.asarray(values), axis=0)[::-1][int(rank) - 1]  # the rank-th largest per column
    assert np.all(np.abs(estimate - exact) <= width + 1e-6), (estimate, exact, width)
    # The estimate splits each column into rank values above it, up to the tokens inside one bin.
    above = (np.asarray(values) >= estimate[None, :]).sum(0)
    assert np.all(np.abs(above[[0, 2, 3]] - rank) <= 0.01 * t)


def test_global_layers_by_rule():
    cfg = tiny(n_layers=22).model_copy(update={"global_every": 4, "sliding_window_layers": []})
    assert [i for i in range(22) if cfg.is_global(i)] == [3, 7, 11, 15, 19, 21]
    assert cfg.window(0) == cfg.sliding_window and cfg.window(21) is None
    with pytest.raises(ValueError, match="excludes sliding_window_layers"):
        ModelConfig.model_validate({**tiny().model_dump(), "global_every": 4})
