r"""The Bayesian multilayer perceptron, a ``PyroModule`` whose weights are ``PyroSample`` sites."""

from __future__ import annotations

from typing import Callable, Sequence

import pyro
import pyro.distributions as dist
import torch
from pyro.nn import PyroModule, PyroSample

from .likelihoods import Gaussian as GaussianLikelihood
from .likelihoods import Likelihood
from .poutine import linear
from .priors import Gaussian as GaussianPrior
from .priors import Prior, Site
from .torch_interop import init_sites, parse_module

__all__ = ["ACTIVATIONS", "BayesianMLP"]

#: Activation functions by name.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": torch.relu,
    "tanh": torch.tanh,
}


class _SitePrior:
    """A site's prior as ``PyroSample`` wants it, ``layer -> distribution`` on the layer's device;
    a class rather than a closure so that a model (and a posterior holding one) pickles."""

    def __init__(self, site: Site, prior: Prior) -> None:
        self.site, self.prior = site, prior

    def __call__(self, layer: torch.nn.Module) -> dist.Distribution:
        return self.prior.site_distribution(self.site, layer.anchor.device)


def _site_prior(site: Site, prior: Prior) -> Callable[[torch.nn.Module], dist.Distribution]:
    return _SitePrior(site, prior)


def _drop_plate_dim(value: torch.Tensor, event_dim: int) -> torch.Tensor:
    """Map Pyro's batch layout of a global site to the network's.

    Under an outer plate (vectorized particles, ``Predictive(parallel=True)``) a global site has
    batch shape ``[*P, 1]``: the trailing 1 is the slot of the ``data`` plate (dim -1).
    :meth:`BayesianMLP.network` wants ``[*P]``, so that slot is removed.
    """
    if value.dim() > event_dim:
        return value.squeeze(value.dim() - event_dim - 1)
    return value


class _Layer(PyroModule):
    """One linear layer: ``weight`` and (unless ``bias`` is None) ``bias`` are PyroSample attributes."""

    def __init__(self, weight: Site, bias: Site | None, prior: Prior) -> None:
        super().__init__()
        # a zero-size buffer so the layer knows its device after .to(device)
        self.register_buffer("anchor", torch.zeros(0), persistent=False)
        self.weight = PyroSample(_site_prior(weight, prior))
        if bias is not None:
            self.bias = PyroSample(_site_prior(bias, prior))


class BayesianMLP(PyroModule):
    r"""A fully connected network with a prior on every weight and bias.

    The model is :math:`w \sim p(w)`, (``precision`` :math:`\sim p(\tau)` for a learned-noise
    likelihood), :math:`y_n \sim p(y_n \mid f_w(x_n))` for each data point inside
    ``pyro.plate("data")``.

    Parameters
    ----------
    in_features : int
        Number of inputs.
    hidden : sequence of int
        Widths of the hidden layers; ``()`` gives Bayesian linear (or logistic) regression.
    out_features : int
        Number of outputs (classes for a categorical likelihood).
    activation : {"relu", "tanh"}
        Hidden-layer nonlinearity.
    prior : pyrobdl.priors.Prior, optional
        Weight prior; default ``priors.Gaussian(scale=1.0)``.
    likelihood : pyrobdl.likelihoods.Likelihood, optional
        Observation model; default ``likelihoods.Gaussian(precision=1.0)``.
    bias : bool, default True
        Whether every layer has a bias.  ``bias=False`` leaves the ``layers.{i}.bias`` sites
        out altogether (NumPyro's BNN example, for instance, has none).

    Notes
    -----
    Sample sites, one per tensor, in this order: ``layers.{i}.weight`` (shape ``[out, in]``),
    ``layers.{i}.bias`` (shape ``[out]``; absent with ``bias=False``) for ``i = 0 .. len(hidden)``, then the likelihood's
    own sites (``precision`` for :class:`~pyrobdl.likelihoods.GaussianLearnedPrecision`), then
    the observed site ``obs`` inside the plate ``data`` (dim -1).  All weight dims are event
    dims, so each weight site has empty batch shape and vectorized particles or ``Predictive``
    draws add leading dimensions.  ``forward`` returns the network output ``f`` of shape
    ``[..., N, out_features]``.

    One site per tensor (rather than one per layer) was kept because pyrobdl's hot path does
    not trace (see :class:`pyrobdl.inference.DirectELBO`): per-site cost there is a handful of
    tensor ops, measured in ``comparisons/benchmarks/svi_step.py``.

    Examples
    --------
    >>> model = BayesianMLP(8, (50,), 1, activation="relu",
    ...                     prior=priors.Gaussian(1.0), likelihood=likelihoods.Gaussian(10.0))
    """

    def __init__(
        self,
        in_features: int,
        hidden: Sequence[int] = (50,),
        out_features: int = 1,
        activation: str = "relu",
        prior: Prior | None = None,
        likelihood: Likelihood | None = None,
        bias: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(bias, bool):
            raise TypeError(f"bias must be True or False, got {bias!r}")
        widths = [in_features, *hidden, out_features]
        for name, w in [("in_features", in_features), ("out_features", out_features)] + [
            (f"hidden[{i}]", h) for i, h in enumerate(hidden)
        ]:
            if isinstance(w, bool) or not isinstance(w, int) or w < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {w!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; valid: {sorted(ACTIVATIONS)}")
        prior = GaussianPrior(1.0) if prior is None else prior
        likelihood = GaussianLikelihood(1.0) if likelihood is None else likelihood
        if not isinstance(prior, Prior):
            raise TypeError(f"prior must be a pyrobdl.priors.Prior, got {type(prior).__name__}")
        if not isinstance(likelihood, Likelihood):
            raise TypeError(
                f"likelihood must be a pyrobdl.likelihoods.Likelihood, got {type(likelihood).__name__}"
            )
        if likelihood.task == "classification" and out_features < 2:
            raise ValueError("out_features must be >= 2 (the number of classes) for a categorical likelihood")
        num_layers = len(widths) - 1
        prior.validate(num_layers)

        self.in_features = in_features
        self.hidden = tuple(hidden)
        self.out_features = out_features
        self.activation = activation
        self.prior = prior
        self.likelihood = likelihood
        self.bias = bias
        per_layer = [
            (Site(f"layers.{i}.weight", i, "weight", (widths[i + 1], widths[i]), widths[i], num_layers),
             Site(f"layers.{i}.bias", i, "bias", (widths[i + 1],), widths[i], num_layers) if bias else None)
            for i in range(num_layers)
        ]
        self.sites: tuple[Site, ...] = tuple(s for pair in per_layer for s in pair if s is not None)
        self.layers = PyroModule[torch.nn.ModuleList]([_Layer(w, b, prior) for w, b in per_layer])
        self._act = ACTIVATIONS[activation]

    @classmethod
    def from_torch(
        cls, module: torch.nn.Module, prior: Prior | None = None, likelihood: Likelihood | None = None
    ) -> "BayesianMLP":
        """The Bayesian version of a plain PyTorch network: same architecture, a prior on every weight.

        Parameters
        ----------
        module : torch.nn.Module
            An ``nn.Sequential`` (or any module whose leaf modules, in order, are) of ``nn.Linear``
            layers with ``nn.ReLU`` or ``nn.Tanh`` between them, with or without biases;
            ``nn.Identity`` and ``nn.Dropout`` (identities at evaluation) are skipped.  Its
            weights are not copied: pass the module as ``fit(..., init=module)`` to start there.
        prior, likelihood
            As in :class:`BayesianMLP`.

        Returns
        -------
        BayesianMLP
            With the module's ``in_features``, hidden widths, ``out_features``, activation and
            ``bias``; a single ``nn.Linear`` gives ``hidden=()``.

        Raises
        ------
        ValueError
            Naming the layer that cannot be mapped (a convolution, a normalisation, another
            activation, widths that do not chain, ...; see
            :func:`pyrobdl.torch_interop.parse_module`), or when the module's ``forward`` does
            not compute its layers in order (checked on random inputs).

        Examples
        --------
        >>> net = torch.nn.Sequential(torch.nn.Linear(8, 50), torch.nn.ReLU(), torch.nn.Linear(50, 1))
        >>> model = BayesianMLP.from_torch(net, prior=priors.Gaussian(1.0))
        """
        arch = parse_module(module)
        model = cls(arch.in_features, arch.hidden, arch.out_features, activation=arch.activation or "relu",
                    prior=prior, likelihood=likelihood, bias=arch.bias)
        init_sites(model, module)  # the module's forward() must compute these layers (checked on random inputs)
        return model

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, hidden={self.hidden}, out_features={self.out_features}, "
            f"activation={self.activation!r}, prior={self.prior!r}, likelihood={self.likelihood!r}"
            + ("" if self.bias else ", bias=False")
        )

    @property
    def device(self) -> torch.device:
        """Device of the model's buffers (where prior parameters are created)."""
        return self.layers[0].anchor.device

    def prior_distributions(self) -> dict[str, dist.Distribution]:
        """Prior of every latent site, in site order (weights, biases, likelihood sites)."""
        device = self.device
        priors = {s.name: self.prior.site_distribution(s, device) for s in self.sites}
        priors.update(self.likelihood.latent_distributions(device))
        return priors

    def network(self, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """Network output for given weights.

        Parameters
        ----------
        params : dict
            Site name -> value; each value may carry leading particle dimensions ``[*P]``.
        x : torch.Tensor
            Inputs ``[N, in_features]``.

        Returns
        -------
        torch.Tensor
            ``[*P, N, out_features]``.
        """
        h = x
        last = len(self.layers) - 1
        for i in range(last + 1):
            h = linear(h, params[f"layers.{i}.weight"], params.get(f"layers.{i}.bias"))
            if i < last:
                h = self._act(h)
        return h

    def log_likelihood(
        self, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
    ) -> torch.Tensor:
        """Pointwise log-likelihood ``log p(y_n | x_n, params)``, shape ``[*P, N]``.

        ``y`` must already be in the likelihood's shape (see ``likelihood.prepare_targets``).
        """
        f = self.network(params, x)
        return self.likelihood.distribution(f, params).log_prob(y)

    def forward(
        self, x: torch.Tensor, y: torch.Tensor | None = None, subsample: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Run the generative model.

        Parameters
        ----------
        x : torch.Tensor
            All inputs, ``[N, in_features]``.
        y : torch.Tensor, optional
            Targets (``[N]`` or ``[N, out]``); sampled when None.
        subsample : torch.Tensor, optional
            Indices of a minibatch: the plate ``data`` then has size N and scales the
            likelihood by ``N / len(subsample)``.

        Returns
        -------
        torch.Tensor
            The network output on the (sub)sampled inputs, ``[..., B, out_features]``.
        """
        if x.dim() != 2 or x.shape[-1] != self.in_features:
            raise ValueError(f"x must have shape [N, {self.in_features}], got {list(x.shape)}")
        params = {}
        for layer_index, layer in enumerate(self.layers):
            params[f"layers.{layer_index}.weight"] = _drop_plate_dim(layer.weight, 2)
            if self.bias:
                params[f"layers.{layer_index}.bias"] = _drop_plate_dim(layer.bias, 1)
        for name, prior in self.likelihood.latent_distributions(self.device).items():
            params[name] = _drop_plate_dim(pyro.sample(name, prior), len(prior.event_shape))
        if y is not None:
            y = self.likelihood.prepare_targets(y, self.out_features)
            if y.shape[0] != x.shape[0]:
                raise ValueError(f"y has {y.shape[0]} rows but x has {x.shape[0]}")
        with pyro.plate("data", x.shape[0], subsample=subsample, dim=-1) as idx:
            if subsample is not None:
                x = x[idx]
                y = None if y is None else y[idx]
            f = self.network(params, x)
            pyro.sample("obs", self.likelihood.distribution(f, params), obs=y)
        return f
