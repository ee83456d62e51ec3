r"""The grid of a suite: independent cells (dataset x split x method x seed), and their models.

A :class:`Cell` carries its fully resolved configuration (source options, model spec, every
option of the method with defaults filled in from the registry), so a cell can run anywhere
from its own description and its record says exactly what produced it.  Cells whose method is
a dataset's reference are marked, and every other cell of the same dataset and split points to
its reference cell, which runs first.  With ``reference_replicates = 2`` the reference method also
runs once more on every split, with seed ``reference seed + REPLICATE_SEED_OFFSET`` (a *replicate*
cell, run beside the reference), and every cell that points to the reference points to the
replicate too: its evaluation reads the two runs' disagreement as the reference's resolution.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from .. import BayesianMLP
from ..inference import get_method
from .config import ConfigError, Suite, label_problem, model_components
from .sources import SOURCES, load_dataset
from .store import config_hash

__all__ = ["Cell", "FILTER_KEYS", "REPLICATE_SEED_OFFSET", "build_model", "check_plan", "expand", "parse_only",
           "select"]

#: Keys ``--only`` accepts.
FILTER_KEYS = ("dataset", "method", "seed", "split")
#: A reference replicate's seed is the reference's seed plus this (a seed the suite's own seeds may not use).
REPLICATE_SEED_OFFSET = 1000


@dataclass(frozen=True)
class Cell:
    """One independent unit of work.

    Attributes
    ----------
    id : str
        ``<dataset>__<method>__split-<k>__seed-<s>``; the name of its results folder.
    dataset, method : str
        Dataset and method labels of the suite.
    split, seed : int
        Split index (data seed for synthetic sources) and fit seed.
    spec : Mapping
        The resolved configuration (JSON types only).
    config_hash : str
        SHA-256 of ``spec``: a stored result is reused only when it matches.
    is_reference : bool
        Whether other cells use this cell's posterior as their reference.
    reference : str or None
        Id of this cell's reference cell.
    resources : Mapping[str, float]
        ``{"cpu": ..., "gpu": ...}`` one run of the cell needs (its method's ``resources``; for
        distributed executors; not in ``spec``, so not in the hash).
    is_replicate : bool
        Whether this cell is the second, independent run of a reference (``reference_replicates
        = 2``): it runs beside the reference and its draws are kept like the reference's.
    replicate : str or None
        Id of the replicate of this cell's reference (the reference's resolution is computed from
        the two), or None.
    """

    id: str
    dataset: str
    method: str
    split: int
    seed: int
    spec: Mapping[str, Any] = field(repr=False)
    config_hash: str = field(repr=False)
    is_reference: bool = False
    reference: str | None = None
    resources: Mapping[str, float] = field(default_factory=lambda: {"cpu": 1.0, "gpu": 0.0}, repr=False)
    is_replicate: bool = False
    replicate: str | None = None


def cell_id(dataset: str, method: str, split: int, seed: int) -> str:
    """The id (and folder name) of a cell: ``<dataset>__<method>__split-<k>__seed-<s>``.

    Labels follow :data:`pyrobdl.compare.config.LABEL_PATTERN` (no ``__``, no leading or
    trailing separator), so the id splits back into its four parts at ``__`` in exactly one way:
    two different cells never share a folder.

    Raises
    ------
    ValueError
        If a label is not valid, or ``split`` or ``seed`` is not an integer >= 0.
    """
    for label in (dataset, method):
        why = label_problem(label)
        if why:
            raise ValueError(why)
    for name, v in (("split", split), ("seed", seed)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
    return f"{dataset}__{method}__split-{split}__seed-{seed}"


def _merge_model(*specs: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for s in specs:
        out.update({k: (dict(v) if isinstance(v, dict) else v) for k, v in s.items()})
    return out


def _hash(spec: Mapping[str, Any]) -> str:
    return config_hash(spec)


def _splits(suite: Suite, ds: Any, data_dir: str | None) -> tuple[int, ...]:
    if ds.splits != "all":
        return tuple(ds.splits)
    n = SOURCES[ds.source].num_splits(ds.options, data_dir)  # type: ignore[misc]
    return tuple(range(n))


def expand(suite: Suite, data_dir: str | None = None) -> list[Cell]:
    """All cells of ``suite``, in run order (dataset, split, method, seed).

    Parameters
    ----------
    suite : Suite
        A validated suite.
    data_dir : str, optional
        Datasets root, needed to count the splits of ``splits = "all"``.

    Returns
    -------
    list of Cell
    """
    cells = []
    ref_seed = suite.seeds[0]
    rep_seed = ref_seed + REPLICATE_SEED_OFFSET
    for ds in suite.datasets:
        if ds.reference_replicates > 1 and rep_seed in suite.seeds:
            raise ConfigError(f"invalid suite {suite.path}: seed {rep_seed} is the reference replicate's "
                              f"(the first seed + {REPLICATE_SEED_OFFSET}); remove it from [suite] seeds")
        for split in _splits(suite, ds, data_dir):
            ref_id = cell_id(ds.label, ds.reference, split, ref_seed) if ds.reference else None
            rep_id = cell_id(ds.label, ds.reference, split, rep_seed) if ds.reference_replicates > 1 else None
            for label in ds.methods:
                entry = suite.method(label)
                meth = get_method(entry.method)
                override = dict(ds.overrides.get(label, {}))
                model = _merge_model(suite.model, ds.model, entry.model, override.pop("model", {}))
                options = {**meth.options, **entry.options, **override}
                seeds = [*suite.seeds, rep_seed] if rep_id is not None and label == ds.reference else suite.seeds
                for seed in seeds:
                    spec = {
                        "suite": suite.name,
                        "dataset": {"label": ds.label, "source": ds.source, "options": dict(ds.options)},
                        "split": split,
                        "model": model,
                        "method": {"label": label, "name": entry.method, "options": options},
                        "seed": seed,
                        "num_eval_samples": suite.num_eval_samples,
                        "inference_data": suite.inference_data,
                        "fit_diagnostics": suite.fit_diagnostics,
                        "gradient_variance": suite.gradient_variance if entry.gradient_variance else None,
                        "published": list(entry.published),
                    }
                    cid = cell_id(ds.label, label, split, seed)
                    is_ref, is_rep = cid == ref_id, cid == rep_id
                    spec["reference"] = None if (ref_id is None or is_ref or is_rep) else ref_id
                    # keys only a suite with replicates has: other suites' hashes stay as they were
                    if is_rep:
                        spec["replicate_of"] = ref_id
                    elif spec["reference"] is not None and rep_id is not None:
                        spec["reference_replicate"] = rep_id
                    cells.append(
                        Cell(cid, ds.label, label, split, seed, spec, _hash(spec), is_ref, spec["reference"],
                             dict(entry.resources), is_rep, spec.get("reference_replicate"))
                    )
    folded: dict[str, str] = {}
    for c in cells:  # guaranteed by the label grammar; checked because a clash would lose results
        other = folded.setdefault(c.id.casefold(), c.id)
        if other is not c.id:
            raise ConfigError(f"invalid suite {suite.path}: cells {other!r} and {c.id!r} would share a results folder")
    return cells


def parse_only(text: str | None) -> dict[str, set[str]]:
    """Parse ``--only key=val,key=val``: values of one key are OR-ed, keys are AND-ed.

    Raises
    ------
    ValueError
        For an entry without ``=``, an unknown key (listing :data:`FILTER_KEYS`), or a text with
        no entry at all (``","``): an empty filter is not "everything".
    """
    only: dict[str, set[str]] = {}
    if text is None:
        return only
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not value:
            raise ValueError(f"--only: expected key=value, got {part!r}")
        if key not in FILTER_KEYS:
            raise ValueError(f"--only: unknown key {key!r}; valid keys: {list(FILTER_KEYS)}")
        only.setdefault(key, set()).add(value)
    if not only:
        raise ValueError(f"--only: no key=value entries in {text[:80]!r}; valid keys: {list(FILTER_KEYS)}")
    return only


def select(cells: list[Cell], only: Mapping[str, Iterable[str]]) -> list[Cell]:
    """Cells matching ``only`` plus the reference cells they depend on.

    Raises
    ------
    ValueError
        If a value matches no cell (listing the valid values of that key).
    """
    if not only:
        return list(cells)
    for key, values in only.items():
        valid = sorted({str(getattr(c, key)) for c in cells})
        bad = sorted(set(values) - set(valid))
        if bad:
            raise ValueError(f"--only: no cell has {key}={bad[0]!r}; valid values of {key}: {valid}")
    chosen = [c for c in cells if all(str(getattr(c, k)) in set(v) for k, v in only.items())]
    needed = {c.reference for c in chosen if c.reference} | {c.replicate for c in chosen if c.replicate}
    keep = {c.id for c in chosen} | needed
    return [c for c in cells if c.id in keep]


def build_model(model_spec: Mapping[str, Any], data: Any) -> BayesianMLP:
    r"""Build the :class:`~pyrobdl.BayesianMLP` of a cell for its data.

    ``in_features`` comes from the data, ``out_features`` is 1 for regression and the number of
    classes for classification.  Without a ``likelihood`` in the spec the data's task chooses
    it: a categorical likelihood for classification data (a CSV's ``task``, a built-in
    classification dataset such as MNIST), the model's default Gaussian for regression.  A likelihood ``precision`` with ``precision_units =
    "original"`` is on the original target scale and is converted to the standardised scale
    the model is trained on: :math:`\tau_{std} = \tau\,\sigma_y^2`.

    Raises
    ------
    ValueError
        If the model does not fit the data (e.g. a regression likelihood on class labels); the
        message names the model key.
    """
    comps = model_components()
    kwargs: dict[str, Any] = {}
    for part in ("prior", "likelihood"):
        if part in model_spec:
            table = dict(model_spec[part])
            cls = comps[part][table.pop("kind")]
            units = table.pop("precision_units", "standardized")
            if units == "original":
                if not hasattr(data, "y_std"):
                    raise ValueError("model.likelihood.precision_units = 'original' needs regression data")
                table["precision"] = float(table["precision"]) * float(data.y_std) ** 2
            try:
                kwargs[part] = cls(**table)
            except (TypeError, ValueError) as e:
                raise ValueError(f"model.{part}: {e}") from e
    classification = hasattr(data, "num_classes")
    if "likelihood" not in kwargs and classification:  # the data's task chooses when the suite does not
        kwargs["likelihood"] = comps["likelihood"]["categorical"]()
    likelihood = kwargs.get("likelihood")
    task = likelihood.task if likelihood is not None else "regression"
    if classification != (task == "classification"):
        kind = model_spec["likelihood"]["kind"]
        if classification:
            raise ValueError(f"model.likelihood: {kind!r} is a regression likelihood but the data are class labels "
                             f"({data.num_classes} classes); add model = {{ likelihood = {{ kind = \"categorical\" }} }} to "
                             "the dataset's table, or leave the likelihood out and the data's task chooses it")
        raise ValueError(f"model.likelihood: {kind!r} is a classification likelihood but the data are regression "
                         "targets; for class labels set task = \"classification\" in the dataset's table "
                         "(source = \"file\"), else use a regression likelihood such as { kind = \"gaussian\" }")
    x = data.x_train
    in_features = int(x[0].numel())
    out = int(data.num_classes) if classification else 1
    return BayesianMLP(
        in_features,
        tuple(model_spec.get("hidden", (50,))),
        out,
        activation=model_spec.get("activation", "relu"),
        **kwargs,
    )


def check_plan(suite: Suite, cells: list[Cell], data_dir: str | None) -> None:
    """Everything that can be checked without fitting: data load, model build, ``check_model``.

    Loads the first split of each dataset used by ``cells`` once, builds every (dataset,
    method) model and runs the method's own ``check_model`` (e.g. MCMC refuses improper priors).

    Raises
    ------
    ConfigError
        Listing every problem, each naming the dataset and method.
    """
    problems: list[str] = []
    per_method: dict[tuple[str, str], list[str]] = {}
    seen: set[tuple[str, str]] = set()
    loaded: dict[str, Any] = {}
    base = suite.path.parent
    for c in cells:
        if (c.dataset, c.method) in seen:
            continue
        seen.add((c.dataset, c.method))
        ds = c.spec["dataset"]
        if c.dataset not in loaded:
            try:
                loaded[c.dataset] = load_dataset(ds["source"], ds["options"], c.split, data_dir, base)
            except (OSError, ValueError, TypeError) as e:
                loaded[c.dataset] = None
                problems.append(f"datasets.{c.dataset}: cannot load split {c.split}: {e}")
        data = loaded[c.dataset]
        if data is None:
            continue
        if c.spec["method"]["options"].get("checkpoint") is not None:
            problems.append(f"methods.{c.method}.checkpoint: a suite keeps each cell's checkpoint itself "
                            "(OUT/checkpoints/<cell>.pt, for cells run in the driver's process); remove the option")
        if c.spec["method"]["options"].get("certify_inputs") is not None:
            problems.append(f"methods.{c.method}.certify_inputs: a suite certifies each posterior itself, at "
                            "diagnostic_points test inputs spread over the test split; remove the option")
        try:
            model = build_model(c.spec["model"], data)
            meth = get_method(c.spec["method"]["name"])
            _check_sizes(c, model, data, meth.options)
            if meth.check_model is not None:
                meth.check_model(model, c.spec["method"]["options"])
        except (TypeError, ValueError) as e:
            per_method.setdefault((c.dataset, str(e)), []).append(c.method)
    # one line per problem: the same model problem with every method is named once
    problems += [f"datasets.{d} x methods.{', '.join(dict.fromkeys(ms))}: {e}" for (d, e), ms in per_method.items()]
    if problems:
        raise ConfigError("\n".join([f"invalid suite {suite.path} ({len(problems)} problem(s)):",
                                     *[f"{suite.path}: {p}" for p in problems]]))


def matches(cell: Cell, only: Mapping[str, Iterable[str]]) -> bool:
    """Whether ``cell`` matches an ``--only`` filter itself (not as a reference it pulled in)."""
    return all(str(getattr(cell, k)) in set(v) for k, v in only.items())


def _check_sizes(c: Cell, model: Any, data: Any, defaults: Any) -> None:
    """Sizes no machine here can hold, refused before work naming the option (issue 42): the
    network, the method's step/sample counts, and ``num_eval_samples`` draws of the test split."""
    from .._validation import check_counts, check_fit_sizes, check_memory, check_option_values

    options = {**defaults, **c.spec["method"]["options"]}
    check_option_values(c.spec["method"]["name"], defaults, c.spec["method"]["options"])
    check_counts(c.spec["method"]["name"], defaults, c.spec["method"]["options"])
    check_fit_sizes(model, options)
    s = int(c.spec["num_eval_samples"])
    params = sum((a + 1) * b for a, b in zip([model.in_features, *model.hidden], [*model.hidden, model.out_features]))
    rows = int(data.x_test.shape[0]) if getattr(data, "x_test", None) is not None else 0
    check_memory("suite.num_eval_samples", s, 4.0 * s * (params + rows * model.out_features))


def describe(cells: list[Cell], only: Mapping[str, Iterable[str]] | None = None) -> str:
    """One-line summary of a grid: counts of datasets, methods, splits, seeds and cells; with an
    ``--only`` filter, how many cells it matched and how many reference cells it added (and why)."""
    n = {k: len({getattr(c, k) for c in cells if not c.is_replicate}) for k in FILTER_KEYS}
    line = (f"{len(cells)} cells: {n['dataset']} dataset(s) x {n['method']} method(s) x "
            f"{n['split']} split(s) x {n['seed']} seed(s) ({sum(c.is_reference for c in cells)} reference"
            + (f", {reps} reference replicate" if (reps := sum(c.is_replicate for c in cells)) else "") + ")")
    if only:
        added = [c for c in cells if not matches(c, only)]
        line += f"; --only matched {len(cells) - len(added)}"
        if added:
            names = sorted({c.method for c in added})
            line += (f" and added {len(added)} reference cell(s) ({', '.join(names)}) because the matched cells are "
                     "scored against them; they run first unless already done")
    return line

