"""CUDA paths of the optimizers that a CPU-only run cannot exercise: skipped without a GPU.

Offload on CUDA streams gradients device -> pinned host slot -> host kernel -> pinned
slot -> device with non-blocking copies and events. Its host arithmetic is the CPU
run's, so the result must be bitwise the same as the same update on CPU: any race on a
reused slot (a copy not yet landed, a slot overwritten too early) breaks the equality.
Run on a GPU machine with ``pytest -q tests/accelerator``.
"""

from __future__ import annotations

import pytest
import torch

from tests.optim.helpers import HYPER, make_params, masters, run_reference, set_grads
from veoptim.optim import EXP_AVG, EXP_AVG_SQ, CPUOffloadAdamW, FullFP32AdamW

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")
STEPS = 8


def _train(device: torch.device, factory, dtype: torch.dtype, offload: bool):
    params = [torch.nn.Parameter(p.detach().to(device)) for p in make_params(dtype)]
    opt = factory([{"params": params, "cpu_offload": True}] if offload else [{"params": params}])
    for step in range(STEPS):
        set_grads(params, step, dtype)  # CPU-drawn gradients, on the parameter's device
        opt.step()
    torch.cuda.synchronize()
    return params, opt


@pytest.mark.parametrize("kernel", ["auto", "eager"])  # host update: native / eager engine
@pytest.mark.parametrize("chunk", [96, 256, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_offload_on_cuda_is_bitwise_the_same_update_on_cpu(chunk, dtype, kernel):
    def factory(groups, kernel=kernel):
        return CPUOffloadAdamW(groups, chunk_size=chunk, kernel=kernel, **HYPER)

    gp, go = _train(CUDA, factory, dtype, offload=True)
    cp, co = _train(torch.device("cpu"), lambda g: factory(g, "eager"), dtype, offload=True)
    for g, c in zip(gp, cp, strict=True):
        assert g.device.type == "cuda", "the compute parameter must stay on its device"
        assert torch.equal(g.detach().cpu(), c.detach())
        for key in (EXP_AVG, EXP_AVG_SQ):
            assert go.state[g][key].device.type == "cpu"
            assert torch.equal(go.state[g][key], co.state[c][key])
    assert all(torch.equal(a, b) for a, b in zip(masters(go, gp), masters(co, cp), strict=True))
    staging = go._staging[gp[0].device]
    slots = [*staging._grad, staging._out]
    assert all(s.buf is not None and s.buf.is_pinned() for s in slots)
    assert staging.allocations == 3, "slots are allocated once and reused"


def test_resident_cuda_update_tracks_the_fp32_reference():
    params, opt = _train(CUDA, lambda g: FullFP32AdamW(g, **HYPER), torch.bfloat16, offload=False)
    ref_params, _ = run_reference(STEPS, torch.bfloat16)
    for p, m, r in zip(params, masters(opt, params), ref_params, strict=True):
        torch.testing.assert_close(m.cpu(), r.detach(), rtol=1e-6, atol=1e-7)
        assert torch.equal(p.detach(), m.to(torch.bfloat16)), "BF16 param = RNE of the master"


def test_sft_trains_and_round_trips_a_checkpoint_on_cuda(tmp_path):
    from tests.checkpoint.ckpt_state import (
        assert_bitwise_equal,
        build_trainer,
        load_with,
        save_with,
        snapshot,
    )
    from veoptim.checkpoint.checkpointer import Checkpointer
    from veoptim.distributed import init_distributed

    overrides = ["run.device=cuda"]
    ctx = init_distributed("cuda", "auto", {})
    writer = build_trainer(tmp_path / "w", overrides, ctx)
    losses = [writer.train_step()["loss"] for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(losses)))
    save_with(Checkpointer(tmp_path / "ckpt", fsync=False), writer, "step_3")
    reader = build_trainer(tmp_path / "r", overrides, ctx)
    load_with(Checkpointer(tmp_path / "ckpt", fsync=False), reader, "step_3")
    before, after = snapshot(writer), snapshot(reader)
    assert_bitwise_equal(before["params"], after["params"], "params")
    assert_bitwise_equal(before["state"], after["state"], "optimizer state")
