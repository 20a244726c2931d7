"""Tokenized conversations kept for the rest of the process.

Rendering every conversation's chat template several times (to locate its assistant
turns) is most of a small run's start. A process that tokenizes the same conversations
with the same tokenizer and settings again (the jobs of a sweep run in one process with
``-m``, a DPO run's two sides of a repeated pair file, several trainers in one script)
gets the tokens of the first time instead. The key is a digest of the messages
themselves, the tokenizer's identity (vocabulary, merges, added and special tokens,
template) and every setting that changes the tokens, so an edited file, another tokenizer
or another ``max_seq_len`` is tokenized afresh. Each caller gets its own tensors.

Only the last :data:`MAX_ENTRIES` tokenizations of at most :data:`MAX_TOKENS` tokens are
kept (as two flat int64 arrays each); larger data sets go through ``datasets`` and its
cache on disk anyway.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from veoptim.data.tokenizer import tokenizer_identity

MAX_ENTRIES = 4
MAX_TOKENS = 4_000_000


def memo_key(messages: Sequence[Any], tokenizer: PreTrainedTokenizerBase, **settings: Any) -> str:
    """What decides the tokens of ``messages``: their content, the tokenizer, ``settings``."""
    digest = hashlib.sha256(tokenizer_identity(tokenizer).encode())
    digest.update(json.dumps(settings, sort_keys=True).encode())
    for conversation in messages:
        digest.update(json.dumps(conversation, sort_keys=True, default=str).encode())
        digest.update(b"\n")
    return digest.hexdigest()


@dataclass(frozen=True)
class _Tokenized:
    ids: np.ndarray
    labels: np.ndarray
    bounds: np.ndarray  # example i is [bounds[i], bounds[i + 1])
    summary: Any


class TokenMemo:
    """The last few tokenizations of this process, by :func:`memo_key`."""

    def __init__(self, max_entries: int = MAX_ENTRIES, max_tokens: int = MAX_TOKENS) -> None:
        self.max_entries, self.max_tokens = max_entries, max_tokens
        self._entries: OrderedDict[str, _Tokenized] = OrderedDict()
        self.hits = self.misses = 0

    def get(self, key: str) -> tuple[list[np.ndarray], list[np.ndarray], Any] | None:
        """Copies of the stored ``(input_ids, labels, summary)``, or None."""
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return _rows(entry.ids, entry.bounds), _rows(entry.labels, entry.bounds), entry.summary

    def put(
        self,
        key: str,
        input_ids: Sequence[Sequence[int]],
        labels: Sequence[Sequence[int]],
        summary: Any,
    ) -> None:
        """Keep a tokenization (unless it has more than ``max_tokens`` tokens)."""
        lengths = np.fromiter((len(ids) for ids in input_ids), np.int64, len(input_ids))
        if lengths.sum() > self.max_tokens or self.max_entries < 1:
            return
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        self._entries[key] = _Tokenized(_flat(input_ids), _flat(labels), bounds, summary)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.hits = self.misses = 0


def _rows(flat: np.ndarray, bounds: np.ndarray) -> list[np.ndarray]:
    """The rows of a copy of ``flat`` (views of that copy: the memo's array stays unshared)."""
    copied = flat.copy()
    return [copied[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def _flat(rows: Sequence[Sequence[int]]) -> np.ndarray:
    return np.concatenate([np.asarray(row, np.int64) for row in rows] or [np.zeros(0, np.int64)])


#: The process's memo (``tokenize_conversations`` uses it).
TOKENIZED = TokenMemo()
