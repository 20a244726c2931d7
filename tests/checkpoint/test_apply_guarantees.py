"""A load is all-or-nothing, only loadable checkpoints are published, weights-only
checkpoints say what they are, and a fresh run never takes over another run's names.

Real trainers, real DCP and files; faults are injected with the checkpointer's fault hook
at named points, including after the first live write of a load.
"""

from __future__ import annotations

import json
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from callbacks import standard_callbacks
from tests.checkpoint.ckpt_state import (
    assert_bitwise_equal,
    build_trainer,
    load_with,
    save_with,
    snapshot,
)
from tests.conftest import REPO
from veoptim.checkpoint import Publisher, latest_complete, resolve
from veoptim.checkpoint import component as C
from veoptim.checkpoint.checkpointer import Checkpointer
from veoptim.checkpoint.faults import PHASE_AFTER_REPLACE
from veoptim.checkpoint.layout import MANIFEST_FILE
from veoptim.errors import CheckpointError, ConfigError, LiveStateInvalidError
from veoptim.state import LR_SCHEDULER, MODEL

pytestmark = pytest.mark.slow

FROZEN = "model.norm.weight"


def _saved(tmp_path: Path, steps: int = 2, overrides: list[str] = ()) -> tuple[Path, object]:
    writer = build_trainer(tmp_path / "writer", list(overrides))
    for _ in range(steps):
        writer.train_step()
    root = tmp_path / "ckpt"
    save_with(Checkpointer(root, fsync=False), writer, "good")
    return root, writer


def _copy_with(root: Path, name: str, edit) -> None:
    """Publish a copy of ``good`` (a valid manifest) with ``edit`` applied to its files."""
    good = resolve(root, "good")
    with Publisher(root, fsync=False).write(name) as out:
        for item in good.iterdir():
            if item.name != MANIFEST_FILE:
                (shutil.copytree if item.is_dir() else shutil.copy2)(item, out / item.name)
        edit(out)


# ------------------------------------------------------------------ all-or-nothing apply
def test_scheduler_state_of_another_shape_is_refused_before_any_write(tmp_path):
    root, _ = _saved(tmp_path)

    def two_groups(out: Path) -> None:
        path = C.shared_json_path(out, LR_SCHEDULER)
        state = json.loads(path.read_text())
        state["base_lrs"] = state["base_lrs"] * 2
        path.write_text(json.dumps(state))

    _copy_with(root, "bad_scheduler", two_groups)
    live = build_trainer(tmp_path / "live")
    live.train_step()
    before = snapshot(live)
    with pytest.raises(CheckpointError, match=r"validating.*base_lrs: expected a list of 1"):
        load_with(Checkpointer(root, fsync=False), live, "bad_scheduler")
    assert_bitwise_equal(before, snapshot(live), "live state")


def test_a_failure_after_the_first_live_write_stops_the_run(tmp_path):
    root, _ = _saved(tmp_path)
    live = build_trainer(tmp_path / "live")
    live.train_step()

    def fail_after_model(phase: str) -> None:
        if phase == f"apply:{MODEL}":
            raise OSError(5, "injected I/O error after the model was written")

    with pytest.raises(LiveStateInvalidError, match="partly loaded and is not valid"):
        load_with(Checkpointer(root, fsync=False, fault_hook=fail_after_model), live, "good")
    assert live.state_invalid
    with pytest.raises(CheckpointError, match="cannot train any more"):
        live.train_step()


# ------------------------------------------------------------ only loadable checkpoints
def _frozen_trainer(run_dir: Path):
    trainer = build_trainer(run_dir)
    dict(trainer.model.named_parameters())[FROZEN].requires_grad_(False)  # after the optimizer
    return trainer


def test_a_parameter_frozen_after_the_optimizer_was_built_saves_and_resumes_bitwise(tmp_path):
    straight = _frozen_trainer(tmp_path / "straight")
    for _ in range(4):
        straight.train_step()
    first = _frozen_trainer(tmp_path / "first")
    first.train_step()
    first.train_step()
    root = tmp_path / "ckpt"
    save_with(Checkpointer(root, fsync=False), first, "s2")
    saved = json.loads(C.shared_json_path(resolve(root, "s2"), "optimizer").read_text())
    assert saved["stateless"] == [FROZEN]
    resumed = _frozen_trainer(tmp_path / "resumed")
    load_with(Checkpointer(root, fsync=False), resumed, "s2")
    resumed.train_step()
    resumed.train_step()
    assert_bitwise_equal(snapshot(straight), snapshot(resumed))
    # A run that trains the parameter again gives it fresh state on its first gradient.
    unfrozen = build_trainer(tmp_path / "unfrozen")
    load_with(Checkpointer(root, fsync=False), unfrozen, "s2")
    param = dict(unfrozen.model.named_parameters())[FROZEN]
    assert param not in unfrozen.optimizer.state
    unfrozen.train_step()
    assert unfrozen.optimizer.state[param]["step"] == 1


def test_optimizer_state_a_load_would_reject_is_never_published(tmp_path):
    root, writer = _saved(tmp_path)
    param = dict(writer.model.named_parameters())[FROZEN]
    del writer.optimizer.state[param]["exp_avg_sq"]
    with pytest.raises(CheckpointError, match=r"gathering state.*model\.norm\.weight\.exp_avg_sq"):
        save_with(Checkpointer(root, fsync=False), writer, "partial")
    assert not (root / "partial").exists() and latest_complete(root) == "good"
    assert [p.name.split(".")[0] for p in (root / ".versions").iterdir()] == ["good"]


# ---------------------------------------------------------------- weights-only checkpoints
def test_weights_only_checkpoint_refuses_a_full_resume_before_reading(tmp_path):
    root, writer = _saved(tmp_path, overrides=["checkpoint.save_optimizer=false"])
    info = json.loads((resolve(root, "good") / C.INFO_FILE).read_text())
    assert info[C.INFO_WEIGHTS_ONLY] is True and list(info[C.INFO_COMPONENTS]) == [
        "model",
        "config",
    ]

    def truncate(out: Path) -> None:  # proves the refusal reads no tensor
        shards = [p for p in (out / C.DCP_DIR).iterdir() if p.name != ".metadata"]
        assert shards
        for shard in shards:
            shard.write_bytes(b"")

    _copy_with(root, "truncated", truncate)
    live = build_trainer(tmp_path / "live")
    live.train_step()
    before = snapshot(live)
    for name in ("good", "truncated"):
        with pytest.raises(
            CheckpointError, match="is a weights-only checkpoint.*load_optimizer=false"
        ):
            load_with(Checkpointer(root, fsync=False), live, name)
    assert_bitwise_equal(before, snapshot(live), "live state")
    load_with(Checkpointer(root, fsync=False), live, "good", load_optimizer=False)
    assert_bitwise_equal(snapshot(writer)["params"], snapshot(live)["params"])
    assert live.progress.global_step == 1  # only the weights were restored


# ------------------------------------------------------------------------- run dir rule
def test_a_fresh_run_refuses_a_root_that_holds_checkpoints(tmp_path):
    first = build_trainer(tmp_path / "run", ["train.stop_at_step=1"])
    first.train()
    first.save_checkpoint()
    again = build_trainer(tmp_path / "run")
    with pytest.raises(ConfigError) as info:
        again.train()
    message = str(info.value)
    for option in ("checkpoint.resume=auto", "another run.dir", "checkpoint.overwrite=true"):
        assert option in message
    assert latest_complete(again.checkpointer.root) == "step_00000001"
    build_trainer(tmp_path / "run", ["checkpoint.overwrite=true", "train.stop_at_step=1"]).train()
    build_trainer(tmp_path / "run", ["checkpoint.resume=auto", "train.stop_at_step=2"]).train()


# ------------------------------------------------------------- metrics before publication
def test_a_steps_metrics_are_written_before_its_checkpoint_is_published(tmp_path):
    trainer = build_trainer(tmp_path / "run", ["checkpoint.save_steps=2", "train.max_steps=4"])
    cfg = trainer.cfg
    trainer.callbacks.callbacks = standard_callbacks(cfg, {})
    logged_at_publication: list[tuple[int, int]] = []

    def at_publication(phase: str) -> None:
        if phase == PHASE_AFTER_REPLACE:
            lines = (trainer.run_dir / cfg.logging.metrics_file).read_text().splitlines()
            logged_at_publication.append(
                (trainer.progress.global_step, json.loads(lines[-1])["step"])
            )

    trainer.checkpointer = Checkpointer(cfg.checkpoint.root_dir(trainer.run_dir),
                                        fsync=False, fault_hook=at_publication)  # fmt: skip
    trainer.train()
    assert logged_at_publication == [(2, 2), (4, 4)]


# --------------------------------------------------------------- a full disk, one line
FULL_DISK = """
import resource, signal, sys
sys.path.insert(0, {repo!r})
from tests.checkpoint.ckpt_state import build_trainer, save_with
from veoptim.checkpoint.checkpointer import Checkpointer
from veoptim.errors import CheckpointError
trainer = build_trainer({run!r}, ["checkpoint.write_threads=2"])
trainer.train_step()
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))
try:
    save_with(Checkpointer({run!r} + "/ckpt", fsync=False), trainer, "s1")
except CheckpointError as error:
    print("ERROR:", error, file=sys.stderr)
"""


def test_a_write_error_in_dcps_writer_threads_is_one_clear_line(tmp_path):
    script = FULL_DISK.format(repo=str(REPO), run=str(tmp_path / "run"))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, cwd=REPO)  # fmt: skip
    assert "ERROR:" in done.stderr and "File too large" in done.stderr, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "Exception in thread" not in done.stderr


del resource, signal, torch
