"""The model's own vocabulary and context length, read from its config: the built-in
GPT's ``model.*`` keys, or the transformers config that ``hf.*`` names. The training
sequence length (``data.block_size``) defaults to the context length, and the data is
checked against both: byte-level data needs 256 token ids, a tokenizer's ids must fit the
vocabulary (:mod:`cargohold.services.data.sources`).
"""

from __future__ import annotations

from cargohold.cluster.schema.data import DataConfig
from cargohold.services.core.errors import ConfigError
from cargohold.services.data.corpus import BYTE_VOCAB
from cargohold.services.models.hf import pretrained_config
from cargohold.services.models.spec import ModelSpec

CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
"""Where transformers configs keep their context length, in the order they are looked up."""


def vocab_size(model: ModelSpec) -> int:
    """Token ids the model embeds: ``model.vocab_size``, or the transformers config's."""
    if not model.hf.enabled:
        return model.gpt.vocab_size
    vocab = getattr(pretrained_config(model.hf), "vocab_size", None)
    if not isinstance(vocab, int) or vocab <= 0:
        raise ConfigError(f"the model at {model.hf.key}={model.hf.path!r} has no vocab_size in its config")
    return vocab


def context_length(model: ModelSpec) -> int | None:
    """The longest sequence the model takes: ``model.block_size``, or the transformers
    config's ``max_position_embeddings`` (or its other name); None when it states none."""
    if not model.hf.enabled:
        return model.gpt.block_size
    loaded = pretrained_config(model.hf)
    for key in CONTEXT_KEYS:
        value = getattr(loaded, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def sequence_length(model: ModelSpec, data: DataConfig) -> int:
    """Tokens per training sequence: ``data.block_size``, else the model's context length."""
    if data.block_size is not None:
        return data.block_size
    context = context_length(model)
    if context is None:
        raise ConfigError(
            f"the model at {model.hf.key}={model.hf.path!r} states no context length "
            f"({', '.join(CONTEXT_KEYS)}); set data.block_size"
        )
    return context


def check_model_fits_data(model: ModelSpec, data: DataConfig) -> None:
    """Refuse a model that the configured data cannot train: byte-level data with fewer
    than 256 token ids, or sequences longer than the model's context."""
    vocab, context, length = vocab_size(model), context_length(model), sequence_length(model, data)
    hf = model.hf
    if hf.enabled:
        model_vocab = f"the model at {hf.key}={hf.path!r} has vocab_size {vocab}"
        model_context = f"max_position_embeddings ({context}) of the model at {hf.key}={hf.path!r}"
    else:
        model_vocab, model_context = f"model.vocab_size is {vocab}", f"model.block_size ({context})"
    if data.format == "bytes" and vocab < BYTE_VOCAB:
        raise ConfigError(f"{model_vocab}; data.format=bytes is byte-level and needs vocab_size >= {BYTE_VOCAB}")
    if context is not None and length > context:
        raise ConfigError(f"data.block_size ({length}) exceeds {model_context}; lower data.block_size")
    if hf.enabled and data.whole_documents:
        family = getattr(pretrained_config(hf), "model_type", None)
        if family not in DOCUMENT_MASKING_FAMILIES:
            raise ConfigError(
                f"the model at {hf.key}={hf.path!r} ({family}) does not confine attention to each "
                f"document from restarting position ids, which rows of whole documents rely on "
                f"(data.packing={data.packing}, data.format={data.format}); set data.packing: stream"
            )


DOCUMENT_MASKING_FAMILIES = frozenset(
    {
        "llama",
        "mistral",
        "mixtral",
        "qwen2",
        "qwen3",
        "qwen3_moe",
        "gemma",
        "gemma2",
        "gemma3_text",
        "phi",
        "phi3",
        "gpt_neox",
        "gptj",
        "stablelm",
        "olmo",
        "olmo2",
        "granite",
        "cohere",
        "starcoder2",
        "gpt_bigcode",
    }
)
"""transformers model types whose causal mask follows restarting position ids
(``masking_utils``' packed sequences), so a row of whole documents attends only within
each; checked against each family in tests/test_hf_families.py. Not in it: OPT (positions
from the attention mask), Falcon and BLOOM (ALiBi from the attention mask), which attend
across documents with position ids alone."""
