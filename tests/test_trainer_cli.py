"""`tokenmill train` from the command line: a run on real token shards through the mixture planner and the
sampler, fail-fast checks, usage errors, and (slow) a real kill and rerun."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tokenmill.cli import main
from tokenmill.formats.plan import MixturePlan, plan_from_json, write_plan
from tokenmill.tokenize.tokenizer import TokenizerInfo
from tokenmill.tokenize.writer import write_counts, write_manifest, write_shard

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "models" / "tiny.yaml")


def read_metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def small_plan(steps: dict[str, int], batch_size: int = 4, sequence_length: int = 32) -> MixturePlan:
    """A complete mixture plan (docs/formats.md) of one source, each phase given by its steps, in order."""
    tokens_per_step = batch_size * sequence_length
    phases, start = [], 0
    for name, phase_steps in steps.items():
        tokens = phase_steps * tokens_per_step
        source = {"name": "web", "cells": ["domain=web/quality=3"], "weight": 1.0, "tokens": tokens,
                  "tokens_available": tokens, "epochs": 1.0}  # fmt: skip
        phases.append({"name": name, "tokens": tokens, "steps": phase_steps, "start_step": start,
                       "end_step": start + phase_steps, "sources": [source]})  # fmt: skip
        start += phase_steps
    return plan_from_json(
        {
            "name": "test",
            "tokenizer": "test-bpe",
            "total_tokens": start * tokens_per_step,
            "sequence_length": sequence_length,
            "batch_size": batch_size,
            "block_size": batch_size,
            "tokens_per_step": tokens_per_step,
            "total_steps": start,
            "phases": phases,
        }  # fmt: skip
    )


def write_tokens(root: Path, vocab_size: int, sha: str = "a" * 64) -> Path:
    """Two cells of token shards (docs/formats.md) whose documents follow a learnable pattern."""
    info = TokenizerInfo(name="test-bpe", sha256=sha, vocab_size=vocab_size, eos_id=0, eos_token="<eos>")
    rng = np.random.default_rng(0)
    summaries = []
    for cell in ("domain=web/quality=3", "domain=code/quality=2"):
        # Documents count upwards from a random start, so the next token is predictable.
        docs = [(rng.integers(1, 200) + np.arange(rng.integers(5, 60))) % 250 + 1 for _ in range(300)]
        ids = np.concatenate([np.append(d, 0) for d in docs])
        ends = np.cumsum([len(d) + 1 for d in docs])
        marker = write_shard(str(root), cell, 0, ids, ends, info, ["part-00000-of-00001.parquet"])
        summaries.append(write_manifest(str(root), cell, [marker], info))
    write_counts(str(root), summaries, info)
    return root


MIXTURE = """
name: cli-test
tokenizer: test-bpe
counts: tokens/counts.json
total_tokens: 20K
sequence_length: 32
batch_size: 8
block_size: 8
max_epochs: 10
phases:
  - name: pretraining
    share: 0.8
    weights: {domain=web/*: 0.7, domain=code/*: 0.3}
  - name: midtraining
    share: 0.2
    weights: {domain=web/*: 0.3, domain=code/*: 0.7}
"""


def test_train_on_a_mixture_from_the_command_line(tmp_path, capsys):
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
    assert main([*argv, "--schedule.steps", "12", "--optimizer.lr", "1e-2"]) == 0
    assert "phase pretraining steps 0..11" in capsys.readouterr().out
    rows = read_metrics(run)
    assert [row["step"] for row in rows] == list(range(12))
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0
    config = json.loads((run / "config.json").read_text())
    assert config["plan"]["tokenizer_sha256"] == "a" * 64 and config["data"]["batch_size"] == 8
    assert (run / "checkpoints" / "12").is_dir()
    # Read through memory maps instead of direct reads: the same batches, so the same losses.
    mapped = tmp_path / "mapped"
    argv_mapped = [
        *argv[:5],
        "--output",
        str(mapped),
        "--logging.peak_flops",
        "1e9",
        "--optimizer.lr",
        "1e-2",
    ]
    assert main([*argv_mapped, "--schedule.steps", "3", "--data.reader", "mmap"]) == 0
    assert [row["loss"] for row in read_metrics(mapped)] == [row["loss"] for row in rows[:3]]
    # Fail fast, before any compiling: shards from another tokenizer than the one asked for...
    assert main([*argv, "--schedule.steps", "13", "--data.tokenizer_sha256", "b" * 64]) == 2
    assert "tokenizer sha256" in capsys.readouterr().err
    # ...and a tokenizer vocabulary larger than the model's (tiny.yaml: 8192).
    write_tokens(tmp_path / "wide" / "tokens", vocab_size=10_000)
    (tmp_path / "wide" / "mixture.yaml").write_text(MIXTURE)
    wide = ["train", "--data.mixture", str(tmp_path / "wide" / "mixture.yaml"), "--model", TINY]
    assert main([*wide, "--output", str(tmp_path / "run2"), "--schedule.steps", "2"]) == 2
    assert "vocabulary (10000) is larger than the model's vocab_size (8192)" in capsys.readouterr().err


def test_usage_errors(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert main(["train", "--model", TINY, "--schedule.steps", "3", "--output", out]) == 2
    assert "--data.mixture" in capsys.readouterr().err
    assert (
        main(
            [
                "train",
                "--data.synthetic",
                "--model",
                str(tmp_path / "nope.yaml"),
                "--schedule.steps",
                "3",
                "--output",
                out,
            ]
        )
        == 2
    )
    assert "cannot read model config" in capsys.readouterr().err
    plan = tmp_path / "plan.json"
    write_plan(str(plan), small_plan({"pretraining": 4}))
    args = ["train", "--data.synthetic", "--data.plan", str(plan), "--model", TINY, "--output", out]
    assert main([*args, "--data.phase", "cooldown"]) == 2
    assert "phase 'cooldown' is not in the plan" in capsys.readouterr().err
    assert main([*args, "--data.sequence_length", "4096"]) == 2
    assert "longer than the model's sequence_length" in capsys.readouterr().err
    # A plan file that breaks the format is refused before anything trains, naming the file and the fields.
    plan.write_text(json.dumps({"sequence_length": 32, "batch_size": "4", "phases": [
        {"name": "pretraining", "start_step": 0, "end_step": 4}]}))  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"cannot read plan {plan}: no 'name', 'tokenizer'" in err and "batch_size" in err, err
    assert "phases[0] has no 'tokens', 'steps'" in err, err
    assert not Path(out).exists()
    assert main([*args[:3], str(tmp_path / "missing.json"), *args[4:]]) == 2
    assert f"cannot read plan {tmp_path / 'missing.json'}: No such file" in capsys.readouterr().err


@pytest.mark.slow
def test_kill_and_rerun_matches_a_straight_run(tmp_path):
    """SIGKILL a real training process mid-run (async checkpoint saves in flight), rerun the same command."""
    cli = [sys.executable, "-c", "import sys; from tokenmill.cli import main; sys.exit(main())"]
    common = [*cli, "train", "--data.synthetic", "--model", TINY, "--schedule.steps", "40"]
    common += [
        "--data.sequence_length",
        "32",
        "--data.batch_size",
        "4",
        "--logging.peak_flops",
        "1e9",
        "--checkpoint.every",
        "5",
    ]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    subprocess.run([*common, "--output", str(straight)], env=env, check=True, capture_output=True)

    process = subprocess.Popen([*common, "--output", str(killed)], env=env, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline:
        lines = (
            (killed / "metrics.jsonl").read_text().count("\n") if (killed / "metrics.jsonl").exists() else 0
        )
        if lines >= 17:
            break
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert len(read_metrics(killed)) < 40
    subprocess.run([*common, "--output", str(killed)], env=env, check=True, capture_output=True)
    a, b = read_metrics(straight), read_metrics(killed)
    assert [r["step"] for r in b] == list(range(40))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
