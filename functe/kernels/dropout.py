"""Dropout with explicit randomness: a counter-based hash of (seed, element index).

The mask is a pure function of the seed and of each element's flat (row-major)
index, so it is never stored: the backward pass recomputes it, and dropout is
its own vector-Jacobian product (``dx = dropout(dy)`` with the same seed).

The same hash is written three times, and the three agree bit for bit (tested):
in Triton on ``uint32``, in torch on ``int32`` tensors holding the same bit
patterns (wrapping multiplication, logical shifts emulated with a mask), and in
plain Python integers (the test oracle, and the per-chunk keys of the CPU fast
path). So the CPU twin and the Triton kernel drop exactly the same elements.

Specification (all arithmetic modulo 2^32)::

    mix(v)   = v ^= v >> 16; v *= 0x7FEB352D; v ^= v >> 15; v *= 0x846CA68B; v ^= v >> 16
    key      = mix(hi32(seed) ^ mix(lo32(seed) ^ 0x9E3779B9))        (seed: int64)
    i        = 2^32·ih + il                                          (element index)
    bits(i)  = mix(mix(il ^ mix(key ^ mix(ih))) + key)
    keep(i)  = int32(bits(i)) >= floor(p·2^32) − 2^31                 (probability 1 − p)
    y        = x · (keep ? scale : 0),   scale = 1/(1 − p) rounded to fp32

``mix`` is Chris Wellons' ``lowbias32``, a bijection with full avalanche. The
key enters twice, so the streams of two seeds are not shifts of each other.
``x·0`` keeps NaN and makes inf NaN at dropped positions, as ``torch`` does.

The kernel takes ``seed`` of shape ``x.shape[:seed.dim()]``: each index of
those leading dimensions is a *group* with its own seed and its own element
count starting at 0. A 0-d seed is one group (the whole tensor); under
``vmap`` the batch dimension becomes a group, so a batched seed gives each
member its own mask and an unbatched one gives every member the same mask
(the function applied per member).
"""

from __future__ import annotations

import math
import struct

import torch
import triton.language as tl

from .._errors import describe, dtype_error, shape_error
from .._kernel import Kernel, Rowwise
from . import _fast
from ._common import compute_dtype, tl_compute_dtype
from ._fast import eager_cpu
from ._triton import ELEMENTWISE_BLOCK, cdiv, jit

Tensor = torch.Tensor

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def threshold(p: float) -> int:
    """The signed 32-bit threshold of ``keep``: ``floor(p·2^32) − 2^31``."""
    return min(math.floor(p * 2.0**32), 2**32 - 1) - 2**31


@torch.compiler.assume_constant_result  # Dynamo folds it instead of tracing struct
def scale(p: float) -> float:
    """``1/(1 − p)`` rounded to fp32 (the value every implementation multiplies by)."""
    return struct.unpack("f", struct.pack("f", 1.0 / (1.0 - p)))[0]


# ----------------------------------------------------------------------------- Python integers (oracle)


def mix_int(v: int) -> int:
    """``mix`` on a Python int in [0, 2^32)."""
    v ^= v >> 16
    v = (v * 0x7FEB352D) & _M32
    v ^= v >> 15
    v = (v * 0x846CA68B) & _M32
    return v ^ (v >> 16)


def key_int(seed: int) -> int:
    """The 32-bit key of a 64-bit seed."""
    seed &= (1 << 64) - 1
    return mix_int((seed >> 32) ^ mix_int((seed & _M32) ^ _GOLDEN))


def keep_int(seed: int, index: int, p: float) -> bool:
    """Whether element ``index`` survives dropout with ``seed`` (the specification, one element at a time)."""
    key = key_int(seed)
    bits = mix_int((mix_int((index & _M32) ^ mix_int(key ^ mix_int(index >> 32))) + key) & _M32)
    signed = bits - (1 << 32) if bits >= 1 << 31 else bits
    return signed >= threshold(p)


# ----------------------------------------------------------------------------- Triton


@jit
def mix(v):
    """``mix`` on a ``uint32`` tensor or scalar."""
    v = v ^ (v >> 16)
    v = v * 0x7FEB352D
    v = v ^ (v >> 15)
    v = v * 0x846CA68B
    return v ^ (v >> 16)


@jit
def seed_key(seed):
    """The ``uint32`` key of an int64 seed (a scalar loaded from memory)."""
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    return mix(hi ^ mix(lo ^ 0x9E3779B9))


@jit
def keep_mask(key, start, index, thresh):
    """``keep`` for the int64 element indices ``index`` of a block starting at ``start``.

    The block must not cross a multiple of 2^32 (true for power-of-two blocks),
    so one block key serves all its elements.
    """
    block_key = mix(key ^ mix((start >> 32).to(tl.uint32)))
    bits = mix(mix((index & 0xFFFFFFFF).to(tl.uint32) ^ block_key) + key)
    return bits.to(tl.int32, bitcast=True) >= thresh


@jit
def _dropout_kernel(
    X, SEED, Y, group_numel, blocks_per_group, thresh, scale, BLOCK: tl.constexpr, COMPUTE: tl.constexpr
):
    pid = tl.program_id(0)
    group = pid // blocks_per_group
    start = (pid % blocks_per_group).to(tl.int64) * BLOCK
    index = start + tl.arange(0, BLOCK)
    mask = index < group_numel
    offs = group.to(tl.int64) * group_numel + index
    keep = keep_mask(seed_key(tl.load(SEED + group)), start, index, thresh)
    x = tl.load(X + offs, mask=mask, other=0.0).to(COMPUTE)
    y = x * tl.where(keep, scale, 0.0).to(COMPUTE)
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


def check_seed_dtype(op: str, seed: Tensor) -> None:
    """An int64 seed tensor (the kernels read 64-bit seeds: an int32 one crashed the interpreter and
    read past it on a GPU; the ops pass int64)."""
    if seed.dtype != torch.int64:
        raise dtype_error(op, "seed", "an i64 tensor", seed)


def dropout(x: Tensor, seed: Tensor, p: float) -> Tensor:
    """``x`` with elements dropped with probability ``p`` and the rest scaled by 1/(1 − p).

    ``seed`` is an int64 tensor of shape ``x.shape[:seed.dim()]`` (one seed per group).
    """
    check_seed_dtype("dropout", seed)
    if seed.shape != x.shape[: seed.dim()]:  # (groups split x by seed.numel(): a rest went unwritten)
        raise shape_error(
            "dropout", "seed", f"an i64 tensor of shape x.shape[:{seed.dim()}]", seed, f"x is {describe(x)}"
        )
    flat = x.contiguous()
    y = torch.empty_like(flat)
    groups = seed.numel()
    if flat.numel():
        group_numel = flat.numel() // groups
        blocks = cdiv(group_numel, ELEMENTWISE_BLOCK)
        _dropout_kernel[(groups * blocks,)](
            flat,
            seed.contiguous(),
            y,
            group_numel,
            blocks,
            threshold(p),
            scale(p),
            BLOCK=ELEMENTWISE_BLOCK,
            COMPUTE=tl_compute_dtype(x.dtype),
        )
    return y


# ----------------------------------------------------------------------------- torch (int32 bit patterns)


def _i32(v: int) -> int:
    """The int32 with the bit pattern of ``v`` in [0, 2^32)."""
    return v - (1 << 32) if v >= 1 << 31 else v


_MUL1, _MUL2, _GOLDEN32 = _i32(0x7FEB352D), _i32(0x846CA68B), _i32(_GOLDEN)


def mix_torch(v: Tensor) -> Tensor:
    """``mix`` on an int32 tensor (multiplication wraps; ``&`` turns the arithmetic shifts logical)."""
    v = v ^ ((v >> 16) & 0xFFFF)
    v = v * _MUL1
    v = v ^ ((v >> 15) & 0x1FFFF)
    v = v * _MUL2
    return v ^ ((v >> 16) & 0xFFFF)


def _mix_(v: Tensor, t: Tensor) -> None:
    """In-place :func:`mix_torch` with scratch ``t`` (the CPU fast path)."""
    for shift, mask, mul in ((16, 0xFFFF, _MUL1), (15, 0x1FFFF, _MUL2)):
        torch.bitwise_right_shift(v, shift, out=t)
        t &= mask
        v ^= t
        v *= mul
    torch.bitwise_right_shift(v, 16, out=t)
    t &= 0xFFFF
    v ^= t


def _keys(seed: Tensor) -> Tensor:
    """int32 keys of int64 seeds."""
    lo = (seed & 0xFFFFFFFF).to(torch.int32)
    hi = (seed >> 32).to(torch.int32)
    return mix_torch(hi ^ mix_torch(lo ^ _GOLDEN32))


def _keep(seed: Tensor, shape: torch.Size, p: float) -> Tensor:
    """The boolean keep mask for an input of ``shape`` (functional: works under every transform)."""
    inner = shape[seed.dim() :]
    n = math.prod(inner)
    key = _keys(seed).reshape((*seed.shape, *([1] * len(inner))))  # (a tuple: a 0-d seed and x give ())
    index = torch.arange(n, dtype=torch.int64 if n > 2**31 else torch.int32, device=seed.device).view(inner)
    high = (index >> 32).to(torch.int32) if n > 2**32 else torch.zeros((), dtype=torch.int32, device=seed.device)
    bits = mix_torch(mix_torch(index.to(torch.int32) ^ mix_torch(key ^ mix_torch(high))) + key)
    return bits >= threshold(p)


def _dropout_fast(x: Tensor, seed: Tensor, p: float) -> Tensor:
    """The CPU fast path: per-chunk keys as Python ints, in-place int32 ops on cache-sized chunks."""
    if not x.numel():  # (a vmap over zero members has zero seeds: no row count to view by)
        return torch.empty_like(x)
    flat = x.contiguous().view(seed.numel(), -1)
    # (written through a view: a view output costs an un-viewing)
    result = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y = result.view(flat.shape)
    n = flat.shape[1]
    size = _fast.CHUNK_ELEMENTS  # a power of two: a chunk never crosses a 2^32 index boundary
    blocks = -(-n // size)
    keys = [key_int(v) for v in seed.reshape(-1).tolist()]
    thresh, factor = threshold(p), scale(p)
    base = torch.arange(min(size, n), dtype=torch.int32, device=x.device)

    def body(i, _, buf):
        g, start = divmod(i, blocks)
        start *= size
        m = min(size, n - start)
        v, t = buf.get("v", 1, torch.int32)[0, :m], buf.get("t", 1, torch.int32)[0, :m]
        keep = buf.get("keep", 1, torch.bool)[0, :m]
        key = keys[g]
        torch.add(base[:m], _i32(start & _M32), out=v)
        v ^= _i32(mix_int(key ^ mix_int(start >> 32)))
        _mix_(v, t)
        v += _i32(key)
        _mix_(v, t)
        out = y[g, start : start + m]
        torch.mul(flat[g, start : start + m], torch.ge(v, thresh, out=keep), out=out).mul_(factor)

    if n:
        _fast.parallel_chunks(len(keys) * blocks, (size,), torch.int32, body)
    return result


def dropout_ref(x: Tensor, seed: Tensor, p: float) -> Tensor:
    """PyTorch twin of :func:`dropout` (the same mask, bit for bit)."""
    check_seed_dtype("dropout", seed)
    if eager_cpu(x, seed):
        return _dropout_fast(x, seed, p)
    acc = compute_dtype(x.dtype)
    factor = torch.where(_keep(seed, x.shape, p), scale(p), 0.0).to(acc)
    return (x.contiguous().to(acc) * factor).to(x.dtype)  # (contiguous, as the fast path: see activation_ref)


# Both arguments are row data: under vmap the batch dimension becomes one more
# leading (group) dimension of x and of the seed.
DROPOUT = Kernel("dropout", dropout, dropout_ref, batch=Rowwise())
