"""The wheel ships what an installed ``veoptim-sft`` reads at run time.

An installed command finds its configs, recipes and bundled model data inside the
package, so a YAML or asset missing from the wheel breaks only installed users, never a
checkout: build the wheel (from a copy, so the checkout gets no build/ dir) and read its
file list. ``scripts/check_install.sh`` (CI) installs it and runs the commands for real.
"""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: What the build reads (pyproject's packages and readme).
SOURCES = ("pyproject.toml", "README.md", "veoptim", "tasks", "callbacks")
COMMANDS = {
    "veoptim-sft": "tasks.sft:main",
    "veoptim-dpo": "tasks.dpo:main",
    "veoptim-multi-lora": "tasks.multi_lora:main",
    "veoptim-export": "tasks.export:main",
}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    """Build the wheel with the PEP 517 hook pip calls (setuptools from this environment)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
            shutil.copytree(REPO / name, src / name, ignore=ignore)
        else:
            shutil.copy2(REPO / name, src / name)
    out = tmp / "dist"
    code = f"import setuptools.build_meta as b; print(b.build_wheel({str(out)!r}))"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=src, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with zipfile.ZipFile(out / proc.stdout.strip().splitlines()[-1]) as archive:
        yield archive


def _files(root: str, pattern: str) -> set[str]:
    return {p.relative_to(REPO).as_posix() for p in (REPO / root).rglob(pattern) if p.is_file()}


def test_every_config_yaml_is_in_the_wheel(wheel):
    configs = _files("veoptim/configs", "*.yaml")
    assert {"veoptim/configs/sft.yaml", "veoptim/configs/recipes/cuda_sft_16rank.yaml"} <= configs
    assert any(c.startswith("veoptim/configs/hydra/") for c in configs)
    assert sorted(configs - set(wheel.namelist())) == []


def test_every_bundled_asset_is_in_the_wheel(wheel):
    assets = _files("veoptim/assets", "*")
    assert "veoptim/assets/data/sft_train.jsonl" in assets
    assert sorted(assets - set(wheel.namelist())) == []


def test_the_task_commands_are_console_scripts(wheel):
    (entry_points,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    parser = configparser.ConfigParser()
    parser.read_string(wheel.read(entry_points).decode())
    assert dict(parser["console_scripts"]) == COMMANDS
    modules = {f"{target.split(':')[0].replace('.', '/')}.py" for target in COMMANDS.values()}
    assert sorted(modules - set(wheel.namelist())) == []


def test_the_native_kernel_source_is_in_the_wheel(wheel):
    """The CPU optimizer kernel is compiled from its source at run time."""
    assert "veoptim/optim/native/adamw.c" in wheel.namelist()
