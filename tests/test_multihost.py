"""Two real processes on loopback train the tiny model together, as two hosts would, and match one process
that holds the same number of devices; the coordinator, process count and id reach jax.distributed through
the flags in one process and the JAX_* variables in the other (jax 0.10 reads neither count nor id itself).

Each process simulates 2 CPU devices (XLA reads the count when jax is first imported, hence fresh
processes); cross-process collectives on CPU go through gloo.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from test_trainer_cli import TINY, read_metrics

from tokenmill.trainer.run.distributed import DistributedSetupError, first_slurm_host, process_group


def train(output: Path, steps: int = 4, *extra: str) -> list[str]:
    """The same small synthetic run for every process: 8 sequences of 32 tokens a step."""
    return [sys.executable, "-m", "tokenmill", "train", "--data.synthetic", "--model", TINY,
            "--schedule.steps", str(steps), "--data.sequence_length", "32", "--data.batch_size", "8",
            "--logging.peak_flops", "1e9", "--checkpoint.every", "2",
            "--output", str(output), *extra]  # fmt: skip


def free_port() -> int:
    """A port no process listens on, below the ephemeral range: the kernel hands ports in that range to
    outgoing connections (gloo opens many), which could take the coordinator's port before it binds."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.Random().sample(range(20000, min(low, 32768)), 50):
        try:
            with socket.socket(socket.AF_INET6) as probe:
                probe.bind(("::", port))  # where jax's coordinator binds: every address
            return port
        except OSError:
            continue
    raise RuntimeError("no free port found")


def environment(devices: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "SLURM_", "JOB_COMPLETION"))}
    # Unoptimised CPU code generation (as in test_expert_parallel.py): a few tiny steps, compiled in each
    # process; LLVM's default level made compiling most of a run's time.
    flags = f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0"
    return {**env, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu", **extra}


def run_all(commands: list[tuple[list[str], dict[str, str]]]) -> list[str]:
    """Start every command at once, wait for all; their combined output, each asserted to have exited 0."""
    processes = [
        subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for command, env in commands
    ]
    try:
        logs = [process.communicate(timeout=600)[0] for process in processes]
    finally:
        for process in processes:
            process.kill()
    failed = [log[-3000:] for process, log in zip(processes, logs, strict=True) if process.returncode != 0]
    assert not failed, "\n\n".join(failed)
    return logs


def train_together_and_alone(together: Path, alone: Path) -> list[str]:
    """Two processes of 2 devices (told by flags and by JAX_* variables) and, at the same time, one process
    of 4 devices: 4 steps each. Returns the three processes' logs."""
    address = f"127.0.0.1:{free_port()}"
    by_variables = {"JAX_COORDINATOR_ADDRESS": address, "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
    return run_all(
        [
            (
                train(together, 4, "--coordinator", address, "--num-processes", "2", "--process-id", "0"),
                environment(2),
            ),
            (train(together, 4), environment(2, **by_variables)),
            (train(alone, 4), environment(4)),
        ]  # fmt: skip
    )


# Slow suite (`make test-slow`): the default suite keeps the cheaper checks of the same code.
@pytest.mark.slow
def test_two_processes_train_like_one_with_the_same_devices(tmp_path):
    together, alone = tmp_path / "together", tmp_path / "alone"
    logs = train_together_and_alone(together, alone)
    assert "joining the job as process 0 of 2" in logs[0] and "from --coordinator, --num-processes" in logs[0]
    assert "joining the job as process 1 of 2" in logs[1] and "from JAX_COORDINATOR_ADDRESS" in logs[1]
    assert "joining the job" not in logs[2]
    two, one = read_metrics(together), read_metrics(alone)
    assert [row["step"] for row in two] == [row["step"] for row in one] == [0, 1, 2, 3]
    for a, b in zip(two, one, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (two, one)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    config = json.loads((together / "config.json").read_text())
    assert config["processes"] == 2 and config["mesh"]["fsdp"] == 4
    assert (together / "checkpoints" / "4").is_dir()


@pytest.mark.slow
def test_a_two_process_run_resumes_in_one_process(tmp_path):
    """Allowed (every row of a batch is a function of the global step, not of the process that reads it),
    logged, and recorded in config.json's history; the losses go on as the one-process run's."""
    together, alone = tmp_path / "together", tmp_path / "alone"
    train_together_and_alone(together, alone)
    logs = run_all([(train(together, 6), environment(4)), (train(alone, 6), environment(4))])
    assert "processes 2 -> 1" in logs[0], logs[0][-3000:]
    two, one = read_metrics(together), read_metrics(alone)
    assert [row["step"] for row in two] == list(range(6))
    assert [row["loss"] for row in two] == pytest.approx([row["loss"] for row in one], rel=1e-5)
    history = json.loads((together / "config.json").read_text())["history"]
    assert [(entry["step"], entry["processes"]) for entry in history] == [(0, 2), (4, 1)]
    assert history[1]["changes"] == ["processes 2 -> 1"]


def test_the_issue_command_runs_as_one_process(tmp_path):
    """The route the docs gave, which ended in `ValueError: Number of processes must be defined.`"""
    address = f"127.0.0.1:{free_port()}"
    env = environment(1, JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES="1", JAX_PROCESS_ID="0")
    done = subprocess.run(train(tmp_path / "x", 1), env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "joining the job as process 0 of 1" in done.stderr


def test_process_group_sources():
    slurm = {
        "SLURM_JOB_ID": "4242",
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "8",
        "SLURM_JOB_NODELIST": "gpu[007-010]",
    }
    group = process_group(environ=slurm)
    assert (group.coordinator, group.num_processes, group.process_id) == ("gpu007:61586", 8, 3)
    assert group.sources == ("SLURM node list", "SLURM_NTASKS", "SLURM_PROCID")
    # Flags win over the environment, value by value; a host without a port gets JAX_COORDINATOR_PORT.
    group = process_group("head", None, 5, {**slurm, "JAX_COORDINATOR_PORT": "9000"})
    assert (group.coordinator, group.num_processes, group.process_id) == ("head:9000", 8, 5)
    # A JobSet pod: the manifest sets the coordinator and count, Kubernetes the completion index.
    pod = {
        "JAX_COORDINATOR_ADDRESS": "run-workers-0-0.run:8476",
        "JAX_NUM_PROCESSES": "4",
        "JOB_COMPLETION_INDEX": "2",
    }
    assert process_group(environ=pod).process_id == 2
    assert process_group(environ={}) is None
    assert process_group(environ={"JOB_COMPLETION_INDEX": "0"}) is None  # an Indexed Job of one process
    with pytest.raises(DistributedSetupError, match="give --num-processes N"):
        process_group(environ={"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_PROCESS_ID": "0"})
    with pytest.raises(DistributedSetupError, match=r"process id 4 \(--process-id\) is not in 0..3"):
        process_group("h:1", 4, 4, {})


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("node001", "node001"),
        ("a1,b2", "a1"),
        ("gpu[003-007,010],cpu1", "gpu003"),
        ("r[1-2]-n[08-09]", "r1-n08"),
        ("x[5,7]", "x5"),
    ],  # fmt: skip
)
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_a_missing_process_count_is_a_usage_error(tmp_path):
    env = environment(1, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}", JAX_PROCESS_ID="0")
    done = subprocess.run(train(tmp_path / "x"), env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "give --num-processes N (or JAX_NUM_PROCESSES)" in done.stderr
    assert not Path(tmp_path / "x").exists()


def test_a_taken_coordinator_port_is_a_usage_error(tmp_path):
    port = free_port()
    with socket.socket(socket.AF_INET6) as squatter:
        squatter.bind(("::", port))
        squatter.listen()
        command = train(tmp_path / "x", 1, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "1",
                        "--process-id", "0")  # fmt: skip
        done = subprocess.run(command, env=environment(1), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"cannot serve the job's coordinator on port {port} of this host (process 0)" in done.stderr
