"""Supervised fine-tuning: next-token cross-entropy on the response tokens of chat data.

The loss of a micro-batch is the *sum* of its labelled tokens' cross-entropy (in
FP32); the trainer divides by the global count of labelled tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from veoptim.checkpoint.component import StateComponent
from veoptim.config.schema import DataConfig, TrainerConfig, opt
from veoptim.data import IGNORE_INDEX, ReadOptions, SFTDataset, collate, load_sft_dataset
from veoptim.data.fields import INPUT_IDS, LABELS
from veoptim.trainer.evaluation import perplexity
from veoptim.trainer.objective import LossSum, MicroBatch


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
        return SFTObjective(
            load_sft_dataset(
                self.data.train_path,
                tokenizer,
                self.data.max_seq_len,
                self.data.packing,
                self.data.read_options(),
            ),
            tokenizer.pad_token_id,
        )


def count_loss_tokens(labels: torch.Tensor) -> int:
    """Number of positions that carry a loss after the causal shift."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def summed_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of next-token cross-entropy in FP32 over labelled positions."""
    shift_logits = logits[:, :-1, :].float()
    shift_labels = labels[:, 1:]
    return F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)),
        shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


class SFTObjective:
    """Chat/instruction examples; loss on the assistant tokens only."""

    normaliser_name = "response tokens (check data.max_seq_len and the data's responses)"

    def __init__(self, dataset: SFTDataset, pad_id: int) -> None:
        self.dataset, self.pad_id = dataset, pad_id
        self.num_examples = len(dataset)
        self.data_fingerprint = dataset.fingerprint

    def setup(self, model: torch.nn.Module, starting_model: Callable[[], torch.nn.Module]) -> None:
        """SFT needs no reference model."""

    def micro_batch(self, indices: list[int]) -> MicroBatch:
        batch = collate([self.dataset[i] for i in indices], self.pad_id)
        return MicroBatch(
            inputs=batch,
            normaliser=count_loss_tokens(batch[LABELS]),
            tokens=int((batch[INPUT_IDS] != self.pad_id).sum()),
        )

    def loss(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> LossSum:
        model_inputs = {k: v for k, v in inputs.items() if k != LABELS}
        # use_cache=False: a KV cache is useless in training and, with packing,
        # transformers would skip the per-example attention masking.
        logits = model(**model_inputs, use_cache=False).logits
        return LossSum(summed_token_loss(logits, inputs[LABELS]))

    def eval_metrics(self, loss: float, metrics: dict[str, float]) -> dict[str, float]:
        """The loss is a mean over response tokens, so its exp is their perplexity."""
        return {"loss": loss, "perplexity": perplexity(loss), **metrics}

    def state_components(self) -> Mapping[str, StateComponent]:
        return {}
