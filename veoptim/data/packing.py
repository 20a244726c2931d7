"""Sequence packing: several examples per row, each still attending only to itself.

Examples are packed greedily in dataset order (an example never spans two rows;
one longer than the row was already truncated). Each row is padded to exactly
``max_seq_len``: pad tokens get label -100. ``position_ids`` restart at 0 at
every example and at the padding, which is how transformers recognises packed
rows: a model called with ``position_ids`` and *no* ``attention_mask`` builds a
block-diagonal causal mask from the restarts (sdpa, eager, flex; flash-attention
derives its varlen boundaries the same way), and rotary positions equal those
of the example run alone. The first token of each example gets label -100, so
no token is trained to predict across an example boundary.
"""

from __future__ import annotations

import torch

from veoptim.data.fields import IGNORE_INDEX, INPUT_IDS, LABELS, POSITION_IDS

Example = dict[str, torch.Tensor]


def _flush(parts: list[Example], max_seq_len: int, pad_id: int) -> Example:
    used = sum(len(p[INPUT_IDS]) for p in parts)
    pad = max_seq_len - used
    input_ids = [p[INPUT_IDS] for p in parts]
    labels = []
    for p in parts:
        part_labels = p[LABELS].clone()
        part_labels[0] = IGNORE_INDEX
        labels.append(part_labels)
    positions = [torch.arange(len(p[INPUT_IDS]), dtype=torch.long) for p in parts]
    if pad:
        input_ids.append(torch.full((pad,), pad_id, dtype=torch.long))
        labels.append(torch.full((pad,), IGNORE_INDEX, dtype=torch.long))
        positions.append(torch.arange(pad, dtype=torch.long))
    return {
        INPUT_IDS: torch.cat(input_ids),
        LABELS: torch.cat(labels),
        POSITION_IDS: torch.cat(positions),
    }


def pack_row(examples: list[Example], pad_id: int, multiple: int = 1) -> Example:
    """``examples`` as one row (``data.padding_free``): a micro-batch's examples side by
    side, each attending only to itself, the same labels trained; padded at the end (as
    packing pads, a document of its own labelled -100) to a multiple of ``multiple``."""
    used = sum(len(e[INPUT_IDS]) for e in examples)
    return _flush(examples, -(-used // multiple) * multiple, pad_id)


def pack_examples(examples: list[Example], max_seq_len: int, pad_id: int) -> list[Example]:
    """Pack ``examples`` (each at most ``max_seq_len`` long) into rows of exactly ``max_seq_len``."""
    rows: list[Example] = []
    parts: list[Example] = []
    used = 0
    for example in examples:
        length = len(example[INPUT_IDS])
        if length == 0:
            continue
        if parts and used + length > max_seq_len:
            rows.append(_flush(parts, max_seq_len, pad_id))
            parts, used = [], 0
        parts.append(example)
        used += length
    if parts:
        rows.append(_flush(parts, max_seq_len, pad_id))
    return rows
