"""What every reader of raw input makes of a record: a document or a rejected record.

A document is a dict with the DESIGN.md document columns; its id is `<source>:<native id>`, or
`<source>:<position>` when the record has none, and two records of one file with the same id stop the
run (`DuplicateIdError`). A rejected record (`kind == "rejected"`) names the file, the line or byte
offset, and the error (docs/formats.md, "Rejected input").
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass

from tokenmill.corpora.paths import relative_source

RAW_LIMIT = 64 * 1024
#: The default `max_record_bytes` of a recipe: a line, Parquet text or WARC record longer than this is
#: rejected as `record_too_large` (a web page is rarely over 1 MiB; Common Crawl cuts them there).
DEFAULT_MAX_RECORD_BYTES = 64 << 20


@dataclass(frozen=True)
class InputFields:
    """Which fields of an input record hold the text, the id and the URL."""

    text: str = "text"
    id: str | None = "id"
    url: str | None = "url"


class DuplicateIdError(ValueError):
    """Two records carry the same id: two of one input file (named with both lines by the reader), or two
    documents meeting in a dedupe stage's join by id. Ids are unique by construction, so either stops
    the run."""


def rejected(
    path: str,
    error_kind: str,
    error: str,
    raw: bytes | str | None = None,
    line: int | None = None,
    offset: int | None = None,
    source: str | None = None,
) -> dict:
    """A rejected-input record (docs/formats.md, "Rejected input"); `source` defaults to the basename."""
    record = {
        "kind": "rejected",
        "file": path,
        "source": source if source is not None else relative_source(path, None),
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


class IdLedger:
    """The ids given so far in one input file, each with the line (row, record) that got it.

    Memory: one dict entry per record of the file being read (about 100 bytes plus the id), freed when
    the file is done; it does not grow with the corpus.
    """

    def __init__(self, path: str, unit: str = "line"):
        self.path = path
        self.unit = unit
        self._first: dict[str, int] = {}

    def claim(self, local_id: str, number: int) -> None:
        first = self._first.setdefault(local_id, number)
        if first != number:
            raise DuplicateIdError(
                f"{self.path}: id {local_id!r} is used twice, by {self.unit} {first} and {self.unit} "
                f"{number}; ids must be unique within an input file (the recipe's fields.id names the id "
                "field; without one, ids are line numbers)"
            )


def make_document(
    record: dict,
    path: str,
    position: str,
    fields: InputFields,
    source: str | None = None,
    ledger: IdLedger | None = None,
    number: int = 0,
) -> dict:
    """A document from one input record whose text field is a string.

    `position` locates the record in its file (`L12` for a line, `R7` for a Parquet row) and gives the
    id when the input has none; ids are prefixed with the source (see the module docstring), and claimed
    in `ledger` (as `number`) when one is given.
    """
    source = source if source is not None else relative_source(path, None)
    native_id = record.get(fields.id) if fields.id else None
    local_id = str(native_id) if native_id not in (None, "") else position
    if ledger is not None:
        ledger.claim(local_id, number)
    url = record.get(fields.url) if fields.url else None
    rest = {k: v for k, v in record.items() if k not in (fields.text, fields.id, fields.url)}
    return {
        "kind": "document",
        "id": f"{source}:{local_id}",
        "text": record[fields.text],
        "source": source,
        "url": url if isinstance(url, str) else None,
        "metadata": json.dumps(rest, sort_keys=True, ensure_ascii=False, default=str),
    }


def field_problem(record: object, fields: InputFields) -> tuple[str, str] | None:
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
