"""Compose a task config from ``configs/`` without the CLI (tests, benchmarks, notebooks)."""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

import veoptim
from veoptim.config import TrainerConfig, prefer_explicit, to_config


def _config_dir() -> Path:
    """The Hydra configs: ``veoptim/configs`` in an installed package (setup.py maps the
    checkout's top-level ``configs/`` there at build time, so ``veoptim-sft`` finds them
    anywhere), else the checkout's ``configs/`` beside the ``veoptim`` package."""
    package = Path(veoptim.__file__).resolve().parent
    installed = package / "configs"
    return installed if installed.is_dir() else package.parent / "configs"


CONFIG_DIR = _config_dir()


@dataclass(frozen=True)
class SearchPath:
    """Where a task command finds its configs: the shipped ones (``--config-path`` another
    primary dir instead), then ``--config-dir``, then the registered schemas; as Hydra's
    ``_run_hydra`` builds it."""

    main: str = str(CONFIG_DIR)  # a directory, or Hydra's pkg:// for a relative --config-path
    extra: str | None = None  # --config-dir, absolute

    @classmethod
    def of_command(cls, module: str, config_dir: str | None, config_path: str | None) -> SearchPath:
        """The search path of ``python -m <module> [--config-path P] [--config-dir D]``."""
        from hydra._internal.utils import compute_search_path_dir

        main = compute_search_path_dir(None, module, config_path) if config_path else None
        return cls(main or str(CONFIG_DIR), os.path.abspath(config_dir) if config_dir else None)

    def dirs(self) -> list[Path]:
        """The file-system directories, in the order Hydra looks a config up."""
        found = [] if self.main.startswith("pkg://") else [Path(self.main)]
        return found + ([Path(self.extra)] if self.extra else [])

    @contextlib.contextmanager
    def initialized(self, job_name: str) -> Iterator[None]:
        """Hydra initialised on this search path for ``compose`` (the global state restored
        on exit, as ``initialize_config_dir`` does)."""
        from hydra import version
        from hydra._internal.hydra import Hydra
        from hydra._internal.utils import create_config_search_path
        from hydra.core.config_search_path import SearchPathQuery
        from hydra.initialize import get_gh_backup, restore_gh_from_backup

        backup = get_gh_backup()
        version.setbase("1.3")
        search_path = create_config_search_path(self.main)
        if self.extra:
            search_path.prepend(provider="command-line", path=f"file://{self.extra}",
                                anchor=SearchPathQuery(provider="schema"))  # fmt: skip
        Hydra.create_main_hydra2(task_name=job_name, config_search_path=search_path)
        try:
            yield
        finally:
            restore_gh_from_backup(backup)


def compose_config(name: str = "sft", overrides: list[str] | None = None) -> DictConfig:
    """Compose ``configs/<name>.yaml`` with overrides, validated against the schema like
    the CLI (a key the overrides give replaces its presets' alternative, as on the CLI)."""
    importlib.import_module(f"{__package__}.{name}")  # registers the task's schema
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name=name, overrides=overrides or [])
    prefer_explicit(cfg, overrides or [])  # e.g. a warmup_ratio replaces the preset's steps
    return cfg


def load_config(
    name: str = "sft", overrides: list[str] | None = None, *, resolve_model: bool = True
) -> TrainerConfig:
    """``compose_config`` turned into the task's validated config dataclass (``to_config``)."""
    return to_config(compose_config(name, overrides), resolve_model=resolve_model)
