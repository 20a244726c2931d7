"""Each exact-precision variant tracks an FP32 torch.optim.AdamW reference; BF16 AdamW does not."""

from __future__ import annotations

import pytest
import torch

from tests.optim.helpers import (
    HYPER,
    make_params,
    masters,
    run_reference,
    run_variant,
    set_grads,
)
from veoptim.errors import ConfigError
from veoptim.optim import (
    EXP_AVG,
    MASTER_WEIGHT,
    STEP,
    CPUOffloadAdamW,
    FullFP32AdamW,
    MasterFP32AdamW,
)

pytestmark = pytest.mark.slow

STEPS = 100

VARIANTS = {
    "full_fp32_adamw": (lambda g: FullFP32AdamW(g, **HYPER), False, 0),
    "master_fp32_adamw": (lambda g: MasterFP32AdamW(g, **HYPER), True, 0),
    "cpu_offload_adamw": (lambda g: CPUOffloadAdamW(g, chunk_size=256, **HYPER), False, 2),
    "cpu_offload_adamw_bf16_moments": (
        lambda g: CPUOffloadAdamW(
            g,
            chunk_size=256,
            resident_moment_dtype=torch.bfloat16,
            offload_moment_dtype=torch.bfloat16,
            **HYPER,
        ),
        True,
        3,
    ),
}


@pytest.fixture(scope="module")
def references() -> dict[bool, list[torch.Tensor]]:
    return {
        bf16: [p.detach().clone() for p in run_reference(STEPS, torch.bfloat16, bf16)[0]]
        for bf16 in (False, True)
    }


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_bf16_params_master_tracks_fp32_reference_over_100_steps(name, references):
    factory, bf16_moments, offload_first = VARIANTS[name]
    params, opt = run_variant(factory, STEPS, torch.bfloat16, offload_first)
    for master, ref in zip(masters(opt, params), references[bf16_moments], strict=True):
        assert master.dtype == torch.float32
        torch.testing.assert_close(master, ref, rtol=1e-6, atol=1e-7)
    for p in params:
        assert float(opt.state[p][STEP]) == STEPS


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_bf16_params_equal_round_to_nearest_of_master(name):
    factory, _, offload_first = VARIANTS[name]
    params, opt = run_variant(factory, 7, torch.bfloat16, offload_first)
    for p in params:
        assert torch.equal(p.detach(), opt.state[p][MASTER_WEIGHT].to(torch.bfloat16))


def test_master_fp32_adamw_keeps_bf16_moments():
    params, opt = run_variant(VARIANTS["master_fp32_adamw"][0], 2, torch.bfloat16)
    assert all(opt.state[p][EXP_AVG].dtype == torch.bfloat16 for p in params)


def test_fp32_params_are_their_own_master_and_match_torch_adamw_bitwise():
    params, opt = run_variant(VARIANTS["full_fp32_adamw"][0], 20, torch.float32)
    ref, _ = run_reference(20, torch.float32)
    for p, r in zip(params, ref, strict=True):
        assert opt.state[p][MASTER_WEIGHT].data_ptr() == p.data_ptr()
        assert torch.equal(p.detach(), r.detach())


def test_plain_bf16_adamw_loses_small_updates_that_masters_keep():
    """Negative control: at a small LR a BF16 AdamW leaves most weights unchanged."""
    lr, steps = 1e-5, 10
    bf16 = make_params(torch.bfloat16)
    plain = torch.optim.AdamW(bf16, lr=lr, weight_decay=0.0)
    exact_params = make_params(torch.bfloat16)
    exact = FullFP32AdamW(exact_params, lr=lr, weight_decay=0.0)
    start = [p.detach().clone() for p in make_params(torch.bfloat16)]
    for step in range(steps):
        set_grads(bf16, step, torch.bfloat16)
        set_grads(exact_params, step, torch.bfloat16)
        plain.step()
        exact.step()
    total = sum(p.numel() for p in bf16)
    moved_plain = sum(int((p.detach() != s).sum()) for p, s in zip(bf16, start, strict=True))
    moved_master = sum(
        int((exact.state[p][MASTER_WEIGHT] != s.float()).sum())
        for p, s in zip(exact_params, start, strict=True)
    )
    assert moved_master >= 0.99 * total
    assert moved_plain < 0.2 * total


def test_maximize_matches_torch_reference():
    params, opt = run_variant(
        lambda g: FullFP32AdamW(g, maximize=True, **HYPER), 10, torch.bfloat16
    )
    ref, _ = run_reference(10, torch.bfloat16, maximize=True)
    for m, r in zip(masters(opt, params), ref, strict=True):
        torch.testing.assert_close(m, r.detach(), rtol=1e-6, atol=1e-7)


def test_amsgrad_is_rejected_with_a_clear_error():
    with pytest.raises(ConfigError, match="amsgrad"):
        FullFP32AdamW(make_params(torch.bfloat16), amsgrad=True)


def test_float64_params_are_rejected():
    with pytest.raises(ConfigError, match="dtype"):
        FullFP32AdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))])


def test_fused_chunk_size_does_not_change_results():
    """The resident path batches narrow operands; any chunk size gives the same bits."""
    runs = [
        run_variant(
            lambda g, c=c: MasterFP32AdamW(g, fused_chunk_size=c, **HYPER), 5, torch.bfloat16
        )
        for c in (64, 1000, 1 << 20)
    ]
    for (p0, o0), (p1, o1) in zip(runs, runs[1:], strict=False):
        for a, b in zip(masters(o0, p0) + p0, masters(o1, p1) + p1, strict=True):
            assert torch.equal(a, b)
