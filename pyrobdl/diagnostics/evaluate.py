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
from .arviz_adapter import pareto_k, pointwise_log_likelihood, psis_loo
from .certification import Certification

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


def _scale(name: str, value: Any, out_features: int) -> np.ndarray:
    arr = np.asarray(value, dtype=np.float64)
    if arr.ndim > 1 or arr.size not in (1, out_features) or not np.isfinite(arr).all():
        raise ValueError(f"{name} must be a finite number or {out_features} numbers (one per output), got {value!r}")
    return np.broadcast_to(arr.reshape(-1), (out_features,)).copy()


def _target_scale(y_mean: Any, y_std: Any, out_features: int) -> tuple[np.ndarray, np.ndarray]:
    mean, std = _scale("y_mean", y_mean, out_features), _scale("y_std", y_std, out_features)
    if (std <= 0).any():
        raise ValueError(f"y_std must be > 0, got {y_std!r}")
    return mean, std


def _task(prediction: Prediction) -> str:
    return prediction._likelihood.task


def _require_task(prediction: Any, task: str, caller: str) -> None:
    if not isinstance(prediction, Prediction):
        raise TypeError(f"{caller} needs a pyrobdl Prediction (posterior.predict(x)), got {type(prediction).__name__}")
    if _task(prediction) != task:
        raise ValueError(f"{caller} needs a {task} prediction, but this one is from a {_task(prediction)} model")


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().cpu().numpy()


def _noise_variance(p: Prediction) -> np.ndarray:
    """Observation-noise variance of every draw at every point, ``[S, N, out]``."""
    return _np(p._likelihood.noise_variance(p._latents, p.samples).expand_as(p.samples))


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


def reference_scores(
    prediction: Prediction, reference: Prediction, *, y_mean: Any = 0.0, y_std: Any = 1.0, seed: int = 0
) -> dict[str, float]:
    r"""Agreement of a predictive with a reference predictive at the same inputs.

    Classification: ``agreement`` and ``total_variation`` (Izmailov et al. 2021).  Regression
    (original scale): ``w2_to_reference`` (mean over points and outputs of the Wasserstein-2
    distance between the two predictive distributions of :math:`y`, from draws),
    ``w2_function_to_reference`` (the same for the noise-free function :math:`f`), and
    ``kl_gaussian_to_reference``, the mean of
    :math:`\mathrm{KL}(\mathcal N(m_{\text{ref}}, v_{\text{ref}})\,\|\,\mathcal N(m, v))` between
    moment-matched Gaussians.

    Raises
    ------
    ValueError
        If the two predictions differ in task, number of points or outputs.
    """
    for name, p in (("prediction", prediction), ("reference", reference)):
        if not isinstance(p, Prediction):
            raise TypeError(f"{name} must be a pyrobdl Prediction, got {type(p).__name__}")
    if _task(prediction) != _task(reference):
        raise ValueError(f"reference is a {_task(reference)} predictive but the posterior is {_task(prediction)}")
    shape, ref_shape = tuple(prediction.samples.shape[1:]), tuple(reference.samples.shape[1:])
    if shape != ref_shape:
        raise ValueError(
            f"reference has predictions of shape [N, out] = {list(ref_shape)} but the posterior's are {list(shape)}: "
            "the reference must be computed at the same test inputs"
        )
    if _task(prediction) == "classification":
        return {
            "agreement": metrics.agreement(_np(prediction.mean), _np(reference.mean)),
            "total_variation": metrics.total_variation(_np(prediction.mean), _np(reference.mean)),
        }
    mean, std = _target_scale(y_mean, y_std, shape[-1])
    rng = np.random.default_rng(seed)

    def draws(p: Prediction) -> tuple[np.ndarray, np.ndarray]:
        f = _np(p.samples)
        sd = np.sqrt(_noise_variance(p))
        f_o = f * std + mean
        return f_o.reshape(f.shape[0], -1), (f_o + sd * std * rng.standard_normal(f.shape)).reshape(f.shape[0], -1)

    (f_a, y_a), (f_b, y_b) = draws(prediction), draws(reference)
    kl = metrics.gaussian_kl(
        _np(reference.mean) * std + mean, _np(reference.variance) * std**2,
        _np(prediction.mean) * std + mean, _np(prediction.variance) * std**2,
    )
    return {
        "w2_to_reference": float(metrics.wasserstein2_empirical(y_a, y_b).mean()),
        "w2_function_to_reference": float(metrics.wasserstein2_empirical(f_a, f_b).mean()),
        "kl_gaussian_to_reference": float(kl.mean()),
    }


def _resolve_reference(reference: Any, model: Any, x: torch.Tensor) -> Posterior | Prediction | None:
    """Validate ``reference`` before any work; return a Posterior or a Prediction."""
    if reference is None:
        return None
    if hasattr(reference, "x_eval") and callable(getattr(reference, "prediction", None)):
        # a stored reference (pyrobdl.inference.reference.Reference): its inputs are known
        reference = (reference.x_eval, reference.prediction())
    if isinstance(reference, tuple):
        if len(reference) != 2 or not isinstance(reference[1], Prediction):
            raise TypeError("a tuple reference must be (x_reference, Prediction)")
        x_ref = check_inputs(model, reference[0], "reference x")
        if x_ref.shape != x.shape or not torch.allclose(x_ref.to(x), x):
            raise ValueError("reference was computed at different test points than x_test")
        reference = reference[1]
    if isinstance(reference, Posterior):
        rm = reference.model
        if rm.likelihood.task != model.likelihood.task or rm.out_features != model.out_features:
            raise ValueError(
                f"reference posterior is a {rm.likelihood.task} model with {rm.out_features} outputs; the posterior "
                f"is a {model.likelihood.task} model with {model.out_features}"
            )
        check_inputs(rm, x, "x_test (for the reference model)")
        return reference
    if isinstance(reference, Prediction):
        n, out = reference.samples.shape[-2:]
        if n != x.shape[0]:
            raise ValueError(
                f"reference prediction has {n} test points but x_test has {x.shape[0]}: it must be computed at x_test"
            )
        if reference._likelihood.task != model.likelihood.task or out != model.out_features:
            raise ValueError("reference prediction is for a different task or number of outputs than the posterior")
        return reference
    raise TypeError(
        "reference must be a Posterior, a Prediction, (x, Prediction) or a stored Reference, "
        f"got {type(reference).__name__}"
    )


def _reference_certification(reference: Any) -> Certification | None:
    """The certification a reference carries (a stored Reference, an MCMCPosterior, a
    StoredPosterior of the suite), or None when it carries none."""
    cert = getattr(reference, "certification", None)
    return cert if isinstance(cert, Certification) else None


def evaluate(
    posterior: Posterior,
    x_test: Any,
    y_test: Any,
    *,
    reference: Any = None,
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
        (1.0 when it passed, 0.0 when not).

    Warns
    -----
    UserWarning
        "agreement with an uncertified reference means nothing: ..." when the reference's
        certification failed (the failures follow).

    Raises
    ------
    TypeError
        If ``posterior`` or ``reference`` has the wrong type.
    ValueError
        Shapes that do not fit the model, a reference at different test points or for another
        task, ``y_std <= 0``, or ``y_mean``/``y_std`` given for a classification model; all
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
    certification = _reference_certification(reference)
    ref = _resolve_reference(reference, model, x)
    if certification is not None and not certification.passed:
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
