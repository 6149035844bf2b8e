"""The trainer's exceptions. Each carries a message that names the setting and the fix."""


class TrainerError(Exception):
    """Base class for errors the trainer reports as one line and a non-zero exit."""


class ConfigError(TrainerError):
    """A flag or combination of flags that cannot work."""


class CheckpointError(TrainerError):
    """A checkpoint that is missing, truncated or altered."""
