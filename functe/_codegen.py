"""A fused plan compiled to straight-line Python: the emitter, residual liveness, and the
generated ``infer``, ``forward``, ``backward`` and ``with_constants`` (see :mod:`functe._fuse`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import optree
import torch

from ._oplist import LEAF, Eqn, Literal, OpList, Var, flat_spec
from ._tree import (
    is_pytree_dataclass,
    rebuild_dataclass,
    tree_leaves,
    tree_unflatten,
)
from ._vjp_checks import (
    _flatten_cotangents,
    argument_needs,
    cotangent_count_error,
    input_labels,
)
from ._vjp_layout import _Call

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


def _apart_from(outputs: tuple, inputs: tuple) -> tuple:
    """``outputs`` with a view in place of any tensor that is one of ``inputs`` (see _generate's infer);
    one view per input, so an output returned twice stays one object, as unfused."""
    views: dict[int, Tensor] = {}
    result = []
    for t in outputs:
        if isinstance(t, Tensor) and any(t is i for i in inputs):
            t = views.setdefault(id(t), t.view_as(t))
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
            "_apart_from": _apart_from,
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

    def __init__(self, program: OpList, joint: OpList, backward: OpList, wanted: frozenset | None = None, outside=None):
        # wanted: the inputs whose gradients are asked for (None: every float input); outside: the
        # output positions built outside the fused op (see _outside_outputs), which get no cotangent
        # but where the op carries an intermediate, which gets it
        outside = Outside() if outside is None else outside
        needs = {v for v in program.inputs if v.dtype.is_floating_point and (wanted is None or v in wanted)}
        for e in joint.eqns:
            if any(isinstance(a, Var) and a in needs for a in e.inputs):
                needs.update(v for v in e.outputs if _is_float_var(v))
        has = {v for k, a in enumerate(program.outputs) if _is_float_var(v := outside.returned(k, a)) and v in needs}

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


def _dead_after(program: OpList, forward: OpList, carried=()) -> list[list[Var]]:
    """Per forward step, the variables no later step reads (intermediates only: the program's inputs
    stay the caller's, and its outputs, and the intermediates the fused op carries, are returned)."""
    keep = set(program.inputs) | {a for a in program.outputs if isinstance(a, Var)} | set(carried)
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


class Outside(dict):
    """Output positions the fused op leaves out and its caller builds from its other outputs:
    ``{position: (source position, shapes)}``, the source reshaped by each of ``shapes`` in turn;
    ``carried``: ``{position: variable}`` for the positions where the fused op returns, in place of
    the program's output, the variable it reshapes (see :func:`_outside_outputs`); ``shadowed``: the
    positions where the fused op returns the program's output all the same (an op read it inside)
    and its caller discards it."""

    def __init__(self):
        super().__init__()
        self.carried: dict[int, Var] = {}
        self.shadowed: set[int] = set()

    def returned(self, k: int, a) -> Var | None:
        """The variable the fused op returns in output position ``k`` (the program's output there is
        ``a``): ``None`` where it returns nothing (a constant, an output built outside)."""
        if k in self.carried:
            return self.carried[k]
        if isinstance(a, Var) and (k not in self or k in self.shadowed):
            return a
        return None


def _outside_outputs(program: OpList) -> Outside:
    """The outputs the fused op leaves out, built by its caller (see :class:`Outside`).

    They are the outputs that alias another output or an intermediate in the unfused function: one
    returned twice (``return y, y``), and the reshapes of an output or of an intermediate that no
    op reads but another such reshape (``y, y.reshape(...)``, ``gelu(x).reshape(-1)``).
    Returned by an autograd.Function, the second of two aliases is a view of the first that
    autograd forbids writing to ("Output 1 of ... is a view and its base ... has been modified
    inplace"), where the unfused function returns the same tensor, or a view torch's own view op
    made; built outside, they are the same objects and views. A reshape of an intermediate is the
    same: the fused op returns the intermediate in the first such output's position (carried) and
    the caller reshapes it, as the unfused function's torch view op does (returned from inside,
    compiled code refused an in-place write on it: "Output 0 of CompiledFunction is a view and is
    being modified inplace"). A reshape an op reads is made inside too (it may be a residual, which
    double backward differentiates through only as an output of the Function): where its source is
    another output, or carried, the fused op still returns it (shadowed), but the caller builds that
    position from the source, and a write on either output reaches the other as unfused (two views
    of one buffer returned by a Function refused writes). Left inside: a reshape of an input. (An
    input returned stays an output of the Function too, a view of the input: its gradient then adds
    the output's cotangent in the order the unfused graph does.)
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
    # A reshape read by an op stays inside, unless each reader is a reshape whose result can be
    # built outside too, returned or not (y, y.reshape(a), y.reshape(a).reshape(b)); dropping one
    # can drop its sources' readers.
    movable = {e.outputs[0] for e in program.eqns if e.op is _reshape}
    changed = True
    while changed:
        changed = False
        for v in list(movable):
            if any(e.op is not _reshape or e.outputs[0] not in movable for e in readers.get(v, ())):
                movable.discard(v)
                changed = True
    # (a chain ends at a variable no reshape made: an output of the Function, or an intermediate)
    chains = {
        a: chain
        for a in first
        if a in movable and (chain := _reshape_chain(a, producer, _reshape)) and chain[0] not in inputs
    }
    outside = Outside()
    for k, a in enumerate(program.outputs):
        if not isinstance(a, Var):
            continue
        if first[a] != k:  # a repeat: the same object as the first position's
            outside[k] = (first[a], ())
        elif a in chains:
            source, shapes = chains[a]
            if source not in first:  # an intermediate: carried in this position (the first of its reshapes)
                first[source] = k
                outside.carried[k] = source
            outside[k] = (first[source], shapes)
    for k, a in enumerate(program.outputs):
        if isinstance(a, Var) and first[a] == k and k not in outside:
            chain = _reshape_chain(a, producer, _reshape)
            if chain is not None and chain[0] in first and chain[0] not in inputs:
                outside[k] = (first[chain[0]], chain[1])
                outside.shadowed.add(k)
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
    program: OpList, forward: OpList, live: _Liveness, input_labels: Callable[[], list[str]], outside: Outside
) -> tuple[str, dict]:
    """Python source of ``infer``, ``forward``, ``backward`` and ``with_constants`` for a plan, and
    its globals; ``outside``: see _outside_outputs."""
    em = _Emitter()
    res_names = {e: f"r{i}" for i, e in enumerate(live.residuals)}
    inputs = ", ".join(em.var(v) for v in program.inputs)

    dead_after = _dead_after(program, forward, outside.carried.values())

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
            items = [_output(em, a) for a in program.outputs]
            # An op's output that is the caller's own tensor at run time (identity's forward rule hands
            # back its input) becomes a view, as the unfused op returns: a caller donating it
            # (add_extra_input(..., in_place=True)) wrote their input. An input the function returns
            # itself stays the object the unfused function returns; so, unlike unfused, does an op
            # whose trace records nothing (dropout with p = 0, a collective on one rank).
            made = [k for k, a in enumerate(program.outputs) if isinstance(a, Var) and a not in program.inputs]
            if made:
                em.emit(
                    f"_out = _apart_from(({''.join(items[k] + ', ' for k in made)}), ({inputs}{',' if inputs else ''}))"
                )
                for j, k in enumerate(made):
                    items[k] = f"_out[{j}]"
            return em.pack(items, program.out_tree)
        # Inside the Function: constants (a captured tensor the program returns) are left out and put
        # back by the caller (with_constants, below): as outputs of the Function, autograd would give
        # the caller's own tensor a grad_fn. So are the outputs built outside (see
        # _outside_outputs). Variables go through _distinct (see there).
        returned = [outside.returned(k, a) for k, a in enumerate(program.outputs)]
        items = ["None" if v is None else em.var(v) for v in returned]
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
        for k in sorted(outside.carried):
            em.emit(f"_c{k} = {items[k]}")  # (an intermediate the op carries in an outside position)
        for k, (source, shapes) in sorted(outside.items()):
            # (a repeat, no shapes, is the source position's output; a reshape reshapes its source
            # variable, the carried intermediate or a kept output)
            base = f"_c{source}" if shapes and source in outside.carried else f"_o{source}"
            em.emit(f"_o{k} = {base}{''.join(f'.reshape({em.literal(shape)})' for shape in shapes)}")
            items[k] = f"_o{k}"
        em.emit(f"return {em.pack(items, program.out_tree)}")
    _generate_compiled_outputs(em, program)
    return "\n".join(em.lines) + "\n", em.globals


def _generate_compiled_outputs(em: _Emitter, program: OpList) -> None:
    """``compiled_outputs(out, inputs, constant)``: the fused op's outputs under torch.compile with an
    input the function returns as that input itself, and the outputs at ``constant`` (positions no
    input that requires grad reaches) detached. Eagerly the node marks those non-differentiable and
    returns a returned input as a view torch's autograd allows writing; in a compiled graph every
    output of the Function required grad (``autograd.grad`` gave zeros where unfused gives None) and
    a returned input was a view a write refused ("returns multiple views")."""
    em.lines.append("def compiled_outputs(out, inputs, constant):")
    if program.out_tree != LEAF:
        em.emit(f"out = {em.leaves(program.out_tree, 'out')}")
    items = []
    for k, a in enumerate(program.outputs):
        item = "out" if program.out_tree == LEAF else f"out[{k}]"
        if isinstance(a, Var) and a in program.inputs:
            item = f"inputs[{program.inputs.index(a)}]"
        elif isinstance(a, Var):
            item = f"({item}.detach() if {k} in constant else {item})"
        items.append(item)
    em.emit(f"return {em.pack(items, program.out_tree)}")


def _generate_backward(
    em: _Emitter,
    program: OpList,
    live: _Liveness,
    res_names: dict[Eqn, str],
    input_labels: Callable[[], list[str]],
    outside: Outside,
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
        # (each variable the op returns: outside positions get no cotangent, but for an intermediate
        # the op carries there, and a shadowed one's, which only a second order gives; see
        # _outside_outputs)
        v = outside.returned(j, a)
        if v is not None and v in live.needs:
            accumulate(v, "cts" if program.out_tree == LEAF else f"cts[{j}]")
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
