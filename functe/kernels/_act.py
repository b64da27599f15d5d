"""Activation math shared by every kernel that applies an activation.

TransformerEngine's formulas (``common/util/math.h``; see
``../shared/reference/transformer_engine_ops.md`` section 5), once as Triton
device functions and once as PyTorch twins, so that the activation kernels,
the fused GEMM epilogues and the quantizing kernels all compute the same thing.
All of them expect inputs already upcast to fp32 (or fp64).

Elementwise activations are identified by a small integer (a Triton
``constexpr``), so one kernel specialises per activation at compile time:

============  ================================  =======================================
name          f(x)                              f'(x)
============  ================================  =======================================
``gelu``      0.5x(1+tanh(√(2/π)(x+0.044715x³)))  TE's closed form (tanh approximation)
``qgelu``     x·σ(1.702x)                       σ(1.702x) + 1.702x·σ(1.702x)(1−σ(1.702x))
``relu``      max(x, 0)                         1 if x > 0 else 0
``srelu``     relu(x)²                          max(2x, 0)
``silu``      x·σ(x)                            σ(x) + x·σ(x)(1−σ(x))
``sigmoid``   σ(x)                              σ(x)(1−σ(x))      (the gate of ``glu``)
============  ================================  =======================================

Gated activations (last dim 2H -> H) apply ``f`` to the **first** half and
multiply by the second, as TE does (PyTorch's ``F.glu`` gates the other half).

Special values: NaN propagates through every f (TE's ``fmaxf``-based relu
would turn NaN into 0, hiding a diverged run) and through every f' except the
piecewise-linear ones, whose derivatives are TE's literal ``x > 0 ? 1 : 0`` and
``x > 0 ? 2x : 0`` (0 for NaN; the forward value is NaN already). ±inf give the
limits of the formulas (e.g. relu(−inf) = 0, σ(−inf) = 0) wherever defined.
"""

from __future__ import annotations

import math

import torch
import triton.language as tl

from ._triton import jit

ACTIVATIONS: dict[str, int] = {"gelu": 0, "qgelu": 1, "relu": 2, "srelu": 3, "silu": 4, "sigmoid": 5}
"""Elementwise activation name -> the integer id kernels specialise on."""

GATED: dict[str, str] = {
    "glu": "sigmoid",
    "geglu": "gelu",
    "qgeglu": "qgelu",
    "reglu": "relu",
    "sreglu": "srelu",
    "swiglu": "silu",
}
"""Gated activation name -> the elementwise activation applied to its first half."""

GELU, QGELU, RELU, SRELU, SILU, SIGMOID = (
    ACTIVATIONS[n] for n in ("gelu", "qgelu", "relu", "srelu", "silu", "sigmoid")
)

_GELU_K0 = 0.79788456  # sqrt(2/pi), as TE writes it
_GELU_K1 = 0.03567741  # sqrt(2/pi) * 0.044715
_GELU_D1 = 0.1070322243  # 3 * sqrt(2/pi) * 0.044715, in the derivative
# TE's constants are fp32 values (it has no fp64 kernels). A float64 input takes the exact ones, as
# torch's eager gelu, the float64 fast path, does: with TE's, the twin (what compiled code runs)
# was 5e-9 off the eager result in float64 where every other op agrees to 1e-15. (The Triton kernels
# keep TE's literals in float64 too: ~1e-9 off there, on the rarely used fp64 Triton path.)
_GELU_F64 = (math.sqrt(2 / math.pi), math.sqrt(2 / math.pi) * 0.044715, 3 * math.sqrt(2 / math.pi) * 0.044715)


def _gelu_constants(dtype: torch.dtype) -> tuple[float, float, float]:
    return _GELU_F64 if dtype == torch.float64 else (_GELU_K0, _GELU_K1, _GELU_D1)


_QGELU_ALPHA = 1.702


# ----------------------------------------------------------------------------- Triton device functions


@jit
def sigmoid(x):
    """σ(x) = 1/(1+e^(−x)); saturates to 0/1 without NaN for large |x|."""
    return 1.0 / (1.0 + tl.exp(-x))


@jit
def tanh(x):
    """tanh(x) = 1 − 2/(e^(2x)+1); exact limits ±1 at ±inf."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@jit
def act_fwd(x, ACT: tl.constexpr):
    """f(x) for activation id ``ACT`` (see the module table)."""
    if ACT == 0:
        y = x * (0.5 + 0.5 * tanh(x * (0.79788456 + 0.03567741 * x * x)))
    elif ACT == 1:
        y = x * sigmoid(1.702 * x)
    elif ACT == 2:
        y = tl.where(x < 0, 0.0, x)  # written so that NaN propagates (x < 0 is False for NaN)
    elif ACT == 3:
        r = tl.where(x < 0, 0.0, x)
        y = r * r
    elif ACT == 4:
        y = x * sigmoid(x)
    else:
        y = sigmoid(x)
    return y


@jit
def act_grad(x, ACT: tl.constexpr):
    """f'(x) for activation id ``ACT``."""
    if ACT == 0:
        t = tanh(0.79788456 * x * (1.0 + 0.044715 * x * x))
        d = 0.5 * x * (1.0 - t * t) * (0.79788456 + 0.1070322243 * x * x) + 0.5 * (1.0 + t)
    elif ACT == 1:
        s = sigmoid(1.702 * x)
        d = s + 1.702 * x * s * (1.0 - s)
    elif ACT == 2:
        d = tl.where(x > 0, 1.0, 0.0)  # TE's drelu: 0 at x = 0 and for NaN
    elif ACT == 3:
        d = tl.where(x > 0, 2.0 * x, 0.0)  # TE's dsrelu, max(2x, 0) with fmaxf's NaN -> 0
    elif ACT == 4:
        s = sigmoid(x)
        d = s + x * s * (1.0 - s)
    else:
        s = sigmoid(x)
        d = s * (1.0 - s)
    return d


@jit
def _clamp_halves(a, b, limit, offset):
    """(min(a, limit), clamp(b, ±limit) + offset), written with ``where`` so that NaN
    propagates as in ``torch.clamp`` (``tl.minimum``/``tl.maximum`` would drop it)."""
    a_c = tl.where(a > limit, limit, a)
    b_c = tl.where(b > limit, limit, tl.where(b < -limit, -limit, b)) + offset
    return a_c, b_c


@jit
def clamped_swiglu_fwd(a, b, limit, alpha, offset):
    """GPT-OSS SwiGLU: min(a, limit)·σ(α·min(a, limit))·(clamp(b, ±limit) + offset)."""
    a_c, b_c = _clamp_halves(a, b, limit, offset)
    return a_c * sigmoid(alpha * a_c) * b_c


@jit
def clamped_swiglu_grads(a, b, limit, alpha, offset):
    """(∂y/∂a, ∂y/∂b) of :func:`clamped_swiglu_fwd` (zero where the clamp is active)."""
    a_c, b_c = _clamp_halves(a, b, limit, offset)
    s = sigmoid(alpha * a_c)
    da = tl.where(a <= limit, b_c * (s + alpha * a_c * s * (1.0 - s)), 0.0)
    db = tl.where((b >= -limit) & (b <= limit), a_c * s, 0.0)
    return da, db


# ----------------------------------------------------------------------------- PyTorch twins


def act_fwd_ref(x: torch.Tensor, name: str) -> torch.Tensor:
    """Twin of :func:`act_fwd` (``x`` already in the compute dtype)."""
    if name == "gelu":
        k0, k1, _ = _gelu_constants(x.dtype)
        return x * (0.5 + 0.5 * torch.tanh(x * (k0 + k1 * x * x)))
    if name == "qgelu":
        return x * torch.sigmoid(_QGELU_ALPHA * x)
    if name == "relu":
        return torch.relu(x)
    if name == "srelu":
        return torch.relu(x) ** 2
    if name == "silu":
        return x * torch.sigmoid(x)
    if name == "sigmoid":
        return torch.sigmoid(x)
    raise KeyError(name)


def act_grad_ref(x: torch.Tensor, name: str) -> torch.Tensor:
    """Twin of :func:`act_grad`."""
    if name == "gelu":
        k0, _, d1 = _gelu_constants(x.dtype)
        t = torch.tanh(k0 * x * (1.0 + 0.044715 * x * x))
        return 0.5 * x * (1.0 - t * t) * (k0 + d1 * x * x) + 0.5 * (1.0 + t)
    if name == "qgelu":
        s = torch.sigmoid(_QGELU_ALPHA * x)
        return s + _QGELU_ALPHA * x * s * (1.0 - s)
    if name == "relu":
        return (x > 0).to(x.dtype)
    if name == "srelu":
        return torch.where(x > 0, 2.0 * x, torch.zeros_like(x))
    if name == "silu":
        s = torch.sigmoid(x)
        return s + x * s * (1.0 - s)
    if name == "sigmoid":
        s = torch.sigmoid(x)
        return s * (1.0 - s)
    raise KeyError(name)


def clamped_swiglu_fwd_ref(a, b, limit: float, alpha: float, offset: float):
    """Twin of :func:`clamped_swiglu_fwd`."""
    a_c = torch.clamp(a, max=limit)
    b_c = torch.clamp(b, -limit, limit) + offset
    return a_c * torch.sigmoid(alpha * a_c) * b_c


def clamped_swiglu_grads_ref(a, b, limit: float, alpha: float, offset: float):
    """Twin of :func:`clamped_swiglu_grads`."""
    a_c = torch.clamp(a, max=limit)
    b_c = torch.clamp(b, -limit, limit) + offset
    s = torch.sigmoid(alpha * a_c)
    zero = torch.zeros_like(a)
    da = torch.where(a <= limit, b_c * (s + alpha * a_c * s * (1.0 - s)), zero)
    db = torch.where((b >= -limit) & (b <= limit), a_c * s, zero)
    return da, db
