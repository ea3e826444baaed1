"""The configured data format (`data_format`: registry.DATA_FORMATS or a plugin class) and its config
checks. Beside the formats, which do not import it."""

from __future__ import annotations

from unitrain import plugins, registry
from unitrain.errors import ConfigError


def data_format(cfg):
    """The configured data format (data/formats.py): a built-in of registry.DATA_FORMATS or a plugin class."""
    return plugins.resolve(cfg["data_format"], registry.DATA_FORMATS, "data_format", "a DataFormat subclass")()


def check_config(cfg) -> None:
    """The data format's config checks, run by the entry right after the config loads and for every
    stage of a pipeline: what is wrong is one ConfigError line, before anything compiles."""
    if problem := data_format(cfg).check(cfg):
        raise ConfigError(f"invalid config: {problem}")
