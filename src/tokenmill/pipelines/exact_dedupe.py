"""`exact_dedupe`: removal of documents whose normalized text is identical, without hot keys.

A grouping stage of the curate recipe (see tokenmill.pipelines.recipe). Of the documents that share a
text (by a 128-bit hash of it), the one with the smallest id is kept and the others are removed with
reason `exact_duplicate` and `detail` `{"kept_id", "text_hash"}`. The copies of one text never meet:

    documents -> (text hash, id)                           ids only, 50-odd bytes per document
      -> CombinePerKey: text hash -> (smallest id, copies)  combiner: partial results per worker, then
                                                            one small accumulator per hash
      -> (text hash, salt) -> kept id, for every id         salted by a hash of the id into
                                                            ceil(copies / group_size) groups, so no group
                                                            holds more than ~group_size ids
      -> GroupByKey by id: the document and its verdict     the one shuffle of whole documents
      -> kept (id == kept id) or removed

A boilerplate page with 50 million copies is one combiner accumulator (an id and a count), 50,000
salted groups of about 1,000 ids, and 50 million single-document groups by id: no worker ever holds
more than one copy of it, and none holds more than `group_size` ids of it.

Everything is a function of the set of documents: the smallest id wins wherever and in whatever order
the copies arrive.

With earlier runs' dedupe indexes (`--dedupe-against`, tokenmill.pipelines.dedupe_index) their (text
hash, marker) pairs join the combiner: a marker sorts before every id and is not a copy, so every copy of
a text an earlier run kept goes to the `removed_earlier` output (reason `earlier_duplicate`, `detail`
naming the earlier id and run), and texts only earlier runs have are dropped after the combine.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable

import apache_beam as beam

from tokenmill.pipelines.dedupe_index import EARLIER_EXACT, earlier_exact_pairs, is_earlier, parse_marker
from tokenmill.pipelines.dedupe_keys import DECISION, DOCUMENT, document_and_decision, text_hash
from tokenmill.pipelines.sinks import stable_hash

STAGE = "exact_dedupe"
REASON = "exact_duplicate"
#: Ids per salted group when the copies of one text are matched with the kept id.
GROUP_SIZE = 1000
# Tags of the values in the salted join.
_KEPT_ID, _COPY_ID = 0, 1


def salt_count(copies: int, group_size: int) -> int:
    """How many salted groups the ids of one text are spread over: at most `group_size` ids each, on
    average."""
    return max(1, math.ceil(copies / group_size))


class _FirstCopy(beam.CombineFn):
    """(smallest id, number of copies) of one text hash; O(1) memory per hash, merged across workers."""

    def create_accumulator(self) -> tuple[str | None, int]:
        return None, 0

    def add_input(self, accumulator: tuple[str | None, int], identifier: str) -> tuple[str | None, int]:
        smallest, copies = accumulator
        # An earlier run's document (--dedupe-against) sorts first and is not a copy of this run.
        copies += not identifier.startswith("\x00")
        return (identifier if smallest is None or identifier < smallest else smallest), copies

    def merge_accumulators(self, accumulators: Iterable[tuple[str | None, int]]) -> tuple[str | None, int]:
        smallest, copies = None, 0
        for other, count in accumulators:
            if other is not None and (smallest is None or other < smallest):
                smallest = other
            copies += count
        return smallest, copies

    def extract_output(self, accumulator: tuple[str | None, int]) -> tuple[str | None, int]:
        return accumulator


def _salted_kept_ids(element: tuple[str, tuple[str, int]], group_size: int):
    """text hash -> (smallest id, copies) => ((hash, salt), kept id) for each of the hash's salts."""
    digest, (kept_id, copies) = element
    for salt in range(salt_count(copies, group_size)):
        yield (digest, salt), (_KEPT_ID, kept_id)


def _salted_copy(pair: tuple[str, str], salts: dict[str, int]):
    """(text hash, id) -> ((hash, salt of the id), id); only hashes with more than `group_size` copies
    are in `salts` (the side input), every other hash has the one salt 0."""
    digest, identifier = pair
    count = salts.get(digest, 1)
    salt = stable_hash(identifier) % count if count > 1 else 0
    return (digest, salt), (_COPY_ID, identifier)


def _verdicts(element: tuple[tuple[str, int], Iterable[tuple[int, str]]]):
    """One salted group -> (id, (text hash, kept id)) for each of its ids.

    Two passes over the group's values (Beam's grouped values are re-iterable, and streamed from the
    shuffle on Dataflow): the first finds the kept id, the second emits a verdict per id. Memory is O(1)
    in the size of the group, which the salts keep near `group_size` ids anyway.
    """
    (digest, _), values = element
    kept_id = next(value for tag, value in values if tag == _KEPT_ID)
    for tag, identifier in values:
        if tag == _COPY_ID:
            yield identifier, (digest, kept_id)


class _Decide(beam.DoFn):
    """id -> its document and its verdict: kept (main output) or removed ('removed')."""

    def process(self, element: tuple[str, Iterable[tuple[int, object]]]):
        identifier, values = element
        document, verdict = document_and_decision(STAGE, identifier, values)
        if document is None or verdict is None:  # cannot happen: every verdict comes from a document
            raise RuntimeError(f"{STAGE}: id {identifier!r} has no document or no verdict")
        digest, kept_id = verdict
        if kept_id == identifier:
            yield document
        elif is_earlier(kept_id):
            run, earlier_id = parse_marker(kept_id)
            yield beam.pvalue.TaggedOutput(
                "removed_earlier",
                {
                    **document,
                    "stage": STAGE,
                    "reason": EARLIER_EXACT,
                    "detail": json.dumps(
                        {"earlier_id": earlier_id, "earlier_run": run, "text_hash": digest}, sort_keys=True
                    ),
                },
            )
        else:
            yield beam.pvalue.TaggedOutput(
                "removed",
                {
                    **document,
                    "stage": STAGE,
                    "reason": REASON,
                    "detail": json.dumps({"kept_id": kept_id, "text_hash": digest}, sort_keys=True),
                },
            )


class ExactDedupe(beam.PTransform):
    """Keep the smallest id of each normalized text; remove the other copies (see the module docstring).

    Memory and shuffle at 10 TB on 1,000 workers: the (text hash, id) pairs (about 50 bytes a document)
    are shuffled twice, once partially combined; whole documents are shuffled once, by id, in groups of
    one document. Per worker: one combiner accumulator per text hash in a bundle, one salted group of
    about `group_size` ids at a time (iterated, not held), one document at a time; and the side input of
    the texts with more than `group_size` copies (at most documents / `group_size` entries, in practice
    the few boilerplate texts of a crawl). With `against`, the earlier indexes' (hash, id) pairs are read
    and combined once more (about 50 bytes per earlier document, combined per hash before the shuffle).
    """

    stage = STAGE

    def __init__(self, group_size: int = GROUP_SIZE):
        super().__init__()
        if not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
        self.group_size = group_size
        #: Earlier runs' dedupe indexes (tokenmill.pipelines.dedupe_index.attach_earlier_indexes): their
        #: texts join the combiner, so every copy of a text they kept is removed as earlier_duplicate.
        self.against: tuple = ()

    def expand(self, documents):
        group_size = self.group_size
        pairs = documents | "HashAndId" >> beam.Map(
            lambda document: (text_hash(document["text"]), document["id"])
        ).with_output_types(tuple[str, str])
        combined = pairs
        if self.against:
            earlier = earlier_exact_pairs(documents.pipeline, self.against, "EarlierTexts")
            combined = (pairs, earlier) | "WithEarlierTexts" >> beam.Flatten()
        first_copies = combined | "FirstCopy" >> beam.CombinePerKey(_FirstCopy())
        if self.against:  # texts only earlier runs have: no copy here to decide
            first_copies = first_copies | "CopiesHere" >> beam.Filter(lambda element: element[1][1] > 0)
        # Only texts with more copies than one group holds need salts; everything else has salt 0.
        salts = (
            first_copies
            | "HotTexts" >> beam.Filter(lambda element: element[1][1] > group_size)
            | "SaltCounts" >> beam.Map(lambda element: (element[0], salt_count(element[1][1], group_size)))
        )
        verdicts = (
            (
                first_copies | "SaltKeptIds" >> beam.FlatMap(_salted_kept_ids, group_size),
                pairs | "SaltCopies" >> beam.Map(_salted_copy, salts=beam.pvalue.AsDict(salts)),
            )
            | "SaltedPairs" >> beam.Flatten()
            | "GroupSalted" >> beam.GroupByKey()
            | "Verdicts" >> beam.FlatMap(_verdicts).with_output_types(tuple[str, tuple[str, str]])
        )
        decided = (
            (
                documents | "KeyById" >> beam.Map(lambda document: (document["id"], (DOCUMENT, document))),
                verdicts | "TagVerdicts" >> beam.Map(lambda verdict: (verdict[0], (DECISION, verdict[1]))),
            )
            | "DocumentsAndVerdicts" >> beam.Flatten()
            | "JoinById" >> beam.GroupByKey()
            | "Decide" >> beam.ParDo(_Decide()).with_outputs("removed", "removed_earlier", main="kept")
        )
        if not self.against:
            return {"kept": decided.kept, "removed": decided.removed}
        stats = (
            (
                documents.pipeline | "EarlierStatsZero" >> beam.Create([{"earlier_duplicates": 0}]),
                decided.removed_earlier | "EarlierCount" >> beam.Map(lambda _: {"earlier_duplicates": 1}),
            )
            | "EarlierStats" >> beam.Flatten()
            | "SumEarlierStats" >> beam.CombineGlobally(_sum_counts)
            | "StageStats" >> beam.Map(lambda numbers: (STAGE, numbers))
        )
        return {
            "kept": decided.kept,
            "removed": decided.removed,
            "removed_earlier": decided.removed_earlier,
            "stats": stats,
        }


def _sum_counts(parts: Iterable[dict]) -> dict:
    total: dict = {}
    for part in parts:
        for key, value in part.items():
            total[key] = total.get(key, 0) + value
    return total
