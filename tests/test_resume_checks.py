"""Resume knows what it resumes: a rerun whose plan, seed or model differ from the checkpoint's is refused,
naming the change; --allow-data-change continues and config.json's history records both configurations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from test_trainer_cli import MIXTURE, TINY, read_metrics, write_tokens

from tokenmill.cli import main
from tokenmill.formats.runs import read_run_record
from tokenmill.trainer.run.checkpoint import differences, identity_changes

SYNTHETIC = [
    "train",
    "--data.synthetic",
    "--model",
    TINY,
    "--data.sequence_length",
    "32",
    "--data.batch_size",
    "4",
]
# One schedule for every rerun (16 steps, whatever --schedule.steps stops at), so the compiled step is reused.
SYNTHETIC += ["--logging.peak_flops", "1e9", "--checkpoint.every", "4", "--schedule.total_steps", "16"]


def history(run: Path) -> list[dict]:
    return [entry.to_json() for entry in read_run_record(str(run / "config.json")).history]


def test_seed_and_model_changes_are_refused_then_allowed_and_recorded(tmp_path, capsys):
    run = tmp_path / "run"
    base = [*SYNTHETIC, "--output", str(run)]
    assert main([*base, "--schedule.steps", "12"]) == 0
    capsys.readouterr()
    first = read_metrics(run)

    # Another seed: other batches from step 12 on.
    assert main([*base, "--schedule.steps", "16", "--seed", "1"]) == 1
    out = capsys.readouterr().out
    assert f"{run}/checkpoints/12 was trained with a different configuration: seed 0 -> 1" in out, out
    assert "--allow-data-change" in out
    # Another model (the same parameter shapes: only the restore could not have told).
    assert main([*base, "--schedule.steps", "16", "--model.moe.capacity_factor", "2.0"]) == 1
    out = capsys.readouterr().out
    assert "model " in out and "model.moe.capacity_factor: 1.25 -> 2.0" in out, out
    assert "seed 0" not in out
    # Nothing was trained or recorded by the refused reruns.
    assert read_metrics(run) == first and len(history(run)) == 1

    assert main([*base, "--schedule.steps", "16", "--seed", "1", "--allow-data-change"]) == 0
    assert "steps 12..15" in capsys.readouterr().out
    assert [row["step"] for row in read_metrics(run)] == list(range(16))
    entries = history(run)
    assert [(e["step"], e["seed"], e["changes"]) for e in entries] == [(0, 0, []), (12, 1, ["seed 0 -> 1"])]
    assert (
        entries[0]["settings"]["schedule"]["steps"] == 12
        and entries[1]["settings"]["schedule"]["steps"] == 16
    )
    config = json.loads((run / "config.json").read_text())
    assert config["seed"] == 1  # the top level is the configuration in force

    # The checkpoint at 16 is of seed 1: the same command goes on without a flag, and a plain resume of
    # the same configuration adds no history entry.
    assert main([*base, "--schedule.steps", "16", "--seed", "1"]) == 0
    assert main([*base, "--schedule.steps", "16", "--seed", "1", "--config", str(run / "config.json")]) == 0
    assert len(history(run)) == 2
    assert main([*base, "--schedule.steps", "16"]) == 1  # back to seed 0 is a change too
    assert "seed 1 -> 0" in capsys.readouterr().out


def test_edited_mixture_weights_are_refused_naming_the_weight(tmp_path, capsys):
    write_tokens(tmp_path / "tokens", vocab_size=4096)
    mixture = tmp_path / "mixture.yaml"
    mixture.write_text(MIXTURE)
    run = tmp_path / "run"
    argv = [
        "train",
        "--data.mixture",
        str(mixture),
        "--model",
        TINY,
        "--output",
        str(run),
        "--logging.peak_flops",
        "1e9",
    ]
    assert main([*argv, "--schedule.steps", "4", "--checkpoint.every", "4"]) == 0
    capsys.readouterr()

    spec = yaml.safe_load(MIXTURE)
    spec["phases"][0]["weights"] = {"domain=web/*": 0.5, "domain=code/*": 0.5}
    mixture.write_text(yaml.safe_dump(spec))
    assert main([*argv, "--schedule.steps", "6"]) == 1
    out = capsys.readouterr().out
    assert f"{run}/checkpoints/4 was trained with a different configuration: plan " in out, out
    # Sources are matched by name, whatever order the planner lists them in.
    assert "phases[pretraining].sources[domain=web/*].weight: 0.75 -> 0.5" in out, out
    assert "phases[pretraining].sources[domain=code/*].weight: 0.25 -> 0.5" in out, out

    assert main([*argv, "--schedule.steps", "6", "--allow-data-change"]) == 0
    entries = history(run)
    assert [entry["step"] for entry in entries] == [0, 4]
    assert entries[1]["changes"][0].startswith("plan ")
    weights = [
        {source["name"]: source["weight"] for source in entry["plan"]["phases"][0]["sources"]}
        for entry in entries
    ]
    assert weights == [
        {"domain=web/*": 0.75, "domain=code/*": 0.25},
        {"domain=web/*": 0.5, "domain=code/*": 0.5},
    ]
    assert entries[0]["plan_sha256"] != entries[1]["plan_sha256"]
    assert [row["step"] for row in read_metrics(run)] == list(range(6))


def test_identity_changes_tell_refused_from_allowed():
    saved = {"plan_sha256": "a" * 64, "seed": 0, "tokenizer_sha256": "e" * 64, "model_sha256": "m",
             "model": {"d_model": 64}, "batch_size": 8, "sequence_length": 32,
             "mesh": {"data": 1, "fsdp": 4, "expert": 1}, "processes": 2}  # fmt: skip
    same = dict(saved)
    assert identity_changes(saved, same) == ([], [])
    moved = {**saved, "mesh": {"data": 1, "fsdp": 2, "expert": 1}, "processes": 1}
    refused, allowed = identity_changes(saved, moved)
    assert refused == [] and [change.what for change in allowed] == ["mesh", "processes"]
    assert str(allowed[1]) == "processes 2 -> 1"
    other = {**saved, "tokenizer_sha256": "f" * 64, "batch_size": 16}
    refused, _ = identity_changes(saved, other)
    assert [str(change) for change in refused] == [
        "tokenizer eeeeeeeeeeee -> ffffffffffff",
        "batch size 8 -> 16",
    ]
    # A record from before identities were kept: nothing to compare, nothing refused.
    assert identity_changes({"phase": "pretraining", "step": 4}, other) == ([], [])


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ({"a": {"b": 1}}, {"a": {"b": 2}}, ["a.b: 1 -> 2"]),
        ({"xs": [{"name": "web", "w": 1}]}, {"xs": [{"name": "web", "w": 2}]}, ["xs[web].w: 1 -> 2"]),
        ({"xs": [1, 2]}, {"xs": [1, 2, 3]}, ["xs: [1, 2] -> [1, 2, 3]"]),
        ({"a": 1}, {"b": 1}, ["a: 1 -> null", "b: null -> 1"]),
    ],
)
def test_differences_name_the_paths(old, new, expected):
    assert differences(old, new) == expected


def test_history_of_a_config_json_from_before_histories(tmp_path):
    """An older config.json (no history) keeps its configuration as the first entry, at an unknown step."""
    from tokenmill.formats.runs import extend_history, history_entry, write_run_record

    path = str(tmp_path / "config.json")
    old = {"seed": 0, "data": {"phase": "pretraining"}, "logging": {"peak_flops": 1.0}, "processes": 1,
           "plan": None, "phases": {"pretraining": {}}}  # fmt: skip
    write_run_record(path, old)
    identity = {"seed": 0, "processes": 1, "mesh": {"data": 1, "fsdp": 1, "expert": 1}}
    entry = history_entry(8, "pretraining", {"seed": 0, "data": {"phase": "pretraining"}}, None, identity)
    history = extend_history(read_run_record(path), entry)
    assert [item["step"] for item in history] == [None, 8]
    assert history[0]["settings"] == {
        "seed": 0,
        "data": {"phase": "pretraining"},
        "logging": {"peak_flops": 1.0},
    }
    write_run_record(path, {**old, "history": history})
    # The same configuration again (another measured peak is not another configuration): no new entry.
    settings = {"seed": 0, "data": {"phase": "pretraining"}, "logging": {}}
    again = history_entry(12, "pretraining", settings, None, identity)
    assert extend_history(read_run_record(path), again) == history


def test_a_checkpoint_of_another_optimizer_is_refused_naming_the_checkpoint(tmp_path, capsys):
    """A rerun with another optimizer finds its state laid out otherwise: the error names the checkpoint
    and the first path that differs, instead of orbax's bare structure mismatch."""
    run = tmp_path / "run"
    base = [*SYNTHETIC, "--output", str(run)]
    assert main([*base, "--schedule.steps", "4", "--optimizer.kind", "adamw"]) == 0
    capsys.readouterr()
    assert main([*base, "--schedule.steps", "8", "--optimizer.kind", "muon"]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint {run}/checkpoints/4 holds a train state laid out otherwise" in err, err
    assert "opt_state" in err and "new --output" in err
    assert [row["step"] for row in read_metrics(run)] == [0, 1, 2, 3]  # nothing trained
