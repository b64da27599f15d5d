"""The quantized linear under the block recipes (FP8 block scaling, NVFP4), TransformerEngine's way.

``functe.ops.fp8_linear`` dispatches here for :class:`functe.Float8BlockScaling` and
:class:`functe.NVFP4BlockScaling`. As in TE, every GEMM operand is quantized along that GEMM's
reduction dimension, each copy from the high-precision tensor:

==========  ======================  ==========================  ==============================
GEMM        operands                FP8 block scaling           NVFP4
==========  ======================  ==========================  ==============================
fprop       x, W                    x 1x128, W 128x128          x 1x16, W 16x16
dgrad       dy, W (transposed)      dy 1x128, the same W_q      dy 1x16 (stochastic rounding);
                                    (2-D blocks: W_qᵀ = (Wᵀ)_q)  the same W_q (1x16 W: Wᵀ again)
wgrad       dyᵀ, xᵀ (along tokens)  1x128 along M               RHT along M, then 1x16
                                                                (dyᵀ: stochastic rounding)
==========  ======================  ==========================  ==============================

The GEMMs are emulated exactly through dequantized operands (:func:`functe._fp8_gemm.gemm_nt`
with fp32 accumulation; the values are exact in the operand dtype, see
:func:`functe._block_quantize.operand_dtype`); NVFP4's per-tensor decode scales multiply the
GEMM's result, as the tensor cores' alpha does. The randomness (RHT signs, stochastic rounding)
comes from the ``seed`` argument, one independent stream per use.
"""

from __future__ import annotations

import torch

from .._block_quantize import SR_DGRAD_STREAM, BlockRecipe, cast_block, operand_dtype, wgrad_operand
from .._errors import ArgumentError
from .._fp8_gemm import gemm_nt
from .._recipe import NVFP4BlockScaling
from .._seed import seed_tensor
from .._trace import tracing
from .._vjp import custom_vjp, differentiated
from .._vjp_guard import quantized_first_order
from ..kernels._common import rows_view
from ..kernels.elementwise import BIAS_GRAD

Tensor = torch.Tensor


def _inv(scale: Tensor | None) -> Tensor | None:
    return None if scale is None else torch.ones_like(scale) / scale


def _fwd(x, weight, bias, seed, *, recipe):
    xq, sx, _ = cast_block(rows_view(x), recipe, "input", None, operand_dtype(recipe, x.dtype))
    return forward_quantized(x, xq, sx, weight, bias, seed, recipe=recipe)


def forward_quantized(x, xq, sx, weight, bias, seed, *, recipe):
    """The forward rule after the input cast: ``(y, residuals)`` from ``xq`` (x's rows quantized, with
    the per-tensor scale ``sx`` of :func:`functe._block_quantize.cast_block`).

    Fused ops that produce the quantized input themselves (norm or activation + block cast: q-in) call
    this, so their residuals are exactly the ones the backward rule expects. ``x`` is the
    high-precision input, a residual: the backward quantizes its wgrad copy from it.
    """
    dtype = operand_dtype(recipe, x.dtype)
    wq, sw, _ = cast_block(weight, recipe, "weight", None, dtype)
    y = gemm_nt(xq, _inv(sx), wq, _inv(sw), out_dtype=x.dtype, bias=bias)
    # 2-D weight blocks are the same for W and Wᵀ: dgrad reuses W_q (an intermediate residual, so
    # second derivatives raise, as for every quantized linear). 1-D blocks run along K, and dgrad
    # quantizes Wᵀ afresh: W_q is not kept (a dead residual held a weight-sized copy until backward).
    reuse = recipe.block_shape("weight")[0] > 1
    residuals = (x, weight, wq if reuse else None, _inv(sw) if reuse else None, seed, bias is not None)
    return y.reshape(*x.shape[:-1], weight.shape[0]), residuals


def _bwd(res, dy, *, recipe, needs_input_grad=(True,) * 4):
    x, weight, wq, sinv_w, seed, has_bias = res
    dy2, out_dtype = rows_view(dy), dy.dtype  # (the cotangent has the output's dtype, which is x's)
    dtype = operand_dtype(recipe, out_dtype)
    dx = dw = None
    if needs_input_grad[0]:  # dgrad (skipped, with its casts, when x is frozen)
        sr_seed = None if seed is None else seed ^ SR_DGRAD_STREAM
        dyq, sdy, _ = cast_block(dy2, recipe, "grad_output", None, dtype, seed=sr_seed)
        if recipe.block_shape("weight")[0] > 1:
            wt, sinv_wt = wq.t(), sinv_w
        else:  # 1-D weight blocks run along K: dgrad needs Wᵀ quantized along N
            wt, swt, _ = cast_block(weight.t(), recipe, "weight", None, dtype)
            sinv_wt = _inv(swt)
        dx = gemm_nt(dyq, _inv(sdy), wt, sinv_wt, out_dtype=out_dtype).reshape(*dy.shape[:-1], weight.shape[1])
    if needs_input_grad[1]:  # wgrad (its RHT and stochastic rounding included)
        dyt, sdyt = wgrad_operand(dy2, recipe, "grad_output", dtype, seed)
        xt, sxt = wgrad_operand(rows_view(x), recipe, "input", dtype, seed)
        dw = gemm_nt(dyt, _inv(sdyt), xt, _inv(sxt), out_dtype=out_dtype)
    dbias = BIAS_GRAD(dy2) if has_bias else None
    return dx, dw, dbias, None


def _prune(res, *, recipe, needs_input_grad):
    """The residuals the wanted gradients read: wgrad the input (and the seed), dgrad the weight and
    its quantized copy."""
    want_dx, want_dw = needs_input_grad[:2]
    if want_dx and want_dw:
        return res
    x, weight, wq, sinv_w, seed, has_bias = res
    kept_w = (weight, wq, sinv_w) if want_dx else (None, None, None)
    return (x if want_dw else None, *kept_w, seed, has_bias)


_block_linear = custom_vjp(
    "block_linear", quantized_first_order(_fwd, "block_linear"), _bwd, needs_input_grad=True, prune_residuals=_prune
)


def block_linear(x: Tensor, weight: Tensor, bias: Tensor | None, *, recipe: BlockRecipe, seed) -> Tensor:
    """The block-scaled quantized linear (arguments already validated by ``fp8_linear``, except the seed)."""
    if isinstance(recipe, NVFP4BlockScaling) and recipe.uses_seed:
        if seed is None and not any(map(differentiated, (x, weight, bias))) and not tracing():
            # (inference: the draws are the gradients' own, RHT on the wgrad operands and SR on dy;
            # a vmap level alone takes no gradient, a served ensemble; a trace's plan may serve
            # training calls, so a fused function still needs the seed)
            return _block_linear(x, weight, bias, None, recipe=recipe)
        if seed is None:
            raise ArgumentError(
                "functe.fp8_linear: argument 'seed' expected a Python int or an int64 tensor: NVFP4BlockScaling draws "
                "random bits (random Hadamard transform, stochastic rounding); pass a new seed each step, or disable "
                "both in the recipe"
            )
        seed = seed_tensor(seed, x, "fp8_linear")
    else:
        seed = None  # deterministic recipe: nothing to draw
    return _block_linear(x, weight, bias, seed, recipe=recipe)
