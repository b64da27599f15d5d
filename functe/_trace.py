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

Modules: the arithmetic translations and the tables of torch calls live in
:mod:`functe._trace_arith`, opaque functions in :mod:`functe._opaque`, and what a function reaches
by name in :mod:`functe._reach`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from . import _vjp
from ._autocast import without_autocast
from ._backend import any_tangent, use_backend
from ._errors import FuncteError, RuleError, TraceError, check_callable, describe
from ._kernel import batched_levels
from ._opaque import _CapturedState, _differentiated_at, _generators
from ._opaque import _OpTable as _OpTable  # (pickles made before the split name it here)
from ._oplist import Eqn, Literal, OpList, Var
from ._reach import _named_values, _reachable_storages, _unwrapped, storage_of
from ._trace_arith import (
    _BINARY,
    _METADATA,
    _NO_VALUE_READ,
    _RANDOM,
    _TEMPLATE_FIRST,
    _TEMPLATE_ONLY,
    _TRANSLATIONS,
    Unrecordable,
)
from ._tree import tree_flatten, tree_unflatten
from ._vjp import CustomVJP

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
        except Unrecordable as refusal:
            raise _unsupported(*refusal.args) from None
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
        if func is Tensor.new_tensor:
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
