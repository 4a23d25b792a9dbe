"""The model a run trains: the built-in GPT's shape (``model.*``) or a local Hugging Face
causal LM (``hf.*``). Sections of :class:`cargohold.cluster.schema.train.TrainConfig`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cargohold.services.core.errors import ConfigError


@dataclass(frozen=True, slots=True, kw_only=True)
class GPTConfig:
    """Shape of the model; the defaults give ~10.9M parameters."""

    vocab_size: int = 256
    """Number of token ids; 256 for byte-level text."""
    block_size: int = 128
    """Longest sequence the position embedding covers."""
    n_layer: int = 6
    """Number of transformer blocks."""
    n_head: int = 6
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int = 384
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout probability on embeddings, attention and residual branches, in [0, 1)."""
    bias: bool = True
    """Whether Linear and LayerNorm layers carry a bias (the output head never does)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"model.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ConfigError(f"model.n_embd ({self.n_embd}) must be divisible by model.n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout!r}")
        if not isinstance(self.bias, bool):
            raise ConfigError(f"model.bias must be a bool, got {self.bias!r}")


@dataclass(kw_only=True, slots=True)
class HFModelConfig:
    """Train a Hugging Face transformers causal LM instead of the built-in GPT (needs the
    `hf` extra). Set one of the two paths; the model's config gives its vocabulary and
    context length, and the `model.*` keys are ignored (`data.block_size` is the training
    sequence length). Paths are local; nothing is downloaded."""

    config_path: str | None = None
    """A local folder holding a causal-LM `config.json` (or the file itself); the model is
    built from it with fresh weights drawn from `seed`."""
    checkpoint_dir: str | None = None
    """A local folder of pretrained weights (`save_pretrained` output) to start training from;
    excludes `hf.config_path`."""

    def __post_init__(self) -> None:
        if self.config_path is not None and self.checkpoint_dir is not None:
            raise ConfigError("hf.config_path and hf.checkpoint_dir are both set; set only one of them")
        if self.config_path is not None and not Path(self.config_path).exists():
            raise ConfigError(
                f"hf.config_path {self.config_path!r} does not exist (a local folder or "
                "config.json; nothing is downloaded)"
            )
        if self.checkpoint_dir is not None and not Path(self.checkpoint_dir).is_dir():
            raise ConfigError(
                f"hf.checkpoint_dir {self.checkpoint_dir!r} is not a folder (a local "
                "save_pretrained output; nothing is downloaded)"
            )

    @property
    def enabled(self) -> bool:
        """Whether a transformers model replaces the built-in GPT."""
        return self.config_path is not None or self.checkpoint_dir is not None

    @property
    def key(self) -> str:
        """The dotted key that names the model, for messages."""
        return "hf.checkpoint_dir" if self.checkpoint_dir is not None else "hf.config_path"

    @property
    def path(self) -> str:
        path = self.checkpoint_dir if self.checkpoint_dir is not None else self.config_path
        if path is None:
            raise ConfigError("hf.config_path or hf.checkpoint_dir must be set")
        return path
