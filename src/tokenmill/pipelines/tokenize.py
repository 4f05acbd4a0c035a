"""The tokenize pipeline: curated Parquet cells to token shards, manifests and tokens/counts.json.

Beam elements are shard tasks, one per curated Parquet file: the n-th file (sorted) of a cell becomes that
cell's part-<n> shard. A DoFn loads the tokenizer once per worker (setup), keeps a shard that is complete
and verified, or else tokenizes the file in batches with `encode_batch` and streams the ids to disk
(tokenmill.tokenize.writer). The done markers then flow to a per-cell step that writes manifest.json, and
from there to one step that writes counts.json, so the catalog appears only once every shard is in place.

With held-out slices (the default; docs/tokenize.md, "Held-out slices") a first pass runs before that:
each file's candidates (tokenmill.tokenize.heldout) are tokenized, combined per cell into the cell's slice
(a CombinePerKey whose accumulator holds at most the slice, so it is lifted before the shuffle: the shuffle
carries per bundle and cell at most `max_tokens` tokens), and written as `<cell>/heldout/`; each cell's last
held-out key then reaches the shard tasks as a side input (a few bytes per cell), so the training shards
leave the slice out. The first pass reads every file once more (id and text columns) and tokenizes only
the candidates: about the rule's fraction of the tokenizing work.

The same graph runs on Beam's local FnApiRunner (SDK worker processes on this machine) and on Dataflow.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

import apache_beam as beam
from apache_beam.metrics import Metrics

from tokenmill import storage
from tokenmill.cells import parse_cell
from tokenmill.formats.tokens import (
    BYTES_SUFFIX,
    COUNTS,
    DONE_SUFFIX,
    HELDOUT_DIR,
    MANIFEST,
    HeldoutRule,
    ShardMarker,
    read_counts,
)
from tokenmill.tokenize.heldout import SliceAccumulator, select
from tokenmill.tokenize.shards import DTYPES, INDEX_DTYPE
from tokenmill.tokenize.tokenizer import (
    TokenizerInfo,
    read_tokenizer_bytes,
    sha256_bytes,
    tokenizer_from_bytes,
)
from tokenmill.tokenize.writer import (
    DEFAULT_BATCH_DOCUMENTS,
    ShardTask,
    process_shard,
    read_marker,
    select_file,
    write_counts,
    write_heldout,
    write_manifest,
)

log = logging.getLogger(__name__)
METRICS_NAMESPACE = "tokenmill.tokenize"
CORES_PER_WORKER = 8


def default_local_workers() -> int:
    """Local worker processes when --workers is not given: one per 8 cores.

    Each worker's encode_batch already runs on every core; more processes only add a Beam start-up each
    (about a CPU second) and overlap the single-threaded Python work around encode_batch (reading Parquet,
    collecting ids, hashing), which is a small fraction of it. One Python thread keeps about 8 cores busy.
    """
    return max(1, (os.cpu_count() or 1) // CORES_PER_WORKER)


class TokenizeError(ValueError):
    """A tokenize run that cannot go as asked: curated input with no cells or a misnamed cell folder, or an
    output folder that holds an earlier run."""


def discover_tasks(curated: str) -> list[ShardTask]:
    """One task per curated Parquet file, numbered per cell in sorted file order."""
    files = storage.expand_glob(storage.join(curated, "domain=*", "quality=*", "*.parquet"))
    by_cell: dict[str, list[str]] = defaultdict(list)
    for path in files:
        name = os.path.basename(path)
        if name.startswith(storage.TEMPORARY_PREFIX):
            continue  # a curate writer's unfinished file
        parts = path.replace("\\", "/").rstrip("/").split("/")
        cell = f"{parts[-3]}/{parts[-2]}"
        try:
            parse_cell(cell)
        except ValueError as error:
            raise TokenizeError(f"{path}: {error}") from error
        by_cell[cell].append(path)
    return [
        ShardTask(cell=cell, index=index, source=path)
        for cell in sorted(by_cell)
        for index, path in enumerate(sorted(by_cell[cell]))
    ]


class _TokenizerFn(beam.DoFn):
    """A DoFn that loads the tokenizer once per worker, after checking it is the one the job started with."""

    def __init__(self, tokenizer_path: str, info: TokenizerInfo, batch_documents: int) -> None:
        self.tokenizer_path = tokenizer_path
        self.info = info
        self.batch_documents = batch_documents

    def setup(self) -> None:
        # Once per worker: loading a 128k-entry tokenizer.json takes a while.
        data = read_tokenizer_bytes(self.tokenizer_path)
        if sha256_bytes(data) != self.info.sha256:
            # Shards must all come from the tokenizer the manifest will name.
            raise RuntimeError(
                f"{self.tokenizer_path}: changed while the job ran (sha256 {sha256_bytes(data)}, "
                f"the job started with {self.info.sha256})"
            )
        self.tokenizer = tokenizer_from_bytes(data, self.tokenizer_path)


class SelectHeldoutFn(_TokenizerFn):
    """One file's share of its cell's held-out slice: (cell, SliceAccumulator). Memory: the accumulator
    (at most the rule's max_tokens tokens and min_documents + 1 documents) and one batch of text."""

    def __init__(self, tokenizer_path: str, info: TokenizerInfo, rule: HeldoutRule, batch_documents: int):
        super().__init__(tokenizer_path, info, batch_documents)
        self.rule = rule

    def process(self, task: ShardTask) -> Iterator[tuple[str, SliceAccumulator]]:
        yield task.cell, select_file(task, self.tokenizer, self.info, self.rule, self.batch_documents)


class CombineSlicesFn(beam.CombineFn):
    """Merges files' slice accumulators into the cell's, pruned after every merge (bounded, associative:
    any merge order gives the same slice)."""

    def __init__(self, rule: HeldoutRule) -> None:
        self.rule = rule

    def create_accumulator(self) -> SliceAccumulator:
        return SliceAccumulator()

    def add_input(self, accumulator: SliceAccumulator, value: SliceAccumulator) -> SliceAccumulator:
        accumulator.merge(value)
        accumulator.prune(self.rule)
        return accumulator

    def merge_accumulators(self, accumulators: Iterable[SliceAccumulator]) -> SliceAccumulator:
        merged = SliceAccumulator()
        for accumulator in accumulators:
            merged.merge(accumulator)
            merged.prune(self.rule)
        return merged

    def extract_output(self, accumulator: SliceAccumulator) -> SliceAccumulator:
        return accumulator


class TokenizeShardFn(_TokenizerFn):
    """Tokenizes one shard task (or keeps its complete shard) and emits the shard's done marker; with
    held-out slices, leaves its cell's slice out (the cells' slices come as a side input)."""

    def __init__(
        self,
        output: str,
        tokenizer_path: str,
        info: TokenizerInfo,
        batch_documents: int,
        rule: HeldoutRule | None = None,
        repeat_cap: int | None = None,
    ) -> None:
        super().__init__(tokenizer_path, info, batch_documents)
        self.output = output
        self.rule = rule
        self.repeat_cap = repeat_cap
        self.written = Metrics.counter(METRICS_NAMESPACE, "shards_written")
        self.kept = Metrics.counter(METRICS_NAMESPACE, "shards_kept")
        self.documents = Metrics.counter(METRICS_NAMESPACE, "documents_written")
        self.tokens = Metrics.counter(METRICS_NAMESPACE, "tokens_written")

    def process(
        self, task: ShardTask, slices: dict[str, dict[str, Any]] | None = None
    ) -> Iterator[ShardMarker]:
        def count(documents: int, tokens: int) -> None:
            self.documents.inc(documents)
            self.tokens.inc(tokens)

        last = slices[task.cell]["last"] if slices is not None else None
        marker, written = process_shard(
            task,
            self.output,
            self.tokenizer,
            self.info,
            self.batch_documents,
            on_batch=count,
            heldout=self.rule,
            heldout_last=last,
            repeat_cap=self.repeat_cap,
        )
        (self.written if written else self.kept).inc()
        yield marker


def _write_cell_manifest(
    cell_markers: tuple[str, Iterable[ShardMarker]],
    output: str,
    info: TokenizerInfo,
    expected: dict[str, int],
) -> dict[str, Any]:
    cell, markers = cell_markers
    # A retried bundle may report a shard twice; its markers are identical (deterministic), keep one.
    by_name = {marker.name: marker for marker in markers}
    if len(by_name) != expected[cell]:
        raise RuntimeError(f"{cell}: {len(by_name)} shards done for {expected[cell]} source files")
    return write_manifest(output, cell, list(by_name.values()), info)


def _write_cell_slice(
    cell_slice: tuple[str, SliceAccumulator], output: str, info: TokenizerInfo, rule: HeldoutRule
) -> tuple[str, dict[str, Any]]:
    cell, accumulator = cell_slice
    return cell, write_heldout(output, select(cell, accumulator, rule), info, rule)


def build_pipeline(
    pipeline,
    tasks: list[ShardTask],
    output: str,
    tokenizer_path: str,
    info: TokenizerInfo,
    batch_documents: int,
    rule: HeldoutRule | None = None,
    repeat_cap: int | None = None,
) -> None:
    """Add the tokenize steps to a Beam pipeline (with held-out slices when `rule` is active; each document
    written min(dup_cluster_size, `repeat_cap`) times when it is set)."""
    expected: dict[str, int] = defaultdict(int)
    for task in tasks:
        expected[task.cell] += 1
    active = rule is not None and rule.active
    task_list = pipeline | "ShardTasks" >> beam.Create(tasks, reshuffle=False)
    dofn = TokenizeShardFn(
        output, tokenizer_path, info, batch_documents, rule if active else None, repeat_cap
    )
    slices = None
    if active:
        assert rule is not None
        slices = beam.pvalue.AsDict(
            task_list
            | "SpreadSelect" >> beam.Reshuffle()
            | "SelectHeldout" >> beam.ParDo(SelectHeldoutFn(tokenizer_path, info, rule, batch_documents))
            | "CombineSlices" >> beam.CombinePerKey(CombineSlicesFn(rule))
            | "WriteHeldout" >> beam.Map(_write_cell_slice, output, info, rule)
        )
    spread = (
        task_list
        # One shard per element on whichever worker is free: shards differ a lot in size.
        | "Spread" >> beam.Reshuffle()
    )
    markers = spread | "Tokenize" >> (beam.ParDo(dofn, slices) if slices is not None else beam.ParDo(dofn))
    cells = (
        markers
        | "ByCell" >> beam.Map(lambda marker: (marker.cell, marker))
        | "GroupCells" >> beam.GroupByKey()
        | "WriteManifests" >> beam.Map(_write_cell_manifest, output, info, dict(expected))
        | "AllCells" >> beam.combiners.ToList()
    )
    if slices is not None:
        cells | "WriteCounts" >> beam.Map(
            lambda cells, heldout: write_counts(output, cells, info, heldout, rule).total_tokens, slices
        )
    else:
        cells | "WriteCounts" >> beam.Map(lambda cells: write_counts(output, cells, info).total_tokens)


class ProgressMonitor:
    """Reports progress of a local run from what is on disk: done markers and growing temporary shards.

    Beam's local workers are separate processes, so the driver reads progress from the output folder: a
    finished shard's counts from its marker, a shard being written from its temporary files' sizes.
    """

    def __init__(self, output: str, tasks: list[ShardTask], dtype: str, every: float) -> None:
        self.output = storage.local_path(output)
        self.tasks = tasks
        self.itemsize = DTYPES[dtype].itemsize
        self.every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenize-progress", daemon=True)
        self._markers: dict[str, ShardMarker] = {}
        self.start_time = time.monotonic()
        self.baseline_tokens = 0

    def snapshot(self) -> tuple[int, int, int]:
        """(shards done, documents, tokens) on disk now, unfinished shards included."""
        done = documents = tokens = 0
        for task in self.tasks:
            path = task.path(self.output, DONE_SUFFIX)
            marker = self._markers.get(path)
            if marker is None and os.path.exists(path):
                marker = read_marker(path)
                if marker is not None:
                    self._markers[path] = marker
            if marker is not None:
                done += 1
                documents += marker.documents
                tokens += marker.tokens
        for cell in sorted({t.cell for t in self.tasks}):
            directory = os.path.join(self.output, cell)
            try:
                names = os.listdir(directory)
            except FileNotFoundError:
                continue
            for name in names:
                if not name.startswith(storage.TEMPORARY_PREFIX):
                    continue
                try:
                    size = os.path.getsize(os.path.join(directory, name))
                except FileNotFoundError:
                    continue  # renamed into place since listdir
                if name.endswith(".bin"):
                    tokens += size // self.itemsize
                elif name.endswith(".idx"):
                    documents += size // INDEX_DTYPE.itemsize
        return done, documents, tokens

    def line(self) -> str:
        done, documents, tokens = self.snapshot()
        elapsed = max(time.monotonic() - self.start_time, 1e-9)
        rate = (tokens - self.baseline_tokens) / elapsed
        return (
            f"tokenize: {done}/{len(self.tasks)} shards, {documents:,} documents, {tokens:,} tokens, "
            f"{rate:,.0f} tokens/s"
        )

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            log.info(self.line())

    def __enter__(self) -> ProgressMonitor:
        if self.every > 0:
            # Shards already on disk (most of them kept, on a resumed run) do not count towards the rate.
            self.baseline_tokens = self.snapshot()[2]
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


# What `tokenmill tokenize` writes below its output folder (docs/formats.md, "Token shards"): counts.json
# and, per cell, its shards and manifest and its held-out slice in heldout/.
_TOKENIZE_FILE = re.compile(
    r"^(?:counts\.json|domain=[^/]+/quality=[^/]+/(?:"
    + HELDOUT_DIR
    + r"/)?(?:part-\d+\.(?:bin|idx|done\.json|"
    + BYTES_SUFFIX[1:]
    + r")|manifest\.json|"
    + re.escape(storage.TEMPORARY_PREFIX)
    + r"[^/]*))$"
)


def earlier_run_files(output: str) -> list[str]:
    """Files of an earlier tokenize run in `output`, relative to it, sorted (other files are not ours)."""
    return [name for name in storage.list_files(output, relative=True) if _TOKENIZE_FILE.match(name)]


def _describe(files: list[str]) -> str:
    slices = sum(1 for name in files if name.endswith(f"/{HELDOUT_DIR}/{MANIFEST}"))
    shards = sum(1 for name in files if name.endswith(".bin") and f"/{HELDOUT_DIR}/" not in name)
    catalog = "counts.json, " if COUNTS in files else "no counts.json (unfinished), "
    held = f", {slices} held-out slices" if slices else ""
    return f"{catalog}{shards} shards{held}, {len(files)} files"


def prepare_output(
    output: str, tasks: list[ShardTask], overwrite: bool, resume: bool, heldout: bool = False
) -> None:
    """Make `output` ready for this run, or refuse it; on any filesystem, before the pipeline starts.

    An output that holds an earlier run is refused unless `overwrite` (delete every file of it first) or
    `resume` (keep the shards that prove complete and verified for this input and tokenizer, redo the
    rest). Resuming refuses files that this run would not write (shards of an earlier run with more
    source files, cells no longer in the input, held-out slices when `heldout` is off), so no folder ever
    mixes two runs. The catalog
    (counts.json, then the manifests) is removed before anything else: a tokens/ folder without
    counts.json is an unfinished run, and readers refuse it.
    """
    earlier = earlier_run_files(output)
    if not earlier:
        return
    if not (overwrite or resume):
        raise TokenizeError(
            f"--output {output} holds an earlier tokenize run ({_describe(earlier)}); pass --resume to "
            "keep its complete, verified shards and redo the rest, or --overwrite to delete it first"
        )
    catalog = [name for name in earlier if name == COUNTS or name.endswith("/" + MANIFEST)]
    if overwrite:
        rest = [name for name in earlier if name not in catalog]
        for name in sorted(catalog, key=lambda name: name != COUNTS) + rest:
            storage.remove_file(storage.join(output, name))
        if storage.is_local(output):  # object stores have no folders to leave behind
            folders = {name.rsplit("/", i)[0] for name in rest for i in range(1, name.count("/") + 1)}
            for folder in sorted(folders, key=lambda folder: (-folder.count("/"), folder)):  # deepest first
                with contextlib.suppress(OSError):  # not empty: it holds files that are not ours
                    os.rmdir(os.path.join(storage.local_path(output), folder))
        log.info("--overwrite: removed %d files of an earlier run from %s", len(earlier), output)
        return
    expected = {f"{task.cell}/{task.name}" for task in tasks}
    cells = {task.cell for task in tasks}
    stale = []
    for name in earlier:
        cell, _, base = name.rpartition("/")
        if name == COUNTS or base.startswith(storage.TEMPORARY_PREFIX):
            continue
        if cell.endswith("/" + HELDOUT_DIR):
            # One slice per cell, as part-00000: stale when the cell is gone or slices are off.
            if not heldout or cell[: -len(HELDOUT_DIR) - 1] not in cells:
                stale.append(name)
            elif base != MANIFEST and not base.startswith("part-00000."):
                stale.append(name)
            continue
        if cell not in cells or (base != MANIFEST and f"{cell}/{base.split('.', 1)[0]}" not in expected):
            stale.append(name)
    if stale:
        raise TokenizeError(
            f"--output {output} holds {len(stale)} files that this run would not write (from an earlier run "
            f"with other input, e.g. {', '.join(stale[:3])}); --resume cannot keep them apart from this "
            "run's: pass --overwrite to delete the earlier run first"
        )
    # Counts first: without counts.json an unfinished run can never be mistaken for a finished one.
    temporaries = [name for name in earlier if name.rpartition("/")[2].startswith(storage.TEMPORARY_PREFIX)]
    for name in sorted(catalog, key=lambda name: name != COUNTS) + temporaries:
        storage.remove_file(storage.join(output, name))
    if temporaries:
        log.info("removed %d temporary files left by an earlier run", len(temporaries))


def run_tokenize(args: argparse.Namespace, tokenizer_path: str, info: TokenizerInfo) -> dict[str, Any]:
    """Run the pipeline; returns a summary (cells, shards written and kept, totals, seconds)."""
    from apache_beam.metrics.metric import MetricsFilter

    from tokenmill.pipelines.options import make_pipeline

    tasks = discover_tasks(args.input)
    if not tasks:
        raise TokenizeError(
            f"no curated Parquet files under {args.input} (expected domain=<d>/quality=<q>/*.parquet)"
        )
    output = args.output
    rule: HeldoutRule | None = getattr(args, "heldout_rule", None)
    dry_run = bool(getattr(args, "dry_run", False))
    if not dry_run:  # a dry run builds the job and touches nothing
        storage.make_dirs(output)
        prepare_output(
            output,
            tasks,
            bool(getattr(args, "overwrite", False)),
            bool(getattr(args, "resume", False)),
            heldout=rule is not None and rule.active,
        )
    log.info(
        "tokenize: %d shards in %d cells, tokenizer %s (%s, vocabulary %d, %s, end-of-text id %d)",
        len(tasks),
        len({t.cell for t in tasks}),
        info.name,
        info.sha256[:12],
        info.vocab_size,
        info.dtype,
        info.eos_id,
    )
    if args.runner == "local":
        args = argparse.Namespace(**vars(args))
        args.workers = min(args.workers or default_local_workers(), len(tasks))
    started = time.monotonic()
    pipeline = make_pipeline(args, "tokenize")
    build_pipeline(
        pipeline,
        tasks,
        output,
        tokenizer_path,
        info,
        args.batch_documents or DEFAULT_BATCH_DOCUMENTS,
        rule,
        getattr(args, "repeat_by_cluster_size", None),
    )
    monitor_every = args.progress_seconds if storage.is_local(output) and args.runner == "local" else 0
    with ProgressMonitor(output, tasks, info.dtype, monitor_every):
        result = pipeline.run()
        result.wait_until_finish()
    seconds = time.monotonic() - started
    summary: dict[str, Any] = {
        "shards": len(tasks),
        "cells": len({t.cell for t in tasks}),
        "seconds": seconds,
    }
    try:
        counters = result.metrics().query(MetricsFilter().with_namespace(METRICS_NAMESPACE))["counters"]
        for counter in counters:
            summary[counter.key.metric.name] = summary.get(counter.key.metric.name, 0) + counter.committed
    except Exception as error:  # metrics are a nicety; some runners do not report them
        log.debug("no metrics from the runner: %s", error)
    if not dry_run:
        counts = read_counts(storage.join(output, COUNTS))
        summary["documents"] = counts.total_documents
        summary["tokens"] = counts.total_tokens
        summary["heldout_documents"] = counts.total_heldout_documents or 0
        summary["heldout_tokens"] = counts.total_heldout_tokens or 0
        summary["reserved_documents"] = sum(entry.reserved_documents or 0 for entry in counts.cells.values())
    return summary
