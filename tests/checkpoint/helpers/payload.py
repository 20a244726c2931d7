"""A deterministic test payload: every file of a version says which step wrote it.

Used by the helper scripts (run as ``python helpers/<script>.py``) and by the tests, so a
reader can tell a complete version of one step from a mix of two steps or a torn file.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

SHARDS = 3
META_FILE = "meta.json"
SHARD_FILE = "shard_{index}.bin"
HEADER = b"step=%012d\n"
HEADER_LEN = len(HEADER % 0)


def _fill(step: int) -> bytes:
    return bytes([step % 251])


def write_payload(version: Path, step: int, shard_bytes: int, *, die_mid_shard: bool = False):
    """Write the shards and the meta file of ``step``; optionally SIGKILL inside shard 1."""
    (version / "shards").mkdir(exist_ok=True)
    for index in range(SHARDS):
        with open(version / "shards" / SHARD_FILE.format(index=index), "wb") as f:
            f.write(HEADER % step)
            body = _fill(step) * shard_bytes
            if die_mid_shard and index == 1:
                f.write(body[: shard_bytes // 2])
                f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            f.write(body)
    (version / META_FILE).write_text(json.dumps({"step": step}))


def check_payload(version: Path) -> int:
    """The step a version holds; ``ValueError`` if its files are torn or from several steps."""
    step = json.loads((version / META_FILE).read_text())["step"]
    for index in range(SHARDS):
        data = (version / "shards" / SHARD_FILE.format(index=index)).read_bytes()
        if data[:HEADER_LEN] != HEADER % step:
            raise ValueError(f"shard {index} of {version} is from another step than {step}")
        body = data[HEADER_LEN:]
        if not body or body.count(_fill(step)) != len(body):
            raise ValueError(f"shard {index} of {version} is torn or mixed")
    return step
