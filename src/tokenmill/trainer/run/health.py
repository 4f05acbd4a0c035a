"""Per-layer health of a train step, sampled every `logging.health_every` steps (docs/trainer.md,
"Metrics"): the norms of the parameters and of the step's update, per parameter group and per layer, the
change of the router bias and the router z-loss per layer.

A parameter group is what a person reads a norm of: `attn` (the attention projections), `experts` (the
routed experts' matrices), `shared` (the shared experts), `router`, `norms` (every norm scale and gate),
`sconv` (the short convolutions), and outside the layers each top-level parameter by its name (`embed`,
`lm_head`, ...). A group of the layers has one norm per layer, in layer order; any other, one number.
Plain functions traced into the step; the result is a few numbers per layer and group.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from tokenmill.trainer.model.shape import ModelConfig
from tokenmill.trainer.model.transformer import LAYERS


def _keys(path: tuple) -> list[str]:
    return [str(getattr(part, "key", getattr(part, "idx", part))) for part in path]


def group_of(keys: list[str]) -> str:
    """The group of a parameter inside a layer, by its path below the layer (`attn.wq`, `moe.w_up`)."""
    name = keys[-1]
    if keys[0] == "moe":
        if name in ("w_gate", "w_up", "w_down"):
            return "experts"
        if name == "router":
            return "router"
        if name.startswith("shared"):
            return "shared"
    if "norm" in name or any("norm" in key for key in keys):
        return "norms"
    if "sconv" in name or any("sconv" in key for key in keys):
        return "sconv"
    return keys[0] if keys[0] in ("attn", "moe") else "other"


def squared_norms(tree: Any, cfg: ModelConfig) -> dict[str, jax.Array]:
    """Sum of squares by group: a [n_layers] vector for the layers' groups, a scalar for the rest."""
    sums: dict[str, jax.Array] = {}
    if isinstance(tree, dict) and LAYERS in tree:
        for group, stacked in zip(cfg.layer_groups(), tree[LAYERS], strict=True):
            for position, layer_tree in enumerate(stacked):
                for path, leaf in jax.tree_util.tree_flatten_with_path(layer_tree)[0]:
                    name = group_of(_keys(path))
                    square = jnp.sum(jnp.square(leaf.astype(jnp.float32)), axis=tuple(range(1, leaf.ndim)))
                    layers = group.start + jnp.arange(leaf.shape[0]) * group.period + position
                    total = sums.get(name, jnp.zeros((cfg.n_layers,), jnp.float32))
                    sums[name] = total.at[layers].add(square)
        rest = {key: value for key, value in tree.items() if key != LAYERS}
    else:
        rest = tree
    for key, subtree in rest.items():
        leaves = jax.tree.leaves(subtree)
        sums[key] = sum(jnp.sum(jnp.square(leaf.astype(jnp.float32))) for leaf in leaves)
    return sums


def health(old_params: Any, new_params: Any, old_bias: jax.Array, new_bias: jax.Array, z_loss: jax.Array,
           cfg: ModelConfig) -> dict[str, Any]:  # fmt: skip
    """The sampled metrics of one step: parameter and update norms per group, the router bias's change
    and the router z-loss per layer."""
    update = jax.tree.map(lambda new, old: new.astype(jnp.float32) - old.astype(jnp.float32), new_params,
                          old_params)  # fmt: skip
    return {
        "param_norms": jax.tree.map(jnp.sqrt, squared_norms(new_params, cfg)),
        "update_norms": jax.tree.map(jnp.sqrt, squared_norms(update, cfg)),
        "router_bias_change": jnp.linalg.norm(new_bias - old_bias, axis=-1),
        "router_z_loss_layers": z_loss,
    }
