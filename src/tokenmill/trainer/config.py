"""Model shapes: the schema of configs/models/*.yaml and its loader.

A model file names the transformer's shape and its mixture-of-experts layer, nothing about training. Shapes
are validated here once, so that model.py can trust them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

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
    # Hidden size of each shared expert; the shared experts are run as one SwiGLU of n_shared * this width.
    shared_hidden: int | None = None
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
    load_balance_loss: float = 0.0
    z_loss: float = 0.0
    dispatch: Literal["capacity", "dropless"] = "capacity"
    capacity_factor: float = 1.25

    @model_validator(mode="after")
    def _check(self) -> MoEConfig:
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k ({self.top_k}) must be between 1 and n_experts ({self.n_experts})")
        if self.balancing == "quantile" and self.top_k >= self.n_experts:
            raise ValueError("quantile balancing needs top_k < n_experts (it reads the (k+1)-th score)")
        if self.capacity_factor <= 0:
            raise ValueError("capacity_factor must be positive")
        return self

    @property
    def shared_width(self) -> int:
        """Hidden width of the fused shared-expert SwiGLU (0 when there are none)."""
        return self.n_shared_experts * (self.shared_hidden or self.expert_hidden)


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
    seq_len: int
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    qk_norm: bool = True
    sliding_window: int | None = None
    # Layers (0-based) that attend only to the last `sliding_window` tokens; the others attend globally.
    sliding_window_layers: list[int] = []
    init_std: float = 0.02
    moe: MoEConfig

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even (rotary embeddings rotate pairs)")
        bad = [i for i in self.sliding_window_layers if not 0 <= i < self.n_layers]
        if bad:
            raise ValueError(f"sliding_window_layers {bad} outside 0..{self.n_layers - 1}")
        if self.sliding_window_layers and not self.sliding_window:
            raise ValueError("sliding_window_layers given without sliding_window")
        return self

    def window(self, layer: int) -> int | None:
        """The attention window of a layer, or None for global attention."""
        return self.sliding_window if layer in self.sliding_window_layers else None


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
