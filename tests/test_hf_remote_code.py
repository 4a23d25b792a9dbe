"""A model folder that ships its own code (``auto_map`` in config.json or
tokenizer_config.json) is refused: cargohold never runs a model folder's code, even when
someone at a terminal would answer transformers' "run the custom code? [y/N]" with y."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(120)

MARKER = "ran-the-folders-code"
CUSTOM_CODE = """
from pathlib import Path
Path({marker!r}).write_text("yes")
from transformers import LlamaConfig


class CustomConfig(LlamaConfig):
    model_type = "cargohold-custom"
"""
LOAD = """
import sys
from cargohold.cluster.schema.model import HFModelConfig
from cargohold.services.data.tokenizer import load_tokenizer
from cargohold.services.core.errors import ConfigError
from cargohold.services.models.hf import pretrained_config
from pathlib import Path
try:
    if sys.argv[2] == "model":
        pretrained_config(HFModelConfig(config_path=sys.argv[1]))
    else:
        load_tokenizer(Path(sys.argv[1]), "data.tokenizer_path", 1000)
except ConfigError as error:
    print("REFUSED:", error, flush=True)
    sys.exit(2)
print("LOADED", flush=True)
"""


def _custom_folder(tmp_path: Path, what: str) -> Path:
    folder = tmp_path / "custom"
    folder.mkdir()
    code = CUSTOM_CODE.format(marker=str(tmp_path / MARKER))
    (folder / "configuration_custom.py").write_text(code)
    auto_map = {"AutoConfig": "configuration_custom.CustomConfig"}
    if what == "model":
        config = {"model_type": "cargohold-custom", "auto_map": auto_map, "vocab_size": 64}
    else:
        config = {"model_type": "llama", "vocab_size": 64}
        (folder / "tokenization_custom.py").write_text(code)
        tokenizer_config = {"auto_map": {"AutoTokenizer": ["tokenization_custom.CustomTokenizer", None]}}
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _run_at_a_terminal(folder: Path, what: str, modules: Path) -> tuple[int, str]:
    """Load ``folder`` in a child process whose standard input and output are a terminal,
    answering "y" to any question; its exit code and output. ``modules``: where
    transformers copies a folder's code before running it."""
    main, child = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-c", LOAD, str(folder), what],
        stdin=child,
        stdout=child,
        stderr=child,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "HF_MODULES_CACHE": str(modules)},
    )
    os.close(child)
    output = b""
    answered = False
    deadline = time.monotonic() + 90
    try:
        while process.poll() is None and time.monotonic() < deadline:
            ready, _, _ = select.select([main], [], [], 0.2)
            if ready:
                try:
                    output += os.read(main, 4096)
                except OSError:
                    break
            if not answered and b"[y/N]" in output:
                os.write(main, b"y\n")
                answered = True
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
        os.close(main)
    return process.returncode, output.decode(errors="replace")


@pytest.mark.parametrize("what", ["model", "tokenizer"])
def test_a_folder_with_its_own_code_is_refused_without_a_question(tmp_path: Path, what: str) -> None:
    # Before: transformers asked at the terminal, and "y" ran the folder's code.
    folder = _custom_folder(tmp_path, what)
    code, output = _run_at_a_terminal(folder, what, tmp_path / "modules")
    assert not (tmp_path / MARKER).exists(), output
    assert "[y/N]" not in output
    assert (code, "REFUSED:" in output) == (2, True), output
    assert "has auto_map" in output and "runs no code from a model folder" in output, output
