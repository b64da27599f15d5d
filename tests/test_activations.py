"""Activation ops: values and gradients vs float64 references on both backends, transforms, errors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import pytest
import torch
from act_helpers import (
    KINDS,
    UNARY,
    as64,
    check,
    check_sum,
    clamped_swiglu,
    deinterleave,
    factor_scales,
    gated,
    inputs,
    on_backends,
    outputs_and_grads,
)
from helpers import F64, FLOATS, check_transforms, gradchecks, make

import functe
from functe import ops
from functe.testing import assert_close

ELEMENTWISE = [(37,), (2, 13), (32, 1, 32), (0, 13), (3, 0)]  # (3, 0): an empty last dimension
GATED = [(74,), (2, 26), (32, 1, 64), (0, 26)]
GATED_K4 = [(72,), (2, 24), (32, 1, 64), (0, 24)]  # H divisible by 4


@dataclass(frozen=True)
class Case:
    name: str
    fn: Callable  # the functe op: (x) or (x, s)
    ref: Callable  # float64 reference from the formula, same arguments
    shapes: list  # x shapes for the value tests
    small: tuple  # x shape for the transform and gradcheck tests
    scaled: bool = False
    gated: bool = False
    k: int | None = None  # interleave block


def _scaled(f):
    return lambda x, s: s[..., None] * f(x)


_TIGHT = dict(limit=0.75, alpha=1.3, glu_linear_offset=0.0)  # clamps hit often with normal inputs
_tight_ref = partial(clamped_swiglu, limit=0.75, alpha=1.3, offset=0.0)

CASES = [
    *(Case(n, getattr(ops, n), UNARY[n], ELEMENTWISE, (2, 5)) for n in ("gelu", "qgelu", "relu", "srelu", "silu")),
    Case("sigmoid_by_name", lambda x: ops.activation(x, "sigmoid"), torch.sigmoid, ELEMENTWISE, (2, 5)),
    *(
        Case(n, getattr(ops, n), partial(gated, n), GATED, (2, 8), gated=True)
        for n in ("glu", "geglu", "qgeglu", "reglu", "sreglu", "swiglu")
    ),
    Case("swiglu_k4", partial(ops.swiglu, interleave=4), partial(gated, "swiglu", k=4), GATED_K4, (2, 16), k=4),
    Case("geglu_k1", partial(ops.geglu, interleave=1), partial(gated, "geglu", k=1), GATED, (2, 8), k=1),
    Case("clamped_swiglu", ops.clamped_swiglu, clamped_swiglu, GATED, (2, 8), gated=True),
    Case(
        "clamped_swiglu_tight_k4",
        partial(ops.clamped_swiglu, interleave=4, **_TIGHT),
        partial(_tight_ref, k=4),
        GATED_K4,
        (2, 16),
        k=4,
    ),
    Case("scaled_swiglu", ops.scaled_swiglu, _scaled(partial(gated, "swiglu")), GATED, (2, 8), True, True),
    Case(
        "scaled_swiglu_k4",
        partial(ops.scaled_swiglu, interleave=4),
        _scaled(partial(gated, "swiglu", k=4)),
        GATED_K4,
        (2, 16),
        True,
        k=4,
    ),
    Case("scaled_srelu", ops.scaled_srelu, _scaled(UNARY["srelu"]), ELEMENTWISE, (2, 5), True),
    Case("scaled_clamped_qgeglu", ops.scaled_clamped_qgeglu, _scaled(clamped_swiglu), GATED, (2, 8), True, True),
    Case(
        "scaled_clamped_qgeglu_tight_k4",
        partial(ops.scaled_clamped_qgeglu, interleave=4, **_TIGHT),
        _scaled(partial(_tight_ref, k=4)),
        GATED_K4,
        (2, 16),
        True,
        k=4,
    ),
    Case(
        "gelu_row_scaled_by_name",
        lambda x, s: ops.activation(x, "gelu", s),
        _scaled(UNARY["gelu"]),
        ELEMENTWISE,
        (2, 5),
        True,
    ),
]
IDS = [c.name for c in CASES]


def _arg_shapes(case, shape):
    return (shape, shape[:-1]) if case.scaled else (shape,)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_values_and_grads_vs_float64_on_both_backends(case, dtype):
    """y, dx (and ds) from the twins and from the Triton kernels vs float64, and vs each other."""
    for shape in case.shapes:
        for kind in KINDS:
            args = inputs(_arg_shapes(case, shape), dtype, kind)
            ref_out = case.ref(*as64(args))
            cotangent = make(ref_out.shape, dtype)
            ref_out, ref_grads, _ = outputs_and_grads(case.ref, as64(args), as64([cotangent])[0])
            if case.scaled:
                unscaled = case.ref(as64(args)[0], torch.ones(shape[:-1], dtype=F64))
                magnitude = (as64([cotangent])[0].abs() * unscaled.abs()).sum(-1)
            x64, s64 = as64(args)[0], (as64(args)[1] if case.scaled else None)
            gated_ = case.gated or case.k is not None
            y_scale, dx_scale = factor_scales(x64, s64, as64([cotangent])[0], gated_, case.k)
            results = on_backends(case.fn, args, cotangent)
            for backend, (out, grads) in results.items():
                where = f"{case.name} {dtype} {shape} {kind} [{backend}]"
                assert out.dtype == dtype and all(g.dtype == dtype for g in grads), where
                check(out, ref_out, f"{where} y", y_scale)
                check(grads[0], ref_grads[0], f"{where} dx", dx_scale)
                if case.scaled:
                    check_sum(grads[1], ref_grads[1], magnitude, f"{where} ds")
            (tri_out, tri_grads), (twin_out, twin_grads) = results["interpret"], results["torch"]
            where = f"{case.name} {dtype} {shape} {kind}: triton vs twin"
            check(tri_out, as64([twin_out])[0], f"{where} y", y_scale)
            check(tri_grads[0], as64(twin_grads[:1])[0], f"{where} dx", dx_scale)
            if case.scaled:
                check_sum(tri_grads[1], as64(twin_grads[1:])[0], magnitude, f"{where} ds")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_torch_func_transforms(case, backend):
    args = [make(s, F64) for s in _arg_shapes(case, case.small)]
    check_transforms(case.fn, case.ref, args)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gradcheck(case, backend):
    gradchecks(case.fn, [make(s, F64) for s in _arg_shapes(case, case.small)])


def test_fp32_scale_with_low_precision_x(backend):
    """s may be fp32 with a bf16 x (routing probabilities); ds comes back fp32, y and dx bf16."""
    x, s = make((4, 16), torch.bfloat16), make((4,), torch.float32)
    cot = make((4, 8), torch.bfloat16)
    out, (dx, ds), _ = outputs_and_grads(ops.scaled_swiglu, [x, s], cot)
    assert (out.dtype, dx.dtype, ds.dtype) == (torch.bfloat16, torch.bfloat16, torch.float32)
    ref = _scaled(partial(gated, "swiglu"))
    ref_out, ref_grads, _ = outputs_and_grads(ref, as64([x, s]), as64([cot])[0])
    check(out, ref_out, "y")
    check(dx, ref_grads[0], "dx")
    magnitude = (as64([cot])[0].abs() * gated("swiglu", as64([x])[0]).abs()).sum(-1)
    check_sum(ds, ref_grads[1], magnitude, "ds")


def test_interleaved_equals_chunked_after_deinterleaving(backend):
    """interleave=k on x equals the chunked op on the de-interleaved x, forward and backward."""
    x = make((3, 48), torch.float32)
    a, b = deinterleave(x, 8)
    chunked = torch.cat([a, b], dim=-1)
    for name in ("swiglu", "geglu", "clamped_swiglu"):
        fn = getattr(ops, name)
        assert torch.equal(fn(x, interleave=8), fn(chunked))
        gx = torch.func.grad(lambda x, fn=fn: (fn(x, interleave=8) * torch.arange(24.0)).sum())(x)
        gc = torch.func.grad(lambda x, fn=fn: (fn(x) * torch.arange(24.0)).sum())(chunked)
        ga, gb = deinterleave(gx, 8)
        assert torch.equal(torch.cat([ga, gb], -1), gc), name
    # interleave=H is the chunked layout itself
    assert torch.equal(ops.swiglu(x, interleave=24), ops.swiglu(x))


def test_first_half_is_the_gated_one():
    """TE gates the first half: glu(x) == F.glu with the halves swapped."""
    x = make((5, 12), torch.float32)
    a, b = x.chunk(2, -1)
    assert_close(ops.glu(x), torch.nn.functional.glu(torch.cat([b, a], -1)))


def test_nan_propagates_and_infinities_follow_the_formulas():
    """NaN in -> NaN out (values, and gradients except relu/srelu whose derivatives are TE's
    literal ``x > 0 ? ... : 0``); +inf -> +inf; relu-like -inf -> 0; kernels == twins.

    Where a formula has the form inf·0 (e.g. gelu(-inf) = -inf·(0.5 + 0.5·tanh(-inf))), the result
    is NaN on both backends, as in TE and torch.
    """
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e30, -1e30, 2.0])
    for name in ("gelu", "qgelu", "relu", "srelu", "silu", "sigmoid"):
        results = {}
        for backend in ("torch", "interpret"):
            with functe.use_backend(backend):
                y = ops.activation(specials, name)
                dx = torch.func.grad(lambda x, name=name: ops.activation(x, name).sum())(specials)
            results[backend] = (y, dx)
            assert y[0].isnan(), (name, backend)
            assert (dx[0] == 0) if name in ("relu", "srelu") else dx[0].isnan(), (name, backend)
            assert y[1] == (1.0 if name == "sigmoid" else float("inf")), (name, backend, y)
            assert y[3] == y[4] == (0.5 if name == "sigmoid" else 0.0), (name, backend, y)
            if name in ("relu", "srelu", "sigmoid"):
                assert y[2] == 0 and y[6] == 0, (name, backend, y)
        for t, r in zip(results["interpret"], results["torch"]):
            assert torch.equal(t.isnan(), r.isnan()), name
            assert_close(t[~t.isnan()], r[~r.isnan()], msg=name)
    # gated: NaN in either half gives NaN
    x = torch.tensor([[float("nan"), 1.0, 1.0, float("nan")]])
    for name in ("glu", "geglu", "qgeglu", "reglu", "sreglu", "swiglu", "clamped_swiglu"):
        for backend in ("torch", "interpret"):
            with functe.use_backend(backend):
                y = getattr(ops, name)(x)
            assert y.isnan().all(), (name, backend, y)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("name", ["relu", "srelu", "reglu", "sreglu", "scaled_srelu"])
def test_piecewise_linear_backward_keeps_te_special_values_in_plain_autograd(name, dtype):
    """Plain autograd takes the CPU fast paths (no transform records): dx = dy·f'(x) with f'(NaN) = 0
    and inf·0 = NaN, exactly as the float64 formula, both when x is free of NaN/-inf (single-pass
    route) and when it is not (fallback); gated and row-scaled forms through the chunked path (the
    linear half and the scale are ones, so the activated half's gradient is dy·f'(a))."""
    # (1e20 and -3e38: dy·2x overflows where x <= 0, and TE's dy·0 is still 0 there; in fp16 they
    # are infinities)
    values = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 3.0, -3.0, 0.5, 1e20, -3e38]
    grid_x, grid_dy = torch.tensor(values).repeat_interleave(len(values)), torch.tensor(values).repeat(len(values))
    clean = ~(grid_x.isnan() | (grid_x == -float("inf")))
    squared = name in ("srelu", "sreglu", "scaled_srelu")
    for a, dy in [(grid_x, grid_dy), (grid_x[clean], grid_dy[clean])]:
        a, dy = a.to(dtype)[None], dy.to(dtype)[None]  # one row
        x = (torch.cat([a, torch.ones_like(a)], -1) if name in ("reglu", "sreglu") else a).requires_grad_()
        scale = (torch.ones(1, dtype=dtype),) if name == "scaled_srelu" else ()
        (dx,) = torch.autograd.grad(ops.activation(x, name, *scale), x, dy)
        dx = dx[..., : a.shape[-1]]
        a64 = a.double()
        slope = torch.where(a64 > 0, 2 * a64 if squared else torch.ones_like(a64), torch.zeros_like(a64))
        want = dy.double() * slope
        assert torch.equal(dx.isnan(), want.isnan()), (name, dtype, a, dy, dx)
        assert torch.equal(dx.double()[~want.isnan()], want.to(dtype).double()[~want.isnan()]), (name, dtype, dx)


def test_non_contiguous_inputs_and_stride0_cotangents(backend):
    x = make((26, 6), torch.float32).t()  # (6, 26), non-contiguous
    s = make((12,), torch.float32)[::2]  # (6,), stride 2
    g = torch.func.grad(lambda x: ops.swiglu(x).sum())(x)  # dy arrives stride-0
    ref = torch.func.grad(lambda x: gated("swiglu", x).sum())(x.double())
    check(g, ref, "swiglu dx")
    gx, gs = torch.func.grad(lambda x, s: ops.scaled_swiglu(x, s).sum(), argnums=(0, 1))(x, s)
    rx, rs = torch.func.grad(lambda x, s: (s[:, None] * gated("swiglu", x)).sum(), argnums=(0, 1))(
        x.double(), s.double()
    )
    check(gx, rx, "scaled dx")
    check_sum(gs, rs, gated("swiglu", x.double()).abs().sum(-1), "scaled ds")


def test_vmap_over_batched_scale_and_x(backend):
    x, s = make((3, 4, 16), F64), make((3, 4), F64)
    ref = _scaled(partial(gated, "swiglu"))
    assert_close(torch.vmap(ops.scaled_swiglu)(x, s), ref(x, s))
    assert_close(torch.vmap(ops.scaled_swiglu, in_dims=(None, 0))(x[0], s), torch.vmap(ref, in_dims=(None, 0))(x[0], s))


# ----------------------------------------------------------------------------- errors


def test_gated_ops_reject_an_odd_last_dimension():
    with pytest.raises(
        functe.ShapeError, match=r"functe\.swiglu: argument 'x' expected f32\[\.\.\.,2H\], got f32\[4,7\]"
    ):
        ops.swiglu(torch.zeros(4, 7))
    with pytest.raises(functe.ShapeError, match=r"functe\.glu: argument 'x' expected bf16\[\.\.\.,2H\], got bf16\[\]"):
        ops.glu(torch.zeros((), dtype=torch.bfloat16))


def test_interleave_must_divide_half_the_last_dimension():
    with pytest.raises(functe.ShapeError, match=r"H divisible by interleave=4, got f32\[2,12\] \(H = 6\)"):
        ops.swiglu(torch.zeros(2, 12), interleave=4)
    with pytest.raises(TypeError, match=r"'interleave' expected a positive int or None, got 0"):
        ops.swiglu(torch.zeros(2, 12), interleave=0)
    # (ops.activation's errors named the activation, functe.gelu, as if ops.gelu had been called)
    with pytest.raises(
        functe.ArgumentError,
        match=r"functe\.activation: argument 'interleave' applies to gated activations only \('gelu' is not gated\), "
        r"got 2",
    ):
        ops.activation(torch.zeros(2, 12), "gelu", interleave=2)
    with pytest.raises(functe.DTypeError, match=r"^functe\.activation: argument 's' expected dtype of 'x' f32\[2,12\]"):
        ops.activation(torch.zeros(2, 12), "swiglu", torch.zeros(2, dtype=torch.float16))


def test_scale_shape_dtype_and_parameter_errors():
    x = torch.zeros(4, 16)
    with pytest.raises(
        functe.ShapeError, match=r"functe\.scaled_swiglu: argument 's' expected f32\[4\], got f32\[4,1\]"
    ):
        ops.scaled_swiglu(x, torch.zeros(4, 1))
    with pytest.raises(functe.DTypeError, match=r"argument 's' expected dtype of 'x' f32\[4,16\] or f32, got f16\[4\]"):
        ops.scaled_srelu(x, torch.zeros(4, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"argument 'limit' expected a finite Python number >= 0, got -1"):
        ops.clamped_swiglu(x, limit=-1)
    with pytest.raises(ValueError, match=r"functe\.activation: argument 'name' expected one of gelu, .*, got 'tanh'"):
        ops.activation(x, "tanh")
    with pytest.raises(ValueError, match=r"'swiglu' takes no parameter 'limit'"):
        ops.activation(x, "swiglu", limit=3.0)
    with pytest.raises(TypeError, match=r"'scaled_swiglu' needs the row scale 's'"):
        ops.activation(x, "scaled_swiglu")
    with pytest.raises(functe.DTypeError, match=r"functe\.gelu: argument 'x' expected dtype f32\|f16\|bf16\|f64"):
        ops.gelu(torch.zeros(3, dtype=torch.int32))


def test_by_name_entry_point_covers_every_name():
    x, s = make((3, 8), torch.float32), make((3,), torch.float32)
    for name in ops.ACTIVATION_NAMES:
        scaled = name.startswith("scaled_")
        y = ops.activation(x, name, s) if scaled else ops.activation(x, name)
        named = getattr(ops, name, None)
        if named is not None:
            assert torch.equal(y, named(x, s) if scaled else named(x)), name
    assert torch.equal(ops.activation(x, "clamped_swiglu", limit=0.5), ops.clamped_swiglu(x, limit=0.5))
