"""The config schemas of the SFT and DPO tasks (``python -m tasks.sft``, ``tasks.dpo``).

They import no torch: a task command checks its command line against them (every key,
type and value) and answers a mistake or ``--help`` in about a second, before the
objective, the model and torch are loaded. ``build_objective`` imports what it builds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from veoptim.config.schema import DataConfig, TrainerConfig, opt

if TYPE_CHECKING:
    from veoptim.data.sources import ReadOptions
    from veoptim.objectives.dpo import DPOObjective
    from veoptim.objectives.sft import SFTObjective


@dataclass
class SFTColumnsConfig:
    """The data's names for data.layout's columns, where they differ ('' = the layout's own)."""

    messages: str = opt("", "messages layout: the list of {role, content} ('messages').")
    prompt: str = opt("", "prompt_response layout: the prompt string ('prompt').")
    response: str = opt(
        "", "prompt_response layout: the response string ('response'; 'completion' is detected)."
    )
    instruction: str = opt("", "alpaca layout: the instruction ('instruction').")
    input: str = opt("", "alpaca layout: optional input, appended after a newline ('input').")
    output: str = opt("", "alpaca layout: the response ('output').")
    history: str = opt(
        "", "alpaca layout: optional earlier [instruction, output] pairs ('history')."
    )
    conversations: str = opt("", "sharegpt layout: the list of turns ('conversations').")
    role_tag: str = opt("", "sharegpt layout: each turn's speaker key ('from').")
    content_tag: str = opt("", "sharegpt layout: each turn's text key ('value').")
    system: str = opt(
        "", "prompt_response, alpaca and sharegpt layouts: optional system prompt ('system')."
    )


@dataclass
class SFTDataConfig(DataConfig):
    train_path: str = opt(
        "",
        "SFT data: a .jsonl file (veoptim's JSONL reader), a .parquet/.arrow/.json/.csv file, "
        "a save_to_disk directory or a dataset name in the local HF datasets cache (read "
        "with datasets); empty = the bundled synthetic dataset.",
    )
    packing: bool = opt(False, "Pack several examples into each sequence instead of padding.")
    padding_free: bool = opt(
        False,
        "Collate each micro-batch as one row of its examples side by side, each attending only "
        "to itself, padded at its end only (to a multiple of 64 tokens); the same examples, "
        "labels and loss (rounding aside). Pair with model.attn_implementation=sdpa_varlen, which attends "
        "within each example only (sdpa attends over the whole row through a mask).",
    )
    source: str = opt(
        "auto",
        "Reader: auto | jsonl | datasets. auto = the JSONL reader for a .jsonl file (or the "
        "bundled data) when data.layout is auto and data.columns is unset, else datasets.",
    )
    layout: str = opt(
        "auto",
        "Row layout (both readers): auto (told from the columns; a .jsonl's per line, from its "
        "keys) | messages | sharegpt | alpaca | prompt_response.",
    )
    columns: SFTColumnsConfig = field(default_factory=SFTColumnsConfig)
    split: str = opt("train", "Split to train on (datasets), e.g. train, test or train[:1000].")
    subset: str = opt(
        "", "The dataset's configuration name (load_dataset's name=; datasets); '' = default."
    )
    num_proc: int = opt(
        1,
        "Worker processes that tokenize (datasets' map); the tokenized examples are cached "
        "and reused by a later run with the same data, tokenizer and data options.",
    )
    train_tool_turns: bool = opt(
        False,
        "Also train the 'tool' turns (a tool's output) of chats; false = they are context only.",
    )

    def read_options(self) -> ReadOptions:
        """The reader options of these keys (data.columns: only the names that are set)."""
        from veoptim.data.sources import ReadOptions

        columns = {k: v for k, v in dataclasses.asdict(self.columns).items() if v}
        return ReadOptions(
            self.source,
            self.layout,
            columns,
            self.split,
            self.subset,
            self.num_proc,
            self.train_tool_turns,
        )


@dataclass
class SFTConfig(TrainerConfig):
    """Root config of ``python -m tasks.sft``."""

    data: SFTDataConfig = field(default_factory=SFTDataConfig)

    def build_objective(self, tokenizer: Any) -> SFTObjective:
        from veoptim.data import load_sft_dataset
        from veoptim.objectives.sft import SFTObjective

        return SFTObjective(
            load_sft_dataset(
                self.data.train_path,
                tokenizer,
                self.data.max_seq_len,
                self.data.packing,
                self.data.read_options(),
            ),
            tokenizer.pad_token_id,
            self.data.padding_free,
        )


@dataclass
class DPODataConfig(DataConfig):
    train_path: str = opt(
        "",
        "Preference pairs JSONL (prompt or messages, chosen, rejected); empty = the bundled pairs.",
    )


@dataclass
class DPOSection:
    beta: float = opt(0.1, "Strength of the KL penalty towards the reference (> 0).")
    label_smoothing: float = opt(
        0.0, "sigmoid loss: assumed share of flipped preference labels, in [0, 0.5)."
    )
    loss: str = opt("sigmoid", "sigmoid (DPO) | ipo.")


@dataclass
class DPOConfig(TrainerConfig):
    """Root config of ``python -m tasks.dpo``."""

    data: DPODataConfig = field(default_factory=DPODataConfig)
    dpo: DPOSection = field(default_factory=DPOSection)

    def build_objective(self, tokenizer: Any) -> DPOObjective:
        from veoptim.data.pairs import load_pair_dataset
        from veoptim.objectives.dpo import DPOObjective, check_dpo

        check_dpo(self.dpo)
        dataset = load_pair_dataset(self.data.train_path, tokenizer, self.data.max_seq_len)
        return DPOObjective(dataset, tokenizer.pad_token_id, self.dpo, self.lora.enabled)
