"""Float64 references for the GEMM tests, written from the formulas (TE's conventions)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

F64 = torch.float64

# Textbook definitions (torch's own implementations, in float64), not functe's twins.
ACT64 = {
    "gelu": lambda z: F.gelu(z, approximate="tanh"),
    "qgelu": lambda z: z * torch.sigmoid(1.702 * z),
    "relu": torch.relu,
    "srelu": lambda z: torch.relu(z) ** 2,
    "silu": F.silu,
    "sigmoid": torch.sigmoid,
}

# (max, mantissa bits, smallest normal exponent): OCP FP8 formats as TE uses them.
FP8 = {torch.float8_e4m3fn: (448.0, 3, -6), torch.float8_e5m2: (57344.0, 2, -14)}


def act64(z: torch.Tensor, name: str | None) -> torch.Tensor:
    return z if name is None else ACT64[name](z)


def dact64(z: torch.Tensor, name: str) -> torch.Tensor:
    """f'(z) by float64 autograd of the textbook f."""
    z = z.detach().to(F64).requires_grad_()
    (d,) = torch.autograd.grad(ACT64[name](z).sum(), z)
    return d


def forward64(x, w, bias=None, residual=None, alpha=1.0, activation=None, sx=None, sw=None, pre_dtype=None):
    """``(z, y)``: z = alpha·sx·sw·x @ Wᵀ + b, y = act(z) + residual, in float64; the activation reads
    z rounded to ``pre_dtype`` (the unfused linear's output dtype, as the kernels' epilogues do; by
    default x's dtype: check_kernel passes float64 copies, so pass it there)."""
    z = alpha * (x.to(F64) @ w.to(F64).T)
    if sx is not None:
        z = z * (sx.to(F64) * sw.to(F64))
    if bias is not None:
        z = z + bias.to(F64)
    pre_dtype = pre_dtype or x.dtype
    y = act64(z if activation is None else z.to(pre_dtype).to(F64), activation)
    if residual is not None:
        y = y + residual.to(F64)
    return z, y


def fp8_spacing(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Distance between adjacent FP8 values around |v| (one ulp)."""
    _, mant, emin = FP8[dtype]
    e = torch.floor(torch.log2(v.abs().clamp_min(2.0**emin)))
    return torch.exp2(e - mant)


def quantize64(y: torch.Tensor, scale: float | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """TE's ``saturating_cast(y · scale)`` computed in float64 (round half to even on the FP8 grid)."""
    fmax, _, _ = FP8[dtype]
    v = torch.clamp(y.to(F64) * torch.as_tensor(scale, dtype=F64), -fmax, fmax)
    ulp = fp8_spacing(v, dtype)
    return torch.round(v / ulp) * ulp  # torch.round rounds half to even


def quantized_inputs(shape, dtype):
    """FP8 test operand: normal values quantized with a per-tensor scale; returns ``(q, scale_inv)``."""
    fmax, _, _ = FP8[dtype]
    x = torch.randn(shape, dtype=F64)
    scale = torch.tensor(fmax / x.abs().max().item() / 2.0, dtype=torch.float32)  # headroom: no saturation
    q = (x * scale.to(F64)).to(torch.float32).to(dtype)
    return q, torch.reciprocal(scale)
