"""unitrain's config: one flat yml, merged in layers, typed, validated, derived and frozen.

`load_config([yml, "key=value", ...])` layers, lowest first:
  1. the root base.yml, i.e. the end of the `base_config:` chain: it lists every key, and the type
     of each default is the type every other layer must give that key;
  2. the ymls of the chain, root-most first (`base_config:` is a path relative to the directory of
     the yml that names it; an absolute path also works);
  3. `<dir of the root base.yml>/models/<model_name>.yml`: model dimensions only;
  4. command-line `key=value` overrides (the last of a repeated key wins).
A relative yml path (the first argument, or a base_config) that does not exist is taken from the
configs shipped in the package when they hold it, a leading `configs/` dropped (find_config_file).
Then each key is checked against RULES and derive() adds computed values. The checks of key
combinations are their owners' (Check, declared beside the code they concern); unitrain.checks runs them.
A user mistake raises ConfigError whose message is one sentence naming the key and where it came from.
What depends on the devices (mesh shapes, batch sizes, the attention kernel's platform) is the run
builder's (run.device_layout), so that reading a config imports no JAX and starts no backend.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import posixpath
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from unitrain.adapters import hf_config
from unitrain.errors import ConfigError
from unitrain.plugins import did_you_mean
from unitrain.registry import (
    ADVANTAGE_ESTIMATORS,
    ATTENTION,
    CONTEXT_PARALLEL_STRATEGIES,
    DATA_FORMATS,
    ENVS,
    FILTERS,
    KL_TYPES,
    LOSS_AGG_MODES,
    MODEL_SOURCES,
    MODES,
    POLICY_LOSSES,
    PREFERENCE_LOSSES,
    ROLLOUT_IS_LEVELS,
    ROLLOUT_IS_MODES,
    ROLLOUT_QUANTIZATIONS,
    SAMPLERS,
    TOOL_CALL_FORMATS,
    WORKFLOWS,
    is_plugin_spec,
)

SHIPPED_CONFIGS = Path(__file__).parent / "configs"  # base.yml, models/ and the recipes, package data
DEFAULT_CONFIG = SHIPPED_CONFIGS / "base.yml"

log = logging.getLogger("unitrain")


class Rule(NamedTuple):
    test: Callable[[Any], bool]  # gets the already-typed value
    expected: str  # completes "config key 'x' expects ..."
    names: tuple[str, ...] = ()  # the values a misspelt one is compared with for a did-you-mean


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_regex(v) -> bool:
    try:
        re.compile(v)
    except (re.error, TypeError):
        return False
    return isinstance(v, str) and v != ""


def choices(*options: str) -> Rule:
    return Rule(lambda v: v in options, "one of " + " | ".join(options), options)


def builtin_or_plugin(table) -> Rule:
    """A short name of a built-in in `table` (a seam's table in registry.py) or a plugin."""
    return Rule(
        lambda v: v in table or is_plugin_spec(v), "one of " + " | ".join(table) + " or pkg.module:symbol", tuple(table)
    )


def optional(rule: Rule) -> Rule:
    return Rule(lambda v: v is None or rule.test(v), rule.expected + " or null", rule.names)


POSITIVE = Rule(lambda v: _is_num(v) and v > 0, "a positive number")
POSITIVE_INT = Rule(lambda v: _is_num(v) and isinstance(v, int) and v > 0, "a positive int")
NON_NEGATIVE = Rule(lambda v: _is_num(v) and v >= 0, "a number >= 0")
NON_NEGATIVE_INT = Rule(lambda v: _is_num(v) and isinstance(v, int) and v >= 0, "an int >= 0")
NAME = Rule(lambda v: isinstance(v, str) and v.strip() != "", "a non-empty string")
MESH_SIZE = Rule(lambda v: v == -1 or v >= 1, "-1 (fill the remaining devices) or a positive int")
DTYPE = choices("float32", "bfloat16", "float16")
# `context` splits the sequence (models/attention.py's context-parallel attention); the rollout mesh
# samples without it (its size there is 1).
MESH_AXES = ("data", "fsdp", "context", "tensor")
ROLLOUT_MESH_AXES = ("data", "fsdp", "tensor")
TRAINER_MESH_KEYS = [f"{net}_{axis}_parallelism" for net in ("ici", "dcn") for axis in MESH_AXES]
ROLLOUT_MESH_KEYS = [f"rollout_{axis}_parallelism" for axis in ROLLOUT_MESH_AXES]

# Our decoder's families are the HF model types it reads: dense, the mixtures of experts, and the
# vision-language ones (a dense decoder with a vision tower, read from an HF folder).
DENSE_FAMILIES, MOE_FAMILIES = hf_config.DENSE_TYPES, hf_config.MOE_TYPES
VISION_LANGUAGE_FAMILIES = hf_config.VISION_LANGUAGE_TYPES

# Per-key constraints beyond the type (which comes from the default in base.yml): a new key that
# needs one adds a row here, e.g. "learning_rate": NON_NEGATIVE.
RULES: dict[str, Rule] = {
    "run_name": NAME,
    "base_output_directory": NAME,
    "seed": NON_NEGATIVE,
    "model_name": Rule(lambda v: isinstance(v, str), '"" (no model yml) or the name of a configs/models yml'),
    "model_family": choices(*DENSE_FAMILIES, *MOE_FAMILIES, *VISION_LANGUAGE_FAMILIES),
    "vocab_size": POSITIVE_INT,
    "emb_dim": POSITIVE_INT,
    "mlp_dim": POSITIVE_INT,
    "num_decoder_layers": POSITIVE_INT,
    "num_query_heads": POSITIVE_INT,
    "num_kv_heads": POSITIVE_INT,
    "head_dim": optional(POSITIVE_INT),
    "rms_norm_eps": POSITIVE,
    "rope_theta": POSITIVE,
    "rope_scaling_type": choices("none", "linear", "llama3"),
    "rope_scaling_factor": POSITIVE,
    "rope_low_freq_factor": POSITIVE,
    "rope_high_freq_factor": POSITIVE,
    "rope_original_max_position": POSITIVE_INT,
    "sliding_window": optional(POSITIVE_INT),
    "sliding_window_pattern": NON_NEGATIVE_INT,
    "rope_local_base_freq": optional(POSITIVE),
    "query_pre_attn_scalar": optional(POSITIVE_INT),
    "final_logit_softcapping": optional(POSITIVE),
    "num_experts": NON_NEGATIVE_INT,
    "num_experts_per_tok": POSITIVE_INT,
    "moe_mlp_dim": POSITIVE_INT,
    "dtype": DTYPE,
    "weight_dtype": DTYPE,
    "remat_policy": choices("none", "full", "save_dots", "save_dots_no_batch"),
    "attention": choices(*ATTENTION),
    **{key: MESH_SIZE for key in TRAINER_MESH_KEYS + ROLLOUT_MESH_KEYS},
    "context_parallel_strategy": choices(*CONTEXT_PARALLEL_STRATEGIES),
    "rollout_devices": NON_NEGATIVE_INT,
    "rollout_meshes": POSITIVE_INT,
    "max_staleness": NON_NEGATIVE_INT,
    "max_concurrent_rollouts": NON_NEGATIVE_INT,
    "rollout_chunk_tokens": NON_NEGATIVE_INT,
    "mode": builtin_or_plugin(MODES),
    "model_source": builtin_or_plugin(MODEL_SOURCES),
    "sampler": builtin_or_plugin(SAMPLERS),
    "vllm_python": NAME,
    "vllm_servers": POSITIVE_INT,
    "vllm_urls": Rule(
        lambda v: (
            isinstance(v, (list, tuple))
            and all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in v)
        ),
        "a list of http:// URLs ([] = start vllm_servers servers)",
    ),
    "vllm_startup_timeout": POSITIVE,
    "vllm_request_timeout": POSITIVE,
    "vllm_max_retries": NON_NEGATIVE_INT,
    "vllm_restarts": NON_NEGATIVE_INT,
    "sglang_python": NAME,
    "sglang_startup_timeout": POSITIVE,
    "sglang_request_timeout": POSITIVE,
    "sglang_max_retries": NON_NEGATIVE_INT,
    "sglang_restarts": NON_NEGATIVE_INT,
    "vllm_weight_transfer": Rule(
        lambda v: v in ("", "memory", "folder"),
        '"" (memory for the servers the trainer starts of model_source unitrain, else folder) | memory | folder',
        ("memory", "folder"),
    ),
    # ranked is the data format's choice (rollout_decoding=beam), not a value of its own
    "workflow": Rule(
        lambda v: v != "ranked" and builtin_or_plugin(WORKFLOWS).test(v),
        "single_turn | multi_turn | pkg.module:symbol (ranked groups: rollout_decoding=beam)",
        ("single_turn", "multi_turn"),
    ),
    "env": Rule(
        lambda v: v == "" or builtin_or_plugin(ENVS).test(v),
        '"" (none) | ' + builtin_or_plugin(ENVS).expected,
        tuple(ENVS),
    ),
    "max_turns": POSITIVE_INT,
    "episode_max_tokens": POSITIVE_INT,
    "env_timeout": Rule(lambda v: _is_num(v) and 0 <= v < math.inf, "a number of seconds >= 0 (0: no limit)"),
    "tool_call_format": choices(*TOOL_CALL_FORMATS),
    "turn_discount": Rule(lambda v: _is_num(v) and 0 < v <= 1, "a number in (0, 1]"),
    "guess_number_low": Rule(lambda v: isinstance(v, int), "an int"),
    "guess_number_high": Rule(lambda v: isinstance(v, int), "an int"),
    "reasoning_gym_task": NAME,
    "dynamic_sampling_filter": Rule(
        lambda v: v == "" or builtin_or_plugin(FILTERS).test(v), '"" (keep all), ' + builtin_or_plugin(FILTERS).expected
    ),
    "steps": POSITIVE_INT,
    "gradient_accumulation_steps": POSITIVE_INT,
    "learning_rate": NON_NEGATIVE,
    "lr_schedule": choices("cosine", "linear", "constant"),
    "warmup_steps": NON_NEGATIVE,
    "lr_final_fraction": Rule(lambda v: _is_num(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "adam_b1": Rule(lambda v: _is_num(v) and 0 <= v < 1, "a number in [0, 1)"),
    "adam_b2": Rule(lambda v: _is_num(v) and 0 <= v < 1, "a number in [0, 1)"),
    "adam_eps": POSITIVE,
    "weight_decay": NON_NEGATIVE,
    "max_grad_norm": NON_NEGATIVE,
    "z_loss_weight": NON_NEGATIVE,
    "moe_aux_loss_coef": NON_NEGATIVE,
    "moe_z_loss_coef": NON_NEGATIVE,
    "logits_chunk_size": NON_NEGATIVE,
    "attention_chunk_size": NON_NEGATIVE,
    "action": choices("train", "eval", "export"),
    "resume_step": optional(POSITIVE_INT),
    "checkpoint_period": POSITIVE_INT,
    "max_to_keep": POSITIVE_INT,
    "eval_interval": NON_NEGATIVE,
    "eval_steps": POSITIVE_INT,
    "eval_num_samples": NON_NEGATIVE,
    "dataset_path": NAME,
    "prompt_key": NAME,
    "completion_key": NAME,
    "messages_key": NAME,
    "per_device_batch_size": POSITIVE_INT,
    "max_target_length": POSITIVE_INT,
    "max_image_patches": NON_NEGATIVE_INT,
    "truncation": choices("truncate", "drop"),
    "num_epochs": optional(POSITIVE_INT),
    "builtin_task_digits": POSITIVE_INT,
    "builtin_task_ops": Rule(
        lambda v: isinstance(v, str) and v and set(v) <= set("+-*") and len(set(v)) == len(v),
        "one or more of the operators + - * (each once), e.g. +-*",
    ),
    "data_shards": POSITIVE_INT,
    "log_period": POSITIVE_INT,
    "profiler": Rule(lambda v: v in ("", "xplane"), '"" (off) or xplane'),
    "profiler_start_step": NON_NEGATIVE,
    "profiler_steps": POSITIVE_INT,
    "peak_flops_per_device": optional(POSITIVE),
    "matmul_peak_size": POSITIVE_INT,
    "wandb_mode": choices("online", "offline", "disabled"),
    "label_key": NAME,
    "max_prompt_length": POSITIVE_INT,
    "reward": Rule(
        lambda v: isinstance(v, str) and all(e.strip() for e in v.split(",")),
        "a comma list of reward names (math, gsm8k, exact_match, format, rm or pkg.module:function)",
    ),
    "reward_weights": optional(
        Rule(
            lambda v: isinstance(v, list) and len(v) > 0 and all(_is_num(w) and math.isfinite(w) for w in v),
            "a non-empty list of finite numbers",
        )
    ),
    "format_reward_pattern": NAME,
    "reward_model_max_length": Rule(lambda v: isinstance(v, int) and v >= 2, "an int >= 2"),
    "reward_model_batch_size": POSITIVE_INT,
    "math_reward_timeout": NON_NEGATIVE,
    "n_samples_per_prompt": POSITIVE_INT,
    "rollout_batch_size": POSITIVE_INT,
    "over_sampling_batch_size": NON_NEGATIVE,
    "max_sampling_rounds": POSITIVE_INT,
    "rollout_max_response_len": POSITIVE_INT,
    "rollout_temperature": POSITIVE,
    "rollout_top_p": Rule(lambda v: _is_num(v) and 0 < v <= 1, "a number in (0, 1]"),
    "rollout_top_k": NON_NEGATIVE,
    "rollout_cache_phases": POSITIVE_INT,
    "rollout_compaction": NON_NEGATIVE_INT,
    "rollout_compaction_min_tokens": NON_NEGATIVE_INT,
    "rollout_quantization": choices(*ROLLOUT_QUANTIZATIONS),
    "advantage_estimator": builtin_or_plugin(ADVANTAGE_ESTIMATORS),
    "eps_clip": POSITIVE,
    "eps_clip_high": optional(POSITIVE),
    "eps_clip_c": optional(Rule(lambda v: _is_num(v) and v > 1, "a number > 1")),
    "loss_agg_mode": choices(*LOSS_AGG_MODES),
    "policy_loss": builtin_or_plugin(POLICY_LOSSES),
    "rollout_is_level": choices(*ROLLOUT_IS_LEVELS),
    "rollout_is_mode": choices(*ROLLOUT_IS_MODES),
    "rollout_is_threshold": Rule(lambda v: _is_num(v) and v > 1, "a number > 1"),
    "rollout_is_threshold_lower": optional(Rule(lambda v: _is_num(v) and 0 < v < 1, "a number in (0, 1)")),
    "overlong_buffer_len": Rule(lambda v: isinstance(v, int) and v >= 0, "an int >= 0 (0 = off)"),
    "overlong_penalty_factor": POSITIVE,
    "kl_coef": NON_NEGATIVE,
    "teacher_weights": optional(
        Rule(
            lambda v: isinstance(v, list) and len(v) > 0 and all(_is_num(w) and 0 <= w < math.inf for w in v),
            "a non-empty list of finite numbers >= 0",
        )
    ),
    "distill_coef": NON_NEGATIVE,
    "distill_reward_weight": NON_NEGATIVE,
    "distill_kl_discount": Rule(lambda v: _is_num(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "distill_temperature": POSITIVE,
    "distill_top_k": POSITIVE_INT,
    "gkd_beta": optional(Rule(lambda v: _is_num(v) and 0 <= v <= 1, "a number in [0, 1]")),
    "distill_lmbda": Rule(lambda v: _is_num(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "kl_type": choices(*KL_TYPES),
    "entropy_coef": NON_NEGATIVE,
    "num_iterations": POSITIVE_INT,
    "gae_gamma": Rule(lambda v: _is_num(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "gae_lambda": Rule(lambda v: _is_num(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "value_clip": optional(POSITIVE),
    "critic_learning_rate": optional(NON_NEGATIVE),
    "critic_warmup_steps": NON_NEGATIVE_INT,
    "rl_packing_row_tokens": NON_NEGATIVE_INT,
    "critic_path": Rule(lambda v: isinstance(v, str), 'a path or ""'),
    "eval_pass_k": POSITIVE_INT,
    "eval_n_samples": NON_NEGATIVE,
    "sample_log_period": POSITIVE_INT,
    "distributed_init": choices("auto", "on", "off"),
    "num_processes": POSITIVE_INT,
    "process_id": NON_NEGATIVE,
    "max_replicated_param_mib": NON_NEGATIVE,
    "dpo_beta": POSITIVE,
    "dpo_label_smoothing": Rule(lambda v: _is_num(v) and 0 <= v < 0.5, "a number in [0, 0.5)"),
    "dpo_loss_type": choices(*PREFERENCE_LOSSES),
    "simpo_gamma": NON_NEGATIVE,
    "cpo_alpha": NON_NEGATIVE,
    "kto_desirable_weight": POSITIVE,
    "kto_undesirable_weight": POSITIVE,
    "kto_label_key": NAME,
    "chosen_key": NAME,
    "chat_loss_on": choices("all_assistant", "last_assistant"),
    "rejected_key": NAME,
    "rm_margin_key": Rule(lambda v: isinstance(v, str), '"" (no margin) or a record field name'),
    "rm_center_coef": NON_NEGATIVE,
    "vocab_pad_multiple": POSITIVE_INT,
    "data_format": builtin_or_plugin(DATA_FORMATS),
    "rollout_decoding": choices("sample", "beam"),
    "beam_width": POSITIVE_INT,
    "beam_length_penalty": Rule(lambda v: _is_num(v) and math.isfinite(v), "a finite number"),
    "lora_rank": Rule(lambda v: isinstance(v, int) and v >= 0, "an int >= 0 (0 = no LoRA)"),
    "lora_alpha": POSITIVE,
    "lora_target": Rule(_is_regex, "a regular expression over '/'-joined parameter paths"),
    "lora_base_dtype": Rule(
        lambda v: v in ("", "bfloat16", "int8", "nf4"), '"" (as weight_dtype) | bfloat16 | int8 | nf4'
    ),
}

# The only keys a configs/models/*.yml may (and must) set: the model section of base.yml without
# the run-time choices (model_name, dtype, weight_dtype, remat_policy, scan_layers, attention).
MODEL_KEYS = (
    "model_family",
    "vocab_size",
    "emb_dim",
    "mlp_dim",
    "num_decoder_layers",
    "num_query_heads",
    "num_kv_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling_type",
    "rope_scaling_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_position",
    "qkv_bias",
    "qk_norm",
    "tie_word_embeddings",
    "sliding_window",
    "sliding_window_pattern",
    "rope_local_base_freq",
    "query_pre_attn_scalar",
    "final_logit_softcapping",
    "num_experts",
    "num_experts_per_tok",
    "moe_mlp_dim",
    "moe_norm_topk_prob",
)


class Check(NamedTuple):
    """A cross-key check, declared by what it concerns (CONFIG_CHECKS of the modules in
    registry.CONFIG_CHECKS; unitrain.checks runs them after the load): the keys it reads, and
    fn(cfg) -> None or what is wrong, one sentence."""

    keys: tuple[str, ...]
    fn: Callable[[Mapping], str | None]

    def __call__(self, cfg: Mapping) -> str | None:
        return self.fn(cfg)


def check(*keys: str) -> Callable[[Callable], Check]:
    """`@check("mode", "critic_path")` over fn(cfg) -> str | None: a Check reading those keys alone."""
    return lambda fn: Check(keys, fn)


def derive(cfg: dict) -> dict:
    """The inputs plus the values computed from them, once (new derived values go here).

    write_config writes derived keys as comments, and load_config recomputes them; users cannot set them.
    """
    out = dict(cfg)
    if out["head_dim"] is None:
        out["head_dim"] = out["emb_dim"] // out["num_query_heads"]
    run_dir = posixpath.join(out["base_output_directory"], out["run_name"])  # posixpath: gs:// too
    out["run_dir"] = run_dir
    out["checkpoint_dir"] = posixpath.join(run_dir, "checkpoints")
    out["tensorboard_dir"] = posixpath.join(run_dir, "tensorboard")
    out["metrics_file"] = posixpath.join(run_dir, "metrics.jsonl")
    out["evaluates"] = out["eval_interval"] > 0 or out["action"] == "eval"  # the mode builds its evaluators
    return out


class _FrozenDict(dict):
    """A dict that refuses changes (a mapping value inside a Config); still a dict for json and jax."""

    def _refuse(self, *args, **kwargs):
        raise TypeError("config values are frozen; use cfg.replace(...)")

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _refuse

    def __reduce__(self):
        return (_FrozenDict, (dict(self),))


def _freeze(v):
    return (
        tuple(map(_freeze, v))
        if isinstance(v, (list, tuple))
        else _FrozenDict({k: _freeze(x) for k, x in v.items()})
        if isinstance(v, Mapping)
        else v
    )


def _thaw(v):
    return (
        list(map(_thaw, v))
        if isinstance(v, (list, tuple))
        else {k: _thaw(x) for k, x in v.items()}
        if isinstance(v, Mapping)
        else v
    )


class _Default(str):
    """The origin of a value the root base.yml gave and no layer above changed (Config.is_default)."""


SET_BY_UNITRAIN = "set by unitrain"  # the origin of a value a tool or the trainer chose (Config.replace)
FROM_COMMAND_LINE = "from command line"  # the origin of a command-line key=value (the recipe's stages yield to it)


class Config(Mapping):
    """The frozen, validated config: cfg.emb_dim, cfg["emb_dim"], cfg.to_dict(), cfg.replace(emb_dim=128)."""

    def __init__(self, values: dict, inputs: dict, schema: dict, origin: dict):
        object.__setattr__(self, "_values", {k: _freeze(v) for k, v in values.items()})
        object.__setattr__(self, "_inputs", inputs)  # validated, before derive(): replace() restarts here
        object.__setattr__(self, "_schema", schema)  # the root yml: keys and default types
        object.__setattr__(self, "_origin", origin)  # key -> where its value was set, for messages

    def __getitem__(self, key):
        return self._values[key]

    def __iter__(self):
        return iter(self._values)

    def __len__(self):
        return len(self._values)

    def __getattr__(self, name):
        values = self.__dict__.get("_values", {})
        if name in values:
            return values[name]
        raise AttributeError(f"config has no key '{name}'{did_you_mean(name, values)}")

    def __setattr__(self, name, value):
        raise dataclasses.FrozenInstanceError(f"config is frozen; use cfg.replace({name}=...)")

    def __delattr__(self, name):
        raise dataclasses.FrozenInstanceError(f"config is frozen; cannot delete '{name}'")

    def __hash__(self):
        return hash(yaml.safe_dump(self.to_dict(), sort_keys=True))

    def __repr__(self):
        return "Config(" + ", ".join(f"{k}={v!r}" for k, v in self._values.items()) + ")"

    def __reduce__(self):
        return (Config, (self.to_dict(), self._inputs, self._schema, self._origin))

    def to_dict(self) -> dict:
        """A plain, yaml-serialisable copy (lists and dicts) of every value, derived ones included."""
        return {k: _thaw(v) for k, v in self._values.items()}

    def inputs(self) -> dict:
        """A plain copy of the values as set, before derive() computed any (head_dim null stays null):
        what the checks of key combinations read (unitrain.checks)."""
        return {k: _thaw(v) for k, v in self._inputs.items()}

    def replace(self, where: str = SET_BY_UNITRAIN, /, **changes) -> Config:
        """A new Config with some inputs changed; typed, validated and derived again like a load. A
        message about a change says it came `where` (e.g. "from stage 'grpo' of recipe.yml line 9")."""
        inputs, origin = dict(self._inputs), dict(self._origin)
        for key, value in changes.items():
            _set(inputs, origin, self._schema, key, value, where)
        return _build(inputs, self._schema, origin, set(changes))

    def origin(self, key: str) -> str:
        """Where the value of `key` was set, as messages say it ("from configs/base.yml line 12")."""
        return self._origin.get(key, SET_BY_UNITRAIN)

    def is_default(self, key: str) -> bool:
        """Whether `key` keeps the root base.yml's value: no recipe, model yml, checkpoint, command
        line or replace() set it."""
        return isinstance(self._origin.get(key), _Default)


_RESERVED = {name for name in dir(Config) if not name.startswith("_")}  # keys that attributes would hide


def _build(inputs: dict, schema: dict, origin: dict, explicit: set) -> Config:
    _take_checkpoint_architecture(inputs, origin, explicit)
    for key, rule in RULES.items():
        if key in inputs and not rule.test(inputs[key]):
            value, hint = inputs[key], ""
            if isinstance(value, str):
                hint = did_you_mean(value, rule.names)
            raise ConfigError(
                f"config key '{key}' expects {rule.expected}, got '{_show(value)}' "
                f"({origin.get(key, SET_BY_UNITRAIN)}){hint}"
            )
    return Config(derive(inputs), inputs, schema, origin)


def load_config(argv: list[str]) -> Config:
    """argv[0] is a yml (configs/base.yml or a recipe), the rest `key=value` overrides."""
    if not argv:
        raise ConfigError("no config file given; the first argument must be a yml such as configs/base.yml")
    chain, resolved = _read_chain(Path(argv[0]))
    root, schema, root_lines = chain[-1]
    missing = [k for k in RULES if k not in schema]
    if missing:
        raise ConfigError(
            f"{_show_path(root)} has no base_config and lacks key '{missing[0]}'; a recipe must start with `base_config: base.yml`"
        )
    if clash := _RESERVED & set(schema):
        raise ConfigError(
            f"config key '{sorted(clash)[0]}' in {_show_path(root)} is reserved (a Config method); rename it"
        )
    inputs = dict(schema)
    origin = {k: _Default(f"from {_show_path(root)} line {root_lines.get(k)}") for k in schema}
    explicit = set()  # keys a user chose (not base.yml's defaults): a checkpoint may not contradict them
    for path, data, lines in reversed(chain[:-1]):
        explicit |= set(data)
        for key, value in data.items():
            _set(inputs, origin, schema, key, value, f"from {_show_path(path)} line {lines.get(key)}")
    cli = {}
    for arg in argv[1:]:
        key, eq, raw = arg.partition("=")
        if not eq or not key:
            raise ConfigError(f"command-line argument '{arg}' is not of the form key=value")
        cli[key] = raw
    if "model_name" in cli:  # picks the model yml, so it is typed before the others
        _set(inputs, origin, schema, "model_name", None, FROM_COMMAND_LINE, raw=cli["model_name"])
    if resolved:  # a written config already holds its model's dimensions (and maybe overrides of them)
        if inputs["model_name"] != schema["model_name"]:
            raise ConfigError(
                f"model_name cannot change when loading the resolved config {_show_path(chain[0][0])}; start from configs/base.yml instead"
            )
    elif inputs["model_name"]:  # "" layers no model yml: the architecture is the checkpoint's or as set
        _apply_model(inputs, origin, schema, root.parent / "models")
        if "model_name" in explicit or "model_name" in cli:
            explicit |= set(MODEL_KEYS)
    for key, raw in cli.items():
        _set(inputs, origin, schema, key, None, FROM_COMMAND_LINE, raw=raw)
    return _build(inputs, schema, origin, explicit | set(cli))


def _take_checkpoint_architecture(inputs: dict, origin: dict, explicit: set) -> None:
    """With load_parameters_path, the architecture keys are the checkpoint's: those the user left at
    their defaults take its values, and one the user set to something else is an error. So the
    model built, the config.yml written and the checkpoint always agree."""
    path = inputs["load_parameters_path"]
    found = checkpoint_architecture(path, inputs) if path else None
    if found is None:
        return
    arch, where = found
    if not arch and (chosen := sorted(explicit & set(MODEL_KEYS))):
        raise ConfigError(
            f"config key '{chosen[0]}' is set ({origin.get(chosen[0], SET_BY_UNITRAIN)}) but model_source "
            f"{inputs['model_source']} takes the architecture from {where}; drop the architecture keys "
            "(`model_name=` on the command line drops a model yml's)"
        )
    for key, value in arch.items():
        ours = inputs[key]
        if key == "vocab_size" and key in explicit and inputs["extra_tokens"] and ours is not None and ours > value:
            continue  # extra_tokens: the model source grows the checkpoint's vocabulary (unitrain.vocab)
        if key in explicit and ours is not None and ours != value:
            set_at = origin.get(key, SET_BY_UNITRAIN)
            way = (
                "add `model_name=` (empty) to the command line to take the checkpoint's architecture"
                if set_at.endswith(_BY_MODEL_NAME.format(inputs["model_name"]))
                else f"drop the key (or set {key}={_show(value)}) to take the checkpoint's value"
            )
            raise ConfigError(
                f"config key '{key}' is {_show(ours)} ({set_at}) but the checkpoint at load_parameters_path "
                f"has {key}={_show(value)} ({where}); {way}"
            )
        inputs[key], origin[key] = value, f"from {where}"


def checkpoint_architecture(path: str, inputs: Mapping) -> tuple[dict, str] | None:
    """(architecture keys, where they were read) of the checkpoint at `path`: an HF folder's
    config.json, or the config.yml of the unitrain run at `path` (its run, checkpoint or step
    directory); no keys for an HF folder that a model source other than unitrain's reads
    itself; None when `path` holds neither."""
    if os.path.isfile(os.path.join(path, "config.json")):
        if (
            inputs["model_source"] != "unitrain"
            and hf_config.read_hf_config(path, inputs["trust_remote_code"]).model_type not in hf_config.MODEL_TYPES
        ):
            return {}, os.path.join(path, "config.json")
        return hf_config.model_keys(path, inputs["trust_remote_code"]), os.path.join(path, "config.json")
    run_config = _run_config_file(path)
    if run_config is None:
        return None
    data, _ = _read_yml(Path(run_config))
    return {k: data[k] for k in MODEL_KEYS if k in data}, _show_path(Path(os.path.normpath(run_config)))


def run_config(path: str) -> dict | None:
    """The config.yml of the unitrain run at `path` (its run, checkpoint or step directory), or None."""
    found = _run_config_file(path)
    return _read_yml(Path(found))[0] if found else None


def _run_config_file(path: str) -> str | None:
    """The config.yml of the unitrain run at `path` (its run, checkpoint or step directory), or None."""
    candidates = [os.path.join(path, *[os.pardir] * up, "config.yml") for up in range(3)]
    return next((c for c in candidates if os.path.isdir(path) and os.path.isfile(c)), None)


def vision_language_folder(path: str) -> str | None:
    """The HF folder that holds a vision-language model's tower dimensions and image processor (no
    config keys): `path` itself, or for a unitrain checkpoint the folder its run started from (its
    config.yml's load_parameters_path, followed back through earlier runs: a pipeline's stages);
    None where the chain reaches no HF folder."""
    seen = set()
    while path and path not in seen:
        seen.add(path)
        if os.path.isfile(os.path.join(path, "config.json")):
            return path
        run_config = _run_config_file(path)
        path = _read_yml(Path(run_config))[0].get("load_parameters_path") if run_config else None
    return None


_BY_MODEL_NAME = ", by model_name={}"  # ends the origin of a key a model yml set


def _apply_model(inputs: dict, origin: dict, schema: dict, models: Path) -> None:
    name = inputs["model_name"]
    path = models / f"{name}.yml"
    if "/" in name or not path.is_file():
        available = ", ".join(sorted(p.stem for p in models.glob("*.yml"))) or "none"
        raise ConfigError(f"model_name '{name}' has no file {_show_path(path)}; available: {available}")
    data, lines = _read_yml(path)
    for key, value in data.items():
        where = f"from {_show_path(path)} line {lines.get(key)}" + _BY_MODEL_NAME.format(name)
        if key in schema and key not in MODEL_KEYS:
            raise ConfigError(f"config key '{key}' is not a model dimension and cannot be set in a model yml ({where})")
        _set(inputs, origin, schema, key, value, where)
    if absent := [k for k in MODEL_KEYS if k not in data]:
        raise ConfigError(f"model file {_show_path(path)} lacks '{absent[0]}'; a model yml sets every model dimension")


def _set(inputs, origin, schema, key, value, where, raw=None) -> None:
    if key not in schema:
        hint = did_you_mean(str(key), schema) or "; the root base.yml lists every key"
        raise ConfigError(f"unknown config key '{key}' ({where}){hint}")
    inputs[key] = _typed(key, value, schema[key], where, raw)
    origin[key] = where


_TYPE_NAMES = {
    bool: "a bool (true or false)",
    int: "an int",
    float: "a number",
    str: "a string",
    list: "a list",
    dict: "a mapping",
}


def _typed(key: str, value, default, where: str, raw: str | None = None):
    """`value`, or the command-line text `raw`, converted to the type of `default`."""
    kind = type(default)
    if raw is not None:
        if kind is str:
            return raw  # as typed: run_name=007 stays '007'
        try:
            value = yaml.load(raw, Loader=_Loader)
        except yaml.YAMLError:
            if default is None:
                raise ConfigError(f"config key '{key}' got '{raw}', which is not valid YAML ({where})") from None
            value = raw  # fails the type check below with the text the user typed
    if default is None:
        return value
    if kind is bool and isinstance(value, bool) or kind is int and _is_num(value) and isinstance(value, int):
        return value
    if kind is float and _is_num(value):
        return float(value)
    if kind is float and isinstance(value, str):
        try:
            return float(value)  # e.g. a yml read without _Loader; also inf
        except ValueError:
            pass
    if kind is str and _is_num(value) or kind is str and isinstance(value, str):
        return str(value)  # run_name: 2024 in a yml
    if kind is list and isinstance(value, (list, tuple)) or kind is dict and isinstance(value, dict):
        return _thaw(value)
    shown = raw if raw is not None else _show(value)
    raise ConfigError(f"config key '{key}' expects {_TYPE_NAMES.get(kind, kind.__name__)}, got '{shown}' ({where})")


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads 1e-5 as a float (YAML 1.1 wants a dot), refuses a repeated key, and
    keeps the line of each top-level key for messages."""

    key_lines: dict | None = None

    def construct_mapping(self, node, deep=False):
        mapping = super().construct_mapping(node, deep)
        lines = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node)
            if key in lines:
                raise yaml.constructor.ConstructorError(
                    problem=f"key '{key}' appears twice (first on line {lines[key]})", problem_mark=key_node.start_mark
                )
            lines[key] = key_node.start_mark.line + 1
        if self.key_lines is None:  # the first mapping constructed is the document's top level
            self.key_lines = lines
        return mapping


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*\.?[0-9_]*|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def _read_yml(path: Path) -> tuple[dict, dict]:
    text = _read_text(path)
    loader = _Loader(text)
    try:
        data = loader.get_single_data()
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{_show_path(path)}{where} is not valid YAML: {getattr(e, 'problem', None) or e}") from None
    finally:
        loader.dispose()
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{_show_path(path)} must be a mapping of `key: value` lines, not a {type(data).__name__}")
    return data, loader.key_lines or {}


def root_config(path: Path) -> Path:
    """The root base.yml at the end of `path`'s base_config chain: the file that lists every key."""
    return _read_chain(path)[0][-1][0]


def _read_chain(path: Path) -> tuple[list[tuple[Path, dict, dict]], bool]:
    """The yml files from `path` along `base_config:` to the root, and whether one is a resolved config."""
    chain, resolved = [], False
    path = find_config_file(str(path), Path())
    while True:
        # absolute but not resolved: messages name the path as given (configs/ is a link in the checkout)
        path = Path(os.path.abspath(path))
        if path.resolve() in [p.resolve() for p, _, _ in chain]:
            names = " -> ".join(_show_path(p) for p in [*(p for p, _, _ in chain), path])
            raise ConfigError(f"base_config forms a cycle: {names}")
        data, lines = _read_yml(path)
        chain.append((path, data, lines))
        resolved |= data.pop("resolved_config", False) is True
        parent = data.pop("base_config", None)
        if parent is None:
            return chain, resolved
        if not isinstance(parent, str) or not parent:
            raise ConfigError(f"base_config in {_show_path(path)} must be a yml path, got '{_show(parent)}'")
        path = find_config_file(parent, path.parent)  # relative to this yml's directory; an absolute path replaces it


def find_config_file(name: str, directory: Path) -> Path:
    """`directory / name` if it exists, else the shipped config that `name` names (a leading
    `configs/` dropped): so `configs/base.yml`, `base_config: base.yml` and
    `chat_template_file: templates/tiny_chat.jinja` work from any directory after a wheel install.
    Else `directory / name`, whose read then fails with its own message."""
    path = directory / name
    parts = Path(name).parts
    if path.exists():
        return path
    shipped = SHIPPED_CONFIGS.joinpath(*parts[1:] if parts[:1] == ("configs",) else parts)
    if not shipped.is_file():
        return path
    log.info("config %s: no such file here, taking the shipped %s", _show_path(path), shipped)
    return shipped


def write_config(cfg: Config, path: str | os.PathLike, on_devices: Mapping | None = None) -> None:
    """Write the fully resolved config as yml; load_config([path]) gives back an equal Config.

    The model yml is already applied, so the file says `resolved_config: true` and loading it skips that
    layer; derived values follow as comments, then `on_devices`: what the run derived from its devices
    (sharding.Layout), for the record. Multi-host callers write from one process only.
    """
    values = cfg.to_dict()
    inputs = {k: values[k] for k in cfg._inputs}
    derived = {k: v for k, v in values.items() if k not in cfg._inputs} | dict(on_devices or {})
    text = (
        "# Fully resolved unitrain config (write_config): load it as is to reproduce the run.\n"
        "resolved_config: true\n"
        + _dump(inputs)
        + "# ---- derived: recomputed on load, not accepted as input\n"
        + "".join(f"# {line}\n" for line in _dump(derived).splitlines())
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # a reader never sees half a file


def _dump(values: dict) -> str:
    """One `key: value` line per key, a list or mapping inline where it holds only scalars (yaml's
    default_flow_style=None would write a mapping of scalars alone as one inline line)."""
    return "".join(
        yaml.safe_dump(
            {k: v}, sort_keys=False, default_flow_style=None if isinstance(v, (list, dict)) else False, width=1000
        )
        for k, v in values.items()
    )


_KEY_LINE = re.compile(r"^([A-Za-z_]\w*):\s*(.*?)(?:\s+#\s?(.*))?$")
_SECTION_LINE = re.compile(r"^# -+ (.+)$")


def describe_keys(base_yml: Path, keyword: str = "") -> str:
    """The keys of a root base.yml with their defaults and comments, grouped by its sections; with
    `keyword`, only the keys whose name, comment or section mentions it (the CLI's --help)."""
    lines, section, width = [], "", 34
    for text in _read_text(base_yml).splitlines():
        if m := _SECTION_LINE.match(text):
            section = m.group(1).strip()
            continue
        m = _KEY_LINE.match(text)
        if not m:
            continue
        key, default, comment = m.group(1), m.group(2) or "(a list: see the file)", m.group(3) or ""
        if keyword.lower() not in f"{key} {comment} {section}".lower():
            continue
        if not lines or lines[-1][0] != section:
            lines.append((section, []))
        lines[-1][1].append(f"  {f'{key}: {default}':<{width}}  {comment}".rstrip())
    if not lines:
        return f"no key of {_show_path(base_yml)} mentions '{keyword}'"
    return "\n".join(f"{section}:\n" + "\n".join(keys) for section, keys in lines)


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config file {_show_path(path)}: {(e.strerror or str(e)).lower()}") from None


def _show(v) -> str:
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def _show_path(p: Path) -> str:
    try:
        return str(p.relative_to(Path.cwd()))
    except ValueError:
        return str(p)
