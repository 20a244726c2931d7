"""The accelerator check must not pass on a machine where CUDA is missing."""

from __future__ import annotations

import os

import pytest
import torch


def test_cuda_is_available_when_required():
    if os.environ.get("VEOPTIM_REQUIRE_CUDA", "") in ("", "0"):
        pytest.skip("VEOPTIM_REQUIRE_CUDA is not set")
    assert torch.cuda.is_available(), (
        "VEOPTIM_REQUIRE_CUDA=1 but torch.cuda.is_available() is False "
        f"(torch {torch.__version__}, built with CUDA {torch.version.cuda})"
    )
    torch.ones(1, device="cuda").add_(1)  # a kernel actually runs
