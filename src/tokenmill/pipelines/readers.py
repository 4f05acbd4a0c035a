"""Reading raw corpora: one input file in, documents and rejected records out.

Formats, by extension: JSON Lines (`.jsonl`, `.json`, `.ndjson`, plain, `.gz` or `.zst`) and Parquet.
zstd goes through the `zstandard` package (streaming, so a truncated frame is detected where it ends),
gzip through the standard library; files are opened through `tokenmill.storage`, so gs:// works at scale.

Every record read becomes exactly one of: a document (a dict with the DESIGN.md document columns) or a
rejected record (`kind == "rejected"`) naming the file, the line or byte offset, and the error. A file
that cannot be read at all (unknown extension, unreadable, truncated) yields one rejected record for
what could not be read, after the documents that could.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

import zstandard

from tokenmill import storage

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
COMPRESSIONS = ("", ".gz", ".zst")
PARQUET_SUFFIXES = (".parquet",)
RAW_LIMIT = 64 * 1024
PARQUET_BATCH_ROWS = 1024


@dataclass(frozen=True)
class InputFields:
    """Which fields of an input record hold the text, the id and the URL."""

    text: str = "text"
    id: str | None = "id"
    url: str | None = "url"


def input_format(path: str) -> str | None:
    """'jsonl', 'jsonl.gz', 'jsonl.zst', 'parquet', 'warc', 'warc.gz', or None for an unknown extension."""
    name = os.path.basename(path).lower()
    for suffix in (".warc", ".warc.gz"):  # web crawls: tokenmill.pipelines.warc
        if name.endswith(suffix):
            return suffix[1:]
    for suffix in PARQUET_SUFFIXES:
        if name.endswith(suffix):
            return "parquet"
    for compression in COMPRESSIONS:
        for suffix in JSONL_SUFFIXES:
            if name.endswith(suffix + compression):
                return "jsonl" + compression
    return None


def source_name(path: str) -> str:
    return os.path.basename(path.rstrip("/"))


def rejected(
    path: str,
    error_kind: str,
    error: str,
    raw: bytes | str | None = None,
    line: int | None = None,
    offset: int | None = None,
) -> dict:
    """A rejected-input record (docs/formats.md, "Rejected input")."""
    record = {
        "kind": "rejected",
        "file": path,
        "source": source_name(path),
        "line": line,
        "offset": offset,
        "error_kind": error_kind,
        "error": error,
        "raw": None,
        "raw_base64": None,
        "raw_truncated": False,
    }
    if raw is not None:
        data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
        record["raw_truncated"] = len(data) > RAW_LIMIT
        data = data[:RAW_LIMIT]
        try:
            record["raw"] = data.decode("utf-8")
        except UnicodeDecodeError:
            record["raw_base64"] = base64.b64encode(data).decode("ascii")
    return record


def make_document(record: dict, path: str, position: str, fields: InputFields) -> dict:
    """A document from one input record whose text field is a string.

    `position` locates the record in its file (`L12` for a line, `R7` for a Parquet row) and gives the
    id when the input has none; ids are prefixed with the source so that inputs cannot collide.
    """
    source = source_name(path)
    native_id = record.get(fields.id) if fields.id else None
    doc_id = f"{source}:{native_id}" if native_id not in (None, "") else f"{source}:{position}"
    url = record.get(fields.url) if fields.url else None
    rest = {k: v for k, v in record.items() if k not in (fields.text, fields.id, fields.url)}
    return {
        "kind": "document",
        "id": doc_id,
        "text": record[fields.text],
        "source": source,
        "url": url if isinstance(url, str) else None,
        "metadata": json.dumps(rest, sort_keys=True, ensure_ascii=False, default=str),
    }


def _field_problem(record: object, fields: InputFields) -> tuple[str, str] | None:
    if not isinstance(record, dict):
        return "bad_json", f"expected a JSON object, got {type(record).__name__}"
    if fields.text not in record:
        return "missing_text", f"no {fields.text!r} field"
    if not isinstance(record[fields.text], str):
        return (
            "text_not_string",
            f"field {fields.text!r} is {type(record[fields.text]).__name__}, not a string",
        )
    return None


class TruncatedInput(Exception):
    """A compressed stream that ends inside a frame."""


READ_CHUNK = 1 << 20


def _zstd_chunks(raw: IO[bytes]) -> Iterator[bytes]:
    """Decompressed zstd data, frame after frame (concatenated frames are valid zstd).

    zstandard's stream reader treats a stream that stops inside a frame as a clean end; a decompressobj
    tells the two apart (`eof` is set only when a frame is complete), so truncation is caught here.
    """
    decompressor = zstandard.ZstdDecompressor()
    frame = decompressor.decompressobj()
    frame_open = False
    while chunk := raw.read(READ_CHUNK):
        while chunk:
            frame_open = True
            output = frame.decompress(chunk)
            if output:
                yield output
            if frame.eof:
                chunk = frame.unused_data
                frame = decompressor.decompressobj()
                frame_open = False
            else:
                chunk = b""
    if frame_open:
        raise TruncatedInput("zstd stream ends inside a frame")


def _lines(chunks: Iterator[bytes]) -> Iterator[bytes]:
    pending = b""
    for chunk in chunks:
        pending += chunk
        *complete, pending = pending.split(b"\n")
        for line in complete:
            yield line + b"\n"
    if pending:
        yield pending


def _raw_lines(path: str, compression: str) -> Iterator[bytes]:
    with storage.open_file(path, "rb") as raw:
        if compression == ".zst":
            yield from _lines(_zstd_chunks(raw))
        elif compression == ".gz":
            # gzip raises EOFError itself when the stream stops before its end-of-stream marker.
            with gzip.GzipFile(fileobj=raw) as stream:
                yield from stream
        else:
            yield from raw


def read_jsonl(path: str, compression: str, fields: InputFields) -> Iterator[dict]:
    line_number = 0
    offset = 0
    try:
        for raw_line in _raw_lines(path, compression):
            line_number += 1
            line_offset = offset
            offset += len(raw_line)
            stripped = raw_line.strip()
            if not stripped:
                continue  # blank lines are separators, not records
            try:
                line_text = stripped.decode("utf-8")
            except UnicodeDecodeError as error:
                yield rejected(
                    path,
                    "bad_utf8",
                    f"{path}:{line_number}: invalid UTF-8 ({error.reason} at byte {error.start})",
                    raw_line,
                    line=line_number,
                    offset=line_offset,
                )
                continue
            try:
                record = json.loads(line_text)
            except json.JSONDecodeError as error:
                yield rejected(
                    path,
                    "bad_json",
                    f"{path}:{line_number}: malformed JSON: {error.msg} at column {error.colno}",
                    raw_line,
                    line=line_number,
                    offset=line_offset,
                )
                continue
            problem = _field_problem(record, fields)
            if problem:
                yield rejected(
                    path,
                    problem[0],
                    f"{path}:{line_number}: {problem[1]}",
                    raw_line,
                    line=line_number,
                    offset=line_offset,
                )
                continue
            yield make_document(record, path, f"L{line_number}", fields)
    except (TruncatedInput, zstandard.ZstdError, EOFError, gzip.BadGzipFile, zlib.error, OSError) as error:
        # A truncated or corrupt compressed stream: what decoded before the damage was read above.
        yield rejected(
            path,
            "truncated",
            f"{path}: compressed stream ends or breaks after {offset} "
            f"decompressed bytes (line {line_number + 1}): {error}",
            line=line_number + 1,
            offset=offset,
        )


def read_parquet(path: str, fields: InputFields) -> Iterator[dict]:
    import pyarrow.parquet as pq

    row = 0
    try:
        with storage.open_file(path, "rb") as handle:
            parquet = pq.ParquetFile(handle)
            if fields.text not in parquet.schema_arrow.names:
                yield rejected(
                    path,
                    "missing_text",
                    f"{path}: no {fields.text!r} column (columns: {', '.join(parquet.schema_arrow.names)})",
                )
                return
            for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS):
                for record in batch.to_pylist():
                    row += 1
                    problem = _field_problem(record, fields)
                    if problem:
                        raw = json.dumps(record, default=str, ensure_ascii=False)
                        yield rejected(path, problem[0], f"{path}: row {row}: {problem[1]}", raw, line=row)
                        continue
                    yield make_document(record, path, f"R{row}", fields)
    except Exception as error:  # pyarrow raises several types for damaged files
        yield rejected(
            path, "unreadable", f"{path}: Parquet unreadable after {row} rows: {error}", line=row + 1
        )


def read_file(path: str, fields: InputFields) -> Iterator[dict]:
    """Every record of one input file, as documents or rejected records."""
    kind = input_format(path)
    if kind is None:
        with storage.open_file(path, "rb") as handle:
            head = handle.read(RAW_LIMIT + 1)
        yield rejected(
            path,
            "unknown_format",
            f"{path}: unknown extension; expected one of "
            ".jsonl, .jsonl.gz, .jsonl.zst, .parquet, .warc, .warc.gz",
            head,
        )
        return
    if kind.startswith("warc"):
        from tokenmill.pipelines.warc import read_warc  # imports FastWARC and Resiliparse only when needed

        yield from read_warc(path)
    elif kind == "parquet":
        yield from read_parquet(path, fields)
    else:
        yield from read_jsonl(path, kind[len("jsonl") :], fields)
