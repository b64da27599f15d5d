"""Testing utilities: the one dtype-keyed tolerance table and comparisons built on it.

The tolerances are TransformerEngine's (``tests/pytorch/test_fusible_ops.py``,
``dtype_tols``): they compare a result computed in ``dtype`` against a float64
reference computed from the same (dtype-rounded) inputs. Quantized results use
the table entry of their FP8/FP4 format.

Example:
    >>> import torch
    >>> tolerance(torch.bfloat16)
    (0.016, 1e-05)
    >>> assert_close(torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64))
"""

from __future__ import annotations

import torch

from ._errors import dtype_name

# dtype (or format name) -> (rtol, atol)
TOLERANCES: dict[object, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1.3e-6, 1e-5),
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float8_e4m3fn: (0.125, 0.0675),
    torch.float8_e5m2: (0.25, 0.125),
    "e2m1": (0.25, 0.125),
}


def tolerance(dtype: object) -> tuple[float, float]:
    """``(rtol, atol)`` for results computed in ``dtype`` (a torch dtype or ``"e2m1"``).

    Example:
        >>> import torch
        >>> rtol, atol = tolerance(torch.bfloat16)
        >>> rtol > tolerance(torch.float32)[0]
        True
    """
    try:
        return TOLERANCES[dtype]
    except KeyError:
        raise KeyError(f"no tolerance for {dtype}; known: {list(TOLERANCES)}") from None


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, *, dtype: object = None, msg: str = "", scale_atol: bool = False
) -> None:
    """Assert ``actual`` matches ``expected`` within the tolerance of ``dtype``.

    ``dtype`` defaults to ``actual.dtype``. Both are compared in float64 on the
    CPU; NaN must match NaN and infinities must match in sign and position.

    The table's ``atol`` is for unit-scale values (TransformerEngine draws its
    inputs from [0, 1)). With ``scale_atol`` it is multiplied by
    ``max(1, max|expected|)``: an element of a sum of large terms that cancels
    to nearly zero is accurate to the terms' scale, not to its own (a gradient
    entry of 3e-5 in a tensor of entries up to 27 is off by 1e-5 in float32).

    Example:
        >>> big = torch.tensor([30.0, 3e-5], dtype=torch.float64)
        >>> assert_close(torch.tensor([30.0, 4.1e-5]), big, dtype=torch.float16, scale_atol=True)
    """
    rtol, atol = tolerance(actual.dtype if dtype is None else dtype)
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    prefix = f"{msg}: " if msg else ""
    if a.shape != e.shape:
        raise AssertionError(f"{prefix}shape {tuple(a.shape)} != expected {tuple(e.shape)}")
    if scale_atol:
        finite = e[torch.isfinite(e)]
        if finite.numel():
            atol *= max(1.0, finite.abs().max().item())
    torch.testing.assert_close(
        a,
        e,
        rtol=rtol,
        atol=atol,
        equal_nan=True,
        msg=lambda m: f"{prefix}{m}\n(tolerance of {dtype_name(actual.dtype) if dtype is None else dtype})",
    )
