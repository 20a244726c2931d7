"""The compiled mixed-dtype AdamW kernel on CUDA: selected by default, tracking the FP32 reference.

``kernel="auto"`` compiles the update on cuda (one kernel per tensor reading and
writing every byte once). Its masters are compared with ``torch.optim.AdamW`` in FP32
(fused, on the CPU: the reference of every exactness test) at the tolerances of
``tests/optim/test_compiled_kernel.py``. Not with the eager engine on CUDA: that is torch's
CUDA fused kernel, which itself differs from the CPU reference by up to 3.3e-6 (1.6e-6
relative) after 30 steps on an H200, more than the compiled kernel does
(docs/benchmarks.md). Skipped without a GPU (a failure under ``VEOPTIM_REQUIRE_CUDA=1``).
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.optim.helpers import HYPER, make_params, masters, run_reference, set_grads
from veoptim.optim import EXP_AVG, EXP_AVG_SQ, FullFP32AdamW, MasterFP32AdamW
from veoptim.optim.kernels import compiled as ck

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")
STEPS = 30
#: (class, parameter dtype, master tolerance (rtol, atol), BF16 moments)
CASES = {
    "full_fp32_bf16": (FullFP32AdamW, torch.bfloat16, (1e-6, 1e-7), False),
    "master_fp32_bf16": (MasterFP32AdamW, torch.bfloat16, (1e-5, 2e-5), True),
    "master_fp32_fp32": (MasterFP32AdamW, torch.float32, (1e-5, 2e-5), True),
}


def _train(cls, dtype: torch.dtype, kernel: str):
    params = [torch.nn.Parameter(p.detach().to(CUDA)) for p in make_params(dtype)]
    opt = cls(params, kernel=kernel, **HYPER)
    for step in range(STEPS):
        set_grads(params, step, dtype)
        opt.step()
    torch.cuda.synchronize()
    return params, opt


@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_kernel_on_cuda_tracks_the_fp32_reference(case):
    cls, dtype, (rtol, atol), bf16_moments = CASES[case]
    cp, co = _train(cls, dtype, "auto")
    assert ck._COMPILED.get("cuda") is not None, "auto must compile on cuda"
    assert not co._scratch._buffers, "the compiled path widens nothing into scratch"
    reference, _ = run_reference(STEPS, dtype, bf16_moments=bf16_moments)
    for a, b in zip(masters(co, cp), reference, strict=True):
        torch.testing.assert_close(a.cpu(), b.detach(), rtol=rtol, atol=atol)
    ep, eo = _train(cls, dtype, "eager")
    for p, q in zip(cp, ep, strict=True):
        assert torch.equal(p.detach(), co.state[p]["master_weight"].to(dtype)) or dtype == (
            torch.float32
        )
        for key in (EXP_AVG, EXP_AVG_SQ):
            assert co.state[p][key].dtype == eo.state[q][key].dtype


def test_compiled_kernel_resumes_bitwise_on_cuda():
    """Resume runs the same kernel on both sides: a reloaded optimizer steps bitwise alike."""
    params, opt = _train(MasterFP32AdamW, torch.bfloat16, "auto")
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin_opt = MasterFP32AdamW(twin, **HYPER)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # its own tensors, not aliases
    for step in range(STEPS, STEPS + 3):
        for group in (params, twin):
            set_grads(group, step, torch.bfloat16)
        opt.step()
        twin_opt.step()
    for a, b in zip(params, twin, strict=True):
        assert torch.equal(a, b)
        assert torch.equal(opt.state[a]["master_weight"], twin_opt.state[b]["master_weight"])
