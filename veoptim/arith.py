"""Small number helpers with no dependencies, shared by the data, distributed and config checks.

Kept apart so ``veoptim.data`` can use them without importing config, models or torch.
"""

from __future__ import annotations

import math


def divisors(n: int) -> list[int]:
    """Every positive divisor of ``n`` in increasing order: the valid choices that errors list."""
    return [d for d in range(1, n + 1) if n % d == 0]


def is_power_of_two(x: object) -> bool:
    """``x`` is a finite positive number 2**k (k any integer): what a loss scale must be,
    so scaling by it and unscaling are exact."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    return 0 < x < float("inf") and math.frexp(x)[0] == 0.5
