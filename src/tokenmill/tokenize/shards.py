"""Token shards on disk: names, checksums, and the memory-mapped reader used by the trainer and the reports.

Layout (docs/formats.md, "Token shards"): per cell, `part-<n>.bin` (token ids, documents each followed by
end-of-text), `part-<n>.idx` (uint64 end offset of each document), `manifest.json`; `tokens/counts.json`
over all cells. `TokenShards` opens one cell, `TokenCatalog` the whole folder through counts.json;
`EvalShards` opens an evaluation set (a cell's `heldout/` slice, or `eval/<name>/`) with its `.bytes`.

Reading fails fast: a manifest or counts.json that breaks its format (tokenmill.formats.tokens reads
them), shards made with another tokenizer than the caller expects, a missing or wrongly sized file, or
(with verification) a checksum mismatch all raise a `ShardError` that names the file and both values. This
module needs only numpy and the format records: the trainer and the reports import it, never Beam or the
tokenizer library.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from tokenmill import storage
from tokenmill.errors import FormatError
from tokenmill.formats.tokens import (
    BYTES_SUFFIX,
    COUNTS,
    EVAL_DIR,
    MANIFEST,
    CellManifest,
    EvalManifest,
    TokenCounts,
    TokenizerEntry,
    read_counts,
    read_eval_manifest,
    read_manifest,
)

DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
INDEX_DTYPE = np.dtype("<u8")
_HASH_CHUNK = 8 << 20


class ShardError(ValueError):
    """Token shards that cannot be read as asked: wrong format version or tokenizer, missing or bad files."""


class ShardChecksumError(ShardError):
    """A shard file whose bytes do not match the sha256 recorded for it."""


def shard_name(index: int) -> str:
    return f"part-{index:05d}"


def check_tokenizer(found: str, expected: str | None, where: str, name: str = "") -> None:
    if expected is not None and found != expected:
        named = f" ({name})" if name else ""
        raise ShardError(
            f"{where}: made with tokenizer sha256 {found}{named}, "
            f"but the caller expects tokenizer sha256 {expected}"
        )


def _map(path: str, dtype: np.dtype, count: int) -> np.ndarray:
    """A read-only memory map of `count` items; checks the file size first so truncation is caught at open."""
    local = storage.local_path(path)
    if not os.path.exists(local):
        raise ShardError(f"{path}: missing (listed in the manifest)")
    size = os.path.getsize(local)
    if size != count * dtype.itemsize:
        raise ShardChecksumError(
            f"{path}: {size} bytes, but the manifest says {count} x {dtype.itemsize} = "
            f"{count * dtype.itemsize} (a truncated or damaged shard)"
        )
    if count == 0:
        # numpy cannot map an empty file.
        return np.zeros(0, dtype=dtype)
    return np.memmap(local, dtype=dtype, mode="r", shape=(count,))


def catalog_tokenizer(counts: TokenCounts, path: str) -> TokenizerEntry:
    """The tokenizer of a catalog that shards are read through, which must give what `tokenize` writes:
    hand-written catalogs for planning may give the cells' tokens alone, a catalog of shards may not."""
    missing = [
        name for name in ("tokenizer", "total_tokens", "total_documents") if getattr(counts, name) is None
    ]
    missing += [f"cells.{cell}.documents" for cell, entry in counts.cells.items() if entry.documents is None]
    if counts.tokenizer is None or missing:
        raise ShardError(
            f"{path}: no {', '.join(missing[:3])} (not a catalog of token shards written by "
            "`tokenmill tokenize`)"
        )
    return counts.tokenizer


class TokenShards:
    """One cell's token shards, memory-mapped: document i, or any token range of the cell's stream.

    The cell's stream is its shards' .bin files concatenated in order (part-00000, part-00001, ...), so
    token offsets and document numbers run across shards. `document(i)` leaves out the end-of-text id
    that follows each document; `tokens(start, stop)` returns the stream as stored, end-of-text included.
    """

    def __init__(self, path: str, expected_tokenizer_sha256: str | None = None, verify: bool = False) -> None:
        if not storage.is_local(path):
            raise ShardError(f"{path}: token shards are memory-mapped and must be on local disk")
        self.path = storage.local_path(path).rstrip("/")
        manifest_path = os.path.join(self.path, MANIFEST)
        if not os.path.exists(manifest_path):
            raise ShardError(
                f"{manifest_path}: missing (not a token cell, or its tokenize run did not finish)"
            )
        try:
            self.manifest = self._read_manifest(manifest_path)
        except FormatError as error:
            raise ShardError(str(error)) from error
        tokenizer = self.manifest.tokenizer
        check_tokenizer(tokenizer.sha256, expected_tokenizer_sha256, manifest_path, tokenizer.name)
        self.cell: str = self._name()
        self.dtype: np.dtype = DTYPES[self.manifest.dtype]
        self.eos_id: int = self.manifest.eos_id
        self.tokenizer_sha256: str = tokenizer.sha256
        self.tokenizer_name: str = tokenizer.name
        self.vocab_size: int = tokenizer.vocab_size
        # The manifest's shard entries as JSON objects: the trainer's readers (windows, remote) take a
        # local cell's shards and a remote one's alike, and a remote cell's are still plain JSON.
        self.shards: list[dict[str, Any]] = [shard.to_json() for shard in self.manifest.shards]

        self._bins: list[np.ndarray] = []
        self._idxs: list[np.ndarray] = []
        for shard in self.shards:
            self._bins.append(_map(self._file(shard, ".bin"), self.dtype, int(shard["tokens"])))
            idx = _map(self._file(shard, ".idx"), INDEX_DTYPE, int(shard["documents"]))
            if len(idx) and int(idx[-1]) != int(shard["tokens"]):
                raise ShardChecksumError(
                    f"{self._file(shard, '.idx')}: last document ends at {int(idx[-1])}, "
                    f"but the shard has {shard['tokens']} tokens"
                )
            self._idxs.append(idx)
        documents = np.array([int(s["documents"]) for s in self.shards], dtype=np.int64)
        tokens = np.array([int(s["tokens"]) for s in self.shards], dtype=np.int64)
        # First document / token of each shard in the cell's numbering, plus the total at the end.
        self._doc_starts = np.concatenate([[0], np.cumsum(documents)])
        self._token_starts = np.concatenate([[0], np.cumsum(tokens)])
        self.num_documents = int(self._doc_starts[-1])
        self.num_tokens = int(self._token_starts[-1])
        if self.num_documents != self.manifest.documents or self.num_tokens != self.manifest.tokens:
            raise ShardError(f"{manifest_path}: cell totals do not equal the sum of its shards")
        if verify:
            self.verify()

    _CHECKED = ((".bin", "bin_sha256"), (".idx", "idx_sha256"))

    def _read_manifest(self, path: str) -> CellManifest | EvalManifest:
        return read_manifest(path)

    def _name(self) -> str:
        return self.manifest.cell

    def _file(self, shard: dict[str, Any], suffix: str) -> str:
        return os.path.join(self.path, shard["name"] + suffix)

    def verify(self) -> int:
        """Check every file against its sha256 in the manifest; returns bytes checked.

        Raises ShardChecksumError naming the first file that does not match.
        """
        checked = 0
        for shard in self.shards:
            for suffix, key in self._CHECKED:
                path = self._file(shard, suffix)
                actual = storage.file_sha256(path, _HASH_CHUNK)
                if actual != shard[key]:
                    raise ShardChecksumError(
                        f"{path}: checksum mismatch (sha256 {actual}, manifest says {shard[key]}); "
                        "the file is corrupted: rerun `tokenmill tokenize` to rewrite it"
                    )
                checked += os.path.getsize(path)
        return checked

    def __len__(self) -> int:
        return self.num_documents

    def __repr__(self) -> str:
        return (
            f"TokenShards({self.path!r}: {self.num_documents} documents, {self.num_tokens} tokens, "
            f"{len(self.shards)} shards, {self.dtype.name})"
        )

    def document_bounds(self, i: int) -> tuple[int, int]:
        """(start, stop) of document i in the cell's token stream; stop is past its end-of-text id."""
        if i < 0:
            i += self.num_documents
        if not 0 <= i < self.num_documents:
            raise IndexError(f"document {i} out of range: the cell has {self.num_documents}")
        shard = int(np.searchsorted(self._doc_starts, i, side="right")) - 1
        local = i - int(self._doc_starts[shard])
        idx = self._idxs[shard]
        start = int(idx[local - 1]) if local else 0
        base = int(self._token_starts[shard])
        return base + start, base + int(idx[local])

    def document(self, i: int) -> np.ndarray:
        """Token ids of document i, without its end-of-text id (a read-only view, no copy)."""
        start, stop = self.document_bounds(i)
        return self.tokens(start, stop - 1)

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the cell's stream; a view within one shard, a copy across shards."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"token range [{start}, {stop}) out of range: the cell has {self.num_tokens}")
        first = max(int(np.searchsorted(self._token_starts, start, side="right")) - 1, 0)
        pieces = []
        shard = first
        while start < stop:
            base = int(self._token_starts[shard])
            end = min(stop, int(self._token_starts[shard + 1]))
            pieces.append(np.asarray(self._bins[shard][start - base : end - base]))
            start = end
            shard += 1
        if not pieces:
            return np.zeros(0, dtype=self.dtype)
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def __iter__(self) -> Iterator[np.ndarray]:
        for i in range(self.num_documents):
            yield self.document(i)


class EvalShards(TokenShards):
    """An evaluation set, memory-mapped: a cell's held-out slice (`tokens/<cell>/heldout`) or an external
    set (`tokens/eval/<name>`). As `TokenShards`, plus each document's UTF-8 bytes (the `.bytes` files),
    for exact bits per byte: `num_bytes`, `document_bytes(i)`, `bytes_between(first, stop)`.
    """

    _CHECKED = (*TokenShards._CHECKED, (BYTES_SUFFIX, "bytes_sha256"))

    def __init__(self, path: str, expected_tokenizer_sha256: str | None = None, verify: bool = False) -> None:
        super().__init__(path, expected_tokenizer_sha256, verify=False)
        self.name: str = self.manifest.name
        self.kind: str = self.manifest.kind
        self._sizes = [
            _map(self._file(shard, BYTES_SUFFIX), INDEX_DTYPE, int(shard["documents"]))
            for shard in self.shards
        ]
        sizes = np.concatenate([np.asarray(s, dtype=np.int64) for s in self._sizes]) if self._sizes else None
        self._byte_starts = np.concatenate([[0], np.cumsum(sizes)]) if sizes is not None else np.zeros(1, int)
        self.num_bytes = int(self._byte_starts[-1])
        if self.num_bytes != self.manifest.bytes:
            raise ShardChecksumError(
                f"{os.path.join(self.path, MANIFEST)}: its .bytes files sum to {self.num_bytes}, but the "
                f"manifest says {self.manifest.bytes}"
            )
        if verify:
            self.verify()

    def __repr__(self) -> str:
        return (
            f"EvalShards({self.path!r}: {self.kind} {self.name}, {self.num_documents} documents, "
            f"{self.num_tokens} tokens, {self.num_bytes} bytes)"
        )

    def _read_manifest(self, path: str) -> EvalManifest:
        return read_eval_manifest(path)

    def _name(self) -> str:
        return self.manifest.name

    def document_bytes(self, i: int) -> int:
        """UTF-8 bytes of document i's text."""
        return self.bytes_between(i, i + 1)

    def bytes_between(self, first: int, stop: int) -> int:
        """UTF-8 bytes of documents [first, stop)."""
        if not 0 <= first <= stop <= self.num_documents:
            raise IndexError(f"documents [{first}, {stop}) out of range: the set has {self.num_documents}")
        return int(self._byte_starts[stop] - self._byte_starts[first])


class TokenCatalog:
    """All cells of a tokens/ folder, through counts.json; cells open on first use, with the same checks.

    Every cell must carry the tokenizer that counts.json names (and the caller's, when given), and the
    counts that counts.json lists for it, so a catalog never mixes tokenizers or plans against stale counts.
    """

    def __init__(
        self, tokens_dir: str, expected_tokenizer_sha256: str | None = None, verify: bool = False
    ) -> None:
        self.path = storage.local_path(tokens_dir).rstrip("/")
        counts_path = os.path.join(self.path, COUNTS)
        if not os.path.exists(counts_path):
            raise ShardError(f"{counts_path}: missing (run `tokenmill tokenize` to the end first)")
        try:
            self.counts: TokenCounts = read_counts(counts_path)
        except FormatError as error:
            raise ShardError(str(error)) from error
        tokenizer = catalog_tokenizer(self.counts, counts_path)
        check_tokenizer(tokenizer.sha256, expected_tokenizer_sha256, counts_path, tokenizer.name)
        self.tokenizer: TokenizerEntry = tokenizer
        self.tokenizer_sha256: str = tokenizer.sha256
        self.total_tokens: int = self.counts.total_tokens or 0
        self.total_documents: int = self.counts.total_documents or 0
        self._verify = verify
        self._open: dict[str, TokenShards] = {}

    @property
    def cells(self) -> list[str]:
        return sorted(self.counts.cells)

    def match(self, pattern: str) -> list[str]:
        """Cells whose name matches a mixture pattern such as `domain=code/*`."""
        return [cell for cell in self.cells if fnmatch.fnmatchcase(cell, pattern.strip("/"))]

    def __contains__(self, cell: object) -> bool:
        return cell in self.counts.cells

    def __len__(self) -> int:
        return len(self.counts.cells)

    def __iter__(self) -> Iterator[str]:
        return iter(self.cells)

    def __getitem__(self, cell: str) -> TokenShards:
        if cell not in self._open:
            if cell not in self.counts.cells:
                raise KeyError(f"{cell!r} is not in {os.path.join(self.path, COUNTS)}")
            entry = self.counts.cells[cell]
            manifest_dir = os.path.dirname(os.path.join(self.path, self.counts.manifest_path(cell)))
            shards = TokenShards(
                manifest_dir, expected_tokenizer_sha256=self.tokenizer_sha256, verify=self._verify
            )
            if shards.num_tokens != entry.tokens or shards.num_documents != entry.documents:
                raise ShardError(
                    f"{os.path.join(self.path, COUNTS)}: lists {entry.tokens} tokens / "
                    f"{entry.documents} documents for {cell}, but its manifest has "
                    f"{shards.num_tokens} / {shards.num_documents}"
                )
            self._open[cell] = shards
        return self._open[cell]

    def heldout(self, cell: str) -> EvalShards:
        """The cell's held-out slice (`<cell>/heldout`), checked against counts.json and its tokenizer."""
        if cell not in self.counts.cells:
            raise KeyError(f"{cell!r} is not in {os.path.join(self.path, COUNTS)}")
        relative = self.counts.heldout_manifest_path(cell)
        if relative is None:
            raise ShardError(
                f"{os.path.join(self.path, COUNTS)}: made without held-out slices (--heldout-fraction 0, or "
                "by a tokenize that predates them)"
            )
        shards = EvalShards(
            os.path.dirname(os.path.join(self.path, relative)),
            expected_tokenizer_sha256=self.tokenizer_sha256,
            verify=self._verify,
        )
        entry = self.counts.cells[cell]
        if shards.num_tokens != entry.heldout_tokens or shards.num_documents != entry.heldout_documents:
            raise ShardError(
                f"{os.path.join(self.path, COUNTS)}: lists {entry.heldout_tokens} held-out tokens / "
                f"{entry.heldout_documents} documents for {cell}, but {relative} has "
                f"{shards.num_tokens} / {shards.num_documents}"
            )
        return shards

    def eval_set(self, name: str) -> EvalShards:
        """The external evaluation set `eval/<name>` (from `tokenmill tokenize-eval`), same tokenizer."""
        return EvalShards(
            os.path.join(self.path, EVAL_DIR, name),
            expected_tokenizer_sha256=self.tokenizer_sha256,
            verify=self._verify,
        )
