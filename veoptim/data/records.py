"""Read SFT JSONL into validated conversations, naming the file and line of any bad record.

Each line is one record in any layout of the layout table (``veoptim/data/conversation_shapes.py``, the
same table the ``datasets`` reader uses): ``messages``, ShareGPT ``conversations``, Alpaca
``instruction``/``input``/``output``, ``prompt``/``response`` or ``prompt``/``completion``.
With ``data.layout=auto`` the layout is detected per line from its keys, so a file may mix
them; a named layout (with ``data.columns`` renames) reads every line the same way. Keys a
layout does not use are ignored. Blank lines are skipped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from veoptim.data.conversation_shapes import LAYOUT_AUTO, Layout, resolve_layout, row_messages
from veoptim.data.messages import KEY_CONTENT, KEY_MESSAGES, KEY_ROLE, Message, validate_messages
from veoptim.errors import DataError

KEY_PROMPT = "prompt"
KEY_RESPONSE = "response"

__all__ = [
    "KEY_CONTENT",
    "KEY_MESSAGES",
    "KEY_PROMPT",
    "KEY_RESPONSE",
    "KEY_ROLE",
    "Conversation",
    "Message",
    "jsonl_records",
    "read_conversations",
    "validate_messages",
]


@dataclass(frozen=True)
class Conversation:
    """One validated example and where it came from (for error messages)."""

    messages: list[Message]
    line: int


def jsonl_records(path: Path, what: str) -> Iterator[tuple[Any, int, str]]:
    """``(record, line number, "<path>:<line>")`` of every non-blank line of the JSONL file
    ``path`` (``what`` names it in errors); a bad line raises ``DataError``."""
    if not path.is_file():
        raise DataError(f"{what} {path} does not exist (expected a JSONL file).")
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                record = json.loads(raw.decode("utf-8").rstrip("\r\n"))  # columns of this line
            except UnicodeDecodeError:
                raise DataError(f"{where}: expected UTF-8 text, found undecodable bytes.") from None
            except json.JSONDecodeError as error:
                raise DataError(
                    f"{where}: expected a JSON object per line, found invalid JSON ({error.msg} "
                    f"at column {error.colno})."
                ) from None
            yield record, line_no, where


def read_conversations(
    path: Path, layout: str = LAYOUT_AUTO, columns: Mapping[str, str] | None = None
) -> list[Conversation]:
    """Parse and validate every line of ``path`` by ``layout`` ('auto': each line's own,
    from its keys) and the ``columns`` renames; the first bad line raises ``DataError``."""
    columns = dict(columns or {})
    bound: dict[frozenset[str], Layout] = {}  # a line's keys -> its layout
    conversations = []
    for record, line_no, where in jsonl_records(path, "SFT data file"):
        if not isinstance(record, dict):
            raise DataError(f"{where}: expected a JSON object, found {type(record).__name__}.")
        keys = frozenset(record)
        if keys not in bound:
            bound[keys] = resolve_layout(layout, columns, sorted(keys), where, noun="key")
        conversations.append(Conversation(row_messages(bound[keys], record, where), line_no))
    if not conversations:
        raise DataError(
            f"SFT data file {path} has no examples (expected one JSON object per line)."
        )
    return conversations
