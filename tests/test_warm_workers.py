"""Warm workers: processes started before the job, prepared by the pipeline, taken by the local runner
(pipelines/warm_workers.py, pipelines/local_worker.py, pipelines/local_runner.py)."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import time

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.util import assert_that

from tokenmill.pipelines.local_runner import BoundedBundleFnApiRunner
from tokenmill.pipelines.options import start_warm_workers
from tokenmill.pipelines.warm_workers import WarmWorkers


def _run_on_workers(
    warm_workers: WarmWorkers | None, allowed: set[tuple[bool, bool]], elements: int = 8
) -> None:
    """A pipeline on 2 worker processes; each element checks, in its worker, that (forked from the pool's
    template, spaCy tokenizer made without the pipeline asking) is one of `allowed`, and one element must
    see `max(allowed)`."""
    options = PipelineOptions(["--direct_num_workers=2", "--direct_running_mode=multi_processing"])
    template = warm_workers.template_pid
    runner = BoundedBundleFnApiRunner(warm_workers=warm_workers)
    with beam.Pipeline(runner=runner, options=options) as pipeline:

        def facts_of(_):
            from tokenmill.filters import heuristics

            # A forked worker starts after the preparations sent before its job: nothing to wait for.
            return os.getppid() == template, "en" in heuristics._SHARED

        def check(facts):
            if not set(facts) <= allowed or max(allowed) not in facts or len(facts) != elements:
                raise AssertionError(f"workers saw {sorted(set(facts))}, allowed {sorted(allowed)}")

        assert_that(pipeline | beam.Create(range(elements)) | beam.Map(facts_of), check)


def test_the_runner_takes_workers_forked_from_the_prepared_template_and_closes_the_pool():
    warm = WarmWorkers(2, ["tokenmill.pipelines.curate"])
    # What HeuristicFilter asks for, and a call that fails: the template logs it and forks anyway.
    warm.prepare(
        [("tokenmill.filters.heuristics:shared_word_tokenizer", ("en",)), ("tokenmill.no_such_module:f", ())]
    )
    _run_on_workers(warm, {(True, True)})
    assert warm.take() is None  # both were taken, and both ran the job and exited
    workers = list(warm._workers.values())
    assert [worker.wait(timeout=30) for worker in workers] == [0, 0]
    assert len({worker.pid for worker in workers}) == 2
    assert warm._template.returncode == 0  # the runner closed the pool, and the template exited


def test_a_slot_with_no_warm_worker_left_starts_a_cold_one():
    warm = WarmWorkers(1)
    _run_on_workers(warm, {(True, False), (False, False)}, elements=16)
    assert warm.take() is None


def test_a_template_nobody_took_a_worker_from_exits_when_the_pool_closes():
    warm = WarmWorkers(2, ["tokenmill.pipelines.curate"])
    started = time.monotonic()
    warm.close()
    assert warm._template.returncode == 0
    assert time.monotonic() - started < 60
    assert warm.take() is None


def _hanging_job() -> dict[str, str]:
    """A job whose control service never answers: Beam's worker waits for it."""
    with socket.socket() as unused:
        unused.bind(("localhost", 0))
        port = unused.getsockname()[1]
    return {"CONTROL_API_SERVICE_DESCRIPTOR": f'url: "localhost:{port}"', "PIPELINE_OPTIONS": "{}"}


def test_forked_workers_report_their_exit_kill_and_failure_like_child_processes():
    with WarmWorkers(3) as warm:
        failing = warm.take()
        failing.start({})  # no service addresses: Beam's worker main raises, the worker exits 1
        assert failing.wait(timeout=60) == 1
        hanging = warm.take()
        hanging.start(_hanging_job())
        with pytest.raises(subprocess.TimeoutExpired):
            hanging.wait(timeout=1)
        assert hanging.poll() is None and hanging.pid not in (None, warm.template_pid)
        hanging.kill()
        assert hanging.wait(timeout=30) == -signal.SIGKILL
        never_started = warm.take()
        assert warm.take() is None  # three were asked for
    assert never_started.wait(timeout=5) == 1  # the pool closed before its job came


def test_a_worker_whose_template_died_is_not_waited_on_forever():
    warm = WarmWorkers(1)
    worker = warm.take()
    worker.start(_hanging_job())
    while worker.pid is None:
        time.sleep(0.05)
    os.kill(warm.template_pid, signal.SIGKILL)
    try:
        assert worker.wait(timeout=30) == 1  # nobody is left to report its exit
        assert warm.take() is None  # nor to fork another: the runner starts a cold worker
    finally:
        os.kill(worker.pid, signal.SIGKILL)  # orphaned by the test's kill; a real run's exits with its job
        warm.close()


def _args(**overrides) -> argparse.Namespace:
    values = {"runner": "local", "workers": 2, "beam_option": [], "dry_run": False, **overrides}
    return argparse.Namespace(**values)


def test_only_a_local_run_on_several_worker_processes_starts_warm_workers():
    for args in (
        _args(runner="dask"),
        _args(workers=1),
        _args(dry_run=True),
        _args(beam_option=["--direct_running_mode=multi_threading"]),
    ):
        assert start_warm_workers(args) is None, args
    with start_warm_workers(_args()) as warm:
        assert [warm.take() is not None for _ in range(3)] == [True, True, False]
