"""Runs (docs/formats.md, "Runs"): `runs/<name>/metrics.jsonl`, one JSON object per logged step, and
`runs/<name>/config.json`, the run's resolved settings and what the trainer records about it, with the
history of every configuration the run has trained with and the step each began at.

The metrics keys the format fixes are typed on read; a row may carry more (the trainer also logs its
objective and router losses), and a run that did not log a key (MFU on a CPU, router metrics of a dense
model) simply lacks it. NaN losses are kept as NaN: a run that diverged shows it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from pydantic import ConfigDict

from tokenmill import storage
from tokenmill.errors import FormatError
from tokenmill.formats.base import Count, FormatModel, load_json, parse

METRICS = "metrics.jsonl"
CONFIG = "config.json"
LOG = "train.log"  # the trainer's log lines (process 0), appended across phases and restarts


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
    # (written every logging.expert_load_every steps); per MoE layer, the busiest expert's fraction x the
    # number of experts (every row):
    expert_imbalance: list[float] | None = None
    drop_fraction: float | None = None
    time: float | None = None  # seconds since the start
    # Telemetry (tokenmill.trainer.run.telemetry); each key only where the hardware reports it.
    timestamp: float | None = None  # Unix time of the row
    device_kind: str | None = None
    devices: Count | None = None
    tokens_per_second_per_device: float | None = None
    step_seconds: float | None = None  # since the previous row; the parts below add up to about it
    data_seconds: float | None = None
    compute_seconds: float | None = None
    checkpoint_seconds: float | None = None
    publish_seconds: float | None = None
    device_memory_bytes: Count | None = None  # the fullest local device
    device_memory_peak_bytes: Count | None = None
    device_memory_limit_bytes: Count | None = None
    host_memory_bytes: Count | None = None  # resident set size of the process
    gpu_utilization: list[float] | None = None  # per local NVIDIA GPU (NVML), percent
    gpu_power_watts: list[float] | None = None
    gpu_temperature_c: list[float] | None = None

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


class HistoryEntry(FormatModel):
    """One configuration a run has trained with (config.json's `history`), from global step `step` on
    (null: recorded before histories were kept)."""

    model_config = ConfigDict(extra="allow")

    step: Count | None
    phase: str | None = None
    started: str | None = None  # when, UTC ISO 8601
    processes: Count | None = None
    mesh: dict[str, int] | None = None
    seed: int | None = None
    plan_sha256: str | None = None
    model_sha256: str | None = None
    tokenizer_sha256: str | None = None
    changes: list[str] = []  # from the checkpoint it resumed across, e.g. "seed 0 -> 1"
    settings: dict[str, Any]
    plan: dict[str, Any] | None = None


# The keys config.json adds after the settings (tokenmill.trainer.run.config skips them on reading back).
RECORD_KEYS = ("params", "flops_per_token", "processes", "plan", "phases", "history", "evaluation_latest")


class RunRecord(FormatModel):
    """config.json as other stages read it: the run's settings (the sections of
    `tokenmill.trainer.run.config.RunConfig`, resolved) followed by what the trainer records about the
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
    history: list[HistoryEntry] | None = None  # every configuration the run has used, oldest first
    # The latest evaluation point's averages (docs/formats.md, "Evaluation"): step, tokens_trained, and per
    # dispatch {average: {loss, bits_per_byte}}.
    evaluation_latest: dict[str, Any] | None = None


def history_entry(
    step: int,
    phase: str,
    settings: Mapping[str, Any],
    plan: Mapping[str, Any] | None,
    identity: Mapping[str, Any],
    changes: Sequence[Any] = (),
) -> dict[str, Any]:
    """One entry of config.json's history: the configuration a run trains with from global step `step`
    (settings as config.json's top level holds them, the plan, the identity a checkpoint records), and the
    changes from the checkpoint it resumed across (strings)."""
    return {
        "step": step,
        "phase": phase,
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "processes": identity.get("processes"),
        "mesh": identity.get("mesh"),
        "seed": identity.get("seed"),
        "plan_sha256": identity.get("plan_sha256"),
        "model_sha256": identity.get("model_sha256"),
        "tokenizer_sha256": identity.get("tokenizer_sha256"),
        "changes": [str(change) for change in changes],
        "settings": dict(settings),
        "plan": dict(plan) if plan is not None else None,
    }


# Entry keys that say when or where a configuration ran, not what it is: a rerun that differs only in them
# (or in the logging section: a measured peak, another W&B project) continues the same entry.
_CIRCUMSTANCES = ("step", "started", "changes")


def extend_history(previous: RunRecord | None, entry: Mapping[str, Any]) -> list[dict[str, Any]]:
    """config.json's history with `entry` appended, unless it is the configuration the last entry already
    records (a plain resume). A config.json from before histories were kept starts the history with its
    own configuration, at an unknown step (null)."""
    history: list[dict[str, Any]] = []
    if previous is not None:
        if previous.history is not None:
            history = [item.to_json() for item in previous.history]
        else:
            old = previous.to_json()
            settings = {key: value for key, value in old.items() if key not in RECORD_KEYS}
            history = [
                {
                    "step": None,
                    "phase": settings.get("data", {}).get("phase"),
                    "processes": old.get("processes"),
                    "changes": [],
                    "settings": settings,
                    "plan": old.get("plan"),
                }
            ]
    if history and _same_configuration(history[-1], entry):
        return history
    return [*history, dict(entry)]


def _same_configuration(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    def essence(item: Mapping[str, Any]) -> dict[str, Any]:
        kept = {key: value for key, value in item.items() if key not in _CIRCUMSTANCES}
        # What is logged and evaluated does not change what is trained.
        kept["settings"] = {
            k: v for k, v in (item.get("settings") or {}).items() if k not in ("logging", "evaluation")
        }
        return kept

    return essence(a) == essence(b)


def read_run_record(path: str) -> RunRecord:
    """A run's config.json; FormatError names the file and the record that breaks the format."""
    return parse(RunRecord, load_json(path), path)


def write_run_record(path: str, record: Mapping[str, Any]) -> None:
    """A run's config.json (keys in the order given, indent 2), checked first, written atomically."""
    parse(RunRecord, dict(record), path)
    storage.write_bytes(path, (json.dumps(record, indent=2) + "\n").encode())
