"""Domain and quality classifiers: training, calibration, loading in curate, and bad models."""

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
from tokenmill.filters.classifiers import ClassifierError, DomainClassifier, QualityClassifier
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
    assert card["labels"] == sorted(
        ["web", "code", "math", "science", "legal", "reference", "conversation", "other"]
    )
    assert card["holdout_metrics"]["accuracy"] > 0.9
    assert set(card["holdout_metrics"]["labels"]) == set(card["labels"])
    assert len(card["data"]["sha256"]) == 64 and card["parameters"]["thread"] == 1
    quality = json.loads((models / "quality" / "model.json").read_text())
    assert quality["positive_label"] == "hq" and quality["holdout_metrics"]["accuracy"] > 0.9
    assert (models / "quality" / "calibration.json").exists()


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
        DomainClassifier(str(models / "domain"), domains=["web", "code", "poetry"])


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
    code_rows = [row for row in rows if row["domain"] == "code"]
    assert code_rows and all(json.loads(row["metadata"])["kind"] == "code" for row in code_rows)
    # The funnel lists the per-domain stages in order.
    assert [entry["stage"] for entry in stats["funnel"]][:4] == [
        "read",
        "normalize",
        "exact_dedupe",
        "domain_classifier",
    ]
