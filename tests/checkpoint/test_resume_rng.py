"""A run that draws random numbers (attention dropout) resumes bitwise: RNG states matter.

No bundled config draws random numbers while training, so a resume that forgets the RNG
states ends like the straight run there. With ``model.attention_dropout=0.1`` every step
draws dropout masks from torch's RNG: ``tasks.sft`` (``run_task``, in this process) runs
4 steps straight, and 2 steps with ``train.stop_at_step=2`` followed by a new run with
``checkpoint.resume=auto``; the two step-4 checkpoints must be bitwise equal (model,
optimizer, scheduler, sampler, progress, RNG) and so must the loss curves. A resume whose
RNG component installs nothing (the negative control) must differ.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.compose import compose_config
from tasks.runner import run_task
from tests.checkpoint.ckpt_state import TINY
from tests.checkpoint.helpers import ckpt_io
from veoptim.checkpoint import step_name
from veoptim.checkpoint.component import Staged
from veoptim.state.rng import RNGState

STOP, TOTAL = 2, 4
DROPOUT = [
    *TINY,
    f"train.max_steps={TOTAL}",
    "model.attention_dropout=0.1",
    "checkpoint.fsync=false",
    "logging.level=WARNING",
]


def sft(run_dir: Path, *overrides: str) -> None:
    """What ``python -m tasks.sft <overrides>`` runs, in this process."""
    run_task(compose_config("sft", [*DROPOUT, f"run.dir={run_dir}", *overrides]))


def sliced(run_dir: Path) -> ckpt_io.Snapshot:
    sft(run_dir, f"train.stop_at_step={STOP}")
    sft(run_dir, "checkpoint.resume=auto")
    return ckpt_io.read_checkpoint(run_dir / "checkpoints" / step_name(TOTAL))


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[Path, ckpt_io.Snapshot]:
    run_dir = tmp_path_factory.mktemp("straight")
    sft(run_dir)
    return run_dir, ckpt_io.read_checkpoint(run_dir / "checkpoints" / step_name(TOTAL))


def test_resume_with_dropout_is_bitwise_equal_to_the_straight_run(straight, tmp_path):
    straight_dir, expected = straight
    resumed = sliced(tmp_path / "sliced")
    assert ckpt_io.differences(expected, resumed) == []
    assert resumed.rng and resumed.rng == expected.rng
    assert ckpt_io.metrics(tmp_path / "sliced") == ckpt_io.metrics(straight_dir)


def test_a_resume_that_skips_the_rng_states_is_detected(straight, tmp_path, monkeypatch):
    """Negative control: the RNG component validates but installs nothing."""
    _, expected = straight
    monkeypatch.setattr(RNGState, "stage", lambda self, saved: Staged())
    resumed = sliced(tmp_path / "sliced")
    diffs = ckpt_io.differences(expected, resumed)
    assert "rng" in diffs
    assert any(d.startswith("model.") for d in diffs), diffs  # other dropout masks drawn
