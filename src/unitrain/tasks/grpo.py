"""mode=grpo: GRPO and its relatives (DAPO, Dr.GRPO, RLOO, REINFORCE++, GSPO) on the RL step
(tasks/rl.py): advantages per group of a prompt's samples by `advantage_estimator` (advantages.py),
the policy the only learner."""

from __future__ import annotations

from unitrain.tasks.rl import RLTask


class GRPOTask(RLTask):
    def __init__(self, run, **kwargs):
        self.estimator = run.cfg.advantage_estimator
        super().__init__(run, **kwargs)
