"""Errors of bad configuration, below every module that reads one (the model config, the families, the run's
settings), so that each can raise them without importing the others."""


class ConfigError(ValueError):
    """A configuration value is missing, malformed or unsupported. The message names the key and the fix."""
