"""Training modes behind one interface (base.py). `mode` picks one:

sft    supervised fine-tuning on packed prompt/completion examples (sft.py)
grpo   RL with verifiable rewards: GRPO, DAPO, Dr.GRPO, RLOO, REINFORCE++ (grpo.py)
ppo    RL with a critic: GRPO's rollouts, GAE advantages, the critic trained alongside (ppo.py)
dpo    direct preference optimisation on chosen/rejected pairs (dpo.py)
rm     a reward model (a scalar head) trained on the same pairs, Bradley-Terry (rm.py)
pkg.module:Class   any Task subclass
"""

from __future__ import annotations

from unitrain import plugins, registry


def task_class(mode: str):
    """The Task class of `mode` (imported when first named)."""
    return plugins.resolve(mode, registry.MODES, "mode", "a Task class")


def create(run):
    """The configured mode's Task for this run."""
    return task_class(run.cfg.mode)(run)
