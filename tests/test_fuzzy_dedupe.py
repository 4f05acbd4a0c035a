"""Fuzzy dedupe: MinHash math (seeded, vectorized, exact against brute force), LSH + connected components
in Beam (planted duplicates, chains, convergence), edge-case documents, and determinism through curate."""

from __future__ import annotations

import json
import random
from pathlib import Path

import apache_beam as beam
import numpy as np
import pyarrow.parquet as pq
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.runners.portability.fn_api_runner import FnApiRunner
from conftest import tree_bytes
from test_exact_dedupe import run as run_probed

from tokenmill.cli import main
from tokenmill.corpora.records import DuplicateIdError
from tokenmill.filters.minhash import (
    MinHasher,
    collision_probability,
    compact_signatures,
    containment,
    containment_from_jaccard,
    distinct_counts,
    estimated_jaccard,
    estimated_jaccard_from_agreement,
    jaccard,
    words,
)
from tokenmill.pipelines.dedupe_keys import node_id, node_key
from tokenmill.pipelines.fuzzy_dedupe import (
    _MAX_STATS,
    ConnectedComponents,
    FuzzyDedupe,
    size_bucket,
)
from tokenmill.pipelines.recipe import RecipeError, build_steps, load_recipe
from tokenmill.pipelines.sinks import StatsCombine

# ---------------------------------------------------------------------------------------------- helpers


def vocabulary(rng: random.Random, size: int = 4000) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return sorted({"".join(rng.choice(letters) for _ in range(rng.randint(3, 10))) for _ in range(size)})


def prose(rng: random.Random, vocab: list[str], count: int) -> list[str]:
    return [rng.choice(vocab) for _ in range(count)]


def edit(rng: random.Random, text_words: list[str], fraction: float) -> list[str]:
    """Substitute, delete or insert words at `fraction` of the positions (the sample corpus's edits)."""
    edited = list(text_words)
    for _ in range(max(1, int(len(edited) * fraction))):
        position = rng.randrange(len(edited))
        roll = rng.random()
        if roll < 0.4:
            edited[position] = "edited"
        elif roll < 0.7:
            del edited[position]
        else:
            edited.insert(position, "inserted")
    return edited


class _Dump(beam.DoFn):
    def __init__(self, path: str):
        self.path = path

    def process(self, items):
        Path(self.path).write_text(json.dumps(items, sort_keys=True, default=str))


def run_stages(
    documents: list[dict] | list[list[dict]], tmp_path: Path, *param_sets: dict
) -> list[tuple[dict, dict, dict]]:
    """FuzzyDedupe with each parameter set (on the same documents, or on one list of documents each),
    side by side in one pipeline on the local runner, one worker: (kept by id, removed by id, stats)."""
    options = PipelineOptions(
        ["--direct_num_workers=1", "--direct_running_mode=in_memory"], pipeline_type_check=True
    )
    per_set = documents if documents and isinstance(documents[0], list) else [documents] * len(param_sets)
    with beam.Pipeline(runner=FnApiRunner(), options=options) as pipeline:
        for index, params in enumerate(param_sets):
            created = pipeline | f"Create{index}" >> beam.Create(per_set[index])
            result = created | f"Dedupe{index}" >> FuzzyDedupe(**{"max_rounds": 4, **params})
            for name in ("kept", "removed", "stats"):
                (
                    result[name]
                    | f"List{name}{index}" >> beam.combiners.ToList()
                    | f"Dump{name}{index}" >> beam.ParDo(_Dump(str(tmp_path / f"{name}-{index}.json")))
                )
    results = []
    for index in range(len(param_sets)):
        kept, removed, stats = (
            json.loads((tmp_path / f"{name}-{index}.json").read_text())
            for name in ("kept", "removed", "stats")
        )
        assert len(stats) == 1 and stats[0][0] == "fuzzy_dedupe"
        results.append(({d["id"]: d for d in kept}, {d["id"]: d for d in removed}, stats[0][1]))
    return results


def run_stage(documents: list[dict], tmp_path: Path, **params) -> tuple[dict, dict, dict]:
    return run_stages(documents, tmp_path, params)[0]


def run_components(edges: list[tuple[str, str]], tmp_path: Path, max_rounds: int) -> tuple[dict, dict]:
    """ConnectedComponents on edges between ids: ({id: (root id, size)}, stats)."""
    options = PipelineOptions(["--direct_num_workers=1", "--direct_running_mode=in_memory"])
    keyed = [(node_key(first), node_key(second)) for first, second in edges]
    with beam.Pipeline(runner=FnApiRunner(), options=options) as pipeline:
        result = pipeline | beam.Create(keyed) | ConnectedComponents(max_rounds)
        (
            result["labels"]
            | "ListLabels" >> beam.combiners.ToList()
            | "DumpLabels" >> beam.ParDo(_Dump(str(tmp_path / "labels.json")))
        )
        (
            result["stats"]
            | "SumStats" >> beam.CombineGlobally(StatsCombine(_MAX_STATS))
            | "DumpStats" >> beam.ParDo(_Dump(str(tmp_path / "cc-stats.json")))
        )
    labels = {
        node_id(node): (node_id(root), size)
        for node, (root, size) in json.loads((tmp_path / "labels.json").read_text())
    }
    return labels, json.loads((tmp_path / "cc-stats.json").read_text())


def shingle_jaccard(hasher: MinHasher, a: str, b: str) -> float:
    return jaccard(hasher.shingles(a), hasher.shingles(b))


# ------------------------------------------------------------------------------------------ minhash math


def test_signature_matches_brute_force_and_is_seeded():
    hasher = MinHasher(ngram=5, bands=14, rows=8, seed=7)
    text = "The quick brown fox jumps over the lazy dog, and then the dog sleeps in the afternoon sun."
    shingles = hasher.shingle_batch([text])[0]
    brute = [
        min((int(a) * int(x) + int(b)) % 2**64 for x in shingles) >> 32 for a, b in zip(hasher.a, hasher.b)
    ]
    signature = hasher.signatures([text])[0][0]
    assert signature.dtype == np.uint32 and signature.tolist() == brute
    # The seed alone fixes the permutations: a new hasher (another worker, another run) agrees.
    assert np.array_equal(MinHasher(seed=7).signatures([text])[0], hasher.signatures([text])[0])
    assert not np.array_equal(MinHasher(seed=8).signatures([text])[0], hasher.signatures([text])[0])
    assert np.all(hasher.a & np.uint64(1) == 1)  # odd multipliers: every permutation is a bijection


def test_batches_blocks_and_documents_do_not_interact():
    rng = random.Random(1)
    vocab = vocabulary(rng)
    texts = [" ".join(prose(rng, vocab, rng.randint(0, 60))) for _ in range(300)] + ["", "one", "two words"]
    hasher = MinHasher()
    batch, present = hasher.signatures(texts)
    for text, signature, has in zip(texts, batch, present, strict=True):
        alone, alone_present = hasher.signatures([text])
        assert has == alone_present[0] and np.array_equal(signature, alone[0])
    # A long document spans many blocks of the product: its signature is the minimum over all of them.
    long_text = " ".join(prose(rng, vocab, 30_000))
    shingles, offsets = hasher.shingle_batch([long_text])
    half = len(shingles) // 2
    first = hasher.signatures_from_shingles(shingles[:half], np.array([0, half]))[0]
    second = hasher.signatures_from_shingles(shingles[half:], np.array([0, len(shingles) - half]))[0]
    assert np.array_equal(hasher.signatures([long_text])[0], np.minimum(first, second))


def test_estimated_jaccard_is_unbiased():
    rng = random.Random(2)
    vocab = vocabulary(rng)
    hasher = MinHasher()
    errors = []
    for _ in range(150):
        base = prose(rng, vocab, 300)
        a, b = " ".join(base), " ".join(edit(rng, base, rng.uniform(0.0, 0.1)))
        signatures, _ = hasher.signatures([a, b])
        errors.append(estimated_jaccard(signatures[0], signatures[1]) - shingle_jaccard(hasher, a, b))
    assert abs(float(np.mean(errors))) < 0.01
    assert float(np.std(errors)) < 0.06  # sqrt(J(1-J)/112) is at most 0.047


def test_compact_signatures_distinct_counts_and_estimated_containment():
    rng = random.Random(12)
    vocab = vocabulary(rng)
    hasher = MinHasher()
    texts = [" ".join(prose(rng, vocab, rng.randint(0, 400))) for _ in range(40)]
    texts += ["a b c a b c a b c", "one two three four five one two three four five"]  # repeated shingles
    shingles, offsets = hasher.shingle_batch(texts)
    assert distinct_counts(shingles, offsets).tolist() == [len(hasher.shingles(text)) for text in texts]
    errors = []
    for _ in range(60):
        base = prose(rng, vocab, 400)
        part = base[: rng.randint(100, 400)]
        a, b = " ".join(edit(rng, part, rng.uniform(0.0, 0.05))), " ".join(base)
        signatures, _ = hasher.signatures([a, b])
        compact = compact_signatures(signatures)
        assert compact.dtype == np.uint16
        equal_rows = int((compact[0] == compact[1]).sum())
        # 16 of the 32 bits: the same estimate as the full signatures but for rare chance agreements.
        estimate = float(estimated_jaccard_from_agreement(equal_rows, hasher.num_perm))
        assert abs(estimate - estimated_jaccard(signatures[0], signatures[1])) < 0.02
        mine, theirs = hasher.shingles(a), hasher.shingles(b)
        # With the true Jaccard, containment follows exactly from the set sizes; with the estimate, nearly.
        exact = containment_from_jaccard(jaccard(mine, theirs), len(mine), len(theirs))
        assert float(exact) == pytest.approx(containment(mine, theirs))
        errors.append(
            float(containment_from_jaccard(estimate, len(mine), len(theirs))) - containment(mine, theirs)
        )
    assert abs(float(np.mean(errors))) < 0.03 and float(np.std(errors)) < 0.1


def test_words_lowercase_and_split_on_anything_but_letters_and_digits():
    assert words("Hello, World! It's 2024_x") == ["hello", "world", "it", "s", "2024", "x"]
    assert words("Ünïcode “quotes” — and naïve café…") == ["ünïcode", "quotes", "and", "naïve", "café"]
    hasher = MinHasher(ngram=2)
    # Punctuation and case do not change shingles: the hashes are those of the bare words.
    for text in ("Hello, World! It's 2024_x", "Ünïcode “quotes” — and naïve café… 日本語のテキスト 😀 x"):
        assert np.array_equal(hasher.shingles(text), hasher.shingles(" ".join(words(text))))
    assert len(hasher.shingles("a b c a b c")) == 3  # {ab, bc, ca}
    # Word hashes: words of more than 8 bytes, and words that differ only past byte 8, stay apart.
    assert len(MinHasher(ngram=1).shingles("internationalization internationalizatiom internat")) == 3


def test_empty_one_word_and_short_documents():
    hasher = MinHasher(ngram=5)
    shingles, offsets = hasher.shingle_batch(["", "  ...  ", "word", "two words", "a b c d e f"])
    assert np.diff(offsets).tolist() == [0, 0, 1, 1, 2]
    signatures, present = hasher.signatures(["", "word"])
    assert present.tolist() == [False, True]
    # A document shorter than n words is one shingle of all its words: equal words, equal signature.
    assert np.array_equal(hasher.signatures(["Word."])[0], hasher.signatures(["word"])[0])
    assert not np.array_equal(hasher.signatures(["word"])[0], hasher.signatures(["words"])[0])


def test_similarity_helpers_and_lsh_curve():
    a = np.array([1, 2, 3, 4], np.uint64)
    b = np.array([3, 4, 5, 6, 7, 8], np.uint64)
    assert jaccard(a, b) == pytest.approx(2 / 8)
    assert containment(a, b) == pytest.approx(0.5) and containment(b, a) == pytest.approx(2 / 6)
    assert collision_probability(0.685, 14, 8) == pytest.approx(0.5, abs=0.01)
    assert collision_probability(0.9, 14, 8) > 0.99 and collision_probability(0.3, 14, 8) < 0.001
    assert [size_bucket(size) for size in (2, 3, 4, 5, 8, 9, 100)] == [
        "2",
        "3",
        "4",
        "5-8",
        "5-8",
        "9-16",
        "65-128",
    ]


# ------------------------------------------------------------------------------------- the Beam stage


def test_planted_near_duplicates_are_found_and_distinct_documents_kept(tmp_path):
    rng = random.Random(3)
    vocab = vocabulary(rng)
    documents, planted = [], {}
    for number in range(60):
        base = prose(rng, vocab, rng.randint(120, 400))
        documents.append({"id": f"a{number:03d}", "text": " ".join(base), "n_chars": None})
        for copy in range(number % 3):  # 0, 1 or 2 near copies, 0.5-1.5% of words edited
            copy_id = f"b{number:03d}-{copy}"
            documents.append({"id": copy_id, "text": " ".join(edit(rng, base, rng.uniform(0.005, 0.015)))})
            planted[copy_id] = f"a{number:03d}"
    # Light edits: every copy is above Jaccard 0.85, where LSH finds a pair with 99% probability (and
    # with these seeds, always). How recall falls with heavier edits is measured in bench/dedupe.py.
    texts = {d["id"]: d["text"] for d in documents}
    hasher = MinHasher()
    assert min(shingle_jaccard(hasher, texts[c], texts[o]) for c, o in planted.items()) > 0.85
    kept, removed, stats = run_stage(documents, tmp_path)
    # Each original and its copies are one component; the one with the smallest node key (a hash of
    # the id, then the id) is kept, original or copy.
    groups: dict[str, list[str]] = {}
    for copy, original in planted.items():
        groups.setdefault(original, [original]).append(copy)
    roots = {member: min(group, key=node_key) for group in groups.values() for member in group}
    assert {root for root in roots.values()} - set(planted)  # some roots are originals ...
    assert {root for root in roots.values()} & set(planted)  # ... and some are copies
    assert set(removed) == {member for member, root in roots.items() if member != root}
    assert set(kept) == {d["id"] for d in documents} - set(removed)
    for identifier, row in removed.items():
        detail = json.loads(row["detail"])
        assert (row["stage"], row["reason"]) == ("fuzzy_dedupe", "near_duplicate")
        assert detail["kept_id"] == row["dup_cluster"] == roots[identifier]
        assert detail["component_size"] == len(groups[planted.get(identifier, identifier)])
        assert kept[roots[identifier]]["dup_cluster"] == roots[identifier]
    assert all(
        document.get("dup_cluster") is None
        for identifier, document in kept.items()
        if identifier not in roots
    )
    assert stats["documents"] == len(documents) and stats["residual_edges"] == 0
    assert stats["components"] == 40 and stats["removed_documents"] == len(planted) == 60
    assert stats["component_sizes"] == {"2": 20, "3": 20}
    assert stats["documents_in_components"] == 100 and stats["largest_component"] == 3
    # Star edges, each member to its bucket's smallest node: one or two per component, and a few more
    # where the members of a component fall into buckets differently.
    assert 60 <= stats["candidate_pairs"] <= 80
    # Every candidate pair was compared (no bucket near the cap), and the planted ones were similar.
    assert stats["verified_pairs"] >= stats["similar_pairs"] >= 60 and stats["capped_buckets"] == 0
    assert stats["removed_characters"] == sum(len(row["text"]) for row in removed.values())


def chain_documents(length: int = 10, window: int = 300, shift: int = 20) -> list[dict]:
    """Windows sliding over one long text: each overlaps the next by far, and the tenth not the first."""
    rng = random.Random(4)
    text = prose(rng, vocabulary(rng), window + shift * length)
    return [
        {"id": f"c{index:02d}", "text": " ".join(text[index * shift : index * shift + window])}
        for index in range(length)
    ]


def test_a_chain_of_near_duplicates_is_one_component_and_the_threshold_decides_the_links(tmp_path):
    documents = chain_documents()
    hasher = MinHasher()
    neighbours = [shingle_jaccard(hasher, documents[i]["text"], documents[i + 1]["text"]) for i in range(9)]
    assert min(neighbours) > 0.8  # each window is a near duplicate of the next ...
    assert shingle_jaccard(hasher, documents[0]["text"], documents[9]["text"]) < 0.3  # ... not of the tenth
    plain, verified, strict, containing = run_stages(
        documents,
        tmp_path,
        {"verify": "none"},
        {"verify": "jaccard", "threshold": 0.7},
        {"verify": "jaccard", "threshold": 0.99},
        {"verify": "containment", "threshold": 0.99},
    )
    # Components are transitive: verified links between neighbours make one component, and its smallest
    # node is kept (node keys in order: c06, c07, c03, c09, c02, c01, c05, c04, c08, c00).
    assert min((d["id"] for d in documents), key=node_key) == "c06"
    for kept, removed, stats in (plain, verified):
        assert set(kept) == {"c06"} and len(removed) == 9
        assert {json.loads(row["detail"])["kept_id"] for row in removed.values()} == {"c06"}
        assert stats["components"] == 1 and stats["component_sizes"] == {"9-16": 1}
    assert plain[2]["verified_pairs"] == 0 and verified[2]["verified_pairs"] > 0
    # Above the neighbours' similarity no pair is a near duplicate: every window stays, in no component.
    for kept, removed, stats in (strict, containing):
        assert removed == {} and len(kept) == 10 and stats["components"] == 0
        assert stats["verified_pairs"] > 0 and stats["similar_pairs"] == 0
        assert all(document.get("dup_cluster") is None for document in kept.values())


def template_corpus(pages: int = 240, twins: int = 30) -> tuple[list[dict], dict[str, str]]:
    """Pages of one generated reference: 600 words of shared template (true Jaccard about 0.43 between
    any two pages) and 400 of their own; `twins` pages have a near copy (1% of words edited)."""
    rng = random.Random(21)
    vocab = vocabulary(rng, 8000)
    template = prose(rng, vocab, 600)
    documents, twin_of = [], {}
    for number in range(pages):
        cut = rng.randint(100, 500)
        text = template[:cut] + prose(rng, vocab, 400) + template[cut:]
        documents.append({"id": f"page{number:03d}", "text": " ".join(text)})
        if number < twins:
            documents.append({"id": f"twin{number:03d}", "text": " ".join(edit(rng, text, 0.01))})
            twin_of[f"twin{number:03d}"] = f"page{number:03d}"
    return documents, twin_of


def best_kept_similarity(hasher: MinHasher, removed: dict, kept: dict) -> dict[str, float]:
    """Each removed document's highest Jaccard similarity to any kept document."""
    kept_shingles = [hasher.shingles(document["text"]) for document in kept.values()]
    best = {}
    for identifier, row in removed.items():
        shingles = hasher.shingles(row["text"])  # once per removed document, not once per pair
        best[identifier] = max(jaccard(shingles, other) for other in kept_shingles)
    return best


def test_boilerplate_chains_remove_nothing_and_near_identical_pairs_never_both_survive(tmp_path):
    documents, twin_of = template_corpus()
    texts = {document["id"]: document["text"] for document in documents}
    hasher = MinHasher()
    assert 0.35 < shingle_jaccard(hasher, texts["page000"], texts["page100"]) < 0.5
    assert min(shingle_jaccard(hasher, texts[t], texts[p]) for t, p in twin_of.items()) > 0.9
    plain, verified, capped = run_stages(
        documents,
        tmp_path,
        {"verify": "none"},
        {},
        {"bucket_cap": 3, "representatives": 2},
    )
    # LSH alone: the template's bands put pages into shared buckets, and components chain them, so pages
    # go that share less than half their 5-grams with every page that stays.
    kept, removed, stats = plain
    assert stats["largest_bucket"] > 3 and stats["largest_component"] > 20
    assert sum(1 for value in best_kept_similarity(hasher, removed, kept).values() if value < 0.5) > 20
    # Verified edges: exactly one of each twin pair goes, naming the other, and nothing else.
    kept, removed, stats = verified
    assert set(removed) == {max(pair, key=node_key) for pair in twin_of.items()}
    for identifier, row in removed.items():
        partner = twin_of.get(identifier) or f"twin{identifier[4:]}"
        assert json.loads(row["detail"])["kept_id"] == partner and partner in kept
    assert stats["components"] == len(twin_of) and stats["capped_buckets"] == 0
    assert stats["verified_pairs"] > stats["similar_pairs"] >= len(twin_of)
    # Buckets over a cap of 3: each member is compared with 2 representatives only, what was not compared
    # is counted, and a cap never removes anything that verification would keep.
    kept_capped, removed_capped, stats = capped
    assert stats["capped_buckets"] > 0 and stats["capped_members"] > 0
    assert stats["capped_pairs"] == stats["bucket_pairs"] - stats["verified_pairs"] > 0
    assert set(removed_capped) <= set(removed)
    assert all(value > 0.9 for value in best_kept_similarity(hasher, removed_capped, kept_capped).values())


def test_one_pass_is_enough_a_rerun_on_the_kept_documents_removes_nothing(tmp_path):
    documents, _ = template_corpus(pages=120, twins=40)
    rng = random.Random(22)
    # Add chains and clusters of copies at the edge of the threshold, where the second pass of a
    # root-verified dedupe would find more.
    base = documents[0]["text"].split()
    for number in range(30):
        documents.append(
            {"id": f"edge{number:02d}", "text": " ".join(edit(rng, base, rng.uniform(0.03, 0.08)))}
        )
    documents += chain_documents(length=12, shift=15)
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
    ((kept, removed, stats),) = run_stages(documents, tmp_path / "first", {})
    assert len(removed) > 40 and stats["capped_buckets"] == 0
    ((kept_again, removed_again, stats_again),) = run_stages(list(kept.values()), tmp_path / "second", {})
    assert removed_again == {} and set(kept_again) == set(kept)
    assert stats_again["components"] == 0


def test_connected_components_converge_to_the_smallest_node_whatever_the_rounds(tmp_path):
    rng = random.Random(5)
    nodes = [f"n{value:06d}" for value in rng.sample(range(10**6), 48)]
    path = list(zip(nodes, nodes[1:], strict=False))  # one long chain, ids in random order
    triangle = [("x2", "x1"), ("x3", "x2"), ("x1", "x3"), ("x1", "x1")]  # a cycle and a self loop
    labels, stats = run_components(path + triangle, tmp_path, max_rounds=8)
    assert stats["residual_edges"] == 0 and 0 < stats["rounds_that_changed_edges"] < 8
    chain_root, triangle_root = min(nodes, key=node_key), min(("x1", "x2", "x3"), key=node_key)
    assert labels == {
        **{node: (chain_root, 48) for node in nodes},
        **{x: (triangle_root, 3) for x in ("x1", "x2", "x3")},
    }
    assert stats["components"] == 2 and stats["component_sizes"] == {"3": 1, "33-64": 1}
    # One round cannot flatten a 48-node chain: the exact finish does the rest, with the same labels.
    labels_after_one, stats = run_components(path + triangle, tmp_path, max_rounds=1)
    assert labels_after_one == labels
    assert stats["rounds"] == 1 and stats["residual_edges"] > 0 and stats["residual_nodes"] > 0
    assert stats["components"] == 2


def test_empty_one_word_and_very_long_documents_in_the_stage(tmp_path):
    rng = random.Random(6)
    vocab = vocabulary(rng)
    long_words = prose(rng, vocab, 150_000)
    documents = [
        {"id": "e0", "text": ""},
        {"id": "e1", "text": "?!"},
        {"id": "w0", "text": "Hello!"},
        {"id": "w1", "text": "hello"},  # the same single word: a near duplicate of w0
        {"id": "w2", "text": "goodbye"},
        {"id": "l0", "text": " ".join(long_words)},
        {"id": "l1", "text": " ".join(edit(rng, long_words, 0.01))},
    ]
    (kept, removed, stats), nothing = run_stages([documents, []], tmp_path, {}, {})
    # Of each pair, the one with the smaller node key stays: w0 (before w1) and l1 (before l0).
    assert min(("w0", "w1"), key=node_key) == "w0" and min(("l0", "l1"), key=node_key) == "l1"
    assert set(kept) == {"e0", "e1", "w0", "w2", "l1"} and set(removed) == {"w1", "l0"}
    assert stats["documents_without_words"] == 2
    assert kept["e0"].get("dup_cluster") is None and kept["l1"]["dup_cluster"] == "l1"
    # No documents at all (everything filtered earlier): nothing out, and the stats are still there.
    kept, removed, stats = nothing
    assert kept == {} and removed == {}
    assert stats["documents"] == 0 and stats["components"] == 0 and stats["residual_edges"] == 0


def test_only_ids_and_signatures_move_until_the_join_and_big_buckets_are_capped(tmp_path):
    # 61 light copies of one text (one component) among 40 unrelated documents, with buckets capped at 8
    # members: each copy is verified against the bucket's 2 smallest members, never held with the others.
    rng = random.Random(9)
    vocab = vocabulary(rng)
    base = prose(rng, vocab, 300)
    documents = [{"id": f"copy{index:02d}", "text": " ".join(edit(rng, base, 0.005))} for index in range(61)]
    documents += [
        {"id": f"other{index:02d}", "text": " ".join(prose(rng, vocab, 200))} for index in range(40)
    ]
    kept, removed, probe = run_probed(
        documents, tmp_path / "capped", FuzzyDedupe(max_rounds=4, bucket_cap=8, representatives=2)
    )
    root = min((d["id"] for d in documents if d["id"].startswith("copy")), key=node_key)
    assert set(kept) == {root} | {d["id"] for d in documents if d["id"].startswith("other")}
    assert len(removed) == 60 and {json.loads(row["detail"])["kept_id"] for row in removed.values()} == {root}
    # Band buckets and component rounds group node keys and signatures only; whole documents are grouped
    # once, by id, one document each.
    carrying = {label: counts for label, counts in probe.items() if counts[1]}
    assert carrying == {"JoinById": (2, 1)}
    assert probe["GroupByBand"][0] > 50  # a bucket of most copies, over the cap: streamed, not held
    # The same decisions without the cap.
    uncapped_kept, uncapped_removed, _ = run_probed(documents, tmp_path / "one", FuzzyDedupe(max_rounds=4))
    assert set(uncapped_kept) == set(kept) and uncapped_removed == removed


def test_two_documents_with_one_id_fail_naming_it(tmp_path):
    text = "the same words in the same order make the same document here"
    documents = [{"id": "x.jsonl:1", "text": text}, {"id": "x.jsonl:1", "text": text + " again"}]
    with pytest.raises(DuplicateIdError, match=r"fuzzy_dedupe: two documents have the id 'x\.jsonl:1'"):
        run_probed(documents, tmp_path, FuzzyDedupe(max_rounds=2))


def test_recipe_parameters_are_checked(tmp_path):
    recipe = tmp_path / "r.yaml"
    for bad, message in (
        ("{verify: maybe}", "verify must be one of"),
        ("{bands: 0}", "bands must be"),
        ("{threshold: 1.5}", "threshold must be"),
        ("{on_unconverged: keep}", "on_unconverged is gone: connected components now always converge"),
        ("{verify_group_size: 100}", "verify_group_size is gone: candidate pairs are now verified"),
        ("{bucket_cap: 4, representatives: 8}", "representatives .8. must not exceed bucket_cap .4."),
        ("{bucket_cap: 0}", "bucket_cap must be a positive integer"),
        ("{shingle_size: 5}", "shingle_size"),
    ):
        recipe.write_text(f"name: r\nstages:\n  - fuzzy_dedupe: {bad}\n")
        with pytest.raises(RecipeError, match=rf"stages\[0\]: bad parameters for fuzzy_dedupe: .*{message}"):
            load_recipe(recipe)
    recipe.write_text("name: r\nstages:\n  - fuzzy_dedupe: {ngram: 3, bands: 20, rows: 5, verify: none}\n")
    step = build_steps(load_recipe(recipe))[-1]
    assert step.stage == "fuzzy_dedupe" and isinstance(step.transform, FuzzyDedupe)
    assert step.transform.verify is None and (step.transform.bands, step.transform.rows) == (20, 5)


# ------------------------------------------------------------------------------- through `tokenmill curate`


def write_corpus(directory: Path) -> dict[str, str]:
    """Two JSON Lines files with near duplicates planted across them; returns copy id -> original id."""
    rng = random.Random(8)
    vocab = vocabulary(rng)
    files: list[list[dict]] = [[], []]
    planted = {}
    for number in range(80):
        base = prose(rng, vocab, rng.randint(80, 200))
        files[number % 2].append({"id": f"a{number:03d}", "text": " ".join(base)})
        if number % 4 == 0:
            files[(number + 1) % 2].append({"id": f"b{number:03d}", "text": " ".join(edit(rng, base, 0.01))})
            planted[f"b{number:03d}"] = f"a{number:03d}"
    directory.mkdir()
    for index, records in enumerate(files):
        (directory / f"part-{index}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return planted


def curate(output: Path, inputs: Path, recipe: Path, workers: int, *extra: str) -> dict:
    status = main(
        [
            "curate",
            *extra,
            "--recipe",
            str(recipe),
            "--input",
            str(inputs / "*.jsonl"),
            "--output",
            str(output),
            "--workers",
            str(workers),
        ]
    )
    assert status == 0
    return json.loads((output / "stats.json").read_text())


@pytest.mark.slow  # the default suite's 15-minute budget; make test-slow runs it
def test_curate_accounts_for_fuzzy_dedupe_and_reruns_identically_whatever_the_worker_count(tmp_path):
    planted = write_corpus(tmp_path / "in")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("name: fuzzy\nstages:\n  - exact_dedupe: {}\n  - fuzzy_dedupe: {max_rounds: 4}\n")
    stats = curate(tmp_path / "one", tmp_path / "in", recipe, workers=1)
    assert stats["balanced"] is True
    stage = stats["stages"]["fuzzy_dedupe"]
    by_reason = stats["removed_by_reason"]["fuzzy_dedupe/near_duplicate"]
    assert by_reason["documents"] == stage["removed_documents"] == len(planted)
    assert by_reason["characters"] == stage["removed_characters"]
    assert stage["candidate_pairs"] == stage["components"] == len(planted) and stage["residual_edges"] == 0
    assert stage["component_sizes"] == {"2": len(planted)}
    removed = pq.read_table(
        tmp_path / "one" / "removed" / "stage=fuzzy_dedupe" / "reason=near_duplicate"
    ).to_pylist()
    # Of each planted pair, the document with the smaller node key (of its full id) is kept.
    pairs = {frozenset(pair) for pair in planted.items()}
    kept_ids = {json.loads(row["detail"])["kept_id"] for row in removed}
    assert len(removed) == len(planted)
    for row in removed:
        kept_id = json.loads(row["detail"])["kept_id"]
        assert frozenset((row["id"].split(":")[1], kept_id.split(":")[1])) in pairs
        assert node_key(kept_id) < node_key(row["id"])
    curated = [
        row
        for path in sorted((tmp_path / "one" / "curated").rglob("*.parquet"))
        for row in pq.read_table(path).to_pylist()
    ]
    clusters = {row["id"]: row["dup_cluster"] for row in curated if row["dup_cluster"]}
    assert set(clusters) == set(clusters.values()) == kept_ids
    # The same bytes on a rerun into the same folder, with two worker processes instead of one.
    first = tree_bytes(tmp_path / "one")
    curate(tmp_path / "one", tmp_path / "in", recipe, 2, "--overwrite")
    assert tree_bytes(tmp_path / "one") == first
