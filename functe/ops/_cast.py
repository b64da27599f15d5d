"""The ``cast`` op and the autocast casts of the ops' data arguments (see :mod:`functe._autocast`)."""

from __future__ import annotations

import torch

from .._autocast import CASTABLE, DEVICES
from .._vjp import custom_vjp

Tensor = torch.Tensor


def _cast_fwd(x, *, dtype):
    return x.to(dtype), x.dtype


def _cast_bwd(source_dtype, dy, *, dtype):
    return (dy.to(source_dtype),)


cast = custom_vjp("cast", _cast_fwd, _cast_bwd)
"""``cast(x, dtype=d)``: ``x`` in dtype ``d``; its gradient comes back in ``x``'s dtype."""


def autocast_inputs(*tensors):
    """``tensors`` in autocast's dtype when autocast is on for their device, else as they are.

    Non-tensors, ``None`` and fp64 tensors pass through. Example:
        >>> import torch
        >>> from functe.ops._cast import autocast_inputs
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     [t.dtype for t in autocast_inputs(torch.ones(2), torch.ones(2, dtype=torch.float64))]
        [torch.bfloat16, torch.float64]
    """
    if not torch._C._is_any_autocast_enabled():
        return tensors
    device = next((t.device.type for t in tensors if isinstance(t, Tensor)), None)
    if device not in DEVICES or not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(
        cast(t, dtype=dtype) if isinstance(t, Tensor) and t.dtype in CASTABLE and t.dtype != dtype else t
        for t in tensors
    )
