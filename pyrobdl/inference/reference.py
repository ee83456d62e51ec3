r"""Reference posteriors: run long NUTS once, save its draws, compare other methods against them.

:func:`run_reference` fits ``method="nuts"`` (or any registered method whose result is an
:class:`~pyrobdl.inference.mcmc.MCMCPosterior`: ``"hmc"``, ...) and writes two files:

* ``<name>.npz`` — ``x_eval`` ``[N, in]``; ``function_draws`` ``[C*D, N, out]``, the network
  output at ``x_eval`` for *every* draw (chain-major); ``latent:<site>`` ``[C*D, ...]``, every
  draw of the likelihood's latents (the noise precision), so the full predictive (including
  aleatoric noise and log-likelihoods) can be rebuilt at ``x_eval``; and
  ``draws:<site>`` ``[C, T, ...]``, every site's draws thinned by ``thin`` per chain, to
  predict at other inputs later;
* ``<name>.json`` — a sidecar with the settings, model description, cost, diagnostics, the
  posterior's certification as a reference (``certification``, see
  :class:`~pyrobdl.diagnostics.Certification`), library versions, fingerprints of the training
  data and the SHA-256 of the ``.npz``.

Both are written atomically (:func:`pyrobdl._io.atomic_write_bytes`: a temporary file in the same
folder, then ``os.replace``), the ``.npz`` first and the sidecar last, so a sidecar only exists for
a complete ``.npz`` and the recorded hash detects a torn or altered pair.  :func:`load_reference`
reads them back into a :class:`Reference`, whose :meth:`Reference.prediction` is a
:class:`~pyrobdl.Prediction` at ``x_eval`` (what ``pyrobdl.diagnostics.evaluate(...,
reference=...)`` compares with), and whose :meth:`Reference.posterior` rebuilds an
:class:`~pyrobdl.inference.mcmc.MCMCPosterior` from the thinned draws for predictions elsewhere.
"""

from __future__ import annotations

import datetime
import hashlib
import io
import json
import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pyro
import torch

from .. import likelihoods as _likelihoods
from .._io import atomic_write_bytes
from .._version import __version__
from .._validation import check_data, check_inputs
from ..diagnostics.certification import Certification
from ..posterior import Cost, Prediction, predictive_from_draws
from .mcmc import MCMCPosterior
from .registry import fit, get_method

__all__ = ["FORMAT", "Reference", "load_reference", "run_reference"]

#: Format name and version recorded in every sidecar.
FORMAT = {"name": "pyrobdl-reference", "version": 1}


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _fingerprint(t: torch.Tensor) -> str:
    return _sha256_bytes(np.ascontiguousarray(t.detach().cpu().numpy()).tobytes())


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (np.generic,)):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _likelihood_spec(lik: Any) -> dict[str, Any]:
    params = {k: v for k, v in vars(lik).items() if not k.startswith("_") and isinstance(v, (int, float))}
    return {"class": type(lik).__name__, "params": params}


def _likelihood_from_spec(spec: Mapping[str, Any], where: Path) -> Any:
    cls = getattr(_likelihoods, spec.get("class", ""), None)
    if not isinstance(cls, type) or not issubclass(cls, _likelihoods.Likelihood):
        raise ValueError(f"{where}: unknown likelihood {spec.get('class')!r}; pass model= to load_reference")
    return cls(**spec.get("params", {}))


def _model_spec(model: Any) -> dict[str, Any]:
    return {
        "in_features": model.in_features,
        "hidden": list(model.hidden),
        "out_features": model.out_features,
        "activation": model.activation,
        "prior": repr(model.prior),
        "likelihood": _likelihood_spec(model.likelihood),
    }


class _StoredFunction:
    """Stands in for a model in :func:`predictive_from_draws`: the function values are stored."""

    def __init__(self, f: torch.Tensor, likelihood: Any) -> None:
        self.f, self.likelihood = f, likelihood

    def network(self, params: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return self.f


@dataclass(frozen=True)
class Reference:
    """A reference posterior read back from disk by :func:`load_reference`.

    Attributes
    ----------
    path : pathlib.Path
        The ``.npz`` file.
    x_eval : torch.Tensor
        Inputs the function draws are stored at, ``[N, in_features]``.
    function_draws : torch.Tensor
        Network output at ``x_eval`` for every draw, ``[C*D, N, out]``.
    latents : dict
        Every draw of each likelihood latent (e.g. ``precision``), ``[C*D, ...]``.
    draws : dict
        Every site, thinned per chain, ``[C, T, *site_shape]``.
    metadata : dict
        The JSON sidecar (settings, model, cost, diagnostics, versions, fingerprints).
    likelihood : pyrobdl.likelihoods.Likelihood
        The observation model (the given model's, or rebuilt from the sidecar).
    certification : pyrobdl.diagnostics.Certification
        Read from the sidecar (property); a sidecar written before certifications were recorded
        gives a failed one, "no certification recorded".
    """

    path: Path
    x_eval: torch.Tensor
    function_draws: torch.Tensor
    latents: Mapping[str, torch.Tensor]
    draws: Mapping[str, torch.Tensor]
    metadata: Mapping[str, Any]
    likelihood: Any = field(repr=False)

    @property
    def certification(self) -> Certification:
        """Whether the reference is certified (see :func:`pyrobdl.diagnostics.certify`)."""
        recorded = self.metadata.get("certification")
        if not isinstance(recorded, Mapping):
            return Certification.missing("no certification recorded")
        return Certification.from_dict(recorded)

    def prediction(self) -> Prediction:
        """The posterior predictive at ``x_eval`` from every stored draw (no network needed)."""
        stand_in = _StoredFunction(self.function_draws, self.likelihood)
        return predictive_from_draws(stand_in, dict(self.latents), self.x_eval)

    def posterior(self, model: Any) -> MCMCPosterior:
        """An :class:`MCMCPosterior` over the thinned draws, to predict at any inputs.

        Raises
        ------
        ValueError
            If ``model`` does not have the architecture the reference was run on.
        """
        _check_model(model, self.metadata, self.path)
        samples = {k: v.to(model.device) for k, v in self.draws.items()}
        meta = self.metadata
        posterior = MCMCPosterior(model, samples, None, method=meta["method"], settings=meta["settings"],
                                  cost=Cost(**meta["cost"]), diagnostics=meta["diagnostics"])
        posterior.certification = self.certification  # of the full run, not of the thinned draws
        return posterior


def _check_model(model: Any, metadata: Mapping[str, Any], path: Path) -> None:
    stored, given = metadata["model"], _model_spec(model)
    diff = [k for k in ("in_features", "hidden", "out_features", "activation") if stored[k] != given[k]]
    if stored["likelihood"]["class"] != given["likelihood"]["class"]:
        diff.append("likelihood")
    if diff:
        raise ValueError(
            f"{path}: the reference was run on a different model ({', '.join(diff)} differ: stored "
            f"{ {k: stored[k] for k in diff if k in stored} }, given { {k: given[k] for k in diff if k in given} })"
        )


def _paths(path: str | os.PathLike) -> tuple[Path, Path]:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    p = Path(path)
    if p.suffix != ".npz":
        raise ValueError(f"path must end in .npz, got {str(p)!r}")
    return p, p.with_suffix(".json")


def run_reference(
    model: Any,
    x: Any,
    y: Any,
    x_eval: Any,
    path: str | os.PathLike,
    *,
    thin: int = 10,
    method: str = "nuts",
    seed: int = 0,
    device: str | torch.device | None = None,
    progress: bool = True,
    overwrite: bool = False,
    **options: Any,
) -> Reference:
    r"""Run a long MCMC fit and save it as a reference posterior.

    Parameters
    ----------
    model : pyrobdl.BayesianMLP
        The model.
    x, y : array-like
        Training data (as for :func:`pyrobdl.fit`).
    x_eval : array-like
        Inputs at which every draw's function value is stored, ``[N, in_features]`` (typically
        the test inputs).
    path : str or os.PathLike
        Output ``.npz`` file; the sidecar is the same path with ``.json``.
    thin : int, default 10
        Keep every ``thin``-th draw of each chain for the stored weights.
    method : str, default "nuts"
        A registered method whose result is an
        :class:`~pyrobdl.inference.mcmc.MCMCPosterior` (``"nuts"``, ``"hmc"``, ...).
    seed : int, default 0
        Seed of the fit.
    device : str or torch.device, optional
        Where to run.
    progress : bool, default True
        Show progress bars.
    overwrite : bool, default False
        Replace existing files; otherwise an existing ``path`` is an error.
    **options
        Options of the sampler (``num_warmup``, ``num_samples``, ``num_chains``, ...).

    Returns
    -------
    Reference
        What :func:`load_reference` returns for the written files; its ``certification`` (also
        in the sidecar) is the fit's, at the first ``diagnostic_points`` training inputs.

    Raises
    ------
    ValueError
        Bad ``path``, ``thin``, unknown ``method``, options or data (before sampling); a method
        whose result holds no chains (after the fit, before anything is written).
    FileExistsError
        If ``path`` exists and ``overwrite`` is False.
    pyrobdl._io.WriteError
        If a file cannot be written (naming it); the previous file, if any, is then unchanged.

    Warns
    -----
    UserWarning
        From :func:`pyrobdl.fit` when the posterior is not certified as a reference; the files
        are written all the same, with the failed certification in the sidecar.
    """
    npz, sidecar = _paths(path)
    get_method(method)  # unknown names fail here, listing the valid ones
    if isinstance(thin, bool) or not isinstance(thin, int) or thin < 1:
        raise ValueError(f"thin must be an integer >= 1, got {thin!r}")
    if not overwrite and (npz.exists() or sidecar.exists()):
        raise FileExistsError(f"{npz} (or its sidecar) exists; load it with load_reference or pass overwrite=True")
    if not npz.parent.is_dir():
        raise ValueError(f"directory {str(npz.parent)!r} of path does not exist")
    x_eval_t = check_inputs(model, x_eval, "x_eval")
    x_t, y_t = check_data(model, x, y)

    posterior = fit(model, x, y, method=method, seed=seed, device=device, progress=progress, **options)
    if not isinstance(posterior, MCMCPosterior):
        raise ValueError(
            f"method {method!r} returned a {type(posterior).__name__}, not Markov chains (an MCMCPosterior): "
            "a reference must be sampled by an MCMC method such as 'nuts'"
        )
    x_eval_t = x_eval_t.to(model.device)
    f = posterior.function_draws(x_eval_t)
    total = posterior.num_chains * posterior.num_draws
    latent_names = list(model.likelihood.latent_distributions(model.device))
    arrays = {"x_eval": x_eval_t.cpu().numpy(), "function_draws": f.reshape(total, *f.shape[2:]).cpu().numpy()}
    for name in latent_names:
        v = posterior.samples[name]
        arrays[f"latent:{name}"] = v.reshape(total, *v.shape[2:]).cpu().numpy()
    for name, v in posterior.samples.items():
        arrays[f"draws:{name}"] = v[:, ::thin].cpu().numpy()
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    data = buf.getvalue()
    metadata = {
        "format": FORMAT,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "npz_sha256": _sha256_bytes(data),
        "method": method,
        "seed": seed,
        "thin": thin,
        "num_chains": posterior.num_chains,
        "num_draws": posterior.num_draws,
        "model": _model_spec(model),
        "settings": _jsonable(posterior.settings),
        "cost": posterior.cost.to_dict(),
        "diagnostics": _jsonable(posterior.diagnostics),
        "certification": (
            _jsonable(posterior.certification.to_dict()) if posterior.certification is not None else None
        ),
        "data": {"num_train": int(x_t.shape[0]), "x_sha256": _fingerprint(x_t), "y_sha256": _fingerprint(y_t),
                 "x_eval_sha256": _fingerprint(x_eval_t)},
        "versions": {"pyrobdl": __version__, "pyro": pyro.__version__, "torch": torch.__version__},
    }
    atomic_write_bytes(npz, data)
    atomic_write_bytes(sidecar, (json.dumps(metadata, indent=1, sort_keys=True) + "\n").encode())
    return load_reference(npz, model=model)


def load_reference(path: str | os.PathLike, *, model: Any | None = None) -> Reference:
    """Read a reference written by :func:`run_reference`.

    Parameters
    ----------
    path : str or os.PathLike
        The ``.npz`` file (its ``.json`` sidecar must sit beside it).
    model : pyrobdl.BayesianMLP, optional
        When given, checked against the stored architecture, and its likelihood and device are
        used; otherwise the likelihood is rebuilt from the sidecar and tensors stay on the CPU.

    Returns
    -------
    Reference

    Raises
    ------
    FileNotFoundError
        If the ``.npz`` or its sidecar is missing.
    ValueError
        If either file is unreadable, corrupted, of another format, or does not match its
        sidecar's hash, or ``model`` differs from the stored architecture; the message names
        the file.
    """
    npz, sidecar = _paths(path)
    for p in (npz, sidecar):
        if not p.is_file():
            raise FileNotFoundError(f"reference file {str(p)!r} not found")
    try:
        metadata = json.loads(sidecar.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"reference sidecar {str(sidecar)!r} is not valid JSON: {e}") from e
    if not isinstance(metadata, dict) or metadata.get("format", {}).get("name") != FORMAT["name"]:
        raise ValueError(f"{str(sidecar)!r} is not a pyrobdl reference sidecar")
    if metadata["format"].get("version") != FORMAT["version"]:
        raise ValueError(f"{str(sidecar)!r} has format version {metadata['format'].get('version')}, "
                         f"this pyrobdl reads version {FORMAT['version']}")
    data = npz.read_bytes()
    if _sha256_bytes(data) != metadata.get("npz_sha256"):
        raise ValueError(f"reference file {str(npz)!r} is corrupted or does not belong to its sidecar "
                         f"{str(sidecar)!r} (SHA-256 mismatch)")
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise ValueError(f"reference file {str(npz)!r} cannot be read: {e}") from e
    for key in ("x_eval", "function_draws"):
        if key not in arrays:
            raise ValueError(f"reference file {str(npz)!r} lacks the array {key!r}")
    if model is not None:
        _check_model(model, metadata, npz)
        likelihood, device = model.likelihood, model.device
    else:
        likelihood, device = _likelihood_from_spec(metadata["model"]["likelihood"], sidecar), torch.device("cpu")

    def tensor(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device)

    return Reference(
        path=npz,
        x_eval=tensor(arrays["x_eval"]),
        function_draws=tensor(arrays["function_draws"]),
        latents={k.split(":", 1)[1]: tensor(v) for k, v in arrays.items() if k.startswith("latent:")},
        draws={k.split(":", 1)[1]: tensor(v) for k, v in arrays.items() if k.startswith("draws:")},
        metadata=metadata,
        likelihood=likelihood,
    )
