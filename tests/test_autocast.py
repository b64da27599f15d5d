"""torch.autocast, as TransformerEngine treats it: ops compute in autocast's dtype, gradients come back
in the parameters' dtype, and fused plans see the same dtypes (functe/_autocast.py)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from helpers import make

import functe
from functe import CurrentScaling, DelayedScaling, ops

BF16, F16 = torch.bfloat16, torch.float16


def _autocast(dtype=BF16):
    return torch.autocast("cpu", dtype=dtype)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 8, generator=g).requires_grad_()
    params = {
        "w1": torch.randn(16, 8, generator=g).requires_grad_(),
        "b1": torch.randn(16, generator=g).requires_grad_(),
        "gamma": (1 + 0.1 * torch.randn(16, generator=g)).requires_grad_(),
        "beta": (0.1 * torch.randn(16, generator=g)).requires_grad_(),
        "w2": torch.randn(8, 16, generator=g).requires_grad_(),
    }
    return x, params


def _block(x, p):
    h = ops.linear(x, p["w1"], p["b1"])
    h = ops.gelu(ops.layer_norm(h, p["gamma"], p["beta"]))
    return ops.linear(h, p["w2"])


def test_linear_under_autocast_is_torchs_and_its_gradients_are_in_the_parameters_dtype():
    # The rules met a bf16 dy beside the fp32 weight: "expected m1 and m2 to have the same dtype"
    # (torch.func.grad), or a RuleError blaming the rule (backward inside the region)
    x, p = _inputs()
    w, b = p["w1"], p["b1"]
    with _autocast():
        y, expected = ops.linear(x, w, b), F.linear(x, w, b)
        assert y.dtype == BF16 and torch.equal(y, expected)
        grads = torch.autograd.grad(y.float().square().sum(), (x, w, b))  # (backward inside the region)
    want = torch.autograd.grad(expected.float().square().sum(), (x, w, b))
    for g, e in zip(grads, want):
        assert g.dtype == torch.float32 and torch.equal(g, e)
    with _autocast():
        fgrad = torch.func.grad(lambda w: ops.linear(x.detach(), w, b.detach()).float().sum())(w.detach())
        tgrad = torch.func.grad(lambda w: F.linear(x.detach(), w, b.detach()).float().sum())(w.detach())
    assert fgrad.dtype == torch.float32 and torch.equal(fgrad, tgrad)


def test_an_autocast_block_runs_and_fuses_to_the_same_values():
    # linear (bf16 out) -> layer_norm with fp32 parameters raised DTypeError; fused, the trace
    # recorded fp32 for what ran in bf16 (explain, rule conditions and dtype checks saw f32)
    x, p = _inputs()
    with _autocast():
        unfused = _block(x, p)
        fused = functe.fuse(_block)(x, p)
        oplist = functe.trace(_block)(x, p)
    assert unfused.dtype == fused.dtype == BF16
    assert torch.equal(fused, unfused)
    printed = str(oplist)
    assert "cast[dtype=bf16] a" in printed and "bf16[4,16] = linear" in printed, printed
    leaves = (x, *p.values())
    g_unfused = torch.autograd.grad(unfused.float().sum(), leaves)
    g_fused = torch.autograd.grad(fused.float().sum(), leaves)
    for a, b, leaf in zip(g_fused, g_unfused, leaves):
        assert a.dtype == leaf.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)  # (bf16 rounding of fused vs unfused epilogues)


def test_autocast_entered_inside_a_fused_function_is_recorded():
    # The trace recorded the ops and dropped the context: the fused result was fp32
    x, p = _inputs()

    def fn(x, w):
        with _autocast():
            return ops.linear(x, w)

    unfused, fused = fn(x, p["w1"]), functe.fuse(fn)(x, p["w1"])
    assert fused.dtype == unfused.dtype == BF16 and torch.equal(fused, unfused)


@pytest.mark.parametrize("recipe", [CurrentScaling(), DelayedScaling(amax_history_len=4)], ids=["current", "delayed"])
def test_fp8_linear_under_fp16_autocast_is_finite_and_computes_in_fp16(recipe):
    # The FP8 GEMM's emulation multiplied FP8 values held in fp32 (up to 448*448*K) under fp16
    # autocast: inf in 12 of 32 outputs (NVFP4: 62 of 64; a fused norm + fp8_linear: all)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 32, generator=g), torch.randn(8, 32, generator=g)
    state = functe.init_linear_scaling_state(recipe) if isinstance(recipe, DelayedScaling) else None
    if state is not None:  # (a scale of 448/amax, as after a step: step 0's scale 1 hid the overflow)
        step = functe.value_and_grad(lambda p, s, x: ops.fp8_linear(x, p, None, s, recipe=recipe).sum())
        state = step(w, state, x)[2]
        assert state.input.scale.item() != 1.0
    with _autocast(F16):
        y = ops.fp8_linear(x, w, None, state, recipe=recipe)
    expected = ops.fp8_linear(x.half(), w.half(), None, state, recipe=recipe)
    assert y.dtype == F16 and torch.isfinite(y).all()
    assert torch.equal(y, expected)


def test_to_a_float_dtype_is_recorded_as_a_cast():
    x, p = _inputs()
    fn = lambda x, w: ops.linear(x.to(BF16), w.to(BF16)).to(torch.float32)
    printed = str(functe.trace(fn)(x, p["w2"].T.contiguous()))
    assert "c:bf16[4,8] = cast[dtype=bf16] a" in printed and "f32[4,16] = cast[dtype=f32]" in printed, printed
    w = p["w1"]
    fused, unfused = functe.fuse(fn)(x, w), fn(x, w)
    assert fused.dtype == torch.float32 and torch.equal(fused, unfused)
    for a, b in zip(torch.autograd.grad(fused.sum(), (x, w)), torch.autograd.grad(unfused.sum(), (x, w))):
        assert a.dtype == torch.float32 and torch.equal(a, b)


def test_mixed_dtype_addition_under_autocast_is_refused_not_recast():
    # torch's + promotes (autocast does not cast it): the trace's add must not cast to bf16 either
    x, p = _inputs()
    with _autocast(), pytest.raises(functe.TraceError, match=r"add_extra_input: argument 'extra' .* got f32\[4,16\]"):
        functe.fuse(lambda x, w: ops.linear(x, w) + torch.zeros(4, 16))(x, p["w1"])


def test_an_opaque_backward_runs_under_its_forwards_autocast():
    # The backward recomputed the function outside the region (fp32): dx differed from torch's
    x, p = _inputs()
    fn = lambda x, w: torch.tanh(x @ w.T)
    with _autocast():
        y, expected = functe.opaque(fn)(x, p["w1"]), fn(x, p["w1"])
    assert y.dtype == BF16 and torch.equal(y, expected)
    got = torch.autograd.grad(y.float().sum(), x)[0]
    assert torch.equal(got, torch.autograd.grad(expected.float().sum(), x)[0])


def test_compiled_functions_under_autocast_match_eager():
    # (a generator-based autocast-off context inside the rules made the compiled ops fail in backward)
    x, p = _inputs()
    leaves = (x, *p.values())
    for fn in (_block, functe.fuse(_block)):
        torch._dynamo.reset()
        with _autocast():
            eager, compiled = fn(x, p), torch.compile(fn, backend="aot_eager")(x, p)
        assert compiled.dtype == BF16 and torch.equal(compiled, eager)
        for a, b in zip(
            torch.autograd.grad(compiled.float().sum(), leaves), torch.autograd.grad(eager.float().sum(), leaves)
        ):
            assert a.dtype == torch.float32 and torch.equal(a, b)


def test_dtype_shorthands_are_recorded_as_casts():
    x, p = _inputs()
    w = p["w1"]
    fn = lambda x, w: ops.linear(x.bfloat16(), w.type_as(x.half()).bfloat16()).float().double()
    printed = str(functe.trace(fn)(x, w))
    for dtype in ("bf16", "f16", "f32", "f64"):
        assert f"cast[dtype={dtype}]" in printed, printed
    fused, unfused = functe.fuse(fn)(x, w), fn(x, w)
    assert fused.dtype == torch.float64 and torch.equal(fused, unfused)


def test_an_opaque_op_in_a_fused_plan_computes_the_dtype_the_trace_recorded():
    # The plan ran the opaque function under the caller's autocast (bf16) while the trace recorded
    # f32, and the next op took bf16 + f32 without complaint (a bf16 result, 0.031 off)
    x, p = _inputs()
    y = torch.randn(4, 16)
    fn = lambda x, w, y: functe.opaque(lambda x, w: x @ w.T)(x, w) + y
    with _autocast():
        printed = str(functe.trace(fn)(x, p["w1"], y))
        fused = functe.fuse(fn)(x, p["w1"], y)
    assert "f32[4,16] = opaque_<lambda>" in printed, printed
    assert fused.dtype == torch.float32 and torch.equal(fused, x @ p["w1"].T + y)


def test_the_cast_op_under_every_torch_func_transform():
    from helpers import check_transforms

    from functe.ops._cast import cast

    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(1))
    check_transforms(
        lambda x: cast(cast(x, dtype=torch.float32), dtype=torch.float64), lambda x: x.float().double(), [x]
    )


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: ops.linear(torch.ones(4, 8), torch.ones(3, 7)), "argument 'weight' expected f32[?,8], got f32[3,7]"),
        (lambda: ops.linear(torch.ones(4, 8), torch.ones(3, 8), torch.ones(4)), "'bias' expected f32[3], got f32[4]"),
        (lambda: ops.bias(torch.ones(4, 8), torch.ones(7)), "argument 'b' expected f32[8], got f32[7]"),
        (lambda: ops.add_extra_input(torch.ones(4, 8), torch.ones(4, 7)), "'extra' expected f32[4,8], got f32[4,7]"),
        (lambda: ops.layer_norm(torch.ones(4, 8), torch.ones(7), torch.ones(8)), "expected f32[8], got f32[7]"),
        (lambda: ops.rms_norm(torch.ones(4, 8), torch.ones(7)), "'weight' expected f32[8], got f32[7]"),
        (lambda: ops.swiglu(torch.ones(4, 7)), "argument 'x' expected f32[...,2H], got f32[4,7]"),
        (lambda: ops.l2_normalize(torch.ones(4, 0)), "got f32[4,0]"),
        (
            lambda: ops.fp8_linear(torch.ones(4, 16), torch.ones(3, 8), None, None, recipe=CurrentScaling()),
            "argument 'weight' expected f32[?,16], got f32[3,8]",
        ),
        (
            lambda: ops.linear(torch.ones(4, 8), torch.ones(3, 8, dtype=torch.float64)),
            "argument 'weight' expected dtype f32 to match 'x' f32[4,8], got f64[3,8]",
        ),
    ],
)
def test_errors_under_autocast_name_the_dtypes_the_caller_passed(call, message):
    # (the checks ran on the arguments cast to bf16, and said "got bf16[3,7]" of an f32 weight)
    with _autocast(), pytest.raises(functe.FuncteError, match=re.escape(message)):
        call()


def test_mixed_parameter_dtypes_that_autocast_unifies_are_accepted():
    x, w, b = torch.ones(4, 8, dtype=BF16), torch.ones(3, 8), torch.ones(3, dtype=F16)
    with _autocast():
        assert ops.linear(x, w, b).dtype == BF16
        assert ops.layer_norm(torch.ones(2, 3), torch.ones(3, dtype=BF16), torch.zeros(3, dtype=F16)).dtype == BF16
        assert ops.scaled_swiglu(torch.ones(2, 4), torch.ones(2, dtype=BF16)).dtype == BF16
    with pytest.raises(functe.DTypeError, match="'weight' expected dtype bf16 to match 'x' bf16"):
        ops.linear(x, w, b)  # without autocast nothing is promoted


def test_row_scales_in_the_callers_dtype_go_with_x_under_autocast():
    # (an f16 x with f16 scales, valid without autocast, was refused under bf16 autocast, and the
    # message gave x autocast's dtype: "expected dtype of 'x' bf16[2,8] or f32, got f16[2]")
    x, s = make((2, 8), dtype=F16).requires_grad_(), torch.rand(2, dtype=F16).requires_grad_()
    with _autocast():
        y = ops.scaled_swiglu(x, s)
    expected = ops.scaled_swiglu(x.detach().to(BF16), s.detach().to(BF16))
    assert y.dtype == BF16 and torch.equal(y, expected)
    dx, ds = torch.autograd.grad(y.sum(), (x, s))
    assert dx.dtype == F16 and ds.dtype == F16
    with (
        _autocast(),
        pytest.raises(functe.DTypeError, match=re.escape("'x' f16[2,8] or f32, got f64[2] (x computes in bf16")),
    ):
        ops.scaled_swiglu(x, s.double())


def test_fused_under_autocast_with_captured_weights_keeps_second_order_and_no_grad_constants():
    # (a regression hunt: recording autocast's casts of captured weights as equations, tried in stop
    # 24, made the cast results intermediate residuals, refusing double backward and hessian, and
    # refused a constant computed under no_grad inside the function)
    w, c = make((8, 4)) * 0.3, make((3, 4))

    def f(x):
        with torch.no_grad():
            k = ops.linear(c, w)  # (captured tensors only: a constant)
        return ops.add_extra_input(ops.linear(x, w), k)

    fused = functe.fuse(f)
    x = make((3, 4)).to(torch.bfloat16).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for fn in (f, fused):
            (g,) = torch.autograd.grad(fn(x).float().pow(2).sum(), x, create_graph=True)
            (gg,) = torch.autograd.grad(g.float().sum(), x)
            if fn is f:
                expected = gg
        assert torch.equal(gg, expected)
        v = make((4,)).to(torch.bfloat16)
        hessians = [
            torch.func.hessian(lambda v, fn=fn: fn(v.expand(3, 4)).float().pow(2).sum())(v) for fn in (f, fused)
        ]
        assert torch.equal(hessians[0], hessians[1])
