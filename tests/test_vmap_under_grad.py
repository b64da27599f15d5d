"""Gradients taken *outside* a vmap: ``grad(vmap(f))``, ``jacrev(vmap(f))``, a vmapped forward then
``.backward()``. Every op's backward rule must run there as it does inside (``vmap(grad(f))``): a
vmap rule that ran the forward rule bare let the outer level differentiate its torch ops instead,
which was silently wrong for rules that are not the forward's derivative (straight-through FP8,
relu'(NaN) = 0) and raised for FP8 casts.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, jacrev, vmap

import functe
from functe import ops
from functe.testing import assert_close

F64 = torch.float64


def _straight_through():
    calls = []

    def fwd(x):
        return torch.round(x), None

    def bwd(_, g):
        calls.append(1)
        return (g,)

    return functe.custom_vjp("round_st", fwd, bwd), calls


def test_a_straight_through_rule_runs_under_grad_of_vmap():
    op, calls = _straight_through()
    x = torch.tensor([[0.2, 1.7, -2.4], [3.1, -0.6, 0.4]], dtype=F64)
    ones = torch.ones_like(x)
    assert torch.equal(vmap(grad(lambda x: op(x).sum()))(x), ones)
    calls.clear()
    assert torch.equal(grad(lambda x: vmap(op)(x).sum())(x), ones)
    assert calls  # the rule ran (the derivative of round would be 0)
    assert torch.equal(jacrev(lambda x: vmap(op)(x).sum(-1))(x).sum(0), ones)
    leaf = x.clone().requires_grad_()
    vmap(op)(leaf).sum().backward()
    assert torch.equal(leaf.grad, ones)
    # a batch dim that is not the first, and nested vmaps
    assert torch.equal(grad(lambda x: vmap(op, in_dims=1)(x).sum())(x), ones)
    assert torch.equal(grad(lambda x: vmap(vmap(op))(x[None]).sum())(x), ones)


@pytest.mark.parametrize("name", ["relu", "srelu"])
@pytest.mark.parametrize("fused", [False, True])
def test_relu_nan_convention_holds_under_grad_of_vmap(name, fused):
    # docs/activations.md: relu'(NaN) = srelu'(NaN) = 0 (TE's derivative), not autograd's.
    op = getattr(ops, name)
    fn = functe.fuse(lambda x: op(x)) if fused else op
    x = torch.tensor([[float("nan"), 1.0, -1.0], [2.0, float("nan"), 0.5]], dtype=F64)
    got = grad(lambda x: vmap(fn)(x).sum())(x)
    assert torch.equal(got, vmap(grad(lambda x: fn(x).sum()))(x))
    assert got[0, 0] == 0 and got[1, 1] == 0


def test_an_unbatched_weight_gets_the_members_summed_gradient():
    gen = torch.Generator().manual_seed(0)
    xs, w, b = (torch.randn(*s, generator=gen, dtype=F64) for s in ((3, 4, 8), (6, 8), (6,)))

    def loss(w, b, x):
        return ops.gelu(ops.linear(x, w, b)).square().sum()

    got = grad(lambda w, b: vmap(loss, in_dims=(None, None, 0))(w, b, xs).sum(), argnums=(0, 1))(w, b)
    want = [sum(g) for g in zip(*(grad(loss, argnums=(0, 1))(w, b, x) for x in xs))]
    assert_close(got[0], want[0])
    assert_close(got[1], want[1])


@pytest.mark.parametrize(
    "recipe", [functe.CurrentScaling(), functe.MXFP8BlockScaling(), functe.Float8BlockScaling()], ids=type
)
def test_fp8_linear_differentiates_straight_through_under_grad_of_vmap(recipe):
    gen = torch.Generator().manual_seed(0)
    w, xs = torch.randn(32, 32, generator=gen), torch.randn(3, 32, 32, generator=gen)

    def loss(w, x):
        return ops.fp8_linear(x, w, None, None, recipe=recipe).square().sum()

    got = grad(lambda w: vmap(loss, in_dims=(None, 0))(w, xs).sum())(w)
    assert_close(got, sum(grad(loss)(w, x) for x in xs), dtype=torch.float32)


@pytest.mark.parametrize("randomness", ["different", "same"])
def test_an_opaque_random_function_batches_with_the_callers_randomness(randomness):
    drop = functe.opaque(lambda x: F.dropout(x, 0.5, training=True))
    x = torch.rand(4, 3, 8, dtype=F64) + 1.0  # (nonzero: a zero output marks a dropped element)
    torch.manual_seed(0)
    y = vmap(drop, randomness=randomness)(x)
    torch.manual_seed(0)
    g = vmap(grad(lambda x: drop(x).sum()), randomness=randomness)(x)
    assert torch.equal(g, (y != 0).to(F64) * 2.0)  # the gradient of the very draw
    if randomness == "same":
        assert torch.equal(y[0] != 0, y[1] != 0)


def test_a_bf16_fp8_linear_under_vmap_matches_the_members_bits():
    # The dequantization scale is batched under vmap (not 0-d): the 16-bit GEMM result meets it in
    # fp32 either way, so each member rounds once, as its own call does.
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(3, 16, 32, generator=gen) * 0.2).to(torch.bfloat16)
    x = (torch.randn(3, 8, 32, generator=gen) * torch.tensor([1.0, 20.0, 0.05])[:, None, None]).to(torch.bfloat16)

    def f(x, w):
        return ops.fp8_linear(x, w, None, None, recipe=functe.CurrentScaling())

    batched = vmap(f)(x, w)
    for i in range(3):
        assert torch.equal(batched[i], f(x[i], w[i]))


def test_an_empty_vmapped_batch_of_per_example_gradients():
    g, b, xs = torch.ones(8), torch.zeros(8), torch.randn(0, 3, 8)
    for norm in (lambda g, x: ops.layer_norm(x, g, b), lambda g, x: ops.rms_norm(x, g)):
        grads = vmap(grad(lambda g, x, norm=norm: norm(g, x).square().sum()), in_dims=(None, 0))(g, xs)
        assert grads.shape == (0, 8)
    recipe = functe.DelayedScaling(amax_history_len=2)
    states = functe.tree_map(lambda t: t.new_empty((0, *t.shape)), functe.init_linear_scaling_state(recipe))

    def step(w, state, x):
        return functe.value_and_grad(lambda w, s, x: ops.linear(x, w).square().sum())(w, state, x)[1]

    assert vmap(step, in_dims=(0, 0, None))(torch.randn(0, 8, 8), states, torch.randn(3, 8)).shape == (0, 8, 8)


@pytest.mark.parametrize("recipe", [functe.CurrentScaling(), functe.DelayedScaling(amax_history_len=2)])
@pytest.mark.parametrize("fused", [False, True])
def test_fp8_linear_over_an_empty_vmapped_batch(recipe, fused):
    # torch 2.13's batching rules fail on `x * s` with a 0-d batched s when there are 0 members
    # (the FP8 cast's scale): the batched twin runs a padded member, a backward rule under vmap(grad)
    # answers zeros of the members' shapes
    state = functe.init_linear_scaling_state(recipe) if isinstance(recipe, functe.DelayedScaling) else None

    def f(x, w, state):
        return ops.fp8_linear(ops.gelu(x), w, None, state, recipe=recipe)

    f = functe.fuse(f) if fused else f
    xs, w = torch.randn(0, 3, 16), torch.randn(8, 16, requires_grad=True)
    y = vmap(f, in_dims=(0, None, None))(xs, w, state)
    assert y.shape == (0, 3, 8)
    (gw,) = torch.autograd.grad(y.sum(), w)
    assert torch.equal(gw, torch.zeros(8, 16))
    gx = vmap(grad(lambda x, w, s: f(x, w, s).sum()), in_dims=(0, None, None))(xs, w.detach(), state)
    assert gx.shape == (0, 3, 16)


def test_an_unbatched_gradient_inside_an_empty_vmap_is_a_real_one():
    # the empty-vmap shortcut (zeros from a backward rule) first fired for any node under an empty
    # vmap, so a gradient of an unbatched w taken inside one came out zeros
    w = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    want = grad(lambda w: ops.gelu(w).sum())(w)

    def body(x):
        return x + 1, grad(lambda w: ops.gelu(w).sum())(w)

    for n in (2, 0):
        assert torch.equal(vmap(body, out_dims=(0, None))(torch.zeros(n, 3, dtype=torch.float64))[1], want)


@pytest.mark.parametrize("recipe", [functe.CurrentScaling(), functe.DelayedScaling(amax_history_len=2)], ids=str)
def test_fused_fp8_inference_and_quantize_over_an_empty_vmap(recipe):
    # (the fused no-grad path ran its forward rules under the empty vmap, and quantize / dequantize are
    # plain functions: both met torch's empty-batch failures, IndexError)
    w, b = torch.randn(8, 16), torch.randn(8)
    state = functe.init_linear_scaling_state(recipe) if isinstance(recipe, functe.DelayedScaling) else None
    f = functe.fuse(lambda x: ops.fp8_linear(x, w, b, state, recipe=recipe))
    assert vmap(f)(torch.randn(0, 4, 16)).shape == (0, 4, 8)
    kw = {"state": functe.init_scaling_state(2)} if state is not None else {}
    q = vmap(lambda x: functe.dequantize(functe.quantize(x, recipe, **kw)[0]))(torch.randn(0, 4, 32))
    assert q.shape == (0, 4, 32)


@pytest.mark.parametrize("randomness", ["same", "different"])
def test_an_empty_vmap_draws_what_torch_draws(randomness):
    # over 0 members torch draws once with randomness="same" and nothing with "different"; the padded
    # member first drew nothing either way, so the generator's next values depended on requires_grad
    drop = functe.opaque(lambda x: F.dropout(x, 0.5, training=True))

    def next_value(fn, x):
        torch.manual_seed(0)
        vmap(fn, randomness=randomness)(x)
        return torch.rand(1)

    for x in (torch.randn(0, 4), torch.randn(0, 4, requires_grad=True)):
        assert torch.equal(next_value(drop, x), next_value(lambda x: F.dropout(x, 0.5, training=True), x))


@pytest.mark.parametrize("fused", [False, True])
def test_a_block_with_unused_outputs_under_grad_of_vmap(fused):
    # layer_norm's op also returns its row statistics, which nobody uses: their cotangents are
    # symbolic zeros (None) inside the batched backward.
    gen = torch.Generator().manual_seed(0)
    shapes = {"w1": (16, 8), "b1": (16,), "w2": (8, 16), "b2": (8,), "g": (8,), "b": (8,)}
    p = {k: torch.randn(*s, generator=gen, dtype=F64) for k, s in shapes.items()}
    xs = torch.randn(5, 4, 8, generator=gen, dtype=F64)

    def block(p, x):
        h = ops.layer_norm(x, p["g"], p["b"])
        return ops.linear(ops.gelu(ops.linear(h, p["w1"], p["b1"])), p["w2"], p["b2"]) + x

    fn = functe.fuse(block) if fused else block

    def loss(p, x):
        return fn(p, x).square().sum()

    got = grad(lambda p: vmap(loss, in_dims=(None, 0))(p, xs).sum())(p)
    per_example = vmap(grad(loss), in_dims=(None, 0))(p, xs)
    for k in p:
        assert_close(got[k], per_example[k].sum(0))


def test_a_materialized_zeros_op_with_an_unused_output_under_grad_of_vmap():
    # symbolic_zeros=False (the default): the rule expects zeros for the output nobody uses.
    op = functe.custom_vjp("two_outputs", lambda x: ((x * 2, x * 3), None), lambda _, g: (g[0] * 2 + g[1] * 3,))
    x = torch.randn(4, 5, dtype=F64)
    got = grad(lambda x: vmap(op)(x)[0].sum())(x)
    assert torch.equal(got, torch.full_like(x, 2.0))


@pytest.mark.parametrize("fused", [False, True])
def test_forward_mode_over_vmap_of_a_random_opaque_function_uses_its_draw(fused):
    drop = functe.opaque(lambda x: F.dropout(x, 0.5, training=True))
    fn = functe.fuse(lambda w, x: drop(ops.linear(x, w))) if fused else (lambda w, x: drop(x @ w.T))
    w, xs = torch.randn(6, 8, dtype=F64), torch.rand(3, 4, 8, dtype=F64) + 1.0
    y, tangent = torch.func.jvp(
        lambda w: vmap(fn, in_dims=(None, 0), randomness="different")(w, xs), (w,), (torch.ones_like(w),)
    )
    kept = y != 0
    assert torch.equal(tangent != 0, kept & (xs.sum(-1, keepdim=True).expand_as(y) != 0))


def test_forward_mode_over_vmap_of_a_fused_program_keeping_its_seed():
    # The dropout's int64 seed is a residual, an integer output of the batched op: no tangent.
    fn = functe.fuse(lambda w, x: ops.dropout(ops.linear(x, w), 0.3, seed=4))
    w, xs = torch.randn(6, 8, dtype=F64), torch.randn(3, 4, 8, dtype=F64)
    v = torch.randn_like(w)
    got = torch.func.jvp(lambda w: vmap(fn, in_dims=(None, 0))(w, xs), (w,), (v,))[1]
    unfused = lambda w, x: ops.dropout(ops.linear(x, w), 0.3, seed=4)
    assert_close(got, torch.func.jvp(lambda w: vmap(unfused, in_dims=(None, 0))(w, xs), (w,), (v,))[1])


def test_gradients_outside_vmap_keep_no_more_than_torch():
    # The batched op keeps only what the op's residuals refer to, pruned for the wanted gradients.
    from helpers import saved_storages

    xs, w, b = torch.randn(8, 64, 64), torch.randn(256, 64), torch.randn(256, requires_grad=True)
    g = torch.randn(64, requires_grad=True)
    for run_functe, run_torch in (
        (lambda: vmap(lambda x: ops.linear(x, w, b))(xs), lambda: vmap(lambda x: F.linear(x, w, b))(xs)),
        (lambda: vmap(lambda x: ops.bias(x, b[:64]))(xs), lambda: vmap(lambda x: x + b[:64])(xs)),
        (lambda: vmap(lambda x: ops.rms_norm(x, g))(xs), lambda: vmap(lambda x: F.rms_norm(x, (64,), g))(xs)),
    ):
        parameters = {t.untyped_storage().data_ptr() for t in (w, b, g)}

        def elements(run, parameters=parameters):  # (activations only: parameters live anyway)
            return sum(torch.Size(s).numel() for p, s in saved_storages(run)[1].items() if p not in parameters)

        assert elements(run_functe) <= elements(run_torch)


# ----------------------------------------------------------------------------- torch's legacy vmap

_LEGACY_CASES = {
    "rms_norm": lambda x, w: ops.rms_norm(x, w),
    "l2_normalize": lambda x, w: ops.l2_normalize(x) * w,
    "layer_norm": lambda x, w: ops.layer_norm(x, w, w),
    "qgelu": lambda x, w: ops.qgelu(x * w),
    "srelu": lambda x, w: ops.srelu(x * w),
    "swiglu": lambda x, w: ops.swiglu(x * w),
    "interleaved_geglu": lambda x, w: ops.geglu(x * w, interleave=2),
    "scaled_srelu": lambda x, w: ops.scaled_srelu(x, w[:3]),
    "dropout": lambda x, w: ops.dropout(x * w, 0.5, seed=1),
}


@pytest.mark.parametrize("name", list(_LEGACY_CASES))
def test_batched_gradients_of_torchs_legacy_vmap(name):
    # autograd.grad(is_grads_batched=True), the vectorized autograd.functional jacobian/hessian and
    # gradcheck(check_batched_grad=True) batch with torch's legacy vmap, whose tensors are plain
    # CPU tensors: the twins' fast paths took them and failed on out= ops (and unflatten/flatten).
    fn = _LEGACY_CASES[name]
    x, w = torch.randn(3, 8, dtype=F64, requires_grad=True), torch.randn(8, dtype=F64, requires_grad=True)
    y = fn(x, w)
    cotangents = torch.randn(5, *y.shape, dtype=F64)
    batched = torch.autograd.grad(y, (x, w), cotangents, is_grads_batched=True, retain_graph=True)
    for i, v in enumerate(cotangents):
        for got, expected in zip(batched, torch.autograd.grad(y, (x, w), v, retain_graph=True)):
            assert_close(got[i], expected)
    assert torch.autograd.gradcheck(fn, (x, w), check_batched_grad=True)


@pytest.mark.parametrize(
    "recipe, kernel",
    [
        (functe.MXFP8BlockScaling(), "mxfp8_cast"),
        (functe.Float8BlockScaling(), "fp8_block_cast"),
        (functe.NVFP4BlockScaling(), "nvfp4_cast"),
    ],
)
def test_block_scaled_casts_refuse_torchs_legacy_vmap_by_name(recipe, kernel):
    # Their casts read exponents through bit views (Tensor.view(dtype)), which the legacy vmap cannot
    # batch: torch's raw "Batching rule not implemented for aten::view.dtype" named no functe op.
    # (Per-tensor FP8 batches: its batched gradients equal the per-cotangent ones.)
    x, w = torch.randn(3, 32, requires_grad=True), torch.randn(5, 32, requires_grad=True)
    seed = 3 if isinstance(recipe, functe.NVFP4BlockScaling) else None
    y = ops.fp8_linear(x, w, None, None, recipe=recipe, seed=seed)
    with pytest.raises(functe.TransformError, match=rf"functe.{kernel}: torch's legacy vmap .*torch.func.vmap"):
        torch.autograd.grad(y, (x, w), torch.randn(4, *y.shape), is_grads_batched=True)
    y = ops.fp8_linear(x, w, None, None, recipe=functe.CurrentScaling())
    cotangents = torch.randn(4, *y.shape)
    batched = torch.autograd.grad(y, (x, w), cotangents, is_grads_batched=True, retain_graph=True)
    for i, v in enumerate(cotangents):
        for got, expected in zip(batched, torch.autograd.grad(y, (x, w), v, retain_graph=True)):
            assert torch.equal(got[i], expected)


def test_quantizing_kernels_twins_stay_picklable():
    # (the legacy-vmap naming wrapper is a class: a closure with the twin's qualified name failed
    # pickle's by-reference lookup)
    import pickle

    from functe.kernels.quantize import ACT_OUTPUT_CAST_AMAX, MXFP8_CAST

    for kernel in (ACT_OUTPUT_CAST_AMAX, MXFP8_CAST):
        assert pickle.loads(pickle.dumps(kernel.twin)).__wrapped__ is kernel.twin.__wrapped__


@pytest.mark.parametrize("op", ["layer_norm", "linear", "rms_norm"])
def test_vmap_of_hessian_over_a_parameter_expanded_along_the_vmapped_dimension(op):
    # (from a vmap fuzz: the op's jvp rule made its primals dual, and a parameter shared by expanding
    # it along the vmapped dimension, in_dims=1, overlaps only in the vmap level's physical tensor:
    # torch refused "more than one element of the written-to tensor refers to a single memory location")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, dtype=torch.float64, generator=g)
    b = torch.randn(4, dtype=torch.float64, generator=g)
    shared = torch.randn(4, 1, dtype=torch.float64, generator=g).expand(4, 3)  # (strides (1, 0))
    loss = {
        "layer_norm": lambda x, w: ops.layer_norm(x, w, b).pow(2).sum(),
        "linear": lambda x, c: ops.linear(x, torch.eye(4, dtype=torch.float64), c).pow(3).sum(),
        "rms_norm": lambda x, w: ops.rms_norm(x, w).pow(3).sum(),
    }[op]
    hessian = torch.func.hessian(loss)
    got = vmap(hessian, in_dims=(None, 1))(x, shared)
    want = torch.stack([hessian(x, shared[:, i].contiguous()) for i in range(3)])
    assert_close(got, want)
