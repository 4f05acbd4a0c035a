"""Reading what curate wrote, for the report pages: only what the page needs.

Per-cell document and character counts by source (two Parquet columns), a seeded uniform sample of rows
per cell, examples of removed documents per reason and of rejected input per error kind (the records
through tokenmill.formats.rejected). The JSON files (stats.json, counts.json, manifests, the plan, a run's
metrics and config) are read through tokenmill.formats. Sampling is a pure function of (seed, cell or
reason, row count), so the same inputs give the same page.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tokenmill import storage
from tokenmill.cells import parse_cell
from tokenmill.errors import FormatError
from tokenmill.formats.documents import CLUSTER_SIZE, cluster_size_bin
from tokenmill.formats.rejected import RejectedRecord, read_rejected

_PARTITION = re.compile(r"(?:^|/)(domain=[^/]+/quality=[^/]+)/[^/]+\.parquet$")
_REMOVED = re.compile(r"(?:^|/)stage=([^/]+)/reason=([^/]+)/[^/]+\.parquet$")
RAW_PREVIEW_BYTES = 4096


class InputError(ValueError):
    """An input that is missing or does not follow docs/formats.md; the message names the file."""


@dataclass(frozen=True)
class CurateLayout:
    """Where curate's outputs are: `curated/`, `removed/`, `rejected/` and `stats.json` side by side."""

    curated: str
    removed: str
    rejected: str
    stats: str


def locate_curate_output(path: str) -> CurateLayout:
    """Accept either curate's output folder or its `curated/` folder (whose siblings hold the rest)."""
    path = path.rstrip("/") or "/"
    if storage.exists(storage.join(path, "curated")):
        root = path
        curated = storage.join(path, "curated")
    elif storage.exists(path) and os.path.basename(path) == "curated":
        root = os.path.dirname(path) if storage.is_local(path) else path.rsplit("/", 1)[0]
        curated = path
    elif storage.exists(path) and storage.expand_glob(
        storage.join(path, "domain=*", "quality=*", "*.parquet")
    ):
        root, curated = path, path
    else:
        raise InputError(
            f"{path}: no curated output here (expected {path}/curated/domain=*/quality=*/*.parquet)"
        )
    return CurateLayout(
        curated=curated,
        removed=storage.join(root, "removed"),
        rejected=storage.join(root, "rejected"),
        stats=storage.join(root, "stats.json"),
    )


def read_json_file(path: str, what: str) -> Any:
    try:
        return storage.read_json(path)
    except FileNotFoundError as error:
        raise InputError(f"{path}: {what} not found") from error
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InputError(f"{path}: {what} is not valid JSON ({error})") from error


def cell_files(curated_dir: str) -> dict[str, list[str]]:
    """Parquet files per cell name, both sorted; files whose folder is not a cell are refused."""
    cells: dict[str, list[str]] = {}
    for path in storage.expand_glob(storage.join(curated_dir, "domain=*", "quality=*", "*.parquet")):
        match = _PARTITION.search(path.replace(os.sep, "/"))
        if not match:
            continue
        try:
            domain, quality = parse_cell(match.group(1))
        except ValueError as error:
            raise InputError(f"{path}: {error}") from error
        cells.setdefault(f"domain={domain}/quality={quality}", []).append(path)
    return {cell: sorted(files) for cell, files in sorted(cells.items())}


def _parquet(path: str) -> pq.ParquetFile:
    try:
        if storage.is_local(path):
            return pq.ParquetFile(storage.local_path(path))
        with storage.open_file(path) as handle:
            return pq.ParquetFile(io.BytesIO(handle.read()))
    except (OSError, pa.ArrowException) as error:
        raise InputError(f"{path}: not a readable Parquet file ({error})") from error


@dataclass
class SourceCount:
    documents: int = 0
    characters: int = 0


@dataclass
class CellScan:
    """What the page shows of one curated cell: counts by source and sampled rows."""

    cell: str
    documents: int = 0
    characters: int = 0
    sources: dict[str, SourceCount] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)
    #: Kept documents per duplicate-cluster size bin ("1", "2", ..., "5-8", ...; formats.documents), from
    #: the `dup_cluster_size` column; empty for curated files written before it existed.
    cluster_sizes: dict[str, int] = field(default_factory=dict)
    #: The documents those clusters stand for: the sum of `dup_cluster_size` (0 without the column).
    represented: int = 0


def seeded_rng(seed: int, key: str) -> random.Random:
    # random.Random seeded with a str hashes it with SHA-512: stable across runs, platforms and
    # PYTHONHASHSEED, which is what byte-identical output needs.
    return random.Random(f"tokenmill-report:{seed}:{key}")


def sample_indices(total: int, k: int, seed: int, key: str) -> list[int]:
    """k distinct row indices out of `total`, uniformly at random, sorted; all rows when k >= total."""
    if k <= 0 or total <= 0:
        return []
    if k >= total:
        return list(range(total))
    return sorted(seeded_rng(seed, key).sample(range(total), k))


def read_rows(files: Sequence[str], indices: Sequence[int], columns: Sequence[str]) -> list[dict[str, Any]]:
    """Rows at positions `indices` (sorted) of the files taken in order, reading only their row groups."""
    wanted = list(indices)
    rows: list[dict[str, Any]] = []
    offset = 0
    cursor = 0
    for path in files:
        if cursor >= len(wanted):
            break
        parquet = _parquet(path)
        present = [c for c in columns if c in parquet.schema_arrow.names]
        for group in range(parquet.num_row_groups):
            group_rows = parquet.metadata.row_group(group).num_rows
            local = []
            while cursor < len(wanted) and wanted[cursor] < offset + group_rows:
                local.append(wanted[cursor] - offset)
                cursor += 1
            if local:
                table = parquet.read_row_group(group, columns=present).take(pa.array(local, type=pa.int64()))
                for row in table.to_pylist():
                    rows.append({c: row.get(c) for c in columns})
            offset += group_rows
    return rows


def _row_count(files: Sequence[str]) -> int:
    return sum(_parquet(path).metadata.num_rows for path in files)


def scan_cell(cell: str, files: Sequence[str], *, samples: int, seed: int) -> CellScan:
    """Counts by source (from the `source` and `n_chars` columns) and a seeded uniform sample of rows."""
    scan = CellScan(cell=cell)
    for path in files:
        parquet = _parquet(path)
        missing = {"source", "n_chars"} - set(parquet.schema_arrow.names)
        if missing:
            raise InputError(f"{path}: missing column(s) {', '.join(sorted(missing))} (see docs/formats.md)")
        table = parquet.read(columns=["source", "n_chars"])
        if CLUSTER_SIZE in parquet.schema_arrow.names:
            _count_cluster_sizes(scan, parquet.read(columns=[CLUSTER_SIZE]).column(CLUSTER_SIZE))
        grouped = table.group_by("source").aggregate(
            [("n_chars", "sum"), ("n_chars", "count", pc.CountOptions(mode="all"))]
        )
        for row in grouped.to_pylist():
            source = row["source"] if row["source"] is not None else "(none)"
            count = scan.sources.setdefault(source, SourceCount())
            count.documents += int(row["n_chars_count"])
            count.characters += int(row["n_chars_sum"] or 0)
        scan.documents += table.num_rows
        scan.characters += int(pc.sum(table["n_chars"]).as_py() or 0)
    indices = sample_indices(scan.documents, samples, seed, cell)
    scan.samples = read_rows(
        files, indices, ["id", "text", "source", "url", "n_chars", "quality_score", "language"]
    )
    scan.sources = dict(sorted(scan.sources.items()))
    scan.cluster_sizes = dict(sorted(scan.cluster_sizes.items(), key=lambda item: _bin_start(item[0])))
    return scan


def _bin_start(size_bin: str) -> int:
    return int(size_bin.split("-", 1)[0])


def _count_cluster_sizes(scan: CellScan, sizes: pa.ChunkedArray) -> None:
    """Add one file's `dup_cluster_size` column to the cell's histogram (a null counts as 1)."""
    counted = pc.value_counts(pc.fill_null(sizes, 1)).to_pylist()
    for entry in counted:
        size, count = int(entry["values"]), int(entry["counts"])
        size_bin = cluster_size_bin(size)
        scan.cluster_sizes[size_bin] = scan.cluster_sizes.get(size_bin, 0) + count
        scan.represented += size * count


@dataclass
class RemovedReason:
    stage: str
    reason: str
    files: list[str]
    documents: int = 0
    examples: list[dict[str, Any]] = field(default_factory=list)


def scan_removed(removed_dir: str, *, examples: int, seed: int) -> dict[str, RemovedReason]:
    """Examples of removed documents per `<stage>/<reason>`, drawn uniformly at random (seeded)."""
    reasons: dict[str, RemovedReason] = {}
    for path in storage.expand_glob(storage.join(removed_dir, "stage=*", "reason=*", "*.parquet")):
        match = _REMOVED.search(path.replace(os.sep, "/"))
        if not match:
            continue
        key = f"{match.group(1)}/{match.group(2)}"
        reasons.setdefault(key, RemovedReason(match.group(1), match.group(2), [])).files.append(path)
    for key, reason in sorted(reasons.items()):
        reason.files.sort()
        reason.documents = _row_count(reason.files)
        indices = sample_indices(reason.documents, examples, seed, f"removed:{key}")
        reason.examples = read_rows(reason.files, indices, ["id", "text", "source", "url", "detail"])
    return dict(sorted(reasons.items()))


def scan_rejected(rejected_dir: str, *, examples: int, seed: int) -> dict[str, dict[str, Any]]:
    """Counts and examples of rejected input per error kind (reservoir sampling, seeded per kind)."""
    kinds: dict[str, dict[str, Any]] = {}
    files = [
        *storage.expand_glob(storage.join(rejected_dir, "*.jsonl.zst")),
        *storage.expand_glob(storage.join(rejected_dir, "*.jsonl")),
    ]
    for path in sorted(files):
        try:
            for _, record in read_rejected(path):
                kind = record.error_kind or "unknown"
                entry = kinds.setdefault(
                    kind, {"documents": 0, "examples": [], "rng": seeded_rng(seed, kind)}
                )
                entry["documents"] += 1
                example = _rejected_example(record)
                # Reservoir sampling: each record of a kind ends up in the examples with equal chance.
                if len(entry["examples"]) < examples:
                    entry["examples"].append(example)
                elif examples > 0:
                    slot = entry["rng"].randrange(entry["documents"])
                    if slot < examples:
                        entry["examples"][slot] = example
        except FormatError as error:
            raise InputError(str(error)) from error
    for entry in kinds.values():
        entry.pop("rng")
    return dict(sorted(kinds.items()))


def _rejected_example(record: RejectedRecord) -> dict[str, Any]:
    raw, encoded = record.raw, record.raw_base64
    return {
        "file": record.file,
        "line": record.line,
        "offset": record.offset,
        "error": record.error,
        "raw": raw[:RAW_PREVIEW_BYTES] if raw is not None else None,
        "raw_base64": encoded[:RAW_PREVIEW_BYTES] if encoded is not None else None,
        "raw_truncated": record.raw_truncated
        or any(value is not None and len(value) > RAW_PREVIEW_BYTES for value in (raw, encoded)),
    }
