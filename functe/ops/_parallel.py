"""Collective ops: all-gather, reduce-scatter and all-reduce with TransformerEngine's backward rules.

Each is a :func:`functe.custom_vjp` op over :func:`functe._collectives.collective` (the
functional collectives of ``torch.distributed``, waited for, with a real ``vmap`` rule and a
cross-rank shape check), so it composes with ``torch.func``, ``functe.trace`` / ``functe.fuse``
and ``torch.compile``. A group of one rank (or no initialised process group) makes every op the
identity, as in TE.

The backward rules follow TE's AllGather / ReduceScatter / AllReduce ops, whose convention is
SPMD: every rank runs the same program on its own data, and a gradient is what flows back into
this rank's input.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from .._backend import result_view
from .._collectives import Group, collective, meet_before_raising, resolve_group
from .._errors import ArgumentError, FuncteError, as_int, check_flag, check_tensor, shape_error, shown_number
from .._vjp import custom_vjp

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

Tensor = torch.Tensor


@contextlib.contextmanager
def _raising_together(x: object, group: Group) -> Iterator[None]:
    """Local argument checks whose failure may be this rank's alone (its x has another rank or
    dtype): the failing rank first joins the other ranks' cross-rank check, saying it raises, so
    they raise too instead of waiting there until the group's timeout."""
    try:
        yield
    except FuncteError:
        if isinstance(x, Tensor):
            meet_before_raising(x, group)
        raise


def _dim(op: str, x: Tensor, dim: object) -> int:
    index = as_int(dim)
    if index is None:
        raise ArgumentError(f"functe.{op}: argument 'dim' expected an int, got {shown_number(dim)}")
    if not -x.dim() <= index < x.dim():
        raise shape_error(op, "x", f"a tensor with a dimension {dim!r}", x, "the dimension to gather or scatter along")
    return index % x.dim()


# ----------------------------------------------------------------------------- all_gather


def _all_gather_fwd(x, *, group, dim):
    return collective("all_gather", x, group, dim=dim, who="all_gather"), None


def _all_gather_bwd(_, dy, *, group, dim):
    return (collective("reduce_scatter", dy, group, dim=dim, who="all_gather (backward: reduce-scatter)"),)


_all_gather = custom_vjp("all_gather", _all_gather_fwd, _all_gather_bwd)


def all_gather(x: Tensor, *, group: ProcessGroup | None = None, dim: int = 0) -> Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order); backward: reduce-scatter of ``dy``.

    Every rank must pass the same shape and dtype (checked: a clear error on every rank instead of
    a hang, see :func:`functe.set_collective_checks`). One rank: the identity.

    Args:
        x: any tensor of rank >= 1 (fp8 data is gathered as bytes).
        group: the ``ProcessGroup`` (default: the default group).
        dim: the dimension to concatenate along (TE: 0, the sequence dimension).

    Example:
        >>> import torch
        >>> from functe import ops
        >>> ops.all_gather(torch.ones(2, 3)).shape  # a single process: the identity
        torch.Size([2, 3])
    """
    g = resolve_group("all_gather", group)
    with _raising_together(x, g):
        check_tensor("all_gather", "x", x, dtypes=None)
        dim = _dim("all_gather", x, dim)
    if g.size == 1:
        return result_view(x)  # (the identity, as a view: see there)
    return _all_gather(x, group=g, dim=dim)


# ----------------------------------------------------------------------------- reduce_scatter


def _reduce_scatter_fwd(x, *, group, dim):
    return collective("reduce_scatter", x, group, dim=dim, who="reduce_scatter"), None


def _reduce_scatter_bwd(_, dy, *, group, dim):
    return (collective("all_gather", dy, group, dim=dim, who="reduce_scatter (backward: all-gather)"),)


_reduce_scatter = custom_vjp("reduce_scatter", _reduce_scatter_fwd, _reduce_scatter_bwd)


def reduce_scatter(x: Tensor, *, group: ProcessGroup | None = None, dim: int = 0) -> Tensor:
    """Sum ``x`` over ranks and keep this rank's slice along ``dim``; backward: all-gather of ``dy``.

    ``x.shape[dim]`` must be divisible by the group size (checked on every rank together, after
    the cross-rank shape check). One rank: the identity.

    Example:
        >>> import torch
        >>> from functe import ops
        >>> ops.reduce_scatter(torch.ones(4, 2)).shape
        torch.Size([4, 2])
    """
    g = resolve_group("reduce_scatter", group)
    with _raising_together(x, g):
        check_tensor("reduce_scatter", "x", x)
        dim = _dim("reduce_scatter", x, dim)  # (divisibility is checked after the cross-rank check)
    if g.size == 1:
        return result_view(x)  # (the identity, as a view: see there)
    return _reduce_scatter(x, group=g, dim=dim)


# ----------------------------------------------------------------------------- all_reduce


def _all_reduce_fwd(x, *, group, reduce_in_backward):
    return collective("all_reduce", x, group, who="all_reduce"), None


def _all_reduce_bwd(_, dy, *, group, reduce_in_backward):
    if not reduce_in_backward:  # (share: the identity, whose own adjoint sums over ranks)
        return (collective("share", dy, group, who="all_reduce (backward)"),)
    return (collective("all_reduce", dy, group, who="all_reduce (backward)"),)


_all_reduce = custom_vjp("all_reduce", _all_reduce_fwd, _all_reduce_bwd)


def all_reduce(x: Tensor, *, group: ProcessGroup | None = None, reduce_in_backward: bool = False) -> Tensor:
    """Sum ``x`` over ranks; backward: ``dy`` (default) or the sum of ``dy`` over ranks.

    The default backward is TE's AllReduce: the output feeds computations that every rank repeats
    identically (a replicated loss), so the gradient is already the same everywhere and passes
    through. ``reduce_in_backward=True`` sums the output gradients instead, the exact adjoint when
    each rank's output feeds a *different* computation whose losses add up. (TE's AllReduce takes
    a ``reduce_in_backward`` flag too but ignores it: its backward is always the identity.)

    Example:
        >>> import torch
        >>> from functe import ops
        >>> ops.all_reduce(torch.tensor([1.0, 2.0])).tolist()
        [1.0, 2.0]
    """
    g = resolve_group("all_reduce", group)
    with _raising_together(x, g):
        check_tensor("all_reduce", "x", x)
        reduce_in_backward = check_flag("all_reduce", "reduce_in_backward", reduce_in_backward)
    if g.size == 1:
        return result_view(x)  # (the identity, as a view: see there)
    return _all_reduce(x, group=g, reduce_in_backward=reduce_in_backward)
