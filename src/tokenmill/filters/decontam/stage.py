"""The `decontam` curation stage: flag or remove documents that hold evaluation records.

Memory and shuffle at 10 TB on 1,000 workers: no shuffle (a per-document step). Each worker process
holds one memory-mapped index (tokenmill.filters.models.SharedModel), shared with the other processes of
its machine through the page cache, and about 40 bytes per byte of one ~1 MB chunk of text.
"""

from __future__ import annotations

import bisect
import json
from collections import defaultdict
from collections.abc import Iterator

from tokenmill.filters.base import DocumentStep, Removal
from tokenmill.filters.decontam.hashing import count_words, normalize_for_matching
from tokenmill.filters.decontam.index import DecontamIndex, load_index, read_index_header
from tokenmill.filters.decontam.matching import DEFAULT_BAND, Match, Matcher
from tokenmill.filters.models import SharedModel
from tokenmill.formats.documents import split_paragraphs

#: Documents are matched in chunks of about this many bytes, which bounds the temporary arrays.
_CHUNK_BYTES = 1 << 20
#: What a match is called in the annotation and in stats.json, from the strongest evidence to the weakest.
KINDS = ("verbatim", "edited", "partial")


class Decontaminate(DocumentStep):
    """Flag or remove documents that hold evaluation records (recipe stage `decontam`).

    A long record (`long_words` words or more) is found when one aligned occurrence in the document covers
    at least `min_coverage` of its counted words (matching.py says what covered means), or at least
    `min_covered_words` of them (a long passage quoted in part). A short record is found when its whole
    normalized text occurs. `action: remove` removes the document (reason `contaminated`); `action: flag`
    keeps it. Either way the document's `metadata` gets a `contamination` key naming the matched
    evaluation sets and, per set, the best-matching record.

    At 10 TB on 1,000 workers: no shuffle; each worker process holds one index, memory-mapped and shared
    by the processes of its machine, plus temporary arrays of about 40 bytes per byte of a 1 MB chunk.
    """

    stage = "decontam"

    def __init__(
        self,
        index: str,
        action: str = "remove",
        min_coverage: float = 0.7,
        min_covered_words: int = 40,
        band: int = DEFAULT_BAND,
    ):
        if action not in ("remove", "flag"):
            raise ValueError(f"decontam action must be remove or flag, not {action!r}")
        if not 0 < min_coverage <= 1:
            raise ValueError(f"decontam min_coverage must be in (0, 1], not {min_coverage}")
        if min_covered_words < 1:
            raise ValueError(f"decontam min_covered_words must be at least 1, not {min_covered_words}")
        if not 0 <= band <= 16:
            raise ValueError(f"decontam band must be between 0 and 16 words, not {band}")
        self.index_path = index
        self.action = action
        self.min_coverage = float(min_coverage)
        self.min_covered_words = int(min_covered_words)
        self.band = int(band)
        # Read (and check) the header now, so that a missing or stale index fails at recipe load.
        self.header, _ = read_index_header(index)
        # One index per worker process, whatever the number of copies of this step there.
        self._shared_index = SharedModel(load_index, index)
        self._index: DecontamIndex | None = None
        self._matcher: Matcher | None = None
        self._stats: dict = {}

    def __getstate__(self) -> dict:
        # Workers load the index themselves in setup(); a pickled step carries only its settings.
        keep = (
            "index_path",
            "action",
            "min_coverage",
            "min_covered_words",
            "band",
            "header",
            "_shared_index",
        )
        return {
            **{name: self.__dict__[name] for name in keep},
            "_index": None,
            "_matcher": None,
            "_stats": {},
        }

    def setup(self) -> None:
        index: DecontamIndex = self._shared_index.get()
        self._index = index  # the process's one copy, held while this step lives
        self._matcher = Matcher(index, self.min_coverage, self.min_covered_words, self.band)
        sets = index.header["sets"]
        self._names = [entry["name"] for entry in sets]
        self._files = [[file["path"] for file in entry["files"]] for entry in sets]
        self._set_starts = [int(entry["first_record"]) for entry in sets]
        self._record_file = index.arrays["record_file"]
        self._record_line = index.arrays["record_line"]

    def apply(self, documents: list[dict]) -> list[Removal | None]:
        if self._matcher is None:
            self.setup()
        found: dict[int, dict[int, tuple[str, Match]]] = defaultdict(dict)  # document -> set -> best
        for begin, end in _chunks(documents):
            self._match_chunk(documents, begin, end, found)
        results: list[Removal | None] = []
        stats = self._stats
        stats["documents"] = stats.get("documents", 0) + len(documents)
        for position, document in enumerate(documents):
            matches = found.get(position)
            if not matches:
                results.append(None)
                continue
            by_name = sorted(matches, key=lambda s: self._names[s])
            names = [self._names[s] for s in by_name]
            described = [self._describe(s, *matches[s], document["text"]) for s in by_name]
            coverage = max(match["coverage"] for match in described)
            _annotate(
                document,
                {"eval_sets": names, "coverage": coverage, "matches": described, "action": self.action},
            )
            stats["contaminated"] = stats.get("contaminated", 0) + 1
            per_set = stats.setdefault("eval_sets", {})
            for name, match in zip(names, described, strict=True):
                counts = per_set.setdefault(name, {})
                counts["documents"] = counts.get("documents", 0) + 1
                counts[match["match"]] = counts.get(match["match"], 0) + 1
            if self.action == "remove":
                results.append(
                    Removal("contaminated", {"eval_sets": names, "coverage": coverage, "matches": described})
                )
            else:
                results.append(None)
        return results

    def drain_stats(self) -> dict:
        """Counts since the last call, then reset: `documents` (checked), `contaminated`, and per set
        `eval_sets.<name>.documents` with the same documents by their best match, `verbatim`, `edited`
        or `partial`. Numbers only, so that they sum across workers into stats.json."""
        stats, self._stats = self._stats, {}
        return stats

    def _match_chunk(self, documents: list[dict], begin: int, end: int, found: dict) -> None:
        assert self._matcher is not None
        texts = [normalize_for_matching(documents[position]["text"]) for position in range(begin, end)]
        for match in self._matcher.match(texts):
            kind = self._kind(match)
            eval_set = bisect.bisect_right(self._set_starts, match.record) - 1
            document = begin + match.document
            best = found[document].get(eval_set)
            if best is None or _strength(kind, match) > _strength(best[0], best[1]):
                found[document][eval_set] = (kind, match)

    def _kind(self, match: Match) -> str:
        if match.covered >= match.counted:
            return "verbatim"
        return "edited" if match.coverage >= self.min_coverage else "partial"

    def _describe(self, eval_set: int, kind: str, match: Match, text: str) -> dict:
        return {
            "eval_set": self._names[eval_set],
            "file": self._files[eval_set][int(self._record_file[match.record])],
            "line": int(self._record_line[match.record]),
            "match": kind,
            "coverage": round(match.coverage, 4),
            "words": match.covered,
            "of": match.counted,
            "paragraph": _paragraph_of(text, match.start),
        }


def _paragraph_of(text: str, word: int) -> int:
    """The paragraph (0-based, counted at blank lines) that holds a word of the normalized text; worked
    out for matched documents only, as matching reads each document whole."""
    seen = 0
    for number, paragraph in enumerate(split_paragraphs(text)):
        seen += count_words(paragraph)
        if word < seen:
            return number
    return number


def _strength(kind: str, match: Match) -> tuple:
    """Which of two matches with one set to report: the stronger kind, then coverage, then the earlier
    record (so that reruns report the same one)."""
    return (-KINDS.index(kind), match.coverage, match.covered, -match.record)


def _chunks(documents: list[dict]) -> Iterator[tuple[int, int]]:
    begin, size = 0, 0
    for position, document in enumerate(documents):
        size += len(document["text"])
        if size >= _CHUNK_BYTES:
            yield begin, position + 1
            begin, size = position + 1, 0
    if begin < len(documents):
        yield begin, len(documents)


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
