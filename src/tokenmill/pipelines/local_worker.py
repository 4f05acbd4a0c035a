"""The local runner's SDK worker process: Beam's own worker main, then an exit without the interpreter's
teardown; and the template that warm workers are forked from.

When the runner closes a worker's control stream, Beam's worker finishes its in-flight bundles, tears its
DoFns down, closes its channels and flushes its log handler, and returns; every output file is written
and renamed by then. What is left is Python's teardown: freeing every object the worker made (spaCy's
vocabulary and string store, the bundles' buffers, several hundred MB), about 0.7 s per worker of a
curate run, paid before the run can end. `os._exit` skips it; the operating system reclaims the memory
at once. A worker that fails still exits through Python, with its traceback and a non-zero status.

`--warm FD MODULE...` runs the template of a warm pool (tokenmill.pipelines.warm_workers): it imports
Beam's worker and the modules named, then reads JSON lines on stdin: `{"call": "module:function", "args":
[...]}` runs a preparation, `{"start": N, "environment": {...}}` forks worker N, which sets the job's
service addresses and runs as Beam's worker, `{"kill": N}` kills worker N if it is still running. On file
descriptor FD it writes `{"worker": N, "pid": P}` for each fork and `{"worker": N, "returncode": R}` for
each exit (R as subprocess gives it: negative for a signal). Messages are handled one at a time on the
only thread, so a fork waits for the preparations sent before it, and nothing else runs when it forks.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import select
import signal
import sys
import time
import traceback

log = logging.getLogger(__name__)

#: The longest sleep of Beam's state sampler in a worker (see _sampler_that_stops_quickly), in ms.
STATE_SAMPLING_MS = 20
#: How long a template whose pool closed waits for its running workers before it kills them.
CLOSE_GRACE_SECONDS = 30.0


def _run_worker() -> None:
    from apache_beam.runners.worker import sdk_worker_main  # imported by the template, where there is one

    _one_bundle_at_a_time()
    _sampler_that_stops_quickly()
    sdk_worker_main.main(sys.argv)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _one_bundle_at_a_time() -> None:
    """Bundles the runner sends ahead wait for the one running instead of running beside it.

    The local runner sends each worker its next bundle (input and request) while the current one runs
    (tokenmill.pipelines.local_runner, BUNDLES_AHEAD), so that a worker does not idle while a bundle's
    outputs go back and the next one's input comes. Beam's harness would run both at once, on two
    threads with two sets of DoFns (the steps' shared state, such as the spaCy tokenizer, is not made
    for that, and memory would double): a lock makes them take turns, in a worker process's one set of
    DoFns. A queued bundle's input waits in its receiving queue, which is made unbounded in elements:
    with Beam's five, a queued bundle's full queue would stop the data stream's reader, and with it
    the input of the bundle running. The runner bounds what is queued (one bundle of at most
    MAX_BUNDLE_BYTES per worker), so the worker's memory stays bounded.
    """
    import threading

    from apache_beam.runners.worker import data_plane, sdk_worker

    data_plane._DEFAULT_RECEIVE_QUEUE_MAX_ELEMENTS = 0  # ByteLimitedQueue: no bound on elements
    turn = threading.Lock()
    process_bundle = sdk_worker.SdkWorker.process_bundle

    def in_turn(self, request, instruction_id):
        with turn:
            return process_bundle(self, request, instruction_id)

    sdk_worker.SdkWorker.process_bundle = in_turn


def _sampler_that_stops_quickly() -> None:
    """Bundles end within STATE_SAMPLING_MS of their last element, not within Beam's 200 ms.

    Beam's harness times each step with a state sampler: a thread per bundle that sleeps between
    samples, its period growing from 2 ms to 200 ms, and that the bundle's end joins, so every bundle
    waits for the sampler's current sleep to end (up to 200 ms, with nothing to do). On the curate
    bench's filter stage that was a tenth of a worker's time in bundles of 0.4 s (py-spy: the bundle
    thread in StateSampler.stop). With a 20 ms ceiling the wait is at most that; the sampler's thread
    wakes 50 times a second instead of 5, without the interpreter lock (Beam's sampler loop runs
    without it), and the step timings it gives are finer.
    """
    from apache_beam.runners.worker import statesampler

    class QuickStopSampler(statesampler.StateSampler):
        def __init__(self, prefix, counter_factory, sampling_period_ms: int = STATE_SAMPLING_MS) -> None:
            super().__init__(prefix, counter_factory, min(sampling_period_ms, STATE_SAMPLING_MS))

    statesampler.StateSampler = QuickStopSampler


def _call(name: str, args: list[str]) -> None:
    module_name, _, function_name = name.partition(":")
    try:
        getattr(importlib.import_module(module_name), function_name)(*args)
    except Exception as error:  # the step's own set-up meets it again, in a bundle, and reports it there
        log.warning("warm worker template: preparing %s%s failed: %s", name, tuple(args), error)


class _Template:
    """The template's state: its running workers by number, and a pidfd for each (readable once it exits)."""

    def __init__(self, report_fd: int) -> None:
        self.report_fd = report_fd
        self.running: dict[int, int] = {}  # worker number -> pid, until reaped
        self.exit_fds: dict[int, int] = {}  # pidfd -> worker number

    def report(self, **fields) -> None:
        try:
            os.write(self.report_fd, (json.dumps(fields) + "\n").encode())
        except BrokenPipeError:  # the launcher is gone; its workers end with their job's channels
            pass

    def fork(self, number: int, environment: dict[str, str]) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)
                for fd in (null, self.report_fd, *self.exit_fds):
                    os.close(fd)
                os.environ.update(environment)
                _run_worker()
            except BaseException:
                traceback.print_exc()
            os._exit(1)
        self.running[number] = pid
        self.exit_fds[_exit_fd(pid)] = number
        self.report(worker=number, pid=pid)

    def kill(self, number: int) -> None:
        if number in self.running:  # not reaped yet, so its pid is still its own
            os.kill(self.running[number], signal.SIGKILL)

    def reap(self, exit_fd: int) -> None:
        number = self.exit_fds.pop(exit_fd)
        os.close(exit_fd)
        _, status = os.waitpid(self.running.pop(number), 0)
        self.report(worker=number, returncode=_returncode(status))


def _exit_fd(pid: int) -> int:
    """A file descriptor readable once `pid` exits: its pidfd (Linux 5.3)."""
    return os.pidfd_open(pid)


def _returncode(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _serve_as_template(report_fd: int, modules: list[str]) -> None:
    for module_name in ("apache_beam.runners.worker.sdk_worker_main", *modules):
        try:
            importlib.import_module(module_name)
        except Exception as error:  # the job's own import meets it again and reports it there
            log.warning("warm worker template: importing %s failed: %s", module_name, error)
    template = _Template(report_fd)
    commands, pending = sys.stdin.fileno(), b""
    while commands is not None:
        readable, _, _ = select.select([commands, *template.exit_fds], [], [])
        for exit_fd in readable:
            if exit_fd != commands:
                template.reap(exit_fd)
        if commands not in readable:
            continue
        chunk = os.read(commands, 1 << 16)
        if not chunk:
            commands = None  # the pool closed
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            message = json.loads(line)
            if "call" in message:
                _call(message["call"], message["args"])
            elif "start" in message:
                template.fork(message["start"], message["environment"])
            elif "kill" in message:
                template.kill(message["kill"])
    deadline = time.monotonic() + CLOSE_GRACE_SECONDS
    while template.exit_fds:
        readable, _, _ = select.select(list(template.exit_fds), [], [], max(0.0, deadline - time.monotonic()))
        if not readable:
            for number in list(template.running):
                template.kill(number)
            readable, _, _ = select.select(list(template.exit_fds), [], [])
        for exit_fd in readable:
            template.reap(exit_fd)
    os._exit(0)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--warm":
        _serve_as_template(int(sys.argv[2]), sys.argv[3:])
    _run_worker()


if __name__ == "__main__":
    main()
