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
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tokenmill import storage
from tokenmill.errors import UsageError
from tokenmill.trainer.run.distributed import DEFAULT_COORDINATOR_PORT

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
REPLICATED_JOB = "workers"
CONFIG_MOUNT = "/etc/tokenmill"
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"


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
    `volumes` (PersistentVolumeClaim name, mount path), shared by all pods."""
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
                "failurePolicy": {"maxRestarts": max_restarts},
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
                                "template": {"spec": pod_spec},
                            }
                        },
                    }
                ],
            },
        },
    ]


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
    multi-host checkpoints need anyway) before the tasks start."""
    quote = shlex.quote
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
    for flag, value in (("partition", partition), ("account", account), ("time", time_limit),
                        ("cpus-per-task", cpus_per_task)):  # fmt: skip
        if value:
            lines.append(f"#SBATCH --{flag}={value}")
    lines += [
        "#SBATCH --exclusive",
        f"#SBATCH --output={launch.name}-%j.out",
        "",
        "set -euo pipefail",
        f"cd {quote(chdir)}" if chdir else 'cd "${SLURM_SUBMIT_DIR:-.}"',
    ]
    if setup:
        lines.append(setup)
    config = f"{launch.output.rstrip('/')}/launch-${{SLURM_JOB_ID}}.yaml"
    lines += [
        "",
        "# The run configuration as launched: later edits of the file do not change this job.",
        f"mkdir -p {quote(launch.output)}",
        f'RUN_CONFIG="{config}"',
        "cat > \"$RUN_CONFIG\" <<'TOKENMILL_RUN_CONFIG'",
        launch.run_yaml.rstrip("\n"),
        "TOKENMILL_RUN_CONFIG",
        "",
        "# Process 0 listens here, on the first node of the allocation.",
        f"export JAX_COORDINATOR_PORT={launch.port}",
        " ".join(
            ["srun", "--kill-on-bad-exit=1", *map(quote, launch.train_command("RUN_CONFIG_PLACEHOLDER"))]
        ).replace("RUN_CONFIG_PLACEHOLDER", '"$RUN_CONFIG"'),
        "",
    ]
    return "\n".join(lines)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `tokenmill launch` to the `tokenmill` parser."""
    parser = subparsers.add_parser(
        "launch",
        help="write the job that trains a run configuration on several machines (JobSet, SLURM)",
        description="Write a multi-host training job for an existing scheduler from one run configuration "
        "(configs/runs/*.yaml): a Kubernetes JobSet manifest or a SLURM batch script. Every process runs "
        "`tokenmill train --config FILE --mesh.distributed` and finds the coordinator, the process count "
        "and its "
        "id in the variables the job sets. The mesh and batch are checked against the devices first. "
        "Flags after `--` go to every `tokenmill train`. See docs/operations.md.",
    )
    kinds = parser.add_subparsers(dest="scheduler", metavar="SCHEDULER")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", required=True, metavar="FILE", help="the run configuration")
    common.add_argument("--nodes", type=int, required=True, help="machines")
    common.add_argument(
        "--devices-per-node", type=int, default=8, help="accelerators per machine (default 8)"
    )
    common.add_argument(
        "--processes-per-node", type=int, default=1, help="processes per machine, each with its share of the "
        "devices (default 1: one process drives every device of its machine)",
    )  # fmt: skip
    common.add_argument("--name", help="the job's name (default: the run folder's name)")
    common.add_argument(
        "--port",
        type=int,
        default=DEFAULT_COORDINATOR_PORT,
        help="the coordinator's port (default %(default)s)",
    )
    common.add_argument("--output", "-o", metavar="FILE", help="write here instead of to stdout")
    common.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then more `tokenmill train` flags")

    jobset = kinds.add_parser(
        "jobset", parents=[common], help="a Kubernetes JobSet (jobset.x-k8s.io/v1alpha2) and its ConfigMap"
    )
    jobset.add_argument("--image", required=True, help="a container image with tokenmill installed")
    jobset.add_argument(
        "--volume", action="append", default=[], metavar="CLAIM:MOUNT",
        help="mount a PersistentVolumeClaim in every pod; the run folder must be on one (repeatable)",
    )  # fmt: skip
    jobset.add_argument("--namespace", help="the namespace (default: kubectl's)")
    jobset.add_argument(
        "--device-resource", default="nvidia.com/gpu", help="the devices' resource name (google.com/tpu, ...)"
    )
    jobset.add_argument("--workdir", default="/opt/tokenmill", help="where relative paths of the run resolve")
    jobset.add_argument("--node-selector", action="append", default=[], metavar="KEY=VALUE")
    jobset.add_argument("--max-restarts", type=int, default=3, help="JobSet restarts after a failure")
    jobset.set_defaults(handler=_launch_jobset)

    slurm = kinds.add_parser("slurm", parents=[common], help="a SLURM batch script (sbatch)")
    slurm.add_argument("--partition")
    slurm.add_argument("--account")
    slurm.add_argument("--time", dest="time_limit", metavar="D-HH:MM:SS")
    slurm.add_argument("--cpus-per-task", type=int)
    slurm.add_argument("--chdir", help="run from here (default: where sbatch was called)")
    slurm.add_argument(
        "--setup", help="a shell line run first on the batch host, e.g. 'source .venv/bin/activate'"
    )
    slurm.set_defaults(handler=_launch_slurm)
    parser.set_defaults(handler=lambda args: parser.print_help() or 2)


def _launch_of(args: argparse.Namespace) -> Launch:
    extra = list(args.train_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    return plan_launch(
        args.config,
        args.nodes,
        args.devices_per_node,
        args.processes_per_node,
        args.name,
        args.port,
        tuple(extra),
    )


def _emit(text: str, output: str | None, what: str) -> None:
    if output:
        storage.write_bytes(output, text.encode())
        print(f"{output}: {what}", file=sys.stderr)
    else:
        sys.stdout.write(text)


def _launch_jobset(args: argparse.Namespace) -> int:
    launch = _launch_of(args)
    volumes = []
    for item in args.volume:
        claim, _, mount = item.partition(":")
        if not claim or not mount.startswith("/"):
            raise UsageError(f"--volume {item!r}: expected CLAIM:/MOUNT/PATH")
        volumes.append((claim, mount.rstrip("/") or "/"))
    output = launch.output if launch.output.startswith("/") else f"{args.workdir.rstrip('/')}/{launch.output}"
    if not any(output == mount or output.startswith(mount.rstrip("/") + "/") for _, mount in volumes):
        raise UsageError(
            f"the run folder {output} is on no --volume: every pod writes the run's checkpoints there and a "
            "restarted job resumes from them, so it must be a volume all pods share (--volume CLAIM:MOUNT)"
        )
    selector = {}
    for item in args.node_selector:
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"--node-selector {item!r}: expected KEY=VALUE")
        selector[key] = value
    objects = jobset_manifest(
        launch,
        args.image,
        volumes,
        args.namespace,
        args.device_resource,
        args.workdir,
        selector,
        args.max_restarts,
    )
    _emit(jobset_yaml(objects, launch), args.output, f"JobSet {launch.name}, {launch.processes} processes")
    return 0


def _launch_slurm(args: argparse.Namespace) -> int:
    launch = _launch_of(args)
    script = slurm_script(
        launch, args.partition, args.account, args.time_limit, args.chdir, args.setup, args.cpus_per_task
    )
    _emit(
        script, args.output, f"SLURM batch script, {launch.nodes} nodes x {launch.processes_per_node} tasks"
    )
    return 0
