"""Let helper subprocesses import the publisher without importing torch (about 1-5 s each).

``veoptim/distributed/__init__.py`` re-exports the device mesh and FSDP plan, which import
torch; ``veoptim.distributed.agreement`` itself needs torch only once a process group
exists. Registering the package without running its ``__init__`` keeps each crash-test
subprocess at a fraction of a second; the modules under test are the real ones.
Import this module before any ``veoptim`` module.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
_PACKAGE = "veoptim.distributed"

if _PACKAGE not in sys.modules:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import veoptim  # noqa: F401  (the real parent package)

    _module = types.ModuleType(_PACKAGE)
    _module.__path__ = [str(REPO / "veoptim" / "distributed")]
    sys.modules[_PACKAGE] = _module
