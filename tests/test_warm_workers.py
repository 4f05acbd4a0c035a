"""Warm workers: processes started before the job, prepared by the pipeline, taken by the local runner
(pipelines/warm_workers.py, pipelines/local_worker.py, pipelines/local_runner.py)."""

from __future__ import annotations

import argparse
import sys
import time

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.util import assert_that

from tokenmill.pipelines.local_runner import BoundedBundleFnApiRunner
from tokenmill.pipelines.options import start_warm_workers
from tokenmill.pipelines.warm_workers import WarmWorkers


def _run_on_workers(
    warm_workers: WarmWorkers | None, allowed: set[tuple[bool, bool]], elements: int = 8
) -> None:
    """A pipeline on 2 worker processes; each element checks, in its worker, that (started warm, spaCy
    tokenizer made without the pipeline asking) is one of `allowed`, and one element must see
    `max(allowed)`."""
    options = PipelineOptions(["--direct_num_workers=2", "--direct_running_mode=multi_processing"])
    prepared = max(allowed)[1]
    runner = BoundedBundleFnApiRunner(warm_workers=warm_workers)
    with beam.Pipeline(runner=runner, options=options) as pipeline:

        def facts_of(_):
            from tokenmill.filters import heuristics

            # A warm worker's preparations go on beside the job: give the tokenizer time to appear.
            deadline = time.monotonic() + (60 if prepared else 0)
            while "en" not in heuristics._SHARED and time.monotonic() < deadline:
                time.sleep(0.05)
            return "--warm" in sys.argv, "en" in heuristics._SHARED

        def check(facts):
            if not set(facts) <= allowed or max(allowed) not in facts or len(facts) != elements:
                raise AssertionError(f"workers saw {sorted(set(facts))}, allowed {sorted(allowed)}")

        assert_that(pipeline | beam.Create(range(elements)) | beam.Map(facts_of), check)


def test_the_runner_takes_warm_workers_that_the_pipeline_prepared_and_closes_the_pool():
    warm = WarmWorkers(2, ["tokenmill.pipelines.curate"])
    processes = list(warm._idle)
    # What HeuristicFilter asks for, and a call that fails: the worker logs it and runs the job anyway.
    warm.prepare(
        [("tokenmill.filters.heuristics:shared_word_tokenizer", ("en",)), ("tokenmill.no_such_module:f", ())]
    )
    _run_on_workers(warm, {(True, True)})
    assert warm.take() is None  # both were taken, and both ran the job and exited
    assert [process.wait(timeout=30) for process in processes] == [0, 0]


def test_a_slot_with_no_warm_worker_left_starts_a_cold_one():
    warm = WarmWorkers(1)
    _run_on_workers(warm, {(True, False), (False, False)}, elements=16)
    assert warm.take() is None


def test_warm_workers_nobody_took_exit_when_the_pool_closes():
    warm = WarmWorkers(2, ["tokenmill.pipelines.curate"])
    processes = list(warm._idle)
    started = time.monotonic()
    warm.close()
    assert [process.returncode for process in processes] == [0, 0]
    assert time.monotonic() - started < 60
    assert warm.take() is None


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
        assert len(warm._idle) == 2
