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

from tokenmill import storage
from tokenmill.corpora.paths import input_root, relative_source
from tokenmill.corpora.readers import Oversized, bounded_lines, input_format, read_file
from tokenmill.corpora.records import DuplicateIdError, InputFields
from tokenmill.filters.normalize import Normalize, normalize_text

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


# --- Names: sources and ids relative to the input root -------------------------------------------------


@pytest.mark.parametrize(
    "patterns, root",
    [
        (["/data/crawl-*/part.jsonl"], "/data"),
        (["/data/in/a.jsonl"], "/data/in"),
        (["/data/in/**/*.jsonl.zst"], "/data/in"),
        (["/data/a/*.jsonl", "/data/b/x.jsonl"], "/data"),
        (["/data/in/part-[0-9].jsonl"], "/data/in"),
        (["/*.jsonl"], "/"),
        (["gs://bucket/prefix/crawl-*/part.jsonl"], "gs://bucket/prefix"),
        (["gs://bucket/prefix/a/*.jsonl", "gs://bucket/prefix/b/*.jsonl"], "gs://bucket/prefix"),
        (["gs://bucket-a/x/*.jsonl", "gs://bucket-b/x/*.jsonl"], "gs://"),
        (["gs://buck*/x.jsonl"], "gs://"),
        (["gs://bucket/x/*.jsonl", "/data/x/*.jsonl"], ""),
    ],
)
def test_input_root_is_the_common_folder_before_the_first_glob(patterns, root):
    assert input_root(patterns) == root


def test_relative_sources_are_the_same_locally_and_in_a_bucket(tmp_path, monkeypatch):
    assert relative_source("gs://bucket/prefix/crawl-01/part.jsonl", "gs://bucket/prefix") == (
        "crawl-01/part.jsonl"
    )
    assert relative_source(str(tmp_path / "crawl-01" / "part.jsonl"), str(tmp_path)) == "crawl-01/part.jsonl"
    assert relative_source("gs://b/a//x.jsonl", "gs://b") == "a//x.jsonl"  # not the same object as a/x
    assert relative_source("gs://bucket-a/x/p.jsonl", "gs://") == "bucket-a/x/p.jsonl"
    assert relative_source(str(tmp_path / "p.jsonl"), None) == "p.jsonl"
    # A relative pattern and the relative paths its glob gives name files as absolute ones do.
    monkeypatch.chdir(tmp_path)
    assert input_root(["in/crawl-*/part.jsonl"]) == str(tmp_path / "in")
    assert relative_source("in/crawl-02/part.jsonl", str(tmp_path / "in")) == "crawl-02/part.jsonl"
    with pytest.raises(ValueError, match="not below the input root"):
        relative_source("gs://other/prefix/a.jsonl", "gs://bucket/prefix")
    with pytest.raises(ValueError, match="not below the input root"):
        relative_source("/elsewhere/a.jsonl", str(tmp_path))


def test_files_of_the_same_name_in_two_folders_get_distinct_ids(tmp_path):
    records = [{"id": i, "text": f"document {i}"} for i in range(300)]
    for crawl in ("crawl-01", "crawl-02"):
        (tmp_path / crawl).mkdir()
        (tmp_path / crawl / "part.jsonl").write_bytes(lines(*records, {"text": "no id"}))
    pattern = str(tmp_path / "*" / "part.jsonl")
    root = input_root([pattern])
    documents = [d for path in storage.expand_glob(pattern) for d in read_file(path, FIELDS, root)]
    assert len(documents) == 602 and len({d["id"] for d in documents}) == 602
    assert documents[0]["id"] == "crawl-01/part.jsonl:0" and documents[0]["source"] == "crawl-01/part.jsonl"
    assert documents[300]["id"] == "crawl-01/part.jsonl:L301"
    assert documents[301]["id"] == "crawl-02/part.jsonl:0"


def test_the_same_layout_on_local_disk_and_in_a_remote_filesystem_reads_identically(tmp_path):
    import fsspec

    memory = fsspec.filesystem("memory")
    files = {
        "crawl-01/part.jsonl": lines({"id": "a", "text": "one"}, b"{broken", {"text": "two"}),
        "crawl-02/part.jsonl.zst": zstandard.ZstdCompressor().compress(lines({"id": "a", "text": "three"})),
    }
    for name, data in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
        memory.pipe(f"/bucket/prefix/{name}", data)

    def read_all(pattern: str) -> list[dict]:
        root = input_root([pattern])
        records = [r for path in storage.expand_glob(pattern) for r in read_file(path, FIELDS, root)]
        return [{k: v for k, v in r.items() if k not in ("file", "error")} for r in records]

    try:
        local = read_all(str(tmp_path / "*" / "part.*"))
        remote = read_all("memory://bucket/prefix/*/part.*")
    finally:
        memory.rm("/bucket", recursive=True)
    assert [r["id"] for r in local if r["kind"] == "document"] == [
        "crawl-01/part.jsonl:a",
        "crawl-01/part.jsonl:L3",
        "crawl-02/part.jsonl.zst:a",
    ]
    assert json.dumps(local, sort_keys=True) == json.dumps(remote, sort_keys=True)


def test_a_repeated_id_in_one_file_fails_naming_the_file_the_id_and_both_lines(tmp_path):
    path = tmp_path / "dup.jsonl"
    path.write_bytes(lines({"id": "x", "text": "a"}, {"id": "y", "text": "b"}, b"", {"id": "x", "text": "c"}))
    with pytest.raises(DuplicateIdError) as caught:
        list(read_file(str(path), FIELDS))
    assert str(path) in str(caught.value) and "'x'" in str(caught.value)
    assert "line 1 and line 4" in str(caught.value)
    # A native id that spells another record's position collides with it too.
    path.write_bytes(lines({"text": "no id"}, {"id": "L1", "text": "claims line 1"}))
    with pytest.raises(DuplicateIdError, match="line 1 and line 2"):
        list(read_file(str(path), FIELDS))
    table = tmp_path / "dup.parquet"
    pq.write_table(pa.table({"id": [1, 2, 1], "text": ["a", "b", "c"]}), table)
    with pytest.raises(DuplicateIdError, match="row 1 and row 3"):
        list(read_file(str(table), FIELDS))


# --- Bounded memory per record -------------------------------------------------------------------------


def write_compressed(path, data: bytes) -> None:
    if path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(data))
    elif path.name.endswith(".zst"):
        path.write_bytes(zstandard.ZstdCompressor().compress(data))
    else:
        path.write_bytes(data)


@pytest.mark.parametrize("name", ["long.jsonl", "long.jsonl.gz", "long.jsonl.zst"])
def test_a_line_over_max_record_bytes_is_rejected_and_the_lines_after_it_are_read(tmp_path, name):
    big = json.dumps({"id": "big", "text": "w" * 3_000_000}).encode()  # spans several read chunks
    short_big = json.dumps({"id": "short", "text": "v" * 2000}).encode()
    data = lines(
        {"id": 1, "text": "one"}, big, {"id": 2, "text": "two"}, short_big, {"id": 3, "text": "three"}
    )
    data += json.dumps({"id": "tail", "text": "t" * 5000}).encode()  # the last line has no newline
    path = tmp_path / name
    write_compressed(path, data)
    records = list(read_file(str(path), FIELDS, max_record_bytes=1000))
    assert [(r["kind"], r.get("id") or r["error_kind"]) for r in records] == [
        ("document", f"{name}:1"),
        ("rejected", "record_too_large"),
        ("document", f"{name}:2"),
        ("rejected", "record_too_large"),
        ("document", f"{name}:3"),
        ("rejected", "record_too_large"),
    ]
    first, second, last = (r for r in records if r["kind"] == "rejected")
    assert first["line"] == 2 and first["offset"] == data.index(big)
    assert f"{len(big) + 1:,} bytes" in first["error"] and str(path) in first["error"]
    assert (
        first["raw_truncated"] and len(first["raw"]) == 64 * 1024 and first["raw"].startswith('{"id": "big"')
    )
    assert second["line"] == 4 and second["offset"] == data.index(short_big)
    assert not second["raw_truncated"] and second["raw"] == short_big.decode() + "\n"
    assert last["line"] == 6 and last["offset"] == data.index(b'{"id": "tail"')


def test_bounded_lines_never_holds_more_than_the_limit():
    chunks = [b'{"a": 1}\n{"big": "', *[b"x" * 1000] * 50, b'"}\n{"b": 2}', b"\n"]
    items = list(bounded_lines(iter(chunks), 5000))
    assert items[0] == b'{"a": 1}\n' and items[2] == b'{"b": 2}\n'
    assert isinstance(items[1], Oversized) and items[1].size == 50_012
    assert items[1].head == b'{"big": "' + b"x" * 50_000 + b'"}\n'  # all of it: under RAW_LIMIT
    items = list(bounded_lines(iter([b"y" * 10, b"y" * 10]), 15))
    assert items == [Oversized(b"y" * 20, 20)]


def test_zstd_that_expands_enormously_comes_out_in_bounded_chunks():
    import io

    from tokenmill.corpora import readers

    data = zstandard.ZstdCompressor().compress(b" " * 50_000_000 + b"\n")  # a few kB compressed
    assert len(data) < 100_000
    sizes = [len(chunk) for chunk in readers._zstd_chunks(io.BytesIO(data))]
    assert sum(sizes) == 50_000_001 and max(sizes) <= readers.READ_CHUNK


def test_a_parquet_text_over_max_record_bytes_is_rejected_from_arrow_memory(tmp_path):
    path = tmp_path / "wide.parquet"
    pq.write_table(pa.table({"id": ["a", "b", "c"], "text": ["short", "é" * 3000, None]}), path)
    records = list(read_file(str(path), FIELDS, max_record_bytes=5000))
    assert [r["kind"] for r in records] == ["document", "rejected", "rejected"]
    too_large = records[1]
    assert too_large["error_kind"] == "record_too_large" and too_large["line"] == 2
    assert "6,000 bytes" in too_large["error"] and too_large["raw"] == "é" * 3000
    assert records[2]["error_kind"] == "text_not_string"


def test_a_file_that_is_not_parquet_is_one_unreadable_record(tmp_path):
    path = tmp_path / "fake.parquet"
    path.write_bytes(b"PAR1 this is not really parquet" * 100)
    (record,) = read_file(str(path), FIELDS)
    assert record["error_kind"] == "unreadable" and str(path) in record["error"]
