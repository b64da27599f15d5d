"""Opaque functions: any function of tensors run as-is inside a trace, as one op differentiated with
``torch.func.vjp`` (:func:`opaque`), and the checks that keep its captured state honest.

An opaque op recomputes its function in its backward (from the random generators' states the
forward started from) and, inside a trace, runs it on meta or fake tensors to infer shapes: the
captured state those extra runs update is restored (:class:`_CapturedState`), and captured
tensors that would lose their gradients or tangents are refused.
"""

from __future__ import annotations

import contextlib
import functools
import math
import types
from collections.abc import Callable
from typing import Any

import torch
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
from torch.autograd import forward_ad

from ._autocast import autocast_as, autocast_state
from ._backend import any_tangent, forward_ad_active
from ._errors import ArgumentError, TraceError, TransformError, describe
from ._kernel import batched_levels
from ._reach import _named_values, _unwrapped
from ._rng import RandomState
from ._tree import tree_flatten, tree_unflatten
from ._vjp import CustomVJP, custom_vjp, run_outside_graph

Tensor = torch.Tensor


def _not_recording():
    """The trace's recording switched off (imported per call: :mod:`functe._trace` imports this module)."""
    from ._trace import _recording

    return _recording(None)


def _differentiated_at(wrapper: Tensor) -> bool:
    """Whether the torch.func level of a grad-tracking ``wrapper`` differentiates it: a ``grad`` /
    ``vjp`` level makes it require grad, a ``jvp`` level gives it a tangent (and no requires_grad:
    a constant taken from it gave zero tangents)."""
    if wrapper.requires_grad:
        return True
    with forward_ad._set_fwd_grad_enabled(True):
        return forward_ad.unpack_dual(wrapper).tangent is not None


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
        try:
            hash(fn)
        except TypeError:  # (an unhashable callable object, a dataclass's say: keyed by identity, which
            return _OPAQUE, (id(fn), name)  # stays unique, as the op it keeps holds the object)
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
    op.opaque_fn = fn  # (a trace refuses a traced value it reaches by name: see functe._trace._record)
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
        with _not_recording():
            saved = [(t, t._version, t.clone() if t.numel() <= limit else None) for t in self.tensors]
        try:
            yield
        except BaseException:
            self._restore(saved, label, during, refuse=False)
            raise
        self._restore(saved, label, during, refuse=True)

    @staticmethod
    def _restore(saved: list, label: str, during: str, refuse: bool) -> None:
        with _not_recording(), torch.no_grad():
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
