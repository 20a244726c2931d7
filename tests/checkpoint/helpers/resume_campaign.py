"""The multi-rank resume campaign shared by the resume-equivalence and resharding tests.

Process start (torch + transformers import, gloo setup) costs 10-20 s per spawn on the
shared 2-core machine, so every run of every variant shares six spawns::

    A4, A2, A1   train straight to N+K, and with train.stop_at_step=N (saves step N)
    (pytest)     publish a copy of a step-N checkpoint with BF16-rounded FP32 masters
    B4, B2, B1   fresh processes: resume=auto to N+K; negative controls (weights-only,
                 rounded masters); load other world sizes' step-N checkpoints (resharding)

The tests read the published checkpoints back (``ckpt_io``) and compare them bitwise.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.checkpoint.helpers.ckpt_io import write_bf16_rounded_masters
from tests.checkpoint.helpers.sft_jobs import LoadJob, SftJob, run_jobs
from tests.distributed.spawn import run_ranks
from veoptim.checkpoint import step_name

N, K = 3, 2
TOTAL = N + K
DENSE = {1: ("model=tiny_dense", "parallel=single"), 2: ("model=tiny_dense", "parallel=fsdp"),
         4: ("model=tiny_dense", "parallel=fsdp")}  # fmt: skip
MOE_4 = ("model=tiny_moe", "parallel=fsdp_ep2")
MOE_NO_EP = {1: ("model=tiny_moe", "parallel=single"), 2: ("model=tiny_moe", "parallel=fsdp")}
#: (world size, model kind, optimizer, model.dtype): every optimizer and every world size
#: at least once, not their product (a resume's exactness does not depend on the pair: the
#: optimizer's state and the rank's shards are checked independently). full_fp32_adamw on
#: 4 and 2 dense ranks and 4 MoE ranks are the resharding sources (the negative controls
#: run on 2 dense and 4 MoE ranks); then plain AdamW on one process, FP32 masters of BF16
#: params on 2 dense ranks and under expert parallelism, host offload on 4 dense ranks, and
#: fp16 with its loss scaler on 2 dense ranks (:data:`FP16_OVERRIDES`).
VARIANTS = (
    (4, "dense", "full_fp32_adamw", "bf16"),
    (2, "dense", "full_fp32_adamw", "bf16"),
    (4, "moe", "full_fp32_adamw", "bf16"),
    (1, "dense", "adamw", "fp32"),
    (2, "dense", "master_fp32_adamw", "bf16"),
    (4, "moe", "master_fp32_adamw", "bf16"),
    (4, "dense", "cpu_offload_adamw", "fp32"),
    (2, "dense", "master_fp32_adamw", "fp16"),
)
#: fp16 computes in fp16 under FSDP2 too; growing after every clean step from 2**17, the
#: tiny model's FP16 gradients overflow every other step (1, 3, 5: before and after the
#: resume at N), so the skips and the scaler's checkpointed state are part of the run.
FP16_OVERRIDES = (
    "parallel.param_dtype=fp16",
    "train.loss_scale_init=131072",
    "train.loss_scale_growth_interval=1",
)
NEGATIVE_OPTIMIZER = ("full_fp32_adamw", "bf16")
WORLDS = (4, 2, 1)


@dataclass(frozen=True)
class Variant:
    """One (world size, model + plan, optimizer, param dtype) combination."""

    world: int
    kind: str  # dense | moe
    optim: str
    dtype: str
    base: Path

    @property
    def name(self) -> str:
        return f"{self.world}rank-{self.kind}-{self.optim}-{self.dtype}"

    @property
    def dir(self) -> Path:
        return self.base / self.name

    def overrides(self, *, plan: tuple[str, str] | None = None) -> list[str]:
        model_plan = plan or (MOE_4 if self.kind == "moe" else DENSE[self.world])
        fp16 = FP16_OVERRIDES if self.dtype == "fp16" else ()
        return [*model_plan, f"optim={self.optim}", f"model.dtype={self.dtype}",
                f"train.max_steps={TOTAL}", *fp16]  # fmt: skip

    def run_dir(self, what: str) -> Path:
        return self.dir / what

    def checkpoint(self, what: str, step: int) -> Path:
        """The published ``step`` checkpoint of run ``what`` (straight, sliced, controls)."""
        root = self.tampered_root if what == "bf16_masters" else self.run_dir(what) / "checkpoints"
        return root / step_name(step)

    @property
    def tampered_root(self) -> Path:
        """Where the copy with BF16-rounded masters is published (and resumed from)."""
        return self.dir / "tampered"

    @property
    def negative(self) -> bool:
        kind = "moe" if self.world == 4 else "dense"
        return (self.optim, self.dtype) == NEGATIVE_OPTIMIZER and self.kind == kind


def variants(base: Path) -> list[Variant]:
    return [Variant(w, kind, o, d, base) for w, kind, o, d in VARIANTS]


def find(base: Path, world: int, kind: str, optim: str, dtype: str) -> Variant:
    return Variant(world, kind, optim, dtype, base)


# --------------------------------------------------------------------------- resharding
#: The step-N checkpoints that other world sizes load (source variant, target plan, optimizer?).
RESHARD_SOURCE_DENSE_4 = (4, "dense", "full_fp32_adamw", "bf16")
RESHARD_SOURCE_DENSE_2 = (2, "dense", "full_fp32_adamw", "bf16")
RESHARD_SOURCE_MOE_4 = (4, "moe", "full_fp32_adamw", "bf16")
#: key -> (loading world, source, plan in the loading run, load_optimizer)
RESHARD_LOADS: dict[str, tuple[int, tuple[Any, ...], tuple[str, str], bool]] = {
    "dense_4to2": (2, RESHARD_SOURCE_DENSE_4, DENSE[2], True),
    "dense_4to1": (1, RESHARD_SOURCE_DENSE_4, DENSE[1], True),
    "dense_2to1": (1, RESHARD_SOURCE_DENSE_2, DENSE[1], True),
    "dense_2to4": (4, RESHARD_SOURCE_DENSE_2, DENSE[4], True),
    "moe_4to2_same_ep": (2, RESHARD_SOURCE_MOE_4, MOE_4, True),
    "moe_4to2_no_ep_optimizer": (2, RESHARD_SOURCE_MOE_4, MOE_NO_EP[2], True),
    "moe_4to2_no_ep_weights": (2, RESHARD_SOURCE_MOE_4, MOE_NO_EP[2], False),
    "moe_4to1_optimizer": (1, RESHARD_SOURCE_MOE_4, MOE_NO_EP[1], True),
    "moe_4to1_weights": (1, RESHARD_SOURCE_MOE_4, MOE_NO_EP[1], False),
}


def reshard_source(base: Path, key: str) -> Path:
    _, source, _, _ = RESHARD_LOADS[key]
    return find(base, *source).checkpoint("sliced", N)


def reshard_out(base: Path, key: str) -> Path:
    return base / "reshard" / key


def _load_jobs(base: Path, world: int) -> list[LoadJob]:
    jobs = []
    for key, (target_world, source, plan, load_optimizer) in RESHARD_LOADS.items():
        if target_world != world:
            continue
        variant = find(base, *source)
        jobs.append(
            LoadJob(
                key=key,
                overrides=tuple(variant.overrides(plan=plan)),
                ref=str(reshard_source(base, key)),
                load_optimizer=load_optimizer,
                out_root=str(reshard_out(base, key)),
            )
        )
    return jobs


# --------------------------------------------------------------------------- the campaign
def _phase_a(variant: Variant) -> list[SftJob]:
    o = variant.overrides()
    return [
        SftJob((*o, f"run.dir={variant.run_dir('straight')}")),
        SftJob((*o, f"train.stop_at_step={N}", f"run.dir={variant.run_dir('sliced')}")),
    ]


def _phase_b(variant: Variant) -> list[SftJob]:
    o = variant.overrides()
    jobs = [SftJob((*o, "checkpoint.resume=auto", f"run.dir={variant.run_dir('sliced')}"))]
    if variant.negative:
        jobs.append(SftJob((*o, f"run.dir={variant.run_dir('weights_only')}",
                            f"checkpoint.resume={variant.checkpoint('sliced', N)}",
                            "checkpoint.load_optimizer=false")))  # fmt: skip
        jobs.append(SftJob((*o, f"run.dir={variant.run_dir('bf16_masters')}",
                            f"checkpoint.root={variant.tampered_root}",
                            "checkpoint.resume=auto")))  # fmt: skip
    return jobs


@functools.cache
def campaign(base: Path) -> dict[str, Any]:
    """Run all six spawns once per pytest process; returns timings and load results."""
    all_variants = variants(base)
    report: dict[str, Any] = {"seconds": {}, "loads": {}, "rounded_masters": {}}
    for world in WORLDS:
        jobs = [j for v in all_variants if v.world == world for j in _phase_a(v)]
        start = time.monotonic()
        run_ranks(world, run_jobs, base / f"spawn_a{world}", jobs)
        report["seconds"][f"a{world}"] = time.monotonic() - start
    for v in all_variants:
        if v.negative:
            report["rounded_masters"][v.name] = write_bf16_rounded_masters(
                v.checkpoint("sliced", N), v.tampered_root, step_name(N)
            )
    for world in WORLDS:
        jobs = [j for v in all_variants if v.world == world for j in _phase_b(v)]
        jobs += _load_jobs(base, world)
        start = time.monotonic()
        result = run_ranks(world, run_jobs, base / f"spawn_b{world}", jobs)
        report["seconds"][f"b{world}"] = time.monotonic() - start
        report["loads"].update(result["loads"])
    return report
