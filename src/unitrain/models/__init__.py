"""Models behind one interface (base.py). `model_source` picks who builds the model:

unitrain   our decoder (decoder.py): random init, HF safetensors or a unitrain checkpoint
tunix      Tunix's model library (unitrain.adapters.tunix; the `tunix` extra): HF checkpoints
pkg.module:fn   any fn(cfg, mesh) -> Model
"""

from __future__ import annotations

# Short names of the built-in model sources ("module:function", imported only when chosen).
SOURCES = {
    "unitrain": "unitrain.models.decoder:source",
    "tunix": "unitrain.adapters.tunix:source",
}


def build(cfg, mesh):
    """The configured model with its parameters placed in their shardings."""
    from unitrain import plugins  # here: config validation imports SOURCES, and plugins imports config

    return plugins.resolve(cfg.model_source, SOURCES, "model_source")(cfg, mesh)
