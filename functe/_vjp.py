"""``custom_vjp``: define an op by a forward rule and a backward rule, JAX style.

This is the one mechanism every functe op is built on. An op is

* a **forward rule** ``fwd(*args, **static) -> (out, residuals)``: ``args`` are
  pytrees of tensors (``None`` allowed), ``static`` are keyword-only, hashable,
  non-differentiable values (a dtype, an eps, an activation name); ``out`` and
  ``residuals`` are pytrees;
* a **backward rule** ``bwd(residuals, cotangent, **static) -> tuple``: one
  cotangent per positional argument, each a pytree matching that argument, with
  ``None`` meaning zero.

:class:`CustomVJP` turns the pair into an ``autograd.Function`` in the split
style (``forward`` without ctx, plus ``setup_context``), which is the only style
``torch.func`` accepts. The design answers the traps measured in
``docs/design.md``:

* **Pytrees are flattened** to positional tensors before ``apply``: a tensor
  hidden inside a dict would otherwise silently get a zero gradient.
* **Residuals are saved by origin.** A residual that *is* an input or an output
  is saved as that input or output, so autograd can differentiate through it
  and second derivatives are exact. Any other residual (an intermediate result)
  is returned from ``forward`` as a non-differentiable extra output. Its
  dependence on the inputs is invisible to autograd, so when a backward pass
  with such residuals is itself being differentiated, the cotangents pass
  through a guard that raises :class:`~functe.TransformError` naming the op:
  never silent zeros. The guard hangs on an *anchor*, an empty differentiable
  output of the op saved for backward, so it is on the graph even when nothing
  else in the backward pass is (the cotangent of a plain ``.sum()`` is a
  constant, and the intermediates are not differentiable).
* **Kernels launch only in forward.** Backward rules call ops and kernels
  (:class:`functe._kernel.Kernel`), which are Functions themselves, so
  ``torch.func.grad`` (whose backward sees wrapped tensors) works.
* **vmap** is explicit: the default batching rule calls the op's *batched twin*, a
  custom_vjp op whose rules are the op's forward and backward rules under
  ``torch.vmap`` (with the caller's ``randomness``), so an op batches exactly as the
  ops and kernels it is made of, and a gradient taken outside the vmap
  (``grad(vmap(f))``) still runs the op's backward rule (:class:`functe._vjp_batch._Batch`).
  ``batching=None`` makes ``vmap`` raise a clear error.
* **jvp** (forward mode, ``jacfwd``, ``torch.autograd.forward_ad``) differentiates
  the forward rule in forward mode (:func:`functe._kernel.forward_tangents`), so
  it is exact whenever the forward rule is differentiable.

Modules: the call layout (flattened arguments, residuals split by origin) lives in
:mod:`functe._vjp_layout`, the checks of a backward rule's cotangents and the per-argument
gradient flags in :mod:`functe._vjp_checks`, the batched twin in :mod:`functe._vjp_batch`, and the
second-order guard in :mod:`functe._vjp_guard`.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import pickle
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import forward_ad

from ._autocast import without_autocast
from ._backend import any_tangent, forward_ad_active
from ._errors import ArgumentError, RuleError, TransformError, called_as, check_flag, describe
from ._kernel import (
    empty_batched,
    forward_tangents,
    output_strides,
    refuse_forward_over_forward,
    with_layout,
)
from ._pickling import global_name, named, reachable_by_name
from ._rng import RandomState
from ._tree import tree_unflatten, with_contents
from ._vjp_batch import _Batch, _batched_bwd, _batched_fwd, _batched_prune
from ._vjp_checks import _flatten_cotangents, argument_needs
from ._vjp_guard import _guard, second_order_subject
from ._vjp_layout import (
    _CONST,
    _IN,
    _NEW,
    _OUT,
    _Call,
    _flatten,
    _output_leaves,
    _pruned,
    _run_forward,
    _split_result,
    _unflatten,
)

Tensor = torch.Tensor

_VARARGS = inspect.Signature([inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL)])

# While ``functe.trace`` runs a function, the recorder that turns an op call on
# traced values into an equation of the op list (see functe._trace); ``None``
# otherwise. A plain module global: the eager path pays one global lookup.
_recorder: Callable | None = None


class CustomVJP:
    """An op defined by a forward and a backward rule (see the module docstring).

    Args:
        name: the op's name, used in errors, traces and profiles.
        fwd: ``fwd(*args, **static) -> (out, residuals)``.
        bwd: ``bwd(residuals, cotangent, **static) -> tuple`` (one entry per positional arg).
        symbolic_zeros: pass ``None`` to ``bwd`` for outputs whose cotangent is
            zero (unused outputs) instead of materialising zeros.
        batching: ``"forward"`` (vmap runs the forward rule batched) or ``None``
            (vmap raises :class:`~functe.TransformError`).
        needs_input_grad: call ``bwd`` with the keyword ``needs_input_grad``, one
            flag per positional argument (whether any of its tensors wants a
            cotangent at this level), so it can skip work whose result autograd
            would drop (a frozen weight's wgrad GEMM); it may return ``None``
            for an unflagged argument.
        prune_residuals: ``prune(residuals, *, needs_input_grad, **static) -> residuals``
            (requires ``needs_input_grad``): the residuals with the leaves that
            no wanted gradient reads replaced by ``None`` (or the very object
            it was given, when it drops nothing). Called when autograd
            records the op and some argument wants no gradient; the dropped
            leaves are not saved (a linear with a frozen weight keeps no input
            alive for a wgrad it will not run), and ``bwd`` gets ``None`` there.
            Inside :func:`functe.fuse` the op of the backward step that reads
            the residuals prunes them (a fused op's rule covers its ops').
        constant_residuals: tensors that the forward rule may return among its
            residuals and that depend on no input (a captured constant such as
            a frozen weight): saved as intermediates are, but differentiating
            the backward needs no guard for them (their derivative is zero),
            so second order stays exact. Matched by identity.
        keep_autocast: run the rules under the caller's ``torch.autocast``. By default
            they run with autocast off, so they compute in their arguments' dtypes
            (``functe._autocast``: functe's ops cast their data arguments to autocast's
            dtype before the op); :func:`functe.opaque` keeps it (its function runs as-is).
            Inside a :func:`functe.fuse` plan every op runs with autocast off, this one
            too: it computes in the dtypes the trace recorded (docs/design.md §6).

    Example:
        >>> import torch
        >>> def fwd(x, *, s):
        ...     return x * s, None
        >>> def bwd(res, g, *, s):
        ...     return (g * s,)
        >>> scale = CustomVJP("scale", fwd, bwd)
        >>> torch.func.grad(lambda x: scale(x, s=3.0).sum())(torch.ones(2)).tolist()
        [3.0, 3.0]
    """

    def __init__(
        self,
        name: str,
        fwd: Callable[..., tuple[Any, Any]],
        bwd: Callable[..., tuple],
        *,
        symbolic_zeros: bool = False,
        batching: str | None = "forward",
        needs_input_grad: bool = False,
        prune_residuals: Callable | None = None,
        constant_residuals: tuple[Tensor, ...] = (),
        keep_autocast: bool = False,
    ):
        if not isinstance(name, str) or not name:
            raise RuleError(f"functe.custom_vjp: argument 'name' expected a non-empty str, got {describe(name)}")
        symbolic_zeros = check_flag("custom_vjp", "symbolic_zeros", symbolic_zeros)
        needs_input_grad = check_flag("custom_vjp", "needs_input_grad", needs_input_grad)
        keep_autocast = check_flag("custom_vjp", "keep_autocast", keep_autocast)
        if batching not in ("forward", None):
            raise RuleError(f"functe.custom_vjp: op {name}: batching must be 'forward' or None, got {batching!r}")
        for arg, rule in (("fwd", fwd), ("bwd", bwd), ("prune_residuals", prune_residuals)):
            if not callable(rule) and not (arg == "prune_residuals" and rule is None):
                raise RuleError(f"functe.custom_vjp: op {name}: {arg} must be a function, got {describe(rule)}")
        if prune_residuals is not None and not needs_input_grad:
            raise RuleError(f"functe.custom_vjp: op {name}: prune_residuals needs needs_input_grad=True")
        for c in constant_residuals:
            if not isinstance(c, Tensor) or c.requires_grad or torch._C._functorch.is_functorch_wrapped_tensor(c):
                raise RuleError(
                    f"functe.custom_vjp: op {name}: constant_residuals must be plain tensors that require no gradient, "
                    f"got {describe(c)}"
                )
        # (where a pickle looks the op up by name: the module that made it, then its forward rule's)
        # (no frames while Dynamo traces, which builds a plan's ops: it cannot trace sys._getframe)
        frame = None if torch.compiler.is_compiling() else sys._getframe(1)
        while frame is not None and frame.f_globals.get("__name__") == __name__:
            frame = frame.f_back
        self._made_in = None if frame is None else frame.f_globals.get("__name__")
        self._home = getattr(fwd, "__module__", None)
        # (rules that close over values: each recorded call checks them, see _refuse_captured_derivatives)
        self._closures = tuple(f for f in (fwd, bwd) if isinstance(f, types.FunctionType) and f.__closure__)
        # (the rules themselves: called directly while autocast is off, which is what the wrapper
        # does then, without its frame and its re-packed keywords)
        raw = (fwd, bwd)
        if not keep_autocast:
            fwd, bwd = without_autocast(fwd), without_autocast(bwd)
        self.name = name
        self.fwd = fwd
        self.bwd = bwd
        self.symbolic_zeros = symbolic_zeros
        self.batching = batching
        # (a check of the caller's context and the call's argument leaves, run at each call before any
        # Function: see functe.opaque)
        self.precheck: Callable[[list], None] | None = None
        # (an op Dynamo cannot trace: under torch.compile it runs eagerly, a graph break; see run_outside_graph)
        self.eager_under_compile = False
        self.needs_input_grad = needs_input_grad
        self.prune_residuals = prune_residuals
        self.constant_residuals = constants = tuple(constant_residuals)
        self._raw_fwd = raw[0]
        self.function = _make_function(
            name,
            fwd,
            bwd,
            symbolic_zeros,
            batching,
            needs_input_grad,
            prune_residuals,
            constants,
            forward_mode=True,
            raw=raw,
        )
        # Dynamo refuses Functions that define ``jvp``; compiled code gets a
        # twin class without it (forward-mode AD is not traced by compile). Nor does it get the
        # constants: tensors in the closure of a Function's forward made Dynamo's trace of the
        # backward fail (and a compiled graph is not differentiated twice, so the guard costs nothing).
        self.compiled_function = _make_function(name, fwd, bwd, symbolic_zeros, batching, forward_mode=False)
        self._eager_apply = _C_APPLY.__get__(None, self.function)

    def __call__(self, *args, **static):
        for key, value in static.items():
            if isinstance(value, Tensor):
                # (a static value is closed over by the rules: its gradient would be silently lost)
                raise ArgumentError(
                    f"functe.{self.name}: keyword argument '{key}' is static (not differentiated), got "
                    f"{describe(value)}; pass tensors positionally"
                )
        if _recorder is not None:
            traced = _recorder(self, args, static)
            if traced is not NotImplemented:
                return traced
        compiling = torch.compiler.is_compiling()
        leaves, in_tree = _flatten(args, compiling)
        if self.precheck is not None:
            self.precheck(leaves)
        mode = _COMPILED if compiling else _call_mode(leaves)
        if mode is _FORWARD_ONLY:
            # Nothing will ask for a backward: the forward rule alone, its residuals dropped (the
            # Function would add ~12 us of Python per op for the same values).
            fwd = self.fwd if torch._C._is_any_autocast_enabled() else self._raw_fwd
            out, _ = _split_result(self.name, fwd(*args, **static))
            out_leaves, out_tree = _output_leaves(self.name, out, leaves, False)
            return _unflatten(out_tree, out_leaves, False)
        if self._closures:
            _refuse_captured_derivatives(self.name, self._closures)
        call = _Call(in_tree, static)
        if mode is _COMPILED:
            _refuse_compiled_transforms(self.name)
            if self.eager_under_compile and torch.compiler.is_dynamo_compiling():
                # (Dynamo only: a non-strict export also reports compiling, and there the disabled
                # call would run this branch again and again)
                return run_outside_graph(self, args, static)
            results = self.compiled_function.apply(call, *_distinct_tensors(leaves))
            layout = results[-1]
            return tree_unflatten(layout.out_tree, results[: layout.n_out])
        if mode is _EAGER:
            results = self._eager_apply(call, *leaves)
        else:
            results = self.function.apply(call, *leaves)
        layout = results[-1]
        return _unflatten(layout.out_tree, results[: layout.n_out], False)

    def __reduce__(self):
        # An op pickles by reference, as a function does: its rules are wrapped (without_autocast)
        # and its Function classes are made per op, so none of them pickles by value, and a
        # reference keeps a rule set or a fused function's pickle small and loads today's rules.
        fn = getattr(self, "opaque_fn", None)
        if fn is not None:
            # (@functe.opaque binds the function's name to the op: the function is not reachable by
            # its name, the op is)
            found = None if reachable_by_name(fn) else global_name(self, getattr(fn, "__module__", None))
            return (named, (*found, CustomVJP)) if found else (_opaque_op, (fn, self.opaque_name))
        found = global_name(self, self._made_in, self._home)
        if found is None:
            raise pickle.PicklingError(
                f"functe.{self.name}: a custom_vjp op pickles by reference, like a function, so it must be "
                f"bound to a module-level name; none of the globals of {self._made_in} or {self._home} (or of "
                "another loaded module of their packages) is this op"
            )
        return named, (*found, CustomVJP)

    def __copy__(self):
        return self

    def __deepcopy__(self, memo: dict):
        # An op is a value (its rules and Functions never change): a copy is the op itself, which
        # also holds for ops bound to no global name (they do not pickle). An opaque op is its
        # function's: a copied module's op calls the copied submodule.
        fn = getattr(self, "opaque_fn", None)
        if fn is None:
            return self
        copied = copy.deepcopy(fn, memo)
        if copied is fn:  # (a builtin or a function: copied as themselves, their op is this one)
            return self
        if isinstance(copied, (types.FunctionType, torch.nn.Module)) or (
            isinstance(copied, types.MethodType) and isinstance(copied.__self__, torch.nn.Module)
        ):
            return _opaque_op(copied, self.opaque_name)  # (memoised on the copy itself: freed with it)
        # (any other callable's op is memoised in a global table keyed by it: the copy's op is made
        # unmemoised, or each deepcopy would stay alive in that table)
        from ._opaque import new_opaque_op

        return new_opaque_op(copied, self.opaque_name)

    def __repr__(self):
        return f"custom_vjp({self.name})"


def _opaque_op(fn: Callable, name: str | None) -> CustomVJP:
    from ._opaque import opaque  # (the opaque module imports this one)

    return opaque(fn, name=name)


def custom_vjp(
    name: str,
    fwd: Callable[..., tuple[Any, Any]],
    bwd: Callable[..., tuple],
    *,
    symbolic_zeros: bool = False,
    batching: str | None = "forward",
    needs_input_grad: bool = False,
    prune_residuals: Callable | None = None,
    constant_residuals: tuple[Tensor, ...] = (),
    keep_autocast: bool = False,
) -> CustomVJP:
    """Define an op from a forward rule and a backward rule (see :class:`CustomVJP`).

    Example:
        >>> import torch
        >>> def cube_fwd(x):
        ...     return x**3, x          # residual: the input itself
        >>> def cube_bwd(x, g):
        ...     return (3 * x**2 * g,)
        >>> cube = custom_vjp("cube", cube_fwd, cube_bwd)
        >>> x = torch.tensor([2.0])
        >>> torch.func.grad(lambda x: cube(x).sum())(x).item()
        12.0
        >>> torch.func.grad(lambda x: torch.func.grad(lambda x: cube(x).sum())(x).sum())(x).item()
        12.0
    """
    return CustomVJP(
        name,
        fwd,
        bwd,
        symbolic_zeros=symbolic_zeros,
        batching=batching,
        needs_input_grad=needs_input_grad,
        prune_residuals=prune_residuals,
        constant_residuals=constant_residuals,
        keep_autocast=keep_autocast,
    )


def _refuse_captured_derivatives(name: str, rules: tuple) -> None:
    """Raise if a rule closes over a tensor that autograd or a torch.func transform differentiates.

    The op differentiates its positional arguments only: the derivative through a captured tensor
    was silently dropped (``jvp`` over ``w`` in ``custom_vjp("f", lambda x: (x * w, None), ...)``
    gave a zero tangent, ``grad`` a zero gradient), where JAX's ``custom_vjp`` refuses a closed-over
    value it differentiates. Only closures are read (an op's rules defined at module level pay
    nothing); the containers in them are opened as :func:`functe.opaque` opens what its function
    reaches (:func:`functe._tree.with_contents`).
    """
    captured = [c.cell_contents for rule in rules for c in rule.__closure__ if cell_filled(c)]
    with forward_ad._set_fwd_grad_enabled(True):  # (inside a Function's forward a dual reads as plain)
        for v in with_contents(captured):
            if differentiated(v):
                raise ArgumentError(
                    f"functe.{name}: a rule uses {describe(v)} from its closure, and that tensor is "
                    "differentiated (it requires grad, or a torch.func transform or forward AD "
                    "differentiates it); the op differentiates its positional arguments only, so "
                    "its derivative would be lost: pass it as an argument"
                )


def cell_filled(cell) -> bool:
    """Whether a closure cell holds a value (an empty one: a name assigned later)."""
    try:
        _ = cell.cell_contents
    except ValueError:
        return False
    return True


def differentiated(v: Any) -> bool:
    """Whether ``v`` is a tensor that autograd, a torch.func ``grad``/``jvp`` level or forward AD
    differentiates (a ``vmap`` level alone does not)."""
    return isinstance(v, Tensor) and (_differentiated(v) or any_tangent((v,)))


def _differentiated(t: Tensor) -> bool:
    """Whether autograd (under grad mode) or a torch.func ``grad``/``jvp`` level differentiates ``t``:
    it requires grad, or a wrapper other than vmap's holds it."""
    f = torch._C._functorch
    grad_mode = torch.is_grad_enabled()
    while True:
        if grad_mode and t.requires_grad:
            return True
        if not f.is_functorch_wrapped_tensor(t):
            return False
        if not f.is_batchedtensor(t):  # (a grad or jvp level's wrapper)
            return True
        t = f.get_unwrapped(t)


def _distinct_tensors(leaves: list) -> list:
    """``leaves`` with each repeat of a tensor replaced by a view of it.

    Dynamo does not trace ``Function.apply`` given one tensor twice (``layer_norm(x, w, w)``): it
    breaks the graph and hands the call back to eager. Through a view the op sees the same values,
    and autograd sums the view's gradient into the tensor's, as it sums the two positions' eagerly.
    """
    distinct, seen = None, []
    for i, t in enumerate(leaves):
        if isinstance(t, Tensor):
            if any(t is u for u in seen):
                distinct = distinct or list(leaves)
                distinct[i] = t.view_as(t)
            else:
                seen.append(t)
    return leaves if distinct is None else distinct


def _refuse_compiled_transforms(name: str) -> None:
    """Keep ``torch.compile(torch.func.grad(f))`` from silently dropping backward rules.

    In torch 2.13 Dynamo traces through ``torch.func`` transforms and ignores a
    Function's custom backward (pytorch#193279), which would silently replace
    functe's backward rules (FP8 state updates included) by the derivative of
    the forward. Asking for the functorch level here makes Dynamo stop: with
    ``fullgraph=False`` it breaks the graph and the op runs eagerly (correct),
    with ``fullgraph=True`` it raises. Outside any transform the call folds to
    ``None`` and costs nothing. Where Dynamo evaluates it inside a transform
    (``backend="eager"`` with ``fullgraph=False`` does), the explicit error
    below takes over. See docs/design.md.
    """
    if torch._C._functorch.maybe_current_level() is not None:
        raise TransformError(
            f"functe.{name}: torch.compile of a torch.func transform would drop custom backward rules "
            "(pytorch#193279); compile the loss and take gradients outside it with torch.autograd.grad"
        )


def _run_eagerly(fn: Callable, args: tuple, static: dict):
    return fn(*args, **static)


# An opaque op under torch.compile (``fn`` the op, or its forward rule and the saved generator
# states of a fused program holding it):
# Dynamo failed inside the op's Function (an internal error loading its function from the
# forward's closure; then torch.get_rng_state, which it does not trace), a crash even without
# fullgraph, and a fused program's trace of the rule broke its graph at each of its checks. Run
# eagerly instead: a graph break around the op.
run_outside_graph = torch.compiler.disable(
    _run_eagerly,
    reason=(
        "functe.opaque: an opaque function runs eagerly under torch.compile (it saves the random "
        "generators' states for its backward, which recomputes it with torch.func: Dynamo traces "
        "neither); compile with fullgraph=False (a graph break around the op, exact) or write the "
        "function with functe ops"
    ),
)


# The C implementation behind ``autograd.Function.apply``. The Python wrapper
# around it binds every call's arguments with ``inspect.signature`` and routes
# through functorch; with no transform active (the common eager case) and no
# stale functorch wrapper among the arguments, calling the C entry point
# directly does exactly the same work minus ~10 us of Python per op.
_C_APPLY = torch._C._FunctionBase.__dict__["apply"]
_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


_FORWARD_ONLY, _EAGER, _FUNCTION, _COMPILED = "forward only", "eager", "function", "compiled"


def _call_mode(leaves) -> str:
    """How a call runs, decided in one pass over its leaves.

    ``_COMPILED`` while Dynamo traces (the Function without ``jvp``); ``_FUNCTION`` (the Python
    ``Function.apply``) under a ``torch.func`` transform or with a (dead) functorch wrapper among the
    arguments; ``_EAGER`` (the C ``apply``) when autograd records, through grad mode and an input
    requiring grad or through an input with a forward-mode tangent; else ``_FORWARD_ONLY``.
    """
    if torch._C._are_functorch_transforms_active():  # (the caller checked is_compiling)
        return _FUNCTION
    grad = torch.is_grad_enabled()
    records = False
    for leaf in leaves:
        if isinstance(leaf, Tensor):
            if _is_wrapped(leaf):
                return _FUNCTION
            records = records or (grad and leaf.requires_grad)
    return _EAGER if records or any_tangent(leaves) else _FORWARD_ONLY


def _differentiable(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


_set_eval_frame = torch._C._dynamo.eval_frame.set_eval_frame
_interpreters = torch._C._functorch.peek_interpreter_stack  # (None outside every torch.func transform)


def _outside_dynamo(method: Callable) -> Callable:
    """An eager Function's method run with Dynamo's frame callback off.

    Dynamo traces only the compiled twin (``compiled_function``); the eager one runs where it does
    not trace, such as a ``torch.func`` transform inside a compiled step (the transform graph-breaks
    at ``_refuse_compiled_transforms`` and runs eagerly with the callback still installed). There
    Dynamo compiled every frame the eager Function reached as a frame of its own: the rule wrapper
    shared by every op (``without_autocast``'s ``run``) recompiled per op, argument count and grad
    mode until the recompile limit (8), and a compiled step took 28% longer than eager per step.
    (``torch.compiler.disable`` does the same at ~1.2 us a call; this costs ~0.3 us.)
    """

    def run(*args):
        if torch.compiler.is_dynamo_compiling():  # (compiled autograd inlines the method: let it)
            return method(*args)
        prior = _set_eval_frame(None)
        try:
            return method(*args)
        finally:
            _set_eval_frame(prior)

    return run


# The wrapper's own frame is skipped as torch.compiler.disable's is (one code object for all of
# them): left to the callback, it was compiled itself, and recompiled per grad mode.
torch._dynamo.eval_frame.skip_code(_outside_dynamo(print).__code__)


def _make_function(
    name: str,
    fwd: Callable,
    bwd: Callable,
    symbolic_zeros: bool,
    batching: str | None,
    needs_input_grad: bool = False,
    prune: Callable | None = None,
    constants: tuple[Tensor, ...] = (),
    *,
    forward_mode: bool,
    raw: tuple[Callable, Callable] | None = None,
) -> type[torch.autograd.Function]:
    # (the rules unwrapped, the eager Function's: run directly while autocast is off, as the wrapper
    # would run them, without its frame and re-packed keywords)
    raw_fwd, raw_bwd = raw or (None, None)
    autocasting = torch._C._is_any_autocast_enabled

    # The staticmethods close over plain functions and values only: Dynamo
    # cannot rebuild arbitrary objects (such as the CustomVJP) inside the
    # autograd.Function it traces.
    def forward(*args):
        # When no input requires grad, Dynamo calls forward with a ctx in front
        # unless the parameter count matches the arguments, which it cannot for
        # ``*leaves``; the ctx is dropped here (eager autograd never passes one).
        if not isinstance(args[0], _Call):
            args = args[1:]
        call, leaves = args[0], args[1:]
        rule = fwd if raw_fwd is None or autocasting() else raw_fwd
        out_leaves, new, layout = _run_forward(name, rule, call, leaves, constants)
        return (*out_leaves, *new, layout)

    def setup_context(ctx, inputs, output):
        call, leaves = inputs[0], inputs[1:]
        layout = output[-1]
        outs = output[: layout.n_out]
        new = output[layout.n_out : layout.n_out + layout.n_new]
        sources = {_IN: leaves, _OUT: outs, _NEW: new}
        if prune is not None:
            flags = ctx.needs_input_grad[1:]
            # (the common case, every float tensor wanting a gradient, costs one pass; an int seed
            # never wants one)
            if any(not f and isinstance(t, Tensor) and t.is_floating_point() for f, t in zip(flags, leaves)):
                layout = _pruned(name, prune, layout, sources, call, argument_needs(flags, call.in_tree))
        # (the higher-order anchor, last of ``new``, is saved after the residuals and stays differentiable)
        ctx.save_for_backward(*(sources[kind][i] for kind, i in layout.plan if kind != _CONST), *new[-1:])
        if forward_mode and (forward_ad_active() or torch._C._are_functorch_transforms_active()):
            # (only ``jvp`` reads them, and it runs only where an input has a tangent: under a dual
            # level or a torch.func transform)
            ctx.save_for_forward(*(t for t in leaves if isinstance(t, Tensor)))
        if new:
            ctx.mark_non_differentiable(*new[:-1])
            ctx.anchor_device = new[-1].device
        ctx.set_materialize_grads(False)
        ctx.call = call
        ctx.layout = layout
        in_meta, consts = [], {}
        for i, t in enumerate(leaves):
            if isinstance(t, Tensor):
                in_meta.append((t.shape, t.dtype))
            else:
                in_meta.append(None)
                consts[i] = t
        ctx.in_meta, ctx.consts = in_meta, consts
        ctx.out_meta = [(t.shape, t.dtype, t.device) if isinstance(t, Tensor) else None for t in outs]
        if forward_mode:
            ctx.out_strides = output_strides(outs)

    def backward(ctx, *grads):
        call, layout = ctx.call, ctx.layout
        compiling = torch.compiler.is_compiling()
        saved = iter(ctx.saved_tensors)
        res_leaves = [value if kind == _CONST else next(saved) for kind, value in layout.plan]
        residuals = _unflatten(layout.res_tree, res_leaves, compiling)
        out_cts = list(grads[: layout.n_out])
        if not symbolic_zeros:
            for i, (g, meta) in enumerate(zip(out_cts, ctx.out_meta)):
                if g is None and meta is not None:
                    out_cts[i] = torch.zeros(meta[0], dtype=meta[1], device=meta[2])
        if not compiling and _interpreters() is not None and empty_batched((*grads, *res_leaves)):
            # vmap(grad(f)) over 0 members: no member has a value, only shapes (the rule's own torch
            # ops may fail on empty batches, see vmap_call)
            device = next(g.device for g in grads if g is not None)
            flat = [
                torch.zeros(meta[0], dtype=meta[1], device=device) if meta is not None and wants else None
                for meta, wants in zip(ctx.in_meta, ctx.needs_input_grad[1:])
            ]
        else:
            # (ctx.needs_input_grad's first entry is the call)
            needs = ctx.needs_input_grad[1:]
            extra = {"needs_input_grad": argument_needs(needs, call.in_tree)} if needs_input_grad else {}
            rule = bwd if raw_bwd is None or autocasting() else raw_bwd
            cts = rule(residuals, _unflatten(layout.out_tree, out_cts, compiling), **extra, **call.static)
            flat = _flatten_cotangents(name, call, cts, ctx.in_meta, fwd)
        if layout.guarded and torch.is_grad_enabled():
            flat = _guard(second_order_subject(fwd, name), flat, next(saved))
        return (None, *flat)

    def jvp(ctx, *tangents):
        refuse_forward_over_forward(name)
        call, layout = ctx.call, ctx.layout
        primals = ctx.saved_tensors
        positions = [i for i, meta in enumerate(ctx.in_meta) if meta is not None]
        diff = [k for k, p in enumerate(primals) if p.is_floating_point()]

        def out_only(*values):
            leaves = [ctx.consts.get(i) for i in range(len(ctx.in_meta))]
            for k, i in enumerate(positions):
                leaves[i] = primals[k]
            for k, v in zip(diff, values):
                leaves[positions[k]] = v
            out_leaves, _, _ = _run_forward(name, fwd, call, leaves, constants)
            return tuple(o for o in out_leaves if o is not None)

        tans = tuple(
            torch.zeros_like(primals[k]) if tangents[1 + positions[k]] is None else tangents[1 + positions[k]]
            for k in diff
        )
        # A random forward rule (an opaque dropout) reruns from the generators' states its forward
        # started from, so the tangent is that of the same draw (the first such state: the earliest).
        replay = next((v for kind, v in layout.plan if kind == _CONST and isinstance(v, RandomState)), None)
        try:
            with contextlib.nullcontext() if replay is None else replay.restored():
                out_tangents = forward_tangents(out_only, tuple(primals[k] for k in diff), tans)
        except TransformError as error:  # (a kernel's refusal: say which op the user called)
            raise called_as(error, f"functe.{name}") from None
        it = iter(out_tangents)
        result = [None if meta is None else next(it) for meta in ctx.out_meta]
        # (an integer output, a seed kept as a residual, has no tangent: autograd refuses one)
        result = [None if meta is None or not _differentiable(meta[1]) else t for t, meta in zip(result, ctx.out_meta)]
        if ctx.out_strides is not None:
            result = [t if t is None else with_layout(t, s) for t, s in zip(result, ctx.out_strides)]
        if not layout.n_new:
            return (*result, None)
        # (the anchor is differentiable, and torch's forward AD asserts on a None tangent for it)
        return (*result, *([None] * (layout.n_new - 1)), torch.zeros(0, device=ctx.anchor_device), None)

    batched: list[CustomVJP] = []  # this op's batched twin, made on first use (see _Batch)

    def vmap(info, in_dims, call, *leaves):
        if batching is None:
            raise TransformError(f"functe.{name} has no batching rule: it cannot be used under torch.func.vmap")
        positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]
        dims = [in_dims[1 + i] for i in positions]
        tensors = [leaves[i] if d in (None, 0) else leaves[i].movedim(d, 0) for i, d in zip(positions, dims)]
        flags = (needs_input_grad, prune, symbolic_zeros)
        plan = _Batch(name, fwd, bwd, call, leaves, positions, dims, info.randomness, flags, constants)
        if not batched:
            batched.append(
                CustomVJP(
                    name,
                    _batched_fwd,
                    _batched_bwd,
                    symbolic_zeros=True,
                    needs_input_grad=True,
                    prune_residuals=_batched_prune,
                )
            )
        flat = batched[0](*tensors, batch=plan)
        n_out = len(flat) - plan.layout.n_new
        out_leaves = plan.outputs(flat[:n_out])
        new = list(flat[n_out:])
        outputs = (*out_leaves, *new, plan.layout)
        out_dims = (*(None if o is None else 0 for o in out_leaves), *([0] * len(new)), None)
        return outputs, out_dims

    if forward_mode:  # (the eager Function: see _outside_dynamo)
        forward, setup_context, backward, jvp, vmap = map(
            _outside_dynamo, (forward, setup_context, backward, jvp, vmap)
        )
    # Function.apply binds its arguments with inspect.signature(forward) on every
    # call; a precomputed signature makes that lookup free.
    forward.__signature__ = _VARARGS
    methods = {
        "forward": staticmethod(forward),
        "setup_context": staticmethod(setup_context),
        "backward": staticmethod(backward),
        "vmap": staticmethod(vmap),
    }
    if forward_mode:
        methods["jvp"] = staticmethod(jvp)
    return type(name, (torch.autograd.Function,), methods)
