"""Beam's local runner (FnApiRunner) with bundles of bounded size, so a worker's memory does not grow with
the corpus.

With several SDK worker processes, FnApiRunner's ParallelBundleManager splits each stage's whole input
into exactly one part per worker and writes each part to its worker's data channel before the bundle
starts: a worker holds 1/W of the stage's input at once (a probe saw 4-6 MiB messages at 5k documents,
20-30 MiB at 20k), and glibc keeps the freed buffers, so the worker's peak grows with the corpus.
Dataflow workers read bundles of bounded size instead. Here each stage's input is cut into bundles of at
most `max_bundle_bytes` (encoded; 8 MiB by default, about 3,000 web documents: per-bundle costs vanish,
and a stage of 10k documents already fills its bundles), as many as that takes and at least
BUNDLES_PER_WORKER per worker where there are as many elements, shrinking toward the stage's end
(`pack_bundles`), and every worker process runs one bundle at a time, with the next one already sent
to it (BUNDLES_AHEAD), so it starts that one the moment it finishes. The runner (the launcher process)
still holds every
stage's input and output, as before: it is this runner's shuffle, what Dataflow's shuffle service holds
on Dataflow.

Bundles are cut between the runner's data chunks (each a worker's output flushed at about 10 MB) or,
when a stage has fewer chunks than bundles, between elements; a GroupByKey's output between keys, so one
key's group is never split (a group larger than the bound is one bundle). What a pipeline computes does
not depend on its bundles, so the output is the same as with Beam's own split.

Each worker process runs tokenmill.pipelines.local_worker (Beam's worker main, taking bundles sent ahead
in turn, then an exit without the interpreter's teardown), and where the command started a warm pool
(tokenmill.pipelines.warm_workers) the runner gives each of its worker slots a worker forked from the
pool's template, already past its imports, instead of starting a cold one.

The worker processes start with glibc's `MALLOC_ARENA_MAX=2` (unless the environment sets it): an SDK
worker runs its bundles and its gRPC channels on several threads, glibc gives each thread that contends
an arena of its own (up to 8 per core), and memory freed in one arena is not reused by another, so a
worker's resident memory crept up stage after stage with the corpus (curate_scale's web recipe: 615 MiB
at 10k, 797 at 40k; 620 at 40k with two arenas).

Memory at 10 TB: this is a one-machine runner; per worker process, one bundle (`max_bundle_bytes`) in
flight and one bundle's input waiting, plus what its DoFns hold, whatever the corpus; the launcher holds
a stage's data whole.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import sys
import threading
from collections.abc import Mapping

import grpc
from apache_beam.metrics import monitoring_infos
from apache_beam.portability import python_urns
from apache_beam.portability.api import (
    beam_fn_api_pb2,
    beam_fn_api_pb2_grpc,
    beam_runner_api_pb2,
    endpoints_pb2,
)
from apache_beam.runners.portability.fn_api_runner import execution
from apache_beam.runners.portability.fn_api_runner.fn_runner import (
    BundleManager,
    FnApiRunner,
    ParallelBundleManager,
)
from apache_beam.runners.portability.fn_api_runner.worker_handlers import (
    SubprocessSdkWorkerHandler,
    WorkerHandler,
)
from apache_beam.runners.portability.local_job_service import BeamFnLoggingServicer, SubprocessSdkWorker
from apache_beam.utils import thread_pool_executor
from google.protobuf import json_format, text_format

from tokenmill.pipelines.warm_workers import WORKER_MALLOC_ARENAS, WORKER_MODULE, WarmWorkers, pool

#: The most encoded input bytes one bundle sends a worker (a stage's input is cut into as many bundles).
MAX_BUNDLE_BYTES = 8 << 20
#: A stage's input is cut into at least this many bundles per worker (where it has as many elements): a
#: stage waits for its slowest worker, and with one bundle per worker a worker that finishes first idles
#: for the rest; with four, at most about a quarter of one bundle's time. The price: a stage whose input
#: came in fewer data chunks (about 10 MB each) than that is re-cut between elements, which decodes and
#: re-encodes it once in the launcher (stages under about 80 MB for 2 workers; larger ones are cut as
#: they came).
BUNDLES_PER_WORKER = 4
#: Bundles sent to a worker ahead of the one it runs, where the workers run tokenmill's worker main
#: (which makes them wait their turn: tokenmill.pipelines.local_worker): a worker then starts its next
#: bundle the moment it finishes one, instead of idling while the outputs go back and the next input
#: comes (about 6% of the filter stage's worker time on the curate bench, without it).
BUNDLES_AHEAD = 1
#: The command Beam's FnApiRunner starts each SDK worker process with, and the one this runner uses.
BEAM_WORKER_COMMAND = f"{sys.executable} -m apache_beam.runners.worker.sdk_worker_main".encode()
WORKER_COMMAND = f"{sys.executable} -m {WORKER_MODULE}".encode()
#: The environment of workers taken from a warm pool (a JSON payload: the cold command, the pool's id).
WARM_SUBPROCESS_URN = "tokenmill:env:warm_subprocess_python:v1"
#: A GroupByKey's output is first cut into parts of about this many values, then parts are packed into
#: bundles of at most MAX_BUNDLE_BYTES (its grouped values are only encoded when it is cut).
GROUPED_VALUES_PER_PART = 256


class BoundedBundleFnApiRunner(FnApiRunner):
    """FnApiRunner whose parallel stages run in bundles of at most `max_bundle_bytes` of input each, on
    `warm_workers` where given (closed when the run ends)."""

    def __init__(
        self, max_bundle_bytes: int = MAX_BUNDLE_BYTES, warm_workers: WarmWorkers | None = None, **kwargs
    ) -> None:
        super().__init__(**kwargs)
        if max_bundle_bytes <= 0:
            raise ValueError(f"max_bundle_bytes must be positive, not {max_bundle_bytes}")
        self.max_bundle_bytes = max_bundle_bytes
        self.warm_workers = warm_workers
        self._bundles_ahead = 0

    def run_pipeline(self, pipeline, options):
        # SDK worker processes inherit the launcher's environment (Beam's SubprocessSdkWorker), and glibc
        # reads this once, at a process's start: set before the first stage starts them.
        os.environ.setdefault("MALLOC_ARENA_MAX", WORKER_MALLOC_ARENAS)
        try:
            return super().run_pipeline(pipeline, options)
        finally:
            if self.warm_workers is not None:
                self.warm_workers.close()

    def run_via_runner_api(self, pipeline_proto, options):
        pool_id = self.warm_workers.pool_id if self.warm_workers is not None else None
        self._bundles_ahead = BUNDLES_AHEAD if use_tokenmill_worker(pipeline_proto, pool_id) else 0
        return super().run_via_runner_api(pipeline_proto, options)

    def _get_bundle_manager(self, bundle_context_manager: execution.BundleContextManager) -> BundleManager:
        manager = super()._get_bundle_manager(bundle_context_manager)
        if type(manager) is ParallelBundleManager:  # stateful and single-worker stages keep Beam's manager
            return BoundedParallelBundleManager(
                bundle_context_manager,
                self._progress_frequency,
                cache_token_generator=manager._cache_token_generator,
                max_bundle_bytes=self.max_bundle_bytes,
                bundles_ahead=self._bundles_ahead,
            )
        return manager


class _PinnedBundleManager(BundleManager):
    """Beam's BundleManager sending its bundle to one given worker: BundleManager picks a worker from a
    global counter, which can give two concurrent bundles to one worker and leave another idle. Where
    `after` is given, the bundle's input is written once that event is set, and `inputs_sent` is set
    once it has been written (or the bundle failed before)."""

    def __init__(
        self,
        worker_handler,
        *args,
        after: threading.Event | None = None,
        inputs_sent: threading.Event | None = None,
        **kwargs,
    ) -> None:
        self._pinned = worker_handler
        self._after = after
        self._inputs_sent = inputs_sent if inputs_sent is not None else threading.Event()
        self._inputs_left = 0
        super().__init__(*args, **kwargs)

    @property
    def _worker_handler(self):
        return self._pinned

    @_worker_handler.setter
    def _worker_handler(self, _ignored) -> None:
        pass  # process_bundle assigns the counter's pick: the pinned worker stays

    def process_bundle(self, inputs, *args, **kwargs):
        if self._after is not None:
            self._after.wait()
        self._inputs_left = len(inputs)
        if not inputs:
            self._inputs_sent.set()
        try:
            return super().process_bundle(inputs, *args, **kwargs)
        finally:
            self._inputs_sent.set()

    def _send_input_to_worker(self, process_bundle_id: str, read_transform_id: str, byte_streams) -> None:
        super()._send_input_to_worker(process_bundle_id, read_transform_id, byte_streams)
        self._inputs_left -= 1
        if self._inputs_left <= 0:
            self._inputs_sent.set()


def _set_event() -> threading.Event:
    event = threading.Event()
    event.set()
    return event


def _cut(coder_impl, chunks: list[bytes], parts: int) -> list[bytes]:
    """Encoded elements re-cut between elements into `parts` pieces (Beam's ListBuffer cuts between
    elements when asked for more parts than it has chunks)."""
    buffer = execution.ListBuffer(coder_impl)
    buffer._inputs = list(chunks)
    return [piece for part in buffer.partition(max(parts, len(chunks) + 1)) for piece in part if piece]


def use_tokenmill_worker(pipeline_proto: beam_runner_api_pb2.Pipeline, pool_id: str | None = None) -> bool:
    """Beam's own worker command (what --direct_running_mode=multi_processing gives) becomes the same
    worker without the interpreter's teardown at its end (tokenmill.pipelines.local_worker), taken from
    the warm pool `pool_id` where one is given; a command the pipeline set itself is kept. True where
    every worker process of the pipeline is then tokenmill's (and takes bundles sent ahead in turn)."""
    ours = others = 0
    for environment in pipeline_proto.components.environments.values():
        if environment.urn != python_urns.SUBPROCESS_SDK or environment.payload != BEAM_WORKER_COMMAND:
            others += 1
        elif pool_id is None:
            environment.payload = WORKER_COMMAND
            ours += 1
        else:
            environment.urn = WARM_SUBPROCESS_URN
            environment.payload = json.dumps({"command": WORKER_COMMAND.decode(), "pool": pool_id}).encode()
            ours += 1
    return ours > 0 and not others


@WorkerHandler.register_environment(WARM_SUBPROCESS_URN, bytes)
class WarmSubprocessSdkWorkerHandler(SubprocessSdkWorkerHandler):
    """Beam's subprocess worker handler, whose worker is a warm process from the pool where one is left."""

    def __init__(self, payload: bytes, state, provision_info, grpc_server) -> None:
        spec = json.loads(payload)
        super().__init__(spec["command"].encode(), state, provision_info, grpc_server)
        self._pool_id = spec["pool"]

    def start_worker(self) -> None:
        warm = pool(self._pool_id)
        process = warm.take() if warm is not None else None
        if process is None:
            super().start_worker()
            return
        self.worker = _WarmSdkWorker(process, self.control_address, self.provision_info, self.worker_id)
        self.worker_thread = threading.Thread(name="run_worker", target=self.worker.run)
        self.worker_thread.start()


class _WarmSdkWorker(SubprocessSdkWorker):
    """Beam's SubprocessSdkWorker.run with the job's addresses handed to a warm pool's template, which
    forks the worker (a ForkedWorker stands in for the child process)."""

    def __init__(self, process, control_address, provision_info, worker_id) -> None:
        super().__init__(WORKER_COMMAND, control_address, provision_info, worker_id)
        self._process = process

    def run(self) -> None:
        options = [("grpc.http2.max_pings_without_data", 0), ("grpc.http2.max_ping_strikes", 0)]
        logging_server = grpc.server(thread_pool_executor.shared_unbounded_instance(), options=options)
        logging_port = logging_server.add_insecure_port("[::]:0")
        logging_server.start()
        beam_fn_api_pb2_grpc.add_BeamFnLoggingServicer_to_server(BeamFnLoggingServicer(), logging_server)
        environment = {
            "CONTROL_API_SERVICE_DESCRIPTOR": text_format.MessageToString(
                endpoints_pb2.ApiServiceDescriptor(url=self._control_address)
            ),
            "LOGGING_API_SERVICE_DESCRIPTOR": text_format.MessageToString(
                endpoints_pb2.ApiServiceDescriptor(url=f"localhost:{logging_port}")
            ),
            "PIPELINE_OPTIONS": json_format.MessageToJson(
                self._provision_info.provision_info.pipeline_options
            ),
        }
        if self._worker_id:
            environment["WORKER_ID"] = self._worker_id
        process = self._process
        try:
            process.start(environment)
            process.wait()
            if process.returncode:
                raise RuntimeError(f"Worker subprocess exited with return code {process.returncode}")
        finally:
            if process.poll() is None:
                process.kill()
            logging_server.stop(0)


def pack_bundles(
    pieces: list[tuple[str, bytes]], input_names: list[str], wanted: int, max_bundle_bytes: int
) -> list[dict[str, list[bytes]]]:
    """(input name, encoded piece) pairs packed, in order, into bundles {input name: pieces}.

    Guided scheduling: each new bundle takes a 1/`wanted` share of the bytes still to pack (at most
    `max_bundle_bytes`, at least one piece), so bundles shrink toward the stage's end and the last ones
    the workers take are small: a stage waits for its slowest worker, and a worker that finishes first
    idles for at most one small bundle's time. About `wanted` x ln(bytes / smallest piece) bundles.
    """
    remaining = sum(len(piece) for _, piece in pieces)
    bundles: list[dict[str, list[bytes]]] = []
    size = target = 0
    for name, piece in pieces:
        if not bundles or (size > 0 and size + len(piece) > target):
            bundles.append({input_name: [] for input_name in input_names})
            size = 0
            target = max(1, min(max_bundle_bytes, -(-remaining // wanted)))
        bundles[-1][name].append(piece)
        size += len(piece)
        remaining -= len(piece)
    return bundles


class BoundedParallelBundleManager(ParallelBundleManager):
    """Runs one stage: its input cut into bundles of bounded size, each worker running one at a time,
    with `bundles_ahead` more sent to it and waiting (where its worker process waits them in turn)."""

    def __init__(
        self, *args, max_bundle_bytes: int = MAX_BUNDLE_BYTES, bundles_ahead: int = 0, **kwargs
    ) -> None:
        super().__init__(*args, **kwargs)
        self.max_bundle_bytes = max_bundle_bytes
        self.bundles_ahead = bundles_ahead

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
        bundles = pack_bundles(pieces, list(inputs), wanted, self.max_bundle_bytes)
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
        # Timers go to one bundle, as in Beam.
        work = collections.deque(
            (index, bundle, fired_timers if index == 0 else {}) for index, bundle in enumerate(bundles)
        )
        results: list = [None] * len(bundles)
        errors: list[BaseException] = []
        taking = threading.Lock()
        handlers = self.bundle_context_manager.worker_handlers[: self._num_workers]
        running = {id(handler): 0 for handler in handlers}
        # A worker's bundles reach it in the order they were taken: each one's input is written once the
        # one before it has written all of its own (so a running bundle's input is never behind another's).
        last_sent = {id(handler): _set_event() for handler in handlers}

        def run_on(worker_handler) -> None:
            key = id(worker_handler)
            while not errors:
                with taking:
                    # A bundle sent ahead is one that no other worker can take: send one only while
                    # every worker still has one to take after it.
                    if not work or (running[key] and len(work) < len(handlers)):
                        return
                    index, bundle, timers = work.popleft()
                    running[key] += 1
                    after, last_sent[key] = last_sent[key], threading.Event()
                    inputs_sent = last_sent[key]
                manager = _PinnedBundleManager(
                    worker_handler,
                    self.bundle_context_manager,
                    self._progress_frequency,
                    cache_token_generator=self._cache_token_generator,
                    after=after,
                    inputs_sent=inputs_sent,
                )
                try:
                    results[index] = manager.process_bundle(
                        bundle, expected_outputs, timers, expected_output_timers, dry_run
                    )
                except BaseException as error:  # the first failure fails the stage, as in Beam
                    errors.append(error)
                    return
                finally:
                    with taking:
                        running[key] -= 1

        threads = [
            threading.Thread(target=run_on, args=(handler,), daemon=True)
            for handler in handlers
            for _ in range(1 + self.bundles_ahead)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        # One pass over every bundle's metrics (merging them bundle by bundle re-read the merged list
        # each time: 0.5 s of the launcher's time between stages on the curate bench, 30 bundles a stage).
        split_results = [split for _, splits in results for split in splits]
        responses = [result for result, _ in results]
        merged = beam_fn_api_pb2.InstructionResponse(
            process_bundle=beam_fn_api_pb2.ProcessBundleResponse(
                monitoring_infos=monitoring_infos.consolidate(
                    itertools.chain.from_iterable(
                        response.process_bundle.monitoring_infos for response in responses
                    )
                )
            ),
            error=next((response.error for response in reversed(responses) if response.error), ""),
        )
        return merged, split_results
