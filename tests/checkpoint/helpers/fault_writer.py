"""Run a sequence of saves of one name under a real filesystem fault; report JSON lines.

    python fault_writer.py ROOT --saves 1:1024,2:4000000,3:1024 [--fsize-limit BYTES]

For each ``step:shard_bytes`` it saves ``ckpt`` and prints
``{"step", "error", "published_step"}``: the error message (None on success) and the step
``ckpt`` resolves to afterwards. ``--fsize-limit`` sets RLIMIT_FSIZE, so writing beyond it
fails with EFBIG, as a full quota would. The caller provides the fault otherwise (a tiny
tmpfs for ENOSPC, an unwritable directory for EACCES).
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import signal
import sys
from pathlib import Path

from payload import check_payload, write_payload

from veoptim.checkpoint.publish import Publisher
from veoptim.checkpoint.versions import resolve
from veoptim.errors import CheckpointError


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("--saves", required=True)
    parser.add_argument("--fsize-limit", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)  # retention warnings go to stderr
    if args.fsize_limit:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of a signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (args.fsize_limit, args.fsize_limit))
    publisher = Publisher(args.root, keep_last=0, fsync=True)
    for item in args.saves.split(","):
        step, shard_bytes = (int(x) for x in item.split(":"))
        error = None
        try:
            with publisher.write("ckpt", step=step) as version:
                write_payload(version, step, shard_bytes)
        except CheckpointError as exc:
            error = str(exc)
        try:
            published = check_payload(resolve(args.root, "ckpt"))
        except Exception as exc:
            published = f"{type(exc).__name__}: {exc}"
        versions = sorted(p.name for p in (args.root / ".versions").iterdir())
        print(
            json.dumps(
                {"step": step, "error": error, "published_step": published, "versions": versions}
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
