"""The wheel ships what an installed ``veoptim-sft`` reads at run time.

An installed command finds its configs, recipes and bundled model data inside the
package, so a YAML or asset missing from the wheel breaks only installed users, never a
checkout: build the wheel (from a copy, so the checkout gets no build/ dir) and read its
file list. ``scripts/check_install.sh`` (CI) installs it and runs the commands for real.
The checkout's top-level ``tasks/`` and ``callbacks/`` ship as ``veoptim.tasks`` and
``veoptim.callbacks`` (setup.py): the wheel claims no top-level name but ``veoptim``.
"""

from __future__ import annotations

import configparser
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
#: What the build reads (pyproject's packages and readme).
SOURCES = ("pyproject.toml", "setup.py", "README.md", "veoptim", "tasks", "callbacks", "configs")
COMMANDS = {
    "veoptim-sft": "veoptim.tasks.sft:main",
    "veoptim-dpo": "veoptim.tasks.dpo:main",
    "veoptim-multi-lora": "veoptim.tasks.multi_lora:main",
    "veoptim-export": "veoptim.tasks.export:main",
    "veoptim-serve": "veoptim.tasks.serve:main",
    "veoptim-generate": "veoptim.tasks.generate:main",
    "veoptim-sweep-report": "veoptim.tasks.sweep_report:main",
}
#: checkout directory -> the package it is installed as
INSTALLED_AS = {
    "veoptim": "veoptim",
    "tasks": "veoptim/tasks",
    "callbacks": "veoptim/callbacks",
    "configs": "veoptim/configs",
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


def test_every_config_yaml_is_in_the_wheel_under_the_package(wheel):
    """The checkout's top-level configs/ ships as veoptim/configs/ (mapped at build time)."""
    configs = _files("configs", "*.yaml")
    assert {"configs/sft.yaml", "configs/recipes/cuda_sft_16rank.yaml"} <= configs
    assert any(c.startswith("configs/hydra/") for c in configs)
    assert sorted({f"veoptim/{c}" for c in configs} - set(wheel.namelist())) == []


def test_the_checkout_keeps_one_copy_of_the_configs():
    """No hand-kept copy inside the package: the checkout composes from configs/."""
    from tasks.compose import CONFIG_DIR

    assert not (REPO / "veoptim" / "configs").exists()
    assert CONFIG_DIR == REPO / "configs"


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
    assert "veoptim/optim/kernels/adamw.c" in wheel.namelist()


def test_the_wheel_claims_no_top_level_name_but_veoptim(wheel):
    """No generic ``tasks`` or ``callbacks`` in a user's site-packages."""
    names = wheel.namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"veoptim"}
    (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
    assert wheel.read(top_level).decode().split() == ["veoptim"]


def test_every_module_of_the_checkout_is_in_the_wheel_under_its_installed_name(wheel):
    expected = {
        f"{installed}/{path.relative_to(REPO / directory).as_posix()}"
        for directory, installed in INSTALLED_AS.items()
        for path in (REPO / directory).rglob("*.py")
        if "__pycache__" not in path.parts
    }
    assert {"veoptim/tasks/sft.py", "veoptim/callbacks/__init__.py"} <= expected
    assert sorted(expected - set(wheel.namelist())) == []


def test_a_build_in_the_checkout_is_ignored_by_git():
    """``pip install .`` writes build/ (setuptools' build_py) into the checkout."""
    proc = subprocess.run(
        ["git", "check-ignore", "build/lib/veoptim/__init__.py", "dist/veoptim.whl"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["build/lib/veoptim/__init__.py", "dist/veoptim.whl"]


USER_CODE = """
import json, os, sys
import callbacks, tasks  # the user's own packages, beside the installed veoptim
import veoptim.tasks.multi_lora, veoptim.tasks.runner, veoptim.tasks.sweep_report
assert tasks.MINE and callbacks.MINE, "the user's packages were shadowed"
assert veoptim.__file__.startswith(os.environ["SITE"]), veoptim.__file__
mine = {"tasks", "callbacks"}
assert not [m for m in sys.modules if m.split(".")[0] in mine and m not in mine], sorted(sys.modules)
assert veoptim.tasks.runner.standard_callbacks.__module__ == "veoptim.callbacks"
sys.exit(veoptim.tasks.sweep_report.main(["run", "--out", "report"]))
"""


def test_the_installed_package_leaves_a_users_own_tasks_and_callbacks_alone(wheel, tmp_path):
    """The wheel unpacked as site-packages, run from a project with its own ``tasks`` and
    ``callbacks`` packages: both stay the user's, the tasks and the sweep report run."""
    site, user = tmp_path / "site", tmp_path / "user"
    wheel.extractall(site)
    for name in ("tasks", "callbacks"):
        (user / name).mkdir(parents=True)
        (user / name / "__init__.py").write_text("MINE = True\n")
    (user / "run").mkdir()
    records = [{"step": s, "loss": 3.0 / s, "lr": 1e-3, "tokens_per_s": 1.0} for s in (1, 2, 3)]
    (user / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    env = {**os.environ, "PYTHONPATH": str(site), "SITE": str(site), "OMP_NUM_THREADS": "1"}
    env.update(HF_HUB_OFFLINE="1", WANDB_MODE="disabled")

    def python(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, *args], cwd=user, env=env, capture_output=True, text=True, timeout=300
        )

    proc = python("-c", USER_CODE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (user / "report" / "sweep.csv").is_file()
    assert proc.stdout == (user / "report" / "sweep.md").read_text() and "| run" in proc.stdout
    # The installed task module runs, and its torchrun hint names it.
    proc = python(
        "-m", "veoptim.tasks.sft", "parallel=fsdp_ep2", "run.dir=r", "logging.progress=false"
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    hint = "torchrun --standalone --nproc_per_node 2 -m veoptim.tasks.sft parallel=fsdp_ep2"
    assert hint in proc.stdout + proc.stderr
