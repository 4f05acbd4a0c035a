"""The report pages in a real browser: headless Debian Chromium, driven by selenium, opening files from disk.

Checks what only a browser can: no console errors (a Content-Security-Policy violation is one), one
heatmap cell per (domain, quality), the search box filters, a document holding `<script>` runs nothing,
and the layout survives hostile text. Screenshots go to test-artifacts/.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenmill.cli import main
from tokenmill.reports.browser import headless_chromium, missing_browser
from tokenmill.samples.report_inputs import ReportInputs, make_report_inputs, report_args

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> ReportInputs:
    return make_report_inputs(tmp_path_factory.mktemp("browser-inputs"))


@pytest.fixture(scope="module")
def site(inputs: ReportInputs, tmp_path_factory: pytest.TempPathFactory) -> Path:
    output = tmp_path_factory.mktemp("browser-site")
    assert main(report_args(inputs, output)) == 0
    return output


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    missing = missing_browser()
    if missing:
        pytest.fail(
            f"{', '.join(missing)} not found: run `make browser` (Debian's chromium and chromium-driver)"
        )
    with headless_chromium("tokenmill-chromium-") as driver:
        yield driver


def console_errors(driver) -> list[dict]:
    return [entry for entry in driver.get_log("browser") if entry.get("level") in ("SEVERE", "ERROR")]


def open_page(driver, path: Path) -> None:
    # Through a blank page, so that no state of an earlier test (unfolded details, a search) carries over.
    driver.get("about:blank")
    driver.get(path.as_uri())
    driver.execute_script("return document.readyState")


def screenshot(driver, name: str) -> Path:
    """A full-page screenshot: grow the window to the page's height, then shrink it back."""
    ARTIFACTS.mkdir(exist_ok=True)
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1280, min(int(height) + 40, 12000))
    path = ARTIFACTS / name
    driver.save_screenshot(str(path))
    driver.set_window_size(1280, 1000)
    return path


def visible(driver, selector: str) -> list[str]:
    return driver.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0]))"
        ".filter(e => e.offsetParent !== null || e.getClientRects().length > 0)"
        ".map(e => e.getAttribute('data-domain') || e.textContent);",
        selector,
    )


def search(driver, text: str) -> str:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    box = driver.find_element(By.ID, "search")
    box.clear()
    if text:
        box.send_keys(text)
    else:
        driver.execute_script("arguments[0].dispatchEvent(new Event('input'))", box)
    status = driver.find_element(By.ID, "search-status")
    WebDriverWait(driver, 5).until(lambda d: status.get_attribute("data-query") == text.strip().lower())
    return status.text


def test_index_opens_from_disk_without_errors(browser, site: Path, inputs: ReportInputs) -> None:
    open_page(browser, site / "index.html")
    assert browser.title == "Data overview"
    # Open every fold, so that all samples (the hostile ones among them) are rendered.
    browser.execute_script("document.querySelectorAll('details').forEach(d => d.open = true)")
    shot = screenshot(browser, "report-index.png")
    assert shot.stat().st_size > 10_000
    assert console_errors(browser) == []
    cells = browser.execute_script(
        "return Array.from(document.querySelectorAll('.heat-cell'))"
        ".map(e => e.getAttribute('data-row') + '/' + e.getAttribute('data-column'))"
    )
    assert len(cells) == len(set(cells)) == len(inputs.domains) * 5
    assert set(cells) == {f"{d}/q{q}" for d in inputs.domains for q in range(5)}
    # Clicking a heatmap cell lands on that cell's samples, unfolded.
    browser.execute_script("document.querySelectorAll('details').forEach(d => d.open = false)")
    browser.execute_script("location.hash = '#cell-math-q3'")
    assert browser.execute_script("return document.getElementById('cell-math-q3').open") is True


def test_hostile_samples_run_nothing_and_break_no_layout(browser, site: Path, inputs: ReportInputs) -> None:
    open_page(browser, site / "index.html")
    browser.execute_script("document.querySelectorAll('details').forEach(d => d.open = true)")
    assert browser.execute_script("return typeof window.__pwned") == "undefined"
    assert browser.title == "Data overview"
    texts = browser.execute_script(
        "return Array.from(document.querySelectorAll('#domain-web .sample-text')).map(e => e.textContent)"
    )
    assert any("<script>window.__pwned" in t for t in texts)
    assert any("</textarea></pre></div>" in t for t in texts)
    # The javascript: URL is text, not a link.
    assert (
        browser.execute_script(
            "return Array.from(document.links).filter(a => a.protocol === 'javascript:').length"
        )
        == 0
    )
    # Structure intact: every card, every section, the footer after them; the body is displayed.
    assert browser.execute_script("return document.querySelectorAll('article.domain-card').length") == len(
        inputs.domains
    )
    assert browser.execute_script(
        "return Array.from(document.querySelectorAll('main > section')).map(s => s.id)"
    ) == [
        "summary",
        "heatmap",
        "domains",
        "curation",
        "mixture",
        "data",
    ]
    assert browser.execute_script("return getComputedStyle(document.body).display") == "block"
    assert browser.execute_script("return document.querySelector('body > footer') !== null")
    # A sample does not stretch the page sideways.
    assert browser.execute_script("return document.documentElement.scrollWidth") <= 1280
    assert console_errors(browser) == []


def test_curation_sections_show_their_records_as_text(browser, site: Path, inputs: ReportInputs) -> None:
    """Repeated lines, duplicate clusters, contamination examples, personal data and the sources' licenses:
    laid out, their hostile strings shown as text (nothing ran), and nothing wider than the window."""
    from tokenmill.samples.report_inputs import HOSTILE_MARKUP

    open_page(browser, site / "index.html")
    browser.execute_script("document.querySelectorAll('details').forEach(d => d.open = true)")
    browser.execute_script("document.getElementById('curation').scrollIntoView()")
    assert browser.execute_script("return typeof window.__pwned") == "undefined"

    def texts(selector: str) -> list[str]:
        return browser.execute_script(
            "return Array.from(document.querySelectorAll(arguments[0])).map(e => e.textContent)", selector
        )

    assert f"{HOSTILE_MARKUP} Accept cookies HOSTILE-LINE" in texts("details.repeated-lines td.line-text")
    assert f"{HOSTILE_MARKUP}HOSTILE-LICENSE" in texts("table.input-sources td.license")
    examples = texts("details.contaminated .sample-text")
    assert any(text.startswith(f"{HOSTILE_MARKUP} HOSTILE-DECONTAM") for text in examples)
    # A javascript: provenance is text, an https one a link.
    assert "javascript:window.__pwned=1" in texts("table.input-sources td.provenance")
    assert browser.execute_script(
        "return Array.from(document.querySelectorAll('table.input-sources a')).map(a => a.protocol)"
    ) == ["https:"]
    # Every new part is laid out: the cluster-size chart has a size, the tables have visible rows.
    box = browser.execute_script(
        "const r = document.querySelector('#duplicates ~ .chart-box svg').getBoundingClientRect();"
        "return [r.width, r.height]"
    )
    assert box[0] > 300 and box[1] > 40
    for table in (
        "boilerplate",
        "duplicates",
        "contamination",
        "pii-kinds",
        "pii-cells",
        "pii-sources",
        "input-sources",
    ):
        rows = browser.execute_script(
            "return Array.from(document.querySelectorAll(`table.${arguments[0]} tbody tr`))"
            ".filter(r => r.getBoundingClientRect().height > 0).length",
            table,
        )
        assert rows > 0, table
    # Its links land on the parts.
    for anchor in browser.execute_script(
        "return Array.from(document.querySelectorAll('#curation-parts a')).map(a => a.hash.slice(1))"
    ):
        assert browser.execute_script("return document.getElementById(arguments[0]) !== null", anchor), anchor
    assert browser.execute_script("return document.documentElement.scrollWidth") <= 1280
    element = browser.find_element("id", "curation")
    ARTIFACTS.mkdir(exist_ok=True)
    element.screenshot(str(ARTIFACTS / "report-index-curation.png"))
    assert console_errors(browser) == []


def test_search_filters_domains_and_samples(browser, site: Path, inputs: ReportInputs) -> None:
    open_page(browser, site / "index.html")
    everything = len(visible(browser, ".domain-card"))
    assert everything == len(inputs.domains)

    status = search(browser, "math")
    assert visible(browser, ".domain-card") == ["math"]
    assert status.startswith("1 of ")
    dimmed = browser.execute_script(
        "return Array.from(document.querySelectorAll('.heat-row.dim')).map(r => r.getAttribute('data-row'))"
    )
    assert sorted(dimmed) == sorted(d for d in inputs.domains if d != "math")

    # A word from one document's text: that document alone, its fold opened.
    search(browser, "hostile-textarea")
    assert visible(browser, ".domain-card") == ["web"]
    shown = visible(browser, ".domain-card .sample")
    assert len(shown) == 1 and "HOSTILE-TEXTAREA" in shown[0]

    search(browser, "no-such-text-anywhere")
    assert visible(browser, ".domain-card") == []

    status = search(browser, "")
    assert len(visible(browser, ".domain-card")) == everything
    assert "match" not in status
    assert browser.execute_script("return document.querySelectorAll('details.samples[open]').length") == 0
    screenshot(browser, "report-index-top.png")
    assert console_errors(browser) == []


def test_run_page(browser, site: Path) -> None:
    open_page(browser, site / "run.html")
    charts = browser.execute_script(
        "return Array.from(document.querySelectorAll('figure.run-chart')).map(f => f.dataset.chart)"
    )
    for title in (
        "Training loss",
        "Learning rate",
        "Throughput",
        "Expert load imbalance",
        "Dropped assignments",
    ):
        assert title in charts
    # Every chart drew a line.
    assert (
        browser.execute_script(
            "return Array.from(document.querySelectorAll('figure.run-chart'))"
            ".filter(f => !f.querySelector('path')).length"
        )
        == 0
    )
    screenshot(browser, "report-run.png")
    assert console_errors(browser) == []


def test_topic_domain_view(browser, tmp_path_factory: pytest.TempPathFactory) -> None:
    from test_report import _topic_model

    root = tmp_path_factory.mktemp("browser-topics")
    inputs = make_report_inputs(root / "inputs", names=["c00", "c01", "c02"], hostile=False)
    (root / "domains").mkdir()
    _topic_model(root / "domains", ["c00", "c01", "c02"])
    assert main(report_args(inputs, root / "site", "--domains-model", str(root / "domains"), run=False)) == 0
    open_page(browser, root / "site" / "index.html")
    browser.execute_script("document.querySelectorAll('details').forEach(d => d.open = true)")
    # The terms show on each card, the example that holds <script> is text, and nothing ran.
    terms = browser.execute_script(
        "return Array.from(document.querySelectorAll('#domain-c01 .term')).map(e => e.textContent)"
    )
    assert terms == ["term1a", "term1b", "term1c"]
    examples = browser.execute_script(
        "return Array.from(document.querySelectorAll('.topic-examples .sample-text')).map(e => e.textContent)"
    )
    assert examples == ["<script>boom()</script>"] * 3
    assert browser.execute_script("return document.querySelectorAll('.qsplit').length") == 3
    screenshot(browser, "report-topic-domains.png")
    # A domain is found by one of its terms.
    search(browser, "term2c")
    assert visible(browser, ".domain-card") == ["c02"]
    search(browser, "")
    assert console_errors(browser) == []


def test_run_page_draws_one_curve_per_domain_held_out_set_and_the_macro(
    browser, site: Path, inputs: ReportInputs
) -> None:
    from tokenmill.formats.evals import read_eval

    records = read_eval(str(inputs.run / "eval.jsonl"))
    heldout = sorted({r.set for r in records if r.kind == "heldout"})
    assert heldout == [f"heldout/domain={d}" for d in sorted(inputs.domains)]
    open_page(browser, site / "run.html")
    browser.execute_script("document.getElementById('evaluation').scrollIntoView()")
    # Per chart: the curves the browser laid out (a drawn path with a non-empty box) and their names.
    charts = browser.execute_script(
        "return Array.from(document.querySelectorAll('figure.eval-chart')).map(f => ({"
        " title: f.dataset.chart, kind: f.dataset.kind, measure: f.dataset.measure, axis: f.dataset.axis,"
        " curves: Array.from(f.querySelectorAll('path')).filter(p => {"
        "   const box = p.getBBox(); return box.width > 50 && p.getTotalLength() > 50; })"
        "   .map(p => p.querySelector('title').textContent),"
        " phases: f.querySelectorAll('line.vline').length,"
        " visible: f.getBoundingClientRect().width > 200 }))"
    )
    held = [c for c in charts if c["kind"] == "heldout"]
    assert {(c["measure"], c["axis"]) for c in held} == {
        (m, a) for m in ("bits_per_byte", "loss") for a in ("step", "tokens")
    }
    for chart in held:
        assert chart["curves"] == [*heldout, "held-out macro"], chart["title"]
        assert chart["phases"] == 1 and chart["visible"], chart["title"]
    external = [c for c in charts if c["kind"] == "external"]
    assert external and all(c["curves"][-1].startswith("macro over all") for c in external)
    # The latest point's table has a row per set and average.
    rows = browser.execute_script(
        "return Array.from(document.querySelectorAll('table.evaluation tbody tr')).map(r => r.dataset.set)"
    )
    assert rows[: len(heldout)] == heldout and "heldout_macro" in rows
    element = browser.find_element("id", "evaluation")
    ARTIFACTS.mkdir(exist_ok=True)
    element.screenshot(str(ARTIFACTS / "report-run-evaluation.png"))
    assert console_errors(browser) == []
