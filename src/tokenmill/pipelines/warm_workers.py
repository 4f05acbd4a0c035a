"""SDK worker processes started before the job graph is built, so that their start-up overlaps the
launcher's.

A local curate run spends its first seconds in the launcher alone, on one core: Python imports Beam and
the pipeline's modules, loads the recipe, builds the job graph and fuses it into stages (3.5-5 s on the
2-core development machine). Only then does Beam's FnApiRunner start its worker processes, and each
imports Beam's worker (1.1 s), tokenmill's pipeline modules (0.8 s) and spaCy (0.75 s), then builds the
spaCy tokenizer (1.25 s) in its first bundle, while the launcher waits. Warm workers are started by the
command as its first act, import what the command names while the launcher works, take "prepare" calls
the pipeline sends once it knows its steps (the tokenizer), and then wait on their stdin for the one
thing only the running job knows: the addresses of its control, data and logging services. The local
runner hands each Beam worker slot a warm process (tokenmill.pipelines.local_runner) and falls back to a
cold one when none is left; a warm process nobody took exits when its stdin closes, so a failed or
dry run leaves no process behind.

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
#: The module a worker process runs (Beam's worker main, without the interpreter's teardown at its end).
WORKER_MODULE = "tokenmill.pipelines.local_worker"

_POOLS: dict[str, WarmWorkers] = {}


def worker_environment() -> dict[str, str]:
    """The environment a worker process starts with: the launcher's, two malloc arenas by default."""
    return {"MALLOC_ARENA_MAX": WORKER_MALLOC_ARENAS, **os.environ}


class WarmWorkers:
    """`count` worker processes, started now, importing `modules`; `take()` hands one out, once."""

    def __init__(self, count: int, modules: Sequence[str] = ()) -> None:
        self.pool_id = f"{os.getpid()}-{id(self)}"
        self._lock = threading.Lock()
        command = [sys.executable, "-m", WORKER_MODULE, "--warm", *modules]
        self._idle = [
            subprocess.Popen(command, stdin=subprocess.PIPE, env=worker_environment()) for _ in range(count)
        ]
        _POOLS[self.pool_id] = self

    def prepare(self, calls: Iterable[tuple[str, Sequence[str]]]) -> None:
        """Have every idle worker call each `module:function` with its string arguments (what the
        pipeline's steps would do first in every worker, such as loading a tokenizer)."""
        lines = "".join(json.dumps({"call": name, "args": list(args)}) + "\n" for name, args in calls)
        if not lines:
            return
        with self._lock:
            for process in self._idle:
                _send(process, lines)

    def take(self) -> subprocess.Popen | None:
        """An idle warm worker process, or None when every one was taken."""
        with self._lock:
            return self._idle.pop() if self._idle else None

    def close(self) -> None:
        """Idle workers exit (their stdin closes); the pool is forgotten."""
        _POOLS.pop(self.pool_id, None)
        with self._lock:
            idle, self._idle = self._idle, []
        for process in idle:
            try:
                process.stdin.close()
            except OSError:
                pass
        for process in idle:
            process.wait()

    def __enter__(self) -> WarmWorkers:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def pool(pool_id: str) -> WarmWorkers | None:
    return _POOLS.get(pool_id)


def start_job(process: subprocess.Popen, environment: dict[str, str]) -> None:
    """Give a warm worker the running job's service addresses: it then runs as Beam's worker."""
    _send(process, json.dumps({"environment": environment}) + "\n")
    process.stdin.close()


def _send(process: subprocess.Popen, lines: str) -> None:
    try:
        process.stdin.write(lines.encode())
        process.stdin.flush()
    except OSError:  # it died (its imports failed): the job's start finds out and says so
        pass
