"""Read checkpoints in a loop while another process saves; report what was seen as JSON.

    python reader.py ROOT STOP_FILE

Each read resolves a name once (``latest``, or whatever ``latest_complete`` picks), then
reads every file from that version. A read whose version was removed meanwhile (the name
moved on and a later save collected the old version, manifest first) is counted as
``vanished``: the documented outcome for a slow reader. Any other failure, and any torn or
mixed version, is reported.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from payload import check_payload

from veoptim.checkpoint.layout import manifest_path, read_link, read_manifest, version_dir
from veoptim.checkpoint.versions import latest_complete, resolve_version


def removed(root: Path, name: str, version_id: str | None) -> bool:
    """True iff ``name`` no longer points to ``version_id`` and that version is being or
    has been deleted (its manifest, deleted first, is gone)."""
    if version_id is None or read_link(root, name) == version_id:
        return False
    return not manifest_path(version_dir(root, version_id)).exists()


def main() -> int:
    root, stop = Path(sys.argv[1]), Path(sys.argv[2])
    reads, vanished, failures, steps = 0, 0, [], set()
    while not stop.exists() or reads < 20:
        name = "latest" if reads % 2 else latest_complete(root)
        version_id = None
        try:
            version_id = read_link(root, name)
            if version_id is None:
                raise ValueError(f"{name!r} is not a published name in {root}")
            version = resolve_version(root, version_id)
            step = check_payload(version)
            if read_manifest(version).step != step:
                raise ValueError(f"manifest step differs from payload step {step} in {version}")
            steps.add(step)
        except Exception as exc:
            if removed(root, name, version_id):
                vanished += 1
            else:
                failures.append(f"{name}: {type(exc).__name__}: {exc}")
        reads += 1
    report = {"reads": reads, "vanished": vanished, "failures": failures[:20]}
    print(json.dumps({**report, "steps": sorted(steps)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
