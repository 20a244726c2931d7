"""``veoptim-sweep-report`` in a checkout: ``python scripts/sweep_report.py runs/sft ...``.

The report is ``tasks/sweep_report.py`` (installed as ``veoptim.tasks.sweep_report``, the
``veoptim-sweep-report`` command); this wrapper keeps the documented script path working.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's tasks/

from tasks.sweep_report import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
