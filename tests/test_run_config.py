"""Run configurations: `tokenmill train --config FILE`, flags generated from the configuration's fields that
win over the file, a run's config.json that trains the same run again, and errors that name file and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from test_trainer_cli import MIXTURE, TINY, read_metrics, small_plan, write_tokens

from tokenmill.cli import build_parser, main
from tokenmill.errors import UsageError
from tokenmill.mixtures import load_mixture, plan_mixture
from tokenmill.trainer.commands.train import run_config_of
from tokenmill.trainer.ladder import load_ladder, plan_ladder
from tokenmill.trainer.run.config import (
    Phase,
    RunConfig,
    RunConfigError,
    build_run_config,
    phases_from_plan,
    read_run_config_file,
    resolve_run_config,
)
from tokenmill.trainer.run.heuristic import MAY_RECIPE, warmup_steps_for

REPO = Path(__file__).resolve().parents[1]
RUNS = REPO / "configs" / "runs"


def parse(*argv: str) -> RunConfig:
    return run_config_of(build_parser().parse_args(["train", *argv]))


def test_a_runs_config_json_trains_the_same_run_again(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write_tokens(tmp_path / "tokens", vocab_size=4096)
    (tmp_path / "mixture.yaml").write_text(MIXTURE)
    (tmp_path / "run.yaml").write_text(
        f"output: runs/first\nmodel: {TINY}\ndata: {{mixture: mixture.yaml}}\nschedule: {{steps: 3}}\n"
        "optimizer: {lr: 1.0e-2, beta2: 0.9}\nlogging: {peak_flops: 1.0e9}\n"
    )
    assert main(["train", "--config", "run.yaml", "--optimizer.beta2", "0.99", "--seed", "7"]) == 0
    first = json.loads(Path("runs/first/config.json").read_text())
    # The flags won over the file; what neither gave is resolved: the plan's batch, the shards' folder from
    # the mixture's counts:, the recipe's schedule, the mesh and the tokenizer the shards were made with.
    assert first["optimizer"] == {"kind": "adamw", "lr_heuristic": MAY_RECIPE.name, "lr": 1e-2,
                                  "adam_lr": None, "beta1": 0.9, "beta2": 0.99, "epsilon": 1e-8,
                                  "weight_decay": 0.1, "clip_norm": 1.0,
                                  "state_memory": "device", "microbatches": 1}  # fmt: skip
    assert first["seed"] == 7 and first["data"]["tokens"] == "tokens" and first["data"]["batch_size"] == 8
    assert first["data"]["tokenizer_sha256"] == "a" * 64 and first["mesh"]["fsdp"] >= 1
    assert (
        first["schedule"]["steps"] == 3 and first["schedule"]["total_steps"] == first["plan"]["total_steps"]
    )
    assert (
        first["model"]["name"] == "tiny" and first["phases"]["pretraining"]["optimizer"] == first["optimizer"]
    )

    assert main(["train", "--config", "runs/first/config.json", "--output", "runs/second"]) == 0
    losses = [row["loss"] for row in read_metrics(Path("runs/first"))]
    assert len(losses) == 3 and [row["loss"] for row in read_metrics(Path("runs/second"))] == losses
    second = json.loads(Path("runs/second/config.json").read_text())

    def settings(config: dict) -> dict:
        # The history's entries say when and into which folder each configuration began; nothing else differs.
        history = [
            {**{k: v for k, v in entry.items() if k not in ("started", "settings")},
             "settings": {k: v for k, v in entry["settings"].items() if k != "output"}}
            for entry in config["history"]
        ]  # fmt: skip
        kept = {key: value for key, value in config.items() if key not in ("output", "phases", "history")}
        return {**kept, "history": history}

    assert settings(second) == settings(first) and second["output"] == "runs/second"
    # A flag still wins over a config.json.
    assert parse("--config", "runs/first/config.json", "--optimizer.lr", "3e-2").optimizer.lr == 3e-2


def test_flags_win_over_the_file_and_each_setting_has_one_flag(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(
        f"model: {TINY}\noutput: runs/x\noptimizer: {{lr: 1.0e-2, beta1: 0.85}}\nschedule: {{steps: 5}}\n"
        "mesh: {data: 2, fsdp: -1, expert: 1}\ndata: {synthetic: true, shard_cache: 2G}\n"
    )
    run = parse("--config", str(config), "--optimizer.lr", "3e-3", "--mesh", "1,-1,4", "--model.moe.dispatch",
                "dropless")  # fmt: skip
    assert run.optimizer.lr == 3e-3 and run.optimizer.beta1 == 0.85 and run.schedule.steps == 5
    assert (run.mesh.data, run.mesh.fsdp, run.mesh.expert) == (1, -1, 4)
    assert (
        run.model.moe.dispatch == "dropless" and run.model.d_model == 64 and run.data.shard_cache == 2 * 10**9
    )
    same = parse("--config", str(config), "--optimizer.lr", "3e-3", "--mesh.data", "1", "--mesh.expert", "4",
                 "--model.moe.dispatch", "dropless")  # fmt: skip
    assert same == run
    # One flag per setting: the spellings of earlier releases are gone.
    for old in (["--lr", "3e-3"], ["--dispatch", "dropless"], ["--steps", "5"]):
        with pytest.raises(SystemExit):
            parse("--config", str(config), *old)
        assert "unrecognized arguments" in capsys.readouterr().err
    no_synthetic = parse("--config", str(config), "--no-data.synthetic", "--model.d_model", "32")
    assert no_synthetic.data.synthetic is False
    assert parse("--config", str(config), "--model.d_model", "32").model.d_model == 32
    # A model given as a file on the command line replaces the file's, and its fields can then be changed.
    marin = parse("--config", str(config), "--model", str(REPO / "configs/models/tiny-marin.yaml"))
    assert marin.model.name == "tiny-marin"
    assert parse("--data.shard_cache", "1M", "--model", TINY).data.shard_cache == 10**6


def test_unknown_and_bad_fields_name_the_file_and_the_field(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    for text, field in [
        (f"model: {TINY}\noptimizer: {{lrr: 0.1}}\n", "optimizer.lrr"),
        (f"model: {TINY}\noptimiser: {{lr: 0.1}}\n", "optimiser"),
        ("model: {name: x, vocab_size: 10, d_model: 8, n_layers: 1, n_heads: 1, n_kv_heads: 1, head_dim: 8,"
         " sequence_length: 8, moe: {n_experts: 2, top_k: 1, expert_hidden: 4}, colour: red}\n",
         "model.colour"),
        (f"model: {TINY}\nschedule: {{steps: many}}\n", "schedule.steps"),
        (f"model: {TINY}\nmesh: {{data: -1, fsdp: -1}}\n", "mesh"),
        (f"model: {TINY}\noptimizer:\n  lr: 0.1\n  lr: 0.2\n", "not valid YAML"),
    ]:  # fmt: skip
        config.write_text(text)
        assert (
            main(["train", "--config", str(config), "--data.synthetic", "--output", str(tmp_path / "r")]) == 2
        )
        err = capsys.readouterr().err
        assert f"{config}: {field}" in err, err
    config.write_text("model: configs/models/no-such-model.yaml\n")
    with pytest.raises(RunConfigError, match=rf"{config}: model: cannot read model config"):
        read_run_config_file(str(config))
    config.write_text("- a list\n")
    with pytest.raises(RunConfigError, match=rf"{config}: a run configuration is a mapping"):
        read_run_config_file(str(config))
    # A config.json from before run configurations says so instead of listing every old key.
    old = tmp_path / "config.json"
    old.write_text(json.dumps({"model": {}, "train": {"lr": 0.1}, "plan": None}))
    with pytest.raises(RunConfigError, match="before run configurations"):
        read_run_config_file(str(old))
    # A model field changed without a model to change.
    with pytest.raises(RunConfigError, match="model.d_model: no model to change"):
        build_run_config({}, {"model.d_model": 8})
    with pytest.raises(UsageError, match="expected three integers"):
        parse("--model", TINY, "--mesh", "2,2")


def test_resolving_fills_in_the_marin_recipe_once(tmp_path):
    run = build_run_config({"model": str(REPO / "configs/models/tiny-marin.yaml"), "output": "x"})
    phases = [Phase("pretraining", 0, 800), Phase("midtraining", 800, 1000)]
    resolved = resolve_run_config(run, phases).config
    tokens_per_batch = 8 * resolved.model.sequence_length
    recipe = MAY_RECIPE.hyperparameters(1000 * tokens_per_batch, resolved.model.d_model, tokens_per_batch)
    assert resolved.optimizer.kind == "muonh" and resolved.optimizer.lr == recipe["lr"]
    assert resolved.optimizer.adam_lr == recipe["adam_lr"] and resolved.optimizer.epsilon == recipe["epsilon"]
    assert (resolved.schedule.kind, resolved.schedule.warmup_steps) == (
        "linear",
        warmup_steps_for(1000, 0.01),
    )
    assert (resolved.optimizer.clip_norm, resolved.optimizer.weight_decay) == (0.0, 0.0)
    assert resolved.schedule.steps == 800 and resolved.schedule.min_lr_ratio == 0.05
    assert resolve_run_config(resolved, phases).config == resolved
    # Given only the MuonH rate, the Adam group keeps Marin's ratio to it.
    faster = resolve_run_config(run.with_values({"optimizer.lr": 0.013}), phases).config
    assert faster.optimizer.adam_lr == pytest.approx(0.003)
    with pytest.raises(RunConfigError, match="phase 'cooldown' is not in the plan"):
        resolve_run_config(run.with_values({"data.phase": "cooldown"}), phases)
    planned = small_plan({"pretraining": 800, "midtraining": 200}, batch_size=8)
    assert phases_from_plan(planned) == phases
    with pytest.raises(RunConfigError, match=r"batch size 4 \(--data.batch_size\) differs from the plan's 8"):
        resolve_run_config(run.with_values({"data.batch_size": 4}), phases, planned)


@pytest.mark.parametrize("path", sorted(RUNS.glob("*.yaml")), ids=lambda path: path.name)
def test_shipped_run_configurations_are_valid(path, monkeypatch):
    monkeypatch.chdir(REPO)  # their paths are relative to the repository's root
    raw = yaml.safe_load(path.read_text())
    run = build_run_config(read_run_config_file(str(path)))
    assert run.model is not None and Path(raw["model"]).exists()
    if path.name == "swarm-proxy.yaml":
        # A mixture search's proxy template: `tokenmill mixture swarm` sets each proxy's folder and mixture.
        assert run.output is None and run.data.mixture is None and run.data.tokens
        return
    assert run.output and load_mixture(run.data.mixture).name


def test_the_marin_rung_trains_with_the_ladders_optimizer(monkeypatch):
    """configs/runs/marin-d768.yaml resolves to the optimizer `tokenmill ladder plan` prints for the rung."""
    monkeypatch.chdir(REPO)
    run = build_run_config(read_run_config_file("configs/runs/marin-d768.yaml"))
    plan = plan_mixture(load_mixture(run.data.mixture))
    resolved = resolve_run_config(run, phases_from_plan(plan), plan).config
    rung = next(
        r for r in plan_ladder(load_ladder("configs/ladders/marin.yaml"))["rungs"] if r["name"] == "d768"
    )
    expected = rung["optimizer"]
    assert resolved.data.batch_size == 1024 and resolved.schedule.total_steps == rung["steps"] == 11420
    for field in ("lr", "adam_lr", "beta1", "beta2", "epsilon", "clip_norm", "weight_decay"):
        assert getattr(resolved.optimizer, field) == expected[field], field
    assert resolved.schedule.warmup_steps == expected["warmup_steps"]
    assert resolved.schedule.min_lr_ratio == expected["min_lr_ratio"]


def test_the_defaults_docs_trainer_md_lists_are_the_configurations():
    text = (REPO / "docs" / "trainer.md").read_text()
    section = text[text.index("## Run configurations") :]
    block = section[section.index("```yaml\n") + 8 : section.index("```\n", section.index("```yaml"))]
    assert yaml.safe_load(block) == RunConfig().model_dump(mode="json")
