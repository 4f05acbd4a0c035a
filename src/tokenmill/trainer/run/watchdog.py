"""Preemption and hangs: what a run does when the scheduler wants its machines back, or when no step
comes back (docs/trainer.md, "A run's bad hours"; docs/operations.md for how the launch outputs use the
exit codes).

`Preemption` turns SIGTERM and SIGINT (what Kubernetes and SLURM send before they kill) into a request the
loop reads after the step in flight: it checkpoints and raises `Preempted`, which `tokenmill train` turns
into exit code 75 (REQUEUE_EXIT, EX_TEMPFAIL). If the step and the checkpoint are not done within the
deadline, a timer abandons them: the latest complete checkpoint stays the one a rerun resumes, and the
process exits 75 all the same. A second signal acts as it would without the handler.

`Watchdog` is a thread that exits the process with code 76 (HANG_EXIT) when no step completes within its
time (a longer one for the first step of a command, which compiles), after dumping every thread's stack
(faulthandler) into the run's train.log, so that the scheduler restarts the run and a person can see where
it hung.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

#: `tokenmill train`'s exit code after a preemption: checkpointed (or abandoned in time), requeue me.
REQUEUE_EXIT = 75
#: The exit code after the watchdog found no step completing in time: restart me.
HANG_EXIT = 76
#: Exit codes the launch outputs restart a job on.
RESTART_EXITS = (REQUEUE_EXIT, HANG_EXIT)


class Preempted(Exception):
    """The run was asked to stop by a signal and has checkpointed; exit with `exit_code` to be requeued."""

    exit_code = REQUEUE_EXIT


def _flush_logs() -> None:
    for handler in logging.getLogger("tokenmill").handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001 (best effort on the way out)
            pass


class Preemption:
    """SIGTERM/SIGINT handlers for the duration of a `with` block (main thread only; elsewhere a no-op).

    `requested` is the signal's name once one arrived. `on_abandon` runs (from the timer's thread) when the
    deadline passes before the loop has exited, just before the process exits REQUEUE_EXIT."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, deadline_seconds: float, on_abandon: Callable[[str], None] | None = None):
        self.deadline_seconds = deadline_seconds
        self.on_abandon = on_abandon
        self.requested: str | None = None
        self._previous: dict[int, object] = {}
        self._timer: threading.Timer | None = None

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            for number in self.SIGNALS:
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        self._restore()
        if self._timer is not None:
            self._timer.cancel()

    def _restore(self) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)  # type: ignore[arg-type]
        self._previous = {}

    def _handle(self, number: int, frame: object) -> None:
        self.requested = signal.Signals(number).name
        # A second signal acts as it would have without us (SIGINT: KeyboardInterrupt, SIGTERM: death).
        self._restore()
        log.warning(
            "%s: finishing the step in flight, then a checkpoint and exit %d (deadline %.0f s)",
            self.requested, REQUEUE_EXIT, self.deadline_seconds,
        )  # fmt: skip
        self._timer = threading.Timer(self.deadline_seconds, self._abandon)
        self._timer.daemon = True
        self._timer.start()

    def _abandon(self) -> None:
        log.error("the step and checkpoint did not finish within %.0f s: abandoned", self.deadline_seconds)
        if self.on_abandon is not None:
            try:
                self.on_abandon(self.requested or "?")
            except Exception:  # noqa: BLE001 (the exit matters more than the record)
                log.exception("recording the abandoned preemption failed")
        _flush_logs()
        os._exit(REQUEUE_EXIT)


class Watchdog:
    """A daemon thread: `arm(seconds)` starts a deadline (0: none), `stop()` ends the watch. When a
    deadline passes, every thread's stack goes to `stack_file` (and stderr), `on_hang(seconds, first)` runs,
    and the process exits HANG_EXIT."""

    def __init__(self, stack_file: Path | None, on_hang: Callable[[float, bool], None] | None = None):
        self.stack_file = stack_file
        self.on_hang = on_hang
        self._deadline: float | None = None
        self._seconds = 0.0
        self._first = False
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="tokenmill-watchdog", daemon=True)
        self._thread.start()

    def arm(self, seconds: float, first: bool = False) -> None:
        with self._lock:
            self._deadline = time.monotonic() + seconds if seconds > 0 else None
            self._seconds, self._first = seconds, first

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._stopped.wait(0.2):
            with self._lock:
                expired = self._deadline is not None and time.monotonic() > self._deadline
                seconds, first = self._seconds, self._first
            if expired:
                self._fire(seconds, first)

    def _fire(self, seconds: float, first: bool) -> None:
        what = "the first step" if first else "a step"
        log.error("no step completed within %.0f s (%s): dumping every thread's stack, exit %d",
                  seconds, what, HANG_EXIT)  # fmt: skip
        _flush_logs()
        if self.stack_file is not None:
            with open(self.stack_file, "a", encoding="utf-8") as handle:
                handle.write(f"--- watchdog: no step within {seconds:.0f} s; every thread's stack ---\n")
                handle.flush()
                faulthandler.dump_traceback(file=handle, all_threads=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if self.on_hang is not None:
            try:
                self.on_hang(seconds, first)
            except Exception:  # noqa: BLE001 (the exit matters more than the record)
                log.exception("recording the hang failed")
        _flush_logs()
        os._exit(HANG_EXIT)
