"""The dedupe index (docs/formats.md, "Dedupe index"): what a curate run kept, for later runs to dedupe
against.

`<output>/dedupe-index/` holds one Parquet file per shard (`part-<n>-of-<m>.parquet`, zstd, sorted by id)
with one row per kept document (INDEX_SCHEMA: its id, the exact-dedupe hash of its normalized text, and,
when the run had a `fuzzy_dedupe` stage, its LSH band keys, compact MinHash signature and number of
distinct shingles), and `manifest.json` (`DedupeIndexManifest`): the format version, the text hash and
normalization the hashes depend on, the MinHash parameters, and the runs the index holds, each with its
files, their sha256 and a content hash. A merged index (`tokenmill dedupe-index merge`) holds several runs,
each in its own folder.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Any

import pyarrow as pa
from pydantic import BeforeValidator

from tokenmill import storage
from tokenmill.formats.base import Count, FormatModel, read_model, write_model

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
#: The folder of a curate run's output that its index is written to.
INDEX_DIR = "dedupe-index"
#: What the `text_hash` column is; an index with another is refused (its hashes would never match).
TEXT_HASH = "blake2b-128 hex of the UTF-8 normalized text"
#: What the text was when it was hashed (tokenmill.filters.normalize.normalize_text).
NORMALIZATION = (
    "tokenmill normalize_text v1: LF line endings, C0/C1 controls other than tab and LF removed, NFC"
)
#: Bits of each signature row kept in the `signature` column (tokenmill.filters.minhash.COMPACT_BITS).
SIGNATURE = "uint16 little-endian, top 16 bits of each of bands x rows MinHash rows"

INDEX_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("text_hash", pa.string()),
        ("band_keys", pa.list_(pa.binary())),  # null: no fuzzy part, or a document without words
        ("signature", pa.binary()),
        ("shingles", pa.int64()),
    ]
)


def _format_version(value: Any) -> Any:
    if value != FORMAT_VERSION:
        raise ValueError(f"dedupe index format version {value!r}, but this reader expects {FORMAT_VERSION}")
    return value


class MinHashParams(FormatModel):
    """The parameters that band keys and signatures depend on: equal only if these are equal."""

    ngram: Count
    bands: Count
    rows: Count
    seed: Count


class IndexFile(FormatModel):
    """One shard: its path relative to the index folder, rows and sha256."""

    path: str
    rows: Count
    sha256: str


class IndexRun(FormatModel):
    """The kept documents of one curate run. `id` is content-keyed: recipe name and content hash."""

    id: str
    recipe: str
    documents: Count
    content_hash: str
    files: list[IndexFile]


class DedupeIndexManifest(FormatModel):
    format_version: Annotated[int, BeforeValidator(_format_version)]
    text_hash: str
    normalization: str
    signature: str
    #: None: the run had no fuzzy_dedupe stage, so the index has exact hashes only.
    minhash: MinHashParams | None
    runs: list[IndexRun]

    @property
    def documents(self) -> int:
        return sum(run.documents for run in self.runs)


def content_hash(files: list[IndexFile]) -> str:
    """sha256 over the files' (path, sha256), in path order: names the run's index by its content."""
    digest = hashlib.sha256()
    for entry in sorted(files, key=lambda entry: entry.path):
        digest.update(f"{entry.path}\x00{entry.sha256}\n".encode())
    return digest.hexdigest()


def manifest_path(index: str) -> str:
    return storage.join(index, MANIFEST)


def read_manifest(index: str) -> DedupeIndexManifest:
    """The manifest of the index folder `index`; FileNotFoundError naming it if there is none."""
    path = manifest_path(index)
    if not storage.exists(path):
        raise FileNotFoundError(f"{index}: no dedupe index here ({MANIFEST} missing)")
    return read_model(DedupeIndexManifest, path)


def write_manifest(index: str, manifest: DedupeIndexManifest) -> None:
    write_model(manifest_path(index), manifest)
