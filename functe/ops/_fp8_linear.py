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

import torch

from .._errors import check_same_device, check_same_dtype, check_tensor, describe_shape, shape_error
from .._fp8_gemm import compute_dtype, gemm_nt, native_ok
from .._fp8_state import LinearScalingState, as_cotangent, check_linear_state, delayed_scaling_update
from .._quantize import QUANTIZABLE, cast, cast_dbias
from .._recipe import BLOCK_RECIPES, DelayedScaling, MXFP8BlockScaling, Recipe, check_recipe
from .._vjp import custom_vjp
from ..kernels.elementwise import BIAS_GRAD
from ..kernels.quantize import MXFP8_CAST
from ._block_linear import block_linear

Tensor = torch.Tensor


# ----------------------------------------------------------------------------- per-tensor recipes


def _fwd(x, weight, bias, state, *, recipe):
    if isinstance(recipe, MXFP8BlockScaling):
        return _mx_fwd(x, weight, bias, recipe)
    x2 = x.reshape(-1, x.shape[-1])
    native = native_ok(x2, weight, dims=(x2.shape[0], weight.shape[0], x2.shape[1]))
    delayed = isinstance(recipe, DelayedScaling)
    scale_x, scale_w = (state.input.scale, state.weight.scale) if delayed else (None, None)
    xq, sx, amax_x = cast(x2, recipe, "input", scale_x, _store(recipe, "input", x, native))
    wq, sw, amax_w = cast(weight, recipe, "weight", scale_w, _store(recipe, "weight", x, native))
    sinv_x, sinv_w = torch.reciprocal(sx), torch.reciprocal(sw)
    y = gemm_nt(xq, sinv_x, wq, sinv_w, out_dtype=x.dtype, bias=bias, native=native, fast_accum=True)
    next_states = None
    if delayed:
        next_states = (
            delayed_scaling_update(state.input, amax_x, recipe=recipe, role="input"),
            delayed_scaling_update(state.weight, amax_w, recipe=recipe, role="weight"),
            state.grad_output,
        )
    residuals = (xq, sinv_x, wq, sinv_w, next_states, bias is not None, native, x.shape, x.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0]), residuals


def _store(recipe: Recipe, role: str, like: Tensor, native: bool) -> torch.dtype:
    """Storage of quantized operands: float8 for the native GEMM, its compute dtype otherwise."""
    return recipe.dtype(role) if native else compute_dtype(like.dtype)


def _bwd(res, dy, *, recipe):
    if isinstance(recipe, MXFP8BlockScaling):
        return _mx_bwd(res, dy, recipe)
    xq, sinv_x, wq, sinv_w, next_states, has_bias, native, x_shape, dtype = res
    dy2 = dy.reshape(-1, dy.shape[-1])
    if native and not native_ok(dy2, dims=(dy2.shape[0], dy2.shape[1], xq.shape[1])):
        native = False  # (not expected: same device and dims) decode the saved FP8 operands for the emulation
        xq, wq = xq.to(compute_dtype(dtype)), wq.to(compute_dtype(dtype))
    store = _store(recipe, "grad_output", dy, native)
    go_state = next_states[2] if next_states is not None else None
    go_scale = go_state.scale if go_state is not None else None
    if has_bias:
        dyq, dbias, sdy, amax_dy = cast_dbias(dy2, recipe, "grad_output", go_scale, store)
    else:
        (dyq, sdy, amax_dy), dbias = cast(dy2, recipe, "grad_output", go_scale, store), None
    sinv_dy = torch.reciprocal(sdy)
    dx = gemm_nt(dyq, sinv_dy, wq.t(), sinv_w, out_dtype=dtype, native=native)
    dw = gemm_nt(dyq.t(), sinv_dy, xq.t(), sinv_x, out_dtype=dtype, native=native)
    state_ct = None
    if next_states is not None:
        new_in, new_w, _ = next_states
        new_go = delayed_scaling_update(go_state, amax_dy, recipe=recipe, role="grad_output")
        state_ct = LinearScalingState(
            input=as_cotangent(new_in), weight=as_cotangent(new_w), grad_output=as_cotangent(new_go)
        )
    return dx.reshape(x_shape), dw, dbias, state_ct


# ----------------------------------------------------------------------------- MXFP8


def _mx(t: Tensor, recipe: Recipe, role: str, dtype: torch.dtype) -> Tensor:
    """MXFP8-quantize ``t`` along its last dim and return the exact dequantized values."""
    return MXFP8_CAST(t, recipe.dtype(role), compute_dtype(dtype))[0]


def _mx_fwd(x, weight, bias, recipe):
    x2 = x.reshape(-1, x.shape[-1])
    y = gemm_nt(
        _mx(x2, recipe, "input", x.dtype),
        None,
        _mx(weight, recipe, "weight", x.dtype),
        None,
        out_dtype=x.dtype,
        bias=bias,
    )
    return y.reshape(*x.shape[:-1], weight.shape[0]), (x, weight, bias is not None)


def _mx_bwd(res, dy, recipe):
    # Rowwise copies have blocks along K (fprop); dgrad reduces over N and wgrad over M, so their
    # operands are quantized again with blocks along those dims (TE's columnwise copies).
    x, weight, has_bias = res
    x2, dy2, dtype = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1]), x.dtype
    dx = gemm_nt(
        _mx(dy2, recipe, "grad_output", dtype), None, _mx(weight.t(), recipe, "weight", dtype), None, out_dtype=dtype
    )
    dw = gemm_nt(
        _mx(dy2.t(), recipe, "grad_output", dtype), None, _mx(x2.t(), recipe, "input", dtype), None, out_dtype=dtype
    )
    dbias = BIAS_GRAD(dy2) if has_bias else None
    return dx.reshape(x.shape), dw, dbias, None


_fp8_linear = custom_vjp("fp8_linear", _fwd, _bwd)


def fp8_linear(
    x: Tensor, weight: Tensor, bias: Tensor | None, state: LinearScalingState | None, *, recipe: Recipe, seed=None
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
            :mod:`functe.ops._block_linear` (``docs/block_scaling.md``).
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
    check_same_dtype("fp8_linear", "weight", weight, x, "x")
    if bias is not None:
        check_tensor("fp8_linear", "bias", bias, dtypes=QUANTIZABLE)
        if bias.shape != (weight.shape[0],):
            raise shape_error("fp8_linear", "bias", describe_shape(x.dtype, (weight.shape[0],)), bias)
        check_same_dtype("fp8_linear", "bias", bias, x, "x")
    check_linear_state("fp8_linear", state, recipe)
    check_same_device("fp8_linear", {"x": x, "weight": weight, "bias": bias})
    if isinstance(recipe, BLOCK_RECIPES):
        return block_linear(x, weight, bias, recipe=recipe, seed=seed)
    return _fp8_linear(x, weight, bias, state, recipe=recipe)
