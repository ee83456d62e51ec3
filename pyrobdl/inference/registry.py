r"""One registry of inference methods, and :func:`fit`, the single entry point.

A method is a name, a dict of options with their defaults, and a ``run`` function
``run(model, x, y, options, progress) -> Posterior``.  :func:`fit` validates the data and the
options against the registry *before* any work, seeds, moves the model to the device, and calls
``run``.  The comparison runner only ever calls :func:`fit`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np
import pyro
import torch

from .._validation import check_data, check_fit_sizes, check_option_values, resolve_device
from .._saved import lost_in_json
from ..posterior import Posterior, SVIPosterior
from ..torch_interop import init_sites
from .starts import INIT_REPLACES
from .svi import LoopSettings, run_svi

__all__ = ["COMMON_OPTIONS", "Method", "fit", "get_method", "methods", "register_method", "register_svi_method"]

#: Options every method takes, handled by :func:`fit` itself.
COMMON_OPTIONS = ("seed", "device", "progress", "threads")

#: Process-wide default of :func:`fit`'s ``threads`` (the command line's ``--threads`` sets it).
DEFAULTS: dict[str, Any] = {"threads": "auto"}

#: ``threads="auto"`` runs on one thread below this many multiply-adds per gradient
#: (batch size x the network's weights).  Measured (docs/benchmarks.md, "Threads"): on this
#: project's 2-core machine under load, two torch threads were 15-23x slower than one for a
#: 1x50 network and 6-11x slower even for a 2x400 MNIST-sized one (63M multiply-adds per step).
SMALL_WORK = 10_000_000


def resolve_threads(threads: int | str | None, model: Any, batch: int) -> int | None:
    """The torch thread count :func:`fit` uses, or None to leave the process's setting.

    Parameters
    ----------
    threads : int, "auto" or None
        An int >= 1 is used as given; None leaves torch's setting; ``"auto"`` gives one thread
        when a gradient costs fewer than :data:`SMALL_WORK` multiply-adds (where thread
        start-up and, on a busy machine, waiting for a core cost more than they save), else
        the smaller of torch's setting and the cores the load average leaves idle (at least 1).
    model : pyrobdl.BayesianMLP
    batch : int
        Data points per gradient.

    Raises
    ------
    ValueError
        For anything else, naming the value.
    """
    if threads is None:
        return None
    if threads == "auto":
        sizes = (model.in_features, *model.hidden, model.out_features)
        work = batch * sum(a * b for a, b in zip(sizes[:-1], sizes[1:]))
        if work < SMALL_WORK:
            return 1
        try:
            idle = (os.cpu_count() or 1) - math.ceil(os.getloadavg()[0])
        except OSError:
            idle = torch.get_num_threads()
        return max(1, min(torch.get_num_threads(), idle))
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be an integer >= 1, 'auto' or None, got {threads!r}")
    return threads


@contextlib.contextmanager
def _num_threads(n: int | None) -> Any:
    old = torch.get_num_threads()
    if n is not None and n != old:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != old:
            torch.set_num_threads(old)


@dataclass(frozen=True)
class Method:
    """A registered inference method.

    Attributes
    ----------
    name : str
        Registry key.
    options : Mapping[str, Any]
        Every option the method takes, with its default.
    run : callable
        ``run(model, x, y, options, progress) -> Posterior``; ``options`` is complete.
    summary : str
        One line shown by ``pyrobdl methods``.
    check_model : callable or None
        ``check_model(model, options)`` raising ValueError when the method cannot run on the
        model (e.g. an improper prior for MAP or MCMC).
    build_guide : callable or None
        SVI methods: ``build_guide(model, options) -> guide``, the untrained guide the method
        starts from (what :func:`pyrobdl.load_posterior` fills with a saved ``state_dict``).
    init_options : Mapping[str, Any] or None
        None: the method refuses ``fit(..., init=...)``.  Otherwise it starts from the given
        network (``options["init"]``, the model's site values) and these options, with their
        defaults, exist beside it only: they are not in ``options``, so a fit without ``init``
        has the settings (and a suite cell the configuration hash) it had before.
    """

    name: str
    options: Mapping[str, Any]
    run: Callable[..., Posterior]
    summary: str = ""
    check_model: Callable[[Any, Mapping[str, Any]], None] | None = None
    build_guide: Callable[[Any, Mapping[str, Any]], Any] | None = None
    init_options: Mapping[str, Any] | None = None


_REGISTRY: dict[str, Method] = {}


def register_method(method: Method) -> Method:
    """Add ``method`` to the registry (an existing name is replaced) and return it."""
    _REGISTRY[method.name] = method
    return method


def methods() -> list[str]:
    """Sorted names of the registered methods."""
    return sorted(_REGISTRY)


def get_method(name: str) -> Method:
    """Look a method up by name.

    Raises
    ------
    ValueError
        For an unknown name; the message lists the valid ones.
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown method {name!r}; valid methods: {methods()}")
    return _REGISTRY[name]


def rebuild_guide(name: str, model: Any, settings: Mapping[str, Any]) -> Any:
    """A fresh guide of the registered method ``name`` for ``model``, built with the saved
    ``settings`` (those JSON could not hold fall back to the method's defaults): what a loaded
    :class:`~pyrobdl.posterior.SVIPosterior` loads its saved guide state into.

    Raises
    ------
    ValueError
        For an unknown method, or one without a guide.
    """
    method = get_method(name)
    if method.build_guide is None:
        raise ValueError(f"method {name!r} has no guide to rebuild")
    options = {**method.options,
               **{k: v for k, v in settings.items() if k in method.options and not lost_in_json(v)}}
    with torch.random.fork_rng(devices=[]):  # the guide's initial values are overwritten anyway
        return method.build_guide(model, options).to(model.device)


def install_guide_builder() -> None:
    """Make :func:`rebuild_guide` the :attr:`SVIPosterior.guide_builder` hook.

    The posterior contract sits below the registry and imports nothing above it
    (docs/architecture.md); the registry installs this hook when it is imported, and
    :func:`pyrobdl.saving.load_posterior` calls this function before loading.
    """
    SVIPosterior.guide_builder = staticmethod(rebuild_guide)


install_guide_builder()


def require_proper_prior(model: Any, options: Mapping[str, Any]) -> None:
    """``check_model`` for methods that need a normalisable prior (MAP, MCMC)."""
    if not getattr(model.prior, "proper", True):
        valid = [m for m, meth in sorted(_REGISTRY.items()) if meth.check_model is None]
        raise ValueError(
            f"the prior {model.prior!r} is improper, so this method's objective or target is not a "
            f"distribution; use a guide that defines a KL to it, one of {valid}"
        )


_LOOP_FIELDS = tuple(f.name for f in dataclasses.fields(LoopSettings))


def register_svi_method(
    name: str,
    guide_factory: Callable[..., Any],
    guide_options: Mapping[str, Any],
    *,
    summary: str = "",
    loop_defaults: Mapping[str, Any] | None = None,
    check_model: Callable[[Any, Mapping[str, Any]], None] | None = None,
) -> Method:
    """Register an SVI method: a guide factory plus the shared loop.

    Parameters
    ----------
    name : str
        Registry key.
    guide_factory : callable
        ``guide_factory(model, **guide_options) -> BNNGuide``.
    guide_options : Mapping
        The guide's options with defaults.
    summary : str
        One-line description.
    loop_defaults : Mapping, optional
        Method-specific defaults of :class:`~pyrobdl.inference.svi.LoopSettings` fields.
    check_model : callable, optional
        See :class:`Method`.
    """
    loop = dataclasses.asdict(LoopSettings())
    loop.update(loop_defaults or {})
    clash = set(loop) & set(guide_options)
    if clash:
        raise ValueError(f"guide options {sorted(clash)} clash with loop options")

    def build_guide(model: Any, options: Mapping[str, Any]) -> Any:
        kwargs = {k: options[k] for k in guide_options}
        if options.get("init") is not None:  # fit's init=, already the model's site values
            kwargs["init_loc"] = options["init"]
        return guide_factory(model, **kwargs)

    def run(model: Any, x: torch.Tensor, y: torch.Tensor, options: Mapping[str, Any], progress: bool) -> Posterior:
        settings = LoopSettings(**{k: options[k] for k in _LOOP_FIELDS})
        settings.validate(x.shape[0])
        guide = build_guide(model, options).to(x.device)
        return run_svi(model, guide, x, y, settings, method=name, all_settings=dict(options), progress=progress)

    # a guide that takes init_loc starts from given weights: fit(..., init=network) sets it
    init_options = {} if "init_loc" in guide_options else None
    return register_method(Method(name, {**loop, **guide_options}, run, summary, check_model, build_guide, init_options))


def _warn_if_diverged(method: str, posterior: Any) -> None:
    """Warn when a fit's objective ended far worse than it started (e.g. a learning rate too large).

    The history is the per-step objective, higher is better (the ELBO, or the log joint of a
    point estimate).  Diverged means: the median over the last tenth of the steps is below the
    first step's value by more than ``max(1, |first|)``, i.e. more than twice as bad for a
    negative objective.  A fit that merely stalls, or a noisy stochastic ELBO, stays well clear.
    """
    history = getattr(posterior, "history", None)
    if history is None or len(history) < 10:
        return
    h = np.asarray(history, dtype=float)
    window = max(1, len(h) // 10)
    start, end = float(h[0]), float(np.median(h[-window:]))
    if np.isfinite(start) and np.isfinite(end) and end < start - max(1.0, abs(start)):
        warnings.warn(
            f"the {method} fit diverged: its objective went from {start:.4g} at the first step to {end:.4g} "
            f"(median of the last {window} steps); lower lr (now {posterior.settings.get('lr', '?')!r})",
            UserWarning, stacklevel=3,
        )


def _init_options(method: str, meth: Method, init: Any, options: Mapping[str, Any]) -> Mapping[str, Any]:
    """The options ``init`` brings with it (their defaults); raises where ``init`` or they do not apply."""
    extra = meth.init_options or {}
    if init is None:
        stray = sorted(set(options) & set(extra))
        if stray:
            raise ValueError(f"option(s) {stray} of method {method!r} apply only beside init= (a starting network)")
        return {}
    if meth.init_options is None:
        takes = [m for m in methods() if _REGISTRY[m].init_options is not None]
        raise ValueError(f"method {method!r} takes no init= (a starting network); the methods that start from "
                         f"given weights: {takes}")
    clash = [k for k in INIT_REPLACES if k in options]
    if clash:
        raise ValueError(f"init= gives the starting weights; do not pass {clash} beside it")
    return extra


def fit(
    model: Any,
    x: Any,
    y: Any,
    method: str = "mean_field",
    *,
    seed: int = 0,
    device: str | torch.device | None = None,
    progress: bool = True,
    threads: int | str | None = None,
    init: Any = None,
    **options: Any,
) -> Posterior:
    """Approximate the posterior of ``model`` given ``(x, y)`` with a registered method.

    Parameters
    ----------
    model : pyrobdl.BayesianMLP
        The model.
    x : array-like
        Inputs ``[N, in_features]``.
    y : array-like
        Targets: ``[N]`` or ``[N, out]`` (regression), class labels ``[N]`` (classification).
    method : str, default "mean_field"
        A name from :func:`methods`.
    seed : int, default 0
        Seeds Pyro's RNGs (torch, numpy, random) before anything random happens.
    device : str or torch.device, optional
        Where to run; default the device of ``x``.  The model and data are moved there.
    progress : bool, default True
        Show a progress bar.
    threads : int, "auto" or None, optional
        torch CPU threads during the fit (restored afterwards).  Default
        ``DEFAULTS["threads"]``, i.e. ``"auto"``: one thread for small networks (below
        :data:`SMALL_WORK` multiply-adds per gradient: on a busy 2-core machine a 1x50 network
        measured 15-23x slower with two threads than with one), otherwise torch's setting capped
        at the cores the load average leaves idle; see :func:`resolve_threads`.  The count used
        is recorded in the posterior's settings.
    init : torch.nn.Module or state dict, optional
        A trained network (or its ``state_dict``) with the model's architecture (see
        :meth:`pyrobdl.BayesianMLP.from_torch`): the starting point of the methods that take one
        (:mod:`pyrobdl.inference.starts` says what each does with it, and which options it
        adds, e.g. ``fit_map=False`` for post-hoc Laplace); the others refuse it by name.
        Replaces ``init_loc`` / ``init_strategy``, which may not be passed beside it.
    **options
        The method's options (see ``pyrobdl methods``); unknown ones are an error.

    Returns
    -------
    Posterior
        Same interface for every method: ``sample``, ``predict``, ``cost``, ``history``.

    Raises
    ------
    ValueError
        Unknown method or option, invalid data, a model the method cannot handle, or an
        ``init`` the method does not take or that does not fit the model (naming the layer);
        raised before any training.

    Warns
    -----
    UserWarning
        When the posterior carries a certification (MCMC methods) that failed: it is not
        certified as a reference posterior, and the message lists why.

    Examples
    --------
    >>> posterior = fit(model, x, y, method="mean_field", num_steps=2000, lr=1e-2, seed=0)
    >>> posterior.predict(x_test, num_samples=200).mean
    """
    meth = get_method(method)
    init_options = _init_options(method, meth, init, options)
    unknown = sorted(set(options) - set(meth.options) - set(init_options))
    if unknown:
        raise ValueError(
            f"method {method!r} does not take option(s) {unknown}; valid options: "
            f"{sorted(meth.options) + list(COMMON_OPTIONS)}"
        )
    check_option_values(method, meth.options, options)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed must be in 0..2**32-1 (what numpy and torch accept), got {seed}")
    full = {**meth.options, **init_options, **options}
    check_fit_sizes(model, full)  # before anything is allocated
    if init is not None:
        full["init"] = init_sites(model, init)
    if meth.check_model is not None:
        meth.check_model(model, full)
    x, y = check_data(model, x, y)
    dev = resolve_device(device, x.device)
    x, y = x.to(dev), y.to(dev)
    model.to(dev)
    pyro.set_rng_seed(seed)
    if threads is None:
        threads = DEFAULTS["threads"]
    batch = full.get("batch_size")
    batch = batch if isinstance(batch, int) and not isinstance(batch, bool) and batch >= 1 else x.shape[0]
    n_threads = resolve_threads(threads, model, min(batch, x.shape[0]))
    with _num_threads(n_threads):
        full.update(seed=seed, device=str(dev), threads=torch.get_num_threads())
        posterior = meth.run(model, x, y, full, progress)
    _warn_if_diverged(method, posterior)
    certification = getattr(posterior, "certification", None)
    if certification is not None and not certification.passed:
        # where it was certified, when the caller chose (e.g. held-back inputs, as the suite does)
        given = (certification.inputs or {}).get("source") == "certify_inputs"
        where = f" (at the {certification.num_points} certify_inputs)" if given else ""
        warnings.warn(
            f"the {method} posterior is not certified as a reference: {'; '.join(certification.failures)}{where}. "
            "Agreement with it means nothing; run longer chains (docs/diagnostics.md, Certification).",
            UserWarning, stacklevel=2,
        )
    return posterior
