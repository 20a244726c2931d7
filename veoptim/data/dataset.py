"""The SFT dataset a run trains on: read with veoptim's JSONL reader or ``datasets``
(``sources.py`` decides), tokenized by ``sft.py``, optionally packed.

The ``datasets`` reader (``hf_datasets.py``) is imported only when it is used.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from veoptim.data.packing import Example, pack_examples
from veoptim.data.paths import bundled_dataset_path
from veoptim.data.records import read_conversations
from veoptim.data.sft import Truncation, report_truncation, tokenize_conversations
from veoptim.data.sources import ReadOptions, TokenCache
from veoptim.errors import DataError


@dataclass
class SFTDataset:
    """Tokenized (optionally packed) SFT examples; ``dataset[i]`` is a dict of 1-D long tensors.

    Without packing an item has ``input_ids`` and ``labels``; with packing each item
    is exactly ``max_seq_len`` long and also has ``position_ids`` that restart at 0
    for every example in it (see :mod:`veoptim.data.packing`).
    """

    path: Path
    max_seq_len: int
    packing: bool
    items: list[Example]
    num_examples: int
    num_truncated: int
    truncation: Truncation = Truncation()
    #: The tokenized cache of data read with ``datasets`` (None: read by the JSONL reader).
    token_cache: TokenCache | None = None

    def __len__(self) -> int:
        return len(self.items)

    @cached_property
    def fingerprint(self) -> str:
        """SHA-256 of every item's tensors in order: what a sampler position refers to.

        Hashing the tokenized items (not the file) catches edited examples, a different
        tokenizer, max_seq_len or packing, and ignores formatting-only changes.
        """
        digest = hashlib.sha256()
        for item in self.items:
            for key in sorted(item):
                tensor = item[key]
                digest.update(f"{key}:{tensor.numel()};".encode())
                digest.update(tensor.numpy().tobytes())
        return digest.hexdigest()

    def __getitem__(self, index: int) -> Example:
        return self.items[index]


def load_sft_dataset(
    path: str,
    tokenizer: PreTrainedTokenizerBase,
    max_seq_len: int,
    packing: bool,
    options: ReadOptions | None = None,
) -> SFTDataset:
    """Read the SFT data at ``path`` ('' = bundled) into an :class:`SFTDataset`: JSONL with
    veoptim's reader, or anything ``datasets`` reads (``options`` decide; see ``sources.py``)."""
    options = options or ReadOptions()
    options.check()
    if max_seq_len < 2:
        raise DataError(
            f"data.max_seq_len must be >= 2 (a token and its successor), got {max_seq_len}."
        )
    if tokenizer.pad_token_id is None:
        raise DataError("the tokenizer has no pad token; load it with veoptim.data.load_tokenizer.")
    file = Path(path) if path else bundled_dataset_path()
    token_cache = None
    if options.uses_datasets(path):
        from veoptim.data.hf_datasets import read_with_datasets  # datasets loads only if used

        examples, truncation, token_cache = read_with_datasets(
            path or str(file), tokenizer, max_seq_len, options
        )
    else:
        examples, truncation = tokenize_conversations(
            read_conversations(file, options.layout, options.columns),
            tokenizer,
            max_seq_len,
            file,
            train_tool_turns=options.train_tool_turns,
        )
    report_truncation(truncation, len(examples), max_seq_len, file)
    items = pack_examples(examples, max_seq_len, tokenizer.pad_token_id) if packing else examples
    return SFTDataset(
        file,
        max_seq_len,
        packing,
        items,
        len(examples),
        truncation.num_truncated,
        truncation,
        token_cache,
    )
