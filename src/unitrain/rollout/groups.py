"""Groups: a prompt record and its n trajectories, scored (rollout/driver.py makes them), and what
chooses among them: a dynamic-sampling filter sees whole groups,

    kept = [g for g in groups if keep(g)]

`dynamic_sampling_filter`: a built-in name from registry.FILTERS or a plugin `pkg.module:fn(group) -> bool`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from unitrain import plugins, registry
from unitrain.errors import RunEndedEarly


@dataclasses.dataclass(frozen=True)
class Group:
    """One prompt record and its trajectories (rollout/workflow.py), scored."""

    prompt: object  # unitrain.data.prompts.Prompt: ids (as the workflow prompted), text, label
    trajectories: tuple  # n rollout.workflow.Trajectory
    rewards: np.ndarray  # [n] float32, the weighted total
    per_reward: dict[str, np.ndarray]  # each reward's raw [n] values, the task's (or the environment's) first

    @property
    def version(self) -> int:
        """The oldest weights version any of its sampled tokens came from."""
        versions = [int(t.versions[t.loss_mask == 1].min()) for t in self.trajectories if t.loss_mask.any()]
        return min(versions, default=0)

    @property
    def correct(self) -> np.ndarray:
        """[n] bool: the task reward (the first) gives 1."""
        return next(iter(self.per_reward.values())) >= 1.0


def nonzero_std(group: Group) -> bool:
    """Keep a group only if its rewards differ: equal rewards give zero advantage, hence no signal."""
    return bool(np.std(group.rewards) > 0)


def make_filter(spec: str):
    """ "" (keep every group), a registry.FILTERS name or a plugin `pkg.module:fn(group) -> bool`."""
    if spec == "":
        return None
    return plugins.resolve(spec, registry.FILTERS, "dynamic_sampling_filter", "a function (group) -> bool")


def select_groups(kept: list, dropped: list, batch_size: int, rounds: int = 0) -> tuple[list, int, int]:
    """The step's groups: those that passed the filter, topped up with dropped ones when the
    sampling rounds ran out (shapes stay static; a zero-std group only adds zero advantages).
    `rounds` > 0: the step used up its max_sampling_rounds (else the prompt stream ended).
    Returns (groups, number discarded, number refilled)."""
    refilled = min(max(0, batch_size - len(kept)), len(dropped))
    groups = (kept + dropped[:refilled])[:batch_size]
    if len(groups) < batch_size and rounds:
        raise RunEndedEarly(
            f"{rounds} sampling rounds (max_sampling_rounds) gave {len(groups)} of the {batch_size} groups a rollout "
            "batch needs: the workflow left the others out (episodes whose first prompt is longer than "
            "max_prompt_length, or workflow errors: see rollout_workflow_errors); fix those records, or raise "
            "max_sampling_rounds"
        )
    if len(groups) < batch_size:
        raise RunEndedEarly(
            f"the prompt stream ran out before a rollout batch of {batch_size} groups was full; "
            "raise num_epochs or lower steps"
        )
    return groups, len(dropped) - refilled, refilled
