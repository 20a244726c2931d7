"""Collate examples into a right-padded batch the model and the loss take directly.

Padded batches carry ``input_ids``, ``labels`` (-100 at padding) and a 2-D
``attention_mask``. Packed rows (items with ``position_ids``) are all
``max_seq_len`` long, so nothing is padded; the batch carries ``position_ids``
and deliberately *no* ``attention_mask``: given only ``position_ids``,
transformers builds the block-diagonal causal mask that keeps packed examples
apart (a 2-D mask of ones would switch that detection off).
"""

from __future__ import annotations

import torch

from veoptim.data.fields import ATTENTION_MASK, IGNORE_INDEX, INPUT_IDS, LABELS, POSITION_IDS
from veoptim.errors import DataError


def _pad(rows: list[torch.Tensor], length: int, value: int) -> torch.Tensor:
    out = torch.full((len(rows), length), value, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def collate(examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Stack ``examples`` (dicts of 1-D long tensors) into a batch, right-padding with ``pad_id``."""
    if not examples:
        raise DataError("collate expected at least one example, found an empty list.")
    if pad_id is None:
        raise DataError("collate expected an integer pad_id, found None.")
    packed = [POSITION_IDS in e for e in examples]
    if any(packed) != all(packed):
        raise DataError("collate expected all examples packed (with position_ids) or none of them.")
    length = max(len(e[INPUT_IDS]) for e in examples)
    input_ids = [e[INPUT_IDS] for e in examples]
    labels = [e[LABELS] for e in examples]
    batch = {
        INPUT_IDS: _pad(input_ids, length, pad_id),
        LABELS: _pad(labels, length, IGNORE_INDEX),
    }
    if all(packed):
        batch[POSITION_IDS] = _pad([e[POSITION_IDS] for e in examples], length, 0)
        return batch
    mask = torch.zeros((len(examples), length), dtype=torch.long)
    for i, ids in enumerate(input_ids):
        mask[i, : len(ids)] = 1
    batch[ATTENTION_MASK] = mask
    return batch
