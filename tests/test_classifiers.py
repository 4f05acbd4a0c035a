"""Domain and quality classifiers: training on deduplicated data, calibration (of any fastText model),
max_chars, loading in curate, and bad models."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from conftest import REPO, SAMPLE, run_tokenmill

from tokenmill.filters.base import DomainChains
from tokenmill.filters.classifiers import (
    ClassifierError,
    DomainClassifier,
    QualityClassifier,
    calibrate_model,
    load_fasttext,
    split_examples,
)
from tokenmill.filters.code import CodeQuality
from tokenmill.filters.heuristics import HeuristicFilter
from tokenmill.formats.cards import CALIBRATION, CARD, read_calibration, read_card
from tokenmill.formats.documents import curated_dataset
from tokenmill.pipelines.recipe import RecipeError, load_recipe


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("classifiers")
    data = root / "data"
    # A fresh process, as the demo runs it: the generated text depends on the modules already loaded.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenmill.samples.classifier_data",
            "--output",
            str(data),
            "--per-domain",
            "150",
        ],
        check=True,
        capture_output=True,
    )
    run_tokenmill(
        "classifier",
        "train",
        "--kind",
        "domain",
        "--input",
        str(data / "domain.jsonl"),
        "--output",
        str(root / "domain"),
    )
    run_tokenmill(
        "classifier",
        "train",
        "--kind",
        "quality",
        "--input",
        str(data / "quality.jsonl"),
        "--output",
        str(root / "quality"),
        "--calibration",
        str(data / "calibration.jsonl"),
    )
    return root


def test_training_writes_a_card_with_held_out_metrics(models):
    card = json.loads((models / "domain" / "model.json").read_text())
    # Only labels that real text backs: no web, math, science or conversation (made-up text only).
    assert card["labels"] == ["code", "legal", "other", "reference"]
    assert card["holdout_metrics"]["accuracy"] > 0.8
    assert (
        card["data"]["train"]
        + card["data"]["holdout"]
        + card["data"]["exact_duplicates_removed"]
        + card["data"]["near_duplicates_removed"]
        == card["data"]["examples"]
    )
    assert set(card["holdout_metrics"]["labels"]) == set(card["labels"])
    assert len(card["data"]["sha256"]) == 64 and card["parameters"]["thread"] == 1
    quality = json.loads((models / "quality" / "model.json").read_text())
    assert quality["positive_label"] == "hq" and quality["holdout_metrics"]["accuracy"] > 0.8
    assert (models / "quality" / "calibration.json").exists()
    # Near copies of training texts (a license with another copyright line) leave the calibration set.
    calibration = quality["calibration"]
    lines = (models / "data" / "calibration.jsonl").read_text().count("\n")
    assert calibration["training_copies_removed"] > 0
    assert (
        calibration["documents"] + calibration["training_copies_removed"] + calibration["duplicates_removed"]
        == lines
    )


def test_cards_and_calibration_read_back_through_the_format(models):
    domain = read_card(str(models / "domain" / CARD))
    assert domain.kind == "domain" and domain.calibration is None
    assert "calibration" not in json.loads((models / "domain" / CARD).read_text())  # no null field either
    quality = read_card(str(models / "quality" / CARD))
    calibration = read_calibration(str(models / "quality" / CALIBRATION))
    assert quality.calibration is not None and quality.calibration.domains == sorted(calibration.cuts)
    assert calibration.positive_label == quality.positive_label == "hq"
    assert sum(calibration.documents.values()) == quality.calibration.documents


def test_a_broken_calibration_is_refused_naming_the_file_and_field(models, tmp_path):
    good = json.loads((models / "quality" / CALIBRATION).read_text())
    broken = {
        "no-star": {**good, "cuts": {k: v for k, v in good["cuts"].items() if k != "*"}},
        "short": {**good, "cuts": {**good["cuts"], "code": good["cuts"]["*"][:2]}},
        "three-buckets": {**good, "quantiles": [0.5, 0.9], "cuts": {"*": [0.1, 0.2]}},
        "not-numbers": {**good, "cuts": {**good["cuts"], "*": ["low", "mid", "high", "top"]}},
    }
    expected = {
        "no-star": r"cuts: no '\*' entry",
        "short": r"4 cuts per domain expected .*code",
        "three-buckets": r"2 quantiles, but the quality buckets 0..4 need 4 cuts",
        "not-numbers": r"cuts\.\*\[0\]",
    }
    for name, document in broken.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(document))
        with pytest.raises(ClassifierError, match=f"{re.escape(str(path))}: .*{expected[name]}"):
            QualityClassifier(str(models / "quality"), calibration=str(path))


def test_training_is_deterministic(models, tmp_path):
    again = tmp_path / "domain"
    run_tokenmill(
        "classifier",
        "train",
        "--kind",
        "domain",
        "--input",
        json.loads((models / "domain" / "model.json").read_text())["data"]["path"],
        "--output",
        str(again),
    )
    assert (again / "model.bin").read_bytes() == (models / "domain" / "model.bin").read_bytes()


def test_calibration_gives_buckets_of_roughly_equal_size(models):
    classifier = QualityClassifier(str(models / "quality"))
    calibration = [
        json.loads(line) for line in (models / "data" / "calibration.jsonl").read_text().splitlines()
    ]
    documents = [{"text": record["text"], "domain": record["domain"]} for record in calibration]
    classifier.apply(documents)
    by_domain: dict[str, Counter] = {}
    for document in documents:
        by_domain.setdefault(document["domain"], Counter())[document["quality"]] += 1
    for domain, buckets in by_domain.items():
        total = sum(buckets.values())
        for bucket in range(5):
            assert 0.1 * total <= buckets[bucket] <= 0.3 * total, (domain, dict(buckets))


def test_empty_text_gets_a_defined_label(models):
    documents = [{"text": "   "}, {"text": ""}]
    DomainClassifier(str(models / "domain")).apply(documents)
    QualityClassifier(str(models / "quality")).apply(documents)
    for document in documents:
        assert (document["domain"], document["domain_score"]) == ("other", 0.0)
        assert (document["quality_score"], document["quality"]) == (0.0, 0)


def test_bad_models_fail_naming_the_path(models, tmp_path):
    with pytest.raises(ClassifierError, match="fastText model not found: .*nowhere/model.bin"):
        DomainClassifier(str(tmp_path / "nowhere"))
    corrupt = tmp_path / "corrupt.bin"
    corrupt.write_bytes(b"\x00not a model" * 100)
    with pytest.raises(ClassifierError, match=f"{corrupt}: not a readable fastText model"):
        DomainClassifier(str(corrupt))
    with pytest.raises(
        ClassifierError, match=r"do not match the recipe's domains .*not in the model: \['poetry'\]"
    ):
        DomainClassifier(str(models / "domain"), domains=["code", "legal", "reference", "poetry"])


def test_a_recipe_with_a_bad_model_fails_before_the_pipeline(models, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: r\nstages:\n  - domain_classifier: {{model: {tmp_path}/missing}}\n")
    with pytest.raises(
        RecipeError, match=rf"{recipe}: stages\[0\]: domain_classifier: fastText model not found"
    ):
        load_recipe(recipe)
    result = run_tokenmill(
        "curate",
        "--recipe",
        str(recipe),
        "--input",
        str(SAMPLE / "*"),
        "--output",
        str(tmp_path / "out"),
        check=False,
    )
    assert result.returncode == 2 and "fastText model not found" in result.stderr
    assert not (tmp_path / "out").exists()


def test_each_domain_gets_its_own_chain():
    code = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
    chains = DomainChains({"code": [CodeQuality()], "default": [HeuristicFilter("gopher_quality")]})
    documents = [{"id": "c", "text": code, "domain": "code"}, {"id": "p", "text": code, "domain": "web"}]
    verdicts = chains.apply(documents)
    assert verdicts[0] is None  # code passes the code checks...
    assert verdicts[1] is not None and verdicts[1].stage == "gopher_quality"  # ...and fails the prose ones
    assert CodeQuality().judge("x = 1\n" + "a" * 2000 + "\n" + "y = 2\n").reason == "long_line"


def test_curate_places_documents_in_cells_with_the_trained_models(models, tmp_path):
    recipe_text = (REPO / "configs" / "curate" / "mixed.yaml").read_text()
    recipe_text = recipe_text.replace("out/demo/models/", f"{models}/")
    recipe = tmp_path / "mixed.yaml"
    recipe.write_text(recipe_text)
    output = tmp_path / "out"
    run_tokenmill(
        "curate",
        "--recipe",
        str(recipe),
        "--input",
        str(SAMPLE / "*"),
        "--output",
        str(output),
        "--workers",
        "1",
    )
    stats = json.loads((output / "stats.json").read_text())
    assert stats["balanced"]
    cells = {cell.split("/")[0].split("=")[1] for cell in stats["cells"]}
    assert {"code", "reference"} <= cells
    table = curated_dataset(str(output / "curated")).to_table()
    rows = table.to_pylist()
    assert all(0.0 <= row["quality_score"] <= 1.0 and 0 <= row["quality"] <= 4 for row in rows)
    kinds = [(row["domain"], json.loads(row["metadata"])["kind"]) for row in rows]
    # Every code chunk is placed in code. With no math label (no real math text is at hand), the sample's
    # generated worked problems, all formulas, go there too; prose never does.
    assert {kind for domain, kind in kinds if domain == "code"} <= {"code", "math"}
    assert all(domain == "code" for domain, kind in kinds if kind == "code")
    assert sum(1 for domain, kind in kinds if kind == "prose" and domain == "reference") > 0.95 * sum(
        1 for _, kind in kinds if kind == "prose"
    )
    # The funnel lists the per-domain stages in order.
    assert [entry["stage"] for entry in stats["funnel"]][:4] == [
        "read",
        "normalize",
        "exact_dedupe",
        "domain_classifier",
    ]


def _words_text(rng, vocabulary: list[str], count: int) -> str:
    return " ".join(rng.choice(vocabulary) for _ in range(count))


def _copies_across(train: list[tuple[str, str]], holdout: list[tuple[str, str]]) -> int:
    """Held-out texts with an exact (normalized) or near (5-gram Jaccard >= 0.7) copy in train, by brute
    force: no LSH, so it misses nothing the split should have prevented."""
    from tokenmill.filters.classifiers import normalized_text
    from tokenmill.filters.minhash import MinHasher, jaccard

    hasher = MinHasher(ngram=5)
    train_normalized = {normalized_text(text) for text, _ in train}
    train_shingles = [hasher.shingles(text) for text, _ in train]
    found = 0
    for text, _ in holdout:
        shingles = hasher.shingles(text)
        if normalized_text(text) in train_normalized or any(
            jaccard(shingles, other) >= 0.7 for other in train_shingles
        ):
            found += 1
    return found


def test_the_legal_text_comes_from_the_core_dependencies_only():
    """What the dev, test and train extras install never joins the training text (it would change every
    classifier and cell of the demo); the packages a plain install brings do."""
    from tokenmill.samples.classifier_data import canonical_name, core_distributions

    names = {canonical_name(distribution.metadata["Name"]) for distribution in core_distributions()}
    assert {"datatrove", "spacy", "pyarrow", "jinja2", "pyyaml"} <= names  # direct and
    assert {"thinc", "markupsafe"} <= names  # transitive requirements
    installed_extras = {"pytest", "pytest-xdist", "ruff", "hypothesis", "selenium", "jax", "scikit-learn"}
    assert not names & installed_extras and "tokenmill" not in names


def test_the_held_out_split_has_no_copy_of_a_training_text():
    import random

    rng = random.Random(5)
    vocabulary = [f"w{number}" for number in range(3000)]
    examples = [(_words_text(rng, vocabulary, 60), rng.choice(["a", "b"])) for _ in range(300)]
    distinct = [text for text, _ in examples]
    planted = _words_text(rng, vocabulary, 80)
    # 20 exact copies (case and whitespace differ: the same text once normalized) ...
    for number in range(20):
        copy = planted.upper() if number % 2 else planted.replace(" ", "  \n", 3)
        examples.append((copy, "a"))
    # ... and 20 near copies (2 of 80 words edited: Jaccard >= 0.77), and a chain: each link 2 words
    # from the last, so that its two ends are further apart than the threshold but one group all the same.
    for _ in range(20):
        words = planted.split()
        for position in rng.sample(range(len(words)), 2):
            words[position] = rng.choice(vocabulary)
        examples.append((" ".join(words), "b"))
    chain = [_words_text(rng, vocabulary, 120)]
    for _ in range(6):
        words = chain[-1].split()
        for position in rng.sample(range(len(words)), 2):
            words[position] = rng.choice(vocabulary)
        chain.append(" ".join(words))
    examples += [(text, "a") for text in chain]
    rng.shuffle(examples)

    # The check below is not vacuous: a plain shuffled split puts copies on both sides.
    naive = examples[:]
    random.Random(0).shuffle(naive)
    assert _copies_across(naive[60:], naive[:60]) > 5

    train, holdout, duplicates = split_examples(examples, 0.2, seed=0)
    assert _copies_across(train, holdout) == 0
    assert len(duplicates.exact) == 19  # the planted text itself is the one kept
    assert len(duplicates.near) == 20 + 6  # the near copies, and every link of the chain but the first
    assert len(train) + len(holdout) + len(duplicates.exact) + len(duplicates.near) == len(examples)
    # Unrelated texts are never merged: every one of the 300 distinct texts is still there.
    left = {text for text, _ in train + holdout}
    assert all(text in left for text in distinct)


@pytest.mark.slow  # the default suite's 15-minute budget; make test-slow runs it
def test_calibrate_an_external_fasttext_model_and_curate_with_it(models, tmp_path):
    """A .bin trained with the fasttext package (not tokenmill), labels of its own; calibrate, curate."""
    from tokenmill.filters.classifiers import fasttext_text

    quality = [json.loads(line) for line in (models / "data" / "quality.jsonl").read_text().splitlines()]
    train_jsonl = tmp_path / "train.jsonl"
    train_jsonl.write_text("".join(json.dumps(record) + "\n" for record in quality))
    fasttext_file = tmp_path / "train.txt"
    fasttext_file.write_text(
        "".join(
            f"__label__{'good' if r['label'] == 'hq' else 'bad'} {fasttext_text(r['text'], 10**6)}\n"
            for r in quality
        )
    )
    external = tmp_path / "external.bin"
    subprocess.run(  # a fresh process that knows nothing of tokenmill
        [
            sys.executable,
            "-c",
            "import sys, fasttext; fasttext.train_supervised(sys.argv[1], thread=1, seed=1, verbose=0, "
            "epoch=5, wordNgrams=2).save_model(sys.argv[2])",
            str(fasttext_file),
            str(external),
        ],
        check=True,
    )
    calibration = [
        json.loads(line) for line in (models / "data" / "calibration.jsonl").read_text().splitlines()
    ]
    planted = [{"text": record["text"], "domain": "reference"} for record in quality[:5]]
    # A repeat of a calibration document that copies no training text (the quality data has no other
    # languages), so that it counts as a repeat.
    foreign = next(record for record in calibration if record["domain"] == "other")
    repeat = [{**foreign, "text": foreign["text"].upper()}]
    calibration_file = tmp_path / "calibration.jsonl"
    calibration_file.write_text(
        "".join(json.dumps(record) + "\n" for record in calibration + planted + repeat)
    )
    output = tmp_path / "calibrated"
    with pytest.raises(ClassifierError, match=r"give --positive-label \(labels: \['bad', 'good'\]\)"):
        calibrate_model(str(external), str(calibration_file), str(tmp_path / "refused"))
    run_tokenmill(
        "classifier", "calibrate", "--model", str(external), "--calibration", str(calibration_file),
        "--output", str(output), "--positive-label", "good", "--max-chars", "300",
        "--exclude", str(train_jsonl),
    )  # fmt: skip
    card = read_card(str(output / CARD))
    assert card.trained_by == "external" and card.data is None and card.holdout_metrics is None
    assert card.labels == ["bad", "good"] and card.positive_label == "good"
    assert card.parameters["max_chars"] == 300
    assert card.calibration is not None
    # The bundled quality model was trained on the same texts: what its calibration dropped, plus the
    # 5 planted training texts and the 1 planted repeat.
    bundled = read_card(str(models / "quality" / CARD)).calibration
    assert bundled is not None and bundled.training_copies_removed is not None
    assert card.calibration.training_copies_removed == bundled.training_copies_removed + 5
    assert card.calibration.duplicates_removed == (bundled.duplicates_removed or 0) + 1
    assert card.calibration.documents == bundled.documents
    cuts = read_calibration(str(output / CALIBRATION)).cuts
    # Per content type: each domain's own cut points, in order.
    assert {"*", "code", "legal", "reference"} <= set(cuts)
    assert all(values == sorted(values) for values in cuts.values())
    assert cuts["code"] != cuts["reference"]
    assert (output / "model.bin").read_bytes() == external.read_bytes()

    # The stage reads the card's max_chars: 300, not 4000, and refuses a recipe that says otherwise.
    stage = QualityClassifier(str(output))
    assert stage.max_chars == 300
    with pytest.raises(ClassifierError, match="max_chars 4000 differs from the model card's 300"):
        QualityClassifier(str(output), max_chars=4000)
    model = load_fasttext(str(external))
    long_texts = [record["text"] for record in calibration if len(record["text"]) > 1500][:20]
    documents = [{"text": text, "domain": "code"} for text in long_texts]
    stage.apply(documents)

    def good_score(text: str, max_chars: int) -> float:
        labels, scores = model.predict(fasttext_text(text, max_chars), k=-1)
        return float(dict(zip(labels, scores))["__label__good"])

    assert all(d["quality_score"] == pytest.approx(good_score(d["text"], 300)) for d in documents)
    assert any(good_score(text, 300) != pytest.approx(good_score(text, 4000)) for text in long_texts)

    # Curate with it: the tokenmill-trained domain model and the external, calibrated quality model.
    inputs = tmp_path / "input"
    inputs.mkdir()
    (inputs / "docs.jsonl").write_text(
        "".join(
            json.dumps({"id": f"d{number}", "text": record["text"]}) + "\n"
            for number, record in enumerate(calibration[:80])
        )
    )
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "name: external\nstages:\n"
        f"  - domain_classifier: {{model: {models}/domain}}\n"
        f"  - quality_classifier: {{model: {output}}}\n"
    )
    curated = tmp_path / "out"
    run_tokenmill(
        "curate",
        "--recipe",
        str(recipe),
        "--input",
        str(inputs / "*.jsonl"),
        "--output",
        str(curated),
        "--workers",
        "1",
    )
    stats = json.loads((curated / "stats.json").read_text())
    assert stats["balanced"] and stats["kept"]["documents"] == 80
    rows = curated_dataset(str(curated / "curated")).to_table().to_pylist()
    assert {row["quality"] for row in rows} >= {0, 4}
    for row in rows[:10]:
        assert row["quality_score"] == pytest.approx(good_score(row["text"], 300), abs=1e-5)
