from pathlib import Path

import pytest
import torch

from cargohold.services.core.errors import ConfigError
from cargohold.services.data import batch_for_step, generate_corpus, load_tokens

TOKENS = load_tokens(None, 5_000, seed=0)
ARGS = dict(step=3, rank=0, world_size=1, batch_size=4, seq_len=16, seed=0)


@pytest.mark.parametrize("num_bytes", [0, 1, 17, 4_096, 100_003])
def test_generate_corpus_has_exact_length_and_is_ascii(num_bytes: int) -> None:
    corpus = generate_corpus(num_bytes, seed=1)
    assert isinstance(corpus, bytes)
    assert len(corpus) == num_bytes
    assert corpus.isascii()


def test_generate_corpus_is_deterministic_per_seed_and_english_like() -> None:
    corpus = generate_corpus(20_000, seed=5)
    assert corpus == generate_corpus(20_000, seed=5)
    assert corpus != generate_corpus(20_000, seed=6)
    assert generate_corpus(20_000, seed=5)[:500] == generate_corpus(500, seed=5)
    text = corpus.decode("ascii")
    assert text[0].isupper()
    assert text.count(". ") > 100 and "\n\n" in text and '"' in text and "?" in text
    words = text.split()
    assert 50 < len(set(words)) < 400  # a small, repeated vocabulary
    assert " a old " not in text and " a " in text


def test_generate_corpus_rejects_negative_size() -> None:
    with pytest.raises(ConfigError, match="data.corpus_bytes"):
        generate_corpus(-1, seed=0)


def test_load_tokens_generated_is_uint8_bytes_of_corpus() -> None:
    tokens = load_tokens(None, 1_000, seed=3)
    assert tokens.dtype == torch.uint8 and tokens.shape == (1_000,)
    assert bytes(tokens.tolist()) == generate_corpus(1_000, seed=3)


def test_load_tokens_reads_file_up_to_num_bytes(tmp_path: Path) -> None:
    path = tmp_path / "corpus.bin"
    path.write_bytes(bytes(range(256)) * 4)
    assert bytes(load_tokens(str(path), 10_000, seed=0).tolist()) == bytes(range(256)) * 4
    assert bytes(load_tokens(str(path), 300, seed=0).tolist()) == (bytes(range(256)) * 2)[:300]


def test_load_tokens_rejects_missing_empty_and_short_files(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing.txt")
    with pytest.raises(ConfigError, match="missing.txt"):
        load_tokens(missing, 100, seed=0)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ConfigError, match="empty.txt.*empty"):
        load_tokens(str(empty), 100, seed=0)
    short = tmp_path / "short.txt"
    short.write_bytes(b"hello")
    with pytest.raises(ConfigError, match="short.txt.*seq_len"):
        load_tokens(str(short), 100, seed=0, seq_len=8)
    assert load_tokens(str(short), 100, seed=0, seq_len=4).numel() == 5
    with pytest.raises(ConfigError, match="data.corpus_bytes"):
        load_tokens(None, 8, seed=0, seq_len=8)
    with pytest.raises(ConfigError, match="data.corpus_bytes"):
        load_tokens(None, 0, seed=0)


def test_batch_shapes_dtype_and_shift() -> None:
    x, y = batch_for_step(TOKENS, **ARGS)
    assert x.shape == y.shape == (4, 16)
    assert x.dtype == y.dtype == torch.int64
    torch.testing.assert_close(x[:, 1:], y[:, :-1])
    # every row is a real window of the corpus, with y's last token following x's
    corpus = bytes(TOKENS.tolist())
    for row_x, row_y in zip(x.tolist(), y.tolist(), strict=True):
        assert bytes(row_x + row_y[-1:]) in corpus


def test_batch_is_a_pure_function_of_seed_and_step() -> None:
    x, y = batch_for_step(TOKENS, **ARGS)
    batch_for_step(TOKENS, **{**ARGS, "step": 4})  # no hidden state between calls
    x2, y2 = batch_for_step(TOKENS, **ARGS)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, batch_for_step(TOKENS, **{**ARGS, "step": 4})[0])
    assert not torch.equal(x, batch_for_step(TOKENS, **{**ARGS, "seed": 1})[0])
    # (seed, step + 1) must not repeat (seed + 1, step)
    assert not torch.equal(
        batch_for_step(TOKENS, **{**ARGS, "step": 4})[0],
        batch_for_step(TOKENS, **{**ARGS, "seed": 1, "step": 3})[0],
    )


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_split_the_single_process_global_batch(world_size: int) -> None:
    reference_x, reference_y = batch_for_step(TOKENS, **{**ARGS, "batch_size": world_size * ARGS["batch_size"]})
    parts = [batch_for_step(TOKENS, **{**ARGS, "rank": rank, "world_size": world_size}) for rank in range(world_size)]
    assert torch.equal(torch.cat([x for x, _ in parts]), reference_x)
    assert torch.equal(torch.cat([y for _, y in parts]), reference_y)
    assert not torch.equal(parts[0][0], parts[1][0])


def test_batch_covers_the_whole_corpus_over_many_steps() -> None:
    tokens = torch.arange(40, dtype=torch.uint8)
    starts = {
        int(batch_for_step(tokens, **{**ARGS, "step": step, "seq_len": 8})[0][row, 0])
        for step in range(200)
        for row in range(4)
    }
    assert starts == set(range(40 - 8))  # every window start, including the last


@pytest.mark.parametrize(
    ("override", "name"),
    [
        ({"rank": 1}, "rank"),
        ({"rank": -1}, "rank"),
        ({"world_size": 0}, "world_size"),
        ({"batch_size": 0}, "batch_size"),
        ({"seq_len": 0}, "seq_len"),
        ({"seq_len": 5_000}, "seq_len"),
        ({"step": -1}, "step"),
    ],
)
def test_batch_rejects_bad_arguments(override: dict[str, int], name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        batch_for_step(TOKENS, **{**ARGS, **override})


def test_batch_rejects_non_1d_tokens() -> None:
    with pytest.raises(ConfigError, match="tokens"):
        batch_for_step(TOKENS.view(50, 100), **ARGS)
