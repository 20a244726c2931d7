"""A deterministic global-batch sampler whose position is checkpointable state.

Semantics (the same on 1 or N data-parallel ranks):

- Epoch ``e`` visits the examples in the order of a permutation drawn from
  ``numpy.random.default_rng([seed, e])`` (its own generator; global RNGs are
  never touched).
- Optimizer step ``s`` of an epoch consumes the global batch
  ``perm[s * G:(s + 1) * G]`` (``G = global_batch_size``); the incomplete tail
  of an epoch (``num_examples % G`` examples) is dropped.
- Rank ``r`` of ``dp_size`` takes the *contiguous* share
  ``batch[r * G / dp_size:(r + 1) * G / dp_size]``, split into
  ``G / (dp_size * micro_batch_size)`` micro-batches (the accumulation steps).
  The union over ranks is the global batch, whatever ``dp_size`` is.
- The position (epoch, step in epoch) is the whole state; it does not depend
  on ``dp_size`` or ``micro_batch_size``, so a run may resume on another number
  of ranks and continue with the same global batches.
- With ``indices`` (the training examples left by an evaluation hold-out), the
  permutation orders positions in ``indices`` and yields the examples at them:
  nothing outside ``indices`` is ever drawn.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from veoptim.arith import divisors
from veoptim.errors import CheckpointError, ConfigError, DataError

STATE_VERSION = 1
KEY_VERSION = "version"
KEY_EPOCH = "epoch"
KEY_STEP_IN_EPOCH = "step_in_epoch"
KEY_SEED = "seed"
KEY_NUM_EXAMPLES = "num_examples"
KEY_GLOBAL_BATCH_SIZE = "global_batch_size"
KEY_DATA_FINGERPRINT = "data_fingerprint"


def _check_sizes(
    num_examples: int,
    global_batch_size: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
) -> None:
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ConfigError(
            f"data-parallel rank must be in [0, dp_size); got dp_rank={dp_rank}, dp_size={dp_size}."
        )
    if seed < 0:
        raise ConfigError(f"train.seed must be >= 0, got {seed}.")
    if global_batch_size < 1 or global_batch_size % dp_size:
        multiples = [dp_size * k for k in range(1, 5)]
        raise ConfigError(
            f"train.global_batch_size must be a positive multiple of the data-parallel size "
            f"{dp_size} (e.g. {multiples}), got {global_batch_size}."
        )
    per_rank = global_batch_size // dp_size
    if micro_batch_size < 1 or per_rank % micro_batch_size:
        raise ConfigError(
            f"train.micro_batch_size must divide the per-rank batch global_batch_size/dp_size = "
            f"{global_batch_size}/{dp_size} = {per_rank}; valid choices are {divisors(per_rank)}, "
            f"got {micro_batch_size}."
        )
    if num_examples < global_batch_size:
        raise DataError(
            f"the dataset has {num_examples} sequences, fewer than one global batch "
            f"(train.global_batch_size={global_batch_size}); use more data or a smaller batch."
        )


class GlobalBatchSampler:
    """Yields this rank's micro-batches of indices, one optimizer step at a time."""

    def __init__(
        self,
        num_examples: int,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        data_fingerprint: str = "",
        indices: Sequence[int] | None = None,
    ) -> None:
        if indices is not None and len(indices) != num_examples:
            raise ConfigError(
                f"the sampler got {len(indices)} example indices for num_examples={num_examples}."
            )
        _check_sizes(num_examples, global_batch_size, micro_batch_size, dp_rank, dp_size, seed)
        self.num_examples = num_examples
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        #: Identifies the examples the indices refer to ('' = unknown, not checked on load).
        self.data_fingerprint = data_fingerprint
        #: The example ids drawn from (None: ``range(num_examples)``).
        self.indices = None if indices is None else np.asarray(indices, dtype=np.int64)
        self._epoch = 0
        self._step_in_epoch = 0
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    @property
    def epoch(self) -> int:
        """Epoch of the next step ``next_step`` returns."""
        return self._epoch

    @property
    def step_in_epoch(self) -> int:
        """Steps of the current epoch already consumed."""
        return self._step_in_epoch

    @property
    def steps_per_epoch(self) -> int:
        """Full global batches per epoch (the incomplete tail is dropped)."""
        return self.num_examples // self.global_batch_size

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches per optimizer step on each rank."""
        return self.global_batch_size // (self.dp_size * self.micro_batch_size)

    def permutation(self, epoch: int) -> np.ndarray:
        """The visiting order of ``epoch`` (a pure function of ``seed``, ``epoch`` and
        ``indices``): example ids."""
        if self._perm_epoch != epoch:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)
            self._perm = perm if self.indices is None else self.indices[perm]
            self._perm_epoch = epoch
        assert self._perm is not None
        return self._perm

    def global_batch(self, epoch: int, step_in_epoch: int) -> list[int]:
        """All indices of one optimizer step, over every rank, in rank order."""
        start = step_in_epoch * self.global_batch_size
        return self.permutation(epoch)[start : start + self.global_batch_size].tolist()

    def next_step(self) -> list[list[int]]:
        """This rank's micro-batches for the next optimizer step; rolls over to the next epoch."""
        batch = self.global_batch(self._epoch, self._step_in_epoch)
        per_rank = self.global_batch_size // self.dp_size
        share = batch[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]
        micro = self.micro_batch_size
        self._step_in_epoch += 1
        if self._step_in_epoch == self.steps_per_epoch:
            self._epoch += 1
            self._step_in_epoch = 0
        return [share[i : i + micro] for i in range(0, per_rank, micro)]

    def state_dict(self) -> dict[str, int | str]:
        """The position (JSON-serializable ints) plus what it is only valid for."""
        return {
            KEY_VERSION: STATE_VERSION,
            KEY_EPOCH: self._epoch,
            KEY_STEP_IN_EPOCH: self._step_in_epoch,
            KEY_SEED: self.seed,
            KEY_NUM_EXAMPLES: self.num_examples,
            KEY_GLOBAL_BATCH_SIZE: self.global_batch_size,
            KEY_DATA_FINGERPRINT: self.data_fingerprint,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the position; fails (changing nothing) if it belongs to other data or batches."""
        if not isinstance(state, dict) or state.get(KEY_VERSION) != STATE_VERSION:
            found = state.get(KEY_VERSION) if isinstance(state, dict) else type(state).__name__
            raise CheckpointError(
                f"sampler state version must be {STATE_VERSION}, found {found!r}."
            )
        for key, live in (
            (KEY_SEED, self.seed),
            (KEY_NUM_EXAMPLES, self.num_examples),
            (KEY_GLOBAL_BATCH_SIZE, self.global_batch_size),
        ):
            if state.get(key) != live:
                raise CheckpointError(
                    f"sampler state was saved with {key}={state.get(key)!r} but this run has "
                    f"{key}={live}; the data order cannot continue (resume with the same data, "
                    "train.seed and train.global_batch_size)."
                )
        saved_fingerprint = state.get(KEY_DATA_FINGERPRINT) or ""
        if (
            saved_fingerprint
            and self.data_fingerprint
            and saved_fingerprint != self.data_fingerprint
        ):
            raise CheckpointError(
                f"the training data differs from the checkpoint's (tokenized-content fingerprint "
                f"saved {saved_fingerprint[:16]}, live {self.data_fingerprint[:16]}): the same "
                "indices would pick other examples, so the data order cannot continue; resume "
                "with the data file, tokenizer and data.max_seq_len/packing the run was saved "
                "with, or load weights only (checkpoint.load_optimizer=false)."
            )
        epoch, step = state.get(KEY_EPOCH), state.get(KEY_STEP_IN_EPOCH)
        if not (isinstance(epoch, int) and isinstance(step, int)) or epoch < 0:
            raise CheckpointError(
                f"sampler state has invalid epoch/step_in_epoch {epoch!r}/{step!r}."
            )
        if not 0 <= step < self.steps_per_epoch:
            raise CheckpointError(
                f"sampler state step_in_epoch={step} is outside [0, {self.steps_per_epoch})."
            )
        self._epoch, self._step_in_epoch = epoch, step
