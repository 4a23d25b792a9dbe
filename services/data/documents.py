"""Reading the documents of local files, before tokenization: text files, JSON lines, and
Hugging Face ``datasets`` folders or arrow/parquet files. Each record carries where it
came from (file and line, or row) so that a bad one is refused by name. ``section`` is
the config section whose ``path`` (and ``split``) named the data, for messages: ``data``,
or ``eval`` for held-out data."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cargohold.services.core.errors import ConfigError

TEXT_PIECE_CHARS = 1 << 20
"""A long text file is tokenized in pieces of about this many characters, each ending at
a line break, so memory stays bounded. A tokenizer that merges across line breaks may
split the break between two pieces otherwise than the whole file's (a token a MiB)."""
DATASET_BATCH_ROWS = 1000


@dataclass(frozen=True, slots=True)
class Record:
    value: Any
    where: str
    """``file:line`` or ``folder row N``, for messages."""


def text_files(path: Path, section: str = "data") -> list[Path]:
    """A text file, or every ``*.txt`` file under a folder in name order: one document each."""
    files = sorted(path.rglob("*.txt")) if path.is_dir() else [path]
    if not files:
        raise ConfigError(f"{section}.path {str(path)!r} is a folder without *.txt files")
    return files


def text_pieces(path: Path, section: str = "data") -> Iterator[tuple[str, bool]]:
    """``(piece, ends_document)`` of each of :func:`text_files`."""
    for file in text_files(path, section):
        try:
            with file.open(encoding="utf-8") as handle:
                piece: list[str] = []
                size = 0
                for line in handle:
                    piece.append(line)
                    size += len(line)
                    if size >= TEXT_PIECE_CHARS:
                        yield "".join(piece), False
                        piece, size = [], 0
                yield "".join(piece), True
        except UnicodeDecodeError as error:
            raise ConfigError(f"{section}.path: {file} is not UTF-8 text: {error}") from error


def jsonl_records(
    path: Path, field: str, section: str = "data", max_chars: tuple[int, str] | None = None
) -> Iterator[Record]:
    """The ``field`` of each JSON object line of ``path`` (blank lines skipped).
    ``max_chars``: the most characters a line may hold, and what such a line is (for the
    message), refused before it is parsed."""
    if not path.is_file():
        raise ConfigError(f"{section}.path {str(path)!r} is not a file (JSON lines)")
    with path.open(encoding="utf-8") as handle:
        try:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                where = f"{path}:{number}"
                if max_chars is not None and len(line) > max_chars[0]:
                    raise ConfigError(
                        f"{where} holds {len(line):,} characters, more than the {max_chars[0]:,} {max_chars[1]}"
                    )
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ConfigError(f"{where} is not valid JSON: {error}") from error
                if not isinstance(record, dict):
                    raise ConfigError(f"{where} holds a {type(record).__name__}, not a JSON object")
                if field not in record:
                    raise ConfigError(f"{where} has no field {field!r} (data.field); its fields: {sorted(record)}")
                yield Record(record[field], where)
        except UnicodeDecodeError as error:
            raise ConfigError(f"{section}.path {str(path)!r} is not UTF-8 text: {error}") from error


def dataset_records(path: Path, field: str, split: str, section: str = "data") -> Iterator[Record]:
    """Column ``field`` of a ``datasets`` folder (``save_to_disk``; split ``split`` of a
    DatasetDict), or of ``.arrow`` / ``.parquet`` files (a file, or a folder of them)."""
    _datasets()  # pyarrow, which reads parquet, comes with it
    if path.is_dir() and not (path / "state.json").is_file() and not (path / "dataset_dict.json").is_file():
        files = sorted(path.glob("*.parquet")) or sorted(path.glob("*.arrow"))
        if not files:
            raise ConfigError(
                f"{section}.path {str(path)!r} is neither a datasets folder (save_to_disk) nor a folder of "
                ".parquet or .arrow files"
            )
    else:
        files = [path]
    for file in files:
        if file.suffix == ".parquet":
            yield from _parquet_records(file, field, section)
        else:
            yield from _dataset_records(file, field, split, section)


def _parquet_records(path: Path, field: str, section: str) -> Iterator[Record]:
    import pyarrow.parquet as parquet  # comes with datasets

    table = parquet.ParquetFile(path)
    _check_column(path, field, table.schema_arrow.names, section)
    row = 0
    for batch in table.iter_batches(batch_size=DATASET_BATCH_ROWS, columns=[field]):
        for value in batch.column(0).to_pylist():
            yield Record(value, f"{path} row {row}")
            row += 1


def _dataset_records(path: Path, field: str, split: str, section: str) -> Iterator[Record]:
    datasets = _datasets()
    if path.is_dir():
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ConfigError(
                    f"{section}.split {split!r} is not a split of {section}.path {str(path)!r}: {sorted(loaded)}"
                )
            loaded = loaded[split]
    elif path.suffix == ".arrow":
        loaded = datasets.Dataset.from_file(str(path))
    else:
        raise ConfigError(
            f"{section}.path {str(path)!r}: data.format=hf_dataset reads a folder, .arrow or .parquet files"
        )
    _check_column(path, field, loaded.column_names, section)
    row = 0
    for batch in loaded.select_columns([field]).iter(batch_size=DATASET_BATCH_ROWS):
        for value in batch[field]:
            yield Record(value, f"{path} row {row}")
            row += 1


def _check_column(path: Path, field: str, columns: list[str], section: str) -> None:
    if field not in columns:
        raise ConfigError(
            f"data.field {field!r} is not a column of {section}.path {str(path)!r}; its columns: {columns}"
        )


def _datasets() -> Any:
    try:
        import datasets
    except ImportError as error:
        raise ConfigError(
            f"data.format=hf_dataset needs the datasets package: pip install 'cargohold[datasets]' ({error})"
        ) from error
    return datasets
