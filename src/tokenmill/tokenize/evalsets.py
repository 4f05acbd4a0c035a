"""External evaluation sets: text that the user brings, tokenized under a name (`tokenmill tokenize-eval`).

An evaluation set (Paloma's C4 slice, an uncheatable-eval dump, a team's own held-out crawl) is read with
curate's readers (JSON Lines, Parquet, WARC; plain, .gz or .zst; local or gs://), so a bad record gets the
same error and the same `rejected/` record as in curate, and tokenized with the run's tokenizer into
`<tokens>/eval/<name>/`: `part-<n>.bin/.idx/.bytes` per input file (sorted), their done markers,
`rejected/part-<n>-of-<m>.jsonl.zst` where an input had bad records, and `manifest.json` (an
`EvalManifest` of kind `external`), written last. The text is tokenized as given (no normalization), and
each document's UTF-8 bytes are recorded, so bits per byte are exact for the set's own text.

Runs in the calling process, one input file at a time (an evaluation set is millions of tokens, not
trillions): memory is one batch of text and ids plus one read chunk of the reader, and the ids of the
file being read (the reader's duplicate check).
"""

from __future__ import annotations

import logging
import os
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenmill import storage
from tokenmill.errors import FormatError
from tokenmill.formats import tokens as token_files
from tokenmill.formats.rejected import write_rejected
from tokenmill.formats.tokens import (
    BYTES_SUFFIX,
    COUNTS,
    DONE_SUFFIX,
    EVAL_DIR,
    FORMAT_VERSION,
    MANIFEST,
    EvalManifest,
    EvalShardMarker,
    TokenizerEntry,
)
from tokenmill.tokenize.shards import DTYPES, INDEX_DTYPE, shard_name
from tokenmill.tokenize.tokenizer import TokenizerInfo
from tokenmill.tokenize.writer import DEFAULT_BATCH_DOCUMENTS, _encoder, _HashingSink

log = logging.getLogger(__name__)
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
REJECTED_DIR = "rejected"
_SET_FILE = re.compile(
    r"^(?:part-\d+\.(?:bin|idx|bytes|done\.json)|manifest\.json|rejected/part-\d+-of-\d+\.jsonl\.zst|"
    r"(?:rejected/)?" + re.escape(storage.TEMPORARY_PREFIX) + r"[^/]*)$"
)


class EvalSetError(ValueError):
    """An evaluation set that cannot be made as asked: a bad name, no documents, another tokenizer than the
    tokens folder's, or an output that holds an earlier set."""


@dataclass(frozen=True)
class EvalInput:
    """The n-th input file (sorted) of a set: shard part-<n>."""

    index: int
    path: str
    source: str  # relative to the input root, as curate names it


def set_folder(output: str, name: str) -> str:
    """`<tokens>/eval/<name>`."""
    return storage.join(output, EVAL_DIR, name)


def check_name(name: str) -> None:
    if not NAME_PATTERN.match(name):
        raise EvalSetError(
            f"evaluation set name {name!r}: use letters, digits, '_', '.', '-' (it names a folder and a "
            "mixture's evaluation set)"
        )


def check_tokenizer(output: str, info: TokenizerInfo) -> None:
    """Refuse a tokenizer other than the one the tokens folder's counts.json was made with."""
    counts_path = storage.join(output, COUNTS)
    if not storage.exists(counts_path):
        return
    try:
        counts = token_files.read_counts(counts_path)
    except FormatError as error:
        raise EvalSetError(str(error)) from None
    if counts.tokenizer is not None and counts.tokenizer.sha256 != info.sha256:
        raise EvalSetError(
            f"{counts_path}: made with tokenizer sha256 {counts.tokenizer.sha256} ({counts.tokenizer.name}), "
            f"but --tokenizer has sha256 {info.sha256} ({info.name}): an evaluation set must use the run's "
            "tokenizer"
        )


def earlier_set_files(folder: str) -> list[str]:
    """Files of an earlier `tokenize-eval` of this set, relative to its folder."""
    return [name for name in storage.list_files(folder, relative=True) if _SET_FILE.match(name)]


def prepare_folder(folder: str, overwrite: bool, resume: bool) -> None:
    """Refuse a folder holding an earlier set unless --overwrite (delete it) or --resume (keep complete,
    verified shards); the manifest goes first either way, so an unfinished set is never read."""
    earlier = earlier_set_files(folder)
    if not earlier:
        return
    if not (overwrite or resume):
        raise EvalSetError(
            f"{folder} holds an earlier evaluation set ({len(earlier)} files); pass --resume to keep its "
            "complete, verified shards, or --overwrite to delete it first"
        )
    doomed = (
        earlier
        if overwrite
        else [
            name
            for name in earlier
            if name == MANIFEST or os.path.basename(name).startswith(storage.TEMPORARY_PREFIX)
        ]
    )
    for name in sorted(doomed, key=lambda name: name != MANIFEST):
        storage.remove_file(storage.join(folder, name))


def _rejected_path(folder: str, index: int, of: int) -> str:
    return storage.join(folder, REJECTED_DIR, f"part-{index:05d}-of-{of:05d}.jsonl.zst")


def tokenize_input(
    item: EvalInput,
    of: int,
    folder: str,
    name: str,
    tokenizer,
    info: TokenizerInfo,
    fields,
    root: str,
    batch_documents: int,
    max_record_bytes: int,
) -> EvalShardMarker:
    """One input file to part-<n>.bin/.idx/.bytes (and its rejected records), then its done marker."""
    from tokenmill.corpora.readers import read_file

    dtype = DTYPES[info.dtype]
    encode = _encoder(tokenizer)
    shard = shard_name(item.index)
    rejected: list[dict[str, Any]] = []
    documents = tokens = size = 0
    with (
        storage.atomic_write(storage.join(folder, shard + ".bin")) as bin_handle,
        storage.atomic_write(storage.join(folder, shard + ".idx")) as idx_handle,
        storage.atomic_write(storage.join(folder, shard + BYTES_SUFFIX)) as bytes_handle,
    ):
        sinks = [_HashingSink(handle) for handle in (bin_handle, idx_handle, bytes_handle)]
        eos = np.array([info.eos_id], dtype=dtype)

        def flush(texts: list[str]) -> None:
            nonlocal documents, tokens, size
            if not texts:
                return
            pieces: list[np.ndarray] = []
            ends = np.empty(len(texts), dtype=np.int64)
            length = 0
            for position, encoding in enumerate(encode(texts, add_special_tokens=False)):
                ids = np.array(encoding.ids, dtype=dtype)
                pieces += (ids, eos)
                length += len(ids) + 1
                ends[position] = length
            sizes = np.array([len(text.encode("utf-8")) for text in texts], dtype=INDEX_DTYPE)
            sinks[0].write(np.concatenate(pieces))
            sinks[1].write((ends + tokens).astype(INDEX_DTYPE))
            sinks[2].write(sizes)
            documents += len(texts)
            tokens += length
            size += int(sizes.sum())

        batch: list[str] = []
        for record in read_file(item.path, fields, root, max_record_bytes):
            if record["kind"] == "rejected":
                rejected.append(record)
                continue
            batch.append(record["text"])
            if len(batch) >= batch_documents:
                flush(batch)
                batch = []
        flush(batch)
    kinds = dict(sorted(Counter(record["error_kind"] for record in rejected).items()))
    if rejected:
        write_rejected(_rejected_path(folder, item.index, of), rejected)
        for record in rejected[:3]:
            log.warning("%s: rejected: %s", item.source, record["error"])
    marker = EvalShardMarker(
        name=shard,
        documents=documents,
        tokens=tokens,
        bytes=size,
        bin_sha256=sinks[0].digest.hexdigest(),
        idx_sha256=sinks[1].digest.hexdigest(),
        bytes_sha256=sinks[2].digest.hexdigest(),
        source_files=[item.source],
        format_version=FORMAT_VERSION,
        set=name,
        tokenizer_sha256=info.sha256,
        dtype=info.dtype,
        eos_id=info.eos_id,
        source_sha256=storage.file_sha256(item.path),
        fields=_fields(fields),
        rejected=kinds,
    )
    token_files.write_eval_marker(storage.join(folder, shard + DONE_SUFFIX), marker)
    return marker


def _fields(fields) -> dict[str, str | None]:
    return {"text": fields.text, "id": fields.id, "url": fields.url}


def make_eval_set(
    name: str,
    inputs: list[str],
    root: str,
    output: str,
    tokenizer,
    info: TokenizerInfo,
    fields,
    *,
    overwrite: bool = False,
    resume: bool = False,
    batch_documents: int = DEFAULT_BATCH_DOCUMENTS,
    max_record_bytes: int,
    on_file: Callable[[EvalShardMarker, bool], None] | None = None,
) -> EvalManifest:
    """Tokenize `inputs` (files, sorted) into `<output>/eval/<name>/`; returns the set's manifest.

    `on_file(marker, written)` is called after each input file (written False: kept on --resume).
    """
    check_name(name)
    check_tokenizer(output, info)
    folder = set_folder(output, name)
    storage.make_dirs(folder)
    prepare_folder(folder, overwrite, resume)
    from tokenmill.corpora.paths import relative_source

    items = [EvalInput(i, path, relative_source(path, root)) for i, path in enumerate(sorted(inputs))]
    stale = [
        entry
        for entry in earlier_set_files(folder)
        if entry.startswith("part-") and int(entry[5:].split(".", 1)[0]) >= len(items)
    ]
    if stale:
        raise EvalSetError(
            f"{folder} holds shards of an earlier set with more input files ({', '.join(stale[:3])}); pass "
            "--overwrite"
        )
    markers: list[EvalShardMarker] = []
    for item in items:
        expected = {
            "format_version": FORMAT_VERSION,
            "set": name,
            "tokenizer_sha256": info.sha256,
            "dtype": info.dtype,
            "eos_id": info.eos_id,
            "source_files": [item.source],
            "fields": _fields(fields),
        }
        marker_path = storage.join(folder, shard_name(item.index) + DONE_SUFFIX)
        marker = None
        if resume:
            checks = {**expected, "source_sha256": storage.file_sha256(item.path)}
            marker = _kept(folder, marker_path, checks, item.index, len(items))
        written = marker is None
        if marker is None:
            marker = tokenize_input(
                item,
                len(items),
                folder,
                name,
                tokenizer,
                info,
                fields,
                root,
                batch_documents,
                max_record_bytes,
            )
        markers.append(marker)
        if on_file is not None:
            on_file(marker, written)
    documents = sum(marker.documents for marker in markers)
    if documents == 0:
        rejected = sum(sum(marker.rejected.values()) for marker in markers)
        raise EvalSetError(
            f"evaluation set {name}: no documents in {len(items)} input files ({rejected} records rejected, "
            f"see {storage.join(folder, REJECTED_DIR)})"
        )
    rejected_kinds: Counter[str] = Counter()
    for marker in markers:
        rejected_kinds.update(marker.rejected)
    manifest = EvalManifest(
        format_version=FORMAT_VERSION,
        kind="external",
        name=name,
        tokenizer=TokenizerEntry(**info.manifest_entry()),
        dtype=info.dtype,
        eos_id=info.eos_id,
        documents=documents,
        tokens=sum(marker.tokens for marker in markers),
        bytes=sum(marker.bytes for marker in markers),
        shards=[marker.entry() for marker in markers],
        inputs=[item.source for item in items],
        rejected=dict(sorted(rejected_kinds.items())),
    )
    token_files.write_eval_manifest(storage.join(folder, MANIFEST), manifest)
    return manifest


def _kept(
    folder: str, marker_path: str, expected: dict[str, Any], index: int, of: int
) -> EvalShardMarker | None:
    """The shard's marker if the shard on disk is complete and verified for this input, else None."""
    if not storage.exists(marker_path):
        return None
    try:
        marker = token_files.read_eval_marker(marker_path)
    except (OSError, FormatError):
        return None
    if any(getattr(marker, key) != value for key, value in expected.items()):
        return None
    for suffix, recorded in (
        (".bin", marker.bin_sha256),
        (".idx", marker.idx_sha256),
        (BYTES_SUFFIX, marker.bytes_sha256),
    ):
        path = storage.join(folder, marker.name + suffix)
        if not storage.exists(path) or storage.file_sha256(path) != recorded:
            return None
    if marker.rejected and not storage.exists(_rejected_path(folder, index, of)):
        return None
    return marker
