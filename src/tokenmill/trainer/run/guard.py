"""The spike and non-finite guard of a train step, decided on the device (docs/trainer.md, "A run's bad
hours").

Before a step's update is applied its loss and gradient norm are compared with a running window of the
steps that were applied: a non-finite value always skips the step, and after `warmup` steps in the window
a value above mean + `sigmas` standard deviations of the window (its last `window` applied steps) skips it
too (OLMo-core's rule; its defaults are 6 sigma over 128 steps after 64). A skipped step leaves the
parameters, the optimizer state and the router bias bit-identical, its values never enter the window, and
only the step counter moves on: the data is a function of the step, so the run continues past it exactly.

The window is part of the train state ({"loss", "grad_norm", "filled", "next", "consecutive"}), so a
checkpoint carries it and a resumed run decides as the uninterrupted one would. Plain functions of arrays,
traced into the jitted step: no host round-trip. Memory: two fp32 vectors of `window` values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The reason a step was skipped, as the step's metrics give it (`skip_reason`, an index into this).
REASONS = ("", "nonfinite_loss", "nonfinite_grad_norm", "loss_spike", "grad_norm_spike", "excluded")
APPLIED, NONFINITE_LOSS, NONFINITE_GRAD_NORM, LOSS_SPIKE, GRAD_NORM_SPIKE, EXCLUDED = range(len(REASONS))


def init_window(window: int) -> dict:
    """An empty window of `window` steps: nothing applied yet, no skips in a row."""
    return {
        "loss": jnp.zeros((window,), jnp.float32),
        "grad_norm": jnp.zeros((window,), jnp.float32),
        "filled": jnp.zeros((), jnp.int32),  # applied steps in the window, at most `window`
        "next": jnp.zeros((), jnp.int32),  # where the next applied step is written (a ring)
        "consecutive": jnp.zeros((), jnp.int32),  # steps skipped in a row up to now
    }


def _above(values: jax.Array, filled: jax.Array, value: jax.Array, sigmas: float) -> jax.Array:
    """Whether `value` exceeds mean + sigmas x std (population) of the first `filled` entries."""
    valid = jnp.arange(values.shape[0]) < filled
    count = jnp.maximum(filled, 1).astype(jnp.float32)
    mean = jnp.where(valid, values, 0.0).sum() / count
    variance = jnp.where(valid, (values - mean) ** 2, 0.0).sum() / count
    return value > mean + sigmas * jnp.sqrt(variance)


def decide(window: dict, loss: jax.Array, grad_norm: jax.Array, sigmas: float, warmup: int) -> jax.Array:
    """The step's reason to skip (an int32 index of REASONS; APPLIED, 0, to apply it)."""
    loss, grad_norm = loss.astype(jnp.float32), grad_norm.astype(jnp.float32)
    warm = window["filled"] >= warmup
    checks = [
        ~jnp.isfinite(loss),
        ~jnp.isfinite(grad_norm),
        warm & _above(window["loss"], window["filled"], loss, sigmas),
        warm & _above(window["grad_norm"], window["filled"], grad_norm, sigmas),
    ]
    reason = jnp.int32(APPLIED)
    # The first check that holds names the reason: non-finite before spikes, the loss before the norm.
    for code, check in reversed(list(enumerate(checks, start=1))):
        reason = jnp.where(check, jnp.int32(code), reason)
    return reason


def record(window: dict, loss: jax.Array, grad_norm: jax.Array, reason: jax.Array) -> dict:
    """The window after the step: an applied step's values written into it, a skipped one's left out
    (counted in `consecutive`)."""
    applied = reason == APPLIED
    size = window["loss"].shape[0]
    at = window["next"]
    return {
        "loss": jnp.where(applied, window["loss"].at[at].set(loss.astype(jnp.float32)), window["loss"]),
        "grad_norm": jnp.where(
            applied, window["grad_norm"].at[at].set(grad_norm.astype(jnp.float32)), window["grad_norm"]
        ),
        "filled": jnp.where(applied, jnp.minimum(window["filled"] + 1, size), window["filled"]),
        "next": jnp.where(applied, (at + 1) % size, at),
        "consecutive": jnp.where(applied, 0, window["consecutive"] + 1),
    }
