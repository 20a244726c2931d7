"""Every log line of a task command has one format, whichever phase or library wrote it.

Hydra's launcher lines, a config error logged before ``setup_logging``, veoptim's and
the callbacks' lines, transformers' and Python's warnings, the run dir's log file:
``[rankN] <date> <time>,<ms> LEVEL logger: message`` (the rank prefix only with several ranks).
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from tasks.compose import CONFIG_DIR
from tests import forkserver
from tests.conftest import REPO
from veoptim.distributed import DistContext, setup_logging

pytestmark = pytest.mark.slow

LINE = re.compile(
    r"(\[rank\d+\] )?\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) \S+: .*"
)
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def sft(cwd: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "tasks.sft", *overrides, "logging.progress=false"]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=ENV, timeout=300)


def odd_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip() and not LINE.fullmatch(line)]


def test_a_sweep_job_logs_every_line_in_one_format(tmp_path):
    """``-m`` adds Hydra's launcher lines; the job trains, checkpoints and exports."""
    sweep = tmp_path / "sweep"
    proc = sft(tmp_path, "-m", "train.max_steps=2", f"run.dir={sweep}", "run.device=cpu")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert odd_lines(proc.stdout) == [] and odd_lines(proc.stderr) == []
    names = {line.split()[3] for line in proc.stdout.splitlines() if line.strip()}
    assert {"veoptim:", "callbacks.checkpoint:", "callbacks.hf_export:"} <= names
    assert any(name.startswith("hydra.") for name in names), names
    log_file = (sweep / "0" / "sft.log").read_text()
    assert "INFO veoptim: training " in log_file and odd_lines(log_file) == []


def test_an_error_before_setup_logging_has_the_same_format(tmp_path):
    proc = sft(tmp_path, "optim.lr=-1", f"run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2
    output = proc.stdout + proc.stderr
    assert "ERROR veoptim: ConfigError: optim.lr must be >= 0" in output
    assert odd_lines(output) == []


def screen(text: str) -> list[str]:
    """The lines a terminal shows for ``text``: ``\\r`` returns to the line's start and what
    follows overwrites it (how tqdm redraws its bar in place)."""
    lines = []
    for physical in text.split("\n"):
        row: list[str] = []
        column = 0
        for char in physical:
            if char == "\r":
                column = 0
                continue
            row[column : column + 1] = [char]
            column += 1
        lines.append("".join(row).rstrip())
    return lines


def test_log_lines_never_continue_the_progress_bars_line(tmp_path):
    """Checkpoints saved while the bar is drawn log a line each; on one console (stdout and
    stderr together, as a terminal shows them) every such line starts on a line of its own
    and the bar is drawn again below it."""
    output = tmp_path / "console.txt"
    args = [f"run.dir={tmp_path / 'run'}", "train.max_steps=6", "checkpoint.save_steps=2",
            "train.global_batch_size=4", "train.micro_batch_size=4", "export.hf=false",
            "logging.progress=true"]  # fmt: skip
    env = {**ENV, "PYTHONUNBUFFERED": "1"}
    process = forkserver.ForkedModule("tasks.sft", args, cwd=tmp_path, env=env, stdout=output)
    assert process.wait(300) == 0, output.read_text()[-3000:]
    lines = [line for line in screen(output.read_text()) if line]
    saved = [line for line in lines if "saved checkpoint" in line]
    assert len(saved) == 3, lines
    logged = [line for line in lines if re.search(r"\d,\d{3} (INFO|WARNING) ", line)]
    glued = [line for line in logged if not LINE.fullmatch(line)]
    assert glued == [], glued
    bars = [i for i, line in enumerate(lines) if "/6 [" in line]
    assert bars and bars[-1] > lines.index(saved[0])  # drawn again after the line


@contextmanager
def veoptim_logging() -> Iterator[None]:
    """``setup_logging`` of a single process; the loggers it touches restored afterwards."""
    loggers = [logging.getLogger(name) for name in ("", "transformers", "huggingface_hub")]
    saved = [(lg.level, list(lg.handlers), lg.propagate) for lg in loggers]
    showwarning = warnings.showwarning
    try:
        setup_logging(DistContext(0, 1, 0, torch.device("cpu"), "gloo"), "INFO")
        yield
    finally:
        for lg, (level, handlers, propagate) in zip(loggers, saved, strict=True):
            lg.level, lg.handlers[:], lg.propagate = level, handlers, propagate
        warnings.showwarning = showwarning


def test_python_warnings_become_one_log_line(capsys):
    with veoptim_logging(), warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("first part\n  second part", UserWarning, stacklevel=1)
    (line,) = capsys.readouterr().err.splitlines()
    assert LINE.fullmatch(line), line
    assert "WARNING py.warnings: UserWarning: first part second part (" in line


def test_transformers_logs_through_veoptim_handlers(capsys):
    from transformers.utils import logging as transformers_logging

    with veoptim_logging():
        transformers_logging.get_logger("transformers.modeling_utils").warning("from transformers")
    (line,) = capsys.readouterr().err.splitlines()
    assert LINE.fullmatch(line) and line.endswith("transformers.modeling_utils: from transformers")


def test_every_task_config_and_recipe_selects_veoptim_log_format():
    """A new recipe that forgets the ``override /hydra/job_logging`` lines fails here."""
    import tasks.dpo  # noqa: F401 - register the schemas the configs compose over
    import tasks.multi_lora  # noqa: F401
    import tasks.sft  # noqa: F401

    names = ["sft", "dpo", "multi_lora"]
    names += [f"recipes/{p.stem}" for p in sorted((CONFIG_DIR / "recipes").glob("*.yaml"))]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        for name in names:
            choices = compose(config_name=name, return_hydra_config=True).hydra.runtime.choices
            logging_choices = (choices["hydra/job_logging"], choices["hydra/hydra_logging"])
            assert logging_choices == ("veoptim", "veoptim"), name
