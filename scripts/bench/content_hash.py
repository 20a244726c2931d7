"""What a base's content hash costs: hashing tensors while an export writes them, and hashing
a base's safetensors files when a LoRA run, a merged export or ``veoptim-generate`` checks
an adapter's base.

A model-like BF16 state (square and wide matrices) is written as safetensors shards; in
the same run, interleaved round by round, the bench times:

* ``write_s``: ``save_torch_state_dict`` of the state, fsynced (an HF export's weights);
* ``write_hashed_s``: the same through ``save_hashed``, the export's writer, which hashes
  the tensors while they are written;
* ``hash_memory_s``: ``state_content_hash`` alone, for its throughput;
* ``read_s``: a plain sequential read of the written files, warm page cache;
* ``hash_files_s``: ``files_content_hash`` of those files, warm page cache (what a check adds).

Prints one JSON line with the medians and the ratios ``write_hashed / write`` (the export's
overhead) and ``hash_files / read``.

    .venv/bin/python scripts/bench/content_hash.py [--size-mb 512] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from huggingface_hub import save_torch_state_dict

from veoptim import content_hash
from veoptim.content_hash import files_content_hash, state_content_hash
from veoptim.export.hf_format import save_hashed


def model_like_state(size_mb: int, hidden: int = 2048) -> dict[str, torch.Tensor]:
    """BF16 matrices of a transformer's shapes (attention squares, 4x-wide MLPs) adding up
    to about ``size_mb``."""
    g = torch.Generator().manual_seed(0)
    state, total, layer = {}, 0, 0
    while total < size_mb << 20:
        for name, shape in (("attn", (hidden, hidden)), ("up", (4 * hidden, hidden)),
                            ("down", (hidden, 4 * hidden))):  # fmt: skip
            tensor = torch.randn(shape, generator=g).bfloat16()
            state[f"layers.{layer}.{name}.weight"] = tensor
            total += tensor.numel() * tensor.element_size()
        layer += 1
    return state


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def write(state: dict[str, torch.Tensor], out: Path) -> None:
    save_torch_state_dict(state, out, max_shard_size=1 << 30)
    for file in out.glob("*.safetensors"):
        with file.open("rb") as f:
            os.fsync(f.fileno())


def write_hashed(state: dict[str, torch.Tensor], out: Path) -> None:
    save_hashed(state, out, 1 << 30, [])
    for file in out.glob("*.safetensors"):
        with file.open("rb") as f:
            os.fsync(f.fileno())


def read(out: Path) -> None:
    for file in sorted(out.glob("*.safetensors")):
        with file.open("rb", buffering=0) as f:
            while f.read(16 << 20):
                pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    state = model_like_state(args.size_mb)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    keys = ("write", "write_hashed", "hash_memory", "read", "hash_files")
    times: dict[str, list[float]] = {k: [] for k in keys}
    with tempfile.TemporaryDirectory(prefix="veoptim-hash-bench-") as tmp:
        for repeat in range(args.repeats):
            dirs = {
                write: Path(tmp) / f"plain{repeat}",
                write_hashed: Path(tmp) / f"hashed{repeat}",
            }
            for writer in (write, write_hashed) if repeat % 2 else (write_hashed, write):
                dirs[writer].mkdir()
                times[writer.__name__].append(timed(writer, state, dirs[writer]))
            out = dirs[write]
            times["hash_memory"].append(timed(state_content_hash, state))
            read(out)  # warm the page cache for both timed reads
            times["read"].append(timed(read, out))
            content_hash._CACHE.clear()  # a fresh process: nothing remembered
            times["hash_files"].append(timed(files_content_hash, out))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({
        "bench": "content_hash",
        "bytes": nbytes,
        "repeats": args.repeats,
        "threads": content_hash._THREADS,
        **{f"{k}_s": round(v, 4) for k, v in med.items()},
        "hash_memory_GBps": round(nbytes / med["hash_memory"] / 1e9, 2),
        "hash_files_GBps": round(nbytes / med["hash_files"] / 1e9, 2),
        "export_write_hashed_vs_write": round(med["write_hashed"] / med["write"], 3),
        "hash_memory_vs_write": round(med["hash_memory"] / med["write"], 3),
        "check_hash_files_vs_warm_read": round(med["hash_files"] / med["read"], 3),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
