"""Advantage estimators: the RL step's rewards -> advantages, a seam like every other.

    estimate = make_estimator(cfg, name)           # registry.ADVANTAGE_ESTIMATORS or pkg.module:fn
    arrays, metrics = estimate(Rollout(...))      # arrays: {"advantages": [N] or [N, C], ...}

GRPO takes `advantage_estimator` (grpo, drgrpo, rloo, reinforce_pp: per group of a prompt's samples,
losses.compute_advantages), PPO takes gae (per token, from the critic's values: losses.gae, whitened
over the batch's sampled tokens; it also returns the critic's targets, "returns"). A plugin is a
function of a Rollout that returns ({"advantages": [N] or [N, C] float32}, {metric: float}).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from unitrain import losses, plugins, registry
from unitrain.config import check


@dataclasses.dataclass(frozen=True)
class Rollout:
    """What an estimator sees of a step's rollout rows (numpy, on the host)."""

    rewards: np.ndarray  # [N] float32: each trajectory's reward
    group_ids: np.ndarray  # [N] int32: the group (prompt) of each row, consecutive
    num_groups: int
    loss_mask: np.ndarray  # [N, C] int32: the sampled tokens
    kl: np.ndarray | None  # [N, C] float32: the per-token KL to the reference with use_kl_in_reward, else None
    values: np.ndarray | None  # [N, C] float32: the critic's values of the sampled tokens' states (PPO)
    cfg: object  # the run's Config (kl_coef, advantage_norm_by_std, gae_gamma, gae_lambda, ...)


def sequence_rewards(r: Rollout) -> np.ndarray:
    """[N] float32: the rewards less kl_coef times each row's summed KL to the reference, if in the reward."""
    if r.kl is None:
        return r.rewards
    return r.rewards - r.cfg.kl_coef * (r.kl * r.loss_mask.astype(bool)).sum(axis=1)


def _group_estimator(name: str, r: Rollout) -> tuple[dict, dict]:
    weights = r.loss_mask.sum(axis=1).astype(np.float32) if name == "reinforce_pp" else None
    advantages = losses.compute_advantages(
        sequence_rewards(r), r.group_ids, r.num_groups, name, r.cfg.advantage_norm_by_std, weights=weights
    )
    return {"advantages": np.asarray(advantages)}, {}


grpo = functools.partial(_group_estimator, "grpo")
drgrpo = functools.partial(_group_estimator, "drgrpo")
rloo = functools.partial(_group_estimator, "rloo")
reinforce_pp = functools.partial(_group_estimator, "reinforce_pp")


@functools.partial(jax.jit, static_argnames=("gamma", "lam", "kl_coef"))
def _gae(rewards, values, mask, kl, *, gamma: float, lam: float, kl_coef: float) -> dict:
    per_token = losses.token_rewards(rewards, mask, kl, kl_coef)
    advantages, returns = losses.gae(per_token, values, mask, gamma, lam)
    m = mask.astype(np.float32)
    tokens = m.sum()
    return {
        "advantages": losses.masked_whiten(advantages, m) * m,
        "returns": returns,
        "critic/values_mean": (values * m).sum() / tokens,
        "critic/returns_mean": returns.sum() / tokens,
        "critic/explained_var": losses.explained_variance(returns, values, m),
    }


def gae(r: Rollout) -> tuple[dict, dict]:
    """PPO's: the reward on the last sampled token (less kl_coef times each token's KL, if in the
    reward), advantages and returns by GAE over the sampled tokens (gae_gamma, gae_lambda), the
    advantages whitened over the batch's sampled tokens (0 off them); the critic's metrics."""
    cfg = r.cfg
    out = _gae(r.rewards, r.values, r.loss_mask, r.kl, gamma=cfg.gae_gamma, lam=cfg.gae_lambda, kl_coef=cfg.kl_coef)
    out = {k: np.asarray(v) for k, v in out.items()}
    arrays = {k: out.pop(k) for k in ("advantages", "returns")}
    return arrays, {k: float(v) for k, v in out.items()}


def make_estimator(name: str):
    """The estimator `name`: a registry.ADVANTAGE_ESTIMATORS name or a plugin `pkg.module:fn`."""
    return plugins.resolve(name, registry.ADVANTAGE_ESTIMATORS, "advantage_estimator", "a function (Rollout)")


@check("advantage_estimator", "mode")
def _gae_needs_a_critic(c) -> str | None:
    """GAE needs a critic's values, which only mode=ppo trains (and PPO estimates by GAE alone)."""
    if c["advantage_estimator"] == "gae" and c["mode"] != "ppo":
        return f"advantage_estimator gae needs a critic's values: mode=ppo (mode={c['mode']} has no critic)"
    return None


CONFIG_CHECKS = (_gae_needs_a_critic,)
