"""Dynamic loss scaling for fp16 compute (``model.dtype=fp16``).

FP16 holds gradients down to about 6e-8; the smaller ones of a language model vanish. The
trainer multiplies the loss by ``scale`` before the backward, so the gradients it produces
are ``scale`` times larger, and the exact optimizers divide them again in FP32
(``ExactAdamW.step(grad_divisor=...)``), after the FP16 storage they had to survive.

A step whose scaled gradients hold an inf or a nan (their global norm is not finite) is
skipped: no optimizer step, no LR scheduler step, the masters, moments and step counters
untouched; the scale halves. After ``growth_interval`` clean steps in a row the scale
doubles. The scale is always a power of two, so scaling and unscaling are exact and the
state is plain JSON, restored bitwise (the ``loss_scale`` checkpoint component).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from veoptim.arith import is_power_of_two
from veoptim.errors import CheckpointError, ConfigError, DivergedError

BACKOFF = 0.5
GROWTH = 2.0
#: Below this scale an overflow is the loss's own, not the scale's: the run diverged.
MIN_SCALE = 1.0
STATE_KEYS = ("scale", "growth_interval", "clean_steps", "skipped_steps")


@dataclass
class DynamicLossScaler:
    """The scale of the next step, and how it got there (a ``state_dict`` object)."""

    scale: float = 2.0**16
    growth_interval: int = 2000
    #: Clean steps since the scale last changed.
    clean_steps: int = 0
    #: Steps skipped over the whole run (metrics report it).
    skipped_steps: int = 0

    def __post_init__(self) -> None:
        if not is_power_of_two(self.scale) or self.scale < MIN_SCALE:
            raise ConfigError(
                f"train.loss_scale_init must be a power of two >= {MIN_SCALE:g}, got {self.scale!r}."
            )
        if isinstance(self.growth_interval, bool) or not (
            isinstance(self.growth_interval, int) and self.growth_interval >= 1
        ):
            raise ConfigError(
                "train.loss_scale_growth_interval must be a positive int, got "
                f"{self.growth_interval!r}."
            )
        self.scale = float(self.scale)

    def update(self, found_inf: bool, step: int) -> None:
        """After step ``step``: halve on an overflow (skipped), double after enough clean steps."""
        if found_inf:
            if self.scale <= MIN_SCALE:
                raise DivergedError(
                    f"fp16 step {step} overflowed (inf/nan gradients) at the smallest loss scale "
                    f"{MIN_SCALE:g}: the loss itself is not finite; train in bf16 or with a lower "
                    "optim.lr."
                )
            self.scale *= BACKOFF
            self.clean_steps = 0
            self.skipped_steps += 1
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= GROWTH
            self.clean_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: Any) -> None:
        """Install a saved state after checking all of it (nothing changes on a refusal)."""
        if not isinstance(state, dict) or set(state) != set(STATE_KEYS):
            raise CheckpointError(
                f"loss scaler state must have keys {list(STATE_KEYS)}, found {state!r}."
            )
        if not is_power_of_two(state["scale"]) or state["scale"] < MIN_SCALE:
            raise CheckpointError(
                f"saved loss scale must be a power of two >= {MIN_SCALE:g}, found {state['scale']!r}."
            )
        counts = [state[k] for k in ("clean_steps", "skipped_steps")]
        if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts):
            raise CheckpointError(
                f"saved loss scaler counts must be non-negative ints, found {state!r}."
            )
        if state["growth_interval"] != self.growth_interval:
            raise CheckpointError(
                f"the checkpoint's loss scaler grows every {state['growth_interval']!r} clean steps, "
                f"this run's every {self.growth_interval} (train.loss_scale_growth_interval); resume "
                "with the saved value."
            )
        self.scale = float(state["scale"])
        self.clean_steps, self.skipped_steps = counts
