"""Held-out slices (`tokenmill tokenize`), external evaluation sets (`tokenmill tokenize-eval`) and evaluation
sets in mixtures: chosen by content, never trained on, counted, resumable, refused when trained on.

The curated cells are written here with ids and texts of their own (every text unique, so a decoded
document names its id); the tokenizer is trained on the spot.
"""

from __future__ import annotations

import gzip
import json
import random
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import tree_bytes
from test_tokenize import WORDS

from tokenmill.cli import main
from tokenmill.formats.documents import DOCUMENT_SCHEMA
from tokenmill.formats.rejected import read_rejected
from tokenmill.tokenize import TokenCatalog, TokenShards
from tokenmill.tokenize.heldout import (
    Entry,
    SliceAccumulator,
    candidate_cut,
    document_key,
    make_rule,
    select,
)
from tokenmill.tokenize.tokenizer import load_tokenizer
from tokenmill.units import format_count

DOCUMENTS = 240


def text_of(number: int) -> str:
    rng = np.random.default_rng(number)
    words = " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), size=int(rng.integers(4, 40))))
    return f"document {number}: {words}.\n"


ALL = [(f"crawl/part.jsonl:{n}", text_of(n)) for n in range(DOCUMENTS)]
BY_TEXT = {text: doc_id for doc_id, text in ALL}


def write_rows(curated: Path, domain: str, quality: int, n: int, m: int, rows: list[tuple[str, str]]) -> None:
    records = [
        {
            "id": doc_id,
            "text": text,
            "source": "crawl/part.jsonl",
            "url": None,
            "metadata": "{}",
            "language": "en",
            "language_score": 1.0,
            "quality_score": 0.5,
            "quality": quality,
            "domain": domain,
            "domain_score": 1.0,
            "n_chars": len(text),
            "n_words": len(text.split()),
            "dup_cluster": None,
        }
        for doc_id, text in sorted(rows)
    ]
    path = curated / f"domain={domain}" / f"quality={quality}" / f"part-{n:05d}-of-{m:05d}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records, schema=DOCUMENT_SCHEMA), path, compression="zstd")


def curate_layout(curated: Path, layout: str) -> None:
    """The same documents bucketed two ways, as a re-curation with other domains and files would."""
    if layout == "a":  # two cells by number parity, two files each
        cells = {("even", 2): [d for i, d in enumerate(ALL) if i % 2 == 0], ("odd", 3): ALL[1::2]}
        files = 2
    else:  # three cells by thirds, three files each
        cells = {("low", 1): ALL[:80], ("mid", 2): ALL[80:160], ("high", 4): ALL[160:]}
        files = 3
    for (domain, quality), rows in cells.items():
        for n in range(files):
            write_rows(curated, domain, quality, n, files, rows[n::files])


def tokenize(curated: Path, output: Path, tokenizer: Path, *extra: str) -> int:
    args = ["tokenize", "--input", str(curated), "--output", str(output), "--tokenizer", str(tokenizer)]
    return main([*args, "--workers", "1", "--progress-seconds", "0", *extra])


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory) -> Path:
    curated = tmp_path_factory.mktemp("train") / "curated"
    curate_layout(curated, "a")
    path = curated.parent / "tokenizer.json"
    assert (
        main(["tokenizer", "train", "--input", str(curated), "--vocab-size", "400", "--output", str(path)])
        == 0
    )
    return path


@pytest.fixture(scope="module")
def layout_a(tmp_path_factory, tokenizer_path) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("layout-a")
    curate_layout(root / "curated", "a")
    assert tokenize(root / "curated", root / "tokens", tokenizer_path, "--heldout-fraction", "0.1") == 0
    return root / "curated", root / "tokens"


def decoded_ids(reader: TokenShards, tokenizer) -> list[str]:
    return [BY_TEXT[tokenizer.decode(reader.document(i).tolist())] for i in range(len(reader))]


def split(tokens: Path, tokenizer) -> tuple[set[str], set[str], dict[str, int]]:
    """(ids in training shards, ids in held-out slices, reserved documents per cell) of a tokens folder."""
    catalog = TokenCatalog(str(tokens), verify=True)
    training: list[str] = []
    held: list[str] = []
    for cell in catalog:
        training += decoded_ids(catalog[cell], tokenizer)
        held += decoded_ids(catalog.heldout(cell), tokenizer)
    assert len(set(training)) == len(training) and len(set(held)) == len(held)
    reserved = {cell: catalog.counts.cells[cell].reserved_documents for cell in catalog}
    return set(training), set(held), reserved


# --- the slice ----------------------------------------------------------------------------------------------


def test_no_held_out_document_is_in_a_training_shard(layout_a, tokenizer_path):
    tokenizer, _ = load_tokenizer(str(tokenizer_path))
    training, held, reserved = split(layout_a[1], tokenizer)
    assert held and not training & held
    assert training | held == {doc_id for doc_id, _ in ALL}  # nothing reserved: the cap is far away
    assert set(reserved.values()) == {0}
    cut = candidate_cut(make_rule(0.1, 4_000_000, 1))
    assert held == {doc_id for doc_id, _ in ALL if document_key(doc_id) < cut}  # chosen by content alone


def test_the_slice_is_in_key_order_with_exact_bytes(layout_a, tokenizer_path):
    tokenizer, info = load_tokenizer(str(tokenizer_path))
    catalog = TokenCatalog(str(layout_a[1]))
    for cell in catalog:
        slice_ = catalog.heldout(cell)
        ids = decoded_ids(slice_, tokenizer)
        assert ids == sorted(ids, key=lambda doc_id: (document_key(doc_id), doc_id))
        texts = dict(ALL)
        assert [slice_.document_bytes(i) for i in range(len(slice_))] == [len(texts[i].encode()) for i in ids]
        assert slice_.num_bytes == slice_.manifest.bytes == catalog.counts.cells[cell].heldout_bytes
        stream = slice_.tokens(0, slice_.num_tokens)
        assert int((stream == info.eos_id).sum()) == len(slice_)  # whole documents, each ending in eos


def test_counts_json_counts_training_held_out_and_reserved_documents(layout_a):
    curated, tokens = layout_a
    counts = json.loads((tokens / "counts.json").read_text())
    assert counts["heldout"]["fraction"] == 0.1 and counts["heldout"]["max_tokens"] == 4_000_000
    assert counts["total_tokens"] == sum(entry["tokens"] for entry in counts["cells"].values())
    assert counts["total_heldout_tokens"] == sum(e["heldout_tokens"] for e in counts["cells"].values())
    assert counts["total_heldout_documents"] == sum(e["heldout_documents"] for e in counts["cells"].values())
    for cell, entry in counts["cells"].items():
        rows = sum(pq.read_metadata(path).num_rows for path in (curated / cell).glob("*.parquet"))
        assert entry["documents"] + entry["heldout_documents"] + entry["reserved_documents"] == rows
        manifest = json.loads((tokens / entry["heldout_manifest"]).read_text())
        assert (manifest["kind"], manifest["name"], manifest["cell_documents"]) == ("heldout", cell, rows)
        assert (manifest["tokens"], manifest["documents"]) == (
            entry["heldout_tokens"],
            entry["heldout_documents"],
        )
        training = json.loads((tokens / entry["manifest"]).read_text())
        assert entry["tokens"] == training["tokens"]  # `tokens` stays the training shards' count


def test_the_same_documents_bucketed_otherwise_give_the_same_held_out_set(layout_a, tokenizer_path, tmp_path):
    tokenizer, _ = load_tokenizer(str(tokenizer_path))
    curate_layout(tmp_path / "curated", "b")
    assert (
        tokenize(tmp_path / "curated", tmp_path / "tokens", tokenizer_path, "--heldout-fraction", "0.1") == 0
    )
    training_a, held_a, _ = split(layout_a[1], tokenizer)
    training_b, held_b, _ = split(tmp_path / "tokens", tokenizer)
    assert len(TokenCatalog(str(tmp_path / "tokens")).cells) == 3
    assert held_a == held_b and training_a == training_b

    # With a cap that binds, each cell keeps its lowest keys and reserves the rest of its candidates: what is
    # never trained on (held out or reserved) is still the same in both layouts.
    args = ("--heldout-fraction", "0.3", "--heldout-max-tokens", "100", "--overwrite")
    assert tokenize(layout_a[0], tmp_path / "capped-a", tokenizer_path, *args) == 0
    assert tokenize(tmp_path / "curated", tmp_path / "capped-b", tokenizer_path, *args) == 0
    cut = candidate_cut(make_rule(0.3, 100, 1))
    candidates = {doc_id for doc_id, _ in ALL if document_key(doc_id) < cut}
    for folder in ("capped-a", "capped-b"):
        training, held, reserved = split(tmp_path / folder, tokenizer)
        assert sum(reserved.values()) > 0 and not training & held
        assert training == {doc_id for doc_id, _ in ALL} - candidates  # no candidate is ever trained on
        assert held <= candidates and len(held) + sum(reserved.values()) == len(candidates)
        counts = json.loads((tmp_path / folder / "counts.json").read_text())
        for entry in counts["cells"].values():
            # The cap: the slice stops once it holds max_tokens (the last document crossing it).
            assert 0 < entry["heldout_tokens"] and entry["heldout_tokens"] - 100 < 200


def test_a_cell_too_small_for_the_fraction_holds_out_min_documents(tokenizer_path, tmp_path):
    curated = tmp_path / "curated"
    write_rows(curated, "tiny", 0, 0, 1, ALL[:5])
    write_rows(curated, "one", 1, 0, 1, ALL[5:6])
    assert (
        tokenize(
            curated,
            tmp_path / "tokens",
            tokenizer_path,
            "--heldout-fraction",
            "0.001",
            "--heldout-min-documents",
            "2",
        )
        == 0
    )
    counts = json.loads((tmp_path / "tokens" / "counts.json").read_text())["cells"]
    lowest = sorted(ALL[:5], key=lambda row: (document_key(row[0]), row[0]))[:2]
    tokenizer, _ = load_tokenizer(str(tokenizer_path))
    slice_ = TokenCatalog(str(tmp_path / "tokens")).heldout("domain=tiny/quality=0")
    assert decoded_ids(slice_, tokenizer) == [doc_id for doc_id, _ in lowest]
    # ...but never more than half the cell: a one-document cell keeps it for training.
    assert (
        counts["domain=one/quality=1"]["heldout_documents"],
        counts["domain=one/quality=1"]["documents"],
    ) == (0, 1)


def test_slices_merge_in_any_order_to_the_global_prefix():
    """The bounded combine: per-file accumulators, merged and pruned in any grouping, give the slice that
    sorting every document of the cell would."""
    rng = random.Random(5)
    rule = make_rule(0.4, 300, 3)
    cut = candidate_cut(rule)
    entries = []
    for n in range(400):
        doc_id = f"doc-{n}"
        key = document_key(doc_id)
        entries.append(
            Entry(key, doc_id, np.zeros(rng.randint(1, 40), np.uint16), rng.randint(1, 99), key < cut)
        )
    expected = select("c", _accumulate(entries, [entries], rule), rule)
    for _ in range(5):
        shuffled = entries[:]
        rng.shuffle(shuffled)
        bounds = sorted(rng.sample(range(1, len(shuffled)), 7))
        parts = [shuffled[a:b] for a, b in zip([0, *bounds], [*bounds, len(shuffled)], strict=True)]
        rng.shuffle(parts)
        got = select("c", _accumulate(entries, parts, rule), rule)
        assert [e.id for e in got.entries] == [e.id for e in expected.entries] and got.last == expected.last
        assert (got.reserved_documents, got.reserved_tokens) == (
            expected.reserved_documents,
            expected.reserved_tokens,
        )
    ordered = sorted(entries, key=lambda e: e.order)
    prefix, tokens = [], 0
    for entry in ordered:
        if tokens >= 300 or not entry.candidate:
            break
        prefix.append(entry.id)
        tokens += len(entry.ids)
    assert [e.id for e in expected.entries] == prefix


def _accumulate(entries, parts, rule) -> SliceAccumulator:
    total = SliceAccumulator()
    for part in parts:
        accumulator = SliceAccumulator()
        accumulator.documents = len(part)
        for entry in part:
            accumulator.add(entry)
            accumulator.prune(rule)
        total.merge(accumulator)
        total.prune(rule)
    assert total.documents == len(entries)
    return total


# --- reruns -------------------------------------------------------------------------------------------------


def test_resume_rebuilds_a_lost_slice_and_keeps_what_is_complete(layout_a, tokenizer_path, tmp_path, capsys):
    curated, tokens = layout_a
    copy = tmp_path / "tokens"
    shutil.copytree(tokens, copy)
    clean = tree_bytes(tokens)
    heldout = copy / "domain=even/quality=2/heldout"
    (heldout / "part-00000.bin").unlink()
    (heldout / "manifest.json").unlink()
    (copy / "counts.json").unlink()
    kept = {p: p.stat().st_ino for p in copy.rglob("part-*") if "/heldout/" not in str(p)}
    kept_slice = {p: p.stat().st_ino for p in (copy / "domain=odd/quality=3/heldout").glob("part-*")}
    capsys.readouterr()
    assert tokenize(curated, copy, tokenizer_path, "--heldout-fraction", "0.1", "--resume") == 0
    assert "(0 written, 4 kept as complete)" in capsys.readouterr().out
    assert tree_bytes(copy) == clean
    assert {p: p.stat().st_ino for p in kept} == kept
    assert {p: p.stat().st_ino for p in kept_slice} == kept_slice  # same bytes: not rewritten

    # Another rule leaves other documents out: every training shard is made again.
    assert tokenize(curated, copy, tokenizer_path, "--heldout-fraction", "0.2", "--resume") == 0
    assert "(4 written, 0 kept as complete)" in capsys.readouterr().out
    # Slices switched off: the earlier slices are files this run would not write.
    assert tokenize(curated, copy, tokenizer_path, "--heldout-fraction", "0", "--resume") == 2
    assert "heldout/manifest.json" in capsys.readouterr().err
    assert tokenize(curated, copy, tokenizer_path, "--heldout-fraction", "0", "--overwrite") == 0
    assert not list(copy.rglob("heldout"))
    counts = json.loads((copy / "counts.json").read_text())
    assert "heldout" not in counts and "heldout_tokens" not in counts["cells"]["domain=odd/quality=3"]
    assert counts["total_documents"] == DOCUMENTS
    assert tokenize(curated, copy, tokenizer_path, "--heldout-fraction", "0.1", "--overwrite") == 0
    assert tree_bytes(copy) == clean


# --- external evaluation sets -------------------------------------------------------------------------------


def test_an_external_set_is_tokenized_with_bad_records_rejected_by_file_and_line(
    layout_a, tokenizer_path, tmp_path
):
    tokenizer, info = load_tokenizer(str(tokenizer_path))
    tokens = tmp_path / "tokens"
    shutil.copytree(layout_a[1], tokens)
    raw = tmp_path / "paloma"
    raw.mkdir()
    good = ["Café — déjà vu, a first document.\n", "second\r\ndocument  with  spaces", "日本語のテキスト"]
    lines = [
        json.dumps({"id": "a", "text": good[0]}).encode(),
        b'{"id": "b", "text": broken',
        json.dumps({"id": "c", "text": good[1]}).encode(),
        json.dumps({"id": "d", "body": "no text field"}).encode(),
        b'{"id": "e", "text": "bad \xff utf-8"}',
    ]
    (raw / "c4-en.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    with gzip.open(raw / "c4-zh.jsonl.gz", "wt", encoding="utf-8") as handle:
        handle.write(json.dumps({"id": "z", "text": good[2]}, ensure_ascii=False) + "\n")
    args = [
        "tokenize-eval",
        "--name",
        "paloma-c4",
        "--input",
        str(raw / "*.jsonl*"),
        "--output",
        str(tokens),
        "--tokenizer",
        str(tokenizer_path),
    ]
    assert main(args) == 0
    folder = tokens / "eval" / "paloma-c4"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert (manifest["kind"], manifest["name"], manifest["documents"]) == ("external", "paloma-c4", 3)
    assert manifest["inputs"] == ["c4-en.jsonl", "c4-zh.jsonl.gz"]
    assert manifest["rejected"] == {"bad_json": 1, "bad_utf8": 1, "missing_text": 1}
    rejected = [record for _, record in read_rejected(str(folder / "rejected/part-00000-of-00002.jsonl.zst"))]
    assert [(r.line, r.error_kind) for r in rejected] == [
        (2, "bad_json"),
        (4, "missing_text"),
        (5, "bad_utf8"),
    ]
    assert all(r.file.endswith("c4-en.jsonl") for r in rejected)
    evalset = TokenCatalog(str(tokens)).eval_set("paloma-c4")
    assert [
        tokenizer.decode(evalset.document(i).tolist()) for i in range(3)
    ] == good  # as given, not normalized
    assert evalset.num_bytes == manifest["bytes"] == sum(len(text.encode()) for text in good)
    assert [evalset.document_bytes(i) for i in range(3)] == [len(text.encode()) for text in good]
    evalset.verify()

    before = tree_bytes(folder)
    assert main(args) == 2  # an earlier set is refused without --resume or --overwrite
    assert main([*args, "--resume"]) == 0 and tree_bytes(folder) == before
    (folder / "part-00001.bin").unlink()
    assert main([*args, "--resume"]) == 0 and tree_bytes(folder) == before
    assert main([*args, "--overwrite"]) == 0 and tree_bytes(folder) == before


def test_an_external_set_must_use_the_runs_tokenizer(layout_a, tmp_path, capsys):
    other = tmp_path / "other.json"
    assert (
        main(
            ["tokenizer", "train", "--input", str(layout_a[0]), "--vocab-size", "300", "--output", str(other)]
        )
        == 0
    )
    (tmp_path / "set.jsonl").write_text('{"text": "x"}\n')
    tokens = tmp_path / "tokens"
    shutil.copytree(layout_a[1], tokens)
    capsys.readouterr()
    code = main(
        [
            "tokenize-eval",
            "--name",
            "x",
            "--input",
            str(tmp_path / "set.jsonl"),
            "--output",
            str(tokens),
            "--tokenizer",
            str(other),
        ]
    )
    assert code == 2
    error = capsys.readouterr().err
    _, info = load_tokenizer(str(other))
    counts = json.loads((tokens / "counts.json").read_text())
    assert info.sha256 in error and counts["tokenizer"]["sha256"] in error


# --- evaluation sets in mixtures ----------------------------------------------------------------------------


MIXTURE = """\
name: heldout-test
tokenizer: tokenmill-bpe-400
total_tokens: 2K
sequence_length: 16
batch_size: 4
max_epochs: 10
phases:
  - name: pretraining
    share: 1
    weights:
      domain=even/*: 0.5
      {second}: 0.5
evaluation:
  heldout: domain=*/*
  sets: [paloma-c4]
{sources}"""


def test_mixture_plan_lists_the_evaluation_sets_with_their_counts(layout_a, tokenizer_path, tmp_path, capsys):
    tokens = tmp_path / "tokens"
    shutil.copytree(layout_a[1], tokens)
    (tmp_path / "set.jsonl").write_text('{"text": "an evaluation document"}\n{"text": "and one more"}\n')
    assert (
        main(
            [
                "tokenize-eval",
                "--name",
                "paloma-c4",
                "--input",
                str(tmp_path / "set.jsonl"),
                "--output",
                str(tokens),
                "--tokenizer",
                str(tokenizer_path),
            ]
        )
        == 0
    )
    spec = tmp_path / "mix.yaml"
    spec.write_text(MIXTURE.format(second="domain=odd/*", sources=""))
    capsys.readouterr()
    assert main(["mixture", "plan", str(spec), "--counts", str(tokens / "counts.json"), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    counts = json.loads((tokens / "counts.json").read_text())["cells"]
    sets = {item["name"]: item for item in plan["evaluation"]}
    assert list(sets) == ["heldout/domain=even", "heldout/domain=odd", "paloma-c4"]
    even = sets["heldout/domain=even"]
    assert even["cells"] == ["domain=even/quality=2"]
    assert even["manifests"] == ["domain=even/quality=2/heldout/manifest.json"]
    assert (even["tokens"], even["documents"], even["bytes"]) == tuple(
        counts["domain=even/quality=2"][f"heldout_{key}"] for key in ("tokens", "documents", "bytes")
    )
    external = json.loads((tokens / "eval/paloma-c4/manifest.json").read_text())
    assert sets["paloma-c4"]["manifests"] == ["eval/paloma-c4/manifest.json"]
    assert (sets["paloma-c4"]["documents"], sets["paloma-c4"]["bytes"]) == (2, external["bytes"])
    assert main(["mixture", "plan", str(spec), "--counts", str(tokens / "counts.json")]) == 0
    text = capsys.readouterr().out
    assert "evaluation sets (zero training weight)" in text and "paloma-c4" in text
    # A missing external set is an error that says how to make it.
    shutil.rmtree(tokens / "eval")
    assert main(["mixture", "check", str(spec), "--counts", str(tokens / "counts.json")]) == 2
    assert "tokenize-eval --name paloma-c4" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("second", "sources", "expected"),
    [
        (
            "paloma-c4",
            "sources:\n  paloma-c4: domain=odd/*\n",
            "evaluation set paloma-c4 is also a training source: source paloma-c4",
        ),
        (
            "domain=odd/quality=3/heldout",
            "",
            "a held-out slice (domain=odd/quality=3/heldout) cannot be trained on",
        ),
        (
            "odd",
            "sources:\n  odd: tokens/eval/paloma-c4\n",
            "evaluation set paloma-c4 cannot be trained on (source odd)",
        ),
    ],
)
def test_mixture_check_refuses_an_evaluation_set_that_is_trained_on(
    tmp_path, capsys, second, sources, expected
):
    spec = tmp_path / "mix.yaml"
    spec.write_text(MIXTURE.format(second=second, sources=sources))
    capsys.readouterr()
    assert main(["mixture", "check", str(spec)]) == 2
    error = capsys.readouterr().err
    assert expected in error and "(line " in error


def test_held_out_sets_need_counts_made_with_held_out_slices(layout_a, tokenizer_path, tmp_path, capsys):
    spec = tmp_path / "mix.yaml"
    spec.write_text(MIXTURE.format(second="domain=odd/*", sources="").replace("  sets: [paloma-c4]\n", ""))
    plain = tmp_path / "plain"
    assert tokenize(layout_a[0], plain, tokenizer_path, "--heldout-fraction", "0") == 0
    capsys.readouterr()
    assert main(["mixture", "check", str(spec), "--counts", str(plain / "counts.json")]) == 2
    assert "counts.json was made without them" in capsys.readouterr().err
    # Without counts (declared tokens), the held-out set is listed, uncounted.
    declared = spec.read_text().replace("domain=even/*: 0.5", "even: 0.5").replace("domain=odd/*", "odd")
    spec.write_text(
        declared
        + "sources:\n  even: {cells: domain=even/*, tokens: 1K}\n  odd: {cells: domain=odd/*, tokens: 1K}\n"
    )
    assert main(["mixture", "plan", str(spec), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["evaluation"] == [
        {
            "name": "heldout",
            "kind": "heldout",
            "cells": [],
            "selectors": ["domain=*/*"],
            "manifests": [],
            "tokens": None,
            "documents": None,
            "bytes": None,
        }
    ]


def test_an_external_set_from_gs_to_gs_has_the_bytes_of_a_local_one(layout_a, tokenizer_path, tmp_path, gcs):
    raw = tmp_path / "raw"
    raw.mkdir()
    table = pa.table({"id": ["p1", "p2", None], "text": ["first parquet document", "zweites Dokument", None]})
    pq.write_table(table, raw / "set.parquet")
    local = tmp_path / "tokens"
    shutil.copytree(layout_a[1], local)
    common = ["tokenize-eval", "--name", "pq", "--tokenizer", str(tokenizer_path)]
    assert main([*common, "--input", str(raw / "set.parquet"), "--output", str(local)]) == 0
    gcs.upload(raw, "heldout-test", "raw")
    gcs.upload(local, "heldout-test", "tokens")
    remote = gcs.url("heldout-test", "tokens")
    assert (
        main(
            [
                *common,
                "--input",
                gcs.url("heldout-test", "raw", "*.parquet"),
                "--output",
                remote,
                "--overwrite",
            ]
        )
        == 0
    )
    remote_files = gcs.tree_bytes("heldout-test", "tokens", "eval", "pq")
    local_files = tree_bytes(local / "eval" / "pq")
    # Rejected records name the file where it was read (a local path or a gs:// URL), as curate's do.
    rejected = "rejected/part-00000-of-00001.jsonl.zst"
    assert set(remote_files) == set(local_files) and rejected in local_files
    assert {k: v for k, v in remote_files.items() if k != rejected} == {
        k: v for k, v in local_files.items() if k != rejected
    }
    manifest = json.loads((local / "eval/pq/manifest.json").read_text())
    assert manifest["rejected"] == {"text_not_string": 1} and manifest["documents"] == 2


def test_the_overview_page_shows_each_cells_held_out_slice(layout_a, tmp_path):
    curated, tokens = layout_a
    spec = tmp_path / "mix.yaml"
    spec.write_text(MIXTURE.format(second="domain=odd/*", sources="").replace("  sets: [paloma-c4]\n", ""))
    site = tmp_path / "site"
    assert (
        main(
            [
                "report",
                "--curated",
                str(curated),
                "--tokens",
                str(tokens),
                "--mixture",
                str(spec),
                "--output",
                str(site),
            ]
        )
        == 0
    )
    page = (site / "index.html").read_text()
    assert ">held out</th>" in page
    counts = json.loads((tokens / "counts.json").read_text())["cells"]
    for entry in counts.values():
        assert f"({entry['heldout_documents']:,} docs)</td>" in page
    rows = list(
        re.finditer(
            r'<tr>\s*<td><span class="swatch"[^>]*></span><a href="#cell-(\w+)-q(\d)">.*?</tr>', page, re.S
        )
    )
    assert len(rows) == len(counts)
    for row in rows:
        entry = counts[f"domain={row.group(1)}/quality={row.group(2)}"]
        held = f"{format_count(entry['heldout_tokens'])} ({entry['heldout_documents']:,} docs)"
        assert f'<td class="num">{held}</td>' in row.group(0)
