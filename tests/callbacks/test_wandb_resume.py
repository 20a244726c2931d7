"""Every slice of a run logs to one wandb run (offline mode: the run dirs name its id)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from callbacks.metrics import WANDB_ID_FILE
from tasks.compose import compose_config
from tasks.runner import run_task
from veoptim.checkpoint import component as C
from veoptim.checkpoint import step_name
from veoptim.checkpoint.versions import resolve_path
from veoptim.state import RUN_IDS

pytestmark = pytest.mark.starts_processes

BASE = ["run.device=cpu", "train.max_steps=4", "train.global_batch_size=4",
        "train.micro_batch_size=2", "scheduler.warmup_steps=1", "logging.progress=false",
        "logging.level=WARNING", "export.hf=false", "checkpoint.fsync=false"]  # fmt: skip
OFFLINE = "logging.wandb.mode=offline"


def _offline_ids(run_dir: Path) -> list[str]:
    """The run id of every offline wandb run in the run dir, oldest first. The id is read
    from the run's ``run-<id>.wandb`` file, not the dir name (two runs of one id started in
    the same second get dirs ``…-<id>`` and ``…-<id>-1``); slices run one after another, so
    the order of their files' last writes is the order of the runs."""
    files = [f for d in (run_dir / "wandb").glob("offline-run-*") for f in d.glob("run-*.wandb")]
    files.sort(key=lambda f: f.stat().st_mtime_ns)
    return [f.name.removeprefix("run-").removesuffix(".wandb") for f in files]


def _saved_id(run_dir: Path, step: int) -> str:
    version = resolve_path(run_dir / "checkpoints" / step_name(step))
    return json.loads(C.shared_json_path(version, RUN_IDS).read_text())["wandb"]


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def test_slices_continue_one_wandb_run(tmp_path):
    run_dir = tmp_path / "run"
    common = [f"run.dir={run_dir}", *BASE, OFFLINE]
    run_task(compose_config("sft", [*common, "train.stop_at_step=2"]))
    run_task(compose_config("sft", [*common, "checkpoint.resume=auto"]))
    ids = _offline_ids(run_dir)
    assert len(ids) == 2 and ids[0] == ids[1]
    assert (run_dir / WANDB_ID_FILE).read_text().strip() == ids[0]
    assert _saved_id(run_dir, 2) == _saved_id(run_dir, 4) == ids[0]
    # Starting over in the run dir is another run.
    run_task(compose_config("sft", [*common, "checkpoint.overwrite=true"]))
    ids = _offline_ids(run_dir)
    assert len(set(ids)) == 2 and ids[-1] != ids[0]
    assert (run_dir / WANDB_ID_FILE).read_text().strip() == ids[-1]


def test_a_resume_from_a_checkpoint_without_an_id_continues_the_run_dir_id(tmp_path):
    """Slice 1 ran without wandb and saved step 1. Slice 2 (wandb on) got an id but crashed
    before saving (here: saved nothing). Slice 3 resumes step 1 again: it continues the
    wandb run of slice 2, whose id the run dir kept."""
    run_dir = tmp_path / "run"
    common = [f"run.dir={run_dir}", *BASE]
    run_task(compose_config("sft", [*common, "train.stop_at_step=1"]))
    assert _saved_id(run_dir, 1) == "" and not (run_dir / WANDB_ID_FILE).exists()
    resume = [*common, OFFLINE, "checkpoint.resume=auto"]
    run_task(compose_config("sft", [*resume, "checkpoint.save_at_end=false"]))
    (first,) = _offline_ids(run_dir)
    assert not (run_dir / "checkpoints" / step_name(4)).exists()
    run_task(compose_config("sft", resume))
    assert _offline_ids(run_dir) == [first, first] and _saved_id(run_dir, 4) == first
