"""The shared activation math: Triton device functions vs PyTorch twins vs float64 formulas."""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

import functe
from functe.kernels import _act
from functe.kernels._triton import jit
from functe.testing import assert_close


@jit
def _probe_kernel(X, Y, D, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask)
    tl.store(Y + offs, _act.act_fwd(x, ACT), mask=mask)
    tl.store(D + offs, _act.act_grad(x, ACT), mask=mask)


@jit
def _probe_clamped_kernel(A, B, Y, DA, DB, n, limit, alpha, offset, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(A + offs, mask=mask)
    b = tl.load(B + offs, mask=mask)
    tl.store(Y + offs, _act.clamped_swiglu_fwd(a, b, limit, alpha, offset), mask=mask)
    da, db = _act.clamped_swiglu_grads(a, b, limit, alpha, offset)
    tl.store(DA + offs, da, mask=mask)
    tl.store(DB + offs, db, mask=mask)


def _formula(x: torch.Tensor, name: str) -> torch.Tensor:
    """f written from the textbook definitions, in float64, differentiated by autograd."""
    sig = torch.sigmoid
    forms = {
        "gelu": lambda x: 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))),
        "qgelu": lambda x: x * sig(1.702 * x),
        "relu": torch.relu,
        "srelu": lambda x: torch.relu(x) ** 2,
        "silu": lambda x: x * sig(x),
        "sigmoid": sig,
    }
    return forms[name](x)


POINTS = torch.tensor([-30.0, -8.0, -3.0, -1.0, -0.5, -1e-3, 0.0, 1e-3, 0.5, 1.0, 3.0, 8.0, 30.0])


@pytest.mark.parametrize("name", list(_act.ACTIVATIONS))
def test_device_functions_match_twins_and_formulas(name):
    x = torch.cat([POINTS, torch.randn(50) * 4]).to(torch.float32)
    y, d = torch.empty_like(x), torch.empty_like(x)
    with functe.use_backend("interpret"):
        _probe_kernel[(1,)](x, y, d, x.numel(), ACT=_act.ACTIVATIONS[name], BLOCK=triton.next_power_of_2(x.numel()))
    x64 = x.double().requires_grad_()
    f64 = _formula(x64, name)
    (d64,) = torch.autograd.grad(f64.sum(), x64)
    assert_close(y, _act.act_fwd_ref(x, name))
    assert_close(d, _act.act_grad_ref(x, name))
    # TE's gelu constants are rounded to 8 digits: compare with the textbook form at fp32's tolerance.
    assert_close(y, f64)
    assert_close(d, d64)


@pytest.mark.parametrize("name", list(_act.ACTIVATIONS))
def test_extremes_are_finite_limits_and_nan_propagates(name):
    x = torch.tensor([float("inf"), -float("inf"), float("nan"), 1e30, -1e30])
    y, d = torch.empty_like(x), torch.empty_like(x)
    with functe.use_backend("interpret"):
        _probe_kernel[(1,)](x, y, d, 5, ACT=_act.ACTIVATIONS[name], BLOCK=8)
    ref_y, ref_d = _act.act_fwd_ref(x, name), _act.act_grad_ref(x, name)
    assert y[2].isnan() and ref_y[2].isnan()
    if name in ("relu", "srelu"):  # TE's literal piecewise derivatives: x > 0 is False for NaN
        assert d[2] == 0 and ref_d[2] == 0
    else:
        assert d[2].isnan() and ref_d[2].isnan()
    # +-inf inputs: kernel and twin agree wherever the twin is not NaN (0*inf forms).
    finite = ~ref_y.isnan()
    assert torch.equal(y[finite], ref_y[finite]), (y, ref_y)
    finite = ~ref_d.isnan()
    assert_close(d[finite], ref_d[finite])


def test_clamped_swiglu_device_functions():
    a = torch.cat([torch.randn(40) * 6, torch.tensor([7.0, 7.5, -7.5, 0.0])])
    b = torch.cat([torch.randn(40) * 6, torch.tensor([7.0, -7.0, 8.0, -9.0])])
    y, da, db = (torch.empty_like(a) for _ in range(3))
    with functe.use_backend("interpret"):
        _probe_clamped_kernel[(1,)](a, b, y, da, db, a.numel(), 7.0, 1.702, 1.0, BLOCK=64)
    assert_close(y, _act.clamped_swiglu_fwd_ref(a, b, 7.0, 1.702, 1.0))
    ref_da, ref_db = _act.clamped_swiglu_grads_ref(a, b, 7.0, 1.702, 1.0)
    assert_close(da, ref_da)
    assert_close(db, ref_db)
    a64, b64 = a.double().requires_grad_(), b.double().requires_grad_()
    ac = torch.clamp(a64, max=7.0)
    y64 = ac * torch.sigmoid(1.702 * ac) * (torch.clamp(b64, -7.0, 7.0) + 1.0)
    ga, gb = torch.autograd.grad(y64.sum(), (a64, b64))
    assert_close(y, y64)
    assert_close(da, ga)
    assert_close(db, gb)
