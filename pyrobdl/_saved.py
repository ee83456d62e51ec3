r"""The folder a saved posterior is written to, below the :class:`~pyrobdl.posterior.Posterior`
contract: the model's specification, settings as JSON, and the atomic write of the folder.

:mod:`pyrobdl.saving` (one layer up: it rebuilds posteriors of any class, and SVI guides through
the method registry) documents the format and reads it back; :meth:`Posterior.save` and
:func:`pyrobdl.saving.save_posterior` write it with :func:`write_posterior`, and sampler
checkpoints record the run's model with :func:`model_spec` (docs/architecture.md).
"""

from __future__ import annotations

import inspect
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping

import torch

__all__ = ["FORMAT_VERSION", "UNSERIALISABLE", "lost_in_json", "model_spec", "write_posterior"]

#: Version of the on-disk layout; :func:`pyrobdl.saving.load_posterior` refuses others.
FORMAT_VERSION = 1
_META, _TENSORS = "posterior.json", "tensors.pt"


# ------------------------------------------------------------------------------------ model
def _component_spec(obj: Any, module: str) -> dict[str, Any]:
    """A prior or likelihood as ``{"class", "args"}``: its constructor's arguments, read back
    from the attributes of the same name (every pyrobdl prior and likelihood keeps them)."""
    cls = type(obj)
    if cls.__module__ != module:
        raise TypeError(f"cannot save a {cls.__module__}.{cls.__qualname__}: only {module} classes are supported")
    args = {}
    for name, p in inspect.signature(cls.__init__).parameters.items():
        if name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        value = getattr(obj, name, p.default)
        if value is inspect.Parameter.empty:
            raise TypeError(f"cannot save {cls.__qualname__}: argument {name!r} is not kept on the object")
        args[name] = list(value) if isinstance(value, tuple) else value
    return {"class": cls.__qualname__, "args": args}


def model_spec(model: Any) -> dict[str, Any]:
    """A :class:`~pyrobdl.BayesianMLP` as a JSON-serialisable dict (see :func:`pyrobdl.saving.model_from_spec`).

    Raises
    ------
    TypeError
        For a prior or likelihood that is not one of pyrobdl's own classes.
    """
    return {
        "in_features": model.in_features, "hidden": list(model.hidden), "out_features": model.out_features,
        "activation": model.activation, "bias": bool(getattr(model, "bias", True)),
        "prior": _component_spec(model.prior, "pyrobdl.priors"),
        "likelihood": _component_spec(model.likelihood, "pyrobdl.likelihoods"),
    }


# ------------------------------------------------------------------------------------- JSON
#: Stand-in for a setting that JSON cannot hold (e.g. an ``init_loc`` dict of tensors); on load
#: the method's default is used in its place (the saved state overwrites what it initialised).
UNSERIALISABLE = "__unserialisable__"


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, torch.device):
        return str(value)
    return {UNSERIALISABLE: repr(value)[:200]}


def lost_in_json(value: Any) -> bool:
    """Whether a saved setting holds a value JSON could not (see :data:`UNSERIALISABLE`)."""
    if isinstance(value, dict):
        return UNSERIALISABLE in value or any(lost_in_json(v) for v in value.values())
    if isinstance(value, list):
        return any(lost_in_json(v) for v in value)
    return False


# ------------------------------------------------------------------------------------ write
def write_posterior(posterior: Any, path: str | os.PathLike[str]) -> Path:
    """Write ``posterior`` to the folder ``path``: the body of :func:`pyrobdl.saving.save_posterior`
    and :meth:`pyrobdl.Posterior.save`, which check that ``posterior`` is a
    :class:`~pyrobdl.posterior.Posterior` (this module sits below it and reads only its
    ``_state``, ``model``, ``settings``, ``cost``, ``history``, ``diagnostics`` and
    ``certification``).

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
    path = Path(path)
    if path.exists() and not (path.is_dir() and (path / _META).exists()):
        raise FileExistsError(f"{path} exists and is not a saved posterior; refusing to overwrite it")
    tensors, extra = posterior._state()
    cls = type(posterior)
    cert = posterior.certification
    meta = {
        "format": "pyrobdl-posterior", "format_version": FORMAT_VERSION,
        "class": {"module": cls.__module__, "name": cls.__qualname__},
        "model": model_spec(posterior.model),
        "method": posterior.method, "settings": _jsonable(posterior.settings),
        "cost": _jsonable(posterior.cost.to_dict()), "diagnostics": _jsonable(posterior.diagnostics),
        "certification": None if cert is None else _jsonable(cert.to_dict()),
        "dtype": str(torch.get_default_dtype()), "state": _jsonable(extra),
    }
    flat = {"history": torch.as_tensor(posterior.history, dtype=torch.float64).reshape(-1)}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{cls.__qualname__}._state returned a {type(t).__name__} for {name!r}, not a tensor")
        flat[f"state/{name}"] = t.detach().cpu().contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        torch.save(flat, tmp / _TENSORS)
        (tmp / _META).write_text(json.dumps(meta, indent=1, sort_keys=True), encoding="utf-8")
        if path.exists():  # a previous save: swap, then remove it
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
