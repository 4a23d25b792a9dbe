"""``data.*``: what the model trains on (docs/data.md)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cargohold.cluster.schema.checks import check_output_folder, positive
from cargohold.services.core.errors import ConfigError

DataFormat = Literal["bytes", "tokens", "text", "jsonl", "chat", "hf_dataset"]
TEXT_FIELDS = {"jsonl": "text", "hf_dataset": "text", "chat": "messages"}
"""The record field each format reads when ``data.field`` is not set."""


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """What the model trains on (docs/data.md). Every file is local; nothing is downloaded."""

    format: DataFormat = "bytes"
    """bytes: byte-level text (ids 0-255; the demo). tokens: a pre-tokenized `.bin`
    file (raw ids: uint16 for a vocabulary of up to 65,536 ids, uint32 above) or `.npy`
    file (any integer dtype), memory-mapped. text: a text file, or a folder of `*.txt`
    files, one document each. jsonl: one JSON object a line, its `data.field` a
    document. chat: one JSON object a line, its `data.field` a list of messages rendered
    with the tokenizer's chat template; the loss counts the assistant's tokens only.
    hf_dataset: a Hugging Face `datasets` folder (`save_to_disk`), or `.parquet`/`.arrow`
    files (needs the `datasets` extra). text, jsonl, chat and hf_dataset are tokenized
    with `data.tokenizer` and packed, an EOS token after each document."""
    path: str | None = None
    """The file or folder `data.format` reads. bytes: a text file to train on, or None to
    generate the built-in corpus; every other format needs it."""
    corpus_bytes: int = 2_000_000
    """bytes only: the size of the generated corpus when `data.path` is None, else how much
    of the file is read."""
    batch_size: int = 8
    """Sequences per worker per micro-batch; a step's global batch is this times
    `worker.num_workers` times `data.micro_batches`."""
    micro_batches: int = 1
    """Micro-batches each worker runs forward and backward per step, their gradients summed
    (gradient accumulation) before the one push to the state servers and the one update:
    a larger global batch in the activation memory of one micro-batch."""
    block_size: int | None = None
    """Tokens per training sequence; None takes the model's context length (`model.block_size`,
    or an `hf` model's `max_position_embeddings`)."""
    seed: int = 1234
    """Seeds which sequences each step draws (a pure function of seed and step)."""
    tokenizer: str | None = None
    """A local folder with the tokenizer files (`save_pretrained` output) for text, jsonl, chat
    and hf_dataset; None takes `hf.checkpoint_dir`, else the folder of `hf.config_path`."""
    field: str | None = None
    """The record field that holds a document (jsonl, hf_dataset; default "text") or a
    conversation (chat; default "messages")."""
    split: str = "train"
    """hf_dataset: the split to read when the folder holds several (a `DatasetDict`)."""
    cache_dir: str | None = None
    """Where tokenized data is kept, keyed by the data's content, the tokenizer's files and
    these settings, so that another run does not tokenize again; None: ~/.cache/cargohold/data."""
    packing: Literal["auto", "stream", "documents"] = "auto"
    """How training sequences are made of the documents (text, jsonl, chat, hf_dataset).
    stream: back to back, sequences cut at any offset (no padding, but a sequence may start
    inside a document and attend across an EOS into the one before). documents: each
    sequence holds whole documents (best-fit decreasing), padded, its position ids
    restarting and attention confined to each document (data.overlong says what happens
    to one longer than a sequence). auto: documents for chat, stream otherwise."""
    overlong: Literal["truncate", "drop", "split", "error"] = "truncate"
    """With whole documents: one longer than data.block_size + 1 tokens is truncated (its
    start kept), dropped, or split into sequence-sized pieces, each trained as a document;
    the counts are logged before training. A conversation (or piece) left without a counted
    target, an assistant token, is dropped and counted. error: any such document refuses
    the data before training starts, the first few named by file and line."""

    def __post_init__(self) -> None:
        positive("data.corpus_bytes", self.corpus_bytes)
        positive("data.batch_size", self.batch_size)
        if self.micro_batches < 1:
            raise ConfigError(f"data.micro_batches must be an integer >= 1, got {self.micro_batches}")
        if self.block_size is not None:
            positive("data.block_size", self.block_size)
        if self.path is None and self.format != "bytes":
            raise ConfigError(f"data.path must name the data to read with data.format={self.format}")
        if self.path is not None and not Path(self.path).expanduser().exists():
            raise ConfigError(f"data.path {self.path!r} does not exist (a local file or folder)")
        if self.tokenizer is not None and not Path(self.tokenizer).expanduser().is_dir():
            raise ConfigError(f"data.tokenizer {self.tokenizer!r} is not a folder (a local save_pretrained output)")
        if self.field == "":
            raise ConfigError("data.field must be a field name or null, got an empty string")
        if self.cache_dir:
            check_output_folder("data.cache_dir", self.cache_dir)
        if self.packing == "documents" and self.format in ("bytes", "tokens"):
            raise ConfigError(
                f"data.packing=documents needs documents; data.format={self.format} has none (use text, jsonl, "
                "chat or hf_dataset, or data.packing=stream)"
            )

    @property
    def whole_documents(self) -> bool:
        """Sequences are made of whole documents (data.packing, auto: chat)."""
        return self.packing == "documents" or (self.packing == "auto" and self.format == "chat")

    @property
    def record_field(self) -> str:
        """The field jsonl, chat and hf_dataset records are read from."""
        return self.field or TEXT_FIELDS.get(self.format, "text")
