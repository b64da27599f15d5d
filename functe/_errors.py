"""Error classes and the helpers that write their messages.

Every functe error names the op, the argument, and the expected versus actual
value, with tensors described in a compact jaxpr-like form (``f32[8,16]``).
All classes derive from :class:`FuncteError`, so ``except functe.FuncteError``
catches any of them, and each also derives from the builtin exception a caller
would expect (``ValueError`` for shapes, ``TypeError`` for dtypes).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ._autocast import casts_to_one_dtype

_DTYPE_SHORT = {
    torch.float64: "f64",
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float8_e4m3fn: "f8e4m3",
    torch.float8_e5m2: "f8e5m2",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "bool",
}


def dtype_name(dtype: torch.dtype) -> str:
    """Short name of a dtype as functe prints it (``torch.float32`` -> ``f32``)."""
    return _DTYPE_SHORT.get(dtype, str(dtype).removeprefix("torch."))


def describe(value: Any) -> str:
    """Describe a value for an error message: ``f32[8,16]`` for a tensor.

    Example:
        >>> import torch
        >>> describe(torch.zeros(8, 16))
        'f32[8,16]'
    """
    if isinstance(value, torch.Tensor):
        dims = ",".join(str(d) for d in value.shape)
        return f"{dtype_name(value.dtype)}[{dims}]"
    if value is None:
        return "None"
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)  # (torch.float64, cuda:0: the value is what the message needs)
    return type(value).__name__


def describe_shape(dtype: torch.dtype | None, shape) -> str:
    """Describe an expected shape: ``f32[8,16]``, ``?[...,16]`` for unknown parts."""
    prefix = "?" if dtype is None else dtype_name(dtype)
    dims = ",".join("..." if d is Ellipsis else ("?" if d is None else str(d)) for d in shape)
    return f"{prefix}[{dims}]"


class FuncteError(Exception):
    """Base class of every error functe raises on purpose.

    Each subclass also derives from the built-in error callers caught before (``ValueError``,
    ``TypeError``), and every message starts with ``functe.<op>:`` and names the argument.

    Example:
        >>> import torch, functe
        >>> try:
        ...     functe.ops.linear(torch.zeros(4, 16), torch.zeros(8, 15))
        ... except functe.FuncteError as error:
        ...     print(type(error).__name__, isinstance(error, ValueError))
        ShapeError True
    """


class ShapeError(FuncteError, ValueError):
    """An argument has the wrong shape (rank, size, or divisibility)."""


class DTypeError(FuncteError, TypeError):
    """An argument has a dtype the op does not accept."""


class DeviceError(FuncteError, ValueError):
    """Arguments of one call live on different devices."""


class TransformError(FuncteError, RuntimeError):
    """A transform (vmap, jvp, higher-order grad, compile) the op cannot honour."""


def called_as(error: TransformError, who: str) -> TransformError:
    """``error`` (a kernel's refusal, raised deep inside) prefixed with ``who:``, the op or fused
    program the user called, unless it already starts with it.

    Example:
        >>> str(called_as(TransformError("functe.cast: no jvp"), "functe.fp8_linear"))
        'functe.fp8_linear: functe.cast: no jvp'
    """
    if str(error).startswith(f"{who}:"):
        return error
    return TransformError(f"{who}: {error}")


class StateError(FuncteError, ValueError):
    """A scaling-state pytree is malformed or used in a way that would corrupt it."""


class TraceError(FuncteError, RuntimeError):
    """Something inside a traced function cannot be recorded in an op list."""


def _where(op: str, arg: str) -> str:
    return f"functe.{op}: argument '{arg}'"


def shape_error(op: str, arg: str, expected: str, actual: Any, why: str = "") -> ShapeError:
    """Build a :class:`ShapeError` with the standard message layout."""
    tail = f" ({why})" if why else ""
    return ShapeError(f"{_where(op, arg)} expected {expected}, got {describe(actual)}{tail}")


def dtype_error(op: str, arg: str, expected: str, actual: Any, why: str = "") -> DTypeError:
    """Build a :class:`DTypeError` with the standard message layout."""
    tail = f" ({why})" if why else ""
    return DTypeError(f"{_where(op, arg)} expected {expected}, got {describe(actual)}{tail}")


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_tensor(op: str, arg: str, value: Any, *, dtypes=FLOAT_DTYPES) -> torch.Tensor:
    """Require a dense tensor of one of ``dtypes``; return it."""
    if not isinstance(value, torch.Tensor):
        raise dtype_error(op, arg, "a tensor", value)
    if value.layout is not torch.strided or value.is_nested:
        # (no op takes a sparse or nested tensor: torch failed deep inside, "unsupported memory
        # format option Contiguous", or a forward ran whose backward then failed)
        raise ArgumentError(f"{_where(op, arg)} expected a dense tensor, got a {_layout(value)}")
    if dtypes is not None and value.dtype not in dtypes:
        names = "|".join(dtype_name(d) for d in dtypes)
        raise dtype_error(op, arg, f"dtype {names}", value)
    return value


def _layout(value: torch.Tensor) -> str:
    """A tensor of another layout described: ``sparse_coo f32[4,16]``, ``nested f32[2,j1,16]``."""
    kind = "nested" if value.is_nested else str(value.layout).removeprefix("torch.").lstrip("_")
    try:
        shown = describe(value)
    except RuntimeError:  # (a strided nested tensor has no sizes)
        shown = f"{dtype_name(value.dtype)}[...]"
    return f"{kind} {shown}"


def check_same_dtype(
    op: str, arg: str, value: torch.Tensor, like: torch.Tensor, like_arg: str, *, autocast: bool = False
) -> None:
    """Require ``value`` to have the dtype of ``like`` (functe never promotes silently).

    ``autocast``: the op casts both with ``autocast_inputs`` after its checks (which see what the
    caller passed), so dtypes that autocast makes one are fine.
    """
    if value.dtype != like.dtype and not (autocast and casts_to_one_dtype(value, like)):
        raise dtype_error(op, arg, f"dtype {dtype_name(like.dtype)} to match '{like_arg}' {describe(like)}", value)


def check_flag(op: str, arg: str, value: Any) -> bool:
    """``value`` if it is a bool (or a numpy bool, returned as a bool), else an
    :class:`ArgumentError` (``bool("no")`` would be True)."""
    if _numpy_scalar_kind(value) == "b":
        return bool(value)
    if not isinstance(value, bool):
        raise ArgumentError(f"{_where(op, arg)} expected a bool, got {value!r}")
    return value


def _numpy_scalar_kind(value: Any) -> str | None:
    """numpy's dtype kind of a numpy scalar (``"b"``, ``"i"``, ``"u"``, ``"f"``...), else None.

    (Checked by type, without importing numpy: a value read from a numpy array or config is a
    numpy scalar, which is not a Python bool or int.)"""
    kind = type(value).__module__ == "numpy" and getattr(value, "dtype", None)
    return getattr(kind, "kind", None) if getattr(value, "ndim", None) == 0 else None


def as_int(value: Any) -> int | None:
    """``value`` as an int if it is a Python or numpy integer (not a bool), else None.

    (An integer read from a numpy array or a config is a numpy scalar, not a Python int: refusing
    it as "expected an int" reads as a bug to its caller.)

    Example:
        >>> as_int(3), as_int(True), as_int(3.0)
        (3, None, None)
    """
    if isinstance(value, int) and not isinstance(value, bool):
        return int(value)
    return int(value) if _numpy_scalar_kind(value) in ("i", "u") else None


def python_scalar(value: Any) -> Any:
    """A numpy scalar as the Python bool, int or float it holds; anything else as it is (a symbolic
    float under torch.compile included, which a conversion would specialise).

    Example:
        >>> python_scalar(2.5), python_scalar("a")
        (2.5, 'a')
    """
    # (Python scalars first: Dynamo cannot trace the numpy check's getattr on a symbolic float)
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return value.item() if _numpy_scalar_kind(value) in ("b", "i", "u", "f") else value


def check_callable(op: str, arg: str, value: Any) -> Any:
    """``value`` if it is callable, else an :class:`ArgumentError` (raised where it is given, not at
    the first call deep inside a trace or a transform)."""
    if not callable(value):
        raise ArgumentError(f"{_where(op, arg)} expected a function, got {describe(value)}")
    return value


def check_number(op: str, arg: str, value: Any, *, finite: bool = True, minimum: float | None = None) -> float:
    """``value`` as a float if it is a Python or numpy number (not a bool) that a float holds
    (``10**400`` is not), finite unless ``finite=False`` and at least ``minimum``; else an :class:`ArgumentError`."""
    number = as_float(value)
    if number is not None and (finite or minimum is not None):
        # (specialised under torch.compile, as kernels' static_float: Dynamo made a float
        # symbolic under dynamic=True or once it changed between calls, and math.isfinite of
        # a symbolic float broke the graph, which fullgraph=True refused: layer_norm's eps. A
        # value no check reads, constant_scale's, stays symbolic: one graph for every scale)
        number = float.fromhex(number.hex())
    kind = ("a finite Python number" if finite else "a Python number") + ("" if minimum is None else f" >= {minimum:g}")
    if number is None or (finite and not math.isfinite(number)) or (minimum is not None and not number >= minimum):
        raise ArgumentError(f"{_where(op, arg)} expected {kind}, got {shown_number(value)}")
    return number


def as_float(value: Any) -> float | None:
    """``value`` as a float if it is a Python or numpy number (not a bool) that a float holds
    (``10**400`` is not), else None.

    Example:
        >>> as_float(3), as_float(True), as_float(10**400)
        (3.0, None, None)
    """
    python_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if python_number or _numpy_scalar_kind(value) in ("i", "u", "f"):
        try:
            return float(value)
        except OverflowError:
            return None
    return None


def shown_number(value: Any) -> str:
    """How an error shows a value that should have been a number: its repr (a number's or a
    string's), else :func:`describe`, cut to 40 characters (``10**400`` has 401 digits)."""
    shown = repr(value) if isinstance(value, (int, float, str)) or _numpy_scalar_kind(value) else describe(value)
    return shown if len(shown) <= 40 else f"{shown[:37]}..."


def check_device(op: str, arg: str, value: Any) -> None:
    """Require a device argument torch reads (None, a torch.device, an index or a device string such
    as ``"cuda:0"``): a bad string was torch's "Invalid device string", naming neither op nor argument."""
    if isinstance(value, str):
        try:
            torch.device(value)
            return
        except RuntimeError:
            pass
    elif value is None or isinstance(value, torch.device):
        return
    elif isinstance(value, int) and not isinstance(value, bool) and value >= 0:  # (an accelerator's index)
        return
    raise DeviceError(
        f"{_where(op, arg)} expected a torch.device or a device string ('cpu', 'cuda:0'), got {shown_number(value)}"
    )


def check_same_device(op: str, tensors: dict[str, Any]) -> None:
    """Require every tensor in ``tensors`` (name -> value) to be on one device."""
    devices = {name: t.device for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"'{n}' on {d}" for n, d in devices.items())
        raise DeviceError(f"functe.{op}: arguments must share one device, got {listing}")


class ArgumentError(FuncteError, ValueError, TypeError):
    """An argument of the wrong kind or value (a name, a flag, a number out of range); its shape,
    dtype and device have the errors above. (Both a ValueError and a TypeError, as Python's own.)"""


class RuleError(FuncteError, ValueError, TypeError):
    """An op's forward or backward rule, or a fusion rule, broke its contract (what it returns, or
    how it is declared)."""


class RecipeError(FuncteError, ValueError):
    """A quantization recipe is misconfigured (an unsupported format, a bad history length...)."""


class DistributedError(FuncteError, RuntimeError):
    """The ranks of a process group disagree: they reached different collectives at the same point."""
