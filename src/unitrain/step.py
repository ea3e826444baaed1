"""The step machinery every mode shares: the train state and its shardings, the exact-accumulation
train step over any loss, the jitted and donated update. Programs compile through the run's
compile cache (compile_cache.py); rows move between host and global arrays with sharding.py.

    state = init_state(params, optimizer, mesh)                       # {params, opt_state, step}
    update = make_train_step(task.loss, StepConfig.from_config(cfg, learning_rate), optimizer, state_shardings,
                             task.batch_shardings())          # a mode: run.make_update(task.loss, shardings)
    state, metrics = programs("train_step", update, state, batch)     # compiled once per batch shape
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import optax

from unitrain import lora, sharding
from unitrain.models import moe

log = logging.getLogger("unitrain")


# ---------------------------------------------------------------- state


def opt_state_shardings(optimizer: optax.GradientTransformation, params, param_shardings, mesh):
    """Shardings of optimizer.init(params): each moment takes its parameter's sharding, everything
    else (step counts) is replicated over the mesh; a frozen parameter's empty slot (optax's
    MaskedNode, optimizer.make_optimizer's `frozen`) stays empty. `params` may be concrete or abstract."""
    frozen = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
    return optax.tree_map_params(
        optimizer,
        lambda x, s: x if frozen(x) else s,
        jax.eval_shape(optimizer.init, params),
        param_shardings,
        transform_non_params=lambda _: sharding.replicated(mesh),
        is_leaf=frozen,
    )


def init_state(
    params: dict,
    optimizer: optax.GradientTransformation,
    mesh,
    opt_host_offload: bool = False,
    adapters_only: bool = False,
) -> dict:
    """{params, opt_state, step}, every array in its sharding (the optimizer state optionally in
    pinned host memory, brought to the device inside each step). With `adapters_only` (LoRA) the
    optimizer holds the adapters alone (lora.trainable)."""
    trained = lora.trainable(params, adapters_only)
    shardings = opt_state_shardings(optimizer, trained, jax.tree.map(lambda x: x.sharding, trained), mesh)
    opt_state = jax.jit(optimizer.init, out_shardings=shardings)(trained)
    if opt_host_offload:
        opt_state = sharding.with_memory_kind(opt_state, "pinned_host")
    step = jax.device_put(jnp.zeros((), jnp.int32), sharding.replicated(mesh))
    return {"params": params, "opt_state": opt_state, "step": step}


def frozen_copy(params: dict, host_offload: bool = False) -> dict:
    """A copy of the parameters that training never touches (a reference policy), optionally kept
    in pinned host memory between uses."""
    # Abstract parameters (tools/bench.py --compile-only) have nothing to copy.
    copy = jax.tree.map(lambda x: x if isinstance(x, jax.ShapeDtypeStruct) else jnp.copy(x), params)
    return sharding.with_memory_kind(copy, "pinned_host") if host_offload else copy


def device_shardings(params: dict) -> dict:
    """The shardings of `params` in device memory: `jax.device_put(p, these)` inside a jitted
    function brings a host-offloaded copy over (a no-op for parameters already on the device)."""
    return jax.tree.map(lambda x: x.sharding.with_memory_kind("device"), params)


# ---------------------------------------------------------------- the step


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """What the train step reads of the config: the keys of the same names, whether only the LoRA
    adapters train (lora_rank > 0), and the optimizer's learning-rate schedule (logged each step)."""

    gradient_accumulation_steps: int
    max_grad_norm: float
    optimizer_host_offload: bool
    adapters_only: bool
    learning_rate: optax.Schedule
    moe_aux_loss_coef: float = 0.0
    moe_z_loss_coef: float = 0.0

    @classmethod
    def from_config(cls, cfg, learning_rate: optax.Schedule) -> StepConfig:
        return cls(
            gradient_accumulation_steps=cfg.gradient_accumulation_steps,
            max_grad_norm=cfg.max_grad_norm,
            optimizer_host_offload=cfg.optimizer_host_offload,
            adapters_only=cfg.lora_rank > 0,
            learning_rate=learning_rate,
            moe_aux_loss_coef=cfg.moe_aux_loss_coef,
            moe_z_loss_coef=cfg.moe_z_loss_coef,
        )


def with_router_losses(loss_fn, aux_coef: float, z_coef: float):
    """loss_fn with a mixture of experts' router terms added (models/moe.py): the RouterStats its
    forwards report, as moe_aux_loss_coef * load-balancing loss + moe_z_loss_coef * z-loss per unit
    of the loss's denominator (so after train_step's division they add to the mean loss as they
    are), and the moe/* metrics. A dense model reports none: the loss is loss_fn's."""

    def loss(params, batch, *frozen):
        with moe.collect_router_stats() as collected:
            total, (denom, metrics) = loss_fn(params, batch, *frozen)
        if not collected:
            return total, (denom, metrics)
        router = moe.router_losses(collected)
        total = total + (aux_coef * router["aux_loss"] + z_coef * router["z_loss"]) * denom
        once = jnp.ones((), jnp.float32)  # each micro-batch's value counts once: the step logs their mean
        return total, (denom, {**metrics, **{f"moe/{name}": (value, once) for name, value in router.items()}})

    return loss


def train_step(loss_fn, settings: StepConfig, optimizer, state, batch, *frozen):
    """One optimizer step over `gradient_accumulation_steps` micro-batches, exact at token level.

    loss_fn(params, micro_batch, *frozen) -> (loss_sum, (denominator, {metric: (sum, count)})), `frozen`
    the parameters of models the loss runs but does not train (a teacher's), as they are. Gradients of
    the summed losses are added up over micro-batches and divided once by the total denominator;
    each metric likewise ends as its total sum over its total count. An optimizer state offloaded
    to host memory is updated a parameter at a time (streamed_update). `learning_rate` is the optimizer's schedule (run.learning_rate),
    read for the step's metric. A mixture of experts' router terms join the loss (with_router_losses).
    """
    k = settings.gradient_accumulation_steps
    loss_fn = with_router_losses(loss_fn, settings.moe_aux_loss_coef, settings.moe_z_loss_coef)
    # Row i*k + j goes to micro-batch j: each device's contiguous rows stay on that device.
    micro = jax.tree.map(lambda x: x.reshape(-1, k, *x.shape[1:]).swapaxes(0, 1), batch)
    # Only the trained part is differentiated and updated (with LoRA the adapters; the frozen base
    # passes through the donated state untouched).
    trained = lora.trainable(state["params"], settings.adapters_only)

    def full(t):
        return lora.with_trainable(state["params"], t, settings.adapters_only)

    grad_fn = jax.value_and_grad(lambda t, mb: loss_fn(full(t), mb, *frozen), has_aux=True)
    shapes = jax.eval_shape(grad_fn, trained, jax.tree.map(lambda x: x[0], micro))
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), shapes)

    def accumulate(carry, mb):
        return jax.tree.map(lambda c, x: c + x.astype(jnp.float32), carry, grad_fn(trained, mb)), None

    ((loss_sum, (denom, sums)), grads), _ = jax.lax.scan(accumulate, zeros, micro)
    denom = jnp.maximum(denom, 1.0)
    grads = jax.tree.map(lambda g, p: (g / denom).astype(p.dtype), grads, trained)
    grad_norm = optax.tree.norm(grads)
    if settings.optimizer_host_offload:
        trained, opt_state = streamed_update(optimizer, grads, state["opt_state"], trained, settings.max_grad_norm)
    else:
        updates, opt_state = optimizer.update(grads, state["opt_state"], trained)
        trained = optax.apply_updates(trained, updates)
    params = full(trained)
    clipped = jnp.minimum(grad_norm, settings.max_grad_norm) if settings.max_grad_norm > 0 else grad_norm
    step_metrics = {
        "loss": loss_sum / denom,
        "grad_norm": grad_norm,
        "grad_norm_clipped": clipped,
        "learning_rate": settings.learning_rate(state["step"]),
        "loss_denominator": denom,
        **{name: total / jnp.maximum(count, 1.0) for name, (total, count) in sums.items()},
    }
    return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, step_metrics


def streamed_update(optimizer, grads, opt_state, trained, max_grad_norm: float):
    """(updated parameters, optimizer state) of optimizer.update with the state in host memory, a
    parameter at a time: one parameter's moments come to the device, are updated and go back before
    the next one's come, so the device holds one parameter's moments beside the gradients (moving
    the whole state over at once peaks higher than keeping it there: docs/PERFORMANCE.md). Each
    call sees one parameter, the others as empty arrays. The global-norm clip runs first, over the
    parameters the optimizer holds moments for (make_optimizer's clip leaves frozen ones out), so
    each call's own clip finds its parameter within the bound and leaves it be."""
    leaves, treedef = jax.tree.flatten(trained)
    grad_leaves = jax.tree.leaves(grads)
    index = jax.tree.unflatten(treedef, list(range(len(leaves))))
    masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731  a frozen parameter's empty slot

    def over_state(f, non_params):  # f(state leaf, its parameter's index) on the parameter-shaped leaves
        return optax.tree_map_params(optimizer, f, opt_state, index, transform_non_params=non_params, is_leaf=masked)

    # the parameter each state leaf belongs to (-1: step counts and the like, the same after every call)
    owners = jax.tree.leaves(over_state(lambda x, j: x if masked(x) else j, lambda _: -1))
    moved = sorted(set(owners) - {-1})
    if max_grad_norm > 0:
        clipped, _ = optax.clip_by_global_norm(max_grad_norm).update([grad_leaves[j] for j in moved], None)
        grad_leaves = [*grad_leaves]
        for j, g in zip(moved, clipped):
            grad_leaves[j] = g

    def empty_but(i, x, j):
        return x if j == i or masked(x) else jnp.zeros((0,), x.dtype)

    updated, states, sent = list(leaves), {}, None
    for i in moved:
        state = over_state(functools.partial(empty_but, i), lambda x: x)
        if sent is not None:  # this parameter's moments move once the previous one's have left
            state, _ = jax.lax.optimization_barrier((state, sent))
        state = jax.device_put(state, jax.memory.Space.Device)
        one, grad = ([empty_but(i, x, j) for j, x in enumerate(tree)] for tree in (leaves, grad_leaves))
        updates, state = optimizer.update(jax.tree.unflatten(treedef, grad), state, jax.tree.unflatten(treedef, one))
        sent = jax.device_put(state, jax.memory.Space.Host)
        states[i] = jax.tree.leaves(sent)
        updated[i] = optax.apply_updates(leaves[i], jax.tree.leaves(updates)[i])
    new_state = [states[o if o >= 0 else moved[-1]][k] for k, o in enumerate(owners)]
    return jax.tree.unflatten(treedef, updated), jax.tree.unflatten(jax.tree.structure(opt_state), new_state)


def make_train_step(loss_fn, settings: StepConfig, optimizer, state_shardings, batch_shardings, frozen_shardings=()):
    """train_step jitted with explicit shardings and the state donated; `frozen_shardings` those of
    train_step's `frozen` parameters, one tree each."""
    return jax.jit(
        functools.partial(train_step, loss_fn, settings, optimizer),
        in_shardings=(state_shardings, batch_shardings, *frozen_shardings),
        out_shardings=(state_shardings, None),
        donate_argnums=0,
    )
