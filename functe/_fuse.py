"""The fused executor: ``functe.fuse`` and ``functe.explain``.

``fuse(fn)`` returns a function with ``fn``'s signature. Per input signature
(pytree structure, shapes, dtypes, devices, static leaves) it traces ``fn``
once to an op list and builds a :class:`Plan`:

1. equations whose results reach no output are dropped (every op is pure),
   then the rule set's *joint* rules rewrite the op list;
2. its *forward* rules rewrite that into the **forward plan**, its
   *backward* rules, independently, into the **backward plan**
   (TransformerEngine's key insight: the two passes have different fusion
   opportunities, and the residual contract of docs/fusion.md lets them be
   chosen separately);
3. both plans are compiled to straight-line Python (no per-call
   interpretation, no data-dependent branches, no host synchronisation).

A call runs the whole program as **one** :func:`functe.custom_vjp` op whose
forward rule is the forward plan (returning only the residuals that live
backward steps need) and whose backward rule calls a second custom_vjp op
running the backward plan; so ``torch.func.grad``, ``vmap``, ``vmap(grad)``,
``jvp``, ``functional_call`` and ``torch.compile`` (with autograd outside)
treat a fused function exactly like the unfused one. With no gradient to
record the forward plan runs directly, without residuals.

This module holds the fused function and its plan cache; a signature's :class:`Plan` and the
autograd ops running it are in ``_plan``, the code generation in ``_codegen``, the cache keys in
``_fuse_keys``, the reached modules in ``_fuse_modules``, the torch.compile path in ``_fuse_compile``.
"""

from __future__ import annotations

import copy
import functools
import inspect
import operator
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from . import _reach, _trace
from ._autocast import autocast_state
from ._backend import any_tangent, get_backend
from ._errors import (
    ArgumentError,
    TraceError,
    TransformError,
    called_as,
    check_callable,
    describe,
    describe_shape,
)
from ._folded import FoldedConstants
from ._fuse_compile import (
    _call_outside_graph,
    _compiled_plan,
    _compiled_plan_index,
    _constant_outputs,
    _find_mode_modules,
    _refresh_outside_graph,
)
from ._fuse_keys import _Bits, _constant_key, _dict_keys, _shown, _static_key, _unhashable_error
from ._fuse_modules import (
    _REGISTRATIONS,
    _TRACKED,
    _TRAINING,
    _count_module_registrations,
    _name_module_parameter,
    _submodules,
)
from ._kernel import batched, empty_batched
from ._pickling import global_name, named, reachable_by_name
from ._plan import Plan
from ._recipe import check_recipe
from ._trace import trace_call
from ._tree import (
    tree_flatten,
)
from ._vjp import (
    _refuse_compiled_transforms,
)
from ._vjp_checks import positional_names

Tensor = torch.Tensor


def _carries_grad(t: Tensor) -> bool:
    """Whether ``t``, under torch.func, is differentiated in reverse mode by some level: it or a
    tensor it wraps requires grad (a vmapped tensor shows no requires_grad of its own, a jvp
    level's dual none either: forward-only transforms keep the cheaper infer, as unfused)."""
    while True:
        if t.requires_grad:
            return True
        if not _is_wrapped(t):
            return False
        t = _unwrap(t)


_unwrap = torch._C._functorch.get_unwrapped


def _defined_in(fn: Callable, cls: type) -> bool:
    """Whether ``fn`` is a method of ``cls`` (or a base) written in its body: its qualified name is the
    class's plus its own, and its first parameter is ``self``."""
    owner, _, _ = getattr(fn, "__qualname__", "").rpartition(".")
    if not owner or not any(getattr(c, "__qualname__", None) == owner for c in cls.__mro__):
        return False
    return positional_names(fn)[:1] == ["self"]


# ----------------------------------------------------------------------------- the fused function


RETRACE_WARNING = 16
"""After this many traces of one fused function, :class:`RetraceWarning`; again at each doubling."""


def _warns_at(count: int) -> bool:
    # 16, 32, 64, ...: a long run that retraces every step (an int seed) keeps hearing of it while
    # its plans pile up (they are kept), with a warning per doubling rather than per step.
    doublings, rest = divmod(count, RETRACE_WARNING)
    return doublings > 0 and rest == 0 and (doublings & (doublings - 1)) == 0


class RetraceWarning(UserWarning):
    """A fused function keeps meeting new input signatures (see :data:`RETRACE_WARNING`)."""


class Fused:
    """``fn`` with fused execution; returned by :func:`fuse`.

    Attributes:
        trace_count: how many times ``fn`` was traced (once per new signature, and again when a
            captured tensor a folded constant read changed in place).
        stale_retraces: how many of those traces replaced a stale plan.

    Example:
        >>> import torch, functe
        >>> fused = functe.fuse(lambda x: 2.0 * x)
        >>> _ = fused(torch.ones(3)), fused(torch.zeros(3)), fused(torch.ones(5))
        >>> fused.trace_count  # one plan per shape
        2
    """

    def __init__(self, fn: Callable, rules, recipe):
        # (updated=(): copying fn.__dict__ would let an attribute of fn, a model's `plan` say, hide a method)
        functools.update_wrapper(self, fn, updated=())
        if not hasattr(self, "__name__"):  # (a functools.partial or a callable object has none to copy)
            inner = getattr(fn, "func", None)
            self.__name__ = (
                f"partial({inner.__name__})" if callable(inner) and hasattr(inner, "__name__") else type(fn).__name__
            )
        self.rules = rules
        self.recipe = recipe
        self.trace_count = 0
        self._index: dict[Any, int] = {}
        self._plans: list[Plan] = []
        self._last_key: tuple | None = None
        self.stale_retraces = 0  # of trace_count: retraces of a plan whose folded constants went stale
        self._fake_slot: tuple[tuple, int] | None = None  # (key, index) of the plan traced under a fake mode
        self._mode_modules: list[torch.nn.Module] | None = None  # (see _training_flags)
        # modules traces called (see _training_flags), weakly: one made inside the function, or a model
        # passed as an argument once, is not kept alive by the fused function
        self._called: weakref.WeakValueDictionary[int, torch.nn.Module] = weakref.WeakValueDictionary()
        self._modules_epoch = -1  # (_REGISTRATIONS when _mode_modules was found)
        self._structure = 0  # (bumped when the module tree changed: a key entry)
        self._failed_traces = 0  # (bumped when a call whose compiled trace raised ran: see __call__)
        self._folded = FoldedConstants()  # (one copy of a constant every plan folds: see _folded)

    def _training_flags(self) -> tuple:
        """``(structure, flag, ...)``: the ``training`` flag of every module the function reaches by
        name or a trace called, and of their submodules; ``()`` when there are none.

        A trace reads them once (``if self.training: dropout``), so plans are keyed by them: after
        ``model.eval()`` a plan traced in training kept dropping units. The module tree is found
        again after a submodule registration on a module some fused function tracks (a global
        counter, one comparison per call): a replaced submodule without tensors (an activation
        module) ran the old one's code.
        (Not found by ``fuse``: a module being unpickled or deep-copied is not built yet.)
        """
        if self._modules_epoch != _REGISTRATIONS[0]:
            self._find_modules()
        modules = self._mode_modules  # (~0.2 us per module on the 2-core CI machine: map, not a genexpr)
        return (self._structure, *map(_TRAINING, modules)) if modules else ()

    def _flags_now(self) -> tuple:
        """:meth:`_training_flags` of the modules found last, as compiled code reads them (Dynamo
        guards what it reads: a global count that moved during a compile recompiled every call;
        the modules are found outside the graph, by :func:`_find_mode_modules`; and Dynamo cannot
        call an attrgetter)."""
        modules = self._mode_modules
        return (self._structure, *(m.training for m in modules)) if modules else ()

    def _find_modules(self) -> None:
        _count_module_registrations()
        self._modules_epoch = _REGISTRATIONS[0]
        # (the last list dropped first: a module only it and the weak `_called` hold, one a trace made
        # inside the function, is freed rather than carried into every later list)
        old = None if self._mode_modules is None else list(map(id, self._mode_modules))
        self._mode_modules = None
        found = {id(m): m for m in _submodules(self.__wrapped__)}
        for module in list(self._called.values()):
            found.update((id(m), m) for m in module.modules())
        if old is None or list(found) != old:
            self._structure += 1
        self._mode_modules = list(found.values())  # (equal when nothing changed: Dynamo guards it by ==)
        _TRACKED.update(self._mode_modules)

    def __call__(self, *args, **kwargs):
        if _trace.tracing():
            return self.__wrapped__(*args, **kwargs)  # inside an outer trace: inline
        if torch.compiler.is_compiling():
            # Inside a compiled torch.func transform no tensor shows requires_grad, so the forward
            # plan alone would run and Dynamo would differentiate it, dropping the backward rules.
            _refuse_compiled_transforms(f"fuse({self.__name__})")
            walked: list[Tensor] = []
            key = _constant_key((args, kwargs), walked)
            # (the backend and the modules' training flags: arguments, so that Dynamo guards them;
            # the modules are found outside the graph first, so that the list Dynamo reads is final)
            _find_mode_modules(self)
            failed = operator.index(self._failed_traces)  # (specialised: see _constant_key)
            index, order = _compiled_plan_index(self, key, get_backend(), (*self._flags_now(), failed))
            if index < 0:
                # The trace raised a functe error (its message is `order`): raised inside Dynamo's
                # trace, it reached the caller as an InternalTorchDynamoError, which an `except
                # functe.TraceError` missed. The graph breaks here (fullgraph=True: Dynamo's error,
                # with the message) and the call runs eagerly, raising the error itself; should it
                # run (the cause gone, a captured weight frozen since), _failed_traces changes,
                # which Dynamo guards above, so the next call compiles the plan.
                torch._dynamo.graph_break(msg=f"functe.fuse({self.__name__}): {order}")
                return _call_outside_graph(self, args, kwargs)
            plan = _compiled_plan(self, index)
            # A plan that folded computations on captured tensors (`w.to(bf16)`) must see their
            # in-place updates, which no Dynamo guard does (a version counter is data): the check
            # runs outside the graph, and a retrace replaces the plan object, whose guard then
            # recompiles. Module bindings need no break: rebound() is false here (the lookup above
            # just refreshed the plan), but evaluating the names makes Dynamo guard them, so a
            # replaced weight recompiles and the recompile's lookup retraces. Before, the compiled
            # graph kept the trace's values and replaced weights silently.
            if plan.sources or (plan.bindings and plan.rebound()):
                _refresh_outside_graph(self, key)
                plan = _compiled_plan(self, index)
            tensors = [walked[i] for i in order]
            if plan.differentiable and torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
                if plan.checks_captured:
                    plan.check_captured(plan.variant(None))
                # (Dynamo traces the custom_vjp op; its outputs are then made what unfused returns)
                constant = _constant_outputs(self, index, tuple(t.requires_grad for t in tensors))
                return plan.compiled_outputs(plan.run_op(*tensors), tensors, constant)
            if plan.checks_captured and torch.is_grad_enabled():
                plan.check_captured(None)
            return plan.infer(*tensors)
        _, plan, tensors = self._lookup(args, kwargs)
        if plan.unbatchable is not None and batched(tensors):
            raise TransformError(
                f"functe.fuse({self.__name__}): its op {plan.unbatchable} has no batching rule "
                "(custom_vjp(batching=None)): it cannot be used under torch.func.vmap"
            )
        if plan.differentiable and torch.is_grad_enabled():
            needs = tuple(t.requires_grad for t in tensors)
            # Only the inputs that want gradients keep their backward steps' residuals (autograd
            # records only what reaches them): under torch.func a wrapper counts when a tensor it
            # wraps requires grad (a vmapped argument shows none itself: grad(vmap(f)) must record
            # the node, not differentiate infer's forward rules; see _carries_grad).
            functorch = torch._C._functorch.maybe_current_level() is not None
            if functorch:
                needs = tuple(n or _carries_grad(t) for n, t in zip(needs, tensors))
            if any(needs):
                variant = plan.variant(None if all(needs) else needs)
                if variant.liveness.live:  # (else no output depends on a trainable input)
                    if plan.checks_captured:
                        plan.check_captured(variant)
                    # (the eager node has no jvp rule: forward-mode AD takes the custom_vjp op)
                    if functorch or any_tangent(tensors):
                        return variant.run_op(*tensors)
                    return variant.eager(*tensors)
        if plan.checks_captured and torch.is_grad_enabled():
            plan.check_captured(None)
        if plan.differentiable and empty_batched(tensors):
            # (vmap over 0 members: the op's batched twin runs a padded member, where the forward
            # rules under this vmap fail on torch's empty-batch bugs; see functe._kernel.vmap_call)
            return plan.variant(None).run_op(*tensors)
        try:
            return plan.infer(*tensors)
        except TransformError as error:  # (a kernel's refusal, e.g. forward-mode AD through FP8: name the program)
            raise called_as(error, f"functe.fuse({self.__name__})") from None

    def _plan_and_tensors(self, args, kwargs) -> tuple[Plan, list[Tensor]]:
        _, plan, tensors = self._lookup(args, kwargs)
        return plan, tensors

    def _lookup(self, args, kwargs) -> tuple[int, Plan, list[Tensor]]:
        """The plan index and plan for these arguments (tracing on a new signature) and their tensor
        leaves. (The plan itself, not only its index: a fake call's slot may be replaced meanwhile.)"""
        leaves, spec = tree_flatten((args, kwargs))
        tensors, key, fake = self._key(leaves, args, kwargs, spec)
        try:
            index = self._index.get(key)
        except TypeError:
            if any(not isinstance(d, int) for t in tensors for d in t.shape):
                raise TraceError(
                    f"functe.fuse({self.__name__}): symbolic shapes ({describe(tensors[0])}; make_fx's "
                    "tracing_mode='symbolic', a dynamic torch.export Dim) cannot key a plan: a fused function "
                    "is planned per concrete shape; trace it with concrete shapes, or use the unfused ops"
                ) from None
            raise _unhashable_error(self, leaves, spec) from None
        if fake is not None:
            with _trace.TRACE_LOCK:  # (the slot is shared: another thread's fake call may replace it)
                return (*self._fake_plan(key, leaves, args, kwargs), tensors)
        if index is None:
            index = self._new_plan(key, leaves, args, kwargs)
        elif self._plans[index].watches and self._plans[index].stale():
            index = self._new_plan(key, leaves, args, kwargs, stale=index)
        return index, self._plans[index], tensors

    def _key(self, leaves: list, args, kwargs, spec=None) -> tuple[list[Tensor], tuple, Any]:
        """The tensor leaves of a call, its plan key and the FakeTensorMode in force (or ``None``)."""
        if spec is None:
            spec = tree_flatten((args, kwargs))[1]
        # (optree's spec equality ignores dict insertion order and 1 == 1.0 == True keys; fn may not)
        tensors, key = [], [spec, _dict_keys((args, kwargs))]
        for x in leaves:  # (one pass: this is the cached call's main cost besides the ops)
            if isinstance(x, Tensor):
                tensors.append(x)
                key.append((x.shape, x.dtype, x.device))
            elif type(x) is float:
                # by bits: -0.0 == 0.0 would reuse a plan with the other sign, and nan != nan retrace forever
                key.append((float, _Bits(x.hex())))
            else:
                key.append(_static_key(x))
        if torch._C._is_any_autocast_enabled():  # (a trace under autocast folds and records its dtypes)
            key.append(autocast_state())  # (the signature's)
        # (a trace folds computations on captured tensors with the backend then in force: run under
        # another one, the plan's constants had the first one's bits, whichever call came first)
        key.append(get_backend())
        training = self._training_flags()
        if training:
            key.append(training)
        fake = _active_fake_mode()
        if fake is not None:
            # (a trace under a FakeTensorMode, make_fx's fake tracing, holds fake constants, which a
            # real call, or another fake mode, cannot use: the plans are kept apart; weakly, so
            # that the key alone keeps no mode alive)
            key.append(weakref.ref(fake))
        return tensors, tuple(key), fake

    def _fake_plan(self, key: tuple, leaves: list, args, kwargs) -> tuple[int, Plan]:
        """The plan of a call under a FakeTensorMode (with ``TRACE_LOCK`` held). Fake calls share one
        slot: a new signature or fake mode replaces the last plan (each fake mode's plan holds its
        mode and fake constants: kept, every memory estimate or make_fx call leaked one, and counted
        toward the retrace warning)."""
        index = self._index.get(key)
        if index is None:
            slot = None
            if self._fake_slot is not None:
                old_key, slot = self._fake_slot
                self._index.pop(old_key, None)
            index = self._new_plan(key, leaves, args, kwargs, slot=slot)
            self._fake_slot = (key, index)
        elif self._plans[index].watches and self._plans[index].stale():
            index = self._new_plan(key, leaves, args, kwargs, stale=index)
        return index, self._plans[index]

    def _new_plan(
        self, key: tuple, leaves: list, args, kwargs, stale: int | None = None, slot: int | None = None
    ) -> int:
        """Trace and plan a new signature (or one whose plan is ``stale``); the index of its plan."""
        # One thread at a time (tracing is global state); the index is published only with its plan,
        # and a thread that waited finds the plan another one made for the same signature.
        with _trace.TRACE_LOCK:
            index = self._index.get(key)
            if index is not None and (stale is None or not self._plans[index].stale()):
                return index
            sources: dict[int, Tensor] = {}
            viewed: dict[int, Tensor] = {}
            called: list[torch.nn.Module] = []
            try:
                program = trace_call(self.__wrapped__, args, kwargs, sources, called, viewed)
            except TraceError as e:
                if hasattr(e, "capture") and _trace._plain_trainable(e.capture[1]):
                    # (a tensor a transform sees, a module's under functional_call: the trace's own words)
                    _name_module_parameter(e, [*_reach._reached(self.__wrapped__), *called])
                raise
            self._folded.share(program)
            self.trace_count += 1
            plan = Plan(
                program,
                self.rules,
                self.recipe,
                self.__name__,
                list(sources.values()),
                positional_names(self.__wrapped__),
                list(viewed.values()),
            )
            # (the modules fn reaches by name: a plan that took some of their parameters or buffers
            # as constants checks at each call that their names still give those tensors)
            modules = {id(v): v for v in _reach._reached(self.__wrapped__) if isinstance(v, torch.nn.Module)}
            # (the modules it called: a module passed as an argument, held in a dict or an object)
            self._called.update((id(m), m) for m in called)
            self._find_modules()
            # (the key as the next call computes it, with the modules this trace found: so that it
            # finds this plan instead of tracing again)
            # (not for a fake call: its one slot is found and replaced by the key it was traced for)
            rekeyed = self._key(leaves, args, kwargs)[1] if _active_fake_mode() is None else key
            if modules:
                plan.bind(list(modules.values()), list(sources.values()))
            if slot is not None:  # (a fake call's plan replacing the last one: see _lookup)
                self._plans[slot] = plan
                setattr(self, f"_plan{slot}", plan)
                self._index[key] = slot
                return slot
            if stale is not None:  # (same signature: the plan is replaced in place)
                self._index[rekeyed] = stale
                self._plans[stale] = plan
                setattr(self, f"_plan{stale}", plan)
                self.stale_retraces += 1
                if _warns_at(self.stale_retraces):
                    self._warn_stale(plan)
                return stale
            self._plans.append(plan)
            index = self._index[key] = self._index[rekeyed] = len(self._plans) - 1
            setattr(self, f"_plan{index}", plan)  # (what compiled code reads: see _compiled_plan)
            if _warns_at(len(self._plans)):  # (signatures: stale retraces warn on their own)
                self._warn_retracing(key, leaves)
            self._last_key = key
            return index

    def _warn_stale(self, plan: Plan) -> None:
        """Warn (see _warns_at) that changes to captured tensors keep invalidating plans."""
        read = [t for t in (ref() for ref, *_ in plan.sources) if t is not None]
        read += [t for *_, t, _, _, _ in plan.bindings]
        shown = ", ".join(describe(t) for t in read[:3])
        warnings.warn(
            f"functe.fuse({self.__name__}) has retraced {self.stale_retraces} times because tensors it captured "
            f"({shown}) changed in place, or a module's attribute names another tensor (functional_call); pass "
            "tensors that change (weights an optimizer updates) as arguments",
            RetraceWarning,
            stacklevel=5,
        )

    def _warn_retracing(self, key: tuple, leaves: list) -> None:
        """Warn (see _warns_at) that plans pile up, naming the static leaves that changed since the last trace."""
        previous = self._last_key
        changed, reshaped = [], []
        if previous is not None and len(previous) == len(key) and previous[:2] == key[:2]:
            for leaf, old, new in zip(leaves, previous[2:], key[2:]):
                if old == new:
                    continue
                if isinstance(old[0], torch.Size) and isinstance(new[0], torch.Size):  # (tensor entries)
                    reshaped.append(f"{describe_shape(old[1], old[0])} -> {describe_shape(new[1], new[0])}")
                elif not isinstance(leaf, Tensor):
                    changed.append(f"{_shown(old)} -> {_shown(new)}")
        what = f"static leaves changed: {', '.join(changed)}; " if changed else ""
        if reshaped:
            # (a served model's prompt lengths, a decode loop's growing cache: every shape its plan)
            what += (
                f"tensor shapes changed: {', '.join(reshaped)} (one plan per shape: pad or bucket lengths that vary); "
            )
        flags = self._training_flags()
        if flags and previous is not None and flags not in previous[len(leaves) + 2 :]:
            # (the modules' training flags key the plans too: toggling layers one by one makes plans)
            what += "the training flags of the modules it reaches changed (each combination has its plan); "
        warnings.warn(
            f"functe.fuse({self.__name__}) has traced {len(self._plans)} input signatures (each plan is kept); "
            f"{what}non-tensor arguments are static, so a value that changes every call (a step count, a "
            "seed) retraces every call: pass it as a tensor (a seed as an i64[] tensor)",
            RetraceWarning,
            stacklevel=5,
        )

    def plan(self, *args, **kwargs) -> Plan:
        """The :class:`Plan` for these arguments (tracing ``fn`` if this signature is new)."""
        return self._plan_and_tensors(args, kwargs)[0]

    def __get__(self, obj: Any, objtype: type | None = None) -> Fused:
        # A fused function shared as a class attribute is itself through an instance (self.mlp(x)),
        # as before; only a method fused in its class body is refused: the instance was not bound,
        # and the call failed with Python's "missing 1 required positional argument" (bound, the
        # instance would be static to the trace: its tensors captured constants, not inputs).
        if obj is None or not _defined_in(self.__wrapped__, type(obj)):
            return self
        raise TraceError(
            f"functe.fuse({self.__name__}) decorates a method: fuse the bound method once an instance exists "
            f"(functe.fuse(obj.{self.__name__})) or the module, and call that"
        )

    def __deepcopy__(self, memo: dict) -> Fused:
        # A copy traces afresh: the plans' generated functions hold the original's captured tensors
        # in their globals, which deepcopy does not copy (functions are atomic to it), so a copied
        # plan computed with the original module's weights.
        new = Fused.__new__(Fused)
        memo[id(self)] = new  # (before the function: a module's copy refers back to this one)
        new.__init__(copy.deepcopy(self.__wrapped__, memo), self.rules, self.recipe)
        return new

    def __reduce__(self):
        # The function, rules and recipe, not the plans: their generated code is rebuilt by tracing
        # on the first call after loading (and a pickled plan would hold the weights it folded).
        # Under @functe.fuse the function's name is bound to this object, which then pickles by
        # reference, as the function would have.
        fn = self.__wrapped__
        found = None if reachable_by_name(fn) else global_name(self, getattr(fn, "__module__", None))
        return (named, (*found, Fused)) if found else (Fused, (fn, self.rules, self.recipe))

    def __repr__(self):
        return f"fuse({self.__name__})"


_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def _active_fake_mode():
    """The FakeTensorMode in force, or ``None``."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)


def fuse(fn: Callable, *, recipe: Any = None, rules=None) -> Fused:
    """Run ``fn`` through the fused executor (see the module docstring).

    Args:
        fn: a function of pytrees of tensors built from functe ops, plain
            arithmetic on them, and :func:`functe.opaque` functions.
            Non-tensor leaves of its arguments are static.
        recipe: the quantization recipe the rules see (``None``: high precision).
        rules: a :class:`functe.rules.RuleSet`; default ``functe.rules.DEFAULT_RULES``.

    Returns:
        A callable with ``fn``'s signature; its ``trace_count`` counts traces.

    Example:
        >>> import torch, functe
        >>> from functe import ops
        >>> @functe.fuse
        ... def block(x, w, b):
        ...     return ops.linear(x, w, b) + x
        >>> x, w, b = torch.ones(2, 4), torch.eye(4), torch.zeros(4)
        >>> block(x, w, b).tolist()
        [[2.0, 2.0, 2.0, 2.0], [2.0, 2.0, 2.0, 2.0]]
        >>> torch.func.grad(lambda w: block(x, w, b).sum())(w)[0].tolist()
        [2.0, 2.0, 2.0, 2.0]
        >>> block.trace_count
        1
    """
    check_callable("fuse", "fn", fn)
    return _new_fused(fn, _check_rules("fuse", rules), _check_fuse_recipe("fuse", recipe))


@torch.compiler.disable
def _new_fused(fn: Callable, rules, recipe) -> Fused:
    # (made outside any compiled graph: a Fused that Dynamo built while tracing reached the lookups
    # that run outside the graph without its attributes, an internal AttributeError; fuse(f)(x)
    # inside a compiled function now graph-breaks here and traces the call as any fused call)
    return Fused(fn, rules, recipe)


def _check_rules(op: str, rules: Any):
    """``rules`` if it is a RuleSet (``None``: the default rules), else a clear error now rather than
    at the first call."""
    from .rules import DEFAULT_RULES, RuleSet  # (functe.rules imports the ops)

    if rules is None:
        return DEFAULT_RULES
    if not isinstance(rules, RuleSet):
        raise ArgumentError(f"functe.{op}: argument 'rules' expected a functe.rules.RuleSet, got {describe(rules)}")
    return rules


def _check_fuse_recipe(op: str, recipe: Any):
    """``None`` or one of functe's recipes (the rules only read it: a typo would leave every quantized
    linear unfused without a word)."""
    return None if recipe is None else check_recipe(op, recipe)


def explain(fn: Callable, *args, rules=None, recipe: Any = None, **kwargs) -> None:
    """Print how ``fn`` is fused for these arguments.

    Shows the traced op list, then for each plan the rules that fired, every
    rule that matched but declined with its reason, and the rewritten op list.
    ``fn`` may be a :func:`fuse` d function (its rules and recipe are used).

    Example:
        >>> import torch, functe
        >>> from functe import ops
        >>> functe.explain(lambda x, w: ops.linear(x, w) * 2.0, torch.ones(2, 4), torch.ones(3, 4))
        functe.fuse(<lambda>): program as traced
        { lambda a:f32[2,4] b:f32[3,4]. let
            c:f32[2,3] = linear a b None
            d:f32[2,3] = constant_scale[scale=2.0] c
          in (d,) }
        forward plan:
          fired: none
          (unchanged)
        backward plan:
          fired: backward_linear_scale x1
        { lambda a:f32[2,4] b:f32[3,4]. let
            c:f32[2,3] = backward_linear_scale[scale=2.0] a b None
          in (c,) }
        residuals kept for the backward plan: linear, constant_scale
    """
    check_callable("explain", "fn", fn)
    given = {name: value for name, value in (("rules", rules), ("recipe", recipe)) if value is not None}
    if isinstance(fn, Fused):
        # (a fused function has its own rules and recipe: these keywords can only be fn's)
        for name in given:
            if not _takes_keyword(fn.__wrapped__, name):
                raise ArgumentError(
                    f"functe.explain: {name}= is ignored for the fused function {fn.__name__}, which uses its "
                    f"own (set it with functe.fuse(fn, {name}=...)), and {fn.__name__} takes no {name!r}"
                )
        fused, kwargs = fn, {**given, **kwargs}
    else:
        for name in given:
            if _takes_keyword(fn, name):  # (explain would take the keyword and trace fn without it)
                raise ArgumentError(
                    f"functe.explain: {name}= is fuse's {name}, but {getattr(fn, '__name__', fn)} also takes "
                    f"{name!r}: explain the fused function, which passes it on: "
                    f"functe.explain(functe.fuse(fn), *args, {name}=...)"
                )
        fused = Fused(fn, _check_rules("explain", rules), _check_fuse_recipe("explain", recipe))
    print(fused.plan(*args, **kwargs).explain())


def _takes_keyword(fn: Callable, name: str) -> bool:
    """Whether ``fn`` accepts a keyword argument ``name`` (by name or through ``**kwargs``)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # (a builtin without a signature)
        return False
    return any((p.name == name and p.kind != p.POSITIONAL_ONLY) or p.kind == p.VAR_KEYWORD for p in parameters)
