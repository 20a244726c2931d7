"""checkpoint.write_threads: one DCP shard file per writer thread (either checkpoint.format),
same state on load."""

from __future__ import annotations

import pytest

from tests.checkpoint.ckpt_state import (
    assert_bitwise_equal,
    build_trainer,
    load_with,
    save_with,
    snapshot,
)
from veoptim.checkpoint import component as C
from veoptim.checkpoint import resolve
from veoptim.checkpoint.checkpointer import Checkpointer
from veoptim.errors import ConfigError

SUFFIX = {"raw": ".raw", "dcp": ".distcp"}


@pytest.mark.parametrize("fmt", ["raw", "dcp"])
@pytest.mark.parametrize("threads", [1, 3])
def test_each_writer_thread_writes_a_shard_and_the_load_is_bitwise(tmp_path, threads, fmt):
    writer = build_trainer(tmp_path / "w")
    writer.train_step()
    root = tmp_path / "ckpt"
    checkpointer = Checkpointer(root, fsync=False, write_threads=threads, storage_format=fmt)
    save_with(checkpointer, writer, "s1")
    files = sorted(p.name for p in (resolve(root, "s1") / C.DCP_DIR).iterdir())
    assert files == [".metadata", *(f"__0_{n}{SUFFIX[fmt]}" for n in range(threads))]
    reader = build_trainer(tmp_path / "r")
    load_with(Checkpointer(root), reader, "s1")
    assert_bitwise_equal(snapshot(writer)["params"], snapshot(reader)["params"])
    assert_bitwise_equal(snapshot(writer)["state"], snapshot(reader)["state"])


def test_zero_writer_threads_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="checkpoint.write_threads must be >= 1"):
        Checkpointer(tmp_path, write_threads=0)


def test_an_unknown_format_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="checkpoint.format must be one of"):
        Checkpointer(tmp_path, storage_format="safetensors")
