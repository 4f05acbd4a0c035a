"""MinHash signatures and LSH band keys over word n-grams, vectorized with numpy (no Beam here).

What the fuzzy dedupe stage (tokenmill.pipelines.fuzzy_dedupe) compares documents with, kept apart from
Beam so that the bench, the tests and any other tool compute the very same signatures.

Text -> words: lowercased; a word is a maximal run of letters and digits (`str.isalnum`, the regex `\\w`
without `_`); everything else (spaces, punctuation, symbols) separates words. The split runs on the
text's UTF-8 bytes in numpy: comparisons for ASCII, and for other characters their code points, decoded
in numpy and looked up in a table of all of Unicode. Words are never built as Python strings.

Words -> 64-bit word hashes, without a Python call per word: each word is read as 8-byte little-endian
chunks straight out of the text's bytes, every chunk (xor its index times a constant) is mixed with the
murmur3 64-bit finalizer, a bijection, so words of up to 8 bytes never collide; the chunks of a word are
summed and mixed once more with the word's length.

Words -> shingles: the 64-bit hash of each run of `ngram` consecutive words of a document is the
finalized sum of the word hashes times a fixed odd constant per position. A document with fewer than
`ngram` words (but at least one) has one shingle made from all its words; an empty one has none, gets no
signature, and is never a candidate.

Shingles -> signature: `bands * rows` permutations h_j(x) = a_j * x + b_j (mod 2^64, a_j odd, so each is
a bijection of the 64-bit shingle hashes), drawn from numpy's PCG64 with the configured seed, so that
every worker and every rerun draws the same ones. The signature keeps the top 32 bits of each minimum:
min(h_j(S)) >> 32, an order-preserving cut, so equal signature values mean equal minima up to a 2^-32
chance. A batch of documents is one (permutations x shingles) product, computed in blocks of bounded
size and reduced per document with `np.minimum.reduceat`, so a long document costs memory in proportion
to the block, not to its length.

Signature -> LSH band keys: band i is the bytes of rows [i*rows, (i+1)*rows) of the signature, prefixed
with i; two documents are candidates when any band key is equal (the same banding as datasketch's
MinHashLSH). The probability that a pair with Jaccard similarity s collides in some band is
1 - (1 - s^rows)^bands; with the defaults (14 bands x 8 rows, as datatrove and FineWeb use) it is 50% at
s = 0.68 (the rule of thumb (1/bands)^(1/rows) says 0.72), 77% at 0.75, 92% at 0.8 and 99.96% at 0.9.

Candidate pairs -> verdicts: the fraction of equal rows of two signatures estimates their Jaccard
similarity (unbiased, standard deviation sqrt(J(1-J)/num_perm): 0.04 at J = 0.8 with 112 rows).
Verification compares compact signatures (the top 16 bits of each row, `compact_signatures`), corrects
for their chance agreements (`estimated_jaccard_from_agreement`), and estimates containment from that
and the two documents' numbers of distinct shingles (`distinct_counts`, `containment_from_jaccard`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

_U64 = np.uint64
_MIX1 = _U64(0xFF51AFD7ED558CCD)
_MIX2 = _U64(0xC4CEB9FE1A85EC53)
_S33 = _U64(33)
_S32 = _U64(32)
_GOLDEN = _U64(0x9E3779B97F4A7C15)
_LENGTH_SALT = _U64(0xD6E8FEB86659FD93)
# Odd multipliers for the word positions inside a shingle (fixed: they define the shingle hash).
_POSITION_MULTIPLIERS = np.array(
    [
        0x9E3779B97F4A7C15,
        0xBF58476D1CE4E5B9,
        0x94D049BB133111EB,
        0xD6E8FEB86659FD93,
        0xA0761D6478BD642F,
        0xE7037ED1A0B428DB,
        0x8EBC6AF09C88C6E3,
        0x589965CC75374CC3,
        0x1D8E4E27C47D124F,
        0xC2B2AE3D27D4EB4F,
        0x165667B19E3779F9,
        0x27D4EB2F165667C5,
        0x85EBCA77C2B2AE63,
        0xFF51AFD7ED558CCD,
        0xC4CEB9FE1A85EC53,
        0x2545F4914F6CDD1D,
    ],
    dtype=np.uint64,
)
MAX_NGRAM = len(_POSITION_MULTIPLIERS)

_WORD_CODE_POINTS: np.ndarray | None = None
# _LOW_BYTES[k]: a mask of the k lowest bytes of a 64-bit chunk (the part of a chunk inside its word).
_LOW_BYTES = np.array([(1 << (8 * k)) - 1 for k in range(8)] + [(1 << 64) - 1], dtype=np.uint64)
#: Shingle rows per block of the (permutations x shingles) product: 112 x 8,192 uint64 is 7.3 MB. Half
#: of 16,384 was 10-15% faster here (the add and the minimum re-read less of the block from memory);
#: much smaller blocks pay numpy's per-call cost more often (4,096 and below were slower).
BLOCK_ROWS = 8192


def fmix64(values: np.ndarray) -> np.ndarray:
    """murmur3's 64-bit finalizer, elementwise (a bijection of uint64 that spreads every bit)."""
    values = values ^ (values >> _S33)
    values *= _MIX1
    values ^= values >> _S33
    values *= _MIX2
    values ^= values >> _S33
    return values


_WORD = re.compile(r"[^\W_]+")


def words(text: str) -> list[str]:
    """The words that shingles are made of, as strings (the hashing below never builds them)."""
    return _WORD.findall(text.lower())


def _word_code_points() -> np.ndarray:
    """Which Unicode code points are word characters (str.isalnum: regex `\\w` without `_`); built once."""
    global _WORD_CODE_POINTS
    if _WORD_CODE_POINTS is None:
        _WORD_CODE_POINTS = np.fromiter((chr(c).isalnum() for c in range(0x110000)), bool, 0x110000)
    return _WORD_CODE_POINTS


def _separators(data: np.ndarray) -> np.ndarray:
    """True for each byte of UTF-8 `data` that belongs to a character that is not a word character.

    ASCII by comparisons (letters, digits; a byte of 0x80 or more belongs to a multi-byte character);
    multi-byte characters are decoded to code points in numpy and looked up in a table of every code
    point, so that text outside ASCII costs no Python per character either.
    """
    folded = data | np.uint8(0x20)  # ASCII upper case to lower case (and nothing else into a-z)
    word = (folded >= 0x61) & (folded <= 0x7A)
    word |= (data >= 0x30) & (data <= 0x39)
    word |= data >= 0x80
    separator = ~word
    leads = np.flatnonzero(data >= 0xC0)  # the first byte of every multi-byte character
    if len(leads) == 0:
        return separator
    padded = np.concatenate([data, np.zeros(3, np.uint8)]).astype(np.uint32)
    b0, b1, b2, b3 = (padded[leads + k] for k in range(4))
    length = np.where(b0 < 0xE0, 2, np.where(b0 < 0xF0, 3, 4))
    code = np.where(
        length == 2,
        ((b0 & 0x1F) << 6) | (b1 & 0x3F),
        np.where(
            length == 3,
            ((b0 & 0x0F) << 12) | ((b1 & 0x3F) << 6) | (b2 & 0x3F),
            ((b0 & 0x07) << 18) | ((b1 & 0x3F) << 12) | ((b2 & 0x3F) << 6) | (b3 & 0x3F),
        ),
    )
    not_word = ~_word_code_points()[np.minimum(code, 0x10FFFF)]
    for offset in range(4):
        marked = leads[not_word & (length > offset)] + offset
        separator[marked] = True
    return separator


def _read_u64(padded: np.ndarray, offsets: np.ndarray, remaining: np.ndarray) -> np.ndarray:
    """The little-endian 8 bytes at each offset (unaligned reads), with bytes past `remaining` zeroed."""
    view = np.ndarray((len(padded) - 7,), dtype="<u8", buffer=padded, offset=0, strides=(1,))
    return view[offsets].astype(np.uint64, copy=False) & _LOW_BYTES[np.minimum(remaining, 8)]


def _word_hashes(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(64-bit hash per word, byte offset where each word starts) for the UTF-8 bytes of lowercased text.

    A word's hash is fmix64(sum over its 8-byte chunks c_k of fmix64(c_k ^ k * golden) ^ length * salt).
    """
    inside = np.zeros(len(data) + 2, bool)
    np.logical_not(_separators(data), out=inside[1:-1])
    boundaries = np.flatnonzero(inside[1:] != inside[:-1])  # (bool, not int8: numpy's fast path)
    if len(boundaries) == 0:
        return np.empty(0, np.uint64), np.empty(0, np.int64)
    starts, ends = boundaries[0::2], boundaries[1::2]  # a word starts, ends, the next starts, ...
    lengths = ends - starts
    # The text is padded so that an 8-byte read at any byte stays inside.
    padded = np.concatenate([data, np.zeros(8, np.uint8)])
    per_word = fmix64(_read_u64(padded, starts, lengths))  # chunk 0 of every word
    long_words = np.flatnonzero(lengths > 8)
    if len(long_words):  # the rare words of more than 8 bytes: their further chunks, word by word
        extra = (lengths[long_words] + 7) // 8 - 1
        first = np.zeros(len(long_words), np.int64)
        np.cumsum(extra[:-1], out=first[1:])
        owner = np.repeat(np.arange(len(long_words)), extra)
        index = np.arange(int(extra.sum())) - first[owner] + 1
        offsets = starts[long_words][owner] + 8 * index
        values = _read_u64(padded, offsets, ends[long_words][owner] - offsets)
        mixed = fmix64(values ^ (index.astype(np.uint64) * _GOLDEN))
        per_word[long_words] += np.add.reduceat(mixed, first)
    return fmix64(per_word ^ (lengths.astype(np.uint64) * _LENGTH_SALT)), starts


class MinHasher:
    """Word n-gram shingles, MinHash signatures and LSH band keys with fixed, seeded parameters."""

    def __init__(self, ngram: int = 5, bands: int = 14, rows: int = 8, seed: int = 1):
        if not 1 <= ngram <= MAX_NGRAM:
            raise ValueError(f"ngram must be in 1..{MAX_NGRAM}, got {ngram}")
        if not (1 <= bands < 1 << 16 and rows >= 1):
            raise ValueError(f"bands (below 65,536) and rows must be positive, got {bands} x {rows}")
        self.ngram = ngram
        self.bands = bands
        self.rows = rows
        self.seed = seed
        generator = np.random.Generator(np.random.PCG64(seed))
        self.a = generator.integers(0, 1 << 64, self.num_perm, dtype=np.uint64, endpoint=False) | _U64(1)
        self.b = generator.integers(0, 1 << 64, self.num_perm, dtype=np.uint64, endpoint=False)
        self._band_prefixes = [band.to_bytes(2, "big") for band in range(bands)]

    @property
    def num_perm(self) -> int:
        return self.bands * self.rows

    def shingle_batch(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Shingle hashes of many texts: (uint64 hashes in document order, offsets of length len(texts)+1)."""
        encoded = [text.lower().encode("utf-8", "surrogatepass") for text in texts]
        byte_offsets = np.zeros(len(encoded) + 1, np.int64)
        np.cumsum([len(data) + 1 for data in encoded], out=byte_offsets[1:])
        # One space after each text: words never run from one document into the next.
        data = np.frombuffer(b" ".join(encoded) + b" ", np.uint8)
        word_hashes, word_starts = _word_hashes(data)
        word_document = np.searchsorted(byte_offsets, word_starts, side="right") - 1
        count = len(word_hashes)
        n = self.ngram
        words_per_document = np.bincount(word_document, minlength=len(texts))
        first_word = np.zeros(len(texts), np.int64)
        np.cumsum(words_per_document[:-1], out=first_word[1:])
        # Sums over every run of n words of the whole batch; the runs that cross a document boundary
        # are dropped below. A full shingle starts where its n-th word is in the same document.
        sums = np.zeros(count, np.uint64)
        full = np.zeros(count, bool)
        if count >= n:
            runs = count - n + 1
            sums[:runs] = word_hashes[:runs] * _POSITION_MULTIPLIERS[0]
            for k in range(1, n):
                sums[:runs] += word_hashes[k : k + runs] * _POSITION_MULTIPLIERS[k]
            full[:runs] = word_document[n - 1 :] == word_document[:runs]
        # A document with fewer than n words (but some) has one shingle at its first word: all its words.
        short = np.flatnonzero((words_per_document > 0) & (words_per_document < n))
        if len(short):
            starts, lengths = first_word[short], words_per_document[short]
            partial = word_hashes[starts] * _POSITION_MULTIPLIERS[0]
            for k in range(1, n - 1):
                present = lengths > k
                partial[present] += word_hashes[starts[present] + k] * _POSITION_MULTIPLIERS[k]
            sums[starts] = partial
            full[starts] = True
        selected = np.flatnonzero(full)
        shingles = fmix64(sums[selected])
        offsets = np.zeros(len(texts) + 1, np.int64)
        np.cumsum(np.bincount(word_document[selected], minlength=len(texts)), out=offsets[1:])
        return shingles, offsets

    def shingles(self, text: str) -> np.ndarray:
        """The distinct shingle hashes of one text, sorted (what Jaccard and containment are computed on)."""
        hashes, _ = self.shingle_batch([text])
        return np.unique(hashes)

    def signatures(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """(uint32 signatures, shape (len(texts), num_perm), bool: has at least one shingle) for a batch."""
        shingles, offsets = self.shingle_batch(texts)
        return self.signatures_from_shingles(shingles, offsets)

    def signatures_from_shingles(
        self, shingles: np.ndarray, offsets: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Signatures from shingle hashes grouped by document (offsets as `shingle_batch` returns them)."""
        documents = len(offsets) - 1
        present = offsets[1:] > offsets[:-1]
        # Permutations x shingles, so that each permutation's values are contiguous for the reduction.
        minima = np.full((self.num_perm, documents), np.iinfo(np.uint64).max, np.uint64)
        # Only documents with shingles take part: reduceat cannot express an empty segment.
        starts = offsets[:-1][present]
        columns_of = np.flatnonzero(present)
        total = len(shingles)
        block = np.empty((self.num_perm, min(BLOCK_ROWS, max(total, 1))), np.uint64)
        a = self.a[:, None]
        b = self.b[:, None]
        for low in range(0, total, BLOCK_ROWS):
            high = min(total, low + BLOCK_ROWS)
            first = np.searchsorted(starts, low, side="right") - 1
            last = np.searchsorted(starts, high - 1, side="right") - 1
            segment_starts = np.maximum(starts[first : last + 1], low) - low
            view = block[:, : high - low]
            np.multiply(a, shingles[None, low:high], out=view)
            np.add(view, b, out=view)
            part = np.minimum.reduceat(view, segment_starts, axis=1)
            target = columns_of[first : last + 1]
            minima[:, target] = np.minimum(minima[:, target], part)
        return np.ascontiguousarray((minima >> _S32).astype(np.uint32).T), present

    def band_keys(self, signature: np.ndarray) -> list[bytes]:
        """The LSH key of each band of one signature: the band's number, then its rows' bytes."""
        raw = np.ascontiguousarray(signature, dtype="<u4").tobytes()
        width = 4 * self.rows
        return [
            prefix + raw[band * width : (band + 1) * width] for band, prefix in enumerate(self._band_prefixes)
        ]


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """|A & B| / |A | B| of two sorted arrays of distinct shingle hashes (1.0 for two empty sets)."""
    if len(a) == 0 and len(b) == 0:
        return 1.0
    common = len(np.intersect1d(a, b, assume_unique=True))
    return common / (len(a) + len(b) - common)


def containment(part: np.ndarray, whole: np.ndarray) -> float:
    """|A & B| / |A|: how much of `part`'s shingles appear in `whole` (1.0 when `part` has none)."""
    if len(part) == 0:
        return 1.0
    return len(np.intersect1d(part, whole, assume_unique=True)) / len(part)


#: Bits of each signature row that verification compares (b-bit minwise hashing, Li and König 2010): the
#: top 16 of the 32. Two rows whose minima differ agree on them with chance 2^-16, which
#: `estimated_jaccard_from_agreement` corrects for.
COMPACT_BITS = 16


def compact_signatures(signatures: np.ndarray) -> np.ndarray:
    """The top `COMPACT_BITS` bits of each signature row, as uint16: half the bytes to carry, and the same
    estimate of Jaccard similarity but for a 2^-16 chance per row of a false agreement."""
    return (np.asarray(signatures, np.uint32) >> np.uint32(32 - COMPACT_BITS)).astype(np.uint16)


def estimated_jaccard_from_agreement(equal_rows: np.ndarray | int, num_perm: int) -> np.ndarray:
    """The Jaccard estimate from the number of equal rows of two compact signatures: the fraction of
    equal rows, less the chance 2^-COMPACT_BITS that two different minima agree on their top bits."""
    chance = 2.0**-COMPACT_BITS
    agreement = np.asarray(equal_rows, np.float64) / num_perm
    return np.clip((agreement - chance) / (1.0 - chance), 0.0, 1.0)


def containment_from_jaccard(
    similarity: np.ndarray, part_size: np.ndarray, whole_size: np.ndarray
) -> np.ndarray:
    """|A & B| / |A| from the Jaccard similarity J and the two set sizes: |A & B| = J (|A| + |B|) / (1 + J).
    With an estimated J this is the containment estimate (capped at 1)."""
    similarity = np.asarray(similarity, np.float64)
    part = np.maximum(np.asarray(part_size, np.float64), 1.0)
    common = similarity * (part + np.asarray(whole_size, np.float64)) / (1.0 + similarity)
    return np.minimum(common / part, 1.0)


def distinct_counts(shingles: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """The number of distinct shingle hashes of each document of a batch (`shingle_batch`'s output): the
    set sizes that containment is estimated with. One sort of the batch, no Python per document."""
    documents = len(offsets) - 1
    owner = np.repeat(np.arange(documents), np.diff(offsets))
    order = np.lexsort((shingles, owner))
    sorted_shingles, sorted_owner = shingles[order], owner[order]
    first = np.ones(len(order), bool)
    first[1:] = (sorted_shingles[1:] != sorted_shingles[:-1]) | (sorted_owner[1:] != sorted_owner[:-1])
    return np.bincount(sorted_owner[first], minlength=documents)


def collision_probability(similarity: float, bands: int, rows: int) -> float:
    """The chance that a pair with this Jaccard similarity shares at least one band: 1 - (1 - s^r)^b."""
    return 1.0 - (1.0 - similarity**rows) ** bands


def estimated_jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """The fraction of equal signature rows: MinHash's estimate of the Jaccard similarity."""
    return float(np.mean(a == b))
