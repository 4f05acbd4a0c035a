"""Decontamination against evaluation sets: the n-gram index and the `decontam` curation stage.

Training on the test set makes every published number worthless, so curation flags or removes documents
that contain evaluation records. Two halves, both here (docs/decontam.md explains the choices):

* `build_index` (`tokenmill decontam index`) reads evaluation sets (JSON Lines, the fields to match
  configurable per file), normalizes each record's text, and writes one file: a JSON header and sorted
  arrays of 64-bit hashes of every record's word n-grams (13 by default), with the record each came from.
  Records shorter than n words are indexed whole, so short items are not ignored.
* `Decontaminate` (recipe stage `decontam`) hashes every n-gram of a document, looks them up, and
  measures how much of each evaluation record the document holds, within each paragraph and across the
  whole document. The measure is relative to the record, not the page, so an item embedded in a long
  page is not diluted. Short records are found by an anchor (their last words) and confirmed whole.

Normalization (`normalize_for_matching`): Unicode NFC, lowercase, every run of characters that are not
letters or digits (punctuation, symbols, underscores, whitespace) becomes one space; words are what is
left between spaces. Hashing is vectorized with numpy: a polynomial hash of each word's UTF-8 bytes and
a polynomial hash of each window of word hashes, both computed from prefix sums mod 2**64 and finished
with a 64-bit mixer, so a window costs a few array operations whatever n is.
"""

from __future__ import annotations

import bisect
import gzip
import hashlib
import io
import json
import os
import re
import unicodedata
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokenmill import storage
from tokenmill.filters.base import DocumentStep, Removal

FORMAT_VERSION = 1
MAGIC = b"TMDECON\x00"
NORMALIZATION = "nfc-lower-nonword-v1"
HASHING = "poly64-fmix64-v1"
DEFAULT_N = 13
DEFAULT_FIELDS = ("question", "answer")
#: Short records (under n words) need at least this many words: a two-word answer matches everywhere.
DEFAULT_MIN_WORDS = 6
#: An n-gram found in this many distinct records of one set is a prompt template, not an item.
DEFAULT_TEMPLATE_RECORDS = 10
#: Bits of the membership bitmap per indexed hash: about 1/16 of clean n-grams reach the binary search.
BITMAP_BITS_PER_ENTRY = 16
EVAL_SUFFIXES = (".jsonl.gz", ".jsonl.zst", ".json.gz", ".json.zst", ".jsonl", ".json")

_NON_WORD = re.compile(r"[\W_]+")
_ASCII_NON_WORD = str.maketrans({chr(c): " " for c in range(128) if not chr(c).isalnum()})
_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n\s*")
_ALIGN = 64
# Odd multipliers, so that their powers are invertible mod 2**64 (windows are cut from prefix sums).
_BYTE_BASE = 0x9E3779B97F4A7C15
_WORD_BASE = 0xC2B2AE3D27D4EB4F
_LENGTH_SALT = np.uint64(0x165667B19E3779F9)
_MASK64 = (1 << 64) - 1
_MIX1 = np.uint64(0xFF51AFD7ED558CCD)
_MIX2 = np.uint64(0xC4CEB9FE1A85EC53)
_SHIFT = np.uint64(33)
# Documents are hashed in chunks of about this many bytes, which bounds the power tables below.
_CHUNK_BYTES = 1 << 20


class DecontamError(ValueError):
    """An evaluation file or index that cannot be used; the message names the file (and line)."""


# ---------------------------------------------------------------------------------------------- hashing


def normalize_for_matching(text: str) -> str:
    """NFC, lowercase, runs of non-letter/digit characters -> one space, stripped."""
    if text.isascii():  # the same result, a third faster: most text is ASCII
        return " ".join(text.lower().translate(_ASCII_NON_WORD).split())
    if not unicodedata.is_normalized("NFC", text):
        text = unicodedata.normalize("NFC", text)
    return _NON_WORD.sub(" ", text.lower()).strip()


def split_paragraphs(text: str) -> list[str]:
    """Paragraphs are separated by blank lines (lines holding only spaces or tabs count as blank)."""
    return _PARAGRAPH_BREAK.split(text)


class _Powers:
    """base**i and base**-i mod 2**64 for i < size, grown on demand and shared by the process."""

    def __init__(self, base: int):
        self.base = base
        self.inverse = pow(base, -1, 1 << 64)
        self.tables = (np.ones(0, np.uint64), np.ones(0, np.uint64))

    def get(self, size: int) -> tuple[np.ndarray, np.ndarray]:
        tables = self.tables  # one read: another thread may swap in bigger tables meanwhile
        if len(tables[0]) < size:
            size = max(size, 2 * len(tables[0]), 4096)
            tables = (_power_table(self.base, size), _power_table(self.inverse, size))
            self.tables = tables
        return tables


def _power_table(base: int, size: int) -> np.ndarray:
    table = np.full(size, base, dtype=np.uint64)
    table[0] = 1
    return np.cumprod(table, out=table)  # wraps mod 2**64, which is the arithmetic wanted


_BYTE_POWERS = _Powers(_BYTE_BASE)
_WORD_POWERS = _Powers(_WORD_BASE)


def _mix(values: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finalizer, in place: polynomial hashes have weak low bits without it."""
    values ^= values >> _SHIFT
    values *= _MIX1
    values ^= values >> _SHIFT
    values *= _MIX2
    values ^= values >> _SHIFT
    return values


def hash_words(units: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Word hashes of normalized, non-empty texts, concatenated; and the number of words in each text."""
    if not units:
        return np.zeros(0, np.uint64), np.zeros(0, np.int64)
    counts = np.fromiter((unit.count(" ") + 1 for unit in units), np.int64, len(units))
    data = np.frombuffer(" ".join(units).encode("utf-8"), np.uint8)
    forward, backward = _BYTE_POWERS.get(len(data) + 1)
    prefix = np.zeros(len(data) + 1, np.uint64)
    np.cumsum(data * forward[: len(data)], out=prefix[1:])
    # Normalized text has exactly one space between words and none at either end.
    spaces = np.flatnonzero(data == 32)
    starts = np.concatenate(([0], spaces + 1))
    ends = np.concatenate((spaces, [len(data)]))
    hashes = (prefix[ends] - prefix[starts]) * backward[starts]
    hashes += (ends - starts).astype(np.uint64) * _LENGTH_SALT
    return _mix(hashes), counts


def window_hashes(word_hashes: np.ndarray, length: int, prefix: np.ndarray | None = None) -> np.ndarray:
    """The hash of every run of `length` consecutive words (len(word_hashes) - length + 1 of them).

    `prefix` is `word_prefix(word_hashes)`, passed in when several lengths are hashed over the same words.
    """
    count = len(word_hashes) - length + 1
    if count <= 0:
        return np.zeros(0, np.uint64)
    if prefix is None:
        prefix = word_prefix(word_hashes)
    _, backward = _WORD_POWERS.get(len(word_hashes) + 1)
    hashes = (prefix[length:] - prefix[:count]) * backward[:count]
    hashes += np.uint64((length * int(_LENGTH_SALT)) & _MASK64)
    return _mix(hashes)


def word_prefix(word_hashes: np.ndarray) -> np.ndarray:
    """Prefix sums of word_hash[i] * base**i: any window's polynomial hash is a difference of two."""
    forward, _ = _WORD_POWERS.get(len(word_hashes) + 1)
    prefix = np.zeros(len(word_hashes) + 1, np.uint64)
    np.cumsum(word_hashes * forward[: len(word_hashes)], out=prefix[1:])
    return prefix


def text_hash(normalized: str) -> int:
    """The hash of a whole normalized text: equal to its window hash over all of its words."""
    words, _ = hash_words([normalized])
    return int(window_hashes(words, len(words))[0])


def extract_ngrams(texts: list[str], n: int = DEFAULT_N) -> list[np.ndarray]:
    """The n-gram hashes of each text (what the stage looks up): the baseline cost of decontamination."""
    units = [normalize_for_matching(text) for text in texts]
    words, counts = hash_words([unit for unit in units if unit])
    owner = np.repeat(np.arange(len(counts)), counts)
    hashes = window_hashes(words, n)
    valid = owner[: len(hashes)] == owner[n - 1 :] if len(hashes) else np.zeros(0, bool)
    starts = np.concatenate(([0], np.cumsum(counts)))
    result, position = [], 0
    for unit in units:
        if not unit:
            result.append(np.zeros(0, np.uint64))
            continue
        begin, end = starts[position], starts[position + 1] - n + 1
        result.append(hashes[begin:end][valid[begin:end]] if end > begin else np.zeros(0, np.uint64))
        position += 1
    return result


# ------------------------------------------------------------------------------------ evaluation files


@dataclass(frozen=True)
class FieldSpec:
    """Which fields of a record are its text: dotted paths into the JSON object; `?` marks optional."""

    paths: tuple[str, ...] = DEFAULT_FIELDS

    @classmethod
    def parse(cls, value: str) -> FieldSpec:
        paths = tuple(part.strip() for part in value.split(",") if part.strip())
        if not paths:
            raise DecontamError(f"no fields in {value!r}; give them as question,answer")
        return cls(paths)


@dataclass
class EvalSet:
    """One evaluation file: its name (the file name without extensions) and its records' texts."""

    name: str
    path: str
    fields: FieldSpec
    sha256: str = ""
    lines: int = 0
    texts: list[str] = field(default_factory=list)  # normalized record texts, in file order
    line_numbers: list[int] = field(default_factory=list)
    empty: int = 0


def eval_set_name(path: str) -> str:
    base = os.path.basename(path)
    for suffix in EVAL_SUFFIXES:
        if base.endswith(suffix):
            return base[: -len(suffix)]
    return base.rsplit(".", 1)[0] if "." in base else base


def _field_text(record: dict, dotted: str) -> str | None:
    """The text at a dotted path: a string, a number, or a list of them (joined); None when absent."""
    value: Any = record
    for key in dotted.split("."):
        if not isinstance(value, dict) or value.get(key) is None:
            return None
        value = value[key]
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str | int | float):
        return str(value)
    if isinstance(value, list) and all(isinstance(item, str | int | float) for item in value):
        return " ".join(str(item) for item in value)
    raise TypeError(type(value).__name__)


def _open_lines(path: str) -> Iterator[bytes]:
    with storage.open_file(path, "rb") as handle:
        data = handle.read()
    if path.endswith(".gz"):
        data = gzip.decompress(data)
    elif path.endswith(".zst"):
        import zstandard

        data = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data)).read()
    yield from data.split(b"\n")


def read_eval_set(path: str, fields: FieldSpec) -> EvalSet:
    """Read and check a whole evaluation file; any bad line is a DecontamError naming file and line."""
    eval_set = EvalSet(name=eval_set_name(path), path=path, fields=fields)
    digest = hashlib.sha256()
    for number, raw in enumerate(_open_lines(path), start=1):
        digest.update(raw + b"\n")
        if not raw.strip():
            continue
        eval_set.lines = number
        where = f"{path}:{number}"
        try:
            record = json.loads(raw)
        except UnicodeDecodeError:
            raise DecontamError(f"{where}: not valid UTF-8") from None
        except json.JSONDecodeError as error:
            raise DecontamError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
        if not isinstance(record, dict):
            raise DecontamError(f"{where}: expected a JSON object, got {type(record).__name__}")
        parts = []
        for path_spec in fields.paths:
            optional = path_spec.endswith("?")
            dotted = path_spec.rstrip("?")
            try:
                text = _field_text(record, dotted)
            except TypeError as error:
                raise DecontamError(f"{where}: field {dotted!r} is a {error}, not text") from None
            if text is None and not optional:
                raise DecontamError(
                    f"{where}: missing field {dotted!r} (this file's fields: {', '.join(fields.paths)}; "
                    f"choose others with --fields or --set-fields {eval_set.name}=FIELD,FIELD; "
                    "a trailing ? makes a field optional)"
                )
            if text:
                parts.append(text)
        normalized = normalize_for_matching(" ".join(parts))
        if not normalized:
            eval_set.empty += 1
            continue
        eval_set.texts.append(normalized)
        eval_set.line_numbers.append(number)
    eval_set.sha256 = digest.hexdigest()
    return eval_set


def read_eval_sets(
    paths: list[str], default_fields: FieldSpec | None = None, set_fields: dict[str, FieldSpec] | None = None
) -> list[EvalSet]:
    """Read every evaluation file; fails on the first bad line or on two files with the same set name."""
    default_fields = default_fields or FieldSpec()
    set_fields = dict(set_fields or {})
    by_name: dict[str, str] = {}
    for path in paths:
        name = eval_set_name(path)
        if name in by_name:
            raise DecontamError(f"{path} and {by_name[name]} are both evaluation set {name!r}; rename one")
        by_name[name] = path
    unknown = sorted(set(set_fields) - set(by_name))
    if unknown:
        raise DecontamError(
            f"--set-fields names no evaluation file: {', '.join(unknown)} "
            f"(sets: {', '.join(sorted(by_name))})"
        )
    return [read_eval_set(path, set_fields.get(eval_set_name(path), default_fields)) for path in paths]


# ---------------------------------------------------------------------------------------------- index


@dataclass
class DecontamIndex:
    """The loaded index: the header (docs/decontam.md) and its arrays (possibly memory-mapped)."""

    header: dict
    arrays: dict[str, np.ndarray]

    @property
    def n(self) -> int:
        return int(self.header["n"])

    @property
    def set_names(self) -> list[str]:
        return [entry["name"] for entry in self.header["sets"]]

    @property
    def short_lengths(self) -> list[int]:
        return [int(length) for length in self.header["short_lengths"]]

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
        start = -(-(len(MAGIC) + 8 + len(blob)) // _ALIGN) * _ALIGN
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
        """Read an index; local files are memory-mapped, so worker processes share the pages."""
        header, start = read_index_header(path)
        arrays: dict[str, np.ndarray] = {}
        local = storage.is_local(path)
        blob = None
        if not local:
            with storage.open_file(path, "rb") as handle:
                blob = handle.read()
        for name, entry in header["arrays"].items():
            dtype, length = np.dtype(entry["dtype"]), int(entry["length"])
            offset = start + int(entry["offset"])
            if length == 0:
                arrays[name] = np.zeros(0, dtype)
            elif local:
                # A plain ndarray over the mapping: memmap's own indexing is slower.
                arrays[name] = np.asarray(np.memmap(storage.local_path(path), dtype, "r", offset, (length,)))
            else:
                arrays[name] = np.frombuffer(blob, dtype, length, offset)
        return cls(header, arrays)


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
    start = -(-(len(MAGIC) + 8 + size) // _ALIGN) * _ALIGN
    if storage.is_local(path):
        actual = os.path.getsize(storage.local_path(path))
        if actual < start + header["data_bytes"]:
            raise DecontamError(
                f"{path}: truncated decontamination index ({actual} bytes, expected "
                f"{start + header['data_bytes']})"
            )
    return header, start


def _unique_pairs(hashes: np.ndarray, records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct (hash, record) pairs, sorted by hash then record (records come in ascending order)."""
    if not len(hashes):
        return hashes, records
    order = np.argsort(hashes, kind="stable")  # a radix sort; stable, so records stay ascending
    hashes, records = hashes[order], records[order]
    keep = np.ones(len(hashes), bool)
    keep[1:] = (hashes[1:] != hashes[:-1]) | (records[1:] != records[:-1])
    return hashes[keep], records[keep]


def _run_lengths(sorted_values: np.ndarray) -> np.ndarray:
    """The length of each run of equal values in a sorted array."""
    if not len(sorted_values):
        return np.zeros(0, np.int64)
    starts = np.flatnonzero(np.concatenate(([True], sorted_values[1:] != sorted_values[:-1])))
    return np.diff(np.append(starts, len(sorted_values)))


def _index_records(
    texts: list[str], first_record: int, n: int, min_words: int, chunk: int = 20_000
) -> tuple[list, list, np.ndarray]:
    """(n-gram hash, record) and (whole-text hash, record) arrays for records, and each one's word count."""
    ngram_parts, short_parts, words_per_record = [], [], []
    for begin in range(0, len(texts), chunk):
        words, counts = hash_words(texts[begin : begin + chunk])
        words_per_record.append(counts)
        owner = np.repeat(np.arange(len(counts)), counts)
        starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        prefix = word_prefix(words)
        hashes = window_hashes(words, n, prefix)
        if len(hashes):
            valid = owner[: len(hashes)] == owner[n - 1 :]
            ngram_parts.append((hashes[valid], (owner[: len(hashes)][valid] + begin + first_record)))
        # A short record is found by its anchor, the hash of its last `min_words` words (its end holds
        # the answer, so anchors are rarely shared), and confirmed by the hash of all of its words.
        anchors = window_hashes(words, min_words, prefix)
        for length in np.unique(counts[(counts >= min_words) & (counts < n)]):
            which = np.flatnonzero(counts == length)
            whole = window_hashes(words, int(length), prefix)[starts[which]]
            anchor = anchors[starts[which] + int(length) - min_words]
            short_parts.append((anchor, whole, which + begin + first_record, np.full(len(which), length)))
    return (
        ngram_parts,
        short_parts,
        np.concatenate(words_per_record) if words_per_record else np.zeros(0, int),
    )


def build_index(
    eval_sets: list[EvalSet],
    n: int = DEFAULT_N,
    min_words: int = DEFAULT_MIN_WORDS,
    template_records: int = DEFAULT_TEMPLATE_RECORDS,
) -> DecontamIndex:
    """Index the records of every set (each set's duplicate records once; template n-grams dropped)."""
    if not 2 <= n <= 1000:
        raise DecontamError(f"n must be between 2 and 1000, not {n}")
    if not 1 <= min_words <= n:
        raise DecontamError(f"min_words must be between 1 and n ({n}), not {min_words}")
    if template_records < 2:
        raise DecontamError(f"template_records must be at least 2, not {template_records}")
    sets_meta, lines, record_ngrams = [], [], []
    ngram_hash, ngram_record, short_parts_all = [], [], []
    short_lengths_seen: set[int] = set()
    first = 0
    for eval_set in eval_sets:
        texts, numbers, seen = [], [], set()
        for text, number in zip(eval_set.texts, eval_set.line_numbers, strict=True):
            if text not in seen:  # duplicates would make an item's own n-grams look like a template
                seen.add(text)
                texts.append(text)
                numbers.append(number)
        ngram_parts, short_parts, word_counts = _index_records(texts, first, n, min_words)
        hashes = np.concatenate([part[0] for part in ngram_parts]) if ngram_parts else np.zeros(0, np.uint64)
        records = np.concatenate([part[1] for part in ngram_parts]) if ngram_parts else np.zeros(0, np.int64)
        hashes, records = _unique_pairs(hashes, records)
        # An n-gram that many distinct records share is the set's prompt template: it names no item, and
        # any page that quotes the template would match every record.
        per_hash = _run_lengths(hashes)
        keep = np.repeat(per_hash < template_records, per_hash)
        templates = int((per_hash >= template_records).sum())
        hashes, records = hashes[keep], records[keep]
        counts = np.bincount(records - first, minlength=len(texts)).astype(np.uint32)
        ngram_hash.append(hashes)
        ngram_record.append(records)
        short_parts_all.extend(short_parts)
        short_lengths_seen.update(
            int(c) for c in np.unique(word_counts[(word_counts >= min_words) & (word_counts < n)])
        )
        long_records = int((word_counts >= n).sum())
        sets_meta.append(
            {
                "name": eval_set.name,
                "file": eval_set.path,
                "sha256": eval_set.sha256,
                "fields": list(eval_set.fields.paths),
                "first_record": first,
                "records": len(texts),
                "lines": eval_set.lines,
                "duplicates": len(eval_set.texts) - len(texts),
                "empty": eval_set.empty,
                "ngram_records": long_records,
                "short_records": int(((word_counts >= min_words) & (word_counts < n)).sum()),
                "too_short": int((word_counts < min_words).sum()),
                "template_only": int(((counts == 0) & (word_counts >= n)).sum()),
                "ngrams": int(len(hashes)),
                "template_ngrams": templates,
            }
        )
        lines.append(np.asarray(numbers, np.uint32))
        record_ngrams.append(counts)
        first += len(texts)
    ngram_hash_all, ngram_record_all = _sorted_by_hash(ngram_hash, ngram_record)
    # Short records sorted by anchor, with their whole-text hash, record and length alongside.
    columns = [np.zeros(0, np.uint64)] * 4
    if short_parts_all:
        columns = [np.concatenate([part[column] for part in short_parts_all]) for column in range(4)]
    order = np.argsort(columns[0], kind="stable")
    short_hash_all, short_whole, short_record, short_length = (column[order] for column in columns)
    short_lengths = sorted(short_lengths_seen)
    entries = len(ngram_hash_all) + len(short_hash_all)
    bits = min(33, max(16, int(np.ceil(np.log2(max(entries, 1) * BITMAP_BITS_PER_ENTRY)))))  # <= 1 GiB
    header = {
        "format_version": FORMAT_VERSION,
        "kind": "tokenmill-decontam-index",
        "n": n,
        "normalization": NORMALIZATION,
        "hashing": HASHING,
        "min_words": min_words,
        "template_records": template_records,
        "sets": sets_meta,
        "records": first,
        "short_lengths": short_lengths,
        "bitmap_bits": bits,
    }
    arrays = {
        "ngram_hash": ngram_hash_all.astype("<u8"),
        "ngram_record": ngram_record_all.astype("<u4"),
        "short_hash": short_hash_all.astype("<u8"),
        "short_whole": short_whole.astype("<u8"),
        "short_record": short_record.astype("<u4"),
        "short_length": short_length.astype("<u2"),
        "record_ngrams": (np.concatenate(record_ngrams) if record_ngrams else np.zeros(0)).astype("<u4"),
        "record_line": (np.concatenate(lines) if lines else np.zeros(0)).astype("<u4"),
        "bitmap": _bitmap(np.concatenate((ngram_hash_all, short_hash_all)), bits),
    }
    return DecontamIndex(header, arrays)


def _sorted_by_hash(hash_parts: list, record_parts: list) -> tuple[np.ndarray, np.ndarray]:
    if not hash_parts:
        return np.zeros(0, np.uint64), np.zeros(0, np.uint32)
    hashes = np.concatenate(hash_parts).astype(np.uint64)
    records = np.concatenate(record_parts).astype(np.uint32)
    order = np.argsort(hashes, kind="stable")  # parts come in ascending record order
    return hashes[order], records[order]


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


# ---------------------------------------------------------------------------------------------- stage


@dataclass
class _Match:
    """The best evidence that a document holds one record."""

    record: int
    overlap: float
    ngrams: int
    paragraph: int | None
    kind: str  # "ngrams" or "whole"


class Decontaminate(DocumentStep):
    """Flag or remove documents that hold evaluation records (recipe stage `decontam`).

    A long record (n words or more) is found when, among its indexed n-grams, at least `min_overlap` of
    them occur in one paragraph (n-grams are counted in the paragraph where they start), or
    `min_doc_overlap` of them across the whole document, or at least `min_ngrams` of them in one
    paragraph (a long passage quoted in part). A short record (`min_words` to n - 1 words) is found when
    its whole normalized text occurs. `action: remove` removes the document (reason `contaminated`);
    `action: flag` keeps it. Either way the document's `metadata` gets a `contamination` key naming the
    matched evaluation sets and, per set, the best-matching record.
    """

    stage = "decontam"

    def __init__(
        self,
        index: str,
        action: str = "remove",
        min_overlap: float = 0.2,
        min_doc_overlap: float = 0.5,
        min_ngrams: int = 30,
    ):
        if action not in ("remove", "flag"):
            raise ValueError(f"decontam action must be remove or flag, not {action!r}")
        for name, value in (("min_overlap", min_overlap), ("min_doc_overlap", min_doc_overlap)):
            if not 0 < value <= 1:
                raise ValueError(f"decontam {name} must be in (0, 1], not {value}")
        if min_ngrams < 1:
            raise ValueError(f"decontam min_ngrams must be at least 1, not {min_ngrams}")
        self.index_path = index
        self.action = action
        self.min_overlap = float(min_overlap)
        self.min_doc_overlap = float(min_doc_overlap)
        self.min_ngrams = int(min_ngrams)
        # Read (and check) the header now, so that a missing or stale index fails at recipe load.
        self.header, _ = read_index_header(index)
        self._index: DecontamIndex | None = None
        self._stats: dict = {}

    def __getstate__(self) -> dict:
        # Workers load the index themselves in setup(); a pickled step carries only its settings.
        keep = ("index_path", "action", "min_overlap", "min_doc_overlap", "min_ngrams", "header")
        return {**{name: self.__dict__[name] for name in keep}, "_index": None, "_stats": {}}

    def setup(self) -> None:
        index = DecontamIndex.load(self.index_path)
        self._index = index
        self._n = index.n
        self._min_words = int(index.header["min_words"])
        self._bits = int(index.header["bitmap_bits"])
        sets = index.header["sets"]
        self._names = [entry["name"] for entry in sets]
        self._set_starts = [int(entry["first_record"]) for entry in sets]
        a = index.arrays
        self._ngram_hash, self._ngram_record = a["ngram_hash"], a["ngram_record"]
        self._short_hash, self._short_whole = a["short_hash"], a["short_whole"]
        self._short_record, self._short_length = a["short_record"], a["short_length"]
        self._record_ngrams, self._record_line, self._bitmap = (
            a["record_ngrams"],
            a["record_line"],
            a["bitmap"],
        )

    # -- lookups

    def _candidates(self, queries: np.ndarray) -> np.ndarray:
        """Positions of queries whose bit is set in the bitmap (all indexed hashes pass; 1/16 of others)."""
        if not len(queries) or not len(self._bitmap):
            return np.zeros(0, np.int64)
        top = queries >> np.uint64(64 - self._bits)
        bits = self._bitmap[top >> np.uint64(3)] >> (top & np.uint64(7)).astype(np.uint8)
        return np.flatnonzero(bits & 1)

    @staticmethod
    def _find(sorted_hashes: np.ndarray, queries: np.ndarray, positions: np.ndarray):
        """(query position, index entry) for every entry equal to a query (an n-gram may be in records)."""
        if not len(positions) or not len(sorted_hashes):
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        wanted = queries[positions]
        # Sorted keys search several times faster: each search starts where the last one ended.
        order = np.argsort(wanted)
        positions, wanted = positions[order], wanted[order]
        left = np.searchsorted(sorted_hashes, wanted, "left")
        hit = sorted_hashes[np.minimum(left, len(sorted_hashes) - 1)] == wanted
        positions, left, wanted = positions[hit], left[hit], wanted[hit]
        # Only the hits (few) pay for the second search, which finds n-grams shared by several records.
        counts = np.searchsorted(sorted_hashes, wanted, "right") - left
        offsets = np.cumsum(counts) - counts
        entries = np.arange(int(counts.sum())) - np.repeat(offsets - left, counts)
        return np.repeat(positions, counts), entries

    # -- the step

    def apply(self, documents: list[dict]) -> list[Removal | None]:
        if self._index is None:
            self.setup()
        found: dict[int, dict[int, _Match]] = defaultdict(dict)  # document -> set -> best match
        for begin, end in self._chunks(documents):
            self._match_chunk(documents, begin, end, found)
        results: list[Removal | None] = []
        stats = self._stats
        stats["documents"] = stats.get("documents", 0) + len(documents)
        for position, document in enumerate(documents):
            matches = found.get(position)
            if not matches:
                results.append(None)
                continue
            names = sorted(self._names[s] for s in matches)
            described = [self._describe(s, matches[s]) for s in sorted(matches, key=lambda s: self._names[s])]
            overlap = max(match["overlap"] for match in described)
            _annotate(
                document,
                {"eval_sets": names, "overlap": overlap, "matches": described, "action": self.action},
            )
            stats["contaminated"] = stats.get("contaminated", 0) + 1
            by_set = stats.setdefault("eval_sets", {})
            for name in names:
                by_set[name] = {"documents": by_set.get(name, {}).get("documents", 0) + 1}
            if self.action == "remove":
                results.append(
                    Removal("contaminated", {"eval_sets": names, "overlap": overlap, "matches": described})
                )
            else:
                results.append(None)
        return results

    def drain_stats(self) -> dict:
        """Counts since the last call (documents, contaminated, eval_sets.<name>.documents), then reset.

        Numbers only, so that they sum across workers (tokenmill.pipelines.curate.merge_numbers).
        """
        stats, self._stats = self._stats, {}
        return stats

    def _chunks(self, documents: list[dict]) -> Iterator[tuple[int, int]]:
        begin, size = 0, 0
        for position, document in enumerate(documents):
            size += len(document["text"])
            if size >= _CHUNK_BYTES:
                yield begin, position + 1
                begin, size = position + 1, 0
        if begin < len(documents):
            yield begin, len(documents)

    def _match_chunk(self, documents: list[dict], begin: int, end: int, found: dict) -> None:
        units, unit_doc, unit_para = [], [], []
        for position in range(begin, end):
            for number, paragraph in enumerate(split_paragraphs(documents[position]["text"])):
                normalized = normalize_for_matching(paragraph)
                if normalized:
                    units.append(normalized)
                    unit_doc.append(position)
                    unit_para.append(number)
        if not units:
            return
        words, counts = hash_words(units)
        word_unit = np.repeat(np.arange(len(units)), counts)
        word_doc = np.asarray(unit_doc, np.int64)[word_unit]
        prefix = word_prefix(words)
        n = self._n
        # Long records: every n-gram of the document, attributed to the paragraph where it starts.
        grams = window_hashes(words, n, prefix)
        if len(grams):
            positions = self._candidates(grams)
            positions = positions[word_doc[positions] == word_doc[positions + n - 1]]
            at, entries = self._find(self._ngram_hash, grams, positions)
            if len(at):
                self._score_ngrams(
                    grams[at],
                    self._ngram_record[entries].astype(np.int64),
                    word_doc[at],
                    word_unit[at],
                    unit_doc,
                    unit_para,
                    found,
                )
        # Short records: one pass of anchor windows; each anchor hit is confirmed by the whole record's hash.
        anchor = self._min_words
        anchors = window_hashes(words, anchor, prefix)
        if not len(anchors) or not len(self._short_hash):
            return
        positions = self._candidates(anchors)
        positions = positions[word_doc[positions] == word_doc[positions + anchor - 1]]
        at, entries = self._find(self._short_hash, anchors, positions)
        lengths = self._short_length[entries].astype(np.int64)
        starts = at + anchor - lengths
        inside = starts >= 0
        at, entries, lengths, starts = at[inside], entries[inside], lengths[inside], starts[inside]
        inside = word_doc[starts] == word_doc[at]
        at, entries, lengths, starts = at[inside], entries[inside], lengths[inside], starts[inside]
        _, backward = _WORD_POWERS.get(len(prefix))
        whole = (prefix[starts + lengths] - prefix[starts]) * backward[starts]
        whole += lengths.astype(np.uint64) * _LENGTH_SALT
        confirmed = _mix(whole) == self._short_whole[entries]
        for start, entry in zip(starts[confirmed].tolist(), entries[confirmed].tolist(), strict=True):
            record = int(self._short_record[entry])
            paragraph = unit_para[word_unit[start]]
            self._offer(found, int(word_doc[start]), _Match(record, 1.0, 0, paragraph, "whole"))

    def _score_ngrams(self, hashes, records, docs, units, unit_doc, unit_para, found) -> None:
        # Distinct n-grams of each record per paragraph, then per document.
        per_unit = _count_distinct(units, records, hashes)
        per_doc = _count_distinct(docs, records, hashes)
        totals = self._record_ngrams
        for (unit, record), count in per_unit.items():
            overlap = count / max(int(totals[record]), 1)
            if overlap >= self.min_overlap or count >= self.min_ngrams:
                self._offer(
                    found, unit_doc[unit], _Match(record, min(overlap, 1.0), count, unit_para[unit], "ngrams")
                )
        for (document, record), count in per_doc.items():
            overlap = count / max(int(totals[record]), 1)
            if overlap >= self.min_doc_overlap:
                self._offer(found, document, _Match(record, min(overlap, 1.0), count, None, "ngrams"))

    def _offer(self, found: dict, document: int, match: _Match) -> None:
        eval_set = bisect.bisect_right(self._set_starts, match.record) - 1
        best = found[document].get(eval_set)
        if best is None or (match.overlap, match.ngrams, -match.record) > (
            best.overlap,
            best.ngrams,
            -best.record,
        ):
            found[document][eval_set] = match

    def _describe(self, eval_set: int, match: _Match) -> dict:
        return {
            "eval_set": self._names[eval_set],
            "line": int(self._record_line[match.record]),
            "overlap": round(match.overlap, 4),
            "ngrams": match.ngrams,
            "paragraph": match.paragraph,
            "match": match.kind,
        }


def _count_distinct(
    groups: np.ndarray, records: np.ndarray, hashes: np.ndarray
) -> dict[tuple[int, int], int]:
    """{(group, record): number of distinct hashes}, for hits only (few per clean document)."""
    order = np.lexsort((hashes, records, groups))
    groups, records, hashes = groups[order], records[order], hashes[order]
    same_pair = np.concatenate(([False], (groups[1:] == groups[:-1]) & (records[1:] == records[:-1])))
    distinct = ~(same_pair & np.concatenate(([False], hashes[1:] == hashes[:-1])))
    groups, records, new_pair = groups[distinct], records[distinct], ~same_pair[distinct]
    starts = np.flatnonzero(new_pair)
    counts = np.diff(np.append(starts, len(groups)))
    return {
        (int(group), int(record)): int(count)
        for group, record, count in zip(
            groups[starts].tolist(), records[starts].tolist(), counts.tolist(), strict=True
        )
    }


def _annotate(document: dict, contamination: dict) -> None:
    """Add `contamination` to the document's metadata JSON (re-serialized with sorted keys)."""
    raw = document.get("metadata")
    try:
        metadata = json.loads(raw) if raw else {}
    except (TypeError, json.JSONDecodeError):
        metadata = {"original_metadata": raw}
    if not isinstance(metadata, dict):
        metadata = {"original_metadata": metadata}
    metadata["contamination"] = contamination
    document["metadata"] = json.dumps(metadata, sort_keys=True, ensure_ascii=False, default=str)


def expand_eval_paths(patterns: Iterable[str]) -> list[str]:
    """Every file the patterns name, sorted and without repeats; a pattern matching nothing is an error."""
    files: list[str] = []
    for pattern in patterns:
        matches = storage.expand_glob(pattern)
        if not matches:
            raise DecontamError(f"--evals {pattern!r} matches no file")
        files.extend(matches)
    return sorted(dict.fromkeys(files))
