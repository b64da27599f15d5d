"""Tracing a function of tensors to an op list, without computing anything.

``functe.trace(fn)(*args)`` replaces every tensor leaf of the arguments by a
:class:`Tracer`: a tensor subclass with no storage that reports the real
shape, dtype and device (so the public ops' argument checks pass unchanged)
and carries its :class:`~functe._oplist.Var`. Then:

* an op call (:class:`functe.CustomVJP`) that receives a tracer is recorded as
  an equation instead of running: ``CustomVJP.__call__`` consults
  ``functe._vjp._recorder``, which is set only while a trace is active. The
  op's output shapes come from running its forward rule on meta tensors;
* plain tensor arithmetic on tracers is recorded as the matching functe op
  (``x + y`` -> ``add_extra_input``, ``x + b`` with a per-feature ``b`` ->
  ``bias``, ``2.0 * x`` / ``x / 2`` / ``-x`` -> ``constant_scale``, ``x - y``,
  ``x.reshape(...)`` / ``x.view(...)`` -> ``reshape``, ``F.linear`` -> ``linear``);
* metadata queries (``shape``, ``dtype``, ``dim()``, ...) answer normally;
* any other torch call on a tracer raises :class:`~functe.TraceError` naming it.
  A function the user marks with :func:`opaque` becomes an op of its own,
  run as-is and differentiated with ``torch.func.vjp``.

Non-tensor leaves of the arguments are static: they are passed to ``fn``
unchanged and recorded in the op list. Tensors captured from the enclosing
scope become literals (constants); one that requires grad is refused, since
its gradient would be lost.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import re
import threading
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.autograd import forward_ad
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from . import _vjp
from ._autocast import autocast_as, autocast_state, without_autocast
from ._backend import any_tangent, forward_ad_active, use_backend
from ._errors import ArgumentError, FuncteError, RuleError, TraceError, TransformError, check_callable, describe
from ._kernel import batched_levels
from ._oplist import Eqn, Literal, OpList, Var
from ._rng import RandomState
from ._tree import tree_flatten, tree_unflatten, with_contents
from ._vjp import CustomVJP, cell_filled, custom_vjp, run_outside_graph

Tensor = torch.Tensor


class _Trace:
    """The equations recorded by one active trace."""

    def __init__(self, caller_grad: bool = True):
        self.eqns: list[Eqn] = []
        # Whether the caller had grad mode on (the trace itself always runs with it on).
        self.caller_grad = caller_grad
        # The saved-tensor hooks in force when the trace began (a checkpoint around the fused call)
        self.saved_tensor_hooks = _saved_tensor_hooks()
        self.watch: _CapturedWatch | None = None  # (what the function reads from, and made, outside the trace)


def _saved_tensor_hooks():
    return torch._C._autograd._top_saved_tensors_default_hooks(True)


_active: _Trace | None = None

# Tracing state is module-global (the eager path pays one global lookup, not a thread-local one), so
# one thread traces at a time: a second thread's trace, or its meta shape inference, would otherwise
# swap the recorder under the first (traces failed, or recorded into each other). Reentrant: a
# trace runs shape inference inside itself. Eager calls in other threads never wait for it.
TRACE_LOCK = threading.RLock()


_owner: int | None = None  # the thread recording _active


def tracing() -> bool:
    """Whether this thread is recording a trace right now."""
    return _active is not None and _owner == threading.get_ident()


@contextlib.contextmanager
def _recording(trace: _Trace | None):
    global _active, _owner
    with TRACE_LOCK:
        previous = _active, _owner, _vjp._recorder
        _active, _owner = trace, threading.get_ident()
        _vjp._recorder = None if trace is None else _record
        try:
            yield
        finally:
            _active, _owner, _vjp._recorder = previous


class Tracer(Tensor):
    """A shape-only stand-in for a tensor inside a trace (see the module docstring)."""

    @staticmethod
    def __new__(cls, var: Var, trace: _Trace):
        t = Tensor._make_wrapper_subclass(
            cls, var.shape, dtype=var.dtype, device=var.device, requires_grad=var.dtype.is_floating_point
        )
        t._var = var
        t._trace = trace
        return t

    def __init__(self, var: Var, trace: _Trace):
        super().__init__()

    def __repr__(self):
        return f"Tracer({self._var.aval})"

    def __format__(self, spec: str) -> str:
        # (f"{y}" logs as str(y) does: Tensor.__format__ went to __torch_function__ and was refused;
        # a format spec, f"{y:.4f}", reads the value)
        if spec:
            raise _unsupported(Tensor.__format__, (self, spec))
        return repr(self)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        rule = _TRANSLATIONS.get(func) if _active is not None else None
        if rule is None:
            raise _unsupported(func, args, kwargs)
        positional, keywords = _operands_by_position(func, args, kwargs)
        try:
            return rule(*positional, **keywords)
        except FuncteError as e:
            if isinstance(e, TypeError):
                # (torch's operator methods turn a TypeError into NotImplemented: the message would be lost)
                raise TraceError(f"functe.trace: {_func_name(func)}: {e}") from e
            raise
        except (TypeError, ValueError) as e:  # arguments the translation does not take (torch's own kwargs...)
            # (without the translation's own name: "got an unexpected keyword argument 'out'")
            why = re.sub(r"^[\w<>.]+\(\) ", "", str(e))
            raise _unsupported(func, args, kwargs, f" ({why})") from e

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise _unsupported(func, args, kwargs)


class _ShapeOnly(Tensor):
    """A tensor with metadata and no data: stands for an argument when only its signature is known."""

    @staticmethod
    def __new__(cls, shape, dtype: torch.dtype, device: torch.device):
        return Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        raise TraceError(f"functe: {_func_name(func)} on a shape-only tensor (it has no data)")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TraceError(f"functe: {func} on a shape-only tensor (it has no data)")


def shape_only(shape, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A data-less tensor reporting ``shape``, ``dtype`` and ``device`` (for tracing from a signature)."""
    return _ShapeOnly(shape, dtype, device)


def _operands_by_position(func, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """An arithmetic call's operands given by torch's keyword names (``x.add(other=y)``,
    ``torch.add(input=x, other=y)``) moved to their positions, as the translations take them."""
    if func not in _BINARY or not ("input" in kwargs or "other" in kwargs):
        return args, kwargs
    args, kwargs = list(args), dict(kwargs)
    if not args and "input" in kwargs:
        args.append(kwargs.pop("input"))
    if len(args) == 1 and "other" in kwargs:
        args.append(kwargs.pop("other"))
    return tuple(args), kwargs


def _func_name(func) -> str:
    name = torch.overrides.resolve_name(func)
    if name is None:
        name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or str(func)
    return name.removeprefix("torch.") if name.startswith("torch.Tensor.") else name


def _unsupported(func, args, kwargs=None, why: str = "") -> TraceError:
    if any(isinstance(a, Tracer) and _active is None for a in args):
        return TraceError(
            f"functe.trace: a traced value escaped its trace and reached {_func_name(func)} "
            "(do not store tracers outside the traced function)"
        )
    described = ", ".join(
        [*(describe(a) for a in args), *(f"{k}={_shown_kwarg(v)}" for k, v in (kwargs or {}).items())]
    )
    return TraceError(
        f"functe.trace: {_func_name(func)}({described}) on a traced value cannot be recorded in an op list{why}. "
        "Use a functe op (functe.ops), plain arithmetic that maps to one (x + y, 2.0 * x, x.reshape(...)), "
        "or mark the function opaque: functe.opaque(fn) runs it as-is and differentiates it with torch.func"
    )


def _shown_kwarg(value: Any) -> str:
    """A keyword argument in a message: a number, flag or name as itself (``dim=-1``, not ``dim=int``)."""
    if isinstance(value, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return str(value)  # (torch.channels_last, not "memory_format")
    return repr(value) if value is None or isinstance(value, (bool, int, float, str)) else describe(value)


# ----------------------------------------------------------------------------- recording op calls


def _record(op: CustomVJP, args: tuple, static: dict[str, Any]):
    """``CustomVJP.__call__`` during a trace: record an equation if any argument is traced."""
    leaves, in_tree = tree_flatten(args)
    if not any(isinstance(leaf, Tracer) for leaf in leaves):
        return NotImplemented  # constants only: compute now, the result is a constant
    if not torch.is_grad_enabled():
        # (the trace itself runs with grad on: the function turned it off. Unfused, the op's outputs
        # would carry no gradient; an op list has no stop-gradient, so the plan would differentiate it)
        raise TraceError(
            f"functe.{op.name}: called on a traced value with gradients off (torch.no_grad(), "
            "set_grad_enabled(False) or inference_mode() inside the traced function, or "
            "torch.utils.checkpoint with use_reentrant=True, which runs its function so); the op list would "
            "differentiate it. Compute it outside and pass it in as an argument, or wrap that part in "
            "functe.opaque(fn) (a checkpoint: see functe.opaque, or checkpoint around the fused function)"
        )
    trace = _active
    if _saved_tensor_hooks() != trace.saved_tensor_hooks:
        # (torch.utils.checkpoint, save_on_cpu: the plan's one node saves its own residuals, and
        # hooks pushed inside the traced function never see them: the memory was silently not saved)
        raise TraceError(
            f"functe.{op.name}: called on a traced value under saved-tensor hooks pushed inside the traced "
            "function (torch.utils.checkpoint, torch.autograd.graph.save_on_cpu): a traced (fused) program "
            "records its ops, not the hooks, which would never run. Apply them around the fused function "
            "(checkpoint(fused_fn, ...)), or wrap the region in functe.opaque(fn), which keeps only its "
            "arguments and recomputes fn in the backward"
        )
    if getattr(op, "opaque_fn", None) is not None:
        _refuse_captured_tracers(op)
    inputs = [_atom(op.name, leaf, trace) for leaf in leaves]
    device = next(a.device if isinstance(a, Var) else a.value.device for a in inputs if _is_tensor_atom(a))
    out = infer_outputs(op, inputs, static, in_tree)
    out_leaves, out_tree = tree_flatten(out)
    outputs = []
    for leaf in out_leaves:
        if leaf is not None and not isinstance(leaf, Tensor):
            raise TraceError(f"functe.{op.name}: forward outputs must be tensors or None, got {describe(leaf)}")
        outputs.append(None if leaf is None else Var(leaf.shape, leaf.dtype, device))
    trace.eqns.append(Eqn(op, inputs, outputs, static, in_tree=in_tree, out_tree=out_tree))
    return tree_unflatten(out_tree, [None if v is None else Tracer(v, trace) for v in outputs])


def _refuse_captured_tracers(op: CustomVJP) -> None:
    """Raise if an opaque op's function reaches a traced value by name: the equation records the
    op's arguments only, so the plan would run the function on the trace's stand-in (which has no
    data) instead of the value of that call."""
    for v in _named_values(op.opaque_fn):
        if isinstance(v, Tracer):
            raise TraceError(
                f"functe.{op.name}: the function uses a traced value {describe(v)} without taking it as an "
                "argument; an op list records the op's arguments only: pass it as an argument"
            )


def _is_tensor_atom(atom) -> bool:
    return isinstance(atom, Var) or isinstance(atom.value, Tensor)


def _atom(op_name: str, leaf: Any, trace: _Trace):
    if isinstance(leaf, Tracer):
        if leaf._trace is not trace:
            raise TraceError(f"functe.{op_name}: received a traced value from another (finished or outer) trace")
        return leaf._var
    if isinstance(leaf, Tensor):
        constant = _untracked_constant(leaf)
        if constant is None and batched_levels((leaf,)):
            # (a frozen ensemble swapped in by functional_call under vmap lands here: no gradient
            # is involved, so the message below would point the wrong way)
            raise TraceError(
                f"functe.{op_name}: a tensor {describe(leaf)} captured from the enclosing scope is batched by an "
                "enclosing torch.func.vmap, and a traced program captures only constants: pass it to the traced "
                "function as an argument (for an ensemble of modules under vmap, fuse a function that takes the "
                "parameters, or call the unfused module)"
            )
        if constant is None and not trace.caller_grad and _plain_trainable(leaf):
            # An eval pass (no_grad, inference_mode) of a function that captures trainable weights
            # (`fuse(module)`): no gradient can be lost now, and a later call under grad mode refuses
            # the constant then (Plan.check_captured), as a trace under grad mode would.
            constant = leaf
        if constant is None:
            raise _trainable_capture(op_name, leaf)
        return Literal(constant, fresh=trace.watch is not None and trace.watch._made(_unwrapped(constant)))
    return Literal(leaf)


def _trainable_capture(op_name: str, t: Tensor) -> TraceError:
    """The trace's refusal of a captured tensor ``t`` that gradients or a transform see, at
    ``op_name``; it keeps both (``capture``): :func:`functe.fuse` names a module's parameter."""
    error = TraceError(
        f"functe.{op_name}: a tensor {describe(t)} captured from the enclosing scope requires gradients (or "
        "carries a forward-mode tangent, or is being transformed); pass it to the traced function as an "
        "argument, otherwise its gradient would be silently lost"
    )
    error.capture = (op_name, t)
    return error


def _untracked_constant(t: Tensor) -> Tensor | None:
    """``t`` as a plain tensor when no gradient or transform can see it, else ``None``.

    A tensor made inside the traced function under ``torch.func.grad`` (a factory call, an int seed
    turned into a tensor) is a grad-tracking wrapper that requires no gradient: a constant, kept
    unwrapped (the cached plan outlives the transform, and a dead wrapper would fail later). A
    batched (vmap) or gradient-requiring tensor is not a constant.
    """
    f = torch._C._functorch
    while f.is_functorch_wrapped_tensor(t):
        if not f.is_gradtrackingtensor(t) or _differentiated_at(t):
            return None
        t = f.get_unwrapped(t)
    # (a forward-mode dual, too: inside the fused node its tangent would be lost)
    return None if t.requires_grad or any_tangent((t,)) else t


def _plain_trainable(t: Tensor) -> bool:
    """A tensor that requires grad and nothing else: no transform's wrapper, no forward-mode tangent."""
    return t.requires_grad and not torch._C._functorch.is_functorch_wrapped_tensor(t) and not any_tangent((t,))


def _differentiated_at(wrapper: Tensor) -> bool:
    """Whether the torch.func level of a grad-tracking ``wrapper`` differentiates it: a ``grad`` /
    ``vjp`` level makes it require grad, a ``jvp`` level gives it a tangent (and no requires_grad:
    a constant taken from it gave zero tangents)."""
    if wrapper.requires_grad:
        return True
    with forward_ad._set_fwd_grad_enabled(True):
        return forward_ad.unpack_dual(wrapper).tangent is not None


def _meta(atom) -> Any:
    if isinstance(atom, Var):
        return torch.empty(atom.shape, dtype=atom.dtype, device="meta")
    if isinstance(atom.value, Tensor):
        return atom.value.to("meta")
    return atom.value


def _fake(atom) -> Any:
    """Inside a FakeTensorMode: a fake tensor on the var's own device, or the literal's value."""
    if isinstance(atom, Var):
        return torch.empty(atom.shape, dtype=atom.dtype, device=atom.device)
    return atom.value


def _run_forward_rule(op, inputs, params: dict[str, Any], in_tree, *, fake: bool) -> Any:
    """``op``'s forward rule on shape-only stand-ins: meta tensors, or fake ones on the real device.

    The caller's dispatch modes do not see a run on meta tensors: it is the trace's bookkeeping, not
    the program (``FlopCounterMode`` counted every GEMM of a first call twice, ``make_fx`` put the
    meta computation into its graph as dead nodes).
    """
    modes = contextlib.ExitStack()
    if not fake or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is None:
        modes.enter_context(_disable_current_modes())  # (a caller's fake mode is the one fake runs nest in)
    elif torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None:
        modes.enter_context(disable_proxy_modes_tracing())  # (make_fx's fake tracing: not in its graph)
    if fake:
        modes.enter_context(_quiet_fake_tensor_log())
        modes.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
    with _recording(None), use_backend("torch"), torch.no_grad(), modes:
        args = tree_unflatten(in_tree, [(_fake if fake else _meta)(a) for a in inputs])
        # (autocast off, as the plan runs every rule: on fake tensors on the CPU or a GPU the
        # caller's autocast would apply, and the trace recorded a dtype the plan does not compute)
        return without_autocast(op.fwd)(*args, **params)


def forward_on_meta(op, inputs, params: dict[str, Any], in_tree) -> tuple[Any, Any]:
    """Run ``op``'s forward rule on meta tensors standing for ``inputs``; return ``(out, residuals)``.

    Kernels dispatch to their PyTorch twins (which are fake/meta-friendly)
    whatever the backend, and no trace records the nested calls.
    """
    opaque_fn = getattr(op, "opaque_fn", None)
    # (an opaque function that updates captured state would apply the update once per shape run)
    state = (
        contextlib.nullcontext()
        if opaque_fn is None
        else _CapturedState(_named_values(opaque_fn)).undone(op.name, "while a trace infers its output shapes")
    )
    # An opaque function runs on fake tensors on the real device first: it may branch on the device
    # (`if x.device.type == "cpu": x = x.float()`), and on meta tensors the trace recorded the other
    # branch's dtype. A functe op's forward rule runs on meta tensors first (cheaper), and falls back
    # to fake ones, which can mix with a tensor it captured.
    first, second = (True, False) if opaque_fn is not None else (False, True)
    with state:
        try:
            result = _run_forward_rule(op, inputs, params, in_tree, fake=first)
        except FuncteError:
            raise
        except Exception as e:
            try:
                result = _run_forward_rule(op, inputs, params, in_tree, fake=second)
            except FuncteError:
                raise
            except Exception:
                # (a TypeError about the call itself, e.g. a missing keyword, is no data dependence)
                hint = (
                    "does the call pass its static parameters?"
                    if _call_error(e)
                    else f"do its inputs ({', '.join(_atom_shapes(inputs))}) fit together? is it data-dependent?"
                )
                raise TraceError(
                    f"functe.trace: cannot infer the output shapes of {op.name} by running its forward rule on "
                    f"shape-only (meta) tensors; {hint} ({type(e).__name__}: {e})"
                ) from e
    if not (isinstance(result, tuple) and len(result) == 2):
        raise RuleError(f"functe.{op.name}: the forward rule must return (out, residuals), got {describe(result)}")
    return result


def _atom_shapes(inputs) -> list[str]:
    return [a.aval if isinstance(a, Var) else describe(a.value) for a in inputs]


@contextlib.contextmanager
def _quiet_fake_tensor_log():
    """torch's fake-tensor logger off for a shape run expected to fail: it logged ~70 lines of
    traceback ("failed while attempting to run meta") before functe's own error said what failed."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    disabled, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = disabled


def _call_error(error: Exception) -> bool:
    """Whether ``error`` is Python's refusal of a call's arguments (missing, unexpected, too many)."""
    text = str(error)
    return isinstance(error, TypeError) and (
        "argument" in text and ("missing" in text or "unexpected" in text or "takes" in text)
    )


def infer_outputs(op, inputs, params: dict[str, Any], in_tree) -> Any:
    """The output pytree of ``op`` applied to ``inputs``, as meta tensors (see :func:`forward_on_meta`)."""
    return forward_on_meta(op, inputs, params, in_tree)[0]


# ----------------------------------------------------------------------------- trace()


def trace(fn: Callable) -> Callable[..., OpList]:
    """``trace(fn)(*args, **kwargs)`` records ``fn`` as an :class:`~functe._oplist.OpList`.

    Only shapes, dtypes and devices of the tensor arguments are used; nothing
    is computed. Non-tensor leaves of the arguments are static.

    Example:
        >>> import torch, functe
        >>> from functe import ops
        >>> def block(x, w, b):
        ...     return ops.linear(x, w, b) * 0.5 + x
        >>> print(functe.trace(block)(torch.ones(4, 8), torch.ones(8, 8), torch.ones(8)))
        { lambda a:f32[4,8] b:f32[8,8] c:f32[8]. let
            d:f32[4,8] = linear a b c
            e:f32[4,8] = constant_scale[scale=0.5] d
            f:f32[4,8] = add_extra_input e a
          in (f,) }
    """

    check_callable("trace", "fn", fn)

    @functools.wraps(fn)
    def traced(*args, **kwargs) -> OpList:
        return trace_call(fn, args, kwargs)

    return traced


def trace_call(
    fn: Callable,
    args: tuple,
    kwargs: dict,
    sources: dict[int, Tensor] | None = None,
    called: list[torch.nn.Module] | None = None,
    viewed: dict[int, Tensor] | None = None,
) -> OpList:
    """Trace ``fn(*args, **kwargs)`` (see :func:`trace`); ``sources`` collects the captured tensors
    whose values computations folded into constants read (see :class:`_CapturedWatch`), ``called``
    the modules the function called (however it reached them: an argument, a dict, a helper),
    ``viewed`` the captured tensors the program holds views of (``w.t()``: their storages are watched)."""
    leaves, in_tree = tree_flatten((args, kwargs))
    t = _Trace(caller_grad=torch.is_grad_enabled())
    inputs: list[Var] = []
    static: dict[int, Any] = {}
    traced_leaves = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, Tensor):
            v = Var(leaf.shape, leaf.dtype, leaf.device)
            inputs.append(v)
            traced_leaves.append(Tracer(v, t))
        else:
            static[i] = leaf
            traced_leaves.append(leaf)
    targs, tkwargs = tree_unflatten(in_tree, traced_leaves)
    # Under grad mode, so that ops take their differentiable path (no donation).
    # (out of inference mode: a plan traced during an eval pass must serve training calls too)
    watch = t.watch = _CapturedWatch(
        {} if sources is None else sources, _reachable_storages(fn), {} if viewed is None else viewed
    )
    with (
        _refusing_generator_changes(fn, static),  # (outside the watch: its reads are not the function's)
        _recording(t),
        torch.inference_mode(False),
        torch.enable_grad(),
        watch,
        _refusing_module_hooks(called),
        _parametrize_cache_off(),
    ):
        out = fn(*targs, **tkwargs)
    if watch.unwatched and sources is not None:
        _warn_unwatched(fn, list(watch.unwatched.values()))
    out_leaves, out_tree = tree_flatten(out)
    outputs = [_output_atom(leaf, t, watch) for leaf in out_leaves]
    return OpList(inputs, t.eqns, outputs, in_tree=in_tree, out_tree=out_tree, static=static)


class UnwatchedConstantWarning(UserWarning):
    """A fused function folded a computation on a captured inference tensor into a constant."""


def _warn_unwatched(fn: Callable, tensors: list[Tensor]) -> None:
    # (a folded constant over a tensor with a version counter is checked at every call; an inference
    # tensor has none, so a weight synced in place under inference_mode, load_state_dict or copy_,
    # left the plan computing with the old values, silently)
    shown = ", ".join(describe(t) for t in tensors[:3]) + (f" and {len(tensors) - 3} more" if len(tensors) > 3 else "")
    warnings.warn(
        f"functe.fuse({getattr(fn, '__name__', type(fn).__name__)}): a computation folded into a constant reads "
        f"inference tensors ({shown}, made under torch.inference_mode), which have no version counter: an "
        "in-place update of them (load_state_dict, copy_) will not reach the plan, which keeps the old values. "
        "Create them outside inference_mode, or pass them to the fused function as arguments",
        UnwatchedConstantWarning,
        stacklevel=6,  # (the fused function's caller: through trace_call, _new_plan, _lookup, __call__)
    )


class _DrawWatch(TorchDispatchMode):
    """While a trace runs, in its thread: refuse a draw from torch's default generators (an aten op
    tagged ``nondeterministic_seeded`` with no ``generator``) on real tensors."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _active is None or torch.Tag.nondeterministic_seeded not in func.tags or kwargs.get("generator"):
            return func(*args, **kwargs)  # (not recording: a shape run of an opaque op, under a fake mode)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
        if any(t.device.type == "meta" or isinstance(t, FakeTensor) for t in tensors):
            return func(*args, **kwargs)
        # The tag also marks ops that draw only sometimes (dropout_p = 0 attention, rrelu or
        # native_dropout in eval, an RNN): refused only if the op's generator moved. (Another thread
        # drawing during this one op would be taken for it: the window is the op's run.)
        device = next((t.device for t in tensors), kwargs.get("device") or torch.device("cpu"))
        generator = _default_generator(torch.device(device))
        state = generator.get_state() if generator is not None else None
        out = func(*args, **kwargs)
        if state is not None and not torch.equal(generator.get_state(), state):
            raise _draw_error(f"{func} draws from torch's default random generator")
        return out


def _default_generator(device: torch.device) -> torch.Generator | None:
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda" and torch.cuda.is_initialized():
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return None


def _draw_error(what: str) -> TraceError:
    """The refusal of a random draw (or reseed) inside a trace, whichever check saw it."""
    return TraceError(
        f"functe.trace: {what} inside a traced function: it would happen once, at trace time, and every call "
        "would reuse its result. Pass the random tensor as an argument, use a seeded op "
        "(functe.ops.dropout(x, p, seed=...)), or wrap the drawing part in functe.opaque(fn), which draws on "
        "every call"
    )


@contextlib.contextmanager
def _refusing_generator_changes(fn: Callable, static: dict[int, Any]):
    """Refuse random draws in a trace: a draw (or ``torch.manual_seed``) inside a trace happens once,
    at trace time, and the plan reuses its result; unfused, every call draws anew.

    The trace refuses the random functions it knows by name; this catches the rest: a dispatch mode
    (per thread: another thread's draws are its own) sees every aten op that draws from a default
    generator (``torch.dropout``, ``F.dropout2d``, ``nn.init.normal_``, the ``exponential_`` inside
    ``F.gumbel_softmax``), and the states of the ``torch.Generator`` objects the function reaches
    by name or takes as arguments are compared before and after (their ``generator=`` draws), and
    the default CPU generator's seed (a ``torch.manual_seed`` inside, with a seed other than the
    current one: its state is the process's, which other threads' draws move).
    """
    generators = [g for g in _generators(fn, static) if g is not torch.default_generator]
    seed = torch.default_generator.initial_seed()  # (a reseed; draws, this thread's or others', keep it)
    with _disable_current_modes():  # (under a fake mode too: the states are real tensors)
        before = [g.get_state() for g in generators]
    with _DrawWatch():
        yield
    with _disable_current_modes():
        moved = [i for i, (g, state) in enumerate(zip(generators, before)) if not torch.equal(g.get_state(), state)]
    if torch.default_generator.initial_seed() != seed:
        raise _draw_error("the function reseeded torch's default random generator (torch.manual_seed)")
    if moved:
        raise _draw_error("the function moved a torch.Generator it captures or takes as an argument (a draw, a reseed)")


_HOOK_KINDS = {
    "_forward_pre_hooks": "forward pre-hooks",
    "_forward_hooks": "forward hooks",
    "_backward_pre_hooks": "backward pre-hooks",
    "_backward_hooks": "backward hooks",
}
_GLOBAL_HOOKS = {
    "_global_forward_pre_hooks": "global forward pre-hooks",
    "_global_forward_hooks": "global forward hooks",
    "_global_backward_pre_hooks": "global backward pre-hooks",
    "_global_backward_hooks": "global backward hooks",
}


def _user_hooks(hooks) -> list:
    """The hooks of one kind a module has, but those that only derive a parameter from others the
    trace captures (weight_norm's, pruning's: the captured-tensor watch retraces when those change)."""
    if not hooks:
        return []
    from torch.nn.utils.prune import BasePruningMethod
    from torch.nn.utils.weight_norm import WeightNorm

    return [h for h in hooks.values() if not isinstance(h, (WeightNorm, BasePruningMethod))]


@contextlib.contextmanager
def _parametrize_cache_off():
    """While a trace runs: parametrized weights computed from their originals, not read from
    ``parametrize.cached()``'s cache. A cached weight is no read of the original, so the plan never
    watched it (updates to the original went unseen for good), and a weight computed in the trace
    went into the cache as a Tracer that later eager calls met."""
    from torch.nn.utils import parametrize

    # (relative, not saved and restored: the counter is the process's, and another thread's cached()
    # block may open or close during the trace; restored absolutely, it ended at 1 or -1 with no
    # block open and cached every parametrized weight forever)
    enabled = parametrize._cache_enabled
    parametrize._cache_enabled -= enabled
    try:
        yield
    finally:
        parametrize._cache_enabled += enabled


@contextlib.contextmanager
def _refusing_module_hooks(called: list[torch.nn.Module] | None = None):
    """While a trace runs: refuse a module call that has hooks (its own or torch's global ones).

    A traced program calls its modules once, when it is traced: their hooks would run then, on
    traced values, and never on a later call (activation logging silently stopped; a full backward
    hook failed on the Tensor.view_as it records). Hooks belong on a module that calls the fused one.
    """
    from torch.nn.modules import module as nn_module

    # (functe's own checks, a nested or another thread's trace's, are no user hooks)
    existing = {
        name: [h for h in getattr(nn_module, name).values() if not getattr(h, "_functe_check", False)]
        for name in _GLOBAL_HOOKS
    }

    def check(module, args):
        if not tracing():
            return  # (another thread's module call while this one traces)
        if called is not None:
            called.append(module)
        kinds = [label for name, label in _HOOK_KINDS.items() if _user_hooks(getattr(module, name, None))]
        kinds += [label for name, label in _GLOBAL_HOOKS.items() if existing[name]]
        if kinds:
            raise TraceError(
                f"functe.trace: module {type(module).__name__} has {' and '.join(kinds)}: a traced (fused) "
                "program calls its modules once, when it is traced, so the hooks would run only then, on "
                "traced values, and never on later calls. Register them on a module that calls the fused "
                "function, or remove them before fusing"
            )

    check._functe_check = True
    handle = nn_module.register_module_forward_pre_hook(check)
    try:
        yield
    finally:
        handle.remove()


class _CapturedWatch(torch.overrides.TorchFunctionMode):
    """While a trace runs: note the captured tensors whose values a folded computation reads.

    A computation on tensors captured from the enclosing scope (``w.t().contiguous()``,
    ``w.to(torch.bfloat16)``, ``2 * w``) runs once, at trace time, and its result becomes a
    constant of the op list. :func:`functe.fuse` keeps the captured tensors it read (``sources``,
    by weak reference with their version counters and ``requires_grad``) and retraces when one
    changed in place (an optimizer step) or started requiring grad (the retrace then refuses a
    gradient-carrying constant, as any trace does), instead of computing with a stale constant.
    Views (``w.t()``, ``w.data``) share the captured storage and stand for it; results that depend
    on metadata only (``torch.zeros_like(w)``, ``x.to(w)``, ``w.numel()``) and tensors made from
    nothing captured (``torch.ones(3)``) read no captured value. Not seen: updates that bypass
    the version counter (``w.data.mul_()``, ``torch.optim`` with ``fused=True``) and inference
    tensors, which have none.
    """

    def __init__(self, sources: dict[int, Tensor], reachable: set[int] = frozenset(), viewed=None):
        super().__init__()
        self.viewed = {} if viewed is None else viewed  # id -> captured tensor a result is a view of
        self.reachable = reachable  # storages of the tensors the function reaches by name (state it may write)
        self.sources = sources  # id -> captured tensor a folded computation read
        self.made: dict[int, weakref.ref] = {}  # id -> tensor made during the trace (weakly: not kept alive)
        self.captured: dict[int, Tensor] = {}  # storage -> the captured tensor first seen with it
        self.unwatched: dict[int, Tensor] = {}  # storage -> an inference tensor a folded computation read
        self.inference_captured: dict[int, Tensor] = {}  # storage -> the captured inference tensor first seen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _active is not None:  # (refused before they run)
            self._refuse_effects(func, args, kwargs)
        out = func(*args, **kwargs)
        if _active is None or func in _METADATA or func in _NO_VALUE_READ:  # (shape inference, metadata)
            return out
        # (x.to(other), x.expand_as(other), ... read other's metadata only; other.new_tensor(data) reads data)
        if func is T.new_tensor:
            values = args[1:2]
        elif func in _TEMPLATE_ONLY:
            values = args[:1]
        else:
            values = (args[1:], kwargs) if func in _TEMPLATE_FIRST else (args, kwargs)
        tensors = [_unwrapped(t) for t in tree_flatten(values)[0] if isinstance(t, Tensor)]
        if any(isinstance(t, (Tracer, _ShapeOnly)) for t in tensors):
            return out
        read = {}  # storage -> the captured tensor whose values the call reads (a view stands for it)
        unwatched = {}  # (the same for inference tensors: no version counter tells when they change)
        for t in tensors:
            if t.device.type == "meta":
                continue
            storage = storage_of(t)
            # (an inference tensor is kept apart: no version counter, so no source to watch)
            reads, seen = (unwatched, self.inference_captured) if t.is_inference() else (read, self.captured)
            if not self._made(t):
                reads[storage] = seen.setdefault(storage, t)
            elif storage in seen:  # a view of a captured tensor (w.t(), w.data)
                reads[storage] = seen[storage]
        # A result that is a view of a captured tensor (w.t(), table[i]) reads none of that tensor's
        # values: it stays live through the storage. Every other captured argument was read (the
        # index i), and so is everything when the result is not a tensor (x.item(), c[:] = w).
        for r in tree_flatten(out)[0]:
            if isinstance(r, Tensor):
                r = _unwrapped(r)
                if r.device.type != "meta":
                    storage = storage_of(r)
                    base = read.pop(storage, None)
                    if base is not None:
                        self.viewed[id(base)] = base
                    unwatched.pop(storage, None)
                self.made[id(r)] = weakref.ref(r)
        self.sources.update((id(t), t) for t in read.values())
        self.unwatched.update(unwatched)
        return out

    def _refuse_effects(self, func, args: tuple, kwargs: dict) -> None:
        """Random draws and writes into captured tensors would happen once, at trace time."""
        if _draws(func, args, kwargs):
            raise _draw_error(f"{_func_name(func)} draws random numbers")
        targets = [args[0]] if args and isinstance(args[0], Tensor) and _in_place(func) else []
        out = kwargs.get("out")  # (torch.add(step, 1, out=step) writes as step.add_(1) does)
        targets += [t for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, Tensor)]
        for target in targets:
            if not isinstance(target, (Tracer, _ShapeOnly)):
                self._refuse_write(func, _unwrapped(target))

    def _refuse_write(self, func, target: Tensor) -> None:
        # (only tensors the function reaches by name: one it made by means the watch cannot see,
        # torch.from_numpy or copy.deepcopy, is its own to write)
        if target.device.type != "meta" and storage_of(target) in self.reachable:
            raise TraceError(
                f"functe.trace: {_func_name(func)} writes into {describe(target)} captured from the enclosing "
                "scope: inside a traced function the write would happen once, at trace time, not on every "
                "call. Keep state explicit: take the tensor as an argument and return its new value"
            )

    def _made(self, t: Tensor) -> bool:
        ref = self.made.get(id(t))
        return ref is not None and ref() is t


def _in_place(func) -> bool:
    """Whether ``func`` writes into its first argument's values (``Tensor.add_``, ``__setitem__``)."""
    name = getattr(func, "__name__", "")
    return name == "__setitem__" or (name.endswith("_") and not name.endswith("__") and name not in _FLAG_SETTERS)


_FLAG_SETTERS = {"requires_grad_", "share_memory_", "retain_grad_"}


def _draws(func, args: tuple, kwargs: dict) -> bool:
    """Whether the call draws from a random generator the trace cannot replay: not one the function
    passes itself (``generator=``), and not dropout that is off (``training=False`` or ``p=0``)."""
    if func not in _RANDOM or kwargs.get("generator") is not None:
        return False
    if func is torch.nn.functional.dropout:
        p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
        training = kwargs.get("training", args[2] if len(args) > 2 else True)
        return bool(training) and p != 0
    return True


def _reachable_storages(fn: Callable) -> set[int]:
    """Storages of the tensors ``fn`` reaches by name (:func:`_named_values`; a module's parameters and
    buffers): what a write inside a trace would change once only."""
    values = list(_named_values(fn))
    storages = set()
    for v in values:
        tensors = [v] if isinstance(v, Tensor) else []
        if isinstance(v, torch.nn.Module):
            tensors = [*v.parameters(), *v.buffers()]
        storages.update(storage_of(t) for t in tensors if t.device.type != "meta")
    return storages


def _named_values(fn: Callable, arguments: Any = ()) -> list:
    """What a callable reaches by name: a plain function's closure, defaults and the globals its code
    names; a partial's bound arguments; a bound method's object; a module itself (its parameters and
    buffers); another callable object's attributes; and, for the last three, what their function
    (``forward``, ``__call__``) reaches. (Only plain functions were looked at: ``opaque(module)``
    lost the module's gradients and ``fuse(module)`` wrote its buffers once.) The contents of the
    containers among them are included, except the call's own ``arguments`` (see
    :func:`functe._tree.with_contents`)."""
    return with_contents(_reached(fn), arguments)


def _reached(fn: Callable, depth: int = 0) -> list:
    """:func:`_named_values` without the containers' contents."""
    if isinstance(fn, types.FunctionType):
        values = [c.cell_contents for c in fn.__closure__ or () if cell_filled(c)]
        values += list(fn.__defaults__ or ()) + list((fn.__kwdefaults__ or {}).values())
        return values + [fn.__globals__[n] for n in fn.__code__.co_names if n in fn.__globals__]
    if depth > 3 or isinstance(fn, types.BuiltinFunctionType):  # (a chain of wrappers: enough levels)
        return []
    if isinstance(fn, functools.partial):
        return [*fn.args, *fn.keywords.values(), *_reached(fn.func, depth + 1)]
    if isinstance(fn, types.MethodType):
        return [*_object_values(fn.__self__), *_reached(fn.__func__, depth + 1)]
    if isinstance(fn, torch.nn.Module):
        return [fn, *_reached(type(fn).forward, depth + 1)]
    return [*_object_values(fn), *_reached(type(fn).__call__, depth + 1)]


def _object_values(obj: object) -> list:
    """An object a method is bound to, and (unless it is a module) its attributes."""
    if isinstance(obj, torch.nn.Module):
        return [obj]
    return [obj, *getattr(obj, "__dict__", {}).values()]


def _unwrapped(t: Tensor) -> Tensor:
    """The tensor under torch.func's wrappers (a vmap or grad inside the traced function wraps a
    captured tensor outside torch-function dispatch)."""
    f = torch._C._functorch
    while f.is_functorch_wrapped_tensor(t):
        t = f.get_unwrapped(t)
    return t


def storage_of(t: Tensor) -> int:
    """The address of ``t``'s storage (identifies what views share)."""
    try:
        storage = t.untyped_storage()
        if storage.device.type == "meta":
            # (a fake tensor's or a meta tensor's: no data, and asking a fake one for its data
            # pointer warns, soon fails; the storage object is what its views share)
            return storage._cdata
        return storage.data_ptr()
    except (RuntimeError, NotImplementedError):  # (a tensor without storage: treated as its own)
        return -id(t)


def _output_atom(leaf: Any, t: _Trace, watch: _CapturedWatch):
    if isinstance(leaf, Tracer):
        if leaf._trace is not t:
            raise TraceError("functe.trace: the function returned a traced value from another trace")
        return leaf._var
    if leaf is None or isinstance(leaf, Tensor):
        if isinstance(leaf, Tensor) and leaf.requires_grad:
            raise TraceError(
                f"functe.trace: the function returned a captured tensor {describe(leaf)} that requires gradients; "
                "pass it as an argument instead"
            )
        return Literal(leaf, fresh=isinstance(leaf, Tensor) and watch._made(_unwrapped(leaf)))
    raise TraceError(f"functe.trace: outputs must be tensors or None, got {describe(leaf)}")


# ----------------------------------------------------------------------------- opaque functions


# The op of each opaque function, so that every call of ``opaque(fn)`` gives the same op (a rule can
# match it). The ops of a plain function, of a module and of a module's bound method live on the
# function or module, in an attribute: a lambda made anew on every step, or a model made per trial
# of a sweep, then takes its ops with it when it is dropped (the op and its owner form a cycle the
# collector frees); a global table kept every module and its parameters alive. Other callables
# (builtins such as torch.tanh, callable objects, their bound methods) are keyed here: an attribute
# in a user object's __dict__ changed what vars() and an __eq__ over it see.
_OPAQUE: dict[Any, CustomVJP] = {}
_OPAQUE_ATTR = "__functe_opaque_ops__"


class _OpTable:
    """The opaque ops made for one owner, kept in its ``__dict__``. Not copied or pickled with it
    (``copy.deepcopy(model)``, ``torch.save(model)``): a copy makes ops of its own."""

    __slots__ = ("ops", "owner")

    def __init__(self, owner: Any = None):
        self.owner, self.ops = owner, {}

    def __reduce__(self):
        return (_OpTable, ())


def _op_table(fn: Callable, name: str | None) -> tuple[dict, Any]:
    """The table that keeps ``opaque(fn, name=name)``'s op, and its key there."""
    owner, key = fn, name
    if isinstance(fn, types.MethodType):  # (a new bound method object on every attribute access)
        owner, key = fn.__self__, (fn.__func__, name)
    attributes = getattr(owner, "__dict__", None)
    if not isinstance(owner, (types.FunctionType, torch.nn.Module)) or type(attributes) is not dict:
        return _OPAQUE, (fn, name)
    table = attributes.get(_OPAQUE_ATTR)
    if not isinstance(table, _OpTable) or table.owner is not owner:  # (functools.wraps, copy.copy)
        table = attributes[_OPAQUE_ATTR] = _OpTable(owner)
    return table.ops, key


def opaque(fn: Callable, *, name: str | None = None) -> CustomVJP:
    """Make ``fn`` (any function of tensors) an op that a trace records as one equation.

    The op runs ``fn`` as-is; its backward rule differentiates ``fn`` with
    ``torch.func.vjp`` (recomputing the forward from the random number
    generators' states the forward started from, so a random ``fn`` such as
    dropout is differentiated at the draw it made). Keyword arguments of a call
    are static. Calling the same ``fn`` twice gives the same op.

    Example:
        >>> import torch, functe
        >>> tanh = functe.opaque(torch.tanh)
        >>> print(functe.trace(lambda x: tanh(x) * 2.0)(torch.ones(3)))
        { lambda a:f32[3]. let
            b:f32[3] = opaque_tanh a
            c:f32[3] = constant_scale[scale=2.0] b
          in (c,) }
        >>> torch.func.grad(lambda x: tanh(x).sum())(torch.zeros(2)).tolist()
        [1.0, 1.0]
    """
    if not callable(fn):
        raise ArgumentError(f"functe.opaque: argument 'fn' expected a function, got {describe(fn)}")
    table, key = _op_table(fn, name)
    op = table.get(key)
    if op is None:
        op = table[key] = new_opaque_op(fn, name)
    return op


def new_opaque_op(fn: Callable, name: str | None) -> CustomVJP:
    """The op :func:`opaque` makes for ``fn``, not memoised (a deep copy's own op: see
    ``CustomVJP.__deepcopy__``)."""
    label = name or f"opaque_{getattr(fn, '__name__', type(fn).__name__)}"

    def fwd(*args, **static):
        if torch.compiler.is_dynamo_compiling():  # (in a fused program's forward: see _vjp.run_outside_graph)
            return run_outside_graph(eager_fwd, args, static)
        return eager_fwd(*args, **static)

    def eager_fwd(*args, **static):
        if forward_ad_active():
            _refuse_captured_tangents(fn, label, args)
        # (before fn draws: the backward replays the same draws, also from generators it reaches;
        # looked up per call, ~15 us: a name rebound to a new generator each epoch is found)
        rng = RandomState(args, _generators(fn, static))
        versions = [_version(a) for a in args]
        out = fn(*args, **static)
        _refuse_written_arguments(label, args, versions)
        # (and under the forward's autocast: the backward may run outside it)
        return out, (args, rng, autocast_state())

    def bwd(res, ct, **static):
        args, rng, amp = res
        reached = _named_values(fn, args)  # (one walk for both: the check and the state kept)
        _refuse_grads_in(reached, label)
        recompute = _CapturedState(reached).undone(label, "while the backward recomputes it")
        with rng.restored(), autocast_as(amp), recompute:
            try:
                return vjp_call(fn, args, ct, **static)
            except RuntimeError as e:
                if "use_reentrant=True" not in str(e):
                    raise
                # (torch's words name .grad(), which the caller never called: the op's backward did)
                raise TraceError(
                    f"functe.{label}: the function runs torch.utils.checkpoint with use_reentrant=True, which "
                    "cannot run inside the opaque op's backward (it differentiates the function with "
                    "torch.autograd.grad). An opaque op already keeps only its arguments and recomputes the "
                    "function in its backward, as a checkpoint does: drop the checkpoint, or pass "
                    "use_reentrant=False"
                ) from e

    op = custom_vjp(label, fwd, bwd, keep_autocast=True)
    op.eager_under_compile = True  # (see _vjp.run_outside_graph)
    op.opaque_fn = fn  # (a trace refuses a traced value it reaches by name: see _record)
    op.opaque_name = name  # (a pickled op loads as opaque(fn, name=name): see CustomVJP.__reduce__)
    # (functe.fuse checks the function's captured state per call: see Plan.check_captured)
    op.opaque_check = functools.partial(_refuse_captured_grads, fn, label)
    # (before the op's Function: inside its forward a torch.func wrapper shows no tangent)
    op.precheck = functools.partial(_refuse_captured_transformed, fn, label)
    return op


def _generators(fn: Callable, static: dict) -> tuple[torch.Generator, ...]:
    """The ``torch.Generator`` objects ``fn`` reaches by name or takes as a static argument (the
    values of ``static``), each once."""
    found = [v for v in (*_named_values(fn), *static.values()) if isinstance(v, torch.Generator)]
    return tuple({id(g): g for g in found}.values())


class _CapturedState:
    """The tensors a function reaches by name that a run may update: module buffers and captured
    tensors that are not parameters.

    An opaque function runs more than once per call of its op: again in the backward (its graph is
    recomputed) and, in a trace, on meta or fake tensors to infer shapes. A function that updates
    captured state (BatchNorm's running statistics and batch count) did so at every run: two updates
    per training step, and two more from a trace that computed nothing. The forward's own update is
    the call's; :meth:`undone` takes back the other runs'. (BatchNorm's running statistics are
    written without a version bump, so values are compared as well as version counters.)
    """

    __slots__ = ("tensors",)

    def __init__(self, reached: list):
        """``reached``: what the function reaches by name (:func:`_named_values`)."""
        tensors = []
        for v in reached:
            if isinstance(v, torch.nn.Module):
                tensors += v.buffers()
            elif isinstance(v, Tensor) and not isinstance(v, torch.nn.Parameter):
                tensors.append(v)
        # (not a transform's wrapper: a value of the call, not state; nor meta or inference tensors)
        wrapped = torch._C._functorch.is_functorch_wrapped_tensor
        self.tensors = [t for t in tensors if not wrapped(t) and t.device.type != "meta" and not t.is_inference()]

    @contextlib.contextmanager
    def undone(self, label: str, during: str, limit: int = 1 << 16):
        """Run a block and undo what it writes into these tensors (each of up to ``limit`` elements
        is copied first; a larger one that the block writes is refused), also when it raises."""
        # (outside any trace's recording: the copies and the comparison are not the function's reads,
        # which would make the state a folded constant's source, and the restore is not its write)
        with _recording(None):
            saved = [(t, t._version, t.clone() if t.numel() <= limit else None) for t in self.tensors]
        try:
            yield
        except BaseException:
            self._restore(saved, label, during, refuse=False)
            raise
        self._restore(saved, label, during, refuse=True)

    @staticmethod
    def _restore(saved: list, label: str, during: str, refuse: bool) -> None:
        with _recording(None), torch.no_grad():
            for t, version, old in saved:
                if old is None:
                    if refuse and t._version != version:
                        raise TraceError(
                            f"functe.{label}: the function writes into {describe(t)}, which it reaches by "
                            f"name, {during}: the write would be applied an extra time; pass the tensor as "
                            "an argument and return its new value"
                        )
                elif t._version != version or not torch.equal(t, old):
                    t.copy_(old)


def _version(a) -> int | None:
    """The version counter of the tensor under ``a``'s ``torch.func`` wrappers (a write through a
    vmap wrapper bumps the batched tensor's, not the wrapper's); ``None`` for a non-tensor and an
    inference tensor (which has no version counter)."""
    if not isinstance(a, Tensor):
        return None
    a = _unwrapped(a)
    return None if a.is_inference() else a._version


def _refuse_written_arguments(label: str, args: tuple, versions: list) -> None:
    """Raise if ``fn`` wrote into one of its arguments in place (``nn.SiLU(inplace=True)``), also
    when nothing is differentiated: functe's ops are pure (a fused plan may share or reorder the
    values it is given), and the backward recomputes ``fn`` from the arguments, which no longer
    hold the forward's inputs; an op that saved one for its own backward would differentiate the
    written values (a fused plan saves residuals after the whole forward, so autograd's version
    check could not see it: silently wrong weight gradients). Writes into captured state (a
    BatchNorm's running statistics) are not arguments and stay allowed."""
    for i, (a, before) in enumerate(zip(args, versions)):
        if before is not None and _version(a) != before:
            raise ArgumentError(
                f"functe.{label}: the function wrote into its argument {i} ({describe(a)}) in place; an "
                "opaque function must leave its arguments unchanged (its backward recomputes it from them): "
                "compute out of place (e.g. nn.SiLU() instead of nn.SiLU(inplace=True))"
            )


def _refuse_captured_grads(fn: Callable, label: str, arguments: Any = ()) -> None:
    """Raise if ``fn`` uses a tensor (or a module's parameter) that requires grad without taking it as
    an argument: the opaque op differentiates its arguments only, so that gradient would be lost.

    Looks at what ``fn`` reaches by name (:func:`_named_values`, containers opened, the call's
    ``arguments`` left out), at backward time.
    """
    _refuse_grads_in(_named_values(fn, arguments), label)


def _refuse_grads_in(reached: list, label: str) -> None:
    """:func:`_refuse_captured_grads` on what the function reaches, already listed."""
    for v in reached:
        if (isinstance(v, Tensor) and v.requires_grad) or (
            isinstance(v, torch.nn.Module) and any(p.requires_grad for p in v.parameters())
        ):
            raise ArgumentError(
                f"functe.{label}: the function uses {describe(v) if isinstance(v, Tensor) else type(v).__name__} "
                "that requires grad without taking it as an argument; the opaque op differentiates its "
                "arguments only, so that gradient would be lost: pass it as an argument"
            )


def _refuse_captured_tangents(fn: Callable, label: str, arguments: Any = ()) -> None:
    """Raise if ``fn`` reaches by name a tensor with a forward-mode tangent: when the op runs as an
    autograd node whose arguments carry none, autograd never calls its ``jvp`` rule, and that
    tangent would be lost. (Read with forward grad mode on: inside a Function's forward it is off,
    and every dual reads as plain.)"""
    with forward_ad._set_fwd_grad_enabled(True):
        for v in _named_values(fn, arguments):
            if isinstance(v, Tensor) and any_tangent((v,)):
                raise ArgumentError(
                    f"functe.{label}: the function uses {describe(v)}, which carries a forward-mode tangent, "
                    "without taking it as an argument; the opaque op's jvp rule sees its arguments only, so "
                    "that tangent would be lost: pass it as an argument"
                )


def _refuse_captured_transformed(fn: Callable, label: str, leaves: list) -> None:
    """Raise if ``fn`` reaches by name a tensor (or a module's parameter) that a ``torch.func`` level
    differentiates (a ``grad``/``vjp`` wrapper requiring grad, a ``jvp`` wrapper with a tangent).
    Checked in the forward: when none of the op's own arguments is differentiated the op is no
    autograd node, its backward never runs, and the gradient or tangent came out zero. A tensor an
    enclosing ``vmap`` batches is refused too when that vmap level batches none of the op's
    arguments (``leaves``): functorch failed on it ("escaped") when no argument was batched, and
    paired the wrong members when only another level batched them (``vmap(lambda c: vmap(lambda
    x: op(x))(xs))(cs)`` gave ``xs[j] * cs[j]`` for every ``i``); with an argument batched at its
    level the vmap rule runs ``fn`` on it correctly."""
    f = torch._C._functorch
    argument_levels = None  # (the vmap levels batching an argument: computed on the first wrapped capture)
    for v in _named_values(fn, leaves):
        tensors = list(v.parameters()) if isinstance(v, torch.nn.Module) else [v] if isinstance(v, Tensor) else []
        for t in tensors:
            w, top = t, 0
            while f.is_functorch_wrapped_tensor(w):
                top = max(top, f.maybe_get_level(w))
                if argument_levels is None:
                    argument_levels = batched_levels(leaves)
                if f.is_batchedtensor(w):
                    if f.maybe_get_level(w) not in argument_levels:
                        raise TransformError(
                            f"functe.{label}: the function uses {describe(t)}, which an enclosing torch.func.vmap "
                            "batches, without taking it as an argument, and that vmap batches none of its "
                            "arguments: pass it as an argument"
                        )
                elif f.is_gradtrackingtensor(w) and _differentiated_at(w):
                    raise ArgumentError(
                        f"functe.{label}: the function uses {describe(t)}, which a torch.func transform "
                        "differentiates, without taking it as an argument; the opaque op differentiates its "
                        "arguments only, so that derivative would be lost: pass it as an argument"
                    )
                w = f.get_unwrapped(w)
            if top and argument_levels and top >= _lowest_differentiating_level():
                raise TransformError(
                    f"functe.{label}: the function uses {describe(t)}, which a torch.func grad/jvp level (or a "
                    "vmap inside one) wraps, without taking it as an argument; the op's vmap rule runs the "
                    "function below that level, where torch cannot unwrap it (an INTERNAL ASSERT): pass it "
                    "as an argument"
                )


def _lowest_differentiating_level() -> float:
    """The level of the outermost ``torch.func`` transform that is not a ``vmap`` (inf if none).

    The op's vmap rule runs its function below every level its arguments are batched at, and
    below every grad/jvp level: functorch then fails (an INTERNAL ASSERT, measured in torch 2.13)
    on a captured tensor wrapped at such a level or above one; a capture wrapped only by ``vmap``
    levels under all of them works."""
    vmap = torch._C._functorch.TransformType.Vmap
    levels = [i.level() for i in retrieve_all_functorch_interpreters() if i.key() != vmap]
    return min(levels, default=math.inf)


def vjp_call(fn: Callable, args: tuple, ct: Any, **static) -> tuple:
    """The cotangents of ``fn(*args, **static)``'s positional arguments for output cotangent ``ct``.

    One entry per argument, each a pytree like it (``None`` for leaves that
    are not floating-point or complex tensors or get no gradient). Outputs that are
    ``None``, neither floating-point nor complex, or have a ``None`` cotangent are skipped.
    Inside a transform or under grad mode (higher order) it uses
    ``torch.func.vjp``; a first-order eager backward takes the cheaper
    ``torch.autograd.grad`` route.
    """
    leaves, tree = tree_flatten(args)
    diff = [i for i, leaf in enumerate(leaves) if _is_float(leaf)]
    ct_leaves = tree_flatten(ct)[0]
    taken: list[int] = []

    def f(*xs):
        full = list(leaves)
        for i, x in zip(diff, xs):
            full[i] = x
        outs = tree_flatten(fn(*tree_unflatten(tree, full), **static))[0]
        taken[:] = [j for j, (o, c) in enumerate(zip(outs, ct_leaves)) if c is not None and _is_float(o)]
        return tuple(outs[j] for j in taken)

    tensors = [t for t in (*ct_leaves, *leaves) if isinstance(t, Tensor)]
    if torch.is_grad_enabled() or any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors):
        _, pull = torch.func.vjp(f, *(leaves[i] for i in diff))
        grads = pull(tuple(ct_leaves[j] for j in taken))
    else:
        # A first-order eager backward: plain autograd is several times cheaper than torch.func.vjp.
        with torch.enable_grad():
            xs = [leaves[i].detach().requires_grad_() for i in diff]
            outs = f(*xs)
            pairs = [(o, ct_leaves[j]) for o, j in zip(outs, taken) if o.requires_grad]
            grads = (
                torch.autograd.grad([o for o, _ in pairs], xs, [c for _, c in pairs], allow_unused=True)
                if pairs and xs
                else [None] * len(xs)
            )
    flat: list = [None] * len(leaves)
    for i, g in zip(diff, grads):
        flat[i] = g
    return tuple(tree_unflatten(tree, flat))


def _is_float(value) -> bool:
    """A tensor that can carry a gradient: floating point or complex (a complex output's cotangent
    was dropped, its gradient silently missing; a complex input got none)."""
    return isinstance(value, Tensor) and (value.is_floating_point() or value.is_complex())


# ----------------------------------------------------------------------------- arithmetic on tracers


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _ops():
    from . import ops  # imported lazily: functe.ops imports this package's core

    return ops


def _integer_arithmetic(sign: str, a, b) -> None:
    """Refuse arithmetic on a traced integer tensor (a seed) with a way out: functe's arithmetic ops
    are float ops."""
    if any(isinstance(v, Tensor) and not v.is_floating_point() for v in (a, b)):
        raise TraceError(
            f"functe.trace: {describe(a)} {sign} {describe(b)}: arithmetic on an integer tensor (a seed) is not "
            "recorded; derive seeds outside the traced function and pass them in, or use an opaque op, e.g. "
            "functe.opaque(lambda seed, k: seed + k)(seed, 1)"
        )


def _add(a, b):
    """``a + b`` as add_extra_input (same shapes) or bias (``b`` one value per feature of ``a``)."""
    _integer_arithmetic("+", a, b)
    ops = _ops()
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        # (autocast does not cast torch's +, so neither do its ops here: mixed dtypes are refused)
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            if a.shape == b.shape:
                return ops.add_extra_input(a, b)
            if b.dim() == 1 and a.dim() >= 1 and b.shape[0] == a.shape[-1]:
                return ops.bias(a, b)
            if a.dim() == 1 and b.dim() >= 1 and a.shape[0] == b.shape[-1]:
                return ops.bias(b, a)
    raise TraceError(
        f"functe.trace: {describe(a)} + {describe(b)} has no functe op: functe records x + y for equal shapes "
        "(add_extra_input) and x + b for a per-feature b (bias); use functe.opaque for anything else"
    )


def _torch_add(a, b, *, alpha=1):
    _check_alpha(alpha)
    if alpha != 1 and isinstance(b, Tensor):  # (else _add names the operands the caller wrote)
        b = _scale(b, alpha)
    return _add(a, b)


def _check_alpha(alpha) -> None:
    if isinstance(alpha, bool):  # (torch refuses it for a float result; as a scale it would be 1 or 0)
        raise TraceError(f"functe.trace: alpha={alpha!r}: a boolean alpha is only supported for boolean results")


def _bool_as_float(value):
    """A Python bool as the number torch promotes it to against a float tensor (``x * True`` is
    ``x * 1.0``); anything else as it is."""
    return float(value) if isinstance(value, bool) else value


def _scale(x, s):
    s = _bool_as_float(s)
    _integer_arithmetic("*", x, s)
    if not (isinstance(x, Tensor) and _is_number(s)):
        raise TraceError(
            f"functe.trace: {describe(x)} * {describe(s)} has no functe op: functe records the product of a "
            "traced value and a Python number (constant_scale); use functe.opaque for anything else"
        )
    return _ops().constant_scale(x, s)


def _mul(a, b):
    return _scale(b, a) if _is_number(_bool_as_float(a)) else _scale(a, b)


def _div(a, b, *, rounding_mode=None):
    if rounding_mode is not None:  # (named with the call by __torch_function__)
        raise TypeError(f"rounding_mode={rounding_mode!r}: only true division is recorded")
    b = _bool_as_float(b)
    if not _is_number(b):
        raise TraceError(f"functe.trace: {describe(a)} / {describe(b)}: only division by a Python number is recorded")
    # x / ±0 is x · ±inf elementwise (±inf, or NaN for x = 0), as torch computes it
    inverse = 1.0 / b if b else math.copysign(math.inf, b)
    # (1/c must be a normal number where the scale is applied: for a tiny c it overflows to inf, for a
    # huge c it is subnormal and loses bits; and so must c, which torch rounds to x's dtype before
    # dividing: either way the result would leave the documented 2 ulps of torch's division)
    limits = torch.finfo(torch.float64 if isinstance(a, Tensor) and a.dtype == torch.float64 else torch.float32)
    normal = lambda v: limits.tiny <= abs(v) <= limits.max
    if b and math.isfinite(b) and not (normal(b) and normal(inverse)):
        raise TraceError(
            f"functe.trace: {describe(a)} / {b!r}: {b!r} or 1/{b!r} is not a normal {limits.dtype} number, so "
            f"x / c cannot be recorded as x * (1/c) within 2 ulps; use functe.opaque(lambda x: x / {b!r})"
        )
    return _scale(a, inverse)


def _sub(a, b, *, alpha=1):
    _check_alpha(alpha)
    _check_subtraction(a, b)
    return _add(a, _scale(b, -float(alpha)))


def _rsub(a, b):  # b - a
    _check_subtraction(b, a)
    return _add(b, _scale(a, -1.0))


def _check_subtraction(a, b) -> None:
    _integer_arithmetic("-", a, b)
    # (else x - 2 fails inside its own rewrite, as "int * float")
    if not (isinstance(a, Tensor) and isinstance(b, Tensor)):
        raise TraceError(
            f"functe.trace: {describe(a)} - {describe(b)} has no functe op: functe records x - y for equal "
            "shapes (add_extra_input) and x - b for a per-feature b (bias); use functe.opaque for anything else"
        )


def _reshape(x, *shape, **keyword):
    if keyword and not shape and set(keyword) == {"shape"}:  # (x.reshape(shape=...), torch's keyword)
        shape = (keyword["shape"],)
    elif keyword:
        raise TypeError(f"reshape() got unexpected keyword arguments {sorted(keyword)}")
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    return _ops().reshape(x, shape)


def _torch_reshape(x, shape):
    return _ops().reshape(x, shape)


def _linear(input, weight, bias=None):  # (torch's parameter names: F.linear(input=x, weight=w) is valid)
    return _ops().linear(input, weight, bias)


def _same(x):
    return x


def _contiguous(x, memory_format=torch.contiguous_format):
    """``x.contiguous()``: a traced value is contiguous (see docs/fusion.md), so it records nothing;
    another memory format would change the layout, which an op list does not track."""
    if memory_format not in (torch.contiguous_format, torch.preserve_format):
        raise _unsupported(Tensor.contiguous, (x,), {"memory_format": memory_format}, " (only the contiguous format)")
    return x


def _cast_method(dtype: torch.dtype) -> Callable:
    """``x.float()`` and its kind: ``x.to(dtype)``; the default memory format keeps the layout."""

    def cast(x, memory_format=torch.preserve_format):
        if memory_format is not torch.preserve_format:
            raise _unsupported(Tensor.to, (x, dtype), {"memory_format": memory_format}, " (only preserve_format)")
        return _to(x, dtype)

    return cast


def _dropout_off(input, p=0.5, training=True, inplace=False):
    """``F.dropout`` that is the identity (``nn.Dropout`` in eval mode, ``p = 0``); one that drops is
    refused (its draw would happen once, at trace time: functe.ops.dropout takes a seed)."""
    if p < 0 or p > 1:  # (torch's check, before anything else)
        raise TraceError(f"functe.trace: F.dropout: dropout probability has to be between 0 and 1, but got {p}")
    if training and p != 0:
        raise TypeError("dropout in training draws random numbers: use functe.ops.dropout(x, p, seed=...)")
    return input


def _to(x, *args, **kwargs):
    # No-op conversions and floating-point dtype changes (the cast op) are recorded: a device
    # change has no op. (x.to(other) takes other's dtype and device.)
    target = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor):
            target += [a.dtype, a.device]
        elif isinstance(a, torch.dtype):
            target.append(a)
        elif isinstance(a, (torch.device, str)):
            device = torch.device(a)  # (the CPU is one device: "cpu:0" is x's "cpu")
            target.append(x.device if device.type == x.device.type == "cpu" else device)
        elif isinstance(a, int) and not isinstance(a, bool):
            target.append(a)  # (an accelerator's ordinal: never a no-op, and never equal to a dtype or device)
    # (positionally, to(dtype, non_blocking, copy): the second bool is copy)
    flags = [a for a in args if isinstance(a, bool)]
    copy = kwargs.get("copy", False) or (len(flags) > 1 and flags[1])
    dtypes = [t for t in target if isinstance(t, torch.dtype) and t != x.dtype]
    if not copy and all(t in (x.dtype, x.device, *dtypes) for t in target):  # (no device change)
        if not dtypes:
            return x
        if len(dtypes) == 1 and x.dtype in _FLOATS and dtypes[0] in _FLOATS:  # (a float dtype change)
            return _ops()._cast.cast(x, dtype=dtypes[0])
    named = lambda a: torch.device(a) if isinstance(a, str) else a  # (the message shows the device)
    why = " (copy=True makes a copy)" if copy else ""
    raise _unsupported(Tensor.to, (x, *map(named, args)), {k: named(v) for k, v in kwargs.items()}, why)


_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)

T = Tensor
_TRANSLATIONS: dict[Any, Callable] = {
    T.__add__: _add,
    T.__radd__: lambda a, b: _add(b, a),
    T.add: _torch_add,
    torch.add: _torch_add,
    T.__sub__: _sub,
    T.__rsub__: _rsub,
    T.sub: _sub,
    torch.sub: _sub,
    T.__mul__: _mul,
    T.__rmul__: _mul,
    T.mul: _mul,
    torch.mul: _mul,
    T.__truediv__: _div,
    T.div: _div,
    torch.div: _div,
    T.__neg__: lambda x: _scale(x, -1.0),
    T.neg: lambda x: _scale(x, -1.0),
    torch.neg: lambda x: _scale(x, -1.0),
    T.__pos__: _same,
    T.reshape: _reshape,
    T.view: _reshape,
    torch.reshape: _torch_reshape,
    torch.nn.functional.linear: _linear,
    T.contiguous: _contiguous,
    torch.nn.functional.dropout: _dropout_off,
    T.to: _to,
    T.float: _cast_method(torch.float32),
    T.half: _cast_method(torch.float16),
    T.bfloat16: _cast_method(torch.bfloat16),
    T.double: _cast_method(torch.float64),
    T.type_as: lambda x, other: _to(x, other.dtype),
}

# The arithmetic whose operands torch also takes by keyword (input=, other=; see _operands_by_position)
_BINARY = {T.add, torch.add, T.sub, torch.sub, T.mul, torch.mul, T.div, torch.div}

# Queries that read metadata only: answered by the wrapper tensor itself.
_METADATA = {
    T.shape.__get__,
    T.dtype.__get__,
    T.device.__get__,
    T.ndim.__get__,
    T.requires_grad.__get__,
    T.is_cuda.__get__,
    T.is_meta.__get__,
    T.layout.__get__,
    T.dim,
    T.size,
    T.numel,
    T.stride,
    T.is_contiguous,
    T.is_floating_point,
    T.is_complex,
    T.element_size,
    T.__len__,
    T.__hash__,
    T.get_device,
    T.is_inference,
    T.storage_offset,
    T.is_leaf.__get__,
    T._version.__get__,
    T.is_sparse.__get__,
    T.is_quantized.__get__,
    T.is_cpu.__get__,
    T.is_xpu.__get__,
    T.is_mps.__get__,
    T.is_xla.__get__,
    T.is_ipu.__get__,
    T.is_maia.__get__,
    T.is_mtia.__get__,
    T.is_vulkan.__get__,
    T.is_mkldnn.__get__,
    T.is_nested.__get__,
    T.is_sparse_csr.__get__,
    T.itemsize.__get__,
    T.nbytes.__get__,
    T.is_signed,
    T.is_conj,
    T.is_neg,
    T.ndimension,
    T.nelement,
    torch.numel,
    torch.is_floating_point,
    torch.is_complex,
}

# Calls that read a tensor's metadata only (the trace's folded-constant watch skips them), and
# those whose first argument is the only value read (the others are templates).
_TEMPLATE_ONLY = {T.to, T.type_as, T.expand_as, T.view_as, T.reshape_as}
_NO_VALUE_READ = {
    T.is_cpu.__get__,
    T.nbytes.__get__,
    T.itemsize.__get__,
    T.is_leaf.__get__,
    T.storage_offset,
    torch.numel,
}
# Their first argument is a template (shape, dtype, device); any other tensor is a value read
# (torch.full_like(base, s) reads s).
_TEMPLATE_FIRST = {
    torch.zeros_like,
    torch.ones_like,
    torch.empty_like,
    torch.full_like,
    T.new_zeros,
    T.new_ones,
    T.new_empty,
    T.new_full,
}
# Random draws: inside a traced function they would run once, at trace time, and every call would
# reuse that draw (explicit randomness is a seed argument: ops.dropout(x, p, seed=...)).
_RANDOM = {
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
    torch.normal,
    torch.bernoulli,
    torch.multinomial,
    torch.poisson,
    torch.rand_like,
    torch.randn_like,
    torch.randint_like,
    torch.nn.functional.dropout,
    T.uniform_,
    T.normal_,
    T.bernoulli_,
    T.random_,
    T.exponential_,
    T.geometric_,
    T.log_normal_,
    T.cauchy_,
}
