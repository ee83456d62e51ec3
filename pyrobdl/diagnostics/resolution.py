r"""The resolution of a reference posterior: how far two independent runs of it disagree.

A reference that cannot be certified (chains that hold separate likelihood levels: yacht, boston,
energy and concrete, for every sampler measured) still has a measurable precision.  Run it twice,
independently (other seeds, other starting points, the same settings), and compute between the two
runs the agreement metrics that :func:`pyrobdl.diagnostics.evaluate` computes between a method and
the reference (:func:`~pyrobdl.diagnostics.agreement.reference_scores`).  That distance is the
reference's **resolution**: a method's distance to the reference means something in units of it.
Izmailov et al. (2021) judged their HMC reference the same way: independent HMC runs agreed with
each other far more than any approximation agreed with HMC.

How to read it (``docs/diagnostics.md``, "Reference resolution").  Write :math:`d(\cdot,\cdot)` for
a distance that obeys the triangle inequality (the function-space and predictive W2, the total
variation), :math:`p` for the true posterior, :math:`r_1, r_2` for the two runs and
:math:`\rho = d(r_1, r_2)` for the resolution.  When the runs' errors are independent and alike,
each run lies about :math:`\rho/\sqrt2 \le \rho` from :math:`p`; taking :math:`d(r_1, p) \le \rho`,

* a method :math:`m` with :math:`d(m, r_1) > \rho` is **distinguishable from the reference**
  (:math:`d(m, p) \ge d(m, r_1) - d(r_1, p) > 0`);
* two methods are **resolved** (their order is the order under :math:`p`) when their distances
  differ by more than :math:`2\rho`.

The assumption can fail: two runs that share a bias (both stuck in one mode that the posterior
leaves) agree with each other and not with :math:`p`; a resolution is a lower bound on a
reference's error, what reruns can reveal, and a certificate remains the stronger statement.  The
Gaussian KL is not a metric; its ratio to its own resolution is reported, not a verdict.

References
----------
P. Izmailov, S. Vikram, M. D. Hoffman, A. G. Wilson. What are Bayesian neural network posteriors
really like? ICML 2021.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch

from .._validation import check_inputs
from ..posterior import Posterior, Prediction
from .agreement import _target_scale, reference_certification, reference_scores, resolve_reference
from .inputs import inputs_sha256

__all__ = ["DISTANCES", "Resolution", "reference_resolution"]

#: Agreement keys and how each becomes a distance (0 = the runs agree exactly): ``"distance"`` is
#: one already, ``"similarity"`` is one minus a distance (classification agreement).
DISTANCES = {
    "w2_function_to_reference": "distance",
    "w2_to_reference": "distance",
    "kl_gaussian_to_reference": "distance",
    "total_variation": "distance",
    "agreement": "similarity",
}
#: The distance a verdict reads, per task: a metric, so that the triangle inequality holds.
PRIMARY = {"regression": "w2_function_to_reference", "classification": "total_variation"}


def _distance(key: str, value: float) -> float:
    return 1.0 - value if DISTANCES.get(key) == "similarity" else value


@dataclass(frozen=True)
class Resolution:
    r"""How far two independent runs of a reference disagree, in every agreement metric.

    Attributes
    ----------
    metrics : dict
        The agreement keys of :func:`~pyrobdl.diagnostics.evaluate` between the two runs (run
        ``a`` in the method's place, run ``b`` in the reference's): ``w2_function_to_reference``,
        ``w2_to_reference``, ``kl_gaussian_to_reference`` (the larger of its two directions) for
        regression, ``agreement`` and ``total_variation`` for classification.
    task : {"regression", "classification"}
    num_points : int
        Inputs it was computed at.
    num_samples : int
        Draws of each run it was computed from (a distance between finite samples includes their
        Monte Carlo error: compare with distances computed from as many draws).
    inputs_sha256 : str
        :func:`inputs_sha256` of those inputs.
    y_mean, y_std : list of float
        The target standardisation the regression metrics were computed under (original scale).
    seed : int
        Seed of the draws.
    certified : tuple of (bool or None)
        Whether each run carries a passed certification (None: none recorded).
    """

    metrics: Mapping[str, float]
    task: str
    num_points: int
    num_samples: int
    inputs_sha256: str
    y_mean: tuple[float, ...]
    y_std: tuple[float, ...]
    seed: int
    certified: tuple[bool | None, bool | None]

    @property
    def primary(self) -> str:
        """The key a verdict reads: ``w2_function_to_reference`` or ``total_variation``."""
        return PRIMARY[self.task]

    @property
    def w2_function(self) -> float:
        """Function-space W2 between the runs (regression; nan for classification)."""
        return float(self.metrics.get("w2_function_to_reference", math.nan))

    @property
    def w2_predictive(self) -> float:
        """W2 between the runs' predictive distributions of y (regression; nan otherwise)."""
        return float(self.metrics.get("w2_to_reference", math.nan))

    @property
    def predictive_kl(self) -> float:
        """Gaussian KL between the runs' predictives (regression; nan otherwise)."""
        return float(self.metrics.get("kl_gaussian_to_reference", math.nan))

    @property
    def agreement(self) -> float:
        """Top-1 agreement between the runs (classification; nan otherwise)."""
        return float(self.metrics.get("agreement", math.nan))

    @property
    def total_variation(self) -> float:
        """Mean total variation between the runs' predictive class probabilities (classification)."""
        return float(self.metrics.get("total_variation", math.nan))

    def distance(self, key: str | None = None) -> float:
        """The resolution of metric ``key`` (default :attr:`primary`) as a distance (0: the runs agree)."""
        key = self.primary if key is None else key
        if key not in self.metrics:
            raise KeyError(f"no resolution for {key!r}; this one has {sorted(self.metrics)}")
        return _distance(key, float(self.metrics[key]))

    def in_resolutions(self, scores: Mapping[str, float]) -> dict[str, float]:
        """Each agreement score of ``scores`` (what ``evaluate`` returns) as a multiple of the resolution.

        Returns
        -------
        dict
            ``"<key>_in_resolutions"`` per agreement key present in both: distance / resolution
            (inf when the resolution is 0 and the distance is not; nan when both are 0).
        """
        out = {}
        for key in self.metrics:
            if key in scores:
                d, r = _distance(key, float(scores[key])), self.distance(key)
                out[f"{key}_in_resolutions"] = d / r if r > 0 else (math.inf if d > 0 else math.nan)
        return out

    def distinguishable(self, score: float, key: str | None = None) -> bool:
        """Whether a method whose agreement score ``key`` (default :attr:`primary`; as ``evaluate``
        reports it) is ``score`` is distinguishable from the reference: farther than the resolution
        (module docstring)."""
        return _distance(self._key(key), score) > self.distance(key)

    def resolves(self, score_a: float, score_b: float, key: str | None = None) -> bool:
        """Whether two methods' agreement scores ``key`` (as ``evaluate`` reports them) differ, as
        distances, by more than twice the resolution, so that their order is the order under the
        true posterior (module docstring)."""
        k = self._key(key)
        return abs(_distance(k, score_a) - _distance(k, score_b)) > 2.0 * self.distance(k)

    def _key(self, key: str | None) -> str:
        return self.primary if key is None else key

    def summary(self) -> str:
        """One line, e.g. ``"resolution: function-space W2 0.012, predictive KL 0.003 (2 x 500 draws at 31 points)"``."""
        names = {"w2_function_to_reference": "function-space W2", "w2_to_reference": "predictive W2",
                 "kl_gaussian_to_reference": "predictive KL", "agreement": "agreement",
                 "total_variation": "total variation"}
        parts = ", ".join(f"{names.get(k, k)} {v:.3g}" for k, v in self.metrics.items())
        return f"resolution: {parts} (2 x {self.num_samples} draws at {self.num_points} points)"

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-serialisable)."""
        out = dataclasses.asdict(self)
        out.update(metrics=dict(self.metrics), y_mean=list(self.y_mean), y_std=list(self.y_std),
                   certified=list(self.certified))
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Resolution:
        """Inverse of :meth:`to_dict`.

        Raises
        ------
        ValueError
            If a field is missing or unknown, or the task is not one of the two.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        missing, unknown = sorted(names - set(data)), sorted(set(data) - names)
        if missing or unknown:
            raise ValueError(f"not a resolution record: missing {missing}, unknown {unknown}")
        if data["task"] not in PRIMARY:
            raise ValueError(f"not a resolution record: task {data['task']!r}")
        d = dict(data)
        d.update(metrics={str(k): float(v) for k, v in data["metrics"].items()},
                 y_mean=tuple(float(v) for v in data["y_mean"]), y_std=tuple(float(v) for v in data["y_std"]),
                 certified=tuple(None if v is None else bool(v) for v in data["certified"]),
                 num_points=int(data["num_points"]), num_samples=int(data["num_samples"]), seed=int(data["seed"]))
        return cls(**d)


def _model_of(run: Any) -> Any:
    return run.model if isinstance(run, Posterior) else None


def _check_pair(ref_a: Any, ref_b: Any) -> None:
    """Refuse what cannot be two independent runs of one reference, before any work."""
    if ref_a is None or ref_b is None:
        raise ValueError("a resolution needs two independent reference runs: ref_b is missing "
                         "(run the reference again with another seed)")
    if ref_a is ref_b:
        raise ValueError("ref_a and ref_b are the same run: a resolution needs two independent runs "
                         "(the same settings, another seed and other starting points)")
    ma, mb = _model_of(ref_a), _model_of(ref_b)
    if ma is not None and mb is not None:
        fields = ("in_features", "hidden", "out_features", "activation")
        differ = [f for f in fields if getattr(ma, f) != getattr(mb, f)]
        if type(ma.likelihood) is not type(mb.likelihood) or repr(ma.prior) != repr(mb.prior):
            differ.append("prior/likelihood")
        if differ:
            raise ValueError(f"ref_a and ref_b are runs of different models ({', '.join(differ)} differ): "
                             "a resolution compares two runs of one reference")
    seeds = [getattr(r, "settings", {}).get("seed") if isinstance(getattr(r, "settings", None), Mapping) else None
             for r in (ref_a, ref_b)]
    if seeds[0] is not None and seeds[0] == seeds[1]:
        raise ValueError(f"ref_a and ref_b were run with the same seed ({seeds[0]}): they are not independent")


def _prediction(run: Any, model: Any, x: torch.Tensor, num_samples: int, seed: int) -> Prediction:
    resolved = resolve_reference(run, model, x)
    if isinstance(resolved, Posterior):
        return resolved.predict(x.to(resolved.model.device), num_samples, seed=seed)
    return resolved


def _same_draws(a: Prediction, b: Prediction) -> bool:
    return a.samples.shape == b.samples.shape and bool(torch.equal(a.samples.cpu(), b.samples.cpu()))


def reference_resolution(
    ref_a: Any,
    ref_b: Any,
    x_test: Any,
    *,
    num_samples: int = 500,
    seed: int = 0,
    y_mean: Any = 0.0,
    y_std: Any = 1.0,
    model: Any = None,
) -> Resolution:
    r"""The resolution of a reference: the agreement metrics between two independent runs of it.

    Parameters
    ----------
    ref_a, ref_b : Posterior, stored Reference or (x, Prediction)
        Two runs of the same reference (same model and settings, other seeds and starting
        points), e.g. two ``fit(..., method="chees", seed=s)`` results.  Predictions are taken
        from ``num_samples`` draws of each (an MCMC posterior's evenly spaced over every chain).
    x_test : array-like
        Inputs ``[N, in_features]`` (the held-back inputs the methods are evaluated at).
    num_samples : int, default 500
        Draws of each run; use the ``num_samples`` the methods are evaluated with, since a
        distance between finite samples includes their Monte Carlo error.
    seed : int, default 0
        Seed of the draws (and of the predictive noise draws of ``w2_to_reference``).
    y_mean, y_std : float or array-like, default 0 and 1
        Target standardisation (regression): distances on the original scale, as ``evaluate``.
    model : pyrobdl.BayesianMLP, optional
        The model both runs are of; needed only when neither run is a Posterior (two stored
        predictions), to check ``x_test``.  A stored prediction is used with all its draws: thin
        it to ``num_samples`` draws first, as the methods it is compared with are.

    Returns
    -------
    Resolution

    Raises
    ------
    ValueError
        Before any work: a missing second run, the same run twice, runs of different models or
        with the same recorded seed, inputs that do not fit the model or differ from a stored
        reference's; after predicting: two runs with identical draws (not independent).
    TypeError
        A run of a type that is not a reference.

    Examples
    --------
    >>> ref = pyrobdl.fit(model, x, y, method="chees", num_chains=64, superchain_size=8, seed=0)
    >>> ref_b = pyrobdl.fit(model, x, y, method="chees", num_chains=64, superchain_size=8, seed=1)
    >>> res = reference_resolution(ref, ref_b, x_test, y_mean=data.y_mean, y_std=data.y_std)
    >>> evaluate(mean_field, x_test, y_test, reference=ref, resolution=res, y_mean=..., y_std=...)
    """
    _check_pair(ref_a, ref_b)
    for name, value, low in (("num_samples", num_samples, 2), ("seed", seed, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    model = _model_of(ref_a) or _model_of(ref_b) or model
    if model is None:
        raise TypeError("at least one of ref_a, ref_b must be a Posterior (its model checks the inputs), or give "
                        f"model=; got {type(ref_a).__name__} and {type(ref_b).__name__}")
    x = check_inputs(model, x_test, "x_test").to(model.device)
    task = model.likelihood.task
    if task == "regression":
        mean, std = _target_scale(y_mean, y_std, model.out_features)
    else:
        mean, std = np.zeros(model.out_features), np.ones(model.out_features)
    for run in (ref_a, ref_b):
        resolve_reference(run, model, x)  # every input check before any prediction
    pa, pb = (_prediction(r, model, x, num_samples, seed) for r in (ref_a, ref_b))
    if _same_draws(pa, pb):
        raise ValueError("ref_a and ref_b gave identical draws: they are one run, not two independent ones")
    ab = reference_scores(pa, pb, y_mean=mean, y_std=std, seed=seed)
    if "kl_gaussian_to_reference" in ab:  # not symmetric: the larger direction
        ba = reference_scores(pb, pa, y_mean=mean, y_std=std, seed=seed)
        ab["kl_gaussian_to_reference"] = max(ab["kl_gaussian_to_reference"], ba["kl_gaussian_to_reference"])
    certified = tuple(None if c is None else bool(c.passed)
                      for c in (reference_certification(ref_a), reference_certification(ref_b)))
    return Resolution(
        metrics=ab, task=task, num_points=int(x.shape[0]), num_samples=int(pa.samples.shape[0]),
        inputs_sha256=inputs_sha256(x), y_mean=tuple(float(v) for v in mean), y_std=tuple(float(v) for v in std),
        seed=seed, certified=certified,  # type: ignore[arg-type]
    )


def check_resolution(resolution: Any, x: torch.Tensor, task: str, num_samples: int, y_mean: Any,
                     y_std: Any, out_features: int) -> Resolution | None:
    """Refuse a resolution that was not computed where ``evaluate`` is asked to use it (before any work).

    Raises
    ------
    TypeError
        ``resolution`` is not a :class:`Resolution` (or None).
    ValueError
        Another task, other inputs, another number of draws, or another target scale.
    """
    if resolution is None:
        return None
    if not isinstance(resolution, Resolution):
        raise TypeError(f"resolution must be a Resolution (reference_resolution(...)), got {type(resolution).__name__}")
    if resolution.task != task:
        raise ValueError(f"resolution is of a {resolution.task} reference but the posterior is a {task} model")
    if resolution.inputs_sha256 != inputs_sha256(x):
        raise ValueError(f"resolution was computed at other inputs than x_test ({resolution.num_points} points, "
                         f"x_test has {x.shape[0]}): compute it at x_test")
    if resolution.num_samples != num_samples:
        raise ValueError(f"resolution was computed from {resolution.num_samples} draws per run but num_samples is "
                         f"{num_samples}: distances between finite samples are comparable only at equal draws")
    if task == "regression":
        mean, std = _target_scale(y_mean, y_std, out_features)
        if not (np.allclose(mean, resolution.y_mean) and np.allclose(std, resolution.y_std)):
            raise ValueError(f"resolution was computed with y_mean={list(resolution.y_mean)}, "
                             f"y_std={list(resolution.y_std)}; evaluate was given y_mean={y_mean!r}, y_std={y_std!r}")
    return resolution


def resolution_scores(scores: Mapping[str, float], resolution: Resolution) -> dict[str, float]:
    """What ``evaluate`` adds for a resolution: ``<key>_resolution`` (the runs' own value),
    ``<key>_in_resolutions`` (the method's distance in units of it) and ``reference_resolved``
    (1.0 when the method is distinguishable from the reference on the primary distance)."""
    out = {f"{k}_resolution": float(v) for k, v in resolution.metrics.items()}
    out.update(resolution.in_resolutions(scores))
    if resolution.primary in scores:
        out["reference_resolved"] = float(resolution.distinguishable(float(scores[resolution.primary])))
    return out

