"""Supervised fine-tuning: next-token cross-entropy on the response tokens of chat data.

The loss of a micro-batch is the *sum* of its labelled tokens' cross-entropy (in
FP32); the trainer divides by the global count of labelled tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from veoptim.checkpoint import StateComponent
from veoptim.data import IGNORE_INDEX, SFTDataset, collate
from veoptim.data.fields import INPUT_IDS, LABELS
from veoptim.data.packing import pack_row
from veoptim.trainer.evaluation import perplexity
from veoptim.trainer.objective import LossSum, MicroBatch

#: data.padding_free rows are padded to a multiple of this many tokens: every distinct
#: length is a new set of matrix shapes, whose kernels oneDNN keeps (its primitive cache
#: grew the tiny model's peak RSS by 200 MB over 40 steps of unique lengths); at most 63
#: pad tokens per micro-batch bound the shapes.
ROW_MULTIPLE = 64


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

    def __init__(self, dataset: SFTDataset, pad_id: int, padding_free: bool = False) -> None:
        self.dataset, self.pad_id = dataset, pad_id
        #: Collate each micro-batch as one row of its examples side by side (no padding).
        self.padding_free = padding_free
        self.num_examples = len(dataset)
        self.data_fingerprint = dataset.fingerprint

    @property
    def longest_example(self) -> int:
        """Tokens of the longest example (or packed row): ``train.micro_batch_tokens``
        sizes micro-batches from it."""
        return max(len(self.dataset[i][INPUT_IDS]) for i in range(self.num_examples))

    def setup(self, model: torch.nn.Module, starting_model: Callable[[], torch.nn.Module]) -> None:
        """SFT needs no reference model."""

    def micro_batch(self, indices: list[int]) -> MicroBatch:
        examples = [self.dataset[i] for i in indices]
        if self.padding_free:
            examples = [pack_row(examples, self.pad_id, ROW_MULTIPLE)]
        batch = collate(examples, self.pad_id)
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
