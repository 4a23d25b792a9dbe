"""The data's pure logic, without files or a cluster: the shape of a step's global batch,
which blocks each step reads, blocks of a token stream with counted targets, the loss
weights that make the ranks' mean the step's mean over counted tokens, packing, the
chat response mask and the cache key."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cargohold.services.core.errors import ConfigError
from cargohold.services.data import batch_for_step, load_tokens
from cargohold.services.data.batches import BatchShape, loss_weight
from cargohold.services.data.blocks import TokenBlocks
from cargohold.services.data.cache import cache_key
from cargohold.services.data.chat import counted_tokens, response_spans
from cargohold.services.data.corpus import ByteCorpus
from cargohold.services.data.packing import pack, stream_dtype
from cargohold.services.data.sampling import step_blocks
from cargohold.services.models.loss import IGNORE_INDEX, mean_token_loss

# --- the global batch -------------------------------------------------------------------


def test_rows_are_ordered_by_micro_batch_then_rank() -> None:
    shape = BatchShape(world_size=3, batch_size=2, seq_len=8, micro_batches=2)
    assert shape.rows == 12
    taken = [range(12)[shape.rows_of(rank, micro)] for micro in range(2) for rank in range(3)]
    assert [list(r) for r in taken] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    for bad in ({"rank": 3}, {"rank": -1}, {"micro": 2}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            shape.rows_of(**{"rank": 0, **bad})
    with pytest.raises(ConfigError, match="batch_size"):
        BatchShape(world_size=1, batch_size=0, seq_len=8)


# --- which blocks a step reads ----------------------------------------------------------


def test_each_epoch_reads_every_block_once_and_steps_never_repeat_within_it() -> None:
    num_blocks, rows = 40, 8
    seen = torch.cat([step_blocks(num_blocks, step, rows, seed=3) for step in range(1, 6)])
    assert sorted(seen.tolist()) == list(range(num_blocks))  # 5 steps x 8 rows: one epoch
    second = torch.cat([step_blocks(num_blocks, step, rows, seed=3) for step in range(6, 11)])
    assert sorted(second.tolist()) == list(range(num_blocks)) and not torch.equal(seen, second)


def test_blocks_are_a_pure_function_of_seed_and_step() -> None:
    first = step_blocks(1000, 7, 16, seed=1)
    step_blocks(1000, 8, 16, seed=1)
    assert torch.equal(first, step_blocks(1000, 7, 16, seed=1))
    assert not torch.equal(first, step_blocks(1000, 7, 16, seed=2))
    assert not torch.equal(first, step_blocks(1000, 8, 16, seed=1))
    with pytest.raises(ConfigError, match="step"):
        step_blocks(1000, 0, 16, seed=1)


def test_a_step_across_an_epoch_boundary_and_data_smaller_than_a_batch() -> None:
    across = step_blocks(10, 2, 6, seed=0)  # positions 6..11: the end of epoch 0, the start of epoch 1
    assert len(set(across[:4].tolist())) == 4 and len(set(across[4:].tolist())) == 2
    tiny = step_blocks(3, 1, 7, seed=0)  # 7 rows of 3 blocks: every block, more than once
    assert set(tiny.tolist()) == {0, 1, 2}


# --- blocks of a token stream -----------------------------------------------------------

SHAPE = BatchShape(world_size=2, batch_size=3, seq_len=4)


def _blocks(tokens: np.ndarray, counted: np.ndarray | None = None, shape: BatchShape = SHAPE) -> TokenBlocks:
    return TokenBlocks(tokens, counted, shape, seed=5, vocab_size=1000, name="test stream")


def test_targets_are_inputs_shifted_and_ranks_read_disjoint_blocks() -> None:
    tokens = np.arange(101, dtype=np.uint16)  # 25 blocks of 4 (+1) tokens
    source = _blocks(tokens)
    parts = [source.batch(3, rank) for rank in range(2)]
    for part in parts:
        assert part.inputs.dtype == part.targets.dtype == torch.int64 and part.weight == 1.0
        assert torch.equal(part.targets, part.inputs + 1)
        assert torch.equal(part.inputs[:, 0] % 4, torch.zeros(3, dtype=torch.int64))  # block starts
    starts = [set(p.inputs[:, 0].tolist()) for p in parts]
    assert not starts[0] & starts[1]
    whole = _blocks(tokens, shape=BatchShape(world_size=1, batch_size=6, seq_len=4)).batch(3, 0)
    assert torch.equal(torch.cat([p.inputs for p in parts]), whole.inputs)  # ranks split the global batch


def test_counted_flags_mask_targets_and_weigh_ranks_by_their_share() -> None:
    tokens = np.arange(101, dtype=np.uint16)
    counted = (np.arange(101) % 3 == 0).astype(np.uint8)
    source = _blocks(tokens, counted)
    parts = [source.batch(2, rank) for rank in range(2)]
    counts = []
    for part in parts:
        kept = part.targets != IGNORE_INDEX
        assert torch.equal(part.targets[kept] % 3, torch.zeros(int(kept.sum()), dtype=torch.int64))
        assert torch.equal(part.targets[kept], (part.inputs + 1)[kept])
        counts.append(int(kept.sum()))
    for part, count in zip(parts, counts):
        assert part.weight == count * 2 / sum(counts)


def test_weighted_rank_losses_average_to_the_global_token_mean() -> None:
    """What FSDP2's averaging of the ranks' gradients computes is the mean over the whole
    global batch's counted tokens, however unevenly the ranks count them."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 4, 11, generator=generator)  # rank, row, position, vocab
    targets = torch.randint(0, 11, (2, 3, 4), generator=generator)
    targets[0, :, :3] = IGNORE_INDEX  # rank 0 counts 3 tokens, rank 1 twelve
    shape = BatchShape(world_size=2, batch_size=3, seq_len=4)
    counts = [int((targets[r] != IGNORE_INDEX).sum()) for r in range(2)]
    ranks = [mean_token_loss(logits[r], targets[r]) * loss_weight(counts[r], sum(counts), shape) for r in range(2)]
    expected = F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1), ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(sum(ranks) / 2, expected, rtol=1e-6, atol=0)
    assert loss_weight(5, 10, shape) == 1.0 and loss_weight(0, 0, shape) == 0.0


def test_a_batch_without_counted_targets_has_loss_and_gradient_zero() -> None:
    logits = torch.randn(2, 4, 7, requires_grad=True)
    loss = mean_token_loss(logits, torch.full((2, 4), IGNORE_INDEX))
    loss.backward()
    assert loss.item() == 0.0 and logits.grad is not None and not logits.grad.any()
    unmasked = torch.randint(0, 7, (2, 4))
    assert torch.equal(mean_token_loss(logits, unmasked), F.cross_entropy(logits.flatten(0, 1), unmasked.flatten()))


def test_ids_outside_the_vocabulary_and_short_streams_are_refused() -> None:
    tokens = np.full(101, 7, dtype=np.uint16)
    tokens[50] = 999
    with pytest.raises(ConfigError, match=r"test stream holds token id 999 .*vocabulary of 500"):
        source = TokenBlocks(tokens, None, SHAPE, seed=5, vocab_size=500, name="test stream")
        for step in range(1, 6):  # 30 rows of 25 blocks: every block
            for rank in range(2):
                source.batch(step, rank)
    with pytest.raises(ConfigError, match="test stream holds 4 tokens.*block_size"):
        _blocks(np.arange(4, dtype=np.uint16))


def test_byte_corpus_keeps_the_byte_path_and_splits_micro_batches_as_ranks() -> None:
    tokens = load_tokens(None, 5_000, seed=0)
    shape = BatchShape(world_size=2, batch_size=3, seq_len=16, micro_batches=2)
    corpus = ByteCorpus(tokens, shape, seed=9)
    batch = corpus.batch(4, 1, micro=1)
    x, y = batch_for_step(tokens, step=4, rank=3, world_size=4, batch_size=3, seq_len=16, seed=9)
    assert torch.equal(batch.inputs, x) and torch.equal(batch.targets, y) and batch.weight == 1.0
    single = ByteCorpus(tokens, BatchShape(world_size=2, batch_size=3, seq_len=16), seed=9).batch(4, 1)
    x, _ = batch_for_step(tokens, step=4, rank=1, world_size=2, batch_size=3, seq_len=16, seed=9)
    assert torch.equal(single.inputs, x)


# --- packing, chat masks, cache keys ----------------------------------------------------


def test_pack_puts_eos_after_each_document_and_does_not_count_it() -> None:
    tokens, counted, ends = pack([([5, 6], None), ([7], None)], eos_id=1, dtype=np.dtype(np.uint16))
    assert tokens.tolist() == [5, 6, 1, 7, 1] and counted is None and tokens.dtype == np.uint16
    assert ends == [3, 5]  # where each document ends, its EOS included
    tokens, counted, _ = pack([([5, 6], [False, True]), ([7], [True])], eos_id=1, dtype=np.dtype(np.uint32))
    assert tokens.tolist() == [5, 6, 1, 7, 1] and counted is not None and counted.tolist() == [0, 1, 0, 1, 0]
    with pytest.raises(ValueError, match="counted flags"):
        pack([([5], [True]), ([7], None)], eos_id=1, dtype=np.dtype(np.uint16))
    assert stream_dtype(65_536) == np.uint16 and stream_dtype(65_537) == np.uint32


def _render(messages: list[dict[str, str]], generation_prompt: bool) -> str:
    text = "".join(f"<{m['role']}>{m['content']}|" for m in messages)
    return text + ("<assistant>" if generation_prompt else "")


def test_response_spans_are_the_assistants_turns_and_tokens_overlapping_them_count() -> None:
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "ok?"},
        {"role": "assistant", "content": "ok"},
    ]
    text, spans = response_spans(_render, messages, "x.jsonl:1")
    assert text == "<user>hi|<assistant>yo|<user>ok?|<assistant>ok|"
    assert [text[a:b] for a, b in spans] == ["yo|", "ok|"]
    offsets = [(0, 6), (6, 9), (9, 20), (20, 22), (22, 23), (23, 29), (43, 46)]
    assert counted_tokens(offsets, spans) == [False, False, False, True, True, False, True]


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_the_line() -> None:
    def rewriting(messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return _render(messages, generation_prompt) + f"({len(messages)} turns)"

    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    with pytest.raises(ConfigError, match=r"chat\.jsonl:7.*turn 1"):
        response_spans(rewriting, messages, "chat.jsonl:7")


def test_the_cache_key_changes_with_content_tokenizer_and_settings() -> None:
    base = cache_key("content", "tokenizer", {"format": "text", "field": "text"})
    assert base == cache_key("content", "tokenizer", {"field": "text", "format": "text"})
    assert (
        len(
            {
                base,
                cache_key("other", "tokenizer", {"format": "text", "field": "text"}),
                cache_key("content", "other", {"format": "text", "field": "text"}),
                cache_key("content", "tokenizer", {"format": "jsonl", "field": "text"}),
            }
        )
        == 4
    )


def test_masking_the_targets_of_a_single_row_leaves_its_inputs_alone() -> None:
    """With data.batch_size 1 the inputs and targets were two views of one storage: masking a
    prompt's targets wrote IGNORE_INDEX into the inputs (the embedding then failed)."""
    tokens = np.arange(1, 60, dtype=np.uint16)
    counted = (np.arange(59) % 3 == 0).astype(np.uint8)
    blocks = TokenBlocks(tokens, counted, BatchShape(1, 1, 8), seed=0, vocab_size=64, name="test")
    for step in (1, 2, 3):
        batch = blocks.batch(step, 0)
        assert (batch.targets == IGNORE_INDEX).any()
        assert batch.inputs.min() >= 1 and torch.equal(
            batch.inputs[0, 1:], torch.arange(1, 60)[batch.inputs[0, 1] - 1 :][:7]
        )
