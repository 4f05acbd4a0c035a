"""Input that real crawls and real storage give: files of one name in several folders, connections that
reset mid-file, and a single line of hundreds of megabytes. Each must leave curate's output exactly as a
clean run would, or fail the run; never lose documents quietly."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from conftest import REPO, rejected_rows, tree_bytes
from fsspec.implementations.local import LocalFileSystem
from fsspec.spec import AbstractBufferedFile

from tokenmill import storage
from tokenmill.cli import main
from tokenmill.corpora import records
from tokenmill.formats.documents import curated_dataset

PLAIN_RECIPE = "name: plain\nstages:\n  - exact_dedupe: {}\n"


def curate(output: Path, recipe: Path, *patterns: str) -> dict:
    args = ["curate", "--recipe", str(recipe), "--output", str(output), "--workers", "1"]
    assert main([*args, *[arg for pattern in patterns for arg in ("--input", pattern)]]) == 0
    return json.loads((output / "stats.json").read_text())


# --- A filesystem whose connections reset --------------------------------------------------------------


class FlakyFile(AbstractBufferedFile):
    """A local file read in small ranges, raising ConnectionResetError where FlakyFileSystem says."""

    def _fetch_range(self, start: int, end: int) -> bytes:
        FlakyFileSystem.check(self.path, start, end)
        with open(self.path, "rb") as handle:
            handle.seek(start)
            return handle.read(end - start)


class FlakyFileSystem(LocalFileSystem):
    """The local filesystem under `flaky://`, whose reads fail at chosen offsets of chosen files: once
    each (a reset connection), or every time (`permanent`)."""

    protocol = ("flaky",)
    failures: dict[str, list[int]] = {}  # file name -> offsets whose read fails
    permanent: set[str] = set()
    raised: list[tuple[str, int]] = []

    @classmethod
    def _strip_protocol(cls, path):
        if isinstance(path, str) and path.startswith("flaky://"):
            path = path[len("flaky://") :]
        return super()._strip_protocol(path)

    def _open(self, path, mode="rb", block_size=None, autocommit=True, cache_options=None, **kwargs):
        if mode != "rb":
            return super()._open(path, mode, block_size, autocommit, cache_options, **kwargs)
        return FlakyFile(self, path, mode, block_size=64 * 1024, cache_type="readahead")

    @classmethod
    def check(cls, path: str, start: int, end: int) -> None:
        name = os.path.basename(path)
        for offset in cls.failures.get(name, []):
            if start <= offset < end and (name in cls.permanent or (name, offset) not in cls.raised):
                cls.raised.append((name, offset))
                raise ConnectionResetError(104, f"Connection reset by peer (injected at byte {offset})")

    @classmethod
    def reset(cls, failures: dict[str, list[int]], permanent: set[str] = frozenset()) -> None:
        cls.failures = failures
        cls.permanent = set(permanent)
        cls.raised = []


@pytest.fixture
def flaky(monkeypatch):
    fsspec.register_implementation("flaky", FlakyFileSystem, clobber=True)
    monkeypatch.setattr(storage, "READ_BACKOFF_SECONDS", 0.001)
    FlakyFileSystem.reset({})
    yield FlakyFileSystem
    FlakyFileSystem.reset({})


def write_mixed_inputs(folder: Path) -> None:
    """Every input format, a few hundred kB each (many read blocks), in two folders."""
    folder.mkdir()
    (folder / "a").mkdir()
    (folder / "b").mkdir()

    def documents(prefix: str, count: int) -> list[dict]:
        return [
            {"id": f"{prefix}{i}", "text": f"{prefix} {i} " + os.urandom(300).hex(), "url": f"https://x/{i}"}
            for i in range(count)
        ]

    def jsonl(rows: list[dict]) -> bytes:
        return "".join(json.dumps(row) + "\n" for row in rows).encode()

    (folder / "a" / "part.jsonl").write_bytes(jsonl(documents("plain", 600)))
    (folder / "b" / "part.jsonl").write_bytes(jsonl(documents("plain", 600)))  # the same name and ids
    (folder / "a" / "part.jsonl.gz").write_bytes(gzip.compress(jsonl(documents("gz", 600))))
    (folder / "b" / "part.jsonl.zst").write_bytes(
        zstandard.ZstdCompressor().compress(jsonl(documents("zst", 600)))
    )
    pq.write_table(
        pa.Table.from_pylist(documents("pq", 600)), folder / "a" / "part.parquet", row_group_size=100
    )


def test_reads_that_reset_mid_file_are_retried_and_the_output_is_a_clean_runs(tmp_path, flaky):
    inputs = tmp_path / "in"
    write_mixed_inputs(inputs)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(PLAIN_RECIPE)
    clean = tmp_path / "clean"
    clean_stats = curate(clean, recipe, str(inputs / "*" / "part.*"))

    sizes = {path.name: path.stat().st_size for path in inputs.rglob("part.*")}
    failures = {name: [size // 7, size // 2, size - 100] for name, size in sizes.items()}
    flaky.reset(failures)
    retried = tmp_path / "retried"
    retried_stats = curate(retried, recipe, f"flaky://{inputs}/*/part.*")

    # Every planted failure fired (the same names in two folders fire at each), and none lost a document.
    assert {event for event in flaky.raised} == {(n, o) for n, offsets in failures.items() for o in offsets}
    assert retried_stats["read"]["documents"] == clean_stats["read"]["documents"] == 3000
    assert retried_stats["rejected"]["documents"] == 0 and retried_stats["balanced"]
    assert len(retried_stats["sources"]) == 5 and "a/part.jsonl" in retried_stats["sources"]
    for stats in (clean_stats, retried_stats):
        del stats["inputs"]
    assert retried_stats == clean_stats
    clean_files, retried_files = tree_bytes(clean), tree_bytes(retried)
    del clean_files["stats.json"], retried_files["stats.json"]
    assert retried_files == clean_files


def test_a_read_that_keeps_failing_fails_the_run_instead_of_losing_documents(tmp_path, flaky):
    inputs = tmp_path / "in"
    write_mixed_inputs(inputs)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(PLAIN_RECIPE)
    for name in ("part.jsonl.zst", "part.parquet"):
        size = next(inputs.rglob(name)).stat().st_size
        flaky.reset({name: [size // 2]}, permanent={name})
        output = tmp_path / f"out-{name}"
        with pytest.raises(Exception, match="Connection reset by peer") as caught:
            curate(output, recipe, f"flaky://{inputs}/*/{name}")
        assert "truncated" not in str(caught.value) and "unreadable" not in str(caught.value)
        assert len(flaky.raised) == storage.READ_ATTEMPTS  # retried, then given up
        assert not (output / "stats.json").exists()


def test_the_retrying_reader_resumes_at_the_offset_reached(tmp_path, flaky):
    data = os.urandom(3_000_000)
    (tmp_path / "blob.bin").write_bytes(data)
    flaky.reset({"blob.bin": [10, 1_000_000, 2_999_999]})
    with storage.open_file(f"flaky://{tmp_path}/blob.bin") as handle:
        assert handle.read(5) == data[:5]
        assert handle.read() == data[5:]
    assert len(flaky.raised) == 3
    with storage.open_file(f"flaky://{tmp_path}/blob.bin") as handle:  # seeks are resumed from too
        handle.seek(2_999_990)
        assert handle.read() == data[2_999_990:]
    with pytest.raises(FileNotFoundError):  # a permanent error is not retried
        storage.open_file(f"flaky://{tmp_path}/missing.bin")


# --- Ids that cannot collide ---------------------------------------------------------------------------


def test_files_of_one_name_in_two_folders_keep_all_their_documents(tmp_path):
    inputs = tmp_path / "in"
    for crawl in ("crawl-01", "crawl-02"):
        (inputs / crawl).mkdir(parents=True)
        rows = [{"id": str(i), "text": f"{crawl} page {i}: {os.urandom(16).hex()}"} for i in range(300)]
        (inputs / crawl / "part.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(PLAIN_RECIPE)
    stats = curate(tmp_path / "out", recipe, str(inputs / "*" / "part.jsonl"))
    assert stats["kept"]["documents"] == 600 and stats["removed"]["documents"] == 0
    assert set(stats["sources"]) == {"crawl-01/part.jsonl", "crawl-02/part.jsonl"}
    ids = curated_dataset(str(tmp_path / "out" / "curated")).to_table().column("id").to_pylist()
    assert len(set(ids)) == 600 and "crawl-02/part.jsonl:299" in ids


def test_a_repeated_id_in_one_file_stops_the_run(tmp_path):
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "dup.jsonl").write_text('{"id": "7", "text": "a"}\n{"id": "7", "text": "b"}\n')
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(PLAIN_RECIPE)
    with pytest.raises(Exception, match="id '7' is used twice, by line 1 and line 2"):
        curate(tmp_path / "out", recipe, str(inputs / "*.jsonl"))
    assert not (tmp_path / "out" / "stats.json").exists()


# --- One huge line -------------------------------------------------------------------------------------

BIG_TEXT_BYTES = 300 * 10**6
#: Runs the CLI as a child and prints the peak resident memory of it and its children (KiB).
MEASURE = textwrap.dedent(
    """
    import resource, subprocess, sys
    status = subprocess.run([sys.executable, "-m", "tokenmill", *sys.argv[1:]]).returncode
    print("peak_kib", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    sys.exit(status)
    """
)


def write_with_a_huge_line(handle, prefix: str) -> bytes:
    """Five short lines, one line of 300 MB (written in pieces), five short lines; returns the head."""
    head = "".join(json.dumps({"id": f"{prefix}{i}", "text": f"short {prefix} {i}"}) + "\n" for i in range(5))
    handle.write(head.encode())
    handle.write(b'{"id": "big", "text": "')
    piece = b"huge " * 200_000  # 1 MB
    for _ in range(BIG_TEXT_BYTES // len(piece)):
        handle.write(piece)
    handle.write(b'"}\n')
    tail = "".join(
        json.dumps({"id": f"{prefix}{i}", "text": f"short {prefix} {i}"}) + "\n" for i in range(5, 10)
    )
    handle.write(tail.encode())
    return head.encode()


def test_a_300_mb_line_is_rejected_and_the_run_stays_small(tmp_path):
    inputs = tmp_path / "in"
    inputs.mkdir()
    with open(inputs / "big.jsonl", "wb") as handle:
        head = write_with_a_huge_line(handle, "p")
    with open(inputs / "big.jsonl.zst", "wb") as raw, zstandard.ZstdCompressor().stream_writer(raw) as handle:
        write_with_a_huge_line(handle, "z")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("name: tiny\n")
    output = tmp_path / "out"
    args = ["curate", "--recipe", str(recipe), "--input", str(inputs / "*"), "--output", str(output)]
    result = subprocess.run(
        [sys.executable, "-c", MEASURE, *args, "--workers", "1"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    peak_bytes = int(result.stdout.split("peak_kib")[1]) * 1024
    assert peak_bytes < 1.5 * 2**30, f"peak memory {peak_bytes / 2**30:.2f} GiB"
    print(f"peak memory of the run: {peak_bytes / 2**20:,.0f} MiB")

    stats = json.loads((output / "stats.json").read_text())
    assert stats["balanced"] is True
    assert stats["kept"]["documents"] == 20 and stats["read"]["documents"] == 22
    assert stats["rejected_by_error"] == {"record_too_large": {"documents": 2}}
    rejected = rejected_rows(output)
    assert [(r["file"].rsplit("/", 1)[1], r["line"], r["offset"]) for r in rejected] == [
        ("big.jsonl", 6, len(head)),
        ("big.jsonl.zst", 6, len(head)),
    ]
    big_line = len('{"id": "big", "text": "') + BIG_TEXT_BYTES + len('"}\n')
    for record in rejected:
        assert f"a line of {big_line:,} bytes" in record["error"]
        assert record["raw_truncated"] and record["raw"].startswith('{"id": "big", "text": "huge huge')
        assert len(record["raw"]) == records.RAW_LIMIT
    ids = curated_dataset(str(output / "curated")).to_table().column("id").to_pylist()
    assert sorted(ids) == sorted(
        [f"big.jsonl:p{i}" for i in range(10)] + [f"big.jsonl.zst:z{i}" for i in range(10)]
    )
