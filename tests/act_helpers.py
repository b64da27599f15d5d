"""Float64 references (written from TransformerEngine's formulas) and comparison helpers for the
activation, norm and dropout tests."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from helpers import F64, make

import functe
from functe.testing import assert_close, tolerance

KINDS = ("normal", "zeros", "large")
BACKENDS = ("torch", "interpret")

# ----------------------------------------------------------------------------- float64 references


def gelu(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def qgelu(x):
    return x * torch.sigmoid(1.702 * x)


def srelu(x):
    return torch.relu(x) ** 2


def silu(x):
    return x * torch.sigmoid(x)


UNARY: dict[str, Callable] = {
    "gelu": gelu,
    "qgelu": qgelu,
    "relu": torch.relu,
    "srelu": srelu,
    "silu": silu,
    "sigmoid": torch.sigmoid,
}
GATE_OF = {"glu": "sigmoid", "geglu": "gelu", "qgeglu": "qgelu", "reglu": "relu", "sreglu": "srelu", "swiglu": "silu"}


def deinterleave(x, k):
    """TE's reference: view ``[..., 2H]`` as ``(..., 2H/2k, 2, k)``, swap to ``(..., 2, 2H/2k, k)``, split."""
    if k is None:
        return x.chunk(2, dim=-1)
    blocks = x.unflatten(-1, (x.shape[-1] // (2 * k), 2, k)).transpose(-3, -2)
    return blocks.select(-3, 0).flatten(-2), blocks.select(-3, 1).flatten(-2)


def clamped_swiglu(x, limit=7.0, alpha=1.702, offset=1.0, k=None):
    a, b = deinterleave(x, k)
    a = torch.clamp(a, max=limit)
    return a * torch.sigmoid(alpha * a) * (torch.clamp(b, -limit, limit) + offset)


def gated(name, x, k=None):
    a, b = deinterleave(x, k)
    return UNARY[GATE_OF[name]](a) * b


def layer_norm(x, w, b, eps=1e-5, zero_centered=False):
    xc = x - x.mean(-1, keepdim=True)
    return xc / torch.sqrt((xc**2).mean(-1, keepdim=True) + eps) * (w + 1 if zero_centered else w) + b


def rms_norm(x, w, eps=1e-5, zero_centered=False):
    return x / torch.sqrt((x**2).mean(-1, keepdim=True) + eps) * (w + 1 if zero_centered else w)


def l2_normalize(x, eps=1e-6):
    return x / torch.sqrt((x**2).sum(-1, keepdim=True) + eps)


# ----------------------------------------------------------------------------- inputs and comparisons


def inputs(shapes: Sequence[tuple], dtype, kind: str):
    """One tensor per shape: the first of ``kind``, the rest (parameters, scales) normal."""
    return [make(s, dtype, kind=kind if i == 0 else "normal") for i, s in enumerate(shapes)]


def representable(expected: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float64 reference, except that values beyond ``dtype``'s range become its ±inf.

    A large-magnitude input can make an exact result overflow the output dtype
    (e.g. relu(x)² in fp16); the op must then give inf, as a cast would.
    """
    if dtype == F64:
        return expected
    big = expected.abs() > torch.finfo(dtype).max
    return torch.where(big, expected.to(dtype).to(F64), expected)


def _within(actual, expected, bound, msg):
    """Same NaN and inf positions (signs included); finite values within ``bound`` (a tensor)."""
    a = actual.detach().to("cpu", F64)
    e = representable(expected, actual.dtype)
    assert a.shape == e.shape, f"{msg}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    assert torch.equal(a.isnan(), e.isnan()), f"{msg}: NaN positions differ"
    special = e.isinf() | a.isinf()
    assert torch.equal(a[special], e[special]), f"{msg}: infinities differ"
    finite = ~(special | e.isnan())
    err = (a - e).abs()[finite]
    excess = err - bound.expand_as(e)[finite]
    assert bool((excess <= 0).all()), (
        f"{msg}: {int((excess > 0).sum())} elements beyond the bound; largest excess {float(excess.max()):.3g} "
        f"(tolerance of {actual.dtype})"
    )


def check(actual, expected, msg, scale=None):
    """``actual`` vs the float64 ``expected`` at ``actual``'s dtype tolerance (overflow-aware).

    ``scale`` (the magnitude of the factors that multiply an activation value,
    e.g. |b·dy| for the gradient of a gated activation) turns the bound into
    ``atol·max(scale, 1) + rtol·|expected|``: an activation value is accurate to about
    atol in absolute terms (tanh and σ saturate in fp32), and that error is
    multiplied by everything it is multiplied with.
    """
    if scale is None:
        assert_close(actual, representable(expected, actual.dtype), msg=msg)
        return
    rtol, atol = tolerance(actual.dtype)
    _within(actual, expected, atol * scale.clamp(min=1.0) + rtol * expected.abs(), msg)


def check_sum(actual, expected, magnitude, msg):
    """A reduction vs its float64 value, with the error bound of a sum: ``atol + rtol·Σ|terms|``.

    A sum of mixed-sign terms can be far smaller than its terms, so its error
    is relative to ``magnitude`` (the sum of absolute values), not to itself.
    """
    rtol, atol = tolerance(actual.dtype)
    _within(actual, expected, atol + rtol * magnitude, msg)


def interleave(a, b, k):
    """Inverse of :func:`deinterleave`."""
    if k is None:
        return torch.cat([a, b], dim=-1)
    blocks = torch.stack([a.unflatten(-1, (-1, k)), b.unflatten(-1, (-1, k))], dim=-2)
    return blocks.flatten(-3)


def factor_scales(x, s, dy, gated: bool, k=None):
    """Magnitudes of the factors multiplying the activation value in y and in dx (float64 inputs)."""
    s = torch.ones(x.shape[:-1], dtype=F64) if s is None else s.abs()
    if not gated:
        return s[..., None].expand_as(x), (dy * s[..., None]).abs()
    _, b = deinterleave(x, k)
    b = b.abs().clamp(min=1.0)
    g = (dy * s[..., None]).abs()
    return s[..., None] * b, interleave(g * b, g, k)


def outputs_and_grads(fn, args, cotangent=None):
    """``fn(*args)`` and the VJP with ``cotangent`` (random in the output dtype if None)."""
    args = [a.detach().requires_grad_() for a in args]
    out = fn(*args)
    if cotangent is None:
        cotangent = make(out.shape, out.dtype)
    grads = torch.autograd.grad(out, args, cotangent.to(out.dtype))
    return out.detach(), [g.detach() for g in grads], cotangent


def on_backends(fn, args, cotangent):
    """``{backend: (out, grads)}`` for the PyTorch twins and the Triton kernels (interpreted)."""
    results = {}
    for backend in BACKENDS:
        with functe.use_backend(backend):
            out, grads, _ = outputs_and_grads(fn, args, cotangent)
        results[backend] = (out, grads)
    return results


def as64(tensors):
    return [t.detach().to("cpu", F64) for t in tensors]
