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
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import decimal
import functools
import inspect
import itertools
import linecache
import math
import operator
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import optree
import torch

from . import _trace
from ._autocast import autocast_state, without_autocast
from ._backend import any_tangent, get_backend, unaliased_outputs
from ._errors import (
    ArgumentError,
    FuncteError,
    TraceError,
    TransformError,
    called_as,
    check_callable,
    describe,
    describe_shape,
)
from ._folded import FoldedConstants
from ._kernel import batched, empty_batched, formula_twins
from ._oplist import LEAF, Eqn, Literal, OpList, Var, _op_names, flat_spec, format_oplist, without_dead_code
from ._recipe import check_recipe
from ._rng import RandomState
from ._trace import trace_call, vjp_call
from ._tree import (
    NAMESPACE,
    argument_labels,
    is_pytree_dataclass,
    rebuild_dataclass,
    tree_flatten,
    tree_leaves,
    tree_unflatten,
)
from ._vjp import (
    _Call,
    _flatten_cotangents,
    _guard,
    _refuse_compiled_transforms,
    argument_needs,
    check_gradients,
    cotangent_count_error,
    custom_vjp,
    first_order_only,
    higher_order_anchor,
    input_labels,
    positional_names,
    run_outside_graph,
)

Tensor = torch.Tensor


# ----------------------------------------------------------------------------- runtime helpers of generated code


def _acc(a, b):
    """Sum of two cotangents, either of which may be ``None`` (zero)."""
    if a is None:
        return b
    if b is None:
        return a
    return a + b


def _distinct(outputs: tuple, inputs: tuple) -> tuple:
    """``outputs`` with a view in place of any tensor that is an input or an earlier output.

    A Function must not return one of its inputs, or one tensor twice (Dynamo's trace of it fails),
    and an op such as ``identity`` or ``make_extra_output`` hands back its input object, so whether
    two variables are one tensor is known only at run time. (Compared with ``is``: Dynamo guards on
    an ``id()``'s value, and a compiled fused call recompiled for every new batch tensor.)
    """
    result: list = []
    for t in outputs:
        if isinstance(t, Tensor) and (any(t is i for i in inputs) or any(t is r for r in result)):
            t = t.view_as(t)
        result.append(t)
    return tuple(result)


def _zeros(meta) -> Tensor:
    shape, dtype, device = meta
    return torch.zeros(shape, dtype=dtype, device=device)


def _zeros_or(ct, meta) -> Tensor:
    return _zeros(meta) if ct is None else ct


RULE_HINT = "; functe.rules.check tests a rule"
"""Appended to the errors of a fused op's backward rule, but where rules.check runs (see there)."""


def _bad_cotangents(name: str, cts, count: int):
    raise cotangent_count_error(name, cts, count, f" (in a fused plan's backward{RULE_HINT})")


class _StepCheck:
    """The first check of one backward step's cotangents against its inputs' shapes and dtypes, as
    custom_vjp checks an op's: run inside a plan, a wrong cotangent for an intermediate went on into
    the step that made it (a [1,8] one broadcast back to [4,8]: right shapes, wrong values), and only
    the program's inputs were checked. Shapes and dtypes are fixed per plan, so one call suffices."""

    __slots__ = ("call", "fwd", "in_meta", "name", "outer", "pending", "program_labels", "where")

    def __init__(self, e: Eqn, program: OpList, program_labels: Callable[[], list[str]]):
        self.name, self.fwd, self.call = e.op.name, e.op.fwd, _Call(e.in_tree, {})
        # per input of the step: its position among the program's inputs, if it is one (named too)
        position = {v: i for i, v in enumerate(program.inputs)}
        self.outer = [position.get(a) if isinstance(a, Var) else None for a in e.inputs]
        self.program_labels = program_labels
        self.in_meta = [(a.shape, a.dtype) if isinstance(a, Var) else _literal_meta(a.value) for a in e.inputs]
        self.where = f" (in a fused plan's backward{RULE_HINT if e.covers else ''})"
        self.pending = True

    def check(self, cts: tuple) -> None:
        _flatten_cotangents(self.name, self.call, cts, self.in_meta, self.fwd, self.where, self.labels)
        self.pending = False

    def labels(self) -> list[str]:
        """The step's inputs as its rule names them, and as the fused function's caller passed them."""
        outer = self.program_labels()
        return [
            label if i is None else f"{label} (the fused function's {outer[i]})"
            for label, i in zip(input_labels(self.fwd, self.call.in_tree), self.outer)
        ]


def _literal_meta(value: Any) -> tuple | None:
    return (value.shape, value.dtype) if isinstance(value, Tensor) else None


# ----------------------------------------------------------------------------- code generation


def _is_literal(value: Any) -> bool:
    """Whether ``repr(value)`` is Python source for ``value`` itself (exact types: the repr of an
    IntEnum or a numpy float is not, and an int subclass would come back as a plain int)."""
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return True
    if kind is float:
        return math.isfinite(value)
    if kind is tuple:
        return all(_is_literal(v) for v in value)
    return False


class _Emitter:
    """Source lines plus the globals they refer to."""

    def __init__(self):
        self.globals: dict[str, Any] = {
            "torch": torch,
            "_acc": _acc,
            "_zeros": _zeros,
            "_distinct": _distinct,
            "_zeros_or": _zeros_or,
            "_bad_cotangents": _bad_cotangents,
            "_StepCheck": _StepCheck,
            "_leaves": tree_leaves,
            "_unflatten": tree_unflatten,
            "_dataclass": rebuild_dataclass,
        }
        self._by_id: dict[int, str] = {}
        self.lines: list[str] = []
        self.names: dict[Var, str] = {}

    def glob(self, value: Any, prefix: str) -> str:
        name = self._by_id.get(id(value))
        if name is None:
            name = f"_{prefix}{len(self.globals)}"
            self.globals[name] = value
            self._by_id[id(value)] = name
        return name

    def literal(self, value: Any) -> str:
        return repr(value) if _is_literal(value) else self.glob(value, "c")

    def var(self, v: Var) -> str:
        name = self.names.get(v)
        if name is None:
            name = self.names[v] = f"v{len(self.names)}"
        return name

    def atom(self, a) -> str:
        return self.literal(a.value) if isinstance(a, Literal) else self.var(a)

    def emit(self, line: str) -> None:
        self.lines.append("    " + line)

    def args(self, eqn: Eqn) -> str:
        atoms = [self.atom(a) for a in eqn.inputs]
        if eqn.in_tree == flat_spec(len(atoms)):
            text = ", ".join(atoms)
        else:
            text = "*" + self.build(eqn.in_tree, atoms)
        return text + self.params(eqn)

    def params(self, eqn: Eqn) -> str:
        return "".join(f", {k}={self.literal(v)}" for k, v in eqn.params.items())

    def bind(self, eqn: Eqn, value: str) -> None:
        names = [("_" if v is None else self.var(v)) for v in eqn.outputs]
        if eqn.out_tree == LEAF:
            self.emit(f"{names[0]} = {value}")
        elif not names:
            self.emit(f"_ = {value}")
        elif eqn.out_tree == flat_spec(len(names)):
            self.emit(f"{', '.join(names)}, = {value}")
        else:
            self.emit(f"{', '.join(names)}, = {self.leaves(eqn.out_tree, value)}")

    def pack(self, items: list[str], tree) -> str:
        if tree == LEAF:
            return items[0]
        if tree == flat_spec(len(items)):
            return f"({', '.join(items)},)" if items else "()"
        return self.build(tree, items)

    # Pytrees are built and taken apart by generated Python where their nodes allow (tuples, lists,
    # dicts, namedtuples, functe.pytree_dataclass): Dynamo refuses optree calls with specs made
    # outside its trace ("Expected treespec to be an instance of PyTreeSpec").

    def build(self, tree, items: list[str]) -> str:
        """A Python expression building a pytree of structure ``tree`` from leaf expressions."""
        if not _spelled_out(tree):
            return f"_unflatten({self.glob(tree, 's')}, [{', '.join(items)}])"
        it = iter(items)
        return self._node(tree, it)

    def _node(self, tree, it) -> str:
        if tree.is_leaf():
            return next(it)
        parts = [self._node(c, it) for c in tree.children()]
        kind = tree.kind
        if kind == optree.PyTreeKind.TUPLE:
            return f"({''.join(p + ', ' for p in parts)})"
        if kind == optree.PyTreeKind.LIST:
            return f"[{', '.join(parts)}]"
        if kind == optree.PyTreeKind.DICT:
            # (flattened in sorted key order; rebuilt in the original one, as optree does)
            by_key = dict(zip(tree.entries(), parts))
            order = optree.tree_unflatten(tree, [None] * tree.num_leaves)
            return "{" + ", ".join(f"{self.literal(k)}: {by_key[k]}" for k in order) + "}"
        if kind == optree.PyTreeKind.NAMEDTUPLE:
            return f"{self.glob(tree.type, 't')}({', '.join(parts)})"
        names = self.literal(tree.type.__functe_pytree_fields__)
        return f"_dataclass({self.glob(tree.type, 't')}, {names}, ({''.join(p + ', ' for p in parts)}))"

    def leaves(self, tree, value: str) -> str:
        """A Python expression for the leaves of ``value`` (of structure ``tree``), as a tuple."""
        if not _spelled_out(tree):
            return f"_leaves({value})"
        return "(" + "".join(f"{a.codify(value)}, " for a in tree.accessors()) + ")"


_SPELLED_KINDS = (optree.PyTreeKind.TUPLE, optree.PyTreeKind.LIST, optree.PyTreeKind.NAMEDTUPLE)


def _spelled_out(tree) -> bool:
    """Whether generated code can build and index pytrees of structure ``tree`` itself."""
    if tree.is_leaf():
        return True
    kind = tree.kind
    ok = (
        kind in _SPELLED_KINDS
        or (kind == optree.PyTreeKind.DICT and all(_is_literal(k) for k in tree.entries()))
        or (kind == optree.PyTreeKind.CUSTOM and is_pytree_dataclass(tree.type))
    )
    return ok and all(_spelled_out(c) for c in tree.children())


def _output(em: _Emitter, a) -> str:
    """A program output; a constant the function made is copied on every call (see Literal.fresh)."""
    return f"{em.atom(a)}.clone()" if isinstance(a, Literal) and a.fresh else em.atom(a)


def _is_float_var(a) -> bool:
    return isinstance(a, Var) and a.dtype.is_floating_point


class _Liveness:
    """Which vars carry cotangents and which backward steps (and so residuals) are needed."""

    def __init__(
        self, program: OpList, joint: OpList, backward: OpList, wanted: frozenset | None = None, outside=frozenset()
    ):
        # wanted: the inputs whose gradients are asked for (None: every float input); outside: the
        # output positions built outside the fused op (see _outside_outputs), which get no cotangent
        needs = {v for v in program.inputs if v.dtype.is_floating_point and (wanted is None or v in wanted)}
        for e in joint.eqns:
            if any(isinstance(a, Var) and a in needs for a in e.inputs):
                needs.update(v for v in e.outputs if _is_float_var(v))
        has = {a for k, a in enumerate(program.outputs) if _is_float_var(a) and a in needs and k not in outside}

        def wanted_step(e: Eqn) -> bool:
            return any(isinstance(a, Var) and a in needs for a in e.inputs)

        # A fused backward step runs the backward of every op it covers; where one of them has no
        # input that wants a gradient (a frozen FP8 linear under a trainable bias), the covered ops'
        # own steps run instead, so that op keeps no residuals and costs no GEMMs, as unfused.
        steps: list[Eqn] = []
        for e in backward.eqns:
            if e.phase == "backward" and not all(wanted_step(c) for c in e.covers):
                steps.extend(e.covers)
            else:
                steps.append(e)
        live: list[Eqn] = []
        for e in reversed(steps):
            if any(v in has for v in e.outputs if v is not None) and wanted_step(e):
                live.append(e)
                has.update(a for a in e.inputs if isinstance(a, Var) and a in needs)
        self.needs = needs
        self.live = live  # in backward execution order
        owners = {o for e in live for o in _owners(e)}
        self.residuals = [e for e in joint.eqns if e in owners]  # residual owners, in program order


def _step_needs(e: Eqn, live: _Liveness) -> tuple[bool, ...]:
    """Per argument of a backward step, whether it wants a cotangent in this plan variant."""
    return argument_needs([isinstance(a, Var) and a in live.needs for a in e.inputs], e.in_tree)


def _pruned_residuals(em: _Emitter, live: _Liveness, res_names: dict) -> None:
    """Emit the ``prune_residuals`` call of each live step that has one and some argument wanting no
    gradient: the residuals it reads are dropped before the forward returns them (a frozen
    weight's linear keeps no input; see custom_vjp)."""
    for e in live.live:
        prune = getattr(e.op, "prune_residuals", None)
        # (an absent bias or an int seed is unflagged too, but there is nothing to prune for it; a
        # captured float tensor, a literal, is frozen)
        if prune is None or not any(_frozen_float(a, live) for a in e.inputs):
            continue
        flags = _step_needs(e, live)
        if e.phase == "backward":  # (a fused step reads the tuple of its covered ops' residuals)
            names = "".join(f"{res_names[o]}, " for o in _owners(e))
            em.emit(f"{names}= {em.glob(prune, 'p')}(({names}){em.params(e)}, needs_input_grad={flags!r})")
        else:
            name = res_names[e]
            em.emit(f"{name} = {em.glob(prune, 'p')}({name}{em.params(e)}, needs_input_grad={flags!r})")


def _frozen_float(a, live: _Liveness) -> bool:
    """Whether a step input is a float tensor that wants no gradient (a frozen input's value, or a
    captured constant)."""
    if isinstance(a, Var):
        return a.dtype.is_floating_point and a not in live.needs
    return isinstance(a.value, Tensor) and a.value.is_floating_point()


def _owners(eqn: Eqn) -> tuple[Eqn, ...]:
    """The equations whose residuals a step of a plan produces (forward) or consumes (backward)."""
    return eqn.covers if eqn.phase in ("forward", "backward") else (eqn,)


def _dead_after(program: OpList, forward: OpList) -> list[list[Var]]:
    """Per forward step, the variables no later step reads (intermediates only: the program's inputs
    stay the caller's, and its outputs are returned)."""
    keep = set(program.inputs) | {a for a in program.outputs if isinstance(a, Var)}
    last: dict[Var, int] = {}
    for i, e in enumerate(forward.eqns):
        for v in e.outputs:
            if v is not None:
                last[v] = i  # (an output nothing reads dies where it is made)
        for a in e.inputs:
            if isinstance(a, Var):
                last[a] = i
    dead: list[list[Var]] = [[] for _ in forward.eqns]
    for v, i in last.items():
        if v not in keep:
            dead[i].append(v)
    return dead


def _outside_outputs(program: OpList) -> dict[int, tuple[int, tuple]]:
    """Output positions the fused op leaves out and its caller builds from its other outputs:
    ``{position: (source position, shapes)}``, the source reshaped by each of ``shapes`` in turn.

    They are the outputs that alias another output in the unfused function: one returned twice
    (``return y, y``) and the reshapes of an output that no op reads but another such reshape
    (``y, y.reshape(...)``).
    Returned by an autograd.Function, the second of two aliases is a view of the first that
    autograd forbids writing to ("Output 1 of ... is a view and its base ... has been modified
    inplace"), where the unfused function returns the same tensor, or a view torch's own view op
    made; built outside, they are the same objects and views. Left inside: a reshape an op reads
    (it may be a residual) and a reshape of an input. (An input returned stays an output of the
    Function too, a view of the input: its gradient then adds the output's cotangent in the order
    the unfused graph does.)
    """
    from .ops._core import _reshape  # (functe.ops imports this module's callers; imported late)

    producer = {v: e for e in program.eqns for v in e.outputs if v is not None}
    readers: dict[Var, list[Eqn]] = {}
    for e in program.eqns:
        for a in e.inputs:
            if isinstance(a, Var):
                readers.setdefault(a, []).append(e)
    first: dict[Var, int] = {}  # each variable's first position
    for k, a in enumerate(program.outputs):
        if isinstance(a, Var) and a not in first:
            first[a] = k
    inputs = set(program.inputs)
    # (a chain ends at a variable no reshape made: one in `first` is a Function output)
    chains = {
        a: chain
        for a in first
        if (chain := _reshape_chain(a, producer, _reshape)) is not None and chain[0] in first and chain[0] not in inputs
    }
    # An output read by an op stays inside, unless each reader is a reshape whose result is built
    # outside too (y, y.reshape(a), y.reshape(a).reshape(b)); dropping one can drop its sources' readers.
    changed = True
    while changed:
        changed = False
        for a in list(chains):
            if any(e.op is not _reshape or e.outputs[0] not in chains for e in readers.get(a, ())):
                del chains[a]
                changed = True
    outside: dict[int, tuple[int, tuple]] = {}
    for k, a in enumerate(program.outputs):
        if not isinstance(a, Var):
            continue
        if first[a] != k:  # a repeat: the same object as the first position's
            outside[k] = (first[a], ())
        elif a in chains:
            source, shapes = chains[a]
            outside[k] = (first[source], shapes)
    return outside


def _reshape_chain(v: Var, producer: dict, reshape_op) -> tuple[Var, tuple] | None:
    """``(source, shapes)`` when ``v`` is ``source`` reshaped by ``shapes`` in turn, else None."""
    shapes: list = []
    while (e := producer.get(v)) is not None and e.op is reshape_op:
        shapes.append(e.params["shape"])
        v = e.inputs[0]
        if not isinstance(v, Var):
            return None
    return (v, tuple(reversed(shapes))) if shapes else None


def _generate(
    program: OpList, forward: OpList, live: _Liveness, input_labels: Callable[[], list[str]], outside: dict
) -> tuple[str, dict]:
    """Python source of ``infer``, ``forward``, ``backward`` and ``with_constants`` for a plan, and
    its globals; ``outside``: see _outside_outputs."""
    em = _Emitter()
    res_names = {e: f"r{i}" for i, e in enumerate(live.residuals)}
    inputs = ", ".join(em.var(v) for v in program.inputs)

    dead_after = _dead_after(program, forward)

    def forward_body(keep_residuals: bool) -> None:
        for i, e in enumerate(forward.eqns):
            call = f"{em.glob(e.op.fwd, 'f')}({em.args(e)})"
            if e.phase == "forward":  # (a fused step: one residual tuple per op it covers)
                r = "_r" if keep_residuals and any(o in res_names for o in e.covers) else "_"
            else:
                r = res_names.get(e, "_") if keep_residuals else "_"
            single = e.out_tree == LEAF and e.outputs[0] is not None
            # (residuals no one keeps are dropped at once: bound to `_`, the op's inputs they hold
            # lived on until the next op's)
            result = f"{call}[0]" if r == "_" else call
            bound = "" if r == "_" else f", {r}"
            if single:
                em.emit(f"{em.var(e.outputs[0])}{bound} = {result}")
            else:
                em.emit(f"_o{bound} = {result}")
                em.bind(e, "_o")
            if r == "_r":
                em.emit(f"{', '.join(res_names.get(o, '_') for o in e.covers)}, = _r")
            # Free each intermediate after its last use, as eager code does when it rebinds a name:
            # kept to the return, a deep block's activations all lived at once (peak memory grew
            # with depth under no_grad). _o and _r, the op's result tuples, hold tensors too.
            dead = [em.var(v) for v in dead_after[i]] + ([] if single else ["_o"]) + (["_r"] if r == "_r" else [])
            if dead:
                em.emit(f"del {', '.join(dead)}")

    def outputs(in_function: bool) -> str:
        if not in_function:
            return em.pack([_output(em, a) for a in program.outputs], program.out_tree)
        # Inside the Function: constants (a captured tensor the program returns) are left out and put
        # back by the caller (with_constants, below): as outputs of the Function, autograd would give
        # the caller's own tensor a grad_fn. So are the outputs built outside (see
        # _outside_outputs). Variables go through _distinct (see there).
        items = [
            em.atom(a) if isinstance(a, Var) and k not in outside else "None" for k, a in enumerate(program.outputs)
        ]
        if any(isinstance(a, Var) for a in program.outputs):
            em.emit(f"_out = _distinct(({''.join(i + ', ' for i in items)}), ({inputs}{',' if inputs else ''}))")
            items = [f"_out[{k}]" for k in range(len(items))]
        return em.pack(items, program.out_tree)

    em.lines.append(f"def infer({inputs}):")
    forward_body(keep_residuals=False)
    em.emit(f"return {outputs(in_function=False)}")
    em.lines.append(f"def forward({inputs}):")
    forward_body(keep_residuals=True)
    _pruned_residuals(em, live, res_names)
    residuals = "".join(f"{res_names[e]}, " for e in live.residuals)
    em.emit(f"return {outputs(in_function=True)}, ({residuals})")
    _generate_backward(em, program, live, res_names, input_labels, outside)
    # The backward rule of the fused op. Under create_graph / torch.func the backward plan runs as
    # one differentiable op; a plain first-order backward (grad mode off) and compiled code run it
    # directly. (Generated rather than a closure: Dynamo cannot rebuild a closure over an op object,
    # and it resolves the global only on the branch it takes.)
    em.lines.append("def bwd(res, cts):")
    em.emit("if torch.is_grad_enabled() and not torch.compiler.is_compiling():")
    em.emit("    return _backward_op(res, cts)")
    em.emit("return backward(res, cts)")
    # The outputs of the fused op with the constants and the outside outputs it left out put back
    # (see outputs()); the latter in position order, after the kept ones they may be built from.
    em.lines.append("def with_constants(out):")
    if all(isinstance(a, Var) for a in program.outputs) and not outside:
        em.emit("return out")
    else:
        if program.out_tree != LEAF:
            em.emit(f"out = {em.leaves(program.out_tree, 'out')}")
        items = [
            (("out" if program.out_tree == LEAF else f"out[{k}]") if isinstance(a, Var) else _output(em, a))
            for k, a in enumerate(program.outputs)
        ]
        for j in sorted({s for s, _ in outside.values()} - set(outside)):
            em.emit(f"_o{j} = {items[j]}")  # (a kept output an outside one is built from)
            items[j] = f"_o{j}"
        for k, (source, shapes) in sorted(outside.items()):
            em.emit(f"_o{k} = _o{source}{''.join(f'.reshape({em.literal(shape)})' for shape in shapes)}")
            items[k] = f"_o{k}"
        em.emit(f"return {em.pack(items, program.out_tree)}")
    return "\n".join(em.lines) + "\n", em.globals


def _generate_backward(
    em: _Emitter,
    program: OpList,
    live: _Liveness,
    res_names: dict[Eqn, str],
    input_labels: Callable[[], list[str]],
    outside: dict,
) -> None:
    em.lines.append("def backward(res, cts):")
    if res_names:
        em.emit(f"{''.join(f'{n}, ' for n in res_names.values())}= res")
    grads: dict[Var, str] = {}
    present: set[Var] = set()  # cotangents known not to be None
    declare: list[str] = []  # grad variables first assigned inside a conditional step

    def accumulate(v: Var, value: str, known: bool = False, conditional: bool = False) -> None:
        if v in grads:
            em.emit(f"{grads[v]} = _acc({grads[v]}, {value})")
        elif conditional:
            # first assigned in this step's block: None before it (declared outside), so no _acc
            grads[v] = f"g{len(grads)}"
            declare.append(grads[v])
            em.emit(f"{grads[v]} = {value}")
        else:
            grads[v] = f"g{len(grads)}"
            em.emit(f"{grads[v]} = {value}")
        if known:
            present.add(v)

    # The fused op passes symbolic zeros: an unused output's cotangent is None (also a single
    # output's, which autograd's undefined-gradient checks pass).
    if program.out_tree != LEAF:
        em.emit(f"cts = {em.leaves(program.out_tree, 'cts')}")
    for j, a in enumerate(program.outputs):
        if isinstance(a, Var) and a in live.needs and j not in outside:  # (outside: no cotangent, see there)
            accumulate(a, "cts" if program.out_tree == LEAF else f"cts[{j}]")
    for e in live.live:
        # A step none of whose output cotangents is known to exist runs only if one does (at run
        # time: a structural None check, no data): autograd skips such a node, and an FP8 op's
        # backward must not see zeros (it would roll its state as if reached).
        reached = [v for v in e.outputs if v is not None and v in grads]
        conditional = not any(v in present for v in e.outputs if v is not None)
        # inside the block guarded by "g is not None" for a single reached output, that g is present
        inside = set(present) | (set(reached) if conditional and len(reached) == 1 else set())
        outer, outer_declared = em.lines, len(declare)
        if conditional:
            em.lines = []
        items = []
        for v in e.outputs:
            if v is None:
                items.append("None")
                continue
            meta = em.glob((v.shape, v.dtype, v.device), "m")
            g = grads.get(v)
            if e.op.symbolic_zeros or v in inside:
                items.append(g or "None")
            else:
                items.append(f"_zeros_or({g}, {meta})" if g else f"_zeros({meta})")
        owners = _owners(e)
        res = res_names[e] if e.phase != "backward" else f"({''.join(f'{res_names[o]}, ' for o in owners)})"
        needs = ""
        if getattr(e.op, "needs_input_grad", False):
            # which of the step's arguments want cotangents: known per plan variant (see custom_vjp)
            needs = f", needs_input_grad={_step_needs(e, live)!r}"
        em.emit(f"_c = {em.glob(e.op.bwd, 'b')}({res}, {em.pack(items, e.out_tree)}{em.params(e)}{needs})")
        # (checked as custom_vjp checks it: a short tuple raised a bare IndexError below, a long one
        # dropped its extra cotangents silently)
        count = len(e.in_tree.children())
        em.emit(
            f"if (_c.__class__ is not tuple and not isinstance(_c, tuple)) or len(_c) != {count}: "
            f"_bad_cotangents({e.op.name!r}, _c, {count})"
        )
        step_check = em.glob(_StepCheck(e, program, input_labels), "s")
        # (compiling: no check, and pending not read: Dynamo guarded on it, so the first eager
        # backward's check recompiled the compiled caller)
        em.emit(f"if not torch.compiler.is_compiling() and {step_check}.pending: {step_check}.check(_c)")
        # The step consumed its outputs' cotangents (complete: a variable has one producing step):
        # drop them, so an intermediate gradient is freed here, as autograd frees a node's inputs.
        done = [grads[v] for v in e.outputs if v is not None and v in grads]
        if done:
            em.emit(f"{' = '.join(done)} = None")
        offset = 0
        for i, child in enumerate(e.in_tree.children()):
            atoms = e.inputs[offset : offset + child.num_leaves]
            offset += child.num_leaves
            wanted = [(k, a) for k, a in enumerate(atoms) if isinstance(a, Var) and a in live.needs]
            if not wanted:
                continue
            if child == LEAF:
                accumulate(atoms[0], f"_c[{i}]", conditional=conditional)
            else:
                em.emit(f"_t = _c[{i}]")
                em.emit(f"_l = {(None,) * child.num_leaves!r} if _t is None else {em.leaves(child, '_t')}")
                for k, a in wanted:
                    accumulate(a, f"_l[{k}]", conditional=conditional)
        if conditional:
            body, em.lines = em.lines, outer
            for name in declare[outer_declared:]:
                em.emit(f"{name} = None")
            em.emit(f"if {' or '.join(f'{grads[v]} is not None' for v in reached) or 'False'}:")
            em.lines.extend("    " + line for line in body)
    em.emit("return (" + "".join(f"{grads.get(v, 'None')}, " for v in program.inputs) + ")")


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
        self.sources = [(weakref.ref(t), t._version, t.requires_grad, _trace.storage_of(t)) for t in sources]
        # Captured tensors the program holds views of (w.t(), w[:n], w.data), with their storages: a
        # view reads its tensor's values live, but a tensor given a new storage (w.data = ...,
        # module.half().float()) leaves the view on the old one, which the plan kept computing with.
        self.viewed = [(weakref.ref(t), _trace.storage_of(t)) for t in viewed]
        self.bindings: list[tuple] = []  # (see bind)
        self.checks_captured = bool(self._captured or self._opaque_eqns)
        full = self.variant(None)
        self.liveness, self.source, self.infer, self.op = full.liveness, full.source, full.infer, full.op
        self.eager, self.with_constants, self.run_op = full.eager, full.with_constants, full.run_op

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
        viewed = {_trace.storage_of(t) for t in self._captured}
        seen, bound_views = set(), set()
        for owner in modules:
            for name, t in _named_tensors(owner):  # (every name of a tied tensor: rebinding any one of them unties it)
                path = tuple(name.split("."))
                holder = functools.reduce(getattr, path[:-1], owner)
                if (id(holder), path[-1]) in seen:
                    continue
                if id(t) in taken or _trace.storage_of(t) in viewed:
                    seen.add((id(holder), path[-1]))
                    # (a tensor read through a view: its storage is checked with its name, one check)
                    storage = None if id(t) in taken else _trace.storage_of(t)
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
                    self.sources.append((weakref.ref(count), count._version, False, _trace.storage_of(count)))

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
                t._version != version or t.requires_grad != requires_grad or _trace.storage_of(t) != storage
            ):
                return True  # (a new storage: p.data = ..., set_())
        for ref, storage in self.viewed:
            t = ref()
            if t is not None and _trace.storage_of(t) != storage:
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
            if storages and storage is not None and _trace.storage_of(t) != storage:
                return True
        return False

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
        """The op list before and after each rewrite, rules fired and declined (see :func:`explain`)."""
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


def _named_tensor(owner: torch.nn.Module, modules: tuple[str, ...], name: str) -> Tensor | None:
    """The parameter, buffer or plain tensor attribute ``name`` of ``owner``'s submodule at ``modules``,
    through the dicts that ``functional_call`` and attribute assignment write (a plan checks them per
    call: no ``getattr``)."""
    for part in modules:
        owner = owner._modules.get(part)
        if owner is None:
            return None
    t = owner._parameters.get(name)
    if t is None:
        t = owner._buffers.get(name)
    return owner.__dict__.get(name) if t is None else t  # (a plain attribute: pruning's weight)


class _Variant:
    """A plan's generated code for one set of inputs that want gradients (see :meth:`Plan.variant`)."""

    def __init__(self, plan: Plan, needs_grad: tuple[bool, ...] | None):
        program, name = plan.program, plan.name
        wanted = None if needs_grad is None else frozenset(v for v, n in zip(program.inputs, needs_grad) if n)
        self.liveness = _Liveness(program, plan.joint, plan.backward, wanted, frozenset(plan.outside))
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


def _defined_in(fn: Callable, cls: type) -> bool:
    """Whether ``fn`` is a method of ``cls`` (or a base) written in its body: its qualified name is the
    class's plus its own, and its first parameter is ``self``."""
    owner, _, _ = getattr(fn, "__qualname__", "").rpartition(".")
    if not owner or not any(getattr(c, "__qualname__", None) == owner for c in cls.__mro__):
        return False
    return positional_names(fn)[:1] == ["self"]


def _unhashable_error(fused: Fused, leaves: list, spec) -> TraceError:
    """The error for a call whose static (non-tensor) leaves do not all hash: which, where, and, for an
    object that holds tensors functe cannot see, what to do (its tensors would be captured constants)."""
    from ._fp8_state import hides_tensors  # (the FP8 state module imports this one)

    labels = argument_labels(*spec.children(), names=positional_names(fused.__wrapped__))
    bad = []
    for label, leaf in zip(labels, leaves):
        if isinstance(leaf, Tensor):
            continue
        try:
            hash(leaf)
        except TypeError:
            bad.append((label, leaf))
    shown = ", ".join(f"{label} ({type(leaf).__name__})" for label, leaf in bad[:4]) + (" ..." if len(bad) > 4 else "")
    hidden = [label for label, leaf in bad if hides_tensors(leaf)]
    hint = (
        f"; {hidden[0]} holds tensors that functe cannot flatten: use dicts, lists and tuples, or register "
        "its class with functe.pytree_dataclass"
        if hidden
        else ": a set as a frozenset, an array as a tensor"
    )
    return TraceError(
        f"functe.fuse({fused.__name__}): non-tensor arguments are static (a plan per value) and must be "
        f"hashable, got {shown}{hint}"
    )


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
    """What a fused plan's second-order error says (see ``_vjp._HigherOrderGuard``)."""
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
            # (a backstop: each step's cotangents are checked first, see _StepCheck)
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


# ----------------------------------------------------------------------------- the fused function


RETRACE_WARNING = 16
"""After this many traces of one fused function, :class:`RetraceWarning` (once)."""


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
                return plan.run_op(*tensors)  # Dynamo traces the custom_vjp op
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
                    _name_module_parameter(e, [*_trace._reached(self.__wrapped__), *called])
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
            modules = {id(v): v for v in _trace._reached(self.__wrapped__) if isinstance(v, torch.nn.Module)}
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
                if self.stale_retraces == RETRACE_WARNING:
                    self._warn_stale(plan)
                return stale
            self._plans.append(plan)
            index = self._index[key] = self._index[rekeyed] = len(self._plans) - 1
            setattr(self, f"_plan{index}", plan)  # (what compiled code reads: see _compiled_plan)
            if len(self._plans) == RETRACE_WARNING:  # (signatures: stale retraces warn on their own)
                self._warn_retracing(key, leaves)
            self._last_key = key
            return index

    def _warn_stale(self, plan: Plan) -> None:
        """Warn once that changes to captured tensors keep invalidating plans."""
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
        """Warn once that plans pile up, naming the static leaves that changed since the last trace."""
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
        return Fused, (self.__wrapped__, self.rules, self.recipe)

    def __repr__(self):
        return f"fuse({self.__name__})"


class _Bits(str):
    """A static leaf's key text where its value cannot be its key (see _static_key): a float's hex
    bits, a complex number's, a wide numpy scalar's or a decimal's exact text (told apart from a
    ``str`` subclass's value, an ``np.str_`` or a ``StrEnum``, whose key also holds a string under
    another type); ``shown``: the value, for messages."""

    shown: str | None = None


def _bits(text: str, value: Any) -> _Bits:
    key = _Bits(text)
    key.shown = repr(value)
    return key


def _shown(entry: tuple) -> str:
    """A static leaf's key entry as the value it stands for (floats are keyed by their hex bits)."""
    _, value = entry
    if isinstance(value, _Bits):
        return value.shown or repr(float.fromhex(value))
    return repr(value)


def _static_key(x: Any) -> tuple:
    """The cache key of a static leaf: its type and value, with the values that ``==`` calls equal
    but a function can tell apart kept apart: floating values by their bits (``-0.0 == 0.0``; also
    a float subclass such as ``np.float64``), complex numbers by both parts' bits, numpy's other
    floating and complex scalars by their repr (``np.longdouble``: ``float()`` would round it),
    decimals by their text (``Decimal('-0') == 0``), and a frozenset by its elements' keys.
    """
    if isinstance(x, float):
        return (type(x), _Bits(float(x).hex()))
    if isinstance(x, complex):
        return (type(x), _bits(f"{x.real.hex()} {x.imag.hex()}", x))
    kind = getattr(getattr(x, "dtype", None), "kind", None)
    numpy_scalar = type(x).__module__ == "numpy" and type(x).__name__ != "ndarray"  # (an array is unhashable)
    if kind == "f" and numpy_scalar and x.dtype.itemsize <= 8:  # (float() is exact; the type keys the dtype)
        return (type(x), _Bits(float(x).hex()))
    if kind in ("f", "c") and numpy_scalar:  # (repr: exact and signed; the bytes hold x87 padding)
        return (type(x), _bits(repr(x), x))
    if isinstance(x, decimal.Decimal):
        return (type(x), _bits(str(x), x))
    if isinstance(x, frozenset):
        return (type(x), _bits(" ".join(sorted(repr(_static_key(e)) for e in x)), x))
    return (type(x), x)


_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def _dict_keys(tree: tuple) -> tuple:
    """The keys of every dict among ``tree``'s nodes, in insertion order and with their types.

    (One or two ``isinstance`` per value: this runs on every cached call. Nodes other than the
    builtin containers, a ``pytree_dataclass`` or a ``deque`` holding a dict, open one level.)
    """
    found: list = []

    def walk(node) -> None:
        for value in node.values() if isinstance(node, dict) else node:
            if isinstance(value, _CONTAINERS):
                if isinstance(value, dict):
                    found.append((tuple(value), tuple(map(type, value))))
                walk(value)
            elif not isinstance(value, _PLAIN_LEAVES) and not optree.tree_is_leaf(
                value, none_is_leaf=True, namespace=NAMESPACE
            ):
                walk(optree.tree_flatten_one_level(value, none_is_leaf=True, namespace=NAMESPACE).children)

    walk(tree)
    return tuple(found)


def _active_fake_mode():
    """The FakeTensorMode in force, or ``None``."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)


_CONTAINERS = (dict, tuple, list)
_PLAIN_LEAVES = (torch.Tensor, int, float, str, type(None), torch.dtype, torch.device)


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


# ----------------------------------------------------------------------------- torch.compile


def _constant_key(tree: Any, tensors: list) -> Any:
    """A key of plain constants (structure, shapes, dtypes, devices, static leaves) that Dynamo can fold.

    Tensors met on the way are appended to ``tensors`` (Dynamo cannot trace
    optree's flattening of dicts, so this walk stands in for it).
    """
    if isinstance(tree, Tensor):
        tensors.append(tree)
        # operator.index specialises a size Dynamo made symbolic (on a recompile: automatic dynamic
        # shapes; or dynamic=True), with a guard: a plan is per shape anyway, and
        # assume_constant_result cannot take a symbolic argument (int() does not specialise).
        return ("T", tuple(operator.index(d) for d in tree.shape), tree.dtype, tree.device)
    if type(tree) is int:
        return ("S", operator.index(tree))
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return ("nt", type(tree), tuple(_constant_key(t, tensors) for t in tree))
    if isinstance(tree, (tuple, list)):
        return ("seq", type(tree), tuple(_constant_key(t, tensors) for t in tree))
    if isinstance(tree, dict):
        factory = tree.default_factory if isinstance(tree, collections.defaultdict) else None
        values = tuple(_constant_key(v, tensors) for v in tree.values())
        return ("map", type(tree), tuple(tree.keys()), values, factory)
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        names = tuple(f.name for f in dataclasses.fields(tree))
        return ("dc", type(tree), names, tuple(_constant_key(getattr(tree, n), tensors) for n in names))
    if isinstance(tree, float):
        # by its bits (-0.0 is not 0.0: see Fused._lookup); .hex() also specialises a float Dynamo
        # made symbolic, where float() does not
        return ("F", type(tree), tree.hex())
    return ("S", tree)


def _rebuild(key: Any) -> Any:
    """Arguments with shape-only tensors, from a :func:`_constant_key`."""
    kind = key[0]
    if kind == "T":
        return _trace.shape_only(key[1], key[2], key[3])
    if kind == "nt":
        return key[1](*(_rebuild(k) for k in key[2]))
    if kind == "seq":
        return key[1](_rebuild(k) for k in key[2])
    if kind == "map":
        items = zip(key[2], (_rebuild(k) for k in key[3]))
        return key[1](key[4], items) if issubclass(key[1], collections.defaultdict) else key[1](items)
    if kind == "dc":
        return rebuild_dataclass(key[1], key[2], [_rebuild(k) for k in key[3]])
    return key[1](float.fromhex(key[2])) if kind == "F" else key[1]


def _compiled_plan(fused: Fused, index: int) -> Plan:
    # (by attribute, not self._plans[index]: Dynamo guards a list subscript on the list's length,
    # so each new signature's plan recompiled every graph compiled before it)
    return getattr(fused, f"_plan{index}")


def _submodules(fn: Callable) -> list[torch.nn.Module]:
    """The modules ``fn`` reaches by name and all their submodules, each once."""
    found: dict[int, torch.nn.Module] = {}
    for v in _trace._reached(fn):
        if isinstance(v, torch.nn.Module):
            found.update((id(m), m) for m in v.modules())
    return list(found.values())


_TRAINING = operator.attrgetter("training")


def _named_tensors(module: torch.nn.Module, *, attributes: bool = True):
    """``(name, tensor)`` of every parameter and buffer of ``module``, under every name a tied one has,
    and of its plain tensor attributes: a pruned or (classic) weight-normed module's ``weight``, which
    its pre-hook sets anew at every call of the module (read by ``fuse(module.forward)``, the old one
    stayed in the plan)."""
    tensors = (
        (f"{prefix}.{key}" if prefix else key, value)
        for prefix, sub in module.named_modules(remove_duplicate=False)
        for key, value in vars(sub).items()
        if isinstance(value, Tensor)
    )
    named = itertools.chain(
        module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False)
    )
    return itertools.chain(named, tensors) if attributes else named


# (a module takes no parameters as arguments: what to do about a trainable one it captures)
_MODULE_REMEDY = (
    "call the unfused module, or fuse a function taking its parameters (torch.func.functional_call), "
    "or freeze it (requires_grad_(False))"
)


def _name_module_parameter(error: TraceError, reached: list) -> None:
    """Reword the trace's refusal of a trainable captured tensor when it is a parameter or buffer
    of a module the function reaches or called (``'0.weight'``): "pass it as an argument" is no
    remedy for ``fuse(model)``."""
    op_name, tensor = error.capture
    for module in reached:
        if isinstance(module, torch.nn.Module):
            # (parameters and buffers: a plain attribute such as pruning's weight is a product of
            # them, which "freeze it" cannot reach)
            name = next((name for name, t in _named_tensors(module, attributes=False) if t is tensor), None)
            if name is not None:
                error.args = (
                    f"functe.{op_name}: a tensor {describe(tensor)} (the module's {name!r}) captured "
                    f"from the enclosing scope requires gradients; {_MODULE_REMEDY}, otherwise its gradient "
                    "would be silently lost",
                )
                return


# Submodule registrations (`model.act = GELU()`, add_module) on a module some fused function tracks,
# counted by a global hook installed when a fused function first looks for modules: a changed count
# makes each fused function look for its module tree again (see Fused._training_flags). Other
# registrations (a model built elsewhere, make_fx's graph modules) do not count: every fused
# function walked its tree again after each (501 modules: +2.3 ms on the next call).
_REGISTRATIONS = [0]
_REGISTRATION_HOOK: list = []
_TRACKED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def _count_module_registrations() -> None:
    if not _REGISTRATION_HOOK:

        def registered(module, name, submodule):
            if module in _TRACKED:
                _REGISTRATIONS[0] += 1

        registered._functe_check = True  # (no user hook: see _trace._refusing_module_hooks)
        _REGISTRATION_HOOK.append(torch.nn.modules.module.register_module_module_registration_hook(registered))


@torch._dynamo.assume_constant_result
def _find_mode_modules(fused: Fused) -> int:
    """Run by Dynamo at trace time (not traced): :meth:`Fused._training_flags`'s module list."""
    fused._training_flags()
    return 0


def _refresh(fused: Fused, key: Any) -> None:
    """Retrace ``fused``'s plan for ``key`` if it went stale (run eagerly: a graph break)."""
    args, kwargs = _rebuild(key)
    fused._lookup(args, kwargs)


_refresh_outside_graph = torch.compiler.disable(
    _refresh,
    reason=(
        "functe.fuse: the plan folded computations on captured tensors (w.to(torch.bfloat16), 2 * w) "
        "whose in-place updates are checked outside the graph; for fullgraph=True pass those tensors "
        "to the fused function as arguments"
    ),
)


@torch._dynamo.assume_constant_result
def _compiled_plan_index(fused: Fused, key: Any, backend: str, training: tuple) -> tuple[int, tuple[int, ...] | str]:
    """Run by Dynamo at trace time (not traced): find or build the plan.

    Returns the plan's index and the order of the tensors of the
    :func:`_constant_key` walk in the plan's (optree) flattening order; ``backend`` (the one in force,
    which the lookup keys plans by) and ``training`` (the reached modules' flags, keyed too) are arguments
    so that Dynamo guards them: a switch, ``model.eval()``, recompiles. Only
    ints come back into the graph; the plan itself is then read from ``fused``
    so that Dynamo has a real source to guard on. A functe error the trace raises comes back as
    ``(-1, its message)`` (see ``Fused.__call__``); ``training`` ends with ``fused._failed_traces``,
    guarded like the flags (an int argument of its own, Dynamo made symbolic on a recompile).
    """
    args, kwargs = _rebuild(key)
    walked: list[Tensor] = []
    _constant_key((args, kwargs), walked)
    try:
        index, _, tensors = fused._lookup(args, kwargs)
    except FuncteError as error:
        return -1, str(error)  # (the caller runs the call outside the graph, which raises it: see there)
    position = {id(t): i for i, t in enumerate(walked)}
    return index, tuple(position[id(t)] for t in tensors)


@torch.compiler.disable
def _call_outside_graph(fused: Fused, args: tuple, kwargs: dict) -> Any:
    """``fused(*args, **kwargs)`` run eagerly: for a compiled call whose trace raised (see
    ``Fused.__call__``); when it runs, the compiled caller recompiles at its next call."""
    out = fused(*args, **kwargs)
    fused._failed_traces += 1
    return out
