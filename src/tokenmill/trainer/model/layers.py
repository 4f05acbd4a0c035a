"""Pieces every part of the model shares: the parameter type, the batch's mesh axes, activation sharding
pins, RMSNorm, weight initialisation and the SwiGLU MLP."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from tokenmill.trainer.model.shape import ModelConfig

Params = dict[str, jax.Array]

# Mesh axes that split the batch: the expert axis holds different tokens outside the MoE block (as in
# DeepSeek/MaxText expert parallelism), so every device works on its own slice of the batch.
BATCH_AXES = ("data", "fsdp", "expert")


def constrain(x: jax.Array, *spec: object) -> jax.Array:
    """Pin an activation's sharding when a mesh is set; a no-op in single-device code and tests."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec(*spec))


def rms_norm(x: jax.Array, scale: jax.Array | None, eps: float) -> jax.Array:
    """RMSNorm in fp32 (the mean of squares underflows in bf16), returned in x's dtype; no scale: plain."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if scale is not None:
        normed = normed * scale
    return normed.astype(x.dtype)


def init_matrix(cfg: ModelConfig, key: jax.Array, shape: tuple[int, ...], std: float) -> jax.Array:
    """One fp32 weight matrix: normal, or truncated at +-3 standard units (then scaled), times std."""
    if cfg.init_truncated:
        return std * jax.random.truncated_normal(key, -3.0, 3.0, shape, jnp.float32)
    return std * jax.random.normal(key, shape, jnp.float32)


def output_std(cfg: ModelConfig) -> float:
    """Init std of matrices that write into the residual stream."""
    # Smaller, so that the residual stream does not grow with depth (GPT-2's trick), unless turned off.
    std = cfg.weight_std
    return std / math.sqrt(2 * cfg.n_layers) if cfg.init_scale_outputs else std


def swiglu(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    """A dense SwiGLU MLP (the shared experts)."""
    return (jax.nn.silu(x @ gate) * (x @ up)) @ down
