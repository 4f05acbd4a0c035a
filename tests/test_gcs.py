"""gs:// end to end against a real GCS emulator on loopback (tests/gcs_emulator.py): the storage layer,
and `tokenmill curate` and `tokenmill tokenize` from gs:// input to gs:// output, byte-identical to the
same runs on local paths, with every connection beyond loopback refused."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import zstandard
from conftest import SAMPLE, WEB_RECIPE, offline_env, rejected_rows, run_tokenmill, tree_bytes
from gcs_emulator import GcsEmulator

from tokenmill import storage
from tokenmill.cli import main

# `gcs`: the session's emulator, a fixture of conftest.py.


# --- the storage layer ---------------------------------------------------------------------------------


def test_storage_layer_reads_lists_and_removes_on_gcs(gcs):
    fs = gcs.filesystem()
    base = gcs.url("layer")
    storage.write_bytes(f"{base}/out/curated/domain=web/quality=1/part-0.parquet", b"a" * 10)
    storage.write_json(f"{base}/out/stats.json", {"b": 1, "a": [1]})
    storage.write_bytes(f"{base}/out/curated-old/keep.parquet", b"old")
    storage.write_bytes(f"{base}/out/notes.txt", b"mine")

    assert storage.read_json(f"{base}/out/stats.json") == {"a": [1], "b": 1}
    assert fs.cat_file(f"{gcs.bucket}/layer/out/stats.json") == b'{\n  "a": [\n    1\n  ],\n  "b": 1\n}\n'
    assert storage.exists(f"{base}/out/stats.json") and not storage.exists(f"{base}/out/nope.json")
    assert storage.expand_glob(f"{base}/out/*.json") == [f"{base}/out/stats.json"]
    # A prefix is a folder: out/curated never takes in out/curated-old.
    assert storage.list_files(f"{base}/out/curated") == [
        f"{base}/out/curated/domain=web/quality=1/part-0.parquet"
    ]
    assert storage.list_files(f"{base}/out", relative=True) == [
        "curated-old/keep.parquet",
        "curated/domain=web/quality=1/part-0.parquet",
        "notes.txt",
        "stats.json",
    ]
    assert storage.is_dir_nonempty(f"{base}/out/curated")
    assert not storage.is_dir_nonempty(f"{base}/out/cur") and not storage.is_dir_nonempty(f"{base}/none")
    assert storage.remove_tree(f"{base}/out/curated") == 1
    assert storage.remove_tree(f"{base}/out/curated") == 0
    assert storage.remove_file(f"{base}/out/stats.json") and not storage.remove_file(f"{base}/out/stats.json")
    assert storage.list_files(f"{base}/out", relative=True) == ["curated-old/keep.parquet", "notes.txt"]

    # A write that fails halfway leaves no object (closing an fsspec writer would have committed it).
    with pytest.raises(RuntimeError), storage.atomic_write(f"{base}/half.bin") as handle:
        handle.write(b"x" * (1 << 20))
        raise RuntimeError("killed mid-write")
    assert not storage.exists(f"{base}/half.bin")
    with storage.atomic_write(f"{base}/whole.bin") as handle:
        handle.write(b"y" * (3 << 20))
    assert storage.file_sha256(f"{base}/whole.bin") == hashlib.sha256(b"y" * (3 << 20)).hexdigest()


def test_local_copy_downloads_once_and_follows_a_changed_object(gcs, tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    model = gcs.url("models", "lid.176.bin")
    storage.write_bytes(model, b"first model")
    first = storage.local_copy(model)
    assert first.endswith("/lid.176.bin") and Path(first).read_bytes() == b"first model"
    assert first.startswith(str(tmp_path / "cache"))
    downloads = []
    fs = storage.filesystem(model)[0]  # fsspec hands out one instance per set of options
    get_file = fs.get_file

    def counting_get_file(*args, **kwargs):
        downloads.append(args[0])
        return get_file(*args, **kwargs)

    monkeypatch.setattr(fs, "get_file", counting_get_file)
    assert storage.local_copy(model) == first and downloads == []  # cached: no second download
    storage.write_bytes(model, b"second model, longer")
    second = storage.local_copy(model)
    assert second != first and Path(second).read_bytes() == b"second model, longer"
    assert len(downloads) == 1
    assert not [p for p in (tmp_path / "cache").rglob(storage.TEMPORARY_PREFIX + "*")]
    with pytest.raises(FileNotFoundError):
        storage.local_copy(gcs.url("models", "missing.bin"))
    local = tmp_path / "local.bin"
    local.write_bytes(b"here")
    assert storage.local_copy(str(local)) == str(local)  # local files are used where they are


# --- curate and tokenize, gs:// to gs:// -----------------------------------------------------------------


def normalized_rejected(rows: list[dict], root: str) -> list[dict]:
    """Rejected rows with the input root taken out of the fields that name the file's location."""
    return [
        {**row, "file": row["file"].replace(root, "<root>"), "error": row["error"].replace(root, "<root>")}
        for row in rows
    ]


def gcs_rejected_rows(gcs: GcsEmulator, *parts: str) -> list[dict]:
    rows = []
    for data in gcs.tree_bytes(*parts, "rejected").values():
        text = zstandard.ZstdDecompressor().stream_reader(data).read()
        rows.extend(json.loads(line) for line in text.splitlines())
    return rows


@pytest.mark.slow  # half a minute of curate runs: make test-slow
def test_curate_and_tokenize_from_gs_to_gs_give_the_bytes_of_local_runs(
    gcs, web_sample_run, tmp_path, capsys
):
    env, network_log = offline_env(tmp_path)
    env.update(gcs.env)
    raw = gcs.upload(SAMPLE, "raw")
    out = gcs.url("out")
    # What an earlier run left in the output folder, and a file that is not the run's.
    storage.write_bytes(f"{out}/curated/domain=web/quality=9/part-00002-of-00003.parquet", b"stale")
    storage.write_bytes(f"{out}/stats.json", b"{}")
    storage.write_bytes(f"{out}/notes.txt", b"not curate's")

    curate = ["curate", "--recipe", str(WEB_RECIPE), "--input", f"{raw}/*", "--output", out]
    capsys.readouterr()
    assert main(curate) == 2  # refused, before anything is written or removed
    assert f"--output {out} holds an earlier curate run (curated, stats.json)" in capsys.readouterr().err
    assert storage.read_json(f"{out}/stats.json") == {}
    run_tokenmill(*curate, "--overwrite", "--workers", "2", env=env)

    # The local run: conftest's curate of the sample with the same recipe (bytes that do not depend on the
    # worker count: test_curate.py), shared with other tests.
    local_out, _ = web_sample_run
    local = tmp_path / "local"
    remote = gcs.tree_bytes("out")
    assert remote.pop("notes.txt") == b"not curate's"  # --overwrite removes the run's parts only
    expected = {
        name: data for name, data in tree_bytes(local_out).items() if not name.startswith("rejected/")
    }
    assert {name: data for name, data in remote.items() if not name.startswith("rejected/")} == expected
    assert any(name.startswith("curated/") for name in expected) and "stats.json" in expected
    # Rejected records name the file where it is; apart from that location they are the same.
    local_rows = normalized_rejected(rejected_rows(local_out), str(SAMPLE))
    assert normalized_rejected(gcs_rejected_rows(gcs, "out"), raw) == local_rows and len(local_rows) == 3

    # A tokenizer trained on the local run's text, read by the gs:// run from the bucket (with its sidecar).
    tokenizer = local / "tok" / "tokenizer.json"
    assert (
        main(
            [
                "tokenizer",
                "train",
                "--input",
                str(local_out / "curated"),
                "--vocab-size",
                "600",
                "--output",
                str(tokenizer),
            ]
        )
        == 0
    )
    gcs.upload(tokenizer.parent, "tok")
    tokens = gcs.url("tokens")
    storage.write_bytes(f"{tokens}/domain=web/quality=9/part-00007.bin", b"stale shard")
    tokenize = [
        "tokenize",
        "--input",
        f"{out}/curated",
        "--output",
        tokens,
        "--tokenizer",
        gcs.url("tok", "tokenizer.json"),
        "--progress-seconds",
        "0",
        "--workers",
        "1",
    ]
    assert main(tokenize) == 2
    assert f"--output {tokens} holds an earlier tokenize run (no counts.json" in capsys.readouterr().err
    run_tokenmill(*tokenize, "--overwrite", env=env)
    assert (
        main(
            [
                "tokenize",
                "--input",
                str(local_out / "curated"),
                "--output",
                str(local / "tokens"),
                "--tokenizer",
                str(tokenizer),
                "--progress-seconds",
                "0",
                "--workers",
                "1",
            ]
        )
        == 0
    )
    local_tokens = tree_bytes(local / "tokens")
    assert {"counts.json", "domain=web/quality=0/manifest.json"} <= set(local_tokens)
    assert any(name.endswith(".bin") for name in local_tokens)
    assert gcs.tree_bytes("tokens") == local_tokens

    assert not network_log.exists(), network_log.read_text()
