"""Interop with torch's own DCP tools: ``checkpoint.format=dcp`` checkpoints are read by
``dcp_to_torch_save`` directly; the default ``raw`` ones are not, and ``veoptim-export
--format dcp`` converts them into a checkpoint that torch reads and veoptim resumes from."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tasks.export import main as export_main
from tests.checkpoint.ckpt_state import (
    assert_bitwise_equal,
    build_trainer,
    load_with,
    save_with,
    snapshot,
)
from tests.checkpoint.helpers import ckpt_io
from veoptim.checkpoint import component as C
from veoptim.checkpoint import resolve
from veoptim.checkpoint.checkpointer import Checkpointer
from veoptim.checkpoint.layout import read_manifest


def _flat(tree: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        out.update(_flat(value, name + ".") if isinstance(value, dict) else {name: value})
    return out


def _shards(version) -> list[str]:
    return sorted(p.suffix for p in (version / C.DCP_DIR).iterdir() if p.name != ".metadata")


def test_the_config_key_selects_dcps_layout_which_torch_reads(tmp_path):
    trainer = build_trainer(tmp_path / "run", ["checkpoint.format=dcp"])
    trainer.train_step()
    published = trainer.save_checkpoint("s1")
    assert set(_shards(published.path)) == {".distcp"}
    dcp_to_torch_save(published.path / C.DCP_DIR, tmp_path / "plain.pt")
    plain = _flat(torch.load(tmp_path / "plain.pt", weights_only=True))
    saved = ckpt_io.read_checkpoint(published.path).tensors
    assert plain.keys() == saved.keys()
    assert_bitwise_equal(plain, saved)


def test_a_raw_checkpoint_converts_to_dcp_and_resumes_bitwise(tmp_path):
    writer = build_trainer(tmp_path / "w")
    writer.train_step()
    root = tmp_path / "ckpt"
    save_with(Checkpointer(root, fsync=False), writer, "s1")
    raw = resolve(root, "s1")
    assert set(_shards(raw)) == {".raw"}
    with pytest.raises(CheckpointException, match="RawChunk"):  # torch's reader cannot
        dcp_to_torch_save(raw / C.DCP_DIR, tmp_path / "fails.pt")

    out = tmp_path / "converted"
    assert export_main([str(root / "s1"), "--out", str(out), "--name", "s1_dcp", "--format", "dcp", "--no-fsync"]) == 0  # fmt: skip
    converted = resolve(out, "s1_dcp")
    assert set(_shards(converted)) == {".distcp"}
    assert read_manifest(converted).kind == "checkpoint"
    dcp_to_torch_save(converted / C.DCP_DIR, tmp_path / "plain.pt")
    plain = _flat(torch.load(tmp_path / "plain.pt", weights_only=True))
    assert_bitwise_equal(plain, ckpt_io.read_checkpoint(raw).tensors)

    reader = build_trainer(tmp_path / "r")
    load_with(Checkpointer(out, fsync=False), reader, "s1_dcp")
    after = snapshot(reader)
    expected = snapshot(writer)
    for part in ("params", "state", "groups", "scheduler", "sampler", "progress"):
        assert_bitwise_equal(expected[part], after[part], part)
