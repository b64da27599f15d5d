"""Dropout with explicit randomness (JAX style: the seed is an argument, there is no global RNG).

The seed travels to the custom_vjp op as a *positional*, non-differentiable
int64 tensor, not as a static keyword: a static value would be baked into a
fused or compiled program and force a retrace whenever it changes (every
step). The kernel reads it from memory, so no host synchronisation happens,
and the mask is recomputed from ``(seed, element index)`` in the backward pass
instead of being stored. The mask is the same on the Triton kernels and the
PyTorch twins (see :mod:`functe.kernels.dropout`).
"""

from __future__ import annotations

import torch

from .._backend import result_view
from .._errors import ArgumentError, check_tensor, python_scalar
from .._seed import seed_tensor
from .._vjp import custom_vjp
from ..kernels._common import static_float
from ..kernels.dropout import DROPOUT
from ._cast import autocast_inputs

Tensor = torch.Tensor


def _dropout_fwd(x, seed, *, p):
    return DROPOUT(x, seed, p), seed


def _dropout_bwd(seed, dy, *, p):
    # dropout is linear in x: its VJP is dropout of dy with the same mask.
    return DROPOUT(dy, seed, p), None


_dropout = custom_vjp("dropout", _dropout_fwd, _dropout_bwd)


def dropout(x: Tensor, p: float, *, seed: int | Tensor) -> Tensor:
    """Zero each element with probability ``p`` and scale the rest by ``1/(1 − p)``.

    The mask is a pure function of ``seed`` and of each element's row-major
    index: the same seed gives the same mask (on the Triton kernels and the
    PyTorch twins alike), a different seed an independent-looking one, and
    under ``vmap`` a batched seed gives each member its own mask. Pass a new
    seed each step (e.g. ``base_seed + step``) and a distinct one per dropout
    site. ``p = 0`` returns ``x`` unchanged; NaN and inf stay NaN where dropped
    (``x·0``), as in ``torch.nn.functional.dropout``.

    Args:
        x: any shape, fp32/fp16/bf16/fp64.
        p: drop probability, a Python number in [0, 1).
        seed: a Python int or an ``int64`` 0-d tensor (on x's device, or on the
            CPU, from where it is copied; in a traced or fused function, on x's device).

    Example:
        >>> import torch
        >>> from functe import ops
        >>> y = ops.dropout(torch.ones(10_000), 0.25, seed=7)
        >>> sorted(set(y.tolist())), round(float((y == 0).float().mean()), 2)
        ([0.0, 1.3333333730697632], 0.25)
        >>> torch.equal(y, ops.dropout(torch.ones(10_000), 0.25, seed=7))
        True
    """
    check_tensor("dropout", "x", x)
    p = python_scalar(p)  # (a numpy float too: np.float32(0.25) was refused)
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
        raise ArgumentError(f"functe.dropout: argument 'p' expected a Python number in [0, 1), got {p!r}")
    seed = seed_tensor(seed, x, "dropout")
    (x,) = autocast_inputs(x)  # (after the checks: they name what the caller passed)
    if p == 0:
        return result_view(x)  # (not x itself: see there)
    return _dropout(x, seed, p=static_float(p))
