"""The recommender's rewards, `reward: sid_hit` and `reward: sid_rank` (registry.REWARDS): a
completion is scored against the label's semantic ID (SID), alone or by its rank in a group that
ranked rollouts give best first.

  sid_hit   1.0 if the completion is the label's SID (whitespace between its tokens ignored)
  sid_rank  MiniOneRec's rank-aware penalty for wrong items ranked above the target (a GroupReward)
"""

from __future__ import annotations

import math

from unitrain.rewards import GroupReward, Reward


def sid_hit_reward(prompt: str, completion: str, label: str) -> float:
    """1.0 if the completion is the label's SID (whitespace between its tokens ignored)."""
    return float("".join(completion.split()) == "".join(label.split()))


def sid_rank_reward(prompts: list[str], completions: list[str], labels: list[str]) -> list[float]:
    """MiniOneRec's rank-aware reward over a group ranked best first: in a group that holds the
    target, each wrong item at rank r (0 = best) gets -(1/log2(r+2)) / sum_j 1/log2(j+2), so a wrong
    item ranked above the target costs most; the hit gets 0. A group without the target gets 0s."""
    hits = [sid_hit_reward(p, c, lab) for p, c, lab in zip(prompts, completions, labels)]
    if not any(hits):
        return [0.0] * len(hits)
    weights = [1.0 / math.log2(r + 2) for r in range(len(hits))]
    return [0.0 if hit else -w / sum(weights) for hit, w in zip(hits, weights)]


def make_sid_hit_reward(cfg) -> Reward:
    return sid_hit_reward


def make_sid_rank_reward(cfg) -> GroupReward:
    return GroupReward(sid_rank_reward)
