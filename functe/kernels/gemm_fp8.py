"""GEMMs whose output is quantized to FP8 for the next op, with their PyTorch twins.

The output is first rounded to ``out_dtype`` (the dtype the unfused GEMM would
have produced), so a fused result equals ``quantize(unfused output)`` exactly:

* **Delayed scaling** (:func:`gemm_quantize`): the scale is known before the
  GEMM runs (derived from earlier steps' amaxes), so one kernel does it all: the
  epilogue casts ``saturate(y · scale)`` to FP8 and records the amax of ``y``
  (per-tile partial maxima, reduced afterwards without atomics) for the next
  history update.
* **Current scaling** needs the amax of the *whole* output before the first
  element can be cast, and no tile knows it until every tile is done. The two
  phases are therefore (:func:`gemm_quantize_current`): (1) the GEMM writes
  ``y`` in ``out_dtype`` and its amax (:func:`gemm_amax`); (2) the scale is
  computed on the device (no host sync) and a cast kernel writes
  ``q = saturate(y · scale)`` (:func:`cast_fp8`). Phase 2 costs one read of ``y``
  and one write of ``q``; recomputing the GEMM instead would double its FLOPs,
  which only pays for very small K.
"""

from __future__ import annotations

import torch
import triton.language as tl

from .._backend import interpreting
from .._errors import DTypeError, check_same_device, check_tensor, describe, dtype_name, shape_error
from .._kernel import Kernel, Rowwise
from ._common import as_rows, rows_view
from ._fp8_cast import FP8_DTYPES, current_scale, fp8_format, fp8_max, saturating_cast, saturating_cast_ref
from ._triton import ELEMENTWISE_BLOCK, cdiv, jit
from .gemm import check_forward, forward_ref, run_gemm

Tensor = torch.Tensor


def _amax_ref(y: Tensor) -> Tensor:
    """max |y| as fp32 0-d (0 for an empty tensor); NaN anywhere gives NaN."""
    if y.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=y.device)
    return y.abs().amax().to(torch.float32)


def _check_scale(op: str, scale: Tensor, fp8_dtype: torch.dtype) -> None:
    check_tensor(op, "scale", scale, dtypes=(torch.float32,))
    if scale.numel() != 1:
        raise shape_error(op, "scale", "f32[] (one per-tensor scale)", scale)
    if fp8_dtype not in FP8_DTYPES:
        names = "|".join(dtype_name(d) for d in FP8_DTYPES)
        got = dtype_name(fp8_dtype) if isinstance(fp8_dtype, torch.dtype) else describe(fp8_dtype)
        raise DTypeError(f"functe.{op}: argument 'fp8_dtype' expected {names}, got {got}")  # (a dtype, not bf16[0])


# ----------------------------------------------------------------------------- phase 1 / amax only


def gemm_amax(
    x: Tensor,
    w: Tensor,
    bias: Tensor | None = None,
    residual: Tensor | None = None,
    alpha: float = 1.0,
    activation: str | None = None,
    x_scale_inv: Tensor | None = None,
    w_scale_inv: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`functe.kernels.gemm.gemm` plus the amax of its output (fp32 0-d), from the same epilogue."""
    out_dtype = check_forward("gemm_amax", x, w, bias, residual, activation, x_scale_inv, w_scale_inv, out_dtype)
    x2 = rows_view(x)
    y = torch.empty((x2.shape[0], w.shape[0]), dtype=out_dtype, device=x.device)
    res = None if residual is None else rows_view(residual)
    amax = run_gemm(x2, w.t(), y, alpha=alpha, a_scale_inv=x_scale_inv, b_scale_inv=w_scale_inv, bias=bias,
                    residual=res, activation=activation, amax=True)  # fmt: skip
    return y.view(*x.shape[:-1], w.shape[0]), amax


def gemm_amax_ref(
    x: Tensor,
    w: Tensor,
    bias: Tensor | None = None,
    residual: Tensor | None = None,
    alpha: float = 1.0,
    activation: str | None = None,
    x_scale_inv: Tensor | None = None,
    w_scale_inv: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """PyTorch twin of :func:`gemm_amax`."""
    out_dtype = check_forward("gemm_amax", x, w, bias, residual, activation, x_scale_inv, w_scale_inv, out_dtype)
    _, y = forward_ref(x, w, bias, residual, alpha, activation, x_scale_inv, w_scale_inv, out_dtype)
    y = y.to(out_dtype)
    return y.view(*x.shape[:-1], w.shape[0]), _amax_ref(y)


# ----------------------------------------------------------------------------- delayed scaling: one kernel


def gemm_quantize(
    x: Tensor,
    w: Tensor,
    scale: Tensor,
    fp8_dtype: torch.dtype,
    bias: Tensor | None = None,
    residual: Tensor | None = None,
    alpha: float = 1.0,
    activation: str | None = None,
    x_scale_inv: Tensor | None = None,
    w_scale_inv: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """``(q, amax)``: the GEMM's output ``y`` (rounded to ``out_dtype``) cast to FP8 with a known ``scale``.

    ``q = saturate(y · scale)`` in ``fp8_dtype`` (dequantize with
    ``1/scale``); ``amax = max |y|`` for the delayed-scaling history.
    """
    op = "gemm_quantize"
    out_dtype = check_forward(op, x, w, bias, residual, activation, x_scale_inv, w_scale_inv, out_dtype)
    _check_scale(op, scale, fp8_dtype)
    check_same_device(op, {"x": x, "scale": scale})
    x2 = rows_view(x)
    q = torch.empty((x2.shape[0], w.shape[0]), dtype=fp8_dtype, device=x.device)
    res = None if residual is None else rows_view(residual)
    amax = run_gemm(x2, w.t(), q, alpha=alpha, a_scale_inv=x_scale_inv, b_scale_inv=w_scale_inv, bias=bias,
                    residual=res, activation=activation, q_scale=scale, round_to=out_dtype)  # fmt: skip
    return q.view(*x.shape[:-1], w.shape[0]), amax


def gemm_quantize_ref(
    x: Tensor,
    w: Tensor,
    scale: Tensor,
    fp8_dtype: torch.dtype,
    bias: Tensor | None = None,
    residual: Tensor | None = None,
    alpha: float = 1.0,
    activation: str | None = None,
    x_scale_inv: Tensor | None = None,
    w_scale_inv: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """PyTorch twin of :func:`gemm_quantize`."""
    op = "gemm_quantize"
    out_dtype = check_forward(op, x, w, bias, residual, activation, x_scale_inv, w_scale_inv, out_dtype)
    _check_scale(op, scale, fp8_dtype)
    _, y = forward_ref(x, w, bias, residual, alpha, activation, x_scale_inv, w_scale_inv, out_dtype)
    y = y.to(out_dtype)
    q = saturating_cast_ref(y.to(torch.float32) * scale.reshape(()), fp8_dtype)
    return q.view(*x.shape[:-1], w.shape[0]), _amax_ref(y)


# ----------------------------------------------------------------------------- current scaling: phase 2


@jit
def _cast_fp8_kernel(
    Y,
    S,
    Q,
    n,
    FP8_MAX: tl.constexpr,
    MANT: tl.constexpr,
    EMIN: tl.constexpr,
    EMULATE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    y = tl.load(Y + offs, mask=mask).to(tl.float32) * tl.load(S)
    tl.store(Q + offs, saturating_cast(y, Q.dtype.element_ty, FP8_MAX, MANT, EMIN, EMULATE), mask=mask)


def cast_fp8(y: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    """``q = saturate(y · scale)`` in ``fp8_dtype`` (``y`` fp32/fp16/bf16, ``scale`` fp32 0-d)."""
    check_tensor("cast_fp8", "y", y, dtypes=(torch.float32, torch.float16, torch.bfloat16))
    _check_scale("cast_fp8", scale, fp8_dtype)
    rows = as_rows(y)
    q = torch.empty(rows.shape, dtype=fp8_dtype, device=y.device)
    n = rows.numel()
    if n:
        fp8_max_value, mant, emin = fp8_format(fp8_dtype)
        _cast_fp8_kernel[(cdiv(n, ELEMENTWISE_BLOCK),)](
            rows, scale, q, n, FP8_MAX=fp8_max_value, MANT=mant, EMIN=emin, EMULATE=interpreting(),
            BLOCK=ELEMENTWISE_BLOCK,
        )  # fmt: skip
    return q.view(y.shape)


def cast_fp8_ref(y: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    """PyTorch twin of :func:`cast_fp8`."""
    check_tensor("cast_fp8", "y", y, dtypes=(torch.float32, torch.float16, torch.bfloat16))
    _check_scale("cast_fp8", scale, fp8_dtype)
    return saturating_cast_ref(y.to(torch.float32) * scale.reshape(()), fp8_dtype)


GEMM_AMAX = Kernel("gemm_amax", gemm_amax, gemm_amax_ref, fast_path=False)  # amax reduces over rows: vmaps the twin
GEMM_QUANTIZE = Kernel("gemm_quantize", gemm_quantize, gemm_quantize_ref, fast_path=False, quantizes=True)
CAST_FP8 = Kernel("gemm_cast_fp8", cast_fp8, cast_fp8_ref, batch=Rowwise(params=(1,)), fast_path=False, quantizes=True)


def gemm_quantize_current(
    x: Tensor,
    w: Tensor,
    fp8_dtype: torch.dtype,
    bias: Tensor | None = None,
    residual: Tensor | None = None,
    alpha: float = 1.0,
    activation: str | None = None,
    x_scale_inv: Tensor | None = None,
    w_scale_inv: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    epsilon: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Current (per-tensor, just-in-time) scaling of the GEMM output: ``(q, scale_inv, amax)``.

    Phase 1 is :data:`GEMM_AMAX`; the scale is TE's ``max / max(amax,
    epsilon)`` (1 for an amax of 0/inf/NaN, FLT_MAX for an infinite scale),
    computed on the device; phase 2 is :data:`CAST_FP8`. ``q`` equals
    ``cast_fp8(gemm(...), scale)`` exactly.

    Example:
        >>> import torch
        >>> x, w = torch.ones(2, 3), torch.ones(4, 3)
        >>> q, scale_inv, amax = gemm_quantize_current(x, w, torch.float8_e4m3fn)
        >>> amax.item(), q.float()[0].tolist()  # amax 3 maps to E4M3's max, 448
        (3.0, [448.0, 448.0, 448.0, 448.0])
    """
    y, amax = GEMM_AMAX(x, w, bias, residual, alpha, activation, x_scale_inv, w_scale_inv, out_dtype)
    scale = current_scale(amax, fp8_max(fp8_dtype), epsilon)
    return CAST_FP8(y, scale, fp8_dtype), torch.reciprocal(scale), amax
