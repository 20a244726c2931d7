"""cpu_offload_adamw: chunked streaming through bounded staging equals the resident update bitwise."""

from __future__ import annotations

import pytest
import torch

from tests.optim.helpers import HYPER, make_params, masters, run_variant
from veoptim.config.schema import OptimConfig
from veoptim.errors import ConfigError
from veoptim.optim import (
    EXP_AVG,
    EXP_AVG_SQ,
    MASTER_WEIGHT,
    CPUOffloadAdamW,
    FullFP32AdamW,
    MasterFP32AdamW,
    build_optimizer,
)

STEPS = 6
ALL = len(make_params(torch.float32))


def _offloaded(chunk: int, dtype: torch.dtype, **kw):
    return run_variant(
        lambda g: CPUOffloadAdamW(g, chunk_size=chunk, **kw, **HYPER), STEPS, dtype, ALL
    )


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# The 1024-element parameter: 256 < 1024 (several chunks), 1024 == numel, 4096 > numel;
# 37*29 = 1073 and 1000 leave tail chunks at every chunk size.
@pytest.mark.parametrize("chunk", [256, 1024, 4096, 100])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chunked_offload_equals_resident_update_bitwise(chunk, dtype):
    rp, ro = run_variant(lambda g: FullFP32AdamW(g, **HYPER), STEPS, dtype)
    op, oo = _offloaded(chunk, dtype)
    assert _same(masters(ro, rp), masters(oo, op))
    assert _same([p.detach() for p in rp], [p.detach() for p in op])
    for key in (EXP_AVG, EXP_AVG_SQ):
        assert _same([ro.state[p][key] for p in rp], [oo.state[p][key] for p in op])


def test_offloaded_bf16_moments_equal_master_fp32_adamw_bitwise():
    rp, ro = run_variant(lambda g: MasterFP32AdamW(g, **HYPER), STEPS, torch.bfloat16)
    op, oo = _offloaded(256, torch.bfloat16, offload_moment_dtype=torch.bfloat16)
    assert _same(masters(ro, rp), masters(oo, op))
    assert _same([ro.state[p][EXP_AVG] for p in rp], [oo.state[p][EXP_AVG] for p in op])


def test_offloaded_fp32_param_keeps_a_separate_host_master():
    params, opt = _offloaded(256, torch.float32)
    for p in params:
        assert opt.state[p][MASTER_WEIGHT].data_ptr() != p.data_ptr()
        assert torch.equal(opt.state[p][MASTER_WEIGHT], p.detach())


def test_mixed_groups_use_configured_moment_dtypes_and_devices():
    params, opt = run_variant(
        lambda g: CPUOffloadAdamW(
            g,
            chunk_size=128,
            resident_moment_dtype=torch.bfloat16,
            offload_moment_dtype=torch.float32,
            **HYPER,
        ),
        3,
        torch.bfloat16,
        offload_first=2,
    )
    for i, p in enumerate(params):
        state = opt.state[p]
        expected = torch.float32 if i < 2 else torch.bfloat16
        assert state[EXP_AVG].dtype == state[EXP_AVG_SQ].dtype == expected
        assert state[MASTER_WEIGHT].dtype == torch.float32
        assert state[MASTER_WEIGHT].device.type == "cpu"
        assert p.device.type == "cpu"


def test_staging_is_allocated_once_and_bounded_by_chunk_size():
    params, opt = _offloaded(256, torch.bfloat16, kernel="eager")
    (staging,) = opt._staging.values()
    assert staging.allocations == 3  # two grad slots and one write-back slot, never regrown
    for slot in (*staging._grad, staging._out):
        assert slot.buf.numel() == 256 * 4


def test_cpu_only_offload_with_the_native_kernel_stages_nothing():
    params, opt = _offloaded(256, torch.bfloat16)
    assert all(s.allocations == 0 for s in opt._staging.values())
    eager_params, eager = _offloaded(256, torch.bfloat16, kernel="eager")
    assert _same(params, eager_params)
    assert _same(masters(opt, params), masters(eager, eager_params))


def test_offload_flag_is_not_serialized_into_param_groups():
    params, opt = _offloaded(256, torch.bfloat16)
    assert all("cpu_offload" not in g for g in opt.state_dict()["param_groups"])
    assert all(g["cpu_offload"] for g in opt.param_groups)


def test_state_dict_load_keeps_the_live_offload_placement():
    params, opt = _offloaded(256, torch.bfloat16)
    sd = opt.state_dict()
    fresh_params = make_params(torch.bfloat16)
    fresh = CPUOffloadAdamW(
        [{"params": fresh_params, "cpu_offload": True}], chunk_size=256, **HYPER
    )
    fresh.load_state_dict(sd)
    assert fresh.param_groups[0]["cpu_offload"] is True


def test_non_offload_types_reject_offload_groups():
    with pytest.raises(ConfigError, match="cpu_offload_adamw"):
        FullFP32AdamW([{"params": make_params(torch.bfloat16), "cpu_offload": True}])


def _model() -> torch.nn.Module:
    return torch.nn.ModuleDict(
        {"attn": torch.nn.Linear(8, 8), "mlp": torch.nn.Linear(8, 8), "norm": torch.nn.LayerNorm(8)}
    )


def test_empty_offload_pattern_list_is_rejected():
    with pytest.raises(ConfigError, match="cpu_offload_param_patterns is empty"):
        build_optimizer(_model(), OptimConfig(name="cpu_offload_adamw"))


def test_offload_pattern_matching_nothing_is_rejected_by_name():
    cfg = OptimConfig(name="cpu_offload_adamw", cpu_offload_param_patterns=["mlp", "experts"])
    with pytest.raises(ConfigError, match="'experts' matches no trainable parameter"):
        build_optimizer(_model(), cfg)


def test_builder_offloads_exactly_the_matching_parameters():
    model = _model()
    cfg = OptimConfig(name="cpu_offload_adamw", cpu_offload_param_patterns=[r"^mlp\."])
    opt = build_optimizer(model, cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    offloaded = {names[id(p)] for g in opt.param_groups if g["cpu_offload"] for p in g["params"]}
    assert offloaded == {"mlp.weight", "mlp.bias"}
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert all(p.device.type == "cpu" for p in model.parameters())
