"""`fuzzy_dedupe`: near-duplicate removal with MinHash LSH, as Beam transforms without hot keys.

A grouping stage of the curate recipe (see tokenmill.pipelines.recipe). Nothing is gathered on one
machine, and only ids and band keys move until the one join with the documents:

    documents -> MinHash signature -> 14 (band key, node) per document     (tokenmill.filters.minhash)
      -> GroupByKey per band bucket, iterated twice -> star edges (member -> the bucket's smallest node)
      -> connected components: `max_rounds` large-star / small-star rounds unrolled in the graph, each
         peeling off the components that have become stars; what is left is solved exactly
      -> GroupByKey by id: each document meets its label (the one shuffle of whole documents)
      -> kept: documents without near duplicates and each component's root; the other members are
         removed with reason `near_duplicate`, or with verification sent, whole, to a salted group of
         their root, checked against the root's shingles there, and kept or removed

**Nodes.** A document's node is its key `node_key(id)`: 16 hex digits of a 64-bit hash of the id, then
the id. Nodes compare by (hash, id), so the order of ids in the input (a chain of near duplicates whose
ids follow the chain, say) never lines up with the graph: every input is as good as randomly labelled.
The node that is smallest in this order is the component's root, the document that is kept.

**Connected components** (Kiveris et al., "Connected Components in MapReduce and Beyond", SoCC 2014).
Large-star: every node links its larger neighbours to the smallest node of its neighbourhood; small-star:
every node links itself and its smaller neighbours to the smallest of them. Each step is one GroupByKey
over the edges; alternating them turns each component into a star around its smallest node, on randomly
ordered nodes in about 1.2 log2(n) rounds for a chain of n (8 for 1,000, 11 for 10,000, 16 for 10^6,
measured with the same steps in plain Python). Beam has no loops, so `max_rounds` rounds are unrolled.
Each round also finds the components that are done: a root (no smaller neighbour) none of whose children
reports children of its own or a second parent is the centre of a finished star; the next round's
large-star labels its members and sends nothing on, so a finished component costs nothing later. What
the rounds leave (empty unless a component needs more rounds than `max_rounds`) is solved exactly by
union-find in one combine, whose memory is O(residual nodes) on one worker; stats count it
(`residual_edges`, `residual_nodes`). The result never depends on `max_rounds`: only its cost does.

**Verification.** LSH links A~B and B~C even when A and C are far apart, and components then remove C
as a duplicate of A. With `verify: containment` (the default) a member is removed only if at least
`threshold` of its distinct shingles appear in the root's (`jaccard`: the true Jaccard similarity of
the two shingle sets); a member that fails stays kept, in its component (`dup_cluster`). Members go to
their root in salted groups: (root, hash of the member mod ceil(size / verify_group_size)), and the
root's shingles go once to each salt, so a component of a million members is a thousand groups of about
a thousand members, each iterated one member at a time, and the root's shingles are shipped a thousand
times rather than a million.

Everything is a function of the set of documents: node keys decide the roots, and every reducer's output
is a function of its group's contents, whatever the worker count or the order of arrival.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from typing import Any

import apache_beam as beam
import numpy as np
from apache_beam.transforms.window import GlobalWindows

from tokenmill.filters.minhash import MAX_NGRAM, MinHasher, containment, jaccard
from tokenmill.pipelines.exact_dedupe import document_and_decision, salt_count
from tokenmill.pipelines.sinks import stable_hash

STAGE = "fuzzy_dedupe"
REASON = "near_duplicate"
VERIFY_METRICS = ("containment", "jaccard")
#: Rounds unrolled before the exact finish: enough for randomly ordered chains of ~10^7 nodes.
DEFAULT_ROUNDS = 20
#: Members per salted verification group.
VERIFY_GROUP_SIZE = 1000
#: Keys of the stage's stats that combine by maximum; every other number is summed.
_MAX_STATS = ("largest_component", "largest_bucket")
_HASH_DIGITS = 16

# Between the two steps of a round, messages travel beside the edges as strings that start with "~",
# which sorts after every node key (node keys start with a hex digit): the minimum of a group is a node
# whenever the group has one, and `value < _MESSAGE` tells a node from a message.
_MESSAGE = "~"
_ROOT = "~R"  # (node, _ROOT): the node has no smaller neighbour
_OTHER = "~O"  # (parent, _OTHER): a child that has children of its own, or another parent
_FINISHED = "~F"  # (root, _FINISHED): the root's component is a star

#: The element type of edges and messages: (node, node or message). Not tuple[str, str]: Beam encodes a
#: str-typed value with a Python callback (StrUtf8Coder), Any with its compiled FastPrimitivesCoder, and
#: the components of a 100,000-leaf star take half the Python calls that way.
_EDGE = tuple[Any, Any]

# Tags of the values of the id join and of the verification groups.
_DOCUMENT, _LABEL = 0, 1
_ROOT_SHINGLES, _MEMBER = 0, 1


def node_key(identifier: str) -> str:
    """A document's node in the graph: the 64-bit stable hash of its id in hex, then the id."""
    return f"{stable_hash(identifier):016x}{identifier}"


def node_id(key: str) -> str:
    """The document id of a node key."""
    return key[_HASH_DIGITS:]


def size_bucket(size: int) -> str:
    """The histogram bin of a component size: "2", "3", "4", then powers of two ("5-8", "9-16", ...)."""
    if size <= 4:
        return str(size)
    upper = 1 << (size - 1).bit_length()
    return f"{upper // 2 + 1}-{upper}"


def _component_stats(size: int) -> dict:
    return {
        "components": 1,
        "documents_in_components": size,
        "largest_component": size,
        "component_sizes": {size_bucket(size): 1},
    }


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


def _edge_hash(child: str, parent: str) -> int:
    return stable_hash(f"{child}\x00{parent}")


def _sum_fingerprints(fingerprints: Iterable[tuple[int, int]]) -> tuple[int, int]:
    """(edge count, sum of 64-bit edge hashes): equal for two rounds when nothing changed (and, but for a
    2^-64 chance, only then)."""
    count = total = 0
    for part_count, part_total in fingerprints:
        count += part_count
        total = (total + part_total) & (2**64 - 1)
    return count, total


class _Fingerprint(beam.DoFn):
    """Edges -> (round, (count, sum of edge hashes)), one partial per bundle: the edges are not copied."""

    def __init__(self, round_number: int):
        self.round_number = round_number

    def start_bundle(self):
        self.count = self.total = 0

    def process(self, edge: tuple[str, str]):
        if edge[1] < _MESSAGE:
            self.count += 1
            self.total += _edge_hash(*edge)
        return ()

    def finish_bundle(self):
        if self.count:
            yield GlobalWindows.windowed_value((self.round_number, (self.count, self.total & (2**64 - 1))))


class _BandKeys(beam.DoFn):
    """A batch of documents -> (band key, node) for every band of every document that has shingles."""

    def __init__(self, ngram: int, bands: int, rows: int, seed: int):
        self.params = (ngram, bands, rows, seed)

    def setup(self):
        self.hasher = MinHasher(*self.params)

    def process(self, batch):
        signatures, present = self.hasher.signatures([document["text"] for document in batch])
        for document, signature, has_shingles in zip(batch, signatures, present, strict=True):
            if not has_shingles:
                continue
            node = node_key(document["id"])
            for key in self.hasher.band_keys(signature):
                yield key, node
        yield beam.pvalue.TaggedOutput(
            "stats", {"documents": len(batch), "documents_without_words": int((~present).sum())}
        )


def _star_edges(bucket: tuple[bytes, Iterable[str]]):
    """The nodes of one band bucket -> (member, smallest node) edges: a star spans the bucket.

    Two passes over the grouped values (re-iterable in Beam, streamed from the shuffle on Dataflow): the
    smallest node and the count, then the edges. Memory is O(1) in the size of the bucket.
    """
    _, nodes = bucket
    smallest = None
    count = 0
    for node in nodes:
        count += 1
        if smallest is None or node < smallest:
            smallest = node
    if count < 2:
        return
    for node in nodes:
        if node != smallest:
            yield node, smallest
    yield beam.pvalue.TaggedOutput(
        "stats",
        {"colliding_buckets": 1, "bucket_pairs": count * (count - 1) // 2, "largest_bucket": count},
    )


# Edges are (larger node, smaller node) throughout: (child, parent).


def _oriented(pair: tuple[str, str]):
    first, second = pair
    if first > second:
        yield first, second
    elif second > first:
        yield second, first


def _neighbourhoods(element: tuple[str, str]):
    """An edge, both ways (each end is grouped with all its neighbours); a message, to its node only."""
    node, other = element
    yield node, other
    if other < _MESSAGE:
        yield other, node


def _label_star(root: str, values: Iterable[str]):
    """A finished star: (node, (root, size)) for the root and each of its children, and its stats.

    The edges of a star one round after it finished are distinct (each leaf's small-star emitted its
    edge once, and nothing else emitted it), so counting the children counts its members. Two passes."""
    size = 1 + sum(1 for value in values if root < value < _MESSAGE)
    label = (root, size)
    yield beam.pvalue.TaggedOutput("labels", (root, label))
    for value in values:
        if root < value < _MESSAGE:
            yield beam.pvalue.TaggedOutput("labels", (value, label))
    yield beam.pvalue.TaggedOutput("stats", _component_stats(size))


def _large_star(element: tuple[str, Iterable[str]]):
    """One node with all its neighbours (and maybe a finished-star message): large-star, and the node's
    part of the star check.

    Large-star links every larger neighbour to the smallest node of the neighbourhood (itself included).
    Star check: a node without smaller neighbours is a root and says so to itself (_ROOT); a node with
    children, or with two parents, tells each parent (_OTHER); a leaf (one parent, no children) says
    nothing. A root that got a finished-star message instead labels itself and its children and sends
    nothing on. Two passes over the grouped values; memory O(1) in the number of neighbours.
    """
    node, values = element
    parent = None
    several_parents = False
    has_children = False
    finished = False
    for value in values:
        if value < node:
            if parent is None:
                parent = value
            elif value != parent:
                several_parents = True
                if value < parent:
                    parent = value
        elif value < _MESSAGE:
            has_children = True
        else:
            finished = True
    if finished:
        yield from _label_star(node, values)
        return
    if has_children:
        smallest = node if parent is None else parent
        for value in values:
            if node < value < _MESSAGE:
                yield value, smallest
    if parent is None:
        yield node, _ROOT
    elif several_parents or has_children:
        for value in values:
            if value < node:
                yield value, _OTHER


def _small_star(element: tuple[str, Iterable[str]]):
    """One node with its smaller neighbours (and the star-check messages addressed to it): small-star, or
    the star check of a root.

    Small-star links the node and its smaller neighbours to the smallest of them. A root (it has no
    smaller neighbours, so messages are all it gets) that no child told _OTHER has only leaves: its
    component is a star, finished; it sends itself _FINISHED. Two passes; memory O(1) in the group.
    """
    node, values = element
    smallest = min(values)
    if smallest < _MESSAGE:
        for value in values:
            if smallest < value < _MESSAGE:
                yield value, smallest
        yield node, smallest
        return
    is_root = has_other = False
    for value in values:
        if value == _ROOT:
            is_root = True
        elif value == _OTHER:
            has_other = True
    if is_root and not has_other:
        yield node, _FINISHED


class _SmallStar(beam.DoFn):
    """Small-star (`_small_star`) for one round, with the fingerprint of the edges it emits: one partial
    (count, sum of edge hashes) per bundle, tagged 'fingerprint', so that the edges are not copied to
    compute it."""

    def __init__(self, round_number: int):
        self.round_number = round_number

    def start_bundle(self):
        self.count = self.total = 0

    def process(self, element: tuple[str, Iterable[str]]):
        for edge in _small_star(element):
            if edge[1] < _MESSAGE:
                self.count += 1
                self.total += _edge_hash(*edge)
            yield edge

    def finish_bundle(self):
        if self.count:
            yield beam.pvalue.TaggedOutput(
                "fingerprint",
                GlobalWindows.windowed_value((self.round_number, (self.count, self.total & (2**64 - 1)))),
            )


class _Round(beam.PTransform):
    """One round of connected components on (child, parent) edges and finished-star messages: large-star
    (one GroupByKey by node), then small-star (one GroupByKey by the larger end of each edge).

    Outputs the next round's edges and messages, the labels of the stars that finished a round ago, their
    stats, and the fingerprint of the new edges. Shuffle: every unfinished edge twice (both ways, then
    once) and one report per node.
    """

    def __init__(self, round_number: int):
        super().__init__()
        self.round_number = round_number

    def expand(self, edges):
        large = (
            edges
            | "Neighbourhoods" >> beam.FlatMap(_neighbourhoods).with_output_types(_EDGE)
            | "GroupNeighbourhoods" >> beam.GroupByKey()
            | "LargeStar"
            >> beam.FlatMap(_large_star)
            .with_output_types(_EDGE)
            .with_outputs("labels", "stats", main="edges")
        )
        small = (
            large.edges
            | "GroupSmaller" >> beam.GroupByKey()
            | "SmallStar"
            >> beam.ParDo(_SmallStar(self.round_number))
            .with_output_types(_EDGE)
            .with_outputs("fingerprint", main="edges")
        )
        return {
            "edges": small.edges,
            "labels": large.labels,
            "stats": large.stats,
            "fingerprint": small.fingerprint,
        }


def _by_parent(element: tuple[str, str]) -> tuple[str, str]:
    child, parent = element
    return element if parent >= _MESSAGE else (parent, child)


def _finish(element: tuple[str, Iterable[str]]):
    """After the last round, one node with its children: a finished star is labelled; anything else goes
    to the exact finish as (child, parent) edges. Two passes; memory O(1) in the number of children."""
    node, values = element
    if any(value >= _MESSAGE for value in values):
        yield from _label_star(node, values)
        return
    for value in values:
        yield value, node


def _find(parents: dict[str, str], node: str) -> str:
    parents.setdefault(node, node)
    root = node
    while parents[root] != root:
        root = parents[root]
    while parents[node] != root:  # path compression
        parents[node], node = root, parents[node]
    return root


def _union(parents: dict[str, str], first: str, second: str) -> None:
    """Join the sets of two nodes under the smaller root, so that every set's root is its smallest node."""
    first, second = _find(parents, first), _find(parents, second)
    if first < second:
        parents[second] = first
    elif second < first:
        parents[first] = second


class _UnionFind(beam.CombineFn):
    """Edges -> (parent pointer per node, edge count): the exact components of what the rounds left.

    Memory O(residual nodes), on the one worker that merges the accumulators (the per-bundle
    accumulators before it hold their own share)."""

    def create_accumulator(self) -> tuple[dict[str, str], int]:
        return {}, 0

    def add_input(self, accumulator, edge):
        parents, count = accumulator
        _union(parents, edge[0], edge[1])
        return parents, count + 1

    def merge_accumulators(self, accumulators):
        accumulators = iter(accumulators)
        parents, count = next(accumulators)
        for other, other_count in accumulators:
            for node, parent in other.items():
                _union(parents, node, parent)
            count += other_count
        return parents, count

    def extract_output(self, accumulator):
        return accumulator


def _residual_labels(solved: tuple[dict[str, str], int]):
    """The exact finish's components -> (node, (root, size)) labels and stats."""
    parents, edges = solved
    roots = {node: _find(parents, node) for node in list(parents)}
    sizes = Counter(roots.values())
    for node, root in roots.items():
        yield node, (root, sizes[root])
    yield beam.pvalue.TaggedOutput("stats", {"residual_edges": edges, "residual_nodes": len(roots)})
    for size in sizes.values():
        yield beam.pvalue.TaggedOutput("stats", _component_stats(size))


def _rounds_stats(fingerprints: list[tuple[int, tuple[int, int]]], max_rounds: int) -> dict:
    """The candidate edges' count, and how many rounds changed the edge set (round -1 is the candidate
    edges themselves; a round with no edges has no fingerprint)."""
    by_round = dict(fingerprints)
    ordered = [by_round.get(round_number, (0, 0)) for round_number in range(-1, max_rounds)]
    changed = sum(1 for before, after in zip(ordered, ordered[1:], strict=False) if before != after)
    return {"candidate_pairs": ordered[0][0], "rounds": max_rounds, "rounds_that_changed_edges": changed}


class ConnectedComponents(beam.PTransform):
    """(node, node) pairs -> {"labels": (node, (root, component size)) for every node of an edge, "stats":
    dicts of numbers}. The root of a component is its smallest node; nodes are node keys (`node_key`),
    so that order is a hash order, or any strings that start with a character below "~".

    `max_rounds` large-star / small-star rounds are unrolled (see the module docstring), then what is
    not finished is solved exactly: the labels are the true connected components for any `max_rounds`.

    Memory and shuffle at 10 TB on 1,000 workers: each round shuffles the unfinished edges about three
    times (both ways by node, once by the larger end, one report per node); finished components leave
    after the round that finishes them, so late rounds carry only the long chains. Per worker, each
    group (a node and its neighbours, the largest being a star's root with all its members) is iterated
    twice and never held: O(1) memory in its size. The exact finish holds the residual graph on one
    worker: O(residual nodes), zero when every component finished within `max_rounds`.
    """

    def __init__(self, max_rounds: int = DEFAULT_ROUNDS):
        super().__init__()
        if not isinstance(max_rounds, int) or max_rounds < 1:
            raise ValueError(f"max_rounds must be a positive integer, got {max_rounds!r}")
        self.max_rounds = max_rounds

    def expand(self, pairs):
        max_rounds = self.max_rounds
        edges = (
            pairs
            | "Orient" >> beam.FlatMap(_oriented).with_output_types(_EDGE)
            | "Distinct" >> beam.Distinct()
        )
        stats_parts = []
        label_parts = []
        fingerprints = [edges | "FingerprintInput" >> beam.ParDo(_Fingerprint(-1))]
        for round_number in range(max_rounds):
            result = edges | f"Round{round_number}" >> _Round(round_number)
            edges = result["edges"]
            label_parts.append(result["labels"])
            stats_parts.append(result["stats"])
            fingerprints.append(result["fingerprint"])
        # Every round's fingerprint partials go to one combine: one stage, not one per round.
        stats_parts.append(
            tuple(fingerprints)
            | "AllRounds" >> beam.Flatten()
            | "Fingerprints" >> beam.CombinePerKey(_sum_fingerprints)
            | "FingerprintList" >> beam.combiners.ToList()
            | "RoundsStat" >> beam.Map(_rounds_stats, max_rounds)
        )
        finished = (
            edges
            | "KeyByParent" >> beam.Map(_by_parent).with_output_types(_EDGE)
            | "GroupChildren" >> beam.GroupByKey()
            | "Finish"
            >> beam.FlatMap(_finish).with_output_types(_EDGE).with_outputs("labels", "stats", main="residual")
        )
        label_parts.append(finished.labels)
        stats_parts.append(finished.stats)
        residual = (
            finished.residual
            | "DistinctResidual" >> beam.Distinct()
            | "SolveResidual" >> beam.CombineGlobally(_UnionFind())
            | "ResidualLabels" >> beam.FlatMap(_residual_labels).with_outputs("stats", main="labels")
        )
        label_parts.append(residual.labels)
        stats_parts.append(residual.stats)
        labels = tuple(label_parts) | "AllLabels" >> beam.Flatten()
        stats = tuple(stats_parts) | "AllStats" >> beam.Flatten()
        return {"labels": labels, "stats": stats}


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
    """id -> its document and its label (if it has near duplicates): kept (main output), removed, or,
    with verification, sent to its root's salted group ('verify'), where the root sends its shingles
    once per salt."""

    def __init__(self, hasher_params: tuple[int, int, int, int], verify: str | None, group_size: int):
        self.hasher_params = hasher_params
        self.verify = verify
        self.group_size = group_size

    def setup(self):
        self.hasher = MinHasher(*self.hasher_params)

    def process(self, element):
        identifier, values = element
        document, label = document_and_decision(STAGE, identifier, values)
        if document is None:  # cannot happen: every node comes from a document
            raise RuntimeError(f"{STAGE}: a label for {identifier!r}, which has no document")
        if label is None:  # no near duplicates
            yield document
            return
        root, size = label
        root_id = node_id(root)
        document = {**document, "dup_cluster": root_id}
        salts = salt_count(size, self.group_size)
        if root_id == identifier:
            yield beam.pvalue.TaggedOutput("stats", {"kept_with_duplicates": 1})
            if self.verify:
                shingles = self.hasher.shingles(document["text"]).tobytes()
                for salt in range(salts):
                    yield beam.pvalue.TaggedOutput("verify", ((root, salt), (_ROOT_SHINGLES, shingles)))
            yield document
        elif self.verify:
            salt = stable_hash(identifier) % salts
            yield beam.pvalue.TaggedOutput("verify", ((root, salt), (_MEMBER, (document, size))))
        else:
            yield beam.pvalue.TaggedOutput("stats", _removal_stats(document))
            yield beam.pvalue.TaggedOutput("removed", _removed(document, root_id, size))


class _Verify(beam.DoFn):
    """One salted group of a component: its members, each removed if similar enough to the root, else
    kept (still in its component). Two passes: the root's shingles, then the members one at a time, so
    memory is the root's shingles plus one member, whatever the group's size."""

    def __init__(self, hasher_params: tuple[int, int, int, int], metric: str, threshold: float):
        self.hasher_params = hasher_params
        self.metric = metric
        self.threshold = threshold

    def setup(self):
        self.hasher = MinHasher(*self.hasher_params)

    def process(self, element):
        (root, _), values = element
        root_shingles = next((value for tag, value in values if tag == _ROOT_SHINGLES), None)
        if root_shingles is None:  # cannot happen: a root sends its shingles to every salt
            raise RuntimeError(f"{STAGE}: no shingles from the root {node_id(root)!r} for verification")
        theirs = np.frombuffer(root_shingles, np.uint64)
        for tag, value in values:
            if tag != _MEMBER:
                continue
            document, size = value
            mine = self.hasher.shingles(document["text"])
            similarity = containment(mine, theirs) if self.metric == "containment" else jaccard(mine, theirs)
            similarity = round(similarity, 4)
            if similarity >= self.threshold:
                yield beam.pvalue.TaggedOutput("stats", _removal_stats(document))
                yield beam.pvalue.TaggedOutput(
                    "removed", _removed(document, node_id(root), size, {self.metric: similarity})
                )
            else:
                yield beam.pvalue.TaggedOutput("stats", {"verification_kept": 1})
                yield document


class FuzzyDedupe(beam.PTransform):
    """Near-duplicate removal with MinHash LSH and connected components (see the module docstring).

    Parameters (the recipe's `fuzzy_dedupe:` mapping): `ngram` words per shingle (5), `bands` x `rows`
    of the LSH banding (14 x 8), `seed` of the permutations (1), `max_rounds` of connected components
    unrolled before the exact finish (20), `verify` (`containment`, `jaccard` or `none`) with its
    `threshold` (0.7), `verify_group_size` (members per verification group, 1,000) and `batch_size`
    (documents per signature batch, 256).

    Memory and shuffle at 10 TB on 1,000 workers: band keys and node keys (14 x ~60 bytes a document)
    are shuffled once by bucket; the candidate edges (ids only) a few times per round while their
    component is unfinished (see ConnectedComponents); whole documents once, by id, one document per
    group; with verification, the members of components once more, to their root's salted group, and
    the roots' shingles once per salt (ceil(size / verify_group_size) copies). Per worker: one batch
    of signatures, and one document (plus, in verification, one root's shingles) at a time: every
    group, a million-member bucket or component included, is iterated, never held.
    """

    stage = STAGE

    def __init__(
        self,
        ngram: int = 5,
        bands: int = 14,
        rows: int = 8,
        seed: int = 1,
        max_rounds: int = DEFAULT_ROUNDS,
        verify: str | None = "containment",
        threshold: float = 0.7,
        batch_size: int = 256,
        verify_group_size: int = VERIFY_GROUP_SIZE,
        on_unconverged: str | None = None,
    ):
        super().__init__()
        if on_unconverged is not None:
            raise ValueError(
                "on_unconverged is gone: connected components now always converge (the rounds are "
                "followed by an exact finish of whatever they leave), so there is nothing to fail or keep; "
                "remove it from the recipe (max_rounds now only trades rounds for the finish's memory)"
            )
        if not isinstance(ngram, int) or not 1 <= ngram <= MAX_NGRAM:
            raise ValueError(f"ngram must be an integer in 1..{MAX_NGRAM}, got {ngram!r}")
        for name, value in (
            ("bands", bands),
            ("rows", rows),
            ("max_rounds", max_rounds),
            ("batch_size", batch_size),
            ("verify_group_size", verify_group_size),
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
        MinHasher(ngram, bands, rows, seed)  # its own checks, now rather than on the workers
        self.ngram = ngram
        self.bands = bands
        self.rows = rows
        self.seed = seed
        self.max_rounds = max_rounds
        self.verify = verify
        self.threshold = float(threshold)
        self.batch_size = batch_size
        self.verify_group_size = verify_group_size

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
                        "residual_edges": 0,
                        "residual_nodes": 0,
                        "kept_with_duplicates": 0,
                        "removed_documents": 0,
                        "removed_characters": 0,
                        "verification_kept": 0,
                        "bands": self.bands,
                        "rows": self.rows,
                        "ngram": self.ngram,
                    }
                ]
            )
        ]

        # Signatures, band buckets, candidate edges: node keys only.
        bands = (
            documents
            | "BatchForSignatures"
            >> beam.BatchElements(min_batch_size=self.batch_size, max_batch_size=self.batch_size)
            | "BandKeys"
            >> beam.ParDo(_BandKeys(*hasher_params))
            .with_output_types(tuple[bytes, Any])
            .with_outputs("stats", main="keys")
        )
        stats_parts.append(bands.stats)
        buckets = (
            bands.keys
            | "GroupByBand" >> beam.GroupByKey()
            | "StarEdges"
            >> beam.FlatMap(_star_edges).with_output_types(_EDGE).with_outputs("stats", main="edges")
        )
        stats_parts.append(buckets.stats)
        components = buckets.edges | "Components" >> ConnectedComponents(self.max_rounds)
        stats_parts.append(components["stats"])

        # The one join of whole documents: each meets its label (if any) by id.
        decided = (
            (
                documents | "KeyById" >> beam.Map(lambda document: (document["id"], (_DOCUMENT, document))),
                components["labels"]
                | "LabelsById" >> beam.Map(lambda label: (node_id(label[0]), (_LABEL, label[1]))),
            )
            | "DocumentsAndLabels" >> beam.Flatten()
            | "JoinById" >> beam.GroupByKey()
            | "Decide"
            >> beam.ParDo(_Decide(hasher_params, self.verify, self.verify_group_size)).with_outputs(
                "removed", "stats", "verify", main="kept"
            )
        )
        stats_parts.append(decided.stats)
        kept_parts = [decided.kept]
        removed_parts = [decided.removed]
        if self.verify:
            verified = (
                decided.verify
                | "GroupBySaltedRoot" >> beam.GroupByKey()
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
