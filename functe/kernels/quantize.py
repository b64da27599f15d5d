"""FP8 quantizing kernels: amax + saturating cast in one pass, fused with what precedes the cast.

Every kernel here computes a high-precision value ``v`` tile by tile, records ``amax = max|v|``
and (when ``write``) stores ``q = fp8(clamp(v * scale, ±fp8_max))`` in the same pass:

=======================  ======================================  ==================================
kernel                   v                                       extra output
=======================  ======================================  ==================================
``cast_amax``            x                                       –
``act_cast_amax``        act(x), or act(a)·b for gated acts      – (q-in: the next op's input)
``dbias_cast_amax``      dy                                      dbias = Σ_rows dy (TE's bgrad_quantize)
``dact_dbias_cast_amax`` dy·act'(x)                              dbias = Σ_rows v (TE's dbias_dgelu...)
``mxfp8_cast``           x, one E8M0 scale per 32 elements       block scales (u8 biased exponents)
=======================  ======================================  ==================================

Delayed scaling casts with the state's (delayed) scale and uses the amax of the same pass;
current scaling runs a kernel twice: ``write=False`` for the amax (and dbias), then the cast
with the scale computed from it on the device (TE PR #2007: bgrad_quantize must compute the
amax under current scaling).

Numerics (kernel and twin alike): ``v * scale`` in fp32, clamped to ±fp8_max (saturating cast;
±inf saturate), rounded to nearest-even on the FP8 grid; NaN stays NaN. The amax of a tensor
containing NaN is NaN (so the scale update keeps the old scale); ±inf give an infinite amax.
``out_dtype`` is the storage of ``q``: the float8 dtype, or a wider float type holding the same
grid values exactly (E4M3/E5M2 values are exact in bf16): the CPU GEMM emulation reads them
without a decode pass.

Triton's interpreter rounds float32 -> float8 conversions wrongly when rounding carries into the
exponent (31.4 -> 16 in E4M3), so the kernels round to the FP8 grid themselves
(:func:`round_to_fp8`, integer RNE on the float32 bits) and only convert exact grid values.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton.language as tl

from .._errors import describe_shape, shape_error
from .._kernel import Kernel, PerMember, Rowwise
from . import _act
from ._common import as_rows, column_sums
from ._triton import cdiv, jit, next_power_of_2, tile_ids, tiled_grid
from .activation import activation_ref, dactivation_ref

Tensor = torch.Tensor


class Fp8Format(NamedTuple):
    """Constants of a float8 format, as the kernels need them."""

    mant: int  # mantissa bits
    bias: int  # exponent bias
    min_normal: float  # smallest normal magnitude
    sub_steps: float  # subnormal grid points per unit (1 / subnormal spacing)
    max: float  # largest finite value


FP8_FORMATS = {
    torch.float8_e4m3fn: Fp8Format(3, 7, 2.0**-6, 2.0**9, 448.0),
    torch.float8_e5m2: Fp8Format(2, 15, 2.0**-14, 2.0**16, 57344.0),
}

_MODE_CAST, _MODE_ACT, _MODE_DACT = 0, 1, 2
_MAGIC = 12582912.0  # 1.5 * 2**23: (t + M) - M rounds |t| < 2**22 to an integer, nearest-even
_PARTIAL_PROGRAMS = 256
CLAMPED_SWIGLU = "clamped_swiglu"


# ----------------------------------------------------------------------------- device functions


@jit
def round_to_fp8(v, MANT: tl.constexpr, MIN_NORMAL: tl.constexpr, SUB_STEPS: tl.constexpr):
    """``v`` (float32, |v| <= fp8 max, or NaN) rounded to nearest-even on an FP8 grid.

    Normal range: integer rounding of the float32 bits to ``MANT`` mantissa bits (a carry into
    the exponent is the correct round-up). Subnormal range (|v| < MIN_NORMAL): fixed spacing
    1 / SUB_STEPS, rounded with the 1.5 * 2**23 trick; the sign of zero is kept.
    """
    bits = v.to(tl.int32, bitcast=True)
    lsb = (bits >> (23 - MANT)) & 1
    rounded = (bits + ((1 << (22 - MANT)) - 1) + lsb) & (-(1 << (23 - MANT)))
    normal = rounded.to(tl.float32, bitcast=True)
    sub = tl.abs(((v * SUB_STEPS + 12582912.0) - 12582912.0) / SUB_STEPS)
    sub = tl.where(bits < 0, -sub, sub)
    out = tl.where(tl.abs(v) < MIN_NORMAL, sub, normal)
    return tl.where(v != v, v, out)


@jit
def encode_fp8(q, MANT: tl.constexpr, BIAS: tl.constexpr, MIN_NORMAL: tl.constexpr, SUB_STEPS: tl.constexpr):
    """The float8 bit pattern (u8) of a float32 value already on the FP8 grid (NaN -> sign|0x7F).

    Kernels store bits rather than ``q.to(float8)`` because Triton's interpreter converts NaN
    (and rounding cases) wrongly; on a GPU the few integer ops hide under the memory traffic.
    """
    bits = q.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    normal = (((mag >> 23) - (127 - BIAS)) << MANT) | ((mag >> (23 - MANT)) & ((1 << MANT) - 1))
    sub = (tl.abs(q) * SUB_STEPS).to(tl.int32)
    code = tl.where(tl.abs(q) < MIN_NORMAL, sub, normal)
    code = tl.where(q != q, 0x7F, code)
    return (code | sign).to(tl.uint8)


@jit
def saturate(v, MAXV: tl.constexpr):
    """Clamp to ±MAXV, keeping NaN (``tl.minimum`` may drop NaN on a GPU)."""
    return tl.where(v > MAXV, MAXV, tl.where(v < -MAXV, -MAXV, v))


@jit
def tile_amax(v, mask):
    """(max |v| over the valid lanes, with NaN ignored, per column; any NaN per column as 0/1)."""
    isnan = (v != v) & mask
    a = tl.where(mask & ~isnan, tl.abs(v), 0.0)
    return tl.max(a, axis=0), tl.max(isnan.to(tl.int32), axis=0)


@jit
def act_forward(
    X, x, offs, mask, n_cols, limit, alpha, offset, ACT: tl.constexpr, GATED: tl.constexpr, CLAMPED: tl.constexpr
):
    """``act(x)`` for ``x`` loaded from ``X + offs`` (fp32); gated acts read their linear half ``n_cols`` further."""
    if GATED:
        b = tl.load(X + offs + n_cols, mask=mask, other=0.0).to(tl.float32)
        if CLAMPED:
            v = _act.clamped_swiglu_fwd(x, b, limit, alpha, offset)
        else:
            v = _act.act_fwd(x, ACT) * b
    else:
        v = _act.act_fwd(x, ACT)
    return v


# ----------------------------------------------------------------------------- per-tensor kernel


@jit
def _quantize_kernel(
    X,
    DY,
    S,
    Q,
    DB,
    AMAX,
    n_rows,
    n_cols,
    x_row_stride,
    rows_per_program,
    limit,
    alpha,
    offset,
    MODE: tl.constexpr,
    ACT: tl.constexpr,
    GATED: tl.constexpr,
    CLAMPED: tl.constexpr,
    DBIAS: tl.constexpr,
    WRITE: tl.constexpr,
    ROUND: tl.constexpr,
    CAST: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    SUB_STEPS: tl.constexpr,
    MAXV: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # Program (i, j) handles rows [i*rows_per_program, (i+1)*rows_per_program) of column block j:
    # partial amax -> AMAX[i, j], partial column sums (dbias) -> DB[i, block j].
    n_col_programs = tl.cdiv(n_cols, BLOCK_C)
    pid_r, pid_c = tile_ids(n_col_programs)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < n_cols
    scale = tl.load(S).to(tl.float32)
    col_amax = tl.zeros((BLOCK_C,), dtype=tl.float32)
    col_nan = tl.zeros((BLOCK_C,), dtype=tl.int32)
    col_sum = tl.zeros((BLOCK_C,), dtype=tl.float32)
    start = pid_r.to(tl.int64) * rows_per_program
    for r0 in range(0, rows_per_program, BLOCK_R):
        rows = start + r0 + tl.arange(0, BLOCK_R)
        mask = (rows[:, None] < n_rows) & (rows[:, None] < start + rows_per_program) & col_mask[None, :]
        x_offs = rows[:, None] * x_row_stride + cols[None, :]
        x = tl.load(X + x_offs, mask=mask, other=0.0).to(tl.float32)
        if MODE == 0:
            v = x
        elif MODE == 1:
            v = act_forward(X, x, x_offs, mask, n_cols, limit, alpha, offset, ACT, GATED, CLAMPED)
        else:
            dy = tl.load(DY + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            v = dy * _act.act_grad(x, ACT)
        if ROUND:  # the value the unfused activation (or its backward) would store, in x's dtype
            v = v.to(X.dtype.element_ty).to(tl.float32)
        v = tl.where(mask, v, 0.0)  # padding lanes: act(0) may be non-zero (sigmoid)
        tile_max, tile_nan = tile_amax(v, mask)
        col_amax = tl.maximum(col_amax, tile_max)
        col_nan = tl.maximum(col_nan, tile_nan)
        if DBIAS:
            col_sum += tl.sum(v, axis=0)
        if WRITE:
            if CAST:
                q = round_to_fp8(saturate(v * scale, MAXV), MANT, MIN_NORMAL, SUB_STEPS)
                if BITS:
                    q = encode_fp8(q, MANT, BIAS, MIN_NORMAL, SUB_STEPS)
            else:
                q = v  # high precision (dact + dbias without a cast)
            tl.store(Q + rows[:, None] * n_cols + cols[None, :], q.to(Q.dtype.element_ty), mask=mask)
    amax = tl.where(tl.max(col_nan, axis=0) > 0, float("nan"), tl.max(col_amax, axis=0))
    tl.store(AMAX + pid_r * n_col_programs + pid_c, amax)
    if DBIAS:
        tl.store(DB + pid_r.to(tl.int64) * n_cols + cols, col_sum, mask=col_mask)


def check_fp8_output(qdtype: torch.dtype, out_dtype: torch.dtype) -> None:
    """Refuse a float8 ``out_dtype`` other than ``qdtype``: a kernel stores qdtype's bits, which in
    another float8 tensor read as other values (its twin converted the values)."""
    if out_dtype in FP8_FORMATS and out_dtype != qdtype:
        raise ValueError(f"a float8 output must be in the quantized format {qdtype}, got {out_dtype}")


def fp8_constexprs(qdtype: torch.dtype, out_dtype: torch.dtype) -> dict:
    """The format constants a quantizing kernel takes (``MANT``, ``BIAS``, ``MIN_NORMAL``, ``SUB_STEPS``,
    ``MAXV``) and ``BITS``: whether ``out_dtype`` is float8 (stored as bits, see :func:`encode_fp8`)."""
    check_fp8_output(qdtype, out_dtype)
    fmt = FP8_FORMATS[qdtype]
    return {
        "MANT": fmt.mant,
        "BIAS": fmt.bias,
        "MIN_NORMAL": fmt.min_normal,
        "SUB_STEPS": fmt.sub_steps,
        "MAXV": fmt.max,
        "BITS": out_dtype in FP8_FORMATS,
    }


def _storage(q: Tensor) -> Tensor:
    """What a kernel writes through: float8 tensors as their u8 bits (see :func:`encode_fp8`)."""
    return q.view(torch.uint8) if q.dtype in FP8_FORMATS else q


def _launch(x, dy, scale, mode, act, limit, alpha, offset, qdtype, out_dtype, write, dbias, *, round_=False, cast=True):
    """Run :func:`_quantize_kernel` over ``x`` (and ``dy``); return (q, dbias or None, amax).

    ``round_``: round ``v`` to x's dtype first (what an unfused activation would store);
    ``cast=False``: store ``v`` itself in ``out_dtype`` (no FP8 rounding).
    """
    if dy is not None and dy.shape != x.shape:  # (the kernel indexes dy by x's rows: it read past a short dy)
        raise shape_error("dactivation", "dy", describe_shape(dy.dtype, tuple(x.shape)), dy, "x's shape")
    gated = mode == _MODE_ACT and (act == CLAMPED_SWIGLU or act in _act.GATED)
    in_cols = x.shape[-1] if x.dim() else 1
    n_cols = in_cols // 2 if gated else in_cols
    rows = as_rows(x) if x.numel() else None
    n_rows = rows.shape[0] if rows is not None else 0
    out_shape = (*x.shape[:-1], n_cols) if x.dim() else ()
    q = torch.empty(out_shape if write else (0,), dtype=out_dtype, device=x.device)
    db = None
    if n_rows == 0 or n_cols == 0:
        amax = torch.zeros((), dtype=torch.float32, device=x.device)
        if dbias:
            db = torch.zeros(n_cols, dtype=x.dtype if dy is None else dy.dtype, device=x.device)
        return q, db, amax
    block_c = min(next_power_of_2(n_cols), 128)
    block_r = max(1, min(next_power_of_2(n_rows), 2048 // block_c))
    rows_per_program = max(cdiv(n_rows, _PARTIAL_PROGRAMS), block_r)
    n_programs = cdiv(n_rows, rows_per_program)
    n_col_programs = cdiv(n_cols, block_c)
    grid = tiled_grid(n_programs, n_col_programs)
    partial_amax = torch.empty((n_programs, n_col_programs), dtype=torch.float32, device=x.device)
    partial_sums = torch.empty((n_programs, n_cols) if dbias else (1,), dtype=torch.float32, device=x.device)
    act_id = _act.ACTIVATIONS.get(_act.GATED.get(act, act), 0) if act else 0
    _quantize_kernel[grid](
        rows,
        rows if dy is None else as_rows(dy),
        scale.to(torch.float32).contiguous(),
        _storage(q),
        partial_sums,
        partial_amax,
        n_rows,
        n_cols,
        in_cols,
        rows_per_program,
        limit,
        alpha,
        offset,
        MODE=mode,
        ACT=act_id,
        GATED=gated,
        CLAMPED=act == CLAMPED_SWIGLU,
        DBIAS=dbias,
        WRITE=write,
        ROUND=round_,
        CAST=cast,
        **fp8_constexprs(qdtype, out_dtype),
        BLOCK_R=block_r,
        BLOCK_C=block_c,
    )
    if dbias:
        db = partial_sums.sum(0).to(x.dtype if dy is None else dy.dtype)
    return q, db, partial_amax.amax()


# ----------------------------------------------------------------------------- twins' shared pieces


def amax_ref(v: Tensor) -> Tensor:
    """``max|v|`` as f32[] (0 for an empty tensor, NaN if any element is NaN)."""
    if v.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=v.device)
    lo, hi = torch.aminmax(v)  # one pass, no |v| temporary; propagates NaN
    # (abs: for an all-zero v, max(-0.0, +0.0) may be -0.0; the kernels' |v| gives +0.0)
    return torch.maximum(-lo, hi).abs().to(torch.float32)


def _chunkable(*tensors: Tensor) -> bool:
    """Whether the chunked in-place path is safe: eager, plain CPU tensors (no functorch wrapper)."""
    if torch.compiler.is_compiling():
        return False
    return all(t.device.type == "cpu" and not torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors)


_CHUNK = 1 << 18  # 1 MiB of fp32 temporaries: fastest on the CI CPU (4096^2: 18 ms vs 128 ms eager, 1 thread)


def cast_ref(v: Tensor, scale: Tensor, qdtype: torch.dtype, out_dtype: torch.dtype) -> Tensor:
    """``q = fp8(clamp(v * scale, ±max))`` in ``out_dtype`` storage (the twins' cast).

    torch's float -> float8 conversion rounds to nearest-even; the clamp makes E5M2 saturate
    (torch lets it overflow to inf). On plain CPU tensors the cast runs in row chunks that
    stay in cache (3-4x faster than whole-tensor temporaries).
    """
    check_fp8_output(qdtype, out_dtype)
    maxv = FP8_FORMATS[qdtype].max
    scale = scale.to(torch.float32)
    if v.numel() <= _CHUNK or v.dim() == 0 or not _chunkable(v, scale):
        q = torch.clamp(v.to(torch.float32) * scale, -maxv, maxv).to(qdtype)
        return q if out_dtype == qdtype else q.to(out_dtype)
    out = torch.empty(v.shape, dtype=out_dtype, device=v.device)
    flat_v, flat_out = v.reshape(-1, v.shape[-1]), out.view(-1, v.shape[-1])
    step = max(1, _CHUNK // max(1, v.shape[-1]))
    for i in range(0, flat_v.shape[0], step):
        tmp = flat_v[i : i + step].to(torch.float32) * scale  # a new chunk-sized temporary
        q = tmp.clamp_(-maxv, maxv).to(qdtype)
        flat_out[i : i + step] = q if out_dtype == qdtype else q.to(out_dtype)
    return out


def _empty(out_dtype: torch.dtype, like: Tensor) -> Tensor:
    return torch.empty((0,), dtype=out_dtype, device=like.device)


def _value_ref(x: Tensor, dy: Tensor | None, mode: int, act: str, limit: float, alpha: float, offset: float):
    """The high-precision ``v`` of each kernel mode, in fp32 (the twins' forward math)."""
    xf = x.to(torch.float32)
    if mode == _MODE_CAST:
        return xf
    if mode == _MODE_DACT:
        return dy.to(torch.float32) * _act.act_grad_ref(xf, act)
    if act == CLAMPED_SWIGLU or act in _act.GATED:
        a, b = xf.chunk(2, dim=-1)
        if act == CLAMPED_SWIGLU:
            return _act.clamped_swiglu_fwd_ref(a, b, limit, alpha, offset)
        return _act.act_fwd_ref(a, _act.GATED[act]) * b
    return _act.act_fwd_ref(xf, act)


# ----------------------------------------------------------------------------- kernels and twins


def cast_amax(
    x: Tensor, scale: Tensor, qdtype: torch.dtype, out_dtype: torch.dtype, write: bool
) -> tuple[Tensor, Tensor]:
    """``(q, amax)``: ``q = fp8(clamp(x * scale))`` (empty unless ``write``) and ``amax = max|x|``."""
    q, _, amax = _launch(x, None, scale, _MODE_CAST, "", 0.0, 0.0, 0.0, qdtype, out_dtype, write, False)
    return q, amax


def cast_amax_ref(
    x: Tensor, scale: Tensor, qdtype: torch.dtype, out_dtype: torch.dtype, write: bool
) -> tuple[Tensor, Tensor]:
    """PyTorch twin of :func:`cast_amax`."""
    q = cast_ref(x, scale, qdtype, out_dtype) if write else _empty(out_dtype, x)
    return q, amax_ref(x)


def act_cast_amax(
    x: Tensor,
    scale: Tensor,
    act: str,
    limit: float,
    alpha: float,
    offset: float,
    qdtype: torch.dtype,
    out_dtype: torch.dtype,
    write: bool,
) -> tuple[Tensor, Tensor]:
    """``(q, amax)`` of ``v = act(x)``; gated acts (and ``"clamped_swiglu"``) map ``[..., 2H]`` to ``[..., H]``.

    ``limit``, ``alpha``, ``offset`` are the clamped SwiGLU's parameters (ignored otherwise).
    """
    q, _, amax = _launch(x, None, scale, _MODE_ACT, act, limit, alpha, offset, qdtype, out_dtype, write, False)
    return q, amax


def act_cast_amax_ref(
    x: Tensor,
    scale: Tensor,
    act: str,
    limit: float,
    alpha: float,
    offset: float,
    qdtype: torch.dtype,
    out_dtype: torch.dtype,
    write: bool,
) -> tuple[Tensor, Tensor]:
    """PyTorch twin of :func:`act_cast_amax`."""
    v = _value_ref(x, None, _MODE_ACT, act, limit, alpha, offset)
    q = cast_ref(v, scale, qdtype, out_dtype) if write else _empty(out_dtype, x)
    return q, amax_ref(v)


def dbias_cast_amax(
    dy: Tensor, scale: Tensor, qdtype: torch.dtype, out_dtype: torch.dtype, write: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """``(q, dbias, amax)`` of ``v = dy``: TE's bgrad_quantize (dbias = Σ over all leading dims)."""
    return _launch(dy, None, scale, _MODE_CAST, "", 0.0, 0.0, 0.0, qdtype, out_dtype, write, True)


def dbias_cast_amax_ref(
    dy: Tensor, scale: Tensor, qdtype: torch.dtype, out_dtype: torch.dtype, write: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """PyTorch twin of :func:`dbias_cast_amax`."""
    q = cast_ref(dy, scale, qdtype, out_dtype) if write else _empty(out_dtype, dy)
    return q, column_sums(dy, dy.dtype), amax_ref(dy)


def dact_dbias_cast_amax(
    dy: Tensor, x: Tensor, scale: Tensor, act: str, qdtype: torch.dtype, out_dtype: torch.dtype, write: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """``(q, dbias, amax)`` of ``v = dy * act'(x)`` for an elementwise ``act`` (TE's dbias_dgelu, ...)."""
    return _launch(x, dy, scale, _MODE_DACT, act, 0.0, 0.0, 0.0, qdtype, out_dtype, write, True)


def dact_dbias_cast_amax_ref(
    dy: Tensor, x: Tensor, scale: Tensor, act: str, qdtype: torch.dtype, out_dtype: torch.dtype, write: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """PyTorch twin of :func:`dact_dbias_cast_amax`."""
    v = _value_ref(x, dy, _MODE_DACT, act, 0.0, 0.0, 0.0)
    q = cast_ref(v, scale, qdtype, out_dtype) if write else _empty(out_dtype, x)
    return q, column_sums(v, dy.dtype), amax_ref(v)


# ----------------------------------------------------------------------------- rounded variants (fusion targets)
#
# The fused ops of functe.fuse must reproduce the unfused program: an activation (or its backward)
# stores its result in x's dtype and the next op quantizes *that*. These variants round ``v`` to x's
# dtype before the amax, the bias sum and the cast, so they equal the unfused pair bit for bit (the
# twins are literally the unfused twins composed). TE's q-in kernels skip that rounding; it changes
# nothing for fp32 and at most one 16-bit rounding step otherwise, but it would make the next scaling
# state differ from the unfused program's.


def act_output_cast_amax(
    x: Tensor,
    scale: Tensor,
    act: str,
    limit: float,
    alpha: float,
    offset: float,
    qdtype: torch.dtype,
    out_dtype: torch.dtype,
    write: bool,
) -> tuple[Tensor, Tensor]:
    """:func:`act_cast_amax` of the activation's output rounded to x's dtype: ``quantize(activation(x))``."""
    q, _, amax = _launch(
        x, None, scale, _MODE_ACT, act, limit, alpha, offset, qdtype, out_dtype, write, False, round_=True
    )
    return q, amax


def act_output_cast_amax_ref(
    x: Tensor,
    scale: Tensor,
    act: str,
    limit: float,
    alpha: float,
    offset: float,
    qdtype: torch.dtype,
    out_dtype: torch.dtype,
    write: bool,
) -> tuple[Tensor, Tensor]:
    """PyTorch twin of :func:`act_output_cast_amax`: the activation twin, then the cast twin."""
    return cast_amax_ref(activation_ref(x, act, 0, limit, alpha, offset), scale, qdtype, out_dtype, write)


def act_output_amax(x: Tensor, act: str, limit: float, alpha: float, offset: float) -> tuple[Tensor, Tensor]:
    """``(h, amax)``: the activation's output ``h = act(x)`` in x's dtype and ``amax = max|h|``, one pass.

    ``h`` is the activation op's output bit for bit (16- and 32-bit inputs) and ``amax`` what
    :func:`cast_amax` measures on it: the first pass of a two-pass quantize (NVFP4) that writes the
    activation instead of only recomputing it, so the second pass reads ``h`` (half of a gated ``x``).
    """
    h, _, amax = _launch(
        x, None, unit_scale(x.device), _MODE_ACT, act, limit, alpha, offset, torch.float8_e4m3fn, x.dtype, True, False,
        round_=True, cast=False,
    )  # fmt: skip
    return h, amax


def act_output_amax_ref(x: Tensor, act: str, limit: float, alpha: float, offset: float) -> tuple[Tensor, Tensor]:
    """PyTorch twin of :func:`act_output_amax`: the activation twin, then the amax of its output."""
    h = activation_ref(x, act, 0, limit, alpha, offset)
    return h, amax_ref(h)


def dact_output_dbias_cast_amax(
    dy: Tensor, x: Tensor, scale: Tensor, act: str, qdtype: torch.dtype, out_dtype: torch.dtype, write: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`dact_dbias_cast_amax` of ``g = dy * act'(x)`` rounded to x's dtype (``dbias_cast(dactivation)``)."""
    return _launch(x, dy, scale, _MODE_DACT, act, 0.0, 0.0, 0.0, qdtype, out_dtype, write, True, round_=True)


def dact_output_dbias_cast_amax_ref(
    dy: Tensor, x: Tensor, scale: Tensor, act: str, qdtype: torch.dtype, out_dtype: torch.dtype, write: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """PyTorch twin of :func:`dact_output_dbias_cast_amax`: the dactivation twin, then the dbias-cast twin."""
    return dbias_cast_amax_ref(dactivation_ref(dy, x, act, 0, 0.0, 0.0, 0.0), scale, qdtype, out_dtype, write)


def dact_dbias(dy: Tensor, x: Tensor, act: str) -> tuple[Tensor, Tensor]:
    """``(g, dbias)``: ``g = dy * act'(x)`` in x's dtype and ``dbias = Σ_rows g`` (fp32 sums), one pass.

    The high-precision backward of bias + activation (the quantizing kernel's dact mode, no cast).
    """
    g, dbias, _ = _launch(
        x, dy, unit_scale(x.device), _MODE_DACT, act, 0.0, 0.0, 0.0, torch.float8_e4m3fn, x.dtype, True, True,
        round_=True, cast=False,
    )  # fmt: skip
    return g, dbias


def dact_dbias_ref(dy: Tensor, x: Tensor, act: str) -> tuple[Tensor, Tensor]:
    """PyTorch twin of :func:`dact_dbias`."""
    g = dactivation_ref(dy, x, act, 0, 0.0, 0.0, 0.0)
    return g, column_sums(g, g.dtype)


def unit_scale(device: torch.device) -> Tensor:
    """A scale of 1 (fp32 0-d) on ``device``, made there.

    Not a CPU constant moved with ``.to(device)``: that copy from pageable host memory synchronises
    the host with the GPU, and CUDA-graph capture refuses it.
    """
    if device.type == "cpu":
        return _ONE
    return torch.ones((), dtype=torch.float32, device=device)


_ONE = torch.ones((), dtype=torch.float32, device="cpu")


# ----------------------------------------------------------------------------- MXFP8


@jit
def _mxfp8_kernel(
    X,
    Q,
    E,
    n_rows,
    n_cols,
    n_blocks,
    DEQUANT: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    SUB_STEPS: tl.constexpr,
    MAXV: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    # A tile of BLOCK_R rows x BLOCK_B scaling blocks of 32 columns each.
    pid_r, pid_c = tile_ids(tl.cdiv(n_blocks, BLOCK_B))
    rows = pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    blocks = pid_c * BLOCK_B + tl.arange(0, BLOCK_B)
    cols = blocks[:, None] * 32 + tl.arange(0, 32)[None, :]
    mask = (rows[:, None, None] < n_rows) & (cols[None, :, :] < n_cols)
    offs = rows[:, None, None] * n_cols + cols[None, :, :]
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    isnan = (x != x) & mask
    block_amax = tl.max(tl.where(isnan, 0.0, tl.abs(x)), axis=2)
    has_nan = tl.max(isnan.to(tl.int32), axis=2) > 0
    # E8M0 exponent of amax / fp8_max, rounded up (TE's float_to_e8m0): 0 -> 0, inf -> 254, NaN -> 255.
    ratio = block_amax * (1.0 / MAXV)
    bits = ratio.to(tl.int32, bitcast=True)
    exp = bits >> 23
    mant = bits & 0x7FFFFF
    up = (mant > 0) & (exp != 254) & ~((exp == 0) & (mant <= 0x400000))
    exp = tl.where(up, exp + 1, exp)
    exp = tl.where(ratio == 0.0, 0, exp)
    exp = tl.where(ratio == float("inf"), 254, exp)
    exp = tl.where(has_nan, 255, exp)
    # q = x * 2**(127 - exp) as two exact power-of-two factors (each a normal float32).
    shift = 127 - exp
    half = shift >> 1  # floor, also for negative shifts
    f1 = ((half + 127) << 23).to(tl.float32, bitcast=True)
    f2 = ((shift - half + 127) << 23).to(tl.float32, bitcast=True)
    q = round_to_fp8(saturate(x * f1[:, :, None] * f2[:, :, None], MAXV), MANT, MIN_NORMAL, SUB_STEPS)
    if DEQUANT:
        scale_inv = ((exp + 0) << 23).to(tl.float32, bitcast=True)
        scale_inv = tl.where(exp == 0, 5.877471754111438e-39, tl.where(exp == 255, float("nan"), scale_inv))
        q = q * scale_inv[:, :, None]
    else:
        q = encode_fp8(q, MANT, BIAS, MIN_NORMAL, SUB_STEPS)
    tl.store(Q + offs, q.to(Q.dtype.element_ty), mask=mask)
    bmask = (rows[:, None] < n_rows) & (blocks[None, :] < n_blocks)
    tl.store(E + rows[:, None] * n_blocks + blocks[None, :], exp.to(tl.uint8), mask=bmask)


def mxfp8_cast(x: Tensor, qdtype: torch.dtype, out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(q, e8m0)``: MXFP8 quantization along the last dim, one scale per 32 elements.

    ``e8m0`` holds biased exponents (u8, ``scale_inv = 2**(e - 127)``, 255 = NaN) of shape
    ``[..., ceil(K / 32)]``; a last partial block is scaled by its own amax. With a float8
    ``out_dtype``, ``q`` is the FP8 data; with a wider ``out_dtype`` it is the *dequantized*
    value ``q * scale_inv`` (exact: a power-of-two multiple of an FP8 value).
    """
    n_cols = x.shape[-1]
    n_blocks = cdiv(n_cols, 32)
    check_fp8_output(qdtype, out_dtype)
    q = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    e = torch.empty((*x.shape[:-1], n_blocks), dtype=torch.uint8, device=x.device)
    if x.numel():
        rows = as_rows(x)
        n_rows = rows.shape[0]
        fmt = FP8_FORMATS[qdtype]
        block_b = min(next_power_of_2(n_blocks), 4)
        block_r = max(1, min(next_power_of_2(n_rows), 2048 // (32 * block_b)))
        grid = tiled_grid(cdiv(n_rows, block_r), cdiv(n_blocks, block_b))
        _mxfp8_kernel[grid](
            rows,
            _storage(q),
            e,
            n_rows,
            n_cols,
            n_blocks,
            DEQUANT=out_dtype not in FP8_FORMATS,
            MANT=fmt.mant,
            BIAS=fmt.bias,
            MIN_NORMAL=fmt.min_normal,
            SUB_STEPS=fmt.sub_steps,
            MAXV=fmt.max,
            BLOCK_R=block_r,
            BLOCK_B=block_b,
        )
    return q, e


def e8m0_exponent_ref(block_amax: Tensor, fp8_max: float) -> Tensor:
    """TE's ``float_to_e8m0(amax / fp8_max)`` rounded up, as int32 (0 -> 0, inf -> 254, NaN -> 255)."""
    ratio = block_amax.to(torch.float32) * (1.0 / fp8_max)
    bits = ratio.view(torch.int32)
    exp, mant = bits >> 23, bits & 0x7FFFFF
    up = (mant > 0) & (exp != 254) & ~((exp == 0) & (mant <= 0x400000))
    exp = torch.where(up, exp + 1, exp)
    exp = torch.where(ratio == 0, torch.zeros_like(exp), exp)
    exp = torch.where(ratio == float("inf"), torch.full_like(exp, 254), exp)
    return torch.where(ratio.isnan(), torch.full_like(exp, 255), exp)


def e8m0_to_float(e: Tensor) -> Tensor:
    """``2**(e - 127)`` as float32 for biased exponents ``e`` (255 -> NaN), exactly.

    Built from the float32 bits rather than through ``torch.float8_e8m0fnu``, which Inductor cannot
    compile on the CPU (its C++ backend has no such dtype).
    """
    if e.dtype != torch.uint8:
        return e.to(torch.float32)
    bits = e.to(torch.int32) << 23  # the exponent field: 2**(e - 127) for e in 1..254
    bits = torch.where(e == 0, 0x00400000, bits)  # 2**-127 is subnormal in float32
    return torch.where(e == 255, 0x7FC00000, bits).view(torch.float32)  # NaN


def mxfp8_cast_ref(x: Tensor, qdtype: torch.dtype, out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """PyTorch twin of :func:`mxfp8_cast`."""
    check_fp8_output(qdtype, out_dtype)
    maxv = FP8_FORMATS[qdtype].max
    k = x.shape[-1]
    n_blocks = -(-k // 32)
    xf = x.to(torch.float32)
    padded = torch.nn.functional.pad(xf, (0, n_blocks * 32 - k)) if k % 32 else xf
    blocks = padded.reshape(*x.shape[:-1], n_blocks, 32)
    has_nan = blocks.isnan().any(-1)
    block_amax = torch.where(blocks.isnan(), 0.0, blocks.abs()).amax(-1)
    exp = e8m0_exponent_ref(torch.where(has_nan, float("nan"), block_amax), maxv)
    shift = 127 - exp
    half = torch.div(shift, 2, rounding_mode="floor")
    f1 = ((half + 127) << 23).view(torch.float32)
    f2 = ((shift - half + 127) << 23).view(torch.float32)
    scaled = blocks * f1[..., None] * f2[..., None]
    q = torch.clamp(scaled, -maxv, maxv).to(qdtype)
    if out_dtype not in FP8_FORMATS:
        q = q.to(torch.float32) * e8m0_to_float(exp.to(torch.uint8))[..., None]
    q = q.reshape(padded.shape)[..., :k].to(out_dtype)
    return q.contiguous(), exp.to(torch.uint8)


CAST_AMAX = Kernel("fp8_cast_amax", cast_amax, cast_amax_ref, fast_path=False, quantizes=True)
ACT_CAST_AMAX = Kernel("fp8_act_cast_amax", act_cast_amax, act_cast_amax_ref, quantizes=True)
DBIAS_CAST_AMAX = Kernel("fp8_dbias_cast_amax", dbias_cast_amax, dbias_cast_amax_ref, fast_path=False, quantizes=True)
DACT_DBIAS_CAST_AMAX = Kernel(
    "fp8_dact_dbias_cast_amax", dact_dbias_cast_amax, dact_dbias_cast_amax_ref, fast_path=False, quantizes=True
)
MXFP8_CAST = Kernel("mxfp8_cast", mxfp8_cast, mxfp8_cast_ref, batch=Rowwise(), quantizes=True)
# (PerMember: the fused activation q-in's amax is per member; vmapping the twin's formula rounded
# `h` differently from the activation's row-batched fast path, an ulp, then the amax and the scale)
ACT_OUTPUT_CAST_AMAX = Kernel(
    "fp8_act_output_cast_amax", act_output_cast_amax, act_output_cast_amax_ref, batch=PerMember(), quantizes=True
)
ACT_OUTPUT_AMAX = Kernel("act_output_amax", act_output_amax, act_output_amax_ref, batch=PerMember())
DACT_OUTPUT_DBIAS_CAST_AMAX = Kernel(
    "fp8_dact_output_dbias_cast_amax",
    dact_output_dbias_cast_amax,
    dact_output_dbias_cast_amax_ref,
    batch=PerMember(),  # (the bits of the unfused activation backward, which batches by rows)
    quantizes=True,
)
DACT_DBIAS = Kernel("dact_dbias", dact_dbias, dact_dbias_ref)
