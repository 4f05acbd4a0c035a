"""Deterministic, size-bounded, atomic writers for partitioned output (curated/, removed/, rejected/).

Records are grouped by partition (a folder relative to the output, such as
`curated/domain=web/quality=3`). Each partition's byte total decides its file count
m = ceil(bytes / target_file_bytes); a record goes to file hash(record key) mod m, and each file is sorted
by record key before it is written, so the same input gives the same bytes whatever the worker count or
the order of arrival. Every one of the m files is
written (an empty one if no record hashed there), each atomically, named `part-<n>-of-<m>`.

At scale every file is one group on one worker: with the default 256 MB target a group fits in memory.
"""

from __future__ import annotations

import hashlib
import io
import math
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import apache_beam as beam
import pyarrow as pa
import pyarrow.parquet as pq
from apache_beam.transforms.window import GlobalWindows

from tokenmill import storage

PARQUET_ROW_GROUP_ROWS = 16_384


def stable_hash(text: str) -> int:
    """A 64-bit hash that is the same in every process and run (Python's hash() is salted)."""
    return int.from_bytes(
        hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little"
    )


def part_name(index: int, count: int, suffix: str) -> str:
    return f"part-{index:05d}-of-{count:05d}{suffix}"


def write_parquet(path: str, rows: list[dict], schema: pa.Schema) -> None:
    table = pa.Table.from_pylist(rows, schema=schema)
    buffer = io.BytesIO()
    pq.write_table(
        table, buffer, compression="zstd", row_group_size=PARQUET_ROW_GROUP_ROWS, write_statistics=True
    )
    storage.write_bytes(path, buffer.getvalue())


@dataclass(frozen=True)
class OutputKind:
    """One kind of partitioned output (curated documents, removed ones, rejected input): its name, its
    files' suffix and writer, and each record's sort key and size in bytes (what file counts are made of)."""

    name: str
    suffix: str
    write: Callable[[str, list[dict]], None]
    record_key: Callable[[dict], str]
    record_bytes: Callable[[dict], int]


class _WriteFile(beam.DoFn):
    def __init__(self, output_dir: str, kinds: dict[str, OutputKind]):
        self.output_dir = output_dir
        self.kinds = kinds
        self.files_written = beam.metrics.Metrics.counter("tokenmill", "files_written")

    def process(self, element: tuple[tuple[tuple[str, str], int, int], Iterable[dict | None]]):
        ((kind_name, partition), index, count), records = element
        kind = self.kinds[kind_name]
        rows = sorted((record for record in records if record is not None), key=kind.record_key)
        relative = f"{partition}/{part_name(index, count, kind.suffix)}"
        kind.write(storage.join(self.output_dir, relative), rows)
        self.files_written.inc()
        yield relative, len(rows)


class SumPerBundle(beam.DoFn):
    """(key, value) pairs in; at the end of each bundle, one (key, sum of its values) per key seen, summed
    with `add`. Put before a Flatten that the runner materializes (the local runner materializes every
    Flatten of several inputs): what crosses is one element per key per bundle, not one per record, as a
    combiner's lifted pre-combine would do without the Flatten. Memory: one value per key of the bundle."""

    def __init__(self, add: Callable[[Any, Any], Any] = operator.add) -> None:
        self.add = add

    def start_bundle(self) -> None:
        self.sums: dict = {}

    def process(self, pair: tuple) -> Iterable[Any]:
        # Nothing is emitted per element; Beam (2.78 on) refuses a DoFn whose process is hinted to
        # return None, so the empty output is said as an empty iterable.
        key, value = pair
        self.sums[key] = self.add(self.sums[key], value) if key in self.sums else value
        return ()

    def finish_bundle(self):
        for key, total in self.sums.items():
            yield GlobalWindows.windowed_value((key, total))
        self.sums = {}


def _assign_file(
    pair: tuple[tuple[str, str], dict | int], kinds: dict[str, OutputKind], counts: dict
) -> tuple[tuple[tuple[str, str], int, int], dict | None]:
    """A record's file, ((kind, partition), index, count), and the record; a placeholder ((kind,
    partition), file index) keeps its index and stands for no record."""
    key, value = pair
    count = counts[key]
    if isinstance(value, int):
        return (key, value, count), None
    return (key, stable_hash(kinds[key[0]].record_key(value)) % count, count), value


class WritePartitioned(beam.PTransform):
    """Write (partition, record) pairs as size-bounded files; outputs (path relative to the output, rows)
    per file.

    The input is a tuple of PCollections, part i of kind `kinds[i]` (kinds may repeat: every stage's
    removals are of one kind). All kinds go through one group by file, so that their files are written in
    one stage, spread over every worker: on a runner that runs stages one at a time, a stage per kind
    would leave workers idle while one writes a kind's only file. The records wait, materialized, for
    their partitions' byte totals (a side input: a file's index needs its partition's file count); one
    placeholder per file joins them in that same materialization, so that every file is written even
    where no record hashed to it, and a record crosses the runner's shuffle twice: there and in the group
    by file (on the local runner every Flatten of several inputs is materialized, so one after AssignFile
    would be a third crossing). Memory: a file's records on one worker (at most about
    `target_file_bytes`); shuffle: the records' bytes twice, plus one small element per file.
    """

    def __init__(self, output_dir: str, kinds: Sequence[OutputKind], target_file_bytes: int):
        super().__init__()
        self.output_dir = output_dir
        self.part_kinds = list(kinds)
        self.kinds = {kind.name: kind for kind in self.part_kinds}
        self.target_file_bytes = target_file_bytes

    def expand(self, parts):
        if not isinstance(parts, tuple) or len(parts) != len(self.part_kinds):
            raise ValueError(f"WritePartitioned: {len(self.part_kinds)} kinds need as many PCollections")
        target = self.target_file_bytes
        # Each record keyed by (kind, partition): a partition's files and its kind's writer go together.
        keyed = [
            part | f"Key{index}" >> beam.Map(lambda pair, name=kind.name: ((name, pair[0]), pair[1]))
            for index, (part, kind) in enumerate(zip(parts, self.part_kinds))
        ]
        # Byte totals per (kind, partition) and bundle, made where the records are: what crosses to the
        # sum is one number per partition per bundle, not one per record.
        sizes = [
            part
            | f"Bytes{index}" >> beam.Map(lambda pair, size=kind.record_bytes: (pair[0], size(pair[1])))
            | f"BundleBytes{index}" >> beam.ParDo(SumPerBundle())
            for index, (part, kind) in enumerate(zip(keyed, self.part_kinds))
        ]
        all_sizes = sizes[0] if len(sizes) == 1 else tuple(sizes) | "AllSizes" >> beam.Flatten()
        file_counts = (
            all_sizes
            | "SumBytes" >> beam.CombinePerKey(sum)
            | "FileCount" >> beam.Map(lambda pair: (pair[0], max(1, math.ceil(pair[1] / target))))
        )
        every_file = file_counts | "EveryFile" >> beam.FlatMap(
            lambda pair: [(pair[0], index) for index in range(pair[1])]
        )
        return (
            (*keyed, every_file)
            | "Together" >> beam.Flatten()
            | "AssignFile" >> beam.Map(_assign_file, kinds=self.kinds, counts=beam.pvalue.AsDict(file_counts))
            | "GroupByFile" >> beam.GroupByKey()
            | "Write" >> beam.ParDo(_WriteFile(self.output_dir, self.kinds))
        )


class StatsCombine(beam.CombineFn):
    """A stage's stats: sums dicts of numbers (histograms nested one level), taking the maximum for the keys
    in `max_keys` (largest component, largest bucket, ...). O(keys) memory, merged across workers."""

    def __init__(self, max_keys: Iterable[str] = ()) -> None:
        self.max_keys = frozenset(max_keys)

    def create_accumulator(self) -> dict:
        return {}

    def add_input(self, accumulator: dict, element: dict) -> dict:
        for key, value in element.items():
            if isinstance(value, dict):
                nested = accumulator.setdefault(key, {})
                for inner, number in value.items():
                    nested[inner] = nested.get(inner, 0) + number
            elif key in self.max_keys:
                accumulator[key] = max(accumulator.get(key, 0), value)
            else:
                accumulator[key] = accumulator.get(key, 0) + value
        return accumulator

    def merge_accumulators(self, accumulators: Iterable[dict]) -> dict:
        merged: dict = {}
        for accumulator in accumulators:
            self.add_input(merged, accumulator)
        return merged

    def extract_output(self, accumulator: dict) -> dict:
        return accumulator
