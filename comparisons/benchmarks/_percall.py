"""A shared timing helper of the per-call kernel benchmarks (``flat_kernel_pair.py``, ``inference_mode.py``)."""

from __future__ import annotations

import time
from typing import Callable


def cpu_us_per_call(fn: Callable[[], object], calls: int, warmup: int) -> float:
    """Process CPU microseconds per call of ``fn`` over ``calls`` calls, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    start = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - start) / calls * 1e6
