"""Elementwise/bias kernels: Triton (interpreted) vs twin vs float64, odd shapes, specials."""

from __future__ import annotations

import pytest
import torch
import triton.language as tl
from helpers import F64, FLOATS, check_kernel, make

import functe
from functe.kernels import _triton, elementwise
from functe.kernels._common import column_sums
from functe.kernels.gemm import GEMM, GEMM_DGRAD, gemm_wgrad_dbias_ref
from functe.kernels.hadamard import RHT16
from functe.kernels.quantize import dact_dbias_ref

SHAPES = [(37,), (2, 13), (32, 1, 32), (0, 13), (3, 1)]


@pytest.mark.parametrize("dtype", [*FLOATS, F64])
@pytest.mark.parametrize("shape", SHAPES)
def test_axpby(shape, dtype):
    x, e = make(shape, dtype), make(shape, dtype)
    check_kernel(elementwise.AXPBY, (x, e, -2.5, 0.5), lambda x, e, a, b: a * x + b * e)
    check_kernel(elementwise.AXPBY, (x, None, 3.5, 0.0), lambda x, e, a, b: a * x)
    # e is x itself (x + x, or make_extra_output's two cotangents as one tensor): the launcher took
    # "e is x" for "no e" and dropped beta·e
    check_kernel(elementwise.AXPBY, (x, x, -2.5, 0.5), lambda x, e, a, b: a * x + b * e)


def test_an_add_of_a_tensor_to_itself():
    x = make((2, 13))
    for backend in ("torch", "interpret"):
        with functe.use_backend(backend):
            assert torch.equal(functe.ops.add_extra_input(x, x), x + x)
            assert torch.equal(functe.fuse(lambda x: x + x)(x), x + x)
            _, vjp = torch.func.vjp(functe.ops.make_extra_output, x)
            assert torch.equal(vjp((x, x))[0], x + x)


@pytest.mark.parametrize("dtype", [*FLOATS, F64])
@pytest.mark.parametrize("shape", SHAPES)
def test_add_bias(shape, dtype):
    x, b = make(shape, dtype), make(shape[-1:], dtype)
    check_kernel(elementwise.ADD_BIAS, (x, b), lambda x, b: x + b)


@pytest.mark.parametrize("dtype", [*FLOATS, F64])
@pytest.mark.parametrize("shape", [*SHAPES, (600, 5)])
def test_bias_grad_is_the_fp32_sum_over_leading_dims(shape, dtype):
    dy = make(shape, dtype)
    check_kernel(elementwise.BIAS_GRAD, (dy,), lambda dy: dy.reshape(-1, dy.shape[-1]).sum(0))


@pytest.mark.parametrize("dtype", FLOATS)
def test_column_sums_accumulate_in_fp32_for_16_bit_inputs(dtype):
    # 256 followed by 4096 ones: a 16-bit accumulator stalls at 256 (bf16's spacing there is 2; fp16
    # stalls at 2048), an fp32 one reaches 4352 exactly, which both 16-bit formats represent.
    dy = torch.ones(4097, 3, dtype=dtype)
    dy[0] = 256.0
    exact = torch.full((3,), 4352.0, dtype=dtype)
    assert torch.equal(column_sums(dy, dtype), exact)
    assert torch.equal(elementwise.bias_grad_ref(dy), exact)
    assert torch.equal(gemm_wgrad_dbias_ref(dy, torch.ones(4097, 2, dtype=dtype))[1], exact)
    assert torch.equal(dact_dbias_ref(dy, torch.ones_like(dy), "relu")[1], exact)
    with functe.use_backend("interpret"):
        assert torch.equal(elementwise.bias_grad(dy), exact)
    assert torch.equal(column_sums(dy, torch.float32), exact.float())


def test_bias_grad_is_deterministic_and_uses_many_programs():
    dy = make((5000, 3), torch.float32)
    with functe.use_backend("interpret"):
        first = elementwise.bias_grad(dy)
        second = elementwise.bias_grad(dy)
    assert torch.equal(first, second)


def test_zeros_large_values_and_non_contiguous_inputs():
    x = make((7, 9), torch.bfloat16, kind="large").t()
    e = make((9, 7), torch.bfloat16, kind="zeros")
    check_kernel(elementwise.AXPBY, (x, e, 1.0, 1.0), lambda x, e, a, b: x + e)
    dy = make((9, 7), torch.float32).expand(4, 9, 7)  # stride 0, as the gradient of .sum() arrives
    check_kernel(elementwise.BIAS_GRAD, (dy,), lambda dy: dy.reshape(-1, 7).sum(0))


def test_inf_and_nan_propagate_identically():
    x = torch.tensor([[1.0, float("inf"), float("nan"), -float("inf")]])
    b = torch.tensor([1.0, 1.0, 1.0, 1.0])
    with functe.use_backend("interpret"):
        y = elementwise.add_bias(x, b)
        s = elementwise.axpby(x, None, -2.0, 0.0)
        db = elementwise.bias_grad(torch.cat([x, x]))
    assert torch.equal(y.isnan(), elementwise.add_bias_ref(x, b).isnan())
    assert y[0, 1] == float("inf") and y[0, 3] == -float("inf")
    assert s[0, 1] == -float("inf") and s[0, 2].isnan()
    assert db[1] == float("inf") and db[2].isnan() and db[3] == -float("inf")


def test_interpreted_casts_between_bf16_and_fp64_or_fp16_keep_their_values():
    # numpy has no bf16: the interpreter converted an fp64 or fp16 value to bf16's integer storage
    # (and back), so an fp64 GEMM stored as bf16 gave NaN and 9e-41, and a bf16 bias added to an fp64
    # accumulator garbage; only fp32 <-> bf16 was patched. Kernel-level launchers reach these casts.
    gen = torch.Generator().manual_seed(0)
    x, w, dy = (torch.randn(*s, generator=gen, dtype=F64) for s in ((5, 16), (3, 16), (5, 3)))
    bias, accum = torch.randn(3, generator=gen).to(torch.bfloat16), torch.randn(5, 16, generator=gen).bfloat16()
    for out_dtype in (torch.bfloat16, torch.float16):
        with functe.use_backend("interpret"):
            got = GEMM(x, w, None, None, 1.0, None, None, None, out_dtype)
            seed = torch.tensor(1234)
            rotated = RHT16.launcher(x, seed, False, out_dtype)
        assert torch.equal(got, GEMM.twin(x, w, None, None, 1.0, None, None, None, out_dtype)), out_dtype
        assert torch.equal(rotated, RHT16.twin(x, seed, False, out_dtype)), out_dtype
    with functe.use_backend("interpret"):
        with_bias = GEMM(x, w, bias, None, 1.0, "gelu", None, None, torch.bfloat16)  # (bf16 -> fp64 loaded)
        summed = GEMM_DGRAD(dy, w, accum, 1.0, None, None, None)  # (read and stored as bf16)
    assert torch.equal(with_bias, GEMM.twin(x, w, bias, None, 1.0, "gelu", None, None, torch.bfloat16))
    assert torch.equal(summed, GEMM_DGRAD.twin(dy, w, accum, 1.0, None, None, None))


@_triton.jit
def _convert_kernel(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < n).to(Y.dtype.element_ty), mask=offs < n)


@pytest.mark.parametrize("pair", ["bf16>f32", "bf16>f64", "bf16>f16", "f64>bf16", "f16>bf16", "f32>bf16"])
def test_interpreted_conversions_to_and_from_bf16_equal_torchs(pair):
    # (fp64/fp16 <-> bf16 read bf16's integer storage as a value; bf16 -> fp32 misread subnormals)
    names = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32, "f64": F64}
    src, dst = (names[n] for n in pair.split(">"))
    values = [float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, -1e-39, 2**-130, 3.0, -1.0 / 3, 6e4, 1e-5]
    x = torch.tensor(values, dtype=F64).to(src)
    y = torch.empty(len(values), dtype=dst)
    with functe.use_backend("interpret"):
        _convert_kernel[(1,)](x, y, len(values), BLOCK=16)
    expected = x.to(dst)
    assert torch.equal(y.isnan(), expected.isnan()), (y, expected)
    assert torch.equal(y.nan_to_num(), expected.nan_to_num()), (y, expected)
    assert torch.equal(y.signbit()[1:], expected.signbit()[1:])  # (NaN's sign aside)


def test_interpreted_bf16_stores_round_to_nearest_even_like_a_gpu():
    # Triton's interpreter truncates fp32 -> bf16; functe patches that one cast to round to
    # nearest even, so interpreted bf16 outputs are bit-identical to the twins (torch rounds RNE).
    x = make((4096,), torch.bfloat16)
    with functe.use_backend("interpret"):
        y = elementwise.axpby(x, None, 1.0 + 2**-12, 0.0)
    assert torch.equal(y, elementwise.axpby_ref(x, None, 1.0 + 2**-12, 0.0))
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 3.0e38], dtype=torch.bfloat16)
    with functe.use_backend("interpret"):
        out = elementwise.axpby(specials, None, 1.0, 0.0)
    assert out[0].isnan() and out[1] == float("inf") and out[2] == -float("inf")
    assert torch.equal(out[3:], specials[3:])
