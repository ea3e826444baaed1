"""What a user can get wrong, as exceptions: the entry prints the message (one sentence naming the key,
file or path) and exits with status 2. A leaf: it imports nothing, so every module may raise these."""


class UserError(Exception):
    """A mistake of the user's or a fault of their environment, not a bug: one line, exit status 2."""


class ConfigError(UserError):
    """A config key, file or combination of keys that cannot run."""


class DataError(UserError):
    """A data file or record that is unusable; the message names `file:line` or the path."""


class CheckpointError(UserError):
    """A checkpoint that cannot be read, restored or saved (damaged, another model, a full disk)."""


class RunEndedEarly(UserError):
    """The run cannot go on (the prompts ran out before a batch was full); the steps before it trained."""
