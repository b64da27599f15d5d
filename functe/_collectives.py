"""Collectives on torch.distributed's functional collectives, safe under every transform.

:func:`collective` runs ``all_gather``, ``reduce_scatter`` or ``all_reduce`` over a process group
with ``torch.ops._c10d_functional`` (the ops ``torch.distributed._functional_collectives`` is
built on): they return a new tensor instead of writing their input, so they are pure, and
``torch.compile`` traces them into the graph. functe waits for the result at once
(``wait_tensor``), so a collective's output is an ordinary tensor.

Measured on torch 2.13 (gloo, CPU), and why this module is more than a call:

* The functional ops have **no batching rule**: under ``torch.func.vmap`` an all-reduce returned
  wrong numbers and an all-gather zeros, silently. Here a collective launched on a functorch
  wrapper goes through :class:`_Collective`, an ``autograd.Function`` whose ``vmap`` rule moves the
  vmapped dimension in front and runs one collective over the whole batch, whose ``jvp`` applies
  the collective to the tangent (collectives are linear), and whose ``backward`` is the adjoint
  collective, so second derivatives through a backward rule that communicates are exact. The
  adjoint depends on what the ranks' values mean (below, "Replicated values").
* A **shape mismatch** between ranks is not an error in gloo: an all-gather of ``f32[2,3]`` on one
  rank and ``f32[3,3]`` on another aborted the process (``gloo::EnforceNotMet``, SIGABRT); NCCL
  hangs or reads garbage. Unless checks are off (:func:`set_collective_checks`,
  ``FUNCTE_CHECK_COLLECTIVES=0``), every eager collective first all-gathers a small signature
  (collective, dim, reduction, dtype, shape) and every rank raises the same clear error if the
  signatures differ. That costs one tiny collective and a host synchronisation per call; under
  ``torch.compile`` and CUDA-graph capture the check is skipped (no host synchronisation there).
* A rank that fails before a collective leaves the others waiting: the wait is bounded by the
  process group's ``timeout`` (gloo raises ``RuntimeError`` after it; a peer process that exits
  closes its connections and the others fail at once). functe adds no unbounded wait of its own.

**Replicated values.** A tensor-parallel program holds two kinds of values: *rank-local* ones
(a weight shard, the GEMM output with it; each rank's cotangent is its own) and *replicated* ones
(the same value on every rank, computed by every rank alike: a column-parallel linear's input,
the all-reduced output of a row-parallel one; every rank receives the same, complete cotangent).
An all-gather feeding rank-local work has the reduce-scatter as adjoint, and an all-reduce whose
ranks' outputs feed different losses the all-reduce; but an all-reduce *into* a replicated value
(``replicated=True``) has the identity as adjoint, an all-gather into one this rank's slice, and a
replicated value entering rank-local work (``"share"``: the identity, Megatron's copy-to-region)
has the all-reduce into a replicated value as adjoint, which sums the ranks' partial cotangents.
Differentiating a linear's backward rule (a gradient penalty, a Hessian-vector product) needs
these pairs: with the plain all-reduce as the adjoint of a column-parallel dx, its gradients came
out ``P`` times too large.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import zlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from ._backend import has_values, records
from ._errors import (
    ArgumentError,
    DistributedError,
    DTypeError,
    ShapeError,
    as_int,
    check_flag,
    describe,
    dtype_name,
)
from ._scoped import ScopedSetting

Tensor = torch.Tensor

KINDS = ("all_gather", "reduce_scatter", "all_reduce")
LOCAL_KINDS = ("share", "slice")
"""Steps without communication whose adjoints communicate (see "Replicated values" above)."""
REDUCTIONS = ("sum", "max", "min")
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclasses.dataclass(frozen=True)
class Group:
    """A process group as static, hashable configuration: its c10d name and size.

    Ops take a ``torch.distributed.ProcessGroup`` (or ``None`` for the default group) and keep
    this value as a static parameter, so it shows in op lists and keys compiled graphs. A
    single-process run (no process group initialised) is ``Group("", 1)``.

    Example:
        >>> Group("0", 2)
        Group('0', size=2)
    """

    name: str
    size: int

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise ArgumentError(
                f"functe.Group: argument 'name' expected a c10d group name (str), got {describe(self.name)}"
            )
        size = as_int(self.size)  # (a numpy integer is stored as an int)
        if size is None or size < 1:
            raise ArgumentError(f"functe.Group: argument 'size' expected an int >= 1, got {self.size!r}")
        object.__setattr__(self, "size", size)

    def __repr__(self):
        return f"Group({self.name!r}, size={self.size})"


SINGLE = Group("", 1)


def resolve_group(op: str, group: object, arg: str = "group") -> Group:
    """``group`` (a ProcessGroup, a :class:`Group`, or ``None`` for the default group) as a :class:`Group`."""
    if isinstance(group, Group):
        return group  # (unchecked here: a trace or explain of a parallel program may use a made-up one)
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return SINGLE
        group = dist.group.WORLD
    if dist.is_available() and group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ArgumentError(
            f"functe.{op}: argument '{arg}': this rank ({dist.get_rank()}) is not a member of that group "
            "(torch.distributed.new_group returns GroupMember.NON_GROUP_MEMBER on ranks outside it): only its "
            "members may run a collective over it"
        )
    if not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise ArgumentError(
            f"functe.{op}: argument '{arg}' expected a torch.distributed.ProcessGroup or None, "
            f"got {type(group).__name__}"
        )
    return Group(group.group_name, dist.get_world_size(group))


# ----------------------------------------------------------------------------- checks


def _publish_checks(enabled: bool) -> None:
    global _checks
    _checks = enabled


_checks = True
_checks_setting = ScopedSetting(
    os.environ.get("FUNCTE_CHECK_COLLECTIVES", "1") not in ("0", "false", "False", ""), _publish_checks
)


def set_collective_checks(enabled: bool) -> None:
    """Turn the cross-rank signature check of every collective on or off (default on).

    Every rank must use the same setting (the check is itself a collective). Inside an open
    :func:`collective_checks` block the block's setting stays in force until it closes. Off saves one tiny
    collective and one host synchronisation per call; a mismatch then aborts (gloo) or hangs
    (NCCL) instead of raising. ``FUNCTE_CHECK_COLLECTIVES=0`` turns it off at import.

    Example:
        >>> set_collective_checks(True)
    """
    _checks_setting.set_default(check_flag("set_collective_checks", "enabled", enabled))


@contextlib.contextmanager
def collective_checks(enabled: bool) -> Iterator[None]:
    """:func:`set_collective_checks` for a ``with`` block (process-wide while open, as
    :func:`functe.use_backend`).

    Example:
        >>> with collective_checks(False):
        ...     pass  # collectives here skip the cross-rank signature check
    """
    with _checks_setting.scoped(check_flag("collective_checks", "enabled", enabled)):
        yield


# Every torch dtype, in a fixed order (the same torch on every rank): a dtype's code in a signature is its
# index, so no two dtypes share one (unlisted dtypes shared -1, and int8 on one rank met bool on another)
_DTYPES = tuple(sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str))
_MAX_DIMS = 12  # listed one by one; any further dims enter a checksum


_RAISING = len(KINDS)  # the kind code of a rank meeting the check only to raise its own error
_LAYOUT = len(KINDS) + 1  # the kind code of all_reduce_gradients' tree-layout check
# kind, dim, reduction, dtype, rank, numel, the dims, a checksum of further dims, a checksum of the
# collective's role: every cross-rank check exchanges rows of this one length (rows of different
# lengths made gloo abort the process)
_SIGNATURE_LEN = 8 + _MAX_DIMS


def _signature(kind: str, x: Tensor, dim: int, op: str, who: str) -> list[int]:
    code = _DTYPES.index(x.dtype)
    dims = list(x.shape[:_MAX_DIMS]) + [-1] * (_MAX_DIMS - min(x.dim(), _MAX_DIMS))
    rest = zlib.crc32(repr(tuple(x.shape[_MAX_DIMS:])).encode())
    return [KINDS.index(kind), dim, REDUCTIONS.index(op), code, x.dim(), x.numel(), *dims, rest, _role(who)]


def _role(who: str) -> int:
    """A checksum of what a collective is for (``who`` past the op's name: "all-reduce of the
    output (row)"): a row-parallel forward's all-reduce and a column-parallel backward's, of one
    shape, summed unrelated tensors. (The op's name is left out: a rank's fused op and another's
    unfused one may run the same collective.)"""
    return zlib.crc32(who.split(": ", 1)[-1].encode())


def _describe_signature(sig: list[int]) -> str:
    if sig[0] == _LAYOUT:
        return "all_reduce_gradients' layout check"
    kind, dim, op, code, ndim = KINDS[sig[0]], sig[1], REDUCTIONS[sig[2]], sig[3], sig[4]
    shape = ",".join(str(d) for d in sig[6 : 6 + min(ndim, _MAX_DIMS)])
    if ndim > _MAX_DIMS:
        shape += f",...(checksum {sig[6 + _MAX_DIMS]:08x})"
    args = [f"{dtype_name(_DTYPES[code])}[{shape}]"]
    if kind != "all_reduce":
        args.append(f"dim={dim}")
    if kind != "all_gather":
        args.append(op)
    return f"{kind}({', '.join(args)})"


def _skip_check(x: Tensor) -> bool:
    if not _checks or torch.compiler.is_compiling() or not has_values(x):
        return True
    return x.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _from_every_rank(values: list[int], device: torch.device, group: Group) -> list[list[int]]:
    """Every rank's ``values`` (int64, same length on every rank), in rank order: one all-gather and
    the host synchronisation of a cross-rank check."""
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    c10d = torch.ops._c10d_functional
    rows = c10d.wait_tensor(c10d.all_gather_into_tensor(mine, group.size, group.name))
    return rows.view(group.size, len(values)).tolist()


def _check(kind: str, x: Tensor, group: Group, dim: int, op: str, who: str) -> None:
    """Raise on every rank if the ranks are about to run different collectives or shapes."""
    rows = _from_every_rank(_signature(kind, x, dim, op, who), x.device, group)
    if all(row == rows[0] for row in rows):
        return
    _raise_if_ranks_differ_in_kind(rows, group, who, lambda row: (row[0], row[2]))
    listing = ", ".join(f"rank {r} calls {_describe_signature(row)}" for r, row in enumerate(rows))
    if any(row[-1] != rows[0][-1] for row in rows):
        raise DistributedError(
            f"functe.{who}: the ranks of {group!r} run different collectives at this point: {listing}, "
            "not all for this one's purpose (a forward's and a backward's collective, say); every rank must "
            "run the same ops in the same order"
        )
    raise ShapeError(f"functe.{who}: every rank of {group!r} must pass the same shape and dtype: {listing}")


def _raise_if_ranks_differ_in_kind(rows: list[list[int]], group: Group, who: str, kind_of: Callable) -> None:
    """Raise (the same error on every rank) if a rank met the check only to raise its own error, or
    if the ranks' rows are different collectives (``kind_of(row)`` differs)."""
    raising = [r for r, row in enumerate(rows) if row[0] == _RAISING]
    if raising:
        ranks = ", ".join(str(r) for r in raising)
        raise DistributedError(
            f"functe.{who}: rank(s) {ranks} of {group!r} raised an argument error instead of joining this "
            "collective (their error says which argument), so this rank stops too"
        )
    if any(kind_of(row) != kind_of(rows[0]) for row in rows):
        listing = ", ".join(f"rank {r} calls {_describe_signature(row)}" for r, row in enumerate(rows))
        raise DistributedError(
            f"functe.{who}: the ranks of {group!r} run different collectives at this point: {listing} "
            "(every rank must run the same ops in the same order)"
        )


def check_same_layout(layout: Callable[[], str], like: Tensor, group: Group, who: str) -> None:
    """Raise on every rank unless all ranks pass the same ``layout()`` (a description of a pytree's
    structure, shapes and dtypes): a flat buffer of one size can hide different layouts. (A function,
    called only when the check runs: under torch.compile, which skips it, Dynamo cannot build text.)"""
    if group.size == 1 or _skip_check(like):
        return
    layout = layout()
    mine = [_LAYOUT, zlib.crc32(layout.encode())] + [0] * (_SIGNATURE_LEN - 2)
    rows = _from_every_rank(mine, like.device, group)
    _raise_if_ranks_differ_in_kind(rows, group, who, lambda row: row[0])
    sums = [row[1] for row in rows]
    if len(set(sums)) > 1:
        listing = ", ".join(f"rank {r}: {c:08x}" for r, c in enumerate(sums))
        raise ShapeError(
            f"functe.{who}: every rank of {group!r} must pass the same tree structure, shapes and dtypes; "
            f"the layouts differ (checksums {listing}); this rank passes {layout[:300]}"
        )


def stand_in(group: Group) -> Tensor | None:
    """An empty tensor on a device ``group`` communicates on (the CPU for gloo, the current CUDA
    device for NCCL), for a rank that holds no tensor but must join a check the others run (it
    would leave them waiting); ``None`` when the backend is unknown."""
    try:
        backend = dist.get_backend(dist.distributed_c10d._resolve_process_group(group.name))
    except Exception:  # (a group functe cannot look up: the caller skips its check)
        return None
    if "gloo" in backend:
        return torch.empty(0, device="cpu")
    if "nccl" in backend and torch.cuda.is_available():
        return torch.empty(0, device=torch.device("cuda", torch.cuda.current_device()))
    return None


def meet_before_raising(x: Tensor, group: Group) -> None:
    """Join the cross-rank check of whatever collective the other ranks run next, saying this rank
    raises, before it raises a local argument error: ranks whose arguments were fine, waiting in that
    check, raise a DistributedError naming this rank instead of hanging (or, before, reading this
    rank's stand-in as another collective). Ranks failing alike meet alike and raise their own errors."""
    if group.size == 1 or _skip_check(x):
        return
    mine = [_RAISING] + [0] * (_SIGNATURE_LEN - 1)
    try:
        _from_every_rank(mine, x.device, group)
    except Exception:  # (a group that cannot communicate): the caller's own error says more
        pass


# ----------------------------------------------------------------------------- execution


def _out_shape(kind: str, shape: torch.Size, dim: int, size: int) -> list[int]:
    out = list(shape)
    if kind == "all_gather":
        out[dim] *= size
    elif kind == "reduce_scatter":
        out[dim] //= size
    return out


def _raw(kind: str, x: Tensor, group: Group, dim: int, op: str) -> Tensor:
    """The functional collective itself, waited for; ``dim`` moved to the front where needed."""
    if x.device.type == "meta":  # shapes only (functe.trace runs forward rules on meta tensors)
        return x.new_empty(_out_shape(kind, x.shape, dim, group.size))
    c10d = torch.ops._c10d_functional
    if kind == "all_reduce":
        return c10d.wait_tensor(c10d.all_reduce(x, op, group.name))
    moved = x if dim == 0 else x.movedim(dim, 0)
    data = moved.view(torch.uint8) if moved.dtype in _FP8 else moved  # gloo has no float8: move bytes
    if kind == "all_gather":
        out = c10d.all_gather_into_tensor(data.contiguous(), group.size, group.name)
    else:
        out = c10d.reduce_scatter_tensor(data.contiguous(), op, group.size, group.name)
    out = c10d.wait_tensor(out)
    out = out.view(moved.dtype) if moved.dtype in _FP8 else out
    return out if dim == 0 else out.movedim(0, dim)


def _validate(kind: str, x: Tensor, group: Group, dim: int, who: str) -> None:
    """Local argument checks, made after the cross-rank check so that all ranks raise together."""
    if kind == "reduce_scatter" and x.shape[dim] % group.size:
        raise ShapeError(
            f"functe.{who}: argument 'x' expected dim {dim} divisible by the group size {group.size} "
            f"(each rank keeps one slice), got {describe(x)}"
        )
    if x.dtype in _FP8 and kind != "all_gather":
        raise DTypeError(f"functe.{who}: float8 tensors can be gathered but not reduced, got {describe(x)}")


def _local(kind: str, x: Tensor, group: Group, dim: int) -> Tensor:
    """The steps without communication: ``share`` (the identity) and ``slice`` (this rank's part)."""
    if kind == "share":
        # (a view, not x itself: autograd treats a Function's input returned as-is as a view, and
        # then refuses a jvp that does not return one, under forward-over-reverse)
        return x.view_as(x)
    size = x.shape[dim] // group.size
    rank = 0 if x.device.type == "meta" else dist.get_rank(dist.distributed_c10d._resolve_process_group(group.name))
    return x.narrow(dim, rank * size, size)


def _check_registered(group: Group, who: str) -> None:
    """A :class:`Group` given directly (not resolved from a ProcessGroup) names an initialised c10d
    group of its size; else c10d failed with a message naming neither the op nor the argument."""
    found = None
    if dist.is_available() and dist.is_initialized():
        try:
            found = dist.distributed_c10d._resolve_process_group(group.name)
        except (RuntimeError, ValueError, KeyError):
            found = None
    if found is None or dist.get_world_size(found) != group.size:
        raise ArgumentError(
            f"functe.{who}: argument 'group' is {group!r}, but no initialised torch.distributed process group "
            f"has that name{' and size' if found is not None else ''}; pass a live ProcessGroup itself (one "
            "torch.distributed.destroy_process_group destroyed is no longer registered)"
        )


def _execute(kind: str, x: Tensor, group: Group, dim: int, op: str, who: str) -> Tensor:
    if x.device.type != "meta" and kind != "share":
        _check_registered(group, who)
    if kind in LOCAL_KINDS:
        return _local(kind, x, group, dim)
    if not _skip_check(x):
        _check(kind, x, group, dim, op, who)
    _validate(kind, x, group, dim, who)
    return _raw(kind, x, group, dim, op)


def collective(
    kind: str, x: Tensor, group: Group, *, dim: int = 0, op: str = "sum", who: str = "", replicated: bool = False
) -> Tensor:
    """Run collective ``kind`` on ``x`` over ``group`` and return the (waited) result.

    * ``all_gather``: concatenate every rank's ``x`` along ``dim`` (rank order);
    * ``reduce_scatter``: reduce (``op``) over ranks, then keep this rank's slice along ``dim``;
    * ``all_reduce``: reduce (``op``: ``"sum"``, ``"max"``, ``"min"``) over ranks;
    * ``share``: ``x`` itself, a replicated value entering rank-local work (no communication);
    * ``slice``: this rank's slice along ``dim`` of a replicated ``x`` (no communication).

    ``replicated`` (sum ``all_reduce``, ``all_gather``): the result is a replicated value, which
    sets the adjoint (the module's "Replicated values"). ``who`` names the op in error messages.
    Differentiable (and batchable) through :class:`_Collective` when ``x`` requires grad or is a
    ``torch.func`` wrapper; without one of those (any first-order call), ``share`` costs nothing.
    """
    if group.size == 1:
        return x
    if torch.compiler.is_compiling():
        # Dynamo traces the functional op into the graph; a Function nested in the op Function
        # being traced is not supported, and compiled code is first-order (docs/design.md).
        if kind in LOCAL_KINDS:
            return _local(kind, x, group, dim)
        _validate(kind, x, group, dim, who)
        return _raw(kind, x, group, dim, op)
    if records((x,)):
        return _Collective.apply(x, kind, group, dim, op, who, replicated)
    return _execute(kind, x, group, dim, op, who)


def _extremum_mask(x: Tensor, y: Tensor, group: Group, who: str) -> Tensor:
    """Where ``x`` attains the max/min ``y`` of all ranks, divided by how many ranks do (ties share)."""
    hits = (x == y).to(x.dtype)
    return hits / collective("all_reduce", hits, group, op="sum", who=who)


# (kind, replicated) -> the adjoint's (kind, replicated), for sum reductions
_ADJOINT = {
    ("all_gather", False): ("reduce_scatter", False),
    ("reduce_scatter", False): ("all_gather", False),
    ("all_reduce", False): ("all_reduce", False),  # each rank's output feeds its own loss
    ("all_reduce", True): ("share", False),
    ("share", False): ("all_reduce", True),
    ("all_gather", True): ("slice", False),
    ("slice", False): ("all_gather", True),
}


class _Collective(torch.autograd.Function):
    """A collective as an ``autograd.Function``: its adjoint as backward, itself as jvp, a real vmap rule."""

    @staticmethod
    def forward(x, kind, group, dim, op, who, replicated):
        return _execute(kind, x, group, dim, op, who)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, kind, group, dim, op, who, replicated = inputs
        ctx.args = (kind, group, dim, op, who, replicated)
        if op != "sum":
            ctx.save_for_backward(x, output)
            ctx.save_for_forward(x, output)

    @staticmethod
    def backward(ctx, dy):
        kind, group, dim, op, who, replicated = ctx.args
        if op != "sum":  # max/min all-reduce: the gradient goes to the ranks holding the extremum
            x, y = ctx.saved_tensors
            dx = collective("all_reduce", dy, group, op="sum", who=who) * _extremum_mask(x, y, group, who)
        else:
            adjoint, adjoint_replicated = _ADJOINT[kind, replicated]
            dx = collective(adjoint, dy, group, dim=dim, who=who, replicated=adjoint_replicated)
        return dx, None, None, None, None, None, None

    @staticmethod
    def jvp(ctx, dx, *_):
        kind, group, dim, op, who, replicated = ctx.args
        if op != "sum":
            x, y = ctx.saved_tensors
            return collective("all_reduce", dx * _extremum_mask(x, y, group, who), group, op="sum", who=who)
        return collective(kind, dx, group, dim=dim, op=op, who=who, replicated=replicated)

    @staticmethod
    def vmap(info, in_dims, x, kind, group, dim, op, who, replicated):
        if in_dims[0] is None:
            return collective(kind, x, group, dim=dim, op=op, who=who, replicated=replicated), None
        # One collective for the whole batch: the vmapped dim goes in front, the op's dim shifts by one.
        batched = x.movedim(in_dims[0], 0)
        return collective(kind, batched, group, dim=dim + 1, op=op, who=who, replicated=replicated), 0
