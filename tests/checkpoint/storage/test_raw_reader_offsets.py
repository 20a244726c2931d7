"""Resharded reads of ``raw`` shards in one process: every box of every tensor, bitwise.

A load on another rank count asks for boxes of the saved chunks: a read item's
``storage_offsets`` say where inside a saved chunk the box starts, its ``dest_offsets``
where it goes in the destination. The multi-rank resharding test (``test_reshard.py``)
takes minutes; here DCP's own planning does the same in milliseconds: a save planner
writes each tensor as the chunks N ranks' shards would be (rows, or 2-D tiles), and a
load planner asks for the chunks of another layout (DCP's resharding algorithm,
``create_read_items_for_chunk_list``, computes the read items). Row boxes are read straight
into their destination from a byte offset inside a saved chunk; column and tile boxes go
through a buffer and a narrow. Tensors of several dtypes and shapes share the data files,
so every chunk but the first of a file starts at a nonzero byte offset.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from veoptim.checkpoint.storage.raw_format import RawChunk, byte_view
from veoptim.checkpoint.storage.raw_writer import RawFileSystemWriter
from veoptim.checkpoint.storage.safe_dcp import SafeFileSystemReader, read_dcp_metadata

SHAPES = {
    "w.f32": (torch.float32, (10, 6)),
    "w.bf16": (torch.bfloat16, (7, 5, 3)),
    "b.f16": (torch.float16, (9,)),
    "i.i64": (torch.int64, (5, 4)),
    "u.u8": (torch.uint8, (13, 3)),
    "d.f64": (torch.float64, (3, 7)),
    "big.f32": (torch.float32, (64, 300)),
}
#: Parts per dimension (missing trailing dims: 1): how a layout cuts every tensor.
SAVED = {"whole": (1,), "rows3": (3,), "tiles2x2": (2, 2)}
LOADED = {"whole": (1,), "rows2": (2,), "rows4": (4,), "cols3": (1, 3), "tiles3x2": (3, 2),
          "every_row": (64,)}  # fmt: skip

Box = tuple[tuple[int, ...], tuple[int, ...]]


def _sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bytes reinterpreted as ``dtype`` (every bit pattern, NaNs included)."""
    generator = torch.Generator().manual_seed(seed)
    count = torch.Size(shape).numel() * dtype.itemsize
    raw = torch.randint(0, 256, (count,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape)


def _bytes(tensor: torch.Tensor) -> bytes:
    return bytes(byte_view(tensor.contiguous()))


def _boxes(shape: tuple[int, ...], parts: tuple[int, ...]) -> list[Box]:
    """The non-empty boxes of ``shape`` cut into ``parts`` per dimension (shares differ by
    at most one, like ranks' shards)."""
    parts = (parts + (1,) * len(shape))[: len(shape)]
    ranges = [
        [(size * i // n, size * (i + 1) // n - size * i // n) for i in range(n)]
        for size, n in zip(shape, parts, strict=True)
    ]
    boxes = []
    for combo in itertools.product(*ranges):
        if all(length for _, length in combo):
            boxes.append((tuple(o for o, _ in combo), tuple(n for _, n in combo)))
    return boxes


def _fill(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A destination filled with 0xA5 bytes, so a byte the load did not write shows."""
    count = torch.Size(shape).numel() * dtype.itemsize
    return torch.full((count,), 0xA5, dtype=torch.uint8).view(dtype).reshape(shape)


def _narrow(tensor: torch.Tensor, box: Box) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(*box, strict=True)):
        tensor = tensor.narrow(dim, start, length)
    return tensor


class ChunkedSavePlanner(DefaultSavePlanner):
    """Writes each tensor as the boxes of a layout, as that many ranks' shards would be."""

    def __init__(self, parts: tuple[int, ...]) -> None:
        super().__init__()
        self.parts = parts

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, tensor in self.state_dict.items():
            for offsets, sizes in _boxes(tuple(tensor.shape), self.parts):
                chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
                data = TensorWriteData(chunk, TensorProperties.create_from_tensor(tensor),
                                       tensor.size())  # fmt: skip
                index = MetadataIndex(fqn, torch.Size(offsets))
                items.append(WriteItem(index, WriteItemType.SHARD, tensor_data=data))
        self.plan = SavePlan(items, planner_data=self.mappings)  # DCP's flattening
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        chunk = write_item.tensor_data.chunk
        return _narrow(self.state_dict[write_item.index.fqn], (chunk.offsets, chunk.sizes))


class BoxLoadPlanner(DefaultLoadPlanner):
    """Loads the boxes of another layout into their own destination tensors, with the read
    items DCP's resharding computes for them."""

    def __init__(self, dests: dict[str, list[tuple[Box, torch.Tensor]]]) -> None:
        super().__init__()
        self.dests = dests

    def create_local_plan(self) -> LoadPlan:
        items = []
        for fqn, boxes in self.dests.items():
            local = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for (o, s), _ in boxes]
            items += create_read_items_for_chunk_list(
                fqn, self.metadata.state_dict_metadata[fqn], local
            )
        self.plan = LoadPlan(items)
        return self.plan

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        box, dest = self.dests[index.fqn][index.index]
        assert tuple(index.offset) == box[0]
        return dest


def _state() -> dict[str, torch.Tensor]:
    return {
        name: _sample(dtype, shape, n) for n, (name, (dtype, shape)) in enumerate(SHAPES.items())
    }


@pytest.fixture(scope="module", params=list(SAVED))
def saved(request, tmp_path_factory) -> tuple[str, Path, dict[str, torch.Tensor]]:
    path = tmp_path_factory.mktemp(request.param)
    state = _state()
    dcp.save(state, storage_writer=RawFileSystemWriter(path, thread_count=2),
             planner=ChunkedSavePlanner(SAVED[request.param]), no_dist=True)  # fmt: skip
    return request.param, path, state


def test_the_saved_chunks_are_the_layout_and_lie_inside_shared_files(saved):
    name, path, state = saved
    metadata = read_dcp_metadata(path)
    for fqn, tensor in state.items():
        chunks = metadata.state_dict_metadata[fqn].chunks
        found = sorted((tuple(c.offsets), tuple(c.sizes)) for c in chunks)
        assert found == sorted(_boxes(tuple(tensor.shape), SAVED[name])), fqn
    raw = [chunk for chunk in metadata.storage_data.values() if isinstance(chunk, RawChunk)]
    assert len(raw) == len(metadata.storage_data)
    assert len({c.relative_path for c in raw}) == 2
    assert sum(c.offset > 0 for c in raw) >= len(raw) - 2  # all but each file's first


@pytest.mark.parametrize("layout", list(LOADED))
def test_every_box_of_another_layout_reads_bitwise(saved, layout):
    name, path, state = saved
    dests = {}
    for fqn, tensor in state.items():
        boxes = _boxes(tuple(tensor.shape), LOADED[layout])
        dests[fqn] = [(box, _fill(tensor.dtype, box[1])) for box in boxes]
    dcp.load({}, storage_reader=SafeFileSystemReader(path), planner=BoxLoadPlanner(dests),
             no_dist=True)  # fmt: skip
    wrong = [
        (fqn, box)
        for fqn, boxes in dests.items()
        for box, dest in boxes
        if _bytes(dest) != _bytes(_narrow(state[fqn], box))
    ]
    assert wrong == [], f"saved as {name}, loaded as {layout}: wrong boxes {wrong[:5]}"
