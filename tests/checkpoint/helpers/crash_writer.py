"""Save checkpoints through the real publisher and die by SIGKILL at a chosen phase.

    python crash_writer.py ROOT --name ckpt --step 2 --die-at before_replace
    python crash_writer.py ROOT --loop [--count N]   # save step_N and latest (until killed)

``--die-at`` takes a publisher phase (``veoptim.checkpoint.publish.PHASES``) or
``mid_shard`` (inside a shard, before the writer finishes it).
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import sys
from pathlib import Path

from payload import write_payload

from veoptim.checkpoint.layout import read_manifest, step_name
from veoptim.checkpoint.publish import Publisher
from veoptim.checkpoint.versions import latest_complete, resolve

MID_SHARD = "mid_shard"


def naive_save(root: Path, name: str, step: int, shard_bytes: int) -> None:
    """Negative control: a non-atomic "move the old directory aside, move the new one in"
    publish, killed between the two renames (what the atomic publisher replaces)."""
    tmp = root / f"{name}.tmp"
    tmp.mkdir()
    write_payload(tmp, step, shard_bytes)
    os.rename(root / name, root / f"{name}.old")
    os.kill(os.getpid(), signal.SIGKILL)
    os.rename(tmp, root / name)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("--name", default="ckpt")
    parser.add_argument("--step", type=int, default=1)
    parser.add_argument("--die-at", default="")
    parser.add_argument("--shard-bytes", type=int, default=4096)
    parser.add_argument("--keep-last", type=int, default=0)
    parser.add_argument("--no-fsync", action="store_true")
    parser.add_argument("--loop", action="store_true")
    parser.add_argument("--count", type=int, default=0, help="--loop: stop after N steps")
    parser.add_argument("--naive", action="store_true", help="negative control, see naive_save")
    args = parser.parse_args()
    if args.naive:
        naive_save(args.root, args.name, args.step, args.shard_bytes)

    def die_at(phase: str) -> None:
        if phase == args.die_at:
            os.kill(os.getpid(), signal.SIGKILL)

    publisher = Publisher(
        args.root,
        keep_last=args.keep_last,
        fsync=not args.no_fsync,
        fault_hook=die_at,
    )
    if not args.loop:
        with publisher.write(args.name, step=args.step) as version:
            write_payload(
                version, args.step, args.shard_bytes, die_mid_shard=args.die_at == MID_SHARD
            )
        return 0
    latest = latest_complete(args.root)
    step = 0 if latest is None else read_manifest(resolve(args.root, latest)).step
    rounds = itertools.count() if args.count <= 0 else range(args.count)
    for _ in rounds:
        step += 1
        for name in (step_name(step), "latest"):
            with publisher.write(name, step=step, prunable=name != "latest") as version:
                write_payload(version, step, args.shard_bytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
