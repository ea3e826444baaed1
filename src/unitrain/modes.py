"""Training modes behind one interface (tasks/base.py). `mode` picks one (registry.MODES):

sft    supervised fine-tuning on packed prompt/completion examples (tasks/sft.py)
grpo   RL with verifiable rewards: GRPO, DAPO, Dr.GRPO, RLOO, REINFORCE++ (tasks/grpo.py)
ppo    RL with a critic: GRPO's rollouts, GAE advantages, the critic trained alongside (tasks/ppo.py)
dpo    direct preference optimisation on chosen/rejected pairs, and IPO, SimPO, CPO, ORPO, KTO (tasks/dpo.py)
online_dpo  DPO on pairs of the policy's own answers, a reward picking chosen and rejected (tasks/online_dpo.py)
rm     a reward model (a scalar head) trained on the same pairs, Bradley-Terry (tasks/rm.py)
pkg.module:Class   any Task subclass

Outside the tasks package, which the modes import: this module imports every mode it names.
"""

from __future__ import annotations

from unitrain import plugins, registry


def task_class(mode: str):
    """The Task class of `mode` (imported when first named)."""
    return plugins.resolve(mode, registry.MODES, "mode", "a Task class")


def create(run):
    """The configured mode's Task for this run."""
    return task_class(run.cfg.mode)(run)
