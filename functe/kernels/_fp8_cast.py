"""The saturating FP8 cast used by the GEMM epilogues, as a Triton device function and a torch twin.

TransformerEngine's convention: ``q = saturating_cast(x * scale)`` (values beyond
the format's largest finite value become ±max, NaN stays NaN, rounding is to
nearest even) and ``dequant = q * scale_inv``.

On a GPU the cast is the hardware conversion. Triton's *interpreter* gets it
wrong: its fp32 -> fp8 conversion rounds ties away from zero, does not carry a
rounded-up mantissa into the exponent (e.g. -124 becomes -64 in E4M3) and turns
NaN into a finite value. Values that are already on the FP8 grid convert
exactly, so under the interpreter the kernel first rounds to the grid in fp32
arithmetic (:func:`round_to_fp8_grid`, exact) and writes NaN's bit pattern
itself. The compiled GPU path never runs that emulation.
"""

from __future__ import annotations

import torch
import triton.language as tl

from .._errors import dtype_name
from ._triton import jit

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# dtype -> (largest finite value, mantissa bits, smallest normal exponent)
_FORMATS = {
    torch.float8_e4m3fn: (448.0, 3, -6),
    torch.float8_e5m2: (57344.0, 2, -14),
}


def fp8_format(dtype: torch.dtype) -> tuple[float, int, int]:
    """``(max, mantissa_bits, min_normal_exponent)`` of an FP8 dtype."""
    try:
        return _FORMATS[dtype]
    except KeyError:
        raise KeyError(f"not an FP8 dtype: {dtype_name(dtype)}") from None


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype (448 for E4M3, 57344 for E5M2)."""
    return fp8_format(dtype)[0]


@jit
def round_to_fp8_grid(x, MANT: tl.constexpr, EMIN: tl.constexpr):
    """Round fp32 ``x`` (already within ±max) to the nearest FP8 value, ties to even, in exact fp32 math."""
    bits = x.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, EMIN)  # subnormals share the smallest normal's spacing
    ulp = ((e - MANT + 127) << 23).to(tl.float32, bitcast=True)
    # 1.5 * 2**23: adding and subtracting it rounds |x| / ulp (< 32) to an integer, ties to even.
    r = ((tl.abs(x) / ulp + 12582912.0) - 12582912.0) * ulp
    return tl.where(bits < 0, -r, r)  # the sign bit, so -0.0 stays -0.0


@jit
def saturating_cast(
    x, OUT: tl.constexpr, FP8_MAX: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr, EMULATE: tl.constexpr
):
    """``x`` (fp32) clamped to ±FP8_MAX and cast to FP8 dtype ``OUT``; NaN propagates."""
    x = tl.where(x > FP8_MAX, FP8_MAX, tl.where(x < -FP8_MAX, -FP8_MAX, x))  # comparisons keep NaN
    if EMULATE:
        q = round_to_fp8_grid(x, MANT, EMIN).to(OUT)
        nan = tl.full(x.shape, 0x7F, tl.uint8).to(OUT, bitcast=True)  # NaN in both E4M3 and E5M2
        q = tl.where(x != x, nan, q)
    else:
        q = x.to(OUT, fp_downcast_rounding="rtne")
    return q


def saturating_cast_ref(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Twin of :func:`saturating_cast` (``x`` in fp32): clamp to ±max, then round to nearest even."""
    m = fp8_max(dtype)
    return torch.clamp(x, -m, m).to(dtype)


FLT_MAX = torch.finfo(torch.float32).max


def current_scale(amax: torch.Tensor, max_value: float, epsilon: float = 0.0, power_2: bool = False) -> torch.Tensor:
    """TE's current-scaling scale from an amax (fp32 0-d), without a host sync.

    ``scale = max_value / max(amax, epsilon)``, one correctly rounded fp32 division (a Python float
    divided by a tensor is evaluated as ``reciprocal(amax) * max``: two roundings); an amax of 0,
    inf or NaN gives 1; an infinite scale (tiny amax) gives FLT_MAX; ``power_2`` rounds the scale
    down to a power of two. The one formula behind ``functe.current_scale`` and the GEMM kernels.

    Example:
        >>> current_scale(torch.tensor(7.632362365722656), 448.0).item()  # RN(448 / amax)
        58.69742202758789
    """
    a = torch.clamp_min(amax.to(torch.float32), epsilon)
    scale = torch.full_like(a, max_value) / a
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, FLT_MAX), scale)
    bad = (a == 0) | ~torch.isfinite(a)
    scale = torch.where(bad, torch.ones_like(scale), scale)
    if power_2:
        scale = (scale.view(torch.int32) & -(1 << 23)).view(torch.float32)  # clear the mantissa
    return scale
