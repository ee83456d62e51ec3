"""One ``torch.compile`` code object per kind of flat log joint (Dynamo's recompilation limit)."""

from __future__ import annotations

import types


_COMPILED_CODES: dict[tuple, types.CodeType] = {}


def _compiled_entry(fn: types.FunctionType, key: tuple) -> types.FunctionType:
    """``fn`` with a code object shared only by log joints of the same ``key`` (shapes, model).

    Dynamo keeps its compiled graphs, and its limit of 8 recompilations, per code object: every
    :meth:`FlatLogJoint.compile` passes the same lambda, so a process that compiled log joints of
    more than 8 shapes (a suite over many datasets, one worker) ran the 9th and later eagerly
    while reporting them compiled.  Log joints of the same key still share one compiled graph
    (the data are graph inputs, so another split of a dataset compiles nothing).
    """
    code = _COMPILED_CODES.get(key)
    if code is None:
        code = fn.__code__.replace(co_name=f"flat_log_joint_{len(_COMPILED_CODES)}")
        _COMPILED_CODES[key] = code
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
