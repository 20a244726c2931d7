"""The ``raw`` byte layout of DCP shards: plain tensor bytes plus an index in DCP's metadata.

Each writer thread of each rank writes one file ``__<rank>_<n>.raw``: the tensors' bytes
back to back (each starting at a multiple of ``ALIGNMENT``), nothing else. Where every
chunk lies is a :class:`RawChunk` in the ``storage_data`` that DCP keeps in ``.metadata``
(file, byte offset, byte length, dtype, shape), so a load reads each tensor with one
``readinto`` into its destination's memory: no per-tensor pickle records, no
intermediate copies. DCP's planning, resharding and metadata are unchanged; only the
bytes move differently (see docs/checkpoints.md, "Shard format").

:func:`check_storage` validates an index against the metadata and the files on disk
(stat only) before any tensor is read.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from veoptim.errors import CheckpointError

RAW_SUFFIX = ".raw"
#: Byte alignment of every chunk inside a data file (cache-line; lets a reader view it in place).
ALIGNMENT = 64
#: Data file names a writer produces: ``__<rank>_<n>.raw``.
FILE_PATTERN = re.compile(r"__\d+_\d+\.raw")
#: Every dtype torch knows, by name (``torch.bfloat16`` -> ``"bfloat16"``).
DTYPES: dict[str, torch.dtype] = {
    str(value).removeprefix("torch."): value
    for value in vars(torch).values()
    if isinstance(value, torch.dtype)
}


@dataclass(frozen=True)
class RawChunk:
    """Where one saved tensor chunk's bytes are (the ``storage_data`` of its index)."""

    relative_path: str
    offset: int
    length: int
    dtype: str
    shape: tuple[int, ...]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, sharing its memory (writable)."""
    flat = tensor.detach().reshape(-1)
    if flat.data_ptr() != tensor.data_ptr() and tensor.numel():
        raise AssertionError("byte_view needs a contiguous tensor")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def contiguous_range(
    shape: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...]
) -> tuple[int, int] | None:
    """(first element, element count) of the box ``offsets``/``lengths`` inside a row-major
    array of ``shape`` if the box is one contiguous run, else None."""
    dims = len(shape)
    # Trailing dims taken whole can be merged; the first partial dim may be any range;
    # every dim before it must then have length 1.
    k = dims
    while k > 0 and offsets[k - 1] == 0 and lengths[k - 1] == shape[k - 1]:
        k -= 1
    if any(lengths[i] != 1 for i in range(k - 1)):
        return None
    strides = [math.prod(shape[i + 1 :]) for i in range(dims)]
    start = sum(o * s for o, s in zip(offsets, strides, strict=True))
    return start, math.prod(lengths)


def _check_chunk(chunk: Any, where: Path, key: Any) -> RawChunk:
    ok = (
        isinstance(chunk, RawChunk)
        and isinstance(chunk.relative_path, str)
        and FILE_PATTERN.fullmatch(chunk.relative_path) is not None
        and all(isinstance(v, int) and v >= 0 for v in (chunk.offset, chunk.length))
        and isinstance(chunk.dtype, str)
        and chunk.dtype in DTYPES
        and isinstance(chunk.shape, tuple)
        and all(isinstance(v, int) and v >= 0 for v in chunk.shape)
    )
    if not ok:
        raise CheckpointError(f"DCP metadata {where} has a malformed raw index entry for {key}.")
    return chunk


def check_storage(metadata: Metadata, dcp_dir: Path) -> None:
    """Raise unless every raw index entry matches its tensor's metadata and lies inside an
    existing data file; a no-op for DCP's own ``torch_save`` shards.

    Catches a missing, extra or truncated data file and a corrupted index before any read.
    """
    entries = metadata.storage_data or {}
    if not any(isinstance(v, RawChunk) for v in entries.values()):
        return
    where = Path(dcp_dir) / ".metadata"
    chunks: dict[tuple[str, tuple[int, ...]], Any] = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            for chunk in entry.chunks:
                chunks[(fqn, tuple(chunk.offsets))] = (entry.properties.dtype, chunk.sizes)
    ends: dict[str, int] = {}
    for index, raw in entries.items():
        raw = _check_chunk(raw, where, index.fqn)
        spec = chunks.pop((index.fqn, tuple(index.offset or ())), None)
        if spec is None or DTYPES[raw.dtype] != spec[0] or raw.shape != tuple(spec[1]):
            raise CheckpointError(
                f"DCP metadata {where}: the raw index entry of {index.fqn!r} does not match "
                "its tensor's dtype, shape or chunk (corrupted metadata)."
            )
        if raw.length != nbytes(raw.shape, DTYPES[raw.dtype]):
            raise CheckpointError(f"DCP metadata {where}: {index.fqn!r} has a wrong byte length.")
        ends[raw.relative_path] = max(ends.get(raw.relative_path, 0), raw.offset + raw.length)
    if chunks:
        missing = sorted({fqn for fqn, _ in chunks})
        raise CheckpointError(f"DCP metadata {where} has no raw index entry for {missing[:5]}.")
    extra = sorted(p.name for p in Path(dcp_dir).iterdir() if p.name not in {*ends, ".metadata"})
    if extra:
        raise CheckpointError(
            f"checkpoint {dcp_dir} holds files its raw index does not list: {extra[:5]}."
        )
    for name, end in sorted(ends.items()):
        try:
            size = os.stat(Path(dcp_dir) / name).st_size
        except FileNotFoundError as exc:
            raise CheckpointError(
                f"checkpoint data file {Path(dcp_dir) / name} is missing."
            ) from exc
        if size < end:
            raise CheckpointError(
                f"checkpoint data file {Path(dcp_dir) / name} is truncated: {size} bytes, its "
                f"index needs {end}."
            )
