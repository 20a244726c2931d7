"""The trainer as the service calls it, on one process or on every rank of a torchrun job.

Under ``torchrun`` rank 0 runs the HTTP server, the database and the worker; the other
ranks run :func:`follow`. Every trainer call of the worker is a :class:`ServedTrainer`
method: rank 0 announces it (name and arguments) on a process group of its own, and
every rank runs it together (the slots' calls are collective), each on its share of the
rows of a forward pass or a sampling batch. Every rank then reports how its call ended,
with its share of the results, to rank 0: a failure on any rank is that request's error
(on rank 0 the exception itself, from another rank its message and category), and the
next call runs as usual.

A rank that dies or does not answer within ``serve.rank_timeout_s`` fails the call in
flight with a ``server`` error; rank 0 then answers every further trainer call with that
error at once instead of waiting on the lost rank (``healthz`` names it), until the job
is restarted. With one process every method is the :class:`SlotTrainer` call itself.
"""

from __future__ import annotations

import logging
import signal
import weakref
from collections.abc import Callable, Collection
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from veoptim.data.fields import INPUT_IDS
from veoptim.distributed.sizes import rank_slice
from veoptim.service.errors import SERVER, ServiceError, describe
from veoptim.slots import (
    Generation,
    SampledRow,
    SampleRow,
    SlotTrainer,
    TokenPass,
    forward_tokens,
    optim_step_clipped,
)

log = logging.getLogger("veoptim.service")
#: The followers wait for rank 0's next call as long as the job runs.
IDLE_TIMEOUT = timedelta(days=365)
STOP = "stop"


class ServedTrainer:
    """The calls the service makes on its :class:`SlotTrainer`; the few reads it makes
    (``num_slots``, which slots hold an adapter, where exports go) go to rank 0's trainer
    directly. Build it on every rank (it creates the job's call groups: collective)."""

    def __init__(self, trainer: SlotTrainer, timeout_s: float) -> None:
        self.trainer = trainer
        self.rank, self.world = trainer.ctx.rank, trainer.ctx.world_size
        self.timeout_s = timeout_s
        #: Why the job cannot run trainer calls any more (a rank was lost); "" while it can.
        self.lost = ""
        self._announce = self._agree = None
        if self.world > 1:
            self._announce = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
            self._agree = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    # ------------------------------------------------------------------ reads (rank 0's trainer)
    @property
    def num_slots(self) -> int:
        return self.trainer.num_slots

    def holds(self, slot: int) -> bool:
        """Whether ``slot`` holds an adapter (maybe one a failed load left partly written)."""
        return self.trainer.holds(slot)

    def partly_written(self, slot: int) -> bool:
        """Whether a failed load left ``slot`` partly written."""
        return self.trainer.partly_written(slot)

    def export_dir(self, name: str) -> Path:
        """Where ``export_slot`` publishes the PEFT adapter directory ``name``."""
        return self.trainer.export_dir(name)

    # ------------------------------------------------------------------ calls
    def create_slot(self, slot: int, **hyper: Any) -> None:
        self._everywhere("create_slot", slot, **hyper)

    def load_slot(self, slot: int, ref: str, load_optimizer: bool = True) -> Path:
        return self._everywhere("load_slot", slot, ref, load_optimizer)

    def release_slot(self, slot: int) -> None:
        self._everywhere("release_slot", slot)

    def save_slot(self, slot: int, name: str, with_optimizer: bool = True) -> Path:
        return self._everywhere("save_slot", slot, name, with_optimizer)

    def export_slot(self, slot: int, name: str) -> Path:
        return self._everywhere("export_slot", slot, name)

    def delete_checkpoint(self, name: str) -> None:
        self._everywhere("delete_checkpoint", name)

    def prune_checkpoints(self, keep: Collection[str]) -> list[str]:
        return self._everywhere("prune_checkpoints", set(keep))

    def slot_state(self, slot: int) -> dict[str, Any]:
        return self._everywhere("slot_state", slot)

    def optim_step(self, slot: int, grad_clip: float, **adam: Any) -> dict[str, float]:
        """``optim_step`` of ``slot`` with this call's gradient-norm clip (0 = none)."""
        return self._everywhere("optim_step", slot, grad_clip, **adam)

    def forward_tokens(self, batch: dict[str, torch.Tensor], loss: Any, backward: bool,
                       train_slots: Collection[int] | None = None) -> TokenPass:  # fmt: skip
        """:func:`forward_tokens` of ``loss.row_losses`` over ``batch``, each rank its rows
        (``train_slots``: the slots that train; the others' rows are a forward only)."""
        return self._everywhere("forward_tokens", batch, loss, backward, train_slots)

    def start_sampling(self, rows: list[SampleRow]) -> None:
        """A :class:`Generation` of ``rows`` on every rank (its share), prefilled; one at
        a time per job."""
        self._everywhere("start_sampling", rows)

    def advance_sampling(self, steps: int | None, seconds: float | None = None) -> bool:
        """:meth:`Generation.advance` everywhere; whether every row stopped."""
        return self._everywhere("advance_sampling", steps, seconds)

    def sampled(self) -> list[SampledRow]:
        """The finished generation's rows, in the order they were started; it is dropped."""
        return self._everywhere("sampled")

    def drop_sampling(self) -> None:
        """Drop the generation in progress (if any) on every rank."""
        self._everywhere("drop_sampling")

    # ------------------------------------------------------------------ rank 0
    def _everywhere(self, name: str, *args: Any, **kwargs: Any) -> Any:
        if self.world == 1:
            return run_local(self.trainer, name, 0, 1, args, kwargs)[0]
        if self.lost:
            raise ServiceError(self.lost, status=503, category=SERVER)
        try:
            dist.broadcast_object_list([(name, args, kwargs)], src=0, group=self._announce)
        except Exception as exc:
            self._lose(f"announcing {name}", exc)
        try:
            result, error = run_local(self.trainer, name, 0, self.world, args, kwargs)
        except Exception as exc:  # ended on rank 0: still collect the others' outcomes
            result, error, own = None, describe(exc), exc
        else:
            own = None
        reports: list[Any] = [None] * self.world
        shared = result if name in COMBINE else None  # the others' results are combined
        try:
            dist.gather_object((shared, error), reports, dst=0, group=self._agree)
        except Exception as exc:
            self._lose(f"collecting the ranks' outcome of {name}", exc)
        if own is not None:
            raise own
        for rank, (_, failure) in enumerate(reports):
            if failure is not None:
                message, category = failure
                raise ServiceError(f"{message} (on rank {rank})", category=category)
        if name in COMBINE:
            return COMBINE[name]([r for r, _ in reports], args)
        return result

    def _lose(self, what: str, exc: BaseException) -> None:
        self.lost = (
            f"a rank of this torchrun job was lost while {what} ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); the job can no longer train or "
            "sample: restart it (published checkpoints stay loadable)."
        )
        log.error("%s", self.lost)
        raise ServiceError(self.lost, status=503, category=SERVER) from exc

    def stop_followers(self) -> None:
        """Tell the other ranks the service ended (they return from :func:`follow`)."""
        if self.world == 1 or self.lost:
            return
        try:
            dist.broadcast_object_list([(STOP, (), {})], src=0, group=self._announce)
        except Exception:
            log.warning("could not tell the other ranks to stop", exc_info=True)

    def close(self) -> None:
        """Drop the trainer's model and this object's groups, so that the job's process
        groups can be destroyed (their threads end only once nothing holds them)."""
        self.trainer.close()
        self._announce = self._agree = None

    # ------------------------------------------------------------------ other ranks
    def follow(self) -> None:
        """Run rank 0's calls until it stops the service (or is lost). SIGTERM and SIGINT
        are left to rank 0, which drains and then stops every rank."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: log.info("signal: rank 0 drains and stops this rank"))
        log.info("rank %d follows rank 0's service calls", self.rank)
        while True:
            message: list[Any] = [None]
            try:
                dist.broadcast_object_list(message, src=0, group=self._announce)
            except Exception:
                log.error("rank 0 was lost: this rank stops", exc_info=True)
                raise
            name, args, kwargs = message[0]
            if name == STOP:
                log.info("rank 0 stopped the service")
                return
            try:
                result, error = run_local(self.trainer, name, self.rank, self.world, args, kwargs)
            except Exception as exc:
                result, error = None, describe(exc)
            outcome = (result if name in COMBINE else None, error)  # rank 0 keeps its own
            dist.gather_object(outcome, None, dst=0, group=self._agree)


def run_local(trainer: SlotTrainer, name: str, rank: int, world: int, args: tuple,
              kwargs: dict[str, Any]) -> tuple[Any, None]:  # fmt: skip
    """This rank's part of call ``name``: (its result, no error); raises on failure."""
    return CALLS[name](trainer, rank, world, *args, **kwargs), None


# ---------------------------------------------------------------------- the calls
def _forward(trainer: SlotTrainer, rank: int, world: int, batch: dict[str, torch.Tensor],
             loss: Any, backward: bool, train_slots: Any = None) -> TokenPass:  # fmt: skip
    """This rank's rows of ``batch``; a rank without rows runs row 0 with its loss times 0
    (every rank takes part in the sharded model's collectives; the zeros add nothing)."""
    rows = rank_slice(batch[INPUT_IDS].shape[0], rank, world)
    if not rows:
        mine = {k: v[:1] for k, v in batch.items()}
        out = forward_tokens(trainer, mine, lambda lp, b: loss.row_losses(lp, b) * 0.0,
                             backward=backward, train_slots=train_slots)  # fmt: skip
        return TokenPass(out.logprobs[:0], out.row_losses[:0])
    mine = {k: v[rows.start : rows.stop] for k, v in batch.items()}
    return forward_tokens(
        trainer, mine, loss.row_losses, backward=backward, train_slots=train_slots
    )


#: Each trainer's generation in progress in this process (the worker runs one at a time).
_GENERATIONS: weakref.WeakKeyDictionary[SlotTrainer, Generation] = weakref.WeakKeyDictionary()


def _start_sampling(trainer: SlotTrainer, rank: int, world: int, rows: list[SampleRow]) -> None:
    _GENERATIONS.pop(trainer, None)
    mine = rank_slice(len(rows), rank, world)
    _GENERATIONS[trainer] = Generation(trainer, [rows[i] for i in mine], pad_with=rows[0])


def _generation(trainer: SlotTrainer) -> Generation:
    generation = _GENERATIONS.get(trainer)
    if generation is None:
        raise ServiceError("no sampling batch is in progress on this rank.", category=SERVER)
    return generation


def _drop_sampling(trainer: SlotTrainer) -> None:
    _GENERATIONS.pop(trainer, None)


def _sampled(trainer: SlotTrainer) -> list[SampledRow]:
    rows = _generation(trainer).results()
    del _GENERATIONS[trainer]
    return rows


CALLS: dict[str, Callable[..., Any]] = {
    "create_slot": lambda t, _r, _w, slot, /, **hyper: t.create_slot(slot, **hyper),
    "load_slot": lambda t, _r, _w, /, *a: t.load_slot(*a),
    "release_slot": lambda t, _r, _w, slot, /: t.release_slot(slot),
    "save_slot": lambda t, _r, _w, /, *a: t.save_slot(*a),
    "export_slot": lambda t, _r, _w, /, *a: t.export_slot(*a),
    "delete_checkpoint": lambda t, _r, _w, name, /: t.delete_checkpoint(name),
    "prune_checkpoints": lambda t, _r, _w, keep, /: t.prune_checkpoints(keep),
    "slot_state": lambda t, _r, _w, slot, /: t.slot_state(slot),
    "optim_step": lambda t, _r, _w, slot, clip, /, **adam: optim_step_clipped(
        t, slot, clip, **adam
    ),
    "forward_tokens": _forward,
    "start_sampling": _start_sampling,
    "advance_sampling": lambda t, _r, _w, steps, seconds, /: _generation(t).advance(steps, seconds),
    "sampled": lambda t, _r, _w, /: _sampled(t),
    "drop_sampling": lambda t, _r, _w, /: _drop_sampling(t),
}


def _combine_forward(results: list[TokenPass], args: tuple) -> TokenPass:
    return TokenPass(
        torch.cat([r.logprobs for r in results]), torch.cat([r.row_losses for r in results])
    )


#: How rank 0 puts the ranks' results together (the other calls answer rank 0's own).
COMBINE: dict[str, Callable[[list[Any], tuple], Any]] = {
    "forward_tokens": _combine_forward,
    "sampled": lambda results, args: [row for part in results for row in part],
}
