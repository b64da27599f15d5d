"""The quantized linear under the block recipes: fwd/bwd vs F.linear on dequantized operands.

The reference rebuilds, in float64, the dequantized operands each GEMM must use (TE's copies:
fprop on rowwise x and W, dgrad on rowwise dy and the same 2-D-blocked W, wgrad on dyᵀ and xᵀ
quantized along the tokens, NVFP4's wgrad copies through the random Hadamard transform, the
stochastic rounding streams of the seed) from the quantizing building blocks checked against the
formulas in ``test_block_kernels.py``, and multiplies them with ``F.linear``. The op must match
within TE's tolerance (E4M3 for FP8 block scaling, E2M1 for NVFP4) *and* within the rounding bound
of a GEMM with fp32 accumulation on those exact operands.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import make

import functe
from functe import ops
from functe._block_quantize import RHT_STREAM, SR_DGRAD_STREAM, SR_WGRAD_STREAM, cast_block
from functe.kernels.hadamard import RHT16
from functe.testing import assert_close

F64 = torch.float64
RECIPES = {
    "fp8block": functe.Float8BlockScaling(),
    "fp8block_fp32_hybrid": functe.Float8BlockScaling(power_2_scales=False, fp8_format=functe.Format.HYBRID),
    "nvfp4": functe.NVFP4BlockScaling(),
    "nvfp4_plain": functe.NVFP4BlockScaling(
        disable_rht=True, disable_stochastic_rounding=True, disable_2d_quantization=True
    ),
}
# (x shape, out_features, bias)
CASES = [((37, 32), 16, True), ((2, 3, 48), 24, False), ((0, 32), 8, True)]
SEED = 1234


def _deq(t, recipe, role, seed=None):
    """The dequantized operand (float64) the op's GEMM sees for ``t`` quantized as ``role``."""
    q, scale, _ = cast_block(t, recipe, role, None, torch.float32, seed=seed)
    return q.double() if scale is None else q.double() / scale.double()


def _wgrad(t2, recipe, role, seed):
    """``t2ᵀ`` quantized along the tokens, through the RHT for NVFP4 (zero-padded to 16 tokens)."""
    t = t2.t()
    nvfp4 = isinstance(recipe, functe.NVFP4BlockScaling)
    if nvfp4 and not recipe.disable_rht:
        t = RHT16(F.pad(t, (0, (-t.shape[1]) % 16)), seed ^ RHT_STREAM, False, torch.float32)
    sr = nvfp4 and role == "grad_output" and not recipe.disable_stochastic_rounding
    return _deq(t, recipe, role, seed ^ SR_WGRAD_STREAM if sr else None)


def _reference(x, w, b, dy, recipe, seed):
    """(value, magnitude) of y, dx, dW in float64 from the operands the op must use."""
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    sr_seed = seed ^ SR_DGRAD_STREAM if isinstance(recipe, functe.NVFP4BlockScaling) else None
    wq = _deq(w, recipe, "weight")
    wq_t = wq.T if recipe.block_shape("weight")[0] > 1 else _deq(w.t(), recipe, "weight")
    pairs = [
        (_deq(x2, recipe, "input"), wq.T),
        (_deq(dy2, recipe, "grad_output", sr_seed), wq_t.T),
        (_wgrad(dy2, recipe, "grad_output", seed), _wgrad(x2, recipe, "input", seed).T),
    ]
    (y, y_mag), (dx, dx_mag), (dw, dw_mag) = [(p @ q, p.abs() @ q.abs()) for p, q in pairs]
    if b is not None:
        y, y_mag = y + b.double(), y_mag + b.double().abs()
    shape_y = (*x.shape[:-1], w.shape[0])
    return (y.reshape(shape_y), y_mag.reshape(shape_y)), (dx.reshape(x.shape), dx_mag.reshape(x.shape)), (dw, dw_mag)


def _assert_gemm_close(actual, expected, magnitude, k, what, tol_dtype):
    """TE's tolerance for the format, and the rounding bound of a GEMM with fp32 accumulation:
    fp32 outputs k * 2**-24 of the magnitude (plus the per-tensor scale's roundings), bf16 outputs two
    roundings of 2**-9 (the emulation rounds the bf16 GEMM's result before the scale and bias)."""
    assert actual.shape == expected.shape, what
    assert_close(actual, expected, dtype=tol_dtype, msg=what)
    unit = 2.0**-8 if actual.dtype == torch.bfloat16 else (k + 4) * 2.0**-24
    err = (actual.double() - expected).abs()
    bound = unit * (magnitude + expected.abs()) + 1e-30
    assert (err <= bound).all(), f"{what}: error {(err / bound).max().item():.2f}x the bound"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}x{c[1]}" for c in CASES])
@pytest.mark.parametrize("name", list(RECIPES))
def test_values_and_grads_vs_dequantized_reference(name, case, dtype, backend):
    recipe = RECIPES[name]
    shape, n_out, has_bias = case
    x, w = make(shape, dtype, scale=3.0), make((n_out, shape[-1]), dtype, scale=0.2)
    w[0, :5] = 40.0  # an outlier row/column: the blocks around it get their own scales
    b = make((n_out,), dtype) if has_bias else None
    dy = make((*shape[:-1], n_out), dtype, scale=0.01)
    seed = torch.tensor(SEED)
    primals = (x, w, b) if has_bias else (x, w)

    def fn(x, w, b=None):
        return ops.fp8_linear(x, w, b, None, recipe=recipe, seed=seed)

    y, pull = torch.func.vjp(fn, *primals)
    dx, dw, *db = pull(dy)
    (ref_y, mag_y), (ref_dx, mag_dx), (ref_dw, mag_dw) = _reference(x, w, b, dy, recipe, seed)
    tol = "e2m1" if isinstance(recipe, functe.NVFP4BlockScaling) else torch.float8_e4m3fn
    assert y.dtype == dx.dtype == dw.dtype == dtype
    _assert_gemm_close(y, ref_y, mag_y, shape[-1], "y", tol)
    _assert_gemm_close(dx, ref_dx, mag_dx, n_out, "dx", tol)
    _assert_gemm_close(dw, ref_dw, mag_dw, x.numel() // shape[-1] + 16, "dW", tol)
    if has_bias:
        assert db[0].dtype == dtype
        assert_close(db[0], dy.double().reshape(-1, n_out).sum(0), msg="db")


@pytest.mark.parametrize("name", ["fp8block", "nvfp4"])
def test_close_to_the_unquantized_linear(name):
    """The quantization error itself: relative error of y, dx, dW against F.linear on the original
    operands, within what the format's precision allows (E4M3: 2**-4 per value, E2M1 with E4M3
    scales: ~2**-2) and far from a wrong GEMM (errors of order 1)."""
    recipe = RECIPES[name]
    x, w = torch.randn(256, 64, dtype=torch.bfloat16), (torch.randn(48, 64) * 0.1).to(torch.bfloat16)
    dy = torch.randn(256, 48, dtype=torch.bfloat16)
    y, pull = torch.func.vjp(lambda x, w: ops.fp8_linear(x, w, None, None, recipe=recipe, seed=3), x, w)
    dx, dw = pull(dy)
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    bound = 0.05 if name == "fp8block" else 0.2
    for got, exact, what in ((y, x64 @ w64.T, "y"), (dx, dy64 @ w64, "dx"), (dw, dy64.T @ x64, "dW")):
        rel = ((got.double() - exact).norm() / exact.norm()).item()
        assert 0.002 < rel < bound, f"{what}: relative error {rel:.4f}"


def test_seed_is_required_reproducible_and_used_only_in_backward():
    recipe = RECIPES["nvfp4"]
    x, w = torch.randn(48, 32), torch.randn(16, 32) * 0.2
    with pytest.raises(TypeError, match="seed"):  # (where a gradient may be taken: see the inference test)
        ops.fp8_linear(x, w.clone().requires_grad_(), None, None, recipe=recipe)
    with pytest.raises(TypeError, match="seed"):
        ops.fp8_linear(x, w, None, None, recipe=recipe, seed=1.5)

    dy = torch.randn(48, 16) * 0.01

    def run(seed):
        y, pull = torch.func.vjp(lambda x, w: ops.fp8_linear(x, w, None, None, recipe=recipe, seed=seed), x, w)
        return (y, *pull(dy))

    y1, dx1, dw1 = run(7)
    y2, dx2, dw2 = run(torch.tensor(7))
    y3, dx3, dw3 = run(8)
    assert torch.equal(y1, y2) and torch.equal(dx1, dx2) and torch.equal(dw1, dw2)
    assert torch.equal(y1, y3)  # the forward quantization is deterministic
    assert not torch.equal(dx1, dx3) and not torch.equal(dw1, dw3)  # SR and RHT draw from the seed
    # Deterministic recipes ignore the seed.
    plain = RECIPES["nvfp4_plain"]
    assert torch.equal(
        ops.fp8_linear(x, w, None, None, recipe=plain, seed=1), ops.fp8_linear(x, w, None, None, recipe=plain)
    )


def test_rht_keeps_the_weight_gradient_unbiased():
    """With the RHT (and no stochastic rounding) dW still estimates dyᵀ x: Q Qᵀ = I cancels between
    the two wgrad operands. A transform applied to one operand only would be off by O(1)."""
    x, dy = torch.randn(64, 32), torch.randn(64, 16)
    w = torch.randn(16, 32) * 0.2
    exact = dy.double().T @ x.double()
    for recipe in (functe.NVFP4BlockScaling(disable_stochastic_rounding=True), RECIPES["nvfp4_plain"]):
        _, pull = torch.func.vjp(lambda w, r=recipe: ops.fp8_linear(x, w, None, None, recipe=r, seed=5), w)
        (dw,) = pull(dy)
        rel = ((dw.double() - exact).norm() / exact.norm()).item()
        assert rel < 0.2, rel


def test_second_derivatives_raise():
    x, w = torch.randn(4, 16, dtype=F64), torch.randn(8, 16, dtype=F64)
    loss = lambda x: ops.fp8_linear(x.float(), w.float(), None, None, recipe=RECIPES["fp8block"]).sum()
    with pytest.raises(functe.TransformError):
        torch.func.grad(lambda x: torch.func.grad(loss)(x).sum())(x)


@pytest.mark.parametrize("name", ["fp8block", "nvfp4"])
def test_vmap_of_grad_equals_per_member_runs(name):
    recipe = RECIPES[name]
    ws = torch.randn(3, 16, 32) * 0.2
    x = torch.randn(10, 32)
    loss = lambda w: ops.fp8_linear(x, w, None, None, recipe=recipe, seed=5).square().sum()
    batched = torch.func.vmap(torch.func.grad(loss))(ws)
    for i in range(3):
        assert torch.equal(batched[i], torch.func.grad(loss)(ws[i]))


def test_compiles_fullgraph_with_the_seed_as_an_argument():
    """torch.compile(fullgraph=True) of the NVFP4 linear (kernels opaque, the seed a tensor input, so
    a new seed does not recompile), gradients taken outside (docs/design.md): identical results."""
    from torch._dynamo.backends.registry import lookup_backend

    aot_eager, graphs = lookup_backend("aot_eager"), []

    def counting(gm, inputs):
        graphs.append(gm)
        return aot_eager(gm, inputs)

    recipe = RECIPES["nvfp4"]
    fn = lambda x, w, seed: ops.fp8_linear(x, w, None, None, recipe=recipe, seed=seed)
    compiled = torch.compile(fn, fullgraph=True, backend=counting)
    x, w = torch.randn(32, 64, requires_grad=True), torch.randn(16, 64, requires_grad=True)
    for seed in (3, 4):
        y = compiled(x, w, torch.tensor(seed))
        y_ref = fn(x, w, torch.tensor(seed))
        grads = torch.autograd.grad((y * y).sum(), (x, w))
        grads_ref = torch.autograd.grad((y_ref * y_ref).sum(), (x, w))
        assert torch.equal(y, y_ref) and all(torch.equal(g, r) for g, r in zip(grads, grads_ref))
    assert len(graphs) == 1


@pytest.mark.parametrize(("name", "keeps_wq"), [("nvfp4", True), ("nvfp4_1d", False), ("fp8block", True)])
def test_only_2d_weight_blocks_keep_the_quantized_weight(name, keeps_wq):
    # With 1-D weight blocks dgrad quantizes Wᵀ afresh, but W_q (weight-sized, in the GEMM's dtype)
    # was kept until backward all the same.
    recipe = {"nvfp4_1d": functe.NVFP4BlockScaling(disable_2d_quantization=True)}.get(name) or RECIPES[name]
    x, w = make((32, 64)).requires_grad_(), make((48, 64)).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = ops.fp8_linear(x, w, None, None, recipe=recipe, seed=torch.tensor(5))
    weight_sized = [t for t in saved if t.shape == w.shape and t.untyped_storage().data_ptr() != w.data_ptr()]
    assert bool(weight_sized) == keeps_wq
    (dx,) = torch.autograd.grad(y.sum(), x)
    assert dx.isfinite().all()


def test_nearby_seeds_never_share_a_stream():
    # Streams were seed ^ 0x53520001 / 0x53520002: seed 3's dgrad rounding bits were seed 0's wgrad
    # ones (layers or steps 0 and 3 of base + offset seeds). Every stream of every seed a counter or
    # a layer offset makes is now distinct.
    streams = (0, RHT_STREAM, SR_DGRAD_STREAM, SR_WGRAD_STREAM)
    seeds = range(-(2**12), 2**12)
    keys = {s ^ c for s in seeds for c in streams}
    assert len(keys) == len(seeds) * len(streams)


def test_nvfp4_inference_needs_no_seed():
    # The draws are the gradients' own (RHT on the wgrad operands, SR on dy): a served model was
    # told to "pass a new seed each step". Anything that may differentiate still needs one, and so
    # does a fused function (its plan may serve training calls).
    recipe = functe.NVFP4BlockScaling()
    torch.manual_seed(0)
    x, w = torch.randn(4, 32), torch.randn(16, 32)
    with torch.no_grad():
        seeded = ops.fp8_linear(x, w, None, None, recipe=recipe, seed=7)
        torch.testing.assert_close(ops.fp8_linear(x, w, None, None, recipe=recipe), seeded, rtol=0, atol=0)
    with torch.inference_mode():
        torch.testing.assert_close(ops.fp8_linear(x, w, None, None, recipe=recipe), seeded, rtol=0, atol=0)
    with pytest.raises(functe.ArgumentError, match=r"argument 'seed' expected"):
        ops.fp8_linear(x, w.requires_grad_(), None, None, recipe=recipe)
    with torch.no_grad(), pytest.raises(functe.ArgumentError, match=r"argument 'seed' expected"):
        functe.fuse(lambda x: ops.fp8_linear(x, w, None, None, recipe=recipe))(x)
    # A vmap level alone takes no gradient (a served ensemble): it was refused as if it trained.
    # Under grad, or vmap(grad), a seed is still needed.
    frozen, members = w.detach(), torch.stack([x, 2 * x])
    with torch.no_grad():
        batched = torch.func.vmap(lambda xi: ops.fp8_linear(xi, frozen, None, None, recipe=recipe))(members)
        for i in range(2):
            alone = ops.fp8_linear(members[i], frozen, None, None, recipe=recipe, seed=7)
            torch.testing.assert_close(batched[i], alone, rtol=0, atol=0)
    loss = lambda xi: ops.fp8_linear(xi, frozen, None, None, recipe=recipe).sum()
    with pytest.raises(functe.ArgumentError, match=r"argument 'seed' expected"):
        torch.func.grad(loss)(x)
    with pytest.raises(functe.ArgumentError, match=r"argument 'seed' expected"):
        torch.func.vmap(torch.func.grad(loss))(members)
