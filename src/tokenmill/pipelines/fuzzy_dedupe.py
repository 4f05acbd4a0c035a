"""`fuzzy_dedupe`: near-duplicate removal with MinHash LSH, as Beam transforms that scale like exact dedupe.

A grouping stage of the curate recipe (see tokenmill.pipelines.recipe). Nothing is gathered on one
machine: every step below is a Beam transform keyed by a band bucket, a document id or a component.

    documents -> MinHash signature -> 14 band keys per document        (tokenmill.filters.minhash)
      -> GroupByKey per band bucket -> star edges (member -> smallest id in the bucket), distinct
      -> connected components: large-star / small-star rounds, unrolled up to `max_rounds`
      -> star check: every node points at its component's smallest id, or the run fails (or keeps)
      -> CoGroupByKey with the documents by id: the smallest id of each component is kept, the others
         removed with reason `near_duplicate` (optionally only after verification against the kept copy)

Connected components (Kiveris et al., "Connected Components in MapReduce and Beyond", SoCC 2014): an edge
set is rewritten by two steps, each one GroupByKey. Large-star: every node links its larger neighbours
to the smallest id of its neighbourhood; small-star: every node links itself and its smaller neighbours
to the smallest of them. The edge set stops changing exactly when it is a forest of stars, each centred
on its component's smallest id; that takes O(log^2 n) rounds (a handful in practice). Beam has no
loops, so `max_rounds` rounds are unrolled in the graph; a round on a converged edge set changes nothing
and costs one pass over the (small) edge set. A fingerprint of each round's edges tells in stats how
many rounds changed anything, and a final check proves convergence: a node that has a parent and
children, or two parents, is not a star leaf. By default that fails the run, loudly; with
`on_unconverged: keep` such documents are kept (never removed without a resolved component) and counted.

Everything is a function of the set of documents: ids decide the roots, sets decide the reducers'
output, so the result is the same whatever the worker count or the order of arrival.

Chains: LSH links A~B and B~C even when A and C are far apart, and connected components then remove C
as a duplicate of A. With `verify: containment` (the default) a member is removed only if at least
`threshold` of its distinct shingles appear in the kept document (`jaccard`: the true Jaccard
similarity of the two shingle sets); a member that fails stays kept, in its component (`dup_cluster`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable

import apache_beam as beam
import numpy as np

from tokenmill.filters.minhash import MAX_NGRAM, MinHasher, containment, jaccard

STAGE = "fuzzy_dedupe"
REASON = "near_duplicate"
VERIFY_METRICS = ("containment", "jaccard")
UNCONVERGED_POLICIES = ("fail", "keep")
#: Keys of the stage's stats that combine by maximum; every other number is summed.
_MAX_STATS = ("largest_component", "largest_bucket")


class ComponentsNotConverged(RuntimeError):
    """Connected components still had chained nodes after `max_rounds` rounds."""


def size_bucket(size: int) -> str:
    """The histogram bin of a component size: "2", "3", "4", then powers of two ("5-8", "9-16", ...)."""
    if size <= 4:
        return str(size)
    upper = 1 << (size - 1).bit_length()
    return f"{upper // 2 + 1}-{upper}"


def _stable_hash(text: str) -> int:
    return int.from_bytes(
        hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little"
    )


class _StatsCombine(beam.CombineFn):
    """Sums dicts of numbers (histograms nested one level), taking the maximum for `_MAX_STATS` keys."""

    def create_accumulator(self):
        return {}

    def add_input(self, accumulator, element):
        for key, value in element.items():
            if isinstance(value, dict):
                nested = accumulator.setdefault(key, {})
                for inner, number in value.items():
                    nested[inner] = nested.get(inner, 0) + number
            elif key in _MAX_STATS:
                accumulator[key] = max(accumulator.get(key, 0), value)
            else:
                accumulator[key] = accumulator.get(key, 0) + value
        return accumulator

    def merge_accumulators(self, accumulators):
        merged = {}
        for accumulator in accumulators:
            self.add_input(merged, accumulator)
        return merged

    def extract_output(self, accumulator):
        return accumulator


class _EdgeFingerprint(beam.CombineFn):
    """(edge count, sum of 64-bit edge hashes): equal for two rounds when nothing changed (and, but for a
    2^-64 chance, only then)."""

    def create_accumulator(self):
        return 0, 0

    def add_input(self, accumulator, edge):
        return accumulator[0] + 1, (accumulator[1] + _stable_hash(f"{edge[0]}\x00{edge[1]}")) & (2**64 - 1)

    def merge_accumulators(self, accumulators):
        count = total = 0
        for accumulator_count, accumulator_total in accumulators:
            count += accumulator_count
            total = (total + accumulator_total) & (2**64 - 1)
        return count, total

    def extract_output(self, accumulator):
        return accumulator


class _BandKeys(beam.DoFn):
    """A batch of documents -> (band key, id) for every band of every document that has shingles."""

    def __init__(self, ngram: int, bands: int, rows: int, seed: int):
        self.params = (ngram, bands, rows, seed)

    def setup(self):
        self.hasher = MinHasher(*self.params)

    def process(self, batch):
        signatures, present = self.hasher.signatures([document["text"] for document in batch])
        for document, signature, has_shingles in zip(batch, signatures, present, strict=True):
            if not has_shingles:
                continue
            for key in self.hasher.band_keys(signature):
                yield key, document["id"]
        yield beam.pvalue.TaggedOutput(
            "stats", {"documents": len(batch), "documents_without_words": int((~present).sum())}
        )


def _star_edges(bucket: tuple[bytes, Iterable[str]]):
    """The documents of one band bucket -> (member, smallest id) edges: a star spans the bucket."""
    _, ids = bucket
    members = sorted(set(ids))
    if len(members) > 1:
        root = members[0]
        for member in members[1:]:
            yield member, root
        yield beam.pvalue.TaggedOutput(
            "stats",
            {
                "colliding_buckets": 1,
                "bucket_pairs": len(members) * (len(members) - 1) // 2,
                "largest_bucket": len(members),
            },
        )


# Edges are (larger id, smaller id) throughout: (child, parent) once the forest is made of stars.


def _both_directions(edge: tuple[str, str]):
    yield edge[0], edge[1]
    yield edge[1], edge[0]


def _large_star(element: tuple[str, Iterable[str]]):
    """Link every larger neighbour of a node to the smallest id of its neighbourhood (itself included)."""
    node, neighbours = element
    neighbours = set(neighbours)
    smallest = min(min(neighbours), node)
    for neighbour in neighbours:
        if neighbour > node:
            yield neighbour, smallest


def _to_larger(edge: tuple[str, str]):
    child, parent = edge
    return (child, parent) if child > parent else (parent, child)


def _small_star(element: tuple[str, Iterable[str]]):
    """Link a node and its smaller neighbours to the smallest of them."""
    node, smaller = element
    smaller = set(smaller)
    smallest = min(smaller)
    for member in smaller | {node}:
        if member != smallest:
            yield member, smallest


class _LargeStarSmallStar(beam.PTransform):
    """One round of connected components: a large-star step, then a small-star step."""

    def expand(self, edges):
        return (
            edges
            | "BothDirections" >> beam.FlatMap(_both_directions).with_output_types(tuple[str, str])
            | "GroupNeighbours" >> beam.GroupByKey()
            | "LargeStar" >> beam.FlatMap(_large_star).with_output_types(tuple[str, str])
            | "KeyByLarger" >> beam.Map(_to_larger).with_output_types(tuple[str, str])
            | "GroupSmaller" >> beam.GroupByKey()
            | "SmallStar" >> beam.FlatMap(_small_star).with_output_types(tuple[str, str])
        )


def _roles(edge: tuple[str, str]):
    child, parent = edge
    yield child, ("parent", parent)
    yield parent, ("child", child)


def _resolve(element: tuple[str, Iterable[tuple[str, str]]]):
    """Star check for one node: a root labels itself and its children (id -> (root, component size));
    a node with a parent and children, or with two parents, is a chain the rounds did not flatten."""
    node, roles = element
    parents = set()
    children = set()
    for role, other in roles:
        (parents if role == "parent" else children).add(other)
    if len(parents) > 1 or (parents and children):
        yield beam.pvalue.TaggedOutput("unconverged", node)
    elif not parents:  # a root (a leaf, with one parent and no children, is labelled by its root)
        size = len(children) + 1
        yield node, (node, size)
        for child in children:
            yield child, (node, size)
        yield beam.pvalue.TaggedOutput(
            "stats",
            {
                "components": 1,
                "documents_in_components": size,
                "largest_component": size,
                "component_sizes": {size_bucket(size): 1},
            },
        )


def _rounds_stats(fingerprints: list[tuple[int, tuple[int, int]]], max_rounds: int) -> dict:
    """How many rounds changed the edge set (round -1 is the candidate edges themselves; a round with no
    edges at all has no fingerprint, and there is nothing to change)."""
    by_round = dict(fingerprints)
    ordered = [by_round.get(round_number, (0, 0)) for round_number in range(-1, max_rounds)]
    changed = sum(1 for before, after in zip(ordered, ordered[1:], strict=False) if before != after)
    return {"rounds": max_rounds, "rounds_that_changed_edges": changed}


def _convergence_stats(unconverged: int, max_rounds: int, policy: str) -> dict:
    if unconverged and policy == "fail":
        raise ComponentsNotConverged(
            f"{STAGE}: connected components did not converge in max_rounds={max_rounds} rounds: "
            f"{unconverged} documents are still chained; raise max_rounds in the recipe (or set "
            f"on_unconverged: keep to keep such documents)"
        )
    return {"converged": int(unconverged == 0), "unconverged_nodes": unconverged}


class ConnectedComponents(beam.PTransform):
    """(id, id) edges -> {"labels": (id, (component's smallest id, component size)) for every node,
    "stats": dicts of numbers}, computed in Beam with `max_rounds` unrolled large-star/small-star rounds.

    Convergence is checked at the end: with `on_unconverged="fail"` a graph that the rounds did not
    flatten into stars fails the pipeline (ComponentsNotConverged); with "keep", chained nodes get no
    label from their chain (so they are not removed) and `unconverged_nodes` counts them.
    """

    def __init__(self, max_rounds: int = 12, on_unconverged: str = "fail"):
        super().__init__()
        self.max_rounds = max_rounds
        self.on_unconverged = on_unconverged

    def expand(self, pairs):
        max_rounds, policy = self.max_rounds, self.on_unconverged
        edges = (
            pairs
            | "Orient" >> beam.Map(_to_larger).with_output_types(tuple[str, str])
            | "Distinct" >> (beam.Distinct())
        )
        edges = edges | "NoSelfLoops" >> beam.Filter(lambda edge: edge[0] != edge[1])
        stats_parts = [
            edges
            | "CountEdges" >> beam.combiners.Count.Globally()
            | "EdgesStat" >> beam.Map(lambda count: {"candidate_pairs": count})
        ]
        # Every round's edges, tagged with the round, go to one combine: one stage, not one per round.
        tagged = [edges | "TagInput" >> beam.Map(lambda edge: (-1, edge))]
        for round_number in range(max_rounds):
            edges = edges | f"Round{round_number}" >> _LargeStarSmallStar()
            tagged.append(edges | f"Tag{round_number}" >> beam.Map(lambda edge, n=round_number: (n, edge)))
        stats_parts.append(
            tuple(tagged)
            | "AllRounds" >> beam.Flatten()
            | "Fingerprints" >> beam.CombinePerKey(_EdgeFingerprint())
            | "FingerprintList" >> beam.combiners.ToList()
            | "RoundsStat" >> beam.Map(_rounds_stats, max_rounds)
        )
        resolved = (
            edges
            | "Roles" >> beam.FlatMap(_roles).with_output_types(tuple[str, tuple[str, str]])
            | "GroupRoles" >> beam.GroupByKey()
            | "StarCheck"
            >> beam.FlatMap(_resolve)
            .with_output_types(tuple[str, tuple[str, int]])
            .with_outputs("unconverged", "stats", main="labels")
        )
        stats_parts.append(resolved.stats)
        stats_parts.append(
            resolved.unconverged
            | "CountUnconverged" >> beam.combiners.Count.Globally()
            | "ConvergenceCheck" >> beam.Map(_convergence_stats, max_rounds, policy)
        )
        stats = tuple(stats_parts) | "AllStats" >> beam.Flatten()
        return {"labels": resolved.labels, "stats": stats}


def _removed(document: dict, root: str, size: int, extra: dict | None = None) -> dict:
    detail = {"kept_id": root, "dup_cluster": root, "component_size": size, **(extra or {})}
    return {
        **document,
        "dup_cluster": root,
        "stage": STAGE,
        "reason": REASON,
        "detail": json.dumps(detail, sort_keys=True),
    }


def _removal_stats(document: dict) -> dict:
    n_chars = document.get("n_chars")
    return {
        "removed_documents": 1,
        "removed_characters": len(document["text"]) if n_chars is None else n_chars,
    }


class _Decide(beam.DoFn):
    """id -> (documents, labels): kept (main), removed, or, with verification, sent on to be checked."""

    def __init__(self, hasher_params: tuple[int, int, int, int], verify: str | None):
        self.hasher_params = hasher_params
        self.verify = verify

    def setup(self):
        self.hasher = MinHasher(*self.hasher_params)

    def process(self, element):
        identifier, grouped = element
        # Documents that share an id (an input anomaly) are all decided alike, in a fixed order.
        documents = sorted(grouped["document"], key=lambda document: document["text"])
        labels = set(grouped["label"])
        if len(labels) != 1:
            # No label: not a near-duplicate of anything. Two: two roots claim it, which happens only
            # before convergence (with on_unconverged: keep); it is kept and counted.
            if labels:
                yield beam.pvalue.TaggedOutput("stats", {"unresolved_documents": len(documents)})
            yield from documents
        else:
            yield from self._decide(identifier, documents, *next(iter(labels)))

    def _decide(self, identifier: str, documents: list[dict], root: str, size: int):
        documents = [{**document, "dup_cluster": root} for document in documents]
        if identifier == root:
            yield beam.pvalue.TaggedOutput("stats", {"kept_with_duplicates": len(documents)})
            if self.verify and documents:
                shingles = self.hasher.shingles(documents[0]["text"])
                yield beam.pvalue.TaggedOutput("root_shingles", (root, shingles.tobytes()))
            yield from documents
        else:
            yield from self._members(identifier, documents, root, size)

    def _members(self, identifier: str, documents: list[dict], root: str, size: int):
        for document in documents:
            if self.verify:
                yield beam.pvalue.TaggedOutput("pending", (identifier, (document, size)))
            else:
                yield beam.pvalue.TaggedOutput("stats", _removal_stats(document))
                yield beam.pvalue.TaggedOutput("removed", _removed(document, root, size))
        if self.verify and documents:
            yield beam.pvalue.TaggedOutput("member_of", (root, identifier))


def _fan_out_root(element):
    """root -> (its shingles, its members) => (member, (root, root shingles)) for every member."""
    root, grouped = element
    for shingles in list(grouped["shingles"])[:1]:  # one root document per id (the first, if ids repeat)
        for member in grouped["members"]:
            yield member, (root, shingles)


class _Verify(beam.DoFn):
    """A member and its root's shingles: removed if similar enough, else kept (still in its component)."""

    def __init__(self, hasher_params: tuple[int, int, int, int], metric: str, threshold: float):
        self.hasher_params = hasher_params
        self.metric = metric
        self.threshold = threshold

    def setup(self):
        self.hasher = MinHasher(*self.hasher_params)

    def process(self, element):
        _, grouped = element
        roots = list(grouped["root"])
        for document, size in grouped["document"]:
            if not roots:  # cannot happen: every pending member has a root
                yield document
                continue
            root, root_bytes = roots[0]
            mine = self.hasher.shingles(document["text"])
            theirs = np.frombuffer(root_bytes, np.uint64)
            similarity = containment(mine, theirs) if self.metric == "containment" else jaccard(mine, theirs)
            similarity = round(similarity, 4)
            if similarity >= self.threshold:
                yield beam.pvalue.TaggedOutput("stats", _removal_stats(document))
                yield beam.pvalue.TaggedOutput(
                    "removed", _removed(document, root, size, {self.metric: similarity})
                )
            else:
                yield beam.pvalue.TaggedOutput("stats", {"verification_kept": 1})
                yield document


class FuzzyDedupe(beam.PTransform):
    """Near-duplicate removal with MinHash LSH and connected components (see the module docstring).

    Parameters (the recipe's `fuzzy_dedupe:` mapping): `ngram` words per shingle (5), `bands` x `rows`
    of the LSH banding (14 x 8), `seed` of the permutations (1), `max_rounds` of connected components
    (12), `verify` (`containment`, `jaccard` or `none`) with its `threshold` (0.7), `on_unconverged`
    (`fail` or `keep`) and `batch_size` (documents per signature batch, 256).
    """

    stage = STAGE

    def __init__(
        self,
        ngram: int = 5,
        bands: int = 14,
        rows: int = 8,
        seed: int = 1,
        max_rounds: int = 12,
        verify: str | None = "containment",
        threshold: float = 0.7,
        on_unconverged: str = "fail",
        batch_size: int = 256,
    ):
        super().__init__()
        if not isinstance(ngram, int) or not 1 <= ngram <= MAX_NGRAM:
            raise ValueError(f"ngram must be an integer in 1..{MAX_NGRAM}, got {ngram!r}")
        for name, value in (
            ("bands", bands),
            ("rows", rows),
            ("max_rounds", max_rounds),
            ("batch_size", batch_size),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        if verify in (None, "none", False):
            verify = None
        elif verify not in VERIFY_METRICS:
            raise ValueError(f"verify must be one of {', '.join(VERIFY_METRICS)} or none, got {verify!r}")
        if not isinstance(threshold, int | float) or not 0.0 < threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {threshold!r}")
        if on_unconverged not in UNCONVERGED_POLICIES:
            raise ValueError(
                f"on_unconverged must be one of {', '.join(UNCONVERGED_POLICIES)}, got {on_unconverged!r}"
            )
        MinHasher(ngram, bands, rows, seed)  # its own checks, now rather than on the workers
        self.ngram = ngram
        self.bands = bands
        self.rows = rows
        self.seed = seed
        self.max_rounds = max_rounds
        self.verify = verify
        self.threshold = float(threshold)
        self.on_unconverged = on_unconverged
        self.batch_size = batch_size

    def expand(self, documents):
        hasher_params = (self.ngram, self.bands, self.rows, self.seed)
        stats_parts = [
            documents.pipeline
            | "StatsZero"
            >> beam.Create(
                [
                    {
                        "documents": 0,
                        "documents_without_words": 0,
                        "colliding_buckets": 0,
                        "bucket_pairs": 0,
                        "largest_bucket": 0,
                        "candidate_pairs": 0,
                        "components": 0,
                        "documents_in_components": 0,
                        "largest_component": 0,
                        "component_sizes": {},
                        "kept_with_duplicates": 0,
                        "removed_documents": 0,
                        "removed_characters": 0,
                        "verification_kept": 0,
                        "unresolved_documents": 0,
                        "bands": self.bands,
                        "rows": self.rows,
                        "ngram": self.ngram,
                    }
                ]
            )
        ]

        # Signatures, band buckets, candidate edges.
        bands = (
            documents
            | "BatchForSignatures"
            >> beam.BatchElements(min_batch_size=self.batch_size, max_batch_size=self.batch_size)
            | "BandKeys"
            >> beam.ParDo(_BandKeys(*hasher_params))
            .with_output_types(tuple[bytes, str])
            .with_outputs("stats", main="keys")
        )
        stats_parts.append(bands.stats)
        buckets = (
            bands.keys
            | "GroupByBand" >> beam.GroupByKey()
            | "StarEdges"
            >> beam.FlatMap(_star_edges)
            .with_output_types(tuple[str, str])
            .with_outputs("stats", main="edges")
        )
        stats_parts.append(buckets.stats)
        components = buckets.edges | "Components" >> ConnectedComponents(self.max_rounds, self.on_unconverged)
        stats_parts.append(components["stats"])

        # Decisions, joined with the documents by id.
        decided = (
            {
                "document": documents | "KeyById" >> beam.Map(lambda document: (document["id"], document)),
                "label": components["labels"],
            }
            | "JoinLabels" >> beam.CoGroupByKey()
            | "Decide"
            >> beam.ParDo(_Decide(hasher_params, self.verify)).with_outputs(
                "removed", "stats", "pending", "member_of", "root_shingles", main="kept"
            )
        )
        stats_parts.append(decided.stats)
        kept_parts = [decided.kept]
        removed_parts = [decided.removed]
        if self.verify:
            root_copies = (
                {"shingles": decided.root_shingles, "members": decided.member_of}
                | "JoinRoots" >> beam.CoGroupByKey()
                | "FanOutRoot" >> beam.FlatMap(_fan_out_root)
            )
            verified = (
                {"document": decided.pending, "root": root_copies}
                | "JoinMembers" >> beam.CoGroupByKey()
                | "Verify"
                >> beam.ParDo(_Verify(hasher_params, self.verify, self.threshold)).with_outputs(
                    "removed", "stats", main="kept"
                )
            )
            kept_parts.append(verified.kept)
            removed_parts.append(verified.removed)
            stats_parts.append(verified.stats)

        stats = (
            tuple(stats_parts)
            | "AllStats" >> beam.Flatten()
            | "SumStats" >> beam.CombineGlobally(_StatsCombine())
            | "StageStats" >> beam.Map(lambda numbers: (STAGE, numbers))
        )
        kept = tuple(kept_parts) | "AllKept" >> beam.Flatten()
        removed = tuple(removed_parts) | "AllRemoved" >> beam.Flatten()
        return {"kept": kept, "removed": removed, "stats": stats}
