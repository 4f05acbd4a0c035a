"""`tokenmill launch`: the JobSet manifest and the SLURM script written from one run configuration, checked
by parsing them as their schedulers would (the JobSet schema's required fields, Kubernetes' naming and
Indexed-Job rules, `bash -n`, #SBATCH lines), and by running the script against a stand-in `srun`."""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import stat
import subprocess
from pathlib import Path

import pytest
import yaml
from test_trainer_cli import TINY

from tokenmill.cli import main
from tokenmill.trainer.run.config import build_run_config, read_run_config_file
from tokenmill.trainer.run.distributed import ProcessGroup, process_group

DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


@pytest.fixture
def run_config(tmp_path: Path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(
        f"output: runs/tiny-Multi_Host\nmodel: {TINY}\nseed: 7\n"
        "data: {synthetic: true, batch_size: 32, sequence_length: 64}\n"
        "mesh: {data: 1, fsdp: -1, expert: 2}\nschedule: {steps: 100}\n"
    )
    return path


def settings(path: Path) -> dict:
    return build_run_config(read_run_config_file(str(path)), {}, str(path)).model_dump(mode="json")


def pod_environment(container: dict, annotations: dict[str, str]) -> dict[str, str]:
    """The container's environment as the kubelet gives it: values, and annotations by the downward API."""
    env = {}
    for variable in container["env"]:
        if "value" in variable:
            env[variable["name"]] = variable["value"]
        else:
            path = variable["valueFrom"]["fieldRef"]["fieldPath"]
            key = re.fullmatch(r"metadata\.annotations\['(.+)'\]", path).group(1)
            env[variable["name"]] = annotations[key]
    return env


def test_jobset_manifest(run_config, tmp_path, capsys):
    out = tmp_path / "jobset.yaml"
    argv = ["launch", "jobset", "--config", str(run_config), "--nodes", "4", "--devices-per-node", "4",
            "--processes-per-node", "2", "--image", "registry.example/tokenmill:1", "--volume",
            "runs:/opt/tokenmill/runs", "--port", "9123", "-o", str(out),
            "--", "--logging.peak_flops", "1e15"]  # fmt: skip
    assert main(argv) == 0
    config_map, jobset = yaml.safe_load_all(out.read_text())

    # The run configuration travels in the ConfigMap, model inlined: the same run as the file.
    assert (config_map["apiVersion"], config_map["kind"]) == ("v1", "ConfigMap")
    frozen = tmp_path / "frozen.yaml"
    frozen.write_text(config_map["data"]["run.yaml"])
    assert settings(frozen) == settings(run_config)

    # The JobSet schema's required fields, and the rules Kubernetes enforces on Jobs and names.
    assert (jobset["apiVersion"], jobset["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    name = jobset["metadata"]["name"]
    assert name == "tiny-multi-host" and DNS_LABEL.match(name)
    (workers,) = jobset["spec"]["replicatedJobs"]
    assert DNS_LABEL.match(workers["name"]) and workers["replicas"] == 1
    job = workers["template"]["spec"]
    assert job["completionMode"] == "Indexed" and job["parallelism"] == job["completions"] == 8
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] in ("Never", "OnFailure")  # a Job's pods may not restart Always
    (container,) = pod["containers"]
    assert container["name"] and container["image"] == "registry.example/tokenmill:1"
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "2"}  # 4 devices over 2 processes a node
    assert container["command"] == ["tokenmill", "train", "--config", "/etc/tokenmill/run.yaml",
                                    "--mesh.distributed", "--logging.peak_flops", "1e15"]  # fmt: skip
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    for mount in container["volumeMounts"]:
        assert mount["name"] in volumes
    assert volumes["run-config"]["configMap"]["name"] == config_map["metadata"]["name"]
    assert {"name": "coordinator", "containerPort": 9123} in container["ports"]

    # Every pod finds its place: JobSet names pod I of job J of replicated job R `NAME-R-J-I`, under a
    # headless service named after the JobSet; the completion index reaches the pod as an annotation.
    hostnames = [f"{name}-{workers['name']}-0-{index}" for index in range(8)]
    assert all(len(hostname) <= 63 and DNS_LABEL.match(hostname) for hostname in hostnames)
    groups = [
        process_group(
            environ=pod_environment(container, {"batch.kubernetes.io/job-completion-index": str(i)})
        )
        for i in range(8)
    ]
    assert groups == [
        ProcessGroup(
            f"{hostnames[0]}.{name}:9123",
            8,
            i,
            ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"),
        )  # fmt: skip
        for i in range(8)
    ]
    assert "wrote" not in capsys.readouterr().out


def test_jobset_needs_the_run_folder_on_a_shared_volume(run_config, capsys):
    argv = ["launch", "jobset", "--config", str(run_config), "--nodes", "2", "--image", "x"]
    assert main(argv) == 2
    assert "the run folder /opt/tokenmill/runs/tiny-Multi_Host is on no --volume" in capsys.readouterr().err
    assert main([*argv, "--volume", "runs:/opt/tokenmill/runs/other"]) == 2
    assert main([*argv, "--volume", "runs:/opt/tokenmill/runs"]) == 0


def sbatch_options(script: str) -> dict[str, str]:
    options = {}
    for line in script.splitlines():
        if line.startswith("#SBATCH"):
            flag, _, value = line.removeprefix("#SBATCH ").partition("=")
            options[flag] = value
    return options


def test_slurm_script(run_config, tmp_path):
    script_path = tmp_path / "job.sbatch"
    argv = ["launch", "slurm", "--config", str(run_config), "--nodes", "2", "--devices-per-node", "8",
            "--partition", "gpu", "--time", "1-00:00:00", "--setup", "export MARK='set up'",
            "-o", str(script_path), "--", "--logging.peak_flops", "1e15"]  # fmt: skip
    assert main(argv) == 0
    script = script_path.read_text()
    subprocess.run(["bash", "-n", str(script_path)], check=True)
    assert sbatch_options(script) == {
        "--job-name": "tiny-multi-host",
        "--nodes": "2",
        "--ntasks-per-node": "1",
        "--gpus-per-node": "8",
        "--partition": "gpu",
        "--time": "1-00:00:00",
        "--exclusive": "",
        "--output": "tiny-multi-host-%j.out",
        "--requeue": "",
        "--signal": "TERM@180",  # the run's preemption deadline (120 s) and a minute
    }
    # All #SBATCH lines come before the first command, or sbatch ignores them.
    lines = [line for line in script.splitlines() if line and not line.startswith("#")]
    assert script.index(lines[0]) > script.rindex("#SBATCH")

    # Run it as sbatch would on the first node, with an `srun` that records what it was asked to start.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(
        '#!/bin/bash\nprintf "%s\\n" "$@" > srun.args\necho "$JAX_COORDINATOR_PORT $MARK" > srun.env\n'
    )
    srun.chmod(srun.stat().st_mode | stat.S_IEXEC)
    workdir = tmp_path / "submit"
    workdir.mkdir()
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "77",
        "SLURM_SUBMIT_DIR": str(workdir),
    }
    subprocess.run(["bash", str(script_path)], env=env, check=True, cwd=tmp_path)
    args = (workdir / "srun.args").read_text().splitlines()
    frozen = "runs/tiny-Multi_Host/launch-77.yaml"
    assert args == ["--kill-on-bad-exit=1", "tokenmill", "train", "--config", frozen, "--mesh.distributed",
                    "--logging.peak_flops", "1e15"]  # fmt: skip
    assert (workdir / "srun.env").read_text() == "8476 set up\n"
    assert settings(workdir / frozen) == settings(run_config)

    # Each task srun starts finds its place from SLURM's variables.
    tasks = [
        process_group(
            environ={
                "SLURM_JOB_ID": "77",
                "SLURM_JOB_NODELIST": "gpu[12-13]",
                "SLURM_NTASKS": "2",
                "SLURM_PROCID": str(i),
                "JAX_COORDINATOR_PORT": "8476",
            }
        )  # fmt: skip
        for i in range(2)
    ]
    assert [(t.coordinator, t.num_processes, t.process_id) for t in tasks] == [
        ("gpu12:8476", 2, 0),
        ("gpu12:8476", 2, 1),
    ]


def test_slurm_several_processes_per_node_split_the_gpus(run_config, capsys):
    argv = ["launch", "slurm", "--config", str(run_config), "--nodes", "2", "--devices-per-node", "8"]
    assert main([*argv, "--processes-per-node", "4"]) == 0
    options = sbatch_options(capsys.readouterr().out)
    assert options["--ntasks-per-node"] == "4" and options["--gpus-per-task"] == "2"
    assert "--gpus-per-node" not in options


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            "mesh: {data: 1, fsdp: 3, expert: 2}\n",
            "the mesh data=1, fsdp=3, expert=2 does not fit 16 devices",
        ),
        ("mesh: {data: 1, fsdp: -1, expert: 3}\n", "does not fit 16 devices (2 nodes x 8)"),
        ("data: {synthetic: true, batch_size: 24}\n", "batch size 24 is not divisible by the 16 devices"),
        ("mesh: {data: 1, fsdp: -1, expert: 2, colour: red}\n", "colour"),
    ],
)
def test_launch_refuses_what_the_devices_cannot_run(run_config, capsys, change, message):
    text = run_config.read_text()
    section = change.split(":")[0]
    run_config.write_text(
        "\n".join(line for line in text.splitlines() if not line.startswith(section)) + "\n" + change
    )
    assert (
        main(["launch", "slurm", "--config", str(run_config), "--nodes", "2", "--devices-per-node", "8"]) == 2
    )
    assert message in capsys.readouterr().err


def test_launch_quotes_what_it_writes(run_config, capsys):
    assert (
        main(
            [
                "launch",
                "slurm",
                "--config",
                str(run_config),
                "--nodes",
                "1",
                "--",
                "--logging.wandb_project",
                "a b;c",
            ]
        )
        == 0
    )
    srun = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("srun "))
    assert shlex.split(srun)[-2:] == ["--logging.wandb_project", "a b;c"]


# ---------------------------------------------------------------------------------------------------------
# Hostile values: run configurations come from other people's pull requests. What `tokenmill launch` writes
# must pass each value on as data (one argument, one YAML scalar), or refuse it; never run it.

#: Values a path, a name or a flag of a configuration might hold, each one line: shell (command
#: substitution, quotes, separators, parameters) and YAML (keys, items, flow mappings, aliases, anchors,
#: comments, tags). Each "would run" `touch PWNED`, or make a key or a document of its own.
HOSTILE = [
    "x$(touch PWNED)",
    "`touch PWNED`",
    "a'b\"c",
    "a;touch PWNED",
    "a&&touch PWNED",
    "a|touch PWNED",
    "key: value",
    "- item",
    "{a: 1}",
    "*alias",
    "&anchor",
    "#comment",
    "!!python/object/apply:os.system ['touch PWNED']",
    "${HOME}",
    "--help",
]
#: What breaks a line: of a shell script (newline), or of YAML too (carriage return, the separators).
LINE_BREAKS = ["a\ntouch PWNED", "a\rtouch PWNED", "a\u2028touch PWNED", "a\u2029touch PWNED"]
#: A flag's value may hold a newline: as one quoted word (one YAML scalar) it reaches `tokenmill train`
#: whole, which is how a multi-line value is passed.
MULTI_LINE_FLAG = "line one\ntouch PWNED\nTOKENMILL_RUN_CONFIG\n"


def hostile_run_config(tmp_path: Path, value: str, output: str | None = None) -> Path:
    """A run configuration whose file and run folder are both named `value` (folders where it has '/')."""
    path = tmp_path / "configs" / f"{value}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {"output": f"runs/{value}" if output is None else output, "model": TINY, "seed": 7,
                "data": {"synthetic": True, "batch_size": 32, "sequence_length": 64},
                "mesh": {"data": 1, "fsdp": -1, "expert": 2}, "schedule": {"steps": 100}}  # fmt: skip
    path.write_text(yaml.safe_dump(document))
    return path


def recording_srun(tmp_path: Path) -> Path:
    """A folder holding an `srun` that writes its arguments, NUL-separated (a newline in one survives), to
    $RECORD, and runs nothing."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    srun = bin_dir / "srun"
    srun.write_text('#!/bin/bash\nprintf "%s\\0" "$@" > "$RECORD"\n')
    srun.chmod(srun.stat().st_mode | stat.S_IEXEC)
    return bin_dir


def no_pwned(root: Path) -> None:
    assert not list(root.rglob("PWNED")), "a hostile value ran"


@pytest.mark.parametrize("value", HOSTILE)
def test_slurm_passes_hostile_values_as_data(tmp_path, value):
    """The run folder, the configuration's path, --chdir and the flags after `--` all hold `value`: the
    script, run by bash as sbatch would, hands each to srun verbatim and runs none of them."""
    run_config = hostile_run_config(tmp_path, value)
    submit = tmp_path / "submit" / value
    submit.mkdir(parents=True)
    script_path = tmp_path / "job.sbatch"
    argv = ["launch", "slurm", "--config", str(run_config), "--nodes", "1", f"--chdir={submit}",
            "-o", str(script_path), "--", "--logging.wandb_project", value,
            "--logging.wandb_entity", MULTI_LINE_FLAG]  # fmt: skip
    assert main(argv) == 0
    script = script_path.read_text()
    subprocess.run(["bash", "-n", str(script_path)], check=True)
    # The #SBATCH lines hold only what launch made of them (the name is a DNS label), whole.
    options = sbatch_options(script)
    assert DNS_LABEL.match(options["--job-name"])
    assert options["--output"] == f"{options['--job-name']}-%j.out"

    record = tmp_path / "srun.args"
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "PATH": f"{recording_srun(tmp_path)}:{os.environ['PATH']}", "RECORD": str(record),
           "SLURM_JOB_ID": "77", "HOME": str(home)}  # fmt: skip
    subprocess.run(["bash", str(script_path)], env=env, check=True, cwd=tmp_path)
    no_pwned(tmp_path)
    frozen = f"runs/{value}/launch-77.yaml"
    assert record.read_text().split("\0")[:-1] == [
        "--kill-on-bad-exit=1", "tokenmill", "train", "--config", frozen, "--mesh.distributed",
        "--logging.wandb_project", value, "--logging.wandb_entity", MULTI_LINE_FLAG,
    ]  # fmt: skip
    # The configuration was written where srun was told to find it (the run folder, from --chdir), whole.
    assert settings(submit / frozen) == settings(run_config)


def test_slurm_here_document_cannot_be_closed_from_inside(run_config, tmp_path):
    """The frozen configuration is a quoted here-document: a line of it equal to the delimiter would end it
    and run what follows, so launch picks a delimiter no line of it is."""
    from tokenmill.trainer.commands.launch import plan_launch, slurm_script

    launch = plan_launch(str(run_config), 1, 8)
    smuggled = launch.run_yaml + "TOKENMILL_RUN_CONFIG\ntouch PWNED\nTOKENMILL_RUN_CONFIG_\n"
    script_path = tmp_path / "job.sbatch"
    script_path.write_text(slurm_script(dataclasses.replace(launch, run_yaml=smuggled)))
    env = {
        **os.environ,
        "PATH": f"{recording_srun(tmp_path)}:{os.environ['PATH']}",
        "RECORD": str(tmp_path / "srun.args"),
        "SLURM_JOB_ID": "5",
        "SLURM_SUBMIT_DIR": str(tmp_path),
    }
    subprocess.run(["bash", str(script_path)], env=env, check=True, cwd=tmp_path)
    no_pwned(tmp_path)
    assert (tmp_path / "runs/tiny-Multi_Host/launch-5.yaml").read_text() == smuggled.rstrip("\n") + "\n"


@pytest.mark.parametrize("flag", ["--partition", "--account", "--time"])
# ("--help" is left out: `--partition=--help` is one word to sbatch, a partition of that name.)
@pytest.mark.parametrize("value", [*HOSTILE[:-1], *LINE_BREAKS, "a b", "100%", "a\\b"])
def test_slurm_refuses_what_an_sbatch_line_cannot_hold(run_config, tmp_path, capsys, flag, value):
    """sbatch parses #SBATCH lines itself (blanks, '#', quotes, '%'): what it would misread is refused, the
    message naming the flag and the value."""
    out = tmp_path / "job.sbatch"
    assert (
        main(
            [
                "launch",
                "slurm",
                "--config",
                str(run_config),
                "--nodes",
                "1",
                f"{flag}={value}",
                "-o",
                str(out),
            ]
        )
        == 2
    )
    assert f"{flag} {value!r}: an #SBATCH value may hold only" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("value", LINE_BREAKS)
@pytest.mark.parametrize(
    "scheduler", [["slurm"], ["jobset", "--image", "x", "--volume", "runs:/opt/tokenmill"]]
)
def test_launch_refuses_a_path_of_several_lines(tmp_path, capsys, scheduler, value):
    """A line break in the run folder or the configuration's path would end the comment or the line it is
    written in: refused, naming the field."""
    base = ["launch", *scheduler, "--nodes", "1"]
    run_config = hostile_run_config(tmp_path, "plain", output=f"runs/{value}")
    assert main([*base, "--config", str(run_config)]) == 2
    assert f"{run_config}: output: {'runs/' + value!r}: holds a line break" in capsys.readouterr().err
    run_config = hostile_run_config(tmp_path, value, output="runs/plain")
    assert main([*base, "--config", str(run_config)]) == 2
    assert f"--config {str(run_config)!r}: holds a line break" in capsys.readouterr().err
    if scheduler == ["slurm"]:
        assert main([*base, "--config", str(hostile_run_config(tmp_path, "ok")), f"--chdir=/x/{value}"]) == 2
        assert f"--chdir {'/x/' + value!r}: holds a line break" in capsys.readouterr().err


def keys_of(node: object) -> set:
    """Every mapping key anywhere in a loaded YAML document."""
    if isinstance(node, dict):
        return set(node).union(*(keys_of(value) for value in node.values()))
    if isinstance(node, list):
        return set().union(*(keys_of(item) for item in node))
    return set()


@pytest.mark.parametrize("value", HOSTILE)
def test_jobset_writes_hostile_values_as_scalars(tmp_path, value):
    """Image, namespace, volume claim and mount, node selector, run folder, the configuration's path and the
    flags after `--` all hold `value`: the manifest loads back as exactly its two documents, each value where
    it was put, verbatim, and nowhere a key."""
    run_config = hostile_run_config(tmp_path, value)
    mount = f"/opt/tokenmill/runs/{value}"  # the run folder, runs/VALUE in the workdir, is on it
    claim = value.replace(":", "-")  # CLAIM:MOUNT splits at the first ':'
    out = tmp_path / "jobset.yaml"
    argv = ["launch", "jobset", "--config", str(run_config), "--nodes", "2", f"--image={value}",
            f"--namespace={value}", f"--volume={claim}:{mount}", f"--node-selector=pool={value}",
            "-o", str(out), "--", "--logging.wandb_project", value,
            "--logging.wandb_entity", MULTI_LINE_FLAG]  # fmt: skip
    assert main(argv) == 0
    documents = list(yaml.safe_load_all(out.read_text()))
    assert [document["kind"] for document in documents] == ["ConfigMap", "JobSet"]
    config_map, jobset = documents
    assert config_map["metadata"]["namespace"] == jobset["metadata"]["namespace"] == value
    frozen = tmp_path / "frozen.yaml"
    frozen.write_text(config_map["data"]["run.yaml"])
    assert settings(frozen) == settings(run_config) and settings(frozen)["output"] == f"runs/{value}"
    pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == value and pod["nodeSelector"] == {"pool": value}
    assert container["command"] == ["tokenmill", "train", "--config", "/etc/tokenmill/run.yaml",
                                    "--mesh.distributed", "--logging.wandb_project", value,
                                    "--logging.wandb_entity", MULTI_LINE_FLAG]  # fmt: skip
    assert {"name": "volume-0", "mountPath": mount} in container["volumeMounts"]
    assert {"name": "volume-0", "persistentVolumeClaim": {"claimName": claim}} in pod["volumes"]
    assert not any(value in key for document in documents for key in keys_of(document))


@pytest.mark.parametrize("value", LINE_BREAKS)
@pytest.mark.parametrize(
    ("flag", "given"),
    [("--image", "{}"), ("--namespace", "{}"), ("--workdir", "/opt/{}"), ("--node-selector", "pool={}"),
     ("--volume", "runs:/opt/tokenmill/{}")],
)  # fmt: skip
def test_jobset_refuses_values_of_several_lines(run_config, capsys, flag, given, value):
    argv = ["launch", "jobset", "--config", str(run_config), "--nodes", "2", "--image", "x", "--volume",
            "runs:/opt/tokenmill/runs", "--workdir", "/opt/tokenmill"]  # fmt: skip
    assert main([*argv, f"{flag}={given.format(value)}"]) == 2
    assert f"{flag} {given.format(value)!r}: holds a line break" in capsys.readouterr().err


@pytest.mark.parametrize(("code", "requeued"), [(0, False), (1, False), (75, True), (76, True)])
def test_slurm_requeues_a_preempted_or_hung_run(run_config, tmp_path, code, requeued):
    """srun's exit code 75 (preempted, checkpointed) or 76 (hung) requeues the job; the script exits
    with srun's code either way."""
    script_path = tmp_path / "job.sbatch"
    assert main(["launch", "slurm", "--config", str(run_config), "--nodes", "2", "-o", str(script_path)]) == 0
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("srun", f"exit {code}"), ("scontrol", 'printf "%s " "$@" > scontrol.args')):
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "77",
           "SLURM_SUBMIT_DIR": str(tmp_path)}  # fmt: skip
    result = subprocess.run(["bash", str(script_path)], env=env, cwd=tmp_path)
    assert result.returncode == code
    recorded = tmp_path / "scontrol.args"
    assert recorded.exists() == requeued
    if requeued:
        assert recorded.read_text() == "requeue 77 "


def test_jobset_restarts_a_preempted_run_without_using_up_a_restart(run_config, tmp_path):
    out = tmp_path / "jobset.yaml"
    argv = ["launch", "jobset", "--config", str(run_config), "--nodes", "2", "--image", "x", "--volume",
            "runs:/opt/tokenmill/runs", "-o", str(out)]  # fmt: skip
    assert main(argv) == 0
    _, jobset = yaml.safe_load_all(out.read_text())
    policy = jobset["spec"]["failurePolicy"]
    assert policy["maxRestarts"] == 3
    assert policy["rules"] == [
        {"action": "RestartJobSetAndIgnoreMaxRestarts", "onJobFailureReasons": ["PodFailurePolicy"]}
    ]
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    rules = job["podFailurePolicy"]["rules"]
    # Exit 75 of the train container, or a disrupted pod, fails the job by its pod failure policy.
    exit_75 = {"containerName": "train", "operator": "In", "values": [75]}
    assert rules[0] == {"action": "FailJob", "onExitCodes": exit_75}
    assert rules[1] == {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget"}]}
    pod = job["template"]["spec"]
    assert pod["containers"][0]["name"] == "train" and pod["terminationGracePeriodSeconds"] == 180
