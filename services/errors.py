"""The error hierarchy. One root, one subclass per area; transport maps them to gRPC
status codes, nowhere else does."""

from __future__ import annotations


class CargoholdError(Exception):
    """Root of every error cargohold raises on purpose."""


class ConfigError(CargoholdError, ValueError):
    """A configuration value is missing, unknown or out of range; the message names the key."""


class LayoutError(CargoholdError, ValueError):
    """A shard layout request cannot be satisfied (sizes, counts, alignment)."""


class ShardError(CargoholdError):
    """A request about a shard is invalid; subclasses say how."""


class UnknownShardError(ShardError, KeyError):
    """No shard is registered under the given (run id, shard id)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class ShardConflictError(ShardError):
    """A shard is registered again with a different specification."""


class StepMismatchError(ShardError):
    """The step of a push or fetch is not the one the shard can serve."""


class InvalidTensorError(ShardError, ValueError):
    """A tensor payload has the wrong size, dtype or checksum."""


class TransportError(CargoholdError):
    """A remote call failed; the message carries the server's status and detail."""


class TrainingError(CargoholdError):
    """The training run failed; raised by the launcher with the cause."""
