"""The training service: ``python -m tasks.serve [key=value ...]`` (``veoptim-serve``).

Serves the Tinker API over multi-LoRA slots (``docs/service.md``); a client sets
``TINKER_BASE_URL=http://127.0.0.1:8000`` and ``TINKER_API_KEY=tml-...``. Keys:
``veoptim-serve keys add NAME [key=value ...]`` prints a new key for tenant NAME (stored
hashed in ``<run.dir>/service.sqlite``); ``veoptim-serve keys list`` lists the tenants.
Under ``torchrun`` rank 0 serves and every rank runs the trainer calls (``parallel=fsdp``).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from datetime import timedelta
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from veoptim.config import to_config
from veoptim.errors import ConfigError, VeoptimError
from veoptim.service import ServeConfig
from veoptim.service.auth import check_tenant_name, key_hash, new_key
from veoptim.service.db import DB_FILE, Database

from .cli import task_command
from .runner import run_dir_of_job

if TYPE_CHECKING:
    from veoptim.distributed import DistContext

# The trainer, torch and the HTTP server are imported once the config is valid (in job):
# --help, a mistyped key and the keys command answer without loading them.

NAME = "serve"
#: What the server imports of the ``service`` extra (pyproject.toml), checked before the
#: model loads: a missing one was a traceback through Hydra after the base was built.
SERVICE_MODULES = ("fastapi", "uvicorn", "httptools", "tinker", "zstandard")
log = logging.getLogger("veoptim")
USAGE = (
    "usage: veoptim-serve keys add NAME [key=value ...] | veoptim-serve keys list [key=value ...]"
)


def check_service_extra() -> None:
    """ConfigError naming ``pip install 'veoptim[service]'`` when a package of the extra
    does not import (imported, not only looked up: serving needs them next anyway)."""
    for module in SERVICE_MODULES:
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise ConfigError(
                f"veoptim-serve needs the service extra, but its package {module} does not "
                f"import ({error}); install it with pip install 'veoptim[service]'."
            ) from None


def job(cfg: DictConfig) -> None:
    try:
        check_service_extra()
        cfg = cfg.copy()
        cfg.run.dir = run_dir_of_job(cfg)
        config = to_config(cfg)
        assert isinstance(config, ServeConfig)
        config.check_serve_keys()
        from veoptim.distributed import init_distributed, setup_logging

        timeout = timedelta(seconds=config.serve.rank_timeout_s)
        ctx = init_distributed(config.run.device, config.parallel.backend, os.environ, timeout)
        setup_logging(ctx, config.logging.level, config.logging.progress)
        try:
            from veoptim.rundir import locked_run_dir

            with locked_run_dir(config.run.dir, "this server"):  # one server per run dir
                serve_on(ctx, config)
        finally:
            ctx.close()
    except VeoptimError as error:
        log.error("%s: %s", type(error).__name__, error)
        sys.exit(2)


def serve_on(ctx: DistContext, config: ServeConfig) -> None:
    """Rank 0 serves; the other ranks of a torchrun job run its trainer calls. Returns
    once the service stopped, holding nothing of the model (the groups can go)."""
    from veoptim.service.ranks import ServedTrainer
    from veoptim.service.runtime import Service
    from veoptim.service.server import serve
    from veoptim.service.threads import apply_server_threads
    from veoptim.slots import SlotTrainer

    apply_server_threads(config.serve.threads)
    served = ServedTrainer(SlotTrainer.from_config(config, ctx), config.serve.rank_timeout_s)
    try:
        if ctx.is_main:
            serve(Service(config, served))
        else:
            served.follow()
    finally:
        served.close()


def keys_command(argv: list[str]) -> int:
    """``keys add NAME [overrides]`` / ``keys list [overrides]`` on the run dir's database."""
    from .compose import load_config

    if not argv or argv[0] not in ("add", "list") or (argv[0] == "add" and len(argv) < 2):
        print(USAGE, file=sys.stderr)
        return 2
    overrides = argv[2:] if argv[0] == "add" else argv[1:]
    try:
        config = load_config(NAME, overrides)
        database = Database(os.path.join(config.run.dir, DB_FILE))
        try:
            if argv[0] == "list":
                print("\n".join(database.tenant_names()))
                return 0
            name = check_tenant_name(argv[1])
            key = new_key()
            database.add_tenant(name, key_hash(key))
        finally:
            database.close()
    except VeoptimError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(key)
    print(f"tenant {name!r} added to {config.run.dir}/{DB_FILE}; the key is shown only now.",
          file=sys.stderr)  # fmt: skip
    return 0


_serve = task_command(NAME, ServeConfig, job)


def keys_argv(argv: list[str]) -> list[str] | None:
    """The ``keys`` command's arguments (overrides before ``keys`` moved after it), or
    None when ``argv`` is a plain serve command line."""
    words = [i for i, arg in enumerate(argv) if "=" not in arg and not arg.startswith("-")]
    if not words or argv[words[0]] != "keys":
        return None
    first = words[0]
    return argv[first + 1 :] + argv[:first]


def main() -> None:
    keys = keys_argv(sys.argv[1:])
    if keys is not None:
        sys.exit(keys_command(keys))
    _serve()


if __name__ == "__main__":
    main()
