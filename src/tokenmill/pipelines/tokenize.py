"""The tokenize pipeline: curated Parquet cells to token shards, manifests and tokens/counts.json.

Beam elements are shard tasks, one per curated Parquet file: the n-th file (sorted) of a cell becomes that
cell's part-<n> shard. A DoFn loads the tokenizer once per worker (setup), keeps a shard that is complete
and verified, or else tokenizes the file in batches with `encode_batch` and streams the ids to disk
(tokenmill.tokenize.writer). The done markers then flow to a per-cell step that writes manifest.json, and
from there to one step that writes counts.json, so the catalog appears only once every shard is in place.

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
from tokenmill.formats.tokens import COUNTS, DONE_SUFFIX, MANIFEST, ShardMarker, read_counts
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
    write_counts,
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


class TokenizeShardFn(beam.DoFn):
    """Tokenizes one shard task (or keeps its complete shard) and emits the shard's done marker."""

    def __init__(self, output: str, tokenizer_path: str, info: TokenizerInfo, batch_documents: int) -> None:
        self.output = output
        self.tokenizer_path = tokenizer_path
        self.info = info
        self.batch_documents = batch_documents
        self.written = Metrics.counter(METRICS_NAMESPACE, "shards_written")
        self.kept = Metrics.counter(METRICS_NAMESPACE, "shards_kept")
        self.documents = Metrics.counter(METRICS_NAMESPACE, "documents_written")
        self.tokens = Metrics.counter(METRICS_NAMESPACE, "tokens_written")

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

    def process(self, task: ShardTask) -> Iterator[ShardMarker]:
        def count(documents: int, tokens: int) -> None:
            self.documents.inc(documents)
            self.tokens.inc(tokens)

        marker, written = process_shard(
            task, self.output, self.tokenizer, self.info, self.batch_documents, on_batch=count
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


def build_pipeline(
    pipeline,
    tasks: list[ShardTask],
    output: str,
    tokenizer_path: str,
    info: TokenizerInfo,
    batch_documents: int,
) -> None:
    """Add the tokenize steps to a Beam pipeline."""
    expected: dict[str, int] = defaultdict(int)
    for task in tasks:
        expected[task.cell] += 1
    dofn = TokenizeShardFn(output, tokenizer_path, info, batch_documents)
    (
        pipeline
        | "ShardTasks" >> beam.Create(tasks, reshuffle=False)
        # One shard per element on whichever worker is free: shards differ a lot in size.
        | "Spread" >> beam.Reshuffle()
        | "Tokenize" >> beam.ParDo(dofn)
        | "ByCell" >> beam.Map(lambda marker: (marker.cell, marker))
        | "GroupCells" >> beam.GroupByKey()
        | "WriteManifests" >> beam.Map(_write_cell_manifest, output, info, dict(expected))
        | "AllCells" >> beam.combiners.ToList()
        | "WriteCounts" >> beam.Map(lambda cells: write_counts(output, cells, info).total_tokens)
    )


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


# What `tokenmill tokenize` writes below its output folder (docs/formats.md, "Token shards").
_TOKENIZE_FILE = re.compile(
    r"^(?:counts\.json|domain=[^/]+/quality=[^/]+/(?:part-\d+\.(?:bin|idx|done\.json)|manifest\.json|"
    + re.escape(storage.TEMPORARY_PREFIX)
    + r"[^/]*))$"
)


def earlier_run_files(output: str) -> list[str]:
    """Files of an earlier tokenize run in `output`, relative to it, sorted (other files are not ours)."""
    return [name for name in storage.list_files(output, relative=True) if _TOKENIZE_FILE.match(name)]


def _describe(files: list[str]) -> str:
    shards = sum(1 for name in files if name.endswith(".bin"))
    catalog = "counts.json, " if COUNTS in files else "no counts.json (unfinished), "
    return f"{catalog}{shards} shards, {len(files)} files"


def prepare_output(output: str, tasks: list[ShardTask], overwrite: bool, resume: bool) -> None:
    """Make `output` ready for this run, or refuse it; on any filesystem, before the pipeline starts.

    An output that holds an earlier run is refused unless `overwrite` (delete every file of it first) or
    `resume` (keep the shards that prove complete and verified for this input and tokenizer, redo the
    rest). Resuming refuses files that this run would not write (shards of an earlier run with more
    source files, cells no longer in the input), so no folder ever mixes two runs. The catalog
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
            for cell in sorted({name.rpartition("/")[0] for name in rest}):
                for folder in (cell, cell.split("/", 1)[0]):
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
    dry_run = bool(getattr(args, "dry_run", False))
    if not dry_run:  # a dry run builds the job and touches nothing
        storage.make_dirs(output)
        prepare_output(
            output, tasks, bool(getattr(args, "overwrite", False)), bool(getattr(args, "resume", False))
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
        pipeline, tasks, output, tokenizer_path, info, args.batch_documents or DEFAULT_BATCH_DOCUMENTS
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
    return summary
