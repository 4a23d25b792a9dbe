"""The data a run trains on, as ``data.*`` names it: :func:`open_source` gives a
:class:`~cargohold.services.data.batches.DataSource` whose batches are a pure function of
(step, rank, micro-batch).

The launcher opens it once before any actor starts, so bad data is refused first and the
tokenization cache is filled once; each worker then opens it again (a cache hit) and
reads only its own rows.
"""

from __future__ import annotations

import logging
from pathlib import Path

from cargohold.cluster.schema.data import DataConfig
from cargohold.services.data.batches import BatchShape, DataSource
from cargohold.services.data.blocks import TokenBlocks
from cargohold.services.data.corpus import ByteCorpus, load_tokens
from cargohold.services.data.rows import DocumentRows, OverlongCounts, refuse_overlong
from cargohold.services.data.tokenization import document_places, tokenized_stream
from cargohold.services.data.tokens import check_dtype_holds_vocab, check_ids_in_vocab, open_token_file
from cargohold.services.models.dimensions import check_model_fits_data, sequence_length, vocab_size
from cargohold.services.models.spec import ModelSpec

logger = logging.getLogger(__name__)


def batch_shape(model: ModelSpec, data: DataConfig, num_workers: int) -> BatchShape:
    """The global batch of a step of ``num_workers`` workers training ``model`` on ``data``."""
    return BatchShape(
        world_size=num_workers,
        batch_size=data.batch_size,
        seq_len=sequence_length(model, data),
        micro_batches=data.micro_batches,
    )


def open_source(model: ModelSpec, data: DataConfig, num_workers: int, *, check_token_file: bool = True) -> DataSource:
    """The batches of ``data`` for ``num_workers`` workers, checked against ``model``: its
    vocabulary numbers every token id, its context covers ``data.block_size``. ConfigError
    names what is wrong (key, file, line) before anything trains. ``check_token_file=False``
    (a worker, after its launcher checked) leaves a token file's ids to be checked as
    batches read them."""
    check_model_fits_data(model, data)
    shape = batch_shape(model, data, num_workers)
    if data.format == "bytes":
        tokens = load_tokens(data.path, data.corpus_bytes, data.seed, seq_len=shape.seq_len)
        return ByteCorpus(tokens, shape, seed=data.seed)
    vocab = vocab_size(model)
    if data.format == "tokens":
        path = Path(data.path or "").expanduser()
        ids = open_token_file(path, vocab)
        check_dtype_holds_vocab(ids.dtype, vocab, f"data.path {str(path)!r}")
        if check_token_file:
            check_ids_in_vocab(path, ids, vocab, f"data.path {str(path)!r}")
        return TokenBlocks(ids, None, shape, seed=data.seed, vocab_size=vocab, name=f"data.path {str(path)!r}")
    stream = tokenized_stream(data, model.hf, vocab)
    name = f"data.path {data.path!r} (tokenized)"
    if not data.whole_documents:
        return TokenBlocks(stream.tokens, stream.counted, shape, seed=data.seed, vocab_size=vocab, name=name)
    if data.overlong == "error":
        refuse_overlong(stream.ends, shape.seq_len + 1, name, lambda shown: document_places(data, shown))
    rows = DocumentRows(
        stream.tokens,
        stream.counted,
        stream.ends,
        shape,
        seed=data.seed,
        vocab_size=vocab,
        name=name,
        overlong=data.overlong,
        pad_id=0,
    )
    # A warning when documents were cut or left out (shown by default), else information.
    log = logger.warning if rows.overlong != OverlongCounts() else logger.info
    log(
        "%s: %d documents in %d sequences of whole documents (%.1f%% padding); longer than a sequence "
        "(data.overlong=%s): %s",
        name,
        rows.documents,
        rows.num_blocks,
        100 * rows.padding / (rows.num_blocks * (shape.seq_len + 1)),
        data.overlong,
        rows.overlong.describe(),
    )
    return rows
