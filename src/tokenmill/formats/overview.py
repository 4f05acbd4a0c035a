"""The data-overview page's numbers, `site/data/overview.json` (docs/reports.md, "What the site holds"):
tokens, documents and sample ids per cell, sources per domain, duplicate clusters and personal data per
cell and per source, as `tokenmill report` publishes them.

Written through `OverviewData` (reports/site.py), so that a key added to the page's data without a field
here is an error naming it, not a file that drifts from its readers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ConfigDict

from tokenmill.formats.base import Count, FormatModel, parse, read_model

OVERVIEW = "overview.json"
FORMAT_VERSION = 1


class _Written(FormatModel):
    """A record this project writes: an unknown key is an error, never dropped on the way out."""

    model_config = ConfigDict(extra="forbid")


class OverviewHeadline(_Written):
    tokens: Count
    documents: Count
    sources: Count
    domains: Count
    cells: Count  # cells with tokens
    quality_buckets: Count  # quality buckets with tokens
    tokenizer: dict[str, Any]  # counts.json's tokenizer record, {} when it names none


class OverviewCell(_Written):
    tokens: Count
    documents: Count
    curated_documents: Count
    characters: Count
    manifest: str | None  # the published copy of the cell's manifest, None when the cell has none
    samples: list[str]  # the ids of the sample documents shown
    cluster_sizes: dict[str, Count] | None = None  # curated documents per dedupe-cluster-size bin
    represented_documents: Count | None = None  # documents the curated ones stand for, duplicates included
    #: The `pii` column summed: finds per kind, documents_checked and documents_with_pii; None without it.
    pii: dict[str, Count] | None = None


class OverviewSource(_Written):
    documents: Count
    characters: Count
    tokens_estimated: Count  # the cell's tokens shared out by characters
    enrichment: float | None  # share in the domain / share overall; None without tokens


class OverviewSourceTotals(_Written):
    """One input source over every curated cell (the overview's per-source sections)."""

    documents: Count
    characters: Count
    cluster_sizes: dict[str, Count] | None = None  # as OverviewCell's, None without dup_cluster_size
    represented_documents: Count | None = None
    pii: dict[str, Count] | None = None  # as OverviewCell's


class OverviewDomain(_Written):
    tokens: Count
    documents: Count
    quality_split: dict[str, Count]  # tokens per quality bucket, "q0".."q4"
    sources: dict[str, OverviewSource]
    terms: list[str] | None = None  # with a topic-domains model
    topic_name: str | None = None


class OverviewTopicModel(_Written):
    path: str
    k: Count
    domains: Count
    sample_documents: Count
    embedding: str
    within: str
    between: str
    min_share: str
    not_on_page: list[str]
    unknown_on_page: list[str]


class OverviewOptions(_Written):
    seed: int
    samples_per_cell: Count
    preview_chars: Count


class OverviewData(_Written):
    format_version: int
    headline: OverviewHeadline
    cells: dict[str, OverviewCell]
    domains: dict[str, OverviewDomain]
    #: Per input source, over all cells; absent in pages written before issue 34.
    sources: dict[str, OverviewSourceTotals] | None = None
    topic_model: OverviewTopicModel | None = None
    quality_cuts: dict[str, list[float]] | None = None  # per content type, the quality-bucket cuts
    options: OverviewOptions


def read_overview(path: str) -> OverviewData:
    """A site's data/overview.json; FormatError naming the file and the field."""
    return read_model(OverviewData, path)


def checked_overview(data: Mapping[str, Any]) -> dict[str, Any]:
    """The page's numbers checked against `OverviewData`, as the JSON object to publish (FormatError names
    the field that does not fit)."""
    return parse(OverviewData, dict(data), f"data/{OVERVIEW}").to_json()
