"""Instruction / chat examples: a conversation rendered with the tokenizer's chat template,
and which of its tokens the loss counts (the assistant's responses; the prompt is masked).

The template is rendered as text, once for the whole conversation and once for each
prefix: before assistant turn i with the generation prompt (the prompt it answers) and
through turn i (prompt and response). Turn i's response is the text between the two, and
the tokens of the whole conversation that overlap such a span are counted, by their
character offsets. This works with any template whose rendering of a prefix is a prefix
of the whole (a template that rewrites earlier turns is refused, naming the line).

The template is code from the model's folder, run in Jinja's sandbox: what it raises, and
a rendering that outlasts :data:`RENDER_SECONDS`, refuse the data naming the template and
the line; a conversation is bounded (:data:`MAX_CONVERSATION_CHARS`, :data:`MAX_TURNS`)
before it is rendered.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cargohold.services.core.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Messages = list[dict[str, Any]]
Render = Callable[[Messages, bool], str]
"""The template's text of some messages, with or without the generation prompt."""
RESPONSE_ROLE = "assistant"

MAX_CONVERSATION_CHARS = 4 << 20
"""Characters a chat record (its JSON line) may hold: 4 Mi, about a million tokens, more
than any model's context (such a conversation could only be truncated or split). The
fast tokenizer holds some 170 bytes a character while it encodes with offsets (measured:
0.7 GB over the process's own for 4 MB), so one record of 200 MB aborted the process
(SIGABRT) with no message."""
MAX_TURNS = 1024
"""Messages a conversation may hold. Each assistant turn renders the template over the
turns before it, so rendering grows with the square of the turns: 1024 render in about
4 s with a short template (measured on a shared 2-core machine), 10**6 would take days."""
RENDER_SECONDS = 30.0
"""How long rendering one conversation (every prefix together) may take: several times
what a conversation at the bounds above takes, and a template that loops (the model
folder's code) is refused after this long instead of stalling the check before the run."""
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")
"""Where a tokenizer folder keeps its chat template, in the order transformers reads them."""


def conversation(value: object, where: str) -> Messages:
    """``value`` checked as a conversation: a list of messages, each a mapping with a string
    ``role`` and ``content``, at least one of them the assistant's."""
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: a conversation is a non-empty list of messages, got {type(value).__name__}")
    if len(value) > MAX_TURNS:
        raise ConfigError(
            f"{where}: the conversation has {len(value)} messages, more than the {MAX_TURNS} one may hold "
            "(rendering it grows with the square of its turns); split it into shorter conversations"
        )
    for index, message in enumerate(value):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise ConfigError(f"{where}: message {index} is not an object with string 'role' and 'content'")
    if not any(message["role"] == RESPONSE_ROLE for message in value):
        raise ConfigError(f"{where}: the conversation has no {RESPONSE_ROLE!r} message, so nothing to learn")
    return value


def response_spans(render: Render, messages: Messages, where: str) -> tuple[str, list[tuple[int, int]]]:
    """The text of the whole conversation and the character spans of its responses."""
    text = render(messages, False)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != RESPONSE_ROLE:
            continue
        prompt, through = render(messages[:index], True), render(messages[: index + 1], False)
        if not (through.startswith(prompt) and text.startswith(through)):
            raise ConfigError(
                f"{where}: the chat template renders turn {index} differently within the whole conversation, "
                "so its response cannot be told from its prompt"
            )
        spans.append((len(prompt), len(through)))
    return text, spans


def counted_tokens(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[bool]:
    """For each token's character span ``[start, end)``: whether it overlaps a response span."""
    counted = []
    for start, end in offsets:
        counted.append(any(start < stop and end > begin for begin, stop in spans))
    return counted


def check_chat_tokenizer(tokenizer: PreTrainedTokenizerBase, key: str, folder: str) -> None:
    """Chat data needs a template and a fast tokenizer (which reports character offsets)."""
    if not tokenizer.chat_template:
        raise ConfigError(
            f"the tokenizer at {key} {folder!r} has no chat template, which data.format=chat renders conversations with"
        )
    if not tokenizer.is_fast:
        raise ConfigError(f"the tokenizer at {key} {folder!r} is not a fast tokenizer (data.format=chat needs offsets)")


def template_source(folder: Path, key: str) -> str:
    """The chat template of the tokenizer in ``folder`` (named by config key ``key``), by
    its file, for messages."""
    name = next((name for name in TEMPLATE_FILES if (folder / name).is_file()), TEMPLATE_FILES[-1])
    return f"the chat template in {key} {str(folder)!r} ({name})"


def render_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: Messages, where: str, template: str = "the chat template"
) -> tuple[list[int], list[bool]]:
    """The conversation's token ids and which of them the loss counts. ``template`` names
    the template (:func:`template_source`) when it fails or outlasts :data:`RENDER_SECONDS`."""

    def render(part: Messages, generation_prompt: bool) -> str:
        if not part:
            return ""
        try:
            text = tokenizer.apply_chat_template(part, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as error:  # the template is the folder's code: whatever it raises is bad input
            raise ConfigError(
                f"{where}: {template} failed rendering the conversation: {type(error).__name__}: {error}"
            ) from error
        assert isinstance(text, str), "tokenize=False renders text"
        return text

    started = time.monotonic()
    try:
        with _deadline(RENDER_SECONDS):
            text, spans = response_spans(render, messages, where)
        expired = time.monotonic() - started > RENDER_SECONDS  # outside the main thread: checked after
    except _Expired:
        expired = True
    if expired:
        raise ConfigError(
            f"{where}: {template} took more than {RENDER_SECONDS:g} s to render the conversation "
            f"({len(messages)} messages): does it loop?"
        )
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(encoded["input_ids"]), counted_tokens(encoded["offset_mapping"], spans)


class _Expired(BaseException):
    """Raised into a rendering that outlasted its deadline; a BaseException, so that no
    ``except Exception`` on the way (Jinja's, the template's caller's) swallows it."""


@contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Interrupt the block with :class:`_Expired` after ``seconds``: by SIGALRM, which only
    the main thread can handle, unless an alarm set before (pytest-timeout's) fires first;
    that alarm is armed again with the time it had left. In another thread nothing
    interrupts the block, and the caller checks the time it took."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    earlier, interval = signal.getitimer(signal.ITIMER_REAL)
    if earlier and earlier <= seconds:
        yield
        return

    def expire(signum: int, frame: object) -> None:
        raise _Expired

    started = time.monotonic()
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)
        finally:  # the alarm fires once: if it fired just now, this still runs
            signal.signal(signal.SIGALRM, previous if previous is not None else signal.SIG_DFL)
            if earlier:
                signal.setitimer(signal.ITIMER_REAL, max(earlier - (time.monotonic() - started), 1e-3), interval)
