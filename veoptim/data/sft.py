"""SFT examples: render with the tokenizer's chat template, label only the assistant turns.

Each conversation is rendered once with ``tokenizer.apply_chat_template`` and
tokenized with character offsets. The trained span of assistant message ``j`` is
the text between the render of ``messages[:j]`` plus the generation prompt and
the render of ``messages[:j+1]``: the response and the template's end-of-turn
tokens after it (``<|end|>`` for the bundled tokenizer, which is its EOS). A
token is labelled when its first character lies in a trained span, so every
assistant turn of a multi-turn chat is trained and everything else is -100.
This works for any chat template whose renders of growing prefixes are prefixes
of each other; one that is not (e.g. it rewrites earlier turns) is rejected.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from veoptim.data.chat_format import ROLE_ASSISTANT
from veoptim.data.fields import IGNORE_INDEX, INPUT_IDS, LABELS
from veoptim.data.packing import Example, pack_examples
from veoptim.data.paths import bundled_dataset_path
from veoptim.data.records import Conversation, Message, read_conversations
from veoptim.errors import DataError

log = logging.getLogger(__name__)

#: Above this share of truncated examples the startup report is a warning.
TRUNCATION_WARN_SHARE = 0.05


@dataclass(frozen=True)
class Truncation:
    """What ``data.max_seq_len`` cut off, reported at startup: silent truncation trains on
    partial answers, and a length that cuts every response trains on nothing."""

    num_truncated: int = 0
    #: Examples whose every trained (response) token lies beyond max_seq_len.
    num_without_response: int = 0
    #: Tokens of the longest example before truncation.
    longest: int = 0
    #: The shortest max_seq_len that keeps a response token of at least one example.
    min_len_with_response: int = 0


def _render(
    tokenizer: PreTrainedTokenizerBase, messages: list[Message], generation_prompt: bool
) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )


def trained_spans(
    tokenizer: PreTrainedTokenizerBase,
    conversation: Conversation,
    where: str,
    last_turn_only: bool = False,
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the ``[start, end)`` character spans of its assistant turns
    (only the final one with ``last_turn_only``: a preference pair's response)."""
    messages = conversation.messages
    try:
        text = _render(tokenizer, messages, generation_prompt=False)
        spans = []
        for j, message in enumerate(messages):
            if message["role"] != ROLE_ASSISTANT or (last_turn_only and j < len(messages) - 1):
                continue
            before = _render(tokenizer, messages[:j], generation_prompt=True)
            through = _render(tokenizer, messages[: j + 1], generation_prompt=False)
            if not (text.startswith(through) and through.startswith(before)):
                raise DataError(
                    f"{where}: the tokenizer's chat template is not prefix-stable (rendering "
                    f"messages[:{j + 1}] is not a prefix of the whole conversation), so the "
                    "assistant turns cannot be located; use a template that renders turns in order."
                )
            spans.append((len(before), len(through)))
    except DataError:
        raise
    except Exception as error:  # jinja raises its own types (raise_exception, undefined, ...)
        raise DataError(
            f"{where}: the tokenizer's chat template failed on this example: {error}"
        ) from error
    return text, spans


def _label(
    input_ids: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]]
) -> list[int]:
    labels = [IGNORE_INDEX] * len(input_ids)
    span_iter = iter(spans)
    span = next(span_iter, None)
    for k, (start, _) in enumerate(offsets):
        while span is not None and start >= span[1]:
            span = next(span_iter, None)
        if span is not None and span[0] <= start:
            labels[k] = input_ids[k]
    return labels


def tokenize_conversations(
    conversations: list[Conversation],
    tokenizer: PreTrainedTokenizerBase,
    max_seq_len: int,
    path: Path,
    last_turn_only: bool = False,
) -> tuple[list[Example], Truncation]:
    """``input_ids`` and ``labels`` (-100 outside assistant turns, or outside the final one
    with ``last_turn_only``), truncated to ``max_seq_len``.

    Returns the examples and what truncation cut off.
    """
    rendered = [
        trained_spans(tokenizer, c, f"{path}:{c.line}", last_turn_only) for c in conversations
    ]
    encoded = tokenizer(
        [text for text, _ in rendered], add_special_tokens=False, return_offsets_mapping=True
    )
    examples = []
    num_truncated = without_response = longest = 0
    needed = None  # the fewest tokens that keep a trained token (positions >= 1 carry loss)
    for (_, spans), ids, offsets in zip(
        rendered, encoded[INPUT_IDS], encoded["offset_mapping"], strict=True
    ):
        labels = _label(ids, offsets, spans)
        num_truncated += len(ids) > max_seq_len
        longest = max(longest, len(ids))
        first = next((k for k in range(1, len(labels)) if labels[k] != IGNORE_INDEX), None)
        without_response += first is None or first >= max_seq_len
        if first is not None:
            needed = first + 1 if needed is None else min(needed, first + 1)
        examples.append(
            {
                INPUT_IDS: torch.tensor(ids[:max_seq_len], dtype=torch.long),
                LABELS: torch.tensor(labels[:max_seq_len], dtype=torch.long),
            }
        )
    return examples, Truncation(num_truncated, without_response, longest, needed or 0)


def report_truncation(
    truncation: Truncation, num_examples: int, max_seq_len: int, path: Path
) -> None:
    """Log how many examples ``max_seq_len`` truncated (a warning above 5 %, or when some
    lose their whole response); ``DataError`` when no example keeps a response token."""
    if truncation.num_without_response == num_examples:
        need = truncation.min_len_with_response
        if not need or need <= max_seq_len:  # no response at all, whatever the length
            raise DataError(f"no example of {path} has a response token to train on.")
        raise DataError(
            f"data.max_seq_len={max_seq_len} is too short to hold any response of {path}: all "
            f"{num_examples} examples are cut before their first response token, so nothing "
            f"would be trained; expected data.max_seq_len >= {need} (the shortest prompt plus "
            f"one response token), ideally >= {truncation.longest} (the longest example)."
        )
    share = truncation.num_truncated / num_examples
    summary = (
        f"{truncation.num_truncated} of {num_examples} examples ({share:.1%}) in {path} are "
        f"longer than data.max_seq_len={max_seq_len} and were truncated "
        f"(longest: {truncation.longest} tokens)"
    )
    if truncation.num_without_response:
        summary += (
            f"; {truncation.num_without_response} of them keep no response token and train nothing"
        )
    if share > TRUNCATION_WARN_SHARE or truncation.num_without_response:
        log.warning("%s; raise data.max_seq_len to train on whole examples.", summary)
    else:
        log.info("%s.", summary)


@dataclass
class SFTDataset:
    """Tokenized (optionally packed) SFT examples; ``dataset[i]`` is a dict of 1-D long tensors.

    Without packing an item has ``input_ids`` and ``labels``; with packing each item
    is exactly ``max_seq_len`` long and also has ``position_ids`` that restart at 0
    for every example in it (see :mod:`veoptim.data.packing`).
    """

    path: Path
    max_seq_len: int
    packing: bool
    items: list[Example]
    num_examples: int
    num_truncated: int
    truncation: Truncation = Truncation()

    def __len__(self) -> int:
        return len(self.items)

    @cached_property
    def fingerprint(self) -> str:
        """SHA-256 of every item's tensors in order: what a sampler position refers to.

        Hashing the tokenized items (not the file) catches edited examples, a different
        tokenizer, max_seq_len or packing, and ignores formatting-only changes.
        """
        digest = hashlib.sha256()
        for item in self.items:
            for key in sorted(item):
                tensor = item[key]
                digest.update(f"{key}:{tensor.numel()};".encode())
                digest.update(tensor.numpy().tobytes())
        return digest.hexdigest()

    def __getitem__(self, index: int) -> Example:
        return self.items[index]


def load_sft_dataset(
    path: str, tokenizer: PreTrainedTokenizerBase, max_seq_len: int, packing: bool
) -> SFTDataset:
    """Read chat or prompt/response JSONL at ``path`` ('' = bundled) into an :class:`SFTDataset`."""
    if max_seq_len < 2:
        raise DataError(
            f"data.max_seq_len must be >= 2 (a token and its successor), got {max_seq_len}."
        )
    if tokenizer.pad_token_id is None:
        raise DataError("the tokenizer has no pad token; load it with veoptim.data.load_tokenizer.")
    file = Path(path) if path else bundled_dataset_path()
    conversations = read_conversations(file)
    examples, truncation = tokenize_conversations(conversations, tokenizer, max_seq_len, file)
    report_truncation(truncation, len(examples), max_seq_len, file)
    items = pack_examples(examples, max_seq_len, tokenizer.pad_token_id) if packing else examples
    return SFTDataset(
        file, max_seq_len, packing, items, len(examples), truncation.num_truncated, truncation
    )
