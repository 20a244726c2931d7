"""Write-back of FP32 masters into low-precision parameters.

Round-to-nearest-even is ``Tensor.copy_``. Stochastic rounding (BF16 targets
only) adds counter-based noise to the 16 bits BF16 drops: the noise of an
element is a hash of (seed, step, parameter ordinal, global element index), so
it is reproducible after a resume and independent of chunking, device and
thread count, and needs no saved RNG state.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_LOW16 = 0xFFFF
# 64-bit mixing constants (splitmix64 finaliser), as signed int64 values.
_C1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_C2 = 0x94D049BB133111EB - (1 << 64)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)


def _wrap64(x: int) -> int:
    """Reduce a Python int to the signed int64 range (two's complement)."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= (1 << 63) else x


def noise_key(seed: int, step: int, ordinal: int) -> int:
    """A 64-bit key that differs for every (seed, step, parameter) triple."""
    return _wrap64(seed * 0x100000001B3 + step * _GOLDEN + ordinal * 0x2545F4914F6CDD1D)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 tensors (logical shifts emulated by masking)."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _C1
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _C2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def stochastic_round_bf16_(
    dst: torch.Tensor, src: torch.Tensor, key: int, first_index: int
) -> None:
    """Write ``src`` (FP32, 1-D) into ``dst`` (BF16, 1-D) with stochastic rounding.

    ``first_index`` is the global flat index of ``src[0]``; together with ``key`` it
    fixes the noise, so any split of a tensor into segments gives the same bits.
    """
    idx = torch.arange(src.numel(), dtype=torch.int64, device=src.device) + (first_index + key)
    noise = _mix(_mix(idx)) & _LOW16
    bits = (src.view(torch.int32).to(torch.int64) & _MASK32) + noise
    bf16_bits = ((bits >> 16) & _LOW16).to(torch.int32)
    # int32 -> int16 keeps the low 16 bits (two's complement), i.e. the BF16 bit pattern.
    rounded = bf16_bits.to(torch.int16).view(torch.bfloat16)
    # NaN payloads may carry past the sign bit; keep NaN as NaN.
    dst.copy_(torch.where(torch.isnan(src), src.to(torch.bfloat16), rounded))


def write_back_(
    dst: list[torch.Tensor],
    src: list[torch.Tensor],
    *,
    stochastic: bool,
    keys: list[int] | None = None,
    first_indices: list[int] | None = None,
) -> None:
    """Copy FP32 master segments into parameter segments (RNE, or SR for BF16 targets)."""
    if not stochastic:
        torch._foreach_copy_(dst, src)
        return
    assert keys is not None and first_indices is not None
    for d, s, k, i in zip(dst, src, keys, first_indices, strict=True):
        if d.dtype == torch.bfloat16:
            stochastic_round_bf16_(d, s, k, i)
        else:
            d.copy_(s)
