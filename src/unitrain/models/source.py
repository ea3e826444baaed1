"""The model source of `model_source: unitrain`: our decoder (decoder.py) built from the config for
the platform the programs are built for, its parameters placed in their shardings: randomly
initialised, read from an HF checkpoint (adapters.hf) or from a unitrain checkpoint (a
vision-language model's: its tower's dimensions from the HF folder its run started from,
config.vision_language_folder); with or without its LM head (sources.py).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os

import jax
from flax import nnx

from unitrain import checkpoint, sharding
from unitrain.adapters import hf, hf_config
from unitrain.config import VISION_LANGUAGE_FAMILIES as VISION_LANGUAGE
from unitrain.config import vision_language_folder
from unitrain.errors import ConfigError
from unitrain.models import decoder, qwen2_5_vl
from unitrain.models.attention import attention_kernel

log = logging.getLogger("unitrain")

# An HF checkpoint's output heads, a causal LM's and a classifier's: tensors a headless decoder does
# not hold, and no error in the folder it is read from (a scalar head reads the classifier's score).
HEAD_TENSORS = ("lm_head.weight", "score.weight")


def source(cfg, mesh, output_head: bool = True) -> decoder.Decoder:
    """The decoder of the config with its parameters placed in their shardings: random init, HF
    weights, or the parameters of a unitrain checkpoint (`load_parameters_path`). Without
    `output_head`, a scalar head's backbone: no LM head, that of the checkpoint (HF or unitrain) not read."""
    platform = sharding.target_platform()
    model_cfg = decoder.ModelConfig.from_config(cfg, platform, output_head=output_head)
    path = cfg.load_parameters_path
    vision = None
    if cfg.model_family in VISION_LANGUAGE:  # the decoder's multimodal fields, like the tower, are config.json's
        folder = vision_language_folder(path)
        if folder is None:
            raise ConfigError(
                f"load_parameters_path {path}: a {cfg.model_family} checkpoint whose run started from no HF folder, "
                "whose config.json holds the vision tower's dimensions"
            )
        vision = hf.vision_config_from_hf(folder, cfg.trust_remote_code)
        keys, _ = hf_config.vision_language_keys(folder)
        model_cfg = dataclasses.replace(
            model_cfg, mrope_section=keys["mrope_section"], image_token_id=keys["image_token_id"]
        )
    context = mesh.shape["context"]
    kernel = attention_kernel(
        model_cfg.attention, platform, model_cfg.dtype, context, model_cfg.context_parallel_strategy
    )
    where = f" (auto on {platform}{f', context {context}' if context > 1 else ''})"
    log.info("attention: %s%s", kernel, where if model_cfg.attention == "auto" else "")
    rules = model_cfg.logical_axis_rules
    # Checked on the abstract model, before any parameter is materialised.
    create = decoder.create if vision is None else functools.partial(qwen2_5_vl.create, vision=vision)
    sharding.check_not_replicated(
        nnx.state(nnx.eval_shape(lambda: create(model_cfg))), mesh, rules, cfg.max_replicated_param_mib
    )
    if path and os.path.isfile(os.path.join(path, "config.json")):
        return hf.load(path, mesh=mesh, model_cfg=model_cfg, other_tensors=() if output_head else HEAD_TENSORS)
    model = sharding.init_sharded(lambda: create(model_cfg, seed=cfg.seed, hf_writer=hf.save), mesh, rules)
    if path and output_head:
        graphdef, params = nnx.split(model)
        model = nnx.merge(graphdef, checkpoint.load_params(path, nnx.to_pure_dict(params)))
    elif path:
        model = _backbone_of_causal_lm(model, path, model_cfg, mesh)
    return model


def _backbone_of_causal_lm(model: decoder.Decoder, path: str, model_cfg, mesh) -> decoder.Decoder:
    """The headless `model` with the parameters of the causal LM in the unitrain checkpoint at
    `path`: the LM read as it was saved, its output head then dropped."""
    rules = model_cfg.logical_axis_rules
    causal = nnx.state(nnx.eval_shape(lambda: decoder.create(dataclasses.replace(model_cfg, output_head=True))))
    like = jax.tree.map(
        lambda var, s: jax.ShapeDtypeStruct(var.shape, var.dtype, sharding=s),
        nnx.to_pure_dict(causal),
        nnx.to_pure_dict(sharding.state_shardings(causal, mesh, rules)),
    )
    lm = checkpoint.load_params(path, like)
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    nnx.replace_by_pure_dict(state, {k: v for k, v in lm.items() if k in params})
    return nnx.merge(graphdef, state)
