"""What a model shape counts and computes: parameters (total, active, stored), forecast compute, FLOPs per
token for MFU, the measured or known peak FLOP/s, and XLA's FLOP count of a compiled step.

The conventions (Marin's counts, Levanter's forecast, the MFU count without the head) are written down in
docs/trainer.md, "Counting parameters and compute".
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

from tokenmill.trainer.model import hlo
from tokenmill.trainer.model.shape import ModelConfig


@dataclass(frozen=True)
class ParamCount:
    total_params: int  # matrices, with the embedding and the head
    active_params: int  # matrices one token multiplies with, without the embedding and the head
    stored_params: int  # every number a checkpoint holds: parameters and the router bias
    embedding_params: int  # token embedding + output head
    attention_params: int
    router_params: int
    routed_expert_params: int
    latent_params: int  # latent_down + latent_up
    shared_expert_params: int
    # What stored holds beyond total: norm scales, GatedNorm, attention gate, SConv, the router bias.
    other_stored_params: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def _attention_matrices(cfg: ModelConfig) -> int:
    """Wq, Wk, Wv (at the stored KV heads), Wo of one layer."""
    q_width = cfg.n_heads * cfg.head_dim
    return 2 * cfg.d_model * q_width + 2 * cfg.d_model * cfg.stored_kv_heads * cfg.head_dim


def per_token_gate_matrices(cfg: ModelConfig) -> int:
    """Matrices outside the counts that every token still multiplies with: GatedNorm, the attention gate."""
    d = cfg.d_model
    gated_norm = 2 * d * cfg.gated_norm_rank if cfg.gated_norm_rank else 0
    per_layer = 2 * gated_norm + (d * cfg.n_heads if cfg.attn_gate else 0)
    n_outer = (1 + cfg.embed_norm) if cfg.gated_norm_rank else 0  # final (and embedding) GatedNorm
    return cfg.n_layers * per_layer + n_outer * gated_norm


def count_params(cfg: ModelConfig) -> ParamCount:
    """Exact parameter counts of the pytree that transformer.init_params builds (see the module docstring)."""
    d, m, layers = cfg.d_model, cfg.moe, cfg.n_layers
    attention = _attention_matrices(cfg)
    router = d * m.n_experts
    width = m.latent_dim or d
    expert = 3 * width * m.expert_hidden  # SwiGLU: gate, up, down
    latent = 2 * d * m.latent_dim if m.latent_dim else 0
    shared = 3 * d * m.shared_hidden_total
    per_layer_fixed = attention + router + latent + shared
    embeddings = 2 * cfg.vocab_size * d  # untied embedding and head
    active = layers * (per_layer_fixed + m.top_k * expert)
    total = layers * (per_layer_fixed + m.n_experts * expert) + embeddings

    kv_width = cfg.stored_kv_heads * cfg.head_dim
    vectors = 2 * d  # attention and MoE RMSNorm scales
    if cfg.qk_norm and cfg.qk_norm_learnable:
        vectors += 2 * cfg.head_dim
    vectors += m.latent_dim or 0  # the latent RMSNorm's scale
    sconv_width = {"k": kv_width, "v": kv_width, "attn": d, "mlp": d}
    sconv = cfg.sconv_kernel * sum(sconv_width[site] for site in cfg.sconv_sites)
    per_layer_other = vectors + sconv + m.n_experts  # + the router bias
    outer_vectors = d * (1 + cfg.embed_norm)  # final (and embedding) RMSNorm scales
    other = layers * per_layer_other + outer_vectors + per_token_gate_matrices(cfg)
    return ParamCount(
        total_params=total,
        active_params=active,
        stored_params=total + other,
        embedding_params=embeddings,
        attention_params=layers * attention,
        router_params=layers * router,
        routed_expert_params=layers * m.n_experts * expert,
        latent_params=layers * latent,
        shared_expert_params=layers * shared,
        other_stored_params=other,
    )


def stored_params_from_shapes(cfg: ModelConfig) -> int:
    """stored_params read off the real pytree: transformer.init_params under jax.eval_shape (nothing is
    allocated,
    so this works for the 535B shape too) plus the router bias."""
    # Imported here: counting by formula, which most callers want, should not pay for importing JAX.
    import jax

    from tokenmill.trainer.model import transformer

    shapes = jax.eval_shape(lambda key: transformer.init_params(key, cfg), jax.random.key(0))
    bias = jax.eval_shape(lambda: transformer.init_router_bias(cfg))
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(shapes)) + math.prod(bias.shape)


def reference_tokens(cfg: ModelConfig) -> int | None:
    """Tokens of the shape's reference run (steps x sequences x sequence_length), or None when it has none."""
    run = cfg.reference_run
    return run.steps * run.batch_size * cfg.sequence_length if run else None


def levanter_global_layers(cfg: ModelConfig) -> int:
    """Global-attention layers as Levanter's FLOPs count them: n_layers // global_every under the rule
    (the forced-global last layer is not counted), otherwise the layers that have no window."""
    if cfg.global_every is not None:
        return cfg.n_layers // cfg.global_every
    return sum(cfg.is_global(layer) for layer in range(cfg.n_layers))


def forecast_flops_per_token(cfg: ModelConfig, sequence_length: int | None = None) -> int:
    """Training FLOPs per token without the output head: 3 x Levanter's lm_flops_per_token (forward)."""
    sequence_length = sequence_length or cfg.sequence_length
    d, m, heads, head_dim = cfg.d_model, cfg.moe, cfg.n_heads, cfg.head_dim
    d_attn = heads * head_dim
    width = m.latent_dim or d
    mlp = 2 * 3 * width * m.expert_hidden * m.top_k + 2 * 3 * d * m.shared_hidden_total + 2 * d * m.n_experts
    latent = 2 * 2 * d * m.latent_dim if m.latent_dim else 0
    out_proj = 2 * d_attn * d

    def qkv(kv_heads: int) -> int:
        return 2 * d * (d_attn + 2 * kv_heads * head_dim)

    def span(keys: int) -> int:  # QK^T, the mask/softmax and AV over `keys` keys, with no causal halving
        return 4 * keys * d_attn + 3 * keys * heads

    n_global = levanter_global_layers(cfg)
    local_keys = min(cfg.sliding_window or sequence_length, sequence_length)
    global_kv = cfg.global_kv_heads or cfg.n_kv_heads
    flops = cfg.n_layers * (mlp + latent + out_proj)
    flops += n_global * (qkv(global_kv) + span(sequence_length))
    flops += (cfg.n_layers - n_global) * (qkv(cfg.n_kv_heads) + span(local_keys))
    return 3 * flops  # forward, and backward at twice the forward


def forecast_compute(cfg: ModelConfig, tokens: int, sequence_length: int | None = None) -> int:
    """Compute C of training on `tokens` tokens, as Marin's ladder forecast prices it (no output head)."""
    return forecast_flops_per_token(cfg, sequence_length) * tokens


def train_flops(cfg: ModelConfig, tokens: int, sequence_length: int | None = None) -> int:
    """forecast_compute plus the output head's forward and backward (6 x d_model x vocab per token)."""
    return forecast_compute(cfg, tokens, sequence_length) + 6 * cfg.d_model * cfg.vocab_size * tokens


def mean_causal_context(sequence_length: int, window: int | None = None) -> float:
    """Mean number of keys a query attends to in a causal sequence of sequence_length, optionally windowed."""
    if not window or window >= sequence_length:
        return (sequence_length + 1) / 2
    # Positions 0..w-1 see 1..w keys, the remaining sequence_length - w see w each.
    return (window * (window + 1) / 2 + (sequence_length - window) * window) / sequence_length


def attention_flops_per_token(cfg: ModelConfig, sequence_length: int | None = None) -> float:
    """Training FLOPs per token spent in QK^T and AV (not in the projections, which 6N covers)."""
    sequence_length = sequence_length or cfg.sequence_length
    d_attn = cfg.n_heads * cfg.head_dim
    context = sum(mean_causal_context(sequence_length, cfg.window(layer)) for layer in range(cfg.n_layers))
    return 3 * 4 * d_attn * context


def flops_per_token(cfg: ModelConfig, sequence_length: int | None = None) -> float:
    """Training FLOPs per token for MFU: 6 x the matrices a token multiplies with + causal attention."""
    matmul_params = count_params(cfg).active_params + per_token_gate_matrices(cfg)
    return 6 * matmul_params + attention_flops_per_token(cfg, sequence_length)


def model_info(cfg: ModelConfig, tokens: int | None = None, sequence_length: int | None = None) -> dict:
    """What `tokenmill model info` prints: counts, compute at `tokens` (default: the reference run's), and
    the MFU convention's FLOPs per token.

    stored_params is computed twice, from the formula and from the initialised shapes; a disagreement is a
    bug in one of them and raises rather than printing a wrong number.
    """
    counts = count_params(cfg)
    from_shapes = stored_params_from_shapes(cfg)
    if from_shapes != counts.stored_params:
        raise RuntimeError(
            f"{cfg.name}: stored parameters {counts.stored_params:,} by formula but {from_shapes:,} "
            "in the initialised pytree"
        )
    if tokens is None:
        tokens = reference_tokens(cfg)
    run = cfg.reference_run
    return {
        "name": cfg.name,
        **counts.as_dict(),
        "sequence_length": sequence_length or cfg.sequence_length,
        "tokens": tokens,
        "reference_run": {"steps": run.steps, "batch_size": run.batch_size} if run else None,
        "forecast_flops_per_token": forecast_flops_per_token(cfg, sequence_length),
        "forecast_compute": forecast_compute(cfg, tokens, sequence_length) if tokens is not None else None,
        "train_flops": train_flops(cfg, tokens, sequence_length) if tokens is not None else None,
        "flops_per_token": flops_per_token(cfg, sequence_length),
        "attention_flops_per_token": attention_flops_per_token(cfg, sequence_length),
        "head_flops_per_token": 6 * cfg.d_model * cfg.vocab_size,
    }


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


# --- XLA's count of a compiled step --------------------------------------------------------------


def xla_flops(compiled: Any) -> tuple[float, float]:
    """(XLA's cost analysis of the compiled step, the same with every loop body counted per iteration), per
    device.

    XLA's HloCostAnalysis counts a while loop's body once, whatever its trip count, so a scanned model's
    layers would count as one group. The second figure adds, for each while loop whose trip count the HLO
    gives (XLA's known_trip_count, else the loop's induction bound: model/hlo.py), (trips - 1) x the matmul
    FLOPs of its body (nested loops multiply; a conditional by its heaviest branch), read from the compiled
    HLO: the matmuls are the FLOPs that matter, the body's elementwise work is counted once as XLA does.
    """
    analysis = compiled.cost_analysis()
    if isinstance(analysis, list):  # older JAX: one dict per executable
        analysis = analysis[0]
    raw = float(analysis.get("flops", 0.0))
    module = hlo.parse_module(compiled.as_text())
    dots = hlo.dot_flops(module)

    def total(per_trip: bool) -> float:
        runs, _ = hlo.multiplicities(module, lambda name: dots[name], per_trip=per_trip)
        return sum(runs[name] * flops for name, flops in dots.items())

    return raw, raw + total(per_trip=True) - total(per_trip=False)
