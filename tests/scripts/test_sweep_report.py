"""``scripts/sweep_report.py`` (a wrapper of ``tasks/sweep_report.py``) on a real sweep, errors, resumes."""

from __future__ import annotations

import csv
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tasks.sweep_report import (
    PNG_SIZE,
    find_runs,
    label_runs,
    load_run,
    loss_figure,
    smooth,
    table_rows,
)
from tests import forkserver

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "sweep_report.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def report(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, env=ENV
    )


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's header (signature, then the IHDR chunk), checking both."""
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_SIGNATURE and head[12:16] == b"IHDR", head
    return struct.unpack(">II", head[16:24])


def plotted(runs: list) -> dict[str, list[float]]:
    """The chart's lines: label -> y values."""
    (axes,) = loss_figure(runs).axes
    return {line.get_label(): list(line.get_ydata()) for line in axes.get_lines()}


def last_record(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``python -m tasks.sft -m optim.lr=1e-3,3e-3``: jobs 0 and 1 of a 6-step CPU run."""
    tmp = tmp_path_factory.mktemp("sweep")
    sweep_dir = tmp / "sw"
    args = ["-m", "optim.lr=1e-3,3e-3", f"run.dir={sweep_dir}",
            "run.device=cpu", "train.max_steps=6", "scheduler.warmup_steps=0",
            "train.global_batch_size=4", "train.micro_batch_size=4", "logging.progress=false",
            "export.hf=false", "checkpoint.save_at_end=false"]  # fmt: skip
    proc = forkserver.run_module("tasks.sft", args, cwd=tmp, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return sweep_dir


@pytest.fixture(scope="module")
def reported(sweep: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = sweep.parent / "report"
    return report(sweep, "--out", out), out


def test_table_labels_runs_by_their_differing_override(sweep, reported):
    proc, out = reported
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| optim.lr=")]
    labels = [row.split("|")[1].strip() for row in rows]
    assert sorted(labels) == ["optim.lr=0.001", "optim.lr=0.003"]
    assert (out / "sweep.md").read_text() == proc.stdout

    with (out / "sweep.csv").open() as handle:
        table = list(csv.DictReader(handle))
    finals = [float(row["final_loss"]) for row in table]
    assert finals == sorted(finals), "best final loss first"
    by_label = {row["run"]: row for row in table}
    for job in ("0", "1"):
        config = yaml.safe_load((sweep / job / "config.yaml").read_text())
        row = by_label[f"optim.lr={config['optim']['lr']}"]
        last = last_record(sweep / job)
        assert float(row["final_loss"]) == last["loss"]
        assert int(row["steps"]) == int(row["last_step"]) == last["step"] == 6
        assert float(row["final_lr"]) == last["lr"]


def test_png_is_written_with_the_expected_size(reported):
    proc, out = reported
    assert png_size(out / "loss.png") == PNG_SIZE
    assert f"{out / 'loss.png'}" in proc.stderr


def test_chart_has_one_line_per_run_labelled_by_its_override(sweep):
    runs = [load_run(sweep / job, name=job) for job in ("0", "1")]
    label_runs(runs)
    lines = plotted(runs)
    assert sorted(lines) == ["optim.lr=0.001", "optim.lr=0.003"]
    for run in runs:
        assert lines[run.label] == [rec["loss"] for rec in run.records.values()]
    (axes,) = loss_figure(runs, window=3).axes
    assert axes.get_title() == "loss vs step (moving average over 3)"
    assert axes.get_legend() is not None


def test_run_dirs_and_smoothing(sweep, tmp_path):
    proc = report(sweep / "0", sweep / "1", "--out", tmp_path, "--smooth", "3")
    assert proc.returncode == 0, proc.stderr
    assert "optim.lr=0.001" in proc.stdout and "optim.lr=0.003" in proc.stdout
    assert png_size(tmp_path / "loss.png") == PNG_SIZE


def test_without_matplotlib_the_table_and_csv_are_still_written(sweep, reported, tmp_path):
    """matplotlib is an extra: its absence costs the PNG, with one sentence saying how to add it."""
    code = (
        "import runpy, sys; sys.modules['matplotlib'] = None; "  # None: import raises ImportError
        f"sys.argv = ['sweep_report.py', {str(sweep)!r}, '--out', {str(tmp_path)!r}]; "
        f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV)
    assert proc.returncode == 0, proc.stderr
    notes = [line for line in proc.stderr.splitlines() if line.startswith("note:")]
    assert notes == [
        "note: loss.png not written because matplotlib is not installed "
        "(pip install 'veoptim[plots]')."
    ]
    _, out = reported
    assert proc.stdout == (out / "sweep.md").read_text() == (tmp_path / "sweep.md").read_text()
    assert (tmp_path / "sweep.csv").read_text() == (out / "sweep.csv").read_text()
    assert not (tmp_path / "loss.png").exists()


def test_errors_are_one_sentence_with_exit_code_2(tmp_path):
    (tmp_path / "empty").mkdir()
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": \n')
    nometric = tmp_path / "nometric"
    nometric.mkdir()
    (nometric / "metrics.jsonl").write_text('{"step": 1, "lr": 0.1}\n')
    cases = {
        tmp_path / "missing": "does not exist",
        tmp_path / "empty": "no metrics.jsonl found",
        bad: f"{bad / 'metrics.jsonl'}:2",
        nometric: f"{nometric / 'metrics.jsonl'}:1 has no 'loss'",
    }
    for path, message in cases.items():
        proc = report(path)
        assert proc.returncode == 2, (path, proc.stderr)
        assert message in proc.stderr and "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


def test_resumed_run_later_record_wins(tmp_path):
    """A run resumed from step 1 re-logs steps 2-3 into the same file; those records win."""
    lines = [(1, 5.0), (2, 4.0), (3, 1.0), (2, 4.5), (3, 3.5), (4, 3.0)]
    (tmp_path / "metrics.jsonl").write_text(
        "".join(
            json.dumps({"step": s, "loss": v, "lr": 0.1, "tokens_per_s": 10.0}) + "\n"
            for s, v in lines
        )  # fmt: skip
    )
    run = load_run(tmp_path)
    assert {step: rec["loss"] for step, rec in run.records.items()} == {1: 5.0, 2: 4.5, 3: 3.5, 4: 3.0}  # fmt: skip
    label_runs([run])
    assert run.label == tmp_path.name  # no config, nothing to compare: the dir name
    (row,) = table_rows([run])
    assert (row["steps"], row["last_step"], row["first_loss"], row["final_loss"]) == (
        4,
        4,
        5.0,
        3.0,
    )
    assert (row["min_loss"], row["min_step"]) == (3.0, 4)
    assert plotted([run]) == {tmp_path.name: [5.0, 4.5, 3.5, 3.0]}


def test_smooth_is_a_trailing_moving_average():
    assert smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert smooth([1.0, 3.0], 1) == [1.0, 3.0]


def test_a_torn_last_line_is_skipped_with_a_warning(tmp_path):
    """A run killed mid-write leaves a last line without newline: reported, not fatal."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    proc = report(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "torn last line" in proc.stderr and f"{tmp_path / 'metrics.jsonl'}:2" in proc.stderr


def test_a_sweep_written_into_a_run_dir_reports_the_run_and_every_job(sweep, tmp_path):
    """README's flow: ``make demo`` writes runs/sft, then ``python -m tasks.sft -m
    optim.lr=1e-3,3e-3`` writes runs/sft/0 and runs/sft/1: all three are reported."""
    root = tmp_path / "sft"
    args = [f"run.dir={root}", "run.device=cpu",
            "train.max_steps=3", "scheduler.warmup_steps=0", "train.global_batch_size=4",
            "train.micro_batch_size=4", "logging.progress=false", "export.hf=false",
            "checkpoint.save_at_end=false"]  # fmt: skip
    proc = forkserver.run_module("tasks.sft", args, cwd=tmp_path, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for job in ("0", "1"):  # the sweep's real job dirs, as the sweep writes them under root
        shutil.copytree(sweep / job, root / job)
    assert [name for _, name in find_runs(root)] == ["sft", "sft/0", "sft/1"]

    proc = report(root, "--out", tmp_path / "report")
    assert proc.returncode == 0, proc.stderr
    with (tmp_path / "report" / "sweep.csv").open() as handle:
        table = list(csv.DictReader(handle))
    got = sorted((int(row["last_step"]), float(row["final_loss"])) for row in table)
    want = sorted(
        (last_record(d)["step"], last_record(d)["loss"]) for d in (root, root / "0", root / "1")
    )
    assert got == want and [step for step, _ in got] == [3, 6, 6]
    assert len({row["run"] for row in table}) == 3  # each labelled apart


def test_labels_name_only_the_swept_key_with_the_value_each_run_used(sweep, tmp_path):
    """README's flow: ``make demo`` trains into runs/sft (with checkpoint.overwrite=true and
    its own length), the sweep ``-m optim.lr=1e-3,3e-3`` writes runs/sft/0 and /1. The
    labels name optim.lr, the one key swept, also for the demo's run, which left it at its
    default: no checkpoint.overwrite, no train.max_steps."""
    root = tmp_path / "sft"
    shutil.copytree(sweep, root)  # as the sweep wrote it: multirun.yaml, 0/, 1/
    args = [f"run.dir={root}", "checkpoint.overwrite=true", "run.device=cpu",
            "train.max_steps=3", "scheduler.warmup_steps=0", "train.global_batch_size=4",
            "train.micro_batch_size=4", "logging.progress=false", "export.hf=false",
            "checkpoint.save_at_end=false"]  # fmt: skip
    proc = forkserver.run_module("tasks.sft", args, cwd=tmp_path, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = [load_run(d, name=name) for d, name in find_runs(root)]
    label_runs(runs)
    assert [run.label for run in runs] == [
        "optim.lr=0.003 [sft]",  # the default the demo's run trained with
        "optim.lr=0.001",
        "optim.lr=0.003 [sft/1]",
    ]


def test_a_swept_config_group_is_labelled_by_its_option(tmp_path):
    """``-m optim=adamw,full_fp32_adamw`` changes several optim.* keys; the label is the
    group's option each job ran with."""
    args = ["-m", "optim=adamw,full_fp32_adamw", f"run.dir={tmp_path / 'sw'}", "run.device=cpu",
            "train.max_steps=2", "train.global_batch_size=4", "train.micro_batch_size=4",
            "logging.progress=false", "export.hf=false", "checkpoint.save_at_end=false"]  # fmt: skip
    proc = forkserver.run_module("tasks.sft", args, cwd=tmp_path, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = [load_run(d, name=name) for d, name in find_runs(tmp_path / "sw")]
    label_runs(runs)
    assert [run.label for run in runs] == ["optim=adamw", "optim=full_fp32_adamw"]
