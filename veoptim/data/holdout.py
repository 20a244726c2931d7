"""A deterministic evaluation hold-out (``data.eval_fraction``) of the training examples.

The split is a pure function of the number of examples and the fraction, drawn from
its own generator with a fixed seed: it is the same on every rank, on every resume and
for every ``train.seed`` (runs with different seeds are evaluated on the same
examples). The held-out examples are never trained on: the sampler draws only the
training indices, and its data fingerprint covers the split.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from veoptim.errors import DataError

#: Seed of the hold-out permutation (independent of train.seed by design).
HOLDOUT_SEED = 0x5EED


@dataclass(frozen=True)
class Holdout:
    """Example indices (ascending) to train on and to evaluate on."""

    train: list[int]
    eval: list[int]

    def fingerprint(self, data_fingerprint: str) -> str:
        """The training data's fingerprint extended by the split, so a resume with another
        split is refused; unchanged when nothing is held out."""
        if not self.eval:
            return data_fingerprint
        digest = hashlib.sha256(np.asarray(self.eval, dtype=np.int64).tobytes()).hexdigest()
        return hashlib.sha256(f"{data_fingerprint}|holdout:{digest}".encode()).hexdigest()


def split_holdout(num_examples: int, fraction: float) -> Holdout:
    """Hold out ``round(fraction * num_examples)`` examples (at least one when
    ``fraction > 0``); ``fraction == 0`` trains on everything."""
    if fraction <= 0:
        return Holdout(train=list(range(num_examples)), eval=[])
    count = max(1, round(fraction * num_examples))
    if count >= num_examples:
        raise DataError(
            f"data.eval_fraction={fraction} holds out {count} of the {num_examples} training "
            "examples and leaves none to train on; lower data.eval_fraction."
        )
    order = np.random.default_rng(HOLDOUT_SEED).permutation(num_examples)
    return Holdout(train=sorted(order[count:].tolist()), eval=sorted(order[:count].tolist()))
