"""Read a published training checkpoint back into full tensors, compare two, tamper with one;
run a task straight and sliced (stopped and resumed) for the comparison.

Runs in the pytest process (no process group): DCP reads every shard of every rank
into full (unsharded) tensors, whatever world size wrote it. The comparison is
bitwise (``torch.equal`` and equal dtypes) on every tensor and exact on the JSON state.
"""

from __future__ import annotations

import json
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from veoptim.checkpoint import component as C
from veoptim.checkpoint.layout import KIND_CHECKPOINT
from veoptim.checkpoint.publish import Publisher
from veoptim.checkpoint.storage.safe_dcp import SafeFileSystemReader, read_dcp_metadata
from veoptim.checkpoint.versions import resolve_path
from veoptim.optim import MASTER_WEIGHT
from veoptim.state import CONFIG, RNG

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

#: metrics.jsonl fields that must be equal between a straight and a resumed run.
METRIC_FIELDS = ("step", "epoch", "loss", "lr", "grad_norm", "tokens_seen")
#: What an fp16 run's records add (its loss scaler's).
FP16_METRIC_FIELDS = ("loss_scale", "skipped_steps")
#: Components whose JSON legitimately differs between slices of one run (run dir, stop step).
NOT_COMPARED = (CONFIG,)


@dataclass
class Snapshot:
    """Everything a checkpoint version holds, as full tensors and parsed JSON."""

    path: Path
    tensors: dict[str, torch.Tensor]
    #: Shared JSON state by component name (``progress``, ``sampler``, ...).
    trainer_state: dict[str, Any]
    info: dict[str, Any]
    #: Per-rank RNG states by file name.
    rng: dict[str, Any]


def read_checkpoint(ref: Path) -> Snapshot:
    """Resolve ``ref`` (a name link or version dir) and read it completely."""
    version = resolve_path(Path(ref))
    metadata = read_dcp_metadata(version / C.DCP_DIR)
    tensors = {
        key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        for key, entry in metadata.state_dict_metadata.items()
    }
    dcp.load(tensors, storage_reader=SafeFileSystemReader(version / C.DCP_DIR), no_dist=True)
    rng_dir = C.rank_json_path(version, RNG, 0).parent
    rng = {p.name: json.loads(p.read_text()) for p in sorted(rng_dir.iterdir())}
    shared = {
        p.stem: json.loads(p.read_text()) for p in sorted((version / C.STATE_DIR).glob("*.json"))
    }
    return Snapshot(
        path=version,
        tensors=tensors,
        trainer_state=shared,
        info=json.loads((version / C.INFO_FILE).read_text()),
        rng=rng,
    )


def differences(a: Snapshot, b: Snapshot, *, rng: bool = True) -> list[str]:
    """Every key whose value differs between two checkpoints (empty = bitwise equal)."""
    out = [f"only in {a.path.name}: {k}" for k in sorted(set(a.tensors) - set(b.tensors))]
    out += [f"only in {b.path.name}: {k}" for k in sorted(set(b.tensors) - set(a.tensors))]
    for key in sorted(set(a.tensors) & set(b.tensors)):
        x, y = a.tensors[key], b.tensors[key]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
            out.append(key)
    for key in sorted(set(a.trainer_state) | set(b.trainer_state)):
        if key not in NOT_COMPARED and a.trainer_state.get(key) != b.trainer_state.get(key):
            out.append(f"trainer_state.{key}")
    if a.info.get(C.INFO_STEP) != b.info.get(C.INFO_STEP):
        out.append("checkpoint.json step")
    if rng and a.rng != b.rng:
        out.append("rng")
    return out


def master_keys(snapshot: Snapshot) -> list[str]:
    return [k for k in snapshot.tensors if k.endswith("." + MASTER_WEIGHT)]


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The metrics.jsonl records of a run dir, reduced to the fields that must match."""
    records = [
        json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    ]
    fields = METRIC_FIELDS + tuple(k for k in FP16_METRIC_FIELDS if records and k in records[0])
    return [{k: record[k] for k in fields} for record in records]


def write_bf16_rounded_masters(src: Path, root: Path, name: str) -> int:
    """Publish a copy of checkpoint ``src`` whose FP32 masters went through BF16.

    The dtype stays FP32, so validation accepts it: only the lost low bits differ.
    Returns how many master tensors the rounding changed (the control needs > 0).
    """
    snapshot = read_checkpoint(src)
    changed = 0
    tensors = {}
    for key, value in snapshot.tensors.items():
        if key.endswith("." + MASTER_WEIGHT):
            rounded = value.to(torch.bfloat16).to(value.dtype)
            changed += int(not torch.equal(rounded, value))
            value = rounded
        tensors[key] = value
    publisher = Publisher(root, fsync=False)
    with publisher.write(name, kind=KIND_CHECKPOINT, step=snapshot.info[C.INFO_STEP]) as out:
        shutil.copy2(snapshot.path / C.INFO_FILE, out / C.INFO_FILE)
        shutil.copytree(snapshot.path / C.STATE_DIR, out / C.STATE_DIR)
        dcp.save(tensors, storage_writer=FileSystemWriter(out / C.DCP_DIR), no_dist=True)
    return changed


def straight_and_sliced(root: Path, overrides: list[str], stop: int) -> tuple[Path, Path]:
    """Run ``python -m tasks.sft`` with ``overrides`` straight through, and again stopped
    at step ``stop`` and resumed (``checkpoint.resume=auto``); returns the two run dirs."""
    from tasks.compose import compose_config
    from tasks.runner import run_task

    straight, sliced = root / "straight", root / "sliced"
    run_task(compose_config("sft", [f"run.dir={straight}", *overrides]))
    run_task(compose_config("sft", [f"run.dir={sliced}", *overrides, f"train.stop_at_step={stop}"]))
    run_task(compose_config("sft", [f"run.dir={sliced}", *overrides, "checkpoint.resume=auto"]))
    return straight, sliced
