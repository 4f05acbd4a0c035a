"""tokenmill's own greedy decode, over its forward: the reference an exported model's generate() is checked
against (tests/test_export_hf.py) and a way to read off what a checkpoint continues a prompt with.

No KV cache: each new token reruns the forward over a buffer of the model's sequence_length (one compiled
program whatever the prompt), the tokens after the prefix masked off by causality. The routed experts run
dropless, as tokenmill evaluates and as transformers runs them. Memory grows with one forward pass over
[rows, sequence_length].
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tokenmill.trainer.model.shape import ModelConfig


def dropless(cfg: ModelConfig) -> ModelConfig:
    """The shape with its routed experts dispatched dropless (nothing dropped: the function itself)."""
    return cfg.model_copy(update={"moe": cfg.moe.model_copy(update={"dispatch": "dropless"})})


def greedy_decode(
    params: Any, router_bias: Any, cfg: ModelConfig, prompt: np.ndarray, new_tokens: int
) -> np.ndarray:
    """prompt [rows, P] (int) followed by `new_tokens` greedily chosen tokens: [rows, P + new_tokens].

    Raises ValueError when P + new_tokens exceeds the model's sequence_length."""
    import jax
    import jax.numpy as jnp

    from tokenmill.trainer.model import transformer

    cfg = dropless(cfg)
    prompt = np.asarray(prompt, np.int32)
    rows, length = prompt.shape
    if length + new_tokens > cfg.sequence_length:
        raise ValueError(
            f"{length} + {new_tokens} tokens exceed the model's sequence_length {cfg.sequence_length}"
        )

    @jax.jit
    def next_token(params: Any, router_bias: Any, buffer: jax.Array, position: jax.Array) -> jax.Array:
        logits, _ = transformer.forward(params, router_bias, buffer, jnp.zeros_like(buffer), cfg)
        return jnp.argmax(logits[:, position - 1], axis=-1).astype(jnp.int32)

    params, router_bias = jax.device_put((params, router_bias))
    buffer = np.zeros((rows, cfg.sequence_length), np.int32)
    buffer[:, :length] = prompt
    for position in range(length, length + new_tokens):
        buffer[:, position] = np.asarray(next_token(params, router_bias, jnp.asarray(buffer), position))
    return buffer[:, : length + new_tokens]
