"""Validation on held-out data (``eval.*``): which blocks each evaluation reads and how
they are weighted, the refusals of bad held-out data before training (exit status 2,
naming the key and file), and a run on real Ray actors whose held-out losses equal the
reference's bitwise, with gradient accumulation, in the run's result and its metrics."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import ray
import torch
from reference import reference_train, tiny_config

from cargohold.cluster import cli
from cargohold.cluster.sections import config_task
from cargohold.cluster.supervise import train
from cargohold.services.core.errors import ConfigError
from cargohold.services.data import generate_corpus
from cargohold.services.data.evaluation import EvalSet
from cargohold.services.metrics.launcher import LauncherMetrics
from cargohold.services.metrics.names import EVAL_LOSS, EVAL_PERPLEXITY, EVAL_STEP
from cargohold.services.models.loss import IGNORE_INDEX


def _held_out(tmp_path: Path, num_bytes: int = 20_000) -> Path:
    path = tmp_path / "held-out.txt"
    path.write_bytes(generate_corpus(num_bytes, seed=99))
    return path


def test_eval_batches_read_the_set_in_order_and_weigh_the_token_mean() -> None:
    """Batch i of rank r is the blocks ``[(i * W + r) * B, ...)``; with masked targets the
    weighted batch means average to the mean over every counted token of the set."""
    rng = np.random.default_rng(0)
    seq_len, world, batch_size = 8, 2, 3
    tokens = rng.integers(0, 50, size=seq_len * 40 + 1).astype(np.uint16)  # 40 blocks: 6 whole batches
    counted = rng.random(tokens.shape[0]) < 0.4
    held_out = EvalSet(
        tokens,
        counted,
        world_size=world,
        batch_size=batch_size,
        seq_len=seq_len,
        max_batches=None,
        vocab_size=50,
        name="t",
    )
    assert held_out.num_batches == 6
    per_token = torch.from_numpy(rng.random((40, seq_len)))  # a "loss" per target
    weighted, seen = 0.0, []
    for index in range(held_out.num_batches):
        for rank in range(world):
            batch = held_out.batch(index, rank)
            first = (index * world + rank) * batch_size
            seen.extend(range(first, first + batch_size))
            assert torch.equal(
                batch.inputs[0], torch.from_numpy(tokens[first * seq_len : first * seq_len + seq_len].astype(np.int64))
            )
            mask = batch.targets.ne(IGNORE_INDEX)
            losses = per_token[first : first + batch_size]
            mean = float(losses[mask].mean()) if mask.any() else 0.0
            weighted += batch.weight / held_out.num_batches * mean
    assert seen == list(range(36))
    blocks_counted = torch.from_numpy(
        np.stack([counted[b * seq_len + 1 : b * seq_len + seq_len + 1] for b in range(36)])
    )
    expected = float(per_token[:36][blocks_counted].mean())
    assert math.isclose(weighted / world, expected, rel_tol=1e-12)

    capped = EvalSet(
        tokens,
        counted,
        world_size=world,
        batch_size=batch_size,
        seq_len=seq_len,
        max_batches=2,
        vocab_size=50,
        name="t",
    )
    assert capped.num_batches == 2


def _refused(capsys: pytest.CaptureFixture[str], *overrides: str) -> str:
    """Run ``cargohold train`` with ``overrides``; it must exit 2 before training starts."""
    args = ["train", "--set", "steps=2", "--set", "data.corpus_bytes=20000"]
    for override in overrides:
        args += ["--set", override]
    assert cli.main(args) == 2
    return capsys.readouterr().err


def test_bad_held_out_data_and_accumulation_exit_2_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    assert f"eval.path '{empty}' is empty" in _refused(capsys, f"eval.path={empty}")
    short = _held_out(tmp_path, 200)  # 2 workers x 8 sequences of 257 bytes do not fit in 200
    err = _refused(capsys, f"eval.path={short}")
    assert f"eval.path '{short}'" in err and "fewer than one eval batch" in err
    assert "eval.path" in _refused(capsys, f"eval.path={tmp_path / 'missing.txt'}")
    assert "eval.split" in _refused(capsys, "eval.split=validation")
    assert "eval.every_steps" in _refused(capsys, "eval.every_steps=5")
    assert "tuning.eval.batch_size" in _refused(capsys, f"eval.path={short}", "tuning.eval.batch_size=0")
    for bad in ("0", "-1"):
        assert "data.micro_batches" in _refused(capsys, f"data.micro_batches={bad}")


def test_bad_held_out_jsonl_line_exits_2_naming_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    from data_fixtures import make_tokenizer, write_jsonl

    tokenizer = make_tokenizer(tmp_path / "tokenizer")
    train_file = write_jsonl(tmp_path / "train.jsonl", 50)
    held_out = tmp_path / "held-out.jsonl"
    held_out.write_text('{"text": "a cat"}\n{"body": "no text field"}\n')
    err = _refused(
        capsys,
        "data.format=jsonl",
        f"data.path={train_file}",
        f"data.tokenizer={tokenizer}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "model.vocab_size=384",
        f"eval.path={held_out}",
    )
    assert f"{held_out}:2 has no field 'text'" in err


@pytest.mark.integration
def test_held_out_loss_matches_the_reference_bitwise_and_reaches_result_and_metrics(tmp_path: Path) -> None:
    """Two micro-batches a step, validation every 2 of 5 steps and after the last: the
    held-out losses equal the reference's bitwise, and validating leaves training as it
    was (the training losses equal the reference's, which never validates between steps)."""
    config = tiny_config(
        steps=5, data__micro_batches=2, eval__path=str(_held_out(tmp_path)), eval__every_steps=2, eval__max_batches=3
    )
    assert config_task(config).open_eval().num_batches == 3
    metrics, shown = LauncherMetrics(), []
    try:
        result = train(config, on_eval=shown.append, metrics=metrics)
    finally:
        if ray.is_initialized():
            ray.shutdown()
    reference = reference_train(config, config.steps, eval_steps=(2, 4, 5))
    assert result.losses == reference.losses
    assert [(e.step, e.loss) for e in result.evals] == sorted(reference.evals.items())
    assert shown == result.evals
    last = result.evals[-1]
    assert last.perplexity == math.exp(last.loss) and 1.0 < last.perplexity < 256.0
    registry = metrics.registry
    assert registry.get_sample_value(EVAL_LOSS) == last.loss
    assert registry.get_sample_value(EVAL_PERPLEXITY) == last.perplexity
    assert registry.get_sample_value(EVAL_STEP) == 5


def test_eval_split_is_for_datasets_only() -> None:
    with pytest.raises(ConfigError, match="eval.split"):
        tiny_config(eval__split="validation")
