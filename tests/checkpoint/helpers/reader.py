"""Read checkpoints in a loop while another process saves; report what was seen as JSON.

    python reader.py ROOT STOP_FILE

Each read resolves a name once (``latest``, or whatever ``latest_complete`` picks), then
reads every file from that version. Any read that fails or sees a torn/mixed version is
reported.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import light_imports  # noqa: F401  (before veoptim)
from payload import check_payload

from veoptim.checkpoint.manifest import read_manifest
from veoptim.checkpoint.resolve import latest_complete, resolve


def main() -> int:
    root, stop = Path(sys.argv[1]), Path(sys.argv[2])
    reads, failures, steps = 0, [], set()
    while not stop.exists() or reads < 20:
        name = "latest" if reads % 2 else latest_complete(root)
        try:
            version = resolve(root, name)
            step = check_payload(version)
            if read_manifest(version).step != step:
                raise ValueError(f"manifest step differs from payload step {step} in {version}")
            steps.add(step)
        except Exception as exc:
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
        reads += 1
    print(json.dumps({"reads": reads, "failures": failures[:20], "steps": sorted(steps)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
