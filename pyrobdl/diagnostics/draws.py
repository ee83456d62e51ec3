"""Posterior draws as chains, and the network's outputs and log-likelihood at them: no ArviZ here.

What :mod:`pyrobdl.diagnostics.arviz_adapter` builds its ``InferenceData`` from (and re-exports):
:func:`chain_draws` reads a posterior only through the generic hooks of
:class:`~pyrobdl.posterior.Posterior` (``_chains``), never through its method name, and every
prediction goes through the posterior's own predictive function (``posterior.function``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyro
import torch

from .._validation import check_data

__all__ = ["chain_draws", "is_point_mass", "pointwise_log_likelihood"]

#: Draws evaluated through the network at once (bounds memory for large test sets).
_CHUNK = 256

#: What this module (and the adapter) reads of a posterior: the hooks and fields of
#: :class:`pyrobdl.posterior.Posterior`.  It sits below the posterior contract
#: (docs/architecture.md: ``Posterior.to_inference_data`` calls down to it), so it checks for them
#: rather than importing the class.
_POSTERIOR_HOOKS = ("_chains", "_sample_stats")
_POSTERIOR_FIELDS = ("model", "method", "settings", "cost")


def _check_posterior(posterior: Any) -> None:
    if not (all(callable(getattr(posterior, h, None)) for h in _POSTERIOR_HOOKS)
            and all(hasattr(posterior, f) for f in _POSTERIOR_FIELDS)):
        raise TypeError(f"posterior must be a pyrobdl Posterior (what fit returns), got {type(posterior).__name__}")


def _check_num_samples(num_samples: Any) -> None:
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be an integer >= 1, got {num_samples!r}")


def chain_draws(posterior: Any, num_samples: int, *, seed: int | None = None) -> dict[str, torch.Tensor]:
    """The posterior's draws grouped into chains, ``{site: [chain, draw, *site_shape]}``.

    Calls the posterior's ``_chains`` hook (independent draws split into pseudo-chains by
    default; the stored Markov chains for MCMC) and checks every site shares ``[chain, draw]``.

    Raises
    ------
    ValueError
        If ``num_samples`` is not a positive integer or the hook returns inconsistent shapes.
    """
    _check_posterior(posterior)
    _check_num_samples(num_samples)
    if seed is not None:
        pyro.set_rng_seed(seed)
    with torch.no_grad():
        chains = posterior._chains(num_samples)
    expected = set(posterior.model.prior_distributions())
    if set(chains) != expected:
        raise ValueError(
            f"{type(posterior).__name__}._chains returned sites {sorted(chains)}, expected {sorted(expected)}"
        )
    heads = {tuple(v.shape[:2]) for v in chains.values() if v.dim() >= 2}
    if len(heads) != 1 or any(v.dim() < 2 for v in chains.values()):
        raise ValueError(f"{type(posterior).__name__}._chains must return [chain, draw, ...] for every site, got "
                         f"{ {k: list(v.shape) for k, v in chains.items()} }")
    return chains


def _flat(chains: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int, int]:
    c, d = next(iter(chains.values())).shape[:2]
    return {k: v.detach().reshape(c * d, *v.shape[2:]) for k, v in chains.items()}, c, d


def is_point_mass(draws: dict[str, torch.Tensor]) -> bool:
    """Whether every draw (leading dim) of every site equals the first: a point estimate.

    Exact equality on purpose: any genuine distribution over weights gives distinct draws.
    A single draw says nothing either way and counts as not a point mass.
    """
    return all(v.shape[0] > 1 and bool((v == v[:1]).all()) for v in draws.values())


def _chunks(flat: dict[str, torch.Tensor], total: int):
    for i in range(0, total, _CHUNK):
        yield {k: v[i : i + _CHUNK] for k, v in flat.items()}


def pointwise_log_likelihood(
    posterior: Any, x: Any, y: Any, num_samples: int = 500, *, seed: int | None = None
) -> np.ndarray:
    """Pointwise log-likelihood ``log p(y_n | w)`` of every chain draw, ``[chain, draw, N]`` (float64).

    Parameters
    ----------
    posterior : Posterior
        Any method's result.
    x, y : array-like
        Data in the model's (training) scale, validated like ``fit``'s.
    num_samples : int, default 500
        Draws to request from the posterior (see :func:`chain_draws`).
    seed : int, optional
        Seed for the draws.
    """
    _check_posterior(posterior)
    model = posterior.model
    x_t, y_t = (t.to(model.device) for t in check_data(model, x, y))
    flat, c, d = _flat(chain_draws(posterior, num_samples, seed=seed))
    with torch.no_grad():
        # the posterior's own predictive function (Laplace's linearised network, ...), not the raw network
        ll = torch.cat([model.likelihood.distribution(posterior.function(p, x_t), p).log_prob(y_t)
                        for p in _chunks(flat, c * d)])
    _check_log_lik_shape(ll, c * d, x_t.shape[0])
    return ll.double().cpu().numpy().reshape(c, d, -1)


def _check_log_lik_shape(ll: torch.Tensor, draws: int, n: int) -> None:
    if tuple(ll.shape) != (draws, n):
        # the DESIGN.md trap: a broadcast gone wrong gives (draw, draw, N) and az.loo "works"
        raise RuntimeError(f"pointwise log-likelihood has shape {list(ll.shape)}, expected [{draws}, {n}]")


def _predictive_draws(posterior: Any, flat: dict[str, torch.Tensor], total: int, x: torch.Tensor, y: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The network output ``f``, the pointwise log-likelihood of ``y`` and one replicate of ``y`` for each
    of the ``total`` draws in ``flat``, in chunks, by the posterior's own predictive function."""
    fs, lls, reps = [], [], []
    with torch.no_grad():
        for p in _chunks(flat, total):
            f = posterior.function(p, x)
            lik = posterior.model.likelihood.distribution(f, p)
            fs.append(f)
            lls.append(lik.log_prob(y))
            reps.append(lik.sample())
    return torch.cat(fs), torch.cat(lls), torch.cat(reps)
