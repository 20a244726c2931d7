"""Fresh-process resume equivalence on 1, 2 and 4 gloo ranks, with negative controls.

For every variant (world size, dense FSDP2 or MoE EP x FSDP, optimizer type, param dtype:
each optimizer and each world size, not their product) ``tasks.sft`` runs N+K steps straight, and N steps with ``train.stop_at_step=N``
followed by a NEW process with ``checkpoint.resume=auto`` to N+K. Both final
checkpoints are read back into full tensors and must be bitwise equal: parameters,
FP32 masters, moments, step counters, LR scheduler and param groups, progress, sampler
position and RNG; the metrics.jsonl curves (loss, LR, grad norm, tokens) too. The
same comparison catches a weights-only resume and BF16-rounded masters. An fp16 run
(2 ranks, FP16 compute under FSDP2) skips overflowed steps before and after the resume, and
its loss scaler's state is compared too. The runs are
batched into six spawns (``helpers/resume_campaign.py``), shared with ``test_reshard``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checkpoint.helpers import ckpt_io
from tests.checkpoint.helpers.resume_campaign import TOTAL, N, campaign, variants
from veoptim.checkpoint import latest_complete, step_name

pytestmark = pytest.mark.multirank

VARIANTS = {v.name: v for v in variants(Path("."))}
NEGATIVE = sorted(name for name, v in VARIANTS.items() if v.negative)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    path = tmp_path_factory.getbasetemp() / "resume_campaign"
    campaign(path)
    return path


def _variant(base: Path, name: str):
    v = VARIANTS[name]
    return type(v)(v.world, v.kind, v.optim, v.dtype, base)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_fresh_process_resume_is_bitwise_equal_to_straight_run(base, name):
    v = _variant(base, name)
    straight = ckpt_io.read_checkpoint(v.checkpoint("straight", TOTAL))
    resumed = ckpt_io.read_checkpoint(v.checkpoint("sliced", TOTAL))
    assert ckpt_io.differences(straight, resumed) == []
    assert straight.trainer_state["progress"]["global_step"] == TOTAL
    if v.optim != "adamw":  # FP32 masters are really part of the comparison
        masters = ckpt_io.master_keys(straight)
        assert masters and all(str(straight.tensors[k].dtype) == "torch.float32" for k in masters)
    curve = ckpt_io.metrics(v.run_dir("straight"))
    assert [r["step"] for r in curve] == list(range(1, TOTAL + 1))
    assert ckpt_io.metrics(v.run_dir("sliced")) == curve  # data order, loss, LR, grad norm
    if v.dtype == "fp16":  # the loss scaler skipped steps on both sides of the resume
        skipped = [r["skipped_steps"] for r in curve]
        assert skipped[N - 1] > 0 and skipped[-1] > skipped[N - 1], skipped
        assert straight.trainer_state["loss_scale"] == resumed.trainer_state["loss_scale"]


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_stop_at_step_saved_step_n_and_exited(base, name):
    v = _variant(base, name)
    sliced = ckpt_io.read_checkpoint(v.checkpoint("sliced", N))
    assert sliced.trainer_state["progress"]["global_step"] == N
    straight_names = sorted(p.name for p in (v.run_dir("straight") / "checkpoints").iterdir())
    assert step_name(N) not in straight_names  # only stop_at_step made the step-N save
    assert latest_complete(v.run_dir("sliced") / "checkpoints") == step_name(TOTAL)


@pytest.mark.parametrize("name", NEGATIVE)
def test_weights_only_resume_is_detected(base, name):
    v = _variant(base, name)
    straight = ckpt_io.read_checkpoint(v.checkpoint("straight", TOTAL))
    control = ckpt_io.read_checkpoint(v.checkpoint("weights_only", TOTAL))
    diffs = ckpt_io.differences(straight, control)
    assert any(d.startswith("model.") for d in diffs)
    assert any(d.endswith(".master_weight") for d in diffs)
    assert ckpt_io.metrics(v.run_dir("weights_only")) != ckpt_io.metrics(v.run_dir("straight"))


@pytest.mark.parametrize("name", NEGATIVE)
def test_bf16_rounded_masters_are_detected(base, name):
    v = _variant(base, name)
    assert campaign(base)["rounded_masters"][v.name] > 0  # the tampering changed masters
    straight = ckpt_io.read_checkpoint(v.checkpoint("straight", TOTAL))
    control = ckpt_io.read_checkpoint(v.checkpoint("bf16_masters", TOTAL))
    diffs = ckpt_io.differences(straight, control)
    assert any(d.endswith(".master_weight") for d in diffs)
    assert any(d.startswith("model.") for d in diffs)
    # everything else about the resume was right: progress and data position match
    assert control.trainer_state["progress"] == straight.trainer_state["progress"]
    assert control.trainer_state["sampler"] == straight.trainer_state["sampler"]
