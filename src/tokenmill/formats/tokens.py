"""Token shards' JSON files (docs/formats.md, "Token shards"): each cell's `manifest.json`, each shard's done
marker `part-<n>.done.json`, and `tokens/counts.json`, the catalog that mixtures plan against; and the
evaluation sets' manifests (docs/formats.md, "Evaluation sets"): each cell's held-out slice
(`tokens/<cell>/heldout/manifest.json`) and each external set (`tokens/eval/<name>/manifest.json`).

The .bin and .idx files themselves are read by `tokenmill.tokenize.shards` (memory maps) and
`tokenmill.trainer.data.remote` (ranged reads); their layout is fixed by the records here.
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
#: A cell's held-out slice lives in this folder of the cell's folder; external sets under EVAL_DIR/<name>.
HELDOUT_DIR = "heldout"
EVAL_DIR = "eval"
#: Beside an evaluation shard's .bin and .idx: little-endian uint64 UTF-8 bytes of each document.
BYTES_SUFFIX = ".bytes"
#: How a document's held-out key is made: the first 8 bytes, big-endian, of this hash of its id.
HELDOUT_HASH = "sha256('tokenmill-heldout:' + id)[:8], big-endian uint64"
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


class HeldoutRule(FormatModel):
    """How `tokenize` chose each cell's held-out slice (docs/tokenize.md, "Held-out slices").

    A document is a held-out candidate when its key (`hash`) is below `fraction` x 2^64. A cell's slice is
    its documents in key order while the slice holds fewer than `max_tokens` tokens, candidates first, then
    (only in a cell too small for the fraction) other documents until it holds `min_documents` (at most half
    the cell's documents). Candidates past the cap are reserved: neither trained on nor evaluated.
    """

    fraction: float
    max_tokens: Count
    min_documents: Count
    hash: str = HELDOUT_HASH

    @property
    def active(self) -> bool:
        return self.fraction > 0 or self.min_documents > 0


class ShardMarker(ShardEntry):
    """`part-<n>.done.json`, written last beside a finished shard: its manifest entry plus what it was made
    with, so that a resumed run keeps it only when the same input and tokenizer would make it again.

    `heldout` and `heldout_last` (the cell's held-out rule and the key of its last held-out document, see
    `EvalManifest`) say which documents the shard left out: a shard made under another rule, or before
    its cell's slice moved, is made again. Both are null (or absent) without held-out slices.
    """

    format_version: int
    cell: str
    tokenizer_sha256: str
    dtype: TokenDtype
    eos_id: Count
    source_sha256: str
    heldout: HeldoutRule | None = None
    heldout_last: str | None = None
    #: `tokenize --repeat-by-cluster-size`: each document written min(dup_cluster_size, this) times;
    #: null (or absent) when every document is written once.
    repeat_cap: Count | None = None

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


class EvalShardEntry(ShardEntry):
    """One shard of an evaluation set: a ShardEntry plus its documents' UTF-8 bytes (the `.bytes` file)."""

    bytes: Count
    bytes_sha256: str


class EvalShardMarker(EvalShardEntry):
    """`eval/<name>/part-<n>.done.json`, written last beside a finished shard of an external set: its
    manifest entry plus what it was made with (as `ShardMarker`), and what its input file had rejected."""

    format_version: int
    set: str
    tokenizer_sha256: str
    dtype: TokenDtype
    eos_id: Count
    source_sha256: str
    fields: dict[str, str | None]
    rejected: dict[str, Count]

    def entry(self) -> EvalShardEntry:
        return EvalShardEntry(**{name: getattr(self, name) for name in EvalShardEntry.model_fields})


class EvalManifest(FormatModel):
    """The manifest of an evaluation set: a cell's held-out slice (`kind: heldout`, in
    `tokens/<cell>/heldout/`) or an external set (`kind: external`, in `tokens/eval/<name>/`).

    `bytes` is the UTF-8 length of the documents' text (end-of-text ids have none): bits per byte of a set
    are its summed negative log-likelihood in bits over all its tokens, end-of-text included, divided by
    `bytes`. Held-out slices carry the rule, `last` (the key of the slice's last document in key order,
    `<16 hex digits>:<id>`, null for an empty slice) and the candidates the cap reserved; external sets
    carry their input files and what was rejected while reading them.
    """

    format_version: int
    kind: Literal["heldout", "external"]
    name: str  # the cell for a held-out slice, the set's name for an external set
    tokenizer: TokenizerEntry
    dtype: TokenDtype
    eos_id: Count
    documents: Count
    tokens: Count
    bytes: Count
    shards: list[EvalShardEntry]
    heldout: HeldoutRule | None = None
    last: str | None = None
    cell_documents: Count | None = None  # every document of the cell, held out or not
    reserved_documents: Count | None = None
    reserved_tokens: Count | None = None
    inputs: list[str] | None = None  # external: input files, relative to the input root
    rejected: dict[str, Count] | None = None  # external: records rejected, by error_kind

    _check_version = field_validator("format_version", mode="before")(_format_version)


class CellCount(FormatModel):
    """A cell's line in counts.json. Catalogs written by hand for planning may give `tokens` alone.

    `tokens` and `documents` are the training shards' (what mixtures plan against and the sampler draws);
    the `heldout_*` fields count the cell's held-out slice (`heldout_manifest`), `reserved_*` the held-out
    candidates past the cap, which are in neither.
    """

    tokens: Count
    documents: Count | None = None
    manifest: str | None = None
    heldout_tokens: Count | None = None
    heldout_documents: Count | None = None
    heldout_bytes: Count | None = None
    heldout_manifest: str | None = None
    reserved_documents: Count | None = None
    reserved_tokens: Count | None = None


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
    heldout: HeldoutRule | None = None  # null: made without held-out slices
    total_heldout_tokens: Count | None = None
    total_heldout_documents: Count | None = None
    cells: dict[str, CellCount]

    _check_version = field_validator("format_version", mode="before")(_format_version)

    def manifest_path(self, cell: str) -> str:
        """The cell's manifest, relative to the tokens folder ('/'-separated)."""
        return self.cells[cell].manifest or f"{cell}/{MANIFEST}"

    def heldout_manifest_path(self, cell: str) -> str | None:
        """The cell's held-out manifest, relative to the tokens folder, or None without held-out slices."""
        if self.heldout is None or not self.heldout.active:
            return None
        return self.cells[cell].heldout_manifest or heldout_manifest_path(cell)


def heldout_manifest_path(cell: str) -> str:
    """`<cell>/heldout/manifest.json`, relative to the tokens folder."""
    return f"{cell}/{HELDOUT_DIR}/{MANIFEST}"


def eval_manifest_path(name: str) -> str:
    """`eval/<name>/manifest.json`, relative to the tokens folder."""
    return f"{EVAL_DIR}/{name}/{MANIFEST}"


def read_manifest(path: str) -> CellManifest:
    """A cell's manifest.json; FormatError names the file and field that break the format."""
    return read_model(CellManifest, path)


def write_manifest(path: str, manifest: CellManifest) -> None:
    write_model(path, manifest)


def read_eval_manifest(path: str) -> EvalManifest:
    """An evaluation set's manifest.json (held-out slice or external set); FormatError names the field."""
    return read_model(EvalManifest, path)


def write_eval_manifest(path: str, manifest: EvalManifest) -> None:
    write_model(path, manifest)


def read_eval_marker(path: str) -> EvalShardMarker:
    return read_model(EvalShardMarker, path)


def write_eval_marker(path: str, marker: EvalShardMarker) -> None:
    write_model(path, marker)


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
