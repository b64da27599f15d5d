"""Fused GEMMs with their PyTorch twins: forward epilogues, backward GEMMs, FP8 operands.

One Triton kernel computes ``C = epilogue(alpha · sa · sb · prologue(A) @ B)`` for
``A [M, K]`` and ``B [K, N]`` of any strides, accumulating in fp32 (fp64 for
fp64 operands). The roles are views of that one kernel:

===================  =========================  ==========================  ================================
launcher             A                          B                           result
===================  =========================  ==========================  ================================
``gemm``             x ``[..., K]``             Wᵀ (W ``[N, K]``)           ``y [..., N]``
``gemm_dgrad``       dy ``[..., N]``            W                           ``dx [..., K]``
``gemm_dgrad_dact``  dy · act'(z) (prologue)    W                           ``(dx, g)``
``gemm_wgrad``       dyᵀ (over all rows)        x                           ``dW [N, K]``
``gemm_wgrad_dbias`` dyᵀ, plus its row sums     x                           ``(dW, db)``
===================  =========================  ==========================  ================================

The forward epilogue, in this order: ``p = alpha·sa·sb·acc`` → ``+ bias`` →
(pre-activation ``z`` stored by ``gemm_preact``) → ``act`` (any elementwise
activation of :mod:`functe.kernels._act`) → ``+ residual`` → cast. Backward
GEMMs add ``accum`` (TE's BackwardLinearAdd / main_grad accumulation) and
take ``alpha`` (BackwardLinearScale). Quantized outputs live in
:mod:`functe.kernels.gemm_fp8`.

FP8 operands (``float8_e4m3fn`` / ``float8_e5m2``, any combination: E4M3 x
E4M3 forward, E5M2 x E4M3 for dgrad and wgrad) come with per-tensor
``scale_inv`` (fp32, one element), applied in the epilogue: TE's convention,
``dequant = q · scale_inv``. Their result dtype must be given (``out_dtype``).

Every launcher allocates its outputs and never writes its inputs; the
``*_IN_PLACE`` objects are the only exception, and only when the caller donates
the accumulator (see :class:`Donating`). Twins upcast the operands exactly and
multiply in the compute dtype, so they compute the kernel's formula up to
summation order.

Under Triton's interpreter, ``tl.dot`` multiplies bf16 tiles as raw uint16
bits (numpy has no bf16), so bf16 tiles are upcast to fp32 first: exact, since
a product of two bf16 values fits an fp32 mantissa. FP8 tiles are decoded by
the interpreter itself (correct for every finite value; it cannot decode NaN or
inf codes).

Example (on CPU the twins run; ``functe.use_backend("interpret")`` runs the kernel):
    >>> import torch
    >>> x, w, b = torch.ones(2, 3), torch.ones(4, 3), torch.full((4,), -3.0)
    >>> GEMM(x, w, b, None, 2.0, "relu").tolist()  # relu(2·x @ Wᵀ + b)
    [[3.0, 3.0, 3.0, 3.0], [3.0, 3.0, 3.0, 3.0]]
    >>> dx, g = GEMM_DGRAD_DACT(torch.ones(2, 4), torch.ones(2, 4), w, None, 1.0, "relu")
    >>> dx.tolist()  # (dy · relu'(z)) @ W
    [[4.0, 4.0, 4.0], [4.0, 4.0, 4.0]]
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from .._backend import donatable, interpreting, runs_triton
from .._errors import (
    FLOAT_DTYPES,
    ArgumentError,
    DTypeError,
    check_same_device,
    check_same_dtype,
    check_tensor,
    describe_shape,
    dtype_error,
    dtype_name,
    shape_error,
)
from .._kernel import Kernel, Rowwise
from . import _gemm_configs
from ._act import ACTIVATIONS, act_fwd, act_fwd_ref, act_grad, act_grad_ref
from ._common import column_sums, compute_dtype, rows_view, tl_compute_dtype, tl_dtype
from ._fp8_cast import FP8_DTYPES, fp8_format, saturating_cast
from ._triton import cdiv, jit, on_device_of

Tensor = torch.Tensor

_NO_ACT = -1


# ----------------------------------------------------------------------------- the kernel


@jit
def _gemm_tile(
    tile,
    A,
    B,
    C,
    BIAS,
    RES,
    PRE,
    ZIN,
    G,
    ROWSUM,
    AMAX,
    A_SCALE_INV,
    B_SCALE_INV,
    Q_SCALE,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    stride_rm,
    stride_rn,
    stride_zm,
    stride_zk,
    alpha,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    HAS_RES: tl.constexpr,
    STORE_PRE: tl.constexpr,
    DACT: tl.constexpr,
    STORE_G: tl.constexpr,
    ROW_SUM: tl.constexpr,
    SCALED: tl.constexpr,
    AMAX_OUT: tl.constexpr,
    QUANT: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_EMIN: tl.constexpr,
    ROUND_TO: tl.constexpr,
    COMPUTE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SPLIT_ACC: tl.constexpr,
    UPCAST: tl.constexpr,
    EMULATE_FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Grouped order: GROUP_M row-blocks share each column block while it is in L2.
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    first_m = (tile // width) * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % width) % group_m
    pid_n = (tile % width) // group_m

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # Row-side outputs (g, row sums) are written once, by the programs of the first column block.
    first_col_rows = tl.where(pid_n == 0, M, 0)
    # Operand rows and columns wrap around instead of being masked, so only K needs
    # a load mask; results of wrapped rows/columns are dropped by the masked stores.
    am = (rm % M).to(tl.int64)
    bn = (rn % N).to(tl.int64)
    a_ptrs = A + am[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = B + rk[:, None] * stride_bk + bn[None, :] * stride_bn
    if DACT >= 0:
        z_ptrs = ZIN + am[:, None] * stride_zm + rk[None, :] * stride_zk
    if ROW_SUM:
        row_sum = tl.zeros((BLOCK_M,), dtype=COMPUTE)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=COMPUTE)
    for k0 in range(0, K, BLOCK_K):
        k_in = rk < K - k0
        a = tl.load(a_ptrs, mask=k_in[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_in[:, None], other=0.0)
        if DACT >= 0:
            # Prologue: g = dy · act'(z), rounded to dy's dtype as an unfused dact would store it.
            z = tl.load(z_ptrs, mask=k_in[None, :], other=0.0).to(COMPUTE)
            a = (a.to(COMPUTE) * act_grad(z, DACT)).to(A.dtype.element_ty)
            if STORE_G:
                # One program per row block writes g: the one computing the first column block.
                g_mask = (rm < first_col_rows)[:, None] & k_in[None, :]
                tl.store(G + rm.to(tl.int64)[:, None] * K + (k0 + rk)[None, :], a, mask=g_mask)
            z_ptrs += BLOCK_K * stride_zk
        if ROW_SUM:
            row_sum += tl.sum(a.to(COMPUTE), axis=1)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if SPLIT_ACC:
            # FP8 on Hopper: promote to fp32 after every K block (TE's split accumulator, dgrad/wgrad)
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K, out_dtype=COMPUTE)
        else:
            # (FP8 on Hopper keeps Triton's fast wgmma accumulation here, as TE's fprop does)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION, out_dtype=COMPUTE)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    y = acc * alpha
    if SCALED:
        y = y * (tl.load(A_SCALE_INV) * tl.load(B_SCALE_INV))
    cm = rm.to(tl.int64)
    cn = rn.to(tl.int64)
    c_mask = (rm < M)[:, None] & (rn < N)[None, :]
    c_offs = cm[:, None] * stride_cm + cn[None, :] * stride_cn
    if HAS_BIAS:
        y += tl.load(BIAS + bn).to(COMPUTE)[None, :]
    if STORE_PRE:
        tl.store(PRE + c_offs, y.to(PRE.dtype.element_ty), mask=c_mask)
    if ACT >= 0:
        # The activation reads the pre-activation as the unfused linear would hand it over (rounded
        # to its dtype, as stored for the backward): fused and unfused agree, an overflow included.
        y = act_fwd(y.to(ROUND_TO).to(COMPUTE), ACT)
    if HAS_RES:
        y += tl.load(RES + cm[:, None] * stride_rm + cn[None, :] * stride_rn, mask=c_mask, other=0.0).to(COMPUTE)
    if ROW_SUM:
        tl.store(ROWSUM + cm, row_sum.to(ROWSUM.dtype.element_ty), mask=rm < first_col_rows)
    if AMAX_OUT:
        # amax of the output as an unfused op would hold it (rounded to its dtype);
        # adding the sum of the NaN entries makes a NaN anywhere give a NaN amax.
        y = y.to(ROUND_TO).to(COMPUTE)
        seen = tl.where(c_mask, y, 0.0)
        tl.store(AMAX + tile, tl.max(tl.abs(seen)) + tl.sum(tl.where(seen != seen, seen, 0.0)))
    if QUANT:
        out = saturating_cast(
            y.to(tl.float32) * tl.load(Q_SCALE), C.dtype.element_ty, FP8_MAX, FP8_MANT, FP8_EMIN, EMULATE_FP8
        )
    else:
        out = y.to(C.dtype.element_ty)
    tl.store(C + c_offs, out, mask=c_mask)


@jit
def _gemm_kernel(
    A,
    B,
    C,
    BIAS,
    RES,
    PRE,
    ZIN,
    G,
    ROWSUM,
    AMAX,
    A_SCALE_INV,
    B_SCALE_INV,
    Q_SCALE,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    stride_rm,
    stride_rn,
    stride_zm,
    stride_zk,
    alpha,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    HAS_RES: tl.constexpr,
    STORE_PRE: tl.constexpr,
    DACT: tl.constexpr,
    STORE_G: tl.constexpr,
    ROW_SUM: tl.constexpr,
    SCALED: tl.constexpr,
    AMAX_OUT: tl.constexpr,
    QUANT: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_EMIN: tl.constexpr,
    ROUND_TO: tl.constexpr,
    COMPUTE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SPLIT_ACC: tl.constexpr,
    UPCAST: tl.constexpr,
    EMULATE_FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PERSISTENT: tl.constexpr,
):
    # Non-persistent: one program per output tile. Persistent: a fixed number of
    # programs (the SM count) each loop over tiles, saving launch/tail effects.
    if PERSISTENT:
        num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
            _gemm_tile(
                tile, A, B, C, BIAS, RES, PRE, ZIN, G, ROWSUM, AMAX, A_SCALE_INV, B_SCALE_INV, Q_SCALE,
                M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_rm, stride_rn,
                stride_zm, stride_zk, alpha, HAS_BIAS, ACT, HAS_RES, STORE_PRE, DACT, STORE_G, ROW_SUM, SCALED,
                AMAX_OUT, QUANT, FP8_MAX, FP8_MANT, FP8_EMIN, ROUND_TO, COMPUTE, DOT_PRECISION, SPLIT_ACC, UPCAST,
                EMULATE_FP8, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
            )  # fmt: skip
    else:
        _gemm_tile(
            tl.program_id(0), A, B, C, BIAS, RES, PRE, ZIN, G, ROWSUM, AMAX, A_SCALE_INV, B_SCALE_INV, Q_SCALE,
            M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_rm, stride_rn,
            stride_zm, stride_zk, alpha, HAS_BIAS, ACT, HAS_RES, STORE_PRE, DACT, STORE_G, ROW_SUM, SCALED,
            AMAX_OUT, QUANT, FP8_MAX, FP8_MANT, FP8_EMIN, ROUND_TO, COMPUTE, DOT_PRECISION, SPLIT_ACC, UPCAST,
            EMULATE_FP8, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
        )  # fmt: skip


# ----------------------------------------------------------------------------- launching

_AUTOTUNED: dict[int, triton.runtime.Autotuner] = {}
_SM_COUNT: dict[int, int] = {}


def _autotuned(operand_bytes: int):
    """The kernel autotuned over the config list for this operand width (built on first GPU use)."""
    kernel = _AUTOTUNED.get(operand_bytes)
    if kernel is None:
        # restore_value: benchmarking runs must not accumulate into a donated C (C aliases RES then).
        kernel = triton.autotune(_gemm_configs.configs_for(operand_bytes), key=["M", "N", "K"], restore_value=["C"])(
            _gemm_kernel
        )
        _AUTOTUNED[operand_bytes] = kernel
    return kernel


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def _strides(t: Tensor | None) -> tuple[int, int]:
    return (t.stride(0), t.stride(1)) if t is not None else (0, 0)


def _launcher(a: Tensor, M: int, N: int):
    """``(kernel[grid], max tiles, fixed config)``: the interpreter's fixed config, or the autotuned GPU kernel."""
    if interpreting():
        config = dict(_gemm_configs.INTERPRET)
        tiles = cdiv(M, config["BLOCK_M"]) * cdiv(N, config["BLOCK_N"])
        programs = min(tiles, _gemm_configs.INTERPRET_PROGRAMS) if config["PERSISTENT"] else tiles
        return _gemm_kernel[(programs,)], tiles, config
    configs = _gemm_configs.configs_for(a.element_size())
    bm, bn = _gemm_configs.smallest_tile(configs)
    sms = _sm_count(a.device)

    def grid(meta):
        n = cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"])
        return (min(n, sms) if meta["PERSISTENT"] else n,)

    return _autotuned(a.element_size())[grid], cdiv(M, bm) * cdiv(N, bn), {}


def run_gemm(
    a: Tensor,
    b: Tensor,
    out: Tensor,
    *,
    alpha: float = 1.0,
    a_scale_inv: Tensor | None = None,
    b_scale_inv: Tensor | None = None,
    bias: Tensor | None = None,
    residual: Tensor | None = None,
    activation: str | None = None,
    pre: Tensor | None = None,
    dact: str | None = None,
    z: Tensor | None = None,
    g: Tensor | None = None,
    row_sum: Tensor | None = None,
    amax: bool = False,
    q_scale: Tensor | None = None,
    round_to: torch.dtype | None = None,
    split_accumulator: bool = False,
) -> Tensor | None:
    """Launch ``out = epilogue(alpha·sa·sb·prologue(a) @ b)`` on 2-D ``a [M, K]``, ``b [K, N]`` (any strides).

    Every output (``out``, ``pre``, ``g``, ``row_sum``) is preallocated by the
    caller; ``residual`` may be ``out`` itself (each program reads a residual
    tile before writing the same tile). Returns the output's amax (fp32 0-d)
    when ``amax`` (or ``q_scale``, which quantizes ``out`` to its FP8 dtype), else None.
    ``split_accumulator`` (FP8 operands, Hopper) promotes the accumulation to fp32 after every
    K block, as TE does for dgrad and wgrad; otherwise Triton's fast FP8 accumulation is kept.
    """
    M, K = a.shape
    N = b.shape[1]
    if bias is not None:
        bias = bias.contiguous()  # the epilogue reads it as one contiguous row (a strided bias was misread)
    quant = q_scale is not None
    want_amax = amax or quant
    if M == 0 or N == 0:
        return torch.zeros((), dtype=torch.float32, device=out.device) if want_amax else None
    fp8_max_value, mant, emin = fp8_format(out.dtype) if quant else (448.0, 3, -6)
    flags = {
        "HAS_BIAS": bias is not None,
        "ACT": _NO_ACT if activation is None else ACTIVATIONS[activation],
        "HAS_RES": residual is not None,
        "STORE_PRE": pre is not None,
        "DACT": _NO_ACT if dact is None else ACTIVATIONS[dact],
        "STORE_G": g is not None,
        "ROW_SUM": row_sum is not None,
        "SCALED": a_scale_inv is not None,
        "AMAX_OUT": want_amax,
        "QUANT": quant,
        "FP8_MAX": fp8_max_value,
        "FP8_MANT": mant,
        "FP8_EMIN": emin,
        # what the unfused linear's result would be rounded to (quantized outputs: the unfused dtype),
        # before its activation and, without one, before its amax is taken
        "ROUND_TO": tl_dtype(round_to if quant else out.dtype) if want_amax or activation else tl.float32,
        "COMPUTE": tl_compute_dtype(a.dtype),
        "DOT_PRECISION": "ieee" if a.dtype in (torch.float32, torch.float64) else "tf32",
        "SPLIT_ACC": split_accumulator and a.element_size() == 1,
        "UPCAST": interpreting() and a.dtype == torch.bfloat16,
        "EMULATE_FP8": interpreting(),
    }
    kernel, tiles, config = _launcher(a, M, N)
    # Per-tile amax partials, reduced below: deterministic, no atomics. Zeros are
    # neutral for a max of absolute values (and cover tiles a config does not have).
    partials = torch.zeros(tiles if want_amax else 1, dtype=torch.float32, device=out.device)
    with on_device_of(a):  # (the autotuner times configurations on the current device)
        kernel(
            a, b, out,
            out if bias is None else bias,
            out if residual is None else residual,
            out if pre is None else pre,
            out if z is None else z,
            out if g is None else g,
            out if row_sum is None else row_sum,
            partials,
            partials if a_scale_inv is None else a_scale_inv,
            partials if b_scale_inv is None else b_scale_inv,
            partials if q_scale is None else q_scale,
            M, N, K,
            *_strides(a), *_strides(b), *_strides(out), *_strides(residual), *_strides(z),
            alpha,
            **flags,
            **config,
        )  # fmt: skip
    return partials.amax() if want_amax else None


# ----------------------------------------------------------------------------- checks shared by launchers and twins


def _check_operands(op, names, a, b, a_scale_inv, b_scale_inv, out_dtype) -> torch.dtype:
    """Check two GEMM operands (both 16/32/64-bit and equal, or both FP8 with scale_invs); return the out dtype."""
    check_tensor(op, names[0], a, dtypes=(*FLOAT_DTYPES, *FP8_DTYPES))
    check_tensor(op, names[1], b, dtypes=(*FLOAT_DTYPES, *FP8_DTYPES))
    fp8 = a.dtype in FP8_DTYPES
    if (b.dtype in FP8_DTYPES) != fp8 or (not fp8 and b.dtype != a.dtype):
        want = "an FP8 dtype" if fp8 else f"dtype {dtype_name(a.dtype)}"
        raise dtype_error(op, names[1], f"{want} to match '{names[0]}'", b, "operands are both FP8 or the same dtype")
    for scale, name in ((a_scale_inv, names[2]), (b_scale_inv, names[3])):
        if not fp8:
            if scale is not None:
                raise dtype_error(op, name, "None (scale_inv applies to FP8 operands only)", scale)
            continue
        if scale is None:
            raise dtype_error(op, name, "an f32 tensor of one element (FP8 operands need their scale_inv)", scale)
        check_tensor(op, name, scale, dtypes=(torch.float32,))
        if scale.numel() != 1:
            raise shape_error(op, name, "f32[] (one per-tensor scale_inv)", scale)
    if out_dtype is None:
        if fp8:
            raise dtype_error(op, "out_dtype", "f32|f16|bf16 for FP8 operands", None)
        return a.dtype
    if out_dtype not in FLOAT_DTYPES or (fp8 and out_dtype == torch.float64):
        allowed = "f32|f16|bf16" if fp8 else "f32|f16|bf16|f64"
        raise DTypeError(f"functe.{op}: argument 'out_dtype' expected {allowed}, got {dtype_name(out_dtype)}")
    return out_dtype


def _check_vector(op, name, t, size, dtype):
    if t is None:
        return
    check_tensor(op, name, t)
    if t.shape != (size,):
        raise shape_error(op, name, describe_shape(dtype, (size,)), t)
    if t.dtype != dtype:
        raise dtype_error(op, name, f"dtype {dtype_name(dtype)} (the output dtype)", t)


def _check_like(op, name, t, shape, dtype):
    """``t`` (residual / accum) must have exactly the output's shape and dtype."""
    if t is None:
        return
    check_tensor(op, name, t)
    if tuple(t.shape) != tuple(shape):
        raise shape_error(op, name, describe_shape(dtype, shape), t, "it is added to the GEMM's output")
    if t.dtype != dtype:
        raise dtype_error(op, name, f"dtype {dtype_name(dtype)} (the output dtype)", t)


def _check_activation(op, name, activation, *, required=False):
    if activation is None and not required:
        return
    if activation not in ACTIVATIONS:
        raise ArgumentError(f"functe.{op}: argument '{name}' expected one of {sorted(ACTIVATIONS)}, got {activation!r}")


def check_forward(op, x, w, bias, residual, activation, x_scale_inv, w_scale_inv, out_dtype) -> torch.dtype:
    """Validate the forward GEMM's arguments (shared by every forward launcher and twin); return the out dtype."""
    out_dtype = _check_operands(op, ("x", "w", "x_scale_inv", "w_scale_inv"), x, w, x_scale_inv, w_scale_inv, out_dtype)
    if x.dim() < 1:
        raise shape_error(op, "x", "a tensor of rank >= 1 ([..., K])", x)
    if w.dim() != 2 or w.shape[1] != x.shape[-1]:
        expected = describe_shape(w.dtype, (None, x.shape[-1]))
        raise shape_error(op, "w", expected, w, f"W is [N, K] with K = x.shape[-1] = {x.shape[-1]}")
    _check_vector(op, "bias", bias, w.shape[0], out_dtype)
    _check_like(op, "residual", residual, (*x.shape[:-1], w.shape[0]), out_dtype)
    _check_activation(op, "activation", activation)
    check_same_device(op, {"x": x, "w": w, "bias": bias, "residual": residual, "x_scale_inv": x_scale_inv,
                           "w_scale_inv": w_scale_inv})  # fmt: skip
    return out_dtype


# ----------------------------------------------------------------------------- twin building blocks


def linear_ref(a: Tensor, b: Tensor, bias: Tensor | None, a_scale_inv, b_scale_inv, alpha: float) -> Tensor:
    """``alpha·sa·sb·(a @ b) + bias`` for 2-D operands: exact upcast, accumulated in fp32 (fp64 for fp64).

    Without FP8 scales it is one ``addmm`` (BLAS scales the product and adds the bias), except for
    ``alpha = 0``, where BLAS would skip the product (the kernel keeps IEEE ``0 · inf = NaN``).
    """
    compute = compute_dtype(a.dtype)
    a, b = a.to(compute), b.to(compute)
    if bias is not None and a_scale_inv is None and alpha != 0.0:
        return torch.addmm(bias.to(compute), a, b, alpha=alpha)
    acc = torch.mm(a, b)
    if alpha != 1.0:
        acc = acc * alpha
    if a_scale_inv is not None:
        acc = acc * (a_scale_inv.reshape(()) * b_scale_inv.reshape(()))
    return acc if bias is None else acc + bias.to(compute)


def _plus(y: Tensor, other: Tensor | None) -> Tensor:
    """``y + other`` (a residual or an accumulator, any leading shape) in y's compute dtype."""
    return y if other is None else y + rows_view(other).to(y.dtype)


def forward_ref(x, w, bias, residual, alpha, activation, x_scale_inv, w_scale_inv, pre_dtype):
    """``(pre_activation, y)`` of the forward GEMM as 2-D fp32 (fp64) tensors, both unrounded; the
    activation reads the pre-activation rounded to ``pre_dtype`` (the unfused linear's result)."""
    z = linear_ref(rows_view(x), w.t(), bias, x_scale_inv, w_scale_inv, alpha)
    y = z if activation is None else act_fwd_ref(z.to(pre_dtype).to(z.dtype), activation)
    return z, _plus(y, residual)


# ----------------------------------------------------------------------------- forward


def forward_out(x: Tensor, w: Tensor, dtype: torch.dtype) -> Tensor:
    """A new 2-D ``[rows, N]`` output buffer for a forward GEMM."""
    return torch.empty((math.prod(x.shape[:-1]), w.shape[0]), dtype=dtype, device=x.device)


def forward_into(out: Tensor, x, w, bias, residual, alpha, activation, x_scale_inv, w_scale_inv, **extra):
    """Run the forward GEMM into the 2-D buffer ``out`` (which may be ``residual``'s own, donated, memory)."""
    return run_gemm(
        rows_view(x), w.t(), out, alpha=alpha, a_scale_inv=x_scale_inv, b_scale_inv=w_scale_inv, bias=bias,
        residual=None if residual is None else rows_view(residual), activation=activation, **extra,
    )  # fmt: skip


def gemm(
    x: Tensor,
    w: Tensor,
    bias: Tensor | None = None,
    residual: Tensor | None = None,
    alpha: float = 1.0,
    activation: str | None = None,
    x_scale_inv: Tensor | None = None,
    w_scale_inv: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """``y = residual + act(alpha·sx·sw·x @ Wᵀ + bias)`` in one kernel.

    ``x [..., K]``, ``W [N, K]``; ``bias [N]`` and ``residual [..., N]`` in the
    output dtype (``x``'s, or ``out_dtype``, which FP8 operands require).
    """
    out_dtype = check_forward("gemm", x, w, bias, residual, activation, x_scale_inv, w_scale_inv, out_dtype)
    y = forward_out(x, w, out_dtype)
    forward_into(y, x, w, bias, residual, alpha, activation, x_scale_inv, w_scale_inv)
    return y.view(*x.shape[:-1], w.shape[0])


def gemm_ref(
    x: Tensor,
    w: Tensor,
    bias: Tensor | None = None,
    residual: Tensor | None = None,
    alpha: float = 1.0,
    activation: str | None = None,
    x_scale_inv: Tensor | None = None,
    w_scale_inv: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """PyTorch twin of :func:`gemm`."""
    out_dtype = check_forward("gemm", x, w, bias, residual, activation, x_scale_inv, w_scale_inv, out_dtype)
    _, y = forward_ref(x, w, bias, residual, alpha, activation, x_scale_inv, w_scale_inv, out_dtype)
    return y.to(out_dtype).view(*x.shape[:-1], w.shape[0])


def gemm_preact(
    x: Tensor,
    w: Tensor,
    bias: Tensor | None = None,
    residual: Tensor | None = None,
    alpha: float = 1.0,
    activation: str | None = None,
    x_scale_inv: Tensor | None = None,
    w_scale_inv: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`gemm` that also returns the pre-activation ``z = alpha·x @ Wᵀ + bias`` (act's backward needs it)."""
    out_dtype = check_forward("gemm_preact", x, w, bias, residual, activation, x_scale_inv, w_scale_inv, out_dtype)
    y = forward_out(x, w, out_dtype)
    z = torch.empty_like(y)
    forward_into(y, x, w, bias, residual, alpha, activation, x_scale_inv, w_scale_inv, pre=z)
    shape = (*x.shape[:-1], w.shape[0])
    return y.view(shape), z.view(shape)


def gemm_preact_ref(
    x: Tensor,
    w: Tensor,
    bias: Tensor | None = None,
    residual: Tensor | None = None,
    alpha: float = 1.0,
    activation: str | None = None,
    x_scale_inv: Tensor | None = None,
    w_scale_inv: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """PyTorch twin of :func:`gemm_preact`."""
    out_dtype = check_forward("gemm_preact", x, w, bias, residual, activation, x_scale_inv, w_scale_inv, out_dtype)
    z, y = forward_ref(x, w, bias, residual, alpha, activation, x_scale_inv, w_scale_inv, out_dtype)
    shape = (*x.shape[:-1], w.shape[0])
    return y.to(out_dtype).view(shape), z.to(out_dtype).view(shape)


# ----------------------------------------------------------------------------- backward


def _accum_out_dtype(op, accum, out_dtype) -> torch.dtype | None:
    """The output dtype: ``out_dtype``, else ``accum``'s (main_grad accumulation sets it), checked as
    ``accum`` (an integer accum was reported as a bad 'out_dtype', a list as an AttributeError)."""
    if out_dtype is None and accum is not None:
        check_tensor(op, "accum", accum, dtypes=FLOAT_DTYPES)
        return accum.dtype
    return out_dtype


def _check_dgrad(op, dy, w, accum, dy_scale_inv, w_scale_inv, out_dtype) -> torch.dtype:
    out_dtype = _accum_out_dtype(op, accum, out_dtype)
    names = ("dy", "w", "dy_scale_inv", "w_scale_inv")
    out_dtype = _check_operands(op, names, dy, w, dy_scale_inv, w_scale_inv, out_dtype)
    if dy.dim() < 1:
        raise shape_error(op, "dy", "a tensor of rank >= 1 ([..., N])", dy)
    if w.dim() != 2 or w.shape[0] != dy.shape[-1]:
        expected = describe_shape(w.dtype, (dy.shape[-1], None))
        raise shape_error(op, "w", expected, w, f"W is [N, K] with N = dy.shape[-1] = {dy.shape[-1]}")
    _check_like(op, "accum", accum, (*dy.shape[:-1], w.shape[1]), out_dtype)
    check_same_device(op, {"dy": dy, "w": w, "accum": accum, "dy_scale_inv": dy_scale_inv, "w_scale_inv": w_scale_inv})
    return out_dtype


def _dgrad_into(dx: Tensor, dy, w, accum, alpha, dy_scale_inv, w_scale_inv, **extra) -> None:
    run_gemm(
        rows_view(dy), w, dx, alpha=alpha, a_scale_inv=dy_scale_inv, b_scale_inv=w_scale_inv,
        residual=None if accum is None else rows_view(accum), split_accumulator=True, **extra,
    )  # fmt: skip


def gemm_dgrad(
    dy: Tensor,
    w: Tensor,
    accum: Tensor | None = None,
    alpha: float = 1.0,
    dy_scale_inv: Tensor | None = None,
    w_scale_inv: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """``dx = accum + alpha·sdy·sw·dy @ W`` (``dy [..., N]``, ``W [N, K]``, ``dx [..., K]``)."""
    out_dtype = _check_dgrad("gemm_dgrad", dy, w, accum, dy_scale_inv, w_scale_inv, out_dtype)
    dx = torch.empty((math.prod(dy.shape[:-1]), w.shape[1]), dtype=out_dtype, device=dy.device)
    _dgrad_into(dx, dy, w, accum, alpha, dy_scale_inv, w_scale_inv)
    return dx.view(*dy.shape[:-1], w.shape[1])


def gemm_dgrad_ref(
    dy: Tensor,
    w: Tensor,
    accum: Tensor | None = None,
    alpha: float = 1.0,
    dy_scale_inv: Tensor | None = None,
    w_scale_inv: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """PyTorch twin of :func:`gemm_dgrad`."""
    out_dtype = _check_dgrad("gemm_dgrad", dy, w, accum, dy_scale_inv, w_scale_inv, out_dtype)
    dx = _plus(linear_ref(rows_view(dy), w, None, dy_scale_inv, w_scale_inv, alpha), accum)
    return dx.to(out_dtype).view(*dy.shape[:-1], w.shape[1])


def _check_dgrad_dact(op, dy, z, w, accum, activation) -> torch.dtype:
    out_dtype = _check_dgrad(op, dy, w, accum, None, None, None)
    check_tensor(op, "z", z)
    if z.shape != dy.shape:
        raise shape_error(op, "z", describe_shape(dy.dtype, dy.shape), z, "the activation's input, shaped like dy")
    check_same_dtype(op, "z", z, dy, "dy")
    _check_activation(op, "activation", activation, required=True)
    return out_dtype


def _dact_ref(dy: Tensor, z: Tensor, activation: str) -> Tensor:
    """``g = dy·act'(z)`` in the compute dtype, rounded to dy's dtype."""
    compute = compute_dtype(dy.dtype)
    return (dy.to(compute) * act_grad_ref(z.to(compute), activation)).to(dy.dtype)


def gemm_dgrad_dact(
    dy: Tensor, z: Tensor, w: Tensor, accum: Tensor | None = None, alpha: float = 1.0, activation: str = "gelu"
) -> tuple[Tensor, Tensor]:
    """The activation's backward as dgrad's prologue: ``g = dy·act'(z)``, ``dx = accum + alpha·g @ W``.

    ``z`` is the activation's input (what :func:`gemm_preact` stores). Returns
    ``(dx, g)``; ``g`` is rounded to dy's dtype, as an unfused dact would store
    it, and feeds :func:`gemm_wgrad_dbias`. See ``docs/gemm.md`` for when the
    prologue pays (it recomputes act' once per output column block).
    """
    out_dtype = _check_dgrad_dact("gemm_dgrad_dact", dy, z, w, accum, activation)
    dx = torch.empty((math.prod(dy.shape[:-1]), w.shape[1]), dtype=out_dtype, device=dy.device)
    g = torch.empty(dy.shape, dtype=dy.dtype, device=dy.device)
    _dgrad_into(dx, dy, w, accum, alpha, None, None, dact=activation, z=rows_view(z), g=rows_view(g))
    if dx.numel() == 0 and g.numel():  # W is [N, 0]: no program ran, yet g is still owed
        g = _dact_ref(dy, z, activation)
    return dx.view(*dy.shape[:-1], w.shape[1]), g


def gemm_dgrad_dact_ref(
    dy: Tensor, z: Tensor, w: Tensor, accum: Tensor | None = None, alpha: float = 1.0, activation: str = "gelu"
) -> tuple[Tensor, Tensor]:
    """PyTorch twin of :func:`gemm_dgrad_dact`."""
    out_dtype = _check_dgrad_dact("gemm_dgrad_dact", dy, z, w, accum, activation)
    g = _dact_ref(dy, z, activation)
    dx = _plus(linear_ref(rows_view(g), w, None, None, None, alpha), accum)
    return dx.to(out_dtype).view(*dy.shape[:-1], w.shape[1]), g


def _check_wgrad(op, dy, x, accum, dy_scale_inv, x_scale_inv, out_dtype) -> torch.dtype:
    out_dtype = _accum_out_dtype(op, accum, out_dtype)
    names = ("dy", "x", "dy_scale_inv", "x_scale_inv")
    out_dtype = _check_operands(op, names, dy, x, dy_scale_inv, x_scale_inv, out_dtype)
    if dy.dim() < 1 or x.dim() < 1 or dy.shape[:-1] != x.shape[:-1]:
        expected = describe_shape(x.dtype, (*dy.shape[:-1], None))
        raise shape_error(op, "x", expected, x, "x and dy share their leading (row) dimensions")
    _check_like(op, "accum", accum, (dy.shape[-1], x.shape[-1]), out_dtype)
    check_same_device(op, {"dy": dy, "x": x, "accum": accum, "dy_scale_inv": dy_scale_inv, "x_scale_inv": x_scale_inv})
    return out_dtype


def _wgrad_into(dw: Tensor, dy, x, accum, alpha, dy_scale_inv, x_scale_inv, **extra) -> None:
    # dW = dyᵀ @ x: A is dyᵀ, a strided view (no transposed copy), contracted over all rows.
    run_gemm(
        rows_view(dy).t(), rows_view(x), dw, alpha=alpha, a_scale_inv=dy_scale_inv, b_scale_inv=x_scale_inv,
        residual=accum, split_accumulator=True, **extra,
    )  # fmt: skip


def gemm_wgrad(
    dy: Tensor,
    x: Tensor,
    accum: Tensor | None = None,
    alpha: float = 1.0,
    dy_scale_inv: Tensor | None = None,
    x_scale_inv: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """``dW = accum + alpha·sdy·sx·dyᵀ @ x`` summed over all leading dims (``dW [N, K]``)."""
    out_dtype = _check_wgrad("gemm_wgrad", dy, x, accum, dy_scale_inv, x_scale_inv, out_dtype)
    dw = torch.empty((dy.shape[-1], x.shape[-1]), dtype=out_dtype, device=dy.device)
    _wgrad_into(dw, dy, x, accum, alpha, dy_scale_inv, x_scale_inv)
    return dw


def gemm_wgrad_ref(
    dy: Tensor,
    x: Tensor,
    accum: Tensor | None = None,
    alpha: float = 1.0,
    dy_scale_inv: Tensor | None = None,
    x_scale_inv: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """PyTorch twin of :func:`gemm_wgrad`."""
    out_dtype = _check_wgrad("gemm_wgrad", dy, x, accum, dy_scale_inv, x_scale_inv, out_dtype)
    dw = _plus(linear_ref(rows_view(dy).t(), rows_view(x), None, dy_scale_inv, x_scale_inv, alpha), accum)
    return dw.to(out_dtype)


def gemm_wgrad_dbias(dy: Tensor, x: Tensor, accum: Tensor | None = None, alpha: float = 1.0) -> tuple[Tensor, Tensor]:
    """:func:`gemm_wgrad` plus ``db = Σ dy`` over the leading dims, summed in fp32 in the same pass.

    ``db`` is not scaled by ``alpha``: the forward adds the bias after the
    scaled product (``y = act(alpha·x @ Wᵀ + b)``).
    """
    out_dtype = _check_wgrad("gemm_wgrad_dbias", dy, x, accum, None, None, None)
    dw = torch.empty((dy.shape[-1], x.shape[-1]), dtype=out_dtype, device=dy.device)
    db = torch.empty(dy.shape[-1], dtype=dy.dtype, device=dy.device)
    _wgrad_into(dw, dy, x, accum, alpha, None, None, row_sum=db)
    if dw.numel() == 0 and db.numel():  # x is [..., 0]: no program ran, yet db is still owed
        db = column_sums(dy, dy.dtype)
    return dw, db


def gemm_wgrad_dbias_ref(
    dy: Tensor, x: Tensor, accum: Tensor | None = None, alpha: float = 1.0
) -> tuple[Tensor, Tensor]:
    """PyTorch twin of :func:`gemm_wgrad_dbias`."""
    out_dtype = _check_wgrad("gemm_wgrad_dbias", dy, x, accum, None, None, None)
    dw = _plus(linear_ref(rows_view(dy).t(), rows_view(x), None, None, None, alpha), accum)
    return dw.to(out_dtype), column_sums(dy, dy.dtype)


# ----------------------------------------------------------------------------- kernels

# Rowwise: x/dy/residual/accum/z rows fold a vmapped dimension into M; W, bias and
# the scale_invs are parameters (batching those vmaps the twin). wgrad reduces over
# the rows, so it batches by vmapping the twin.
GEMM = Kernel("gemm", gemm, gemm_ref, batch=Rowwise(params=(1, 2, 6, 7)), fast_path=False)
GEMM_PREACT = Kernel("gemm_preact", gemm_preact, gemm_preact_ref, batch=Rowwise(params=(1, 2, 6, 7)), fast_path=False)
GEMM_DGRAD = Kernel("gemm_dgrad", gemm_dgrad, gemm_dgrad_ref, batch=Rowwise(params=(1, 4, 5)), fast_path=False)
GEMM_DGRAD_DACT = Kernel(
    "gemm_dgrad_dact", gemm_dgrad_dact, gemm_dgrad_dact_ref, batch=Rowwise(params=(2,)), fast_path=False
)
GEMM_WGRAD = Kernel("gemm_wgrad", gemm_wgrad, gemm_wgrad_ref, fast_path=False)
GEMM_WGRAD_DBIAS = Kernel("gemm_wgrad_dbias", gemm_wgrad_dbias, gemm_wgrad_dbias_ref, fast_path=False)


# ----------------------------------------------------------------------------- donated accumulators


def gemm_in_place(
    x: Tensor,
    w: Tensor,
    bias: Tensor | None,
    residual: Tensor,
    alpha: float = 1.0,
    activation: str | None = None,
    x_scale_inv: Tensor | None = None,
    w_scale_inv: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> None:
    """:func:`gemm` written into ``residual``'s buffer (contiguous, shared with no other argument)."""
    check_forward("gemm", x, w, bias, residual, activation, x_scale_inv, w_scale_inv, out_dtype)
    forward_into(rows_view(residual), x, w, bias, residual, alpha, activation, x_scale_inv, w_scale_inv)


def gemm_dgrad_in_place(
    dy: Tensor,
    w: Tensor,
    accum: Tensor,
    alpha: float = 1.0,
    dy_scale_inv: Tensor | None = None,
    w_scale_inv: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> None:
    """:func:`gemm_dgrad` written into ``accum``'s buffer (BackwardLinearAdd's ``dx = d_extra + dy @ W``)."""
    _check_dgrad("gemm_dgrad", dy, w, accum, dy_scale_inv, w_scale_inv, out_dtype)
    _dgrad_into(rows_view(accum), dy, w, accum, alpha, dy_scale_inv, w_scale_inv)


def gemm_wgrad_in_place(
    dy: Tensor,
    x: Tensor,
    accum: Tensor,
    alpha: float = 1.0,
    dy_scale_inv: Tensor | None = None,
    x_scale_inv: Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> None:
    """:func:`gemm_wgrad` written into ``accum``'s buffer (TE's ``main_grad += dW``)."""
    _check_wgrad("gemm_wgrad", dy, x, accum, dy_scale_inv, x_scale_inv, out_dtype)
    _wgrad_into(accum, dy, x, accum, alpha, dy_scale_inv, x_scale_inv)


class Donating:
    """A GEMM kernel whose accumulator argument (``residual`` / ``accum``) the caller *donates*.

    Calling it means the caller will not read the accumulator again, so the
    result may be written into its buffer and returned as that very tensor
    (``result is accumulator``): TE's ``AddExtraInput(in_place=True)``,
    BackwardLinearAdd and main_grad accumulation, without a second buffer. The
    write happens only where nobody else can observe it:

    * nothing requires grad and no ``torch.func`` transform wraps an argument
      (the rule of :func:`functe.ops.add_extra_input`), and not while compiling;
    * the accumulator is contiguous (no stride-0 broadcast) and shares no
      storage with another argument (a program could read what another wrote).

    Otherwise the pure kernel runs and returns a new tensor; the values are the
    same either way. On Triton the write is the custom op
    ``functe::<kernel>_in_place``, declared with ``mutates_args``, so
    functionalization sees it; the twin computes out of place and copies.
    """

    def __init__(self, kernel: Kernel, in_place: Callable[..., None]):
        self.kernel = kernel
        names = list(inspect.signature(in_place).parameters)
        if names != list(inspect.signature(kernel.launcher).parameters):
            raise TypeError(f"{in_place.__name__}: signature must match {kernel.name}'s")
        self.target = 3 if names[3] == "residual" else 2
        self.op = torch.library.custom_op(
            f"functe::{kernel.name}_in_place", in_place, mutates_args=(names[self.target],)
        )
        self.op.register_fake(_no_output)

    def __call__(self, *args):
        target = args[self.target] if len(args) > self.target else None
        if not _can_donate(target, args, self.target):
            return self.kernel(*args)
        if runs_triton(target.device):
            self.op(*args)
        else:
            target.copy_(self.kernel.twin(*args))
        return target

    def __repr__(self):
        return f"Donating({self.kernel.name})"


def _no_output(*args, **kwargs) -> None:
    return None


def _can_donate(target, args, position: int) -> bool:
    if not isinstance(target, Tensor) or torch.compiler.is_compiling():
        return False
    others = [a for i, a in enumerate(args) if i != position and isinstance(a, Tensor)]
    # Arguments on another device take the pure kernel, whose check names them: with one on 'meta'
    # the dispatcher ran the in-place op's fake kernel, which checks and writes nothing, and the
    # untouched accumulator came back as the result.
    if any(a.device != target.device for a in others):
        return False
    return donatable(target, others)


GEMM_IN_PLACE = Donating(GEMM, gemm_in_place)
GEMM_DGRAD_IN_PLACE = Donating(GEMM_DGRAD, gemm_dgrad_in_place)
GEMM_WGRAD_IN_PLACE = Donating(GEMM_WGRAD, gemm_wgrad_in_place)
