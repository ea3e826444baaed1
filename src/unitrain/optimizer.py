"""optax AdamW with warmup then cosine/linear/constant decay, global-norm clipping and a weight-decay
mask that spares norms and biases."""

from __future__ import annotations

import jax
import optax

_NO_DECAY = ("attn_norm", "mlp_norm", "final_norm", "q_norm", "k_norm", "bq", "bk", "bv")


def learning_rate_schedule(cfg) -> optax.Schedule:
    """Linear warmup from 0 to learning_rate over warmup_steps, then the lr_schedule decay to
    learning_rate * lr_final_fraction at the last optimizer step (GRPO makes several per step)."""
    peak, end = cfg.learning_rate, cfg.learning_rate * cfg.lr_final_fraction
    decay_steps = max(cfg.optimizer_steps - cfg.warmup_steps, 1)
    decay = {
        "cosine": optax.cosine_decay_schedule(peak, decay_steps, alpha=cfg.lr_final_fraction),
        "linear": optax.linear_schedule(peak, end, decay_steps),
        "constant": optax.constant_schedule(peak),
    }[cfg.lr_schedule]
    warmup = optax.linear_schedule(0.0, peak, cfg.warmup_steps)
    return optax.join_schedules([warmup, decay], [cfg.warmup_steps])


def decay_mask(params):
    """True for the matrices that weight decay applies to (not norms, not biases)."""
    return jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key not in _NO_DECAY, params)


def make_optimizer(cfg) -> optax.GradientTransformation:
    adamw = optax.adamw(learning_rate_schedule(cfg), b1=cfg.adam_b1, b2=cfg.adam_b2, eps=cfg.adam_eps,
                        weight_decay=cfg.weight_decay, mask=decay_mask)
    if cfg.max_grad_norm > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adamw)
    return adamw
