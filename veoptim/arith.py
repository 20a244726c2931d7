"""Small integer helpers with no dependencies, shared by the data and distributed checks.

Kept apart so ``veoptim.data`` can use them without importing config, models or torch.
"""

from __future__ import annotations


def divisors(n: int) -> list[int]:
    """Every positive divisor of ``n`` in increasing order: the valid choices that errors list."""
    return [d for d in range(1, n + 1) if n % d == 0]
