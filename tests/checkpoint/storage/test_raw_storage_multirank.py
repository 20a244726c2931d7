"""The raw shard layout with DTensor shards on 2 gloo ranks: saved sharded one way, loaded
sharded another way (partial boxes of every chunk), and loaded whole in one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.checkpoint.helpers import raw_dtensor
from tests.distributed.spawn import start_ranks
from veoptim.checkpoint.storage.raw_format import RawChunk
from veoptim.checkpoint.storage.safe_dcp import SafeFileSystemReader, read_dcp_metadata

pytestmark = [pytest.mark.slow, pytest.mark.multirank]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict]:
    base = tmp_path_factory.mktemp("raw_dtensor")
    ckpt, out = base / "ckpt", base / "out"
    out.mkdir()
    args = (str(base / "init"), str(ckpt), str(out))
    start_ranks(raw_dtensor.worker, args, raw_dtensor.WORLD)
    ranks = {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(raw_dtensor.WORLD)}
    return ckpt, ranks


def test_shards_reload_bitwise_into_another_sharding(saved):
    _, ranks = saved
    for rank, equal in ranks.items():
        assert equal and all(equal.values()), f"rank {rank}: {equal}"


def test_every_rank_wrote_raw_chunks_of_its_own_shards(saved):
    ckpt, _ = saved
    metadata = read_dcp_metadata(ckpt)
    assert all(isinstance(chunk, RawChunk) for chunk in metadata.storage_data.values())
    files = {chunk.relative_path for chunk in metadata.storage_data.values()}
    assert {name.split("_")[2] for name in files} == {"0", "1"}  # __<rank>_<n>.raw
    assert len(metadata.state_dict_metadata["rows"].chunks) == 2


def test_shards_load_whole_in_one_process(saved):
    ckpt, _ = saved
    full = raw_dtensor.full_tensors()
    out = {key: torch.zeros_like(value) for key, value in full.items()}
    dcp.load(out, storage_reader=SafeFileSystemReader(ckpt), no_dist=True)
    for key, value in full.items():
        assert out[key].dtype == value.dtype and torch.equal(out[key], value), key
