r"""Agreement of a posterior's predictive with a reference predictive at the same inputs.

:func:`reference_scores` is what :func:`pyrobdl.diagnostics.evaluate` adds for a reference and
what :func:`pyrobdl.diagnostics.reference_resolution` computes between two reference runs: the
same numbers, so that a method's distance to the reference and the reference's own precision are
read in one unit.  :func:`resolve_reference` checks what a caller passes as a reference before any
work.  Nothing here branches on a method's name.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .._validation import check_inputs
from ..posterior import Posterior, Prediction
from . import metrics
from .certification import Certification

__all__ = ["reference_certification", "reference_scores", "resolve_reference"]


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


def resolve_reference(reference: Any, model: Any, x: torch.Tensor) -> Posterior | Prediction | None:
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


def reference_certification(reference: Any) -> Certification | None:
    """The certification a reference carries (a stored Reference, an MCMCPosterior, a
    StoredPosterior of the suite), or None when it carries none."""
    cert = getattr(reference, "certification", None)
    return cert if isinstance(cert, Certification) else None


