"""The ``adamw`` type: ``torch.optim.AdamW`` with veoptim's loading and DCP guarantees.

Arithmetic and state are torch's (moments in the parameter dtype). Added: the
DCP state-initialising dummy step leaves every step counter at 0 (so it is not
counted as a real step and a later first step is bitwise the same as without
it), and ``load_state_dict`` validates keys, dtypes and shapes before torch's
loader runs, rejecting instead of casting.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from veoptim.errors import ConfigError
from veoptim.optim.base import ValidatedOptimizerMixin
from veoptim.optim.checks import ExpectedState, check_bool, check_lr
from veoptim.optim.dtensor_util import local
from veoptim.optim.state_keys import EXP_AVG, EXP_AVG_SQ, STEP, STEP_DTYPE

#: Boolean options of torch.optim.AdamW; torch itself accepts any truthy value.
_BOOL_OPTIONS = ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused")


class AdamW(ValidatedOptimizerMixin, torch.optim.AdamW):
    """``torch.optim.AdamW`` (fused where supported) with validated loading and a neutral DCP dummy step."""

    def __init__(
        self,
        params: Iterable[Any],
        *,
        param_names: Mapping[int, str] | None = None,
        **kwargs: Any,
    ) -> None:
        for name in _BOOL_OPTIONS:
            if name in kwargs:
                check_bool(name, kwargs[name], optional=name in ("foreach", "fused"))
        if kwargs.get("amsgrad"):
            raise ConfigError("veoptim's adamw does not support amsgrad; use amsgrad=False.")
        self.param_names: dict[int, str] = dict(param_names or {})
        super().__init__(params, **kwargs)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Check a group's own lr/maximize before torch adds it (torch checks only the defaults)."""
        if "lr" in param_group:
            check_lr(param_group["lr"])
        if "maximize" in param_group:
            check_bool("maximize", param_group["maximize"])
        super().add_param_group(param_group)

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
            return self._torch_step(closure)
        # lr 0 and zero gradients leave parameters and moments bitwise unchanged; only
        # the step counters moved, and they are put back to 0.
        loss = self._torch_step(closure)
        for state in self.state.values():
            state[STEP].zero_()
        return loss

    def _torch_step(self, closure: Any) -> Any:
        """torch's AdamW step without its step-hook wrapper.

        Once any plain ``torch.optim.Adam``/``AdamW`` exists, torch has wrapped that class's
        ``step`` to run step hooks; our own ``step`` is wrapped too, so calling the wrapped
        parent would run every pre/post hook twice.
        """
        fn = super().step.__func__  # type: ignore[attr-defined]
        while getattr(fn, "hooked", False):
            fn = fn.__wrapped__
        return fn(self, closure)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Reject (CheckpointError, nothing changed) state whose keys, dtype or shape differ.

        Load pre-hooks run first (as in torch), so what is validated is what is loaded.
        """
        state_dict = dict(state_dict)
        hooks = self._optimizer_load_state_dict_pre_hooks
        for hook in hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._validated_owners(state_dict)
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()  # already run above
        try:
            super().load_state_dict(state_dict)
        finally:
            self._optimizer_load_state_dict_pre_hooks = hooks
