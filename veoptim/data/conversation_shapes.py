"""Dataset layouts: the one table every SFT reader maps a record (a JSONL line, a
``datasets`` row) into a validated conversation with.

Each layout turns a record into the ``[{"role", "content"}, ...]`` messages of
``veoptim/data/messages.py``, so tokenization, labelling, packing and truncation reporting
are shared:

- ``messages``: a ``messages`` list of ``{role, content}`` (OpenAI / TRL conversational);
- ``sharegpt``: a ``conversations`` list of ``{from, value}`` entries (LLaMA-Factory's
  ShareGPT), optional ``system``; ``from`` names map to roles by :data:`SHAREGPT_ROLES`;
- ``alpaca``: ``instruction``, optional ``input`` (appended to the instruction after a
  newline, as LLaMA-Factory does), ``output``, optional ``system`` and ``history`` (earlier
  ``[instruction, output]`` pairs);
- ``prompt_response``: ``prompt`` and ``response`` strings (TRL's ``completion`` is
  detected as the response), optional ``system``.

:data:`TABLE` lists them in the order ``data.layout=auto`` tries them: the ``datasets``
reader detects one layout from a dataset's columns, the JSONL reader one per line from its
keys (so a file may mix layouts). Column names (and ShareGPT's entry keys
``role_tag``/``content_tag``) can be renamed with ``data.columns.<name>``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from veoptim.data.chat_format import ROLE_ASSISTANT, ROLE_SYSTEM, ROLE_TOOL, ROLE_USER
from veoptim.data.messages import KEY_CONTENT, KEY_ROLE, Message, validate_messages
from veoptim.errors import ConfigError, DataError

LAYOUT_AUTO = "auto"
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
    """A layout bound to one dataset (or JSONL line): canonical name -> its column (present
    ones only)."""

    name: str
    columns: dict[str, str]
    role_tag: str = ENTRY_KEYS["role_tag"]
    content_tag: str = ENTRY_KEYS["content_tag"]


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


@dataclass(frozen=True)
class LayoutSpec:
    """One row of the layout table."""

    name: str
    #: Canonical columns: the required ones, then the optional ones.
    required: tuple[str, ...]
    optional: tuple[str, ...]
    convert: Callable[[Layout, Mapping[str, Any], str], Any]
    #: Another name ``data.layout=auto`` accepts for a required column (TRL's 'completion').
    aliases: Mapping[str, str] = field(default_factory=dict)

    @property
    def renamable(self) -> tuple[str, ...]:
        """The ``data.columns.<name>`` keys this layout reads."""
        entry = tuple(ENTRY_KEYS) if self.name == "sharegpt" else ()
        return self.required + self.optional + entry

    def describe(self) -> str:
        """Its required columns as a user reads them: 'prompt' and 'response'/'completion'."""
        names = [
            f"'{c}'/'{self.aliases[c]}'" if c in self.aliases else f"'{c}'" for c in self.required
        ]
        return " and ".join(names)


#: Every layout, in the order ``data.layout=auto`` tries them (first whose columns all exist).
TABLE: tuple[LayoutSpec, ...] = (
    LayoutSpec("messages", ("messages",), (), _messages),
    LayoutSpec("sharegpt", ("conversations",), ("system",), _sharegpt),
    LayoutSpec("alpaca", ("instruction", "output"), ("input", "system", "history"), _alpaca),
    LayoutSpec(
        "prompt_response",
        ("prompt", "response"),
        ("system",),
        _prompt_response,
        {"response": "completion"},
    ),
)
LAYOUT_BY_NAME: dict[str, LayoutSpec] = {spec.name: spec for spec in TABLE}
#: The values of ``data.layout`` besides ``auto``.
LAYOUTS: tuple[str, ...] = tuple(LAYOUT_BY_NAME)
#: What ``data.layout=auto`` recognises, for error messages.
DETECTED = ", ".join(f"{spec.describe()} ({spec.name})" for spec in TABLE)
#: How to read data whose names differ, for error messages.
MAPPING_HINT = (
    f"set data.layout to one of {list(LAYOUTS)} and name your fields with "
    "data.columns.<name>=<yours> (e.g. data.layout=alpaca data.columns.instruction=question "
    "data.columns.output=answer)"
)


def _present(spec: LayoutSpec, names: set[str]) -> dict[str, str]:
    """Each required column of ``spec`` that ``names`` holds -> the name it has there."""
    found = {}
    for column in spec.required:
        alias = spec.aliases.get(column)
        if column in names:
            found[column] = column
        elif alias in names:
            found[column] = alias
    return found


def detect_layout(
    column_names: Sequence[str], source: str, noun: str = "column"
) -> tuple[str, dict[str, str]]:
    """The layout (and renames) the columns (a JSONL line: its keys, ``noun="key"``) imply,
    for ``data.layout=auto``; ``DataError`` naming the layouts and the keys that map yours."""
    names = set(column_names)
    for spec in TABLE:
        found = _present(spec, names)
        if len(found) == len(spec.required):
            return spec.name, {c: n for c, n in found.items() if c != n}
    for spec in TABLE:
        found = _present(spec, names)
        if found:
            missing = next(c for c in spec.required if c not in found)
            raise DataError(
                f"{source}: '{missing}' is missing: {sorted(found.values())} is a {noun} of the "
                f"{spec.name} layout, which needs {spec.describe()}; found {noun}s "
                f"{sorted(names)}. If yours is named differently, set data.layout={spec.name} "
                f"data.columns.{missing}=<your {noun}>."
            )
    raise DataError(
        f"{source}: cannot tell the layout from the {noun}s {sorted(names)}; data.layout=auto "
        f"reads {DETECTED}. For other names {MAPPING_HINT}."
    )


def resolve_layout(
    layout: str,
    renames: Mapping[str, str],
    column_names: Sequence[str],
    source: str,
    noun: str = "column",
) -> Layout:
    """Bind ``layout`` ('auto' = detected) to the dataset's columns (a JSONL line's keys,
    ``noun="key"``); ``ConfigError`` for a rename the layout has no use for, ``DataError``
    for a column the data lacks."""
    if layout == LAYOUT_AUTO:
        if renames:
            raise ConfigError(
                f"data.columns ({dict(renames)}) renames the columns of a layout; set "
                f"data.layout to one of {list(LAYOUTS)} as well."
            )
        layout, renames = detect_layout(column_names, source, noun)
    spec = LAYOUT_BY_NAME[layout]
    known = spec.renamable
    unknown = sorted(set(renames) - set(known))
    if unknown:
        raise ConfigError(
            f"data.columns.{unknown[0]} is not a column of data.layout={layout}; expected some "
            f"of {list(known)}."
        )
    named = {c: renames.get(c) or c for c in spec.required + spec.optional}
    wanted = list(spec.required) + [c for c in spec.optional if renames.get(c)]
    missing = [named[c] for c in wanted if named[c] not in column_names]
    if missing:
        raise DataError(
            f"{source}: data.layout={layout} expects the {noun}(s) {missing}, found {noun}s "
            f"{sorted(column_names)}; map yours with data.columns.<name>=<{noun}>."
        )
    columns = {c: col for c, col in named.items() if col in column_names}
    tags = {k: renames.get(k) or v for k, v in ENTRY_KEYS.items()}
    return Layout(layout, columns, tags["role_tag"], tags["content_tag"])


def row_messages(layout: Layout, row: Mapping[str, Any], where: str) -> list[Message]:
    """The validated conversation of ``row`` (``where`` names it in errors)."""
    return validate_messages(LAYOUT_BY_NAME[layout.name].convert(layout, row, where), where)
