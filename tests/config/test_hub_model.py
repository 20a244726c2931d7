"""``model.path`` as a Hugging Face Hub id: resolved through huggingface_hub from the local
Hub cache (offline here), the commit pinned in the resolved config, a one-line error
naming the id, the cache and the download command when it is not there; and a veoptim
run directory as ``model.path`` names the export inside it to pass instead."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest
from huggingface_hub import scan_cache_dir, snapshot_download
from huggingface_hub.file_download import (
    _cache_commit_hash_for_specific_revision,
    _create_symlink,
    repo_folder_name,
)

from tasks.runner import run_task
from tests.config.test_model_path import _model_dir
from tests.conftest import compose_sft
from veoptim.config import to_config
from veoptim.errors import ConfigError

REPO_ID = "tiny-org/tiny-qwen"


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def put_in_hub_cache(cache: Path, repo_id: str, source: Path, revision: str = "main") -> str:
    """Lay ``source``'s files out in ``cache`` as ``hf_hub_download`` does, with
    huggingface_hub's own helpers: ``models--org--name/blobs/<etag>`` (the SHA-256 of an LFS
    file such as safetensors, the git blob SHA-1 of others), ``snapshots/<commit>/<file>``
    relative links to the blobs, and ``refs/<revision>`` holding the commit. Returns it."""
    files = sorted(p for p in source.rglob("*") if p.is_file())
    commit = hashlib.sha1(b"".join(p.read_bytes() for p in files)).hexdigest()
    storage = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    for file in files:
        data = file.read_bytes()
        lfs = file.suffix == ".safetensors"
        etag = hashlib.sha256(data).hexdigest() if lfs else _git_blob_sha1(data)
        blob = storage / "blobs" / etag
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        pointer = storage / "snapshots" / commit / file.relative_to(source)
        pointer.parent.mkdir(parents=True, exist_ok=True)
        _create_symlink(str(blob), str(pointer), new_blob=False)
    _cache_commit_hash_for_specific_revision(str(storage), revision, commit)
    return commit


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A temporary ``HF_HUB_CACHE`` holding ``tiny-org/tiny-qwen`` (offline)."""
    cache = tmp_path / "hub"
    commit = put_in_hub_cache(cache, REPO_ID, _model_dir(tmp_path / "src"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub itself recognises the layout: one repo, one revision, refs/main.
    (repo,) = scan_cache_dir(cache).repos
    assert repo.repo_id == REPO_ID and {r.commit_hash for r in repo.revisions} == {commit}
    assert snapshot_download(REPO_ID, cache_dir=cache, local_files_only=True).endswith(commit)
    return cache, commit


def test_a_hub_id_trains_from_the_cache_with_its_commit_pinned(hub_cache, tiny_overrides, caplog):
    cache, commit = hub_cache
    overrides = [*tiny_overrides, f"model.path={REPO_ID}", "train.max_steps=2"]
    cfg = to_config(compose_sft(overrides))
    snapshot = cache / f"models--tiny-org--tiny-qwen/snapshots/{commit}"
    assert (cfg.model.path, cfg.model.hub_id, cfg.model.revision) == (
        str(snapshot),
        REPO_ID,
        commit,
    )
    with caplog.at_level(logging.INFO, logger="veoptim"):
        result = run_task(compose_sft(overrides))
    assert result["final_loss"] == result["final_loss"]  # trained (not NaN)
    # The log names the Hub id (not the tiny_dense preset label model.path overrides).
    started = [r.getMessage() for r in caplog.records if r.getMessage().startswith("training ")]
    assert started and started[0].startswith(f"training {REPO_ID} (qwen2,"), started
    resolved = (Path(tiny_overrides[0].split("=", 1)[1]) / "config.yaml").read_text()
    assert f"revision: {commit}" in resolved and f"hub_id: {REPO_ID}" in resolved
    # The pinned revision (a branch name too) selects the same snapshot.
    pinned = to_config(compose_sft([*overrides, f"model.revision={commit}"]))
    assert pinned.model.path == str(snapshot)
    assert to_config(compose_sft([*overrides, "model.revision=main"])).model.revision == commit


def test_a_hub_id_missing_from_the_cache_says_which_cache_and_how_to_download(
    hub_cache, tiny_overrides
):
    cache, _ = hub_cache
    with pytest.raises(ConfigError) as caught:
        to_config(compose_sft([*tiny_overrides, "model.path=Qwen/Qwen2.5-0.5B-Instruct"]))
    message = str(caught.value)
    assert "\n" not in message
    for part in ("model.path=Qwen/Qwen2.5-0.5B-Instruct", "Hugging Face Hub model",
                 "not in the local Hub cache", f"HF_HUB_CACHE={cache}", "HF_HUB_OFFLINE=1",
                 "`hf download Qwen/Qwen2.5-0.5B-Instruct`",
                 "huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct"):  # fmt: skip
        assert part in message, (part, message)
    with pytest.raises(ConfigError, match=r"at revision v9.*--revision v9"):
        to_config(compose_sft([*tiny_overrides, f"model.path={REPO_ID}", "model.revision=v9"]))


def test_a_path_that_is_neither_a_directory_nor_a_hub_id_says_so(tiny_overrides, tmp_path):
    with pytest.raises(ConfigError, match="does not exist: it is no local directory, and not a"):
        to_config(compose_sft([*tiny_overrides, f"model.path={tmp_path}/no/such/model"]))
    with pytest.raises(ConfigError, match="model.revision applies to a Hub model id"):
        to_config(compose_sft([*tiny_overrides, f"model.path={tmp_path}", "model.revision=main"]))


def test_a_run_directory_as_model_path_names_the_export_to_use(tmp_path, tiny_overrides):
    run_dir = tmp_path / "run"
    overrides = [*tiny_overrides, "train.max_steps=1"]
    run_task(compose_sft([*overrides, "export.hf=true"]))
    with pytest.raises(ConfigError) as caught:
        to_config(compose_sft([*tiny_overrides, f"model.path={run_dir}"]))
    message = str(caught.value)
    assert "is a veoptim run directory" in message
    assert f"model.path={run_dir}/exports/hf_final" in message
    assert "data.tokenizer_path" not in message
    # Without an export yet: how to write one.
    bare = tmp_path / "bare"
    (bare / "checkpoints").mkdir(parents=True)
    (bare / "config.yaml").write_text(json.dumps({}))
    with pytest.raises(
        ConfigError, match="has no Hugging Face export yet; write one with veoptim-export"
    ):
        to_config(compose_sft([*tiny_overrides, f"model.path={bare}"]))
