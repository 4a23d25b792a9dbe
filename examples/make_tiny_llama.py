"""Make a small Llama-shaped checkpoint with its own tokenizer, offline, for
examples/finetune.yaml to fine-tune:

    .venv/bin/python examples/make_tiny_llama.py runs/tiny-llama

Nothing can be downloaded here, so both parts are built locally, as a real checkpoint
folder holds them (``save_pretrained`` of a model and of its tokenizer):

* a byte-level BPE tokenizer (the GPT-2 / Llama 3 kind) trained with ``tokenizers`` on
  the shipped conversations, wrapped in ``PreTrainedTokenizerFast`` with a ChatML chat
  template whose ``<|im_end|>`` is the EOS token;
* a ``LlamaConfig`` of 0.16M parameters with weights drawn from ``--seed``; its
  vocabulary is the tokenizer's rounded up to a multiple of 64 (as nanoGPT pads GPT-2's:
  kernels like round shapes), and its EOS and pad ids are the tokenizer's, so the
  generation config stops where the chat turns end.

Swap the folder for any local ``save_pretrained`` checkpoint of a causal LM and the
rest of the example is unchanged.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

DATA = Path(__file__).resolve().parent / "data" / "chat.jsonl"
BOS, EOS, PAD = "<|im_start|>", "<|im_end|>", "<|pad|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}" + BOS + "{{ message['role'] }}\n{{ message['content'] }}" + EOS + "\n"
    "{% endfor %}{% if add_generation_prompt %}" + BOS + "assistant\n{% endif %}"
)
"""ChatML: each turn is ``<|im_start|>role``, a line break, its content and ``<|im_end|>``."""


def texts(path: Path) -> Iterator[str]:
    """Every message's content in the conversations file, and the roles' names."""
    yield from ("system", "user", "assistant")
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            for message in json.loads(line)["messages"]:
                yield message["content"]


def make_tokenizer(data: Path, vocab_size: int) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE of ``vocab_size`` ids (special tokens included) trained on ``data``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # any text encodes, byte by byte at worst
    )
    tokenizer.train_from_iterator(texts(data), trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=PAD)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_model(tokenizer: transformers.PreTrainedTokenizerFast, seed: int) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        vocab_size=-(-len(tokenizer) // 64) * 64,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the checkpoint folder to write")
    parser.add_argument("--data", type=Path, default=DATA, help="conversations to train the tokenizer on")
    parser.add_argument("--vocab-size", type=int, default=512, help="tokenizer ids, special tokens included")
    parser.add_argument("--seed", type=int, default=0, help="seeds the model's initial weights")
    args = parser.parse_args(argv)
    tokenizer = make_tokenizer(args.data, args.vocab_size)
    model = make_model(tokenizer, args.seed)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.out}: a {parameters / 1e6:.2f}M-parameter Llama and its {len(tokenizer)}-id tokenizer")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
