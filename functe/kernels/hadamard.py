"""Counter-based random bits for quantization, and the random Hadamard transform (RHT).

**Random bits.** Block-scaled quantization needs randomness twice: the signs of the random
Hadamard transform and the coin flips of stochastic rounding. Both come from the counter-based
hash of :mod:`functe.kernels.dropout` (same ``mix``, same key derivation, same per-element
formula), so the Triton kernels and the PyTorch twins draw the same bits for the same seed, and
nothing depends on a global RNG::

    key     = mix(hi32(seed) ^ mix(lo32(seed) ^ 0x9E3779B9))
    bits(i) = mix(mix(lo32(i) ^ mix(key ^ mix(hi32(i)))) + key)        (i: int64 element index)

**RHT.** NVFP4 multiplies every 16 consecutive values of a row by ``Q = diag(s) · H16 / 4``,
``H16`` the Sylvester Hadamard matrix and ``s_i = ±1`` the sign of ``bits(i)`` for
``i = 0..15`` (one sign vector per seed, shared by every block, as TransformerEngine shares its
fixed sign vector). ``Q`` is orthogonal (``Q Qᵀ = I``): applying it to both operands of a GEMM
along the reduction dimension leaves the product unchanged while spreading outliers over 16
values. ``y = x Q`` is computed as ``WHT(x ∘ s) / 4`` with the fast Walsh-Hadamard butterfly
(four stages of ``(a + b, a − b)`` on pairs ``j, j ^ h``); the inverse is ``x = s ∘ WHT(y) / 4``.
Kernel and twin run the same butterfly, so they agree bit for bit.
"""

from __future__ import annotations

import torch
import triton.language as tl

from .._errors import describe_shape, shape_error
from .._kernel import Kernel
from ._common import as_rows, compute_dtype, tl_compute_dtype
from ._triton import cdiv, jit
from .dropout import _i32, _keys, _mix_, check_seed_dtype, key_int, mix, mix_int, mix_torch, seed_key

Tensor = torch.Tensor

RHT_SIZE = 16


# ----------------------------------------------------------------------------- random bits


@jit
def random_bits(key, index):
    """``bits(index)`` (uint32) for int64 element indices and a ``uint32`` key from :func:`seed_key`."""
    hi = mix(key ^ mix((index >> 32).to(tl.uint32)))
    return mix(mix((index & 0xFFFFFFFF).to(tl.uint32) ^ hi) + key)


@jit
def uniform24(bits):
    """A uniform float32 in [0, 1) on the 2^-24 grid from the top 24 of 32 random bits."""
    return (bits >> 8).to(tl.float32) * 5.960464477539063e-08


def random_bits_ref(seed: Tensor, index: Tensor) -> Tensor:
    """Twin of :func:`random_bits`: int32 tensors holding the uint32 bit patterns."""
    key = _keys(seed)
    hi = mix_torch(key ^ mix_torch((index >> 32).to(torch.int32)))
    return mix_torch(mix_torch(index.to(torch.int32) ^ hi) + key)


def random_bits_fast(seed: int, start: int, n: int) -> Tensor:
    """``bits(start .. start + n - 1)`` for a Python int seed: the CPU fast path (in-place int32 ops).

    Within one 2^32 block of indices the high word's part of the hash is one Python int, as in
    dropout's fast path; across a boundary it falls back to :func:`random_bits_ref`.
    """
    if (start >> 32) != ((start + max(n, 1) - 1) >> 32):
        index = torch.arange(start, start + n, dtype=torch.int64, device="cpu")
        return random_bits_ref(torch.tensor(seed, dtype=torch.int64, device="cpu"), index)
    key = key_int(seed)
    v = torch.arange(n, dtype=torch.int32, device="cpu")
    v += _i32(start & 0xFFFFFFFF)  # int32 wraps: the low word of the index
    v ^= _i32(mix_int(key ^ mix_int(start >> 32)))
    t = torch.empty_like(v)
    _mix_(v, t)
    v += _i32(key)
    _mix_(v, t)
    return v


def uniform24_ref(bits: Tensor) -> Tensor:
    """Twin of :func:`uniform24`."""
    return ((bits >> 8) & 0xFFFFFF).to(torch.float32) * 2.0**-24


def rht_signs(seed: Tensor) -> Tensor:
    """The 16 signs (``f32[16]`` of ±1) of the RHT for an int64 ``seed``."""
    bits = random_bits_ref(seed, torch.arange(RHT_SIZE, dtype=torch.int64, device=seed.device))
    return torch.where(bits < 0, -1.0, 1.0).to(torch.float32)


def rht_matrix(seed: Tensor) -> Tensor:
    """``Q = diag(s) · H16 / 4`` as a float64 matrix (what the transform multiplies rows by)."""
    i = torch.arange(RHT_SIZE, device="cpu")
    parity = torch.zeros(RHT_SIZE, RHT_SIZE, dtype=torch.int64, device="cpu")
    both = i[:, None] & i[None, :]
    for b in range(4):
        parity ^= (both >> b) & 1
    h = 1.0 - 2.0 * parity.to(torch.float64)
    return rht_signs(seed).to("cpu", torch.float64)[:, None] * h / 4.0


# ----------------------------------------------------------------------------- Triton


@jit
def walsh_hadamard16(x, lanes):
    """The unnormalised Walsh-Hadamard transform of each row of ``x [R, 16]`` (butterfly order)."""
    h = 1
    for _ in tl.static_range(4):
        partner = tl.gather(x, (lanes ^ h)[None, :] + tl.zeros_like(x).to(tl.int32), axis=1)
        x = tl.where((lanes & h)[None, :] != 0, partner - x, x + partner)
        h = h * 2
    return x


@jit
def rht_sign_lanes(key, lanes):
    """``s_j`` (±1.0) for the lanes ``j`` of a 16-wide row."""
    bits = random_bits(key, lanes.to(tl.int64))
    return tl.where((bits >> 31) != 0, -1.0, 1.0)


@jit
def _rht_kernel(X, SEED, Y, n_rows, INVERSE: tl.constexpr, BLOCK_R: tl.constexpr, COMPUTE: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    lanes = tl.arange(0, 16)
    offs = rows[:, None] * 16 + lanes[None, :]
    mask = rows[:, None] < n_rows
    x = tl.load(X + offs, mask=mask, other=0.0).to(COMPUTE)
    s = rht_sign_lanes(seed_key(tl.load(SEED)), lanes).to(COMPUTE)
    if INVERSE:
        y = walsh_hadamard16(x, lanes) * s[None, :] * 0.25
    else:
        y = walsh_hadamard16(x * s[None, :], lanes) * 0.25
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


def rht16(x: Tensor, seed: Tensor, inverse: bool, out_dtype: torch.dtype) -> Tensor:
    """``x`` with every 16 consecutive values of its last dim multiplied by ``Q`` (``Qᵀ`` if ``inverse``).

    The last dim must be a multiple of 16; computed in fp32 (fp64 for fp64 inputs), stored in
    ``out_dtype``.
    """
    check_seed_dtype("rht16", seed)
    if x.dim() == 0 or x.shape[-1] % RHT_SIZE:  # (the kernel reads rows of 16: it mixed rows otherwise)
        raise shape_error("rht16", "x", describe_shape(x.dtype, (Ellipsis, "16k")), x, "groups of 16 values")
    rows = as_rows(x) if x.numel() else x.reshape(0, RHT_SIZE)
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    n = rows.numel() // RHT_SIZE
    if n:
        block_r = 64
        _rht_kernel[(cdiv(n, block_r),)](
            rows, seed, y, n, INVERSE=inverse, BLOCK_R=block_r, COMPUTE=tl_compute_dtype(x.dtype)
        )
    return y


# ----------------------------------------------------------------------------- PyTorch twin


def walsh_hadamard16_ref(x: Tensor) -> Tensor:
    """Twin of :func:`walsh_hadamard16` over the last dim (of size 16), same butterfly order."""
    lead = x.shape[:-1]
    h = 1
    while h < RHT_SIZE:
        pairs = x.reshape(*lead, RHT_SIZE // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack([a + b, a - b], dim=-2).reshape(*lead, RHT_SIZE)
        h *= 2
    return x


def rht16_ref(x: Tensor, seed: Tensor, inverse: bool, out_dtype: torch.dtype) -> Tensor:
    """PyTorch twin of :func:`rht16`."""
    check_seed_dtype("rht16", seed)
    # (unflatten(-1, (-1, 16)) and flatten(-2), not reshapes through x.shape[-1] // 16: with that size
    # dynamic under torch.compile and 16 at the first call, Dynamo could not prove the round trip and
    # specialised it, refusing mark_dynamic)
    blocks = x.to(compute_dtype(x.dtype)).unflatten(-1, (-1, RHT_SIZE))
    s = rht_signs(seed).to(blocks.dtype)
    y = walsh_hadamard16_ref(blocks) * s * 0.25 if inverse else walsh_hadamard16_ref(blocks * s) * 0.25
    return y.flatten(-2).to(out_dtype)


RHT16 = Kernel("rht16", rht16, rht16_ref, fast_path=False)
