"""Read SFT JSONL into validated conversations, naming the file and line of any bad record.

Two record shapes are accepted (per line, so a file may mix them):

- chat: ``{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}]}``
  with roles ``system`` (first message only), ``user``, ``assistant`` and ``tool`` (a
  tool's output: it follows an assistant or another tool message); at least one
  assistant message, and the conversation ends with one.
- pair: ``{"prompt": "...", "response": "..."}``, read as a one-turn chat.

Other keys on a line are ignored. Blank lines are skipped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from veoptim.data.chat_format import ROLE_ASSISTANT, ROLE_SYSTEM, ROLE_TOOL, ROLE_USER, ROLES
from veoptim.errors import DataError

KEY_MESSAGES = "messages"
KEY_PROMPT = "prompt"
KEY_RESPONSE = "response"
KEY_ROLE = "role"
KEY_CONTENT = "content"

Message = dict[str, str]


@dataclass(frozen=True)
class Conversation:
    """One validated example and where it came from (for error messages)."""

    messages: list[Message]
    line: int


def _messages_from_record(record: Any, where: str) -> list[Message]:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, found {type(record).__name__}.")
    if KEY_MESSAGES in record:
        return validate_messages(record[KEY_MESSAGES], where)
    if KEY_PROMPT in record or KEY_RESPONSE in record:
        for key in (KEY_PROMPT, KEY_RESPONSE):
            if key not in record:
                raise DataError(
                    f"{where}: expected both 'prompt' and 'response', '{key}' is missing."
                )
            if not isinstance(record[key], str):
                raise DataError(
                    f"{where}: expected '{key}' to be a string, found {type(record[key]).__name__}."
                )
        return [
            {KEY_ROLE: ROLE_USER, KEY_CONTENT: record[KEY_PROMPT]},
            {KEY_ROLE: ROLE_ASSISTANT, KEY_CONTENT: record[KEY_RESPONSE]},
        ]
    raise DataError(
        f"{where}: expected a 'messages' list or 'prompt' and 'response' strings, "
        f"found keys {sorted(record)}."
    )


def validate_messages(messages: Any, where: str, last_role: str = ROLE_ASSISTANT) -> list[Message]:
    """Validated messages that end with a ``last_role`` turn (SFT: the trained response;
    a preference pair's context: the user turn the responses answer)."""
    if not isinstance(messages, list) or not messages:
        raise DataError(
            f"{where}: expected 'messages' to be a non-empty list, found {messages!r:.60}."
        )
    out: list[Message] = []
    for i, message in enumerate(messages):
        at = f"{where}: messages[{i}]"
        if not isinstance(message, dict):
            raise DataError(
                f"{at}: expected an object with 'role' and 'content', found {message!r:.60}."
            )
        role, content = message.get(KEY_ROLE), message.get(KEY_CONTENT)
        if role not in ROLES:
            raise DataError(f"{at}: expected role in {list(ROLES)}, found {role!r}.")
        if not isinstance(content, str):
            raise DataError(
                f"{at}: expected 'content' to be a string, found {type(content).__name__}."
            )
        if role == ROLE_SYSTEM and i != 0:
            raise DataError(f"{at}: a 'system' message is only allowed first.")
        if role == ROLE_TOOL and (not out or out[-1][KEY_ROLE] not in (ROLE_ASSISTANT, ROLE_TOOL)):
            found = f"after a {out[-1][KEY_ROLE]!r} message" if out else "first"
            raise DataError(
                f"{at}: expected a 'tool' message (a tool's output) to follow an 'assistant' "
                f"or 'tool' message, found it {found}."
            )
        out.append({KEY_ROLE: role, KEY_CONTENT: content})
    if out[-1][KEY_ROLE] != last_role:
        what = "the trained response" if last_role == ROLE_ASSISTANT else "the context"
        raise DataError(
            f"{where}: expected the conversation to end with "
            f"{'an' if last_role == ROLE_ASSISTANT else 'a'} '{last_role}' message "
            f"({what}), found {out[-1][KEY_ROLE]!r}."
        )
    return out


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
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                raise DataError(f"{where}: expected UTF-8 text, found undecodable bytes.") from None
            except json.JSONDecodeError as error:
                raise DataError(
                    f"{where}: expected a JSON object per line, found invalid JSON ({error.msg})."
                ) from None
            yield record, line_no, where


def read_conversations(path: Path) -> list[Conversation]:
    """Parse and validate every line of ``path``; the first bad line raises ``DataError``."""
    conversations = [
        Conversation(_messages_from_record(record, where), line_no)
        for record, line_no, where in jsonl_records(path, "SFT data file")
    ]
    if not conversations:
        raise DataError(
            f"SFT data file {path} has no examples (expected one JSON object per line)."
        )
    return conversations
