"""Shared pieces of the LoRA tests: a PEFT load that fails on PEFT's key warnings, logits."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import torch
from peft import PeftModel
from torch import nn

#: A fixed input for comparing logits (token ids inside the bundled vocabulary).
INPUT_IDS = torch.tensor([[5, 17, 40, 99, 12, 7, 260, 3, 44, 100], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0]])


def load_peft_strictly(base: nn.Module, adapter_dir: Path) -> nn.Module:
    """``PeftModel.from_pretrained``; any warning from PEFT (missing or unexpected adapter
    keys, say) fails the test."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = PeftModel.from_pretrained(copy.deepcopy(base), str(adapter_dir))
    peft_warnings = [str(w.message) for w in caught if "peft" in (w.filename or "")]
    assert not peft_warnings, peft_warnings
    return model.eval()


def logits(model: nn.Module, ids: torch.Tensor = INPUT_IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.float()
