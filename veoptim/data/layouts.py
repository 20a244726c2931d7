"""Dataset layouts: one row of a ``datasets`` table -> one validated conversation.

Each layout turns a row into the ``[{"role", "content"}, ...]`` messages the JSONL reader
produces, so tokenization, labelling, packing and truncation reporting are shared:

- ``messages``: a ``messages`` list of ``{role, content}`` (OpenAI / TRL conversational);
- ``prompt_response``: ``prompt`` and ``response`` strings (TRL's ``completion`` is
  detected as the response), optional ``system``;
- ``alpaca``: ``instruction``, optional ``input`` (appended to the instruction after a
  newline, as LLaMA-Factory does), ``output``, optional ``system`` and ``history`` (earlier
  ``[instruction, output]`` pairs);
- ``sharegpt``: a ``conversations`` list of ``{from, value}`` entries (LLaMA-Factory's
  ShareGPT), optional ``system``; ``from`` names map to roles by :data:`SHAREGPT_ROLES`.

Column names (and ShareGPT's entry keys ``role_tag``/``content_tag``) can be renamed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from veoptim.data.chat_format import ROLE_ASSISTANT, ROLE_SYSTEM, ROLE_TOOL, ROLE_USER
from veoptim.data.records import KEY_CONTENT, KEY_ROLE, Message, validate_messages
from veoptim.data.sources import LAYOUT_AUTO, LAYOUTS
from veoptim.errors import ConfigError, DataError

#: Canonical columns of each layout: required ones first, then optional ones.
REQUIRED: dict[str, tuple[str, ...]] = {
    "messages": ("messages",),
    "prompt_response": ("prompt", "response"),
    "alpaca": ("instruction", "output"),
    "sharegpt": ("conversations",),
}
OPTIONAL: dict[str, tuple[str, ...]] = {
    "messages": (),
    "prompt_response": ("system",),
    "alpaca": ("input", "system", "history"),
    "sharegpt": ("system",),
}
#: ShareGPT's keys inside each entry (canonical -> default), renamable like columns.
ENTRY_KEYS = {"role_tag": "from", "content_tag": "value"}
#: ShareGPT ``from`` values (LLaMA-Factory's tags, OpenAI's roles) and the role each becomes.
SHAREGPT_ROLES: dict[str, str] = {
    "system": ROLE_SYSTEM,
    "human": ROLE_USER,
    "user": ROLE_USER,
    "gpt": ROLE_ASSISTANT,
    "assistant": ROLE_ASSISTANT,
    "function_call": ROLE_ASSISTANT,
    "observation": ROLE_TOOL,
    "tool": ROLE_TOOL,
    "function": ROLE_TOOL,
}


@dataclass(frozen=True)
class Layout:
    """A layout bound to one dataset: canonical name -> its column (present ones only)."""

    name: str
    columns: dict[str, str]
    role_tag: str = ENTRY_KEYS["role_tag"]
    content_tag: str = ENTRY_KEYS["content_tag"]


def detect_layout(column_names: Sequence[str], source: str) -> tuple[str, dict[str, str]]:
    """The layout (and renames) a dataset's columns imply, for ``data.layout=auto``."""
    names = set(column_names)
    if "messages" in names:
        return "messages", {}
    if "conversations" in names:
        return "sharegpt", {}
    if {"instruction", "output"} <= names:
        return "alpaca", {}
    if {"prompt", "response"} <= names:
        return "prompt_response", {}
    if {"prompt", "completion"} <= names:
        return "prompt_response", {"response": "completion"}
    raise DataError(
        f"{source}: cannot tell the layout from the columns {sorted(names)}; expected "
        "'messages' (messages), 'conversations' (sharegpt), 'instruction' and 'output' (alpaca) "
        "or 'prompt' and 'response'/'completion' (prompt_response); set data.layout and "
        "data.columns."
    )


def resolve_layout(
    layout: str, renames: Mapping[str, str], column_names: Sequence[str], source: str
) -> Layout:
    """Bind ``layout`` ('auto' = detected) to the dataset's columns; ``ConfigError`` for a
    rename the layout has no use for, ``DataError`` for a column the data lacks."""
    if layout == LAYOUT_AUTO:
        if renames:
            raise ConfigError(
                f"data.columns ({dict(renames)}) renames the columns of a layout; set "
                f"data.layout to one of {list(LAYOUTS)} as well."
            )
        layout, renames = detect_layout(column_names, source)
    known = (
        REQUIRED[layout] + OPTIONAL[layout] + (tuple(ENTRY_KEYS) if layout == "sharegpt" else ())
    )
    unknown = sorted(set(renames) - set(known))
    if unknown:
        raise ConfigError(
            f"data.columns.{unknown[0]} is not a column of data.layout={layout}; expected some "
            f"of {list(known)}."
        )
    named = {c: renames.get(c) or c for c in REQUIRED[layout] + OPTIONAL[layout]}
    wanted = list(REQUIRED[layout]) + [c for c in OPTIONAL[layout] if renames.get(c)]
    missing = [named[c] for c in wanted if named[c] not in column_names]
    if missing:
        raise DataError(
            f"{source}: data.layout={layout} expects the column(s) {missing}, found columns "
            f"{sorted(column_names)}; map yours with data.columns.<name>=<column>."
        )
    columns = {c: col for c, col in named.items() if col in column_names}
    tags = {k: renames.get(k) or v for k, v in ENTRY_KEYS.items()}
    return Layout(layout, columns, tags["role_tag"], tags["content_tag"])


def _text(row: Mapping[str, Any], column: str, where: str, optional: bool = False) -> str:
    value = row.get(column)
    if optional and value is None:
        return ""
    if not isinstance(value, str):
        raise DataError(
            f"{where}: expected column '{column}' to be a string, found {type(value).__name__}."
        )
    return value


def _system(layout: Layout, row: Mapping[str, Any], where: str) -> list[Message]:
    column = layout.columns.get("system")
    text = _text(row, column, where, optional=True) if column else ""
    return [{KEY_ROLE: ROLE_SYSTEM, KEY_CONTENT: text}] if text else []


def _turn(prompt: str, response: str) -> list[Message]:
    return [
        {KEY_ROLE: ROLE_USER, KEY_CONTENT: prompt},
        {KEY_ROLE: ROLE_ASSISTANT, KEY_CONTENT: response},
    ]


def _messages(layout: Layout, row: Mapping[str, Any], where: str) -> list[Message]:
    return row.get(layout.columns["messages"])


def _prompt_response(layout: Layout, row: Mapping[str, Any], where: str) -> list[Message]:
    prompt = _text(row, layout.columns["prompt"], where)
    response = _text(row, layout.columns["response"], where)
    return _system(layout, row, where) + _turn(prompt, response)


def _history(layout: Layout, row: Mapping[str, Any], where: str) -> list[Message]:
    column = layout.columns.get("history")
    pairs = row.get(column) if column else None
    if not pairs:
        return []
    if not isinstance(pairs, list) or not all(
        isinstance(p, list) and len(p) == 2 and all(isinstance(t, str) for t in p) for p in pairs
    ):
        raise DataError(
            f"{where}: expected column '{column}' to be a list of [instruction, output] string "
            f"pairs, found {pairs!r:.80}."
        )
    return [m for prompt, response in pairs for m in _turn(prompt, response)]


def _alpaca(layout: Layout, row: Mapping[str, Any], where: str) -> list[Message]:
    instruction = _text(row, layout.columns["instruction"], where)
    column = layout.columns.get("input")
    extra = _text(row, column, where, optional=True) if column else ""
    prompt = f"{instruction}\n{extra}" if extra else instruction
    output = _text(row, layout.columns["output"], where)
    return _system(layout, row, where) + _history(layout, row, where) + _turn(prompt, output)


def _sharegpt(layout: Layout, row: Mapping[str, Any], where: str) -> list[Message]:
    column, role_tag, content_tag = (
        layout.columns["conversations"],
        layout.role_tag,
        layout.content_tag,
    )
    entries = row.get(column)
    if not isinstance(entries, list) or not entries:
        raise DataError(
            f"{where}: expected '{column}' to be a non-empty list of {{'{role_tag}', "
            f"'{content_tag}'}} entries, found {entries!r:.60}."
        )
    messages = _system(layout, row, where)
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise DataError(
                f"{where}: expected '{column}' entry {i} to be an object with '{role_tag}' and "
                f"'{content_tag}', found {entry!r:.60}."
            )
        sender, content = entry.get(role_tag), entry.get(content_tag)
        if not isinstance(sender, str) or sender not in SHAREGPT_ROLES:
            raise DataError(
                f"{where}: '{column}' entry {i} has {role_tag}={sender!r}; expected one of "
                f"{list(SHAREGPT_ROLES)}."
            )
        if not isinstance(content, str):
            raise DataError(
                f"{where}: '{column}' entry {i} has {content_tag} of type "
                f"{type(content).__name__}; expected a string."
            )
        messages.append({KEY_ROLE: SHAREGPT_ROLES[sender], KEY_CONTENT: content})
    return messages


_CONVERTERS: dict[str, Callable[[Layout, Mapping[str, Any], str], Any]] = {
    "messages": _messages,
    "prompt_response": _prompt_response,
    "alpaca": _alpaca,
    "sharegpt": _sharegpt,
}


def row_messages(layout: Layout, row: Mapping[str, Any], where: str) -> list[Message]:
    """The validated conversation of ``row`` (``where`` names it in errors)."""
    return validate_messages(_CONVERTERS[layout.name](layout, row, where), where)
