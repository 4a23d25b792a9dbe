"""The model's own tokenizer: ``transformers.AutoTokenizer`` from a local folder, offline.

``data.tokenizer`` names the folder; by default it is the ``hf`` model's (its checkpoint
folder, or the folder of its config), where ``save_pretrained`` puts the tokenizer files
next to the weights. The tokenizer must number its ids within the model's vocabulary and
have an EOS token, which separates packed documents.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

from cargohold.cluster.schema.data import DataConfig
from cargohold.cluster.schema.model import HFModelConfig
from cargohold.services.core.errors import ConfigError
from cargohold.services.models.hf import model_folder, refuse_folder_code

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.json",
    "chat_template.jinja",
)
"""The files that make a tokenizer (those ``save_pretrained`` writes, by model family):
what the tokenization cache's key hashes. Weights next to them are not read."""


def tokenizer_folder(data: DataConfig, hf: HFModelConfig) -> tuple[Path, str]:
    """The tokenizer's folder (``data.tokenizer``, else the ``hf`` model's) and the key
    that named it, for messages."""
    if data.tokenizer is not None:
        return Path(data.tokenizer).expanduser().resolve(), "data.tokenizer"
    if hf.enabled:
        return model_folder(hf), hf.key
    raise ConfigError(
        f"data.format={data.format} is tokenized: set data.tokenizer to a local tokenizer folder "
        "(or train an hf model whose folder holds its tokenizer)"
    )


def load_tokenizer(folder: Path, key: str, vocab_size: int) -> PreTrainedTokenizerBase:
    """The tokenizer in ``folder`` (named by config key ``key``), read from disk only;
    refused when it has no EOS token or numbers ids beyond ``vocab_size``."""
    try:
        import transformers
    except ImportError as error:
        raise ConfigError(
            f"data.format needs the transformers package: pip install 'cargohold[hf]' ({error})"
        ) from error
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"{key} {str(folder)!r} holds no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...)")
    refuse_folder_code(folder, f"{key} {str(folder)!r}")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"cannot load a tokenizer from {key} {str(folder)!r}: {error}") from error
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"the tokenizer at {key} {str(folder)!r} has no EOS token, which separates documents")
    if len(tokenizer) > vocab_size:
        raise ConfigError(
            f"the tokenizer at {key} {str(folder)!r} has {len(tokenizer)} ids, more than the model's "
            f"vocabulary of {vocab_size}"
        )
    return tokenizer


def tokenizer_digest(folder: Path) -> str:
    """A hash of the tokenizer files in ``folder`` (names and contents)."""
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = folder / name
        if path.is_file():
            digest.update(f"{name}\0{path.stat().st_size}\0".encode())
            with path.open("rb") as handle:
                digest.update(hashlib.file_digest(handle, "sha256").digest())
    return digest.hexdigest()
