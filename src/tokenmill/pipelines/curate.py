"""`tokenmill curate`: raw corpora in, curated Parquet cells, removed documents, rejected input and stats out.

The pipeline reads as its list of steps:

    read files -> normalize -> (recipe stages, in order: language, exact_dedupe, heuristic filters, ...)
               -> default cell (the seam where the domain and quality classifiers go)
               -> dedupe clusters (every dedupe removal's kept_id made final, dup_cluster_size) -> write

Every document read ends in exactly one place: curated/ (kept), removed/stage=<s>/reason=<r>/ (with
why), or rejected/ (input that is not a document). With a dedupe stage, dedupe-index/ records what was
kept, for later runs' --dedupe-against (tokenmill.pipelines.dedupe_index). stats.json counts what was
read independently of where it went, so `balanced` proves the invariant rather than restating it.

Output is a function of the input and the recipe alone: files are sharded by a stable hash of the
document id and sorted within, so reruns give the same bytes. An output folder that holds an earlier
run is refused unless `--overwrite`, which first removes the previous output of this command
(curated/, removed/, rejected/, stats.json) on any filesystem; stats.json is written last, so a
killed run, run again with --overwrite, ends exactly like a run that was never stopped.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

import apache_beam as beam
import pyarrow as pa

from tokenmill import storage
from tokenmill.cells import cell_name
from tokenmill.corpora.paths import common_file_root
from tokenmill.corpora.readers import read_file
from tokenmill.corpora.records import DEFAULT_MAX_RECORD_BYTES, InputFields
from tokenmill.filters.base import DocumentStep, sum_numbers
from tokenmill.formats import stats as stats_format
from tokenmill.formats.base import parse
from tokenmill.formats.documents import DOCUMENT_SCHEMA, REMOVED_SCHEMA
from tokenmill.formats.rejected import write_rejected
from tokenmill.formats.stats import STATS, CurateStats
from tokenmill.pipelines.dedupe_clusters import DedupeClusters
from tokenmill.pipelines.dedupe_index import (
    WriteDedupeIndex,
    attach_earlier_indexes,
    index_params,
    load_indexes,
)
from tokenmill.pipelines.recipe import MAX_SOURCE_TEXT, GroupingStep, Recipe, build_steps
from tokenmill.pipelines.sinks import OutputKind, SumPerBundle, WritePartitioned, write_parquet

log = logging.getLogger(__name__)

OUTPUT_PARTS = ("curated", "removed", "rejected", "dedupe-index", STATS)
#: Distinct record licenses kept per source in stats.json; the rest are counted together under
#: OTHER_LICENSES (a license field that holds something else, such as an id, stays small).
MAX_LICENSES = 20
OTHER_LICENSES = "(other)"
_PATH_UNSAFE = str.maketrans({c: "_" for c in '/\\=:*?"<>| '})


def estimated_tokens(n_chars: int | None, chars_per_token: float) -> int:
    return int((n_chars or 0) // chars_per_token)


class Progress:
    """A periodic progress line from each worker process (Beam counters carry the totals on Dataflow)."""

    def __init__(self, label: str, every_seconds: float = 10.0):
        self.label = label
        self.every_seconds = every_seconds
        self.count = 0
        self.started = time.monotonic()
        self.last = self.started

    def add(self, count: int) -> None:
        self.count += count
        now = time.monotonic()
        if now - self.last >= self.every_seconds:
            self.last = now
            rate = self.count / max(now - self.started, 1e-9)
            print(
                f"[curate pid {os.getpid()}] {self.label}: {self.count:,} ({rate:,.0f}/s)",
                file=sys.stderr,
                flush=True,
            )


class ReadFile(beam.DoFn):
    """One input file -> documents (main output) and rejected records ('rejected').

    Sources and ids are named relative to `root` (corpora.paths.relative_source). Memory per worker thread:
    one read chunk, one record of at most `max_record_bytes` (longer ones are rejected unread) and the
    ids of the file being read (records.IdLedger), whatever the file's size; no shuffle. Storage errors
    propagate, so the runner retries the file (its earlier outputs are discarded with the failed
    bundle); a file that keeps failing fails the job instead of losing documents.
    """

    def __init__(
        self,
        fields: InputFields,
        root: str | None = None,
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
    ):
        self.fields = fields
        self.root = root
        self.max_record_bytes = max_record_bytes
        self.read_counter = beam.metrics.Metrics.counter("tokenmill", "documents_read")
        self.rejected_counter = beam.metrics.Metrics.counter("tokenmill", "documents_rejected")

    def setup(self):
        self.progress = Progress("records read")

    def process(self, path: str):
        for record in read_file(path, self.fields, self.root, self.max_record_bytes):
            self.read_counter.inc()
            self.progress.add(1)
            if record.pop("kind") == "rejected":
                self.rejected_counter.inc()
                yield beam.pvalue.TaggedOutput("rejected", record)
            else:
                yield record


class ApplyStep(beam.DoFn):
    """Runs one DocumentStep over batches: survivors go on as a batch, removed documents to 'removed'."""

    def __init__(self, step: DocumentStep):
        self.step = step
        self.kept_counter = beam.metrics.Metrics.counter("tokenmill", f"{step.stage}.kept")
        self.removed_counter = beam.metrics.Metrics.counter("tokenmill", f"{step.stage}.removed")
        # CPU time inside the step, summed over workers: where the time goes, per stage.
        self.microseconds = beam.metrics.Metrics.counter("tokenmill", f"{step.stage}.microseconds")

    def setup(self):
        self.step.setup()

    def process(self, batch: list[dict]):
        started = time.process_time()
        verdicts = self.step.apply(batch)
        self.microseconds.inc(int((time.process_time() - started) * 1e6))
        kept = []
        for document, removal in zip(batch, verdicts, strict=True):
            if removal is None:
                kept.append(document)
                continue
            self.removed_counter.inc()
            yield beam.pvalue.TaggedOutput(
                "removed",
                {
                    **document,
                    "stage": removal.stage or self.step.stage,
                    "reason": removal.reason,
                    "detail": json.dumps(removal.detail, sort_keys=True, default=str),
                },
            )
        self.kept_counter.inc(len(kept))
        for stage, numbers in self.step.drain_stage_stats().items():
            yield beam.pvalue.TaggedOutput("stats", (stage, numbers))
        if kept:
            yield kept


def _fill_cell(document: dict, domain: str, quality: int) -> dict:
    document.setdefault("domain", domain)
    document.setdefault("quality", quality)
    return document


def _row(document: dict, schema) -> dict:
    return {name: document.get(name) for name in schema.names}


def _documents_kind(name: str, schema: pa.Schema) -> OutputKind:
    """Document rows as Parquet files of `schema`, sorted by id, sized by their text."""
    return OutputKind(
        name,
        ".parquet",
        lambda path, rows: write_parquet(path, rows, schema),
        lambda row: row["id"],
        lambda row: len(row.get("text") or "") + 64,
    )


def _removed_row(document: dict, keep_text: bool) -> dict:
    """A removed/ row; without its text (recipe `removed_text: false`) it still says how long it was."""
    row = _row(document, REMOVED_SCHEMA)
    if not keep_text:
        if row["n_chars"] is None:
            row["n_chars"] = len(row["text"] or "")
        row["text"] = None
    return row


def _safe(part: str) -> str:
    return str(part).translate(_PATH_UNSAFE) or "unknown"


def _stat_entries(record: dict, outcome: str, chars_per_token: float):
    """(key, (documents, characters, estimated tokens)) for the stats combiner."""
    if outcome == "rejected":
        yield ("rejected", record["error_kind"], record["source"]), (1, 0, 0)
        return
    n_chars = record.get("n_chars") or 0
    counts = (1, n_chars, estimated_tokens(n_chars, chars_per_token))
    if outcome == "kept":
        yield ("kept", cell_name(record["domain"], int(record["quality"])), record["source"]), counts
    else:
        yield ("removed", f"{record['stage']}/{record['reason']}", record["source"]), counts


def record_license(metadata: str | None, path: str) -> str | None:
    """The license a record names at the dotted `path` of its metadata (the recipe's `fields.license`):
    text as it is, another value as compact JSON, cut to MAX_SOURCE_TEXT characters; None without one."""
    try:
        value = json.loads(metadata) if metadata else None
    except (TypeError, ValueError):
        return None
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if value is None or value == "":
        return None
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, ensure_ascii=False)
    return text[:MAX_SOURCE_TEXT]


def _read_entries(document: dict, chars_per_token: float, license_field: str | None = None):
    n_chars = len(document["text"])
    yield ("read", "", document["source"]), (1, n_chars, estimated_tokens(n_chars, chars_per_token))
    if license_field:
        license_name = record_license(document.get("metadata"), license_field)
        if license_name is not None:
            yield ("license", license_name, document["source"]), (1, 0, 0)


def _add_triples(first: tuple[int, int, int], second: tuple[int, int, int]) -> tuple[int, int, int]:
    return first[0] + second[0], first[1] + second[1], first[2] + second[2]


def _sum_triples(values: Iterable[tuple[int, int, int]]) -> tuple[int, int, int]:
    documents = characters = tokens = 0
    for d, c, t in values:
        documents += d
        characters += c
        tokens += t
    return documents, characters, tokens


@dataclass
class CurateRun:
    recipe: Recipe
    recipe_path: str
    inputs: list[str]
    output: str
    #: The folder that sources and ids are named relative to: paths.input_root of the --input patterns
    #: (None: the common folder of `inputs`).
    input_root: str | None = None
    #: Earlier runs' dedupe indexes (--dedupe-against): the dedupe stages remove what duplicates them.
    dedupe_against: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.input_root is None:
            self.input_root = common_file_root(self.inputs)


def build_stats(
    entries: list, run: CurateRun, files: Iterable[tuple[str, int]], stage_stats: Iterable[tuple[str, dict]]
) -> CurateStats:
    """stats.json from the combined counts, the files written and the stages' own statistics
    (docs/formats.md, "stats.json")."""
    from tokenmill.corpora.paths import relative_source

    def triple(documents=0, characters=0, tokens=0):
        return {"documents": documents, "characters": characters, "tokens_estimated": tokens}

    read = [0, 0, 0]
    kept = [0, 0, 0]
    removed = [0, 0, 0]
    removed_by_reason: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    rejected_by_error: dict[str, int] = defaultdict(int)
    cells: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    sources: dict[str, dict[str, int]] = defaultdict(
        lambda: {"read": 0, "kept": 0, "removed": 0, "rejected": 0}
    )
    licenses: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for (outcome, detail, source), counts in entries:
        if outcome == "read":
            _add(read, counts)
            sources[source]["read"] += counts[0]
        elif outcome == "kept":
            _add(kept, counts)
            _add(cells[detail], counts)
            sources[source]["kept"] += counts[0]
        elif outcome == "removed":
            _add(removed, counts)
            _add(removed_by_reason[detail], counts)
            sources[source]["removed"] += counts[0]
        elif outcome == "license":
            licenses[source][detail] += counts[0]
        else:
            rejected_by_error[detail] += counts[0]
            sources[source]["rejected"] += counts[0]
            sources[source]["read"] += counts[0]  # read, then found not to be a document
    rejected_total = sum(rejected_by_error.values())
    matched = {run.recipe.source_pattern(source) for source in sources}
    for pattern in run.recipe.sources:
        if pattern not in matched:
            log.warning("%s: sources pattern %r names no input file read", run.recipe_path, pattern)
    # Documents are counted as the reader emits them, apart from where they end up; a rejected record
    # never becomes a document, so it counts once, as read and as rejected.
    read_documents = read[0] + rejected_total

    funnel = [{"stage": "read", **triple(read_documents, read[1], read[2])}]
    stage_names = run.recipe.stage_names()
    by_stage: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for key, counts in removed_by_reason.items():
        _add(by_stage[key.split("/", 1)[0]], counts)
    # What is left after stage i is what was kept plus what later stages removed.
    for position, stage in enumerate(stage_names):
        left = list(kept)
        for later in stage_names[position + 1 :]:
            _add(left, by_stage[later])
        funnel.append({"stage": stage, "removed_documents": by_stage[stage][0], **triple(*left)})
    stats = {
        "format_version": stats_format.FORMAT_VERSION,
        "recipe": run.recipe_path,
        "recipe_name": run.recipe.name,
        # Relative to the input root, like `sources`: the same files give the same stats.json wherever
        # they are (a local folder or a gs:// prefix).
        "inputs": [relative_source(path, run.input_root) for path in run.inputs],
        "chars_per_token": run.recipe.chars_per_token,
        "read": triple(read_documents, read[1], read[2]),
        "kept": triple(*kept),
        "removed": triple(*removed),
        "rejected": {"documents": rejected_total},
        "balanced": read_documents == kept[0] + removed[0] + rejected_total,
        "funnel": funnel,
        "removed_by_reason": {
            key: {"stage": key.split("/", 1)[0], "reason": key.split("/", 1)[1], **triple(*counts)}
            for key, counts in sorted(removed_by_reason.items())
        },
        "rejected_by_error": {
            kind: {"documents": count} for kind, count in sorted(rejected_by_error.items())
        },
        "cells": {cell: triple(*counts) for cell, counts in sorted(cells.items())},
        "sources": {
            source: {**outcomes, **_provenance(run.recipe, source, licenses.get(source, {}))}
            for source, outcomes in sorted(sources.items())
        },
        "stages": dict(sorted(stage_stats)),
        "files": dict(sorted(files)),
    }
    return parse(CurateStats, stats, storage.join(run.output, STATS))


def _provenance(recipe: Recipe, source: str, licenses: dict[str, int]) -> dict:
    """A source's license and provenance from the recipe's `sources:` table, and the documents read per
    license its records name (the MAX_LICENSES most common, the rest together as OTHER_LICENSES)."""
    info = recipe.source_info(source)
    found = {} if info is None else info.model_dump(exclude_none=True)
    if licenses:
        ranked = sorted(licenses.items(), key=lambda item: (-item[1], item[0]))
        kept = dict(ranked[:MAX_LICENSES])
        rest = sum(count for _, count in ranked[MAX_LICENSES:])
        if rest:
            kept[OTHER_LICENSES] = kept.get(OTHER_LICENSES, 0) + rest
        found["licenses"] = dict(sorted(kept.items()))
    return found


def merge_numbers(values: Iterable[dict]) -> dict:
    """Sum dicts of numbers (nested dicts key by key): how stage statistics combine across workers."""
    return sum_numbers(list(values))


def _add(total: list[int], counts) -> None:
    for index, value in enumerate(counts):
        total[index] += value


class WriteStats(beam.DoFn):
    def __init__(self, run: CurateRun):
        self.run = run

    def process(self, entries, files, stage_stats):
        stats = build_stats(sorted(entries), self.run, files, stage_stats)
        stats_format.write_stats(storage.join(self.run.output, STATS), stats)
        yield stats


def build_pipeline(pipeline: beam.Pipeline, run: CurateRun) -> None:
    """Add the curate transforms to `pipeline`."""
    recipe = run.recipe
    chars_per_token = recipe.chars_per_token
    steps = build_steps(recipe, run.recipe_path)
    attach_earlier_indexes(steps, load_indexes(run.dedupe_against))
    warm_workers = getattr(pipeline.runner, "warm_workers", None)
    if warm_workers is not None:  # the local runner's workers set up the steps while the job is built
        calls = (call for step in steps if isinstance(step, DocumentStep) for call in step.warm_up_calls())
        warm_workers.prepare(dict.fromkeys(calls))

    read = (
        pipeline
        | "Inputs" >> beam.Create(run.inputs)
        | "SpreadFiles" >> beam.Reshuffle()
        | "Read"
        >> beam.ParDo(ReadFile(recipe.input_fields, run.input_root, recipe.max_record_bytes)).with_outputs(
            "rejected", main="documents"
        )
    )
    documents = read.documents | "SpreadDocuments" >> beam.Reshuffle()
    read_stats = documents | "CountRead" >> beam.FlatMap(
        _read_entries, chars_per_token, recipe.fields.license
    )

    removed_parts = []
    removed_stages = []  # the stage of each of removed_parts, for DedupeClusters
    stage_stats_parts = []
    batches = documents | "Batch0" >> beam.BatchElements(
        min_batch_size=recipe.batch_size, max_batch_size=recipe.batch_size
    )
    for position, step in enumerate(steps):
        if isinstance(step, GroupingStep):  # compares documents: unbatch, run the transform, batch again
            unbatched = batches | f"Unbatch{position}" >> beam.FlatMap(lambda batch: batch)
            result = unbatched | f"Step{position}_{step.stage}" >> step.transform
            removed_parts.append(result["removed"])
            removed_stages.append(step.stage)
            if "removed_earlier" in result:  # not a dedupe pointer: names an earlier run's document
                removed_parts.append(result["removed_earlier"])
                removed_stages.append(f"{step.stage}/earlier")
            if "stats" in result:
                stage_stats_parts.append(result["stats"])
            batches = result["kept"] | f"Batch{position}" >> beam.BatchElements(
                min_batch_size=recipe.batch_size, max_batch_size=recipe.batch_size
            )
            continue
        result = batches | f"Step{position}_{step.stage}" >> beam.ParDo(ApplyStep(step)).with_outputs(
            "removed", "stats", main="kept"
        )
        removed_parts.append(result.removed)
        removed_stages.append(step.stage)
        stage_stats_parts.append(result.stats)
        batches = result.kept

    cell = recipe.default_cell
    kept = (
        batches
        | "Unbatch" >> beam.FlatMap(lambda batch: batch)
        # The seam for the domain and quality classifiers: documents they did not place get the default.
        | "DefaultCell" >> beam.Map(_fill_cell, cell.domain, cell.quality)
    )
    # Every dedupe removal's kept_id made final, and every kept document's dup_cluster_size.
    finished = (kept, *removed_parts) | "DedupeClusters" >> DedupeClusters(removed_stages)
    kept, removed = finished["kept"], finished["removed"]
    stage_stats_parts.append(finished["stats"])
    dedupes, minhash = index_params(steps)
    index_files = []
    target = recipe.target_file_bytes
    if dedupes and recipe.dedupe_index:  # what later runs dedupe against (--dedupe-against)
        index_files.append(
            kept | "DedupeIndex" >> WriteDedupeIndex(run.output, recipe.name, minhash, shard_bytes=target)
        )
    rejected = read.rejected

    curated_kind = _documents_kind("curated", DOCUMENT_SCHEMA)
    removed_kind = _documents_kind("removed", REMOVED_SCHEMA)
    rejected_kind = OutputKind(
        "rejected",
        ".jsonl.zst",
        write_rejected,
        lambda r: f"{r['file']}\x00{r['line'] or 0:012d}\x00{r['offset'] or 0:015d}",
        lambda r: len(r.get("raw") or r.get("raw_base64") or "") + 256,
    )
    keyed_kept = kept | "KeyByCell" >> beam.Map(
        lambda d: (f"curated/{cell_name(d['domain'], int(d['quality']))}", _row(d, DOCUMENT_SCHEMA))
    )
    keyed_removed = tuple(
        part
        | f"KeyByReason{index}"
        >> beam.Map(
            lambda d: (
                f"removed/stage={_safe(d['stage'])}/reason={_safe(d['reason'])}",
                _removed_row(d, recipe.removed_text),
            )
        )
        for index, part in enumerate(removed)
    )
    keyed_rejected = rejected | "KeyRejected" >> beam.Map(
        lambda r: ("rejected", {k: v for k, v in r.items() if k != "source"})
    )
    output_files = (keyed_kept, *keyed_removed, keyed_rejected) | "WriteOutputs" >> WritePartitioned(
        run.output, [curated_kind, *[removed_kind] * len(keyed_removed), rejected_kind], target
    )

    entries = (
        kept | "KeptStats" >> beam.FlatMap(_stat_entries, "kept", chars_per_token),
        *(
            part | f"RemovedStats{index}" >> beam.FlatMap(_stat_entries, "removed", chars_per_token)
            for index, part in enumerate(removed)
        ),
        rejected | "RejectedStats" >> beam.FlatMap(_stat_entries, "rejected", chars_per_token),
        read_stats,
    )
    # Summed per bundle where the documents are, so the Flatten carries a few sums, not an entry a document.
    outcome_stats = (
        tuple(
            part | f"StatsPerBundle{index}" >> beam.ParDo(SumPerBundle(_add_triples))
            for index, part in enumerate(entries)
        )
        | "AllStats" >> beam.Flatten()
    )
    # stats.json marks a finished run, so it waits for every file: the file list is its side input.
    files = (
        (output_files, *index_files) | "AllFiles" >> beam.Flatten() | "FileList" >> beam.combiners.ToList()
    )
    stage_stats = (
        tuple(stage_stats_parts)
        | "AllStageStats" >> beam.Flatten(pipeline=pipeline)
        | "MergeStageStats" >> beam.CombinePerKey(merge_numbers)
        | "StageStatsList" >> beam.combiners.ToList()
    )
    (
        outcome_stats
        | "SumStats" >> beam.CombinePerKey(_sum_triples)
        | "StatsList" >> beam.combiners.ToList()
        | "WriteStats"
        >> beam.ParDo(
            WriteStats(run),
            files=beam.pvalue.AsSingleton(files),
            stage_stats=beam.pvalue.AsSingleton(stage_stats),
        )
    )


def stage_seconds(result) -> dict[str, float]:
    """CPU seconds spent inside each per-document step, from the finished pipeline's counters."""
    seconds = {}
    for counter in result.metrics().query(beam.metrics.MetricsFilter().with_namespace("tokenmill"))[
        "counters"
    ]:
        name = counter.key.metric.name
        if name.endswith(".microseconds"):
            stage = name.removesuffix(".microseconds")
            seconds[stage] = seconds.get(stage, 0.0) + counter.committed / 1e6
    return seconds


def clear_previous_output(output: str) -> None:
    """Remove what an earlier curate run wrote here (and nothing else), on any filesystem.

    stats.json goes first: it marks a finished run, so a clearing cut short never leaves a folder that
    looks finished. Then curated/, removed/ and rejected/ (with any temporaries of killed writers in
    them), and temporaries left at the top by a killed stats.json write.
    """
    storage.remove_file(storage.join(output, STATS))
    for part in OUTPUT_PARTS:
        if part != STATS:
            storage.remove_tree(storage.join(output, part))
    if storage.is_local(output) and os.path.isdir(storage.local_path(output)):
        root = storage.local_path(output)
        for name in os.listdir(root):
            if name.startswith(storage.TEMPORARY_PREFIX) and os.path.isfile(os.path.join(root, name)):
                os.remove(os.path.join(root, name))
