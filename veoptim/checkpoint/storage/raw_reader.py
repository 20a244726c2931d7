"""Reading ``raw`` DCP shards (``raw_format.py``): each chunk straight into its destination.

DCP's ``FileSystemReader`` reads every tensor as a ``torch.save`` record: ``torch.load``
(an unpickler) into a fresh tensor, then a copy into the destination. Here a chunk whose
requested box is one contiguous byte range of the file and whose destination is a
contiguous CPU tensor is read into the destination's own memory; neighbouring chunks of
a file are read together by one scatter read (``preadv``: one large sequential read
filling many tensors), which is what keeps a cold read near the disk's speed. Only a
resharded box that is not contiguous (or a destination on an accelerator) goes through
a temporary CPU buffer and ``copy_``. Nothing is unpickled.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from veoptim.checkpoint.storage.prefault import prefault
from veoptim.checkpoint.storage.raw_format import (
    ALIGNMENT,
    DTYPES,
    RawChunk,
    byte_view,
    contiguous_range,
)
from veoptim.errors import CheckpointError

#: Concurrent sequential reads per rank (threads); a rank's files are split among them.
#: 2, 4 and 8 measured the same within the noise of the development VM (1 GB, 2 cores).
READ_STREAMS = 2
#: Largest scatter read (bytes, buffers): big enough to keep the disk busy, within IOV_MAX.
MAX_READ_BYTES = 16 << 20
MAX_READ_BUFFERS = 512
_HAS_PREADV = hasattr(os, "preadv")


@dataclass
class _Run:
    """Adjacent byte ranges of one file read by one scatter read."""

    start: int
    end: int = 0
    views: list[memoryview] = field(default_factory=list)
    done: list[tuple[ReadItem, torch.Tensor]] = field(default_factory=list)


def read_exactly(fd: int, views: list[memoryview], offset: int, path: Path) -> None:
    """Fill ``views`` in order from ``fd`` at ``offset``; a short file is a CheckpointError."""
    views = [v for v in views if len(v)]
    position, first = offset, 0
    while first < len(views):
        if _HAS_PREADV:
            n = os.preadv(fd, views[first:], position)
        else:  # one buffer at a time where the platform has no preadv
            os.lseek(fd, position, os.SEEK_SET)
            n = os.readv(fd, views[first : first + 1])
        if n <= 0:
            raise CheckpointError(
                f"checkpoint data file {path} is truncated: it ends at byte {position}, "
                "inside a tensor its index lists."
            )
        position += n
        while first < len(views) and n >= len(views[first]):
            n -= len(views[first])
            first += 1
        if n:
            views[first] = views[first][n:]


def _narrow(tensor: torch.Tensor, offsets: torch.Size, lengths: torch.Size) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths, strict=True)):
        if start != 0 or length != tensor.shape[dim]:
            tensor = tensor.narrow(dim, start, length)
    return tensor


def _target(path: Path, req: ReadItem, chunk: RawChunk, planner: LoadPlanner) -> torch.Tensor:
    target = planner.resolve_tensor(req).detach()
    if target.dtype != DTYPES[chunk.dtype] or tuple(target.shape) != tuple(req.lengths):
        raise CheckpointError(
            f"checkpoint data file {path}: {req.storage_index.fqn!r} is stored as "
            f"{chunk.dtype}{list(chunk.shape)}, the destination is {target.dtype}"
            f"{list(target.shape)}."
        )
    return target


Step = _Run | tuple[ReadItem, RawChunk, torch.Tensor]


def _plan(path: Path, reqs: list[tuple[ReadItem, RawChunk]], planner: LoadPlanner) -> list[Step]:
    """One file's requests in offset order: direct ones merged into scatter reads of
    adjacent ranges (``_Run``), the others read through a temporary buffer."""
    reqs.sort(key=lambda pair: pair[1].offset)
    steps: list[Step] = []
    run: _Run | None = None
    for req, chunk in reqs:
        target = _target(path, req, chunk, planner)
        itemsize = DTYPES[chunk.dtype].itemsize
        box = contiguous_range(chunk.shape, tuple(req.storage_offsets), tuple(req.lengths))
        if box is None or target.device.type != "cpu" or not target.is_contiguous():
            steps.append((req, chunk, target))
            run = None
            continue
        start = chunk.offset + box[0] * itemsize
        view = byte_view(target)
        gap = start - run.end if run is not None else -1
        if run is None or not 0 <= gap < ALIGNMENT or _full(run, len(view)):
            run, gap = _Run(start=start, end=start), 0
            steps.append(run)
        if gap:
            run.views.append(memoryview(bytearray(gap)))
        run.views.append(view)
        run.end = start + len(view)
        run.done.append((req, target))
    return steps


def _span(step: Step) -> tuple[int, int]:
    if isinstance(step, _Run):
        return step.start, step.end
    return step[1].offset, step[1].offset + step[1].length


def _split(steps: list[Step], parts: int) -> list[list[Step]]:
    """``steps`` cut into at most ``parts`` consecutive groups of about equal bytes."""
    total = sum(e - s for s, e in map(_span, steps))
    groups: list[list[Step]] = [[]]
    done = 0
    for step in steps:
        start, end = _span(step)
        if groups[-1] and len(groups) < parts and done >= total * len(groups) / parts:
            groups.append([])
        groups[-1].append(step)
        done += end - start
    return groups


def _execute(path: Path, steps: list[Step], planner: LoadPlanner) -> None:
    """Read ``steps`` (consecutive ranges of one file) in order. The disk is told to read
    the whole range ahead; the destinations' pages are populated (``prefault.py``) by a
    thread of their own that keeps ahead of the reads, the first run's before any read."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            first, last = _span(steps[0])[0], _span(steps[-1])[1]
            os.posix_fadvise(fd, first, last - first, os.POSIX_FADV_SEQUENTIAL)
            os.posix_fadvise(fd, first, last - first, os.POSIX_FADV_WILLNEED)
        targets = [[t for _, t in step.done] for step in steps if isinstance(step, _Run)]
        prefault(targets[0] if targets else [])
        if len(targets) < 2:  # nothing to populate ahead: no thread
            _read_steps(fd, path, steps, planner)
            return
        with ThreadPoolExecutor(1, thread_name_prefix="veoptim-prefault") as ahead:
            populating = ahead.submit(prefault, [t for ts in targets[1:] for t in ts])
            _read_steps(fd, path, steps, planner)
            populating.result()
    finally:
        os.close(fd)


def _read_steps(fd: int, path: Path, steps: list[Step], planner: LoadPlanner) -> None:
    for step in steps:
        if isinstance(step, _Run):
            read_exactly(fd, step.views, step.start, path)
            for req, target in step.done:
                planner.commit_tensor(req, target)
        else:
            _read_via_buffer(fd, path, *step, planner)


def _full(run: _Run, more: int) -> bool:
    return run.end - run.start + more > MAX_READ_BYTES or len(run.views) + 2 > MAX_READ_BUFFERS


def _read_via_buffer(
    fd: int, path: Path, req: ReadItem, chunk: RawChunk, target: torch.Tensor, planner: Any
) -> None:
    whole = torch.empty(chunk.shape, dtype=DTYPES[chunk.dtype])
    read_exactly(fd, [byte_view(whole)], chunk.offset, path)
    target.copy_(_narrow(whole, req.storage_offsets, req.lengths))
    planner.commit_tensor(req, target)


def read_raw_items(
    dcp_dir: Path, items: list[ReadItem], storage: dict[Any, Any], planner: LoadPlanner
) -> None:
    """Read every raw ``items`` entry into the planner's destination tensors."""
    per_file: dict[str, list[tuple[ReadItem, RawChunk]]] = {}
    for req in items:
        chunk = storage[req.storage_index]
        if req.type != LoadItemType.TENSOR or not chunk.dtype:
            raise CheckpointError(
                f"checkpoint {dcp_dir} stores {req.storage_index.fqn!r} as non-tensor data; "
                "veoptim never reads pickled entries."
            )
        per_file.setdefault(chunk.relative_path, []).append((req, chunk))
    plans = [(Path(dcp_dir) / name, _plan(Path(dcp_dir) / name, reqs, planner))
             for name, reqs in sorted(per_file.items())]  # fmt: skip
    parts = max(1, READ_STREAMS // max(1, len(plans)))
    jobs = [(path, group) for path, steps in plans if steps for group in _split(steps, parts)]
    if len(jobs) <= 1 or READ_STREAMS <= 1:
        for path, steps in jobs:
            _execute(path, steps, planner)
        return
    with ThreadPoolExecutor(min(READ_STREAMS, len(jobs)), thread_name_prefix="veoptim-raw") as pool:
        for future in [pool.submit(_execute, path, steps, planner) for path, steps in jobs]:
            future.result()
