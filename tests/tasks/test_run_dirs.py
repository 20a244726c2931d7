"""A run is one run: ``checkpoint.resume=auto`` resumes only the run dir's own run, a second
writer of a run dir is refused, and every checkpoint and export records its run. Real
``python -m tasks.sft`` commands, real files and locks."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests import forkserver
from tests.conftest import REPO, run_sft_cli
from veoptim.checkpoint.layout import published_names, read_manifest
from veoptim.checkpoint.versions import latest_complete, resolve
from veoptim.rundir import holder_of, read_identity

pytestmark = pytest.mark.slow

COMMON = [
    "run.device=cpu",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "scheduler.warmup_steps=1",
    "logging.progress=false",
]


def sft(run_dir: Path, *args: str) -> tuple[int, str]:
    done = run_sft_cli([*COMMON, f"run.dir={run_dir}", *args], REPO)
    return done.returncode, done.stdout + done.stderr


def run_of(root: Path, name: str) -> str | None:
    return read_manifest(resolve(root, name)).run


def steps(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


def test_resume_auto_after_an_overwrite_resumes_the_overwrite_runs_own_checkpoint(
    tmp_path: Path,
) -> None:
    run_dir, root = tmp_path / "ow", tmp_path / "ow" / "checkpoints"
    rc, _ = sft(run_dir, "train.max_steps=12", "optim.lr=1e-3")
    assert rc == 0
    first = read_identity(run_dir).run_id
    rc, log = sft(run_dir, "checkpoint.overwrite=true", "train.max_steps=12", "optim.lr=3e-3",
                  "train.stop_at_step=4")  # fmt: skip
    assert rc == 0, log
    second = read_identity(run_dir).run_id
    assert second != first and "stay under their names" in log
    # The earlier run's newest checkpoint is still there, and newer: what auto picked before.
    assert latest_complete(root) == "step_00000012" and run_of(root, "step_00000012") == first
    assert latest_complete(root, run=second) == "step_00000004"

    rc, plan = sft(run_dir, "checkpoint.resume=auto", "train.max_steps=12", "optim.lr=3e-3",
                   "run.dry_run=true")  # fmt: skip
    assert rc == 0 and "step_00000004" in plan and f"own checkpoint (run {second})" in plan

    rc, log = sft(run_dir, "checkpoint.resume=auto", "train.max_steps=12", "optim.lr=3e-3")
    assert rc == 0, log
    assert "(step 4)" in log and f"run {second}" in log
    assert steps(run_dir) == list(range(1, 13))  # 1-4 of the slice, then 5-12 resumed
    assert read_identity(run_dir).run_id == second
    assert run_of(root, "step_00000012") == second  # re-published by the resumed run
    assert run_of(tmp_path / "ow" / "exports", "hf_final") == second


def test_a_fresh_run_with_overwrite_ignores_earlier_runs_in_retention(tmp_path: Path) -> None:
    run_dir, root = tmp_path / "keep", tmp_path / "keep" / "checkpoints"
    rc, _ = sft(run_dir, "train.max_steps=6", "checkpoint.save_steps=2", "export.hf=false")
    assert rc == 0
    first = read_identity(run_dir).run_id
    rc, log = sft(run_dir, "train.max_steps=3", "checkpoint.overwrite=true",
                  "checkpoint.save_steps=1", "checkpoint.keep_last=1", "export.hf=false")  # fmt: skip
    assert rc == 0, log
    second = read_identity(run_dir).run_id
    # keep_last=1 counted and pruned only the new run's names (it re-pointed step_00000002,
    # then pruned it); the earlier run's other names stay.
    names = {name: read_manifest(resolve(root, name)).run for name in published_names(root)}
    assert names == {"step_00000003": second, "step_00000004": first, "step_00000006": first}


def test_an_explicit_checkpoint_of_another_run_is_a_warm_start_the_log_names(
    tmp_path: Path,
) -> None:
    rc, _ = sft(tmp_path / "a", "train.max_steps=6", "train.stop_at_step=4", "export.hf=false")
    assert rc == 0
    source = read_identity(tmp_path / "a").run_id
    ckpt = tmp_path / "a" / "checkpoints" / "step_00000004"
    rc, log = sft(tmp_path / "b", "train.max_steps=6", f"checkpoint.resume={ckpt}",
                  "export.hf=false")  # fmt: skip
    assert rc == 0, log
    assert f"run {source}'s checkpoint" in log
    assert read_identity(tmp_path / "b").run_id == source  # a full resume continues run a
    rc, log = sft(tmp_path / "c", "train.max_steps=2", f"checkpoint.resume={ckpt}",
                  "checkpoint.load_optimizer=false", "export.hf=false")  # fmt: skip
    assert rc == 0, log
    warm = read_identity(tmp_path / "c")
    assert "warm start" in log and warm.run_id != source and warm.source.run_id == source


def test_two_runs_into_one_run_dir_the_second_is_refused_naming_the_first(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "twice"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    args = [*COMMON, f"run.dir={run_dir}", "train.max_steps=100000", "export.hf=false",
            "checkpoint.save_on_signal=false"]  # fmt: skip
    first = forkserver.ForkedModule("tasks.sft", args, cwd=REPO, env=env,
                                    stdout=tmp_path / "first.log")  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while holder_of(run_dir) is None or not (run_dir / "metrics.jsonl").exists():
            assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the first run never took the lock"
            time.sleep(0.1)
        rc, log = sft(run_dir, "train.max_steps=5", "export.hf=false")
        assert first.poll() is None  # still training: the refusal was not a race
        assert rc == 2
        errors = [line for line in log.splitlines() if "in use by" in line]
        assert len(errors) == 1 and f"pid {first.pid} on " in errors[0], log
    finally:
        first.kill()
        first.wait(60)
    trained = steps(run_dir)
    assert trained == list(range(1, len(trained) + 1))  # one writer: no interleaved steps
    # The killed run's record is stale: the next run takes the dir over and says whose it was.
    rc, log = sft(run_dir, "train.max_steps=3", "export.hf=false", "checkpoint.overwrite=true")
    assert rc == 0, log
    assert f"took over the stale lock of pid {first.pid}" in log


@pytest.mark.parametrize("where", ["below_a_file", "a_file"])
def test_an_unusable_run_dir_is_one_line_and_exit_2(tmp_path: Path, where: str) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    run_dir = afile / "run" if where == "below_a_file" else afile
    done = run_sft_cli([f"run.dir={run_dir}"], REPO, fresh=True)
    assert done.returncode == 2
    assert done.stdout == "" and done.stderr.count("\n") == 1, done.stderr[-2000:]
    assert f"run.dir {run_dir} cannot be used: it is not a directory" in done.stderr
