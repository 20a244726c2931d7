"""Spawn worker of the async-save tests: real trainer runs with ``checkpoint.async_save``.

A *write gate* wraps the storage writers' ``write_data`` (DCP's ``FileSystemWriter`` and
veoptim's ``RawFileSystemWriter``: the storage layer, which runs on the background thread
of an async save) for one checkpoint name: it either
holds the write until the training loop has finished the next step (so the snapshot
is written after the live tensors moved on), or raises ``ENOSPC`` on one rank (a
storage failure). Everything else — trainer, callback, Checkpointer, DCP — is real.
"""

from __future__ import annotations

import errno
import threading
from pathlib import Path
from typing import Any

from tests.checkpoint.helpers.sft_jobs import COMMON

GATE_TIMEOUT_S = 10.0
SAVE_STEPS = 2
MAX_STEPS = 4


class WriteGate:
    """Holds or fails the DCP data write of checkpoints whose path contains ``target``."""

    def __init__(self) -> None:
        self.target: str | None = None
        self.fail = False
        self.release = threading.Event()
        self.held_until_released = False
        self.timed_out = False
        self.thread: str | None = None

    def install(self) -> None:
        from torch.distributed.checkpoint.filesystem import _FileSystemWriter

        from veoptim.checkpoint.storage.raw_writer import RawFileSystemWriter

        for kind in (_FileSystemWriter, RawFileSystemWriter):
            self._wrap(kind)

    def _wrap(self, kind: type) -> None:
        original = kind.write_data
        gate = self

        def write_data(writer: Any, plan: Any, planner: Any) -> Any:
            if gate.target is not None and gate.target in str(writer.path):
                gate.thread = threading.current_thread().name
                if gate.fail:
                    raise OSError(
                        errno.ENOSPC, "No space left on device (injected)", str(writer.path)
                    )
                gate.timed_out = not gate.release.wait(GATE_TIMEOUT_S)
                gate.held_until_released = not gate.timed_out
            return original(writer, plan, planner)

        kind.write_data = write_data

    def arm(self, target: str | None, *, fail: bool = False) -> None:
        self.target, self.fail = target, fail
        self.release.clear()
        self.held_until_released = self.timed_out = False
        self.thread = None


def _trainer(ctx: Any, overrides: list[str], extra: list[Any]) -> Any:
    from omegaconf import OmegaConf

    from callbacks import standard_callbacks
    from tasks.compose import compose_config
    from veoptim.config import to_config
    from veoptim.trainer import Trainer

    sft = to_config(compose_config("sft", [*COMMON, *overrides]))
    resolved = OmegaConf.to_container(OmegaConf.structured(sft), resolve=True)
    return Trainer.from_config(sft, ctx, [*standard_callbacks(sft, resolved), *extra])


def _probe(gate: WriteGate, release_at: int) -> Any:
    """A callback that records the in-flight save at ``release_at`` and then opens the gate."""
    from veoptim.trainer import Callback

    class Probe(Callback):
        seen: dict[str, Any] = {}

        def on_step_end(self, trainer: Any, metrics: Any) -> None:
            if trainer.progress.global_step != release_at:
                return
            in_flight = trainer.checkpointer._in_flight
            self.seen = {
                "in_flight": in_flight is not None,
                "future_done": None if in_flight is None else in_flight[1].done(),
                "step": trainer.progress.global_step,
            }
            gate.release.set()

    return Probe()


def _fail_at(step: int) -> Any:
    """A callback that makes training fail (on every rank) at the end of ``step``."""
    from veoptim.trainer import Callback

    class FailAt(Callback):
        def on_step_end(self, trainer: Any, metrics: Any) -> None:
            if trainer.progress.global_step == step:
                raise RuntimeError("training blew up")

    return FailAt()


def run(ctx: Any, out: Path, overrides: list[str]) -> dict[str, Any]:
    """Sync reference, gated async run, two failing async runs and a failing training run
    with a save in flight; returns observations."""
    from veoptim.checkpoint import latest_complete, step_name
    from veoptim.errors import CheckpointError

    gate = WriteGate()
    gate.install()
    fail_rank = ctx.world_size - 1
    base = [*overrides, f"train.max_steps={MAX_STEPS}", f"checkpoint.save_steps={SAVE_STEPS}"]
    result: dict[str, Any] = {"rank": ctx.rank}

    gate.arm(None)
    _trainer(ctx, [*base, f"run.dir={out / 'sync'}"], []).train()

    gate.arm("step_00000002")
    probe = _probe(gate, release_at=3)
    trainer = _trainer(ctx, [*base, "checkpoint.async_save=true", f"run.dir={out / 'async'}"], [probe])  # fmt: skip
    trainer.train()
    result["async"] = {**probe.seen, "held": gate.held_until_released,
                       "timed_out": gate.timed_out, "thread": gate.thread}  # fmt: skip

    for case, extra in {
        "fail_next_save": ["checkpoint.save_steps=1", "checkpoint.save_at_end=false"],
        "fail_train_end": ["train.max_steps=3", "checkpoint.save_at_end=false"],
    }.items():
        gate.arm("step_00000002", fail=ctx.rank == fail_rank)
        run_dir = out / case
        trainer = _trainer(ctx, [*base, *extra, "checkpoint.async_save=true", f"run.dir={run_dir}"], [])  # fmt: skip
        try:
            trainer.train()
            error = None
        except CheckpointError as exc:
            error = str(exc)
        result[case] = {
            "error": error,
            "raised_at_step": trainer.progress.global_step,
            "latest": latest_complete(run_dir / "checkpoints"),
        }

    # Training fails at step 3 with the step-2 save in flight: it is abandoned, not
    # published; the next run in that directory saves normally and removes its debris.
    gate.arm(None)
    run_dir = out / "abandon"
    no_end = [*base, "checkpoint.save_at_end=false", f"run.dir={run_dir}"]
    trainer = _trainer(ctx, [*no_end, "checkpoint.async_save=true"], [_fail_at(3)])
    try:
        trainer.train()
        raised = None
    except RuntimeError as exc:
        raised = str(exc)
    root = trainer.checkpointer.root
    abandoned = {
        "raised": raised,
        "latest": latest_complete(root),
        "step_2_exists": (root / step_name(2)).exists(),
    }
    _trainer(ctx, [*no_end, "checkpoint.save_steps=1", "train.stop_at_step=1"], []).train()
    abandoned["latest_after"] = latest_complete(root)
    abandoned["versions_after"] = sorted(
        p.name.split(".")[0] for p in (root / ".versions").iterdir()
    )
    result["abandon"] = abandoned
    return result
