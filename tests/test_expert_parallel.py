"""Expert parallelism (model/expert_parallel.py) on 8 simulated CPU devices against the single-device block.

XLA reads the device count when jax is first imported, and this test process may have imported jax already,
so each check runs in a fresh Python process with XLA_FLAGS set before the import (as in
test_trainer_multidevice.py) and prints its measurements as one JSON line; the assertions are made here.
"""

from __future__ import annotations

import textwrap

import pytest
from conftest import run_on_simulated_devices

COMMON = textwrap.dedent(
    """
    import json, logging, math
    import jax, jax.numpy as jnp, numpy as np
    from tokenmill.trainer.model import expert_parallel, moe, router
    from tokenmill.trainer.model.shape import ModelConfig, MoEConfig
    from tokenmill.trainer.model.sharding import make_mesh

    assert jax.device_count() == 8, jax.devices()

    def shape(**moe_fields):
        fields = dict(n_experts=8, top_k=2, expert_hidden=12)
        fields.update(moe_fields)
        return ModelConfig(name="t", vocab_size=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1,
                           head_dim=8, sequence_length=8, moe=MoEConfig(**fields))

    def inputs(cfg, batch, seq, seed=0):
        # Weights scaled up from the init so that outputs and gradients are O(1) and differences show.
        params = jax.tree.map(lambda w: 8 * w, moe.init_moe_params(jax.random.key(seed), cfg))
        x = jax.random.normal(jax.random.key(seed + 1), (batch, seq, cfg.d_model))
        bias = 0.1 * jax.random.normal(jax.random.key(seed + 2), (cfg.moe.n_experts,))
        return params, x, bias

    def compare(mesh_shape, cfg, batch=8, seq=8, transport=None):
        \"\"\"(reference, expert-parallel, routing) on one mesh, in one compiled program: the reference is
        moe_block with expert parallelism off (moe.py's dispatches); `transport` runs routed_experts
        alone on that transport (then the shape must have no shared or latent experts).\"\"\"
        params, x, bias = inputs(cfg, batch, seq)
        reference_moe = cfg.moe.model_copy(update={"expert_parallel": False})

        def loss(p, x, m, expert_parallel_transport=None):
            if expert_parallel_transport is None:
                y, stats = moe.moe_block(p, x, bias, m)
            else:
                y, stats = expert_parallel.routed_experts(p, x, x, bias, m, expert_parallel_transport)
            return jnp.sum(jnp.sin(y)), (y, stats)

        def both(p, x):
            grad = lambda *args: jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(p, x, *args)
            routing = router.route(x.reshape(batch * seq, -1), p["router"], bias, reference_moe)
            return grad(reference_moe), grad(cfg.moe, transport), routing.expert_ids

        with jax.set_mesh(make_mesh(mesh_shape)):
            traced = jax.jit(both).trace(params, x)
            reference, parallel, ids = traced.lower().compile()(params, x)
        return reference, parallel, np.asarray(ids), str(traced.jaxpr)

    def differences(ref, got):
        (loss_a, (y_a, stats_a)), grads_a = ref
        (loss_b, (y_b, stats_b)), grads_b = got
        scale = lambda a: float(jnp.max(jnp.abs(a))) + 1e-12
        rel = lambda a, b: float(jnp.max(jnp.abs(a - b))) / scale(a)
        return {
            "loss": [float(loss_a), float(loss_b)],
            "y": rel(y_a, y_b),
            "grads": max(rel(a, b) for a, b in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b))),
            "load": rel(stats_a.load, stats_b.load),
            "quantile_bias": rel(stats_a.quantile_bias, stats_b.quantile_bias),
            "quantile_bias_scale": scale(stats_a.quantile_bias),
            "balance_loss": rel(stats_a.balance_loss, stats_b.balance_loss),
            "z_loss": rel(stats_a.z_loss, stats_b.z_loss),
            "dropped": [int(stats_a.dropped), int(stats_b.dropped)],
        }
    """
)


def run_script(*parts: str) -> dict:
    """Run COMMON + parts on 8 simulated CPU devices; the parts fill `result`, printed as one JSON line."""
    script = COMMON + "result = {}\n" + "".join(parts) + 'print("RESULT " + json.dumps(result))\n'
    return run_on_simulated_devices(script)


EQUALITY = """
roomy = dict(capacity_factor=100.0)
# Everything the block has: shared expert, latent experts, quantile balancing from a global histogram.
full = dict(n_shared_experts=1, latent_dim=8, balancing="quantile", bias_space="logit", quantile_bins=64)
# Two meshes: an expert group of 2 in each of 4 data x fsdp positions, and of 4 in each of 2.
for dispatch, mesh in (("capacity", (2, 2, 2)), ("dropless", (1, 2, 4))):
    reference, parallel, _, jaxpr = compare(mesh, shape(dispatch=dispatch, **roomy, **full))
    result[dispatch] = differences(reference, parallel)
    result[f"{dispatch}/all_to_all"] = jaxpr.count("all_to_all")
# The ragged transport's bookkeeping (offsets, expert-major receive layout, reverse exchange), with the
# collective emulated by a dense all_to_all since XLA:CPU lacks ragged-all-to-all.
cfg = shape(dispatch="dropless", n_experts=16, top_k=3)
reference, parallel, _, _ = compare((2, 1, 4), cfg, batch=16, transport="ragged_emulated")
result["ragged_emulated"] = differences(reference, parallel)
# The native ragged path traces and lowers on CPU (compiling is what XLA:CPU cannot do).
params, x, bias = inputs(cfg, 16, 8)
native = jax.jit(lambda p, x: expert_parallel.routed_experts(p, x, x, bias, cfg.moe, "ragged"))
with jax.set_mesh(make_mesh((2, 1, 4))):
    result["ragged_lowered"] = "ragged_all_to_all" in native.lower(params, x).as_text()
result["ragged_supported_on_cpu"] = expert_parallel.ragged_all_to_all_supported("cpu")
# The probe says yes where the collective compiles: here, the emulation standing in for it, asked while a
# step is being traced on a mesh (as moe_block asks).
native_collective = jax.lax.ragged_all_to_all
jax.lax.ragged_all_to_all = expert_parallel.emulated_ragged_all_to_all
probed = []
probe = expert_parallel.ragged_all_to_all_supported.__wrapped__  # past the per-backend cache
with jax.set_mesh(make_mesh((1, 1, 8))):
    jax.jit(lambda x: probed.append(probe("cpu")) or x).trace(x)
jax.lax.ragged_all_to_all = native_collective
result["probe_with_a_compiling_collective"] = probed
"""


@pytest.fixture(scope="module")
def measured() -> dict:
    """One subprocess for the default tests: importing jax and compiling dominate their time."""
    return run_script(EQUALITY, DROPS, REFUSALS)


def test_forward_gradients_and_stats_equal_single_device_for_both_transports(measured):
    result = measured
    for name in ("capacity", "dropless"):
        diff = result[name]
        assert diff["dropped"] == [0, 0], name
        assert abs(diff["loss"][0] - diff["loss"][1]) < 1e-5 * abs(diff["loss"][0]), (name, diff)
        assert diff["y"] < 1e-5 and diff["grads"] < 1e-5, (name, diff)
        assert diff["load"] == 0 and diff["quantile_bias"] == 0, (name, diff)
        assert diff["quantile_bias_scale"] > 0.01  # a real balancing signal, not zeros on both sides
        assert diff["balance_loss"] < 1e-6 and diff["z_loss"] < 1e-6, (name, diff)
        # The expert-parallel path ran: two all-to-alls forward, their transposes backward.
        assert result[name + "/all_to_all"] >= 4
    ragged = result["ragged_emulated"]
    assert ragged["dropped"] == [0, 0]
    assert ragged["y"] < 1e-5 and ragged["grads"] < 1e-5 and ragged["load"] == 0, ragged
    assert result["ragged_lowered"] is True
    # CPU has no ragged-all-to-all: dropless fell back to the capacity transport and said so once.
    assert result["ragged_supported_on_cpu"] is False
    assert result["probe_with_a_compiling_collective"] == [True]
    assert result["stderr"].count("does not implement ragged_all_to_all") == 1


DROPS = """
# One batch row per device: capacity per (sender shard x expert) is the single-device per-row capacity,
# so a small factor drops exactly the same copies.
reference, parallel, _, _ = compare((1, 1, 8), shape(capacity_factor=0.5), batch=8, seq=16)
result["one_row"] = differences(reference, parallel)

# Four rows per device share their cells: the drops are the overflow of each (shard, expert) cell,
# counted here independently from the routing.
batch, seq = 32, 8
cfg = shape(capacity_factor=0.5)
_, parallel, ids, _ = compare((1, 1, 8), cfg, batch, seq)
by_shard = ids.reshape(8, -1)  # [shard, its tokens' copies]
capacity = expert_parallel.shard_capacity(batch * seq // 8, cfg.moe)
expected = int(sum(max(0, int((row == e).sum()) - capacity) for row in by_shard for e in range(8)))
result["pooled"] = {"expected": expected, "dropped": int(parallel[0][1][1].dropped), "capacity": capacity}

# The ragged transport with a receive limit: what overflows a device's buffer is dropped and counted.
limited = shape(dispatch="dropless", receive_capacity_factor=0.5)
_, parallel, ids, _ = compare((1, 1, 8), limited, batch, seq, transport="ragged_emulated")
rows = expert_parallel.receive_rows(batch * seq // 8, 8, limited.moe)
arriving = np.bincount(ids.reshape(-1), minlength=8)  # 8 experts on 8 devices: one expert per receiver
result["ragged_limit"] = {
    "expected": int(np.maximum(arriving - rows, 0).sum()),
    "dropped": int(parallel[0][1][1].dropped),
    "finite": bool(all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(parallel[1]))),
}
"""


def test_small_capacity_drops_and_counts_drops(measured):
    result = measured
    one_row = result["one_row"]
    assert one_row["dropped"][0] > 0 and one_row["dropped"][0] == one_row["dropped"][1], one_row
    assert one_row["y"] < 1e-5 and one_row["grads"] < 1e-5, one_row
    pooled = result["pooled"]
    assert pooled["expected"] > 0 and pooled["dropped"] == pooled["expected"], pooled
    ragged = result["ragged_limit"]
    assert ragged["expected"] > 0 and ragged["dropped"] == ragged["expected"], ragged
    assert ragged["finite"]


REFUSALS = """
def refusal(cfg):
    params, x, bias = inputs(cfg, 8, 8)
    try:
        with jax.set_mesh(make_mesh((1, 1, 8))):
            jax.jit(lambda p, x: moe.moe_block(p, x, bias, cfg.moe)).trace(params, x)
    except ValueError as error:
        return str(error)
    return None

result["refusals"] = {
    # an exact quantile over the global batch is not available per device
    "quantile": refusal(shape(balancing="quantile")),
    "split": refusal(shape(n_experts=6)),
}
"""


def test_unsupported_layouts_are_refused_with_the_reason(measured):
    result = measured["refusals"]
    assert "quantile_bins" in result["quantile"]
    assert "6 experts do not split over an expert axis of 8" in result["split"]


TRAIN_STEP = """
from tokenmill.trainer.data.batch import SyntheticSource
from tokenmill.trainer.run.config import Phase, RunConfig, resolve_run_config
from tokenmill.trainer.model.sharding import batch_sharding
from tokenmill.trainer.run.step import compile_train_step

for dispatch in ("capacity", "dropless"):
    cfg = ModelConfig(
        name="t", vocab_size=128, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
        sequence_length=16,
        moe=MoEConfig(n_experts=8, top_k=2, expert_hidden=16, n_shared_experts=1, dispatch=dispatch,
                      capacity_factor=100.0),
    )
    phases = [Phase("pretraining", 0, 2)]
    run = resolve_run_config(RunConfig(model=cfg, data={"batch_size": 8, "sequence_length": 16},
                                       optimizer={"kind": "adamw", "lr": 1e-2}), phases)
    source = SyntheticSource(128, 16, 8, seed=0, active_vocab=64)
    for mesh_shape in ((1, 1, 1), (1, 2, 4)):
        mesh = make_mesh(mesh_shape)
        with jax.set_mesh(mesh):
            init_fn, step_fn, _ = compile_train_step(run, mesh)
            state = init_fn(jax.random.key(0))
            rows = []
            for i in range(2):
                batch = source.batch(i)
                tokens = jax.device_put(batch.tokens, batch_sharding(mesh))
                segments = jax.device_put(batch.segment_ids, batch_sharding(mesh))
                state, metrics = step_fn(state, tokens, segments)
                rows.append([float(metrics["loss"]), float(metrics["grad_norm"])])
            result[f"{dispatch}/{mesh_shape}"] = rows
            result[f"{dispatch}/{mesh_shape}/bias"] = np.asarray(state["router_bias"]).tolist()
"""


@pytest.mark.slow
def test_train_steps_on_an_expert_parallel_mesh_match_one_device():
    result = run_script(TRAIN_STEP)
    for dispatch in ("capacity", "dropless"):
        single, parallel = result[f"{dispatch}/(1, 1, 1)"], result[f"{dispatch}/(1, 2, 4)"]
        for (loss_a, grad_a), (loss_b, grad_b) in zip(single, parallel, strict=True):
            assert abs(loss_a - loss_b) < 1e-5 * loss_a and abs(grad_a - grad_b) < 1e-4 * grad_a
        bias_a = result[f"{dispatch}/(1, 1, 1)/bias"]
        bias_b = result[f"{dispatch}/(1, 2, 4)/bias"]
        assert bias_a == bias_b and any(any(row) for row in bias_a)  # the same, non-zero load statistics
