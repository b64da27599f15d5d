"""The call layout of a ``custom_vjp`` op: flat argument leaves, and forward outputs split from residuals.

An op's ``autograd.Function`` takes positional tensors, so a call's pytree arguments are flattened
(:func:`_flatten`, with fast paths for a plain tensor and a flat tuple) and travel with their
structure and static values (:class:`_Call`). The forward rule's ``(out, residuals)`` is run on the
leaves (:func:`_run_forward`) and split by origin: each residual leaf is an input, an output, a new
intermediate or a constant (``_IN``/``_OUT``/``_NEW``/``_CONST``), which :class:`_Layout` records for
``setup_context`` to save and ``backward`` to rebuild (``prune_residuals`` turns dropped ones into
constant ``None`` entries, :func:`_pruned`). Used by :mod:`functe._vjp`'s Functions, the batched
twin (:mod:`functe._vjp_batch`) and the cotangent checks (:mod:`functe._vjp_checks`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._backend import PLAIN_TENSOR_TYPES, unaliased_outputs
from ._errors import RuleError, describe
from ._tree import PyTreeSpec, tree_flatten, tree_unflatten
from ._vjp_guard import higher_order_anchor

Tensor = torch.Tensor

_IN, _OUT, _NEW, _CONST = 0, 1, 2, 3
_LEAF = tree_flatten(0)[1]  # the spec of a single leaf
# _FLAT[n]: the spec of a plain tuple of n leaves (the common call: tensors and Nones as arguments)
_FLAT = tuple(tree_flatten((0,) * n)[1] for n in range(17))


class _Call:
    """The non-tensor part of one call: the argument structure and the static values.

    (The op itself is closed over by its Function class: Dynamo cannot carry
    arbitrary objects through ``autograd.Function.apply`` arguments.)
    """

    __slots__ = ("in_tree", "static")

    def __init__(self, in_tree: PyTreeSpec, static: dict[str, Any]):
        self.in_tree = in_tree
        self.static = static


class _Layout:
    """How forward's flat outputs split into primal outputs and residuals."""

    __slots__ = ("guarded", "n_new", "n_out", "out_tree", "plan", "res_tree")

    def __init__(self, out_tree, n_out, res_tree, plan, n_new, guarded):
        self.out_tree = out_tree
        self.n_out = n_out
        self.res_tree = res_tree
        self.plan = plan  # per residual leaf: (_IN, i) | (_OUT, j) | (_NEW, k) | (_CONST, value)
        self.n_new = n_new
        # whether a new residual is an intermediate (not a constant_residual): its backward, when
        # differentiated, goes through the guard
        self.guarded = guarded


def _flatten(tree, compiling: bool) -> tuple[list, PyTreeSpec]:
    """``tree_flatten(tree)``, without the pytree walk for the common eager cases: a plain tensor, or
    a tuple of plain tensors and Nones (~5 us a call). Not while compiling: Dynamo models optree with
    its own spec objects and cannot use one made outside."""
    if not compiling:
        kind = type(tree)
        if kind in PLAIN_TENSOR_TYPES:
            return [tree], _LEAF
        if kind is tuple and len(tree) < len(_FLAT):
            for leaf in tree:
                if leaf is not None and type(leaf) not in PLAIN_TENSOR_TYPES:
                    return tree_flatten(tree)
            return list(tree), _FLAT[len(tree)]
    return tree_flatten(tree)


def _unflatten(spec: PyTreeSpec, leaves, compiling: bool):
    """``tree_unflatten(spec, leaves)``, without optree for the specs :func:`_flatten` makes."""
    if not compiling:
        if spec is _LEAF:
            return leaves[0]
        if len(leaves) < len(_FLAT) and spec is _FLAT[len(leaves)]:
            return tuple(leaves)
    return tree_unflatten(spec, leaves)


def _index_of(value: Tensor, candidates) -> int:
    for i, c in enumerate(candidates):
        if c is value:
            return i
    return -1


def _split_result(name: str, result) -> tuple[Any, Any]:
    """The forward rule's ``(out, residuals)``, or a clear error."""
    if not (isinstance(result, tuple) and len(result) == 2):
        raise RuleError(f"functe.{name}: the forward rule must return (out, residuals), got {describe(result)}")
    return result


def _output_leaves(name: str, out, leaves, compiling: bool | None = None) -> tuple[list, PyTreeSpec]:
    """``out``'s leaves (checked: tensors or None) and structure, inputs among them as views.

    An output that is an input object would make autograd treat the op as an
    in-place one; a view keeps the op functional and costs nothing.
    """
    # The common case without a pytree walk (not while compiling: Dynamo models
    # optree with its own spec objects and cannot use a spec made outside).
    if compiling is None:
        compiling = torch.compiler.is_compiling()
    if isinstance(out, Tensor) and not compiling:
        out_leaves, out_tree = [out], _LEAF
    else:
        out_leaves, out_tree = _flatten(out, compiling)
        for leaf in out_leaves:
            if leaf is not None and not isinstance(leaf, Tensor):
                raise RuleError(f"functe.{name}: forward outputs must be tensors or None, got {describe(leaf)}")
    out_leaves = [o.view_as(o) if isinstance(o, Tensor) and _index_of(o, leaves) >= 0 else o for o in out_leaves]
    return out_leaves, out_tree


def _run_forward(
    name: str, fwd: Callable, call: _Call, leaves, constants: tuple[Tensor, ...] = ()
) -> tuple[list, list, _Layout]:
    """Run the forward rule on flat leaves; return (out leaves, new residuals, layout).

    ``constants``: the op's ``constant_residuals`` (new residuals that need no guard; compared with
    ``is``, not ``id``, which Dynamo would guard on)."""
    compiling = torch.compiler.is_compiling()
    args = _unflatten(call.in_tree, leaves, compiling)
    out, res = _split_result(name, fwd(*args, **call.static))
    out_leaves, out_tree = _output_leaves(name, out, leaves, compiling)
    res_leaves, res_tree = _flatten(res, compiling)
    plan, new = [], []
    guarded = False
    for r in res_leaves:
        # (inputs first: a residual that is an input returned as an output is saved as the input)
        if not isinstance(r, Tensor):
            plan.append((_CONST, r))
        elif (i := _index_of(r, leaves)) >= 0:
            plan.append((_IN, i))
        elif (j := _index_of(r, out_leaves)) >= 0:
            plan.append((_OUT, j))
        elif (k := _index_of(r, new)) >= 0:
            plan.append((_NEW, k))
        else:
            plan.append((_NEW, len(new)))
            new.append(r)
            guarded = guarded or _index_of(r, constants) < 0
    if new:
        new.append(higher_order_anchor(new[0]))
    # (after the plan: residuals that are outputs are saved as the outputs returned, by position)
    out_leaves = unaliased_outputs(out_leaves, leaves)[0]
    layout = _Layout(out_tree, len(out_leaves), res_tree, tuple(plan), len(new), guarded)
    return out_leaves, new, layout


def _residual_leaves(layout: _Layout, sources: dict) -> list:
    """The residual leaves ``layout`` describes, taken from ``sources`` (``_IN``/``_OUT``/``_NEW`` lists)."""
    return [value if kind == _CONST else sources[kind][value] for kind, value in layout.plan]


def _pruned(name: str, prune: Callable, layout: _Layout, sources: dict, call: _Call, needs: tuple) -> _Layout:
    """``layout`` with the residuals ``prune`` drops for these gradient needs made constant ``None``s,
    which are not saved (see ``prune_residuals`` in :class:`CustomVJP`)."""
    leaves = _residual_leaves(layout, sources)
    residuals = tree_unflatten(layout.res_tree, leaves)
    kept = prune(residuals, needs_input_grad=needs, **call.static)
    if kept is residuals:  # (nothing dropped: a frozen FP8 state, say)
        return layout
    kept_leaves, kept_tree = tree_flatten(kept)
    if kept_tree != layout.res_tree or any(k is not None and k is not r for k, r in zip(kept_leaves, leaves)):
        raise RuleError(
            f"functe.{name}: prune_residuals must return the residuals it was given with some leaves "
            f"replaced by None, got {describe(kept)}"
        )
    plan = tuple(entry if k is not None else (_CONST, None) for entry, k in zip(layout.plan, kept_leaves))
    return _Layout(layout.out_tree, layout.n_out, layout.res_tree, plan, layout.n_new, layout.guarded)
