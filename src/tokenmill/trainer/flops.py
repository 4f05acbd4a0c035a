"""Parameter and FLOP counts of a model shape, and the measured peak that MFU divides by.

The conventions, written down once (docs/trainer.md repeats them):

- Parameter counts exclude the token embedding and the output head (Kaplan et al. 2020's non-embedding N),
  the count that scaling ladders fit and that the model names (1.6B-A61M, 535B-A23B) use. Embedding and head
  sizes are reported separately, and `*_with_embeddings` counts add them back.
- total = every other parameter; active = what one token multiplies with: attention, norms, router, shared
  experts and top_k of the routed experts. The router bias is state, not a parameter, and is not counted.
- Training FLOPs per token = 6 x active (forward 2, backward 4) + attention: per layer, QK^T and AV cost
  4 x context x d_attn forward, where context is the mean number of keys a causal query sees (about
  seq_len/2, fewer in a sliding-window layer); x3 for training. The output head's 6 x d_model x vocab is NOT
  in the count (as in 6N), so MFU from these numbers is conservative for small models with large vocabularies.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from tokenmill.trainer.config import ModelConfig


@dataclass(frozen=True)
class ParamCount:
    total_params: int
    active_params: int
    embedding_params: int  # token embedding + output head
    total_params_with_embeddings: int
    active_params_with_embeddings: int
    attention_params: int
    routed_expert_params: int
    shared_expert_params: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def count_params(cfg: ModelConfig) -> ParamCount:
    """Exact parameter counts of the pytree that model.init_params builds."""
    d, m = cfg.d_model, cfg.moe
    attention = d * cfg.n_heads * cfg.head_dim * 2 + d * cfg.n_kv_heads * cfg.head_dim * 2
    if cfg.qk_norm:
        attention += 2 * cfg.head_dim
    norms = 2 * d
    router = d * m.n_experts
    expert = 3 * d * m.expert_hidden  # SwiGLU: gate, up, down
    shared = 3 * d * m.shared_width
    per_layer_fixed = attention + norms + router + shared
    total = cfg.n_layers * (per_layer_fixed + m.n_experts * expert) + d  # + final norm
    active = cfg.n_layers * (per_layer_fixed + m.top_k * expert) + d
    embeddings = 2 * cfg.vocab_size * d  # untied embedding and head
    return ParamCount(
        total_params=total,
        active_params=active,
        embedding_params=embeddings,
        total_params_with_embeddings=total + embeddings,
        active_params_with_embeddings=active + embeddings,
        attention_params=cfg.n_layers * attention,
        routed_expert_params=cfg.n_layers * m.n_experts * expert,
        shared_expert_params=cfg.n_layers * shared,
    )


def mean_causal_context(seq_len: int, window: int | None = None) -> float:
    """Mean number of keys a query attends to in a causal sequence of seq_len, optionally windowed."""
    if not window or window >= seq_len:
        return (seq_len + 1) / 2
    # Positions 0..w-1 see 1..w keys, the remaining seq_len - w see w each.
    return (window * (window + 1) / 2 + (seq_len - window) * window) / seq_len


def attention_flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> float:
    """Training FLOPs per token spent in QK^T and AV (not in the projections, which 6N covers)."""
    seq_len = seq_len or cfg.seq_len
    d_attn = cfg.n_heads * cfg.head_dim
    context = sum(mean_causal_context(seq_len, cfg.window(layer)) for layer in range(cfg.n_layers))
    return 3 * 4 * d_attn * context


def flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> float:
    """Training FLOPs per token: 6 x active parameters + attention (see the module docstring)."""
    return 6 * count_params(cfg).active_params + attention_flops_per_token(cfg, seq_len)


def model_info(cfg: ModelConfig, tokens: int | None = None, seq_len: int | None = None) -> dict:
    """What `tokenmill model info` prints: counts, FLOPs per token and, given tokens, the total."""
    counts = count_params(cfg)
    per_token = flops_per_token(cfg, seq_len)
    info = {
        "name": cfg.name,
        **counts.as_dict(),
        "seq_len": seq_len or cfg.seq_len,
        "flops_per_token": per_token,
        "attention_flops_per_token": attention_flops_per_token(cfg, seq_len),
        "head_flops_per_token": 6 * cfg.d_model * cfg.vocab_size,
        "tokens": tokens,
        "total_flops": per_token * tokens if tokens is not None else None,
    }
    return info


# Dense bf16 peaks per chip, from the vendors' data sheets, for MFU on known accelerators.
_KNOWN_PEAKS = {
    "h100": 989e12,
    "h200": 989e12,
    "b200": 2250e12,
    "a100": 312e12,
    "tpu v4": 275e12,
    "tpu v5 lite": 197e12,
    "tpu v5e": 197e12,
    "tpu v5p": 459e12,
    "tpu v5": 459e12,
    "tpu v6 lite": 918e12,
    "tpu v6e": 918e12,
}


def known_peak_flops(device_kind: str) -> float | None:
    """Data-sheet peak FLOP/s of one device of this kind, or None when unknown (CPUs)."""
    kind = device_kind.lower()
    for name, peak in sorted(_KNOWN_PEAKS.items(), key=lambda item: -len(item[0])):
        if name in kind:
            return peak
    return None


def measure_matmul_flops(size: int = 1024, dtype: str = "float32", seconds: float = 1.0) -> float:
    """Achieved FLOP/s of a plain jitted square matmul on the default device: the practical CPU peak.

    CPUs have no meaningful data-sheet peak for XLA, so MFU on a CPU is measured against this instead.
    """
    import jax
    import jax.numpy as jnp

    a = jnp.ones((size, size), dtype) * 0.5
    b = jnp.ones((size, size), dtype) * 0.25
    matmul = jax.jit(lambda a, b: a @ b)
    matmul(a, b).block_until_ready()  # compile
    runs, start = 0, time.perf_counter()
    while True:
        matmul(a, b).block_until_ready()
        runs += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds and runs >= 3:
            break
    return 2 * size**3 * runs / elapsed
