"""Models behind one interface (base.py). `model_source` picks who builds the model:

unitrain   our decoder (source.py): random init, HF safetensors or a unitrain checkpoint
tunix      Tunix's model library (unitrain.adapters.tunix; the `tunix` extra): HF checkpoints
pkg.module:fn   any fn(cfg, mesh) -> Model
"""

from __future__ import annotations

from unitrain import plugins, registry


def build(cfg, mesh):
    """The configured model with its parameters placed in their shardings."""
    return plugins.resolve(cfg.model_source, registry.MODEL_SOURCES, "model_source")(cfg, mesh)
