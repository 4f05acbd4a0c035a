"""The overview page's curation sections beside the funnel: what line-level boilerplate removal took, the
duplicate clusters, contamination per evaluation set, personal data, and each source's license and
provenance.

Each function turns records into rows for the template: the stages' own numbers from stats.json
(`stages.line_boilerplate`, `stages.dedupe_clusters`, `stages.decontam`, `stages.pii`, `sources`), and what
the curated and removed files hold, as tokenmill.reports.inputs scans them (per source and cell: cluster
sizes, personal-data finds; matched documents per evaluation set). Text from the records (repeated lines,
licenses, excerpts) is handed to the template as it is, to be escaped there. Tables with a row per source
show the MAX_SOURCE_ROWS that matter most; data/overview.json has every source.
"""

from __future__ import annotations

from typing import Any

from tokenmill.formats.documents import PII_KINDS, split_paragraphs
from tokenmill.formats.stats import CurateStats
from tokenmill.reports import svg
from tokenmill.reports.display import percent, preview, safe_href, sample_row
from tokenmill.reports.inputs import (
    CellScan,
    ContaminationScan,
    SourceCount,
    add_numbers,
    sorted_bins,
)

#: The stages whose statistics these sections read (stats.json `stages.<name>`).
BOILERPLATE, CLUSTERS, DECONTAM, PII = "line_boilerplate", "dedupe_clusters", "decontam", "pii"
#: Rows of a per-source table on the page (the sources with the most to show; all in overview.json).
MAX_SOURCE_ROWS = 100
#: What the decontam stage calls its matches, strongest first (tokenmill.filters.decontam.stage.KINDS).
MATCH_KINDS = ("verbatim", "edited", "partial")
#: What the pii stage did with the finds of a kind (stats.json `stages.pii.<kind>`).
PII_OUTCOMES = ("masked", "flagged", "removed", "reserved")
#: The dedupe_clusters numbers the duplicates section lists, with what each is.
CLUSTER_NUMBERS = (
    ("removals_followed", "dedupe removals followed to their final kept document"),
    ("kept_id_moved", "of those, pointing past a document removed later"),
    ("removed_with_representative", "filed with the stage that removed their representative"),
    ("clusters", "kept documents with duplicates (clusters of 2 or more)"),
    ("documents_in_clusters", "documents those clusters stand for"),
    ("largest_cluster", "largest cluster"),
)


def _number(value: Any) -> int:
    """A count from a stage's statistics (untyped in stats.json): 0 where it is not a number."""
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0


def _stage(stats: CurateStats | None, name: str) -> dict[str, Any]:
    entry = stats.stages.get(name) if stats else None
    return entry if isinstance(entry, dict) else {}


def histogram_text(histogram: dict[str, int]) -> str:
    """One line of a cluster-size histogram: "1×950 · 2×30 · 5-8×3"."""
    return " · ".join(f"{size_bin}×{count:,}" for size_bin, count in histogram.items())


def totals_by_source(scans: dict[str, CellScan]) -> dict[str, SourceCount]:
    """Each source's counts summed over the cells (documents, characters, cluster sizes, pii)."""
    totals: dict[str, SourceCount] = {}
    for scan in scans.values():
        for name, count in scan.sources.items():
            total = totals.setdefault(name, SourceCount())
            total.documents += count.documents
            total.characters += count.characters
            total.represented += count.represented
            add_numbers(total.cluster_sizes, count.cluster_sizes)
            add_numbers(total.pii, count.pii)
    for total in totals.values():
        total.cluster_sizes = sorted_bins(total.cluster_sizes)
    return dict(sorted(totals.items()))


def boilerplate_section(stats: CurateStats | None, preview_chars: int) -> dict[str, Any] | None:
    """What line_boilerplate removed, in all and per source, with each source's most repeated lines
    (stats.json `stages.line_boilerplate`; `sources` is there from issue 34 on). None without the stage."""
    stage = _stage(stats, BOILERPLATE)
    if not stage:
        return None
    reported = stage.get("sources") if isinstance(stage.get("sources"), dict) else {}
    ranked = sorted(reported.items(), key=lambda item: (-_number(item[1].get("characters_removed")), item[0]))
    rows = []
    for position, (name, entry) in enumerate(ranked[:MAX_SOURCE_ROWS]):
        counted = _number(entry.get("documents_counted"))
        characters = _number(entry.get("characters"))
        lines = entry.get("top_lines") if isinstance(entry.get("top_lines"), list) else []
        rows.append(
            {
                "name": name,
                "anchor": f"boilerplate-{position}",
                **{
                    key: _number(entry.get(key))
                    for key in ("documents", "lines_removed", "documents_edited", "documents_removed")
                },
                "characters": characters,
                "characters_removed": _number(entry.get("characters_removed")),
                "share": percent(_number(entry.get("characters_removed")), characters),
                "frequent_lines": _number(entry.get("frequent_lines")),
                "documents_counted": counted,
                "top_lines": [
                    {
                        "text": None if line.get("text") is None else preview(line["text"], preview_chars)[0],
                        "documents": _number(line.get("documents")),
                        "share": percent(_number(line.get("documents")), counted),
                    }
                    for line in lines
                    if isinstance(line, dict)
                ],
            }
        )
    read_characters = stats.read.characters if stats else 0
    return {
        **{
            key: _number(stage.get(key))
            for key in (
                "documents_counted",
                "frequent_lines",
                "sources_with_boilerplate",
                "lines_removed",
                "characters_removed",
                "documents_edited",
                "documents_removed",
            )
        },
        "share_of_read": percent(_number(stage.get("characters_removed")), read_characters),
        "sources": rows,
        "reported": len(reported),
        "has_report": "sources" in stage,
    }


def duplicates_section(scans: dict[str, CellScan], stats: CurateStats | None) -> dict[str, Any] | None:
    """Duplicate-cluster sizes over every cell (the `dup_cluster_size` column) as a chart, the
    dedupe_clusters stage's numbers and histogram, and per source the kept documents, the documents they
    stand for and their cluster sizes. None where no curated file has the column."""
    histogram: dict[str, int] = {}
    for scan in scans.values():
        add_numbers(histogram, scan.cluster_sizes)
    if not histogram:
        return None
    histogram = sorted_bins(histogram)
    kept = sum(histogram.values())
    represented = sum(scan.represented for scan in scans.values())
    chart = svg.bar_chart(
        [svg.Bar(f"size {size_bin}", count, f"{count:,} docs") for size_bin, count in histogram.items()],
        title="Kept documents per duplicate-cluster size (log scale)",
        width=720,
        log=True,
    )
    stage = _stage(stats, CLUSTERS)
    numbers = [
        {"key": key, "label": label, "value": _number(stage[key])}
        for key, label in CLUSTER_NUMBERS
        if key in stage
    ]
    stage_sizes = stage.get("cluster_sizes") if isinstance(stage.get("cluster_sizes"), dict) else {}
    sources = []
    for name, total in totals_by_source(scans).items():
        if not total.cluster_sizes:
            continue
        in_clusters = sum(count for size_bin, count in total.cluster_sizes.items() if size_bin != "1")
        sources.append(
            {
                "name": name,
                "documents": total.documents,
                "represented": total.represented,
                "duplicates": total.represented - total.documents,
                "share": percent(total.represented - total.documents, total.represented),
                "in_clusters": in_clusters,
                "sizes_text": histogram_text(total.cluster_sizes),
            }
        )
    sources.sort(key=lambda row: (-row["duplicates"], row["name"]))
    return {
        "chart": chart,
        "kept": kept,
        "represented": represented,
        "duplicates": represented - kept,
        "share": percent(represented - kept, represented),
        "histogram_text": histogram_text(histogram),
        "stage_numbers": numbers,
        "stage_sizes_text": histogram_text(sorted_bins({str(k): _number(v) for k, v in stage_sizes.items()})),
        "sources": sources[:MAX_SOURCE_ROWS],
        "source_count": len(sources),
    }


def _excerpt(row: dict[str, Any], paragraph: Any, preview_chars: int) -> tuple[str, bool]:
    """The matched paragraph of a document's text (the decontam match's `paragraph`, counted at blank
    lines), cut to preview_chars; the text's start where the paragraph is not there."""
    text = "" if row.get("text") is None else str(row["text"])
    paragraphs = split_paragraphs(text)
    if isinstance(paragraph, int) and 0 <= paragraph < len(paragraphs):
        text = paragraphs[paragraph]
    return preview(text, preview_chars)


def contamination_rows(
    stats: CurateStats | None, scan: ContaminationScan | None, preview_chars: int
) -> list[dict[str, Any]]:
    """Documents matched per evaluation set (benchmark) by the decontam stage (stats.json:
    stages.decontam), with how each matched: `verbatim`, `edited` (most of an item, a few words changed)
    or `partial` (a long passage quoted in part); docs/decontam.md. With `scan`, how many were removed
    and how many flagged (kept), and examples: the matched paragraph of each."""
    decontam = _stage(stats, DECONTAM)
    checked = _number(decontam.get("documents"))
    sets = decontam.get("eval_sets") if isinstance(decontam.get("eval_sets"), dict) else {}
    rows = []
    for name, entry in sorted(sets.items()):
        documents = _number(entry.get("documents"))
        share = f"{100 * documents / checked:.2g}%" if checked else "–"  # tiny shares keep their digits
        kinds = {kind: _number(entry.get(kind)) for kind in MATCH_KINDS}
        removed = scan.removed.get(name, 0) if scan else None
        flagged = None
        if scan is not None:
            flagged = scan.flagged.get(name, 0) if scan.flagged_scanned else max(0, documents - removed)
        examples = []
        for position, row in enumerate(scan.examples.get(name, []) if scan else []):
            match = row["match"]
            text, cut = _excerpt(row, match.get("paragraph"), preview_chars)
            examples.append(
                {
                    **sample_row(row, "", preview_chars),
                    "text": text,
                    "truncated": cut,
                    "action": row["action"],
                    "match": str(match.get("match", "")),
                    "coverage": f"{100 * float(match.get('coverage') or 0):.0f}%",
                    "words": f"{_number(match.get('words'))} of {_number(match.get('of'))} words",
                    "record": f"{match.get('file', '')}:{match.get('line', '')}",
                    "paragraph": match.get("paragraph"),
                    "position": position,
                }
            )
        rows.append(
            {
                "eval_set": name,
                "anchor": f"contamination-{len(rows)}",
                "documents": documents,
                "share": share,
                "checked": checked,
                "removed": removed,
                "flagged": flagged,
                "examples": examples,
                **kinds,
            }
        )
    return rows


def personal_data_section(
    stats: CurateStats | None, scans: dict[str, CellScan], removed: dict[str, dict[str, int]]
) -> dict[str, Any] | None:
    """Personal data per kind as the pii stage counted it (stats.json `stages.pii`: masked, flagged,
    removed, reserved), and the finds per cell and per source in the kept documents (the `pii` column),
    with the documents removed per source (removed/stage=pii). None without a pii stage."""
    stage = _stage(stats, PII)
    cells = {cell: scan.pii for cell, scan in scans.items() if scan.pii}
    if not stage and not cells and not removed:
        return None
    kinds = []
    for kind in PII_KINDS:
        entry = stage.get(kind) if isinstance(stage.get(kind), dict) else {}
        kinds.append({"kind": kind, **{outcome: _number(entry.get(outcome)) for outcome in PII_OUTCOMES}})
    cell_rows = [
        {
            "cell": cell,
            "checked": numbers.get("documents_checked", 0),
            "with_pii": numbers.get("documents_with_pii", 0),
            "share": percent(numbers.get("documents_with_pii", 0), numbers.get("documents_checked", 0)),
            "finds": [numbers.get(kind, 0) for kind in PII_KINDS],
        }
        for cell, numbers in cells.items()
        if numbers.get("documents_with_pii", 0)
    ]
    sources = []
    totals = totals_by_source(scans)
    for name in sorted(set(totals) | set(removed)):
        kept = totals[name].pii if name in totals else {}
        gone = removed.get(name, {})
        if not kept.get("documents_with_pii") and not gone.get("documents_checked"):
            continue
        sources.append(
            {
                "name": name,
                "checked": kept.get("documents_checked", 0),
                "with_pii": kept.get("documents_with_pii", 0),
                "finds": [kept.get(kind, 0) for kind in PII_KINDS],
                "removed": gone.get("documents_checked", 0),
                "removed_finds": sum(gone.get(kind, 0) for kind in PII_KINDS),
            }
        )
    sources.sort(key=lambda row: (-(row["with_pii"] + row["removed"]), row["name"]))
    return {
        "kinds": kinds,
        "kind_names": list(PII_KINDS),
        **{
            key: _number(stage.get(key))
            for key in ("documents", "documents_with_pii", "documents_masked", "documents_removed")
        },
        "has_stage": bool(stage),
        "cells": cell_rows,
        "cells_without": len(cells) - len(cell_rows),
        "sources": sources[:MAX_SOURCE_ROWS],
        "source_count": len(sources),
    }


def source_rows(stats: CurateStats | None) -> list[dict[str, Any]]:
    """Every input source of stats.json: where its documents went, its license and provenance (the
    recipe's `sources:` table; a provenance that is an http(s) URL becomes a link), and the documents read
    per license its records name."""
    rows = []
    for name, outcomes in sorted((stats.sources if stats else {}).items()):
        licenses = sorted(outcomes.licenses.items(), key=lambda item: (-item[1], item[0]))
        rows.append(
            {
                "name": name,
                **{key: getattr(outcomes, key) for key in ("read", "kept", "removed", "rejected")},
                "license": outcomes.license or "",
                "provenance": outcomes.provenance or "",
                "provenance_href": safe_href(outcomes.provenance),
                "licenses_text": " · ".join(f"{license} ×{count:,}" for license, count in licenses),
            }
        )
    return rows
