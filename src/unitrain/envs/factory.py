"""The `env` key's environment factory: a registry.ENVS built-in or a plugin. Beside the
environments, which do not import it."""

from __future__ import annotations

from collections.abc import Callable

from unitrain import plugins, registry


def env_factory(cfg) -> Callable:
    """The `env` key's factory (cfg) -> Environment: a registry.ENVS built-in or a plugin."""
    return plugins.resolve(cfg.env, registry.ENVS, "env", "an environment factory (cfg) -> Environment")
