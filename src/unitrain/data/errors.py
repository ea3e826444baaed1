"""The exception the data path raises for unusable user data."""

from unitrain.config import ConfigError


class DataError(ConfigError):
    """A data file or record is unusable; the message is one sentence naming `file:line` or the path.

    A ConfigError, so the entry reports it like a config mistake: one line, exit status 2.
    """
