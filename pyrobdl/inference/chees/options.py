"""The options of method "chees": their defaults, the values they may take, which of them make a
checkpoint's identity, and their validation before any work (``fit``'s ``check_model``)."""

from __future__ import annotations

import math
import numbers
import os
from typing import Any, Mapping

from ...diagnostics.certification import check_certify_inputs
from ...flat import _check_supported
from ..starts import check_spread
from ..registry import require_proper_prior
from .adaptation import MASS_MATRICES, QUARTER_PERIOD_ADAPTATIONS, STEP_SIZE_ADAPTATIONS, TRAJECTORY_ADAPTATIONS

#: Starting points of the chains.
INIT_STRATEGIES = ("prior", "map", "ensemble")
#: How each iteration's trajectory length is jittered.
JITTERS = ("halton", "uniform", "none")
#: Which R-hat certifies the chains ("auto": nested over superchain starts, else split).
CERTIFY_RHATS = ("auto", "split", "nested", "both")
__all__ = ["CERTIFY_RHATS", "CHEES_OPTIONS", "INIT_STRATEGIES", "JITTERS", "MASS_MATRICES", "STEP_SIZE_ADAPTATIONS",
           "TRAJECTORY_ADAPTATIONS"]

CHEES_OPTIONS: dict[str, Any] = {
    "num_chains": 64,
    "num_warmup": 500,
    "num_samples": 200,
    "target_accept_prob": 0.651,
    "step_size": None,
    "init_trajectory_length": 1.0,
    "trajectory_lr": 0.05,
    "step_size_adaptation": "windowed",
    "trajectory_adaptation": "free",
    "warmup_trajectory_scale": 1.0,
    "adapt_mass_matrix": True,
    "mass_matrix": "cross-chain",
    "max_num_steps": 1024,
    "jitter": "halton",
    "init_strategy": "prior",
    "superchain_size": 1,
    "map_num_steps": 500,
    "map_lr": 1e-2,
    "divergence_threshold": 1000.0,
    "restart_after_divergences": 10,
    "chunk_size": "auto",
    "compile": "auto",
    "diagnostic_points": 50,
    "certify_inputs": None,
    "max_num_samples": None,
    "extend_by": 100,
    "certify_rhat": "auto",
    "temperatures": None,
    "adapt_temperatures": False,
    "checkpoint": None,
    "checkpoint_every_s": 300.0,
}

#: Options added after checkpoints were first written, with the value that behaves as before them:
#: at that value they are left out of a checkpoint's identity, so older checkpoints resume.  It is
#: the default except for ``restart_after_divergences`` (on by default, 0 before): an older
#: checkpoint resumes with ``restart_after_divergences=0`` and is refused, by name, without it.
_LATER_OPTIONS = {"step_size_adaptation": "windowed", "trajectory_adaptation": "free", "warmup_trajectory_scale": 1.0,
                  "restart_after_divergences": 0}

#: Options that do not change the chains (where and how often they are saved, the kernel, the
#: thread count, the points the result is diagnosed and certified at) or that a resumed run
#: reconciles itself (``num_samples`` may grow: the run is extended; so may the extension's
#: bounds), so a checkpoint's identity leaves them out.
_NOT_IDENTITY = ("checkpoint", "checkpoint_every_s", "compile", "chunk_size", "threads", "device", "num_samples",
                 "diagnostic_points", "certify_inputs", "max_num_samples", "extend_by", "certify_rhat")


# ----------------------------------------------------------------------------------- options
def _int(options: Mapping[str, Any], name: str, low: int) -> None:
    v = options[name]
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")


def _positive(options: Mapping[str, Any], name: str, allow_none: bool = False) -> None:
    v = options[name]
    if v is None and allow_none:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be a finite number > 0{' or None' if allow_none else ''}, got {v!r}")


def _check_options(model: Any, options: Mapping[str, Any]) -> None:
    require_proper_prior(model, options)
    _check_counts(options)
    check_certify_inputs(model, options)
    _check_certify_rhat(options)
    _check_numbers(options)
    _check_choices(options)
    _check_checkpoint(options)
    _check_temperatures(options)
    if options.get("init") is not None:  # fit(..., init=network): starts at its weights + init_spread * N(0, 1)
        check_spread(options["init_spread"], allow_none=False)
    # the flat log joint refuses what it does not implement, by name, before any work
    _check_supported(model)


def _check_counts(options: Mapping[str, Any]) -> None:
    """Chains, superchains, iterations and the other whole-number options."""
    _int(options, "num_chains", 2)
    _int(options, "num_warmup", 0)
    _int(options, "superchain_size", 1)
    k, m = options["num_chains"], options["superchain_size"]
    if m > 1 and (k % m or k // m < 2):
        raise ValueError(
            f"superchain_size={m} must divide num_chains={k} into at least 2 superchains "
            f"(num_chains a multiple of superchain_size, num_chains >= 2 * superchain_size)"
        )
    _int(options, "restart_after_divergences", 0)
    for name in ("num_samples", "max_num_steps", "map_num_steps", "diagnostic_points", "extend_by"):
        _int(options, name, 1)
    if options["max_num_samples"] is not None:
        _int(options, "max_num_samples", 1)
        if options["max_num_samples"] < options["num_samples"]:
            raise ValueError(f"max_num_samples={options['max_num_samples']} must be >= num_samples="
                             f"{options['num_samples']} (the draws per chain before the first certification), "
                             "or None: no extension")
    if options["chunk_size"] not in (None, "auto"):
        _int(options, "chunk_size", 1)


def _check_certify_rhat(options: Mapping[str, Any]) -> None:
    if options["certify_rhat"] not in CERTIFY_RHATS:
        raise ValueError(f"unknown certify_rhat {options['certify_rhat']!r}; valid: {list(CERTIFY_RHATS)}")
    if options["certify_rhat"] in ("nested", "both") and options["superchain_size"] == 1:
        raise ValueError(
            f"certify_rhat={options['certify_rhat']!r} needs chains started in superchains (superchain_size > 1): "
            "nested R-hat over independently started chains cannot see chains that never left their start")


def _check_numbers(options: Mapping[str, Any]) -> None:
    """The real-valued options and the flags."""
    for name in ("init_trajectory_length", "trajectory_lr", "map_lr", "divergence_threshold"):
        _positive(options, name)
    _positive(options, "step_size", allow_none=True)
    p = options["target_accept_prob"]
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p < 1:
        raise ValueError(f"target_accept_prob must be in (0, 1), got {p!r}")
    w = options["warmup_trajectory_scale"]
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 < w <= 1:
        raise ValueError(f"warmup_trajectory_scale must be in (0, 1], got {w!r}")
    for name in ("adapt_mass_matrix", "adapt_temperatures"):
        if not isinstance(options[name], bool):
            raise TypeError(f"{name} must be True or False, got {options[name]!r}")
    if not (isinstance(options["compile"], bool) or options["compile"] == "auto"):
        raise TypeError(f"compile must be True, False or 'auto', got {options['compile']!r}")


def _check_choices(options: Mapping[str, Any]) -> None:
    """The options that name one of a fixed set, and the one combination of them refused."""
    for name, valid in (("jitter", JITTERS), ("step_size_adaptation", STEP_SIZE_ADAPTATIONS),
                        ("trajectory_adaptation", TRAJECTORY_ADAPTATIONS), ("mass_matrix", MASS_MATRICES),
                        ("init_strategy", INIT_STRATEGIES)):
        if options[name] not in valid:
            raise ValueError(f"unknown {name} {options[name]!r}; valid: {list(valid)}")
    if options["trajectory_adaptation"] in QUARTER_PERIOD_ADAPTATIONS and (
            options["mass_matrix"] == "per-chain" or options["temperatures"] is not None):
        raise ValueError(f"trajectory_adaptation={options['trajectory_adaptation']!r} needs one metric for every "
                         "chain: mass_matrix 'cross-chain' or 'within-chain' and no temperatures")


def _check_checkpoint(options: Mapping[str, Any]) -> None:
    ckpt = options["checkpoint"]
    if ckpt is not None and not isinstance(ckpt, (str, os.PathLike)):
        raise TypeError(f"checkpoint must be None or a file path, got {ckpt!r}")
    if ckpt is not None and os.path.isdir(ckpt):
        raise ValueError(f"checkpoint {ckpt!r} is a folder; give a file path (e.g. {os.path.join(ckpt, 'chees.pt')!r})")
    every = options["checkpoint_every_s"]
    if isinstance(every, bool) or not isinstance(every, (int, float)) or not math.isfinite(every) or every < 0:
        raise ValueError(f"checkpoint_every_s must be a finite number >= 0, got {every!r}")


def _check_temperatures(options: Mapping[str, Any]) -> None:
    """``temperatures``: None, or inverse temperatures 1 = beta_0 > beta_1 > ... > 0 whose number
    divides ``num_chains`` into rungs of at least 2 chains."""
    t = options["temperatures"]
    if t is None:
        if options["adapt_temperatures"]:
            raise ValueError("adapt_temperatures=True needs temperatures (the initial ladder whose inner inverse "
                             "temperatures it moves)")
        return
    if isinstance(t, (str, bytes)) or not hasattr(t, "__len__"):
        raise TypeError(f"temperatures must be None or a sequence of inverse temperatures, got {t!r}")
    betas = list(t)
    if any(isinstance(b, bool) or not isinstance(b, numbers.Real) or not math.isfinite(b) for b in betas):
        raise TypeError(f"temperatures must hold finite numbers, got {betas!r}")
    if len(betas) < 2:
        raise ValueError(f"temperatures needs at least 2 inverse temperatures (1 first), got {betas!r}")
    if betas[0] != 1:
        raise ValueError(f"temperatures[0] must be 1 (the posterior's rung), got {betas[0]!r}")
    if any(not a > b for a, b in zip(betas, betas[1:])) or betas[-1] <= 0:
        raise ValueError(f"temperatures must decrease strictly from 1 and stay > 0, got {betas!r}")
    k, r = options["num_chains"], len(betas)
    if k % r or k // r < 2:
        raise ValueError(f"num_chains={k} must be a multiple of len(temperatures)={r} with at least 2 chains "
                         "per temperature")
    if options["superchain_size"] > 1:
        raise ValueError("temperatures and superchain_size > 1 cannot be combined (the rungs' chains swap states "
                         "between superchains)")


