"""A fused call under torch.compile: the plan found at trace time (not traced), refreshed and
error-raising calls run outside the graph."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ._errors import (
    FuncteError,
)
from ._fuse_keys import _constant_key, _rebuild

if TYPE_CHECKING:
    from ._fuse import Fused
    from ._plan import Plan

Tensor = torch.Tensor


def _compiled_plan(fused: Fused, index: int) -> Plan:
    # (by attribute, not self._plans[index]: Dynamo guards a list subscript on the list's length,
    # so each new signature's plan recompiled every graph compiled before it)
    return getattr(fused, f"_plan{index}")


@torch._dynamo.assume_constant_result
def _find_mode_modules(fused: Fused) -> int:
    """Run by Dynamo at trace time (not traced): :meth:`Fused._training_flags`'s module list."""
    fused._training_flags()
    return 0


def _refresh(fused: Fused, key: Any) -> None:
    """Retrace ``fused``'s plan for ``key`` if it went stale (run eagerly: a graph break)."""
    args, kwargs = _rebuild(key)
    fused._lookup(args, kwargs)


_refresh_outside_graph = torch.compiler.disable(
    _refresh,
    reason=(
        "functe.fuse: the plan folded computations on captured tensors (w.to(torch.bfloat16), 2 * w) "
        "whose in-place updates are checked outside the graph; for fullgraph=True pass those tensors "
        "to the fused function as arguments"
    ),
)


@torch._dynamo.assume_constant_result
def _compiled_plan_index(fused: Fused, key: Any, backend: str, training: tuple) -> tuple[int, tuple[int, ...] | str]:
    """Run by Dynamo at trace time (not traced): find or build the plan.

    Returns the plan's index and the order of the tensors of the
    :func:`_constant_key` walk in the plan's (optree) flattening order; ``backend`` (the one in force,
    which the lookup keys plans by) and ``training`` (the reached modules' flags, keyed too) are arguments
    so that Dynamo guards them: a switch, ``model.eval()``, recompiles. Only
    ints come back into the graph; the plan itself is then read from ``fused``
    so that Dynamo has a real source to guard on. A functe error the trace raises comes back as
    ``(-1, its message)`` (see ``Fused.__call__``); ``training`` ends with ``fused._failed_traces``,
    guarded like the flags (an int argument of its own, Dynamo made symbolic on a recompile).
    """
    args, kwargs = _rebuild(key)
    walked: list[Tensor] = []
    _constant_key((args, kwargs), walked)
    try:
        index, _, tensors = fused._lookup(args, kwargs)
    except FuncteError as error:
        return -1, str(error)  # (the caller runs the call outside the graph, which raises it: see there)
    position = {id(t): i for i, t in enumerate(walked)}
    return index, tuple(position[id(t)] for t in tensors)


@torch._dynamo.assume_constant_result
def _constant_outputs(fused: Fused, index: int, requires_grad: tuple[bool, ...]) -> tuple[int, ...]:
    """Run by Dynamo at trace time (not traced): :meth:`Plan.constant_outputs` (Dynamo guards the
    inputs' requires_grad, so a change recompiles)."""
    return _compiled_plan(fused, index).constant_outputs(requires_grad)


@torch.compiler.disable
def _call_outside_graph(fused: Fused, args: tuple, kwargs: dict) -> Any:
    """``fused(*args, **kwargs)`` run eagerly: for a compiled call whose trace raised (see
    ``Fused.__call__``); when it runs, the compiled caller recompiles at its next call."""
    out = fused(*args, **kwargs)
    fused._failed_traces += 1
    return out
