"""Reading what curate wrote, for the report pages: only what the page needs.

Per-cell document and character counts by source (two Parquet columns), with each source's duplicate-
cluster sizes and personal-data finds where the files have those columns, a seeded uniform sample of rows
per cell, examples of removed documents per reason and of rejected input per error kind (the records
through tokenmill.formats.rejected), and per evaluation set the documents the decontam stage matched, with
examples (removed/ rows by their `detail`; kept, flagged ones by their `metadata`, read only when the
stage flagged some). The JSON files (stats.json, counts.json, manifests, the plan, a run's metrics and
config) are read through tokenmill.formats. Sampling is a pure function of (seed, cell or reason, row
count), so the same inputs give the same page.
"""

from __future__ import annotations

import bisect
import io
import json
import os
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tokenmill import storage
from tokenmill.cells import parse_cell
from tokenmill.errors import FormatError
from tokenmill.formats.documents import CLUSTER_SIZE, PII, PII_KINDS, cluster_size_bin
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


#: A source's or a cell's personal-data numbers: finds per kind (PII_KINDS), and these two counts.
PII_DOCUMENTS = ("documents_checked", "documents_with_pii")


@dataclass
class SourceCount:
    """One source's documents in a cell (or, summed, in several), as the page counts them."""

    documents: int = 0
    characters: int = 0
    #: Kept documents per duplicate-cluster size bin, and the documents they stand for (see CellScan).
    cluster_sizes: dict[str, int] = field(default_factory=dict)
    represented: int = 0
    #: Finds per kind of the `pii` column and PII_DOCUMENTS; empty where no pii stage ran.
    pii: dict[str, int] = field(default_factory=dict)


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
    #: Personal data in the cell's documents (the `pii` column), as SourceCount.pii: empty without it.
    pii: dict[str, int] = field(default_factory=dict)
    #: With scan_cell(contamination=True): (row position in the cell, decontam annotation) of each row
    #: whose metadata holds one, i.e. the documents the decontam stage flagged and kept.
    contaminated: list[tuple[int, dict[str, Any]]] = field(default_factory=list)


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
        end = offset + parquet.metadata.num_rows
        local = []
        while cursor < len(wanted) and wanted[cursor] < end:
            local.append(wanted[cursor] - offset)
            cursor += 1
        rows.extend(_file_rows(parquet, local, columns))
        offset = end
    return rows


def _file_rows(parquet: pq.ParquetFile, local: Sequence[int], columns: Sequence[str]) -> list[dict[str, Any]]:
    """Rows at positions `local` (sorted) of one file, reading only the row groups that hold them (on the
    calling thread: build_overview scans several cells at once)."""
    present = [c for c in columns if c in parquet.schema_arrow.names]
    rows: list[dict[str, Any]] = []
    offset = 0
    cursor = 0
    for group in range(parquet.num_row_groups):
        if cursor >= len(local):
            break
        group_rows = parquet.metadata.row_group(group).num_rows
        in_group = []
        while cursor < len(local) and local[cursor] < offset + group_rows:
            in_group.append(local[cursor] - offset)
            cursor += 1
        if in_group:
            table = parquet.read_row_group(group, columns=present, use_threads=False)
            rows.extend(_as_rows(table.take(pa.array(in_group, type=pa.int64())), columns))
        offset += group_rows
    return rows


def _as_rows(table: pa.Table, columns: Sequence[str]) -> list[dict[str, Any]]:
    """A table's rows as dicts of `columns`, None for a column the table lacks."""
    return [{c: row.get(c) for c in columns} for row in table.to_pylist()]


def _row_count(files: Sequence[str]) -> int:
    return sum(_parquet(path).metadata.num_rows for path in files)


SAMPLE_COLUMNS = ("id", "text", "source", "url", "n_chars", "quality_score", "language")


def scan_cell(
    cell: str, files: Sequence[str], *, samples: int, seed: int, contamination: bool = False
) -> CellScan:
    """Counts by source (from the `source` and `n_chars` columns, and `dup_cluster_size` and `pii` where
    the files have them) and a seeded uniform sample of rows; with `contamination`, also the rows whose
    `metadata` holds the decontam stage's annotation (flagged documents).

    Each file is opened once and, where every row group holds a sampled row (the common case: a cell's
    files are few row groups each), read once for counts and samples together; elsewhere the count
    columns are read whole and the sample columns only from the row groups with a sampled row. Memory:
    one file's count columns plus the sampled row groups' text, whatever the cell's size. Reads stay on
    the calling thread (no Arrow thread pool under each): build_overview scans several cells at once."""
    scan = CellScan(cell=cell)
    parquets = [(path, _parquet(path)) for path in files]
    for path, parquet in parquets:
        missing = {"source", "n_chars"} - set(parquet.schema_arrow.names)
        if missing:
            raise InputError(f"{path}: missing column(s) {', '.join(sorted(missing))} (see docs/formats.md)")
    total = sum(parquet.metadata.num_rows for _, parquet in parquets)
    wanted = sample_indices(total, samples, seed, cell)
    tables: dict[str, list[pa.Table]] = {}  # by schema: the files of a cell are counted together
    cursor = 0
    for path, parquet in parquets:
        names = parquet.schema_arrow.names
        columns = ["source", "n_chars", *(c for c in (CLUSTER_SIZE, PII) if c in names)]
        extra = ["metadata"] if contamination and "metadata" in names else []
        sample_columns = [c for c in SAMPLE_COLUMNS if c in names]
        # Sampled rows of this file, by position in the file.
        first, end = scan.documents, scan.documents + parquet.metadata.num_rows
        local = []
        while cursor < len(wanted) and wanted[cursor] < end:
            local.append(wanted[cursor] - first)
            cursor += 1
        # One read for counts and samples where every row group holds a sampled row; else the count
        # columns whole and the sampled rows from their row groups.
        starts = [0]
        for group in range(parquet.num_row_groups):
            starts.append(starts[-1] + parquet.metadata.row_group(group).num_rows)
        groups = {bisect.bisect_right(starts, row) - 1 for row in local}
        try:
            if local and len(groups) == parquet.num_row_groups:
                table = parquet.read(
                    columns=list(dict.fromkeys(columns + sample_columns + extra)), use_threads=False
                )
                sampled = table.select(sample_columns).take(pa.array(local, type=pa.int64()))
                scan.samples.extend(_as_rows(sampled, SAMPLE_COLUMNS))
            else:
                table = parquet.read(columns=columns + extra, use_threads=False)
                scan.samples.extend(_file_rows(parquet, local, SAMPLE_COLUMNS))
        except (OSError, pa.ArrowException) as error:
            raise InputError(f"{path}: not a readable Parquet file ({error})") from error
        if extra:
            scan.contaminated.extend(
                (scan.documents + row, annotation)
                for row, annotation in contamination_annotations(table["metadata"])
            )
        table = table.select(columns)
        tables.setdefault(table.schema.to_string(), []).append(table)
        scan.documents += table.num_rows
    for group in tables.values():
        _count_table(scan, pa.concat_tables(group))
    scan.sources = dict(sorted(scan.sources.items()))
    scan.cluster_sizes = sorted_bins(scan.cluster_sizes)
    for count in scan.sources.values():
        count.cluster_sizes = sorted_bins(count.cluster_sizes)
    return scan


def _count_table(scan: CellScan, table: pa.Table) -> None:
    """Add a cell's rows (one or several files with the same columns) to its counts: documents,
    characters and personal data per source, and the cluster sizes.

    Grouped with numpy over the dictionary codes of `source`: a cell is one small grouping, and acero's
    fixed cost per grouping was most of a small cell's counting. Memory: a few integers per row."""
    source = pc.fill_null(table["source"], "(none)").combine_chunks().dictionary_encode()
    names = source.dictionary.to_pylist()
    codes = source.indices.to_numpy(zero_copy_only=False)
    documents = np.bincount(codes, minlength=len(names))
    characters = _sum_by(codes, table["n_chars"], len(names))
    pii = {
        key: _sum_by(codes, values, len(names))
        for key, values in (pii_columns(table[PII]) if PII in table.column_names else {}).items()
    }
    for code, name in enumerate(names):
        count = scan.sources.setdefault(name, SourceCount())
        count.documents += int(documents[code])
        count.characters += int(characters[code])
        numbers = {key: int(sums[code]) for key, sums in pii.items()}
        if numbers.get("documents_checked"):
            add_numbers(count.pii, numbers)
            add_numbers(scan.pii, numbers)
    scan.characters += int(characters.sum())
    if CLUSTER_SIZE in table.column_names:
        _count_cluster_sizes(scan, names, codes, table[CLUSTER_SIZE])


def _sum_by(codes: np.ndarray, values: pa.ChunkedArray, groups: int) -> np.ndarray:
    """Sums of an integer column per group code (nulls count 0), exact in int64."""
    sums = np.zeros(groups, dtype=np.int64)
    np.add.at(sums, codes, pc.fill_null(values, 0).to_numpy().astype(np.int64, copy=False))
    return sums


def add_numbers(total: dict[str, int], numbers: dict[str, int]) -> None:
    """`numbers` added into `total`, key by key (histograms, finds per kind)."""
    for key, value in numbers.items():
        total[key] = total.get(key, 0) + value


def sorted_bins(histogram: dict[str, int]) -> dict[str, int]:
    """A cluster-size histogram in the order of its bins ("1", "2", ..., "5-8", "9-16", ...)."""
    return dict(sorted(histogram.items(), key=lambda item: int(item[0].split("-", 1)[0])))


def _count_cluster_sizes(
    scan: CellScan, names: list[str], codes: np.ndarray, column: pa.ChunkedArray
) -> None:
    """Add a cell's `dup_cluster_size` column (a null counts as 1) to its histogram and its sources',
    `codes` being each row's source in `names`."""
    sizes = pc.fill_null(column, 1).to_numpy().astype(np.int64, copy=False)
    pairs, counts = np.unique(np.stack([codes.astype(np.int64), sizes], axis=1), axis=0, return_counts=True)
    for (code, size), count in zip(pairs.tolist(), counts.tolist(), strict=True):
        size_bin = cluster_size_bin(size)
        source = scan.sources.setdefault(names[code], SourceCount())
        for histogram in (scan.cluster_sizes, source.cluster_sizes):
            histogram[size_bin] = histogram.get(size_bin, 0) + count
        scan.represented += size * count
        source.represented += size * count


def pii_columns(column: pa.ChunkedArray) -> dict[str, pa.ChunkedArray]:
    """A `pii` column as the numbers summed per source: the finds per kind (PII_KINDS), 1 per document
    the stage checked (`pii` not null) and 1 per document with a find (PII_DOCUMENTS); {} when every
    row's `pii` is null (no pii stage ran)."""
    if column.null_count == len(column):
        return {}
    finds = {kind: pc.fill_null(pc.struct_field(column, kind), 0) for kind in PII_KINDS}
    total = finds[PII_KINDS[0]]
    for kind in PII_KINDS[1:]:
        total = pc.add(total, finds[kind])
    return {
        **finds,
        "documents_checked": pc.cast(pc.is_valid(column), pa.int64()),
        "documents_with_pii": pc.cast(pc.greater(total, 0), pa.int64()),
    }


def pii_by_source(table: pa.Table) -> dict[str, dict[str, int]]:
    """Per source of a table with `source` and `pii` columns, the numbers of `pii_columns` summed;
    sources without a checked document are left out."""
    pii = pii_columns(table[PII])
    if not pii:
        return {}
    grouped = pa.table({"source": table["source"], **pii}).group_by("source")
    result = {}
    for row in grouped.aggregate([(key, "sum") for key in pii]).to_pylist():
        numbers = {key: int(row[f"{key}_sum"] or 0) for key in pii}
        if numbers["documents_checked"]:
            result[row["source"]] = numbers
    return result


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


#: The removals of the decontam and pii stages, as `<stage>/<reason>` (removed/stage=.../reason=.../).
DECONTAM_REMOVED = "decontam/contaminated"
PII_REMOVED = "pii/pii_density"


@dataclass
class ContaminationScan:
    """Documents the decontam stage matched, per evaluation set: `removed`, the removed/ rows whose detail
    names the set; `flagged`, the curated documents whose metadata names it (looked for only when asked:
    it reads every curated file's metadata column); `examples`, drawn uniformly at random (seeded) from
    both, each row with its `action` (removed or flagged) and its `match` with the set."""

    removed: dict[str, int] = field(default_factory=dict)
    flagged: dict[str, int] = field(default_factory=dict)
    flagged_scanned: bool = False
    examples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


def _json_object(value: Any) -> dict[str, Any]:
    try:
        parsed = json.loads(value) if value else {}
    except (TypeError, ValueError):
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _set_matches(found: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The decontam annotation's best match per evaluation set ({} for a document it did not match)."""
    matches = found.get("matches")
    if not isinstance(matches, list):
        return {}
    return {str(m["eval_set"]): m for m in matches if isinstance(m, dict) and m.get("eval_set") is not None}


def contamination_annotations(metadata: pa.ChunkedArray) -> list[tuple[int, dict[str, Any]]]:
    """(row, annotation) of the rows of a `metadata` column that hold the decontam stage's
    `contamination` key; the JSON is parsed only for those."""
    marked = pc.match_substring(pc.fill_null(metadata, ""), '"contamination"')
    found = []
    for row in pc.indices_nonzero(marked).to_pylist():
        annotation = _json_object(metadata[row].as_py()).get("contamination")
        if isinstance(annotation, dict):
            found.append((row, annotation))
    return found


def scan_contamination(
    removed: dict[str, RemovedReason],
    flagged: dict[str, CellScan] | None,
    cell_files: dict[str, list[str]],
    *,
    examples: int,
    seed: int,
) -> ContaminationScan:
    """Per evaluation set, the documents decontam removed (removed/stage=decontam, by `detail`) and, with
    `flagged` (cell scans made with contamination=True), those it flagged and kept, with examples. A
    removal that dedupe_clusters re-filed under decontam (a copy of a contaminated document,
    `removed_with`) names no set and is not counted."""
    scan = ContaminationScan(flagged_scanned=flagged is not None)
    # set -> (where: "removed" or a cell, row position there, match); the files of each place in order.
    found: dict[str, list[tuple[str, int, dict[str, Any]]]] = {}
    places = {"removed": removed[DECONTAM_REMOVED].files if DECONTAM_REMOVED in removed else []}
    offset = 0
    for path in places["removed"]:
        details = _parquet(path).read(columns=["detail"]).column("detail").to_pylist()
        for row, detail in enumerate(details):
            for name, match in _set_matches(_json_object(detail)).items():
                found.setdefault(name, []).append(("removed", offset + row, match))
                scan.removed[name] = scan.removed.get(name, 0) + 1
        offset += len(details)
    for cell, cell_scan in sorted((flagged or {}).items()):
        places[cell] = cell_files[cell]
        for position, annotation in cell_scan.contaminated:
            for name, match in _set_matches(annotation).items():
                found.setdefault(name, []).append((cell, position, match))
                scan.flagged[name] = scan.flagged.get(name, 0) + 1
    chosen = {
        name: [entries[i] for i in sample_indices(len(entries), examples, seed, f"contamination:{name}")]
        for name, entries in sorted(found.items())
    }
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    for place, files in places.items():
        wanted = sorted({position for entries in chosen.values() for p, position, _ in entries if p == place})
        if wanted:
            read = read_rows(files, wanted, ["id", "text", "source", "url"])
            rows.update({(place, position): row for position, row in zip(wanted, read, strict=True)})
    scan.examples = {
        name: [
            {
                **rows[(place, position)],
                "action": "removed" if place == "removed" else "flagged",
                "match": match,
            }
            for place, position, match in entries
        ]
        for name, entries in chosen.items()
    }
    scan.removed, scan.flagged = dict(sorted(scan.removed.items())), dict(sorted(scan.flagged.items()))
    return scan


def scan_removed_pii(removed: dict[str, RemovedReason]) -> dict[str, dict[str, int]]:
    """Per source, the documents the pii stage removed (removed/stage=pii/reason=pii_density; counted as
    `documents_checked`) and their finds per kind, from the `pii` column."""
    totals: dict[str, dict[str, int]] = {}
    for path in removed[PII_REMOVED].files if PII_REMOVED in removed else []:
        parquet = _parquet(path)
        if PII not in parquet.schema_arrow.names:
            continue
        table = parquet.read(columns=["source", PII])
        table = table.set_column(0, "source", pc.fill_null(table["source"], "(none)"))
        for source, numbers in pii_by_source(table).items():
            add_numbers(totals.setdefault(source, {}), numbers)
    return dict(sorted(totals.items()))
