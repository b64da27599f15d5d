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

import math

import torch
import torch.nn.functional as F
import triton.language as tl

from .._errors import describe_shape, shape_error
from .._kernel import Kernel, Rowwise
from . import _act
from ._act import ACTIVATIONS, GATED
from ._common import compute_dtype, row_counts, shaped, tl_compute_dtype
from ._fast import eager_cpu, parallel_chunks
from ._triton import cdiv, jit, next_power_of_2, tile_ids, tiled_grid

Tensor = torch.Tensor

CLAMPED = "clamped_swiglu"
NAMES: tuple[str, ...] = (*ACTIVATIONS, *GATED, CLAMPED)
"""Every activation name the kernels accept."""


def spec(name: str) -> tuple[int, bool, bool]:
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
    return spec(name)[1]


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
def gated_grads(g, a, b, limit, alpha, offset, ACT: tl.constexpr, CLAMPED_: tl.constexpr):
    """(g·∂y/∂a, g·∂y/∂b) of :func:`gated_fwd`, in TE's order: da = (g·f'(a))·b, db = g·f(a).

    (The order decides where fp32 overflows: g·b can exceed fp32 where (g·f'(a))·b does not.)
    """
    if CLAMPED_:
        da, db = _act.clamped_swiglu_grads(a, b, limit, alpha, offset)
        da, db = g * da, g * db
    else:
        da = (g * _act.act_grad(a, ACT)) * b
        db = g * _act.act_fwd(a, ACT)
    return da, db


@jit
def _tile(n_rows, n_out, n_col_blocks, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # A tiled_grid launch (1-D: see functe.kernels._triton) split into row and column blocks.
    pid_r, pid_c = tile_ids(n_col_blocks)
    rows = pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < n_out)[None, :]
    return rows, cols, row_mask, mask, pid_c


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
    rows, cols, row_mask, mask, _ = _tile(n_rows, n_out, n_col_blocks, BLOCK_R, BLOCK_C)
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
    rows, cols, row_mask, mask, pid_c = _tile(n_rows, n_out, n_col_blocks, BLOCK_R, BLOCK_C)
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
        da, db = gated_grads(g, a, b, limit, alpha, offset, ACT, CLAMPED_)
        tl.store(dx_row + a_cols[None, :], da.to(DX.dtype.element_ty), mask=mask)
        tl.store(dx_row + b_cols[None, :], db.to(DX.dtype.element_ty), mask=mask)
        if HAS_S:
            y = gated_fwd(a, b, limit, alpha, offset, ACT, CLAMPED_)
    else:
        x = tl.load(x_row + cols[None, :], mask=mask, other=0.0).to(COMPUTE)
        tl.store(dx_row + cols[None, :], (g * _act.act_grad(x, ACT)).to(DX.dtype.element_ty), mask=mask)
        if HAS_S:
            y = _act.act_fwd(x, ACT)
    if HAS_S:
        partial = tl.sum(tl.where(mask, dy * y, 0.0), axis=1)
        tl.store(DS_PARTIAL + pid_c.to(tl.int64) * n_rows + rows, partial, mask=row_mask)


# ----------------------------------------------------------------------------- launchers


_TILE_ELEMENTS = 1024
"""Elements per program. Measured on an H100 (docs/benchmarks.md, bf16, 8192 x 16384 gated inputs):
with 4096 the clamped SwiGLU backward reached 0.85 of a copy's bandwidth and 1.00 with 1024 (its
math is long, and more programs hide it); the gated forwards 0.96-0.98 -> 0.99, GELU's 0.96 -> 0.97."""


def _out_cols(name: str, in_cols: int) -> int:
    return in_cols // 2 if is_gated(name) else in_cols


def check_layout(name: str, x: Tensor, interleave: int) -> None:
    """A gated activation's x has an even last dimension 2H with H divisible by ``interleave``: the
    kernel read past x otherwise, and the twin's views reinterpreted rows (both silently)."""
    if is_gated(name):
        _check_halves(repr(name), x, interleave)


def _check_halves(what: str, x: Tensor, interleave: int) -> None:
    n = x.shape[-1] if x.dim() else 0
    if interleave < 0:  # (the kernel read blocks of a negative width; the twin failed in a reshape)
        raise ValueError(f"functe.activation: argument 'interleave' expected an int >= 0, got {interleave}")
    if n < 2 or n % 2 or (interleave and (n // 2) % interleave):
        expected = describe_shape(x.dtype, (Ellipsis, "2H"))
        layout = f"H divisible by interleave={interleave}" if interleave else "two halves"
        raise shape_error("activation", "x", expected, x, f"gated {what}: an even last dimension 2H >= 2, {layout}")


def _check_launch(name: str, x: Tensor, s: Tensor | None, dy: Tensor | None, interleave: int, y_shape: tuple) -> None:
    """The launch's arguments in the shapes its kernel indexes them by (it reads past them else)."""
    if s is not None and s.shape != x.shape[:-1]:
        raise shape_error("activation", "s", describe_shape(s.dtype, tuple(x.shape[:-1])), s, "one scale per row")
    if dy is not None and dy.shape != y_shape:
        raise shape_error("activation", "dy", describe_shape(dy.dtype, y_shape), dy)


def _launch(kernel, dy, x, s, name, interleave, limit, alpha, offset):
    """Shared launcher: forward when ``dy`` is None, else backward. Returns (y or dx, ds or None),
    y in its own shape and dx in x's.

    The kernels index contiguous memory by the row and column counts they are given, so the tensors
    go to them as they are, not as 2-D views (each view cost ~0.8 us of the launch's host time)."""
    act, gated, clamped = spec(name)
    if gated:
        _check_halves(repr(name), x, interleave)
    x = x.contiguous()
    n_rows, in_cols = row_counts(x)
    n_out = in_cols // 2 if gated else in_cols
    y_shape = (*x.shape[:-1], n_out) if gated else x.shape
    _check_launch(name, x, s, dy, interleave, y_shape)
    block_c = min(next_power_of_2(n_out), 1024)
    block_r = min(next_power_of_2(n_rows), max(1, _TILE_ELEMENTS // block_c))
    n_col_blocks = cdiv(n_out, block_c)
    grid = tiled_grid(cdiv(n_rows, block_r), n_col_blocks)
    s_flat = None if s is None else s.contiguous()
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
        y = torch.empty(y_shape, dtype=x.dtype, device=x.device) if gated else torch.empty_like(x)
        if n_rows * n_out:
            kernel[grid](x, x if s_flat is None else s_flat, y, *scalars, **flags)
        return y, None
    dx = torch.empty_like(x)
    partial = None
    if s is not None:
        partial = torch.zeros((n_col_blocks, n_rows), dtype=compute_dtype(x.dtype), device=x.device)
    if n_rows * in_cols:
        kernel[grid](
            dy.contiguous(),
            x,
            x if s_flat is None else s_flat,
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
    return _launch(_act_kernel, None, x, None, name, interleave, limit, alpha, offset)[0]


def activation_scaled(
    x: Tensor, s: Tensor, name: str, interleave: int, limit: float, alpha: float, offset: float
) -> Tensor:
    """``s[..., None] * f(x)``; ``s`` has shape ``x.shape[:-1]``."""
    return _launch(_act_kernel, None, x, s, name, interleave, limit, alpha, offset)[0]


def dactivation(dy: Tensor, x: Tensor, name: str, interleave: int, limit: float, alpha: float, offset: float) -> Tensor:
    """``dx = dy * f'(x)`` (for gated f, the two halves' gradients in x's layout)."""
    return _launch(_dact_kernel, dy, x, None, name, interleave, limit, alpha, offset)[0]


def dactivation_scaled(
    dy: Tensor, x: Tensor, s: Tensor, name: str, interleave: int, limit: float, alpha: float, offset: float
) -> tuple[Tensor, Tensor]:
    """``(dx, ds)`` of ``y = s[..., None] * f(x)``: ``dx = s * dy * f'(x)``, ``ds = sum_last(dy * f(x))``."""
    return _launch(_dact_kernel, dy, x, s, name, interleave, limit, alpha, offset)


# ----------------------------------------------------------------------------- PyTorch twins


# Elementwise activations with a fused torch function that evaluates TE's formula
# in fp32 (for any input dtype) and rounds once, as the kernel does.
_NATIVE_FWD = {
    "gelu": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "relu": torch.relu,
    "sigmoid": torch.sigmoid,
}
# Native backward functions (fp32 math for any input dtype, one rounding). gelu_backward
# has a derivative of its own, so it serves under transforms and second derivatives too
# (one op where the formula takes about a dozen); silu_backward has none, so it is used
# only where autograd does not record, and the differentiable formula runs otherwise.
_NATIVE_DACT_DIFFERENTIABLE = {
    "gelu": lambda dy, x: torch.ops.aten.gelu_backward(dy, x, approximate="tanh"),
}
_NATIVE_DACT_UNRECORDED = {"silu": torch.ops.aten.silu_backward}


def _halves(x: Tensor, interleave: int) -> tuple[Tensor, Tensor]:
    """Views ``[..., H // k, k]`` of the activated and linear halves of ``x [..., 2H]``."""
    h = x.shape[-1] // 2
    k = interleave or h
    if 2 * h != x.shape[-1] or h % k:  # (integer checks: the views below would reinterpret rows)
        _check_halves("activation", x, interleave)
    # (reshape, a view here: torch's legacy vmap, autograd.grad(is_grads_batched=True), has no unflatten)
    blocks = x.reshape(*x.shape[:-1], h // k, 2, k)
    return blocks.select(-2, 0), blocks.select(-2, 1)


def _merged(t: Tensor, dims: int) -> Tensor:
    """``t.flatten(-dims)``, as a reshape with explicit sizes (torch's legacy vmap has no flatten,
    and -1 is ambiguous for 0 rows)."""
    return t.reshape(*t.shape[:-dims], math.prod(t.shape[-dims:]))


def _value(x: Tensor, name: str, interleave: int, limit: float, alpha: float, offset: float) -> Tensor:
    """``f(x)`` in x's (compute) dtype."""
    _, gated, clamped = spec(name)
    if not gated:
        return _act.act_fwd_ref(x, name)
    # The halves in the output's shape (a copy when interleaved): the product is then the result
    # itself, where flattening it would return a view, which an in-place op on the result of a
    # Function refuses (and under torch.compile nothing un-views it; see _backend.unaliased_outputs).
    a, b = (_merged(half, 2) for half in _halves(x, interleave))
    if clamped:
        return _act.clamped_swiglu_fwd_ref(a, b, limit, alpha, offset)
    return _act.act_fwd_ref(a, GATED[name]) * b


def _vjp(g: Tensor, x: Tensor, name: str, interleave: int, limit: float, alpha: float, offset: float) -> Tensor:
    """``g * f'(x)`` in x's (compute) dtype, in x's layout."""
    _, gated, clamped = spec(name)
    if not gated:
        return g * _act.act_grad_ref(x, name)
    a, b = _halves(x, interleave)
    g = g.reshape(*g.shape[:-1], *a.shape[-2:])
    if clamped:
        da, db = _act.clamped_swiglu_grads_ref(a, b, limit, alpha, offset)
        da, db = g * da, g * db
    else:  # TE's order (see gated_grads)
        base = GATED[name]
        da, db = (g * _act.act_grad_ref(a, base)) * b, g * _act.act_fwd_ref(a, base)
    return _merged(torch.stack([da, db], dim=-2), 3)


def activation_ref(x: Tensor, name: str, interleave: int, limit: float, alpha: float, offset: float) -> Tensor:
    """PyTorch twin of :func:`activation`."""
    native = _NATIVE_FWD.get(name)
    if native is not None:
        return native(x)
    if eager_cpu(x):
        return _fast_forward(x, None, name, interleave, limit, alpha, offset)
    # (contiguous, as the fast path and the launcher write: the output's layout must not depend on
    # the route, compiled or not; see _kernel._OnContiguous)
    x = x.contiguous()
    return _value(x.to(compute_dtype(x.dtype)), name, interleave, limit, alpha, offset).to(x.dtype)


def activation_scaled_ref(
    x: Tensor, s: Tensor, name: str, interleave: int, limit: float, alpha: float, offset: float
) -> Tensor:
    """PyTorch twin of :func:`activation_scaled`."""
    if eager_cpu(x, s):
        return _fast_forward(x, s, name, interleave, limit, alpha, offset)
    acc = compute_dtype(x.dtype)
    x = x.contiguous()  # (see activation_ref)
    y = _value(x.to(acc), name, interleave, limit, alpha, offset) * s.to(acc)[..., None]
    return y.to(x.dtype)


def dactivation_ref(
    dy: Tensor, x: Tensor, name: str, interleave: int, limit: float, alpha: float, offset: float
) -> Tensor:
    """PyTorch twin of :func:`dactivation`."""
    native = _NATIVE_DACT_DIFFERENTIABLE.get(name)
    if native is not None:
        return native(dy, x)
    if eager_cpu(dy, x):
        native = _NATIVE_DACT_UNRECORDED.get(name)
        if native is not None:
            return native(dy, x)
        if name in ("relu", "srelu"):
            return _fast_relu_backward(dy, x, name)
        return _fast_backward(dy, x, None, name, interleave, limit, alpha, offset)[0]
    acc = compute_dtype(x.dtype)
    x = x.contiguous()  # (see activation_ref)
    return _vjp(dy.to(acc), x.to(acc), name, interleave, limit, alpha, offset).to(x.dtype)


def dactivation_scaled_ref(
    dy: Tensor, x: Tensor, s: Tensor, name: str, interleave: int, limit: float, alpha: float, offset: float
) -> tuple[Tensor, Tensor]:
    """PyTorch twin of :func:`dactivation_scaled`."""
    if eager_cpu(dy, x, s):
        return _fast_backward(dy, x, s, name, interleave, limit, alpha, offset)
    acc = compute_dtype(x.dtype)
    dy, xa = dy.to(acc), x.contiguous().to(acc)  # (see activation_ref)
    dx = _vjp(dy * s.to(acc)[..., None], xa, name, interleave, limit, alpha, offset)
    ds = (dy * _value(xa, name, interleave, limit, alpha, offset)).sum(-1)
    return dx.to(x.dtype), ds.to(s.dtype)


# ----------------------------------------------------------------------------- CPU fast path
#
# The same formulas on cache-sized row chunks in the compute dtype, with in-place
# and out= ops (see functe.kernels._fast). Used only where no autograd or
# transform can observe it; the functions above are the reference.

_aten = torch.ops.aten


def _f_into(t: Tensor, name: str, out: Tensor) -> Tensor:
    """``out ← f(t)`` (``t`` unchanged)."""
    if name == "gelu":
        _aten.gelu.out(t, approximate="tanh", out=out)
    elif name == "silu":
        _aten.silu.out(t, out=out)
    elif name == "sigmoid":
        torch.sigmoid(t, out=out)
    elif name == "qgelu":
        torch.mul(t, 1.702, out=out).sigmoid_().mul_(t)
    else:  # relu, srelu; clamp keeps NaN
        torch.clamp(t, min=0.0, out=out)
        if name == "srelu":
            out.square_()
    return out


def _vjp_into(g: Tensor, t: Tensor, name: str, out: Tensor, tmp: Tensor) -> Tensor:
    """``out ← g·f'(t)`` (``out`` may be ``g``; ``tmp`` is scratch)."""
    if name == "gelu":
        _aten.gelu_backward.grad_input(g, t, approximate="tanh", grad_input=out)
    elif name == "silu":
        _aten.silu_backward.grad_input(g, t, grad_input=out)
    elif name == "qgelu":  # qgelu'(x) = silu'(1.702x): TE's σ(z) + zσ(z)(1 − σ(z)) with z = 1.702x
        _aten.silu_backward.grad_input(g, torch.mul(t, 1.702, out=tmp), grad_input=out)
    elif name == "sigmoid":
        _aten.sigmoid_backward.grad_input(g, torch.sigmoid(t, out=tmp), grad_input=out)
    elif name == "relu":  # g·(t > 0 ? 1 : 0) with TE's special values (see _fast_relu_backward)
        _aten.leaky_relu_backward.grad_input(g, t, 0.0, False, grad_input=out)
    else:  # srelu'(x) = 2x where x > 0, else 0 (NaN -> 0, as TE); multiplied, so inf·0 is NaN
        _srelu_vjp_into(g, t, out, tmp)
    return out


def _srelu_vjp_into(g: Tensor, t: Tensor, out: Tensor, tmp: Tensor | None = None) -> Tensor:
    """``out ← g·(t > 0 ? 2t : 0)`` (``out`` may be ``g`` when ``tmp``, scratch of ``t``'s shape, is
    given; ``t`` in the compute dtype).

    TE's factor 2·relu(t) (exact) times g in one rounding: addcmul forms value·tensor1 first. Exact
    for every t but NaN (relu keeps it; TE's factor is 0): t's sum rules NaN out, else the ``where``
    form runs (torch.where is ~3x slower than these passes on CPU). (Masking the product g·2t instead
    made it NaN wherever it overflowed at t <= 0, and at t = -inf.)
    """
    total = float(t.sum())
    if total != total:
        mask = torch.where(t > 0, t, t.new_zeros(()), out=tmp)
        return torch.mul(g, mask.mul_(2.0), out=out)
    relu = torch.clamp(t, min=0.0, out=out if tmp is None else tmp)
    return torch.addcmul(t.new_zeros(()), relu, g, value=2.0, out=out)


def _clamped_into(a: Tensor, b: Tensor, limit: float, alpha: float, offset: float, out: Tensor, tmp: Tensor):
    """``out ← a_c·σ(α·a_c)·(clamp(b, ±limit) + offset)``."""
    a_c = torch.clamp(a, max=limit, out=tmp)
    torch.mul(a_c, alpha, out=out).sigmoid_().mul_(a_c)
    out.mul_(torch.clamp(b, -limit, limit, out=tmp).add_(offset))
    return out


def _clamped_vjp_into(g, a, b, limit, alpha, offset, da, db, tmp):
    """``da ← g·∂y/∂a``, ``db ← g·∂y/∂b`` of the clamped SwiGLU (zero factors where a clamp is active).

    The factors are zeroed before g multiplies them, as in the kernel and TE: g·0 stays NaN for a
    NaN or infinite g.
    """
    a_c = torch.clamp(a, max=limit, out=tmp)
    torch.mul(a_c, alpha, out=db).sigmoid_().mul_(a_c)  # a_c·σ(α·a_c)
    db.masked_fill_(~((b >= -limit) & (b <= limit)), 0.0).mul_(g)
    torch.clamp(b, -limit, limit, out=da).add_(offset)  # b_c
    _aten.silu_backward.grad_input(da, a_c.mul_(alpha), grad_input=da)  # ·silu'(α·a_c), TE's da formula
    da.masked_fill_(~(a <= limit), 0.0).mul_(g)


def _lanes(x: Tensor, name: str, interleave: int) -> tuple[Tensor, Tensor | None]:
    """Views ``[R, blocks, k]`` of the activated input and (gated) the linear half."""
    rows = x.reshape(math.prod(x.shape[:-1]), x.shape[-1]) if x.dim() else x.reshape(1, 1)
    if not is_gated(name):
        return rows.unsqueeze(1), None
    h = rows.shape[1] // 2
    k = interleave or h
    if 2 * h != rows.shape[1] or h % k:
        check_layout(name, x, interleave)
    blocks = rows.view(-1, h // k, 2, k)
    return blocks.select(2, 0), blocks.select(2, 1)


def _fast_relu_backward(dy: Tensor, x: Tensor, name: str) -> Tensor:
    """relu/srelu ``dy·f'(x)`` in x's dtype: f'(x) is exact (0, 1 or 2x), so the one
    product rounds once, as in fp32 followed by a cast."""
    if name == "relu":
        # leaky_relu_backward with slope 0 is TE's formula in one pass, special values included:
        # x > 0 ? dy : dy·0 (so relu'(NaN) = 0, and inf·0 = NaN where x <= 0). threshold_backward
        # (x <= 0 ? 0 : dy) is as fast but passes dy through at NaN and drops non-finite dy.
        return _aten.leaky_relu_backward(dy, x, 0.0, False)
    if x.dtype != compute_dtype(x.dtype):
        # In 16 bits 2·g·t overflows (fp16 from |t| = 32752; CPU addcmul forms 2t in fp16): the
        # chunked path computes it in fp32, as TE, at the same speed (8192x4096 bf16: 65 vs 64 ms).
        return _fast_backward(dy, x, None, name, 0, 0.0, 0.0, 0.0)[0]
    return _srelu_vjp_into(dy, x, torch.empty_like(x))


def _fast_forward(x, s, name, interleave, limit, alpha, offset) -> Tensor:
    _, gated, clamped = spec(name)
    base = GATED.get(name, name)
    a, b = _lanes(x, name, interleave)
    n_rows, blocks, k = a.shape
    # (allocated in the output's shape and written through a view: a view returned from a Function
    # costs an un-viewing at the boundary, see _backend.unaliased_outputs)
    result = torch.empty(_y_shape(x, name), dtype=x.dtype, device=x.device)
    y = result.view(n_rows, blocks, k)
    s_rows = None if s is None else s.reshape(-1, 1, 1)

    def body(_, sl, buf):
        m = sl.stop - sl.start
        ta, out = buf.upcast("a", a[sl]), buf.get("out", m)
        if clamped:
            _clamped_into(ta, buf.upcast("b", b[sl]), limit, alpha, offset, out, buf.get("tmp", m))
        else:
            _f_into(ta, base, out)
            if gated:
                out.mul_(b[sl])
        if s_rows is not None:
            out.mul_(s_rows[sl])
        y[sl].copy_(out)

    parallel_chunks(n_rows, (blocks, k), compute_dtype(x.dtype), body)
    return result


def _fast_backward(dy, x, s, name, interleave, limit, alpha, offset) -> tuple[Tensor, Tensor | None]:
    _, gated, clamped = spec(name)
    base = GATED.get(name, name)
    a, b = _lanes(x, name, interleave)
    n_rows, blocks, k = a.shape
    acc = compute_dtype(x.dtype)
    dy_lanes = dy.reshape(n_rows, blocks, k)
    dx = torch.empty((n_rows, blocks, 2 if gated else 1, k), dtype=x.dtype, device=x.device)
    da, db = dx.select(2, 0), (dx.select(2, 1) if gated else None)
    s_rows = None if s is None else s.reshape(-1, 1, 1)
    ds = None if s is None else torch.empty(n_rows, dtype=acc, device=x.device)

    def body(_, sl, buf):
        m = sl.stop - sl.start
        ta, g = buf.upcast("a", a[sl]), buf.upcast("g", dy_lanes[sl])
        tb = None if b is None else buf.upcast("b", b[sl])
        gs = g if s_rows is None else torch.mul(g, s_rows[sl], out=buf.get("gs", m))
        out, tmp, value = buf.get("out", m), buf.get("tmp", m), buf.get("value", m)
        if clamped:
            _clamped_vjp_into(gs, ta, tb, limit, alpha, offset, out, value, tmp)
            da[sl].copy_(out)
            db[sl].copy_(value)
            if ds is not None:
                _clamped_into(ta, tb, limit, alpha, offset, value, tmp)
        elif gated:
            da[sl].copy_(_vjp_into(gs, ta, base, out, tmp).mul_(tb))  # TE's order (see gated_grads)
            db[sl].copy_(torch.mul(_f_into(ta, base, value), gs, out=out))
            if ds is not None:
                value.mul_(tb)
        else:
            da[sl].copy_(_vjp_into(gs, ta, base, out, tmp))
            if ds is not None:
                _f_into(ta, base, value)
        if ds is not None:
            torch.sum(value.mul_(g), dim=(1, 2), out=ds[sl])

    parallel_chunks(n_rows, (blocks, k), acc, body)
    return shaped(dx, x.shape), (None if ds is None else shaped(ds.to(s.dtype), s.shape))


ACTIVATION = Kernel("activation", activation, activation_ref, batch=Rowwise())
ACTIVATION_SCALED = Kernel("activation_scaled", activation_scaled, activation_scaled_ref, batch=Rowwise())
DACTIVATION = Kernel("dactivation", dactivation, dactivation_ref, batch=Rowwise())
DACTIVATION_SCALED = Kernel("dactivation_scaled", dactivation_scaled, dactivation_scaled_ref, batch=Rowwise())
