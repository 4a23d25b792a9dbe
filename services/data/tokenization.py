"""Tokenizing what ``data.*`` names with the model's tokenizer, through the cache: text
files, JSON lines, chat conversations and Hugging Face datasets become one packed token
stream (:mod:`.packing`), written once to the tokenization cache (:mod:`.cache`) and
memory-mapped from there by every process.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from cargohold.cluster.schema.data import DataConfig
from cargohold.cluster.schema.model import HFModelConfig
from cargohold.services.core.errors import ConfigError
from cargohold.services.data.cache import CachedStream, TokenCache, cache_key, content_digest
from cargohold.services.data.chat import (
    MAX_CONVERSATION_CHARS,
    check_chat_tokenizer,
    conversation,
    render_conversation,
    template_source,
)
from cargohold.services.data.documents import Record, dataset_records, jsonl_records, text_files, text_pieces
from cargohold.services.data.packing import Document, Piece, pack, stream_dtype
from cargohold.services.data.tokenizer import load_tokenizer, tokenizer_digest, tokenizer_folder

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = "~/.cache/cargohold/data"
DOCUMENTS_PER_PIECE = 256
"""Documents tokenized in one call (the fast tokenizers batch them across threads)."""


def tokenized_stream(data: DataConfig, hf: HFModelConfig, vocab_size: int, section: str = "data") -> CachedStream:
    """The packed stream of ``data``, tokenized by the tokenizer it names (or the ``hf``
    model's): read from the cache, or tokenized into it. Held-out data passes its own,
    ``section`` naming its keys (eval)."""
    folder, key = tokenizer_folder(data, hf)
    tokenizer = load_tokenizer(folder, key, vocab_size)
    template = ""
    if data.format == "chat":
        check_chat_tokenizer(tokenizer, key, str(folder))
        template = template_source(folder, key)
    path = Path(data.path or "").expanduser().resolve()
    settings = {"format": data.format, "field": data.record_field, "split": data.split}
    root = Path(data.cache_dir or DEFAULT_CACHE_DIR).expanduser()
    entry = TokenCache(root / cache_key(content_digest(path), tokenizer_digest(folder), settings))
    cached = entry.read()
    if cached is not None:
        return cached
    logger.info("tokenizing %s with the tokenizer at %s into %s", path, folder, entry.folder)
    dtype = stream_dtype(len(tokenizer))
    pieces = _pieces(data, section, tokenizer, path, dtype, template)
    return entry.write(pieces, dtype, {"source": str(path), "tokenizer": str(folder), **settings})


def document_places(data: DataConfig, indices: list[int], section: str = "data") -> list[str]:
    """Where documents ``indices`` (ascending, numbered in stream order) of ``data`` came
    from (file and line, dataset row, text file), read again without tokenizing: each
    record is one document."""
    path = Path(data.path or "").expanduser().resolve()
    if data.format == "text":
        files = text_files(path, section)
        return [str(files[index]) for index in indices]
    if data.format == "hf_dataset":
        records = dataset_records(path, data.record_field, data.split, section)
    else:
        records = jsonl_records(path, data.record_field, section)
    wanted = set(indices)
    places = {index: r.where for index, r in enumerate(islice(records, max(indices) + 1)) if index in wanted}
    return [places.get(index, f"document {index}") for index in indices]


def _pieces(
    data: DataConfig, section: str, tokenizer: PreTrainedTokenizerBase, path: Path, dtype: np.dtype, template: str
) -> Iterator[Piece]:
    """``template``: where chat data's template comes from (:func:`.chat.template_source`)."""
    eos = tokenizer.eos_token_id
    assert isinstance(eos, int), "load_tokenizer refuses a tokenizer without EOS"
    if data.format == "text":
        yield from _text(tokenizer, path, eos, dtype, section)
        return
    if data.format == "hf_dataset":
        records = dataset_records(path, data.record_field, data.split, section)
    elif data.format == "chat":
        bound = (MAX_CONVERSATION_CHARS, "a conversation may hold (about a million tokens); split it or leave it out")
        records = jsonl_records(path, data.record_field, section, bound)
    else:
        records = jsonl_records(path, data.record_field, section)
    while batch := list(islice(records, DOCUMENTS_PER_PIECE)):
        documents: list[Document]
        if data.format == "chat":
            documents = [
                render_conversation(tokenizer, conversation(r.value, r.where), r.where, template) for r in batch
            ]
        else:
            ids = tokenizer([_text_of(r) for r in batch], add_special_tokens=False)["input_ids"]
            documents = [(document, None) for document in ids]
        yield pack(documents, eos, dtype)


def _text(tokenizer: PreTrainedTokenizerBase, path: Path, eos: int, dtype: np.dtype, section: str) -> Iterator[Piece]:
    """Text files: a document's pieces back to back, EOS after its last."""
    for piece, ends_document in text_pieces(path, section):
        ids = tokenizer(piece, add_special_tokens=False)["input_ids"]
        tokens = np.asarray(ids + [eos] if ends_document else ids, dtype=dtype)
        yield tokens, None, [len(tokens)] if ends_document else []


def _text_of(record: Record) -> str:
    if not isinstance(record.value, str):
        raise ConfigError(f"{record.where}: data.field holds a {type(record.value).__name__}, not text")
    return record.value
