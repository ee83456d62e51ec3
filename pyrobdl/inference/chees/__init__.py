"""Many-chain HMC with ChEES adaptation (method "chees"); the code is in :mod:`.run`."""

from .run import (  # noqa: F401  (public names, and the private ones tests and probes use)
    _NOT_IDENTITY,
    CERTIFY_RHATS,
    CHEES_OPTIONS,
    INIT_STRATEGIES,
    JITTERS,
    MASS_MATRICES,
    WindowVariance,
    _compile,
    _map_init,
    _ReplicaTracker,
    _Sampler,
    _swap,
    _Tempered,
    chees_gradient,
    halton,
    respace_ladder,
    run_chees,
    warmup_windows,
)
