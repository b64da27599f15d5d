"""Quantized tensors and the recipe-level casts built on the quantizing kernels.

:func:`quantize` and :func:`dequantize` are the public, non-differentiable conversions; the
helpers below (``cast``, ``cast_dbias``, ``cast_act``, ``cast_dact_dbias``, and for the fused ops of
``functe.fuse`` ``cast_norm``, ``cast_act_output``, ``cast_dact_output_dbias``) are what quantizing
ops use inside their rules, one per fused kernel: they run delayed scaling in one pass (cast with
the state's scale, amax of the same pass) and current scaling in two (amax, scale on the
device, cast). MXFP8 has no fused variants yet.
"""

from __future__ import annotations

import torch

from ._block_quantize import dequantize_block, quantize_block
from ._errors import (
    ArgumentError,
    DTypeError,
    ShapeError,
    StateError,
    TransformError,
    check_same_device,
    check_tensor,
    describe,
    describe_shape,
    dtype_name,
)
from ._fp8_state import check_delayed_state, recipe_scale, update_state
from ._recipe import BLOCK_RECIPES, ROLES, DelayedScaling, MXFP8BlockScaling, Recipe, check_recipe
from ._seed import seed_tensor
from ._state import ScalingState
from ._tree import pytree_dataclass
from .kernels.block_quantize import block_index
from .kernels.norm_quantize import NORM_CAST_AMAX
from .kernels.quantize import (
    ACT_CAST_AMAX,
    ACT_OUTPUT_CAST_AMAX,
    CAST_AMAX,
    DACT_DBIAS_CAST_AMAX,
    DACT_OUTPUT_DBIAS_CAST_AMAX,
    DBIAS_CAST_AMAX,
    MXFP8_CAST,
    e8m0_to_float,
    unit_scale,
)

Tensor = torch.Tensor

QUANTIZABLE = (torch.float32, torch.float16, torch.bfloat16)


@pytree_dataclass
class QuantizedTensor:
    """An FP8 tensor and what dequantizes it.

    Fields:
        data: the float8 values (``float8_e4m3fn`` or ``float8_e5m2``), shape of the original.
        scale_inv: ``f32[]``, ``1 / scale`` of a per-tensor recipe (``None`` for MXFP8):
            ``dequantize = data * scale_inv``.
        block_scales: MXFP8 only (else ``None``): ``u8[..., ceil(K/32)]`` E8M0 biased exponents,
            one per 32 elements of the last dim, ``scale_inv = 2**(e - 127)`` (255 = NaN); view
            them as ``torch.float8_e8m0fnu`` for APIs that take that dtype.

    Block recipes (``docs/block_scaling.md``): :class:`functe.Float8BlockScaling` stores float8
    ``data``, ``scale_inv=None`` and fp32 ``block_scales`` (the per-block ``scale_inv``:
    ``[..., ceil(K/128)]``, weights ``[ceil(M/128), ceil(K/128)]``); :class:`functe.NVFP4BlockScaling`
    stores packed E2M1 codes ``u8[..., K/2]`` (element ``2i`` in the low nibble; view as
    ``torch.float4_e2m1fn_x2``), the global decode scale ``f32[]`` as ``scale_inv`` and
    ``float8_e4m3fn`` block scales (``[..., ceil(K/16)]``, weights ``[ceil(M/16), ceil(K/16)]``).

    Example:
        >>> import torch, functe
        >>> q, _ = functe.quantize(torch.tensor([1.0, -3.5]), functe.CurrentScaling())
        >>> q.data.dtype, q.scale_inv.item()  # amax / 448
        (torch.float8_e4m3fn, 0.0078125)
    """

    data: Tensor
    scale_inv: Tensor | None
    block_scales: Tensor | None


# ----------------------------------------------------------------------------- casts used by ops


def cast(x: Tensor, recipe: Recipe, role: str, scale: Tensor | None, out_dtype: torch.dtype):
    """Per-tensor cast of ``x`` for ``role``: ``(q, scale used, amax)``.

    Delayed scaling casts with ``scale`` (the state's) and measures the amax in the same pass;
    current scaling measures the amax first and derives the scale from it on the device.
    """
    qdtype = recipe.dtype(role)
    if isinstance(recipe, DelayedScaling):
        q, amax = CAST_AMAX(x, scale, qdtype, out_dtype, True)
        return q, scale, amax
    _, amax = CAST_AMAX(x, unit_scale(x.device), qdtype, out_dtype, False)
    scale = recipe_scale(amax, recipe=recipe, role=role)
    q, _ = CAST_AMAX(x, scale, qdtype, out_dtype, True)
    return q, scale, amax


def cast_dbias(dy: Tensor, recipe: Recipe, role: str, scale: Tensor | None, out_dtype: torch.dtype):
    """Cast plus the bias gradient (TE's bgrad_quantize): ``(q, dbias, scale used, amax)``.

    Under current scaling the first pass computes the amax *and* dbias (TE PR #2007), the second
    only casts.
    """
    qdtype = recipe.dtype(role)
    if isinstance(recipe, DelayedScaling):
        q, dbias, amax = DBIAS_CAST_AMAX(dy, scale, qdtype, out_dtype, True)
        return q, dbias, scale, amax
    _, dbias, amax = DBIAS_CAST_AMAX(dy, unit_scale(dy.device), qdtype, out_dtype, False)
    scale = recipe_scale(amax, recipe=recipe, role=role)
    q, _ = CAST_AMAX(dy, scale, qdtype, out_dtype, True)
    return q, dbias, scale, amax


def cast_act(
    x: Tensor,
    act: str,
    recipe: Recipe,
    role: str,
    scale: Tensor | None,
    out_dtype: torch.dtype,
    *,
    limit: float = 7.0,
    alpha: float = 1.702,
    offset: float = 1.0,
):
    """``act(x)`` quantized in the activation's own kernel (q-in): ``(q, scale used, amax)``.

    ``act`` is any elementwise or gated activation of :mod:`functe.kernels._act`, or
    ``"clamped_swiglu"`` (with ``limit``, ``alpha``, ``offset``). Current scaling runs the
    kernel twice (amax, then cast), recomputing the activation instead of storing it.
    """
    qdtype, params = recipe.dtype(role), (limit, alpha, offset)
    if isinstance(recipe, DelayedScaling):
        q, amax = ACT_CAST_AMAX(x, scale, act, *params, qdtype, out_dtype, True)
        return q, scale, amax
    _, amax = ACT_CAST_AMAX(x, unit_scale(x.device), act, *params, qdtype, out_dtype, False)
    scale = recipe_scale(amax, recipe=recipe, role=role)
    q, _ = ACT_CAST_AMAX(x, scale, act, *params, qdtype, out_dtype, True)
    return q, scale, amax


def cast_dact_dbias(dy: Tensor, x: Tensor, act: str, recipe: Recipe, role: str, scale, out_dtype: torch.dtype):
    """``g = dy * act'(x)`` quantized with its bias gradient (TE's dbias_dgelu...): ``(q, dbias, scale, amax)``."""
    qdtype = recipe.dtype(role)
    if isinstance(recipe, DelayedScaling):
        q, dbias, amax = DACT_DBIAS_CAST_AMAX(dy, x, scale, act, qdtype, out_dtype, True)
        return q, dbias, scale, amax
    _, dbias, amax = DACT_DBIAS_CAST_AMAX(dy, x, unit_scale(dy.device), act, qdtype, out_dtype, False)
    scale = recipe_scale(amax, recipe=recipe, role=role)
    q, _, _ = DACT_DBIAS_CAST_AMAX(dy, x, scale, act, qdtype, out_dtype, True)
    return q, dbias, scale, amax


def _delayed_or_current(run, recipe: Recipe, role: str, scale: Tensor | None, device: torch.device):
    """The per-tensor scaling logic around a quantizing kernel ``run(scale, write)`` (results, amax last).

    Delayed scaling: one pass with the state's scale. Current scaling: a pass for the amax (and any
    other result, e.g. dbias), the scale on the device, then the cast pass. Returns the kernel's
    results with the scale used inserted before the amax.
    """
    if isinstance(recipe, DelayedScaling):
        *out, amax = run(scale, True)
        return (*out, scale, amax)
    _, *others, amax = run(unit_scale(device), False)
    scale = recipe_scale(amax, recipe=recipe, role=role)
    return (run(scale, True)[0], *others, scale, amax)


def cast_norm(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    kind: str,
    eps: float,
    zero_centered_gamma: bool,
    recipe: Recipe,
    role: str,
    scale: Tensor | None,
    out_dtype: torch.dtype,
):
    """``norm(x)`` quantized in the norm's own kernel (q-in): ``(q, scale used, amax, stats)``.

    ``kind`` is ``"layer"`` (LayerNorm, ``bias`` = β) or ``"rms"`` (RMSNorm, ``bias`` None). Equals
    ``cast(norm(x), ...)`` bit for bit. ``stats`` is LayerNorm's ``(mean, rstd)`` (shape
    ``x.shape[:-1]``, the bits the unfused LayerNorm returns; its backward takes them) and ``()``
    for RMSNorm. Delayed scaling: one pass; current scaling: the kernel runs twice (amax, then
    cast), recomputing the norm instead of storing it (see :mod:`functe.kernels.norm_quantize`).
    """
    qdtype = recipe.dtype(role)

    def run(s, write):
        return NORM_CAST_AMAX(x, weight, bias, s, eps, kind, zero_centered_gamma, qdtype, out_dtype, write)

    q, mean, rstd, scale, amax = _delayed_or_current(run, recipe, role, scale, x.device)
    return q, scale, amax, ((mean, rstd) if kind == "layer" else ())


def cast_act_output(
    x: Tensor,
    act: str,
    recipe: Recipe,
    role: str,
    scale: Tensor | None,
    out_dtype: torch.dtype,
    *,
    limit: float = 0.0,
    alpha: float = 0.0,
    offset: float = 0.0,
):
    """:func:`cast_act` of the activation's output rounded to x's dtype: equals ``cast(activation(x))``
    bit for bit (what the fused [activation, fp8_linear] op needs). ``(q, scale used, amax)``."""
    qdtype = recipe.dtype(role)

    def run(s, write):
        return ACT_OUTPUT_CAST_AMAX(x, s, act, limit, alpha, offset, qdtype, out_dtype, write)

    return _delayed_or_current(run, recipe, role, scale, x.device)


def cast_dact_output_dbias(dy: Tensor, x: Tensor, act: str, recipe: Recipe, role: str, scale, out_dtype: torch.dtype):
    """:func:`cast_dact_dbias` of ``g = dy * act'(x)`` rounded to x's dtype: equals
    ``cast_dbias(dactivation(dy, x))`` bit for bit. ``(q, dbias, scale used, amax)``."""
    qdtype = recipe.dtype(role)

    def run(s, write):
        return DACT_OUTPUT_DBIAS_CAST_AMAX(dy, x, s, act, qdtype, out_dtype, write)

    return _delayed_or_current(run, recipe, role, scale, dy.device)


# ----------------------------------------------------------------------------- public conversions


def _refuse_transformed(op: str, x: Tensor) -> None:
    """Raise if a ``torch.func`` ``grad``/``vjp`` or ``jvp`` level differentiates ``x``: the result is
    FP8 data, so its derivative would come out zero, silently (plain autograd leaves a result that
    does not require grad, which fails loudly where it is the only path). ``x.detach()`` opts out."""
    f = torch._C._functorch
    if f.maybe_current_level() is None:
        return
    differentiated = torch.autograd.forward_ad.unpack_dual(x).tangent is not None
    t = x
    # (a grad level's wrapper that requires grad: a captured trainable tensor that no transform
    # differentiates, under vmap or a grad over another argument, is autograd's, and stays allowed)
    while not differentiated and f.is_functorch_wrapped_tensor(t):
        differentiated = torch.is_grad_enabled() and f.is_gradtrackingtensor(t) and t.requires_grad
        t = f.get_unwrapped(t)
    if differentiated:
        raise TransformError(
            f"functe.{op}: argument 'x' ({describe(x)}) is differentiated by a torch.func transform, but "
            "quantization has no derivative (the result is FP8 data: the gradient or tangent would be zero, "
            "silently); quantize x.detach(), or use ops.fp8_linear, which is straight-through in reverse mode"
        )


def quantize(
    x: Tensor, recipe: Recipe, *, state: ScalingState | None = None, role: str = "input", seed=None
) -> tuple[QuantizedTensor, ScalingState | None]:
    """Quantize ``x`` for tensor ``role`` under ``recipe``: ``(QuantizedTensor, next state)``.

    Saturating: values beyond the format's range become ±max (±inf included); NaN stays NaN.
    Delayed scaling needs the role's ``state``; the cast uses its (delayed) scale and the next
    state records ``max|x|`` (:func:`functe.delayed_scaling_update`). Stateless recipes return
    ``None`` as the next state. Not differentiable (the result is FP8 data).

    Args:
        x: ``[..., K]`` in fp32/fp16/bf16.
        recipe: :class:`functe.DelayedScaling`, :class:`functe.CurrentScaling`,
            :class:`functe.MXFP8BlockScaling`, :class:`functe.Float8BlockScaling` or
            :class:`functe.NVFP4BlockScaling`.
        state: the role's :class:`functe.ScalingState` (delayed scaling only).
        role: ``"input"``, ``"weight"`` or ``"grad_output"``; picks E4M3 or E5M2 under HYBRID, and
            2-D blocks for weights under the block recipes.
        seed: NVFP4 only: a Python int or ``i64[]`` tensor, the random bits of stochastic rounding
            (``role="grad_output"`` unless disabled). Block recipes: see ``docs/block_scaling.md``.

    Example:
        >>> import torch, functe
        >>> recipe = functe.DelayedScaling(amax_history_len=2)
        >>> q, state = functe.quantize(torch.tensor([0.5, 896.0]), recipe, state=functe.init_scaling_state(2))
        >>> functe.dequantize(q).tolist(), state.scale.item()  # scale 1 saturates 896 to 448
        ([0.5, 448.0], 0.5)
    """
    check_tensor("quantize", "x", x, dtypes=QUANTIZABLE)
    check_recipe("quantize", recipe)
    if role not in ROLES:
        raise ArgumentError(f"functe.quantize: argument 'role' expected one of {ROLES}, got {role!r}")
    _refuse_transformed("quantize", x)
    x = x.detach()
    # (checked for every recipe: the deterministic ones ignore its value, not a malformed seed)
    seed = None if seed is None else seed_tensor(seed, x, "quantize")
    if isinstance(recipe, BLOCK_RECIPES):
        _no_state(state, recipe)
        data, scale_inv, block_scales = quantize_block(x, recipe, role, seed)
        return QuantizedTensor(data=data, scale_inv=scale_inv, block_scales=block_scales), None
    qdtype = recipe.dtype(role)
    if isinstance(recipe, MXFP8BlockScaling):
        _no_state(state, recipe)
        if x.dim() < 1:
            raise ShapeError(
                "functe.quantize: argument 'x' expected rank >= 1 for MXFP8 (blocks along the last dim), "
                f"got {describe(x)}"
            )
        data, e8m0 = MXFP8_CAST(x, qdtype, qdtype)
        return QuantizedTensor(data=data, scale_inv=None, block_scales=e8m0), None
    if isinstance(recipe, DelayedScaling):
        check_delayed_state("quantize", "state", state, recipe)
        check_same_device("quantize", {"x": x, "state.scale": state.scale, "state.amax_history": state.amax_history})
        # (not differentiable, as x: a transform differentiating the state reached the cast kernel's
        # second-order refusal)
        state = ScalingState(scale=state.scale.detach(), amax_history=state.amax_history.detach())
        data, scale, amax = cast(x, recipe, role, state.scale, qdtype)
        new_state = update_state(state, amax, recipe=recipe, role=role)
        return QuantizedTensor(data=data, scale_inv=torch.reciprocal(scale), block_scales=None), new_state
    _no_state(state, recipe)
    data, scale, _ = cast(x, recipe, role, None, qdtype)
    return QuantizedTensor(data=data, scale_inv=torch.reciprocal(scale), block_scales=None), None


def _no_state(state, recipe) -> None:
    if state is not None:
        raise StateError(f"functe.quantize: argument 'state' expected None ({type(recipe).__name__} is stateless)")


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The values a :class:`QuantizedTensor` stands for, in ``dtype`` (computed in fp32).

    As TE's, the product ``code * scale_inv`` is formed in fp32 whatever ``dtype`` is: a value
    past fp32's range (``x = FLT_MAX`` with power-of-two scales rounds up to ``2**128``) is
    ``inf`` in float64 too.

    Example:
        >>> import torch, functe
        >>> q, _ = functe.quantize(torch.arange(64.0), functe.MXFP8BlockScaling())
        >>> functe.dequantize(q)[[0, 31, 63]].tolist()
        [0.0, 32.0, 64.0]
    """
    if not isinstance(q, QuantizedTensor):
        raise ArgumentError(f"functe.dequantize: argument 'q' expected a QuantizedTensor, got {type(q).__name__}")
    check_quantized_layout("dequantize", "q", q)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise DTypeError(f"functe.dequantize: argument 'dtype' expected a floating dtype, got {dtype!r}")
    if q.block_scales is not None and q.block_scales.dtype != torch.uint8:
        return dequantize_block(q.data, q.scale_inv, q.block_scales).to(dtype)
    values = q.data.to(torch.float32)
    if q.block_scales is None:
        # (expanded: torch 2.13's vmap over 0 members fails on x * s with a batched 0-d s)
        return (values * q.scale_inv.expand(values.shape)).to(dtype)
    return mx_dequantize(values, q.block_scales).to(dtype)


_FP8_DATA = (torch.float8_e4m3fn, torch.float8_e5m2)


def check_quantized_layout(op: str, arg: str, q: QuantizedTensor) -> None:
    """Raise unless ``q``'s fields form one of the layouts :class:`QuantizedTensor` documents.

    A hand-built tensor whose block scales do not fit its data would otherwise be read out of
    bounds by the Triton kernels, or (a 1-D layout with too few rows) taken for a weight's 2-D one.
    """
    data, scale_inv, scales = q.data, q.scale_inv, q.block_scales

    def fail(field: str, expected: str, actual, why: str = "", error: type = ShapeError) -> None:
        tail = f" ({why})" if why else ""
        raise error(f"functe.{op}: argument '{arg}.{field}' expected {expected}, got {describe(actual)}{tail}")

    def check_scalar(field: str, value) -> None:
        if not isinstance(value, Tensor) or value.dtype != torch.float32 or value.dim() != 0:
            fail(field, "f32[]", value)

    if not isinstance(data, Tensor):
        fail("data", "a tensor", data)
    # (the kernels would read scales on another device as pointers into data's)
    check_same_device(op, {f"{arg}.data": data, f"{arg}.scale_inv": scale_inv, f"{arg}.block_scales": scales})
    if data.dim() < 1 and scales is not None:  # (a per-tensor FP8 scalar is fine: quantize makes one)
        fail("data", "a tensor of rank >= 1 (blocks along the last dim)", data)
    kind = None if scales is None else scales.dtype if isinstance(scales, Tensor) else type(scales)
    if kind is torch.float8_e4m3fn:  # NVFP4: packed E2M1 codes
        data_dtype, block, k, layouts = torch.uint8, 16, 2 * data.shape[-1], "NVFP4"
        check_scalar("scale_inv", scale_inv)
    elif kind in (None, torch.uint8, torch.float32):
        data_dtype, block = None, {None: 0, torch.uint8: 32, torch.float32: 128}[kind]
        k = data.shape[-1] if data.dim() else 1
        layouts = {None: "per-tensor FP8", torch.uint8: "MXFP8", torch.float32: "FP8 block"}[kind]
        if data.dtype not in _FP8_DATA:
            fail("data", "float8_e4m3fn or float8_e5m2 data", data, f"{layouts} layout", DTypeError)
        if kind is None:
            check_scalar("scale_inv", scale_inv)
            return
        if scale_inv is not None:
            fail("scale_inv", "None", scale_inv, f"{layouts} keeps its scales in block_scales")
    else:
        fail("block_scales", "None, u8 (MXFP8), f32 (FP8 block) or f8e4m3 (NVFP4) block scales", scales, "", DTypeError)
    if data_dtype is not None and data.dtype != data_dtype:
        fail("data", dtype_name(data_dtype), data, f"{layouts} layout", DTypeError)
    lead, n_blocks = tuple(data.shape[:-1]), -(-k // block)
    one_d = (*lead, n_blocks)
    two_d = (-(-data.shape[0] // block), n_blocks) if data.dim() == 2 and kind is not torch.uint8 else None
    if tuple(scales.shape) not in (one_d, two_d):
        expected = describe_shape(scales.dtype, one_d)
        if two_d is not None:
            expected += f" or, for a weight's {block}x{block} blocks, {describe_shape(scales.dtype, two_d)}"
        fail("block_scales", expected, scales, f"{layouts} data {describe(data)}")


def mx_dequantize(values: Tensor, e8m0: Tensor) -> Tensor:
    """``values * 2**(e - 127)`` with one exponent per 32 elements of the last dim (fp32)."""
    scale = e8m0_to_float(e8m0)
    return values * scale.index_select(-1, block_index(values.shape[-1], 32, scale.device))
