"""Independent references for the block-scaled formats, written from TE's formulas in float64.

Every fp32 operation of the formulas is evaluated in float64 and rounded to fp32 (exact for one
+, -, *, / of fp32 values: float64 has more than twice the precision), so the references round at
the same points as TE's reference implementation without sharing code with functe:

* :func:`fp8_block_reference`: TE's ``compute_scale_from_amax`` per 1xB or BxB block, then the
  round-to-nearest-even FP8 grid of :mod:`fp8_helpers`;
* :func:`nvfp4_reference`: TE's ``reference_nvfp4.py`` (global encode/decode, E4M3 block scales,
  E2M1 round-to-nearest-even), returning codes, scales and dequantized values;
* :func:`bits_int`: the counter-based hash on Python integers (from the dropout oracle);
* :func:`sylvester` / :func:`rht_q`: the Hadamard matrix by Sylvester's recursion and the RHT
  matrix ``diag(s) H / 4``.
"""

from __future__ import annotations

import math

import torch
from fp8_helpers import MAX, round_fp8_ref

from functe.kernels.dropout import key_int, mix_int

F64 = torch.float64
FLT_MAX = torch.finfo(torch.float32).max
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=F64)


def f32(t: torch.Tensor) -> torch.Tensor:
    """Round a float64 tensor to fp32 (and back to float64)."""
    return t.to(torch.float32).to(F64)


def tiles(v: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``v [M, K]`` zero-padded to whole blocks, as ``[M/rows, rows, K/cols, cols]``."""
    m, k = v.shape
    padded = torch.zeros(-(-m // rows) * rows, -(-k // cols) * cols, dtype=v.dtype)
    padded[:m, :k] = v
    return padded.reshape(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols)


def untile(t: torch.Tensor, m: int, k: int) -> torch.Tensor:
    a, r, b, c = t.shape
    return t.reshape(a * r, b * c)[:m, :k]


def block_amax(blocks: torch.Tensor) -> torch.Tensor:
    """Largest magnitude per block (NaN if the block holds a NaN)."""
    a = blocks.abs().amax(dim=(1, 3))
    has_nan = blocks.isnan().any(dim=3).any(dim=1)
    return torch.where(has_nan, torch.nan, a)


# ----------------------------------------------------------------------------- FP8 block scaling


def te_block_scale(amax: torch.Tensor, fp8_max: float, pow2: bool, eps: float, inf_value: float) -> torch.Tensor:
    """TE's compute_scale_from_amax on float64 amaxes (exact fp32 values), one block at a time;
    ``inf_value`` replaces an infinite scale (the block kernels': the input dtype's largest value)."""
    out = []
    for a in amax.reshape(-1).tolist():
        a = max(a, eps) if not math.isnan(a) else a
        if a == 0 or math.isinf(a) or math.isnan(a):
            out.append(1.0)
            continue
        s = float(f32(torch.tensor(fp8_max / a, dtype=F64)))
        if math.isinf(s):
            s = inf_value
        if pow2:
            s = 2.0 ** (math.frexp(s)[1] - 1)
        out.append(s)
    return torch.tensor(out, dtype=F64).reshape(amax.shape)


def fp8_block_reference(x: torch.Tensor, block_rows: int, qdtype, *, pow2=True, eps=0.0):
    """(FP8 values, scale_inv per block, dequantized values) of ``x [..., K]`` in float64.

    ``block_rows`` 1: 1x128 blocks along the last dim (any leading shape); 128: a matrix in 128x128 blocks.
    """
    v = x.to(F64).reshape(-1, x.shape[-1])
    t = tiles(v, block_rows, 128)
    # (TE's block kernels: inf -> the input type's largest finite value; fp64, which TE has not: FLT_MAX)
    inf_value = min(torch.finfo(x.dtype).max, FLT_MAX)
    scale = te_block_scale(block_amax(t), MAX[qdtype], pow2, eps, inf_value)
    scale_inv = f32(1.0 / scale)
    q = round_fp8_ref(f32(t * scale[:, None, :, None]), qdtype)
    deq = q * scale_inv[:, None, :, None]
    shape = x.shape
    lead = shape[:-1] if block_rows == 1 else scale.shape[:1]
    m, k = v.shape
    return (
        untile(q, m, k).reshape(shape),
        scale_inv.reshape(*lead, scale.shape[-1]),
        untile(deq, m, k).reshape(shape),
    )


# ----------------------------------------------------------------------------- NVFP4


def round_e2m1_reference(w: torch.Tensor) -> torch.Tensor:
    """``w`` (float64, |w| <= 6) rounded to the nearest E2M1 value, ties to the even code."""
    mag = w.abs()
    hi = torch.searchsorted(E2M1_GRID, mag.nan_to_num(0.0)).clamp(max=7)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = mag - E2M1_GRID[lo], E2M1_GRID[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    out = torch.where(pick_hi, E2M1_GRID[hi], E2M1_GRID[lo])
    out = torch.where(w.signbit(), -out, out)
    return torch.where(w.isnan(), w, out)


def e2m1_code(q: torch.Tensor) -> torch.Tensor:
    """The 4-bit code of E2M1 values (index in the grid, bit 3 the sign)."""
    idx = torch.searchsorted(E2M1_GRID, q.abs().nan_to_num(0.0))
    return (idx | (q.signbit().long() << 3)).where(~q.isnan(), torch.zeros_like(idx))


def nvfp4_reference(v: torch.Tensor, tile_rows: int, *, rounding=round_e2m1_reference):
    """TE's NVFP4 reference on ``v [..., K]`` (float64 of the fp32 values to quantize).

    Returns a dict: ``w`` (scaled, clamped values before rounding), ``q`` (E2M1 values), ``codes``,
    ``scales`` (E4M3 values per block), ``global_encode``, ``global_decode``, ``deq`` (``q * s * global_decode``).
    ``rounding`` maps ``w`` to ``q`` (tests pass a stochastic oracle).
    """
    mat = v.to(F64).reshape(-1, v.shape[-1])
    m, k = mat.shape
    amax = mat.abs().max() if mat.numel() else torch.tensor(0.0, dtype=F64)
    if mat.isnan().any():
        amax = torch.tensor(math.nan, dtype=F64)
    ge = f32(torch.tensor(2688.0, dtype=F64) / amax)
    ge = torch.where(ge > FLT_MAX, torch.tensor(FLT_MAX, dtype=F64), ge)
    ge = torch.where(ge == 0, torch.tensor(1.0, dtype=F64), ge)
    gd = f32(1.0 / ge)
    mult = f32(ge * f32(torch.tensor(1.0 / 6.0, dtype=F64)))
    t = tiles(mat, tile_rows, 16)
    d = f32(block_amax(t) * mult)
    d = torch.where(d > FLT_MAX, torch.tensor(FLT_MAX, dtype=F64), d)
    s = round_fp8_ref(d.clamp(max=448.0), torch.float8_e4m3fn)
    enc = f32(1.0 / f32(s * gd))
    enc = torch.where(enc > FLT_MAX, torch.tensor(FLT_MAX, dtype=F64), enc)
    w = f32(t * enc[:, None, :, None]).clamp(-6.0, 6.0)
    q = rounding(w)
    lead = v.shape[:-1] if tile_rows == 1 else s.shape[:1]
    deq = q * s[:, None, :, None] * gd
    return {
        "w": untile(w, m, k).reshape(v.shape),
        "q": untile(q, m, k).reshape(v.shape),
        "codes": untile(e2m1_code(q), m, k).reshape(v.shape),
        "scales": s.reshape(*lead, s.shape[-1]),
        "global_encode": ge,
        "global_decode": gd,
        "deq": untile(deq, m, k).reshape(v.shape),
    }


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Two codes per byte, element ``2i`` in the low nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


# ----------------------------------------------------------------------------- randomness


def bits_int(seed: int, index: int) -> int:
    """The 32 random bits of element ``index`` for ``seed`` (the dropout hash, per element)."""
    key = key_int(seed)
    return mix_int((mix_int((index & 0xFFFFFFFF) ^ mix_int(key ^ mix_int(index >> 32))) + key) & 0xFFFFFFFF)


def sylvester(n: int) -> torch.Tensor:
    """The n x n Hadamard matrix by Sylvester's recursion [[H, H], [H, -H]]."""
    h = torch.ones(1, 1, dtype=F64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def rht_q(seed: int) -> torch.Tensor:
    """``Q = diag(s) H16 / 4`` with ``s_i`` the sign of ``bits(i)`` (bit 31 set: -1)."""
    signs = torch.tensor([-1.0 if bits_int(seed, i) >> 31 else 1.0 for i in range(16)], dtype=F64)
    return signs[:, None] * sylvester(16) / 4.0
