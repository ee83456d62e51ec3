"""README.md's Python examples run as written: every ```python block, in order, in one namespace."""

from __future__ import annotations

import re
import time
import warnings
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_readme_has_python_examples():
    blocks = python_blocks(README.read_text(encoding="utf-8"))
    assert len(blocks) >= 3
    joined = "\n".join(blocks)
    for needle in ("svi.step(", "pyrobdl.fit(", "load_posterior(", "load_csv(", "Categorical()"):
        assert needle in joined, needle


@pytest.mark.slow
def test_readme_python_examples_run_as_written(tmp_path, monkeypatch):
    """Slow (about a minute): the examples fit real models, a many-chain reference included."""
    monkeypatch.chdir(tmp_path)  # the examples write files (a saved posterior, a CSV)
    namespace: dict = {"__name__": "__readme__"}
    start = time.perf_counter()
    with warnings.catch_warnings():
        # the README says how to handle the reference's certification warning; others are errors
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message=".*torch.jit.trace.*")
        warnings.filterwarnings("ignore", category=FutureWarning, module="arviz")
        for i, block in enumerate(python_blocks(README.read_text(encoding="utf-8"))):
            exec(compile(block, f"README.md python block {i + 1}", "exec"), namespace)
    # what the examples claim they produce
    assert namespace["draws"].shape == (100, 200, 1)
    assert namespace["pred"].mean.shape == (200, 1)
    assert -5 < namespace["test_ll"] < 5
    assert namespace["reference"].history.shape == (300,)
    assert namespace["probs"].shape == (75, 2)
    assert float(namespace["accuracy"]) > 0.8  # two blobs 2.8 sd apart: ~92% separable
    with torch.no_grad():  # post-hoc Laplace's mean network is the user's network
        assert torch.equal(namespace["plain"](namespace["x_test"]), namespace["net"](namespace["x_test"]))
    assert isinstance(namespace["one"], torch.nn.Sequential)
    assert time.perf_counter() - start < 600
