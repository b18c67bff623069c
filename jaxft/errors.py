"""Errors of bad configuration, below every module that reads one (the model config, the families, the run's
settings), so that each can raise them without importing the others."""


class ConfigError(ValueError):
    """A configuration value is missing, malformed or unsupported. The message names the key and the fix."""


class KeyedConfigError(ConfigError):
    """A bad setting of one key: `field` names it and `problem` is the message without it, so `part_error` can state
    the problem under the key the user wrote."""

    def __init__(self, field: str, problem: str):
        self.field, self.problem = field, problem
        super().__init__(f"key {field!r}: {problem}")
