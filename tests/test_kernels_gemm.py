"""Fused GEMM kernels: Triton (interpreted) vs twin vs float64 math, every epilogue, FP8, donation."""

from __future__ import annotations

import pytest
import torch
from gemm_helpers import FP8, dact64, forward64, fp8_spacing, quantize64, quantized_inputs
from helpers import F64, FLOATS, check_kernel, make

import functe
from functe.kernels import _gemm_configs, gemm_fp8
from functe.kernels import gemm as G
from functe.kernels._act import ACTIVATIONS
from functe.testing import assert_close, tolerance

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
M, K, N = 37, 45, 61  # nothing is a multiple of the blocks


def _both(fn, *args):
    """(Triton through the interpreter, twin) results of a Kernel."""
    with functe.use_backend("interpret"):
        out = fn.launcher(*args)
    return out, fn.twin(*args)


# ----------------------------------------------------------------------------- forward epilogues


EPILOGUES = {
    "plain": dict(),
    "bias": dict(bias=True),
    "bias_gelu": dict(bias=True, activation="gelu"),
    "residual": dict(residual=True),
    "bias_silu_residual_alpha": dict(bias=True, residual=True, activation="silu", alpha=-2.5),
    "alpha_zero_relu": dict(bias=True, activation="relu", alpha=0.0),
}


def _forward_args(epilogue, dtype, x_shape=(M, K), n=N):
    x, w = make(x_shape, dtype), make((n, x_shape[-1]), dtype)
    bias = make((n,), dtype) if epilogue.get("bias") else None
    res = make((*x_shape[:-1], n), dtype) if epilogue.get("residual") else None
    return (x, w, bias, res, epilogue.get("alpha", 1.0), epilogue.get("activation"))


@pytest.mark.parametrize("dtype", [*FLOATS, F64])
@pytest.mark.parametrize("name", list(EPILOGUES))
def test_forward_epilogues_vs_twin_and_float64(name, dtype):
    args = _forward_args(EPILOGUES[name], dtype)
    y = check_kernel(G.GEMM, args, lambda *a: forward64(*a, pre_dtype=dtype)[1], out_dtypes=[dtype])
    assert y.shape == (M, N)


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_every_activation_with_its_preactivation(activation):
    args = _forward_args({"bias": True, "activation": activation, "alpha": -2.5}, torch.bfloat16)
    check_kernel(G.GEMM_PREACT, args, lambda *a: tuple(reversed(forward64(*a, pre_dtype=torch.bfloat16))))


@pytest.mark.parametrize(
    "x_shape", [(37,), (2, 3, 13), (32, 1, 32), (0, 13), (5, 0)], ids=["1d", "3d", "32x1x32", "0rows", "K0"]
)
def test_odd_shapes_and_leading_dims(x_shape):
    args = _forward_args({"bias": True, "residual": True, "activation": "qgelu"}, torch.float32, x_shape, n=7)
    y = check_kernel(G.GEMM, args, lambda *a: forward64(*a)[1])
    assert y.shape == (*x_shape[:-1], 7)


def test_non_contiguous_and_stride_zero_operands():
    x = make((K, M), torch.float16).t()  # column-major x
    w = make((K, N), torch.float16).t()  # W stored transposed
    res = make((N,), torch.float16).expand(M, N)  # stride-0 rows, as gradients of .sum() arrive
    check_kernel(G.GEMM, (x, w, None, res, 1.0, "srelu"), lambda *a: forward64(*a, pre_dtype=torch.float16)[1])


def test_large_magnitudes_zeros_and_special_values():
    x = make((M, K), torch.bfloat16, kind="large")
    w = make((N, K), torch.bfloat16)
    check_kernel(G.GEMM, (x, w, None, None, 1.0, None), lambda *a: forward64(*a)[1])
    zeros = make((M, K), torch.bfloat16, kind="zeros")
    y, _ = _both(G.GEMM, zeros, w, None, None, 1.0, "gelu")
    assert torch.equal(y, torch.zeros_like(y))
    x = make((4, K), torch.float32)
    x[0, 3], x[1, 5], x[2, 7] = float("nan"), float("inf"), -float("inf")
    w = make((3, K), torch.float32).abs() + 0.1  # positive: row 1 -> +inf, row 2 -> -inf
    y, twin = _both(G.GEMM, x, w, None, None, 1.0, None)
    for out in (y, twin):
        assert out[0].isnan().all() and (out[1] == float("inf")).all() and (out[2] == -float("inf")).all()
        assert out[3].isfinite().all()


@pytest.mark.parametrize("activation", ["gelu", "qgelu", "silu", "srelu"])
def test_the_activation_reads_the_preactivation_as_the_unfused_linear_returns_it(activation):
    # The epilogue applied the activation to the fp32 accumulator: where z overflowed fp16 the fused
    # output was gelu(-7e4) = -0 while the unfused chain (and the stored z) had gelu(-inf) = NaN, and
    # the backward, reading the stored z, was NaN under a finite forward.
    x = torch.tensor([[1.0, 1.0], [1.0, -1.0], [0.5, 0.25]], dtype=torch.float16)
    w = torch.tensor([[-35000.0, -35000.0], [1.0, 2.0], [3.0, -1.0]], dtype=torch.float16)
    bias = torch.tensor([0.5, -0.25, 0.125], dtype=torch.float16)
    args = (x, w, bias, None, 1.0, activation)
    (y, z), (y_twin, z_twin) = _both(G.GEMM_PREACT, *args)
    assert z[0, 0] == -float("inf")
    unfused = G.GEMM.twin(x, w, bias, None, 1.0, None)
    with functe.use_backend("torch"):
        unfused = functe.ops.activation(unfused, activation)
    for out in (y, y_twin):
        assert torch.equal(out.isnan(), unfused.isnan()), (out, unfused)
        assert_close(out[~out.isnan()], unfused[~unfused.isnan()])
    assert torch.equal(z, z_twin)


# ----------------------------------------------------------------------------- launch configurations


def _swap_config(monkeypatch, **config):
    monkeypatch.setattr(_gemm_configs, "INTERPRET", {**_gemm_configs.INTERPRET, **config})


def test_persistent_and_grouped_orders_compute_the_same_tiles(monkeypatch):
    args = _forward_args(EPILOGUES["bias_silu_residual_alpha"], torch.float32, (70, K), n=N)
    with functe.use_backend("interpret"):
        plain = G.gemm(*args)
        _swap_config(monkeypatch, GROUP_M=3)
        grouped = G.gemm(*args)
        _swap_config(monkeypatch, GROUP_M=3, PERSISTENT=True)
        monkeypatch.setattr(_gemm_configs, "INTERPRET_PROGRAMS", 5)  # 5 programs loop over 20 tiles
        persistent, amax = gemm_fp8.gemm_amax(*args)
    assert torch.equal(plain, grouped) and torch.equal(plain, persistent)
    assert amax == plain.abs().max()


def test_other_block_shapes(monkeypatch):
    _swap_config(monkeypatch, BLOCK_M=32, BLOCK_N=16, BLOCK_K=32, GROUP_M=1)
    args = _forward_args(EPILOGUES["bias_gelu"], torch.float16)
    check_kernel(G.GEMM, args, lambda *a: forward64(*a, pre_dtype=torch.float16)[1])


def test_gpu_autotune_lists():
    for configs, bk in ((_gemm_configs.HOPPER_16BIT, 64), (_gemm_configs.HOPPER_FP8, 128)):
        assert any(c.kwargs["PERSISTENT"] for c in configs) and any(not c.kwargs["PERSISTENT"] for c in configs)
        for c in configs:
            kw = c.kwargs
            assert kw["BLOCK_K"] == bk and kw["GROUP_M"] == 8
            assert all(kw[b] >= 16 and kw[b] & (kw[b] - 1) == 0 for b in ("BLOCK_M", "BLOCK_N"))
    assert _gemm_configs.configs_for(1) is _gemm_configs.HOPPER_FP8
    assert _gemm_configs.smallest_tile(_gemm_configs.HOPPER_16BIT) == (64, 64)
    tuned = G._autotuned(2)  # built lazily; benchmarking restores a donated C
    assert tuned.keys == ["M", "N", "K"] and tuned.restore_value == ["C"]


# ----------------------------------------------------------------------------- backward


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("alpha", [1.0, -2.5, 0.0])
def test_dgrad_with_accumulate_and_alpha(alpha, dtype):
    dy, w, acc = make((2, 19, N), dtype), make((N, K), dtype), make((2, 19, K), dtype)
    check_kernel(G.GEMM_DGRAD, (dy, w, acc, alpha), lambda dy, w, acc, a: acc + a * dy @ w)
    check_kernel(G.GEMM_DGRAD, (dy, w, None, alpha), lambda dy, w, acc, a: a * dy @ w)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("alpha", [1.0, -2.5, 0.0])
def test_wgrad_and_bias_grad_over_leading_dims(alpha, dtype):
    dy, x = make((2, 19, N), dtype), make((2, 19, K), dtype)

    def ref(dy, x, acc, a):
        return a * dy.reshape(-1, N).T @ x.reshape(-1, K) + (0 if acc is None else acc)

    check_kernel(G.GEMM_WGRAD, (dy, x, None, alpha), ref)
    main_grad = make((N, K), torch.float32)  # fp32 main_grad accumulation of a low-precision wgrad
    check_kernel(G.GEMM_WGRAD, (dy, x, main_grad, alpha), ref, out_dtypes=[torch.float32])
    check_kernel(G.GEMM_WGRAD_DBIAS, (dy, x, None, alpha), lambda *a: (ref(*a), a[0].reshape(-1, N).sum(0)))


def test_backward_on_empty_and_stride_zero_gradients():
    dy = make((N,), torch.float32).expand(3, 4, N)  # gradient of .sum(): stride 0
    x = make((3, 4, K), torch.float32)
    check_kernel(G.GEMM_WGRAD_DBIAS, (dy, x, None, 1.0), lambda dy, x, c, a: (dy.reshape(-1, N).T @ x.reshape(-1, K),
                                                                              dy.reshape(-1, N).sum(0)))  # fmt: skip
    empty_dy, empty_x = make((0, N), torch.float32), make((0, K), torch.float32)
    dw, db = _both(G.GEMM_WGRAD_DBIAS, empty_dy, empty_x, None, 1.0)[0]
    assert torch.equal(dw, torch.zeros(N, K)) and torch.equal(db, torch.zeros(N))
    check_kernel(G.GEMM_DGRAD, (empty_dy, make((N, K), torch.float32)), lambda dy, w: dy @ w)


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_dgrad_with_dactivation_prologue(activation):
    dtype = torch.bfloat16
    dy, z, w, acc = make((2, 19, N), dtype), make((2, 19, N), dtype, scale=2.0), make((N, K), dtype), None
    if activation == "relu":
        z[0, 0, :5] = 0.0  # relu'(0) = 0, as TE defines it
        acc = make((2, 19, K), dtype)
    (dx, g), (dx_t, g_t) = _both(G.GEMM_DGRAD_DACT, dy, z, w, acc, -2.5, activation)
    g64 = dy.to(F64) * dact64(z, activation)
    assert_close(g, g_t, msg="g: triton vs twin")
    for got_dx, got_g, who in ((dx, g, "triton"), (dx_t, g_t, "twin")):
        assert got_g.dtype == dtype and got_dx.dtype == dtype
        assert_close(got_g, g64, msg=f"{who} g")
        # dx is the GEMM of the g it returned (rounded to bf16, as an unfused dact stores it). dx of
        # triton and twin are not compared directly: their g may differ by one bf16 rounding step
        # (the kernel's fp32 act' and the twin's differ in the last bit), which cancellation in dx
        # can magnify.
        expected = -2.5 * got_g.to(F64) @ w.to(F64) + (0 if acc is None else acc.to(F64))
        assert_close(got_dx, expected, msg=f"{who} dx")


# ----------------------------------------------------------------------------- FP8 operands


@pytest.mark.parametrize("name", ["plain", "bias_gelu", "bias_silu_residual_alpha"])
def test_fp8_forward_e4m3_operands_every_epilogue(name):
    epilogue = EPILOGUES[name]
    xq, sx = quantized_inputs((M, K), E4M3)
    wq, sw = quantized_inputs((N, K), E4M3)
    out = torch.bfloat16
    bias = make((N,), out) if epilogue.get("bias") else None
    res = make((M, N), out) if epilogue.get("residual") else None
    args = (xq, wq, bias, res, epilogue.get("alpha", 1.0), epilogue.get("activation"), sx, sw, out)
    check_kernel(G.GEMM, args, lambda x, w, b, r, a, act, sx, sw, o: forward64(x, w, b, r, a, act, sx, sw, o)[1],
                 out_dtypes=[out])  # fmt: skip


def test_fp8_backward_e5m2_gradients_times_e4m3():
    dyq, sdy = quantized_inputs((2, 19, N), E5M2)
    wq, sw = quantized_inputs((N, K), E4M3)
    xq, sx = quantized_inputs((2, 19, K), E4M3)
    acc = make((2, 19, K), torch.bfloat16)
    check_kernel(G.GEMM_DGRAD, (dyq, wq, acc, 1.0, sdy, sw), lambda dy, w, acc, a, s1, s2: acc + s1 * s2 * dy @ w)
    check_kernel(G.GEMM_WGRAD, (dyq, xq, None, -2.5, sdy, sx, torch.float32),
                 lambda dy, x, acc, a, s1, s2, o: a * s1 * s2 * dy.reshape(-1, N).T @ x.reshape(-1, K))  # fmt: skip


def test_fp8_operand_checks():
    xq, sx = quantized_inputs((M, K), E4M3)
    wq, sw = quantized_inputs((N, K), E4M3)
    with pytest.raises(functe.DTypeError, match=r"gemm: argument 'w_scale_inv' expected an f32 tensor"):
        G.gemm_ref(xq, wq, None, None, 1.0, None, sx, None, torch.bfloat16)
    with pytest.raises(functe.DTypeError, match=r"argument 'out_dtype' expected f32\|f16\|bf16 for FP8"):
        G.gemm_ref(xq, wq, None, None, 1.0, None, sx, sw)
    with pytest.raises(functe.DTypeError, match=r"argument 'w' expected an FP8 dtype to match 'x', got bf16"):
        G.gemm(xq, wq.to(torch.bfloat16), None, None, 1.0, None, sx, sw, torch.bfloat16)
    with pytest.raises(functe.ShapeError, match=r"argument 'x_scale_inv' expected f32\[\] .*got f32\[2\]"):
        G.gemm(xq, wq, None, None, 1.0, None, sx.expand(2), sw, torch.bfloat16)


# ----------------------------------------------------------------------------- quantized outputs


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("out", [torch.bfloat16, torch.float32])
def test_delayed_scaling_output_is_quantize_of_the_unfused_output(out, fp8):
    x, w, b, r = make((M, K), out), make((N, K), out), make((N,), out), make((M, N), out)
    scale = torch.tensor(FP8[fp8][0] / 30.0)  # |y| reaches ~60: part of the output saturates
    args = (x, w, scale, fp8, b, r, -2.5, "gelu")
    with functe.use_backend("interpret"):
        q, amax = gemm_fp8.gemm_quantize(*args)
        y = G.gemm(x, w, b, r, -2.5, "gelu")
        unfused = gemm_fp8.cast_fp8(y, scale, fp8)
    q_t, amax_t = gemm_fp8.gemm_quantize_ref(*args)
    y_t, _ = gemm_fp8.gemm_amax_ref(x, w, b, r, -2.5, "gelu")
    # fused == quantize(unfused output), bit for bit, on each backend
    assert torch.equal(q.view(torch.uint8), unfused.view(torch.uint8))
    assert torch.equal(q_t.view(torch.uint8), gemm_fp8.cast_fp8_ref(y_t, scale, fp8).view(torch.uint8))
    assert amax == y.abs().max().float() and amax_t == y_t.abs().max().float()
    assert (q.float().abs() == FP8[fp8][0]).any(), "the test should saturate some outputs"
    # vs float64: within one FP8 ulp of TE's formula applied to the exact output
    _, y64 = forward64(x, w, b, r, -2.5, "gelu")
    q64 = quantize64(y64, scale, fp8)
    for got in (q, q_t):
        err = (got.to(F64) - q64).abs()
        assert (err <= fp8_spacing(q64, fp8)).all(), f"max err {err.max()}"
        assert (err == 0).float().mean() > 0.9
    assert_close(amax, y64.abs().max(), dtype=out)


def test_amax_and_quantized_output_propagate_nan():
    x, w = make((M, K), torch.float32), make((N, K), torch.float32)
    x[3, 0] = float("nan")
    for q, amax in _both(gemm_fp8.GEMM_QUANTIZE, x, w, torch.tensor(1.0), E4M3):
        assert amax.isnan()
        assert q[3].float().isnan().all() and not q[4:].float().isnan().any()


def test_current_scaling_two_phases():
    x, w = make((2, 19, K), torch.bfloat16), make((N, K), torch.bfloat16)
    for backend in ("interpret", "torch"):
        with functe.use_backend(backend):
            q, scale_inv, amax = gemm_fp8.gemm_quantize_current(x, w, E4M3, activation="srelu")
            y = G.GEMM(x, w, None, None, 1.0, "srelu")
        assert amax == y.abs().max().float()
        assert torch.isclose(scale_inv, amax / 448.0, rtol=1e-6, atol=0)
        assert q.float().abs().max() == 448.0  # the largest |y| maps to the format's max
        assert_close(q.float() * scale_inv, y.float(), dtype=E4M3)
    zeros = torch.zeros(3, K)
    q, scale_inv, amax = gemm_fp8.gemm_quantize_current(zeros, torch.ones(2, K), E5M2)
    assert amax == 0 and scale_inv == 1.0 and (q.float() == 0).all()  # TE: amax 0 keeps scale 1


def test_current_scale_is_one_correctly_rounded_division():
    # TE: scale = fp8_max / amax rounded once. 448.0 / amax (a Python float over a tensor) is computed
    # as reciprocal(amax) * 448 and was off by an ulp for about a quarter of these amaxes.
    amax = torch.rand(400, generator=torch.Generator().manual_seed(0), dtype=torch.float64).mul(20).float()
    exact = (torch.full_like(amax, 448.0, dtype=torch.float64) / amax.double()).float()  # RN of the exact quotient
    got = torch.stack([gemm_fp8.current_scale(a, 448.0) for a in amax])
    assert torch.equal(got, exact)
    recipe = functe.CurrentScaling(fp8_format=functe.Format.E4M3)
    assert torch.equal(got, torch.stack([functe.current_scale(a, recipe=recipe, role="input") for a in amax]))
    x, w = make((4, K), torch.float32), make((N, K), torch.float32)
    _, scale_inv, amax = gemm_fp8.gemm_quantize_current(x, w, E4M3)
    assert torch.equal(scale_inv, torch.reciprocal((torch.tensor(448.0, dtype=torch.float64) / amax.double()).float()))


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_cast_kernel_rounds_like_torch_on_every_value_and_midpoint(fp8):
    codes = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    grid = codes[codes.isfinite()].unique()
    specials = torch.tensor([1e9, -1e9, float("inf"), -float("inf"), float("nan"), -0.0, 1e-30])
    y = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, torch.randn(300) * 100, specials])
    scale = torch.tensor(1.0)
    q, q_t = _both(gemm_fp8.CAST_FP8, y, scale, fp8)
    assert torch.equal(q.float().isnan(), y.isnan()) and torch.equal(q_t.float().isnan(), y.isnan())
    finite = ~y.isnan()
    assert torch.equal(q[finite].view(torch.uint8), q_t[finite].view(torch.uint8))  # incl. ties and -0.0
    assert torch.equal(q_t[finite].to(F64), quantize64(y[finite], 1.0, fp8))


# ----------------------------------------------------------------------------- argument checks


def test_clear_errors():
    x, w = make((M, K), torch.float32), make((N, K), torch.float32)
    with pytest.raises(functe.ShapeError, match=r"functe.gemm: argument 'w' expected f32\[\?,45\], got f32\[61,44\]"):
        G.GEMM(x, w[:, :44])
    with pytest.raises(functe.DTypeError, match=r"argument 'bias' expected dtype bf16 \(the output dtype\)"):
        G.GEMM(x.bfloat16(), w.bfloat16(), torch.zeros(N))
    with pytest.raises(functe.ShapeError, match=r"argument 'residual' expected f32\[37,61\], got f32\[61\]"):
        G.GEMM(x, w, None, torch.zeros(N))
    with pytest.raises(ValueError, match=r"argument 'activation' expected one of .*got 'tanh'"):
        G.GEMM(x, w, None, None, 1.0, "tanh")
    with pytest.raises(functe.DTypeError, match=r"argument 'x_scale_inv' expected None"):
        G.GEMM(x, w, None, None, 1.0, None, torch.tensor(1.0), torch.tensor(1.0))
    with pytest.raises(functe.ShapeError, match=r"gemm_wgrad: argument 'x' expected f32\[2,3,\?\]"):
        G.GEMM_WGRAD(torch.zeros(2, 3, 4), torch.zeros(6, 5))
    with pytest.raises(functe.DTypeError, match=r"gemm_dgrad_dact: argument 'z' expected dtype f32"):
        G.GEMM_DGRAD_DACT(torch.zeros(3, 4), torch.zeros(3, 4).half(), torch.zeros(4, 5))


# ----------------------------------------------------------------------------- donated accumulators


@pytest.mark.parametrize("backend_name", ["interpret", "torch"])
def test_donated_accumulators_are_written_in_place(backend_name):
    x, w, b = make((M, K), torch.bfloat16), make((N, K), torch.bfloat16), make((N,), torch.bfloat16)
    res = make((M, N), torch.bfloat16)
    dy, acc, main_grad = make((M, N), torch.bfloat16), make((M, K), torch.bfloat16), make((N, K), torch.float32)
    with functe.use_backend(backend_name):
        expected = G.GEMM(x, w, b, res.clone(), 1.0, "gelu"), G.GEMM_DGRAD(dy, w, acc.clone(), -2.5)
        expected += (G.GEMM_WGRAD(dy, x, main_grad.clone()),)
        got = G.GEMM_IN_PLACE(x, w, b, res, 1.0, "gelu"), G.GEMM_DGRAD_IN_PLACE(dy, w, acc, -2.5)
        got += (G.GEMM_WGRAD_IN_PLACE(dy, x, main_grad),)
    for g, target, e in zip(got, (res, acc, main_grad), expected):
        assert g is target and torch.equal(g, e)
    schema = str(torch.ops.functe.gemm_in_place.default._schema)
    assert "Tensor(a3!) residual" in schema and schema.endswith("-> ()")  # the mutation is declared


def test_donation_falls_back_to_a_new_tensor_when_the_write_could_be_seen():
    x, w = make((M, K), torch.float32), make((N, K), torch.float32)
    cases = {
        "requires_grad": (x.clone().requires_grad_(), make((M, N), torch.float32)),
        "non_contiguous": (x, make((N, M), torch.float32).t()),
        "stride_zero": (x, make((N,), torch.float32).expand(M, N)),
    }
    shared = make((M * (N + K),), torch.float32)  # x and the residual: contiguous views of one storage
    cases["shares_storage"] = (shared[M * N :].view(M, K), shared[: M * N].view(M, N))
    for name, (xx, res) in cases.items():
        before = res.detach().clone()
        with functe.use_backend("interpret"):
            y = G.GEMM_IN_PLACE(xx, w, None, res)
        assert y is not res and torch.equal(res, before), name
        assert_close(y, forward64(xx.detach(), w, None, before)[1], msg=name)
    # The very tensor as operand and residual: the check skipped the residual by identity, so it was
    # donated (the Triton kernel would read x while writing it).
    square, w2 = make((5, 5), torch.float32), make((5, 5), torch.float32)
    before = square.clone()
    with functe.use_backend("interpret"):
        y = G.GEMM_IN_PLACE(square, w2, None, square)
    assert y is not square and torch.equal(square, before)
    assert_close(y, forward64(before, w2, None, before)[1])


@pytest.mark.parametrize("backend_name", ["interpret", "torch"])
def test_donation_with_an_argument_on_another_device_raises_and_writes_nothing(backend_name):
    # With one argument on 'meta' the dispatcher ran the in-place op's fake kernel (no check, no
    # write) and the untouched accumulator came back as the GEMM's result (the Triton path).
    x, w, b = make((M, K), torch.float16), make((N, K), torch.float16), make((N,), torch.float16)
    dy, res, acc, main_grad = (make(s, torch.float16) for s in ((M, N), (M, N), (M, K), (N, K)))
    calls = {
        "gemm: argument.* 'x' on meta": lambda: G.GEMM_IN_PLACE(x.to("meta"), w, b, res, 1.0, "gelu"),
        "gemm_dgrad: argument.* 'w' on meta": lambda: G.GEMM_DGRAD_IN_PLACE(dy, w.to("meta"), acc),
        "gemm_wgrad: argument.* 'dy' on meta": lambda: G.GEMM_WGRAD_IN_PLACE(dy.to("meta"), x, main_grad),
    }
    before = [t.clone() for t in (res, acc, main_grad)]
    with functe.use_backend(backend_name):
        for message, call in calls.items():
            with pytest.raises(functe.DeviceError, match=message):
                call()
    assert all(torch.equal(t, b) for t, b in zip((res, acc, main_grad), before))


@pytest.mark.parametrize("backend_name", ["interpret", "torch"])
def test_a_bad_accumulator_is_named_as_accum(backend_name):
    # The output dtype comes from accum when out_dtype is not given: a list was an AttributeError
    # and an integer accum was reported as a bad 'out_dtype', which the caller never passed.
    dy, w, x = make((M, N), torch.float16), make((N, K), torch.float16), make((M, K), torch.float16)
    with functe.use_backend(backend_name):
        for call in (
            lambda: G.GEMM_DGRAD(dy, w, [[0.0] * K] * M, 1.0),
            lambda: G.GEMM_DGRAD_DACT(dy, dy.clone(), w, [[0.0] * K] * M, 1.0, "gelu"),
            lambda: G.GEMM_WGRAD(dy, x, [[0.0] * K] * N, 1.0),
        ):
            with pytest.raises(functe.DTypeError, match=r"argument 'accum' expected a tensor, got list"):
                call()
        with pytest.raises(
            functe.DTypeError, match=rf"gemm_dgrad: argument 'accum' expected dtype .*got i64\[{M},{K}\]"
        ):
            G.GEMM_DGRAD(dy, w, torch.zeros(M, K, dtype=torch.int64), 1.0)
        with pytest.raises(
            functe.DTypeError, match=rf"gemm_wgrad: argument 'accum' expected dtype .*got i32\[{N},{K}\]"
        ):
            G.GEMM_WGRAD(dy, x, torch.zeros(N, K, dtype=torch.int32), 1.0)


# ----------------------------------------------------------------------------- transforms through the Kernel


def test_vmap_and_grad_through_the_gemm_kernel():
    x, w, b = make((3, 5, 13), torch.float64), make((7, 13), torch.float64), make((7,), torch.float64)
    with functe.use_backend("interpret"):
        rowwise = torch.func.vmap(lambda x: G.GEMM(x, w, b, None, -2.5, "gelu"))(x)  # x batched: folded into rows
        ws = torch.stack([w, 2 * w, -w])
        per_w = torch.func.vmap(lambda w: G.GEMM(x[0], w, b, None, 1.0, "silu"))(ws)  # W batched: twin vmap
        grads = torch.func.grad(lambda x, w: (G.GEMM(x, w, b, None, 1.0, "gelu") ** 2).sum(), argnums=(0, 1))(x, w)
    assert_close(rowwise, forward64(x, w, b, None, -2.5, "gelu")[1])
    assert_close(per_w, torch.stack([forward64(x[0], v, b, None, 1.0, "silu")[1] for v in ws]))
    x64, w64 = x.clone().requires_grad_(), w.clone().requires_grad_()
    (forward64(x64, w64, b, None, 1.0, "gelu")[1] ** 2).sum().backward()
    assert_close(grads[0], x64.grad)
    assert_close(grads[1], w64.grad)


# ----------------------------------------------------------------------------- GPU (compiled, autotuned)


def _assert_within_a_preactivation_ulp(y, y_twin, z_twin, slope=1.13, z_error=0.0):
    rtol, atol = tolerance(y.dtype)
    y, y_twin, z_twin = (t.detach().to("cpu", torch.float64) for t in (y, y_twin, z_twin))
    z_ulp = torch.finfo(torch.bfloat16).eps * z_twin.abs()
    excess = (y - y_twin).abs() - (rtol * y_twin.abs() + atol + slope * (z_ulp + z_error))
    assert excess.max() <= 0, f"{int((excess > 0).sum())} elements beyond one ulp of z; worst excess {excess.max():.3g}"


def _fast_fp8_accumulation_error(x, w, alpha):
    """What Hopper's fast FP8 accumulation may lose per entry of ``alpha * x @ w.T``, in float64 on the CPU.

    The forward GEMM keeps Triton's fast wgmma accumulation for FP8 operands (TE's fprop does not
    split its accumulator either). That accumulator keeps about 14 mantissa bits (DeepSeek-V3's
    measurement), so each of the K/32 MMA steps may drop ~2^-14 of the running sum: bounded here by
    2^-11 of the sum of the terms' magnitudes (seen on an H100: 606 of 130,813 entries off, by up to
    0.047, where the sum cancelled; this test's terms sum to ~610 in magnitude, so the bound is ~0.3
    there). A review simulated the alternatives on these inputs: a 14-bit accumulator's error stays
    about 1/15 of this bound, while a bf16 accumulator, a dropped K element or bias, or alpha's sign
    flipped exceed it (a 1% scale error does not).
    """
    xa, wa = (t.detach().to("cpu", torch.float64).abs() for t in (x, w))
    return 2.0**-11 * abs(alpha) * (xa @ wa.T)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, E4M3])
def test_cuda_autotuned_kernel_matches_twin(dtype):
    x, w = make((257, 383), torch.bfloat16, device="cuda"), make((509, 383), torch.bfloat16, device="cuda")
    b, r = make((509,), torch.bfloat16, device="cuda"), make((257, 509), torch.bfloat16, device="cuda")
    scales = (None, None)
    if dtype == E4M3:
        x, w, scales = x.to(E4M3), w.to(E4M3), (torch.ones((), device="cuda"), torch.ones((), device="cuda"))
    alpha = -2.5
    args = (x, w, b, r, alpha, "gelu", *scales, torch.bfloat16)
    y, z = G.gemm_preact(*args)
    y_twin, z_twin = G.gemm_preact_ref(*args)
    z_error = _fast_fp8_accumulation_error(x, w, alpha) if dtype == E4M3 else 0.0
    rtol, atol = tolerance(z.dtype)
    z64, z_twin64 = (t.detach().to("cpu", torch.float64) for t in (z, z_twin))
    z_excess = (z64 - z_twin64).abs() - (rtol * z_twin64.abs() + atol + z_error)
    assert z_excess.max() <= 0, f"{int((z_excess > 0).sum())} pre-activations off; worst excess {z_excess.max():.3g}"
    # The activation reads the pre-activation rounded to bf16 (as the unfused linear returns it).
    # The kernel and the twin sum K in different orders, so where the fp32 sums straddle a rounding
    # boundary the two round z to neighbouring bf16 values: y may then differ by one ulp of z times
    # the activation's slope (GELU's is at most 1.13), which the residual's cancellation can make
    # large relative to y itself (seen on an H100 with FP8 operands: 0.0625 on |y| ~ 5e-4).
    _assert_within_a_preactivation_ulp(y, y_twin, z_twin, z_error=z_error)
    _assert_within_a_preactivation_ulp(G.gemm(*args), y_twin, z_twin, z_error=z_error)
    dx, g = G.gemm_dgrad_dact(r, r, w.to(torch.bfloat16), None, 1.0, "gelu")
    dx_t, g_t = G.gemm_dgrad_dact_ref(r, r, w.to(torch.bfloat16), None, 1.0, "gelu")
    assert_close(g, g_t)
    # dx sums 509 products in another order than the twin: one entry that cancels to ~6e-4 was off
    # by 2.7e-5 on an H100, accurate to its terms' scale (what scale_atol allows), not to its own.
    assert_close(dx, dx_t, scale_atol=True)


def test_compiles_fullgraph_as_opaque_custom_ops():
    x, w, b, r = make((M, K), torch.float32), make((N, K), torch.float32), make((N,), torch.float32), make((M, N))

    def f(x, w, b, r):
        y, z = G.GEMM_PREACT(x, w, b, None, -2.5, "gelu")
        return y, z, G.GEMM_IN_PLACE(x, w, b, r, 1.0, "relu")  # compiled: donation falls back (pure)

    with functe.use_backend("interpret"):
        eager = f(x, w, b, r.clone())  # eager donates: writes into its residual
        r_compiled = r.clone()
        compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(x, w, b, r_compiled)
    for c, e in zip(compiled, eager):
        assert torch.equal(c, e)
    assert torch.equal(r_compiled, r)  # compiled code never writes a donated buffer


def test_a_strided_bias_is_read_by_its_strides():
    # The epilogue loaded bias[0:N] from its storage: a bias of stride 2 gave [3, 4, 5, 6], not [3, 5, 7, 9].
    x, w, bias = torch.ones(2, 3), torch.ones(4, 3), torch.arange(8.0)[::2]
    want = x @ w.t() + bias
    for backend in ("interpret", "torch"):
        with functe.use_backend(backend):
            assert torch.equal(G.GEMM(x, w, bias, None, 1.0, None), want), backend
            y, z = G.GEMM_PREACT(x, w, bias, None, 1.0, "relu")
            assert torch.equal(z, want) and torch.equal(y, want.relu()), backend
