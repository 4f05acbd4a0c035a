"""Training on more than one machine: `tokenmill launch` writes the job for a multi-host scheduler, and every
process of that job finds its place in it (`process_group`).

A multi-host JAX job needs three facts in every process: the coordinator's address (process 0's host and a
port), the number of processes and this process's id. `jax.distributed.initialize` (jax 0.10) reads only
the coordinator address from the environment (JAX_COORDINATOR_ADDRESS) and detects SLURM, Open MPI and
Cloud TPU by itself; it does not read JAX_NUM_PROCESSES or JAX_PROCESS_ID, and under SLURM it makes every
process see one local device. So tokenmill resolves all three itself and passes them explicitly, each
from the first of:

1. the command line: `--coordinator HOST[:PORT]`, `--num-processes N`, `--process-id I`;
2. JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID (what the JobSet manifest below sets);
3. SLURM, inside `srun`: the first host of SLURM_STEP_NODELIST (else SLURM_JOB_NODELIST), SLURM_NTASKS,
   SLURM_PROCID;
4. a Kubernetes Indexed Job (JobSet): JOB_COMPLETION_INDEX for the process id.

The coordinator's port, where only a host is known: JAX_COORDINATOR_PORT, else (SLURM) one derived from the
job id as JAX does (two jobs sharing a node do not collide), else 8476.

`tokenmill launch jobset|slurm` writes, from one run configuration (configs/runs/*.yaml):

- a Kubernetes JobSet (jobset.x-k8s.io/v1alpha2) of one replicated job whose Indexed Job runs one pod per
  process, with a ConfigMap holding the run configuration (model inlined): the coordinator is pod 0 of job 0
  of the replicated job, reached through the JobSet's headless service
  (`NAME-workers-0-0.NAME:PORT`), the process count is the job's parallelism, the process id is the pod's
  completion index (the `batch.kubernetes.io/job-completion-index` annotation, through the downward API);
- a SLURM batch script: `srun` starts the processes, and each reads SLURM_PROCID, SLURM_NTASKS and the
  first node of the allocation.

Both run `tokenmill train --config FILE --mesh.distributed` in every process; the data each process reads is a
function of the global step and its process index, so nothing else has to be coordinated. No JAX here: the
command line checks a launch before anything starts.

`tokenmill launch jobset|slurm --swarm SWARM` writes instead a mixture search's swarm (swarm.json, written by
`tokenmill mixture swarm`) as one job array, one task per proxy, each task independent of the others:

- a SLURM array (`#SBATCH --array=0-(N-1)%P`), one node, one task and its devices per array task;
- a Kubernetes batch/v1 Job with `completionMode: Indexed` (`completions` N, `parallelism` P), not a JobSet:
  the proxies do not talk to one another, so they need no headless service, and a plain Indexed Job retries
  each failed index on its own (`backoffLimitPerIndex`) where a JobSet would recreate every pod.

Task i runs `python -m tokenmill.swarm.worker SWARM --index env`, which trains proxy i of swarm.json's
`proxies` (from SLURM_ARRAY_TASK_ID or JOB_COMPLETION_INDEX), unless that proxy's result.json already says it
finished with the run configuration it has now (the worker checks, as `tokenmill mixture run` does): a
resubmitted array then reruns only what is unfinished. The manifest is read through tokenmill.formats (the
trainer does not import tokenmill.swarm).

Run configurations (and swarms) come from other people's pull requests, so nothing from them, or from the
command line, is pasted into what a scheduler runs: shell words are shlex-quoted (the run configuration's
path in the SLURM script too, with only `${SLURM_JOB_ID}` left to expand), manifests are written by a YAML
dumper (every value a scalar, never a key or a document), and what cannot be quoted is refused with a
UsageError naming the flag or field: a line break or control character in any path, name or value (it would
end a comment line of the script or of the manifest), and in an #SBATCH value anything outside
`SBATCH_VALUE` (sbatch parses those lines itself). `--setup` alone is shell by design: the launching user's
own line, never a configuration's.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tokenmill import storage
from tokenmill.errors import FormatError, UsageError
from tokenmill.formats.swarm import SWARM, read_swarm
from tokenmill.trainer.run.distributed import DEFAULT_COORDINATOR_PORT
from tokenmill.trainer.run.watchdog import HANG_EXIT, REQUEUE_EXIT

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
REPLICATED_JOB = "workers"
CONFIG_MOUNT = "/etc/tokenmill"
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
DEFAULT_DEVICES_PER_NODE = 8
DEFAULT_PROCESSES_PER_NODE = 1

#: What an #SBATCH value may hold. sbatch reads those lines itself, not through a shell: it splits them at
#: blanks, ends them at '#', takes quotes and backslashes its own way, and expands '%' in file names. So a
#: value there is not quoted but checked against this set, which every partition, account, time limit and
#: ordinary path fits.
SBATCH_VALUE = re.compile(r"[A-Za-z0-9._,:@+=/-]+")
#: Unicode categories that break a line somewhere we write one: control characters (newline, carriage
#: return, NUL, ...) and the line and paragraph separators, which YAML also reads as line breaks.
LINE_BREAKING = ("Cc", "Zl", "Zp")


def one_line(field: str, value: str) -> str:
    """`value`, unless it holds a line break or control character: then UsageError naming `field`. Such a
    value would end the comment or directive it is written in and start a line of its own; no path, name or
    image is legitimately made of several lines."""
    if any(unicodedata.category(char) in LINE_BREAKING for char in value):
        raise UsageError(
            f"{field} {value!r}: holds a line break or control character, which tokenmill launch refuses "
            "(it would start a new line of the script or manifest)"
        )
    return value


def sbatch_value(field: str, value: str) -> str:
    """`value` for an #SBATCH directive, unless it holds a character outside SBATCH_VALUE: then UsageError
    naming `field` (sbatch parses the line itself, so the value cannot be quoted)."""
    if not SBATCH_VALUE.fullmatch(value):
        raise UsageError(
            f"{field} {value!r}: an #SBATCH value may hold only letters, digits and . _ , : @ + = / - "
            "(sbatch reads the line itself, so it cannot be quoted)"
        )
    return value


# ---------------------------------------------------------------------------------------------------------
# `tokenmill launch`: the job, from one run configuration.


@dataclass(frozen=True)
class Launch:
    """What every scheduler needs to know: the run, and how many machines, processes and devices."""

    name: str  # the job's name: a DNS label (Kubernetes names pods after it)
    config_path: str  # the run configuration the job was written from
    run_yaml: str  # that configuration, model inlined, frozen into the job
    output: str  # the run folder, which every process writes to (checkpoints): a shared filesystem
    nodes: int
    processes_per_node: int
    devices_per_node: int
    port: int
    train_args: tuple[str, ...]  # more `tokenmill train` flags, after --config and --mesh.distributed

    @property
    def processes(self) -> int:
        return self.nodes * self.processes_per_node

    @property
    def devices_per_process(self) -> int:
        return self.devices_per_node // self.processes_per_node

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    def train_command(self, config: str) -> list[str]:
        return ["tokenmill", "train", "--config", config, "--mesh.distributed", *self.train_args]


def dns_label(text: str) -> str:
    """`text` as a Kubernetes name (RFC 1035 label: lower-case letters, digits, '-', starting with a letter),
    short enough for the pod hostnames built from it (NAME-workers-J-I)."""
    label = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    label = re.sub(r"-{2,}", "-", label)
    if not label or not label[0].isalpha():
        label = f"tokenmill-{label}".rstrip("-")
    return label[:40].rstrip("-")


def plan_launch(
    config_path: str,
    nodes: int,
    devices_per_node: int,
    processes_per_node: int = 1,
    name: str | None = None,
    port: int = DEFAULT_COORDINATOR_PORT,
    train_args: tuple[str, ...] = (),
) -> Launch:
    """Read and check a run configuration for a job of `nodes` machines; UsageError says what does not fit
    (the mesh or the batch against the devices, a missing model or output)."""
    from tokenmill.trainer.run.config import RunConfigError, build_run_config, read_run_config_file

    if nodes < 1 or processes_per_node < 1 or devices_per_node < 1:
        raise UsageError("--nodes, --processes-per-node and --devices-per-node must be positive")
    one_line("--config", config_path)  # it heads the frozen configuration and the job as a comment
    for flag in train_args:
        if "\0" in flag:  # every other character reaches `tokenmill train` quoted, as one argument
            raise UsageError(f"-- {flag!r}: a NUL cannot be passed in an argument")
    if devices_per_node % processes_per_node:
        raise UsageError(
            f"{devices_per_node} devices per node do not split evenly over {processes_per_node} processes"
        )
    try:
        raw = read_run_config_file(config_path)
        run = build_run_config(raw, {}, config_path)
    except RunConfigError as error:
        raise UsageError(str(error)) from error
    if run.model is None:
        raise UsageError(f"{config_path}: no model: (a multi-host job trains the configuration as written)")
    if not run.output:
        raise UsageError(f"{config_path}: no output: (every process writes the run's checkpoints there)")
    one_line(f"{config_path}: output:", run.output)
    devices = nodes * devices_per_node
    sizes = [run.mesh.data, run.mesh.fsdp, run.mesh.expert]
    known = 1
    for size in sizes:
        known *= size if size != -1 else 1
    if (-1 in sizes and devices % known) or (-1 not in sizes and known != devices):
        raise UsageError(
            f"{config_path}: the mesh data={sizes[0]}, fsdp={sizes[1]}, expert={sizes[2]} does not fit "
            f"{devices} devices ({nodes} nodes x {devices_per_node}); a multi-host mesh uses every device"
        )
    batch = run.data.batch_size
    processes = nodes * processes_per_node
    if batch is not None and (batch % devices or batch % processes):
        raise UsageError(
            f"{config_path}: batch size {batch} is not divisible by the {devices} devices and "
            f"{processes} processes"
        )
    document = run.model_dump(mode="json", exclude_unset=True)
    header = f"# {config_path}, as `tokenmill launch` froze it into the job (model inlined).\n"
    run_yaml = header + yaml.safe_dump(document, sort_keys=False)
    job_name = dns_label(name or Path(run.output).name or Path(config_path).stem)
    return Launch(
        job_name, config_path, run_yaml, run.output, nodes, processes_per_node, devices_per_node, port,
        tuple(train_args),
    )  # fmt: skip


def jobset_manifest(
    launch: Launch,
    image: str,
    volumes: Sequence[tuple[str, str]] = (),
    namespace: str | None = None,
    device_resource: str = "nvidia.com/gpu",
    workdir: str = "/opt/tokenmill",
    node_selector: Mapping[str, str] | None = None,
    max_restarts: int = 3,
) -> list[dict[str, Any]]:
    """The Kubernetes objects of a launch: a ConfigMap with the run configuration and a JobSet of one
    replicated job ("workers") whose Indexed Job runs one pod per process.

    Each pod learns its place through JAX_COORDINATOR_ADDRESS (pod 0 of job 0, by the JobSet's headless
    service: NAME-workers-0-0.NAME), JAX_NUM_PROCESSES (the job's parallelism) and JAX_PROCESS_ID (its
    completion index, from the downward API). A failed pod fails the job, and JobSet recreates every pod
    (up to `max_restarts`): the run resumes from its latest checkpoint, which therefore must be on one of
    `volumes` (PersistentVolumeClaim name, mount path), shared by all pods. A pod that exits REQUEUE_EXIT
    (75: preempted, checkpointed) or is disrupted (its node drained or preempted) fails the job through
    the pod failure policy, and the JobSet restarts on that without counting it against `max_restarts`;
    the pods get the run's preemption deadline and a minute more between SIGTERM and SIGKILL."""
    _check_pod_values(image, volumes, namespace, device_resource, workdir, node_selector)
    name = launch.name
    config_map = f"{name}-run-config"
    metadata: dict[str, Any] = {"name": name, "labels": {"app.kubernetes.io/name": "tokenmill"}}
    if namespace:
        metadata["namespace"] = namespace
    mounts = [{"name": "run-config", "mountPath": CONFIG_MOUNT, "readOnly": True}]
    pod_volumes: list[dict[str, Any]] = [{"name": "run-config", "configMap": {"name": config_map}}]
    for index, (claim, mount) in enumerate(volumes):
        mounts.append({"name": f"volume-{index}", "mountPath": mount})
        pod_volumes.append({"name": f"volume-{index}", "persistentVolumeClaim": {"claimName": claim}})
    container: dict[str, Any] = {
        "name": "train",
        "image": image,
        "workingDir": workdir,
        "command": launch.train_command(f"{CONFIG_MOUNT}/run.yaml"),
        "env": [
            {"name": "JAX_COORDINATOR_ADDRESS", "value": f"{name}-{REPLICATED_JOB}-0-0.{name}:{launch.port}"},
            {"name": "JAX_NUM_PROCESSES", "value": str(launch.processes)},
            {
                "name": "JAX_PROCESS_ID",
                "valueFrom": {
                    "fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']"}
                },
            },
        ],
        "ports": [{"name": "coordinator", "containerPort": launch.port}],
        "volumeMounts": mounts,
    }
    if device_resource:
        count = str(launch.devices_per_process)
        container["resources"] = {"limits": {device_resource: count}, "requests": {device_resource: count}}
    pod_spec: dict[str, Any] = {"restartPolicy": "Never", "containers": [container], "volumes": pod_volumes}
    # SIGTERM, then this long to checkpoint before SIGKILL: the run's own deadline and a minute for the rest.
    pod_spec["terminationGracePeriodSeconds"] = int(_preemption_seconds(launch.run_yaml)) + 60
    if node_selector:
        pod_spec["nodeSelector"] = dict(node_selector)
    config_metadata = {key: value for key, value in metadata.items() if key != "name"}
    return [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": config_map, **config_metadata},
            "data": {"run.yaml": launch.run_yaml},
        },
        {
            "apiVersion": JOBSET_API,
            "kind": "JobSet",
            "metadata": metadata,
            "spec": {
                "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
                # A preempted run (exit 75, or a disrupted pod) restarts without using up a restart.
                "failurePolicy": {
                    "maxRestarts": max_restarts,
                    "rules": [
                        {
                            "action": "RestartJobSetAndIgnoreMaxRestarts",
                            "onJobFailureReasons": ["PodFailurePolicy"],
                        }
                    ],
                },
                "replicatedJobs": [
                    {
                        "name": REPLICATED_JOB,
                        "replicas": 1,
                        "template": {
                            "spec": {
                                "parallelism": launch.processes,
                                "completions": launch.processes,
                                "completionMode": "Indexed",
                                "backoffLimit": 0,
                                "podFailurePolicy": {
                                    "rules": [
                                        {
                                            "action": "FailJob",
                                            "onExitCodes": {
                                                "containerName": "train",
                                                "operator": "In",
                                                "values": [REQUEUE_EXIT],
                                            },
                                        },
                                        {
                                            "action": "FailJob",
                                            "onPodConditions": [{"type": "DisruptionTarget"}],
                                        },
                                    ]
                                },
                                "template": {"spec": pod_spec},
                            }
                        },
                    }
                ],
            },
        },
    ]


def _preemption_seconds(run_yaml: str) -> float:
    """The run's watchdog.preemption_seconds (its default when the configuration does not set it)."""
    from tokenmill.trainer.run.config import WatchdogConfig

    try:
        settings = yaml.safe_load(run_yaml) or {}
    except yaml.YAMLError:  # not a configuration train could read either; it will say so itself
        settings = {}
    given = (settings.get("watchdog") or {}) if isinstance(settings, dict) else {}
    default = WatchdogConfig().preemption_seconds
    value = given.get("preemption_seconds", default) if isinstance(given, dict) else default
    return float(value)


def jobset_yaml(objects: list[dict[str, Any]], launch: Launch) -> str:
    header = (
        f"# Written by `tokenmill launch jobset` from {launch.config_path}: {launch.nodes} nodes x "
        f"{launch.processes_per_node} process(es), {launch.devices_per_process} device(s) each.\n"
        "# kubectl apply -f THIS_FILE   (needs the JobSet controller: https://jobset.sigs.k8s.io)\n"
    )
    return header + yaml.dump_all(objects, Dumper=_BlockDumper, sort_keys=False, width=1000)


class _BlockDumper(yaml.SafeDumper):
    """yaml.safe_dump, with multi-line strings (the run configuration in the ConfigMap) as literal blocks."""


def _string(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_BlockDumper.add_representer(str, _string)


def _check_pod_values(
    image: str,
    volumes: Sequence[tuple[str, str]],
    namespace: str | None,
    device_resource: str,
    workdir: str,
    node_selector: Mapping[str, str] | None,
) -> None:
    """UsageError for a pod's value with a line break in it. The YAML dumper would quote it faithfully,
    but none of them is legitimately made of several lines, and the paths among them end up in shells."""
    one_line("--image", image)
    one_line("--device-resource", device_resource)
    one_line("--workdir", workdir)
    if namespace:
        one_line("--namespace", namespace)
    for claim, mount in volumes:
        one_line("--volume", f"{claim}:{mount}")
    for key, value in (node_selector or {}).items():
        one_line("--node-selector", f"{key}={value}")


def slurm_script(
    launch: Launch,
    partition: str | None = None,
    account: str | None = None,
    time_limit: str | None = None,
    chdir: str | None = None,
    setup: str | None = None,
    cpus_per_task: int | None = None,
) -> str:
    """An sbatch script: `srun` starts one task per process, each
    `tokenmill train --config ... --mesh.distributed`
    finding its place from SLURM_PROCID, SLURM_NTASKS and the first node of the allocation. The run
    configuration is frozen into the script and written into the run folder (a shared filesystem, which
    multi-host checkpoints need anyway) before the tasks start. Values are quoted for the shell, or
    checked for #SBATCH lines (UsageError where they cannot be written there)."""
    quote = shlex.quote
    directives = (("partition", partition), ("account", account), ("time", time_limit))
    for flag, value in directives:
        if value:
            sbatch_value(f"--{flag}", value)
    if chdir:
        one_line("--chdir", chdir)
    lines = [
        "#!/bin/bash",
        f"# Written by `tokenmill launch slurm` from {launch.config_path}: {launch.nodes} nodes x "
        f"{launch.processes_per_node} process(es), {launch.devices_per_process} device(s) each.",
        "# sbatch THIS_FILE",
        f"#SBATCH --job-name={launch.name}",
        f"#SBATCH --nodes={launch.nodes}",
        f"#SBATCH --ntasks-per-node={launch.processes_per_node}",
    ]
    if launch.processes_per_node == 1:
        lines.append(f"#SBATCH --gpus-per-node={launch.devices_per_node}")
    else:
        # Each task gets (and sees, as its devices 0..k-1) only its own GPUs.
        lines.append(f"#SBATCH --gpus-per-task={launch.devices_per_process}")
    for flag, value in (*directives, ("cpus-per-task", cpus_per_task)):
        if value:
            lines.append(f"#SBATCH --{flag}={value}")
    lines += [
        "#SBATCH --exclusive",
        f"#SBATCH --output={launch.name}-%j.out",
        # Requeued after a preemption or a hang (below); SIGTERM to the tasks before the time limit, so that
        # a job that runs out of time checkpoints and is requeued too.
        "#SBATCH --requeue",
        f"#SBATCH --signal=TERM@{int(_preemption_seconds(launch.run_yaml)) + 60}",
        "",
        "set -euo pipefail",
        f"cd -- {quote(chdir)}" if chdir else 'cd "${SLURM_SUBMIT_DIR:-.}"',
    ]
    if setup:
        lines.append(setup)
    # The run folder is quoted as one word; only the job id after it expands.
    config = quote(f"{launch.output.rstrip('/')}/launch-") + '"${SLURM_JOB_ID}.yaml"'
    frozen = launch.run_yaml.rstrip("\n")
    # A quoted here-document ends at the first line that is its delimiter: pick one no line of it is.
    delimiter = "TOKENMILL_RUN_CONFIG"
    while delimiter in frozen.splitlines():
        delimiter += "_"
    train = [quote(word) for word in launch.train_command("")]
    train[train.index("--config") + 1] = '"$RUN_CONFIG"'  # the first --config is ours, before train_args
    lines += [
        "",
        "# The run configuration as launched: later edits of the file do not change this job.",
        f"mkdir -p -- {quote(launch.output)}",
        f"RUN_CONFIG={config}",
        f"cat > \"$RUN_CONFIG\" <<'{delimiter}'",
        frozen,
        delimiter,
        "",
        "# Process 0 listens here, on the first node of the allocation.",
        f"export JAX_COORDINATOR_PORT={launch.port}",
        f"# {REQUEUE_EXIT}: preempted and checkpointed; {HANG_EXIT}: no step in time (stacks in train.log). "
        "Either way the job goes back in",
        "# the queue and the rerun resumes from the latest checkpoint; any other failure ends the job.",
        "set +e",
        " ".join(["srun", "--kill-on-bad-exit=1", *train]),
        "status=$?",
        "set -e",
        f'if [ "$status" -eq {REQUEUE_EXIT} ] || [ "$status" -eq {HANG_EXIT} ]; then',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'exit "$status"',
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# `tokenmill launch --swarm`: a mixture search's proxies as one job array.

WORKER_MODULE = "tokenmill.swarm.worker"
SWARM_LOGS = "logs"  # SLURM array tasks' output, under the swarm's folder
SWARM_CONTAINER = "proxy"


@dataclass(frozen=True)
class SwarmLaunch:
    """A swarm's proxies as one job array: task i trains `proxies[i]`."""

    name: str  # the job's name: a DNS label
    swarm: str  # the swarm's folder as given: where the tasks find it, from the directory they run in
    proxies: tuple[str, ...]  # the proxies' ids, in array order (swarm.json's `proxies`)
    parallel: int | None  # at most this many tasks at once (None: as many as the scheduler allows)
    devices_per_task: int  # 0: the proxies train on CPU
    cpus_per_task: int | None

    @property
    def tasks(self) -> int:
        return len(self.proxies)

    def task_commands(self, index_variable: str) -> list[str]:
        """The POSIX shell lines of one task: skip a finished proxy, else run the worker on this task's."""
        quote = shlex.quote
        lines = [f"SWARM={quote(self.swarm)}"]
        if not self.devices_per_task:
            lines.append('export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"  # no devices asked for: train on CPU')
        lines += [
            f': "${{{index_variable}:?is not set: this runs as a task of a job array}}"',
            # The worker skips a proxy that already finished with its run configuration as it is now.
            f'exec python -m {WORKER_MODULE} "$SWARM" --index env',
        ]
        return lines


def plan_swarm_launch(
    swarm: str,
    name: str | None = None,
    parallel: int | None = None,
    devices_per_task: int = 1,
    cpus_per_task: int | None = None,
) -> SwarmLaunch:
    """Read the swarm's manifest (SWARM/swarm.json) for a job array of one task per proxy; UsageError names
    what is missing or wrong."""
    one_line("--swarm", swarm)  # it heads the job as a comment
    manifest_path = storage.join(swarm, SWARM)
    if not storage.exists(manifest_path):
        raise UsageError(
            f"--swarm {swarm}: no {manifest_path} (a swarm's folder holds the swarm.json that "
            "`tokenmill mixture swarm` writes)"
        )
    try:
        manifest = read_swarm(manifest_path)
    except FormatError as error:
        raise UsageError(str(error)) from error
    if not manifest.proxies:
        raise UsageError(f"{manifest_path}: no proxies to run")
    if parallel is not None and parallel < 1:
        raise UsageError("--parallel: at least 1")
    if devices_per_task < 0 or (cpus_per_task is not None and cpus_per_task < 1):
        raise UsageError("--gpus-per-task must be 0 or more, --cpus-per-task 1 or more")
    return SwarmLaunch(
        dns_label(name or manifest.name or Path(swarm.rstrip("/")).name),
        swarm,
        tuple(proxy.id for proxy in manifest.proxies),
        parallel,
        devices_per_task,
        cpus_per_task,
    )


def swarm_slurm_script(
    launch: SwarmLaunch,
    partition: str | None = None,
    account: str | None = None,
    time_limit: str | None = None,
    chdir: str | None = None,
    setup: str | None = None,
) -> str:
    """An sbatch script of one array task per proxy (`--array=0-(N-1)%P`), each on one node with its own
    devices, running the worker from the submission directory (or `chdir`). Each task's output goes to
    SWARM/logs/JOBID_TASK.out; its first line names the proxy. The swarm's folder is in an #SBATCH line
    (the tasks' output), so it, like every #SBATCH value, must fit SBATCH_VALUE (UsageError otherwise)."""
    sbatch_value("--swarm", launch.swarm)
    directives = (("partition", partition), ("account", account), ("time", time_limit), ("chdir", chdir))
    for flag, value in directives:
        if value:
            sbatch_value(f"--{flag}", value)
    array = f"0-{launch.tasks - 1}" + (f"%{launch.parallel}" if launch.parallel else "")
    lines = [
        "#!/bin/bash",
        f"# Written by `tokenmill launch slurm --swarm {launch.swarm}`: {launch.tasks} proxies, one array "
        f"task each, {launch.devices_per_task} GPU(s) per task.",
        "# sbatch THIS_FILE   (from the directory the swarm was made in: its run configurations' paths are "
        "relative to it)",
        f"#SBATCH --job-name={launch.name}",
        f"#SBATCH --array={array}",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks=1",
    ]
    if launch.devices_per_task:
        # One task on one node: the batch step itself holds (and sees) the node's GPUs, no srun needed.
        lines.append(f"#SBATCH --gpus-per-node={launch.devices_per_task}")
    for flag, value in (("cpus-per-task", launch.cpus_per_task), *directives):
        if value:
            lines.append(f"#SBATCH --{flag}={value}")
    lines += [
        f"#SBATCH --output={storage.join(launch.swarm, SWARM_LOGS)}/%A_%a.out",
        "",
        "set -euo pipefail",
        f"cd -- {shlex.quote(chdir)}" if chdir else 'cd "${SLURM_SUBMIT_DIR:-.}"',
    ]
    if setup:
        lines.append(setup)
    lines += [
        "",
        "# Task i trains swarm.json's proxy i, unless its result.json says it finished with its run.yaml as",
        "# it is now: resubmitting the array reruns only the unfinished (a killed proxy resumes from its",
        "# checkpoints).",
        *launch.task_commands("SLURM_ARRAY_TASK_ID"),
        "",
    ]
    return "\n".join(lines)


def swarm_job_manifest(
    launch: SwarmLaunch,
    image: str,
    volumes: Sequence[tuple[str, str]] = (),
    namespace: str | None = None,
    device_resource: str = "nvidia.com/gpu",
    workdir: str = "/opt/tokenmill",
    node_selector: Mapping[str, str] | None = None,
    max_restarts: int = 3,
) -> dict[str, Any]:
    """A batch/v1 Indexed Job of one pod per proxy (`completions` = proxies, `parallelism` = --parallel):
    Kubernetes sets JOB_COMPLETION_INDEX in each pod, and the worker trains that proxy. The swarm's folder
    is on one of `volumes` (PersistentVolumeClaim name, mount path), shared by all pods. A failed pod is
    retried on its own index, up to `max_restarts` times (`backoffLimitPerIndex`, Kubernetes 1.29+); a pod
    evicted or preempted (condition DisruptionTarget) is retried without counting."""
    _check_pod_values(image, volumes, namespace, device_resource, workdir, node_selector)
    metadata: dict[str, Any] = {"name": launch.name, "labels": {"app.kubernetes.io/name": "tokenmill"}}
    if namespace:
        metadata["namespace"] = namespace
    mounts, pod_volumes = [], []
    for index, (claim, mount) in enumerate(volumes):
        mounts.append({"name": f"volume-{index}", "mountPath": mount})
        pod_volumes.append({"name": f"volume-{index}", "persistentVolumeClaim": {"claimName": claim}})
    container: dict[str, Any] = {
        "name": SWARM_CONTAINER,
        "image": image,
        "workingDir": workdir,
        "command": ["sh", "-c", "\n".join(["set -eu", *launch.task_commands("JOB_COMPLETION_INDEX")])],
        "volumeMounts": mounts,
    }
    resources: dict[str, str] = {}
    if launch.devices_per_task and device_resource:
        resources[device_resource] = str(launch.devices_per_task)
    if launch.cpus_per_task:
        resources["cpu"] = str(launch.cpus_per_task)
    if resources:
        container["resources"] = {"limits": dict(resources), "requests": dict(resources)}
    pod_spec: dict[str, Any] = {"restartPolicy": "Never", "containers": [container], "volumes": pod_volumes}
    if node_selector:
        pod_spec["nodeSelector"] = dict(node_selector)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": metadata,
        "spec": {
            "completionMode": "Indexed",
            "completions": launch.tasks,
            "parallelism": launch.parallel or launch.tasks,
            "backoffLimitPerIndex": max_restarts,
            "podFailurePolicy": {
                "rules": [{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}]
            },
            "template": {"metadata": {"labels": dict(metadata["labels"])}, "spec": pod_spec},
        },
    }


def swarm_job_yaml(job: dict[str, Any], launch: SwarmLaunch) -> str:
    header = (
        f"# Written by `tokenmill launch jobset --swarm {launch.swarm}`: {launch.tasks} proxies, one pod "
        "each (a batch/v1 Indexed Job).\n"
        "# kubectl apply -f THIS_FILE   (Kubernetes 1.29+ for backoffLimitPerIndex; no JobSet controller)\n"
    )
    return header + yaml.dump(job, Dumper=_BlockDumper, sort_keys=False, width=1000)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `tokenmill launch` to the `tokenmill` parser."""
    parser = subparsers.add_parser(
        "launch",
        help="write the job that trains a run configuration on several machines, or a swarm as a job array "
        "(JobSet, SLURM)",
        description="Write a multi-host training job for an existing scheduler from one run configuration "
        "(configs/runs/*.yaml): a Kubernetes JobSet manifest or a SLURM batch script. Every process runs "
        "`tokenmill train --config FILE --mesh.distributed` and finds the coordinator, the process count "
        "and its "
        "id in the variables the job sets. The mesh and batch are checked against the devices first. "
        "Flags after `--` go to every `tokenmill train`. With --swarm DIR instead of --config: a mixture "
        "search's proxies as one job array (a SLURM array, a Kubernetes Indexed Job), one task per proxy. "
        "See docs/operations.md.",
    )
    kinds = parser.add_subparsers(dest="scheduler", metavar="SCHEDULER")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--config", metavar="FILE", help="the run configuration (one run on --nodes machines)"
    )
    common.add_argument(
        "--swarm", metavar="DIR", help="instead of --config: a swarm's folder (swarm.json, from `tokenmill "
        "mixture swarm`), written as one job array of one task per proxy",
    )  # fmt: skip
    common.add_argument("--nodes", type=int, help="machines (with --config, which needs it)")
    common.add_argument(
        "--devices-per-node", type=int, help=f"accelerators per machine (default {DEFAULT_DEVICES_PER_NODE})"
    )
    common.add_argument(
        "--processes-per-node", type=int, help="processes per machine, each with its share of the "
        "devices (default 1: one process drives every device of its machine)",
    )  # fmt: skip
    common.add_argument("--name", help="the job's name (default: the run folder's name, or the swarm's)")
    common.add_argument(
        "--port", type=int, help=f"the coordinator's port (default {DEFAULT_COORDINATOR_PORT})"
    )
    common.add_argument(
        "--parallel",
        type=int,
        metavar="P",
        help="with --swarm: at most P proxies at once (default: no limit)",
    )
    common.add_argument(
        "--gpus-per-task",
        type=int,
        metavar="G",
        help="with --swarm: devices per proxy (default 1; 0: CPU only)",
    )
    common.add_argument(
        "--cpus-per-task", type=int, metavar="C", help="CPUs per task (SLURM) or per proxy's pod (--swarm)"
    )
    common.add_argument("--output", "-o", metavar="FILE", help="write here instead of to stdout")
    common.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then more `tokenmill train` flags")

    jobset = kinds.add_parser(
        "jobset",
        parents=[common],
        help="a Kubernetes JobSet (jobset.x-k8s.io/v1alpha2) and its ConfigMap; with --swarm, an Indexed Job",
    )
    jobset.add_argument("--image", required=True, help="a container image with tokenmill installed")
    jobset.add_argument(
        "--volume", action="append", default=[], metavar="CLAIM:MOUNT",
        help="mount a PersistentVolumeClaim in every pod; the run folder (or the swarm) must be on one "
        "(repeatable)",
    )  # fmt: skip
    jobset.add_argument("--namespace", help="the namespace (default: kubectl's)")
    jobset.add_argument(
        "--device-resource", default="nvidia.com/gpu", help="the devices' resource name (google.com/tpu, ...)"
    )
    jobset.add_argument("--workdir", default="/opt/tokenmill", help="where relative paths of the run resolve")
    jobset.add_argument("--node-selector", action="append", default=[], metavar="KEY=VALUE")
    jobset.add_argument(
        "--max-restarts", type=int, default=3,
        help="JobSet restarts after a failure; with --swarm, retries of each proxy's pod (default 3)",
    )  # fmt: skip
    jobset.set_defaults(handler=_launch_jobset)

    slurm = kinds.add_parser(
        "slurm", parents=[common], help="a SLURM batch script (sbatch); with --swarm, an array"
    )
    slurm.add_argument("--partition")
    slurm.add_argument("--account")
    slurm.add_argument(
        "--time", dest="time_limit", metavar="D-HH:MM:SS", help="the job's (with --swarm: each task's)"
    )
    slurm.add_argument("--chdir", help="run from here (default: where sbatch was called)")
    slurm.add_argument(
        "--setup", help="a shell line run first on the batch host, e.g. 'source .venv/bin/activate'"
    )
    slurm.set_defaults(handler=_launch_slurm)
    parser.set_defaults(handler=lambda args: parser.print_help() or 2)


#: Flags of one form only, as (attribute, flag): given with the other form, they are refused, not ignored.
RUN_ONLY = (
    ("nodes", "--nodes"),
    ("devices_per_node", "--devices-per-node"),
    ("processes_per_node", "--processes-per-node"),
    ("port", "--port"),
    ("train_args", "-- FLAGS"),
)
SWARM_ONLY = (("parallel", "--parallel"), ("gpus_per_task", "--gpus-per-task"))


def _is_swarm(args: argparse.Namespace) -> bool:
    """Which form the command line asks for: --swarm (a job array) or --config (one multi-host run)."""
    if (args.config is None) == (args.swarm is None):
        raise UsageError(
            "give --config FILE (one run on several machines) or --swarm DIR (a swarm's proxies as one job "
            "array)" + (", not both" if args.config else "")
        )
    wrong = SWARM_ONLY if args.config else RUN_ONLY
    given = [flag for attribute, flag in wrong if getattr(args, attribute) not in (None, [])]
    if given:
        form = "--swarm" if args.config else "--config"
        raise UsageError(f"{', '.join(given)}: only with {form}")
    if args.config and args.nodes is None:
        raise UsageError("--config needs --nodes: the machines the run takes")
    return args.swarm is not None


def _launch_of(args: argparse.Namespace) -> Launch:
    extra = list(args.train_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    return plan_launch(
        args.config,
        args.nodes,
        DEFAULT_DEVICES_PER_NODE if args.devices_per_node is None else args.devices_per_node,
        DEFAULT_PROCESSES_PER_NODE if args.processes_per_node is None else args.processes_per_node,
        args.name,
        DEFAULT_COORDINATOR_PORT if args.port is None else args.port,
        tuple(extra),
    )


def _swarm_launch_of(args: argparse.Namespace) -> SwarmLaunch:
    devices = 1 if args.gpus_per_task is None else args.gpus_per_task
    return plan_swarm_launch(args.swarm, args.name, args.parallel, devices, args.cpus_per_task)


def _emit(text: str, output: str | None, what: str) -> None:
    if output:
        storage.write_bytes(output, text.encode())
        print(f"{output}: {what}", file=sys.stderr)
    else:
        sys.stdout.write(text)


def _volumes(args: argparse.Namespace) -> list[tuple[str, str]]:
    volumes = []
    for item in args.volume:
        claim, _, mount = item.partition(":")
        if not claim or not mount.startswith("/"):
            raise UsageError(f"--volume {item!r}: expected CLAIM:/MOUNT/PATH")
        volumes.append((claim, mount.rstrip("/") or "/"))
    return volumes


def _on_a_volume(path: str, workdir: str, volumes: Sequence[tuple[str, str]], what: str, why: str) -> str:
    """`path` as the pods see it (relative paths resolve in `workdir`); UsageError when no volume holds it,
    saying `what` it is and `why` every pod needs it."""
    inside = path if path.startswith("/") else f"{workdir.rstrip('/')}/{path}"
    inside = inside.rstrip("/") or "/"
    if not any(inside == mount or inside.startswith(mount.rstrip("/") + "/") for _, mount in volumes):
        raise UsageError(
            f"{what} {inside} is on no --volume: {why}, so it must be a volume all pods share "
            "(--volume CLAIM:MOUNT)"
        )
    return inside


def _node_selector(args: argparse.Namespace) -> dict[str, str]:
    selector = {}
    for item in args.node_selector:
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"--node-selector {item!r}: expected KEY=VALUE")
        selector[key] = value
    return selector


def _check_pod_args(args: argparse.Namespace, volumes: Sequence[tuple[str, str]]) -> None:
    """The pod's values from the command line, refused before anything is resolved against them (a
    --workdir of several lines would otherwise be reported as a run folder on no volume)."""
    _check_pod_values(
        args.image, volumes, args.namespace, args.device_resource, args.workdir, _node_selector(args)
    )


def _launch_jobset(args: argparse.Namespace) -> int:
    if _is_swarm(args):
        return _launch_swarm_job(args)
    if args.cpus_per_task:
        raise UsageError(
            "--cpus-per-task: for a JobSet, only with --swarm (a multi-host pod takes its machine)"
        )
    launch = _launch_of(args)
    volumes = _volumes(args)
    _check_pod_args(args, volumes)
    _on_a_volume(
        launch.output,
        args.workdir,
        volumes,
        "the run folder",
        "every pod writes the run's checkpoints there and a restarted job resumes from them",
    )
    objects = jobset_manifest(
        launch,
        args.image,
        volumes,
        args.namespace,
        args.device_resource,
        args.workdir,
        _node_selector(args),
        args.max_restarts,
    )
    _emit(jobset_yaml(objects, launch), args.output, f"JobSet {launch.name}, {launch.processes} processes")
    return 0


def _launch_swarm_job(args: argparse.Namespace) -> int:
    launch = _swarm_launch_of(args)
    volumes = _volumes(args)
    _check_pod_args(args, volumes)
    _on_a_volume(
        launch.swarm,
        args.workdir,
        volumes,
        "the swarm",
        "every pod reads swarm.json there and trains its proxy into it (run folder, result.json)",
    )
    job = swarm_job_manifest(
        launch,
        args.image,
        volumes,
        args.namespace,
        args.device_resource,
        args.workdir,
        _node_selector(args),
        args.max_restarts,
    )
    _emit(swarm_job_yaml(job, launch), args.output, f"Indexed Job {launch.name}, {launch.tasks} proxies")
    return 0


def _launch_slurm(args: argparse.Namespace) -> int:
    if _is_swarm(args):
        launch = _swarm_launch_of(args)
        script = swarm_slurm_script(
            launch, args.partition, args.account, args.time_limit, args.chdir, args.setup
        )
        # sbatch opens each task's output file before the task starts, and fails the task if its folder is
        # missing: make it now.
        storage.make_dirs(storage.join(launch.swarm, SWARM_LOGS))
        _emit(script, args.output, f"SLURM array {launch.name}, {launch.tasks} proxies")
        return 0
    launch = _launch_of(args)
    script = slurm_script(
        launch, args.partition, args.account, args.time_limit, args.chdir, args.setup, args.cpus_per_task
    )
    _emit(
        script, args.output, f"SLURM batch script, {launch.nodes} nodes x {launch.processes_per_node} tasks"
    )
    return 0
