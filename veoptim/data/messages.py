"""The rules every SFT conversation follows, whichever reader and layout produced it.

A conversation is a list of ``{"role", "content"}`` messages: roles ``system`` (first
message only), ``user``, ``assistant`` and ``tool`` (a tool's output: it follows an
assistant or another tool message), string contents, and it ends with the trained
``assistant`` turn (a preference pair's context ends with the ``user`` turn instead).
"""

from __future__ import annotations

from typing import Any

from veoptim.data.chat_format import ROLE_ASSISTANT, ROLE_SYSTEM, ROLE_TOOL, ROLES
from veoptim.errors import DataError

KEY_MESSAGES = "messages"
KEY_ROLE = "role"
KEY_CONTENT = "content"

Message = dict[str, str]


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
