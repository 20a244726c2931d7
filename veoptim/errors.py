"""Typed errors. Each message says what was expected, what was found, and where."""


class VeoptimError(Exception):
    """Base class of every error veoptim raises on purpose."""


class ConfigError(VeoptimError, ValueError):
    """A configuration value is missing, unknown, of the wrong type or inconsistent."""


class DataError(VeoptimError, ValueError):
    """Training data is malformed (the message names the file and line)."""


class CheckpointError(VeoptimError, RuntimeError):
    """A checkpoint could not be written, published, read, validated or applied."""


class DistributedError(VeoptimError, RuntimeError):
    """The process group, device or parallel plan could not be set up."""


class LiveStateInvalidError(CheckpointError):
    """Applying a checkpoint failed after live state was written: the run must not continue."""


class PreemptedError(VeoptimError, RuntimeError):
    """Training stopped on SIGTERM/SIGINT after saving; the message says how to resume."""


class SlotError(VeoptimError, RuntimeError):
    """A multi-LoRA slot operation failed; only that slot's caller sees it, and every other
    slot is untouched. ``slot`` is the slot index the call named."""

    def __init__(self, slot: int, message: str) -> None:
        super().__init__(f"slot {slot}: {message}")
        self.slot = slot


class SlotStateInvalidError(SlotError):
    """Loading a slot failed after its live state was written: reset, release or load it
    again before training it (other slots are unaffected)."""


class DivergedError(VeoptimError, RuntimeError):
    """Training cannot go on: an fp16 step overflowed even at the smallest loss scale."""
