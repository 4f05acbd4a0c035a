"""Spherical k-means and the coarsening of fine clusters into domains, in NumPy.

Vectors are unit length, so cosine similarity is a dot product: a document belongs to the centroid with
the largest dot product, and a centroid is the normalized sum of its members. k-means++ seeding uses
1 - cosine (half the squared Euclidean distance between unit vectors) as the distance; the generator is
seeded, ties go to the lower index, so the same vectors and seed give the same clusters.

Coarsening merges the K fine clusters with Ward's criterion over their means (the increase of the
within-group sum of squares, n_a n_b / (n_a + n_b) * |m_a - m_b|^2, which on unit vectors is a cosine
distance weighted by size), by the nearest-neighbour chain algorithm: O(K^2 d) time and O(K d) memory,
so K = 5,000 takes seconds. The dendrogram is cut at N groups; a group below `min_share` of the documents
is then merged into its nearest group by cosine, smallest first.

Memory: the vectors (n x d float32) and one chunk of similarities (CHUNK_ROWS x K) at a time; 10M
documents of 64 dimensions are 2.6 GB, plus 8192 x 5,000 x 4 bytes = 164 MB of similarities.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

CHUNK_ROWS = 8192


def normalize_rows(vectors: np.ndarray) -> np.ndarray:
    """Each row scaled to unit length; a zero row stays zero."""
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return np.divide(vectors, norms, out=np.zeros_like(vectors), where=norms > 0)


def nearest(vectors: np.ndarray, centroids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(index of the most similar centroid, that cosine) per row, in chunks of CHUNK_ROWS rows.

    The products are taken in float64: a BLAS matrix product's rounding depends on the shape of the batch,
    and curate's batches depend on how the runner cut its bundles, so in float32 the same document could get
    another score (or, at a near tie, another domain) on another runner. In float64 that difference is far
    below float32's resolution, so the float32 score and the choice are the same whatever the batch."""
    labels = np.empty(len(vectors), dtype=np.int64)
    scores = np.empty(len(vectors), dtype=np.float32)
    centroids = np.asarray(centroids, dtype=np.float64)
    for start in range(0, len(vectors), CHUNK_ROWS):
        similarity = np.asarray(vectors[start : start + CHUNK_ROWS], dtype=np.float64) @ centroids.T
        labels[start : start + CHUNK_ROWS] = np.argmax(similarity, axis=1)  # first maximum: lower index
        scores[start : start + CHUNK_ROWS] = similarity[
            np.arange(len(similarity)), labels[start : start + CHUNK_ROWS]
        ]
    return labels, scores


def kmeans_plus_plus(vectors: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k distinct rows chosen by k-means++ with 1 - cosine as the distance."""
    n = len(vectors)
    chosen = [int(rng.integers(n))]
    distance = np.clip(1.0 - vectors @ vectors[chosen[0]], 0.0, None).astype(np.float64)
    distance[chosen[0]] = 0.0
    for _ in range(1, k):
        total = distance.sum()
        if total <= 0:  # every remaining row equals a chosen one: take the first unchosen rows
            taken = set(chosen)
            chosen.append(next(i for i in range(n) if i not in taken))
        else:
            chosen.append(int(np.searchsorted(np.cumsum(distance), rng.random() * total, side="right")))
            chosen[-1] = min(chosen[-1], n - 1)
        distance = np.minimum(distance, np.clip(1.0 - vectors @ vectors[chosen[-1]], 0.0, None))
        distance[chosen] = 0.0
    return vectors[chosen].copy()


@dataclass(frozen=True)
class KMeansResult:
    centroids: np.ndarray  # k x d, unit rows
    labels: np.ndarray  # n, the nearest centroid of each row (as predict would give it)
    similarity: np.ndarray  # n, the cosine to that centroid
    iterations: int
    converged: bool


def spherical_kmeans(vectors: np.ndarray, k: int, seed: int = 0, max_iterations: int = 50) -> KMeansResult:
    """Spherical k-means of unit rows: k-means++ seeding, then assign/update until no row moves.

    A cluster left empty is re-seeded with the row least similar to its own centroid (one not yet used
    as a seed in that round), so that K clusters come back whenever the rows hold K distinct vectors.
    """
    n = len(vectors)
    if not 1 <= k <= n:
        raise ValueError(f"k={k} clusters need at least {k} documents, the sample has {n}")
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    rng = np.random.default_rng(seed)
    centroids = kmeans_plus_plus(vectors, k, rng)
    labels = np.full(n, -1, dtype=np.int64)
    converged = False
    iterations = 0
    for iterations in range(1, max_iterations + 1):  # noqa: B007 - the count is reported
        new_labels, similarity = nearest(vectors, centroids)
        if np.array_equal(new_labels, labels):
            converged = True
            break
        labels = new_labels
        sums = np.zeros((k, vectors.shape[1]), dtype=np.float64)
        np.add.at(sums, labels, vectors)
        counts = np.bincount(labels, minlength=k)
        empty = np.flatnonzero(counts == 0)
        if len(empty):
            # Farthest rows first; a stable sort keeps the choice deterministic among equal similarities.
            farthest = np.argsort(similarity, kind="stable")[: len(empty)]
            for cluster, row in zip(empty, farthest):
                sums[cluster] = vectors[row]
        centroids = normalize_rows(sums).astype(np.float32)
    labels, similarity = nearest(vectors, centroids)
    return KMeansResult(centroids, labels, similarity, iterations, converged)


def _ward_cost(size_a: float, mean_a: np.ndarray, sizes: np.ndarray, means: np.ndarray) -> np.ndarray:
    difference = means - mean_a
    return size_a * sizes / (size_a + sizes) * np.einsum("ij,ij->i", difference, difference)


def ward_merges(sums: np.ndarray, sizes: np.ndarray) -> list[tuple[int, int, float]]:
    """The full Ward dendrogram of groups given by their vector sums and sizes, as (a, b, cost) merges;
    merged groups get new indices len(sizes), len(sizes) + 1, ... as in SciPy's linkage.

    Nearest-neighbour chain: follow nearest neighbours until two are each other's nearest, merge them.
    Ward's criterion is reducible, so this finds the same dendrogram as merging the closest pair each time.
    """
    count = len(sizes)
    capacity = 2 * count - 1
    all_sizes = np.zeros(capacity, dtype=np.float64)
    all_means = np.zeros((capacity, sums.shape[1]), dtype=np.float64)
    all_sizes[:count] = sizes
    all_means[:count] = sums / np.maximum(sizes, 1)[:, None]
    active = np.zeros(capacity, dtype=bool)
    active[:count] = True
    merges: list[tuple[int, int, float]] = []
    chain: list[int] = []
    next_index = count
    while active.sum() > 1:
        if not chain:
            chain.append(int(np.flatnonzero(active)[0]))
        current = chain[-1]
        candidates = np.flatnonzero(active)
        candidates = candidates[candidates != current]
        costs = _ward_cost(
            all_sizes[current], all_means[current], all_sizes[candidates], all_means[candidates]
        )
        best = int(candidates[np.argmin(costs)])
        if len(chain) > 1:
            # Ties go to the previous link, or the chain could cycle between equal neighbours.
            previous = chain[-2]
            previous_cost = costs[np.searchsorted(candidates, previous)]
            if previous_cost <= costs.min():
                best = previous
        if len(chain) > 1 and best == chain[-2]:
            a, b = chain.pop(), chain.pop()
            cost = float(_ward_cost(all_sizes[a], all_means[a], all_sizes[[b]], all_means[[b]])[0])
            size = all_sizes[a] + all_sizes[b]
            all_means[next_index] = (all_sizes[a] * all_means[a] + all_sizes[b] * all_means[b]) / size
            all_sizes[next_index] = size
            active[[a, b]] = False
            active[next_index] = True
            merges.append((min(a, b), max(a, b), cost))
            next_index += 1
        else:
            chain.append(best)
    return merges


def coarsen(sums: np.ndarray, sizes: np.ndarray, groups: int, min_share: float) -> np.ndarray:
    """Fine cluster -> group index (0 = the largest group), for `groups` groups or fewer.

    The Ward dendrogram is cut at `groups`, then any group holding less than `min_share` of the documents
    joins the group whose mean direction is nearest by cosine, smallest group first (so the result can
    have fewer groups than asked: the card says how many). Empty fine clusters join by their direction.
    """
    count = len(sizes)
    if groups < 1:
        raise ValueError("at least one domain")
    if groups > count:
        raise ValueError(f"{groups} domains cannot be made from {count} fine clusters (K < N)")
    populated = np.flatnonzero(sizes > 0)
    merges = ward_merges(sums[populated], sizes[populated].astype(np.float64))
    # Ward's costs never decrease up the dendrogram, so the cut at `groups` applies the cheapest merges.
    parent = list(range(2 * len(populated) - 1))

    def find(node: int) -> int:
        while parent[node] != node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    order = sorted(range(len(merges)), key=lambda i: (merges[i][2], i))
    keep = set(order[: max(len(populated) - groups, 0)])
    for index, (a, b, _) in enumerate(merges):
        new = len(populated) + index
        if index in keep:
            parent[find(a)] = new
            parent[find(b)] = new
    roots = [find(i) for i in range(len(populated))]
    members: dict[int, list[int]] = {}
    for fine, root in zip(populated.tolist(), roots):
        members.setdefault(root, []).append(fine)
    group_list = sorted(members.values(), key=lambda fines: fines[0])

    total = float(sizes.sum())
    while len(group_list) > 1:
        group_sizes = [float(sizes[fines].sum()) for fines in group_list]
        smallest = min(range(len(group_list)), key=lambda i: (group_sizes[i], group_list[i][0]))
        if group_sizes[smallest] >= min_share * total:
            break
        directions = normalize_rows(np.stack([sums[fines].sum(axis=0) for fines in group_list]))
        similarity = directions @ directions[smallest]
        similarity[smallest] = -np.inf
        target = int(np.argmax(similarity))
        merged = sorted(group_list[target] + group_list[smallest])
        group_list = [fines for i, fines in enumerate(group_list) if i not in (target, smallest)] + [merged]
        group_list.sort(key=lambda fines: fines[0])

    group_list.sort(key=lambda fines: (-float(sizes[fines].sum()), fines[0]))
    mapping = np.full(count, -1, dtype=np.int64)
    for group, fines in enumerate(group_list):
        mapping[fines] = group
    unplaced = np.flatnonzero(mapping < 0)
    if len(unplaced):
        directions = normalize_rows(np.stack([sums[fines].sum(axis=0) for fines in group_list]))
        mapping[unplaced] = np.argmax(normalize_rows(sums[unplaced]) @ directions.T, axis=1)
    return mapping
