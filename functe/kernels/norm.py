"""Normalization kernels (LayerNorm, RMSNorm, L2 normalization), forward and backward.

All three normalise each row of ``x [..., N]`` by a reciprocal standard
deviation ``r`` computed in fp32 (fp64 for fp64 inputs):

==================  ===============================  ==================================
kind                x̂                                 r
==================  ===============================  ==================================
``layer``           (x − mean(x))·r                  1/√(mean((x − mean)²) + eps)
``rms``             x·r                              1/√(mean(x²) + eps)
``l2``              x·r                              1/√(Σx² + eps)
==================  ===============================  ==================================

then ``y = x̂·γ + β`` (γ → 1 + γ with ``zero_centered_gamma``). The LayerNorm
forward also returns its row statistics ``mean`` and ``rstd`` (= r), shape
``x.shape[:-1]``, in the compute dtype, and its backward kernels take them
(TransformerEngine's ``layernorm_fwd`` / ``layernorm_bwd`` contract): they are
*outputs* of the op, so the op keeps no intermediate residual and its second
derivatives stay exact. The RMSNorm and L2 backward kernels take only the inputs
``(dy, x, γ)`` and recompute r from ``x``, which they read anyway. With ``g = dy·γ``:

    dx = r·(g − mean(g) − x̂·mean(g·x̂))      (layer; rms and l2 drop mean(g),
                                              l2 uses sums instead of means)
    dγ = Σ_rows dy·x̂,   dβ = Σ_rows dy

``dγ`` and ``dβ`` are fp32 per-program partial sums over contiguous row ranges
(a fixed number of programs, so the result does not depend on the device),
reduced by one sum afterwards: deterministic, no atomics.

The per-row math lives in the device functions :func:`normalize_rows` and
:func:`norm_grads_rows`, so that fused kernels (norm + FP8 quantize) compute
exactly the same thing.
"""

from __future__ import annotations

import math

import torch
import triton.language as tl

from .._errors import ShapeError, describe, describe_shape, shape_error
from .._kernel import FoldMembers, Kernel, Members, Rowwise
from . import _fast
from ._common import as_dtype, compute_dtype, row_counts, rows_view, shaped, tl_compute_dtype
from ._fast import eager_cpu, parallel_chunks
from ._triton import cdiv, jit, next_power_of_2, tile_ids, tiled_grid

Tensor = torch.Tensor

KINDS = ("layer", "rms", "l2")
MAX_COLS = 65536
"""Longest row the single-pass kernels hold in registers."""

# ----------------------------------------------------------------------------- Triton device functions


@jit
def reciprocal(count, x):
    """``1 / count`` in ``x``'s dtype, rounded once from fp64.

    Computed here, not passed in: a Python float argument is fp32 in a compiled kernel (Triton types
    it so; the interpreter keeps the double), which left fp64 statistics fp32-accurate on a GPU.
    """
    return (tl.full([], 1.0, tl.float64) / count).to(x.dtype)


@jit
def normalize_rows(x, mask, count, eps, CENTER: tl.constexpr):
    """``(x̂, mean, r)`` of each row of the tile ``x [R, C]`` (masked lanes must hold 0).

    ``count`` is N for means (layer, rms) or 1 for sums (l2); ``CENTER``
    subtracts the row mean first (layer; without it ``mean`` is 0). Masked lanes of x̂ are 0.
    """
    inv_n = reciprocal(count, x)
    if CENTER:
        mean = tl.sum(x, axis=1) * inv_n
        x = tl.where(mask, x - mean[:, None], 0.0)
    # Correctly rounded sqrt and division: tl.sqrt compiles to sqrt.approx.ftz on a GPU, which flushes
    # a subnormal variance (eps = 0) to 0 and gives r = inf where the twins stay finite.
    # (fp64, for gradcheck, is IEEE already and has no _rn variants.)
    var = tl.sum(x * x, axis=1) * inv_n + eps
    if var.dtype == tl.float32:
        r = tl.math.div_rn(tl.full(var.shape, 1.0, tl.float32), tl.sqrt_rn(var))
    else:
        r = 1.0 / tl.sqrt(var)
    if not CENTER:
        mean = tl.zeros_like(r)
    xhat = tl.where(mask, x * r[:, None], 0.0)
    return xhat, mean, r


@jit
def norm_grads_rows(g, xhat, r, count, CENTER: tl.constexpr):
    """``dx`` of each row from ``g = dy·γ``, x̂ and r (see the module docstring)."""
    inv_n = reciprocal(count, g)
    c = tl.sum(g * xhat, axis=1) * inv_n
    if CENTER:
        g = g - (tl.sum(g, axis=1) * inv_n)[:, None]
    return (g - xhat * c[:, None]) * r[:, None]


@jit
def _load_gamma(W, cols, col_mask, ZERO_CENTERED: tl.constexpr, COMPUTE: tl.constexpr):
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(COMPUTE)
    if ZERO_CENTERED:
        w = w + 1.0
    return w


@jit
def norm_fwd_tile(
    X,
    W,
    B,
    pid,
    n_rows,
    n_cols,
    count,
    eps,
    CENTER: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    COMPUTE: tl.constexpr,
):
    """``(y, offs, mask, rows, mean, r)``: the normalised rows of program ``pid`` (``BLOCK_R`` whole
    rows), in COMPUTE, with their indices and statistics.

    The one forward computation: the norm kernel stores ``y`` (and, for LayerNorm, ``mean`` and
    ``r``); the norm + FP8 cast kernel (:mod:`functe.kernels.norm_quantize`) quantizes it, so both
    produce the same bits.
    """
    rows = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    offs = rows[:, None] * n_cols + cols[None, :]
    x = tl.load(X + offs, mask=mask, other=0.0).to(COMPUTE)
    y, mean, r = normalize_rows(x, mask, count, eps, CENTER)
    if HAS_W:
        y = y * _load_gamma(W, cols, col_mask, ZERO_CENTERED, COMPUTE)[None, :]
    if HAS_B:
        y = y + tl.load(B + cols, mask=col_mask, other=0.0).to(COMPUTE)[None, :]
    return y, offs, mask, rows, mean, r


@jit
def store_stats(MEAN, RSTD, rows, n_rows, mean, r):
    """Store a tile's row statistics (LayerNorm's ``mean`` and ``rstd``)."""
    tl.store(MEAN + rows, mean, mask=rows < n_rows)
    tl.store(RSTD + rows, r, mask=rows < n_rows)


@jit
def _norm_fwd_kernel(
    X,
    W,
    B,
    Y,
    MEAN,
    RSTD,
    rows_per_member,
    n_cols,
    count,
    eps,
    programs_per_member,
    x_member_stride,
    w_member_stride,
    b_member_stride,
    CENTER: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    STATS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    COMPUTE: tl.constexpr,
):
    # Program (m, p) normalizes tile p of member m's rows. An unbatched call is one member; a vmapped
    # one with γ or β per member (an ensemble) stacks the members: x, γ and β advance by their member
    # strides (0 for one shared by every member), y and the statistics by the member's rows.
    member, pid = tile_ids(programs_per_member)
    y, offs, mask, rows, mean, r = norm_fwd_tile(
        X + member * x_member_stride, W + member * w_member_stride, B + member * b_member_stride, pid,
        rows_per_member, n_cols, count, eps, CENTER, HAS_W, HAS_B, ZERO_CENTERED, BLOCK_R, BLOCK_N, COMPUTE,
    )  # fmt: skip
    first_row = member * rows_per_member
    tl.store(Y + first_row * n_cols + offs, y.to(Y.dtype.element_ty), mask=mask)
    if STATS:
        store_stats(MEAN + first_row, RSTD + first_row, rows, rows_per_member, mean, r)


@jit
def _norm_bwd_kernel(
    DY,
    X,
    MEAN,
    RSTD,
    W,
    ACC,
    DX,
    DW_PARTIAL,
    DB_PARTIAL,
    rows_per_member,
    n_cols,
    count,
    eps,
    tiles_per_program,
    programs_per_member,
    w_member_stride,
    CENTER: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    HAS_ACC: tl.constexpr,
    HAS_STATS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    COMPUTE: tl.constexpr,
    STAGES: tl.constexpr,
):
    # Program (m, p) handles member m's contiguous row tiles [p*T, (p+1)*T) and writes one row of
    # dγ/dβ partial sums; the launcher reduces them per member. An unbatched call is one member;
    # a vmapped one (the batching rule) stacks the members' rows, so their sums stay apart.
    member, pid = tile_ids(programs_per_member)
    first_row = member * rows_per_member
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    if HAS_W:
        w = _load_gamma(W + member * w_member_stride, cols, col_mask, ZERO_CENTERED, COMPUTE)
    dw = tl.zeros((BLOCK_N,), dtype=COMPUTE)
    db = tl.zeros((BLOCK_N,), dtype=COMPUTE)
    # (the next tiles' loads in flight while this one's sums run: see _bwd_tiling)
    for t in tl.range(0, tiles_per_program, num_stages=STAGES):
        local = (pid * tiles_per_program + t) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = local < rows_per_member
        rows = first_row + local
        mask = row_ok[:, None] & col_mask[None, :]
        offs = rows[:, None] * n_cols + cols[None, :]
        x = tl.load(X + offs, mask=mask, other=0.0).to(COMPUTE)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(COMPUTE)
        if HAS_STATS:  # LayerNorm: the forward's statistics (no reductions to redo)
            mean = tl.load(MEAN + rows, mask=row_ok, other=0.0).to(COMPUTE)
            r = tl.load(RSTD + rows, mask=row_ok, other=0.0).to(COMPUTE)
            xhat = tl.where(mask, (x - mean[:, None]) * r[:, None], 0.0)
        else:
            xhat, _, r = normalize_rows(x, mask, count, eps, CENTER)
        g = dy
        if HAS_W:
            g = dy * w[None, :]
            dw += tl.sum(dy * xhat, axis=0)
        if HAS_B:
            db += tl.sum(dy, axis=0)
        dx = norm_grads_rows(g, xhat, r, count, CENTER)
        if HAS_ACC:  # a residual's gradient added before the one rounding (TE's rmsnorm_bwd_add)
            dx += tl.load(ACC + offs, mask=mask, other=0.0).to(COMPUTE)
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
    partial = (member * programs_per_member + pid) * n_cols
    if HAS_W:
        tl.store(DW_PARTIAL + partial + cols, dw, mask=col_mask)
    if HAS_B:
        tl.store(DB_PARTIAL + partial + cols, db, mask=col_mask)


# ----------------------------------------------------------------------------- launchers


_TILE_ELEMENTS = 4096
"""Elements per forward tile (rows of at most 4096 columns share a program)."""
_BWD_TILE_ELEMENTS = 8192
"""Elements per backward tile, up to 4 rows: each tile's loads overlap the previous one's math."""

_PIPELINE_BYTES = 96 * 1024
"""Shared memory the backward's pipelined loads may take (stages x one tile of each tensor it loads).

Triton stages pipelined loads in shared memory and refuses a launch whose kernel needs more than the
device has per block: 96 KiB fits every GPU functe targets (sm_86/89 allow 99 KiB a block, sm_80
163, sm_90 227). Three stages of a bf16 tile of 8192 elements take exactly 96 KiB; larger tiles take
fewer stages or none (fp32 beyond 1024 columns and fp64 run unpipelined, as before the tuning, and
were not measured since: pipelined, fp32 needed 192 KiB, more than an A100 has, and fp64 more than
an H100, by a review's compile of the launches with Triton 3.9's ptxas).
"""


def _bwd_partials(block_n: int) -> int:
    """How many programs split a backward's rows (each writes one fp32 row of dγ/dβ partial sums).

    A fixed number per row width, so the sums' order, and the result, does not depend on the device.
    Measured on an H100 (docs/benchmarks.md): 128 programs were faster than 256 at 4096 and 8192
    columns (LayerNorm by 5%, RMSNorm by 2-3%: half the partial sums to write and reduce); at 1024,
    where a program is 4 warps, 256.
    """
    return 256 if block_n <= 1024 else 128


_OPS = {"layer": "layer_norm", "rms": "rms_norm", "l2": "l2_normalize"}


def check_norm_bias(kind: str, bias: Tensor | None) -> None:
    """Refuse a β for RMSNorm (only LayerNorm has one) in the kernels that take ``kind``: the kernel
    added it and the twin ignored it, so a kernel-level call's result depended on the backend."""
    if kind != "layer" and bias is not None:
        raise ValueError(f"a {kind} norm takes no bias (only LayerNorm has β), got {describe(bias)}")


def _rows_per_member(x: Tensor, members: int) -> int:
    """Rows of ``x`` (its last dimension a row) per member of a ``members``-stacked call."""
    return x.numel() // max(x.shape[-1], 1) // max(members, 1)


def _tiling(x: Tensor, kind: str, members: int = 1) -> tuple[int, int, int]:
    """``(block_r, block_n, warps)`` for ``x``'s rows (the norm kernels and their fused casts); with
    ``members``, for one member's rows (a vmapped call: each member tiled as its own call)."""
    n_cols = x.shape[-1]
    n_rows = _rows_per_member(x, members)
    if n_cols > MAX_COLS:
        raise ShapeError(
            f"functe.{_OPS[kind]}: argument 'x' expected rows of at most {MAX_COLS} elements on the Triton "
            f"backend (its kernels normalize a row in one pass), got {describe(x)}"
        )
    block_n = next_power_of_2(n_cols)
    block_r = min(next_power_of_2(n_rows), max(1, _TILE_ELEMENTS // block_n))
    # Measured on an H100 (docs/benchmarks.md, bf16, 2^26 elements): 16 warps at 8192 columns left
    # LayerNorm at 0.79 of a copy's bandwidth and 8 reached 0.94; at 16384, 4 warps 0.92, 8 or 16
    # warps 0.69-0.70. Wider rows keep 16 (not measured). The fused casts use the same warps, so
    # their row reductions add in the same order as the unfused norm's.
    warps = 4 if block_n < 2048 else 8 if block_n <= 8192 else 4 if block_n <= 16384 else 16
    return block_r, block_n, warps


def _bwd_tiling(x: Tensor, kind: str, members: int = 1, *, accum: bool = False) -> tuple[int, int, int, int, int]:
    """``(block_r, block_n, warps, stages, partials)`` of the backward kernel (see :func:`_tiling`):
    ``partials`` caps the programs that split the rows (each writes a row of dγ/dβ partial sums).

    The backward loops over its row tiles, so its loads are software-pipelined (``stages`` tiles in
    flight) up to 8192 columns where they fit :data:`_PIPELINE_BYTES`. Measured on an H100 by
    CUDA-graph replay (docs/benchmarks.md, bf16, 2^26 elements), against the tiling before (the
    forward's, no pipelining, 256 programs): at 8192 columns LayerNorm 0.54 -> 0.82 of a copy's
    bandwidth and RMSNorm 0.68 -> 0.87; at 4096, 0.60 -> 0.82 and 0.72 -> 0.87. Wider rows did better
    without pipelining (measured at 16384 only, by do_bench). ``accum``: the ``*_bwd_add`` variants,
    which also load the residual's gradient.
    """
    _, block_n, _ = _tiling(x, kind, members)
    block_r = min(next_power_of_2(_rows_per_member(x, members)), 4, max(1, _BWD_TILE_ELEMENTS // block_n))
    warps = 4 if block_n <= 1024 else 8 if block_n <= 8192 else 16
    tile_bytes = block_r * block_n * x.element_size() * (3 if accum else 2)
    stages = next((s for s in (3, 2) if s * tile_bytes <= _PIPELINE_BYTES), 1) if block_n <= 8192 else 1
    return block_r, block_n, warps, stages, _bwd_partials(block_n)


def mean_count(kind: str, n_cols: int) -> int:
    """What a row's statistics divide by: N for means (layer, rms), 1 for a sum (l2)."""
    return 1 if kind == "l2" else max(n_cols, 1)


def _check_launch(kind: str, x: Tensor, members: int | None = None, **others: Tensor | None) -> None:
    """γ and β of shape ``(N,)`` (or ``(M, N)``, one per member of a vmapped call), dy and accum of
    x's shape: the launchers index them by x's layout, so a kernel-level call with a wrong shape read
    past them (the twins raised torch's errors)."""
    for arg, t in others.items():
        if t is None:
            continue
        expected = x.shape[-1:] if arg in ("weight", "bias") else x.shape
        if members is not None and arg in ("weight", "bias") and t.dim() == 2:
            expected = (members, x.shape[-1])
        if t.shape != expected:
            raise shape_error(_OPS[kind], arg, describe_shape(t.dtype, tuple(expected)), t)


def new_stats(x: Tensor, kind: str) -> tuple[Tensor, Tensor]:
    """LayerNorm's ``(mean, rstd)`` buffers for ``x`` (``x.shape[:-1]``, compute dtype; empty for the
    other kinds), for a kernel to write. Rows of nothing (N = 0) get the twin's statistics here, mean
    0 and rstd NaN (a 0/0 variance), since no program runs to write them (the norm + cast launchers
    returned unwritten memory)."""
    stats = kind == "layer"
    mean = torch.empty(x.shape[:-1] if stats else (0,), dtype=compute_dtype(x.dtype), device=x.device)
    rstd = torch.empty_like(mean)
    if stats and x.shape[-1] == 0:
        mean.zero_()
        rstd.fill_(math.nan)
    return mean, rstd


def check_norm_params(
    kind: str, x: Tensor, weight: Tensor | None, bias: Tensor | None, members: int | None = None
) -> None:
    """γ and β of shape ``(N,)`` for a launcher indexing them by x's columns (or ``(M, N)`` with
    ``members``), and no β for RMSNorm."""
    check_norm_bias(kind, bias)
    _check_launch(kind, x, members, weight=weight, bias=bias)


def _member_count(kind: str, x: Tensor) -> int:
    """The members of a ``*_members`` kernel's x ``[M, ..., N]``: a 1-D (or 0-d) x has rows of no
    member (its launch wrote nothing and returned unwritten memory)."""
    if x.dim() < 2:
        raise ShapeError(
            f"functe.{_OPS[kind]}: argument 'x' of a members kernel expected [M, ..., N] (members on dimension 0), "
            f"got {describe(x)}"
        )
    return x.shape[0]


def _member_stride(t: Tensor | None, members: bool) -> int:
    """How far a member's γ or β lies from the previous one's: 0 when every member shares it."""
    return t.shape[-1] if members and t is not None and t.dim() == 2 else 0


def _fwd(
    x: Tensor, w: Tensor | None, b: Tensor | None, eps: float, kind: str, zero_centered: bool, members: bool = False
):
    """``y``, or for LayerNorm ``(y, mean, rstd)`` (statistics of shape ``x.shape[:-1]``, compute dtype).

    ``members``: x's dimension 0 stacks independent members (see :func:`layer_norm_members`); γ and β
    are ``[N]`` or ``[M, N]``. An x broadcast along it (stride 0: one input to every member) is read
    once per member, not copied.
    """
    m = _member_count(kind, x) if members else 1
    check_norm_params(kind, x, w, b, m if members else None)
    shared_x = members and m > 0 and x.stride(0) == 0
    # (the kernel indexes contiguous memory by the counts it is given: no 2-D view, ~0.8 us each)
    rows = (x[0] if shared_x else x).contiguous()
    n_rows, n_cols = row_counts(rows)
    rows_per_member = n_rows if shared_x else n_rows // max(m, 1)
    # Results in their own shapes (contiguous, so the kernel's row-major indexing holds): views
    # returned from a Function cost an un-viewing at its boundary (_backend.unaliased_outputs).
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device) if shared_x else torch.empty_like(rows)
    stats = kind == "layer"
    mean, rstd = new_stats(x, kind)
    if y.numel():
        block_r, block_n, warps = _tiling(x, kind, m)
        programs = cdiv(rows_per_member, block_r)
        _norm_fwd_kernel[tiled_grid(m, programs)](
            rows,
            rows if w is None else w.contiguous(),
            rows if b is None else b.contiguous(),
            y,
            mean,
            rstd,
            rows_per_member,
            n_cols,
            mean_count(kind, n_cols),
            eps,
            programs,
            0 if shared_x else rows_per_member * n_cols,
            _member_stride(w, members),
            _member_stride(b, members),
            CENTER=kind == "layer",
            HAS_W=w is not None,
            HAS_B=b is not None,
            ZERO_CENTERED=zero_centered,
            STATS=stats,
            BLOCK_R=block_r,
            BLOCK_N=block_n,
            COMPUTE=tl_compute_dtype(x.dtype),
            num_warps=warps,
        )
    return (y, mean, rstd) if stats else y


def _bwd(
    dy: Tensor,
    x: Tensor,
    w: Tensor | None,
    eps: float,
    kind: str,
    zero_centered: bool,
    has_b: bool,
    accum: Tensor | None = None,
    stats: tuple[Tensor, Tensor] | None = None,
    members: bool = False,
):
    """``(dx, dγ or None, dβ or None)``; ``accum`` (x's shape and dtype) is added to dx; ``stats``
    (LayerNorm's ``(mean, rstd)``) replace recomputing them (``eps`` is then unused).

    ``members``: x's dimension 0 stacks independent members (a vmapped call, see
    :func:`layer_norm_bwd_members`): dγ and dβ are ``[M, N]``, one reduction per member, tiled and
    partitioned exactly as a call on that member alone; γ is ``[N]`` or ``[M, N]``.
    """
    m = _member_count(kind, x) if members else 1
    _check_launch(kind, x, m if members else None, dy=dy, weight=w, accum=accum)
    # (the kernel indexes contiguous memory by the counts it is given: no 2-D views, ~0.8 us each)
    rows = x.contiguous()
    n_rows, n_cols = row_counts(rows)
    reduced = (m, n_cols) if members else (n_cols,)
    acc = compute_dtype(x.dtype)
    if n_rows == 0 or n_cols == 0:
        dx = torch.empty_like(rows) if accum is None else accum.clone(memory_format=torch.contiguous_format)
        dw = torch.zeros(reduced, dtype=w.dtype, device=x.device) if w is not None else None
        db = torch.zeros(reduced, dtype=x.dtype, device=x.device) if has_b else None
        return dx, dw, db
    dx = torch.empty_like(rows)
    rows_per_member = n_rows // m
    block_r, block_n, warps, stages, partials = _bwd_tiling(x, kind, m, accum=accum is not None)
    n_tiles = cdiv(rows_per_member, block_r)
    tiles_per_program = cdiv(n_tiles, partials)
    programs = cdiv(n_tiles, tiles_per_program)
    # (one member's partial sums without a member dimension: reduced without an index, ~1 us each)
    partial_shape = (m, programs, n_cols) if members else (programs, n_cols)
    dw_partial = torch.empty(partial_shape, dtype=acc, device=x.device) if w is not None else None
    db_partial = torch.empty(partial_shape, dtype=acc, device=x.device) if has_b else None
    if stats is not None:
        for arg, stat in zip(("mean", "rstd"), stats):
            if stat.numel() != n_rows:  # (the kernel reads one per row: past a shorter one)
                raise shape_error(_OPS[kind], arg, describe_shape(acc, tuple(x.shape[:-1])), stat, "one per row of x")
    mean, rstd = (rows, rows) if stats is None else (stat.contiguous() for stat in stats)
    _norm_bwd_kernel[tiled_grid(m, programs)](
        dy.contiguous(),
        rows,
        mean,
        rstd,
        rows if w is None else w.contiguous(),
        rows if accum is None else accum.contiguous(),
        dx,
        dx if dw_partial is None else dw_partial,
        dx if db_partial is None else db_partial,
        rows_per_member,
        n_cols,
        mean_count(kind, n_cols),
        eps,
        tiles_per_program,
        programs,
        n_cols if w is not None and w.dim() == 2 else 0,
        CENTER=kind == "layer",
        HAS_W=w is not None,
        HAS_B=has_b,
        ZERO_CENTERED=zero_centered,
        HAS_ACC=accum is not None,
        HAS_STATS=stats is not None,
        BLOCK_R=block_r,
        BLOCK_N=block_n,
        COMPUTE=tl_compute_dtype(x.dtype),
        STAGES=stages,
        num_warps=warps,
    )

    def reduce(partial: Tensor | None, dtype: torch.dtype) -> Tensor | None:
        if partial is None:
            return None
        return partial.sum(1 if members else 0).to(dtype)

    return dx, reduce(dw_partial, None if w is None else w.dtype), reduce(db_partial, x.dtype)


def layer_norm(
    x: Tensor, weight: Tensor, bias: Tensor, eps: float, zero_centered_gamma: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """LayerNorm of the last dimension: ``(y, mean, rstd)``, ``y = (x − mean)·rstd·γ + β``.

    ``mean`` and ``rstd = 1/√(var + eps)`` have shape ``x.shape[:-1]`` and the compute dtype
    (fp32; fp64 for fp64 x); the backward kernels take them.
    """
    return _fwd(x, weight, bias, eps, "layer", zero_centered_gamma)


def layer_norm_bwd(
    dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor, zero_centered_gamma: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dx, dγ, dβ)`` of :func:`layer_norm` from its statistics (β does not enter the gradients)."""
    return _bwd(dy, x, weight, 0.0, "layer", zero_centered_gamma, True, stats=(mean, rstd))


def rms_norm(x: Tensor, weight: Tensor, eps: float, zero_centered_gamma: bool) -> Tensor:
    """RMSNorm of the last dimension: ``x·r·γ``."""
    return _fwd(x, weight, None, eps, "rms", zero_centered_gamma)


def rms_norm_bwd(dy: Tensor, x: Tensor, weight: Tensor, eps: float, zero_centered_gamma: bool) -> tuple[Tensor, Tensor]:
    """``(dx, dγ)`` of :func:`rms_norm`."""
    dx, dw, _ = _bwd(dy, x, weight, eps, "rms", zero_centered_gamma, False)
    return dx, dw


def layer_norm_bwd_add(
    dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor, accum: Tensor, zero_centered_gamma: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`layer_norm_bwd` with ``accum`` (a residual's gradient, x's shape) added to dx in the same pass."""
    return _bwd(dy, x, weight, 0.0, "layer", zero_centered_gamma, True, accum, (mean, rstd))


def rms_norm_bwd_add(
    dy: Tensor, x: Tensor, weight: Tensor, accum: Tensor, eps: float, zero_centered_gamma: bool
) -> tuple[Tensor, Tensor]:
    """:func:`rms_norm_bwd` with ``accum`` added to dx in the same pass (TE's ``rmsnorm_bwd_add``)."""
    dx, dw, _ = _bwd(dy, x, weight, eps, "rms", zero_centered_gamma, False, accum)
    return dx, dw


def layer_norm_members(
    x: Tensor, weight: Tensor, bias: Tensor, eps: float, zero_centered_gamma: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`layer_norm` of independent members stacked on dimension 0, in one launch.

    ``x`` is ``[M, ..., N]`` (or one input broadcast to every member), γ and β ``[N]`` (shared) or
    ``[M, N]``; each member's bits are a launch on that member alone. The norm forward kernels'
    batching rule for a batched γ or β (an ensemble under ``vmap``), which one launch of the plain
    kernel cannot index.
    """
    return _fwd(x, weight, bias, eps, "layer", zero_centered_gamma, members=True)


def rms_norm_members(x: Tensor, weight: Tensor, eps: float, zero_centered_gamma: bool) -> Tensor:
    """:func:`rms_norm` of independent members (see :func:`layer_norm_members`)."""
    return _fwd(x, weight, None, eps, "rms", zero_centered_gamma, members=True)


def layer_norm_bwd_members(
    dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor, zero_centered_gamma: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`layer_norm_bwd` of independent members stacked on dimension 0, in one launch.

    ``dy`` and ``x`` are ``[M, ..., N]``, the statistics ``[M, ...]``, γ ``[N]`` (shared) or ``[M, N]``;
    dγ and dβ are ``[M, N]``, each member's reduced as a call on that member alone reduces it. The
    norm backward kernels' batching rule: under ``vmap`` (per-example gradients, ``vmap(grad)``) a
    backward whose dγ summed every member's rows could not run as one launch of the plain kernel.
    """
    return _bwd(dy, x, weight, 0.0, "layer", zero_centered_gamma, True, stats=(mean, rstd), members=True)


def rms_norm_bwd_members(
    dy: Tensor, x: Tensor, weight: Tensor, eps: float, zero_centered_gamma: bool
) -> tuple[Tensor, Tensor]:
    """:func:`rms_norm_bwd` of independent members (see :func:`layer_norm_bwd_members`)."""
    dx, dw, _ = _bwd(dy, x, weight, eps, "rms", zero_centered_gamma, False, members=True)
    return dx, dw


def layer_norm_bwd_add_members(
    dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor, accum: Tensor, zero_centered_gamma: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`layer_norm_bwd_add` of independent members (see :func:`layer_norm_bwd_members`)."""
    return _bwd(dy, x, weight, 0.0, "layer", zero_centered_gamma, True, accum, (mean, rstd), members=True)


def rms_norm_bwd_add_members(
    dy: Tensor, x: Tensor, weight: Tensor, accum: Tensor, eps: float, zero_centered_gamma: bool
) -> tuple[Tensor, Tensor]:
    """:func:`rms_norm_bwd_add` of independent members (see :func:`layer_norm_bwd_members`)."""
    dx, dw, _ = _bwd(dy, x, weight, eps, "rms", zero_centered_gamma, False, accum, members=True)
    return dx, dw


def l2_normalize(x: Tensor, eps: float) -> Tensor:
    """``x / √(Σ_last x² + eps)``."""
    return _fwd(x, None, None, eps, "l2", False)


def l2_normalize_bwd(dy: Tensor, x: Tensor, eps: float) -> Tensor:
    """``dx`` of :func:`l2_normalize`."""
    return _bwd(dy, x, None, eps, "l2", False, False)[0]


# ----------------------------------------------------------------------------- PyTorch twins


def _gamma(w: Tensor, zero_centered: bool, acc: torch.dtype) -> Tensor:
    w = as_dtype(w, acc)
    return w + 1.0 if zero_centered else w


def _normalize(x: Tensor, eps: float, kind: str) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(x̂, r, mean or None)`` in x's (compute) dtype; r and mean keep the reduced dimension."""
    mean = None
    if kind == "layer":
        mean = x.mean(-1, keepdim=True)
        x = x - mean
    sq = (x * x).sum(-1, keepdim=True) if kind == "l2" else (x * x).mean(-1, keepdim=True)
    r = torch.rsqrt(sq + eps)
    return x * r, r, mean


def _dx(g: Tensor, xhat: Tensor, r: Tensor, kind: str) -> Tensor:
    """``dx = r·(g − mean(g) − x̂·mean(g·x̂))`` from ``g = dy·γ`` (see the module docstring)."""
    mean = (lambda t: t.sum(-1, keepdim=True)) if kind == "l2" else (lambda t: t.mean(-1, keepdim=True))
    if kind == "layer":
        g = g - mean(g)
    return (g - xhat * mean(g * xhat)) * r


def _grads(dy: Tensor, x: Tensor, w: Tensor | None, eps: float, kind: str) -> tuple[Tensor, Tensor]:
    """``(dx, x̂)`` in the compute dtype of RMSNorm or L2 normalization (w already the effective γ)."""
    xhat, r, _ = _normalize(x, eps, kind)
    return _dx(dy if w is None else dy * w, xhat, r, kind), xhat


def _column_sums(t: Tensor) -> Tensor:
    return rows_view(t).sum(0)  # (explicit row count: reshape(-1, n) of an empty vmapped batch is ambiguous)


def layer_norm_ref(
    x: Tensor, weight: Tensor, bias: Tensor | None, eps: float, zero_centered_gamma: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """PyTorch twin of :func:`layer_norm`."""
    acc = compute_dtype(x.dtype)
    if eager_cpu(x, weight, bias):
        # torch's fused LayerNorm computes in fp32 for low-precision inputs and rounds once; with
        # fp32 γ and β (1 + γ formed in fp32) it also returns fp32 statistics, which it does not
        # for bf16/fp16 parameters.
        if zero_centered_gamma or x.dtype != acc:
            weight, bias = _gamma(weight, zero_centered_gamma, acc), None if bias is None else bias.to(acc)
        # (torch.native_layer_norm and squeeze: the same kernel and views as torch.ops.aten's
        # overload and view(x.shape[:-1]) with ~5 us less Python dispatch at small sizes)
        if x.dtype != acc and x.numel() <= _fast.CHUNK_ELEMENTS:  # (see _recompute_cancelled_rows)
            y, mean, rstd = torch.native_layer_norm(x.to(acc), x.shape[-1:], weight, bias, eps)
            return y.to(x.dtype), mean.squeeze(-1), rstd.squeeze(-1)
        y, mean, rstd = torch.native_layer_norm(x, x.shape[-1:], weight, bias, eps)
        mean, rstd = mean.squeeze(-1), rstd.squeeze(-1)
        if x.dtype != torch.float64:
            threshold = _CANCELLING_FP32 if x.dtype == torch.float32 else _CANCELLING
            _recompute_cancelled_rows(y, x, mean, rstd, weight, bias, eps, threshold)
        return y, mean, rstd
    # (contiguous, as the fast path and the launcher write: the output's layout must not depend on
    # the route, compiled or not; see _kernel._OnContiguous)
    xhat, rstd, mean = _normalize(x.contiguous().to(acc), eps, "layer")
    y = xhat * _gamma(weight, zero_centered_gamma, acc)
    y = (y if bias is None else y + bias.to(acc)).to(x.dtype)  # (no bias: the norm kernels' HAS_B=False)
    return y, mean.squeeze(-1), rstd.squeeze(-1)


_CANCELLING = 256.0
"""|mean|·rstd above which torch's 16-bit LayerNorm loses accuracy (see _recompute_cancelled_rows)."""
_CANCELLING_FP32 = 8.0
"""The same for fp32 inputs: ~|mean|·rstd·2^-24 of error, so 5e-7 at 8 (3.7e-4 at a mean of 1e4 std)."""


def _recompute_cancelled_rows(
    y: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight, bias, eps: float, threshold: float
) -> None:
    """Rows of ``x`` whose mean is large against their spread (``|mean|·rstd > threshold``),
    normalized again in fp32 from ``x − mean`` into ``y``, their ``mean`` and ``rstd`` with them.

    torch's LayerNorm forms rstd·x − rstd·mean, which cancels to an error of ~ulp(|mean|·rstd), in
    its mixed-precision kernel and its fp32 one alike: a 16-bit row of a constant 3e4 (x − mean
    exactly 0, y exactly β) came out β + 0.44, and fp32 rows of std 1 came out 1.2e-5 of the largest
    output off float64 at a mean of 256, 3.7e-4 at 1e4, 3.8e-3 at 1e5 (a stop-35 fuzz), their rstd
    off with the variance; TE's kernel and functe's subtract the mean first. The redone rows are
    centred first (exact there), then normalized by the fp32 kernel, whose mean of the centred row
    refines the mean. Thresholds: 256 for 16-bit inputs (an absolute error above 2^-15: below it the
    cancellation still shows in the last bit of small outputs, measured on 1024-wide fp16 rows with
    |mean|·rstd = 255, 2.6% of elements 1 ulp from the correctly rounded value, 0.01% at mean 0, all
    inside the fp16 tolerance), 8 for fp32 (5e-7). Usually no row qualifies and the check costs one
    pass over the statistics. (Small 16-bit inputs take the fp32 kernel whole instead, unchecked:
    its error, ~|mean|·rstd·2^-24, stays below half a 16-bit ulp while |mean|·rstd < 2^15.)
    """
    # (a comparison, not the max: one NaN row made the max NaN and left every row as it was)
    if mean.numel() <= 64:  # (in Python: the test below costs ~9 µs on a tiny input, of any rank)
        means, rstds = (mean, rstd) if mean.dim() == 1 else (mean.reshape(-1), rstd.reshape(-1))
        if all(abs(m) * r <= threshold for m, r in zip(means.tolist(), rstds.tolist())):  # (NaN: the test decides)
            return
    cancelling = torch.mul(mean.abs(), rstd).view(-1) > threshold
    if not bool(cancelling.any()):
        return
    rows = torch.nonzero(cancelling).view(-1)
    x_rows, y_rows = x.reshape(-1, x.shape[-1]), y.view(-1, x.shape[-1])
    centred = x_rows[rows].float().sub_(mean.reshape(-1, 1)[rows])
    redone, redone_mean, redone_rstd = torch.native_layer_norm(centred, x.shape[-1:], weight, bias, eps)
    y_rows[rows] = redone.to(y.dtype)
    mean.view(-1)[rows] += redone_mean.view(-1).to(mean.dtype)
    rstd.view(-1)[rows] = redone_rstd.view(-1).to(rstd.dtype)


def _member_param(t: Tensor, x: Tensor) -> Tensor:
    """A γ or β broadcast over x's rows: ``[N]`` shared, or ``[M, N]`` (one per member of
    ``x [M, ..., N]``) viewed as ``[M, 1, ..., 1, N]``."""
    return t if t.dim() == 1 else t.view(t.shape[0], *([1] * (x.dim() - 2)), t.shape[1])


def _member_gamma(w: Tensor, x: Tensor, zero_centered: bool, acc: torch.dtype) -> Tensor:
    """The effective γ (see :func:`_member_param`)."""
    return _member_param(_gamma(w, zero_centered, acc), x)


def _member_sums(t: Tensor) -> Tensor:
    """Σ over each member's rows: ``[M, ..., N]`` -> ``[M, N]`` (explicit counts: M may be 0)."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:-1]), t.shape[-1]).sum(1)


def _layer_norm_grads(
    dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor, zero_centered: bool, members: bool = False
):
    """``(dx, dγ, dβ)`` of LayerNorm from its statistics, in the compute dtype (the reference path);
    ``members``: dγ and dβ per member of x's dimension 0 (see :func:`layer_norm_bwd_members`)."""
    acc = compute_dtype(x.dtype)
    dy_a, r = dy.to(acc), rstd.to(acc)[..., None]
    xhat = (x.contiguous().to(acc) - mean.to(acc)[..., None]) * r  # (see layer_norm_ref)
    dx = _dx(dy_a * _member_gamma(weight, x, zero_centered, acc), xhat, r, "layer")
    sums = _member_sums if members else _column_sums
    return dx, sums(dy_a * xhat), sums(dy_a)


def layer_norm_bwd_ref(
    dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor, zero_centered_gamma: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """PyTorch twin of :func:`layer_norm_bwd`."""
    if eager_cpu(dy, x, mean, rstd, weight):
        return _layer_norm_bwd_fast(dy, x, mean, rstd, weight, zero_centered_gamma)
    dx, dw, db = _layer_norm_grads(dy, x, mean, rstd, weight, zero_centered_gamma)
    return dx.to(x.dtype), dw.to(weight.dtype), db.to(x.dtype)


def layer_norm_bwd_add_ref(
    dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor, accum: Tensor, zero_centered_gamma: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """PyTorch twin of :func:`layer_norm_bwd_add`."""
    if eager_cpu(dy, x, mean, rstd, weight, accum):
        return _layer_norm_bwd_fast(dy, x, mean, rstd, weight, zero_centered_gamma, accum)
    dx, dw, db = _layer_norm_grads(dy, x, mean, rstd, weight, zero_centered_gamma)
    return (dx + accum.to(dx.dtype)).to(x.dtype), dw.to(weight.dtype), db.to(x.dtype)


def layer_norm_bwd_members_ref(
    dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor, zero_centered_gamma: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """PyTorch twin of :func:`layer_norm_bwd_members`."""
    dx, dw, db = _layer_norm_grads(dy, x, mean, rstd, weight, zero_centered_gamma, members=True)
    return dx.to(x.dtype), dw.to(weight.dtype), db.to(x.dtype)


def layer_norm_bwd_add_members_ref(
    dy: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor, accum: Tensor, zero_centered_gamma: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """PyTorch twin of :func:`layer_norm_bwd_add_members`."""
    dx, dw, db = _layer_norm_grads(dy, x, mean, rstd, weight, zero_centered_gamma, members=True)
    return (dx + accum.to(dx.dtype)).to(x.dtype), dw.to(weight.dtype), db.to(x.dtype)


def layer_norm_members_ref(
    x: Tensor, weight: Tensor, bias: Tensor, eps: float, zero_centered_gamma: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """PyTorch twin of :func:`layer_norm_members`."""
    acc = compute_dtype(x.dtype)
    xhat, rstd, mean = _normalize(_one_member(x).to(acc), eps, "layer")
    y = (xhat * _member_gamma(weight, x, zero_centered_gamma, acc) + _member_param(bias.to(acc), x)).expand(x.shape)
    stats = x.shape[:-1]
    return y.to(x.dtype), mean.squeeze(-1).expand(stats).contiguous(), rstd.squeeze(-1).expand(stats).contiguous()


def _one_member(x: Tensor) -> Tensor:
    """x, or its one member when every member shares it (stride 0: an ensemble's common input,
    normalized once and broadcast against the members' γ instead of once per member)."""
    return x[:1] if x.dim() >= 2 and x.shape[0] > 1 and x.stride(0) == 0 else x


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float, zero_centered_gamma: bool) -> Tensor:
    """PyTorch twin of :func:`rms_norm`."""
    acc = compute_dtype(x.dtype)
    gamma = _gamma(weight, zero_centered_gamma, acc)
    if eager_cpu(x, weight):
        return _rms_fwd_fast(x, gamma, eps, "rms")
    xhat, _, _ = _normalize(x.contiguous().to(acc), eps, "rms")  # (see layer_norm_ref)
    return (xhat * gamma).to(x.dtype)


def rms_norm_members_ref(x: Tensor, weight: Tensor, eps: float, zero_centered_gamma: bool) -> Tensor:
    """PyTorch twin of :func:`rms_norm_members`."""
    acc = compute_dtype(x.dtype)
    xhat, _, _ = _normalize(_one_member(x).to(acc), eps, "rms")
    return (xhat * _member_gamma(weight, x, zero_centered_gamma, acc)).expand(x.shape).to(x.dtype)


def rms_norm_bwd_ref(
    dy: Tensor, x: Tensor, weight: Tensor, eps: float, zero_centered_gamma: bool
) -> tuple[Tensor, Tensor]:
    """PyTorch twin of :func:`rms_norm_bwd`."""
    acc = compute_dtype(x.dtype)
    if eager_cpu(dy, x, weight):
        dx, dw = _rms_bwd_fast(dy, x, _gamma(weight, zero_centered_gamma, acc), eps, "rms")
        return dx, dw.to(weight.dtype)
    dx, dw = _rms_grads(dy, x, weight, eps, zero_centered_gamma)
    return dx.to(x.dtype), dw


def rms_norm_bwd_add_ref(
    dy: Tensor, x: Tensor, weight: Tensor, accum: Tensor, eps: float, zero_centered_gamma: bool
) -> tuple[Tensor, Tensor]:
    """PyTorch twin of :func:`rms_norm_bwd_add`."""
    acc = compute_dtype(x.dtype)
    if eager_cpu(dy, x, weight, accum):
        dx, dw = _rms_bwd_fast(dy, x, _gamma(weight, zero_centered_gamma, acc), eps, "rms", accum)
        return dx, dw.to(weight.dtype)
    dx, dw = _rms_grads(dy, x, weight, eps, zero_centered_gamma)
    return (dx + accum.to(dx.dtype)).to(x.dtype), dw


def _rms_grads(dy: Tensor, x: Tensor, weight: Tensor, eps: float, zero_centered: bool, members: bool = False):
    """``(dx in the compute dtype, dγ in γ's dtype)`` of RMSNorm (the reference path); ``members``: dγ
    per member of x's dimension 0 (see :func:`layer_norm_bwd_members`)."""
    acc = compute_dtype(x.dtype)
    dy_a = dy.to(acc)
    dx, xhat = _grads(dy_a, x.contiguous().to(acc), _member_gamma(weight, x, zero_centered, acc), eps, "rms")
    return dx, (_member_sums if members else _column_sums)(dy_a * xhat).to(weight.dtype)


def rms_norm_bwd_members_ref(
    dy: Tensor, x: Tensor, weight: Tensor, eps: float, zero_centered_gamma: bool
) -> tuple[Tensor, Tensor]:
    """PyTorch twin of :func:`rms_norm_bwd_members`."""
    dx, dw = _rms_grads(dy, x, weight, eps, zero_centered_gamma, members=True)
    return dx.to(x.dtype), dw


def rms_norm_bwd_add_members_ref(
    dy: Tensor, x: Tensor, weight: Tensor, accum: Tensor, eps: float, zero_centered_gamma: bool
) -> tuple[Tensor, Tensor]:
    """PyTorch twin of :func:`rms_norm_bwd_add_members`."""
    dx, dw = _rms_grads(dy, x, weight, eps, zero_centered_gamma, members=True)
    return (dx + accum.to(dx.dtype)).to(x.dtype), dw


def l2_normalize_ref(x: Tensor, eps: float) -> Tensor:
    """PyTorch twin of :func:`l2_normalize`."""
    if eager_cpu(x):
        return _rms_fwd_fast(x, None, eps, "l2")
    return _normalize(x.contiguous().to(compute_dtype(x.dtype)), eps, "l2")[0].to(x.dtype)  # (see layer_norm_ref)


def l2_normalize_bwd_ref(dy: Tensor, x: Tensor, eps: float) -> Tensor:
    """PyTorch twin of :func:`l2_normalize_bwd`."""
    if eager_cpu(dy, x):
        return _rms_bwd_fast(dy, x, None, eps, "l2")[0]
    acc = compute_dtype(x.dtype)
    return _grads(dy.to(acc), x.contiguous().to(acc), None, eps, "l2")[0].to(x.dtype)  # (see layer_norm_ref)


# ----------------------------------------------------------------------------- CPU fast path
#
# The same formulas on cache-sized row chunks (see functe.kernels._fast); dγ/dβ are per-chunk fp32
# partial sums added in chunk order. LayerNorm's backward runs torch's fused
# native_layer_norm_backward with the forward's statistics (see _layer_norm_bwd_fast).


def _reduce_partials(parts: dict[int, Tensor], count: int, n_cols: int, acc: torch.dtype) -> Tensor:
    """Per-chunk partial sums added in chunk order (deterministic)."""
    if not count:
        return torch.zeros(n_cols, dtype=acc, device="cpu")
    return torch.stack([parts[i] for i in range(count)]).sum(0)


def _rstd(xt: Tensor, kind: str, eps: float, scratch: Tensor) -> Tensor:
    """1/√(mean or sum of squares + eps) per row (RMSNorm, L2); ``scratch``: a buffer of ``xt``'s shape.

    The squares are summed by ``sum`` (a cascade: ~4e-7 relative in fp32 at any length), not by
    ``torch.linalg.vector_norm``, twice as fast but a running sum on the CPU: 5e-6 relative on
    4,096 equal fp32 entries, 1.2e-4 on 140,000 (TE's fp32 rtol is 1.3e-6).
    """
    sq = torch.mul(xt, xt, out=scratch).sum(-1, keepdim=True)
    return (sq if kind == "l2" else sq.div_(xt.shape[-1])).add_(eps).rsqrt_()


def _rows(*tensors: Tensor) -> list[Tensor]:
    return [rows_view(t) for t in tensors]  # (2-D tensors as they are: a reshape costs a dispatch)


def _rms_fwd_fast(x, gamma, eps, kind):
    rows, y = x.reshape(-1, x.shape[-1]), torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y_rows = y.view(rows.shape)

    def body(_, sl, buf):
        xt = buf.upcast("x", rows[sl])
        out = buf.get("out", sl.stop - sl.start)
        out = torch.mul(xt, _rstd(xt, kind, eps, scratch=out), out=out)
        y_rows[sl].copy_(out if gamma is None else out.mul_(gamma))

    parallel_chunks(rows.shape[0], rows.shape[1:], compute_dtype(x.dtype), body)
    return y


def _layer_norm_bwd_fast(dy, x, mean, rstd, weight, zero_centered, accum=None):
    """LayerNorm's backward from its statistics with torch's fused kernel, in the compute dtype.

    fp32/fp64 x: one whole-tensor call (measured at 8192x4096: per-chunk calls are ~1.3x slower).
    bf16/fp16 x: torch's mixed-precision kernel accumulates dγ/dβ with 16-bit accuracy (7% relative
    error at 8192 rows, and 0.5% already for 32-row calls, even with fp32 γ), so each chunk of rows is
    upcast and runs the fp32 kernel, and the per-chunk dγ/dβ are added in chunk order. (Measured at
    8192x4096 bf16: 48 ms, against 58 ms for the 16-bit kernel's dx plus a separate fp32 reduction
    pass for dγ/dβ, and 37 ms for torch eager's inexact 16-bit backward.)

    The kernel forms x̂ = rstd·x − rstd·mean in one FMA, which cancels where |mean|·rstd is large (an
    N = 1 row, whose x̂ is exactly 0, got dγ = 0.48; rows of a constant 1e4 a 2% dx error). The
    16-bit chunks and every input of one chunk or less therefore pass x − mean (formed in the
    upcast's own pass) with a zero mean: exact as the Triton kernel. Only large fp32/fp64 inputs keep
    torch eager's formula (centering them costs a second full pass: 47 -> 93 ms at 8192x4096).
    """
    acc = compute_dtype(x.dtype)
    rows, dy_rows = _rows(x, dy)
    acc_rows = None if accum is None else accum.reshape(rows.shape)
    n_rows, n = rows.shape
    # (contiguous: torch's kernel reads the statistics as if they were, and a strided view of them
    # gave wrong dx silently)
    mean = as_dtype(mean.reshape(n_rows, 1), acc).contiguous()
    rstd = as_dtype(rstd.reshape(n_rows, 1), acc).contiguous()
    gamma = _gamma(weight, zero_centered, acc)
    # A β argument only makes the kernel return dβ (its values never enter the backward): γ stands in,
    # saving a zeros allocation per call.
    beta = gamma
    small = rows.numel() <= _fast.CHUNK_ELEMENTS  # (read per call: tests shrink it)
    if small or x.dtype == acc:  # one call: on x − mean with a zero mean when small (see the docstring)
        xs, ms = (torch.sub(rows, mean), torch.zeros_like(mean)) if small else (rows, mean)
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(
            as_dtype(dy_rows, acc), xs, [n], ms, rstd, gamma, beta, [True, True, True]
        )
        if acc_rows is not None:
            dx = dx.add_(acc_rows)
        return shaped(as_dtype(dx, x.dtype), x.shape), as_dtype(dw, weight.dtype), as_dtype(db, x.dtype)
    dx = torch.empty_like(rows)
    dw_parts, db_parts = {}, {}
    zero_mean = torch.zeros_like(mean)

    def body(i, sl, buf):
        # (the upcast, then the mean subtracted in the cached copy: a broadcasting out= sub reading
        # the 16-bit rows was slower than the two, 13 against 11 ms a thread at 8192x4096)
        xt = buf.upcast("x", rows[sl]).sub_(mean[sl])
        g = buf.upcast("dy", dy_rows[sl])
        dx_c, dw_parts[i], db_parts[i] = torch.ops.aten.native_layer_norm_backward(
            g, xt, [n], zero_mean[sl], rstd[sl], gamma, beta, [True, True, True]
        )
        dx[sl].copy_(dx_c if acc_rows is None else dx_c.add_(acc_rows[sl]))

    # (chunks of twice the usual rows: the kernel's dγ/dβ pass costs per call)
    count = parallel_chunks(n_rows, (n,), acc, body, chunk_scale=2)
    dw = _reduce_partials(dw_parts, count, n, acc).to(weight.dtype)
    return shaped(dx, x.shape), dw, _reduce_partials(db_parts, count, n, acc).to(x.dtype)


def _rms_bwd_fast(dy, x, gamma, eps, kind, accum=None):
    """``(dx, dγ in the compute dtype or None)`` of RMSNorm (γ given) or L2 normalization (γ None);
    ``accum`` is added to dx before its rounding."""
    acc = compute_dtype(x.dtype)
    rows, dy_rows = _rows(x, dy)
    acc_rows = None if accum is None else accum.reshape(rows.shape)
    n_rows, n = rows.shape
    dx = torch.empty_like(rows)
    reduce = (lambda t: t.sum(-1, keepdim=True)) if kind == "l2" else (lambda t: t.mean(-1, keepdim=True))
    dw_parts = {}

    def body(i, sl, buf):
        m = sl.stop - sl.start
        xt, dyt = buf.upcast("x", rows[sl]), buf.upcast("dy", dy_rows[sl])
        tmp = buf.get("tmp", m)
        r = _rstd(xt, kind, eps, scratch=tmp)
        xhat = torch.mul(xt, r, out=buf.get("xhat", m))
        g = dyt if gamma is None else torch.mul(dyt, gamma, out=buf.get("g", m))
        c = reduce(torch.mul(g, xhat, out=tmp))
        out = torch.addcmul(g, xhat, c, value=-1.0, out=tmp).mul_(r)
        dx[sl].copy_(out if acc_rows is None else out.add_(acc_rows[sl]))
        if gamma is not None:
            dw_parts[i] = torch.mul(dyt, xhat, out=tmp).sum(0)

    count = parallel_chunks(n_rows, (n,), acc, body)
    dw = None if gamma is None else _reduce_partials(dw_parts, count, n, acc)
    return shaped(dx, x.shape), dw


def _members_kernel(launcher, twin, params: tuple[int, ...]) -> Kernel:
    """A ``*_members`` kernel: no CPU fast path (its twin is the formula), and under a further vmap
    (an ensemble of ensembles) the outer level folds into its members, γ (and β) at ``params``."""
    return Kernel(launcher.__name__, launcher, twin, batch=FoldMembers(params), fast_path=False)


# Forward kernels batch over rows; a batched γ or β (an ensemble) runs the ``*_members`` kernel.
# The backward kernels reduce over rows into dγ/dβ: a vmapped call runs the ``*_members`` kernel, one
# launch whose dγ (and dβ) stay per member (vmap(grad): per-example gradients of γ, or an ensemble).
LAYER_NORM_MEMBERS = _members_kernel(layer_norm_members, layer_norm_members_ref, (1, 2))
RMS_NORM_MEMBERS = _members_kernel(rms_norm_members, rms_norm_members_ref, (1,))
LAYER_NORM = Kernel("layer_norm", layer_norm, layer_norm_ref, batch=Rowwise(params=(1, 2), members=LAYER_NORM_MEMBERS))
RMS_NORM = Kernel("rms_norm", rms_norm, rms_norm_ref, batch=Rowwise(params=(1,), members=RMS_NORM_MEMBERS))
LAYER_NORM_BWD_MEMBERS = _members_kernel(layer_norm_bwd_members, layer_norm_bwd_members_ref, (4,))
RMS_NORM_BWD_MEMBERS = _members_kernel(rms_norm_bwd_members, rms_norm_bwd_members_ref, (2,))
LAYER_NORM_BWD_ADD_MEMBERS = _members_kernel(layer_norm_bwd_add_members, layer_norm_bwd_add_members_ref, (4,))
RMS_NORM_BWD_ADD_MEMBERS = _members_kernel(rms_norm_bwd_add_members, rms_norm_bwd_add_members_ref, (2,))
LAYER_NORM_BWD = Kernel(
    "layer_norm_bwd", layer_norm_bwd, layer_norm_bwd_ref, batch=Members(LAYER_NORM_BWD_MEMBERS, params=(4,))
)
RMS_NORM_BWD = Kernel("rms_norm_bwd", rms_norm_bwd, rms_norm_bwd_ref, batch=Members(RMS_NORM_BWD_MEMBERS, params=(2,)))
LAYER_NORM_BWD_ADD = Kernel(
    "layer_norm_bwd_add",
    layer_norm_bwd_add,
    layer_norm_bwd_add_ref,
    batch=Members(LAYER_NORM_BWD_ADD_MEMBERS, params=(4,)),
)
RMS_NORM_BWD_ADD = Kernel(
    "rms_norm_bwd_add", rms_norm_bwd_add, rms_norm_bwd_add_ref, batch=Members(RMS_NORM_BWD_ADD_MEMBERS, params=(2,))
)
L2_NORMALIZE = Kernel("l2_normalize", l2_normalize, l2_normalize_ref, batch=Rowwise())
L2_NORMALIZE_BWD = Kernel("l2_normalize_bwd", l2_normalize_bwd, l2_normalize_bwd_ref, batch=Rowwise())
