"""Plain tensor arithmetic on tracers, recorded as the matching functe op, and the tables of torch
calls a trace answers (metadata), translates, or refuses.

``x + y`` -> ``add_extra_input``, ``x + b`` with a per-feature ``b`` -> ``bias``, ``2.0 * x`` /
``x / 2`` / ``-x`` -> ``constant_scale``, ``x - y``, ``x.reshape(...)`` -> ``reshape``,
``F.linear`` -> ``linear``, float casts -> ``cast`` (see :mod:`functe._trace`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ._errors import TraceError, describe

Tensor = torch.Tensor


class Unrecordable(Exception):
    """A translation's refusal of a call it cannot record (a memory format, a device change):
    :class:`functe._trace.Tracer` raises it as the trace's "cannot be recorded" error."""

    def __init__(self, func, args: tuple, kwargs: dict, why: str = ""):
        super().__init__(func, args, kwargs, why)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _ops():
    from . import ops  # imported lazily: functe.ops imports this package's core

    return ops


def _integer_arithmetic(sign: str, a, b) -> None:
    """Refuse arithmetic on a traced integer tensor (a seed) with a way out: functe's arithmetic ops
    are float ops."""
    if any(isinstance(v, Tensor) and not v.is_floating_point() for v in (a, b)):
        raise TraceError(
            f"functe.trace: {describe(a)} {sign} {describe(b)}: arithmetic on an integer tensor (a seed) is not "
            "recorded; derive seeds outside the traced function and pass them in, or use an opaque op, e.g. "
            "functe.opaque(lambda seed, k: seed + k)(seed, 1)"
        )


def _add(a, b):
    """``a + b`` as add_extra_input (same shapes) or bias (``b`` one value per feature of ``a``)."""
    _integer_arithmetic("+", a, b)
    ops = _ops()
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        # (autocast does not cast torch's +, so neither do its ops here: mixed dtypes are refused)
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            if a.shape == b.shape:
                return ops.add_extra_input(a, b)
            if b.dim() == 1 and a.dim() >= 1 and b.shape[0] == a.shape[-1]:
                return ops.bias(a, b)
            if a.dim() == 1 and b.dim() >= 1 and a.shape[0] == b.shape[-1]:
                return ops.bias(b, a)
    raise TraceError(
        f"functe.trace: {describe(a)} + {describe(b)} has no functe op: functe records x + y for equal shapes "
        "(add_extra_input) and x + b for a per-feature b (bias); use functe.opaque for anything else"
    )


def _torch_add(a, b, *, alpha=1):
    _check_alpha(alpha)
    if alpha != 1 and isinstance(b, Tensor):  # (else _add names the operands the caller wrote)
        b = _scale(b, alpha)
    return _add(a, b)


def _check_alpha(alpha) -> None:
    if isinstance(alpha, bool):  # (torch refuses it for a float result; as a scale it would be 1 or 0)
        raise TraceError(f"functe.trace: alpha={alpha!r}: a boolean alpha is only supported for boolean results")


def _bool_as_float(value):
    """A Python bool as the number torch promotes it to against a float tensor (``x * True`` is
    ``x * 1.0``); anything else as it is."""
    return float(value) if isinstance(value, bool) else value


def _scale(x, s):
    s = _bool_as_float(s)
    _integer_arithmetic("*", x, s)
    if not (isinstance(x, Tensor) and _is_number(s)):
        raise TraceError(
            f"functe.trace: {describe(x)} * {describe(s)} has no functe op: functe records the product of a "
            "traced value and a Python number (constant_scale); use functe.opaque for anything else"
        )
    return _ops().constant_scale(x, s)


def _mul(a, b):
    return _scale(b, a) if _is_number(_bool_as_float(a)) else _scale(a, b)


def _div(a, b, *, rounding_mode=None):
    if rounding_mode is not None:  # (named with the call by __torch_function__)
        raise TypeError(f"rounding_mode={rounding_mode!r}: only true division is recorded")
    b = _bool_as_float(b)
    if not _is_number(b):
        raise TraceError(f"functe.trace: {describe(a)} / {describe(b)}: only division by a Python number is recorded")
    # x / ±0 is x · ±inf elementwise (±inf, or NaN for x = 0), as torch computes it
    inverse = 1.0 / b if b else math.copysign(math.inf, b)
    # (1/c must be a normal number where the scale is applied: for a tiny c it overflows to inf, for a
    # huge c it is subnormal and loses bits; and so must c, which torch rounds to x's dtype before
    # dividing: either way the result would leave the documented 2 ulps of torch's division)
    limits = torch.finfo(torch.float64 if isinstance(a, Tensor) and a.dtype == torch.float64 else torch.float32)
    normal = lambda v: limits.tiny <= abs(v) <= limits.max
    if b and math.isfinite(b) and not (normal(b) and normal(inverse)):
        raise TraceError(
            f"functe.trace: {describe(a)} / {b!r}: {b!r} or 1/{b!r} is not a normal {limits.dtype} number, so "
            f"x / c cannot be recorded as x * (1/c) within 2 ulps; use functe.opaque(lambda x: x / {b!r})"
        )
    return _scale(a, inverse)


def _sub(a, b, *, alpha=1):
    _check_alpha(alpha)
    _check_subtraction(a, b)
    return _add(a, _scale(b, -float(alpha)))


def _rsub(a, b):  # b - a
    _check_subtraction(b, a)
    return _add(b, _scale(a, -1.0))


def _check_subtraction(a, b) -> None:
    _integer_arithmetic("-", a, b)
    # (else x - 2 fails inside its own rewrite, as "int * float")
    if not (isinstance(a, Tensor) and isinstance(b, Tensor)):
        raise TraceError(
            f"functe.trace: {describe(a)} - {describe(b)} has no functe op: functe records x - y for equal "
            "shapes (add_extra_input) and x - b for a per-feature b (bias); use functe.opaque for anything else"
        )


def _reshape(x, *shape, **keyword):
    if keyword and not shape and set(keyword) == {"shape"}:  # (x.reshape(shape=...), torch's keyword)
        shape = (keyword["shape"],)
    elif keyword:
        raise TypeError(f"reshape() got unexpected keyword arguments {sorted(keyword)}")
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    return _ops().reshape(x, shape)


def _torch_reshape(x, shape):
    return _ops().reshape(x, shape)


def _linear(input, weight, bias=None):  # (torch's parameter names: F.linear(input=x, weight=w) is valid)
    return _ops().linear(input, weight, bias)


def _same(x):
    return x


def _contiguous(x, memory_format=torch.contiguous_format):
    """``x.contiguous()``: a traced value is contiguous (see docs/fusion.md), so it records nothing;
    another memory format would change the layout, which an op list does not track."""
    if memory_format not in (torch.contiguous_format, torch.preserve_format):
        raise Unrecordable(Tensor.contiguous, (x,), {"memory_format": memory_format}, " (only the contiguous format)")
    return x


def _cast_method(dtype: torch.dtype) -> Callable:
    """``x.float()`` and its kind: ``x.to(dtype)``; the default memory format keeps the layout."""

    def cast(x, memory_format=torch.preserve_format):
        if memory_format is not torch.preserve_format:
            raise Unrecordable(Tensor.to, (x, dtype), {"memory_format": memory_format}, " (only preserve_format)")
        return _to(x, dtype)

    return cast


def _dropout_off(input, p=0.5, training=True, inplace=False):
    """``F.dropout`` that is the identity (``nn.Dropout`` in eval mode, ``p = 0``); one that drops is
    refused (its draw would happen once, at trace time: functe.ops.dropout takes a seed)."""
    if p < 0 or p > 1:  # (torch's check, before anything else)
        raise TraceError(f"functe.trace: F.dropout: dropout probability has to be between 0 and 1, but got {p}")
    if training and p != 0:
        raise TypeError("dropout in training draws random numbers: use functe.ops.dropout(x, p, seed=...)")
    return input


def _to(x, *args, **kwargs):
    # No-op conversions and floating-point dtype changes (the cast op) are recorded: a device
    # change has no op. (x.to(other) takes other's dtype and device.)
    target = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor):
            target += [a.dtype, a.device]
        elif isinstance(a, torch.dtype):
            target.append(a)
        elif isinstance(a, (torch.device, str)):
            device = torch.device(a)  # (the CPU is one device: "cpu:0" is x's "cpu")
            target.append(x.device if device.type == x.device.type == "cpu" else device)
        elif isinstance(a, int) and not isinstance(a, bool):
            target.append(a)  # (an accelerator's ordinal: never a no-op, and never equal to a dtype or device)
    # (positionally, to(dtype, non_blocking, copy): the second bool is copy)
    flags = [a for a in args if isinstance(a, bool)]
    copy = kwargs.get("copy", False) or (len(flags) > 1 and flags[1])
    dtypes = [t for t in target if isinstance(t, torch.dtype) and t != x.dtype]
    if not copy and all(t in (x.dtype, x.device, *dtypes) for t in target):  # (no device change)
        if not dtypes:
            return x
        if len(dtypes) == 1 and x.dtype in _FLOATS and dtypes[0] in _FLOATS:  # (a float dtype change)
            return _ops()._cast.cast(x, dtype=dtypes[0])
    named = lambda a: torch.device(a) if isinstance(a, str) else a  # (the message shows the device)
    why = " (copy=True makes a copy)" if copy else ""
    raise Unrecordable(Tensor.to, (x, *map(named, args)), {k: named(v) for k, v in kwargs.items()}, why)


_FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)

T = Tensor
_TRANSLATIONS: dict[Any, Callable] = {
    T.__add__: _add,
    T.__radd__: lambda a, b: _add(b, a),
    T.add: _torch_add,
    torch.add: _torch_add,
    T.__sub__: _sub,
    T.__rsub__: _rsub,
    T.sub: _sub,
    torch.sub: _sub,
    T.__mul__: _mul,
    T.__rmul__: _mul,
    T.mul: _mul,
    torch.mul: _mul,
    T.__truediv__: _div,
    T.div: _div,
    torch.div: _div,
    T.__neg__: lambda x: _scale(x, -1.0),
    T.neg: lambda x: _scale(x, -1.0),
    torch.neg: lambda x: _scale(x, -1.0),
    T.__pos__: _same,
    T.reshape: _reshape,
    T.view: _reshape,
    torch.reshape: _torch_reshape,
    torch.nn.functional.linear: _linear,
    T.contiguous: _contiguous,
    torch.nn.functional.dropout: _dropout_off,
    T.to: _to,
    T.float: _cast_method(torch.float32),
    T.half: _cast_method(torch.float16),
    T.bfloat16: _cast_method(torch.bfloat16),
    T.double: _cast_method(torch.float64),
    T.type_as: lambda x, other: _to(x, other.dtype),
}

# The arithmetic whose operands torch also takes by keyword (input=, other=; see functe._trace._operands_by_position)
_BINARY = {T.add, torch.add, T.sub, torch.sub, T.mul, torch.mul, T.div, torch.div}

# Queries that read metadata only: answered by the wrapper tensor itself.
_METADATA = {
    T.shape.__get__,
    T.dtype.__get__,
    T.device.__get__,
    T.ndim.__get__,
    T.requires_grad.__get__,
    T.is_cuda.__get__,
    T.is_meta.__get__,
    T.layout.__get__,
    T.dim,
    T.size,
    T.numel,
    T.stride,
    T.is_contiguous,
    T.is_floating_point,
    T.is_complex,
    T.element_size,
    T.__len__,
    T.__hash__,
    T.get_device,
    T.is_inference,
    T.storage_offset,
    T.is_leaf.__get__,
    T._version.__get__,
    T.is_sparse.__get__,
    T.is_quantized.__get__,
    T.is_cpu.__get__,
    T.is_xpu.__get__,
    T.is_mps.__get__,
    T.is_xla.__get__,
    T.is_ipu.__get__,
    T.is_maia.__get__,
    T.is_mtia.__get__,
    T.is_vulkan.__get__,
    T.is_mkldnn.__get__,
    T.is_nested.__get__,
    T.is_sparse_csr.__get__,
    T.itemsize.__get__,
    T.nbytes.__get__,
    T.is_signed,
    T.is_conj,
    T.is_neg,
    T.ndimension,
    T.nelement,
    torch.numel,
    torch.is_floating_point,
    torch.is_complex,
}

# Calls that read a tensor's metadata only (the trace's folded-constant watch skips them), and
# those whose first argument is the only value read (the others are templates).
_TEMPLATE_ONLY = {T.to, T.type_as, T.expand_as, T.view_as, T.reshape_as}
_NO_VALUE_READ = {
    T.is_cpu.__get__,
    T.nbytes.__get__,
    T.itemsize.__get__,
    T.is_leaf.__get__,
    T.storage_offset,
    torch.numel,
}
# Their first argument is a template (shape, dtype, device); any other tensor is a value read
# (torch.full_like(base, s) reads s).
_TEMPLATE_FIRST = {
    torch.zeros_like,
    torch.ones_like,
    torch.empty_like,
    torch.full_like,
    T.new_zeros,
    T.new_ones,
    T.new_empty,
    T.new_full,
}
# Random draws: inside a traced function they would run once, at trace time, and every call would
# reuse that draw (explicit randomness is a seed argument: ops.dropout(x, p, seed=...)).
_RANDOM = {
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
    torch.normal,
    torch.bernoulli,
    torch.multinomial,
    torch.poisson,
    torch.rand_like,
    torch.randn_like,
    torch.randint_like,
    torch.nn.functional.dropout,
    T.uniform_,
    T.normal_,
    T.bernoulli_,
    T.random_,
    T.exponential_,
    T.geometric_,
    T.log_normal_,
    T.cauchy_,
}
