"""The fine-tuning example as a user runs it (README, "Fine-tune your model"), with fewer
steps: examples/make_tiny_llama.py makes the checkpoint, `cargohold train --config
examples/finetune.yaml` fine-tunes it on the shipped conversations and exports it, and
transformers alone loads the export. The export's logits are those of the masters the
run's final checkpoint holds, bitwise; examples/generate.py answers from it."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from cargohold.cluster.schema.io import load_config  # noqa: E402
from cargohold.cluster.sections import config_layout, model_spec  # noqa: E402
from cargohold.services.checkpoint import CheckpointDir, read_flat_range  # noqa: E402
from cargohold.services.core.layout import gather_params  # noqa: E402
from cargohold.services.models.build import build_model  # noqa: E402

# slow: the chat contract (tests/test_training_contract.py, the masked chat loss bitwise) and
# tests/test_export_hf.py cover its behaviour in the default run.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
CONFIG = EXAMPLES / "finetune.yaml"
STEPS = 6


def _run(*command: str) -> str:
    done = subprocess.run([sys.executable, *command], cwd=REPO, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_example_fine_tunes_and_its_export_loads_with_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)  # the example's paths are relative to the repository, as in the README
    model_dir, export = tmp_path / "tiny-llama", tmp_path / "export"
    assert "Llama" in _run(str(EXAMPLES / "make_tiny_llama.py"), str(model_dir))
    overrides = [
        f"hf.checkpoint_dir={model_dir}",
        f"export_dir={export}",
        f"data.cache_dir={tmp_path / 'cache'}",
        f"steps={STEPS}",
        "optim.warmup_steps=2",
        f"checkpoint.dir={tmp_path / 'checkpoints'}",
        f"checkpoint.every_steps={STEPS}",
    ]
    output = _run("-m", "cargohold.cluster.cli", "train", "--config", str(CONFIG), *(f"--set={o}" for o in overrides))
    losses = [float(loss) for loss in re.findall(r"^step \d+ loss ([0-9.]+)", output, re.M)]
    assert len(losses) == STEPS and losses[-1] < losses[0] - 0.5, losses

    store = CheckpointDir(tmp_path / "checkpoints")
    final = store.final_dir(STEPS)
    manifest = store.load(final)
    config = load_config(CONFIG, overrides)
    _, _, layout = config_layout(config)
    masters = gather_params(layout, read_flat_range(final, manifest, 0, manifest.total)["master"])
    trained = build_model(model_spec(config), config.data).eval()
    with torch.no_grad():
        for name, param in trained.named_parameters():
            param.copy_(masters[name])

    tokenizer = transformers.AutoTokenizer.from_pretrained(export, local_files_only=True)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(export, local_files_only=True)
    messages = [{"role": "user", "content": "What is the capital of Peru?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, trained(ids)[0])
    assert loaded.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")

    reply = _script("generate").answer(export, "What is the capital of Peru?", max_new_tokens=12)
    assert reply.strip() and "<|im_end|>" not in reply
