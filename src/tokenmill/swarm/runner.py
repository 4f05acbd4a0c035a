"""Running a swarm on this machine: a pool of worker processes, each pinned to its share of the cores (and
of the GPUs, when given), one proxy at a time each, resumable.

A proxy is finished when its result.json says so for the run configuration it has now; rerunning the command
runs only the others (a killed proxy resumes from its checkpoints; a failed one is tried again). Each
worker's output goes to proxy-NNN/worker.log. Progress: one line per proxy that ends, with an ETA from the
mean time of the proxies finished so far.

Memory: one proxy's model and data per worker; the runner itself holds the job list only.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tokenmill import storage
from tokenmill.errors import FormatError, UsageError
from tokenmill.formats.swarm import RESULT, ProxyResult, SwarmProxy, read_result
from tokenmill.swarm.build import sha256_text
from tokenmill.units import format_duration

log = logging.getLogger(__name__)
POLL_SECONDS = 0.5


@dataclass(frozen=True)
class Slot:
    """One worker's share of the machine."""

    index: int
    cpus: tuple[int, ...]
    gpus: tuple[str, ...] = ()

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        threads = str(len(self.cpus))
        env.update({"OMP_NUM_THREADS": threads, "OPENBLAS_NUM_THREADS": threads, "MKL_NUM_THREADS": threads})
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpus)
        else:
            env.setdefault("JAX_PLATFORMS", "cpu")
        # Every proxy compiles the same step (same model, same shapes): JAX's persistent cache compiles it
        # once for the swarm instead of once per proxy (a third of a small proxy's time on a CPU).
        env.setdefault(
            "JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(storage.cache_dir()), "jax-compilation")
        )
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        return env


def make_slots(workers: int, gpus: Sequence[str] = ()) -> list[Slot]:
    """`workers` slots over this process's cores (sched_getaffinity) and the GPUs given, split evenly."""
    cores = sorted(os.sched_getaffinity(0))
    if workers < 1:
        raise UsageError("--workers: at least 1")
    if workers > len(cores):
        raise UsageError(
            f"--workers {workers}: this process may use {len(cores)} cores; one worker a core at most"
        )
    if gpus and len(gpus) % workers:
        raise UsageError(f"--gpus: {len(gpus)} GPUs do not split evenly over {workers} workers")
    per_cpu, per_gpu = len(cores) // workers, (len(gpus) // workers if gpus else 0)
    return [
        Slot(
            i,
            tuple(cores[i * per_cpu : (i + 1) * per_cpu]),
            tuple(gpus[i * per_gpu : (i + 1) * per_gpu]) if gpus else (),
        )
        for i in range(workers)
    ]


def job_result(root: str, job: SwarmProxy) -> ProxyResult | None:
    """The job's result, if it has one for its current run configuration."""
    path = storage.join(root, job.id, RESULT)
    if not storage.exists(path):
        return None
    try:
        result = read_result(path)
    except FormatError as error:  # a torn or hand-edited file: the proxy runs again
        log.warning("%s; the proxy runs again", error)
        return None
    config = Path(storage.join(root, job.run_config))
    if not config.exists() or result.run_config_sha256 != sha256_text(config.read_text(encoding="utf-8")):
        return None
    return result


def unfinished(root: str, jobs: Sequence[SwarmProxy]) -> list[SwarmProxy]:
    found = []
    for job in jobs:
        result = job_result(root, job)
        if result is None or result.status != "finished":
            found.append(job)
    return found


@dataclass
class RunSummary:
    finished: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    skipped: int = 0  # finished before this invocation
    seconds: float = 0.0


def run_jobs(
    swarm: str,
    root: str,
    jobs: Sequence[SwarmProxy],
    workers: int,
    gpus: Sequence[str] = (),
    validation: bool = False,
    limit: int | None = None,
) -> RunSummary:
    """Run every unfinished job of `jobs` (files under `root`) on `workers` pinned worker processes.

    limit: start at most this many (then stop, as a killed run would): for drills and tests."""
    slots = make_slots(workers, gpus)
    todo = unfinished(root, jobs)
    summary = RunSummary(skipped=len(jobs) - len(todo))
    if limit is not None:
        todo = todo[:limit]
    total = len(todo)
    if summary.skipped:
        log.info("%d of %d already finished; running the other %d", summary.skipped, len(jobs), total)
    started = time.monotonic()
    free = list(slots)
    running: dict[int, tuple[subprocess.Popen, SwarmProxy, Slot, float]] = {}
    durations: list[float] = []
    queue = list(todo)
    # A scheduler's kill (SIGTERM) stops the workers too, as Ctrl-C does: no proxy trains on unwatched.
    previous = signal.signal(signal.SIGTERM, _interrupt) if _main_thread() else None
    try:
        while queue or running:
            while queue and free:
                job, slot = queue.pop(0), free.pop(0)
                running[slot.index] = (
                    _start(swarm, root, job, slot, validation),
                    job,
                    slot,
                    time.monotonic(),
                )
            time.sleep(POLL_SECONDS)
            for index, (process, job, slot, began) in list(running.items()):
                if process.poll() is None:
                    continue
                del running[index]
                free.append(slot)
                durations.append(time.monotonic() - began)
                result = job_result(root, job)
                if result is not None and result.status == "finished":
                    summary.finished.append(job.id)
                    status = "finished"
                else:
                    summary.failed.append(job.id)
                    status = f"FAILED (see {storage.join(root, job.id, 'worker.log')})"
                done = len(summary.finished) + len(summary.failed)
                left = total - done
                eta = sum(durations) / len(durations) * math.ceil(left / len(slots)) if left else 0.0
                print(
                    f"[{done}/{total}] {job.id} {status} in {format_duration(durations[-1])}; "
                    f"{len(running)} running, elapsed {format_duration(time.monotonic() - started)}, "
                    f"ETA {format_duration(eta)}",
                    flush=True,
                )
    except KeyboardInterrupt:
        for process, *_ in running.values():
            process.terminate()
        for process, *_ in running.values():
            process.wait()
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    summary.seconds = time.monotonic() - started
    return summary


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _start(swarm: str, root: str, job: SwarmProxy, slot: Slot, validation: bool) -> subprocess.Popen:
    command = [sys.executable, "-m", "tokenmill.swarm.worker", swarm, job.id]
    if validation:
        command.append("--validation")
    log_path = Path(storage.join(root, job.id, "worker.log"))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log_file:
        cpus = set(slot.cpus)
        return subprocess.Popen(
            command,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=slot.environment(),
            preexec_fn=lambda: os.sched_setaffinity(0, cpus),
        )
