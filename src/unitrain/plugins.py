"""One loader for everything a config may name as `pkg.module:symbol`: rewards, dynamic-sampling
filters, model sources, samplers, modes, workflows, environments and data formats.

Built-ins keep short names; registry.py keeps each seam's table of them (as "module:symbol" strings,
imported only when chosen) and config validation reads the same tables.
A plugin is imported only when the config names it. Every failure is one ConfigError line that
names the config key, the spec and what went wrong.
"""

from __future__ import annotations

import difflib
import importlib

from unitrain.errors import ConfigError
from unitrain.registry import is_plugin_spec


def load(spec: str, key: str, expected: str = "a callable"):
    """The object `spec` = "pkg.module:symbol" names (the symbol may be dotted: module:Class.method)."""
    where = f"config key '{key}' names '{spec}'"
    if not is_plugin_spec(spec):
        raise ConfigError(f"{where}, which is not of the form pkg.module:symbol")
    module_name, _, attr = spec.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ConfigError(f"{where} but module '{e.name}' is not found on the Python path") from None
        raise ConfigError(f"{where} but importing '{module_name}' failed: {one_line(e)}") from None
    except Exception as e:  # a plugin with a bug at import time
        raise ConfigError(f"{where} but importing '{module_name}' failed: {one_line(e)}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(
                f"{where} but module '{module_name}' has no attribute '{attr}'{did_you_mean(part, dir(obj))}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{where} but '{attr}' is a {type(obj).__name__}, not {expected}")
    return obj


def resolve(name: str, builtins: dict[str, str], key: str, expected: str = "a callable"):
    """A built-in by its short name (its table entry is itself a "module:symbol" spec) or a plugin."""
    if name in builtins:
        return load(builtins[name], key, expected)
    if ":" in name:
        return load(name, key, expected)
    raise ConfigError(
        f"config key '{key}' names unknown '{name}'{did_you_mean(name, builtins)} "
        f"(built-ins: {', '.join(builtins)}; a plugin is written pkg.module:symbol)"
    )


def one_line(e) -> str:
    text = f"{type(e).__name__}: {e}" if isinstance(e, BaseException) else str(e)
    text = " ".join(text.split())
    return text[:300] + "..." if len(text) > 300 else text


def did_you_mean(name: str, known) -> str:
    hint = difflib.get_close_matches(name, list(known), n=1)
    return f"; did you mean '{hint[0]}'?" if hint else ""
