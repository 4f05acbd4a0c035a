"""Where this process stands in a multi-host job, and joining it: `process_group` finds the coordinator's
address, the number of processes and this process's id; `maybe_initialize_distributed` passes them to
jax.distributed.initialize explicitly.

Each fact comes from the first of: the command line (`--coordinator HOST[:PORT]`, `--num-processes N`,
`--process-id I`); JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID; SLURM inside `srun`
(SLURM_STEP_NODELIST's first host, SLURM_NTASKS, SLURM_PROCID); a Kubernetes Indexed Job's
JOB_COMPLETION_INDEX. jax 0.10 reads only the first variable itself, and under SLURM would pin every process
to one local device, so tokenmill passes all three (docs/trainer.md, "Several hosts").
"""

from __future__ import annotations

import logging
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_COORDINATOR_PORT = 8476


class DistributedSetupError(ValueError):
    """The coordinator, process count or process id cannot be worked out; the message says what to set."""


@dataclass(frozen=True)
class ProcessGroup:
    """Where this process stands in a multi-host job, and where each fact came from (for the log)."""

    coordinator: str
    num_processes: int
    process_id: int
    sources: tuple[str, str, str]

    def describe(self) -> str:
        return (
            f"process {self.process_id} of {self.num_processes}, coordinator {self.coordinator} "
            f"(from {', '.join(dict.fromkeys(self.sources))})"
        )


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: 'gpu[003-007,010],cpu1' -> 'gpu003'; 'r[1-2]-n[08-09]' ->
    'r1-n08' (each bracket gives its first value, zero padding kept)."""
    host, i = [], 0
    while i < len(nodelist) and nodelist[i] != ",":
        if nodelist[i] == "[":
            end = nodelist.find("]", i)
            if end < 0:
                raise DistributedSetupError(f"SLURM node list {nodelist!r}: unclosed '['")
            host.append(re.split(r"[,-]", nodelist[i + 1 : end], maxsplit=1)[0])
            i = end + 1
        else:
            host.append(nodelist[i])
            i += 1
    if not host:
        raise DistributedSetupError(f"SLURM node list {nodelist!r} names no host")
    return "".join(host)


def _with_port(address: str, environ: Mapping[str, str], default_port: int) -> str:
    if re.search(r":\d+$", address) and not address.endswith("]"):
        return address
    return f"{address}:{environ.get('JAX_COORDINATOR_PORT') or default_port}"


def _integer(value: str | int, name: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise DistributedSetupError(f"{name}={value!r} is not an integer") from None


def _slurm_step(environ: Mapping[str, str]) -> bool:
    """Inside an `srun` step of several tasks (one task, as in an interactive `srun --pty`, is no job of
    several processes): SLURM gives every task its rank and the step's size."""
    tasks = environ.get("SLURM_NTASKS", "")
    return "SLURM_PROCID" in environ and tasks.isdigit() and int(tasks) > 1


def port_is_free(port: int) -> bool:
    """Whether a listener could bind `port` on every address, as the coordinator does ([::]:PORT, else
    0.0.0.0 where the host has no IPv6); with SO_REUSEADDR, as gRPC binds, so that connections of an
    earlier run still in TIME_WAIT do not count."""
    for family, address in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 here
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((address, port))
            except OSError:
                return False
            return True
    return True


def process_group(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> ProcessGroup | None:
    """The coordinator, process count and id from the flags, else the variables the scheduler set (see the
    module docstring for the order). None when nothing at all points at a multi-host job; a
    DistributedSetupError naming what is missing when only some of the three are known."""
    env = os.environ if environ is None else environ
    found: dict[str, tuple[Any, str]] = {}
    if coordinator:
        found["coordinator"] = (_with_port(coordinator, env, DEFAULT_COORDINATOR_PORT), "--coordinator")
    if num_processes is not None:
        found["num_processes"] = (num_processes, "--num-processes")
    if process_id is not None:
        found["process_id"] = (process_id, "--process-id")

    def offer(key: str, value: Any, source: str) -> None:
        if key not in found and value not in (None, ""):
            found[key] = (value, source)

    offer("coordinator", env.get("JAX_COORDINATOR_ADDRESS"), "JAX_COORDINATOR_ADDRESS")
    offer("num_processes", env.get("JAX_NUM_PROCESSES"), "JAX_NUM_PROCESSES")
    offer("process_id", env.get("JAX_PROCESS_ID"), "JAX_PROCESS_ID")
    if _slurm_step(env):
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if nodelist and "coordinator" not in found:
            job = env.get("SLURM_JOB_ID", "")
            # JAX's own choice: a port in the top 4,096 of the range, from the job id.
            port = int(job) % 4096 + 61440 if job.isdigit() else DEFAULT_COORDINATOR_PORT
            offer("coordinator", _with_port(first_slurm_host(nodelist), env, port), "SLURM node list")
        offer("num_processes", env.get("SLURM_NTASKS"), "SLURM_NTASKS")
        offer("process_id", env.get("SLURM_PROCID"), "SLURM_PROCID")
    offer("process_id", env.get("JOB_COMPLETION_INDEX"), "JOB_COMPLETION_INDEX")

    if not found or set(found) == {"process_id"} and found["process_id"][1] == "JOB_COMPLETION_INDEX":
        return None  # a lone Indexed Job's index says nothing about other processes
    missing = [key for key in ("coordinator", "num_processes", "process_id") if key not in found]
    if missing:
        hints = {
            "coordinator": "--coordinator HOST:PORT (or JAX_COORDINATOR_ADDRESS)",
            "num_processes": "--num-processes N (or JAX_NUM_PROCESSES)",
            "process_id": "--process-id I (or JAX_PROCESS_ID)",
        }
        known = ", ".join(f"{key} from {source}" for key, (_, source) in found.items())
        raise DistributedSetupError(
            f"a multi-host run needs the coordinator, the process count and this process's id; {known} "
            f"but not the rest: give {' and '.join(hints[key] for key in missing)}, or run under srun or "
            "the JobSet `tokenmill launch` writes"
        )
    count = _integer(found["num_processes"][0], found["num_processes"][1])
    index = _integer(found["process_id"][0], found["process_id"][1])
    if count < 1 or not 0 <= index < count:
        raise DistributedSetupError(
            f"process id {index} ({found['process_id'][1]}) is not in 0..{count - 1} "
            f"({count} processes, from {found['num_processes'][1]})"
        )
    return ProcessGroup(
        str(found["coordinator"][0]),
        count,
        index,
        (found["coordinator"][1], found["num_processes"][1], found["process_id"][1]),
    )


def maybe_initialize_distributed(
    force: bool = False,
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> ProcessGroup | None:
    """Join a multi-host job: jax.distributed.initialize with the coordinator, process count and process id
    given explicitly, from the flags or the variables the scheduler sets (commands/launch.py: `--coordinator`,
    `--num-processes`, `--process-id`; JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID;
    SLURM's srun; a JobSet's completion index). jax 0.10 reads only JAX_COORDINATOR_ADDRESS itself, so the
    other two must be passed. Without `force` (--mesh.distributed) it runs only when one of them is there;
    with
    it and none of them, JAX's own detection (Cloud TPU, Open MPI) decides. Returns the process group
    joined, or None (one process, or JAX's detection)."""
    import jax  # here: `tokenmill launch` reads this module's defaults without starting JAX

    group = process_group(coordinator, num_processes, process_id)
    if group is None and not force:
        return None
    # CPU processes need a cross-process collective implementation (simulated multi-host tests, CPU-only
    # clusters); jax 0.10 defaults to gloo, and a choice made in the environment is kept.
    if jax.config.jax_cpu_collectives_implementation is None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if group is None:
        try:
            jax.distributed.initialize()
        except ValueError as error:
            raise DistributedSetupError(
                f"--mesh.distributed: JAX found no cluster to join ({error}); give --coordinator HOST:PORT, "
                "--num-processes N and --process-id I (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, "
                "JAX_PROCESS_ID), or run under srun or the JobSet `tokenmill launch` writes"
            ) from error
        log.info("process %d of %d (JAX's cluster detection)", jax.process_index(), jax.process_count())
        return None
    log.info("joining the job as %s", group.describe())
    port = int(group.coordinator.rsplit(":", 1)[-1])
    if group.process_id == 0 and not port_is_free(port):
        # Checked first: jaxlib (0.10) can crash outright when the coordinator's port is taken.
        raise DistributedSetupError(
            f"cannot serve the job's coordinator on port {port} of this host (process 0): it is taken; "
            "choose another in --coordinator HOST:PORT (or JAX_COORDINATOR_ADDRESS / JAX_COORDINATOR_PORT) "
            "on every host"
        )
    # 'deactivate': the three are known; JAX's SLURM detection would otherwise pin each process to one
    # local device (JAX_LOCAL_DEVICE_IDS still picks devices where a launcher sets it).
    try:
        jax.distributed.initialize(
            coordinator_address=group.coordinator,
            num_processes=group.num_processes,
            process_id=group.process_id,
            cluster_detection_method="deactivate",
        )
    except jax.errors.JaxRuntimeError as error:
        # Process 0 serves the coordinator: the usual failure is its port taken on this host.
        hint = (
            f"; is port {port} taken on this host? Choose another in --coordinator HOST:PORT (or "
            "JAX_COORDINATOR_ADDRESS / JAX_COORDINATOR_PORT) on every host"
            if group.process_id == 0
            else f"; is process 0 up and {group.coordinator} reachable from this host?"
        )
        raise DistributedSetupError(f"cannot join the job as {group.describe()}: {error}{hint}") from error
    return group
