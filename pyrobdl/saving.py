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
        For another format version, a class outside pyrobdl, tensors that do not fit the
        rebuilt model or guide, a damaged or forged file (unreadable JSON or tensors, a field
        missing or of the wrong type, anything but plain tensors), or parameters that are NaN
        or infinite; the message names the file.
    """
    from .diagnostics.certification import Certification
    from .inference.registry import install_guide_builder
    from .posterior import Cost, Posterior

    install_guide_builder()  # SVIPosterior rebuilds its guide through the method registry

    path = Path(path)
    if not (path / _META).is_file() or not (path / _TENSORS).is_file():
        raise FileNotFoundError(f"{path} is not a saved posterior (expected {_META} and {_TENSORS})")
    meta = _read_meta(path / _META)
    module, name = meta["class"]["module"], meta["class"]["name"]
    if not (module == "pyrobdl" or module.startswith("pyrobdl.")):
        raise ValueError(f"{path / _META}: posterior class {module}.{name} is not part of pyrobdl; refusing to import it")
    try:
        cls = getattr(importlib.import_module(module), name, None)
    except ImportError:
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, Posterior)):
        raise ValueError(f"{path / _META}: {module}.{name} is not a Posterior class")
    flat = _read_tensors(path / _TENSORS, device)
    tensors = {k.removeprefix("state/"): v for k, v in flat.items() if k.startswith("state/")}
    try:
        model = model_from_spec(meta["model"]).to(device)
        common = {
            "method": meta["method"], "settings": _restore_float(meta["settings"]),
            "cost": Cost(**_restore_float(meta["cost"])), "history": flat["history"].cpu().numpy(),
            "diagnostics": _restore_float(meta["diagnostics"]),
        }
        posterior = cls._from_state(model, tensors, _restore_float(meta["state"]), common)
        if meta.get("certification") is not None:
            posterior.certification = Certification.from_dict(_restore_float(meta["certification"]))
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, RuntimeError) as e:
        if isinstance(e, ValueError) and str(path) in str(e):
            raise
        raise ValueError(f"{path}: not a loadable saved posterior ({type(e).__name__}: {str(e)[:200]}); save it "
                         "again with Posterior.save") from None
    return posterior


#: Fields of posterior.json that load_posterior reads, with their JSON types.
_FIELDS = {"format": str, "format_version": int, "class": dict, "model": dict, "method": str, "settings": dict,
           "cost": dict, "diagnostics": dict, "state": dict}


def _read_meta(file: Path) -> dict[str, Any]:
    """posterior.json, with every field :func:`load_posterior` reads checked; errors name the file."""
    try:
        meta = json.loads(file.read_bytes()[:1 << 26].decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ValueError(f"{file}: not a readable posterior description ({type(e).__name__}); save the "
                         "posterior again with Posterior.save") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(meta).__name__}")
    if meta.get("format") != "pyrobdl-posterior" or meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{file}: format {repr(meta.get('format'))[:40]} version "
                         f"{repr(meta.get('format_version'))[:20]}; this pyrobdl reads pyrobdl-posterior version "
                         f"{FORMAT_VERSION}")
    for key, kind in _FIELDS.items():
        if not isinstance(meta.get(key), kind) or isinstance(meta.get(key), bool):
            raise ValueError(f"{file}: field {key!r} must be a JSON {kind.__name__}, got "
                             f"{type(meta.get(key)).__name__ if key in meta else 'nothing'}")
    if meta.get("certification") is not None and not isinstance(meta["certification"], dict):
        raise ValueError(f"{file}: field 'certification' must be a JSON object or null")
    if not all(isinstance(meta["class"].get(k), str) for k in ("module", "name")):
        raise ValueError(f"{file}: field 'class' must hold strings 'module' and 'name'")
    return meta


def _read_tensors(file: Path, device: Any) -> dict[str, torch.Tensor]:
    """tensors.pt as plain tensors (``weights_only``: no code runs), every parameter finite."""
    try:
        flat = torch.load(file, map_location=device, weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises many kinds for a damaged or forged file
        raise ValueError(f"{file}: not a readable tensor file ({type(e).__name__}: {str(e).strip()[:160]}); "
                         "save the posterior again with Posterior.save") from None
    if not isinstance(flat, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                             for k, v in flat.items()):
        raise ValueError(f"{file}: expected a flat {{name: tensor}} dict")
    if "history" not in flat:
        raise ValueError(f"{file}: no 'history' tensor")
    for key, t in flat.items():
        # the parameters (guide state, draws, members, mean and curvature); a sampler trace may
        # hold infinite energies of divergent transitions, and a loss history a diverged step
        if key.startswith("state/") and not key.startswith("state/trace/") and t.is_floating_point():
            bad = int((~torch.isfinite(t)).sum())
            if bad:
                raise ValueError(f"{file}: tensor {key.removeprefix('state/')!r} holds {bad} NaN or infinite "
                                 "value(s); a posterior with non-finite parameters is refused")
    return flat
