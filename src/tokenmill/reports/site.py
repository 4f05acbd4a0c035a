"""Writes the static site: index.html, run.html, swarm.html and data/ with the files behind the page.

The site opens from disk or from a bucket: every link is relative, styles and the search script are
inline, charts are inline SVG, and the small JSON files a reader needs to check the numbers (counts.json,
each cell's manifest, stats.json, the plan) are copied into data/ with a SHA256SUMS file. Pages are Jinja2
templates with autoescaping on, and a Content-Security-Policy allows only the page's own script (by hash),
so document text that looks like HTML or script is shown as text and could not run even if it slipped
through. No timestamps, sorted JSON and seeded samples make the output byte-identical for the same inputs.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from tokenmill import storage
from tokenmill.formats.overview import checked_overview
from tokenmill.formats.plan import MixturePlan
from tokenmill.formats.tokens import COUNTS
from tokenmill.reports.inputs import InputError, locate_curate_output
from tokenmill.reports.overview import OverviewOptions, build_overview, read_token_counts
from tokenmill.reports.render import check_output, render_template
from tokenmill.reports.runpage import build_run
from tokenmill.reports.swarmpage import build_swarm, render_swarm_page


@dataclass
class SiteResult:
    output: str
    files: dict[str, int] = field(default_factory=dict)  # relative path -> bytes

    @property
    def index_bytes(self) -> int:
        return self.files.get("index.html", 0)


def _json_bytes(value: Any) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def _read_bytes(path: str) -> bytes:
    with storage.open_file(path, "rb") as handle:
        return handle.read()


def render_run_page(
    run_page: dict[str, Any], *, title: str = "Data overview", has_overview: bool = True, swarm_name: str = ""
) -> bytes:
    """run.html from `build_run`'s content: for `build_site`, and for the trainer's live publishing
    (`tokenmill.trainer.run.publish`), which has no overview beside it until the final report."""
    return render_template(
        "run.html.j2",
        title=title,
        has_run=True,
        run_name=run_page["name"],
        page="run",
        r=run_page,
        has_overview=has_overview,
        refresh=run_page["follow"]["refresh"],
        swarm_name=swarm_name,
    )


def _remove_stale(output: str, written: set[str]) -> None:
    """Delete files from an earlier report that this one did not write, so the folder equals the build."""
    if not storage.is_local(output):
        return
    root = storage.local_path(output)
    for directory, _, files in os.walk(root, topdown=False):
        for name in files:
            relative = os.path.relpath(os.path.join(directory, name), root).replace(os.sep, "/")
            if relative not in written:
                os.remove(os.path.join(directory, name))
        if directory != root and not os.listdir(directory):
            os.rmdir(directory)


def build_site(
    *,
    curated: str,
    tokens: str,
    plan: MixturePlan,
    output: str,
    previous_plan: MixturePlan | None = None,
    run: str | None = None,
    options: OverviewOptions | None = None,
    title: str = "Data overview",
    ladder: str | None = None,
    swarm: str | None = None,
) -> SiteResult:
    """Build the site into `output` and return the files written with their sizes.

    ladder: a scaling-ladder fit (`tokenmill ladder fit`'s ladder.json) drawn on the run page; without it the
    run folder's own ladder.json is used when there is one.
    swarm: a mixture search's folder (`tokenmill mixture swarm`): adds swarm.html, linked from every page.
    """
    if ladder and not run:
        raise InputError(f"{ladder}: a ladder forecast is drawn on the run page; give --run too")
    options = options or OverviewOptions()
    check_output(output)
    layout = locate_curate_output(curated)
    counts = read_token_counts(tokens)
    overview = build_overview(layout, tokens, counts, plan, previous_plan, options)
    # Not beside the overview on a thread: a thread busy in Python makes every system call of the other
    # wait for the interpreter lock (listing the 400 curated files took 1.8 s instead of 7 ms).
    run_page = build_run(run, ladder) if run else None
    swarm_page = None
    if swarm:
        swarm_page = build_swarm(swarm)
    swarm_name = swarm_page["name"] if swarm_page else ""

    outputs: dict[str, bytes] = {}
    data_files: list[dict[str, Any]] = []

    def publish(relative: str, payload: bytes, label: str, group: str) -> None:
        outputs[relative] = payload
        data_files.append(
            {
                "href": relative,
                "label": label,
                "group": group,
                "bytes": len(payload),
                "sha256": hashlib.sha256(payload).hexdigest(),
            }
        )

    # Copied byte for byte, so that a reader can compare them with the originals.
    publish(
        "data/tokens/counts.json",
        _read_bytes(storage.join(tokens, COUNTS)),
        "token counts per cell",
        "tokens",
    )
    for cell, path in sorted(overview["manifests"].items()):
        publish(f"data/tokens/{cell}/manifest.json", _read_bytes(path), f"manifest of {cell}", "manifests")
    if overview["stats_path"]:
        publish(
            "data/curate/stats.json", _read_bytes(overview["stats_path"]), "curation statistics", "curate"
        )
    publish("data/mixture/plan.json", _json_bytes(plan.to_json()), "mixture plan", "mixture")
    if previous_plan is not None:
        publish(
            "data/mixture/previous-plan.json",
            _json_bytes(previous_plan.to_json()),
            "previous mixture plan",
            "mixture",
        )
    encoder = json.JSONEncoder(sort_keys=True, ensure_ascii=False)  # one encoder for 10,000 lines
    samples = "".join(encoder.encode(sample) + "\n" for sample in overview["samples"]).encode("utf-8")
    publish(
        "data/samples.jsonl", samples, "sample documents shown on the page (text cut to the preview)", "page"
    )
    publish(
        "data/overview.json", _json_bytes(checked_overview(overview["data"])), "the page's numbers", "page"
    )
    if run_page:
        for relative, payload, label in run_page["files"]:
            publish(relative, payload, label, "run")
    sums = "".join(
        f"{f['sha256']}  {f['href'][len('data/') :]}\n" for f in sorted(data_files, key=lambda f: f["href"])
    )
    outputs["data/SHA256SUMS"] = sums.encode("utf-8")

    # The files are written on a few threads (each write ends in an fsync, which waits on the disk),
    # data/ while the pages render and the pages last, so a reader who opens a page mid-write finds the
    # data it links to.
    with ThreadPoolExecutor(max_workers=8, thread_name_prefix="tokenmill-site") as pool:

        def write(item: tuple[str, bytes]) -> None:
            storage.write_bytes(storage.join(output, *item[0].split("/")), item[1])

        data_written = [pool.submit(write, item) for item in sorted(outputs.items())]
        pages: dict[str, bytes] = {}
        counts_href = "data/tokens/counts.json"
        pages["index.html"] = render_template(
            "index.html.j2",
            title=title,
            has_run=run_page is not None,
            run_name=run_page["name"] if run_page else "",
            swarm_name=swarm_name,
            page="overview",
            o=overview,
            data_files=sorted(data_files, key=lambda f: (f["group"] != "tokens", f["group"], f["href"])),
            counts_href=counts_href,
            options=options,
        )
        if run_page:
            pages["run.html"] = render_run_page(run_page, title=title, swarm_name=swarm_name)
        if swarm_page:
            pages["swarm.html"] = render_swarm_page(
                swarm_page, has_overview=True, run_name=run_page["name"] if run_page else ""
            )

        for future in data_written:
            future.result()
        list(pool.map(write, sorted(pages.items())))
    outputs.update(pages)
    _remove_stale(output, set(outputs))
    return SiteResult(output=output, files={k: len(v) for k, v in sorted(outputs.items())})
