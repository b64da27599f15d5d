"""NVFP4 kernels: E2M1 values with E4M3 block scales and an fp32 tensor scale, fused with activations.

TransformerEngine's NVFP4 quantization (``custom_recipes/reference_nvfp4.py``), for a tensor whose
largest magnitude ``amax`` was measured in a first pass (:func:`functe.kernels.quantize.cast_amax`
or ``act_output_cast_amax`` with ``write=False``)::

    global_encode = 448·6 / amax       (FLT_MAX instead of inf; 1 instead of 0, i.e. for an infinite amax)
    global_decode = 1 / global_encode
    s   = e4m3(clamp(block_amax · (global_encode · fp32(1/6)), 448))     per block of 1x16 or 16x16 values
    enc = min(1 / (s · global_decode), FLT_MAX)
    q   = e2m1(clamp(v · enc, ±6))          dequantized: q · s · global_decode

E2M1 magnitudes are 0, 0.5, 1, 1.5, 2, 3, 4, 6 (codes 0-7, bit 3 the sign). Rounding is to the
nearest value, ties to even, or *stochastic*: up with probability ``(|v| − lo) / (hi − lo)``
between the two neighbours, the coin a 24-bit uniform from the counter-based hash of
:mod:`functe.kernels.hadamard` (element index in the quantized tensor, explicit seed).

Outputs: ``scales`` as ``float8_e4m3fn`` (``[..., ceil(K/16)]`` for 1x16 blocks,
``[ceil(M/16), ceil(K/16)]`` for 16x16), and ``q`` either packed (``out_dtype=torch.uint8``,
two codes per byte, element ``2i`` in the low nibble, ``K`` even) or, for the GEMM emulation, the
partially dequantized values ``q · s`` in a float dtype (exact in bf16: at most 6 significant
bits); the caller applies ``global_decode`` after the GEMM, as the tensor cores' alpha does.

Special values (TE's reference behaves the same): a NaN makes the amax NaN and so every scale
NaN: the whole tensor dequantizes to NaN (E2M1 itself has no NaN; a NaN's code is 0). An infinite
amax makes ``global_encode`` 1: infinities saturate to ±6·448.
"""

from __future__ import annotations

import math

import torch
import triton.language as tl

from .._errors import shape_error
from .._kernel import Kernel
from . import _fast
from ._common import rows_view
from ._triton import cdiv, jit, next_power_of_2, tile_ids, tiled_grid
from .block_quantize import (
    _MODE_ACT,
    _MODE_CAST,
    FLT_MAX,
    FLT_MAX_TL,
    act_layout,
    act_value,
    act_value_ref,
    block_amax_ref,
    block_scale_at,
    blocked,
    by_row_chunks,
    check_block_scales,
    decode_fp8,
    dequantize_grid,
    expand_block_scales,
    grid_step_ref,
    nan_max,
    round_to_grid_ref,
    unblocked,
)
from .dropout import seed_key
from .hadamard import random_bits, random_bits_fast, random_bits_ref, uniform24, uniform24_ref
from .quantize import encode_fp8, round_to_fp8, saturate

Tensor = torch.Tensor

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
ONE_SIXTH = 0.16666667163372040  # fp32(1/6), TE's torch.reciprocal(6.0)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# ----------------------------------------------------------------------------- Triton device functions


@jit
def round_e2m1(v):
    """``v`` (|v| <= 6, or NaN) rounded to the nearest E2M1 value, ties to even, sign kept."""
    return round_to_fp8(v, 1, 1.0, 2.0)


@jit
def stochastic_e2m1(v, u):
    """``v`` (|v| <= 6, or NaN) rounded up in magnitude if ``u < (|v| − lo) / (hi − lo)`` (stochastic rounding).

    ``lo`` is ``|v|`` truncated to the grid: multiples of 0.5 below 1, else one mantissa bit; the
    step ``hi − lo`` is a power of two, so the fraction is exact.
    """
    a = tl.abs(v)
    bits = a.to(tl.int32, bitcast=True)
    lo = tl.where(a < 1.0, (a * 2.0).to(tl.int32).to(tl.float32) * 0.5, (bits & -4194304).to(tl.float32, bitcast=True))
    exp = (bits >> 23) & 0xFF
    step = tl.where(a < 1.0, 0.5, ((exp - 1) << 23).to(tl.float32, bitcast=True))
    inv_step = tl.where(a < 1.0, 2.0, ((255 - exp) << 23).to(tl.float32, bitcast=True))
    q = tl.where(u < (a - lo) * inv_step, lo + step, lo)
    q = tl.where(v.to(tl.int32, bitcast=True) < 0, -q, q)  # (the sign bit: -0 stays -0, code 8, as the twin)
    return tl.where(v != v, v, q)


@jit
def encode_e2m1(q):
    """The 4-bit code (int32) of an E2M1 grid value (sign in bit 3; NaN -> 0)."""
    a = tl.abs(q)
    mag = tl.where(a < 2.0, a * 2.0, tl.where(a < 4.0, a + 2.0, a * 0.5 + 4.0)).to(tl.int32)
    code = mag | (((q.to(tl.int32, bitcast=True) >> 31) & 1) << 3)
    return tl.where(q != q, 0, code)


@jit
def global_scales(amax):
    """(global_encode, global_decode) from the tensor's amax (TE's reference; an amax of -0 counts as 0)."""
    enc = tl.math.div_rn(tl.full(amax.shape, 2688.0, tl.float32), tl.abs(amax))
    enc = tl.where(enc > FLT_MAX_TL, FLT_MAX_TL, enc)  # keeps NaN
    enc = tl.where(enc == 0.0, 1.0, enc)
    return enc, tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), enc)


@jit
def nvfp4_block_scales(block_amax, global_encode, global_decode):
    """(s: the E4M3 block decode scale as fp32, enc: the element encode scale) per block."""
    d = block_amax * (global_encode * 0.16666667163372040)
    d = saturate(tl.where(d > FLT_MAX_TL, FLT_MAX_TL, d), 448.0)
    s = round_to_fp8(d, 3, 0.015625, 512.0)  # E4M3, round to nearest even
    enc = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s * global_decode)
    return s, tl.where(enc > FLT_MAX_TL, FLT_MAX_TL, enc)


@jit
def _quantize_half(v, enc, s, key, index, STOCHASTIC: tl.constexpr):
    """Scaled, clamped, rounded E2M1 values of one half (even or odd lanes) of a tile."""
    w = saturate(v * enc[:, None, :, None], 6.0)
    if STOCHASTIC:
        return stochastic_e2m1(w, uniform24(random_bits(key, index)))
    return round_e2m1(w)


@jit
def _nvfp4_kernel(
    X,
    AMAX,
    SEED,
    Q,
    S,
    n_rows,
    n_cols,
    n_blocks,
    x_row_stride,
    limit,
    alpha,
    offset,
    MODE: tl.constexpr,
    ACT: tl.constexpr,
    GATED: tl.constexpr,
    CLAMPED: tl.constexpr,
    TILE_ROWS: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    PACKED: tl.constexpr,
    BLOCK_RB: tl.constexpr,
    BLOCK_CB: tl.constexpr,
):
    # Program (i, j): BLOCK_RB scaling blocks of TILE_ROWS rows x BLOCK_CB blocks of 16 columns, as
    # 4-D tiles [block row, row in block, block column, pair in block]; even and odd lanes are
    # loaded separately, so a pair's two codes meet in one byte without shuffles.
    pid_r, pid_c = tile_ids(tl.cdiv(n_blocks, BLOCK_CB))
    rb = pid_r.to(tl.int64) * BLOCK_RB + tl.arange(0, BLOCK_RB)
    cb = pid_c * BLOCK_CB + tl.arange(0, BLOCK_CB)
    rows = (rb[:, None] * TILE_ROWS + tl.arange(0, TILE_ROWS)[None, :])[:, :, None, None]
    even = (cb[:, None] * 16 + 2 * tl.arange(0, 8)[None, :])[None, None, :, :]
    mask_e = (rows < n_rows) & (even < n_cols)
    mask_o = (rows < n_rows) & (even + 1 < n_cols)
    offs = rows * x_row_stride + even
    ve = act_value(X, offs, mask_e, n_cols, limit, alpha, offset, MODE, ACT, GATED, CLAMPED)
    vo = act_value(X, offs + 1, mask_o, n_cols, limit, alpha, offset, MODE, ACT, GATED, CLAMPED)
    a_e = nan_max(nan_max(ve, 3), 1)
    a_o = nan_max(nan_max(vo, 3), 1)
    block_amax = tl.where((a_e != a_e) | (a_e > a_o), a_e, a_o)
    ge, gd = global_scales(tl.load(AMAX).to(tl.float32))
    s, enc = nvfp4_block_scales(block_amax, ge, gd)
    key = seed_key(tl.load(SEED))
    index = rows * n_cols + even
    qe = _quantize_half(ve, enc, s, key, index, STOCHASTIC)
    qo = _quantize_half(vo, enc, s, key, index + 1, STOCHASTIC)
    if PACKED:
        byte = encode_e2m1(qe) | (encode_e2m1(qo) << 4)
        tl.store(Q + rows * (n_cols // 2) + even // 2, byte.to(tl.uint8), mask=mask_e)
    else:
        s4 = s[:, None, :, None]
        tl.store(Q + index, (qe * s4).to(Q.dtype.element_ty), mask=mask_e)
        tl.store(Q + index + 1, (qo * s4).to(Q.dtype.element_ty), mask=mask_o)
    smask = (rb[:, None] * TILE_ROWS < n_rows) & (cb[None, :] < n_blocks)
    tl.store(S + rb[:, None] * n_blocks + cb[None, :], encode_fp8(s, 3, 7, 0.015625, 512.0), mask=smask)


def _check_packing(x: Tensor, n_cols: int, out_dtype: torch.dtype) -> None:
    # (two codes a byte: with an odd count the kernel wrote a row's last code into the next row's
    # first byte, and the twin failed on an unrelated size)
    if out_dtype == torch.uint8 and n_cols % 2:
        raise shape_error("nvfp4_cast", "x", f"rows of an even number of values to pack (got {n_cols})", x)


def nvfp4_cast(
    x: Tensor,
    amax: Tensor,
    seed: Tensor,
    act: str,
    limit: float,
    alpha: float,
    offset: float,
    tile_rows: int,
    stochastic: bool,
    out_dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """``(q, scales)``: NVFP4 quantization of ``v = act(x)`` (``act=""``: ``v = x``) given ``amax = max|v|``.

    ``tile_rows`` 1 (1x16 blocks along the last dim) or 16 (16x16 blocks of a matrix);
    ``stochastic`` rounds with the bits of ``seed`` (``i64[]``, ignored otherwise). ``out_dtype``
    ``torch.uint8``: packed codes ``[..., K/2]`` (``K`` even); a float dtype: the values ``q · s``.
    """
    act_id, gated, clamped, n_cols = act_layout(x, act)
    packed = out_dtype == torch.uint8
    _check_packing(x, n_cols, out_dtype)
    rows = rows_view(x.contiguous())
    n_rows, in_cols = rows.shape
    n_blocks = cdiv(n_cols, BLOCK)
    q = torch.empty((*x.shape[:-1], n_cols // 2 if packed else n_cols), dtype=out_dtype, device=x.device)
    lead = x.shape[:-1] if tile_rows == 1 else (cdiv(n_rows, tile_rows),)
    scales = torch.empty((*lead, n_blocks), dtype=torch.float8_e4m3fn, device=x.device)
    if n_rows == 0 or n_cols == 0:
        return q, scales
    block_cb = min(next_power_of_2(n_blocks), 8)
    block_rb = max(1, min(next_power_of_2(cdiv(n_rows, tile_rows)), 128 // (block_cb * tile_rows)))
    grid = tiled_grid(cdiv(cdiv(n_rows, tile_rows), block_rb), cdiv(n_blocks, block_cb))
    _nvfp4_kernel[grid](
        rows,
        amax.to(torch.float32),
        seed,
        q,
        scales.view(torch.uint8),
        n_rows,
        n_cols,
        n_blocks,
        in_cols,
        limit,
        alpha,
        offset,
        MODE=_MODE_ACT if act else _MODE_CAST,
        ACT=act_id,
        GATED=gated,
        CLAMPED=clamped,
        TILE_ROWS=tile_rows,
        STOCHASTIC=stochastic,
        PACKED=packed,
        BLOCK_RB=block_rb,
        BLOCK_CB=block_cb,
    )
    return q, scales


# ----------------------------------------------------------------------------- PyTorch twins


def e2m1_multiples_ref(w: Tensor, u: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Twin of :func:`round_e2m1` (``u=None``) and :func:`stochastic_e2m1`, in a CPU-friendly form.

    ``|w| ≈ r · step``: ``step`` is the E2M1 spacing at ``|w|`` (0.5 below 2, 1 below 4, else 2,
    from the exponent bits), ``r`` the integer multiple, rounded half to even (the same grid
    point as the kernel's integer rounding of the fp32 bits) or up when ``u < frac`` (the
    fraction is exact: ``step`` is a power of two). NaN counts as 0 (its code; its block scale
    is NaN anyway). Returns ``(r, step, w with NaN as 0)``.
    """
    wz = torch.nan_to_num(w, nan=0.0)
    a = wz.abs()
    step = grid_step_ref(a, 1, 1.0)
    t = a / step
    if u is None:
        return torch.round(t), step, wz
    r = torch.floor(t)
    return r + torch.ceil((t - r) - u), step, wz  # ceil(frac - u) is 1 exactly when u < frac


def e2m1_values_ref(r: Tensor, step: Tensor, wz: Tensor) -> Tensor:
    """The E2M1 values ``±r · step`` (the sign of ``wz``, -0 kept)."""
    return torch.copysign(r * step, wz)


def e2m1_codes_ref(r: Tensor, step: Tensor, wz: Tensor) -> Tensor:
    """Twin of :func:`encode_e2m1`: ``r + 2·log2(2·step)`` (codes 0-7) with the sign in bit 3, int32."""
    mag = r.to(torch.int32) + 2 * ((step.view(torch.int32) >> 23) - 126)
    return mag | ((wz.view(torch.int32) >> 28) & 8)


def decode_e2m1_ref(codes: Tensor) -> Tensor:
    """Twin of :func:`decode_e2m1`: E2M1 values (fp32) of 4-bit codes (any integer tensor)."""
    table = torch.tensor([*E2M1_VALUES, *(-v for v in E2M1_VALUES)], dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def unpack_e2m1(packed: Tensor) -> Tensor:
    """``u8[..., K/2]`` packed codes -> fp32 values ``[..., K]`` (element ``2i`` in the low nibble)."""
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])
    return decode_e2m1_ref(codes)


def global_scales_ref(amax: Tensor) -> tuple[Tensor, Tensor]:
    """Twin of :func:`global_scales`."""
    amax = amax.to(torch.float32).abs()  # amax_ref may give -0.0 for an all-zero tensor
    enc = torch.full_like(amax, 2688.0) / amax
    enc = torch.where(enc > FLT_MAX, torch.full_like(enc, FLT_MAX), enc)
    enc = torch.where(enc == 0, torch.ones_like(enc), enc)
    return enc, torch.ones_like(enc) / enc


def nvfp4_block_scales_ref(block_amax: Tensor, global_encode: Tensor, global_decode: Tensor):
    """Twin of :func:`nvfp4_block_scales`: (s as fp32 E4M3 values, enc)."""
    d = torch.clamp(block_amax * (global_encode * ONE_SIXTH), max=E4M3_MAX)  # (TE caps at FLT_MAX first: same)
    s = round_to_grid_ref(d, 3, 2.0**-6)  # E4M3, round half to even; NaN stays NaN
    return s, (torch.ones_like(s) / (s * global_decode)).clamp(max=FLT_MAX)


def _nvfp4_rows(mat, bits, ge, gd, act, limit, alpha, offset, tile_rows, stochastic, out_dtype):
    """The NVFP4 cast of a ``[rows, K]`` matrix: (q ``[rows, K']`` or packed ``[rows, K'/2]``, E4M3 scales).

    ``bits``: the random bits (int32 ``[rows, K']``) of stochastic rounding, else ``None``.
    """
    v = act_value_ref(mat, act, limit, alpha, offset)
    tiles = blocked(v, tile_rows, BLOCK)  # [mb, tr, kb, 16]
    s, enc = nvfp4_block_scales_ref(block_amax_ref(tiles), ge, gd)
    w = torch.clamp(tiles * enc[:, None, :, None], -E2M1_MAX, E2M1_MAX)
    u = uniform24_ref(blocked(bits, tile_rows, BLOCK)) if stochastic else None
    r, step, wz = e2m1_multiples_ref(w, u)
    if out_dtype == torch.uint8:
        codes = unblocked(e2m1_codes_ref(r, step, wz), v.shape)
        return (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8), s.to(torch.float8_e4m3fn)
    values = e2m1_values_ref(r, step, wz) * s[:, None, :, None]
    return unblocked(values, v.shape).to(out_dtype), s.to(torch.float8_e4m3fn)


def nvfp4_cast_ref(
    x: Tensor,
    amax: Tensor,
    seed: Tensor,
    act: str,
    limit: float,
    alpha: float,
    offset: float,
    tile_rows: int,
    stochastic: bool,
    out_dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """PyTorch twin of :func:`nvfp4_cast`."""
    n_cols = act_layout(x, act)[3]
    _check_packing(x, n_cols, out_dtype)
    n_rows = math.prod(x.shape[:-1])
    ge, gd = global_scales_ref(amax)
    params = (ge, gd, act, limit, alpha, offset, tile_rows, stochastic, out_dtype)
    q = torch.empty((n_rows, n_cols // 2 if out_dtype == torch.uint8 else n_cols), dtype=out_dtype, device=x.device)
    scales = torch.empty((-(-n_rows // tile_rows), -(-n_cols // BLOCK)), dtype=torch.float8_e4m3fn, device=x.device)
    key = int(seed) if stochastic and _fast.eager_cpu(x, amax, seed) else None  # (None: no chunked path)

    def chunk(mat, r0):
        bits = random_bits_fast(key, r0 * n_cols, mat.shape[0] * n_cols).view(-1, n_cols) if stochastic else None
        return _nvfp4_rows(mat, bits, *params)

    if not by_row_chunks(x, tile_rows, ((q, 1), (scales, tile_rows)), chunk, inputs=(amax, seed)):
        index = torch.arange(n_rows * n_cols, dtype=torch.int64, device=x.device).view(n_rows, n_cols)
        bits = random_bits_ref(seed, index) if stochastic else None
        q, scales = _nvfp4_rows(rows_view(x), bits, *params)
    lead = x.shape[:-1] if tile_rows == 1 else scales.shape[:1]
    return q.reshape(*x.shape[:-1], q.shape[-1]), scales.reshape(*lead, scales.shape[-1])


# ----------------------------------------------------------------------------- dequantize


@jit
def decode_e2m1(code):
    """fp32 values of 4-bit E2M1 codes (int32): magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6, bit 3 the sign."""
    m = code & 7
    v = tl.where(m < 4, m.to(tl.float32) * 0.5, tl.where(m < 6, (m - 2).to(tl.float32), (m - 4).to(tl.float32) * 2.0))
    return tl.where((code & 8) != 0, -v, v)


@jit
def _nvfp4_dequantize_kernel(
    D,
    S,
    G,
    Y,
    n_rows,
    n_cols,
    n_blocks,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    pid_r, pid_c = tile_ids(tl.cdiv(n_cols, BLOCK_C))  # (the grid of dequantize_grid)
    rows = (pid_r.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R))[:, None]
    cols = (pid_c * BLOCK_C + tl.arange(0, BLOCK_C))[None, :]
    mask = (rows < n_rows) & (cols < n_cols)
    byte = tl.load(D + rows * (n_cols // 2) + cols // 2, mask=mask, other=0).to(tl.int32)
    q = decode_e2m1(tl.where(cols % 2 == 0, byte & 0xF, byte >> 4))
    s = decode_fp8(block_scale_at(S, rows, cols, n_blocks, mask, BLOCK_ROWS, 16), 3, 7, True)
    tl.store(Y + rows * n_cols + cols, (q * s * tl.load(G)).to(Y.dtype.element_ty), mask=mask)


def nvfp4_dequantize(
    data: Tensor, scales: Tensor, global_decode: Tensor, block_rows: int, out_dtype: torch.dtype
) -> Tensor:
    """``e2m1 · s · global_decode`` of packed codes ``data [..., K/2]`` with E4M3 block scales of
    1x16 (``block_rows=1``: ``[..., ceil(K/16)]``) or 16x16 blocks (``[ceil(M/16), ceil(K/16)]``)."""
    check_block_scales("dequantize", "scales", scales, (*data.shape[:-1], 2 * data.shape[-1]), block_rows, BLOCK)
    rows = rows_view(data.contiguous())
    y = torch.empty((*data.shape[:-1], 2 * data.shape[-1]), dtype=out_dtype, device=data.device)
    if rows.numel():
        grid, block_r, block_c = dequantize_grid(rows.shape[0], 2 * rows.shape[1])
        _nvfp4_dequantize_kernel[grid](
            rows,
            scales.contiguous().view(torch.uint8),
            global_decode.to(torch.float32),
            y,
            rows.shape[0],
            2 * rows.shape[1],
            scales.shape[-1],
            BLOCK_ROWS=block_rows,
            BLOCK_R=block_r,
            BLOCK_C=block_c,
        )
    return y


def nvfp4_dequantize_ref(
    data: Tensor, scales: Tensor, global_decode: Tensor, block_rows: int, out_dtype: torch.dtype
) -> Tensor:
    """PyTorch twin of :func:`nvfp4_dequantize`."""
    values = unpack_e2m1(data)
    check_block_scales("dequantize", "scales", scales, values.shape, block_rows, BLOCK)
    return (values * expand_block_scales(scales, values.shape, block_rows, BLOCK) * global_decode).to(out_dtype)


NVFP4_CAST = Kernel("nvfp4_cast", nvfp4_cast, nvfp4_cast_ref, quantizes=True)
NVFP4_DEQUANTIZE = Kernel("nvfp4_dequantize", nvfp4_dequantize, nvfp4_dequantize_ref)
