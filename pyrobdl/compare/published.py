r"""Published numbers the report puts beside pyrobdl's, as data.

Every number below is copied from the project's ``REFERENCES.md`` (sections 1 and 2), which cites
the papers; each :class:`PublishedRow` names its paper and table.  "±" values are standard
errors over splits, except for Lakshminarayanan et al. (printed "±", see their paper).  Metrics:
``rmse`` and ``test_ll`` (per-point test log-likelihood) on the original target scale for UCI;
``test_error`` (fraction misclassified) for MNIST.

A suite's method entry lists the rows it should be compared with
(``published = ["gal2016_mc_dropout"]``); a row applies to a result when its ``match`` items
equal the result's dataset source options (and model widths where a row names them).  The table
lives in the suite package, which validates those keys; the report, one layer up, reads it from
here (docs/architecture.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

__all__ = ["PUBLISHED", "PublishedRow", "UCI_PROTOCOL"]

#: The protocol every UCI row shares (REFERENCES.md §1).
UCI_PROTOCOL = (
    "1 hidden layer of 50 ReLU units (protein: 100), X and y standardised with the training split's "
    "statistics, RMSE and test LL on the original scale, mean over 20 splits (protein: 5)"
)


@dataclass(frozen=True)
class PublishedRow:
    """Published results of one method.

    Attributes
    ----------
    key : str
        Identifier used in suites (``published = [...]``).
    label : str
        Short name shown in tables.
    source : str
        Paper and table.
    results : Mapping[str, Mapping[str, tuple[float, float | None]]]
        Dataset key -> metric -> (mean, standard error or None).
    match : Mapping[str, Mapping[str, object]]
        Dataset key -> items a result must have to be compared with it: ``source`` and
        ``name`` (dataset source options), ``hidden`` (model widths) when the row is specific
        to an architecture.
    note : str
        Settings that differ from pyrobdl's defaults.
    """

    key: str
    label: str
    source: str
    results: Mapping[str, Mapping[str, tuple[float, float | None]]]
    match: Mapping[str, Mapping[str, object]] = field(default_factory=dict)
    note: str = ""


def _uci(table: Mapping[str, tuple[tuple[float, float], tuple[float, float]]]) -> dict[str, dict[str, tuple[float, float | None]]]:
    return {name: {"rmse": rmse, "test_ll": ll} for name, (rmse, ll) in table.items()}


def _uci_match(names: object) -> dict[str, dict[str, object]]:
    return {name: {"source": "uci", "name": name} for name in names}  # type: ignore[union-attr]


_GAL2016 = {  # Gal & Ghahramani 2016, Table 1 (arXiv v6 errors): (VI, PBP, MC dropout)
    "boston": (((4.32, 0.29), (3.01, 0.18), (2.97, 0.19)), ((-2.90, 0.07), (-2.57, 0.09), (-2.46, 0.06))),
    "concrete": (((7.19, 0.12), (5.67, 0.09), (5.23, 0.12)), ((-3.39, 0.02), (-3.16, 0.02), (-3.04, 0.02))),
    "energy": (((2.65, 0.08), (1.80, 0.05), (1.66, 0.04)), ((-2.39, 0.03), (-2.04, 0.02), (-1.99, 0.02))),
    "kin8nm": (((0.10, 0.00), (0.10, 0.00), (0.10, 0.00)), ((0.90, 0.01), (0.90, 0.01), (0.95, 0.01))),
    "naval": (((0.01, 0.00), (0.01, 0.00), (0.01, 0.00)), ((3.73, 0.12), (3.73, 0.01), (3.80, 0.01))),
    "power": (((4.33, 0.04), (4.12, 0.03), (4.02, 0.04)), ((-2.89, 0.01), (-2.84, 0.01), (-2.80, 0.01))),
    "protein": (((4.84, 0.03), (4.73, 0.01), (4.36, 0.01)), ((-2.99, 0.01), (-2.97, 0.00), (-2.89, 0.00))),
    "wine": (((0.65, 0.01), (0.64, 0.01), (0.62, 0.01)), ((-0.98, 0.01), (-0.97, 0.01), (-0.93, 0.01))),
    "yacht": (((6.89, 0.67), (1.02, 0.05), (1.11, 0.09)), ((-3.43, 0.16), (-1.63, 0.02), (-1.55, 0.03))),
}


def _gal2016(column: int) -> dict[str, dict[str, tuple[float, float | None]]]:
    return _uci({name: (rmse[column], ll[column]) for name, (rmse, ll) in _GAL2016.items()})


_GAL2016_SOURCE = 'Gal & Ghahramani 2016, "Dropout as a Bayesian Approximation", Table 1 (arXiv v6)'
_GAL2016_NOTE = "40 epochs x10, Adam, l = 1e-2, T = 10,000 test samples; per-dataset p and tau from the authors' code"

_GAL2018 = {  # Gal's 2018 re-run with a grid search over (p, tau), 4000 epochs
    "boston": ((2.90, 0.18), (-2.40, 0.04)),
    "concrete": ((4.83, 0.16), (-2.94, 0.02)),
    "energy": ((0.54, 0.01), (-1.21, 0.01)),
    "kin8nm": ((0.079, 0.001), (1.14, 0.01)),
    "naval": ((0.00074, 0.00005), (4.45, 0.00)),
    "power": ((4.01, 0.04), (-2.81, 0.01)),
    "protein": ((4.27, 0.02), (-2.87, 0.00)),
    "wine": ((0.62, 0.01), (-0.93, 0.01)),
    "yacht": ((0.67, 0.05), (-1.25, 0.02)),
}

_ENSEMBLES = {  # Lakshminarayanan et al. 2017, Table 1, 5 networks, "±" as printed
    "boston": ((3.28, 1.00), (-2.41, 0.25)),
    "concrete": ((6.03, 0.58), (-3.06, 0.18)),
    "energy": ((2.09, 0.29), (-1.38, 0.22)),
    "kin8nm": ((0.09, 0.00), (1.20, 0.02)),
    "naval": ((0.00, 0.00), (5.63, 0.05)),
    "power": ((4.11, 0.17), (-2.79, 0.04)),
    "protein": ((4.71, 0.06), (-2.83, 0.02)),
    "wine": ((0.64, 0.04), (-0.94, 0.12)),
    "yacht": ((1.58, 0.48), (-1.18, 0.21)),
}


def _mnist(errors: Mapping[tuple[int, ...], float]) -> tuple[dict, dict]:
    results = {f"mnist-{'x'.join(map(str, h))}": {"test_error": (e / 100.0, None)} for h, e in errors.items()}
    match = {f"mnist-{'x'.join(map(str, h))}": {"source": "mnist", "name": "mnist", "hidden": list(h)} for h in errors}
    return results, match


_BLUNDELL = 'Blundell et al. 2015, "Weight Uncertainty in Neural Networks", Table 1'
_bbb_g = _mnist({(400, 400): 1.82, (800, 800): 1.99, (1200, 1200): 2.04})
_bbb_mix = _mnist({(400, 400): 1.36, (800, 800): 1.34, (1200, 1200): 1.32})
_sgd_drop = _mnist({(400, 400): 1.51, (800, 800): 1.33, (1200, 1200): 1.36})
_sgd = _mnist({(400, 400): 1.83, (800, 800): 1.84, (1200, 1200): 1.88})
_svd = _mnist({(300, 100): 1.92})
_lenet = _mnist({(300, 100): 1.64})

#: Every published row, by key.
PUBLISHED: dict[str, PublishedRow] = {
    row.key: row
    for row in [
        PublishedRow("gal2016_vi", "VI (Graves 2011), as in Gal 2016", _GAL2016_SOURCE, _gal2016(0),
                     _uci_match(_GAL2016), "mean-field VI of Graves 2011; " + UCI_PROTOCOL),
        PublishedRow("gal2016_pbp", "PBP, as in Gal 2016", _GAL2016_SOURCE, _gal2016(1), _uci_match(_GAL2016),
                     "Hernández-Lobato & Adams 2015; " + UCI_PROTOCOL),
        PublishedRow("gal2016_mc_dropout", "MC dropout (Gal 2016)", _GAL2016_SOURCE, _gal2016(2),
                     _uci_match(_GAL2016), _GAL2016_NOTE),
        PublishedRow("gal2018_mc_dropout", "MC dropout, grid search (Gal 2018)",
                     "Gal's 2018 re-run with a grid search over (p, tau), REFERENCES.md §1",
                     _uci(_GAL2018), _uci_match(_GAL2018),
                     "4000 epochs; (p, tau) chosen by validation LL on the last 20% of each training split"),
        PublishedRow("lakshminarayanan2017_ensembles", "Deep ensembles (5 nets)",
                     'Lakshminarayanan et al. 2017, "Deep Ensembles", Table 1', _uci(_ENSEMBLES),
                     _uci_match(_ENSEMBLES), "± as printed in the paper"),
        PublishedRow("blundell2015_bbb_gaussian", "Bayes by Backprop, Gaussian prior", _BLUNDELL, *_bbb_g),
        PublishedRow("blundell2015_bbb_mixture", "Bayes by Backprop, scale-mixture prior", _BLUNDELL, *_bbb_mix),
        PublishedRow("blundell2015_sgd_dropout", "SGD + dropout", _BLUNDELL, *_sgd_drop),
        PublishedRow("blundell2015_sgd", "SGD", _BLUNDELL, *_sgd),
        PublishedRow("molchanov2017_sparse_vd", "Sparse VD (LeNet-300-100)",
                     'Molchanov et al. 2017, "Variational Dropout Sparsifies DNNs"', *_svd,
                     note="98.9-97.2-62.0% of weights removed per layer, 200 epochs"),
        PublishedRow("molchanov2017_original", "LeNet-300-100, no sparsification",
                     'Molchanov et al. 2017, "Variational Dropout Sparsifies DNNs"', *_lenet),
    ]
}
