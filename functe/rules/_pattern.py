"""Fusion rules as data: patterns over op lists, rules, rule sets, and the rewrite driver.

A :class:`Pattern` is a tree over dataflow edges rooted at the *last* op of a
fusion: ``Pattern(add_extra_input, Pattern(linear, "x", "w", "b"), "r")``
matches an ``add_extra_input`` whose first input is produced by a ``linear``.
Inputs of a pattern node are

* a string: a named capture of whatever atom is there (``"_"`` matches
  anything without capturing; a name used twice must see the same atom);
* ``None``: the input must be the literal ``None`` (an absent optional argument);
* a nested :class:`Pattern`: the input must be a var produced by a matching
  equation. That producer's output must have this single consumer, unless the
  nested pattern says ``shared=True`` (the fused op then also produces it);
* ``...`` as the *last* input: any further inputs, not captured (for ops whose
  arity varies, e.g. ``fp8_linear`` with a state pytree or ``None``; the rewrite
  reads them with ``m.args(name)``).

A :class:`Rule` couples a pattern with a phase, an optional ``condition``
(``None`` to accept, or a *reason* string to decline, shown by
``functe.explain``) and a ``rewrite`` returning the fused equation (usually
``m.fuse(op, inputs, outputs)``). Phases (see docs/fusion.md):

* ``"forward"``: the fused op's forward rule replaces the covered ops'
  forwards and must return ``(out, (res_1, ..., res_k))``: exactly the
  residuals the covered ops' own forward rules return, in pattern order (a
  node's nested inputs, as the pattern lists them, before the node: for a
  chain, program order), so
  that the unfused (or separately fused) backward can consume them;
* ``"backward"``: the fused op's backward rule replaces the covered ops'
  backwards; it receives ``(res_1, ..., res_k)`` as the covered forwards made them;
* ``"joint"``: the fused op replaces the covered ops in both passes, with
  residuals of its own.

A :class:`RuleSet` is an ordered, immutable collection; ``a + b`` concatenates
(rule names must be unique). :func:`rewrite` applies one phase's rules to a
fixed point: rules are tried in order, each everywhere it matches, repeatedly,
until nothing fires (or ``max_rewrites`` is exceeded), counting matches per rule
and collecting the reasons of declined matches.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._errors import ArgumentError, FuncteError, RuleError, TraceError, as_int, describe, shown_number
from .._oplist import Atom, Eqn, Literal, OpList, Var, check_oplist, is_none, toposort
from .._pickling import global_name, named
from .._rng import RandomState
from .._trace import forward_on_meta
from .._tree import tree_flatten, tree_unflatten
from .._vjp import CustomVJP

PHASES = ("joint", "forward", "backward")


class Pattern:
    """One node of a pattern (see the module docstring).

    Args:
        op: the op to match (a :class:`functe.CustomVJP`), or a tuple of alternatives.
        *inputs: one entry per flat input of the op: a capture name, ``None``,
            or a nested :class:`Pattern`; a last ``...`` stands for any remaining inputs.
        name: capture name for the matched equation (``m.eqn(name)``).
        out: for a nested pattern, the output index of this op that must feed
            the consumer (``None``: any; ``m.edge(name)`` tells which).
        commutative: also try the first two inputs swapped.
        shared: for a nested pattern, the feeding output may have other consumers.

    Example:
        >>> from functe.ops import _core
        >>> from functe.rules import Pattern
        >>> p = Pattern(_core._add_extra_input, Pattern(_core._linear, "x", "w", "b", name="lin"), "r")
        >>> p.inputs[1], p.inputs[0].name  # (Rule's example uses it)
        ('r', 'lin')
    """

    __slots__ = ("commutative", "inputs", "name", "op", "out", "shared", "variadic")

    def __init__(
        self,
        op,
        *inputs: str | Pattern | None,
        name: str | None = None,
        out: int | None = None,
        commutative: bool = False,
        shared: bool = False,
    ):
        self.op = op if isinstance(op, tuple) else (op,)
        for alternative in self.op:
            if not isinstance(alternative, CustomVJP):
                # (a public function, ops.linear, never matches: the rule would silently never fire)
                hint = (
                    " (the op a public function calls, e.g. functe.ops._core._linear)" if callable(alternative) else ""
                )
                raise RuleError(
                    f"functe.rules.Pattern: argument 'op' expected a functe op (CustomVJP) or a tuple of them{hint}, "
                    f"got {describe(alternative)}"
                )
        for arg, value in (("commutative", commutative), ("shared", shared)):
            if not isinstance(value, bool):
                raise RuleError(f"functe.rules.Pattern: argument '{arg}' expected a bool, got {value!r}")
        if not (name is None or isinstance(name, str)) or not (out is None or type(out) is int):
            raise RuleError(
                f"functe.rules.Pattern: 'name' must be a str or None and 'out' an int or None, got {name!r}, {out!r}"
            )
        self.variadic = bool(inputs) and inputs[-1] is Ellipsis
        inputs = inputs[:-1] if self.variadic else inputs
        self.inputs = inputs
        self.name = name
        self.out = out
        self.commutative = commutative
        self.shared = shared
        for i in inputs:
            if not (i is None or isinstance(i, (str, Pattern))):
                raise RuleError(f"functe.rules.Pattern: inputs are capture names, None or Patterns, got {i!r}")

    def __repr__(self):
        args = ", ".join([*(repr(i) for i in self.inputs), *(["..."] if self.variadic else [])])
        return f"{'|'.join(op.name for op in self.op)}({args})"


class Match:
    """A successful structural match, handed to a rule's condition and rewrite.

    ``m["x"]`` is the atom captured as ``"x"``; ``m.eqn("lin")`` the equation
    captured by the pattern node named ``"lin"``; ``m.edge("lin")`` which of its
    outputs feeds its consumer. ``covered`` lists the matched equations in
    pattern order (post-order: a node's nested inputs, as the pattern lists them,
    before the node; for a chain, program order) and ``outputs`` their outputs
    used outside the match, in that order (the
    fused equation must define all of them). ``recipe`` is the executor's recipe.

    Example:
        >>> import torch, functe
        >>> from functe import ops
        >>> from functe.ops import _core
        >>> from functe.rules import Pattern, Rule, RuleSet, rewrite
        >>> seen = []
        >>> spy = Rule("spy", "forward", Pattern(_core._linear, "x", "w", None, name="lin"), lambda m: None,
        ...            condition=lambda m: seen.append((m["w"].aval, m.eqn("lin").name)) or "only looking")
        >>> program = functe.trace(lambda x, w: ops.linear(x, w))(torch.ones(2, 3), torch.ones(5, 3))
        >>> _ = rewrite(program, RuleSet([spy]), "forward")
        >>> seen
        [('f32[5,3]', 'linear')]
    """

    def __init__(self, rule: Rule, captures, eqns, edges, covered, outputs, recipe):
        self.rule = rule
        self.captures: dict[str, Atom] = captures
        self.eqns: dict[str, Eqn] = eqns
        self.edges: dict[str, int] = edges
        self.covered: tuple[Eqn, ...] = covered
        self.outputs: tuple[Var, ...] = outputs
        self.recipe = recipe

    def __getitem__(self, name: str) -> Atom:
        return self.captures[name]

    def eqn(self, name: str) -> Eqn:
        return self.eqns[name]

    def edge(self, name: str) -> int:
        return self.edges[name]

    def params(self, name: str) -> dict[str, Any]:
        return self.eqns[name].params

    def args(self, name: str) -> tuple:
        """The positional arguments of the equation captured as ``name``, with atoms as leaves
        (a state pytree comes back as that pytree of atoms)."""
        e = self.eqns[name]
        return tree_unflatten(e.in_tree, list(e.inputs))

    def fuse(self, op, inputs: Sequence[Any], outputs: Sequence[Var] | None = None, **params) -> Eqn:
        """The fused equation ``outputs = op(*inputs, **params)`` (outputs default to ``self.outputs``).

        ``inputs`` are atoms, or pytrees of atoms for pytree arguments (from :meth:`args`); a plain
        ``None`` (an absent bias) is the literal ``None``.
        """
        leaves, in_tree = tree_flatten(tuple(inputs))
        leaves = [Literal(None) if leaf is None else leaf for leaf in leaves]
        for leaf in leaves:
            if not isinstance(leaf, (Var, Literal)):
                raise RuleError(
                    f"Match.fuse: inputs must be atoms of the op list (m['name'], m.args(...)) or None, got "
                    f"{describe(leaf)}"
                )
        return Eqn(op, leaves, self.outputs if outputs is None else outputs, params, in_tree=in_tree)


@dataclass(frozen=True)
class Rule:
    """A rewrite rule (see the module docstring).

    Args:
        name: unique within a rule set; counters and explanations use it.
        phase: ``"forward"``, ``"backward"`` or ``"joint"``.
        pattern: the :class:`Pattern` to find.
        rewrite: ``rewrite(m: Match) -> Eqn``.
        condition: ``condition(m: Match) -> str | None``: a non-empty reason to decline, or ``None``.
        doc: one line saying what the rule does (``lhs -> rhs``).

    Example:
        >>> import torch, functe
        >>> from functe import ops
        >>> from functe.ops import _core, _fused
        >>> from functe.rules import Pattern, Rule, RuleSet, rewrite
        >>> rule = Rule(
        ...     "my_linear_add", "forward",
        ...     Pattern(_core._add_extra_input, Pattern(_core._linear, "x", "w", "b"), "r", commutative=True),
        ...     lambda m: m.fuse(
        ...         _fused.forward_linear_add, [m["x"], m["w"], m["b"], m["r"]], scale=None, bias_op=False),
        ...     condition=lambda m: "fp32 weight" if m["w"].dtype == torch.float32 else None)
        >>> block = lambda x, w, r: ops.linear(x, w) + r
        >>> args = lambda dtype: [torch.ones(shape, dtype=dtype) for shape in ((4, 8), (16, 8), (4, 16))]
        >>> _, stats = rewrite(functe.trace(block)(*args(torch.float32)), RuleSet([rule]), "forward")
        >>> stats.fired, [(name, reason) for name, _, reason in stats.declined]
        ({}, [('my_linear_add', 'fp32 weight')])
        >>> _, stats = rewrite(functe.trace(block)(*args(torch.bfloat16)), RuleSet([rule]), "forward")
        >>> stats.fired
        {'my_linear_add': 1}
    """

    name: str
    phase: str
    pattern: Pattern
    rewrite: Callable[[Match], Eqn]
    condition: Callable[[Match], str | None] | None = None
    doc: str = ""
    location: str = field(default="", compare=False)

    def __post_init__(self):
        if self.phase not in PHASES:
            raise RuleError(f"functe.rules: rule {self.name}: phase must be one of {PHASES}, got {self.phase!r}")
        if not isinstance(self.pattern, Pattern):
            raise RuleError(
                f"functe.rules: rule {self.name}: pattern must be a Pattern, got {type(self.pattern).__name__}"
            )
        if not callable(self.rewrite) or not (self.condition is None or callable(self.condition)):
            raise RuleError(
                f"functe.rules: rule {self.name}: rewrite must be a function and condition a function or None, "
                f"got {describe(self.rewrite)} and {describe(self.condition)}"
            )
        names = [node.name for node in _nodes(self.pattern) if node.name]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            # (m.eqn / m.params and check's static= are keyed by node name: the last node silently won)
            raise RuleError(
                f"functe.rules: rule {self.name}: pattern node names must be unique (m.eqn(name) picks one "
                f"equation), got {', '.join(map(repr, repeated))} more than once"
            )
        frame = sys._getframe(2)
        if not self.location:
            object.__setattr__(self, "location", f"{frame.f_code.co_filename}:{frame.f_lineno}")
        # (where a pickle looks the rule up by name: the module that made it)
        object.__setattr__(self, "_home", frame.f_globals.get("__name__"))

    def __reduce_ex__(self, protocol):
        # A rule bound to a module-level name (functe's own, or a user's) pickles by reference, as a
        # function does: functe's conditions are closures (first_reason) and pickle by value fails
        # on them; any other rule pickles by value (its functions by their names).
        found = global_name(self, getattr(self, "_home", None))
        if found is not None:
            return named, (*found, Rule)
        return super().__reduce_ex__(protocol)

    def __add__(self, other) -> RuleSet:
        return RuleSet((self,)) + other

    def __repr__(self):
        return f"Rule({self.name}, {self.phase}, {self.pattern!r})"


class RuleSet:
    """An ordered, immutable collection of rules; ``a + b`` concatenates.

    Example:
        >>> from functe.rules import DEFAULT_RULES, RuleSet
        >>> len(RuleSet()), len(DEFAULT_RULES + RuleSet()) == len(DEFAULT_RULES)
        (0, True)
    """

    __slots__ = ("rules",)

    def __init__(self, rules: Sequence[Rule] = ()):
        rules = tuple(rules)
        for r in rules:
            if not isinstance(r, Rule):
                raise RuleError(f"functe.rules.RuleSet: a RuleSet holds Rules, got {describe(r)}")
        names = [r.name for r in rules]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise RuleError(f"functe.rules.RuleSet: rule names must be unique in a RuleSet; repeated: {duplicates}")
        self.rules = rules

    def __add__(self, other) -> RuleSet:
        if isinstance(other, Rule):
            return RuleSet((*self.rules, other))
        if isinstance(other, RuleSet):
            return RuleSet((*self.rules, *other.rules))
        return NotImplemented

    def __iter__(self):
        return iter(self.rules)

    def __len__(self):
        return len(self.rules)

    def phase(self, phase: str) -> tuple[Rule, ...]:
        """The rules of one phase, in order."""
        return tuple(r for r in self.rules if r.phase == phase)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.rules)

    def __repr__(self):
        return f"RuleSet({', '.join(self.names)})"


@dataclass
class RewriteStats:
    """What one :func:`rewrite` did: matches per rule and declined matches with reasons.

    Example:
        >>> import torch, functe
        >>> from functe import ops
        >>> from functe.rules import DEFAULT_RULES, rewrite
        >>> program = functe.trace(lambda x, w: ops.gelu(ops.linear(x, w)))(torch.ones(4, 8), torch.ones(16, 8))
        >>> _, stats = rewrite(program, DEFAULT_RULES, "forward")
        >>> stats.fired, stats.declined[0][0], stats.declined[0][2][:22]
        ({}, 'forward_linear_bias_activation', 'weight dtype float32: ')
    """

    fired: dict[str, int] = field(default_factory=dict)
    declined: list[tuple[str, str, str]] = field(default_factory=list)  # (rule, where, reason)


# ----------------------------------------------------------------------------- matching


class _Graph:
    """Indexes of one op list used while matching."""

    def __init__(self, oplist: OpList):
        self.oplist = oplist
        self.producers = oplist.producers()
        self.uses = oplist.uses()
        self.outputs = {id(a) for a in oplist.outputs if isinstance(a, Var)}


@dataclass(frozen=True)
class _State:
    captures: dict
    eqns: dict
    edges: dict
    covered: tuple
    violations: tuple
    nodes: tuple = ()  # the pattern node each covered equation matched, parallel to covered


def _ops_match(pattern: Pattern, eqn: Eqn) -> bool:
    return any(eqn.op is op for op in pattern.op)


def _match(pattern: Pattern, eqn: Eqn, state: _State, g: _Graph) -> Iterator[_State]:
    n = len(pattern.inputs)
    arity_ok = len(eqn.inputs) >= n if pattern.variadic else len(eqn.inputs) == n
    if not _ops_match(pattern, eqn) or eqn.phase == "joint" or not arity_ok:
        return
    eqns = dict(state.eqns)
    if pattern.name:
        eqns[pattern.name] = eqn
    state = _State(state.captures, eqns, state.edges, (*state.covered, eqn), state.violations, (*state.nodes, pattern))
    orders = [pattern.inputs]
    if pattern.commutative and len(pattern.inputs) >= 2:
        orders.append((pattern.inputs[1], pattern.inputs[0], *pattern.inputs[2:]))
    for inputs in orders:
        yield from _match_inputs(inputs, eqn.inputs[:n], state, g)


def _same_atom(a: Atom, b: Atom) -> bool:
    return a is b or (isinstance(a, Literal) and isinstance(b, Literal) and a.value is b.value)


def _match_inputs(pats, atoms, state: _State, g: _Graph) -> Iterator[_State]:
    if not pats:
        yield state
        return
    p, a = pats[0], atoms[0]
    rest = pats[1:], atoms[1:]
    if p is None:
        if is_none(a):
            yield from _match_inputs(*rest, state, g)
    elif isinstance(p, str):
        if p == "_":
            yield from _match_inputs(*rest, state, g)
        elif p in state.captures:
            if _same_atom(state.captures[p], a):
                yield from _match_inputs(*rest, state, g)
        else:
            captures = {**state.captures, p: a}
            yield from _match_inputs(
                *rest, _State(captures, state.eqns, state.edges, state.covered, state.violations, state.nodes), g
            )
    elif isinstance(a, Var) and a in g.producers:
        producer, k = g.producers[a]
        if (p.out is not None and p.out != k) or producer in state.covered:
            return
        uses = g.uses.get(a, 0)
        violations = state.violations
        if uses != 1 and not p.shared:
            violations = (*violations, f"the output {a.aval} of {producer.name} has {uses} consumers")
        edges = {**state.edges, p.name: k} if p.name else state.edges
        state = _State(state.captures, state.eqns, edges, state.covered, violations, state.nodes)
        for s in _match(p, producer, state, g):
            yield from _match_inputs(*rest, s, g)


def _nodes(pattern: Pattern) -> list[Pattern]:
    """Every node of ``pattern``, the root first."""
    found = [pattern]
    for i in pattern.inputs:
        if isinstance(i, Pattern):
            found += _nodes(i)
    return found


def _post_order(pattern: Pattern) -> dict[int, int]:
    """Each node of ``pattern`` (by identity) -> its index in post-order: a node's nested inputs, as
    the pattern lists them, before the node. The order of a match's covered equations, hence of a
    forward fusion's residuals: for a chain it is program order; for sibling inputs it is fixed by
    the pattern, where program order depended on how the caller wrote the program (the fused op
    could not know which residual was which: silently swapped gradients)."""
    order: dict[int, int] = {}

    def visit(node: Pattern) -> None:
        for i in node.inputs:
            if isinstance(i, Pattern):
                visit(i)
        order[id(node)] = len(order)

    visit(pattern)
    return order


def _external_outputs(covered: Sequence[Eqn], g: _Graph) -> tuple[Var, ...]:
    inside = {id(e) for e in covered}
    used_outside: set[int] = set(g.outputs)
    for e in g.oplist.eqns:
        if id(e) not in inside:
            used_outside.update(id(a) for a in e.inputs if isinstance(a, Var))
    return tuple(v for e in covered for v in e.outputs if v is not None and id(v) in used_outside)


def near_misses(pattern: Pattern, oplist: OpList) -> list[str]:
    """Why ``pattern`` matches no equation of ``oplist`` whose op is its root's: for each such
    equation, the first place where the program's structure differs from the pattern's (an input
    count, a ``None`` the program fills, an input made by another op). Empty when some equation
    matches structurally (a rule that still does not fire declined, or its captures disagree)."""
    g = _Graph(oplist)
    roots = [e for e in oplist.eqns if _ops_match(pattern, e)]
    if not roots:
        present = sorted({e.name for e in oplist.eqns})
        return [f"no {_op_names(pattern)} equation in the program (it has: {', '.join(present) or 'none'})"]
    reasons = []
    for root in roots:
        reason = _structural_miss(pattern, root, g)
        if reason is None:
            return []
        reasons.append(f"{_location(root)}: {reason}")
    return reasons


def _op_names(pattern: Pattern) -> str:
    return " or ".join(op.name for op in pattern.op)


def _atom_text(a: Atom) -> str:
    return a.aval if isinstance(a, Var) else repr(a.value) if isinstance(a, Literal) else repr(a)


def _structural_miss(pattern: Pattern, eqn: Eqn, g: _Graph) -> str | None:
    n, name = len(pattern.inputs), eqn.name
    if eqn.phase == "joint":
        return f"{name} is a fused op already"
    if len(eqn.inputs) < n or (len(eqn.inputs) != n and not pattern.variadic):
        given = ", ".join(_atom_text(a) for a in eqn.inputs)
        return f"the pattern gives {name} {n} inputs, the equation has {len(eqn.inputs)} ({given})"
    orders = [pattern.inputs]
    if pattern.commutative and n >= 2:
        orders.append((pattern.inputs[1], pattern.inputs[0], *pattern.inputs[2:]))
    reasons = []
    for inputs in orders:
        reason = _inputs_miss(inputs, eqn, g)
        if reason is None:
            return None
        reasons.append(reason)
    if len(reasons) == 2:  # (commutative: either order could be the one the user meant)
        return f"{reasons[0]}; with its first two inputs swapped, {reasons[1]}"
    return reasons[0]


def _inputs_miss(inputs, eqn: Eqn, g: _Graph) -> str | None:
    for i, (p, a) in enumerate(zip(inputs, eqn.inputs)):
        if p is None and not is_none(a):
            return f"input {i} of {eqn.name} is {_atom_text(a)}, the pattern wants None"
        if not isinstance(p, Pattern):
            continue
        if not (isinstance(a, Var) and a in g.producers):
            return (
                f"input {i} of {eqn.name} is {_atom_text(a)}, not made by an equation; the pattern wants {_op_names(p)}"
            )
        producer, k = g.producers[a]
        if not _ops_match(p, producer):
            return f"input {i} of {eqn.name} is made by {producer.name}, the pattern wants {_op_names(p)}"
        if p.out is not None and p.out != k:
            return f"input {i} of {eqn.name} is output {k} of {producer.name}, the pattern wants output {p.out}"
        if (reason := _structural_miss(p, producer, g)) is not None:
            return reason
    return None


# ----------------------------------------------------------------------------- the driver


class _Rewriter:
    def __init__(self, rules: Sequence[Rule], phase: str, recipe: Any, max_rewrites: int):
        self.rules = rules
        self.phase = phase
        self.recipe = recipe
        self.max_rewrites = max_rewrites
        self.stats = RewriteStats()
        self._declined: set[tuple[str, int, str]] = set()
        self._declined_at: dict[tuple[str, int], list[tuple[str, str, str]]] = {}

    def run(self, oplist: OpList) -> OpList:
        count = 0
        changed = True
        while changed:
            changed = False
            for rule in self.rules:
                while (new := self._apply_once(rule, oplist)) is not None:
                    oplist = new
                    changed = True
                    count += 1
                    self.stats.fired[rule.name] = self.stats.fired.get(rule.name, 0) + 1
                    if count > self.max_rewrites:
                        raise RuleError(
                            f"functe.rules: no fixed point after {self.max_rewrites} rewrites in the {self.phase} "
                            f"phase (last rule: {rule.name}); does a rule match its own result?"
                        )
        return oplist

    def _decline(self, rule: Rule, root: Eqn, reason: str) -> None:
        key = (rule.name, id(root), reason)
        if key not in self._declined:
            self._declined.add(key)
            entry = (rule.name, _location(root), reason)
            self.stats.declined.append(entry)
            self._declined_at.setdefault((rule.name, id(root)), []).append(entry)

    def _fired(self, rule: Rule, root: Eqn) -> None:
        """Forget the rule's declines at ``root``: it fired there after all (another input order of a
        commutative pattern, or a match another rewrite made possible), and explain listed both."""
        entries = self._declined_at.pop((rule.name, id(root)), ())
        if entries:  # (by identity: another root's decline may read the same)
            self.stats.declined[:] = [d for d in self.stats.declined if not any(d is e for e in entries)]

    def _apply_once(self, rule: Rule, oplist: OpList) -> OpList | None:
        g = _Graph(oplist)
        root_ops = rule.pattern.op
        for root in oplist.eqns:
            if not any(root.op is op for op in root_ops):
                continue
            for state in _match(rule.pattern, root, _State({}, {}, {}, (), ()), g):
                if state.violations:
                    self._decline(rule, root, state.violations[0])
                    continue
                new = self._try(rule, root, state, g)
                if new is not None:
                    self._fired(rule, root)
                    return new
        return None

    def _try(self, rule: Rule, root: Eqn, state: _State, g: _Graph) -> OpList | None:
        position = {e: i for i, e in enumerate(g.oplist.eqns)}
        node_order = _post_order(rule.pattern)
        in_pattern = {e: node_order[id(node)] for e, node in zip(state.covered, state.nodes)}
        covered = tuple(sorted(state.covered, key=in_pattern.__getitem__))
        m = Match(rule, state.captures, state.eqns, state.edges, covered, _external_outputs(covered, g), self.recipe)
        reason = _user_call(rule, "condition", root, rule.condition, m) if rule.condition is not None else None
        if reason is not None:
            if not isinstance(reason, str) or not reason.strip():
                # (a bool reads naturally as "applies?" but True would be taken as a reason to decline;
                # an empty string, from `cond and "why"`-style code, would decline with no reason to print)
                raise RuleError(
                    f"functe.rules: rule {rule.name}: condition must return a non-empty reason string to decline "
                    f"or None to fire, got {reason!r} (matched at {_location(root)})"
                )
            self._decline(rule, root, reason)
            return None
        fused = _user_call(rule, "rewrite", root, rule.rewrite, m)
        if not isinstance(fused, Eqn):
            raise RuleError(f"functe.rules: rule {rule.name}: rewrite must return an Eqn, got {type(fused).__name__}")
        missing = [v for v in m.outputs if not any(v is o for o in fused.outputs)]
        if missing:
            raise TraceError(
                f"functe.rules: rule {rule.name}: the fused equation must define every output used outside the match; "
                f"missing {missing}"
            )
        # (a covered equation fused earlier brings its own covers, in their order)
        originals = list(dict.fromkeys(o for e in covered for o in e.originals))
        fused = fused.replace(covers=tuple(originals), phase=rule.phase)
        _check_fused(rule, fused)
        rest = [e for e in g.oplist.eqns if e not in covered]
        priority = {e: float(position[e]) for e in rest}
        priority[fused] = float(max(position[e] for e in covered))
        order = toposort([*rest, fused], priority)
        if order is None:
            self._decline(rule, root, "fusing would create a cycle: an outside op both consumes and feeds the match")
            return None
        new = g.oplist.replace(eqns=tuple(order))
        check_oplist(new)
        return new


def _user_call(rule: Rule, part: str, root: Eqn, fn: Callable, m: Match):
    """A rule's condition or rewrite, whose own errors name the rule and the match they came from."""
    try:
        return fn(m)
    except FuncteError:
        raise
    except Exception as error:
        raise RuleError(
            f"functe.rules: rule {rule.name}: its {part} raised {type(error).__name__}: {error} "
            f"(matched at {_location(root)})"
        ) from error


def _location(root: Eqn) -> str:
    """Where a match sits, for reports: its root op and what that op produces (``add_extra_input -> f32[4,6]``)."""
    return f"{root.name} -> {_describe_outputs(root)}"


def _describe_outputs(eqn: Eqn) -> str:
    return ", ".join(v.aval for v in eqn.outputs if v is not None)


def _check_fused(rule: Rule, fused: Eqn) -> None:
    """Shape-check the fused op on meta tensors; a forward fusion must return one residual per covered op."""
    try:
        out, res = forward_on_meta(fused.op, fused.inputs, fused.params, fused.in_tree)
    except TraceError as e:  # (name the rule whose rewrite made the call: the user's code is the rewrite)
        params = ", ".join(sorted(fused.params)) or "none"
        raise TraceError(
            f"functe.rules: rule {rule.name}: its rewrite made a {fused.name} call (static parameters: {params}) "
            f"that cannot run: {e}"
        ) from e
    leaves, tree = tree_flatten(out)
    got = [None if leaf is None else (tuple(leaf.shape), leaf.dtype) for leaf in leaves]
    want = [None if v is None else (tuple(v.shape), v.dtype) for v in fused.outputs]
    if got != want or tree != fused.out_tree:
        shown_got = ", ".join("None" if leaf is None else describe(leaf) for leaf in leaves)
        shown_want = ", ".join("None" if v is None else v.aval for v in fused.outputs)
        raise TraceError(
            f"functe.rules: rule {rule.name}: the fused op {fused.name} returns ({shown_got}) with structure "
            f"{tree}, but the equation declares ({shown_want}) with structure {fused.out_tree}"
        )
    if rule.phase == "forward" and not (isinstance(res, tuple) and len(res) == len(fused.covers)):
        raise TraceError(
            f"functe.rules: rule {rule.name}: the forward rule of {fused.name} must return one residual per covered op "
            f"({len(fused.covers)}: {', '.join(e.name for e in fused.covers)}), got "
            f"{len(res) if isinstance(res, tuple) else type(res).__name__}"
        )
    if rule.phase == "forward":
        # The backward plan hands each covered op's backward rule its residual: same structure,
        # shapes and dtypes as that op's own forward rule returns (else it fails deep inside it).
        for i, (eqn, mine) in enumerate(zip(fused.covers, res)):
            _, theirs = forward_on_meta(eqn.op, eqn.inputs, eqn.params, eqn.in_tree)
            if _residual_layout(mine) != _residual_layout(theirs):
                raise TraceError(
                    f"functe.rules: rule {rule.name}: residual {i} of the fused op {fused.name} must be what "
                    f"{eqn.name}'s forward rule returns, {_residual_text(theirs)}; got {_residual_text(mine)}"
                )


def _residual_layout(res) -> tuple:
    leaves, tree = tree_flatten(res)
    # (an opaque op's generator state is a fresh RandomState per run, equal to no other: compared
    # by type, a forward fusion over an opaque op could never pass)
    return tree, [
        (t.shape, t.dtype) if isinstance(t, torch.Tensor) else RandomState if isinstance(t, RandomState) else t
        for t in leaves
    ]


def _residual_text(res) -> str:
    leaves, tree = tree_flatten(res)
    return f"{tree} of ({', '.join(describe(t) if isinstance(t, torch.Tensor) else repr(t) for t in leaves)})"


def rewrite(
    oplist: OpList, rules: RuleSet, phase: str, *, recipe: Any = None, max_rewrites: int = 1000
) -> tuple[OpList, RewriteStats]:
    """Apply ``rules`` of one ``phase`` to ``oplist`` until nothing fires.

    Returns the rewritten op list and the :class:`RewriteStats` (matches per
    rule, declined matches with reasons).

    Example:
        >>> import torch, functe
        >>> from functe import ops
        >>> from functe.rules import DEFAULT_RULES, rewrite
        >>> program = functe.trace(lambda x, w, r: ops.linear(x, w) + r)(
        ...     torch.ones(4, 8), torch.ones(16, 8), torch.ones(4, 16))
        >>> fused, stats = rewrite(program, DEFAULT_RULES, "forward")
        >>> print(fused)
        { lambda a:f32[4,8] b:f32[16,8] c:f32[4,16]. let
            d:f32[4,16] = forward_linear_add[bias_op=False scale=None] a b None c
          in (d,) }
        >>> stats.fired
        {'forward_linear_bias_add': 1}
    """
    if not isinstance(oplist, OpList):
        raise RuleError(
            f"functe.rules.rewrite: argument 'oplist' expected an OpList (functe.trace), got {describe(oplist)}"
        )
    if not isinstance(rules, RuleSet):
        raise RuleError(f"functe.rules.rewrite: argument 'rules' expected a RuleSet, got {describe(rules)}")
    if phase not in PHASES:
        raise RuleError(f"functe.rules.rewrite: phase must be one of {PHASES}, got {phase!r}")
    limit = as_int(max_rewrites)
    if limit is None or limit < 1:
        raise ArgumentError(
            f"functe.rules.rewrite: argument 'max_rewrites' expected a positive int, got {shown_number(max_rewrites)}"
        )
    rewriter = _Rewriter(rules.phase(phase), phase, recipe, limit)
    return rewriter.run(oplist), rewriter.stats
