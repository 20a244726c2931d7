"""Preference pairs (DPO): a context, a chosen and a rejected response, from JSONL.

Accepted record shapes (per line; other keys are ignored, blank lines skipped):

- ``{"prompt": "...", "chosen": "...", "rejected": "..."}``: the prompt is one user turn;
- ``{"messages": [...], "chosen": ..., "rejected": ...}``: the context is a chat (system,
  user and assistant turns) ending with a user turn;
- ``prompt`` may also be such a list of messages (TRL's conversational format), and
  ``chosen`` / ``rejected`` may be a string, an assistant message, or a list holding
  one assistant message.

Each side is tokenized like an SFT example of ``context + [response]`` with only the
response (and its end-of-turn token) labelled, so both share the context tokens.

A path that is not a ``.jsonl`` file (``.parquet``, ``.arrow``, ``.json``, ``.csv``, a
``save_to_disk`` directory, a dataset in the local HF cache) is read with ``datasets``
(split ``train``); each row is validated as a JSONL record would be, errors name the row.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from veoptim.data.chat_format import ROLE_ASSISTANT, ROLE_USER
from veoptim.data.collate import collate
from veoptim.data.fields import IGNORE_INDEX, INPUT_IDS, LABELS
from veoptim.data.paths import bundled_pairs_path
from veoptim.data.records import (
    KEY_CONTENT,
    KEY_MESSAGES,
    KEY_PROMPT,
    KEY_ROLE,
    Conversation,
    Message,
    jsonl_records,
    validate_messages,
)
from veoptim.data.sft import report_truncation, tokenize_conversations
from veoptim.errors import DataError

log = logging.getLogger(__name__)

KEY_CHOSEN, KEY_REJECTED = "chosen", "rejected"
SIDES = (KEY_CHOSEN, KEY_REJECTED)
Example = dict[str, torch.Tensor]


@dataclass(frozen=True)
class PreferencePair:
    """One validated record: the context and both responses, and its line."""

    context: list[Message]
    chosen: Message
    rejected: Message
    line: int


def _context(record: dict[str, Any], where: str) -> list[Message]:
    if KEY_MESSAGES in record:
        value, key = record[KEY_MESSAGES], KEY_MESSAGES
    elif KEY_PROMPT in record:
        value, key = record[KEY_PROMPT], KEY_PROMPT
    else:
        raise DataError(
            f"{where}: expected a 'prompt' (string or messages) or a 'messages' context, "
            f"found keys {sorted(record)}."
        )
    if isinstance(value, str):
        return [{KEY_ROLE: ROLE_USER, KEY_CONTENT: value}]
    context = validate_messages(value, f"{where}: '{key}'", last_role=ROLE_USER)
    return context


def _response(value: Any, key: str, where: str) -> Message:
    if isinstance(value, str):
        return {KEY_ROLE: ROLE_ASSISTANT, KEY_CONTENT: value}
    if isinstance(value, dict):
        value = [value]
    if isinstance(value, list) and len(value) == 1:
        (message,) = validate_messages(value, f"{where}: '{key}'", last_role=ROLE_ASSISTANT)
        return message
    raise DataError(
        f"{where}: expected '{key}' to be a string, an assistant message or a list of one, "
        f"found {value!r:.60}."
    )


def _pair(record: Any, line: int, where: str) -> PreferencePair:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, found {type(record).__name__}.")
    missing = [key for key in SIDES if key not in record]
    if missing:
        raise DataError(f"{where}: expected 'chosen' and 'rejected', {missing} missing.")
    context = _context(record, where)
    chosen, rejected = (_response(record[key], key, where) for key in SIDES)
    return PreferencePair(context, chosen, rejected, line)


def read_pairs(path: Path) -> list[PreferencePair]:
    """Parse and validate every line of ``path``; the first bad line raises ``DataError``."""
    pairs = [
        _pair(record, line_no, where)
        for record, line_no, where in jsonl_records(path, "preference data file")
    ]
    if not pairs:
        raise DataError(f"preference data file {path} has no pairs (one JSON object per line).")
    return pairs


def read_pair_rows(path: str) -> list[PreferencePair]:
    """Validate every row of the data ``datasets`` reads at ``path`` (``line`` = row index)."""
    from veoptim.data.hf_datasets import open_dataset  # datasets loads only if used

    rows = open_dataset(path, what="preference data")
    pairs = [_pair(row, i, f"{path} row {i}") for i, row in enumerate(rows)]
    if not pairs:
        raise DataError(f"preference data {path} has no pairs.")
    return pairs


@dataclass
class PairDataset:
    """Tokenized pairs; ``dataset[i]`` has ``chosen_*`` and ``rejected_*`` input ids and
    labels (1-D long tensors). Pairs whose response was truncated away on either side
    are dropped at load time (reported)."""

    path: Path
    max_seq_len: int
    items: list[dict[str, Example]]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, Example]:
        return self.items[index]

    @cached_property
    def fingerprint(self) -> str:
        """SHA-256 of every item's tokens in order (what a sampler position refers to)."""
        digest = hashlib.sha256()
        for item in self.items:
            for side in SIDES:
                for key in (INPUT_IDS, LABELS):
                    tensor = item[side][key]
                    digest.update(f"{side}.{key}:{tensor.numel()};".encode())
                    digest.update(tensor.numpy().tobytes())
        return digest.hexdigest()


def _has_response(example: Example) -> bool:
    return bool((example[LABELS][1:] != IGNORE_INDEX).any())


def load_pair_dataset(
    path: str, tokenizer: PreTrainedTokenizerBase, max_seq_len: int
) -> PairDataset:
    """Read pairs JSONL at ``path`` ('' = the bundled pairs) and tokenize both sides."""
    if max_seq_len < 2:
        raise DataError(f"data.max_seq_len must be >= 2, got {max_seq_len}.")
    file = Path(path) if path else bundled_pairs_path()
    from_jsonl = file.suffix == ".jsonl"
    pairs = read_pairs(file) if from_jsonl else read_pair_rows(path)
    sides: dict[str, list[Example]] = {}
    truncations = []
    for side in SIDES:
        conversations = [Conversation([*p.context, getattr(p, side)], p.line) for p in pairs]
        sides[side], truncation = tokenize_conversations(
            conversations, tokenizer, max_seq_len, file, last_turn_only=True
        )
        truncations.append(truncation)
    worst = max(truncations, key=lambda t: (t.num_without_response, t.num_truncated))
    report_truncation(worst, len(pairs), max_seq_len, file)  # the side truncation hit hardest
    items, dropped = [], []
    for pair, chosen, rejected in zip(pairs, sides[KEY_CHOSEN], sides[KEY_REJECTED], strict=True):
        if _has_response(chosen) and _has_response(rejected):
            items.append({KEY_CHOSEN: chosen, KEY_REJECTED: rejected})
        else:
            dropped.append(pair.line)
    if not items:
        raise DataError(
            f"no pair of {file} keeps a response token on both sides within "
            f"data.max_seq_len={max_seq_len}; raise data.max_seq_len."
        )
    if dropped:
        log.warning(
            "%d of %d pairs of %s lose a whole response to data.max_seq_len=%d and are skipped "
            "(%s %s%s).",
            len(dropped), len(pairs), file, max_seq_len, "lines" if from_jsonl else "rows",
            dropped[:5], "..." if len(dropped) > 5 else "",
        )  # fmt: skip
    return PairDataset(file, max_seq_len, items)


def collate_pairs(items: list[dict[str, Example]], pad_id: int) -> dict[str, torch.Tensor]:
    """One batch of ``2 * len(items)`` rows: every chosen side, then every rejected side
    (one forward pass computes both)."""
    return collate([item[side] for side in SIDES for item in items], pad_id)
