"""Dedupe against earlier runs: curate writes OUTPUT/dedupe-index/, a later run with --dedupe-against removes
its copies and near copies of what the earlier run kept, naming the earlier document; indexes merge, an
index made with other MinHash parameters is refused, and the index works on gs:// (the GCS emulator)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tokenmill.cli import main
from tokenmill.formats import dedupe_index as index_format
from tokenmill.pipelines.dedupe_index import DedupeIndexError, load_indexes, merge_indexes

RECIPE = """name: dedupe
stages:
  - exact_dedupe: {}
  - fuzzy_dedupe: {bands: BANDS, rows: ROWS, threshold: THRESHOLD}
"""

_WORDS = [f"w{n}q" for n in range(5000)]


def _text(rng: random.Random, words: int = 160) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words)) + "."


def _edited(text: str, rng: random.Random, at: float = 0.5) -> str:
    """One word replaced: about 5 of 156 five-word shingles change, Jaccard ~0.94."""
    words = text.split(" ")
    words[int(len(words) * at)] = "edited" + str(rng.randrange(10**6))
    return " ".join(words)


def _write(path: Path, documents: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": key, "text": text}) + "\n" for key, text in documents.items()))


def _recipe(tmp_path: Path, bands: int = 20, rows: int = 5, threshold: float = 0.7) -> Path:
    path = tmp_path / f"recipe-{bands}x{rows}-{threshold}.yaml"
    text = RECIPE.replace("BANDS", str(bands)).replace("ROWS", str(rows))
    path.write_text(text.replace("THRESHOLD", str(threshold)))
    return path


def _curate(recipe: Path, inputs: Path, output: str, *against: str) -> int:
    flags = [flag for index in against for flag in ("--dedupe-against", index)]
    return main(
        [
            "curate",
            "--recipe",
            str(recipe),
            "--input",
            str(inputs),
            "--output",
            output,
            "--workers",
            "1",
            *flags,
        ]
    )


def _rows(root: Path, folder: str) -> list[dict]:
    rows = []
    for path in sorted((root / folder).rglob("*.parquet")):
        rows.extend(pq.read_table(path).to_pylist())
    return rows


def _plain(identifier: str) -> str:
    """An id without the input file's name that curate qualifies it with ("b.jsonl:copy1" -> "copy1")."""
    return identifier.split(":", 1)[1]


def _removed(root: Path, stage: str, reason: str) -> dict[str, dict]:
    """id -> detail of the removals under removed/stage=STAGE/reason=REASON, earlier_id made plain."""
    removals = {}
    for row in _rows(root, f"removed/stage={stage}/reason={reason}"):
        detail = json.loads(row["detail"])
        if "earlier_id" in detail:
            detail["earlier_id"] = _plain(detail["earlier_id"])
        removals[_plain(row["id"])] = detail
    return removals


def _kept_ids(root: Path) -> set[str]:
    return {_plain(row["id"]) for row in _rows(root, "curated")}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Run A (40 documents) curated; run B: 8 exact copies and 8 one-word edits of A's documents, 20 new
    documents, and one new document twice (a duplicate inside B)."""
    tmp_path = tmp_path_factory.mktemp("dedupe-index")
    rng = random.Random(30)
    a = {f"a{n:02d}": _text(rng) for n in range(40)}
    copies = {f"copy{n}": a[f"a{n:02d}"] for n in range(8)}
    edits = {f"edit{n}": _edited(a[f"a{n + 10:02d}"], rng) for n in range(8)}
    new = {f"new{n:02d}": _text(rng) for n in range(20)}
    new["new99"] = new["new00"]
    _write(tmp_path / "a" / "a.jsonl", a)
    _write(tmp_path / "b" / "b.jsonl", {**copies, **edits, **new})
    recipe = _recipe(tmp_path)
    assert _curate(recipe, tmp_path / "a" / "*.jsonl", str(tmp_path / "out-a")) == 0
    return tmp_path, recipe, a, copies, edits, new


def test_a_later_run_removes_its_copies_and_edits_of_an_earlier_run_naming_them(corpus):
    tmp_path, recipe, a, copies, edits, new = corpus
    index = tmp_path / "out-a" / index_format.INDEX_DIR
    manifest = index_format.read_manifest(str(index))
    assert manifest.documents == 40 and manifest.minhash.bands == 20 and len(manifest.runs) == 1
    rows = pq.read_table(index / manifest.runs[0].files[0].path).to_pylist()
    assert {_plain(row["id"]) for row in rows} == set(a) and all(len(row["band_keys"]) == 20 for row in rows)
    run_a = manifest.runs[0].id

    out_b = tmp_path / "out-b"
    assert _curate(recipe, tmp_path / "b" / "*.jsonl", str(out_b), str(index)) == 0
    exact = _removed(out_b, "exact_dedupe", "earlier_duplicate")
    near = _removed(out_b, "fuzzy_dedupe", "earlier_near_duplicate")
    assert {key: value["earlier_id"] for key, value in exact.items()} == {
        f"copy{n}": f"a{n:02d}" for n in range(8)
    }
    assert {key: value["earlier_id"] for key, value in near.items()} == {
        f"edit{n}": f"a{n + 10:02d}" for n in range(8)
    }
    assert {value["earlier_run"] for value in (*exact.values(), *near.values())} == {run_a}
    assert all("kept_id" not in value for value in (*exact.values(), *near.values()))

    # Otherwise B is deduped as it would be alone: its own duplicate goes, its new documents stay.
    out_alone = tmp_path / "out-b-alone"
    assert _curate(recipe, tmp_path / "b" / "*.jsonl", str(out_alone)) == 0
    assert _kept_ids(out_alone) == set(copies) | set(edits) | set(new) - {"new99"}
    assert _kept_ids(out_b) == set(new) - {"new99"}
    assert _removed(out_b, "exact_dedupe", "exact_duplicate") == _removed(
        out_alone, "exact_dedupe", "exact_duplicate"
    )

    stats = json.loads((out_b / "stats.json").read_text())
    assert stats["balanced"] and stats["read"]["documents"] == 37
    assert stats["removed_by_reason"]["exact_dedupe/earlier_duplicate"]["documents"] == 8
    assert stats["removed_by_reason"]["fuzzy_dedupe/earlier_near_duplicate"]["documents"] == 8
    assert stats["stages"]["exact_dedupe"]["earlier_duplicates"] == 8
    assert stats["stages"]["fuzzy_dedupe"]["earlier_near_duplicates"] == 8
    # B's own index holds what B kept, and only that.
    b_index = index_format.read_manifest(str(out_b / index_format.INDEX_DIR))
    assert b_index.documents == len(_kept_ids(out_b))


def test_index_shards_hold_to_the_recipe_target_file_bytes_and_store_the_same_rows(corpus):
    """The index is written like every other output: shards sized for target_file_bytes (so a writer's
    memory stays bounded however large the corpus), each sorted by id, and the stored rows (band keys and
    compact signatures made from the signature the shuffle carried) equal those of a one-shard index."""
    tmp_path, recipe, a, *_ = corpus
    small = tmp_path / "recipe-small-files.yaml"
    small.write_text(recipe.read_text().replace("name: dedupe\n", "name: dedupe\ntarget_file_bytes: 10000\n"))
    assert _curate(small, tmp_path / "a" / "*.jsonl", str(tmp_path / "out-a-sharded")) == 0
    sharded = tmp_path / "out-a-sharded" / index_format.INDEX_DIR
    files = index_format.read_manifest(str(sharded)).runs[0].files
    assert len(files) == 3  # ceil(40 rows x 700 bytes / 10,000)
    rows = []
    for entry in files:
        shard = pq.read_table(sharded / entry.path).to_pylist()
        assert [row["id"] for row in shard] == sorted(row["id"] for row in shard) and len(shard) == entry.rows
        rows.extend(shard)
    whole = tmp_path / "out-a" / index_format.INDEX_DIR
    one_shard = pq.read_table(whole / index_format.read_manifest(str(whole)).runs[0].files[0].path)
    assert sorted(rows, key=lambda row: row["id"]) == one_shard.to_pylist()


@pytest.mark.slow  # the default suite's 15-minute budget; make test-slow runs it
def test_merged_indexes_dedupe_a_third_run_against_both(corpus):
    tmp_path, recipe, a, copies, edits, new = corpus
    out_b = tmp_path / "out-b-for-merge"
    index_a = str(tmp_path / "out-a" / index_format.INDEX_DIR)
    assert _curate(recipe, tmp_path / "b" / "*.jsonl", str(out_b), index_a) == 0
    index_b = str(out_b / index_format.INDEX_DIR)
    merged = str(tmp_path / "merged")
    assert main(["dedupe-index", "merge", index_a, index_b, index_a, "--output", merged]) == 0
    manifest = index_format.read_manifest(merged)
    assert len(manifest.runs) == 2 and manifest.documents == 40 + len(_kept_ids(out_b))
    before = (Path(merged) / index_format.MANIFEST).read_bytes()
    merge_indexes([index_a, index_b], merged)  # a rerun writes the same bytes
    assert (Path(merged) / index_format.MANIFEST).read_bytes() == before

    rng = random.Random(31)
    c = {"c_a": a["a30"], "c_b": new["new05"], "c_edit_b": _edited(new["new06"], rng), "c_new": _text(rng)}
    _write(tmp_path / "c" / "c.jsonl", c)
    out_c = tmp_path / "out-c"
    assert _curate(recipe, tmp_path / "c" / "*.jsonl", str(out_c), merged) == 0
    exact = _removed(out_c, "exact_dedupe", "earlier_duplicate")
    near = _removed(out_c, "fuzzy_dedupe", "earlier_near_duplicate")
    assert {key: value["earlier_id"] for key, value in exact.items()} == {"c_a": "a30", "c_b": "new05"}
    assert {key: value["earlier_id"] for key, value in near.items()} == {"c_edit_b": "new06"}
    assert {exact["c_a"]["earlier_run"], exact["c_b"]["earlier_run"]} == {run.id for run in manifest.runs}
    assert _kept_ids(out_c) == {"c_new"}


def test_an_index_made_with_other_minhash_parameters_is_refused(corpus, capsys):
    tmp_path, _, *_ = corpus
    index = str(tmp_path / "out-a" / index_format.INDEX_DIR)
    other = _recipe(tmp_path, bands=14, rows=8)
    capsys.readouterr()
    assert _curate(other, tmp_path / "b" / "*.jsonl", str(tmp_path / "out-refused"), index) == 2
    error = capsys.readouterr().err
    assert "was made with bands=20" in error and "has bands=14" in error
    assert not (tmp_path / "out-refused" / "stats.json").exists()
    with pytest.raises(DedupeIndexError, match="no dedupe index here"):
        load_indexes([str(tmp_path / "nowhere")])
    future = tmp_path / "future-index"
    future.mkdir()
    manifest = json.loads((Path(index) / index_format.MANIFEST).read_text())
    (future / index_format.MANIFEST).write_text(json.dumps({**manifest, "format_version": 2}))
    with pytest.raises(DedupeIndexError, match="format version 2, but this reader expects 1"):
        load_indexes([str(future)])
    (future / index_format.MANIFEST).write_text(json.dumps({**manifest, "normalization": "NFKC"}))
    with pytest.raises(DedupeIndexError, match="its normalization is 'NFKC'"):
        load_indexes([str(future)])


def test_the_index_round_trips_on_gcs(corpus, gcs):
    tmp_path, recipe, a, copies, edits, new = corpus
    raw = gcs.upload(tmp_path / "a", "index-raw")
    out = gcs.url("index-a")
    assert _curate(recipe, f"{raw}/*.jsonl", out) == 0
    remote = gcs.tree_bytes("index-a", index_format.INDEX_DIR)
    local_index = tmp_path / "out-a" / index_format.INDEX_DIR
    local = {path.name: path.read_bytes() for path in local_index.iterdir()}
    assert remote == local  # the same bytes wherever it is written
    merged = gcs.url("index-merged")
    assert main(["dedupe-index", "merge", f"{out}/{index_format.INDEX_DIR}", "--output", merged]) == 0
    out_b = tmp_path / "out-b-gcs"
    assert _curate(recipe, tmp_path / "b" / "*.jsonl", str(out_b), merged) == 0
    assert set(_removed(out_b, "exact_dedupe", "earlier_duplicate")) == set(copies)
    assert set(_removed(out_b, "fuzzy_dedupe", "earlier_near_duplicate")) == set(edits)


@pytest.mark.slow  # the default suite's 15-minute budget; make test-slow runs it
def test_earlier_buckets_over_the_group_size_are_salted_with_the_same_verdicts(tmp_path, monkeypatch):
    """An earlier index whose band buckets hold several near-identical documents (kept by a run that
    removed only exact copies of signatures): salted into groups of one earlier member each, the later run
    removes the same documents, naming the same earlier ones, as unsalted."""
    from tokenmill.pipelines import dedupe_index

    rng = random.Random(32)
    bases = [_text(rng) for _ in range(5)]
    earlier = {
        f"e{n}v{k}": _edited(base, rng, 0.2 + 0.2 * k) for n, base in enumerate(bases) for k in range(3)
    }
    later = {f"l{n}": _edited(base, rng, 0.9) for n, base in enumerate(bases)}
    later["fresh"] = _text(rng)
    _write(tmp_path / "e" / "e.jsonl", earlier)
    _write(tmp_path / "l" / "l.jsonl", later)
    assert _curate(_recipe(tmp_path, threshold=1.0), tmp_path / "e" / "*.jsonl", str(tmp_path / "out-e")) == 0
    index = str(tmp_path / "out-e" / index_format.INDEX_DIR)
    assert index_format.read_manifest(index).documents == 15  # near-identical, all kept
    recipe = _recipe(tmp_path)
    assert _curate(recipe, tmp_path / "l" / "*.jsonl", str(tmp_path / "out-whole"), index) == 0
    monkeypatch.setattr(dedupe_index, "GROUP_SIZE", 1)
    assert _curate(recipe, tmp_path / "l" / "*.jsonl", str(tmp_path / "out-salted"), index) == 0
    whole = _removed(tmp_path / "out-whole", "fuzzy_dedupe", "earlier_near_duplicate")
    salted = _removed(tmp_path / "out-salted", "fuzzy_dedupe", "earlier_near_duplicate")
    assert set(whole) == {f"l{n}" for n in range(5)} and salted == whole
    assert all(detail["earlier_id"].startswith(key.replace("l", "e") + "v") for key, detail in whole.items())
    stats = {
        name: json.loads((tmp_path / name / "stats.json").read_text())["stages"]["fuzzy_dedupe"]
        for name in ("out-whole", "out-salted")
    }
    assert stats["out-whole"]["earlier_salted_buckets"] == 0 < stats["out-salted"]["earlier_salted_buckets"]
