"""Elementwise and bias kernels behind the core ops, with their PyTorch twins.

* ``axpby(x, e, alpha, beta) = alpha * x + beta * e`` (``e`` optional): constant
  scale, residual add, and the gradient sum of ``make_extra_output``.
* ``add_bias(x, b) = x + b`` with ``b`` broadcast over the last dimension.
* ``bias_grad(dy)``: the sum of ``dy`` over all leading dimensions, accumulated
  in fp32 as per-program partial sums reduced afterwards (deterministic, no
  atomics).

All compute in fp32 (fp64 for fp64 inputs) and cast the result to the input dtype.
"""

from __future__ import annotations

import torch
import triton.language as tl

from .._errors import describe_shape, shape_error
from .._kernel import Kernel, Rowwise
from ._common import as_rows, column_sums, compute_dtype, tl_compute_dtype
from ._triton import ELEMENTWISE_BLOCK, cdiv, jit, next_power_of_2, tile_ids, tiled_grid

Tensor = torch.Tensor


@jit
def _axpby_kernel(X, E, Y, n, alpha, beta, HAS_E: tl.constexpr, BLOCK: tl.constexpr, COMPUTE: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    y = alpha * tl.load(X + offs, mask=mask).to(COMPUTE)
    if HAS_E:
        y += beta * tl.load(E + offs, mask=mask).to(COMPUTE)
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


def axpby(x: Tensor, e: Tensor | None, alpha: float, beta: float) -> Tensor:
    """``alpha * x + beta * e`` (``e`` may be None), computed in fp32."""
    if e is not None and e.shape != x.shape:  # (the kernel indexes e by x's elements: it read past a short e)
        raise shape_error("axpby", "e", describe_shape(e.dtype, tuple(x.shape)), e, "x's shape")
    x = x.contiguous()
    y = torch.empty_like(x)
    n = x.numel()
    if n:
        # (HAS_E says whether e was given: e may be x itself, x + x, which must not lose its second term)
        has_e = e is not None
        e = e.contiguous() if has_e else x
        grid = (cdiv(n, ELEMENTWISE_BLOCK),)
        _axpby_kernel[grid](
            x, e, y, n, alpha, beta, HAS_E=has_e, BLOCK=ELEMENTWISE_BLOCK, COMPUTE=tl_compute_dtype(x.dtype)
        )
    return y


def axpby_ref(x: Tensor, e: Tensor | None, alpha: float, beta: float) -> Tensor:
    """PyTorch twin of :func:`axpby`."""
    acc = compute_dtype(x.dtype)
    if e is None:
        return (x.to(acc) * alpha).to(x.dtype)
    xa = x.to(acc)
    # One pass when alpha == 1 (the residual add); the result is always a new tensor.
    return torch.add(xa if alpha == 1.0 else xa * alpha, e.to(acc), alpha=beta).to(x.dtype)


@jit
def _add_bias_kernel(X, B, Y, n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, COMPUTE: tl.constexpr):
    pid_r, pid_c = tile_ids(tl.cdiv(n_cols, BLOCK_C))
    rows = pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    offs = rows[:, None] * n_cols + cols[None, :]
    b = tl.load(B + cols, mask=cols < n_cols).to(COMPUTE)
    y = tl.load(X + offs, mask=mask).to(COMPUTE) + b[None, :]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


def add_bias(x: Tensor, b: Tensor) -> Tensor:
    """``x + b`` with ``b`` of shape ``(x.shape[-1],)``, computed in fp32."""
    if b.shape != x.shape[-1:]:  # (the kernel indexes b by x's columns: it read past a short b)
        raise shape_error("bias", "b", describe_shape(b.dtype, tuple(x.shape[-1:])), b)
    rows = as_rows(x)
    y = torch.empty_like(rows)
    n_rows, n_cols = rows.shape
    if rows.numel():
        block_c = min(next_power_of_2(n_cols), 256)
        block_r = max(1, 2048 // block_c)
        grid = tiled_grid(cdiv(n_rows, block_r), cdiv(n_cols, block_c))
        _add_bias_kernel[grid](
            rows,
            b.contiguous(),
            y,
            n_rows,
            n_cols,
            BLOCK_R=block_r,
            BLOCK_C=block_c,
            COMPUTE=tl_compute_dtype(x.dtype),
        )
    return y.view(x.shape)


def add_bias_ref(x: Tensor, b: Tensor) -> Tensor:
    """PyTorch twin of :func:`add_bias`."""
    acc = compute_dtype(x.dtype)
    return (x.to(acc) + b.to(acc)).to(x.dtype)


@jit
def _column_partial_sums_kernel(
    DY, P, n_rows, n_cols, rows_per_program, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, COMPUTE: tl.constexpr
):
    # Program (i, j) sums rows [i*rows_per_program, (i+1)*rows_per_program) of
    # column block j into P[i, block j]; the launcher then reduces P over i.
    pid_r, pid_c = tile_ids(tl.cdiv(n_cols, BLOCK_C))
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < n_cols
    acc = tl.zeros((BLOCK_C,), dtype=COMPUTE)
    start = pid_r.to(tl.int64) * rows_per_program
    for r0 in range(0, rows_per_program, BLOCK_R):
        rows = start + r0 + tl.arange(0, BLOCK_R)
        mask = (rows[:, None] < n_rows) & (rows[:, None] < start + rows_per_program) & col_mask[None, :]
        tile = tl.load(DY + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0.0).to(COMPUTE)
        acc += tl.sum(tile, axis=0)
    tl.store(P + pid_r.to(tl.int64) * n_cols + cols, acc, mask=col_mask)


_PARTIAL_PROGRAMS = 256


def bias_grad(dy: Tensor) -> Tensor:
    """Sum of ``dy`` over all leading dimensions (fp32 partial sums, then one reduction)."""
    rows = as_rows(dy)
    n_rows, n_cols = rows.shape
    acc = compute_dtype(dy.dtype)
    if n_rows == 0:
        return torch.zeros(n_cols, dtype=dy.dtype, device=dy.device)
    block_c = min(next_power_of_2(n_cols), 128)
    block_r = max(1, min(next_power_of_2(n_rows), 4096 // block_c))
    rows_per_program = max(cdiv(n_rows, _PARTIAL_PROGRAMS), block_r)
    n_programs = cdiv(n_rows, rows_per_program)
    partials = torch.empty((n_programs, n_cols), dtype=acc, device=dy.device)
    grid = tiled_grid(n_programs, cdiv(n_cols, block_c))
    _column_partial_sums_kernel[grid](
        rows,
        partials,
        n_rows,
        n_cols,
        rows_per_program,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        COMPUTE=tl_compute_dtype(dy.dtype),
    )
    return partials.sum(0).to(dy.dtype)


def bias_grad_ref(dy: Tensor) -> Tensor:
    """PyTorch twin of :func:`bias_grad`."""
    return column_sums(dy, dy.dtype)


AXPBY = Kernel("axpby", axpby, axpby_ref, batch=Rowwise(), fast_path=False)
ADD_BIAS = Kernel("add_bias", add_bias, add_bias_ref, batch=Rowwise(params=(1,)), fast_path=False)
BIAS_GRAD = Kernel("bias_grad", bias_grad, bias_grad_ref, fast_path=False)
