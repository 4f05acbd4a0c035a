"""`fuzzy_dedupe`: near-duplicate removal with MinHash LSH, as Beam transforms without hot keys.

A grouping stage of the curate recipe (see tokenmill.pipelines.recipe). Near-duplicate pairs are decided
before connected components, and only ids, compact signatures and band keys move until the one join with
the documents:

    documents -> MinHash signature -> 20 (band key, member) per document    (tokenmill.filters.minhash)
      -> GroupByKey per band bucket: the bucket's candidate pairs verified by the estimate of their
         similarity from the two signatures (every pair of a bucket of up to `bucket_cap` members; each
         member against `representatives` of a larger one, the rest counted as capped)
      -> verified edges: a spanning forest of the bucket's similar pairs (member -> the smallest node of
         its similar group), at most members - 1 per bucket
      -> connected components over the verified edges: `max_rounds` large-star / small-star rounds
         unrolled in the graph, each peeling off the components that have become stars; what is left
         is solved exactly
      -> GroupByKey by id: each document meets its label (the one shuffle of whole documents)
      -> kept: documents without near duplicates and each component's root; the other members are
         removed with reason `near_duplicate`, naming the root

**Nodes.** A document's node is its key `node_key(id)`: 16 hex digits of a 64-bit hash of the id, then
the id. Nodes compare by (hash, id), so the order of ids in the input (a chain of near duplicates whose
ids follow the chain, say) never lines up with the graph: every input is as good as randomly labelled.
The node that is smallest in this order is the component's root, the document that is kept.

**Banding for verification.** The default banding is 20 bands x 5 rows (100 permutations), more
sensitive than the 14 x 8 of LSH without verification (datatrove, FineWeb): a pair at Jaccard 0.8 is a
candidate with probability 0.9996 instead of 0.92, one at 0.5 with 0.47 instead of 0.05. Verification
removes the false candidates that this lets in; what it cannot do is link a pair that never became a
candidate, and on real documents those were most of the near-identical pairs that survived 14 x 8.

**Verified edges.** LSH makes a candidate of any two documents that share a band, and boilerplate (one
template behind hundreds of pages) puts documents that share little else into one band bucket. Only
candidate pairs whose estimated similarity reaches `threshold` become edges: `verify: jaccard` (the
default) compares the fraction of equal signature rows (the MinHash estimate of Jaccard similarity, on
the top 16 bits of each row), `verify: containment` the estimated share of the smaller document's
shingles that are in the larger, `verify: none` takes every candidate (datatrove's behaviour). A pair's
verdict depends only on its two signatures, so it is the same in every bucket the pair shares. Two
documents whose estimated similarity reaches the threshold and that share a bucket of at most
`bucket_cap` members always end in one component (only one of them is kept), and a document is removed
only through a chain of verified edges, never through a bucket it merely shares.

**Buckets without hot keys.** A bucket is read as its values arrive: up to `bucket_cap` members are held
(their node keys and compact signatures: O(bucket_cap) memory) and every pair among them verified, k^2/2
comparisons of 100 rows, vectorized. A bucket that grows past `bucket_cap` (a boilerplate band with 10^6
members) keeps only its `representatives` smallest members, and its members are then read a second time
(Beam's grouped values are re-iterable, streamed from the shuffle on Dataflow) and each verified against
those: O(representatives) memory and k x representatives comparisons. Pairs of such a bucket that were
not compared are counted (`capped_buckets`, `capped_members`: members similar to no representative,
`capped_pairs`), never linked: a cap can only keep a near duplicate, never remove a document.

**Shuffle.** Verification needs no shuffle of its own: each band key travels with its member, which is
its node key, its compact signature (2 bytes x 100 rows) and its number of distinct shingles, about 280
bytes, so the band shuffle is about 20 x 280 bytes per document whatever the number of candidate pairs.
Candidate pairs are compared where the bucket is grouped (CPU k^2/2 per bucket up to `bucket_cap`, then
linear in k) and leave as at most k - 1 verified edges per bucket: the edge shuffles of the components
grow with the documents that have a near duplicate, not with the candidate pairs.

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

**One pass is enough.** The kept documents of a run share no verified edge (they are the roots of
different components), and a rerun on them computes the same signatures and the same verdicts, on
buckets that only lost members: without capped buckets it removes nothing (tested), and with them only
pairs that a cap left uncompared.

**Earlier runs.** With `--dedupe-against` (tokenmill.pipelines.dedupe_index.EarlierNearDuplicates), the
documents with a verified near duplicate in an earlier run's index are removed first (`removed_earlier`,
reason `earlier_near_duplicate`); earlier documents are never nodes of this graph.

Everything is a function of the set of documents: node keys decide the roots and the representatives,
and every reducer's output is a function of its group's contents, whatever the worker count or the
order of arrival.
"""

from __future__ import annotations

import bisect
import json
from collections import Counter
from collections.abc import Iterable
from typing import Any

import apache_beam as beam
import numpy as np
from apache_beam.transforms.window import GlobalWindows

from tokenmill.filters.minhash import (
    MAX_NGRAM,
    MinHasher,
    compact_signatures,
    containment_from_jaccard,
    distinct_counts,
    estimated_jaccard_from_agreement,
)
from tokenmill.pipelines.dedupe_keys import document_and_decision, node_id, node_key
from tokenmill.pipelines.sinks import StatsCombine, stable_hash

STAGE = "fuzzy_dedupe"
REASON = "near_duplicate"
VERIFY_METRICS = ("containment", "jaccard")
#: Rounds unrolled before the exact finish: enough for randomly ordered chains of ~10^7 nodes.
DEFAULT_ROUNDS = 20
#: Band buckets of up to this many members have every pair verified (their members held meanwhile).
BUCKET_CAP = 1000
#: Members of a larger bucket that each of its members is verified against: its smallest nodes.
REPRESENTATIVES = 16
#: Members of a capped bucket compared with its representatives in one vectorized step.
_CHUNK = 1024
#: Keys of the stage's stats that combine by maximum; every other number is summed.
_MAX_STATS = ("largest_component", "largest_bucket")

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

# Tags of the values of the id join.
_DOCUMENT, _LABEL = 0, 1


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
    """A batch of documents -> (band key, member) for every band of every document that has shingles.

    A member is (node, compact signature bytes, distinct shingles): what verification compares, carried
    with each band key so that a bucket can be verified where it is grouped. Without verification the
    signature is left out (b""), and the shingles are counted only for `verify: containment` (0 else)."""

    def __init__(self, ngram: int, bands: int, rows: int, seed: int, verify: str | None):
        self.params = (ngram, bands, rows, seed)
        self.verify = verify

    def setup(self):
        self.hasher = MinHasher(*self.params)

    def process(self, batch):
        shingles, offsets = self.hasher.shingle_batch([document["text"] for document in batch])
        signatures, present = self.hasher.signatures_from_shingles(shingles, offsets)
        compact = compact_signatures(signatures) if self.verify else None
        sizes = distinct_counts(shingles, offsets) if self.verify == "containment" else None
        for index, document in enumerate(batch):
            if not present[index]:
                continue
            member = (
                node_key(document["id"]),
                b"" if compact is None else compact[index].tobytes(),
                0 if sizes is None else int(sizes[index]),
            )
            for key in self.hasher.band_keys(signatures[index]):
                yield key, member
        yield beam.pvalue.TaggedOutput(
            "stats", {"documents": len(batch), "documents_without_words": int((~present).sum())}
        )


def _local_root(parents: list[int], index: int) -> int:
    """Union-find over the positions of a bucket's held members (path halving)."""
    while parents[index] != index:
        parents[index] = parents[parents[index]]
        index = parents[index]
    return index


def _local_union(parents: list[int], first: int, second: int) -> None:
    """Join under the smaller position: members are held in node order, so every root is its group's
    smallest node."""
    first, second = _local_root(parents, first), _local_root(parents, second)
    if first < second:
        parents[second] = first
    elif second < first:
        parents[first] = second


class _BucketEdges(beam.DoFn):
    """One band bucket -> verified edges (member node, smallest node of its similar group) and its stats.

    Pass one reads the members as they arrive, holding at most `bucket_cap` of them; a bucket of at most
    `bucket_cap` has every pair compared, and each member linked to the smallest node of its group of
    similar members (union-find over the held members: a spanning forest of the verified pairs, at most
    k - 1 edges, and the same components as all of them). A larger bucket keeps only its
    `representatives` smallest members from pass one; pass two reads the bucket again and links each
    member to each group of representatives that it is similar to, in chunks of `_CHUNK` members. Memory
    O(bucket_cap) either way. Without verification (`metric` None) every member links to the bucket's
    smallest node, as LSH alone would.
    """

    def __init__(
        self, num_perm: int, metric: str | None, threshold: float, bucket_cap: int, representatives: int
    ):
        self.num_perm = num_perm
        self.metric = metric
        self.threshold = threshold
        self.bucket_cap = bucket_cap
        self.representatives = representatives

    def _signatures(self, members: list) -> tuple[np.ndarray, np.ndarray]:
        signatures = np.frombuffer(b"".join(member[1] for member in members), np.uint16)
        sizes = np.array([member[2] for member in members], np.int64)
        return signatures.reshape(len(members), self.num_perm), sizes

    def _similar(self, equal_rows: np.ndarray, sizes: np.ndarray, other_sizes: np.ndarray) -> np.ndarray:
        """Which compared pairs are near duplicates: their estimated similarity reaches the threshold."""
        similarity = estimated_jaccard_from_agreement(equal_rows, self.num_perm)
        if self.metric == "containment":
            similarity = containment_from_jaccard(
                similarity, np.minimum(sizes, other_sizes), np.maximum(sizes, other_sizes)
            )
        return similarity >= self.threshold

    def process(self, bucket: tuple[bytes, Iterable[tuple[str, bytes, int]]]):
        _, members = bucket
        held: list | None = []
        smallest: list = []  # the `representatives` smallest members, once the bucket is over the cap
        count = 0
        for member in members:
            count += 1
            if held is not None:
                held.append(member)
                if len(held) > self.bucket_cap:
                    smallest = sorted(held)[: self.representatives]
                    held = None
            elif member < smallest[-1]:
                bisect.insort(smallest, member)
                smallest.pop()
        if count < 2:
            return
        stats = {"colliding_buckets": 1, "bucket_pairs": count * (count - 1) // 2, "largest_bucket": count}
        if self.metric is None:
            root = min(held)[0] if held is not None else smallest[0][0]
            for member in members if held is None else held:
                if member[0] != root:
                    yield member[0], root
        elif held is not None:
            yield from self._verify_all(sorted(held), stats)
        else:
            yield from self._verify_against_representatives(members, smallest, count, stats)
        yield beam.pvalue.TaggedOutput("stats", stats)

    def _verify_all(self, held: list, stats: dict):
        """Every pair of members held in node order, then each member -> the smallest node of its group of
        similar members. Returns (via StopIteration) each member's root position, for the caller."""
        signatures, sizes = self._signatures(held)
        parents = list(range(len(held)))
        similar = 0
        for index in range(len(held) - 1):
            equal_rows = (signatures[index + 1 :] == signatures[index]).sum(axis=1)
            for other in np.flatnonzero(self._similar(equal_rows, sizes[index], sizes[index + 1 :])):
                similar += 1
                _local_union(parents, index, index + 1 + int(other))
        roots = [_local_root(parents, index) for index in range(len(held))]
        for index, member in enumerate(held):
            if roots[index] != index:
                yield member[0], held[roots[index]][0]
        stats.update(verified_pairs=len(held) * (len(held) - 1) // 2, similar_pairs=similar)
        return roots

    def _verify_against_representatives(self, members: Iterable, smallest: list, count: int, stats: dict):
        """A bucket over the cap: its representatives verified among themselves, then every other member
        (read again, in chunks) against them; what matches none is counted as capped."""
        positions = yield from self._verify_all(smallest, stats)
        roots = [smallest[position][0] for position in positions]
        signatures, sizes = self._signatures(smallest)
        chosen = {member[0] for member in smallest}
        unmatched = similar = 0
        chunk: list = []

        def link(chunk: list):
            nonlocal unmatched, similar
            chunk_signatures, chunk_sizes = self._signatures(chunk)
            equal_rows = (chunk_signatures[:, None, :] == signatures[None, :, :]).sum(axis=2)
            matches = self._similar(equal_rows, chunk_sizes[:, None], sizes[None, :])
            similar += int(matches.sum())
            for member, row in zip(chunk, matches, strict=True):
                linked = sorted({roots[index] for index in np.flatnonzero(row)})
                unmatched += not linked
                for root in linked:
                    yield member[0], root

        for member in members:
            if member[0] in chosen:
                continue
            chunk.append(member)
            if len(chunk) == _CHUNK:
                yield from link(chunk)
                chunk = []
        if chunk:
            yield from link(chunk)
        compared = stats["verified_pairs"] + (count - len(smallest)) * len(smallest)
        stats.update(
            verified_pairs=compared,
            similar_pairs=stats["similar_pairs"] + similar,
            capped_buckets=1,
            capped_members=unmatched,
            capped_pairs=count * (count - 1) // 2 - compared,
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


def _removed(document: dict, root: str, size: int) -> dict:
    detail = {"kept_id": root, "dup_cluster": root, "component_size": size}
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
    """id -> its document and its label (if it has near duplicates): kept (main output; a component's
    root, or a document without near duplicates) or removed, naming the root."""

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
        if root_id == identifier:
            yield beam.pvalue.TaggedOutput("stats", {"kept_with_duplicates": 1})
            yield document
        else:
            yield beam.pvalue.TaggedOutput("stats", _removal_stats(document))
            yield beam.pvalue.TaggedOutput("removed", _removed(document, root_id, size))


class FuzzyDedupe(beam.PTransform):
    """Near-duplicate removal with MinHash LSH, verified edges and connected components (see the module
    docstring).

    Parameters (the recipe's `fuzzy_dedupe:` mapping): `ngram` words per shingle (5), `bands` x `rows`
    of the LSH banding (20 x 5), `seed` of the permutations (1), `verify` (`jaccard`, `containment` or
    `none`) with its `threshold` (0.7) on the pair's estimated similarity, `bucket_cap` (band buckets of
    up to this many members have every pair verified, 1,000) and `representatives` (what each member of
    a larger bucket is verified against, 16), `max_rounds` of connected components unrolled before the
    exact finish (20) and `batch_size` (documents per signature batch, 256).

    Memory and shuffle at 10 TB on 1,000 workers: band keys with their members (node key, 224-byte
    compact signature, shingle count: 20 x ~280 bytes a document) are shuffled once by bucket, and
    verification adds no shuffle: it grows the CPU of the bucket groups with their candidate pairs
    (k^2/2 comparisons up to `bucket_cap`, k x `representatives` above), not what moves. The verified
    edges (ids only, at most k - 1 per bucket) move a few times per round while their component is
    unfinished (see ConnectedComponents); whole documents once, by id, one document per group. Per
    worker: one batch of signatures, `bucket_cap` members of one bucket, and one document at a time:
    every group, a million-member bucket or component included, is iterated, never held.
    """

    stage = STAGE

    def __init__(
        self,
        ngram: int = 5,
        bands: int = 20,
        rows: int = 5,
        seed: int = 1,
        max_rounds: int = DEFAULT_ROUNDS,
        verify: str | None = "jaccard",
        threshold: float = 0.7,
        batch_size: int = 256,
        bucket_cap: int = BUCKET_CAP,
        representatives: int = REPRESENTATIVES,
        on_unconverged: str | None = None,
        verify_group_size: int | None = None,
    ):
        super().__init__()
        if on_unconverged is not None:
            raise ValueError(
                "on_unconverged is gone: connected components now always converge (the rounds are "
                "followed by an exact finish of whatever they leave), so there is nothing to fail or keep; "
                "remove it from the recipe (max_rounds now only trades rounds for the finish's memory)"
            )
        if verify_group_size is not None:
            raise ValueError(
                "verify_group_size is gone: candidate pairs are now verified inside their band bucket, "
                "before connected components, and no member is compared with its component's root; "
                "remove it from the recipe (bucket_cap and representatives bound a bucket's verification)"
            )
        if not isinstance(ngram, int) or not 1 <= ngram <= MAX_NGRAM:
            raise ValueError(f"ngram must be an integer in 1..{MAX_NGRAM}, got {ngram!r}")
        for name, value in (
            ("bands", bands),
            ("rows", rows),
            ("max_rounds", max_rounds),
            ("batch_size", batch_size),
            ("bucket_cap", bucket_cap),
            ("representatives", representatives),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if representatives > bucket_cap:
            raise ValueError(
                f"representatives ({representatives}) must not exceed bucket_cap ({bucket_cap}): they are "
                "the members a bucket over the cap keeps"
            )
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
        self.bucket_cap = bucket_cap
        self.representatives = representatives
        #: Earlier runs' dedupe indexes (tokenmill.pipelines.dedupe_index.attach_earlier_indexes): their
        #: near duplicates are removed first, and the rest is deduped as usual.
        self.against: tuple = ()

    def expand(self, documents):
        hasher_params = (self.ngram, self.bands, self.rows, self.seed)
        earlier = None
        if self.against:
            from tokenmill.pipelines import dedupe_index

            earlier = documents | "Earlier" >> dedupe_index.EarlierNearDuplicates(
                STAGE,
                self.against,
                _DocumentBandKeys(hasher_params, self.verify, self.batch_size),
                self.bands * self.rows,
                self.verify,
                self.threshold,
                dedupe_index.GROUP_SIZE,
            )
            documents = earlier["kept"]
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
                        "verified_pairs": 0,
                        "similar_pairs": 0,
                        "capped_buckets": 0,
                        "capped_members": 0,
                        "capped_pairs": 0,
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
                        "bands": self.bands,
                        "rows": self.rows,
                        "ngram": self.ngram,
                    }
                ]
            )
        ]

        # Signatures, band buckets, verified edges: node keys and compact signatures only.
        bands = (
            documents
            | "BatchForSignatures"
            >> beam.BatchElements(min_batch_size=self.batch_size, max_batch_size=self.batch_size)
            | "BandKeys"
            >> beam.ParDo(_BandKeys(*hasher_params, self.verify))
            .with_output_types(tuple[bytes, Any])
            .with_outputs("stats", main="keys")
        )
        stats_parts.append(bands.stats)
        buckets = (
            bands.keys
            | "GroupByBand" >> beam.GroupByKey()
            | "VerifiedEdges"
            >> beam.ParDo(
                _BucketEdges(
                    self.bands * self.rows, self.verify, self.threshold, self.bucket_cap, self.representatives
                )
            )
            .with_output_types(_EDGE)
            .with_outputs("stats", main="edges")
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
            | "Decide" >> beam.ParDo(_Decide()).with_outputs("removed", "stats", main="kept")
        )
        stats_parts.append(decided.stats)
        if earlier is not None:
            stats_parts.append(earlier["stats"])
        stats = (
            tuple(stats_parts)
            | "AllStats" >> beam.Flatten()
            | "SumStats" >> beam.CombineGlobally(StatsCombine(_MAX_STATS))
            | "StageStats" >> beam.Map(lambda numbers: (STAGE, numbers))
        )
        result = {"kept": decided.kept, "removed": decided.removed, "stats": stats}
        if earlier is not None:
            result["removed_earlier"] = earlier["removed"]
        return result


class _DocumentBandKeys(beam.PTransform):
    """Documents -> (band key, member), as the stage makes them: for matching against earlier indexes."""

    def __init__(self, hasher_params: tuple, verify: str | None, batch_size: int):
        super().__init__()
        self.hasher_params = hasher_params
        self.verify = verify
        self.batch_size = batch_size

    def expand(self, documents):
        return (
            documents
            | "Batch" >> beam.BatchElements(min_batch_size=self.batch_size, max_batch_size=self.batch_size)
            | "BandKeys"
            >> beam.ParDo(_BandKeys(*self.hasher_params, self.verify))
            .with_output_types(tuple[bytes, Any])
            .with_outputs("stats", main="keys")
        ).keys
