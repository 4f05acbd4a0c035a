"""On 8 simulated CPU devices (data 2 x fsdp 2 x expert 2) the losses equal the single-device losses, with
the optimizer state in device memory or in pinned host memory.

XLA reads the device count when jax is first imported, and this test process may have imported jax already,
so the comparison runs in a fresh Python process with XLA_FLAGS set before the import.
"""

from __future__ import annotations

import textwrap

from conftest import run_on_simulated_devices

SCRIPT = textwrap.dedent(
    """
    import json, sys, tempfile
    import jax
    from tokenmill.trainer.model.shape import ModelConfig, MoEConfig
    from tokenmill.trainer.data.batch import SyntheticSource
    from tokenmill.trainer.model.sharding import make_mesh, param_shardings
    from tokenmill.trainer.model import transformer
    from tokenmill.trainer.run.config import Phase, RunConfig, resolve_run_config
    from tokenmill.trainer.run.loop import train

    assert jax.device_count() == 8, jax.devices()
    result = {}
    for dispatch in ("capacity", "dropless"):
        cfg = ModelConfig(
            name="t", vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
            sequence_length=32,
            sliding_window=16, sliding_window_layers=[1],
            moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=32, n_shared_experts=1, dispatch=dispatch,
                          capacity_factor=1.0, bias_rate=0.01),
        )
        meshes = ["2,2,2", "1,1,1"] + (["2,2,2/pinned_host"] if dispatch == "capacity" else [])
        for mesh in meshes:
            out = tempfile.mkdtemp()
            source = SyntheticSource(256, 32, 8, seed=0, active_vocab=64)
            shape, _, memory = mesh.partition("/")
            sizes = dict(zip(("data", "fsdp", "expert"), map(int, shape.split(","))))
            run = RunConfig(output=out, model=cfg, data={"batch_size": 8}, mesh=sizes,
                            logging={"peak_flops": 1e9}, schedule={"warmup_steps": 1},
                            optimizer={"state_memory": memory or "device"})
            rows = train(resolve_run_config(run, [Phase("pretraining", 0, 3)]), source)
            result[f"{dispatch}/{mesh}"] = [[r["loss"], r["grad_norm"], r["drop_fraction"]] for r in rows]
    abstract = jax.eval_shape(lambda k: transformer.init_params(k, cfg), jax.random.key(0))
    shardings = param_shardings(abstract, make_mesh((2, 2, 2)))
    result["w_gate_spec"] = str(shardings["layers"][0][0]["moe"]["w_gate"].spec)
    print("RESULT " + json.dumps(result))
    print(json.dumps(result), file=sys.stderr)
    """
)


def test_eight_devices_match_one_device():
    result = run_on_simulated_devices(SCRIPT)  # five tiny train steps compiled to run three times each
    # [layer repeats, experts, d_model, hidden]: the stacked layers' axis is not split.
    assert result["w_gate_spec"] == "P(None, 'expert', 'fsdp', None)"
    # The optimizer state in pinned host memory, brought to the devices a layer slice at a time, trains the
    # same as state in device memory.
    for key in ("capacity/2,2,2", "dropless/2,2,2", "capacity/2,2,2/pinned_host"):
        dispatch = key.split("/")[0]
        sharded, single = result[key], result[f"{dispatch}/1,1,1"]
        assert len(sharded) == len(single) == 3
        for (loss_a, grad_a, drop_a), (loss_b, grad_b, drop_b) in zip(sharded, single, strict=True):
            assert abs(loss_a - loss_b) < 1e-5 * abs(loss_b), (dispatch, sharded, single)
            assert abs(grad_a - grad_b) < 1e-4 * abs(grad_b)
            assert drop_a == drop_b
    assert any(row[2] > 0 for row in result["capacity/1,1,1"])  # the capacity path really dropped tokens
