"""Norm + FP8 cast in one kernel: LayerNorm or RMSNorm forward, amax and saturating cast (q-in).

TransformerEngine's ``layernorm_fwd`` / ``rmsnorm_fwd`` with an FP8 quantizer: the norm emits its
output already quantized for the next op (the FP8 linear's input). One program normalises
``BLOCK_R`` whole rows exactly as :mod:`functe.kernels.norm` does (same device functions, same
tiling, so the same bits), rounds the result to x's dtype (the value the unfused norm would
store), then records the per-program amax and, with ``write``, stores
``q = fp8(clamp(y * scale, ±fp8_max))`` with :mod:`functe.kernels.quantize`'s rounding. The
per-program amaxes are reduced afterwards (deterministic, no atomics).

So ``norm_cast_amax(x, ...)`` equals ``cast_amax(norm(x), ...)`` bit for bit, on the Triton
kernels and on the twins (whose twin *is* that composition). For LayerNorm it also returns the row
statistics ``mean`` and ``rstd`` the unfused LayerNorm returns (the same bits): its backward takes them.

Scaling recipes (:func:`functe._quantize.cast_norm`):

* **delayed scaling**: the scale is the state's, known before the kernel: one pass reads x and
  writes q (TE fuses this case too);
* **current scaling**: the scale depends on the amax of the whole output. TE runs the norm
  unfused (writes y in high precision), then an amax pass over y, then the cast (read y, write q).
  functe runs this kernel twice instead, ``write=False`` (amax only) then ``write=True`` with the
  scale computed on the device: it recomputes the norm rather than storing and re-reading y
  (x is read twice, q written once: 5 bytes per bf16 element instead of TE's 9), as
  :func:`functe._quantize.cast_act` does for activations.
"""

from __future__ import annotations

import torch
import triton.language as tl

from .._kernel import Kernel
from ._common import as_rows, tl_compute_dtype
from ._triton import cdiv, jit
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
from .quantize import _storage, cast_amax_ref, encode_fp8, fp8_constexprs, round_to_fp8, saturate, tile_amax

Tensor = torch.Tensor

KINDS = ("layer", "rms")


@jit
def _norm_cast_kernel(
    X,
    W,
    B,
    S,
    Q,
    MEAN,
    RSTD,
    AMAX,
    n_rows,
    n_cols,
    count,
    eps,
    CENTER: tl.constexpr,
    HAS_B: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    WRITE: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    SUB_STEPS: tl.constexpr,
    MAXV: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    COMPUTE: tl.constexpr,
):
    pid = tl.program_id(0)
    y, offs, mask, rows, mean, r = norm_fwd_tile(
        X, W, B, pid, n_rows, n_cols, count, eps, CENTER, True, HAS_B, ZERO_CENTERED, BLOCK_R, BLOCK_N, COMPUTE
    )
    if CENTER:  # LayerNorm's statistics, as the unfused LayerNorm stores them
        store_stats(MEAN, RSTD, rows, n_rows, mean, r)
    # What the unfused norm stores (x's dtype), then the quantizing kernel's fp32 arithmetic.
    v = tl.where(mask, y.to(X.dtype.element_ty).to(tl.float32), 0.0)
    col_max, col_nan = tile_amax(v, mask)
    amax = tl.where(tl.max(col_nan, axis=0) > 0, float("nan"), tl.max(col_max, axis=0))
    tl.store(AMAX + pid, amax)
    if WRITE:
        q = round_to_fp8(saturate(v * tl.load(S).to(tl.float32), MAXV), MANT, MIN_NORMAL, SUB_STEPS)
        if BITS:
            q = encode_fp8(q, MANT, BIAS, MIN_NORMAL, SUB_STEPS)
        tl.store(Q + offs, q.to(Q.dtype.element_ty), mask=mask)


def norm_cast_amax(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    scale: Tensor,
    eps: float,
    kind: str,
    zero_centered_gamma: bool,
    qdtype: torch.dtype,
    out_dtype: torch.dtype,
    write: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(q, mean, rstd, amax)`` of ``y = norm(x)`` (``kind`` ``"layer"``: LayerNorm with ``bias``;
    ``"rms"``: RMSNorm).

    ``amax = max|y|`` (f32[], NaN if y has a NaN) of y rounded to x's dtype; with ``write``,
    ``q = fp8(clamp(y * scale, ±max))`` in ``out_dtype`` storage (else an empty tensor). ``mean``
    and ``rstd`` are LayerNorm's statistics (shape ``x.shape[:-1]``, as :func:`functe.kernels.norm.layer_norm`
    returns them); empty for RMSNorm.
    """
    check_norm_params(kind, x, weight, bias)
    rows = as_rows(x)
    n_rows, n_cols = rows.shape
    q = torch.empty(x.shape if write else (0,), dtype=out_dtype, device=x.device)
    mean, rstd = new_stats(x, kind)
    if rows.numel() == 0:
        return q, mean, rstd, torch.zeros((), dtype=torch.float32, device=x.device)
    block_r, block_n, warps = _tiling(x, kind)  # the norm kernels' tiling: the same reductions
    programs = cdiv(n_rows, block_r)
    partial = torch.empty(programs, dtype=torch.float32, device=x.device)
    _norm_cast_kernel[(programs,)](
        rows,
        weight.contiguous(),
        rows if bias is None else bias.contiguous(),
        scale.to(torch.float32).contiguous(),
        _storage(q) if write else partial,
        mean,
        rstd,
        partial,
        n_rows,
        n_cols,
        mean_count(kind, n_cols),
        eps,
        CENTER=kind == "layer",
        HAS_B=bias is not None,
        ZERO_CENTERED=zero_centered_gamma,
        WRITE=write,
        **fp8_constexprs(qdtype, out_dtype),
        BLOCK_R=block_r,
        BLOCK_N=block_n,
        COMPUTE=tl_compute_dtype(x.dtype),
        num_warps=warps,
    )
    return q, mean, rstd, partial.amax()


def norm_cast_amax_ref(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    scale: Tensor,
    eps: float,
    kind: str,
    zero_centered_gamma: bool,
    qdtype: torch.dtype,
    out_dtype: torch.dtype,
    write: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """PyTorch twin of :func:`norm_cast_amax`: the norm twin, then the cast twin."""
    check_norm_bias(kind, bias)
    if kind == "layer":
        y, mean, rstd = layer_norm_ref(x, weight, bias, eps, zero_centered_gamma)
    else:
        y, (mean, rstd) = rms_norm_ref(x, weight, eps, zero_centered_gamma), new_stats(x, kind)
    q, amax = cast_amax_ref(y, scale, qdtype, out_dtype, write)
    return q, mean, rstd, amax


# The amax reduces over rows, so under vmap the twin is vmapped (one amax per batch member).
NORM_CAST_AMAX = Kernel("fp8_norm_cast_amax", norm_cast_amax, norm_cast_amax_ref, quantizes=True)
