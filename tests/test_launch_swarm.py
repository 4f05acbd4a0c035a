"""`tokenmill launch slurm|jobset --swarm`: a mixture search's swarm as one job array (a SLURM array, a
Kubernetes Indexed Job), one task per proxy. The outputs are checked as their schedulers would read them
(`bash -n` / `sh -n`, #SBATCH lines, the Job's fields), then run as a task would be: a finished proxy is
skipped, an unfinished one runs the real worker (`python -m tokenmill.swarm.worker SWARM --index env`),
which trains nothing here (its run configuration names a missing model) but records its failure in that
proxy's result.json, so the proxy an index picked is visible."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_launch import DNS_LABEL, HOSTILE, LINE_BREAKS, keys_of, no_pwned, sbatch_options

from tokenmill.cli import main
from tokenmill.formats.swarm import (
    ProxyResult,
    SwarmEvalSet,
    SwarmManifest,
    SwarmProxy,
    SwarmSource,
    read_result,
    write_result,
    write_swarm,
)

SWARM_DIR = "runs/swarm-Test"
PROXIES = 3
WORKER = 'exec python -m tokenmill.swarm.worker "$SWARM" --index env'


@pytest.fixture
def swarm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A swarm of three proxies in tmp_path/runs/swarm-Test (the working directory is tmp_path, as it is the
    directory a swarm is made and launched from); no tokens, no training."""
    monkeypatch.chdir(tmp_path)
    return make_swarm(tmp_path / SWARM_DIR, SWARM_DIR)


def make_swarm(root: Path, folder: str) -> Path:
    """A swarm of three proxies in `root`, which is `folder` from the working directory."""
    proxies = []
    for index in range(PROXIES):
        proxy_id = f"proxy-{index:03d}"
        (root / proxy_id).mkdir(parents=True)
        (root / proxy_id / "run.yaml").write_text(
            yaml.safe_dump({"output": f"{folder}/{proxy_id}/run", "model": "configs/models/missing.yaml"})
        )
        proxies.append(
            SwarmProxy(
                id=proxy_id,
                index=index,
                weights={"web": 0.25 + 0.25 * index, "code": 0.75 - 0.25 * index},
                mixture=f"{proxy_id}/mixture.yaml",
                run_config=f"{proxy_id}/run.yaml",
                run=f"{proxy_id}/run",
            )
        )
    sources = [
        SwarmSource(name=name, content=name * 8, cells=[name], tokens_available=1000, max_epochs=4.0,
                    prior=0.5, base_weight=0.5, fixed_epochs=0.0)
        for name in ("web", "code")
    ]  # fmt: skip
    manifest = SwarmManifest(
        format_version=1,
        name="swarm-Test",
        seed=0,
        base_mixture="mixtures/base.yaml",
        base_mixture_sha256="0" * 64,
        base_mixture_text="name: base\n",
        run_config="configs/runs/proxy.yaml",
        tokens="out/tokens",
        phase="pretraining",
        phases=["pretraining"],
        phase_tokens=1000,
        target_tokens=1000,
        proxy_tokens=100,
        concentrations=[1.0],
        sources=sources,
        evaluation=[SwarmEvalSet(name="heldout", kind="heldout", content="1" * 8)],
        proxies=proxies,
        block_size=64,
    )
    write_swarm(str(root / "swarm.json"), manifest)
    return root


def finish(root: Path, proxy_id: str) -> ProxyResult:
    """Record `proxy_id` as finished for its run.yaml as it is now (what the worker writes at its end)."""
    config = (root / proxy_id / "run.yaml").read_text()
    result = ProxyResult(
        id=proxy_id,
        status="finished",
        run_config_sha256=hashlib.sha256(config.encode()).hexdigest(),
        seconds=1.0,
        metrics={"heldout": {"loss": 2.0, "bits_per_byte": 1.0}},
    )
    write_result(str(root / proxy_id / "result.json"), result)
    return result


def task_environment(**variables: str) -> dict[str, str]:
    """A task's environment: this interpreter's `python` first on PATH (the one tokenmill is installed in)."""
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    return {**os.environ, "PATH": path, **variables}


def array_indices(spec: str) -> tuple[list[int], int | None]:
    """The indices of an `#SBATCH --array` value (`0-31%8`, `0,2,5-7`) and its limit of tasks at once."""
    indices, _, limit = spec.partition("%")
    found = []
    for part in indices.split(","):
        first, _, last = part.partition("-")
        found.extend(range(int(first), int(last or first) + 1))
    return found, int(limit) if limit else None


def test_slurm_array(swarm, tmp_path):
    script_path = tmp_path / "swarm.sbatch"
    argv = ["launch", "slurm", "--swarm", SWARM_DIR, "--parallel", "2", "--gpus-per-task", "1",
            "--cpus-per-task", "4", "--partition", "gpu", "--time", "0-02:00:00",
            "--setup", "export MARK=set-up", "-o", str(script_path)]  # fmt: skip
    assert main(argv) == 0
    script = script_path.read_text()
    subprocess.run(["bash", "-n", str(script_path)], check=True)
    options = sbatch_options(script)
    assert options == {
        "--job-name": "swarm-test",
        "--array": "0-2%2",
        "--nodes": "1",
        "--ntasks": "1",
        "--gpus-per-node": "1",
        "--cpus-per-task": "4",
        "--partition": "gpu",
        "--time": "0-02:00:00",
        "--output": f"{SWARM_DIR}/logs/%A_%a.out",
    }
    # One task per proxy, each index once: 0..N-1, at most --parallel at a time.
    assert array_indices(options["--array"]) == (list(range(PROXIES)), 2)
    assert DNS_LABEL.match(options["--job-name"])
    # sbatch does not make the output's folder (a task whose folder is missing fails unseen): launch does.
    assert (swarm / "logs").is_dir()
    # All #SBATCH lines come before the first command, or sbatch ignores them.
    commands = [line for line in script.splitlines() if line and not line.startswith("#")]
    assert script.index(commands[0]) > script.rindex("#SBATCH")
    assert f"SWARM={SWARM_DIR}" in commands and commands[-1] == WORKER
    assert "JAX_PLATFORMS" not in script  # a GPU per task: JAX finds it

    # Run it as sbatch would for two tasks of the array, from the submission directory.
    finished = finish(swarm, "proxy-000")
    submit = tmp_path / "elsewhere"
    submit.mkdir()
    env = task_environment(SLURM_SUBMIT_DIR=str(tmp_path), SLURM_ARRAY_TASK_ID="0")
    task = subprocess.run(["bash", str(script_path)], env=env, cwd=submit, capture_output=True, text=True)
    assert task.returncode == 0, task.stderr
    assert "proxy-000: finished" in task.stdout and "skipped" in task.stdout
    assert read_result(str(swarm / "proxy-000" / "result.json")) == finished  # the worker never ran

    env["SLURM_ARRAY_TASK_ID"] = "1"
    task = subprocess.run(["bash", str(script_path)], env=env, cwd=submit, capture_output=True, text=True)
    # The worker ran proxy 1 of swarm.json in the submission directory: the missing model failed it, and
    # the failure is recorded where `tokenmill mixture fit` looks.
    assert task.returncode == 1
    assert "array task 1: proxy-001" in task.stdout
    result = read_result(str(swarm / "proxy-001" / "result.json"))
    assert result.status == "failed" and f"{SWARM_DIR}/proxy-001/run.yaml" in result.error
    assert not (swarm / "proxy-002" / "result.json").exists()


def test_slurm_array_defaults(swarm, capsys):
    assert main(["launch", "slurm", "--swarm", SWARM_DIR, "--gpus-per-task", "0"]) == 0
    script = capsys.readouterr().out
    options = sbatch_options(script)
    assert array_indices(options["--array"]) == (list(range(PROXIES)), None)
    assert "--gpus-per-node" not in options and "--exclusive" not in options
    assert 'export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"' in script  # no GPU asked for: train on CPU


def test_indexed_job(swarm, tmp_path):
    out = tmp_path / "swarm-job.yaml"
    argv = ["launch", "jobset", "--swarm", SWARM_DIR, "--image", "registry.example/tokenmill:1",
            "--volume", "runs:/opt/tokenmill/runs", "--parallel", "2", "--gpus-per-task", "2",
            "--cpus-per-task", "8", "--namespace", "search", "--node-selector", "pool=a100",
            "-o", str(out)]  # fmt: skip
    assert main(argv) == 0
    (job,) = yaml.safe_load_all(out.read_text())

    # A batch/v1 Indexed Job: Kubernetes sets JOB_COMPLETION_INDEX (0..completions-1) in each pod.
    assert (job["apiVersion"], job["kind"]) == ("batch/v1", "Job")
    assert job["metadata"]["name"] == "swarm-test" and DNS_LABEL.match(job["metadata"]["name"])
    assert job["metadata"]["namespace"] == "search"
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == PROXIES and spec["parallelism"] == 2
    # Each proxy is retried on its own index; Kubernetes requires restartPolicy Never for a pod failure
    # policy, and an Indexed Job for backoffLimitPerIndex.
    assert spec["backoffLimitPerIndex"] == 3
    (rule,) = spec["podFailurePolicy"]["rules"]
    assert rule == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["nodeSelector"] == {"pool": "a100"}
    (container,) = pod["containers"]
    assert (
        container["image"] == "registry.example/tokenmill:1" and container["workingDir"] == "/opt/tokenmill"
    )
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "2", "cpu": "8"}
    assert container["resources"]["requests"] == container["resources"]["limits"]
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    (mount,) = container["volumeMounts"]
    assert mount["mountPath"] == "/opt/tokenmill/runs"
    assert volumes[mount["name"]]["persistentVolumeClaim"] == {"claimName": "runs"}

    shell, flag, body = container["command"]
    assert (shell, flag) == ("sh", "-c")
    subprocess.run(["sh", "-n", "-c", body], check=True)  # POSIX sh (dash here): images may lack bash
    lines = body.splitlines()
    assert f"SWARM={SWARM_DIR}" in lines and lines[-1] == WORKER

    # Run the pod's command as the kubelet would for two indices, in the image's working directory.
    finish(swarm, "proxy-002")
    env = task_environment(JOB_COMPLETION_INDEX="2")
    env.pop("SLURM_ARRAY_TASK_ID", None)
    task = subprocess.run(["sh", "-c", body], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert task.returncode == 0 and "proxy-002: finished" in task.stdout, task.stderr
    env["JOB_COMPLETION_INDEX"] = "0"
    task = subprocess.run(["sh", "-c", body], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert task.returncode == 1 and "array task 0: proxy-000" in task.stdout
    assert read_result(str(swarm / "proxy-000" / "result.json")).status == "failed"


def test_indexed_job_needs_the_swarm_on_a_shared_volume(swarm, capsys):
    argv = ["launch", "jobset", "--swarm", SWARM_DIR, "--image", "x"]
    assert main(argv) == 2
    assert f"the swarm /opt/tokenmill/{SWARM_DIR} is on no --volume" in capsys.readouterr().err
    assert main([*argv, "--volume", "runs:/opt/tokenmill/runs/other"]) == 2
    assert main([*argv, "--volume", "runs:/opt/tokenmill/runs"]) == 0
    (job,) = yaml.safe_load_all(capsys.readouterr().out)
    assert job["spec"]["parallelism"] == job["spec"]["completions"] == PROXIES  # no --parallel: all at once
    assert job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "1"}


def run_check(root: Path, index: int) -> subprocess.CompletedProcess:
    """Task `index` of the array, as the scheduler starts it: the worker with --index env."""
    env = {**os.environ, "SLURM_ARRAY_TASK_ID": str(index), "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-m", "tokenmill.swarm.worker", str(root), "--index", "env"]
    return subprocess.run(command, capture_output=True, text=True, env=env)


def test_a_task_skips_only_a_proxy_finished_with_its_run_configuration(swarm):
    manifest = json.loads((swarm / "swarm.json").read_text())
    finish(swarm, "proxy-000")
    check = run_check(swarm, 0)
    assert check.returncode == 0 and "proxy-000: finished already" in check.stdout
    # An edited run configuration runs again, as with `tokenmill mixture run` (and fails here: no model).
    run_yaml = swarm / "proxy-000" / "run.yaml"
    run_yaml.write_text(run_yaml.read_text() + "seed: 1\n")
    assert run_check(swarm, 0).returncode == 1
    # A failed proxy is tried again; so is one whose result.json is unreadable. Index i is proxies[i].
    failed = finish(swarm, "proxy-001").model_copy(update={"status": "failed", "error": "boom"})
    write_result(str(swarm / "proxy-001" / "result.json"), failed)
    assert run_check(swarm, 1).returncode == 1
    assert manifest["proxies"][1]["id"] == "proxy-001"
    (swarm / "proxy-002" / "result.json").write_text("{not json")
    assert run_check(swarm, 2).returncode == 1
    assert json.loads((swarm / "proxy-002" / "result.json").read_text())["status"] == "failed"


@pytest.mark.parametrize(
    "scheduler", [["slurm"], ["jobset", "--image", "x", "--volume", "runs:/opt/tokenmill"]]
)
def test_a_folder_without_swarm_json(tmp_path, monkeypatch, capsys, scheduler):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "not-a-swarm").mkdir()
    assert main(["launch", *scheduler, "--swarm", "not-a-swarm"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"--swarm not-a-swarm: no not-a-swarm/swarm\.json \(", err), err
    assert not (tmp_path / "not-a-swarm" / "logs").exists()


def test_a_bad_swarm_json_names_the_file(swarm, capsys):
    (swarm / "swarm.json").write_text('{"format_version": 1}')
    assert main(["launch", "slurm", "--swarm", SWARM_DIR]) == 2
    assert f"{SWARM_DIR}/swarm.json" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--swarm", SWARM_DIR, "--config", "run.yaml", "--nodes", "2"], "or --swarm DIR (a swarm's"),
        ([], "give --config FILE (one run on several machines) or --swarm DIR"),
        (["--swarm", SWARM_DIR, "--nodes", "2"], "--nodes: only with --config"),
        (["--swarm", SWARM_DIR, "--", "--seed", "1"], "-- FLAGS: only with --config"),
        (["--config", "run.yaml", "--nodes", "2", "--parallel", "4"], "--parallel: only with --swarm"),
        (["--config", "run.yaml"], "--config needs --nodes"),
        (["--swarm", SWARM_DIR, "--parallel", "0"], "--parallel: at least 1"),
    ],
)
def test_the_two_forms_exclude_each_other(swarm, capsys, argv, message):
    assert main(["launch", "slurm", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    if "--config" in argv and "--swarm" in argv:
        assert "not both" in err


# ---------------------------------------------------------------------------------------------------------
# Hostile values (see test_launch.HOSTILE): a swarm's folder, and the flags around it, reach each task as
# data, or are refused.


def recording_python(tmp_path: Path) -> Path:
    """A folder holding a `python` that writes its arguments, NUL-separated, to $RECORD, and runs nothing."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    python = bin_dir / "python"
    python.write_text('#!/bin/sh\nprintf "%s\\0" "$@" > "$RECORD"\n')
    python.chmod(0o755)
    return bin_dir


@pytest.mark.parametrize("value", HOSTILE)
def test_indexed_job_passes_a_hostile_swarm_folder_as_data(tmp_path, monkeypatch, value):
    """The swarm's folder and --workdir hold `value`: the Job loads back as one document with them verbatim
    (and nowhere a key), and its pod's command hands the folder to the worker as one argument."""
    monkeypatch.chdir(tmp_path)
    folder = f"runs/{value}"
    make_swarm(tmp_path / folder, folder)
    workdir = f"/opt/{value}"
    out = tmp_path / "job.yaml"
    argv = ["launch", "jobset", f"--swarm={folder}", "--image", "x", f"--workdir={workdir}",
            f"--volume=runs:{workdir}/runs", "-o", str(out)]  # fmt: skip
    assert main(argv) == 0
    documents = list(yaml.safe_load_all(out.read_text()))
    assert [document["kind"] for document in documents] == ["Job"]
    assert not any(value in key for key in keys_of(documents[0]))
    (container,) = documents[0]["spec"]["template"]["spec"]["containers"]
    assert container["workingDir"] == workdir
    assert container["volumeMounts"] == [{"name": "volume-0", "mountPath": f"{workdir}/runs"}]

    shell, flag, body = container["command"]
    assert (shell, flag) == ("sh", "-c")
    record = tmp_path / "python.args"
    env = task_environment(JOB_COMPLETION_INDEX="1", RECORD=str(record))
    env["PATH"] = f"{recording_python(tmp_path)}:{env['PATH']}"
    subprocess.run(["sh", "-c", body], env=env, cwd=tmp_path, check=True)
    no_pwned(tmp_path)
    assert record.read_text().split("\0")[:-1] == ["-m", "tokenmill.swarm.worker", folder, "--index", "env"]


def test_slurm_array_passes_what_an_sbatch_line_holds(tmp_path, monkeypatch):
    """Every character SBATCH_VALUE lets through reaches the task as it was given."""
    monkeypatch.chdir(tmp_path)
    folder = "runs/a=b,c@d+e:f-g_h.i"
    make_swarm(tmp_path / folder, folder)
    script_path = tmp_path / "swarm.sbatch"
    assert main(["launch", "slurm", "--swarm", folder, "--chdir", str(tmp_path), "-o", str(script_path)]) == 0
    assert sbatch_options(script_path.read_text())["--output"] == f"{folder}/logs/%A_%a.out"
    record = tmp_path / "python.args"
    env = task_environment(SLURM_ARRAY_TASK_ID="0", RECORD=str(record))
    env["PATH"] = f"{recording_python(tmp_path)}:{env['PATH']}"
    subprocess.run(["bash", str(script_path)], env=env, cwd=tmp_path / "runs", check=True)
    assert record.read_text().split("\0")[:-1] == ["-m", "tokenmill.swarm.worker", folder, "--index", "env"]


@pytest.mark.parametrize("value", [*HOSTILE[:-1], *LINE_BREAKS, "a b", "100%"])
def test_slurm_array_refuses_a_swarm_folder_sbatch_cannot_hold(tmp_path, monkeypatch, capsys, value):
    """The folder is in the tasks' #SBATCH --output line, which sbatch parses itself: what it would misread
    there is refused (naming --swarm), before the logs folder is made."""
    monkeypatch.chdir(tmp_path)
    folder = f"runs/{value}"
    make_swarm(tmp_path / folder, folder)
    assert main(["launch", "slurm", f"--swarm={folder}"]) == 2
    err = capsys.readouterr().err
    assert f"--swarm {folder!r}: " in err, err
    assert not (tmp_path / folder / "logs").exists()


@pytest.mark.parametrize("flag", ["--partition", "--account", "--time", "--chdir"])
@pytest.mark.parametrize("value", ["x$(touch PWNED)", "a b", "#comment", "a\ntouch PWNED", "100%"])
def test_slurm_array_refuses_what_an_sbatch_line_cannot_hold(swarm, capsys, flag, value):
    assert main(["launch", "slurm", "--swarm", SWARM_DIR, f"{flag}={value}"]) == 2
    assert f"{flag} {value!r}: an #SBATCH value may hold only" in capsys.readouterr().err


@pytest.mark.parametrize("value", LINE_BREAKS)
def test_indexed_job_refuses_a_swarm_folder_of_several_lines(tmp_path, monkeypatch, capsys, value):
    """The folder heads the manifest as a comment, which a line break would end."""
    monkeypatch.chdir(tmp_path)
    folder = f"runs/{value}"
    make_swarm(tmp_path / folder, folder)
    argv = ["launch", "jobset", f"--swarm={folder}", "--image", "x", "--volume", "runs:/opt/tokenmill/runs"]
    assert main(argv) == 2
    assert f"--swarm {folder!r}: holds a line break" in capsys.readouterr().err
