"""An advantage estimator written as a plugin outside the package
(`advantage_estimator: plugin_estimator:rank_advantages`): each sample's advantage is its reward's
rank in its group, centred and scaled to [-1, 1] (ties share their mean rank). It records what it saw
so a test can check it against NumPy."""

from __future__ import annotations

import numpy as np

SEEN: list = []


def rank_advantages(rollout) -> tuple[dict, dict]:
    advantages = np.zeros_like(rollout.rewards)
    for g in range(rollout.num_groups):
        rows = rollout.group_ids == g
        n = int(rows.sum())
        if n > 1:
            r = rollout.rewards[rows]
            ranks = (r[:, None] > r[None]).sum(1) + ((r[:, None] == r[None]).sum(1) + 1) / 2  # 1..n, ties averaged
            advantages[rows] = (ranks - (n + 1) / 2) / ((n - 1) / 2)
    SEEN.append((rollout.rewards.copy(), rollout.group_ids.copy(), advantages))
    return {"advantages": advantages.astype(np.float32)}, {"rank/positive_fraction": float(np.mean(advantages > 0))}
