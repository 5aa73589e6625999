"""User-facing errors. The CLI prints these as one line (no traceback) and exits with status 2."""

from __future__ import annotations


class Echo2Error(Exception):
    """Base of every error caused by bad input (config, files, flags, peers) rather than a bug."""


class ConfigError(Echo2Error, ValueError):
    """A config value breaks a rule; the message names the field and the rule."""


class CheckpointError(Echo2Error):
    """A checkpoint directory is missing or cannot be loaded as a model + tokenizer."""


class DataError(Echo2Error, ValueError):
    """An input data file is malformed; the message names the file and line."""


class TrainingDivergedError(Echo2Error):
    """The loss became NaN or inf; the last good checkpoint is kept."""


class InfeasibleError(Echo2Error, ValueError):
    """A capacity or activation problem has no solution; the message says what to change."""
