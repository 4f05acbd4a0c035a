"""runs/NAME/metrics.jsonl (and Weights & Biases when configured), written by process 0 only."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import jax

from tokenmill.errors import FormatError
from tokenmill.formats.runs import METRICS, metrics_line, parse_metrics_line

log = logging.getLogger(__name__)


class MetricsWriter:
    """metrics.jsonl (and Weights & Biases when configured), written by process 0 only."""

    def __init__(self, run_dir: Path, resume_step: int, wandb_project: str | None, config: dict):
        self.enabled = jax.process_index() == 0
        self.path = run_dir / METRICS
        self.wandb = None
        if not self.enabled:
            return
        if self.path.exists():
            # Steps logged after the checkpoint we resume from are about to be trained again; drop them so
            # that every step appears once.
            kept = [
                line for line in self.path.read_text().splitlines() if line and _step_of(line) < resume_step
            ]
            self.path.write_text("".join(line + "\n" for line in kept))
        self.file = self.path.open("a")
        project = wandb_project or os.environ.get("WANDB_PROJECT")
        if project:
            try:
                import wandb
            except ImportError:
                log.warning("Weights & Biases logging asked for, but wandb is not installed; skipping it")
            else:
                # WANDB_MODE=offline is honoured by wandb itself; `wandb sync` uploads later.
                self.wandb = wandb.init(project=project, name=run_dir.name, config=config, resume="allow")

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        self.file.write(metrics_line(row))
        self.file.flush()
        if self.wandb is not None:
            flat = {k: v for k, v in row.items() if isinstance(v, int | float) and v is not None}
            for layer, norm in enumerate(row["router_bias_norm"]):
                flat[f"router_bias_norm/layer{layer}"] = norm
            for layer, imbalance in enumerate(row["expert_imbalance"]):
                flat[f"expert_imbalance/layer{layer}"] = imbalance
            flat.update(_health_keys(row))
            self.wandb.log(flat, step=row["step"])

    @property
    def size(self) -> int:
        """Bytes of metrics.jsonl written so far: whole rows only, since every write is flushed."""
        return self.file.tell() if self.enabled and not self.file.closed else 0

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            if self.wandb is not None:
                self.wandb.finish()


def _health_keys(row: dict) -> dict[str, float]:
    """The sampled per-layer health of a row (loop._health_row) as flat W&B keys: `update_norms/experts/
    layer3`, `router_bias_change/layer0`, `param_norms/embed`."""
    flat: dict[str, float] = {}

    def put(prefix: str, value: object) -> None:
        if isinstance(value, list):
            for layer, item in enumerate(value):
                flat[f"{prefix}/layer{layer}"] = item
        elif isinstance(value, int | float):
            flat[prefix] = value

    for key in ("param_norms", "update_norms"):
        for group, value in (row.get(key) or {}).items():
            put(f"{key}/{group}", value)
    for key in ("router_bias_change", "router_z_loss_layers"):
        if key in row:
            put(key, row[key])
    return flat


def _step_of(line: str) -> int:
    """The step of a metrics.jsonl line; -1 for a line that is not a metrics row (a write cut short)."""
    try:
        return parse_metrics_line(line, METRICS).step
    except FormatError:
        return -1
