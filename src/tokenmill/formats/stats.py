"""stats.json, curate's account of a run (docs/formats.md, "stats.json"): what was read, kept, removed and
rejected, per stage, reason, cell and source, and the files written. Written last: its presence marks a
finished run.
"""

from __future__ import annotations

from typing import Any, Literal

from tokenmill.formats.base import Count, FormatModel, read_model, write_model

STATS = "stats.json"
FORMAT_VERSION = 1


class Totals(FormatModel):
    documents: Count
    characters: Count
    tokens_estimated: Count


class DocumentCount(FormatModel):
    documents: Count


class FunnelStage(FormatModel):
    """What is left after a stage; `removed_documents` (what the stage removed) is left out for "read"."""

    stage: str
    documents: Count
    characters: Count
    tokens_estimated: Count
    removed_documents: Count | None = None


class RemovedReason(FormatModel):
    stage: str
    reason: str
    documents: Count
    characters: Count
    tokens_estimated: Count


class SourceOutcomes(FormatModel):
    """Documents of one input file by where they went, and what is known of its origin: the license and
    provenance the recipe's `sources:` table gives it, and the documents read per license that its
    records name (the recipe's `fields.license`). The last three are absent where nothing says."""

    read: Count
    kept: Count
    removed: Count
    rejected: Count
    license: str | None = None
    provenance: str | None = None
    licenses: dict[str, Count] = {}


class CurateStats(FormatModel):
    """stats.json. `files` and `stages` are empty in a file written before they existed."""

    format_version: Literal[1]
    recipe: str
    recipe_name: str | None = None
    inputs: list[str]
    chars_per_token: float
    read: Totals
    kept: Totals
    removed: Totals
    rejected: DocumentCount
    balanced: bool
    funnel: list[FunnelStage]
    removed_by_reason: dict[str, RemovedReason]
    rejected_by_error: dict[str, DocumentCount]
    cells: dict[str, Totals]
    sources: dict[str, SourceOutcomes]
    #: Every file the run wrote (relative to the output folder) with its row count.
    files: dict[str, Count] = {}
    #: What stages that compare documents report about themselves (numbers, nested by name).
    stages: dict[str, dict[str, Any]] = {}


def read_stats(path: str) -> CurateStats:
    """stats.json at `path`; FormatError names the file and field that break the format."""
    return read_model(CurateStats, path)


def write_stats(path: str, stats: CurateStats) -> None:
    write_model(path, stats)
