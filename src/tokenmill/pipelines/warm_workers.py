"""SDK worker processes forked from one template process started before the job graph is built, so that
their start-up overlaps the launcher's and is paid once, not once per worker.

A local curate run spends its first seconds in the launcher alone, on one core: Python imports Beam and
the pipeline's modules, loads the recipe, builds the job graph and fuses it into stages (3.5-5 s on the
2-core development machine). Only then does Beam's FnApiRunner start its worker processes, and each
imports Beam's worker (1.1 s), tokenmill's pipeline modules (0.8 s) and spaCy (0.75 s), then builds the
spaCy tokenizer (0.8-1.25 s) in its first bundle, while the launcher waits. Here the command starts one
template process as its first act; it imports what the command names while the launcher works, runs the
"prepare" calls the pipeline sends once it knows its steps (the tokenizer), and then forks one worker
per Beam worker slot when the running job asks for it, with the one thing only the running job knows:
the addresses of its control, data and logging services. Each worker starts past its imports and its
preparations, and shares the template's memory pages until it writes them (copy on write). The local
runner hands each worker slot a forked worker (tokenmill.pipelines.local_runner) and falls back to a cold
process when the pool is spent or its template is gone.

The template forks from its only thread (imports and preparations run on it, before any fork), reaps its
workers and reports each one's exit status on a pipe of its own, so the runner waits on a forked worker
as on a child process. When its stdin closes (the pool closes, or the launcher dies) it waits for the
workers still running, for at most local_worker.CLOSE_GRACE_SECONDS, kills the rest and exits: a failed
or dry run leaves no process behind.

This module imports nothing heavy: it is imported before Beam is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterable, Sequence

#: glibc malloc arenas per worker process (see tokenmill.pipelines.local_runner), where the environment
#: does not set MALLOC_ARENA_MAX.
WORKER_MALLOC_ARENAS = "2"
#: The module a worker process runs (Beam's worker main, without the interpreter's teardown at its end),
#: and the template runs with `--warm`.
WORKER_MODULE = "tokenmill.pipelines.local_worker"

_POOLS: dict[str, WarmWorkers] = {}


def worker_environment() -> dict[str, str]:
    """The environment a worker process starts with: the launcher's, two malloc arenas by default."""
    return {"MALLOC_ARENA_MAX": WORKER_MALLOC_ARENAS, **os.environ}


class ForkedWorker:
    """A worker the template forks when `start` gives it the job: waited on and killed like a child
    process (`wait`, `poll`, `kill`, `returncode`), through the template, which is its parent."""

    def __init__(self, pool: WarmWorkers, number: int) -> None:
        self._pool = pool
        self.number = number
        self.pid: int | None = None
        self.returncode: int | None = None
        self._exited = threading.Event()

    def start(self, environment: dict[str, str]) -> None:
        """Fork the worker, which then runs as Beam's worker with the job's service addresses."""
        if not self._pool._send({"start": self.number, "environment": environment}):
            self._exit(1)  # the template is gone: wait() says the worker failed

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"warm worker {self.number}", timeout)
        return self.returncode

    def poll(self) -> int | None:
        return self.returncode

    def kill(self) -> None:
        self._pool._send({"kill": self.number})

    def _exit(self, returncode: int) -> None:
        if self.returncode is None:
            self.returncode = returncode
        self._exited.set()


class WarmWorkers:
    """A template process, started now, importing `modules`; `take()` hands out up to `count` workers
    forked from it."""

    def __init__(self, count: int, modules: Sequence[str] = ()) -> None:
        self.pool_id = f"{os.getpid()}-{id(self)}"
        self._lock = threading.Lock()
        self._left = count
        self._workers: dict[int, ForkedWorker] = {}
        reports, report_to = os.pipe()
        self._template = subprocess.Popen(
            [sys.executable, "-m", WORKER_MODULE, "--warm", str(report_to), *modules],
            stdin=subprocess.PIPE,
            pass_fds=(report_to,),
            env=worker_environment(),
        )
        os.close(report_to)
        self._reader = threading.Thread(target=self._read_reports, args=(reports,), daemon=True)
        self._reader.start()
        _POOLS[self.pool_id] = self

    @property
    def template_pid(self) -> int:
        return self._template.pid

    def prepare(self, calls: Iterable[tuple[str, Sequence[str]]]) -> None:
        """Have the template call each `module:function` with its string arguments before it forks a
        worker (what the pipeline's steps would do first in every worker, such as loading a tokenizer)."""
        for name, args in calls:
            self._send({"call": name, "args": list(args)})

    def take(self) -> ForkedWorker | None:
        """A worker to start, or None when `count` were taken or the template is gone."""
        with self._lock:
            if self._left <= 0 or self._template.poll() is not None:
                return None
            self._left -= 1
            worker = ForkedWorker(self, len(self._workers))
            self._workers[worker.number] = worker
            return worker

    def close(self) -> None:
        """No more workers: the template exits once the workers it forked have (see the module's note);
        the pool is forgotten."""
        _POOLS.pop(self.pool_id, None)
        with self._lock:
            self._left = 0
            try:
                self._template.stdin.close()
            except OSError:
                pass
        self._template.wait()
        self._reader.join()

    def _send(self, message: dict) -> bool:
        with self._lock:
            try:
                self._template.stdin.write((json.dumps(message) + "\n").encode())
                self._template.stdin.flush()
                return True
            except (OSError, ValueError):  # it died, or the pool closed
                return False

    def _read_reports(self, reports: int) -> None:
        with os.fdopen(reports, "rb") as lines:
            for line in lines:
                report = json.loads(line)
                worker = self._workers.get(report["worker"])
                if worker is None:
                    continue
                if "pid" in report:
                    worker.pid = report["pid"]
                if "returncode" in report:
                    worker._exit(report["returncode"])
        for worker in list(self._workers.values()):  # the template exited: nothing is left to report
            worker._exit(1)

    def __enter__(self) -> WarmWorkers:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def pool(pool_id: str) -> WarmWorkers | None:
    return _POOLS.get(pool_id)
