"""The training loop: the loss falls, resume is exact, phases continue, NaNs stop the run, bad data is
refused, metrics have the documented keys, schedules span phases."""

from __future__ import annotations

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_trainer_cli import small_plan

from tokenmill.trainer.data.batch import Batch, SyntheticSource, check_source, segments_from_eos
from tokenmill.trainer.model.shape import ModelConfig, MoEConfig
from tokenmill.trainer.run.config import Phase, RunConfig, phases_from_plan, resolve_run_config, set_dotted
from tokenmill.trainer.run.loop import train
from tokenmill.trainer.run.optim import LayerwiseOptimizer, Schedule, make_optimizer
from tokenmill.trainer.run.resume import TrainingError
from tokenmill.trainer.run.step import make_schedule

METRIC_KEYS = {
    "step", "phase", "loss", "lr", "tokens", "tokens_per_second", "flops", "mfu", "grad_norm", "param_norm",
    "router_bias_norm", "expert_imbalance", "expert_load", "drop_fraction", "time",
}  # fmt: skip


def tiny(**moe_overrides) -> ModelConfig:
    moe_cfg = dict(n_experts=4, top_k=2, expert_hidden=32, n_shared_experts=1, bias_rate=0.01)
    moe_cfg.update(moe_overrides)
    return ModelConfig(
        name="test", vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
        sequence_length=32,
        moe=MoEConfig(**moe_cfg),
    )  # fmt: skip


def config(tmp_path, model_cfg: ModelConfig | None = None, **overrides) -> RunConfig:
    """The tests' run: 4 sequences a step, AdamW at 3e-3; overrides by dotted field (`schedule__steps=3`)."""
    settings = {"output": str(tmp_path / "run"), "model": (model_cfg or tiny()).model_dump(),
                "data": {"batch_size": 4}, "optimizer": {"lr": 3e-3}, "schedule": {"warmup_steps": 5},
                "logging": {"peak_flops": 1e9}, "checkpoint": {"every": 1000}}  # fmt: skip
    return RunConfig.model_validate(
        set_dotted(settings, {key.replace("__", "."): value for key, value in overrides.items()})
    )


def source(cfg: ModelConfig, batch_size: int = 4, seed: int = 0) -> SyntheticSource:
    return SyntheticSource(cfg.vocab_size, cfg.sequence_length, batch_size, seed, active_vocab=64)


def test_loss_falls_quickly(tmp_path):
    started = time.perf_counter()
    model_cfg = tiny()
    rows = train(
        resolve_run_config(config(tmp_path, model_cfg), [Phase("pretraining", 0, 60)]), source(model_cfg)
    )
    assert len(rows) == 60
    first, last = np.mean([r["loss"] for r in rows[:5]]), np.mean([r["loss"] for r in rows[-5:]])
    assert first > 5.0 and last < first - 1.5, (first, last)
    assert time.perf_counter() - started < 120
    assert METRIC_KEYS <= set(rows[0])
    written = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in written] == list(range(60))
    row = written[-1]
    assert row["tokens"] == 60 * 4 * 32 and row["flops"] > 0 and 0 < row["mfu"]
    assert len(row["router_bias_norm"]) == 2 and len(row["expert_load"]) == 2
    assert all(abs(sum(layer) - 1) < 1e-3 for layer in row["expert_load"])
    # The whole per-expert load at the first and last step (and every logging.expert_load_every = 100);
    # every row has each layer's imbalance, the busiest expert's share x the number of experts.
    assert [r["step"] for r in written if "expert_load" in r] == [0, 59]
    for r in (written[0], written[-1]):
        expected = [max(layer) * len(layer) / sum(layer) for layer in r["expert_load"]]
        np.testing.assert_allclose(r["expert_imbalance"], expected, rtol=1e-3)
    assert all(len(r["expert_imbalance"]) == 2 and min(r["expert_imbalance"]) >= 1.0 for r in written)
    assert 0 <= row["drop_fraction"] < 1
    config_json = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config_json["model"]["d_model"] == 32 and config_json["schedule"]["total_steps"] == 60


def test_resume_is_exact(tmp_path):
    model_cfg = tiny()
    phases = [Phase("pretraining", 0, 8)]
    straight = train(resolve_run_config(config(tmp_path / "a"), phases), source(model_cfg))
    # Four steps, then "killed" (the checkpoint at 4 is the last thing it wrote), then the same command again.
    interrupted = config(tmp_path / "b", checkpoint__every=4)
    first = train(resolve_run_config(interrupted, phases), source(model_cfg), stop_after=4)
    second = train(resolve_run_config(config(tmp_path / "b", checkpoint__every=4), phases), source(model_cfg))
    assert [r["step"] for r in first] == [0, 1, 2, 3] and [r["step"] for r in second] == [4, 5, 6, 7]
    assert [r["loss"] for r in first + second] == [r["loss"] for r in straight]
    assert [r["router_bias_norm"] for r in first + second] == [r["router_bias_norm"] for r in straight]
    lines = (tmp_path / "b" / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(8))


def test_midtraining_continues_from_pretraining_with_the_decay(tmp_path):
    model_cfg = tiny()
    phases = phases_from_plan(small_plan({"pretraining": 6, "midtraining": 4}))
    assert phases == [Phase("pretraining", 0, 6), Phase("midtraining", 6, 10)]
    with pytest.raises(TrainingError, match="continues from the previous phase"):
        train(
            resolve_run_config(config(tmp_path, data__phase="midtraining", schedule__warmup_steps=2), phases),
            source(model_cfg),
        )
    # Pretraining stops early (3 of its 6 steps); midtraining still starts at its own step 6.
    pre = train(
        resolve_run_config(config(tmp_path, schedule__steps=3, schedule__warmup_steps=2), phases),
        source(model_cfg),
    )
    mid = train(
        resolve_run_config(config(tmp_path, data__phase="midtraining", schedule__warmup_steps=2), phases),
        source(model_cfg, seed=1),
    )
    assert [r["step"] for r in pre] == [0, 1, 2] and [r["step"] for r in mid] == [6, 7, 8, 9]
    assert {r["phase"] for r in mid} == {"midtraining"}
    assert mid[0]["tokens"] == 4 * (4 * 32)  # tokens actually trained: 3 steps of pretraining, then this one
    lrs = [r["lr"] for r in mid]
    assert lrs[0] == pytest.approx(3e-3) and all(a > b for a, b in zip(lrs, lrs[1:], strict=False))
    assert mid[0]["loss"] < pre[0]["loss"]  # it did start from the trained weights
    config_json = json.loads((tmp_path / "run" / "config.json").read_text())
    assert set(config_json["phases"]) == {"pretraining", "midtraining"}


def test_nan_loss_stops_and_names_the_last_good_checkpoint(tmp_path):
    model_cfg = tiny()
    cfg = config(
        tmp_path, optimizer__lr=1e30, schedule__warmup_steps=0, checkpoint__every=1, optimizer__clip_norm=1e30
    )
    with pytest.raises(
        TrainingError, match=r"at step \d+ .*Last good checkpoint: .*checkpoints/\d+"
    ) as error:
        train(resolve_run_config(cfg, [Phase("pretraining", 0, 20)]), source(model_cfg))
    assert "loss is" in str(error.value)


def test_schedules_span_phases(tmp_path):
    phases = [Phase("pretraining", 0, 80), Phase("midtraining", 80, 100)]
    wsd = make_schedule(
        resolve_run_config(
            config(tmp_path, optimizer__lr=1.0, schedule__warmup_steps=10, schedule__min_lr_ratio=0.1), phases
        )
    )
    assert (wsd.total_steps, wsd.decay_steps) == (100, 20)
    assert float(wsd(0)) == pytest.approx(0.1) and float(wsd(9)) == pytest.approx(1.0)
    assert float(wsd(79)) == pytest.approx(1.0) and float(wsd(90)) == pytest.approx(0.55)
    assert float(wsd(100)) == pytest.approx(0.1)
    linear = Schedule("linear", 1.0, 110, 10, 0)
    assert float(linear(10)) == pytest.approx(1.0) and float(linear(60)) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        Schedule("wsd", 1.0, 10, 8, 8)


def test_synthetic_source_is_deterministic_and_sliced_by_process():
    whole = SyntheticSource(1000, 64, 8, seed=3)
    halves = [SyntheticSource(1000, 64, 8, seed=3, process_index=i, process_count=2) for i in range(2)]
    batch = whole.batch(5)
    assert batch.tokens.shape == (8, 65) and batch.tokens.dtype == np.int32
    np.testing.assert_array_equal(batch.tokens, whole.batch(5).tokens)
    np.testing.assert_array_equal(batch.tokens, np.concatenate([h.batch(5).tokens for h in halves]))
    assert not np.array_equal(batch.tokens, whole.batch(6).tokens)
    assert (batch.tokens == 0).any()  # documents end with end-of-text


def test_segment_ids_split_after_end_of_text():
    tokens = np.array([[5, 6, 0, 7, 0, 0, 8]])
    np.testing.assert_array_equal(segments_from_eos(tokens, 0), [[0, 0, 0, 1, 1, 2, 3]])


class _Shards:
    def __init__(self, vocab_size: int, sha: str):
        self.vocab_size, self.tokenizer_sha256 = vocab_size, sha

    def batch(self, step: int) -> Batch:
        raise AssertionError("not reached")


def test_fail_fast_on_tokenizer_hash_and_vocabulary():
    with pytest.raises(ValueError, match="tokenizer sha256 aaa.*names tokenizer sha256 bbb"):
        check_source(_Shards(100, "aaa"), 256, "bbb")
    with pytest.raises(ValueError, match=r"vocabulary \(300\) is larger than the model's vocab_size \(256\)"):
        check_source(_Shards(300, "aaa"), 256, "aaa")
    check_source(_Shards(256, "aaa"), 256, "aaa")


def test_out_of_vocabulary_tokens_are_refused(tmp_path):
    class Wide(SyntheticSource):
        def batch(self, step: int) -> Batch:
            b = super().batch(step)
            return Batch(b.tokens + 300, b.segment_ids)

    model_cfg = tiny()
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        train(resolve_run_config(config(tmp_path, model_cfg), [Phase("pretraining", 0, 2)]), Wide(256, 32, 4))


def test_muon_orthogonalises_matrices_and_leaves_the_rest_to_adam():
    params = {
        "embed": jnp.ones((16, 8)),
        "w": jax.random.normal(jax.random.key(0), (8, 4)),
        "experts": jax.random.normal(jax.random.key(1), (3, 8, 4)),
        "norm": jnp.ones((8,)),
    }
    grads = jax.tree.map(lambda x: jax.random.normal(jax.random.key(2), x.shape), params)
    tx = make_optimizer("muon", weight_decay=0.0, clip_norm=1e9)
    updates, _ = tx.update(grads, tx.init(params), params)
    assert jax.tree.structure(updates) == jax.tree.structure(params)
    # Muon's update of a matrix has (near-)equal singular values; each expert's matrix on its own.
    singular = jnp.linalg.svd(updates["w"], compute_uv=False)
    assert float(singular.max() / singular.min()) < 2.0
    for e in range(3):
        s = jnp.linalg.svd(updates["experts"][e], compute_uv=False)
        assert float(s.max() / s.min()) < 2.0


def test_weights_and_biases_gets_the_metrics_when_installed(tmp_path, monkeypatch):
    logged = []

    class Run:
        def log(self, row, step):
            logged.append((step, row))

        def finish(self):
            logged.append("finished")

    class FakeWandb:
        @staticmethod
        def init(**kwargs):
            assert kwargs["project"] == "tokenmill-test" and kwargs["name"] == "run"
            return Run()

    monkeypatch.setitem(sys.modules, "wandb", FakeWandb)
    model_cfg = tiny()
    cfg = config(tmp_path, schedule__steps=2, logging__wandb_project="tokenmill-test")
    train(
        resolve_run_config(cfg, [Phase("pretraining", 0, 60)]), source(model_cfg)
    )  # the loss test's compile
    assert [step for step, _ in logged[:2]] == [0, 1] and logged[-1] == "finished"
    row = logged[0][1]
    assert {"loss", "lr", "mfu", "router_bias_norm/layer0", "expert_imbalance/layer1"} <= set(row)


@pytest.mark.slow  # make test-slow
@pytest.mark.parametrize("balancing", ["bias", "none"])
def test_microbatches_equal_one_pass(balancing):
    """Gradient accumulation over 2 microbatches is the one-pass step: loss, gradient norm, the router load
    behind the bias update, and the parameters after the update agree to float rounding (fp32)."""
    from tokenmill.trainer.model import transformer
    from tokenmill.trainer.run.step import make_train_step

    model_cfg = tiny(dispatch="dropless", balancing=balancing)
    params = transformer.init_params(jax.random.key(0), model_cfg)
    tx = LayerwiseOptimizer(make_optimizer("adamw", weight_decay=0.1, clip_norm=None), clip_norm=1.0)
    schedule = Schedule("wsd", 3e-3, 10, 0, 2)
    state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params),
             "router_bias": transformer.init_router_bias(model_cfg)}  # fmt: skip
    batch = source(model_cfg, batch_size=4).batch(0)
    tokens, segments = jnp.asarray(batch.tokens), jnp.asarray(batch.segment_ids)
    outcomes = {}
    for n in (1, 2):
        step = jax.jit(make_train_step(model_cfg, tx, schedule, jnp.float32, microbatches=n))
        outcomes[n] = step(state, tokens, segments)
    (one, one_metrics), (two, two_metrics) = outcomes[1], outcomes[2]
    for key in ("loss", "objective", "grad_norm", "expert_load", "drop_fraction"):
        np.testing.assert_allclose(two_metrics[key], one_metrics[key], rtol=2e-5, atol=1e-7, err_msg=key)
    np.testing.assert_array_equal(two["router_bias"], one["router_bias"])
    if balancing == "bias":
        assert np.abs(np.asarray(one["router_bias"])).sum() > 0  # the update ran, from the same load
    # Adam's first update is about lr x sign(gradient) (3e-3 here), so a gradient near zero turns float
    # rounding into up to ~1e-6; a wrong gradient would differ by the whole update.
    for a, b in zip(jax.tree.leaves(two["params"]), jax.tree.leaves(one["params"]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-5)
    moved = [np.abs(np.asarray(a) - np.asarray(b)).max() for a, b in zip(jax.tree.leaves(one["params"]),
             jax.tree.leaves(params), strict=True)]  # fmt: skip
    assert max(moved) > 1e-3  # the step changed the parameters


def test_microbatches_must_divide_the_batch(tmp_path):
    from tokenmill.trainer.run.config import RunConfigError

    with pytest.raises(RunConfigError, match="microbatches 3 does not divide the batch of 4"):
        resolve_run_config(config(tmp_path, optimizer__microbatches=3), [Phase("pretraining", 0, 5)])
