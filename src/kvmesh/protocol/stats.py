"""The one percentile every kvmesh figure uses (bench over HTTP, sim in virtual time).

Linear interpolation between the two closest ranks: numpy's default method ("linear", type 7 of
Hyndman and Fan), which is what vLLM's benchmark_serving and inference-perf report, so a kvmesh
p99 compares with theirs. The median is the same definition at q = 50.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (q in 0..100) of `values`, linearly interpolated; 0.0 for no values
    (as vLLM's benchmark reports an empty set)."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    data = np.fromiter(values, dtype=float)
    if data.size == 0:
        return 0.0
    return float(np.percentile(data, q, method="linear"))
