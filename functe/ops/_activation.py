"""Activation ops: elementwise, gated (2H -> H, TransformerEngine's first-half gating) and row-scaled.

Every public function here validates its arguments and calls one
:func:`functe.custom_vjp` op whose forward rule runs the ``ACTIVATION`` kernel
and whose backward rule runs ``DACTIVATION`` (the residuals are the inputs, so
second derivatives are exact). Formulas and conventions: ``docs/activations.md``.
"""

from __future__ import annotations

import torch

from .._errors import (
    ArgumentError,
    ShapeError,
    as_int,
    check_number,
    check_same_device,
    check_tensor,
    describe,
    describe_shape,
    dtype_error,
    dtype_name,
    shape_error,
)
from .._vjp import custom_vjp
from ..kernels.activation import (
    ACTIVATION,
    ACTIVATION_SCALED,
    DACTIVATION,
    DACTIVATION_SCALED,
    NAMES,
    is_gated,
)
from ._cast import autocast_inputs

Tensor = torch.Tensor

_CLAMPED_DEFAULTS = {"limit": 7.0, "alpha": 1.702, "glu_linear_offset": 1.0}
_SCALED_ALIASES = {"scaled_swiglu": "swiglu", "scaled_srelu": "srelu", "scaled_clamped_qgeglu": "clamped_swiglu"}

ACTIVATION_NAMES: tuple[str, ...] = (*NAMES, *_SCALED_ALIASES)
"""Names accepted by :func:`activation`: elementwise (``gelu qgelu relu srelu silu sigmoid``),
gated (``glu geglu qgeglu reglu sreglu swiglu clamped_swiglu``) and the row-scaled
``scaled_swiglu scaled_srelu scaled_clamped_qgeglu``."""


def _fwd(x, s, *, name, interleave, limit, alpha, offset):
    if s is None:
        return ACTIVATION(x, name, interleave, limit, alpha, offset), (x, None)
    return ACTIVATION_SCALED(x, s, name, interleave, limit, alpha, offset), (x, s)


def _bwd(res, dy, *, name, interleave, limit, alpha, offset):
    x, s = res
    if s is None:
        return DACTIVATION(dy, x, name, interleave, limit, alpha, offset), None
    return DACTIVATION_SCALED(dy, x, s, name, interleave, limit, alpha, offset)


_activation = custom_vjp("activation", _fwd, _bwd)


def _apply(op: str, x: Tensor, s: Tensor | None, name: str, interleave, clamp: dict | None) -> Tensor:
    """Validate and run activation ``name`` (``clamp``: the clamped-SwiGLU parameters or None)."""
    # The checks name what the caller passed; x_cast is x in the dtype it computes in (autocast's;
    # not s: the row scales keep their dtype, fp32 beside any x).
    (x_cast,) = autocast_inputs(x)
    check_tensor(op, "x", x)
    gated = is_gated(name)
    if gated and (x.dim() == 0 or x.shape[-1] < 2 or x.shape[-1] % 2):
        expected = describe_shape(x.dtype, (Ellipsis, "2H"))
        raise shape_error(op, "x", expected, x, "a gated activation needs an even last dimension 2H >= 2 (two halves)")
    if s is None and op.startswith("scaled_"):
        raise ArgumentError(f"functe.{op}: argument 's' (one scale per row of x) is required, got None")
    k = 0
    if interleave is not None:
        if not gated:
            raise ArgumentError(
                f"functe.{op}: argument 'interleave' applies to gated activations only ({name!r} is not gated), "
                f"got {interleave!r}"
            )
        k = as_int(interleave)
        if k is None or k < 1:
            raise ArgumentError(
                f"functe.{op}: argument 'interleave' expected a positive int or None, got {interleave!r}"
            )
        interleave = k
        h = x.shape[-1] // 2
        if h % interleave:
            raise ShapeError(
                f"functe.{op}: argument 'x' expected a last dimension 2H with H divisible by interleave={interleave}, "
                f"got {describe(x)} (H = {h})"
            )
        k = interleave
    if s is not None:
        check_tensor(op, "s", s)
        if x.dim() == 0:
            raise shape_error(op, "x", "a tensor of rank >= 1 (rows to scale)", x)
        if s.shape != x.shape[:-1]:
            expected = describe_shape(s.dtype, tuple(x.shape[:-1]))
            raise shape_error(op, "s", expected, s, "one scale per row of x: x.shape[:-1]")
        if s.dtype == x.dtype != x_cast.dtype and s.dtype != torch.float32:
            # (scales in x's own 16-bit dtype, valid without autocast, go with x to autocast's dtype;
            # refused before, by a message that gave x autocast's dtype, not the caller's)
            (s,) = autocast_inputs(s)
        if s.dtype not in (x_cast.dtype, torch.float32):
            under = "" if x_cast is x else f"x computes in {dtype_name(x_cast.dtype)} under autocast"
            raise dtype_error(op, "s", f"dtype of 'x' {describe(x)} or f32", s, under)
        check_same_device(op, {"x": x, "s": s})
    if clamp is None:
        return _activation(x_cast, s, name=name, interleave=k, limit=0.0, alpha=0.0, offset=0.0)
    limit = check_number(op, "limit", clamp["limit"], minimum=0.0)
    alpha = check_number(op, "alpha", clamp["alpha"])
    offset = check_number(op, "glu_linear_offset", clamp["glu_linear_offset"])
    return _activation(x_cast, s, name=name, interleave=k, limit=limit, alpha=alpha, offset=offset)


def activation(
    x: Tensor,
    name: str,
    s: Tensor | None = None,
    *,
    interleave: int | None = None,
    limit: float | None = None,
    alpha: float | None = None,
    glu_linear_offset: float | None = None,
) -> Tensor:
    """Apply the activation called ``name`` (see :data:`ACTIVATION_NAMES`), optionally row-scaled.

    The entry point for code that holds an activation as data (the fusion
    executor, GEMM epilogues). ``s`` (shape ``x.shape[:-1]``) scales each row,
    ``y = s[..., None] * f(x)``, with ``ds`` computed; it is required by the
    ``scaled_*`` names and allowed for every activation. ``interleave`` applies
    to gated activations; ``limit``, ``alpha`` and ``glu_linear_offset`` to the
    clamped ones (defaults 7.0, 1.702, 1.0). A parameter that the activation
    does not use is an error, not silently ignored.

    Example:
        >>> import torch
        >>> from functe import ops
        >>> ops.activation(torch.tensor([[-1.0, 2.0, 3.0, 4.0]]), "reglu").tolist()
        [[0.0, 8.0]]
        >>> ops.activation(torch.tensor([[1.0, -2.0]]), "scaled_srelu", torch.tensor([3.0])).tolist()
        [[3.0, 0.0]]
    """
    base = _SCALED_ALIASES.get(name, name) if isinstance(name, str) else None
    if base not in NAMES:
        names = ", ".join(ACTIVATION_NAMES)
        raise ArgumentError(f"functe.activation: argument 'name' expected one of {names}, got {name!r}")
    if name in _SCALED_ALIASES and s is None:
        raise ArgumentError(f"functe.activation: '{name}' needs the row scale 's'")
    given = {"limit": limit, "alpha": alpha, "glu_linear_offset": glu_linear_offset}
    clamp = None
    if base == "clamped_swiglu":
        clamp = {k: _CLAMPED_DEFAULTS[k] if v is None else v for k, v in given.items()}
    elif unused := [k for k, v in given.items() if v is not None]:
        raise ArgumentError(f"functe.activation: '{name}' takes no parameter {', '.join(map(repr, unused))}")
    return _apply("activation", x, s, base, interleave, clamp)


# ----------------------------------------------------------------------------- elementwise


def gelu(x: Tensor) -> Tensor:
    """GELU, tanh approximation (TransformerEngine's): ``0.5x(1 + tanh(√(2/π)(x + 0.044715x³)))``.

    Example:
        >>> import torch
        >>> from functe import ops
        >>> [round(v, 4) for v in ops.gelu(torch.tensor([-1.0, 0.0, 1.0])).tolist()]
        [-0.1588, 0.0, 0.8412]
    """
    return _apply("gelu", x, None, "gelu", None, None)


def qgelu(x: Tensor) -> Tensor:
    """Quick GELU: ``x·σ(1.702x)``.

    Example:
        >>> import torch
        >>> from functe import ops
        >>> [round(v, 4) for v in ops.qgelu(torch.tensor([-1.0, 1.0])).tolist()]
        [-0.1542, 0.8458]
    """
    return _apply("qgelu", x, None, "qgelu", None, None)


def relu(x: Tensor) -> Tensor:
    """ReLU: ``max(x, 0)``, with NaN propagated; the derivative at 0 is 0.

    Example:
        >>> import torch
        >>> from functe import ops
        >>> ops.relu(torch.tensor([-1.0, 0.0, 2.0])).tolist()
        [0.0, 0.0, 2.0]
    """
    return _apply("relu", x, None, "relu", None, None)


def srelu(x: Tensor) -> Tensor:
    """Squared ReLU: ``relu(x)²``.

    Example:
        >>> import torch
        >>> from functe import ops
        >>> ops.srelu(torch.tensor([-1.0, 3.0])).tolist()
        [0.0, 9.0]
    """
    return _apply("srelu", x, None, "srelu", None, None)


def silu(x: Tensor) -> Tensor:
    """SiLU (swish): ``x·σ(x)``.

    Example:
        >>> import torch
        >>> from functe import ops
        >>> [round(v, 4) for v in ops.silu(torch.tensor([-1.0, 1.0])).tolist()]
        [-0.2689, 0.7311]
    """
    return _apply("silu", x, None, "silu", None, None)


# ----------------------------------------------------------------------------- gated


def glu(x: Tensor, *, interleave: int | None = None) -> Tensor:
    """GLU: ``σ(a)·b`` with ``a, b`` the first and second halves of the last dimension.

    TransformerEngine's convention: the *first* half is gated (``torch.nn.functional.glu``
    gates the second). ``interleave=k`` reads the block-interleaved layout
    ``[a(k), b(k), a(k), ...]`` instead (TE's ``glu_interleave_size``); k must divide H.

    Example:
        >>> import torch
        >>> from functe import ops
        >>> ops.glu(torch.tensor([0.0, 4.0])).tolist()
        [2.0]
    """
    return _apply("glu", x, None, "glu", interleave, None)


def geglu(x: Tensor, *, interleave: int | None = None) -> Tensor:
    """GEGLU: ``gelu(a)·b`` (tanh GELU; halves and ``interleave`` as in :func:`glu`).

    Example:
        >>> import torch
        >>> from functe import ops
        >>> [round(v, 4) for v in ops.geglu(torch.tensor([1.0, 2.0])).tolist()]
        [1.6824]
    """
    return _apply("geglu", x, None, "geglu", interleave, None)


def qgeglu(x: Tensor, *, interleave: int | None = None) -> Tensor:
    """QGEGLU: ``a·σ(1.702a)·b`` (halves and ``interleave`` as in :func:`glu`).

    Example:
        >>> import torch
        >>> from functe import ops
        >>> [round(v, 4) for v in ops.qgeglu(torch.tensor([1.0, 2.0])).tolist()]
        [1.6916]
    """
    return _apply("qgeglu", x, None, "qgeglu", interleave, None)


def reglu(x: Tensor, *, interleave: int | None = None) -> Tensor:
    """ReGLU: ``relu(a)·b`` (halves and ``interleave`` as in :func:`glu`).

    Example:
        >>> import torch
        >>> from functe import ops
        >>> ops.reglu(torch.tensor([[-1.0, 2.0, 5.0, 5.0]])).tolist()
        [[0.0, 10.0]]
    """
    return _apply("reglu", x, None, "reglu", interleave, None)


def sreglu(x: Tensor, *, interleave: int | None = None) -> Tensor:
    """SReGLU: ``relu(a)²·b`` (halves and ``interleave`` as in :func:`glu`).

    Example:
        >>> import torch
        >>> from functe import ops
        >>> ops.sreglu(torch.tensor([3.0, 2.0])).tolist()
        [18.0]
    """
    return _apply("sreglu", x, None, "sreglu", interleave, None)


def swiglu(x: Tensor, *, interleave: int | None = None) -> Tensor:
    """SwiGLU: ``silu(a)·b`` (halves and ``interleave`` as in :func:`glu`).

    Example:
        >>> import torch
        >>> from functe import ops
        >>> x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])  # a = [1, 2], b = [3, 4]
        >>> [round(v, 4) for v in ops.swiglu(x)[0].tolist()]
        [2.1932, 7.0464]
        >>> [round(v, 4) for v in ops.swiglu(x, interleave=1)[0].tolist()]  # a = [1, 3], b = [2, 4]
        [1.4621, 11.4309]
    """
    return _apply("swiglu", x, None, "swiglu", interleave, None)


def clamped_swiglu(
    x: Tensor,
    *,
    limit: float = 7.0,
    alpha: float = 1.702,
    glu_linear_offset: float = 1.0,
    interleave: int | None = None,
) -> Tensor:
    """GPT-OSS SwiGLU: ``a_c·σ(alpha·a_c)·(clamp(b, ±limit) + glu_linear_offset)``, ``a_c = min(a, limit)``.

    Gradients are zero where a clamp is active. Halves and ``interleave`` as in :func:`glu`.

    Example:
        >>> import torch
        >>> from functe import ops
        >>> [round(v, 2) for v in ops.clamped_swiglu(torch.tensor([9.0, 9.0])).tolist()]  # 7·σ(11.9)·(7 + 1)
        [56.0]
    """
    clamp = {"limit": limit, "alpha": alpha, "glu_linear_offset": glu_linear_offset}
    return _apply("clamped_swiglu", x, None, "clamped_swiglu", interleave, clamp)


# ----------------------------------------------------------------------------- row-scaled


def scaled_swiglu(x: Tensor, s: Tensor, *, interleave: int | None = None) -> Tensor:
    """``s[..., None] · swiglu(x)``; ``s`` has shape ``x.shape[:-1]`` (e.g. MoE routing probabilities).

    ``s`` may have x's dtype or fp32; its gradient is ``Σ_last dy·swiglu(x)``, reduced in fp32.

    Example:
        >>> import torch
        >>> from functe import ops
        >>> x, s = torch.tensor([[1.0, 3.0], [1.0, 3.0]]), torch.tensor([1.0, 0.5])
        >>> [round(v, 4) for v in ops.scaled_swiglu(x, s)[:, 0].tolist()]
        [2.1932, 1.0966]
    """
    return _apply("scaled_swiglu", x, s, "swiglu", interleave, None)


def scaled_srelu(x: Tensor, s: Tensor) -> Tensor:
    """``s[..., None] · relu(x)²``; ``s`` as in :func:`scaled_swiglu`.

    Example:
        >>> import torch
        >>> from functe import ops
        >>> ops.scaled_srelu(torch.tensor([[2.0, -1.0]]), torch.tensor([0.5])).tolist()
        [[2.0, 0.0]]
    """
    return _apply("scaled_srelu", x, s, "srelu", None, None)


def scaled_clamped_qgeglu(
    x: Tensor,
    s: Tensor,
    *,
    limit: float = 7.0,
    alpha: float = 1.702,
    glu_linear_offset: float = 1.0,
    interleave: int | None = None,
) -> Tensor:
    """``s[..., None] · clamped_swiglu(x)``: TransformerEngine's ScaledClampedQGeGLU (same numerics).

    Example:
        >>> import torch
        >>> from functe import ops
        >>> y = ops.scaled_clamped_qgeglu(torch.tensor([[9.0, 9.0]]), torch.tensor([2.0]))
        >>> [round(v, 2) for v in y[0].tolist()]
        [112.0]
    """
    clamp = {"limit": limit, "alpha": alpha, "glu_linear_offset": glu_linear_offset}
    return _apply("scaled_clamped_qgeglu", x, s, "clamped_swiglu", interleave, clamp)
