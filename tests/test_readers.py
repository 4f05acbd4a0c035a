"""Reading raw input: every record becomes a document or a rejected record that says where and why."""

from __future__ import annotations

import base64
import gzip
import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from tokenmill.filters.normalize import Normalize, normalize_text
from tokenmill.pipelines.readers import InputFields, input_format, read_file

FIELDS = InputFields()


def lines(*records) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in records)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("a.jsonl", "jsonl"),
        ("a.JSONL.ZST", "jsonl.zst"),
        ("a.json.gz", "jsonl.gz"),
        ("a.ndjson", "jsonl"),
        ("a.parquet", "parquet"),
        ("a.txt", None),
        ("a.jsonl.bz2", None),
        ("jsonl", None),
    ],
)
def test_input_format_by_extension(name, expected):
    assert input_format(name) == expected


def test_plain_gzip_and_zstd_read_the_same_documents(tmp_path):
    data = lines(
        {"id": 1, "text": "one", "url": "https://a.example/1", "lang": "en"}, {"id": 2, "text": "two"}
    )
    (tmp_path / "a.jsonl").write_bytes(data)
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(data))
    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(data))
    results = {
        name: list(read_file(str(tmp_path / name), FIELDS))
        for name in ("a.jsonl", "a.jsonl.gz", "a.jsonl.zst")
    }
    for name, records in results.items():
        assert [r["kind"] for r in records] == ["document", "document"]
        assert [r["text"] for r in records] == ["one", "two"]
        assert records[0]["id"] == f"{name}:1"
        assert records[0]["url"] == "https://a.example/1"
        assert json.loads(records[0]["metadata"]) == {"lang": "en"}


def test_id_falls_back_to_line_number_and_is_stable(tmp_path):
    path = tmp_path / "noid.jsonl"
    path.write_bytes(lines({"text": "a"}, b"", {"text": "b"}))
    first = [r["id"] for r in read_file(str(path), FIELDS)]
    assert first == ["noid.jsonl:L1", "noid.jsonl:L3"]  # blank line 2 is skipped but still counted
    assert first == [r["id"] for r in read_file(str(path), FIELDS)]


def test_each_bad_line_is_rejected_with_file_line_and_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(
        lines(
            {"id": "ok", "text": "fine"},
            b'{"id": "broken", "text": "no closing brace"',
            b'{"id": "latin1", "text": "caf\xe9"}',
            {"id": "missing", "body": "text is elsewhere"},
            {"id": "number", "text": 42},
            b"[1, 2, 3]",
        )
    )
    records = list(read_file(str(path), FIELDS))
    assert [r["kind"] for r in records] == ["document"] + ["rejected"] * 5
    rejected = records[1:]
    assert [r["error_kind"] for r in rejected] == [
        "bad_json",
        "bad_utf8",
        "missing_text",
        "text_not_string",
        "bad_json",
    ]
    assert [r["line"] for r in rejected] == [2, 3, 4, 5, 6]
    for record in rejected:
        assert record["file"] == str(path)
        assert f"{path}:{record['line']}" in record["error"]
    # Bytes that are not UTF-8 are kept exactly, as base64.
    assert base64.b64decode(rejected[1]["raw_base64"]) == b'{"id": "latin1", "text": "caf\xe9"}\n'
    assert rejected[0]["raw"].startswith('{"id": "broken"')


def test_truncated_zstd_keeps_what_decoded_and_rejects_the_rest(tmp_path):
    rng = random.Random(0)
    # Random numbers compress poorly, so the file spans many zstd blocks and half of it still decodes.
    data = lines(*[{"id": i, "text": " ".join(str(rng.random()) for _ in range(30))} for i in range(3000)])
    compressed = zstandard.ZstdCompressor().compress(data)
    path = tmp_path / "cut.jsonl.zst"
    path.write_bytes(compressed[: len(compressed) // 2])
    records = list(read_file(str(path), FIELDS))
    documents = [r for r in records if r["kind"] == "document"]
    rejected = [r for r in records if r["kind"] == "rejected"]
    assert 0 < len(documents) < 3000
    assert [r["id"] for r in documents] == [f"cut.jsonl.zst:{i}" for i in range(len(documents))]
    assert len(rejected) >= 1 and rejected[-1]["error_kind"] == "truncated"
    assert str(path) in rejected[-1]["error"]


def test_truncated_gzip_is_rejected_too(tmp_path):
    data = lines(*[{"id": i, "text": f"text {i}"} for i in range(100)])
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(gzip.compress(data)[:-12])
    records = list(read_file(str(path), FIELDS))
    assert records[-1]["kind"] == "rejected" and records[-1]["error_kind"] == "truncated"


def test_concatenated_zstd_frames_are_one_stream(tmp_path):
    compressor = zstandard.ZstdCompressor()
    path = tmp_path / "two.jsonl.zst"
    path.write_bytes(compressor.compress(lines({"text": "a"})) + compressor.compress(lines({"text": "b"})))
    assert [r["text"] for r in read_file(str(path), FIELDS)] == ["a", "b"]


def test_unknown_extension_is_one_rejected_record(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("just some text\n")
    (record,) = read_file(str(path), FIELDS)
    assert record["kind"] == "rejected" and record["error_kind"] == "unknown_format"
    assert record["raw"] == "just some text\n"


def test_parquet_rows_and_configurable_fields(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(
        pa.table({"doc_id": ["a", "b", "c"], "content": ["first", None, "third"], "extra": [1, 2, 3]}), path
    )
    records = list(read_file(str(path), InputFields(text="content", id="doc_id", url=None)))
    assert [r["kind"] for r in records] == ["document", "rejected", "document"]
    assert records[0]["id"] == "p.parquet:a" and records[0]["text"] == "first"
    assert json.loads(records[0]["metadata"]) == {"extra": 1}
    assert records[1]["error_kind"] == "text_not_string" and records[1]["line"] == 2


def test_parquet_without_the_text_column_is_rejected_naming_the_columns(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"body": ["x"]}), path)
    (record,) = read_file(str(path), FIELDS)
    assert record["error_kind"] == "missing_text" and "body" in record["error"]


def test_normalization():
    assert normalize_text("cafe\u0301\r\nline\rtwo\x00\x07\tok\u2028end") == "café\nline\ntwo\tok\nend"
    documents = [{"text": "  \n\t "}, {"text": "x" * 101}, {"text": "e\u0301 fine"}]
    verdicts = Normalize(max_chars=100).apply(documents)
    assert [v.reason if v else None for v in verdicts] == ["empty", "too_long", None]
    assert documents[2]["text"] == "é fine" and documents[2]["n_chars"] == 6 and documents[2]["n_words"] == 2
