"""Trainer progress: the counters a checkpoint saves so a resumed run continues exactly,
and the run's external identities (its wandb run id) that every slice continues.

The epoch is not counted here: it is the sampler's position in the data.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from veoptim.errors import CheckpointError

PROGRESS_KEYS = ("global_step", "tokens_seen")


@dataclass
class TrainerProgress:
    """Real optimizer steps taken and non-padding tokens consumed (global)."""

    global_step: int = 0
    tokens_seen: int = 0

    def state_dict(self) -> dict[str, int]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, int]) -> None:
        if (
            not isinstance(state, dict)
            or set(state) != set(PROGRESS_KEYS)
            or not all(isinstance(state[k], int) and state[k] >= 0 for k in PROGRESS_KEYS)
        ):
            raise CheckpointError(
                f"trainer progress must have non-negative integer keys {list(PROGRESS_KEYS)}, "
                f"found {state!r}."
            )
        for key in PROGRESS_KEYS:
            setattr(self, key, state[key])


@dataclass
class RunIds:
    """Identities of the run outside veoptim, kept in checkpoints so every slice of a run
    continues them: the wandb run id ('' until a wandb callback sets it)."""

    wandb: str = ""

    def state_dict(self) -> dict[str, str]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, str]) -> None:
        if not isinstance(state, dict) or set(state) != {"wandb"}:
            raise CheckpointError(f"run ids must be {{'wandb': <str>}}, found {state!r}.")
        if not isinstance(state["wandb"], str):
            raise CheckpointError(f"the saved wandb run id must be a string, found {state!r}.")
        self.wandb = state["wandb"]
