"""The batched twin of a ``custom_vjp`` op: its default ``vmap`` rule, differentiable outside the vmap.

Under ``torch.vmap`` an op's Function calls its batched twin, itself a custom_vjp op whose forward
rule (:func:`_batched_fwd`) runs the op's forward rule under ``torch.vmap`` and whose backward rule
(:func:`_batched_bwd`) runs the op's backward rule under ``torch.vmap``, with the caller's
``randomness``. So an op batches exactly as the ops and kernels it is made of, and a gradient taken
outside the vmap (``grad(vmap(f))``) still runs the op's backward rule. :class:`_Batch` is one
batched call, the twin's static argument; :func:`_batched_prune` prunes the twin's residuals with
the op's own ``prune_residuals``. The ``vmap`` rule of an op's Function (:mod:`functe._vjp`) makes
the twin on first use and calls it.
"""

from __future__ import annotations

import torch

from ._kernel import _with, vmap_call
from ._rng import RandomState
from ._tree import tree_flatten, tree_unflatten
from ._vjp_checks import _flatten_cotangents, argument_needs
from ._vjp_guard import _guard, second_order_subject
from ._vjp_layout import _CONST, _IN, _NEW, _OUT, _Layout, _residual_leaves, _run_forward

Tensor = torch.Tensor


class _Batch:
    """One batched call of an op (its vmap rule's arguments), the static argument of its batched twin.

    The twin is itself a custom_vjp op whose forward rule runs the op's forward rule under
    ``torch.vmap`` and whose backward rule runs the op's backward rule under ``torch.vmap``. The vmap
    rule calls the twin instead of vmapping the forward rule directly, so that a gradient taken
    *outside* the vmap (``grad(vmap(f))``, ``jacrev(vmap(f))``, a vmapped forward then
    ``.backward()``) records the op's backward rule, as it does inside (``vmap(grad(f))``): running
    the vmapped forward rule bare would let the outer level differentiate its torch ops instead
    (silently wrong for a straight-through rule, and an FP8 cast refused to be differentiated).
    The twin keeps only the batched inputs and outputs the op's residual layout refers to, pruned
    further by the op's own ``prune_residuals`` for the wanted gradients, and the generators' state a
    random forward started from (its ``jvp`` replays the draw).
    """

    __slots__ = (
        "bwd",
        "call",
        "constants",
        "dims",
        "fwd",
        "in_meta",
        "layout",
        "leaves",
        "name",
        "needs",
        "out_meta",
        "positions",
        "prune",
        "random",
        "symbolic_zeros",
    )

    def __init__(self, name, fwd, bwd, call, leaves, positions, dims, randomness, flags, constants):
        self.name, self.fwd, self.bwd, self.call = name, fwd, bwd, call
        self.constants = constants
        self.leaves = [None if isinstance(leaf, Tensor) else leaf for leaf in leaves]
        self.positions = positions
        self.dims = tuple(None if d is None else 0 for d in dims)  # (batched tensors arrive moved to dim 0)
        self.random = randomness
        self.needs, self.prune, self.symbolic_zeros = flags
        # set by the forward, per member: the op's residual layout, its outputs' and inputs' metadata
        self.layout: _Layout | None = None
        self.out_meta: list = []
        self.in_meta: list = []

    def full(self, tensors) -> list:
        """The op's argument leaves with these (member or batched) tensors in the tensor positions."""
        return _with(self.leaves, self.positions, tensors)

    def wanted(self, needs_input_grad) -> list[bool]:
        """Per argument leaf of the op, whether it wants a gradient (the twin's flags are per tensor)."""
        return _with([False] * len(self.leaves), self.positions, needs_input_grad)

    def outputs(self, flat_outs) -> list:
        """The op's output leaves (``None`` where it returned none) from the twin's flat outputs."""
        it = iter(flat_outs)
        return [None if meta is None else next(it) for meta in self.out_meta]


def _batched_fwd(*tensors, batch: _Batch):
    def member(*ts):
        leaves = batch.full(ts)
        out_leaves, new, layout = _run_forward(batch.name, batch.fwd, batch.call, leaves, batch.constants)
        batch.layout = layout
        batch.out_meta = [(o.shape, o.dtype, o.device) if isinstance(o, Tensor) else None for o in out_leaves]
        batch.in_meta = [(t.shape, t.dtype) if isinstance(t, Tensor) else None for t in leaves]
        return (*(o for o in out_leaves if o is not None), *new)

    flat = vmap_call(member, batch.dims, tensors, randomness=batch.random)
    plan = batch.layout.plan
    used_in = {i for kind, i in plan if kind == _IN}
    used_out = {j for kind, j in plan if kind == _OUT}
    n_out = len(flat) - batch.layout.n_new
    # Residuals: only the batched inputs and outputs the op's residual layout refers to, the
    # intermediates (the anchor among them), and a random forward's generator state (see _Batch).
    ins = tuple(t if i in used_in else None for i, t in zip(batch.positions, tensors))
    outs = tuple(o if j in used_out else None for j, o in enumerate(batch.outputs(flat[:n_out])) if o is not None)
    states = tuple(v for kind, v in plan if kind == _CONST and isinstance(v, RandomState))[:1]
    return flat, (ins, outs, tuple(flat[n_out:]), states)


def _batched_prune(res, *, batch: _Batch, needs_input_grad):
    """The twin's residuals the wanted gradients read: the op's own ``prune_residuals`` decides on
    the batched tensors standing in for the members' (it only says which leaves to keep)."""
    if batch.prune is None:
        return res
    ins, outs, new, states = res
    wanted = batch.wanted(needs_input_grad)
    layout = batch.layout
    sources = {_IN: batch.full(ins), _OUT: batch.outputs(outs), _NEW: new}
    leaves = _residual_leaves(layout, sources)
    needs = argument_needs(wanted, batch.call.in_tree)
    pruned = batch.prune(tree_unflatten(layout.res_tree, leaves), needs_input_grad=needs, **batch.call.static)
    kept = tree_flatten(pruned)[0]
    keep = {id(t) for t, k in zip(leaves, kept) if isinstance(t, Tensor) and k is not None}
    dropped = {id(t) for t in leaves if isinstance(t, Tensor)} - keep
    if not dropped:
        return res
    ins = tuple(None if t is not None and id(t) in dropped else t for t in ins)
    outs = tuple(None if t is not None and id(t) in dropped else t for t in outs)
    return ins, outs, new, states


def _batched_bwd(res, cts, *, batch: _Batch, needs_input_grad):
    ins, outs, new, _ = res
    layout = batch.layout
    n_out = len(cts) - layout.n_new
    wanted = batch.wanted(needs_input_grad)
    returned: list[int] = []

    def member(ts, member_outs, member_new, out_cts):
        leaves = batch.full(ts)
        ct_leaves = batch.outputs(out_cts)
        if not batch.symbolic_zeros:  # (the op's rule expects zeros for an unused output, as autograd gives)
            ct_leaves = [
                torch.zeros(meta[0], dtype=meta[1], device=meta[2]) if g is None and meta is not None else g
                for g, meta in zip(ct_leaves, batch.out_meta)
            ]
        sources = {_IN: leaves, _OUT: batch.outputs(member_outs), _NEW: member_new}
        res_leaves = _residual_leaves(layout, sources)
        residuals = tree_unflatten(layout.res_tree, res_leaves)
        extra = {"needs_input_grad": argument_needs(wanted, batch.call.in_tree)} if batch.needs else {}
        grads = batch.bwd(residuals, tree_unflatten(layout.out_tree, ct_leaves), **extra, **batch.call.static)
        flat_grads = _flatten_cotangents(batch.name, batch.call, grads, batch.in_meta, batch.fwd)
        returned[:] = [k for k, i in enumerate(batch.positions) if isinstance(flat_grads[i], Tensor)]
        return tuple(flat_grads[batch.positions[k]] for k in returned)

    def dims(items, batched) -> tuple:
        return tuple(
            None if t is None else (batched[k] if isinstance(batched, tuple) else 0) for k, t in enumerate(items)
        )

    out_cts = tuple(cts[:n_out])
    in_dims = (dims(ins, batch.dims), dims(outs, 0), dims(new, 0), dims(out_cts, 0))
    grads = vmap_call(member, in_dims, (ins, outs, new, out_cts), randomness=batch.random)
    result = [None] * len(ins)
    for k, g in zip(returned, grads):
        # (an unbatched input gets the sum of the members' cotangents)
        result[k] = g.sum(0) if batch.dims[k] is None else g
    if layout.guarded and torch.is_grad_enabled():  # (its backward uses intermediates: see _guard)
        result = _guard(second_order_subject(batch.fwd, batch.name), result, new[-1])
    return tuple(result)
