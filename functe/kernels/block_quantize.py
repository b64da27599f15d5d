"""FP8 block-scaling kernels (DeepSeek style, TE's Float8BlockScaling), fused with activations.

One fp32 scale per block of 1x128 (each row's 128 consecutive values: inputs, gradients) or
128x128 values (weights). Per block, with ``amax`` its largest magnitude (TE's
``compute_scale_from_amax``)::

    scale = fp8_max / max(amax, eps)       (1 if that is 0, inf or NaN; instead of inf, the largest
                                            finite value of the input's dtype, TE's value_for_inf)
    scale = 2^floor(log2(scale))           (with power-of-two scales: the mantissa bits cleared)
    q     = fp8(clamp(v * scale, ±fp8_max)),   scale_inv = 1 / scale

``v`` is ``x`` or, fused, ``act(x)`` for every elementwise and gated activation of
:mod:`functe.kernels._act` (and the clamped SwiGLU): one kernel computes the activation, the
block amax, the scale and the cast, since a 1x128 block lives in one program. A partial last
block (a dimension that is not a multiple of 128) is scaled by its own amax, exactly as if the
tensor were zero-padded. A NaN in a block makes its amax NaN and its scale 1 (the NaN stays NaN;
TE's ``fmaxf`` amax would skip it), an inf gives scale 1 and saturates to ±fp8_max.

``out_dtype`` is the storage of ``q``: the float8 dtype, or a wider float dtype that receives the
*dequantized* value ``q * scale_inv`` (exact for power-of-two scales), which the CPU GEMM
emulation consumes directly.

The same pieces serve the NVFP4 kernels (:mod:`functe.kernels.nvfp4`): :func:`act_value` loads
a tile and applies the activation, :func:`act_layout` / :func:`act_value_ref` are its host side
and twin.
"""

from __future__ import annotations

import math

import torch
import triton.language as tl

from .._errors import ShapeError, describe_shape, shape_error
from .._kernel import Kernel, Rowwise
from . import _act, _fast
from ._common import rows_view
from ._triton import cdiv, jit, next_power_of_2, tile_ids, tiled_grid
from .activation import activation_ref
from .quantize import (
    CLAMPED_SWIGLU,
    FP8_FORMATS,
    _storage,
    _value_ref,
    act_forward,
    check_fp8_output,
    encode_fp8,
    round_to_fp8,
    saturate,
)

Tensor = torch.Tensor

BLOCK = 128
FLT_MAX = 3.4028234663852886e38
FLT_MAX_TL = tl.constexpr(FLT_MAX)  # what compiled kernels may read (a plain global is interpreter-only)
_MODE_CAST, _MODE_ACT = 0, 1  # as in functe.kernels.quantize


# ----------------------------------------------------------------------------- shared pieces


@jit
def act_value(
    X,
    offs,
    mask,
    n_cols,
    limit,
    alpha,
    offset,
    MODE: tl.constexpr,
    ACT: tl.constexpr,
    GATED: tl.constexpr,
    CLAMPED: tl.constexpr,
):
    """``v`` at ``offs``: ``x``, or ``act(x)`` (gated: ``act(a) * b`` with ``b`` ``n_cols`` further), 0 where masked.

    The activation's value is rounded to ``x``'s dtype, as the activation op's output would be, so a
    fused activation + cast equals the activation followed by the cast bit for bit (TE's kernels
    quantize the fp32 value; functe's FP8 q-in kernels round the same way, ``docs/fusion.md``).
    """
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if MODE == 1:
        v = act_forward(X, x, offs, mask, n_cols, limit, alpha, offset, ACT, GATED, CLAMPED)
        v = v.to(X.dtype.element_ty).to(tl.float32)
    else:
        v = x
    return tl.where(mask, v, 0.0)  # padding lanes: act(0) may be non-zero (sigmoid)


@jit
def nan_max(v, axis: tl.constexpr):
    """``max |v|`` along ``axis``, NaN if any element is NaN (``tl.max`` may drop NaN on a GPU)."""
    isnan = v != v
    m = tl.max(tl.where(isnan, 0.0, tl.abs(v)), axis=axis)
    return tl.where(tl.max(isnan.to(tl.int32), axis=axis) > 0, float("nan"), m)


def act_layout(x: Tensor, act: str) -> tuple[int, bool, bool, int]:
    """``(activation id, gated, clamped, output columns)`` of ``act`` ("" = none) applied to ``x``."""
    if not act:
        return 0, False, False, x.shape[-1]
    gated = act == CLAMPED_SWIGLU or act in _act.GATED
    act_id = _act.ACTIVATIONS.get(_act.GATED.get(act, act), 0)
    return act_id, gated, act == CLAMPED_SWIGLU, x.shape[-1] // 2 if gated else x.shape[-1]


def act_value_ref(x: Tensor, act: str, limit: float, alpha: float, offset: float) -> Tensor:
    """Twin of :func:`act_value` on a whole tensor, in fp32 (an activation's value rounded to ``x``'s dtype)."""
    if not act:
        return _value_ref(x, None, _MODE_CAST, act, limit, alpha, offset)
    v = _value_ref(x, None, _MODE_ACT, act, limit, alpha, offset)
    return v if x.dtype == torch.float32 else v.to(x.dtype).to(torch.float32)


# ----------------------------------------------------------------------------- FP8 block kernel


def inf_scale(dtype: torch.dtype) -> float:
    """What an infinite block scale (a tiny amax) becomes for an input of ``dtype``: its largest
    finite value, as TE's block kernels (``value_for_inf``, the input type's max), at most FLT_MAX.

    Example:
        >>> inf_scale(torch.float16), inf_scale(torch.float32) == FLT_MAX
        (65504.0, True)
    """
    return min(torch.finfo(dtype).max, FLT_MAX)


@jit
def fp8_block_scale(amax, eps, MAXV: tl.constexpr, POW2: tl.constexpr, INF_SCALE: tl.constexpr):
    """(scale, scale_inv) of blocks with largest magnitude ``amax`` (TE's compute_scale_from_amax);
    ``INF_SCALE``: :func:`inf_scale` of the input's dtype."""
    a = tl.where(amax < eps, eps, amax)  # NaN stays NaN
    scale = tl.math.div_rn(tl.full(a.shape, MAXV, tl.float32), a)
    scale = tl.where(scale == float("inf"), INF_SCALE, scale)
    if POW2:
        scale = (scale.to(tl.int32, bitcast=True) & -8388608).to(tl.float32, bitcast=True)
    scale = tl.where((a == 0.0) | (a == float("inf")) | (a != a), 1.0, scale)
    return scale, tl.math.div_rn(tl.full(a.shape, 1.0, tl.float32), scale)


@jit
def _fp8_block_store(
    Q,
    v,
    offs,
    mask,
    scale,
    scale_inv,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    SUB_STEPS: tl.constexpr,
    MAXV: tl.constexpr,
    DEQUANT: tl.constexpr,
):
    q = round_to_fp8(saturate(v * scale[:, None, :, None], MAXV), MANT, MIN_NORMAL, SUB_STEPS)
    if DEQUANT:
        q = q * scale_inv[:, None, :, None]
    else:
        q = encode_fp8(q, MANT, BIAS, MIN_NORMAL, SUB_STEPS)
    tl.store(Q + offs, q.to(Q.dtype.element_ty), mask=mask)


@jit
def _fp8_block_kernel(
    X,
    Q,
    S,
    H,
    n_rows,
    n_cols,
    n_blocks,
    x_row_stride,
    limit,
    alpha,
    offset,
    eps,
    MODE: tl.constexpr,
    ACT: tl.constexpr,
    GATED: tl.constexpr,
    CLAMPED: tl.constexpr,
    TILE_ROWS: tl.constexpr,
    ROW_CHUNK: tl.constexpr,
    POW2: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    SUB_STEPS: tl.constexpr,
    MAXV: tl.constexpr,
    INF_SCALE: tl.constexpr,
    DEQUANT: tl.constexpr,
    KEEP: tl.constexpr,
    BLOCK_RB: tl.constexpr,
    BLOCK_CB: tl.constexpr,
):
    # Program (i, j): BLOCK_RB scaling blocks of TILE_ROWS rows x BLOCK_CB blocks of 128 columns,
    # held as 4-D tiles [block row, row in block, block column, column in block], ROW_CHUNK rows at a time.
    # KEEP (1x128 blocks only): also store v itself in H (x's dtype; v is already rounded to it, so the
    # store is exact): the activation's output and its quantized copy from one read of x.
    pid_r, pid_c = tile_ids(tl.cdiv(n_blocks, BLOCK_CB))
    rb = pid_r.to(tl.int64) * BLOCK_RB + tl.arange(0, BLOCK_RB)
    cb = pid_c * BLOCK_CB + tl.arange(0, BLOCK_CB)
    cols = (cb[:, None] * 128 + tl.arange(0, 128)[None, :])[None, None, :, :]
    col_ok = cols < n_cols
    if TILE_ROWS == ROW_CHUNK:  # 1x128 blocks: one pass
        rows = (rb[:, None] * TILE_ROWS + tl.arange(0, ROW_CHUNK)[None, :])[:, :, None, None]
        mask = (rows < n_rows) & col_ok
        v = act_value(X, rows * x_row_stride + cols, mask, n_cols, limit, alpha, offset, MODE, ACT, GATED, CLAMPED)
        if KEEP:
            tl.store(H + rows * n_cols + cols, v.to(H.dtype.element_ty), mask=mask)
        scale, scale_inv = fp8_block_scale(nan_max(nan_max(v, 3), 1), eps, MAXV, POW2, INF_SCALE)
        _fp8_block_store(
            Q, v, rows * n_cols + cols, mask, scale, scale_inv, MANT, BIAS, MIN_NORMAL, SUB_STEPS, MAXV, DEQUANT
        )
    else:  # 128x128 blocks: the amax over ROW_CHUNK-row slices, then the cast
        amax = tl.zeros((BLOCK_RB, BLOCK_CB), dtype=tl.float32)
        for r0 in tl.static_range(0, TILE_ROWS, ROW_CHUNK):
            rows = (rb[:, None] * TILE_ROWS + r0 + tl.arange(0, ROW_CHUNK)[None, :])[:, :, None, None]
            mask = (rows < n_rows) & col_ok
            v = act_value(X, rows * x_row_stride + cols, mask, n_cols, limit, alpha, offset, MODE, ACT, GATED, CLAMPED)
            part = nan_max(nan_max(v, 3), 1)
            amax = tl.where((part != part) | (part > amax), part, amax)
        scale, scale_inv = fp8_block_scale(amax, eps, MAXV, POW2, INF_SCALE)
        for r0 in tl.static_range(0, TILE_ROWS, ROW_CHUNK):
            rows = (rb[:, None] * TILE_ROWS + r0 + tl.arange(0, ROW_CHUNK)[None, :])[:, :, None, None]
            mask = (rows < n_rows) & col_ok
            v = act_value(X, rows * x_row_stride + cols, mask, n_cols, limit, alpha, offset, MODE, ACT, GATED, CLAMPED)
            _fp8_block_store(
                Q, v, rows * n_cols + cols, mask, scale, scale_inv, MANT, BIAS, MIN_NORMAL, SUB_STEPS, MAXV, DEQUANT
            )
    smask = (rb[:, None] * TILE_ROWS < n_rows) & (cb[None, :] < n_blocks)
    tl.store(S + rb[:, None] * n_blocks + cb[None, :], scale_inv, mask=smask)


def _fp8_block_launch(x, act, limit, alpha, offset, qdtype, out_dtype, block_rows, pow2, eps, keep=False):
    """``(q, scale_inv)``, and with ``keep`` (1x128 blocks) ``(h, q, scale_inv)``: ``h = v`` in x's dtype."""
    act_id, gated, clamped, n_cols = act_layout(x, act)
    rows = rows_view(x.contiguous())
    n_rows, in_cols = rows.shape
    n_blocks = cdiv(n_cols, BLOCK)
    check_fp8_output(qdtype, out_dtype)
    q = torch.empty((*x.shape[:-1], n_cols), dtype=out_dtype, device=x.device)
    h = torch.empty(q.shape if keep else (0,), dtype=x.dtype, device=x.device)
    lead = x.shape[:-1] if block_rows == 1 else (cdiv(n_rows, block_rows),)
    scale_inv = torch.empty((*lead, n_blocks), dtype=torch.float32, device=x.device)
    outputs = (h, q, scale_inv) if keep else (q, scale_inv)
    if q.numel() == 0:
        return outputs
    fmt = FP8_FORMATS[qdtype]
    if block_rows == 1:
        block_cb = min(next_power_of_2(n_blocks), 2)
        block_rb, chunk = max(1, min(next_power_of_2(n_rows), 16 // block_cb)), 1
    else:
        block_cb, block_rb, chunk = 1, 1, 32
    grid = tiled_grid(cdiv(cdiv(n_rows, block_rows), block_rb), cdiv(n_blocks, block_cb))
    _fp8_block_kernel[grid](
        rows,
        _storage(q),
        scale_inv,
        h if keep else scale_inv,  # (an unused pointer when not keeping)
        n_rows,
        n_cols,
        n_blocks,
        in_cols,
        limit,
        alpha,
        offset,
        eps,
        MODE=_MODE_ACT if act else _MODE_CAST,
        ACT=act_id,
        GATED=gated,
        CLAMPED=clamped,
        TILE_ROWS=block_rows,
        ROW_CHUNK=chunk,
        POW2=pow2,
        MANT=fmt.mant,
        BIAS=fmt.bias,
        MIN_NORMAL=fmt.min_normal,
        SUB_STEPS=fmt.sub_steps,
        MAXV=fmt.max,
        INF_SCALE=inf_scale(x.dtype),
        DEQUANT=out_dtype not in FP8_FORMATS,
        KEEP=keep,
        BLOCK_RB=block_rb,
        BLOCK_CB=block_cb,
    )
    return outputs


# ----------------------------------------------------------------------------- twins


def fp8_block_scale_ref(
    amax: Tensor, eps: float, fp8_max: float, pow2: bool, inf_value: float
) -> tuple[Tensor, Tensor]:
    """Twin of :func:`fp8_block_scale`: (scale, scale_inv) per block, fp32 (``inf_value``: its ``INF_SCALE``)."""
    a = torch.where(amax < eps, torch.full_like(amax, eps), amax)
    scale = torch.full_like(a, fp8_max) / a  # full_like / tensor: one rounding (see functe._fp8_state)
    scale = torch.where(scale == float("inf"), torch.full_like(scale, inf_value), scale)
    if pow2:
        scale = (scale.view(torch.int32) & -(1 << 23)).view(torch.float32)
    scale = torch.where((a == 0) | ~a.isfinite(), torch.ones_like(scale), scale)
    return scale, torch.ones_like(scale) / scale


def blocked(v: Tensor, block_rows: int, block_cols: int) -> Tensor:
    """``v [..., M, K]`` zero-padded and viewed as ``[..., ceil(M/br), br, ceil(K/bc), bc]``."""
    m, k = v.shape[-2], v.shape[-1]
    pad_r, pad_c = (-m) % block_rows, (-k) % block_cols
    if pad_r or pad_c:
        v = torch.nn.functional.pad(v, (0, pad_c, 0, pad_r))
    return v.reshape(*v.shape[:-2], (m + pad_r) // block_rows, block_rows, (k + pad_c) // block_cols, block_cols)


def grid_step_ref(a: Tensor, mant: int, min_normal: float) -> Tensor:
    """The spacing of a float grid with ``mant`` mantissa bits at magnitudes ``a`` (fp32, a power of two).

    ``2^floor(log2 a) · 2^-mant`` from the exponent bits, at least the subnormal spacing
    ``min_normal · 2^-mant``; infinite for NaN.
    """
    return ((a.view(torch.int32) & 0x7F800000).view(torch.float32) * 2.0**-mant).clamp_min(min_normal * 2.0**-mant)


def round_to_grid_ref(w: Tensor, mant: int, min_normal: float) -> Tensor:
    """Twin of :func:`functe.kernels.quantize.round_to_fp8` in float arithmetic (no float8 conversion).

    ``|w| / step`` is exact (``step`` a power of two), ``torch.round`` rounds it half to even: the
    same grid point as the kernel's integer rounding of the bits; the sign (-0 too) and NaN are kept.
    """
    a = w.abs()
    step = grid_step_ref(a, mant, min_normal)
    return torch.copysign(torch.round(a / step) * step, w)


def block_amax_ref(tiles: Tensor) -> Tensor:
    """``max |v|`` per block of ``tiles [mb, br, kb, bc]`` (``[mb, kb]``; NaN if the block holds one).

    For short blocks a tree of ``torch.maximum`` over halves (NaN-propagating, and faster on the
    CPU than a reduction over a short inner dim), then the max over the block's rows.
    """
    m = tiles.abs()
    if m.shape[-1] > 32:
        return m.amax(dim=(1, 3))
    while m.shape[-1] > 1:
        half = m.shape[-1] // 2
        m = torch.maximum(m[..., :half], m[..., half:])
    return m[..., 0].amax(dim=1)


def unblocked(t: Tensor, shape: torch.Size) -> Tensor:
    """Inverse of :func:`blocked`: back to ``shape`` (padding cut off)."""
    *lead, mb, br, kb, bc = t.shape
    return t.reshape(*lead, mb * br, kb * bc)[..., : shape[-2], : shape[-1]].reshape(shape).contiguous()


def by_row_chunks(x: Tensor, tile_rows: int, outputs, rows_fn, *, inputs: tuple = ()) -> bool:
    """The twins' CPU fast path: ``rows_fn(x_rows)`` on cache-sized chunks of whole tile rows.

    ``outputs`` are ``(tensor, rows per output row)`` pairs (1 for per-row results, ``tile_rows``
    for per-tile scales); chunk results are written into them. ``inputs``: the twin's other tensor
    arguments that ``rows_fn`` reads (an amax, a seed). Runs only when ``x`` and all of them are plain
    eager CPU tensors (not a vmapped seed over a plain ``x``) and ``x`` is larger than a chunk (see
    :mod:`functe.kernels._fast`); returns whether it ran.
    """
    if x.numel() <= _fast.CHUNK_ELEMENTS or not _fast.eager_cpu(x, *inputs):
        return False
    mat = rows_view(x)
    n_rows = mat.shape[0]

    def body(_, tiles, scratch):
        r0, r1 = tiles.start * tile_rows, min(tiles.stop * tile_rows, n_rows)
        for out, (t, per) in zip(rows_fn(mat[r0:r1], r0), outputs):
            t[r0 // per : -(-r1 // per)] = out

    _fast.parallel_chunks(-(-n_rows // tile_rows), (tile_rows, mat.shape[1]), torch.float32, body)
    return True


def _fp8_block_rows(mat, act, limit, alpha, offset, qdtype, out_dtype, block_rows, pow2, eps):
    """The FP8 block cast of a ``[rows, K]`` matrix: (q ``[rows, K']``, scale_inv ``[row blocks, K'/128]``)."""
    v = act_value_ref(mat, act, limit, alpha, offset)
    tiles = blocked(v, block_rows, BLOCK)  # [mb, br, kb, 128]
    maxv = FP8_FORMATS[qdtype].max
    scale, scale_inv = fp8_block_scale_ref(block_amax_ref(tiles), eps, maxv, pow2, inf_scale(mat.dtype))
    w = torch.clamp(tiles * scale[:, None, :, None], -maxv, maxv)
    if out_dtype in FP8_FORMATS:
        q = w.to(qdtype)
    else:  # the dequantized value, without a float8 round trip (slow on the CPU)
        fmt = FP8_FORMATS[qdtype]
        q = round_to_grid_ref(w, fmt.mant, fmt.min_normal) * scale_inv[:, None, :, None]
    return unblocked(q, v.shape).to(out_dtype), scale_inv


def _fp8_block_ref(x, act, limit, alpha, offset, qdtype, out_dtype, block_rows, pow2, eps):
    check_fp8_output(qdtype, out_dtype)
    n_cols = act_layout(x, act)[3]
    if n_cols % BLOCK and torch.compiler.is_dynamo_compiling():  # (a partial last block: see _PARTIAL_BLOCKS)
        return _fp8_block_ref_eager(x, act, limit, alpha, offset, qdtype, out_dtype, block_rows, pow2, eps)
    return _fp8_block_ref_traced(x, act, limit, alpha, offset, qdtype, out_dtype, block_rows, pow2, eps)


def _fp8_block_ref_traced(x, act, limit, alpha, offset, qdtype, out_dtype, block_rows, pow2, eps):
    n_cols = act_layout(x, act)[3]
    args = (act, limit, alpha, offset, qdtype, out_dtype, block_rows, pow2, eps)
    q = torch.empty((math.prod(x.shape[:-1]), n_cols), dtype=out_dtype, device=x.device)
    scale_inv = torch.empty((-(-q.shape[0] // block_rows), -(-n_cols // BLOCK)), dtype=torch.float32, device=x.device)
    if not by_row_chunks(x, block_rows, ((q, 1), (scale_inv, block_rows)), lambda m, _: _fp8_block_rows(m, *args)):
        q, scale_inv = _fp8_block_rows(rows_view(x), *args)
    lead = x.shape[:-1] if block_rows == 1 else scale_inv.shape[:1]
    return q.reshape(*x.shape[:-1], n_cols), scale_inv.reshape(*lead, scale_inv.shape[-1])


# _PARTIAL_BLOCKS: torch 2.13's CPU Inductor reads garbage for the last, partial block of the padded
# block views and of the per-element scale selection (every formulation tried; docs/block_scaling.md).
# While Dynamo traces, the twins of partial blocks call these, which it cannot trace: a graph break,
# the twin runs in Python (under fullgraph=True an error, not a wrong answer). The disabled copies
# run the bodies, not the checking functions: non-strict torch.export reports is_compiling()
# without Dynamo, where disable does nothing, and the check called itself until the stack ran out
# (hence is_dynamo_compiling, too: no Dynamo, no graph break needed).
_PARTIAL_REASON = (
    "functe: a block-scaled tensor with a partial last block runs outside the compiled graph (torch 2.13's "
    "CPU Inductor miscompiles it, docs/block_scaling.md); for fullgraph=True or a strict export, make the "
    "dimension a multiple of the block size"
)
_fp8_block_ref_eager = torch.compiler.disable(_fp8_block_ref_traced, recursive=True, reason=_PARTIAL_REASON)


# ----------------------------------------------------------------------------- kernels


def fp8_block_cast(
    x: Tensor,
    act: str,
    limit: float,
    alpha: float,
    offset: float,
    qdtype: torch.dtype,
    out_dtype: torch.dtype,
    pow2: bool,
    eps: float,
) -> tuple[Tensor, Tensor]:
    """``(q, scale_inv)`` of ``v = act(x)`` (``act=""``: ``v = x``) with 1x128 blocks along the last dim.

    ``scale_inv`` is ``f32[..., ceil(K/128)]``; gated acts map ``[..., 2H]`` to ``[..., H]``.
    ``limit``, ``alpha``, ``offset`` are the clamped SwiGLU's parameters.
    """
    return _fp8_block_launch(x, act, limit, alpha, offset, qdtype, out_dtype, 1, pow2, eps)


def fp8_block_cast_ref(
    x: Tensor,
    act: str,
    limit: float,
    alpha: float,
    offset: float,
    qdtype: torch.dtype,
    out_dtype: torch.dtype,
    pow2: bool,
    eps: float,
) -> tuple[Tensor, Tensor]:
    """PyTorch twin of :func:`fp8_block_cast`."""
    return _fp8_block_ref(x, act, limit, alpha, offset, qdtype, out_dtype, 1, pow2, eps)


def fp8_block_act_cast_keep(
    x: Tensor,
    act: str,
    limit: float,
    alpha: float,
    offset: float,
    qdtype: torch.dtype,
    out_dtype: torch.dtype,
    pow2: bool,
    eps: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(h, q, scale_inv)``: :func:`fp8_block_cast` of ``v = act(x)`` that also stores ``h = v`` in x's dtype.

    ``h`` is the activation op's output bit for bit (``ACTIVATION(x, act, 0, ...)``; 16- and 32-bit
    inputs), ``q, scale_inv`` equal ``fp8_block_cast(h, "", ...)``: the activation and its 1x128 block
    cast in one pass, reading ``x`` once (per output element: ``x`` read, ``h`` and ``q`` written).
    """
    return _fp8_block_launch(x, act, limit, alpha, offset, qdtype, out_dtype, 1, pow2, eps, keep=True)


def fp8_block_act_cast_keep_ref(
    x: Tensor,
    act: str,
    limit: float,
    alpha: float,
    offset: float,
    qdtype: torch.dtype,
    out_dtype: torch.dtype,
    pow2: bool,
    eps: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """PyTorch twin of :func:`fp8_block_act_cast_keep`: the activation twin, then the cast twin of its output."""
    h = activation_ref(x, act, 0, limit, alpha, offset) if act else x.clone(memory_format=torch.contiguous_format)
    q, scale_inv = _fp8_block_ref(h, "", 0.0, 0.0, 0.0, qdtype, out_dtype, 1, pow2, eps)
    return h, q, scale_inv


def fp8_block_cast_2d(
    x: Tensor, qdtype: torch.dtype, out_dtype: torch.dtype, pow2: bool, eps: float
) -> tuple[Tensor, Tensor]:
    """``(q, scale_inv)`` of a matrix ``x [M, K]`` with 128x128 blocks.

    ``scale_inv`` is ``f32[ceil(M/128), ceil(K/128)]``; ``out_dtype`` as in :func:`fp8_block_cast`.
    """
    return _fp8_block_launch(x, "", 0.0, 0.0, 0.0, qdtype, out_dtype, BLOCK, pow2, eps)


def fp8_block_cast_2d_ref(
    x: Tensor, qdtype: torch.dtype, out_dtype: torch.dtype, pow2: bool, eps: float
) -> tuple[Tensor, Tensor]:
    """PyTorch twin of :func:`fp8_block_cast_2d`."""
    return _fp8_block_ref(x, "", 0.0, 0.0, 0.0, qdtype, out_dtype, BLOCK, pow2, eps)


# ----------------------------------------------------------------------------- dequantize


@jit
def decode_fp8(bits, MANT: tl.constexpr, BIAS: tl.constexpr, FN: tl.constexpr):
    """fp32 values of float8 bit patterns (u8): exact integer decoding, since Triton's interpreter
    decodes E4M3's NaN (0x7F) as 480. ``FN``: E4M3 (NaN = S.1111.111, no inf), else IEEE-like E5M2."""
    b = bits.to(tl.int32)
    e = (b >> MANT) & ((1 << (7 - MANT)) - 1)
    m = b & ((1 << MANT) - 1)
    normal = (((e - BIAS + 127) << 23) | (m << (23 - MANT))).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, m.to(tl.float32) * (2.0 ** (1 - BIAS - MANT)), normal)
    if FN:
        v = tl.where((b & 0x7F) == 0x7F, float("nan"), v)
    else:
        top = (1 << (7 - MANT)) - 1
        v = tl.where(e == top, tl.where(m == 0, float("inf"), float("nan")), v)
    return tl.where((b & 0x80) != 0, -v, v)


@jit
def block_scale_at(S, rows, cols, n_blocks, mask, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """The block scale (as stored) of each element ``(rows, cols)``."""
    return tl.load(S + (rows // BLOCK_ROWS) * n_blocks + cols // BLOCK_COLS, mask=mask, other=0)


@jit
def _fp8_block_dequantize_kernel(
    D,
    S,
    Y,
    n_rows,
    n_cols,
    n_blocks,
    BLOCK_ROWS: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    FN: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid_r, pid_c = tile_ids(tl.cdiv(n_cols, BLOCK_C))
    rows = (pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R))[:, None]
    cols = (pid_c * BLOCK_C + tl.arange(0, BLOCK_C))[None, :]
    mask = (rows < n_rows) & (cols < n_cols)
    q = decode_fp8(tl.load(D + rows * n_cols + cols, mask=mask, other=0), MANT, BIAS, FN)
    s = block_scale_at(S, rows, cols, n_blocks, mask, BLOCK_ROWS, 128)
    tl.store(Y + rows * n_cols + cols, (q * s).to(Y.dtype.element_ty), mask=mask)


def dequantize_grid(n_rows: int, n_cols: int) -> tuple[tuple[int], int, int]:
    """(grid, BLOCK_R, BLOCK_C) of an elementwise dequantize over a ``[n_rows, n_cols]`` matrix (the
    kernel splits its program id with ``tile_ids(cdiv(n_cols, BLOCK_C))``)."""
    block_c = min(next_power_of_2(n_cols), 128)
    block_r = max(1, min(next_power_of_2(n_rows), 2048 // block_c))
    return tiled_grid(cdiv(n_rows, block_r), cdiv(n_cols, block_c)), block_r, block_c


def check_block_scales(op: str, arg: str, scales: Tensor, shape, block_rows: int, block_cols: int) -> None:
    """Block scales of the shape a tensor of ``shape`` has: ``[..., ceil(K/cols)]`` for 1-D blocks,
    ``[ceil(M/rows), ceil(K/cols)]`` for 2-D ones. (The dequantize kernels index them by the data's
    blocks and read past short scales; the twins broadcast a single row of them.) 2-D blocks tile a
    matrix: the launchers flatten more dimensions into rows, where the scales' rows count only the
    first, and read past them."""
    if block_rows > 1 and len(shape) != 2:
        raise ShapeError(
            f"functe.{op}: argument 'data' expected a matrix ({block_rows}x{block_cols} blocks scale the "
            f"rows and columns of one), got values of shape {list(shape)}"
        )
    cols = -(-shape[-1] // block_cols) if len(shape) else 0
    expected = (*shape[:-1], cols) if block_rows == 1 else (-(-shape[0] // block_rows), cols)
    if tuple(scales.shape) != expected:
        blocks = f"{block_rows}x{block_cols} blocks of {tuple(shape)} values"
        raise shape_error(op, arg, describe_shape(scales.dtype, expected), scales, blocks)


def fp8_block_dequantize(data: Tensor, scale_inv: Tensor, block_rows: int, out_dtype: torch.dtype) -> Tensor:
    """``data * scale_inv`` per block: float8 ``data [..., K]``, fp32 ``scale_inv`` of 1x128 blocks
    (``block_rows=1``: ``[..., ceil(K/128)]``) or 128x128 blocks (``[ceil(M/128), ceil(K/128)]``)."""
    check_block_scales("dequantize", "scale_inv", scale_inv, data.shape, block_rows, BLOCK)
    rows = rows_view(data.contiguous())
    y = torch.empty(data.shape, dtype=out_dtype, device=data.device)
    if rows.numel():
        grid, block_r, block_c = dequantize_grid(*rows.shape)
        fmt = FP8_FORMATS[data.dtype]
        _fp8_block_dequantize_kernel[grid](
            rows.view(torch.uint8),
            scale_inv.contiguous(),
            y,
            rows.shape[0],
            rows.shape[1],
            scale_inv.shape[-1],
            BLOCK_ROWS=block_rows,
            MANT=fmt.mant,
            BIAS=fmt.bias,
            FN=data.dtype == torch.float8_e4m3fn,
            BLOCK_R=block_r,
            BLOCK_C=block_c,
        )
    return y


def expand_block_scales(scales: Tensor, shape: torch.Size, block_rows: int, block_cols: int) -> Tensor:
    """Per-element fp32 scales of a tensor of ``shape`` from its block scales (1-D or 2-D blocks)."""
    partial = shape[-1] % block_cols or (block_rows > 1 and shape[0] % block_rows)
    if partial and torch.compiler.is_dynamo_compiling():  # (see _PARTIAL_BLOCKS)
        return _expand_block_scales_eager(scales, shape, block_rows, block_cols)
    return _expand_block_scales(scales, shape, block_rows, block_cols)


def _expand_block_scales(scales: Tensor, shape: torch.Size, block_rows: int, block_cols: int) -> Tensor:
    s = scales.to(torch.float32)
    if block_rows > 1:
        s = s.index_select(0, block_index(shape[0], block_rows, s.device))
    return s.index_select(-1, block_index(shape[-1], block_cols, s.device))


_expand_block_scales_eager = torch.compiler.disable(_expand_block_scales, recursive=True, reason=_PARTIAL_REASON)


def block_index(n: int, block: int, device: torch.device) -> Tensor:
    """The block of each of ``n`` positions: ``[0]*block + [1]*block + ...`` (``n`` entries).

    (Selecting scales by it, not ``repeat_interleave(block)[:n]``: Inductor miscompiled the sliced
    repeat when ``n`` is not a multiple of ``block``, reading garbage for the last partial block.)"""
    return torch.arange(n, device=device) // block


def fp8_block_dequantize_ref(data: Tensor, scale_inv: Tensor, block_rows: int, out_dtype: torch.dtype) -> Tensor:
    """PyTorch twin of :func:`fp8_block_dequantize`."""
    check_block_scales("dequantize", "scale_inv", scale_inv, data.shape, block_rows, BLOCK)
    return (data.to(torch.float32) * expand_block_scales(scale_inv, data.shape, block_rows, BLOCK)).to(out_dtype)


FP8_BLOCK_CAST = Kernel("fp8_block_cast", fp8_block_cast, fp8_block_cast_ref, batch=Rowwise(), quantizes=True)
FP8_BLOCK_ACT_CAST_KEEP = Kernel(
    "fp8_block_act_cast_keep", fp8_block_act_cast_keep, fp8_block_act_cast_keep_ref, batch=Rowwise(), quantizes=True
)
FP8_BLOCK_CAST_2D = Kernel("fp8_block_cast_2d", fp8_block_cast_2d, fp8_block_cast_2d_ref, quantizes=True)
FP8_BLOCK_DEQUANTIZE = Kernel("fp8_block_dequantize", fp8_block_dequantize, fp8_block_dequantize_ref)
