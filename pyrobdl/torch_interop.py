r"""Plain PyTorch networks in and out: ``nn.Linear`` stacks <-> a :class:`~pyrobdl.BayesianMLP`'s sites.

A :class:`~pyrobdl.BayesianMLP` with hidden widths :math:`(h_1, \dots, h_L)` computes
:math:`f(x) = W_L\,\sigma(\cdots\sigma(W_0 x + b_0)\cdots) + b_L`, which is exactly what an
``nn.Sequential(nn.Linear, act, nn.Linear, act, ..., nn.Linear)`` computes, with ``act`` one of
``nn.ReLU`` or ``nn.Tanh``.  This module maps between the two:

* :func:`parse_module` reads the architecture of a trained network (the layers and activations
  among its leaf modules, in registration order) and refuses, naming the layer, anything a
  :class:`~pyrobdl.BayesianMLP` cannot represent;
* :func:`init_sites` turns a trained network or its ``state_dict`` into the model's site values
  (``layers.{i}.weight``, ``layers.{i}.bias``), the starting point of ``fit(..., init=...)``;
* :func:`to_sequential` builds a plain ``nn.Sequential`` from site values, the export of
  :meth:`pyrobdl.Posterior.to_torch`.

It sits at the bottom of pyrobdl's layers: it imports torch only, and reads a model through its
attributes (``in_features``, ``hidden``, ``out_features``, ``activation``, ``bias``, ``network``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

__all__ = ["ACTIVATION_MODULES", "TorchArchitecture", "check_outputs", "init_sites", "parse_module",
           "to_sequential"]

#: The activation modules a BayesianMLP can represent, by its ``activation`` name (exact types:
#: a subclass may compute something else).
ACTIVATION_MODULES: dict[str, type[torch.nn.Module]] = {"relu": torch.nn.ReLU, "tanh": torch.nn.Tanh}
_ACTIVATION_NAMES = {cls: name for name, cls in ACTIVATION_MODULES.items()}
#: Modules that compute the identity at evaluation (``module.eval()``) and are skipped.
_IDENTITIES = (torch.nn.Identity, torch.nn.Dropout)
_SUPPORTED = "nn.Linear layers with nn.ReLU or nn.Tanh between them (nn.Identity and nn.Dropout are skipped)"


@dataclass(frozen=True)
class TorchArchitecture:
    """What :func:`parse_module` read from a network.

    Attributes
    ----------
    in_features, out_features : int
        Inputs of the first ``nn.Linear`` and outputs of the last.
    hidden : tuple of int
        Outputs of every ``nn.Linear`` but the last.
    activation : str or None
        ``"relu"`` or ``"tanh"``; None for a single ``nn.Linear`` (no hidden layer).
    bias : bool
        Whether the layers have biases (all of them, or none).
    linears : tuple of (str, torch.nn.Linear)
        The ``nn.Linear`` layers in order, each with its dotted name in the network.
    """

    in_features: int
    hidden: tuple[int, ...]
    out_features: int
    activation: str | None
    bias: bool
    linears: tuple[tuple[str, torch.nn.Linear], ...]


def _leaves(module: torch.nn.Module, prefix: str = "") -> list[tuple[str, torch.nn.Module]]:
    children = list(module.named_children())
    if not children:
        empty = isinstance(module, (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict))
        return [] if empty else [(prefix or type(module).__name__, module)]
    out = []
    for name, child in children:
        out.extend(_leaves(child, f"{prefix}.{name}" if prefix else name))
    return out


def _describe(name: str, layer: torch.nn.Module) -> str:
    return f"layer {name!r} ({layer!r})"


def parse_module(module: torch.nn.Module) -> TorchArchitecture:
    """Read the architecture of a network made of ``nn.Linear`` layers with ReLU/Tanh between them.

    Parameters
    ----------
    module : torch.nn.Module
        An ``nn.Sequential``, or any module whose leaf modules, in registration order, are
        ``nn.Linear``, activation, ``nn.Linear``, ..., ``nn.Linear`` (nested containers are
        walked; ``nn.Identity`` and ``nn.Dropout`` are skipped).

    Returns
    -------
    TorchArchitecture

    Raises
    ------
    TypeError
        If ``module`` is not a ``torch.nn.Module``.
    ValueError
        Naming the layer that cannot be mapped: any other module (a convolution, a
        normalisation, an activation other than ReLU/Tanh), two activations of different kinds,
        two ``nn.Linear`` layers with no activation between them, widths that do not chain, a
        layer with a bias among layers without (or the reverse), an activation before the first
        or after the last ``nn.Linear``, or a network with no ``nn.Linear`` at all.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(module).__name__}")
    linears: list[tuple[str, torch.nn.Linear]] = []
    activation, after_activation, last_activation = None, False, ""
    for name, layer in _leaves(module):
        if isinstance(layer, torch.nn.Linear):
            if isinstance(layer.weight, torch.nn.parameter.UninitializedParameter):
                raise ValueError(f"{_describe(name, layer)} is not initialised yet (a lazy layer): run it once first")
            if linears:
                prev_name, prev = linears[-1]
                if not after_activation:
                    raise ValueError(
                        f"{_describe(name, layer)} follows {prev_name!r} with no activation between them; a BayesianMLP "
                        "has a ReLU or Tanh between every two linear layers (an activation applied inside forward() "
                        "through torch.nn.functional is not a layer: rebuild the network as an nn.Sequential)")
                if layer.in_features != prev.out_features:
                    raise ValueError(f"{_describe(name, layer)} takes {layer.in_features} inputs but {prev_name!r} "
                                     f"gives {prev.out_features}: the widths do not chain")
                if (layer.bias is None) != (linears[0][1].bias is None):
                    has, other = ("has no bias", "has one") if layer.bias is None else ("has a bias", "has none")
                    raise ValueError(f"{_describe(name, layer)} {has} but layer {linears[0][0]!r} {other}; a "
                                     "BayesianMLP gives every layer a bias or none (bias=False)")
            linears.append((name, layer))
            after_activation = False
        elif type(layer) in _ACTIVATION_NAMES:
            kind = _ACTIVATION_NAMES[type(layer)]
            if not linears:
                raise ValueError(f"{_describe(name, layer)} comes before the first nn.Linear; a BayesianMLP starts "
                                 "with a linear layer")
            if after_activation:
                raise ValueError(f"{_describe(name, layer)} follows the activation {last_activation!r} with no "
                                 "linear layer between them")
            if activation is not None and kind != activation:
                raise ValueError(f"{_describe(name, layer)} is a {kind} activation but the network's earlier ones "
                                 f"are {activation}; a BayesianMLP has one activation for every hidden layer")
            activation, after_activation, last_activation = kind, True, name
        elif isinstance(layer, _IDENTITIES):
            continue
        else:
            hint = ("; a categorical likelihood applies the softmax itself: remove it"
                    if isinstance(layer, (torch.nn.Softmax, torch.nn.LogSoftmax)) else "")
            raise ValueError(f"cannot map {_describe(name, layer)} to a BayesianMLP: it takes {_SUPPORTED}{hint}")
    if not linears:
        raise ValueError(f"the network has no nn.Linear layer; a BayesianMLP maps {_SUPPORTED}")
    if after_activation:
        raise ValueError(
            f"the network ends with the activation {last_activation!r}; a BayesianMLP's output layer is linear "
            "(its likelihood applies its own link, e.g. the softmax of a categorical likelihood): remove it")
    return TorchArchitecture(
        in_features=linears[0][1].in_features, hidden=tuple(layer.out_features for _, layer in linears[:-1]),
        out_features=linears[-1][1].out_features, activation=activation, bias=linears[0][1].bias is not None,
        linears=tuple(linears))


def _architecture_of(model: Any) -> str:
    return (f"in_features={model.in_features}, hidden={tuple(model.hidden)}, out_features={model.out_features}, "
            f"activation={model.activation!r}, bias={model.bias}")


def _check_matches(model: Any, arch: TorchArchitecture) -> None:
    """Raise when the network's architecture is not the model's, naming the first difference."""
    widths = [model.in_features, *model.hidden, model.out_features]
    if len(arch.linears) != len(widths) - 1:
        raise ValueError(f"init has {len(arch.linears)} linear layers but the model has {len(widths) - 1} "
                         f"({_architecture_of(model)})")
    for i, (name, layer) in enumerate(arch.linears):
        expected = (widths[i + 1], widths[i])
        if tuple(layer.weight.shape) != expected:
            raise ValueError(f"init's {_describe(name, layer)} has weight shape {list(layer.weight.shape)} but the "
                             f"model's layers.{i}.weight is {list(expected)}")
    if arch.bias != model.bias:
        raise ValueError(f"init's layers {'have' if arch.bias else 'have no'} biases but the model was built with "
                         f"bias={model.bias}")
    if model.hidden and arch.activation != model.activation:
        raise ValueError(f"init uses the {arch.activation} activation but the model {model.activation!r}")


def _state_dict_layers(state: Mapping[str, Any]) -> list[tuple[str, torch.Tensor, torch.Tensor | None]]:
    """``(prefix, weight, bias)`` per layer of a state dict, in the dict's order."""
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        if not isinstance(key, str) or "." not in key and key not in ("weight", "bias"):
            raise ValueError(f"init state dict key {key!r} is not '<layer>.weight' or '<layer>.bias'")
        prefix, _, leaf = key.rpartition(".")
        if leaf not in ("weight", "bias"):
            raise ValueError(f"cannot map init state dict entry {key!r}: a BayesianMLP's state is the weight and "
                             "bias of each linear layer (a normalisation or other layer has no counterpart)")
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"init state dict entry {key!r} is a {type(value).__name__}, not a tensor")
        layers.setdefault(prefix, {})[leaf] = value
    out = []
    for prefix, entries in layers.items():
        name = f"{prefix}.weight" if prefix else "weight"
        if "weight" not in entries:
            raise ValueError(f"init state dict has a bias for layer {prefix!r} but no weight {name!r}")
        if entries["weight"].dim() != 2:
            raise ValueError(f"init state dict entry {name!r} has shape {list(entries['weight'].shape)}; a linear "
                             "layer's weight is 2-dimensional [out, in] (a convolution's is not)")
        out.append((prefix, entries["weight"], entries.get("bias")))
    return out


def init_sites(model: Any, init: Any) -> dict[str, torch.Tensor]:
    """The model's weight and bias sites from a trained network or its state dict.

    Parameters
    ----------
    model : pyrobdl.BayesianMLP
        The model whose sites are filled.
    init : torch.nn.Module or Mapping[str, torch.Tensor]
        A network :func:`parse_module` can read, with the model's architecture (its activation
        included), or a ``state_dict`` whose entries are ``<layer>.weight`` ``[out, in]`` and
        ``<layer>.bias`` ``[out]`` of the linear layers in order (a ``nn.Sequential``'s
        ``"0.weight", "0.bias", "2.weight", ...``, or the model's own site names).  A state dict
        carries no activation, so only the shapes are checked.

    Returns
    -------
    dict
        ``{"layers.{i}.weight": [out, in], "layers.{i}.bias": [out]}``, detached copies on the
        network's device and in its dtype.  The likelihood's sites (a learned noise precision)
        are not included: a plain network has none.

    Raises
    ------
    TypeError
        If ``init`` is neither a module nor a mapping.
    ValueError
        Naming the layer or entry that does not fit the model (architecture, shape, bias, a
        non-finite value), or that the network's outputs differ from the model's network at
        these weights (see :func:`check_outputs`).
    """
    if isinstance(init, torch.nn.Module):
        arch = parse_module(init)
        _check_matches(model, arch)
        layers = [(name, layer.weight, layer.bias) for name, layer in arch.linears]
    elif isinstance(init, Mapping):
        layers = _state_dict_layers(init)
        widths = [model.in_features, *model.hidden, model.out_features]
        if len(layers) != len(widths) - 1:
            raise ValueError(f"init state dict has {len(layers)} layers ({[p for p, _, _ in layers]}) but the model "
                             f"has {len(widths) - 1} ({_architecture_of(model)})")
        for i, (prefix, w, b) in enumerate(layers):
            expected = (widths[i + 1], widths[i])
            if tuple(w.shape) != expected:
                raise ValueError(f"init state dict entry '{prefix}.weight' has shape {list(w.shape)} but the model's "
                                 f"layers.{i}.weight is {list(expected)}")
            if (b is not None) != model.bias:
                raise ValueError(f"init state dict layer {prefix!r} {'has' if b is not None else 'has no'} bias but "
                                 f"the model was built with bias={model.bias}")
            if b is not None and tuple(b.shape) != (widths[i + 1],):
                raise ValueError(f"init state dict entry '{prefix}.bias' has shape {list(b.shape)}, expected "
                                 f"[{widths[i + 1]}]")
    else:
        raise TypeError(f"init must be a torch.nn.Module or its state_dict (a mapping of tensors), got "
                        f"{type(init).__name__}")
    values: dict[str, torch.Tensor] = {}
    for i, (name, w, b) in enumerate(layers):
        for leaf, v in (("weight", w), ("bias", b)):
            if v is None:
                continue
            if not torch.isfinite(v).all():
                raise ValueError(f"init's layer {name!r} has a non-finite {leaf}")
            values[f"layers.{i}.{leaf}"] = v.detach().clone()
    if isinstance(init, torch.nn.Module):
        check_outputs(init, model, values)
    return values


def check_outputs(module: torch.nn.Module, model: Any, values: Mapping[str, torch.Tensor],
                  num_points: int = 16) -> None:
    """Raise unless ``module`` computes the model's network at ``values``.

    The layers :func:`parse_module` read say nothing of what ``forward`` does with them (a skip
    connection, a scaling, an activation from ``torch.nn.functional``), so both are evaluated on
    ``num_points`` standard normal inputs (a fixed private generator: the global RNG is not
    touched), in evaluation mode (restored afterwards), and must agree to float rounding.

    Raises
    ------
    ValueError
        When calling the module fails, or its outputs differ from the model's.
    """
    w = values["layers.0.weight"]
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(num_points, model.in_features, generator=gen, dtype=w.dtype).to(w.device)
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        with torch.no_grad():
            got = module(x)
            want = model.network(dict(values), x)
    except Exception as err:  # the user's forward may raise anything
        raise ValueError(f"calling the network on inputs of shape {list(x.shape)} failed "
                         f"({type(err).__name__}: {err})") from err
    finally:
        for m, mode in modes:
            m.training = mode
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        shape = list(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        raise ValueError(f"the network returns {shape} on inputs {list(x.shape)}; its layers give {list(want.shape)}")
    eps = torch.finfo(w.dtype).eps
    tol = 1e3 * eps * (1.0 + float(want.abs().max()))
    err = float((got - want).abs().max())
    if not err <= tol:
        raise ValueError(f"the network's forward() does not compute its layers in order (linear, activation, ..., "
                         f"linear): outputs differ by {err:.3g} on random inputs; a BayesianMLP maps {_SUPPORTED}")


def to_sequential(model: Any, params: Mapping[str, torch.Tensor]) -> torch.nn.Sequential:
    """A plain ``nn.Sequential`` computing ``model.network(params, x)``.

    Parameters
    ----------
    model : pyrobdl.BayesianMLP
        Gives the architecture.
    params : Mapping[str, torch.Tensor]
        One value per weight (and bias) site, without a sample dimension; other sites (a noise
        precision) are ignored.

    Returns
    -------
    torch.nn.Sequential
        ``Linear, act, Linear, ..., Linear`` with copies of the weights (their dtype and device),
        ``requires_grad=True`` like any fresh ``nn.Linear``.  The output is the network's: a
        regression mean or classification logits (no softmax).

    Raises
    ------
    ValueError
        If a site is missing or has the wrong shape.
    """
    widths = [model.in_features, *model.hidden, model.out_features]
    layers: list[torch.nn.Module] = []
    for i in range(len(widths) - 1):
        names = [f"layers.{i}.weight"] + ([f"layers.{i}.bias"] if model.bias else [])
        shapes = [(widths[i + 1], widths[i]), (widths[i + 1],)]
        for name, shape in zip(names, shapes):
            if name not in params:
                raise ValueError(f"params lack the site {name!r}")
            if tuple(params[name].shape) != shape:
                raise ValueError(f"params[{name!r}] has shape {list(params[name].shape)}, expected {list(shape)} "
                                 "(one value per site, no sample dimension)")
        w = params[names[0]]
        # skip_init: no random initialisation (the global RNG is left alone), the weights are copied in
        linear = torch.nn.utils.skip_init(torch.nn.Linear, widths[i], widths[i + 1], bias=model.bias,
                                          device=w.device, dtype=w.dtype)
        with torch.no_grad():
            linear.weight.copy_(w)
            if model.bias:
                linear.bias.copy_(params[names[1]])
        layers.append(linear)
        if i < len(widths) - 2:
            layers.append(ACTIVATION_MODULES[model.activation]())
    return torch.nn.Sequential(*layers)
