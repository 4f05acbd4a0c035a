"""Runs (docs/formats.md, "Runs"): `runs/<name>/metrics.jsonl`, one JSON object per logged step, and
`runs/<name>/config.json`, the run's resolved settings and what the trainer records about it.

The metrics keys the format fixes are typed on read; a row may carry more (the trainer also logs its
objective and router losses), and a run that did not log a key (MFU on a CPU, router metrics of a dense
model) simply lacks it. NaN losses are kept as NaN: a run that diverged shows it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

from pydantic import ConfigDict

from tokenmill import storage
from tokenmill.errors import FormatError
from tokenmill.formats.base import Count, FormatModel, load_json, parse

METRICS = "metrics.jsonl"
CONFIG = "config.json"


class MetricsRow(FormatModel):
    """One logged step. Keys beyond these are kept (`row.model_extra`) and written back as they came."""

    model_config = ConfigDict(extra="allow")

    step: Count
    phase: str | None = None
    loss: float | None = None
    lr: float | None = None
    tokens: Count | None = None  # cumulative
    tokens_per_second: float | None = None
    flops: float | None = None  # cumulative
    mfu: float | None = None
    grad_norm: float | None = None
    param_norm: float | None = None
    router_bias_norm: list[float] | None = None  # one per MoE layer
    expert_load: list[list[float]] | None = None  # per MoE layer, per expert: fraction of routed tokens
    drop_fraction: float | None = None
    time: float | None = None  # seconds since the start

    def value(self, key: str) -> Any:
        """The value logged under `key`, or None when this step did not log it."""
        return getattr(self, key, None)


def parse_metrics_line(line: str | bytes, origin: str) -> MetricsRow:
    """One line of metrics.jsonl; FormatError naming `origin` (file and line) if it is not a metrics row."""
    try:
        value = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise FormatError(origin, f"not JSON ({error})") from None
    return parse(MetricsRow, value, origin)


def metrics_line(row: Mapping[str, Any]) -> str:
    """A row as its line of metrics.jsonl (keys in the order given, NaN as NaN), checked first."""
    parse(MetricsRow, dict(row), METRICS)
    return json.dumps(row) + "\n"


def iter_metrics(path: str) -> Iterator[tuple[int, MetricsRow]]:
    """(line number, row) for each row of a metrics.jsonl, in file order; FormatError names the file and
    line of a bad row."""
    with storage.open_file(path, "rb") as handle:
        for number, line in enumerate(handle.read().splitlines(), start=1):
            if line.strip():
                yield number, parse_metrics_line(line, f"{path}: line {number}")


def read_metrics(path: str) -> list[MetricsRow]:
    """Every row of a metrics.jsonl, in step order (a step logged again after a resume: in file order)."""
    return sorted((row for _, row in iter_metrics(path)), key=lambda row: row.step)


class RunRecord(FormatModel):
    """config.json as other stages read it: the run's settings (the sections of
    `tokenmill.trainer.run_config.RunConfig`, resolved) followed by what the trainer records about the
    run. Only the records are typed here; the settings are the trainer's to check, and every key of the
    document stays available (`to_json`). A synthetic run has no plan; runs of older trainers lack some
    records, so each is optional."""

    model_config = ConfigDict(extra="allow")

    model: dict[str, Any] | None = None
    params: dict[str, Any] | None = None  # parameter counts (total, active, ...)
    flops_per_token: float | None = None
    processes: Count | None = None
    plan: dict[str, Any] | None = None  # the mixture plan the run trained on (docs/formats.md)
    phases: dict[str, Any] | None = None  # each phase's settings, by phase name


def read_run_record(path: str) -> RunRecord:
    """A run's config.json; FormatError names the file and the record that breaks the format."""
    return parse(RunRecord, load_json(path), path)


def write_run_record(path: str, record: Mapping[str, Any]) -> None:
    """A run's config.json (keys in the order given, indent 2), checked first, written atomically."""
    parse(RunRecord, dict(record), path)
    storage.write_bytes(path, (json.dumps(record, indent=2) + "\n").encode())
