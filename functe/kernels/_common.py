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
