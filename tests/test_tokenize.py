"""Tokenizer training, `tokenmill tokenize`, the shard reader and the counts catalog, on tiny curated cells.

The curated fixtures are written here (docs/formats.md columns, in domain=<d>/quality=<q>/ folders) so
that these tests do not depend on `tokenmill curate`; the tokenizer is trained on the spot.
"""

from __future__ import annotations

import json
import os
import shutil
import unicodedata
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import tree_bytes

from tokenmill.cli import main
from tokenmill.formats.documents import DOCUMENT_SCHEMA
from tokenmill.tokenize import EvalShards, ShardChecksumError, ShardError, TokenCatalog, TokenShards
from tokenmill.tokenize.heldout import document_key
from tokenmill.tokenize.tokenizer import dtype_for_vocab, load_tokenizer, sha256_bytes

# Text that a lossy tokenizer would not give back: accents (NFC), code with tabs and runs of spaces,
# other scripts, emoji sequences, digits, the end-of-text token's own spelling, empty and blank documents.
TRICKY = [
    unicodedata.normalize("NFC", "Café naïve résumé, “quotes” — ‘single’ … déjà vu"),
    "def f(x):\n\tif x  >  1:\n\t\treturn {'a': [1, 2]}  # comment\n\n\n    return None\n",
    "日本語のテキストと中文文本，한국어 텍스트。",
    "مرحبا بالعالم — שלום עולם — नमस्ते दुनिया — Ελληνικά — русский текст",
    "👩‍👩‍👧‍👦 family, 👍🏽 thumbs, 🇫🇷 flag",
    "numbers 1234567890 3.14159 -42 1e-9 0x1F",
    "a web page quoting <|endoftext|> in its text, and <|end_of_text|> too",
    "",
    "   \n\t  ",
    "trailing spaces   \nand\ttabs\t\n",
]
WORDS = "the quick brown fox jumps over a lazy dog while tokens flow into shards of memory".split()


def prose(seed: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), size=int(rng.integers(5, 80)))) + ".\n"


def write_cell_file(curated: Path, domain: str, quality: int, n: int, m: int, texts: list[str]) -> Path:
    rows = [
        {
            "id": f"{domain}-{quality}-{n}:{i:05d}",
            "text": text,
            "source": "fixture.jsonl",
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
        for i, text in enumerate(texts)
    ]
    path = curated / f"domain={domain}" / f"quality={quality}" / f"part-{n:05d}-of-{m:05d}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=DOCUMENT_SCHEMA), path, compression="zstd")
    return path


def make_curated(curated: Path) -> dict[str, list[str]]:
    """Two cells (2 and 3 files); returns each cell's texts in stream order (files sorted, rows in order)."""
    layout = {("code", 3): 2, ("web", 1): 3}
    texts: dict[str, list[str]] = {}
    seed = 0
    for (domain, quality), files in layout.items():
        cell = f"domain={domain}/quality={quality}"
        texts[cell] = []
        for n in range(files):
            batch = [
                TRICKY[(seed + k) % len(TRICKY)] if k % 3 == 0 else prose(seed + k) for k in range(25 + n)
            ]
            seed += 100
            write_cell_file(curated, domain, quality, n, files, batch)
            texts[cell].extend(batch)
    return texts


def tokenize(curated: Path, output: Path, tokenizer: Path, *extra: str) -> int:
    args = ["tokenize", "--input", str(curated), "--output", str(output), "--tokenizer", str(tokenizer)]
    return main([*args, "--workers", "1", "--progress-seconds", "0", *extra])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, dict[str, list[str]]]:
    curated = tmp_path_factory.mktemp("curated") / "curated"
    return curated, make_curated(curated)


@pytest.fixture(scope="module")
def tokenizer_path(corpus, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    assert (
        main(["tokenizer", "train", "--input", str(corpus[0]), "--vocab-size", "1000", "--output", str(path)])
        == 0
    )
    return path


@pytest.fixture(scope="module")
def tokens(corpus, tokenizer_path, tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("tokens") / "tokens"
    assert tokenize(corpus[0], output, tokenizer_path) == 0
    return output


def copy_tokens(tokens: Path, destination: Path) -> Path:
    shutil.copytree(tokens, destination)
    return destination


# --- tokenizer -------------------------------------------------------------------------------------------


def test_trained_tokenizer_is_byte_level_bpe_with_end_of_text_zero_and_a_recorded_name(tokenizer_path):
    tokenizer, info = load_tokenizer(str(tokenizer_path))
    assert info.eos_id == 0 and info.eos_token == "<|endoftext|>"
    assert info.vocab_size <= 1000 and info.dtype == "uint16"
    assert info.sha256 == sha256_bytes(tokenizer_path.read_bytes())
    meta = json.loads(tokenizer_path.with_name("tokenizer.meta.json").read_text())
    assert meta["name"] == info.name == "tokenmill-bpe-1000"
    assert meta["sha256"] == info.sha256
    assert tokenizer.normalizer is None  # any normalizer could lose text


@pytest.mark.parametrize(
    "text", [*TRICKY, "windows\r\nline endings\r\n", "e\u0301 (not NFC) and \u00e9", "\x00\x7f"]
)
def test_trained_tokenizer_round_trips_text(tokenizer_path, text):
    tokenizer, info = load_tokenizer(str(tokenizer_path))
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    # The end-of-text token's spelling inside a document is text, never a document boundary.
    assert info.eos_id not in ids


def test_dtype_is_uint16_when_the_vocabulary_fits_else_uint32():
    assert dtype_for_vocab(256) == "uint16"
    assert dtype_for_vocab(65536) == "uint16"
    assert dtype_for_vocab(65537) == "uint32"
    assert dtype_for_vocab(128256) == "uint32"


# --- tokenize output ---------------------------------------------------------------------------------------


def cell_rows(curated: Path, cell: str) -> list[tuple[str, str]]:
    """(id, text) of a curated cell's documents in stream order (files sorted, rows in order)."""
    rows = []
    for path in sorted((curated / cell).glob("*.parquet")):
        table = pq.read_table(path, columns=["id", "text"])
        rows += zip(table.column("id").to_pylist(), table.column("text").to_pylist(), strict=True)
    return rows


def split_by_slice(curated: Path, tokens: Path, cell: str) -> tuple[list[str], list[str]]:
    """(training texts in stream order, held-out texts in key order) of a cell, from its slice's last key."""
    rows = cell_rows(curated, cell)
    last = json.loads((tokens / cell / "heldout" / "manifest.json").read_text())["last"]
    bound = (int(last.split(":", 1)[0], 16), last.split(":", 1)[1])
    held = [
        text for key, i, text in sorted((document_key(i), i, text) for i, text in rows) if (key, i) <= bound
    ]
    return [text for i, text in rows if (document_key(i), i) > bound], held


def test_decoding_each_document_gives_back_its_text(corpus, tokens, tokenizer_path):
    """Training shards hold every document but the cell's held-out slice (by default on), in order; the
    slice holds the rest, in key order; together they are the cell."""
    tokenizer, info = load_tokenizer(str(tokenizer_path))
    held_out = 0
    for cell, texts in corpus[1].items():
        rows = cell_rows(corpus[0], cell)
        assert [text for _, text in rows] == texts
        slice_ = EvalShards(
            str(tokens / cell / "heldout"), expected_tokenizer_sha256=info.sha256, verify=True
        )
        last = slice_.manifest.last
        assert last is not None  # min_documents 1: every cell of two or more documents has a slice
        bound = (int(last.split(":", 1)[0], 16), last.split(":", 1)[1])
        keyed = sorted((document_key(i), i, text) for i, text in rows)
        held = [text for key, i, text in keyed if (key, i) <= bound]
        training = [text for i, text in rows if (document_key(i), i) > bound]
        shards = TokenShards(str(tokens / cell), expected_tokenizer_sha256=info.sha256, verify=True)
        assert (
            len(shards) == len(training)
            and len(slice_) == len(held)
            and len(held) + len(training) == len(rows)
        )
        for reader, expected in ((shards, training), (slice_, held)):
            for i, text in enumerate(expected):
                ids = reader.document(i)
                assert info.eos_id not in ids
                assert tokenizer.decode(ids.tolist(), skip_special_tokens=False) == text
        assert slice_.num_bytes == sum(len(text.encode("utf-8")) for text in held)
        held_out += len(held)
    assert held_out >= 2


def test_end_of_text_follows_every_document_and_nothing_else(tokens, tokenizer_path):
    _, info = load_tokenizer(str(tokenizer_path))
    for cell in ("domain=code/quality=3", "domain=web/quality=1"):
        shards = TokenShards(str(tokens / cell))
        stream = shards.tokens(0, shards.num_tokens)
        ends = [shards.document_bounds(i)[1] for i in range(len(shards))]
        assert np.flatnonzero(stream == info.eos_id).tolist() == [end - 1 for end in ends]
        assert ends[-1] == shards.num_tokens


def test_counts_json_equals_the_sum_of_the_manifests(tokens, tokenizer_path):
    _, info = load_tokenizer(str(tokenizer_path))
    counts = json.loads((tokens / "counts.json").read_text())
    assert counts["format_version"] == 1
    assert counts["tokenizer"] == {"name": info.name, "sha256": info.sha256, "vocab_size": info.vocab_size}
    assert set(counts["cells"]) == {"domain=code/quality=3", "domain=web/quality=1"}
    total_tokens = total_documents = 0
    for cell, entry in counts["cells"].items():
        assert entry["manifest"] == f"{cell}/manifest.json"
        manifest = json.loads((tokens / entry["manifest"]).read_text())
        assert set(manifest) == {
            "format_version",
            "cell",
            "tokenizer",
            "dtype",
            "eos_id",
            "documents",
            "tokens",
            "shards",
        }
        assert manifest["cell"] == cell and manifest["tokenizer"] == counts["tokenizer"]
        assert (manifest["dtype"], manifest["eos_id"]) == ("uint16", 0)
        assert entry["tokens"] == manifest["tokens"] == sum(s["tokens"] for s in manifest["shards"])
        assert entry["documents"] == manifest["documents"] == sum(s["documents"] for s in manifest["shards"])
        for n, shard in enumerate(manifest["shards"]):
            # One shard per source file, in sorted order.
            assert shard["name"] == f"part-{n:05d}"
            assert shard["source_files"] == [f"part-{n:05d}-of-{len(manifest['shards']):05d}.parquet"]
            assert (tokens / cell / f"{shard['name']}.bin").stat().st_size == 2 * shard["tokens"]
            idx = np.fromfile(tokens / cell / f"{shard['name']}.idx", dtype="<u8")
            assert len(idx) == shard["documents"] and idx[-1] == shard["tokens"]
        total_tokens += entry["tokens"]
        total_documents += entry["documents"]
    assert counts["total_tokens"] == total_tokens and counts["total_documents"] == total_documents


def test_token_ranges_run_across_shards(tokens):
    cell = tokens / "domain=web/quality=1"
    shards = TokenShards(str(cell))
    raw = np.concatenate([np.fromfile(cell / f"part-{n:05d}.bin", dtype="<u2") for n in range(3)])
    assert shards.num_tokens == len(raw) and shards.dtype == np.dtype("<u2")
    first = int(json.loads((cell / "manifest.json").read_text())["shards"][0]["tokens"])
    assert np.array_equal(shards.tokens(first - 5, first + 7), raw[first - 5 : first + 7])
    assert np.array_equal(shards.tokens(0, shards.num_tokens), raw)
    assert len(shards.tokens(3, 3)) == 0
    assert np.array_equal(shards.document(-1), shards.tokens(*shards.document_bounds(len(shards) - 1))[:-1])
    with pytest.raises(IndexError):
        shards.tokens(0, shards.num_tokens + 1)
    with pytest.raises(IndexError):
        shards.document(len(shards))


def test_catalog_opens_cells_through_counts_json(tokens, tokenizer_path):
    _, info = load_tokenizer(str(tokenizer_path))
    catalog = TokenCatalog(str(tokens), expected_tokenizer_sha256=info.sha256)
    assert catalog.cells == ["domain=code/quality=3", "domain=web/quality=1"]
    assert catalog.match("domain=web/*") == ["domain=web/quality=1"]
    assert catalog.total_tokens == sum(catalog[cell].num_tokens for cell in catalog)
    assert catalog["domain=code/quality=3"].eos_id == 0
    assert catalog["domain=code/quality=3"].vocab_size == info.vocab_size
    with pytest.raises(KeyError):
        catalog["domain=nope/quality=0"]


def test_a_second_run_keeps_every_shard_and_writes_the_same_bytes(
    corpus, tokens, tokenizer_path, tmp_path, capsys
):
    copy = copy_tokens(tokens, tmp_path / "tokens")
    before = tree_bytes(copy)
    inodes = {p: p.stat().st_ino for p in copy.rglob("part-*")}
    capsys.readouterr()
    assert tokenize(corpus[0], copy, tokenizer_path, "--resume") == 0
    assert "(0 written, 5 kept as complete)" in capsys.readouterr().out
    assert tree_bytes(copy) == before
    assert {p: p.stat().st_ino for p in copy.rglob("part-*")} == inodes  # kept, not rewritten


def test_workers_in_separate_processes_write_the_same_bytes(corpus, tokens, tokenizer_path, tmp_path):
    output = tmp_path / "tokens"
    args = [
        "tokenize",
        "--input",
        str(corpus[0]),
        "--output",
        str(output),
        "--tokenizer",
        str(tokenizer_path),
    ]
    assert main([*args, "--workers", "2", "--progress-seconds", "0"]) == 0
    assert tree_bytes(output) == tree_bytes(tokens)


# --- resume ------------------------------------------------------------------------------------------------


def test_resume_redoes_only_damaged_or_unfinished_shards_and_ends_with_the_same_bytes(
    corpus, tokens, tokenizer_path, tmp_path
):
    copy = copy_tokens(tokens, tmp_path / "tokens")
    clean = tree_bytes(tokens)
    code, web = copy / "domain=code/quality=3", copy / "domain=web/quality=1"
    # What a kill leaves: a half-written temporary, a shard renamed into place before its done marker, no
    # catalog; and what time may do: a shard damaged on disk.
    (web / ".tmp-0123-part-00002.bin").write_bytes(b"\x01\x02")
    (web / "part-00001.done.json").unlink()
    data = bytearray((code / "part-00001.bin").read_bytes())
    data[10] ^= 0xFF
    (code / "part-00001.bin").write_bytes(bytes(data))
    (copy / "counts.json").unlink()
    (code / "manifest.json").unlink()
    untouched = {
        p: p.stat().st_ino for p in [code / "part-00000.bin", web / "part-00000.bin", web / "part-00002.bin"]
    }

    assert tokenize(corpus[0], copy, tokenizer_path, "--resume") == 0
    assert tree_bytes(copy) == clean
    assert {p: p.stat().st_ino for p in untouched} == untouched
    assert not list(copy.rglob(".tmp-*"))


def test_a_changed_source_file_is_tokenized_again(corpus, tokens, tokenizer_path, tmp_path):
    curated = tmp_path / "curated"
    shutil.copytree(corpus[0], curated)
    copy = copy_tokens(tokens, tmp_path / "tokens")
    write_cell_file(curated, "code", 3, 1, 2, ["a different document", "and another"])
    web = {p: p.stat().st_ino for p in (copy / "domain=web/quality=1").glob("part-*")}
    assert tokenize(curated, copy, tokenizer_path, "--resume") == 0
    cell = "domain=code/quality=3"
    shards = TokenShards(str(copy / cell), verify=True)
    training, held = split_by_slice(curated, copy, cell)
    assert shards.shards[1]["documents"] == 2 - sum(
        text in held for text in ["a different document", "and another"]
    )
    assert len(shards) == len(training)
    # The cell's slice is a prefix of all its documents in key order, so a changed file may move it: shard 0
    # is kept only if the slice did not move, and otherwise made again without the new slice.
    before = json.loads((tokens / cell / "heldout/manifest.json").read_text())["last"]
    after = json.loads((copy / cell / "heldout/manifest.json").read_text())["last"]
    marker = json.loads((copy / cell / "part-00000.done.json").read_text())
    assert marker["heldout_last"] == after
    old = json.loads((tokens / cell / "manifest.json").read_text())["shards"][0]
    assert (shards.shards[0] == old) == (before == after)
    assert {p: p.stat().st_ino for p in (copy / "domain=web/quality=1").glob("part-*")} == web  # kept


def test_an_earlier_run_is_refused_unless_resume_or_overwrite(
    corpus, tokens, tokenizer_path, tmp_path, capsys
):
    copy = copy_tokens(tokens, tmp_path / "tokens")
    (copy / "notes.txt").write_text("not ours\n")
    before = tree_bytes(copy)
    capsys.readouterr()
    assert tokenize(corpus[0], copy, tokenizer_path) == 2
    error = capsys.readouterr().err
    assert f"--output {copy} holds an earlier tokenize run (counts.json, 5 shards" in error
    assert "--resume" in error and "--overwrite" in error
    assert tree_bytes(copy) == before  # refused before touching anything
    with pytest.raises(SystemExit) as exit_info:  # one or the other
        tokenize(corpus[0], copy, tokenizer_path, "--resume", "--overwrite")
    assert exit_info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err

    # --overwrite deletes the earlier run and writes every shard again: same bytes, new files.
    assert tokenize(corpus[0], copy, tokenizer_path, "--overwrite") == 0
    assert "(5 written, 0 kept as complete)" in capsys.readouterr().out
    assert tree_bytes(copy) == before  # notes.txt, not a tokenize file, is left alone


def test_resume_refuses_shards_this_run_would_not_write(corpus, tokens, tokenizer_path, tmp_path, capsys):
    # The earlier run had one more source file in a cell: its shard would sit beside this run's.
    copy = copy_tokens(tokens, tmp_path / "tokens")
    cell = copy / "domain=code/quality=3"
    for suffix in (".bin", ".idx", ".done.json"):
        shutil.copy(cell / f"part-00000{suffix}", cell / f"part-00009{suffix}")
    capsys.readouterr()
    assert tokenize(corpus[0], copy, tokenizer_path, "--resume") == 2
    error = capsys.readouterr().err
    assert "holds 3 files that this run would not write" in error
    assert "domain=code/quality=3/part-00009.bin" in error and "--overwrite" in error
    # ...and a cell that is no longer in the input at all.
    shutil.copytree(cell, copy / "domain=gone/quality=1")
    shutil.rmtree(cell)
    shutil.copytree(tokens / "domain=code/quality=3", cell)
    assert tokenize(corpus[0], copy, tokenizer_path, "--resume") == 2
    assert "domain=gone/quality=1/" in capsys.readouterr().err

    assert tokenize(corpus[0], copy, tokenizer_path, "--overwrite") == 0
    assert not (copy / "domain=gone").exists()  # its files, then its emptied folders
    assert tree_bytes(copy) == tree_bytes(tokens)


# --- fail fast -------------------------------------------------------------------------------------------


def test_a_corrupted_shard_is_caught_by_checksum_naming_the_file(tokens, tmp_path):
    copy = copy_tokens(tokens, tmp_path / "tokens")
    path = copy / "domain=web/quality=1/part-00001.bin"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    shards = TokenShards(str(copy / "domain=web/quality=1"))  # opening alone checks sizes, not bytes
    with pytest.raises(ShardChecksumError, match="part-00001.bin: checksum mismatch"):
        shards.verify()
    with pytest.raises(ShardChecksumError, match=str(path)):
        TokenShards(str(copy / "domain=web/quality=1"), verify=True)
    with pytest.raises(ShardChecksumError, match="part-00001.bin"):
        TokenCatalog(str(copy), verify=True)["domain=web/quality=1"]


def test_a_truncated_shard_is_caught_when_opened(tokens, tmp_path):
    copy = copy_tokens(tokens, tmp_path / "tokens")
    path = copy / "domain=code/quality=3/part-00000.bin"
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(ShardChecksumError, match=f"{path}: .* bytes, but the manifest says"):
        TokenShards(str(copy / "domain=code/quality=3"))


def test_another_tokenizer_or_format_version_is_refused_naming_both_values(tokens, tokenizer_path, tmp_path):
    _, info = load_tokenizer(str(tokenizer_path))
    other = "ab" * 32
    with pytest.raises(ShardError, match=f"tokenizer sha256 {info.sha256}.*expects tokenizer sha256 {other}"):
        TokenShards(str(tokens / "domain=code/quality=3"), expected_tokenizer_sha256=other)
    with pytest.raises(ShardError, match=f"{info.sha256}.*{other}"):
        TokenCatalog(str(tokens), expected_tokenizer_sha256=other)

    copy = copy_tokens(tokens, tmp_path / "tokens")
    manifest_path = copy / "domain=code/quality=3/manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["format_version"] = 2
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ShardError, match="format version 2, but this reader expects 1"):
        TokenShards(str(copy / "domain=code/quality=3"))


def test_catalog_refuses_counts_that_disagree_with_a_manifest(tokens, tmp_path):
    copy = copy_tokens(tokens, tmp_path / "tokens")
    counts = json.loads((copy / "counts.json").read_text())
    counts["cells"]["domain=web/quality=1"]["tokens"] += 1
    (copy / "counts.json").write_text(json.dumps(counts))
    with pytest.raises(ShardError, match="domain=web/quality=1"):
        TokenCatalog(str(copy))["domain=web/quality=1"]


# --- uint32 -------------------------------------------------------------------------------------------------


def big_vocabulary_tokenizer(small: Path, path: Path, vocab_size: int = 70_000) -> None:
    """The trained tokenizer made Llama-3 like: padded past 65,536 ids, <|begin_of_text|> and <|end_of_text|>
    as the last two ids (Llama-3 has them at 128000 and 128001), and a post-processor that would put
    <|begin_of_text|> before every text, so uint32 storage, large ids and "no BOS" are all exercised."""
    spec = json.loads(small.read_text())
    vocab = spec["model"]["vocab"]
    del vocab["<|endoftext|>"]
    used = set(vocab.values())
    free = (i for i in range(vocab_size) if i not in used)
    for k in range(vocab_size - 2 - len(vocab)):
        vocab[f"<unused_{k}>"] = next(free)
    special = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
    spec["added_tokens"] = [
        {"id": vocab_size - 2, "content": "<|begin_of_text|>", **special},
        {"id": vocab_size - 1, "content": "<|end_of_text|>", **special},
    ]
    bos = {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, bos, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {
            "<|begin_of_text|>": {
                "id": "<|begin_of_text|>",
                "ids": [vocab_size - 2],
                "tokens": ["<|begin_of_text|>"],
            }
        },
    }
    path.write_text(json.dumps(spec))


def test_a_vocabulary_past_65536_is_stored_as_uint32(corpus, tokenizer_path, tmp_path):
    big = tmp_path / "big" / "tokenizer.json"
    big.parent.mkdir()
    big_vocabulary_tokenizer(tokenizer_path, big)
    tokenizer, info = load_tokenizer(str(big))
    assert (info.vocab_size, info.eos_id, info.eos_token, info.dtype) == (
        70_000,
        69_999,
        "<|end_of_text|>",
        "uint32",
    )
    output = tmp_path / "tokens"
    assert tokenize(corpus[0], output, big) == 0
    cell = "domain=code/quality=3"
    shards = TokenShards(str(output / cell), expected_tokenizer_sha256=info.sha256, verify=True)
    assert shards.dtype == np.dtype("<u4") and shards.eos_id == 69_999
    assert json.loads((output / cell / "manifest.json").read_text())["tokenizer"]["name"] == "big"
    assert (output / cell / "part-00000.bin").stat().st_size == 4 * shards.shards[0]["tokens"]
    assert tokenizer.encode("x").ids[0] == 69_998  # the post-processor would add BOS...
    assert 69_998 not in shards.tokens(0, shards.num_tokens)  # ...but shards hold none
    training, _ = split_by_slice(corpus[0], output, cell)
    assert len(shards) == len(training)
    for i, text in enumerate(training):
        start, stop = shards.document_bounds(i)
        assert int(shards.tokens(start, stop)[-1]) == 69_999
        assert tokenizer.decode(shards.document(i).tolist(), skip_special_tokens=False) == text


# --- command line -------------------------------------------------------------------------------------------


def test_user_errors_exit_2_with_one_line(corpus, tokenizer_path, tmp_path, capsys):
    no_eos = tmp_path / "no-eos.json"
    spec = json.loads(tokenizer_path.read_text())
    spec["added_tokens"] = []
    del spec["model"]["vocab"]["<|endoftext|>"]
    no_eos.write_text(json.dumps(spec))
    (tmp_path / "empty").mkdir()
    cases = [
        (["--input", str(tmp_path / "missing")], "input not found"),
        (["--input", str(tmp_path / "empty")], "no curated Parquet files"),
        (["--tokenizer", str(tmp_path / "missing.json")], "tokenizer file not found"),
        (["--tokenizer", str(no_eos)], "no end-of-text token found"),
        (["--eos-token", "<nope>"], "has no token '<nope>'"),
    ]
    for override, message in cases:
        args = {"--input": str(corpus[0]), "--tokenizer": str(tokenizer_path)}
        extra = []
        for flag, value in zip(override[::2], override[1::2], strict=True):
            if flag in args:
                args[flag] = value
            else:
                extra += [flag, value]
        argv = ["tokenize", "--output", str(tmp_path / "out"), "--workers", "1"]
        argv += [item for pair in args.items() for item in pair] + extra
        capsys.readouterr()
        assert main(argv) == 2, override
        assert message in capsys.readouterr().err
    train = ["tokenizer", "train", "--input", str(corpus[0]), "--output", str(tmp_path / "t.json")]
    assert main([*train, "--vocab-size", "100"]) == 2
    assert "too small" in capsys.readouterr().err


def test_tokenizer_info_prints_what_manifests_record(tokenizer_path, capsys):
    assert main(["tokenizer", "info", str(tokenizer_path)]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["name"] == "tokenmill-bpe-1000" and record["eos_id"] == 0 and record["dtype"] == "uint16"


def test_a_renamed_tokenizer_keeps_its_sidecar_name_only_while_the_bytes_match(tokenizer_path, tmp_path):
    copy = tmp_path / "tokenizer.json"
    shutil.copy(tokenizer_path, copy)
    shutil.copy(tokenizer_path.with_name("tokenizer.meta.json"), tmp_path / "tokenizer.meta.json")
    assert load_tokenizer(str(copy))[1].name == "tokenmill-bpe-1000"
    spec = json.loads(copy.read_text())
    spec["decoder"] = None
    copy.write_text(json.dumps(spec))
    assert load_tokenizer(str(copy))[1].name == os.path.basename(tmp_path)


# --- Dataflow ---------------------------------------------------------------------------------------------


def test_dataflow_job_graph_builds_and_the_dofn_pickles(tokenizer_path):
    import argparse

    import apache_beam as beam
    from apache_beam.internal import pickler

    from tokenmill.pipelines.options import add_runner_arguments, make_pipeline
    from tokenmill.pipelines.tokenize import TokenizeShardFn, build_pipeline
    from tokenmill.tokenize.writer import ShardTask

    parser = argparse.ArgumentParser()
    add_runner_arguments(parser)
    args = parser.parse_args(
        [
            "--runner",
            "dataflow",
            "--project",
            "tokenmill-test",
            "--region",
            "us-central1",
            "--temp_location",
            "gs://tokenmill-test/tmp",
            "--dry_run",
        ]
    )
    _, info = load_tokenizer(str(tokenizer_path))
    tasks = [
        ShardTask(
            "domain=web/quality=1", n, f"gs://b/curated/domain=web/quality=1/part-{n:05d}-of-00002.parquet"
        )
        for n in range(2)
    ]
    pipeline = make_pipeline(args, "tokenize")
    build_pipeline(pipeline, tasks, "gs://b/tokens", "gs://b/tokenizer.json", info, 512)
    dofns = []

    class CollectDoFns(beam.pipeline.PipelineVisitor):
        def visit_transform(self, applied):
            if isinstance(applied.transform, beam.ParDo):
                dofns.append(applied.transform.dofn)

    pipeline.visit(CollectDoFns())
    tokenize_fn = next(d for d in dofns if isinstance(d, TokenizeShardFn))
    restored = pickler.loads(pickler.dumps(tokenize_fn))
    assert restored.info == info and restored.tokenizer_path == "gs://b/tokenizer.json"
    result = pipeline.run()  # --dry_run: translated to a Dataflow job, nothing submitted
    assert result.state == "DONE"
    names = {t.unique_name.split("/")[0] for t in result.job.proto_pipeline.components.transforms.values()}
    assert {"ShardTasks", "Tokenize", "WriteManifests", "WriteCounts"} <= names


def test_dataflow_needs_cloud_paths(corpus, tokenizer_path, tmp_path, capsys):
    argv = [
        "tokenize",
        "--input",
        str(corpus[0]),
        "--output",
        "gs://b/tokens",
        "--tokenizer",
        str(tokenizer_path),
        "--runner",
        "dataflow",
        "--project",
        "p",
        "--region",
        "r",
        "--temp_location",
        "gs://b/tmp",
    ]
    assert main(argv) == 2
    assert "give gs:// paths for --input, --tokenizer" in capsys.readouterr().err
