"""Beam's local runner (FnApiRunner) with bundles of bounded size, so a worker's memory does not grow with
the corpus.

With several SDK worker processes, FnApiRunner's ParallelBundleManager splits each stage's whole input
into exactly one part per worker and writes each part to its worker's data channel before the bundle
starts: a worker holds 1/W of the stage's input at once (a probe saw 4-6 MiB messages at 5k documents,
20-30 MiB at 20k), and glibc keeps the freed buffers, so the worker's peak grows with the corpus.
Dataflow workers read bundles of bounded size instead. Here each stage's input is cut into bundles of at
most `max_bundle_bytes` (encoded; 8 MiB by default, about 3,000 web documents: per-bundle costs vanish,
and a stage of 10k documents already fills its bundles), as many as that takes and at least
BUNDLES_PER_WORKER per worker where there are as many elements, and every worker process runs one bundle
at a time, taking the next one when it is free. The runner (the launcher process) still holds every
stage's input and output, as before: it is this runner's shuffle, what Dataflow's shuffle service holds
on Dataflow.

Bundles are cut between the runner's data chunks (each a worker's output flushed at about 10 MB) or,
when a stage has fewer chunks than bundles, between elements; a GroupByKey's output between keys, so one
key's group is never split (a group larger than the bound is one bundle). What a pipeline computes does
not depend on its bundles, so the output is the same as with Beam's own split.

The worker processes start with glibc's `MALLOC_ARENA_MAX=2` (unless the environment sets it): an SDK
worker runs its bundles and its gRPC channels on several threads, glibc gives each thread that contends
an arena of its own (up to 8 per core), and memory freed in one arena is not reused by another, so a
worker's resident memory crept up stage after stage with the corpus (curate_scale's web recipe: 615 MiB
at 10k, 797 at 40k; 620 at 40k with two arenas).

Memory at 10 TB: this is a one-machine runner; per worker process, one bundle (`max_bundle_bytes`) in
flight plus what its DoFns hold, whatever the corpus; the launcher holds a stage's data whole.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
from collections.abc import Mapping

from apache_beam.metrics import monitoring_infos
from apache_beam.portability.api import beam_fn_api_pb2
from apache_beam.runners.portability.fn_api_runner import execution
from apache_beam.runners.portability.fn_api_runner.fn_runner import (
    BundleManager,
    FnApiRunner,
    ParallelBundleManager,
)

#: The most encoded input bytes one bundle sends a worker (a stage's input is cut into as many bundles).
MAX_BUNDLE_BYTES = 8 << 20
#: A stage's input is cut into at least this many bundles per worker (where it has as many elements): a
#: stage waits for its slowest worker, and with one bundle per worker a worker that finishes first idles
#: for the rest; with four, at most about a quarter of one bundle's time. The price: a stage whose input
#: came in fewer data chunks (about 10 MB each) than that is re-cut between elements, which decodes and
#: re-encodes it once in the launcher (stages under about 80 MB for 2 workers; larger ones are cut as
#: they came).
BUNDLES_PER_WORKER = 4
#: glibc malloc arenas per worker process (MALLOC_ARENA_MAX), where the environment does not set it.
WORKER_MALLOC_ARENAS = "2"
#: A GroupByKey's output is first cut into parts of about this many values, then parts are packed into
#: bundles of at most MAX_BUNDLE_BYTES (its grouped values are only encoded when it is cut).
GROUPED_VALUES_PER_PART = 1024


class BoundedBundleFnApiRunner(FnApiRunner):
    """FnApiRunner whose parallel stages run in bundles of at most `max_bundle_bytes` of input each."""

    def __init__(self, max_bundle_bytes: int = MAX_BUNDLE_BYTES, **kwargs) -> None:
        super().__init__(**kwargs)
        if max_bundle_bytes <= 0:
            raise ValueError(f"max_bundle_bytes must be positive, not {max_bundle_bytes}")
        self.max_bundle_bytes = max_bundle_bytes

    def run_pipeline(self, pipeline, options):
        # SDK worker processes inherit the launcher's environment (Beam's SubprocessSdkWorker), and glibc
        # reads this once, at a process's start: set before the first stage starts them.
        os.environ.setdefault("MALLOC_ARENA_MAX", WORKER_MALLOC_ARENAS)
        return super().run_pipeline(pipeline, options)

    def _get_bundle_manager(self, bundle_context_manager: execution.BundleContextManager) -> BundleManager:
        manager = super()._get_bundle_manager(bundle_context_manager)
        if type(manager) is ParallelBundleManager:  # stateful and single-worker stages keep Beam's manager
            return BoundedParallelBundleManager(
                bundle_context_manager,
                self._progress_frequency,
                cache_token_generator=manager._cache_token_generator,
                max_bundle_bytes=self.max_bundle_bytes,
            )
        return manager


class _PinnedBundleManager(BundleManager):
    """Beam's BundleManager sending its bundle to one given worker: BundleManager picks a worker from a
    global counter, which can give two concurrent bundles to one worker and leave another idle."""

    def __init__(self, worker_handler, *args, **kwargs) -> None:
        self._pinned = worker_handler
        super().__init__(*args, **kwargs)

    @property
    def _worker_handler(self):
        return self._pinned

    @_worker_handler.setter
    def _worker_handler(self, _ignored) -> None:
        pass  # process_bundle assigns the counter's pick: the pinned worker stays


def _cut(coder_impl, chunks: list[bytes], parts: int) -> list[bytes]:
    """Encoded elements re-cut between elements into `parts` pieces (Beam's ListBuffer cuts between
    elements when asked for more parts than it has chunks)."""
    buffer = execution.ListBuffer(coder_impl)
    buffer._inputs = list(chunks)
    return [piece for part in buffer.partition(max(parts, len(chunks) + 1)) for piece in part if piece]


class BoundedParallelBundleManager(ParallelBundleManager):
    """Runs one stage: its input cut into bundles of bounded size, each worker running one at a time."""

    def __init__(self, *args, max_bundle_bytes: int = MAX_BUNDLE_BYTES, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.max_bundle_bytes = max_bundle_bytes

    def _pieces(self, buffer, bundles_needed: int) -> list[bytes]:
        """The buffer's encoded elements as byte pieces of at most max_bundle_bytes (unless one element
        is larger), at least `bundles_needed` of them where there are as many elements."""
        if isinstance(buffer, execution.GroupingBuffer):
            coder_impl = buffer._post_grouped_coder.get_impl()
            table = buffer._table
            if not buffer._grouped_output:  # first cut between keys (values are not encoded until then)
                values = sum(len(group) for group in table.values())
                parts = max(bundles_needed, -(-values // GROUPED_VALUES_PER_PART))
                parts = max(1, min(parts, len(table) or 1))
            else:
                parts = 1  # already cut (a GroupingBuffer is cut once): its parts as they are
            chunks = [piece for part in buffer.partition(parts) for piece in part if piece]
        elif isinstance(buffer, execution.ListBuffer):
            coder_impl = buffer._coder_impl
            chunks = [chunk for chunk in buffer if chunk]
        else:
            return [chunk for chunk in buffer if chunk]
        total = sum(len(chunk) for chunk in chunks)
        wanted = max(bundles_needed, -(-total // self.max_bundle_bytes))
        if chunks and len(chunks) < wanted:
            return _cut(coder_impl, chunks, wanted)
        pieces = []
        for chunk in chunks:
            if len(chunk) > self.max_bundle_bytes:
                pieces.extend(_cut(coder_impl, [chunk], -(-len(chunk) // self.max_bundle_bytes)))
            else:
                pieces.append(chunk)
        return pieces

    def _bundles(self, inputs: Mapping[str, execution.PartitionableBuffer]) -> list[dict[str, list[bytes]]]:
        workers = self._num_workers
        wanted = workers * BUNDLES_PER_WORKER
        pieces = [(name, piece) for name, buffer in inputs.items() for piece in self._pieces(buffer, wanted)]
        total = sum(len(piece) for _, piece in pieces)
        # Small inputs still spread over every worker, in a few bundles each so that a worker done early
        # takes more; large ones in bundles of at most max_bundle_bytes.
        target = max(1, min(self.max_bundle_bytes, -(-total // wanted)))
        bundles: list[dict[str, list[bytes]]] = []
        size = target
        for name, piece in pieces:
            if size + len(piece) > target and (not bundles or size > 0):
                bundles.append({input_name: [] for input_name in inputs})
                size = 0
            bundles[-1][name].append(piece)
            size += len(piece)
        while len(bundles) < workers:  # as Beam does: every worker runs the stage, some with no input
            bundles.append({input_name: [] for input_name in inputs})
        return bundles

    def process_bundle(
        self,
        inputs: Mapping[str, execution.PartitionableBuffer],
        expected_outputs,
        fired_timers,
        expected_output_timers,
        dry_run: bool = False,
    ):
        bundles = self._bundles(inputs)
        work: queue.SimpleQueue = queue.SimpleQueue()
        for index, bundle in enumerate(bundles):
            work.put(
                (index, bundle, fired_timers if index == 0 else {})
            )  # timers go to one bundle, as in Beam
        results: list = [None] * len(bundles)
        errors: list[BaseException] = []

        def run_on(worker_handler) -> None:
            while not errors:
                try:
                    index, bundle, timers = work.get_nowait()
                except queue.Empty:
                    return
                manager = _PinnedBundleManager(
                    worker_handler,
                    self.bundle_context_manager,
                    self._progress_frequency,
                    cache_token_generator=self._cache_token_generator,
                )
                try:
                    results[index] = manager.process_bundle(
                        bundle, expected_outputs, timers, expected_output_timers, dry_run
                    )
                except BaseException as error:  # the first failure fails the stage, as in Beam
                    errors.append(error)
                    return

        handlers = self.bundle_context_manager.worker_handlers[: self._num_workers]
        threads = [threading.Thread(target=run_on, args=(handler,), daemon=True) for handler in handlers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        merged = None
        split_results: list = []
        for result, split_result in results:
            split_results += split_result
            if merged is None:
                merged = result
            else:
                merged = beam_fn_api_pb2.InstructionResponse(
                    process_bundle=beam_fn_api_pb2.ProcessBundleResponse(
                        monitoring_infos=monitoring_infos.consolidate(
                            itertools.chain(
                                result.process_bundle.monitoring_infos, merged.process_bundle.monitoring_infos
                            )
                        )
                    ),
                    error=result.error or merged.error,
                )
        return merged, split_results
