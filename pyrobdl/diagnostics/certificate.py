"""The certification records: what a reference posterior must satisfy (:class:`CertificationCriteria`,
:data:`REFERENCE_CRITERIA`) and what was measured (:class:`Certification`), with their dict forms.

:func:`~pyrobdl.diagnostics.certification.certify` fills them in; the module docstring of
:mod:`pyrobdl.diagnostics.certification` explains the criteria.  Everything here is importable
from ``pyrobdl.diagnostics.certification`` as well.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from .rhat import RHAT_DECIMALS

#: R-hat variants :class:`CertificationCriteria` accepts.
RHAT_METHODS = ("split", "nested", "both")
#: How :class:`CertificationCriteria` reads the E-BFMI threshold.
EBFMI_METHODS = ("pooled", "per-chain")
#: Fewest draws per chain with which R-hat and ESS are defined (ArviZ's minimum as well).
MIN_DRAWS = 4


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
    to function space (see :mod:`pyrobdl.diagnostics.certification`).

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
