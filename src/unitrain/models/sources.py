"""Who builds the model: `model_source` (registry.MODEL_SOURCES) picks a model source. Beside the
sources, which do not import it.


unitrain   our decoder (source.py): random init, HF safetensors or a unitrain checkpoint
tunix      Tunix's model library (unitrain.adapters.tunix; the `tunix` extra): HF checkpoints
pkg.module:fn   any fn(cfg, mesh) -> Model; with an `output_head` parameter, fn(cfg, mesh,
                output_head=False) builds it without its LM head, under which a scalar head
                (models/scalar_head.py) makes it a critic or a reward model
"""

from __future__ import annotations

import inspect

from unitrain import plugins, registry
from unitrain.errors import ConfigError


def build(cfg, mesh, output_head: bool = True):
    """The configured model with its parameters placed in their shardings (without its LM head:
    the backbone of a scalar-head model)."""
    source = plugins.resolve(cfg.model_source, registry.MODEL_SOURCES, "model_source")
    if output_head:
        return source(cfg, mesh)
    if "output_head" not in inspect.signature(source).parameters:
        raise ConfigError(
            f"model_source {cfg.model_source} takes no output_head, so it builds no headless model for a "
            "critic or a reward model; give its fn an output_head parameter (models/__init__.py)"
        )
    return source(cfg, mesh, output_head=False)
