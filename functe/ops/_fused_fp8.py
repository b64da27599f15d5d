"""Fused ops around the quantized linear: q-in forwards and the quantized activation backward.

* **q-in** (forward): a norm or an activation whose only consumer is an ``fp8_linear`` emits its
  output already quantized for that linear's input role, in its own kernel
  (:func:`functe._quantize.cast_norm`, :func:`functe._quantize.cast_act_output`), and the FP8 GEMM
  takes the quantized operand (:func:`functe.ops._fp8_linear.forward_quantized`). The
  high-precision output is never written. TE: ``LayerNorm`` / ``RMSNorm`` / activations with the
  next op's input quantizer.
* **activation backward + dbias + cast** (backward): ``g = dy·act'(z)``, its column sums (the
  bias gradient) and its quantization with the *producing* ``fp8_linear``'s grad-output state in
  one pass (:func:`functe._quantize.cast_dact_output_dbias`); that linear's dgrad and wgrad then
  run on the quantized ``g`` (:func:`functe.ops._fp8_linear.backward_quantized`). TE's
  BackwardActivationBias (``dbias_dgelu`` / ``dbias_drelu`` with the grad-output quantizer).

Every one follows the residual contract of ``docs/fusion.md``: the residuals are exactly those of
the covered ops (norm or activation, ``fp8_linear``), computed by the same code paths, so the
scaling states that come back through the gradient (``docs/fp8.md``) are those of the unfused
program, bit for bit. The fused kernels round to the producer's dtype before the amax and the cast
(TE's do not), which is what makes them equal.

Data parallelism: a linear's ``parallel`` without a tensor-parallel mode (an ``amax_group`` alone)
is passed to the fused op, whose backward reduces the forward's and dy's amaxes over that group
as ``fp8_linear``'s does (the forward communicates nothing). Tensor-parallel linears are not fused.

Per-tensor recipes only (delayed and current scaling); MXFP8 quantizes the columnwise copies from
the high-precision tensors, which these fusions would have to write anyway.
"""

from __future__ import annotations

import functools

import torch

from .._errors import RecipeError
from .._fp8_gemm import native_ok
from .._quantize import cast_act_output, cast_dact_output_dbias, cast_norm
from .._recipe import DelayedScaling, MXFP8BlockScaling
from .._vjp import custom_vjp
from .._vjp_guard import quantized_first_order
from ..kernels._common import rows_view
from . import _activation as act
from . import _fp8_linear as fp8
from ._core import _bias
from ._fused import _act_params, prune_covered, q_in_activation_backward, q_in_norm_backward

Tensor = torch.Tensor


def _per_tensor(op: str, recipe) -> None:
    if isinstance(recipe, MXFP8BlockScaling):
        raise RecipeError(f"functe.{op}: per-tensor recipes only (DelayedScaling, CurrentScaling), got {recipe!r}")


def _input_cast_setup(op: str, rows: Tensor, weight: Tensor, state, recipe):
    """``(native GEMM?, storage dtype of the quantized input, input scale or None)``, as fp8_linear's
    forward decides them for an input of ``rows`` rows."""
    _per_tensor(op, recipe)
    native = native_ok(rows, weight, dims=(rows.shape[0], weight.shape[0], weight.shape[1]))
    scale = state.input.scale if isinstance(recipe, DelayedScaling) else None
    return native, fp8._store(recipe, "input", rows, native), scale


# ----------------------------------------------------------------------------- q-in: norm -> fp8_linear


def _forward_norm_fp8_linear_fwd(
    x, norm_weight, norm_bias, weight, bias, state, *, kind, eps, zero_centered_gamma, recipe, parallel=None
):
    rows = rows_view(x)
    native, store, scale = _input_cast_setup("forward_norm_fp8_linear", rows, weight, state, recipe)
    xq, sx, amax, stats = cast_norm(
        rows, norm_weight, norm_bias, kind, eps, zero_centered_gamma, recipe, "input", scale, store
    )
    y, lin_res = fp8.forward_quantized(
        xq, sx, amax, x.shape, x.dtype, weight, bias, state, recipe=recipe, native=native, parallel=parallel
    )
    # The norm's residuals (its inputs, and LayerNorm's statistics in its output's shape), fp8_linear's.
    norm_res = (x, norm_weight, *(s.view(x.shape[:-1]) for s in stats))
    return y, (norm_res, lin_res)


# (backward: fp8_linear's rule, then the norm's)
forward_norm_fp8_linear = custom_vjp(
    "forward_norm_fp8_linear",
    quantized_first_order(_forward_norm_fp8_linear_fwd, "forward_norm_fp8_linear"),
    functools.partial(q_in_norm_backward, fp8._fp8_linear),
)
"""``fp8_linear(norm(x, norm_weight[, norm_bias]), weight, bias, state)`` with the norm's output
quantized in the norm kernel (q-in). Covers ``layer_norm | rms_norm, fp8_linear``."""


# ----------------------------------------------------------------------------- q-in: activation -> fp8_linear


def _forward_activation_fp8_linear_fwd(x, weight, bias, state, *, name, limit, alpha, offset, recipe, parallel=None):
    rows = rows_view(x)
    native, store, scale = _input_cast_setup("forward_activation_fp8_linear", rows, weight, state, recipe)
    xq, sx, amax = cast_act_output(rows, name, recipe, "input", scale, store, limit=limit, alpha=alpha, offset=offset)
    h_shape = torch.Size((*x.shape[:-1], xq.shape[-1]))  # (fp8_linear keeps x.shape, a torch.Size)
    y, lin_res = fp8.forward_quantized(
        xq, sx, amax, h_shape, x.dtype, weight, bias, state, recipe=recipe, native=native, parallel=parallel
    )
    return y, ((x, None), lin_res)  # the activation's residuals (its input), fp8_linear's


forward_activation_fp8_linear = custom_vjp(
    "forward_activation_fp8_linear",
    quantized_first_order(_forward_activation_fp8_linear_fwd, "forward_activation_fp8_linear"),
    functools.partial(q_in_activation_backward, fp8._fp8_linear),
)
"""``fp8_linear(act(x), weight, bias, state)`` with the activation's output quantized in the
activation kernel (q-in; elementwise, gated and clamped activations, chunked layout). Covers
``activation, fp8_linear``."""


# ------------------------------------------------------------------------- backward: fp8_linear -> [bias] -> activation


def _backward_fp8_linear_activation_fwd(x, weight, bias, state, extra_bias, *, activation, recipe, parallel=None):
    # The unfused chain: fp8_linear, [bias], activation.
    _per_tensor("backward_fp8_linear_activation", recipe)
    z, lin_res = fp8._fp8_linear.fwd(x, weight, bias, state, recipe=recipe, parallel=parallel)
    res = [lin_res]
    if extra_bias is not None:
        z, bias_res = _bias.fwd(z, extra_bias)
        res.append(bias_res)
    y, act_res = act._activation.fwd(z, None, **_act_params(activation))
    return y, (*res, act_res)


def _backward_fp8_linear_activation_bwd(res, dy, *, activation, recipe, parallel=None, needs_input_grad=(True,) * 5):
    lin_res, (z, _) = res[0], res[-1]
    dy2 = rows_view(dy)
    lin_res, store, scale = fp8.grad_output_setup(lin_res, dy2, recipe)
    gq, dbias, sg, amax = cast_dact_output_dbias(dy2, rows_view(z), activation, recipe, "grad_output", scale, store)
    # (only the wanted GEMMs: a frozen weight's wgrad, whose residuals _prune dropped, is skipped)
    want = needs_input_grad[:2]
    dx, dweight, state_ct = fp8.backward_quantized(lin_res, gq, sg, amax, recipe=recipe, parallel=parallel, want=want)
    # Both biases (the linear's own, a separate bias op's) have the gradient Σ_rows g.
    return dx, dweight, dbias if lin_res[5] else None, state_ct, dbias if len(res) == 3 else None


backward_fp8_linear_activation = custom_vjp(
    "backward_fp8_linear_activation",
    quantized_first_order(_backward_fp8_linear_activation_fwd, "backward_fp8_linear_activation"),
    _backward_fp8_linear_activation_bwd,
    needs_input_grad=True,
    # (fp8_linear's pruning of its residuals, the first; the bias's and activation's are kept)
    prune_residuals=prune_covered(0, fp8._prune, 4, static=("recipe", "parallel")),
)
"""``act(fp8_linear(x, weight, bias, state) [+ extra_bias])``; its backward computes
``g = dy·act'(z)``, the bias gradient and the quantization of ``g`` with the linear's grad-output
state in one pass, then dgrad and wgrad on the quantized ``g``. Covers ``fp8_linear, [bias],
activation``."""

__all__ = ["backward_fp8_linear_activation", "forward_activation_fp8_linear", "forward_norm_fp8_linear"]
