"""pyrobdl's batched rank-normalised R-hat and bulk/tail ESS against ArviZ's own computation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import DEVICES
from pyrobdl.diagnostics import convergence
from pyrobdl.diagnostics.arviz_adapter import arviz_convergence

# both compute in float64; the only differences are the order of floating-point sums
RTOL = 1e-10


def _ar1(rng: np.random.Generator, c: int, d: int, v: int, phi: float) -> np.ndarray:
    x = np.zeros((c, d, v))
    e = rng.normal(size=(c, d, v))
    x[:, 0] = e[:, 0]
    for t in range(1, d):
        x[:, t] = phi * x[:, t - 1] + e[:, t]
    return x


def _cases() -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(20261126)
    out = []
    for c in (1, 2, 4):
        for d in (4, 5, 7, 33, 100):
            out.append((f"normal-{c}x{d}", rng.normal(size=(c, d, 3))))
            out.append((f"ar0.95-{c}x{d}", _ar1(rng, c, d, 3, 0.95)))  # long positive sequence
            out.append((f"antithetic-{c}x{d}", _ar1(rng, c, d, 3, -0.7)))  # negative pairs: truncation rules
            out.append((f"ties-{c}x{d}", rng.integers(0, 3, size=(c, d, 3)).astype(float)))  # average ranks
            out.append((f"offsets-{c}x{d}", rng.normal(size=(c, d, 3)) + 0.7 * np.arange(c)[:, None, None]))
    special = rng.normal(size=(4, 50, 5))
    special[..., 0] = 3.0  # constant: R-hat NaN, ESS = all draws
    special[1, 7, 1] = np.nan  # one NaN draw: every number NaN
    special[..., 2] = np.where(rng.random((4, 50)) < 0.5, -1.0, 1.0)  # folded draws constant
    special[..., 3] = 0.0
    special[0, 0, 3] = 1.0  # one draw apart from the rest
    out.append(("special", special))
    out.append(("more-chains-than-draws", _ar1(rng, 64, 10, 2, 0.5)))
    out.append(("long-ar0.99", _ar1(rng, 4, 1000, 2, 0.99)))
    out.append(("two-dims", rng.normal(size=(3, 20, 2, 3))))
    return out


@pytest.mark.parametrize("name,draws", _cases(), ids=[name for name, _ in _cases()])
def test_equals_arviz(name: str, draws: np.ndarray) -> None:
    ref = arviz_convergence(draws)
    got = convergence(draws)
    for key in ("rhat", "ess_bulk", "ess_tail"):
        assert got[key].shape == ref[key].shape == draws.shape[2:], key
        assert got[key].dtype == np.float64
        np.testing.assert_array_equal(np.isnan(got[key]), np.isnan(ref[key]), err_msg=f"{name} {key}: NaN pattern")
        np.testing.assert_allclose(got[key], ref[key], rtol=RTOL, atol=0, equal_nan=True, err_msg=f"{name} {key}")


def test_special_values_mean_what_arviz_says() -> None:
    """The edge cases above are real edge cases (so the equality test exercises them)."""
    draws = dict(_cases())["special"]
    got = convergence(draws)
    assert np.isnan(got["rhat"][0]) and got["ess_bulk"][0] == draws.shape[0] * draws.shape[1]
    assert np.isnan([got[k][1] for k in got]).all()
    assert np.isfinite(got["rhat"][2])
    offsets = dict(_cases())["offsets-4x100"]
    assert convergence(offsets)["rhat"].min() > 1.1  # chains 0.7 sd apart are flagged


def test_chunking_and_tensor_input_change_nothing() -> None:
    rng = np.random.default_rng(1)
    draws = _ar1(rng, 8, 40, 7, 0.8)
    whole = convergence(draws)
    one_at_a_time = convergence(draws, chunk_elements=1)
    as_tensor = convergence(torch.as_tensor(draws))
    for key in whole:
        np.testing.assert_allclose(one_at_a_time[key], whole[key], rtol=1e-13)
        np.testing.assert_array_equal(as_tensor[key], whole[key])
    # float32 tensors are summarised in float64, as their float64 values
    single = torch.as_tensor(draws, dtype=torch.float32)
    np.testing.assert_array_equal(convergence(single)["rhat"], convergence(single.double().numpy())["rhat"])


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match=r"\[chain, draw, \.\.\.\]"):
        convergence(np.zeros(10))
    with pytest.raises(ValueError, match="chunk_elements"):
        convergence(np.zeros((2, 10)), chunk_elements=0)


@pytest.mark.cuda
@pytest.mark.skipif("cuda" not in DEVICES, reason="needs a CUDA device")
def test_cuda_equals_cpu() -> None:
    rng = np.random.default_rng(2)
    draws = np.concatenate([_ar1(rng, 16, 60, 4, 0.9), rng.integers(0, 3, size=(16, 60, 2)).astype(float)], -1)
    cpu = convergence(torch.as_tensor(draws))
    gpu = convergence(torch.as_tensor(draws, device="cuda"))
    for key in cpu:
        np.testing.assert_allclose(gpu[key], cpu[key], rtol=1e-10)
