"""Marin's learning-rate heuristic: the optimizer settings of a run from its tokens, width and batch.

The 535B-A23B family (configs/models/marin-*.yaml) trains as the reference run did: MuonH with the rates,
beta2 and epsilon this rule gives for the run's own token budget, a linear schedule with 1% warmup down to
5% of the peak, no clipping and no weight decay. `tokenmill train` takes these as its defaults for the
family and `tokenmill ladder plan` shows them per rung. No JAX here: the ladder and the command line read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


def warmup_steps_for(total_steps: int, fraction: float) -> int:
    """Warmup of `fraction` of the run, in whole steps (Marin: 1% of the steps)."""
    if not 0 <= fraction < 1:
        raise ValueError(f"a warmup fraction is in [0, 1), not {fraction}")
    return round(fraction * total_steps)


# --- Marin's learning-rate heuristic ---------------------------------------------------------------------


# Marin's peak rate of the Adam group (embeddings, router) over the MuonH rate of the matrices.
ADAM_TO_MUONH_LR_RATIO = 3 / 13


@dataclass(frozen=True)
class MarinHeuristic:
    """Marin's compute-scaling rule for MuonH (experiments/grug/moe_hero_ep/heuristic.py, `MoeHeuristic`).

        adam_lr  = lr_coeff x T^tokens_exp x d^dim_exp x sqrt(tokens per batch)   (capped at max_lr)
        muonh_lr = muonh_ratio x adam_lr                                          (capped at max_lr)
        beta2    = clip(beta2_base^(tokens per batch / beta2_reference_tpb), min_beta2, max_beta2)
        epsilon  = epsilon_coeff x sqrt(T / tokens per batch)

    T is the run's training tokens (steps x batch x sequence length) and d the model width. The defaults are
    the May recipe fit (marin-community/marin#5951), the heuristic of the 535B-A23B family here; `AUG_REFIT`
    holds the later per-cell refit that the hero's launcher also carries.
    """

    name: str = "may-5951"
    lr_coeff: float = 0.06602
    lr_tokens_exp: float = -0.395
    lr_dim_exp: float = -0.150
    muonh_ratio: float = 1 / ADAM_TO_MUONH_LR_RATIO
    epsilon_coeff: float = 9.676e-18
    beta1: float = 0.9062
    beta2_base: float = 0.999
    beta2_reference_tpb: int = 131_072
    min_beta2: float = 0.95
    max_beta2: float = 0.9999
    max_lr: float = 0.05
    min_lr_ratio: float = 0.05
    warmup_fraction: float = 0.01

    def adam_lr(self, tokens: float, d_model: int, tokens_per_batch: int) -> float:
        lr = (
            self.lr_coeff
            * tokens**self.lr_tokens_exp
            * d_model**self.lr_dim_exp
            * math.sqrt(tokens_per_batch)
        )
        return min(self.max_lr, lr)

    def beta2(self, tokens_per_batch: int) -> float:
        return max(
            self.min_beta2,
            min(self.max_beta2, self.beta2_base ** (tokens_per_batch / self.beta2_reference_tpb)),
        )

    def hyperparameters(self, tokens: int, d_model: int, tokens_per_batch: int) -> dict[str, Any]:
        """Settings for a run of `tokens` tokens at width d_model in batches of tokens_per_batch tokens."""
        if tokens <= 0 or d_model <= 0 or tokens_per_batch <= 0:
            raise ValueError("the heuristic needs positive tokens, width and tokens per batch")
        adam = self.adam_lr(tokens, d_model, tokens_per_batch)
        return {
            "heuristic": self.name,
            "optimizer": "muonh",
            "lr": min(self.max_lr, self.muonh_ratio * adam),
            "adam_lr": adam,
            "beta1": self.beta1,
            "beta2": self.beta2(tokens_per_batch),
            "epsilon": self.epsilon_coeff * math.sqrt(tokens / tokens_per_batch),
            "min_lr_ratio": self.min_lr_ratio,
            "warmup_fraction": self.warmup_fraction,
            "schedule": "linear",
            "clip_norm": 0.0,
            "weight_decay": 0.0,
        }


MAY_RECIPE = MarinHeuristic()
AUG_REFIT = MarinHeuristic(
    name="aug-refit", lr_coeff=0.087571, lr_tokens_exp=-0.3461, lr_dim_exp=-0.3448, beta1=0.90
)
HEURISTICS = {MAY_RECIPE.name: MAY_RECIPE, AUG_REFIT.name: AUG_REFIT}


def is_marin_family(model_cfg: Any) -> bool:
    """Whether a model shape is of the 535B-A23B family (configs/models/marin-*.yaml, tiny-marin.yaml):
    Marin's block, recognised by its expert latent projection or its GatedNorm. Such shapes train as the
    reference run did (MuonH and this heuristic) unless the command line says otherwise."""
    moe = getattr(model_cfg, "moe", None)
    return bool(getattr(moe, "latent_dim", None) or getattr(model_cfg, "gated_norm_rank", None))
