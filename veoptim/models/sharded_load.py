"""Load ``model.path`` straight into each rank's shards.

Without this, rank 0 of a distributed run builds the whole model from ``model.path`` and
broadcasts every shard: a model that does not fit one host or device cannot start. Here
every rank builds the model's structure with its parameters on the meta device (buffers
such as rotary tables are computed as usual: they are small and not in the weight files),
the parallel plan shards it, and each rank then reads only the slices of the safetensors
files that its shards hold (its rows of dense tensors, its experts), converted to the
model's dtype as ``from_pretrained`` would, straight into its local shards. Peak memory per
rank is its shards plus one slice.

It applies when every parameter of the model is stored under its own name in the
safetensors files (tied weights once), or, for fused MoE experts, as the per-expert
``gate_proj`` / ``up_proj`` / ``down_proj`` weights that transformers' ``save_pretrained``
writes. Files with other layouts are loaded by rank 0 as before.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from veoptim.errors import ConfigError

SINGLE_FILE = "model.safetensors"
#: Fused expert parameter -> the per-expert Linear weights it stacks, in row order.
FUSED_FROM_PER_EXPERT = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
INDEX_FILE = "model.safetensors.index.json"


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Construct modules with their parameters on the meta device and everything else as
    usual, so buffers computed at construction (rotary tables) keep their values."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            meta = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            module._parameters[name] = meta

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


#: safetensors dtype names -> torch dtypes.
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


class SafetensorsFile:
    """One safetensors file, read with ``readinto`` row range by row range (no mmap: the
    mapped pages of the whole file would count against every rank's memory)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        self.data_start = 8 + size
        self.entries: dict[str, dict[str, Any]] = header

    def shape(self, key: str) -> list[int]:
        return list(self.entries[key]["shape"])

    def read(self, handle: BinaryIO, key: str, index: tuple[slice, ...]) -> torch.Tensor:
        """``tensor[index]`` of ``key``: reads only the rows of ``index[0]``."""
        entry = self.entries[key]
        dtype = DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ConfigError(
                f"model.path {self.path}: tensor {key} has dtype {entry['dtype']}, which "
                f"sharded loading does not read (expected one of {sorted(DTYPES)})."
            )
        shape = entry["shape"]
        rows = index[0] if shape else slice(0, 1)
        row_items = math.prod(shape[1:]) if shape else 1
        item = torch.empty((), dtype=dtype).element_size()
        out = torch.empty((rows.stop - rows.start, *shape[1:]), dtype=dtype)
        handle.seek(self.data_start + entry["data_offsets"][0] + rows.start * row_items * item)
        view = memoryview(out.view(torch.uint8).numpy()).cast("B") if out.numel() else None
        if view is not None and handle.readinto(view) != len(view):
            raise ConfigError(f"model.path {self.path}: tensor {key} is truncated.")
        if not shape:
            return out.reshape(())
        return out[(slice(None), *index[1:])]


class SafetensorsShards:
    """The safetensors files of a model directory, read slice by slice."""

    def __init__(self, path: Path, files: dict[str, Path]) -> None:
        self.path, self.files = path, files
        self._headers: dict[Path, SafetensorsFile] = {}

    def header(self, key: str) -> SafetensorsFile:
        file = self.files[key]
        if file not in self._headers:
            self._headers[file] = SafetensorsFile(file)
        return self._headers[file]

    @classmethod
    def open(cls, path: str | Path) -> SafetensorsShards | None:
        """The weights of ``path``, or None when it holds no safetensors files."""
        path = Path(path)
        index = path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as error:
                raise ConfigError(
                    f"model.path {path}: {INDEX_FILE} is not a safetensors index with a "
                    f"'weight_map' ({error})."
                ) from error
            return cls(path, {key: path / name for key, name in weight_map.items()})
        single = path / SINGLE_FILE
        if single.is_file():
            return cls(path, dict.fromkeys(SafetensorsFile(single).entries, single))
        return None

    def read_rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of the tensor stored under ``key``, in its stored dtype."""
        file = self.header(key)
        index = (slice(start, stop), *(slice(0, n) for n in file.shape(key)[1:]))
        with open(self.files[key], "rb") as handle:
            return file.read(handle, key, index)

    def missing(self, model: nn.Module) -> list[str]:
        """Keys of ``model``'s state dict the files cannot fill: stored under no name (a
        tied weight is stored once, under either of its names) and not per expert."""
        stored_ids = {id(t) for name, t in _named_state(model) if self._readable(name)}
        return [name for name, t in _named_state(model) if id(t) not in stored_ids]

    def _readable(self, name: str) -> bool:
        return name in self.files or _per_expert_keys(name, 0, self.files) is not None

    @torch.no_grad()
    def load_into(self, model: nn.Module) -> None:
        """Fill every local shard of ``model`` (sharded, then ``to_empty``) from the files."""
        with ExitStack() as stack:
            handles: dict[Path, BinaryIO] = {}

            def read(key: str, index: tuple[slice, ...]) -> torch.Tensor:
                file = self.files[key]
                if file not in handles:
                    handles[file] = stack.enter_context(open(file, "rb"))  # noqa: SIM115
                return self.header(key).read(handles[file], key, index)

            for name, tensor in _named_state(model):
                if not self._readable(name):
                    continue  # tied: filled through the name it is stored under
                local, index = local_view(tensor)
                if not local.numel():
                    continue
                if name in self.files:
                    local.copy_(read(name, index))
                else:
                    _read_fused_experts(name, local, index, self, read)


def _per_expert_keys(name: str, expert: int, files: Mapping[str, Path]) -> list[str] | None:
    """The per-expert keys (``experts.<e>.gate_proj.weight`` ...) that the fused expert
    parameter ``name`` is stored as, or None. transformers 5 fuses them at load and splits
    them again in ``save_pretrained``."""
    for fused, parts in FUSED_FROM_PER_EXPERT.items():
        if name.endswith(f".experts.{fused}"):
            prefix = name[: -len(fused)]
            keys = [f"{prefix}{expert}.{part}.weight" for part in parts]
            return keys if all(k in files for k in keys) else None
    return None


def _read_fused_experts(
    name: str,
    local: torch.Tensor,
    index: tuple[slice, ...],
    shards: SafetensorsShards,
    read: Callable[[str, tuple[slice, ...]], torch.Tensor],
) -> None:
    """Fill ``local`` (the ``index`` region of a fused ``[experts, rows, cols]`` parameter)
    from the per-expert weights, which stack along the rows (gate rows, then up rows)."""
    experts, rows, cols = index
    for i, expert in enumerate(range(experts.start, experts.stop)):
        keys = _per_expert_keys(name, expert, shards.files)
        assert keys is not None
        start = 0
        for key in keys:
            height = shards.header(key).shape(key)[0]
            lo, hi = max(rows.start, start), min(rows.stop, start + height)
            if lo < hi:
                part = read(key, (slice(lo - start, hi - start), cols))
                local[i, lo - rows.start : hi - rows.start].copy_(part)
            start += height


def local_view(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """This rank's part of ``tensor`` and where it sits in the whole tensor."""
    if not isinstance(tensor, DTensor):
        return tensor, tuple(slice(0, n) for n in tensor.shape)
    shape, offset = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    return tensor.to_local(), tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def _named_state(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters and persistent buffers under their state-dict names (tied ones once each)."""
    return list(model.state_dict(keep_vars=True).items())
