"""The decontamination index: what `tokenmill decontam index` writes and the `decontam` stage reads.

One file: a JSON header and arrays (docs/decontam.md has the byte layout). For every *long* record (at
least `long_words` words, 13 by default) it holds the record's words (32-bit hashes, to verify a
candidate alignment word by word) and an inverted index of its *anchors*, its distinct word 4-grams
(hash -> record, offset), through which a document finds the records it may hold. An anchor that
`template_records` distinct records of one set share is that set's prompt template or a stock phrase:
it finds no item, so it is dropped, and its words do not count towards a record's coverage. A *short*
record (`min_words` to `long_words` - 1 words) is found whole: by the hash of its last 4 words, confirmed
by the hash of all of them.

Memory at 10 TB on 1,000 workers: the index is independent of the corpus. It costs about 16 bytes per
anchor and 5 per word of the evaluation text (the reference's 1.6M records of about 60 words: 2 GB),
plus 2 bytes of membership bitmap per entry; each machine memory-maps one copy, shared by its workers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokenmill import storage
from tokenmill.filters.decontam.eval_sets import DecontamError, EvalSet
from tokenmill.filters.decontam.hashing import (
    HASHING,
    NORMALIZATION,
    hash_words,
    window_hashes,
    windows_at,
    word_prefix,
)

FORMAT_VERSION = 2
MAGIC = b"TMDECON\x00"
KIND = "tokenmill-decontam-index"
#: Records of at least this many words are matched edit-tolerantly; shorter ones whole.
DEFAULT_LONG_WORDS = 13
#: Words per anchor. Two words replaced in a 13-word item always leave two runs of 4 unreplaced words.
ANCHOR_WORDS = 4
#: Short records (under long_words) need at least this many words: a two-word answer matches everywhere.
DEFAULT_MIN_WORDS = 6
#: An anchor found in this many distinct records of one set is a prompt template, not an item.
DEFAULT_TEMPLATE_RECORDS = 10
#: An anchor shared by more records than this, across all sets, is dropped (a stock phrase of the suite).
MAX_ANCHOR_RECORDS = 64
#: Bits of the membership bitmap per indexed hash: about 1/16 of clean windows reach the binary search.
BITMAP_BITS_PER_ENTRY = 16
_ALIGN = 64


@dataclass
class DecontamIndex:
    """The loaded index: the header (docs/decontam.md) and its arrays (memory-mapped when loaded)."""

    header: dict
    arrays: dict[str, np.ndarray]
    #: Lookup structures built from the arrays once per loaded index, shared by every step copy holding it.
    derived: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def derive(self, name: str, build: Callable[[np.ndarray], Any]) -> Any:
        """`build(arrays[name])`, made once per loaded index (two threads may both build it, harmlessly)."""
        if name not in self.derived:
            self.derived[name] = build(self.arrays[name])
        return self.derived[name]

    def save(self, path: str) -> None:
        """Write the index atomically: magic, header length, JSON header, then 64-byte-aligned arrays."""
        layout, offset = {}, 0
        names = sorted(self.arrays)  # the order of the header's sorted keys, whatever the dict's
        for name in names:
            array = self.arrays[name]
            layout[name] = {"dtype": array.dtype.str, "offset": offset, "length": int(len(array))}
            offset += -(-array.nbytes // _ALIGN) * _ALIGN
        header = {**self.header, "arrays": layout, "data_bytes": offset}
        blob = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
        start = _data_start(len(blob))
        with storage.atomic_write(path, "wb") as handle:
            handle.write(MAGIC + len(blob).to_bytes(8, "little") + blob)
            handle.write(b"\x00" * (start - len(MAGIC) - 8 - len(blob)))
            for name in names:
                data = np.ascontiguousarray(self.arrays[name])
                handle.write(memoryview(data).cast("B"))  # no copy of what may be gigabytes
                handle.write(b"\x00" * (-data.nbytes % _ALIGN))
        self.header = header

    @classmethod
    def load(cls, path: str) -> DecontamIndex:
        """Read an index, memory-mapped so that the worker processes of a machine share its pages; a
        remote index (gs://...) is first downloaded once per machine (storage.local_copy)."""
        header, start = read_index_header(path)
        local = storage.local_copy(path)
        if not storage.is_local(path):  # read_index_header checks the size of local files only
            _check_size(path, os.path.getsize(local), start + header["data_bytes"])
        arrays: dict[str, np.ndarray] = {}
        for name, entry in header["arrays"].items():
            dtype, length = np.dtype(entry["dtype"]), int(entry["length"])
            offset = start + int(entry["offset"])
            if length == 0:
                arrays[name] = np.zeros(0, dtype)
            else:
                # A plain ndarray over the mapping: memmap's own indexing is slower.
                arrays[name] = np.asarray(np.memmap(local, dtype, "r", offset, (length,)))
        return cls(header, arrays)


def load_index(path: str) -> DecontamIndex:
    """`DecontamIndex.load`, as a module-level function (what a `SharedModel` pickles by reference)."""
    return DecontamIndex.load(path)


def _data_start(header_bytes: int) -> int:
    return -(-(len(MAGIC) + 8 + header_bytes) // _ALIGN) * _ALIGN


def _check_size(path: str, actual: int, expected: int) -> None:
    if actual < expected:
        raise DecontamError(f"{path}: truncated decontamination index ({actual} bytes, expected {expected})")


def read_index_header(path: str) -> tuple[dict, int]:
    """The header of an index file and where its arrays start; refuses other files and versions."""
    if not storage.exists(path):
        raise DecontamError(
            f"decontamination index not found: {path} (build it with `tokenmill decontam index`)"
        )
    with storage.open_file(path, "rb") as handle:
        head = handle.read(len(MAGIC) + 8)
        if len(head) < len(MAGIC) + 8 or head[: len(MAGIC)] != MAGIC:
            raise DecontamError(f"{path}: not a tokenmill decontamination index")
        size = int.from_bytes(head[len(MAGIC) :], "little")
        try:
            header = json.loads(handle.read(size))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise DecontamError(f"{path}: damaged decontamination index header") from None
    version = header.get("format_version")
    if version != FORMAT_VERSION:
        raise DecontamError(
            f"{path}: index format version {version}, but this tokenmill reads version "
            f"{FORMAT_VERSION}; rebuild it with `tokenmill decontam index`"
        )
    if header.get("normalization") != NORMALIZATION or header.get("hashing") != HASHING:
        raise DecontamError(
            f"{path}: index built with normalization {header.get('normalization')!r} and "
            f"hashing {header.get('hashing')!r}; this tokenmill uses {NORMALIZATION!r} and "
            f"{HASHING!r}; rebuild it"
        )
    start = _data_start(size)
    if storage.is_local(path):
        _check_size(path, os.path.getsize(storage.local_path(path)), start + header["data_bytes"])
    return header, start


# ---------------------------------------------------------------------------------------------- build


def _run_lengths(sorted_values: np.ndarray) -> np.ndarray:
    """The length of each run of equal values in a sorted array."""
    if not len(sorted_values):
        return np.zeros(0, np.int64)
    starts = np.flatnonzero(np.concatenate(([True], sorted_values[1:] != sorted_values[:-1])))
    return np.diff(np.append(starts, len(sorted_values)))


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The concatenation of range(start, start + length) for each pair."""
    total = int(lengths.sum())
    return np.repeat(starts - (np.cumsum(lengths) - lengths), lengths) + np.arange(total)


def _hash_records(
    texts: list[str], long_words: int, min_words: int, chunk: int = 20_000
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Word hashes and word counts of the texts; the hash of the 4-gram starting at each word (0 where
    fewer than 4 words of its text are left); and the hash of each short text, whole. Hashed in chunks of
    records, which bounds the prefix sums and power tables (8 bytes per byte of text)."""
    parts: list[tuple[np.ndarray, ...]] = []
    for begin in range(0, len(texts), chunk):
        words, counts = hash_words(texts[begin : begin + chunk])
        prefix = word_prefix(words)
        grams = np.zeros(len(words), np.uint64)
        windows = window_hashes(words, ANCHOR_WORDS, prefix)
        grams[: len(windows)] = windows
        starts = np.cumsum(counts) - counts
        ends = np.repeat(starts + counts, counts)
        grams[np.arange(len(words)) + ANCHOR_WORDS > ends] = 0  # windows that run into the next text
        short = (counts >= min_words) & (counts < long_words)
        wholes = np.zeros(len(counts), np.uint64)
        wholes[short] = windows_at(prefix, starts[short], counts[short])
        parts.append((words, counts, grams, wholes))
    if not parts:
        return np.zeros(0, np.uint64), np.zeros(0, np.int64), np.zeros(0, np.uint64), np.zeros(0, np.uint64)
    return tuple(np.concatenate([part[column] for part in parts]) for column in range(4))  # type: ignore[return-value]


@dataclass
class _SetArrays:
    """One set's share of the index, record numbers already global."""

    anchor_hash: np.ndarray
    anchor_record: np.ndarray
    anchor_offset: np.ndarray
    words: np.ndarray  # uint32 word hashes of the long records, concatenated
    counted: np.ndarray  # uint8 per word: 0 for template words
    record_words: np.ndarray  # per record: words stored (0 for short and skipped records)
    record_counted: np.ndarray  # per record: words that count towards coverage
    short: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # anchor, whole hash, record, length
    meta: dict


def _index_set(
    texts: list[str], first: int, long_words: int, min_words: int, template_records: int
) -> _SetArrays:
    """Anchors, words and short-record hashes of one set's distinct texts."""
    words, counts, grams, wholes = _hash_records(texts, long_words, min_words)
    starts = np.cumsum(counts) - counts
    is_long = counts >= long_words
    is_short = (counts >= min_words) & ~is_long
    long_records = np.flatnonzero(is_long)
    # Anchors: every 4-gram of a long record, once per (hash, record), at its first offset.
    gram_counts = counts[long_records] - ANCHOR_WORDS + 1
    owner = np.repeat(long_records, gram_counts)
    offset = _ranges(np.zeros(len(long_records), np.int64), gram_counts)
    gram_starts = starts[owner] + offset
    order = np.lexsort((offset, owner, grams[gram_starts]))
    hashes, owner, offset = grams[gram_starts][order], owner[order], offset[order]
    keep = np.ones(len(hashes), bool)
    keep[1:] = (hashes[1:] != hashes[:-1]) | (owner[1:] != owner[:-1])
    hashes, owner, offset = hashes[keep], owner[keep], offset[keep]
    # A 4-gram that many distinct records share is the set's prompt template or a stock phrase: it
    # names no item, and a page that quotes it would make every record a candidate.
    per_hash = _run_lengths(hashes)
    template = np.repeat(per_hash >= template_records, per_hash)
    # A word that only template 4-grams hold counts for nothing: finding it is no evidence of the item.
    distinctive = ~np.isin(grams[gram_starts], hashes[template])
    counted_all = np.zeros(len(words), np.uint8)
    for shift in range(ANCHOR_WORDS):
        counted_all[gram_starts[distinctive] + shift] = 1
    hashes, owner, offset = hashes[~template], owner[~template], offset[~template]
    positions = _ranges(starts[long_records], counts[long_records])
    counted = counted_all[positions]
    record_counted = np.zeros(len(texts), np.int64)
    if len(long_records):
        record_counted[long_records] = np.add.reduceat(
            counted.astype(np.int64), np.cumsum(counts[long_records]) - counts[long_records]
        )
    # Short records: the anchor is the last 4 words (their end holds the answer, so anchors are rarely
    # shared, while starts such as "what is the capital of" are), confirmed by the hash of all words.
    short_records = np.flatnonzero(is_short)
    lengths = counts[short_records]
    short_anchor = grams[starts[short_records] + lengths - ANCHOR_WORDS]
    short_whole = wholes[short_records]
    meta = {
        "records": len(texts),
        "long_records": len(long_records),
        "short_records": len(short_records),
        "too_short": int((counts < min_words).sum()),
        # Long records left with fewer counted words than a short record needs are nothing but template:
        # they cannot be told from it, so they are never matched.
        "template_only": int((is_long & (record_counted < min_words)).sum()),
        "anchors": len(hashes),
        "template_anchors": int((per_hash >= template_records).sum()),
        "words": len(positions),
    }
    record_counted[is_long & (record_counted < min_words)] = 0
    return _SetArrays(
        anchor_hash=hashes,
        anchor_record=(owner + first).astype(np.uint32),
        anchor_offset=offset.astype(np.uint32),
        words=words[positions].astype(np.uint32),  # the low 32 bits: they verify, they do not look up
        counted=counted,
        record_words=np.where(is_long, counts, 0).astype(np.uint32),
        record_counted=record_counted.astype(np.uint32),
        short=(
            short_anchor,
            short_whole,
            (short_records + first).astype(np.uint32),
            lengths.astype(np.uint16),
        ),
        meta=meta,
    )


def build_index(
    eval_sets: list[EvalSet],
    long_words: int = DEFAULT_LONG_WORDS,
    min_words: int = DEFAULT_MIN_WORDS,
    template_records: int = DEFAULT_TEMPLATE_RECORDS,
) -> DecontamIndex:
    """Index the records of every set (each set's duplicate records once; template anchors dropped)."""
    if not ANCHOR_WORDS + 1 <= long_words <= 1000:
        raise DecontamError(f"long_words must be between {ANCHOR_WORDS + 1} and 1000, not {long_words}")
    if not ANCHOR_WORDS <= min_words <= long_words:
        raise DecontamError(
            f"min_words must be between {ANCHOR_WORDS} and long_words ({long_words}), not {min_words}"
        )
    if template_records < 2:
        raise DecontamError(f"template_records must be at least 2, not {template_records}")
    parts: list[_SetArrays] = []
    sets_meta, files, lines = [], [], []
    first = 0
    for eval_set in eval_sets:
        texts, file_numbers, numbers, seen = [], [], [], set()
        for text, file_number, number in zip(
            eval_set.texts, eval_set.file_numbers, eval_set.line_numbers, strict=True
        ):
            if text not in seen:  # a duplicate would make an item's own anchors look like a template
                seen.add(text)
                texts.append(text)
                file_numbers.append(file_number)
                numbers.append(number)
        part = _index_set(texts, first, long_words, min_words, template_records)
        parts.append(part)
        sets_meta.append(
            {
                "name": eval_set.name,
                "layout": eval_set.layout,
                "fields": eval_set.resolved,
                "files": [{"path": f.path, "sha256": f.sha256, "rows": f.rows} for f in eval_set.files],
                "first_record": first,
                "duplicates": len(eval_set.texts) - len(texts),
                "empty": eval_set.empty,
                **part.meta,
            }
        )
        files.append(np.asarray(file_numbers, np.uint32))
        lines.append(np.asarray(numbers, np.uint32))
        first += len(texts)

    def joined(name: str, dtype: str) -> np.ndarray:
        values = [getattr(part, name) for part in parts]
        return (np.concatenate(values) if values else np.zeros(0)).astype(dtype)

    anchor_hash = joined("anchor_hash", "<u8")
    order = np.argsort(anchor_hash, kind="stable")  # parts come in ascending record order
    # An anchor that many records of many sets share is a stock phrase of the whole suite: a page that
    # repeats it would make each of its words a candidate for all of those records.
    per_hash = _run_lengths(anchor_hash[order])
    order = order[np.repeat(per_hash <= MAX_ANCHOR_RECORDS, per_hash)]
    short = [
        np.concatenate([part.short[column] for part in parts]) if parts else np.zeros(0)
        for column in range(4)
    ]
    short_order = np.argsort(short[0], kind="stable")
    record_words = joined("record_words", "<u8")
    arrays = {
        "anchor_hash": anchor_hash[order],
        "anchor_record": joined("anchor_record", "<u4")[order],
        "anchor_offset": joined("anchor_offset", "<u4")[order],
        "words": joined("words", "<u4"),
        "counted": joined("counted", "u1"),
        "record_start": np.concatenate(([0], np.cumsum(record_words))).astype("<u8"),
        "record_counted": joined("record_counted", "<u4"),
        "record_file": (np.concatenate(files) if files else np.zeros(0)).astype("<u4"),
        "record_line": (np.concatenate(lines) if lines else np.zeros(0)).astype("<u4"),
        "short_hash": short[0][short_order].astype("<u8"),
        "short_whole": short[1][short_order].astype("<u8"),
        "short_record": short[2][short_order].astype("<u4"),
        "short_length": short[3][short_order].astype("<u2"),
    }
    entries = len(arrays["anchor_hash"]) + len(arrays["short_hash"])
    bits = min(33, max(16, int(np.ceil(np.log2(max(entries, 1) * BITMAP_BITS_PER_ENTRY)))))  # <= 1 GiB
    arrays["bitmap"] = _bitmap(np.concatenate((arrays["anchor_hash"], arrays["short_hash"])), bits)
    header = {
        "format_version": FORMAT_VERSION,
        "kind": KIND,
        "normalization": NORMALIZATION,
        "hashing": HASHING,
        "long_words": long_words,
        "anchor_words": ANCHOR_WORDS,
        "min_words": min_words,
        "template_records": template_records,
        "records": first,
        "common_anchors": int((per_hash > MAX_ANCHOR_RECORDS).sum()),
        "sets": sets_meta,
        "bitmap_bits": bits,
    }
    return DecontamIndex(header, arrays)


def _bitmap(hashes: np.ndarray, bits: int) -> np.ndarray:
    """A one-hash Bloom filter over the top `bits` bits of each hash: most clean lookups end here."""
    bitmap = np.zeros(1 << max(bits - 3, 0), np.uint8)
    if len(hashes):
        positions = np.sort(hashes >> np.uint64(64 - bits))
        positions = positions[np.concatenate(([True], positions[1:] != positions[:-1]))]
        byte = positions >> np.uint64(3)
        value = (np.uint8(1) << (positions & np.uint64(7)).astype(np.uint8)).astype(np.uint8)
        boundaries = np.flatnonzero(np.concatenate(([True], byte[1:] != byte[:-1])))
        bitmap[byte[boundaries]] = np.bitwise_or.reduceat(value, boundaries)
    return bitmap
