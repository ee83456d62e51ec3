r"""Comparison suites: TOML files read with the standard library and validated key by key.

A suite names datasets, a model, methods with their options, seeds and splits.  Every key is
checked before anything runs; a wrong key gets an error naming the key, the file and the valid
keys, and all such errors of a file are reported together.

File layout (every table and key is optional unless marked)::

    [suite]
    name = "quickstart"            # default: the file's stem
    description = "..."
    seeds = [0]                    # fit seeds; each cell is fitted once per seed
    device = "cpu"                 # default device; ``pyrobdl compare --device`` overrides it
    num_eval_samples = 200         # posterior draws used for every metric and prediction
    inference_data = true          # write ArviZ netCDF per cell
    fit_diagnostics = true         # PSIS-LOO and VI Pareto k on the training split
    data_dir = "../datasets"       # datasets root (relative to this file); --data-dir overrides
    reference = "nuts"             # method label whose fit is the reference (per dataset override)
    reference_replicates = 2       # 2: a second, independent run of the reference (its resolution)

    [model]                        # the default model of every dataset
    hidden = [50]
    activation = "relu"
    prior = { kind = "gaussian", scale = 1.0 }
    likelihood = { kind = "gaussian", precision = 10.0, precision_units = "standardized" }

    [methods.<label>]              # at least one; <label> is the registry name unless method= says
    method = "mean_field"
    num_steps = 2000               # any option of the method (``pyrobdl methods`` lists them)
    model = { prior = { kind = "log_uniform" } }   # model overrides for this method
    published = ["gal2016_mc_dropout"]             # published rows the report compares with
    gradient_variance = false      # run the gradient-variance diagnostic after the fit
    resources = { cpu = 1, gpu = 0.25 }            # per cell, for --executor ray (default cpu 1, gpu 0)

    [datasets.<label>]             # at least one
    source = "uci"                 # required: blr | gap | uci | mnist | file
    name = "boston"                # source options (see SOURCES); uci/mnist name defaults to label
    splits = [0, 1] or "all"       # default [0]
    methods = ["mean_field"]       # method labels run on this dataset (default: all)
    reference = "nuts"             # overrides [suite] reference ("" = none)
    reference_replicates = 1       # overrides [suite] reference_replicates
    model = { hidden = [] }        # model overrides for this dataset
    overrides = { dropout = { p = 0.05, model = { prior = { kind = "gaussian", scale = 100.0 } } } }
                                   # per-method options (and model overrides) on this dataset

    [gradient_variance]            # keyword arguments of pyrobdl.diagnostics.gradient_variance

Model keys are merged in the order ``[model]`` < dataset ``model`` < method ``model`` < the
dataset's ``overrides.<method>.model``; the ``prior`` and ``likelihood`` tables are replaced
whole, not merged.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any, Mapping

from .._validation import MAX_NESTING, nesting_depth
from ..inference import get_method, methods
from ..model import ACTIVATIONS
from .published import PUBLISHED
from .schema import (
    DATASET_RESERVED,
    LABEL_PATTERN,
    METHOD_RESERVED,
    MODEL_KEYS,
    PRECISION_UNITS,
    REFERENCE_REPLICATES,
    RESOURCE_KEYS,
    SUITE_KEYS,
    TOP_KEYS,
    ConfigError,
    DatasetEntry,
    MethodEntry,
    Suite,
    _kwargs_of,
    label_problem,
    model_components,
)
from .sources import SOURCES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the same parser, packaged for Python 3.10
    import tomli as tomllib

__all__ = [
    "LABEL_PATTERN",
    "ConfigError",
    "DatasetEntry",
    "MethodEntry",
    "Suite",
    "label_problem",
    "load_suite",
    "model_components",
    "parse_suite",
    "tomllib",
]


def _case_clashes(errors: "_Errors", where: str, labels: Any) -> None:
    seen: dict[str, str] = {}
    for label in labels:
        key = str(label).casefold()
        if key in seen:
            errors.add(f"{where}.{label}", f"differs from {where}.{seen[key]} only in letter case; "
                       "labels name folders, which some file systems do not tell apart")
        seen.setdefault(key, str(label))


class _Errors:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.items: list[str] = []

    def add(self, where: str, message: str) -> None:
        self.items.append(f"{self.path}: {where}: {message}")

    def unknown(self, where: str, given: Mapping[str, Any], valid: Any) -> None:
        for key in given:
            if key not in valid:
                self.add(f"{where}.{key}" if where else key, f"unknown key {key!r}; valid keys: {sorted(valid)}")

    def raise_if_any(self) -> None:
        if self.items:
            n = len(self.items)
            head = f"invalid suite {self.path} ({n} problem{'s' if n > 1 else ''}):"
            raise ConfigError("\n".join([head, *self.items]))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _check_value_type(default: Any, value: Any) -> str | None:
    """A reason why ``value`` cannot stand for an option whose default is ``default``, or None.

    Only clear mismatches are rejected (a string for a number, a number for a flag); value
    ranges are checked by the method itself when the cell runs.
    """
    if default is None:
        return None
    if isinstance(default, bool):
        return None if isinstance(value, bool) else f"must be true or false, got {value!r}"
    if _is_number(default):
        if _is_number(value) or (isinstance(value, list) and value and all(_is_number(v) for v in value)):
            return None
        return f"must be a number (or a list of numbers), got {value!r}"
    if isinstance(default, str):  # a choice, or 'auto' standing for a flag or a number (chees compile, chunk_size)
        ok = isinstance(value, (str, bool)) or _is_number(value)
        return None if ok else f"must be a string (or a flag or number the method takes), got {value!r}"
    return None


def _check_model(errors: _Errors, where: str, spec: Any) -> None:
    if not isinstance(spec, dict):
        errors.add(where, f"must be a table, got {spec!r}")
        return
    errors.unknown(where, spec, MODEL_KEYS)
    if "hidden" in spec:
        h = spec["hidden"]
        if not isinstance(h, list) or not all(_is_int(w) and w >= 1 for w in h):
            errors.add(f"{where}.hidden", f"must be a list of integers >= 1 (may be empty), got {h!r}")
    if "activation" in spec and spec["activation"] not in ACTIVATIONS:
        errors.add(f"{where}.activation", f"unknown activation {spec['activation']!r}; valid: {sorted(ACTIVATIONS)}")
    comps = model_components()
    for part in ("prior", "likelihood"):
        if part not in spec:
            continue
        table = spec[part]
        if not isinstance(table, dict) or "kind" not in table:
            errors.add(f"{where}.{part}", f"must be a table with a 'kind'; valid kinds: {sorted(comps[part])}")
            continue
        kind = table["kind"]
        if kind not in comps[part]:
            errors.add(f"{where}.{part}.kind", f"unknown {part} kind {kind!r}; valid kinds: {sorted(comps[part])}")
            continue
        valid = ["kind", *_kwargs_of(comps[part][kind])]
        if part == "likelihood" and "precision" in valid:
            valid.append("precision_units")
            units = table.get("precision_units", "standardized")
            if units not in PRECISION_UNITS:
                errors.add(f"{where}.{part}.precision_units", f"unknown value {units!r}; valid: {list(PRECISION_UNITS)}")
        errors.unknown(f"{where}.{part}", table, valid)


def _str_list(errors: _Errors, where: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        errors.add(where, f"must be a list of strings, got {value!r}")
        return ()
    return tuple(value)


def _parse_methods(errors: _Errors, raw: Any) -> list[MethodEntry]:
    if not isinstance(raw, dict) or not raw:
        errors.add("methods", "at least one [methods.<label>] table is required")
        return []
    entries = []
    for label, table in raw.items():
        where = f"methods.{label}"
        why = label_problem(label)
        if why:
            errors.add(where, why)
        if not isinstance(table, dict):
            errors.add(where, f"must be a table, got {table!r}")
            continue
        name = table.get("method", label)
        try:
            meth = get_method(name)
        except ValueError:
            errors.add(f"{where}.method" if "method" in table else where, f"unknown method {name!r}; valid methods: {methods()}")
            continue
        clash = sorted(set(meth.options) & set(METHOD_RESERVED))
        if clash:
            errors.add(where, f"method {name!r} has options {clash} that clash with suite keys {list(METHOD_RESERVED)}")
        options = {k: v for k, v in table.items() if k not in METHOD_RESERVED}
        errors.unknown(where, options, [*meth.options, *METHOD_RESERVED])
        for key, value in options.items():
            if key in meth.options:
                why = _check_value_type(meth.options[key], value)
                if why:
                    errors.add(f"{where}.{key}", why)
        model = table.get("model", {})
        _check_model(errors, f"{where}.model", model)
        published = _str_list(errors, f"{where}.published", table.get("published", []))
        for key in published:
            if key not in PUBLISHED:
                errors.add(f"{where}.published", f"unknown published row {key!r}; valid: {sorted(PUBLISHED)}")
        gv = table.get("gradient_variance", False)
        if not isinstance(gv, bool):
            errors.add(f"{where}.gradient_variance", f"must be true or false, got {gv!r}")
        resources = _parse_resources(errors, f"{where}.resources", table.get("resources", {}))
        entries.append(
            MethodEntry(label, name, options, model if isinstance(model, dict) else {}, published, gv is True,
                        resources)
        )
    return entries


def _parse_resources(errors: _Errors, where: str, raw: Any) -> dict[str, float]:
    """``resources = { cpu = N, gpu = F }``: cpu a number > 0, gpu 0, a fraction in (0, 1) or a whole count."""
    out = {"cpu": 1.0, "gpu": 0.0}
    if not isinstance(raw, dict):
        errors.add(where, f"must be a table like {{ cpu = 1, gpu = 0.25 }}, got {raw!r}")
        return out
    errors.unknown(where, raw, RESOURCE_KEYS)
    for key in RESOURCE_KEYS:
        if key not in raw:
            continue
        v = raw[key]
        if not _is_number(v) or isinstance(v, bool) or not math.isfinite(v) or v < 0 or (key == "cpu" and v == 0):
            errors.add(f"{where}.{key}", f"must be a number {'> 0' if key == 'cpu' else '>= 0'}, got {v!r}")
            continue
        if key == "gpu" and v > 1 and float(v) != int(v):
            errors.add(f"{where}.gpu", f"must be a fraction of one device (at most 1) or a whole number of devices, got {v!r}")
            continue
        out[key] = float(v)
    return out


def _replicates(errors: _Errors, where: str, value: Any) -> int:
    if _is_int(value) and value in REFERENCE_REPLICATES:
        return int(value)
    errors.add(where, f"must be 1 (one reference run) or 2 (a second, independent run: the reference's resolution), "
                      f"got {value!r}")
    return 1


def _parse_splits(errors: _Errors, where: str, table: Mapping[str, Any], fixed_splits: bool) -> tuple[int, ...] | str:
    """A dataset table's ``splits``: a tuple of split indices, or ``"all"`` (a source with fixed splits)."""
    splits: tuple[int, ...] | str = (0,)
    if "splits" in table:
        s = table["splits"]
        if s == "all":
            splits = "all"
        elif isinstance(s, list) and s and all(_is_int(v) and 0 <= v < 2**32 for v in s):
            splits = tuple(s)
        else:
            errors.add(f"{where}.splits", f'must be a non-empty list of integers in 0..2**32-1 or "all", got {s!r}')
    if splits == "all" and not fixed_splits:
        errors.add(f"{where}.splits", f'"all" needs a source with fixed splits; {table.get("source")!r} has none')
    return splits


def _parse_overrides(errors: _Errors, where: str, overrides: Any, ds_methods: Any,
                     entries_by_label: Mapping[str, MethodEntry]) -> dict[str, Any]:
    """A dataset table's ``overrides``: method label -> options (and model overrides), each checked."""
    if not isinstance(overrides, dict):
        errors.add(f"{where}.overrides", f"must be a table of method label -> options, got {overrides!r}")
        overrides = {}
    for m, opts in overrides.items():
        w = f"{where}.overrides.{m}"
        if m not in ds_methods:
            errors.add(w, f"unknown method label; valid: {list(ds_methods)}")
        elif not isinstance(opts, dict):
            errors.add(w, f"must be a table of options, got {opts!r}")
        elif m in entries_by_label:
            meth = get_method(entries_by_label[m].method)
            errors.unknown(w, opts, [*meth.options, "model"])
            for key, value in opts.items():
                why = _check_value_type(meth.options[key], value) if key in meth.options else None
                if why:
                    errors.add(f"{w}.{key}", why)
            if "model" in opts:
                _check_model(errors, f"{w}.model", opts["model"])
    return overrides


def _parse_datasets(
    errors: _Errors, raw: Any, labels: list[str], default_reference: str | None, base: Path,
    entries_by_label: Mapping[str, MethodEntry], default_replicates: int = 1,
) -> list[DatasetEntry]:
    if not isinstance(raw, dict) or not raw:
        errors.add("datasets", "at least one [datasets.<label>] table is required")
        return []
    entries = []
    for label, table in raw.items():
        where = f"datasets.{label}"
        why = label_problem(label)
        if why:
            errors.add(where, why)
        if not isinstance(table, dict):
            errors.add(where, f"must be a table, got {table!r}")
            continue
        source_name = table.get("source")
        if source_name not in SOURCES:
            errors.add(f"{where}.source", f"{'missing' if source_name is None else 'unknown source ' + repr(source_name)}; valid sources: {sorted(SOURCES)}")
            continue
        source = SOURCES[source_name]
        given = {k: v for k, v in table.items() if k not in DATASET_RESERVED}
        errors.unknown(where, given, [*source.options, *DATASET_RESERVED])
        options = dict(source.options)
        options.update({k: v for k, v in given.items() if k in source.options})
        if "name" in source.options and "name" not in given:
            options["name"] = label
        for key, why in source.check(options, base):
            errors.add(f"{where}.{key}", why)
        splits = _parse_splits(errors, where, table, source.num_splits is not None)
        ds_methods = _str_list(errors, f"{where}.methods", table.get("methods", labels))
        for m in ds_methods:
            if m not in labels:
                errors.add(f"{where}.methods", f"unknown method label {m!r}; valid: {labels}")
        reference = table.get("reference", default_reference) or None
        if reference is not None:
            if not isinstance(reference, str) or reference not in ds_methods:
                errors.add(
                    f"{where}.reference",
                    f"must be the label of a method run on this dataset, one of {list(ds_methods)}; got {reference!r}",
                )
        replicates = default_replicates
        if "reference_replicates" in table:
            replicates = _replicates(errors, f"{where}.reference_replicates", table["reference_replicates"])
            if replicates > 1 and reference is None:
                errors.add(f"{where}.reference_replicates", "a second reference run needs a reference "
                           "(reference = \"<method label>\" here or in [suite])")
        model = table.get("model", {})
        _check_model(errors, f"{where}.model", model)
        overrides = _parse_overrides(errors, where, table.get("overrides", {}), ds_methods, entries_by_label)
        entries.append(
            DatasetEntry(
                label, source_name, options, splits, ds_methods, reference,
                model if isinstance(model, dict) else {}, overrides, replicates if reference is not None else 1,
            )
        )
    return entries


def _parse_suite_table(errors: _Errors, suite: Any) -> tuple[dict[str, Any], list[Any], Any]:
    """The ``[suite]`` table checked: (the table, its seeds, its num_eval_samples)."""
    if not isinstance(suite, dict):
        errors.add("suite", "must be a table")
        suite = {}
    errors.unknown("suite", suite, SUITE_KEYS)
    seeds = suite.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(_is_int(s) and 0 <= s < 2**32 for s in seeds):
        errors.add("suite.seeds", f"must be a non-empty list of integers in 0..2**32-1, got {seeds!r}")
        seeds = [0]
    if len(set(seeds)) != len(seeds):
        errors.add("suite.seeds", f"has duplicates: {seeds!r}")
    nes = suite.get("num_eval_samples", 200)
    if not _is_int(nes) or nes < 2:
        errors.add("suite.num_eval_samples", f"must be an integer >= 2, got {nes!r}")
    for key in ("name", "description", "device", "data_dir", "reference"):
        if key in suite and not isinstance(suite[key], str):
            errors.add(f"suite.{key}", f"must be a string, got {suite[key]!r}")
    for key in ("inference_data", "fit_diagnostics"):
        if not isinstance(suite.get(key, True), bool):
            errors.add(f"suite.{key}", f"must be true or false, got {suite[key]!r}")
    return suite, seeds, nes


def _check_gradient_variance(errors: _Errors, gv: Any) -> None:
    """The ``[gradient_variance]`` table: keyword arguments of :func:`pyrobdl.diagnostics.gradient_variance`."""
    if not isinstance(gv, dict):
        errors.add("gradient_variance", "must be a table of keyword arguments")
    else:
        from .. import diagnostics

        fn = getattr(diagnostics, "gradient_variance", None)
        if fn is None:
            errors.add("gradient_variance", "this pyrobdl has no pyrobdl.diagnostics.gradient_variance")
        else:
            valid = [k for k in _kwargs_of(fn) if k not in ("model", "x", "y", "guide_params")]
            errors.unknown("gradient_variance", gv, valid)


def parse_suite(raw: Mapping[str, Any], path: str | Path = "<suite>") -> Suite:
    """Validate a parsed suite (a dict as returned by :func:`tomllib.load`).

    Parameters
    ----------
    raw : Mapping
        The TOML document.
    path : str or pathlib.Path
        The file it came from; named in errors, and relative paths are resolved against its
        folder.

    Returns
    -------
    Suite

    Raises
    ------
    ConfigError
        Listing every invalid key or value found, each with the file, the key and the valid keys.
    """
    path = Path(path)
    base = path.parent if path.suffix else Path.cwd()
    errors = _Errors(path)
    errors.unknown("", raw, TOP_KEYS)
    suite, seeds, nes = _parse_suite_table(errors, raw.get("suite", {}))
    model = raw.get("model", {})
    _check_model(errors, "model", model)
    method_entries = _parse_methods(errors, raw.get("methods"))
    labels = [m.label for m in method_entries]
    if raw.get("methods") and isinstance(raw["methods"], dict):
        labels = list(raw["methods"])
    replicates = _replicates(errors, "suite.reference_replicates", suite.get("reference_replicates", 1))
    dataset_entries = _parse_datasets(
        errors, raw.get("datasets"), labels, suite.get("reference") or None, base,
        {m.label: m for m in method_entries}, replicates,
    )
    if replicates > 1 and dataset_entries and not any(d.reference for d in dataset_entries):
        errors.add("suite.reference_replicates", "a second reference run needs a reference: no dataset has one "
                   "(set [suite] reference or a dataset's reference)")
    for where in ("methods", "datasets"):
        if isinstance(raw.get(where), dict):
            _case_clashes(errors, where, raw[where])
    gv = raw.get("gradient_variance")
    if gv is not None:
        _check_gradient_variance(errors, gv)
    errors.raise_if_any()
    data_dir = suite.get("data_dir") or None
    if data_dir is not None:
        data_dir = str((base / data_dir).expanduser()) if not Path(data_dir).is_absolute() else data_dir
    return Suite(
        path=path,
        name=suite.get("name", path.stem),
        description=suite.get("description", ""),
        seeds=tuple(seeds),
        device=suite.get("device") or None,
        num_eval_samples=int(nes),
        inference_data=suite.get("inference_data", True),
        fit_diagnostics=suite.get("fit_diagnostics", True),
        data_dir=data_dir,
        model=dict(model),
        methods=tuple(method_entries),
        datasets=tuple(dataset_entries),
        gradient_variance=dict(gv) if isinstance(gv, dict) else None,
        raw=dict(raw),
    )


def load_suite(path: str | Path) -> Suite:
    """Read and validate a suite file.

    Parameters
    ----------
    path : str or pathlib.Path
        A TOML file.

    Returns
    -------
    Suite

    Raises
    ------
    FileNotFoundError
        If the file does not exist.
    ConfigError
        If it is not valid TOML (the parser's message, with the file) or any key is invalid.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"suite file {path} not found")
    try:
        with path.open("rb") as fh:
            raw = tomllib.load(fh)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}); save the suite file as UTF-8") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to be a suite file (arrays or tables inside each other "
                          "beyond Python's recursion limit)") from None
    if nesting_depth(raw) > MAX_NESTING:  # what parsed under a raised recursion limit (torch.compile raises it)
        raise ConfigError(f"{path}: nested too deeply to be a suite file (arrays or tables inside each other "
                          f"more than {MAX_NESTING} levels)")
    return parse_suite(raw, path)
