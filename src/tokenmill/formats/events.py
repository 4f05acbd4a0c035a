"""A run's events (docs/formats.md, "Run events"): `runs/<name>/events.jsonl`, one JSON object per thing
that happened to the run besides its steps, in the order it happened, across every command that trained it.

Kinds:
  start        a command began training (`step`: where it starts; `resumed_from`: the checkpoint's step,
               absent when fresh; `previous`: how the command before it ended, the last event it recorded,
               or {"kind": "killed"} when its last event was not an end)
  skip         the guard left a step's update out (`reason`: nonfinite_loss, nonfinite_grad_norm,
               loss_spike or grad_norm_spike; `loss`, `grad_norm`)
  rollback     after `consecutive` skips the run restored checkpoint `checkpoint` and never trains the steps
               `skipped_from`..`skipped_to` (both included); a resumed run skips them too
  excluded     steps skipped without being computed (a rollback's, or guard.skip_steps): `skipped_from`..
               `skipped_to`
  checkpoint   a checkpoint of the state after `step` steps is complete on disk
  change       the command resumed across a change of data or configuration (`changes`, as config.json's
               history words them; `allowed`: whether --allow-data-change was needed)
  preemption   SIGTERM/SIGINT (`signal`); `checkpoint`: the step saved before exiting (null: abandoned);
               `exit_code` 75
  watchdog     no step completed within `seconds` (`first_step`: whether it was the first); the stacks
               are in train.log; `exit_code` 76
  stop         the command stopped on an error (`message`)
  finish       the command reached its target step

Every event has `kind`, `time` (UTC ISO 8601), `step` (the global step it concerns, or null) and `message`
(a sentence for people). Written by process 0, each event one `write` of a whole line to a file opened for
appending and flushed to disk before training goes on, so a crash leaves whole lines; a last line cut
short by a crash is ignored on reading.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import ConfigDict

from tokenmill.errors import FormatError
from tokenmill.formats.base import Count, FormatModel, parse

EVENTS = "events.jsonl"
Kind = Literal[
    "start",
    "skip",
    "rollback",
    "excluded",
    "checkpoint",
    "change",
    "preemption",
    "watchdog",
    "stop",
    "finish",
]
#: The kinds that end a command.
ENDS = ("preemption", "watchdog", "stop", "finish")


class Event(FormatModel):
    """One event of a run."""

    model_config = ConfigDict(extra="forbid")

    kind: Kind
    time: str
    step: Count | None = None
    message: str = ""
    phase: str | None = None
    reason: str | None = None  # skip
    loss: float | None = None  # skip
    grad_norm: float | None = None  # skip
    consecutive: Count | None = None  # rollback
    checkpoint: Count | None = None  # rollback, preemption: the checkpoint's step
    skipped_from: Count | None = None  # rollback, excluded
    skipped_to: Count | None = None
    resumed_from: Count | None = None  # start
    previous: dict[str, Any] | None = None  # start: the previous command's last event
    changes: list[str] | None = None  # change
    allowed: bool | None = None  # change
    signal: str | None = None  # preemption
    seconds: float | None = None  # watchdog
    first_step: bool | None = None  # watchdog
    exit_code: int | None = None  # preemption, watchdog, stop


def event(kind: str, step: int | None, message: str = "", **fields: Any) -> dict[str, Any]:
    """An event as a JSON object, timed now; checked against the format."""
    given = {key: value for key, value in fields.items() if value is not None}
    now = datetime.now(UTC).isoformat(timespec="milliseconds")
    record = {"kind": kind, "time": now, "step": step, "message": message, **given}
    parse(Event, record, EVENTS)
    return record


def append_event(path: str | os.PathLike, record: dict[str, Any]) -> None:
    """Append one event to a local events.jsonl: one write of the whole line (O_APPEND), then fsync, so
    that a crash leaves whole lines and a reader never sees half an event but the last."""
    parse(Event, record, str(path))
    line = (json.dumps(record, allow_nan=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def parse_events(lines: Iterable[str | bytes], origin: str) -> list[Event]:
    """The events of events.jsonl's lines; a last line that is not whole JSON (a write cut short) is
    left out, any other bad line is a FormatError naming `origin` and the line."""
    lines = [line for line in lines if line.strip()]
    events = []
    for number, line in enumerate(lines, start=1):
        try:
            value = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            if number == len(lines):
                break
            raise FormatError(f"{origin}: line {number}", f"not JSON ({error})") from None
        events.append(parse(Event, value, f"{origin}: line {number}"))
    return events


def read_events(path: str) -> list[Event]:
    """Every event of an events.jsonl (local or gs://), in file order; [] when there is none."""
    from tokenmill import storage

    if not storage.exists(path):
        return []
    with storage.open_file(path, "rb") as handle:
        return parse_events(handle.read().splitlines(), path)


def excluded_steps(events: Iterable[Event]) -> set[int]:
    """The global steps a run never trains on, by its rollbacks."""
    steps: set[int] = set()
    for item in events:
        if item.kind == "rollback" and item.skipped_from is not None and item.skipped_to is not None:
            steps.update(range(item.skipped_from, item.skipped_to + 1))
    return steps
