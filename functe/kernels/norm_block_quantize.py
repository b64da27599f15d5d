"""Norm + block cast in one kernel: LayerNorm or RMSNorm forward, then the rowwise block quantization
of its output for the next block-scaled linear (FP8 block scaling 1x128, NVFP4 1x16): q-in under the
block recipes.

One program normalises ``BLOCK_R`` whole rows exactly as :mod:`functe.kernels.norm` does (the same
device function :func:`functe.kernels.norm.norm_fwd_tile`, the same tiling, so the same bits) and
stores the norm's output ``y`` (x's dtype) and, for LayerNorm, its statistics: the block recipes'
linear quantizes its wgrad copy (``yᵀ``, blocks along the tokens; NVFP4's Hadamard transform) from
the high-precision ``y`` in its backward, so ``y`` is written anyway (TE writes both copies from its
norm kernel too). The same registers then give the row-wise block-quantized GEMM operand: the
rows split into blocks of 128 (or 16) values, each block's amax, scale and cast with the block
kernels' own device functions (:func:`functe.kernels.block_quantize.fp8_block_scale`,
:func:`functe.kernels.nvfp4.nvfp4_block_scales`, ...). A row shorter than a block is one
(zero-padded) block, as in the block kernels.

So ``norm_fp8_block_cast(x, ...)`` equals ``fp8_block_cast(norm(x), ...)`` and
``norm_nvfp4_cast(x, ..., amax)`` equals ``nvfp4_cast(norm(x), amax, ...)`` bit for bit, on the Triton
kernels and on the twins (whose twins *are* those compositions).

* **FP8 block scaling**: one pass (a 1x128 block lives inside one program's rows).
* **NVFP4**: the block scales need the tensor's amax (its global scale) first, so
  :func:`functe._block_quantize.cast_norm_block` runs the per-tensor norm + amax kernel
  (:data:`functe.kernels.norm_quantize.NORM_CAST_AMAX`, ``write=False``: x read, nothing written)
  and then this kernel: x read twice, ``y`` and ``q`` written once (the unfused pair reads ``y``
  twice more: the amax pass and the cast).

Only the forward's input role: 1-D blocks, round to nearest (no stochastic rounding, nothing
random); ``q`` holds the (partially, for NVFP4: ``e2m1 · s``) dequantized values in a float dtype,
as the GEMM emulation consumes them, or float8 bits for FP8 block scaling.
"""

from __future__ import annotations

import torch
import triton.language as tl

from .._kernel import Kernel
from ._common import as_rows, compute_dtype, tl_compute_dtype
from ._triton import cdiv, jit
from .block_quantize import BLOCK as FP8_BLOCK
from .block_quantize import fp8_block_cast_ref, fp8_block_scale, inf_scale, nan_max
from .norm import (
    _tiling,
    check_norm_bias,
    check_norm_params,
    layer_norm_ref,
    mean_count,
    new_stats,
    norm_fwd_tile,
    rms_norm_ref,
    store_stats,
)
from .nvfp4 import BLOCK as NVFP4_BLOCK
from .nvfp4 import global_scales, nvfp4_block_scales, nvfp4_cast_ref, round_e2m1
from .quantize import _storage, encode_fp8, fp8_constexprs, round_to_fp8, saturate

Tensor = torch.Tensor

KINDS = ("layer", "rms")


@jit
def _norm_block_cast_kernel(
    X,
    W,
    B,
    AMAX,
    Y,
    Q,
    S,
    MEAN,
    RSTD,
    n_rows,
    n_cols,
    n_blocks,
    count,
    eps,
    amax_eps,
    CENTER: tl.constexpr,
    HAS_B: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    NVFP4: tl.constexpr,
    POW2: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    SUB_STEPS: tl.constexpr,
    MAXV: tl.constexpr,
    INF_SCALE: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CB: tl.constexpr,
    COMPUTE: tl.constexpr,
):
    pid = tl.program_id(0)
    y, offs, mask, rows, mean, r = norm_fwd_tile(
        X, W, B, pid, n_rows, n_cols, count, eps, CENTER, True, HAS_B, ZERO_CENTERED, BLOCK_R, BLOCK_N, COMPUTE
    )
    y = y.to(Y.dtype.element_ty)  # what the unfused norm stores, and what its block cast reads
    tl.store(Y + offs, y, mask=mask)
    if CENTER:  # LayerNorm's statistics, as the unfused LayerNorm stores them
        store_stats(MEAN, RSTD, rows, n_rows, mean, r)
    # The row tile as [rows, blocks, values per block] (masked lanes are 0: zero-padded blocks).
    v = tl.reshape(tl.where(mask, y.to(tl.float32), 0.0), (BLOCK_R, BLOCK_N // CB, CB))
    block_amax = nan_max(v, 2)
    if NVFP4:
        ge, gd = global_scales(tl.load(AMAX).to(tl.float32))
        s, enc = nvfp4_block_scales(block_amax, ge, gd)
        q = round_e2m1(saturate(v * enc[:, :, None], 6.0)) * s[:, :, None]
        s_out = encode_fp8(s, 3, 7, 0.015625, 512.0)  # the E4M3 block scales, as bits
    else:
        scale, scale_inv = fp8_block_scale(block_amax, amax_eps, MAXV, POW2, INF_SCALE)
        q = round_to_fp8(saturate(v * scale[:, :, None], MAXV), MANT, MIN_NORMAL, SUB_STEPS)
        if BITS:
            q = encode_fp8(q, MANT, BIAS, MIN_NORMAL, SUB_STEPS)
        else:  # the dequantized value (exact for power-of-two scales), for the GEMM emulation
            q = q * scale_inv[:, :, None]
        s_out = scale_inv
    tl.store(Q + offs, tl.reshape(q, (BLOCK_R, BLOCK_N)).to(Q.dtype.element_ty), mask=mask)
    blocks = tl.arange(0, BLOCK_N // CB)
    smask = (rows < n_rows)[:, None] & (blocks < n_blocks)[None, :]
    tl.store(S + rows[:, None] * n_blocks + blocks[None, :], s_out.to(S.dtype.element_ty), mask=smask)


def _launch(x, weight, bias, amax, eps, kind, zero_centered_gamma, nvfp4, qdtype, out_dtype, pow2, amax_eps):
    """``(y, q, block scales, mean, rstd)`` (see :func:`norm_fp8_block_cast` / :func:`norm_nvfp4_cast`)."""
    check_norm_params(kind, x, weight, bias)
    rows = as_rows(x)
    n_rows, n_cols = rows.shape
    block = NVFP4_BLOCK if nvfp4 else FP8_BLOCK
    n_blocks = cdiv(n_cols, block)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    q = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    s_dtype = torch.float8_e4m3fn if nvfp4 else torch.float32
    scales = torch.empty((*x.shape[:-1], n_blocks), dtype=s_dtype, device=x.device)
    mean, rstd = new_stats(x, kind)
    if rows.numel() == 0:
        return y, q, scales, mean, rstd
    block_r, block_n, warps = _tiling(x, kind)  # the norm kernels' tiling: the same reductions
    fmt = fp8_constexprs(qdtype, out_dtype)
    _norm_block_cast_kernel[(cdiv(n_rows, block_r),)](
        rows,
        weight.contiguous(),
        rows if bias is None else bias.contiguous(),
        rows if amax is None else amax.to(torch.float32),
        y,
        _storage(q),
        scales.view(torch.uint8) if nvfp4 else scales,
        mean,
        rstd,
        n_rows,
        n_cols,
        n_blocks,
        mean_count(kind, n_cols),
        eps,
        amax_eps,
        CENTER=kind == "layer",
        HAS_B=bias is not None,
        ZERO_CENTERED=zero_centered_gamma,
        NVFP4=nvfp4,
        POW2=pow2,
        INF_SCALE=inf_scale(x.dtype),  # (y, which the cast reads, has x's dtype)
        **fmt,
        BLOCK_R=block_r,
        BLOCK_N=block_n,
        CB=min(block_n, block),  # a row shorter than a block: one block
        COMPUTE=tl_compute_dtype(x.dtype),
        num_warps=warps,
    )
    return y, q, scales, mean, rstd


def _norm_ref(x, weight, bias, eps, kind, zero_centered_gamma):
    """The unfused norm's twin: ``(y, mean, rstd)`` (empty statistics for RMSNorm)."""
    check_norm_bias(kind, bias)
    if kind == "layer":
        return layer_norm_ref(x, weight, bias, eps, zero_centered_gamma)
    empty = torch.empty((0,), dtype=compute_dtype(x.dtype), device=x.device)
    return rms_norm_ref(x, weight, eps, zero_centered_gamma), empty, empty.clone()


def norm_fp8_block_cast(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    eps: float,
    kind: str,
    zero_centered_gamma: bool,
    qdtype: torch.dtype,
    out_dtype: torch.dtype,
    pow2: bool,
    amax_epsilon: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(y, q, scale_inv, mean, rstd)``: ``y = norm(x)`` (``kind`` ``"layer"``: LayerNorm with ``bias``;
    ``"rms"``: RMSNorm), and its FP8 block cast with 1x128 blocks along the last dim.

    ``q``: ``fp8(clamp(y·scale, ±max))`` per block (TE's ``compute_scale_from_amax``, ``pow2``
    power-of-two scales, ``amax_epsilon``), float8 bits for a float8 ``out_dtype`` else the
    dequantized values; ``scale_inv`` ``f32[..., ceil(N/128)]``; ``mean``/``rstd`` LayerNorm's
    statistics (``x.shape[:-1]``; empty for RMSNorm).
    """
    return _launch(x, weight, bias, None, eps, kind, zero_centered_gamma, False, qdtype, out_dtype, pow2, amax_epsilon)


def norm_fp8_block_cast_ref(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    eps: float,
    kind: str,
    zero_centered_gamma: bool,
    qdtype: torch.dtype,
    out_dtype: torch.dtype,
    pow2: bool,
    amax_epsilon: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """PyTorch twin of :func:`norm_fp8_block_cast`: the norm twin, then the block cast twin."""
    y, mean, rstd = _norm_ref(x, weight, bias, eps, kind, zero_centered_gamma)
    q, scale_inv = fp8_block_cast_ref(y, "", 0.0, 0.0, 0.0, qdtype, out_dtype, pow2, amax_epsilon)
    return y, q, scale_inv, mean, rstd


def norm_nvfp4_cast(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    amax: Tensor,
    eps: float,
    kind: str,
    zero_centered_gamma: bool,
    out_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(y, q, scales, mean, rstd)``: ``y = norm(x)`` and its NVFP4 cast with 1x16 blocks, given
    ``amax = max|y|`` (f32[], from a first pass): ``q = e2m1 · s`` in the float ``out_dtype`` (the
    caller applies the global decode scale), ``scales`` the E4M3 block scales ``[..., ceil(N/16)]``,
    round to nearest."""
    return _launch(
        x, weight, bias, amax, eps, kind, zero_centered_gamma, True, torch.float8_e4m3fn, out_dtype, False, 0.0
    )


def norm_nvfp4_cast_ref(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    amax: Tensor,
    eps: float,
    kind: str,
    zero_centered_gamma: bool,
    out_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """PyTorch twin of :func:`norm_nvfp4_cast`: the norm twin, then the NVFP4 cast twin."""
    y, mean, rstd = _norm_ref(x, weight, bias, eps, kind, zero_centered_gamma)
    no_seed = torch.zeros((), dtype=torch.int64, device=x.device)  # (round to nearest: no bits drawn)
    q, scales = nvfp4_cast_ref(y, amax, no_seed, "", 0.0, 0.0, 0.0, 1, False, out_dtype)
    return y, q, scales, mean, rstd


# The NVFP4 cast reads a tensor-wide amax and both kernels' statistics follow x's rows; under vmap
# the twins are vmapped (as for NORM_CAST_AMAX).
NORM_FP8_BLOCK_CAST = Kernel("norm_fp8_block_cast", norm_fp8_block_cast, norm_fp8_block_cast_ref, quantizes=True)
NORM_NVFP4_CAST = Kernel("norm_nvfp4_cast", norm_nvfp4_cast, norm_nvfp4_cast_ref, quantizes=True)

__all__ = ["KINDS", "NORM_FP8_BLOCK_CAST", "NORM_NVFP4_CAST"]
