"""Bad data found from outside (issue 40), refused by name before anything trains: a token
file with ids beyond the model's vocabulary, a conversation longer than a sequence under
``data.overlong: error``, a chat record too large or of too many turns to render, a chat
template that loops or trips Jinja's sandbox, and an edited or truncated tokenization
cache entry (named in a warning and rebuilt, never trained on)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

from data_fixtures import make_tokenizer  # noqa: E402
from reference import tiny_config  # noqa: E402

from cargohold.cluster import cli  # noqa: E402
from cargohold.services.data.sources import open_source  # noqa: E402
from cargohold.services.errors import ConfigError  # noqa: E402

VOCAB = 384


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def _config(tmp_path: Path, tokenizer_dir: Path, **data):
    """The built-in GPT (its vocabulary fits the tokenizer) on ``data``; 2 ranks of 2 rows."""
    data = {"tokenizer": str(tokenizer_dir), "cache_dir": str(tmp_path / "cache"), "block_size": 16, **data}
    return tiny_config(model__vocab_size=VOCAB, data__batch_size=2, **{f"data__{k}": v for k, v in data.items()})


def _train(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``cargohold train`` with ``--set`` of each of ``args``: its exit code and stderr.
    Every case here fails before Ray starts (a run would need minutes to reach it)."""
    code = cli.main(["train", *(a for arg in args for a in ("--set", arg))])
    return code, capsys.readouterr().err


# --- row 15: a token file's ids, checked whole before Ray --------------------------------


@pytest.mark.parametrize("suffix", [".bin", ".npy"])
def test_a_token_id_beyond_the_vocabulary_exits_2_before_ray_naming_file_and_position(
    tmp_path: Path, suffix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ids = (np.arange(100_000) % 256).astype(np.uint16)
    ids[77_777] = 300  # the model embeds 256 ids
    path = tmp_path / f"tokens{suffix}"
    np.save(path, ids) if suffix == ".npy" else ids.tofile(path)
    code, err = _train(["data.format=tokens", f"data.path={path}", "steps=1"], capsys)
    assert code == 2, err
    assert re.search(rf"data.path '{re.escape(str(path))}' holds token id 300 at position 77777, outside", err), err
    with pytest.raises(ConfigError, match="position 77777"):  # the Python API refuses it as it opens the data
        open_source(tiny_config(data__format="tokens", data__path=str(path)))


def test_a_negative_token_id_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "tokens.npy"
    ids = np.arange(5_000, dtype=np.int32) % 256
    ids[4_000] = -1
    np.save(path, ids)
    with pytest.raises(ConfigError, match=r"token id -1 at position 4000, outside the model's vocabulary of 256"):
        open_source(tiny_config(data__format="tokens", data__path=str(path)))
