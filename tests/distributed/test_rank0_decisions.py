"""A decision only rank 0 makes, shared with ranks that wait for it, fails on every rank
when rank 0 fails: the other ranks raise the same agreed error instead of waiting forever
for a value rank 0 never sends, and the job goes on (the next export succeeds).

The fault is real: an ``exports/hf_base`` link pointing outside its root, which rank 0
refuses while deciding whether the base must be exported beside an adapter. The spawn has
a deadline, so a rank left waiting fails the test instead of hanging it.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.checkpoint.ckpt_state import build_trainer
from tests.distributed.spawn import run_ranks
from tests.slots.helpers import build
from veoptim.checkpoint import Publisher, resolve_agreed, step_name
from veoptim.distributed import DistContext
from veoptim.distributed.agreement import on_rank0
from veoptim.errors import CheckpointError, SlotError

pytestmark = [pytest.mark.slow, pytest.mark.multirank]

LORA = ["lora.enabled=true", "lora.r=4", "parallel=fsdp"]


def _outcome(call) -> str:
    try:
        call()
    except (CheckpointError, SlotError) as exc:
        return str(exc)
    return "ok"


def _escaping_base_link(exports: Path, rank: int) -> None:
    """Rank 0 plants ``exports/hf_base`` -> outside the root; every rank waits for it."""
    if rank == 0:
        exports.mkdir(parents=True, exist_ok=True)
        os.symlink("/tmp", exports / "hf_base")
    dist.barrier()


def _remove_link(exports: Path, rank: int) -> None:
    if rank == 0:
        (exports / "hf_base").unlink()
    dist.barrier()


def _callback_exports(ctx: DistContext, out: Path) -> dict[str, str]:
    from callbacks.hf_export import HFExportCallback

    trainer = build_trainer(out / "lora", LORA, ctx)
    trainer.train_step()
    exports, callback = trainer.run_dir / "exports", HFExportCallback(trainer.cfg.export)
    _escaping_base_link(exports, ctx.rank)
    failed = _outcome(lambda: callback.export(trainer, "lora_final"))
    _remove_link(exports, ctx.rank)
    return {"callback": failed, "callback_after": _outcome(lambda: callback.export(trainer, "x"))}


def _slot_exports(ctx: DistContext, out: Path) -> dict[str, str]:
    slots = build(out / "slots", ctx, **{"parallel.dp_shard": 2})
    slots.create_slot(0)
    _escaping_base_link(slots.exports_root, ctx.rank)
    failed = _outcome(lambda: slots.export_slot(0, "tenant"))
    _remove_link(slots.exports_root, ctx.rank)
    return {"slot": failed, "slot_after": _outcome(lambda: slots.export_slot(0, "tenant"))}


def _decisions(ctx: DistContext, out: Path) -> dict[str, str]:
    """Rank 0's decisions as every rank receives them: a value only rank 0 has (its pid),
    and ``resume=auto``'s version in the root of two checkpoints ``_results`` made. If a rank did not get rank
    0's value, every rank fails here at once, before a collective could wait for it."""
    seen = {
        "pid": on_rank0(os.getpid, "reading rank 0's pid"),
        "auto": str(resolve_agreed(out / "decisions", "auto").path),
    }
    gathered: list = [None] * ctx.world_size
    dist.all_gather_object(gathered, seen)
    if any(g != gathered[0] for g in gathered):
        raise AssertionError(f"the ranks did not all get rank 0's decisions: {gathered}")
    return {"decided_pid": str(seen["pid"]), "rank_pid": str(os.getpid()),
            "auto": seen["auto"]}  # fmt: skip


def _checks(ctx: DistContext, out: Path) -> dict:
    result = {**_decisions(ctx, out), **_callback_exports(ctx, out), **_slot_exports(ctx, out)}
    (out / f"rank{ctx.rank}.json").write_text(json.dumps(result))
    return result


@functools.cache
def _results() -> dict[int, dict[str, str]]:
    out = Path(tempfile.mkdtemp(prefix="veoptim-rank0-"))
    for step in (1, 2):  # a root of two checkpoints, published before the ranks start
        with Publisher(out / "decisions").write(step_name(step), step=step) as version:
            (version / "payload").write_text(str(step))
    run_ranks(2, _checks, out, timeout_s=120)  # the spawn takes ~20 s: a hang fails fast
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)}


def test_every_rank_gets_rank0s_decision_not_its_own():
    results = _results()
    assert results[1]["decided_pid"] == results[0]["decided_pid"] == results[0]["rank_pid"]
    assert results[1]["rank_pid"] != results[0]["rank_pid"]
    assert results[0]["auto"] == results[1]["auto"] and "step_00000002" in results[0]["auto"]


@pytest.mark.parametrize("export", ["callback", "slot"])
def test_rank0_failing_to_decide_fails_every_rank_with_the_same_error(export):
    results = _results()
    message = results[0][export]
    assert (
        "checking the base export in " in message
        and "failed on rank 0 of 2" in message
        and "points to '/tmp'" in message
    )
    assert results[1][export] == message


@pytest.mark.parametrize("export", ["callback", "slot"])
def test_the_ranks_stay_in_step_and_the_next_export_succeeds(export):
    assert [_results()[r][f"{export}_after"] for r in (0, 1)] == ["ok", "ok"]
