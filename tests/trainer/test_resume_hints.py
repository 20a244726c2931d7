"""A refused fresh start in a run dir that holds checkpoints offers a way on that the next
start accepts: the resume it names was checked by the load's own validation first.

Real ``python -m tasks.sft`` runs: a first run writes checkpoints, a second command is
refused, and the command its message offers is run as written (the second command plus the
offered overrides) and must start.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import run_sft_cli
from veoptim.trainer.startup import RESUME_WEIGHTS, RESUME_WHOLE

pytestmark = pytest.mark.slow

SHORT = ["run.device=cpu", "train.global_batch_size=4", "train.micro_batch_size=4",
         "scheduler.warmup_steps=1", "logging.progress=false", "export.hf=false",
         "checkpoint.fsync=false"]  # fmt: skip
#: case: (the first run, the refused command, what its message offers)
CASES = {
    "the same run, sliced": (
        ["train.max_steps=4", "train.stop_at_step=2"],
        ["train.max_steps=4", "train.stop_at_step=2"],
        RESUME_WHOLE,
    ),
    "weights-only checkpoints": (
        ["train.max_steps=2", "checkpoint.save_optimizer=false"],
        ["train.max_steps=2", "checkpoint.save_optimizer=false"],
        RESUME_WEIGHTS,
    ),
    "a longer run of the same model": (
        ["train.max_steps=2"],
        ["train.max_steps=4"],
        RESUME_WEIGHTS,
    ),
    "another model": (
        ["train.max_steps=2"],
        ["train.max_steps=2", "model=tiny_moe"],
        None,
    ),
}


def _error_line(proc) -> str:
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if " ERROR " in line]
    assert len(lines) == 1, proc.stdout + proc.stderr
    return lines[0]


@pytest.mark.parametrize("case", list(CASES))
def test_the_way_on_a_refused_start_offers_is_accepted(tmp_path: Path, case: str) -> None:
    first, second, offered = CASES[case]
    run = [f"run.dir={tmp_path / 'run'}", *SHORT]
    trained = run_sft_cli([*run, *first], tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    refused = run_sft_cli([*run, *second], tmp_path)
    assert refused.returncode == 2
    message = _error_line(refused)
    assert "already holds checkpoints (newest: step_00000002)" in message, message
    if offered is None:  # no resume fits: none is offered, the other ways are
        assert "checkpoint.resume=auto" not in message and "cannot resume from it" in message
        assert "model.arch: saved 'qwen2', live 'qwen3_moe'" in message, message
        way = ["checkpoint.overwrite=true"]
    else:
        named = re.search(r"(?:continue that run|start from its weights) with ([^(,]+)", message)
        assert named and named.group(1).strip() == offered, message
        way = offered.split()
    assert "checkpoint.overwrite=true" in message
    followed = run_sft_cli([*run, *second, *way], tmp_path)
    assert followed.returncode == 0, _error_line(followed)
    if offered == RESUME_WEIGHTS:
        assert "restored model weights only" in followed.stdout + followed.stderr


@pytest.mark.parametrize(
    ("second", "weights_load"),
    [(["train.max_steps=4"], "accepted"), (["train.max_steps=2", "model=tiny_moe"], "refused")],
)
def test_a_refused_resume_offers_a_weights_only_load_only_where_it_loads(
    tmp_path: Path, second: list[str], weights_load: str
) -> None:
    """An explicit checkpoint.resume=auto whose whole state does not fit: the components
    advise checkpoint.load_optimizer=false; where that load would be refused as well (another
    model), the message says so and why, and following the advice is indeed refused."""
    run = [f"run.dir={tmp_path / 'run'}", *SHORT]
    trained = run_sft_cli([*run, "train.max_steps=2"], tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    refused = run_sft_cli([*run, *second, "checkpoint.resume=auto"], tmp_path)
    assert refused.returncode == 2
    message = _error_line(refused)
    assert "checkpoint.load_optimizer=false" in message, message
    followed = run_sft_cli([*run, *second, *RESUME_WEIGHTS.split()], tmp_path)
    if weights_load == "accepted":
        assert "refused as well" not in message, message
        assert followed.returncode == 0, _error_line(followed)
    else:
        assert (
            "A weights-only load (checkpoint.load_optimizer=false) is refused as well: " in message
        )
        assert "model.arch: saved 'qwen2', live 'qwen3_moe'" in message.split("refused as well")[1]
        assert followed.returncode == 2  # as the message said
