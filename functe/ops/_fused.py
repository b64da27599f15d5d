"""Fused ops: what the fusion rules (``functe.rules``) rewrite runs of core ops into.

Each is a :func:`functe.custom_vjp` op, internal (not in :mod:`functe.ops`'s surface): a rule
rewrites to it only after the unfused ops it covers were traced, and their shape inference
checked the arguments, so it checks nothing itself (called by hand with a wrong shape, dtype or
device it gives torch's error, or a wrong value). Each follows TransformerEngine's equivalence
contract (docs/fusion.md), which is what lets the executor choose the forward and the backward
plan independently:

* a **forward** fusion computes the covered ops' forward in fewer passes and
  returns exactly the residuals their own forward rules return (a tuple, one
  entry per covered op, in program order); its backward rule is the unfused
  chain of the covered ops' backward rules;
* a **backward** fusion consumes those unfused residuals and computes the
  covered ops' backward in fewer passes; its forward rule is the unfused chain.

Where the GEMMs run (:func:`triton_gemm`): with a Triton backend (CUDA, or the
interpreter in tests) and fp16/bf16 operands, the fused ops call functe's
Triton GEMMs (:mod:`functe.kernels.gemm`: epilogues with bias, activation and
residual; dgrad accumulating into a gradient; wgrad with the bias gradient in
the same pass). fp32/fp64 GEMMs stay with torch (cuBLAS): functe's fp32 GEMM
configurations are IEEE accuracy paths with small tiles. On the CPU the GEMMs
are ``torch.addmm`` / ``matmul`` in the operands' dtype (BLAS; the GEMM twins
would upcast 16-bit operands to fp32, twice the time on CPUs with bf16 units),
so the accumulation and the scale still happen inside the GEMM (one rounding).
"""

from __future__ import annotations

import torch

from .._backend import runs_triton
from .._vjp import custom_vjp
from ..kernels._common import column_sums, rows_view, shaped
from ..kernels.activation import DACTIVATION
from ..kernels.elementwise import AXPBY, BIAS_GRAD
from ..kernels.gemm import GEMM, GEMM_DGRAD, GEMM_DGRAD_DACT, GEMM_PREACT, GEMM_WGRAD, GEMM_WGRAD_DBIAS
from ..kernels.norm import LAYER_NORM_BWD_ADD, RMS_NORM_BWD_ADD
from ..kernels.quantize import DACT_DBIAS
from . import _activation as act
from . import _norm as norm
from ._core import (
    _add_bwd,
    _bias,
    _bias_bwd,
    _bias_fwd,
    _linear_bwd,
    _linear_fwd,
    _scale_bwd,
    _scale_fwd,
    linear_prune,
)

Tensor = torch.Tensor

TRITON_GEMM_DTYPES = (torch.float16, torch.bfloat16)


def triton_gemm(t: Tensor) -> bool:
    """Whether fused GEMMs on ``t`` run functe's Triton kernels (see the module docstring)."""
    return runs_triton(t.device) and t.dtype in TRITON_GEMM_DTYPES


def dact_prologue_pays(activation: str, k: int) -> bool:
    """Whether dgrad should apply the activation's backward as its prologue (``GEMM_DGRAD_DACT``).

    docs/gemm.md's cost model: every program recomputes act' once per output column block, which
    for relu/srelu (a compare and a select) is ~3% of the MMA and pays; for gelu, qgelu, silu and
    sigmoid (exp and reciprocal on the MUFU) it costs about as much as the MMA and pays only when
    the output ``dx [..., k]`` has a single column block (``k <= 64``, the narrowest BLOCK_N).
    """
    return activation in ("relu", "srelu") or k <= 64


def _frozen(needs_input_grad: tuple[bool, bool, bool], has_bias: bool) -> bool:
    """Whether a linear's ``(x, weight, bias)`` includes an input whose gradient nobody wants (an
    absent bias is flagged False, and wants nothing)."""
    want_dx, want_dweight, want_dbias = needs_input_grad
    return not (want_dx and want_dweight and (want_dbias or not has_bias))


def prune_covered(index: int, prune, arguments: int, static: tuple[str, ...] = ()):
    """``prune_residuals`` of a fused op whose residual ``index`` is a covered op's, pruned by that
    op's own ``prune``: the covered op's arguments are the fused op's first ``arguments``, and
    ``static`` names the fused op's static params its rule takes. The other ops' residuals are kept."""

    def fused_prune(res, *, needs_input_grad, **params):
        given = {k: params[k] for k in static if k in params}  # (an optional param the rule left out)
        kept = prune(res[index], needs_input_grad=needs_input_grad[:arguments], **given)
        # (always a new tuple: Dynamo cannot trace ``is`` between two tuples, and broke the graph there,
        # past which its optree polyfill failed on a dict output; the caller compares the leaves)
        return (*res[:index], kept, *res[index + 1 :])

    return fused_prune


def _prune_linear_at(index: int):
    """:func:`prune_covered` for a covered linear (``x, weight, bias`` lead the fused op's arguments;
    a row-parallel one passes its ``parallel``)."""
    return prune_covered(index, linear_prune, 3, static=("parallel",))


def _linear_residuals(x: Tensor, weight: Tensor, has_bias: bool):
    """The residuals ``linear``'s own forward rule returns (see ``_core._linear_fwd``)."""
    return (x, weight, has_bias)


# ----------------------------------------------------------------------------- forward: linear (+bias) (+scale) + add


def _forward_linear_add_fwd(x, weight, bias, extra, *, scale, bias_op):
    s = 1.0 if scale is None else scale
    lin = _linear_residuals(x, weight, bias is not None and not bias_op)
    res = (lin, *([None] * (1 + bias_op + (scale is not None))))
    if triton_gemm(x) and (bias is None or scale is None):
        # One kernel: y = extra + (s·x·Wᵀ + bias), one rounding. (The epilogue adds the bias after
        # alpha, so a scaled bias takes the path below; the scale rule declines biased linears.)
        return GEMM(x, weight, bias, extra, s), res
    if bias is None and s == 0.0:
        # BLAS skips the product at alpha = 0, where 0·inf must stay NaN (and -0.0 keep its sign):
        # the product, then extra + s·h in one pass, as the unfused chain (0·h is exact).
        y = torch.add(rows_view(extra), torch.mm(rows_view(x), weight.t()), alpha=s)
    elif bias is None:
        # y = s·x·Wᵀ + extra: the GEMM accumulates into the residual (beta = 1, alpha = s), one rounding.
        y = torch.addmm(rows_view(extra), rows_view(x), weight.t(), alpha=s)
    else:
        # With a bias, torch has no GEMM with both a bias and an accumulator: the bias epilogue
        # first, then one pass y = extra + s·h. That rounds h once, never more often than the
        # unfused chain (rounding extra + s·b first instead could cancel where it does not). A
        # separate bias op rounds the GEMM result before adding the bias, as unfused: the same bits.
        if bias_op:
            h = rows_view(_bias_fwd(torch.nn.functional.linear(x, weight), bias)[0])
        else:
            h = torch.addmm(bias, rows_view(x), weight.t())
        y = torch.add(rows_view(extra), h, alpha=s)
    # Residuals of the covered ops: linear, [bias], [constant_scale], add_extra_input.
    return shaped(y, extra.shape), res


def _forward_linear_add_bwd(res, dy, *, scale, bias_op, needs_input_grad=(True,) * 4):
    # The unfused chain, backwards: add_extra_input, [constant_scale], [bias], linear.
    want_dx, want_dweight, want_dbias, _ = needs_input_grad
    d_out, d_extra = _add_bwd(None, dy)
    if scale is not None:
        (d_out,) = _scale_bwd(None, d_out, scale=scale)
    d_bias = None
    if bias_op:
        d_out, d_bias = _bias_bwd(None, d_out)
    dx, dweight, d_lin_bias = _linear_bwd(res[0], d_out, needs_input_grad=(want_dx, want_dweight, want_dbias))
    return dx, dweight, (d_bias if want_dbias else None) if bias_op else d_lin_bias, d_extra


forward_linear_add = custom_vjp(
    "forward_linear_add",
    _forward_linear_add_fwd,
    _forward_linear_add_bwd,
    needs_input_grad=True,
    prune_residuals=_prune_linear_at(0),
)
"""``y = scale·(x·Wᵀ + bias) + extra``: one GEMM accumulating into ``extra`` (a bias adds one pass on CPU).

Static ``scale`` (``None``: no ``constant_scale`` op was covered) and
``bias_op`` (the bias came from a separate ``bias`` op, not from ``linear``)
fix the residual layout of the covered ops:
``linear [, bias] [, constant_scale], add_extra_input``.
"""


# ----------------------------------------------------------------------------- backward: make_extra_output -> linear


def _backward_linear_add_fwd(x, weight, bias, *, parallel=None):
    # Unfused forward: (x, x) = make_extra_output(x); y = linear(x, weight, bias).
    y, lin = _linear_fwd(x, weight, bias, parallel=parallel)
    return (x, y), (None, lin)


def _backward_linear_add_bwd(res, cts, *, parallel=None, needs_input_grad=(True, True, True)):
    # dx = d_extra + dy·W: the dgrad GEMM accumulates into the extra output's gradient (beta = 1).
    _, (x, weight, has_bias) = res
    d_extra, dy = cts
    if dy is None:
        return d_extra, None, None
    if parallel is not None or _frozen(needs_input_grad, has_bias):  # (only the wanted gradients, unfused)
        # (a row-parallel linear: its own backward marks the replicated dy, see _parallel)
        dx, dweight, dbias = _linear_bwd(
            (x, weight, has_bias), dy, parallel=parallel, needs_input_grad=needs_input_grad
        )
        return (None if dx is None else _acc_extra(dx, d_extra)), dweight, dbias
    if triton_gemm(dy):
        dx = GEMM_DGRAD(dy, weight, d_extra)
        dweight, dbias = GEMM_WGRAD_DBIAS(dy, x) if has_bias else (GEMM_WGRAD(dy, x), None)
        return dx, dweight, dbias
    dy2 = rows_view(dy)
    if d_extra is None:
        dx = torch.matmul(dy, weight)
    else:
        dx = shaped(torch.addmm(rows_view(d_extra), dy2, weight), x.shape)
    dweight = torch.matmul(dy2.t(), rows_view(x))
    return dx, dweight, BIAS_GRAD(dy) if has_bias else None


def _acc_extra(dx: Tensor, d_extra: Tensor | None) -> Tensor:
    return dx if d_extra is None else AXPBY(dx, d_extra, 1.0, 1.0)


backward_linear_add = custom_vjp(
    "backward_linear_add",
    _backward_linear_add_fwd,
    _backward_linear_add_bwd,
    symbolic_zeros=True,
    needs_input_grad=True,
    prune_residuals=_prune_linear_at(1),
)
"""``(extra, y) = (x, linear(x, weight, bias))``: a forked residual feeding a linear.

Its backward runs the dgrad GEMM accumulating into the extra output's
gradient; covers ``make_extra_output, linear``.
"""


# ----------------------------------------------------------------------------- backward: linear -> constant_scale


def _backward_linear_scale_fwd(x, weight, bias, *, scale, parallel=None):
    h, lin = _linear_fwd(x, weight, bias, parallel=parallel)
    y, _ = _scale_fwd(h, scale=scale)
    return y, (lin, None)


def _backward_linear_scale_bwd(res, dy, *, scale, parallel=None, needs_input_grad=(True, True, True)):
    # dx = s·dy·W and dW = s·dyᵀ·x: the scale is the alpha of both GEMMs.
    (x, weight, has_bias), _ = res
    if parallel is not None or _frozen(needs_input_grad, has_bias):  # (only the wanted gradients, unfused)
        # (a row-parallel linear: its rule marks the replicated dy for second derivatives, see _parallel)
        (dh,) = _scale_bwd(None, dy, scale=scale)
        return _linear_bwd((x, weight, has_bias), dh, parallel=parallel, needs_input_grad=needs_input_grad)
    if triton_gemm(dy):
        dx = GEMM_DGRAD(dy, weight, None, scale)
        if not has_bias or dy.dtype == torch.float16:  # (fp16: the bias gradient of _scaled_bias_grad)
            return dx, GEMM_WGRAD(dy, x, None, scale), _scaled_bias_grad(dy, scale) if has_bias else None
        dweight, dbias = GEMM_WGRAD_DBIAS(dy, x, None, scale)  # dbias comes unscaled
        return dx, dweight, AXPBY(dbias, None, scale, 0.0)
    if scale == 0.0:
        # BLAS skips the products at alpha = 0, where 0·inf must stay NaN: the unfused chain.
        (dh,) = _scale_bwd(None, dy, scale=scale)
        return _linear_bwd((x, weight, has_bias), dh)
    dy2 = rows_view(dy)
    zero = dy.new_zeros(())  # ignored: beta = 0
    dx = torch.addmm(zero, dy2, weight, beta=0, alpha=scale).view(*x.shape[:-1], weight.shape[1])
    dweight = torch.addmm(zero, dy2.t(), rows_view(x), beta=0, alpha=scale)
    dbias = _scaled_bias_grad(dy, scale) if has_bias else None
    return dx, dweight, dbias


def _scaled_bias_grad(dy, scale):
    """``scale · Σ dy`` over the rows, rounded once to dy's dtype.

    An fp16 ``Σ dy`` rounded before the scale overflows where the unfused chain (scale each element,
    then sum) stays finite (100 rows of dy = 1000 at scale 1/8: inf against 12500), so fp16 keeps the
    sum in fp32 up to the scale (a wider sum costs an upcast: not for bf16, whose range is fp32's).
    """
    if dy.dtype == torch.float16:
        return (column_sums(dy, torch.float32) * scale).to(dy.dtype)
    return AXPBY(BIAS_GRAD(dy), None, scale, 0.0)


backward_linear_scale = custom_vjp(
    "backward_linear_scale",
    _backward_linear_scale_fwd,
    _backward_linear_scale_bwd,
    needs_input_grad=True,
    prune_residuals=_prune_linear_at(0),
)
"""``y = scale·linear(x, weight, bias)``; its backward puts ``scale`` into both GEMMs.

Covers ``linear, constant_scale``.
"""

# ----------------------------------------------------------------------------- forward: linear (+bias) -> activation


def _act_params(activation: str) -> dict:
    """The static params of the ``activation`` op for an elementwise activation."""
    return {"name": activation, "interleave": 0, "limit": 0.0, "alpha": 0.0, "offset": 0.0}


def _forward_linear_activation_fwd(x, weight, bias, *, activation, bias_op):
    if triton_gemm(x):
        # The GEMM epilogue: z = x·Wᵀ + b (stored: the activation's backward needs it), y = act(z).
        y, z = GEMM_PREACT(x, weight, bias, None, 1.0, activation)
    else:
        # No epilogue on the CPU: the unfused ops' own calls (a separate bias op rounds the GEMM
        # result first, as unfused), then the activation kernel: the same bits.
        if bias_op:
            z, _ = _bias_fwd(torch.nn.functional.linear(x, weight), bias)
        else:
            z = torch.nn.functional.linear(x, weight, bias)
        y, _ = act._activation.fwd(z, None, **_act_params(activation))
    lin = _linear_residuals(x, weight, bias is not None and not bias_op)
    # Residuals of the covered ops: linear, [bias], activation (its input z).
    return y, ((lin, None, (z, None)) if bias_op else (lin, (z, None)))


def _forward_linear_activation_bwd(res, dy, *, activation, bias_op, needs_input_grad=(True, True, True)):
    # The unfused chain, backwards: activation, [bias], linear.
    dz, _ = act._activation.bwd(res[-1], dy, **_act_params(activation))
    d_bias = None
    if bias_op:
        dz, d_bias = _bias_bwd(None, dz)
    dx, dweight, d_lin_bias = _linear_bwd(res[0], dz, needs_input_grad=needs_input_grad)
    return dx, dweight, (d_bias if needs_input_grad[2] else None) if bias_op else d_lin_bias


forward_linear_activation = custom_vjp(
    "forward_linear_activation",
    _forward_linear_activation_fwd,
    _forward_linear_activation_bwd,
    needs_input_grad=True,
    prune_residuals=_prune_linear_at(0),
)
"""``y = act(x·Wᵀ + bias)`` with the bias and the activation in the GEMM epilogue (TE's
ForwardLinearBiasActivation, activation included). Covers ``linear, [bias], activation``; also
returns the pre-activation as the activation's residual."""


# ----------------------------------------------------------------------------- backward: activation and bias


def _dact_dbias(dy: Tensor, z: Tensor, activation: str, want_db: bool):
    """``(g = dy·act'(z), Σ_rows g or None)``: one pass (``DACT_DBIAS``) where a bias gradient is wanted."""
    if want_db and z.dtype != torch.float64:  # (the quantizing kernel computes in fp32)
        return DACT_DBIAS(dy, z, activation)
    g = DACTIVATION(dy, z, activation, 0, 0.0, 0.0, 0.0)
    return g, (BIAS_GRAD(g) if want_db else None)


def _backward_linear_activation_fwd(x, weight, bias, *, activation, parallel=None):
    # The unfused chain: linear, activation.
    z, lin = _linear_fwd(x, weight, bias, parallel=parallel)
    y, act_res = act._activation.fwd(z, None, **_act_params(activation))
    return y, (lin, act_res)


def _backward_linear_activation_bwd(res, dy, *, activation, parallel=None, needs_input_grad=(True, True, True)):
    (x, weight, has_bias), (z, _) = res
    if parallel is not None or _frozen(needs_input_grad, has_bias):  # (only the wanted gradients)
        # (a row-parallel linear: its rule marks the replicated g for second derivatives, see _parallel)
        g, dbias = _dact_dbias(dy, z, activation, has_bias and needs_input_grad[2])
        dx, dweight, _ = _linear_bwd((x, weight, False), g, parallel=parallel, needs_input_grad=needs_input_grad)
        return dx, dweight, dbias
    if triton_gemm(dy):
        if dact_prologue_pays(activation, weight.shape[1]):
            dx, g = GEMM_DGRAD_DACT(dy, z, weight, None, 1.0, activation)
        else:
            g = DACTIVATION(dy, z, activation, 0, 0.0, 0.0, 0.0)
            dx = GEMM_DGRAD(g, weight)
        # wgrad and the bias gradient in one pass over g.
        dweight, dbias = GEMM_WGRAD_DBIAS(g, x) if has_bias else (GEMM_WGRAD(g, x), None)
        return dx, dweight, dbias
    g, dbias = _dact_dbias(dy, z, activation, has_bias)
    g2 = rows_view(g)
    return torch.matmul(g, weight), torch.matmul(g2.t(), rows_view(x)), dbias


backward_linear_activation = custom_vjp(
    "backward_linear_activation",
    _backward_linear_activation_fwd,
    _backward_linear_activation_bwd,
    needs_input_grad=True,
    prune_residuals=_prune_linear_at(0),
)
"""``y = act(linear(x, weight, bias))``; its backward computes ``g = dy·act'(z)`` and the bias gradient
in one pass (Triton GEMMs: dact as dgrad's prologue where it pays, dbias inside the wgrad GEMM; else
the ``DACT_DBIAS`` kernel). Covers ``linear, activation``."""


def _backward_activation_bias_fwd(h, b, *, activation):
    z, _ = _bias.fwd(h, b)
    y, act_res = act._activation.fwd(z, None, **_act_params(activation))
    return y, (None, act_res)


def _backward_activation_bias_bwd(res, dy, *, activation):
    _, (z, _) = res
    return _dact_dbias(dy, z, activation, True)


backward_activation_bias = custom_vjp(
    "backward_activation_bias", _backward_activation_bias_fwd, _backward_activation_bias_bwd
)
"""``y = act(h + b)``; its backward computes ``dh = dy·act'(h + b)`` and ``db = Σ dh`` in one pass
(TE's BackwardActivationBias without a quantized output). Covers ``bias, activation``."""


# ----------------------------------------------------------------------------- backward: make_extra_output -> norm


def _norm_forward(kind: str, x, weight, bias, *, eps, zero_centered_gamma):
    """``(y, residuals)`` of the norm op of ``kind`` (``"layer"``: LayerNorm with ``bias``; ``"rms"``)."""
    if kind == "rms":
        return norm._rms_norm.fwd(x, weight, eps=eps, zero_centered_gamma=zero_centered_gamma)
    (y, _, _), res = norm._layer_norm.fwd(x, weight, bias, eps=eps, zero_centered_gamma=zero_centered_gamma)
    return y, res


def _norm_backward(kind: str, res, dy, *, eps, zero_centered_gamma):
    """``(dx, dweight, dbias or None)`` of the norm op of ``kind`` from its residuals, for a cotangent
    of ``y`` only (the LayerNorm statistics not differentiated through)."""
    static = {"eps": eps, "zero_centered_gamma": zero_centered_gamma}
    if kind == "layer":
        return norm._layer_norm.bwd(res, (dy, None, None), **static)
    return (*norm._rms_norm.bwd(res, dy, **static), None)


def q_in_norm_backward(linear, res, dy, *, kind, eps, zero_centered_gamma, recipe, **parallel):
    """Backward of a q-in fusion ``linear(norm(x))`` (``linear``: ``fp8_linear`` or ``block_linear``):
    the unfused chain, the linear's rule then the norm's, on the residuals ``(norm's, linear's)``.
    The linear's last cotangent (its scaling state's, or None for a seed) is passed through;
    ``parallel`` (an ``fp8_linear``'s amax group) goes to the linear's rule."""
    norm_res, lin_res = res
    dh, dweight, dbias, last = linear.bwd(lin_res, dy, recipe=recipe, **parallel)
    dx, dnorm_w, dnorm_b = _norm_backward(kind, norm_res, dh, eps=eps, zero_centered_gamma=zero_centered_gamma)
    return dx, dnorm_w, dnorm_b, dweight, dbias, last


def q_in_activation_backward(linear, res, dy, *, name, limit, alpha, offset, recipe, **parallel):
    """Backward of a q-in fusion ``linear(act(x))``: the linear's rule, then the activation's."""
    act_res, lin_res = res
    dh, dweight, dbias, last = linear.bwd(lin_res, dy, recipe=recipe, **parallel)
    dx, _ = act._activation.bwd(act_res, dh, name=name, interleave=0, limit=limit, alpha=alpha, offset=offset)
    return dx, dweight, dbias, last


def _backward_add_norm_fwd(x, weight, bias, *, kind, eps, zero_centered_gamma):
    # Unfused forward: (x, x) = make_extra_output(x); y = norm(x, weight[, bias]).
    y, norm_res = _norm_forward(kind, x, weight, bias, eps=eps, zero_centered_gamma=zero_centered_gamma)
    return (x, y), (None, norm_res)


def _backward_add_norm_bwd(res, cts, *, kind, eps, zero_centered_gamma):
    # dx = d_extra + norm'(dy): the norm's backward kernel adds the residual's gradient before rounding.
    _, norm_res = res
    d_extra, dy = cts
    if dy is None:
        return d_extra, None, None
    if d_extra is None:
        return _norm_backward(kind, norm_res, dy, eps=eps, zero_centered_gamma=zero_centered_gamma)
    if kind == "layer":
        x, weight, mean, rstd = norm_res
        return LAYER_NORM_BWD_ADD(dy, x, mean, rstd, weight, d_extra, zero_centered_gamma)
    x, weight = norm_res
    return (*RMS_NORM_BWD_ADD(dy, x, weight, d_extra, eps, zero_centered_gamma), None)


backward_add_norm = custom_vjp("backward_add_norm", _backward_add_norm_fwd, _backward_add_norm_bwd, symbolic_zeros=True)
"""``(extra, y) = (x, norm(x, weight[, bias]))``: a forked residual feeding a LayerNorm (``kind="layer"``)
or an RMSNorm (``kind="rms"``, ``bias`` None). Its backward adds the residual's gradient inside the
norm's backward kernel (TE's BackwardAddRMSNorm). Covers ``make_extra_output, layer_norm | rms_norm``
(the rule declines a LayerNorm whose statistics are used: this op does not return them)."""

__all__ = [
    "backward_activation_bias",
    "backward_add_norm",
    "backward_linear_activation",
    "backward_linear_add",
    "backward_linear_scale",
    "dact_prologue_pays",
    "forward_linear_activation",
    "forward_linear_add",
    "triton_gemm",
]
