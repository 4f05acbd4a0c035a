"""Curated and removed documents (docs/formats.md, "Curated documents", "Removed documents"): the Parquet
schema that curate writes and every later stage reads.

Kept here, apart from the Beam pipelines, so that the tokenizer, the reports and the trainer can read
curated output without importing Beam. Columns and types are those of docs/formats.md.
"""

from __future__ import annotations

import re

import pyarrow as pa
import pyarrow.dataset as ds

#: The `pii` column's type: finds per kind (tokenmill.filters.pii.PLACEHOLDERS' kinds, in this order).
PII_KINDS = ("email", "phone", "ip", "credit_card", "iban")
PII_COUNTS = pa.struct([(kind, pa.int32()) for kind in PII_KINDS])

DOCUMENT_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("text", pa.string()),
        ("source", pa.string()),
        ("url", pa.string()),
        ("metadata", pa.string()),
        ("language", pa.string()),
        ("language_score", pa.float32()),
        ("quality_score", pa.float32()),
        ("quality", pa.int8()),
        ("domain", pa.string()),
        ("domain_score", pa.float32()),
        ("n_chars", pa.int64()),
        ("n_words", pa.int64()),
        ("dup_cluster", pa.string()),
        # Documents this one stands for: itself, its exact copies and near duplicates, transitively
        # (tokenmill.pipelines.dedupe_clusters); 1 without duplicates, null in removed/.
        ("dup_cluster_size", pa.int64()),
        # Personal data found per kind by the pii stage (tokenmill.filters.pii): masked or flagged in a kept
        # document, in the text of a removed one; null where no pii stage ran.
        ("pii", PII_COUNTS),
    ]
)
#: The column of DOCUMENT_SCHEMA that says how many documents a kept document stands for.
CLUSTER_SIZE = "dup_cluster_size"
#: The column of DOCUMENT_SCHEMA with a document's personal-data finds per kind.
PII = "pii"


def cluster_size_bin(size: int) -> str:
    """The histogram bin of a duplicate-cluster size: "1" .. "4", then powers of two ("5-8", "9-16", ...):
    the bins of fuzzy dedupe's `component_sizes`."""
    if size <= 4:
        return str(size)
    upper = 1 << (size - 1).bit_length()
    return f"{upper // 2 + 1}-{upper}"


#: What separates a document's paragraphs: a blank line (one holding only spaces or tabs counts).
_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n\s*")


def split_paragraphs(text: str) -> list[str]:
    """A text's paragraphs, separated by blank lines: how the decontam stage counts a match's
    `paragraph` (in removed/ `detail` and kept `metadata`), and how the overview page finds it again."""
    return _PARAGRAPH_BREAK.split(text)


#: removed/ rows: the document columns plus `detail`, JSON saying why in numbers.
REMOVED_SCHEMA = DOCUMENT_SCHEMA.append(pa.field("detail", pa.string()))

# The cell is in the path and in the file; naming the partition types makes the two agree (pyarrow would
# otherwise infer dictionary<int32> for `quality` from the path and refuse to merge it with int8).
CURATED_PARTITIONING = ds.partitioning(
    pa.schema([("domain", pa.string()), ("quality", pa.int8())]), flavor="hive"
)
REMOVED_PARTITIONING = ds.partitioning(
    pa.schema([("stage", pa.string()), ("reason", pa.string())]), flavor="hive"
)


def curated_dataset(path: str) -> ds.Dataset:
    """All of curated/ (or one cell folder) as a pyarrow dataset."""
    return ds.dataset(path, format="parquet", schema=DOCUMENT_SCHEMA, partitioning=CURATED_PARTITIONING)


def removed_dataset(path: str) -> ds.Dataset:
    """All of removed/ as a pyarrow dataset, with `stage` and `reason` columns from the path."""
    schema = REMOVED_SCHEMA.append(pa.field("stage", pa.string())).append(pa.field("reason", pa.string()))
    return ds.dataset(path, format="parquet", schema=schema, partitioning=REMOVED_PARTITIONING)
