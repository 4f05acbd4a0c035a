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
from collections.abc import Callable, Iterable

import apache_beam as beam
import pyarrow as pa
import pyarrow.parquet as pq

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


class _WriteFile(beam.DoFn):
    def __init__(
        self,
        output_dir: str,
        suffix: str,
        write: Callable[[str, list[dict]], None],
        record_key: Callable[[dict], str],
    ):
        self.output_dir = output_dir
        self.suffix = suffix
        self.write = write
        self.record_key = record_key
        self.files_written = beam.metrics.Metrics.counter("tokenmill", "files_written")

    def process(self, element: tuple[tuple[str, int, int], Iterable[dict | None]]):
        (partition, index, count), records = element
        rows = sorted((record for record in records if record is not None), key=self.record_key)
        relative = f"{partition}/{part_name(index, count, self.suffix)}"
        self.write(storage.join(self.output_dir, relative), rows)
        self.files_written.inc()
        yield relative, len(rows)


class WritePartitioned(beam.PTransform):
    """Write (partition, record) pairs as size-bounded files; outputs (path relative to the output, rows)
    per file."""

    def __init__(
        self,
        output_dir: str,
        suffix: str,
        write: Callable[[str, list[dict]], None],
        record_key: Callable[[dict], str],
        record_bytes: Callable[[dict], int],
        target_file_bytes: int,
    ):
        super().__init__()
        self.output_dir = output_dir
        self.suffix = suffix
        self.write = write
        self.record_key = record_key
        self.record_bytes = record_bytes
        self.target_file_bytes = target_file_bytes

    def expand(self, keyed_records):
        target = self.target_file_bytes
        record_key, record_bytes = self.record_key, self.record_bytes
        file_counts = (
            keyed_records
            | "Bytes" >> beam.Map(lambda pair: (pair[0], record_bytes(pair[1])))
            | "SumBytes" >> beam.CombinePerKey(sum)
            | "FileCount" >> beam.Map(lambda pair: (pair[0], max(1, math.ceil(pair[1] / target))))
        )
        every_file = file_counts | "EveryFile" >> beam.FlatMap(
            lambda pair: [((pair[0], index, pair[1]), None) for index in range(pair[1])]
        )
        assigned = keyed_records | "AssignFile" >> beam.Map(
            lambda pair, counts: (
                (pair[0], stable_hash(record_key(pair[1])) % counts[pair[0]], counts[pair[0]]),
                pair[1],
            ),
            counts=beam.pvalue.AsDict(file_counts),
        )
        return (
            (assigned, every_file)
            | "Together" >> beam.Flatten()
            | "GroupByFile" >> beam.GroupByKey()
            | "Write" >> beam.ParDo(_WriteFile(self.output_dir, self.suffix, self.write, record_key))
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
