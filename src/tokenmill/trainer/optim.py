"""Learning-rate schedules that span phases, and the optimizer (AdamW, or Muon for matrices).

A schedule is a function of the global step over the whole run, not of one phase: pretraining runs the
warmup and the stable part, and midtraining, started from pretraining's last checkpoint, continues at its
own start step and therefore gets the decay. By default the decay is exactly the last phase.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import jax
import jax.numpy as jnp
import optax


@dataclass(frozen=True)
class Schedule:
    """Warmup-stable-decay ("wsd") or warmup-then-linear-decay ("linear") over total_steps global steps."""

    kind: Literal["wsd", "linear"]
    peak_lr: float
    total_steps: int
    warmup_steps: int
    decay_steps: int  # wsd only: the length of the final decay
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.total_steps <= 0:
            raise ValueError("a schedule needs at least one step")
        if self.warmup_steps < 0 or self.decay_steps < 0:
            raise ValueError("warmup and decay steps must be non-negative")
        if self.kind == "wsd" and self.warmup_steps + self.decay_steps > self.total_steps:
            raise ValueError(
                f"warmup ({self.warmup_steps}) + decay ({self.decay_steps}) steps exceed "
                f"the schedule's {self.total_steps} steps"
            )

    def __call__(self, step: jax.Array | int) -> jax.Array:
        step = jnp.asarray(step, jnp.float32)
        floor = self.peak_lr * self.min_lr_ratio
        # Warmup reaches the peak at step warmup_steps (step 0 trains at peak / warmup, never at zero).
        warm = self.peak_lr * jnp.minimum(1.0, (step + 1) / max(1, self.warmup_steps))
        if self.kind == "wsd":
            decay_start = self.total_steps - self.decay_steps
            progress = jnp.clip((step - decay_start) / max(1, self.decay_steps), 0.0, 1.0)
        else:
            span = max(1, self.total_steps - self.warmup_steps)
            progress = jnp.clip((step - self.warmup_steps) / span, 0.0, 1.0)
        decayed = floor + (self.peak_lr - floor) * (1.0 - progress)
        return jnp.where(step < self.warmup_steps, warm, decayed)


def _is_matrix(path: tuple, leaf: jax.Array) -> bool:
    return leaf.ndim >= 2


def _decay_mask(params: dict) -> dict:
    """Weight decay on matrices only: norms' scales decaying towards zero would shrink activations."""
    return jax.tree_util.tree_map_with_path(_is_matrix, params)


def _muon_dims(params: dict) -> dict:
    """Which parameters Muon orthogonalises, and along which axes; None sends a leaf to Adam.

    Embedding and output head stay on Adam (their rows are per-token, not a linear map to orthogonalise);
    stacked expert weights [E, in, out] are one matrix per expert.
    """

    def dims(path: tuple, leaf: jax.Array) -> optax.contrib.MuonDimensionNumbers | None:
        name = jax.tree_util.keystr(path)
        if leaf.ndim < 2 or "embed" in name or "lm_head" in name:
            return None
        if leaf.ndim == 3:
            return optax.contrib.MuonDimensionNumbers(reduction_axis=1, output_axis=2)
        return optax.contrib.MuonDimensionNumbers(reduction_axis=0, output_axis=1)

    return jax.tree_util.tree_map_with_path(dims, params)


def make_optimizer(
    params: dict,
    kind: Literal["adamw", "muon"] = "adamw",
    weight_decay: float = 0.1,
    clip_norm: float = 1.0,
    b1: float = 0.9,
    b2: float = 0.95,
) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW (or Muon on hidden matrices, Adam elsewhere), at a learning rate of 1.

    The train step multiplies the updates by schedule(global step) itself, rather than handing optax the
    schedule: optax would evaluate it at its own step counter, which restarts or lags when a phase starts from
    an earlier phase's checkpoint, while the global step in the train state is the one the schedule means.
    """
    if kind == "adamw":
        inner = optax.adamw(1.0, b1=b1, b2=b2, eps=1e-8, weight_decay=weight_decay, mask=_decay_mask)
    elif kind == "muon":
        inner = optax.contrib.muon(
            1.0,
            weight_decay=weight_decay,
            weight_decay_mask=_decay_mask,
            adam_b1=b1,
            adam_b2=b2,
            adam_weight_decay=weight_decay,
            muon_weight_dimension_numbers=_muon_dims(params),
            # Moonlight's scaling: Muon's updates get AdamW's RMS, so one learning rate serves both groups.
            consistent_rms=0.2,
        )
    else:
        raise ValueError(f"unknown optimizer {kind!r}")
    return optax.chain(optax.clip_by_global_norm(clip_norm), inner)
