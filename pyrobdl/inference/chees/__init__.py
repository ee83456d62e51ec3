r"""Many-chain HMC with ChEES adaptation: every chain advanced in lock-step, one batched gradient.

``fit(model, x, y, method="chees", num_chains=64, ...)`` runs K chains of jittered Hamiltonian
Monte Carlo on the flat log joint of :mod:`pyrobdl.flat`.  Every chain shares the step size,
the diagonal mass matrix and the number of leapfrog steps of an iteration, so each leapfrog
step is *one* call of :meth:`~pyrobdl.flat.FlatLogJoint.value_and_grad` on a ``[K, P]``
batch; the chains differ only in their state, momentum and accept/reject decision.  Sharing
the tuning parameters is what makes the cross-chain adaptation of Hoffman, Radul & Sountsov
(2021) possible:

* **step size** by dual averaging (Hoffman & Gelman 2014) of the *harmonic mean* of the
  chains' acceptance probabilities, target 0.651 (Beskos et al. 2013's optimum for HMC), as
  TFP and BlackJAX do;
* **trajectory length** T by stochastic gradient ascent of the ChEES criterion
  (the Change in the Estimator of the Expected Square,
  :math:`\tfrac14 E[(\lVert\theta'-E\theta'\rVert^2 - \lVert\theta-E\theta\rVert^2)^2]`), whose
  per-chain gradient with respect to :math:`\log T` is
  :math:`h\,T\,(\lVert\theta'-\bar\theta'\rVert^2-\lVert\theta-\bar\theta\rVert^2)\,
  (\theta'-\bar\theta')^\top M^{-1}p'`, averaged over chains with their acceptance
  probabilities as weights, fed to Adam (no momentum, :math:`\beta_2 = 0.95`), each update
  clipped to :math:`\pm 0.35` in log space, and smoothed by a moving average;
* **jitter**: iteration t uses :math:`\lceil h_t T/\epsilon\rceil` leapfrog steps, where
  :math:`h_t \in (0, 1)` is the base-2 Halton (van der Corput) sequence — even coverage of
  trajectory lengths with less variance than uniform draws (the paper's choice);
* **diagonal mass matrix** re-estimated at the end of Stan-style warm-up windows (an initial
  fast buffer, doubling slow windows, a final fast buffer), by default from the variance across
  chains *and* iterations of the window (``mass_matrix="cross-chain"``); or from the chains'
  own variances over the window, pooled into one shared matrix (``"within-chain"``) or kept one
  per chain (``"per-chain"``, the one tuning parameter the chains then do not share);
* **divergences** per chain: a non-finite energy or an energy error above
  ``divergence_threshold``.

The result is the project's :class:`~pyrobdl.inference.mcmc.MCMCPosterior` with K chains, so
every diagnostic, the ArviZ adapter, the suite and the report treat it like ``"nuts"``.

The code, by room: :mod:`.options` (defaults and validation), :mod:`.adaptation` (jitter, warm-up
windows, mass matrix, dual averaging, Adam on log T, the ChEES gradient), :mod:`.kernel` (the
lock-step leapfrog and transition), :mod:`.tempering` (replica exchange and its ladder),
:mod:`.starts` (``init_strategy``), :mod:`.state` (what a run carries and its checkpoint snapshot),
:mod:`.run` (the iterations and the extension until certified), :mod:`.result` (the posterior, its
diagnostics and certification).
"""

from __future__ import annotations

from ..registry import Method, register_method
from .adaptation import MASS_MATRICES, WindowVariance, halton
from .options import CERTIFY_RHATS, CHEES_OPTIONS, INIT_STRATEGIES, JITTERS, _check_options
from .run import run_chees

# names that tests, research probes and the docs reach through pyrobdl.inference.chees (a test
# that patches a name patches it in the module that looks it up, e.g. chees.starts._map_init)
from .adaptation import chees_gradient, warmup_windows  # noqa: F401
from .kernel import _compile, _Sampler  # noqa: F401
from .options import _NOT_IDENTITY  # noqa: F401
from .starts import _map_init  # noqa: F401
from .tempering import _ReplicaTracker, _swap, _Tempered, respace_ladder  # noqa: F401

__all__ = ["CERTIFY_RHATS", "CHEES_OPTIONS", "INIT_STRATEGIES", "JITTERS", "MASS_MATRICES", "WindowVariance", "halton",
           "run_chees"]

register_method(Method(
    "chees", CHEES_OPTIONS, run_chees,
    "Many-chain HMC in lock-step with ChEES adaptation (Hoffman, Radul & Sountsov 2021); certified references",
    check_model=_check_options, init_options={"init_spread": 0.1},
))
