r"""The Laplace approximation: a Gaussian at a MAP estimate with the curvature of the log joint.

``fit(model, x, y, method="laplace", hessian="full")`` finds a MAP estimate :math:`\theta_*`
(the ensemble's batched trainer, :func:`~pyrobdl.inference.ensemble.train_members`, with one
member) and returns

.. math::

    q(\theta) = \mathcal N\bigl(\theta_*,\; (H + c\,D)^{-1}\bigr),\qquad
    H \approx -\nabla^2_\theta \log p(y \mid x, \theta)\big|_{\theta_*},

where :math:`D` is the diagonal precision of the model's Gaussian prior and :math:`c` a scalar
multiplier of it (1, or tuned by the marginal likelihood).  The curvature :math:`H` is

* ``"full"``: the generalised Gauss-Newton matrix :math:`\sum_n J_n^\top \Lambda_n J_n`
  (``curvature="ggn"``, :math:`J_n = \partial f(x_n)/\partial\theta`, :math:`\Lambda_n` the
  Hessian of the negative log-likelihood in the network output) or the exact Hessian
  (``curvature="exact"``), over every weight;
* ``"diag"``: the diagonal of the GGN;
* ``"kron"``: per layer, the Kronecker-factored GGN (K-FAC; Martens & Grosse 2015, Ritter et al.
  2018): :math:`\sum_n G_n \otimes a_n a_n^\top \approx \tfrac1N(\sum_n G_n)\otimes(\sum_n a_n a_n^\top)`
  with :math:`a_n` the layer's input (with a 1 for the bias) and :math:`G_n` the GGN in the
  layer's pre-activations; block-diagonal across layers;
* ``"last_layer"``: the exact Hessian (= GGN, the output is linear in it) of the last layer only,
  every other weight fixed at its MAP value (Kristiadi et al. 2020).

A learned noise precision :math:`\tau = e^u` gets its own one-dimensional block with the exact
second derivative of the log joint in :math:`u` (its cross-curvature with the weights is dropped).

Every block is stored through one eigendecomposition of its prior-whitened curvature
:math:`D^{-1/2} H D^{-1/2} = U \operatorname{diag}(\lambda) U^\top`, from which, for any
:math:`c`, the covariance :math:`D^{-1/2} U (\lambda + c)^{-1} U^\top D^{-1/2}`, the draws
:math:`\theta_* + D^{-1/2} U (\lambda + c)^{-1/2} z` and the log determinant follow.  The
marginal likelihood's stationarity condition in :math:`c` is MacKay's (1992) fixed point
:math:`\gamma(c) = \sum_j \lambda_j / (\lambda_j + c) = c\, \theta_*^\top D \theta_*`, solved by
bisection (``prior_precision="marglik"``; the mean stays at the MAP, as in the post-hoc tuning of
Daxberger et al. 2021).

Why not ``laplace-torch``: measured for torch 2.13 (docs/methods/laplace.md) it pins an alpha
release of ``asdfghjkl`` and pulls ``backpack-for-pytorch``, ``curvlinops-for-pytorch``,
``torchvision`` and ``torchmetrics``; a dry-run install resolved to a different torch build.
The curvatures here are a few Jacobians (``pyrobdl._grad.jacobian``; ``torch.func`` for the exact
Hessian) over the flat layout.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch

from .._grad import jacobian
from ..flat import FlatLogJoint
from ..posterior import Cost, Posterior
from .ensemble import LOOP_OPTIONS, _check_options as _check_ensemble_options, init_members, loop_settings, train_members
from .registry import Method, register_method
from .svi import _peak_memory

__all__ = ["CURVATURES", "HESSIANS", "LAPLACE_OPTIONS", "LaplacePosterior", "PREDICTIVES", "PRIOR_PRECISIONS",
           "run_laplace"]

#: Structures of the curvature.
HESSIANS = ("full", "diag", "kron", "last_layer")
#: Which second derivative: the generalised Gauss-Newton matrix or the exact Hessian.
CURVATURES = ("ggn", "exact")
#: How the prior precision multiplier c is chosen.
PRIOR_PRECISIONS = ("fixed", "marglik")
#: How predictions are made: the network at weight draws, or its linearisation at the MAP.
PREDICTIVES = ("sample", "linearized")
#: Largest dense block (coordinates) a "full" or "kron" curvature may form.
MAX_BLOCK = 6000

LAPLACE_OPTIONS: dict[str, Any] = {
    "hessian": "full",
    "curvature": "ggn",
    "prior_precision": "fixed",
    "predictive": "sample",
    "newton_steps": 0,
    "init_loc": "linear",
    "num_steps": 1000,
    "lr": 1e-2,
    "batch_size": None,
    "lr_schedule": "cosine",
    "average_last": 0.1,
    "data_chunk": 256,
}
#: Options that exist only beside ``fit(..., init=network)``: the MAP fit starts at the network,
#: or (``fit_map=False``) the Gaussian is centred there with no fit: post-hoc Laplace.
LAPLACE_INIT_OPTIONS: dict[str, Any] = {"fit_map": True}


@dataclass
class _Block:
    """One block of the posterior precision: coordinates ``index``, prior-whitening ``d_sqrt``
    (the square root of the prior precision, 1 for an untuned block), eigenvectors ``u``
    (None: diagonal block) and eigenvalues ``lam`` of the whitened curvature; ``tuned``: whether
    the prior multiplier c applies (otherwise the prior is already inside ``lam``)."""

    index: torch.Tensor
    d_sqrt: torch.Tensor
    lam: torch.Tensor
    u: torch.Tensor | None
    tuned: bool
    #: K-FAC with a uniform prior: the eigenvectors are ``kron(U_G, U_A)``, kept as the two factors
    kron: tuple[torch.Tensor, torch.Tensor] | None = None

    def shift(self, c: float) -> torch.Tensor:
        return self.lam + c if self.tuned else self.lam

    def covariance(self, c: float) -> torch.Tensor:
        inv = 1.0 / self.shift(c)
        u = torch.kron(*self.kron) if self.kron is not None else self.u
        if u is None:
            return torch.diag(inv / self.d_sqrt**2)
        m = u / self.d_sqrt.unsqueeze(-1)
        return (m * inv) @ m.t()

    def draw(self, z: torch.Tensor, c: float) -> torch.Tensor:
        """``z [S, m]`` standard normal -> offsets ``[S, m]``."""
        z = z * self.shift(c).rsqrt()
        if self.kron is not None:  # kron(U_G, U_A) vec(Z) = vec(U_G Z U_A^T), row-major
            ug, ua = self.kron
            z = (ug @ z.view(z.shape[0], ug.shape[0], ua.shape[0]) @ ua.t()).reshape(z.shape[0], -1)
        elif self.u is not None:
            z = z @ self.u.t()
        return z / self.d_sqrt


def _whiten(h: torch.Tensor, d: torch.Tensor, tuned: bool, index: torch.Tensor) -> tuple[_Block, int]:
    """Eigendecompose ``D^{-1/2} H D^{-1/2}``; eigenvalues below 0 are clipped to 0, and those
    below ``-1e-9`` times the largest (an exact Hessian away from a minimum, not the round-off
    of a rank-deficient GGN, e.g. dead ReLU units) are counted."""
    d_sqrt = d.sqrt()
    if h.dim() == 1:
        lam, u = h / d, None
    else:
        lam, u = torch.linalg.eigh(h / d_sqrt.unsqueeze(-1) / d_sqrt)
    clipped = int((lam < -1e-9 * float(lam.abs().max().clamp_min(1e-300))).sum())
    return _Block(index, d_sqrt, lam.clamp_min(0.0), u, tuned), clipped


class _Curvature:
    """Per-datum GGN square roots, exact Hessians and layer inputs, in float64, by data chunks."""

    def __init__(self, model: Any, lj: FlatLogJoint, theta: torch.Tensor, chunk: int) -> None:
        self.model, self.layout, self.chunk = model, lj.layout, chunk
        self.theta = theta.double()
        self.x = lj.x.double()
        self.y = lj.y if lj.task == "classification" else lj.y.double()
        self.task = lj.task
        lik = model.likelihood
        if lj.task == "regression":
            self.tau = float(lj.layout.unpack(self.theta)[lik.site]) if getattr(lj, "_learned", False) else float(lik.precision)

    def _f(self, t: torch.Tensor, xb: torch.Tensor) -> torch.Tensor:
        return self.model.network(self.layout.unpack(t), xb)

    def chunks(self):
        for i in range(0, self.x.shape[0], self.chunk):
            yield self.x[i : i + self.chunk], self.y[i : i + self.chunk]

    def ggn_sqrt(self, xb: torch.Tensor, columns: torch.Tensor | None = None) -> torch.Tensor:
        r"""``M_n = \Lambda_n^{1/2\top} J_n`` ``[B, O, P]`` (or its ``columns``), with
        ``\sum_n M_n^\top M_n`` the GGN."""
        jac = jacobian(self._f, self.theta, xb)  # [B, O, P]
        if columns is not None:
            jac = jac[..., columns]
        return self._lambda_root(jac, xb)

    def _lambda_root(self, jac: torch.Tensor, xb: torch.Tensor) -> torch.Tensor:
        r"""``jac`` ``[B, O, m]`` times the square root of the output curvature :math:`\Lambda_n`."""
        if self.task == "regression":
            return jac * math.sqrt(self.tau)
        # categorical: Lambda = diag(p) - p p^T = L L^T with L^T = diag(sqrt p) - sqrt(p) p^T
        p = torch.softmax(self._f(self.theta, xb), -1)  # [B, O]
        mean_jac = (p.unsqueeze(-1) * jac).sum(1, keepdim=True)
        return p.sqrt().unsqueeze(-1) * (jac - mean_jac)

    def exact_hessian(self) -> torch.Tensor:
        """Minus the Hessian of the log-likelihood over every coordinate, ``[P, P]``."""
        lik = self.model.likelihood

        def loglik(t: torch.Tensor, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
            params = self.layout.unpack(t)
            return lik.distribution(self.model.network(params, xb), params).log_prob(yb).sum()

        total = torch.zeros(self.layout.size, self.layout.size, dtype=torch.float64, device=self.x.device)
        for xb, yb in self.chunks():
            # reverse-over-reverse: torch.func.hessian's forward mode warns (torch.jit.script) in torch 2.13
            total -= torch.func.jacrev(torch.func.jacrev(loglik))(self.theta, xb, yb)
        return total

    def _forward(self, xb: torch.Tensor, offsets: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The network at the MAP with ``offsets[i]`` ``[out_i]`` added to layer i's pre-activations:
        the output ``[B, O]`` and each layer's input, with a column of ones when the model has biases."""
        params = self.layout.unpack(self.theta)
        h, inputs = xb, []
        last = len(self.model.hidden)
        for i in range(last + 1):
            bias = params.get(f"layers.{i}.bias")
            inputs.append(h if bias is None else torch.cat([h, h.new_ones(h.shape[0], 1)], 1))
            h = h @ params[f"layers.{i}.weight"].t()
            if bias is not None:
                h = h + bias
            if offsets is not None:
                h = h + offsets[i]
            if i < last:
                h = torch.relu(h) if self.model.activation == "relu" else torch.tanh(h)
        return h, inputs

    def layer_inputs(self, xb: torch.Tensor) -> list[torch.Tensor]:
        """Each layer's input ``[B, in_l]``, with a column of ones ``[B, in_l + 1]`` when the model
        has biases."""
        return self._forward(xb)[1]

    def preactivation_ggn_sqrt(self, xb: torch.Tensor) -> torch.Tensor:
        r"""GGN square roots in every layer's pre-activations, ``[B, O, sum_l out_l]``: the
        Jacobian of :math:`f(x_n)` in an offset added to layer l's pre-activations (shared by the
        batch, so datum n's row is its own pre-activation Jacobian), times :math:`\Lambda_n^{1/2}`.
        The same numbers as the bias columns of :meth:`ggn_sqrt`, with or without biases."""
        widths = [*self.model.hidden, self.model.out_features]
        zero = self.theta.new_zeros(sum(widths))

        def f(eps: torch.Tensor) -> torch.Tensor:
            return self._forward(xb, list(torch.split(eps, widths)))[0]

        return self._lambda_root(jacobian(f, zero), xb)


def _layer_sites(layout: Any, i: int) -> tuple[str, ...]:
    """Layer i's sites present in the layout: its weight, and its bias unless the model has none."""
    return tuple(f"layers.{i}.{k}" for k in ("weight", "bias") if f"layers.{i}.{k}" in layout)


def _weight_index(layout: Any, layers: range) -> torch.Tensor:
    idx = [torch.arange(layout[name].start, layout[name].stop) for i in layers for name in _layer_sites(layout, i)]
    return torch.cat(idx)


def _kron_index(layout: Any, i: int) -> torch.Tensor:
    """Flat coordinates of layer ``i`` in the row-major order of ``[W | b]`` (``[out, in+1]``), or
    of ``W`` (``[out, in]``) for a model without biases."""
    w = layout[f"layers.{i}.weight"]
    out, inp = w.shape
    grid = torch.arange(w.start, w.stop).view(out, inp)
    if f"layers.{i}.bias" not in layout:
        return grid.reshape(-1)
    b = layout[f"layers.{i}.bias"]
    return torch.cat([grid, torch.arange(b.start, b.stop).view(out, 1)], 1).reshape(-1)


def _precision_block(cur: _Curvature, lj: FlatLogJoint) -> tuple[torch.Tensor, float] | None:
    """The learned noise precision's own block: minus the second derivative of the log joint
    in ``u = log tau`` at the MAP (likelihood, Gamma prior and Jacobian), and its index."""
    if not getattr(lj, "_learned", False):
        return None
    sq = 0.0
    for xb, yb in cur.chunks():
        f = cur._f(cur.theta, xb)
        sq += float(((yb.reshape(f.shape) - f) ** 2).sum())
    return torch.tensor([lj._prec_slice.start]), 0.5 * cur.tau * sq + lj._b * cur.tau


def _blocks(model: Any, lj: FlatLogJoint, theta: torch.Tensor, options: Mapping[str, Any]) -> tuple[list[_Block], int]:
    cur = _Curvature(model, lj, theta, options["data_chunk"])
    layout, hessian = lj.layout, options["hessian"]
    num_layers = len(model.hidden) + 1
    prior = lj._prior_prec.double()
    pieces: list[tuple[torch.Tensor, torch.Tensor]] = []  # (index, curvature: [m, m] or [m])
    if hessian == "full":
        idx = _weight_index(layout, range(num_layers))
        if idx.numel() > MAX_BLOCK:
            raise ValueError(f"hessian='full' would form a {idx.numel()}x{idx.numel()} matrix (limit {MAX_BLOCK}); "
                             "use 'kron', 'diag' or 'last_layer'")
        if options["curvature"] == "exact":
            h = cur.exact_hessian()[idx][:, idx]
        else:
            h = sum(torch.einsum("nop,noq->pq", m, m) for m in (cur.ggn_sqrt(xb, idx) for xb, _ in cur.chunks()))
        pieces.append((idx, h))
    elif hessian == "diag":
        idx = _weight_index(layout, range(num_layers))
        pieces.append((idx, sum((cur.ggn_sqrt(xb, idx) ** 2).sum((0, 1)) for xb, _ in cur.chunks())))
    elif hessian == "last_layer":
        idx = _weight_index(layout, range(num_layers - 1, num_layers))
        h = sum(torch.einsum("nop,noq->pq", m, m) for m in (cur.ggn_sqrt(xb, idx) for xb, _ in cur.chunks()))
        pieces.append((idx, h))
    else:  # kron
        kron_blocks, dense = _kron_blocks(model, lj, cur, prior)
        pieces += dense
    blocks, clipped = (kron_blocks if hessian == "kron" else []), 0
    for idx, h in pieces:
        block, c = _whiten(h, prior[idx], True, idx)
        blocks.append(block)
        clipped += c
    extra = _precision_block(cur, lj)
    if extra is not None:
        idx, h = extra
        block, c = _whiten(torch.tensor([h], dtype=torch.float64), torch.ones(1, dtype=torch.float64), False, idx)
        blocks.append(block)
        clipped += c
    return blocks, clipped


def _kron_blocks(model: Any, lj: FlatLogJoint, cur: "_Curvature", prior: torch.Tensor
                 ) -> tuple[list[_Block], list[tuple[torch.Tensor, torch.Tensor]]]:
    """``hessian="kron"``: one Jacobian pass for every layer's two Kronecker factors.  A layer whose
    prior is uniform becomes a block in Kronecker form; one with weight and bias priors of different
    scales a dense ``(index, curvature)`` piece for :func:`_whiten` (refused above ``MAX_BLOCK``)."""
    num_layers = len(model.hidden) + 1
    widths = [*model.hidden, model.out_features]
    g: list[Any] = [0.0] * num_layers
    a: list[Any] = [0.0] * num_layers
    for xb, _ in cur.chunks():
        m = cur.preactivation_ggn_sqrt(xb)  # GGN roots in every layer's pre-activations
        inputs = cur.layer_inputs(xb)
        for i, mi in enumerate(torch.split(m, widths, -1)):
            g[i] = g[i] + torch.einsum("noi,noj->ij", mi, mi)
            a[i] = a[i] + inputs[i].t() @ inputs[i]
    kron_blocks, pieces = [], []
    for i in range(num_layers):
        idx = _kron_index(lj.layout, i)
        d = prior[idx]
        if bool((d == d[0]).all()):
            # a uniform prior keeps the Kronecker structure: eigenvalues are products of the
            # factors' eigenvalues, eigenvectors kron(U_G, U_A), never formed
            lam_g, ug = torch.linalg.eigh(g[i])
            lam_a, ua = torch.linalg.eigh(a[i])
            lam = torch.outer(lam_g.clamp_min(0.0), lam_a.clamp_min(0.0)).reshape(-1) / (lj.num_data * d[0])
            kron_blocks.append(_Block(idx, d.sqrt(), lam, None, True, kron=(ug, ua)))
            continue
        if idx.numel() > MAX_BLOCK:
            raise ValueError(f"hessian='kron': layer {i} has weight and bias priors of different scales and "
                             f"{idx.numel()} coordinates, above the dense-block limit {MAX_BLOCK}; use one prior "
                             "scale per layer, 'diag' or 'last_layer'")
        pieces.append((idx, torch.kron(g[i], a[i]) / lj.num_data))
    return kron_blocks, pieces


def _tune_prior(blocks: list[_Block], theta: torch.Tensor, lo: float = 1e-8, hi: float = 1e8) -> float:
    r"""MacKay's fixed point :math:`\gamma(c) = c\,q` by bisection in :math:`\log c`
    (:math:`\gamma` falls and :math:`c\,q` rises with c, so the root is unique)."""
    lam = torch.cat([b.lam for b in blocks if b.tuned])
    q = float(sum(((theta[b.index] * b.d_sqrt) ** 2).sum() for b in blocks if b.tuned))
    if q <= 0:
        return hi
    a, b = math.log(lo), math.log(hi)
    for _ in range(200):
        mid = 0.5 * (a + b)
        c = math.exp(mid)
        if float((lam / (lam + c)).sum()) > c * q:
            a = mid
        else:
            b = mid
    return math.exp(0.5 * (a + b))


def log_marginal_likelihood(lj: FlatLogJoint, theta: torch.Tensor, blocks: list[_Block], c: float) -> float:
    r"""Laplace's estimate of :math:`\log p(y \mid x)` at prior multiplier ``c``:
    :math:`\log p(y\mid\theta_*) + \log p_c(\theta_*) + \tfrac m2 \log 2\pi - \tfrac12\log\det(H + cD)`,
    m the coordinates the blocks cover; coordinates outside them (point masses) keep their
    prior at c = 1, and the noise precision's Gamma prior is not scaled.

    Parameters
    ----------
    lj : FlatLogJoint
        The model's flat log joint on the training data.
    theta : torch.Tensor
        The mode :math:`\theta_*`, ``[P]``.
    blocks : list
        The curvature blocks of a :class:`LaplacePosterior` (``posterior._blocks``).
    c : float
        Prior precision multiplier.

    Returns
    -------
    float
        The log marginal likelihood estimate (nats).
    """
    t = theta.unsqueeze(0).to(lj.dtype)
    logp, _ = lj.value_and_grad(t)
    lp, _ = lj.log_prior(t)
    th = theta.double()
    d = lj._prior_prec.double()
    weights = d > 0
    gauss_1 = 0.5 * torch.log(d[weights] / (2 * math.pi)).sum() - 0.5 * (d * th * th)[weights].sum()
    total = float(logp - lp) + float(lp) - float(gauss_1)  # log-likelihood + the non-Gaussian prior terms
    scale = torch.ones_like(d)
    for b in blocks:
        if b.tuned:
            scale[b.index] = c
    total += float((0.5 * torch.log(scale * d / (2 * math.pi)) - 0.5 * scale * d * th * th)[weights].sum())
    m = sum(b.index.numel() for b in blocks)
    total += 0.5 * m * math.log(2 * math.pi)
    for b in blocks:
        total -= float(0.5 * (torch.log(b.d_sqrt**2).sum() + torch.log(b.shift(c)).sum()))
    return total


class LaplacePosterior(Posterior):
    r"""A Gaussian :math:`\mathcal N(\theta_*, \Sigma)` over the flat layout (block-diagonal
    :math:`\Sigma`; coordinates outside every block are fixed at :math:`\theta_*`).

    Attributes
    ----------
    mean : torch.Tensor
        :math:`\theta_*`, the MAP estimate, flat and unconstrained ``[P]``.
    prior_precision_multiplier : float
        c: the posterior precision is :math:`H + c D`.
    layout : pyrobdl.flat.FlatLayout
        The packing of the sites.
    """

    def __init__(self, model: Any, mean: torch.Tensor, blocks: list[_Block], c: float, layout: Any,
                 predictive: str, chunk: int, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self.mean = mean
        self._blocks = blocks
        self.prior_precision_multiplier = c
        self.layout = layout
        self.predictive = predictive
        self._chunk = chunk

    def _state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors: dict[str, torch.Tensor] = {"mean": self.mean}
        blocks = []
        for i, b in enumerate(self._blocks):
            for field in ("index", "d_sqrt", "lam"):
                tensors[f"block{i}.{field}"] = getattr(b, field)
            if b.u is not None:
                tensors[f"block{i}.u"] = b.u
            if b.kron is not None:
                tensors[f"block{i}.kron0"], tensors[f"block{i}.kron1"] = b.kron
            blocks.append({"tuned": bool(b.tuned), "u": b.u is not None, "kron": b.kron is not None})
        extra = {"blocks": blocks, "c": float(self.prior_precision_multiplier), "predictive": self.predictive,
                 "chunk": self._chunk}
        return tensors, extra

    @classmethod
    def _from_state(cls, model: Any, tensors: Mapping[str, torch.Tensor], extra: Mapping[str, Any],
                    common: Mapping[str, Any]) -> LaplacePosterior:
        from ..flat import FlatLayout

        blocks = []
        for i, spec in enumerate(extra["blocks"]):
            blocks.append(_Block(
                index=tensors[f"block{i}.index"], d_sqrt=tensors[f"block{i}.d_sqrt"], lam=tensors[f"block{i}.lam"],
                u=tensors[f"block{i}.u"] if spec["u"] else None, tuned=bool(spec["tuned"]),
                kron=(tensors[f"block{i}.kron0"], tensors[f"block{i}.kron1"]) if spec["kron"] else None,
            ))
        layout = FlatLayout(model)
        if tensors["mean"].shape != (layout.size,):
            raise ValueError(f"saved Laplace mean has shape {list(tensors['mean'].shape)}, expected [{layout.size}]")
        return cls(model, tensors["mean"], blocks, float(extra["c"]), layout, extra["predictive"], extra["chunk"], **common)

    def _mean_params(self) -> dict[str, torch.Tensor]:
        return self.layout.unpack(self.mean)

    def covariance(self) -> torch.Tensor:
        """The full covariance ``[P, P]`` (float64; zero rows for point-mass coordinates)."""
        p = self.layout.size
        cov = torch.zeros(p, p, dtype=torch.float64, device=self.mean.device)
        for b in self._blocks:
            cov[b.index.unsqueeze(-1), b.index] = b.covariance(self.prior_precision_multiplier)
        return cov

    def _offsets(self, num_samples: int) -> torch.Tensor:
        delta = torch.zeros(num_samples, self.layout.size, dtype=torch.float64, device=self.mean.device)
        for b in self._blocks:
            z = torch.randn(num_samples, b.index.numel(), dtype=torch.float64, device=self.mean.device)
            delta[:, b.index] = b.draw(z, self.prior_precision_multiplier)
        return delta

    def _draw(self, num_samples: int) -> dict[str, torch.Tensor]:
        theta = self.mean.double() + self._offsets(num_samples)
        return self.layout.unpack(theta.to(self.mean.dtype))

    def function(self, draws: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        r"""The network at the draws (``predictive="sample"``) or, with ``predictive="linearized"``,
        its first-order expansion at the MAP, :math:`f_*(x) + J_*(x)(\theta - \theta_*)` (Immer et
        al. 2021), at the same draws.  :meth:`predict`, the ArviZ export, the training-data
        PSIS-LOO and the report's calibration curve all go through it; see
        :meth:`Posterior.function`."""
        if self.predictive == "sample":
            return self.model.network(draws, x)
        mean64 = self.mean.double()
        delta = self.layout.pack(draws).double() - mean64  # [S, P]

        def f(t: torch.Tensor, xb: torch.Tensor) -> torch.Tensor:
            return self.model.network(self.layout.unpack(t), xb)

        parts = []
        with torch.no_grad():
            for i in range(0, x.shape[0], self._chunk):
                xb = x[i : i + self._chunk].double()
                jac = jacobian(f, mean64, xb)  # [B, O, P]
                parts.append(f(mean64, xb) + torch.einsum("bop,sp->sbo", jac, delta))
        return torch.cat(parts, 1).to(self.mean.dtype)


def _check_options(model: Any, options: Mapping[str, Any]) -> None:
    for name, valid in (("hessian", HESSIANS), ("curvature", CURVATURES), ("prior_precision", PRIOR_PRECISIONS),
                        ("predictive", PREDICTIVES)):
        if options[name] not in valid:
            raise ValueError(f"unknown {name} {options[name]!r}; valid: {list(valid)}")
    if options["curvature"] == "exact" and options["hessian"] != "full":
        raise ValueError(f"curvature='exact' needs hessian='full' (hessian={options['hessian']!r} is a GGN "
                         "approximation; for 'last_layer' the two coincide)")
    for name, low in (("newton_steps", 0), ("data_chunk", 1)):
        v = options[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
    if options["newton_steps"] and options["hessian"] != "full":
        raise ValueError("newton_steps > 0 needs hessian='full' (a Newton step with an approximate curvature "
                         "does not reach the MAP)")
    _check_ensemble_options(model, {**options, "num_members": 1, "prior": True, "chunk_size": None})
    if options.get("fit_map", True) not in (True, False):
        raise TypeError(f"fit_map must be True or False, got {options['fit_map']!r}")


def run_laplace(model: Any, x: torch.Tensor, y: torch.Tensor, options: Mapping[str, Any], progress: bool) -> Posterior:
    """MAP estimate, curvature, prior precision, Gaussian (``fit``'s ``run`` for ``"laplace"``).

    Parameters
    ----------
    model : pyrobdl.BayesianMLP
        The model, on the data's device.
    x, y : torch.Tensor
        Validated training data.
    options : Mapping
        Every option of :data:`LAPLACE_OPTIONS`, plus ``seed``.
    progress : bool
        Show a progress bar for the MAP fit.

    Returns
    -------
    LaplacePosterior
        ``history`` is the MAP fit's log joint per step; ``diagnostics`` holds the prior
        multiplier c, the Laplace log marginal likelihood at c, the number of clipped negative
        curvature eigenvalues and the effective number of parameters :math:`\\gamma`.  With
        ``fit(..., init=net, fit_map=False)`` (post-hoc) there is no MAP fit: ``history`` is
        empty, the cost counts no gradient, ``map_log_joint`` is the full-data log joint at the
        given weights and ``log_joint_gradient_norm`` the norm of its gradient there.
    """
    device = x.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start, cpu_start = time.perf_counter(), time.process_time()
    settings = loop_settings({k: options[k] for k in LOOP_OPTIONS}, x.shape[0])
    lj = FlatLogJoint(model, x, y)
    theta0 = init_members(model, lj, 1, options["init_loc"] if options.get("init") is None else options["init"])
    if options.get("fit_map", True):
        trained = train_members(lj, theta0, settings, progress=progress, desc="laplace (MAP)")
        theta, history, gradients, epochs = trained.theta[0], trained.history[:, 0], trained.gradient_evaluations, trained.epochs
    else:  # post-hoc: at the given weights, which may not be a mode of this log joint (see the gradient norm)
        theta, history, gradients, epochs = theta0[0], np.zeros(0), 0, 0.0
    for _ in range(options["newton_steps"]):
        blocks, _ = _blocks(model, lj, theta, options)
        _, g = lj.value_and_grad(theta.unsqueeze(0).double().to(lj.dtype))
        step = torch.zeros(lj.size, dtype=torch.float64, device=device)
        for b in blocks:
            step[b.index] = b.covariance(1.0) @ g[0].double()[b.index]
        theta = (theta.double() + step).to(theta.dtype)
        gradients += 1
    blocks, clipped = _blocks(model, lj, theta, options)
    c = 1.0 if options["prior_precision"] == "fixed" else _tune_prior(blocks, theta.double())
    lam = torch.cat([b.lam for b in blocks if b.tuned])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    cost = Cost(wall_time_s=wall, gradient_evaluations=gradients, epochs=epochs + options["newton_steps"],
                peak_memory_bytes=_peak_memory(device), device=str(device), cpu_time_s=cpu)
    diagnostics = {
        "prior_precision_multiplier": c,
        "log_marginal_likelihood": log_marginal_likelihood(lj, theta, blocks, c),
        "effective_parameters": float((lam / (lam + c)).sum()),
        "clipped_eigenvalues": clipped,
        "map_log_joint": float(history[-1]) if len(history) else float(lj.value_and_grad(theta.unsqueeze(0))[0][0]),
    }
    if not options.get("fit_map", True):
        diagnostics["log_joint_gradient_norm"] = float(lj.value_and_grad(theta.unsqueeze(0))[1].norm())
    return LaplacePosterior(model, theta, blocks, c, lj.layout, options["predictive"], options["data_chunk"],
                            method="laplace", settings=dict(options), cost=cost, history=history,
                            diagnostics=diagnostics)


register_method(Method(
    "laplace", LAPLACE_OPTIONS, run_laplace,
    "Laplace approximation at the MAP: full/GGN, diagonal, Kronecker-factored or last-layer curvature (MacKay 1992)",
    check_model=_check_options, init_options=LAPLACE_INIT_OPTIONS,
))
