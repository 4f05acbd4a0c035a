"""`tokenmill mixture check|plan|diff|schema` through the real command line entry point."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tokenmill.cli import main

REPO = Path(__file__).resolve().parents[1]
MIXTURES = REPO / "mixtures"
HERO = str(MIXTURES / "marin-535b-a23b.yaml")
# The illustrative 11-source mixture that tests/test_mixtures_plan.py works out by hand.
REFERENCE = str(Path(__file__).parent / "fixtures" / "eleven-sources.yaml")
HELD = {"heldout_tokens": 500, "heldout_documents": 2, "heldout_bytes": 2_000}
SAMPLE_COUNTS = {
    "format_version": 1,
    "tokenizer": {"name": "tokenmill-bpe-4k", "sha256": "", "vocab_size": 4096},
    "total_tokens": 0,
    "total_documents": 0,
    # Held-out slices as the demo tokenizes them (mixtures/demo.yaml evaluates on every domain's).
    "heldout": {"fraction": 0.05, "max_tokens": 4_000_000, "min_documents": 2},
    # Cells like those the demo's classifiers make of the sample corpus (a few domains are missing, as they
    # may be: the demo mixture spreads their weight over the others).
    "cells": {
        **{
            f"domain=c00/quality={q}": {"tokens": 40_000 + 1_000 * q, "documents": 9, **HELD}
            for q in range(5)
        },
        **{f"domain=c01/quality={q}": {"tokens": 20_000, "documents": 9, **HELD} for q in (2, 3, 4)},
        "domain=c02/quality=3": {"tokens": 10_000, "documents": 9, **HELD},
    },
}
#: The search demo's cells (mixtures/demo-search.yaml): every domain the sample's classifier finds, four
#: large ones and six small ones, at every quality bucket.
SEARCH_COUNTS = {
    **SAMPLE_COUNTS,
    "cells": {
        f"domain=c{domain:02d}/quality={q}": {"tokens": size // 5, "documents": 9, **HELD}
        for domain, size in enumerate([120_000, 90_000, 70_000, 60_000] + [6_000] * 6)
        for q in range(5)
    },
}


@pytest.fixture
def counts_file(tmp_path: Path) -> str:
    path = tmp_path / "counts.json"
    path.write_text(json.dumps(SAMPLE_COUNTS))
    return str(path)


@pytest.fixture
def search_counts_file(tmp_path: Path) -> str:
    path = tmp_path / "search-counts.json"
    path.write_text(json.dumps(SEARCH_COUNTS))
    return str(path)


def test_check_every_shipped_mixture(capsys, counts_file):
    files = sorted(str(path) for path in MIXTURES.glob("*.yaml"))
    assert main(["mixture", "check", *files]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == len(files) and all(": ok (" in line for line in out)
    assert main(["mixture", "check", str(MIXTURES / "demo.yaml"), "--counts", counts_file]) == 0
    assert "planned against" in capsys.readouterr().out


@pytest.mark.parametrize("path", sorted(MIXTURES.glob("*.yaml")), ids=lambda p: p.name)
def test_plan_every_shipped_mixture(capsys, counts_file, search_counts_file, path):
    # The demo's mixtures plan against the demo's token counts; the others carry their own.
    counts = {"demo.yaml": counts_file, "demo-search.yaml": search_counts_file}.get(path.name)
    extra = ["--counts", counts] if counts else []
    assert main(["mixture", "plan", str(path), "--json", *extra]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["name"] == path.stem
    assert document["phases"][-1]["end_step"] == document["total_steps"]
    for phase in document["phases"]:
        assert sum(source["tokens"] for source in phase["sources"]) == phase["tokens"]


def test_plan_text(capsys):
    assert main(["mixture", "plan", REFERENCE]) == 0
    out = capsys.readouterr().out
    assert (
        "phase pretraining: steps 0 to 447,035 (447,035 steps, 1,788,140 blocks), 15T tokens (asked 15T)"
        in out
    )
    assert "phase midtraining: steps 447,035 to 558,794" in out
    assert "(illustrative)" in out


def test_plan_text_of_the_reference_run(capsys):
    assert main(["mixture", "plan", HERO]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(
        "marin-535b-a23b: 18.75T tokens budgeted (phase shares and epochs refer to it), 18.01T planned in "
        "390,251 steps of 46,137,344 tokens (11,264 x 4,096) (total_steps); mixture blocks of 49,152 "
        "sequences, boundaries every 48 step(s)\n"
    )
    out = captured.out
    assert (
        "from marin-community/marin experiments/grug/moe_hero_ep/harrier_mix_2026_08_18.json at 4da809f"
        in out
    )
    assert (
        "phase pretraining: steps 0 to 312,192 (312,192 steps, 71,544 blocks), 14.4T tokens (asked 15T)"
        in out
    )
    assert (
        "phase midtraining: steps 312,192 to 390,251 (78,059 steps, 17,888 blocks and 25,600 sequences of "
        "one more), 3.601T tokens (asked 3.75T)" in out
    )
    # Weights too small for one sequence in 49,152 are kept as published, and the plan says what they become.
    assert "weight 9.587e-09 rounds to 0 of 49152 sequences per block" in captured.err


def test_plan_output_file(tmp_path, capsys, counts_file):
    target = tmp_path / "plans" / "demo.json"
    assert (
        main(
            ["mixture", "plan", str(MIXTURES / "demo.yaml"), "--counts", counts_file, "--output", str(target)]
        )
        == 0
    )
    assert json.loads(target.read_text())["name"] == "demo"
    captured = capsys.readouterr()
    assert "phase pretraining" in captured.out
    assert "domain=c0[4-9]/quality>=2 matches no cell in counts.json" in captured.err


def test_plan_uses_the_specs_counts_file(tmp_path, capsys, counts_file):
    spec = (MIXTURES / "demo.yaml").read_text().replace("../out/demo/tokens/counts.json", "counts.json")
    (tmp_path / "demo.yaml").write_text(spec)
    assert main(["mixture", "plan", str(tmp_path / "demo.yaml"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens_from"] == "counts.json"


def test_plan_demo_without_counts_says_what_to_do(tmp_path, capsys):
    spec = (
        (MIXTURES / "demo.yaml").read_text().replace("../out/demo/tokens/counts.json", "missing/counts.json")
    )
    (tmp_path / "demo.yaml").write_text(spec)
    assert main(["mixture", "plan", str(tmp_path / "demo.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"tokenmill mixture: error: {tmp_path / 'demo.yaml'}: planning needs token counts, and its counts "
        f"file {tmp_path / 'missing/counts.json'} does not exist yet: run the tokenize stage first, or pass "
        "--counts"
    )


def test_errors_are_one_line_with_file_path_and_line(tmp_path, capsys):
    text = Path(REFERENCE).read_text().replace("      code-hq: 0.20\n", "      snippets: 0.20\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    assert main(["mixture", "check", str(bad)]) == 2
    err = capsys.readouterr().err
    line = text.splitlines().index("      snippets: 0.20") + 1
    assert (
        err == f"tokenmill mixture: error: {bad}: phases[1].weights.snippets: unknown source (line {line})\n"
    )


def test_missing_file(capsys):
    assert main(["mixture", "check", "nowhere.yaml"]) == 2
    assert (
        capsys.readouterr().err
        == "tokenmill mixture: error: nowhere.yaml: no such mixture file: nowhere.yaml\n"
    )


def test_schema(capsys, tmp_path):
    assert main(["mixture", "schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["title"] == "tokenmill mixture" and "phases" in schema["properties"]
    assert main(["mixture", "schema", "--output", str(tmp_path / "s.json")]) == 0
    assert json.loads((tmp_path / "s.json").read_text()) == schema


def test_diff_files(tmp_path, capsys):
    text = Path(REFERENCE).read_text().replace("total_tokens: 18.75T", "total_tokens: 20T")
    (tmp_path / "marin-535b-a23b.yaml").write_text(text)
    assert main(["mixture", "diff", REFERENCE, str(tmp_path / "marin-535b-a23b.yaml")]) == 0
    out = capsys.readouterr().out
    assert "total_tokens 18.75T -> 20T (+1.25T, +6.7%)" in out
    assert "phase pretraining (changed): tokens 15T -> 16T" in out
    assert "web-q4" in out and "epochs 2.002 -> 2.135" in out
    assert main(["mixture", "diff", REFERENCE, str(tmp_path / "marin-535b-a23b.yaml"), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["fields"]["total_tokens"] == [18_750_000_000_000, 20_000_000_000_000]


def test_diff_same_file(capsys):
    assert main(["mixture", "diff", HERO, HERO]) == 0
    assert "no change in steps, tokens or epochs" in capsys.readouterr().out


def test_diff_git_revisions(tmp_path, capsys, monkeypatch):
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "mixtures").mkdir()
    spec = tmp_path / "mixtures" / "marin-535b-a23b.yaml"
    spec.write_text(Path(HERO).read_text())
    rung = tmp_path / "mixtures" / "marin-ladder-48b.yaml"
    rung.write_text((MIXTURES / "marin-ladder-48b.yaml").read_text())
    subprocess.run([*git, "-C", str(tmp_path), "add", "."], check=True)
    subprocess.run([*git, "-C", str(tmp_path), "commit", "-q", "-m", "one"], check=True)
    # Swap two cells' midtraining weights (each value appears once, in midtraining).
    text = spec.read_text()
    c32, c30 = "      c32q3: 0.040449415611640636\n", "      c30q4: 0.02865497188099325\n"
    assert text.count(c32) == 1 and text.count(c30) == 1
    spec.write_text(
        text.replace(c32, "      c32q3: 0.02865497188099325\n").replace(
            c30, "      c30q4: 0.040449415611640636\n"
        )
    )
    monkeypatch.chdir(tmp_path)
    assert (
        main(["mixture", "diff", "HEAD:mixtures/marin-535b-a23b.yaml", "mixtures/marin-535b-a23b.yaml"]) == 0
    )
    out = capsys.readouterr().out
    assert "phase midtraining (changed)" in out and "c32q3" in out and "c30q4" in out
    assert "phase pretraining" not in out
    # a slice read from git finds its parent in the same revision
    assert (
        main(["mixture", "diff", "HEAD:mixtures/marin-ladder-48b.yaml", "mixtures/marin-ladder-48b.yaml"])
        == 0
    )
    assert "c32q3" in capsys.readouterr().out
    assert main(["mixture", "diff", "HEAD~5:mixtures/x.yaml", "mixtures/marin-535b-a23b.yaml"]) == 2
    assert "git cannot show it" in capsys.readouterr().err


def test_mixture_without_action_prints_help(capsys):
    assert main(["mixture"]) == 2
    assert "check" in capsys.readouterr().out
