"""``pin_to_core`` of ``comparisons/benchmarks/nuts_vs_numpyro.py``: the benchmarks' ``--cpu-core``.

Measured CPU seconds of a JAX sampler include a helper thread on any idle core (docs/benchmarks/
chees.md, "One core each"); pinning must reach threads that already run, not only the caller.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux CPU affinity and two cores")
def test_pin_to_core_pins_threads_that_already_run():
    core = max(os.sched_getaffinity(0))
    code = (
        "import os, sys, threading; sys.path.insert(0, 'comparisons/benchmarks');"
        "from nuts_vs_numpyro import pin_to_core;"
        "stop = threading.Event(); t = threading.Thread(target=stop.wait); t.start();"
        f"pin_to_core({core});"
        "sets = [os.sched_getaffinity(int(tid)) for tid in os.listdir('/proc/self/task')];"
        "stop.set(); t.join(); print(len(sets), sorted({c for s in sets for c in s}))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    count, cores = out.split(" ", 1)
    assert int(count) >= 2  # the main thread and the one started before pinning (torch may add more)
    assert cores.strip() == f"[{core}]"
