"""Writes the static site: index.html, run.html and data/ with the files behind the page.

The site opens from disk or from a bucket: every link is relative, styles and the search script are
inline, charts are inline SVG, and the small JSON files a reader needs to check the numbers (counts.json,
each cell's manifest, stats.json, the plan) are copied into data/ with a SHA256SUMS file. Pages are Jinja2
templates with autoescaping on, and a Content-Security-Policy allows only the page's own script (by hash),
so document text that looks like HTML or script is shown as text and could not run even if it slipped
through. No timestamps, sorted JSON and seeded samples make the output byte-identical for the same inputs.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import jinja2

from tokenmill import __version__, storage
from tokenmill.formats.overview import checked_overview
from tokenmill.formats.plan import MixturePlan
from tokenmill.formats.tokens import COUNTS
from tokenmill.reports.inputs import InputError, locate_curate_output
from tokenmill.reports.overview import OverviewOptions, build_overview, read_token_counts
from tokenmill.reports.runpage import build_run

GENERATOR = "tokenmill report"


@dataclass
class SiteResult:
    output: str
    files: dict[str, int] = field(default_factory=dict)  # relative path -> bytes

    @property
    def index_bytes(self) -> int:
        return self.files.get("index.html", 0)


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("tokenmill.reports", "templates"),
        # Autoescape everything, whatever the template's extension: document text is data, never markup.
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters["thousands"] = lambda value: f"{int(value):,}"
    return env


def _asset(name: str) -> str:
    return resources.files("tokenmill.reports").joinpath("templates", name).read_text(encoding="utf-8")


def _script_hash(script: str) -> str:
    return "sha256-" + base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode("ascii")


def _json_bytes(value: Any) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def _read_bytes(path: str) -> bytes:
    with storage.open_file(path, "rb") as handle:
        return handle.read()


def _check_output(output: str) -> None:
    """Refuse to write into a folder that holds something other than an earlier report."""
    if not storage.is_local(output):
        return
    path = storage.local_path(output)
    if os.path.isfile(path):
        raise InputError(f"{output}: is a file; --output must be a folder")
    if not os.path.isdir(path) or not os.listdir(path):
        return
    # An earlier report, or the live run page `tokenmill train --publish` keeps in the same folder.
    for page in ("index.html", "run.html"):
        if is_earlier_page(os.path.join(path, page)):
            return
    raise InputError(
        f"{output}: folder is not empty and holds no earlier report; choose an empty or new folder"
    )


def is_earlier_page(path: str) -> bool:
    """Whether the local file `path` is a page this module wrote (its generator meta says so)."""
    if not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8", errors="replace") as handle:
        return f'<meta name="generator" content="{GENERATOR}' in handle.read(4096)


def render_run_page(
    run_page: dict[str, Any], *, title: str = "Data overview", has_overview: bool = True
) -> bytes:
    """run.html from `build_run`'s content: for `build_site`, and for the trainer's live publishing
    (`tokenmill.trainer.run.publish`), which has no overview beside it until the final report."""
    script = _asset("search.js")
    return (
        _environment()
        .get_template("run.html.j2")
        .render(
            title=title,
            version=__version__,
            generator=GENERATOR,
            style=_asset("style.css"),
            script=script,
            script_hash=_script_hash(script),
            has_run=True,
            run_name=run_page["name"],
            page="run",
            r=run_page,
            has_overview=has_overview,
            refresh=run_page["follow"]["refresh"],
        )
        .encode("utf-8")
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
) -> SiteResult:
    """Build the site into `output` and return the files written with their sizes.

    ladder: a scaling-ladder fit (`tokenmill ladder fit`'s ladder.json) drawn on the run page; without it the
    run folder's own ladder.json is used when there is one.
    """
    if ladder and not run:
        raise InputError(f"{ladder}: a ladder forecast is drawn on the run page; give --run too")
    options = options or OverviewOptions()
    _check_output(output)
    layout = locate_curate_output(curated)
    counts = read_token_counts(tokens)
    overview = build_overview(layout, tokens, counts, plan, previous_plan, options)
    run_page = build_run(run, ladder) if run else None

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
    samples = b"".join(
        (json.dumps(sample, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")
        for sample in overview["samples"]
    )
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

    env = _environment()
    script = _asset("search.js")
    common = {
        "title": title,
        "version": __version__,
        "generator": GENERATOR,
        "style": _asset("style.css"),
        "script": script,
        "script_hash": _script_hash(script),
        "has_run": run_page is not None,
        "run_name": run_page["name"] if run_page else "",
    }
    counts_href = "data/tokens/counts.json"
    outputs["index.html"] = (
        env.get_template("index.html.j2")
        .render(
            **common,
            page="overview",
            o=overview,
            data_files=sorted(data_files, key=lambda f: (f["group"] != "tokens", f["group"], f["href"])),
            counts_href=counts_href,
            options=options,
        )
        .encode("utf-8")
    )
    if run_page:
        outputs["run.html"] = render_run_page(run_page, title=title)

    # Each atomic write ends in an fsync, which waits on the disk and not the CPU: a few threads overlap them.
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(
            pool.map(
                lambda item: storage.write_bytes(storage.join(output, *item[0].split("/")), item[1]),
                sorted(outputs.items()),
            )
        )
    _remove_stale(output, set(outputs))
    return SiteResult(output=output, files={k: len(v) for k, v in sorted(outputs.items())})
