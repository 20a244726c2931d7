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


def _render(
    tokenizer: PreTrainedTokenizerBase, messages: list[Message], generation_prompt: bool
) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )


def trained_spans(
    tokenizer: PreTrainedTokenizerBase, conversation: Conversation, where: str
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the ``[start, end)`` character spans of its assistant turns."""
    messages = conversation.messages
    try:
        text = _render(tokenizer, messages, generation_prompt=False)
        spans = []
        for j, message in enumerate(messages):
            if message["role"] != ROLE_ASSISTANT:
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
) -> tuple[list[Example], int]:
    """``input_ids`` and ``labels`` (-100 outside assistant turns), truncated to ``max_seq_len``.

    Returns the examples and how many were truncated.
    """
    rendered = [trained_spans(tokenizer, c, f"{path}:{c.line}") for c in conversations]
    encoded = tokenizer(
        [text for text, _ in rendered], add_special_tokens=False, return_offsets_mapping=True
    )
    examples = []
    num_truncated = 0
    for (_, spans), ids, offsets in zip(
        rendered, encoded[INPUT_IDS], encoded["offset_mapping"], strict=True
    ):
        labels = _label(ids, offsets, spans)
        num_truncated += len(ids) > max_seq_len
        examples.append(
            {
                INPUT_IDS: torch.tensor(ids[:max_seq_len], dtype=torch.long),
                LABELS: torch.tensor(labels[:max_seq_len], dtype=torch.long),
            }
        )
    return examples, num_truncated


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
    examples, num_truncated = tokenize_conversations(conversations, tokenizer, max_seq_len, file)
    items = pack_examples(examples, max_seq_len, tokenizer.pad_token_id) if packing else examples
    return SFTDataset(file, max_seq_len, packing, items, len(examples), num_truncated)
