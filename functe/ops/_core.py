"""Core ops: linear, bias, residual plumbing, scaling, identity, reshape.

Each public function checks its arguments (clear errors at the boundary) and
then calls a :func:`functe.custom_vjp` op. Forward rules return ``(out,
residuals)``; backward rules return one cotangent per positional argument.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .._backend import donatable
from .._errors import (
    FLOAT_DTYPES,
    ArgumentError,
    ShapeError,
    as_int,
    check_flag,
    check_number,
    check_same_device,
    check_same_dtype,
    check_tensor,
    describe,
    describe_shape,
    shape_error,
)
from .._parallel import (
    gather_grad_output,
    gather_input,
    gemm_bias,
    linear_parallelism,
    reduce_grad_input,
    reduce_output,
    share_replicated,
)
from .._vjp import custom_vjp
from ..kernels._common import rows_view
from ..kernels.elementwise import ADD_BIAS, AXPBY, BIAS_GRAD
from ._cast import autocast_inputs

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

Tensor = torch.Tensor


# ----------------------------------------------------------------------------- linear


def _linear_fwd(x, weight, bias, *, parallel=None):
    if parallel is None:
        return torch.nn.functional.linear(x, weight, bias), (x, weight, bias is not None)
    # Tensor parallelism (functe/_parallel.py): communication around the same GEMM.
    y = torch.nn.functional.linear(gather_input("linear", x, parallel), weight, gemm_bias(bias, parallel))
    return reduce_output("linear", y, bias, parallel), (x, weight, bias is not None)


def _linear_bwd(res, dy, *, parallel=None, needs_input_grad=(True, True, True)):
    x, weight, has_bias = res
    if parallel is not None:  # column+sp gathers x again (as TE: less memory), row+sp gathers dy
        # (every gradient, whatever is frozen: the collectives must match on every rank)
        x, dy = gather_input("linear", x, parallel), gather_grad_output("linear", dy, parallel)
        x_local, dy_local = share_replicated("linear", x, dy, parallel)
        dx = reduce_grad_input("linear", torch.matmul(dy_local, weight), parallel)
        dweight = torch.matmul(rows_view(dy_local).t(), rows_view(x_local))
        return dx, dweight, BIAS_GRAD(dy) if has_bias else None
    # Only the wanted gradients (a frozen weight's wgrad GEMM is a third of the linear's work).
    want_dx, want_dweight, want_dbias = needs_input_grad
    dx = torch.matmul(dy, weight) if want_dx else None
    dweight = torch.matmul(rows_view(dy).t(), rows_view(x)) if want_dweight else None
    dbias = BIAS_GRAD(dy) if has_bias and want_dbias else None
    return dx, dweight, dbias


def linear_prune(res, *, parallel=None, needs_input_grad):
    """``linear``'s residuals that the wanted gradients read: wgrad reads x, dgrad the weight (under
    tensor parallelism every gradient runs, so everything is kept)."""
    want_dx, want_dweight, _ = needs_input_grad
    if parallel is not None or (want_dx and want_dweight):
        return res
    x, weight, has_bias = res
    return (x if want_dweight else None, weight if want_dx else None, has_bias)


_linear = custom_vjp("linear", _linear_fwd, _linear_bwd, needs_input_grad=True, prune_residuals=linear_prune)


def linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    tensor_parallel_mode: str | None = None,
    sequence_parallel: bool = False,
    group: ProcessGroup | None = None,
) -> Tensor:
    """``y = x @ weight.T + bias`` for inputs of any leading shape.

    Args:
        x: ``[..., in_features]``.
        weight: ``[out_features, in_features]`` (TransformerEngine's and PyTorch's layout).
        bias: optional ``[out_features]``.
        tensor_parallel_mode: ``None``, ``"column"`` (weight ``[out/P, in]``, output split along
            features) or ``"row"`` (weight ``[out, in/P]``, input split along features, output
            all-reduced, bias replicated and added once). Shapes are the local ones.
        sequence_parallel: with a mode, activations outside the linear are split along dim 0:
            column all-gathers ``x``, row reduce-scatters ``y`` (see docs/parallel.md).
        group: the tensor-parallel ``ProcessGroup`` (default: the default group). A group of one
            rank is no parallelism.

    Returns:
        ``[..., out_features]`` in ``x``'s dtype. All arguments share one dtype
        and device; nothing is promoted silently.

    Example:
        >>> import torch
        >>> from functe import ops
        >>> ops.linear(torch.ones(2, 3), torch.ones(4, 3), torch.zeros(4)).shape
        torch.Size([2, 4])
    """
    check_tensor("linear", "x", x)
    check_tensor("linear", "weight", weight)
    if x.dim() < 1:
        raise shape_error("linear", "x", "a tensor of rank >= 1 ([..., in_features])", x)
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        expected = describe_shape(x.dtype, (None, x.shape[-1]))
        raise shape_error("linear", "weight", expected, weight, f"in_features must match x.shape[-1] = {x.shape[-1]}")
    check_same_dtype("linear", "weight", weight, x, "x", autocast=True)
    if bias is not None:
        check_tensor("linear", "bias", bias)
        if bias.shape != (weight.shape[0],):
            raise shape_error("linear", "bias", describe_shape(x.dtype, (weight.shape[0],)), bias)
        check_same_dtype("linear", "bias", bias, x, "x", autocast=True)
    check_same_device("linear", {"x": x, "weight": weight, "bias": bias})
    parallel = linear_parallelism("linear", x, tensor_parallel_mode, sequence_parallel, group)
    # (after the checks, which name what the caller passed: f32, not the bf16 autocast makes of it)
    x, weight, bias = autocast_inputs(x, weight, bias)
    if parallel is None:
        return _linear(x, weight, bias)
    return _linear(x, weight, bias, parallel=parallel)


# ----------------------------------------------------------------------------- bias


def _bias_fwd(x, b):
    return ADD_BIAS(x, b), None


def _bias_bwd(_, dy):
    return dy, BIAS_GRAD(dy)


_bias = custom_vjp("bias", _bias_fwd, _bias_bwd)


def bias(x: Tensor, b: Tensor) -> Tensor:
    """``y = x + b``, with ``b`` of shape ``[x.shape[-1]]`` broadcast over leading dims.

    The gradient of ``b`` is the sum of ``dy`` over all leading dimensions,
    accumulated in fp32.

    Example:
        >>> import torch
        >>> from functe import ops
        >>> ops.bias(torch.zeros(2, 3), torch.tensor([1.0, 2.0, 3.0])).tolist()
        [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]
    """
    check_tensor("bias", "x", x)
    check_tensor("bias", "b", b)
    if x.dim() < 1:
        raise shape_error("bias", "x", "a tensor of rank >= 1 ([..., features])", x)
    if b.shape != (x.shape[-1],):
        expected = describe_shape(x.dtype, (x.shape[-1],))
        raise shape_error("bias", "b", expected, b, "one value per feature of x's last dimension")
    check_same_dtype("bias", "b", b, x, "x", autocast=True)
    check_same_device("bias", {"x": x, "b": b})
    return _bias(*autocast_inputs(x, b))


# ----------------------------------------------------------------------------- residual plumbing


def _add_fwd(x, extra):
    return AXPBY(x, extra, 1.0, 1.0), None


def _add_bwd(_, dy):
    return dy, dy


_add_extra_input = custom_vjp("add_extra_input", _add_fwd, _add_bwd)


def add_extra_input(x: Tensor, extra: Tensor, *, in_place: bool = False) -> Tensor:
    """``y = x + extra`` (a residual connection); ``dx = dy`` and ``d_extra = dy``.

    ``in_place=True`` **donates** ``extra``: functe may reuse its buffer for
    ``y`` and the caller must not read ``extra`` afterwards (it may hold ``y`` or
    anything else). A pure program cannot observe the difference except through
    that buffer, so functe reuses it only where no autograd or ``torch.func``
    layer could see the write (e.g. inference) and ``extra`` shares no memory
    with ``x``; otherwise it computes out of place. (``functe.fuse`` never
    donates: its plans allocate their outputs.)

    Example:
        >>> import torch
        >>> from functe import ops
        >>> ops.add_extra_input(torch.ones(2), torch.full((2,), 2.0)).tolist()
        [3.0, 3.0]
    """
    check_tensor("add_extra_input", "x", x)
    check_tensor("add_extra_input", "extra", extra)
    if extra.shape != x.shape:
        raise shape_error("add_extra_input", "extra", describe_shape(x.dtype, tuple(x.shape)), extra)
    check_same_dtype("add_extra_input", "extra", extra, x, "x", autocast=True)
    check_same_device("add_extra_input", {"x": x, "extra": extra})
    x, extra = autocast_inputs(x, extra)
    # (a truthy non-bool, in_place="False", would donate, and overwrite, the caller's buffer)
    # (a donated buffer is written in place only where nothing can tell: see donatable; an x
    # overlapping extra's memory, extra.t() or a shifted slice, would make add_ raise)
    if check_flag("add_extra_input", "in_place", in_place) and donatable(extra, (x,)):
        return extra.add_(x)
    return _add_extra_input(x, extra)


def _extra_out_fwd(x):
    # (the extra output a view, not the same tensor: donating it must not write into x and y,
    # which _backend.donatable sees as the storage's other holder)
    return (x, x.view_as(x)), None


def _extra_out_bwd(_, cts):
    dy, dextra = cts
    if dy is None:
        return (dextra,)
    if dextra is None:
        return (dy,)
    return (AXPBY(dy, dextra, 1.0, 1.0),)


_make_extra_output = custom_vjp("make_extra_output", _extra_out_fwd, _extra_out_bwd, symbolic_zeros=True)


def make_extra_output(x: Tensor) -> tuple[Tensor, Tensor]:
    """Fork ``x`` into ``(y, extra)``, both equal to ``x``; ``dx = dy + d_extra``.

    An unused output contributes a zero gradient without materialising zeros.

    Example:
        >>> import torch
        >>> from functe import ops
        >>> x = torch.ones(3)
        >>> g = torch.func.grad(lambda x: sum(t.sum() for t in ops.make_extra_output(x)))(x)
        >>> g.tolist()
        [2.0, 2.0, 2.0]
    """
    check_tensor("make_extra_output", "x", x)
    return _make_extra_output(x)


# ----------------------------------------------------------------------------- scaling, identity, reshape


def _scale_fwd(x, *, scale):
    return AXPBY(x, None, scale, 0.0), None


def _scale_bwd(_, dy, *, scale):
    return (AXPBY(dy, None, scale, 0.0),)


_constant_scale = custom_vjp("constant_scale", _scale_fwd, _scale_bwd)


def constant_scale(x: Tensor, scale: float) -> Tensor:
    """``y = scale * x`` for a Python number ``scale``; ``dx = scale * dy``.

    Example:
        >>> import torch
        >>> from functe import ops
        >>> ops.constant_scale(torch.ones(2), -2.5).tolist()
        [-2.5, -2.5]
    """
    check_tensor("constant_scale", "x", x)
    return _constant_scale(x, scale=check_number("constant_scale", "scale", scale, finite=False))


def _identity_fwd(x):
    return x, None


def _identity_bwd(_, dy):
    return (dy,)


_identity = custom_vjp("identity", _identity_fwd, _identity_bwd)


def identity(x: Tensor) -> Tensor:
    """``y = x`` as an op (a fusion boundary and a place to hang a quantizer).

    Example:
        >>> import torch
        >>> from functe import ops
        >>> ops.identity(torch.arange(3.0)).tolist()
        [0.0, 1.0, 2.0]
    """
    check_tensor("identity", "x", x, dtypes=FLOAT_DTYPES)
    return _identity(x)


def _reshape_fwd(x, *, shape):
    return x.reshape(shape), tuple(x.shape)


def _reshape_bwd(in_shape, dy, *, shape):
    return (dy.reshape(in_shape),)


_reshape = custom_vjp("reshape", _reshape_fwd, _reshape_bwd)


def reshape(x: Tensor, shape: Sequence[int]) -> Tensor:
    """``x.reshape(shape)`` as an op; one ``-1`` is inferred. ``dx = dy.reshape(x.shape)``.

    Example:
        >>> import torch
        >>> from functe import ops
        >>> ops.reshape(torch.zeros(2, 6), (3, -1)).shape
        torch.Size([3, 4])
    """
    check_tensor("reshape", "x", x)
    if as_int(shape) is not None:
        shape = (shape,)  # as torch's x.reshape(12)
    dims = tuple(map(as_int, shape)) if isinstance(shape, (tuple, list, torch.Size)) else None
    if dims is None or any(d is None or d < -1 for d in dims):
        raise ArgumentError(f"functe.reshape: argument 'shape' expected a tuple of ints >= -1, got {shape!r}")
    shape = dims
    known = math.prod([d for d in shape if d != -1])
    inferred = shape.count(-1)
    fits = (inferred == 0 and known == x.numel()) or (inferred == 1 and known != 0 and x.numel() % known == 0)
    if inferred > 1 or not fits:
        raise ShapeError(
            f"functe.reshape: argument 'shape' expected a shape with {x.numel()} elements "
            f"(at most one -1) to match x {describe(x)}, got {shape}"
        )
    return _reshape(x, shape=shape)
