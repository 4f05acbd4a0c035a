"""Line-level boilerplate removal: repeated navigation lines of a source go, the pages' own lines stay,
documentation pages then pass FineWeb's checks, and every document is accounted for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_tokenmill
from datatrove.data import Document

from tokenmill.filters.boilerplate import (
    BoilerplateLineFilter,
    BoilerplateLines,
    line_hash,
    source_key,
    strip_lines,
)
from tokenmill.filters.heuristics import HeuristicFilter
from tokenmill.formats.documents import curated_dataset
from tokenmill.pipelines.recipe import RecipeError, load_recipe
from tokenmill.samples.text import prose_paragraphs

# What the text of a docs.python.org page starts and ends with (its navigation, top and bottom).
NAVIGATION = [
    "Navigation",
    "index",
    "modules |",
    "next |",
    "previous |",
    "Python »",
    "3.11.7 Documentation »",
    "The Python Standard Library »",
]
FOOTER = ["Theme Auto Light Dark", "Table of Contents", "Previous topic", "Next topic", "This Page",
          "Report a Bug", "Show Source", "© Copyright 2001-2023, Python Software Foundation."]  # fmt: skip


def docs_page(paragraphs: list[str]) -> str:
    return "\n".join(NAVIGATION + [""] + ["\n\n".join(paragraphs)] + [""] + FOOTER + NAVIGATION)


def test_strip_lines_removes_frequent_lines_and_keeps_the_rest():
    text = "Home | About\n\nA line of its own.\n  HOME |   about  \nAnother line.\n\nBack to top"
    frequent = {line_hash("home | about"), line_hash("Back to top")}
    stripped = strip_lines(text, frequent)
    assert stripped.text == "A line of its own.\nAnother line."  # case and spacing do not hide a copy
    assert stripped.lines_removed == 3
    assert stripped.characters_removed == len(text) - len(stripped.text)
    assert strip_lines("nothing to do\nhere", frequent).lines_removed == 0


def test_code_and_other_sources_are_not_edited():
    frequent = {"source:site.jsonl": {line_hash("return None")}}
    editor = BoilerplateLines()
    code = {"text": "def f():\n    return None\n", "source": "site.jsonl", "domain": "code"}
    assert editor.edit(code, frequent.get(editor.key(code))) is None and code["text"].endswith("None\n")
    prose = {"text": "Text.\nreturn None", "source": "other.jsonl"}
    assert editor.edit(prose, frequent.get(editor.key(prose))) is None
    by_host = BoilerplateLines(by="url_host")
    assert source_key({"url": "https://docs.python.org/3/x.html", "source": "a"}, "url_host") == (
        "host:docs.python.org"
    )
    no_url = {"text": "Text.\nreturn None", "source": "site.jsonl", "url": None}
    assert by_host.edit(no_url, frequent.get(by_host.key(no_url))) and no_url["text"] == "Text."


def test_the_datatrove_filter_edits_and_drops_like_the_stage():
    frequent = {"source:docs": {line_hash(line) for line in NAVIGATION}}
    step = BoilerplateLineFilter(frequent)
    page = Document(text=docs_page(["Real text."]), id="1", metadata={"source": "docs"})
    assert step.filter(page) is True and page.text.split("\n")[0] == "Real text."
    only_navigation = Document(text="\n".join(NAVIGATION), id="2", metadata={"source": "docs"})
    assert step.filter(only_navigation) == (False, "boilerplate_only")


def test_bad_parameters_fail_at_recipe_load(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\nstages:\n  - line_boilerplate: {min_documents: 1}\n")
    with pytest.raises(RecipeError, match=r"stages\[0\]: bad parameters for line_boilerplate: min_documents"):
        load_recipe(recipe)
    recipe.write_text("name: r\nstages:\n  - line_boilerplate: {by: domain}\n")
    with pytest.raises(RecipeError, match="by must be 'source' or 'url_host'"):
        load_recipe(recipe)


def _curate(tmp_path: Path, name: str, stages: str, inputs: Path) -> dict:
    recipe = tmp_path / f"{name}.yaml"
    recipe.write_text(f"name: {name}\nstages:\n{stages}")
    output = tmp_path / name
    run_tokenmill(
        "curate", "--recipe", str(recipe), "--input", str(inputs / "*.jsonl"), "--output", str(output),
        "--workers", "1",
    )  # fmt: skip
    stats = json.loads((output / "stats.json").read_text())
    rows = (
        curated_dataset(str(output / "curated")).to_table().to_pylist() if stats["kept"]["documents"] else []
    )
    return {"stats": stats, "rows": {row["id"]: row for row in rows}}


def test_documentation_pages_keep_their_text_and_pass_fineweb_after_the_navigation_goes(tmp_path):
    paragraphs = [p for p in prose_paragraphs() if len(p) > 200][:90]
    pages = [docs_page(paragraphs[3 * n : 3 * n + 3]) for n in range(30)]
    navigation_only = ["\n".join(NAVIGATION + FOOTER)] * 5
    inputs = tmp_path / "input"
    inputs.mkdir()
    (inputs / "docs.jsonl").write_text(
        "".join(
            json.dumps({"id": f"p{n}", "text": text}) + "\n" for n, text in enumerate(pages + navigation_only)
        )
    )
    # Another source where a navigation line occurs in fewer than min_documents documents: it stays.
    others = [f"{paragraphs[n]}\nShow Source\n{paragraphs[n + 1]}" for n in range(8)]
    (inputs / "other.jsonl").write_text(
        "".join(json.dumps({"id": f"o{n}", "text": text}) + "\n" for n, text in enumerate(others))
    )
    # Without the step FineWeb's filter removes the pages for their repeated and short lines ...
    fineweb = HeuristicFilter("fineweb_quality")
    before = fineweb.apply([{"id": str(n), "text": text} for n, text in enumerate(pages)])
    assert sum(1 for verdict in before if verdict is None) <= 2
    # ... with it, run first in the same recipe, they are kept.
    stages = "  - line_boilerplate: {min_documents: 10, min_fraction: 0.2}\n  - fineweb_quality: {}\n"
    after = _curate(tmp_path, "after", stages, inputs)
    kept_pages = sorted(key for key in after["rows"] if key.startswith("docs.jsonl:p"))
    assert len(kept_pages) == 30
    for n in range(30):
        text = after["rows"][f"docs.jsonl:p{n}"]["text"]
        assert text == "\n\n".join(paragraphs[3 * n : 3 * n + 3])  # every own line, no navigation line
        assert after["rows"][f"docs.jsonl:p{n}"]["n_chars"] == len(text)
    for n in range(8):  # the other source is counted apart: its lone "Show Source" lines stay
        assert after["rows"][f"other.jsonl:o{n}"]["text"] == others[n]

    stats = after["stats"]
    assert stats["balanced"] and stats["read"]["documents"] == 43
    assert stats["read"]["documents"] == (
        stats["kept"]["documents"] + stats["removed"]["documents"] + stats["rejected"]["documents"]
    )
    assert stats["removed_by_reason"]["line_boilerplate/boilerplate_only"]["documents"] == 5
    numbers = stats["stages"]["line_boilerplate"]
    per_page = len(NAVIGATION) * 2 + len(FOOTER)
    assert numbers["lines_removed"] == 30 * per_page + 5 * (len(NAVIGATION) + len(FOOTER))
    assert numbers["documents_edited"] == 30 and numbers["documents_removed"] == 5
    assert numbers["frequent_lines"] == len(NAVIGATION) + len(FOOTER)
    # The report per source, through curate's summing of stage statistics: only docs.jsonl had boilerplate;
    # each of its 10 top lines is on all 35 of its pages, with the text the pages write.
    report = numbers["sources"]
    assert list(report) == ["source:docs.jsonl"]
    docs = report["source:docs.jsonl"]
    assert (docs["lines_removed"], docs["characters_removed"]) == (
        numbers["lines_removed"],
        numbers["characters_removed"],
    )
    assert docs["documents"] == docs["documents_counted"] == 35 and docs["documents_removed"] == 5
    assert len(docs["top_lines"]) == 10 and {line["documents"] for line in docs["top_lines"]} == {35}
    assert {line["text"] for line in docs["top_lines"]} <= set(NAVIGATION + FOOTER)


def test_a_sample_of_the_documents_finds_the_lines_and_every_document_is_edited():
    """sample_every=8 counts the lines of about 1 document in 8 (the shuffle's cap at scale); the
    navigation line, on every page, is still found and removed from all 400, and a line on 3% of the
    pages (below min_fraction) stays everywhere."""
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions
    from apache_beam.runners.portability.fn_api_runner import FnApiRunner
    from apache_beam.testing.util import assert_that, equal_to

    from tokenmill.pipelines.line_boilerplate import LineBoilerplate
    from tokenmill.pipelines.sinks import stable_hash

    documents = [
        {
            "id": f"site:{n}",
            "source": "site.jsonl",
            "text": "Home | Docs | Blog\n"
            + f"Page {n} says something of its own."
            + ("\nRare line" if n % 32 == 0 else ""),
        }
        for n in range(400)
    ]
    expected = [(d["id"], d["text"].split("\n", 1)[1]) for d in documents]
    options = PipelineOptions(["--direct_num_workers=1", "--direct_running_mode=in_memory"])
    with beam.Pipeline(runner=FnApiRunner(), options=options) as pipeline:
        result = (
            pipeline
            | beam.Create([None])
            | beam.FlatMap(lambda _: [dict(d) for d in documents])
            | LineBoilerplate(min_documents=5, min_fraction=0.1, sample_every=8)
        )
        assert_that(result["kept"] | beam.Map(lambda d: (d["id"], d["text"])), equal_to(expected))
        assert_that(result["removed"], equal_to([]), label="NothingRemoved")
        # Only the sampled documents' lines were counted: the ids whose stable hash is 0 mod 8.
        sampled = sum(1 for d in documents if stable_hash(d["id"]) % 8 == 0)
        assert 20 <= sampled <= 80
        counted = (
            result["stats"]
            | beam.Filter(lambda entry: "documents_counted" in entry[1])
            | beam.Map(lambda entry: entry[1]["documents_counted"])
        )
        assert_that(counted, equal_to([sampled]), label="Counted")
        with pytest.raises(ValueError, match="sample_every must be a positive integer"):
            LineBoilerplate(sample_every=0)


def test_the_stage_reports_per_source_what_it_removed_and_its_most_repeated_lines():
    """stats.json's `sources` entry: per source the documents and characters the stage saw, the lines and
    characters it removed (as strip_lines counts them), and its top lines by documents counted, each with
    its text as written, cut to line_chars; only the top_sources sources with most characters removed."""
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions
    from apache_beam.runners.portability.fn_api_runner import FnApiRunner
    from apache_beam.testing.util import assert_that

    from tokenmill.filters.base import sum_numbers
    from tokenmill.pipelines.line_boilerplate import LineBoilerplate

    hostile = "<script>window.__pwned=1</script> Menu " + "x" * 300
    documents = [
        {
            "id": f"site:{n}",
            "source": "site.jsonl",
            "text": "\n".join(
                ["Home | Docs | Blog", f"Page {n} says something of its own."]
                + (["  HOSTILE   " + hostile] if n < 30 else [])
                + (["Subscribe to our newsletter"] if n % 2 else [])
            ),
        }
        for n in range(40)
    ]
    documents += [
        {"id": f"small:{n}", "source": "small.jsonl", "text": f"Skip to content\nOwn text {n}."}
        for n in range(12)
    ]
    documents += [{"id": f"plain:{n}", "source": "plain.jsonl", "text": f"Only {n}."} for n in range(12)]
    expected_removed = {}
    for source, frequent in (
        ("site.jsonl", {line_hash(line) for line in ("Home | Docs | Blog", "HOSTILE " + hostile,
                                                     "Subscribe to our newsletter")}),
        ("small.jsonl", {line_hash("Skip to content")}),
    ):  # fmt: skip
        edits = [strip_lines(d["text"], frequent) for d in documents if d["source"] == source]
        expected_removed[f"source:{source}"] = (
            sum(e.lines_removed for e in edits),
            sum(e.characters_removed for e in edits),
        )

    def check(reports):
        merged = sum_numbers([numbers for _, numbers in reports])
        sources = merged["sources"]
        assert list(sources) == ["source:site.jsonl"]  # top_sources=1: the one with most removed
        site = sources["source:site.jsonl"]
        assert (site["lines_removed"], site["characters_removed"]) == expected_removed["source:site.jsonl"]
        assert site["documents"] == 40 and site["documents_counted"] == 40
        assert site["characters"] == sum(len(d["text"]) for d in documents if d["source"] == "site.jsonl")
        assert site["documents_edited"] == 40 and site["documents_removed"] == 0
        assert site["frequent_lines"] == 3
        assert site["top_lines"] == [
            {"text": "Home | Docs | Blog", "documents": 40},
            {"text": ("HOSTILE   " + hostile)[:64], "documents": 30},  # as written, stripped, cut
        ]
        assert merged["lines_removed"] == sum(removed for removed, _ in expected_removed.values())

    options = PipelineOptions(["--direct_num_workers=1", "--direct_running_mode=in_memory"])
    with beam.Pipeline(runner=FnApiRunner(), options=options) as pipeline:
        result = (
            pipeline
            | beam.Create([None])
            | beam.FlatMap(lambda _: [dict(d) for d in documents])
            | LineBoilerplate(min_documents=10, min_fraction=0.1, top_lines=2, top_sources=1, line_chars=64)
        )
        assert_that(result["stats"] | beam.combiners.ToList(), lambda lists: check(lists[0]))
    with pytest.raises(ValueError, match="top_lines must be an integer >= 0"):
        LineBoilerplate(top_lines=-1)
