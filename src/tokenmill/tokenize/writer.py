"""The shard writer: one curated Parquet file in, one token shard out, resumable and checksummed.

A shard is a deterministic function of its source file and the tokenizer, so a rerun can keep any shard
that is provably complete and redo the rest. The .bin and .idx are streamed (bounded memory) to temporary
names, renamed into place, and only then is the shard's done marker (`part-<n>.done.json`) written,
atomically and last. A shard counts as complete only when its marker names the same format version,
tokenizer, and source file (by sha256), and both files still hash to what the marker records, so a shard
cut short by a kill, or damaged since, is never counted and is written again.

Manifests and counts.json are built from the markers, with sorted keys and no timestamps, so a run that
was killed and resumed leaves the same bytes as one that never stopped.

Held-out slices (tokenmill.tokenize.heldout): `select_file` gives a file's share of its cell's slice
(candidates with their token ids), `write_heldout` writes a cell's slice as `heldout/part-00000` with its
manifest, and `tokenize_file` leaves the slice (and the reserved candidates) out of the training shard.
A training shard's marker records the cell's rule and last held-out key, so a shard is kept on resume only
when it left out the same documents.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import heapq
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from tokenmill import storage
from tokenmill.errors import FormatError
from tokenmill.formats import tokens as token_files
from tokenmill.formats.tokens import (
    BYTES_SUFFIX,
    COUNTS,
    DONE_SUFFIX,
    FORMAT_VERSION,
    HELDOUT_DIR,
    MANIFEST,
    CellCount,
    CellManifest,
    EvalManifest,
    EvalShardEntry,
    HeldoutRule,
    ShardEntry,
    ShardMarker,
    TokenCounts,
    TokenizerEntry,
    heldout_manifest_path,
)
from tokenmill.tokenize.heldout import (
    Classifier,
    Entry,
    HeldoutSelection,
    SliceAccumulator,
    candidate_cut,
    document_key,
)
from tokenmill.tokenize.shards import DTYPES, INDEX_DTYPE, shard_name
from tokenmill.tokenize.tokenizer import TokenizerInfo

# Kept equal to tokenmill.formats.documents.CLUSTER_SIZE (not imported: it pulls in pyarrow.dataset).
CLUSTER_SIZE = "dup_cluster_size"

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
    task: ShardTask,
    output: str,
    info: TokenizerInfo,
    source_sha256: str,
    heldout: HeldoutRule | None = None,
    heldout_last: str | None = None,
    repeat_cap: int | None = None,
) -> ShardMarker | None:
    """The shard's done marker if the shard on disk is complete and verified for this input (and left out
    the same held-out documents, and repeated documents by the same cap), else None."""
    marker = read_marker(task.path(output, DONE_SUFFIX))
    if marker is None:
        return None
    rule = heldout.model_dump() if heldout is not None and heldout.active else None
    if (marker.heldout.model_dump() if marker.heldout is not None else None) != rule:
        return None
    expected = {
        "heldout_last": heldout_last if rule is not None else None,
        "format_version": FORMAT_VERSION,
        "cell": task.cell,
        "name": task.name,
        "tokenizer_sha256": info.sha256,
        "dtype": info.dtype,
        "eos_id": info.eos_id,
        "source_files": [os.path.basename(task.source)],
        "source_sha256": source_sha256,
        "repeat_cap": repeat_cap,
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


def _texts(batch, source: str, row: int) -> list[str]:
    texts = batch.column("text").to_pylist()
    if any(text is None for text in texts):
        raise ValueError(f"{source}: row {row + texts.index(None)} has no text (curated text is never null)")
    return texts


def _encoder(tokenizer):
    # encode_batch_fast skips character offsets, which shards do not keep; same ids as encode_batch.
    return getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)


def _repeats(batch, rows: list[int] | None, repeat_cap: int) -> list[int]:
    """How many times each document of the batch (or of its `rows`) is written: min(dup_cluster_size, cap),
    at least 1 (tokenize --repeat-by-cluster-size; FineWeb-2's upsampling by duplicate-cluster size)."""
    sizes = batch.column(CLUSTER_SIZE).to_pylist()
    if rows is not None:
        sizes = [sizes[i] for i in rows]
    return [max(1, min(size or 1, repeat_cap)) for size in sizes]


def _encode_ahead(
    batches: Iterator[Any],
    tokenizer,
    source: str,
    classifier: Classifier | None = None,
    repeat_cap: int | None = None,
) -> Iterator[list[Any]]:
    """Encodings of each Parquet batch of texts, the next batch encoding while the caller handles this one.

    encode_batch releases the GIL and runs on every core, but between its calls the Python work of
    collecting ids, hashing and writing would leave the cores idle; a helper thread encodes one batch
    ahead so the two overlap. At most two batches are in memory. With a `classifier`, only the documents
    that go to the training shard are encoded.
    """
    encode = _encoder(tokenizer)
    first_row = 0

    def work(batch, row: int) -> list[Any]:
        texts = _texts(batch, source, row)
        rows = None
        if classifier is not None and classifier.active:
            rows = classifier.training_rows(batch.column("id").to_pylist())
            texts = [texts[i] for i in rows]
        encodings = encode(texts, add_special_tokens=False)
        if repeat_cap is None:
            return encodings
        # Each text is encoded once; its copies are the same encoding, written again.
        repeats = _repeats(batch, rows, repeat_cap)
        return [encoding for encoding, count in zip(encodings, repeats, strict=True) for _ in range(count)]

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
    heldout: HeldoutRule | None = None,
    heldout_last: str | None = None,
    repeat_cap: int | None = None,
) -> ShardMarker:
    """Tokenize one source file into part-<n>.bin/.idx, then write its done marker; returns the marker.

    With an active held-out rule, the cell's held-out slice (up to `heldout_last`) and its reserved
    candidates are left out. With `repeat_cap`, each document is written min(dup_cluster_size,
    repeat_cap) times in a row (a file without the column is refused, naming it)."""
    import pyarrow.parquet as pq

    active = heldout is not None and heldout.active
    classifier = Classifier(heldout, heldout_last) if active else None
    dtype = DTYPES[info.dtype]
    documents = 0
    tokens = 0
    with (
        storage.open_file(task.source, "rb") as source,
        storage.atomic_write(task.path(output, ".bin")) as bin_handle,
        storage.atomic_write(task.path(output, ".idx")) as idx_handle,
    ):
        bin_sink, idx_sink = _HashingSink(bin_handle), _HashingSink(idx_handle)
        columns = ["id", "text"] if active else ["text"]
        parquet = pq.ParquetFile(source)
        if repeat_cap is not None:
            if CLUSTER_SIZE not in parquet.schema_arrow.names:
                raise ValueError(
                    f"{task.source}: no {CLUSTER_SIZE} column (curated before cluster sizes were recorded); "
                    "curate again, or tokenize without --repeat-by-cluster-size"
                )
            columns = [*columns, CLUSTER_SIZE]
        batches = parquet.iter_batches(batch_size=batch_documents, columns=columns)
        eos = np.array([info.eos_id], dtype=dtype)
        for encodings in _encode_ahead(batches, tokenizer, task.source, classifier, repeat_cap):
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
        # Only with held-out slices, so that markers made without them keep their bytes.
        **({"heldout": heldout, "heldout_last": heldout_last} if active else {}),
        **({"repeat_cap": repeat_cap} if repeat_cap is not None else {}),
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
    heldout: HeldoutRule | None = None,
    heldout_last: str | None = None,
    repeat_cap: int | None = None,
) -> tuple[ShardMarker, bool]:
    """Keep the shard if complete and verified, else (re)write it.

    Returns (done marker, whether the shard was written by this call).
    """
    source_sha256 = storage.file_sha256(task.source)
    marker = completed_marker(task, output, info, source_sha256, heldout, heldout_last, repeat_cap)
    if marker is not None:
        return marker, False
    marker = tokenize_file(
        task,
        output,
        tokenizer,
        info,
        source_sha256,
        batch_documents,
        on_batch,
        heldout,
        heldout_last,
        repeat_cap,
    )
    return marker, True


# --- held-out slices -------------------------------------------------------------------------------------


def select_file(
    task: ShardTask,
    tokenizer,
    info: TokenizerInfo,
    rule: HeldoutRule,
    batch_documents: int = DEFAULT_BATCH_DOCUMENTS,
) -> SliceAccumulator:
    """The file's share of its cell's held-out slice: its candidates and its `min_documents` lowest other
    keys, tokenized (end-of-text appended), pruned to what can still be in the slice.

    Reads the file's id and text columns once; tokenizes only candidates (the rule's fraction of the
    documents) and at most `min_documents` others. Memory: one batch of text plus the accumulator (at most
    `max_tokens` tokens and `min_documents` + 1 documents).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    dtype = DTYPES[info.dtype]
    encode = _encoder(tokenizer)
    cut = candidate_cut(rule)
    accumulator = SliceAccumulator()
    lowest: list[tuple[int, str, str]] = []  # the min_documents lowest (key, id, text) of non-candidates
    row = 0

    def entries(found: list[tuple[int, str, str]], candidate: bool) -> list[Entry]:
        encodings = encode([text for _, _, text in found], add_special_tokens=False)
        return [
            Entry(
                key=key,
                id=document_id,
                ids=np.array([*encoding.ids, info.eos_id], dtype=dtype),
                bytes=len(text.encode("utf-8")),
                candidate=candidate,
            )
            for (key, document_id, text), encoding in zip(found, encodings, strict=True)
        ]

    with storage.open_file(task.source, "rb") as source:
        parquet = pq.ParquetFile(source)
        accumulator.documents = parquet.metadata.num_rows
        for batch in parquet.iter_batches(batch_size=batch_documents, columns=["id", "text"]):
            keyed = [(document_key(i), i, r) for r, i in enumerate(batch.column("id").to_pylist())]
            picked = [item for item in keyed if item[0] < cut]
            others = heapq.nsmallest(rule.min_documents, (item for item in keyed if item[0] >= cut))
            # Only the documents that may be held out become Python strings: a few in a thousand.
            rows = [r for _, _, r in picked + others]
            texts = batch.column("text").take(pa.array(rows, type=pa.int64())).to_pylist() if rows else []
            if any(text is None for text in texts):
                bad = rows[texts.index(None)]
                raise ValueError(f"{task.source}: row {row + bad} has no text (curated text is never null)")
            row += batch.num_rows
            found = [(key, i, text) for (key, i, _), text in zip(picked, texts, strict=False)]
            lowest = heapq.nsmallest(
                rule.min_documents,
                lowest
                + [(key, i, text) for (key, i, _), text in zip(others, texts[len(picked) :], strict=True)],
            )
            if found:
                for entry in entries(found, True):
                    accumulator.add(entry)
                accumulator.prune(rule)
    if lowest:
        for entry in entries(lowest, False):
            accumulator.add(entry)
        accumulator.prune(rule)
    return accumulator


def _unchanged(path: str, data: bytes) -> bool:
    return storage.exists(path) and storage.file_sha256(path) == hashlib.sha256(data).hexdigest()


def write_heldout(
    output: str, selection: HeldoutSelection, info: TokenizerInfo, rule: HeldoutRule
) -> dict[str, Any]:
    """Write a cell's held-out slice (`<cell>/heldout/part-00000.bin/.idx/.bytes`, then its manifest.json);
    returns the cell's held-out totals for `write_counts`.

    The documents are in key order. Files that already hold the same bytes (a resumed run) are left as they
    are; an empty slice has no shard files, only its manifest.
    """
    cell = selection.cell
    folder = storage.join(output, cell, HELDOUT_DIR)
    shards: list[EvalShardEntry] = []
    if selection.entries:
        ids = np.concatenate([entry.ids for entry in selection.entries]).astype(
            np.dtype(info.dtype).newbyteorder("<")
        )
        ends = np.cumsum([len(entry.ids) for entry in selection.entries]).astype("<u8")
        sizes = np.array([entry.bytes for entry in selection.entries], dtype="<u8")
        name = shard_name(0)
        digests = {}
        for suffix, array in ((".bin", ids), (".idx", ends), (BYTES_SUFFIX, sizes)):
            data = array.tobytes()
            path = storage.join(folder, name + suffix)
            if not _unchanged(path, data):
                storage.write_bytes(path, data)
            digests[suffix] = hashlib.sha256(data).hexdigest()
        shards.append(
            EvalShardEntry(
                name=name,
                documents=len(selection.entries),
                tokens=len(ids),
                bin_sha256=digests[".bin"],
                idx_sha256=digests[".idx"],
                source_files=[],
                bytes=int(sizes.sum()),
                bytes_sha256=digests[BYTES_SUFFIX],
            )
        )
    manifest = EvalManifest(
        format_version=FORMAT_VERSION,
        kind="heldout",
        name=cell,
        tokenizer=_tokenizer_entry(info),
        dtype=info.dtype,
        eos_id=info.eos_id,
        documents=sum(shard.documents for shard in shards),
        tokens=sum(shard.tokens for shard in shards),
        bytes=sum(shard.bytes for shard in shards),
        shards=shards,
        heldout=rule,
        last=selection.last,
        cell_documents=selection.cell_documents,
        reserved_documents=selection.reserved_documents,
        reserved_tokens=selection.reserved_tokens,
    )
    token_files.write_eval_manifest(storage.join(output, heldout_manifest_path(cell)), manifest)
    return {
        "cell": cell,
        "heldout_tokens": manifest.tokens,
        "heldout_documents": manifest.documents,
        "heldout_bytes": manifest.bytes,
        "reserved_documents": selection.reserved_documents,
        "reserved_tokens": selection.reserved_tokens,
        "last": selection.last,
    }


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


def _cell_count(cell: dict[str, Any], heldout: dict[str, Any] | None) -> CellCount:
    name = cell["cell"]
    if heldout is None:
        return CellCount(tokens=cell["tokens"], documents=cell["documents"], manifest=f"{name}/{MANIFEST}")
    return CellCount(
        tokens=cell["tokens"],
        documents=cell["documents"],
        manifest=f"{name}/{MANIFEST}",
        heldout_tokens=heldout["heldout_tokens"],
        heldout_documents=heldout["heldout_documents"],
        heldout_bytes=heldout["heldout_bytes"],
        heldout_manifest=heldout_manifest_path(name),
        reserved_documents=heldout["reserved_documents"],
        reserved_tokens=heldout["reserved_tokens"],
    )


def build_counts(
    cells: list[dict[str, Any]],
    info: TokenizerInfo,
    heldout: dict[str, dict[str, Any]] | None = None,
    rule: HeldoutRule | None = None,
) -> TokenCounts:
    """counts.json from the cells' totals and, with an active held-out rule, their slices' totals
    (`write_heldout`'s results, by cell)."""
    active = rule is not None and rule.active
    entries = {
        c["cell"]: _cell_count(c, (heldout or {})[c["cell"]] if active else None)
        for c in sorted(cells, key=lambda c: c["cell"])
    }
    fields: dict[str, Any] = {}
    if active:
        fields = {
            "heldout": rule,
            "total_heldout_tokens": sum(entry.heldout_tokens or 0 for entry in entries.values()),
            "total_heldout_documents": sum(entry.heldout_documents or 0 for entry in entries.values()),
        }
    return TokenCounts(
        format_version=FORMAT_VERSION,
        tokenizer=_tokenizer_entry(info),
        total_tokens=sum(entry.tokens for entry in entries.values()),
        total_documents=sum(entry.documents or 0 for entry in entries.values()),
        cells=entries,
        **fields,
    )


def write_counts(
    output: str,
    cells: list[dict[str, Any]],
    info: TokenizerInfo,
    heldout: dict[str, dict[str, Any]] | None = None,
    rule: HeldoutRule | None = None,
) -> TokenCounts:
    """Write tokens/counts.json from the cells' totals (`write_manifest`'s results) and their held-out
    slices' (`write_heldout`'s); returns it."""
    counts = build_counts(cells, info, heldout, rule)
    token_files.write_counts(storage.join(output, COUNTS), counts)
    return counts
