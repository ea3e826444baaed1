"""The built-in choices of every seam, as data: a short name -> "module:symbol", imported only when a
config chooses it (plugins.resolve). A third party adds a choice without editing these tables by
naming `pkg.module:symbol` in the config. A leaf: config validation reads these tables without
importing JAX or any implementation."""

# model_source: fn(cfg, mesh) -> Model, its parameters placed in their shardings
MODEL_SOURCES = {
    "unitrain": "unitrain.models.source:source",
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
