"""``<run.dir>/metrics.jsonl``: one line per training call and per sampling request."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any


class MetricsLog:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()

    def write(self, model_id: str, tenant_id: int, slot: int | None, op: str,
              **values: Any) -> None:  # fmt: skip
        line = {"time": round(time.time(), 3), "model": model_id, "tenant": tenant_id,
                "slot": slot, "op": op, **values}  # fmt: skip
        with self._lock, self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")
