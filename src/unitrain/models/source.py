"""The model source of `model_source: unitrain`: our decoder (decoder.py) built from the config for
the platform the programs are built for, its parameters placed in their shardings: randomly
initialised, read from an HF checkpoint (adapters.hf) or from a unitrain checkpoint.
"""

from __future__ import annotations

import logging
import os

from flax import nnx

from unitrain import checkpoint, sharding
from unitrain.adapters import hf
from unitrain.models import decoder
from unitrain.models.attention import attention_kernel

log = logging.getLogger("unitrain")


def source(cfg, mesh) -> decoder.Decoder:
    """The decoder of the config with its parameters placed in their shardings: random init, HF
    weights, or the parameters of a unitrain checkpoint (`load_parameters_path`)."""
    platform = sharding.target_platform()
    model_cfg = decoder.ModelConfig.from_config(cfg, platform)
    kernel = attention_kernel(model_cfg.attention, platform, model_cfg.dtype)
    log.info("attention: %s%s", kernel, f" (auto on {platform})" if model_cfg.attention == "auto" else "")
    rules = model_cfg.logical_axis_rules
    # Checked on the abstract model, before any parameter is materialised.
    sharding.check_not_replicated(
        nnx.state(nnx.eval_shape(lambda: decoder.create(model_cfg))), mesh, rules, cfg.max_replicated_param_mib
    )
    path = cfg.load_parameters_path
    if path and os.path.isfile(os.path.join(path, "config.json")):
        return hf.load(path, mesh=mesh, model_cfg=model_cfg)
    model = sharding.init_sharded(lambda: decoder.create(model_cfg, cfg.seed, hf.save), mesh, rules)
    if path:
        graphdef, params = nnx.split(model)
        model = nnx.merge(graphdef, checkpoint.load_params(path, nnx.to_pure_dict(params)))
    return model
