"""A model's content hash: one SHA-256 over every tensor's name, dtype, shape and bytes.

Adapters record the content hash of the base they were trained on, so a base retrained
under the same path (same config and shapes, other values) is told apart. The hash is the
same whether computed from tensors in memory (an export hashes what it writes, while the
bytes are there) or from a directory's safetensors files (a base loaded from
``model.path``): per tensor ``sha256(bytes)``, then one SHA-256 over the sorted lines
``name dtype shape digest``. It depends on the values and their stored dtype, not on how
the tensors are split into files. Tensors are hashed on a thread pool (``hashlib``
releases the GIL), so hashing runs at several GB/s.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from veoptim.errors import ConfigError

#: torch dtype -> the safetensors dtype name (what a file records).
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_THREADS = max(1, min(8, os.cpu_count() or 1))
_CACHE: dict[tuple, str] = {}


def _line(name: str, dtype: str, shape: Iterable[int], digest: str) -> bytes:
    return f"{name} {dtype} {list(shape)} {digest}\n".encode()


def _combine(lines: Iterable[tuple[str, bytes]]) -> str:
    total = hashlib.sha256()
    for _, line in sorted(lines):
        total.update(line)
    return total.hexdigest()


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def state_content_hash(tensors: Mapping[str, torch.Tensor]) -> str:
    """The content hash of ``tensors`` (CPU or device; not modified)."""

    def one(item: tuple[str, torch.Tensor]) -> tuple[str, bytes]:
        name, tensor = item
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise ConfigError(f"tensor {name!r} has dtype {tensor.dtype}, which has no hash name.")
        digest = hashlib.sha256(_tensor_bytes(tensor)).hexdigest()
        return name, _line(name, SAFETENSORS_DTYPES[tensor.dtype], tensor.shape, digest)

    with ThreadPoolExecutor(_THREADS) as pool:
        return _combine(pool.map(one, tensors.items()))


def _safetensors_files(directory: Path) -> list[Path]:
    index = sorted(directory.glob("*.safetensors.index.json"))
    if index:
        try:
            weight_map = json.loads(index[0].read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"{index[0]} is not a safetensors index: {exc}.") from exc
        return [directory / name for name in sorted(set(weight_map.values()))]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{directory} has no safetensors weights to hash.")
    return files


def _file_entries(path: Path) -> list[tuple[str, str, list[int], int, int]]:
    """(name, dtype, shape, start, end) of every tensor in a safetensors file (absolute
    byte offsets)."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    entries = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        start, end = meta["data_offsets"]
        entries.append((name, meta["dtype"], meta["shape"], 8 + length + start, 8 + length + end))
    return entries


def _hash_range(path: Path, start: int, end: int) -> str:
    digest = hashlib.sha256()
    with path.open("rb", buffering=0) as f:
        f.seek(start)
        left = end - start
        while left > 0:
            chunk = f.read(min(left, 16 << 20))
            if not chunk:
                raise ConfigError(f"{path} ends before its tensor data does (truncated).")
            digest.update(chunk)
            left -= len(chunk)
    return digest.hexdigest()


def files_content_hash(directory: str | Path) -> str:
    """The content hash of the tensors in ``directory``'s safetensors files, read from
    disk (remembered for this process while the files' sizes and times are unchanged)."""
    directory = Path(directory)
    files = _safetensors_files(directory)
    try:
        key = (str(directory.resolve()), *((f.name, f.stat().st_size, f.stat().st_mtime_ns)
                                           for f in files))  # fmt: skip
        tasks = [(f, *entry) for f in files for entry in _file_entries(f)]
    except (OSError, ValueError, KeyError, struct.error) as exc:
        raise ConfigError(f"cannot read the safetensors weights in {directory}: {exc}.") from exc
    if key in _CACHE:
        return _CACHE[key]

    def one(task: tuple) -> tuple[str, bytes]:
        path, name, dtype, shape, start, end = task
        return name, _line(name, dtype, shape, _hash_range(path, start, end))

    with ThreadPoolExecutor(_THREADS) as pool:
        content = _combine(pool.map(one, tasks))
    _CACHE[key] = content
    return content
