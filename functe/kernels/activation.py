"""Activation kernels, forward and backward, elementwise and gated, optionally row-scaled.

One Triton kernel per direction serves every activation: the activation is a
``constexpr`` (so each one compiles to its own specialisation) and so are the
gated layout and the presence of a row scale. The math comes from
:mod:`functe.kernels._act` (TransformerEngine's formulas).

=====================  =====================================================
kernel                 computes
=====================  =====================================================
``ACTIVATION``         ``y = f(x)``
``ACTIVATION_SCALED``  ``y = s[..., None] * f(x)``
``DACTIVATION``        ``dx = dy * f'(x)`` (the vector-Jacobian product)
``DACTIVATION_SCALED`` ``dx = s * dy * f'(x)`` and ``ds = sum_last(dy * f(x))``
=====================  =====================================================

``f`` is named by a string: an elementwise activation (``ACTIVATIONS``), a
gated one (``GATED``: last dim ``2H -> H``, ``f`` applied to the *first* half
and multiplied by the second) or ``"clamped_swiglu"`` (GPT-OSS; parameters
``limit``, ``alpha``, ``offset``). ``interleave = k > 0`` selects the
block-interleaved gated layout ``[a(k), b(k), a(k), b(k), ...]``
(TransformerEngine's ``glu_interleave_size``); the kernels handle it with index
arithmetic and the twins with views, so nothing is de-interleaved in memory.

``ds`` is reduced in fp32: each column block writes a partial sum per row and
the launcher adds the partials (deterministic, no atomics).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .._kernel import Kernel, Rowwise
from . import _act
from ._act import ACTIVATIONS, GATED
from ._common import as_rows, compute_dtype, tl_compute_dtype
from ._fast import eager_cpu
from ._triton import jit, next_power_of_2

Tensor = torch.Tensor

CLAMPED = "clamped_swiglu"
NAMES: tuple[str, ...] = (*ACTIVATIONS, *GATED, CLAMPED)
"""Every activation name the kernels accept."""


def describe(name: str) -> tuple[int, bool, bool]:
    """``(activation id, gated, clamped)`` of an activation name (see :data:`NAMES`)."""
    if name in ACTIVATIONS:
        return ACTIVATIONS[name], False, False
    if name in GATED:
        return ACTIVATIONS[GATED[name]], True, False
    if name == CLAMPED:
        return ACTIVATIONS["silu"], True, True
    raise KeyError(f"unknown activation {name!r}; known: {', '.join(NAMES)}")


def is_gated(name: str) -> bool:
    """Whether ``name`` maps a last dimension of 2H to H."""
    return describe(name)[1]


# ----------------------------------------------------------------------------- Triton device functions


@jit
def gated_columns(cols, n_out, k, INTERLEAVED: tl.constexpr):
    """Input columns of the activated half (a) and the linear half (b) for output columns ``cols``.

    Chunked layout: a = x[:, :H], b = x[:, H:]. Interleaved with block ``k``:
    output column j lives in block j // k, whose a-part starts at 2k(j // k).
    """
    if INTERLEAVED:
        a_cols = (cols // k) * (2 * k) + cols % k
        b_cols = a_cols + k
    else:
        a_cols = cols
        b_cols = cols + n_out
    return a_cols, b_cols


@jit
def gated_fwd(a, b, limit, alpha, offset, ACT: tl.constexpr, CLAMPED_: tl.constexpr):
    """f(a)·b, or the clamped SwiGLU of (a, b)."""
    if CLAMPED_:
        y = _act.clamped_swiglu_fwd(a, b, limit, alpha, offset)
    else:
        y = _act.act_fwd(a, ACT) * b
    return y


@jit
def gated_grads(a, b, limit, alpha, offset, ACT: tl.constexpr, CLAMPED_: tl.constexpr):
    """(∂y/∂a, ∂y/∂b) of :func:`gated_fwd`."""
    if CLAMPED_:
        da, db = _act.clamped_swiglu_grads(a, b, limit, alpha, offset)
    else:
        da = _act.act_grad(a, ACT) * b
        db = _act.act_fwd(a, ACT)
    return da, db


@jit
def _tile(pid, n_rows, n_out, n_col_blocks, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # A 1-D grid (axis 0 allows 2^31 programs; axes 1-2 only 65535) split into row and column blocks.
    rows = (pid // n_col_blocks).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = (pid % n_col_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < n_out)[None, :]
    return rows, cols, row_mask, mask


@jit
def _act_kernel(
    X,
    S,
    Y,
    n_rows,
    n_out,
    in_cols,
    k,
    limit,
    alpha,
    offset,
    n_col_blocks,
    ACT: tl.constexpr,
    GATED_: tl.constexpr,
    CLAMPED_: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_S: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    COMPUTE: tl.constexpr,
):
    rows, cols, row_mask, mask = _tile(tl.program_id(0), n_rows, n_out, n_col_blocks, BLOCK_R, BLOCK_C)
    x_row = X + rows[:, None] * in_cols
    if GATED_:
        a_cols, b_cols = gated_columns(cols, n_out, k, INTERLEAVED)
        a = tl.load(x_row + a_cols[None, :], mask=mask, other=0.0).to(COMPUTE)
        b = tl.load(x_row + b_cols[None, :], mask=mask, other=0.0).to(COMPUTE)
        y = gated_fwd(a, b, limit, alpha, offset, ACT, CLAMPED_)
    else:
        y = _act.act_fwd(tl.load(x_row + cols[None, :], mask=mask, other=0.0).to(COMPUTE), ACT)
    if HAS_S:
        y = y * tl.load(S + rows, mask=row_mask, other=0.0).to(COMPUTE)[:, None]
    tl.store(Y + rows[:, None] * n_out + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@jit
def _dact_kernel(
    DY,
    X,
    S,
    DX,
    DS_PARTIAL,
    n_rows,
    n_out,
    in_cols,
    k,
    limit,
    alpha,
    offset,
    n_col_blocks,
    ACT: tl.constexpr,
    GATED_: tl.constexpr,
    CLAMPED_: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_S: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    COMPUTE: tl.constexpr,
):
    pid = tl.program_id(0)
    rows, cols, row_mask, mask = _tile(pid, n_rows, n_out, n_col_blocks, BLOCK_R, BLOCK_C)
    dy = tl.load(DY + rows[:, None] * n_out + cols[None, :], mask=mask, other=0.0).to(COMPUTE)
    g = dy
    if HAS_S:
        g = dy * tl.load(S + rows, mask=row_mask, other=0.0).to(COMPUTE)[:, None]
    x_row = X + rows[:, None] * in_cols
    dx_row = DX + rows[:, None] * in_cols
    if GATED_:
        a_cols, b_cols = gated_columns(cols, n_out, k, INTERLEAVED)
        a = tl.load(x_row + a_cols[None, :], mask=mask, other=0.0).to(COMPUTE)
        b = tl.load(x_row + b_cols[None, :], mask=mask, other=0.0).to(COMPUTE)
        da, db = gated_grads(a, b, limit, alpha, offset, ACT, CLAMPED_)
        tl.store(dx_row + a_cols[None, :], (g * da).to(DX.dtype.element_ty), mask=mask)
        tl.store(dx_row + b_cols[None, :], (g * db).to(DX.dtype.element_ty), mask=mask)
        if HAS_S:
            y = gated_fwd(a, b, limit, alpha, offset, ACT, CLAMPED_)
    else:
        x = tl.load(x_row + cols[None, :], mask=mask, other=0.0).to(COMPUTE)
        tl.store(dx_row + cols[None, :], (g * _act.act_grad(x, ACT)).to(DX.dtype.element_ty), mask=mask)
        if HAS_S:
            y = _act.act_fwd(x, ACT)
    if HAS_S:
        partial = tl.sum(tl.where(mask, dy * y, 0.0), axis=1)
        tl.store(DS_PARTIAL + (pid % n_col_blocks) * n_rows + rows, partial, mask=row_mask)


# ----------------------------------------------------------------------------- launchers


_TILE_ELEMENTS = 4096


def _out_cols(name: str, in_cols: int) -> int:
    return in_cols // 2 if is_gated(name) else in_cols


def _launch(kernel, dy, x, s, name, interleave, limit, alpha, offset):
    """Shared launcher: forward when ``dy`` is None, else backward. Returns (out rows, ds or None)."""
    act, gated, clamped = describe(name)
    rows = as_rows(x)
    n_rows, in_cols = rows.shape
    n_out = _out_cols(name, in_cols)
    block_c = min(next_power_of_2(n_out), 1024)
    block_r = min(next_power_of_2(n_rows), max(1, _TILE_ELEMENTS // block_c))
    n_col_blocks = triton.cdiv(n_out, block_c)
    grid = (triton.cdiv(n_rows, block_r) * n_col_blocks,)
    s_rows = None if s is None else s.contiguous().view(-1)
    acc = compute_dtype(x.dtype)
    interleaved = bool(interleave) and interleave != n_out
    flags = dict(
        ACT=act,
        GATED_=gated,
        CLAMPED_=clamped,
        INTERLEAVED=interleaved,
        HAS_S=s is not None,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        COMPUTE=tl_compute_dtype(x.dtype),
    )
    scalars = (n_rows, n_out, in_cols, interleave if interleaved else n_out, limit, alpha, offset, n_col_blocks)
    if dy is None:
        out = torch.empty((n_rows, n_out), dtype=x.dtype, device=x.device)
        if out.numel():
            kernel[grid](rows, rows if s_rows is None else s_rows, out, *scalars, **flags)
        return out, None
    dx = torch.empty_like(rows)
    partial = None if s is None else torch.zeros((n_col_blocks, n_rows), dtype=acc, device=x.device)
    if rows.numel():
        dy_rows = dy.contiguous().view(n_rows, n_out)
        kernel[grid](
            dy_rows,
            rows,
            rows if s_rows is None else s_rows,
            dx,
            dx if partial is None else partial,
            *scalars,
            **flags,
        )
    ds = None if partial is None else partial.sum(0).to(s.dtype).view(s.shape)
    return dx, ds


def _y_shape(x: Tensor, name: str) -> tuple[int, ...]:
    return (*x.shape[:-1], _out_cols(name, x.shape[-1])) if x.dim() else ()


def activation(x: Tensor, name: str, interleave: int, limit: float, alpha: float, offset: float) -> Tensor:
    """``f(x)`` for the activation ``name`` (``interleave`` 0: chunked gated layout)."""
    y, _ = _launch(_act_kernel, None, x, None, name, interleave, limit, alpha, offset)
    return y.view(_y_shape(x, name))


def activation_scaled(
    x: Tensor, s: Tensor, name: str, interleave: int, limit: float, alpha: float, offset: float
) -> Tensor:
    """``s[..., None] * f(x)``; ``s`` has shape ``x.shape[:-1]``."""
    y, _ = _launch(_act_kernel, None, x, s, name, interleave, limit, alpha, offset)
    return y.view(_y_shape(x, name))


def dactivation(dy: Tensor, x: Tensor, name: str, interleave: int, limit: float, alpha: float, offset: float) -> Tensor:
    """``dx = dy * f'(x)`` (for gated f, the two halves' gradients in x's layout)."""
    dx, _ = _launch(_dact_kernel, dy, x, None, name, interleave, limit, alpha, offset)
    return dx.view(x.shape)


def dactivation_scaled(
    dy: Tensor, x: Tensor, s: Tensor, name: str, interleave: int, limit: float, alpha: float, offset: float
) -> tuple[Tensor, Tensor]:
    """``(dx, ds)`` of ``y = s[..., None] * f(x)``: ``dx = s * dy * f'(x)``, ``ds = sum_last(dy * f(x))``."""
    dx, ds = _launch(_dact_kernel, dy, x, s, name, interleave, limit, alpha, offset)
    return dx.view(x.shape), ds


# ----------------------------------------------------------------------------- PyTorch twins


# Elementwise activations with a fused torch function that evaluates TE's formula
# in fp32 (for any input dtype) and rounds once, as the kernel does.
_NATIVE_FWD = {
    "gelu": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "relu": torch.relu,
    "sigmoid": torch.sigmoid,
}
# Native backward functions: used where autograd does not record (silu_backward
# has no derivative of its own), otherwise the differentiable formula runs.
_NATIVE_DACT = {
    "gelu": lambda dy, x: torch.ops.aten.gelu_backward(dy, x, approximate="tanh"),
    "silu": torch.ops.aten.silu_backward,
}


def _halves(x: Tensor, interleave: int) -> tuple[Tensor, Tensor]:
    """Views ``[..., H // k, k]`` of the activated and linear halves of ``x [..., 2H]``."""
    h = x.shape[-1] // 2
    k = interleave or h
    blocks = x.unflatten(-1, (h // k, 2, k))
    return blocks.select(-2, 0), blocks.select(-2, 1)


def _value(x: Tensor, name: str, interleave: int, limit: float, alpha: float, offset: float) -> Tensor:
    """``f(x)`` in x's (compute) dtype."""
    _, gated, clamped = describe(name)
    if not gated:
        return _act.act_fwd_ref(x, name)
    a, b = _halves(x, interleave)
    if clamped:
        y = _act.clamped_swiglu_fwd_ref(a, b, limit, alpha, offset)
    else:
        y = _act.act_fwd_ref(a, GATED[name]) * b
    return y.flatten(-2)


def _vjp(g: Tensor, x: Tensor, name: str, interleave: int, limit: float, alpha: float, offset: float) -> Tensor:
    """``g * f'(x)`` in x's (compute) dtype, in x's layout."""
    _, gated, clamped = describe(name)
    if not gated:
        return g * _act.act_grad_ref(x, name)
    a, b = _halves(x, interleave)
    g = g.unflatten(-1, a.shape[-2:])
    if clamped:
        da, db = _act.clamped_swiglu_grads_ref(a, b, limit, alpha, offset)
    else:
        base = GATED[name]
        da, db = _act.act_grad_ref(a, base) * b, _act.act_fwd_ref(a, base)
    return torch.stack([g * da, g * db], dim=-2).flatten(-3)


def activation_ref(x: Tensor, name: str, interleave: int, limit: float, alpha: float, offset: float) -> Tensor:
    """PyTorch twin of :func:`activation`."""
    native = _NATIVE_FWD.get(name)
    if native is not None:
        return native(x)
    return _value(x.to(compute_dtype(x.dtype)), name, interleave, limit, alpha, offset).to(x.dtype)


def activation_scaled_ref(
    x: Tensor, s: Tensor, name: str, interleave: int, limit: float, alpha: float, offset: float
) -> Tensor:
    """PyTorch twin of :func:`activation_scaled`."""
    acc = compute_dtype(x.dtype)
    y = _value(x.to(acc), name, interleave, limit, alpha, offset) * s.to(acc)[..., None]
    return y.to(x.dtype)


def dactivation_ref(
    dy: Tensor, x: Tensor, name: str, interleave: int, limit: float, alpha: float, offset: float
) -> Tensor:
    """PyTorch twin of :func:`dactivation`."""
    native = _NATIVE_DACT.get(name)
    if native is not None and eager_cpu(dy, x):
        return native(dy, x)
    acc = compute_dtype(x.dtype)
    return _vjp(dy.to(acc), x.to(acc), name, interleave, limit, alpha, offset).to(x.dtype)


def dactivation_scaled_ref(
    dy: Tensor, x: Tensor, s: Tensor, name: str, interleave: int, limit: float, alpha: float, offset: float
) -> tuple[Tensor, Tensor]:
    """PyTorch twin of :func:`dactivation_scaled`."""
    acc = compute_dtype(x.dtype)
    dy, xa = dy.to(acc), x.to(acc)
    dx = _vjp(dy * s.to(acc)[..., None], xa, name, interleave, limit, alpha, offset)
    ds = (dy * _value(xa, name, interleave, limit, alpha, offset)).sum(-1)
    return dx.to(x.dtype), ds.to(s.dtype)


ACTIVATION = Kernel("activation", activation, activation_ref, batch=Rowwise())
ACTIVATION_SCALED = Kernel("activation_scaled", activation_scaled, activation_scaled_ref, batch=Rowwise())
DACTIVATION = Kernel("dactivation", dactivation, dactivation_ref, batch=Rowwise())
DACTIVATION_SCALED = Kernel("dactivation_scaled", dactivation_scaled, dactivation_scaled_ref, batch=Rowwise())
