"""SFT data through Hugging Face ``datasets``, tokenized once into a reusable cache.

``data.train_path`` may be a local ``.parquet``/``.arrow``/``.json``/``.jsonl``/``.csv``
file, a directory written by ``save_to_disk`` (or holding data files), or the name of a
dataset already in the local HF datasets cache. Rows become conversations by their layout
(``veoptim/data/conversation_shapes.py``) and are tokenized by the same function as JSONL
(``encode_conversations``), inside ``Dataset.map`` with ``data.num_proc`` workers.

The tokenized columns are written to ``$HF_DATASETS_CACHE/veoptim_sft/sft-<key>.arrow``
where ``<key>`` hashes the source dataset's fingerprint, the tokenizer (vocabulary,
merges, special tokens, chat template), ``max_seq_len``, the layout and its columns and
``train_tool_turns``: a second run over the same inputs loads that file and tokenizes
nothing; a change to any of them tokenizes again into a new file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import datasets
import numpy as np
from transformers import PreTrainedTokenizerBase

from veoptim.data.conversation_shapes import Layout, resolve_layout, row_messages
from veoptim.data.fields import INPUT_IDS, LABELS
from veoptim.data.packing import Example
from veoptim.data.records import jsonl_records
from veoptim.data.sft import (
    FIRST_TRAINED,
    NUM_TOKENS,
    Truncation,
    encode_conversations,
    summarize_truncation,
    to_examples,
)
from veoptim.data.sources import ReadOptions, TokenCache
from veoptim.data.tokenizer import tokenizer_identity
from veoptim.errors import DataError

log = logging.getLogger(__name__)

#: File extension -> the ``datasets`` builder that reads it.
FILE_BUILDERS = {
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
}
#: Part of every cache key: bump it when tokenization or a layout changes what it produces.
CACHE_VERSION = "sft-tokens-1"
CACHE_SUBDIR = "veoptim_sft"
FEATURES = datasets.Features(
    {
        INPUT_IDS: datasets.List(datasets.Value("int32")),
        LABELS: datasets.List(datasets.Value("int32")),
        NUM_TOKENS: datasets.Value("int64"),
        FIRST_TRAINED: datasets.Value("int64"),
    }
)
#: Text files up to this size are checked for being empty before ``datasets`` reads them.
EMPTY_PROBE_BYTES = 4096
JSON_SHAPE = "a JSON array of objects or one JSON object per line"
EXPECTED = (
    f"a {'/'.join(sorted(FILE_BUILDERS))} file, a save_to_disk directory or the name of a "
    "dataset in the local Hugging Face datasets cache"
)


def _reasons(error: BaseException) -> str:
    """Every message of ``error``'s chain, whole, on one line: ``datasets`` wraps the cause
    (a JSON parse error and its position) in "An error occurred while generating the
    dataset", so its first line alone says nothing."""
    parts: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = " ".join(str(current).split())
        parts.append(f"{type(current).__name__}: {text}" if text else type(current).__name__)
        current = current.__cause__ or current.__context__
    return "; from ".join(parts)


def _json_problem(file: Path) -> str | None:
    """Where the JSON(L) ``file`` is not valid JSON, as ``<path>:<line>: ...`` (None: every
    line, or the whole document, parses), read by the same rules as the JSONL reader."""
    with file.open("rb") as f:
        head = f.read(EMPTY_PROBE_BYTES).lstrip()
    if head.startswith(b"["):  # one JSON document (an array of rows)
        try:
            json.loads(file.read_bytes().decode("utf-8"))
        except UnicodeDecodeError:
            return f"{file}: expected UTF-8 text, found undecodable bytes."
        except json.JSONDecodeError as error:
            return (
                f"{file}:{error.lineno}: expected {JSON_SHAPE}, found invalid JSON "
                f"({error.msg} at column {error.colno})."
            )
        return None
    try:
        for _ in jsonl_records(file, "data file"):
            pass
    except DataError as error:
        return str(error)
    return None


def _is_empty_text(file: Path) -> bool:
    """A JSON(L) or CSV file with nothing to read: no bytes, only whitespace or ``[]``
    (``datasets`` fails on those with an empty ``StopIteration`` or a "no data" split)."""
    if file.stat().st_size > EMPTY_PROBE_BYTES:
        return False
    return "".join(file.read_bytes().decode("utf-8", "replace").split()) in ("", "[]")


def _looks_like_path(path: str) -> bool:
    """A missing file is an error of its own; anything else may be a cached dataset's name."""
    return (
        Path(path).suffix.lower() in FILE_BUILDERS
        or path.startswith(("/", ".", "~"))
        or path.count("/") > 1
    )


def _from_disk(directory: Path, split: str) -> datasets.Dataset:
    """``split`` of a save_to_disk directory, with ``load_dataset``'s split syntax
    (``train[:10%]``, ``train+test``); a saved single Dataset is the split ``train``."""
    loaded = datasets.load_from_disk(str(directory))
    splits = dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}
    try:
        parts = datasets.ReadInstruction.from_spec(split).to_absolute(
            {name: len(part) for name, part in splits.items()}
        )
    except ValueError:
        raise DataError(
            f"{directory} (a save_to_disk directory) has no split {split!r} (data.split); "
            f"expected one of {list(splits)}, optionally sliced like 'train[:1000]'."
        ) from None
    selected = [
        part if (p.from_, p.to) == (0, len(part)) else part.select(range(p.from_, p.to))
        for p in parts
        for part in [splits[p.splitname]]
    ]
    return selected[0] if len(selected) == 1 else datasets.concatenate_datasets(selected)


def open_dataset(
    path: str, split: str = "train", subset: str = "", what: str = "SFT data"
) -> datasets.Dataset:
    """The ``split`` of the data at ``path`` (file, directory or cached name) as a ``Dataset``;
    ``what`` names the data in errors."""
    local = Path(path)
    try:
        if local.is_file():
            builder = FILE_BUILDERS.get(local.suffix.lower())
            if builder is None:
                raise DataError(
                    f"{what} file {path} has the unsupported extension {local.suffix!r}; "
                    f"expected {EXPECTED}."
                )
            if builder in ("json", "csv") and _is_empty_text(local):
                shape = "a header line and rows" if builder == "csv" else JSON_SHAPE
                raise DataError(
                    f"{what} file {path} is empty: it holds no rows (expected {shape})."
                )
            return datasets.load_dataset(builder, data_files={"train": str(local)}, split=split)
        if local.is_dir():
            state = (
                datasets.config.DATASET_STATE_JSON_FILENAME,
                datasets.config.DATASETDICT_JSON_FILENAME,
            )
            if any((local / name).is_file() for name in state):
                return _from_disk(local, split)
            return datasets.load_dataset(str(local), subset or None, split=split)
        if _looks_like_path(path):
            raise DataError(f"{what} file {path} does not exist (expected {EXPECTED}).")
        try:
            return datasets.load_dataset(path, subset or None, split=split)
        except Exception as error:
            raise DataError(
                f"{what} {path!r} is neither a local file or directory nor a dataset in the "
                f"local Hugging Face datasets cache ({datasets.config.HF_DATASETS_CACHE}) "
                f"for split {split!r}: {_reasons(error)}"
            ) from error
    except DataError:
        raise
    except Exception as error:  # datasets and pyarrow raise many types for unreadable data
        problem = (
            _json_problem(local) if FILE_BUILDERS.get(local.suffix.lower()) == "json" else None
        )
        raise DataError(
            f"could not read {what} {path} (data.split={split!r}) with datasets: "
            + (problem or _reasons(error))
        ) from error


def cache_key(
    dataset: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    layout: Layout,
    max_seq_len: int,
    train_tool_turns: bool,
) -> str:
    """The tokenized cache's name: every input that changes the tokens is in it."""
    parts = [
        CACHE_VERSION,
        dataset._fingerprint,  # datasets' own identity of the source rows
        len(dataset),
        layout.name,
        layout.columns,
        layout.role_tag,
        layout.content_tag,
        max_seq_len,
        train_tool_turns,
        tokenizer_identity(tokenizer),
    ]
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:40]


class RowEncoder:
    """The ``Dataset.map`` function: a batch of rows -> token columns (picklable, so it runs
    in ``num_proc`` worker processes)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        layout: Layout,
        source: str,
        max_seq_len: int,
        train_tool_turns: bool,
    ) -> None:
        self.tokenizer, self.layout, self.source = tokenizer, layout, source
        self.max_seq_len, self.train_tool_turns = max_seq_len, train_tool_turns

    def __call__(self, batch: dict[str, list[Any]], indices: list[int]) -> dict[str, list]:
        rows = [{name: batch[name][k] for name in batch} for k in range(len(indices))]
        wheres = [f"{self.source} row {i}" for i in indices]
        conversations = [row_messages(self.layout, r, w) for r, w in zip(rows, wheres, strict=True)]
        return encode_conversations(
            conversations,
            wheres,
            self.tokenizer,
            self.max_seq_len,
            train_tool_turns=self.train_tool_turns,
        )


def _lists(dataset: datasets.Dataset, column: str) -> list[np.ndarray]:
    """A list column as int64 arrays (copies: the cache file is read-only memory)."""
    chunks = dataset.data.column(column).chunks
    return [row.astype(np.int64) for chunk in chunks for row in chunk.to_numpy(False)]


@contextlib.contextmanager
def environment_kept() -> Iterator[None]:
    """Keep the process's ``os.environ`` (the object and its contents) across the block.

    ``Dataset.map`` with ``num_proc`` sets ``TOKENIZERS_PARALLELISM`` for its workers and
    then rebinds ``os.environ`` to a copy taken before: whoever holds the real mapping (or
    later removes a variable from it) would no longer see what subprocesses inherit.
    """
    environ, saved = os.environ, dict(os.environ)
    try:
        yield
    finally:
        os.environ = environ  # noqa: B003 -- rebinding back to the real mapping is the point
        for name in set(environ) - set(saved):
            del environ[name]
        environ.update(saved)


def read_with_datasets(
    path: str, tokenizer: PreTrainedTokenizerBase, max_seq_len: int, options: ReadOptions
) -> tuple[list[Example], Truncation, TokenCache]:
    """Tokenized examples of ``path`` (through the cache), what truncation cut, the cache."""
    dataset = open_dataset(path, options.split, options.subset)
    if len(dataset) == 0:
        raise DataError(f"SFT data {path} (split {options.split!r}) has no examples.")
    layout = resolve_layout(options.layout, options.columns, dataset.column_names, path)
    dataset = dataset.select_columns(sorted(set(layout.columns.values())))
    key = cache_key(dataset, tokenizer, layout, max_seq_len, options.train_tool_turns)
    cache_dir = Path(datasets.config.HF_DATASETS_CACHE) / CACHE_SUBDIR
    cache_dir.mkdir(parents=True, exist_ok=True)
    before = set(os.listdir(cache_dir))
    encode = RowEncoder(tokenizer, layout, path, max_seq_len, options.train_tool_turns)
    with environment_kept():
        tokenized = dataset.map(
            encode,
            with_indices=True,
            batched=True,
            remove_columns=dataset.column_names,
            features=FEATURES,
            num_proc=options.num_proc if options.num_proc > 1 else None,
            cache_file_name=str(cache_dir / f"sft-{key}.arrow"),
            new_fingerprint=key,
            desc=f"Tokenizing {path}",
        )
    files = tuple(f["filename"] for f in tokenized.cache_files)
    cache = TokenCache(files, reused=bool(files) and all(Path(f).name in before for f in files))
    log.info(
        "%s the tokenized examples of %s: %s",
        "reused" if cache.reused else "wrote",
        path,
        ", ".join(files) or "in memory",
    )
    truncation = summarize_truncation(
        tokenized.data.column(NUM_TOKENS).to_numpy(),
        tokenized.data.column(FIRST_TRAINED).to_numpy(),
        max_seq_len,
    )
    return to_examples(_lists(tokenized, INPUT_IDS), _lists(tokenized, LABELS)), truncation, cache
