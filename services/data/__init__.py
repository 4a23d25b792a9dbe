"""Training data: the byte-level demo corpus, and token streams read from local files
(pre-tokenized token files, text, JSONL, chat, Hugging Face datasets) tokenized with the
model's own tokenizer.

The byte-level names stay importable from here (``from cargohold.services.data import
batch_for_step``); everything else is in its module: :mod:`.sources` opens what
``data.*`` names, as a :class:`~cargohold.services.data.batches.DataSource`.
"""

from cargohold.services.data.corpus import batch_for_step, generate_corpus, load_tokens
from cargohold.services.data.seeds import dropout_seed, stable_seed

__all__ = ["batch_for_step", "dropout_seed", "generate_corpus", "load_tokens", "stable_seed"]
