"""Token shards' JSON files (docs/formats.md, "Token shards"): each cell's `manifest.json`, each shard's done
marker `part-<n>.done.json`, and `tokens/counts.json`, the catalog that mixtures plan against.

The .bin and .idx files themselves are read by `tokenmill.tokenize.shards` (memory maps) and
`tokenmill.trainer.remote` (ranged reads); their layout is fixed by the records here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import field_validator

from tokenmill.formats.base import Count, FormatModel, parse, read_model, write_model

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
COUNTS = "counts.json"
DONE_SUFFIX = ".done.json"
TokenDtype = Literal["uint16", "uint32"]


def _format_version(value: Any) -> Any:
    if value != FORMAT_VERSION:
        raise ValueError(f"token shard format version {value!r}, but this reader expects {FORMAT_VERSION}")
    return value


class TokenizerEntry(FormatModel):
    """The tokenizer that made the shards, as manifests and counts.json name it."""

    name: str
    sha256: str
    vocab_size: Count


class ShardEntry(FormatModel):
    """One shard of a cell: part-<n>.bin and .idx, their sha256, and the Parquet file(s) it was made from."""

    name: str
    documents: Count
    tokens: Count
    bin_sha256: str
    idx_sha256: str
    source_files: list[str]


class ShardMarker(ShardEntry):
    """`part-<n>.done.json`, written last beside a finished shard: its manifest entry plus what it was made
    with, so that a resumed run keeps it only when the same input and tokenizer would make it again."""

    format_version: int
    cell: str
    tokenizer_sha256: str
    dtype: TokenDtype
    eos_id: Count
    source_sha256: str

    def entry(self) -> ShardEntry:
        return ShardEntry(**{name: getattr(self, name) for name in ShardEntry.model_fields})


class CellManifest(FormatModel):
    """A cell's `manifest.json`: its tokenizer, token type, end-of-text id, totals and shards in order."""

    format_version: int
    cell: str
    tokenizer: TokenizerEntry
    dtype: TokenDtype
    eos_id: Count
    documents: Count
    tokens: Count
    shards: list[ShardEntry]

    _check_version = field_validator("format_version", mode="before")(_format_version)


class CellCount(FormatModel):
    """A cell's line in counts.json. Catalogs written by hand for planning may give `tokens` alone."""

    tokens: Count
    documents: Count | None = None
    manifest: str | None = None


class TokenCounts(FormatModel):
    """`tokens/counts.json`: token and document counts per cell, and the tokenizer they were counted with.

    `tokenize` writes every field; catalogs written by hand for planning (tests, what-if plans) may give
    only `format_version` and the cells' tokens, so the rest is optional here and `TokenCatalog` (which
    opens the shards) insists on it.
    """

    format_version: int
    tokenizer: TokenizerEntry | None = None
    total_tokens: Count | None = None
    total_documents: Count | None = None
    cells: dict[str, CellCount]

    _check_version = field_validator("format_version", mode="before")(_format_version)

    def manifest_path(self, cell: str) -> str:
        """The cell's manifest, relative to the tokens folder ('/'-separated)."""
        return self.cells[cell].manifest or f"{cell}/{MANIFEST}"


def read_manifest(path: str) -> CellManifest:
    """A cell's manifest.json; FormatError names the file and field that break the format."""
    return read_model(CellManifest, path)


def write_manifest(path: str, manifest: CellManifest) -> None:
    write_model(path, manifest)


def read_marker(path: str) -> ShardMarker:
    """A shard's done marker; FormatError if it breaks the format (a resumed run redoes the shard)."""
    return read_model(ShardMarker, path)


def write_marker(path: str, marker: ShardMarker) -> None:
    write_model(path, marker)


def read_counts(path: str) -> TokenCounts:
    """tokens/counts.json; FormatError names the file and field that break the format."""
    return read_model(TokenCounts, path)


def counts_from_json(value: Mapping[str, Any], origin: str = COUNTS) -> TokenCounts:
    """A catalog given as parsed JSON (a dict built in code); FormatError names `origin` and the field."""
    return parse(TokenCounts, value, origin)


def write_counts(path: str, counts: TokenCounts) -> None:
    write_model(path, counts)
