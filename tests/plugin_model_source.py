"""A model source written as a plugin outside the package (`model_source: plugin_model_source:source`):
a decoder built and initialised by hand from the config's model keys, with or without its LM head, so
that it serves as a policy and (under a scalar head) as PPO's critic. It records each build."""

from __future__ import annotations

from unitrain import sharding
from unitrain.models import decoder

BUILT: list = []


def source(cfg, mesh, output_head: bool = True):
    model_cfg = decoder.ModelConfig.from_config(cfg, sharding.target_platform(), output_head=output_head)
    BUILT.append(output_head)
    return sharding.init_sharded(lambda: decoder.create(model_cfg, cfg.seed), mesh, model_cfg.logical_axis_rules)
