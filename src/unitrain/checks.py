"""The config's checks of key combinations, each declared beside the code it concerns: the modules
of registry.CONFIG_CHECKS hold theirs as CONFIG_CHECKS (config.Check: the keys it reads and
fn(cfg) -> None or what is wrong); the configured data format brings its own (DataFormat.check),
and where it says the config ranks with beam search, the sampler must be able to.
config.py checks each key alone (types, RULES) and imports none of them; the entry runs these right
after the load and for every stage of a pipeline, before anything compiles.

A check sees only the keys it declares (another is a bug of the check, raised as such), and what
is wrong is one ConfigError line naming where the user set the keys involved.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping

from unitrain import registry
from unitrain.config import Check, Config, load_config
from unitrain.data import format_choice
from unitrain.engines.factory import check_ranking
from unitrain.errors import ConfigError


def owner_checks() -> Iterator[Check]:
    """Every built-in Check, in registry.CONFIG_CHECKS' order."""
    for spec in registry.CONFIG_CHECKS:
        module, _, name = spec.partition(":")
        yield from getattr(importlib.import_module(module), name)


class _Declared(Mapping):
    """The config as one check may read it (its inputs, plain lists and dicts): its declared keys alone."""

    def __init__(self, values: dict, check: Check):
        self.values, self.check = values, check

    def __getitem__(self, key):
        if key not in self.check.keys:
            raise KeyError(
                f"config check {self.check.fn.__module__}.{self.check.fn.__name__} reads '{key}', which it does not declare"
            )
        return self.values[key]

    def __iter__(self):
        return iter(self.check.keys)

    def __len__(self):
        return len(self.check.keys)


def _set_by_user(cfg: Config, keys) -> str:
    """' (key from where; ...)' for the keys a layer above base.yml set, else ''."""
    chosen = [f"{key} {cfg.origin(key)}" for key in keys if not cfg.is_default(key)]
    return f" ({'; '.join(chosen)})" if chosen else ""


def check_config(cfg: Config) -> Config:
    """`cfg` when every check passes; else the first failure as a ConfigError."""
    values = cfg.inputs()
    for check in owner_checks():
        if problem := check(_Declared(values, check)):
            raise ConfigError(f"invalid config: {problem}{_set_by_user(cfg, check.keys)}")
    fmt = format_choice.data_format(cfg)
    if problem := fmt.check(cfg) or ((ranks := fmt.ranking(cfg)) and check_ranking(cfg, ranks)):
        raise ConfigError(f"invalid config: {problem}")
    return cfg


def load_checked(argv: list[str]) -> Config:
    """config.load_config's Config, its key combinations checked (the entry's and tools' load)."""
    return check_config(load_config(argv))
