"""The `env` key's environment factory (a registry.ENVS built-in or a plugin), and its
demonstrations as SFT records of the built-in task. Beside the environments, which do not import it."""

from __future__ import annotations

from collections.abc import Callable

from unitrain import plugins, registry
from unitrain.envs.base import DemonstratingEnvironment
from unitrain.errors import ConfigError


def env_factory(cfg) -> Callable:
    """The `env` key's factory (cfg) -> Environment: a registry.ENVS built-in or a plugin."""
    return plugins.resolve(cfg.env, registry.ENVS, "env", "an environment factory (cfg) -> Environment")


def demonstrations(cfg) -> Callable | None:
    """With `env` set: (prompt, label) -> the environment's demonstration as a chat record with its
    tools (envs/base.py), the SFT warm start for its episodes (data/sft.py's built-in records); else None."""
    if not cfg.env:
        return None
    env = env_factory(cfg)(cfg)
    if not isinstance(env, DemonstratingEnvironment):
        raise ConfigError(f"env={cfg.env} has no demonstration(record) to train on with mode=sft")
    return lambda prompt, label: {
        "messages": env.demonstration({"prompt": prompt, "label": label}),
        "tools": env.tools or None,
    }
