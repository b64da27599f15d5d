"""The custom_vjp contract: pytrees, residuals, static args, errors, transforms, higher order."""

from __future__ import annotations

import pytest
import torch
from torch.func import grad, jacfwd, jacrev, jvp, vmap

import functe
from functe import ops
from functe.testing import assert_close

F64 = torch.float64


def _dict_scale_fwd(params, x):
    return params["w"] * x + params["b"], (params["w"], x)


def _dict_scale_bwd(res, g):
    w, x = res
    return {"w": g * x, "b": g}, g * w


dict_scale = functe.custom_vjp("dict_scale", _dict_scale_fwd, _dict_scale_bwd)


def test_tensor_inside_a_dict_gets_its_gradient():
    # A raw autograd.Function would silently give the dict's tensors zero gradient.
    params = {"w": torch.tensor([2.0, 3.0]), "b": torch.tensor([0.5, 0.5])}
    x = torch.tensor([4.0, 5.0])
    gp, gx = grad(lambda p, x: dict_scale(p, x).sum(), argnums=(0, 1))(params, x)
    assert gp["w"].tolist() == [4.0, 5.0] and gp["b"].tolist() == [1.0, 1.0]
    assert gx.tolist() == [2.0, 3.0]


def test_pytree_dataclass_state_argument_and_cotangent():
    state = functe.init_scaling_state(4)

    def fwd(x, s):
        return x * s.scale, s.scale

    def bwd(scale, g):
        return g * scale, functe.ScalingState(scale=g.sum(), amax_history=None)

    op = functe.custom_vjp("state_scale", fwd, bwd)
    gx, gs = grad(lambda x, s: op(x, s).sum(), argnums=(0, 1))(torch.ones(3), state)
    assert gx.tolist() == [1.0, 1.0, 1.0] and isinstance(gs, functe.ScalingState)
    assert gs.scale.item() == 3.0 and torch.equal(gs.amax_history, torch.zeros(4))


def test_static_arguments_are_keyword_only_and_reach_both_rules():
    seen = []

    def fwd(x, *, power):
        seen.append(("fwd", power))
        return x**power, x

    def bwd(x, g, *, power):
        seen.append(("bwd", power))
        return (power * x ** (power - 1) * g,)

    op = functe.custom_vjp("power", fwd, bwd)
    g = grad(lambda x: op(x, power=3).sum())(torch.tensor([2.0]))
    assert g.item() == 12.0 and seen == [("fwd", 3), ("bwd", 3)]


def test_residuals_that_are_outputs_give_exact_second_derivatives():
    # exp saves its output; d2/dx2 exp(x) = exp(x) flows through the saved output.
    op = functe.custom_vjp("exp", _exp_fwd, lambda y, g: (g * y,))
    x = torch.tensor([0.3, -1.2], dtype=F64)
    g2 = grad(lambda x: grad(lambda x: op(x).sum())(x).sum())(x)
    assert_close(g2, torch.exp(x))


def _exp_fwd(x):
    y = torch.exp(x)
    return y, y


def _mean_fwd(x):
    m = x.mean()
    return x * m, (m, x)  # m is an intermediate: not an input, not an output


def _mean_bwd(res, g):
    m, x = res
    return (g * m + (g * x).sum() / x.numel(),)


xmean = functe.custom_vjp("xmean", _mean_fwd, _mean_bwd)


def test_intermediate_residuals_first_order_exact_second_order_refused():
    x = torch.randn(5, dtype=F64)
    ref = grad(lambda x: torch.sin(x * x.mean()).sum())(x)
    assert_close(grad(lambda x: torch.sin(xmean(x)).sum())(x), ref)
    assert_close(vmap(grad(lambda x: torch.sin(xmean(x)).sum()))(x.expand(2, 5)), ref.expand(2, 5))
    msg = r"functe\.xmean: second-order derivatives are not supported"
    with pytest.raises(functe.TransformError, match=msg):
        grad(lambda x: grad(lambda x: torch.sin(xmean(x)).sum())(x).sum())(x)
    xr = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(torch.sin(xmean(xr)).sum(), xr, create_graph=True)
    with pytest.raises(functe.TransformError, match=msg):
        g.sum().backward()
    assert torch.autograd.gradcheck(xmean, (xr,))


def test_constant_residuals_need_no_guard_and_give_exact_second_derivatives():
    # A residual that is a captured constant (not an input, not an output) was refused in second
    # order as an intermediate although its derivative is zero.
    c = torch.randn(5, dtype=F64)

    def fwd(x):
        return x * x * c, (x, c)

    def bwd(res, g):
        x, c = res
        return (2 * x * c * g,)

    x = torch.randn(5, dtype=F64)
    hessian_ref = torch.diag(2 * c * torch.cos(x * x * c) - (2 * x * c) ** 2 * torch.sin(x * x * c))
    loss = lambda op: lambda x: torch.sin(op(x)).sum()
    guarded = functe.custom_vjp("xxc", fwd, bwd)
    with pytest.raises(functe.TransformError, match=r"functe\.xxc: (second-order|forward-mode)"):
        torch.func.hessian(loss(guarded))(x)
    op = functe.custom_vjp("xxc", fwd, bwd, constant_residuals=(c,))
    assert_close(torch.func.hessian(loss(op))(x), hessian_ref)
    assert_close(grad(lambda x: grad(loss(op))(x).sum())(x), hessian_ref.sum(1))
    assert_close(vmap(torch.func.hessian(loss(op)))(x.expand(2, 5)), hessian_ref.expand(2, 5, 5))
    xr = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(loss(op)(xr), xr, create_graph=True)
    assert_close(torch.autograd.grad(g.sum(), xr)[0], hessian_ref.sum(1))
    with pytest.raises(functe.RuleError, match=r"functe.custom_vjp: op xxc: constant_residuals must be plain tensors"):
        functe.custom_vjp("xxc", fwd, bwd, constant_residuals=(c.clone().requires_grad_(),))


def test_second_order_through_vmap_and_forward_mode_is_refused_too():
    # The guard's vmap rule returned a plain view, so hessian / jacrev(jacrev) (a vmap between the
    # two backward passes) returned wrong values; jvp(grad) raised torch's NotImplementedError.
    x = torch.randn(5, dtype=F64)
    f = lambda x: torch.sin(xmean(x)).sum()
    msg = r"functe\.xmean: (second-order|forward-mode) derivatives"
    for transform in (torch.func.hessian, lambda g: jacrev(jacrev(g)), lambda g: torch.func.jacfwd(jacrev(g))):
        with pytest.raises(functe.TransformError, match=msg):
            transform(f)(x)
    with pytest.raises(functe.TransformError, match=msg):
        jvp(grad(f), (x,), (torch.ones_like(x),))


fused_linear = functe.fuse(lambda x, w: ops.linear(x, w))


@pytest.mark.parametrize("name", ["silu", "rms_norm", "fused linear"])
def test_forward_over_reverse_with_a_plain_sum_loss(name):
    # The cotangent of .sum() is an expanded tensor; jvp made a dual of it and failed ("more than one
    # element of the written-to tensor refers to a single memory location").
    x = torch.randn(3, 4, dtype=F64)
    w = torch.randn(5, 4, dtype=F64)
    functe_fn, torch_fn = {
        "silu": (ops.silu, torch.nn.functional.silu),
        "rms_norm": (
            lambda x: ops.rms_norm(x, torch.ones(4, dtype=F64)),
            lambda x: torch.nn.functional.rms_norm(x, (4,), eps=1e-5),
        ),
        # (w an argument: a captured tensor would be an intermediate residual, refused in second order)
        "fused linear": (lambda x: fused_linear(x, w), lambda x: x @ w.t()),
    }[name]
    t = torch.randn_like(x)
    got = jvp(grad(lambda x: functe_fn(x).sum()), (x,), (t,))[1]
    want = jvp(grad(lambda x: torch_fn(x).sum()), (x,), (t,))[1]
    assert_close(got, want)


@pytest.mark.parametrize(
    "recipe",
    [
        functe.DelayedScaling(),
        functe.CurrentScaling(),
        functe.MXFP8BlockScaling(),
        functe.Float8BlockScaling(),
        functe.NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True),
    ],
    ids=lambda r: type(r).__name__,
)
def test_quantized_linear_refuses_forward_mode_and_second_order(recipe):
    # Forward mode differentiated the casts' rounding: MXFP8's uint8 scales first failed, then every
    # recipe returned a silent tangent (exact zeros for block scaling, only the scale's path for the
    # others) where reverse mode is straight-through.
    x, w = torch.randn(4, 32), torch.randn(8, 32)
    state = functe.init_linear_scaling_state(recipe)
    linear = lambda x: ops.fp8_linear(x, w, None, state, recipe=recipe)
    out = lambda y: y[0] if isinstance(y, tuple) else y
    op = "block_linear" if isinstance(recipe, (functe.Float8BlockScaling, functe.NVFP4BlockScaling)) else "fp8_linear"
    with pytest.raises(functe.TransformError, match=rf"functe\.{op}: functe\.\w+: forward-mode derivatives"):
        jvp(linear, (x,), (torch.ones_like(x),))
    with pytest.raises(functe.TransformError, match="forward-mode derivatives"):
        torch.func.jacfwd(lambda x: out(linear(x)))(x)
    # reverse mode: straight-through, the dgrad GEMM of the quantized operands
    assert torch.func.jacrev(lambda x: out(linear(x)))(x).abs().sum() > 0
    if isinstance(recipe, functe.MXFP8BlockScaling):
        loss = lambda x: out(linear(x)).pow(2).sum()
        with pytest.raises(functe.TransformError, match=r"functe\.mxfp8_cast: a quantizing kernel has no derivative"):
            grad(lambda x: grad(loss)(x).sum())(x)


def test_second_order_refused_when_the_cotangent_is_a_constant():
    # A plain .sum() loss gives a constant cotangent and the intermediate m is not differentiable:
    # nothing in the first backward pass is on the graph but the guard's anchor (without it,
    # grad(grad) returned zeros and create_graph a gradient that did not require grad).
    x = torch.randn(5, dtype=F64)
    msg = r"functe\.xmean: second-order derivatives are not supported"
    with pytest.raises(functe.TransformError, match=msg):
        grad(lambda x: grad(lambda x: xmean(x).sum())(x).sum())(x)
    xr = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(xmean(xr).sum(), xr, create_graph=True)
    assert g.requires_grad
    with pytest.raises(functe.TransformError, match=msg):
        g.sum().backward()
    # first order is untouched, and so is an op whose residuals are only inputs and outputs
    assert_close(grad(lambda x: xmean(x).sum())(x), grad(lambda x: (x * x.mean()).sum())(x))


def test_jvp_and_jacfwd_follow_the_forward_rule():
    x = torch.randn(4, dtype=F64)
    t = torch.randn(4, dtype=F64)
    assert_close(jvp(xmean, (x,), (t,))[1], jvp(lambda x: x * x.mean(), (x,), (t,))[1])
    assert_close(jacfwd(xmean)(x), jacfwd(lambda x: x * x.mean())(x))


@pytest.mark.parametrize("backend", ["torch", "interpret"])
def test_plain_forward_ad_matches_torch_func_jvp_in_a_training_step(backend):
    # torch.autograd.forward_ad (not torch.func) with inputs that require grad, as a training step
    # mixing forward and reverse mode has them: a rule's jvp cannot open its own dual level there.
    x, w, b, e = (torch.randn(*s, dtype=F64) for s in ((5, 8), (6, 8), (6,), (5, 6)))

    def step(x, w, b, e):
        return ops.add_extra_input(ops.gelu(ops.linear(x, w, b)), e * 1.0, in_place=True) * 2.0

    tangents = tuple(torch.randn_like(a) for a in (x, w, b, e))
    expected = jvp(step, (x, w, b, e), tangents)[1]
    for fn in (step, functe.fuse(step)):
        leaves = [a.clone().requires_grad_() for a in (x, w, b, e)]
        with functe.use_backend(backend), torch.autograd.forward_ad.dual_level():
            duals = [torch.autograd.forward_ad.make_dual(a, t) for a, t in zip(leaves, tangents)]
            primal, tangent = torch.autograd.forward_ad.unpack_dual(fn(*duals))
            grads = torch.autograd.grad(primal.sum(), leaves)
            # (no op writes into an argument: the caller's duals keep their tangents)
            for dual, t in zip(duals, tangents):
                assert torch.equal(torch.autograd.forward_ad.unpack_dual(dual).tangent, t)
        assert_close(tangent, expected)
        assert_close(grads[0], grad(lambda x: step(x, w, b, e).sum())(x))


def test_symbolic_zeros_pass_none_for_unused_outputs():
    seen = []

    def fwd(x):
        return (x * 2, x * 3), None

    def bwd(_, cts):
        seen.append(tuple(c is None for c in cts))
        a, b = cts
        return ((0 if a is None else 2 * a) + (0 if b is None else 3 * b),)

    op = functe.custom_vjp("two_outputs", fwd, bwd, symbolic_zeros=True)
    g = grad(lambda x: op(x)[1].sum())(torch.ones(2))
    assert g.tolist() == [3.0, 3.0] and seen == [(True, False)]
    dense = functe.custom_vjp("two_outputs_dense", fwd, lambda _, cts: (2 * cts[0] + 3 * cts[1],))
    assert grad(lambda x: dense(x)[0].sum())(torch.ones(2)).tolist() == [2.0, 2.0]


def test_no_batching_rule_raises_naming_the_op():
    op = functe.custom_vjp("unbatchable", lambda x: (x * 2, None), lambda _, g: (g * 2,), batching=None)
    with pytest.raises(functe.TransformError, match=r"functe\.unbatchable has no batching rule"):
        vmap(op)(torch.ones(3, 2))
    # inside fuse too (the plan ran its forward rule under vmap, bypassing the refusal), also under
    # grad and with other ops around it; unbatched, the fused program runs
    fused = functe.fuse(lambda x, y: op(x + y) * 2.0)
    x = torch.ones(3, 2)
    never = r"functe\.fuse\(<lambda>\): its op unbatchable has no batching rule"
    with pytest.raises(functe.TransformError, match=never):
        vmap(fused, in_dims=(0, None))(x, torch.ones(2))
    with pytest.raises(functe.TransformError, match=never):
        vmap(grad(lambda x: fused(x, x).sum()))(x)
    assert fused(x, x).tolist() == [[8.0, 8.0]] * 3


def test_forward_rule_contract_errors():
    bad = functe.custom_vjp("bad_fwd", lambda x: x * 2, lambda _, g: (g,))
    with pytest.raises(
        TypeError, match=r"functe\.bad_fwd: the forward rule must return \(out, residuals\), got f32\[2\]"
    ):
        bad(torch.ones(2))
    bad_out = functe.custom_vjp("bad_out", lambda x: ((x, 3), None), lambda _, g: (g[0],))
    with pytest.raises(TypeError, match=r"functe\.bad_out: forward outputs must be tensors or None, got int"):
        bad_out(torch.ones(2))


def test_backward_rule_contract_errors():
    count = functe.custom_vjp("bad_count", lambda x, y: (x + y, None), lambda _, g: (g,))
    with pytest.raises(TypeError, match=r"functe\.bad_count: the backward rule must return a tuple of 2 cotangents"):
        grad(lambda x: count(x, x).sum())(torch.ones(2))
    shape = functe.custom_vjp("bad_shape", lambda x: (x.sum(), None), lambda _, g: (g,))
    with pytest.raises(
        TypeError, match=r"functe\.bad_shape: the backward rule returned f32\[\] for argument 'x', expected f32\[3\]"
    ):
        grad(lambda x: shape(x))(torch.ones(3))
    dtype = functe.custom_vjp("bad_dtype", lambda x: (x * 1, None), lambda _, g: (g.double(),))
    with pytest.raises(TypeError, match=r"returned f64\[3\] for argument 'x', expected f32\[3\]"):
        grad(lambda x: dtype(x).sum())(torch.ones(3))
    # (an input inside a pytree argument is named by its key path, not by its flat leaf number)
    nested = functe.custom_vjp("bad_nested", _dict_scale_fwd, lambda res, g: ({"w": g, "b": g.double()}, g))
    with pytest.raises(TypeError, match=r"returned f64\[2\] for argument 'params'\['b'\], expected f32\[2\]"):
        grad(lambda p: nested(p, torch.ones(2)).sum())({"w": torch.ones(2), "b": torch.ones(2)})
    structure = functe.custom_vjp("bad_tree", _dict_scale_fwd, lambda res, g: ({"w": g}, g))
    with pytest.raises(TypeError, match=r"functe\.bad_tree: cotangent 0 from the backward rule has structure"):
        grad(lambda p: structure(p, torch.ones(2)).sum())({"w": torch.ones(2), "b": torch.ones(2)})


def test_output_aliasing_an_input_stays_functional():
    op = functe.custom_vjp("passthrough", lambda x: (x, None), lambda _, g: (g,))
    x = torch.ones(3, requires_grad=True)
    y = op(x)
    assert y is not x and y.data_ptr() == x.data_ptr()
    (g,) = torch.autograd.grad((y * 2).sum(), x)
    assert g.tolist() == [2.0, 2.0, 2.0]


def _counting_identity_op():
    calls = {"fwd": 0}

    def fwd(x, y):
        calls["fwd"] += 1
        return (x, x * y), (y,)

    def bwd(res, cts):
        (y,) = res
        dx, dxy = cts
        return dx + dxy * y, None

    return functe.custom_vjp("pair", fwd, bwd), calls


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "no_requires_grad"])
def test_forward_only_path_returns_the_same_values_and_fresh_outputs(mode):
    # With nothing recording, the op skips its autograd.Function; results and aliasing must not change.
    op, calls = _counting_identity_op()
    x, y = torch.tensor([1.0, -2.0]), torch.tensor([3.0, 4.0])
    ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(mode)
    if ctx is None:
        out = op(x, y)
    else:
        with ctx():
            out = op(x, y)
    assert calls["fwd"] == 1
    assert out[0] is not x and torch.equal(out[0], x)  # an input returned as an output is a view
    assert torch.equal(out[1], x * y)


def test_jvp_under_no_grad_still_uses_the_function():
    # torch.no_grad() does not turn off forward-mode AD: the op must still propagate tangents.
    op, _ = _counting_identity_op()
    x, y, t = torch.tensor([1.0, -2.0]), torch.tensor([3.0, 4.0]), torch.tensor([1.0, 1.0])
    with torch.no_grad():
        _, tangent = jvp(lambda x: op(x, y)[1], (x,), (t,))
    assert torch.equal(tangent, y)


def test_argument_needs_groups_leaf_flags_by_argument():
    from functe._tree import tree_flatten
    from functe._vjp_checks import argument_needs

    spec = lambda args: tree_flatten(args)[1]
    assert argument_needs((True, False, False), spec((1, 2, None))) == (True, False, False)
    # (an argument without leaves next to one with two: as many leaves as arguments, not one each)
    assert argument_needs((False, True), spec(((), (1, 2)))) == (False, True)
    assert argument_needs((False, True, False), spec(((1, 2), 3))) == (True, False)
    assert argument_needs((False, True, False), spec(((1, 2), 3))) == (True, False)  # cached


def _scale_by(w):
    """An op whose rules close over ``w`` (a factory, as users write them)."""
    return functe.custom_vjp("scale_by_w", lambda x: (x * w, None), lambda _, g: (g * w,))


def test_a_rule_closing_over_a_differentiated_tensor_is_refused():
    # The op differentiates its positional arguments only: jvp over the captured w gave a zero
    # tangent and grad a zero gradient, silently (JAX's custom_vjp refuses a closed-over value it
    # differentiates).
    x, w = torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    refused = r"scale_by_w: a rule uses f64\[4\] from its closure, and that tensor is differentiated"
    with pytest.raises(functe.ArgumentError, match=refused):
        jvp(lambda w: _scale_by(w)(x), (w,), (torch.ones(4, dtype=torch.float64),))
    with pytest.raises(functe.ArgumentError, match=refused):
        grad(lambda w: _scale_by(w)(x).sum())(w)
    with pytest.raises(functe.ArgumentError, match=refused):
        _scale_by(w.clone().requires_grad_())(x.clone().requires_grad_())
    with pytest.raises(functe.ArgumentError, match=refused):  # (inside a container too)
        params = {"w": w.clone().requires_grad_()}
        functe.custom_vjp("scale_by_w", lambda x: (x * params["w"], None), lambda _, g: (g,))(x.requires_grad_())
    # a captured constant is fine, with or without a transform on the arguments
    x = x.detach()
    assert torch.equal(grad(lambda x: _scale_by(w)(x).sum())(x), w)
    assert torch.equal(vmap(_scale_by(w))(x[:, None].expand(4, 4)), x[:, None] * w)
