"""Training modes behind one interface (base.py). `mode` picks one:

sft    supervised fine-tuning on packed prompt/completion examples (sft.py)
grpo   RL with verifiable rewards: GRPO, DAPO, Dr.GRPO, RLOO, REINFORCE++ (grpo.py)
ppo    RL with a critic: GRPO's rollouts, GAE advantages, the critic trained alongside (ppo.py)
dpo    direct preference optimisation on chosen/rejected pairs (dpo.py)
pkg.module:Class   any Task subclass
"""

from __future__ import annotations

from unitrain import plugins, registry


def create(run):
    """The configured mode's Task for this run."""
    return plugins.resolve(run.cfg.mode, registry.MODES, "mode", "a Task class")(run)
