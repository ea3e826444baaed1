"""Losses. Each returns (sum over tokens, number of tokens) so that gradient accumulation over
micro-batches, and averaging over hosts, is exact at token level: the step divides once, at the end.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy(logits, targets, weights, z_loss_weight: float = 0.0):
    """Token-weighted next-token cross-entropy with optional z-loss (PaLM: z_loss_weight * logZ^2).

    logits [B,T,V] (any float dtype; computed in float32), targets [B,T] int, weights [B,T] {0,1}.
    Returns (loss_sum, weight_sum, nll_sum): loss_sum includes the z-loss, nll_sum does not.
    """
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    nll = (log_z - target_logits) * weights
    loss = nll + z_loss_weight * jnp.square(log_z) * weights
    return loss.sum(), weights.sum(), nll.sum()
