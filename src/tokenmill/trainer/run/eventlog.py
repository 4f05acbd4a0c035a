"""runs/NAME/events.jsonl as the loop writes it (process 0), with the same events in train.log and, where
Weights & Biases is on, as its alerts (docs/formats.md, "Run events")."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import jax

from tokenmill.formats.events import ENDS, EVENTS, Event, append_event, event, read_events

log = logging.getLogger(__name__)

# The kinds a person on call wants to hear about, and how loudly.
ALERTS = {"skip": "WARN", "rollback": "ERROR", "preemption": "WARN", "watchdog": "ERROR", "stop": "ERROR",
          "change": "INFO"}  # fmt: skip


class EventLog:
    """Appends events to runs/NAME/events.jsonl (process 0 only; the others keep nothing)."""

    def __init__(self, run_dir: Path, wandb: Any = None):
        self.enabled = jax.process_index() == 0
        self.path = run_dir / EVENTS
        self.wandb = wandb
        self._lock = threading.Lock()  # the watchdog's and the preemption timer's threads add events too
        self.previous: list[Event] = read_events(str(self.path))

    def previous_end(self) -> dict[str, Any] | None:
        """How the command before this one ended: its last event if that is an end, else killed."""
        if not self.previous:
            return None
        last = self.previous[-1]
        if last.kind in ENDS:
            return {"kind": last.kind, "step": last.step, "time": last.time, "message": last.message}
        return {"kind": "killed", "step": last.step, "time": last.time,
                "message": f"no end recorded; its last event was {last.kind}"}  # fmt: skip

    def add(self, kind: str, step: int | None, message: str = "", **fields: Any) -> None:
        record = event(kind, step, message, **fields)
        level = logging.WARNING if kind in ALERTS and kind != "change" else logging.INFO
        log.log(level, "event %s at step %s: %s", kind, step, message)
        if not self.enabled:
            return
        with self._lock:
            append_event(self.path, record)
        if self.wandb is not None and kind in ALERTS:
            try:
                import wandb

                self.wandb.alert(
                    title=f"{kind} at step {step}", text=message or kind,
                    level=getattr(wandb.AlertLevel, ALERTS[kind]), wait_duration=60,
                )  # fmt: skip
            except Exception as error:  # noqa: BLE001 (an alert that fails must not stop training)
                log.warning("W&B alert failed: %s", error)
