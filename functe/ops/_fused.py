"""Fused ops: what the fusion rules (``functe.rules``) rewrite runs of core ops into.

Each is a :func:`functe.custom_vjp` op usable on its own, and each follows
TransformerEngine's equivalence contract (docs/fusion.md), which is what lets
the executor choose the forward and the backward plan independently:

* a **forward** fusion computes the covered ops' forward in fewer passes and
  returns exactly the residuals their own forward rules return (a tuple, one
  entry per covered op, in program order); its backward rule is the unfused
  chain of the covered ops' backward rules;
* a **backward** fusion consumes those unfused residuals and computes the
  covered ops' backward in fewer passes; its forward rule is the unfused chain.

The GEMMs go through ``torch.addmm``, so the accumulation and the scale
happen inside the GEMM (one rounding to the output dtype). On CUDA the same
path runs until the Triton GEMM epilogues of issue 6 replace it.
"""

from __future__ import annotations

import torch

from .._vjp import custom_vjp
from ..kernels.elementwise import AXPBY, BIAS_GRAD
from ._core import _add_bwd, _bias_bwd, _linear_bwd, _linear_fwd, _scale_bwd, _scale_fwd

Tensor = torch.Tensor


def _rows(t: Tensor) -> Tensor:
    """``t`` as a 2-D ``(rows, features)`` tensor (a view when possible)."""
    return t.reshape(-1, t.shape[-1]) if t.dim() > 0 else t.reshape(1, 1)


def _linear_residuals(x: Tensor, weight: Tensor, has_bias: bool):
    """The residuals ``linear``'s own forward rule returns (see ``_core._linear_fwd``)."""
    return (x, weight, has_bias)


# ----------------------------------------------------------------------------- forward: linear (+bias) (+scale) + add


def _forward_linear_add_fwd(x, weight, bias, extra, *, scale, bias_op):
    s = 1.0 if scale is None else scale
    if bias is None:
        # y = s·x·Wᵀ + extra: the GEMM accumulates into the residual (beta = 1, alpha = s), one rounding.
        y = torch.addmm(_rows(extra), _rows(x), weight.t(), alpha=s)
    else:
        # With a bias, torch has no GEMM with both a bias and an accumulator: the bias epilogue
        # first, then one pass y = extra + s·h. That rounds h once, never more often than the
        # unfused chain (rounding extra + s·b first instead could cancel where it does not).
        y = torch.add(_rows(extra), torch.addmm(bias, _rows(x), weight.t()), alpha=s)
    # Residuals of the covered ops: linear, [bias], [constant_scale], add_extra_input.
    lin = _linear_residuals(x, weight, bias is not None and not bias_op)
    return y.view(extra.shape), (lin, *([None] * (1 + bias_op + (scale is not None))))


def _forward_linear_add_bwd(res, dy, *, scale, bias_op):
    # The unfused chain, backwards: add_extra_input, [constant_scale], [bias], linear.
    d_out, d_extra = _add_bwd(None, dy)
    if scale is not None:
        (d_out,) = _scale_bwd(None, d_out, scale=scale)
    d_bias = None
    if bias_op:
        d_out, d_bias = _bias_bwd(None, d_out)
    dx, dweight, d_lin_bias = _linear_bwd(res[0], d_out)
    return dx, dweight, d_bias if bias_op else d_lin_bias, d_extra


forward_linear_add = custom_vjp("forward_linear_add", _forward_linear_add_fwd, _forward_linear_add_bwd)
"""``y = scale·(x·Wᵀ + bias) + extra``: one GEMM accumulating into ``extra`` (a bias adds one pass on CPU).

Static ``scale`` (``None``: no ``constant_scale`` op was covered) and
``bias_op`` (the bias came from a separate ``bias`` op, not from ``linear``)
fix the residual layout of the covered ops:
``linear [, bias] [, constant_scale], add_extra_input``.
"""


# ----------------------------------------------------------------------------- backward: make_extra_output -> linear


def _backward_linear_add_fwd(x, weight, bias):
    # Unfused forward: (x, x) = make_extra_output(x); y = linear(x, weight, bias).
    y, lin = _linear_fwd(x, weight, bias)
    return (x, y), (None, lin)


def _backward_linear_add_bwd(res, cts):
    # dx = d_extra + dy·W: the dgrad GEMM accumulates into the extra output's gradient (beta = 1).
    _, (x, weight, has_bias) = res
    d_extra, dy = cts
    if dy is None:
        return d_extra, None, None
    dy2 = _rows(dy)
    if d_extra is None:
        dx = torch.matmul(dy, weight)
    else:
        dx = torch.addmm(_rows(d_extra), dy2, weight).view(x.shape)
    dweight = torch.matmul(dy2.t(), _rows(x))
    return dx, dweight, BIAS_GRAD(dy) if has_bias else None


backward_linear_add = custom_vjp(
    "backward_linear_add", _backward_linear_add_fwd, _backward_linear_add_bwd, symbolic_zeros=True
)
"""``(extra, y) = (x, linear(x, weight, bias))``: a forked residual feeding a linear.

Its backward runs the dgrad GEMM accumulating into the extra output's
gradient; covers ``make_extra_output, linear``.
"""


# ----------------------------------------------------------------------------- backward: linear -> constant_scale


def _backward_linear_scale_fwd(x, weight, bias, *, scale):
    h, lin = _linear_fwd(x, weight, bias)
    y, _ = _scale_fwd(h, scale=scale)
    return y, (lin, None)


def _backward_linear_scale_bwd(res, dy, *, scale):
    # dx = s·dy·W and dW = s·dyᵀ·x: the scale is the alpha of both GEMMs.
    (x, weight, has_bias), _ = res
    dy2 = _rows(dy)
    zero = dy.new_zeros(())  # ignored: beta = 0
    dx = torch.addmm(zero, dy2, weight, beta=0, alpha=scale).view(*x.shape[:-1], weight.shape[1])
    dweight = torch.addmm(zero, dy2.t(), _rows(x), beta=0, alpha=scale)
    dbias = AXPBY(BIAS_GRAD(dy), None, scale, 0.0) if has_bias else None
    return dx, dweight, dbias


backward_linear_scale = custom_vjp("backward_linear_scale", _backward_linear_scale_fwd, _backward_linear_scale_bwd)
"""``y = scale·linear(x, weight, bias)``; its backward puts ``scale`` into both GEMMs.

Covers ``linear, constant_scale``.
"""

__all__ = ["backward_linear_add", "backward_linear_scale", "forward_linear_add"]
