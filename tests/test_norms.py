"""Norm ops: values and gradients vs float64 references on both backends, transforms, errors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import pytest
import torch
from act_helpers import KINDS, as64, check, check_sum, inputs, on_backends, outputs_and_grads
from act_helpers import l2_normalize as l2_ref
from act_helpers import layer_norm as ln_ref
from act_helpers import rms_norm as rms_ref
from helpers import F64, FLOATS, check_transforms, gradchecks, make

import functe
from functe import ops
from functe.kernels import _triton
from functe.kernels import norm as norm_kernels
from functe.testing import tolerance

SHAPES = [(37,), (2, 13), (32, 1, 32), (0, 13)]


@dataclass(frozen=True)
class Case:
    name: str
    fn: Callable
    ref: Callable
    params: int  # number of [N] parameters after x (weight, bias)
    kind: str  # layer | rms | l2
    eps: float
    zero_centered: bool = False


CASES = [
    Case("layer_norm", ops.layer_norm, ln_ref, 2, "layer", 1e-5),
    Case(
        "layer_norm_zc_eps",
        partial(ops.layer_norm, eps=0.3, zero_centered_gamma=True),
        partial(ln_ref, eps=0.3, zero_centered=True),
        2,
        "layer",
        0.3,
        True,
    ),
    Case("rms_norm", ops.rms_norm, rms_ref, 1, "rms", 1e-5),
    Case(
        "rms_norm_zc_eps",
        partial(ops.rms_norm, eps=0.3, zero_centered_gamma=True),
        partial(rms_ref, eps=0.3, zero_centered=True),
        1,
        "rms",
        0.3,
        True,
    ),
    Case("l2_normalize", ops.l2_normalize, l2_ref, 0, "l2", 1e-6),
    Case("l2_normalize_eps", partial(ops.l2_normalize, eps=0.5), partial(l2_ref, eps=0.5), 0, "l2", 0.5),
]
IDS = [c.name for c in CASES]


def _shapes(case, shape):
    return (shape, *[shape[-1:]] * case.params)


def _normalized(case, x):
    """(x̂, r) in float64."""
    n = 1 if case.kind == "l2" else x.shape[-1]
    xc = x - x.mean(-1, keepdim=True) if case.kind == "layer" else x
    r = torch.rsqrt((xc**2).sum(-1, keepdim=True) / n + case.eps)
    return xc * r, r


def _magnitudes(case, args64, dy):
    """Error scales: Σ|terms| of dx = r·(g − mean(g) − x̂·mean(g·x̂)), of dγ = Σ dy·x̂ and of dβ = Σ dy."""
    x = args64[0]
    n = 1 if case.kind == "l2" else x.shape[-1]
    xhat, r = _normalized(case, x)
    g = dy.abs()
    if case.params:
        g = g * (args64[1] + (1.0 if case.zero_centered else 0.0)).abs()
    dx = r * (g + g.sum(-1, keepdim=True) / n + xhat.abs() * (g * xhat.abs()).sum(-1, keepdim=True) / n)
    rows = dy.reshape(-1, x.shape[-1])
    return dx, (rows * xhat.reshape(rows.shape)).abs().sum(0), rows.abs().sum(0)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_values_and_grads_vs_float64_on_both_backends(case, dtype):
    for shape in SHAPES:
        for kind in KINDS:
            args = inputs(_shapes(case, shape), dtype, kind)
            args64 = as64(args)
            cotangent = make(shape, dtype)
            dy = as64([cotangent])[0]
            ref_out, ref_grads, _ = outputs_and_grads(case.ref, args64, dy)
            dx_mag, dw_mag, db_mag = _magnitudes(case, args64, dy)
            results = on_backends(case.fn, args, cotangent)
            for backend, (out, grads) in results.items():
                where = f"{case.name} {dtype} {shape} {kind} [{backend}]"
                assert out.dtype == dtype and all(g.dtype == dtype for g in grads), where
                check(out, ref_out, f"{where} y")
                check_sum(grads[0], ref_grads[0], dx_mag, f"{where} dx")
                if case.params >= 1:
                    check_sum(grads[1], ref_grads[1], dw_mag, f"{where} dw")
                if case.params == 2:
                    check_sum(grads[2], ref_grads[2], db_mag, f"{where} db")
            tri, twin = results["interpret"], results["torch"]
            check(tri[0], as64([twin[0]])[0], f"{case.name} {dtype} {shape} {kind}: triton vs twin y")
            check_sum(tri[1][0], as64(twin[1][:1])[0], dx_mag, f"{case.name} {dtype} {shape} {kind}: triton vs twin dx")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_torch_func_transforms(case, backend):
    check_transforms(case.fn, case.ref, [make(s, F64) for s in _shapes(case, (3, 6))])


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gradcheck(case, backend):
    gradchecks(case.fn, [make(s, F64) for s in _shapes(case, (3, 5))])


def test_per_example_weight_gradients_under_vmap(backend):
    """vmap(grad) w.r.t. γ gives one dγ per example (the backward kernel's reduction is per member)."""
    x, w, b = make((4, 3, 6), F64), make((6,), F64), make((6,), F64)
    loss = lambda w, b, x: (ops.layer_norm(x, w, b) ** 3).sum()
    ref = lambda w, b, x: (ln_ref(x, w, b) ** 3).sum()
    per_example = torch.vmap(torch.func.grad(loss, argnums=(0, 1)), in_dims=(None, None, 0))(w, b, x)
    expected = torch.vmap(torch.func.grad(ref, argnums=(0, 1)), in_dims=(None, None, 0))(w, b, x)
    for got, exp in zip(per_example, expected):
        assert got.shape == (4, 6)
        check(got, exp, "per-example grads")


def _loss_and_params(name):
    if name == "layer_norm":
        return (lambda w, b, x, t: (ops.layer_norm(x, w, b) * t).sum()), (0, 1, 2)
    if name == "rms_norm":
        return (lambda w, x, t: (ops.rms_norm(x, w, zero_centered_gamma=True) * t).sum()), (0, 1)

    @functe.fuse
    def residual_norm(x, w, b):  # fused to backward_add_norm: dx = d_skip + norm'(dy), one kernel
        y, skip = ops.make_extra_output(x)
        return ops.layer_norm(y, w, b), skip

    def loss(w, b, x, t):
        y, skip = residual_norm(x, w, b)
        return ((y + 2 * skip) * t).sum()

    return loss, (0, 1, 2)


@pytest.mark.parametrize("name", ["layer_norm", "rms_norm", "residual_layer_norm"])
def test_per_example_gradients_launch_one_backward_kernel_with_each_members_bits(name):
    # vmap(grad) used to run the backward's twin under torch.vmap (torch ops, even on a GPU): the
    # batching rule now launches the members kernel once, each member's dγ/dβ its own reduction.
    loss, argnums = _loss_and_params(name)
    params = [make((13,), torch.float32) for _ in argnums[:-1]]
    x, t = make((3, 5, 13), torch.float32), make((3, 5, 13), torch.float32)
    grad = torch.func.grad(loss, argnums=argnums)
    with functe.use_backend("interpret"), _triton.record_launches() as log:
        per_example = torch.vmap(grad, in_dims=(*[None] * len(params), 0, 0))(*params, x, t)
    backward = [launch for launch in log if launch[0] is norm_kernels._norm_bwd_kernel]
    assert len(backward) == 1, [launch[0].__name__ for launch in log]
    ((_, args, _, grid),) = backward
    assert grid[0] // args[14] == 3 and args[9] == 5  # (programs / programs_per_member members of 5 rows)
    with functe.use_backend("interpret"):
        alone = [grad(*params, x[i], t[i]) for i in range(3)]
    for got, parts in zip(per_example, zip(*alone)):
        assert torch.equal(got, torch.stack(parts))


@pytest.mark.parametrize("x_per_member", [True, False])
@pytest.mark.parametrize("name", ["layer_norm", "rms_norm"])
def test_an_ensembles_forward_launches_one_norm_kernel_with_each_members_bits(name, x_per_member):
    # vmap over an ensemble's γ and β (torch.func's model ensembling) ran the forward's twin under
    # torch.vmap (torch ops, even on a GPU): the batching rule now launches the members kernel once;
    # one x shared by every member is read in place (member stride 0), not copied per member.
    loss, argnums = _loss_and_params(name)
    params = [make((4, 13), torch.float32) for _ in argnums[:-1]]
    x, t = make((4, 5, 13) if x_per_member else (5, 13), torch.float32), make((4, 5, 13), torch.float32)
    grad = torch.func.grad(loss, argnums=argnums[:-1])
    x_dim = 0 if x_per_member else None
    with functe.use_backend("interpret"), _triton.record_launches() as log:
        per_member = torch.vmap(grad, in_dims=(*[0] * len(params), x_dim, 0))(*params, x, t)
    launched = [launch[0] for launch in log]
    assert launched == [norm_kernels._norm_fwd_kernel, norm_kernels._norm_bwd_kernel], [k.__name__ for k in launched]
    (_, args, _, grid) = log[0]
    assert grid[0] // args[10] == 4 and args[6] == 5 and args[11] == (65 if x_per_member else 0)
    with functe.use_backend("interpret"):
        alone = [grad(*(p[i] for p in params), x[i] if x_per_member else x, t[i]) for i in range(4)]
    for got, parts in zip(per_member, zip(*alone)):
        assert torch.equal(got, torch.stack(parts))


@pytest.mark.parametrize("name", ["layer_norm", "rms_norm"])
def test_an_ensemble_of_ensembles_launches_one_kernel_each_way_with_each_members_bits(name):
    # A nested vmap called the members kernels under the outer level, which had no batching rule:
    # their twins ran (torch ops on a GPU, other bits); the outer level now folds into the members.
    loss, argnums = _loss_and_params(name)
    params = [make((2, 3, 13), torch.float32) for _ in argnums[:-1]]  # (2 ensembles of 3 members)
    x, t = make((2, 5, 13), torch.float32), make((2, 3, 5, 13), torch.float32)  # (x: one per ensemble)
    grad = torch.func.grad(loss, argnums=argnums[:-1])
    inner = torch.vmap(grad, in_dims=(*[0] * len(params), None, 0))
    with functe.use_backend("interpret"), _triton.record_launches() as log:
        nested = torch.vmap(inner)(*params, x, t)
    launched = [launch[0] for launch in log]
    assert launched == [norm_kernels._norm_fwd_kernel, norm_kernels._norm_bwd_kernel], [k.__name__ for k in launched]
    assert log[0][3][0] // log[0][1][10] == 6  # (programs / programs_per_member: 2 x 3 members)
    with functe.use_backend("interpret"):
        alone = [[grad(*(p[a, m] for p in params), x[a], t[a, m]) for m in range(3)] for a in range(2)]
    for k, got in enumerate(nested):
        assert torch.equal(got, torch.stack([torch.stack([alone[a][m][k] for m in range(3)]) for a in range(2)]))


def test_second_derivatives_through_the_members_kernel(backend):
    # grad of a function of per-example γ-gradients (a per-example gradient penalty) differentiates
    # the members kernel through its twin
    x, w, b = make((3, 4, 6), F64), make((6,), F64), make((6,), F64)

    def penalty(fn):
        per_example = torch.vmap(torch.func.grad(lambda w, b, x: (fn(x, w, b) ** 3).sum()), in_dims=(None, None, 0))
        return lambda w, b, x: (per_example(w, b, x) ** 2).sum()

    got = torch.func.grad(penalty(ops.layer_norm), argnums=(0, 1, 2))(w, b, x)
    expected = torch.func.grad(penalty(ln_ref), argnums=(0, 1, 2))(w, b, x)
    for g, e in zip(got, expected):
        check(g, e, "second derivative")


def test_weight_grads_are_deterministic_fp32_partial_sums():
    """Many rows: the backward kernel splits them over programs; dγ and dβ are reproducible."""
    x, w, dy = make((3000, 5), torch.bfloat16), make((5,), torch.bfloat16), make((3000, 5), torch.bfloat16)
    with functe.use_backend("interpret"):
        _, mean, rstd = norm_kernels.layer_norm(x, w, w, 1e-5, False)
        first = norm_kernels.layer_norm_bwd(dy, x, mean, rstd, w, False)
        second = norm_kernels.layer_norm_bwd(dy, x, mean, rstd, w, False)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    dy64, x64 = dy.double(), x.double()
    xhat = ln_ref(x64, torch.ones(5, dtype=F64), torch.zeros(5, dtype=F64))
    check_sum(first[1], (dy64 * xhat).sum(0), (dy64 * xhat).abs().sum(0), "dw")
    check_sum(first[2], dy64.sum(0), dy64.abs().sum(0), "db")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [40, 4097])  # one chunk, and the CPU path's per-chunk partial sums
@pytest.mark.parametrize("name", ["layer_norm", "rms_norm"])
def test_16_bit_weight_grads_accumulate_in_fp32(name, rows, dtype):
    # x̂ = ±1/√(1 + eps) in every row, dy = 256 in row 0 and 1 elsewhere: dβ = Σ dy = 256 + (rows - 1)
    # and |dγ| = dβ/√(1 + eps), each rounded once to the 16-bit dtype. A 16-bit accumulator stalls
    # (bf16 at 256, fp16 at 2048): torch's own bf16/fp16 LayerNorm backward gives 512 and 4096 at 4097 rows.
    x = torch.tensor([1.0, -1.0], dtype=dtype).repeat(rows, 32)
    dy = torch.ones(rows, 64, dtype=dtype)
    dy[0] = 256.0
    w = torch.ones(64, dtype=dtype, requires_grad=True)
    b = torch.zeros(64, dtype=dtype, requires_grad=True)
    y = ops.layer_norm(x, w, b) if name == "layer_norm" else ops.rms_norm(x, w)
    params = (w, b) if name == "layer_norm" else (w,)
    grads = torch.autograd.grad(y, params, dy)
    total = torch.tensor(256.0 + (rows - 1), dtype=F64)
    dw = total / torch.sqrt(torch.tensor(1 + 1e-5, dtype=F64))
    assert torch.equal(grads[0], torch.stack([dw, -dw]).to(dtype).repeat(32))
    if name == "layer_norm":
        assert torch.equal(grads[1], total.to(dtype).expand(64))


def test_non_contiguous_inputs_and_stride0_cotangents(backend):
    x = make((13, 6), torch.float32).t()  # (6, 13), non-contiguous
    w, b = make((26,), torch.float32)[::2], make((13,), torch.float32)  # stride-2 weight
    grads = torch.func.grad(lambda x, w, b: ops.layer_norm(x, w, b).sum(), argnums=(0, 1, 2))(x, w, b)
    expected = torch.func.grad(lambda x, w, b: ln_ref(x, w, b).sum(), argnums=(0, 1, 2))(
        x.double(), w.double(), b.double()
    )
    for i, (g, e) in enumerate(zip(grads, expected)):
        check_sum(g, e, torch.full_like(e, 60.0), f"grad {i}")


def test_nan_in_a_row_stays_in_that_row(backend):
    x = make((3, 8), torch.float32)
    x[1, 2] = float("nan")
    w, b = torch.ones(8), torch.zeros(8)
    for y in (ops.layer_norm(x, w, b), ops.rms_norm(x, w), ops.l2_normalize(x)):
        assert y[1].isnan().all() and not y[0].isnan().any() and not y[2].isnan().any()


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "x",
    [torch.full((16, 1), 1e4), torch.full((16, 8), 1e4), 1e4 + torch.randn(16, 64)],
    ids=["one column", "constant rows", "mean 1e4"],
)
def test_layer_norm_backward_far_from_zero(x):
    # torch's CPU kernel forms x̂ = rstd·x − rstd·mean in one FMA: for one column (x̂ = 0 exactly, so
    # dγ = 0) it gave dγ = 0.48, for constant rows of 1e4 a 2% dx error. The CPU path now passes x − mean.
    gen = torch.Generator().manual_seed(3)
    w, b = 1 + 0.1 * torch.randn(x.shape[-1], generator=gen), torch.randn(x.shape[-1], generator=gen)
    dy = torch.randn(x.shape, generator=gen)
    x64, w64, b64 = (t.double().requires_grad_() for t in (x, w, b))
    centred = x64 - x64.mean(-1, keepdim=True)
    y64 = centred / torch.sqrt((centred**2).mean(-1, keepdim=True) + 1e-5) * w64 + b64
    ref = torch.autograd.grad(y64, (x64, w64, b64), dy.double())
    # x's own fp32 rounding near 1e4 limits every path to ~1e-3 of x̂ for the random rows
    tol = 1e-5 if x.std() == 0 else 2e-3
    # dx sums terms of size rstd·|dy·γ| (rstd = 316 for constant rows) that cancel to ~0
    rstd = float(torch.rsqrt(centred.detach().pow(2).mean(-1) + 1e-5).max())
    scale = max(1.0, float((dy * w).abs().max()) * rstd)
    for backend, (_, grads) in on_backends(lambda x, w, b: ops.layer_norm(x, w, b), (x, w, b), dy).items():
        for name, got, want in zip(("dx", "dγ", "dβ"), grads, ref):
            err = float((got.double() - want).abs().max())
            assert err <= tol * (scale if name == "dx" else max(1.0, float(want.abs().max()))), (backend, name, err)


@pytest.mark.parametrize("name", ["layer_norm", "rms_norm"])
def test_parameter_weights_take_the_same_path_as_plain_tensors(name):
    # nn.Parameter (a Tensor subclass) turned the CPU twins off their fast path: other bits than
    # plain weights (1.9e-6 apart at 4096x1024) and 3-4x slower
    x = make((512, 256))
    w, b = make((256,)), make((256,))
    norm = (lambda x, w, b: ops.layer_norm(x, w, b)) if name == "layer_norm" else (lambda x, w, b: ops.rms_norm(x, w))
    with torch.no_grad():
        assert torch.equal(norm(x, w, b), norm(x, torch.nn.Parameter(w), torch.nn.Parameter(b)))
    results = []
    for wrap in (lambda t: t.clone().requires_grad_(), torch.nn.Parameter):
        xs, ws, bs = x.clone().requires_grad_(), wrap(w.clone()), wrap(b.clone())
        y = norm(xs, ws, bs)
        grads = torch.autograd.grad(y, (xs, ws), torch.ones_like(y))
        results.append((y, *grads))
    assert all(torch.equal(p, q) for p, q in zip(*results))


def test_weight_shape_and_dtype_mismatches():
    x = torch.zeros(4, 16)
    with pytest.raises(
        functe.ShapeError,
        match=r"functe\.layer_norm: argument 'weight' expected f32\[16\], got f32\[15\] "
        r"\(one value per feature: x\.shape\[-1\] = 16\)",
    ):
        ops.layer_norm(x, torch.ones(15), torch.zeros(16))
    with pytest.raises(
        functe.ShapeError, match=r"functe\.layer_norm: argument 'bias' expected f32\[16\], got f32\[1,16\]"
    ):
        ops.layer_norm(x, torch.ones(16), torch.zeros(1, 16))
    with pytest.raises(
        functe.ShapeError, match=r"functe\.rms_norm: argument 'weight' expected f32\[16\], got f32\[4,16\]"
    ):
        ops.rms_norm(x, torch.ones(4, 16))
    with pytest.raises(
        functe.DTypeError,
        match=r"functe\.rms_norm: argument 'weight' expected dtype f32 to match 'x' f32\[4,16\], got bf16\[16\]",
    ):
        ops.rms_norm(x, torch.ones(16, dtype=torch.bfloat16))


def test_rank_and_eps_errors():
    with pytest.raises(
        functe.ShapeError,
        match=r"functe\.l2_normalize: argument 'x' expected a tensor \[\.\.\., N\] with N >= 1, got f32\[\]",
    ):
        ops.l2_normalize(torch.tensor(1.0))
    with pytest.raises(functe.ShapeError, match=r"got f32\[3,0\]"):
        ops.rms_norm(torch.zeros(3, 0), torch.zeros(0))
    with pytest.raises(
        ValueError, match=r"functe\.layer_norm: argument 'eps' expected a finite Python number >= 0, got -1.0"
    ):
        ops.layer_norm(torch.zeros(2, 3), torch.ones(3), torch.zeros(3), eps=-1.0)


def _block(x, w, b, s, seed):
    h = ops.layer_norm(x, w, b)
    h = ops.scaled_swiglu(h, s, interleave=2)
    return ops.dropout(ops.rms_norm(h, w[:4], zero_centered_gamma=True), 0.25, seed=seed)


@pytest.mark.parametrize("requires_grad", [False, True], ids=["inference", "training"])
def test_block_compiles_fullgraph(requires_grad, backend):
    """layer_norm -> scaled_swiglu -> rms_norm -> dropout under torch.compile(fullgraph=True), with
    autograd outside; multi-argument ops also compile when nothing requires grad."""
    torch._dynamo.reset()
    args = [make(s, torch.float32).requires_grad_(requires_grad) for s in ((5, 8), (8,), (8,), (5,))]
    seed = torch.tensor(11)
    compiled = torch.compile(_block, fullgraph=True, backend="aot_eager")
    got, expected = compiled(*args, seed), _block(*args, seed)
    check(got, expected.double(), "value")
    if requires_grad:
        cot = make(got.shape, torch.float32)
        for g, e in zip(torch.autograd.grad(got, args, cot), torch.autograd.grad(expected, args, cot)):
            check(g, e.double(), "grad")
    torch._dynamo.reset()


def test_layer_norm_hessian_matches_the_formula():
    # The reference is LayerNorm written out in torch ops: torch 2.13's own F.layer_norm gets the
    # d(dγ)/dx block of hessian / jacrev(jacrev) wrong (38.5 on entries of ~1e4, while its grad(grad)
    # and jacrev(grad) are right), which first looked like a functe bug.
    gen = torch.Generator().manual_seed(0)
    x, g, b = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((4, 8), (8,), (8,)))

    def written_out(x, g):
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return (x - mean) * (var + 1e-5).rsqrt() * g + b

    loss = lambda norm: lambda x, g: (norm(x, g) ** 3).sum()
    got = torch.func.hessian(loss(lambda x, g: ops.layer_norm(x, g, b)), argnums=(0, 1))(x, g)
    want = torch.func.hessian(loss(written_out), argnums=(0, 1))(x, g)
    for i in range(2):
        for k in range(2):
            torch.testing.assert_close(got[i][k], want[i][k])


@pytest.mark.parametrize("kind", ["rms_norm", "l2_normalize"])
def test_long_fp32_rows_keep_fp32_accuracy_on_the_cpu(kind):
    # The CPU path summed the squares with torch.linalg.vector_norm, a running sum: 1.2e-4 relative
    # on a constant row of 140,000 (5e-6 at 4,096, against TE's fp32 rtol 1.3e-6); F.rms_norm: 3e-7.
    n = 140_000
    x = torch.full((2, n), 0.7)
    x[1] = torch.linspace(-1.0, 2.0, n)
    w = make((n,))
    fn = (lambda x, w: ops.rms_norm(x, w)) if kind == "rms_norm" else (lambda x, w: ops.l2_normalize(x) * w)
    ref = (lambda x, w: rms_ref(x, w)) if kind == "rms_norm" else (lambda x, w: l2_ref(x) * w)
    dy = make((2, n))
    rtol, _ = tolerance(torch.float32)
    for given in (x, x[:1].expand(2, n)):  # (an expanded row, read at stride 0, too)
        y64, vjp64 = torch.func.vjp(ref, *as64([given, w]))
        check(fn(given, w), y64, f"{kind} value")  # (no gradient: the forward's own fast path)
        inputs = [given.detach().requires_grad_(), w.detach().requires_grad_()]
        y = fn(*inputs)
        check(y.detach(), y64, f"{kind} value, recorded")
        grads = torch.autograd.grad(y, inputs, dy)
        for got, want, name in zip(grads, vjp64(dy.double()), ["dx", "dw"]):  # (relative to the largest)
            assert (got.double() - want).abs().max() <= 4 * rtol * want.abs().max(), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [3, 4096], ids=["one-chunk", "chunked"])
def test_layer_norm_of_rows_with_a_large_mean_is_exact_in_16_bits(dtype, rows):
    # torch's mixed-precision LayerNorm forms rstd·x − rstd·mean, which cancels where |mean|·rstd is
    # large: a constant row of 3e4 (y exactly β) came out β + 0.44 in bf16 on the CPU, where TE's
    # formula subtracts the mean first (as functe's Triton kernel does).
    torch.manual_seed(0)
    n = 64
    x = torch.randn(rows, n) * 3
    x[::3] = torch.tensor([3e4, -6e4, 1e3])[torch.arange(0, rows, 3) % 3, None]  # constant rows
    x[1::3] += 5e4  # a large mean with a spread (rounded in 16 bits: nearly constant)
    x[2, 5] = float("nan")  # (one NaN row turned the recomputation off for every row)
    x, w, b = x.to(dtype), make((n,), dtype), make((n,), dtype)
    backends = ["torch", "interpret"] if rows == 3 else ["torch"]
    for backend in backends:
        with functe.use_backend(backend):
            y = ops.layer_norm(x, w, b)
            y_recorded = ops.layer_norm(x.clone().requires_grad_(), w, b)
        torch.testing.assert_close(y, y_recorded.detach(), rtol=0, atol=0, equal_nan=True)
        assert torch.equal(y[::3], b.expand(y[::3].shape)), backend
        expected = ln_ref(*as64([x, w, b]))
        assert y[2].isnan().all()
        ordinary = (torch.arange(rows) % 3 == 2) & (torch.arange(rows) != 2)
        check(y[ordinary], expected[ordinary], "value")
        # Rows of a large mean and a spread carry fp32's own error, ~|mean|·2^-24/std (TE's too, in
        # whatever order its kernel sums); the cancellation made it 0.1 to 0.9.
        spread = torch.arange(rows) % 3 == 1
        assert (y[spread].double() - expected[spread]).abs().max() < 1e-2 * w.abs().max()


@pytest.mark.parametrize("rows", [3, 4096], ids=["one-chunk", "chunked"])
def test_layer_norm_of_fp32_rows_with_a_large_mean_keeps_fp32_accuracy(rows):
    # torch's fp32 LayerNorm cancels as its 16-bit one does (above): rows of std 1 and a mean of 1e4
    # came out 3.7e-4 of the largest output off the float64 value, 3.8e-3 at 1e5 (a stop-35 fuzz),
    # and their rstd carried the variance's cancellation; TE's formula subtracts the mean first.
    torch.manual_seed(0)
    n = 64
    x = torch.randn(rows, n, dtype=F64)
    x[::3] += torch.tensor([1e4, -1e5, 300.0], dtype=F64)[torch.arange(0, rows, 3) % 3, None]
    x, w, b = x.float(), make((n,)), make((n,))
    y, _, rstd = norm_kernels.layer_norm_ref(x, w, b, 1e-5, False)
    x64 = x.double()
    expected = ln_ref(x64, w.double(), b.double())
    rtol, _ = tolerance(torch.float32)
    assert (y.double() - expected).abs().max() <= 4 * rtol * expected.abs().max()
    rstd64 = (x64.var(-1, unbiased=False) + 1e-5).rsqrt()
    assert ((rstd.double() - rstd64).abs() / rstd64).max() <= 4 * rtol
    assert torch.equal(ops.layer_norm(x, w, b), y)
    assert torch.equal(ops.layer_norm(x.view(rows, 1, n), w, b).view(rows, n), y)  # (statistics of rank 2)
