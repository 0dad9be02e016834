"""Typed errors with messages that say what is wrong and what to do.

Every error rmm raises on bad input derives from `RmmError`, so applications (CLI, server) can
report it cleanly without a traceback and without having touched stored data.
"""

from __future__ import annotations


class RmmError(Exception):
    """Base class of every error rmm raises on bad input or state."""


class UnknownUserError(RmmError, KeyError):
    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "unknown user"


class UnknownMemoryError(RmmError, KeyError):
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown memory"


class DimensionMismatchError(RmmError, ValueError):
    """An encoder, index or checkpoint whose vector size does not match the bank's."""


class FeatureMismatchError(RmmError, ValueError):
    """Candidates carry per-candidate features under other names (or order) than the reranker weighs."""


class EncoderMismatchError(RmmError, ValueError):
    """A bank or checkpoint built with a different encoder than the one given."""


class CorruptFileError(RmmError):
    """A bank, index, checkpoint or dataset file that cannot be read as what it claims to be."""


class PretrainedUsersError(RmmError, ValueError):
    """Held-out figures asked for on users (conversations) the encoder was pretrained on."""


class DataError(RmmError, ValueError):
    """A dataset file that is missing, malformed, or not in the expected schema."""


class ModelNotFoundError(RmmError, FileNotFoundError):
    """Model weights that are not on this machine (nothing is downloaded at run time)."""


class CheckpointError(RmmError):
    """A reranker checkpoint that is missing, corrupt, or incompatible."""


class LLMError(RmmError):
    """An LLM backend that failed: transport errors, refusals, missing engines, bad responses."""


class ConfigError(RmmError, ValueError):
    """A setting (YAML file or `key=value` override) that is unknown, of the wrong type or out of range."""


class DeviceUnavailableError(RmmError, RuntimeError):
    """A device was asked for by name (`cuda`, `cuda:1`) that this machine does not have."""


class EncoderUnavailableError(RmmError):
    """The query encoder's process died (the request may be retried: the next one starts a new process)."""
