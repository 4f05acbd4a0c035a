"""`tokenmill curate` end to end: accounting, bad input, determinism, kill-and-rerun, dedupe."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import zstandard
from conftest import REPO, SAMPLE, WEB_RECIPE, rejected_rows, run_tokenmill, tree_bytes

from tokenmill.cli import main


def curate(
    output: Path, *inputs: str, recipe: Path = WEB_RECIPE, workers: int = 1, overwrite: bool = False
) -> dict:
    status = main(
        [
            "curate",
            *(["--overwrite"] if overwrite else []),
            "--recipe",
            str(recipe),
            "--output",
            str(output),
            "--workers",
            str(workers),
            *[arg for path in inputs for arg in ("--input", path)],
        ]
    )
    assert status == 0
    return json.loads((output / "stats.json").read_text())


def parquet_rows(root: Path) -> list[dict]:
    return [row for path in sorted(root.rglob("*.parquet")) for row in pq.read_table(path).to_pylist()]


def count_input_records(directory: Path) -> int:
    """Records in the sample files, counted without tokenmill's reader."""
    total = 0
    for path in sorted(directory.iterdir()):
        if path.suffix == ".parquet":
            total += pq.read_metadata(path).num_rows
            continue
        data = path.read_bytes()
        if path.name.endswith(".zst"):
            data = zstandard.ZstdDecompressor().stream_reader(data).read()
        elif path.name.endswith(".gz"):
            data = gzip.decompress(data)
        total += sum(1 for line in data.splitlines() if line.strip())
    return total


@pytest.fixture(scope="module")
def sample_run(web_sample_run) -> tuple[Path, dict]:
    return web_sample_run  # conftest's: other modules read the same run


def test_sample_accounting_balances_and_matches_the_files(sample_run):
    output, stats = sample_run
    assert stats["balanced"] is True
    assert stats["read"]["documents"] == count_input_records(SAMPLE)
    curated = parquet_rows(output / "curated")
    removed = parquet_rows(output / "removed")
    rejected = rejected_rows(output)
    assert len(curated) == stats["kept"]["documents"] > 0
    assert len(removed) == stats["removed"]["documents"] > 0
    assert len(rejected) == stats["rejected"]["documents"] == 3
    assert stats["read"]["documents"] == len(curated) + len(removed) + len(rejected)
    # Every document is in exactly one place.
    ids = [row["id"] for row in curated + removed]
    assert len(ids) == len(set(ids))
    # Per-reason counts match the removed/ folders.
    on_disk = Counter()
    for path in (output / "removed").rglob("*.parquet"):
        stage, reason = path.parent.parent.name.split("=", 1)[1], path.parent.name.split("=", 1)[1]
        on_disk[f"{stage}/{reason}"] += pq.read_metadata(path).num_rows
    assert dict(on_disk) == {key: entry["documents"] for key, entry in stats["removed_by_reason"].items()}
    # The funnel ends at what was kept and never grows.
    funnel = [entry["documents"] for entry in stats["funnel"]]
    assert funnel[-1] == stats["kept"]["documents"]
    assert funnel == sorted(funnel, reverse=True)
    assert [entry["stage"] for entry in stats["funnel"]] == [
        "read",
        "normalize",
        "language",
        "exact_dedupe",
        "fuzzy_dedupe",
        "gopher_repetition",
        "gopher_quality",
        "fineweb_quality",
        "c4",
        "pii",
    ]
    # Every kind of planted noise was caught somewhere.
    kinds = Counter(json.loads(row["metadata"]).get("kind") for row in removed)
    for kind in ("spam", "boilerplate", "language_de", "language_fr", "language_es", "exact_duplicate"):
        assert kinds[kind] > 0, kind
    assert stats["sources"]["web-002.jsonl"]["rejected"] == 3
    for counts in stats["sources"].values():
        assert counts["read"] == counts["kept"] + counts["removed"] + counts["rejected"]


def test_curated_layout_and_schema(sample_run):
    output, stats = sample_run
    files = sorted(p.relative_to(output).as_posix() for p in (output / "curated").rglob("*.parquet"))
    assert files == ["curated/domain=web/quality=0/part-00000-of-00001.parquet"]
    table = pq.read_table(output / files[0])
    assert table.schema.names == [
        "id",
        "text",
        "source",
        "url",
        "metadata",
        "language",
        "language_score",
        "quality_score",
        "quality",
        "domain",
        "domain_score",
        "n_chars",
        "n_words",
        "dup_cluster",
        "dup_cluster_size",
        "pii",
    ]
    assert str(table.schema.field("quality").type) == "int8"
    assert str(table.schema.field("dup_cluster_size").type) == "int64"
    ids = table.column("id").to_pylist()
    assert ids == sorted(ids)
    assert pq.ParquetFile(output / files[0]).metadata.row_group(0).column(1).compression == "ZSTD"
    assert stats["cells"]["domain=web/quality=0"]["documents"] == table.num_rows


def test_exact_duplicates_keep_the_smallest_id_across_files(sample_run):
    output, _ = sample_run
    removed = pq.read_table(output / "removed" / "stage=exact_dedupe" / "reason=exact_duplicate").to_pylist()
    assert removed
    everything = {
        row["id"]: row for row in parquet_rows(output / "curated") + parquet_rows(output / "removed")
    }
    curated_ids = {row["id"] for row in parquet_rows(output / "curated")}
    matched = {}
    for row in removed:
        detail = json.loads(row["detail"])
        # The copy the stage kept (matched_id where fuzzy dedupe removed it later); kept_id is in curated/.
        matched[row["id"]] = detail.get("matched_id", detail["kept_id"])
        assert matched[row["id"]] < row["id"]
        assert everything[matched[row["id"]]]["text"] == row["text"]
        assert detail["kept_id"] in curated_ids
    # The Parquet input repeats JSONL documents: dedupe crossed files and formats.
    assert any(
        everything[matched[row["id"]]]["source"] == "mixed-000.parquet"
        and row["source"].endswith((".jsonl", ".jsonl.gz", ".jsonl.zst"))
        for row in removed
    )


def test_rerun_gives_identical_bytes_whatever_the_worker_count(sample_run, tmp_path, capsys):
    output, _ = sample_run
    # A folder that holds an earlier run (the 2-worker run's output): refused, then replaced with
    # --overwrite by a 1-worker run, which must write every byte again (one curate run, not two).
    again = tmp_path / "again"
    shutil.copytree(output, again)
    capsys.readouterr()
    argv = ["curate", "--recipe", str(WEB_RECIPE), "--input", str(SAMPLE / "*"), "--output", str(again)]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert "holds an earlier curate run (curated, removed, rejected, dedupe-index, stats.json)" in error
    assert "pass --overwrite" in error
    assert tree_bytes(again) == tree_bytes(output)  # refused before touching anything
    # What the rerun must replace: every file of the earlier run spoiled, and one it did not write.
    for path in sorted(again.rglob("*")):
        if path.is_file():
            path.write_bytes(b"spoiled")
    stale = again / "curated" / "domain=web" / "quality=9" / "part-stale.parquet"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"stale")
    (again / "notes.txt").write_text("not curate's\n")  # beside the run: --overwrite leaves it
    curate(again, str(SAMPLE / "*"), workers=1, overwrite=True)
    assert (again / "notes.txt").read_text() == "not curate's\n"
    (again / "notes.txt").unlink()
    assert tree_bytes(again) == tree_bytes(output)


def write_bad_inputs(directory: Path) -> None:
    directory.mkdir()
    good = [
        {"id": f"g{i}", "text": f"Good document number {i} with enough words to stand alone."}
        for i in range(5)
    ]
    bad = (
        b"\n".join(
            [
                b'{"id": "bad-json", "text": "unterminated"',
                b'{"id": "bad-utf8", "text": "caf\xe9"}',
                b'{"id": "no-text", "body": "elsewhere"}',
                b'{"id": "list-text", "text": ["not", "a", "string"]}',
                b'{"id": "empty", "text": "  \\n "}',
            ]
        )
        + b"\n"
    )
    (directory / "good.jsonl").write_text("".join(json.dumps(r) + "\n" for r in good))
    (directory / "bad.jsonl").write_bytes(bad)
    (directory / "huge.jsonl").write_text(json.dumps({"id": "huge", "text": "word " * 10_000_000}) + "\n")
    payload = "".join(
        json.dumps({"id": f"z{i}", "text": f"{i} {os.urandom(200).hex()}"}) + "\n" for i in range(2000)
    ).encode()
    compressed = zstandard.ZstdCompressor().compress(payload)
    (directory / "cut.jsonl.zst").write_bytes(compressed[: len(compressed) * 2 // 3])
    (directory / "notes.txt").write_text("not a corpus\n")


def test_every_bad_input_is_accounted_for(tmp_path):
    inputs = tmp_path / "inputs"
    write_bad_inputs(inputs)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("name: plain\nstages:\n  - exact_dedupe: {}\n")
    stats = curate(tmp_path / "out", str(inputs / "*"), recipe=recipe)
    assert stats["balanced"] is True
    assert {k: v["documents"] for k, v in stats["rejected_by_error"].items()} == {
        "bad_json": 1,
        "bad_utf8": 1,
        "missing_text": 1,
        "text_not_string": 1,
        "truncated": 1,
        "unknown_format": 1,
    }
    assert stats["removed_by_reason"]["normalize/empty"]["documents"] == 1
    assert stats["removed_by_reason"]["normalize/too_long"]["documents"] == 1
    truncated_docs = stats["sources"]["cut.jsonl.zst"]["kept"]
    assert 0 < truncated_docs < 2000
    assert stats["kept"]["documents"] == 5 + truncated_docs
    rejected = {row["error_kind"]: row for row in rejected_rows(tmp_path / "out")}
    assert rejected["bad_utf8"]["line"] == 2 and rejected["bad_utf8"]["file"].endswith("bad.jsonl")
    assert "notes.txt" in rejected["unknown_format"]["error"]
    huge = pq.read_table(tmp_path / "out" / "removed" / "stage=normalize" / "reason=too_long").to_pylist()
    assert huge[0]["id"] == "huge.jsonl:huge" and len(huge[0]["text"]) == 50_000_000  # kept whole, not lost


def test_missing_input_fails_before_the_pipeline_naming_the_path(tmp_path):
    result = run_tokenmill(
        "curate",
        "--recipe",
        str(WEB_RECIPE),
        "--input",
        str(tmp_path / "nope/*.jsonl"),
        "--output",
        str(tmp_path / "out"),
        check=False,
    )
    assert result.returncode == 2
    assert f"--input '{tmp_path / 'nope/*.jsonl'}' matches no file" in result.stderr
    assert not (tmp_path / "out").exists()


def test_bad_recipe_names_the_file_and_stage(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: x\nstages:\n  - gopher_quality: {min_doc_wrds: 3}\n")
    result = run_tokenmill(
        "curate",
        "--recipe",
        str(recipe),
        "--input",
        str(SAMPLE / "*"),
        "--output",
        str(tmp_path / "out"),
        check=False,
    )
    assert result.returncode == 2
    assert f"{recipe}: stages[0]: bad parameters for gopher_quality" in result.stderr
    assert "min_doc_wrds" in result.stderr


@pytest.mark.slow  # half a minute of curate runs: make test-slow
def test_a_killed_run_rerun_ends_like_a_clean_run(sample_run, tmp_path):
    clean, _ = sample_run
    output = tmp_path / "killed"
    command = [
        sys.executable,
        "-m",
        "tokenmill",
        "curate",
        "--recipe",
        str(WEB_RECIPE),
        "--input",
        str(SAMPLE / "*"),
        "--output",
        str(output),
        "--workers",
        "2",
    ]
    process = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    # Kill it once it has started writing (or after a few seconds), with everything it spawned.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.poll() is None:
        if (output / "removed").exists():
            break
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert not (output / "stats.json").exists() or tree_bytes(output) == tree_bytes(clean)
    # The rerun over what the killed process left: in this process, on one worker (a third of the time of
    # two worker processes here; the bytes do not depend on the worker count, as the rerun test above shows).
    curate(output, str(SAMPLE / "*"), workers=1, overwrite=True)
    assert tree_bytes(output) == tree_bytes(clean)


def test_removed_documents_can_be_recorded_without_their_text(tmp_path):
    inputs = tmp_path / "inputs"
    write_bad_inputs(inputs)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("name: plain\nremoved_text: false\nstages:\n  - exact_dedupe: {}\n")
    stats = curate(tmp_path / "out", str(inputs / "*"), recipe=recipe)
    assert stats["balanced"] is True
    rows = parquet_rows(tmp_path / "out" / "removed")
    assert len(rows) == stats["removed"]["documents"] > 0
    assert all(row["text"] is None for row in rows)
    huge = pq.read_table(tmp_path / "out" / "removed" / "stage=normalize" / "reason=too_long").to_pylist()
    # The size and the why stay: the 50 MB document is named with its length and its reason's detail.
    assert huge[0]["id"] == "huge.jsonl:huge" and huge[0]["n_chars"] == 50_000_000 and huge[0]["detail"]
    # The curated side is untouched.
    assert all(row["text"] for row in parquet_rows(tmp_path / "out" / "curated"))


def test_sources_get_their_license_and_provenance_from_the_recipe_and_the_records(tmp_path):
    inputs = tmp_path / "inputs"
    (inputs / "crawl").mkdir(parents=True)
    records = {
        "crawl/a.jsonl": [{"id": f"a{n}", "text": f"Document {n} of a.", "meta": {"license": lic}}
                          for n, lic in enumerate(["CC-BY-4.0", "CC-BY-4.0", "MIT", ""])],
        "crawl/b.jsonl": [{"id": "b0", "text": "The only one of b.", "meta": {"license": ["MIT", "X"]}}],
        "books.jsonl": [{"id": "c0", "text": "A book.", "meta": "not an object"}],
    }  # fmt: skip
    for name, rows in records.items():
        (inputs / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "name: licensed\nfields: {license: meta.license}\nsources:\n"
        '  "crawl/b*": {license: "<script>x</script> GPL-3.0", provenance: "https://example.org/b"}\n'
        '  "crawl/*": {license: CC-BY-4.0}\n'
        '  "unused/*": {provenance: nowhere}\n'
    )
    stats = curate(tmp_path / "out", str(inputs / "**" / "*.jsonl"), str(inputs / "*.jsonl"), recipe=recipe)
    sources = stats["sources"]
    # The first pattern that matches gives the license (kept as text), the records their own licenses.
    assert sources["crawl/b.jsonl"]["license"] == "<script>x</script> GPL-3.0"
    assert sources["crawl/b.jsonl"]["provenance"] == "https://example.org/b"
    assert sources["crawl/b.jsonl"]["licenses"] == {'["MIT", "X"]': 1}
    assert sources["crawl/a.jsonl"]["license"] == "CC-BY-4.0" and "provenance" not in sources["crawl/a.jsonl"]
    assert sources["crawl/a.jsonl"]["licenses"] == {"CC-BY-4.0": 2, "MIT": 1}  # an empty one is none
    assert set(sources["books.jsonl"]) == {"read", "kept", "removed", "rejected"}  # nothing says


def test_a_bad_sources_table_names_the_field(tmp_path):
    from tokenmill.pipelines.recipe import RecipeError, load_recipe

    recipe = tmp_path / "r.yaml"
    for table, field in (
        ('  "web-*": {licence: MIT}\n', "sources.web-*.licence: Extra inputs are not permitted"),
        ('  "web-*": {}\n', "sources.web-*: Value error, give a license, a provenance or both"),
        ('  "web-*": {license: ""}\n', "sources.web-*.license: String should have at least 1 character"),
        ('  "web-*": MIT\n', "sources.web-*: Input should be a valid dictionary"),
    ):  # fmt: skip
        recipe.write_text(f"name: r\nsources:\n{table}")
        with pytest.raises(RecipeError) as error:
            load_recipe(recipe)
        assert str(error.value).startswith(f"{recipe}: ") and field in str(error.value)
