"""Counting host synchronisations without a GPU.

On an accelerator a host synchronisation is anything that makes the CPU wait for the
device: reading a value (``.item()``, ``int()``, ``bool()``, ``.tolist()``, ``.cpu()``,
``.numpy()``) or an op whose output size depends on tensor values (``nonzero``, boolean
mask indexing, ``bincount``, ``unique``, ``masked_select``, ``repeat_interleave``
without ``output_size``). On CPU none of them waits, so :class:`HostSyncCounter` counts
them instead: a ``TorchDispatchMode`` sees every aten op (forward and backward), and the
three reads that never reach the dispatcher for CPU tensors (``tolist``, ``cpu``,
``numpy``) are counted by wrapping them on ``torch.Tensor`` while the counter is active.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: Ops that read a value or size their output from tensor values.
SYNCING_OPS = {
    "aten._local_scalar_dense.default",  # item(), int(t), float(t), bool(t)
    "aten.is_nonzero.default",
    "aten.equal.default",
    "aten.allclose.default",
    "aten.nonzero.default",
    "aten.nonzero_static.default",
    "aten.masked_select.default",
    "aten.bincount.default",
    "aten._unique2.default",
    "aten.unique_dim.default",
    "aten.unique_consecutive.default",
}
HOST_READS = ("tolist", "cpu", "numpy")


def _is_sync(func: Any, args: tuple, kwargs: dict) -> bool:
    name = str(func)
    if name in SYNCING_OPS:
        return True
    if name == "aten.repeat_interleave.Tensor":
        return kwargs.get("output_size") is None
    if name.startswith("aten.index.Tensor"):  # boolean masks are a nonzero in disguise
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(i is not None and i.dtype == torch.bool for i in indices)
    return False


class HostSyncCounter(TorchDispatchMode):
    """``with HostSyncCounter() as c: ...``; then ``c.total`` and ``c.by_name`` (the syncs),
    ``c.ops`` (every aten op seen, to tell which path ran)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_name: Counter[str] = Counter()
        self.ops: Counter[str] = Counter()
        self._saved: dict[str, Callable | None] = {}

    @property
    def total(self) -> int:
        return sum(self.by_name.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        self.ops[str(func)] += 1
        if _is_sync(func, args, kwargs):
            self.by_name[str(func)] += 1
        return func(*args, **kwargs)

    def __enter__(self) -> HostSyncCounter:
        for name in HOST_READS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = torch.Tensor.__dict__.get(name)  # None: inherited from TensorBase

            def counted(
                t: torch.Tensor, *a: Any, _name: str = name, _f: Callable = original, **k: Any
            ):
                self.by_name[f"Tensor.{_name}"] += 1
                return _f(t, *a, **k)

            setattr(torch.Tensor, name, counted)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for name, own in self._saved.items():
            if own is None:
                delattr(torch.Tensor, name)  # falls back to TensorBase's method
            else:
                setattr(torch.Tensor, name, own)
        self._saved.clear()
        return super().__exit__(*exc)
