"""The hand-written value and gradient of the flat log joint: the samplers' hot path.

:func:`value_and_grad` is :meth:`FlatLogJoint._value_and_grad <pyrobdl.flat.FlatLogJoint>`: a
forward pass, ``dlogp/df``, the backward pass through the hidden layers, then layer 0's one
GEMM.  Each step is a function of the log joint ``lj`` (its layout, likelihood and data); the
statements are those of the single function they came from, in the same order (the outputs
are bit-identical, and ``torch.compile`` traces through the calls).

Layout: hidden activations are ``[B, K, H]`` (data-major), so the first layer is one GEMM over
every chain at once, forward (``[B, in+1] @ [in+1, K*H]``) and backward.  A layer stores its
activations ``h = tanh(a)`` or ``relu(a)`` in place of the pre-activation, and the backward pass
reads them (``tanh'(a) = 1 - h^2``, ``relu'(a) = 1[h > 0]``).  A tanh layer may instead store
``s = sigmoid(2a)``, the affine map ``s -> 2s - 1`` folded into the next layer's weights and
``tanh'(a) = 4 s (1 - s)`` (the *fold*): always when traced by ``torch.compile`` (``functional``;
Inductor's tanh measured 2.3-5x slower than its sigmoid), and eagerly wherever
:func:`tanh_through_sigmoid` says ATen's tanh is the slower.  ATen's float32 CPU tanh is MKL's
VML: 1.25-1.3x faster than ATen's sigmoid on an Intel Xeon, **6-7x slower** on an AMD EPYC
(MKL's generic code path), where the fold makes the eager kernel 1.4-1.7x faster
(``docs/benchmarks/chees.md``).
"""

from __future__ import annotations

import functools
import platform
from typing import Any

import torch


@functools.lru_cache(maxsize=None)
def _cpu_vendor() -> str:
    """The CPU's vendor string (``GenuineIntel``, ``AuthenticAMD``, ...), ``""`` when unknown."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    proc = platform.processor()  # e.g. Windows: "Intel64 Family 6 Model 85 Stepping 7, GenuineIntel"
    return "GenuineIntel" if "GenuineIntel" in proc else "AuthenticAMD" if "AuthenticAMD" in proc else ""


def tanh_through_sigmoid(device: torch.device) -> bool:
    """Whether the eager kernel computes a tanh layer as ``2 sigmoid(2a) - 1`` on ``device`` (the fold).

    On the CPU, yes unless ATen's tanh is MKL's VML on an Intel CPU, the one place it measured
    faster than ATen's sigmoid (1.25-1.3x on a Xeon; on an AMD EPYC MKL's tanh was 6-7x slower, and
    without MKL ATen's tanh is Sleef's, which Inductor's measurements put well below its sigmoid).
    On CUDA, no (both are memory-bound there; unmeasured, so unchanged).  Deterministic for a
    machine, so a seed's draws do not depend on a timing.
    """
    if device.type != "cpu":
        return False
    return not (torch.backends.mkl.is_available() and _cpu_vendor() == "GenuineIntel")


def tanh_(a: torch.Tensor, through_sigmoid: bool) -> torch.Tensor:
    """``tanh(a)`` in place: ATen's, or ``2 sigmoid(2a) - 1`` where :func:`tanh_through_sigmoid` says
    ATen's is the slower (for paths that keep ``h = tanh(a)`` itself, unlike this kernel's fold; on the
    AMD EPYC of 2026-11-30, 200,000 elements: 153 against ATen's 694 CPU µs, within 1.8e-7 of it)."""
    if through_sigmoid:
        return a.mul_(2.0).sigmoid_().mul_(2.0).sub_(1.0)
    return a.tanh_()


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
    fold = tanh and (functional or lj._sigmoid_tanh)  # sigmoid(2a) stored: the fold (module docstring)
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
    w0aug, zs, f = _forward(x1, layers, last, tanh, fold, per_row, k, b, lj._zero)
    if fixed:  # the likelihood's constant is in logp already: one pass less over [K]
        r = y - f
        aux = (r, None, None, None)
        if not skip:
            logp.add_((r * r).sum((-1, -2)), alpha=-0.5 * lj._tau * scale)
    else:
        ll, aux = lj._log_lik(f, y, theta)
        logp += ll if scale == 1.0 else scale * ll
    gf = _output_grad(lj, f, y, theta, aux, grad, logp, scale, prior, per_row, k, b)
    # relu into one output unit: relu(a) = a * 1[a > 0] and a0 = x1 @ w0aug^T, so the output
    # weight's gradient sum_b g[k,b] relu(a0[b,k,h]) equals sum_i w0aug[k,h,i] S[k,h,i], where
    # S = x1^T (g masked by 1[a0 > 0]) is the GEMM layer 0's gradient computes anyway: one
    # pass over the [B, K, H] activations less (they are read from memory, not cache)
    homogeneous = lj._fold_output_grad and not tanh and last == 1 and layers[1][0].shape[1] == 1
    pieces: dict[str, torch.Tensor] = {}  # each layer site's likelihood gradient, added to grad at the end
    g, factor, alpha = _backward_hidden(lj, gf, zs, layers, pieces, last, tanh, fold, homogeneous, functional, k, b)
    _backward_layer0(lj, g, x1, w0aug, factor, alpha, pieces, last, homogeneous, per_row, k, b)
    _add_pieces(lj, grad, pieces, k)
    return logp, grad


def batch(lj: Any, idx: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The augmented inputs, targets and likelihood scale of ``lj`` on minibatch ``idx``: all the data
    and 1 for None; ``[B]`` (or ``[K, B]``, each row of theta on its own minibatch) and N / B."""
    if idx is None:
        return lj._x1, lj.y, 1.0
    return lj._x1[idx], lj.y[idx], lj.num_data / idx.shape[-1]


def _scaled_mm(m1: torch.Tensor, m2: torch.Tensor, alpha: float, zero: torch.Tensor) -> torch.Tensor:
    """``alpha * (m1 @ m2)`` (2-D or batched 3-D), the scale applied inside the product: with beta = 0
    the zero input is ignored, and the product's output is not read and written a second time."""
    if alpha == 1.0:
        return torch.mm(m1, m2) if m1.dim() == 2 else torch.bmm(m1, m2)
    fn = torch.addmm if m1.dim() == 2 else torch.baddbmm
    return fn(zero, m1, m2, beta=0.0, alpha=alpha)


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


def _forward(x1, layers, last, tanh, fold, per_row, k, b, zero):
    """Layer 0's augmented weights ``[K, H, in+1]``, the hidden activations and the outputs ``[K, B, O]``;
    ``fold``: tanh layers as sigmoid(2a) (module docstring); ``zero``: a 0-d zero tensor (the ignored
    input of a product with beta = 0)."""
    w0, b0 = layers[0]
    c0 = 2.0 if fold and last > 0 else 1.0  # sigmoid(2 a) of the first hidden layer
    w0aug = torch.cat([w0, b0.unsqueeze(-1)], -1)  # [K, H, in+1]
    if per_row:
        a0 = _scaled_mm(x1, w0aug.transpose(1, 2), c0, zero).transpose(0, 1)  # [B, K, H]
    else:
        a0 = _scaled_mm(x1, w0aug.reshape(-1, x1.shape[1]).t(), c0, zero).view(b, k, -1)  # [B, K, H]
    zs = []  # per hidden layer: tanh(a), relu(a) or (fold) sigmoid(2a), [B, K, H] (possibly strided)
    a = a0
    for j in range(1, last + 1):
        # in place: the pre-activation is a fresh product not needed again (one [B, K, H]
        # allocation less per layer; large allocations measured ~30% of an elementwise op)
        z = a.sigmoid_() if fold else a.tanh_() if tanh else a.relu_()
        zs.append(z)
        w, bias = layers[j]
        # fold: the layer's input is h = 2 s - 1, so w h + b = 2 w s + (b - sum w); the next
        # layer's sigmoid(2a) doubles both again (alpha and beta of one baddbmm)
        alpha, beta = (2.0 if j == last else 4.0, 1.0 if j == last else 2.0) if fold else (1.0, 1.0)
        beff = bias - w.sum(-1) if fold else bias
        if w.shape[1] == 1:  # one output unit: [K, 1, Hin] @ [K, Hin, B] -> [K, B, 1]
            a = torch.baddbmm(beff.unsqueeze(-1), w, z.permute(1, 2, 0), beta=beta, alpha=alpha).transpose(1, 2)
        else:  # [K, B, Hout]
            a = torch.baddbmm(beff.unsqueeze(1), z.transpose(0, 1), w.transpose(1, 2), beta=beta, alpha=alpha)
        if j < last:
            a = a.transpose(0, 1)  # back to [B, K, H]
    f = a if last > 0 else a.transpose(0, 1)  # [K, B, O]
    return w0aug, zs, f


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


def _backward_hidden(lj, gf, zs, layers, pieces, last, tanh, fold, homogeneous, functional, k, b):
    """Backward through layers last .. 1, their sites' gradients into ``pieces``; ``g = dlogp/da_0`` (up
    to a factor), and the factor (a tensor or None) and scalar ``alpha`` layer 0's gradient applies
    after its GEMM."""
    g = gf  # g = dlogp/da_j, [K, B, Hout]
    factor: torch.Tensor | None = None
    alpha = 1.0
    for j in range(last, 0, -1):
        z = zs[j - 1]
        w, _ = layers[j]
        gsum = g.sum(1)  # [K, Hout]
        if not homogeneous:  # g^T h, [K, Hout, Hin]; fold: h = 2 s - 1, so 2 g^T s - sum_b g
            # (one baddbmm into a fresh tensor: into grad's strided view it measured 3x slower)
            pieces[f"layers.{j}.weight"] = (
                torch.baddbmm(gsum.unsqueeze(-1), g.transpose(1, 2), z.transpose(0, 1), beta=-1.0, alpha=2.0) if fold
                else torch.bmm(g.transpose(1, 2), z.transpose(0, 1)))
        if f"layers.{j}.bias" in lj.layout:
            pieces[f"layers.{j}.bias"] = gsum
        if j == 1 and w.shape[1] == 1:
            # dlogp/da0[b,k,h] = g[k,b] w[k,h] act'(a0)[b,k,h]: w is applied after the GEMM
            # (fold: the 4 of tanh' in the same pass as the copy into [B, K, 1])
            gb = (g.permute(1, 0, 2).mul(lj.const(4.0)) if fold else g.permute(1, 0, 2).contiguous()).expand(b, k, z.shape[-1])
            factor = w.transpose(1, 2)  # [K, H, 1]
        else:
            gb = torch.bmm(g, w).transpose(0, 1)  # [B, K, Hin], z's layout
        # written into z's layout (z is not needed again): following gb's (expanded) strides would
        # cost a copy; torch.compile (functional): out= into a strided z miscompiles (torch 2.13, measured)
        if fold:  # tanh'(a) = 4 s (1 - s)
            g = (torch.ops.aten.sigmoid_backward(gb, z) if functional
                 else torch.ops.aten.sigmoid_backward.grad_input(gb, z, grad_input=z))
            if j == 1:
                alpha = 1.0 if factor is not None else 4.0
            else:
                g.mul_(lj.const(4.0))
        elif tanh:  # tanh'(a) = 1 - h^2
            g = torch.ops.aten.tanh_backward.grad_input(gb, z, grad_input=z)
        else:
            g = (torch.ops.aten.threshold_backward(gb, z, 0.0) if functional
                 else torch.ops.aten.threshold_backward.grad_input(gb, z, 0.0, grad_input=z))
        if j > 1:
            g = g.transpose(0, 1)  # [K, B, H] for the next layer's products
    return g, factor, alpha


def _backward_layer0(lj, g, x1, w0aug, factor, alpha, pieces, last, homogeneous, per_row, k, b):
    """Layer 0: one GEMM ``[in+1, B] @ [B, K*H0]``, its sites' gradients into ``pieces``."""
    if last == 0:
        g = g.transpose(0, 1)  # [B, K, O]
    h0 = g.shape[-1]
    if per_row:
        r0 = _scaled_mm(g.transpose(0, 1).transpose(1, 2), x1, alpha, lj._zero)  # [K, H0, in+1]
    else:
        r0 = _scaled_mm(x1.t(), g.reshape(b, k * h0), alpha, lj._zero).view(x1.shape[1], k, h0).permute(1, 2, 0)  # [K, H0, in+1]
    if homogeneous:  # the output weight's gradient from S = r0 before the factor w (above)
        pieces["layers.1.weight"] = (r0 * w0aug).sum(-1)
    if factor is not None:
        r0 = r0 * factor
    pieces["layers.0.weight"] = r0[..., :-1]
    if "layers.0.bias" in lj.layout:
        pieces["layers.0.bias"] = r0[..., -1]
