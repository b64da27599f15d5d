"""Kernels: a Triton launcher and its PyTorch twin behind the one dispatch point.

A :class:`Kernel` pairs a Triton *launcher* (allocates its outputs, launches,
returns) with a PyTorch *twin* of the same signature. Calling the kernel picks
one by :func:`functe._backend.runs_triton`: the twin runs directly (it is plain
torch, so every transform understands it); a Triton launch goes through a
per-kernel ``autograd.Function`` whose ``forward`` calls the launcher: wrapped as
a ``torch.library.custom_op`` (opaque to ``torch.compile``, no autograd of its
own) where something traces the dispatcher, directly otherwise (see
:func:`eager_launch`). That Function is what makes a kernel safe to call anywhere, including in
a backward rule under ``torch.func.grad``:

* the launch happens only in ``forward``, which always receives plain tensors
  (a raw launch on a functorch wrapper fails: "Cannot access storage of
  TensorWrapper");
* ``backward`` and ``jvp`` differentiate the *twin* with ``torch.func``, so a
  kernel used inside a backward rule has correct second derivatives;
* ``vmap`` applies the kernel's batching rule: :class:`Rowwise` folds the
  vmapped dimension into the kernel's leading (row) dimensions (or, for a batched
  parameter such as an ensemble's γ, runs its members kernel), :class:`Members`
  runs a variant kernel that keeps per-member reductions apart, :class:`PerMember`
  runs the kernel once per member (each member's bits those of its own call);
  anything else runs ``torch.vmap`` over the twin, which is always correct.

The twin goes through the same kind of Function where a transform or autograd
would otherwise record it on large CPU tensors: its ``forward`` sees plain
tensors with nothing recording, so the twin takes its CPU fast path (one fused
ATen call where the differentiable formula takes a dozen: measured 1.5x to 4.7x
faster under ``torch.func.vjp`` at 8192x4096); second derivatives still
differentiate the formula. Twins with a CPU fast path (most activation, norm,
dropout and quantizing twins: ``Kernel(..., fast_path=True)``, the default) go
through the Function at every size, so a kernel returns the same bits whether
or not autograd or a transform records it (the fast path and the formula may
round differently, and an FP8 amax or a fused-vs-unfused comparison sees every
ulp). Twins without one (``fast_path=False``) call the twin directly on small
tensors, where a Function costs more per call than the formula's ops (see the
threshold).
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._C._functorch import TransformType
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
from torch.autograd import forward_ad as _forward_ad

from ._backend import PLAIN_TENSOR_TYPES, any_tangent, forward_ad_active, records, runs_triton_on, unaliased_outputs
from ._errors import TransformError

Tensor = torch.Tensor


TWIN_FUNCTION_MIN_ELEMENTS = 1 << 16
"""A recorded call of a twin without a fast path whose first tensor has at least this many elements
runs as a Function (see the module docstring). Measured under ``torch.func.vjp``, one thread: at 4,096 elements the
Function costs up to 66 us more than it saves (swiglu 585 vs 519 us), at 65,536 it is about even
(silu 464 vs 508, swiglu 685 vs 629, layer_norm 588 vs 656 us), at 262,144 it wins for every op
(layer_norm 743 vs 3,410 us)."""


class Rowwise:
    """Batching rule for kernels that treat all leading dimensions as independent rows.

    ``params`` are the positions of arguments that are *not* row data (a norm's
    weight, say). When only row arguments are batched, the vmapped dimension is
    moved in front and becomes one more leading dimension, and every output is
    batched along dimension 0. When a ``params`` argument is batched (an
    ensemble of weights), ``members`` runs as for :class:`Members` (a kernel over a
    leading member dimension, γ ``[M, N]``), or without one the twin is vmapped.
    """

    def __init__(self, params: Sequence[int] = (), members: Kernel | None = None):
        self.params = frozenset(params)
        self.members = members


class Members:
    """Batching rule for kernels that reduce over rows (a norm backward's dγ and dβ).

    Folding the vmapped dimension into the rows (:class:`Rowwise`) would sum every member's rows
    into one reduction. A vmapped call runs ``members`` instead: the same kernel over a leading
    member dimension, one launch that keeps each member's reductions apart. Row arguments are moved
    in front (an unbatched one broadcast); a ``params`` argument (γ) is moved in front when batched
    and passed as it is otherwise (``members`` takes ``[N]`` or ``[M, N]``). Every output is batched
    along dimension 0.
    """

    def __init__(self, members: Kernel, params: Sequence[int] = ()):
        self.members = members
        self.params = frozenset(params)


class FoldMembers:
    """Batching rule for a ``*_members`` kernel itself (a nested ``vmap``: an ensemble of ensembles).

    Row arguments are ``[M, ...]`` (members on dimension 0); the outer vmapped dimension ``A`` is
    folded into the members (``[A·M, ...]``, an unbatched one broadcast), ``params`` (γ, β: ``[N]``
    or ``[M, N]``) widened to ``[A·M, N]`` where the outer level or the members vary them, and the
    outputs unfolded to ``[A, M, ...]``: one launch, each member's bits as its own launch.
    """

    def __init__(self, params: Sequence[int] = ()):
        self.params = frozenset(params)


class PerMember:
    """Batching rule for kernels whose reductions are per member and whose unfused equivalent batches
    by rows (a fused dact + dbias + FP8 cast, whose amax and bias gradient are per member): the
    kernel runs once per member, so each member's bits are those of its own unbatched call, hence
    of the unfused ops it replaces (vmapping the twin's formula instead rounded ``g = dy·act'(z)``
    differently from the activation backward's row-batched fast path: an ulp, then the amax and the
    next scale). One launch per member costs: above ``max_members`` (per-example gradients over a
    large batch) the twin is vmapped as without a rule, one call whose bits may differ by an ulp
    (a fused FP8 MLP's ``vmap(value_and_grad)`` over 32 members: 13.2 ms vmapped, 21.4 per member).
    The cap is per ``vmap`` level: a nested ``vmap`` of 16 x 16 runs 256 launches.
    """

    def __init__(self, max_members: int = 16):
        self.max_members = max_members


class Kernel:
    """A Triton launcher and its PyTorch twin, dispatched by device and backend.

    Args:
        name: unique name; the custom op is registered as ``functe::<name>``.
        launcher: Triton host function with type annotations (they become the
            custom-op schema); allocates and returns new tensors, never writes
            its inputs.
        twin: PyTorch function with the same signature and results.
        batch: a :class:`Rowwise`, :class:`Members`, :class:`FoldMembers` or :class:`PerMember`
            rule, or ``None`` to vmap the twin.
        fast_path: whether the twin (or a twin it calls) has a CPU fast path
            (``functe.kernels._fast.eager_cpu``) whose bits may differ from its
            differentiable formula; recorded calls then always run it through
            the Function (see the module docstring).
        quantizes: whether the kernel rounds to a low-precision grid (an FP8,
            MXFP8 or NVFP4 cast, even one returning the dequantized values in a
            float dtype): forward mode refuses it (see the jvp rule).
    """

    def __init__(
        self,
        name: str,
        launcher: Callable,
        twin: Callable,
        *,
        batch: Rowwise | Members | FoldMembers | PerMember | None = None,
        fast_path: bool = True,
        quantizes: bool = False,
    ):
        if list(inspect.signature(launcher).parameters) != list(inspect.signature(twin).parameters):
            raise TypeError(f"kernel {name}: launcher and twin must have the same signature")
        self.name = name
        self.launcher = launcher
        raw_twin = twin
        if quantizes:
            twin = _NamingLegacyVmapErrors(name, twin)
        self.twin = twin
        self.batch = batch
        self.fast_path = fast_path
        self.quantizes = quantizes
        self.op = torch.library.custom_op(f"functe::{name}", launcher, mutates_args=())
        self.direct = _with_float_scalars(launcher)
        self.launch = _launching(self, self.direct)
        # The twin is plain torch, so on fake tensors it computes exactly the
        # output shapes and dtypes: it serves as the op's fake implementation, on contiguous
        # arguments, as the launchers lay out their outputs (see _OnContiguous).
        self.op.register_fake(_OnContiguous(raw_twin))
        self.function = _make_function(self, self.launch)
        self.twin_function = _make_function(self, twin)

    def __call__(self, *args):
        for first in args:
            if isinstance(first, Tensor):
                break
        if runs_triton_on(first):
            if not torch.compiler.is_compiling():
                route = _triton_route(args)  # (one pass for `records` and `eager_launch`: ~1.5 us a call)
                if route is _DIRECT:
                    return self.direct(*args)
                if route is _CUSTOM_OP:
                    return self.op(*args)
            run, function = self.launch, self.function
        elif type(first) not in PLAIN_TENSOR_TYPES or not first.is_cpu:  # (is_cpu: see runs_triton_on)
            return self.twin(*args)
        elif not torch.is_grad_enabled() and not _transforms_active() and not forward_ad_active():
            return self.twin(*args)  # nothing can record (the common path: backward rules, inference)
        else:
            run, function = self.twin, self.twin_function
        if torch.compiler.is_compiling():
            # Dynamo cannot nest a Function inside the op Function it traces; the opaque
            # custom op (or the plain-torch twin) is all it needs (compiled code is first-order).
            return run(*args)
        if records(args):
            if getattr(_formula_twins, "on", False):
                return self.twin(*args)  # (see formula_twins: recorded, as a formula, not a Function)
            if (
                run is self.twin
                and not (self.fast_path or self.quantizes)  # (a quantizing kernel's jvp must refuse)
                and first.numel() < TWIN_FUNCTION_MIN_ELEMENTS
                and not any_tangent(args)  # (twins use out= functions, which forward AD refuses)
            ):
                return run(*args)  # recorded as it runs: cheaper than a Function at this size, same bits
            return function.apply(*args)
        return run(*args)

    def __repr__(self):
        return f"Kernel({self.name})"


class _OnContiguous:
    """A twin run on contiguous copies of its tensor arguments: its outputs laid out as the
    launchers lay out theirs, which take their inputs contiguous. The custom op's fake (on a
    transposed input a formula keeps the input's strides, where the launcher does not, and
    Inductor's ``assert_size_stride`` failed the compiled call at run time; copies of fake tensors
    cost nothing)."""

    def __init__(self, twin: Callable):
        self.__wrapped__ = twin  # (inspect.signature reads the twin's)

    def __call__(self, *args):
        return self.__wrapped__(*(a.contiguous() if isinstance(a, Tensor) else a for a in args))

    def __reduce__(self):
        return (_OnContiguous, (self.__wrapped__,))


class _NamingLegacyVmapErrors:
    """A quantizing kernel's twin raising a functe error under torch's legacy vmap, which has no
    batching rule for a bit cast (``Tensor.view(dtype)``, how the block-scaled casts read exponents):
    torch's raw "Batching rule not implemented for aten::view.dtype" named no functe op. (No ``try``
    while compiling: a graph break inside one made Dynamo run the frame eagerly and compile its
    callees one by one. A class, not a closure: the twin stays picklable.)"""

    def __init__(self, name: str, twin: Callable):
        self.name = name
        self.__wrapped__ = twin  # (inspect.signature reads the twin's)

    def __call__(self, *args):
        twin = self.__wrapped__
        if torch.compiler.is_compiling():
            return twin(*args)
        try:
            return twin(*args)
        except RuntimeError as error:
            legacy = any(isinstance(a, Tensor) and torch._C._functorch.is_legacy_batchedtensor(a) for a in args)
            if not legacy or "Batching rule not implemented" not in str(error):
                raise
            raise TransformError(
                f"functe.{self.name}: torch's legacy vmap (autograd.grad(is_grads_batched=True), "
                "autograd.functional.jacobian/hessian(vectorize=True), gradcheck(check_batched_grad=True)) "
                f"cannot batch this kernel's bit casts ({str(error).split(';')[0]}): use torch.func.vmap or "
                "jacrev, or take the gradients one cotangent at a time"
            ) from error

    def __reduce__(self):
        return (_NamingLegacyVmapErrors, (self.name, self.__wrapped__))


_transforms_active = torch._C._are_functorch_transforms_active
_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_unwrapped = torch._C._functorch.get_unwrapped
_dispatch_modes = torch._C._len_torch_dispatch_stack
_jit_tracing = torch._C._is_tracing
_profiling = torch._C._autograd._profiler_enabled


_FLOAT_ANNOTATIONS = (float, "float", "float | None", "Optional[float]")


def _with_float_scalars(launcher: Callable) -> Callable:
    """``launcher`` converting an int or a 0-d tensor given for a ``float`` parameter to a float, as
    its custom op's schema does: called directly, Triton would specialise the kernel on an int (a
    different compiled variant) or take a tensor for a pointer."""
    positions = tuple(
        i for i, p in enumerate(inspect.signature(launcher).parameters.values()) if p.annotation in _FLOAT_ANNOTATIONS
    )
    if not positions:
        return launcher

    def launch(*args):
        args = list(args)
        for i in positions:
            if i < len(args) and isinstance(args[i], (int, Tensor)) and not isinstance(args[i], bool):
                args[i] = float(args[i])
        return launcher(*args)

    return launch


def _launching(kernel: Kernel, direct: Callable) -> Callable:
    """A Triton launch of ``kernel``: ``direct`` (its launcher) where :func:`eager_launch` allows,
    else its custom op. One decision per launch, wherever the launch happens (a kernel call nothing
    records, or the forward of the kernel's Function)."""

    def launch(*args):
        return direct(*args) if eager_launch(args) else kernel.op(*args)

    return launch


_DIRECT, _CUSTOM_OP, _RECORDED = "direct", "custom op", "recorded"


def _triton_route(args: Sequence[Any]) -> str:
    """How a Triton kernel call outside ``torch.compile`` runs, in one pass over its arguments:
    ``_RECORDED`` where :func:`functe._backend.records` says autograd or a transform records it (its
    Function), else ``_DIRECT`` or ``_CUSTOM_OP`` as :func:`eager_launch` decides (the same tests,
    in that order of precedence)."""
    grad = torch.is_grad_enabled()
    direct = not _dispatcher_recorded()
    for a in args:
        if isinstance(a, Tensor):
            if (grad and a.requires_grad) or _is_wrapped(a):
                return _RECORDED
            if direct and _misread(a):
                direct = False
    if any_tangent(args):
        return _RECORDED
    return _DIRECT if direct else _CUSTOM_OP


def eager_launch(args: Sequence[Any]) -> bool:
    """Whether a Triton launch may call its launcher directly rather than through its custom op.

    The op's Python layers (dispatch, autograd redispatch, its alias check) cost as much as the
    launch itself: measured on an H100 host, 128 vs 78 us per call, and a GELU forward+backward at
    8x256 680 vs 438 us. The op stays wherever it does more than run the launcher:

    * something records the dispatcher: ``torch.compile``, dispatch modes (``FlopCounterMode``,
      fake tensors, functionalization), ``torch.jit.trace`` (which records the op and replays it;
      the launcher's arithmetic on traced sizes breaks), the profiler (its ``functe::<name>``
      ranges attribute time to kernels);
    * a tensor the launcher would misread: a subclass, a meta tensor, a tensor with the negative
      bit (``z.conj().imag``: the dispatcher resolves it, a kernel reading the memory would get the
      other sign), an efficient zero tensor (no memory), a nested tensor (the op's error names it).
    """
    # (is_compiling first: Dynamo cannot trace the other checks)
    if torch.compiler.is_compiling() or _dispatcher_recorded():
        return False
    return not any(_misread(a) for a in args if isinstance(a, Tensor))


def _dispatcher_recorded() -> bool:
    """Whether a dispatch mode, ``torch.jit.trace`` or the profiler records the dispatcher (see
    :func:`eager_launch`; the caller has ruled out ``torch.compile``)."""
    return bool(_dispatch_modes() or _jit_tracing() or _profiling())


def _misread(a: Tensor) -> bool:
    """Whether a launcher reading ``a``'s memory directly would misread it (see :func:`eager_launch`)."""
    return type(a) not in PLAIN_TENSOR_TYPES or a.is_meta or a.is_neg() or a._is_zerotensor() or a.is_nested


def _float_positions(args: Sequence[Any]) -> list[int]:
    return [i for i, a in enumerate(args) if isinstance(a, Tensor) and a.is_floating_point()]


def _with(args: Sequence[Any], positions: Sequence[int], values: Sequence[Any]) -> list[Any]:
    full = list(args)
    for i, v in zip(positions, values):
        full[i] = v
    return full


def _make_function(kernel: Kernel, run: Callable) -> type[torch.autograd.Function]:
    """The Function around ``run`` (the launcher's custom op, or the twin) described in the module docstring."""
    twin = kernel.twin

    def forward(*args):
        out = run(*args)
        # A Function must not hand back one of its inputs (a twin may return one unchanged): a view
        # keeps the result functional. A view of the kernel's own buffer is not left a view.
        if isinstance(out, tuple):
            return tuple(unaliased_outputs([_fresh(o, args) for o in out], args)[0])
        return unaliased_outputs([_fresh(out, args)], args)[0][0]

    def setup_context(ctx, inputs, output):
        outs = output if isinstance(output, tuple) else (output,)
        ctx.floating_outputs = [i for i, o in enumerate(outs) if isinstance(o, Tensor) and o.is_floating_point()]
        # (a quantizing kernel, or an MXFP8 cast's uint8 scales among the outputs: no derivative)
        ctx.quantizing = kernel.quantizes or len(ctx.floating_outputs) != len(outs)
        positions = [i for i, a in enumerate(inputs) if isinstance(a, Tensor)]
        ctx.positions = positions
        ctx.others = [None if isinstance(a, Tensor) else a for a in inputs]
        tensors = [inputs[i] for i in positions]
        ctx.save_for_backward(*tensors)
        ctx.save_for_forward(*tensors)
        ctx.set_materialize_grads(False)
        ctx.out_strides = output_strides(outs)

    def saved_args(ctx):
        return _with(ctx.others, ctx.positions, ctx.saved_tensors)

    def backward(ctx, *grads):
        args = saved_args(ctx)
        diff = _float_positions(args)
        if ctx.quantizing:  # (reached only when a backward rule that used it is itself differentiated)
            raise TransformError(
                f"functe.{kernel.name}: a quantizing kernel has no derivative; differentiating a backward "
                "rule that uses it (second order through a quantized linear) is not supported"
            )

        def twin_of(*values):
            return twin(*_with(args, diff, values))

        outputs, vjp_fn = torch.func.vjp(twin_of, *(args[i] for i in diff))
        outs = outputs if isinstance(outputs, tuple) else (outputs,)
        cts = tuple(torch.zeros_like(o) if g is None else g for g, o in zip(grads, outs))
        grads_in = vjp_fn(cts if isinstance(outputs, tuple) else cts[0])
        return tuple(_with([None] * len(args), diff, grads_in))

    def jvp(ctx, *tangents):
        args = saved_args(ctx)
        diff = _float_positions(args)
        primals = tuple(args[i] for i in diff)
        tans = tuple(torch.zeros_like(p) if tangents[i] is None else tangents[i] for i, p in zip(diff, primals))

        def twin_of(*values):
            return twin(*_with(args, diff, values))

        refuse_forward_over_forward(kernel.name)
        if ctx.quantizing:
            # A quantizing kernel (FP8 data, uint8 scales): its rounding is piecewise constant, so the
            # tangent would silently vanish into it, or survive only through the scale's path, while
            # reverse mode treats quantized linears as straight-through (TransformerEngine's rule).
            raise TransformError(
                f"functe.{kernel.name}: forward-mode derivatives (jvp, jacfwd) through a quantizing kernel are "
                "not supported: an FP8 or block-scaled op is differentiated straight-through in reverse mode only "
                "(use torch.func.vjp / jacrev)"
            )
        out = forward_tangents(twin_of, primals, tans)
        if ctx.out_strides is None:
            return out
        if isinstance(out, tuple):
            return tuple(with_layout(t, s) for t, s in zip(out, ctx.out_strides))
        return with_layout(out, ctx.out_strides[0])

    def vmap(info, in_dims, *args):
        rule = kernel.batch
        if isinstance(rule, FoldMembers):
            return _fold_members(kernel, rule, info.batch_size, in_dims, args)
        if isinstance(rule, PerMember) and 0 < info.batch_size <= rule.max_members:
            members = [
                kernel(*(a if d is None else a.select(d, i) for a, d in zip(args, in_dims)))
                for i in range(info.batch_size)
            ]
            if isinstance(members[0], tuple):
                out = tuple(torch.stack(parts) for parts in zip(*members))
                return out, tuple(0 for _ in out)
            return torch.stack(members), 0
        if isinstance(rule, PerMember):  # (0 members, or more than its cap: as without a rule)
            rule = None
        # (params beyond the passed arguments are defaulted, hence unbatched)
        batched_params = rule is not None and any(d is not None for i, d in enumerate(in_dims) if i in rule.params)
        if isinstance(rule, Members) or (batched_params and rule.members is not None):
            moved = [
                a if i in rule.params and d is None else _to_front(a, d, info.batch_size)
                for i, (a, d) in enumerate(zip(args, in_dims))
            ]
            out = rule.members(*moved)
            return out, tuple(0 for _ in out) if isinstance(out, tuple) else 0
        if rule is None or batched_params:
            out = vmap_call(twin, tuple(in_dims), args)
        else:
            moved = [
                _to_front(a, d, info.batch_size) if i not in rule.params else a
                for i, (a, d) in enumerate(zip(args, in_dims))
            ]
            out = kernel(*moved)
        dims = tuple(0 for _ in out) if isinstance(out, tuple) else 0
        return out, dims

    methods = {
        "forward": staticmethod(forward),
        "setup_context": staticmethod(setup_context),
        "backward": staticmethod(backward),
        "jvp": staticmethod(jvp),
        "vmap": staticmethod(vmap),
    }
    suffix = "kernel" if run is kernel.launch else "twin"
    return type(f"{kernel.name}_{suffix}", (torch.autograd.Function,), methods)


def forward_tangents(fn: Callable, primals: tuple, tangents: tuple) -> Any:
    """The output tangents of ``fn`` at ``primals`` (what a Function's ``jvp`` rule returns).

    Under ``torch.func`` a nested ``torch.func.jvp`` is the right tool. Under plain
    ``torch.autograd.forward_ad`` it is not: a ``dual_level`` cannot nest ("Nested forward mode AD
    is not supported"), and autograd calls ``jvp`` with forward grad mode off. There the primals are
    made dual at the level already open, with forward grad mode on for this computation only, and
    grad mode as autograd left it: a loss that uses the tangent (a Jacobian penalty) is
    differentiated through this computation, as through torch's own forward-mode formulas.
    """
    if not forward_ad_active() or _transforms_active():
        _rule_levels.depth = getattr(_rule_levels, "depth", 0) + 1
        try:
            # (as below: an overlapping primal stays when its tangent has its very layout, so an
            # output that is a view of it gets a view of that tangent; a dense copy's tangent made
            # functorch write it into the overlapping input's, which torch refuses)
            # (an overlap that only a functorch level's tensor shows, a member expanded along the
            # vmapped dimension, is copied whatever the tangent: the dual is made on that level)
            same = [
                p if isinstance(t, Tensor) and p.stride() == t.stride() and not _hidden_overlap(p) else dense(p)
                for p, t in zip(primals, tangents)
            ]
            return torch.func.jvp(fn, tuple(same), tangents)[1]
        finally:
            _rule_levels.depth -= 1
    level = _forward_ad._current_level
    with _forward_ad._set_fwd_grad_enabled(True):
        primals = [_forward_ad.unpack_dual(p, level=level).primal for p in primals]
        # (an overlapping primal, an expanded cotangent, is copied unless its tangent has its very
        # layout: then it stays, and an output that is a view of it gets a view of that tangent)
        primals = [p if p.stride() == t.stride() else dense(p) for p, t in zip(primals, tangents)]
        duals = [_forward_ad.make_dual(p, t, level=level) for p, t in zip(primals, tangents)]
        out = fn(*duals)
        # (unpacked inside: with forward grad mode off a dual reads as having no tangent)
        unpacked = [_forward_ad.unpack_dual(o, level=level) for o in (out if isinstance(out, tuple) else (out,))]
    tans = tuple(torch.zeros_like(u.primal) if u.tangent is None else u.tangent for u in unpacked)
    return tans if isinstance(out, tuple) else tans[0]


# The torch.func.jvp levels functe's own jvp rules open (per thread), not counted as the caller's.
_rule_levels = threading.local()
_formula_twins = threading.local()


@contextlib.contextmanager
def formula_twins():
    """Kernels called inside run their twins' differentiable formulas directly, with no Function.

    For a fused program's backward plan differentiated under ``torch.func`` (second order): there
    the plan runs inside ``torch.func.vjp`` inside the backward of an ``autograd.Function``, and a
    kernel's Function, whose own backward opens ``torch.func.vjp`` again, fails torch 2.13's level
    check (an INTERNAL ASSERT "escaped?"; a plain Function reproduces it). Second derivatives do
    not promise the first-order path's bits.
    """
    previous = getattr(_formula_twins, "on", False)
    _formula_twins.on = True
    try:
        yield
    finally:
        _formula_twins.on = previous


def refuse_forward_over_forward(name: str) -> None:
    """Raise if the caller nested forward-mode transforms (``jvp(jvp(f))``, ``jacfwd(jacfwd(f))``).

    torch 2.13 returns zero for the second-order forward term of every ``autograd.Function`` with a
    ``jvp`` rule (a plain Function computing ``t * cos(x)`` gives ``jvp(jvp(sin)) = 0``): silently
    wrong, so refused. ``jacfwd(jacrev(f))`` and ``torch.func.hessian`` differentiate the backward
    rules in forward mode and are exact.
    """
    if not _transforms_active():
        return
    levels = sum(i.key() == TransformType.Jvp for i in retrieve_all_functorch_interpreters())
    if levels - getattr(_rule_levels, "depth", 0) >= 2:
        raise TransformError(
            f"functe.{name}: forward-over-forward derivatives (jvp of jvp, jacfwd of jacfwd) are not supported: "
            "torch 2.13 gives a custom autograd.Function's second-order forward term as zero; use "
            "jacfwd(jacrev(f)) or torch.func.hessian"
        )


def output_strides(outputs) -> list | None:
    """Each tensor output's strides while a forward-mode level is open (``None`` otherwise): a
    ``jvp`` rule's tangents must take them (see :func:`with_layout`)."""
    if not forward_ad_active():
        return None
    return [o.stride() if isinstance(o, Tensor) else None for o in outputs]


def with_layout(tangent: Tensor, stride) -> Tensor:
    """``tangent`` with its output's strides: autograd asserts that an output which is a view (a
    launcher's ``y.view(x.shape)``) gets a tangent of its own layout, and a tangent computed
    through the twin follows the twin's layout (a transposed input's, say)."""
    if stride is None or tangent.stride() == stride or 0 in stride:
        return tangent
    # (new_empty_strided: under vmap (jacfwd, hessian) the tangent is batched, and an unbatched
    # buffer cannot receive it)
    return tangent.new_empty_strided(tangent.shape, stride).copy_(tangent)


def dense(t: Tensor) -> Tensor:
    """``t``, copied if its elements overlap in memory (an expanded cotangent, e.g. of ``.sum()``),
    as it or any tensor a ``torch.func`` wrapper of it holds: ``torch.func.jvp`` makes dual tensors
    of its primals, which an overlapping tensor cannot be."""
    if _overlaps(t) or _hidden_overlap(t):
        return t.clone(memory_format=torch.contiguous_format)
    return t


def _overlaps(t: Tensor) -> bool:
    return any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape))


def _hidden_overlap(t: Tensor) -> bool:
    """Whether a tensor under ``t``'s ``torch.func`` wrappers overlaps in memory where ``t`` itself
    does not: ``vmap(hessian(f), in_dims=1)`` of a parameter expanded along the vmapped dimension,
    whose physical tensor has stride 0 there (torch: "more than one element of the written-to
    tensor refers to a single memory location")."""
    if _overlaps(t):
        return False
    while _is_wrapped(t):
        t = _unwrapped(t)
        if _overlaps(t):
            return True
    return False


def _fresh(value: Any, args: Sequence[Any]) -> Any:
    if isinstance(value, Tensor) and any(value is a for a in args):
        return value.view_as(value)
    return value


def _fold_members(kernel: Kernel, rule: FoldMembers, outer: int, in_dims: tuple, args: tuple) -> tuple:
    """A :class:`FoldMembers` kernel under an outer ``vmap`` of size ``outer`` (see there)."""
    members = None  # (dimension 0 of a row argument, as the kernel sees it)
    for i, (a, d) in enumerate(zip(args, in_dims)):
        if i not in rule.params and isinstance(a, Tensor):
            members = a.shape[1] if d == 0 else a.shape[0]  # (batched elsewhere: dimension 0 is still the members)
            break
    folded = []
    for i, (a, d) in enumerate(zip(args, in_dims)):
        if not isinstance(a, Tensor) or (i in rule.params and d is None and a.dim() == 1):
            folded.append(a)  # (a number, or a γ shared by every member of every ensemble)
            continue
        front = _to_front(a, d, outer)
        if i in rule.params:  # ([A, N]: one γ per outer member, shared by its members; or [A, M, N])
            if front.dim() == 2:
                front = front[:, None, :].expand(outer, members, front.shape[-1])
            folded.append(front.reshape(outer * members, front.shape[-1]))
        else:
            folded.append(front.reshape(outer * members, *front.shape[2:]))
    out = kernel(*folded)

    def unfold(t: Tensor) -> Tensor:
        return t.reshape(outer, members, *t.shape[1:])

    if isinstance(out, tuple):
        return tuple(unfold(t) for t in out), tuple(0 for _ in out)
    return unfold(out), 0


def _to_front(value: Any, dim: int | None, size: int) -> Any:
    """Move a vmapped dimension to the front; broadcast an unbatched row tensor."""
    if not isinstance(value, Tensor):
        return value
    if dim is None:
        return value.expand(size, *value.shape)
    return value.movedim(dim, 0)


def vmap_call(fn: Callable, in_dims: Any, args: tuple, *, randomness: str = "error") -> Any:
    """``torch.vmap(fn, in_dims=in_dims, out_dims=0, randomness=randomness)(*args)``, also for an
    empty vmapped batch.

    torch 2.13's batching rules fail on some ops over 0 members (``v * s`` with a batched 0-d ``s``
    raises "select(): index 0 out of range"), so a batch of 0 runs one zero-filled member and returns
    its outputs' first 0 rows. Its draws are those torch makes over 0 members: one shared draw with
    ``randomness="same"``, none with ``"different"`` (the member runs under a forked RNG). ``in_dims``
    is an int, ``None`` or nested tuples matching ``args`` (the forms functe passes).
    """
    size = _batch_size(in_dims, args)
    if size != 0:
        return torch.vmap(fn, in_dims=in_dims, out_dims=0, randomness=randomness)(*args)
    padded = _pad_member(in_dims, args)
    if randomness == "different":  # (the member's own draws: torch draws nothing for 0 members)
        devices = sorted({str(t.device) for t in _tensors(args) if t.device.type == "cuda"})
        rng = torch.random.fork_rng(devices=devices, device_type="cuda")
    else:
        rng = contextlib.nullcontext()
    with rng:
        out = torch.vmap(fn, in_dims=in_dims, out_dims=0, randomness=randomness)(*padded)
    return _first_rows(out)


def _batch_size(dims: Any, value: Any) -> int | None:
    if isinstance(dims, tuple):
        sizes = [_batch_size(d, v) for d, v in zip(dims, value)]
        return next((s for s in sizes if s is not None), None)
    if isinstance(dims, int) and isinstance(value, tuple):
        return _batch_size(tuple(dims for _ in value), value)
    return value.shape[dims] if isinstance(dims, int) and isinstance(value, Tensor) else None


def _pad_member(dims: Any, value: Any) -> Any:
    if isinstance(dims, tuple):
        return tuple(_pad_member(d, v) for d, v in zip(dims, value))
    if isinstance(dims, int) and isinstance(value, tuple):
        return tuple(_pad_member(dims, v) for v in value)
    if isinstance(dims, int) and isinstance(value, Tensor):
        shape = list(value.shape)
        shape[dims] = 1
        return value.new_zeros(shape)
    return value


def _first_rows(out: Any) -> Any:
    if isinstance(out, tuple):
        return tuple(_first_rows(o) for o in out)
    return out[:0] if isinstance(out, Tensor) else out


def _tensors(value: Any):
    if isinstance(value, tuple | list):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, Tensor):
        yield value


def _vmap_levels(tensors):
    """``(level, member count)`` of every vmap level each of ``tensors`` is batched at (its own levels
    only)."""
    if torch.compiler.is_compiling() or torch._C._functorch.peek_interpreter_stack() is None:
        return  # (functe refuses compiled transforms, docs/design.md: no vmap when compiling)
    functorch = torch._C._functorch
    for t in tensors:
        while isinstance(t, Tensor) and functorch.is_functorch_wrapped_tensor(t):
            inner = functorch.get_unwrapped(t)
            if functorch.is_batchedtensor(t):
                yield functorch.maybe_get_level(t), inner.shape[functorch.maybe_get_bdim(t)]
            t = inner


def empty_batched(tensors) -> bool:
    """Whether any of ``tensors`` is vmapped over 0 members at some level (a backward rule then runs
    on batched tensors of no members, where torch 2.13's batching rules fail on ``x * s`` with a
    0-d ``s``: see :func:`vmap_call`). Only the tensors' own levels count: an unbatched gradient
    taken inside an empty vmap is a real one."""
    return any(size == 0 for _, size in _vmap_levels(tensors))


def batched(tensors) -> bool:
    """Whether any of ``tensors`` is vmapped at some level."""
    return any(True for _ in _vmap_levels(tensors))


def batched_levels(tensors) -> set[int]:
    """The vmap levels at which any of ``tensors`` is batched."""
    return {level for level, _ in _vmap_levels(tensors)}
