"""Tokenizer throughput with the tokenization cache cold, and the time to load from it warm.

    python benchmarks/tokenization.py                  # 20 MB of JSON lines, an 8192-id byte-level BPE
    python benchmarks/tokenization.py --megabytes 50 --format chat

Data and tokenizer are made locally in a temporary folder (deleted at the end): documents
of ~2 KB cut from the demo's generated English (:func:`generate_corpus`), written as JSON
lines (``--format jsonl``) or as two-turn conversations (``--format chat``: rendered with
a chat template, the loss mask computed from character offsets); and a byte-level BPE
(``tokenizers``, wrapped in transformers' fast ``PreTrainedTokenizerFast``) trained on
the first megabyte.

Three timings, each of the path ``cargohold train`` takes before any actor starts
(:func:`~cargohold.services.data.tokenization.tokenized_stream`):

* **cold**: an empty cache: load the tokenizer, hash the data, read and tokenize every
  document, pack and write the entry. Printed as tokens/s and MB/s of input;
* **baseline**: the fast tokenizer alone on the same documents, already in memory (one
  batched ``tokenizer(texts)`` call per 256 documents, as cargohold batches them): the
  ratio cold / baseline is what cargohold's reading, packing and writing cost;
* **warm**: the same call again in a new process (as the next run makes it), the entry
  now there: load the tokenizer, hash the data (the key), map the entry.

The fast tokenizer parallelises a batch over ``RAYON_NUM_THREADS`` threads (default: all
cores). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import tempfile
import time
from pathlib import Path

from cargohold.cluster.schema.io import from_dict
from cargohold.cluster.schema.train import TrainConfig
from cargohold.services.data.corpus import generate_corpus
from cargohold.services.data.tokenization import DOCUMENTS_PER_PIECE, tokenized_stream

DOCUMENT_BYTES = 2048
EOS = "<|end|>"
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}" + EOS + "{% endfor %}"


def documents(megabytes: float, seed: int) -> list[str]:
    text = generate_corpus(int(megabytes * 1e6), seed).decode()
    return [text[i : i + DOCUMENT_BYTES] for i in range(0, len(text), DOCUMENT_BYTES)]


def write_data(path: Path, docs: list[str], fmt: str) -> None:
    with path.open("w", encoding="utf-8") as out:
        for doc in docs:
            if fmt == "chat":
                half = len(doc) // 2
                record = {
                    "messages": [{"role": "user", "content": doc[:half]}, {"role": "assistant", "content": doc[half:]}]
                }
            else:
                record = {"text": doc}
            out.write(json.dumps(record) + "\n")


def make_tokenizer(folder: Path, sample: list[str], vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = [EOS, "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(sample, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)


def run_config(root: Path, fmt: str, vocab_size: int) -> TrainConfig:
    return from_dict(
        TrainConfig,
        {
            "model": {"vocab_size": vocab_size},
            "data": {
                "format": fmt,
                "path": str(root / "data.jsonl"),
                "tokenizer": str(root / "tokenizer"),
                "cache_dir": str(root / "cache"),
            },
        },
    )


def baseline_seconds(folder: Path, docs: list[str]) -> float:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    start = time.perf_counter()
    for i in range(0, len(docs), DOCUMENTS_PER_PIECE):
        tokenizer(docs[i : i + DOCUMENTS_PER_PIECE], add_special_tokens=False)
    return time.perf_counter() - start


def warm_seconds(root: Path, fmt: str, vocab_size: int) -> tuple[float, float, int]:
    """The cache hit as a new process meets it (run in one): the data hashed again, the
    tokenizer loaded; and apart, the import of transformers before it."""
    start = time.perf_counter()
    import transformers  # noqa: F401  (once per process, whatever the cache holds)

    imported = time.perf_counter()
    config = run_config(root, fmt, vocab_size)
    stream = tokenized_stream(config.data, config.hf, vocab_size)
    return time.perf_counter() - imported, imported - start, len(stream.tokens)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=float, default=20.0, help="size of the generated text")
    parser.add_argument("--format", choices=("jsonl", "chat"), default="jsonl")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    docs = documents(args.megabytes, args.seed)
    with tempfile.TemporaryDirectory(prefix="cargohold-bench-tokenization-") as folder:
        root = Path(folder)
        write_data(root / "data.jsonl", docs, args.format)
        sample = random.Random(args.seed).sample(docs, k=min(len(docs), 500))
        make_tokenizer(root / "tokenizer", sample, args.vocab_size)
        config = run_config(root, args.format, args.vocab_size)
        input_mb = (root / "data.jsonl").stat().st_size / 1e6

        base = baseline_seconds(root / "tokenizer", docs)  # first: the page cache then holds the data for both
        start = time.perf_counter()
        stream = tokenized_stream(config.data, config.hf, args.vocab_size)
        cold = time.perf_counter() - start
        tokens = len(stream.tokens)
        with multiprocessing.get_context("spawn").Pool(1) as child:  # a new run: nothing memoised
            warm, importing, warm_tokens = child.apply(warm_seconds, (root, args.format, args.vocab_size))
        assert warm_tokens == tokens

    threads = os.environ.get("RAYON_NUM_THREADS", f"{os.cpu_count()} (all cores)")
    print(f"{args.format}: {len(docs)} documents, {input_mb:.1f} MB, {tokens} tokens; vocab {args.vocab_size}")
    print(f"cores {os.cpu_count()}, tokenizer threads {threads}")
    print(f"cold cache : {cold:7.2f} s  {tokens / cold / 1e6:6.2f} M tokens/s  {input_mb / cold:6.2f} MB/s")
    print(f"tokenizer  : {base:7.2f} s  {tokens / base / 1e6:6.2f} M tokens/s  (alone, documents in memory)")
    print(f"warm cache : {warm:7.3f} s  ({cold / warm:.0f}x faster than cold)")
    print(f"             + {importing:.2f} s importing transformers first (once per process, cache or not)")
    print(f"ratio cold / tokenizer alone: {cold / base:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
