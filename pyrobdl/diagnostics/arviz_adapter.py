r"""The one module of pyrobdl that imports ArviZ.

Every ArviZ call (``ess``, ``rhat``, ``loo``, ``psislw``, ``InferenceData`` construction, rank and
trace plots) goes through this file, so moving to ArviZ 1.x touches one module.  Arrays in, plain
numpy/dicts (or an ``InferenceData`` / a matplotlib ``Figure``) out.

:func:`to_inference_data` never uses ``az.from_pyro``: it builds every group from arrays shaped
here, so ``log_likelihood`` is exactly ``(chain, draw, obs)`` (DESIGN.md, known traps).  It reads
a posterior only through the generic hooks of :class:`~pyrobdl.posterior.Posterior`
(``_chains`` and ``_sample_stats``), never through its method name.
"""

from __future__ import annotations

import contextlib
import json
import math
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import pyro
import torch
from matplotlib.figure import Figure

from .._validation import check_data
from .._version import __version__
from .draws import (_check_log_lik_shape, _check_num_samples, _check_posterior, _flat, _predictive_draws,
                    chain_draws, is_point_mass, pointwise_log_likelihood)

with warnings.catch_warnings():
    # ArviZ 0.23 announces its 1.0 rewrite with a FutureWarning on import (DESIGN.md traps).
    warnings.simplefilter("ignore", FutureWarning)
    import arviz as az

__all__ = [
    "LooResult",
    "az",
    "bfmi",
    "arviz_convergence",
    "chain_draws",
    "is_point_mass",
    "pareto_k",
    "plot_rank",
    "plot_trace",
    "pointwise_log_likelihood",
    "psis_loo",
    "read_inference_data",
    "stored_dims",
    "to_inference_data",
]


def arviz_convergence(draws: Any) -> dict[str, np.ndarray]:
    r"""ArviZ's own split-R-hat and bulk/tail effective sample sizes of each scalar quantity.

    pyrobdl computes these numbers with :func:`pyrobdl.diagnostics.convergence` (all quantities in
    one batch, on the draws' device; ArviZ calls one Python function per quantity, minutes for
    thousands of chains); this is ArviZ's computation, the reference that one is tested against.

    Parameters
    ----------
    draws : array-like
        Shape ``[chain, draw, *dims]``.

    Returns
    -------
    dict
        ``{"rhat", "ess_bulk", "ess_tail"}``, each of shape ``dims`` (rank-normalised split
        R-hat and ESS of Vehtari et al. 2021, computed by ArviZ).

    References
    ----------
    A. Vehtari, A. Gelman, D. Simpson, B. Carpenter, P.-C. Bürkner. Rank-normalization,
    folding, and localization: an improved R-hat. Bayesian Analysis, 2021.
    """
    arr = np.asarray(draws, dtype=float)
    if arr.ndim < 2:
        raise ValueError(f"draws must have shape [chain, draw, ...], got {arr.shape}")
    with warnings.catch_warnings():
        # ArviZ guesses that an array with more chains than draws has its axes swapped; the
        # [chain, draw] order here is by construction (many-chain samplers: K > draws is normal)
        warnings.filterwarnings("ignore", message="More chains", category=UserWarning)
        dataset = az.convert_to_dataset({"x": arr})
    # chains that never moved (every proposal rejected) have zero variance: ArviZ divides by it;
    # the NaN/inf it returns is the answer (a failed diagnostic), the warning is noise
    with np.errstate(divide="ignore", invalid="ignore"):
        return {
            "rhat": np.asarray(az.rhat(dataset)["x"].values),
            "ess_bulk": np.asarray(az.ess(dataset, method="bulk")["x"].values),
            "ess_tail": np.asarray(az.ess(dataset, method="tail")["x"].values),
        }


def bfmi(energy: Any) -> np.ndarray:
    """ArviZ's E-BFMI (``az.bfmi``) of each chain's energy ``[chain, iteration]``.

    pyrobdl computes E-BFMI itself (:func:`pyrobdl.diagnostics.certification.ebfmi`); this is
    ArviZ's value, for comparison.
    """
    arr = np.asarray(energy, dtype=float)
    if arr.ndim != 2:
        raise ValueError(f"energy must have shape [chain, iteration], got {arr.shape}")
    return np.asarray(az.bfmi(arr), dtype=float)


# ----------------------------------------------------------------------------- InferenceData


def _unit_dims(model: Any) -> list[str]:
    """Names of the unit axes between layers: inputs, hidden layers, outputs."""
    out = "class" if model.likelihood.task == "classification" else "output"
    return ["feature", *[f"hidden_{i}" for i in range(len(model.hidden))], out]


def _site_dims(model: Any, name: str, shape: Sequence[int]) -> list[str]:
    units = _unit_dims(model)
    for s in model.sites:
        if s.name == name and tuple(shape) == tuple(s.shape):
            return [units[s.layer + 1], units[s.layer]] if s.kind == "weight" else [units[s.layer + 1]]
    key = name.replace(".", "_")
    return [f"{key}_dim_{k}" for k in range(len(shape))]


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return f"<tensor shape {list(value.shape)}>"
    return str(value)


def _library_versions() -> dict[str, str]:
    # str(): torch.__version__ is a str subclass that netCDF writers cannot store
    return {
        "pyrobdl_version": str(__version__),
        "pyro_version": str(pyro.__version__),
        "torch_version": str(torch.__version__),
        "numpy_version": str(np.__version__),
        "arviz_version": str(az.__version__),
    }


def _check_sample_stats(stats: dict[str, Any], c: int, d: int, owner: str) -> dict[str, np.ndarray]:
    out = {}
    for k, v in stats.items():
        arr = np.asarray(v)
        if arr.shape[:2] != (c, d):
            raise ValueError(f"{owner}._sample_stats()[{k!r}] has shape {arr.shape}, expected [{c}, {d}, ...] "
                             "to match the draws of _chains")
        out[k] = arr
    return out


def to_inference_data(
    posterior: Any, x: Any, y: Any, num_samples: int = 500, *, seed: int | None = None
) -> az.InferenceData:
    r"""Convert a posterior and a data set to ``arviz.InferenceData``.

    Parameters
    ----------
    posterior : Posterior
        Any method's result.
    x : array-like
        Inputs ``[N, in_features]`` (training or test data, in the model's scale).
    y : array-like
        Targets ``[N]`` / ``[N, out]``, or class labels ``[N]``.
    num_samples : int, default 500
        Draws requested from the posterior: methods that draw on demand return this many,
        split into up to four pseudo-chains; MCMC returns its stored chains.
    seed : int, optional
        Seed for the draws and the posterior-predictive replicates.

    Returns
    -------
    arviz.InferenceData
        Groups (``C`` chains, ``D`` draws, ``N`` points):

        * ``posterior`` — one variable per Pyro site (``layers.0.weight`` ...), dims named by
          the units they connect: ``feature``, ``hidden_0`` ..., ``output`` (``class`` for
          classification); e.g. ``layers.0.weight`` is ``(chain, draw, hidden_0, feature)``.
        * ``posterior_predictive`` — ``y``: replicated observations ``(chain, draw, obs)``
          (``(..., obs, output)`` for several outputs) and ``f``: the network output
          ``(chain, draw, obs, output|class)`` (logits for classification), the function-space
          quantity to diagnose a BNN by.
        * ``log_likelihood`` — ``y``: :math:`\log p(y_n \mid w)`, exactly ``(chain, draw, obs)``;
          absent for a point estimate (below).
        * ``observed_data`` — ``y``; ``constant_data`` — ``x`` ``(obs, feature)``.
        * ``sample_stats`` — whatever the posterior's ``_sample_stats`` hook returns
          (``diverging``, ``step_size``, ``tree_depth``, ``energy``, ... for MCMC); absent when
          empty.
        * ``attrs`` — ``method``, ``posterior_class``, ``settings`` and ``cost`` (JSON strings,
          so the data can be written to netCDF), ``model``, ``point_estimate`` (1 or 0),
          library versions.

        A posterior whose draws are all identical (MAP, any ``Delta`` guide) is exported as
        what it is, a point estimate: one chain of one draw and **no** ``log_likelihood``
        group, so ``az.loo``/``az.waic``/``az.compare`` refuse it instead of reading a
        zero-variance log-likelihood as a perfect in-sample fit (``p_waic = 0``, MAP ranked
        first by ``az.compare``).

    Notes
    -----
    What ArviZ's PSIS-LOO means here.  ``az.loo`` importance-reweights the draws it is given to
    approximate leave-one-out predictive densities.  For MCMC draws that is an estimate of the
    model's LOO (when the chains have converged and Pareto :math:`\hat k` is small).  For draws
    of an approximate posterior :math:`q` (mean-field, dropout, ...) it is the LOO of *q*
    treated as if it were the posterior: a statement about the approximation, not about the
    model, and it can be badly optimistic when :math:`q` is too narrow (large :math:`\hat k`
    says so; ``vi_pareto_k`` in :func:`pyrobdl.diagnostics.fit_diagnostics` checks :math:`q`
    against the model directly).  ``az.compare`` over methods therefore ranks approximations,
    each judged by itself; held-out test log-likelihood is the comparison that does not depend
    on that.

    Raises
    ------
    TypeError
        If ``posterior`` is not a :class:`~pyrobdl.posterior.Posterior`.
    ValueError
        If ``x``/``y`` do not fit the model (wrong feature count, row mismatch, labels out of
        range, NaN), or ``num_samples`` is not a positive integer.

    Examples
    --------
    >>> idata = posterior.to_inference_data(x_test, y_test)
    >>> az.loo(idata)
    """
    _check_posterior(posterior)
    _check_num_samples(num_samples)
    model = posterior.model
    x_t, y_t = (t.to(model.device) for t in check_data(model, x, y))
    flat, c, d = _flat(chain_draws(posterior, num_samples, seed=seed))
    point = is_point_mass(flat)
    if point:  # one draw is the whole posterior; repeating it would fake chains and draws
        flat, c, d = {k: v[:1] for k, v in flat.items()}, 1, 1
    n = x_t.shape[0]
    f, ll, rep = _predictive_draws(posterior, flat, c * d, x_t, y_t)
    _check_log_lik_shape(ll, c * d, n)

    def arr(t: torch.Tensor, *tail: int) -> np.ndarray:
        return t.cpu().numpy().reshape(c, d, *tail)

    f_np = arr(f, n, model.out_features)
    y_obs = y_t.cpu().numpy()
    y_rep = arr(rep, *y_t.shape)
    units = _unit_dims(model)
    y_dims = ["obs"] if y_obs.ndim == 1 else ["obs", units[-1]]
    if y_obs.ndim == 2 and y_obs.shape[1] == 1:  # one regression output: plain (obs,) for plot_ppc
        y_obs, y_rep, y_dims = y_obs[:, 0], y_rep[..., 0], ["obs"]

    posterior_vars = {k: v.cpu().numpy().reshape(c, d, *v.shape[1:]) for k, v in flat.items()}
    dims = {k: _site_dims(model, k, v.shape[2:]) for k, v in posterior_vars.items()}
    dims.update(y=y_dims, f=["obs", units[-1]], x=["obs", "feature"])
    widths = [model.in_features, *model.hidden, model.out_features]
    coords = {"obs": np.arange(n), **{u: np.arange(w) for u, w in zip(units, widths)}}
    stats = _check_sample_stats(dict(posterior._sample_stats(num_samples)), c, d, type(posterior).__name__)
    attrs = {
        "method": posterior.method,
        "posterior_class": type(posterior).__name__,
        "settings": json.dumps(posterior.settings, sort_keys=True, default=_jsonable),
        "cost": json.dumps(posterior.cost.to_dict(), sort_keys=True),
        "model": repr(model),
        "num_chains": c,
        "num_draws": d,
        "point_estimate": int(point),
    }
    versions = _library_versions()
    idata = az.from_dict(
        posterior=posterior_vars,
        posterior_predictive={"y": y_rep, "f": f_np},
        log_likelihood=None if point else {"y": arr(ll.double(), n)},
        observed_data={"y": y_obs},
        constant_data={"x": x_t.cpu().numpy()},
        sample_stats=stats or None,
        coords=coords,
        dims=dims,
        attrs=attrs,
        posterior_attrs={"inference_library": "pyro", "inference_library_version": pyro.__version__},
    )
    idata.attrs.update(versions)  # from_dict drops an "arviz_version" given in attrs
    return idata


# ----------------------------------------------------------------------------- PSIS


@dataclass(frozen=True)
class LooResult:
    """PSIS-LOO of a pointwise log-likelihood (computed by ``az.loo``).

    Attributes
    ----------
    elpd : float
        :math:`\\widehat{\\mathrm{elpd}}_{\\mathrm{loo}}`, summed over points.
    se : float
        Its standard error.
    p_loo : float
        Effective number of parameters.
    pareto_k : numpy.ndarray
        Pareto :math:`\\hat k` of each point's importance ratios ``[N]``.
    good_k : float
        ArviZ's sample-size-dependent threshold :math:`\\min(1 - 1/\\log_{10} S, 0.7)`.
    """

    elpd: float
    se: float
    p_loo: float
    pareto_k: np.ndarray
    good_k: float


def psis_loo(log_lik: Any) -> LooResult:
    r"""Pareto-smoothed importance-sampling leave-one-out cross-validation (Vehtari et al. 2017).

    Parameters
    ----------
    log_lik : array-like
        Pointwise log-likelihood ``[chain, draw, N]`` of the data the posterior was fitted to.

    Returns
    -------
    LooResult

    Notes
    -----
    ArviZ's warning about large :math:`\hat k` is silenced here because :math:`\hat k` is
    returned: the caller reports it (``loo_pareto_k_max``) rather than a log line.

    References
    ----------
    A. Vehtari, A. Gelman, J. Gabry. Practical Bayesian model evaluation using leave-one-out
    cross-validation and WAIC. Statistics and Computing 27, 2017.
    """
    ll = np.asarray(log_lik, dtype=np.float64)
    if ll.ndim != 3:
        raise ValueError(f"log_lik must have shape [chain, draw, N], got {ll.shape}")
    idata = az.from_dict(log_likelihood={"y": ll}, dims={"y": ["obs"]})
    # Relative efficiency of the draws from the ESS of the likelihood values, as R's
    # loo::relative_eff (ArviZ would read it from a posterior group, which a bare array lacks);
    # ESS is scale-invariant, so each point is shifted by its max for stability.
    lik = np.exp(ll - ll.max(axis=(0, 1), keepdims=True))
    ess = np.asarray(az.ess(az.convert_to_dataset({"lik": lik}), method="mean")["lik"].values)
    reff = float(np.nanmean(ess)) / (ll.shape[0] * ll.shape[1]) if np.isfinite(ess).any() else 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        res = az.loo(idata, pointwise=True, reff=reff)
    return LooResult(float(res["elpd_loo"]), float(res["se"]), float(res["p_loo"]),
                     np.asarray(res["pareto_k"].values, dtype=float), float(res["good_k"]))


def pareto_k(log_ratios: Any) -> float:
    r"""Pareto :math:`\hat k` of importance ratios :math:`\log r_s` of ``S`` independent draws.

    Parameters
    ----------
    log_ratios : array-like
        ``[S]``: e.g. :math:`\log p(w_s, y) - \log q(w_s)` for draws of a variational
        approximation (Yao et al. 2018).

    Returns
    -------
    float
        The shape estimate of ``az.psislw``: below 0.5 the importance-sampling estimate
        converges fast; above 0.7 it is unreliable.
    """
    lr = np.asarray(log_ratios, dtype=np.float64)
    if lr.ndim != 1 or lr.size < 5:
        raise ValueError(f"log_ratios must be 1-D with at least 5 draws, got shape {lr.shape}")
    if not np.isfinite(lr).all():
        raise ValueError("log_ratios must be finite")
    _, k = az.psislw(lr, reff=1.0)
    return float(k)


@contextlib.contextmanager
def read_inference_data(path: Any, groups: Sequence[str] | None = None):
    """Open a stored ``InferenceData`` netCDF file lazily, for the ``with`` block only.

    Groups and variables are read from disk when accessed, not at open: a report that draws four
    test inputs' rank plots from a many-chain reference reads those, not the whole file (the
    quickstart's 64-chain gap reference stores 67 MB; opening it eagerly cost 0.6-0.8 CPU s of the
    0.7-1.2 s its rank-ECDF figure took, lazily 0.1 s).  The file is closed when the block ends.

    Parameters
    ----------
    path : str or os.PathLike
        The ``.nc`` file, as written by ``pyrobdl compare`` (``inference_data.nc``).
    groups : sequence of str, optional
        Open only these groups (each must be in the file); default every group.  Opening a group
        reads every variable's metadata: a rank plot needs one of a file's seven groups, 0.03 CPU s
        against ArviZ's 0.2 for all of them.

    Yields
    ------
    arviz.InferenceData
        Valid inside the block only.
    """
    if groups is None:
        with az.rc_context({"data.load": "lazy"}):
            idata = az.from_netcdf(str(path))
        try:
            yield idata
        finally:
            idata.close()
        return
    import xarray as xr

    opened = {}
    try:
        for group in groups:
            opened[group] = xr.open_dataset(str(path), group=group, engine="h5netcdf")
        yield az.InferenceData(**opened)
    finally:
        for ds in opened.values():
            ds.close()


def stored_dims(path: Any) -> dict[str, dict[str, int]]:
    """The groups of a stored ``InferenceData`` netCDF file and their dimension sizes, from its metadata.

    No group is opened as an xarray dataset: the report asks which cells hold a multi-chain sampler
    (a ``sample_stats`` group, ``chain`` above 1) before it draws their rank plots, and opening
    every cell's file with ArviZ to find out cost ~0.1 CPU s per file (22 files in the quickstart,
    16 of them variational fits).

    Parameters
    ----------
    path : str or os.PathLike
        The ``.nc`` file, as written by ``pyrobdl compare`` (``inference_data.nc``).

    Returns
    -------
    dict
        ``{group: {dimension: size}}``, e.g. ``{"posterior": {"chain": 64, "draw": 350, ...}, ...}``.
    """
    import h5netcdf

    with h5netcdf.File(str(path), "r") as f:
        return {name: {d: int(dim.size) for d, dim in group.dimensions.items()} for name, group in f.groups.items()}


# ----------------------------------------------------------------------------- plots


@contextlib.contextmanager
def _arviz_plotting():
    """Silence one known deprecation inside ArviZ 0.23's matplotlib backend.

    ArviZ's kwarg dealiaser calls ``matplotlib.cbook.normalize_kwargs`` with a dict, which
    matplotlib 3.11 deprecates (removal planned for 3.13): a warning about ArviZ's code, not
    pyrobdl's, raised on every trace plot.  Only that message is ignored.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="Passing a dict or None as alias_mapping", category=DeprecationWarning
        )
        yield


def _grid(n: int, cols: int, panel: tuple[float, float]) -> tuple[Figure, np.ndarray]:
    cols = max(1, min(cols, n))
    rows = math.ceil(n / cols)
    fig = Figure(figsize=(panel[0] * cols, panel[1] * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax in axes[n:]:
        fig.delaxes(ax)
    return fig, axes[:n]


def _panel_count(dataset: Any) -> int:
    return int(sum(np.prod([s for dname, s in v.sizes.items() if dname not in ("chain", "draw")] or [1])
                   for v in dataset.data_vars.values()))


def plot_rank(data: Any, *, cols: int = 3) -> Figure:
    """Rank plots (Vehtari et al. 2021) of every scalar in ``data``, one panel each.

    Parameters
    ----------
    data : xarray.Dataset or arviz.InferenceData
        Variables with ``chain`` and ``draw`` dims (select a few scalars first: one panel each).
    cols : int, default 3
        Panels per row.

    Returns
    -------
    matplotlib.figure.Figure
        A figure not registered with pyplot (nothing shown or saved).
    """
    dataset = az.convert_to_dataset(data)
    n = _panel_count(dataset)
    fig, axes = _grid(n, cols, (3.2, 2.4))
    with _arviz_plotting():
        az.plot_rank(dataset, ax=axes, show=False)
    return fig


def plot_trace(dataset: Any, sample_stats: Any = None) -> Figure:
    """Trace plots (density and draws per chain), one row per variable, divergences marked.

    Parameters
    ----------
    dataset : xarray.Dataset
        The (few) variables to plot, with ``chain`` and ``draw`` dims.
    sample_stats : xarray.Dataset, optional
        Sampler statistics of the same draws; ``diverging`` is drawn as ticks when present.

    Returns
    -------
    matplotlib.figure.Figure
    """
    dataset = az.convert_to_dataset(dataset)
    groups = {"posterior": dataset}
    if sample_stats is not None and "diverging" in sample_stats:
        groups["sample_stats"] = sample_stats
    n = len(dataset.data_vars)
    fig = Figure(figsize=(9.0, 2.2 * n), layout="constrained")
    axes = fig.subplots(n, 2, squeeze=False)
    with _arviz_plotting():
        az.plot_trace(az.InferenceData(**groups), axes=axes, compact=True, show=False)
    return fig
