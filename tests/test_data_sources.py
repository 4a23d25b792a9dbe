"""The data formats, read from local files: pre-tokenized token files, text, JSON lines,
chat and Hugging Face datasets tokenized with a tokenizer trained here, the tokenization
cache, the model's own vocabulary and context, and bad input refused by name before
anything trains."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from data_fixtures import EOS, make_tokenizer, tiny_llama, write_chat, write_jsonl  # noqa: E402
from reference import tiny_config  # noqa: E402

from cargohold.cluster import cli  # noqa: E402
from cargohold.cluster.schema.io import load_config  # noqa: E402
from cargohold.cluster.sections import config_task, model_spec  # noqa: E402
from cargohold.services.core.errors import ConfigError  # noqa: E402
from cargohold.services.data import generate_corpus, tokenization  # noqa: E402
from cargohold.services.data.blocks import TokenBlocks  # noqa: E402
from cargohold.services.data.rows import DocumentRows  # noqa: E402
from cargohold.services.models.dimensions import sequence_length  # noqa: E402
from cargohold.services.models.loss import IGNORE_INDEX  # noqa: E402

VOCAB = 384


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path):
    return transformers.AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama whose folder holds its tokenizer too, as a checkpoint's would."""
    folder = tmp_path_factory.mktemp("llama")
    return tiny_llama(make_tokenizer(folder), VOCAB)


def _config(tmp_path: Path, tokenizer_dir: Path, **data):
    """The built-in GPT (its vocabulary fits the tokenizer) on ``data``; 2 ranks of 2 rows."""
    data = {"tokenizer": str(tokenizer_dir), "cache_dir": str(tmp_path / "cache"), "block_size": 16, **data}
    return tiny_config(model__vocab_size=VOCAB, data__batch_size=2, **{f"data__{k}": v for k, v in data.items()})


def _stream(source) -> np.ndarray:
    assert isinstance(source, (TokenBlocks, DocumentRows))
    return np.asarray(source.tokens)


# --- pre-tokenized token files ----------------------------------------------------------


@pytest.mark.parametrize(
    ("suffix", "dtype", "vocab"),
    [(".bin", "uint16", 256), (".bin", "uint16", 65_536), (".bin", "uint32", 65_537), (".npy", "uint32", 256)],
)
def test_token_files_are_memory_mapped_and_batched(tmp_path: Path, suffix: str, dtype: str, vocab: int) -> None:
    """A .bin file's dtype follows the vocabulary (uint16 up to 65,536 ids, nanoGPT's
    convention; uint32 above); a .npy file states its own."""
    ids = (np.arange(1000) * 7 % 256).astype(dtype)
    path = tmp_path / f"tokens{suffix}"
    np.save(path, ids) if suffix == ".npy" else ids.tofile(path)
    model = {"model__vocab_size": vocab, "model__n_embd": 8, "model__n_head": 1} if vocab != 256 else {}
    config = tiny_config(data__format="tokens", data__path=str(path), **model)
    source = config_task(config).open_data()
    assert isinstance(source.tokens, np.memmap) and np.array_equal(source.tokens, ids)
    batch = source.batch(1, 1)
    assert batch.inputs.shape == (4, 32) and torch.equal(batch.inputs[:, 1:], batch.targets[:, :-1])
    for row in batch.inputs:  # each row is a block of the file
        start = int(np.flatnonzero(ids == row[0].item())[0]) // 32 * 32
        assert torch.equal(row, torch.from_numpy(ids[start : start + 32].astype(np.int64)))


def test_token_file_dtype_is_checked_against_the_vocabulary(tmp_path: Path) -> None:
    path = tmp_path / "tokens.npy"
    np.save(path, np.arange(1000, dtype=np.uint16))
    big = tiny_config(
        data__format="tokens", data__path=str(path), model__vocab_size=70_000, model__n_embd=8, model__n_head=1
    )
    with pytest.raises(ConfigError, match=r"data.path .*tokens.npy.* uint16 ids .* 70000 ids.*write the ids as uint32"):
        config_task(big).open_data()
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\0" * 7)
    with pytest.raises(ConfigError, match=r"odd.bin.*not a whole number of uint16 ids.*as a \.npy file"):
        config_task(tiny_config(data__format="tokens", data__path=str(odd))).open_data()
    six = tmp_path / "six.bin"  # 3 uint16 ids, not a whole number of the uint32 ids of a vocabulary above 65,536
    np.arange(3, dtype=np.uint16).tofile(six)
    big = dataclasses.replace(big, data=dataclasses.replace(big.data, path=str(six)))
    with pytest.raises(ConfigError, match=r"six.bin.*not a whole number of uint32 ids.*vocabulary of 70000 ids"):
        config_task(big).open_data()
    path = tmp_path / "tokens.bin"
    floats = tmp_path / "floats.npy"
    np.save(floats, np.zeros(100, dtype=np.float32))
    with pytest.raises(ConfigError, match="floats.npy.*float32"):
        config_task(tiny_config(data__format="tokens", data__path=str(floats))).open_data()
    with pytest.raises(ConfigError, match=r"token id 300 .*vocabulary of 256"):
        np.full(1000, 300, dtype=np.uint16).tofile(path)
        config_task(tiny_config(data__format="tokens", data__path=str(path))).open_data().batch(1, 0)


# --- text, JSON lines and datasets, tokenized -------------------------------------------


def test_text_files_are_tokenized_and_packed_with_eos(tmp_path: Path, tokenizer_dir: Path, tokenizer) -> None:
    folder = tmp_path / "texts"
    folder.mkdir()
    documents = {"b.txt": "Ben has a red fox.\nEva has a dog.\n", "a.txt": "Anna has a cat."}
    for name, text in documents.items():
        (folder / name).write_text(text)
    eos = tokenizer.eos_token_id
    expected = [*tokenizer(documents["a.txt"])["input_ids"], eos, *tokenizer(documents["b.txt"])["input_ids"], eos]
    source = config_task(_config(tmp_path, tokenizer_dir, format="text", path=str(folder), block_size=4)).open_data()
    assert _stream(source).tolist() == expected and _stream(source).dtype == np.uint16
    single = config_task(
        _config(tmp_path, tokenizer_dir, format="text", path=str(folder / "b.txt"), block_size=4)
    ).open_data()
    assert _stream(single).tolist() == [*tokenizer(documents["b.txt"])["input_ids"], eos]


def test_jsonl_documents_are_the_field_of_each_line(tmp_path: Path, tokenizer_dir: Path, tokenizer) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", 20, field="body")
    texts = [json.loads(line)["body"] for line in path.read_text().splitlines()]
    source = config_task(_config(tmp_path, tokenizer_dir, format="jsonl", path=str(path), field="body")).open_data()
    expected = [i for text in texts for i in [*tokenizer(text)["input_ids"], tokenizer.eos_token_id]]
    assert _stream(source).tolist() == expected
    batch = source.batch(1, 0)
    assert batch.weight == 1.0 and not (batch.targets == IGNORE_INDEX).any()


def test_a_datasets_folder_parquet_and_arrow_give_the_jsonl_stream(tmp_path: Path, tokenizer_dir: Path) -> None:
    datasets = pytest.importorskip("datasets")
    path = write_jsonl(tmp_path / "docs.jsonl", 20)
    texts = [json.loads(line)["text"] for line in path.read_text().splitlines()]
    expected = _stream(config_task(_config(tmp_path, tokenizer_dir, format="jsonl", path=str(path))).open_data())
    table = datasets.Dataset.from_dict({"id": list(range(20)), "text": texts})
    table.save_to_disk(tmp_path / "saved")
    datasets.DatasetDict({"train": table, "test": table.select(range(2))}).save_to_disk(tmp_path / "splits")
    table.to_parquet(tmp_path / "docs.parquet")
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    for where in ("saved", "splits", "docs.parquet", arrow):
        config = _config(tmp_path, tokenizer_dir, format="hf_dataset", path=str(tmp_path / where))
        assert np.array_equal(_stream(config_task(config).open_data()), expected), where
    with pytest.raises(ConfigError, match=r"data.split 'validation' .*\['test', 'train'\]"):
        config_task(
            _config(tmp_path, tokenizer_dir, format="hf_dataset", path=str(tmp_path / "splits"), split="validation")
        ).open_data()
    with pytest.raises(ConfigError, match=r"data.field 'body' is not a column .*\['id', 'text'\]"):
        config_task(
            _config(tmp_path, tokenizer_dir, format="hf_dataset", path=str(tmp_path / "saved"), field="body")
        ).open_data()


# --- chat -------------------------------------------------------------------------------


def test_chat_counts_the_assistants_tokens_only(tmp_path: Path, tokenizer_dir: Path, tokenizer) -> None:
    path = write_chat(tmp_path / "chat.jsonl", 50)
    source = config_task(_config(tmp_path, tokenizer_dir, format="chat", path=str(path))).open_data()
    stream, counted = _stream(source), np.asarray(source.counted)
    # the counted tokens, read back, are the responses and the end of their turns
    spans = np.flatnonzero(np.diff(np.concatenate([[0], counted, [0]])))
    responses = [tokenizer.decode(stream[a:b].tolist()) for a, b in zip(spans[::2], spans[1::2])]
    expected = [
        m["content"] + EOS
        for line in path.read_text().splitlines()
        for m in json.loads(line)["messages"]
        if m["role"] == "assistant"
    ]
    assert responses == expected
    parts = [source.batch(1, rank) for rank in range(2)]
    for part in parts:
        masked = part.targets == IGNORE_INDEX
        assert masked.any() and not masked.all()
        kept = ~masked[:, :-1]  # a counted target is the next input
        assert torch.equal(part.targets[:, :-1][kept], part.inputs[:, 1:][kept])
    counts = [int((p.targets != IGNORE_INDEX).sum()) for p in parts]
    assert [p.weight for p in parts] == [c * 2 / sum(counts) for c in counts]


def test_chat_refuses_a_tokenizer_without_template_and_a_bad_line(tmp_path: Path, tokenizer_dir: Path) -> None:
    plain = make_tokenizer(tmp_path / "plain", chat_template=False)
    path = write_chat(tmp_path / "chat.jsonl", 5)
    with pytest.raises(ConfigError, match=r"data.tokenizer .*plain.* no chat template"):
        config_task(_config(tmp_path, plain, format="chat", path=str(path))).open_data()
    lines = path.read_text().splitlines()
    lines[3] = json.dumps({"messages": [{"role": "user", "content": "hi"}]})
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=r"chat.jsonl:4: the conversation has no 'assistant' message"):
        config_task(_config(tmp_path, tokenizer_dir, format="chat", path=str(path))).open_data()
    lines[3] = json.dumps({"conversation": []})
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=r"chat.jsonl:4 has no field 'messages' \(data.field\)"):
        config_task(_config(tmp_path, tokenizer_dir, format="chat", path=str(path))).open_data()


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"docs.jsonl:3 is not valid JSON"),
        ('["a list"]', r"docs.jsonl:3 holds a list, not a JSON object"),
        ('{"body": "x"}', r"docs.jsonl:3 has no field 'text' \(data.field\)"),
        ('{"text": 5}', r"docs.jsonl:3: data.field holds a int, not text"),
    ],
)
def test_a_bad_jsonl_line_is_refused_naming_file_and_line(tmp_path: Path, tokenizer_dir: Path, line, message) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", 5)
    lines = path.read_text().splitlines()
    lines[2] = line
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=message):
        config_task(_config(tmp_path, tokenizer_dir, format="jsonl", path=str(path))).open_data()


# --- the tokenization cache -------------------------------------------------------------


def test_a_second_run_reads_the_cache_and_a_change_invalidates_it(
    tmp_path: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_chat(tmp_path / "chat.jsonl", 20)
    config = _config(tmp_path, tokenizer_dir, format="chat", path=str(path))
    first = _stream(config_task(config).open_data()).copy()
    entries = list((tmp_path / "cache").iterdir())
    assert len(entries) == 1 and {p.name for p in entries[0].iterdir()} >= {"tokens.bin", "counted.bin", "meta.json"}

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized again")

    with monkeypatch.context() as patch:
        patch.setattr(tokenization, "_pieces", no_tokenizing)
        assert np.array_equal(_stream(config_task(config).open_data()), first)

    write_chat(path, 21)  # new content: a new entry
    assert len(_stream(config_task(config).open_data())) > len(first)
    tokenizer_copy = shutil.copytree(tokenizer_dir, tmp_path / "tokenizer-copy")
    assert np.array_equal(
        _stream(config_task(_config(tmp_path, tokenizer_copy, format="chat", path=str(path))).open_data()),
        _stream(config_task(config).open_data()),
    )  # same files elsewhere: the same entry
    template = tokenizer_copy / "chat_template.jinja"
    template.write_text(template.read_text().replace("<|end|>", "<|end|>\n"))
    changed = _stream(config_task(_config(tmp_path, tokenizer_copy, format="chat", path=str(path))).open_data())
    assert len(changed) > len(_stream(config_task(config).open_data()))
    assert len(list((tmp_path / "cache").iterdir())) == 3

    entry = next(
        e for e in (tmp_path / "cache").iterdir() if json.loads((e / "meta.json").read_text())["tokens"] == len(first)
    )
    (entry / "meta.json").unlink()  # as a crash before the entry was complete leaves it
    write_chat(path, 20)
    assert np.array_equal(_stream(config_task(config).open_data()), first) and (entry / "meta.json").is_file()


# --- the model's own vocabulary and context ---------------------------------------------


def test_an_hf_models_folder_gives_the_tokenizer_vocabulary_and_context(tmp_path: Path, llama_dir: Path) -> None:
    path = write_chat(tmp_path / "chat.jsonl", 20)
    data = {"format": "chat", "path": str(path), "cache_dir": str(tmp_path / "cache")}
    config = tiny_config(hf__config_path=str(llama_dir), **{f"data__{k}": v for k, v in data.items()})
    assert sequence_length(model_spec(config), config.data) == 32  # max_position_embeddings
    batch = config_task(config).open_data().batch(1, 0)
    assert batch.inputs.shape == (4, 32) and int(batch.inputs.max()) < VOCAB
    sized = tiny_config(hf__config_path=str(llama_dir), data__block_size=16)
    assert sequence_length(model_spec(sized), sized.data) == 16
    plain, short = tiny_config(), tiny_config(data__block_size=8)
    assert sequence_length(model_spec(plain), plain.data) == 32 and sequence_length(model_spec(short), short.data) == 8
    with pytest.raises(ConfigError, match=r"data.block_size \(33\) exceeds max_position_embeddings \(32\)"):
        config_task(tiny_config(hf__config_path=str(llama_dir), data__block_size=33)).open_data()
    with pytest.raises(ConfigError, match=r"data.block_size \(33\) exceeds model.block_size \(32\)"):
        config_task(tiny_config(data__block_size=33)).open_data()
    small = tiny_llama(tmp_path / "small", 300)
    with pytest.raises(ConfigError, match=r"data.tokenizer .* 3\d\d ids, more than the model's vocabulary of 300"):
        config_task(
            tiny_config(
                hf__config_path=str(small), data__tokenizer=str(llama_dir), **{f"data__{k}": v for k, v in data.items()}
            )
        ).open_data()
    with pytest.raises(ConfigError, match=r"hf.config_path .*small.* holds no tokenizer files"):
        config_task(tiny_config(hf__config_path=str(small), **{f"data__{k}": v for k, v in data.items()})).open_data()
    with pytest.raises(ConfigError, match=r"set data.tokenizer"):
        config_task(tiny_config(**{f"data__{k}": v for k, v in data.items()})).open_data()


# --- configuration ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.format=text"], "data.path must name the data to read with data.format=text"),
        (
            ["data.format=jsonl", "data.path=/nonexistent/docs.jsonl"],
            "data.path '/nonexistent/docs.jsonl' does not exist",
        ),
        (["data.format=bogus"], "data.format must be one of"),
        (["data.path=/nonexistent/corpus.txt"], "data.path '/nonexistent/corpus.txt' does not exist"),
        (["data.corpus_path=/tmp/x"], "unknown config key 'data.corpus_path': set data.path (with data.format: bytes"),
        (["data.block_size=0"], "data.block_size must be"),
        (["data.tokenizer=/nonexistent"], "data.tokenizer '/nonexistent' is not a folder"),
        (
            ["data.token_dtype=uint32"],
            "unknown config key 'data.token_dtype': no key sets it: a .bin token file holds uint16 ids when the "
            "model's vocabulary has at most 65,536 ids, uint32 ids otherwise",
        ),
    ],
)
def test_data_keys_are_checked_when_the_config_loads(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, overrides)


def test_with_bytes_data_path_is_the_text_file_to_train_on(tmp_path: Path) -> None:
    """data.format=bytes reads data.path's bytes (up to data.corpus_bytes); null generates
    the built-in corpus."""
    text = tmp_path / "corpus.txt"
    text.write_bytes(bytes(range(256)) * 4)
    config = load_config(None, [f"data.path={text}", "data.corpus_bytes=600"])
    assert config.data.format == "bytes" and config.data.path == str(text)
    read = config_task(tiny_config(data__path=str(text), data__corpus_bytes=600)).open_data()
    assert bytes(read.tokens.tolist()) == (bytes(range(256)) * 4)[:600]
    generated = config_task(tiny_config(data__corpus_bytes=600)).open_data()
    assert bytes(generated.tokens.tolist()) == generate_corpus(600, seed=generated.seed)
    text.write_bytes(b"")
    with pytest.raises(ConfigError, match=re.escape(f"data.path {str(text)!r} is empty")):
        config_task(tiny_config(data__path=str(text))).open_data()


def test_cargohold_train_exits_2_on_bad_data_before_starting_anything(
    tmp_path: Path, tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", 5)
    path.write_text(path.read_text() + '{"title": "no text"}\n')
    args = [
        "train",
        "--set",
        "data.format=jsonl",
        "--set",
        f"data.path={path}",
        "--set",
        f"data.tokenizer={tokenizer_dir}",
    ]
    assert cli.main([*args, "--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", "model.vocab_size=384"]) == 2
    assert re.search(r"docs.jsonl:6 has no field 'text'", capsys.readouterr().err)


@pytest.mark.parametrize(
    ("form", "content"),
    [("text", ""), ("jsonl", ""), ("chat", ""), ("jsonl", "\n  \n\n"), ("chat", "\n\n")],
    ids=["text", "jsonl", "chat", "jsonl-blank-lines", "chat-blank-lines"],
)
def test_an_empty_training_file_is_refused_naming_the_key_and_the_file(
    tmp_path: Path, tokenizer_dir: Path, capsys: pytest.CaptureFixture[str], form: str, content: str
) -> None:
    path = tmp_path / f"empty.{'txt' if form == 'text' else 'jsonl'}"
    path.write_text(content)
    args = ["train", "--set", f"data.format={form}", "--set", f"data.path={path}"]
    args += ["--set", f"data.tokenizer={tokenizer_dir}", "--set", f"data.cache_dir={tmp_path / 'cache'}"]
    if form == "chat":
        pytest.importorskip("jinja2")
    code = cli.main([*args, "--set", "model.vocab_size=384"])
    err = capsys.readouterr().err
    assert code == 2, err
    # An empty text file is one empty document: its EOS alone.
    held = r"1 tokens" if form == "text" else r"0 tokens \(it is empty, or every record was skipped\)"
    assert re.search(rf"data.path '{re.escape(str(path))}'.* holds {held}, fewer than one sequence", err), err
