"""The data-overview page's content: headline, heatmap, domain cards, curation funnel and mixture (the
curation sections beside the funnel are built in tokenmill.reports.curation).

With a topic-domain model (`OverviewOptions.domains_model`, the folder `tokenmill domains train` wrote),
each `cNN` domain card also shows the domain's distinctive terms, its share of the model's sample and the
documents nearest its centre; with a quality model (`quality_model`), the page lists the quality cut
points per content type from its calibration.json. Every card shows its Q0-Q4 split and each source's
enrichment: the source's share of the domain's tokens over its share of all tokens (2.0: twice as common
in this domain as overall).

`build_overview` turns the inputs into plain dicts and SVG markup for the template, plus the
machine-readable `overview.json` that is published beside the page. Ordering is fixed everywhere (domains
by tokens then name, cells by quality, sources by characters then name) so the same inputs give the same
bytes.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from tokenmill import storage
from tokenmill.cells import QUALITY_BUCKETS, parse_cell
from tokenmill.errors import FormatError
from tokenmill.formats.cards import CALIBRATION, Calibration, read_calibration
from tokenmill.formats.domains import CARD as DOMAINS_CARD
from tokenmill.formats.domains import DomainsCard, read_domains_card
from tokenmill.formats.plan import MixturePlan
from tokenmill.formats.stats import CurateStats, read_stats
from tokenmill.formats.tokens import COUNTS, CellCount, TokenCounts, read_counts
from tokenmill.reports import svg
from tokenmill.reports.curation import (
    DECONTAM,
    boilerplate_section,
    contamination_rows,
    duplicates_section,
    histogram_text,
    personal_data_section,
    source_rows,
    totals_by_source,
)
from tokenmill.reports.display import percent, preview, sample_row
from tokenmill.reports.inputs import (
    CellScan,
    ContaminationScan,
    CurateLayout,
    InputError,
    cell_files,
    scan_cell,
    scan_contamination,
    scan_rejected,
    scan_removed,
    scan_removed_pii,
)
from tokenmill.reports.plans import cell_allocation, plan_changes
from tokenmill.units import format_count

#: Threads scanning curated cells at once (build_overview).
SCAN_THREADS = 4

QUALITY_COLORS = ("#d7301f", "#fc8d59", "#fdcc8a", "#74a9cf", "#0570b0")  # bucket 0 (low) .. 4 (high)


@dataclass(frozen=True)
class OverviewOptions:
    samples_per_cell: int = 5
    preview_chars: int = 400
    removed_examples: int = 3
    rejected_examples: int = 3
    seed: int = 0
    #: A topic-domain model folder (`tokenmill domains train`): names and examples for its cNN domains.
    domains_model: str | None = None
    #: A quality model folder, or its calibration.json: the quality cut points per content type.
    quality_model: str | None = None


def read_token_counts(tokens_dir: str) -> TokenCounts:
    """tokenize's counts.json in `tokens_dir`; InputError names the file and the field that is wrong, and a
    cell name that is not `domain=<d>/quality=<q>`."""
    path = storage.join(tokens_dir, COUNTS)
    if not storage.exists(path):
        raise InputError(f"{tokens_dir}: no counts.json here (expected the tokenize output folder)")
    try:
        counts = read_counts(path)
    except FormatError as error:
        raise InputError(str(error)) from error
    for cell in counts.cells:
        try:
            parse_cell(cell)
        except ValueError as error:
            raise InputError(f"{path}: {error}") from error
    return counts


def read_curate_stats(path: str) -> CurateStats | None:
    """curate's stats.json, or None where there is none (the page then counts what the folders hold)."""
    if not storage.exists(path):
        return None
    try:
        return read_stats(path)
    except FormatError as error:
        raise InputError(str(error)) from error


def read_domains_model(path: str) -> DomainsCard:
    """The card of a topic-domain model folder (or of its model.json); InputError names what is wrong."""
    card_path = path if path.endswith(".json") else storage.join(path, DOMAINS_CARD)
    if not storage.exists(card_path):
        raise InputError(f"{path}: no topic-domain model card ({DOMAINS_CARD}) here")
    try:
        return read_domains_card(card_path)
    except FormatError as error:
        raise InputError(str(error)) from error


def read_quality_calibration(path: str) -> Calibration | None:
    """A quality model's calibration.json (the folder's, or the file named); None where there is none, so
    that the page leaves the cut points out."""
    calibration_path = path if path.endswith(".json") else storage.join(path, CALIBRATION)
    if not storage.exists(calibration_path):
        return None
    try:
        return read_calibration(calibration_path)
    except FormatError as error:
        raise InputError(str(error)) from error


def quality_cut_rows(calibration: Calibration) -> list[dict[str, Any]]:
    """One row per content type (the calibration's domains; `*` is every type together, listed last)."""
    rows = []
    for content_type in sorted(calibration.cuts, key=lambda name: (name == "*", name)):
        cuts = calibration.cuts[content_type]
        rows.append(
            {
                "content_type": "all types (*)" if content_type == "*" else content_type,
                "key": content_type,
                "cuts": [round(cut, 4) for cut in cuts],
                "cuts_text": " · ".join(f"{cut:.3f}" for cut in cuts),
                "documents": calibration.documents.get(content_type),
            }
        )
    return rows


def _topic(entry: Any, preview_chars: int) -> dict[str, Any]:
    return {
        "name": entry.name,
        "terms": list(entry.terms),
        "sample_documents": entry.documents,
        "sample_share": f"{100 * entry.share:.1f}%",
        "cohesion": f"{entry.cohesion:.3f}",
        "fine_clusters": entry.fine_clusters,
        "examples": [
            {
                "id": example.id,
                "source": example.source,
                "cosine": f"{example.cosine:.3f}",
                "text": preview(example.preview, preview_chars)[0],
            }
            for example in entry.examples
        ],
    }


def _enrich(cards: list[dict[str, Any]], total_tokens: int) -> None:
    """Each card's Q0-Q4 split and each source's enrichment (share in the domain / share overall)."""
    overall: dict[str, float] = {}
    for card in cards:
        for source in card["sources"]:
            overall[source["name"]] = overall.get(source["name"], 0.0) + source["tokens"]
    for card in cards:
        card["topic"] = None  # a topic-domain model's entry, where one is given
        by_quality = {q["quality"]: q["tokens"] for q in card["qualities"]}
        card["quality_split"] = [
            {
                "quality": quality,
                "tokens": by_quality.get(quality, 0),
                "share": percent(by_quality.get(quality, 0), card["tokens"]),
            }
            for quality in QUALITY_BUCKETS
        ]
        for source in card["sources"]:
            inside = source["tokens"] / card["tokens"] if card["tokens"] else 0.0
            everywhere = overall[source["name"]] / total_tokens if total_tokens else 0.0
            enrichment = inside / everywhere if everywhere else None
            source["enrichment"] = None if enrichment is None else round(enrichment, 3)
            source["enrichment_text"] = "–" if enrichment is None else f"{enrichment:.2f}×"


def _cluster_sizes(scan: CellScan) -> dict[str, Any]:
    """A cell's duplicate-cluster sizes for the page: the histogram of `dup_cluster_size` (kept documents
    per size bin), the documents they stand for, and one line of text ("1×950 · 2×30 · 5-8×3")."""
    return {
        "cluster_sizes": scan.cluster_sizes,
        "represented": scan.represented,
        "cluster_sizes_text": histogram_text(scan.cluster_sizes),
    }


def _heldout(entry: CellCount | None) -> dict[str, Any]:
    """A cell's held-out slice for the page (tokens and documents set aside for evaluation; counts.json's
    `heldout_*`), or nothing where the tokens were made without held-out slices."""
    if entry is None or entry.heldout_tokens is None:
        return {"heldout_tokens": None, "heldout_text": "–"}
    return {
        "heldout_tokens": entry.heldout_tokens,
        "heldout_documents": entry.heldout_documents,
        "heldout_text": f"{format_count(entry.heldout_tokens)} ({entry.heldout_documents or 0:,} docs)",
    }


def build_overview(
    layout: CurateLayout,
    tokens_dir: str,
    counts: TokenCounts,
    plan: MixturePlan,
    previous_plan: MixturePlan | None,
    options: OverviewOptions,
) -> dict[str, Any]:
    """Everything the index page shows, as template context; `context["data"]` is published as JSON."""
    files = cell_files(layout.curated)
    stats = read_curate_stats(layout.stats)
    removed = scan_removed(layout.removed, examples=options.removed_examples, seed=options.seed)
    flagged = flagged_contamination(stats, removed)
    # Cells are scanned on a few threads: Parquet reading and decoding release the GIL (and on gs:// the
    # reads wait on the network), so files of one cell decode while another cell's rows are counted.
    # Memory: SCAN_THREADS cells' scans at a time (see scan_cell).
    with ThreadPoolExecutor(max_workers=SCAN_THREADS, thread_name_prefix="tokenmill-scan") as pool:
        scanned = pool.map(
            lambda item: scan_cell(
                item[0], item[1], samples=options.samples_per_cell, seed=options.seed, contamination=flagged
            ),
            files.items(),
        )
        scans: dict[str, CellScan] = dict(zip(files, scanned, strict=True))
    cell_tokens = {cell: entry.tokens for cell, entry in sorted(counts.cells.items())}
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
            count_entry = counts.cells.get(cell)
            tokens_in_cell = cell_tokens.get(cell, 0)
            docs_in_cell = (
                count_entry.documents
                if count_entry is not None and count_entry.documents is not None
                else scan.documents
            )
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
            if count_entry is not None:
                source_path = storage.join(tokens_dir, *counts.manifest_path(cell).split("/"))
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
                    "in_counts": count_entry is not None,
                    "in_curated": cell in scans,
                    "samples": [sample_row(row, cell, options.preview_chars) for row in scan.samples],
                    **_cluster_sizes(scan),
                    **_heldout(count_entry),
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
    _enrich(cards, total_tokens)
    topic_model = None
    if options.domains_model:
        model_card = read_domains_model(options.domains_model)
        entries = {entry.id: entry for entry in model_card.domains}
        for card in cards:
            entry = entries.get(card["name"])
            card["topic"] = _topic(entry, options.preview_chars) if entry is not None else None
            if entry is not None:
                card["search"] += " " + " ".join(entry.terms)
        on_page = {card["name"] for card in cards}
        topic_model = {
            "path": options.domains_model,
            "k": model_card.fine.k,
            "domains": len(model_card.domains),
            "sample_documents": model_card.sample.documents,
            "embedding": model_card.embedding.kind,
            "within": f"{model_card.within_domain_cosine:.3f}",
            "between": f"{model_card.between_domain_cosine:.3f}",
            "min_share": f"{100 * model_card.min_share:.1f}%",
            "not_on_page": [entry.id for entry in model_card.domains if entry.id not in on_page],
            "unknown_on_page": sorted(name for name in on_page if name not in entries),
        }
    calibration = read_quality_calibration(options.quality_model) if options.quality_model else None
    quality_cuts = quality_cut_rows(calibration) if calibration is not None else []
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
        "documents": (
            counts.total_documents
            if counts.total_documents is not None
            else sum(entry.documents or 0 for entry in counts.cells.values())
        ),
        "sources": len(all_sources),
        "domains": len(cards),
        "cells": len([c for c in all_cells if cell_tokens.get(c, 0) > 0]),
        "quality_buckets": len(present_qualities),
        "quality_list": ", ".join(str(q) for q in present_qualities),
        "tokenizer": counts.tokenizer.to_json() if counts.tokenizer else {},
    }

    rejected = scan_rejected(layout.rejected, examples=options.rejected_examples, seed=options.seed)
    contamination = (
        scan_contamination(
            removed,
            scans if flagged else None,
            files,
            examples=options.removed_examples,
            seed=options.seed,
        )
        if stats is not None and stats.stages.get(DECONTAM)
        else None
    )
    funnel = build_funnel(stats, removed, rejected, options, contamination)
    boilerplate = boilerplate_section(stats, options.preview_chars)
    duplicates = duplicates_section(scans, stats)
    personal_data = personal_data_section(stats, scans, scan_removed_pii(removed))
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
                "cluster_sizes": q["cluster_sizes"],
                "represented_documents": q["represented"],
                "pii": (scans[q["cell"]].pii or None) if q["cell"] in scans else None,
            }
            for card in cards
            for q in card["qualities"]
        },
        "domains": {
            card["name"]: {
                "tokens": card["tokens"],
                "documents": card["documents"],
                "quality_split": {f"q{q['quality']}": q["tokens"] for q in card["quality_split"]},
                "sources": {
                    s["name"]: {
                        "documents": s["documents"],
                        "characters": s["characters"],
                        "tokens_estimated": s["tokens"],
                        "enrichment": s["enrichment"],
                    }
                    for s in card["sources"]
                },
                **(
                    {"terms": card["topic"]["terms"], "topic_name": card["topic"]["name"]}
                    if card.get("topic")
                    else {}
                ),
            }
            for card in cards
        },
        "sources": {
            name: {
                "documents": total.documents,
                "characters": total.characters,
                "cluster_sizes": total.cluster_sizes or None,
                "represented_documents": total.represented if total.cluster_sizes else None,
                "pii": total.pii or None,
            }
            for name, total in totals_by_source(scans).items()
        },
        **({"topic_model": topic_model} if topic_model else {}),
        **({"quality_cuts": {row["key"]: row["cuts"] for row in quality_cuts}} if quality_cuts else {}),
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
        "boilerplate": boilerplate,
        "duplicates": duplicates,
        "personal_data": personal_data,
        "mixture": mixture,
        "samples": samples,
        "sample_total": len(samples),
        "manifests": manifests,
        "stats_path": layout.stats if stats is not None else None,
        "data": data,
        "quality_colors": QUALITY_COLORS,
        "topic_model": topic_model,
        "quality_cuts": quality_cuts,
        "quality_cuts_source": options.quality_model if quality_cuts else None,
    }


def flagged_contamination(stats: CurateStats | None, removed: dict[str, Any]) -> bool:
    """Whether the decontam stage flagged (kept) documents: it matched more documents of some evaluation
    set than removed/ holds for that set. Only then is curated/'s metadata read for them."""
    decontam = (stats.stages.get(DECONTAM) if stats else None) or {}
    sets = decontam.get("eval_sets") if isinstance(decontam.get("eval_sets"), dict) else {}
    if not sets:
        return False
    removed_only = scan_contamination(removed, None, {}, examples=0, seed=0)
    return any(
        isinstance(entry, dict) and int(entry.get("documents", 0)) > removed_only.removed.get(name, 0)
        for name, entry in sets.items()
    )


def build_funnel(
    stats: CurateStats | None,
    removed: dict[str, Any],
    rejected: dict[str, dict[str, Any]],
    options: OverviewOptions,
    contamination: ContaminationScan | None = None,
) -> dict[str, Any]:
    """Documents and tokens after each stage, removals by reason with examples, rejected input by kind,
    contamination per evaluation set (with `contamination`'s examples) and the input sources."""
    stages = []
    if stats:
        previous = None
        for stage in stats.funnel:
            stages.append(
                {
                    "stage": stage.stage,
                    "documents": stage.documents,
                    "characters": stage.characters,
                    "tokens_estimated": stage.tokens_estimated,
                    "tokens_text": format_count(stage.tokens_estimated),
                    "share": percent(stage.documents, stats.read.documents),
                    "dropped": None if previous is None else previous - stage.documents,
                }
            )
            previous = stage.documents
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
    by_reason = stats.removed_by_reason if stats else {}
    reasons = []
    for key in sorted(set(by_reason) | set(removed)):
        counted = by_reason.get(key)
        scanned = removed.get(key)
        stage, _, reason = key.partition("/")
        tokens_estimated = counted.tokens_estimated if counted else 0
        reasons.append(
            {
                "key": key,
                "anchor": "removed-" + "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in key),
                "stage": counted.stage if counted else stage,
                "reason": counted.reason if counted else reason,
                "documents": counted.documents if counted else (scanned.documents if scanned else 0),
                "tokens_estimated": tokens_estimated,
                "tokens_text": format_count(tokens_estimated),
                "examples": [
                    {
                        **sample_row(row, "", options.preview_chars),
                        "detail": _detail_text(row.get("detail")),
                    }
                    for row in (scanned.examples if scanned else [])
                ],
            }
        )
    reasons.sort(key=lambda r: (-r["documents"], r["key"]))
    by_error = stats.rejected_by_error if stats else {}
    rejected_rows = []
    for kind in sorted(set(by_error) | set(rejected)):
        scanned = rejected.get(kind) or {}
        rejected_rows.append(
            {
                "kind": kind,
                "documents": by_error[kind].documents if kind in by_error else scanned.get("documents", 0),
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
        for key, entry in (
            ("read", stats.read),
            ("kept", stats.kept),
            ("removed", stats.removed),
            ("rejected", stats.rejected),
        ):
            tokens = getattr(entry, "tokens_estimated", 0)  # rejected input has no text to count
            totals[key] = {
                "documents": entry.documents,
                "tokens_estimated": tokens,
                "tokens_text": format_count(tokens),
            }
    return {
        "present": stats is not None,
        "stages": stages,
        "chart": chart,
        "reasons": reasons,
        "rejected": rejected_rows,
        "contamination": contamination_rows(stats, contamination, options.preview_chars),
        "totals": totals,
        "balanced": None if stats is None else stats.balanced,
        "sources": source_rows(stats),
        "recipe": stats.recipe if stats else None,
        "chars_per_token": stats.chars_per_token if stats else None,
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
    plan: MixturePlan, previous: MixturePlan | None, cell_tokens: dict[str, int]
) -> dict[str, Any]:
    """Phases with their budgets and boundaries, per-source and per-cell tables, and the diff."""
    phases = []
    for i, phase in enumerate(plan.phases):
        sources = []
        for j, source in enumerate(phase.sources):
            sources.append(
                {
                    "name": source.name,
                    "cells": list(source.cells),
                    "weight": source.weight,
                    "weight_text": f"{100 * source.weight:.2f}%",
                    "tokens": source.tokens,
                    "tokens_text": format_count(source.tokens),
                    "available_text": format_count(source.tokens_available),
                    "epochs": source.epochs,
                    "epochs_text": f"{source.epochs:.2f}",
                    "repeated": source.epochs > 1.0,
                    "color": svg.category_color(j),
                }
            )
        phases.append(
            {
                "index": i,
                "name": phase.name,
                "tokens_text": format_count(phase.tokens),
                "share": percent(phase.tokens, plan.total_tokens),
                "steps": phase.steps,
                "start_step": phase.start_step,
                "end_step": phase.end_step,
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
        raw = plan_changes(previous, plan)
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
            "previous_name": previous.name,
        }
    return {
        "name": plan.name,
        "tokenizer": plan.tokenizer,
        "total_tokens_text": format_count(plan.total_tokens),
        "sequence_length": plan.sequence_length,
        "batch_size": plan.batch_size,
        "block_size": plan.block_size,
        "tokens_per_step": plan.tokens_per_step,
        "total_steps": plan.total_steps or max((p["end_step"] for p in phases), default=0),
        "description": plan.description,
        "warnings": list(plan.warnings),
        "illustrative": bool(plan.illustrative),
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
