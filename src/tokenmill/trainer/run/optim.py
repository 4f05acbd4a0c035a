"""Learning-rate schedules that span phases, the optimizers, and Marin's learning-rate heuristic.

A schedule is a function of the global step over the whole run, not of one phase: pretraining runs the
warmup and the stable part, and midtraining, started from pretraining's last checkpoint, continues at its
own start step and therefore gets the decay. By default the decay is exactly the last phase.

Three optimizers, all optax compositions (`make_optimizer`); their defaults for the Marin family come from
Marin's learning-rate heuristic (`tokenmill.trainer.run.heuristic`):

- "adamw": AdamW everywhere (weight decay on matrices only), after global-norm clipping.
- "muon": Muon on hidden matrices with Moonlight's RMS matching, AdamW on embeddings, head and vectors.
- "muonh": the reference run's optimizer (Marin's MuonH, docs/trainer.md). Hidden matrices take a Nesterov
  momentum (0.95), five quintic Newton-Schulz steps and the *hyperball* step: move each matrix by lr x its
  own Frobenius norm along the orthogonalised direction, then rescale it back onto the sphere of its
  norm, so every matrix keeps the Frobenius norm it was initialised with (no weight decay is needed, none
  is applied). The output head takes AdamH (Adam's direction, the same hyperball step, at the MuonH rate);
  embeddings, router, attention gates, SConv kernels and norm scales take plain Adam at their own rate. No
  clipping.

The train step applies the chosen rule through `LayerwiseOptimizer`: the stacked layers one slice at a time
under a loop, so that a device holds one slice's optimizer state and Newton-Schulz temporaries at a time
(and, with the state in pinned host memory, brings only that slice's state over).

Every optimizer here takes the learning rate at update time (`tx.update(..., learning_rate=lr)`) and returns
the parameter increments: the hyperball step is not linear in the rate, so the rate cannot be multiplied
onto a unit-rate update afterwards, and handing optax the schedule would evaluate it at optax's own step
counter, which restarts or lags when a phase starts from an earlier phase's checkpoint. The train step
evaluates the schedule at the global step in the train state and passes the value in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax

from tokenmill.trainer.model.transformer import LAYERS, layer_axes

OptimizerKind = Literal["adamw", "muon", "muonh"]

# Marin's "quintic" Newton-Schulz schedule: one (a, b, c) per step of X <- aX + (bA + cA^2)X, A = XX^T,
# tuned for five steps (NVIDIA Emerging-Optimizers' coefficients, as levanter.optim.util names them).
QUINTIC_NS_COEFFICIENTS = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)
NS_EPS = 1e-8
# Below this norm a matrix or an update counts as zero: the hyperball step divides by both.
NORM_FLOOR = 1e-10


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


# --- the transformations ---------------------------------------------------------------------------------


def _matrix_dims(leaf: jax.Array) -> optax.contrib.MuonDimensionNumbers:
    """The last two axes are one matrix [fan_in, fan_out]; leading axes (layer repeats, experts) are a
    batch."""
    return optax.contrib.MuonDimensionNumbers(reduction_axis=leaf.ndim - 2, output_axis=leaf.ndim - 1)


def _frobenius(x: jax.Array) -> jax.Array:
    x = x.astype(jnp.float32)
    return jnp.sqrt(jnp.sum(x * x, axis=(-2, -1), keepdims=True))


def orthogonalise(
    x: jax.Array, coefficients: tuple = QUINTIC_NS_COEFFICIENTS, eps: float = NS_EPS
) -> jax.Array:
    """Newton-Schulz orthogonalisation of each matrix [..., in, out] (leading axes: a batch of matrices).

    Each matrix is divided by its Frobenius norm (its singular values are then at most 1), transposed when
    taller than wide (A = XX^T is then the smaller Gram matrix), and iterated X <- aX + (bA + cA^2)X once per
    (a, b, c). For X = U S V^T the result is U S' V^T: the quintic schedule brings every singular value
    above 1% of the largest into about [0.97, 1.15]. Runs in fp32 (Marin runs it in bf16).
    """
    work = x.astype(jnp.float32)
    work = work / (_frobenius(work) + eps)
    tall = work.shape[-2] > work.shape[-1]
    if tall:
        work = jnp.swapaxes(work, -1, -2)
    for a, b, c in coefficients:
        gram = work @ jnp.swapaxes(work, -1, -2)
        work = a * work + (b * gram + c * gram @ gram) @ work
    if tall:
        work = jnp.swapaxes(work, -1, -2)
    return work.astype(x.dtype)


def newton_schulz(
    coefficients: tuple[tuple[float, float, float], ...] = QUINTIC_NS_COEFFICIENTS, eps: float = NS_EPS
) -> optax.GradientTransformation:
    """Replace each matrix update by its orthogonalisation (`orthogonalise`), matrix by matrix."""

    def update_fn(updates: Any, state: optax.EmptyState, params: Any = None) -> tuple[Any, optax.EmptyState]:
        del params
        return jax.tree.map(lambda u: _orthogonalise_whole(u, coefficients, eps), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def _orthogonalise_whole(u: jax.Array, coefficients: tuple, eps: float) -> jax.Array:
    """`orthogonalise` a stack of matrices [..., in, out] on a mesh with each device holding whole matrices.

    Newton-Schulz needs every entry of a matrix, but the parameters are sharded inside their matrices
    (fsdp on d_model), so XLA would gather each expert leaf's matrices over fsdp for every layer at once
    ([12, 48, 3072, 3072] fp32 per leaf per device for the 535B, several times over in the iteration's
    temporaries). When a leading axis (experts: 384) divides by the whole mesh, the stack is split over the
    mesh along it instead (an all-to-all that keeps the bytes per device), each device orthogonalises its
    own matrices, and the result returns to the parameter's sharding. Otherwise (a layer stack of 12
    matrices on 64 devices), XLA's partitioner decides, as without a mesh.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if u.ndim < 3 or mesh.empty:
        return orthogonalise(u, coefficients, eps)
    # Experts' axis first: param_spec splits experts over "expert", so the all-to-all stays within fsdp.
    axes = tuple(sorted((n for n in mesh.axis_names if mesh.shape[n] > 1), key=lambda n: n != "expert"))
    size = math.prod(mesh.shape[n] for n in axes)
    leading = [dim for dim in range(u.ndim - 2) if u.shape[dim] % size == 0]
    if not axes or not leading:
        return orthogonalise(u, coefficients, eps)
    spec = [None] * u.ndim
    spec[max(leading, key=lambda dim: u.shape[dim])] = axes
    whole = jax.lax.with_sharding_constraint(u, jax.sharding.PartitionSpec(*spec))
    return orthogonalise(whole, coefficients, eps)


def hyperball_step() -> optax.GradientTransformationExtraArgs:
    """Marin's scale-invariant step: each matrix moves by lr x its norm along the update, then returns to
    its norm.

        moved = W - lr * U * |W| / |U|        new = moved * |W| / |moved|        (|.|: Frobenius, per matrix)

    Returns new - W, so that optax.apply_updates lands on the sphere. A stacked leaf [..., in, out] keeps
    one norm per matrix (each expert on its own sphere). A zero matrix stays zero: route zero-initialised
    weights to Adam.
    """

    def update_fn(
        updates: Any, state: optax.EmptyState, params: Any = None, *, learning_rate: Any = 1.0, **extra: Any
    ) -> tuple[Any, optax.EmptyState]:
        del extra
        if params is None:
            raise ValueError("the hyperball step needs the parameters (their norms are the radii)")

        def step(u: jax.Array, w: jax.Array) -> jax.Array:
            radius = _frobenius(w)
            moved = w - learning_rate * u * (radius / jnp.maximum(_frobenius(u), NORM_FLOOR))
            new = moved * (radius / jnp.maximum(_frobenius(moved), NORM_FLOOR))
            return (new - w).astype(w.dtype)

        return jax.tree.map(step, updates, params), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update_fn)


def times_learning_rate(factor: float = 1.0) -> optax.GradientTransformationExtraArgs:
    """Multiply the updates by factor x the learning rate passed to update()."""

    def update_fn(
        updates: Any, state: optax.EmptyState, params: Any = None, *, learning_rate: Any = 1.0, **extra: Any
    ) -> tuple[Any, optax.EmptyState]:
        del params, extra
        return jax.tree.map(lambda u: (factor * learning_rate * u).astype(u.dtype), updates), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update_fn)


def muonh_matrix(momentum: float = 0.95, coefficients: tuple = QUINTIC_NS_COEFFICIENTS):
    """MuonH on a group of matrices: Nesterov momentum (m = mu m + g, u = mu m + g), Newton-Schulz, hyperball.

    The momentum's scale does not matter (Newton-Schulz normalises it away), so optax.trace is Marin's
    buffer exactly.
    """
    return optax.chain(
        optax.trace(decay=momentum, nesterov=True), newton_schulz(coefficients), hyperball_step()
    )


def adamh_matrix(b1: float, b2: float, eps: float) -> optax.GradientTransformationExtraArgs:
    """AdamH: bias-corrected Adam's direction m / (sqrt(v) + eps), then the hyperball step."""
    return optax.chain(optax.scale_by_adam(b1, b2, eps), hyperball_step())


# --- which parameter takes which rule --------------------------------------------------------------------

# Keys (at any level of a parameter's path) whose leaves stay on plain Adam under MuonH, whatever their
# shape: the embedding table (its rows are per token, not a linear map), the router (its logits feed the
# balancing), the attention gate `attn.gate` (zero-initialised: a zero matrix cannot live on a hyperball)
# and the SConv kernels (sconv_k, sconv_attn, ...). GatedNorm's projections (`*_gated_norm.down/up`) are
# matrices like any other and take MuonH, as in Marin's routing.
ADAM_KEYS = frozenset({"embed", "router", "gate"})
ADAM_KEY_PREFIXES = ("sconv",)
ADAMH_KEYS = frozenset({"lm_head"})


def _keys(path: tuple) -> list[str]:
    return [str(getattr(entry, "key", getattr(entry, "idx", entry))) for entry in path]


def _layer_ndim(path: tuple, leaf: jax.Array) -> int:
    """A parameter's dimensions as one layer sees them: the stacked layers' repeat axis is a batch axis,
    so a stacked norm scale [repeats, d] is still a vector and a stacked matrix is still one matrix each."""
    return leaf.ndim - layer_axes(path)


def optimizer_groups(params: Any) -> Any:
    """The MuonH group of each leaf: "muonh" (hidden matrices, GatedNorm's projections, experts),
    "adamh" (the output head) or "adam" (embedding, router, attention gate, SConv kernels, vectors)."""

    def group(path: tuple, leaf: jax.Array) -> str:
        keys = _keys(path)
        if ADAMH_KEYS.intersection(keys):
            return "adamh"
        if (
            _layer_ndim(path, leaf) < 2
            or ADAM_KEYS.intersection(keys)
            or any(k.startswith(ADAM_KEY_PREFIXES) for k in keys)
        ):
            return "adam"
        return "muonh"

    return jax.tree_util.tree_map_with_path(group, params)


def _is_matrix(path: tuple, leaf: jax.Array) -> bool:
    return _layer_ndim(path, leaf) >= 2


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
        if _layer_ndim(path, leaf) < 2 or "embed" in name or "lm_head" in name:
            return None
        return _matrix_dims(leaf)

    return jax.tree_util.tree_map_with_path(dims, params)


def make_optimizer(
    kind: OptimizerKind = "adamw",
    weight_decay: float = 0.1,
    clip_norm: float | None = 1.0,
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
    adam_lr_ratio: float = 1.0,
    momentum: float = 0.95,
) -> optax.GradientTransformationExtraArgs:
    """The optimizer; `update(grads, state, params, learning_rate=lr)` returns the parameter increments.

    clip_norm: global-norm clipping of the gradients first (None or 0: none, as in the reference run).
    adam_lr_ratio (muonh only): the Adam group's rate over the learning rate passed in (Marin: 3/13; the
    MuonH and AdamH groups take the rate itself). weight_decay: AdamW's decoupled decay on matrices; under
    muonh it applies to the Adam group only (the reference run uses 0: the hyperball fixes every other
    matrix's norm).

    The rule reads which group a parameter is in from its path and shape when it is applied, so the same
    rule serves the whole tree or one slice of the stacked layers (`LayerwiseOptimizer`).
    """
    if kind == "adamw":
        inner = optax.chain(
            optax.adamw(1.0, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=_decay_mask),
            times_learning_rate(),
        )
    elif kind == "muon":
        inner = optax.chain(
            optax.contrib.muon(
                1.0,
                weight_decay=weight_decay,
                weight_decay_mask=_decay_mask,
                adam_b1=b1,
                adam_b2=b2,
                adam_weight_decay=weight_decay,
                # A function of the tree it is given: the layer-by-layer update hands it one slice of
                # the layers at a time.
                muon_weight_dimension_numbers=_muon_dims,
                # Moonlight's scaling: Muon's updates get AdamW's RMS, so one learning rate serves both.
                consistent_rms=0.2,
            ),
            times_learning_rate(),
        )
    elif kind == "muonh":
        adam = [optax.scale_by_adam(b1, b2, eps)]
        if weight_decay:
            adam.append(optax.add_decayed_weights(weight_decay, _decay_mask))
        inner = optax.partition(
            {
                "muonh": muonh_matrix(momentum),
                "adamh": adamh_matrix(b1, b2, eps),
                "adam": optax.chain(*adam, times_learning_rate(-adam_lr_ratio)),
            },
            optimizer_groups,
        )
    else:
        raise ValueError(f"unknown optimizer {kind!r} (adamw, muon or muonh)")
    if clip_norm:
        return optax.chain(optax.clip_by_global_norm(clip_norm), inner)
    return optax.chain(inner)


# --- the train step's optimizer: one layer slice at a time -----------------------------------------------


StateMemory = Literal["device", "pinned_host"]


class LayerwiseOptimizer:
    """The optimizer as the train step runs it: `rule` (make_optimizer's, without clipping) applied to the
    parameters outside the stacked layers as one tree, and to each layer group's stack one slice (one pass
    of the group's body: `period` layers) at a time, under a `jax.lax.fori_loop`.

    Why: applied to the whole tree at once, the update holds every layer's optimizer state on the device
    together with every layer's Newton-Schulz temporaries, on top of the parameters and the gradients: for
    the 535B on 64 devices that is the 40 GB of MuonH state brought from the host plus tens of GB of fp32
    iteration temporaries, and it did not fit 186 GB. Slice by slice, a device holds one slice's state and
    temporaries (1/12 of the 535B's), the parameters are updated in place (dynamic-update-slice into the
    donated stack), and with `state_memory="pinned_host"` each slice's state comes from the host's pinned
    memory just before its update and goes back just after, so the state's device footprint is one slice
    whatever the depth. Memory on device: parameters + gradients + one slice's state and temporaries.

    The state is `{"rest": rule state of the non-layer parameters, "layers": [per group: the rule's state
    of one slice, vmapped over the group's repeats]}`: every state leaf under "layers" (Adam's counts too)
    has the group's leading repeat axis, which the loop slices. Every slice takes the same step, so the
    result equals the rule applied to the whole tree (tested), counts included.

    Clipping (`clip_norm`, as optax.clip_by_global_norm) needs the norm of every gradient before any slice
    updates, so it is a scale computed first and applied to each slice as it is read, together with
    `grad_scale` (gradient accumulation's 1/N): neither makes a scaled copy of the gradients.
    """

    def __init__(
        self,
        rule: optax.GradientTransformationExtraArgs,
        clip_norm: float | None = None,
        state_memory: StateMemory = "device",
    ):
        self.rule = rule
        self.clip_norm = clip_norm
        self.state_memory = state_memory

    def init(self, params: Any) -> dict:
        rest, groups = _split_layers(params)
        return {"rest": self.rule.init(rest), LAYERS: [jax.vmap(self.rule.init)(group) for group in groups]}

    def apply(
        self,
        grads: Any,
        state: dict,
        params: Any,
        learning_rate: Any,
        grad_scale: Any = 1.0,
        grad_norm: jax.Array | None = None,
    ) -> tuple[Any, dict, jax.Array]:
        """(new parameters, new state, the gradients' global norm) for gradients `grads x grad_scale`;
        `grad_norm`, when the caller has it already (the step's guard), is that norm."""
        if grad_norm is None:
            grad_norm = optax.tree.norm(grads) * grad_scale
        scale = jnp.asarray(grad_scale, jnp.float32)
        if self.clip_norm:
            scale = scale * jnp.where(grad_norm < self.clip_norm, 1.0, self.clip_norm / grad_norm)

        def update(grad: Any, opt_state: Any, param: Any) -> tuple[Any, Any]:
            grad = jax.tree.map(lambda g, p: (g.astype(jnp.float32) * scale).astype(p.dtype), grad, param)
            opt_state = self._to(opt_state, jax.memory.Space.Device)
            updates, opt_state = self.rule.update(grad, opt_state, param, learning_rate=learning_rate)
            return optax.apply_updates(param, updates), self._to(opt_state, jax.memory.Space.Host)

        (rest_grads, group_grads), (rest_params, groups) = _split_layers(grads), _split_layers(params)
        new_rest, rest_state = update(rest_grads, state["rest"], rest_params)
        new_groups, group_states = [], []
        for group_grad, group_state, group in zip(group_grads, state[LAYERS], groups, strict=True):

            def one_slice(index: jax.Array, carry: tuple, group_grad: Any = group_grad) -> tuple:
                take = lambda leaf: jax.lax.dynamic_index_in_dim(leaf, index, keepdims=False)  # noqa: E731
                put = lambda leaf, value: jax.lax.dynamic_update_index_in_dim(leaf, value, index, 0)  # noqa: E731
                group, group_state = carry
                slices = (jax.tree.map(take, tree) for tree in (group_grad, group_state, group))
                new, new_state = update(*slices)
                return jax.tree.map(put, group, new), jax.tree.map(put, group_state, new_state)

            # Parameters and state are the loop's carry, each slice written back in place (a scan's stacked
            # output would be a second copy of the state). XLA:CPU still copies the carried state once
            # (docs/trainer.md, "What fills the 535B's device").
            repeats = jax.tree.leaves(group)[0].shape[0]
            group, group_state = jax.lax.fori_loop(0, repeats, one_slice, (group, group_state))
            new_groups.append(group)
            group_states.append(group_state)
        new_params = {**new_rest, LAYERS: new_groups} if groups else new_rest
        return new_params, {"rest": rest_state, LAYERS: group_states}, grad_norm

    def _to(self, tree: Any, space: jax.memory.Space) -> Any:
        if self.state_memory == "device":
            return tree
        return jax.device_put(tree, space)


def _split_layers(tree: Any) -> tuple[Any, list]:
    """(the tree without its stacked layers, the list of layer groups): params, gradients or the like."""
    if isinstance(tree, dict) and LAYERS in tree:
        return {key: value for key, value in tree.items() if key != LAYERS}, list(tree[LAYERS])
    return tree, []
