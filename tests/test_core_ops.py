"""Core ops: values and gradients vs float64 references, on both backends, and every transform."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from helpers import FLOATS, as64, backward_gemms, check_transforms, gradchecks, make, saved_storages

import functe
from functe import ops
from functe.testing import assert_close


@dataclass(frozen=True)
class Case:
    name: str
    fn: Callable  # the functe op under test
    ref: Callable  # a plain-torch reference written from the op's formula
    shapes: tuple  # argument shapes


def _linear_ref(x, w, b):
    return x @ w.T + b


CASES = [
    Case("linear", lambda x, w, b: ops.linear(x, w, b), _linear_ref, ((2, 13), (7, 13), (7,))),
    Case("linear_3d", lambda x, w, b: ops.linear(x, w, b), _linear_ref, ((32, 1, 32), (5, 32), (5,))),
    Case("linear_nobias", lambda x, w: ops.linear(x, w), lambda x, w: x @ w.T, ((37,), (3, 37))),
    Case("linear_empty", lambda x, w, b: ops.linear(x, w, b), _linear_ref, ((0, 13), (4, 13), (4,))),
    Case("bias", lambda x, b: ops.bias(x, b), lambda x, b: x + b, ((2, 13), (13,))),
    Case("bias_3d", lambda x, b: ops.bias(x, b), lambda x, b: x + b, ((32, 1, 32), (32,))),
    Case("bias_empty", lambda x, b: ops.bias(x, b), lambda x, b: x + b, ((0, 13), (13,))),
    Case("add_extra_input", lambda x, e: ops.add_extra_input(x, e), lambda x, e: x + e, ((2, 13), (2, 13))),
    Case("add_extra_input_1d", lambda x, e: ops.add_extra_input(x, e), lambda x, e: x + e, ((37,), (37,))),
    Case("make_extra_output", lambda x: ops.make_extra_output(x), lambda x: (x, x), ((2, 13),)),
    Case("constant_scale", lambda x: ops.constant_scale(x, -2.5), lambda x: -2.5 * x, ((32, 1, 32),)),
    Case("constant_scale_zero", lambda x: ops.constant_scale(x, 0.0), lambda x: 0.0 * x, ((37,),)),
    Case("constant_scale_0d", lambda x: ops.constant_scale(x, 3.5), lambda x: 3.5 * x, ((),)),
    Case("identity", lambda x: ops.identity(x), lambda x: x, ((2, 13),)),
    Case("reshape", lambda x: ops.reshape(x, (13, -1)), lambda x: x.reshape(13, -1), ((2, 13),)),
]
IDS = [c.name for c in CASES]


def _outputs_and_vjp(fn, args, cotangents=None):
    """Outputs of ``fn`` and its VJP with random cotangents (drawn in the output dtype).

    The float64 reference reuses the same, already rounded, cotangents, so the
    comparison measures only the op's own arithmetic.
    """
    args = [a.detach().requires_grad_() for a in args]
    out = fn(*args)
    outs = out if isinstance(out, tuple) else (out,)
    if cotangents is None:
        cotangents = [make(o.shape, o.dtype, device=o.device) for o in outs]
    grads = torch.autograd.grad(outs, args, [c.to(o.dtype) for c, o in zip(cotangents, outs)])
    return outs, grads, cotangents


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_values_and_grads_vs_float64(case, dtype, backend, device):
    args = [make(s, dtype, device=device) for s in case.shapes]
    outs, grads, cotangents = _outputs_and_vjp(case.fn, args)
    ref_outs, ref_grads, _ = _outputs_and_vjp(case.ref, as64(*args), as64(*cotangents))
    for o, r in zip(outs, ref_outs):
        assert o.dtype == dtype and o.shape == r.shape
        assert_close(o, r, msg=f"{case.name} output")
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert g.dtype == dtype, f"{case.name} grad {i} dtype {g.dtype}"
        assert_close(g, r, msg=f"{case.name} grad {i}")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_torch_func_transforms(case, backend):
    args = [make(s, torch.float64) for s in case.shapes]
    if any(a.numel() == 0 for a in args):
        pytest.skip("jacobians of empty tensors are empty")
    check_transforms(case.fn, case.ref, args)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gradcheck(case, backend):
    args = [make(s, torch.float64) for s in case.shapes]
    gradchecks(case.fn, args)


def test_functional_call_and_grad_and_value(backend):
    """functional_call over a params dict; grad_and_value(has_aux=True) vs autograd."""
    module = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
    params = {k: v.detach() for k, v in module.named_parameters()}
    x = make((5, 6), torch.float64)

    def forward(p, x):
        h = ops.linear(x, p["0.weight"], p["0.bias"])
        return ops.linear(torch.tanh(h), p["2.weight"], p["2.bias"])

    def loss(p, x):
        out = forward(p, x)
        return (out**2).mean(), {"mean": out.mean()}

    grads, (value, aux) = torch.func.grad_and_value(loss, has_aux=True)(params, x)
    expected = torch.func.functional_call(module, params, (x,))
    assert_close(forward(params, x), expected)
    ref_params = {k: v.clone().requires_grad_() for k, v in params.items()}
    ref_loss = (torch.func.functional_call(module, ref_params, (x,)) ** 2).mean()
    ref_grads = torch.autograd.grad(ref_loss, list(ref_params.values()))
    assert_close(value, ref_loss)
    assert_close(aux["mean"], expected.mean())
    for (name, g), r in zip(grads.items(), ref_grads):
        assert_close(g, r, msg=name)
    # per-example gradients: vmap(grad) over the batch, params shared
    per_example = torch.func.vmap(torch.func.grad(lambda p, x: loss(p, x[None])[0]), in_dims=(None, 0))(params, x)
    assert per_example["0.weight"].shape == (5, 8, 6)
    assert_close(per_example["0.weight"].mean(0), grads["0.weight"] * 1.0)


def test_add_extra_input_in_place_donates_only_when_invisible():
    x, extra = torch.ones(4), torch.full((4,), 2.0)
    with torch.no_grad():
        y = ops.add_extra_input(x, extra, in_place=True)
    assert y.data_ptr() == extra.data_ptr() and y.tolist() == [3.0] * 4
    # Under autograd the caller's buffer is left alone and gradients flow to both inputs.
    x, extra = torch.ones(4, requires_grad=True), torch.full((4,), 2.0, requires_grad=True)
    y = ops.add_extra_input(x, extra, in_place=True)
    assert y.data_ptr() != extra.data_ptr() and extra.tolist() == [2.0] * 4
    gx, ge = torch.autograd.grad(y.sum(), (x, extra))
    assert gx.tolist() == ge.tolist() == [1.0] * 4
    # Under torch.func.grad too.
    g = torch.func.grad(lambda e: ops.add_extra_input(torch.ones(4), e, in_place=True).sum())(torch.zeros(4))
    assert g.tolist() == [1.0] * 4
    # An x overlapping extra's memory (add_ raised "some elements ... refer to a single memory location").
    square, buf = torch.arange(9.0).view(3, 3), torch.arange(5.0)
    with torch.no_grad():
        assert torch.equal(ops.add_extra_input(square.t(), square.clone(), in_place=True), square.t() + square)
        assert torch.equal(ops.add_extra_input(square.t(), square, in_place=True), square.t() + square.clone())
        assert ops.add_extra_input(buf[1:], buf[:-1], in_place=True).tolist() == [1.0, 3.0, 5.0, 7.0]
    # An extra that another live tensor views: make_extra_output's extra output (it was the input
    # itself, so the write reached the caller's x and the other output y), identity's, a reshape's
    x, w = torch.arange(6.0).reshape(2, 3), torch.eye(3)
    before = x.clone()
    with torch.no_grad():
        y, skip = ops.make_extra_output(x)
        assert ops.add_extra_input(ops.linear(y, w), skip, in_place=True).tolist() == (2 * before).tolist()
        assert torch.equal(y, before) and torch.equal(x, before)
        for view in (ops.identity(x), ops.reshape(x, (3, 2)).reshape(2, 3), x[:1]):
            ops.add_extra_input(torch.ones_like(view), view, in_place=True)
            assert torch.equal(x, before)


def test_make_extra_output_unused_branch_gives_plain_gradient(backend):
    x = make((3, 5), torch.float64)
    g = torch.func.grad(lambda x: (ops.make_extra_output(x)[0] * 3).sum())(x)
    assert torch.equal(g, torch.full_like(x, 3.0))


def test_non_contiguous_and_stride0_cotangents(backend):
    """The gradient of .sum() arrives as a stride-0 tensor; transposed inputs are non-contiguous."""
    x = make((13, 6), torch.float32).t()  # non-contiguous (6, 13)
    b = make((13,), torch.float32)
    g = torch.func.grad(lambda x, b: ops.bias(x, b).sum(), argnums=(0, 1))(x, b)
    assert torch.equal(g[0], torch.ones_like(x)) and torch.equal(g[1], torch.full_like(b, 6.0))
    y = ops.constant_scale(x, 2.0)
    assert_close(y, 2.0 * x.double())


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("in_features, out_features", [(4, 0), (0, 5), (0, 0)])
def test_zero_width_linears_forward_and_backward(in_features, out_features):
    # No input or no output features: y is the bias (or empty), the gradients are zeros of the
    # arguments' shapes, as with torch; unfused, fused, and quantized (a 0-row reshape once failed here).
    x, w, b = make((2, 3, in_features)), make((out_features, in_features)), make((out_features,))
    recipe = functe.CurrentScaling()
    programs = {
        "linear": lambda x, w, b: ops.linear(x, w, b),
        "fuse": functe.fuse(lambda x, w, b: ops.gelu(ops.linear(x, w, b)) + 1.0 * ops.linear(x, w, b)),
        "fp8_linear": lambda x, w, b: ops.fp8_linear(x, w, b, None, recipe=recipe),
    }
    references = {
        "linear": lambda x, w, b: torch.nn.functional.linear(x, w, b),
        "fuse": lambda x, w, b: (
            torch.nn.functional.gelu(torch.nn.functional.linear(x, w, b), approximate="tanh")
            + torch.nn.functional.linear(x, w, b)
        ),
        "fp8_linear": lambda x, w, b: torch.nn.functional.linear(x, w, b),
    }
    for name, fn in programs.items():
        args = [t.clone().requires_grad_() for t in (x, w, b)]
        ref_args = [t.clone().requires_grad_() for t in (x, w, b)]
        y, ref = fn(*args), references[name](*ref_args)
        assert y.shape == ref.shape, name
        assert_close(y, ref, dtype=torch.float16, msg=name)
        cot = make(y.shape)
        for g, r in zip(torch.autograd.grad(y, args, cot), torch.autograd.grad(ref, ref_args, cot)):
            assert g.shape == r.shape, name
            assert_close(g, r, dtype=torch.float16, msg=name)


def test_linear_rejects_wrong_in_features():
    with pytest.raises(
        functe.ShapeError, match=r"functe\.linear: argument 'weight' expected f32\[\?,16\], got f32\[8,15\]"
    ):
        ops.linear(torch.zeros(4, 16), torch.zeros(8, 15))


def test_linear_rejects_dtype_mismatch_and_bias_shape():
    with pytest.raises(
        functe.DTypeError, match=r"'weight' expected dtype f32 to match 'x' f32\[4,16\], got bf16\[8,16\]"
    ):
        ops.linear(torch.zeros(4, 16), torch.zeros(8, 16, dtype=torch.bfloat16))
    with pytest.raises(functe.ShapeError, match=r"'bias' expected f32\[8\], got f32\[16\]"):
        ops.linear(torch.zeros(4, 16), torch.zeros(8, 16), torch.zeros(16))
    with pytest.raises(functe.DTypeError, match=r"'x' expected dtype f32\|f16\|bf16\|f64, got i64\[4,16\]"):
        ops.linear(torch.zeros(4, 16, dtype=torch.long), torch.zeros(8, 16))


def test_device_mismatch_error():
    x = torch.zeros(2, 3)
    meta = torch.zeros(3, device="meta")
    with pytest.raises(
        functe.DeviceError, match=r"functe\.bias: arguments must share one device, got 'x' on cpu, 'b' on meta"
    ):
        ops.bias(x, meta)


def test_other_argument_errors():
    with pytest.raises(functe.ShapeError, match=r"functe\.bias: argument 'b' expected f32\[13\], got f32\[12\]"):
        ops.bias(torch.zeros(2, 13), torch.zeros(12))
    # (a 0-d x blamed b: "argument 'b' expected f32[?], got f32[1]")
    with pytest.raises(functe.ShapeError, match=r"functe\.bias: argument 'x' expected a tensor of rank >= 1"):
        ops.bias(torch.tensor(1.0), torch.zeros(1))
    with pytest.raises(functe.ShapeError, match=r"'extra' expected f32\[2,13\], got f32\[13\]"):
        ops.add_extra_input(torch.zeros(2, 13), torch.zeros(13))
    with pytest.raises(functe.ShapeError, match=r"functe\.reshape: argument 'shape' expected a shape with 26 elements"):
        ops.reshape(torch.zeros(2, 13), (5, -1))
    with pytest.raises(
        TypeError, match=r"functe\.constant_scale: argument 'scale' expected a Python number, got f32\[\]"
    ):
        ops.constant_scale(torch.zeros(2), torch.tensor(2.0))
    with pytest.raises(functe.FuncteError):  # the family catches every class
        ops.linear(torch.zeros(4, 16), torch.zeros(8, 15))


def _block(x, w1, b1, w2):
    return ops.linear(ops.gelu(ops.linear(x, w1, b1)), w2) * 0.5 + x


@pytest.mark.parametrize("fused", [False, True])
def test_frozen_weights_cost_no_weight_gradient_gemm(fused):
    # linear's backward computed dW whatever autograd wanted: a frozen weight (adapter or bias-only
    # fine-tuning) cost a third more backward GEMMs than eager torch, which skips it.
    fn = functe.fuse(_block) if fused else _block
    x, w1, b1, w2 = make((8, 16)), make((32, 16)), make((32,)), make((16, 32))
    trainable_x = x.clone().requires_grad_()
    assert backward_gemms(fn, (trainable_x, w1, b1, w2), trainable_x) == 2  # two dgrads
    trainable_w2 = w2.clone().requires_grad_()
    assert backward_gemms(fn, (x, w1, b1, trainable_w2), trainable_w2) == 1  # fc2's wgrad alone
    every = [t.clone().requires_grad_() for t in (x, w1, b1, w2)]
    assert backward_gemms(fn, every, every) == 4
    for args in ((trainable_x, w1, b1, w2), (x, w1, b1, trainable_w2), every):
        wrt = [a for a in args if a.requires_grad]
        got = torch.autograd.grad(fn(*args).sum(), wrt)
        want = torch.autograd.grad(_block(*args).sum(), wrt)
        for g, e in zip(got, want):
            assert_close(g, e)
    # torch.func: only the differentiated argument's gradient is computed
    grad_w2 = torch.func.grad(lambda w: fn(x, w1, b1, w).sum())(w2)
    assert_close(grad_w2, torch.func.grad(lambda w: _block(x, w1, b1, w).sum())(w2))


def _fp8_linear_of(recipe):
    state = functe.init_linear_scaling_state(recipe)
    seed = torch.tensor(5) if isinstance(recipe, functe.NVFP4BlockScaling) else None
    return lambda x, w: ops.fp8_linear(x, w, None, state, recipe=recipe, seed=seed)


_PRUNED_LINEARS = {
    "linear": lambda x, w: ops.linear(x, w, None),
    **{
        type(r).__name__: _fp8_linear_of(r)
        for r in (
            functe.CurrentScaling(),
            functe.DelayedScaling(),
            functe.MXFP8BlockScaling(),
            functe.Float8BlockScaling(),
            functe.NVFP4BlockScaling(),
        )
    },
}


@pytest.mark.parametrize("name", list(_PRUNED_LINEARS))
def test_a_frozen_weight_keeps_no_input_alive(name):
    # A linear saved its input (or its quantized copy) whatever autograd wanted: a frozen weight's
    # wgrad never runs, yet the input stayed alive until backward (LoRA-style frozen base weights kept
    # every activation). Only the residuals a wanted gradient reads are saved now.
    fn = _PRUNED_LINEARS[name]
    x, w = make((32, 64)), make((16, 64))
    out = lambda y: y[0] if isinstance(y, tuple) else y
    dx_only = x.clone().requires_grad_()
    y, saved = saved_storages(lambda: out(fn(dx_only, w)))
    shapes = list(saved.values())
    assert (32, 64) not in shapes and (16, 64) in shapes
    (dx,) = torch.autograd.grad(y.sum(), dx_only)
    dw_only = w.clone().requires_grad_()
    y, saved = saved_storages(lambda: out(fn(x, dw_only)))
    shapes = list(saved.values())
    assert (32, 64) in shapes and (16, 64) not in shapes
    (dw,) = torch.autograd.grad(y.sum(), dw_only)
    both = x.clone().requires_grad_(), w.clone().requires_grad_()
    y, saved = saved_storages(lambda: out(fn(*both)))
    shapes = list(saved.values())
    assert (32, 64) in shapes and (16, 64) in shapes
    want_dx, want_dw = torch.autograd.grad(y.sum(), both)
    assert torch.equal(dx, want_dx) and torch.equal(dw, want_dw)
    # torch.func sees the same needs: the gradient of one argument from the other's residuals
    assert torch.equal(torch.func.grad(lambda x: out(fn(x, w)).sum())(x), want_dx)
    assert torch.equal(torch.func.grad(lambda w: out(fn(x, w)).sum())(w), want_dw)


def test_pruned_residuals_keep_higher_order_and_batched_gradients():
    # With the weight frozen the input is not saved; the Hessian-vector products and per-example
    # gradients that use the weight alone are unchanged.
    x, w = make((4, 6), torch.float64), make((3, 6), torch.float64)
    loss = lambda x, w: ops.gelu(ops.linear(x, w)).square().sum()
    ref = lambda x, w: torch.nn.functional.gelu(x @ w.T, approximate="tanh").square().sum()
    assert_close(torch.func.hessian(loss)(x, w), torch.func.hessian(ref)(x, w))
    per_row = torch.func.vmap(torch.func.grad(loss), in_dims=(0, None))
    assert_close(per_row(x[:, None], w), torch.func.vmap(torch.func.grad(ref), in_dims=(0, None))(x[:, None], w))


def test_prune_residuals_contract_is_checked():
    fwd = lambda x, w: (x * w, (x, w))
    bwd = lambda res, g, needs_input_grad: (g * res[1], g * res[0])
    with pytest.raises(functe.RuleError, match="prune_residuals needs needs_input_grad=True"):
        functe.custom_vjp("mul", fwd, bwd, prune_residuals=lambda res, needs_input_grad: res)
    bad = functe.custom_vjp("mul", fwd, bwd, needs_input_grad=True, prune_residuals=lambda res, needs_input_grad: None)
    with pytest.raises(functe.RuleError, match=r"functe\.mul: prune_residuals must return the residuals"):
        bad(make((3,)).requires_grad_(), make((3,)))
    swapped = functe.custom_vjp(
        "mul", fwd, bwd, needs_input_grad=True, prune_residuals=lambda res, needs_input_grad: (res[1], res[0])
    )
    with pytest.raises(functe.RuleError, match="with some leaves replaced by None"):
        swapped(make((3,)).requires_grad_(), make((3,)))


@pytest.mark.parametrize(
    "recipe",
    [
        functe.CurrentScaling(),
        functe.MXFP8BlockScaling(),
        functe.DelayedScaling(),
        functe.Float8BlockScaling(),
        functe.NVFP4BlockScaling(),
    ],
    ids=lambda r: type(r).__name__,
)
def test_a_frozen_fp8_weight_costs_no_wgrad_gemm(recipe):
    state = functe.init_linear_scaling_state(recipe)
    seed = torch.tensor(3) if isinstance(recipe, functe.NVFP4BlockScaling) else None

    def fn(x, w):
        y = ops.fp8_linear(x, w, None, state, recipe=recipe, seed=seed)
        return y[0] if isinstance(y, tuple) else y

    x, w = make((32, 64)), make((16, 64))
    trainable_x, trainable_w = x.clone().requires_grad_(), w.clone().requires_grad_()
    assert backward_gemms(fn, (trainable_x, w), trainable_x) == 1
    assert backward_gemms(fn, (x, trainable_w), trainable_w) == 1
    assert backward_gemms(fn, (trainable_x, trainable_w), (trainable_x, trainable_w)) == 2
    (dx,) = torch.autograd.grad(fn(trainable_x, w).sum(), trainable_x)
    assert torch.equal(dx, torch.autograd.grad(fn(trainable_x, trainable_w).sum(), trainable_x)[0])
