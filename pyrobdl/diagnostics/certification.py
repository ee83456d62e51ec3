r"""Certification of an MCMC posterior as a *reference*: has it converged well enough to compare with?

Agreement with a reference posterior means something only when the reference has converged
(DESIGN.md, "A reference is certified or it is not").  :func:`certify` checks an MCMC posterior
against :class:`CertificationCriteria` and returns a :class:`Certification`: pass or fail, the
measured values, and one human-readable sentence per failed criterion.

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
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import torch

from .._validation import check_inputs
from .chain_outliers import chain_outliers
from .rhat import RHAT_DECIMALS, _beyond, _check_ess, _check_rhat, nested_rhat
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

#: R-hat variants :class:`CertificationCriteria` accepts.
RHAT_METHODS = ("split", "nested", "both")
#: How :class:`CertificationCriteria` reads the E-BFMI threshold.
EBFMI_METHODS = ("pooled", "per-chain")
#: Fewest draws per chain with which R-hat and ESS are defined (ArviZ's minimum as well).
MIN_DRAWS = 4
#: At most this many chain indices are listed in an E-BFMI failure sentence.
_MAX_LISTED = 8


def _number(owner: str, name: str, value: Any, *, low: float, strict: bool) -> None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or (value <= low if strict else value < low):
        raise ValueError(f"{owner}.{name} must be a finite number {'>' if strict else '>='} {low:g}, got {value!r}")


def _integer(owner: str, name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{owner}.{name} must be an integer >= {low}, got {value!r}")


@dataclass(frozen=True)
class CertificationCriteria:
    r"""What a posterior must satisfy to be certified as a reference.

    Defaults: posteriordb's reference-posterior definition (R-hat, divergences, E-BFMI) with
    Vehtari et al.'s (2021) ESS of 400 in place of its 10,000 nearly independent draws, carried
    to function space (see the module docstring).

    Attributes
    ----------
    max_rhat : float, default 1.01
        Largest R-hat allowed at every input point and output (every quantity).
    min_ess_bulk : float, default 400
        Smallest bulk effective sample size allowed (all chains together), every quantity
        (Vehtari et al. 2021 ask for 100 per chain with four chains).
    min_ess_tail : float, default 400
        Smallest tail effective sample size (of the 5% and 95% quantiles) allowed.
    max_divergences : int, default 0
        Divergent transitions allowed after warm-up, all chains together.
    min_ebfmi : float, default 0.2
        Smallest E-BFMI allowed: pooled over the chains, or in every chain (``ebfmi``).
    ebfmi : {"pooled", "per-chain"}, default "pooled"
        ``"pooled"``: :func:`ebfmi_pooled`, one estimate from every chain's sampling iterations
        (a chain that wanders in energy weighs in with its large energy variance); ``"per-chain"``:
        :func:`ebfmi` of every chain, Stan's reading, which with many short chains fails on the
        noise of the smallest (module docstring).  Records written before this option existed
        read back as ``"per-chain"``, what they checked.
    rhat : {"split", "nested", "both"}, default "split"
        ``"split"``: rank-normalised split R-hat (Vehtari et al. 2021), what ``az.rhat``
        computes; ``"nested"``: nested R-hat (Margossian et al. 2024, :func:`nested_rhat`) for
        many short chains, chains ``c*superchain_size .. (c+1)*superchain_size - 1`` forming
        superchain ``c``; ``"both"``: each of the two must be at most ``max_rhat`` (the
        strictest reading for many chains started in superchains: nested R-hat asks whether the
        superchains agree, split R-hat whether every chain does).  Nested R-hat is a valid
        check only for chains *started* in
        superchains (each superchain's chains from one common point, e.g. ``fit(...,
        method="chees", superchain_size=M)``): the within-superchain spread then measures what the
        chains forgot of their start.  Over independently started chains the superchain means
        average M independent starts, so even chains that never moved from their prior draws give
        :math:`\hat R_\nu \approx \sqrt{1 + 1/M}` — 1.0078 with M = 64 — and would pass the
        R-hat criterion (and chains that each stay in one mode of a multimodal posterior pass it
        as M grows).
        ``certify`` therefore fails the nested criterion for chains whose trace records another
        start (:attr:`~pyrobdl.inference.mcmc.SamplerTrace.superchain_size`).
    superchain_size : int or None, default None
        Chains per superchain (``rhat="nested"`` or ``"both"`` only); None: the superchains
        the chains were started in (the trace's ``superchain_size``).
    ebfmi_outlier_alpha : float in (0, 1) or None, default 0.01
        Fail a chain whose E-BFMI lies further below the pooled value than the smallest of the
        chains' sampling noise explains (:func:`~pyrobdl.diagnostics.energy.ebfmi_outliers`,
        Bonferroni over the chains at this level): one chain with a pathological energy barely
        moves the pooled value.  None: not checked.  Records written before this option existed
        read back as None, what they checked.
    chain_outlier_alpha : float in (0, 1) or None, default 0.01
        Fail a chain whose mean of some quantity lies further from the chains' median than the
        Monte Carlo error of a chain mean explains
        (:func:`~pyrobdl.diagnostics.chain_outliers.chain_outliers`, Bonferroni over chains and
        quantities at this level; not run with fewer than 8 chains): a few stuck chains among many
        barely move R-hat.  None: not checked (what records written before it read back as).

    Raises
    ------
    ValueError
        For an invalid value; the message names the field.
    """

    max_rhat: float = 1.01
    min_ess_bulk: float = 400.0
    min_ess_tail: float = 400.0
    max_divergences: int = 0
    min_ebfmi: float = 0.2
    rhat: str = "split"
    superchain_size: int | None = None
    ebfmi: str = "pooled"
    ebfmi_outlier_alpha: float | None = 0.01
    chain_outlier_alpha: float | None = 0.01

    def __post_init__(self) -> None:
        owner = "CertificationCriteria"
        _number(owner, "max_rhat", self.max_rhat, low=1.0, strict=True)
        _number(owner, "min_ess_bulk", self.min_ess_bulk, low=0.0, strict=False)
        _number(owner, "min_ess_tail", self.min_ess_tail, low=0.0, strict=False)
        _integer(owner, "max_divergences", self.max_divergences, 0)
        _number(owner, "min_ebfmi", self.min_ebfmi, low=0.0, strict=False)
        if self.rhat not in RHAT_METHODS:
            raise ValueError(f"{owner}.rhat must be one of {list(RHAT_METHODS)}, got {self.rhat!r}")
        if self.ebfmi not in EBFMI_METHODS:
            raise ValueError(f"{owner}.ebfmi must be one of {list(EBFMI_METHODS)}, got {self.ebfmi!r}")
        if self.superchain_size is not None:
            _integer(owner, "superchain_size", self.superchain_size, 1)
        for name in ("ebfmi_outlier_alpha", "chain_outlier_alpha"):
            alpha = getattr(self, name)
            if alpha is not None:
                _number(owner, name, alpha, low=0.0, strict=True)
                if alpha >= 1:
                    raise ValueError(f"{owner}.{name} must be in (0, 1) or None, got {alpha!r}")

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-serialisable)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CertificationCriteria:
        """Inverse of :meth:`to_dict`; missing keys take their defaults, unknown keys are an error."""
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown CertificationCriteria field(s) {unknown}")
        return cls(**dict(data))


#: The one set of criteria every reference is certified against (DESIGN.md, "A reference is
#: certified or it is not"): posteriordb's thresholds, E-BFMI pooled with the outlying-chain test,
#: and **both** R-hats over the superchains the chains were started in (read from the trace).
#: Nested R-hat alone passes a few chains stuck in a shifted mode (4 of 64 chains shifted by 0.5
#: posterior sd: nested R-hat 1.001-1.006 with superchains of 8); split R-hat compares every
#: chain with the others, and the chain-mean outlier test (``chain_outlier_alpha``) fails a few
#: stuck chains that both R-hats pass (docs/diagnostics.md, "Stuck chains").  For chains started
#: independently, where nested R-hat is invalid, use :func:`reference_criteria`.
REFERENCE_CRITERIA = CertificationCriteria(rhat="both", superchain_size=None)


def reference_criteria(superchain_size: int | None) -> CertificationCriteria:
    """:data:`REFERENCE_CRITERIA` for chains started in superchains of ``superchain_size``
    (> 1), else (chains started independently, or unknown) the same criteria with split R-hat
    alone: nested R-hat over independent starts cannot see chains that never moved.

    Parameters
    ----------
    superchain_size : int or None
        Chains per superchain the chains were started in (``trace.superchain_size``).

    Returns
    -------
    CertificationCriteria
    """
    if superchain_size is not None and superchain_size > 1:
        return REFERENCE_CRITERIA
    return dataclasses.replace(REFERENCE_CRITERIA, rhat="split")


@dataclass(frozen=True)
class Certification:
    r"""Whether a posterior is certified as a reference, and what was measured.

    Attributes
    ----------
    passed : bool
        True exactly when ``failures`` is empty.
    failures : tuple of str
        One sentence per failed criterion, e.g. ``"function-space R-hat 1.040 > 1.01 at 12 of 50
        points"`` (R-hat with at least three decimals), ``"7 divergences after warm-up"``, ``"energy not recorded: E-BFMI cannot be
        checked"``.
    rhat_method : {"split", "nested", "both"}
        The R-hat the criterion checked (``criteria.rhat``).
    rhat_max : float
        Largest function-space R-hat the criterion checked, over points and outputs (with
        ``"both"`` the larger of the two R-hats; nan when none could be computed or one is not
        finite somewhere).
    ess_bulk_min, ess_tail_min : float
        Smallest bulk / tail ESS over points and outputs (nan when not computed).
    divergences : int or None
        Divergent transitions after warm-up, all chains (None: no sampler trace).
    ebfmi_min : float or None
        Smallest per-chain E-BFMI (None: energy not recorded; nan: not computable).
    ebfmi_pooled : float or None
        E-BFMI pooled over the chains (:func:`ebfmi_pooled`; None: energy not recorded, or a
        record written before it was computed).
    num_points : int
        Input points the function was evaluated at.
    num_chains, num_draws : int
        Chains, and draws per chain.
    criteria : CertificationCriteria
        What was required.
    rhat_split_max, rhat_nested_max : float or None
        The largest split and nested R-hat separately: split R-hat is recorded whatever the
        criterion (it costs nothing more), nested R-hat when the criterion checks it (None
        otherwise); nan when one could not be computed.
    ebfmi_outliers : dict or None
        What the outlying-chain E-BFMI test measured (:meth:`EBFMIOutliers.to_dict
        <pyrobdl.diagnostics.energy.EBFMIOutliers.to_dict>`: the flagged ``chains`` and their
        ``values``, the pooled ``centre``, the ``noise_sd`` used and its two sources, the
        threshold ``z``); None when it was not checked (``ebfmi_outlier_alpha=None``, no energy,
        fewer than two chains, or a record written before the test existed).
    chain_outliers : dict or None
        What the chain-mean outlier test measured (:meth:`ChainOutliers.to_dict
        <pyrobdl.diagnostics.chain_outliers.ChainOutliers.to_dict>`: the flagged ``chains`` and
        their largest scores ``values``, the ``largest`` score of any chain, the threshold ``z``,
        ``alpha``); None when it was not checked (``chain_outlier_alpha=None``, fewer than 8
        chains or 4 draws, or a record written before the test existed).
    inputs : dict or None
        Where it was checked: ``source`` (``"training inputs"``, ``"held-back inputs"`` or
        ``"certify_inputs"``), ``points`` (how many), ``indices`` (their rows in that set, chosen
        by :func:`~pyrobdl.diagnostics.inputs.spread_indices`; None when the caller gave the
        inputs) and, for given inputs, ``sha256`` of their float64 values; None when not recorded
        (a record written before it was).
    """

    passed: bool
    failures: tuple[str, ...]
    rhat_method: str
    rhat_max: float
    ess_bulk_min: float
    ess_tail_min: float
    divergences: int | None
    ebfmi_min: float | None
    num_points: int
    num_chains: int
    num_draws: int
    criteria: CertificationCriteria = field(default_factory=CertificationCriteria)
    rhat_split_max: float | None = None
    rhat_nested_max: float | None = None
    ebfmi_pooled: float | None = None
    ebfmi_outliers: dict[str, Any] | None = None
    inputs: dict[str, Any] | None = None
    chain_outliers: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "failures", tuple(str(f) for f in self.failures))
        if bool(self.passed) != (not self.failures):
            raise ValueError(f"passed={self.passed!r} contradicts failures={self.failures!r}")

    @classmethod
    def missing(cls, reason: str = "no certification recorded") -> Certification:
        """A failed certification standing for one that was never computed (e.g. an old file)."""
        nan = float("nan")
        return cls(False, (reason,), "split", nan, nan, nan, None, None, 0, 0, 0)

    def summary(self) -> str:
        """One line: ``"certified (...)"`` or ``"not certified: failure; failure"``."""
        if not self.passed:
            return "not certified: " + "; ".join(self.failures)
        nested = f"nested R-hat (superchains of {self.criteria.superchain_size})"
        if self.rhat_method == "both":
            rhat = (f"function-space split R-hat {_fmt(self.rhat_split_max, RHAT_DECIMALS)} and {nested} "
                    f"{_fmt(self.rhat_nested_max, RHAT_DECIMALS)} ≤ {self.criteria.max_rhat:g}")
        else:
            label = nested if self.rhat_method == "nested" else "R-hat"
            rhat = f"function-space {label} {_fmt(self.rhat_max, RHAT_DECIMALS)} ≤ {self.criteria.max_rhat:g}"
        parts = [rhat,
                 f"bulk ESS {_fmt(self.ess_bulk_min, 0)}", f"tail ESS {_fmt(self.ess_tail_min, 0)}",
                 f"{self.divergences} divergences", self._ebfmi_text()]
        return (f"certified ({', '.join(parts)}; {self.num_chains} chains x {self.num_draws} draws "
                f"at {self.num_points} points)")

    def _ebfmi_text(self) -> str:
        out = self.ebfmi_outliers
        within = f", none over {out['z']:.1f} noise sd below the median" if out else ""
        if self.criteria.ebfmi == "pooled" and self.ebfmi_pooled is not None:
            return f"E-BFMI {_fmt(self.ebfmi_pooled, 2)} pooled (smallest chain {_fmt(self.ebfmi_min, 2)}{within})"
        return f"E-BFMI {_fmt(self.ebfmi_min, 2)}"

    def __str__(self) -> str:
        return self.summary()

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-serialisable; a non-finite value is a float nan)."""
        out = dataclasses.asdict(self)
        out["failures"] = list(self.failures)
        out["criteria"] = self.criteria.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Certification:
        """Inverse of :meth:`to_dict`.  Tolerates JSON's losses: a None where a measured float was
        (strict JSON writers store nan as null) reads back as nan.

        Raises
        ------
        ValueError
            If a field is missing or unknown.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        # older records lack the last ones
        optional = {"criteria", "rhat_split_max", "rhat_nested_max", "ebfmi_pooled", "ebfmi_outliers", "inputs",
                    "chain_outliers"}
        missing, unknown = sorted(names - set(data) - optional), sorted(set(data) - names)
        if missing or unknown:
            raise ValueError(f"not a certification record: missing {missing}, unknown {unknown}")
        d = dict(data)
        for key in ("rhat_max", "ess_bulk_min", "ess_tail_min"):
            d[key] = float("nan") if d[key] is None else float(d[key])
        for key in ("split", "nested"):  # an old record has only the criterion's own R-hat
            name = f"rhat_{key}_max"
            value = d.get(name, d["rhat_max"] if d["rhat_method"] == key else None)
            d[name] = None if value is None else float(value)
        for key in ("ebfmi_min", "ebfmi_pooled"):
            if d.get(key) is not None:
                d[key] = float(d[key])
        if d["divergences"] is not None:
            d["divergences"] = int(d["divergences"])
        for key in ("num_points", "num_chains", "num_draws"):
            d[key] = int(d[key])
        d["failures"] = tuple(d["failures"])
        d["passed"] = bool(d["passed"])
        criteria = dict(d.get("criteria") or {})
        # a record from before the option checked E-BFMI in every chain
        criteria.setdefault("ebfmi", "per-chain")
        # ... and no outlying-chain E-BFMI test
        criteria.setdefault("ebfmi_outlier_alpha", None)
        criteria.setdefault("chain_outlier_alpha", None)  # ... and no chain-mean outlier test
        for key in ("ebfmi_outliers", "chain_outliers"):
            if d.get(key) is not None:
                d[key] = dict(d[key])
        d["criteria"] = CertificationCriteria.from_dict(criteria)
        return cls(**d)


def _fmt(value: float | None, decimals: int) -> str:
    if value is None:
        return "—"
    if not math.isfinite(value):
        return str(value)
    return f"{value:.{decimals}f}"


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
    nan = float("nan")
    failures: list[str] = []
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
    return Certification(
        passed=not failures, failures=tuple(failures), rhat_method=criteria.rhat, rhat_max=rhat_max,
        ess_bulk_min=ess_bulk_min, ess_tail_min=ess_tail_min, divergences=divergences,
        ebfmi_min=energy_checks.get("ebfmi_min"), num_points=n, num_chains=c, num_draws=d, criteria=criteria,
        rhat_split_max=split_max, rhat_nested_max=nested_max, ebfmi_pooled=energy_checks.get("ebfmi_pooled"),
        ebfmi_outliers=energy_checks.get("ebfmi_outliers"), chain_outliers=stuck,
    )


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
