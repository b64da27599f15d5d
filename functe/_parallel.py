"""Tensor and sequence parallelism of a linear: the static configuration and the communication steps.

A parallel linear is ``ops.linear`` / ``ops.fp8_linear`` with ``tensor_parallel_mode`` set. The
public functions canonicalise their keyword arguments into one static :class:`LinearParallelism`
value, passed to the op as ``parallel=`` (so op lists, ``functe.explain`` and the fusion rules see
it); the op's forward and backward rules call the four steps below around their GEMMs.
TransformerEngine's BasicLinear semantics (reference section 1), with ``P`` the group size:

========== ============================== ================================ =================================
mode        weight (local)                 forward                          backward
========== ============================== ================================ =================================
column      ``[out/P, in]``, bias          SP: all-gather x along dim 0     all-reduce dx (SP: reduce-scatter)
            ``[out/P]``                    (x ``[s/P, ..., in]``)
row         ``[out, in/P]``, bias          all-reduce y (SP: reduce-scatter SP: all-gather dy along dim 0
            ``[out]`` (replicated)         along dim 0), then add the bias
========== ============================== ================================ =================================

**Row-parallel bias.** TE gives each rank its own full-size bias and adds it *before* the
all-reduce, so the effective bias is the sum over ranks. functe adds the bias once, *after* the
reduction: the bias is an ordinary replicated parameter with the single-process meaning (a
checkpoint loads into a model with any tensor-parallel size), its gradient is the full
``sum(dy)`` on every rank (under SP computed from the all-gathered ``dy``, which the dgrad needs
anyway), and no rank-dependent arithmetic is needed. A TE row-parallel checkpoint converts by
summing its ranks' biases.

**FP8.** The scaling states of a parallel ``fp8_linear`` stay identical across ranks: under
delayed scaling the amaxes of x, W and dy are MAX-reduced over ``amax_group`` (the
tensor-parallel group by default; TE's ``reduce_amax``) before the state update. Under current
scaling an all-gathered input (column + SP) is quantized shard by shard with the scale of the
MAX-reduced amax and gathered as FP8 data (TE's quantized all-gather), which equals quantizing
the gathered tensor. A row + SP ``dy`` is gathered in high precision before its cast (as TE's
Linear does: its ReduceScatter's backward gathers ``dy`` before BasicLinear quantizes it).
"""

from __future__ import annotations

import dataclasses

import torch

from ._collectives import SINGLE, Group, collective, meet_before_raising, resolve_group
from ._errors import ArgumentError, ShapeError, check_flag, describe
from ._fp8_state import recipe_scale
from ._quantize import cast
from ._recipe import DelayedScaling, Recipe
from .kernels.elementwise import ADD_BIAS
from .kernels.quantize import CAST_AMAX

Tensor = torch.Tensor

MODES = (None, "column", "row")


@dataclasses.dataclass(frozen=True)
class LinearParallelism:
    """How a linear is split across ranks: the static ``parallel`` parameter of ``linear`` / ``fp8_linear``.

    Built by the ops from their keyword arguments (``tensor_parallel_mode``,
    ``sequence_parallel``, ``group``, and ``amax_group`` for FP8); printed in op lists as
    ``column@0/2`` (mode, ``+sp`` with sequence parallelism, group name / size) and
    ``amax@0/2``. A linear on one rank has none (``parallel`` is absent from its equation).

    Fields:
        mode: ``None``, ``"column"`` or ``"row"``.
        sequence_parallel: activations outside the linear are split along dim 0.
        group: the tensor-parallel group (size 1 when ``mode`` is ``None``).
        amax_group: FP8 only: the group over which amaxes are MAX-reduced (size 1: none).

    Example:
        >>> from functe._collectives import Group
        >>> LinearParallelism("row", True, Group("0", 2), Group("0", 2))
        row+sp@0/2 amax@0/2
    """

    mode: str | None
    sequence_parallel: bool
    group: Group
    amax_group: Group = SINGLE

    def __repr__(self):
        parts = []
        if self.mode is not None:
            parts.append(f"{self.mode}{'+sp' if self.sequence_parallel else ''}@{self.group.name}/{self.group.size}")
        if self.amax_group.size > 1:
            parts.append(f"amax@{self.amax_group.name}/{self.amax_group.size}")
        return " ".join(parts)

    @property
    def gathers_input(self) -> bool:
        return self.mode == "column" and self.sequence_parallel

    @property
    def gathers_grad_output(self) -> bool:
        return self.mode == "row" and self.sequence_parallel


def linear_parallelism(
    op: str,
    x: Tensor,
    mode: object,
    sequence_parallel: object,
    group: object,
    amax_group: object = None,
    *,
    fp8: bool = False,
    unsupported_recipe: str | None = None,
) -> LinearParallelism | None:
    """Validate and canonicalise a linear's parallel keyword arguments (``None``: nothing to do).

    As TE, a group of one rank turns tensor parallelism off. ``amax_group=None`` means the
    tensor-parallel group (FP8 only). ``unsupported_recipe`` names a recipe without tensor
    parallelism: refused before any rank can fail a local check and wait for the others.
    """
    if mode not in MODES:
        raise ArgumentError(
            f"functe.{op}: argument 'tensor_parallel_mode' expected None, 'column' or 'row', got {mode!r}"
        )
    sequence_parallel = check_flag(op, "sequence_parallel", sequence_parallel)
    if mode is None and (sequence_parallel or group is not None):
        raise ArgumentError(
            f"functe.{op}: 'sequence_parallel' and 'group' apply to a tensor-parallel linear; "
            "set tensor_parallel_mode='column' or 'row'"
        )
    tp = resolve_group(op, group) if mode is not None else SINGLE
    amax = resolve_group(op, amax_group, "amax_group") if amax_group is not None else tp
    if tp.size == 1:
        mode, sequence_parallel = None, False
    if mode is not None and unsupported_recipe is not None:
        # (every rank raises this one together: it depends on the arguments, not on local shapes)
        raise ArgumentError(
            f"functe.{op}: tensor parallelism is not implemented for {unsupported_recipe} "
            "(docs/block_scaling.md); use it without tensor_parallel_mode"
        )
    if mode is not None and fp8 and amax_group is not None and not _covers(amax_group, group):
        # (under column + SP each rank dequantizes the gathered FP8 shards of x with its own scale:
        # scales that drift apart across the tensor-parallel ranks gave wrong outputs and gradients;
        # every rank of a mesh raises this together, its groups being alike)
        raise ArgumentError(
            f"functe.{op}: argument 'amax_group' must contain the tensor-parallel group's ranks "
            f"{_ranks(group)}, got a group of ranks {_ranks(amax_group)}: the FP8 scaling states must "
            "stay equal across a tensor-parallel group; pass the data-parallel x tensor-parallel group "
            "(or the world, or None for the tensor-parallel group alone)"
        )
    if sequence_parallel and (problem := _sequence_parallel_problem(op, x, mode, tp)):
        # Ranks whose x is fine are already waiting in this linear's first collective (an all-gather,
        # a reduce-scatter, or current scaling's amax reduction): meet them there.
        meet_before_raising(x, tp)
        raise problem
    if mode is None and (not fp8 or amax.size == 1):
        return None
    return LinearParallelism(mode, sequence_parallel, tp, amax if fp8 else SINGLE)


def _ranks(group: object) -> list[int]:
    """The global ranks of a ProcessGroup (``None``: the default group)."""
    return torch.distributed.get_process_group_ranks(group or torch.distributed.group.WORLD)


def _covers(amax_group: object, group: object) -> bool:
    """Whether ``amax_group`` holds every rank of the tensor-parallel ``group`` (``Group`` values,
    made up for a trace or an explain, are not checked)."""
    if isinstance(amax_group, Group) or isinstance(group, Group):
        return True
    return set(_ranks(group)) <= set(_ranks(amax_group))


def _sequence_parallel_problem(op: str, x: Tensor, mode: str, tp: Group) -> ShapeError | None:
    if x.dim() < 2:
        return ShapeError(
            f"functe.{op}: argument 'x' expected rank >= 2 with sequence parallelism (dim 0 is split "
            f"across ranks), got {describe(x)}"
        )
    if mode == "row" and x.shape[0] % tp.size:
        return ShapeError(
            f"functe.{op}: argument 'x' expected dim 0 divisible by the tensor-parallel size {tp.size} "
            f"(the output is reduce-scattered along it), got {describe(x)}"
        )
    return None


# ----------------------------------------------------------------------------- communication steps


def gather_input(op: str, x: Tensor, p: LinearParallelism | None) -> Tensor:
    """Column + SP: the all-gathered input (along dim 0); otherwise ``x``."""
    if p is None or not p.gathers_input:
        return x
    return collective("all_gather", x, p.group, who=f"{op}: all-gather of the input (column+sp)")


def reduce_output(op: str, y: Tensor, bias: Tensor | None, p: LinearParallelism | None) -> Tensor:
    """Row: the partial products summed over ranks (SP: reduce-scattered along dim 0), plus the bias once."""
    if p is None or p.mode != "row":
        return y
    kind = "reduce_scatter" if p.sequence_parallel else "all_reduce"
    who = f"{op}: {kind.replace('_', '-')} of the output (row)"
    y = collective(kind, y, p.group, who=who, replicated=not p.sequence_parallel)
    return y if bias is None else ADD_BIAS(y, bias)


def gemm_bias(bias: Tensor | None, p: LinearParallelism | None) -> Tensor | None:
    """The bias the GEMM epilogue adds: all but the row-parallel one (added after the reduction)."""
    return None if p is not None and p.mode == "row" else bias


def gather_grad_output(op: str, dy: Tensor, p: LinearParallelism | None) -> Tensor:
    """Row + SP: the all-gathered output gradient (along dim 0), a replicated value; otherwise ``dy``."""
    if p is None or not p.gathers_grad_output:
        return dy
    return collective("all_gather", dy, p.group, who=f"{op}: all-gather of dy (row+sp, backward)", replicated=True)


def reduce_grad_input(op: str, dx: Tensor, p: LinearParallelism | None) -> Tensor:
    """Column: the partial input gradients summed over ranks (SP: reduce-scattered along dim 0)."""
    if p is None or p.mode != "column":
        return dx
    kind = "reduce_scatter" if p.sequence_parallel else "all_reduce"
    # (without SP, x and so dx are replicated: the all-reduce's adjoint is the identity)
    who = f"{op}: {kind.replace('_', '-')} of dx (column, backward)"
    return collective(kind, dx, p.group, who=who, replicated=not p.sequence_parallel)


def share_replicated(op: str, x: Tensor, dy: Tensor, p: LinearParallelism | None) -> tuple[Tensor, Tensor]:
    """``x`` and ``dy`` as a backward rule's GEMMs with this rank's weight shard read them.

    The identity on values. A replicated one (column: ``x``; row: ``dy``, gathered under SP) enters
    rank-local work through ``share``, whose adjoint sums the ranks' partial cotangents, so
    differentiating the backward rule again (a gradient penalty) is exact; the row-parallel bias
    gradient reads the replicated ``dy`` itself. First-order calls cost nothing.
    """
    if p is None:
        return x, dy
    if p.mode == "column" and not p.sequence_parallel:
        return collective("share", x, p.group, who=f"{op}: x in the wgrad (column, backward)"), dy
    if p.mode == "row":
        return x, collective("share", dy, p.group, who=f"{op}: dy in the GEMMs (row, backward)")
    return x, dy


def gathered_shape(shape: torch.Size, p: LinearParallelism | None) -> tuple[int, ...]:
    """The shape of an input after :func:`gather_input`."""
    if p is None or not p.gathers_input:
        return tuple(shape)
    return (shape[0] * p.group.size, *shape[1:])


# ----------------------------------------------------------------------------- FP8


def reduce_amax(op: str, amaxes: tuple[Tensor, ...], p: LinearParallelism | None) -> tuple[Tensor, ...]:
    """The amaxes MAX-reduced over ``p.amax_group`` in one collective (TE's reduce_amax).

    NaN-safe: the amax of a tensor with a NaN is NaN (docs/fp8.md), but a MAX all-reduce compares
    with ``<`` and drops a NaN depending on which rank holds it (measured with gloo: NaN on rank 0
    survives, on rank 1 it is lost). So a NaN travels as +inf plus a flag, and comes back as NaN
    on every rank if any rank had one: the result is the single-process amax of the whole tensor.
    """
    if p is None or p.amax_group.size == 1:
        return amaxes
    flat = torch.stack([a.reshape(()).to(torch.float32) for a in amaxes])
    nan = torch.isnan(flat)
    packed = torch.cat([torch.where(nan, torch.full_like(flat, float("inf")), flat), nan.to(torch.float32)])
    packed = collective("all_reduce", packed, p.amax_group, op="max", who=f"{op}: amax reduction")
    n = len(amaxes)
    flat = torch.where(packed[n:] > 0, torch.full_like(flat, float("nan")), packed[:n])
    return tuple(flat.unbind(0))


def cast_input(op: str, x2: Tensor, recipe: Recipe, scale: Tensor | None, store: torch.dtype, p):
    """The per-tensor cast of a linear's 2-D input: ``(q local, q for the GEMM, scale, amax)``.

    Column + SP quantizes the local shard and all-gathers the FP8 data; under current scaling the
    scale comes from the amax MAX-reduced over the tensor-parallel group first, so every shard
    uses the scale of the gathered tensor.
    """
    if p is None or not p.gathers_input:
        q, scale, amax = cast(x2, recipe, "input", scale, store)
        return q, q, scale, amax
    qdtype = recipe.dtype("input")
    if isinstance(recipe, DelayedScaling):
        q, amax = CAST_AMAX(x2, scale, qdtype, store, True)
    else:
        _, amax = CAST_AMAX(x2, torch.ones((), device=x2.device), qdtype, store, False)
        (amax,) = reduce_amax(op, (amax,), dataclasses.replace(p, amax_group=p.group))
        scale = recipe_scale(amax, recipe=recipe, role="input")
        q, _ = CAST_AMAX(x2, scale, qdtype, store, True)
    return q, gather_input(op, q, p), scale, amax
