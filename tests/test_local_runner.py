"""The local runner cuts each stage's input into bundles of bounded size (pipelines/local_runner.py)."""

from __future__ import annotations

import json
import os
import sys
import time

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.portability import python_urns
from apache_beam.portability.api import beam_runner_api_pb2
from apache_beam.runners.portability.fn_api_runner import FnApiRunner
from apache_beam.testing.util import assert_that, equal_to

from tokenmill.pipelines.local_runner import (
    BEAM_WORKER_COMMAND,
    BUNDLES_AHEAD,
    BUNDLES_PER_WORKER,
    WORKER_COMMAND,
    WORKER_MALLOC_ARENAS,
    BoundedBundleFnApiRunner,
    pack_bundles,
    use_tokenmill_worker,
)
from tokenmill.pipelines.local_worker import STATE_SAMPLING_MS

#: Elements of about 200 encoded bytes: a 4 KiB bound holds about 20 of them.
PAYLOAD = "x" * 190
MAX_BUNDLE_BYTES = 4096


class BundleSizes(beam.DoFn):
    """Emits the number of elements of each bundle it saw, at the end of the bundle."""

    def start_bundle(self):
        self.seen = 0

    def process(self, element):
        self.seen += 1

    def finish_bundle(self):
        from apache_beam.transforms.window import GlobalWindow
        from apache_beam.utils.windowed_value import WindowedValue

        if self.seen:
            yield WindowedValue(self.seen, GlobalWindow().max_timestamp(), [GlobalWindow()])


def _run(runner, elements: int, keys: int):
    """Bundle sizes after a Create and after a GroupByKey, and the grouped result."""
    options = PipelineOptions(["--direct_num_workers=2", "--direct_running_mode=multi_threading"])
    captured = {}
    with beam.Pipeline(runner=runner, options=options) as pipeline:
        values = pipeline | beam.Create([(index % keys, f"{index}{PAYLOAD}") for index in range(elements)])
        captured["read"] = (
            values | "SizesRead" >> beam.ParDo(BundleSizes()) | "ListRead" >> beam.combiners.ToList()
        )
        grouped = values | beam.GroupByKey() | beam.MapTuple(lambda key, group: (key, len(list(group))))
        captured["grouped"] = (
            grouped | "SizesGrouped" >> beam.ParDo(BundleSizes()) | "ListGrouped" >> (beam.combiners.ToList())
        )
        assert_that(grouped, equal_to([(key, elements // keys) for key in range(keys)]), label="Groups")
        for name, sizes in captured.items():
            assert_that(sizes, lambda lists, name=name: _record(name, lists), label=f"Record{name}")
    return dict(RECORDED)


RECORDED: dict[str, list[int]] = {}


def _record(name: str, lists) -> None:
    (sizes,) = lists
    RECORDED[name] = sorted(sizes)


@pytest.fixture(autouse=True)
def _clear():
    RECORDED.clear()


def test_every_bundle_stays_under_the_bound_and_the_result_is_beams():
    sizes = _run(BoundedBundleFnApiRunner(max_bundle_bytes=MAX_BUNDLE_BYTES), elements=3000, keys=1500)
    # 3,000 elements of ~200 bytes: about 600 KB, so about 150 bundles of at most ~20 elements each.
    assert sum(sizes["read"]) == 3000 and max(sizes["read"]) <= 25 and len(sizes["read"]) >= 100
    # After the GroupByKey: 1,500 keys of two values, cut between keys into bounded bundles too.
    assert sum(sizes["grouped"]) == 1500 and max(sizes["grouped"]) <= GROUPED_BOUND


#: A grouped element here (a key and two values) is about 420 bytes: about 10 under the bound.
GROUPED_BOUND = 12


def test_beams_own_runner_sends_each_worker_its_whole_share():
    """What the bound is for: Beam's runner gives each of the 2 workers half of the stage in one bundle."""
    sizes = _run(FnApiRunner(), elements=3000, keys=1500)
    assert max(sizes["read"]) >= 1500


def test_a_small_stage_still_spreads_over_every_worker_and_empty_input_runs():
    sizes = _run(BoundedBundleFnApiRunner(max_bundle_bytes=MAX_BUNDLE_BYTES), elements=4, keys=2)
    assert sum(sizes["read"]) == 4 and sizes["grouped"] and sum(sizes["grouped"]) == 2


def test_a_stage_under_the_bound_is_cut_so_that_a_worker_done_early_takes_more():
    """A stage waits for its slowest worker: with one bundle per worker, one that finishes first idles for
    the rest; each worker gets about BUNDLES_PER_WORKER bundles, cut between elements, under the bound too."""
    sizes = _run(BoundedBundleFnApiRunner(max_bundle_bytes=64 << 20), elements=400, keys=400)
    assert sum(sizes["read"]) == 400
    assert len(sizes["read"]) >= 2 * BUNDLES_PER_WORKER and max(sizes["read"]) <= 400 // BUNDLES_PER_WORKER
    # 16 file names of a few bytes each: 8 bundles of 2 for 2 workers, not 2 of 8.
    sizes = _run(BoundedBundleFnApiRunner(max_bundle_bytes=64 << 20), elements=16, keys=16)
    assert len(sizes["read"]) == 2 * BUNDLES_PER_WORKER and max(sizes["read"]) <= 2


def test_the_bound_must_be_positive():
    with pytest.raises(ValueError, match="max_bundle_bytes"):
        BoundedBundleFnApiRunner(max_bundle_bytes=0)


def _worker_arenas(elements: int, expected: str) -> None:
    """A pipeline on two worker processes: every element sees MALLOC_ARENA_MAX `expected` in a worker."""
    launcher = os.getpid()
    options = PipelineOptions(["--direct_num_workers=2", "--direct_running_mode=multi_processing"])
    with beam.Pipeline(runner=BoundedBundleFnApiRunner(), options=options) as pipeline:
        seen = (
            pipeline
            | beam.Create(range(elements))
            | beam.Map(lambda _: (os.environ.get("MALLOC_ARENA_MAX"), os.getpid() != launcher))
        )
        assert_that(seen, equal_to([(expected, True)] * elements))


def test_worker_processes_start_with_two_malloc_arenas_unless_the_environment_says(monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "unset by the test")
    monkeypatch.delenv("MALLOC_ARENA_MAX")  # monkeypatch takes back what the runner sets
    _worker_arenas(8, "2")
    assert os.environ["MALLOC_ARENA_MAX"] == WORKER_MALLOC_ARENAS == "2"
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")  # the user's value is kept
    _worker_arenas(8, "4")
    assert os.environ["MALLOC_ARENA_MAX"] == "4"


def test_bundles_shrink_toward_the_end_of_a_stage_and_keep_the_order_and_the_bound():
    """Guided scheduling: a 1/wanted share of what is left per bundle, so the last ones are small."""
    pieces = [("in", bytes([index % 256]) * 100) for index in range(96)]  # 9,600 bytes
    bundles = pack_bundles(pieces, ["in"], wanted=8, max_bundle_bytes=1000)
    sizes = [sum(len(piece) for piece in bundle["in"]) for bundle in bundles]
    assert [piece for bundle in bundles for piece in bundle["in"]] == [piece for _, piece in pieces]
    assert max(sizes) <= 1000 and sizes[0] == 1000  # 9,600 / 8 is over the bound
    assert sizes == sorted(sizes, reverse=True) and sizes[-4:] == [100] * 4
    assert len(bundles) < len(pieces) // 2
    # Two inputs share bundles; a piece larger than the bound is a bundle of its own.
    bundles = pack_bundles([("a", b"x" * 50), ("b", b"y" * 5000), ("a", b"z" * 50)], ["a", "b"], 2, 1000)
    assert bundles == [
        {"a": [b"x" * 50], "b": []},
        {"a": [], "b": [b"y" * 5000]},
        {"a": [b"z" * 50], "b": []},
    ]


def test_workers_run_tokenmills_worker_main_unless_the_pipeline_names_its_own():
    launcher = os.getpid()
    options = PipelineOptions(["--direct_num_workers=2", "--direct_running_mode=multi_processing"])
    with beam.Pipeline(runner=BoundedBundleFnApiRunner(), options=options) as pipeline:
        seen = (
            pipeline
            | beam.Create(range(8))
            | beam.Map(lambda _: (sys.modules["__main__"].__spec__.name, os.getpid() != launcher))
        )
        assert_that(seen, equal_to([("tokenmill.pipelines.local_worker", True)] * 8))
    other = beam_runner_api_pb2.Environment(urn=python_urns.SUBPROCESS_SDK, payload=b"python -m my.worker")
    beams = beam_runner_api_pb2.Environment(urn=python_urns.SUBPROCESS_SDK, payload=BEAM_WORKER_COMMAND)
    proto = beam_runner_api_pb2.Pipeline()
    proto.components.environments["other"].CopyFrom(other)
    proto.components.environments["beams"].CopyFrom(beams)
    assert use_tokenmill_worker(proto) is False  # one worker is not tokenmill's: no bundles sent ahead
    environments = proto.components.environments
    assert environments["other"].payload == b"python -m my.worker"
    assert environments["beams"].payload == WORKER_COMMAND
    alone = beam_runner_api_pb2.Pipeline()
    alone.components.environments["beams"].CopyFrom(beams)
    assert use_tokenmill_worker(alone) is True


def test_bundles_sent_ahead_take_turns_in_their_worker_and_end_without_waiting_for_the_sampler(tmp_path):
    # Defined here, so that it is pickled by value: the worker processes cannot import this module.
    class BundleSpans(beam.DoFn):
        """Writes (worker pid, first and last moment of the bundle, the state sampler's period) of each
        bundle to a file of its own in `folder` (the test reads them back: workers are other processes)."""

        def __init__(self, folder: str) -> None:
            self.folder = folder

        def start_bundle(self):
            self.started = time.monotonic()
            self.seen = 0

        def process(self, element):
            time.sleep(0.002)  # long enough for a bundle sent ahead to arrive while this one runs
            self.seen += 1

        def finish_bundle(self):
            from apache_beam.runners.worker import statesampler

            if not self.seen:
                return
            period = statesampler.get_current_tracker().sampling_period_ms
            span = [os.getpid(), self.started, time.monotonic(), period]
            path = os.path.join(self.folder, f"{os.getpid()}-{time.monotonic_ns()}.json")
            with open(path, "w") as handle:
                json.dump(span, handle)

    options = PipelineOptions(["--direct_num_workers=2", "--direct_running_mode=multi_processing"])
    runner = BoundedBundleFnApiRunner(max_bundle_bytes=MAX_BUNDLE_BYTES)
    with beam.Pipeline(runner=runner, options=options) as pipeline:
        _ = (
            pipeline
            | beam.Create([f"{index}{PAYLOAD}" for index in range(600)])
            | beam.ParDo(BundleSpans(str(tmp_path)))
        )
    assert runner._bundles_ahead == BUNDLES_AHEAD == 1
    spans = [json.loads(path.read_text()) for path in tmp_path.glob("*.json")]
    by_worker: dict[int, list] = {}
    for pid, started, ended, period in spans:
        by_worker.setdefault(pid, []).append((started, ended))
        assert period == STATE_SAMPLING_MS  # Beam's default would be 200 ms
    assert len(by_worker) == 2 and len(spans) >= 2 * BUNDLES_PER_WORKER
    for intervals in by_worker.values():  # one bundle at a time in each worker, though two were sent
        intervals.sort()
        assert all(ended <= next_started for (_, ended), (next_started, _) in zip(intervals, intervals[1:]))
