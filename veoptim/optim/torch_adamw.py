"""The ``adamw`` type: ``torch.optim.AdamW`` with veoptim's loading and DCP guarantees.

Arithmetic and state are torch's (moments in the parameter dtype). Added: the
DCP state-initialising dummy step leaves every step counter at 0 (so it is not
counted as a real step and a later first step is bitwise the same as without
it), and ``load_state_dict`` validates keys, dtypes and shapes before torch's
loader runs, rejecting instead of casting.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from veoptim.errors import ConfigError
from veoptim.optim.base import ValidatedOptimizerMixin
from veoptim.optim.dtensor_util import local
from veoptim.optim.state_check import ExpectedState
from veoptim.optim.state_keys import EXP_AVG, EXP_AVG_SQ, STEP, STEP_DTYPE


class AdamW(ValidatedOptimizerMixin, torch.optim.AdamW):
    """``torch.optim.AdamW`` (fused where supported) with validated loading and a neutral DCP dummy step."""

    def __init__(
        self,
        params: Iterable[Any],
        *,
        param_names: Mapping[int, str] | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("amsgrad"):
            raise ConfigError("veoptim's adamw does not support amsgrad; use amsgrad=False.")
        self.param_names: dict[int, str] = dict(param_names or {})
        super().__init__(params, **kwargs)

    def expected_state(self, param: torch.Tensor) -> ExpectedState:
        """torch AdamW's state of ``param``: moments in the parameter dtype, FP32 scalar step."""
        self._group_of(param)
        pl = local(param)
        return {
            STEP: (torch.Size([]), STEP_DTYPE),
            EXP_AVG: (pl.shape, pl.dtype),
            EXP_AVG_SQ: (pl.shape, pl.dtype),
        }

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        if not self._is_dcp_dummy_step():
            return super().step(closure)
        # lr 0 and zero gradients leave parameters and moments bitwise unchanged; only
        # the step counters moved, and they are put back to 0.
        loss = super().step(closure)
        for state in self.state.values():
            state[STEP].zero_()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Reject (CheckpointError, nothing changed) state whose keys, dtype or shape differ."""
        self._validated_owners(state_dict)
        super().load_state_dict(state_dict)
