"""The built-in choices of every seam and of the config's choice keys, as data. The seams' tables map
a short name -> "module:symbol", imported only when a config chooses it (plugins.resolve); a third
party adds a choice without editing them by naming `pkg.module:symbol` in the config. The choice
keys' tables are tuples of names that the config validates against and the implementations branch
on. A leaf: config validation reads these tables without importing JAX or any implementation."""

import re

# model_source: fn(cfg, mesh) -> Model, its parameters placed in their shardings
MODEL_SOURCES = {
    "unitrain": "unitrain.models.source:source",
    "tunix": "unitrain.adapters.tunix:source",
    "mllm_jax": "unitrain.adapters.mllm_jax:source",
}

# sampler: fn(run) -> Sampler
SAMPLERS = {
    "colocated": "unitrain.engines.colocated:from_run",
    "mesh": "unitrain.engines.mesh:from_run",
    "vllm": "unitrain.engines.vllm:from_run",
    "sglang": "unitrain.engines.sglang:from_run",
}

# dynamic_sampling_filter: fn(group) -> bool
FILTERS = {"nonzero_std": "unitrain.rollout.groups:nonzero_std"}

# workflow: a rollout.workflow.Workflow subclass, made as Class(run); ranked is chosen by the data
# format where it ranks rollouts (DataFormat.workflow)
WORKFLOWS = {
    "single_turn": "unitrain.rollout.single_turn:SingleTurn",
    "multi_turn": "unitrain.rollout.multi_turn:MultiTurn",
    "ranked": "unitrain.rollout.ranked:Ranked",
}

# env: fn(cfg) -> envs.base.Environment, one per episode
ENVS = {
    "calculator": "unitrain.envs.calculator:make_calculator",
    "guess_number": "unitrain.envs.guess:make_guess_number",
    "reasoning_gym": "unitrain.envs.reasoning_gym:make_reasoning_gym",
}
TOOL_CALL_FORMATS = ("hermes", "llama3_json")

# mode: a tasks.base.Task subclass
MODES = {
    "sft": "unitrain.tasks.sft:SFTTask",
    "grpo": "unitrain.tasks.grpo:GRPOTask",
    "dpo": "unitrain.tasks.dpo:DPOTask",
    "rm": "unitrain.tasks.rm:RMTask",
    "ppo": "unitrain.tasks.ppo:PPOTask",
    "online_dpo": "unitrain.tasks.online_dpo:OnlineDPOTask",
}
RL_MODES = (
    "grpo",
    "ppo",
)  # the modes that train on rollouts (rollout_batch_size prompts x n_samples_per_prompt a step)

# attention: the reference einsums (xla), a platform's fused kernel, or auto (the decoder's kernels)
ATTENTION = ("auto", "xla", "cudnn", "splash")
# context_parallel_strategy: how attention reads the keys of a sequence split over the `context` axis
CONTEXT_PARALLEL_STRATEGIES = ("auto", "all_gather", "ring")

# advantage_estimator: fn(advantages.Rollout) -> ({"advantages", ...}, metrics); GRPO's choice (gae is
# PPO's, from its critic's values)
ADVANTAGE_ESTIMATORS = {
    "grpo": "unitrain.advantages:grpo",
    "drgrpo": "unitrain.advantages:drgrpo",
    "rloo": "unitrain.advantages:rloo",
    "reinforce_pp": "unitrain.advantages:reinforce_pp",
    "gae": "unitrain.advantages:gae",
}
GROUP_ESTIMATORS = ("grpo", "drgrpo", "rloo", "reinforce_pp")  # losses.compute_advantages'

# The RL objective's choices (losses.py)
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
# policy_loss: the clipped surrogate's log importance ratio, fn(logprobs, old_logprobs, mask, sequences) -> [B, T]
POLICY_LOSSES = {"ppo": "unitrain.losses:token_log_ratio", "gspo": "unitrain.losses:sequence_log_ratio"}
ROLLOUT_IS_LEVELS = ("token", "sequence", "geometric")
ROLLOUT_IS_MODES = ("truncate", "mask")
# rollout_quantization: the sampler's weights (engines/colocated.py; vLLM's own flags, engines/vllm.py)
ROLLOUT_QUANTIZATIONS = ("none", "int8", "fp8")

# dpo_loss_type: mode=dpo's preference losses (losses.py); kto reads unpaired records
PREFERENCE_LOSSES = ("sigmoid", "ipo", "simpo", "cpo", "orpo", "kto")
REFERENCE_FREE_LOSSES = ("simpo", "cpo", "orpo")  # no reference model is loaded or run for these

# The modules whose CONFIG_CHECKS (config.Check: the keys read, fn(cfg) -> None or what is wrong)
# checks.check_config runs after every load, each beside the code it concerns; the data format's
# own checks run with them (DataFormat.check)
CONFIG_CHECKS = (
    "unitrain.models.sources:CONFIG_CHECKS",
    "unitrain.adapters.mllm_jax:CONFIG_CHECKS",
    "unitrain.models.moe:CONFIG_CHECKS",
    "unitrain.models.attention:CONFIG_CHECKS",
    "unitrain.models.context_parallel:CONFIG_CHECKS",
    "unitrain.sharding:CONFIG_CHECKS",
    "unitrain.distributed:CONFIG_CHECKS",
    "unitrain.checkpoint:CONFIG_CHECKS",
    "unitrain.export:CONFIG_CHECKS",
    "unitrain.lora:CONFIG_CHECKS",
    "unitrain.losses:CONFIG_CHECKS",
    "unitrain.advantages:CONFIG_CHECKS",
    "unitrain.evals:CONFIG_CHECKS",
    "unitrain.reward_model:CONFIG_CHECKS",
    "unitrain.data.prompt_ids:CONFIG_CHECKS",
    "unitrain.data.images:CONFIG_CHECKS",
    "unitrain.data.rl_packing:CONFIG_CHECKS",
    "unitrain.engines.factory:CONFIG_CHECKS",
    "unitrain.engines.vllm:CONFIG_CHECKS",
    "unitrain.engines.sglang:CONFIG_CHECKS",
    "unitrain.rollout.driver:CONFIG_CHECKS",
    "unitrain.rollout.executor:CONFIG_CHECKS",
    "unitrain.rollout.shaping:CONFIG_CHECKS",
    "unitrain.envs.guess:CONFIG_CHECKS",
    "unitrain.tasks.rl:CONFIG_CHECKS",
    "unitrain.tasks.ppo:CONFIG_CHECKS",
    "unitrain.tasks.teacher:CONFIG_CHECKS",
    "unitrain.tasks.gkd:CONFIG_CHECKS",
    "unitrain.tasks.rm:CONFIG_CHECKS",
    "unitrain.tasks.dpo:CONFIG_CHECKS",
    "unitrain.tasks.online_dpo:CONFIG_CHECKS",
)

_PLUGIN_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def is_plugin_spec(value) -> bool:
    """`pkg.module:symbol`, the form in which a config names code outside unitrain (plugins.py loads it)."""
    return isinstance(value, str) and bool(_PLUGIN_SPEC.match(value))


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
    "rm": "unitrain.reward_model:make_rm_reward",
    "sid_hit": "unitrain.recsys.rewards:make_sid_hit_reward",
    "sid_rank": "unitrain.recsys.rewards:make_sid_rank_reward",
}
