"""Local data for the data tests: a tiny tokenizer trained here (nothing is downloaded),
chat and text files made from a small grammar, and a tiny Llama whose folder holds its
tokenizer, as a `save_pretrained` checkpoint would."""

from __future__ import annotations

import json
import random
from pathlib import Path

EOS = "<|end|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}" + EOS + "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""ChatML-like: each turn is its role's marker, its content and the end token."""
SPECIAL = ["<unk>", EOS, "<|system|>", "<|user|>", "<|assistant|>"]

_NAMES = "Anna Ben Clara David Eva Felix".split()
_THINGS = "cat dog bird fox horse boat lamp garden".split()
_COLOURS = "red green blue black white brown".split()


def sentence(rng: random.Random) -> str:
    return f"{rng.choice(_NAMES)} has a {rng.choice(_COLOURS)} {rng.choice(_THINGS)}."


def conversation(rng: random.Random) -> list[dict[str, str]]:
    """A question about a sentence and its answer (learnable: the answer is in the prompt)."""
    name, colour, thing = rng.choice(_NAMES), rng.choice(_COLOURS), rng.choice(_THINGS)
    messages = [
        {"role": "user", "content": f"{name} has a {colour} {thing}. What colour is the {thing}?"},
        {"role": "assistant", "content": f"The {thing} is {colour}."},
    ]
    if rng.random() < 0.5:
        messages = [{"role": "system", "content": "Answer briefly."}, *messages]
    if rng.random() < 0.3:
        messages += [
            {"role": "user", "content": "Who has it?"},
            {"role": "assistant", "content": f"{name} has it."},
        ]
    return messages


def make_tokenizer(folder: Path, *, chat_template: bool = True, vocab_size: int = 384) -> Path:
    """A byte-level BPE tokenizer trained on the grammar's words, saved with
    `save_pretrained` (and a chat template unless told otherwise)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    corpus = [sentence(rng) for _ in range(200)] + [m["content"] for _ in range(100) for m in conversation(rng)]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, unk_token="<unk>")
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(folder)
    return folder


def write_chat(path: Path, count: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    path.write_text("".join(json.dumps({"messages": conversation(rng)}) + "\n" for _ in range(count)))
    return path


def write_jsonl(path: Path, count: int, seed: int = 0, field: str = "text") -> Path:
    rng = random.Random(seed)
    lines = [json.dumps({field: " ".join(sentence(rng) for _ in range(3)), "id": i}) for i in range(count)]
    path.write_text("\n".join(lines) + "\n")
    return path


def tiny_llama(folder: Path, vocab_size: int, **overrides: int) -> Path:
    """A tiny Llama config in ``folder`` (beside a tokenizer, if one is there)."""
    import transformers

    shape = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    transformers.LlamaConfig(**{**shape, **overrides}).save_pretrained(folder)
    return folder
