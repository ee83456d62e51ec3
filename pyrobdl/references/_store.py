r"""The compact reference store: one compressed ``.npz`` per (dataset, split).

A *draws file* (what ``comparisons/uci_references.py --save-draws`` and
``comparisons/build_references.py`` write) holds every reference draw of the network output at
every test input.  :func:`convert` reduces it to a few kB: per test input the posterior mean and
sd of :math:`f` on the original target scale and its quantile function at ``L`` levels
:math:`p_i = (i + 1/2)/L`, the noise sd's quantiles, hashes of the test inputs and targets (not the
data themselves), the certification record and the protocol.  A SHA-256 over every stored entry is
checked on every :func:`load`.

Store entries (all arrays C-ordered, little-endian)
--------------------------------------------------
``meta``
    0-d unicode array: JSON (format version, name, split, levels, hashes, certification, protocol,
    reference metrics, measured rounding error).
``mean``, ``sd`` : float32 ``[N]``
    Posterior mean and sd (``ddof=1``) of :math:`f(x_n)`, original scale.
``zq`` : float16 ``[N, L]``
    Standardised quantiles :math:`(Q_n(p_i) - m_n)/s_n`; the quantile function is
    ``mean[:, None] + sd[:, None] * zq`` (:attr:`Reference.quantiles`).  float16 keeps 11
    significant bits, so a standardised quantile :math:`|z| < 4` is stored within
    :math:`2^{-10} \approx 0.001` reference sd (within 0.002 sd for :math:`4 \le |z| < 8`); the error
    each store actually has is measured at conversion (``meta["rounding"]``).
``noise_sd_quantiles`` : float32 ``[L]``
    Quantiles of the noise sd :math:`\sigma = \sigma_y/\sqrt{\tau}`, original scale.
``test_ids`` : int32 ``[N]``
    Row indices of the inputs in the split's test set.
``x_test``, ``y_test`` : float32, optional
    Only for synthetic data (``include_data=True``): the inputs (model scale) and targets
    (original scale) themselves.
``checksum``
    0-d unicode array: SHA-256 (hex) of every other entry (:func:`_digest`).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

FORMAT_VERSION = 1
DEFAULT_LEVELS = 100
DRAWS_KEYS = ("f", "precision", "x_test", "y_test", "y_mean", "y_std", "certification")
_FILE = re.compile(r"^(?P<name>[a-z0-9][a-z0-9-]*)_split(?P<split>[0-9]+)\.npz$")
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]*$")

#: How the test inputs and targets are hashed (``meta["hash_rule"]``).
HASH_RULE = ("sha256 of the float64 array (C order, little-endian) of the values rounded to float32, "
             "on the model scale: x as the model sees it (pyrobdl.datasets standardises inputs), "
             "y standardised as (y - y_mean) / y_std in float64, then rounded to float32")


def default_root() -> Path:
    """The package's own store folder, ``pyrobdl/references/data``."""
    return Path(__file__).resolve().parent / "data"


def levels(num_levels: int) -> np.ndarray:
    """Quantile levels :math:`p_i = (i + 1/2)/L`, ``i = 0 .. L-1`` (midpoints of ``L`` equal bins)."""
    return (np.arange(num_levels, dtype=np.float64) + 0.5) / num_levels


def empirical_quantiles(draws: np.ndarray, num_levels: int) -> np.ndarray:
    """Quantile function of the empirical distribution of ``draws`` ``[S, ...]`` at :func:`levels`.

    ``method="inverted_cdf"``: the smallest draw whose empirical CDF reaches :math:`p_i`, the exact
    quantile function of the empirical distribution (no interpolation).  Returns ``[L, ...]``.
    """
    return np.quantile(draws, levels(num_levels), axis=0, method="inverted_cdf")


def array_sha256(values: Any) -> str:
    """SHA-256 of an array by :data:`HASH_RULE` (values rounded to float32, hashed as float64)."""
    a = np.ascontiguousarray(np.asarray(values, dtype=np.float32).astype("<f8"))
    return hashlib.sha256(a.tobytes()).hexdigest()


def _digest(entries: Mapping[str, np.ndarray]) -> str:
    """SHA-256 over every entry but ``checksum``: name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for key in sorted(k for k in entries if k != "checksum"):
        a = np.ascontiguousarray(entries[key])
        h.update(f"{key}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def store_path(name: str, split: int, root: str | os.PathLike | None = None) -> Path:
    """Where the store of (``name``, ``split``) lives under ``root`` (default: :func:`default_root`)."""
    return Path(default_root() if root is None else root) / f"{name}_split{split}.npz"


def available(root: str | os.PathLike | None = None) -> list[tuple[str, int]]:
    """Every stored reference, as sorted ``(name, split)`` pairs.

    Parameters
    ----------
    root : path-like, optional
        Store folder (default: the package's own, :func:`default_root`).

    Returns
    -------
    list of (str, int)
    """
    folder = Path(default_root() if root is None else root)
    if not folder.is_dir():
        return []
    found = [(m["name"], int(m["split"])) for p in folder.iterdir() if (m := _FILE.match(p.name))]
    return sorted(found)


@dataclass(frozen=True)
class Reference:
    """One stored reference posterior summary (what :func:`load` returns).

    Attributes
    ----------
    name : str
        Dataset name (``"gap"``, ``"wine"``, ...).
    split : int
        Split index (the data seed for synthetic sets).
    mean, sd : ndarray, float64 ``[N]``
        Posterior mean and sd of :math:`f` at each test input, original target scale.
    zq : ndarray, float16 ``[N, L]``
        Standardised quantiles as stored; :attr:`quantiles` is the quantile function.
    noise_sd_quantiles : ndarray, float64 ``[L]``
        Quantiles of the noise sd, original scale.
    test_ids : ndarray, int ``[N]``
        Row indices of the inputs in the split's test set.
    meta : dict
        Everything else: hashes, ``y_mean``/``y_std``, certification record, protocol, reference
        metrics, the measured rounding error (module docstring).
    path : Path
        The store file.
    x_test, y_test : ndarray or None
        The data, stored for synthetic sets only (inputs on the model scale, targets original).
    """

    name: str
    split: int
    mean: np.ndarray = field(repr=False)
    sd: np.ndarray = field(repr=False)
    zq: np.ndarray = field(repr=False)
    noise_sd_quantiles: np.ndarray = field(repr=False)
    test_ids: np.ndarray = field(repr=False)
    meta: dict = field(repr=False)
    path: Path = field(repr=False)
    x_test: np.ndarray | None = field(default=None, repr=False)
    y_test: np.ndarray | None = field(default=None, repr=False)

    @property
    def num_inputs(self) -> int:
        """Number of test inputs ``N``."""
        return int(self.mean.shape[0])

    @property
    def num_levels(self) -> int:
        """Number of quantile levels ``L``."""
        return int(self.zq.shape[1])

    @property
    def levels(self) -> np.ndarray:
        """The quantile levels :math:`(i + 1/2)/L`."""
        return levels(self.num_levels)

    @property
    def quantiles(self) -> np.ndarray:
        """The reference's quantile function of :math:`f(x_n)`, ``[N, L]`` float64, original scale."""
        return self.mean[:, None] + self.sd[:, None] * self.zq.astype(np.float64)

    @property
    def y_mean(self) -> float:
        """Mean the targets were standardised with (model scale -> original: ``y * y_std + y_mean``)."""
        return float(self.meta["y_mean"])

    @property
    def y_std(self) -> float:
        """Scale the targets were standardised with."""
        return float(self.meta["y_std"])

    @property
    def certified(self) -> bool:
        """Whether the reference passed its certification."""
        return bool(self.meta["certification"]["passed"])

    @property
    def certification(self) -> Any:
        """The certification record as a :class:`pyrobdl.diagnostics.Certification`."""
        from ..diagnostics.certification import Certification

        return Certification.from_dict(self.meta["certification"])

    @property
    def protocol(self) -> dict:
        """Model, prior, likelihood, sampler settings, chains, draws, seed, versions."""
        return dict(self.meta["protocol"])


def _unknown(name: Any, split: Any, root: str | os.PathLike | None) -> ValueError:
    have = available(root)
    listing = ", ".join(f"({n!r}, {s})" for n, s in have) or "none"
    return ValueError(f"no stored reference for name={name!r}, split={split!r}; available: {listing}")


def load(name: str, split: int, *, root: str | os.PathLike | None = None) -> Reference:
    """Load a stored reference and verify its checksum.

    Parameters
    ----------
    name : str
        Dataset name, one of :func:`available`'s.
    split : int
        Split index.
    root : path-like, optional
        Store folder (default: the package's own).

    Returns
    -------
    Reference

    Raises
    ------
    ValueError
        If no such reference is stored (the message lists what is), or the file's checksum does not
        match its contents (a modified or damaged store), or its format version is unknown.
    """
    if not isinstance(name, str) or not _NAME.match(name) or isinstance(split, bool) \
            or not isinstance(split, (int, np.integer)) or split < 0:
        raise _unknown(name, split, root)
    path = store_path(name, int(split), root)
    if not path.is_file():
        raise _unknown(name, split, root)
    try:
        with np.load(io.BytesIO(path.read_bytes()), allow_pickle=False) as z:  # no file left open on error
            entries = {k: z[k] for k in z.files}
    except Exception as e:  # a truncated or foreign file
        raise ValueError(f"reference store {path} cannot be read: {e}") from e
    if "checksum" not in entries or "meta" not in entries:
        raise ValueError(f"reference store {path} has no checksum/meta entry: not a pyrobdl reference store")
    if str(entries["checksum"]) != _digest(entries):
        raise ValueError(f"reference store {path} fails its checksum: the file was modified or damaged")
    meta = json.loads(str(entries["meta"]))
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"reference store {path} has format version {meta.get('format_version')!r}; "
                         f"this pyrobdl reads {FORMAT_VERSION}")
    return Reference(
        meta["name"], int(meta["split"]), entries["mean"].astype(np.float64), entries["sd"].astype(np.float64),
        entries["zq"], entries["noise_sd_quantiles"].astype(np.float64), entries["test_ids"], meta, path,
        entries.get("x_test"), entries.get("y_test"),
    )


# ----------------------------------------------------------------------------------- convert
def read_draws(source: str | os.PathLike | Mapping[str, Any]) -> dict[str, Any]:
    """Read and check a draws file (or a mapping with its keys): shapes, finiteness, scale.

    Returns the entries as numpy values (``certification`` parsed from JSON to a dict).

    Raises
    ------
    ValueError
        For a missing key, a wrong shape or a non-finite value; the message names the entry.
    """
    if isinstance(source, Mapping):
        raw = dict(source)
    else:
        with np.load(io.BytesIO(Path(source).read_bytes()), allow_pickle=False) as z:
            raw = {k: z[k] for k in z.files}
    missing = [k for k in DRAWS_KEYS if k not in raw]
    if missing:
        raise ValueError(f"draws file lacks {missing}; a draws file holds {list(DRAWS_KEYS)}")
    d = {k: np.asarray(raw[k]) for k in DRAWS_KEYS if k != "certification"}
    f = d["f"]
    if f.ndim == 4 and f.shape[-1] == 1:
        f = d["f"] = f[..., 0]
    if f.ndim != 3 or f.shape[0] * f.shape[1] < 2:
        raise ValueError(f"draws file 'f' must be [chain, draw, N] with at least 2 draws, got {list(f.shape)}")
    c, s, n = f.shape
    expect = {"precision": (c, s), "y_test": (n,), "y_mean": (), "y_std": ()}
    for key, shape in expect.items():
        if d[key].shape != shape:
            raise ValueError(f"draws file {key!r} must have shape {list(shape)}, got {list(d[key].shape)}")
    if d["x_test"].ndim != 2 or d["x_test"].shape[0] != n:
        raise ValueError(f"draws file 'x_test' must be [N={n}, D], got {list(d['x_test'].shape)}")
    for key, v in d.items():
        if not np.all(np.isfinite(v)):
            raise ValueError(f"draws file {key!r} has non-finite values")
    if not (float(d["y_std"]) > 0 and np.all(d["precision"] > 0)):
        raise ValueError("draws file 'y_std' and 'precision' must be positive")
    cert = raw["certification"]
    d["certification"] = json.loads(str(cert)) if not isinstance(cert, Mapping) else dict(cert)
    return d


def mixture_test_ll(f: np.ndarray, noise_sd: np.ndarray, y: np.ndarray, chunk: int = 4_000_000) -> float:
    r"""Mean over inputs of :math:`\log \frac1S \sum_s \mathcal N(y_n \mid f_{sn}, \sigma_s^2)`.

    Parameters
    ----------
    f : ndarray ``[S, N]``
        Function draws.
    noise_sd : ndarray ``[S]``
        Noise sd of each draw (same scale as ``f`` and ``y``).
    y : ndarray ``[N]``
        Targets.
    chunk : int
        Elements of ``[S, n]`` evaluated at a time (memory bound).

    Returns
    -------
    float
    """
    s, n = f.shape
    sd = np.asarray(noise_sd, dtype=np.float64).reshape(s, 1)
    step = max(1, chunk // s)
    total = 0.0
    for lo in range(0, n, step):
        z = (y[None, lo:lo + step] - f[:, lo:lo + step]) / sd
        logp = -0.5 * z * z - np.log(sd) - 0.5 * np.log(2.0 * np.pi)
        top = logp.max(0)
        total += float(np.sum(top + np.log(np.exp(logp - top).sum(0)) - np.log(s)))
    return total / n


def _reference_metrics(f: np.ndarray, noise_sd: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """RMSE of the posterior mean and test log-likelihood (mixture over every draw), original scale."""
    rmse = float(np.sqrt(np.mean((f.mean(0) - y) ** 2)))
    return {"rmse": rmse, "test_ll": mixture_test_ll(f, noise_sd, y)}


def summarise(draws: Mapping[str, Any], num_levels: int = DEFAULT_LEVELS) -> tuple[dict[str, np.ndarray], dict]:
    """The arrays of a store and their measured facts, from checked draws (:func:`read_draws`)."""
    c, s, n = draws["f"].shape
    y_mean, y_std = float(draws["y_mean"]), float(draws["y_std"])
    f = draws["f"].reshape(c * s, n).astype(np.float64) * y_std + y_mean
    mean, sd = f.mean(0), f.std(0, ddof=1)
    q = empirical_quantiles(f, num_levels).T  # [N, L]
    safe = np.where(sd > 0, sd, 1.0)
    zq = ((q - mean[:, None]) / safe[:, None]).astype(np.float16)
    mean32, sd32 = mean.astype(np.float32), sd.astype(np.float32)
    back = mean32[:, None].astype(np.float64) + sd32[:, None].astype(np.float64) * zq.astype(np.float64)
    err = np.abs(back - q)
    noise_sd = y_std / np.sqrt(draws["precision"].reshape(-1).astype(np.float64))
    y = draws["y_test"].astype(np.float64) * y_std + y_mean
    facts = {
        "num_chains": int(c), "num_draws": int(s), "num_inputs": int(n),
        "rounding": {"quantile_max_abs": float(err.max()),
                     "quantile_max_in_sd": float((err / safe[:, None]).max()),
                     "zq_max_abs": float(np.abs(zq).max())},
        "reference_metrics": _reference_metrics(f, noise_sd, y),
        "x_sha256": array_sha256(draws["x_test"]), "y_sha256": array_sha256(draws["y_test"]),
        "y_mean": y_mean, "y_std": y_std,
    }
    arrays = {"mean": mean32, "sd": sd32, "zq": zq,
              "noise_sd_quantiles": empirical_quantiles(noise_sd, num_levels).astype(np.float32),
              "test_ids": np.arange(n, dtype=np.int32)}
    return arrays, facts


def _write(path: Path, entries: dict[str, np.ndarray]) -> None:
    """Write ``entries`` plus their checksum, compressed, atomically (temporary file, then rename)."""
    entries = dict(entries)
    entries["checksum"] = np.array(_digest(entries))
    buf = io.BytesIO()
    np.savez_compressed(buf, **entries)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, path)


def convert(source: str | os.PathLike | Mapping[str, Any], name: str, split: int, *,
            protocol: Mapping[str, Any], root: str | os.PathLike | None = None, force: bool = False,
            num_levels: int = DEFAULT_LEVELS, include_data: bool = False) -> Path:
    """Reduce a draws file to a compact reference store (module docstring) and write it.

    Parameters
    ----------
    source : path-like or mapping
        The draws file (``f`` ``[chain, draw, N]`` on the model scale, ``precision`` ``[chain,
        draw]``, ``x_test``, ``y_test`` on the model scale, ``y_mean``, ``y_std``,
        ``certification`` as JSON), or a mapping with the same keys.
    name : str
        Dataset name (lower case letters, digits, ``-``).
    split : int
        Split index.
    protocol : mapping
        How the reference was made (JSON types): model, prior, likelihood, sampler settings, seed,
        data recipe, pyrobdl version.  Chains and draws are added from the draws.
    root : path-like, optional
        Store folder (default: the package's own).
    force : bool, default False
        Store an uncertified reference anyway (its ``certified`` stays False).
    num_levels : int, default 100
        Quantile levels ``L``.
    include_data : bool, default False
        Also store ``x_test`` and the original-scale ``y_test``: only for synthetic data, never
        for data that is not ours to redistribute (UCI).

    Returns
    -------
    Path
        The store file written.

    Raises
    ------
    ValueError
        For a malformed draws file, a bad name or split, an invalid certification record, or an
        uncertified reference without ``force`` (the message quotes its failures).
    """
    from ..diagnostics.certification import Certification

    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"name must match {_NAME.pattern!r} (lower case, digits, '-'), got {name!r}")
    if isinstance(split, bool) or not isinstance(split, (int, np.integer)) or split < 0:
        raise ValueError(f"split must be an integer >= 0, got {split!r}")
    if isinstance(num_levels, bool) or not isinstance(num_levels, int) or num_levels < 2:
        raise ValueError(f"num_levels must be an integer >= 2, got {num_levels!r}")
    draws = read_draws(source)
    cert = Certification.from_dict(draws["certification"])
    if not cert.passed and not force:
        raise ValueError(f"refusing to store an uncertified reference for {name!r} split {split} "
                         f"({cert.summary()}); pass force=True to store it marked uncertified")
    arrays, facts = summarise(draws, num_levels)
    meta = {
        "format_version": FORMAT_VERSION, "name": name, "split": int(split), "num_levels": num_levels,
        "level_rule": "(i + 0.5) / L, i = 0 .. L-1; empirical quantiles by numpy method='inverted_cdf'",
        "scale": "original target scale (model scale * y_std + y_mean)", "hash_rule": HASH_RULE,
        **facts, "certification": cert.to_dict(),
        "protocol": {**dict(protocol), "num_chains": facts["num_chains"], "num_draws": facts["num_draws"]},
        "includes_data": bool(include_data), "forced": bool(force and not cert.passed),
    }
    if not isinstance(source, Mapping):
        meta["source_sha256"] = hashlib.sha256(Path(source).read_bytes()).hexdigest()
    if include_data:
        arrays["x_test"] = np.asarray(draws["x_test"], dtype=np.float32)
        y = draws["y_test"].astype(np.float64) * facts["y_std"] + facts["y_mean"]
        arrays["y_test"] = y.astype(np.float32)
    text = json.dumps(meta, sort_keys=True, allow_nan=True)
    json.loads(text)  # JSON-serialisable protocol, or an error here rather than a broken store
    path = store_path(name, int(split), root)
    _write(path, {**arrays, "meta": np.array(text)})
    return path
