"""Bad data found from outside (issue 40), refused by name before anything trains: a token
file with ids beyond the model's vocabulary, a conversation longer than a sequence under
``data.overlong: error``, a chat record too large or of too many turns to render, a chat
template that loops or trips Jinja's sandbox, and an edited or truncated tokenization
cache entry (named in a warning and rebuilt, never trained on)."""

from __future__ import annotations

import json
import logging
import pickle
import re
import shutil
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

from data_fixtures import CHAT_TEMPLATE, make_tokenizer, write_chat  # noqa: E402
from reference import tiny_config  # noqa: E402

from cargohold.cluster import cli  # noqa: E402
from cargohold.cluster.sections import config_task  # noqa: E402
from cargohold.services.core.errors import ConfigError  # noqa: E402
from cargohold.services.data import chat  # noqa: E402

VOCAB = 384


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def _config(tmp_path: Path, tokenizer_dir: Path, **data):
    """The built-in GPT (its vocabulary fits the tokenizer, its context 64) on ``data``; 2
    ranks of 2 rows."""
    data = {"tokenizer": str(tokenizer_dir), "cache_dir": str(tmp_path / "cache"), "block_size": 16, **data}
    return tiny_config(
        model__vocab_size=VOCAB,
        model__block_size=64,
        data__batch_size=2,
        **{f"data__{k}": v for k, v in data.items()},
    )


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
        config_task(tiny_config(data__format="tokens", data__path=str(path))).open_data()


def test_a_negative_token_id_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "tokens.npy"
    ids = np.arange(5_000, dtype=np.int32) % 256
    ids[4_000] = -1
    np.save(path, ids)
    with pytest.raises(ConfigError, match=r"token id -1 at position 4000, outside the model's vocabulary of 256"):
        config_task(tiny_config(data__format="tokens", data__path=str(path))).open_data()


def test_workers_given_the_launchers_task_read_only_their_batches_each_checked(tmp_path: Path) -> None:
    """The launcher reads a token file whole once; the task it pickles to the workers
    says so, and a worker then checks the ids of the batches it reads (a file changed
    in between is still refused, naming the block)."""
    path = tmp_path / "tokens.bin"
    (np.arange(10_000) % 256).astype(np.uint16).tofile(path)
    config = tiny_config(data__format="tokens", data__path=str(path))
    launcher = config_task(config)
    launcher.open_data()
    np.full(10_000, 300, dtype=np.uint16).tofile(path)  # changed after the launcher's check
    with pytest.raises(ConfigError, match="position 0"):
        config_task(config).open_data()  # a fresh task reads it whole
    worker = pickle.loads(pickle.dumps(launcher)).open_data()
    with pytest.raises(ConfigError, match=r"token id 300 \(in block \d+\), outside the model's vocabulary"):
        worker.batch(1, 0)


# --- row 14: data.overlong=error --------------------------------------------------------


def _long_conversation(turns: int) -> dict:
    """A conversation far longer than a sequence of 17 tokens."""
    messages = [
        {"role": role, "content": "Anna has a red cat. What colour is the cat?"}
        for _ in range(turns)
        for role in ("user", "assistant")
    ]
    return {"messages": messages}


def test_overlong_error_exits_2_before_ray_naming_the_first_offenders_by_file_and_line(
    tmp_path: Path, tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_chat(tmp_path / "chat.jsonl", 40)  # short conversations: each fits a sequence of 64
    lines = path.read_text().splitlines()
    for number in (3, 9, 10, 12, 20, 25, 31):  # 1-based lines made too long
        lines[number - 1] = json.dumps(_long_conversation(number % 3 + 5))
    lines.insert(4, "")  # a blank line is skipped, and the line numbers after it still count it
    path.write_text("\n".join(lines) + "\n")
    args = [f"data.tokenizer={tokenizer_dir}", f"data.cache_dir={tmp_path / 'cache'}", "model.vocab_size=384"]
    args += ["model.block_size=64"]
    args += ["data.format=chat", f"data.path={path}", "data.block_size=63", "data.overlong=error"]
    code, err = _train(args, capsys)
    assert code == 2, err
    named = re.findall(rf"{re.escape(str(path))}:(\d+) \((\d+) tokens\)", err)
    assert [int(line) for line, _ in named] == [3, 10, 11, 13, 21], err  # the first five, after the blank line
    assert all(int(tokens) > 64 for _, tokens in named), err
    assert "7 of 40 documents are longer than a sequence of data.block_size + 1 = 64 tokens" in err, err
    assert "and 2 more" in err and "data.overlong to truncate, drop or split" in err, err
    dropped = _config(tmp_path, tokenizer_dir, format="chat", path=str(path), block_size=63, overlong="drop")
    assert config_task(dropped).open_data().summary()["dropped"] == 7  # what the message offers opens the same data


def test_overlong_error_names_held_out_files_and_text_files(tmp_path: Path, tokenizer_dir: Path) -> None:
    train = write_chat(tmp_path / "train.jsonl", 40)
    held_out = write_chat(tmp_path / "held_out.jsonl", 40, seed=1)
    held_out.write_text(held_out.read_text() + json.dumps(_long_conversation(3)) + "\n")
    config = _config(tmp_path, tokenizer_dir, format="chat", path=str(train), overlong="error", block_size=63)
    config.eval.path = str(held_out)
    config_task(config).open_data()  # the training file fits
    with pytest.raises(ConfigError, match=rf"eval.path .*: 1 of 41 documents .*{re.escape(str(held_out))}:41 \("):
        config_task(config).open_eval()
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("Anna has a cat.")
    (folder / "b.txt").write_text("Ben has a red fox. " * 40)
    texts = _config(tmp_path, tokenizer_dir, format="text", path=str(folder), packing="documents", overlong="error")
    with pytest.raises(ConfigError, match=rf"1 of 2 documents .*: {re.escape(str(folder / 'b.txt'))} \(\d+ tokens\)"):
        config_task(texts).open_data()


# --- row 7: a chat record's size and turns, bounded before rendering ----------------------


def _chat_file(path: Path, records: dict[int, str], count: int = 6) -> Path:
    """``count`` conversations of the fixture's grammar, line n replaced by ``records[n]``."""
    lines = write_chat(path, count).read_text().splitlines()
    for number, line in records.items():
        lines[number - 1] = line
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_chat_record_too_large_to_tokenize_is_refused_naming_file_and_line(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    content = "Anna has a red cat. " * (chat.MAX_CONVERSATION_CHARS // 20)
    huge = json.dumps({"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "Red."}]})
    path = _chat_file(tmp_path / "chat.jsonl", {3: huge})
    bound = f"{chat.MAX_CONVERSATION_CHARS:,}"
    with pytest.raises(ConfigError, match=rf"{re.escape(str(path))}:3 holds [\d,]+ characters, more than the {bound}"):
        config_task(_config(tmp_path, tokenizer_dir, format="chat", path=str(path))).open_data()


def test_a_conversation_of_too_many_turns_is_refused_naming_file_and_line(tmp_path: Path, tokenizer_dir: Path) -> None:
    many = _long_conversation(chat.MAX_TURNS // 2 + 1)  # one pair past the bound, 37 KB
    path = _chat_file(tmp_path / "chat.jsonl", {2: json.dumps(many)})
    message = rf"{re.escape(str(path))}:2: the conversation has {chat.MAX_TURNS + 2} messages, more than the"
    with pytest.raises(ConfigError, match=message):
        config_task(_config(tmp_path, tokenizer_dir, format="chat", path=str(path))).open_data()


def test_a_million_turns_exit_2_before_ray_in_seconds(
    tmp_path: Path, tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    turn = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
    million = json.dumps({"messages": turn * (10**6 // 2)})
    path = _chat_file(tmp_path / "chat.jsonl", {4: million})
    args = [f"data.tokenizer={tokenizer_dir}", f"data.cache_dir={tmp_path / 'cache'}", "model.vocab_size=384"]
    started = time.monotonic()
    code, err = _train([*args, "data.format=chat", f"data.path={path}"], capsys)
    assert code == 2 and re.search(rf"{re.escape(str(path))}:4 holds [\d,]+ characters, more than", err), err
    assert time.monotonic() - started < 20  # it ran past 90 s


# --- row 8: the chat template is the folder's code: bounded in time, its errors named --------

LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
"""A template that renders for hours (10**10 iterations; the sandbox allows ranges of 10**5)."""


def _with_template(tmp_path: Path, tokenizer_dir: Path, template: str) -> Path:
    """A copy of the tokenizer whose chat template is ``template``."""
    folder = Path(shutil.copytree(tokenizer_dir, tmp_path / "tokenizer"))
    (folder / "chat_template.jinja").write_text(template)
    return folder


def test_a_chat_template_that_loops_is_refused_at_its_deadline(
    tmp_path: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(chat, "RENDER_SECONDS", 1.0)
    folder = _with_template(tmp_path, tokenizer_dir, LOOPS + CHAT_TEMPLATE)
    path = write_chat(tmp_path / "chat.jsonl", 4)
    before = signal.getitimer(signal.ITIMER_REAL)[0]  # pytest-timeout's alarm
    started = time.monotonic()
    message = rf"{re.escape(str(path))}:1: the chat template in data.tokenizer '{re.escape(str(folder))}' "
    with pytest.raises(ConfigError, match=message + r"\(chat_template.jinja\) took more than 1 s"):
        config_task(_config(tmp_path, folder, format="chat", path=str(path))).open_data()
    assert time.monotonic() - started < 10
    assert signal.getitimer(signal.ITIMER_REAL)[0] == pytest.approx(before, abs=15)  # armed again, time left
    assert signal.getsignal(signal.SIGALRM) is not None


def test_outside_the_main_thread_a_slow_template_is_refused_after_rendering(
    tmp_path: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(chat, "RENDER_SECONDS", 0.05)
    slow = "{% for i in range(300) %}{% for j in range(10000) %}{% endfor %}{% endfor %}"  # ~0.2-2 s a render
    folder = _with_template(tmp_path, tokenizer_dir, slow + CHAT_TEMPLATE)
    path = write_chat(tmp_path / "chat.jsonl", 4)
    errors: list[BaseException] = []

    def opening() -> None:
        try:
            config_task(_config(tmp_path, folder, format="chat", path=str(path))).open_data()
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=opening)
    thread.start()
    thread.join(timeout=60)
    assert len(errors) == 1 and isinstance(errors[0], ConfigError), errors
    assert re.search(r"chat.jsonl:1: the chat template .* took more than 0.05 s", str(errors[0]))


@pytest.mark.slow
def test_a_chat_template_that_loops_exits_2_before_ray_at_the_real_deadline(
    tmp_path: Path, tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _with_template(tmp_path, tokenizer_dir, LOOPS + CHAT_TEMPLATE)
    path = write_chat(tmp_path / "chat.jsonl", 4)
    started = time.monotonic()
    args = [f"data.tokenizer={folder}", f"data.cache_dir={tmp_path / 'cache'}", "model.vocab_size=384"]
    code, err = _train([*args, "data.format=chat", f"data.path={path}"], capsys)
    assert code == 2 and f"took more than {chat.RENDER_SECONDS:g} s" in err, err
    assert time.monotonic() - started < chat.RENDER_SECONDS + 30


@pytest.mark.parametrize(
    ("template", "raised"),
    [
        ("{{ messages.__class__.__mro__[1].__subclasses__() }}", "SecurityError: access to attribute '__class__'"),
        ("{% for i in range(10**6) %}{% endfor %}", "OverflowError: Range too big"),
        ("{{ raise_exception('no system messages') }}", "TemplateError: no system messages"),
        ("{% for m in messages %}", "TemplateSyntaxError: Unexpected end of template"),
    ],
    ids=["unsafe-attribute", "range", "raise_exception", "syntax"],
)
def test_a_template_that_trips_the_sandbox_exits_2_naming_template_and_line(
    tmp_path: Path, tokenizer_dir: Path, capsys: pytest.CaptureFixture[str], template: str, raised: str
) -> None:
    folder = _with_template(tmp_path, tokenizer_dir, template + CHAT_TEMPLATE)
    path = write_chat(tmp_path / "chat.jsonl", 4)
    args = [f"data.tokenizer={folder}", f"data.cache_dir={tmp_path / 'cache'}", "model.vocab_size=384"]
    code, err = _train([*args, "data.format=chat", f"data.path={path}"], capsys)
    assert code == 2, err
    named = f"{path}:1: the chat template in data.tokenizer {str(folder)!r} (chat_template.jinja) failed rendering"
    assert named in err and raised in err, err


# --- row 9: the tokenization cache, verified as it is read -----------------------------

CACHE_LOGGER = "cargohold.services.data.cache"


def _edit(entry: Path, name: str, how: str) -> None:
    """Damage file ``name`` of cache entry ``entry`` as ``how`` says, keeping its size
    unless told to truncate it."""
    path = entry / name
    if how == "truncate":
        path.write_bytes(path.read_bytes()[:-3])
        return
    if name == "meta.json":
        meta = json.loads(path.read_text())
        meta["counted"] = False  # every token counted, the prompts too
        path.write_text(json.dumps(meta))
        return
    dtype = {"tokens.bin": np.uint16, "counted.bin": np.uint8, "ends.bin": np.uint64}[name]
    values = np.fromfile(path, dtype=dtype)
    if how == "id beyond the vocabulary":
        values[5] = 60_000
    elif how == "reversed":
        values = values[::-1].copy()
    elif how == "all counted":
        values[:] = 1
    values.tofile(path)


@pytest.mark.parametrize(
    ("name", "how", "reason"),
    [
        ("tokens.bin", "id beyond the vocabulary", "tokens.bin does not match its checksum"),
        ("ends.bin", "reversed", "ends.bin does not match its checksum"),
        ("counted.bin", "all counted", "counted.bin does not match its checksum"),
        ("tokens.bin", "truncate", r"tokens.bin is \d+ bytes, meta.json records \d+ \(truncated\?\)"),
        ("meta.json", "counted", "meta.json does not match its checksum"),
        ("meta.json", "truncate", r"meta.json is not an entry's description \(JSONDecodeError"),
    ],
)
def test_a_damaged_cache_entry_is_named_in_a_warning_and_rebuilt(
    tmp_path: Path, tokenizer_dir: Path, caplog: pytest.LogCaptureFixture, name: str, how: str, reason: str
) -> None:
    path = write_chat(tmp_path / "chat.jsonl", 30)
    config = _config(tmp_path, tokenizer_dir, format="chat", path=str(path))
    first = config_task(config).open_data()
    tokens, counted = np.array(first.tokens), np.array(first.counted)
    (entry,) = (tmp_path / "cache").iterdir()
    _edit(entry, name, how)
    with caplog.at_level(logging.WARNING, logger=CACHE_LOGGER):
        again = config_task(config).open_data()
    warned = [r.getMessage() for r in caplog.records if r.name == CACHE_LOGGER]
    assert len(warned) == 1 and re.search(rf"entry {re.escape(str(entry))} is damaged \({reason}", warned[0]), warned
    assert np.array_equal(again.tokens, tokens) and np.array_equal(again.counted, counted)  # tokenized again
    caplog.clear()
    assert np.array_equal(config_task(config).open_data().tokens, tokens)
    assert not [r for r in caplog.records if r.name == CACHE_LOGGER]  # the rebuilt entry holds


def test_a_cache_entry_whose_checksums_were_recomputed_still_needs_ordered_document_ends(
    tmp_path: Path, tokenizer_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Ends out of order would place documents across each other; checked apart from the
    checksums, which whoever edits an entry may write too."""
    from cargohold.services.data import cache

    path = write_chat(tmp_path / "chat.jsonl", 30)
    config = _config(tmp_path, tokenizer_dir, format="chat", path=str(path))
    tokens = np.array(config_task(config).open_data().tokens)
    (entry,) = (tmp_path / "cache").iterdir()
    _edit(entry, "ends.bin", "reversed")
    meta = json.loads((entry / "meta.json").read_text())
    ends = bytearray((entry / "ends.bin").read_bytes())
    meta["files"]["ends.bin"]["crc32c"] = cache.crc32c(memoryview(ends))
    del meta["checksum"]
    meta["checksum"] = cache._checksum(meta)
    (entry / "meta.json").write_text(json.dumps(meta))
    with caplog.at_level(logging.WARNING, logger=CACHE_LOGGER):
        assert np.array_equal(config_task(config).open_data().tokens, tokens)
    assert any("document ends are not increasing" in r.getMessage() for r in caplog.records), caplog.records
