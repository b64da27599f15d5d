"""Block-scaled quantizing kernels: Triton (interpreted) vs PyTorch twin vs float64 references.

The kernels and their twins must agree bit for bit, and both must equal the references written
from TE's formulas in ``block_helpers`` (block scales, FP8 values, E2M1 codes and packed nibbles,
E4M3 scales, global scales). Activation fusions must equal the activation op followed by the
plain cast, stochastic rounding must be unbiased and follow the counter-based hash, and the
random Hadamard transform must be the orthogonal matrix ``diag(s) H / 4``.
"""

from __future__ import annotations

import math

import pytest
import torch
from block_helpers import (
    E2M1_GRID,
    F64,
    bits_int,
    fp8_block_reference,
    nvfp4_reference,
    pack_codes,
    rht_q,
    round_e2m1_reference,
    sylvester,
)
from fp8_helpers import FP8, same_values, special_values

import functe
from functe import ops
from functe._block_quantize import cast_act_block, cast_block
from functe.kernels import _act, hadamard
from functe.kernels import block_quantize as bq
from functe.kernels import norm_block_quantize as nbq
from functe.kernels import nvfp4 as nv
from functe.testing import assert_close

E4M3, E5M2 = FP8
SHAPES = [(37,), (2, 13), (3, 300), (32, 1, 32), (0, 13)]
ACTS = [*_act.ACTIVATIONS, *_act.GATED, "clamped_swiglu"]


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _spread(shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    """Special values (zeros, tiny, huge, negative) with magnitudes that change along the last dim,
    so neighbouring blocks get very different scales."""
    n = math.prod(shape)
    magnitudes = torch.logspace(-4, 4, shape[-1], dtype=F64) if shape[-1] else torch.ones(0, dtype=F64)
    return (special_values(n, seed=seed).reshape(shape) * magnitudes).to(dtype)


def _interpret(fn, *args):
    with functe.use_backend("interpret"):
        return fn(*args)


# ----------------------------------------------------------------------------- FP8 block scaling


@pytest.mark.parametrize("pow2", [True, False], ids=["pow2", "fp32"])
@pytest.mark.parametrize("qdtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_block_1x128_kernel_twin_and_reference(shape, dtype, qdtype, pow2):
    x = _spread(shape, dtype)
    args = ("", 0.0, 0.0, 0.0, qdtype)
    q, sinv = _interpret(bq.fp8_block_cast, x, *args, qdtype, pow2, 0.0)
    dq, sinv2 = _interpret(bq.fp8_block_cast, x, *args, torch.float32, pow2, 0.0)
    q_twin, sinv_twin = bq.fp8_block_cast_ref(x, *args, qdtype, pow2, 0.0)
    dq_twin, _ = bq.fp8_block_cast_ref(x, *args, torch.float32, pow2, 0.0)
    ref_q, ref_sinv, ref_dq = fp8_block_reference(x, 1, qdtype, pow2=pow2)
    assert _bits_equal(q, q_twin) and torch.equal(sinv, sinv_twin) and torch.equal(sinv, sinv2)
    assert sinv.shape == (*shape[:-1], -(-shape[-1] // 128)) and sinv.dtype == torch.float32
    assert same_values(q.float(), ref_q) and same_values(sinv, ref_sinv)
    assert same_values(dq, dq_twin) and same_values(dq, f32_of(ref_dq))
    if pow2:  # power-of-two scales: the dequantized value is exact (also in bf16)
        assert same_values(dq, ref_dq)


def f32_of(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32)


@pytest.mark.parametrize("shape", [(130, 300), (5, 7), (128, 128), (0, 4)])
def test_fp8_block_128x128_weights(shape):
    w = _spread(shape, seed=1)
    q, sinv = _interpret(bq.fp8_block_cast_2d, w, E4M3, E4M3, True, 0.0)
    q_twin, sinv_twin = bq.fp8_block_cast_2d_ref(w, E4M3, E4M3, True, 0.0)
    ref_q, ref_sinv, _ = fp8_block_reference(w, 128, E4M3)
    assert _bits_equal(q, q_twin) and torch.equal(sinv, sinv_twin)
    assert sinv.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    assert same_values(q.float(), ref_q) and same_values(sinv, ref_sinv)
    # One scale per 128x128 tile: the transpose quantizes to the transposed values (dgrad reuses W_q).
    qt, sinv_t = bq.fp8_block_cast_2d_ref(w.t(), E4M3, E4M3, True, 0.0)
    assert _bits_equal(qt, q.t().contiguous()) and torch.equal(sinv_t, sinv.t())


@pytest.mark.parametrize("pow2", [True, False], ids=["pow2", "fp32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_block_scale_past_fp32_is_the_input_dtypes_largest_value(dtype, pow2):
    """A block whose fp8_max / amax overflows fp32 gets the input dtype's largest finite value as its
    scale (TE's value_for_inf), not FLT_MAX: a zero block with a tiny amax_epsilon, and for bf16/fp32
    a block of 1e-38; 1x128 and 128x128 blocks, both backends, and the fused norm + block cast."""
    eps = 1e-40  # (448 / 1e-40 overflows fp32; a zero block's amax becomes eps)
    x = torch.zeros(3, 384, dtype=dtype)
    x[:, 256:] = -2.5  # an ordinary block beside them
    if dtype != torch.float16:
        x[1, 128:256] = 1e-38
    expected = torch.finfo(dtype).max
    expected = 2.0 ** math.floor(math.log2(expected)) if pow2 else expected
    recipe = functe.Float8BlockScaling(power_2_scales=pow2, amax_epsilon=eps)
    for backend in ("torch", "interpret"):
        with functe.use_backend(backend):
            for role, rows in (("input", 1), ("weight", 128)):
                q, _ = functe.quantize(x, recipe, role=role)
                ref_q, ref_sinv, _ = fp8_block_reference(x, rows, E4M3, pow2=pow2, eps=eps)
                what = f"{backend} {role}"
                assert same_values(q.block_scales, ref_sinv) and same_values(q.data.float(), ref_q), what
                assert q.block_scales.reshape(-1)[0].item() == torch.tensor(1 / expected).float().item(), what
            w, b = torch.zeros(384, dtype=dtype), torch.zeros(384, dtype=dtype)  # y = 0: zero blocks
            y, q, s, _, _ = nbq.NORM_FP8_BLOCK_CAST(x, w, b, 1e-5, "layer", False, E4M3, E4M3, pow2, eps)
            assert same_values(s, fp8_block_reference(y, 1, E4M3, pow2=pow2, eps=eps)[1]), backend
            assert (s == torch.tensor(1 / expected).float()).all(), backend


def test_fp8_block_special_blocks():
    inf, nan = math.inf, math.nan
    x = torch.zeros(5, 256)
    x[1, :128] = torch.linspace(-3, 3, 128)
    x[2, 5], x[2, 6] = nan, 2.0
    x[3, 7], x[3, 8], x[3, 9] = inf, -inf, 1.0
    x[4, 3] = 1e-40  # fp32 subnormal: fp8_max / amax overflows to inf -> FLT_MAX -> 2**127
    x[4, 130] = 1e-3
    args = ("", 0.0, 0.0, 0.0, E4M3, E4M3, True)
    q, sinv = _interpret(bq.fp8_block_cast, x, *args, 0.0)
    q_twin, sinv_twin = bq.fp8_block_cast_ref(x, *args, 0.0)
    assert _bits_equal(q, q_twin) and torch.equal(sinv, sinv_twin)
    assert sinv[0].tolist() == [1.0, 1.0] and (q[0].float() == 0).all()  # all-zero blocks: scale 1
    assert sinv[1, 0].item() == 2.0 ** -math.floor(math.log2(448 / 3))  # power of two rounded down
    assert sinv[2, 0].item() == 1.0 and q[2, 5].float().isnan() and q[2, 6].item() == 2.0  # NaN: scale 1
    assert sinv[3, 0].item() == 1.0 and q[3, 7:10].float().tolist() == [448.0, -448.0, 1.0]  # inf saturates
    assert sinv[4, 0].item() == 2.0**-127  # FLT_MAX scale, rounded down to 2**127
    # amax_epsilon bounds every block's amax from below (all-zero blocks included, as in TE)
    q, sinv = _interpret(bq.fp8_block_cast, x[4:], *args, 0.01)
    assert torch.equal(sinv, bq.fp8_block_cast_ref(x[4:], *args, 0.01)[1])
    assert sinv.tolist() == [[2.0 ** -math.floor(math.log2(448 / 0.01))] * 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ACTS)
def test_fp8_block_activation_fusion_equals_activation_then_cast(act, dtype, backend):
    x = (torch.randn(7, 300) * 3).to(dtype)
    x[0, 0] = 9.0  # beyond the clamped SwiGLU's limit
    recipe = functe.Float8BlockScaling()
    q, scale, amax = cast_act_block(x, act, recipe, "input", None, torch.float32)
    v = ops.activation(x, act)
    q_ref, scale_ref, _ = cast_block(v, recipe, "input", None, torch.float32)
    assert scale is None and amax is None and scale_ref is None
    assert q.shape == v.shape and torch.equal(q, q_ref)
    fused_fp8, fused_sinv = bq.FP8_BLOCK_CAST(x, act, 7.0, 1.702, 1.0, E4M3, E4M3, True, 0.0)
    ref_q, ref_sinv, _ = fp8_block_reference(v, 1, E4M3)
    assert same_values(fused_fp8.float(), ref_q) and same_values(fused_sinv, ref_sinv)


# ----------------------------------------------------------------------------- NVFP4


def _amax(v: torch.Tensor) -> torch.Tensor:
    return v.abs().max().float() if v.numel() else torch.zeros(())


_NO_SEED = torch.zeros((), dtype=torch.int64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("shape", "tile_rows"), [((38,), 1), ((2, 14), 1), ((3, 300), 1), ((32, 1, 32), 1), ((0, 14), 1), ((40, 50), 16)]
)
def test_nvfp4_kernel_twin_and_reference(shape, tile_rows, dtype):
    x = _spread(shape, dtype, seed=2)
    amax = _amax(x)
    args = (amax, _NO_SEED, "", 0.0, 0.0, 0.0, tile_rows, False)
    packed, scales = _interpret(nv.nvfp4_cast, x, *args, torch.uint8)
    wide, scales2 = _interpret(nv.nvfp4_cast, x, *args, torch.float32)
    packed_twin, scales_twin = nv.nvfp4_cast_ref(x, *args, torch.uint8)
    wide_twin, _ = nv.nvfp4_cast_ref(x, *args, torch.float32)
    ref = nvfp4_reference(x, tile_rows)
    assert _bits_equal(scales, scales_twin) and _bits_equal(scales, scales2) and torch.equal(packed, packed_twin)
    assert packed.shape == (*shape[:-1], shape[-1] // 2) and packed.dtype == torch.uint8
    assert scales.dtype == torch.float8_e4m3fn and scales.shape == ref["scales"].shape
    assert torch.equal(packed, pack_codes(ref["codes"]))  # E2M1 codes, element 2i in the low nibble
    assert same_values(scales.float(), ref["scales"])
    assert same_values(wide, wide_twin) and same_values(wide, ref["q"] * _per_element(ref["scales"], shape, tile_rows))
    q, _ = functe.quantize(x, functe.NVFP4BlockScaling(disable_2d_quantization=tile_rows == 1), role="weight")
    assert same_values(q.scale_inv, ref["global_decode"]) and same_values(functe.dequantize(q), f32_of(ref["deq"]))


def _per_element(scales: torch.Tensor, shape, tile_rows: int) -> torch.Tensor:
    s = scales.to(F64)
    if tile_rows > 1:
        s = s.repeat_interleave(tile_rows, 0)[: shape[0]]
    return s.repeat_interleave(16, -1)[..., : shape[-1]]


def _exact_scale_tensor(values: torch.Tensor) -> torch.Tensor:
    """Rows of 15 test values plus a 6.0, and one row holding 2688: then global encode = 1, every
    test block's E4M3 scale is 1 and its encode scale 1, so the kernel rounds the values themselves."""
    n = values.numel()
    rows = -(-n // 15)
    x = torch.zeros(rows + 1, 16)
    body = torch.zeros(rows * 15)
    body[:n] = values
    x[:rows, :15] = body.reshape(rows, 15)
    x[:rows, 15] = 6.0
    x[rows, 0] = 2688.0
    return x


def test_e2m1_every_grid_point_midpoint_and_neighbour_rounds_to_nearest_even():
    grid = E2M1_GRID.float()
    mids = (grid[1:] + grid[:-1]) / 2
    up, down = torch.tensor(math.inf), torch.tensor(-1.0)
    values = torch.cat([grid, mids, mids.nextafter(up), mids.nextafter(down)])
    values = torch.cat([values, -values])
    x = _exact_scale_tensor(values)
    ref = nvfp4_reference(x, 1)
    assert torch.equal(ref["w"][:-1], x.double()[:-1])  # the values reach the rounding unscaled
    packed, _ = _interpret(nv.nvfp4_cast, x, _amax(x), _NO_SEED, "", 0.0, 0.0, 0.0, 1, False, torch.uint8)
    packed_twin, _ = nv.nvfp4_cast_ref(x, _amax(x), _NO_SEED, "", 0.0, 0.0, 0.0, 1, False, torch.uint8)
    assert torch.equal(packed, packed_twin) and torch.equal(packed, pack_codes(ref["codes"]))
    q = nv.unpack_e2m1(packed)[:-1, :15].reshape(-1)[: values.numel()].double()
    assert same_values(q, round_e2m1_reference(values.double()))
    ties = {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0}  # to the even code
    for tie, expected in ties.items():
        assert q[values.double().abs() == tie].abs().tolist() == [expected, expected], tie


def test_nvfp4_zeros_saturation_inf_and_nan():
    zeros = torch.zeros(2, 32)
    packed, scales = nv.nvfp4_cast_ref(zeros, _amax(zeros), _NO_SEED, "", 0.0, 0.0, 0.0, 1, False, torch.uint8)
    assert (packed == 0).all() and (scales.float() == 0).all()
    q, _ = functe.quantize(zeros, functe.NVFP4BlockScaling())
    assert (functe.dequantize(q) == 0).all()
    assert same_values(q.scale_inv, nvfp4_reference(zeros, 1)["global_decode"])  # 1 / FLT_MAX

    x = torch.randn(3, 48) * 5
    x[1, 16:32] = 0.0  # an all-zero block in a non-zero tensor: scale 0, codes 0
    x[2, 40] = math.inf
    for fn in (nv.nvfp4_cast, nv.nvfp4_cast_ref):
        with functe.use_backend("interpret"):
            packed, scales = fn(x, _amax(x), _NO_SEED, "", 0.0, 0.0, 0.0, 1, False, torch.uint8)
        codes = torch.stack([packed & 0xF, packed >> 4], -1).reshape(3, 48)
        assert scales[1, 1].item() == 0.0 and (codes[1, 16:32] == 0).all()
        assert codes[2, 40].item() == 7 and scales[2, 2].item() == 448.0  # inf saturates to 6 * 448
    q, _ = functe.quantize(x, functe.NVFP4BlockScaling())
    deq = functe.dequantize(q)
    assert q.scale_inv.item() == 1.0 and deq[2, 40].item() == 2688.0  # an infinite amax: global encode 1
    ref = nvfp4_reference(x, 1)
    assert same_values(deq, f32_of(ref["deq"]))

    x[0, 3] = math.nan  # a NaN: NaN amax, NaN scales, the whole tensor dequantizes to NaN
    for fn in (nv.nvfp4_cast, nv.nvfp4_cast_ref):
        with functe.use_backend("interpret"):
            packed, scales = fn(x, _amax(x).new_tensor(math.nan), _NO_SEED, "", 0.0, 0.0, 0.0, 1, False, torch.uint8)
        assert scales.float().isnan().all() and packed[0, 1] >> 4 == 0  # NaN's own code (element 3): 0
    q, _ = functe.quantize(x, functe.NVFP4BlockScaling())
    assert functe.dequantize(q).isnan().all()


def test_nvfp4_block_scale_rounding_down_saturates_to_six():
    # block amax 6.3 with global encode 1: s = e4m3(1.05) = 1, so 6.3 * enc = 6.3 > 6 clamps to 6.
    x = torch.zeros(2, 16)
    x[0, 0], x[0, 1], x[1, 0] = 6.3, -6.2, 2688.0
    ref = nvfp4_reference(x, 1)
    packed, scales = nv.nvfp4_cast_ref(x, _amax(x), _NO_SEED, "", 0.0, 0.0, 0.0, 1, False, torch.uint8)
    assert scales[0, 0].item() == 1.0 and torch.equal(packed, pack_codes(ref["codes"]))
    assert (packed[0, 0] & 0xF).item() == 7 and (packed[0, 0] >> 4).item() == 15  # +6 and -6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ACTS)
def test_nvfp4_activation_fusion_equals_activation_then_quantize(act, dtype, backend):
    x = (torch.randn(5, 96) * 3).to(dtype)
    x[0, 0] = 9.0
    recipe = functe.NVFP4BlockScaling()
    q, scale, amax = cast_act_block(x, act, recipe, "input", None, torch.float32)
    v = ops.activation(x, act)
    q_ref, scale_ref, amax_ref = cast_block(v, recipe, "input", None, torch.float32)
    assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref) and torch.equal(amax, amax_ref)
    ref = nvfp4_reference(v, 1)
    assert same_values(q, ref["q"] * _per_element(ref["scales"], v.shape, 1))
    assert same_values(scale, ref["global_encode"]) and same_values(amax, v.abs().max())


# ----------------------------------------------------------------------------- stochastic rounding


def _sr(x: torch.Tensor, seed: int, fn=nv.nvfp4_cast_ref) -> torch.Tensor:
    """E2M1 values of ``x`` (set up by :func:`_exact_scale_tensor`) rounded stochastically."""
    with functe.use_backend("interpret"):
        wide, _ = fn(x, _amax(x), torch.tensor(seed), "", 0.0, 0.0, 0.0, 1, True, torch.float32)
    return wide


@pytest.mark.parametrize("value", [2.4, -0.3, 4.5, 1.1])
def test_stochastic_rounding_is_unbiased(value):
    n = 15 * 1100
    x = _exact_scale_tensor(torch.full((n,), value))
    q = _sr(x, 11)[:-1, :15].reshape(-1).double()
    lo, hi = _neighbours(abs(value))
    p = (abs(value) - lo) / (hi - lo)
    assert set(q.abs().unique().tolist()) == {lo, hi}
    z = (q.mean().item() - value) / ((hi - lo) * math.sqrt(p * (1 - p) / n))
    assert abs(z) < 4.4, f"mean {q.mean().item()} for {value}: z = {z:.2f}"  # two-sided p ~ 1e-5
    rne = nv.nvfp4_cast_ref(x, _amax(x), _NO_SEED, "", 0.0, 0.0, 0.0, 1, False, torch.float32)[0]
    assert abs(rne[:-1, :15].mean().item() - value) > 0.09  # round-to-nearest is biased here: the test can fail


def _neighbours(a: float) -> tuple[float, float]:
    grid = E2M1_GRID.tolist()
    hi = next(g for g in grid if g >= a)
    return grid[grid.index(hi) - 1], hi


def test_stochastic_rounding_follows_the_hash_and_is_reproducible():
    values = torch.cat([torch.linspace(-5.9, 5.9, 45), torch.tensor([-0.0, 0.0])])
    x = _exact_scale_tensor(values)
    seed = 2024
    kernel, twin = _sr(x, seed, nv.nvfp4_cast), _sr(x, seed)
    # (bits: the kernel took -0's sign from v < 0 and gave +0, code 0, where the twin keeps code 8)
    assert _bits_equal(kernel, twin) and torch.equal(twin, _sr(x, seed))
    assert not torch.equal(twin, _sr(x, seed + 1))
    q = twin.double().reshape(-1)
    for i, (w, got) in enumerate(zip(x.double().reshape(-1).tolist(), q.tolist())):
        if i >= 16 * (x.shape[0] - 1):
            break
        if w == 0:  # a zero stays a zero of its sign
            assert got == 0 and math.copysign(1, got) == math.copysign(1, w), (i, w, got)
            continue
        lo, hi = _neighbours(abs(w))
        frac = (abs(w) - lo) / (hi - lo) if hi > lo else 0.0
        up = ((bits_int(seed, i) >> 8) * 2.0**-24) < frac
        assert got == math.copysign(hi if up else lo, w), (i, w, got)


def test_random_bits_match_the_python_oracle():
    seed = torch.tensor(-(2**40) + 17)
    index = torch.tensor([0, 1, 15, 2**31 + 3, 2**32 + 5, 2**40 + 3])
    bits = hadamard.random_bits_ref(seed, index)
    assert [b & 0xFFFFFFFF for b in bits.tolist()] == [bits_int(int(seed), int(i)) for i in index.tolist()]


# ----------------------------------------------------------------------------- random Hadamard transform


@pytest.mark.parametrize("shape", [(3, 48), (2, 5, 16), (0, 32)])
def test_rht_is_the_orthogonal_matrix_and_round_trips(shape):
    seed = 99
    q = rht_q(seed)
    assert torch.equal(q @ q.T, torch.eye(16, dtype=F64))  # orthogonal (exact: entries are ±1/4)
    assert torch.equal(hadamard.rht_matrix(torch.tensor(seed)), q)
    assert torch.equal(sylvester(16) @ sylvester(16), 16 * torch.eye(16, dtype=F64))
    x = torch.randn(shape) * 10
    s = torch.tensor(seed)
    y = _interpret(hadamard.rht16, x, s, False, torch.float32)
    back = _interpret(hadamard.rht16, y, s, True, torch.float32)
    assert torch.equal(y, hadamard.rht16_ref(x, s, False, torch.float32))
    assert torch.equal(back, hadamard.rht16_ref(y, s, True, torch.float32))
    expected = (x.double().reshape(*shape[:-1], shape[-1] // 16, 16) @ q).reshape(shape)
    assert_close(y, expected)
    assert_close(back, x.double())
    if x.numel():  # norms are kept: outliers spread over 16 values instead of growing
        assert_close(y.double().norm(), x.double().norm())


# ----------------------------------------------------------------------------- the twins' CPU fast path


def test_twins_chunked_fast_path_equals_the_whole_tensor_formula():
    """Large eager CPU tensors take the chunked path (cache-sized row chunks on worker threads):
    it must give the same bits as the formula on the whole tensor (as under transforms)."""
    from functe.kernels._fast import CHUNK_ELEMENTS

    x = (torch.randn(301, 520) * 4).to(torch.bfloat16)
    assert x.numel() > CHUNK_ELEMENTS
    mat = x.float()
    for block_rows in (1, 128):
        for out in (E4M3, torch.bfloat16):
            q, s = bq._fp8_block_ref(x, "", 0.0, 0.0, 0.0, E4M3, out, block_rows, True, 0.0)
            q_whole, s_whole = bq._fp8_block_rows(mat, "", 0.0, 0.0, 0.0, E4M3, out, block_rows, True, 0.0)
            assert _bits_equal(q, q_whole) and torch.equal(s, s_whole)
    amax, seed = _amax(x), torch.tensor(31)
    ge, gd = nv.global_scales_ref(amax)
    bits = hadamard.random_bits_ref(seed, torch.arange(x.numel()).view(x.shape))
    for tile_rows, stochastic, out in ((1, True, torch.uint8), (16, False, torch.float32), (1, False, torch.uint8)):
        q, s = nv.nvfp4_cast_ref(x, amax, seed, "", 0.0, 0.0, 0.0, tile_rows, stochastic, out)
        q_whole, s_whole = nv._nvfp4_rows(mat, bits, ge, gd, "", 0.0, 0.0, 0.0, tile_rows, stochastic, out)
        assert torch.equal(q, q_whole) and _bits_equal(s, s_whole)


def test_fast_random_bits_equal_the_reference_across_a_2_32_boundary():
    seed = 12345
    for start in (0, 2**31 - 100, 2**32 - 50, 2**33 + 7):
        fast = hadamard.random_bits_fast(seed, start, 200)
        ref = hadamard.random_bits_ref(torch.tensor(seed), torch.arange(start, start + 200))
        assert torch.equal(fast, ref), start


# ----------------------------------------------------------------------------- dequantize


@pytest.mark.parametrize("qdtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize(("shape", "block_rows"), [((3, 300), 1), ((2, 1, 37), 1), ((130, 200), 128), ((0, 8), 1)])
def test_fp8_block_dequantize_kernel_twin_and_reference(shape, block_rows, qdtype):
    x = _spread(shape, seed=3)
    if x.numel():
        x.view(-1)[1] = math.nan
    cast = bq.fp8_block_cast_2d_ref if block_rows > 1 else lambda x, *a: bq.fp8_block_cast_ref(x, "", 0, 0, 0, *a)
    q, sinv = cast(x, qdtype, qdtype, True, 0.0)
    out = _interpret(bq.fp8_block_dequantize, q, sinv, block_rows, torch.float32)
    out_bf16 = _interpret(bq.fp8_block_dequantize, q, sinv, block_rows, torch.bfloat16)
    twin = bq.fp8_block_dequantize_ref(q, sinv, block_rows, torch.float32)
    _, _, ref = fp8_block_reference(x, block_rows, qdtype)
    assert same_values(out, twin) and same_values(out, ref) and same_values(out_bf16, ref.to(torch.bfloat16))
    every_code = torch.arange(256, dtype=torch.uint8).view(qdtype).reshape(2, 128)  # NaN, ±0, subnormals, max
    ones = torch.ones(2, 1)
    decoded = _interpret(bq.fp8_block_dequantize, every_code, ones, 1, torch.float32)
    assert same_values(decoded, every_code.double())


def test_dequantize_of_2d_blocks_refuses_data_that_is_not_a_matrix():
    # (from a fuzz of the kernels' layouts: 128x128 and 16x16 block scales count the first
    # dimension's rows, the launchers flatten every leading dimension into rows and read past them)
    fp8_args = (torch.zeros(2, 128, 256, dtype=torch.float8_e4m3fn), torch.ones(1, 2), 128, torch.float32)
    nvfp4_scales = torch.ones(1, 2).to(torch.float8_e4m3fn)
    nvfp4_args = (torch.zeros(2, 16, 16, dtype=torch.uint8), nvfp4_scales, torch.tensor(1.0), 16, torch.float32)
    for launcher, twin, args in (
        (bq.fp8_block_dequantize, bq.fp8_block_dequantize_ref, fp8_args),
        (nv.nvfp4_dequantize, nv.nvfp4_dequantize_ref, nvfp4_args),
    ):
        for fn in (launcher, twin):
            with pytest.raises(
                functe.ShapeError,
                match=r"functe.dequantize: argument 'data' expected a matrix .*got values of shape \[2, ",
            ):
                _interpret(fn, *args)


@pytest.mark.parametrize(("shape", "tile_rows"), [((3, 300), 1), ((2, 1, 38), 1), ((40, 50), 16), ((0, 8), 1)])
def test_nvfp4_dequantize_kernel_twin_and_reference(shape, tile_rows):
    x = _spread(shape, seed=4)
    amax = _amax(x)
    packed, scales = nv.nvfp4_cast_ref(x, amax, _NO_SEED, "", 0.0, 0.0, 0.0, tile_rows, False, torch.uint8)
    gd = nv.global_scales_ref(amax)[1]
    out = _interpret(nv.nvfp4_dequantize, packed, scales, gd, tile_rows, torch.float32)
    twin = nv.nvfp4_dequantize_ref(packed, scales, gd, tile_rows, torch.float32)
    ref = nvfp4_reference(x, tile_rows)
    assert same_values(out, twin) and same_values(out, f32_of(ref["deq"]))
    every_code = torch.arange(256, dtype=torch.uint8).reshape(1, 256)  # all nibble pairs, NaN block scales
    nan_scales = torch.tensor([[1.0] * 31 + [math.nan]]).to(torch.float8_e4m3fn)
    decoded = _interpret(nv.nvfp4_dequantize, every_code, nan_scales, torch.tensor(0.5), 1, torch.float32)
    assert same_values(decoded, nv.nvfp4_dequantize_ref(every_code, nan_scales, torch.tensor(0.5), 1, torch.float32))
    assert decoded[0, -16:].isnan().all() and decoded[0, :2].tolist() == [0.0, 0.0] and decoded[0, 2].item() == 0.25


def test_launchers_take_non_contiguous_and_stride_0_inputs():
    row = torch.randn(1, 160)
    for x in (row.expand(6, 160), torch.randn(160, 6).t()):  # stride 0 (a .sum() gradient), transposed
        fp8 = _interpret(bq.fp8_block_cast, x, "", 0.0, 0.0, 0.0, E4M3, torch.float32, True, 0.0)
        fp4 = _interpret(nv.nvfp4_cast, x, _amax(x), _NO_SEED, "", 0.0, 0.0, 0.0, 1, True, torch.uint8)
        rht = _interpret(hadamard.rht16, x, _NO_SEED, False, torch.float32)
        c = x.contiguous()
        assert torch.equal(fp8[0], bq.fp8_block_cast_ref(c, "", 0.0, 0.0, 0.0, E4M3, torch.float32, True, 0.0)[0])
        assert torch.equal(fp4[0], nv.nvfp4_cast_ref(c, _amax(c), _NO_SEED, "", 0.0, 0.0, 0.0, 1, True, torch.uint8)[0])
        assert torch.equal(rht, hadamard.rht16_ref(c, _NO_SEED, False, torch.float32))


@pytest.mark.parametrize("shape", [(4, 40), (37, 1), (3, 130)])
def test_twins_return_dense_outputs_like_their_launchers(shape):
    # A twin is its kernel's fake implementation under torch.compile, and the launchers return dense
    # tensors: the twins returned a strided view of their zero-padded block buffer when a dim was
    # not a whole number of blocks (compile asserted on the strides; a [N,1] input kept an [N,128]
    # buffer alive).
    x, g = torch.randn(shape), torch.randn(shape[-1])
    outputs = {
        "fp8_block_cast": bq.fp8_block_cast_ref(x, "", 0.0, 0.0, 0.0, E4M3, torch.float32, True, 0.0),
        "fp8_block_cast gelu": bq.fp8_block_cast_ref(x, "gelu", 0.0, 0.0, 0.0, E4M3, torch.float32, True, 0.0),
        "fp8_block_cast_2d": bq.fp8_block_cast_2d_ref(x, E4M3, torch.float32, True, 0.0),
        "fp8_block_act_cast_keep": bq.fp8_block_act_cast_keep_ref(
            x, "gelu", 0.0, 0.0, 0.0, E4M3, torch.float32, True, 0.0
        ),
        "nvfp4_cast": nv.nvfp4_cast_ref(x, _amax(x), _NO_SEED, "", 0.0, 0.0, 0.0, 1, False, torch.float32),
        "nvfp4_cast 16x16": nv.nvfp4_cast_ref(x, _amax(x), _NO_SEED, "", 0.0, 0.0, 0.0, 16, False, torch.float32),
        "norm_fp8_block_cast": nbq.norm_fp8_block_cast_ref(
            x, g, g, 1e-5, "layer", False, E4M3, torch.float32, True, 0.0
        ),
        "norm_nvfp4_cast": nbq.norm_nvfp4_cast_ref(x, g, g, _amax(x), 1e-5, "layer", False, torch.float32),
    }
    for name, out in outputs.items():
        for t in (o for o in out if isinstance(o, torch.Tensor)):
            assert t.is_contiguous(), (name, t.shape, t.stride())
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), (name, t.shape)
