"""The fused norm + block cast kernels (FP8 block scaling 1x128, NVFP4 1x16) behind the block q-in rule.

Compared *bit for bit* with the unfused pair they replace (the norm kernel, then the block cast kernel)
on the Triton kernels (interpreted) and on the twins, and against the float64 references of
``block_helpers`` (TE's formulas) applied to the stored norm output.
"""

from __future__ import annotations

import pytest
import torch
from act_helpers import layer_norm as ln_ref
from act_helpers import rms_norm as rms_ref
from block_helpers import fp8_block_reference, nvfp4_reference
from helpers import make

import functe
from functe._block_quantize import cast_block, cast_norm_block, operand_dtype
from functe.kernels import norm as nk
from functe.kernels import norm_block_quantize as nbq
from functe.kernels.block_quantize import FP8_BLOCK_CAST
from functe.kernels.norm_quantize import NORM_CAST_AMAX
from functe.kernels.nvfp4 import NVFP4_CAST
from functe.testing import assert_close

E4M3 = torch.float8_e4m3fn
BF16 = torch.bfloat16
FP8B, NVFP4 = functe.Float8BlockScaling(), functe.NVFP4BlockScaling()
NO_SEED = torch.zeros((), dtype=torch.int64)


def _bits_equal(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _args(kind, shape, dtype):
    x = make(shape, dtype, scale=3.0) + 0.5
    return x, make(shape[-1:], dtype), (make(shape[-1:], dtype) if kind == "layer" else None)


def _norm(kind, x, w, b, zc):
    if kind == "layer":
        return nk.LAYER_NORM(x, w, b, 1e-5, zc)
    return nk.RMS_NORM(x, w, 1e-5, zc), None, None


def _amax(x, w, b, kind, zc):
    one = torch.ones(())
    return NORM_CAST_AMAX(x, w, b, one, 1e-5, kind, zc, E4M3, E4M3, False)[3]


@pytest.mark.parametrize("kind", nbq.KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_norm_block_casts_equal_norm_then_block_cast_bit_for_bit(backend, kind, dtype):
    shapes = [(4, 128), (3, 300), (2, 3, 17), (0, 16)]  # whole, partial and sub-block rows; 0 rows
    for shape in shapes:
        for zc in (False, True):
            x, w, b = _args(kind, shape, dtype)
            what = f"{kind} {shape} zc={zc}"
            y, mean, rstd = _norm(kind, x, w, b, zc)
            for out in (E4M3, operand_dtype(FP8B, dtype)):  # float8 bits, or the dequantized GEMM operand
                q1, s1 = FP8_BLOCK_CAST(y, "", 0.0, 0.0, 0.0, E4M3, out, True, 0.0)
                y2, q2, s2, mean2, rstd2 = nbq.NORM_FP8_BLOCK_CAST(x, w, b, 1e-5, kind, zc, E4M3, out, True, 0.0)
                assert _bits_equal(y, y2) and _bits_equal(q1, q2) and _bits_equal(s1, s2), what
                if kind == "layer":  # LayerNorm's statistics: the unfused kernel's bits
                    assert _bits_equal(mean, mean2) and _bits_equal(rstd, rstd2), what
                else:
                    assert mean2.shape == rstd2.shape == (0,), what
            amax = _amax(x, w, b, kind, zc)
            out = operand_dtype(NVFP4, dtype)
            q1, s1 = NVFP4_CAST(y, amax, NO_SEED, "", 0.0, 0.0, 0.0, 1, False, out)
            y2, q2, s2, mean2, _ = nbq.NORM_NVFP4_CAST(x, w, b, amax, 1e-5, kind, zc, out)
            assert _bits_equal(y, y2) and _bits_equal(q1, q2) and _bits_equal(s1, s2), what
            assert kind == "rms" or _bits_equal(mean, mean2), what


@pytest.mark.parametrize("kind", nbq.KINDS)
def test_norm_block_casts_against_float64_references(kind):
    x, w, b = _args(kind, (6, 160), BF16)
    x64, w64 = x.double(), w.double()
    y64 = ln_ref(x64, w64, b.double(), 1e-5, True) if kind == "layer" else rms_ref(x64, w64, 1e-5, True)
    for backend in ("torch", "interpret"):
        with functe.use_backend(backend):
            y, q, scale_inv, _, _ = nbq.NORM_FP8_BLOCK_CAST(x, w, b, 1e-5, kind, True, E4M3, torch.float32, True, 0.0)
            amax = _amax(x, w, b, kind, True)
            y_n, q_n, scales, _, _ = nbq.NORM_NVFP4_CAST(x, w, b, amax, 1e-5, kind, True, torch.float32)
        assert_close(y, y64, dtype=BF16)
        assert torch.equal(y_n, y)
        # The references quantize the norm's output as stored (its row sums may differ from float64 by an ulp).
        stored = y
        _, s_ref, deq_ref = fp8_block_reference(stored, 1, E4M3)
        assert torch.equal(scale_inv.double(), s_ref) and torch.equal(q.double(), deq_ref), backend
        ref = nvfp4_reference(stored.float(), 1)
        assert torch.equal(scales.double(), ref["scales"]), backend
        assert torch.equal(q_n.double(), ref["q"] * ref["scales"].repeat_interleave(16, -1)[:, :160]), backend


def test_norm_block_casts_special_values_and_layouts():
    x, w, b = _args("layer", (5, 144), torch.float32)
    x[1, 3] = float("nan")
    strided = make((48, 6)).t()  # non-contiguous rows of 48
    for backend in ("torch", "interpret"):
        with functe.use_backend(backend):
            _, q, s, mean, _ = nbq.NORM_FP8_BLOCK_CAST(x, w, b, 1e-5, "layer", False, E4M3, torch.float32, True, 0.0)
            assert q[1].isnan().all() and not q[[0, 2, 3, 4]].isnan().any() and mean[1].isnan()
            assert (s[1] == 1).all()  # a NaN block: scale 1 (the NaN stays NaN)
            amax = _amax(x, w, b, "layer", False)
            _, q_n, _, _, _ = nbq.NORM_NVFP4_CAST(x, w, b, amax, 1e-5, "layer", False, torch.float32)
            assert amax.isnan() and q_n.isnan().all()  # NVFP4: a NaN amax makes every scale NaN (TE's reference)
            a = nbq.NORM_FP8_BLOCK_CAST(strided, w[:48], None, 1e-5, "rms", False, E4M3, E4M3, True, 0.0)
            c = nbq.NORM_FP8_BLOCK_CAST(strided.contiguous(), w[:48], None, 1e-5, "rms", False, E4M3, E4M3, True, 0.0)
            assert _bits_equal(a[1], c[1]) and _bits_equal(a[2], c[2])  # q, scale_inv
            assert_close(a[0], c[0])  # (the RMSNorm twin's strided path may round the row sum differently)


@pytest.mark.parametrize("recipe", [FP8B, NVFP4], ids=["fp8_block", "nvfp4"])
def test_cast_norm_block_equals_norm_then_cast_block(recipe):
    x, w, b = _args("layer", (7, 48), BF16)
    dtype = operand_dtype(recipe, BF16)
    y, mean, rstd = nk.LAYER_NORM(x, w, b, 1e-5, False)
    q1, s1, a1 = cast_block(y, recipe, "input", None, dtype)
    y2, q2, s2, a2, (mean2, rstd2) = cast_norm_block(x, w, b, "layer", 1e-5, False, recipe, "input", None, dtype)
    assert _bits_equal(y, y2) and _bits_equal(q1, q2) and _bits_equal(mean, mean2) and _bits_equal(rstd, rstd2)
    assert (s1 is None and s2 is None) if recipe is FP8B else (torch.equal(s1, s2) and torch.equal(a1, a2))
    with pytest.raises(functe.FuncteError, match="norms feed a GEMM as its"):
        cast_norm_block(x, w, b, "layer", 1e-5, False, recipe, "weight", None, dtype)


@pytest.mark.parametrize("zc", [False, True])
def test_layer_norm_without_bias_runs_on_both_backends_alike(zc):
    # The Triton kernels take bias=None (HAS_B=False); the LayerNorm twin raised AttributeError
    # ('NoneType' has no attribute 'to') with zero_centered_gamma or a 16-bit x.
    for dtype in (torch.float32, BF16):
        x, w, _ = _args("layer", (3, 32), dtype)
        got = {}
        for backend in ("torch", "interpret"):
            with functe.use_backend(backend):
                y, _, _ = nk.LAYER_NORM(x, w, None, 1e-5, zc)
                block = nbq.NORM_FP8_BLOCK_CAST(x, w, None, 1e-5, "layer", zc, E4M3, torch.float32, True, 0.0)
            got[backend] = y
            assert_close(block[0], y)
        x64 = x.double()
        w64 = (1.0 + w.double()) if zc else w.double()
        y64 = (x64 - x64.mean(-1, keepdim=True)) / torch.sqrt(x64.var(-1, unbiased=False, keepdim=True) + 1e-5) * w64
        for backend, y in got.items():
            assert_close(y, y64, dtype=dtype, msg=f"{backend} {dtype}")
