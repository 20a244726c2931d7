"""Noticing parameter edits made outside the optimizer, so a stale master never undoes them.

Where the FP32 master is a separate tensor (BF16/FP16 parameters, every
offloaded group), the next step writes the parameter from the master: an edit
between steps (``model.load_state_dict``, ``p.clamp_()`` under ``no_grad``, a
re-initialised layer) would be silently reverted. Where the parameter is its own
master (resident FP32), ``p.data = new_tensor`` would leave the master aliasing
the old storage, and the parameter would never move again.

Detection is cheap: after every write the optimizer records the local tensor's
``_version`` (bumped by every in-place write through the parameter or a view or
``detach()`` of it) and its ``data_ptr`` (changed by rebinding). Only when one
of them moved is the parameter compared with what the master would write; if it
differs, the master is re-derived from the edited value (moments and step are
kept) and one log line names the parameters. In-place writes through ``p.data``
do not bump ``p._version`` (torch gives ``.data`` its own version counter), so
they are visible only to :meth:`ExactAdamW.params_edited` or a rebinding.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from veoptim.optim.dtensor_util import global_flat_offset, local
from veoptim.optim.rounding import noise_key, write_back_
from veoptim.optim.state_keys import MASTER_WEIGHT, STEP

log = logging.getLogger(__name__)

#: (``_version``, ``data_ptr``) of a parameter's local tensor after the optimizer's last write.
Mark = tuple[int, int]


def mark_of(p: torch.Tensor) -> Mark:
    pl = local(p)
    return (pl._version, pl.data_ptr())


def written_value(
    p: torch.Tensor, state: Mapping[str, torch.Tensor], sr: bool, sr_seed: int, ordinal: int
) -> torch.Tensor:
    """What the optimizer's last write-back put into ``p`` (on the master's device)."""
    master = local(state[MASTER_WEIGHT]).reshape(-1)
    pl = local(p)
    out = torch.empty(master.numel(), dtype=pl.dtype, device=master.device)
    step = int(float(state[STEP]))
    write_back_(
        [out],
        [master],
        stochastic=sr,
        keys=[noise_key(sr_seed, step, ordinal)] if sr else None,
        first_indices=[global_flat_offset(p)] if sr else None,
    )
    return out.view(pl.shape)


def matches_master(
    p: torch.Tensor,
    state: Mapping[str, torch.Tensor],
    aliased: bool,
    sr: bool,
    sr_seed: int,
    ordinal: int,
) -> bool:
    """Whether the parameter still holds exactly what its master implies."""
    pl, master = local(p), local(state[MASTER_WEIGHT])
    if pl.shape != master.shape:
        return False
    if aliased:
        return torch.equal(master, pl)
    expected = written_value(p, state, sr, sr_seed, ordinal)
    return torch.equal(expected, pl.to(expected.device))


@torch.no_grad()
def rederive_master_(p: torch.Tensor, state: dict[str, Any], aliased: bool) -> None:
    """Make the master follow the parameter's current value; moments and step are kept."""
    pl = local(p)
    master = local(state[MASTER_WEIGHT])
    if pl.shape != master.shape:
        raise RuntimeError(
            f"a parameter changed shape from {tuple(master.shape)} to {tuple(pl.shape)} outside "
            "the optimizer; its optimizer state cannot follow (rebuild the optimizer)."
        )
    if aliased:
        state[MASTER_WEIGHT] = p.detach()
    else:
        master.copy_(pl)


def log_rederived(owner: str, names: list[str]) -> None:
    if names:
        log.warning(
            "%s: %d parameter(s) were changed outside the optimizer since its last step (%s); "
            "their FP32 masters are re-derived from the edited values (moments and step kept).",
            owner,
            len(names),
            ", ".join(names[:8]) + (", ..." if len(names) > 8 else ""),
        )


class EditFollowingMixin:
    """``ExactAdamW``'s reaction to edits. The class provides the attributes declared here
    and ``master_is_param``, ``_name``, ``_group_of``, ``_all_params`` (no stubs here, so
    the MRO finds the real ones)."""

    state: Any
    stochastic_rounding: bool
    sr_seed: int
    _marks: dict[torch.Tensor, Mark]
    _ordinals: dict[int, int]
    _unverified: set[torch.Tensor]

    def _follow_edit(
        self, p: torch.Tensor, group: Mapping[str, Any], state: dict[str, Any], edited: list[str]
    ) -> None:
        """The parameter was written or rebound since our last write: never undo the edit."""
        aliased = self.master_is_param(p, group)
        if aliased and local(state[MASTER_WEIGHT]).data_ptr() == local(p).data_ptr():
            return  # an in-place edit of a parameter that is its own master: nothing is stale
        ordinal = self._ordinals[id(p)]
        if not matches_master(p, state, aliased, self.stochastic_rounding, self.sr_seed, ordinal):
            edited.append(self._name(p))
        elif not aliased:
            return  # the same values were written again (e.g. a resume): the master stays exact
        rederive_master_(p, state, aliased)

    def resync_masters(self, params: Iterable[torch.Tensor] | None = None) -> list[str]:
        """Re-derive the masters of ``params`` (default: all) that differ from their parameter.

        For edits the version counter cannot see (in-place writes through ``p.data``).
        Returns the names of the parameters whose masters were re-derived.
        """
        edited: list[str] = []
        for p in self._all_params() if params is None else list(params):
            state = self.state.get(p)
            if state and p not in self._unverified:
                group = self._group_of(p)
                aliased = self.master_is_param(p, group)
                ordinal = self._ordinals[id(p)]
                sr, seed = self.stochastic_rounding, self.sr_seed
                if not matches_master(p, state, aliased, sr, seed, ordinal):
                    edited.append(self._name(p))
                    rederive_master_(p, state, aliased)
                self._marks[p] = mark_of(p)
        log_rederived(type(self).__name__, edited)
        return edited
