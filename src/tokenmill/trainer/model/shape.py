"""Model shapes: the schema of configs/models/*.yaml and its loader.

A model file names the transformer's shape and its mixture-of-experts layer. The only training fact it may
carry is `reference_run`, the batch and steps a published shape was trained with, so that `model info` can
price that run. Shapes are validated here once, so that transformer.py can trust them.

Two families share the schema. The DeepSeek-V3-style options are the defaults; Marin's 535B-A23B adds a
field per piece (latent experts, local/global KV heads, a global-layer rule, half RoPE, plain QK-norm with
`qk_mult`, GatedNorm, XSA, the attention gate, SConv, logit-space quantile balancing, the final-logit
z-loss and its initialisation), each off by default so that existing shapes keep their meaning.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal, NamedTuple

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from tokenmill.validation import validation_problems


class MoEConfig(BaseModel):
    """The routed-experts block that replaces every layer's MLP."""

    model_config = ConfigDict(extra="forbid")

    n_experts: int
    top_k: int
    expert_hidden: int
    n_shared_experts: int = 0
    # Hidden width of each shared expert (default: expert_hidden); fused, the shared experts run as one
    # SwiGLU of shared_hidden_total = n_shared_experts x this width.
    shared_expert_hidden: int | None = None
    score_fn: Literal["sigmoid", "softmax"] = "sigmoid"
    # Renormalise the chosen experts' scores to sum to one (DeepSeek-V3 does, for sigmoid scores).
    normalize_weights: bool = True
    route_scale: float = 1.0
    # How experts are kept evenly loaded without a loss: "bias" is DeepSeek-V3's sign update with rate
    # bias_rate (gamma); "quantile" solves for the bias that would have balanced this batch (Kimi K3/Marin);
    # "none" leaves the bias at zero.
    balancing: Literal["bias", "quantile", "none"] = "bias"
    bias_rate: float = 1e-3
    # Step size towards the quantile solution: 1.0 jumps to it, smaller values smooth it (an EMA).
    quantile_rate: float = 1.0
    # Where the router bias is added before top-k: to the scores (DeepSeek-V3) or to the raw logits (Marin).
    # The combine weights are the unbiased scores either way.
    bias_space: Literal["score", "logit"] = "score"
    # Quantile balancing's estimator: None takes the exact quantile of the margins over this batch's tokens;
    # a number reads it from a histogram of that many bins over the margins' live [min, max] (Marin: 10,000).
    quantile_bins: int | None = None
    load_balance_loss: float = 0.0
    # The router z-loss weight (mean squared log-sum-exp of the router logits); logged whatever its weight.
    z_loss: float = 0.0
    dispatch: Literal["capacity", "dropless"] = "capacity"
    # Capacity dispatch: slots per expert = this x the balanced share. Per batch row on one device; per
    # (sender shard x expert) cell under expert parallelism.
    capacity_factor: float = 1.25
    # Run the routed experts expert-parallel (model/expert_parallel.py: shard_map and all-to-all) whenever
    # the ambient mesh has an `expert` axis larger than one. False leaves them to XLA's automatic partitioner.
    expert_parallel: bool = True
    # Dropless under expert parallelism (ragged all-to-all): each device's receive buffer holds this x the
    # balanced share of token copies, and copies past it are dropped and counted (Marin's hero: 1.15). None
    # sizes it for the worst case (every copy of the expert group lands on one device), which never drops
    # but grows with the expert-axis size: set a factor at scale.
    receive_capacity_factor: float | None = None
    # LatentMoE: the routed experts work in a narrower space. Tokens go d_model -> latent_dim (then RMSNorm)
    # before dispatch and the combined expert output goes latent_dim -> d_model; the router and the shared
    # experts still read the full-width token.
    latent_dim: int | None = None
    # Keep each shared expert's matrices apart instead of one fused SwiGLU of n_shared x width. The function
    # is the same; an optimizer that orthogonalises per matrix (Muon) treats them differently.
    separate_shared_experts: bool = False

    @model_validator(mode="after")
    def _check(self) -> MoEConfig:
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k ({self.top_k}) must be between 1 and n_experts ({self.n_experts})")
        if self.balancing == "quantile" and self.top_k >= self.n_experts:
            raise ValueError("quantile balancing needs top_k < n_experts (it reads the (k+1)-th score)")
        if self.capacity_factor <= 0:
            raise ValueError("capacity_factor must be positive")
        if self.receive_capacity_factor is not None and self.receive_capacity_factor <= 0:
            raise ValueError("receive_capacity_factor must be positive")
        if self.quantile_bins is not None and (self.balancing != "quantile" or self.quantile_bins < 2):
            raise ValueError("quantile_bins needs balancing: quantile and at least 2 bins")
        if self.latent_dim is not None and self.latent_dim <= 0:
            raise ValueError("latent_dim must be positive")
        if self.n_shared_experts and self.shared_expert_hidden is None:
            self.shared_expert_hidden = self.expert_hidden
        return self

    @property
    def shared_hidden_total(self) -> int:
        """Hidden width of all shared experts together (0 when there are none)."""
        return self.n_shared_experts * (self.shared_expert_hidden or 0)


class ReferenceRun(BaseModel):
    """The run a published shape was trained with; `model info` prices it when no --tokens is given."""

    model_config = ConfigDict(extra="forbid")

    steps: int
    # Sequences of sequence_length tokens per step.
    batch_size: int

    @model_validator(mode="after")
    def _check(self) -> ReferenceRun:
        if self.steps <= 0 or self.batch_size <= 0:
            raise ValueError("steps and batch_size must be positive")
        return self


# What the backward pass keeps of each layer's forward (jax.checkpoint policies, `remat_layer`):
# "none" keeps every intermediate, "full" keeps only the layer's input and recomputes the rest,
# "dots_saveable" keeps the matmul outputs and recomputes the elementwise work between them, "offload" keeps
# the weight matmuls' outputs in pinned host memory instead of on the device.
RematPolicy = Literal["none", "full", "dots_saveable", "offload"]


class LayerGroup(NamedTuple):
    """Layers start, start + 1, ... start + period * repeats - 1, whose attention schedule repeats every
    `period` layers: they run as one jax.lax.scan of `repeats` steps over a body of `period` layers."""

    start: int
    period: int
    repeats: int

    @property
    def n_layers(self) -> int:
        return self.period * self.repeats

    def layer(self, repeat: int, position: int) -> int:
        """The model's layer index of `position` in the `repeat`-th pass of the body."""
        return self.start + repeat * self.period + position


class ModelConfig(BaseModel):
    """A decoder-only MoE transformer's shape."""

    model_config = ConfigDict(extra="forbid")

    name: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    # Longest sequence the model is built for; the FLOPs counter also uses it as the training length.
    sequence_length: int
    # KV heads on global-attention layers when they differ from n_kv_heads (then the sliding-window layers'
    # count). K and V are stored at the larger count; a layer uses the first heads it needs.
    global_kv_heads: int | None = None
    rope_theta: float = 10_000.0
    # Rotary positions on the first rope_dims channels of each head (None: all of head_dim), pairing
    # channel i with i + rope_dims/2 ("halves") or 2i with 2i+1 (interleaved); the rest carry no position.
    rope_dims: int | None = None
    rope_interleaved: bool = False
    # False: global-attention layers get no rotary positions at all (NoPE), only the windowed ones do.
    rope_on_global_layers: bool = True
    norm_eps: float = 1e-5
    qk_norm: bool = True
    # Learnable per-channel scales on the q/k RMSNorm; False makes it a plain (non-parametric) RMS norm.
    qk_norm_learnable: bool = True
    qk_norm_eps: float | None = None  # None: norm_eps
    # Queries are multiplied by this after the q/k norm: with unit-RMS q and k it sets the logits' scale.
    qk_mult: float = 1.0
    sliding_window: int | None = None
    # Layers (0-based) that attend only to the last `sliding_window` tokens; the others attend globally.
    sliding_window_layers: list[int] = []
    # The same by rule: layer i is global iff (i + 1) % global_every == 0 or it is the last layer; the
    # others attend within sliding_window. Excludes sliding_window_layers.
    global_every: int | None = None
    # RMSNorm (learnable scale) on the token embeddings before the first layer.
    embed_norm: bool = False
    # GatedNorm after every RMSNorm of the residual stream (embedding, attention and MoE inputs, final):
    # x * sigmoid(W_up silu(W_down x)) with W_down [d, rank], W_up [rank, d], no bias.
    gated_norm_rank: int | None = None
    # Exclusive self-attention: remove from each head's output its component along the token's own value.
    xsa: bool = False
    # Headwise output gate 2 * sigmoid(x W_gate), W_gate [d, n_heads] initialised to zero (a gate of 1).
    attn_gate: bool = False
    # Causal depthwise convolutions (kernel sconv_kernel, identity at init, never across documents) after the
    # K and/or V projections and on the attention and MoE outputs before the residual add.
    sconv_sites: list[Literal["k", "v", "attn", "mlp"]] = []
    sconv_kernel: int = 4
    # Weight of the final-logit z-loss, mean over tokens of logsumexp(logits)^2, added to the objective.
    logit_z_loss: float = 0.0
    init_std: float = 0.02
    # When set, the init std of every matrix is init_gain / sqrt(d_model) instead of init_std.
    init_gain: float | None = None
    # Truncated normal (at +-3 standard units, then scaled) instead of a plain normal.
    init_truncated: bool = False
    # Scale matrices that write into the residual stream by 1/sqrt(2 n_layers) at init (GPT-2's trick).
    init_scale_outputs: bool = True
    reference_run: ReferenceRun | None = None
    # What each layer keeps for the backward pass (RematPolicy above); a memory/compute trade, not a shape.
    remat: RematPolicy = "none"
    # Query positions per attention block (None: all at once). Blocked, a layer's [B, heads, S, S] scores
    # are made one [B, heads, block, S] slice at a time and remade in the backward pass; same result.
    attention_block: int | None = None
    # Positions per block of the output head's logits in the loss (None: all at once): only
    # [B, block, vocab] logits are alive at a time; same result.
    loss_block: int | None = None
    moe: MoEConfig

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        for field in ("n_kv_heads", "global_kv_heads"):
            heads = getattr(self, field)
            if heads is not None and (heads <= 0 or self.n_heads % heads):
                raise ValueError(f"n_heads ({self.n_heads}) must be a positive multiple of {field} ({heads})")
        if self.n_heads % self.stored_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of the stored KV heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even (rotary embeddings rotate pairs)")
        if self.rope_dims is not None and (
            self.rope_dims <= 0 or self.rope_dims % 2 or self.rope_dims > self.head_dim
        ):
            raise ValueError(f"rope_dims ({self.rope_dims}) must be even and between 2 and head_dim")
        bad = [i for i in self.sliding_window_layers if not 0 <= i < self.n_layers]
        if bad:
            raise ValueError(f"sliding_window_layers {bad} outside 0..{self.n_layers - 1}")
        if (self.sliding_window_layers or self.global_every) and not self.sliding_window:
            raise ValueError("sliding_window_layers or global_every given without sliding_window")
        if self.global_every is not None and (self.global_every <= 0 or self.sliding_window_layers):
            raise ValueError("global_every must be positive and excludes sliding_window_layers")
        if self.gated_norm_rank is not None and self.gated_norm_rank <= 0:
            raise ValueError("gated_norm_rank must be positive")
        if (self.attention_block is not None and self.attention_block <= 0) or (
            self.loss_block is not None and self.loss_block <= 0
        ):
            raise ValueError("attention_block and loss_block must be positive")
        if self.sconv_kernel <= 0:
            raise ValueError("sconv_kernel must be positive")
        if len(set(self.sconv_sites)) != len(self.sconv_sites):
            raise ValueError(f"sconv_sites {self.sconv_sites} repeats a site")
        if self.moe.latent_dim is not None and self.moe.latent_dim > self.d_model:
            raise ValueError(f"moe.latent_dim ({self.moe.latent_dim}) exceeds d_model ({self.d_model})")
        return self

    @property
    def stored_kv_heads(self) -> int:
        """KV heads the K and V projections produce (the larger of the local and global counts)."""
        return max(self.n_kv_heads, self.global_kv_heads or 0)

    @property
    def weight_std(self) -> float:
        """Standard deviation of the matrices at init."""
        return self.init_gain / math.sqrt(self.d_model) if self.init_gain is not None else self.init_std

    @property
    def qk_eps(self) -> float:
        return self.norm_eps if self.qk_norm_eps is None else self.qk_norm_eps

    def is_global(self, layer: int) -> bool:
        """Whether a layer attends over the whole sequence (not within a sliding window)."""
        if self.global_every is not None:
            return (layer + 1) % self.global_every == 0 or layer == self.n_layers - 1
        return layer not in self.sliding_window_layers

    def window(self, layer: int) -> int | None:
        """The attention window of a layer, or None for global attention."""
        return None if self.is_global(layer) else self.sliding_window

    def kv_heads(self, layer: int) -> int:
        """KV heads a layer attends with: the first this many of the stored ones."""
        if self.is_global(layer) and self.global_kv_heads is not None:
            return self.global_kv_heads
        return self.n_kv_heads

    def rotary(self, layer: int) -> bool:
        """Whether a layer applies rotary positions."""
        return self.rope_on_global_layers or not self.is_global(layer)

    def layer_kind(self, layer: int) -> tuple:
        """What makes one layer's computation differ from another's: window, KV heads, rotary positions."""
        return (self.window(layer), self.kv_heads(layer), self.rotary(layer))

    def layer_groups(self) -> list[LayerGroup]:
        """The layers as scanned groups: a body of `period` layers repeated while the layer kinds repeat
        (Marin: 3 local + 1 global), then the layers left over as one more group of one pass (Marin's d2048:
        layers 20 and 21, local and the forced-global last). The period is the one that leaves the fewest
        layers to compile (period + leftover): compile time grows with that, not with depth."""
        kinds = [self.layer_kind(layer) for layer in range(self.n_layers)]
        best = LayerGroup(0, self.n_layers, 1)
        for period in range(1, self.n_layers + 1):
            repeats = self.n_layers // period
            if all(kinds[i] == kinds[i % period] for i in range(period * repeats)):
                compiled = period + self.n_layers - period * repeats
                if compiled < best.period + self.n_layers - best.n_layers:
                    best = LayerGroup(0, period, repeats)
        groups = [best]
        if best.n_layers < self.n_layers:
            groups.append(LayerGroup(best.n_layers, self.n_layers - best.n_layers, 1))
        return groups


def load_model_config(path: str | Path) -> ModelConfig:
    """Read and validate a configs/models/*.yaml file; ValueError says which file and field is wrong."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as error:
        raise ValueError(f"cannot read model config {path}: {error.strerror or error}") from error
    except yaml.YAMLError as error:
        raise ValueError(f"model config {path} is not valid YAML: {error}") from error
    if not isinstance(raw, dict):
        raise ValueError(f"model config {path} must be a mapping")
    raw.setdefault("name", path.stem)
    try:
        return ModelConfig.model_validate(raw)
    except ValidationError as error:
        raise ValueError(f"model config {path}: {validation_problems(error, 'model')}") from error
