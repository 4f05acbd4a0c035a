"""Every layout the chooser can pick computes the same step: on each mesh of 8 simulated CPU devices that
run/layouts.py's candidate_layouts returns for a small MoE model, the trainer's loss and its gradients
equal the single-device ones, for the capacity and the dropless dispatch.

What runs is the trainer's objective (transformer.loss_fn, as run/step.py differentiates it) under
value_and_grad, its inputs placed with the real shardings (sharding.param_shardings, batch_sharding), so
the expert-parallel path (model/expert_parallel.py) runs wherever the mesh has an expert axis and XLA's
partitioner splits the rest. The optimizer's update and gradient accumulation are checked against one
device elsewhere (test_trainer_multidevice.py, test_expert_parallel.py); this test covers the meshes.

XLA reads the device count when jax is first imported, and this test process may have imported jax already,
so every mesh runs in one fresh Python process with XLA_FLAGS set before the import (as in
test_expert_parallel.py), which prints its measurements as one JSON line; the assertions are made here,
one test per mesh and dispatch so that a failure names them.
"""

from __future__ import annotations

import json
import textwrap

import pytest
from conftest import run_on_simulated_devices

from tokenmill.trainer.model.shape import ModelConfig
from tokenmill.trainer.run.layouts import candidate_layouts

# Eight experts, so every expert axis of 8 devices divides them; a shared expert and latent experts, so
# every kind of parameter sharding.py places is there (one layer: more would add compile time, not layouts).
# A capacity factor of E/k = 4 gives every expert a slot per token, per batch row on one device and per
# (shard, expert) cell under expert parallelism: nothing drops on either side (where they drop differs by
# design, docs/trainer.md "Parallel layout").
SHAPE = dict(
    name="layouts", vocab_size=128, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8,
    sequence_length=16,
    moe=dict(n_experts=8, top_k=2, expert_hidden=16, n_shared_experts=1, latent_dim=16, capacity_factor=4.0),
)  # fmt: skip
DEVICES = 8
BATCH = 16  # two rows per device
CANDIDATES, REFUSED = candidate_layouts(ModelConfig(**SHAPE), DEVICES, BATCH, max_microbatches=1)
MESHES = [candidate.name for candidate in CANDIDATES]

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from tokenmill.trainer.data.batch import SyntheticSource
    from tokenmill.trainer.model import transformer
    from tokenmill.trainer.model.shape import ModelConfig
    from tokenmill.trainer.model.sharding import batch_sharding, make_mesh, param_shardings, replicated
    from tokenmill.trainer.run.layouts import AXES, candidate_layouts, mesh_text

    assert jax.device_count() == 8, jax.devices()
    shape, devices, batch_size, dispatches = json.loads(sys.argv[1])
    configs = {}
    for dispatch in dispatches:
        fields = dict(shape, moe=dict(shape["moe"], dispatch=dispatch))
        configs[dispatch] = ModelConfig(**fields)
    cfg = configs[dispatches[0]]
    candidates, _ = candidate_layouts(cfg, devices, batch_size, max_microbatches=1)

    params = jax.jit(lambda key: transformer.init_params(key, cfg))(jax.random.key(0))
    # A router bias away from zero, as after some balancing steps: the routing depends on it.
    bias = 0.1 * jax.random.normal(jax.random.key(1), (cfg.n_layers, cfg.moe.n_experts))
    data = SyntheticSource(cfg.vocab_size, cfg.sequence_length, batch_size, seed=0, active_vocab=64).batch(0)

    def step(params, bias, tokens, segment_ids):
        out = {}
        for dispatch, model_cfg in configs.items():
            objective = lambda p: transformer.loss_fn(p, bias, tokens, segment_ids, model_cfg, jnp.float32)
            (total, (loss, stats)), grads = jax.value_and_grad(objective, has_aux=True)(params)
            out[dispatch] = (total, loss, stats.load, stats.dropped, grads)
        return out

    def run(mesh_sizes):
        mesh = make_mesh(tuple(mesh_sizes[axis] for axis in AXES))
        with jax.set_mesh(mesh):
            placed = jax.device_put(params, param_shardings(params, mesh))
            tokens = jax.device_put(data.tokens, batch_sharding(mesh))
            segments = jax.device_put(data.segment_ids, batch_sharding(mesh))
            arguments = (placed, jax.device_put(bias, replicated(mesh)), tokens, segments)
            traced = jax.jit(step).trace(*arguments)
            out = jax.device_get(traced.lower().compile()(*arguments))
        split = sum(not leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(placed))
        return out, str(traced.jaxpr).count("all_to_all"), split

    def compare(got, want):
        total, loss, load, dropped, grads = got
        total_0, loss_0, load_0, dropped_0, grads_0 = want
        paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(grads)[0]]
        # Each leaf's largest difference over its largest value: the gradient as a whole, to fp32 rounding.
        worst, where = 0.0, None
        for path, a, b in zip(paths, jax.tree.leaves(grads), jax.tree.leaves(grads_0), strict=True):
            diff = float(np.max(np.abs(a - b))) / (float(np.max(np.abs(b))) + 1e-30)
            if diff > worst:
                worst, where = diff, path
        norm = lambda tree: float(np.sqrt(sum(np.sum(np.square(leaf)) for leaf in jax.tree.leaves(tree))))
        return {
            "objective": [float(total), float(total_0)],
            "loss": [float(loss), float(loss_0)],
            "grad_norm": [norm(grads), norm(grads_0)],
            "grad_worst": worst,
            "grad_worst_leaf": where,
            "load": float(np.max(np.abs(load - load_0))),
            "load_total": float(np.sum(load_0)),
            "dropped": [int(np.sum(dropped)), int(np.sum(dropped_0))],
        }

    reference, _, _ = run({"data": 1, "fsdp": 1, "expert": 1})
    result = {"meshes": {}}
    for candidate in candidates:
        out, all_to_alls, split = run(candidate.mesh)
        result["meshes"][mesh_text(candidate.mesh)] = {
            "all_to_all": all_to_alls,
            "split_params": split,
            **{dispatch: compare(out[dispatch], reference[dispatch]) for dispatch in dispatches},
        }
    print("RESULT " + json.dumps(result))
    """
)


# The reference run trains with capacity; dropless (what it evaluates with) on every mesh is the slow half.
@pytest.fixture(scope="module", params=["capacity", pytest.param("dropless", marks=pytest.mark.slow)])
def measured(request) -> dict:
    """One subprocess for every mesh, per dispatch: importing jax and compiling dominate the time."""
    arguments = json.dumps([SHAPE, DEVICES, BATCH, [request.param]])
    return {"dispatch": request.param, **run_on_simulated_devices(SCRIPT, arguments, devices=DEVICES)}


def test_every_mesh_of_eight_devices_is_a_candidate_and_was_run(measured):
    # 8 experts divide every expert axis of 8 devices: all ten meshes, none refused.
    assert REFUSED == [] and len(MESHES) == 10
    assert sorted(measured["meshes"]) == sorted(MESHES)


@pytest.mark.parametrize("mesh", MESHES)
def test_loss_and_gradients_on_the_mesh_equal_one_device(measured, mesh):
    result = measured["meshes"][mesh]
    got = result[measured["dispatch"]]
    sizes = dict(part.split("=") for part in mesh.split(","))
    loss, loss_0 = got["loss"]
    objective, objective_0 = got["objective"]
    assert loss == pytest.approx(loss_0, rel=1e-5), got
    assert objective == pytest.approx(objective_0, rel=1e-5), got
    norm, norm_0 = got["grad_norm"]
    assert norm_0 > 0 and norm == pytest.approx(norm_0, rel=1e-4), got
    assert got["grad_worst"] < 1e-4, got
    # The same routing: every expert got the same tokens (the load counts copies, so it is exact).
    assert got["load"] == 0 and got["load_total"] > 0, got
    assert got["dropped"] == [0, 0], got
    # The layout was really used: parameters split wherever fsdp or expert is > 1, and the routed experts
    # exchanged over the expert axis (all-to-alls forward and their transposes backward) wherever it is.
    if int(sizes["fsdp"]) > 1 or int(sizes["expert"]) > 1:
        assert result["split_params"] > 0, result
    if int(sizes["expert"]) > 1:
        assert result["all_to_all"] >= 4, result
    else:
        assert result["all_to_all"] == 0, result
