"""Block-scaled quantization at the recipe level: FP8 block scaling and NVFP4.

The casts used inside quantized ops have the shape of the per-tensor ones in
:mod:`functe._quantize` (``cast(x, recipe, role, scale, out_dtype)`` and
``cast_act(x, act, recipe, role, scale, out_dtype, *, limit, alpha, offset)``, each returning
``(q, scale, amax)``), so an op or a fusion rule handles every recipe alike:

* ``q`` is the GEMM operand in ``out_dtype`` (bf16 or fp32): the *dequantized* block values
  (FP8 block scaling: ``fp8 · scale_inv``; NVFP4: ``e2m1 · e4m3 block scale``), exact in that
  dtype wherever the recipe allows (see :func:`operand_dtype`);
* ``scale`` is what remains per tensor: ``None`` for FP8 block scaling, NVFP4's global encode
  scale (the GEMM multiplies its result by ``1 / scale``, as the tensor cores' alpha does);
* ``amax`` is the tensor's ``max|v|`` where the recipe measures it (NVFP4), else ``None``.

Block recipes are stateless: ``scale`` (the argument) must be ``None``. The role picks the
layout: ``"weight"`` gets 2-D blocks (128x128, NVFP4 16x16 unless disabled; ``x`` must be a
matrix), other roles 1-D blocks along the last dim; NVFP4 rounds ``"grad_output"``
stochastically unless disabled, with the bits of ``seed``. The wgrad copies (blocks along the
token dim, NVFP4's random Hadamard transform) are built by :func:`wgrad_operand`.
"""

from __future__ import annotations

import torch

from ._errors import ArgumentError, ShapeError, describe, dtype_error
from ._recipe import Float8BlockScaling, NVFP4BlockScaling
from .kernels.block_quantize import FP8_BLOCK_ACT_CAST_KEEP, FP8_BLOCK_CAST, FP8_BLOCK_CAST_2D, FP8_BLOCK_DEQUANTIZE
from .kernels.hadamard import RHT16, RHT_SIZE
from .kernels.norm_block_quantize import NORM_FP8_BLOCK_CAST, NORM_NVFP4_CAST
from .kernels.norm_quantize import NORM_CAST_AMAX
from .kernels.nvfp4 import NVFP4_CAST, NVFP4_DEQUANTIZE, global_scales_ref
from .kernels.quantize import ACT_OUTPUT_AMAX, ACT_OUTPUT_CAST_AMAX, CAST_AMAX

Tensor = torch.Tensor

BlockRecipe = Float8BlockScaling | NVFP4BlockScaling

# Streams of one linear's seed: each random draw gets its own key (seed ^ stream). Two seeds share a
# stream only if they differ by the XOR of two of these (or one of them): 63-bit constants whose
# pairwise XORs are far from any seed difference a step counter or a layer index makes (they were
# 0x52485400, 0x53520001 and 0x53520002: seeds 3 and 0 swapped their dgrad and wgrad bits).
RHT_STREAM, SR_DGRAD_STREAM, SR_WGRAD_STREAM = 0x2545_F491_4F6C_DD1D, 0x6A09_E667_F3BC_C908, 0x3C6E_F372_FE94_F82B

_NO_ACT = ("", (0.0, 0.0, 0.0))


def operand_dtype(recipe: BlockRecipe, dtype: torch.dtype) -> torch.dtype:
    """The emulated GEMM's operand dtype: bf16 for bf16 outputs where the dequantized values are
    exact in bf16 (NVFP4's ``e2m1 · e4m3``; FP8 values times power-of-two scales), else fp32."""
    if dtype == torch.bfloat16 and (isinstance(recipe, NVFP4BlockScaling) or recipe.power_2_scales):
        return torch.bfloat16
    return torch.float32


def _zero_seed(like: Tensor) -> Tensor:
    return torch.zeros((), dtype=torch.int64, device=like.device)


def _stochastic(recipe: BlockRecipe, role: str) -> bool:
    return isinstance(recipe, NVFP4BlockScaling) and role == "grad_output" and not recipe.disable_stochastic_rounding


def _quantize(x, act, params, recipe, role, out_dtype, seed, op="cast_block"):
    """(q, scale, amax, block scales) of ``v = act(x)`` for ``role`` (the one place a recipe picks its kernels)."""
    rows, _ = recipe.block_shape(role)
    if isinstance(recipe, Float8BlockScaling):
        qdtype, pow2, eps = recipe.dtype(role), recipe.power_2_scales, float(recipe.amax_epsilon)
        if rows > 1:
            q, block_scales = FP8_BLOCK_CAST_2D(x, qdtype, out_dtype, pow2, eps)
        else:
            q, block_scales = FP8_BLOCK_CAST(x, act, *params, qdtype, out_dtype, pow2, eps)
        return q, None, None, block_scales
    # NVFP4: the tensor's amax first (the activation recomputed, not stored), then the cast.
    one, fp8 = torch.ones((), device=x.device), torch.float8_e4m3fn
    if act:  # the amax of the activation's value rounded to x's dtype, as the cast kernel sees it
        _, amax = ACT_OUTPUT_CAST_AMAX(x, one, act, *params, fp8, fp8, False)
    else:
        _, amax = CAST_AMAX(x, one, fp8, fp8, False)
    return _nvfp4(x, amax, act, params, recipe, role, out_dtype, seed, op)


def _nvfp4(x, amax, act, params, recipe, role, out_dtype, seed, op):
    """NVFP4's second pass, given the tensor amax: (q, global encode scale, amax, block scales)."""
    rows, _ = recipe.block_shape(role)
    stochastic = _stochastic(recipe, role)
    if stochastic and seed is None:
        raise ArgumentError(
            f"functe.{op}: argument 'seed' expected a Python int or an int64 tensor: NVFP4BlockScaling rounds "
            "gradients stochastically and needs a seed (or disable_stochastic_rounding=True), got None"
        )
    seed = _zero_seed(x) if seed is None else seed
    q, block_scales = NVFP4_CAST(x, amax, seed, act, *params, rows, stochastic, out_dtype)
    return q, global_scales_ref(amax)[0], amax, block_scales


def _check(x: Tensor, recipe: BlockRecipe, role: str, scale, op: str) -> None:
    if scale is not None:
        raise ArgumentError(f"functe.{op}: {type(recipe).__name__} is stateless; argument 'scale' must be None")
    if x.dim() < 1:
        raise ShapeError(f"functe.{op}: argument 'x' expected rank >= 1 (blocks along the last dim), got {describe(x)}")
    if recipe.block_shape(role)[0] > 1 and x.dim() != 2:
        raise ShapeError(
            f"functe.{op}: argument 'x' expected a matrix for role {role!r} (2-D blocks), got {describe(x)}"
        )


def _check_act(x: Tensor, recipe: BlockRecipe, role: str, scale, op: str) -> None:
    _check(x, recipe, role, scale, op)
    if recipe.block_shape(role)[0] > 1:
        raise ArgumentError(f"functe.{op}: role {role!r} uses 2-D blocks; activations are 1-D blocked inputs")


def cast_block(x: Tensor, recipe: BlockRecipe, role: str, scale: None, out_dtype: torch.dtype, *, seed=None):
    """``x`` quantized for ``role`` as a GEMM operand: ``(q, scale, amax)`` (see the module docstring)."""
    _check(x, recipe, role, scale, "cast_block")
    q, s, amax, _ = _quantize(x, *_NO_ACT, recipe, role, out_dtype, seed)
    return q, s, amax


def cast_act_block(
    x: Tensor,
    act: str,
    recipe: BlockRecipe,
    role: str,
    scale: None,
    out_dtype: torch.dtype,
    *,
    limit: float = 7.0,
    alpha: float = 1.702,
    offset: float = 1.0,
):
    """``act(x)`` quantized for ``role`` in the activation's own kernels: ``(q, scale, amax)``.

    FP8 block scaling: one kernel (activation, 1x128 block amax, scale, cast). NVFP4: the
    activation's amax pass, then one kernel for the activation, block scales and cast. ``act`` is
    any elementwise or gated activation of :mod:`functe.kernels._act`, or ``"clamped_swiglu"``.
    Activations feed a GEMM as its input, so ``role`` must not be ``"weight"``.
    """
    _check_act(x, recipe, role, scale, "cast_act_block")
    q, s, amax, _ = _quantize(x, act, (limit, alpha, offset), recipe, role, out_dtype, None)
    return q, s, amax


def cast_act_block_keep(
    x: Tensor,
    act: str,
    recipe: BlockRecipe,
    role: str,
    scale: None,
    out_dtype: torch.dtype,
    *,
    limit: float = 7.0,
    alpha: float = 1.702,
    offset: float = 1.0,
):
    """:func:`cast_act_block` that also returns the activation's output: ``(h, q, scale, amax)``.

    ``h`` is ``act(x)`` in x's dtype, the activation op's output bit for bit, and ``q, scale, amax``
    equal ``cast_block(h, ...)`` bit for bit; ``h`` is written by the quantizing kernels themselves:

    * FP8 block scaling: **one kernel** reads ``x`` and writes ``h``, ``q`` and the 1x128 block
      scales (``FP8_BLOCK_ACT_CAST_KEEP``);
    * NVFP4: the amax pass writes ``h`` (``ACT_OUTPUT_AMAX``: ``x`` read, ``h`` written, the tensor
      amax), then the cast reads ``h`` (``NVFP4_CAST``, no activation recomputed).

    So the activation + its block cast moves, per output element, ``x`` once and ``h`` once (+ ``h``
    read again for NVFP4's second pass) instead of the activation op's ``x`` + ``h`` followed by the
    cast's reads of ``h`` (one, NVFP4: two). Inputs f32/f16/bf16 (the block recipes' dtypes).
    """
    _check_act(x, recipe, role, scale, "cast_act_block_keep")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):  # the kernels' h is computed in fp32
        raise dtype_error("cast_act_block_keep", "x", "dtype f32|f16|bf16", x)
    params = (limit, alpha, offset)
    if isinstance(recipe, Float8BlockScaling):
        qdtype, pow2, eps = recipe.dtype(role), recipe.power_2_scales, float(recipe.amax_epsilon)
        h, q, _ = FP8_BLOCK_ACT_CAST_KEEP(x, act, *params, qdtype, out_dtype, pow2, eps)
        return h, q, None, None
    h, amax = ACT_OUTPUT_AMAX(x, act, *params)
    q, s, amax, _ = _nvfp4(h, amax, *_NO_ACT, recipe, role, out_dtype, None, "cast_act_block_keep")
    return h, q, s, amax


def cast_norm_block(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    kind: str,
    eps: float,
    zero_centered_gamma: bool,
    recipe: BlockRecipe,
    role: str,
    scale: None,
    out_dtype: torch.dtype,
):
    """``y = norm(x)`` and ``y`` quantized for ``role`` in the norm's own kernel: ``(y, q, scale, amax, stats)``.

    ``kind`` ``"layer"`` (LayerNorm, ``bias`` = β) or ``"rms"`` (RMSNorm, ``bias`` None); ``x`` a
    ``[rows, N]`` matrix. ``y`` (x's dtype) is the norm's output, which the block recipes' linear
    keeps for its wgrad copy; ``q, scale, amax`` equal ``cast_block(y, ...)`` bit for bit and
    ``stats`` is LayerNorm's ``(mean, rstd)`` (``()`` for RMSNorm), the bits the unfused norm returns.
    FP8 block scaling: one kernel. NVFP4: the norm + amax kernel first (nothing written), then the
    norm + cast kernel (:mod:`functe.kernels.norm_block_quantize`). 1-D blocks, round to nearest:
    ``role`` is a forward role other than ``"weight"``.
    """
    _check(x, recipe, role, scale, "cast_norm_block")
    if recipe.block_shape(role)[0] > 1 or _stochastic(recipe, role):
        raise ArgumentError(f"functe.cast_norm_block: role {role!r}: norms feed a GEMM as its (1-D blocked) input")
    if isinstance(recipe, Float8BlockScaling):
        qdtype, pow2, eps_amax = recipe.dtype(role), recipe.power_2_scales, float(recipe.amax_epsilon)
        y, q, _, mean, rstd = NORM_FP8_BLOCK_CAST(
            x, weight, bias, eps, kind, zero_centered_gamma, qdtype, out_dtype, pow2, eps_amax
        )
        s, amax = None, None
    else:
        one, fp8 = torch.ones((), device=x.device), torch.float8_e4m3fn
        _, _, _, amax = NORM_CAST_AMAX(x, weight, bias, one, eps, kind, zero_centered_gamma, fp8, fp8, False)
        y, q, _, mean, rstd = NORM_NVFP4_CAST(x, weight, bias, amax, eps, kind, zero_centered_gamma, out_dtype)
        s = global_scales_ref(amax)[0]
    return y, q, s, amax, ((mean, rstd) if kind == "layer" else ())


def wgrad_operand(t2: Tensor, recipe: BlockRecipe, role: str, out_dtype: torch.dtype, seed: Tensor | None):
    """The wgrad ("columnwise") operand of a ``[M, C]`` matrix: ``t2ᵀ`` quantized along M, ``(q, scale)``.

    NVFP4 with the random Hadamard transform zero-pads M to a multiple of 16 and multiplies every 16
    values along M by ``Q`` (the same ``Q`` for both wgrad operands, so ``Q Qᵀ = I`` cancels in
    ``dW = dyᵀ x``); gradients are rounded stochastically (their own stream of ``seed``).
    """
    t = t2.t()
    if isinstance(recipe, NVFP4BlockScaling) and not recipe.disable_rht:
        pad = (-t.shape[1]) % RHT_SIZE
        if pad:
            t = torch.nn.functional.pad(t, (0, pad))
        t = RHT16(t, seed ^ RHT_STREAM, False, torch.float32)
    sr_seed = seed ^ SR_WGRAD_STREAM if _stochastic(recipe, role) else None
    q, scale, _, _ = _quantize(t, *_NO_ACT, recipe, role, out_dtype, sr_seed)
    return q, scale


# ----------------------------------------------------------------------------- public conversions


def quantize_block(x: Tensor, recipe: BlockRecipe, role: str, seed: Tensor | None):
    """``(data, scale_inv, block_scales)`` for :func:`functe.quantize` under a block recipe.

    FP8 block scaling: float8 data, ``None``, fp32 ``scale_inv`` per block. NVFP4: packed E2M1
    codes (``u8[..., K/2]``), the global decode scale ``f32[]`` and the E4M3 block scales.
    """
    _check(x, recipe, role, None, "quantize")
    if isinstance(recipe, Float8BlockScaling):
        data, _, _, block_scales = _quantize(x, *_NO_ACT, recipe, role, recipe.dtype(role), None)
        return data, None, block_scales
    if x.shape[-1] % 2:
        raise ShapeError(
            "functe.quantize: argument 'x' expected an even last dim for NVFP4 (two values per byte), "
            f"got {describe(x)}"
        )
    data, encode, _, block_scales = _quantize(x, *_NO_ACT, recipe, role, torch.uint8, seed, "quantize")
    return data, torch.ones_like(encode) / encode, block_scales


def _block_rows(data_shape: torch.Size, block_scales: Tensor, block: int) -> int:
    """1 for 1-D block scales ``[..., ceil(K/b)]``, ``block`` for 2-D ones ``[ceil(M/b), ceil(K/b)]``.

    The layouts differ in their leading size except for one-row matrices, where they mean the same.
    """
    two_d = len(data_shape) == 2 and block_scales.shape[0] != data_shape[0]
    return block if two_d else 1


def dequantize_block(data: Tensor, scale_inv: Tensor | None, block_scales: Tensor) -> Tensor:
    """The fp32 values of block-quantized data (FP8 block scaling or NVFP4, told apart by the scales' dtype)."""
    if block_scales.dtype == torch.float8_e4m3fn:
        rows = _block_rows(data.shape, block_scales, 16)
        return NVFP4_DEQUANTIZE(data, block_scales, scale_inv, rows, torch.float32)
    rows = _block_rows(data.shape, block_scales, 128)
    return FP8_BLOCK_DEQUANTIZE(data, block_scales, rows, torch.float32)
