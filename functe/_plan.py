"""A fused function's plan for one input signature: the rewritten programs, their generated code, and
the autograd ops that run them (the custom_vjp op for torch.func, a lean Function for plain autograd)."""

from __future__ import annotations

import functools
import itertools
import linecache
import weakref
from collections.abc import Callable

import torch

from . import _reach
from ._autocast import without_autocast
from ._backend import unaliased_outputs
from ._codegen import _generate, _Liveness, _outside_outputs, _owners
from ._errors import (
    TraceError,
    describe,
)
from ._fuse_modules import _MODULE_REMEDY, _named_tensor, _named_tensors
from ._kernel import formula_twins
from ._opaque import vjp_call
from ._oplist import LEAF, Literal, OpList, Var, _op_names, format_oplist, without_dead_code
from ._rng import RandomState
from ._tree import (
    argument_labels,
    tree_flatten,
    tree_leaves,
    tree_unflatten,
)
from ._vjp import (
    custom_vjp,
    run_outside_graph,
)
from ._vjp_checks import check_gradients
from ._vjp_guard import _guard, first_order_only, higher_order_anchor

Tensor = torch.Tensor


# ----------------------------------------------------------------------------- plans


_plan_numbers = itertools.count()


class Plan:
    """Everything :func:`fuse` caches for one input signature.

    Attributes:
        traced: the traced op list.
        program: ``traced`` without dead code (equations whose results reach no output).
        joint, forward, backward: the op list after the joint rules, and the
            forward and backward plans (each a rewrite of ``joint``).
        stats: ``{"joint" | "forward" | "backward": RewriteStats}``.
        source: the generated Python of ``infer``, ``forward`` and ``backward``.
        op: the custom_vjp op running the whole program.

    Example:
        >>> import torch, functe
        >>> from functe import ops
        >>> fused = functe.fuse(lambda x, w, r: ops.linear(x, w) + r)
        >>> plan = fused.plan(torch.ones(4, 8), torch.ones(16, 8), torch.ones(4, 16))
        >>> plan.stats["forward"].fired, "def backward(res, cts):" in plan.source
        ({'forward_linear_bias_add': 1}, True)
    """

    def __init__(
        self,
        program: OpList,
        rules,
        recipe,
        name: str,
        sources: list[Tensor] = (),
        parameter_names: list[str] = (),
        viewed: list[Tensor] = (),
    ):
        from .rules import rewrite  # functe.rules imports the ops; imported late to keep import order simple

        self.traced = program
        self.program = program = without_dead_code(program)
        self.name = name
        # (how errors name the inputs, worked out only for one: see program_input_labels)
        self.input_labels = functools.partial(program_input_labels, program, tuple(parameter_names))
        self.joint, joint_stats = rewrite(program, rules, "joint", recipe=recipe)
        self.forward, forward_stats = rewrite(self.joint, rules, "forward", recipe=recipe)
        self.backward, backward_stats = rewrite(self.joint, rules, "backward", recipe=recipe)
        self.stats = {"joint": joint_stats, "forward": forward_stats, "backward": backward_stats}
        # Whether any output depends on an input (else there is nothing to differentiate: infer runs).
        self.differentiable = any(isinstance(a, Var) for a in program.outputs)
        self.outside = _outside_outputs(program)  # (outputs aliasing other outputs, see there)
        self._variants: dict[tuple[bool, ...] | None, _Variant] = {}
        self._constant_outputs: dict[tuple[bool, ...], tuple[int, ...]] = {}
        # What the trace took as constants but may start requiring grad later (see check_captured).
        self._captured = [
            a.value
            for e in program.eqns
            for a in e.inputs
            if isinstance(a, Literal) and isinstance(a.value, torch.Tensor)
        ]
        self._opaque_eqns = [e for e in program.eqns if getattr(e.op, "opaque_check", None)]
        # Whether an eval pass (no_grad) captured a trainable tensor, which a trace under grad mode
        # refuses: its calls under grad mode refuse it (check_captured), not the building of its code.
        self.eval_captures = any(t.requires_grad for t in self._captured)
        # (an op made with custom_vjp(batching=None) refuses vmap unfused; the plan runs its forward
        # rule directly, so the program refuses in its place)
        self.unbatchable = next((e.op.name for e in program.eqns if getattr(e.op, "batching", "") is None), None)
        # Captured tensors whose values the trace folded into constants (weakly: a freed one cannot
        # change), with their version counters and requires_grad: an in-place update, or a tensor
        # starting to require grad, makes the plan stale (retraced), see _trace._CapturedWatch.
        self.sources = [(weakref.ref(t), t._version, t.requires_grad, _reach.storage_of(t)) for t in sources]
        # Captured tensors the program holds views of (w.t(), w[:n], w.data), with their storages: a
        # view reads its tensor's values live, but a tensor given a new storage (w.data = ...,
        # module.half().float()) leaves the view on the old one, which the plan kept computing with.
        self.viewed = [(weakref.ref(t), _reach.storage_of(t)) for t in viewed]
        self.bindings: list[tuple] = []  # (see bind)
        self.checks_captured = bool(self._captured or self._opaque_eqns)
        full = self.variant(None)
        self.liveness, self.source, self.infer, self.op = full.liveness, full.source, full.infer, full.op
        self.eager, self.with_constants, self.run_op = full.eager, full.with_constants, full.run_op
        self.compiled_outputs = full.compiled_outputs

    def check_captured(self, variant: _Variant | None) -> None:
        """Before the program runs with grad mode on: raise if a tensor it captured as a constant
        requires grad now, and, when it runs as one autograd node (``variant``), if one an opaque
        function whose backward step does not run reaches by name does. The trace refused such
        tensors, but ``requires_grad_()`` after it would make the cached plan drop their gradients
        silently (inside the node nothing records them; the forward rules of ``infer`` need not be
        differentiable: a quantizing kernel is not). Unfused, autograd would record them. (An opaque
        function runs as plain torch in ``infer``, so autograd reaches what it captured; inside the
        node, an opaque op whose step is live checks in its own backward, as unfused, and only one
        whose step is not checks here.)
        ``variant``: the one running as the node, ``None`` for ``infer``."""
        for t in self._captured:
            if t.requires_grad:
                # (a module's parameter: named, and the remedy for a module, which takes no parameters)
                named = [".".join((*path, name)) for _, path, name, bound, *_ in self.bindings if bound is t]
                what = f"{describe(t)} (the module's {named[0]!r})" if named else describe(t)
                remedy = _MODULE_REMEDY if named else "pass it to the fused function as an argument"
                raise TraceError(
                    f"functe.fuse({self.name}): a tensor {what} captured from the enclosing scope as a constant "
                    f"requires gradients; {remedy}, otherwise its gradient would be silently lost"
                )
        if variant is not None:
            for e in variant.dead_opaque:
                e.op.opaque_check()

    def bind(self, modules: list[torch.nn.Module], sources: list[Tensor]) -> None:
        """Remember which parameters and buffers of ``modules`` the plan took as constants (captured
        tensors it reads, folded constants' ``sources``), by their names and metadata: see :meth:`stale`."""
        taken = {id(t) for t in self._captured} | {id(t) for t in sources}
        # (a module tensor the program reads through a view, w.t() or w.chunk(3), shares its storage:
        # bound too, so that load_state_dict(assign=True) or functional_call retraces)
        viewed = {_reach.storage_of(t) for t in self._captured}
        seen, bound_views = set(), set()
        for owner in modules:
            for name, t in _named_tensors(owner):  # (every name of a tied tensor: rebinding any one of them unties it)
                path = tuple(name.split("."))
                holder = functools.reduce(getattr, path[:-1], owner)
                if (id(holder), path[-1]) in seen:
                    continue
                if id(t) in taken or _reach.storage_of(t) in viewed:
                    seen.add((id(holder), path[-1]))
                    # (a tensor read through a view: its storage is checked with its name, one check)
                    storage = None if id(t) in taken else _reach.storage_of(t)
                    self.bindings.append((owner, path[:-1], path[-1], t, t.dtype, t.shape, storage))
                    if storage is not None:
                        bound_views.add(id(t))
        self.viewed = [(ref, storage) for ref, storage in self.viewed if id(ref()) not in bound_views]
        self._watch_batch_counts(modules, {id(t) for t in sources})

    def _watch_batch_counts(self, modules: list[torch.nn.Module], sources: set[int]) -> None:
        """A fold over BatchNorm's running statistics (a BN folded into a weight for inference) also
        watches the layer's ``num_batches_tracked``: the statistics are updated in place without a
        version bump (a training forward left the folded weight stale silently), the count with one."""
        for owner in modules:
            for bn in owner.modules():
                count = getattr(bn, "num_batches_tracked", None)
                if not isinstance(bn, torch.nn.modules.batchnorm._NormBase) or not isinstance(count, Tensor):
                    continue
                if id(bn.running_mean) in sources or id(bn.running_var) in sources:
                    self.sources.append((weakref.ref(count), count._version, False, _reach.storage_of(count)))

    @property
    def watches(self) -> bool:
        """Whether :meth:`stale` has anything to check."""
        return bool(self.sources or self.bindings or self.viewed)

    def stale(self) -> bool:
        """Whether a captured tensor the trace folded into a constant changed in place since, or
        started (or stopped) requiring grad (the retrace decides whether that gradient can flow);
        or whether a parameter or buffer of a module the function reaches that the plan took as a
        constant now names another tensor (``torch.func.functional_call``, ``load_state_dict(assign=True)``,
        a submodule replaced) or has another dtype or shape (``module.half()`` swaps its ``.data``)."""
        if self.rebound(storages=True):
            return True
        for ref, version, requires_grad, storage in self.sources:
            t = ref()
            if t is not None and (
                t._version != version or t.requires_grad != requires_grad or _reach.storage_of(t) != storage
            ):
                return True  # (a new storage: p.data = ..., set_())
        for ref, storage in self.viewed:
            t = ref()
            if t is not None and _reach.storage_of(t) != storage:
                return True
        return False

    def rebound(self, storages: bool = False) -> bool:
        """Whether a module name the plan bound (:meth:`bind`) gives another tensor, or its tensor has
        another dtype or shape (part of :meth:`stale`; no version counters, so Dynamo can trace it).
        ``storages``: also whether a tensor the plan reads through a view has a new storage
        (``half().float()``; eagerly only: Dynamo cannot read a storage)."""
        for owner, modules, name, t, dtype, shape, storage in self.bindings:  # (~1 µs each: one per captured weight)
            if _named_tensor(owner, modules, name) is not t or t.dtype is not dtype or t.shape != shape:
                return True  # (a device move changes the arguments' devices too: a new signature)
            if storages and storage is not None and _reach.storage_of(t) != storage:
                return True
        return False

    def constant_outputs(self, requires_grad: tuple[bool, ...]) -> tuple[int, ...]:
        """The positions of the output leaves that no input flagged in ``requires_grad`` reaches (see
        ``compiled_outputs``, which detaches them)."""
        found = self._constant_outputs.get(requires_grad)
        if found is None:
            reached = {v for v, r in zip(self.program.inputs, requires_grad) if r}
            for e in self.program.eqns:
                if any(isinstance(a, Var) and a in reached for a in e.inputs):
                    reached.update(v for v in e.outputs if v is not None)
            found = tuple(k for k, a in enumerate(self.program.outputs) if isinstance(a, Var) and a not in reached)
            self._constant_outputs[requires_grad] = found
        return found

    def variant(self, needs_grad: tuple[bool, ...] | None) -> _Variant:
        """The generated functions when only the inputs flagged in ``needs_grad`` (one flag per
        tensor input; ``None``: all) want gradients: the forward keeps only the residuals their
        backward steps read (a frozen input's branch saves nothing, as in autograd)."""
        variant = self._variants.get(needs_grad)
        if variant is None:
            # (a non-float input, a seed say, never wants a gradient: it does not make a variant)
            inputs = self.program.inputs
            wanted = (
                None if needs_grad is None else [n or not v.dtype.is_floating_point for v, n in zip(inputs, needs_grad)]
            )
            if wanted is None or all(wanted):
                variant = self._variants.get(None) or _Variant(self, None)
            else:
                variant = _Variant(self, tuple(wanted))
            self._variants[needs_grad] = variant
        return variant

    def explain(self) -> str:
        """The op list before and after each rewrite, rules fired and declined (see :func:`functe.explain`)."""
        # (one numbering of ops sharing a name for every section: each printout numbered its own,
        # so one opaque op could be `#2` in the traced program and unsuffixed in a plan)
        names = _op_names([*self.traced.eqns, *self.joint.eqns, *self.forward.eqns, *self.backward.eqns])
        lines = [f"functe.fuse({self.name}): program as traced", format_oplist(self.traced, names)]
        dead = len(self.traced.eqns) - len(self.program.eqns)
        if dead:
            lines.append(f"dead code removed: {dead} equation(s) whose results reach no output")
        for phase, oplist in (("joint", self.joint), ("forward", self.forward), ("backward", self.backward)):
            stats = self.stats[phase]
            if phase == "joint" and not stats.fired and not stats.declined:
                continue
            lines.append(f"{phase} plan:")
            fired = ", ".join(f"{rule} x{n}" for rule, n in stats.fired.items())
            lines.append(f"  fired: {fired or 'none'}")
            for rule, where, reason in stats.declined:
                lines.append(f"  declined: {rule} at {where}: {reason}")
            lines.append(format_oplist(oplist, names) if stats.fired else "  (unchanged)")
        kept = ", ".join(names.get(e.op, e.name) for e in self.liveness.residuals)
        lines.append(f"residuals kept for the backward plan: {kept or 'none'}")
        return "\n".join(lines)


class _Variant:
    """A plan's generated code for one set of inputs that want gradients (see :meth:`Plan.variant`)."""

    def __init__(self, plan: Plan, needs_grad: tuple[bool, ...] | None):
        program, name = plan.program, plan.name
        wanted = None if needs_grad is None else frozenset(v for v, n in zip(program.inputs, needs_grad) if n)
        self.liveness = _Liveness(program, plan.joint, plan.backward, wanted, plan.outside)
        # opaque ops whose backward step does not run: their forward, inside the node, hides what
        # they capture from autograd (see Plan.check_captured)
        owners = {o for e in self.liveness.live for o in _owners(e)}
        self.dead_opaque = [e for e in plan._opaque_eqns if e not in owners]
        self.source, namespace = _generate(program, plan.forward, self.liveness, plan.input_labels, plan.outside)
        filename = f"<functe.fuse {name} #{next(_plan_numbers)}>"
        linecache.cache[filename] = (len(self.source), None, self.source.splitlines(True), filename)
        # (tracebacks show the plan's lines while it lives; the entry goes with it: a function fused
        # anew every step, or a plan retraced every step, left ~7 KiB per variant in linecache)
        weakref.finalize(self, linecache.cache.pop, filename, None)
        exec(compile(self.source, filename, "exec"), namespace)
        # (every path runs the plan with autocast off, as custom_vjp runs rules: the trace recorded
        # autocast's casts as equations, and an opaque op must compute the dtype it recorded)
        self.infer: Callable = without_autocast(namespace["infer"])
        self.with_constants: Callable = namespace["with_constants"]
        self.compiled_outputs: Callable = namespace["compiled_outputs"]
        backward = namespace["backward"]
        # The generated dispatcher ``bwd`` calls this op under create_graph / torch.func (see _generate).
        namespace["_backward_op"] = custom_vjp(
            f"fused_{name}_bwd", _backward_fwd(backward), functools.partial(_backward_bwd, backward)
        )
        # symbolic zeros: an output nobody uses has no cotangent, and the backward plan skips the
        # steps that only it reaches (as autograd skips the unfused nodes; an FP8 state is kept).
        forward, bwd = namespace["forward"], namespace["bwd"]
        if plan._opaque_eqns:
            forward, bwd = _replaying(forward, bwd)
        forward.input_labels = plan.input_labels  # (read by custom_vjp's gradient check)
        second_order = _second_order(plan.name)
        first_order_only(forward, *second_order)  # (what custom_vjp's guard says; the eager node's below)
        # The plan's literal tensors (a captured frozen weight, a seed): plain tensors no input reaches
        # (see _trace._untracked_constant), so a backward that keeps one has an exact second order.
        # (one requiring grad was captured by an eval pass: a call under grad mode refuses it first)
        literals = tuple(v for v in namespace.values() if isinstance(v, Tensor) and not v.requires_grad)
        if plan.checks_captured and not plan.eval_captures:
            # (a captured constant made trainable since the trace: the plan's own message, which
            # says what to do, not custom_vjp's about constant residuals)
            plan.check_captured(None)
        self.op = custom_vjp(f"fused_{name}", forward, bwd, symbolic_zeros=True, constant_residuals=literals)
        # per output leaf: whether no input that wants a gradient reaches it
        constant = tuple(not (isinstance(a, Var) and a in self.liveness.needs) for a in program.outputs)
        eager = _eager_function(
            f"fused_{name}_eager",
            without_autocast(namespace["forward"]),
            without_autocast(backward),
            namespace["_backward_op"],
            program.out_tree,
            constant,
            literals,
            plan.input_labels,
            second_order,
        )
        if not all(isinstance(a, Var) for a in program.outputs) or plan.outside:
            self.eager = lambda *tensors: self.with_constants(eager(*tensors))
        else:
            self.eager = eager

    def run_op(self, *tensors):
        """The custom_vjp op on these tensors, constants and outside outputs put back (torch.func and
        compiled calls)."""
        return self.with_constants(self.op(*tensors))


def _replaying(forward: Callable, bwd: Callable) -> tuple[Callable, Callable]:
    """A fused op's rules keeping the generators' states its forward started from (a residual
    constant): its ``jvp`` reruns the forward plan, and an opaque random function in it (dropout)
    must draw again what it drew (custom_vjp's jvp restores the earliest such state)."""

    def forward_from_state(*tensors):
        # (Dynamo does not trace torch.get_rng_state: under it, a graph break with functe's reason,
        # which fullgraph=True shows rather than Dynamo's words about get_rng_state)
        state = (
            run_outside_graph(RandomState, (tensors,), {})
            if torch.compiler.is_dynamo_compiling()
            else RandomState(tensors)
        )
        out, res = forward(*tensors)
        return out, (state, res)

    def bwd_from_state(res, cts):
        return bwd(res[1], cts)

    return forward_from_state, bwd_from_state


_SAVED = object()  # marks a residual leaf kept with save_for_backward


def program_input_labels(program: OpList, names: tuple[str, ...]) -> list[str]:
    """How errors name a traced program's inputs: as its caller passed them (``argument 'x'``,
    ``argument 'params'['w']``), ``names`` being the traced function's positional parameters."""
    spec, count = program.in_tree, len(program.inputs)
    children = spec.children()
    if spec.type is tuple and len(children) == 2 and children[0].type is tuple and children[1].type is dict:
        labels = [label for i, label in enumerate(argument_labels(*children, names=names)) if i not in program.static]
        if len(labels) == count:
            return labels
    return [f"input {i}" for i in range(count)]  # (a program built by hand, not traced from a call)


def _second_order(function: str) -> tuple[str, str]:
    """What a fused plan's second-order error says (see ``_vjp_guard._HigherOrderGuard``)."""
    return (
        f"functe.fuse({function})",
        "the fused plan's backward uses intermediate results of its ops (a pre-activation, a quantized "
        "operand) whose dependence on the inputs autograd cannot see; differentiate the unfused function "
        f"(`{function}`, the fused function's `__wrapped__`) for higher-order derivatives",
    )


def _eager_function(
    name: str,
    forward: Callable,
    backward: Callable,
    backward_op,
    out_tree,
    constant_outputs: tuple[bool, ...],
    literals: tuple[Tensor, ...],
    input_labels: Callable[[], list[str]],
    second_order: tuple[str, str],
) -> Callable:
    """The fused op for plain eager autograd (no torch.func transform, not compiling).

    Same semantics as the custom_vjp op (``Plan.op``) with a fraction of its
    per-call cost: an old-style Function binds no signature and the layout of
    the residuals is known. Intermediate residuals make differentiating the
    backward raise, through the same guard as custom_vjp (hung on an empty
    extra output, the anchor, which callers never see); the plan's ``literals`` are not
    intermediates.
    """

    single = out_tree == LEAF
    n_out = out_tree.num_leaves
    literal_ids = frozenset(map(id, literals))
    constant_positions = [i for i, constant in enumerate(constant_outputs) if constant]
    # The gradients' shapes and dtypes depend on the signature only: checked on the first backward
    # (autograd itself would silently sum a [1,N] gradient to [N], or cast it).
    unchecked = [True]

    def fwd(ctx, *tensors):
        ctx.set_materialize_grads(False)  # (an unused output's cotangent stays None: see Plan.op)
        if unchecked[0]:
            ctx.in_meta = [(t.shape, t.dtype) for t in tensors]
        out, res = forward(*tensors)
        out_leaves, swapped = unaliased_outputs([out] if single else tree_leaves(out), tensors)
        res_leaves, res_tree = tree_flatten(res)
        if swapped:  # (a residual that is an output is saved as the output returned)
            res_leaves = [swapped.get(id(r), r) for r in res_leaves]
        layout = [_SAVED if isinstance(r, Tensor) else r for r in res_leaves]
        saved = [r for r in res_leaves if isinstance(r, Tensor)]
        known = {id(t) for t in (*tensors, *out_leaves)}
        # intermediates: differentiating through them is refused
        n_new = sum(id(r) not in known and id(r) not in literal_ids for r in saved)
        anchor = [higher_order_anchor(saved[0])] if n_new else []
        ctx.save_for_backward(*saved, *anchor)
        ctx.residual_layout = (res_tree, layout, n_new)
        if constant_positions:  # outputs no trainable input reaches do not require grad, as unfused
            ctx.mark_non_differentiable(*(o for i in constant_positions if isinstance(o := out_leaves[i], Tensor)))
        return (*out_leaves, *anchor)

    def bwd(ctx, *grads):
        res_tree, layout, n_new = ctx.residual_layout
        saved = iter(ctx.saved_tensors)
        res = tree_unflatten(res_tree, [next(saved) if leaf is _SAVED else leaf for leaf in layout])
        cts = grads[0] if single else tree_unflatten(out_tree, list(grads[:n_out]))
        if not torch.is_grad_enabled():
            grads_in = backward(res, cts)
        else:
            grads_in = list(backward_op(res, cts))
            grads_in = tuple(_guard(second_order, grads_in, next(saved))) if n_new else tuple(grads_in)
        if unchecked[0]:
            # (a backstop: each step's cotangents are checked first, see _codegen._StepCheck)
            check_gradients(name, grads_in, ctx.in_meta, " (in a fused plan's backward)", input_labels)
            unchecked[0] = False
        return grads_in

    function = type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})

    # autograd.Function.apply's Python layer binds arguments and unwraps dead torch.func wrappers,
    # one generator step per argument; this node is used only when no transform is active, so it
    # calls the C implementation directly unless an argument is a (dead) wrapper.
    checked_apply = function.apply
    c_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, function)
    is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor

    def apply(*tensors):
        for t in tensors:
            if is_wrapped(t):
                return checked_apply(*tensors)
        return c_apply(*tensors)

    if single:
        return lambda *tensors: apply(*tensors)[0]

    def call(*tensors):
        return tree_unflatten(out_tree, list(apply(*tensors)[:n_out]))

    return call


def _backward_fwd(backward: Callable) -> Callable:
    def fwd(res, cts):
        return backward(res, cts), (res, cts)

    return fwd


def _backward_bwd(backward: Callable, saved, ggrads) -> tuple:
    # Second order: differentiate the backward plan itself (built from differentiable ops; its
    # kernels as plain formulas, see formula_twins).
    res, cts = saved
    with formula_twins():
        return vjp_call(backward, (res, cts), ggrads)
