"""Rejected input (docs/formats.md, "Rejected input"): `rejected/part-<n>-of-<m>.jsonl.zst`, one record per
line for each input record that is not a document, with why and the raw bytes (cut to 64 KiB).
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import zstandard

from tokenmill import storage
from tokenmill.errors import FormatError
from tokenmill.formats.base import Count, FormatModel, parse

ZSTD_LEVEL = 3


class RejectedRecord(FormatModel):
    """One rejected input record. `raw` holds it as UTF-8 text, else `raw_base64` as base64."""

    file: str
    line: Count | None
    offset: Count | None
    error: str
    error_kind: str
    raw: str | None = None
    raw_base64: str | None = None
    raw_truncated: bool = False


def write_rejected(path: str, records: Iterable[Mapping[str, Any]]) -> None:
    """Records (in the order given) as one zstd-compressed JSON Lines file, written atomically.

    Each record is checked against `RejectedRecord` first. Memory: the file's compressed and uncompressed
    bytes (the writer's files are bounded by the target file size).
    """
    lines = []
    for record in records:
        checked = parse(RejectedRecord, dict(record), path).model_dump()
        lines.append(json.dumps(checked, sort_keys=True, ensure_ascii=False).encode("utf-8") + b"\n")
    storage.write_bytes(path, zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(b"".join(lines)))


def read_rejected(path: str) -> Iterator[tuple[int, RejectedRecord]]:
    """(line number, record) for each record of a `.jsonl.zst` (or plain `.jsonl`) file, streamed.

    FormatError names the file and line of a record that is not JSON or breaks the format, and a file that
    cannot be decompressed (cut short, not zstd).
    """
    with storage.open_file(path, "rb") as handle:
        try:
            stream = (
                io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(handle))
                if path.endswith(".zst")
                else handle
            )
            for number, line in enumerate(stream, start=1):
                if not line.strip():
                    continue
                try:
                    value = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError) as error:
                    raise FormatError(path, f"line {number} is not JSON ({error})") from None
                yield number, parse(RejectedRecord, value, f"{path}: line {number}")
        except zstandard.ZstdError as error:
            raise FormatError(path, f"cannot decompress ({error})") from None
