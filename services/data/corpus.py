"""The demo corpus and deterministic, stateless batching of byte-level tokens.

The built-in corpus is English-like text from a small grammar: varied enough that a
model has something to learn, regular enough (about 130 words, seven sentence
shapes) that a byte-level model's loss falls visibly within ~50 steps.

Batches are a pure function of ``(seed, step)``: the global batch of a step is drawn from
a generator seeded with a hash of the two, and each rank takes its own rows. A resumed
run, or a single-process reference, reproduces exactly what rank r saw at step s, with no
sampler state to checkpoint.
"""

from __future__ import annotations

import os
import random
import re

import torch

from cargohold.services.core.errors import ConfigError
from cargohold.services.data.batches import Batch, BatchShape
from cargohold.services.data.seeds import stable_seed

BYTE_VOCAB = 256
"""Token ids of byte-level data: 0..255."""

_NAMES = "Anna Ben Clara David Eva Felix Grace Hugo Iris Jonas".split()
_NOUNS = (
    "cat dog farmer teacher child bird baker river king sailor "
    "horse garden letter window basket lamp friend doctor fox boat"
).split()
_ADJECTIVES = ("old small quiet bright green heavy happy tired clever cold red young strange gentle brave dark").split()
_VERBS = "sees finds carries paints follows opens watches likes keeps builds helps calls".split()
_INTRANSITIVE = "sleeps sings waits runs laughs walks rests works".split()
_ADVERBS = "slowly quietly again happily early late together alone".split()
_PREPOSITIONS = "near behind under beside across inside".split()
_PLACES = "house market forest village bridge hill school harbor".split()
_TIMES = "morning evening day night winter summer".split()
_INTERJECTIONS = "Look Listen Wait Oh Well Yes".split()
_DETERMINERS = "the a the this that every one".split()

_TEMPLATES = (
    "{det} {adj} {noun} {verb} {det2} {noun2}.",
    "{name} {verb} {det} {adj} {noun} {prep} the {place}.",
    "every {time}, {det} {noun} {intrans} {adverb}.",
    "the {noun} {intrans} {prep} the {place}, and the {noun2} {intrans2} {adverb}.",
    '"{interj}," said {name}, "the {noun} is {adj}."',
    "did {name} see the {adj} {noun} {prep} the {place}?",
    "{name} and {name2} {intrans_plural} {adverb} {prep} the {adj} {place}.",
)
_A_BEFORE_VOWEL = re.compile(r"\b(a) ([aeiou])")


def _sentence(rng: random.Random) -> str:
    """One sentence from a random template; the first letter is capitalised."""
    intrans_plural = rng.choice(_INTRANSITIVE).removesuffix("s")
    text = rng.choice(_TEMPLATES).format(
        det=rng.choice(_DETERMINERS),
        det2=rng.choice(_DETERMINERS),
        adj=rng.choice(_ADJECTIVES),
        noun=rng.choice(_NOUNS),
        noun2=rng.choice(_NOUNS),
        verb=rng.choice(_VERBS),
        intrans=rng.choice(_INTRANSITIVE),
        intrans2=rng.choice(_INTRANSITIVE),
        intrans_plural=intrans_plural,
        adverb=rng.choice(_ADVERBS),
        prep=rng.choice(_PREPOSITIONS),
        place=rng.choice(_PLACES),
        time=rng.choice(_TIMES),
        interj=rng.choice(_INTERJECTIONS),
        name=rng.choice(_NAMES),
        name2=rng.choice(_NAMES),
    )
    text = _A_BEFORE_VOWEL.sub(r"\1n \2", text)
    start = 1 if text.startswith('"') else 0
    return text[:start] + text[start].upper() + text[start + 1 :]


def generate_corpus(num_bytes: int, seed: int) -> bytes:
    """Exactly ``num_bytes`` of ASCII text: paragraphs of 3-6 sentences, same for a seed."""
    if num_bytes < 0:
        raise ConfigError(f"data.corpus_bytes must be >= 0, got {num_bytes}")
    rng = random.Random(seed)
    parts: list[str] = []
    length = 0
    while length < num_bytes:
        paragraph = " ".join(_sentence(rng) for _ in range(rng.randint(3, 6))) + "\n\n"
        parts.append(paragraph)
        length += len(paragraph)
    return "".join(parts).encode("ascii")[:num_bytes]


def load_tokens(
    path: str | None, num_bytes: int, seed: int, *, seq_len: int = 1, key: str = "data.path"
) -> torch.Tensor:
    """Byte-level tokens (uint8, vocabulary 256) of a file, or of the generated corpus.

    ``num_bytes`` is the corpus size: the generated length, or a cap on how much of the
    file is read; ``key`` is the setting that named the file, for messages. ``seed`` only
    matters for the generated corpus. The corpus must hold at
    least one training sequence, ``seq_len + 1`` bytes, else ConfigError.
    """
    if num_bytes <= 0:
        raise ConfigError(f"data.corpus_bytes must be > 0, got {num_bytes}")
    if seq_len <= 0:
        raise ConfigError(f"seq_len must be > 0, got {seq_len}")
    if path is None:
        data = generate_corpus(num_bytes, seed)
        source = f"the generated corpus (data.corpus_bytes={num_bytes})"
    else:
        file = os.path.expanduser(path)
        if not os.path.isfile(file):
            raise ConfigError(f"{key} {path!r} does not exist or is not a file")
        with open(file, "rb") as f:
            data = f.read(num_bytes)
        if not data:
            raise ConfigError(f"{key} {path!r} is empty")
        source = f"{key} {path!r}"
    if len(data) < seq_len + 1:
        raise ConfigError(f"{source} holds {len(data)} bytes, fewer than one sequence of seq_len + 1 = {seq_len + 1}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def batch_for_step(
    tokens: torch.Tensor,
    *,
    step: int,
    rank: int,
    world_size: int,
    batch_size: int,
    seq_len: int,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s inputs and targets, int64 ``[batch_size, seq_len]``, for ``step``.

    The global batch is ``world_size * batch_size`` windows whose start offsets depend
    only on ``(seed, step)`` and the global batch size; rank r takes rows
    ``[r * batch_size, (r + 1) * batch_size)``. So the ranks of a world of N split the
    same global batch that a world of 1 with N times the batch size sees. ``y`` is ``x``
    shifted left by one token.
    """
    if tokens.dim() != 1:
        raise ConfigError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
    if step < 0:
        raise ConfigError(f"step must be >= 0, got {step}")
    if world_size <= 0:
        raise ConfigError(f"world_size must be > 0, got {world_size}")
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank must be in [0, world_size={world_size}), got {rank}")
    if batch_size <= 0:
        raise ConfigError(f"batch_size must be > 0, got {batch_size}")
    if seq_len <= 0:
        raise ConfigError(f"seq_len must be > 0, got {seq_len}")
    if tokens.numel() < seq_len + 1:
        raise ConfigError(f"tokens hold {tokens.numel()} tokens, fewer than seq_len + 1 = {seq_len + 1}")
    generator = torch.Generator().manual_seed(stable_seed(seed, step))
    starts = torch.randint(0, tokens.numel() - seq_len, (world_size * batch_size,), generator=generator)
    mine = starts[rank * batch_size : (rank + 1) * batch_size].to(tokens.device)
    windows = tokens[mine[:, None] + torch.arange(seq_len + 1, device=tokens.device)].long()
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


class ByteCorpus:
    """Byte-level tokens as a :class:`~cargohold.services.data.batches.DataSource`: the
    windows of :func:`batch_for_step`, micro-batch m of rank r being rank
    ``m * world_size + r`` of a world ``micro_batches`` times as large."""

    def __init__(self, tokens: torch.Tensor, shape: BatchShape, *, seed: int) -> None:
        self.tokens, self.shape, self.seed = tokens, shape, seed

    def batch(self, step: int, rank: int, micro: int = 0) -> Batch:
        shape = self.shape
        rows = shape.rows_of(rank, micro)
        inputs, targets = batch_for_step(
            self.tokens,
            step=step,
            rank=rows.start // shape.batch_size,
            world_size=shape.world_size * shape.micro_batches,
            batch_size=shape.batch_size,
            seq_len=shape.seq_len,
            seed=self.seed,
        )
        return Batch(inputs, targets)
