"""The configured data format (`data_format`: registry.DATA_FORMATS or a plugin class). Beside the
formats, which do not import it; unitrain.checks runs its config checks."""

from __future__ import annotations

from unitrain import plugins, registry


def data_format(cfg):
    """The configured data format (data/formats.py): a built-in of registry.DATA_FORMATS or a plugin class."""
    return plugins.resolve(cfg["data_format"], registry.DATA_FORMATS, "data_format", "a DataFormat subclass")()
