"""Benchmark: `tokenmill report` at the size budget of docs/reports.md (200 cells, 10,000 samples).

Writes report inputs with tokenmill.samples.report_inputs (40 domains x 5 quality buckets, about 100 documents
per cell, 50 samples per cell), then measures

  1. the baseline: reading the inputs alone, what any page built from them has to do: every curated cell's
     Parquet files in full, counts.json and every manifest, stats.json, the plan and metrics.jsonl;
  2. `build_site` on the same inputs (best of two, so that noise from other users of the shared machine
     counts against the baseline, not against the report), and the size of index.html and of the site;
  3. with Chromium present, the page in a browser from disk: time to the load event, and time for a search
     to filter the 10,000 samples (including the search box's 80 ms debounce).

The last line is the result: ratio = baseline seconds / build seconds (higher is better): the report may cost
at most three times reading its inputs, so the target is 1/3. The page-size budget is checked on the line
before it. Run under `nice`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

from tokenmill.formats.plan import read_plan
from tokenmill.reports.browser import headless_chromium, missing_browser
from tokenmill.reports.overview import OverviewOptions
from tokenmill.reports.site import build_site
from tokenmill.samples.report_inputs import make_report_inputs

TARGET = 0.33  # the report may cost at most 3x reading its inputs: baseline / build >= 1/3
INDEX_BUDGET = 12_000_000  # bytes of index.html at 200 cells and 10,000 samples of 400 characters
LOAD_BUDGET = 3.0  # seconds to the load event in headless Chromium
SEARCH_BUDGET = 0.5  # seconds for a search over 10,000 samples, debounce included


def read_inputs(root: Path) -> int:
    """Everything the report reads, read plainly; returns bytes of text so the work cannot be skipped."""
    total = 0
    for cell_dir in sorted((root / "curate" / "curated").glob("domain=*/quality=*")):
        table = pq.read_table(sorted(map(str, cell_dir.glob("*.parquet"))), partitioning=None)
        total += sum(len(t) for t in table.column("text").to_pylist())
    for path in sorted((root / "curate" / "removed").rglob("*.parquet")):
        total += pq.read_table(path).num_rows
    for path in [root / "tokens" / "counts.json", *sorted((root / "tokens").rglob("manifest.json"))]:
        total += len(json.loads(path.read_text()))
    total += len(json.loads((root / "curate" / "stats.json").read_text()))
    total += len(json.loads((root / "plan.json").read_text()))
    total += sum(
        1 for line in (root / "runs" / "fixture-run" / "metrics.jsonl").read_text().splitlines() if line
    )
    return total


def best_of(n: int, fn) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(n):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def browser_times(index: Path) -> tuple[float, float] | None:
    if missing_browser():
        print(f"browser: {', '.join(missing_browser())} missing (run `make browser`); skipped")
        return None
    with headless_chromium("tokenmill-bench-") as driver:
        loads = []
        for _ in range(2):
            driver.get("about:blank")
            driver.get(index.as_uri())
            loads.append(
                driver.execute_script(
                    "const t = performance.getEntriesByType('navigation')[0];"
                    "return t.loadEventEnd - t.startTime;"
                )
                / 1000
            )
        searches = []
        for query in ("science", "matrix attention", "zzz-nothing", "web-2"):
            searches.append(
                driver.execute_async_script(
                    """
                    const [query, done] = arguments;
                    const input = document.getElementById('search');
                    const status = document.getElementById('search-status');
                    const start = performance.now();
                    new MutationObserver((_, observer) => {
                      if (status.getAttribute('data-query') === query) {
                        observer.disconnect();
                        requestAnimationFrame(() => done((performance.now() - start) / 1000));
                      }
                    }).observe(status, {attributes: true, childList: true, subtree: true});
                    input.value = query;
                    input.dispatchEvent(new Event('input'));
                    """,
                    query,
                )
            )
        return min(loads), max(searches)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--domains", type=int, default=40)
    parser.add_argument("--samples-per-cell", type=int, default=50)
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tokenmill-bench-report-"))
    try:
        start = time.perf_counter()
        inputs = make_report_inputs(
            work / "in",
            domains=args.domains,
            docs_per_cell=100,
            hostile=False,
            missing_cells=False,
            steps=20_000,
        )
        print(f"inputs: {len(inputs.cells)} cells written in {time.perf_counter() - start:.1f} s")
        plan = read_plan(str(inputs.plan))
        baseline, _ = best_of(2, lambda: read_inputs(work / "in"))
        print(f"baseline: reading the inputs takes {baseline:.2f} s (best of 2)")

        def build():
            output = work / "site"
            shutil.rmtree(output, ignore_errors=True)
            return build_site(
                curated=str(inputs.curate),
                tokens=str(inputs.tokens),
                plan=plan,
                previous_plan=read_plan(str(inputs.previous_plan)),
                run=str(inputs.run),
                output=str(output),
                options=OverviewOptions(samples_per_cell=args.samples_per_cell),
            )

        seconds, result = best_of(2, build)
        overview = json.loads((work / "site" / "data" / "overview.json").read_text())
        samples = sum(len(c["samples"]) for c in overview["cells"].values())
        site_bytes = sum(result.files.values())
        print(
            f"build: {len(overview['cells'])} cells, {samples:,} samples in {seconds:.2f} s (best of 2); "
            f"index.html {result.index_bytes / 1e6:.2f} MB, "
            f"run.html {result.files.get('run.html', 0) / 1e3:.0f} KB, "
            f"site {site_bytes / 1e6:.2f} MB in {len(result.files)} files"
        )
        times = browser_times(work / "site" / "index.html")
        if times:
            load, search = times
            print(
                f"browser: load event after {load:.2f} s (budget {LOAD_BUDGET} s); slowest search "
                f"{search * 1000:.0f} ms incl. 80 ms debounce (budget {SEARCH_BUDGET * 1000:.0f} ms)"
            )
        within = result.index_bytes <= INDEX_BUDGET
        print(
            f"size budget: index.html {result.index_bytes:,} bytes of {INDEX_BUDGET:,} "
            f"({'within' if within else 'OVER'} budget)"
        )
        print(f"report ratio={baseline / seconds:.2f} target={TARGET} baseline=read_inputs")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
