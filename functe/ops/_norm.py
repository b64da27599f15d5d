"""Normalization ops: LayerNorm, RMSNorm and L2 normalization over the last dimension.

The forward rules run the norm kernels; the backward rules run the matching
backward kernels. No op keeps an intermediate result, so second derivatives are
exact: the LayerNorm op (``_layer_norm``) returns its row statistics ``mean`` and
``rstd`` as *outputs* next to ``y`` and saves them as such (its backward kernel
takes them, TransformerEngine's contract); RMSNorm and L2 normalization
recompute r from ``x``. ``dγ`` and ``dβ`` are reduced in fp32, deterministically.
See ``docs/activations.md``.
"""

from __future__ import annotations

import torch

from .._errors import (
    check_flag,
    check_number,
    check_same_device,
    check_same_dtype,
    check_tensor,
    describe_shape,
    shape_error,
)
from .._vjp import custom_vjp
from ..kernels.norm import (
    L2_NORMALIZE,
    L2_NORMALIZE_BWD,
    LAYER_NORM,
    LAYER_NORM_BWD,
    RMS_NORM,
    RMS_NORM_BWD,
)
from ._cast import autocast_inputs

Tensor = torch.Tensor


def _check(op: str, x: Tensor, params: dict[str, Tensor], eps) -> float:
    check_tensor(op, "x", x)
    if x.dim() == 0 or x.shape[-1] == 0:
        raise shape_error(op, "x", "a tensor [..., N] with N >= 1", x, "normalized over the last dimension")
    n = x.shape[-1]
    for arg, value in params.items():
        check_tensor(op, arg, value)
        if value.shape != (n,):
            expected = describe_shape(x.dtype, (n,))
            raise shape_error(op, arg, expected, value, f"one value per feature: x.shape[-1] = {n}")
        check_same_dtype(op, arg, value, x, "x", autocast=True)
    check_same_device(op, {"x": x, **params})
    return check_number(op, "eps", eps, minimum=0.0)


def _layer_norm_fwd(x, weight, bias, *, eps, zero_centered_gamma):
    y, mean, rstd = LAYER_NORM(x, weight, bias, eps, zero_centered_gamma)
    return (y, mean, rstd), (x, weight, mean, rstd)


def stats_grad(x: Tensor, mean: Tensor, rstd: Tensor, dmean: Tensor | None, drstd: Tensor | None) -> Tensor:
    """The part of dx that flows through LayerNorm's statistics, in their (compute) dtype.

    ``∂mean/∂x = 1/N`` and ``∂rstd/∂x = −rstd³·(x − mean)/N``. Cotangents reach the statistics only
    when something differentiates through them: grad-of-grad, where the backward rule used them.
    """
    n = x.shape[-1]
    dx = None
    if drstd is not None:
        dx = (x.to(mean.dtype) - mean[..., None]) * (drstd * rstd**3 / -n)[..., None]
    if dmean is not None:
        through_mean = (dmean / n)[..., None]
        dx = through_mean.expand(x.shape) if dx is None else dx + through_mean
    return dx


def _layer_norm_bwd(res, cts, *, eps, zero_centered_gamma):
    x, weight, mean, rstd = res
    dy, dmean, drstd = cts
    dx = dweight = dbias = None
    if dy is not None:
        dx, dweight, dbias = LAYER_NORM_BWD(dy, x, mean, rstd, weight, zero_centered_gamma)
    if dmean is not None or drstd is not None:
        through_stats = stats_grad(x, mean, rstd, dmean, drstd)
        dx = (through_stats if dx is None else through_stats + dx).to(x.dtype)
    return dx, dweight, dbias


# symbolic_zeros: the statistics' cotangents arrive as None unless they are differentiated through.
_layer_norm = custom_vjp("layer_norm", _layer_norm_fwd, _layer_norm_bwd, symbolic_zeros=True)
"""``(y, mean, rstd) = _layer_norm(x, weight, bias, *, eps, zero_centered_gamma)``: the LayerNorm op
(``mean`` and ``rstd`` of shape ``x.shape[:-1]``, fp32, or fp64 for fp64 x); :func:`layer_norm` returns ``y``."""


def layer_norm(
    x: Tensor, weight: Tensor, bias: Tensor, *, eps: float = 1e-5, zero_centered_gamma: bool = False
) -> Tensor:
    """LayerNorm over the last dimension: ``(x − mean)/√(var + eps)·γ + β`` (biased variance).

    Args:
        x: ``[..., N]``.
        weight: γ, ``[N]``; with ``zero_centered_gamma`` the scale is ``1 + γ``
            (formed in fp32), so a zero-initialised γ is the identity scale.
        bias: β, ``[N]``.

    Statistics and the result are computed in fp32 (fp64 for fp64 inputs) and
    cast to x's dtype; ``dγ`` and ``dβ`` are fp32 reductions over all rows. The
    op saves the row mean and 1/std for the backward (as outputs of the op, so
    second derivatives stay exact).

    Example:
        >>> import torch
        >>> from functe import ops
        >>> y = ops.layer_norm(torch.tensor([[1.0, 3.0]]), torch.ones(2), torch.zeros(2))
        >>> [round(v, 4) for v in y[0].tolist()]
        [-1.0, 1.0]
    """
    eps = _check("layer_norm", x, {"weight": weight, "bias": bias}, eps)
    x, weight, bias = autocast_inputs(x, weight, bias)  # (after the checks: they name what was passed)
    return _layer_norm(
        x,
        weight,
        bias,
        eps=eps,
        zero_centered_gamma=check_flag("layer_norm", "zero_centered_gamma", zero_centered_gamma),
    )[0]


def _rms_norm_fwd(x, weight, *, eps, zero_centered_gamma):
    return RMS_NORM(x, weight, eps, zero_centered_gamma), (x, weight)


def _rms_norm_bwd(res, dy, *, eps, zero_centered_gamma):
    x, weight = res
    return RMS_NORM_BWD(dy, x, weight, eps, zero_centered_gamma)


_rms_norm = custom_vjp("rms_norm", _rms_norm_fwd, _rms_norm_bwd)


def rms_norm(x: Tensor, weight: Tensor, *, eps: float = 1e-5, zero_centered_gamma: bool = False) -> Tensor:
    """RMSNorm over the last dimension: ``x/√(mean(x²) + eps)·γ`` (γ -> 1 + γ if zero-centred).

    Example:
        >>> import torch
        >>> from functe import ops
        >>> y = ops.rms_norm(torch.tensor([[3.0, -4.0]]), torch.ones(2), eps=0.0)
        >>> [round(v, 4) for v in y[0].tolist()]
        [0.8485, -1.1314]
    """
    eps = _check("rms_norm", x, {"weight": weight}, eps)
    x, weight = autocast_inputs(x, weight)
    return _rms_norm(
        x, weight, eps=eps, zero_centered_gamma=check_flag("rms_norm", "zero_centered_gamma", zero_centered_gamma)
    )


def _l2_fwd(x, *, eps):
    return L2_NORMALIZE(x, eps), x


def _l2_bwd(x, dy, *, eps):
    return (L2_NORMALIZE_BWD(dy, x, eps),)


_l2_normalize = custom_vjp("l2_normalize", _l2_fwd, _l2_bwd)


def l2_normalize(x: Tensor, *, eps: float = 1e-6) -> Tensor:
    """``x/√(Σ_last x² + eps)`` (TransformerEngine's L2Normalization; no parameters).

    Example:
        >>> import torch
        >>> from functe import ops
        >>> ops.l2_normalize(torch.tensor([[3.0, 4.0]]), eps=0.0).tolist()
        [[0.6000000238418579, 0.800000011920929]]
    """
    eps = _check("l2_normalize", x, {}, eps)
    return _l2_normalize(*autocast_inputs(x), eps=eps)
