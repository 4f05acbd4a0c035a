"""The data-overview page's content: headline, heatmap, domain cards, curation funnel and mixture.

`build_overview` turns the inputs into plain dicts and SVG markup for the template, plus the
machine-readable `overview.json` that is published beside the page. Ordering is fixed everywhere (domains
by tokens then name, cells by quality, sources by characters then name) so the same inputs give the same
bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from tokenmill import storage
from tokenmill.cells import QUALITY_BUCKETS, parse_cell
from tokenmill.reports import svg
from tokenmill.reports.inputs import (
    CellScan,
    CurateLayout,
    InputError,
    cell_files,
    read_json_file,
    scan_cell,
    scan_rejected,
    scan_removed,
)
from tokenmill.reports.plans import cell_allocation, diff_plans
from tokenmill.units import format_count

QUALITY_COLORS = ("#d7301f", "#fc8d59", "#fdcc8a", "#74a9cf", "#0570b0")  # bucket 0 (low) .. 4 (high)


@dataclass(frozen=True)
class OverviewOptions:
    samples_per_cell: int = 5
    preview_chars: int = 400
    removed_examples: int = 3
    rejected_examples: int = 3
    seed: int = 0


def safe_href(url: Any) -> str:
    """The URL when it is plain http(s), else '' so that the page shows it as text, never as a link.

    `javascript:`, `data:` and relative URLs from input data must not become clickable.
    """
    if not isinstance(url, str) or not url or any(c in url for c in "\x00\n\r\t\\"):
        return ""
    try:
        parts = urlsplit(url.strip())
    except ValueError:
        return ""
    return url.strip() if parts.scheme.lower() in ("http", "https") and parts.netloc else ""


def preview(text: Any, limit: int) -> tuple[str, bool]:
    """The first `limit` characters of a document and whether it was cut."""
    text = "" if text is None else str(text)
    return (text[:limit], True) if len(text) > limit else (text, False)


def percent(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "–"


def _sample(row: dict[str, Any], cell: str, limit: int) -> dict[str, Any]:
    text, cut = preview(row.get("text"), limit)
    url = row.get("url")
    score = row.get("quality_score")
    return {
        "id": str(row.get("id")),
        "cell": cell,
        "source": "" if row.get("source") is None else str(row.get("source")),
        "url": "" if url is None else str(url),
        "href": safe_href(url),
        "text": text,
        "truncated": cut,
        "n_chars": row.get("n_chars"),
        "quality_score": None if score is None else round(float(score), 3),
        "language": row.get("language"),
    }


def _manifest_path(tokens_dir: str, cell: str, entry: dict[str, Any]) -> str:
    relative = entry.get("manifest") or f"{cell}/manifest.json"
    return storage.join(tokens_dir, *str(relative).split("/"))


def load_counts(tokens_dir: str) -> dict[str, Any]:
    counts = read_json_file(storage.join(tokens_dir, "counts.json"), "token counts (counts.json)")
    if not isinstance(counts, dict) or not isinstance(counts.get("cells"), dict):
        raise InputError(
            f"{storage.join(tokens_dir, 'counts.json')}: no 'cells' object (see docs/formats.md)"
        )
    for cell in counts["cells"]:
        try:
            parse_cell(cell)
        except ValueError as error:
            raise InputError(f"{storage.join(tokens_dir, 'counts.json')}: {error}") from error
    return counts


def build_overview(
    layout: CurateLayout,
    tokens_dir: str,
    counts: dict[str, Any],
    plan: dict[str, Any],
    previous_plan: dict[str, Any] | None,
    options: OverviewOptions,
) -> dict[str, Any]:
    """Everything the index page shows, as template context; `context["data"]` is published as JSON."""
    files = cell_files(layout.curated)
    scans: dict[str, CellScan] = {
        cell: scan_cell(cell, paths, samples=options.samples_per_cell, seed=options.seed)
        for cell, paths in files.items()
    }
    cell_tokens = {cell: int(entry.get("tokens", 0)) for cell, entry in sorted(counts["cells"].items())}
    all_cells = sorted(set(scans) | set(cell_tokens))
    total_tokens = sum(cell_tokens.values())

    domains: dict[str, dict[str, Any]] = {}
    for cell in all_cells:
        domain, quality = parse_cell(cell)
        domains.setdefault(domain, {"name": domain, "cells": {}})["cells"][quality] = cell

    cards = []
    heat_cells = []
    all_sources: set[str] = set()
    manifests: dict[str, str] = {}
    for name, domain in domains.items():
        tokens = sum(cell_tokens.get(c, 0) for c in domain["cells"].values())
        documents = 0
        source_totals: dict[str, dict[str, float]] = {}
        qualities = []
        for quality in QUALITY_BUCKETS:
            cell = domain["cells"].get(quality)
            if cell is None:
                continue
            scan = scans.get(cell, CellScan(cell=cell))
            count_entry = counts["cells"].get(cell, {})
            tokens_in_cell = cell_tokens.get(cell, 0)
            docs_in_cell = int(count_entry.get("documents", scan.documents))
            documents += docs_in_cell
            for source, count in scan.sources.items():
                all_sources.add(source)
                total = source_totals.setdefault(source, {"documents": 0, "characters": 0, "tokens": 0.0})
                total["documents"] += count.documents
                total["characters"] += count.characters
                # Token counts are per cell; a source's share of a cell's tokens follows its characters.
                if scan.characters:
                    total["tokens"] += tokens_in_cell * count.characters / scan.characters
            manifest = ""
            if cell in counts["cells"]:
                source_path = _manifest_path(tokens_dir, cell, count_entry)
                if storage.exists(source_path):
                    manifest = f"data/tokens/{cell}/manifest.json"
                    manifests[cell] = source_path
            qualities.append(
                {
                    "quality": quality,
                    "cell": cell,
                    "anchor": f"cell-{name}-q{quality}",
                    "tokens": tokens_in_cell,
                    "tokens_text": format_count(tokens_in_cell),
                    "documents": docs_in_cell,
                    "curated_documents": scan.documents,
                    "characters": scan.characters,
                    "share": percent(tokens_in_cell, tokens),
                    "manifest": manifest,
                    "in_counts": cell in counts["cells"],
                    "in_curated": cell in scans,
                    "samples": [_sample(row, cell, options.preview_chars) for row in scan.samples],
                }
            )
            heat_cells.append(
                svg.HeatCell(
                    row=name,
                    column=f"q{quality}",
                    value=tokens_in_cell,
                    label=format_count(tokens_in_cell) if tokens_in_cell else "0",
                    title=f"{cell}: {format_count(tokens_in_cell)} tokens, {docs_in_cell:,} documents",
                    href=f"#cell-{name}-q{quality}",
                    key=cell,
                )
            )
        source_rows = [
            {
                "name": source,
                "documents": int(t["documents"]),
                "characters": int(t["characters"]),
                "tokens": round(t["tokens"]),
                "tokens_text": format_count(round(t["tokens"])),
                "share": percent(t["tokens"], tokens),
            }
            for source, t in sorted(source_totals.items(), key=lambda kv: (-kv[1]["characters"], kv[0]))
        ]
        cards.append(
            {
                "name": name,
                "anchor": f"domain-{name}",
                "tokens": tokens,
                "tokens_text": format_count(tokens),
                "share": percent(tokens, total_tokens),
                "documents": documents,
                "qualities": qualities,
                "quality_bar": svg.stacked_bar(
                    [
                        svg.Segment(
                            f"quality {q['quality']}",
                            q["tokens"],
                            f"{q['tokens_text']} tokens ({q['share']})",
                            QUALITY_COLORS[q["quality"]],
                        )
                        for q in qualities
                    ],
                    width=360,
                ),
                "sources": source_rows,
                "source_bar": svg.stacked_bar(
                    [
                        svg.Segment(s["name"], s["tokens"], f"≈{s['tokens_text']} tokens ({s['share']})")
                        for s in source_rows
                    ],
                    width=360,
                ),
                "search": " ".join(
                    [name, *(s["name"] for s in source_rows), *(q["cell"] for q in qualities)]
                ),
                "sample_count": sum(len(q["samples"]) for q in qualities),
            }
        )
    cards.sort(key=lambda c: (-c["tokens"], c["name"]))
    for card in cards:
        # Mixed-source bars reuse category colors; the legend below the bar lists them in this order.
        for i, source in enumerate(card["sources"]):
            source["color"] = svg.category_color(i)

    scale = svg.ColorScale.for_values([c.value for c in heat_cells])
    heatmap = svg.heatmap(
        [c["name"] for c in cards],
        [f"q{q}" for q in QUALITY_BUCKETS],
        heat_cells,
        scale=scale,
        title="Tokens per domain and quality bucket",
        row_label="domain",
        column_label="quality bucket (0 = lowest, 4 = highest)",
        row_hrefs={c["name"]: f"#domain-{c['name']}" for c in cards},
    )
    legend = svg.color_legend(scale, label="tokens per cell")

    present_qualities = sorted({parse_cell(c)[1] for c in all_cells if cell_tokens.get(c, 0) > 0})
    headline = {
        "tokens": total_tokens,
        "tokens_text": format_count(total_tokens),
        "documents": int(
            counts.get("total_documents", sum(int(e.get("documents", 0)) for e in counts["cells"].values()))
        ),
        "sources": len(all_sources),
        "domains": len(cards),
        "cells": len([c for c in all_cells if cell_tokens.get(c, 0) > 0]),
        "quality_buckets": len(present_qualities),
        "quality_list": ", ".join(str(q) for q in present_qualities),
        "tokenizer": counts.get("tokenizer") or {},
    }

    stats = (
        read_json_file(layout.stats, "curate statistics (stats.json)")
        if storage.exists(layout.stats)
        else None
    )
    removed = scan_removed(layout.removed, examples=options.removed_examples, seed=options.seed)
    rejected = scan_rejected(layout.rejected, examples=options.rejected_examples, seed=options.seed)
    funnel = build_funnel(stats, removed, rejected, options)
    mixture = build_mixture(plan, previous_plan, cell_tokens)

    samples = [s for card in cards for q in card["qualities"] for s in q["samples"]]
    data = {
        "format_version": 1,
        "headline": {k: v for k, v in headline.items() if k not in ("tokens_text", "quality_list")},
        "cells": {
            q["cell"]: {
                "tokens": q["tokens"],
                "documents": q["documents"],
                "curated_documents": q["curated_documents"],
                "characters": q["characters"],
                "manifest": q["manifest"] or None,
                "samples": [s["id"] for s in q["samples"]],
            }
            for card in cards
            for q in card["qualities"]
        },
        "domains": {
            card["name"]: {
                "tokens": card["tokens"],
                "documents": card["documents"],
                "sources": {
                    s["name"]: {
                        "documents": s["documents"],
                        "characters": s["characters"],
                        "tokens_estimated": s["tokens"],
                    }
                    for s in card["sources"]
                },
            }
            for card in cards
        },
        "options": {
            "seed": options.seed,
            "samples_per_cell": options.samples_per_cell,
            "preview_chars": options.preview_chars,
        },
    }
    return {
        "headline": headline,
        "heatmap": heatmap,
        "legend": legend,
        "cards": cards,
        "funnel": funnel,
        "mixture": mixture,
        "samples": samples,
        "sample_total": len(samples),
        "manifests": manifests,
        "stats_path": layout.stats if stats is not None else None,
        "data": data,
        "quality_colors": QUALITY_COLORS,
    }


def _contamination(stats: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Documents matched per evaluation set by the decontam stage (stats.json: stages.decontam)."""
    decontam = ((stats or {}).get("stages") or {}).get("decontam") or {}
    checked = int(decontam.get("documents", 0))
    return [
        {"eval_set": name, "documents": int(entry.get("documents", 0)), "checked": checked}
        for name, entry in sorted((decontam.get("eval_sets") or {}).items())
    ]


def build_funnel(
    stats: dict[str, Any] | None,
    removed: dict[str, Any],
    rejected: dict[str, dict[str, Any]],
    options: OverviewOptions,
) -> dict[str, Any]:
    """Documents and tokens after each stage, removals by reason with examples, rejected input by kind."""
    stages = []
    if stats:
        read_docs = int((stats.get("read") or {}).get("documents", 0))
        previous = None
        for stage in stats.get("funnel") or []:
            documents = int(stage.get("documents", 0))
            stages.append(
                {
                    "stage": str(stage.get("stage")),
                    "documents": documents,
                    "characters": int(stage.get("characters", 0)),
                    "tokens_estimated": int(stage.get("tokens_estimated", 0)),
                    "tokens_text": format_count(int(stage.get("tokens_estimated", 0))),
                    "share": percent(documents, read_docs),
                    "dropped": None if previous is None else previous - documents,
                }
            )
            previous = documents
    chart = (
        svg.bar_chart(
            [
                svg.Bar(s["stage"], s["documents"], f"{s['documents']:,} docs · {s['tokens_text']} tok")
                for s in stages
            ],
            title="Documents left after each curation stage",
            width=720,
        )
        if stages
        else None
    )
    by_reason = dict((stats or {}).get("removed_by_reason") or {})
    reasons = []
    for key in sorted(set(by_reason) | set(removed)):
        counted = by_reason.get(key) or {}
        scanned = removed.get(key)
        stage, _, reason = key.partition("/")
        reasons.append(
            {
                "key": key,
                "anchor": "removed-" + "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in key),
                "stage": counted.get("stage", stage),
                "reason": counted.get("reason", reason),
                "documents": int(counted.get("documents", scanned.documents if scanned else 0)),
                "tokens_estimated": int(counted.get("tokens_estimated", 0)),
                "tokens_text": format_count(int(counted.get("tokens_estimated", 0))),
                "examples": [
                    {
                        **_sample(row, "", options.preview_chars),
                        "detail": _detail_text(row.get("detail")),
                    }
                    for row in (scanned.examples if scanned else [])
                ],
            }
        )
    reasons.sort(key=lambda r: (-r["documents"], r["key"]))
    by_error = dict((stats or {}).get("rejected_by_error") or {})
    rejected_rows = []
    for kind in sorted(set(by_error) | set(rejected)):
        scanned = rejected.get(kind) or {}
        rejected_rows.append(
            {
                "kind": kind,
                "documents": int((by_error.get(kind) or {}).get("documents", scanned.get("documents", 0))),
                "examples": [
                    {
                        **e,
                        "raw": preview(e["raw"], options.preview_chars)[0] if e["raw"] is not None else None,
                    }
                    for e in scanned.get("examples", [])
                ],
            }
        )
    rejected_rows.sort(key=lambda r: (-r["documents"], r["kind"]))
    totals = {}
    if stats:
        for key in ("read", "kept", "removed", "rejected"):
            entry = stats.get(key) or {}
            totals[key] = {
                "documents": int(entry.get("documents", 0)),
                "tokens_estimated": int(entry.get("tokens_estimated", 0)),
                "tokens_text": format_count(int(entry.get("tokens_estimated", 0))),
            }
    sources = [
        {"name": name, **{k: int(v.get(k, 0)) for k in ("read", "kept", "removed", "rejected")}}
        for name, v in sorted(((stats or {}).get("sources") or {}).items())
    ]
    return {
        "present": stats is not None,
        "stages": stages,
        "chart": chart,
        "reasons": reasons,
        "rejected": rejected_rows,
        "contamination": _contamination(stats),
        "totals": totals,
        "balanced": None if stats is None else bool(stats.get("balanced")),
        "sources": sources,
        "recipe": (stats or {}).get("recipe"),
        "chars_per_token": (stats or {}).get("chars_per_token"),
    }


def _detail_text(detail: Any) -> str:
    if detail is None:
        return ""
    try:
        return json.dumps(json.loads(detail), sort_keys=True, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(detail)


def _fmt_number(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        return format_count(value) if abs(value) >= 10_000 else f"{value:,}"
    if isinstance(value, float):
        return format_count(value) if abs(value) >= 10_000 else f"{value:.4g}"
    if isinstance(value, list):
        return ", ".join(str(v) for v in value)
    return str(value)


def build_mixture(
    plan: dict[str, Any], previous: dict[str, Any] | None, cell_tokens: dict[str, int]
) -> dict[str, Any]:
    """Phases with their budgets and boundaries, per-source and per-cell tables, and the diff."""
    phases = []
    for i, phase in enumerate(plan["phases"]):
        sources = []
        for j, source in enumerate(phase["sources"]):
            epochs = float(source.get("epochs") or 0.0)
            sources.append(
                {
                    "name": str(source["name"]),
                    "cells": [str(c) for c in source["cells"]],
                    "weight": float(source["weight"]),
                    "weight_text": f"{100 * float(source['weight']):.2f}%",
                    "tokens": int(source["tokens"]),
                    "tokens_text": format_count(int(source["tokens"])),
                    "available_text": format_count(int(source["tokens_available"])),
                    "epochs": epochs,
                    "epochs_text": f"{epochs:.2f}",
                    "repeated": epochs > 1.0,
                    "color": svg.category_color(j),
                }
            )
        phases.append(
            {
                "index": i,
                "name": str(phase["name"]),
                "tokens_text": format_count(int(phase["tokens"])),
                "share": percent(int(phase["tokens"]), int(plan.get("total_tokens") or 0)),
                "steps": int(phase["steps"]),
                "start_step": int(phase["start_step"]),
                "end_step": int(phase["end_step"]),
                "sources": sources,
                "bar": svg.stacked_bar(
                    [svg.Segment(s["name"], s["weight"], s["weight_text"], s["color"]) for s in sources],
                    width=880,
                ),
            }
        )
    timeline = svg.timeline(
        [
            svg.Span(
                p["name"], p["start_step"], p["end_step"], f"{p['tokens_text']} tokens, {p['steps']:,} steps"
            )
            for p in phases
        ],
        title="Phase boundaries (training steps)",
    )
    allocation = cell_allocation(plan, cell_tokens)
    phase_names = [p["name"] for p in phases]
    cell_rows = [
        {
            "cell": cell,
            "available_text": format_count(cell_tokens.get(cell, 0)),
            "phases": [
                None
                if name not in per_phase
                else {
                    "weight_text": f"{100 * per_phase[name]['weight']:.2f}%",
                    "tokens_text": format_count(round(per_phase[name]["tokens"])),
                    "epochs_text": f"{per_phase[name]['epochs']:.2f}",
                    "repeated": per_phase[name]["epochs"] > 1.0,
                }
                for name in phase_names
            ],
        }
        for cell, per_phase in allocation.items()
    ]
    unused = [c for c in sorted(cell_tokens) if c not in allocation and cell_tokens[c] > 0]
    diff = None
    if previous is not None:
        raw = diff_plans(previous, plan)
        diff = {
            "changed": raw["changed"],
            "settings": [
                {**f, "old": _fmt_number(f["old"]), "new": _fmt_number(f["new"])} for f in raw["settings"]
            ],
            "phases": [
                {
                    **p,
                    "fields": [
                        {**f, "old": _fmt_number(f["old"]), "new": _fmt_number(f["new"])} for f in p["fields"]
                    ],
                    "sources": [
                        {
                            **s,
                            "fields": [
                                {
                                    **f,
                                    "old": _fmt_weight(f)
                                    if f["field"] == "weight"
                                    else _fmt_number(f["old"]),
                                    "new": _fmt_weight(f, new=True)
                                    if f["field"] == "weight"
                                    else _fmt_number(f["new"]),
                                }
                                for f in s["fields"]
                            ],
                        }
                        for s in p["sources"]
                    ],
                }
                for p in raw["phases"]
            ],
            "previous_name": previous.get("name"),
        }
    return {
        "name": plan.get("name"),
        "tokenizer": plan.get("tokenizer"),
        "total_tokens_text": format_count(int(plan.get("total_tokens") or 0)),
        "sequence_length": plan.get("sequence_length"),
        "batch_size": plan.get("batch_size"),
        "block_size": plan.get("block_size"),
        "tokens_per_step": plan.get("tokens_per_step"),
        "total_steps": int(plan.get("total_steps") or max((p["end_step"] for p in phases), default=0)),
        "description": plan.get("description"),
        "warnings": [str(w) for w in plan.get("warnings") or []],
        "illustrative": bool(plan.get("illustrative")),
        "phases": phases,
        "phase_names": phase_names,
        "timeline": timeline,
        "cells": cell_rows,
        "unused_cells": unused,
        "diff": diff,
    }


def _fmt_weight(field: dict[str, Any], new: bool = False) -> str:
    value = field["new"] if new else field["old"]
    return f"{100 * float(value):.2f}%" if isinstance(value, int | float) else str(value)
