"""Every SDK client's ``get_tokenizer()`` works offline for the default served name
``tiny_dense``: the server installs its tokenizer in the Hugging Face cache under that
name (``serve.tokenizer_cache``), and leaves an entry it did not make alone."""

from __future__ import annotations

import json

import pytest

from tests import forkserver
from tests.conftest import REPO
from tests.service.helpers import BASE_MODEL, InProcessServer, client_env
from veoptim.data import bundled_tokenizer_dir, load_tokenizer
from veoptim.service.hub_cache import MARKER, hub_repo_id, install_tokenizer

pytestmark = [pytest.mark.starts_processes, pytest.mark.filterwarnings("ignore::FutureWarning")]


def test_every_clients_tokenizer_loads_offline_for_the_default_name(tmp_path):
    cache = tmp_path / "hub"
    srv = InProcessServer(tmp_path / "serve", f"serve.tokenizer_cache={cache}")
    try:
        out = tmp_path / "tokens.json"
        env = {**client_env(srv.keys["alice"]), "HF_HUB_CACHE": str(cache)}
        done = forkserver.run_module("tests.service.tokenizer_client", [srv.url, str(out)],
                                     cwd=REPO, env=env, timeout=240)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        expected = load_tokenizer("").encode("User: Uppercase word1\nAssistant: WORD1")
        assert json.loads(out.read_text()) == {
            "training": expected,
            "save_weights_and_get_sampling_client": expected,
            "create_sampling_client(base_model)": expected,
            "create_sampling_client(model_path)": expected,
        }
    finally:
        srv.close()


def test_the_cache_entry_is_the_servers_or_left_alone(tmp_path):
    cache = tmp_path / "hub"
    snapshot = install_tokenizer(bundled_tokenizer_dir(), BASE_MODEL, cache)
    assert snapshot is not None and (snapshot / "tokenizer.json").is_file()
    assert install_tokenizer(bundled_tokenizer_dir(), BASE_MODEL, cache) == snapshot  # idempotent
    assert (cache / "models--tiny_dense" / "refs" / "main").read_text() == snapshot.name
    # a real Hub download of a name (no marker): never touched
    other = cache / "models--org--real" / "snapshots" / "abc"
    other.mkdir(parents=True)
    (other / "config.json").write_text('{"model_type": "qwen2"}')
    (cache / "models--org--real" / "refs").mkdir()
    (cache / "models--org--real" / "refs" / "main").write_text("abc")
    assert install_tokenizer(bundled_tokenizer_dir(), "org/real", cache) is None
    assert MARKER not in (other / "config.json").read_text()
    assert hub_repo_id("org/model/variant:3") == "org/model"
    assert hub_repo_id(str(bundled_tokenizer_dir())) is None  # a directory loads as it is
