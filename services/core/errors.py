"""The error hierarchy. One root, one subclass per area; transport maps them to gRPC
status codes, nowhere else does."""

from __future__ import annotations


class CargoholdError(Exception):
    """Root of every error cargohold raises on purpose."""


class ConfigError(CargoholdError, ValueError):
    """A configuration value is missing, unknown or out of range; the message names the key."""


class LayoutError(CargoholdError, ValueError):
    """A layout request cannot be satisfied (sizes, counts, alignment)."""


class SegmentError(CargoholdError):
    """A request about a segment is invalid; subclasses say how."""


class UnknownSegmentError(SegmentError, KeyError):
    """No segment is registered under the given (run id, segment id)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class SegmentConflictError(SegmentError):
    """A segment is registered again with a different specification."""


class UpdateMismatchError(SegmentError):
    """The update number of a push or fetch is not the one the segment can serve."""


class InvalidTensorError(SegmentError, ValueError):
    """A tensor payload has the wrong size, dtype or checksum."""


class TruncatedStreamError(InvalidTensorError):
    """A tensor's stream ended before all its bytes arrived. gRPC reports a call the
    client cancelled mid-stream this way too, a moment before it marks the call inactive."""


class ForeignRunError(CargoholdError):
    """A call names a run other than the one its state server serves."""


class TransportError(CargoholdError):
    """A remote call failed; the message carries the server's status and detail."""


class ServerBusyError(CargoholdError):
    """A state server is at one of its limits (bulk transfers granted and not yet made);
    the caller may try again later."""


class TrainingError(CargoholdError):
    """The training run failed; raised by the launcher with the cause."""


class UnsettledError(TrainingError):
    """After a worker is lost, the segments' live state cannot be brought to one update
    (:mod:`~cargohold.services.core.settlement`): the run recovers from a checkpoint."""


class TierError(CargoholdError):
    """The tiered storage of optimizer state (RAM, NVMe files) failed; subclasses say how."""


class CorruptPartitionError(TierError):
    """A partition file is torn, corrupted or not the partition it should be.

    ``path`` and ``partition`` name the file and the partition; the message names both.
    """

    def __init__(self, message: str, *, path: str, partition: str) -> None:
        super().__init__(message)
        self.path = path
        self.partition = partition

    def __reduce__(self):  # keep the fields when the error crosses a Ray actor boundary
        return (_rebuild_corrupt, (str(self), self.path, self.partition))


class TierSpaceError(TierError):
    """A tier path cannot hold the state: too little free space, or a write ran out of it."""


class IncompleteUpdateError(TierError):
    """A segment's update stopped part-way (a failed read or write); retrying the push finishes it."""


def _rebuild_corrupt(message: str, path: str, partition: str) -> CorruptPartitionError:
    return CorruptPartitionError(message, path=path, partition=partition)


class ExportError(CargoholdError):
    """Trained weights cannot be exported (``export_dir``) or an export cannot be read."""


class CheckpointError(CargoholdError):
    """A checkpoint cannot be written, found or read; the message names the path and why."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file is torn, corrupted or not the file its manifest describes."""


class ResumeRefusedError(CheckpointError, ConfigError):
    """``checkpoint.resume`` names a checkpoint this run cannot resume from: none is
    there, its manifest or files are bad, it is of another model, or it was saved with a
    configuration that would give its state another meaning. A ConfigError too: like a
    bad value, it is refused before training starts (exit status 2), naming the file,
    field or keys."""


class OptimizerError(CargoholdError, ValueError):
    """What :class:`cargohold.OffloadedAdamW` was given does not fit: its parameters and
    groups, a step without gradients, a state dict of another model. Raised before any
    state changes; the message names the parameter or the group."""
