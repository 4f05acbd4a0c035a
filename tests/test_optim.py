"""The reference run's optimizer and schedule: Newton-Schulz, MuonH's hyperball, AdamH, the parameter
groups, Marin's learning-rate heuristic for the hero and the rungs, and the linear 1%-warmup schedule.

The MuonH check runs an independent NumPy version of Marin's update (momentum, quintic Newton-Schulz,
hyperball) written from the formulas, not from tokenmill's code."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokenmill.trainer.model.shape import load_model_config
from tokenmill.trainer.run.heuristic import AUG_REFIT, MAY_RECIPE, is_marin_family, warmup_steps_for
from tokenmill.trainer.run.optim import (
    LayerwiseOptimizer,
    Schedule,
    make_optimizer,
    optimizer_groups,
    orthogonalise,
)

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "configs" / "models"

#: Unoptimised CPU code generation for the programs compiled here, which run a few times on tiny shapes:
#: compiling at LLVM's default level took about twice as long (test_expert_parallel.py sets the same level
#: for its processes). The results differ from the default level's in the last bit at most.
QUICK_COMPILE = {"xla_backend_optimization_level": 0}

# Marin's "quintic" coefficient schedule, typed here from levanter.optim.util for the reference.
QUINTIC = [
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
]


def reference_newton_schulz(x: np.ndarray) -> np.ndarray:
    x = x / (np.linalg.norm(x) + 1e-8)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    for a, b, c in QUINTIC:
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def reference_muonh(
    w: np.ndarray, grads: list[np.ndarray], lrs: list[float], beta: float = 0.95
) -> np.ndarray:
    buffer = np.zeros_like(w)
    for g, lr in zip(grads, lrs, strict=True):
        buffer = beta * buffer + g
        direction = reference_newton_schulz(beta * buffer + g)
        radius = np.linalg.norm(w)
        moved = w - lr * direction * radius / np.linalg.norm(direction)
        w = moved * radius / np.linalg.norm(moved)
    return w


#: Draws of at most this many values come from one compiled program (`random`).
_DRAW = 1 << 13


@functools.cache
def _draw(seed: int) -> np.ndarray:
    return np.asarray(jax.random.normal(jax.random.key(seed), (_DRAW,), jnp.float32))


def random(shape: tuple[int, ...], seed: int) -> jax.Array:
    """jax.random.normal(key(seed), shape), value for value: threefry's counters are partitionable (each
    value depends on its flat index alone), so a shape's values are the first ones of a longer draw. One
    compiled draw serves every shape here; each new shape would otherwise compile its own (0.2-0.7 s)."""
    size = math.prod(shape)
    if size > _DRAW:
        return jax.random.normal(jax.random.key(seed), shape, jnp.float32)
    return jnp.asarray(_draw(seed)[:size].reshape(shape))


# Whole trees in one compiled program each: an op outside jit compiles once per leaf shape (about 20 here).
@jax.jit
def scaled(tree, factor: float):
    return jax.tree.map(lambda leaf: factor * leaf, tree)


@jax.jit
def plus(tree, updates):
    return jax.tree.map(jnp.add, tree, updates)


# -- Newton-Schulz -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(48, 24), (24, 48), (32, 32)], ids=["tall", "wide", "square"])
def test_newton_schulz_orthogonalises_and_keeps_the_singular_vectors(shape):
    rng = np.random.default_rng(0)
    m, n = shape
    u, _ = np.linalg.qr(rng.normal(size=(m, min(m, n))))
    v, _ = np.linalg.qr(rng.normal(size=(n, min(m, n))))
    singular = np.geomspace(1.0, 0.02, min(m, n))  # condition number 50
    x = (u * singular) @ v.T
    out = np.asarray(orthogonalise(jnp.asarray(x, jnp.float32)), np.float64)
    s = np.linalg.svd(out, compute_uv=False)
    assert 0.9 < s.min() and s.max() < 1.2, (s.min(), s.max())
    # The polar factor U V^T, not merely some orthogonal matrix: the singular vectors are kept.
    assert np.abs(out - u @ v.T).max() < 0.15
    np.testing.assert_allclose(out, reference_newton_schulz(x), atol=2e-4)
    # Scale-free: the input's norm (the momentum's scale) does not matter.
    np.testing.assert_allclose(orthogonalise(jnp.asarray(1e3 * x, jnp.float32)), out, atol=1e-4)


def test_newton_schulz_treats_a_stack_as_separate_matrices():
    stack = random((3, 16, 8), 1) * jnp.array([1.0, 1e-3, 1e3])[:, None, None]
    out = orthogonalise(stack)
    for e in range(3):
        np.testing.assert_allclose(out[e], orthogonalise(stack[e]), atol=1e-5)
        s = jnp.linalg.svd(out[e], compute_uv=False)
        assert float(s.min()) > 0.5 and float(s.max()) < 1.3


# -- MuonH, AdamH and Adam ---------------------------------------------------------------------------------


def params_like_marin() -> dict:
    """The model's layout: layers stacked by group and position, here one group of one layer (repeat 1)."""
    layer = {
        "attn": {"wq": random((16, 24), 2), "gate": jnp.zeros((16, 3)), "sconv_k": jnp.ones((4, 8))},
        "attn_gated_norm": {"down": random((16, 4), 3), "up": random((4, 16), 4)},
        "moe": {
            "router": random((16, 6), 5),
            "w_up": random((6, 16, 8), 6),
            "latent_norm": jnp.ones(8),
        },
        "attn_norm": jnp.ones(16),
    }
    return {
        "embed": random((64, 16), 0),
        "lm_head": random((16, 64), 1) * 0.1,
        "layers": [[jax.tree.map(lambda leaf: leaf[None], layer)]],
    }


def first_layer(params: dict) -> dict:
    return jax.tree.map(lambda leaf: leaf[0], params["layers"][0][0])


def test_parameter_groups_follow_marins_routing():
    groups = optimizer_groups(params_like_marin())
    layer = groups["layers"][0][0]
    assert (groups["embed"], groups["lm_head"]) == ("adam", "adamh")
    assert layer["attn"] == {"wq": "muonh", "gate": "adam", "sconv_k": "adam"}
    assert layer["attn_gated_norm"] == {"down": "muonh", "up": "muonh"}
    assert layer["moe"] == {"router": "adam", "w_up": "muonh", "latent_norm": "adam"}
    assert layer["attn_norm"] == "adam"


def test_parameter_groups_of_the_tiny_marin_model():
    from tokenmill.trainer.model import transformer

    cfg = load_model_config(MODELS / "tiny-marin.yaml")
    shapes = jax.eval_shape(lambda key: transformer.init_params(key, cfg), jax.random.key(0))
    flat = {
        jax.tree_util.keystr(path): group
        for path, group in jax.tree_util.tree_flatten_with_path(optimizer_groups(shapes))[0]
    }
    assert flat["['embed']"] == "adam" and flat["['lm_head']"] == "adamh"
    layer = {key.split("]", 3)[3]: group for key, group in flat.items() if key.startswith("['layers'][0][0]")}
    assert layer["['moe']['router']"] == "adam" and layer["['attn']['gate']"] == "adam"
    assert all(group == "adam" for key, group in layer.items() if "sconv" in key)
    assert all(
        group == "muonh" for key, group in layer.items() if "gated_norm" in key or "latent_" in key[:12]
    )
    assert layer["['moe']['w_gate']"] == layer["['attn']['wq']"] == "muonh"


def test_muonh_matches_an_independent_reference_and_stays_on_the_hyperball():
    params = params_like_marin()
    tx = make_optimizer("muonh", weight_decay=0.0, clip_norm=None)
    state = tx.init(params)
    lrs = [0.02, 0.05, 0.01, 0.03]
    history = []
    for step, lr in enumerate(lrs):
        grads = scaled(jax.tree.map(lambda x, s=step: random(x.shape, 100 + s), params), 5.0)
        history.append(grads)
        updates, state = jax.jit(tx.update, compiler_options=QUICK_COMPILE)(
            grads, state, params, learning_rate=lr
        )
        params = plus(params, updates)
    start = params_like_marin()
    wq = reference_muonh(
        np.asarray(first_layer(start)["attn"]["wq"], np.float64),
        [np.asarray(first_layer(g)["attn"]["wq"], np.float64) for g in history],
        lrs,
    )
    np.testing.assert_allclose(first_layer(params)["attn"]["wq"], wq, atol=2e-4)
    # Each matrix keeps its own Frobenius norm: the gated norm's projections and every expert separately.
    layer, first = first_layer(params), first_layer(start)
    for new, old in [
        (layer["attn"]["wq"], first["attn"]["wq"]),
        (layer["attn_gated_norm"]["down"], first["attn_gated_norm"]["down"]),
        (params["lm_head"], start["lm_head"]),  # AdamH
    ]:
        assert float(jnp.linalg.norm(new)) == pytest.approx(float(jnp.linalg.norm(old)), rel=1e-5)
        assert float(jnp.abs(new - old).max()) > 1e-3  # and it did move
    expert_norms = [jnp.linalg.norm(w["moe"]["w_up"], axis=(1, 2)) for w in (layer, first)]
    np.testing.assert_allclose(expert_norms[0], expert_norms[1], rtol=1e-5)
    # The Adam group moves freely: the zero-initialised attention gate leaves zero.
    assert float(jnp.abs(layer["attn"]["gate"]).max()) > 0


def test_muonh_step_is_a_fixed_fraction_of_the_norm_whatever_the_gradients_scale():
    params = {"w": random((32, 16), 7)}
    tx = make_optimizer("muonh", weight_decay=0.0, clip_norm=None)
    steps = []
    for scale in (1e-3, 1.0, 1e6):  # no clipping, and none needed: the step does not see the scale
        grads = {"w": random((32, 16), 8) * scale}
        updates, _ = tx.update(grads, tx.init(params), params, learning_rate=0.1)
        steps.append(np.asarray(updates["w"]))
    np.testing.assert_allclose(steps[0], steps[2], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(steps[1], steps[2], rtol=1e-4, atol=1e-6)
    # One step turns W by at most asin(lr): |W_new - W| / |W| = 2 sin(angle / 2) <= 2 sin(asin(0.1) / 2).
    ratio = float(np.linalg.norm(steps[1]) / jnp.linalg.norm(params["w"]))
    assert 0.05 < ratio <= 2 * math.sin(math.asin(0.1) / 2) + 1e-6
    updates, _ = tx.update(grads, tx.init(params), params, learning_rate=0.0)
    assert float(jnp.abs(updates["w"]).max()) < 1e-6


def test_adam_group_rate_is_its_own():
    params = {"embed": random((8, 4), 9), "w": random((4, 4), 10)}
    grads = jax.tree.map(lambda x: random(x.shape, 11), params)
    tx = make_optimizer("muonh", weight_decay=0.0, clip_norm=None, adam_lr_ratio=3 / 13)
    updates, _ = tx.update(grads, tx.init(params), params, learning_rate=0.013)
    # Adam's first step is lr x sign(g) (bias-corrected m / sqrt(v) = g / |g|, eps aside).
    np.testing.assert_allclose(updates["embed"], -0.013 * 3 / 13 * jnp.sign(grads["embed"]), rtol=1e-4)


def test_adamw_and_muon_take_the_rate_at_update_time():
    params = {"w": random((8, 4), 12), "norm": jnp.ones(4)}
    grads = jax.tree.map(lambda x: random(x.shape, 13), params)
    for kind in ("adamw", "muon"):
        tx = make_optimizer(kind, weight_decay=0.0)
        unit, _ = tx.update(grads, tx.init(params), params)
        scaled, _ = tx.update(grads, tx.init(params), params, learning_rate=0.25)
        np.testing.assert_allclose(scaled["w"], 0.25 * unit["w"], rtol=1e-6)


# -- Marin's heuristic -------------------------------------------------------------------------------------

# (d_model, racks, steps) of the ladder as run; tokens = steps x racks x 1,024 x 4,096.
RUNS = {"d768": (768, 1, 11_420), "d1024": (1024, 2, 15_276), "d1536": (1536, 6, 15_128),
        "d2048": (2048, 11, 20_072), "d6144": (6144, 11, 390_251)}  # fmt: skip
# adam = 0.06602 T^-0.395 d^-0.15 sqrt(tokens per batch) and muonh = 13/3 adam, worked out by hand.
EXPECTED = {
    "d768": (3.0162860e-3, 1.3070573e-2, 0.96849108),
    "d1024": (2.7697091e-3, 1.2002073e-2, 0.95),
    "d1536": (2.9362181e-3, 1.2723612e-2, 0.95),
    "d2048": (2.6802681e-3, 1.1614495e-2, 0.95),
    "d6144": (7.0396728e-4, 3.0505249e-3, 0.95),
}


@pytest.mark.parametrize("rung", sorted(RUNS))
def test_heuristic_gives_the_reference_runs_rates(rung):
    d, racks, steps = RUNS[rung]
    tokens_per_batch = racks * 1024 * 4096
    settings = MAY_RECIPE.hyperparameters(steps * tokens_per_batch, d, tokens_per_batch)
    adam, muonh, beta2 = EXPECTED[rung]
    assert settings["adam_lr"] == pytest.approx(adam, rel=1e-6)
    assert settings["lr"] == pytest.approx(muonh, rel=1e-6)
    assert settings["lr"] / settings["adam_lr"] == pytest.approx(13 / 3)
    assert settings["beta2"] == pytest.approx(beta2, rel=1e-7)
    assert (settings["schedule"], settings["min_lr_ratio"], settings["warmup_fraction"]) == (
        "linear",
        0.05,
        0.01,
    )
    assert settings["clip_norm"] == 0 and settings["weight_decay"] == 0


def test_heuristic_edges():
    # beta2 = 0.999^(tokens per batch / 131,072), clipped to [0.95, 0.9999]: one 4,096-token sequence...
    assert MAY_RECIPE.beta2(4096) == 0.9999
    assert MAY_RECIPE.beta2(131_072) == pytest.approx(0.999)
    # ... and the rate is capped at 0.05 for a tiny run.
    tiny = MAY_RECIPE.hyperparameters(100_000, 64, 1024)
    assert tiny["lr"] == 0.05 and tiny["adam_lr"] < 0.05
    hero = MAY_RECIPE.hyperparameters(390_251 * 11_264 * 4096, 6144, 11_264 * 4096)
    assert hero["epsilon"] == pytest.approx(9.676e-18 * math.sqrt(390_251))
    assert AUG_REFIT.hyperparameters(390_251 * 11_264 * 4096, 6144, 11_264 * 4096)["lr"] != hero["lr"]
    with pytest.raises(ValueError):
        MAY_RECIPE.hyperparameters(0, 64, 1024)


def test_marin_family_is_recognised_by_its_block():
    assert all(is_marin_family(load_model_config(path)) for path in MODELS.glob("*marin*.yaml"))
    assert not is_marin_family(load_model_config(MODELS / "tiny.yaml"))


# -- the schedule ------------------------------------------------------------------------------------------


def test_linear_schedule_with_one_percent_warmup_down_to_five_percent():
    total = 390_251
    warmup = warmup_steps_for(total, 0.01)
    assert warmup == 3_903  # round(3,902.51)
    schedule = Schedule("linear", 3e-3, total, warmup, 0, 0.05)
    assert float(schedule(0)) == pytest.approx(3e-3 / warmup)
    assert float(schedule(warmup - 1)) == pytest.approx(3e-3)
    assert float(schedule(warmup)) == pytest.approx(3e-3)
    midpoint = warmup + (total - warmup) // 2
    assert float(schedule(midpoint)) == pytest.approx(3e-3 * (0.05 + 0.95 * 0.5), rel=1e-4)
    assert float(schedule(total)) == pytest.approx(3e-3 * 0.05)
    # The phase boundary (midtraining from step 312,192) is not a kink: one line from warmup to the end.
    before, at, after = (float(schedule(s)) for s in (312_191, 312_192, 312_193))
    assert before - at == pytest.approx(at - after, rel=1e-3)


# -- the train step's layer-by-layer update ----------------------------------------------------------------


def params_with_two_groups() -> dict:
    """Two layer groups as the model stacks them: a body of two positions repeated 3 times, then one layer."""

    def position(seed: int, repeats: int) -> dict:
        layer = params_like_marin()["layers"][0][0]
        # In NumPy (the same float32 products): eager jnp ops would compile once per leaf shape.
        return jax.tree.map(
            lambda leaf: jnp.asarray(
                np.concatenate([np.asarray(leaf) * (1 + 0.1 * (seed + r)) for r in range(repeats)])
            ),
            layer,
        )

    start = params_like_marin()
    return {**start, "layers": [[position(1, 3), position(2, 3)], [position(3, 1)]]}


@pytest.mark.parametrize(
    ("kind", "clip_norm"),
    [
        ("muonh", None),
        ("adamw", 1.0),
        # Each variant compiles its own loop (10 to 20 s on 2 cores): the default suite keeps one
        # Newton-Schulz rule unclipped and one clipped rule; these two repeat the pairing the other way.
        pytest.param("adamw", 1e9, marks=pytest.mark.slow),
        pytest.param("muon", 1.0, marks=pytest.mark.slow),
    ],
)
def test_layer_by_layer_update_equals_the_rule_on_the_whole_tree(kind, clip_norm):
    """LayerwiseOptimizer runs the rule one slice of each layer group at a time under a loop, with clipping
    and the accumulation's 1/N applied as each slice is read: three steps land where the rule applied to
    the whole tree (with optax's own global-norm clipping) lands, clipped (adamw 1.0) or not."""
    params = params_with_two_groups()
    whole_rule = make_optimizer(kind, weight_decay=0.1, clip_norm=clip_norm)
    layerwise = LayerwiseOptimizer(make_optimizer(kind, weight_decay=0.1, clip_norm=None), clip_norm)
    whole, state = params, whole_rule.init(params)
    by_slice, slice_state = params, layerwise.init(params)
    assert jax.tree.leaves(slice_state["layers"][0])[0].shape[0] == 3  # every leaf stacked, counts too
    apply = jax.jit(layerwise.apply, compiler_options=QUICK_COMPILE)
    whole_update = jax.jit(whole_rule.update, compiler_options=QUICK_COMPILE)
    for step, lr in enumerate([0.02, 0.05, 0.01]):
        grads = scaled(jax.tree.map(lambda x, s=step: random(x.shape, 200 + s), params), 4.0)
        updates, state = whole_update(grads, state, whole, learning_rate=lr)
        whole = plus(whole, updates)
        # The sum of two microbatches' gradients and a scale of 1/2: the same mean gradient.
        doubled = scaled(grads, 2.0)
        by_slice, slice_state, grad_norm = apply(doubled, slice_state, by_slice, lr, 0.5)
        assert float(grad_norm) == pytest.approx(float(jax.jit(optax_norm)(grads)), rel=1e-5)
    for path, a, b in zip(paths(whole), jax.tree.leaves(by_slice), jax.tree.leaves(whole), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6, err_msg=path)
    moved = max(
        float(np.abs(np.asarray(a) - np.asarray(b)).max())
        for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(params))
    )
    assert moved > 1e-3


def optax_norm(tree) -> jax.Array:
    import optax

    return optax.tree.norm(tree)


def paths(tree) -> list[str]:
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
