"""Quantizing kernels: Triton (interpreted) vs PyTorch twin vs the FP8 references, bit for bit.

Casts are compared exactly: kernel and twin must produce the same bits and both the value the
round-to-nearest-even reference gives. Fused kernels are compared with their unfused twins
(the activation math differs by float32 ulps between Triton and torch, so a value may land on the
neighbouring FP8 grid point: those comparisons use the format's tolerance).
"""

from __future__ import annotations

import pytest
import torch
from fp8_helpers import FP8, MAX, e8m0_ref, fp8_grid, quantize_ref, same_values, special_values

import functe
from functe.kernels import _act
from functe.kernels import quantize as qk
from functe.testing import assert_close

E4M3, E5M2 = FP8
SHAPES = [(37,), (2, 13), (32, 1, 32), (0, 13)]


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _input(shape, dtype):
    n = 1
    for d in shape:
        n *= d
    return special_values(n).reshape(shape).to(dtype)


@pytest.mark.parametrize("qdtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_cast_amax_kernel_equals_twin_and_reference(shape, dtype, qdtype):
    x = _input(shape, dtype)
    scale = torch.tensor(3.7)
    with functe.use_backend("interpret"):
        q, amax = qk.cast_amax(x, scale, qdtype, qdtype, True)
        q_wide, _ = qk.cast_amax(x, scale, qdtype, torch.bfloat16, True)
    q_twin, amax_twin = qk.cast_amax_ref(x, scale, qdtype, qdtype, True)
    assert q.shape == x.shape and q.dtype == qdtype
    assert _bits_equal(q, q_twin)
    assert same_values(q.float(), quantize_ref(x, scale, qdtype))
    assert same_values(q_wide, q.float())  # the wide storage holds the same grid values
    expected_amax = x.double().abs().max() if x.numel() else torch.tensor(0.0)
    assert amax.dtype == torch.float32 and amax.item() == amax_twin.item() == expected_amax.item()


@pytest.mark.parametrize("qdtype", FP8, ids=["e4m3", "e5m2"])
def test_every_grid_point_midpoint_and_neighbour_rounds_to_nearest_even(qdtype):
    grid, _ = fp8_grid(qdtype)
    mids = (grid[1:] + grid[:-1]) / 2
    up, down = torch.tensor(float("inf"), dtype=torch.float64), torch.tensor(-1.0, dtype=torch.float64)
    values = torch.cat([grid, mids, mids.nextafter(up), mids.nextafter(down).clamp(min=0)]).float()
    values = torch.cat([values, -values])
    one = torch.tensor(1.0)
    with functe.use_backend("interpret"):
        q, _ = qk.cast_amax(values, one, qdtype, qdtype, True)
    q_twin, _ = qk.cast_amax_ref(values, one, qdtype, qdtype, True)
    assert _bits_equal(q, q_twin)
    assert same_values(q.float(), quantize_ref(values, one, qdtype))


@pytest.mark.parametrize("qdtype", FP8, ids=["e4m3", "e5m2"])
def test_saturation_nan_and_inf(qdtype):
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([inf, -inf, 1e30, -1e30, MAX[qdtype] * 1.06, nan, 1.0, -0.0])
    with functe.use_backend("interpret"):
        q, amax = qk.cast_amax(x, torch.tensor(1.0), qdtype, qdtype, True)
        _, amax_inf = qk.cast_amax(x[:5], torch.tensor(1.0), qdtype, qdtype, False)
    q_twin, amax_twin = qk.cast_amax_ref(x, torch.tensor(1.0), qdtype, qdtype, True)
    m = MAX[qdtype]
    assert _bits_equal(q, q_twin)
    assert same_values(q.float(), torch.tensor([m, -m, m, -m, m, nan, 1.0, -0.0]))  # E5M2 too: no inf
    assert amax.isnan() and amax_twin.isnan()  # a NaN anywhere makes the amax NaN
    assert amax_inf.item() == inf


@pytest.mark.parametrize("qdtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("shape", [(5, 70), (2, 64), (32, 1, 32), (0, 32)])
def test_mxfp8_kernel_twin_and_e8m0_reference(shape, qdtype):
    n = 1
    for d in shape:
        n *= d
    magnitudes = torch.logspace(-5, 5, shape[-1], dtype=torch.float64)
    x = (special_values(n).reshape(shape) * magnitudes).float()
    with functe.use_backend("interpret"):
        q, e = qk.mxfp8_cast(x, qdtype, qdtype)
        dq, e2 = qk.mxfp8_cast(x, qdtype, torch.float32)
    q_twin, e_twin = qk.mxfp8_cast_ref(x, qdtype, qdtype)
    dq_twin, _ = qk.mxfp8_cast_ref(x, qdtype, torch.float32)
    assert _bits_equal(q, q_twin) and torch.equal(e, e_twin) and torch.equal(e, e2)
    assert same_values(dq, dq_twin)
    blocks = -(-shape[-1] // 32)
    assert e.shape == (*shape[:-1], blocks) and e.dtype == torch.uint8
    rows = x.reshape(-1, shape[-1])
    for r in range(rows.shape[0]):
        for b in range(blocks):
            block = rows[r, 32 * b : 32 * (b + 1)]
            assert e.reshape(-1, blocks)[r, b].item() == e8m0_ref(block.abs().max().item(), MAX[qdtype])
    # The scale is rounded up: nothing saturates, and each value is its block-scaled FP8 value.
    scale_inv = qk.e8m0_to_float(e).repeat_interleave(32, -1)[..., : shape[-1]].double()
    assert (q.double().abs() <= MAX[qdtype]).all()
    assert same_values(q.float(), quantize_ref(x, 1.0 / scale_inv, qdtype))
    assert same_values(dq, q.double() * scale_inv)


@pytest.mark.parametrize("qdtype", FP8, ids=["e4m3", "e5m2"])
def test_mxfp8_special_blocks(qdtype):
    x = torch.zeros(4, 64)
    x[1, 5] = float("nan")
    x[2, 7] = float("inf")
    x[3] = torch.linspace(-3, 3, 64)
    with functe.use_backend("interpret"):
        q, e = qk.mxfp8_cast(x, qdtype, qdtype)
    q_twin, e_twin = qk.mxfp8_cast_ref(x, qdtype, qdtype)
    assert _bits_equal(q, q_twin) and torch.equal(e, e_twin)
    assert e[0].tolist() == [0, 0] and e[1, 0] == 255 and e[2, 0] == 254
    assert e[3, 0].item() == e8m0_ref(3.0, MAX[qdtype])
    assert qk.e8m0_to_float(e)[1, 0].isnan()  # a NaN block dequantizes to NaN


def _formula(a: torch.Tensor, name: str) -> torch.Tensor:
    """Activations from their definitions in float64 (gated: act(first half) * second half)."""
    x = a.double()
    if name == "clamped_swiglu":
        u, v = x.chunk(2, -1)
        uc = u.clamp(max=7.0)
        return uc * torch.sigmoid(1.702 * uc) * (v.clamp(-7.0, 7.0) + 1.0)
    if name in _act.GATED:
        u, v = x.chunk(2, -1)
        return _act.act_fwd_ref(u, _act.GATED[name]) * v
    return _act.act_fwd_ref(x, name)


ACTS = [*_act.ACTIVATIONS, *_act.GATED, "clamped_swiglu"]


@pytest.mark.parametrize("act", ACTS)
def test_activation_cast_amax_vs_unfused(act):
    x = torch.randn(7, 26) * 3
    x[0, 0] = 9.0  # beyond the clamped SwiGLU's limit
    scale = torch.tensor(20.0)
    args = (act, 7.0, 1.702, 1.0, E4M3)
    with functe.use_backend("interpret"):
        q, amax = qk.act_cast_amax(x, scale, *args, E4M3, True)
        q_none, amax_only = qk.act_cast_amax(x, scale, *args, E4M3, False)
    q_twin, amax_twin = qk.act_cast_amax_ref(x, scale, *args, E4M3, True)
    expected = _formula(x, act)
    assert q.shape == expected.shape and q_none.numel() == 0 and amax_only.item() == amax.item()
    assert_close(amax, amax_twin)
    assert_close(amax, expected.abs().max())
    assert_close(q.float(), q_twin.float(), dtype=E4M3)
    assert_close(q.float(), quantize_ref(expected.float(), scale, E4M3), dtype=E4M3)


@pytest.mark.parametrize("shape", [(37, 13), (32, 1, 32), (0, 13)])
def test_dbias_cast_amax_is_bgrad_quantize(shape):
    dy = torch.randn(shape) * 4
    scale = torch.tensor(1000.0)
    with functe.use_backend("interpret"):
        q, dbias, amax = qk.dbias_cast_amax(dy, scale, E5M2, E5M2, True)
        _, dbias2, amax2 = qk.dbias_cast_amax(dy, scale, E5M2, E5M2, False)
    q_twin, dbias_twin, amax_twin = qk.dbias_cast_amax_ref(dy, scale, E5M2, E5M2, True)
    assert _bits_equal(q, q_twin) and same_values(q.float(), quantize_ref(dy, scale, E5M2))
    expected = dy.double().reshape(-1, shape[-1]).sum(0)
    assert dbias.shape == (shape[-1],) and dbias.dtype == dy.dtype
    assert_close(dbias, expected) and assert_close(dbias_twin, expected) and torch.equal(dbias, dbias2)
    assert amax.item() == amax_twin.item() == amax2.item() == (dy.abs().max().item() if dy.numel() else 0.0)


@pytest.mark.parametrize("act", list(_act.ACTIVATIONS))
def test_dact_dbias_cast_amax_vs_unfused(act):
    x, dy = torch.randn(37, 13) * 2, torch.randn(37, 13)
    scale = torch.tensor(4000.0)
    with functe.use_backend("interpret"):
        q, dbias, amax = qk.dact_dbias_cast_amax(dy, x, scale, act, E5M2, E5M2, True)
    q_twin, dbias_twin, amax_twin = qk.dact_dbias_cast_amax_ref(dy, x, scale, act, E5M2, E5M2, True)
    x64 = x.double().requires_grad_()
    (grad,) = torch.autograd.grad(_formula(x64, act), x64, dy.double())  # dy * act'(x), from autograd
    assert_close(dbias, grad.sum(0)) and assert_close(dbias_twin, grad.sum(0))
    assert_close(amax, grad.abs().max()) and assert_close(amax, amax_twin)
    assert_close(q.float(), q_twin.float(), dtype=E5M2)
    assert_close(q.float(), quantize_ref(grad.float(), scale, E5M2), dtype=E5M2)


def test_twin_chunked_cast_matches_whole_tensor_cast():
    # Large CPU tensors take the cache-friendly chunked path; it must give the same bits.
    x = torch.randn(1100, 512, dtype=torch.bfloat16) * 100  # > _CHUNK: three chunks, the last partial
    assert x.numel() > qk._CHUNK
    scale = torch.tensor(1.3)
    q = qk.cast_ref(x, scale, E4M3, E4M3)
    whole = torch.clamp(x.float() * scale, -448, 448).to(E4M3)
    assert _bits_equal(q, whole)
    assert torch.equal(qk.cast_ref(x, scale, E4M3, torch.bfloat16), whole.to(torch.bfloat16))


@pytest.mark.parametrize(
    "recipe", [functe.DelayedScaling(amax_history_len=2), functe.CurrentScaling()], ids=["delayed", "current"]
)
def test_recipe_level_fused_casts_equal_the_unfused_path(recipe, backend):
    """cast_act / cast_dact_dbias (one or two kernel passes) vs activation twin + plain cast."""
    from functe._quantize import cast, cast_act, cast_dact_dbias

    x, dy = torch.randn(9, 26) * 2, torch.randn(9, 26)
    scale = torch.tensor(50.0) if isinstance(recipe, functe.DelayedScaling) else None
    q, s, amax = cast_act(x, "swiglu", recipe, "input", scale, E4M3)
    v = _act.act_fwd_ref(x[:, :13], "silu") * x[:, 13:]
    q_ref, s_ref, amax_ref = cast(v, recipe, "input", scale, E4M3)
    assert_close(amax, amax_ref) and assert_close(s, s_ref)
    assert_close(q.float(), q_ref.float(), dtype=E4M3)
    q, dbias, s, amax = cast_dact_dbias(dy, x, "gelu", recipe, "grad_output", scale, E5M2)
    g = dy * _act.act_grad_ref(x, "gelu")
    q_ref, s_ref, amax_ref = cast(g, recipe, "grad_output", scale, E5M2)
    assert_close(amax, amax_ref) and assert_close(s, s_ref) and assert_close(dbias, g.double().sum(0))
    assert_close(q.float(), q_ref.float(), dtype=E5M2)


def test_e8m0_scales_are_exact_powers_of_two_without_the_e8m0_dtype():
    # Built from float32 bits (Inductor's CPU backend has no float8_e8m0fnu): every code.
    e = torch.arange(256, dtype=torch.uint8)
    got = qk.e8m0_to_float(e)
    want = torch.tensor([2.0 ** (i - 127) for i in range(255)] + [float("nan")], dtype=torch.float64)
    assert got.dtype == torch.float32 and got[255].isnan()
    assert torch.equal(got[:255].double(), want[:255])


@pytest.mark.parametrize("backend", ["torch", "interpret"])
def test_kernel_level_calls_that_the_kernel_and_twin_read_apart_are_refused(backend):
    # An fp8 output of the other format: the kernels stored the quantized format's bits in it (read
    # as other values), the twins converted the values. A β for RMSNorm: the norm+cast kernels
    # added it, their twins ignored it. Both results depended on the backend.
    from functe.kernels.block_quantize import FP8_BLOCK_CAST
    from functe.kernels.norm_block_quantize import NORM_FP8_BLOCK_CAST, NORM_NVFP4_CAST
    from functe.kernels.norm_quantize import NORM_CAST_AMAX

    x, w, b = torch.randn(2, 32), torch.randn(32), torch.randn(32)
    e4, e5, one = torch.float8_e4m3fn, torch.float8_e5m2, torch.tensor(1.0)
    with functe.use_backend(backend):
        for call in (
            lambda: qk.CAST_AMAX(x, one, e5, e4, True),
            lambda: qk.MXFP8_CAST(x, e5, e4),
            lambda: FP8_BLOCK_CAST(x, "", 0.0, 0.0, 0.0, e5, e4, False, 0.0),
        ):
            with pytest.raises(ValueError, match="float8 output must be in the quantized format"):
                call()
        for call in (
            lambda: NORM_CAST_AMAX(x, w, b, one, 1e-5, "rms", False, e4, torch.uint8, True),
            lambda: NORM_FP8_BLOCK_CAST(x, w, b, 1e-5, "rms", False, e4, torch.float32, False, 0.0),
            lambda: NORM_NVFP4_CAST(x, w, b, torch.tensor(3.0), 1e-5, "rms", True, torch.float32),
        ):
            with pytest.raises(ValueError, match=r"a rms norm takes no bias .*got f32\[32\]"):
                call()
        assert qk.CAST_AMAX(x, one, e4, e4, True)[0].dtype == e4  # (the matching format still works)


def test_a_wrong_fp8_dtype_is_named_as_a_dtype():
    from functe.kernels import gemm_fp8

    with pytest.raises(functe.DTypeError, match=r"'fp8_dtype' expected f8e4m3\|f8e5m2, got bf16$"):  # (was bf16[0])
        gemm_fp8.gemm_quantize(torch.ones(2, 4), torch.ones(3, 4), torch.tensor(1.0), torch.bfloat16)
