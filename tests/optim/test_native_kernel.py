"""The CPU mixed-dtype kernel (native/adamw.c) is bitwise the eager engine, and is used.

Every case trains the same parameters twice, ``kernel="auto"`` (the native kernel on
CPU) and ``kernel="eager"`` (torch's fused kernel on widened operands), and compares
parameters, masters, moments and step counters with ``torch.equal``. A build whose
arithmetic differs (the compiler allowed to contract multiply-adds) is caught by the
kernel's own check, so a miscompiled kernel can never run.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess

import pytest
import torch

from tests.optim.helpers import HYPER
from veoptim.optim import (
    EXP_AVG,
    EXP_AVG_SQ,
    MASTER_WEIGHT,
    STEP,
    CPUOffloadAdamW,
    FullFP32AdamW,
    MasterFP32AdamW,
)
from veoptim.optim.kernels import native as nk

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler (cc)"),
]

#: Odd sizes (vector tails), and one tensor large enough to be split over threads.
SHAPES = [(37, 29), (1000,), (3, 5, 7), (nk.PARALLEL_MIN_NUMEL * 3 + 45,)]
STEPS = 30


def _grads(step: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    scale = 10.0 ** -(step % 5)
    return [(torch.randn(s, generator=g) * scale).to(dtype) for s in SHAPES]


def _train(factory, dtype: torch.dtype, kernel: str, offload: bool, threads: int = 2):
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]
    groups = [{"params": params[:2], "cpu_offload": True}, {"params": params[2:]}]
    opt = factory(groups if offload else params, kernel)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for step in range(STEPS):
            for p, grad in zip(params, _grads(step, dtype), strict=True):
                p.grad = grad
            opt.step()
    finally:
        torch.set_num_threads(before)
    return params, opt


def _assert_bitwise(a, b) -> None:
    (pa, oa), (pb, ob) = a, b
    for p, q in zip(pa, pb, strict=True):
        assert torch.equal(p, q)
        for key in (MASTER_WEIGHT, EXP_AVG, EXP_AVG_SQ, STEP):
            assert torch.equal(oa.state[p][key], ob.state[q][key]), key


VARIANTS = {
    "full_fp32": lambda g, k, **kw: FullFP32AdamW(g, kernel=k, **{**HYPER, **kw}),
    "master_fp32": lambda g, k, **kw: MasterFP32AdamW(g, kernel=k, **{**HYPER, **kw}),
    "offload": lambda g, k, **kw: CPUOffloadAdamW(g, kernel=k, chunk_size=5000, **{**HYPER, **kw}),
}


def test_the_kernel_builds_and_passes_its_check_here():
    assert nk.native_kernel() is not None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_native_steps_are_bitwise_the_eager_engine(variant, dtype):
    factory = VARIANTS[variant]
    offload = variant == "offload"
    native = _train(factory, dtype, "auto", offload)
    eager = _train(factory, dtype, "eager", offload)
    _assert_bitwise(native, eager)
    if dtype == torch.bfloat16 and not offload:
        assert not native[1]._scratch._buffers, "the native kernel widens nothing into scratch"
        assert eager[1]._scratch._buffers


@pytest.mark.parametrize(
    "hyper",
    [
        dict(betas=(0.3, 0.999)),  # lerp weight >= 0.5: torch's other lerp form
        dict(maximize=True, weight_decay=0.0),
        dict(lr=torch.tensor(3e-4)),
    ],
    ids=["small_beta1", "maximize_no_decay", "tensor_lr"],
)
def test_other_hyperparameters_are_bitwise_too(hyper):
    def factory(g, k):
        return MasterFP32AdamW(g, kernel=k, **{**HYPER, **hyper})

    _assert_bitwise(
        _train(factory, torch.bfloat16, "auto", False),
        _train(factory, torch.bfloat16, "eager", False),
    )


@pytest.mark.parametrize("threads", [1, 3])
def test_thread_count_does_not_change_the_result(threads):
    """The OpenMP threads share the elements: one skipped or updated twice would differ."""
    factory = VARIANTS["master_fp32"]
    _assert_bitwise(
        _train(factory, torch.bfloat16, "auto", False, threads=threads),
        _train(factory, torch.bfloat16, "eager", False, threads=2),
    )


def test_stochastic_rounding_and_plain_fp32_keep_their_engines(monkeypatch):
    params = [torch.nn.Parameter(torch.randn(100).bfloat16())]
    opt = FullFP32AdamW(params, stochastic_rounding=True, **HYPER)
    params[0].grad = torch.randn(100).bfloat16()
    opt.step()
    assert opt._scratch._buffers, "stochastic rounding's noise lives in the eager engine"
    monkeypatch.setattr(nk, "_KERNEL", [])  # nothing loaded yet in this "process"
    fp32 = [torch.nn.Parameter(torch.randn(100))]
    opt = FullFP32AdamW(fp32, **HYPER)
    fp32[0].grad = torch.randn(100)
    opt.step()
    assert nk._KERNEL == [], "an FP32 step (torch's one fused call) never builds the kernel"


def test_a_differently_compiled_kernel_fails_the_check(tmp_path):
    """Negative control: let the compiler contract multiply-adds and the check sees it."""
    flags = tuple(f if f != "-ffp-contract=off" else "-ffp-contract=fast" for f in nk.CFLAGS)
    kernel = nk.NativeKernel(nk.build(directory=tmp_path, flags=flags))
    assert "differ" in nk.differences(kernel)


def test_without_a_compiler_the_eager_engine_runs(monkeypatch, caplog, tmp_path):
    with pytest.raises(subprocess.CalledProcessError):
        nk.build(compiler="false", directory=tmp_path)
    build = nk.build
    monkeypatch.setattr(nk, "build", lambda: build(compiler=str(tmp_path / "no-cc")))
    monkeypatch.setattr(nk, "_KERNEL", [])
    with caplog.at_level(logging.INFO, logger=nk.LOG.name):
        assert nk.native_kernel() is None
    assert "could not be built" in caplog.text
    native = _train(VARIANTS["full_fp32"], torch.bfloat16, "auto", False)
    assert native[1]._scratch._buffers, "the eager engine ran"


def test_a_build_is_reused_from_the_cache(tmp_path):
    first = nk.build(directory=tmp_path)
    stamp = first.stat().st_mtime_ns
    assert nk.build(directory=tmp_path) == first and first.stat().st_mtime_ns == stamp
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([first.name, ".build.lock"]), "no temporary file left"


def test_without_a_home_directory_the_cache_is_a_private_temporary_one(monkeypatch):
    def no_home():
        raise RuntimeError("Could not determine home directory")

    monkeypatch.setattr(nk.Path, "home", staticmethod(no_home))
    assert nk.cache_dir().name == f"veoptim-kernels-{os.getuid()}"


def test_a_cache_others_can_write_to_is_refused(tmp_path):
    """A library from a directory another user can write to could be anyone's code."""
    tmp_path.chmod(0o777)
    with pytest.raises(PermissionError, match="only this user"):
        nk.build(directory=tmp_path)
