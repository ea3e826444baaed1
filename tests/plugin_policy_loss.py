"""A policy loss written as a plugin outside the package (`policy_loss: plugin_policy_loss:tight_log_ratio`):
the token's log importance ratio, clamped to [-0.05, 0.05] before the surrogate clips it, so a token
far off-policy weighs at most exp(0.05) of its advantage."""

from __future__ import annotations

import jax.numpy as jnp

BOUND = 0.05


def tight_log_ratio(logprobs, old_logprobs, mask, sequences):
    del mask, sequences  # per token, as the built-in ppo
    return jnp.clip(logprobs - old_logprobs, -BOUND, BOUND)
