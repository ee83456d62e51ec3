r"""The posterior contract: what every inference method returns.

Every method (SVI guides, MAP, and MCMC in later modules) returns a :class:`Posterior`: it draws
weights (:meth:`Posterior.sample`), predicts (:meth:`Posterior.predict`, one implementation for
all methods, from weight draws), and carries its :class:`Cost`, its ``history`` and its
``settings``.  Subclasses only say how to draw weights.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping

import numpy as np
import pyro
import torch

from ._validation import check_inputs
from .torch_interop import to_sequential

if TYPE_CHECKING:
    from .diagnostics.certification import Certification

__all__ = ["Cost", "Posterior", "Prediction", "SVIPosterior"]


@dataclass(frozen=True)
class Cost:
    """What a fit cost.

    Attributes
    ----------
    wall_time_s : float
        Wall-clock seconds of the fit (setup and training; CUDA synchronised at the end).
    gradient_evaluations : int
        Gradients of the log joint evaluated: SVI steps x particles (each on one minibatch);
        for MCMC, leapfrog steps.
    epochs : float
        Full-data-equivalent gradient passes: ``gradient_evaluations * batch / N``; equals
        ``gradient_evaluations`` for full-batch methods such as MCMC.
    peak_memory_bytes : int
        CUDA: peak allocated memory during the fit.  CPU: the process's peak resident set size
        (a high-water mark for the whole process, not only this fit).
    device : str
        Device the fit ran on, e.g. ``"cpu"`` or ``"cuda:0"``.
    cpu_time_s : float or None
        Process CPU seconds of the fit (all threads), beside the wall time: on a shared
        machine wall time also measures other people's jobs.  None where not recorded.
    """

    wall_time_s: float
    gradient_evaluations: int
    epochs: float
    peak_memory_bytes: int
    device: str
    cpu_time_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-serialisable)."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Prediction:
    """Posterior predictive at a set of inputs.

    Attributes
    ----------
    samples : torch.Tensor
        Function draws ``[S, N, out_features]``: regression means, or classification logits.
    mean : torch.Tensor
        Predictive mean ``[N, out]``: :math:`E[y]` (regression) or mean class probabilities.
    variance : torch.Tensor
        Predictive variance ``[N, out]``.  Regression: ``epistemic + aleatoric``.
        Classification: :math:`\\bar p(1-\\bar p)` per class.
    epistemic_variance : torch.Tensor
        Variance over draws of the function (regression) or of class probabilities.
    aleatoric_variance : torch.Tensor or None
        Expected observation-noise variance :math:`E[\\tau^{-1}]` (regression), None for
        classification.
    """

    samples: torch.Tensor
    mean: torch.Tensor
    variance: torch.Tensor
    epistemic_variance: torch.Tensor
    aleatoric_variance: torch.Tensor | None
    _likelihood: Any = field(repr=False, default=None)
    _latents: Mapping[str, torch.Tensor] = field(repr=False, default_factory=dict)

    def log_likelihood(self, y: Any) -> torch.Tensor:
        """Pointwise log-likelihood of targets under each draw, ``[S, N]``.

        Parameters
        ----------
        y : array-like
            Targets in the model's training scale (``[N]`` or ``[N, out]``; labels for
            classification).
        """
        y = torch.as_tensor(y, device=self.samples.device)
        y = y.long() if self._likelihood.task == "classification" else y.to(self.samples.dtype)
        y = self._likelihood.prepare_targets(y, self.samples.shape[-1])
        if y.shape[0] != self.samples.shape[-2]:
            raise ValueError(f"y has {y.shape[0]} rows but the prediction has {self.samples.shape[-2]}")
        return self._likelihood.distribution(self.samples, self._latents).log_prob(y)


class Posterior:
    """Base of every method's result.

    Attributes
    ----------
    model : pyrobdl.BayesianMLP
        The model the posterior is over.
    method : str
        Registry name of the method that produced it.
    settings : dict
        Every option of the method, defaults filled in.
    cost : Cost
        What the fit cost.
    history : numpy.ndarray
        Per-step objective trace (the ELBO for SVI; empty when a method has none).
    diagnostics : dict
        Method-specific diagnostics (sampler statistics for MCMC; empty for SVI).
    certification : pyrobdl.diagnostics.Certification or None
        Whether the posterior is certified as a reference (function-space R-hat, ESS,
        divergences, E-BFMI; see ``docs/diagnostics.md``): set by methods that produce Markov
        chains, None for the others (and for chains not yet certified).
    """

    certification: Certification | None = None

    def __init__(
        self,
        model: Any,
        method: str,
        settings: Mapping[str, Any],
        cost: Cost,
        history: np.ndarray | None = None,
        diagnostics: Mapping[str, Any] | None = None,
    ) -> None:
        self.model = model
        self.method = method
        self.settings = dict(settings)
        self.cost = cost
        self.history = np.zeros(0) if history is None else history
        self.diagnostics = dict(diagnostics or {})

    def __repr__(self) -> str:
        return f"{type(self).__name__}(method={self.method!r}, cost={self.cost})"

    def _draw(self, num_samples: int) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """What :meth:`save` writes beyond the common fields: ``(tensors, json_extras)``.

        Subclasses that can be saved override this and :meth:`_from_state`.
        """
        raise TypeError(f"{type(self).__name__} cannot be saved")

    @classmethod
    def _from_state(cls, model: Any, tensors: Mapping[str, torch.Tensor], extra: Mapping[str, Any],
                    common: Mapping[str, Any]) -> Posterior:
        """Rebuild a posterior from :meth:`_state`'s output; ``common`` holds the constructor's
        ``method``, ``settings``, ``cost``, ``history`` and ``diagnostics``."""
        raise TypeError(f"{cls.__name__} cannot be loaded")

    def save(self, path: Any) -> Any:
        """Save to the folder ``path``: JSON for settings and metadata, plain tensors for the rest
        (no pickle); load with :func:`pyrobdl.load_posterior`.  See :mod:`pyrobdl.saving`.

        Parameters
        ----------
        path : str or os.PathLike
            Folder to write (replaced atomically if it holds an earlier save).

        Returns
        -------
        pathlib.Path
        """
        from ._saved import write_posterior

        return write_posterior(self, path)

    def sample(self, num_samples: int, *, seed: int | None = None) -> dict[str, torch.Tensor]:
        """Draw weights (and likelihood latents) from the posterior.

        Parameters
        ----------
        num_samples : int
            Number of joint draws.
        seed : int, optional
            Seed for the draws (global torch RNG is reseeded when given).

        Returns
        -------
        dict
            Site name -> tensor ``[num_samples, *site_shape]``.
        """
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples must be an integer >= 1, got {num_samples!r}")
        if seed is not None:
            pyro.set_rng_seed(seed)
        with torch.no_grad():
            return self._draw(num_samples)

    def predict(self, x: Any, num_samples: int = 200, *, seed: int | None = None) -> Prediction:
        """Posterior predictive at inputs ``x`` from ``num_samples`` weight draws.

        Parameters
        ----------
        x : array-like
            Inputs ``[N, in_features]``.
        num_samples : int, default 200
            Number of weight draws.
        seed : int, optional
            Seed for the draws.

        Returns
        -------
        Prediction
        """
        x = check_inputs(self.model, x).to(self.model.device)
        draws = self.sample(num_samples, seed=seed)
        with torch.no_grad():
            return predictive_from_draws(self.model, draws, x, f=self.function(draws, x))

    def function(self, draws: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """The function this posterior's predictive puts at weight draws: ``[S, N, out]``.

        The network itself (:meth:`BayesianMLP.network`) by default; a posterior whose predictive
        is another function of the draws (Laplace's linearised network) overrides it.  Every
        consumer of draws — :meth:`predict`, the ArviZ export, the training-data PSIS-LOO, the
        report's calibration curve — goes through it, so they all score the same predictive.

        Parameters
        ----------
        draws : dict
            Site name -> ``[S, *site_shape]`` (constrained), e.g. from :meth:`sample`.
        x : torch.Tensor
            Validated inputs ``[N, in_features]`` on the model's device.

        Returns
        -------
        torch.Tensor
            Regression means or classification logits, ``[S, N, out_features]``.
        """
        return self.model.network(draws, x)

    def _mean_params(self) -> dict[str, torch.Tensor]:
        """The posterior mean of every weight and bias site, where the family has one network
        as its mean (overridden by the Gaussian and point-mass families)."""
        raise ValueError(
            f"the {self.method} posterior ({type(self).__name__}) holds networks from several modes (ensemble members "
            "or Markov chains, whose hidden units may be permuted relative to each other); the average of their "
            "weights is not a network of the posterior. Use to_torch(kind='draw', seed=...)"
        )

    def to_torch(self, kind: str = "mean", *, seed: int | None = None) -> torch.nn.Module:
        """The network at the posterior mean, or at one posterior draw, as a plain ``nn.Sequential``.

        Parameters
        ----------
        kind : {"mean", "draw"}, default "mean"
            ``"mean"``: the posterior mean of the weights (the guide's mean for SVI methods, the
            mode for MAP and Laplace; refused for ensembles and MCMC, whose weight average is
            not a network of the posterior).  ``"draw"``: the weights of
            ``sample(1, seed=seed)`` (for an ensemble that is member 0 and for MCMC the first
            stored draw, since their draws go through a fixed set in order; build any member with
            :func:`pyrobdl.torch_interop.to_sequential`).
        seed : int, optional
            Seed of the draw; only with ``kind="draw"``.

        Returns
        -------
        torch.nn.Sequential
            ``nn.Linear`` layers with the model's activation between them, whose output equals
            the model's network at those weights (regression mean or classification logits).

        Raises
        ------
        ValueError
            For another ``kind``, a ``seed`` with ``kind="mean"``, or ``kind="mean"`` on a
            posterior without a mean network.
        """
        if kind == "mean":
            if seed is not None:
                raise ValueError("seed only applies to to_torch(kind='draw'); the mean network is not random")
            with torch.no_grad():
                params = {k: v.detach() for k, v in self._mean_params().items()}
        elif kind == "draw":
            params = {k: v[0] for k, v in self.sample(1, seed=seed).items()}
        else:
            raise ValueError(f"unknown kind {kind!r}; valid: ['mean', 'draw']")
        return to_sequential(self.model, params)

    def _chains(self, num_samples: int) -> dict[str, torch.Tensor]:
        """Draws grouped into chains for ArviZ, ``{site: [chain, draw, *site_shape]}``.

        Default: ``num_samples`` independent draws of :meth:`_draw` split into pseudo-chains
        (4, 2 or 1 of equal length, at least 4 draws each; see :func:`pseudo_chain_count`), so
        ArviZ's R-hat/ESS are defined (and near 1 / ``num_samples`` for independent draws).
        Posteriors that hold a fixed set of Markov chains (MCMC) override this to return them
        (all, or thinned consistently with :meth:`_sample_stats`).
        """
        chains = pseudo_chain_count(num_samples)
        return {k: v.reshape(chains, num_samples // chains, *v.shape[1:]) for k, v in self._draw(num_samples).items()}

    def _sample_stats(self, num_samples: int) -> dict[str, Any]:
        """Per-draw sampler statistics ``{name: [chain, draw]}`` aligned with :meth:`_chains`.

        Empty by default.  MCMC posteriors return ArviZ's conventional names (``diverging``,
        ``step_size``, ``tree_depth``, ``n_steps``, ``acceptance_rate``, ``energy``, ``lp``), which
        become the ``sample_stats`` group of :meth:`to_inference_data`.
        """
        return {}

    def to_inference_data(self, x: Any, y: Any, num_samples: int = 500, *, seed: int | None = None) -> Any:
        """Convert to ``arviz.InferenceData`` at data ``(x, y)``; see
        :func:`pyrobdl.diagnostics.arviz_adapter.to_inference_data` for the groups and dims.

        Parameters
        ----------
        x : array-like
            Inputs ``[N, in_features]``.
        y : array-like
            Targets or class labels for ``x`` (the model's scale).
        num_samples : int, default 500
            Draws for methods that draw on demand (MCMC returns its stored chains).
        seed : int, optional
            Seed for the draws and posterior-predictive replicates.

        Returns
        -------
        arviz.InferenceData
        """
        from .diagnostics.arviz_adapter import to_inference_data  # ArviZ lives behind the adapter

        return to_inference_data(self, x, y, num_samples, seed=seed)


def pseudo_chain_count(num_samples: int) -> int:
    """Pseudo-chains for ``num_samples`` independent draws: the largest of 4, 2, 1 that divides
    ``num_samples`` with at least 4 draws per chain (ArviZ's minimum for R-hat), else 1."""
    return next((c for c in (4, 2) if num_samples % c == 0 and num_samples // c >= 4), 1)


def predictive_from_draws(
    model: Any, draws: Mapping[str, torch.Tensor], x: torch.Tensor, f: torch.Tensor | None = None
) -> Prediction:
    """Build a :class:`Prediction` from joint weight draws (leading sample dim) at inputs ``x``;
    ``f`` ``[S, N, out]`` replaces the network's outputs at the draws when given (e.g. a
    linearised network)."""
    f = model.network(draws, x) if f is None else f
    lik = model.likelihood
    if lik.task == "classification":
        probs = torch.softmax(f, dim=-1)
        mean = probs.mean(0)
        return Prediction(f, mean, mean * (1 - mean), probs.var(0, unbiased=False), None, lik, dict(draws))
    mean = f.mean(0)
    epistemic = f.var(0, unbiased=False)
    aleatoric = lik.noise_variance(draws, f).expand_as(f).mean(0)
    return Prediction(f, mean, epistemic + aleatoric, epistemic, aleatoric, lik, dict(draws))


class SVIPosterior(Posterior):
    """Result of an SVI method: the trained guide is the posterior.

    Attributes
    ----------
    guide : pyrobdl.guides.BNNGuide
        The trained Pyro guide, usable with ``pyro.infer.Predictive``.
    """

    #: How a loaded SVI posterior rebuilds its guide: ``guide_builder(method, model, settings)``
    #: returns a fresh guide of the method named ``method`` with the saved ``settings``.  The
    #: method registry lives above this contract (docs/architecture.md), so it installs itself
    #: here when imported (:func:`pyrobdl.inference.registry.install_guide_builder`); None before.
    guide_builder: ClassVar[Callable[[str, Any, Mapping[str, Any]], Any] | None] = None

    def __init__(self, model: Any, guide: Any, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self.guide = guide

    def _draw(self, num_samples: int) -> dict[str, torch.Tensor]:
        return self.guide.sample_params(num_samples)

    def _mean_params(self) -> dict[str, torch.Tensor]:
        # the mean of each weight site's variational distribution (a Delta's point, a Gaussian's
        # loc, (1 - p) times the rows of Bernoulli dropout)
        sites = {s.name for s in self.model.sites}
        return {k: q.mean for k, q in self.guide.variational_distributions().items() if k in sites}

    def _state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        # the whole state_dict: independent of how a guide names or packs its parameters
        return dict(self.guide.state_dict()), {}

    @classmethod
    def _from_state(cls, model: Any, tensors: Mapping[str, torch.Tensor], extra: Mapping[str, Any],
                    common: Mapping[str, Any]) -> SVIPosterior:
        if cls.guide_builder is None:
            raise RuntimeError("rebuilding an SVI posterior's guide needs the method registry: import "
                               "pyrobdl.inference first (pyrobdl.load_posterior does)")
        guide = cls.guide_builder(common["method"], model, common["settings"])
        try:
            guide.load_state_dict(dict(tensors), strict=True)
        except RuntimeError as e:
            raise ValueError(f"the saved guide state does not fit a fresh {type(guide).__name__}: {e}") from e
        return cls(model, guide, **common)
