"""Helpers for the tracing, rule and executor tests."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

import functe
from functe.testing import assert_close

F64 = torch.float64
LOW = (torch.float16, torch.bfloat16)


def draw(shape, dtype, gen: torch.Generator) -> torch.Tensor:
    """A test input in ``dtype``: normal values (negatives included) for fp32/fp64; TransformerEngine's
    uniform [0, 1) for 16-bit dtypes, since a composite rounds intermediates and cancellation would
    make any fixed relative tolerance meaningless."""
    if dtype in LOW:
        return torch.rand(shape, generator=gen, dtype=F64).to(dtype)
    return torch.randn(shape, generator=gen, dtype=F64).to(dtype)


def outputs_and_grads(fn: Callable, args: Sequence, cts: Sequence | None = None, gen=None):
    """Outputs of ``fn(*args)`` (a tensor or tuple), gradients of every floating tensor argument for
    output cotangents ``cts`` (drawn with ``draw`` in each output's dtype if None), and ``cts``."""
    args = [a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    out = fn(*args)
    outs = list(out) if isinstance(out, tuple) else [out]
    if cts is None:
        cts = [draw(o.shape, o.dtype, gen) for o in outs]
    inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    grads = torch.autograd.grad(outs, inputs, [c.to(o.dtype) for c, o in zip(cts, outs)], allow_unused=True)
    return outs, grads, cts


def tolerance_dtype(dtype: torch.dtype) -> torch.dtype:
    """The tolerance entry for GEMM results: TransformerEngine compares float32 GEMMs with the float16
    tolerance (a dot product's rounding grows with its length and cancels); others use their own."""
    return torch.float16 if dtype == torch.float32 else dtype


def assert_matches_float64(fused: Callable, fn: Callable, args: Sequence, *, seed: int = 0, what: str = ""):
    """``fused(*args)`` and its gradients, in the arguments' dtype, match ``fn`` evaluated in float64 on
    the same rounded inputs with the same rounded cotangents, within functe.testing's tolerance
    (:func:`tolerance_dtype`; ``atol`` scaled to each tensor's largest value: normal inputs make the
    gradients sums of terms that can cancel)."""
    gen = torch.Generator().manual_seed(seed)
    outs, grads, cts = outputs_and_grads(fused, args, gen=gen)
    wide = [a.detach().to(F64) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    ref_outs, ref_grads, _ = outputs_and_grads(fn, wide, [c.to(F64) for c in cts])
    for i, (o, r) in enumerate(zip(outs, ref_outs)):
        assert o.dtype == args[0].dtype, f"{what} output {i} dtype {o.dtype}"
        assert_close(o, r, dtype=tolerance_dtype(o.dtype), msg=f"{what} output {i}", scale_atol=True)
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert (g is None) == (r is None), f"{what} gradient {i}"
        if g is not None:
            assert_close(g, r, dtype=tolerance_dtype(g.dtype), msg=f"{what} gradient {i}", scale_atol=True)


def vjp_wrt(fn: Callable, args: Sequence, ct, wrt: Sequence[int]):
    """``(fn(*args), cotangents of args[i] for i in wrt)`` through ``torch.func.vjp`` for output cotangent
    ``ct``, the other arguments held fixed."""

    def call(*present):
        full = list(args)
        for i, a in zip(wrt, present):
            full[i] = a
        return fn(*full)

    out, pull = torch.func.vjp(call, *(args[i] for i in wrt))
    return out, pull(ct)


def check_forward_residuals(plan, tensors: Sequence[torch.Tensor], *, not_bitwise: Sequence[str] = ()) -> int:
    """TE's equivalence contract: run ``plan.forward`` eqn by eqn on ``tensors`` (the program's tensor
    inputs) and assert that each forward fusion returns exactly the residuals its covered ops'
    forwards return on the same inputs (bit for bit, except for the fused ops named in
    ``not_bitwise``: same dtypes and shapes). Returns the number of forward fusions checked."""
    from functe._tree import tree_unflatten

    def run(eqn, env):
        vals = [env[a] if isinstance(a, functe.Var) else a.value for a in eqn.inputs]
        out, res = eqn.op.fwd(*tree_unflatten(eqn.in_tree, vals), **eqn.params)
        env.update(zip(eqn.outputs, functe.tree_leaves(out)))
        return res

    env = dict(zip(plan.program.inputs, tensors))
    checked = 0
    for e in plan.forward.eqns:
        res = run(e, env)
        if e.phase != "forward":
            continue
        local = dict(env)  # the unfused chain of the covered ops, from the same inputs
        expected = tuple(run(c, local) for c in e.covers)
        got_leaves, got_tree = functe.tree_flatten(res)
        exp_leaves, exp_tree = functe.tree_flatten(expected)
        assert got_tree == exp_tree, e.name
        for a, b in zip(got_leaves, exp_leaves):
            if isinstance(a, torch.Tensor):
                assert a.dtype == b.dtype and a.shape == b.shape, e.name
                assert e.name in not_bitwise or torch.equal(a, b), e.name
            else:
                assert a == b, e.name
        checked += 1
    return checked


def oplist_text(fn: Callable, *args, **kwargs) -> str:
    return str(functe.trace(fn)(*args, **kwargs))


def plan_of(fn: Callable, *args, rules=None, **kwargs):
    return functe.fuse(fn, rules=rules).plan(*args, **kwargs)
