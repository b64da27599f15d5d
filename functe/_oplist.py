"""The op list: functe's small SSA IR of traced programs, in the style of a jaxpr.

* :class:`Var` is a value with a shape, a dtype and the device it will live on.
  Vars are compared by identity; names are given only when printing.
* :class:`Literal` is a constant inlined into an equation: ``None`` (an absent
  optional argument), a Python number, or a tensor captured from the
  surrounding scope.
* :class:`Eqn` applies one op (a :class:`functe.CustomVJP`) to flat input atoms
  with static params, defining flat output vars. ``in_tree`` / ``out_tree``
  rebuild the op's pytree arguments and results. A *fused* equation, made by a
  rewrite rule, also records the original equations it ``covers`` and the
  rule's ``phase``.
* :class:`OpList` is a whole program: input vars, equations in execution
  order, output atoms, and the pytree structures of the caller's arguments and
  results.

``str(oplist)`` is the one canonical printout (golden tests compare it)::

    { lambda a:f32[4,8] b:f32[16,8] c:f32[16]. let
        d:f32[4,16] = linear a b c
        e:f32[4,16] = constant_scale[scale=0.5] d
      in (e,) }

:func:`check_oplist` validates the structure (SSA, definition before use,
arity against the pytree structures).
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ._errors import TraceError, describe, dtype_name
from ._tree import PyTreeSpec, tree_structure

Tensor = torch.Tensor


class Var:
    """A traced value: shape, dtype and the (real) device it lives on.

    Example:
        >>> import torch
        >>> Var((4, 16), torch.float32, "cpu").aval
        'f32[4,16]'
    """

    __slots__ = ("device", "dtype", "shape")

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device):
        self.shape = tuple(int(d) for d in shape)
        self.dtype = dtype
        self.device = torch.device(device)

    @property
    def aval(self) -> str:
        """The type as printed: ``f32[4,16]``."""
        return f"{dtype_name(self.dtype)}[{','.join(str(d) for d in self.shape)}]"

    def __repr__(self):
        return f"Var({self.aval})"


class Literal:
    """A constant atom: ``None``, a Python number, or a captured tensor.

    ``fresh``: a tensor the traced function made itself (``torch.zeros(8)``, a folded ``2 * w``);
    returned as a program output it is copied on every call, as the function would make a new one
    (the caller may change it in place).
    """

    __slots__ = ("fresh", "value")

    def __init__(self, value: Any, fresh: bool = False):
        self.value = value
        self.fresh = fresh

    def __repr__(self):
        return f"Literal({_literal_text(self.value)})"


Atom = Var | Literal


def is_none(atom: Atom) -> bool:
    """Whether ``atom`` is the literal ``None`` (an absent optional argument)."""
    return isinstance(atom, Literal) and atom.value is None


def flat_spec(n: int) -> PyTreeSpec:
    """The pytree structure of a tuple of ``n`` leaves."""
    return tree_structure((0,) * n)


LEAF = tree_structure(0)


class Eqn:
    """``outputs = op(*inputs, **params)``; see the module docstring.

    Args:
        op: the op (a :class:`functe.CustomVJP`, or anything with ``name``,
            ``fwd`` and ``bwd``).
        inputs: flat input atoms (the leaves of the op's positional arguments).
        outputs: flat output vars (``None`` for an output leaf that is ``None``).
        params: static keyword arguments.
        in_tree: structure of the positional-argument tuple; defaults to one
            leaf per argument.
        out_tree: structure of the op's result; defaults to a single leaf for
            one output, else a tuple.
        covers: for a fused equation, the original equations it replaces (in
            program order).
        phase: ``None`` for an original equation; the rule's phase for a fused one.
    """

    __slots__ = ("covers", "in_tree", "inputs", "op", "out_tree", "outputs", "params", "phase")

    def __init__(
        self,
        op,
        inputs: Sequence[Atom],
        outputs: Sequence[Var | None],
        params: dict[str, Any] | None = None,
        *,
        in_tree: PyTreeSpec | None = None,
        out_tree: PyTreeSpec | None = None,
        covers: Sequence[Eqn] = (),
        phase: str | None = None,
    ):
        self.op = op
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.params = dict(params or {})
        self.in_tree = flat_spec(len(self.inputs)) if in_tree is None else in_tree
        if out_tree is None:
            out_tree = LEAF if len(self.outputs) == 1 else flat_spec(len(self.outputs))
        self.out_tree = out_tree
        self.covers = tuple(covers)
        self.phase = phase

    @property
    def name(self) -> str:
        return self.op.name

    def replace(self, **changes) -> Eqn:
        """A copy with some fields changed."""
        fields = {k: getattr(self, k) for k in self.__slots__}
        fields.update(changes)
        return Eqn(fields.pop("op"), fields.pop("inputs"), fields.pop("outputs"), fields.pop("params"), **fields)

    @property
    def originals(self) -> tuple[Eqn, ...]:
        """The original (traced) equations this one stands for: itself, or what it covers."""
        return self.covers if self.covers else (self,)

    def __repr__(self):
        return f"Eqn({self.name})"


class OpList:
    """A traced program (see the module docstring).

    ``in_tree`` is the structure of ``(args, kwargs)`` of the traced call, with
    ``static`` holding its non-tensor leaves (``position -> value``); ``inputs``
    are the vars of its tensor leaves, in flattening order.

    Example:
        >>> import torch, functe
        >>> program = functe.trace(lambda x, y: x + 2.0 * y)(torch.ones(2), torch.ones(2))
        >>> [v.aval for v in program.inputs], [e.name for e in program.eqns]
        (['f32[2]', 'f32[2]'], ['constant_scale', 'add_extra_input'])
        >>> eqn = program.eqns[0]
        >>> eqn.params, eqn.inputs[0] is program.inputs[1], isinstance(eqn.outputs[0], functe.Var)
        ({'scale': 2.0}, True, True)
    """

    __slots__ = ("eqns", "in_tree", "inputs", "out_tree", "outputs", "static")

    def __init__(
        self,
        inputs: Sequence[Var],
        eqns: Sequence[Eqn],
        outputs: Sequence[Atom],
        *,
        in_tree: PyTreeSpec | None = None,
        out_tree: PyTreeSpec | None = None,
        static: dict[int, Any] | None = None,
    ):
        self.inputs = tuple(inputs)
        self.eqns = tuple(eqns)
        self.outputs = tuple(outputs)
        self.in_tree = flat_spec(len(self.inputs)) if in_tree is None else in_tree
        self.out_tree = flat_spec(len(self.outputs)) if out_tree is None else out_tree
        self.static = dict(static or {})

    def replace(self, **changes) -> OpList:
        fields = {k: getattr(self, k) for k in self.__slots__}
        fields.update(changes)
        return OpList(fields.pop("inputs"), fields.pop("eqns"), fields.pop("outputs"), **fields)

    def producers(self) -> dict[Var, tuple[Eqn, int]]:
        """Var -> (the equation defining it, output index)."""
        return {v: (e, i) for e in self.eqns for i, v in enumerate(e.outputs) if v is not None}

    def uses(self) -> dict[Var, int]:
        """Var -> number of uses (each input slot of each equation, and each program output, counts once)."""
        count: dict[Var, int] = {}
        for atom in (*(a for e in self.eqns for a in e.inputs), *self.outputs):
            if isinstance(atom, Var):
                count[atom] = count.get(atom, 0) + 1
        return count

    def __str__(self):
        return format_oplist(self)

    def __repr__(self):
        return format_oplist(self)


# ----------------------------------------------------------------------------- printing


def _var_names():
    """a, b, ..., z, ba, bb, ... (jaxpr's scheme: base 26 with digits a-z)."""
    n = 0
    while True:
        digits, k = [], n
        while True:
            digits.append(chr(ord("a") + k % 26))
            k //= 26
            if k == 0:
                break
        n += 1
        yield "".join(reversed(digits))


def _literal_text(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"const:{describe(value)}"
    return repr(value)


def _param_text(value: Any) -> str:
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    if isinstance(value, enum.Enum):
        return value.name
    if _generated_repr(value):
        # Configuration values (recipes) print their non-default fields only: readable printouts.
        # A dataclass that writes its own __repr__ (e.g. LinearParallelism) prints with it.
        fields = [
            f"{f.name}={_param_text(getattr(value, f.name))}"
            for f in dataclasses.fields(value)
            if f.repr and _differs(getattr(value, f.name), f.default)
        ]
        return f"{type(value).__name__}({', '.join(fields)})"
    return repr(value)


def _generated_repr(value: Any) -> bool:
    """A dataclass instance whose ``__repr__`` is the one ``dataclasses`` generated (it wraps a helper)."""
    return (
        dataclasses.is_dataclass(value) and not isinstance(value, type) and hasattr(type(value).__repr__, "__wrapped__")
    )


def _differs(value: Any, default: Any) -> bool:
    try:
        return bool(value != default)
    except Exception:  # (a value whose comparison is not a bool, e.g. a tensor: print it)
        return True


def _op_names(eqns: Iterable[Eqn]) -> dict[Any, str]:
    """Printed op names; distinct ops that share a name get ``#2``, ``#3`` suffixes."""
    names: dict[Any, str] = {}
    taken: dict[str, int] = {}
    for e in eqns:
        if e.op in names:
            continue
        k = taken.get(e.name, 0) + 1
        taken[e.name] = k
        names[e.op] = e.name if k == 1 else f"{e.name}#{k}"
    return names


def format_oplist(oplist: OpList, op_names: dict[Any, str] | None = None) -> str:
    """The canonical jaxpr-style printout of ``oplist`` (see the module docstring); ``op_names``
    (from :func:`_op_names`) keeps one op's ``#2`` suffix across several printouts."""
    names = _var_names()
    env: dict[Var, str] = {}

    def define(v: Var | None) -> str:
        if v is None:
            return "_"
        env[v] = next(names)
        return f"{env[v]}:{v.aval}"

    def use(atom: Atom) -> str:
        if isinstance(atom, Literal):
            return _literal_text(atom.value)
        return env.get(atom, f"<undefined {atom.aval}>")

    head = " ".join(define(v) for v in oplist.inputs)
    lines = [f"{{ lambda {head}. let" if head else "{ lambda . let"]
    ops = _op_names(oplist.eqns) if op_names is None else op_names
    for e in oplist.eqns:
        params = " ".join(f"{k}={_param_text(v)}" for k, v in sorted(e.params.items()))
        call = ops[e.op] + (f"[{params}]" if params else "")
        args = " ".join(use(a) for a in e.inputs)
        lhs = " ".join(define(v) for v in e.outputs)
        lines.append(f"    {lhs} = {call}" + (f" {args}" if args else ""))
    outs = ", ".join(use(a) for a in oplist.outputs)
    lines.append(f"  in ({outs},) }}" if len(oplist.outputs) == 1 else f"  in ({outs}) }}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- validation and ordering


def check_oplist(oplist: OpList) -> None:
    """Validate ``oplist``; raise :class:`~functe.TraceError` naming the first problem.

    Checks: every var is defined once (as a program input or by one equation)
    and before it is used; atoms are :class:`Var` or :class:`Literal`; each
    equation's arity matches its ``in_tree`` / ``out_tree``; fused equations
    name a phase and cover at least one original equation.

    Example:
        >>> import torch, functe
        >>> program = functe.trace(lambda x: 2.0 * x)(torch.ones(3))
        >>> functe.check_oplist(program)  # valid: returns None
        >>> functe.check_oplist(program.replace(eqns=program.eqns * 2))  # its output defined twice
        Traceback (most recent call last):
        ...
        functe._errors.TraceError: functe.check_oplist: eqn 1 (constant_scale) redefines Var(f32[3]) ...
    """
    if not isinstance(oplist, OpList):
        raise TraceError(
            f"functe.check_oplist: argument 'oplist' expected an OpList (functe.trace's result), got {oplist!r}"
        )
    defined: set[int] = set()

    def define(v: Any, where: str) -> None:
        if not isinstance(v, Var):
            raise TraceError(f"functe.check_oplist: {where} defines {v!r}, expected a Var")
        if id(v) in defined:
            raise TraceError(f"functe.check_oplist: {where} redefines {v!r} (vars are defined once)")
        defined.add(id(v))

    def use(a: Any, where: str) -> None:
        if isinstance(a, Literal):
            return
        if not isinstance(a, Var):
            raise TraceError(f"functe.check_oplist: {where} uses {a!r}, expected a Var or Literal")
        if id(a) not in defined:
            raise TraceError(f"functe.check_oplist: {where} uses {a!r} before it is defined")

    for i, v in enumerate(oplist.inputs):
        define(v, f"input {i}")
    for k, e in enumerate(oplist.eqns):
        where = f"eqn {k} ({e.name})"
        if len(e.inputs) != e.in_tree.num_leaves:
            raise TraceError(
                f"functe.check_oplist: {where} has {len(e.inputs)} inputs, its in_tree {e.in_tree.num_leaves}"
            )
        if len(e.outputs) != e.out_tree.num_leaves:
            raise TraceError(
                f"functe.check_oplist: {where} has {len(e.outputs)} outputs, its out_tree {e.out_tree.num_leaves}"
            )
        if (e.phase is None) != (not e.covers):
            raise TraceError(f"functe.check_oplist: {where}: a fused equation needs both a phase and covers")
        for a in e.inputs:
            use(a, where)
        for v in e.outputs:
            if v is not None:
                define(v, where)
    for a in oplist.outputs:
        use(a, "the program outputs")
    if len(oplist.outputs) != oplist.out_tree.num_leaves:
        raise TraceError("functe.check_oplist: the output count does not match out_tree")


def without_dead_code(oplist: OpList) -> OpList:
    """``oplist`` without the equations none of whose outputs reaches the program's outputs.

    Every op is pure (state flows through arguments and results), so an equation whose results
    nobody uses changes nothing; dropping it keeps the rules from matching a dead end (a match must
    define every output used outside it, and a dead one has none) and saves its work.

    Example:
        >>> import torch, functe
        >>> def f(x, w):
        ...     unused = functe.ops.linear(x, w)
        ...     return functe.ops.gelu(x)
        >>> traced = functe.trace(f)(torch.ones(2, 4), torch.ones(3, 4))
        >>> len(traced.eqns), len(without_dead_code(traced).eqns)
        (2, 1)
    """
    live = {id(a) for a in oplist.outputs if isinstance(a, Var)}
    kept: list[Eqn] = []
    for e in reversed(oplist.eqns):
        if any(v is not None and id(v) in live for v in e.outputs):
            kept.append(e)
            live.update(id(a) for a in e.inputs if isinstance(a, Var))
    if len(kept) == len(oplist.eqns):
        return oplist
    return oplist.replace(eqns=tuple(reversed(kept)))


def toposort(eqns: Sequence[Eqn], priority: dict[Eqn, float]) -> list[Eqn] | None:
    """Order ``eqns`` so every var is defined before use, preferring low ``priority`` first.

    Returns ``None`` if the dependencies have a cycle (a fusion that is not convex).
    """
    producer = {v: e for e in eqns for v in e.outputs if v is not None}
    deps = {e: {producer[a] for a in e.inputs if isinstance(a, Var) and a in producer} for e in eqns}
    users: dict[Eqn, list[Eqn]] = {e: [] for e in eqns}
    for e, ds in deps.items():
        for d in ds:
            users[d].append(e)
    waiting = {e: len(ds) for e, ds in deps.items()}
    order = {e: i for i, e in enumerate(eqns)}
    ready = [(priority[e], order[e], e) for e in eqns if waiting[e] == 0]
    heapq.heapify(ready)
    out: list[Eqn] = []
    while ready:
        _, _, e = heapq.heappop(ready)
        out.append(e)
        for u in users[e]:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, (priority[u], order[u], u))
    return out if len(out) == len(eqns) else None
