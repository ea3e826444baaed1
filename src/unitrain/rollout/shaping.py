"""What reshapes a step's rollouts between the workflow and the loss, as lists the RL step applies
in order: reward shapers (group -> group, before a dynamic-sampling filter sees it) and row filters
(groups -> ([rows] bool: the rows that stay in the loss, metrics), after the advantages, so a row
taken out still counts in its group's baseline). DAPO's overlong handling is one of each."""

from __future__ import annotations

import dataclasses

import numpy as np

from unitrain import rewards
from unitrain.config import check


def reward_shapers(cfg, max_tokens: int) -> list:
    """The config's reward shapers: DAPO's soft overlong punishment with overlong_buffer_len."""
    return [OverlongPenalty(cfg, max_tokens)] if cfg.overlong_buffer_len else []


def row_filters(cfg) -> list:
    """The config's row filters: DAPO's overlong filter with overlong_filter."""
    return [overlong_filter] if cfg.overlong_filter else []


class OverlongPenalty:
    """DAPO's soft overlong punishment added to a group's rewards, as the reward term "overlong"."""

    def __init__(self, cfg, max_tokens: int):
        self.max_tokens, self.buffer, self.factor = max_tokens, cfg.overlong_buffer_len, cfg.overlong_penalty_factor

    def __call__(self, group):
        lengths = np.asarray([len(t.ids) for t in group.trajectories], np.int32)
        penalty = rewards.overlong_penalty(lengths, self.max_tokens, self.buffer, self.factor)
        return dataclasses.replace(
            group, rewards=group.rewards + penalty, per_reward={**group.per_reward, "overlong": penalty}
        )


def overlong_filter(groups) -> tuple[np.ndarray, dict]:
    """DAPO's overlong filter: the trajectories that ended for length (an answer cut without its stop
    token) leave the loss."""
    truncated = np.asarray([t.end == "length" for g in groups for t in g.trajectories])
    return ~truncated, {"overlong_filtered_fraction": float(truncated.mean())}


@check("overlong_buffer_len", "rollout_max_response_len")
def _overlong_buffer(c) -> str | None:
    if c["overlong_buffer_len"] < c["rollout_max_response_len"]:
        return None
    return f"overlong_buffer_len ({c['overlong_buffer_len']}) must be below rollout_max_response_len ({c['rollout_max_response_len']})"


CONFIG_CHECKS = (_overlong_buffer,)
