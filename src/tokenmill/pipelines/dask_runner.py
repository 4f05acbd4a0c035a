"""Beam's DaskRunner, completed so that tokenmill's pipelines run on a dask.distributed cluster.

Beam 2.77's DaskRunner mixes a multi-output ParDo's outputs, drops what finish_bundle emits, computes only
the last transform's bag and recomputes side inputs per task; this subclass keeps its options and transform
overrides and translates the pipeline into a Dask task graph of its own (per-tag outputs, a hash-shuffle
GroupByKey, lifted combines, side inputs as tasks, DoFns set up once per worker, counters, retries).
Without `--dask_client_address` it starts a LocalCluster for the run. What it refuses, and how memory,
shuffle and task counts grow (Dask suits clusters of tens of workers; Dataflow the largest runs):
docs/operations.md, "Dask".
"""

from __future__ import annotations

import logging
import operator
import tempfile
import threading
import uuid
import zlib
from collections.abc import Iterable
from typing import Any

import apache_beam as beam
from apache_beam import coders, pvalue
from apache_beam.internal import pickler
from apache_beam.metrics.execution import MetricsContainer
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.pipeline import PTransformOverride
from apache_beam.runners.common import DoFnRunner, Receiver
from apache_beam.runners.dask.dask_runner import DaskOptions
from apache_beam.runners.dask.dask_runner import DaskRunner as BeamDaskRunner
from apache_beam.runners.dask.overrides import (
    _Create,
    _Flatten,
    _GroupByKeyOnly,
    _Read,
    _Reshuffle,
    dask_overrides,
)
from apache_beam.runners.direct.direct_metrics import DirectMetrics
from apache_beam.runners.runner import PipelineResult, PipelineState
from apache_beam.runners.worker import statesampler
from apache_beam.transforms.sideinputs import SideInputMap
from apache_beam.transforms.window import GlobalWindows
from apache_beam.utils import counters
from apache_beam.utils.windowed_value import WindowedValue

log = logging.getLogger(__name__)

#: The pseudo-output that carries each bundle's metric updates back to the launcher.
_METRICS_TAG = "__tokenmill_metrics__"
#: Create's partitions when no --dask_npartitions / --dask_partition_size is given: one per element
#: (an input file each, in curate), up to this many.
MAX_CREATE_PARTITIONS = 1024


class TokenmillDaskOptions(PipelineOptions):
    @classmethod
    def _add_argparse_args(cls, parser) -> None:
        parser.add_argument(
            "--dask_local_workers",
            type=int,
            default=2,
            help="worker processes of the LocalCluster started when no --dask_client_address is given",
        )
        parser.add_argument(
            "--dask_shuffle_partitions",
            type=int,
            default=0,
            help="partitions each GroupByKey writes (default: twice the cluster's worker threads); its "
            "shuffle is (input partitions) x (these) small tasks",
        )
        parser.add_argument(
            "--dask_task_retries",
            type=int,
            default=2,
            help="times a failed task (a bundle) is retried before the run fails",
        )


class DaskRunner(BeamDaskRunner):
    """Executes a pipeline on a dask.distributed cluster (see the module docstring for what differs)."""

    def run_pipeline(self, pipeline, options):
        from dask import distributed

        dask_options = options.view_as(DaskOptions).get_all_options(drop_default=True, current_only=True)
        bag_kwargs = DaskOptions._extract_bag_kwargs(dask_options)
        ours = options.view_as(TokenmillDaskOptions)
        pipeline.replace_all(
            [_LiftCombinePerKey(), *dask_overrides()]
        )  # lifting first: its GroupByKey is overridden too
        # Translate once before any cluster starts: what cannot run is refused at once.
        pipeline.visit(_Translator(bag_kwargs, shuffle_partitions=1, run="check"))
        if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
            # The scheduler's and nannies' INFO lines (every connection, every worker) drown the run's.
            logging.getLogger("distributed").setLevel(logging.WARNING)
        cluster = None
        if not dask_options.get("address") and not dask_options.get("scheduler_file"):
            scratch = tempfile.TemporaryDirectory(prefix="tokenmill-dask-")
            cluster = distributed.LocalCluster(
                n_workers=max(1, ours.dask_local_workers),
                threads_per_worker=1,  # the work holds the GIL: processes, not threads, give parallelism
                processes=True,
                host="127.0.0.1",
                dashboard_address="127.0.0.1:0",  # its HTTP server stays on loopback, on a free port
                local_directory=scratch.name,
                # Task errors reach the launcher through the futures; what is left is shutdown noise.
                silence_logs=logging.CRITICAL,
            )
            cluster.scratch = scratch  # removed with the cluster
            dask_options["address"] = cluster.scheduler_address
        client = distributed.Client(**dask_options)
        try:
            if not client.nthreads():
                client.wait_for_workers(1, timeout=120)
            shuffle_partitions = ours.dask_shuffle_partitions or 2 * sum(client.nthreads().values())
            translator = _Translator(bag_kwargs, max(1, shuffle_partitions), run=uuid.uuid4().hex[:12])
            pipeline.visit(translator)
            leaves = translator.leaves()
            keys = [*leaves, *translator.metric_keys]
            futures = client.get(translator.tasks, keys, sync=False, retries=max(0, ours.dask_task_retries))
        except BaseException:
            DaskPipelineResult(client, cluster, [], [])._close()
            raise
        return DaskPipelineResult(client, cluster, futures[: len(leaves)], futures[len(leaves) :])


class DaskPipelineResult(PipelineResult):
    """Waits for every leaf of the graph; closes the client (and the cluster it started) at the end."""

    def __init__(self, client, cluster, leaves: list, metrics: list) -> None:
        super().__init__(PipelineState.RUNNING)
        self.client = client
        self.cluster = cluster
        self.leaves = leaves
        self.metric_futures = metrics
        self._metrics = DirectMetrics()

    def wait_until_finish(self, duration: int | None = None) -> str:
        if PipelineState.is_terminal(self._state):
            return self._state
        from dask import distributed

        try:
            metric_futures = set(self.metric_futures)
            timeout = duration / 1000 if duration is not None else None
            bundle = 0
            for future, result in distributed.as_completed(
                [*self.leaves, *self.metric_futures], timeout=timeout, with_results=True
            ):
                if future in metric_futures:  # one list of per-bundle updates per ParDo
                    for updates in result:
                        self._metrics.commit_logical(bundle, updates)
                        self._metrics.commit_physical(bundle, updates)
                        bundle += 1
            self._state = PipelineState.DONE
        except BaseException:
            self._state = PipelineState.FAILED
            raise
        finally:
            self._close()
        return self._state

    def cancel(self) -> str:
        self.client.cancel([*self.leaves, *self.metric_futures])
        self._state = PipelineState.CANCELLED
        self._close()
        return self._state

    def metrics(self) -> DirectMetrics:
        return self._metrics

    def _close(self) -> None:
        self.client.close()
        if self.cluster is not None:
            self.cluster.close()
            self.cluster.scratch.cleanup()


# ------------------------------------------------------------------------------------------ translation


class _LiftCombinePerKey(PTransformOverride):
    """CombinePerKey becomes Beam's LiftedCombinePerKey: each bundle combines its values per key before
    the shuffle (as Dataflow's combiner lifting does), so a key with millions of values moves one
    accumulator per bundle, and no task ever holds its values together."""

    def matches(self, applied_ptransform) -> bool:
        return type(applied_ptransform.transform) is beam.CombinePerKey

    def get_replacement_transform_for_applied_ptransform(self, applied_ptransform):
        from apache_beam.transforms.combiners import LiftedCombinePerKey

        transform = applied_ptransform.transform
        return LiftedCombinePerKey(transform.fn, transform.args, transform.kwargs)


class _Opaque:
    """A value carried into the task graph as it is (Dask looks inside tuples and lists for tasks)."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


def _unwrap(opaque: _Opaque) -> Any:
    return opaque.value


class _ParDoSpec:
    """What a task needs to run one ParDo over a bundle: one node of the graph per transform."""

    def __init__(self, run: str, label: str, fn: beam.DoFn, args: tuple, kwargs: dict, windowing: Any):
        self.run = run
        self.label = label
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.windowing = windowing
        self.side_inputs: list[tuple[type, dict]] = []  # (view class, view options) per side input


class _Translator(beam.pipeline.PipelineVisitor):
    """Turns the pipeline into a Dask task graph: each PCollection is a list of partition keys, each
    partition (a bundle) a list of WindowedValues; a ParDo task yields (output tag, value) pairs."""

    def __init__(self, bag_kwargs: dict, shuffle_partitions: int, run: str):
        self.bag_kwargs = bag_kwargs
        self.shuffle_partitions = shuffle_partitions
        self.run = run
        self.tasks: dict = {}
        self.partitions: dict[pvalue.PCollection, list] = {}
        self.consumed: set[pvalue.PCollection] = set()
        self.metric_keys: list = []  # per ParDo, a task gathering its bundles' metric updates
        self._gathered: dict[pvalue.PCollection, tuple] = {}
        self._names = 0

    def _name(self, what: str, label: str) -> str:
        self._names += 1  # keys are unique per run, so two runs can share a cluster
        return f"{what}-{self.run}-{self._names}-{label}"

    def visit_transform(self, node) -> None:
        transform = node.transform
        inputs = [value for value in node.inputs if isinstance(value, pvalue.PCollection)]
        for value in inputs:
            if not value.is_bounded:
                raise NotImplementedError(f"DaskRunner: {node.full_label} reads an unbounded PCollection")
            self.consumed.add(value)
        if isinstance(transform, _Create):
            partitions = self._create(node.full_label, list(transform.values))
        elif isinstance(transform, beam.Impulse):
            partitions = self._create(node.full_label, [b""])
        elif isinstance(transform, _GroupByKeyOnly):
            partitions = self._group_by_key(node.full_label, self.partitions[inputs[0]])
        elif isinstance(transform, _Flatten):
            partitions = [key for value in inputs for key in self.partitions[value]]
            partitions = partitions or self._create(node.full_label, [])
        elif isinstance(transform, _Reshuffle):
            partitions = self.partitions[inputs[0]]
        elif isinstance(transform, beam.ParDo):
            self._pardo(node, transform, inputs)
            return
        elif isinstance(transform, _Read):
            raise NotImplementedError(f"DaskRunner: {node.full_label}: beam.io.Read is not supported")
        else:
            raise NotImplementedError(
                f"DaskRunner: {node.full_label} ({type(transform).__name__}) has no Dask translation"
            )
        for output in node.outputs.values():
            self.partitions[output] = partitions

    def _create(self, label: str, values: list) -> list:
        if self.bag_kwargs.get("npartitions"):
            count = self.bag_kwargs["npartitions"]
        elif self.bag_kwargs.get("partition_size"):
            count = -(-len(values) // self.bag_kwargs["partition_size"])
        else:
            count = min(len(values), MAX_CREATE_PARTITIONS)
        count = max(1, min(count, len(values) or 1))
        name = self._name("create", label)
        bounds = [len(values) * index // count for index in range(count + 1)]
        for index in range(count):
            chunk = values[bounds[index] : bounds[index + 1]]
            self.tasks[(name, index)] = (_create_partition, _Opaque(chunk))
        return [(name, index) for index in range(count)]

    def _group_by_key(self, label: str, inputs: list) -> list:
        """All-to-all: each input partition splits by key hash into Q buckets; output q gathers bucket q
        of every input (P x Q small tasks, each bucket moving once)."""
        buckets = self.shuffle_partitions
        split, pick, merge = (self._name(what, label) for what in ("split", "bucket", "group"))
        coder = _Opaque(coders.FastPrimitivesCoder().as_deterministic_coder(label))
        for index, key in enumerate(inputs):
            self.tasks[(split, index)] = (_split, key, buckets, coder)
            for bucket in range(buckets):
                self.tasks[(pick, index, bucket)] = (operator.getitem, (split, index), bucket)
        for bucket in range(buckets):
            self.tasks[(merge, bucket)] = (_merge, [(pick, index, bucket) for index in range(len(inputs))])
        return [(merge, bucket) for bucket in range(buckets)]

    def _pardo(self, node, transform: beam.ParDo, inputs: list) -> None:
        from apache_beam.runners.common import DoFnSignature
        from apache_beam.transforms import userstate

        if userstate.is_stateful_dofn(transform.fn):
            raise NotImplementedError(f"DaskRunner: {node.full_label} is a stateful DoFn")
        if DoFnSignature(transform.fn).is_splittable_dofn():
            raise NotImplementedError(f"DaskRunner: {node.full_label} is a splittable DoFn")
        label = node.full_label
        spec = _ParDoSpec(
            self.run,
            label,
            transform.fn,
            tuple(transform.raw_side_inputs[0]),
            dict(transform.raw_side_inputs[1]),
            inputs[0].windowing,
        )
        side_keys = []
        for side_input in node.side_inputs:
            self.consumed.add(side_input.pvalue)
            spec.side_inputs.append((type(side_input), side_input._view_options()))
            side_keys.append(self._gather(side_input.pvalue, label))
        spec_key = (self._name("dofn", label),)
        self.tasks[spec_key] = (_unwrap, _Opaque(spec))
        bundles, metrics = self._name("pardo", label), self._name("metrics", label)
        for index, key in enumerate(self.partitions[inputs[0]]):
            self.tasks[(bundles, index)] = (_run_bundle, key, spec_key, *side_keys)
            self.tasks[(metrics, index)] = (_select_metrics, (bundles, index))
        count = len(self.partitions[inputs[0]])
        self.tasks[(metrics,)] = (_concat, [(metrics, index) for index in range(count)])
        self.metric_keys.append((metrics,))
        for tag, output in node.outputs.items():
            selected = self._name("output", f"{label}.{tag}")
            for index in range(count):
                self.tasks[(selected, index)] = (_select, (bundles, index), _Opaque(tag))
            self.partitions[output] = [(selected, index) for index in range(count)]

    def _gather(self, value: pvalue.PCollection, label: str) -> tuple:
        """One task holding a whole side input, computed once however many tasks read it."""
        if value not in self._gathered:
            key = (self._name("side", label),)
            self.tasks[key] = (_concat, list(self.partitions[value]))
            self._gathered[value] = key
        return self._gathered[value]

    def leaves(self) -> list:
        """One task per PCollection that nothing reads, done when all of its partitions are: waiting
        for them waits for the whole graph, and no element travels to the launcher."""
        keys = []
        for value, partitions in self.partitions.items():
            if value in self.consumed:
                continue
            done = self._name("done", value.producer.full_label if value.producer else "leaf")
            for index, key in enumerate(partitions):
                self.tasks[(done, index)] = (_discard, key)
            self.tasks[(done,)] = (_all_done, [(done, index) for index in range(len(partitions))])
            keys.append((done,))
        return keys


def _create_partition(values: _Opaque) -> list[WindowedValue]:
    return [GlobalWindows.windowed_value(value) for value in values.value]


def _split(elements: Iterable[WindowedValue], buckets: int, coder: _Opaque) -> list[list]:
    # Keys are compared by their encoding, as Beam compares them; crc32 of it is stable across processes.
    split: list[list] = [[] for _ in range(buckets)]
    encode = coder.value.encode
    for element in elements:
        key, value = element.value
        encoded = encode(key)
        split[zlib.crc32(encoded) % buckets].append((encoded, key, value))
    return split


def _merge(buckets: list[list]) -> list[WindowedValue]:
    groups: dict[bytes, tuple[Any, list]] = {}
    for bucket in buckets:
        for encoded, key, value in bucket:
            groups.setdefault(encoded, (key, []))[1].append(value)
    # Each value went through ReifyWindows: a WindowedValue, as GroupAlsoByWindow expects.
    return [GlobalWindows.windowed_value(group) for _, group in sorted(groups.items())]


def _concat(parts: list[list]) -> list:
    return [element for part in parts for element in part]


def _select(pairs: list[tuple], tag: _Opaque) -> list:
    return [value for pair_tag, value in pairs if pair_tag == tag.value]


def _select_metrics(pairs: list[tuple]) -> list:
    return [value for pair_tag, value in pairs if pair_tag == _METRICS_TAG]


def _discard(_: list) -> None:
    return None


def _all_done(_: list) -> None:
    return None


# -------------------------------------------------------------------------------------------- execution


class _TagReceiver(Receiver):
    def __init__(self, tag, sink: list):
        self.tag = tag
        self.sink = sink

    def receive(self, windowed_value: WindowedValue) -> None:
        self.sink.append((self.tag, windowed_value))


class _Receivers(dict):
    """Receivers by output tag (None: the main output), made on first use, all writing to one list."""

    def __init__(self):
        super().__init__()
        self.outputs: list = []

    def __missing__(self, tag):
        receiver = self[tag] = _TagReceiver(tag, self.outputs)
        return receiver


class _SetUpDoFn:
    """A DoFn that has been set up, with the runner that feeds it bundles."""

    def __init__(self, spec: _ParDoSpec, fn: beam.DoFn, side_values: tuple):
        self.receivers = _Receivers()
        side_inputs = [
            SideInputMap(view_class, view_options, values)
            for (view_class, view_options), values in zip(spec.side_inputs, side_values, strict=True)
        ]
        self.runner = DoFnRunner(
            fn,
            spec.args,
            spec.kwargs,
            side_inputs,
            spec.windowing,
            tagged_receivers=self.receivers,
            step_name=spec.label,
        )
        self.runner.setup()


class _DoFnPool:
    """DoFns set up in this worker process, by run and transform, each used by one bundle at a time.

    Beam reuses a DoFn across bundles; so does this pool, so that setup() (which loads models) runs once
    per process and thread, not once per task. A new run's first task tears down an earlier run's DoFns.
    """

    def __init__(self):
        self.lock = threading.Lock()
        self.run: str | None = None
        self.idle: dict[str, list[_SetUpDoFn]] = {}

    def take(self, spec: _ParDoSpec, side_values: tuple) -> _SetUpDoFn:
        with self.lock:
            if self.run != spec.run:
                stale = [dofn for dofns in self.idle.values() for dofn in dofns]
                self.run, self.idle = spec.run, {}
            else:
                stale = []
            idle = self.idle.get(spec.label)
            taken = idle.pop() if idle else None
        for dofn in stale:
            _teardown(dofn)
        if taken is not None:
            return taken
        # A fresh copy: the spec's DoFn may be shared with other tasks of this process.
        return _SetUpDoFn(spec, pickler.loads(pickler.dumps(spec.fn)), side_values)

    def give_back(self, spec: _ParDoSpec, dofn: _SetUpDoFn) -> None:
        with self.lock:
            if self.run == spec.run:
                self.idle.setdefault(spec.label, []).append(dofn)
                return
        _teardown(dofn)


def _teardown(dofn: _SetUpDoFn) -> None:
    try:
        dofn.runner.teardown()
    except Exception:  # teardown is best effort in Beam too
        log.warning("DoFn teardown failed", exc_info=True)


_POOL = _DoFnPool()
_THREAD = threading.local()


def _metrics_scope(label: str):
    """(scoped state, metrics container) of a transform in this thread: Beam counters update the
    container of the thread's current state. The sampler keeps one state per transform with the
    container it was first given, so the container is kept too and emptied after each bundle."""
    if getattr(_THREAD, "tracker", None) is None:
        _THREAD.tracker = statesampler.StateSampler("", counters.CounterFactory())
        _THREAD.scopes = {}
    statesampler.set_current_tracker(_THREAD.tracker)
    if label not in _THREAD.scopes:
        container = MetricsContainer(label)
        state = _THREAD.tracker.scoped_state(label, "process", metrics_container=container)
        _THREAD.scopes[label] = (state, container)
    return _THREAD.scopes[label]


def _run_bundle(elements: Iterable[WindowedValue], spec: _ParDoSpec, *side_values) -> list[tuple]:
    """Run one bundle (a Dask partition) through the ParDo: (tag, WindowedValue) pairs, then metrics."""
    dofn = _POOL.take(spec, side_values)
    state, container = _metrics_scope(spec.label)
    container.reset()  # what a failed attempt counted before is not this bundle's
    try:
        with state:
            dofn.runner.start()
            for element in elements:
                dofn.runner.process(element)
            dofn.runner.finish()  # after process: what finish_bundle emits belongs to this bundle
    except BaseException:
        dofn.receivers.outputs.clear()
        _teardown(dofn)  # a DoFn that failed mid-bundle is not reused
        raise
    outputs = list(dofn.receivers.outputs)
    dofn.receivers.outputs.clear()
    _POOL.give_back(spec, dofn)
    outputs.append((_METRICS_TAG, container.get_cumulative()))
    return outputs
