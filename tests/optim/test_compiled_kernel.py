"""CPU reference of the compiled accelerator kernel: the same function, uncompiled.

``kernels.compiled.adamw_mixed_`` is what ``torch.compile`` turns into one kernel on
cuda/npu. Here it runs eagerly on CPU (installed as the CPU "compiled" kernel) and
is compared with the eager engine (torch's fused kernel on widened operands).
Not bitwise: FMA contraction and operation order differ in the last bit. Stated
tolerances, over 100 steps of gradients spanning five decades:

- FP32 moments: masters within rtol 1e-6 / atol 1e-7 (the FP32-reference tolerance
  of test_exactness.py); moments within rtol 1e-5.
- BF16 moments: a last-bit difference of the FP32 moment can flip its BF16
  rounding (one BF16 ulp, 2^-8 relative, of that step's update), so masters are
  within rtol 1e-5 / atol 2e-5 (lr 1e-3).
- BF16 parameters are always bitwise RNE(master).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from tests.optim.helpers import HYPER, masters, run_variant
from veoptim.errors import ConfigError
from veoptim.optim import (
    EXP_AVG,
    EXP_AVG_SQ,
    MASTER_WEIGHT,
    FullFP32AdamW,
    MasterFP32AdamW,
)
from veoptim.optim.kernels import compiled as ck

STEPS = 100
CASES = {
    "full_fp32_bf16": (FullFP32AdamW, torch.bfloat16, (1e-6, 1e-7)),
    "full_fp32_fp32": (FullFP32AdamW, torch.float32, (0.0, 0.0)),  # plain fused call: bitwise
    "master_fp32_bf16": (MasterFP32AdamW, torch.bfloat16, (1e-5, 2e-5)),
    "master_fp32_fp32": (MasterFP32AdamW, torch.float32, (1e-5, 2e-5)),
}


@pytest.fixture
def reference_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The uncompiled kernel function as the CPU kernel of ``kernel="compiled"``."""
    monkeypatch.setitem(ck._COMPILED, "cpu", ck.adamw_mixed_)


def _run(cls, dtype: torch.dtype, kernel: str, steps: int = STEPS, **kw):
    return run_variant(lambda g: cls(g, kernel=kernel, **kw, **HYPER), steps, dtype)


@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_kernel_tracks_the_eager_engine(case, reference_kernel):
    cls, dtype, (rtol, atol) = CASES[case]
    cp, co = _run(cls, dtype, "compiled")
    ep, eo = _run(cls, dtype, "eager")
    assert not co._scratch._buffers, "the kernel reads narrow operands directly"
    for a, b in zip(masters(co, cp), masters(eo, ep), strict=True):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
    for p, q in zip(cp, ep, strict=True):
        assert torch.equal(p.detach(), co.state[p][MASTER_WEIGHT].to(dtype))
        for key in (EXP_AVG, EXP_AVG_SQ):
            a, b = co.state[p][key], eo.state[q][key]
            assert a.dtype == b.dtype
            if b.dtype == torch.float32:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-12)


def test_reference_kernel_is_deterministic_so_resume_stays_bitwise(reference_kernel):
    params, opt = _run(MasterFP32AdamW, torch.bfloat16, "compiled", steps=5)
    twin_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin = MasterFP32AdamW(twin_params, kernel="compiled", **HYPER)
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    g = torch.Generator().manual_seed(7)
    for _ in range(3):
        for p, q in zip(params, twin_params, strict=True):
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
            q.grad = p.grad.clone()
        opt.step()
        twin.step()
    for p, q in zip(params, twin_params, strict=True):
        assert torch.equal(p, q)
        for key in (MASTER_WEIGHT, EXP_AVG, EXP_AVG_SQ):
            assert torch.equal(opt.state[p][key], twin.state[q][key])


def test_auto_selects_the_compiled_kernel_on_accelerators_only(monkeypatch):
    monkeypatch.setattr(ck, "_COMPILED", {})
    assert not ck.use_compiled("auto", "cpu", sr=False)
    assert ck.use_compiled("compiled", "cpu", sr=False)
    for device_type in ("cuda", "npu"):
        assert ck.use_compiled("auto", device_type, sr=False)
        assert not ck.use_compiled("eager", device_type, sr=False)
        assert not ck.use_compiled("auto", device_type, sr=True), "stochastic rounding stays eager"
    ck._COMPILED["npu"] = None  # its compilation failed once: eager from then on
    assert not ck.use_compiled("auto", "npu", sr=False)


def test_default_cpu_step_does_not_compile_and_eager_widens_into_scratch():
    params, opt = _run(FullFP32AdamW, torch.bfloat16, "eager", steps=1)
    assert opt._scratch._buffers, "the eager engine widens into scratch"
    assert not ck.use_compiled("auto", "cpu", sr=False)


def test_kernel_setting_is_validated_and_survives_deepcopy():
    with pytest.raises(ConfigError, match="kernel"):
        FullFP32AdamW([torch.nn.Parameter(torch.zeros(4))], kernel="triton")
    opt = FullFP32AdamW([torch.nn.Parameter(torch.zeros(4))], kernel="eager")
    assert copy.deepcopy(opt).kernel == "eager"


def test_a_kernel_that_fails_to_compile_falls_back_to_eager_with_a_warning(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("no inductor backend for this device")

    monkeypatch.setitem(ck._COMPILED, "cpu", broken)
    with caplog.at_level(logging.WARNING, logger=ck.LOG.name):
        cp, co = _run(FullFP32AdamW, torch.bfloat16, "compiled", steps=3)
    ep, eo = _run(FullFP32AdamW, torch.bfloat16, "eager", steps=3)
    assert "using the eager engine" in caplog.text
    assert ck._COMPILED["cpu"] is None
    assert all(torch.equal(a, b) for a, b in zip(masters(co, cp), masters(eo, ep), strict=True))


@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16])
def test_kernel_traces_as_one_dynamic_graph(moment_dtype):
    """What cuda/npu compile: one graph for any length (fullgraph, dynamic), same values.

    ``aot_eager`` traces and functionalizes like inductor without generating code, so
    it runs quickly on CPU; the values are bitwise the uncompiled function's.
    """
    fn = torch.compile(ck.adamw_mixed_, backend="aot_eager", fullgraph=True, dynamic=True)
    for n in (77, 1000, 4096):
        g = torch.Generator().manual_seed(n)
        master = torch.randn(n, generator=g)
        grad = (torch.randn(n, generator=g) * 1e-3).bfloat16()
        m = (torch.randn(n, generator=g) * 1e-3).to(moment_dtype)
        v = (torch.rand(n, generator=g) * 1e-6).to(moment_dtype)
        state = [master, m, v, master.bfloat16()]
        ref = [t.clone() for t in state]
        scalars = (torch.tensor(3.0), torch.tensor(1e-3, dtype=torch.float64), 0.9, 0.999, 1e-8)
        ck.adamw_mixed_(ref[0], grad, ref[1], ref[2], ref[3], *scalars, 0.1, False)
        fn(state[0], grad, state[1], state[2], state[3], *scalars, 0.1, False)
        assert all(torch.equal(a, b) for a, b in zip(state, ref, strict=True))
