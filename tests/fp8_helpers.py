"""Independent FP8 references for the tests, written from the formats' and TE's definitions.

* :func:`round_fp8_ref`: round-to-nearest-even onto the set of finite values of a float8 format
  (enumerated from its 256 bit patterns), with saturation; no float8 cast involved.
* :func:`quantize_ref`: ``round_fp8_ref(fp32(x * scale))``.
* :func:`py_delayed_update`: TE's delayed-scaling update in plain Python over numpy float32
  scalars (one rounding per operation, as float32 tensor arithmetic does).
* :func:`e8m0_ref`: the MXFP8 block exponent ``ceil(log2(amax / fp8_max)) + 127`` from ``frexp``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

F64 = torch.float64
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def fp8_grid(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted finite non-negative values, their codes) of a float8 format, from its bit patterns."""
    codes = torch.arange(128, dtype=torch.uint8)
    values = codes.view(dtype).to(F64)
    keep = values.isfinite()
    values, codes = values[keep], codes[keep]
    order = values.argsort()
    return values[order], codes[order].long()


def round_fp8_ref(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``v`` (float64) saturated to ±max and rounded to the nearest grid value, ties to even."""
    grid, codes = fp8_grid(dtype)
    mag = v.abs().clamp(max=MAX[dtype])
    hi = torch.searchsorted(grid, mag.nan_to_num(0.0)).clamp(max=len(grid) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = mag - grid[lo], grid[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (codes[hi] % 2 == 0))
    out = torch.where(pick_hi, grid[hi], grid[lo])
    out = torch.where(v.signbit(), -out, out)  # keeps -0
    return torch.where(v.isnan(), v, out)


def quantize_ref(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 value of ``x * scale`` (the product rounded to fp32 first, as the kernels compute it)."""
    product = (x.to(F64) * scale.to(F64)).to(torch.float32).to(F64)
    return round_fp8_ref(product, dtype)


def same_values(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal as numbers, NaN where NaN, and the same sign of zero."""
    a, e = actual.to(F64), expected.to(F64)
    if a.shape != e.shape:
        return False
    both_nan = a.isnan() & e.isnan()
    equal = (a == e) & (a.signbit() == e.signbit())
    return bool((both_nan | equal).all())


def py_delayed_update(scale, history, amax, *, fp8_max, margin, algo):
    """TE's update (``_amax_and_scale_update``) on numpy float32 scalars: (scale, history)."""
    f32 = np.float32
    history = [f32(amax), *history[1:]]
    if algo == "max":
        window = f32("nan") if any(math.isnan(h) for h in history) else max(history)
    else:
        window = history[0]
    with np.errstate(all="ignore"):
        new = (f32(fp8_max) / window) / f32(2.0**margin)
    if not (window > 0) or not math.isfinite(window):  # (TE: torch.where(amax > 0.0, sf, scale))
        new = f32(scale)
    if math.isinf(new):
        new = f32(np.finfo(np.float32).max)
    rolled = history[1:] + history[:1]
    rolled[0] = f32(0.0)
    return f32(new), rolled


def e8m0_ref(block_amax: float, fp8_max: float) -> int:
    """Biased exponent of the smallest power of two >= fp32(amax * fp32(1/fp8_max)) (normal ratios)."""
    ratio = float(np.float32(block_amax) * np.float32(1.0 / fp8_max))
    if ratio == 0:
        return 0
    mant, exp = math.frexp(ratio)  # ratio = mant * 2**exp, mant in [0.5, 1)
    return (exp - 1 if mant == 0.5 else exp) + 127


def special_values(n: int, *, scale: float = 30.0, seed: int = 0) -> torch.Tensor:
    """``n`` normal values times ``scale`` with zeros, tiny, huge and negative ones mixed in."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n, generator=g, dtype=F64) * scale
    specials = torch.tensor([0.0, -0.0, 1e-6, -3e-5, 2.0**-12, 1e5, -1e6, 0.5, -448.0], dtype=F64)
    k = min(n, len(specials))
    v[:k] = specials[:k]
    return v[torch.randperm(n, generator=g)]
