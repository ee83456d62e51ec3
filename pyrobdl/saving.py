r"""Save a fitted posterior to disk and load it back, without pickle.

A saved posterior is a folder of two files:

* ``posterior.json`` — everything that is not a tensor, readable by a person: the format
  version, the model's specification (widths, activation, bias, prior and likelihood with their
  arguments), the posterior's class, method name, settings, cost, diagnostics and
  certification;
* ``tensors.pt`` — one flat ``{name: tensor}`` dict of plain CPU tensors written with
  ``torch.save`` and read back with ``torch.load(..., weights_only=True)``, which refuses
  anything but tensors and plain containers (no code runs on load).

What the tensors are is each posterior class's business (:meth:`Posterior._state` and
:meth:`Posterior._from_state`): a trained guide's whole ``state_dict()`` for SVI methods (so
the format does not depend on how a guide names or packs its parameters; the guide is rebuilt
by the method's registry entry and the state loaded strictly), the stored chains and sampler
trace for MCMC, the stored draws for a stored reference.  The posterior's class is recorded by
module and name and is only imported from inside ``pyrobdl``.

Layers (docs/architecture.md): the write side (the model's specification, settings as JSON, the
atomic write of the folder) is :mod:`pyrobdl._saved`, below the posterior contract, so that
:meth:`Posterior.save` calls down to it; this module sits above the inference methods, since
loading imports a posterior's class by name and rebuilds an SVI guide through the method
registry.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any, Mapping

import torch

from ._saved import _META, _TENSORS, FORMAT_VERSION, model_spec, write_posterior

__all__ = ["FORMAT_VERSION", "load_posterior", "model_from_spec", "model_spec", "save_posterior"]


# ------------------------------------------------------------------------------------ model
def _component(spec: Mapping[str, Any], module: str) -> Any:
    mod = importlib.import_module(module)
    cls = getattr(mod, str(spec["class"]), None)
    if not isinstance(cls, type):
        raise ValueError(f"unknown {module} class {spec['class']!r} in a saved model")
    return cls(**spec["args"])


def model_from_spec(spec: Mapping[str, Any]) -> Any:
    """Rebuild the model :func:`model_spec` describes."""
    from .model import BayesianMLP

    return BayesianMLP(
        spec["in_features"], tuple(spec["hidden"]), spec["out_features"], activation=spec["activation"],
        prior=_component(spec["prior"], "pyrobdl.priors"),
        likelihood=_component(spec["likelihood"], "pyrobdl.likelihoods"), bias=spec.get("bias", True),
    )


# ------------------------------------------------------------------------------------- JSON
def _restore_float(value: Any) -> Any:
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return float(value)
    if isinstance(value, list):
        return [_restore_float(v) for v in value]
    if isinstance(value, dict):
        return {k: _restore_float(v) for k, v in value.items()}
    return value


# -------------------------------------------------------------------------------- save/load
def save_posterior(posterior: Any, path: str | os.PathLike[str]) -> Path:
    """Write ``posterior`` to the folder ``path`` (created or replaced atomically).

    Parameters
    ----------
    posterior : pyrobdl.Posterior
        Any registered method's result.
    path : str or os.PathLike
        Folder to write; an existing save there is replaced only once the new one is complete.

    Returns
    -------
    pathlib.Path
        ``path``.

    Raises
    ------
    TypeError
        If the posterior (or its model's prior/likelihood) is not a pyrobdl class that can be
        saved.
    FileExistsError
        If ``path`` exists and is not a saved posterior (nothing is overwritten).
    """
    from .posterior import Posterior

    if not isinstance(posterior, Posterior):
        raise TypeError(f"posterior must be a pyrobdl Posterior, got {type(posterior).__name__}")
    return write_posterior(posterior, path)


def load_posterior(path: str | os.PathLike[str], *, device: str | torch.device = "cpu") -> Any:
    """Load a posterior written by :meth:`pyrobdl.Posterior.save`.

    Parameters
    ----------
    path : str or os.PathLike
        The folder :meth:`~pyrobdl.Posterior.save` wrote.
    device : str or torch.device, default "cpu"
        Where the model and the posterior's tensors go.

    Returns
    -------
    pyrobdl.Posterior
        Of the saved class, with its model, settings, cost, history, diagnostics and
        certification; ``predict``/``sample`` give what the saved posterior gave.

    Raises
    ------
    FileNotFoundError
        If ``path`` holds no saved posterior.
    ValueError
        For another format version, a class outside pyrobdl, or tensors that do not fit the
        rebuilt model or guide.
    """
    from .diagnostics.certification import Certification
    from .inference.registry import install_guide_builder
    from .posterior import Cost, Posterior

    install_guide_builder()  # SVIPosterior rebuilds its guide through the method registry

    path = Path(path)
    if not (path / _META).exists() or not (path / _TENSORS).exists():
        raise FileNotFoundError(f"{path} is not a saved posterior (expected {_META} and {_TENSORS})")
    meta = json.loads((path / _META).read_text(encoding="utf-8"))
    if meta.get("format") != "pyrobdl-posterior" or meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path / _META}: format {meta.get('format')!r} version {meta.get('format_version')!r}; "
                         f"this pyrobdl reads pyrobdl-posterior version {FORMAT_VERSION}")
    module, name = meta["class"]["module"], meta["class"]["name"]
    if not (module == "pyrobdl" or module.startswith("pyrobdl.")):
        raise ValueError(f"{path / _META}: posterior class {module}.{name} is not part of pyrobdl; refusing to import it")
    cls = getattr(importlib.import_module(module), name, None)
    if not (isinstance(cls, type) and issubclass(cls, Posterior)):
        raise ValueError(f"{path / _META}: {module}.{name} is not a Posterior class")
    flat = torch.load(path / _TENSORS, map_location=device, weights_only=True)
    tensors = {k.removeprefix("state/"): v for k, v in flat.items() if k.startswith("state/")}
    model = model_from_spec(meta["model"]).to(device)
    common = {
        "method": meta["method"], "settings": _restore_float(meta["settings"]),
        "cost": Cost(**_restore_float(meta["cost"])), "history": flat["history"].cpu().numpy(),
        "diagnostics": _restore_float(meta["diagnostics"]),
    }
    posterior = cls._from_state(model, tensors, _restore_float(meta["state"]), common)
    if meta.get("certification") is not None:
        posterior.certification = Certification.from_dict(_restore_float(meta["certification"]))
    return posterior
