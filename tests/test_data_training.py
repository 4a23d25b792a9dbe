"""Fine-tuning as a user runs it: `cargohold train` in a subprocess (its own in-process Ray
cluster, 2 workers) on a tiny Llama whose folder holds its own tokenizer, with a JSON
lines file of chat conversations. The run is checkpointed at step 4; resumed from there,
it ends bitwise where the uninterrupted run ended (weights and both Adam moments), its
losses the same, and it tokenizes nothing again."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from data_fixtures import make_tokenizer, tiny_llama, write_chat  # noqa: E402

from cargohold.services.checkpoint import CheckpointDir, read_flat_range  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[1]
STEPS = 8
CONFIG = """\
steps: {steps}
seed: 3
hf:
  config_path: {model}
data:
  format: chat
  path: {chat}
  batch_size: 4
  cache_dir: {cache}
optim:
  lr: 0.01
  warmup_steps: 2
  schedule: cosine
worker:
  num_workers: 2
state_server:
  num_servers: 1
checkpoint:
  dir: {checkpoints}
  every_steps: 4
"""


def _train(config: Path, *args: str) -> list[str]:
    """``cargohold train --config config ...``; the losses it printed, as printed."""
    done = subprocess.run(
        [sys.executable, "-m", "cargohold.cluster.cli", "train", "--config", str(config), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return re.findall(r"^step \d+ loss ([0-9.]+)", done.stdout, re.M)


def _state(root: Path, step: int) -> dict[str, torch.Tensor]:
    store = CheckpointDir(root)
    path = store.final_dir(step)
    manifest = store.load(path)
    return read_flat_range(path, manifest, 0, manifest.total)


@pytest.mark.slow  # 78 s; resume is bitwise in tests/test_recovery.py, chat training in test_training_contract.py
def test_chat_fine_tuning_resumes_bitwise(tmp_path: Path) -> None:
    model = tiny_llama(make_tokenizer(tmp_path / "model"), vocab_size=384)  # max_position_embeddings 32
    chat = write_chat(tmp_path / "chat.jsonl", 300)
    checkpoints = tmp_path / "checkpoints"
    config = tmp_path / "run.yaml"
    config.write_text(
        CONFIG.format(steps=STEPS, model=model, chat=chat, cache=tmp_path / "cache", checkpoints=checkpoints)
    )

    losses = _train(config)
    assert len(losses) == STEPS and float(losses[-1]) < float(losses[0]), losses
    uninterrupted = _state(checkpoints, STEPS)
    shutil.rmtree(CheckpointDir(checkpoints).final_dir(STEPS))  # as if the run had stopped after step 4

    resumed = _train(config, "--resume", "latest")
    assert resumed == losses[4:]
    for key, value in _state(checkpoints, STEPS).items():
        assert torch.equal(value, uninterrupted[key]), key
    assert len(list((tmp_path / "cache").iterdir())) == 1, "the second run read the tokenization cache"
