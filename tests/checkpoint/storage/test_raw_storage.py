"""The raw shard layout (checkpoint.format=raw): DCP saves and loads through veoptim's
storage writer and reader, in one process (DTensor shards: ``test_raw_storage_multirank.py``).

Bitwise roundtrips of every dtype torch can store densely (BF16, FP8, complex, unsigned,
0-d and empty tensors, non-contiguous sources); data files that hold nothing but tensor
bytes at the offsets of the index; and a load that never unpickles anything but DCP's
``.metadata`` (through the allow-list).
"""

from __future__ import annotations

import pickle
import re
import threading
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from veoptim.checkpoint.storage.raw_format import DTYPES, RawChunk, byte_view, contiguous_range
from veoptim.checkpoint.storage.raw_writer import RawFileSystemWriter
from veoptim.checkpoint.storage.safe_dcp import SafeFileSystemReader, read_dcp_metadata
from veoptim.errors import CheckpointError

warnings.filterwarnings("ignore", message="ComplexHalf support is experimental")


def _storable(name: str) -> bool:
    """Dtypes DCP itself can save: dense, whole-byte elements (not quantized, not the
    sub-byte ``int1``-``int7``/``uint1``-``uint7``, not the untyped ``bits*``)."""
    if name.startswith(("bits", "q")) or re.fullmatch(r"u?int[1-7]", name):
        return False
    try:
        torch.empty(2, dtype=DTYPES[name]).view(torch.uint8)
    except (RuntimeError, TypeError):
        return False
    return True


STORABLE = sorted(name for name in DTYPES if _storable(name))


def _sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bytes reinterpreted as ``dtype`` (every bit pattern, NaNs included)."""
    generator = torch.Generator().manual_seed(seed)
    count = torch.Size(shape).numel() * dtype.itemsize
    raw = torch.randint(0, 256, (count,), dtype=torch.uint8, generator=generator)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def _bytes(tensor: torch.Tensor) -> bytes:
    return bytes(byte_view(tensor.contiguous()))


def _state() -> dict[str, torch.Tensor]:
    state = {f"t.{name}": _sample(DTYPES[name], (3, 5), n) for n, name in enumerate(STORABLE)}
    state["zero_d"] = torch.tensor(2.5, dtype=torch.bfloat16)
    state["empty"] = torch.empty(0, 7)
    state["transposed"] = _sample(torch.float32, (6, 4), 99).t()  # non-contiguous source
    state["big"] = _sample(torch.float32, (300, 1000), 7)  # above the gather threshold
    return state


def _save(state: dict, path: Path, threads: int = 2) -> None:
    dcp.save(state, storage_writer=RawFileSystemWriter(path, thread_count=threads), no_dist=True)


def _load(path: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {
        key: torch.empty_like(value, memory_format=torch.contiguous_format)
        for key, value in like.items()
    }
    for tensor in out.values():
        byte_view(tensor)[:] = bytes(tensor.numel() * tensor.itemsize)
    dcp.load(out, storage_reader=SafeFileSystemReader(path), no_dist=True)
    return out


def test_the_storable_dtypes_include_the_training_ones():
    assert {"bfloat16", "float16", "float32", "float64", "int64", "bool", "uint8"} <= set(STORABLE)
    assert {"float8_e4m3fn", "complex64", "uint16"} <= set(STORABLE)


@pytest.mark.parametrize("threads", [1, 3])
def test_every_dtype_roundtrips_bitwise(tmp_path, threads):
    state = _state()
    _save(state, tmp_path, threads)
    loaded = _load(tmp_path, state)
    for key, value in state.items():
        assert loaded[key].dtype == value.dtype and loaded[key].shape == value.shape, key
        assert _bytes(loaded[key]) == _bytes(value), key
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == [".metadata", *(f"__0_{n}.raw" for n in range(threads))]


def test_data_files_hold_only_tensor_bytes_at_their_indexed_offsets(tmp_path):
    """Each file equals the tensors' bytes placed at the index's offsets, zero padding
    between: no pickle, no record framing."""
    state = _state()
    _save(state, tmp_path)
    metadata = read_dcp_metadata(tmp_path)
    expected: dict[str, bytearray] = {}
    for index, chunk in metadata.storage_data.items():
        assert isinstance(chunk, RawChunk) and chunk.offset % 64 == 0
        data = _bytes(state[index.fqn])
        assert chunk.length == len(data) and chunk.dtype == str(state[index.fqn].dtype)[6:]
        image = expected.setdefault(chunk.relative_path, bytearray())
        image.extend(bytes(chunk.offset + chunk.length - len(image)))
        image[chunk.offset : chunk.offset + chunk.length] = data
    for name, image in expected.items():
        assert (tmp_path / name).read_bytes() == bytes(image), name


def test_a_load_never_unpickles_anything_but_the_metadata(tmp_path, monkeypatch):
    state = _state()
    _save(state, tmp_path)

    def refuse(*args, **kwargs):
        raise AssertionError("the raw reader must not unpickle tensor data")

    for owner, name in [(torch, "load"), (pickle, "load"), (pickle, "loads")]:
        monkeypatch.setattr(owner, name, refuse)
    monkeypatch.setattr(torch.serialization, "load", refuse)
    loaded = _load(tmp_path, state)
    assert _bytes(loaded["big"]) == _bytes(state["big"])


def test_metadata_written_before_the_storage_moved_still_loads(tmp_path, monkeypatch):
    """Earlier releases pickled ``RawChunk`` as ``veoptim.checkpoint.raw_format.RawChunk``:
    such a checkpoint still reads; another module path for the same class stays refused."""
    import sys

    from veoptim.checkpoint.storage import raw_format

    def save_as(module: str, path: Path) -> None:
        with monkeypatch.context() as patch:  # pickle records the class under ``module``
            patch.setitem(sys.modules, module, raw_format)
            patch.setattr(RawChunk, "__module__", module)
            _save(state, path)
        assert module.encode() in (path / ".metadata").read_bytes()

    state = _state()
    save_as("veoptim.checkpoint.raw_format", tmp_path / "old")
    loaded = _load(tmp_path / "old", state)
    assert _bytes(loaded["big"]) == _bytes(state["big"])
    save_as("veoptim.elsewhere.raw_format", tmp_path / "other")  # negative control
    with pytest.raises(CheckpointError, match="veoptim.elsewhere.raw_format.RawChunk"):
        read_dcp_metadata(tmp_path / "other")


def test_a_partial_box_is_read_from_its_byte_range(tmp_path):
    """Box arithmetic behind resharded reads: contiguous boxes map to one byte range."""
    assert contiguous_range((4, 6), (1, 0), (2, 6)) == (6, 12)
    assert contiguous_range((4, 6), (1, 2), (1, 3)) == (8, 3)
    assert contiguous_range((4, 6), (0, 2), (2, 3)) is None
    assert contiguous_range((), (), ()) == (0, 1)
    assert contiguous_range((2, 3, 4), (1, 0, 0), (1, 3, 4)) == (12, 12)


def test_a_malformed_index_entry_is_refused(tmp_path):
    _save({"w": torch.ones(4)}, tmp_path)
    metadata = read_dcp_metadata(tmp_path)
    (index,) = metadata.storage_data
    metadata.storage_data[index] = RawChunk("../../etc/passwd", 0, 16, "float32", (4,))
    (tmp_path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match="malformed raw index entry"):
        read_dcp_metadata(tmp_path)


def test_pages_are_populated_ahead_of_the_reads_by_their_own_thread(tmp_path, monkeypatch):
    """A file of many scatter reads: the first read's destinations are populated before it,
    the rest from the populating thread while the reads go on, and the load is bitwise."""
    from veoptim.checkpoint.storage import raw_reader
    from veoptim.checkpoint.storage.prefault import MIN_BYTES

    calls: list[tuple[str, int]] = []
    real = raw_reader.prefault

    def spy(tensors) -> None:
        tensors = list(tensors)
        calls.append((threading.current_thread().name, len(tensors)))
        real(tensors)

    monkeypatch.setattr(raw_reader, "prefault", spy)
    monkeypatch.setattr(raw_reader, "READ_STREAMS", 1)
    rows = raw_reader.MAX_READ_BYTES // 4 // 1000 + 1  # each tensor is a scatter read alone
    state = {f"w{k}": _sample(torch.float32, (rows, 1000), k) for k in range(4)}
    assert all(v.numel() * 4 >= MIN_BYTES for v in state.values())
    _save(state, tmp_path, threads=1)
    loaded = _load(tmp_path, state)
    assert all(_bytes(loaded[k]) == _bytes(v) for k, v in state.items())
    first, ahead = calls
    assert first == (threading.current_thread().name, 1)
    assert ahead[0].startswith("veoptim-prefault") and ahead[1] == 3
