"""The shard writer: one curated Parquet file in, one token shard out, resumable and checksummed.

A shard is a deterministic function of its source file and the tokenizer, so a rerun can keep any shard
that is provably complete and redo the rest. The .bin and .idx are streamed (bounded memory) to temporary
names, renamed into place, and only then is the shard's done marker (`part-<n>.done.json`) written,
atomically and last. A shard counts as complete only when its marker names the same format version,
tokenizer, and source file (by sha256), and both files still hash to what the marker records, so a shard
cut short by a kill, or damaged since, is never counted and is written again.

Manifests and counts.json are built from the markers, with sorted keys and no timestamps, so a run that
was killed and resumed leaves the same bytes as one that never stopped.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from tokenmill import storage
from tokenmill.errors import FormatError
from tokenmill.formats import tokens as token_files
from tokenmill.formats.tokens import (
    COUNTS,
    DONE_SUFFIX,
    FORMAT_VERSION,
    MANIFEST,
    CellCount,
    CellManifest,
    ShardEntry,
    ShardMarker,
    TokenCounts,
    TokenizerEntry,
)
from tokenmill.tokenize.shards import DTYPES, INDEX_DTYPE, shard_name
from tokenmill.tokenize.tokenizer import TokenizerInfo

DEFAULT_BATCH_DOCUMENTS = 512  # documents per encode_batch call: a few MB of text


@dataclasses.dataclass(frozen=True)
class ShardTask:
    """One unit of work: the n-th Parquet file (sorted) of a cell becomes part-<n> of that cell."""

    cell: str
    index: int
    source: str

    @property
    def name(self) -> str:
        return shard_name(self.index)

    def path(self, output: str, suffix: str) -> str:
        return storage.join(output, self.cell, self.name + suffix)


def read_marker(path: str) -> ShardMarker | None:
    """The done marker at `path`, or None if there is none or it cannot be read (the shard is redone)."""
    if not storage.exists(path):
        return None
    try:
        return token_files.read_marker(path)
    except (OSError, FormatError):
        return None


def completed_marker(
    task: ShardTask, output: str, info: TokenizerInfo, source_sha256: str
) -> ShardMarker | None:
    """The shard's done marker if the shard on disk is complete and verified for this input, else None."""
    marker = read_marker(task.path(output, DONE_SUFFIX))
    if marker is None:
        return None
    expected = {
        "format_version": FORMAT_VERSION,
        "cell": task.cell,
        "name": task.name,
        "tokenizer_sha256": info.sha256,
        "dtype": info.dtype,
        "eos_id": info.eos_id,
        "source_files": [os.path.basename(task.source)],
        "source_sha256": source_sha256,
    }
    if any(getattr(marker, key) != value for key, value in expected.items()):
        return None
    for suffix, recorded in ((".bin", marker.bin_sha256), (".idx", marker.idx_sha256)):
        path = task.path(output, suffix)
        if not storage.exists(path) or storage.file_sha256(path) != recorded:
            return None
    return marker


class _HashingSink:
    """Writes arrays to an open file and hashes the same bytes, so no second pass over the file is needed."""

    def __init__(self, handle) -> None:
        self.handle = handle
        self.digest = hashlib.sha256()

    def write(self, array: np.ndarray) -> None:
        view = memoryview(np.ascontiguousarray(array)).cast("B")
        self.handle.write(view)
        self.digest.update(view)


def _encode_ahead(batches: Iterator[Any], tokenizer, source: str) -> Iterator[list[Any]]:
    """Encodings of each Parquet batch of texts, the next batch encoding while the caller handles this one.

    encode_batch releases the GIL and runs on every core, but between its calls the Python work of
    collecting ids, hashing and writing would leave the cores idle; a helper thread encodes one batch
    ahead so the two overlap. At most two batches are in memory.
    """
    # encode_batch_fast skips character offsets, which shards do not keep; same ids as encode_batch.
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    first_row = 0

    def work(batch, row: int) -> list[Any]:
        texts = batch.column(0).to_pylist()
        if any(text is None for text in texts):
            raise ValueError(
                f"{source}: row {row + texts.index(None)} has no text (curated text is never null)"
            )
        return encode(texts, add_special_tokens=False)

    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="encode") as pool:
        pending = None
        for batch in batches:
            submitted = pool.submit(work, batch, first_row)
            first_row += batch.num_rows
            if pending is not None:
                yield pending.result()
            pending = submitted
        if pending is not None:
            yield pending.result()


def tokenize_file(
    task: ShardTask,
    output: str,
    tokenizer,
    info: TokenizerInfo,
    source_sha256: str,
    batch_documents: int = DEFAULT_BATCH_DOCUMENTS,
    on_batch: Callable[[int, int], None] | None = None,
) -> ShardMarker:
    """Tokenize one source file into part-<n>.bin/.idx, then write its done marker; returns the marker."""
    import pyarrow.parquet as pq

    dtype = DTYPES[info.dtype]
    documents = 0
    tokens = 0
    with (
        storage.open_file(task.source, "rb") as source,
        storage.atomic_write(task.path(output, ".bin")) as bin_handle,
        storage.atomic_write(task.path(output, ".idx")) as idx_handle,
    ):
        bin_sink, idx_sink = _HashingSink(bin_handle), _HashingSink(idx_handle)
        batches = pq.ParquetFile(source).iter_batches(batch_size=batch_documents, columns=["text"])
        eos = np.array([info.eos_id], dtype=dtype)
        for encodings in _encode_ahead(batches, tokenizer, task.source):
            # One small array per document, then one concatenation: about a third cheaper than growing a
            # Python list. numpy refuses (OverflowError) an id that does not fit the dtype, never wraps it.
            pieces: list[np.ndarray] = []
            ends = np.empty(len(encodings), dtype=np.int64)
            length = 0
            for position, encoding in enumerate(encodings):
                ids = np.array(encoding.ids, dtype=dtype)
                pieces += (ids, eos)
                length += len(ids) + 1
                ends[position] = length
            if pieces:
                bin_sink.write(np.concatenate(pieces))
                idx_sink.write((ends + tokens).astype(INDEX_DTYPE))
            documents += len(encodings)
            tokens += length
            if on_batch is not None:
                on_batch(len(encodings), length)
    marker = ShardMarker(
        format_version=FORMAT_VERSION,
        cell=task.cell,
        name=task.name,
        documents=documents,
        tokens=tokens,
        bin_sha256=bin_sink.digest.hexdigest(),
        idx_sha256=idx_sink.digest.hexdigest(),
        tokenizer_sha256=info.sha256,
        dtype=info.dtype,
        eos_id=info.eos_id,
        source_files=[os.path.basename(task.source)],
        source_sha256=source_sha256,
    )
    # Last, so that a marker always describes files that are fully in place.
    token_files.write_marker(task.path(output, DONE_SUFFIX), marker)
    return marker


def process_shard(
    task: ShardTask,
    output: str,
    tokenizer,
    info: TokenizerInfo,
    batch_documents: int = DEFAULT_BATCH_DOCUMENTS,
    on_batch: Callable[[int, int], None] | None = None,
) -> tuple[ShardMarker, bool]:
    """Keep the shard if complete and verified, else (re)write it.

    Returns (done marker, whether the shard was written by this call).
    """
    source_sha256 = storage.file_sha256(task.source)
    marker = completed_marker(task, output, info, source_sha256)
    if marker is not None:
        return marker, False
    return tokenize_file(task, output, tokenizer, info, source_sha256, batch_documents, on_batch), True


def write_shard(
    output: str,
    cell: str,
    index: int,
    ids: np.ndarray,
    document_ends: np.ndarray,
    info: TokenizerInfo,
    source_files: list[str],
) -> ShardEntry:
    """Write part-<index> of a cell from token ids already in memory (each document ending with end-of-text,
    `document_ends` its exclusive end offsets); returns its manifest entry, for `write_manifest`.

    For tokens that come from elsewhere than `tokenmill tokenize` (another tokenizer's output, test and
    benchmark fixtures); the format is the same, written atomically.
    """
    name = shard_name(index)
    digests = {}
    little_endian = np.dtype(info.dtype).newbyteorder("<")
    for suffix, array in (
        (".bin", np.asarray(ids, dtype=little_endian)),
        (".idx", np.asarray(document_ends, "<u8")),
    ):
        data = array.tobytes()
        storage.write_bytes(storage.join(output, cell, name + suffix), data)
        digests[suffix] = hashlib.sha256(data).hexdigest()
    return ShardEntry(
        name=name,
        documents=len(document_ends),
        tokens=len(ids),
        bin_sha256=digests[".bin"],
        idx_sha256=digests[".idx"],
        source_files=list(source_files),
    )


def _tokenizer_entry(info: TokenizerInfo) -> TokenizerEntry:
    return TokenizerEntry(**info.manifest_entry())


def build_manifest(cell: str, shards: list[ShardEntry], info: TokenizerInfo) -> CellManifest:
    """A cell's manifest from its shards' entries (or done markers), in shard order."""
    entries = [
        shard.entry() if isinstance(shard, ShardMarker) else shard
        for shard in sorted(shards, key=lambda shard: shard.name)
    ]
    return CellManifest(
        format_version=FORMAT_VERSION,
        cell=cell,
        tokenizer=_tokenizer_entry(info),
        dtype=info.dtype,
        eos_id=info.eos_id,
        documents=sum(entry.documents for entry in entries),
        tokens=sum(entry.tokens for entry in entries),
        shards=entries,
    )


def write_manifest(output: str, cell: str, shards: list[ShardEntry], info: TokenizerInfo) -> dict[str, Any]:
    """Write the cell's manifest.json; returns the cell's totals ({cell, tokens, documents}) for
    `write_counts`."""
    manifest = build_manifest(cell, shards, info)
    token_files.write_manifest(storage.join(output, cell, MANIFEST), manifest)
    return {"cell": cell, "tokens": manifest.tokens, "documents": manifest.documents}


def build_counts(cells: list[dict[str, Any]], info: TokenizerInfo) -> TokenCounts:
    entries = {
        c["cell"]: CellCount(tokens=c["tokens"], documents=c["documents"], manifest=f"{c['cell']}/{MANIFEST}")
        for c in sorted(cells, key=lambda c: c["cell"])
    }
    return TokenCounts(
        format_version=FORMAT_VERSION,
        tokenizer=_tokenizer_entry(info),
        total_tokens=sum(entry.tokens for entry in entries.values()),
        total_documents=sum(entry.documents or 0 for entry in entries.values()),
        cells=entries,
    )


def write_counts(output: str, cells: list[dict[str, Any]], info: TokenizerInfo) -> TokenCounts:
    """Write tokens/counts.json from the cells' totals (`write_manifest`'s results); returns it."""
    counts = build_counts(cells, info)
    token_files.write_counts(storage.join(output, COUNTS), counts)
    return counts
