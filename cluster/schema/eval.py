"""The ``eval`` section of the config: validation on held-out data (docs/data.md,
"Validation"). Kept beside :mod:`cargohold.cluster.schema`, which holds the other sections."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cargohold.cluster.schema.tuning import tuning
from cargohold.services.core.errors import ConfigError


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    """Validation: the mean loss over the counted tokens of held-out data, and its
    perplexity, every `eval.every_steps` steps and after the last (on the progress line,
    in the metrics and in the run's result). Off while neither `eval.path` nor
    `eval.split` is set."""

    path: str | None = None
    """A held-out file or folder, read as `data.format` reads `data.path` (with the same
    tokenizer, field and cache); for data.format=bytes, a text file."""
    split: str | None = None
    """data.format=hf_dataset only: the split to evaluate (e.g. "validation"), of `eval.path`,
    or of `data.path` when `eval.path` is null."""
    every_steps: int = 0
    """Evaluate every this many steps, and after the last; 0 evaluates after the last only."""
    batch_size: int | None = tuning(None)
    """Sequences per worker per eval batch; None takes `data.batch_size`."""
    max_batches: int | None = None
    """Evaluate the first this many batches (`worker.num_workers` x `data.batch_size`, or
    `tuning.eval.batch_size`, sequences each); None evaluates every whole batch the held-out data holds."""

    def __post_init__(self) -> None:
        if self.every_steps < 0:
            raise ConfigError(f"eval.every_steps must be >= 0, got {self.every_steps}")
        for key, value in (("tuning.eval.batch_size", self.batch_size), ("eval.max_batches", self.max_batches)):
            if value is not None and value < 1:
                raise ConfigError(f"{key} must be an integer >= 1 or null, got {value}")
        if self.path == "" or self.split == "":
            raise ConfigError("eval.path and eval.split must be null or non-empty")
        if self.path is not None and not Path(self.path).expanduser().exists():
            raise ConfigError(f"eval.path {self.path!r} does not exist (a local file or folder of held-out data)")
        if self.every_steps and not self.enabled:
            raise ConfigError("eval.every_steps is set but neither eval.path nor eval.split names held-out data")

    @property
    def enabled(self) -> bool:
        return self.path is not None or self.split is not None

    def check_format(self, data_format: str) -> None:
        """The rules that involve ``data.format``."""
        if self.split is not None and data_format != "hf_dataset":
            raise ConfigError(
                f"eval.split is for data.format=hf_dataset; with data.format={data_format} name a held-out "
                "file in eval.path"
            )
