"""Finding evaluation records in documents: rare anchors propose, an aligned word comparison decides.

1. **Candidates.** Every 4-word window of a document is hashed and looked up (a bitmap first, then a
   binary search) among the anchors of the long records. A hit says: record r may start at word
   `position - offset` of the document (its *alignment*).
2. **Verification.** For each candidate alignment, the record's words are compared with the document's
   words at that alignment shifted by up to `band` words either way (insertions and deletions move
   the alignment). A record word is *covered* when it and a neighbour match the document at the same
   shift: two words side by side, the smallest n-gram that is still evidence (a lone "the" is not).
   Alignments of one record that follow one another within the band are one occurrence; their covered
   words are pooled. *Coverage* is the share of the record's counted words (template words do not
   count) that are covered.
3. **Short records** (under `long_words` words) are found whole: the hash of their last 4 words, then
   the hash of all their words.

An edit changes one word: a substitution uncovers that word (and a neighbour at the record's edge), an
insertion or deletion shifts the alignment by one. Two words replaced in a 13-word item leave coverage
of at least 9/13 in the worst placement and 11/13 usually, while a page that merely shares stock phrases
with an item matches few of its words at one alignment. docs/decontam.md has the measured curve.

Memory: per chunk of about 1 MB of text, a few arrays of 8 bytes per word (hashes, windows, prefix
sums); candidates are compared in slices of at most `_VERIFY_WORDS` record words (about 100 bytes each
while compared), and an occurrence compares at most `_ALIGNMENTS` alignments, so a page full of anchors
costs bounded time and memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenmill.filters.decontam.hashing import (
    hash_words,
    window_hashes,
    windows_at,
    word_prefix,
)
from tokenmill.filters.decontam.index import DecontamIndex

#: The alignment may drift this many words either way from a candidate's: insertions and deletions.
DEFAULT_BAND = 3
#: Anchor hits an occurrence needs before its words are compared.
MIN_ANCHOR_HITS = 2
#: Alignments compared per occurrence: edits leave a few; more are a page repeating an anchor.
_ALIGNMENTS = 8
_VERIFY_WORDS = 1 << 18
_NONE = np.iinfo(np.int64).max


class SortedHashes:
    """A sorted array of 64-bit hashes with a directory on their top bits, searched for many queries at
    once: each query's bucket (a few entries, hashes being uniform) is found in one step, then bisected
    in a few vectorized steps. `np.searchsorted` walks the whole depth of a table of millions of entries
    for every query, missing the cache at each level; this is about ten times faster."""

    def __init__(self, hashes: np.ndarray, entries_per_bucket: int = 8):
        self.hashes = hashes
        self.bits = max(1, int(np.ceil(np.log2(max(len(hashes), 1) / entries_per_bucket))))
        self.shift = np.uint64(64 - self.bits)
        bounds = np.arange(1 << self.bits, dtype=np.uint64) << self.shift
        dtype = np.uint32 if len(hashes) < 2**32 else np.int64
        self.directory = np.append(np.searchsorted(hashes, bounds, "left"), len(hashes)).astype(dtype)
        sizes = np.diff(self.directory.astype(np.int64))
        self.steps = int(np.ceil(np.log2(int(sizes.max()) + 1))) if len(sizes) else 0

    def search(self, queries: np.ndarray, side: str) -> np.ndarray:
        """`np.searchsorted(hashes, queries, side)`."""
        bucket = (queries >> self.shift).astype(np.int64)
        low = self.directory[bucket].astype(np.int64)
        high = self.directory[bucket + 1].astype(np.int64)
        last = max(len(self.hashes) - 1, 0)
        for _ in range(self.steps):
            middle = (low + high) >> 1
            value = self.hashes[np.minimum(middle, last)]
            below = (value < queries) if side == "left" else (value <= queries)
            below &= middle < high
            low = np.where(below, middle + 1, low)
            high = np.where(below, high, middle)
        return low


@dataclass
class Match:
    """The best evidence that a document holds one record."""

    document: int  # position in the texts matched
    record: int
    coverage: float  # share of the record's counted words covered (1.0 for a short record found whole)
    covered: int  # counted words covered (for a short record, its length)
    counted: int  # the record's counted words
    start: int  # the word of the document where the match starts
    kind: str  # "whole" (a short record) or "aligned"


class Matcher:
    """Matches chunks of normalized text against a loaded index."""

    def __init__(
        self, index: DecontamIndex, min_coverage: float, min_covered_words: int, band: int = DEFAULT_BAND
    ):
        header, a = index.header, index.arrays
        self.min_coverage = min_coverage
        self.min_covered_words = min_covered_words
        self.band = band
        self.anchor_words = int(header["anchor_words"])
        self.bits = int(header["bitmap_bits"])
        self.bitmap = a["bitmap"]
        self.anchors = index.derive("anchor_hash", SortedHashes)
        self.anchor_record, self.anchor_offset = a["anchor_record"], a["anchor_offset"]
        self.words, self.counted = a["words"], a["counted"]
        self.record_start, self.record_counted = a["record_start"], a["record_counted"]
        self.shorts = index.derive("short_hash", SortedHashes)
        self.short_whole = a["short_whole"]
        self.short_record, self.short_length = a["short_record"], a["short_length"]

    def match(self, texts: list[str]) -> list[Match]:
        """Every occurrence of a record in normalized texts (documents), each found no more than once per
        (text, record, place). A text's words never run into the next one's."""
        present = [position for position, text in enumerate(texts) if text]
        words, counts = hash_words([texts[position] for position in present])
        if not len(words):
            return []
        word_doc = np.repeat(np.asarray(present, np.int64), counts)
        doc_first = np.repeat(np.cumsum(counts) - counts, counts)
        prefix = word_prefix(words)
        anchors = window_hashes(words, self.anchor_words, prefix)
        positions = self._probe(anchors)
        positions = positions[word_doc[positions] == word_doc[positions + self.anchor_words - 1]]
        # In hash order, the searches walk the tables from one end to the other (fewer cache misses).
        positions = positions[np.argsort(anchors[positions])]
        matches = self._long(words, word_doc, anchors, positions)
        matches += self._short(prefix, word_doc, anchors, positions)
        for match in matches:  # document-relative word numbers
            match.start -= int(doc_first[match.start])
        return matches

    # -- lookups

    def _probe(self, queries: np.ndarray) -> np.ndarray:
        """Positions of queries whose bit is set in the bitmap (all indexed hashes pass; 1/16 of others)."""
        if not len(queries) or not len(self.bitmap):
            return np.zeros(0, np.int64)
        top = queries >> np.uint64(64 - self.bits)
        bits = self.bitmap[top >> np.uint64(3)] >> (top & np.uint64(7)).astype(np.uint8)
        return np.flatnonzero(bits & 1)

    @staticmethod
    def _find(table: SortedHashes, queries: np.ndarray, positions: np.ndarray):
        """(query position, table entry) for every entry equal to a query (an anchor may be in several
        records)."""
        if not len(positions) or not len(table.hashes):
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        wanted = queries[positions]
        left = table.search(wanted, "left")
        hit = table.hashes[np.minimum(left, len(table.hashes) - 1)] == wanted
        positions, left, wanted = positions[hit], left[hit], wanted[hit]
        # Only the hits (few) pay for the second search, which finds anchors shared by several records.
        counts = table.search(wanted, "right") - left
        offsets = np.cumsum(counts) - counts
        entries = np.arange(int(counts.sum())) - np.repeat(offsets - left, counts)
        return np.repeat(positions, counts), entries

    # -- long records

    def _long(self, words, word_doc, anchors, positions) -> list[Match]:
        """Occurrences of long records that cover enough of them, from the windows that passed the probe."""
        at, entries = self._find(self.anchors, anchors, positions)
        if not len(at):
            return []
        records = self.anchor_record[entries].astype(np.int64)
        alignment = at - self.anchor_offset[entries].astype(np.int64)
        docs = word_doc[at]
        order = np.lexsort((alignment, records, docs))
        docs, records, alignment = docs[order], records[order], alignment[order]
        # Alignments that follow one another within the band are one occurrence (edits move the
        # alignment a word at a time); a jump is another place, whose words are not pooled with these:
        # stock phrases scattered over a page each sit at an alignment of their own.
        same_pair = np.zeros(len(docs), bool)
        same_pair[1:] = (docs[1:] == docs[:-1]) & (records[1:] == records[:-1])
        occurrence = ~same_pair
        occurrence[1:] |= alignment[1:] - alignment[:-1] > self.band
        # One anchor is a stock phrase as often as an item: an occurrence needs two. Two words replaced
        # in a 13-word item leave at least two (its 11 other words, in at most three runs, hold two 4-runs).
        occurrence_of = np.cumsum(occurrence) - 1
        keep = (np.bincount(occurrence_of) >= MIN_ANCHOR_HITS)[occurrence_of]
        # One comparison per distinct (document, record, alignment), and no more than _ALIGNMENTS per
        # occurrence, those with the most hits: a page repeating an anchor ("la la la la") would otherwise
        # make one occurrence of thousands of alignments.
        distinct = occurrence.copy()
        distinct[1:] |= alignment[1:] != alignment[:-1]
        group = np.cumsum(distinct) - 1
        group_heads = np.flatnonzero(distinct)
        group_occurrence = occurrence_of[group_heads]
        order = np.lexsort((alignment[group_heads], -np.bincount(group), group_occurrence))
        rank = np.arange(len(order)) - np.searchsorted(group_occurrence[order], group_occurrence[order])
        chosen = np.zeros(len(group_heads), bool)
        chosen[order[rank < _ALIGNMENTS]] = True
        keep &= distinct & chosen[group]
        docs, records, alignment, occurrence_of = (
            docs[keep],
            records[keep],
            alignment[keep],
            occurrence_of[keep],
        )
        if not len(docs):
            return []
        first = np.ones(len(docs), bool)
        first[1:] = occurrence_of[1:] != occurrence_of[:-1]
        heads = np.flatnonzero(first)
        occurrence_of = np.cumsum(first) - 1  # renumbered from 0, in order
        lengths = (self.record_start[records + 1] - self.record_start[records]).astype(np.int64)
        # The document's word range bounds the comparison: words of the next document never match.
        doc_first = np.searchsorted(word_doc, docs, "left")
        doc_end = np.searchsorted(word_doc, docs, "right")
        # One flag per (occurrence, record word): a word counts once, however many alignments cover it.
        occurrence_base = np.cumsum(lengths[heads]) - lengths[heads]
        flags = np.zeros(int(lengths[heads].sum()), bool)
        first_word = np.full(len(docs), _NONE)
        ends = np.cumsum(lengths)
        begin = 0
        while begin < len(docs):
            # Slices of about _VERIFY_WORDS record words, however many candidates there are.
            end = max(begin + 1, int(np.searchsorted(ends, ends[begin] - lengths[begin] + _VERIFY_WORDS)))
            part = slice(begin, end)
            candidate, within, first_word[part] = self._verify(
                words, records[part], alignment[part], lengths[part], doc_first[part], doc_end[part]
            )
            flags[occurrence_base[occurrence_of[part][candidate]] + within] = True
            begin = end
        covered = np.add.reduceat(flags, occurrence_base, dtype=np.int64)
        counted = self.record_counted[records[heads]].astype(np.int64)
        coverage = covered / np.maximum(counted, 1)
        found = (counted > 0) & ((coverage >= self.min_coverage) | (covered >= self.min_covered_words))
        start = np.minimum.reduceat(first_word, heads)
        return [
            Match(
                int(docs[head]),
                int(records[head]),
                float(coverage[o]),
                int(covered[o]),
                int(counted[o]),
                int(start[o]),
                "aligned",
            )
            for o, head in zip(np.flatnonzero(found).tolist(), heads[found].tolist(), strict=True)
        ]

    def _verify(self, words, records, alignment, lengths, doc_first, doc_end):
        """For candidate alignments of records: (candidate, record word) of every covered counted word,
        and the first document word each candidate covers (_NONE if none)."""
        total = int(lengths.sum())
        candidate = np.repeat(np.arange(len(records)), lengths)
        within = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        record_word = np.repeat(self.record_start[records].astype(np.int64), lengths) + within
        expected = self.words[record_word]
        base = np.repeat(alignment, lengths) + within
        low, high = np.repeat(doc_first, lengths), np.repeat(doc_end, lengths)
        not_last = np.ones(total, bool)
        not_last[np.cumsum(lengths) - 1] = False
        pair = np.zeros(total, bool)  # record words i and i + 1 match side by side at one shift
        first_word = np.full(total, _NONE)
        for shift in range(-self.band, self.band + 1):
            where = base + shift
            equal = (where >= low) & (where < high)
            equal &= words[np.clip(where, 0, len(words) - 1)].astype(np.uint32) == expected
            both = equal & not_last
            both[:-1] &= equal[1:]
            pair |= both
            np.minimum(first_word, np.where(both, where, _NONE), out=first_word)
        covered = pair.copy()
        covered[1:] |= pair[:-1]
        covered &= self.counted[record_word].astype(bool)
        return (
            candidate[covered],
            within[covered],
            np.minimum.reduceat(first_word, np.cumsum(lengths) - lengths),
        )

    # -- short records

    def _short(self, prefix, word_doc, anchors, positions) -> list[Match]:
        """Short records whose anchor (last 4 words) hits, confirmed by the hash of all their words."""
        at, entries = self._find(self.shorts, anchors, positions)
        if not len(at):
            return []
        lengths = self.short_length[entries].astype(np.int64)
        starts = at + self.anchor_words - lengths
        inside = starts >= 0
        at, entries, lengths, starts = at[inside], entries[inside], lengths[inside], starts[inside]
        inside = word_doc[starts] == word_doc[at]
        at, entries, lengths, starts = at[inside], entries[inside], lengths[inside], starts[inside]
        confirmed = windows_at(prefix, starts, lengths) == self.short_whole[entries]
        return [
            Match(
                int(word_doc[start]),
                int(self.short_record[entry]),
                1.0,
                int(length),
                int(length),
                int(start),
                "whole",
            )
            for start, entry, length in zip(
                starts[confirmed].tolist(),
                entries[confirmed].tolist(),
                lengths[confirmed].tolist(),
                strict=True,
            )
        ]
