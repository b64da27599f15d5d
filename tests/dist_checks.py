"""Checks that run on every rank of the test worker pool (tests/dist_helpers.py).

Each check builds the *global* tensors from fixed seeds (so every rank knows every rank's data),
runs the parallel code on this rank's shard, and compares with the single-process result and
with float64 references sliced the same way. Failures raise inside the worker and come back to
the test as the rank's traceback.
"""

from __future__ import annotations

import collections
import functools
import importlib.util
import math
import os
import time

import torch
import torch.distributed as dist
from helpers import make

import functe
from functe import ops
from functe.testing import assert_close, tolerance

F64 = torch.float64
RECIPES = {
    "delayed": functe.DelayedScaling(amax_history_len=4),
    "current": functe.CurrentScaling(),
    "mxfp8": functe.MXFP8BlockScaling(),
}


def rank() -> int:
    return dist.get_rank()


def world() -> int:
    return dist.get_world_size()


def seeded(shape, dtype=torch.float32, *, seed: int, scale: float = 1.0) -> torch.Tensor:
    """``make`` with its own seed: the same tensor on every rank."""
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return make(shape, dtype, scale=scale)
    finally:
        torch.random.set_rng_state(state)


def part(t: torch.Tensor, dim: int, r: int | None = None) -> torch.Tensor:
    """Rank ``r``'s (default: this rank's) equal slice of ``t`` along ``dim``."""
    return t.chunk(world(), dim)[rank() if r is None else r]


def same_on_all_ranks(t: torch.Tensor) -> bool:
    gathered = [torch.empty_like(t) for _ in range(world())]
    dist.all_gather(gathered, t.contiguous())
    return all(torch.equal(g, gathered[0]) for g in gathered)


def example_module():
    """examples/tp_mlp.py (the tests train with the example's own code)."""
    path = os.path.join(os.path.dirname(__file__), "..", "examples", "tp_mlp.py")
    spec = importlib.util.spec_from_file_location("tp_mlp_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------- collectives


def collectives(dtype_name: str, backend: str) -> None:
    """all_gather / reduce_scatter / all_reduce: values and backward rules vs references."""
    dtype = getattr(torch, dtype_name)
    P, r = world(), rank()
    with functe.use_backend(backend):
        for shape, dim in [((37,), 0), ((2, 13), 0), ((2, 13), 1), ((32, 1, 32), -1), ((0, 3), 0)]:
            xs = [seeded(shape, dtype, seed=10 + s) for s in range(P)]
            gathered_shape = list(shape)
            gathered_shape[dim] *= P
            cts = [seeded(gathered_shape, dtype, seed=20 + s) for s in range(P)]
            x = xs[r].clone().requires_grad_()
            y = ops.all_gather(x, dim=dim)
            assert torch.equal(y, torch.cat(xs, dim)), f"all_gather {shape} dim {dim}"
            (dx,) = torch.autograd.grad(y, x, cts[r])
            expected = part(sum(c.to(F64) for c in cts), dim)  # reduce-scatter of the cotangents
            assert_close(dx, expected, msg=f"all_gather backward {shape} dim {dim}")

        for shape, dim in [((4, 13), 0), ((3, 6), 1), ((0, 3), 0), ((32, 1, 32), 2)]:
            xs = [seeded(shape, dtype, seed=30 + s) for s in range(P)]
            cts = [seeded(part(xs[0], dim).shape, dtype, seed=40 + s) for s in range(P)]
            x = xs[r].clone().requires_grad_()
            y = ops.reduce_scatter(x, dim=dim)
            assert_close(y, part(sum(t.to(F64) for t in xs), dim), msg=f"reduce_scatter {shape}")
            (dx,) = torch.autograd.grad(y, x, cts[r])
            assert torch.equal(dx, torch.cat(cts, dim)), f"reduce_scatter backward {shape}"

        for shape in [(37,), (2, 13), (0, 4)]:
            xs = [seeded(shape, dtype, seed=50 + s, scale=1e3) for s in range(P)]
            x = xs[r].clone().requires_grad_()
            for reduce_in_backward in (False, True):
                y = ops.all_reduce(x, reduce_in_backward=reduce_in_backward)
                assert_close(y, sum(t.to(F64) for t in xs), msg=f"all_reduce {shape}")
                ct = seeded(shape, dtype, seed=60 + r)
                (dx,) = torch.autograd.grad(y, x, ct)
                want = sum(seeded(shape, dtype, seed=60 + s).to(F64) for s in range(P)) if reduce_in_backward else ct
                assert_close(dx, want, msg=f"all_reduce backward {shape} reduce_in_backward={reduce_in_backward}")

        # non-finite values: gathered as they are, summed as IEEE sums them
        special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e30], dtype=dtype)
        assert torch.equal(ops.all_gather(special).view(P, -1).isnan(), special.isnan().expand(P, -1))
        assert_close(ops.all_reduce(special), special.to(F64) * P, msg="all_reduce of inf/nan")
        # non-contiguous inputs: a stride-0 gradient of .sum(), a transpose
        ones = torch.ones((), dtype=dtype).expand(3, 4)
        assert torch.equal(ops.all_reduce(ones), torch.full((3, 4), float(P), dtype=dtype))
        t = seeded((3, 4), dtype, seed=70 + r).t()
        assert torch.equal(ops.all_gather(t), torch.cat([seeded((3, 4), dtype, seed=70 + s).t() for s in range(P)]))
    # FP8 data is gathered as bytes (gloo has no float8 type)
    q = (seeded((5, 16), seed=80 + r) * 8).to(torch.float8_e4m3fn)
    allq = torch.cat([(seeded((5, 16), seed=80 + s) * 8).to(torch.float8_e4m3fn) for s in range(P)])
    assert torch.equal(ops.all_gather(q).view(torch.uint8), allq.view(torch.uint8))


def collective_transforms() -> None:
    """vmap, grad, vjp, jvp, jacrev and grad-of-grad through the collectives (float64)."""
    P, r = world(), rank()
    xs = [seeded((3, 4), F64, seed=100 + s) for s in range(P)]
    cs = [seeded((3 * P, 4), F64, seed=110 + s) for s in range(P)]
    x, c = xs[r], cs[r]
    C = sum(cs)  # the cotangents of all ranks' per-rank losses meet in each rank's gradient

    def loss(t):  # per-rank loss; gradients follow the SPMD sum convention
        return (ops.all_gather(t) ** 3 * c).sum()

    g = torch.func.grad(loss)(x)
    assert_close(g, 3 * x**2 * part(C, 0), msg="grad")
    gg = torch.func.grad(lambda t: torch.func.grad(loss)(t).sum())(x)
    assert_close(gg, 6 * x * part(C, 0), msg="grad of grad")
    _, pull = torch.func.vjp(ops.all_gather, x)
    assert_close(pull(c)[0], part(C, 0), msg="vjp")
    tangent = seeded((3, 4), F64, seed=120 + r)
    _, jvp_out = torch.func.jvp(ops.all_gather, (x,), (tangent,))
    assert_close(jvp_out, torch.cat([seeded((3, 4), F64, seed=120 + s) for s in range(P)]), msg="jvp")
    jac = torch.func.jacrev(lambda t: ops.all_reduce(t, reduce_in_backward=False))(x[0])
    assert_close(jac, torch.eye(4, dtype=F64), msg="jacrev")
    # vmap: one collective for the whole batch equals one per example
    batch = torch.stack([x, 2 * x, -x])
    gather1, scatter1 = functools.partial(ops.all_gather, dim=1), functools.partial(ops.reduce_scatter, dim=1)
    for fn in (ops.all_gather, gather1, scatter1, ops.all_reduce):
        looped = torch.stack([fn(b) for b in batch])
        assert_close(torch.func.vmap(fn)(batch), looped, msg=f"vmap {fn}")
        assert_close(torch.func.vmap(fn, in_dims=1, out_dims=1)(batch.transpose(0, 1)), looped.transpose(0, 1))
    per_example = torch.stack([torch.func.grad(loss)(b) for b in batch])
    assert_close(torch.func.vmap(torch.func.grad(loss))(batch), per_example, msg="vmap(grad)")


# ----------------------------------------------------------------------------- parallel linear

# (mode, sequence_parallel, global x shape, out_features): local shapes are the global ones
# split as the mode says; 0 rows included.
LINEAR_CASES = [
    ("column", False, (37, 10), 6),
    ("column", True, (6, 3, 10), 6),
    ("row", False, (2, 13, 10), 6),
    ("row", True, (4, 1, 10), 6),
    ("column", True, (0, 10), 4),
    ("row", True, (0, 3, 10), 4),
]


def _shards(mode: str, sp: bool, x, w, b, y, dy):
    """This rank's parts of the global x, W, b, y and dy under (mode, sp)."""
    if mode == "column":
        xl = part(x, 0) if sp else x
        return xl, part(w, 0), None if b is None else part(b, 0), part(y, -1), part(dy, -1)
    yl, dyl = (part(y, 0), part(dy, 0)) if sp else (y, dy)
    return part(x, -1), part(w, 1), b, yl, dyl


def _grads_of_input(mode: str, sp: bool, dx):
    """The part of the global dx this rank's input gradient must equal."""
    if mode == "column":
        return part(dx, 0) if sp else dx
    return part(dx, -1)


def _linear_reference(x, w, b, dy):
    """float64 (value, magnitude) of y, dx, dW, db of the global linear.

    The magnitude (``|A| @ |B|`` of each GEMM) bounds the rounding error: a tensor-parallel
    linear rounds partial sums before they are added across ranks, which in 16-bit dtypes can
    cancel, so its error is relative to the magnitude rather than to the result.
    """
    x64, w64, dy64 = x.to(F64), w.to(F64), dy.to(F64)
    bias = 0 if b is None else b.to(F64)
    y, y_mag = x64 @ w64.T + bias, x64.abs() @ w64.abs().T + abs(bias)
    dx, dx_mag = dy64 @ w64, dy64.abs() @ w64.abs()
    dy2, x2 = dy64.reshape(-1, dy64.shape[-1]), x64.reshape(-1, x64.shape[-1])
    dw, dw_mag = dy2.T @ x2, dy2.abs().T @ x2.abs()
    db = None if b is None else (dy2.sum(0), dy2.abs().sum(0))
    return (y, y_mag), (dx, dx_mag), (dw, dw_mag), db


def assert_gemm_close(actual, expected, magnitude, msg: str, *, dtype=None) -> None:
    """``|actual - expected| <= rtol * (magnitude + |expected|) + atol``, tolerance of ``dtype`` (default: actual's)."""
    rtol, atol = tolerance(actual.dtype if dtype is None else dtype)
    assert actual.shape == expected.shape, f"{msg}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = (actual.detach().to(F64) - expected).abs()
    bound = rtol * (magnitude + expected.abs()) + atol
    assert bool((err <= bound).all()), f"{msg}: error {(err / bound).max().item():.2f}x the {actual.dtype} bound"


def _tp_linear(x, w, b=None, *, mode, sp):
    return ops.linear(x, w, b, tensor_parallel_mode=mode, sequence_parallel=sp)


def _weight_part(mode: str):
    """This rank's part of a global weight (or its gradient)."""
    return functools.partial(part, dim=0 if mode == "column" else 1)


def _bias_part(mode: str):
    """This rank's part of a global bias (or its gradient): row-parallel biases are replicated."""
    return functools.partial(part, dim=0) if mode == "column" else (lambda t: t)


def parallel_linear(dtype_name: str, backend: str) -> None:
    """Column, row and sequence-parallel ops.linear equal the single-process linear and its sliced gradients."""
    dtype = getattr(torch, dtype_name)
    with functe.use_backend(backend):
        for i, (mode, sp, shape, n_out) in enumerate(LINEAR_CASES):
            for has_bias in (True, False):
                x = seeded(shape, dtype, seed=200 + i)
                w = seeded((n_out, shape[-1]), dtype, seed=300 + i, scale=0.3)
                b = seeded((n_out,), dtype, seed=400 + i) if has_bias else None
                dy = seeded((*shape[:-1], n_out), dtype, seed=500 + i)
                y_ref, dx_ref, dw_ref, db_ref = _linear_reference(x, w, b, dy)
                db_ref = db_ref or (None, None)
                full = [t.clone().requires_grad_() for t in (x, w, b) if t is not None]
                y_single = ops.linear(*full)
                g_single = [*torch.autograd.grad(y_single, full, dy), None]
                xl, wl, bl, _, dyl = _shards(mode, sp, x, w, b, y_single, dy)
                what = f"{mode}{'+sp' if sp else ''} {tuple(shape)} bias={has_bias} {dtype_name}"
                args = [xl.requires_grad_(), wl.requires_grad_()] + ([bl.requires_grad_()] if has_bias else [])

                f = functools.partial(_tp_linear, mode=mode, sp=sp)
                y = f(*args)
                y_part = [_shards(mode, sp, x, w, b, t, dy)[3] for t in (y_single, *y_ref)]
                assert_gemm_close(y, y_part[1], y_part[2], f"{what}: y vs float64")
                assert_gemm_close(y, y_part[0].to(F64), y_part[2], f"{what}: y vs one process")
                grads = torch.autograd.grad(y, args, dyl)
                _, pull = torch.func.vjp(f, *(a.detach() for a in args))  # the torch.func path
                slicers = [functools.partial(_grads_of_input, mode, sp), _weight_part(mode), _bias_part(mode)]
                refs = zip(slicers, (dx_ref, dw_ref, db_ref), g_single)
                for name, g, g_func, (cut, (ref, mag), one) in zip(("dx", "dW", "db"), grads, pull(dyl), refs):
                    assert_gemm_close(g, cut(ref), cut(mag), f"{what}: {name} vs float64")
                    assert_gemm_close(g, cut(one).to(F64), cut(mag), f"{what}: {name} vs one process")
                    assert torch.equal(g, g_func), f"{what}: {name} autograd vs torch.func"


def _vjp_of(f, x, ct):
    return torch.func.vjp(f, x)[1](ct)[0]


def parallel_linear_vmap() -> None:
    """vmap over a tensor-parallel linear (an ensemble of inputs) equals the loop over examples."""
    for mode, sp in (("column", True), ("row", True), ("column", False), ("row", False)):
        xs = seeded((3, 4, 2, 8), F64, seed=600)
        w, b = seeded((6, 8), F64, seed=601), seeded((6,), F64, seed=602)
        xl = part(xs, 1) if (mode == "column" and sp) else (xs if mode == "column" else part(xs, -1))
        f = functools.partial(_tp_linear, w=_weight_part(mode)(w), b=_bias_part(mode)(b), mode=mode, sp=sp)
        looped = torch.stack([f(t) for t in xl])
        assert_close(torch.func.vmap(f)(xl), looped, msg=f"vmap {mode} {sp}")
        dys = seeded(looped.shape, F64, seed=603 + rank())
        pullback = functools.partial(_vjp_of, f)
        per = torch.stack([pullback(t, d) for t, d in zip(xl, dys)])
        assert_close(torch.func.vmap(pullback)(xl, dys), per, msg=f"vmap(vjp) {mode} {sp}")


def _gradient_penalty(x, w, b, c, *, parallel=None, replicated=(False, False, False)):
    """‖dx‖² + ‖dW‖² + ‖db‖² of loss = Σ c·tanh(x Wᵀ + b), summed once over the global gradients:
    the rank-local parts through ``ops.all_reduce``, the ``replicated`` ones as they are."""
    loss = (c * torch.tanh(ops.linear(x, w, b, **(parallel or {})))).sum()
    grads = torch.autograd.grad(loss, (x, w, b), create_graph=True)
    local = sum((g * g).sum() for g, rep in zip(grads, replicated) if not rep)
    shared = sum((g * g).sum() for g, rep in zip(grads, replicated) if rep)
    return (local if parallel is None else ops.all_reduce(local)) + shared


def parallel_linear_second_derivatives() -> None:
    """A gradient penalty through every tensor-parallel linear equals one process's (float64).

    loss = Σ c·tanh(x Wᵀ + b) (a per-rank share when y is split, the replicated loss when it is
    not: either way the gradients are those of the global loss); pen = ‖dx‖² + ‖dW‖² + ‖db‖²
    summed once over the global gradients (rank-local parts through ``ops.all_reduce``); then
    d pen / d(x, W, b) is this rank's slice of the single-process one. Until the backward rules
    marked replicated values, column dx came out P times too large and row gradients wrong.
    """
    for i, (mode, sp, shape, n_out) in enumerate(LINEAR_CASES[:4]):
        x = seeded(shape, F64, seed=700 + i)
        w, b = seeded((n_out, shape[-1]), F64, seed=710 + i, scale=0.3), seeded((n_out,), F64, seed=720 + i)
        c = seeded((*shape[:-1], n_out), F64, seed=730 + i)

        full = [t.clone().requires_grad_() for t in (x, w, b)]
        pen_ref = _gradient_penalty(*full, c)
        refs = torch.autograd.grad(pen_ref, full)
        xl, wl, bl, cl, _ = _shards(mode, sp, x, w, b, c, c)
        args = [t.clone().requires_grad_() for t in (xl, wl, bl)]
        parallel = {"tensor_parallel_mode": mode, "sequence_parallel": sp}
        # replicated gradients (the same full value on every rank): column dx without SP, row db
        replicated = (mode == "column" and not sp, False, mode == "row")
        pen = _gradient_penalty(*args, cl, parallel=parallel, replicated=replicated)
        what = f"{mode}{'+sp' if sp else ''} {tuple(shape)}"
        assert_close(pen, pen_ref, msg=f"{what}: penalty")
        slicers = [functools.partial(_grads_of_input, mode, sp), _weight_part(mode), _bias_part(mode)]
        for name, g, ref, cut in zip(("x", "W", "b"), torch.autograd.grad(pen, args), refs, slicers):
            assert_close(g, cut(ref), msg=f"{what}: d penalty / d{name}")


def parallel_forward_over_reverse() -> None:
    """Plain forward AD over ``autograd.grad(create_graph=True)`` through the tensor-parallel linears
    and ``ops.all_reduce`` equals ``torch.func``'s forward-over-reverse (the Hessian-vector product).
    The backward's ``share`` returned its input as-is and its jvp did not return a view, which
    autograd refused under a dual level."""
    import torch.autograd.forward_ad as fwAD

    rank = dist.get_rank()
    x, w, t = (seeded((4, 6), F64, seed=790 + i) for i in range(3))
    for mode in ("column", "row", "all_reduce"):
        xs, ws, ts = (v if mode == "column" else v[:, :3] for v in (x, w, t))

        def loss(x, w, mode=mode):
            if mode == "all_reduce":
                return ops.all_reduce(x * (rank + 1.0)).sin().sum()
            return ops.linear(x, w, tensor_parallel_mode=mode).sin().sum()

        expected = torch.func.jvp(lambda x, loss=loss, ws=ws: torch.func.grad(loss)(x, ws), (xs,), (ts,))[1]
        with fwAD.dual_level():
            dual = fwAD.make_dual(xs.clone().requires_grad_(), ts)
            (grad,) = torch.autograd.grad(loss(dual, ws), dual, create_graph=True)
            got = fwAD.unpack_dual(grad).tangent
        assert_close(got, expected, msg=f"{mode}: forward-over-reverse")


def fused_row_parallel_backward() -> list[str]:
    """The backward fusions over a row-parallel linear run its backward with its communication
    marks: first-order gradients equal unfused ones, and a gradient penalty through the scaled
    linear (alpha in the GEMMs) too (before, that fused backward read the replicated dy as
    rank-local: d pen / dW off by up to 2.5; the activation's fusion keeps an intermediate and
    refuses second order). Returns the rules that fired."""
    row = {"tensor_parallel_mode": "row"}
    scaled = lambda x, w, b: ops.linear(x, w, b, **row) * 0.5
    activated = lambda x, w, b: ops.gelu(ops.linear(x, w, b, **row))
    x, w, b = seeded((3, 8), F64, seed=760), seeded((6, 8), F64, seed=761, scale=0.3), seeded((6,), F64, seed=762)
    args = (part(x, -1), part(w, 1), b)
    fired = []
    for program, order in ((scaled, 2), (activated, 1)):
        fused = functe.fuse(program)
        fired += list(fused.plan(*args).stats["backward"].fired)
        results = []
        for fn in (program, fused):
            leaves = [t.clone().requires_grad_() for t in args]
            grads = torch.autograd.grad(torch.tanh(fn(*leaves)).sum(), leaves, create_graph=order == 2)
            if order == 2:
                gx, gw, gb = grads
                pen = ops.all_reduce((gx * gx).sum() + (gw * gw).sum()) + (gb * gb).sum()  # db is replicated
                grads = torch.autograd.grad(pen, leaves)
            results.append(grads)
        for name, f, u in zip(("x", "W", "b"), results[1], results[0]):
            assert_close(f, u, msg=f"order {order}: fused vs unfused d/d{name}")
        if order == 2:  # and both equal one process's, sliced
            leaves = [t.clone().requires_grad_() for t in (x, w, b)]
            grads = torch.autograd.grad(
                torch.tanh(leaves[0] @ leaves[1].T * 0.5 + 0.5 * leaves[2]).sum(), leaves, create_graph=True
            )
            refs = torch.autograd.grad(sum((g * g).sum() for g in grads), leaves)
            for name, f, ref, cut in zip(
                ("x", "W", "b"), results[1], refs, (lambda t: part(t, -1), lambda t: part(t, 1), lambda t: t)
            ):
                assert_close(f, cut(ref), msg=f"fused vs one process d penalty / d{name}")
    return fired


# ----------------------------------------------------------------------------- FP8
# ----------------------------------------------------------------------------- FP8


def _fp8_state(recipe):
    state = functe.init_linear_scaling_state(recipe)
    if state is None:
        return None
    hist = torch.tensor([0.0, 3.0, 0.5, 9.0])  # a state that has seen steps: scales are not 1
    return functe.LinearScalingState(
        input=functe.ScalingState(torch.tensor(37.0), hist.clone()),
        weight=functe.ScalingState(torch.tensor(900.0), hist.clone()),
        grad_output=functe.ScalingState(torch.tensor(2.0**13), hist.clone()),
    )


FP8_CASES = [("column", False), ("column", True), ("row", False), ("row", True)]


def _fp8_loss(params, state, x, dy, *, recipe, **parallel):
    return (ops.fp8_linear(x, params["w"], params["b"], state, recipe=recipe, **parallel) * dy).sum()


def _fp8_dx(params, state, x, dy, **kw):
    return torch.func.grad(lambda t: _fp8_loss(params, state, t, dy, **kw))(x)


def _check_quantized_gather(x, xl, recipe, state) -> None:
    """Column + SP: shards quantized with the scale of the reduced amax, gathered as FP8, equal one cast of x."""
    from functe._fp8_gemm import compute_dtype
    from functe._parallel import cast_input, linear_parallelism
    from functe._quantize import cast

    p = linear_parallelism("check", xl, "column", True, None, fp8=True)
    scale = state.input.scale if state is not None else None
    store, k = compute_dtype(x.dtype), x.shape[-1]
    _, gathered, s, amax = cast_input("check", xl.reshape(-1, k), recipe, scale, store, p)
    q, s_full, amax_full = cast(x.reshape(-1, k), recipe, "input", scale, store)
    assert torch.equal(gathered, q) and torch.equal(s, s_full), "the quantized all-gather differs from one cast"
    if isinstance(recipe, functe.CurrentScaling):
        assert torch.equal(amax, amax_full), "current scaling: the input amax was not reduced over the group"


def parallel_fp8_linear(recipe_name: str, dtype_name: str) -> None:
    """Tensor-parallel fp8_linear vs the single-process fp8_linear: values, sliced gradients, next states."""
    recipe, dtype = RECIPES[recipe_name], getattr(torch, dtype_name)
    loss = functools.partial(_fp8_loss, recipe=recipe)
    for i, (mode, sp) in enumerate(FP8_CASES):
        shape, n_out = (4, 3, 64), 32  # row shards of 32: MXFP8 blocks align with the shards
        x = seeded(shape, dtype, seed=700 + i, scale=3.0)
        w = seeded((n_out, shape[-1]), dtype, seed=710 + i, scale=0.2)
        b = seeded((n_out,), dtype, seed=720 + i)
        dy = seeded((*shape[:-1], n_out), dtype, seed=730 + i, scale=0.01)
        state = _fp8_state(recipe)
        what = f"fp8 {recipe_name} {mode}{'+sp' if sp else ''} {dtype_name}"

        single_y = ops.fp8_linear(x, w, b, state, recipe=recipe)
        _, single_grads, single_state = functe.value_and_grad(loss)({"w": w, "b": b}, state, x, dy)
        single_dx = _fp8_dx({"w": w, "b": b}, state, x, dy, recipe=recipe)
        xl, wl, bl, yl_single, dyl = _shards(mode, sp, x, w, b, single_y, dy)
        kw = {"tensor_parallel_mode": mode, "sequence_parallel": sp}
        y = ops.fp8_linear(xl, wl, bl, state, recipe=recipe, **kw)
        _, grads, next_state = functe.value_and_grad(functools.partial(loss, **kw))({"w": wl, "b": bl}, state, xl, dyl)
        dx = _fp8_dx({"w": wl, "b": bl}, state, xl, dyl, recipe=recipe, **kw)
        # Delayed scaling: reduced amaxes, so the quantized operands are those of one process and only
        # the GEMM's summation order differs. Current scaling quantizes each weight shard with its own
        # scale (as TE): FP8's tolerance. MXFP8 blocks align with the shards here.
        tol = None if recipe_name != "current" else torch.float8_e4m3fn
        (_, y_mag), (_, dx_mag), (_, dw_mag), (_, db_mag) = _linear_reference(x, w, b, dy)
        cut_w, cut_b = _weight_part(mode), _bias_part(mode)
        checks = [
            ("y", y, yl_single, _shards(mode, sp, x, w, b, y_mag, dy)[3]),
            ("dx", dx, _grads_of_input(mode, sp, single_dx), _grads_of_input(mode, sp, dx_mag)),
            ("dW", grads["w"], cut_w(single_grads["w"]), cut_w(dw_mag)),
            ("db", grads["b"], cut_b(single_grads["b"]), cut_b(db_mag)),
        ]
        for name, actual, expected, magnitude in checks:
            assert_gemm_close(actual, expected.to(F64), magnitude, f"{what}: {name} vs one process", dtype=tol)
        if sp and mode == "column" and recipe_name != "mxfp8":
            _check_quantized_gather(x, xl, recipe, state)
        if next_state is not None:  # identical across ranks, and equal to one process's next state
            for leaf, single in zip(functe.tree_leaves(next_state), functe.tree_leaves(single_state)):
                assert same_on_all_ranks(leaf), f"{what}: state differs across ranks"
                assert_close(leaf, single, msg=f"{what}: next state vs single process")


def parallel_fp8_ensemble() -> None:
    """vmap(value_and_grad) over an ensemble of tensor-parallel FP8 linears: each member keeps its own state."""
    recipe, members = RECIPES["delayed"], 3

    def loss(params, state, x):
        return ops.fp8_linear(x, params["w"], None, state, recipe=recipe, tensor_parallel_mode="column").square().sum()

    states = functe.tree_map(lambda t: torch.stack([t] * members), functe.init_linear_scaling_state(recipe))
    w = part(seeded((members, 8, 16), seed=740), 1)
    x = seeded((members, 4, 16), seed=741) * torch.tensor([1.0, 2.0, 4.0])[:, None, None]
    _, grads, next_states = torch.func.vmap(functe.value_and_grad(loss))({"w": w}, states, x)
    for i in range(members):
        member = functe.tree_map(lambda t, i=i: t[i], states)
        _, g, s = functe.value_and_grad(loss)({"w": w[i]}, member, x[i])
        assert_close(grads["w"][i], g["w"], msg=f"member {i}: dW")
        for a, b in zip(functe.tree_leaves(next_states), functe.tree_leaves(s)):
            assert torch.equal(a[i], b), f"member {i}: state"
            assert same_on_all_ranks(a[i])
    scales = next_states.input.scale
    assert len(set(scales.tolist())) == members, "members with different inputs must get different scales"


def _fp8_unbiased_loss(params, state, x, dy, *, recipe, **parallel):
    return (ops.fp8_linear(x, params["w"], None, state, recipe=recipe, **parallel) * dy).sum()


def amax_reduction_keeps_nan_and_inf() -> None:
    """A NaN or inf in one rank's shard reaches every rank's state as one process would record it."""
    from functe._fp8_gemm import compute_dtype
    from functe._parallel import cast_input, linear_parallelism

    recipe = RECIPES["delayed"]
    column_sp = {"tensor_parallel_mode": "column", "sequence_parallel": True}
    for bad in (float("nan"), float("inf"), float("-inf")):
        for culprit in range(world()):
            what = f"{bad} on rank {culprit}"
            x, w, dy = seeded((4, 16), seed=750), seeded((8, 16), seed=751), seeded((4, 8), seed=752)
            x[culprit * 2, 3] = bad  # in rank `culprit`'s half of the sequence
            loss = functools.partial(_fp8_unbiased_loss, recipe=recipe)
            _, _, single = functe.value_and_grad(loss)({"w": w}, _fp8_state(recipe), x, dy)
            tp_loss = functools.partial(loss, **column_sp)
            _, _, tp = functe.value_and_grad(tp_loss)({"w": part(w, 0)}, _fp8_state(recipe), part(x, 0), part(dy, -1))
            for a, b in zip(functe.tree_leaves(tp.input), functe.tree_leaves(single.input)):
                assert torch.equal(a, b) or (a.isnan().any() and torch.equal(a.nan_to_num(), b.nan_to_num())), what
                assert torch.equal(a.isnan(), b.isnan()), what
                assert same_on_all_ranks(a.nan_to_num(7.0)), what
            # current scaling: the reduced amax is the whole tensor's, and a bad one gives scale 1 everywhere
            p = linear_parallelism("check", x, "column", True, None, fp8=True)
            xl = part(x, 0)
            _, _, scale, amax = cast_input("check", xl, functe.CurrentScaling(), None, compute_dtype(x.dtype), p)
            assert torch.equal(amax.isnan(), torch.tensor(bad).isnan()) and scale.item() == 1.0, what


def data_parallel_fp8_states() -> None:
    """Data parallelism with ``amax_group``: states equal one process's over the whole batch, a forward
    without a backward communicates nothing, and a frozen weight skips its wgrad."""
    from functe.ops import _fp8_linear

    recipe, world_group = RECIPES["delayed"], {"amax_group": dist.group.WORLD}
    x, w, dy = seeded((8, 16), seed=1200, scale=3.0), seeded((8, 16), seed=1201), seeded((8, 8), seed=1202)
    loss = functools.partial(_fp8_unbiased_loss, recipe=recipe)
    single = replicas = _fp8_state(recipe)
    for step in range(3):  # (a sum loss: each rank's dy rows are the whole batch's)
        xs = x * (step + 1)
        _, _, single = functe.value_and_grad(loss)({"w": w}, single, xs, dy)
        step_fn = functe.value_and_grad(functools.partial(loss, **world_group))
        _, _, replicas = step_fn({"w": w}, replicas, part(xs, 0), part(dy, 0))
    for a, b in zip(functe.tree_leaves(replicas), functe.tree_leaves(single)):
        assert torch.equal(a, b) and same_on_all_ranks(a)
    with torch.no_grad():  # (each forward reduced its amaxes: unequal evaluation shards waited forever)
        for _ in range(1 + rank()):
            ops.fp8_linear(part(x, 0), w, None, replicas, recipe=recipe, **world_group)
    assert ops.all_reduce(torch.ones(1)).item() == world()
    gemms, real = [], _fp8_linear.gemm_nt
    _fp8_linear.gemm_nt = lambda *a, **k: gemms.append(1) or real(*a, **k)
    try:
        frozen = lambda p, s, dy: (ops.fp8_linear(p["x"], w, None, s, recipe=recipe, **world_group) * dy).sum()
        _, grads, _ = functe.value_and_grad(frozen)({"x": part(x, 0)}, replicas, part(dy, 0))
    finally:
        _fp8_linear.gemm_nt = real
    assert len(gemms) == 2 and grads["x"].shape == part(x, 0).shape  # forward and dgrad (wgrad ran too)


def delayed_states_agree(steps: int, sequence_parallel: bool) -> list[float]:
    """A tensor-parallel FP8 MLP trained for ``steps``: states identical across ranks and equal to one process's."""
    ex = example_module()
    curve, state = ex.train(steps, tp_group=dist.group.WORLD, sequence_parallel=sequence_parallel, fp8=True)
    ref_curve, ref_state = ex.train(steps, fp8=True)
    for leaf, ref in zip(functe.tree_leaves(state), functe.tree_leaves(ref_state)):
        assert same_on_all_ranks(leaf), "a scaling state differs across ranks"
        assert_close(leaf, ref, msg="scaling state vs single process")
    assert all(float(s) != 1.0 for s in functe.tree_leaves(state) if s.dim() == 0), "the scales never moved"
    torch.testing.assert_close(torch.tensor(curve), torch.tensor(ref_curve), rtol=1e-5, atol=1e-6)
    return curve


def tp_mlp_loss_curve(steps: int, sequence_parallel: bool, tp: int) -> tuple[list[float], list[float]]:
    """The example's MLP: the tensor-parallel (or data-parallel, tp=1) loss curve and the single-process one."""
    ex = example_module()
    if tp == world():
        groups = {"tp_group": dist.group.WORLD}
    else:
        groups = {"dp_group": dist.group.WORLD}
    curve, _ = ex.train(steps, sequence_parallel=sequence_parallel, **groups)
    reference, _ = ex.train(steps)
    return curve, reference


# ----------------------------------------------------------------------------- failures


def rank_raises(timeout: float) -> float:
    """Rank 1 raises before a collective; rank 0's collective must fail within the group's timeout."""
    import datetime

    group = dist.new_group(timeout=datetime.timedelta(seconds=timeout))
    if rank() == 1:
        raise ValueError("rank 1 fails before the collective")
    start = time.monotonic()
    try:
        ops.all_reduce(torch.ones(3), group=group)
    except RuntimeError as e:
        elapsed = time.monotonic() - start
        raise RuntimeError(f"after {elapsed:.2f} s: {e}") from e
    raise AssertionError("the collective returned although rank 1 never joined it")


def mismatched_shapes() -> list[str]:
    """Shapes that differ across ranks give the same clear error on every rank (and no hang)."""
    r = rank()
    w = seeded((4, 8), seed=800)
    column_sp = {"tensor_parallel_mode": "column", "sequence_parallel": True}
    cases = [
        lambda: ops.all_gather(torch.ones(2 + r, 3)),
        lambda: ops.linear(torch.ones(3 + r, 8), w, **column_sp),
        lambda: ops.linear(torch.ones(4 + 2 * r, 2, 4), part(w, 1), tensor_parallel_mode="row", sequence_parallel=True),
        lambda: ops.fp8_linear(torch.ones(3 + r, 8), w, None, None, recipe=RECIPES["current"], **column_sp),
        lambda: ops.reduce_scatter(torch.ones(4, 3), dim=r),
        lambda: ops.all_gather(torch.ones(2, 3)) if r == 0 else ops.all_reduce(torch.ones(2, 3)),
        # (one all-reduce of one shape for two purposes: a column backward's dx and a row forward's
        # output were summed together, silently)
        lambda: (
            torch.func.grad(lambda x: ops.linear(x, part(w, 0), tensor_parallel_mode="column").sum())(torch.ones(3, 8))
            if r == 0
            else ops.linear(torch.ones(3, 4), torch.ones(8, 4), tensor_parallel_mode="row")
        ),
    ]
    return _errors_of(cases)


def _errors_of(cases, error=functe.FuncteError) -> list[str]:
    """``"Type: message"`` of the error each case raises (each must raise); the group still works after."""
    messages = []
    for i, case in enumerate(cases):
        try:
            case()
        except error as e:
            messages.append(f"{type(e).__name__}: {e}")
        else:
            raise AssertionError(f"case {i}: rank {rank()} raised nothing")
    assert ops.all_reduce(torch.ones(1)).item() == world()
    return messages


def layouts_hidden_by_one_size() -> list[str]:
    """Ranks whose trees (or deep shapes) differ but whose flat sizes agree raise, on every rank."""
    r = rank()
    cases = [
        lambda: functe.all_reduce_gradients({"w": torch.ones(2, 3) if r == 0 else torch.ones(3, 2)}),
        lambda: functe.all_reduce_gradients({"a": torch.ones(2 + r), "b": torch.ones(3 - r)}),
        lambda: functe.all_reduce_gradients({"w": torch.ones(2)} if r == 0 else {"v": torch.ones(2)}),
        lambda: ops.all_reduce(torch.ones(*[1] * 12, *((2, 3) if r == 0 else (3, 2)))),
        # (a rank whose leaves are all None returned at once, and rank 0 waited until the timeout)
        lambda: functe.all_reduce_gradients({"w": torch.ones(2) if r == 0 else None}),
        lambda: functe.all_reduce_gradients({"w": torch.ones(2)}, average=r == 0),  # (a mean on one rank only)
    ]
    messages = _errors_of(cases, functe.ShapeError)
    assert functe.all_reduce_gradients({"w": torch.ones(2)})["w"].tolist() == [1.0, 1.0]  # same layout: fine
    assert functe.all_reduce_gradients({"w": None}) == {"w": None}  # None everywhere: fine too
    return messages


def awkward_gradient_trees() -> None:
    """Gradient averages that only the order of sum and division decides, trees whose spec repr
    differs between processes, and the reduction compiled with fullgraph."""
    sign = 1 - 2 * rank()
    half = functe.all_reduce_gradients({"g": torch.tensor([40000.0, 60000.0 * sign], dtype=torch.float16)})
    assert half["g"].tolist() == [40000.0, 0.0]  # (summed first: [inf, nan] on every rank)
    tree = collections.defaultdict(lambda: None, {"a": torch.full((2,), float(rank()))})
    assert functe.all_reduce_gradients(tree)["a"].tolist() == [0.5, 0.5]  # (a lambda's address: ShapeError)
    compiled = torch.compile(functe.all_reduce_gradients, backend="eager", fullgraph=True)
    assert compiled({"w": torch.full((3,), float(rank()))})["w"].tolist() == [0.5] * 3


def argument_error_on_one_rank() -> list[str]:
    """Rank 1's x fails a local check (sequence parallelism's, then a plain collective's: a dim its x
    lacks, an integer x to sum), rank 0's is fine: both raise, neither waits."""
    r = rank()
    w = seeded((4, 8), seed=801)
    sp = {"sequence_parallel": True}
    cases = [
        lambda: ops.linear(torch.ones(4 - r, 2, 4), part(w, 1), tensor_parallel_mode="row", **sp),
        lambda: ops.linear(torch.ones(3, 8) if r == 0 else torch.ones(8), w, tensor_parallel_mode="column", **sp),
        lambda: ops.fp8_linear(
            torch.ones(4 - r, 4), part(w, 1), None, None, recipe=RECIPES["current"], tensor_parallel_mode="row", **sp
        ),
        # (column+sp under current scaling: the first collective is the amax reduction, not the all-gather)
        lambda: ops.fp8_linear(
            torch.ones(2, 8) if r == 0 else torch.ones(8),
            w,
            None,
            None,
            recipe=RECIPES["current"],
            tensor_parallel_mode="column",
            **sp,
        ),
        lambda: ops.all_gather(torch.ones(2, 3) if r == 0 else torch.ones(6), dim=1),
        lambda: ops.reduce_scatter(torch.ones(4, 2), dim=1 if r == 0 else 2),
        lambda: ops.all_reduce(torch.ones(2) if r == 0 else torch.ones(2, dtype=torch.int32)),
    ]
    return _errors_of(cases)


def block_recipe_refusal_on_every_rank() -> tuple[str, list[float]]:
    """A block recipe with tensor parallelism, rank 1's x also failing sequence parallelism's check:
    every rank raises the refusal (rank 1 used to meet a check the others never joined, and the next
    collective failed), then the next collective works."""
    x = torch.ones(4, 128) if rank() == 0 else torch.ones(128)
    recipe = functe.Float8BlockScaling()
    sp = {"tensor_parallel_mode": "column", "sequence_parallel": True}
    (error,) = _errors_of([lambda: ops.fp8_linear(x, torch.ones(64, 128), None, None, recipe=recipe, **sp)])
    return error, ops.all_reduce(torch.ones(3)).tolist()


def amax_group_outside_the_tensor_parallel_group() -> tuple[str, list[float]]:
    """A delayed-scaling column + SP linear whose ``amax_group`` (a dp group of a dp=1 x tp=2 mesh)
    lacks the other tensor-parallel rank: refused on every rank (the states drifted apart across the
    tensor-parallel ranks and each dequantized the gathered FP8 shards with its own scale: outputs
    85% off one process's); then the next collective works."""
    solo = [dist.new_group([0]), dist.new_group([1])][rank()]  # (every rank makes every group)
    recipe = RECIPES["delayed"]
    x, w = seeded((4, 16), seed=1210), seeded((4, 16), seed=1211)
    sp = {"tensor_parallel_mode": "column", "sequence_parallel": True}
    dp_only = {"amax_group": solo}
    (error,) = _errors_of([lambda: ops.fp8_linear(x, w, None, _fp8_state(recipe), recipe=recipe, **dp_only, **sp)])
    world_group = {"amax_group": dist.group.WORLD}  # (covers it: runs)
    ops.fp8_linear(x, w, None, _fp8_state(recipe), recipe=recipe, **world_group, **sp)
    return error, ops.all_reduce(torch.ones(3)).tolist()


def gradient_reduction_meets_other_ranks() -> list[str]:
    """all_reduce_gradients against a rank raising an argument error or running another collective."""
    r = rank()
    w = seeded((4, 8), seed=802)
    grads = {"w": torch.ones(2, 3)}
    cases = [
        # (rank 1's linear fails its local check and meets rank 0's layout check to say so: the two
        # exchanged signatures of different lengths, and gloo aborted the process)
        lambda: (
            functe.all_reduce_gradients(grads)
            if r == 0
            else ops.linear(torch.ones(3, 2, 4), part(w, 1), tensor_parallel_mode="row", sequence_parallel=True)
        ),
        lambda: functe.all_reduce_gradients(grads) if r == 0 else ops.all_reduce(torch.ones(2, 3)),
        # (rank 1's integer leaf raised at once while rank 0 waited in the layout check)
        lambda: functe.all_reduce_gradients(grads if r == 0 else {"w": torch.ones(2, 3, dtype=torch.int32)}),
    ]
    return _errors_of(cases)


def group_and_dtype_errors() -> list[str]:
    """A group this rank is not in, and dtypes the signature once coded alike (int8 vs bool)."""
    outside = dist.new_group([1])  # (every rank calls new_group; rank 0 gets NON_GROUP_MEMBER)
    cases = [lambda: ops.all_gather(torch.ones(3, dtype=torch.int8 if rank() == 0 else torch.bool))]
    if rank() == 0:
        cases.append(lambda: ops.all_gather(torch.ones(2), group=outside))
    destroyed = dist.new_group([0, 1])
    dist.destroy_process_group(destroyed)  # (its message advised passing the ProcessGroup: it was passed)
    cases.append(lambda: ops.all_reduce(torch.ones(2), group=destroyed))
    return _errors_of(cases)


# ----------------------------------------------------------------------------- fusion, compile, data parallel


def fused_parallel_block() -> dict:
    """functe.fuse over tensor-parallel linears: same values and gradients as unfused; rules decline as TE."""
    x = seeded((4, 3, 4), seed=900)  # replicated
    w1, w2, w3 = (seeded(s, seed=901 + i, scale=0.3) for i, s in enumerate([(8, 4), (4, 8), (8, 4)]))
    b2 = seeded((4,), seed=904)

    def fn(x, w1, w2, b2, w3):
        h = ops.linear(x, w1, tensor_parallel_mode="column") + x  # forward fusion: fires (column)
        a, skip = ops.make_extra_output(h)
        y = ops.linear(a, w2, b2, tensor_parallel_mode="row") + x  # forward: declines (row); backward: fires
        return ops.constant_scale(ops.linear(y, w3, tensor_parallel_mode="column"), 0.5) + skip  # backward: declines

    args = [x, part(w1, 0), part(w2, 1), b2, part(w3, 0)]
    fused = functe.fuse(fn)
    plan = fused.plan(*args)
    leaves = [a.clone().requires_grad_() for a in args]
    out_f = fused(*leaves)
    ct = seeded(out_f.shape, seed=905 + rank())
    g_f = torch.autograd.grad(out_f, leaves, ct)
    out_u = fn(*leaves)
    g_u = torch.autograd.grad(out_u, leaves, ct)
    assert_close(out_f, out_u, msg="fused vs unfused output")
    for name, a, b in zip(("x", "w1", "w2", "b2", "w3"), g_f, g_u):
        assert_close(a, b, msg=f"fused vs unfused d{name}")
    return {
        phase: {"fired": dict(stats.fired), "declined": [(rule, reason) for rule, _, reason in stats.declined]}
        for phase, stats in plan.stats.items()
    }


def compiled_parallel_linear() -> None:
    """torch.compile(fullgraph=True) of a tensor-parallel loss, gradients taken outside, equals eager."""
    x = part(seeded((4, 2, 8), seed=1000), 0)
    w1, w2 = part(seeded((8, 8), seed=1001), 0), part(seeded((8, 8), seed=1002), 1)

    def loss(x, w1, w2):
        h = ops.linear(x, w1, tensor_parallel_mode="column", sequence_parallel=True)
        return ops.linear(torch.tanh(h), w2, tensor_parallel_mode="row", sequence_parallel=True).square().sum()

    args = [t.clone().requires_grad_() for t in (x, w1, w2)]
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    value = compiled(*args)
    grads = torch.autograd.grad(value, args)
    ref_args = [t.clone().requires_grad_() for t in (x, w1, w2)]
    ref = loss(*ref_args)
    for a, b in zip((value, *grads), (ref, *torch.autograd.grad(ref, ref_args))):
        assert_close(a, b, msg="compiled vs eager")


def data_parallel_step() -> None:
    """Each rank's half batch: averaged gradients and loss equal the full batch's on one process."""
    params = {"w": seeded((6, 8), seed=1100), "b": seeded((6,), seed=1101)}
    x, y = seeded((8, 8), seed=1102), seeded((8, 6), seed=1103)

    def loss_fn(params, state, x, y):
        return (ops.linear(x, params["w"], params["b"]) - y).square().mean()

    loss, grads, _ = functe.data_parallel_value_and_grad(loss_fn)(params, None, part(x, 0), part(y, 0))
    ref_loss, ref_grads, _ = functe.value_and_grad(loss_fn)(params, None, x, y)
    assert_close(loss, ref_loss, msg="loss")
    for k in params:
        assert_close(grads[k], ref_grads[k], msg=f"d{k}")
        assert same_on_all_ranks(grads[k])
    mixed = {"a": torch.full((2,), float(rank())), "h": torch.ones(3, dtype=torch.bfloat16)}
    mixed = functe.all_reduce_gradients(mixed)
    assert mixed["a"].tolist() == [(world() - 1) / 2] * 2 and mixed["h"].dtype == torch.bfloat16
    assert math.isclose(mixed["h"][0].item(), 1.0)
    # FP8 replicas reduce their amaxes over the world (amax_group) so their states agree, fused too:
    # the fused FP8 ops (q-in activation, dact + dbias + cast; norm q-in) reduce them in their
    # backward as fp8_linear does (they declined an amax_group before, losing the fusions)
    recipe = functe.DelayedScaling(amax_history_len=2)
    lin = functools.partial(ops.fp8_linear, recipe=recipe, amax_group=dist.group.WORLD)

    def block(x, g, w, w2, state, state2):
        h = ops.gelu(lin(ops.gelu(x), w, None, state))
        return ops.gelu(lin(ops.rms_norm(h, g), w2, None, state2))

    def fp8_loss(block, params, states, x):
        return block(x, params["g"], params["w"], params["w2"], *states).square().mean()

    xr = seeded((4, 8), seed=1104, scale=1.0 + 10.0 * rank())  # (each replica sees other magnitudes)
    fp8_params = {"g": seeded((8,), seed=1106), "w": seeded((8, 8), seed=1105), "w2": seeded((8, 8), seed=1107)}
    states = (functe.init_linear_scaling_state(recipe), functe.init_linear_scaling_state(recipe))
    fused_block = functe.fuse(block)
    plan = fused_block.plan(xr, fp8_params["g"], fp8_params["w"], fp8_params["w2"], *states)
    assert plan.stats["forward"].fired == {"forward_activation_quantize": 1, "forward_norm_quantize": 1}, plan.stats
    assert plan.stats["backward"].fired == {"backward_fp8_linear_activation": 2}, plan.stats
    for _ in range(2):  # (the second step quantizes with the reduced first step's scales)
        *_, unfused = functe.value_and_grad(functools.partial(fp8_loss, block))(fp8_params, states, xr)
        *_, fused = functe.value_and_grad(functools.partial(fp8_loss, fused_block))(fp8_params, states, xr)
        for a, b in zip(functe.tree_leaves(unfused), functe.tree_leaves(fused), strict=True):
            assert torch.equal(a, b) and same_on_all_ranks(b)
        states = fused
