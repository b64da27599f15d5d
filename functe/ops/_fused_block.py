"""Fused ops around the block-scaled linear (FP8 block scaling, NVFP4): q-in forwards.

A norm or an activation whose only consumer is a ``block_linear`` (``fp8_linear`` under
:class:`functe.Float8BlockScaling` / :class:`functe.NVFP4BlockScaling`) emits the linear's row-wise
(fprop) operand already block-quantized, in its own kernel, and the block GEMM takes it
(:func:`functe.ops._block_linear.forward_quantized`, the tail of ``block_linear``'s forward rule).

Unlike the per-tensor q-in ops (:mod:`functe.ops._fused_fp8`), these also produce the producer's
high-precision output: the block recipes' backward quantizes the wgrad copy (``hᵀ`` with blocks
along the tokens; NVFP4: after the random Hadamard transform with the linear's seed) from it, so it
is ``block_linear``'s residual. Recomputing it in the backward instead is not open to a *forward*
fusion: the backward plan is chosen independently and consumes exactly the covered ops' residuals
(``docs/fusion.md``), and ``block_linear``'s backward reads ``h``.

* **norm → block_linear**: one kernel writes ``y``, LayerNorm's statistics and the quantized
  operand (:func:`functe._block_quantize.cast_norm_block`; NVFP4 runs the norm + amax kernel
  first); the unfused pair reads ``y`` back once (FP8 block) or twice (NVFP4: amax, cast).
* **activation → block_linear**: the quantizing kernels write ``h`` themselves
  (:func:`functe._block_quantize.cast_act_block_keep`): FP8 block scaling one kernel (``x`` read,
  ``h``, ``q`` and the block scales written); NVFP4 the amax pass writes ``h`` and the cast reads it
  back once. The unfused pair reads ``h`` back once (FP8 block) or twice (NVFP4) more.

Both equal the unfused pair bit for bit (outputs, residuals, gradients): the kernels round the
producer's value to its dtype before the block amax and the cast.
"""

from __future__ import annotations

import functools

import torch

from .._block_quantize import cast_act_block_keep, cast_norm_block, operand_dtype
from .._vjp import custom_vjp
from .._vjp_guard import quantized_first_order
from ..kernels._common import rows_view
from . import _block_linear as block
from ._fused import q_in_activation_backward, q_in_norm_backward

Tensor = torch.Tensor


# ----------------------------------------------------------------------------- q-in: norm -> block_linear


def _forward_norm_block_linear_fwd(
    x, norm_weight, norm_bias, weight, bias, seed, *, kind, eps, zero_centered_gamma, recipe
):
    h, xq, sx, _, stats = cast_norm_block(
        rows_view(x), norm_weight, norm_bias, kind, eps, zero_centered_gamma, recipe, "input", None,
        operand_dtype(recipe, x.dtype),
    )  # fmt: skip
    y, lin_res = block.forward_quantized(h.view(x.shape), xq, sx, weight, bias, seed, recipe=recipe)
    # The norm's residuals (its inputs, and LayerNorm's statistics in its output's shape), block_linear's.
    norm_res = (x, norm_weight, *(s.view(x.shape[:-1]) for s in stats))
    return y, (norm_res, lin_res)


# (backward: block_linear's rule, its wgrad copy from the saved norm output, then the norm's)
forward_norm_block_linear = custom_vjp(
    "forward_norm_block_linear",
    quantized_first_order(_forward_norm_block_linear_fwd, "forward_norm_block_linear"),
    functools.partial(q_in_norm_backward, block._block_linear),
)
"""``block_linear(norm(x, norm_weight[, norm_bias]), weight, bias, seed)`` with the norm's output
block-quantized in the norm kernel (q-in). Covers ``layer_norm | rms_norm, block_linear``."""


# ----------------------------------------------------------------------------- q-in: activation -> block_linear


def _forward_activation_block_linear_fwd(x, weight, bias, seed, *, name, limit, alpha, offset, recipe):
    # h (block_linear's residual: its wgrad copy) comes out of the quantizing kernels, bit for bit the
    # activation op's output: FP8 block one kernel, NVFP4 the amax pass writes it and the cast reads it.
    params = {"limit": limit, "alpha": alpha, "offset": offset}
    dtype = operand_dtype(recipe, x.dtype)
    h, xq, sx, _ = cast_act_block_keep(rows_view(x), name, recipe, "input", None, dtype, **params)
    y, lin_res = block.forward_quantized(h.view(*x.shape[:-1], h.shape[-1]), xq, sx, weight, bias, seed, recipe=recipe)
    return y, ((x, None), lin_res)  # (x, None): the activation op's residuals (its input, no row scale)


forward_activation_block_linear = custom_vjp(
    "forward_activation_block_linear",
    quantized_first_order(_forward_activation_block_linear_fwd, "forward_activation_block_linear"),
    functools.partial(q_in_activation_backward, block._block_linear),
)
"""``block_linear(act(x), weight, bias, seed)`` with the activation's output block-quantized in the
activation kernel (q-in; elementwise, gated and clamped activations, chunked layout). Covers
``activation, block_linear``."""

__all__ = ["forward_activation_block_linear", "forward_norm_block_linear"]
