"""Multi-LoRA slots: concurrent adapters on one frozen base, each with its own optimizer,
checkpoints and exports (``SlotTrainer``; see ``docs/multi_lora.md``). This package is
the door: no library module outside it imports one of its modules
(``tests/test_import_rules.py``).

The public surface, for the service, ``tasks/multi_lora.py`` and scripts: the trainer and
its config, the store where slot checkpoints live, and the per-token passes and sampling
of ``tokens.py``. The config loads without torch (a task command checks its command line
first); the runtime names are imported on first use (PEP 562).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from veoptim.lazy import lazy_names
from veoptim.slots.config import MultiLoRAConfig

if TYPE_CHECKING:
    from veoptim.slots.store import SlotStore
    from veoptim.slots.tokens import (
        TARGET_TOKENS,
        Generation,
        SampledRow,
        SampleRow,
        TokenLoss,
        TokenPass,
        forward_tokens,
        optim_step_clipped,
        sample_tokens,
    )
    from veoptim.slots.trainer import SLOT_IDS, SlotLoss, SlotTrainer

#: Public name -> submodule that defines it.
_EXPORTS: dict[str, str] = {
    "SLOT_IDS": "trainer",
    "SlotLoss": "trainer",
    "SlotTrainer": "trainer",
    "SlotStore": "store",
    "TARGET_TOKENS": "tokens",
    "TokenLoss": "tokens",
    "TokenPass": "tokens",
    "Generation": "tokens",
    "forward_tokens": "tokens",
    "optim_step_clipped": "tokens",
    "SampleRow": "tokens",
    "SampledRow": "tokens",
    "sample_tokens": "tokens",
}

__all__ = [
    "SLOT_IDS",
    "Generation",
    "TARGET_TOKENS",
    "MultiLoRAConfig",
    "SampleRow",
    "SampledRow",
    "SlotLoss",
    "SlotStore",
    "SlotTrainer",
    "TokenLoss",
    "TokenPass",
    "forward_tokens",
    "optim_step_clipped",
    "sample_tokens",
]

__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)
