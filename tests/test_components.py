"""Connected components in Beam (tokenmill.pipelines.fuzzy_dedupe.ConnectedComponents) against scipy's, on
the inputs that break fixed-round label propagation: long chains whose ids follow the chain (either way),
a 100,000-leaf star, random graphs, and too few rounds for the exact finish to mop up."""

from __future__ import annotations

import json
import pickle
import random
import time
from pathlib import Path

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.runners.portability.fn_api_runner import FnApiRunner
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components

from tokenmill.pipelines.dedupe_keys import node_id, node_key
from tokenmill.pipelines.fuzzy_dedupe import (
    _MAX_STATS,
    DEFAULT_ROUNDS,
    ConnectedComponents,
    size_bucket,
)
from tokenmill.pipelines.sinks import StatsCombine

#: (wall, CPU) seconds of each Beam run here (the in-memory runner runs in this process), by test:
#: printed at the end of the module (`pytest -s`).
TIMINGS: dict[str, tuple[float, float]] = {}


class _Dump(beam.DoFn):
    def __init__(self, path: str):
        self.path = path

    def process(self, items):
        Path(self.path).write_text(json.dumps(items, default=str))


def run_components(
    edges: list[tuple[str, str]], tmp_path: Path, max_rounds: int = DEFAULT_ROUNDS, name: str = "run"
) -> tuple[dict[str, tuple[str, int]], dict]:
    """ConnectedComponents on edges between ids, on the in-memory runner: ({id: (root id, size)}, stats)."""
    options = PipelineOptions(["--direct_num_workers=1", "--direct_running_mode=in_memory"])
    # The edges reach the pipeline as a file: Create would infer a type from every edge, and a closure
    # over them would be pickled and compressed with the pipeline.
    edges_file = tmp_path / "edges.pickle"
    edges_file.write_bytes(pickle.dumps([(node_key(first), node_key(second)) for first, second in edges]))
    started, cpu_started = time.perf_counter(), time.process_time()
    with beam.Pipeline(runner=FnApiRunner(), options=options) as pipeline:
        result = (
            pipeline
            | beam.Create([str(edges_file)])
            | beam.FlatMap(lambda path: pickle.loads(Path(path).read_bytes()))
            | ConnectedComponents(max_rounds)
        )
        (
            result["labels"]
            | "ListLabels" >> beam.combiners.ToList()
            | "DumpLabels" >> beam.ParDo(_Dump(str(tmp_path / "labels.json")))
        )
        (
            result["stats"]
            | "SumStats" >> beam.CombineGlobally(StatsCombine(_MAX_STATS))
            | "DumpStats" >> beam.ParDo(_Dump(str(tmp_path / "stats.json")))
        )
    TIMINGS[name] = (time.perf_counter() - started, time.process_time() - cpu_started)
    pairs = json.loads((tmp_path / "labels.json").read_text())
    labels = {}
    for node, (root, size) in pairs:
        assert node_id(node) not in labels, f"{node_id(node)} labelled twice"
        labels[node_id(node)] = (node_id(root), size)
    return labels, json.loads((tmp_path / "stats.json").read_text())


def scipy_labels(edges: list[tuple[str, str]]) -> dict[str, tuple[str, int]]:
    """The same labels from scipy: each node's component, rooted at its smallest node key."""
    nodes = sorted({node for edge in edges for node in edge if edge[0] != edge[1]})
    index = {node: position for position, node in enumerate(nodes)}
    pairs = np.array([(index[a], index[b]) for a, b in edges if a != b], dtype=np.int64).reshape(-1, 2)
    graph = coo_matrix((np.ones(len(pairs)), (pairs[:, 0], pairs[:, 1])), shape=(len(nodes), len(nodes)))
    _, component = connected_components(graph, directed=False)
    roots: dict[int, str] = {}
    sizes = np.bincount(component)
    for node in nodes:
        label = component[index[node]]
        if label not in roots or node_key(node) < node_key(roots[label]):
            roots[label] = node
    return {node: (roots[component[index[node]]], int(sizes[component[index[node]]])) for node in nodes}


def assert_matches_scipy(edges: list[tuple[str, str]], labels: dict, stats: dict) -> dict:
    expected = scipy_labels(edges)
    assert labels == expected
    sizes = [size for node, (root, size) in expected.items() if node == root]
    assert stats["components"] == len(sizes)
    assert stats["documents_in_components"] == len(expected)
    assert stats["largest_component"] == max(sizes, default=0)
    histogram: dict[str, int] = {}
    for size in sizes:
        histogram[size_bucket(size)] = histogram.get(size_bucket(size), 0) + 1
    assert stats["component_sizes"] == histogram
    assert stats["candidate_pairs"] == len({tuple(sorted(edge)) for edge in edges if edge[0] != edge[1]})
    return expected


def chain(ids: list[str]) -> list[tuple[str, str]]:
    return list(zip(ids, ids[1:], strict=False))


def test_a_chain_whose_ids_follow_it_converges_to_scipys_components(tmp_path):
    # Ids in chain order: with the ids themselves as labels this needs a round per doubling of the
    # chain's length and more (14 rounds for 10,000); hashed, it is a randomly labelled chain.
    ids = [f"doc{index:05d}" for index in range(10_000)]
    edges = chain(ids)
    labels, stats = run_components(edges, tmp_path, name="chain in id order")
    assert_matches_scipy(edges, labels, stats)
    assert labels["doc00000"] == (min(ids, key=node_key), 10_000)
    # The kept node is the one with the smallest hash, not the smallest id.
    assert labels["doc00000"][0] != "doc00000"
    assert stats["residual_edges"] == 0 and 5 < stats["rounds_that_changed_edges"] < DEFAULT_ROUNDS


def test_the_same_chain_in_reverse_id_order(tmp_path):
    ids = [f"doc{index:05d}" for index in reversed(range(10_000))]
    edges = [(second, first) for first, second in chain(ids)]  # each edge also written backwards
    labels, stats = run_components(edges, tmp_path, name="chain in reverse id order")
    assert_matches_scipy(edges, labels, stats)
    assert stats["residual_edges"] == 0 and stats["components"] == 1


@pytest.mark.slow  # the default suite's 15-minute budget; make test-slow runs it
def test_a_hundred_thousand_leaf_star(tmp_path):
    leaves = [f"leaf{index:06d}" for index in range(100_000)]
    edges = [(leaf, "hub") for leaf in leaves]
    labels, stats = run_components(edges, tmp_path, name="100,000-leaf star")
    assert_matches_scipy(edges, labels, stats)
    assert set(labels.values()) == {(min([*leaves, "hub"], key=node_key), 100_001)}
    # The star is finished after two rounds and labelled in the third; later rounds carry nothing.
    assert stats["rounds_that_changed_edges"] <= 3 and stats["residual_edges"] == 0


def random_graphs(rng: random.Random) -> list[tuple[str, str]]:
    """Several kinds of random graph, on disjoint node names: sparse G(n, m) around the percolation
    threshold (one giant component and many small ones), random trees, small dense clusters joined by
    random bridges, duplicate edges, edges both ways, and self loops."""
    edges: list[tuple[str, str]] = []
    for graph, (nodes, density) in enumerate([(3000, 0.9), (3000, 1.2), (500, 3.0)]):
        names = [f"g{graph}-{index}" for index in range(nodes)]
        for _ in range(int(nodes * density / 2)):
            edges.append((rng.choice(names), rng.choice(names)))
    names = [f"t-{index}" for index in range(3000)]
    for index in range(1, len(names)):
        if rng.random() < 0.97:  # a forest: a few trees
            edges.append((names[index], names[rng.randrange(index)]))
    for cluster in range(200):
        members = [f"k{cluster}-{index}" for index in range(rng.randint(2, 12))]
        edges.extend((a, b) for a in members for b in members if a < b)
        if cluster and rng.random() < 0.3:
            edges.append((members[0], f"k{rng.randrange(cluster)}-0"))
    edges.extend(rng.sample(edges, 500))
    edges.extend((b, a) for a, b in rng.sample(edges, 500))
    edges.extend((node, node) for node in rng.sample(names, 10))
    return edges


def test_random_graphs(tmp_path):
    edges = random_graphs(random.Random(11))
    labels, stats = run_components(edges, tmp_path, name="random graphs")
    expected = assert_matches_scipy(edges, labels, stats)
    assert stats["components"] > 300 and max(size for _, size in expected.values()) > 1000
    assert stats["residual_edges"] == 0


def test_too_few_rounds_leave_the_rest_to_the_exact_finish(tmp_path):
    # One round cannot flatten a 3,000-node chain: the exact finish solves what is left, and the
    # labels are the same as with enough rounds.
    ids = [f"doc{index:05d}" for index in range(3000)]
    edges = chain(ids) + random_graphs(random.Random(12))
    labels, stats = run_components(edges, tmp_path, max_rounds=1, name="one round, exact finish")
    assert_matches_scipy(edges, labels, stats)
    assert stats["rounds"] == 1 and stats["residual_edges"] > 2000 and stats["residual_nodes"] > 2000
    # Three rounds finish the small components and leave less to the finish.
    one_round = stats["residual_nodes"]
    labels, stats = run_components(edges, tmp_path, max_rounds=3, name="three rounds, exact finish")
    assert_matches_scipy(edges, labels, stats)
    assert 0 < stats["residual_nodes"] < one_round


def test_no_edges_and_a_single_edge(tmp_path):
    labels, stats = run_components([], tmp_path, name="no edges")
    assert labels == {} and stats.get("components", 0) == 0 and stats["candidate_pairs"] == 0
    labels, stats = run_components([("b", "a"), ("a", "b"), ("a", "a")], tmp_path, max_rounds=2, name="pair")
    root = min("a", "b", key=node_key)
    assert labels == {"a": (root, 2), "b": (root, 2)} and stats["components"] == 1


@pytest.fixture(scope="module", autouse=True)
def report_timings():
    yield
    for name, (wall, cpu) in TIMINGS.items():
        print(f"\nconnected components, {name}: {wall:.1f} s wall, {cpu:.1f} s CPU")
