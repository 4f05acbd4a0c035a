"""Scanned layers, remat policies, optimizer state in pinned host memory, and `tokenmill model compile`.

The scanned model is checked against an unrolled loop over the same per-layer code (`layer_forward` on each
layer's unstacked weights): same loss, same gradients. Every remat policy must give the gradients of no
remat. `model compile` runs as a user runs it, from a plain process that has not set XLA_FLAGS.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml

from tokenmill.trainer.commands.model import format_compile_report, parse_bytes, parse_mesh_axes
from tokenmill.trainer.model import transformer
from tokenmill.trainer.model.flops import xla_flops
from tokenmill.trainer.model.shape import LayerGroup, ModelConfig, MoEConfig, load_model_config

MODELS = Path(__file__).resolve().parents[1] / "configs" / "models"


def scanned_config(**overrides) -> ModelConfig:
    """Five layers, global every 2nd and the last: local/global twice (a scan of 2 repeats), then one
    global layer left over (a second group), with the Marin pieces that depend on the layer's kind."""
    fields = dict(
        name="scan", vocab_size=64, d_model=32, n_layers=5, n_heads=4, n_kv_heads=2, global_kv_heads=1,
        head_dim=8, sequence_length=16, sliding_window=4, global_every=2, rope_dims=4, rope_interleaved=True,
        rope_on_global_layers=False, qk_norm_learnable=False, embed_norm=True, gated_norm_rank=4, xsa=True,
        attn_gate=True, sconv_sites=["k", "attn"], logit_z_loss=1e-4, init_gain=0.5,
        moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16, latent_dim=16, n_shared_experts=1,
                      balancing="quantile", bias_space="logit", quantile_bins=64, dispatch="dropless"),
    )  # fmt: skip
    fields.update(overrides)
    return ModelConfig(**fields)


def unrolled_loss(params, bias, tokens, segment_ids, cfg: ModelConfig):
    """loss_fn's objective with the layers in a Python loop, one `layer_forward` per layer: the reference
    the scan must reproduce."""
    inputs, targets, seg = tokens[:, :-1], tokens[:, 1:], segment_ids[:, :-1]
    x = params["embed"][inputs]
    x = transformer.norm(x, params["embed_norm"], params.get("embed_gated_norm"), cfg.norm_eps)
    for layer in range(cfg.n_layers):
        x, _ = transformer.layer_forward(
            transformer.layer_params(params, cfg, layer), x, seg, bias[layer], cfg, layer
        )
    x = transformer.norm(x, params["final_norm"], params.get("final_gated_norm"), cfg.norm_eps)
    logits = x @ params["lm_head"]
    cross_entropy = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    return cross_entropy + cfg.logit_z_loss * jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)


def batch(cfg: ModelConfig, seed: int = 3):
    tokens = jax.random.randint(jax.random.key(seed), (2, cfg.sequence_length + 1), 0, cfg.vocab_size)
    segments = (jnp.arange(cfg.sequence_length + 1) >= 7).astype(jnp.int32)[None].repeat(2, 0)
    return tokens, segments


def test_layer_groups_follow_the_attention_schedule():
    hero = load_model_config(MODELS / "marin-535b-a23b.yaml")
    assert hero.layer_groups() == [LayerGroup(0, 4, 12)]  # 3 local + 1 global, 12 times
    d2048 = load_model_config(MODELS / "marin-d2048.yaml")
    # 22 layers: five bodies of four, then layer 20 (local) and the forced-global last layer 21.
    assert d2048.layer_groups() == [LayerGroup(0, 4, 5), LayerGroup(20, 2, 1)]
    cfg = scanned_config()
    assert cfg.layer_groups() == [LayerGroup(0, 2, 2), LayerGroup(4, 1, 1)]
    for group in d2048.layer_groups() + cfg.layer_groups():
        model_cfg = d2048 if group in d2048.layer_groups() else cfg
        for repeat in range(group.repeats):
            for position in range(group.period):
                layer = group.layer(repeat, position)
                assert model_cfg.layer_kind(layer) == model_cfg.layer_kind(group.start + position)


# Slow suite (`make test-slow`): the default suite keeps the cheaper checks of the same code.
@pytest.mark.slow
def test_stacked_layout_and_init_do_not_depend_on_the_grouping():
    cfg = scanned_config()
    params = jax.jit(lambda key: transformer.init_params(key, cfg))(jax.random.key(0))
    wq = params["layers"][0][1]["attn"]["wq"]
    assert wq.shape == (2, cfg.d_model, cfg.n_heads * cfg.head_dim)  # [repeats, in, out]
    assert params["layers"][1][0]["attn_norm"].shape == (1, cfg.d_model)
    # Layer i draws from the i-th key: a model of the first three layers alone has the same weights.
    shorter = cfg.model_copy(update={"n_layers": 3})
    short = jax.jit(lambda key: transformer.init_params(key, shorter))(jax.random.key(0))
    for layer in range(3):
        a, b = transformer.layer_params(params, cfg, layer), transformer.layer_params(short, shorter, layer)
        np.testing.assert_array_equal(a["attn"]["wq"], b["attn"]["wq"])
        np.testing.assert_array_equal(a["moe"]["w_up"], b["moe"]["w_up"])
    with pytest.raises(IndexError):
        transformer.layer_params(params, cfg, cfg.n_layers)


# Slow suite (`make test-slow`): the default suite keeps the cheaper checks of the same code.
@pytest.mark.slow
def test_scan_gives_the_loss_and_gradients_of_an_unrolled_loop():
    cfg = scanned_config()
    params = jax.jit(lambda key: transformer.init_params(key, cfg))(jax.random.key(1))
    bias = 0.1 * jax.random.normal(jax.random.key(2), (cfg.n_layers, cfg.moe.n_experts))
    tokens, segments = batch(cfg)

    def scanned(p):
        return transformer.loss_fn(p, bias, tokens, segments, cfg)[0]

    loss, grads = jax.jit(jax.value_and_grad(scanned))(params)
    ref_loss, ref_grads = jax.jit(
        jax.value_and_grad(lambda p: unrolled_loss(p, bias, tokens, segments, cfg))
    )(params)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    for (path, got), want in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-7, err_msg=jax.tree_util.keystr(path))
    # The statistics come back in layer order: layer 4 (the leftover group) is the last row.
    _, (_, stats) = jax.jit(lambda p: transformer.loss_fn(p, bias, tokens, segments, cfg))(params)
    assert stats.load.shape == (cfg.n_layers, cfg.moe.n_experts)
    seg = segments[:, :-1]
    x = transformer.norm(
        params["embed"][tokens[:, :-1]], params["embed_norm"], params["embed_gated_norm"], 1e-5
    )
    for layer in range(cfg.n_layers):
        x, layer_stats = transformer.layer_forward(
            transformer.layer_params(params, cfg, layer), x, seg, bias[layer], cfg, layer
        )
        np.testing.assert_array_equal(stats.load[layer], layer_stats.load)


# Slow suite (`make test-slow`): the default suite keeps the cheaper checks of the same code.
@pytest.mark.slow
def test_blocked_attention_and_loss_give_the_same_loss_and_gradients():
    cfg = scanned_config()
    params = jax.jit(lambda key: transformer.init_params(key, cfg))(jax.random.key(6))
    bias = transformer.init_router_bias(cfg)
    tokens, segments = batch(cfg, seed=7)

    def value_and_grads(model_cfg):
        return jax.jit(
            jax.value_and_grad(lambda p: transformer.loss_fn(p, bias, tokens, segments, model_cfg)[0])
        )(params)

    loss, grads = value_and_grads(cfg)
    # Blocks of 4 of the 16 positions: windowed (4) and global layers, documents split across blocks.
    blocked_loss, blocked_grads = value_and_grads(
        cfg.model_copy(update={"attention_block": 4, "loss_block": 4})
    )
    np.testing.assert_allclose(float(blocked_loss), float(loss), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(blocked_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
    assert (
        transformer.block_size(4096, 512) == 512
        and transformer.block_size(100, 64) == 50
        and transformer.block_size(8, None) == 8
    )


@pytest.mark.parametrize(
    "policy",
    [
        pytest.param("full", marks=pytest.mark.slow),
        pytest.param("dots_saveable", marks=pytest.mark.slow),
        pytest.param("offload", marks=pytest.mark.slow),
    ],
)
def test_every_remat_policy_gives_the_same_gradients(policy):
    cfg = scanned_config()
    params = jax.jit(lambda key: transformer.init_params(key, cfg))(jax.random.key(4))
    bias = transformer.init_router_bias(cfg)
    tokens, segments = batch(cfg, seed=5)

    def grads(model_cfg):
        return jax.jit(jax.grad(lambda p: transformer.loss_fn(p, bias, tokens, segments, model_cfg)[0]))(
            params
        )

    want = grads(cfg)
    got = grads(cfg.model_copy(update={"remat": policy}))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


# Slow suite (`make test-slow`): the default suite keeps the cheaper checks of the same code.
@pytest.mark.slow
def test_optimizer_state_in_pinned_host_memory_trains_like_device_memory():
    from tokenmill.trainer.model.sharding import make_mesh
    from tokenmill.trainer.run.config import Phase, RunConfig, resolve_run_config
    from tokenmill.trainer.run.step import compile_train_step

    cfg = scanned_config()
    phases = [Phase("pretraining", 0, 10)]
    mesh = make_mesh((1, 1, 1))
    tokens, segments = batch(cfg)
    results = {}
    for memory in ("device", "pinned_host"):
        run = resolve_run_config(
            RunConfig(
                model=cfg, data={"synthetic": True, "batch_size": 2}, optimizer={"state_memory": memory}
            ),
            phases,
        )
        with jax.set_mesh(mesh):
            init_fn, step_fn, shardings = compile_train_step(run, mesh)
            state = init_fn(jax.random.key(0))
            kinds = {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state["opt_state"])}
            assert kinds == {memory}
            assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state["params"])} == {"device"}
            losses = []
            for _ in range(3):
                state, metrics = step_fn(state, tokens, segments)
                losses.append(float(metrics["loss"]))
            assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(state["opt_state"])} == {memory}
        results[memory] = (losses, jax.device_get(state["params"]))
    np.testing.assert_allclose(results["pinned_host"][0], results["device"][0], rtol=1e-6)
    assert results["device"][0][-1] != results["device"][0][0]  # it trained
    for a, b in zip(jax.tree.leaves(results["pinned_host"][1]), jax.tree.leaves(results["device"][1])):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)


def test_loop_bodies_count_once_per_trip():
    """XLA's cost analysis counts a while body once; the corrected count multiplies its matmuls by the
    trip count read from the compiled HLO."""

    def f(ws, x):
        return jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, ws)[0].sum()

    def counts(n):
        compiled = (
            jax.jit(jax.grad(f))
            .lower(
                jax.ShapeDtypeStruct((n, 64, 64), jnp.float32), jax.ShapeDtypeStruct((32, 64), jnp.float32)
            )
            .compile()
        )
        return xla_flops(compiled)

    raw_1, per_trip_1 = counts(1)
    raw_12, per_trip_12 = counts(12)
    matmul = 2 * 32 * 64 * 64
    # Forward x @ w and the weight gradient on every trip, the input gradient on all trips but the first.
    assert per_trip_12 == pytest.approx(matmul * (3 * 12 - 1), rel=0.05)
    assert raw_12 < per_trip_12 / 5  # what cost_analysis alone says: about one trip
    assert per_trip_1 == pytest.approx(raw_1, rel=1e-6)


def test_memory_sizes_and_mesh_axes_parse():
    assert parse_bytes("186GB") == 186 * 10**9
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_mesh_axes("fsdp=8,expert=8", 64) == {"data": 1, "fsdp": 8, "expert": 8}
    assert parse_mesh_axes("expert=4,fsdp=-1", 64) == {"data": 1, "fsdp": 16, "expert": 4}
    assert parse_mesh_axes(None, 8) == {"data": 1, "fsdp": 8, "expert": 1}
    for bad in ("fsdp=3", "tensor=8", "fsdp=-1,expert=-1"):
        with pytest.raises(ValueError):
            parse_mesh_axes(bad, 8)
    with pytest.raises(ValueError):
        parse_bytes("lots")


def test_model_compile_from_a_plain_shell(tmp_path):
    """A tiny model whose layers scan four times, on 8 simulated devices: the documented fields, the
    optimizer state counted on the host, XLA's FLOPs within 25% of the model's. The capacity dispatch:
    XLA:CPU runs `ragged_dot` (dropless) as a loop of dense matmuls over the experts, E times the work."""
    shape = dict(
        name="compile-tiny", vocab_size=256, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32,
        sequence_length=64, moe=dict(n_experts=8, top_k=2, expert_hidden=256, n_shared_experts=1,
                                     dispatch="capacity", capacity_factor=1.0, expert_parallel=False),
    )  # fmt: skip
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(shape))
    env = {key: value for key, value in os.environ.items() if key not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    command = [sys.executable, "-m", "tokenmill", "model", "compile", str(config), "--devices", "8",
               "--mesh", "fsdp=8", "--batch-size", "16", "--optimizer", "adamw", "--compute-dtype", "float32",
               "--optimizer-state", "pinned_host", "--device-memory", "1MB"]  # fmt: skip
    done = subprocess.run([*command, "--json"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["devices"] == 8 and report["mesh"] == {"data": 1, "fsdp": 8, "expert": 1}
    assert report["layer_groups"] == [{"start": 0, "period": 1, "repeats": 4}]
    memory = report["bytes_per_device"]
    assert set(memory) >= {"arguments", "outputs", "temps", "total", "host"}
    # AdamW's two moments of every parameter, split 8 ways, live on the host: about 2 x 4 bytes x params / 8.
    n_params = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(
        jax.eval_shape(lambda k: transformer.init_params(k, ModelConfig(**shape)),
                       jax.random.key(0))))  # fmt: skip
    assert 0.9 * 8 * n_params / 8 < memory["host"] < 1.3 * 8 * n_params / 8
    assert memory["arguments"] < 1.5 * 4 * n_params / 8  # the parameters, not the moments
    assert memory["total"] == memory["arguments"] + memory["outputs"] - memory["aliased"] + memory["temps"]
    assert (
        report["xla_flops_per_step"] > 2 * report["xla_cost_analysis_flops_per_step"]
    )  # four trips, not one
    assert 0.75 < report["xla_flops_per_step"] / report["model_flops_per_step"] < 1.25
    # The executed count adds the head and the capacity dispatch's padding and one-hot einsums.
    parts = report["model_flops_executed_parts"]
    assert parts["output_head"] > 0 and parts["dispatch_einsums"] > 0 and parts["newton_schulz"] == 0
    assert report["model_flops_executed"] > report["model_flops_per_step"]
    assert report["flops_agree"] and 0.75 < report["flops_ratio_executed"] < 1.25
    # Two rows per device: a second compile at 2 microbatches measures what one row of activations costs.
    estimates = {int(count): total for count, total in report["suggestions_estimated_totals"].items()}
    assert set(estimates) == {1, 2} and estimates[2] < estimates[1]
    assert estimates[1] == pytest.approx(memory["total"])
    assert "--microbatches N" in report["suggestions"][0]
    assert report["compile_seconds"] > 0
    assert not report["fits"] and report["margin_bytes"] < 0 and report["suggestions"]
    text = format_compile_report(report)  # what the command prints without --json
    for field in ("bytes_per_device", "xla_flops_per_step", "model_flops_per_step", "compile_seconds"):
        assert field in text
    assert "DOES NOT FIT" in text and "over 0 GB" in text


@pytest.mark.slow  # make test-slow: about two minutes each on 2 cores
@pytest.mark.parametrize("mesh", ["expert=64", "fsdp=8,expert=8"])
def test_the_reference_hero_fits_one_rack(mesh):
    """The 535B's whole train step for one rack (64 devices, 1,024 x 4,096 tokens in 16 microbatches, MuonH
    state on pinned host) compiles and fits a GB200's 186 GB per device, in the reference run's own layout
    (EP64, as configs/runs/marin-535b-a23b.yaml trains it) and in fsdp 8 x expert 8; XLA's FLOPs agree with
    the model's count of what the step runs; the step moves under 5 TB per device in EP64 (15 TB in fsdp 8 x
    expert 8, whose expert weights are gathered over fsdp in every microbatch)."""
    env = {key: value for key, value in os.environ.items() if key not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    command = [sys.executable, "-m", "tokenmill", "model", "compile", "configs/models/marin-535b-a23b.yaml",
               "--devices", "64", "--mesh", mesh, "--batch-size", "1024", "--sequence-length", "4096",
               "--microbatches", "16", "--optimizer-state", "pinned_host", "--json"]  # fmt: skip
    repo = MODELS.parents[1]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800, cwd=repo)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    memory = report["bytes_per_device"]
    assert report["fits"] and memory["total"] < 186e9, memory
    # MuonH's state: one fp32 number per parameter of the device's shards (dense and experts both split
    # over all 64 devices in either layout), on the host.
    assert memory["host"] == pytest.approx(memory["arguments"], rel=0.02) and 33e9 < memory["host"] < 35e9
    assert report["optimizer"] == "muonh" and report["dispatch"] == "expert_parallel/capacity"
    assert report["flops_agree"]
    moved = report["communication"]["bytes_per_device"]["total"]
    assert moved < (5e12 if mesh == "expert=64" else 20e12), moved
