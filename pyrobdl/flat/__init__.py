r"""The flat, batched log joint of a :class:`~pyrobdl.BayesianMLP`: one hot path for every method.

Every latent site of the model is packed into one vector :math:`\theta \in \mathbb R^P` in
*unconstrained* space, and :class:`FlatLogJoint` evaluates, for a batch
:math:`\Theta \in \mathbb R^{K \times P}` (K chains, ensemble members or particles) in one call,

.. math::

    \log \pi(\theta) = \sum_{\text{sites}} \log p(c_s(\theta_s))
        + \log\Bigl|\frac{\partial c_s}{\partial \theta_s}\Bigr|
        + \sum_{n} \log p(y_n \mid f_\theta(x_n), \tau),

with its gradient, where :math:`c_s` maps a site's unconstrained coordinates to its support
(the identity for weights and biases, :math:`\tau = e^{u}` for a learned noise precision).
This is exactly minus the potential energy of Pyro's ``initialize_model`` on the unchanged
model (``tests/test_flat.py`` proves it, value and gradient, for every prior and likelihood).

Layout (:class:`FlatLayout`): the sites in the model's order (``model.prior_distributions()``):
``layers.0.weight`` (``[out, in]``, row-major), ``layers.0.bias``, ``layers.1.weight``, ...,
then the likelihood's latents (``precision``, stored as :math:`\log\tau`).  A model built with
``bias=False`` has no bias sites; the fast path then treats every bias as zero.

The gradient is hand-written for the MLP family (a forward pass, then the backward pass of the
chain rule through each layer as batched matrix products), not taken by autograd: for the
small networks of a BNN benchmark autograd's bookkeeping costs more than the arithmetic.
:meth:`FlatLogJoint.log_joint` is the same function written with differentiable torch ops;
the tests hold the two equal.  Unsupported priors or likelihoods are refused by name when the
object is built, never silently approximated.

Modules: :mod:`~pyrobdl.flat.layout` (the packing), :mod:`~pyrobdl.flat.support` (what is
implemented, refused by name), :mod:`~pyrobdl.flat.logjoint` (the object),
:mod:`~pyrobdl.flat.kernel` (the hand-written value and gradient),
:mod:`~pyrobdl.flat.numpy_kernel` (its numpy twin for small CPU calls),
:mod:`~pyrobdl.flat.fused` (one C++ loop per chain for one-hidden-layer regression networks),
:mod:`~pyrobdl.flat.compiled` (``torch.compile`` code objects).  Everything is importable from
``pyrobdl.flat``, as it was when the package was one module.
"""

from __future__ import annotations

from .layout import FlatLayout, SiteSlice
from .logjoint import FlatLogJoint
from .support import auto_chunk_size

# a private name the samplers import from ``pyrobdl.flat``
from .support import _check_supported  # noqa: F401

__all__ = ["FlatLayout", "FlatLogJoint", "SiteSlice", "auto_chunk_size"]
