"""Held-out slices: which documents of a cell are set aside for evaluation, chosen by their content.

Every document has a key, a 64-bit hash of its id (`document_key`), so that whether a document is a
candidate does not depend on the cell it lands in, the other documents, the order of files or the
runner: the same document is a candidate after cells are re-bucketed or the corpus is re-curated. A
cell's held-out slice is a prefix of its documents in key order (ties by id):

* candidates (key < fraction x 2^64) while the slice holds fewer than `max_tokens` tokens;
* in a cell too small for the fraction, further documents in key order until the slice holds
  `min_documents` (never more than half of the cell's documents), within the same cap.

Candidates past the cap are *reserved*: neither trained on nor evaluated, so a candidate is never trained
on whatever the cell layout (only the `min_documents` top-up depends on the cell). Because the slice is a
prefix, it is described by its last key (`HeldoutSelection.last`), which is all that the shard writer needs
to leave the slice out of the training shards: a document is held out when its (key, id) <= last, reserved
when it is a candidate after that, and trained on otherwise.

The prefix is found without a global gather: each file gives a `SliceAccumulator` of its candidates and
its `min_documents` lowest other keys (with their token ids), accumulators merge (a Beam CombineFn, lifted
before the shuffle), and each one drops what can no longer be in the slice whatever is merged later.
Memory per accumulator: the slice so far, at most `max_tokens` tokens plus one document and
`min_documents` more documents (a few MB at the default cap), whatever the size of the cell.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
from collections.abc import Iterable

import numpy as np

from tokenmill.formats.tokens import HELDOUT_HASH, HeldoutRule

KEY_SPACE = 1 << 64
_SALT = b"tokenmill-heldout:"
#: Defaults that suit a web corpus: 0.5% of the documents, at most 4M tokens per cell.
DEFAULT_FRACTION = 0.005
DEFAULT_MAX_TOKENS = 4_000_000
DEFAULT_MIN_DOCUMENTS = 1


def make_rule(fraction: float, max_tokens: int, min_documents: int) -> HeldoutRule:
    """The rule as recorded in counts.json, manifests and markers (every field given, so all are written)."""
    if not 0 <= fraction < 1:
        raise ValueError(f"held-out fraction {fraction} is not in [0, 1)")
    if max_tokens < 0 or min_documents < 0:
        raise ValueError("held-out max tokens and min documents must be >= 0")
    if fraction == 0:
        min_documents = 0  # 0 turns held-out slices off
    return HeldoutRule(
        fraction=float(fraction),
        max_tokens=int(max_tokens),
        min_documents=int(min_documents),
        hash=HELDOUT_HASH,
    )


def document_key(document_id: str) -> int:
    """The document's held-out key: the first 8 bytes, big-endian, of sha256('tokenmill-heldout:' + id)."""
    return int.from_bytes(hashlib.sha256(_SALT + document_id.encode("utf-8")).digest()[:8], "big")


def candidate_cut(rule: HeldoutRule) -> int:
    """Keys below this are candidates: floor(fraction x 2^64)."""
    return int(rule.fraction * KEY_SPACE)


def format_last(key: int, document_id: str) -> str:
    """A slice's last (key, id) as recorded in manifests and markers: `<16 hex digits>:<id>`."""
    return f"{key:016x}:{document_id}"


def parse_last(text: str) -> tuple[int, str]:
    key, _, document_id = text.partition(":")
    return int(key, 16), document_id


@dataclasses.dataclass(frozen=True)
class Entry:
    """One document that may be in a slice: its key, id, token ids (end-of-text included) and UTF-8 bytes."""

    key: int
    id: str
    ids: np.ndarray
    bytes: int
    candidate: bool

    @property
    def order(self) -> tuple[int, str]:
        return self.key, self.id


@dataclasses.dataclass
class SliceAccumulator:
    """The part of a cell's documents that can still be in its held-out slice, in key order, plus counts.

    `documents` counts every document seen (for the min_documents bound), `candidates` and
    `candidate_tokens` every candidate, kept or dropped (so reserved = candidates - held out).
    """

    entries: list[Entry] = dataclasses.field(default_factory=list)
    documents: int = 0
    candidates: int = 0
    candidate_tokens: int = 0

    def add(self, entry: Entry) -> None:
        bisect.insort(self.entries, entry, key=lambda e: e.order)
        if entry.candidate:
            self.candidates += 1
            self.candidate_tokens += len(entry.ids)

    def merge(self, other: SliceAccumulator) -> None:
        merged = sorted([*self.entries, *other.entries], key=lambda e: e.order)
        self.entries = merged
        self.documents += other.documents
        self.candidates += other.candidates
        self.candidate_tokens += other.candidate_tokens

    def prune(self, rule: HeldoutRule) -> None:
        """Drop entries that no later merge can bring into the slice.

        Merging only adds entries (each can only move an entry later, with more tokens before it) and
        documents (raising the min_documents bound up to min_documents), so an entry with `max_tokens`
        tokens before it, or a non-candidate with `min_documents` entries before it, is out for good.
        """
        kept: list[Entry] = []
        before = 0
        for position, entry in enumerate(self.entries):
            if before >= rule.max_tokens:
                break
            if not entry.candidate and position >= rule.min_documents:
                break  # candidates come first in key order: only non-candidates follow
            kept.append(entry)
            before += len(entry.ids)
        self.entries = kept


@dataclasses.dataclass(frozen=True)
class HeldoutSelection:
    """A cell's held-out slice: its documents in key order and how it was cut."""

    cell: str
    entries: tuple[Entry, ...]
    last: str | None  # format_last of the last entry; None for an empty slice
    cell_documents: int
    reserved_documents: int
    reserved_tokens: int

    @property
    def tokens(self) -> int:
        return sum(len(entry.ids) for entry in self.entries)


def select(cell: str, accumulator: SliceAccumulator, rule: HeldoutRule) -> HeldoutSelection:
    """The slice: the longest key-order prefix within the cap and the candidate / min_documents rule."""
    least = min(rule.min_documents, accumulator.documents // 2)
    taken: list[Entry] = []
    tokens = 0
    for entry in accumulator.entries:
        if tokens >= rule.max_tokens or (not entry.candidate and len(taken) >= least):
            break
        taken.append(entry)
        tokens += len(entry.ids)
    held_candidates = [entry for entry in taken if entry.candidate]
    return HeldoutSelection(
        cell=cell,
        entries=tuple(taken),
        last=format_last(*taken[-1].order) if taken else None,
        cell_documents=accumulator.documents,
        reserved_documents=accumulator.candidates - len(held_candidates),
        reserved_tokens=accumulator.candidate_tokens - sum(len(entry.ids) for entry in held_candidates),
    )


class Classifier:
    """Where each document of a cell goes, given the cell's slice: 'heldout', 'reserved' or 'train'."""

    def __init__(self, rule: HeldoutRule | None, last: str | None) -> None:
        self.active = rule is not None and rule.active
        self.cut = candidate_cut(rule) if rule is not None else 0
        self.last = parse_last(last) if last else None

    def place(self, document_id: str) -> str:
        if not self.active:
            return "train"
        key = document_key(document_id)
        if self.last is not None and (key, document_id) <= self.last:
            return "heldout"
        return "reserved" if key < self.cut else "train"

    def training_rows(self, ids: Iterable[str]) -> list[int]:
        """Positions of the documents that go to the training shard."""
        return [row for row, document_id in enumerate(ids) if self.place(document_id) == "train"]
