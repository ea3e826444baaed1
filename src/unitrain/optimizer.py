"""optax AdamW with warmup then cosine/linear/constant decay, global-norm clipping and the model's
weight-decay mask (models/base.py: decay_mask)."""

from __future__ import annotations

import jax
import optax


def learning_rate_schedule(cfg, optimizer_steps: int, peak: float | None = None) -> optax.Schedule:
    """Linear warmup from 0 to `peak` (None: learning_rate) over warmup_steps, then the lr_schedule
    decay to peak * lr_final_fraction at the last of `optimizer_steps` (sharding.Layout's: GRPO
    makes several per step). PPO's critic takes the same shape to critic_learning_rate."""
    peak = cfg.learning_rate if peak is None else peak
    end = peak * cfg.lr_final_fraction
    decay_steps = max(optimizer_steps - cfg.warmup_steps, 1)
    decay = {
        "cosine": optax.cosine_decay_schedule(peak, decay_steps, alpha=cfg.lr_final_fraction),
        "linear": optax.linear_schedule(peak, end, decay_steps),
        "constant": optax.constant_schedule(peak),
    }[cfg.lr_schedule]
    warmup = optax.linear_schedule(0.0, peak, cfg.warmup_steps)
    return optax.join_schedules([warmup, decay], [cfg.warmup_steps])


def make_optimizer(cfg, decay_mask, learning_rate: optax.Schedule, frozen=None) -> optax.GradientTransformation:
    """decay_mask: a pytree of bools shaped like the parameters (True = weight decay applies);
    `frozen` another (True = never updated: no moments held, not in the clipped norm), or None."""
    optimizer = _adamw(cfg, decay_mask, learning_rate)
    if frozen is None:
        return optimizer
    labels = jax.tree.map(lambda f: "frozen" if f else "trained", frozen)
    return optax.multi_transform({"trained": optimizer, "frozen": optax.set_to_zero()}, labels)


def _adamw(cfg, decay_mask, learning_rate: optax.Schedule) -> optax.GradientTransformation:
    adamw = optax.adamw(
        learning_rate,
        b1=cfg.adam_b1,
        b2=cfg.adam_b2,
        eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
        mask=decay_mask,
    )
    if cfg.max_grad_norm > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adamw)
    return adamw
