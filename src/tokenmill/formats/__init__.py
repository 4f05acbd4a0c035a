"""The files that connect the stages, one module per section of docs/formats.md.

  documents  curated/ and removed/ Parquet: the document schema and datasets (pyarrow)
  stats      stats.json, curate's account of a run
  rejected   rejected/*.jsonl.zst, input that is not a document
  tokens     token shards' manifest.json, done markers and tokens/counts.json
  plan       the mixture plan (`tokenmill mixture plan --json`)
  runs       runs/NAME/metrics.jsonl and config.json
  events     runs/NAME/events.jsonl, what happened to a run besides its steps
  cards      classifier models' model.json and calibration.json

Each gives typed records (pydantic) with `read_*(path)` and `write_*(path, record)` through
tokenmill.storage (local paths and gs://). Readers validate: a file that breaks its format raises
`tokenmill.errors.FormatError` naming the file and the field. Writers give the same bytes for the same
content. No stage parses these files itself; this package imports only storage and errors below it, so
that any stage may import it.
"""

from tokenmill.errors import FormatError

__all__ = ["FormatError"]
