"""Reading a transformers checkpoint (``save_pretrained`` output) one tensor at a time.

``safetensors.safe_open`` memory-maps the files: a tensor is read when asked for, and
:func:`checkpoint_rows` reads only the rows of dim 0 a worker's FSDP2 shard holds, so no
process ever holds the whole checkpoint. Values come back as fp32 CPU tensors, as
``from_pretrained(..., dtype=torch.float32)`` loads them (a bf16 checkpoint is cast
exactly). Names are the transformers parameter names (no ``hf.`` prefix).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from cargohold.services.core.errors import ConfigError, LayoutError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def tensor_files(checkpoint_dir: Path) -> dict[str, Path]:
    """Where each tensor of the checkpoint is stored: tensor name -> safetensors file."""
    folder = Path(checkpoint_dir)
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as error:
            raise ConfigError(f"cannot read the shard index {index}: {type(error).__name__}: {error}") from None
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / SINGLE_FILE
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    raise ConfigError(f"checkpoint folder {_without_safetensors(folder)}")


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
"""Weight files in Python's pickle format, which cargohold never loads: unpickling a file
can run any code it names."""


def require_safetensors(folder: Path, named: str) -> None:
    """Refuse a checkpoint folder (``named``: the config key and value, for the message)
    whose weights are not in safetensors files, before anything reads it."""
    if not ((folder / INDEX_FILE).is_file() or (folder / SINGLE_FILE).is_file()):
        raise ConfigError(f"{named}: {_without_safetensors(folder)}")


def _without_safetensors(folder: Path) -> str:
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES) if folder.is_dir() else []
    held = (
        f" (it holds {', '.join(pickles)}: pickle files, which cargohold never loads, since loading one can run code)"
        if pickles
        else ""
    )
    return (
        f"{folder} holds no {SINGLE_FILE} or {INDEX_FILE}{held}; save the model with save_pretrained "
        "(safetensors), or convert its weights to safetensors"
    )


def checkpoint_tensors(checkpoint_dir: Path, names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, fp32 CPU tensor)`` for each of ``names``, in order, one read at a time."""
    files = tensor_files(checkpoint_dir)
    with ExitStack() as stack:
        opened: dict[Path, Any] = {}
        for name in names:
            path = _file_of(files, name, checkpoint_dir)
            if path not in opened:
                opened[path] = stack.enter_context(safe_open(path, framework="pt"))
            yield name, opened[path].get_tensor(name).to(torch.float32, copy=True)


def checkpoint_rows(checkpoint_dir: Path, name: str, rows: tuple[int, int]) -> torch.Tensor:
    """Rows ``[lo, hi)`` of dim 0 of tensor ``name``, fp32, reading only those rows."""
    path = _file_of(tensor_files(checkpoint_dir), name, checkpoint_dir)
    lo, hi = rows
    with safe_open(path, framework="pt") as f:
        piece = f.get_slice(name)
        shape = piece.get_shape()
        if not shape or not 0 <= lo <= hi <= shape[0]:
            raise LayoutError(f"rows [{lo}, {hi}) are not rows of {name} (shape {shape}) in {checkpoint_dir}")
        return piece[lo:hi].to(torch.float32, copy=True)


def _file_of(files: dict[str, Path], name: str, checkpoint_dir: Path) -> Path:
    try:
        return files[name]
    except KeyError:
        raise ConfigError(
            f"tensor {name} is not in the checkpoint at {checkpoint_dir} "
            f"(it holds {len(files)} tensors); is this checkpoint of the same model?"
        ) from None
