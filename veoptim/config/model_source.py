"""Where ``model.path``'s model comes from, decided once when the config is read.

* a local directory: used as given (a veoptim run directory is refused, naming the export
  inside it to pass instead);
* otherwise a Hugging Face Hub id (``org/name``): the snapshot in the local Hub cache
  (``HF_HUB_CACHE``), downloaded first unless ``HF_HUB_OFFLINE=1``. ``model.path`` becomes
  the snapshot directory, ``model.hub_id`` the id and ``model.revision`` the commit the
  revision resolved to, so the run's resolved config pins the exact model it trained on.
"""

from __future__ import annotations

import os
from pathlib import Path

from veoptim.config.schema import ModelConfig
from veoptim.errors import ConfigError

#: What a Hub download fetches: configs, safetensors weights, tokenizer files, templates.
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
#: What marks a Hugging Face model directory.
MODEL_CONFIG_FILE = "config.json"
#: What marks a veoptim run directory (``run.dir``).
RUN_DIR_FILE = "config.yaml"
RUN_DIR_SUBDIRS = ("checkpoints", "exports")


def hub_cache_dir() -> str:
    """The Hub cache huggingface_hub reads (``HF_HUB_CACHE``, else ``$HF_HOME/hub``)."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return constants.HF_HUB_CACHE


def hub_offline() -> bool:
    """Whether downloads are off (``HF_HUB_OFFLINE``, as huggingface_hub reads it)."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE")
    if value is None:
        return bool(constants.HF_HUB_OFFLINE)
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")


def is_hub_id(name: str) -> bool:
    """``name`` has the form of a Hub repo id (``name`` or ``org/name``)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if name.startswith((".", "~", "/")):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _download_hint(repo_id: str, revision: str) -> str:
    rev = f" --revision {revision}" if revision else ""
    return f"`hf download {repo_id}{rev}` (older huggingface_hub: `huggingface-cli download {repo_id}{rev}`)"


def hub_snapshot(repo_id: str, revision: str = "", *, local_only: bool = False) -> tuple[Path, str]:
    """``(snapshot directory, commit hash)`` of ``repo_id`` at ``revision`` (default
    ``main``): the local cache when offline (or ``local_only``), else downloaded into it
    (ConfigError)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache, offline = hub_cache_dir(), local_only or hub_offline()
    at = f" at revision {revision}" if revision else ""
    try:
        folder = snapshot_download(
            repo_id,
            revision=revision or None,
            cache_dir=cache,
            local_files_only=offline,
            allow_patterns=HUB_FILES,
        )
    except (RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError) as error:
        raise ConfigError(
            f"model.path={repo_id}{at}: the Hugging Face Hub refused it "
            f"({type(error).__name__}: {str(error).splitlines()[0]}); check the id and "
            "revision, and for a gated or private model log in (`hf auth login`)."
        ) from error
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as error:
        why = (
            (
                "downloads are off (HF_HUB_OFFLINE=1)"
                if hub_offline()
                else "nothing is downloaded here"
            )
            if offline
            else f"it could not be downloaded ({type(error).__name__}: {str(error).splitlines()[0]})"
        )
        raise ConfigError(
            f"model.path={repo_id} is no local directory, so it names a Hugging Face Hub model, "
            f"but {repo_id}{at} is not in the local Hub cache (HF_HUB_CACHE={cache}) and {why}; "
            f"download it with {_download_hint(repo_id, revision)} on a machine with network "
            "access into that cache, or pass a local model directory as model.path."
        ) from error
    folder_path = Path(folder)
    return folder_path, folder_path.name


def _refuse_run_dir(path: Path, given: str) -> None:
    """A veoptim run directory is no model: name the export inside it to pass instead."""
    if (path / MODEL_CONFIG_FILE).is_file() or not (path / RUN_DIR_FILE).is_file():
        return
    if not any((path / sub).is_dir() for sub in RUN_DIR_SUBDIRS):
        return
    exports = path / "exports"
    models = sorted(
        p.name for p in exports.glob("*") if not p.name.startswith(".") and (p / MODEL_CONFIG_FILE).is_file()
    ) if exports.is_dir() else []  # fmt: skip
    adapters = sorted(
        p.name for p in exports.glob("*") if (p / "adapter_config.json").is_file()
    ) if exports.is_dir() else []  # fmt: skip
    where = f"model.path={given} is a veoptim run directory (config.yaml, checkpoints/, exports/), not a model"
    if models:
        best = "hf_final" if "hf_final" in models else models[-1]
        raise ConfigError(
            f"{where}; pass one of its Hugging Face exports: model.path={given.rstrip('/')}"
            f"/exports/{best}"
            + (f" (exports: {', '.join(models)})" if len(models) > 1 else "")
            + "."
        )
    if adapters:
        raise ConfigError(
            f"{where}, and its exports are LoRA adapters ({', '.join(adapters)}), which need their "
            "base: export a merged model (veoptim-export <checkpoint> --format merged, or "
            "export.merge_lora=true) and pass that as model.path."
        )
    raise ConfigError(
        f"{where}, and it has no Hugging Face export yet; write one with veoptim-export "
        f"{given.rstrip('/')}/checkpoints/<step_...> --out {given.rstrip('/')}/exports --name "
        f"hf_final and pass model.path={given.rstrip('/')}/exports/hf_final."
    )


def resolve_model_source(model: ModelConfig) -> None:
    """Resolve ``model.path`` in place (see the module docstring; ConfigError)."""
    if not model.path:
        if model.revision:
            raise ConfigError(
                f"model.revision={model.revision} is set, but model.path is empty; "
                "model.revision selects the revision of a Hub model (model.path=org/name)."
            )
        return
    path = Path(model.path).expanduser()
    if path.is_dir():
        if model.revision and not model.hub_id:
            raise ConfigError(
                f"model.revision={model.revision} is set, but model.path={model.path} is a "
                "local directory; model.revision applies to a Hub model id (model.path=org/name)."
            )
        _refuse_run_dir(path, model.path)
        if not (path / MODEL_CONFIG_FILE).is_file():
            # Said here, before the tokenizer is looked for in the same directory: a missing
            # model is the problem, not its tokenizer files.
            raise ConfigError(
                f"model.path={model.path}: {path.resolve()} has no {MODEL_CONFIG_FILE}, so it is "
                f"not a Hugging Face model directory (expected {MODEL_CONFIG_FILE} beside the "
                "weights and tokenizer files, as save_pretrained writes them)."
            )
        return
    if path.exists():
        raise ConfigError(
            f"model.path={model.path} is a file; it must be a model directory or a Hub id."
        )
    if not is_hub_id(model.path):
        raise ConfigError(
            f"model.path={model.path} does not exist: it is no local directory, and not a "
            "Hugging Face Hub id (org/name) either."
        )
    folder, commit = hub_snapshot(model.path, model.revision)
    model.hub_id, model.path, model.revision = model.path, str(folder), commit
