"""Config files of the user's own (``--config-dir DIR --config-name NAME``), through the real
command: any primary config writes into its ``run.dir`` (single run, sweep, a recipe of
its own), with or without the ``hydra:`` block of ``configs/sft.yaml``; a mistake in such a
file is one line naming the file, the line and the key, exit status 2, as on the command
line."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, run_sft_cli
from tests.test_log_format import odd_lines

pytestmark = pytest.mark.slow

#: A primary config as docs/config.md shows it: the schema and the groups, no hydra block.
MINE = """\
defaults:
  - sft_schema
  - model: tiny_dense
  - optim: adamw
  - scheduler: cosine
  - parallel: single
  - _self_

run:
  dir: runs/mine
train:
  max_steps: 2
  global_batch_size: 4
  micro_batch_size: 4
logging:
  progress: false
export:
  hf: false
"""
#: A recipe of one's own under recipes/, as the shipped ones are written.
RECIPE = """\
# @package _global_
defaults:
  - /sft_schema
  - /model: tiny_dense
  - /optim: master_fp32_adamw
  - _self_

run:
  dir: runs/my_recipe
train:
  max_steps: 2
  global_batch_size: 4
  micro_batch_size: 4
logging:
  progress: false
export:
  hf: false
"""


def write(root: Path, files: dict[str, str]) -> Path:
    """The user's config dir ``root/my_configs`` holding ``files`` (name -> text)."""
    configs = root / "my_configs"
    for name, text in files.items():
        (configs / name).parent.mkdir(parents=True, exist_ok=True)
        (configs / name).write_text(text)
    return configs


def run_own(tmp_path: Path, name: str, *args: str, fresh: bool = False):
    return run_sft_cli(["--config-dir", "my_configs", "--config-name", name, *args], tmp_path,
                       fresh=fresh)  # fmt: skip


def recorded_run_dir(run_dir: Path) -> str:
    return yaml.safe_load((run_dir / "config.yaml").read_text())["run"]["dir"]


def test_a_config_without_the_hydra_block_writes_into_its_run_dir(tmp_path):
    write(tmp_path, {"mine.yaml": MINE})
    proc = run_own(tmp_path, "mine")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "runs" / "mine"
    assert (run_dir / "metrics.jsonl").is_file() and (run_dir / "checkpoints").is_dir()
    assert recorded_run_dir(run_dir) == str(run_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my_configs", "runs"]  # no outputs/
    # Hydra's own lines and the run dir's log file in veoptim's format, as with sft.yaml
    assert odd_lines(proc.stdout) == [] and odd_lines((run_dir / "sft.log").read_text()) == []


def test_a_sweep_of_such_a_config_writes_its_jobs_into_its_run_dir(tmp_path):
    write(tmp_path, {"mine.yaml": MINE})
    proc = run_own(tmp_path, "mine", "-m", "optim.lr=1e-3,2e-3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "runs" / "mine"
    for job in ("0", "1"):
        assert (run_dir / job / "metrics.jsonl").is_file()
        assert recorded_run_dir(run_dir / job) == str(run_dir / job)
    assert (run_dir / "multirun.yaml").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my_configs", "runs"]  # no multirun/
    assert odd_lines(proc.stdout) == []


def test_a_recipe_of_ones_own_writes_into_its_run_dir(tmp_path):
    write(tmp_path, {"recipes/my_recipe.yaml": RECIPE})
    proc = run_own(tmp_path, "recipes/my_recipe")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "runs" / "my_recipe"
    assert (run_dir / "metrics.jsonl").is_file()
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["optim"]["name"] == (
        "master_fp32_adamw"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my_configs", "runs"]


def test_the_command_line_still_sets_hydras_dirs(tmp_path):
    write(tmp_path, {"mine.yaml": MINE})
    proc = run_own(tmp_path, "mine", f"hydra.run.dir={tmp_path / 'elsewhere'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert recorded_run_dir(tmp_path / "elsewhere") == str(tmp_path / "elsewhere")


def _replaced(old: str, new: str) -> str:
    assert old in MINE
    return MINE.replace(old, new)


#: case: (files, the file and the text of the offending line, what the line must say)
MISTAKES = {
    "unknown key": (
        {"mine.yaml": _replaced("  max_steps: 2", "  max_stepz: 2")},
        ("mine.yaml", "max_stepz: 2"),
        ["error: unknown config key train.max_stepz (", "did you mean train.max_steps?"],
    ),
    "unknown section": (
        {"mine.yaml": _replaced("train:", "trian:")},
        ("mine.yaml", "trian:"),
        ["error: unknown config key trian (", "did you mean train?"],
    ),
    "wrong type": (
        {"mine.yaml": _replaced("  max_steps: 2", "  max_steps: many")},
        ("mine.yaml", "max_steps: many"),
        ["error: train.max_steps must be an int, not 'many' ("],
    ),
    "bad group option": (
        {"mine.yaml": _replaced("  - optim: adamw", "  - optim: adamww")},
        ("mine.yaml", "- optim: adamww"),
        ["error: unknown option 'adamww' of config group optim (", "did you mean optim=adamw?",
         "valid options: adamw, cpu_offload_adamw, full_fp32_adamw, master_fp32_adamw"],
    ),
    "yaml syntax": (
        {"mine.yaml": _replaced("  max_steps: 2", "  max_steps: [2")},
        ("mine.yaml", "global_batch_size: 4"),  # where the parser saw the sequence unclosed
        ["error: config file my_configs/mine.yaml is not valid YAML: expected ',' or ']'",
         "while parsing a flow sequence at line 12"],
    ),
    "unknown key in a group file": (
        {"mine.yaml": _replaced("  - optim: adamw", "  - optim: my_adamw"),
         "optim/my_adamw.yaml": "name: adamw\nlrr: 0.001\n"},
        ("optim/my_adamw.yaml", "lrr: 0.001"),
        ["error: unknown config key optim.lrr (", "did you mean optim.lr?"],
    ),
    "no schema": (
        {"mine.yaml": MINE.split("\n\n", 1)[1]},  # the defaults list left out
        None,
        ["error: my_configs/mine.yaml composes no task schema", "'- sft_schema'"],
    ),
}  # fmt: skip


def _place(configs: Path, file: str, text: str) -> str:
    lines = (configs / file).read_text().splitlines()
    return (
        f"my_configs/{file}:{lines.index(next(x for x in lines if x.strip() == text)) + 1}: {text}"
    )


@pytest.mark.parametrize("case", list(MISTAKES))
def test_a_mistake_in_ones_own_config_file_is_one_line_naming_file_line_and_key(tmp_path, case):
    files, offending, expected = MISTAKES[case]
    configs = write(tmp_path, files)
    proc = run_own(tmp_path, "mine", "-m", "optim.lr=1e-3,2e-3")  # a sweep checks the same way
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and not proc.stdout, proc.stdout + proc.stderr
    for text in expected + ([_place(configs, *offending)] if offending else []):
        assert text in lines[0], lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my_configs"]  # nothing ran


def test_a_mistake_in_ones_own_config_is_one_line_from_a_new_interpreter(tmp_path):
    """What the interpreter itself prints counts too (the other cases fork a preloaded one)."""
    write(tmp_path, {"mine.yaml": MINE.replace("  max_steps: 2", "  max_stepz: 2")})
    proc: subprocess.CompletedProcess = run_own(tmp_path, "mine", fresh=True)
    assert proc.returncode == 2 and not proc.stdout, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and "unknown config key train.max_stepz" in proc.stderr


def test_help_shows_the_defaults_of_ones_own_config(tmp_path):
    write(tmp_path, {"mine.yaml": MINE})
    proc = run_own(tmp_path, "mine", "--help")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Config keys (key=value; defaults of mine.yaml (--config-name)):" in proc.stdout
    assert "\n    run.dir: str = runs/mine\n" in proc.stdout
    assert "\n    train.max_steps: int = 2\n" in proc.stdout


def _documented() -> tuple[list[str], str]:
    """docs/config.md's own-config examples (the YAML blocks) and its example error line."""
    text = (REPO / "docs" / "config.md").read_text().split("## Your own config files", 1)[1]
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.S)
    error = re.search(r"`(error: unknown config key .*?)`", text).group(1)
    return blocks, error


@pytest.mark.parametrize("example", [0, 1])
def test_the_documented_config_files_run_into_their_run_dir(tmp_path, example):
    blocks, _ = _documented()
    write(tmp_path, {"mine.yaml": blocks[example]})
    short = ["train.max_steps=2", "logging.progress=false", "export.hf=false"]
    proc = run_own(tmp_path, "mine", *short)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert recorded_run_dir(tmp_path / "runs" / "mine") == str(tmp_path / "runs" / "mine")


def test_the_documented_mistake_prints_the_documented_line(tmp_path):
    blocks, error = _documented()
    write(tmp_path, {"mine.yaml": blocks[0].replace("max_steps: 200", "max_stepz: 200")})
    proc = run_own(tmp_path, "mine")
    assert proc.returncode == 2 and proc.stderr.strip() == error, proc.stderr
