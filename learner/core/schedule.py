"""Which optimizer steps are rollout matching (channel B) and which teacher-force the ground truth (channel A).

`is_channel_b(k, ratio)`: E-step `k` (0-based; the optimizer step when the rollout buffer is off) is channel B
exactly when floor((k + 1) * ratio) > floor(k * ratio). Deterministic and a function of the step alone, so a
resumed run continues the same schedule, and B steps are spread evenly (ratio 0.25: A A A B A A A B ...;
0.75: A B B B ...). ratio 0: never; 1: every step. Warm-start steps come before and are always channel A.
"""

from __future__ import annotations

import math


def is_channel_b(k: int, ratio: float) -> bool:
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"channel B ratio must be in [0, 1], got {ratio}")
    if k < 0:
        raise ValueError(f"step index must be >= 0, got {k}")
    # Exact in binary floating point for the ratios people write (0.05, 0.25, 0.75): a tiny epsilon keeps
    # floor(20 * 0.05) at 1 however the product rounds.
    return math.floor((k + 1) * ratio + 1e-9) > math.floor(k * ratio + 1e-9)
