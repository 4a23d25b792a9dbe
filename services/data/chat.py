"""Instruction / chat examples: a conversation rendered with the tokenizer's chat template,
and which of its tokens the loss counts (the assistant's responses; the prompt is masked).

The template is rendered as text, once for the whole conversation and once for each
prefix: before assistant turn i with the generation prompt (the prompt it answers) and
through turn i (prompt and response). Turn i's response is the text between the two, and
the tokens of the whole conversation that overlap such a span are counted, by their
character offsets. This works with any template whose rendering of a prefix is a prefix
of the whole (a template that rewrites earlier turns is refused, naming the line).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from cargohold.services.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Messages = list[dict[str, Any]]
Render = Callable[[Messages, bool], str]
"""The template's text of some messages, with or without the generation prompt."""
RESPONSE_ROLE = "assistant"


def conversation(value: object, where: str) -> Messages:
    """``value`` checked as a conversation: a list of messages, each a mapping with a string
    ``role`` and ``content``, at least one of them the assistant's."""
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: a conversation is a non-empty list of messages, got {type(value).__name__}")
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


def render_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: Messages, where: str
) -> tuple[list[int], list[bool]]:
    """The conversation's token ids and which of them the loss counts."""

    def render(part: Messages, generation_prompt: bool) -> str:
        if not part:
            return ""
        text = tokenizer.apply_chat_template(part, tokenize=False, add_generation_prompt=generation_prompt)
        assert isinstance(text, str), "tokenize=False renders text"
        return text

    text, spans = response_spans(render, messages, where)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(encoded["input_ids"]), counted_tokens(encoded["offset_mapping"], spans)
