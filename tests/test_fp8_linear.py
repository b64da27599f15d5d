"""The quantized linear: numerics vs F.linear on dequantized operands, state flow, transforms."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import make

import functe
from functe import DelayedScaling, Format, ops
from functe._fp8_gemm import _scaled_mm, gemm_nt
from functe.testing import assert_close

F64 = torch.float64
RECIPES = {
    "delayed": DelayedScaling(amax_history_len=4, margin=1),
    "current": functe.CurrentScaling(),
    "mxfp8": functe.MXFP8BlockScaling(),
    "mxfp8_hybrid": functe.MXFP8BlockScaling(fp8_format=Format.HYBRID),  # E5M2 gradients (TE #3342)
}
# (x shape, out_features, bias)
CASES = [((37, 32), 16, True), ((2, 3, 48), 24, True), ((0, 32), 8, True), ((5, 64), 40, False)]


def _dq(t, recipe, role, state=None):
    q, _ = functe.quantize(t, recipe, state=state, role=role)
    return functe.dequantize(q, F64)


def _reference(x, w, b, dy, recipe, state):
    """(value, magnitude) of y, dx, dW from the dequantized operands the op must use, in float64.

    The magnitude ``|A| @ |B|`` bounds the rounding error of a GEMM with fp32 accumulation.
    """
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    if isinstance(recipe, functe.MXFP8BlockScaling):
        pairs = [
            (_dq(x2, recipe, "input"), _dq(w, recipe, "weight").T),
            (_dq(dy2, recipe, "grad_output"), _dq(w.t(), recipe, "weight").T),  # blocks along N
            (_dq(dy2.t(), recipe, "grad_output"), _dq(x2.t(), recipe, "input").T),  # blocks along M
        ]
    else:
        s = state if state is not None else functe.LinearScalingState(None, None, None)
        xq, wq = _dq(x2, recipe, "input", s.input), _dq(w, recipe, "weight", s.weight)
        dyq = _dq(dy2, recipe, "grad_output", s.grad_output)
        pairs = [(xq, wq.T), (dyq, wq), (dyq.T, xq)]
    (y, y_mag), (dx, dx_mag), (dw, dw_mag) = [(p @ q, p.abs() @ q.abs()) for p, q in pairs]
    if b is not None:
        y, y_mag = y + b.double(), y_mag + b.double().abs()
    shape_y = (*x.shape[:-1], w.shape[0])
    return (y.reshape(shape_y), y_mag.reshape(shape_y)), (dx.reshape(x.shape), dx_mag.reshape(x.shape)), (dw, dw_mag)


def _assert_gemm_close(actual, expected, magnitude, k, what):
    """TE's E4M3 tolerance, and the rounding bound of an FP8 GEMM with fp32 accumulation:
    fp32 outputs: k * 2**-24 of the magnitude; bf16 outputs: two roundings of 2**-9 (the emulation
    rounds the bf16 GEMM's result once more before the scale and bias)."""
    assert actual.shape == expected.shape, what
    assert_close(actual, expected, dtype=torch.float8_e4m3fn, msg=what)
    unit = 2.0**-8 if actual.dtype == torch.bfloat16 else (k + 2) * 2.0**-24
    err = (actual.double() - expected).abs()
    bound = unit * (magnitude + expected.abs()) + 1e-30
    assert (err <= bound).all(), f"{what}: error {(err / bound).max().item():.2f}x the bound"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}x{c[1]}" for c in CASES])
@pytest.mark.parametrize("name", list(RECIPES))
def test_values_grads_and_next_state_vs_dequantized_reference(name, case, dtype, backend):
    recipe = RECIPES[name]
    shape, n_out, has_bias = case
    x, w = make(shape, dtype, scale=3.0), make((n_out, shape[-1]), dtype, scale=0.2)
    b = make((n_out,), dtype) if has_bias else None
    dy = make((*shape[:-1], n_out), dtype, scale=0.01)
    state = functe.init_linear_scaling_state(recipe)
    if state is not None:  # a state that has seen a few steps: scales are not 1
        state = functe.LinearScalingState(
            input=functe.ScalingState(torch.tensor(37.0), state.input.amax_history),
            weight=functe.ScalingState(torch.tensor(900.0), state.weight.amax_history),
            grad_output=functe.ScalingState(torch.tensor(2.0**20), state.grad_output.amax_history),
        )
    primals = [x, w, *([b] if has_bias else []), *([state] if state is not None else [])]

    def fn(x, w, *rest):
        rest = list(rest)
        bias = rest.pop(0) if has_bias else None
        return ops.fp8_linear(x, w, bias, rest[0] if rest else None, recipe=recipe)

    y, pull = torch.func.vjp(fn, *primals)
    dx, dw, *rest = pull(dy)
    db = rest.pop(0) if has_bias else None
    dstate = rest[0] if rest else None
    (ref_y, mag_y), (ref_dx, mag_dx), (ref_dw, mag_dw) = _reference(x, w, b, dy, recipe, state)
    assert y.dtype == dx.dtype == dw.dtype == dtype
    _assert_gemm_close(y, ref_y, mag_y, shape[-1], "y")
    _assert_gemm_close(dx, ref_dx, mag_dx, n_out, "dx")
    _assert_gemm_close(dw, ref_dw, mag_dw, x.numel() // shape[-1], "dW")
    if has_bias:
        assert db.dtype == dtype
        assert_close(db, dy.double().reshape(-1, n_out).sum(0), msg="db")
    if state is None:
        assert dstate is None
        return
    nxt = functe.state_from_gradient(state, dstate)
    amax = lambda t: t.abs().max().float() if t.numel() else torch.tensor(0.0)
    for role, t in (("input", x), ("weight", w), ("grad_output", dy)):
        expected = functe.delayed_scaling_update(getattr(state, role), amax(t), recipe=recipe, role=role)
        got = getattr(nxt, role)
        assert got.scale.dtype == torch.float32 and got.amax_history.dtype == torch.float32
        assert torch.equal(got.scale, expected.scale) and torch.equal(got.amax_history, expected.amax_history), role


def test_te_scale_update_oracle(backend):
    """TE's test_fp8_scale_update: HYBRID, margin 2, history 8; after step k each scale is
    (fp8_max / max of the amaxes seen in the window) / 4. Twelve steps: the window slides."""
    recipe = DelayedScaling(margin=2, fp8_format=Format.HYBRID, amax_history_len=8)
    state = functe.init_linear_scaling_state(recipe)
    loss_fn = lambda w, s, x, dy: (ops.fp8_linear(x, w, None, s, recipe=recipe) * dy).sum()
    step = functe.value_and_grad(loss_fn)
    seen = {"input": [], "weight": [], "grad_output": []}
    g = torch.Generator().manual_seed(3)
    for k in range(12):
        x_max, w_max, dy_max = 2.0 + k % 5, 0.5 / (k + 1), 10.0 * (12 - k)  # dy's amax decreases
        x = torch.rand(16, 32, generator=g) * x_max
        x[0, 0] = x_max
        w = torch.full((16, 32), -w_max)
        dy = torch.full((16, 16), dy_max)
        _, _, state = step(w, state, x, dy)
        for role, amax in (("input", x_max), ("weight", w_max), ("grad_output", dy_max)):
            seen[role].append(np.float32(amax))
            fp8_max = np.float32(57344.0 if role == "grad_output" else 448.0)
            expected = (fp8_max / max(seen[role][-8:])) / np.float32(4.0)
            assert getattr(state, role).scale.item() == expected, (k, role)
            assert getattr(state, role).amax_history[-1].item() == np.float32(amax)


def _mlp(recipe):
    def loss_fn(params, state, x):
        h = ops.fp8_linear(x, params["w1"], params["b1"], state["fc1"], recipe=recipe)
        y = ops.fp8_linear(torch.tanh(h), params["w2"], None, state["fc2"], recipe=recipe)
        return (y**2).mean()

    return loss_fn


def _mlp_params(g, members=None):
    shape = lambda *s: s if members is None else (members, *s)
    return {
        "w1": torch.randn(shape(32, 16), generator=g) * 0.3,
        "b1": torch.randn(shape(32), generator=g) * 0.1,
        "w2": torch.randn(shape(16, 32), generator=g) * 0.3,
    }


def test_vmap_of_value_and_grad_keeps_one_state_per_member(backend):
    recipe = DelayedScaling(amax_history_len=4)
    g = torch.Generator().manual_seed(0)
    members = 3
    params = _mlp_params(g, members)
    one = functe.init_linear_scaling_state(recipe)
    scales = torch.tensor([1.0, 16.0, 0.25])
    per_member = [
        {"fc1": functe.tree_map(lambda t, i=i: t * scales[i] if t.dim() == 0 else t, one), "fc2": one}
        for i in range(members)
    ]
    states = functe.tree_map(lambda *ts: torch.stack(ts), *per_member)
    x = torch.randn(members, 8, 16, generator=g) * torch.tensor([1.0, 5.0, 0.1])[:, None, None]
    step = functe.value_and_grad(_mlp(recipe))
    losses, grads, next_states = torch.func.vmap(step)(params, states, x)
    for i in range(members):
        p_i = functe.tree_map(lambda t, i=i: t[i], params)
        loss, grad, nxt = step(p_i, per_member[i], x[i])
        assert_close(losses[i], loss)
        for k in grad:
            assert_close(grads[k][i], grad[k], msg=k)
        for a, b in zip(functe.tree_leaves(next_states), functe.tree_leaves(nxt)):
            assert_close(a[i], b)  # batched GEMMs may sum in another order: dy's amax to fp32 precision
    # The members really differ: each recorded its own amax.
    assert len({next_states["fc1"].input.amax_history[i, -1].item() for i in range(members)}) == members


@pytest.mark.parametrize("name", ["current", "mxfp8_hybrid"])
def test_vmap_grad_of_stateless_recipes_equals_per_member_grad(name, backend):
    recipe = RECIPES[name]
    w, x = make((3, 16, 32), scale=0.3), make((3, 5, 32)) * torch.tensor([1.0, 8.0, 0.1])[:, None, None]
    f = lambda w, x: ops.fp8_linear(x, w, None, None, recipe=recipe).square().sum()
    batched = torch.func.vmap(torch.func.grad(f, argnums=(0, 1)))(w, x)
    for i in range(3):
        for got, expected in zip(batched, torch.func.grad(f, argnums=(0, 1))(w[i], x[i])):
            assert_close(got[i], expected)


def test_torch_func_grad_of_state_is_its_next_value_and_unreached_states_are_kept():
    recipe = DelayedScaling(amax_history_len=4)
    g = torch.Generator().manual_seed(1)
    params = _mlp_params(g)
    state = {"fc1": functe.init_linear_scaling_state(recipe), "fc2": functe.init_linear_scaling_state(recipe)}
    x = torch.randn(8, 16, generator=g)

    def only_first_layer(params, state, x):
        h = ops.fp8_linear(x, params["w1"], params["b1"], state["fc1"], recipe=recipe)
        ops.fp8_linear(torch.tanh(h), params["w2"], None, state["fc2"], recipe=recipe)  # runs, unused
        return h.sum()

    grads = torch.func.grad(only_first_layer, argnums=1)(params, state, x)
    assert grads["fc1"].input.amax_history[0].item() == 1.0  # one use
    assert not any(t.any() for t in functe.tree_leaves(grads["fc2"]))  # never reached: zeros
    _, _, nxt = functe.value_and_grad(only_first_layer)(params, state, x)
    for a, b in zip(functe.tree_leaves(nxt["fc2"]), functe.tree_leaves(state["fc2"])):
        assert torch.equal(a, b)  # kept, not rolled
    assert nxt["fc1"].input.amax_history[-1].item() == x.abs().max().item()


def test_stride0_cotangent_and_3d_input(backend):
    recipe = functe.CurrentScaling()
    x, w = make((4, 3, 32)), make((8, 32))
    gx = torch.func.grad(lambda x: ops.fp8_linear(x, w, None, None, recipe=recipe).sum())(x)  # dy is stride-0
    _, pull = torch.func.vjp(lambda x: ops.fp8_linear(x, w, None, None, recipe=recipe), x)
    (expected,) = pull(torch.ones(4, 3, 8))
    assert torch.equal(gx, expected)


def test_second_order_raises():
    recipe = DelayedScaling(amax_history_len=2)
    state = functe.init_linear_scaling_state(recipe)
    w = make((8, 16))
    g = lambda x: torch.func.grad(lambda x: ops.fp8_linear(x, w, None, state, recipe=recipe).square().sum())(x)
    quantized = r"functe\.fp8_linear: second-order derivatives are not supported: it quantizes its operands"
    with pytest.raises(functe.TransformError, match=quantized):
        torch.func.grad(lambda x: g(x).sum())(make((4, 16)))


def test_quantize_is_not_differentiable_in_its_state_either():
    # quantize detached x but not the state: torch.func.grad over the state reached the cast kernel's
    # "second order through a quantized linear" refusal on a first-order call, and plain autograd
    # returned a scale_inv that required grad
    recipe = DelayedScaling(amax_history_len=2)
    x, state = make((4, 8)), functe.init_scaling_state(2)
    g = torch.func.grad(lambda s: functe.dequantize(functe.quantize(x, recipe, state=s)[0]).sum())(state)
    assert torch.equal(g.scale, torch.zeros(())) and torch.equal(g.amax_history, torch.zeros(2))
    tracked = functe.tree_map(lambda t: t.clone().requires_grad_(), state)
    q, new = functe.quantize(x, recipe, state=tracked)
    assert not q.scale_inv.requires_grad and not new.scale.requires_grad


@pytest.mark.parametrize("recipe", [DelayedScaling(amax_history_len=2), functe.CurrentScaling()], ids=str)
def test_second_order_raises_with_a_plain_sum_loss(recipe):
    # d/dw of the x-gradient: with .sum() the cotangent is a constant and the quantized w an
    # intermediate; this returned zeros before the guard hung on its anchor.
    state = functe.init_linear_scaling_state(recipe)
    x = make((4, 16))
    dx = lambda w: torch.func.grad(lambda x: ops.fp8_linear(x, w, None, state, recipe=recipe).sum())(x)
    with pytest.raises(functe.TransformError, match=r"functe\.fp8_linear: second-order derivatives"):
        torch.func.grad(lambda w: dx(w).sum())(make((8, 16)))


def test_compiled_loss_with_autograd_outside_matches_eager():
    torch._dynamo.reset()
    recipe = DelayedScaling(amax_history_len=4)
    g = torch.Generator().manual_seed(2)
    params = _mlp_params(g)
    state = {"fc1": functe.init_linear_scaling_state(recipe), "fc2": functe.init_linear_scaling_state(recipe)}
    x = torch.randn(8, 16, generator=g)
    loss_fn = _mlp(recipe)
    eager_loss, eager_grads, eager_state = functe.value_and_grad(loss_fn)(params, state, x)
    compiled = torch.compile(loss_fn, backend="aot_eager", fullgraph=True)
    p = functe.tree_map(lambda t: t.clone().requires_grad_(), params)
    s = functe.tree_map(lambda t: t.clone().requires_grad_(), state)
    loss = compiled(p, s, x)
    leaves = functe.tree_leaves(p) + functe.tree_leaves(s)
    grads = torch.autograd.grad(loss, leaves)
    n = len(functe.tree_leaves(p))
    s_grads = functe.tree_unflatten(functe.tree_structure(s), list(grads[n:]))
    nxt = functe.state_from_gradient(state, s_grads)
    assert_close(loss, eager_loss)
    for a, b in zip(grads[:n], functe.tree_leaves(eager_grads)):
        assert_close(a, b)
    for a, b in zip(functe.tree_leaves(nxt), functe.tree_leaves(eager_state)):
        assert torch.equal(a, b)
    torch._dynamo.reset()


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_emulated_gemm_equals_scaled_mm(out_dtype):
    """The CPU emulation against torch._scaled_mm (correct on CPU, but slow), also through the native
    code path's own layout handling (transposed views, as the dgrad/wgrad call sites pass them)."""
    a = (torch.randn(48, 32) * 20).to(torch.float8_e5m2)
    b = (torch.randn(32, 16) * 100).to(torch.float8_e4m3fn)  # used as b.t(): a non-contiguous [N, K]
    sa, sb = torch.tensor(0.37), torch.tensor(1.0 / 448)
    compute = torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32
    bias = torch.randn(16).to(out_dtype)
    emulated = gemm_nt(a.to(compute), sa, b.t().to(compute), sb, out_dtype=out_dtype, bias=bias)
    native_path = _scaled_mm(a, sa, b.t(), sb, out_dtype, bias, False)
    direct = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.float32).double() + bias.double()
    assert_close(native_path, direct, dtype=out_dtype)  # one rounding: within the output dtype's tolerance
    if out_dtype == torch.float32:
        assert_close(emulated, direct)  # the same sums, up to summation order
    scale = sa.double() * sb.double()
    exact = (a.double() @ b.double()) * scale + bias.double()
    magnitude = (a.double().abs() @ b.double().abs()) * scale + bias.double().abs()
    _assert_gemm_close(emulated, exact, magnitude, 32, "emulated")  # bf16: one rounding more


# ----------------------------------------------------------------------------- errors


def test_argument_errors():
    delayed = DelayedScaling(amax_history_len=4)
    state = functe.init_linear_scaling_state(delayed)
    x, w = torch.zeros(4, 16), torch.zeros(8, 16)
    with pytest.raises(functe.ShapeError, match=r"'weight' expected f32\[\?,16\], got f32\[8,15\]"):
        ops.fp8_linear(x, torch.zeros(8, 15), None, state, recipe=delayed)
    with pytest.raises(functe.DTypeError, match=r"'x' expected dtype f32\|f16\|bf16, got f64\[4,16\]"):
        ops.fp8_linear(x.double(), w.double(), None, state, recipe=delayed)
    with pytest.raises(functe.DTypeError, match=r"'weight' expected dtype f32 to match 'x'"):
        ops.fp8_linear(x, w.bfloat16(), None, state, recipe=delayed)
    with pytest.raises(functe.ShapeError, match=r"'bias' expected f32\[8\], got f32\[16\]"):
        ops.fp8_linear(x, w, torch.zeros(16), state, recipe=delayed)
    with pytest.raises(functe.StateError, match=r"'state' expected a LinearScalingState .*got NoneType"):
        ops.fp8_linear(x, w, None, None, recipe=delayed)
    with pytest.raises(functe.StateError, match=r"'state' expected None \(CurrentScaling is stateless\)"):
        ops.fp8_linear(x, w, None, state, recipe=functe.CurrentScaling())
    with pytest.raises(functe.StateError, match=r"'state\.input\.amax_history' expected f32\[8\] \(the recipe's"):
        ops.fp8_linear(x, w, None, state, recipe=DelayedScaling(amax_history_len=8))
    bad = functe.tree_map(lambda t: t.double(), state)
    with pytest.raises(functe.StateError, match=r"'state\.input\.scale' expected float32 \(states stay fp32\)"):
        ops.fp8_linear(x, w, None, bad, recipe=delayed)
    with pytest.raises(functe.RecipeError, match=r"'recipe' expected one of DelayedScaling, CurrentScaling"):
        ops.fp8_linear(x, w, None, None, recipe="hybrid")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["delayed", "current"])
def test_native_scaled_mm_path_on_the_cpu_matches_the_emulation(name, dtype, monkeypatch):
    """The GPU path (float8 operands, torch._scaled_mm) run on the CPU under torch.func, vs the emulation."""
    from functe import _fp8_gemm

    recipe = RECIPES[name]
    state = functe.init_linear_scaling_state(recipe)
    x, w, b = make((2, 16, 32), dtype, scale=3.0), make((48, 32), dtype, scale=0.2), make((48,), dtype)
    dy = make((2, 16, 48), dtype)  # a fixed cotangent: both paths quantize the same dy
    loss_fn = lambda p, s, x: (ops.fp8_linear(x, p["w"], p["b"], s, recipe=recipe) * dy).sum()
    step = functe.value_and_grad(loss_fn)
    emulated = step({"w": w, "b": b}, state, x)
    grad_x = torch.func.grad(lambda x: loss_fn({"w": w, "b": b}, state, x))
    emulated_dx = grad_x(x)
    calls = []
    real = torch._scaled_mm
    monkeypatch.setattr(_fp8_gemm, "_native_device", lambda device: True)
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(a[0].dtype) or real(*a, **k))
    native = step({"w": w, "b": b}, state, x)
    # fprop and wgrad: x is not differentiated, so dgrad is skipped
    assert len(calls) == 2 and all(d in (torch.float8_e4m3fn, torch.float8_e5m2) for d in calls)
    tol = torch.float16 if dtype == torch.float32 else dtype  # summation order (and bf16 double rounding)
    assert_close(native[0], emulated[0], dtype=tol)
    for k in ("w", "b"):
        assert_close(native[1][k], emulated[1][k], dtype=tol, msg=k)
    if state is not None:
        for a, e in zip(functe.tree_leaves(native[2]), functe.tree_leaves(emulated[2])):
            assert torch.equal(a, e)
    calls.clear()
    assert_close(grad_x(x), emulated_dx, dtype=tol)
    assert len(calls) == 2  # fprop and dgrad


def test_native_path_is_not_taken_under_vmap(monkeypatch):
    from functe import _fp8_gemm

    recipe = functe.CurrentScaling()
    monkeypatch.setattr(_fp8_gemm, "_native_device", lambda device: True)
    real, calls = torch._scaled_mm, []
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    w, x = make((2, 16, 32)), make((2, 16, 32))
    f = lambda w, x: ops.fp8_linear(x, w, None, None, recipe=recipe).square().sum()
    batched = torch.func.vmap(torch.func.grad(f))(w, x)
    assert not calls  # _scaled_mm has no batching rule: the emulation runs
    assert_close(batched[1], torch.func.grad(f)(w[1], x[1]), dtype=torch.float16)
    assert len(calls) == 2  # outside vmap (grad only) the native path runs: fprop, wgrad (x is not differentiated)
