r"""What a cell stores besides its metrics, computed from any posterior through its contract.

Everything here uses only :meth:`Posterior.sample`, :meth:`Posterior.predict`,
:meth:`Posterior.function` and the likelihood's public ``noise_variance``, so it works for every
registered method alike:

* :func:`exact_posterior_metrics` — distance to the exact posterior when the model is conjugate
  Bayesian linear regression (no hidden layer, Gaussian prior, fixed-precision Gaussian
  likelihood, one output);
* :func:`predictive_band` — the predictive mean and bands on a grid, for 1-D inputs;
* :func:`calibration_curve` — observed against nominal coverage (regression, from PIT values) or
  a reliability table (classification), computed with :mod:`pyrobdl.diagnostics.metrics`;
* :class:`StoredPosterior` — posterior draws saved by one cell and reloaded by another, so a
  reference posterior is fitted once and can serve cells run later or elsewhere.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from .. import likelihoods, priors
from ..datasets import blr_posterior
from ..posterior import Cost, Posterior
from .store import atomic_write_bytes

__all__ = [
    "CALIBRATION_LEVELS",
    "StoredPosterior",
    "calibration_curve",
    "exact_posterior_metrics",
    "draws_bytes",
    "load_draws",
    "load_draws_bytes",
    "predictive_band",
    "save_draws",
]

#: Nominal central-interval levels of the regression calibration curve.
CALIBRATION_LEVELS = np.round(np.linspace(0.05, 0.95, 19), 2)
#: Equal-width confidence bins of the classification reliability table.
RELIABILITY_BINS = 10
#: Points of the grid on which 1-D predictive bands are drawn.
BAND_POINTS = 200


def _flat_draws(model: Any, draws: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Weights and bias of a one-layer model as ``[S, D + 1]`` (the exact posterior's order)."""
    w, b = (draws[s.name] for s in model.sites[:2])
    return torch.cat([w.reshape(w.shape[0], -1), b.reshape(b.shape[0], -1)], dim=1).double()


def exact_posterior_metrics(model: Any, posterior: Posterior, data: Any, num_samples: int, seed: int) -> dict[str, float]:
    r"""Distance of a posterior to the exact one, for conjugate Bayesian linear regression.

    Returns an empty dict unless ``model`` has no hidden layer, one output, a
    :class:`pyrobdl.priors.Gaussian` prior and a fixed-precision
    :class:`pyrobdl.likelihoods.Gaussian` likelihood; then the exact posterior
    :math:`\mathcal N(\mu, \Sigma)` is known (Bishop 2006, eq. 3.50-3.51) and, from
    ``num_samples`` draws with mean :math:`\hat m` and standard deviations :math:`\hat s`,

    * ``exact_mean_error_sd`` :math:`= \sqrt{\tfrac1d\sum_i ((\hat m_i-\mu_i)/\sigma_i)^2}`,
      the mean error in units of the exact marginal sd :math:`\sigma_i`;
    * ``exact_sd_ratio`` :math:`= \tfrac1d\sum_i \hat s_i/\sigma_i` (1 for exact marginals);
    * ``exact_mf_sd_ratio`` :math:`= \tfrac1d\sum_i \hat s_i/s^{MF}_i`, against the optimal
      mean-field sd :math:`s^{MF}_i = \Lambda_{ii}^{-1/2}` (1 for the mean-field optimum);
    * ``exact_kl`` — :math:`\mathrm{KL}(\mathcal N(\hat m, \hat\Sigma)\,\|\,\mathcal N(\mu,\Sigma))`
      of the Gaussian fitted to the draws (infinite, stored as None, for degenerate draws).

    Monte Carlo error of these estimates is of order :math:`1/\sqrt{S}`.
    """
    prior, lik = model.prior, model.likelihood
    if model.hidden or model.out_features != 1 or type(prior) is not priors.Gaussian or type(lik) is not likelihoods.Gaussian:
        return {}
    w_site, b_site = model.sites[:2]
    exact = blr_posterior(
        data.x_train.cpu(), data.y_train.cpu(),
        weight_prior_scale=prior.layer_scale(w_site), bias_prior_scale=prior.layer_scale(b_site),
        precision=lik.precision,
    )
    theta = _flat_draws(model, posterior.sample(num_samples, seed=seed)).detach().cpu()
    mu, cov = exact.mean, exact.covariance
    sd = exact.posterior_sd
    m, s = theta.mean(0), theta.std(0)
    out = {
        "exact_mean_error_sd": float(((m - mu) / sd).pow(2).mean().sqrt()),
        "exact_sd_ratio": float((s / sd).mean()),
        "exact_mf_sd_ratio": float((s / exact.mean_field_sd).mean()),
    }
    d = mu.shape[0]
    q_cov = torch.cov(theta.T).reshape(d, d)
    try:
        chol_q = torch.linalg.cholesky(q_cov)
        prec = exact.precision_matrix
        diff = (mu - m).unsqueeze(-1)
        kl = 0.5 * (
            torch.trace(prec @ q_cov) + (diff.T @ prec @ diff).squeeze() - d
            + torch.logdet(cov) - 2 * chol_q.diagonal().log().sum()
        )
        out["exact_kl"] = float(kl)
    except RuntimeError:  # singular covariance of the draws (e.g. a point estimate)
        out["exact_kl"] = math.inf
    return out


def _to_original(data: Any, y: torch.Tensor) -> np.ndarray:
    return (y.double().cpu() * float(getattr(data, "y_std", 1.0)) + float(getattr(data, "y_mean", 0.0))).numpy()


def predictive_band(posterior: Posterior, data: Any, num_samples: int, seed: int) -> dict[str, np.ndarray]:
    """Predictive mean and standard deviations on a grid, for 1-D regression (else empty).

    Returns arrays ``band_x`` (grid, the inputs' stored scale), ``band_mean``, ``band_sd``
    (total: function + noise) and ``band_sd_epistemic`` (function only), on the original
    target scale, plus ``train_x``, ``train_y``, ``test_x``, ``test_y``.
    """
    if hasattr(data, "num_classes") or data.x_train.shape[1] != 1:
        return {}
    xs = torch.cat([data.x_train, data.x_test]).double()
    lo, hi = float(xs.min()), float(xs.max())
    pad = 0.1 * (hi - lo)
    dev = posterior.model.device
    grid = torch.linspace(lo - pad, hi + pad, BAND_POINTS, device=dev, dtype=data.x_train.dtype).unsqueeze(-1)
    pred = posterior.predict(grid, num_samples, seed=seed)
    y_std = float(getattr(data, "y_std", 1.0))
    return {
        "band_x": grid.squeeze(-1).cpu().numpy(),
        "band_mean": _to_original(data, pred.mean.squeeze(-1)),
        "band_sd": (pred.variance.squeeze(-1).double().sqrt().cpu() * y_std).numpy(),
        "band_sd_epistemic": (pred.epistemic_variance.squeeze(-1).double().sqrt().cpu() * y_std).numpy(),
        "train_x": data.x_train.squeeze(-1).cpu().numpy(),
        "train_y": _to_original(data, data.y_train),
        "test_x": data.x_test.squeeze(-1).cpu().numpy(),
        "test_y": _to_original(data, data.y_test),
    }


def calibration_curve(posterior: Posterior, data: Any, num_samples: int, seed: int) -> dict[str, np.ndarray]:
    r"""Calibration of the predictive on the test set, for the report's calibration plot.

    Regression: PIT values of the test targets under the predictive mixture
    (:func:`pyrobdl.diagnostics.metrics.gaussian_mixture_pit`) and the observed coverage of the
    central intervals at :data:`CALIBRATION_LEVELS`
    (:func:`~pyrobdl.diagnostics.metrics.interval_coverage`); returns ``calib_level`` and
    ``calib_observed`` (a calibrated predictive lies on the diagonal).

    Classification: the reliability table of the mean predictive
    (:func:`~pyrobdl.diagnostics.metrics.reliability_table`, :data:`RELIABILITY_BINS` bins):
    ``reliab_confidence``, ``reliab_accuracy``, ``reliab_count`` (NaN for empty bins); and per
    test point the top-class probability ``reliab_top_prob`` and whether it was right
    ``reliab_correct`` (1.0/0.0), from which the report draws equal-count bins.
    """
    from ..diagnostics import metrics

    model = posterior.model
    x = data.x_test.to(model.device)
    y = data.y_test.to(model.device)
    with torch.no_grad():
        draws = posterior.sample(num_samples, seed=seed)
        f = posterior.function(draws, x.reshape(x.shape[0], -1))  # the predictive the table scores
        if model.likelihood.task == "classification":
            probs = torch.softmax(f, dim=-1).mean(0).double().cpu().numpy()
            table = metrics.reliability_table(probs, y.cpu().numpy(), RELIABILITY_BINS)
            return {
                "reliab_confidence": table.confidence,
                "reliab_accuracy": table.accuracy,
                "reliab_count": table.count,
                # per test point, so the report can draw equal-count (adaptive) bins
                "reliab_top_prob": probs.max(-1),
                "reliab_correct": (probs.argmax(-1) == y.cpu().numpy()).astype(np.float64),
            }
        scale = model.likelihood.noise_variance(draws, f).expand_as(f).sqrt()
        loc, scale = f.squeeze(-1).double().cpu().numpy(), scale.squeeze(-1).double().cpu().numpy()
    pit = metrics.gaussian_mixture_pit(y.double().cpu().numpy(), loc, scale)
    observed = np.array([metrics.interval_coverage(pit, float(level)) for level in CALIBRATION_LEVELS])
    return {"calib_level": CALIBRATION_LEVELS.copy(), "calib_observed": observed}


def draws_bytes(posterior: Posterior, num_samples: int, seed: int) -> bytes:
    """``num_samples`` joint posterior draws (CPU tensors) serialised with ``torch.save``, in memory."""
    draws = {k: v.detach().cpu() for k, v in posterior.sample(num_samples, seed=seed).items()}
    buf = io.BytesIO()
    torch.save(draws, buf)
    return buf.getvalue()


def save_draws(path: Path, posterior: Posterior, num_samples: int, seed: int) -> str:
    """Save ``num_samples`` joint posterior draws atomically; return the file's SHA-256.

    Raises
    ------
    pyrobdl.compare.store.WriteError
        If the file cannot be written (naming it).
    """
    return atomic_write_bytes(Path(path), draws_bytes(posterior, num_samples, seed))


def load_draws_bytes(blob: bytes) -> dict[str, torch.Tensor]:
    """Draws from the bytes of a file written by :func:`save_draws` (tensors only: ``weights_only``)."""
    draws = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    if (not isinstance(draws, dict) or not draws
            or not all(isinstance(k, str) and isinstance(v, torch.Tensor) and v.dim() >= 1 for k, v in draws.items())
            or len({v.shape[0] for v in draws.values()}) != 1):
        raise ValueError("not a dict of site name -> [draws, ...] tensors with one number of draws")
    return draws


def load_draws(path: Path) -> dict[str, torch.Tensor]:
    """Read draws written by :func:`save_draws`."""
    return load_draws_bytes(Path(path).read_bytes())


class StoredPosterior(Posterior):
    """A posterior given by stored joint draws (e.g. a reference fitted in another cell).

    ``sample(S)`` returns the first ``S`` stored draws, cycling when more are requested than
    stored, so with ``S`` equal to the number stored it reproduces the reference exactly.

    Parameters
    ----------
    model : pyrobdl.BayesianMLP
        The model the draws belong to.
    draws : dict
        Site name -> ``[n, *shape]``.
    method : str
        Registry name of the method that produced the draws.
    cost : Cost, optional
        Cost of the original fit.
    certification : pyrobdl.diagnostics.Certification, optional
        The original fit's certification as a reference (what
        :func:`pyrobdl.diagnostics.evaluate` reports as ``reference_certified``).
    """

    def __init__(self, model: Any, draws: Mapping[str, torch.Tensor], method: str, cost: Cost | None = None,
                 certification: Any = None) -> None:
        super().__init__(model, method, {}, cost or Cost(0.0, 0, 0.0, 0, str(model.device)))
        self.certification = certification
        self._stored = {k: v.to(model.device) for k, v in draws.items()}
        self._n = next(iter(self._stored.values())).shape[0]

    def _draw(self, num_samples: int) -> dict[str, torch.Tensor]:
        idx = torch.arange(num_samples, device=self.model.device) % self._n
        return {k: v[idx] for k, v in self._stored.items()}
