r"""Scores of a posterior on held-out data: one flat dict of named floats per call.

:func:`evaluate` is what the comparison runner calls for every cell: it predicts at the test
inputs, computes the regression or classification metrics of :mod:`pyrobdl.diagnostics.metrics`
(on the original target scale when the targets were standardised), and, given a reference
posterior, the agreement metrics (and whether the reference is certified: agreement with an
uncertified reference means nothing).  :func:`fit_diagnostics` scores a fit on its *training* data
(PSIS-LOO, and the PSIS :math:`\hat k` of a variational approximation).  Every key is documented in
``docs/diagnostics.md``.  Nothing here branches on a method's name.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pyro
import torch

from .._validation import as_tensor, check_data, check_inputs
from ..posterior import Posterior, Prediction
from . import metrics
from .agreement import (
    _noise_variance,
    _np,
    _require_task,
    _target_scale,
    reference_certification,
    reference_scores,
    resolve_reference,
)
from .arviz_adapter import pareto_k, pointwise_log_likelihood, psis_loo
from .resolution import check_resolution, resolution_scores

__all__ = [
    "classification_scores",
    "evaluate",
    "fit_diagnostics",
    "reference_scores",
    "regression_scores",
    "vi_pareto_k",
]

#: Pareto k̂ above which an importance-sampling estimate is unreliable (Vehtari et al. 2024).
BAD_PARETO_K = 0.7
#: Confidence bins of the expected calibration error (Guo et al. 2017).
ECE_BINS = 15


# ----------------------------------------------------------------------------- checks


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def _check_posterior(name: str, posterior: Any) -> Posterior:
    if not isinstance(posterior, Posterior):
        raise TypeError(f"{name} must be a pyrobdl Posterior (what fit returns), got {type(posterior).__name__}")
    return posterior


def _check_targets(model: Any, y: Any, num_points: int, name: str) -> torch.Tensor:
    """``y`` in the likelihood's shape, validated against ``model`` (same rules as ``fit``)."""
    dummy_x = torch.zeros(num_points, model.in_features)
    yt = as_tensor(name, y)
    if yt.dim() == 0 or yt.shape[0] != num_points:
        raise ValueError(f"{name} must have one row per test input ({num_points}), got shape {list(yt.shape)}")
    try:
        return check_data(model, dummy_x, yt)[1]
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from e


# ----------------------------------------------------------------------------- scores


def regression_scores(
    prediction: Prediction, y: Any, *, y_mean: Any = 0.0, y_std: Any = 1.0, seed: int = 0
) -> dict[str, float]:
    r"""Regression metrics of a predictive on the original target scale.

    Parameters
    ----------
    prediction : Prediction
        ``posterior.predict(x_test)`` of a Gaussian-likelihood model.
    y : array-like
        Targets in the model's (standardised) scale, ``[N]`` or ``[N, out]``.
    y_mean, y_std : float or array-like, default 0 and 1
        The standardisation: original :math:`y = y_{\text{std}}\,\tilde y + y_{\text{mean}}`.
    seed : int, default 0
        Seed of the predictive draws used by the CRPS.

    Returns
    -------
    dict
        ``rmse``, ``test_ll``, ``coverage_50/80/90/95``, ``pit_calibration_error``, ``crps``,
        ``epistemic_variance``, ``aleatoric_variance`` (see ``docs/diagnostics.md``).

    Raises
    ------
    ValueError
        If the prediction is from a classification model or ``y`` has the wrong shape.
    """
    _require_task(prediction, "regression", "regression_scores")
    f = _np(prediction.samples)  # [S, N, out]
    s, n, out = f.shape
    yt = torch.as_tensor(y, dtype=prediction.samples.dtype, device=prediction.samples.device)
    yt = yt.unsqueeze(-1) if yt.dim() == 1 else yt
    if tuple(yt.shape) != (n, out):
        raise ValueError(f"y must have shape [{n}] or [{n}, {out}] to match the prediction, got {list(yt.shape)}")
    mean, std = _target_scale(y_mean, y_std, out)
    noise_var = _noise_variance(prediction)
    # test log-likelihood: the density of the original-scale targets is the standardised one
    # divided by prod_j y_std_j, so each point loses sum_j log y_std_j
    lpd = metrics.log_predictive_density(_np(prediction.log_likelihood(yt))) - np.log(std).sum()
    y_o = _np(yt) * std + mean
    f_o = f * std + mean
    sd_o = np.sqrt(noise_var) * std
    pit = metrics.gaussian_mixture_pit(y_o.reshape(-1), f_o.reshape(s, -1), sd_o.reshape(s, -1))
    rng = np.random.default_rng(seed)
    y_rep = f_o + sd_o * rng.standard_normal(f_o.shape)
    scores = {
        "rmse": metrics.rmse(_np(prediction.mean) * std + mean, y_o),
        "test_ll": float(lpd.mean()),
        **{f"coverage_{round(100 * lvl)}": metrics.interval_coverage(pit, lvl) for lvl in metrics.COVERAGE_LEVELS},
        "pit_calibration_error": metrics.pit_calibration_error(pit),
        "crps": float(metrics.crps_ensemble(y_rep.reshape(s, -1), y_o.reshape(-1)).mean()),
        "epistemic_variance": float((_np(prediction.epistemic_variance) * std**2).mean()),
        "aleatoric_variance": float((_np(prediction.aleatoric_variance) * std**2).mean()),
    }
    return scores


def classification_scores(prediction: Prediction, y: Any) -> dict[str, float]:
    r"""Classification metrics of a predictive.

    Parameters
    ----------
    prediction : Prediction
        ``posterior.predict(x_test)`` of a categorical-likelihood model.
    y : array-like
        Integer labels ``[N]``.

    Returns
    -------
    dict
        ``accuracy``, ``nll``, ``test_ll`` (= ``-nll``), ``brier``, ``ece``,
        ``predictive_entropy``, ``expected_entropy``, ``mutual_information`` (means over points).

    Raises
    ------
    ValueError
        If the prediction is from a regression model, or labels are out of range.
    """
    _require_task(prediction, "classification", "classification_scores")
    n, k = prediction.samples.shape[-2:]
    labels = metrics._check_labels(np.asarray(torch.as_tensor(y).cpu()), n, k)
    draw_probs = _np(torch.softmax(prediction.samples.double(), dim=-1))
    probs = draw_probs.mean(0)
    # NLL through logsumexp of per-draw log-likelihoods: stable where the mean probability underflows
    ll = _np(prediction.log_likelihood(torch.as_tensor(labels, device=prediction.samples.device)))
    test_ll = float(metrics.log_predictive_density(ll).mean())
    return {
        "accuracy": metrics.accuracy(probs, labels),
        "nll": -test_ll,
        "test_ll": test_ll,
        "brier": metrics.brier_score(probs, labels),
        "ece": metrics.expected_calibration_error(probs, labels, ECE_BINS),
        "predictive_entropy": float(metrics.predictive_entropy(probs).mean()),
        "expected_entropy": float(metrics.expected_entropy(draw_probs).mean()),
        "mutual_information": float(metrics.mutual_information(draw_probs).mean()),
    }


def evaluate(
    posterior: Posterior,
    x_test: Any,
    y_test: Any,
    *,
    reference: Any = None,
    resolution: Any = None,
    num_samples: int = 500,
    seed: int = 0,
    y_mean: Any = 0.0,
    y_std: Any = 1.0,
) -> dict[str, float]:
    r"""Score a posterior on test data; a flat dict of documented, JSON-ready floats.

    Parameters
    ----------
    posterior : Posterior
        Any method's result.
    x_test : array-like
        Test inputs ``[N, in_features]`` in the model's scale.
    y_test : array-like
        Test targets in the model's scale (``[N]``/``[N, out]``), or labels ``[N]``.
    reference : Posterior, Prediction, (x, Prediction) or Reference, optional
        A reference posterior (usually long NUTS) or its prediction at ``x_test``; adds the
        agreement keys.  A bare Prediction is only checked for the number of points; pass
        ``(x_reference, prediction)``, or a stored reference with ``x_eval`` and
        ``prediction()`` (:func:`pyrobdl.inference.reference.load_reference`), to have the
        inputs compared too.  A reference that carries a certification (a stored reference,
        an MCMC posterior, the suite's stored reference draws) adds ``reference_certified``.
    resolution : Resolution, optional
        The reference's resolution (:func:`pyrobdl.diagnostics.reference_resolution` of two
        independent runs, computed at ``x_test`` with the same ``num_samples``, ``y_mean`` and
        ``y_std``); needs ``reference``.  Adds every agreement key's resolution and the method's
        distance in units of it, and ``reference_resolved``.
    num_samples : int, default 500
        Posterior draws for the predictive (and for a reference Posterior).
    seed : int, default 0
        Seed of the draws.
    y_mean, y_std : float or array-like, default 0 and 1
        Standardisation of the targets (regression only): metrics are reported for
        :math:`y_{\text{std}}\,\tilde y + y_{\text{mean}}`, the original scale; the test
        log-likelihood gets :math:`-\sum_j \log y_{\text{std},j}` per point.

    Returns
    -------
    dict[str, float]
        Regression: ``rmse``, ``test_ll``, ``coverage_50``, ``coverage_80``, ``coverage_90``,
        ``coverage_95``, ``pit_calibration_error``, ``crps``, ``epistemic_variance``,
        ``aleatoric_variance``; with a reference ``w2_to_reference``,
        ``w2_function_to_reference``, ``kl_gaussian_to_reference``.
        Classification: ``accuracy``, ``nll``, ``test_ll``, ``brier``, ``ece``,
        ``predictive_entropy``, ``expected_entropy``, ``mutual_information``; with a reference
        ``agreement``, ``total_variation``.
        Both tasks, with a reference that carries a certification: ``reference_certified``
        (1.0 when it passed, 0.0 when not).  With a resolution, per agreement key ``k``:
        ``k_resolution`` (the two reference runs' own value) and ``k_in_resolutions`` (the
        method's distance over the runs' distance; for ``agreement`` the distance is one minus
        it), and ``reference_resolved`` (1.0 when the method is farther from the reference than
        the resolution on ``w2_function_to_reference`` / ``total_variation``, 0.0 when not).

    Warns
    -----
    UserWarning
        "agreement with an uncertified reference means nothing: ..." when the reference's
        certification failed (the failures follow) and no resolution is given.

    Raises
    ------
    TypeError
        If ``posterior`` or ``reference`` has the wrong type.
    ValueError
        Shapes that do not fit the model, a reference at different test points or for another
        task, ``y_std <= 0``, ``y_mean``/``y_std`` given for a classification model, a
        resolution without a reference or computed at other inputs, draws or target scale; all
        raised before any prediction.

    Examples
    --------
    >>> scores = evaluate(posterior, x_test, y_test, reference=nuts_posterior,
    ...                   y_mean=split.y_mean, y_std=split.y_std)
    >>> scores["test_ll"], scores["w2_to_reference"]
    """
    _check_posterior("posterior", posterior)
    _check_int("num_samples", num_samples, 1)
    _check_int("seed", seed, 0)
    model = posterior.model
    x = check_inputs(model, x_test, "x_test").to(model.device)
    y = _check_targets(model, y_test, x.shape[0], "y_test").to(model.device)
    task = model.likelihood.task
    if task == "regression":
        _target_scale(y_mean, y_std, model.out_features)
    elif not (np.all(np.asarray(y_mean) == 0.0) and np.all(np.asarray(y_std) == 1.0)):
        raise ValueError("y_mean/y_std standardise regression targets; this posterior is a classification model")
    certification = reference_certification(reference)
    ref = resolve_reference(reference, model, x)
    res = check_resolution(resolution, x, task, num_samples, y_mean, y_std, model.out_features)
    if res is not None and ref is None:
        raise ValueError("resolution is the precision of a reference: give the reference too (reference=...)")
    if certification is not None and not certification.passed and res is None:
        warnings.warn(
            f"agreement with an uncertified reference means nothing: the reference is {certification.summary()}",
            UserWarning, stacklevel=2,
        )

    prediction = posterior.predict(x, num_samples, seed=seed)
    if task == "regression":
        scores = regression_scores(prediction, y, y_mean=y_mean, y_std=y_std, seed=seed)
    else:
        scores = classification_scores(prediction, y)
    if ref is not None:
        ref_pred = ref.predict(x.to(ref.model.device), num_samples, seed=seed) if isinstance(ref, Posterior) else ref
        scores.update(reference_scores(prediction, ref_pred, y_mean=y_mean, y_std=y_std, seed=seed))
        if certification is not None:
            scores["reference_certified"] = float(certification.passed)
        if res is not None:
            scores.update(resolution_scores(scores, res))
    return scores


# ----------------------------------------------------------------------------- training-data fit


def vi_pareto_k(posterior: Posterior, x: Any, y: Any, *, num_samples: int = 1000, seed: int = 0) -> float | None:
    r"""PSIS :math:`\hat k` of a variational approximation against the model (Yao et al. 2018).

    Parameters
    ----------
    posterior : Posterior
        A result whose ``guide`` has ``variational_distributions()`` (every SVI method).
    x, y : array-like
        The training data the posterior was fitted to, in the model's scale.
    num_samples : int, default 1000
        Draws from :math:`q`.
    seed : int, default 0

    Returns
    -------
    float or None
        :math:`\hat k` of the ratios :math:`\log p(w_s, y) - \log q(w_s)`,
        :math:`w_s \sim q`, with :math:`\log p(w, y) = \log p(w) + \sum_n \log p(y_n\mid w)`
        from ``model.prior_distributions()`` and ``model.log_likelihood``.  Sites where
        :math:`q` is a point mass are held fixed (the diagnostic is then conditional on them).
        None when it does not apply: no guide (MCMC), every site a point mass (MAP), or a
        :math:`q` without ``log_prob``.

    Notes
    -----
    :math:`\hat k < 0.5`: :math:`q` is close enough to the posterior for importance sampling
    to correct it; :math:`0.5 < \hat k < 0.7`: usable with care; :math:`\hat k > 0.7`: :math:`q`
    misses mass of the posterior (in the sense of :math:`\mathrm{KL}(q\|p)`'s blind spots) and
    expectations under :math:`q` are unreliable.  Mean-field posteriors of neural networks
    usually give :math:`\hat k \gg 0.7`; the number is still useful to compare fits.  An
    improper prior enters through its unnormalised log-density, which :math:`\hat k` ignores.

    References
    ----------
    Y. Yao, A. Vehtari, D. Simpson, A. Gelman. Yes, but did it work?: Evaluating variational
    inference. ICML 2018.
    """
    _check_posterior("posterior", posterior)
    _check_int("num_samples", num_samples, 5)
    guide = getattr(posterior, "guide", None)
    if guide is None or not callable(getattr(guide, "variational_distributions", None)):
        return None
    model = posterior.model
    x_t, y_t = (t.to(model.device) for t in check_data(model, x, y))
    pyro.set_rng_seed(seed)
    with torch.no_grad():
        qs = guide.variational_distributions()
        priors = model.prior_distributions()
        if set(qs) != set(priors):
            raise ValueError(f"guide sites {sorted(qs)} differ from the model's {sorted(priors)}")
        draws = {k: q.sample((num_samples,)) for k, q in qs.items()}
        # Point-mass sites (MAP, or the biases of variational dropout) have no density: they are
        # held at their value, so the ratio is p(w_rest, y | fixed) / q(w_rest); their log p and
        # log q are constant over draws and drop out of k-hat.
        random = [k for k, v in draws.items() if not bool((v == v[:1]).all())]
        if not random:
            return None
        try:
            log_q = sum(qs[k].log_prob(draws[k]) for k in random)
        except NotImplementedError:
            return None
        log_prior = sum(priors[k].log_prob(draws[k]) for k in random)
        log_lik = torch.cat([
            model.log_likelihood({k: v[i : i + 256] for k, v in draws.items()}, x_t, y_t).sum(-1)
            for i in range(0, num_samples, 256)
        ])
    return pareto_k(_np(log_prior + log_lik - log_q))


def fit_diagnostics(
    posterior: Posterior, x_train: Any, y_train: Any, *, num_samples: int = 500, seed: int = 0, y_std: Any = 1.0
) -> dict[str, float]:
    r"""Fit-quality signals on the training data: PSIS-LOO and, for VI, Yao et al.'s :math:`\hat k`.

    Parameters
    ----------
    posterior : Posterior
        Any method's result.
    x_train, y_train : array-like
        The data the posterior was fitted to (model scale).
    num_samples : int, default 500
        Posterior draws (for LOO; also the draws from :math:`q` for ``vi_pareto_k``).
    seed : int, default 0
    y_std : float or array-like, default 1
        Target standardisation (regression), so ``loo_ll`` is on the original scale.

    Returns
    -------
    dict[str, float]
        ``loo_ll`` (PSIS-LOO log predictive density per point, comparable to ``test_ll``),
        ``loo_ll_se``, ``loo_p`` (effective number of parameters), ``loo_pareto_k_max``,
        ``loo_pareto_k_bad_fraction`` (points with :math:`\hat k > 0.7`) — absent when all draws
        give the same likelihood (a point mass: nothing to reweight); ``vi_pareto_k`` when
        :func:`vi_pareto_k` applies.
    """
    _check_posterior("posterior", posterior)
    _check_int("num_samples", num_samples, 5)
    model = posterior.model
    log_std = 0.0
    if model.likelihood.task == "regression":
        log_std = float(np.log(_target_scale(0.0, y_std, model.out_features)[1]).sum())
    ll = pointwise_log_likelihood(posterior, x_train, y_train, num_samples, seed=seed)
    out: dict[str, float] = {}
    flat = ll.reshape(-1, ll.shape[-1])
    if np.ptp(flat, axis=0).max() > 0:
        loo = psis_loo(ll)
        n = ll.shape[-1]
        out.update(
            loo_ll=loo.elpd / n - log_std,
            loo_ll_se=loo.se / n,
            loo_p=loo.p_loo,
            loo_pareto_k_max=float(np.max(loo.pareto_k)),
            loo_pareto_k_bad_fraction=float(np.mean(loo.pareto_k > BAD_PARETO_K)),
        )
    k = vi_pareto_k(posterior, x_train, y_train, num_samples=num_samples, seed=seed)
    if k is not None:
        out["vi_pareto_k"] = k
    return out
