"""Small helpers shared by kernel launchers and their twins."""

from __future__ import annotations

import math

import torch
import triton.language as tl

_TL_DTYPES = {
    torch.float32: tl.float32,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float64: tl.float64,
}


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Internal precision of a kernel: fp32, or fp64 for fp64 inputs (gradcheck runs in fp64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def tl_compute_dtype(dtype: torch.dtype):
    """The Triton dtype matching :func:`compute_dtype`."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def tl_dtype(dtype: torch.dtype):
    """The Triton dtype of a torch floating dtype."""
    return _TL_DTYPES[dtype]


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """A contiguous 2-D view ``(rows, last_dim)`` of ``x`` (copies only if needed).

    Gradients often arrive non-contiguous (the gradient of ``.sum()`` is a
    stride-0 expansion), so every launcher goes through this.
    """
    x = x.contiguous()
    if x.dim() == 0:
        return x.view(1, 1)
    # (the row count is explicit: view(-1, 0) is ambiguous for an empty last dimension)
    return x.view(math.prod(x.shape[:-1]), x.shape[-1])


def row_counts(x: torch.Tensor) -> tuple[int, int]:
    """``(rows, last_dim)`` of ``x`` as :func:`as_rows` views it, without the view: a launcher
    whose kernel indexes a contiguous tensor by these counts passes the tensor itself (a ``view``
    costs ~0.8 us of host time, and a launch made three of them)."""
    shape = x.shape
    if not shape:
        return 1, 1
    last = shape[-1]
    # (the row count from the shape: numel // 0 is undefined for an empty last dimension)
    return (x.numel() // last if last else math.prod(shape[:-1])), last


def shaped(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``t.view(shape)``, or ``t`` itself when it already has that shape: on the CPU a ``view`` call
    with a ``torch.Size`` costs ~2.5 us of dispatch, a tenth of a small op's whole cost."""
    return t if t.shape == shape else t.view(shape)


def rows_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 2-D ``[rows, last]`` tensor (a view when possible), for any row count and last dim.

    The row count is explicit: ``reshape(-1, 0)`` is ambiguous for an empty last dimension (a linear
    with no input or no output features). A 0-d ``t`` is one row of one element.
    """
    dim = t.dim()
    if dim == 2:
        return t  # (already rows: a reshape to the same shape would still cost a dispatch)
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1]) if dim else t.reshape(1, 1)


def static_float(value: float) -> float:
    """``float(value)``, specialised under torch.compile: Dynamo makes a Python float that changed
    between calls symbolic, which a static argument (a cache key, an ``assume_constant_result``
    argument) cannot be; ``.hex()`` makes it guard on the value instead (``float()`` does not).

    Example:
        >>> static_float(0.25)
        0.25
    """
    return float.fromhex(float(value).hex())


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, skipping the call when ``t`` already has it: a no-op ``.to`` still costs a
    dispatch (~1 µs), which is most of a small op's time on the CPU fast paths."""
    return t if t.dtype == dtype else t.to(dtype)


def column_sums(v: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``Σ v`` over all leading dimensions, accumulated in fp32 (fp64 for fp64) and rounded once to ``out_dtype``.

    A 16-bit ``v`` is summed as it is: torch's sum of fp16/bf16 already accumulates in fp32 and
    rounds once (ATen's cast-load policies on the CPU, float accumulators on CUDA), and an fp32
    copy first would cost four times the sum itself (CPU, 4096x4096 bf16: 16 ms copy, 4 ms sum).
    Only a wider ``out_dtype`` needs the upcast (the sum would otherwise round to ``v``'s dtype).
    """
    rows = rows_view(v)
    if out_dtype.itemsize > v.dtype.itemsize:
        rows = rows.to(out_dtype)
    return as_dtype(rows.sum(0), out_dtype)
