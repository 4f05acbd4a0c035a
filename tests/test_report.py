"""Tests of `tokenmill report` on fixtures written from docs/formats.md (the browser tests are elsewhere)."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shutil
import time
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tokenmill.mixtures
from tokenmill.cli import main
from tokenmill.errors import FormatError
from tokenmill.formats.plan import plan_from_json, read_plan
from tokenmill.formats.runs import read_metrics
from tokenmill.formats.tokens import read_counts
from tokenmill.reports import svg
from tokenmill.reports.display import safe_href
from tokenmill.reports.inputs import sample_indices
from tokenmill.reports.overview import OverviewOptions
from tokenmill.reports.plans import cell_allocation, plan_changes
from tokenmill.reports.site import build_site
from tokenmill.samples.report_inputs import (
    HOSTILE_DOMAIN,
    HOSTILE_MARKUP,
    ReportInputs,
    make_report_inputs,
    report_args,
)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> ReportInputs:
    return make_report_inputs(tmp_path_factory.mktemp("report-inputs"))


@pytest.fixture(scope="module")
def site(inputs: ReportInputs, tmp_path_factory: pytest.TempPathFactory) -> Path:
    output = tmp_path_factory.mktemp("site")
    assert main(report_args(inputs, output)) == 0
    return output


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_site_has_pages_and_the_data_behind_them(site: Path, inputs: ReportInputs) -> None:
    files = tree(site)
    assert "index.html" in files and "run.html" in files
    # counts.json and every manifest are copied byte for byte, at the paths counts.json names.
    assert files["data/tokens/counts.json"] == (inputs.tokens / "counts.json").read_bytes()
    counts = json.loads(files["data/tokens/counts.json"])
    for cell, entry in counts["cells"].items():
        assert (
            files[f"data/tokens/{entry['manifest']}"] == (inputs.tokens / cell / "manifest.json").read_bytes()
        )
    assert files["data/curate/stats.json"] == (inputs.curate / "stats.json").read_bytes()
    assert json.loads(files["data/mixture/plan.json"]) == json.loads(inputs.plan.read_text())
    assert files["data/run/metrics.jsonl"] == (inputs.run / "metrics.jsonl").read_bytes()
    # SHA256SUMS checks out, as `cd data && sha256sum -c SHA256SUMS` would.
    sums = files["data/SHA256SUMS"].decode().splitlines()
    assert len(sums) == len([f for f in files if f.startswith("data/") and f != "data/SHA256SUMS"])
    for line in sums:
        digest, name = line.split("  ", 1)
        assert hashlib.sha256(files[f"data/{name}"]).hexdigest() == digest
    samples = [json.loads(line) for line in files["data/samples.jsonl"].decode().splitlines()]
    overview = json.loads(files["data/overview.json"])
    assert len(samples) == sum(len(c["samples"]) for c in overview["cells"].values())
    assert overview["headline"]["tokens"] == counts["total_tokens"]


def test_every_link_resolves(site: Path) -> None:
    for page in ("index.html", "run.html"):
        html = (site / page).read_text()
        ids = set(re.findall(r'\sid="([^"]+)"', html))
        for href in re.findall(r'href="([^"]+)"', html):
            href = href.replace("&amp;", "&")
            if href.startswith(("https://", "http://", "data:")):
                continue
            assert not href.startswith(("/", "javascript:")), href
            path, _, anchor = href.partition("#")
            if path:
                assert (site / path).is_file(), f"{page}: broken link {href}"
            if anchor and (not path or path == page):
                assert anchor in ids, f"{page}: no element with id {anchor}"


def test_headline_heatmap_and_cards(site: Path, inputs: ReportInputs) -> None:
    html = (site / "index.html").read_text()
    assert html.count('class="heat-cell"') == len(inputs.domains) * 5
    for cell in inputs.cells:
        assert f'data-cell="{cell}"' in html
    assert html.count('class="domain-card"') == len(inputs.domains)
    assert "log scale" in html or "tokens per cell" in html  # the heatmap's legend
    counts = json.loads((inputs.tokens / "counts.json").read_text())
    from tokenmill.units import format_count

    assert format_count(counts["total_tokens"]) in html
    assert "Phase 1: pretraining" in html and "Phase 2: midtraining" in html
    assert "Changes from the previous revision" in html
    assert "added" in html  # the fixture's previous plan lacks a source the current one has


class TagCollector(HTMLParser):
    """Every start tag with its attributes, as a browser's tokenizer would see them."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def table_rows(html: str, table_class: str) -> list[list[str]]:
    """The text of each body row's cells of the first <table class="table_class">."""
    table = html.split(f'<table class="{table_class}">', 1)[1].split("</table>", 1)[0]
    body = table.split("<tbody>", 1)[1]
    return [
        [re.sub(r"<[^>]+>", "", cell).strip() for cell in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]
        for row in re.findall(r"<tr[^>]*>(.*?)</tr>", body, re.S)
    ]


def test_contamination_per_evaluation_set(site: Path) -> None:
    from tokenmill.samples.report_inputs import DECONTAM_FLAGGED, DECONTAM_REMOVED

    html = (site / "index.html").read_text()
    rows = {row[0]: row[1:] for row in table_rows(html, "contamination")}
    assert list(rows) == ["gsm8k-test", "mmlu-test"]
    # Per benchmark: documents, their share of those checked, how they matched, how many were removed
    # (removed/ rows whose detail names the set) and flagged (kept, named in their metadata), examples.
    for name, cells in rows.items():
        removed = [kind for matches in DECONTAM_REMOVED for set_name, kind in matches if set_name == name]
        flagged = [kind for set_name, kind in DECONTAM_FLAGGED if set_name == name]
        kinds = removed + flagged
        assert cells[0] == str(len(kinds)) and cells[1].endswith("%")
        assert cells[2:5] == [str(kinds.count(kind)) for kind in ("verbatim", "edited", "partial")]
        assert cells[5:7] == [str(len(removed)), str(len(flagged))]
        assert cells[7] == str(len(kinds))  # every one of them drawn as an example (3 at most)
    # The examples are the paragraph that matched, the document's own text around it left out.
    section = html.split('<details class="contaminated" id="contamination-0">', 1)[1].split("</details>", 1)[
        0
    ]
    assert section.count('class="sample"') == 3
    assert "FLAGGED-DECONTAM" in section and "An opening paragraph." not in section
    assert "HOSTILE-DECONTAM 0" in section and "An unrelated opening" not in section
    assert section.count('badge bad">removed<') == 2 and section.count('badge warn">flagged<') == 1
    assert "&lt;script&gt;window.__pwned=1&lt;/script&gt; HOSTILE-DECONTAM" in section


def test_hostile_documents_are_text(site: Path) -> None:
    for page in ("index.html", "run.html"):
        html = (site / page).read_text()
        parser = TagCollector()
        parser.feed(html)
        tags = [tag for tag, _ in parser.tags]
        # One script element, the page's own, and the CSP admits only it, by hash.
        assert tags.count("script") == 1
        script = re.search(r"<script>(.*?)</script>", html, re.S).group(1)
        digest = "sha256-" + base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
        assert f"script-src '{digest}'" in html
        assert "img" not in tags and "textarea" not in tags and "style" in tags and tags.count("style") == 1
        for tag, attrs in parser.tags:
            assert not any(name.startswith("on") for name in attrs), (tag, attrs)
            href = (attrs.get("href") or "").strip().lower()
            assert not href.startswith(("javascript:", "data:text")), (tag, attrs)
        if page == "index.html":
            text = "".join(parser.text)
            # The documents are on the page, as text, every one of the small hostile cell's.
            for marker in (
                "HOSTILE-SCRIPT",
                "HOSTILE-TEXTAREA",
                "HOSTILE-IMG",
                "HOSTILE-REMOVED",
                "HOSTILE-REJECTED",
                "HOSTILE-LINE",  # a repeated line (line_boilerplate's report)
                "HOSTILE-LICENSE",  # a source's license
                "HOSTILE-DECONTAM",  # a decontam example
            ):
                assert marker in text
            for marker in ("HOSTILE-LINE", "HOSTILE-LICENSE", "HOSTILE-DECONTAM"):
                # The markup itself is on the page as text, right before the marker.
                assert re.search(re.escape(HOSTILE_MARKUP) + r"[^\n]{0,20}" + marker, text), marker
            assert "<script>window.__pwned" in text and "</textarea></pre></div>" in text
            assert "javascript:window.__pwned=1" in text  # shown, not linked
            # The layout survives: every card and every section is still there, in order.
            assert tags.count("article") == html.count('class="domain-card"')
            assert [a.get("id") for t, a in parser.tags if t == "section"] == [
                "summary",
                "heatmap",
                "domains",
                "curation",
                "mixture",
                "data",
            ]


def _stats(inputs: ReportInputs):
    from tokenmill.formats.stats import read_stats

    return read_stats(str(inputs.curate / "stats.json"))


def _folded(html: str, anchor: str) -> str:
    return html.split(f'id="{anchor}">', 1)[1].split("</details>", 1)[0]


def test_repeated_lines_per_source(site: Path, inputs: ReportInputs) -> None:
    """line_boilerplate's report in stats.json: per source what it removed, most characters first, and
    its most repeated lines with their documents (and share of the counted ones), as text."""
    stage = _stats(inputs).stages["line_boilerplate"]
    html = (site / "index.html").read_text()
    rows = table_rows(html, "boilerplate")
    ranked = sorted(stage["sources"].items(), key=lambda item: -item[1]["characters_removed"])
    assert [row[0] for row in rows] == [name for name, _ in ranked]
    for position, (row, (_, entry)) in enumerate(zip(rows, ranked, strict=True)):
        assert row[1:8] == [f"{entry[key]:,}" for key in ("documents", "characters_removed")] + [
            f"{100 * entry['characters_removed'] / entry['characters']:.1f}%"
        ] + [
            f"{entry[key]:,}"
            for key in ("lines_removed", "documents_edited", "documents_removed", "frequent_lines")
        ]
        assert row[8] == str(len(entry["top_lines"]))
        folded = _folded(html, f"boilerplate-{position}")
        lines = [cells for cells in (
            [re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", r, re.S)]
            for r in re.findall(r"<tr>(.*?)</tr>", folded.split("<tbody>", 1)[1], re.S)
        )]  # fmt: skip
        assert [int(cells[0].replace(",", "")) for cells in lines] == [
            line["documents"] for line in entry["top_lines"]
        ]
        for cells, line in zip(lines, entry["top_lines"], strict=True):
            assert cells[1] == f"{100 * line['documents'] / entry['documents_counted']:.1f}%"
            if line["text"] is None:
                assert "text not kept" in cells[2]
            else:
                assert cells[2] == line["text"].replace("&", "&amp;").replace("<", "&lt;").replace(
                    ">", "&gt;"
                )
    summary = html.split('<h3 id="boilerplate">', 1)[1].split("</p>", 1)[0]
    assert f"{stage['lines_removed']:,} lines and {stage['characters_removed']:,} characters" in summary


def test_duplicate_clusters_over_cells_and_per_source(site: Path, inputs: ReportInputs) -> None:
    """The distribution of dup_cluster_size over every curated file, per source, and the dedupe_clusters
    stage's numbers; counted here straight from the Parquet files."""
    import pyarrow.parquet as pq

    from tokenmill.formats.documents import cluster_size_bin

    by_source: dict[str, Counter] = {}
    for path in sorted((inputs.curate / "curated").rglob("*.parquet")):
        for row in pq.read_table(path, columns=["source", "dup_cluster_size"]).to_pylist():
            by_source.setdefault(row["source"], Counter())[row["dup_cluster_size"]] += 1
    overall = Counter()
    for sizes in by_source.values():
        overall.update(sizes)
    html = (site / "index.html").read_text()
    section = html.split('<h3 id="duplicates">', 1)[1].split("<h3", 1)[0]
    bins = Counter()
    for size, count in overall.items():
        bins[cluster_size_bin(size)] += count
    chart = section.split('<div class="chart-box">', 1)[1].split("</svg>", 1)[0]
    drawn = dict(re.findall(r"<title>size ([\d-]+): ([\d,]+) docs</title>", chart))
    assert {b: int(n.replace(",", "")) for b, n in drawn.items()} == dict(bins)
    kept, represented = sum(overall.values()), sum(size * n for size, n in overall.items())
    assert f"{kept:,} kept documents stand for {represented:,}" in section
    rows = {row[0]: row[1:] for row in table_rows(html, "duplicates")}
    assert set(rows) == {name.replace("<", "&lt;").replace(">", "&gt;") for name in by_source}
    for name, sizes in by_source.items():
        row = rows[name.replace("<", "&lt;").replace(">", "&gt;")]
        stood = sum(size * n for size, n in sizes.items())
        assert row[:3] == [f"{sum(sizes.values()):,}", f"{stood:,}", f"{stood - sum(sizes.values()):,}"]
        assert row[4] == f"{sum(n for size, n in sizes.items() if size > 1):,}"
    stage = _stats(inputs).stages["dedupe_clusters"]
    facts = dict(re.findall(r"<dt>([^<]+)</dt><dd[^>]*>([^<]+)</dd>", section))
    assert facts["largest cluster"] == f"{stage['largest_cluster']:,}"
    assert facts["kept documents with duplicates (clusters of 2 or more)"] == f"{stage['clusters']:,}"


def test_personal_data_per_kind_cell_and_source(site: Path, inputs: ReportInputs) -> None:
    """stages.pii per kind; per cell and per source the kept documents' `pii` column summed, and per
    source the documents removed as pii_density; counted here straight from the Parquet files."""
    import pyarrow.parquet as pq

    from tokenmill.formats.documents import PII_KINDS

    stage = _stats(inputs).stages["pii"]
    html = (site / "index.html").read_text()
    kinds = {row[0]: row[1:] for row in table_rows(html, "pii-kinds")}
    assert list(kinds) == list(PII_KINDS)
    for kind, cells in kinds.items():
        assert cells == [
            f"{stage.get(kind, {}).get(o, 0):,}" for o in ("masked", "flagged", "removed", "reserved")
        ]
    cells: dict[str, list[int]] = {}
    sources: dict[str, list[int]] = {}
    for cell in inputs.cells:
        for path in sorted((inputs.curate / "curated" / cell).glob("*.parquet")):
            for row in pq.read_table(path, columns=["source", "pii"]).to_pylist():
                finds = [row["pii"][kind] for kind in PII_KINDS]
                for key, table in ((cell, cells), (row["source"], sources)):
                    total = table.setdefault(key, [0] * (len(PII_KINDS) + 2))
                    total[0] += 1
                    total[1] += any(finds)
                    total[2:] = [a + b for a, b in zip(total[2:], finds, strict=True)]
    shown = {row[0]: row[1:] for row in table_rows(html, "pii-cells")}
    assert shown == {
        cell: [str(t[0]), str(t[1]), f"{100 * t[1] / t[0]:.1f}%", *map(str, t[2:])]
        for cell, t in cells.items()
        if t[1]
    }
    removed = Counter()
    for row in pq.read_table(inputs.curate / "removed" / "stage=pii").to_pylist():
        removed[row["source"]] += 1
    shown = {row[0]: row[1:] for row in table_rows(html, "pii-sources")}
    for source, t in sources.items():
        assert shown[source.replace("<", "&lt;").replace(">", "&gt;")][:6] == [str(t[1]), *map(str, t[2:])]
    for source, count in removed.items():
        assert shown[source][6] == str(count)
    overview = json.loads((site / "data" / "overview.json").read_text())
    for cell, t in cells.items():
        assert overview["cells"][cell]["pii"] == {
            **dict(zip(PII_KINDS, t[2:], strict=True)),
            "documents_checked": t[0],
            "documents_with_pii": t[1],
        }
    assert overview["sources"]["papers.jsonl"]["pii"]["documents_with_pii"] == sources["papers.jsonl"][1]


def test_sources_license_and_provenance(site: Path, inputs: ReportInputs) -> None:
    stats = _stats(inputs)
    html = (site / "index.html").read_text()
    rows = {row[0]: row[1:] for row in table_rows(html, "input-sources")}
    assert len(rows) == len(stats.sources)
    papers = rows["papers.jsonl"]
    assert papers[0] == stats.sources["papers.jsonl"].license and papers[2:6] == [
        str(getattr(stats.sources["papers.jsonl"], key)) for key in ("read", "kept", "removed", "rejected")
    ]
    assert papers[6] == "CC-BY-4.0 ×3 · MIT ×2 · (other) ×1"  # most documents first
    # An https provenance is a link; a javascript: one stays text; a license is text, whatever it holds.
    table = html.split('<table class="input-sources">', 1)[1].split("</table>", 1)[0]
    assert '<a href="https://crawl.example.org/2024" rel="nofollow noopener noreferrer">' in table
    assert "javascript:window.__pwned=1</td>" in table and 'href="javascript' not in table
    assert f"{HOSTILE_MARKUP}HOSTILE-LICENSE".replace("<", "&lt;").replace(">", "&gt;") in table


def test_same_inputs_give_identical_bytes(inputs: ReportInputs, site: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    assert main(report_args(inputs, again)) == 0
    assert tree(again) == tree(site)
    # Rebuilding over an earlier report gives the same tree too, and drops files no longer produced.
    assert main(report_args(inputs, again, run=False)) == 0
    assert not (again / "run.html").exists() and not (again / "data" / "run").exists()
    assert main(report_args(inputs, again)) == 0
    assert tree(again) == tree(site)


def test_seed_changes_the_samples(inputs: ReportInputs, tmp_path: Path) -> None:
    plan = read_plan(str(inputs.plan))
    ids = []
    for seed in (0, 1):
        result = build_site(
            curated=str(inputs.curate),
            tokens=str(inputs.tokens),
            plan=plan,
            output=str(tmp_path / f"seed{seed}"),
            options=OverviewOptions(samples_per_cell=2, seed=seed),
        )
        overview = json.loads((Path(result.output) / "data" / "overview.json").read_text())
        ids.append({cell: entry["samples"] for cell, entry in overview["cells"].items()})
    assert ids[0] != ids[1]
    assert all(len(samples) <= 2 for samples in ids[0].values())


def test_sample_indices_are_uniform_and_seeded() -> None:
    assert sample_indices(10, 20, 0, "x") == list(range(10))
    assert sample_indices(0, 5, 0, "x") == []
    picks = sample_indices(1000, 50, 3, "domain=web/quality=2")
    assert (
        picks == sorted(set(picks))
        and len(picks) == 50
        and picks == sample_indices(1000, 50, 3, "domain=web/quality=2")
    )
    assert picks != sample_indices(1000, 50, 4, "domain=web/quality=2")
    # Every row is equally likely: 4,000 draws of 5 out of 20 put each row near 1,000 times.
    hits = Counter(i for key in range(4000) for i in sample_indices(20, 5, 0, f"cell-{key}"))
    assert set(hits) == set(range(20))
    assert max(hits.values()) < 1150 and min(hits.values()) > 850


@pytest.mark.parametrize("samples", [0, 7, 40, 500])
def test_a_cell_scan_counts_every_row_and_samples_across_files_and_row_groups(
    tmp_path: Path, samples: int
) -> None:
    """Three files of uneven row groups (one file with no rows), null sources, sizes and pii: the
    counts equal a plain count of the rows, and the samples are the rows sample_indices picks, whether
    every row group, some or none of a file holds one (each file is read once or in two parts)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tokenmill.formats.documents import DOCUMENT_SCHEMA, PII_KINDS, cluster_size_bin
    from tokenmill.reports.inputs import SAMPLE_COLUMNS, scan_cell

    rows = []
    for n in range(230):
        pii = None if n % 3 == 0 else {kind: (n + k) % 4 // 3 for k, kind in enumerate(PII_KINDS)}
        rows.append(
            {
                "id": f"doc-{n}",
                "text": f"text {n} " * (n % 5 + 1),
                "source": None if n % 11 == 0 else f"source-{n % 4}",
                "url": f"https://example.org/{n}",
                "language": "en",
                "quality_score": n / 256,  # exact in float32
                "n_chars": n * 3,
                "dup_cluster_size": None if n % 7 == 0 else n % 13 + 1,
                "pii": pii,
            }
        )
    sizes = [(0, 0, 1), (0, 150, 16), (150, 150, 100), (150, 230, 9)]  # (first, end, row group size)
    files = []
    for number, (first, end, group) in enumerate(sizes):
        path = tmp_path / f"part-{number}.parquet"
        table = pa.Table.from_pylist(rows[first:end], schema=DOCUMENT_SCHEMA)
        pq.write_table(table, path, row_group_size=group)
        files.append(str(path))
    scan = scan_cell("domain=web/quality=2", files, samples=samples, seed=5)

    picked = sample_indices(len(rows), samples, 5, "domain=web/quality=2")
    assert scan.samples == [{c: rows[i].get(c) for c in SAMPLE_COLUMNS} for i in picked]
    assert scan.documents == len(rows) and scan.characters == sum(r["n_chars"] for r in rows)
    by_source = Counter(r["source"] or "(none)" for r in rows)
    assert {name: count.documents for name, count in scan.sources.items()} == by_source
    chars = Counter()
    for r in rows:
        chars[r["source"] or "(none)"] += r["n_chars"]
    assert {name: count.characters for name, count in scan.sources.items()} == chars
    bins = Counter(cluster_size_bin(r["dup_cluster_size"] or 1) for r in rows)
    assert scan.cluster_sizes == dict(bins) and list(scan.cluster_sizes) == sorted(
        bins, key=lambda b: int(b.split("-")[0])
    )
    assert scan.represented == sum(r["dup_cluster_size"] or 1 for r in rows)
    checked = [r for r in rows if r["pii"] is not None]
    assert scan.pii["documents_checked"] == len(checked)
    assert scan.pii["documents_with_pii"] == sum(1 for r in checked if any(r["pii"].values()))
    for kind in PII_KINDS:
        assert scan.pii[kind] == sum(r["pii"][kind] for r in checked)


def test_safe_href_keeps_only_web_links() -> None:
    assert safe_href("https://example.org/a?b=1") == "https://example.org/a?b=1"
    for bad in (
        "javascript:alert(1)",
        " JavaScript:alert(1)",
        "data:text/html,<b>",
        "//evil",
        "/x",
        "",
        None,
        "http:/x",
        "java\nscript:alert(1)",
    ):
        assert safe_href(bad) == ""


@given(
    st.text(alphabet="hHtTpPsS:/.-_@?#[]% aZ09\u00e9\uff0f\x01", max_size=30).map(
        lambda tail: tail if tail[:1] in "hH" else "http" + tail
    )
)
@settings(max_examples=2000, deadline=None)
def test_safe_href_agrees_with_urlsplit_on_every_url(url: str) -> None:
    """The fast path for plain web URLs gives what urlsplit's reading gives, on URLs made to sit at its
    edges (hosts with @, brackets, ports, non-ASCII slashes, spaces and control characters)."""
    from urllib.parse import urlsplit

    def by_urlsplit(value: str) -> str:
        if any(c in value for c in "\x00\n\r\t\\"):
            return ""
        try:
            parts = urlsplit(value.strip())
        except ValueError:
            return ""
        return value.strip() if parts.scheme.lower() in ("http", "https") and parts.netloc else ""

    assert safe_href(url) == by_urlsplit(url)


def test_plan_tools() -> None:
    document = {
        "name": "a",
        "tokenizer": "t",
        "total_tokens": 100,
        "sequence_length": 5,
        "batch_size": 2,
        "block_size": 2,
        "tokens_per_step": 10,
        "phases": [
            {
                "name": "p",
                "tokens": 100,
                "steps": 10,
                "start_step": 0,
                "end_step": 10,
                "sources": [
                    {
                        "name": "s",
                        "cells": ["domain=a/quality=1", "domain=a/quality=2"],
                        "weight": 1.0,
                        "tokens": 100,
                        "tokens_available": 200,
                        "epochs": 0.5,
                    }
                ],
            },
        ],
    }
    plan = plan_from_json(document)
    allocation = cell_allocation(plan, {"domain=a/quality=1": 150, "domain=a/quality=2": 50})
    assert allocation["domain=a/quality=1"]["p"]["tokens"] == pytest.approx(75)
    assert allocation["domain=a/quality=2"]["p"]["weight"] == pytest.approx(0.25)
    assert allocation["domain=a/quality=2"]["p"]["epochs"] == pytest.approx(0.5)
    changed = json.loads(json.dumps(document))
    changed["phases"][0]["sources"][0]["weight"] = 0.5
    changed["phases"][0]["sources"].append({**changed["phases"][0]["sources"][0], "name": "t"})
    changed["phases"].append({**changed["phases"][0], "name": "q", "sources": []})
    diff = plan_changes(plan, plan_from_json(changed))
    assert diff["changed"]
    assert [(p["name"], p["status"]) for p in diff["phases"]] == [("p", "changed"), ("q", "added")]
    assert [(s["name"], s["status"]) for s in diff["phases"][0]["sources"]] == [
        ("s", "changed"),
        ("t", "added"),
    ]
    assert diff["phases"][0]["sources"][0]["fields"] == [{"field": "weight", "old": 1.0, "new": 0.5}]
    assert not plan_changes(plan, plan)["changed"]
    with pytest.raises(FormatError, match="x.json: .*phases\\[0\\] has no 'tokens'"):
        plan_from_json({**document, "phases": [{"name": "p"}]}, "x.json")


def test_line_chart_is_deterministic_and_robust() -> None:
    points = [(float(i), 1.0 / (i + 1)) for i in range(5000)]
    points[100] = (100.0, None)
    chart = svg.line_chart(
        [
            svg.Series("loss <b>", points),
            svg.Series("forecast", [(10.0, 0.5), (1e4, 0.01)], dashed=True, markers=True),
        ],
        title="a & b",
        x=svg.Axis("step", log=True),
        y=svg.Axis("loss", log=True),
        vlines=[svg.VLine(1000, "phase <2>")],
    )
    assert chart == svg.line_chart(
        [
            svg.Series("loss <b>", points),
            svg.Series("forecast", [(10.0, 0.5), (1e4, 0.01)], dashed=True, markers=True),
        ],
        title="a & b",
        x=svg.Axis("step", log=True),
        y=svg.Axis("loss", log=True),
        vlines=[svg.VLine(1000, "phase <2>")],
    )
    assert "<b>" not in chart and "loss &lt;b&gt;" in chart and "a &amp; b" in chart
    assert "stroke-dasharray" in chart and "<circle" in chart
    assert "nan" not in chart.lower() and "inf" not in chart.lower()
    assert "no data" in svg.line_chart([svg.Series("x", [])], title="empty")
    kept = svg.decimate([(float(i), float(i % 97 == 0) * 5) for i in range(10000)], 200)
    assert len(kept) <= 202 and max(p[1] for p in kept) == 5


def test_run_page(site: Path) -> None:
    html = (site / "run.html").read_text()
    for title in (
        "Training loss",
        "Learning rate",
        "Throughput",
        "Expert load imbalance",
        "Dropped assignments",
    ):
        assert f'data-chart="{title}"' in html
    assert "config.json" in html and "model.experts" in html
    assert html.count('class="vline"') >= 5  # the phase boundary on each curve


def test_run_page_of_a_dense_run_without_router_metrics(inputs: ReportInputs, tmp_path: Path) -> None:
    run = tmp_path / "runs" / "dense"
    run.mkdir(parents=True)
    run.joinpath("metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 5.0 - s / 100, "lr": 1e-3}) + "\n" for s in range(0, 200, 10))
    )
    assert main(report_args(inputs, tmp_path / "site", "--run", str(run), run=False)) == 0
    html = (tmp_path / "site" / "run.html").read_text()
    assert "no data" in html and "Training loss" in html and "no config.json" in html


def test_metrics_errors_name_the_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "loss": 1.0}\nnot json\n')
    with pytest.raises(FormatError, match="line 2"):
        read_metrics(str(path))


def test_usage_errors(inputs: ReportInputs, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def fails(args: list[str], message: str) -> None:
        assert main(args) == 2
        assert message in capsys.readouterr().err

    out = tmp_path / "out"
    fails(report_args(inputs, out) + ["--curated", str(tmp_path / "nope")], "no such folder")
    fails(report_args(inputs, out) + ["--curated", str(inputs.tokens)], "no curated output here")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    fails(report_args(inputs, out) + ["--plan", str(bad)], "not valid JSON")
    bad.write_text('{"phases": []}')
    fails(report_args(inputs, out) + ["--plan", str(bad)], "phases: empty")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    fails(report_args(inputs, foreign), "not empty")
    assert (foreign / "notes.txt").read_text() == "mine"
    fails(report_args(inputs, out, "--run", str(tmp_path)), "no metrics.jsonl")
    with pytest.raises(SystemExit):
        main(report_args(inputs, out) + ["--mixture", "m.yaml"])  # --plan and --mixture together


def test_mixture_is_planned_lazily(
    inputs: ReportInputs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "mix.yaml"
    spec.write_text("name: fixture-mix\n")
    args = [
        "report",
        "--curated",
        str(inputs.curate),
        "--tokens",
        str(inputs.tokens),
        "--mixture",
        str(spec),
        "--output",
        str(tmp_path / "site"),
    ]
    seen = {}

    def plan_mixture(mixture: object, counts: object) -> object:
        seen["counts"] = counts
        return read_plan(str(inputs.plan))

    monkeypatch.setattr(tokenmill.mixtures, "load_mixture", lambda path: path, raising=False)
    monkeypatch.setattr(tokenmill.mixtures, "plan_mixture", plan_mixture, raising=False)
    assert main(args) == 0
    assert seen["counts"] == read_counts(str(inputs.tokens / "counts.json"))
    assert "fixture-mix" in (tmp_path / "site" / "index.html").read_text()


FIXTURE_MIXTURE = """
name: fixture-yaml
tokenizer: tokenmill-bpe-8k
total_tokens: 60K
sequence_length: 128
batch_size: 4
block_size: 8
max_epochs: 100
phases:
  - name: pretraining
    share: 0.8
    weights: {domain=web/*: 0.5, domain=code/*: 0.3, domain=math/*: 0.2}
  - name: midtraining
    share: 0.2
    weights: {domain=science/*: 0.5, domain=web/quality>=3: 0.5}
"""


def test_mixture_with_the_real_planner(inputs: ReportInputs, tmp_path: Path) -> None:
    """End to end through tokenmill.mixtures' planner."""
    spec = tmp_path / "fixture.yaml"
    spec.write_text(FIXTURE_MIXTURE)
    previous = tmp_path / "previous.yaml"
    previous.write_text(
        FIXTURE_MIXTURE.replace("share: 0.8", "share: 0.9").replace("share: 0.2", "share: 0.1")
    )
    output = tmp_path / "site"
    args = ["report", "--curated", str(inputs.curate), "--tokens", str(inputs.tokens), "--mixture", str(spec)]
    assert main([*args, "--previous-mixture", str(previous), "--output", str(output)]) == 0
    html = (output / "index.html").read_text()
    assert "Mixture: fixture-yaml" in html and "Phase 2: midtraining" in html
    assert "Changes from the previous revision" in html
    plan = json.loads((output / "data" / "mixture" / "plan.json").read_text())
    assert [p["name"] for p in plan["phases"]] == ["pretraining", "midtraining"]


def test_without_stats_removed_or_rejected(inputs: ReportInputs, tmp_path: Path) -> None:
    curate = tmp_path / "curate"
    shutil.copytree(inputs.curate / "curated", curate / "curated")
    result = build_site(
        curated=str(curate / "curated"),  # the curated/ folder itself is accepted too
        tokens=str(inputs.tokens),
        plan=read_plan(str(inputs.plan)),
        output=str(tmp_path / "site"),
    )
    html = (Path(result.output) / "index.html").read_text()
    assert "No stats.json" in html and "Nothing was removed" in html and "No input was rejected" in html
    assert not (Path(result.output) / "data" / "curate").exists()


def test_hostile_cell_is_in_the_fixture(inputs: ReportInputs) -> None:
    assert HOSTILE_DOMAIN in inputs.domains


@pytest.mark.slow
def test_scale_200_cells_10000_samples(tmp_path: Path) -> None:
    """docs/reports.md's size budget: 200 cells, 10,000 samples, index.html under 12 MB, built in 60 s."""
    inputs = make_report_inputs(
        tmp_path / "in", domains=40, docs_per_cell=100, hostile=False, missing_cells=False
    )
    start = time.perf_counter()
    result = build_site(
        curated=str(inputs.curate),
        tokens=str(inputs.tokens),
        plan=read_plan(str(inputs.plan)),
        output=str(tmp_path / "site"),
        options=OverviewOptions(samples_per_cell=50),
    )
    elapsed = time.perf_counter() - start
    overview = json.loads((tmp_path / "site" / "data" / "overview.json").read_text())
    assert len(overview["cells"]) == 200
    assert sum(len(c["samples"]) for c in overview["cells"].values()) == 10_000
    assert result.index_bytes < 12_000_000
    assert elapsed < 60


def _topic_model(folder: Path, ids: list[str]) -> None:
    """A topic-domain model card (tokenmill.formats.domains) naming `ids`, with a hostile example."""
    from tokenmill.formats.domains import (
        DomainEmbedding,
        DomainEntry,
        DomainExample,
        DomainSample,
        DomainsCard,
        FineClusters,
        write_domains_card,
    )

    entries = [
        DomainEntry(
            id=domain_id,
            name=f"term{index}a term{index}b",
            terms=[f"term{index}a", f"term{index}b", f"term{index}c"],
            documents=100 - 10 * index,
            share=round((100 - 10 * index) / 340, 6),
            fine_clusters=3,
            cohesion=0.8,
            examples=[
                DomainExample(
                    id=f"x:{domain_id}", source="x.jsonl", cosine=0.9, preview="<script>boom()</script>"
                )
            ],
        )
        for index, domain_id in enumerate(ids)
    ]
    card = DomainsCard(
        format_version=1,
        kind="domains",
        sample=DomainSample(
            inputs=["x"],
            documents_read=340,
            rejected=0,
            empty=0,
            requested=1000,
            documents=340,
            seed=0,
            method="bottom-S",
        ),
        embedding=DomainEmbedding(
            kind="trained", path="embedding.bin", sha256="0" * 64, dim=8, max_chars=100, parameters={}
        ),
        fine=FineClusters(k=12, iterations=3, converged=True, cohesion=0.9),
        domains_requested=len(ids),
        min_share=0.01,
        within_domain_cosine=0.8,
        between_domain_cosine=0.1,
        domains=entries,
        clusters_sha256="0" * 64,
    )
    write_domains_card(str(folder / "model.json"), card)


def test_topic_domains_terms_enrichment_examples_and_quality_cuts(tmp_path: Path) -> None:
    from tokenmill.formats.cards import Calibration, write_calibration

    inputs = make_report_inputs(tmp_path / "inputs", names=["c00", "c01", "c02"], hostile=False)
    _topic_model(tmp_path / "domains", ["c00", "c01", "c02", "c03"])
    (tmp_path / "quality").mkdir()
    write_calibration(
        str(tmp_path / "quality" / "calibration.json"),
        Calibration(
            positive_label="hq",
            quantiles=[0.2, 0.4, 0.6, 0.8],
            cuts={"*": [0.1, 0.3, 0.5, 0.7], "code": [0.2, 0.4, 0.6, 0.8], "legal": [0.05, 0.1, 0.2, 0.9]},
            documents={"code": 40, "legal": 30},
        ),
    )
    output = tmp_path / "site"
    args = ["--domains-model", str(tmp_path / "domains"), "--quality-model", str(tmp_path / "quality")]
    assert main(report_args(inputs, output, *args)) == 0
    html = (output / "index.html").read_text()
    overview = json.loads((output / "data" / "overview.json").read_text())
    domains = overview["domains"]
    assert sorted(domains) == ["c00", "c01", "c02"]
    for index, name in enumerate(["c00", "c01", "c02"]):
        assert domains[name]["terms"] == [f"term{index}a", f"term{index}b", f"term{index}c"]
        assert f'<span class="term">term{index}b</span>' in html
        # The Q0-Q4 split covers every bucket and adds up to the domain's tokens.
        split = domains[name]["quality_split"]
        assert (
            list(split) == ["q0", "q1", "q2", "q3", "q4"] and sum(split.values()) == domains[name]["tokens"]
        )
    # c03 is in the model but has no curated documents: the page says so rather than drawing an empty card.
    assert "Not on this page (no curated documents): c03" in html
    # Enrichment: a source's share of the domain over its share of all tokens, recomputed here.
    total = sum(d["tokens"] for d in domains.values())
    overall: Counter[str] = Counter()
    for domain in domains.values():
        for source, entry in domain["sources"].items():
            overall[source] += entry["tokens_estimated"]
    checked = 0
    for domain in domains.values():
        for source, entry in domain["sources"].items():
            expected = (entry["tokens_estimated"] / domain["tokens"]) / (overall[source] / total)
            assert entry["enrichment"] == pytest.approx(expected, rel=2e-3, abs=2e-3)
            assert f"{entry['enrichment']:.2f}×" in html
            checked += 1
    assert checked >= 3
    # The examples nearest each domain's centre are shown as text, never as markup.
    assert html.count('class="samples topic-examples"') == 3
    assert "&lt;script&gt;boom()&lt;/script&gt;" in html and "<script>boom()" not in html
    # Quality cut points per content type, `*` last.
    assert re.findall(r'data-content-type="([^"]+)"', html) == ["code", "legal", "*"]
    assert "0.050 · 0.100 · 0.200 · 0.900" in html
    assert overview["quality_cuts"]["code"] == [0.2, 0.4, 0.6, 0.8]
    assert overview["topic_model"]["k"] == 12


def test_without_topic_model_or_calibration_the_rows_are_left_out(
    inputs: ReportInputs, tmp_path: Path
) -> None:
    (tmp_path / "quality").mkdir()  # a quality model folder without calibration.json
    assert main(report_args(inputs, tmp_path / "site", "--quality-model", str(tmp_path / "quality"))) == 0
    html = (tmp_path / "site" / "index.html").read_text()
    assert 'id="quality-cuts"' not in html and 'id="topic-model"' not in html
    assert 'class="qsplit"' in html and "enrichment" in html  # every card still has its split and enrichment
    overview = json.loads((tmp_path / "site" / "data" / "overview.json").read_text())
    assert "quality_cuts" not in overview and "topic_model" not in overview


def test_a_missing_topic_model_is_a_usage_error(inputs: ReportInputs, tmp_path: Path, capsys) -> None:
    args = report_args(inputs, tmp_path / "site", "--domains-model", str(tmp_path / "nope"))
    assert main(args) == 2
    assert "no topic-domain model card (model.json) here" in capsys.readouterr().err


def test_long_runs_are_charted_from_evenly_spaced_rows_keeping_boundaries_and_the_last_row() -> None:
    from tokenmill.reports.runpage import chart_rows

    rows = [{"step": i, "phase": "pretraining" if i < 300_001 else "midtraining"} for i in range(390_251)]
    drawn = chart_rows(rows, limit=2000)
    steps = [row["step"] for row in drawn]
    assert len(drawn) <= 2002
    assert steps == sorted(steps) and steps[0] == 0 and steps[-1] == 390_250
    assert 300_001 in steps  # the first midtraining row: the phase line is drawn where it is
    gaps = {b - a for a, b in zip(steps, steps[1:])}
    assert max(gaps) <= 196  # evenly spaced: no hole wider than one stride
    assert chart_rows(rows[:50], limit=2000) == rows[:50]


def _figures(html: str) -> dict[str, tuple[dict[str, str], str]]:
    """Each chart figure's attributes and its SVG, by title."""
    found = {}
    for match in re.finditer(r"<figure ([^>]*)>(.*?)</figure>", html, re.S):
        attrs = dict(re.findall(r'data-([a-z]+)="([^"]*)"', match.group(1)))
        found[attrs["chart"]] = (attrs, match.group(2))
    return found


def _curves(chart: str) -> list[str]:
    """The names of the lines a chart draws (each path carries its series' name)."""
    import html as html_module

    return [html_module.unescape(name) for name in re.findall(r"<path [^>]*><title>([^<]*)</title>", chart)]


def test_run_page_charts_every_evaluation_set(site: Path, inputs: ReportInputs) -> None:
    from tokenmill.formats.evals import read_eval, series

    records = read_eval(str(inputs.run / "eval.jsonl"))
    heldout = sorted({r.set for r in records if r.kind == "heldout"})
    external = sorted({r.set for r in records if r.kind == "external"})
    assert heldout == [f"heldout/domain={d}" for d in sorted(inputs.domains)] and external
    html = (site / "run.html").read_text()
    assert (site / "data/run/eval.jsonl").read_bytes() == (inputs.run / "eval.jsonl").read_bytes()
    assert 'href="data/run/eval.jsonl"' in html
    figures = _figures(html)
    for measure in ("bits_per_byte", "loss"):
        for axis in ("step", "tokens"):
            drawn = [
                (attrs, chart)
                for attrs, chart in figures.values()
                if attrs.get("measure") == measure and attrs.get("axis") == axis
            ]
            by_kind = {attrs["kind"]: chart for attrs, chart in drawn}
            # One curve per domain's held-out slice and the held-out macro; external sets with the macro.
            assert _curves(by_kind["heldout"]) == [*heldout, "held-out macro"]
            assert _curves(by_kind["external"]) == [*external, f"macro over all {len(heldout) + 1} sets"]
            # The phase boundary is marked on every evaluation chart, against steps and tokens alike.
            assert by_kind["heldout"].count('class="vline"') == 1
    # Capacity against dropless, both averages.
    capacity = figures["Dropless and capacity bits per byte"][1]
    assert _curves(capacity) == [
        "heldout_macro dropless",
        "heldout_macro capacity",
        "macro dropless",
        "macro capacity",
    ]
    # The table holds the last point's values, as eval.jsonl has them.
    last = max(r.step for r in records)
    for name in [*heldout, *external, "heldout_macro", "macro", "micro"]:
        value = series(records, name, "bits_per_byte")[-1]
        assert value[0] == last
        row = re.search(rf'<tr data-set="{re.escape(name)}">(.*?)</tr>', html, re.S)
        assert row and f"{value[2]:.4f}" in row.group(1)
    assert "last held-out macro" in html


def test_run_page_eval_records_follow_a_run_being_written(inputs: ReportInputs, tmp_path: Path) -> None:
    from tokenmill.reports.inputs import InputError
    from tokenmill.reports.runpage import build_run

    run = tmp_path / "run"
    shutil.copytree(inputs.run, run)
    whole = (run / "eval.jsonl").read_bytes()
    # A trainer appending the next evaluation point: its unfinished line waits for the next version.
    (run / "eval.jsonl").write_bytes(whole + b'{"step": 999, "set": "heldout/dom')
    page = build_run(str(run))
    files = {name: payload for name, payload, _ in page["files"]}
    assert files["data/run/eval.jsonl"] == whole
    assert page["evaluation"]["last_step"] == max(json.loads(line)["step"] for line in whole.splitlines())
    # A bad whole line is an error naming the file and line.
    lines = whole.splitlines(keepends=True)
    (run / "eval.jsonl").write_bytes(b"".join(lines[:3]) + b'{"step": 1}\n')
    with pytest.raises(InputError, match=r"eval\.jsonl: line 4"):
        build_run(str(run))
    # Without eval.jsonl the page says so and copies nothing.
    (run / "eval.jsonl").unlink()
    page = build_run(str(run))
    assert page["evaluation"] is None
    assert not any(name.endswith("eval.jsonl") for name, _, _ in page["files"])
