"""Topic domains (issue 20): `tokenmill domains train` and the curate stage `domain_clusters`.

The corpus is real text of distinct kinds that every Python install carries, planted together: chunks of
standard-library sources, license texts (Python's LICENSE.txt and the installed distributions' license
files) and the language reference's prose (pydoc_data). No labels go in; the kinds must come out as
distinct domains.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import random
import re
import sysconfig
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, run_tokenmill

from tokenmill.domains.clustering import coarsen, normalize_rows, spherical_kmeans, ward_merges
from tokenmill.domains.model import DomainsError, load_domain_model
from tokenmill.domains.stage import DomainClusters
from tokenmill.domains.train import DomainSettings, FastTextSettings, train_domains
from tokenmill.formats.domains import CARD, read_domains_card
from tokenmill.pipelines.recipe import Recipe, RecipeError, load_recipe

PER_KIND = 60


def _code(rng: random.Random) -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    documents = []
    for path in sorted(p for p in stdlib.glob("*.py") if p.stat().st_size > 5000):
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        start = rng.randrange(max(1, len(lines) - 60))
        chunk = "\n".join(lines[start : start + 50])
        if len(chunk.split()) >= 60:
            documents.append(chunk)
    return documents


def _legal(rng: random.Random) -> list[str]:
    texts = [(Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text(errors="replace")]
    for distribution in sorted(importlib.metadata.distributions(), key=lambda d: d.metadata["Name"] or ""):
        for file in sorted(distribution.files or [], key=str):
            if ".dist-info" in str(file) and re.match(r"(licen[cs]e|copying)", file.name, re.IGNORECASE):
                try:
                    texts.append(Path(distribution.locate_file(file)).read_text(errors="replace"))
                except OSError:
                    continue
    chunks: dict[str, None] = {}
    for text in texts:
        paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if len(p.split()) > 8]
        for start in range(0, len(paragraphs), 3):
            chunk = "\n\n".join(paragraphs[start : start + 3])
            if len(chunk.split()) >= 60:
                chunks[chunk] = None  # many packages ship the same MIT text: each chunk once
    return list(chunks)


def _reference(rng: random.Random) -> list[str]:
    from pydoc_data.topics import topics

    return [text[:3000] for _, text in sorted(topics.items()) if len(text.split()) >= 80]


def planted_corpus(seed: int = 0) -> dict[str, list[str]]:
    """PER_KIND real documents of each kind (fewer where an install carries fewer)."""
    rng = random.Random(seed)
    kinds = {"code": _code(rng), "legal": _legal(rng), "reference": _reference(rng)}
    for documents in kinds.values():
        rng.shuffle(documents)
    return {kind: documents[:PER_KIND] for kind, documents in kinds.items()}


def write_corpus(path: Path, corpus: dict[str, list[str]]) -> dict[str, str]:
    """The planted documents as one JSON Lines file (kinds interleaved); returns id -> kind."""
    records = [(kind, index, text) for kind, texts in corpus.items() for index, text in enumerate(texts)]
    random.Random(1).shuffle(records)
    with path.open("w") as handle:
        for kind, index, text in records:
            handle.write(json.dumps({"id": f"{kind}-{index}", "text": text}) + "\n")
    return {f"{kind}-{index}": kind for kind, index, _ in records}


SETTINGS = DomainSettings(k=12, domains=3, min_share=0.05, sample=10_000)


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    root = tmp_path_factory.mktemp("domains")
    corpus = planted_corpus()
    assert all(len(texts) >= 40 for texts in corpus.values()), {k: len(v) for k, v in corpus.items()}
    kinds = write_corpus(root / "planted.jsonl", corpus)
    card = train_domains([str(root / "planted.jsonl")], str(root / "model"), SETTINGS)
    return root, corpus, kinds, card


def test_documents_of_distinct_real_kinds_end_up_in_distinct_domains(planted):
    root, corpus, _, card = planted
    model = load_domain_model(str(root / "model"))
    majority = {}
    for kind, texts in corpus.items():
        ids, scores = model.assign(texts)
        domain, hits = Counter(ids).most_common(1)[0]
        assert hits / len(texts) >= 0.85, (kind, Counter(ids))  # purity of each kind
        majority[kind] = domain
        assert np.all((-1.0 <= scores) & (scores <= 1.0 + 1e-5))
    assert len(set(majority.values())) == 3, majority  # three kinds, three domains
    # Each domain is mostly one kind too (no domain swallows two kinds).
    for entry in card.domains:
        assert entry.documents >= 0.05 * card.sample.documents
    # Names come from the text: the code domain's terms include Python's keywords.
    code_terms = set(next(d.terms for d in card.domains if d.id == majority["code"]))
    assert code_terms & {"self", "def", "return", "if", "none", "import"}, code_terms
    legal_terms = set(next(d.terms for d in card.domains if d.id == majority["legal"]))
    assert legal_terms & {"license", "software", "copyright", "warranty", "liability", "notice"}, legal_terms


def test_the_card_says_what_was_fitted(planted):
    root, corpus, kinds, card = planted
    assert read_domains_card(str(root / "model" / CARD)) == card
    assert card.sample.documents == card.sample.documents_read == len(kinds)
    assert card.fine.k == 12 and card.domains_requested == 3 and len(card.domains) == 3
    assert [d.id for d in card.domains] == ["c00", "c01", "c02"]
    assert sum(d.documents for d in card.domains) == card.sample.documents
    assert abs(sum(d.share for d in card.domains) - 1) < 1e-4
    assert [d.documents for d in card.domains] == sorted((d.documents for d in card.domains), reverse=True)
    assert card.within_domain_cosine > card.between_domain_cosine
    model = load_domain_model(str(root / "model"))
    assert model.domain_ids == [d.id for d in card.domains]
    texts = {
        f"planted.jsonl:{kind}-{index}": text for kind, t in corpus.items() for index, text in enumerate(t)
    }
    for domain in card.domains:
        assert domain.terms and domain.examples and domain.name
        # The examples are documents of the sample, placed in their own domain, most central first.
        assert [e.cosine for e in domain.examples] == sorted(
            (e.cosine for e in domain.examples), reverse=True
        )
        for example in domain.examples:
            assert texts[example.id].startswith(example.preview) and len(example.preview) > 50
            assert model.assign([texts[example.id]])[0] == [domain.id]


def test_the_fit_is_deterministic_and_the_seed_matters(planted, tmp_path):
    root, _, _, card = planted
    again = train_domains([str(root / "planted.jsonl")], str(tmp_path / "again"), SETTINGS)
    assert again == card
    for name in ("clusters.npz", "embedding.bin", "model.json"):
        assert (tmp_path / "again" / name).read_bytes() == (root / "model" / name).read_bytes(), name
    vectors = normalize_rows(np.random.default_rng(0).normal(size=(300, 8)).astype(np.float32))
    first, second = spherical_kmeans(vectors, 10, seed=1), spherical_kmeans(vectors, 10, seed=1)
    assert np.array_equal(first.labels, second.labels) and np.array_equal(first.centroids, second.centroids)
    other = spherical_kmeans(vectors, 10, seed=2)
    assert not np.array_equal(first.centroids, other.centroids)


def test_a_diverged_training_runs_again_at_half_the_learning_rate(planted, tmp_path, caplog):
    root = planted[0]
    # cbow on this sample diverges at lr >= 1 and trains at 0.5 (measured); 1.6 halves three times at most.
    steep = DomainSettings(k=12, domains=3, min_share=0.05, fasttext=FastTextSettings(epoch=5, lr=1.6))
    with caplog.at_level(logging.WARNING, logger="tokenmill.domains.train"):
        card = train_domains([str(root / "planted.jsonl")], str(tmp_path / "steep"), steep)
    halvings = [r.getMessage() for r in caplog.records if "diverged (NaN)" in r.getMessage()]
    assert halvings and "at lr 1.6 on the sample; training again at lr 0.8" in halvings[0]
    assert card.embedding.parameters["lr"] == pytest.approx(1.6 / 2 ** len(halvings))
    assert len(card.domains) == 3
    hopeless = DomainSettings(k=12, domains=3, fasttext=FastTextSettings(epoch=5, lr=800.0))
    with pytest.raises(DomainsError, match=r"at lr 100 \(Encountered NaN.\)"):
        train_domains([str(root / "planted.jsonl")], str(tmp_path / "hopeless"), hopeless)
    assert not (tmp_path / "hopeless" / CARD).exists()


def test_an_external_embedding_is_used_where_it_is(planted, tmp_path):
    root, corpus, _, card = planted
    external = tmp_path / "vectors" / "cc.bin"
    external.parent.mkdir()
    external.write_bytes((root / "model" / "embedding.bin").read_bytes())
    settings = DomainSettings(k=12, domains=3, min_share=0.05, embedding=str(external))
    theirs = train_domains([str(root / "planted.jsonl")], str(tmp_path / "model"), settings)
    assert theirs.embedding.kind == "external" and theirs.embedding.path == str(external)
    assert not (tmp_path / "model" / "embedding.bin").exists()  # named, not copied
    # The same vectors give the same clusters as the fit that trained them.
    assert [d.documents for d in theirs.domains] == [d.documents for d in card.domains]
    model = load_domain_model(str(tmp_path / "model"))
    assert (
        model.assign(corpus["code"][:5])[0]
        == load_domain_model(str(root / "model")).assign(corpus["code"][:5])[0]
    )
    external.unlink()
    with pytest.raises(DomainsError, match="fastText model not found"):
        load_domain_model(str(tmp_path / "model"))


def test_spherical_kmeans_finds_planted_directions():
    rng = np.random.default_rng(0)
    directions = normalize_rows(rng.normal(size=(4, 16)))
    truth = np.repeat(np.arange(4), [200, 100, 50, 25])
    vectors = normalize_rows(directions[truth] + 0.15 * rng.normal(size=(len(truth), 16))).astype(np.float32)
    result = spherical_kmeans(vectors, 4, seed=0)
    assert result.converged
    # Each planted group is exactly one cluster.
    assert len({tuple(sorted(set(result.labels[truth == g]))) for g in range(4)}) == 4
    assert all(len(set(result.labels[truth == g])) == 1 for g in range(4))
    with pytest.raises(ValueError, match="at least 5 documents"):
        spherical_kmeans(vectors[:4], 5)


def test_ward_merges_are_scipys_ward_linkage():
    from scipy.cluster.hierarchy import fcluster, linkage

    points = np.random.default_rng(3).normal(size=(40, 5))
    ours = ward_merges(points, np.ones(40))
    theirs = linkage(points, method="ward")
    # SciPy's Ward distance is sqrt(2 * cost).
    ours_sorted = sorted((cost, a, b) for a, b, cost in ours)
    assert np.allclose([np.sqrt(2 * cost) for cost, _, _ in ours_sorted], theirs[:, 2])
    # Cut at any number of groups, the partitions are SciPy's.
    for groups in (2, 5, 12):
        mine = coarsen(points, np.ones(40), groups, 0.0)
        scipys = fcluster(theirs, groups, criterion="maxclust")
        assert len(set(mine)) == groups
        assert {tuple(np.flatnonzero(mine == g)) for g in set(mine)} == {
            tuple(np.flatnonzero(scipys == g)) for g in set(scipys)
        }


def test_coarsening_respects_the_min_share():
    rng = np.random.default_rng(0)
    directions = normalize_rows(rng.normal(size=(6, 16)))
    # Fine clusters around six directions; the sixth direction holds 2% of the documents.
    fine = np.repeat(np.arange(6), 4)
    sizes = np.array([250] * 20 + [10, 10, 10, 10])
    sizes = sizes[np.argsort(fine, kind="stable")]
    means = normalize_rows(directions[fine] + 0.05 * rng.normal(size=(24, 16)))
    sums = means * sizes[:, None]
    without = coarsen(sums, sizes, 6, 0.0)
    shares = np.bincount(without, weights=sizes) / sizes.sum()
    assert len(shares) == 6 and shares.min() < 0.05  # the small direction is its own domain...
    with_floor = coarsen(sums, sizes, 6, 0.05)
    shares = np.bincount(with_floor, weights=sizes) / sizes.sum()
    assert len(shares) == 5 and shares.min() >= 0.05  # ...until the floor merges it into its nearest
    assert (
        list(np.bincount(with_floor, weights=sizes)) == sorted(np.bincount(with_floor, weights=sizes))[::-1]
    )
    # Fine clusters of one direction always share a domain.
    for direction in range(6):
        assert len(set(with_floor[fine == direction])) == 1
    with pytest.raises(ValueError, match="K < N"):
        coarsen(sums, sizes, 30, 0.0)


def test_the_stage_in_beam_assigns_what_the_model_predicts(planted, tmp_path):
    import apache_beam as beam

    from tokenmill.formats.documents import curated_dataset
    from tokenmill.pipelines.curate import CurateRun, build_pipeline

    root, _, kinds, _ = planted
    recipe = Recipe.model_validate(
        {
            "name": "topics",
            "stages": [{"exact_dedupe": {}}, {"domain_clusters": {"model": str(root / "model")}}],
        }
    )
    output = tmp_path / "curate"
    run = CurateRun(recipe, "topics.yaml", [str(root / "planted.jsonl")], str(output))
    with beam.Pipeline(runner="DirectRunner") as pipeline:
        build_pipeline(pipeline, run)
    rows = curated_dataset(str(output / "curated")).to_table().to_pylist()
    stats = json.loads((output / "stats.json").read_text())
    assert stats["balanced"] and stats["read"]["documents"] == len(kinds)
    model = load_domain_model(str(root / "model"))
    expected, scores = model.assign([row["text"] for row in rows])
    assert [row["domain"] for row in rows] == expected
    assert np.allclose([row["domain_score"] for row in rows], scores, atol=1e-6)
    assert {cell.split("/")[0] for cell in stats["cells"]} <= {f"domain={d}" for d in model.domain_ids}
    # The step pickles without its model and finds the same one again in this process.
    step = DomainClusters(str(root / "model"))
    copy = __import__("pickle").loads(__import__("pickle").dumps(step))
    assert copy._model is None
    copy.setup()
    assert copy._model is step._shared_model.get()


def test_the_recipe_refuses_a_missing_model_and_a_stage_out_of_order(planted, tmp_path):
    root = planted[0]
    missing = tmp_path / "missing.yaml"
    missing.write_text(f"name: x\nstages:\n  - domain_clusters: {{model: {tmp_path / 'nope'}}}\n")
    with pytest.raises(RecipeError, match=r"missing.yaml: stages\[0\]: domain_clusters: .*not found"):
        load_recipe(missing)
    late = tmp_path / "late.yaml"
    late.write_text(
        f"name: x\nstages:\n  - domain_clusters: {{model: {root / 'model'}}}\n"
        "  - by_domain: {default: [{gopher_repetition: {}}]}\n"
    )
    with pytest.raises(RecipeError, match=r"by_domain must come before it"):
        load_recipe(late)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / CARD).write_text((root / "model" / CARD).read_text())
    (broken / "clusters.npz").write_bytes(b"not a zip")
    with pytest.raises(DomainsError, match="clusters.npz: not a clusters file"):
        load_domain_model(str(broken))


def test_the_command_writes_the_card_and_says_what_it_found(planted, tmp_path):
    root = planted[0]
    result = run_tokenmill(
        "domains",
        "train",
        "--input",
        str(root),
        "--k",
        "6",
        "--domains",
        "3",
        "--min-share",
        "0.1",
        "--output",
        str(tmp_path / "model"),
    )
    card = json.loads((tmp_path / "model" / CARD).read_text())
    assert card["kind"] == "domains" and card["fine"]["k"] == 6 and len(card["domains"]) <= 3
    assert all(domain["share"] >= 0.1 for domain in card["domains"])
    assert "c00" in result.stdout and "wrote" in result.stdout
    # The folder was read as its files: the model's own files are not input.
    assert card["sample"]["documents"] == len(planted[2])


def test_bad_input_gives_clear_errors(tmp_path):
    def domains_train(source, k: int, domains: int):
        return run_tokenmill("domains", "train", "--input", str(source), "--k", str(k), "--domains",
                             str(domains), "--output", str(tmp_path / "m"), check=False)  # fmt: skip

    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"id": "a", "text": "   "}\n{"id": "b"}\nnot json\n')
    result = domains_train(empty, 2, 1)
    assert result.returncode == 2
    assert "no documents with text (3 records read, 2 rejected, 1 empty)" in result.stderr
    assert not (tmp_path / "m" / CARD).exists()
    few = tmp_path / "few.jsonl"
    few.write_text("".join(json.dumps({"id": str(i), "text": f"word{i} text"}) + "\n" for i in range(3)))
    result = domains_train(few, 2, 4)
    assert result.returncode == 2 and "--k 2 is less than --domains 4" in result.stderr
    result = domains_train(few, 5, 2)
    assert result.returncode == 2 and "need at least 5 documents; the sample has 3" in result.stderr
    result = domains_train(tmp_path / "none-*.jsonl", 2, 1)
    assert result.returncode == 2 and "no input files" in result.stderr


def test_the_demo_recipe_is_mixed_yaml_with_topic_domains():
    import yaml

    demo = yaml.safe_load((REPO / "configs" / "curate" / "demo.yaml").read_text())
    mixed = yaml.safe_load((REPO / "configs" / "curate" / "mixed.yaml").read_text())
    assert demo["stages"][-1] == {"domain_clusters": {"model": "out/demo/models/domains"}}
    assert demo["stages"][-2] == {"decontam": {"index": "out/demo/decontam.index", "action": "flag"}}
    assert {**demo, "name": mixed["name"], "stages": demo["stages"][:-2]} == mixed, (
        "configs/curate/demo.yaml is mixed.yaml plus the decontam and domain_clusters stages: "
        "copy mixed.yaml's change"
    )
