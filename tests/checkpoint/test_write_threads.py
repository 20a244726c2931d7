"""checkpoint.write_threads: one DCP shard file per writer thread, same state on load."""

from __future__ import annotations

import pytest

from tests.checkpoint.ckpt_state import (
    assert_bitwise_equal,
    build_trainer,
    load_with,
    save_with,
    snapshot,
)
from veoptim.checkpoint import contents as C
from veoptim.checkpoint import resolve
from veoptim.checkpoint.checkpointer import Checkpointer
from veoptim.errors import ConfigError


@pytest.mark.parametrize("threads", [1, 3])
def test_each_writer_thread_writes_a_shard_and_the_load_is_bitwise(tmp_path, threads):
    writer = build_trainer(tmp_path / "w")
    writer.train_step()
    root = tmp_path / "ckpt"
    save_with(Checkpointer(root, fsync=False, write_threads=threads), writer, "s1")
    shards = sorted(p.name for p in (resolve(root, "s1") / C.DCP_DIR).glob("*.distcp"))
    assert shards == [f"__0_{n}.distcp" for n in range(threads)]
    reader = build_trainer(tmp_path / "r")
    load_with(Checkpointer(root), reader, "s1")
    assert_bitwise_equal(snapshot(writer)["params"], snapshot(reader)["params"])
    assert_bitwise_equal(snapshot(writer)["state"], snapshot(reader)["state"])


def test_zero_writer_threads_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="checkpoint.write_threads must be >= 1"):
        Checkpointer(tmp_path, write_threads=0)
