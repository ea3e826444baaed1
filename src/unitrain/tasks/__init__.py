"""Training modes behind one interface (base.py). `mode` picks one:

sft    supervised fine-tuning on packed prompt/completion examples (sft.py)
grpo   RL with verifiable rewards: GRPO, DAPO, Dr.GRPO, RLOO, REINFORCE++ (grpo.py)
dpo    direct preference optimisation on chosen/rejected pairs (dpo.py)
pkg.module:Class   any Task subclass
"""

from __future__ import annotations

# Short names of the built-in modes ("module:class", imported only when chosen).
MODES = {
    "sft": "unitrain.tasks.sft:SFTTask",
    "grpo": "unitrain.tasks.grpo:GRPOTask",
    "dpo": "unitrain.tasks.dpo:DPOTask",
}


def create(run):
    """The configured mode's Task for this run."""
    from unitrain import plugins  # here: config validation imports MODES, and plugins imports config

    return plugins.resolve(run.cfg.mode, MODES, "mode", "a Task class")(run)
