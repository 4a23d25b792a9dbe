"""Rows of whole documents (``data.packing: documents``, chat's default): conversations
placed whole by best-fit decreasing, targets counted only inside their own conversation,
position ids restarting per conversation so attention stays inside it; the over-long
policies; and the loss a packed batch gives against each conversation run alone."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import numpy as np
import pytest
import ray
import torch

transformers = pytest.importorskip("transformers")

from data_fixtures import conversation, make_tokenizer, tiny_llama, write_chat  # noqa: E402
from reference import tiny_config  # noqa: E402

from cargohold.cluster import cli  # noqa: E402
from cargohold.cluster.sections import config_task  # noqa: E402
from cargohold.services.core.errors import ConfigError  # noqa: E402
from cargohold.services.data.batches import BatchShape  # noqa: E402
from cargohold.services.data.chat import render_conversation  # noqa: E402
from cargohold.services.data.rows import DocumentRows, OverlongCounts, place_documents  # noqa: E402
from cargohold.services.models.gpt import GPT  # noqa: E402
from cargohold.services.models.hf import HFCausalLM  # noqa: E402
from cargohold.services.models.loss import IGNORE_INDEX  # noqa: E402

VOCAB = 384
SEQ = 64


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tokenizer"), vocab_size=VOCAB)


def _chat_config(tmp_path: Path, tokenizer_dir: Path, count: int = 40, **overrides):
    data = {
        "format": "chat",
        "path": str(write_chat(tmp_path / "chat.jsonl", count)),
        "tokenizer": str(tokenizer_dir),
        "cache_dir": str(tmp_path / "cache"),
        "block_size": SEQ,
        "batch_size": 4,
    }
    data.update(overrides)
    return tiny_config(
        model__vocab_size=VOCAB,
        model__block_size=SEQ,
        worker__num_workers=1,
        **{f"data__{k}": v for k, v in data.items()},
    )


def _segments(position_ids: torch.Tensor) -> torch.Tensor:
    """Each input's document number within its row (a document starts where positions restart)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts.cumsum(dim=1)


# --- placement, pure ---------------------------------------------------------------------


def test_best_fit_decreasing_places_each_document_whole_into_the_fullest_row() -> None:
    lengths = [7, 5, 4, 3, 3, 2, 1]
    rows = place_documents(lengths, 8)
    # 7, 5 and 4 open rows; a 3 fits the row with 3 free (5's), the other 3 the 4's row; the
    # 2 fits nowhere (1, 0 and 1 free) and opens a row; the 1 fills the 7's row.
    assert rows == [[0, 6], [1, 3], [2, 4], [5]]
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 8 for row in rows)
    with pytest.raises(ValueError, match="more than a row's 8"):
        place_documents([9], 8)


def _best_fit_by_scanning(lengths: list[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing the obvious way: every open row scanned for each document."""
    rows: list[list[int]] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fits = [(capacity - sum(lengths[j] for j in row), r) for r, row in enumerate(rows)]
        fits = [(room, r) for room, r in fits if room >= lengths[index]]
        if fits:
            rows[min(fits)[1]].append(index)
        else:
            rows.append([index])
    return rows


def test_the_fast_placement_is_best_fit_decreasing() -> None:
    rng = random.Random(1)
    for _ in range(200):
        capacity = rng.randint(5, 60)
        lengths = [rng.randint(1, capacity) for _ in range(rng.randint(1, 80))]
        assert place_documents(lengths, capacity) == _best_fit_by_scanning(lengths, capacity), (lengths, capacity)


def _rows(lengths: list[int], counted_from: list[int] | None, overlong: str, seq_len: int = 7) -> DocumentRows:
    """Documents of ``lengths`` (ids 1..) whose tokens count from ``counted_from[d]`` on."""
    tokens = np.arange(1, sum(lengths) + 1, dtype=np.uint16) % 200
    counted = None
    if counted_from is not None:
        counted = np.concatenate([np.arange(n) >= c for n, c in zip(lengths, counted_from)]).astype(np.uint8)
    ends = np.cumsum(lengths).astype(np.uint64)
    shape = BatchShape(world_size=1, batch_size=1, seq_len=seq_len)
    return DocumentRows(tokens, counted, ends, shape, seed=0, vocab_size=256, name="test", overlong=overlong, pad_id=0)


def test_each_overlong_policy_is_counted_and_a_document_without_a_target_left_is_dropped() -> None:
    # Rows of 8 tokens. Document 1 (20 tokens) counts from token 2, document 3 (12) only from
    # token 10: truncated to its first 8 it has no counted target left.
    lengths, counted_from = [5, 20, 6, 12], [1, 2, 1, 10]
    truncate = _rows(lengths, counted_from, "truncate")
    assert truncate.overlong == OverlongCounts(truncated=2, without_targets=1)
    assert truncate.documents == 3
    drop = _rows(lengths, counted_from, "drop")
    assert drop.overlong == OverlongCounts(dropped=2) and drop.documents == 2
    split = _rows(lengths, counted_from, "split")
    # 20 -> 8 + 8 + 4, all counted; 12 -> 8 (nothing counted: dropped) + 4 (counted).
    assert split.overlong == OverlongCounts(split=2, without_targets=1)
    assert split.documents == 2 + 3 + 1
    assert "2 truncated, 1 dropped for having no counted target left" == truncate.overlong.describe()
    # Every token of a kept piece is in exactly one row.
    assert int(split._lengths.sum()) == 5 + 20 + 6 + 4
    with pytest.raises(ConfigError, match="holds no document with a target the loss counts"):
        _rows([3, 4], [3, 4], "truncate")


def test_a_row_counts_targets_only_inside_each_document_and_restarts_positions() -> None:
    rows = _rows([3, 4], None, "truncate", seq_len=9)  # one row: 4 + 3 tokens (longest first), 3 of padding
    batch = rows.batch(1, 0)
    assert batch.position_ids is not None
    assert batch.inputs[0].tolist() == [4, 5, 6, 7, 1, 2, 3, 0, 0]
    assert batch.position_ids[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 1]
    # Targets: 5, 6, 7; not 1 (the next document's first); 2, 3; nothing in the padding.
    ignore = IGNORE_INDEX
    assert batch.targets[0].tolist() == [5, 6, 7, ignore, 2, 3, ignore, ignore, ignore]
    assert rows.padding == 3
    assert rows.counted_in(torch.tensor([0])) == 5  # the step's weights count what the row counts


# --- a chat batch, token by token ---------------------------------------------------------


def test_a_chat_batch_holds_whole_conversations_and_counts_only_their_assistant_tokens(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    config = _chat_config(tmp_path, tokenizer_dir)
    source = config_task(config).open_data()
    assert isinstance(source, DocumentRows)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    eos = tokenizer.eos_token_id
    rng = random.Random(0)
    rendered = {}
    for index in range(40):
        ids, flags = render_conversation(tokenizer, conversation(rng), f"line {index + 1}")
        rendered[tuple([*ids, eos])] = [*flags, False]
    for step in (1, 2, 3):
        batch = source.batch(step, 0)
        assert batch.position_ids is not None
        segments = _segments(batch.position_ids)
        for row in range(batch.inputs.shape[0]):
            tokens = torch.cat([batch.inputs[row], batch.targets[row, -1:]])
            for segment in segments[row].unique().tolist():
                at = (segments[row] == segment).nonzero().flatten()
                first, last = int(at[0]), int(at[-1])
                if batch.position_ids[row, first] != 0:
                    raise AssertionError("a document does not start at position 0")
                ids = tuple(int(t) for t in batch.inputs[row, first : last + 1])
                matches = [k for k in rendered if k[: len(ids)] == ids and len(k) == len(ids)]
                if not matches:  # the padding at the end of the row: nothing counted
                    assert all(t == IGNORE_INDEX for t in batch.targets[row, first : last + 1].tolist())
                    continue
                flags = rendered[matches[0]]
                for i in range(first, last + 1):
                    expected = tokens[i + 1].item() if i < last and flags[i - first + 1] else IGNORE_INDEX
                    assert batch.targets[row, i].item() == expected, (step, row, i)
                # A conversation's last input predicts nothing (the next one's first token is no target).
                assert batch.targets[row, last].item() == IGNORE_INDEX


def test_a_chat_file_without_an_assistant_turn_is_refused_before_ray_starts(
    tmp_path: Path, tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n" for _ in range(5)))
    config_file = tmp_path / "run.yaml"
    config_file.write_text(
        f"steps: 1\nmodel:\n  vocab_size: {VOCAB}\ndata:\n  format: chat\n  path: {path}\n"
        f"  tokenizer: {tokenizer_dir}\n  cache_dir: {tmp_path / 'cache'}\n  block_size: 32\n"
    )
    assert cli.main(["train", "--config", str(config_file)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:1: the conversation has no 'assistant' message" in err
    assert not ray.is_initialized()


# --- the loss of a packed batch against each conversation alone --------------------------


def _alone(model: torch.nn.Module, batch, forward) -> torch.Tensor:
    """The mean cross-entropy over the batch's counted targets, each document of each row run
    through ``forward(ids) -> logits`` alone (no packing, no position ids)."""
    segments = _segments(batch.position_ids)
    total, count = torch.zeros((), dtype=torch.float64), 0
    for row in range(batch.inputs.shape[0]):
        for segment in segments[row].unique().tolist():
            at = (segments[row] == segment).nonzero().flatten()
            first, last = int(at[0]), int(at[-1])
            targets = batch.targets[row, first : last + 1]
            if (targets == IGNORE_INDEX).all():
                continue
            logits = forward(batch.inputs[row : row + 1, first : last + 1])[0]
            losses = torch.nn.functional.cross_entropy(
                logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum"
            )
            total += losses.double()
            count += int((targets != IGNORE_INDEX).sum())
    return total / count


def test_a_packed_batch_of_a_transformers_llama_gives_each_conversation_alone_s_loss(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    config = _chat_config(tmp_path, tokenizer_dir)
    batch = config_task(config).open_data().batch(1, 0)
    folder = tiny_llama(tmp_path / "llama", VOCAB, max_position_embeddings=SEQ)
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_pretrained(folder)).eval()
    with torch.no_grad():
        _, packed = HFCausalLM(llama)(batch.inputs, batch.targets, position_ids=batch.position_ids)
        alone = _alone(llama, batch, lambda ids: llama(input_ids=ids).logits)
    assert packed is not None
    assert float(packed) == pytest.approx(float(alone), rel=1e-6)
    # Without the position ids the conversations would see each other: another loss.
    with torch.no_grad():
        _, stream = HFCausalLM(llama)(batch.inputs, batch.targets)
    assert stream is not None and abs(float(stream) - float(alone)) > 1e-4


def test_a_packed_batch_of_the_built_in_gpt_gives_each_conversation_alone_s_loss(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    config = _chat_config(tmp_path, tokenizer_dir)
    batch = config_task(config).open_data().batch(1, 0)
    torch.manual_seed(0)
    from cargohold.cluster.schema.model import GPTConfig

    gpt = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=SEQ, vocab_size=VOCAB)).eval()
    with torch.no_grad():
        _, packed = gpt(batch.inputs, batch.targets, position_ids=batch.position_ids)
        alone = _alone(gpt, batch, lambda ids: gpt(ids)[0])
    assert packed is not None
    assert float(packed) == pytest.approx(float(alone), rel=1e-6)


# --- the reduction: the same loss and gradient however rows are split --------------------


@pytest.mark.parametrize(("world", "batch_size", "micro"), [(1, 4, 1), (2, 2, 1), (4, 1, 1), (2, 1, 2), (1, 1, 4)])
def test_the_step_loss_and_gradient_are_the_token_mean_however_rows_are_split(
    tmp_path: Path, tokenizer_dir: Path, world: int, batch_size: int, micro: int
) -> None:
    """What the workers compute, each batch's mean loss times its weight, averaged over
    ranks and micro-batches (FSDP2's mean, accumulation's sum / M), is the mean over every
    counted token of the step's rows, as one cross_entropy(reduction="mean") over them."""
    config = _chat_config(tmp_path, tokenizer_dir)
    whole = config_task(config).open_data()  # 1 worker x 4 rows: the reference split
    shape = BatchShape(world_size=world, batch_size=batch_size, seq_len=SEQ, micro_batches=micro)
    split = _chat_config(tmp_path, tokenizer_dir)
    source = config_task(split).open_data()
    source.shape = shape
    torch.manual_seed(0)
    from cargohold.cluster.schema.model import GPTConfig

    gpt = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=SEQ, vocab_size=VOCAB))
    reference = whole.batch(1, 0)
    _, expected = gpt(reference.inputs, reference.targets, position_ids=reference.position_ids)
    assert expected is not None
    expected.backward()
    expected_grads = [p.grad.clone() for p in gpt.parameters()]
    gpt.zero_grad()
    total = torch.zeros(())
    for rank in range(world):
        for m in range(micro):
            batch = source.batch(1, rank, m)
            _, loss = gpt(batch.inputs, batch.targets, position_ids=batch.position_ids)
            assert loss is not None
            scaled = loss * batch.weight / (world * micro)
            scaled.backward()
            total += scaled.detach()
    assert float(total) == pytest.approx(float(expected.detach()), rel=1e-6)
    for got, want in zip((p.grad for p in gpt.parameters()), expected_grads):
        assert got is not None
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_a_run_reports_what_the_placement_made_of_the_documents(ray_local, tmp_path: Path, tokenizer_dir: Path) -> None:
    """TrainResult.data_documents and the launcher's gauge carry the counts the log prints."""
    from cargohold.cluster.supervise import train
    from cargohold.services.metrics.launcher import LauncherMetrics
    from cargohold.services.metrics.names import DATA_DOCUMENTS

    config = dataclasses.replace(_chat_config(tmp_path, tokenizer_dir, block_size=24, overlong="split"), steps=2)
    expected = config_task(config).open_data()
    assert isinstance(expected, DocumentRows) and expected.overlong.split > 0
    metrics = LauncherMetrics()
    result = train(config, metrics=metrics)
    assert result.data_documents == expected.summary()
    for what, count in expected.summary().items():
        assert metrics.registry.get_sample_value(DATA_DOCUMENTS, {"what": what}) == count


def test_json_lines_take_whole_documents_as_an_option_and_stream_stays_their_default(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    from data_fixtures import write_jsonl

    from cargohold.services.data.blocks import TokenBlocks

    path = str(write_jsonl(tmp_path / "docs.jsonl", 30))
    stream = config_task(_chat_config(tmp_path, tokenizer_dir, format="jsonl", path=path)).open_data()
    assert isinstance(stream, TokenBlocks)
    rows = config_task(
        _chat_config(tmp_path, tokenizer_dir, format="jsonl", path=path, packing="documents")
    ).open_data()
    assert isinstance(rows, DocumentRows) and rows.documents == 30 and rows.overlong == OverlongCounts()
    eos = transformers.AutoTokenizer.from_pretrained(tokenizer_dir).eos_token_id
    batch = rows.batch(1, 0)
    segments = _segments(batch.position_ids)
    for row in range(batch.inputs.shape[0]):
        for segment in segments[row].unique().tolist():
            at = (segments[row] == segment).nonzero().flatten()
            first, last = int(at[0]), int(at[-1])
            targets = batch.targets[row, first : last + 1]
            if batch.inputs[row, last] == eos:  # a whole document: every target inside it counts
                assert (targets[:-1] != IGNORE_INDEX).all() and targets[-1] == IGNORE_INDEX
                assert targets[-2] == eos


def test_a_family_that_would_attend_across_documents_is_refused_for_whole_documents(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    folder = tmp_path / "opt"
    transformers.OPTConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=SEQ,
        word_embed_proj_dim=32,
    ).save_pretrained(folder)
    config = _chat_config(tmp_path, tokenizer_dir)
    config = dataclasses.replace(config, hf=dataclasses.replace(config.hf, config_path=str(folder / "config.json")))
    with pytest.raises(ConfigError, match=r"\(opt\) does not confine attention .* set data.packing: stream"):
        config_task(config).open_data()
    stream = dataclasses.replace(config, data=dataclasses.replace(config.data, packing="stream"))
    config_task(stream).open_data()  # the old packing stays available
