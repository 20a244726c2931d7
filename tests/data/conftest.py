"""Fixtures of the data tests: the bundled tokenizer and small JSONL files written on the fly."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from veoptim.data import load_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer()


@pytest.fixture
def write_jsonl(tmp_path: Path) -> Callable[[list, str], Path]:
    """Write records (dicts are JSON-encoded, strings written verbatim) as lines of a file."""

    def write(lines: list, name: str = "data.jsonl") -> Path:
        path = tmp_path / name
        text = "".join(
            (line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines
        )
        path.write_text(text, encoding="utf-8")
        return path

    return write
