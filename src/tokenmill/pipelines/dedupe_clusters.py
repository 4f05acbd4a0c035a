"""`kept_id` made final, and each kept document's duplicate-cluster size: one Beam step after the stages.

Each dedupe stage names, in a removal's `detail.kept_id`, the document it kept in the removed one's place.
That document may be removed later: `exact_dedupe` keeps the smallest id of a text, and `fuzzy_dedupe`
(or a second dedupe stage) may then remove it as a near duplicate of another; a filter (quality,
repetition, ...) may remove it too. This step follows every chain to its end once the stages have run:

- the chain ends at a kept document F: `detail.kept_id` becomes F (and `detail.matched_id` keeps the
  document the stage itself matched, where that differs), and F counts the removal in its cluster;
- the chain ends at a document R that a later stage that is not a dedupe stage removed (stage s,
  reason r): the removal moves to `removed/stage=s/reason=r/` with `detail.removed_with` R (plus the dedupe
  stage's own detail, `dedupe_stage`, `dedupe_reason` and `matched_id`): the cluster went with its
  representative, as it would have had the filter run first. So every removal under a dedupe stage names
  a document that is in curated/ (docs/dedupe.md, "Final kept ids and cluster sizes").

Every kept document gets `dup_cluster_size`: itself plus every removal whose chain ends at it (exact copies
and near duplicates, transitively), so the sizes of curated/ sum to the documents they represent.

Chains only point forward in stage order (a stage's kept document survived that stage), so they are
resolved from the last dedupe stage to the first, one join per dedupe stage, and they are as long as the
recipe has dedupe stages:

    statuses: (id, final) of the documents that outlived the stage: kept, or removed by a later stage
    pointers: (kept_id, id) of one dedupe stage's removals
      -> CombinePerKey: kept_id -> pointer count               ids only; a combiner
      -> ((kept_id, salt), status) x salts, ((kept_id, salt of id), id)
                                                                salted as exact_dedupe: ceil(count /
                                                                group_size) groups of ~group_size ids
      -> GroupByKey, iterated twice -> (id, final of its kept_id)
    removed documents of dedupe stages + their finals -> GroupByKey(id) -> rewritten removals
    kept documents + pointer counts per final kept id -> GroupByKey(id) -> dup_cluster_size

A boilerplate text with 10^6 copies is 10^6 pointers to one kept id: 1,000 salted groups of about 1,000
ids, its status sent once to each; no group holds more than about `group_size` ids or more than one
document.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import apache_beam as beam

from tokenmill.formats.documents import CLUSTER_SIZE, cluster_size_bin
from tokenmill.pipelines.dedupe_keys import document_and_decision
from tokenmill.pipelines.exact_dedupe import GROUP_SIZE, salt_count
from tokenmill.pipelines.sinks import StatsCombine, stable_hash

STAGE = "dedupe_clusters"
#: Stages whose removals name, in `detail.kept_id`, the document kept in their place.
DEDUPE_STAGES = ("exact_dedupe", "fuzzy_dedupe")
#: Keys of the step's stats that combine by maximum; every other number is summed.
_MAX_STATS = ("largest_cluster",)

# Finals: where a document's chain ends. (_KEPT, id of the kept document) or (_DROPPED, stage, reason, id
# of the document that the non-dedupe stage removed).
_KEPT, _DROPPED = "kept", "dropped"
# Tags of the values in the salted groups (_HEAD: the kept id's own final) and in the joins by id.
_HEAD, _POINTER = 0, 1
_DOCUMENT, _DECISION = 0, 1


def _salted_heads(status: tuple[str, tuple], hot: dict[str, int]):
    """(id, final) -> ((id, salt), final) for each salt that pointers to `id` are spread over."""
    identifier, final = status
    for salt in range(hot.get(identifier, 1)):
        yield (identifier, salt), (_HEAD, final)


def _salted_pointer(pointer: tuple[str, str], hot: dict[str, int]):
    """(kept id, id) -> ((kept id, salt of the id), id); only kept ids with more than `group_size`
    pointers are in `hot` (the side input), every other has the one salt 0."""
    target, identifier = pointer
    count = hot.get(target, 1)
    salt = stable_hash(identifier) % count if count > 1 else 0
    return (target, salt), (_POINTER, identifier)


def _follow(element: tuple[tuple[str, int], Iterable[tuple[int, Any]]]):
    """One salted group -> (id, final of the group's kept id) for every pointer in it.

    Two passes over the values (re-iterable in Beam, streamed on Dataflow): the head, then the pointers.
    Memory O(1) in the group's size. A group of only a head (a document nothing points at) emits nothing.
    """
    (target, _), values = element
    final = None
    has_pointers = False
    for tag, value in values:
        if tag == _HEAD:
            final = value
        else:
            has_pointers = True
    if not has_pointers:
        return
    if final is None:  # cannot happen: a kept id survived its stage, so it was kept or removed later
        raise RuntimeError(f"{STAGE}: a removal names kept_id {target!r}, which no later outcome has")
    for tag, identifier in values:
        if tag == _POINTER:
            yield identifier, final


class FollowOneStage(beam.PTransform):
    """(statuses, pointers) -> (id, final) for every pointer: each removal of one dedupe stage learns
    where its kept id ended. Salted as exact_dedupe's verdicts (see the module docstring).

    Memory and shuffle at 10 TB on 1,000 workers: ids only. The statuses (one per document that outlived
    the stage: kept, or removed by a later stage; ~60 bytes) and the stage's pointers are shuffled once;
    the pointer counts once, combined.
    Per worker: one salted group of about `group_size` ids at a time (iterated, not held), and the side
    input of kept ids with more than `group_size` pointers (at most pointers / `group_size` entries).
    """

    def __init__(self, group_size: int = GROUP_SIZE):
        super().__init__()
        self.group_size = group_size

    def expand(self, inputs):
        statuses, pointers = inputs
        group_size = self.group_size
        hot = (
            pointers
            | "CountPointers" >> beam.Map(lambda pointer: (pointer[0], 1)).with_output_types(tuple[Any, int])
            | "SumPointers" >> beam.CombinePerKey(sum)
            | "HotKeptIds" >> beam.Filter(lambda element: element[1] > group_size)
            | "SaltCounts" >> beam.Map(lambda element: (element[0], salt_count(element[1], group_size)))
        )
        return (
            (
                statuses | "SaltHeads" >> beam.FlatMap(_salted_heads, hot=beam.pvalue.AsDict(hot)),
                pointers | "SaltPointers" >> beam.Map(_salted_pointer, hot=beam.pvalue.AsDict(hot)),
            )
            | "Salted" >> beam.Flatten()
            | "GroupSalted" >> beam.GroupByKey()
            | "Follow" >> beam.FlatMap(_follow).with_output_types(tuple[Any, Any])
        )


def _pointer(document: dict) -> tuple[str, str]:
    """A dedupe removal -> (its kept id, its id)."""
    try:
        kept_id = json.loads(document["detail"])["kept_id"]
    except (KeyError, TypeError, ValueError) as error:
        raise RuntimeError(
            f"{STAGE}: the {document.get('stage')} removal of {document['id']!r} has no detail.kept_id "
            f"({document.get('detail')!r})"
        ) from error
    return kept_id, document["id"]


def _final_removal(element: tuple[str, Iterable[tuple[int, Any]]]):
    """A dedupe removal and the final of its chain -> the removal as written (see the module docstring),
    and its stats."""
    identifier, values = element
    document, final = document_and_decision(STAGE, identifier, values)
    if document is None or final is None:  # cannot happen: each final comes from a removal
        raise RuntimeError(f"{STAGE}: removal {identifier!r} has no document or no final kept id")
    detail = json.loads(document["detail"])
    matched = detail["kept_id"]
    if final[0] == _KEPT:
        kept_id = final[1]
        if kept_id != matched:
            detail = {**detail, "kept_id": kept_id, "matched_id": matched}
            yield beam.pvalue.TaggedOutput("stats", {"kept_id_moved": 1})
            document = {**document, "detail": json.dumps(detail, sort_keys=True)}
        yield document
        return
    _, stage, reason, removed_with = final
    detail.pop("kept_id")
    detail = {
        **detail,
        "matched_id": matched,
        "removed_with": removed_with,
        "dedupe_stage": document["stage"],
        "dedupe_reason": document["reason"],
    }
    yield beam.pvalue.TaggedOutput("stats", {"removed_with_representative": 1})
    yield {**document, "stage": stage, "reason": reason, "detail": json.dumps(detail, sort_keys=True)}


def _with_cluster_size(element: tuple[str, Iterable[tuple[int, Any]]]):
    """A kept document and how many removals end at it -> the document with `dup_cluster_size`."""
    identifier, values = element
    document, represented = document_and_decision(STAGE, identifier, values)
    if document is None:  # cannot happen: a final names a kept document
        raise RuntimeError(f"{STAGE}: removals end at {identifier!r}, which is not a kept document")
    size = 1 + (represented or 0)
    if size > 1:
        yield beam.pvalue.TaggedOutput(
            "stats",
            {
                "clusters": 1,
                "documents_in_clusters": size,
                "largest_cluster": size,
                "cluster_sizes": {cluster_size_bin(size): 1},
            },
        )
    yield {**document, CLUSTER_SIZE: size}


class DedupeClusters(beam.PTransform):
    """Final kept ids and cluster sizes (see the module docstring).

    Input: (kept documents, removed documents of stage 0, of stage 1, ...), the removals in recipe order;
    `stages` names the stage of each removed collection. Output: {"kept": documents with
    `dup_cluster_size`, "removed": every removal, dedupe ones rewritten, as a tuple of PCollections (the
    other stages' removals as they came, then the rewritten ones: a consumer that maps them one by one
    need not materialize their Flatten), "stats": (STAGE, numbers)}.

    Memory and shuffle at 10 TB on 1,000 workers: per dedupe stage, the ids of the documents that outlived
    it (kept, or removed by a later stage) and its pointers, once each (FollowOneStage); then, whole and
    by id, the dedupe removals once (their detail rewritten) and the kept documents once (with their
    pointer counts, combined per kept id first), in groups of one document. Per worker: one salted group
    of about `group_size` ids, or one document, at a time. Without a dedupe stage nothing is shuffled.
    """

    def __init__(self, stages: Sequence[str], group_size: int = GROUP_SIZE):
        super().__init__()
        if not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
        self.stages = list(stages)
        self.group_size = group_size

    def expand(self, inputs):
        kept, *removed_parts = inputs
        if len(removed_parts) != len(self.stages):
            raise ValueError(
                f"{STAGE}: {len(removed_parts)} removed collections for {len(self.stages)} stages"
            )
        pipeline = kept.pipeline
        zero = {
            "removals_followed": 0,
            "kept_id_moved": 0,
            "removed_with_representative": 0,
            "clusters": 0,
            "documents_in_clusters": 0,
            "largest_cluster": 0,
            "cluster_sizes": {},
        }
        dedupe = [index for index, stage in enumerate(self.stages) if stage in DEDUPE_STAGES]
        if not dedupe:
            return {
                "kept": kept | "ClusterOfOne" >> beam.Map(lambda document: {**document, CLUSTER_SIZE: 1}),
                "removed": tuple(removed_parts),
                "stats": pipeline | "NoDedupe" >> beam.Create([(STAGE, zero)]),
            }

        others = tuple(part for index, part in enumerate(removed_parts) if index not in dedupe)
        kept_finals = kept | "KeptFinals" >> beam.Map(
            lambda d: (d["id"], (_KEPT, d["id"]))
        ).with_output_types(tuple[Any, Any])
        # Where each document's chain ends, by the position of the stage that removed it: a stage's kept
        # documents outlived it, so only the kept ones and what later stages removed can be pointed at.
        ends: dict[int, Any] = {
            index: part
            | f"DroppedFinals{index}"
            >> beam.Map(lambda d: (d["id"], (_DROPPED, d["stage"], d["reason"], d["id"]))).with_output_types(
                tuple[Any, Any]
            )
            for index, part in enumerate(removed_parts)
            if index not in dedupe and index > dedupe[0]
        }
        finals = []
        for index in reversed(dedupe):
            label = f"{self.stages[index]}{index}"
            later = [kept_finals, *(end for position, end in ends.items() if position > index)]
            statuses = tuple(later) | f"Statuses{label}" >> beam.Flatten()
            pointers = removed_parts[index] | f"Pointers{label}" >> beam.Map(_pointer).with_output_types(
                tuple[Any, Any]
            )
            ends[index] = (statuses, pointers) | f"Follow{label}" >> FollowOneStage(self.group_size)
            finals.append(ends[index])
        all_finals = tuple(finals) | "AllFinals" >> beam.Flatten()
        dedupe_removed = tuple(removed_parts[index] for index in dedupe) | "DedupeRemoved" >> beam.Flatten()

        rewritten = (
            (
                dedupe_removed | "RemovedById" >> beam.Map(lambda d: (d["id"], (_DOCUMENT, d))),
                all_finals | "FinalsById" >> beam.Map(lambda f: (f[0], (_DECISION, f[1]))),
            )
            | "RemovedAndFinals" >> beam.Flatten()
            | "JoinRemovedById" >> beam.GroupByKey()
            | "FinalRemovals" >> beam.FlatMap(_final_removal).with_outputs("stats", main="removed")
        )
        represented = (
            all_finals
            | "KeptEnds"
            >> beam.FlatMap(lambda f: [(f[1][1], 1)] if f[1][0] == _KEPT else []).with_output_types(
                tuple[Any, int]
            )
            | "SumRepresented" >> beam.CombinePerKey(sum)
        )
        sized = (
            (
                kept | "KeptById" >> beam.Map(lambda d: (d["id"], (_DOCUMENT, d))),
                represented | "RepresentedById" >> beam.Map(lambda r: (r[0], (_DECISION, r[1]))),
            )
            | "KeptAndSizes" >> beam.Flatten()
            | "JoinKeptById" >> beam.GroupByKey()
            | "ClusterSizes" >> beam.FlatMap(_with_cluster_size).with_outputs("stats", main="kept")
        )
        stats = (
            (
                pipeline | "StatsZero" >> beam.Create([zero]),
                dedupe_removed | "Followed" >> beam.Map(lambda _: {"removals_followed": 1}),
                rewritten.stats,
                sized.stats,
            )
            | "AllStats" >> beam.Flatten()
            | "SumStats" >> beam.CombineGlobally(StatsCombine(_MAX_STATS))
            | "StageStats" >> beam.Map(lambda numbers: (STAGE, numbers))
        )
        return {"kept": sized.kept, "removed": (*others, rewritten.removed), "stats": stats}
