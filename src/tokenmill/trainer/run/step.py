"""One train step, built and jitted: value_and_grad of the loss (over microbatches when asked), the
guard's decision (guard.py), then the optimizer update and the router-bias balancing update outside the
optimizer, both left out of a skipped step.

Everything a step needs is one state pytree {step, params, opt_state, router_bias, guard}, so that a
checkpoint restores exactly the run it came from. `compile_train_step` is also what `tokenmill model
compile` lowers ahead of time (compile.py).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from tokenmill.trainer.model import transformer
from tokenmill.trainer.model.router import update_router_bias
from tokenmill.trainer.model.shape import ModelConfig
from tokenmill.trainer.model.sharding import (
    batch_sharding,
    device_memory,
    param_shardings,
    state_shardings,
)
from tokenmill.trainer.run import guard
from tokenmill.trainer.run.config import GuardConfig, ResolvedRun
from tokenmill.trainer.run.health import health
from tokenmill.trainer.run.heuristic import ADAM_TO_MUONH_LR_RATIO
from tokenmill.trainer.run.optim import LayerwiseOptimizer, Schedule, make_optimizer

# Named scopes that mark what the step's collectives serve in the compiled HLO's op_name, read by
# `tokenmill model compile` (run/collectives.py); metadata only, the computation is the same.
OPTIMIZER_SCOPE = "optimizer_update"
GRADIENT_SCOPE = "gradient_reduction"


def make_schedule(run: ResolvedRun) -> Schedule:
    """The learning rate over the run's global steps."""
    schedule = run.config.schedule
    return Schedule(
        schedule.kind,
        run.config.optimizer.lr,
        schedule.total_steps,
        schedule.warmup_steps,
        schedule.decay_steps,
        schedule.min_lr_ratio,
    )


def make_train_step(
    model_cfg: ModelConfig,
    optimizer: LayerwiseOptimizer,
    schedule: Schedule,
    dtype: Any,
    microbatches: int = 1,
    grad_shardings: Any = None,
    guard_config: GuardConfig | None = None,
    health_every: int = 0,
):
    """The step function (to be jitted): (state, tokens, segment_ids) -> (state, metrics).

    With `guard_config` enabled, the step's loss and gradient norm are checked against the state's window
    first (guard.py) and the update runs under `lax.cond`: a skipped step returns the parameters, the
    optimizer state and the router bias it was given, untouched, and `skip_reason` says why (0: applied).
    The check adds the window's two vectors and one global norm of the gradients (which the update then
    reuses); no memory grows with the model.

    With `health_every` N > 0, every step whose global index is a multiple of N also gives `health`
    (health.py: norms per parameter group and layer of the parameters and of the update, the router
    bias's change and z-loss per layer), under `lax.cond`: the other steps compute none of it. The update's
    norms take one fp32 difference of the parameters, a leaf at a time.

    With `microbatches` N > 1 the batch runs as N microbatches under jax.lax.scan (gradient accumulation):
    each has a forward and a backward pass, their gradients are summed in fp32 (sharded as `grad_shardings`
    says, the parameters' layout), then the optimizer updates once with the sum scaled by 1/N (the scale
    is applied slice by slice inside the update: no averaged copy of the gradients is made). Microbatch i
    takes rows i, i+N, i+2N, ... so that each device's rows split evenly among the microbatches and no row
    moves between devices. Activation memory is that of B/N rows. The loss, the gradients and the router load
    (summed over microbatches: the bias update sees the whole batch's load) equal the one-pass step's up to
    float rounding, since every microbatch has the same number of tokens. Statistics that are not sums over
    tokens are averaged over microbatches: the balance loss, the router z-loss and quantile balancing's
    target bias (a batch quantile; the average of the microbatches' is close to, not equal to, the batch's).
    """
    m = model_cfg.moe

    def gradients(state: dict, tokens: jax.Array, segment_ids: jax.Array) -> tuple:
        def objective(params: dict) -> tuple[jax.Array, Any]:
            return transformer.loss_fn(params, state["router_bias"], tokens, segment_ids, model_cfg, dtype)

        return jax.value_and_grad(objective, has_aux=True)(state["params"])

    def accumulated(state: dict, tokens: jax.Array, segment_ids: jax.Array) -> tuple:
        if microbatches == 1:
            return *gradients(state, tokens, segment_ids), 1.0
        if tokens.shape[0] % microbatches:
            raise ValueError(f"{microbatches} microbatches do not divide a batch of {tokens.shape[0]} rows")

        def split(array: jax.Array) -> jax.Array:
            # Row r goes to microbatch r % N: a device's contiguous block of rows splits evenly.
            return array.reshape(-1, microbatches, *array.shape[1:]).swapaxes(0, 1)

        def keep_layout(grads: Any) -> Any:
            if grad_shardings is None:
                return grads
            with jax.named_scope(GRADIENT_SCOPE):
                return jax.lax.with_sharding_constraint(grads, grad_shardings)

        def body(carry: tuple, batch: tuple) -> tuple[tuple, None]:
            (total, (loss, stats)), grads = gradients(state, *batch)
            grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
            carry_total, carry_loss, carry_stats, carry_grads = carry
            summed = jax.tree.map(jnp.add, carry_grads, grads)
            return (carry_total + total, carry_loss + loss, jax.tree.map(jnp.add, carry_stats, stats),
                    keep_layout(summed)), None  # fmt: skip

        first = jax.eval_shape(gradients, state, split(tokens)[0], split(segment_ids)[0])
        (_, (_, stats_shape)), grads_shape = first
        stats_zero = jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, leaf.dtype), stats_shape)
        grads_zero = keep_layout(jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, jnp.float32), grads_shape))
        start = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), stats_zero, grads_zero)
        (total, loss, stats, grads), _ = jax.lax.scan(body, start, (split(tokens), split(segment_ids)))
        n = microbatches
        stats = stats._replace(
            quantile_bias=stats.quantile_bias / n,
            balance_loss=stats.balance_loss / n,
            z_loss=stats.z_loss / n,
        )
        return (total / n, (loss / n, stats)), grads, 1.0 / n

    def train_step(state: dict, tokens: jax.Array, segment_ids: jax.Array) -> tuple[dict, dict]:
        (total_loss, (loss, stats)), grads, grad_scale = accumulated(state, tokens, segment_ids)
        lr = schedule(state["step"])

        def update(grad_norm: jax.Array | None = None) -> tuple:
            with jax.named_scope(OPTIMIZER_SCOPE):
                params, opt_state, grad_norm = optimizer.apply(
                    grads, state["opt_state"], state["params"], lr, grad_scale, grad_norm
                )
                router_bias = update_router_bias(state["router_bias"], stats.load, stats.quantile_bias, m)
            return params, opt_state, router_bias, grad_norm

        window = state.get("guard")  # a state built without one (tests of the bare step) has none
        if guard_config is not None and guard_config.enabled and window is not None:
            grad_norm = optax.tree.norm(grads) * grad_scale
            reason = guard.decide(window, loss, grad_norm, guard_config.sigmas, guard_config.warmup)
            kept = (state["params"], state["opt_state"], state["router_bias"], grad_norm)
            params, opt_state, router_bias, _ = jax.lax.cond(
                reason == guard.APPLIED, lambda: update(grad_norm), lambda: kept
            )
            window = guard.record(window, loss, grad_norm, reason)
        else:
            params, opt_state, router_bias, grad_norm = update()
            reason = jnp.int32(guard.APPLIED)
        new_state = {
            "step": state["step"] + 1,
            "params": params,
            "opt_state": opt_state,
            "router_bias": router_bias,
            **({"guard": window} if window is not None else {}),
        }

        # A float: the reference run's step routes 11,264 x 4,096 x 8 copies in each of 48 layers, 1.8e10,
        # past int32, which a Python int in a traced expression becomes.
        assignments = float(tokens.shape[0] * (tokens.shape[1] - 1) * m.top_k)
        metrics = {
            "loss": loss,
            "objective": total_loss,
            "lr": lr,
            "grad_norm": grad_norm,
            # Learned parameters only: the router bias is reported on its own (a spike in the norm of
            # everything once turned out to be the bias alone).
            "param_norm": optax.tree.norm(params),
            "router_bias_norm": jnp.linalg.norm(router_bias, axis=-1),
            "expert_load": stats.load / assignments,
            # Per layer, the busiest expert's share x the number of experts (1.0: perfectly balanced).
            "expert_imbalance": stats.load.max(-1) * m.n_experts / jnp.maximum(stats.load.sum(-1), 1.0),
            "drop_fraction": stats.dropped.sum() / (assignments * model_cfg.n_layers),
            "balance_loss": stats.balance_loss.mean(),
            "router_z_loss": stats.z_loss.mean(),
            "skip_reason": reason,
            "consecutive_skips": window["consecutive"] if window is not None else jnp.int32(0),
        }
        if health_every:

            def sample() -> dict:
                return health(state["params"], params, state["router_bias"], router_bias, stats.z_loss,
                              model_cfg)  # fmt: skip

            shapes = jax.eval_shape(sample)
            nothing = lambda: jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, leaf.dtype), shapes)  # noqa: E731
            metrics["health"] = jax.lax.cond(state["step"] % health_every == 0, sample, nothing)
        return new_state, metrics

    return train_step


# Jitted functions by (model, optimizer, schedule, dtype, mesh): a second phase or a resumed run in the same
# process (tests, notebooks) reuses the compiled step instead of compiling it again.
_COMPILED_STEPS: dict[tuple, tuple] = {}


def compile_train_step(run: ResolvedRun, mesh: jax.sharding.Mesh) -> tuple:
    """(init_state, train_step, state shardings): jitted with explicit shardings, cached per configuration.

    With
    `optimizer.state_memory: pinned_host` the optimizer state lives in the host's pinned memory: the
    update (optim.LayerwiseOptimizer) brings one slice of the layers' state to the device at a time and
    sends it back once updated.

    `tokenmill model compile` lowers the returned train_step with abstract arrays (`.lower(...)`), so the
    step it measures is this one."""
    model_cfg, opt, compute_dtype = run.model, run.config.optimizer, run.config.compute_dtype
    schedule = make_schedule(run)
    guard_config = run.config.guard
    # What the compiled step depends on of the guard (not what the loop does after a skip).
    guard_key = guard_config.model_dump_json(include={"enabled", "sigmas", "window", "warmup"})
    health_every = run.config.logging.health_every
    key = (model_cfg.model_dump_json(), opt.model_dump_json(), compute_dtype, schedule, mesh, guard_key,
           health_every)  # fmt: skip
    if key in _COMPILED_STEPS:
        return _COMPILED_STEPS[key]
    dtype = jnp.bfloat16 if compute_dtype == "bfloat16" else jnp.float32
    # Shapes first, then shardings, then the real arrays are created directly in place on the mesh.
    abstract_params = jax.eval_shape(lambda key: transformer.init_params(key, model_cfg), jax.random.key(0))
    rule = make_optimizer(
        opt.kind,
        opt.weight_decay,
        None,  # clipped by the LayerwiseOptimizer, which sees every gradient before any slice updates
        opt.beta1,
        opt.beta2,
        opt.epsilon,
        adam_lr_ratio=opt.adam_lr / opt.lr if opt.adam_lr and opt.lr else ADAM_TO_MUONH_LR_RATIO,
    )
    optimizer = LayerwiseOptimizer(rule, opt.clip_norm, opt.state_memory)

    def init_state(key: jax.Array) -> dict:
        params = transformer.init_params(key, model_cfg)
        return {
            "step": jnp.zeros((), jnp.int32),
            "params": params,
            "opt_state": optimizer.init(params),
            "router_bias": transformer.init_router_bias(model_cfg),
            "guard": guard.init_window(guard_config.window),
        }

    abstract_state = jax.eval_shape(init_state, jax.random.key(0))
    shardings = state_shardings(
        abstract_state, param_shardings(abstract_params, mesh), mesh, optimizer_memory=opt.state_memory
    )
    grad_shardings = device_memory(shardings["params"])
    step = make_train_step(
        model_cfg, optimizer, schedule, dtype, opt.microbatches, grad_shardings, guard_config, health_every
    )
    init_fn = jax.jit(init_state, out_shardings=shardings)
    step_fn = jax.jit(
        step,
        in_shardings=(shardings, batch_sharding(mesh), batch_sharding(mesh)),
        out_shardings=(shardings, None),
        donate_argnums=0,
    )
    _COMPILED_STEPS[key] = (init_fn, step_fn, shardings)
    return _COMPILED_STEPS[key]
