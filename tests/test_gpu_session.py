"""``comparisons/benchmarks/gpu_session.sh --smoke``: the lent-GPU call's every phase, on the CPU at tiny sizes.

A device machine is lent for minutes and never to CI, so the script it runs must be known to work
before the call: this runs it end to end on the CPU (the CUDA tests' command, the quickstart's cells on
both "devices", each sampler of ``chees_vs_blackjax.py`` at one K, the table, the packing).  Without
the benchmark extra (JAX, NumPyro, BlackJAX) the JAX samplers must say they were not run and the rest
must still work.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HAVE_JAX = all(importlib.util.find_spec(m) is not None for m in ("jax", "numpyro", "blackjax"))


@pytest.mark.slow
def test_gpu_session_smoke(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work"), "BUDGET_S": "600",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.run(["bash", "comparisons/benchmarks/gpu_session.sh", "--smoke"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out, work = tmp_path / "out", tmp_path / "work"
    phases = (work / "phases.log").read_text()
    assert "CUDA tests: rc 0" in phases, phases
    assert "quickstart on cpu (twin): rc 0" in phases, phases
    # the twin's cells: the filtered cell and the reference it pulls in, each with a result
    cells = sorted(p.parent.name for p in (work / "qs_cpu" / "cells").glob("*/result.json"))
    assert cells == ["blr__chees__split-0__seed-0", "blr__map__split-0__seed-0"], cells
    rows = [json.loads(s) for s in (out / "samplers.jsonl").read_text().splitlines()]
    ran = {r["sampler"] for r in rows}
    assert ran == ({"chees", "blackjax", "numpyro"} if HAVE_JAX else {"chees"}), phases
    for r in rows:
        assert r["chains"] == 8 and r["warmup"] == 20 and r["samples"] == 20 and r["device"] == "cpu"
        assert r["chain_gradients"] > 8 * 40  # at least one leapfrog step per chain and iteration
        assert 0 < r["ess_min"] <= r["ess_median"] and isinstance(r["certified"], bool)
        assert r["sampling_cpu_s"] > 0 and r["compile_s"] >= 0
    if not HAVE_JAX:
        assert "blackjax_8: rc 6" in phases and "numpyro_8: rc 6" in phases, phases
    summary = (out / "summary.txt").read_text()
    assert "| chees | 8 | 20 + 20 |" in summary, summary
    with tarfile.open(out / "session.tar.gz") as tar:
        names = tar.getnames()
    assert "./phases.log" in names and "./samplers.jsonl" in names and "./tests.log" in names
    assert not [n for n in names if n.endswith((".pt", ".npz", ".nc"))]  # the heavy files stay behind
    assert (out / "session.tar.gz").stat().st_size < 16 * 2**20  # what a device call can bring back


def test_the_jax_samplers_ask_for_the_gpu_on_a_cuda_run():
    """``nuts_vs_numpyro`` (whose data the benchmark uses) defaults ``JAX_PLATFORMS`` to ``cpu`` on
    import; on a ``--device cuda`` run the benchmark must have asked for the GPU before that, or
    BlackJAX and NumPyro would silently run on the host (a lent GPU cannot be asked twice)."""
    code = ("import os, sys; sys.path.insert(0, 'comparisons/benchmarks'); import chees_vs_blackjax as b; "
            "b._jax_env(sys.argv[1]); import nuts_vs_numpyro; print(os.environ['JAX_PLATFORMS'])")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    for device, platform in (("cuda", "cuda"), ("cpu", "cpu")):
        out = subprocess.run([sys.executable, "-c", code, device], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip() == platform
