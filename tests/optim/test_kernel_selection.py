"""One door to the update kernels: ``kernels.select`` picks what ``kernel=`` and the batch
ask for, and every exact optimizer step goes through it."""

from __future__ import annotations

import pytest
import torch

from veoptim.errors import ConfigError
from veoptim.optim import kernels
from veoptim.optim.kernels import CompiledKernel, EagerKernel, NativeKernel, Scratch, UpdateBatch
from veoptim.optim.kernels.native import native_kernel


def _batch(dtype: torch.dtype, out: bool = True) -> UpdateBatch:
    n = 64
    return UpdateBatch(
        masters=[torch.zeros(n)],
        grads=[torch.ones(n, dtype=dtype)],
        exp_avgs=[torch.zeros(n, dtype=dtype)],
        exp_avg_sqs=[torch.zeros(n, dtype=dtype)],
        steps=[torch.tensor(1.0)],
        outs=[torch.zeros(n, dtype=dtype)] if out else [None],
        sr_keys=[],
        sr_offsets=[],
    )


def _select(kernel: str, batch: UpdateBatch, sr: bool = False) -> kernels.Kernel:
    return kernels.select(kernel, batch, stochastic_rounding=sr, scratch=Scratch(), chunk=1024)


def test_auto_takes_the_native_kernel_for_a_cpu_batch_with_something_to_convert():
    if native_kernel() is None:
        pytest.skip("no C compiler for the native kernel on this machine")
    assert isinstance(_select("auto", _batch(torch.bfloat16)), NativeKernel)


def test_auto_leaves_an_all_fp32_batch_to_torchs_fused_call():
    assert isinstance(_select("auto", _batch(torch.float32, out=False)), EagerKernel)


@pytest.mark.parametrize("kernel", ["auto", "compiled"])
def test_stochastic_rounding_always_takes_the_eager_kernel(kernel):
    chosen = _select(kernel, _batch(torch.bfloat16), sr=True)
    assert isinstance(chosen, EagerKernel) and chosen.stochastic_rounding


def test_eager_and_compiled_are_what_they_say():
    assert isinstance(_select("eager", _batch(torch.bfloat16)), EagerKernel)
    assert isinstance(_select("compiled", _batch(torch.bfloat16)), CompiledKernel)


def test_offloaded_batches_get_the_host_kernel_or_the_eager_one_for_the_chunk_loop():
    if native_kernel() is None:
        pytest.skip("no C compiler for the native kernel on this machine")

    def host(kernel: str, sr: bool = False) -> kernels.Kernel:
        return kernels.select_host(
            kernel, _batch(torch.bfloat16), stochastic_rounding=sr, scratch=Scratch(), chunk=64
        )

    assert isinstance(host("auto"), NativeKernel) and host("auto").one_pass
    for eager in (host("eager"), host("auto", sr=True)):  # stochastic rounding: eager only
        assert isinstance(eager, EagerKernel) and not eager.one_pass


def test_an_unknown_kernel_is_refused_naming_the_choices():
    with pytest.raises(ConfigError, match=r"kernel must be one of \['auto', 'eager', 'compiled'\]"):
        kernels.check_kernel("fast")


def test_every_kernel_gives_the_eager_update_of_a_bf16_batch():
    """The door changes who computes, never the result: native is bitwise eager on CPU."""
    if native_kernel() is None:
        pytest.skip("no C compiler for the native kernel on this machine")
    hp = kernels.Hyper(1e-2, 0.9, 0.999, 1e-8, 0.01, False)
    results = {}
    for name in ("auto", "eager"):
        batch = _batch(torch.bfloat16)
        batch.grads[0].copy_(torch.linspace(-1, 1, 64))
        _select(name, batch).update_(batch, hp)
        results[name] = (batch.masters[0], batch.exp_avg_sqs[0], batch.outs[0])
    assert all(torch.equal(a, b) for a, b in zip(results["auto"], results["eager"], strict=True))
