"""``veoptim-export`` / ``python -m tasks.export``: the same files as the live export, one-line
errors (exit 2) for bad input, a killed export leaves the previous one published, and the
host holds about one full model, never two."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from callbacks.hf_export import EXPORTS_SUBDIR, HF_EXPORT_NAME, HFExportCallback
from tasks.export import main as export_main
from tests import forkserver
from tests.checkpoint.ckpt_state import build_trainer, save_with
from veoptim.checkpoint import resolve
from veoptim.checkpoint.checkpointer import Checkpointer
from veoptim.checkpoint.layout import MANIFEST_FILE

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def _trained_checkpoint(tmp: Path, overrides: list[str]):
    """A trained tiny run and its checkpoint ``<tmp>/checkpoints/final``."""
    trainer = build_trainer(tmp / "run", ["train.max_steps=2", *overrides])
    trainer.train()
    root = tmp / "checkpoints"
    checkpointer = Checkpointer(root, fsync=False)
    checkpointer.run = trainer.run_id  # the run's checkpoint: its exports record its run id
    save_with(checkpointer, trainer, "final")
    return trainer, root / "final"


def _cli(*args: str) -> subprocess.CompletedProcess:
    """``python -m tasks.export ARGS``, forked from the preloaded server (``tests/forkserver.py``)."""
    return forkserver.run_module("tasks.export", list(args), cwd=REPO, env=ENV, timeout=300)


def _files(version: Path) -> dict[str, bytes]:
    return {str(p.relative_to(version)): p.read_bytes() for p in version.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    ("overrides", "dtype", "shard_mb"),
    [
        (["model.dtype=fp32"], "bf16", 2048),
        (["model.dtype=bf16", "model.tie_word_embeddings=true"], "fp32", 0),  # tied, sharded
        (["model.dtype=fp32"], "preserve", 2048),
    ],
)
def test_cli_and_callback_write_the_same_files(tmp_path, overrides, dtype, shard_mb):
    trainer, checkpoint = _trained_checkpoint(tmp_path, overrides)
    trainer.cfg.export.dtype, trainer.cfg.export.max_shard_size_mb = dtype, shard_mb
    HFExportCallback(trainer.cfg.export, fsync=False).on_train_end(trainer)
    live = resolve(trainer.run_dir / EXPORTS_SUBDIR, HF_EXPORT_NAME)
    out = tmp_path / "offline"
    argv = [str(checkpoint), "--out", str(out), "--name", HF_EXPORT_NAME, "--dtype", dtype,
            "--max-shard-size-mb", str(shard_mb), "--no-fsync"]  # fmt: skip
    assert export_main(argv) == 0
    offline = resolve(out, HF_EXPORT_NAME)
    live_files, offline_files = _files(live), _files(offline)
    assert sorted(live_files) == sorted(offline_files)
    assert len([f for f in live_files if f.endswith(".safetensors")]) >= 1
    live_manifest = json.loads(live_files.pop(MANIFEST_FILE))
    offline_manifest = json.loads(offline_files.pop(MANIFEST_FILE))
    assert live_manifest.pop("created_ns") and offline_manifest.pop("created_ns")
    assert live_manifest == offline_manifest  # name, kind, step, every file's size and hash
    for name, data in live_files.items():
        assert data == offline_files[name], name


def test_bad_input_is_one_line_saying_what_to_pass(tmp_path):
    _, checkpoint = _trained_checkpoint(tmp_path, [])
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(
        parents=True, exist_ok=True
    )  # what a run dir of tasks.sft looks like
    proc = _cli(str(run_dir), "--out", str(tmp_path / "o"), "--name", "x")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "pass " + str(run_dir) + "/checkpoints/step_..." in proc.stderr
    for fmt in ("peft", "merged"):
        proc = _cli(str(checkpoint), "--out", str(tmp_path / "o"), "--name", "x", "--format", fmt)
        assert proc.returncode == 2
        last = proc.stderr.strip().splitlines()[-1]
        assert "is not a LoRA checkpoint (it has no adapter weights)" in last, proc.stderr
    assert not (tmp_path / "o" / "x").exists()


def test_the_error_messages_of_each_case(tmp_path, capsys):
    _, checkpoint = _trained_checkpoint(tmp_path, [])
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    unfinished = checkpoint.resolve().parent / "step_00000009.0123456789abcdef"
    unfinished.mkdir()
    cases = {
        run_dir: "is a run directory, not a checkpoint; pass ",
        tmp_path / "checkpoints": "checkpoint root, not a checkpoint; pass one of its names, e.g.",
        unfinished: "is an incomplete checkpoint version (no manifest.json",
        tmp_path / "missing": "does not exist",
    }
    for path, expected in cases.items():
        assert export_main([str(path), "--out", str(tmp_path / "o"), "--name", "x"]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and expected in err, (path, err)
    assert not (tmp_path / "o").exists()


_KILL_AFTER_FIRST_SHARD = """
import os, signal, sys
import safetensors.torch as st
real = st.save_file
def save_then_die(*args, **kwargs):
    real(*args, **kwargs)
    print("first shard written", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
st.save_file = save_then_die
from tasks.export import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_killed_export_leaves_the_previous_export_published(tmp_path):
    trainer, checkpoint = _trained_checkpoint(tmp_path, ["model.dtype=fp32"])
    out = tmp_path / "exports"
    args = [str(checkpoint), "--out", str(out), "--name", "hf", "--dtype", "fp32"]
    assert _cli(*args).returncode == 0
    previous = resolve(out, "hf")
    # A real export process, SIGKILLed inside the write: after its first shard file.
    proc = subprocess.run(
        [sys.executable, "-c", _KILL_AFTER_FIRST_SHARD, *args, "--max-shard-size-mb", "0"],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert "first shard written" in proc.stdout
    debris = set((out / ".versions").iterdir()) - {previous}
    assert len(debris) == 1  # the killed export's version, never published
    assert resolve(out, "hf") == previous
    loaded = AutoModelForCausalLM.from_pretrained(previous)
    tokenizer = AutoTokenizer.from_pretrained(previous)
    ids = tokenizer("What is 1+2?", return_tensors="pt").input_ids
    trainer.model.eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, trainer.model(input_ids=ids).logits)
    assert _cli(*args).returncode == 0  # the next export publishes and removes the debris
    assert resolve(out, "hf") != previous and not debris & set((out / ".versions").iterdir())


def _peak_rss_bytes(args: list[str]) -> int:
    """Peak resident memory of one ``python -m tasks.export`` process."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tasks.export", *args], cwd=REPO, env=ENV,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 0, proc.stderr.read().decode()[-2000:]
    return usage.ru_maxrss * 1024  # KiB on Linux


@pytest.fixture(scope="module")
def peak_memory_checkpoints(tmp_path_factory) -> tuple[Path, Path, int]:
    """A ~145 MB (fp32) model's checkpoint, a tiny one's, and the big model's bytes."""
    tmp = tmp_path_factory.mktemp("peak_memory")
    big = ["model.dtype=fp32", "model.hidden_size=768", "model.intermediate_size=3072",
           "model.num_hidden_layers=4", "checkpoint.save_optimizer=false"]  # fmt: skip
    trainer = build_trainer(tmp / "big_run", big)
    model_bytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    save_with(Checkpointer(tmp / "big", fsync=False), trainer, "big")
    del trainer
    _, tiny = _trained_checkpoint(tmp, ["checkpoint.save_optimizer=false"])
    return tmp / "big" / "big", tiny, model_bytes


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_peak_memory_is_about_one_full_model(tmp_path, peak_memory_checkpoints, dtype):
    """The export's peak RSS exceeds a tiny model's export by about one model (the DCP
    read; casts replace sources tensor by tensor), far from two."""
    big, tiny, model_bytes = peak_memory_checkpoints
    common = ["--out", str(tmp_path / "o"), "--dtype", dtype, "--no-fsync"]
    baseline = _peak_rss_bytes([str(tiny), *common, "--name", "tiny"])
    peak = _peak_rss_bytes([str(big), *common, "--name", "big"])
    extra = peak - baseline
    assert model_bytes > 120e6
    assert extra < 1.4 * model_bytes, (extra / model_bytes, model_bytes)


def test_console_script_is_declared():
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'veoptim-export = "veoptim.tasks.export:main"' in pyproject.split("[project.scripts]")[1]
