"""WritePartitioned writes every file of each partition, sorted, from one input or several
(pipelines/sinks.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.util import assert_that, equal_to

from tokenmill import storage
from tokenmill.pipelines.local_runner import BoundedBundleFnApiRunner
from tokenmill.pipelines.sinks import OutputKind, WritePartitioned, part_name, stable_hash

RECORD_BYTES = 10
TARGET_FILE_BYTES = 20


def json_lines_writer():
    """A writer of rows as JSON lines, made here so that worker processes get it by value (they cannot
    import this test module)."""

    def write_json_lines(path: str, rows: list[dict]) -> None:
        storage.write_bytes(path, "".join(json.dumps(row) + "\n" for row in rows).encode())

    return write_json_lines


def _ids_missing_one_file(count: int, files: int, missing: int) -> list[str]:
    """`count` ids none of which hashes to file `missing` of `files`: that file gets no record."""
    ids = (f"doc-{number}" for number in range(10_000))
    return [identifier for identifier in ids if stable_hash(identifier) % files != missing][:count]


def _write(tmp_path: Path, parts: list[list[tuple[str, dict]]], workers: int) -> list[tuple[str, int]]:
    """WritePartitioned of `parts` (one input PCollection each, all of one kind) under tmp_path; the
    (file, rows) it must output, which it is checked to."""
    mode = "multi_processing" if workers > 1 else "in_memory"
    options = PipelineOptions([f"--direct_num_workers={workers}", f"--direct_running_mode={mode}"])
    kind = OutputKind("lines", ".jsonl", json_lines_writer(), lambda row: row["id"], lambda row: RECORD_BYTES)
    with beam.Pipeline(runner=BoundedBundleFnApiRunner(), options=options) as pipeline:
        inputs = tuple(
            pipeline | f"Create{index}" >> beam.Create(part, reshuffle=False)
            for index, part in enumerate(parts)
        )
        files = inputs | WritePartitioned(str(tmp_path), [kind] * len(inputs), TARGET_FILE_BYTES)
        expected = _expected_files(parts)
        assert_that(files, equal_to(expected))
    return expected


def _expected_files(parts: list[list[tuple[str, dict]]]) -> list[tuple[str, int]]:
    by_partition: dict[str, list[dict]] = {}
    for partition, row in (pair for part in parts for pair in part):
        by_partition.setdefault(partition, []).append(row)
    files = []
    for partition, rows in by_partition.items():
        count = max(1, math.ceil(len(rows) * RECORD_BYTES / TARGET_FILE_BYTES))
        for index in range(count):
            rows_here = [row for row in rows if stable_hash(row["id"]) % count == index]
            files.append((f"{partition}/{part_name(index, count, '.jsonl')}", len(rows_here)))
    return files


def test_every_file_is_written_sorted_even_one_no_record_hashed_to_from_several_inputs(tmp_path):
    ids = _ids_missing_one_file(6, files=3, missing=2)  # 60 bytes at 20 a file: 3 files, the last empty
    big = [("curated/a", {"id": identifier, "n": number}) for number, identifier in enumerate(ids)]
    small = [("curated/b", {"id": "only", "n": 0})]
    expected = _write(tmp_path, [big[:4], big[4:] + small], workers=1)
    assert ("curated/a/part-00002-of-00003.jsonl", 0) in expected
    for relative, rows in expected:
        lines = (tmp_path / relative).read_text().splitlines()
        assert len(lines) == rows
        assert [json.loads(line)["id"] for line in lines] == sorted(json.loads(line)["id"] for line in lines)
    written = sorted(json.loads(line)["id"] for path in tmp_path.rglob("*.jsonl") for line in path.open())
    assert written == sorted([*ids, "only"])


def test_the_same_records_give_the_same_bytes_whatever_the_inputs_and_workers(tmp_path):
    ids = _ids_missing_one_file(9, files=5, missing=1)
    records = [("removed/x", {"id": identifier, "n": number}) for number, identifier in enumerate(ids)]
    _write(tmp_path / "one", [records], workers=1)
    _write(tmp_path / "three", [records[6:], records[:3], records[3:6]], workers=2)
    one = {
        path.relative_to(tmp_path / "one"): path.read_bytes() for path in (tmp_path / "one").rglob("*.jsonl")
    }
    three = {
        path.relative_to(tmp_path / "three"): path.read_bytes()
        for path in (tmp_path / "three").rglob("*.jsonl")
    }
    assert one == three and len(one) == 5 and b"" in one.values()


def test_kinds_keep_their_own_writer_suffix_and_order_in_one_write(tmp_path):
    """Two kinds through one WritePartitioned: each partition's files get its kind's suffix and order."""
    reverse = OutputKind(
        "reverse", ".txt", json_lines_writer(), lambda row: "".join(chr(255 - ord(c)) for c in row["id"]), len
    )
    forward = OutputKind("forward", ".jsonl", json_lines_writer(), lambda row: row["id"], lambda row: 1)
    rows = [{"id": identifier} for identifier in ("a", "c", "b")]
    options = PipelineOptions(["--direct_num_workers=1", "--direct_running_mode=in_memory"])
    with beam.Pipeline(runner=BoundedBundleFnApiRunner(), options=options) as pipeline:
        parts = tuple(
            pipeline | f"Create{name}" >> beam.Create([(name, row) for row in rows]) for name in ("f", "r")
        )
        files = parts | WritePartitioned(str(tmp_path), [forward, reverse], 1 << 20)
        assert_that(files, equal_to([("f/part-00000-of-00001.jsonl", 3), ("r/part-00000-of-00001.txt", 3)]))
    ids = {
        name: [json.loads(line)["id"] for line in (tmp_path / name).glob("part-*").__next__().open()]
        for name in "fr"
    }
    assert ids == {"f": ["a", "b", "c"], "r": ["c", "b", "a"]}
