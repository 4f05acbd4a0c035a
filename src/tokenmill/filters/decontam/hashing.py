"""Text normalization and the vectorized word and window hashes that decontamination matches on.

Normalization (`normalize_for_matching`): Unicode NFC, lowercase, every run of characters that are not
letters or digits (punctuation, symbols, underscores, whitespace) becomes one space; words are what is
left between spaces. So case and punctuation never hide an evaluation item.

Hashing is vectorized with numpy: a polynomial hash of each word's UTF-8 bytes and a polynomial hash of
each window of word hashes, both computed from prefix sums mod 2**64 and finished with a 64-bit mixer,
so a window costs a few array operations whatever its length. The hashes are pinned by a test: an index
built on one machine must match documents on another.

Memory: a chunk of text costs about 40 bytes per byte of text in temporary arrays (prefix sums, power
tables, hashes); callers hash documents in chunks of about a megabyte.
"""

from __future__ import annotations

import re
import unicodedata

import numpy as np

NORMALIZATION = "nfc-lower-nonword-v1"
HASHING = "poly64-fmix64-v1"
#: The n of the reference run's n-gram decontamination (`extract_ngrams`, the speed baseline).
DEFAULT_N = 13

_NON_WORD = re.compile(r"[\W_]+")
_ASCII_NON_WORD = str.maketrans({chr(c): " " for c in range(128) if not chr(c).isalnum()})
# Odd multipliers, so that their powers are invertible mod 2**64 (windows are cut from prefix sums).
_BYTE_BASE = 0x9E3779B97F4A7C15
_WORD_BASE = 0xC2B2AE3D27D4EB4F
LENGTH_SALT = np.uint64(0x165667B19E3779F9)
_MASK64 = (1 << 64) - 1
_MIX1 = np.uint64(0xFF51AFD7ED558CCD)
_MIX2 = np.uint64(0xC4CEB9FE1A85EC53)
_SHIFT = np.uint64(33)


def normalize_for_matching(text: str) -> str:
    """NFC, lowercase, runs of non-letter/digit characters -> one space, stripped."""
    if text.isascii():  # the same result, a third faster: most text is ASCII
        return " ".join(text.lower().translate(_ASCII_NON_WORD).split())
    if not unicodedata.is_normalized("NFC", text):
        text = unicodedata.normalize("NFC", text)
    return _NON_WORD.sub(" ", text.lower()).strip()


def count_words(text: str) -> int:
    """The number of words `normalize_for_matching(text)` has, without building it."""
    if text.isascii():
        return len(text.translate(_ASCII_NON_WORD).split())
    return len(_NON_WORD.sub(" ", unicodedata.normalize("NFC", text)).split())


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
WORD_POWERS = _Powers(_WORD_BASE)


def mix(values: np.ndarray) -> np.ndarray:
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
    hashes += (ends - starts).astype(np.uint64) * LENGTH_SALT
    return mix(hashes), counts


def window_hashes(word_hashes: np.ndarray, length: int, prefix: np.ndarray | None = None) -> np.ndarray:
    """The hash of every run of `length` consecutive words (len(word_hashes) - length + 1 of them).

    `prefix` is `word_prefix(word_hashes)`, passed in when several lengths are hashed over the same words.
    """
    count = len(word_hashes) - length + 1
    if count <= 0:
        return np.zeros(0, np.uint64)
    if prefix is None:
        prefix = word_prefix(word_hashes)
    _, backward = WORD_POWERS.get(len(word_hashes) + 1)
    hashes = (prefix[length:] - prefix[:count]) * backward[:count]
    hashes += np.uint64((length * int(LENGTH_SALT)) & _MASK64)
    return mix(hashes)


def windows_at(prefix: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The hash of the window of `lengths[i]` words from word `starts[i]`, for each i (any lengths):
    equal to `window_hashes(words, length)[start]`."""
    _, backward = WORD_POWERS.get(len(prefix))
    hashes = (prefix[starts + lengths] - prefix[starts]) * backward[starts]
    hashes += lengths.astype(np.uint64) * LENGTH_SALT
    return mix(hashes)


def word_prefix(word_hashes: np.ndarray) -> np.ndarray:
    """Prefix sums of word_hash[i] * base**i: any window's polynomial hash is a difference of two."""
    forward, _ = WORD_POWERS.get(len(word_hashes) + 1)
    prefix = np.zeros(len(word_hashes) + 1, np.uint64)
    np.cumsum(word_hashes * forward[: len(word_hashes)], out=prefix[1:])
    return prefix


def text_hash(normalized: str) -> int:
    """The hash of a whole normalized text: equal to its window hash over all of its words."""
    words, _ = hash_words([normalized])
    return int(window_hashes(words, len(words))[0])


def extract_ngrams(texts: list[str], n: int = DEFAULT_N) -> list[np.ndarray]:
    """The n-gram hashes of each text: what 13-gram decontamination must compute, the stage's speed
    baseline (bench/decontam.py)."""
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
