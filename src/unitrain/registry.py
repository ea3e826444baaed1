"""The built-in choices of every seam, as data: a short name -> "module:symbol", imported only when a
config chooses it (plugins.resolve). A third party adds a choice without editing these tables by
naming `pkg.module:symbol` in the config. A leaf: config validation reads these tables without
importing JAX or any implementation."""

# model_source: fn(cfg, mesh) -> Model, its parameters placed in their shardings
MODEL_SOURCES = {
    "unitrain": "unitrain.models.decoder:source",
    "tunix": "unitrain.adapters.tunix:source",
}

# sampler: fn(run) -> Sampler
SAMPLERS = {
    "colocated": "unitrain.rollout.colocated:from_run",
    "mesh": "unitrain.rollout.mesh:from_run",
}

# dynamic_sampling_filter: fn(group) -> bool
FILTERS = {"nonzero_std": "unitrain.rollout.groups:nonzero_std"}

# mode: a tasks.base.Task subclass
MODES = {
    "sft": "unitrain.tasks.sft:SFTTask",
    "grpo": "unitrain.tasks.grpo:GRPOTask",
    "dpo": "unitrain.tasks.dpo:DPOTask",
}

# ---------------------------------------------------------------- data formats and rewards (the recsys plug-in registers here)

# data_format: a unitrain.data.formats.DataFormat subclass: how the data files become records, and
# what the format brings the modes (an evaluator, ranked rollouts, config checks)
DATA_FORMATS = {
    "records": "unitrain.data.formats:DataFormat",
    "minionerec": "unitrain.recsys.format:MiniOneRec",
}

# reward: a factory fn(cfg) -> reward (a plugin names the reward itself: fn(prompt, completion, label) -> float)
REWARDS = {
    "math": "unitrain.rewards:make_math_reward",
    "gsm8k": "unitrain.rewards:make_gsm8k_reward",
    "exact_match": "unitrain.rewards:make_exact_match_reward",
    "format": "unitrain.rewards:make_format_reward",
    "sid_hit": "unitrain.recsys.rewards:make_sid_hit_reward",
    "sid_rank": "unitrain.recsys.rewards:make_sid_rank_reward",
}
