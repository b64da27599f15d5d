"""The FP8 GEMM of quantized ops: FP8 tensor cores on a GPU, an exact emulation elsewhere.

``gemm_nt(a, sa, b, sb)`` computes ``(a @ b.T) * (sa * sb) (+ bias)`` for quantized operands
``a [M, K]`` and ``b [N, K]`` (TE's "TN" GEMM), accumulating in fp32:

* **native** (CUDA, compute capability >= 8.9, every dim a positive multiple of 16, no
  ``vmap``): ``torch._scaled_mm`` on the float8 data, ``a`` row-major and ``b`` column-major as
  cuBLASLt requires. Written to TE's and torchao's layout rules but not run in functe's CI (no
  GPU there); the tests run this path on the CPU (where ``_scaled_mm`` accepts the same calls)
  by patching :func:`_native_device`.
* **emulated** (everything else): E4M3 and E5M2 values are exact in bf16, so the quantizing
  kernels write the FP8 grid values directly in the GEMM's compute dtype (no decode pass) and a
  plain GEMM with fp32 accumulation gives the FP8 GEMM's sum up to summation order. The compute
  dtype is bf16 for bf16 outputs (fast on CPUs with AVX512-BF16/AMX; the bf16 product is rounded
  once more before the scale, <= 1 bf16 ulp) and fp32 otherwise (exact products).
"""

from __future__ import annotations

import torch
from torch._C._functorch import TransformType
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

from ._backend import runs_triton

Tensor = torch.Tensor


def compute_dtype(out_dtype: torch.dtype) -> torch.dtype:
    """The emulated GEMM's operand dtype: bf16 for bf16 outputs, fp32 otherwise."""
    return torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32


def _native_device(device: torch.device) -> bool:
    """A CUDA device with FP8 tensor cores, running functe's GPU path (tests patch this to use the CPU)."""
    return device.type == "cuda" and runs_triton(device) and torch.cuda.get_device_capability(device) >= (8, 9)


def _under_vmap(tensors) -> bool:
    """Whether a ``torch.func.vmap`` is active: ``_scaled_mm`` has no batching rule.

    ``grad`` wrappers alone are fine (the quantized operands need no derivative), so the check
    looks for a vmap level rather than for any functorch wrapper.
    """
    if torch.compiler.is_compiling():
        return False  # functe refuses compiled transforms (docs/design.md): no vmap here
    if any(torch._C._functorch.is_batchedtensor(t) for t in tensors):
        return True
    return any(i.key() == TransformType.Vmap for i in retrieve_all_functorch_interpreters())


def native_ok(*tensors: Tensor, dims: tuple[int, ...]) -> bool:
    """Whether ``torch._scaled_mm`` can run this GEMM (see the module docstring)."""
    if not _native_device(tensors[0].device) or not all(d > 0 and d % 16 == 0 for d in dims):
        return False
    return not _under_vmap(tensors)


def gemm_nt(
    a: Tensor,
    a_scale_inv: Tensor | None,
    b: Tensor,
    b_scale_inv: Tensor | None,
    *,
    out_dtype: torch.dtype,
    bias: Tensor | None = None,
    native: bool = False,
    fast_accum: bool = False,
) -> Tensor:
    """``(a @ b.T) * (a_scale_inv * b_scale_inv) + bias`` in ``out_dtype``.

    ``native``: ``a``/``b`` are float8 data; otherwise they hold the FP8 grid values (or, with
    ``None`` scales, MXFP8's dequantized values) in :func:`compute_dtype`. ``fast_accum`` is TE's
    choice for the forward GEMM (the gradient GEMMs use split accumulation).
    """
    if native:
        return _scaled_mm(a, a_scale_inv, b, b_scale_inv, out_dtype, bias, fast_accum)
    y = torch.mm(a, b.t())
    if a_scale_inv is None:
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.to(out_dtype)
    scale = a_scale_inv * b_scale_inv
    # In the scale's fp32, then one rounding: a 16-bit y times a 0-d fp32 scale rounds once at the
    # fp32 value, but under vmap the scale is batched (not 0-d) and type promotion would differ
    # from the per-member call (1 bf16 ulp, then a different FP8 cast of dy).
    y = y.to(scale.dtype)
    if bias is None:
        return (y * scale).to(out_dtype)
    return torch.addcmul(bias.to(y.dtype), y, scale).to(out_dtype)


def _scaled_mm(a, sa, b, sb, out_dtype, bias, fast_accum):
    # cuBLASLt FP8: A row-major [M, K], B column-major [K, N] (the transpose of a contiguous
    # [N, K]). A bias is fused only in the 16-bit output dtypes it supports.
    fuse_bias = bias is not None and out_dtype in (torch.bfloat16, torch.float16) and bias.dtype == out_dtype
    y = torch._scaled_mm(
        a.detach().contiguous(),
        b.detach().contiguous().t(),
        scale_a=sa.detach().reshape(()).to(torch.float32),
        scale_b=sb.detach().reshape(()).to(torch.float32),
        bias=bias if fuse_bias else None,
        out_dtype=out_dtype,
        use_fast_accum=fast_accum,
    )
    if bias is not None and not fuse_bias:
        y = (y.to(torch.float32) + bias.to(torch.float32)).to(out_dtype)
    return y
