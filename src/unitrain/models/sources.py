"""Who builds the model: `model_source` (registry.MODEL_SOURCES) picks a model source. Beside the
sources, which do not import it.

unitrain   our decoder (source.py): random init, HF safetensors or a unitrain checkpoint
tunix      Tunix's model library (unitrain.adapters.tunix; the `tunix` extra): HF checkpoints
mllm_jax   MLLM_JAX's Llama, Qwen2 and Qwen3 (unitrain.adapters.mllm_jax; a checkout at mllm_jax_path): HF checkpoints
pkg.module:fn   any fn(cfg, mesh) -> Model

A source is fn(cfg, mesh, output_head=True) -> Model, the model of cfg.load_parameters_path with
its parameters placed. The built-ins take `output_head`, and so may a plugin: fn(cfg, mesh,
output_head=False) builds the model without its LM head (an HF folder's head tensors, a causal LM's
or a classifier's score, left unread), under which a scalar head (models/scalar_head.py, which
reads or initialises the head) makes it a critic or a reward model.
"""

from __future__ import annotations

import inspect
import os

from flax import nnx

from unitrain import checkpoint, lora, plugins, registry
from unitrain.config import VISION_LANGUAGE_FAMILIES, check, run_config
from unitrain.errors import ConfigError


def build(cfg, mesh, output_head: bool = True):
    """The configured model with its parameters placed in their shardings (without its LM head:
    the backbone of a scalar-head model)."""
    if output_head and (merged := from_lora_run(cfg, mesh)) is not None:
        return merged
    source = plugins.resolve(cfg.model_source, registry.MODEL_SOURCES, "model_source")
    if output_head:
        return source(cfg, mesh)
    if "output_head" not in inspect.signature(source).parameters:
        raise ConfigError(
            f"model_source {cfg.model_source} takes no output_head, so it builds no headless model for a "
            "critic or a reward model; give its fn an output_head parameter (models/sources.py)"
        )
    return source(cfg, mesh, output_head=False)


LORA_KEYS = ("lora_rank", "lora_alpha", "lora_target", "lora_base_dtype")  # what rebuilds a run's adapters


def lora_run_config(path: str) -> dict | None:
    """The config.yml of the LoRA run (lora_rank > 0) whose run, checkpoint or step directory `path`
    is, else None. An HF folder is itself, even where it sits in such a run's directory (its merged
    export)."""
    if not path or not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json")):
        return None
    recorded = run_config(path)
    return recorded if recorded and recorded.get("lora_rank") else None


def from_lora_run(cfg, mesh):
    """The merged model of the LoRA run whose checkpoint cfg.load_parameters_path names (None when it
    names none): the run's base (its config.yml's load_parameters_path, built as `build` builds any
    model, a LoRA run's merged model in turn) under the run's adapters, read from the checkpoint."""
    path = cfg.load_parameters_path
    recorded = lora_run_config(path)
    if recorded is None:
        return None
    base = build(cfg.replace(load_parameters_path=recorded["load_parameters_path"]), mesh)
    model = lora.apply(base, cfg.replace(**{k: recorded[k] for k in LORA_KEYS}), mesh)
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    params[lora.ADAPTERS] = checkpoint.load_params(path, params[lora.ADAPTERS])
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state).merged()


@check("num_query_heads", "num_kv_heads")
def _heads_group(c) -> str | None:
    if c["num_query_heads"] % c["num_kv_heads"] == 0:
        return None
    return f"num_query_heads ({c['num_query_heads']}) must be a multiple of num_kv_heads ({c['num_kv_heads']})"


@check("head_dim", "emb_dim", "num_query_heads")
def _head_dim(c) -> str | None:
    if c["head_dim"] is not None or c["emb_dim"] % c["num_query_heads"] == 0:
        return None
    return f"head_dim is null but emb_dim ({c['emb_dim']}) is not a multiple of num_query_heads ({c['num_query_heads']}); set head_dim"


@check("rope_scaling_type", "rope_high_freq_factor", "rope_low_freq_factor")
def _llama3_rope(c) -> str | None:
    if c["rope_scaling_type"] != "llama3" or c["rope_high_freq_factor"] > c["rope_low_freq_factor"]:
        return None
    return "rope_scaling_type llama3 needs rope_high_freq_factor > rope_low_freq_factor"


@check("attention", "model_source")
def _attention_kernel(c) -> str | None:
    if c["attention"] in ("auto", "xla") or c["model_source"] == "unitrain":
        return None
    return f"attention={c['attention']} is a kernel of model_source unitrain; model_source {c['model_source']} brings its own attention (use auto or xla)"


@check("model_family", "load_parameters_path", "model_source")
def _vision_language_folder(c) -> str | None:
    # The tower's dimensions are no config keys: config.json holds them, or that of the HF folder a
    # unitrain checkpoint's run started from (found when the model is built: a pipeline's later
    # stages start from checkpoints not written yet).
    if c["model_family"] not in VISION_LANGUAGE_FAMILIES or (
        c["model_source"] == "unitrain" and c["load_parameters_path"]
    ):
        return None
    return (
        f"model_family {c['model_family']} (a vision tower) is read from an HF folder only: set load_parameters_path "
        "to one, or to a unitrain checkpoint of a run that started from one (with model_source unitrain)"
    )


@check("freeze_vision_tower", "model_family", "lora_rank")
def _frozen_tower(c) -> str | None:
    if not c["freeze_vision_tower"]:
        return None
    if c["model_family"] not in VISION_LANGUAGE_FAMILIES:
        return f"freeze_vision_tower is true but model_family {c['model_family']} has no vision tower"
    if c["lora_rank"]:
        return "freeze_vision_tower is true with lora_rank > 0: LoRA already trains its adapters alone"
    return None


CONFIG_CHECKS = (_heads_group, _head_dim, _llama3_rope, _attention_kernel, _vision_language_folder, _frozen_tower)
