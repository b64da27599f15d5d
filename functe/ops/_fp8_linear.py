"""The quantized linear: ``y = x @ W.T + b`` with FP8 operands, TransformerEngine's way.

Forward: ``x`` and ``W`` are quantized (roles "input" and "weight", E4M3 under HYBRID) and
multiplied by the FP8 GEMM (:mod:`functe._fp8_gemm`). Backward: ``dy`` is quantized (role
"grad_output", E5M2 under HYBRID; one pass that also sums the bias gradient, TE's
bgrad_quantize), then ``dx = dy_q @ W_q`` and ``dW = dy_q.T @ x_q`` on the quantized operands
saved by the forward (the per-tensor transposes are the same FP8 values; MXFP8 quantizes the
columnwise copies from the high-precision ``x`` and ``W`` with blocks along the GEMM's
reduction dim, as TE does).

Under delayed scaling the op owns a :class:`functe.LinearScalingState`. Every role's next state
(input and weight computed in forward, grad_output in backward) comes back as the cotangent of
the ``state`` argument (see :mod:`functe._fp8_state`): ``functe.value_and_grad`` returns it as
the next state.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from .._errors import (
    check_same_device,
    check_same_dtype,
    check_tensor,
    describe_shape,
    shape_error,
)
from .._fp8_gemm import compute_dtype, gemm_nt, native_ok
from .._fp8_state import LinearScalingState, as_cotangent, check_linear_state, update_state
from .._parallel import (
    cast_input,
    gather_grad_output,
    gather_input,
    gathered_shape,
    gemm_bias,
    linear_parallelism,
    reduce_amax,
    reduce_grad_input,
    reduce_output,
)
from .._quantize import QUANTIZABLE, cast, cast_dbias
from .._recipe import BLOCK_RECIPES, DelayedScaling, MXFP8BlockScaling, Recipe, check_recipe
from .._seed import seed_tensor
from .._vjp import custom_vjp
from .._vjp_guard import quantized_first_order
from ..kernels._common import rows_view
from ..kernels.elementwise import BIAS_GRAD
from ..kernels.quantize import MXFP8_CAST
from ._block_linear import block_linear
from ._cast import autocast_inputs
from ._core import linear_prune

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

Tensor = torch.Tensor


# ----------------------------------------------------------------------------- per-tensor recipes


def _fwd(x, weight, bias, state, *, recipe, parallel=None):
    if isinstance(recipe, MXFP8BlockScaling):
        return _mx_fwd(x, weight, bias, recipe, parallel)
    x2 = rows_view(x)
    lead = gathered_shape(x.shape[:-1], parallel)  # tensor parallelism: functe/_parallel.py
    native = native_ok(x2, weight, dims=(math.prod(lead), weight.shape[0], x2.shape[1]))
    scale_x = state.input.scale if isinstance(recipe, DelayedScaling) else None
    xq, xq_gemm, sx, amax_x = cast_input(
        "fp8_linear", x2, recipe, scale_x, _store(recipe, "input", x, native), parallel
    )
    return forward_quantized(
        xq,
        sx,
        amax_x,
        x.shape,
        x.dtype,
        weight,
        bias,
        state,
        recipe=recipe,
        native=native,
        parallel=parallel,
        xq_gemm=xq_gemm,
    )


def forward_quantized(
    xq, sx, amax_x, x_shape, dtype, weight, bias, state, *, recipe, native, parallel=None, xq_gemm=None
):
    """The forward rule after the input cast: ``(y, residuals)`` from ``xq`` (2-D, quantized with scale ``sx``).

    Fused ops that produce the quantized input themselves (norm + cast, activation + cast: q-in) call
    this, so their residuals are exactly the ones the backward rule expects. ``xq_gemm`` is the GEMM
    operand when it differs from the saved ``xq`` (column + sequence parallel gathers it).
    """
    delayed = isinstance(recipe, DelayedScaling)
    scale_w = state.weight.scale if delayed else None
    wq, sw, amax_w = cast(weight, recipe, "weight", scale_w, _store(recipe, "weight", xq, native, dtype))
    sinv_x, sinv_w = torch.reciprocal(sx), torch.reciprocal(sw)
    y = gemm_nt(
        xq if xq_gemm is None else xq_gemm,
        sinv_x,
        wq,
        sinv_w,
        out_dtype=dtype,
        bias=gemm_bias(bias, parallel),
        native=native,
        fast_accum=True,
    )
    y = reduce_output("fp8_linear", y.reshape(*gathered_shape(x_shape[:-1], parallel), weight.shape[0]), bias, parallel)
    # The amaxes feed the next states only, which come back through the backward: the states are
    # updated there, with the amaxes reduced over ranks together with dy's in one collective (as TE
    # reduces once per step), and a forward without a backward (inference, evaluation on unequal
    # shards) communicates nothing.
    next_states = (state.input, state.weight, state.grad_output, amax_x, amax_w) if delayed else None
    residuals = (xq, sinv_x, wq, sinv_w, next_states, bias is not None, native, x_shape, dtype)
    return y, residuals


def _store(recipe: Recipe, role: str, like: Tensor, native: bool, dtype: torch.dtype | None = None) -> torch.dtype:
    """Storage of quantized operands: float8 for the native GEMM, its compute dtype (of ``dtype``,
    default ``like``'s) otherwise."""
    return recipe.dtype(role) if native else compute_dtype(like.dtype if dtype is None else dtype)


def _bwd(res, dy, *, recipe, parallel=None, needs_input_grad=(True,) * 4):
    # Only the wanted GEMMs (a frozen weight skips wgrad; not under tensor parallelism, whose
    # collectives must match on every rank: see _collective_gradients).
    want = (True, True) if _collective_gradients(parallel) else needs_input_grad[:2]
    if isinstance(recipe, MXFP8BlockScaling):
        return _mx_bwd(res, dy, recipe, parallel, want)
    # column+sp gathers the saved FP8 input again (as TE), row+sp gathers dy (high precision)
    res = (gather_input("fp8_linear", res[0], parallel), *res[1:])
    dy = gather_grad_output("fp8_linear", dy, parallel)
    dy2 = rows_view(dy)
    res, store, go_scale = grad_output_setup(res, dy2, recipe)
    if res[5]:  # has_bias
        dyq, dbias, sdy, amax_dy = cast_dbias(dy2, recipe, "grad_output", go_scale, store)
    else:
        (dyq, sdy, amax_dy), dbias = cast(dy2, recipe, "grad_output", go_scale, store), None
    dx, dw, state_ct = backward_quantized(res, dyq, sdy, amax_dy, recipe=recipe, parallel=parallel, want=want)
    return dx, dw, dbias, state_ct


def grad_output_setup(res, dy2, recipe):
    """Before the grad-output cast: ``(residuals, storage dtype of dy_q, grad_output scale or None)``."""
    xq, sinv_x, wq, sinv_w, next_states, has_bias, native, x_shape, dtype = res
    if native and not native_ok(dy2, dims=(dy2.shape[0], dy2.shape[1], x_shape[-1])):
        native = False  # (not expected: same device and dims) decode the saved FP8 operands for the emulation
        xq, wq = (None if t is None else t.to(compute_dtype(dtype)) for t in (xq, wq))
        res = (xq, sinv_x, wq, sinv_w, next_states, has_bias, native, x_shape, dtype)
    go_state = next_states[2] if next_states is not None else None
    return res, _store(recipe, "grad_output", dy2, native), go_state.scale if go_state is not None else None


def backward_quantized(res, dyq, sdy, amax_dy, *, recipe, parallel=None, want=(True, True)):
    """The backward rule after the grad-output cast: ``(dx, dW, state cotangent)``; ``want``: whether
    dx and dW are wanted (``None`` in their place when not).

    Fused ops that quantize dy themselves (activation backward + dbias + cast) call this.
    """
    xq, sinv_x, wq, sinv_w, next_states, _, native, x_shape, dtype = res
    sinv_dy = torch.reciprocal(sdy)
    dx = gemm_nt(dyq, sinv_dy, wq.t(), sinv_w, out_dtype=dtype, native=native) if want[0] else None
    dw = gemm_nt(dyq.t(), sinv_dy, xq.t(), sinv_x, out_dtype=dtype, native=native) if want[1] else None
    state_ct = None
    if next_states is not None:
        in_state, w_state, go_state, amax_x, amax_w = next_states  # (see forward_quantized)
        amax_x, amax_w, amax_dy = reduce_amax("fp8_linear", (amax_x, amax_w, amax_dy), parallel)
        new_in = update_state(in_state, amax_x, recipe=recipe, role="input")
        new_w = update_state(w_state, amax_w, recipe=recipe, role="weight")
        new_go = update_state(go_state, amax_dy, recipe=recipe, role="grad_output")
        state_ct = LinearScalingState(
            input=as_cotangent(new_in), weight=as_cotangent(new_w), grad_output=as_cotangent(new_go)
        )
    if dx is not None:
        dx = reduce_grad_input("fp8_linear", dx.reshape(gathered_shape(x_shape, parallel)), parallel)
    return dx, dw, state_ct


# ----------------------------------------------------------------------------- MXFP8


def _mx(t: Tensor, recipe: Recipe, role: str, dtype: torch.dtype) -> Tensor:
    """MXFP8-quantize ``t`` along its last dim and return the exact dequantized values."""
    return MXFP8_CAST(t, recipe.dtype(role), compute_dtype(dtype))[0]


def _mx_fwd(x, weight, bias, recipe, parallel=None):
    # Blocks run along K, so quantizing after the (column+sp) all-gather equals gathering MXFP8 shards.
    xg = gather_input("fp8_linear", x, parallel)
    x2 = rows_view(xg)
    y = gemm_nt(
        _mx(x2, recipe, "input", x.dtype),
        None,
        _mx(weight, recipe, "weight", x.dtype),
        None,
        out_dtype=x.dtype,
        bias=gemm_bias(bias, parallel),
    )
    y = reduce_output("fp8_linear", y.reshape(*xg.shape[:-1], weight.shape[0]), bias, parallel)
    return y, (x, weight, bias is not None)


def _mx_bwd(res, dy, recipe, parallel=None, want=(True, True)):
    # Rowwise copies have blocks along K (fprop); dgrad reduces over N and wgrad over M, so their
    # operands are quantized again with blocks along those dims (TE's columnwise copies). The input
    # is saved only for wgrad, the weight only for dgrad (see _prune).
    x, weight, has_bias = res
    dy = gather_grad_output("fp8_linear", dy, parallel)
    dy2, dtype = rows_view(dy), dy.dtype  # (the cotangent has the output's dtype, which is x's)
    dx = dw = None
    if want[0]:
        dy_q, wt_q = _mx(dy2, recipe, "grad_output", dtype), _mx(weight.t(), recipe, "weight", dtype)
        # (x's shape, gathered: the rows of the gathered dy, the weight's columns)
        dx_shape = (*dy.shape[:-1], weight.shape[1])
        dx = reduce_grad_input(
            "fp8_linear", gemm_nt(dy_q, None, wt_q, None, out_dtype=dtype).reshape(dx_shape), parallel
        )
    if want[1]:
        x2 = rows_view(gather_input("fp8_linear", x, parallel))
        dyt_q, xt_q = _mx(dy2.t(), recipe, "grad_output", dtype), _mx(x2.t(), recipe, "input", dtype)
        dw = gemm_nt(dyt_q, None, xt_q, None, out_dtype=dtype)
    dbias = BIAS_GRAD(dy2) if has_bias else None
    return dx, dw, dbias, None


def _collective_gradients(parallel) -> bool:
    """Whether both gradients run whatever is wanted: tensor parallelism's collectives must match on
    every rank (an ``amax_group`` alone reduces amaxes only: a frozen weight still skips wgrad)."""
    return parallel is not None and parallel.mode is not None


def _prune(res, *, recipe, parallel=None, needs_input_grad):
    """The residuals the wanted gradients read: wgrad the quantized input and its scale, dgrad the
    weight's (all of them under tensor parallelism, where every gradient runs; the delayed-scaling
    states always, for the grad-output scale and the state cotangent)."""
    want_dx, want_dw = needs_input_grad[:2]
    if _collective_gradients(parallel) or (want_dx and want_dw):
        return res
    if isinstance(recipe, MXFP8BlockScaling):
        return linear_prune(res, needs_input_grad=needs_input_grad[:3])
    xq, sinv_x, wq, sinv_w, *rest = res
    return (
        xq if want_dw else None,
        sinv_x if want_dw else None,
        wq if want_dx else None,
        sinv_w if want_dx else None,
        *rest,
    )


_fp8_linear = custom_vjp(
    "fp8_linear", quantized_first_order(_fwd, "fp8_linear"), _bwd, needs_input_grad=True, prune_residuals=_prune
)


def fp8_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    state: LinearScalingState | None,
    *,
    recipe: Recipe,
    tensor_parallel_mode: str | None = None,
    sequence_parallel: bool = False,
    group: ProcessGroup | None = None,
    amax_group: ProcessGroup | None = None,
    seed=None,
) -> Tensor:
    """``y = x @ weight.T + bias`` with FP8 operands (TransformerEngine's quantized linear).

    ``x`` and ``weight`` are quantized in forward, ``dy`` in backward, and dgrad/wgrad run on the
    quantized operands. On a GPU with FP8 tensor cores the GEMMs are ``torch._scaled_mm``;
    elsewhere an exact emulation (FP8 values are exact in bf16).

    Args:
        x: ``[..., in_features]`` in fp32/fp16/bf16.
        weight: ``[out_features, in_features]``, same dtype.
        bias: ``[out_features]`` or ``None``.
        state: the :class:`functe.LinearScalingState` under :class:`functe.DelayedScaling`, passed
            *directly* (no op in between: its cotangent is its next value); ``None`` for the
            stateless :class:`functe.CurrentScaling` and :class:`functe.MXFP8BlockScaling`.
        recipe: the quantization recipe (keyword-only, static). The block recipes
            :class:`functe.Float8BlockScaling` and :class:`functe.NVFP4BlockScaling` run in
            :mod:`functe.ops._block_linear` (``docs/block_scaling.md``; no tensor parallelism yet).
        tensor_parallel_mode, sequence_parallel, group: tensor parallelism as in
            :func:`functe.ops.linear`.
        amax_group: the ``ProcessGroup`` over which amaxes are MAX-reduced under delayed
            scaling (in the backward, with dy's), so that states stay identical across its ranks
            (default: the tensor-parallel group, so under pure data parallelism nothing is
            reduced, unlike TE's default of the world; pass the data-parallel or the world group,
            as TE's ``fp8_group``). The FP8 fusions keep it: their backward reduces the amaxes
            over the group as this op's does (docs/parallel.md, "Fusion rules").
        seed: NVFP4 only (ignored by the deterministic recipes): a Python int or ``i64[]`` tensor,
            the random bits of the Hadamard transform and stochastic rounding. Pass a new seed
            each step; required unless the recipe disables both.

    Returns:
        ``[..., out_features]`` in ``x``'s dtype. The next state comes back through the gradient:
        use :func:`functe.value_and_grad` (or :func:`functe.state_from_gradient` on the
        state's gradient).

    Example:
        >>> import torch, functe
        >>> recipe = functe.DelayedScaling(amax_history_len=4)
        >>> state = functe.init_linear_scaling_state(recipe)
        >>> x, w = torch.ones(2, 16), torch.full((8, 16), 0.5)
        >>> functe.ops.fp8_linear(x, w, None, state, recipe=recipe)[0, :2].tolist()
        [8.0, 8.0]
    """
    check_recipe("fp8_linear", recipe)
    check_tensor("fp8_linear", "x", x, dtypes=QUANTIZABLE)
    check_tensor("fp8_linear", "weight", weight, dtypes=QUANTIZABLE)
    if x.dim() < 1:
        raise shape_error("fp8_linear", "x", "a tensor of rank >= 1 ([..., in_features])", x)
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        expected = describe_shape(x.dtype, (None, x.shape[-1]))
        raise shape_error(
            "fp8_linear", "weight", expected, weight, f"in_features must match x.shape[-1] = {x.shape[-1]}"
        )
    check_same_dtype("fp8_linear", "weight", weight, x, "x", autocast=True)
    if bias is not None:
        check_tensor("fp8_linear", "bias", bias, dtypes=QUANTIZABLE)
        if bias.shape != (weight.shape[0],):
            raise shape_error("fp8_linear", "bias", describe_shape(x.dtype, (weight.shape[0],)), bias)
        check_same_dtype("fp8_linear", "bias", bias, x, "x", autocast=True)
    check_linear_state("fp8_linear", state, recipe)
    if seed is not None:  # (checked for every recipe: the deterministic ones ignore its value only)
        seed = seed_tensor(seed, x, "fp8_linear")
    state_leaves = {}
    for role in ("input", "weight", "grad_output") if state is not None else ():
        s = getattr(state, role)
        state_leaves.update({f"state.{role}.scale": s.scale, f"state.{role}.amax_history": s.amax_history})
    check_same_device("fp8_linear", {"x": x, "weight": weight, "bias": bias, **state_leaves})
    # (after the checks, which name what the caller passed; not the state: its scales stay fp32)
    x, weight, bias = autocast_inputs(x, weight, bias)
    stateful = isinstance(recipe, DelayedScaling)  # amaxes are reduced to keep states identical
    mode, sp = tensor_parallel_mode, sequence_parallel
    block = isinstance(recipe, BLOCK_RECIPES)
    unsupported = type(recipe).__name__ if block else None
    parallel = linear_parallelism(
        "fp8_linear", x, mode, sp, group, amax_group, fp8=stateful, unsupported_recipe=unsupported
    )
    if block:
        return block_linear(x, weight, bias, recipe=recipe, seed=seed)
    if parallel is None:
        return _fp8_linear(x, weight, bias, state, recipe=recipe)
    return _fp8_linear(x, weight, bias, state, recipe=recipe, parallel=parallel)
