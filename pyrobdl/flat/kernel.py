"""The hand-written value and gradient of the flat log joint: the samplers' hot path.

:func:`value_and_grad` is :meth:`FlatLogJoint._value_and_grad <pyrobdl.flat.FlatLogJoint>`: a
forward pass, ``dlogp/df``, the backward pass through the hidden layers, then layer 0's one
GEMM.  Each step is a function of the log joint ``lj`` (its layout, likelihood and data); the
statements are those of the single function they came from, in the same order (the outputs
are bit-identical, and ``torch.compile`` traces through the calls).

Layout: hidden activations are ``[K, H, B]`` (chain-major, then unit, then data point), so the
first layer is one GEMM over every chain at once, forward (``[K*H, in+1] @ [in+1, B]``) and backward
(``[K*H, B] @ [B, in+1]``, whose ``[K, H, in+1]`` result is the sites' own layout), the other layers
are batched products over contiguous ``[K, ., B]`` blocks, and every elementwise pass runs along
the data (a unit's gradient broadcast over the data point, not over a dimension of H elements).  A layer stores its
activations ``h = tanh(a)`` or ``relu(a)`` in place of the pre-activation, and the backward pass
reads them (``tanh'(a) = 1 - h^2``, ``relu'(a) = 1[h > 0]``).
"""

from __future__ import annotations

from typing import Any

import torch

#: Layer 0's backward product ``[K*H, B] @ [B, in+1]`` is computed as ``([in+1, B] @ [B, K*H])^T``
#: while ``g`` takes at most this many bytes: MKL's product alone was 1.1-3x faster that way for ``g``
#: of 0.2-1.6 MB and 1.3-1.9x slower from 3.2 MB on, and in the whole call faster at gap's 0.2 MB,
#: slower at a 2 x 20 net's 1 MB (2-core Xeon, 2 MB of L2 a core, torch 2.13;
#: ``comparisons/benchmarks/flat_kernel_pair.py``)
_SMALL_BYTES = 2**19


def value_and_grad(
    lj: Any, theta: torch.Tensor, idx: torch.Tensor | None, prior: bool = True, functional: bool = False,
    value: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Log joint ``[K]`` and gradient ``[K, P]`` of ``lj`` (a FlatLogJoint) at ``theta`` ``[K, P]``.

    ``idx``: minibatch indices ``[B]`` or ``[K, B]`` (the likelihood scaled by N/B), or None;
    ``functional``: no ``out=`` writes (for ``torch.compile``); ``value=False``: for a Gaussian likelihood
    of fixed precision the log joint is not summed and None is returned in its place (the gradient's
    operations are the same, so its bits are too).  Call under ``torch.no_grad``.
    """
    x1, y, scale = batch(lj, idx)
    per_row = x1.dim() == 3  # [K, B, in+1]
    k, b = theta.shape[0], x1.shape[-2]
    tanh = lj._act == "tanh"
    fixed = lj.task != "classification" and not lj._learned  # a Gaussian of fixed precision tau
    lik_const = scale * b * lj._lik_const_point if fixed else 0.0  # its normaliser, added with the prior's
    skip = fixed and not value  # the value's own operations (a leapfrog's inner steps read only the gradient)
    if prior:
        grad = theta * lj._neg_prior_prec  # d/dtheta of the Gaussian prior
        # theta * theta: theta.square() is pow(theta, 2), the same product through a copied scalar;
        # lj.const: numbers as 0-d tensors (torch copies a Python number at every tensor-scalar op)
        logp = None if skip else torch.mv(theta * theta, lj._half_neg_prior_prec).add_(lj.const(lj._prior_const + lik_const))
    else:
        grad = torch.zeros_like(theta)
        logp = None if skip else theta.new_full((k,), lik_const)
    layers = lj._weights(theta)
    last = lj._num_layers - 1
    w0aug, zs, f = _forward(x1, layers, last, tanh, per_row, k, b)
    if fixed:  # the likelihood's constant is in logp already: one pass less over [K]
        r = y - f
        aux = (r, None, None, None)
        if not skip:
            logp.add_((r * r).sum((-1, -2)), alpha=-0.5 * lj._tau * scale)
    else:
        ll, aux = lj._log_lik(f, y, theta)
        logp += ll if scale == 1.0 else scale * ll
    gf = _output_grad(lj, f, y, theta, aux, grad, logp, scale, prior, per_row, k, b)
    # relu into one output unit: relu(a) = a * 1[a > 0] and a0 = w0aug x1^T, so the output
    # weight's gradient sum_b g[k,b] relu(a0[k,h,b]) equals sum_i w0aug[k,h,i] S[k,h,i], where
    # S = (g masked by 1[a0 > 0]) x1 is the GEMM layer 0's gradient computes anyway: one
    # pass over the [K, H, B] activations less (they are read from memory, not cache)
    homogeneous = lj._fold_output_grad and not tanh and last == 1 and layers[1][0].shape[1] == 1
    pieces: dict[str, torch.Tensor] = {}  # each layer site's likelihood gradient, added to grad at the end
    g, factor = _backward_hidden(lj, gf, zs, layers, pieces, last, tanh, homogeneous, functional, k, b)
    _backward_layer0(lj, g, x1, w0aug, factor, pieces, last, homogeneous, per_row, k, b)
    _add_pieces(lj, grad, pieces, k)
    return logp, grad


def batch(lj: Any, idx: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The augmented inputs, targets and likelihood scale of ``lj`` on minibatch ``idx``: all the data
    and 1 for None; ``[B]`` (or ``[K, B]``, each row of theta on its own minibatch) and N / B."""
    if idx is None:
        return lj._x1, lj.y, 1.0
    return lj._x1[idx], lj.y[idx], lj.num_data / idx.shape[-1]


def _add_pieces(lj: Any, grad: torch.Tensor, pieces: dict[str, torch.Tensor], k: int) -> None:
    """Add the layer sites' gradients ``pieces`` into ``grad`` ``[K, P]``: concatenated in layout order
    and added as one block when the layer sites are the layout's first columns (they are for every
    model pyrobdl builds), else site by site."""
    parts = [(name, pieces[name] if pieces[name].dim() == 2 else pieces[name].reshape(k, -1)) for name in lj._layer_sites]
    if lj._layer_stop is None:
        for name, part in parts:
            sl = lj.layout[name]
            grad[:, sl.start : sl.stop].add_(part)
        return
    block = parts[0][1] if len(parts) == 1 else torch.cat([part for _, part in parts], 1)
    (grad if lj._layer_stop == grad.shape[1] else grad[:, : lj._layer_stop]).add_(block)


def _forward(x1, layers, last, tanh, per_row, k, b):
    """Layer 0's augmented weights ``[K, H, in+1]``, the hidden activations ``[K, H, B]`` and the
    outputs ``[K, B, O]`` (a view of ``[K, O, B]``)."""
    w0, b0 = layers[0]
    w0aug = torch.cat([w0, b0.unsqueeze(-1)], -1)  # [K, H, in+1]
    if per_row:  # x1 [K, B, in+1]
        a = torch.bmm(w0aug, x1.transpose(1, 2))  # [K, H, B]
    else:
        a = torch.mm(w0aug.view(-1, x1.shape[1]), x1.t()).view(k, -1, b)  # [K, H, B]
    zs = []  # per hidden layer: tanh(a) or relu(a), [K, H, B]
    for j in range(1, last + 1):
        # in place: the pre-activation is a fresh product not needed again (one [K, H, B]
        # allocation less per layer; large allocations measured ~30% of an elementwise op)
        z = a.tanh_() if tanh else a.relu_()
        zs.append(z)
        w, bias = layers[j]
        a = torch.baddbmm(bias.unsqueeze(-1), w, z)  # [K, Hout, Hin] @ [K, Hin, B] -> [K, Hout, B]
    return w0aug, zs, a.transpose(1, 2)


def _output_grad(lj, f, y, theta, aux, grad, logp, scale, prior, per_row, k, b):
    """``dlogp/df`` ``[K, B, O]``; a learned precision's gradient (and prior) go into ``grad``, ``logp``."""
    if lj.task == "classification":
        gf = -torch.softmax(f, -1)
        gf.scatter_add_(-1, y.view(-1 if per_row else 1, b, 1).expand(k, -1, 1), torch.ones_like(gf[..., :1]))
        if scale != 1.0:
            gf *= scale
    else:
        r, tau, u, m = aux
        if lj._learned:
            gf = r * (scale * tau).view(k, 1, 1)
            sq = (r * r).sum((-1, -2))
            grad[:, lj._prec_slice.start] = scale * (0.5 * m - 0.5 * tau * sq)
            if prior:
                value, du = lj.precision_log_prior(theta)
                grad[:, lj._prec_slice.start] += du
                logp += value
        else:
            gf = r * lj.const(scale * lj._tau)
    return gf


def _backward_hidden(lj, gf, zs, layers, pieces, last, tanh, homogeneous, functional, k, b):
    """Backward through layers last .. 1, their sites' gradients into ``pieces``; ``g = dlogp/da_0``
    ``[K, H0, B]`` (up to a factor), and the factor ``[K, H0, 1]`` (or None) layer 0's gradient
    applies after its GEMM."""
    g = gf.transpose(1, 2)  # g = dlogp/da_j, [K, Hout, B]
    factor: torch.Tensor | None = None
    for j in range(last, 0, -1):
        z = zs[j - 1]
        w, _ = layers[j]
        gsum = g.sum(-1)  # [K, Hout]
        if not homogeneous:  # g h^T, [K, Hout, Hin]
            # (one bmm into a fresh tensor: into grad's strided view it measured 3x slower)
            pieces[f"layers.{j}.weight"] = torch.bmm(g, z.transpose(1, 2))
        if f"layers.{j}.bias" in lj.layout:
            pieces[f"layers.{j}.bias"] = gsum
        if j == 1 and w.shape[1] == 1:
            # dlogp/da0[k,h,b] = g[k,b] w[k,h] act'(a0)[k,h,b]: w is applied after the GEMM
            gb = g.expand(k, z.shape[1], b)
            factor = w.transpose(1, 2)  # [K, H, 1]
        else:
            gb = torch.bmm(w.transpose(1, 2), g)  # [K, Hin, B]
        # written into z (not needed again); torch.compile: out= into z miscompiled (torch 2.13, measured
        # on the earlier strided layout)
        if tanh:  # tanh'(a) = 1 - h^2
            g = (torch.ops.aten.tanh_backward(gb, z) if functional
                 else torch.ops.aten.tanh_backward.grad_input(gb, z, grad_input=z))
        else:
            g = (torch.ops.aten.threshold_backward(gb, z, 0.0) if functional
                 else torch.ops.aten.threshold_backward.grad_input(gb, z, 0.0, grad_input=z))
    return g, factor


def _backward_layer0(lj, g, x1, w0aug, factor, pieces, last, homogeneous, per_row, k, b):
    """Layer 0: one GEMM ``[K*H0, B] @ [B, in+1]``, its sites' gradients into ``pieces``."""
    if per_row:
        r0 = torch.bmm(g, x1)  # [K, H0, in+1]
    elif g.numel() * g.element_size() <= _SMALL_BYTES:  # the same product as (x1^T g^T)^T: 1.1-3x faster
        r0 = torch.mm(x1.t(), g.reshape(-1, b).t()).t().view(k, -1, x1.shape[1])  # there (MKL, measured)
    else:
        r0 = torch.mm(g.reshape(-1, b), x1).view(k, -1, x1.shape[1])  # [K, H0, in+1]
    if homogeneous:  # the output weight's gradient from S = r0 before the factor w (above)
        pieces["layers.1.weight"] = (r0 * w0aug).sum(-1)
    if factor is not None:
        r0 = r0 * factor
    pieces["layers.0.weight"] = r0[..., :-1]
    if "layers.0.bias" in lj.layout:
        pieces["layers.0.bias"] = r0[..., -1]
