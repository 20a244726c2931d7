"""SFT examples: render with the tokenizer's chat template, label only the assistant turns.

Each conversation is rendered once with ``tokenizer.apply_chat_template`` and
tokenized with character offsets. The trained span of assistant message ``j`` is
the text between the render of ``messages[:j]`` plus the generation prompt and
the render of ``messages[:j+1]``: the response and the template's end-of-turn
tokens after it (``<|end|>`` for the bundled tokenizer, which is its EOS). A
token is labelled when its first character lies in a trained span, so every
assistant turn of a multi-turn chat is trained and everything else is -100.
A ``tool`` message (a tool's output) is masked unless ``train_tool_turns``: then its
whole turn, from the end of the render of ``messages[:j]`` to the end of that of
``messages[:j+1]``, is trained as well.
This works for any chat template whose renders of growing prefixes are prefixes
of each other; one that is not (e.g. it rewrites earlier turns) is rejected.

Both readers (JSONL, and ``datasets`` in ``hf_datasets.py``; ``dataset.py`` picks one)
tokenize with :func:`encode_conversations`, so an example is the same tokens whichever
read it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from veoptim.data.chat_format import ROLE_ASSISTANT, ROLE_TOOL
from veoptim.data.fields import IGNORE_INDEX, INPUT_IDS, LABELS
from veoptim.data.packing import Example
from veoptim.data.records import Conversation, Message
from veoptim.data.token_memo import TOKENIZED, memo_key
from veoptim.errors import DataError

log = logging.getLogger(__name__)

#: Above this share of truncated examples the startup report is a warning.
TRUNCATION_WARN_SHARE = 0.05
#: Per-example columns of :func:`encode_conversations` beside the tokens: the length
#: before truncation and the first trained position (-1: none), for the truncation report.
NUM_TOKENS = "num_tokens"
FIRST_TRAINED = "first_trained"


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
    messages: list[Message],
    where: str,
    last_turn_only: bool = False,
    train_tool_turns: bool = False,
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the ``[start, end)`` character spans of its assistant turns
    (only the final one with ``last_turn_only``: a preference pair's response), and of its
    whole tool turns with ``train_tool_turns``."""
    try:
        text = _render(tokenizer, messages, generation_prompt=False)
        spans = []
        for j, message in enumerate(messages):
            if message["role"] == ROLE_ASSISTANT and not (last_turn_only and j < len(messages) - 1):
                before = _render(tokenizer, messages[:j], generation_prompt=True)
            elif message["role"] == ROLE_TOOL and train_tool_turns and not last_turn_only:
                before = _render(tokenizer, messages[:j], generation_prompt=False)
            else:
                continue
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


def encode_conversations(
    conversations: Sequence[list[Message]],
    wheres: Sequence[str],
    tokenizer: PreTrainedTokenizerBase,
    max_seq_len: int,
    last_turn_only: bool = False,
    train_tool_turns: bool = False,
) -> dict[str, list]:
    """The one tokenization of SFT data (JSONL and ``datasets`` alike), as columns:
    ``input_ids`` and ``labels`` truncated to ``max_seq_len``, ``num_tokens`` before
    truncation and ``first_trained`` (the first labelled position >= 1, -1 if none), from
    which :func:`summarize_truncation` reports what truncation cut.

    ``wheres[i]`` names conversation ``i`` in errors.
    """
    rendered = [
        trained_spans(tokenizer, messages, where, last_turn_only, train_tool_turns)
        for messages, where in zip(conversations, wheres, strict=True)
    ]
    encoded = tokenizer(
        [text for text, _ in rendered], add_special_tokens=False, return_offsets_mapping=True
    )
    columns: dict[str, list] = {INPUT_IDS: [], LABELS: [], NUM_TOKENS: [], FIRST_TRAINED: []}
    for (_, spans), ids, offsets in zip(
        rendered, encoded[INPUT_IDS], encoded["offset_mapping"], strict=True
    ):
        labels = _label(ids, offsets, spans)
        first = next((k for k in range(1, len(labels)) if labels[k] != IGNORE_INDEX), -1)
        columns[INPUT_IDS].append(ids[:max_seq_len])
        columns[LABELS].append(labels[:max_seq_len])
        columns[NUM_TOKENS].append(len(ids))
        columns[FIRST_TRAINED].append(first)
    return columns


def summarize_truncation(
    num_tokens: Sequence[int] | np.ndarray,
    first_trained: Sequence[int] | np.ndarray,
    max_seq_len: int,
) -> Truncation:
    """What ``max_seq_len`` cut, from :func:`encode_conversations`' length columns."""
    lengths, firsts = np.asarray(num_tokens, np.int64), np.asarray(first_trained, np.int64)
    kept = firsts[firsts >= 0]
    return Truncation(
        num_truncated=int((lengths > max_seq_len).sum()),
        num_without_response=int(((firsts < 0) | (firsts >= max_seq_len)).sum()),
        longest=int(lengths.max(initial=0)),
        min_len_with_response=int(kept.min()) + 1 if kept.size else 0,
    )


def to_examples(
    input_ids: Iterable[Sequence[int]], labels: Iterable[Sequence[int]]
) -> list[Example]:
    """1-D long tensors per example, the form packing, collation and the fingerprint take."""
    return [
        {
            INPUT_IDS: torch.as_tensor(ids, dtype=torch.long),
            LABELS: torch.as_tensor(labs, dtype=torch.long),
        }
        for ids, labs in zip(input_ids, labels, strict=True)
    ]


def tokenize_conversations(
    conversations: list[Conversation],
    tokenizer: PreTrainedTokenizerBase,
    max_seq_len: int,
    path: Path,
    last_turn_only: bool = False,
    train_tool_turns: bool = False,
) -> tuple[list[Example], Truncation]:
    """``input_ids`` and ``labels`` (-100 outside assistant turns, or outside the final one
    with ``last_turn_only``), truncated to ``max_seq_len``, of conversations read from the
    JSONL file ``path``.

    Returns the examples and what truncation cut off. Conversations this process has
    tokenized before with the same tokenizer and settings are not rendered again
    (:mod:`veoptim.data.token_memo`).
    """
    messages = [c.messages for c in conversations]
    key = memo_key(messages, tokenizer, max_seq_len=max_seq_len, last_turn_only=last_turn_only,
                   train_tool_turns=train_tool_turns)  # fmt: skip
    kept = TOKENIZED.get(key)
    if kept is not None:
        input_ids, labels, truncation = kept
        log.info("%s: the same conversations were tokenized earlier in this process; "
                 "reusing those tokens.", path)  # fmt: skip
        return to_examples(input_ids, labels), truncation
    columns = encode_conversations(
        messages,
        [f"{path}:{c.line}" for c in conversations],
        tokenizer,
        max_seq_len,
        last_turn_only,
        train_tool_turns,
    )
    truncation = summarize_truncation(columns[NUM_TOKENS], columns[FIRST_TRAINED], max_seq_len)
    TOKENIZED.put(key, columns[INPUT_IDS], columns[LABELS], truncation)
    return to_examples(columns[INPUT_IDS], columns[LABELS]), truncation


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
