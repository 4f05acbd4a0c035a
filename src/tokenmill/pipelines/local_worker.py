"""The local runner's SDK worker process: Beam's own worker main, then an exit without the interpreter's
teardown.

When the runner closes a worker's control stream, Beam's worker finishes its in-flight bundles, tears its
DoFns down, closes its channels and flushes its log handler, and returns; every output file is written
and renamed by then. What is left is Python's teardown: freeing every object the worker made (spaCy's
vocabulary and string store, the bundles' buffers, several hundred MB), about 0.7 s per worker of a
curate run, paid before the run can end. `os._exit` skips it; the operating system reclaims the memory
at once. A worker that fails still exits through Python, with its traceback and a non-zero status.

`--warm MODULE...` starts a warm worker (tokenmill.pipelines.warm_workers): it imports Beam's worker and
the modules named, then reads JSON lines on stdin: `{"call": "module:function", "args": [...]}` queues a
preparation, `{"environment": {...}}` sets the job's service addresses and runs the worker (while the
preparations left go on). At the end of stdin without a job it exits quietly.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import queue
import sys
import threading

log = logging.getLogger(__name__)

#: How much lower than the launcher a warm worker's imports and preparations run (a nice value).
WARM_UP_NICENESS = 10


def _run_worker() -> None:
    from apache_beam.runners.worker import sdk_worker_main  # imported by the warm-up, where there is one

    sdk_worker_main.main(sys.argv)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _call(name: str, args: list[str]) -> None:
    module_name, _, function_name = name.partition(":")
    try:
        getattr(importlib.import_module(module_name), function_name)(*args)
    except Exception as error:  # the step's own set-up meets it again, in a bundle, and reports it there
        log.warning("warm worker: preparing %s%s failed: %s", name, tuple(args), error)


def _wait_for_job(modules: list[str]) -> None:
    calls: queue.SimpleQueue = queue.SimpleQueue()
    job: dict[str, str] = {}
    arrived = threading.Event()

    def read_messages() -> None:
        for line in sys.stdin:
            message = json.loads(line)
            if "call" in message:
                calls.put((message["call"], message["args"]))
            elif "environment" in message:
                job.update(message["environment"])
                break
        calls.put(None)
        arrived.set()

    def prepare() -> None:
        # At a lower priority than the launcher, which builds the job meanwhile: on a machine with fewer
        # cores than processes the launcher's work is what the run waits for. On Linux a thread's nice
        # value is its own, so the job, run by the main thread, keeps the normal priority. Preparations
        # still queued when the job arrives go on beside it (a step's set-up waits for the one it needs).
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WARM_UP_NICENESS)
        except (AttributeError, OSError):
            pass
        for module_name in ("apache_beam.runners.worker.sdk_worker_main", *modules):
            try:
                importlib.import_module(module_name)
            except Exception as error:  # the job's own import meets it again and reports it there
                logging.getLogger(__name__).warning(
                    "warm worker: importing %s failed: %s", module_name, error
                )
        while (call := calls.get()) is not None:
            _call(*call)

    threading.Thread(target=read_messages, name="warm-messages", daemon=True).start()
    threading.Thread(target=prepare, name="warm-up", daemon=True).start()
    arrived.wait()
    if not job:
        os._exit(0)  # stdin closed before a job came: the run did not need this worker
    os.environ.update(job)
    _run_worker()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--warm":
        _wait_for_job(sys.argv[2:])
    _run_worker()


if __name__ == "__main__":
    main()
