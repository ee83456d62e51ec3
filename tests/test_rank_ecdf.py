"""Rank-ECDF difference plots: readable at 64 and 512 chains, a stuck chain stands out."""

from __future__ import annotations

import numpy as np
import pytest

from pyrobdl.diagnostics.plots import plot_rank_ecdf, rank_ecdf_difference


def _idata(chains: int, draws: int = 150, offset: float = 0.0):
    import arviz as az

    f = np.random.default_rng(chains).normal(size=(chains, draws, 4, 1))
    f[0] += offset  # chain 0 samples somewhere else
    return az.from_dict(posterior_predictive={"f": f}, dims={"f": ["obs", "output"]})


def test_rank_ecdf_difference_band_holds_agreeing_chains_and_not_a_stuck_one():
    rng = np.random.default_rng(3)
    outside = 0
    trials = 40
    for _ in range(trials):  # 64 chains of one distribution: all inside in ~95% of trials
        z, diff, lower, upper = rank_ecdf_difference(rng.normal(size=(64, 150)))
        outside += bool(np.any((diff < lower - 1e-12) | (diff > upper + 1e-12)))
    assert z.shape == (100,) and diff.shape == (64, 100)
    # binomial(40, 0.05): 8 or more trials with a chain outside has probability < 1e-3
    assert outside < 8, outside
    values = rng.normal(size=(64, 150))
    values[5] += 1.0
    _, diff, lower, upper = rank_ecdf_difference(values)
    flagged = np.flatnonzero(np.any((diff < lower) | (diff > upper), axis=1))
    assert 5 in flagged and len(flagged) <= 3


@pytest.mark.parametrize("chains", [64, 512])
def test_plot_rank_ecdf_counts_the_chains_outside(chains):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # ArviZ: more chains than draws
        fig = plot_rank_ecdf(_idata(chains, offset=1.0))
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    assert len(titles) == 4
    for t in titles:  # the offset chain is outside in every panel; few or no others are
        n = int(t.split(": ")[1].split(" of ")[0])
        assert t.endswith(f" of {chains} chains outside") and 1 <= n <= 3, t
    from matplotlib.collections import LineCollection
    from matplotlib.colors import to_rgb

    ax = fig.axes[0]
    chain_lines = [c for c in ax.collections if isinstance(c, LineCollection)]  # one per colour
    red = [c for c in chain_lines if np.allclose(c.get_color()[0][:3], to_rgb("C3"))]
    grey = [c for c in chain_lines if np.allclose(c.get_color()[0][:3], to_rgb("0.35"))]
    assert len(red) == len(grey) == 1 and len(chain_lines) == 2
    assert 1 <= len(red[0].get_segments()) <= 3
    assert len(red[0].get_segments()) + len(grey[0].get_segments()) == chains
    assert grey[0].get_alpha() <= 8 / 64
