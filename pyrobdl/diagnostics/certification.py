r"""Certification of an MCMC posterior as a *reference*: has it converged well enough to compare with?

Agreement with a reference posterior means something only when the reference has converged
(DESIGN.md, "A reference is certified or it is not").  :func:`certify` checks an MCMC posterior
against :class:`CertificationCriteria` and returns a :class:`Certification`: pass or fail, the
measured values, and one human-readable sentence per failed criterion.  The two records and
:data:`REFERENCE_CRITERIA` live in :mod:`pyrobdl.diagnostics.certificate` (importable from here too).

The criteria follow posteriordb's definition of a reference posterior (its
``doc/REFERENCE_POSTERIOR_DEFINITION.md``: R-hat below 1.01, no divergent transitions after
warm-up, the E-BFMI threshold 0.2, and 10,000 nearly independent draws, which pyrobdl replaces by
Vehtari et al.'s (2021) bulk and tail ESS of at least 400), carried to **function space**: R-hat
and ESS are computed for the network output :math:`f(x_n)` at fixed inputs :math:`x_1 \dots x_N`
(class probabilities for classification), not for the weights.  The weights of a neural network
are not identifiable (hidden units can be permuted and their signs flipped without changing the
function), so weight-space R-hat is large and weight-space ESS tiny even for a sampler whose
predictions have converged (DESIGN.md, known traps); the predictions are what a reference is used
for.  A function-space certificate does not prove that every mode of the posterior was visited:
only that the chains agree about the predictions at these inputs.

Two R-hats are available: ``"split"``, the rank-normalised split R-hat of Vehtari et al. (2021)
computed by ArviZ (for a few long chains), and ``"nested"``, the nested R-hat of Margossian et al.
(2024) for many short chains grouped in superchains (:func:`nested_rhat`, implemented here in
numpy since ArviZ has none); ``"both"`` requires each.  Every ArviZ call goes through
:mod:`pyrobdl.diagnostics.arviz_adapter`.

E-BFMI is checked **pooled over the chains** by default (:func:`ebfmi_pooled`), or in every chain
(``CertificationCriteria(ebfmi="per-chain")``, Stan's per-chain warning).  posteriordb's
references have 10,000 draws per chain, where one chain's E-BFMI is a precise estimate; with many
short chains it is not: over 300 draws its sampling noise alone is ~0.1, and on the wine
references (512 chains in eight posteriors) a chain's E-BFMI over its first 300 draws did not
predict its E-BFMI over the next 300 (correlation 0.06; the spread between chains, 0.105, is the
noise's, 0.102), so the smallest of hundreds of chains is a far tail of noise.  The pooled
estimate has the precision posteriordb's per-chain one has (docs/diagnostics.md, "E-BFMI").

References
----------
M. Betancourt. Diagnosing suboptimal cotangent disintegrations in Hamiltonian Monte Carlo.
arXiv:1604.00695, 2016.

M. Magnusson, J. Torgander, P.-C. Bürkner, L. Zhang, B. Carpenter, A. Vehtari. posteriordb:
testing, benchmarking and developing Bayesian inference algorithms (arXiv:2407.04967, 2024); the
reference-posterior definition is ``doc/REFERENCE_POSTERIOR_DEFINITION.md`` of
github.com/stan-dev/posteriordb.

C. C. Margossian, M. D. Hoffman, P. Sountsov, L. Riou-Durand, A. Vehtari, A. Gelman. Nested
:math:`\hat R`: assessing the convergence of Markov chain Monte Carlo when running many short
chains. Bayesian Analysis, 2024 (arXiv:2110.13017).

A. Vehtari, A. Gelman, D. Simpson, B. Carpenter, P.-C. Bürkner. Rank-normalization, folding, and
localization: an improved R-hat for assessing convergence of MCMC. Bayesian Analysis, 2021.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np
import torch

from .._validation import check_inputs
from .chain_outliers import chain_outliers
from .certificate import (EBFMI_METHODS, MIN_DRAWS, REFERENCE_CRITERIA, RHAT_METHODS, Certification,
                          CertificationCriteria, reference_criteria)
from .rhat import _beyond, _check_ess, _check_rhat, nested_rhat
from .energy import EBFMIOutliers, ebfmi, ebfmi_noise_sd, ebfmi_outliers, ebfmi_pooled
from .inputs import certification_points, check_certify_inputs, given_inputs
from .rank_diagnostics import convergence

__all__ = [
    "MIN_DRAWS",
    "REFERENCE_CRITERIA",
    "EBFMI_METHODS",
    "RHAT_METHODS",
    "Certification",
    "CertificationCriteria",
    "attach_certification",
    "certification_points",
    "certify",
    "check_certify_inputs",
    "given_inputs",
    "ebfmi",
    "ebfmi_noise_sd",
    "ebfmi_outliers",
    "ebfmi_pooled",
    "nested_rhat",
    "reference_criteria",
]

#: At most this many chain indices are listed in an E-BFMI failure sentence.
_MAX_LISTED = 8


# ----------------------------------------------------------------------------- certify


def _function_values(posterior: Any, x: Any) -> torch.Tensor:
    """``[chain, draw, N, out]`` float64 on the draws' device: network outputs, or class probabilities."""
    model = posterior.model
    xt = check_inputs(model, x, "x").to(model.device)
    f = posterior.function_draws(xt)
    if model.likelihood.task == "classification":
        f = torch.softmax(f, dim=-1)  # logits are not identifiable (a shared shift changes nothing)
    return f.detach().to(torch.float64)


def _chain_list(idx: np.ndarray) -> str:
    shown = ", ".join(str(int(i)) for i in idx[:_MAX_LISTED])
    more = f", … ({idx.size} chains)" if idx.size > _MAX_LISTED else ""
    return f"chain {shown}" if idx.size == 1 else f"chains {shown}{more}"


def _superchains(posterior: Any, criteria: CertificationCriteria) -> tuple[int | None, str]:
    """The superchain size nested R-hat uses, and why the chains' starts do not allow it ("" if they do)."""
    trace = getattr(posterior, "trace", None)
    started = getattr(trace, "superchain_size", None)
    size = criteria.superchain_size if criteria.superchain_size is not None else started
    if size is None:
        return None, ("nested R-hat needs the chains' superchains: the posterior does not record how its chains "
                      "were started; give CertificationCriteria(superchain_size=M)")
    if started is not None and started != size:
        how = "each from its own point" if started == 1 else f"in superchains of {started}"
        return size, (f"nested R-hat with superchains of {size} needs chains started in superchains of {size} "
                      f"from common points, but these chains were started {how}: over independent starts "
                      "nested R-hat cannot detect chains that stay where they started "
                      f"(use fit(..., method=\"chees\", superchain_size={size}))")
    return size, ""


def certify(posterior: Any, x: Any, criteria: CertificationCriteria | None = None) -> Certification:
    r"""Check an MCMC posterior against the reference-posterior criteria, in function space.

    Parameters
    ----------
    posterior : MCMCPosterior
        Anything with ``model``, ``function_draws(x) -> [chain, draw, N, out]`` and ``trace``
        (a :class:`~pyrobdl.inference.mcmc.SamplerTrace` with ``num_warmup``, ``diverging``
        ``[chain, iteration]`` and ``energy`` ``[chain, iteration]`` or None; or None).
    x : array-like
        Inputs ``[N, in_features]`` at which the function is diagnosed (``run_mcmc`` uses the
        first ``diagnostic_points`` training inputs).
    criteria : CertificationCriteria, optional
        Default :class:`CertificationCriteria()` (posteriordb's thresholds, split R-hat).

    Returns
    -------
    Certification
        Never raises for a failed criterion: an unconverged, too short or untraced posterior
        gets a failed certification saying why.

    Notes
    -----
    * **Quantities**: :math:`f(x_n)_j` for every point and output (regression), or the class
      probabilities :math:`\mathrm{softmax}(f(x_n))_j` (classification).
    * **R-hat**: ``"split"`` is ArviZ's rank-normalised split R-hat.  With a single chain ArviZ
      gives none, so the chain is cut into two halves first (ArviZ then splits each again: the
      four quarters are compared).  ``"nested"`` is :func:`nested_rhat` over the superchains the
      chains were started in (``trace.superchain_size``, or ``criteria.superchain_size``);
      chains that do not form at least two superchains, or were not started in superchains of
      that size, fail the certification (the value is still computed when the shape allows).
    * **ESS**: ArviZ's bulk and tail ESS over all chains.
    * **Divergences**: ``trace.diverging`` after the first ``trace.num_warmup`` iterations.
    * **E-BFMI**: of ``trace.energy`` after warm-up, :func:`ebfmi_pooled` over the chains, or
      :func:`ebfmi` of every chain with ``criteria.ebfmi="per-chain"`` (chains are numbered from 0
      in the failure text).  Both values are recorded whichever is checked.
    * Fewer than :data:`MIN_DRAWS` draws per chain: R-hat and ESS are not computed and the
      certification fails.

    Examples
    --------
    >>> cert = certify(nuts_posterior, x_train[:50])
    >>> cert.passed, cert.failures
    (False, ('function-space R-hat 1.390 > 1.01 at 48 of 50 points', 'bulk ESS 7 < 400 at 50 of 50 points'))
    """
    criteria = CertificationCriteria() if criteria is None else criteria
    if not isinstance(criteria, CertificationCriteria):
        raise TypeError(f"criteria must be a CertificationCriteria, got {type(criteria).__name__}")
    f = _function_values(posterior, x)
    c, d, n = f.shape[:3]
    failures: list[str] = []
    measured, criteria = _check_convergence(posterior, f, criteria, failures)
    divergences, energy_checks = _check_trace(posterior, criteria, failures)
    return Certification(
        passed=not failures, failures=tuple(failures), rhat_method=criteria.rhat, rhat_max=measured["rhat_max"],
        ess_bulk_min=measured["ess_bulk_min"], ess_tail_min=measured["ess_tail_min"], divergences=divergences,
        ebfmi_min=energy_checks.get("ebfmi_min"), num_points=n, num_chains=c, num_draws=d, criteria=criteria,
        rhat_split_max=measured["split_max"], rhat_nested_max=measured["nested_max"],
        ebfmi_pooled=energy_checks.get("ebfmi_pooled"), ebfmi_outliers=energy_checks.get("ebfmi_outliers"),
        chain_outliers=measured["stuck"],
    )


def _check_convergence(posterior: Any, f: torch.Tensor, criteria: CertificationCriteria,
                       failures: list[str]) -> tuple[dict[str, Any], CertificationCriteria]:
    """R-hat, ESS and stuck chains of the function values ``f`` ``[chain, draw, N, out]`` against
    ``criteria``: appends the failure sentences to ``failures``; returns the measured values and
    the criteria with the superchain size nested R-hat used."""
    c, d, n = f.shape[:3]
    nan = float("nan")
    rhat_max = ess_bulk_min = ess_tail_min = split_max = nan
    nested_max: Any = nan if criteria.rhat in ("nested", "both") else None  # None: not checked
    stuck = None
    if d < MIN_DRAWS:
        failures.append(f"{d} draw(s) per chain: at least {MIN_DRAWS} are needed to compute R-hat and ESS")
    else:
        conv = convergence(f)
        if c == 1:
            half = d // 2
            split = convergence(torch.stack([f[0, :half], f[0, d - half:]]))["rhat"]
        else:
            split = conv["rhat"]
        split_max = float(np.max(split))
        checked: list[float] = []
        if criteria.rhat in ("split", "both"):
            checked.append(split_max)
            # "split" when the nested one is checked beside it, so the two failures are told apart
            label = "function-space split R-hat" if criteria.rhat == "both" else "function-space R-hat"
            failures += _check_rhat(split, criteria.max_rhat, label, n)
        if criteria.rhat in ("nested", "both"):
            size, start_failure = _superchains(posterior, criteria)
            if start_failure:
                failures.append(start_failure)
            if size is not None:  # the record says which superchains were used
                criteria = dataclasses.replace(criteria, superchain_size=size)
            if size is not None and (c % size or c // size < 2):
                failures.append(f"nested R-hat needs at least 2 superchains of {size} chains, got {c} chain(s)")
            elif size is not None:
                nested = nested_rhat(f, size)
                nested_max = float(np.max(nested))
                failures += _check_rhat(nested, criteria.max_rhat, "function-space nested R-hat", n)
            checked.append(nested_max)
        # the largest R-hat the criterion checked (nan when one of them could not be computed)
        rhat_max = float(np.max(checked))
        ess_bulk_min, ess_tail_min = float(np.min(conv["ess_bulk"])), float(np.min(conv["ess_tail"]))
        failures += _check_ess(conv["ess_bulk"], criteria.min_ess_bulk, "bulk ESS", n)
        failures += _check_ess(conv["ess_tail"], criteria.min_ess_tail, "tail ESS", n)
        found = None if criteria.chain_outlier_alpha is None else chain_outliers(f, criteria.chain_outlier_alpha)
        if found is not None:
            stuck = found.to_dict()
            failures += [found.sentence()] if found.chains else []
    measured = {"rhat_max": rhat_max, "ess_bulk_min": ess_bulk_min, "ess_tail_min": ess_tail_min,
                "split_max": split_max, "nested_max": nested_max, "stuck": stuck}
    return measured, criteria


def _check_trace(posterior: Any, criteria: CertificationCriteria, failures: list[str]) -> tuple[int | None, dict[str, Any]]:
    """Divergences after warm-up and E-BFMI of the sampler trace against ``criteria``: appends the
    failure sentences to ``failures``; returns the divergence count (None without a trace) and
    :func:`_check_energy`'s values."""
    trace = getattr(posterior, "trace", None)
    divergences: int | None = None
    energy_checks: dict[str, Any] = {}
    if trace is None:
        failures.append("no sampler trace: divergences and energy not recorded")
    else:
        w = int(trace.num_warmup)
        divergences = int(np.asarray(trace.diverging)[:, w:].sum())
        if divergences > criteria.max_divergences:
            allowed = f" (at most {criteria.max_divergences} allowed)" if criteria.max_divergences else ""
            failures.append(f"{divergences} divergence{'s' if divergences != 1 else ''} after warm-up{allowed}")
        energy = getattr(trace, "energy", None)
        if energy is None:
            failures.append("energy not recorded: E-BFMI cannot be checked")
        else:
            energy_checks = _check_energy(np.asarray(energy, dtype=float)[:, w:], criteria, failures)
    return divergences, energy_checks


def _check_energy(e: np.ndarray, criteria: CertificationCriteria, failures: list[str]) -> dict[str, Any]:
    """E-BFMI of ``[chain, iteration]`` sampling energies against ``criteria``: appends the failure
    sentences to ``failures`` and returns ``ebfmi_min``, ``ebfmi_pooled`` and ``ebfmi_outliers``."""
    c = e.shape[0]
    values = ebfmi(e)
    ebfmi_min = float(np.min(values)) if values.size else float("nan")
    pooled = ebfmi_pooled(e) if values.size else float("nan")
    bad = np.flatnonzero(~(values >= criteria.min_ebfmi))
    if criteria.ebfmi == "pooled":
        over = f"pooled over {c} chain{'s' if c != 1 else ''}"
        if not math.isfinite(pooled):
            failures.append(f"E-BFMI not finite {over}")
        elif pooled < criteria.min_ebfmi:
            shown = _beyond(pooled, criteria.min_ebfmi, False)
            failures.append(f"E-BFMI {shown} < {criteria.min_ebfmi:g} {over}")
    elif bad.size:
        finite = values[bad][np.isfinite(values[bad])]
        if finite.size:
            shown = _beyond(float(finite.min()), criteria.min_ebfmi, False)
            failures.append(f"E-BFMI {shown} < {criteria.min_ebfmi:g} in {_chain_list(bad)}")
        else:
            failures.append(f"E-BFMI not finite in {_chain_list(bad)}")
    outliers = None
    if criteria.ebfmi_outlier_alpha is not None:
        found = ebfmi_outliers(e, criteria.ebfmi_outlier_alpha)
        if found is not None:
            outliers = found.to_dict()
            if found.chains:
                failures.append(_outlier_sentence(found))
    return {"ebfmi_min": ebfmi_min, "ebfmi_pooled": pooled, "ebfmi_outliers": outliers}


def _outlier_sentence(found: EBFMIOutliers) -> str:
    """``"E-BFMI 0.062 in chain 5, 7.2 noise sd below the chains' median 0.500 (...)"``."""
    idx = np.asarray(found.chains)
    vals = [f"{v:.3f}" for v in found.values[:_MAX_LISTED]]
    sds = [(found.centre - v) / found.noise_sd for v in found.values]
    how_far = f"{min(sds):.1f}" if len(sds) == 1 else f"{min(sds):.1f}-{max(sds):.1f}"
    return (f"E-BFMI {', '.join(vals)}{', …' if idx.size > _MAX_LISTED else ''} in {_chain_list(idx)}, "
            f"{how_far} noise sd below the chains' median {found.centre:.3f} (noise sd {found.noise_sd:.3f} over "
            f"{found.num_draws} draws; more than {found.z:.2f} sd is an outlier among {found.num_chains} chains "
            f"at alpha {found.alpha:g})")


def attach_certification(posterior: Any, x: Any, criteria: CertificationCriteria | None = None,
                         inputs: Mapping[str, Any] | None = None) -> Certification:
    """Certify ``posterior`` at ``x``, store it on the posterior and in its diagnostics.

    Sets ``posterior.certification`` and ``posterior.diagnostics["certification"]``
    (:meth:`Certification.to_dict`); what every MCMC method calls at the end of its run, so that
    :func:`pyrobdl.fit` can warn about an uncertified posterior and the suite records it.

    Parameters
    ----------
    posterior : MCMCPosterior
        See :func:`certify`.
    x : array-like
        Diagnostic inputs ``[N, in_features]``.
    criteria : CertificationCriteria, optional
        E.g. ``CertificationCriteria(rhat="nested", superchain_size=...)`` for many short chains.
    inputs : Mapping, optional
        Where ``x`` comes from, recorded as the certification's ``inputs`` (what
        :func:`certification_points` returns as ``recorded``).

    Returns
    -------
    Certification
    """
    cert = certify(posterior, x, criteria)
    if inputs is not None:
        cert = dataclasses.replace(cert, inputs=dict(inputs))
    posterior.certification = cert
    posterior.diagnostics["certification"] = cert.to_dict()
    return cert
