"""Activation, norm and dropout kernels: Triton (interpreted) vs twin vs float64 on odd shapes and
layouts, the twins' CPU fast path vs their reference path, determinism, and the benchmark GPU path."""

from __future__ import annotations

import optree
import pytest
import torch
from act_helpers import UNARY, clamped_swiglu, deinterleave, gated
from act_helpers import l2_normalize as l2_ref
from act_helpers import layer_norm as ln_ref
from act_helpers import rms_norm as rms_ref
from helpers import F64, FLOATS, check_kernel, make

import functe
from functe import ops
from functe.kernels import _fast
from functe.kernels import activation as ak
from functe.kernels import dropout as dk
from functe.kernels import norm as nk
from functe.testing import assert_close

EW_SHAPES = [(), (1,), (3, 1), (37,), (2, 13), (32, 1, 32), (0, 13), (5, 1100)]
GATED_SHAPES = [(2,), (3, 2), (74,), (2, 26), (32, 1, 64), (0, 26), (3, 2200)]


def _ref_value(x, name, k):
    if name == "clamped_swiglu":
        return clamped_swiglu(x, 7.0, 1.702, 1.0, k)
    if ak.is_gated(name):
        return gated(name, x, k)
    return UNARY[name](x)


def _ref_all(name, k):
    """Float64 references of the four activation kernels, by autograd of the forward formula."""

    def value(x, *_):
        return _ref_value(x, name, k or None)

    def vjp(dy, x, s=None):
        x = x.clone().requires_grad_()
        y = value(x)
        (dx,) = torch.autograd.grad(y, x, dy * (1 if s is None else s[..., None]))
        return dx

    return value, vjp


@pytest.mark.parametrize("dtype", [*FLOATS, F64])
@pytest.mark.parametrize("name", ak.NAMES)
def test_activation_kernels_on_odd_shapes(name, dtype):
    gated_ = ak.is_gated(name)
    for shape in GATED_SHAPES if gated_ else EW_SHAPES:
        k = 1 if gated_ and shape[-1] % 4 else (2 if gated_ else 0)  # exercise the interleaved layout too
        for interleave in (0, k) if gated_ else (0,):
            x = make(shape, dtype)
            value, vjp = _ref_all(name, interleave)
            args = (name, interleave, 7.0, 1.702, 1.0)
            y_shape = ak._y_shape(x, name)
            dy = make(y_shape, dtype)
            check_kernel(ak.ACTIVATION, (x, *args), lambda x, *a, value=value: value(x))
            check_kernel(ak.DACTIVATION, (dy, x, *args), lambda dy, x, *a, vjp=vjp: vjp(dy, x))
            if x.dim():
                s = make(shape[:-1], dtype)
                check_kernel(ak.ACTIVATION_SCALED, (x, s, *args), lambda x, s, *a, value=value: value(x) * s[..., None])
                # ds is a row sum: compare only on normal-sized rows (the tolerance table is elementwise)
                if dtype in (torch.float32, F64):
                    check_kernel(
                        ak.DACTIVATION_SCALED,
                        (dy, x, s, *args),
                        lambda dy, x, s, *a, vjp=vjp, value=value: (vjp(dy, x, s), (dy * value(x)).sum(-1)),
                    )


def test_kernels_take_non_contiguous_and_stride0_inputs():
    x = make((26, 6), torch.float32).t()  # (6, 26)
    dy = make((13,), torch.float32).expand(6, 13)  # stride 0, as the gradient of .sum() arrives
    args = ("swiglu", 0, 7.0, 1.702, 1.0)
    value, vjp = _ref_all("swiglu", 0)
    check_kernel(ak.ACTIVATION, (x, *args), lambda x, *a: value(x))
    check_kernel(ak.DACTIVATION, (dy, x, *args), lambda dy, x, *a: vjp(dy, x))
    w = make((52,), torch.float32)[::2]
    check_kernel(nk.RMS_NORM, (x, w, 1e-5, False), rms_ref)
    check_kernel(
        nk.RMS_NORM_BWD,
        (make((26,), torch.float32).expand(6, 26), x, w, 1e-5, False),
        lambda dy, x, w, eps, zc: torch.autograd.grad(rms_ref(x.requires_grad_(), w.requires_grad_(), eps), (x, w), dy),
    )
    y = make((100,), torch.float32)[::3]
    with functe.use_backend("interpret"):
        triton_y = dk.dropout(y, torch.tensor(5), 0.5)
    assert torch.equal(triton_y, dk.dropout_ref(y, torch.tensor(5), 0.5))


def test_norm_kernels_reject_rows_beyond_the_single_pass_limit():
    x = torch.zeros(1, nk.MAX_COLS + 1)
    with functe.use_backend("interpret"):
        # (the message names the op and the argument: it said only "functe norm kernels: rows of ...")
        for call, op in [(lambda: ops.l2_normalize(x), "l2_normalize"), (lambda: ops.rms_norm(x, x[0]), "rms_norm")]:
            expected = rf"functe\.{op}: argument 'x' expected rows of at most 65536 elements .* got f32\[1,65537\]"
            with pytest.raises(functe.ShapeError, match=expected):
                call()


# ----------------------------------------------------------------------------- fast path vs reference path


def _both_paths(kernel, args):
    """The twin's CPU fast path (plain tensors) and its reference path (inputs requiring grad)."""
    fast = kernel.twin(*args)
    tracked = [
        a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
        for a in args
    ]
    ref = kernel.twin(*tracked)
    fast = fast if isinstance(fast, tuple) else (fast,)
    ref = ref if isinstance(ref, tuple) else (ref,)
    return fast, tuple(r.detach() for r in ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_path_matches_reference_path_across_many_chunks(dtype, monkeypatch):
    """Tiny chunks: many chunks per call, a partial last chunk, several threads."""
    monkeypatch.setattr(_fast, "CHUNK_ELEMENTS", 64)
    x, s = make((37, 24), dtype), make((37,), dtype)
    dy_g, dy = make((37, 12), dtype), make((37, 24), dtype)
    w = make((24,), dtype)
    _, mean, rstd = nk.layer_norm_ref(x, w, w, 1e-5, False)
    cases = [
        (ak.DACTIVATION, (dy, x, "relu", 0, 0.0, 0.0, 0.0)),
        (ak.DACTIVATION, (dy, x, "srelu", 0, 0.0, 0.0, 0.0)),
        (nk.LAYER_NORM, (x, w, s[:24], 0.3, True)),
        (nk.LAYER_NORM_BWD, (dy, x, mean, rstd, w, True)),
        (nk.LAYER_NORM_BWD_ADD, (dy, x, mean, rstd, w, x, False)),
        (nk.RMS_NORM, (x, w, 0.3, False)),
        (nk.RMS_NORM_BWD, (dy, x, w, 0.3, True)),
        (nk.L2_NORMALIZE, (x, 1e-6)),
        (nk.L2_NORMALIZE_BWD, (dy, x, 1e-6)),
    ]
    for name in ("qgelu", "sigmoid", "srelu"):
        cases += [
            (ak.ACTIVATION, (x, name, 0, 0.0, 0.0, 0.0)),
            (ak.ACTIVATION_SCALED, (x, s, name, 0, 0.0, 0.0, 0.0)),
            (ak.DACTIVATION, (dy, x, name, 0, 0.0, 0.0, 0.0)),
            (ak.DACTIVATION_SCALED, (dy, x, s, name, 0, 0.0, 0.0, 0.0)),
        ]
    for name in ("glu", "geglu", "qgeglu", "reglu", "sreglu", "swiglu", "clamped_swiglu"):
        for k in (0, 3):
            cases += [
                (ak.ACTIVATION, (x, name, k, 0.75, 1.3, 0.5)),
                (ak.ACTIVATION_SCALED, (x, s, name, k, 0.75, 1.3, 0.5)),
                (ak.DACTIVATION_SCALED, (dy_g, x, s, name, k, 0.75, 1.3, 0.5)),
            ]
    for kernel, args in cases:
        fast, ref = _both_paths(kernel, args)
        for i, (f, r) in enumerate(zip(fast, ref)):
            assert f.dtype == r.dtype and f.shape == r.shape, (kernel, args[2:], i)
            assert_close(
                f, r.double(), msg=f"{kernel.name} {[a for a in args if not isinstance(a, torch.Tensor)]} output {i}"
            )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_kernel_returns_the_same_bits_whether_or_not_it_is_recorded(dtype):
    """At small sizes too: an FP8 amax, and the fused-vs-unfused contract, see every ulp. (The fast
    path and the formula round differently, e.g. silu_backward; recorded small calls ran the formula.)"""
    x, s, dy, dy_g = make((5, 24), dtype), make((5,), dtype), make((5, 24), dtype), make((5, 12), dtype)
    w = make((24,), dtype)
    _, mean, rstd = nk.layer_norm_ref(x, w, w, 1e-5, False)
    cases = [
        (nk.LAYER_NORM, (x, w, w, 1e-5, False)),
        (nk.LAYER_NORM_BWD, (dy, x, mean, rstd, w, False)),
        (nk.RMS_NORM_BWD, (dy, x, w, 1e-5, False)),
        (nk.L2_NORMALIZE_BWD, (dy, x, 1e-6)),
    ]
    cases += [(ak.DACTIVATION, (dy, x, n, 0, 0.0, 0.0, 0.0)) for n in ("gelu", "silu", "qgelu", "sigmoid", "srelu")]
    cases += [(ak.DACTIVATION, (dy_g, x, n, 0, 7.0, 1.702, 1.0)) for n in ("swiglu", "geglu", "clamped_swiglu")]
    cases += [(ak.DACTIVATION_SCALED, (dy_g, x, s, "swiglu", 0, 0.0, 0.0, 0.0))]
    cases += [(ak.ACTIVATION, (x, n, 0, 0.0, 0.0, 0.0)) for n in ("qgelu", "srelu", "swiglu")]
    for kernel, args in cases:
        label = (kernel.name, [a for a in args if not isinstance(a, torch.Tensor)])
        plain = kernel(*args)
        index = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]

        def call(*values, kernel=kernel, args=args, index=index):
            full = list(args)
            for i, v in zip(index, values):
                full[i] = v
            out = kernel(*full)
            return out if isinstance(out, tuple) else (out,)

        tracked = call(*(args[i].detach().clone().requires_grad_() for i in index))
        under_grad = torch.func.vjp(call, *(args[i] for i in index))[0]
        for name, got in (("autograd", tracked), ("torch.func", under_grad)):
            for p, g in zip(plain if isinstance(plain, tuple) else (plain,), got):
                assert torch.equal(p, g.detach()), (*label, name)


@pytest.mark.parametrize(
    ("name", "a", "b", "dy"),
    [
        ("reglu", -1.0, 1e30, 1e10),
        ("swiglu", -30.0, 1e30, 1e10),
        ("glu", 0.0, 3e38, -3.0),
        ("sreglu", 1.0, 3e38, 0.0),
    ],
)
def test_gated_backward_multiplies_in_one_order_on_every_route(name, a, b, dy):
    # TE's da = (dy·f'(a))·b: the CPU fast path formed f'(a)·(dy·b) and the kernel dy·(f'(a)·b), so
    # where an intermediate leaves fp32 (dy·b = 1e40) the routes gave NaN, -inf or 0 for one input.
    x, g = torch.tensor([[a, b]]), torch.tensor([[dy]])
    x64 = x.double().requires_grad_()
    a64, b64 = x64[:, :1], x64[:, 1:]
    f = {"reglu": torch.relu, "swiglu": torch.nn.functional.silu, "glu": torch.sigmoid}.get(name)
    y64 = (torch.relu(a64) ** 2 if name == "sreglu" else f(a64)) * b64
    (want,) = torch.autograd.grad(y64, x64, g.double())
    results = [ak.DACTIVATION.twin(g, x, name, 0, 0.0, 0.0, 0.0)]
    results.append(ak._vjp(g, x, name, 0, 0.0, 0.0, 0.0))
    with functe.use_backend("interpret"):
        results.append(ak.DACTIVATION(g, x, name, 0, 0.0, 0.0, 0.0))
    for got in results:  # (the routes may differ by an ulp, not by leaving fp32)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0)


def test_clamped_backward_keeps_a_nan_or_inf_cotangent_where_the_clamp_is_active():
    # TE multiplies the clamp's zero factor by dy: dy·0 is NaN for dy = NaN or inf. The fast path
    # zeroed after multiplying and returned 0 (also for a row scale s = inf).
    x = torch.tensor([[9.0, 1.0, 2.0, 9.0]])  # a = [9, 1] (a_0 > limit 7), b = [2, 9] (b_1 > limit)
    for dy in (torch.tensor([[float("nan"), 1.0]]), torch.tensor([[float("inf"), float("inf")]])):
        ref = ak._vjp(dy, x, "clamped_swiglu", 0, 7.0, 1.702, 1.0)
        fast = ak.DACTIVATION.twin(dy, x, "clamped_swiglu", 0, 7.0, 1.702, 1.0)
        with functe.use_backend("interpret"):
            kernel = ak.DACTIVATION(dy, x, "clamped_swiglu", 0, 7.0, 1.702, 1.0)
        assert ref.isnan().any()
        assert torch.equal(fast.isnan(), ref.isnan()) and torch.equal(kernel.isnan(), ref.isnan())
    s = torch.tensor([float("inf")])
    scaled = ak.DACTIVATION_SCALED.twin(torch.ones(1, 2), x, s, "clamped_swiglu", 0, 7.0, 1.702, 1.0)[0]
    assert scaled[0, 0].isnan() and scaled[0, 3].isnan()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_srelu_backward_forms_2x_in_fp32(dtype):
    # fp16 2x overflows from 32752: the CPU path gave inf (and NaN for dy = 0, or when the fp16 sum
    # of x overflowed to -inf); TE computes dy·2x in fp32 and rounds once.
    x = torch.tensor([40000.0, 40000.0, 1.0, -60000.0, -60000.0, float("nan")]).to(dtype)
    dy = torch.tensor([1e-3, 0.0, 1.0, 1.0, 1.0, 1.0]).to(dtype)
    want = (dy.double() * torch.where(x.double() > 0, 2 * x.double(), 0.0)).to(dtype)
    with functe.use_backend("interpret"):
        kernel = ak.DACTIVATION(dy, x, "srelu", 0, 0.0, 0.0, 0.0)
    for got in (ak.DACTIVATION.twin(dy, x, "srelu", 0, 0.0, 0.0, 0.0), kernel):
        assert got.isfinite().all() and torch.equal(got.abs(), want.abs())


def test_fast_path_keeps_nan_and_inf_semantics():
    x = torch.tensor([[float("nan"), float("inf"), -float("inf"), 0.0, -2.0, 3.0]])
    dy = torch.tensor([[1.0, 1.0, float("inf"), float("nan"), 2.0, -1.0]])
    for name in ("relu", "srelu", "qgelu", "sigmoid"):
        fast, ref = _both_paths(ak.DACTIVATION, (dy, x, name, 0, 0.0, 0.0, 0.0))
        assert torch.equal(fast[0].isnan(), ref[0].isnan()), name
        ok = ~ref[0].isnan()
        assert_close(fast[0][ok], ref[0][ok].double(), msg=name)
    xg = torch.tensor([[float("nan"), 9.0, 1.0, float("nan")]])
    fast, ref = _both_paths(ak.ACTIVATION, (xg, "clamped_swiglu", 0, 7.0, 1.702, 1.0))
    assert fast[0].isnan().all() and ref[0].isnan().all()


def test_weight_grads_do_not_depend_on_the_thread_count(monkeypatch):
    monkeypatch.setattr(_fast, "CHUNK_ELEMENTS", 256)
    x, dy, w = make((500, 16), torch.bfloat16), make((500, 16), torch.bfloat16), make((16,), torch.bfloat16)
    threads = torch.get_num_threads()
    _, mean, rstd = nk.layer_norm_ref(x, w, w, 1e-5, False)
    results = []
    for n in (1, 2, 3):
        torch.set_num_threads(n)
        try:
            results.append(
                (nk.layer_norm_bwd_ref(dy, x, mean, rstd, w, False), nk.rms_norm_bwd_ref(dy, x, w, 1e-5, False))
            )
        finally:
            torch.set_num_threads(threads)
    for other in results[1:]:
        for a, b in zip([*results[0][0], *results[0][1]], [*other[0], *other[1]]):
            assert torch.equal(a, b)


def test_fast_path_is_not_taken_under_autograd_transforms_or_compile():
    x = torch.ones(3, requires_grad=True)
    assert not _fast.eager_cpu(x)
    with torch.no_grad():
        assert _fast.eager_cpu(x)
    assert not _fast.eager_cpu(torch.ones(2, device="meta"))
    assert torch.func.vmap(lambda t: torch.tensor(_fast.eager_cpu(t)))(torch.ones(2, 3)).logical_not().all()


# ----------------------------------------------------------------------------- the benchmark's GPU code path


def test_gpu_benchmark_code_path_runs_through_the_interpreter():
    """benchmarks/_act_cases.run_gpu measures kernel bandwidth on CUDA; run it on the CPU at a tiny
    shape through Triton's interpreter so that the code stays correct without a GPU."""
    from benchmarks import _act_cases

    cases = _act_cases.ACTIVATIONS + _act_cases.NORMS + _act_cases.DROPOUT
    with functe.use_backend("interpret"):
        text = _act_cases.run_gpu(cases, (4, 64), torch.float32, reps=1, device="cpu", compile_=False)
    for case in cases:
        assert f"| {case.name}" in text
    assert "fraction of copy" in text


def test_host_time_benchmark_layers_compute_the_same_gradient():
    """benchmarks/bench_launch.py times GELU forward + backward layer by layer, its Triton layers on
    CUDA only: through the interpreter, every layer must give ops.gelu's gradient (a layer computing
    something else would time the wrong work)."""
    from benchmarks.bench_launch import gelu_layers

    x, dy = make((8, 256)).requires_grad_(), make((8, 256))
    with functe.use_backend("interpret"):
        grads = {name: step()[0] for name, step in gelu_layers(x, dy, triton=True).items()}
    assert len(grads) == 5
    expected = grads.pop("ops.gelu (custom_vjp)")
    for name, grad in grads.items():
        assert_close(grad, expected, msg=name)


def test_host_time_proxy_times_every_layer_without_launching_and_restores_launches():
    """bench_launch --proxy times functe's host path on the CPU with Triton's launches made no-ops:
    inside it a launch must be the no-op (else it would time the interpreter), every layer's row
    must print, and afterwards launches must compute again."""
    from benchmarks import bench_launch

    x = make((2, 13))
    with bench_launch.no_op_launches():
        assert functe.get_backend() == "interpret"
        assert ak._act_kernel[(1,)] is bench_launch._no_op_launch
    text = bench_launch.main(["--proxy"], calls=2, rounds=1)
    assert "replaced by no-ops" in text
    for row in (
        "functe launcher alone",
        "Kernel dispatch (ACTIVATION)",
        "Function(Triton kernel[grid])",
        "ops.layer_norm",
    ):
        assert f"| {row}" in text or f": {row}" in text, row
    assert ak._act_kernel[(1,)] is not bench_launch._no_op_launch
    with functe.use_backend("interpret"):
        assert_close(ops.gelu(x), UNARY["gelu"](x.double()).float())


def test_interleaved_views_match_the_reference_layout():
    x = torch.arange(16.0).view(1, 16)
    a, b = ak._halves(x, 2)
    ra, rb = deinterleave(x, 2)
    assert torch.equal(a.flatten(-2), ra) and torch.equal(b.flatten(-2), rb)
    assert ra.tolist() == [[0.0, 1.0, 4.0, 5.0, 8.0, 9.0, 12.0, 13.0]]


def test_layer_norm_reference_matches_torch():
    x, w, b = make((4, 9), F64), make((9,), F64), make((9,), F64)
    assert_close(ln_ref(x, w, b), torch.nn.functional.layer_norm(x, (9,), w, b, 1e-5))
    assert_close(l2_ref(x, eps=0.0), torch.nn.functional.normalize(x, dim=-1, eps=0.0))


# ----------------------------------------------------------------------------- the norm backward's batching rule

# (members M, rows of one member, N, γ per member): an empty batch, a row-less member, N = 1, and
# 3000 rows per member (several programs each, so partial sums are indexed per member and program).
_MEMBER_CASES = [(3, (5,), 13, False), (2, (), 37, True), (0, (4,), 13, False), (2, (2, 3), 1, True)]


def _members_args(kind, add, m, rows, n, per_member, dtype):
    x, dy = make((m, *rows, n), dtype), make((m, *rows, n), dtype)
    w = make((m, n) if per_member else (n,), dtype)
    extra = (make(x.shape, dtype),) if add else ()
    if kind == "rms":
        return (dy, x, w, *extra, 1e-5, True)
    _, mean, rstd = nk.LAYER_NORM.twin(x, torch.ones(n, dtype=dtype), torch.zeros(n, dtype=dtype), 1e-5, False)
    return (dy, x, mean, rstd, w, *extra, False)


def _members_reference(kind, add):
    """Each member alone, by float64 autograd of the forward formula."""

    def reference(dy, x, *rest):
        at = 2 if kind == "layer" else 0  # (the statistics come first for LayerNorm)
        w, accum, zc = rest[at], (rest[at + 1] if add else None), rest[-1]
        outs = []
        for i in range(x.shape[0]):
            xi, wi = x[i].clone().requires_grad_(), (w if w.dim() == 1 else w[i]).clone().requires_grad_()
            bi = torch.zeros(x.shape[-1], dtype=F64, requires_grad=True)
            y = ln_ref(xi, wi, bi, 1e-5, zc) if kind == "layer" else rms_ref(xi, wi, 1e-5, zc)
            grads = torch.autograd.grad(y, (xi, wi, bi) if kind == "layer" else (xi, wi), dy[i], allow_unused=True)
            outs.append((grads[0] + (0 if accum is None else accum[i]), *grads[1:]))
        if not outs:
            n = x.shape[-1]
            return (x.clone(), *(torch.zeros(0, n, dtype=F64) for _ in range(2 if kind == "layer" else 1)))
        return tuple(torch.stack(parts) for parts in zip(*outs))

    return reference


def _plain_kernel(kind, add):
    return {
        ("layer", False): nk.LAYER_NORM_BWD,
        ("layer", True): nk.LAYER_NORM_BWD_ADD,
        ("rms", False): nk.RMS_NORM_BWD,
        ("rms", True): nk.RMS_NORM_BWD_ADD,
    }[kind, add]


def _per_member(kernel, kind, args):
    """``kernel``'s launcher on each member alone, stacked (the rows of member i, γ's row i)."""
    tensors = {0, 1, 2, 3, 4, 5} if kind == "layer" else {0, 1, 2, 3}
    weight = 4 if kind == "layer" else 2
    outs = []
    for i in range(args[1].shape[0]):
        member = [
            a if j not in tensors or not isinstance(a, torch.Tensor) or (j == weight and a.dim() == 1) else a[i]
            for j, a in enumerate(args)
        ]
        outs.append(kernel.launcher(*member))
    return tuple(torch.stack(parts) for parts in zip(*outs))


@pytest.mark.parametrize("dtype", [*FLOATS, F64])
@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_norm_backward_members_kernels_reduce_each_member_alone(kind, add, dtype):
    plain = _plain_kernel(kind, add)
    members = plain.batch.members
    for m, rows, n, per_member in _MEMBER_CASES:
        args = _members_args(kind, add, m, rows, n, per_member, dtype)
        got = check_kernel(members, args, _members_reference(kind, add))
        assert got[1].shape == (m, n), (members.name, got[1].shape)
        if m:  # the launcher's promise: each member's bits as a launch on that member alone
            with functe.use_backend("interpret"):
                alone = _per_member(plain, kind, args)
            for i, (a, b) in enumerate(zip(got, alone)):
                assert torch.equal(a, b), (members.name, dtype, m, rows, n, i)


def test_norm_backward_members_kernel_indexes_partial_sums_per_member_and_program():
    # 3000 rows per member: six programs each write a partial dγ; one launch for both members
    args = _members_args("layer", False, 2, (3000,), 5, True, torch.bfloat16)
    with functe.use_backend("interpret"):
        got = nk.LAYER_NORM_BWD_MEMBERS.launcher(*args)
        alone = _per_member(nk.LAYER_NORM_BWD, "layer", args)
    for a, b in zip(got, alone):
        assert torch.equal(a, b)
    assert not torch.equal(got[1][0], got[1][1])


def test_norm_backward_members_kernel_rejects_a_weight_of_the_wrong_member_count():
    dy = x = torch.ones(3, 4, 8)
    with functe.use_backend("interpret"), pytest.raises(functe.ShapeError, match=r"'weight' expected f32\[3,8\]"):
        nk.RMS_NORM_BWD_MEMBERS(dy, x, torch.ones(2, 8), 1e-5, False)


# ----------------------------------------------------------------------------- the norm forward's batching rule

# (members M, rows of one member, N, γ per member, β per member, x shared by every member): an empty
# batch, one row per member, N = 1, 300 rows per member (two programs each), and one x broadcast to
# every member (stride 0, read in place).
_FORWARD_MEMBER_CASES = [
    (3, (5,), 13, True, False, False),
    (2, (), 37, True, True, False),
    (0, (4,), 13, True, True, False),
    (2, (2, 3), 1, False, True, False),
    (2, (300,), 13, True, True, False),
    (3, (2, 5), 13, True, False, True),
]


def _forward_members_args(kind, m, rows, n, w_per_member, b_per_member, shared_x, dtype):
    x = make((*rows, n), dtype).expand(m, *rows, n) if shared_x else make((m, *rows, n), dtype)
    w = make((m, n) if w_per_member else (n,), dtype)
    if kind == "rms":
        return (x, w, 1e-5, True)
    return (x, w, make((m, n) if b_per_member else (n,), dtype), 1e-5, False)


def _forward_members_reference(kind):
    """Each member alone, in float64: ``y`` (and LayerNorm's mean and rstd)."""

    def reference(x, w, *rest):
        b = rest[0] if kind == "layer" else None
        outs = []
        for i in range(x.shape[0]):
            wi = w if w.dim() == 1 else w[i]
            if kind == "rms":
                outs.append((rms_ref(x[i], wi, 1e-5, True),))
                continue
            bi = b if b.dim() == 1 else b[i]
            mean = x[i].mean(-1)
            rstd = ((x[i] - mean[..., None]) ** 2).mean(-1).add(1e-5).rsqrt()
            outs.append((ln_ref(x[i], wi, bi, 1e-5, False), mean, rstd))
        if not outs:
            return (x.clone(), x.sum(-1), x.sum(-1)) if kind == "layer" else x.clone()
        stacked = tuple(torch.stack(parts) for parts in zip(*outs))
        return stacked if kind == "layer" else stacked[0]

    return reference


@pytest.mark.parametrize("dtype", [*FLOATS, F64])
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_norm_forward_members_kernels_normalize_each_member_alone(kind, dtype):
    plain = nk.LAYER_NORM if kind == "layer" else nk.RMS_NORM
    members = plain.batch.members
    for m, rows, n, w_per_member, b_per_member, shared_x in _FORWARD_MEMBER_CASES:
        args = _forward_members_args(kind, m, rows, n, w_per_member, b_per_member, shared_x, dtype)
        got = check_kernel(members, args, _forward_members_reference(kind))
        got = got if isinstance(got, tuple) else (got,)
        assert got[0].shape == (m, *rows, n), (members.name, got[0].shape)
        with functe.use_backend("interpret"):  # the launcher's promise: each member's bits as a launch on it alone
            for i in range(m):
                member = [
                    a[i] if isinstance(a, torch.Tensor) and (j == 0 or a.dim() == 2) else a for j, a in enumerate(args)
                ]
                alone = plain.launcher(*member)
                for a, b in zip(got, alone if isinstance(alone, tuple) else (alone,)):
                    assert torch.equal(a[i], b), (members.name, dtype, m, rows, n, i)


def test_norm_forward_members_kernel_rejects_a_bias_of_the_wrong_member_count():
    x = torch.ones(3, 4, 8)
    with functe.use_backend("interpret"), pytest.raises(functe.ShapeError, match=r"'bias' expected f32\[3,8\]"):
        nk.LAYER_NORM_MEMBERS(x, torch.ones(3, 8), torch.ones(2, 8), 1e-5, False)
    with functe.use_backend("interpret"), pytest.raises(functe.ShapeError, match=r"'weight' expected f32\[3,8\]"):
        nk.RMS_NORM_MEMBERS(x, torch.ones(4, 8), 1e-5, False)
    # a 1-D x has no member dimension: the launch wrote nothing and returned unwritten memory
    for launch in (
        lambda v: nk.RMS_NORM_MEMBERS(v, torch.ones(3, 3), 1e-5, False),
        lambda v: nk.RMS_NORM_BWD_MEMBERS(v, v, torch.ones(3, 3), 1e-5, False),
    ):
        for v in (torch.ones(3), torch.ones(())):
            with functe.use_backend("interpret"), pytest.raises(functe.ShapeError, match=r"expected \[M, \.\.\., N\]"):
                launch(v)


def test_cpu_fast_paths_allocate_on_the_cpu_under_another_default_device():
    # The fast paths' results and scratch buffers took the ambient default device: CPU tensors inside
    # `with torch.device("meta")` (or set_default_device) failed with "cross-device copies are not allowed".
    x, w, s = make((64, 256), torch.float32), make((256,), torch.float32), make((64,), torch.float32)
    linear_w = make((32, 256), torch.float32)
    nvfp4 = functe.NVFP4BlockScaling()

    def grads(fn, *args):
        args = [a.clone().requires_grad_() for a in args]
        return fn(*args), torch.autograd.grad(fn(*args).sum(), args)

    cases = [
        lambda: grads(ops.swiglu, x),
        lambda: grads(lambda x, s: ops.scaled_swiglu(x, s), x, s),
        lambda: grads(ops.rms_norm, x, w),
        lambda: grads(ops.l2_normalize, x),
        lambda: grads(lambda x: ops.dropout(x, 0.5, seed=1), x),
        lambda: grads(lambda x, w: ops.fp8_linear(x, w, None, None, recipe=nvfp4, seed=3), x, linear_w),
    ]
    for case in cases:
        expected = case()
        with torch.device("meta"):
            got = case()
        for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(expected)):
            assert a.device.type == "cpu" and torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("accum", [False, True])
def test_layer_norm_backward_twin_reads_strided_statistics(dtype, accum):
    # (from a fuzz of the kernels' layouts: the CPU fast path passed a strided view of rstd or mean to
    # torch's native_layer_norm_backward, which reads them as if contiguous: dx off by up to 7)
    x, dy, w = make((8, 32), dtype), make((8, 32), dtype), make((32,))
    _, mean, rstd = nk.layer_norm_ref(x, w, make((32,)), 1e-5, False)
    stats = [torch.stack([t, torch.full_like(t, 9.0)], -1)[:, 0] for t in (mean, rstd)]  # (stride 2)
    assert stats[1].stride() == (2,) and torch.equal(stats[1], rstd)
    kernel, extra = (nk.LAYER_NORM_BWD_ADD, (make((8, 32), dtype),)) if accum else (nk.LAYER_NORM_BWD, ())
    want = kernel.twin(dy, x, mean, rstd, w, *extra, False)
    for got, expected in zip(kernel.twin(dy, x, *stats, w, *extra, False), want):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_layer_norm_backward_kernel_refuses_statistics_of_another_row_count():
    """The Triton backward reads one mean and one rstd per row: the error names the short or long one."""
    x, dy, w = make((3, 8)), make((3, 8)), make((8,))
    with functe.use_backend("interpret"):
        _, mean, rstd = nk.layer_norm(x, w, make((8,)), 1e-5, False)
        with pytest.raises(functe.ShapeError, match=r"layer_norm.*'mean' expected f32\[3\].*f32\[2\]"):
            nk.layer_norm_bwd(dy, x, mean[:2], rstd, w, False)
        with pytest.raises(functe.ShapeError, match=r"layer_norm.*'rstd' expected f32\[3\].*f32\[4\]"):
            nk.layer_norm_bwd(dy, x, mean, torch.cat([rstd, rstd[:1]]), w, False)
        dx, dw, db = nk.layer_norm_bwd(dy, x, mean, rstd, w, False)  # (the right ones still run)
        assert dx.shape == x.shape and dw.shape == db.shape == (8,)
