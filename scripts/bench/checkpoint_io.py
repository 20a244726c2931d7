"""Checkpoint I/O: save/load GB/s vs raw sequential I/O, publication overhead, resume RSS.

One run, one directory (default: a fresh temporary directory under ``--dir`` or the
system temp dir; the JSON says whether it is on the repo's disk). The benchmark
starts two subprocesses from the same config (``--size-mb`` of checkpoint: a
bigger dense Qwen2, ``model.dtype=bf16``, ``optim=full_fp32_adamw`` — BF16
parameters plus FP32 masters and moments):

- ``train``: builds the Trainer through the normal config path, runs ``--steps``
  real steps (peak RSS of training), then ``--repeats`` times: a raw sequential
  write of the checkpoint's byte count (one file, fsync) and ``Checkpointer.save``
  with ``fsync=True``, interleaved. The checkpointer's phase hooks time each part:
  ``write`` (state dicts, DCP shards fsynced by DCP, JSON side files) and
  ``publish`` (fsync pass, manifest, directory fsyncs, link replace, retention);
  ``publication_overhead`` = publish / whole save.
- ``resume``: builds the same Trainer and resumes with ``Checkpointer.load`` (peak
  RSS of resume, taken right after this first load), then more loads interleaved
  with raw sequential reads of the same byte count. Before every read the files are
  evicted from the page cache with ``posix_fadvise(POSIX_FADV_DONTNEED)`` (only this
  benchmark's files; the global ``drop_caches`` is not touched on a shared machine).

GB/s figures are best-of-repeats (1 GB = 1e9 bytes); the first load into the fresh
process is reported apart, against a raw read made just before it in the same process
(this VM's disk reads at one of two speeds, ~0.8 or ~2.3 GB/s, from one read to the
next); ``--fresh-loads N`` starts N resume processes per format and reports the median of
their first loads' ratios and each one. Each resume process starts with none of the
benchmark's files cached, and the raw file's pages are dropped again after each raw read,
so that a load does not first have to reclaim gigabytes of another file's cache (the MB
the kernel reclaimed during each first load are in the JSON). ``repeat_load_rss_ratio``
is the resume process's peak after the later loads, which go into a trainer that already
holds the state and so stage a second full copy of it (a load that fails while reading
leaves the live state as it was). Prints one JSON line. Targets: ``resume_rss_ratio <= 1.05``;
save/load vs raw I/O and publication overhead are reported, with no bar to meet.
On a CPU shared with other jobs, ``--threads 1`` avoids OpenMP stalls in copies.

    .venv/bin/python scripts/bench/checkpoint_io.py [--size-mb 100] [--repeats 5] [--threads N] [--write-threads 2]
        [--fresh-loads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

REPO = Path(__file__).resolve().parents[2]
CHECKPOINT_PREFIX = "bench_"
RAW_FILE = "raw_sequential.bin"
RAW_CHUNK = 8 << 20  # bytes per write()/readinto() of the raw baseline
HEAD_DIM = 64
LAYERS = 4
VOCAB_ESTIMATE = 512  # the bundled tokenizer; sizing only, the JSON reports measured bytes
BYTES_PER_PARAM = 14  # BF16 parameter + FP32 master, exp_avg, exp_avg_sq
FIXED_OVERRIDES = (
    "run.device=cpu",
    "logging.progress=false",
    "optim=full_fp32_adamw",
    "model.dtype=bf16",
    "train.max_steps=1000",
    f"model.num_hidden_layers={LAYERS}",
)
TARGET_RESUME_RSS_RATIO = 1.05


# --------------------------------------------------------------------- sizing
def _params(hidden: int, inter: int, vocab: int = VOCAB_ESTIMATE) -> int:
    heads = hidden // HEAD_DIM
    kv = heads // 2
    attn = 2 * hidden * hidden + hidden + 2 * (hidden * kv * HEAD_DIM + kv * HEAD_DIM)
    return LAYERS * (attn + 3 * hidden * inter + 2 * hidden) + 2 * vocab * hidden + hidden


def model_overrides(size_mb: float) -> list[str]:
    """The widest model (hidden a multiple of 128, MLP >= 2x hidden) of ~``size_mb`` state."""
    target = size_mb * 1e6 / BYTES_PER_PARAM
    best = (128, 256)
    for hidden in range(128, 8192, 128):
        inter = int((target - _params(hidden, 0)) / (3 * LAYERS * hidden)) // 64 * 64
        if inter < 2 * hidden:
            break
        best = (hidden, inter)
    hidden, inter = best
    heads = hidden // HEAD_DIM
    return [
        f"model.hidden_size={hidden}",
        f"model.intermediate_size={inter}",
        f"model.num_attention_heads={heads}",
        f"model.num_key_value_heads={heads // 2}",
    ]


# ----------------------------------------------------------------- utilities
def peak_rss_mb() -> float:
    """Peak resident set of this process (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def reclaimed_mb() -> float:
    """Page-cache and anonymous pages the kernel has reclaimed so far (``/proc/vmstat``), MB:
    a load that must first free memory for its staging shows up here."""
    try:
        lines = Path("/proc/vmstat").read_text().split("\n")
    except OSError:
        return 0.0
    stolen = sum(int(line.split()[1]) for line in lines if line.startswith("pgsteal_"))
    return stolen * os.sysconf("SC_PAGE_SIZE") / 2**20


def cached_mb() -> float:
    """The page cache's size (``Cached`` of ``/proc/meminfo``), MB."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("Cached:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def evict(path: Path) -> None:
    """Drop clean page-cache pages of every file under ``path`` (written and fsynced)."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_write(path: Path, nbytes: int) -> float:
    """Seconds to write ``nbytes`` sequentially into a new file and fsync it.

    The file is not deleted during the timed part of a run: on a filesystem mounted with
    ``discard`` (the development VM), freeing blocks makes the *next* commit wait, which
    would land on whichever save comes next.
    """
    chunk = os.urandom(RAW_CHUNK)  # incompressible, generated outside the timing
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left > 0:
            left -= f.write(memoryview(chunk)[: min(left, RAW_CHUNK)])
        os.fsync(f.fileno())
    return time.perf_counter() - start


def raw_read(path: Path) -> tuple[float, int]:
    """Seconds and bytes of one sequential read of ``path`` into a reused buffer."""
    buffer = bytearray(RAW_CHUNK)
    total = 0
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            total += n
    return time.perf_counter() - start, total


def checkpoint_name(fmt: str, repeat: int) -> str:
    return f"{CHECKPOINT_PREFIX}{fmt}_{repeat}"


def build_trainer(overrides: list[str], run_dir: Path, threads: int = 0):
    import torch

    from tasks.compose import compose_config
    from veoptim.config import to_config
    from veoptim.distributed import init_distributed
    from veoptim.trainer import Trainer

    if threads:
        torch.set_num_threads(threads)
    cfg = to_config(compose_config("sft", [*overrides, f"run.dir={run_dir}"]))
    return Trainer.from_config(cfg, init_distributed("cpu", "auto", {}))


def version_bytes(version_dir: Path) -> int:
    return sum(p.stat().st_size for p in version_dir.rglob("*") if p.is_file())


# ------------------------------------------------------------------ train role
class PhaseClock:
    """Publisher/Checkpointer fault hook used as a stopwatch: phase name -> perf_counter."""

    def __init__(self) -> None:
        self.marks: dict[str, float] = {}

    def __call__(self, phase: str) -> None:
        self.marks[phase] = time.perf_counter()


def save_breakdown(clock: PhaseClock, start: float, end: float) -> dict[str, float]:
    """Seconds per save part; ``publish`` is everything after the data and side files."""
    m = clock.marks
    return {
        "total_s": end - start,
        "prepare_s": m["prepared"] - start,
        "write_s": m["write"] - m["prepared"],  # state dicts, DCP shards (fsynced), side files
        "publish_s": end - m["write"],
        "publish_file_fsync_s": m["before_manifest"] - m["written"],
        "publish_manifest_s": m["after_manifest"] - m["before_manifest"],
        "publish_link_s": m["after_replace"] - m["after_manifest"],
        "publish_tail_s": end - m["after_replace"],  # root fsync, retention
    }


def load_breakdown(clock: PhaseClock, start: float, end: float) -> dict[str, float]:
    """Seconds per load phase: resolve + validate, DCP read into staging, apply to live state."""
    m = clock.marks
    return {
        "total_s": end - start,
        "validate_s": m["validate"] - start,
        "read_s": m["read"] - m["validate"],
        "apply_s": end - m["apply"],
    }


def role_train(args: argparse.Namespace, overrides: list[str]) -> dict[str, Any]:
    from veoptim.checkpoint.checkpointer import Checkpointer

    work = Path(args.workdir)
    trainer = build_trainer(overrides, work / "run", args.threads)
    built_rss = current_rss_mb()
    trainer.model.train()
    for _ in range(args.steps):
        trainer.train_step()
    train_peak = peak_rss_mb()
    params = sum(p.numel() for p in trainer.model.parameters())
    clock = PhaseClock()
    checkpointers = {
        fmt: Checkpointer(
            work / "checkpoints",
            fsync=True,
            write_threads=args.write_threads,
            storage_format=fmt,
            fault_hook=clock,
        )  # fmt: skip
        for fmt in args.formats
    }
    saves: dict[str, list] = {fmt: [] for fmt in args.formats}
    nbytes: dict[str, int] = {}
    raws: list[float] = []
    for r in range(args.repeats):  # interleaved: raw write, then one save of each format
        if nbytes:
            raws.append(raw_write(work / f"{RAW_FILE}.{r}", max(nbytes.values())))
        for fmt in args.formats:
            trainer.checkpointer = checkpointers[fmt]
            clock.marks.clear()
            start = time.perf_counter()
            published = trainer.save_checkpoint(checkpoint_name(fmt, r))
            saves[fmt].append(save_breakdown(clock, start, time.perf_counter()))
            nbytes[fmt] = version_bytes(published.path)
    raws.append(raw_write(work / RAW_FILE, max(nbytes.values())))  # what resume reads
    return {
        "params": params,
        "checkpoint_bytes": nbytes,
        "built_rss_mb": built_rss,
        "train_peak_rss_mb": train_peak,
        "train_peak_rss_with_saves_mb": peak_rss_mb(),
        "saves": saves,
        "raw_write_s": raws,
    }


# ----------------------------------------------------------------- resume role
def role_resume(args: argparse.Namespace, overrides: list[str]) -> dict[str, Any]:
    from veoptim.checkpoint.checkpointer import Checkpointer

    work = Path(args.workdir)
    name = checkpoint_name(args.formats[0], args.repeats - 1)
    trainer = build_trainer(overrides, work / "run", args.threads)
    built_rss = current_rss_mb()
    clock = PhaseClock()
    trainer.checkpointer = Checkpointer(
        work / "checkpoints", fsync=True, storage_format=args.formats[0], fault_hook=clock
    )
    version = (work / "checkpoints" / name).resolve()

    def timed_load() -> dict[str, float]:
        evict(version)
        clock.marks.clear()
        cached, reclaimed = cached_mb(), reclaimed_mb()
        start = time.perf_counter()
        trainer.load_checkpoint(name)
        parts = load_breakdown(clock, start, time.perf_counter())
        return {**parts, "page_cache_before_mb": cached, "reclaimed_mb": reclaimed_mb() - reclaimed}

    def timed_raw_read() -> tuple[float, int]:
        evict(work / RAW_FILE)
        seconds, nbytes = raw_read(work / RAW_FILE)
        evict(work / RAW_FILE)  # the load next to it starts with as much free memory
        return seconds, nbytes

    # the resume: first load into a fresh process, right after a raw read of its own (the
    # disk's speed drifts within minutes: each first load is compared with its neighbour)
    first_raw_s, read_bytes = timed_raw_read()
    loads = [timed_load()]
    resume_peak = peak_rss_mb()
    after_load_rss = current_rss_mb()
    step = trainer.progress.global_step
    raws = []
    for _ in range(args.repeats if args.later_loads is None else args.later_loads):
        seconds, read_bytes = timed_raw_read()
        raws.append(seconds)
        loads.append(timed_load())
    warm_raw, _ = raw_read(work / RAW_FILE)  # the file is now cached: shows what eviction buys
    return {
        "resumed_step": step,
        "built_rss_mb": built_rss,
        "resume_peak_rss_mb": resume_peak,
        "after_load_rss_mb": after_load_rss,
        "peak_rss_after_repeat_loads_mb": peak_rss_mb(),
        "loads": loads,
        "first_raw_read_s": first_raw_s,
        "raw_read_s": raws,
        "raw_read_bytes": read_bytes,
        "raw_read_warm_s": warm_raw,
    }


# --------------------------------------------------------------- orchestrator
def run_role(
    role: str,
    args: argparse.Namespace,
    workdir: Path,
    formats: list[str],
    later_loads: int | None = None,
) -> dict[str, Any]:
    """Run one role in a fresh interpreter (its own ru_maxrss); returns its JSON line."""
    later = args.repeats if later_loads is None else later_loads
    cmd = [sys.executable, __file__, "--role", role, "--workdir", str(workdir),
           "--size-mb", str(args.size_mb), "--repeats", str(args.repeats),
           "--later-loads", str(later),
           "--steps", str(args.steps), "--threads", str(args.threads),
           "--write-threads", str(args.write_threads), "--formats", ",".join(formats)]  # fmt: skip
    # the checkout first, then the caller's path (packages installed with --target)
    path = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(path)}
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{role} subprocess failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def resume(args: argparse.Namespace, workdir: Path, fmt: str, later_loads: int | None) -> dict:
    """One resume process, started with none of the benchmark's files in the page cache (as
    a resume on another node or after a reboot): the saves and raw writes before it leave
    gigabytes of clean cache that its loads would otherwise have to reclaim first."""
    evict(workdir)
    return run_role("resume", args, workdir, [fmt], later_loads=later_loads)


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


def _median_parts(parts: list[dict[str, float]]) -> dict[str, float]:
    return {key: round(median(p[key] for p in parts), 4) for key in parts[0]}


def summarize_format(fmt: str, train: dict, resumes: list[dict], raw_write_s: float) -> dict:
    """One format's figures: medians of the interleaved repeats (best save/load beside).

    ``resumes`` are fresh processes: the first one's later loads give the load figures, and
    every one gives a first load, each compared with the raw read made just before it."""
    nbytes = train["checkpoint_bytes"][fmt]
    saves = train["saves"][fmt]
    resume = resumes[0]
    first_load, *loads = resume["loads"]
    save_s = median(s["total_s"] for s in saves)
    load_s = median(s["total_s"] for s in loads)
    raw_read_s = median(resume["raw_read_s"])
    raw_bytes = resume["raw_read_bytes"]
    first_s = [r["loads"][0]["total_s"] for r in resumes]
    first_ratios = [
        round(nbytes / s / (raw_bytes / r["first_raw_read_s"]), 3)
        for s, r in zip(first_s, resumes, strict=True)
    ]
    train_growth = train["train_peak_rss_mb"] - train["built_rss_mb"]
    resume_growth = max(r["resume_peak_rss_mb"] - r["built_rss_mb"] for r in resumes)
    resume_peak = max(r["resume_peak_rss_mb"] for r in resumes)
    return {
        "checkpoint_bytes": nbytes,
        "save_GBps": gbps(nbytes, save_s),
        "save_best_GBps": gbps(nbytes, min(s["total_s"] for s in saves)),
        "save_vs_raw_write": round(raw_write_s / save_s, 3),
        "load_GBps": gbps(nbytes, load_s),
        "load_best_GBps": gbps(nbytes, min(s["total_s"] for s in loads)),
        "raw_read_GBps": gbps(raw_bytes, raw_read_s),
        "raw_read_warm_cache_GBps": gbps(raw_bytes, resume["raw_read_warm_s"]),
        "load_vs_raw_read": round(nbytes / load_s / (raw_bytes / raw_read_s), 3),
        "fresh_processes": len(resumes),
        "first_load_in_fresh_process_GBps": gbps(nbytes, median(first_s)),
        "first_load_vs_raw_read": round(median(first_ratios), 3),
        "first_load_vs_raw_read_each": first_ratios,
        "first_load_raw_read_GBps_each": [gbps(raw_bytes, r["first_raw_read_s"]) for r in resumes],
        # memory the kernel reclaimed during each first load, and the page cache before it
        "first_load_reclaimed_mb_each": [round(r["loads"][0]["reclaimed_mb"]) for r in resumes],
        "first_load_page_cache_before_mb_each": [
            round(r["loads"][0]["page_cache_before_mb"]) for r in resumes
        ],
        "save_s_each": [round(s["total_s"], 4) for s in saves],
        "load_s_each": [round(s["total_s"], 4) for s in loads],
        "raw_read_s_each": [round(x, 4) for x in resume["raw_read_s"]],
        "save_breakdown_median_s": _median_parts(saves),
        "load_breakdown_median_s": _median_parts(loads),
        "first_load_breakdown_s": {k: round(v, 4) for k, v in first_load.items()},
        "publication_overhead_median": round(median(s["publish_s"] for s in saves) / save_s, 4),
        "resumed_step": resume["resumed_step"],
        "resume_peak_rss_mb": round(resume_peak, 1),
        "resume_rss_ratio": round(resume_peak / train["train_peak_rss_mb"], 3),
        # the later loads go into a trainer that already holds the state: they stage a full
        # second copy (a failed read must leave the live state as it was), so ~2x
        "repeat_load_peak_rss_mb": round(resume["peak_rss_after_repeat_loads_mb"], 1),
        "repeat_load_rss_ratio": round(
            resume["peak_rss_after_repeat_loads_mb"] / train["train_peak_rss_mb"], 3
        ),
        "rss_growth_over_build_ratio": round(resume_growth / train_growth, 3),
    }


def summarize(
    args: argparse.Namespace, workdir: Path, train: dict, resumes: dict, load_start: float
) -> dict:
    raw_write_s = median(train["raw_write_s"])
    nbytes = max(train["checkpoint_bytes"].values())
    return {
        "bench": "checkpoint_io",
        "dir": str(workdir),
        "same_device_as_repo": os.stat(workdir).st_dev == os.stat(REPO).st_dev,
        "model_overrides": model_overrides(args.size_mb),
        "optimizer": "full_fp32_adamw (bf16 params, fp32 master + moments)",
        "params": train["params"],
        "repeats": args.repeats,
        "write_threads": args.write_threads,
        "statistic": "median of interleaved repeats (raw I/O and each format in turn)",
        "raw_write_fsync_GBps": gbps(nbytes, raw_write_s),
        "raw_write_s_each": [round(x, 4) for x in train["raw_write_s"]],
        "caches_dropped": False,
        "page_cache": "per-file posix_fadvise(DONTNEED) before every timed read (no global drop)",
        "formats": {
            fmt: summarize_format(fmt, train, resumes[fmt], raw_write_s) for fmt in args.formats
        },
        "train_peak_rss_mb": round(train["train_peak_rss_mb"], 1),
        "train_peak_rss_with_saves_mb": round(train["train_peak_rss_with_saves_mb"], 1),
        "target_resume_rss_ratio": f"<= {TARGET_RESUME_RSS_RATIO}",
        "loadavg_1min_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        "cpus": os.cpu_count(),
        "torch_threads": args.threads or "default",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=100.0, help="checkpoint size to aim at")
    parser.add_argument("--repeats", type=int, default=5, help="timed saves / loads (best kept)")
    parser.add_argument("--steps", type=int, default=1, help="training steps before saving")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    parser.add_argument(
        "--write-threads", type=int, default=2, help="DCP writer threads (checkpoint.write_threads)"
    )
    parser.add_argument(
        "--formats", default="raw,dcp", help="checkpoint.format values, saved interleaved"
    )
    parser.add_argument(
        "--fresh-loads",
        type=int,
        default=1,
        help="resume processes per format, each timing one first load (the later loads: the first)",
    )
    parser.add_argument("--dir", default=None, help="parent of the work dir (default: temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the work dir")
    parser.add_argument("--role", choices=("train", "resume"), help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--later-loads", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.formats = args.formats.split(",")
    overrides = [*FIXED_OVERRIDES, *model_overrides(args.size_mb)]
    if args.role is not None:
        role = role_train if args.role == "train" else role_resume
        print(json.dumps(role(args, overrides)))
        return
    workdir = Path(tempfile.mkdtemp(prefix="veoptim-ckpt-bench-", dir=args.dir))
    load_start = os.getloadavg()[0]  # other jobs on the machine skew every figure
    try:
        train = run_role("train", args, workdir, args.formats)
        # Fresh processes per format: each first load is a real resume. Every process after
        # the first only needs its first load, so it makes no later loads.
        resumes = {
            fmt: [resume(args, workdir, fmt, later_loads=None if i == 0 else 0)
                  for i in range(max(1, args.fresh_loads))]
            for fmt in args.formats
        }  # fmt: skip
        print(json.dumps(summarize(args, workdir, train, resumes, load_start)))
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
