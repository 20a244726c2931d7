"""Which reader SFT data goes through, and the options of the ``datasets`` one.

Two readers share one tokenization (``veoptim/data/sft.py``): veoptim's JSONL reader,
whose errors name the file and line, and Hugging Face ``datasets`` (local parquet, arrow,
JSON(L) and CSV files, ``save_to_disk`` directories, datasets in the local HF cache),
which adds splits, ``num_proc`` workers and a tokenization cache. Both read records by
the same layout table (``veoptim/data/conversation_shapes.py``). ``source="auto"`` keeps every existing
config on the JSONL reader: a ``.jsonl`` file (or the bundled data) with ``layout="auto"``
and no column renames goes there, everything else goes to ``datasets``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from veoptim.data.conversation_shapes import LAYOUT_AUTO, LAYOUTS
from veoptim.errors import ConfigError

SOURCE_AUTO, SOURCE_JSONL, SOURCE_DATASETS = "auto", "jsonl", "datasets"
SOURCES: tuple[str, ...] = (SOURCE_AUTO, SOURCE_JSONL, SOURCE_DATASETS)


@dataclass(frozen=True)
class ReadOptions:
    """How to read SFT data beyond its path (``data.*`` keys of the same names)."""

    source: str = SOURCE_AUTO
    layout: str = LAYOUT_AUTO
    #: A layout's canonical column (or ShareGPT entry key) -> the name in the data.
    columns: Mapping[str, str] = field(default_factory=dict)
    split: str = "train"
    #: The dataset's configuration name (``load_dataset(path, name=...)``); '' = its default.
    subset: str = ""
    num_proc: int = 1
    #: Label the tool turns too (masked by default: a tool's output is not the model's).
    train_tool_turns: bool = False

    def check(self) -> None:
        """``ConfigError`` naming the key of an unknown or inconsistent value."""
        if self.source not in SOURCES:
            raise ConfigError(f"data.source must be one of {list(SOURCES)}, got {self.source!r}.")
        if self.layout not in (LAYOUT_AUTO, *LAYOUTS):
            raise ConfigError(
                f"data.layout must be one of {[LAYOUT_AUTO, *LAYOUTS]}, got {self.layout!r}."
            )
        if self.num_proc < 1:
            raise ConfigError(f"data.num_proc must be >= 1 (1 = no workers), got {self.num_proc}.")
        if not self.split:
            raise ConfigError("data.split must name a split (e.g. 'train' or 'train[:1000]').")

    @property
    def _plain(self) -> bool:
        return self.layout == LAYOUT_AUTO and not self.columns

    def uses_datasets(self, path: str) -> bool:
        """Whether ``path`` ('' = the bundled JSONL) is read with ``datasets``."""
        if self.source != SOURCE_AUTO:
            return self.source == SOURCE_DATASETS
        return not ((not path or path.endswith(".jsonl")) and self._plain)


@dataclass(frozen=True)
class TokenCache:
    """Where the ``datasets`` reader's tokenized examples live, and whether this load reused
    them (no tokenization ran) or wrote them."""

    files: tuple[str, ...]
    reused: bool
