"""Reading raw corpora: one input file in, documents and rejected records out.

Formats, by extension: JSON Lines (`.jsonl`, `.json`, `.ndjson`, plain, `.gz` or `.zst`), Parquet and
WARC (tokenmill.corpora.warc). zstd goes through `backports.zstd` (Python 3.14's `compression.zstd`),
whose decompressor takes an output bound and tells a frame that ends from a stream cut inside one; gzip
through the standard library. Files are opened through `tokenmill.storage`, so gs:// works at scale.

Every record read becomes exactly one of: a document (a dict with the DESIGN.md document columns) or a
rejected record (`kind == "rejected"`) naming the file, the line or byte offset, and the error
(tokenmill.corpora.records makes both).

Names (tokenmill.corpora.paths). A document's `source` is its input file's path relative to the input
root (`input_root`: the common folder of the `--input` patterns), '/'-separated, so `crawl-01/part.jsonl`
and `crawl-02/part.jsonl` stay apart, and the same files under a local folder or under gs://bucket/prefix
get the same names. Its id is `<source>:<native id>`, or `<source>:L<line>` (`R<row>` for Parquet, `R<record>`
for WARC) when the record has none. Two records of one file with the same id stop the run
(`DuplicateIdError`): ids are then unique across the whole input by construction.

Errors. Content errors become rejected records: bad JSON or UTF-8, a missing or non-string text field, a
compressed stream that is cut or corrupt (the records before the damage are read, the rest is one
`truncated` record), a Parquet file that is not Parquet (`unreadable`) or lacks the text column, and a
record over `max_record_bytes` (`record_too_large`, skipped without being held whole). Storage errors
(OSError from the filesystem, timeouts, connection resets) are never caught here: they propagate, so
that the runner retries the bundle, after `tokenmill.storage`'s reader has retried the read itself.

Memory per file read: one read chunk (1 MiB), at most one record of up to `max_record_bytes`, and the ids
of the file (about 100 bytes plus the id per record, for the duplicate check); never the whole file,
whatever its size or its lines.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any

from backports import zstd

from tokenmill import storage
from tokenmill.corpora.paths import relative_source
from tokenmill.corpora.records import (
    DEFAULT_MAX_RECORD_BYTES,
    RAW_LIMIT,
    IdLedger,
    InputFields,
    field_problem,
    make_document,
    rejected,
)

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
COMPRESSIONS = ("", ".gz", ".zst")
PARQUET_SUFFIXES = (".parquet",)
PARQUET_BATCH_ROWS = 1024
#: Parquet rows are read in batches of about this many (uncompressed) bytes, at most PARQUET_BATCH_ROWS.
PARQUET_BATCH_BYTES = 64 << 20
READ_CHUNK = 1 << 20


def input_format(path: str) -> str | None:
    """'jsonl', 'jsonl.gz', 'jsonl.zst', 'parquet', 'warc', 'warc.gz', or None for an unknown extension."""
    name = os.path.basename(path).lower()
    for suffix in (".warc", ".warc.gz"):  # web crawls: tokenmill.corpora.warc
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


class TruncatedInput(Exception):
    """A compressed stream that ends inside a frame."""


#: Errors of the data itself in a compressed stream (never of the storage: those are OSError from the
#: file object, which is not among these, except gzip's own BadGzipFile, raised only by its decoder).
COMPRESSION_ERRORS = (TruncatedInput, zstd.ZstdError, EOFError, gzip.BadGzipFile, zlib.error)


def _zstd_chunks(raw: IO[bytes]) -> Iterator[bytes]:
    """Decompressed zstd data, frame after frame (concatenated frames are valid zstd), at most READ_CHUNK
    bytes at a time: a small frame that expands to gigabytes is never held whole.

    A stream that stops inside a frame raises TruncatedInput (the decompressor's `eof` is set only when a
    frame is complete).
    """
    decompressor = zstd.ZstdDecompressor()
    frame_open = False
    while True:
        if decompressor.eof:  # a frame ended: what followed it starts the next one
            data = decompressor.unused_data
            decompressor = zstd.ZstdDecompressor()
            frame_open = False
            if not data:
                data = raw.read(READ_CHUNK)
                if not data:
                    return
        elif decompressor.needs_input:
            data = raw.read(READ_CHUNK)
            if not data:
                if frame_open:
                    raise TruncatedInput("zstd stream ends inside a frame")
                return
        else:  # output is waiting for the bound of the previous call
            data = b""
        frame_open = frame_open or bool(data)
        output = decompressor.decompress(data, READ_CHUNK)
        if output:
            yield output


def _gzip_chunks(raw: IO[bytes]) -> Iterator[bytes]:
    # GzipFile.read(n) inflates at most n bytes; it raises EOFError itself when the stream stops before
    # its end-of-stream marker.
    with gzip.GzipFile(fileobj=raw) as stream:
        while chunk := stream.read(READ_CHUNK):
            yield chunk


def _plain_chunks(raw: IO[bytes]) -> Iterator[bytes]:
    while chunk := raw.read(READ_CHUNK):
        yield chunk


@dataclass(frozen=True)
class Oversized:
    """A line longer than the limit: its first bytes (the rejected record's sample) and its length."""

    head: bytes
    size: int


def bounded_lines(chunks: Iterable[bytes], limit: int) -> Iterator[bytes | Oversized]:
    """Lines (newline included) of a byte stream given in chunks; a line of more than `limit` bytes
    comes out as `Oversized`, of which only the first RAW_LIMIT + 1 bytes were kept.

    Memory: one chunk, plus at most `limit` bytes of the current line (a few MiB over for the join).
    """
    parts: list[bytes] = []  # the current line so far, while it is within the limit
    size = 0
    head: bytes | None = None  # set once the current line is over the limit; the rest is dropped
    for chunk in chunks:
        start = 0
        length = len(chunk)
        while start < length:
            end = chunk.find(b"\n", start)
            stop = length if end < 0 else end + 1
            if end >= 0 and not parts and head is None and stop - start <= limit:
                yield chunk[start:stop]  # the common case: a whole line inside one chunk
                start = stop
                continue
            piece = chunk[start:stop]
            size += len(piece)
            if head is None:
                if size > limit:
                    head = b""
                    parts.append(piece)
                    for part in parts:
                        head += part[: RAW_LIMIT + 1 - len(head)]
                    parts = []
                else:
                    parts.append(piece)
            elif len(head) <= RAW_LIMIT:  # a limit below RAW_LIMIT: the sample still gets RAW_LIMIT bytes
                head += piece[: RAW_LIMIT + 1 - len(head)]
            if end >= 0:
                yield Oversized(head, size) if head is not None else b"".join(parts)
                parts, size, head = [], 0, None
            start = stop
    if head is not None:
        yield Oversized(head, size)
    elif parts:
        yield b"".join(parts)


def _decompressed_chunks(raw: IO[bytes], compression: str) -> Iterator[bytes]:
    if compression == ".zst":
        return _zstd_chunks(raw)
    if compression == ".gz":
        return _gzip_chunks(raw)
    return _plain_chunks(raw)


def read_jsonl(
    path: str,
    compression: str,
    fields: InputFields,
    source: str | None = None,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
) -> Iterator[dict]:
    """Every line of a JSON Lines file (plain, .gz or .zst) as a document or a rejected record."""
    source = source if source is not None else relative_source(path, None)
    ledger = IdLedger(path, "line")
    line_number = 0
    offset = 0

    def reject(kind: str, sentence: str, raw: bytes, at: int) -> dict:
        return rejected(
            path, kind, f"{path}:{line_number}: {sentence}", raw, line=line_number, offset=at, source=source
        )

    with storage.open_file(path, "rb") as raw:
        try:
            for item in bounded_lines(_decompressed_chunks(raw, compression), max_record_bytes):
                line_number += 1
                line_offset = offset
                if isinstance(item, Oversized):
                    offset += item.size
                    yield reject(
                        "record_too_large",
                        f"a line of {item.size:,} bytes at offset {line_offset:,}, over max_record_bytes "
                        f"({max_record_bytes:,}); skipped unread",
                        item.head,
                        line_offset,
                    )
                    continue
                offset += len(item)
                stripped = item.strip()
                if not stripped:
                    continue  # blank lines are separators, not records
                try:
                    line_text = stripped.decode("utf-8")
                except UnicodeDecodeError as error:
                    yield reject(
                        "bad_utf8", f"invalid UTF-8 ({error.reason} at byte {error.start})", item, line_offset
                    )
                    continue
                try:
                    record = json.loads(line_text)
                except json.JSONDecodeError as error:
                    yield reject(
                        "bad_json", f"malformed JSON: {error.msg} at column {error.colno}", item, line_offset
                    )
                    continue
                problem = field_problem(record, fields)
                if problem:
                    yield reject(problem[0], problem[1], item, line_offset)
                    continue
                yield make_document(record, path, f"L{line_number}", fields, source, ledger, line_number)
        except COMPRESSION_ERRORS as error:
            # A truncated or corrupt compressed stream: what decoded before the damage was read above.
            yield rejected(
                path,
                "truncated",
                f"{path}: compressed stream ends or breaks after {offset} "
                f"decompressed bytes (line {line_number + 1}): {error}",
                line=line_number + 1,
                offset=offset,
                source=source,
            )


class _WatchedFile:
    """A file object for pyarrow that remembers what its own reads raised.

    pyarrow reports damaged data as ArrowInvalid or as OSError ("Corrupt snappy compressed data") and
    passes a Python file's exceptions through as they are, so an OSError alone cannot tell a broken file
    from a broken connection. Whatever the storage raised is re-raised as it is (a retry); every other
    pyarrow error is the file's content. This reads remote files as they are parsed, with no local copy.
    """

    def __init__(self, handle: IO[bytes]):
        self._handle = handle
        self.storage_error: BaseException | None = None

    def _watch(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self._handle, method)(*args)
        except BaseException as error:
            self.storage_error = error
            raise

    def read(self, size: int = -1) -> bytes:
        return self._watch("read", size)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._watch("seek", offset, whence)

    def tell(self) -> int:
        return self._watch("tell")

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    @property
    def closed(self) -> bool:
        return self._handle.closed

    def close(self) -> None:
        self._handle.close()


def _text_sample(column: Any, index: int) -> bytes:
    """The first RAW_LIMIT + 1 bytes of one Arrow string value, without converting the whole value."""
    import pyarrow as pa
    import pyarrow.compute as pc

    value = column.slice(index, 1)
    if pa.types.is_large_string(value.type):
        value = value.cast(pa.large_binary())
    else:
        value = value.cast(pa.binary())
    return pc.binary_slice(value, 0, RAW_LIMIT + 1)[0].as_py()


def read_parquet(
    path: str,
    fields: InputFields,
    source: str | None = None,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
) -> Iterator[dict]:
    """Every row of a Parquet file as a document or a rejected record.

    Storage errors propagate (see _WatchedFile); a file that is not Parquet, or breaks part way, is
    one `unreadable` record after the rows before the damage. A row whose text is over
    `max_record_bytes` is rejected as `record_too_large` from Arrow memory: Parquet cannot skip a value
    unread, so it is held once there (in its batch), but never converted to Python. Batches are sized
    from the row groups' mean row size, so a batch holds about PARQUET_BATCH_BYTES.
    """
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    source = source if source is not None else relative_source(path, None)
    ledger = IdLedger(path, "row")
    row = 0
    with storage.open_file(path, "rb") as handle:
        watched = _WatchedFile(handle)
        try:
            parquet = pq.ParquetFile(watched)
            names = parquet.schema_arrow.names
            if fields.text not in names:
                yield rejected(
                    path,
                    "missing_text",
                    f"{path}: no {fields.text!r} column (columns: {', '.join(names)})",
                    source=source,
                )
                return
            metadata = parquet.metadata
            widest = max(
                (
                    metadata.row_group(i).total_byte_size / max(metadata.row_group(i).num_rows, 1)
                    for i in range(metadata.num_row_groups)
                ),
                default=1.0,
            )
            batch_rows = max(1, min(PARQUET_BATCH_ROWS, int(PARQUET_BATCH_BYTES // max(widest, 1.0))))
            text_index = names.index(fields.text)
            for batch in parquet.iter_batches(batch_size=batch_rows):
                text = batch.column(text_index)
                oversized: set[int] = set()
                if pa.types.is_string(text.type) or pa.types.is_large_string(text.type):
                    lengths = pc.binary_length(text)
                    over = pc.fill_null(pc.greater(lengths, max_record_bytes), False)
                    if pc.any(over).as_py():
                        oversized = {i for i, flag in enumerate(over.to_pylist()) if flag}
                        kept = batch.filter(pc.invert(over)).to_pylist()
                    else:
                        kept = batch.to_pylist()
                else:
                    kept = batch.to_pylist()
                kept_rows = iter(kept)
                for index in range(batch.num_rows):
                    row += 1
                    if index in oversized:
                        size = lengths[index].as_py()
                        yield rejected(
                            path,
                            "record_too_large",
                            f"{path}: row {row}: a text of {size:,} bytes, over max_record_bytes "
                            f"({max_record_bytes:,}); skipped",
                            _text_sample(text, index),
                            line=row,
                            source=source,
                        )
                        continue
                    record = next(kept_rows)
                    problem = field_problem(record, fields)
                    if problem:
                        raw = json.dumps(record, default=str, ensure_ascii=False)
                        yield rejected(
                            path, problem[0], f"{path}: row {row}: {problem[1]}", raw, line=row, source=source
                        )
                        continue
                    yield make_document(record, path, f"R{row}", fields, source, ledger, row)
        except (pa.ArrowException, OSError) as error:  # ArrowInvalid, and OSError for corrupt pages
            if watched.storage_error is not None:
                raise watched.storage_error from None
            yield rejected(
                path,
                "unreadable",
                f"{path}: Parquet unreadable after {row} rows: {error}",
                line=row + 1,
                source=source,
            )


def read_file(
    path: str,
    fields: InputFields,
    root: str | None = None,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
) -> Iterator[dict]:
    """Every record of one input file, as documents or rejected records.

    `root` is the input root (`input_root`) that `source` and ids are relative to; None names the file
    by its basename (a reader used on its own, outside a run).
    """
    source = relative_source(path, root)
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
            source=source,
        )
        return
    if kind.startswith("warc"):
        from tokenmill.corpora.warc import read_warc  # imports FastWARC and Resiliparse only when needed

        yield from read_warc(path, fields, source=source, max_record_bytes=max_record_bytes)
    elif kind == "parquet":
        yield from read_parquet(path, fields, source, max_record_bytes)
    else:
        yield from read_jsonl(path, kind[len("jsonl") :], fields, source, max_record_bytes)
