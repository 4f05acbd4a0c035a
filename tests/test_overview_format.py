"""The page's data/overview.json has a typed model (tokenmill.formats.overview) that `tokenmill report` writes
through: what it publishes is checked field by field, and a key without a field is refused, named."""

from __future__ import annotations

import copy

import pytest

from tokenmill.errors import FormatError
from tokenmill.formats.overview import checked_overview, read_overview
from tokenmill.storage import write_json

CELL = "domain=web/quality=3"
DATA = {
    "format_version": 1,
    "headline": {"tokens": 120, "documents": 3, "sources": 1, "domains": 1, "cells": 1, "quality_buckets": 1,
                 "tokenizer": {"name": "bpe", "sha256": "ab" * 32, "vocab_size": 4096}},
    "cells": {CELL: {"tokens": 120, "documents": 3, "curated_documents": 3, "characters": 480,
                     "manifest": f"data/tokens/{CELL}/manifest.json", "samples": ["a", "b"],
                     "cluster_sizes": {"1": 3}, "represented_documents": 3,
                     "pii": {"email": 2, "phone": 0, "ip": 0, "credit_card": 0, "iban": 0,
                             "documents_checked": 3, "documents_with_pii": 1}}},
    "domains": {"web": {"tokens": 120, "documents": 3, "quality_split": {"q3": 120},
                        "sources": {"crawl.jsonl": {"documents": 3, "characters": 480,
                                                    "tokens_estimated": 120, "enrichment": 1.0}}}},
    "sources": {"crawl.jsonl": {"documents": 3, "characters": 480, "cluster_sizes": {"1": 3},
                                "represented_documents": 3, "pii": None}},
    "quality_cuts": {"*": [0.2, 0.4, 0.6, 0.8]},
    "options": {"seed": 0, "samples_per_cell": 2, "preview_chars": 400},
}  # fmt: skip


def test_the_overview_round_trips_through_its_model(tmp_path):
    assert checked_overview(DATA) == DATA
    path = tmp_path / "overview.json"
    write_json(str(path), DATA)
    overview = read_overview(str(path))
    assert (
        overview.cells[CELL].tokens == 120
        and overview.domains["web"].sources["crawl.jsonl"].enrichment == 1.0
    )


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda d: d["cells"][CELL].update(colour="red"), f"cells.{CELL}.colour"),
        (lambda d: d["headline"].update(tokens=-1), "headline.tokens"),
        (lambda d: d["domains"]["web"].pop("quality_split"), "domains.web has no 'quality_split'"),
        (lambda d: d["sources"]["crawl.jsonl"].update(licence="MIT"), "sources.crawl.jsonl.licence"),
        (lambda d: d["cells"][CELL]["pii"].update(email=-2), f"cells.{CELL}.pii.email"),
    ],
    ids=["unknown key", "negative count", "missing field", "unknown source key", "negative finds"],
)
def test_a_page_number_that_does_not_fit_is_named(change, field):
    data = copy.deepcopy(DATA)
    change(data)
    with pytest.raises(FormatError, match="data/overview.json") as error:
        checked_overview(data)
    assert field in str(error.value)
