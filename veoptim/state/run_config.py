"""The resolved run config as a component: saved for the record, checked on load, never
installed. The keys that decide data order, LR schedule and optimizer state must match
the live run's; everything else (logging, checkpoint cadence, run dir, stop_at_step,
parallel sizes within the optimizer layout rules) may change between slices of a run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from veoptim.checkpoint.component import ComponentState, SavedComponent, Staged
from veoptim.errors import CheckpointError

#: Must match on a full (model + optimizer) resume.
RESUME_MUST_MATCH = (
    "model",
    "data",
    "train.max_steps",
    "train.global_batch_size",
    "train.seed",
    "optim.name",
    "scheduler",
)
#: On a weights-only resume only the model must match (shapes are validated anyway).
WEIGHTS_ONLY_MUST_MATCH = ("model.arch", "model.path")
ABSENT = "<absent>"


def _flat(config: Any, key: str) -> dict[str, Any]:
    """``{dotted key: value}`` of ``key`` in ``config``, with mappings flattened to leaves."""
    value: Any = config
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return {key: ABSENT}
        value = value[part]
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for sub in value:
            out.update(_flat(value, sub))
        return {f"{key}.{k}": v for k, v in out.items()}
    return {key: value}


def config_differences(saved: Any, live: dict[str, Any], keys: Sequence[str]) -> list[str]:
    """'key: saved X, live Y' for every listed key (or leaf below it) that differs."""
    saved_flat: dict[str, Any] = {}
    live_flat: dict[str, Any] = {}
    for key in keys:
        saved_flat.update(_flat(saved, key))
        live_flat.update(_flat(live, key))
    return [
        f"{k}: saved {saved_flat.get(k, ABSENT)!r}, live {live_flat.get(k, ABSENT)!r}"
        for k in sorted(set(saved_flat) | set(live_flat))
        if saved_flat.get(k, ABSENT) != live_flat.get(k, ABSENT)
    ]


class RunConfigState:
    """``config`` (the resolved config as plain data); a load requires ``must_match`` equal."""

    def __init__(
        self, config: dict[str, Any], must_match: Sequence[str] = RESUME_MUST_MATCH
    ) -> None:
        self.config, self.must_match = config, tuple(must_match)

    def state(self) -> ComponentState:
        return ComponentState(json=self.config)

    def stage(self, saved: SavedComponent) -> Staged:
        if not isinstance(saved.json, dict):
            raise CheckpointError(f"the {saved.name} state in {saved.path} is not a mapping.")
        diffs = config_differences(saved.json, self.config, self.must_match)
        if diffs:
            hint = (
                " (checkpoint.load_optimizer=false resumes weights only)"
                if self.must_match == RESUME_MUST_MATCH
                else ""
            )
            raise CheckpointError(
                f"checkpoint {saved.path} was written by a run with a different config: "
                + "; ".join(diffs)
                + hint
                + "."
            )
        return Staged()
