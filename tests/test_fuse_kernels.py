"""Kernels behind the phase-2 fusions: norm + FP8 cast, rounded activation casts, dact + dbias, and the
norm backward that adds a residual's gradient.

Fused quantizing kernels are compared *bit for bit* with the unfused pair they replace (norm then
cast, activation then cast, dactivation then dbias-cast), on the Triton kernels (interpreted) and on
the twins, and against float64 formulas within the FP8 tolerance.
"""

from __future__ import annotations

import pytest
import torch
from act_helpers import UNARY
from act_helpers import layer_norm as ln_ref
from act_helpers import rms_norm as rms_ref
from fp8_helpers import FP8, quantize_ref, same_values
from helpers import F64, check_kernel, make

import functe
from functe._quantize import cast, cast_norm
from functe.kernels import norm as nk
from functe.kernels import norm_quantize as nq
from functe.kernels import quantize as qk
from functe.kernels.activation import ACTIVATION, DACTIVATION
from functe.kernels.elementwise import BIAS_GRAD
from functe.testing import assert_close

E4M3, E5M2 = FP8
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BACKENDS = ["torch", "interpret"]
RECIPES = [functe.DelayedScaling(amax_history_len=4), functe.CurrentScaling()]


def _bits_equal(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _norm_args(kind, shape, dtype, *, zero_centered=False):
    x = make(shape, dtype, scale=3.0) + 0.5
    w, b = make(shape[-1:], dtype), make(shape[-1:], dtype)
    return x, w, (b if kind == "layer" else None), zero_centered


def _unfused_norm(kind, x, w, b, eps, zc):
    """``(y, stats)``: LayerNorm's ``(mean, rstd)`` or RMSNorm's ``()``."""
    if kind == "layer":
        y, mean, rstd = nk.LAYER_NORM(x, w, b, eps, zc)
        return y, (mean, rstd)
    return nk.RMS_NORM(x, w, eps, zc), ()


def _stats64(x64, eps=1e-5):
    """LayerNorm's (mean, rstd) in float64."""
    mean = x64.mean(-1)
    return mean, torch.rsqrt(((x64 - mean[..., None]) ** 2).mean(-1) + eps)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", nq.KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_cast_equals_norm_then_cast_bit_for_bit(backend, kind, dtype):
    shapes = [(37, 40), (2, 3, 17), (0, 8)] if backend == "torch" else [(9, 40), (2, 3, 17), (0, 8)]
    for shape in shapes:
        for recipe in RECIPES:
            for zc in (False, True):
                x, w, b, _ = _norm_args(kind, shape, dtype)
                scale = torch.tensor(5.0)
                with functe.use_backend(backend):
                    y, stats1 = _unfused_norm(kind, x, w, b, 1e-5, zc)
                    q1, s1, a1 = cast(y.reshape(-1, y.shape[-1]), recipe, "input", scale, E4M3)
                    q2, s2, a2, stats2 = cast_norm(
                        x.reshape(-1, shape[-1]), w, b, kind, 1e-5, zc, recipe, "input", scale, E4M3
                    )
                what = f"{kind} {shape} {type(recipe).__name__} zc={zc}"
                assert _bits_equal(q1, q2), what
                assert torch.equal(a1, a2) and torch.equal(s1, s2), what
                assert len(stats1) == len(stats2) == (2 if kind == "layer" else 0), what
                for u, f in zip(stats1, stats2):  # LayerNorm's statistics: the unfused kernel's bits
                    assert _bits_equal(u.reshape(-1), f), what


@pytest.mark.parametrize("qdtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("kind", nq.KINDS)
def test_norm_cast_against_float64_and_twin(kind, qdtype):
    x, w, b, _ = _norm_args(kind, (21, 48), torch.bfloat16)
    scale = torch.tensor(40.0)
    args = (x, w, b, scale, 1e-5, kind, True, qdtype)
    with functe.use_backend("interpret"):
        q, mean, rstd, amax = nq.norm_cast_amax(*args, qdtype, True)
        q_wide, _, _, amax_only = nq.norm_cast_amax(*args, torch.bfloat16, True)
        empty, mean_nowrite, _, amax_nowrite = nq.norm_cast_amax(*args, qdtype, False)
    q_twin, mean_twin, rstd_twin, amax_twin = nq.norm_cast_amax_ref(*args, qdtype, True)
    x64, w64 = x.double(), w.double()
    if kind == "layer":
        for got in ((mean, rstd), (mean_twin, rstd_twin)):
            for g, e in zip(got, _stats64(x64)):
                assert g.dtype == torch.float32 and g.shape == (21,)
                assert_close(g, e)
        assert torch.equal(mean_nowrite, mean)
    else:
        assert mean.shape == rstd.shape == mean_twin.shape == (0,)
    y64 = ln_ref(x64, w64, b.double(), 1e-5, True) if kind == "layer" else rms_ref(x64, w64, 1e-5, True)
    # The reference quantizes the float64 norm rounded to bf16 (what the unfused norm stores).
    y_stored = y64.to(torch.bfloat16)
    assert same_values(q_twin.float(), quantize_ref(y_stored, scale, qdtype))
    assert_close(q.double() / 40.0, y64, dtype=qdtype)  # Triton vs the formula (the rows' sums may differ by ulps)
    assert same_values(q_wide.float(), q.float())  # wide storage holds the same grid values
    assert empty.numel() == 0 and amax_nowrite.item() == amax.item() == amax_only.item()
    assert_close(amax, y_stored.abs().max().float(), dtype=torch.bfloat16)
    assert_close(amax_twin, amax, dtype=torch.bfloat16)


def test_norm_cast_special_values_and_layouts():
    x = make((6, 16), torch.float32)
    x[1, 3] = float("nan")
    w, b = make((16,)), make((16,))
    one = torch.tensor(1.0)
    strided = make((12, 16)).t()  # non-contiguous input, rows of 12
    for backend in BACKENDS:
        with functe.use_backend(backend):
            q, mean, rstd, amax = nq.NORM_CAST_AMAX(x, w, b, one, 1e-5, "layer", False, E4M3, E4M3, True)
            assert amax.isnan() and q[1].float().isnan().all() and not q[0].float().isnan().any()
            assert mean[1].isnan() and rstd[1].isnan() and not (mean[0].isnan() or rstd[0].isnan())
            q2, _, _, a2 = nq.NORM_CAST_AMAX(strided, w[:12], None, one, 1e-5, "rms", False, E5M2, E5M2, True)
            q3, _, _, a3 = nq.NORM_CAST_AMAX(
                strided.contiguous(), w[:12], None, one, 1e-5, "rms", False, E5M2, E5M2, True
            )
            assert _bits_equal(q2, q3) and torch.equal(a2, a3)
        big = torch.full((2, 8), 1e4)  # a constant row normalises to 0 (then β): amax = max|β|
        _, mean, rstd, a4 = nq.NORM_CAST_AMAX(big, w[:8], b[:8], one, 1e-5, "layer", False, E4M3, E4M3, True)
        assert a4.item() == pytest.approx(b[:8].abs().max().item())
        assert mean.tolist() == [1e4, 1e4] and rstd.tolist() == pytest.approx([1e-5**-0.5] * 2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rounded_activation_casts_equal_the_unfused_pairs(backend, dtype):
    x, dy = make((13, 24), dtype, scale=3.0), make((13, 24), dtype)
    scale = torch.tensor(7.0)
    with functe.use_backend(backend):
        for act in ("gelu", "relu", "srelu", "swiglu", "clamped_swiglu"):
            params = (7.0, 1.702, 1.0) if act == "clamped_swiglu" else (0.0, 0.0, 0.0)
            y = ACTIVATION(x, act, 0, *params)
            for write in (True, False):
                q1, a1 = qk.CAST_AMAX(y, scale, E4M3, E4M3, write)
                q2, a2 = qk.ACT_OUTPUT_CAST_AMAX(x, scale, act, *params, E4M3, E4M3, write)
                assert _bits_equal(q1, q2) and torch.equal(a1, a2), f"{act} write={write}"
        for act in ("gelu", "qgelu", "relu", "srelu", "silu", "sigmoid"):
            g = DACTIVATION(dy, x, act, 0, 0.0, 0.0, 0.0)
            q1, d1, a1 = qk.DBIAS_CAST_AMAX(g, scale, E5M2, torch.bfloat16, True)
            q2, d2, a2 = qk.DACT_OUTPUT_DBIAS_CAST_AMAX(dy, x, scale, act, E5M2, torch.bfloat16, True)
            assert torch.equal(q1, q2) and torch.equal(d1, d2) and torch.equal(a1, a2), act
            g2, d3 = qk.DACT_DBIAS(dy, x, act)
            assert torch.equal(g, g2), act
            assert_close(d3, BIAS_GRAD(g), msg=act)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", ["gelu", "relu"])
def test_dact_dbias_against_float64(act, dtype):
    for shape in [(37, 5), (2, 3, 17), (0, 6)]:
        x, dy = make(shape, dtype), make(shape, dtype)

        def reference(dy, x, act):
            xr = x.clone().requires_grad_()
            (g,) = torch.autograd.grad(UNARY[act](xr), xr, dy)
            return g, g.reshape(-1, g.shape[-1]).sum(0)

        check_kernel(qk.DACT_DBIAS, (dy, x, act), reference)


def _norm_bwd_args(kind, dy, x, w, accum, zc):
    """Arguments of the norm backward kernels (LayerNorm's take the forward's statistics, here the
    twin's whatever the backend, and no eps)."""
    if kind == "layer":
        _, mean, rstd = nk.layer_norm_ref(x, w, w, 1e-5, zc)
        return (dy, x, mean, rstd, w, *accum, zc)
    return (dy, x, w, *accum, 1e-5, zc)


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, F64])
def test_norm_backward_with_an_added_residual_gradient(kind, dtype):
    kernel = nk.LAYER_NORM_BWD_ADD if kind == "layer" else nk.RMS_NORM_BWD_ADD
    plain = nk.LAYER_NORM_BWD if kind == "layer" else nk.RMS_NORM_BWD
    for shape in [(37, 20), (2, 3, 9), (0, 7)]:
        x, dy, acc = make(shape, dtype), make(shape, dtype), make(shape, dtype)
        w = make(shape[-1:], dtype)

        def reference(dy, x, *rest):
            # (LayerNorm's statistics among the arguments are those of x: the formula recomputes them)
            w, acc, zc = (rest[2], rest[3], rest[4]) if kind == "layer" else (rest[0], rest[1], rest[3])
            xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
            if kind == "layer":
                br = torch.zeros_like(w).requires_grad_()
                grads = torch.autograd.grad(ln_ref(xr, wr, br, 1e-5, zc), (xr, wr, br), dy)
            else:
                grads = torch.autograd.grad(rms_ref(xr, wr, 1e-5, zc), (xr, wr), dy)
            return (grads[0] + acc, *grads[1:])

        for zc in (False, True):
            out = check_kernel(kernel, _norm_bwd_args(kind, dy, x, w, (acc,), zc), reference)
            with functe.use_backend("interpret"):
                unfused = plain(*_norm_bwd_args(kind, dy, x, w, (), zc))
            if dtype != torch.bfloat16:  # (in bf16, rounding dx before the add can cancel: see float64 above)
                assert_close(out[0], unfused[0] + acc)
            assert all(torch.equal(a, b) for a, b in zip(out[1:], unfused[1:]))  # dγ, dβ: the same kernel's
    # the CPU fast path (large rows) agrees with the twin's reference path
    x, dy, acc, w = (
        make((300, 700), torch.bfloat16),
        make((300, 700), torch.bfloat16),
        make((300, 700), torch.bfloat16),
        make((700,), torch.bfloat16),
    )
    args = _norm_bwd_args(kind, dy, x, w, (acc,), False)
    fast = kernel.twin(*args)
    with torch.enable_grad():
        slow = kernel.twin(*(a.detach().requires_grad_() if a is w else a for a in args))
    for f, s in zip(fast, slow):
        assert_close(f, s.detach())
