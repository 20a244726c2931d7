"""The resolved run config as a component: saved for the record, checked on load, never
installed. The keys that decide data order, LR schedule and optimizer state must match
the live run's; everything else (logging, checkpoint cadence, run dir, stop_at_step,
parallel sizes within the optimizer layout rules) may change between slices of a run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from veoptim.checkpoint import ComponentState, SavedComponent, Staged
from veoptim.errors import CheckpointError

#: Must match on a full (model + optimizer) resume.
RESUME_MUST_MATCH = (
    "model",
    "data",
    "train.max_steps",
    "train.epochs",
    "train.global_batch_size",
    "train.seed",
    "optim.name",
    "scheduler",
)
#: Keys inside the sections above that only change how the same run is computed or
#: evaluated, not its result: they may change between slices.
MAY_CHANGE = (
    "model.activation_checkpointing",
    "model.attn_implementation",
    "data.eval_path",
    "data.num_proc",
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


def config_differences(
    saved: Any, live: dict[str, Any], keys: Sequence[str], defaults: dict[str, Any] | None = None
) -> list[str]:
    """'key: saved X, live Y' for every listed key (or leaf below it) that differs. A key
    the saved config lacks (written before the key existed) matches a live value equal to
    its default in ``defaults``; keys in :data:`MAY_CHANGE` are not compared."""
    saved_flat: dict[str, Any] = {}
    live_flat: dict[str, Any] = {}
    default_flat: dict[str, Any] = {}
    for key in keys:
        saved_flat.update(_flat(saved, key))
        live_flat.update(_flat(live, key))
        if defaults is not None:
            default_flat.update(_flat(defaults, key))
    for k, value in live_flat.items():
        absent = saved_flat.get(k, ABSENT) == ABSENT
        if absent and k in default_flat and value == default_flat[k]:
            saved_flat[k] = value
    return [
        f"{k}: saved {saved_flat.get(k, ABSENT)!r}, live {live_flat.get(k, ABSENT)!r}"
        for k in sorted(set(saved_flat) | set(live_flat))
        if saved_flat.get(k, ABSENT) != live_flat.get(k, ABSENT)
        and not any(k == m or k.startswith(m + ".") for m in MAY_CHANGE)
    ]


class RunConfigState:
    """``config`` (the resolved config as plain data); a load requires ``must_match`` equal."""

    def __init__(
        self,
        config: dict[str, Any],
        must_match: Sequence[str] = RESUME_MUST_MATCH,
        defaults: dict[str, Any] | None = None,
    ) -> None:
        """``defaults``: the task's default config, so checkpoints written before a key
        existed still load when the live run leaves that key at its default."""
        self.config, self.must_match, self.defaults = config, tuple(must_match), defaults

    def state(self) -> ComponentState:
        return ComponentState(json=self.config)

    def stage(self, saved: SavedComponent) -> Staged:
        if not isinstance(saved.json, dict):
            raise CheckpointError(f"the {saved.name} state in {saved.path} is not a mapping.")
        diffs = config_differences(saved.json, self.config, self.must_match, self.defaults)
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
