"""Plain ``torch.autograd.forward_ad`` (dual levels, not torch.func) through functe.

The transform suite (tests/helpers.py: check_transforms, gradchecks) compares every op's forward-AD
tangents with ``torch.func.jvp``; these tests pin the cases around it: a loss that uses a tangent,
random opaque functions, captured duals, layouts, and bits.
"""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F

import functe
from functe import ops
from functe.testing import assert_close

F64 = torch.float64
BACKENDS = ["torch", "interpret"]


def _mlp(x, w):
    return ops.gelu(ops.linear(x, w))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fused", [False, True])
def test_a_loss_that_uses_the_tangent_is_differentiated_through_it(backend, fused):
    # A Jacobian penalty: the tangent is part of the loss, so its dependence on w must reach w's gradient.
    torch.manual_seed(0)
    x, w = torch.randn(4, 8, dtype=F64), torch.randn(6, 8, dtype=F64)
    v = torch.randn_like(x)

    def reference_loss(w):
        y, jv = torch.func.jvp(lambda x: F.gelu(x @ w.T, approximate="tanh"), (x,), (v,))
        return (y**2).sum() + (jv**2).sum()

    fn = functe.fuse(_mlp) if fused else _mlp
    leaf = w.clone().requires_grad_()
    with functe.use_backend(backend), fwAD.dual_level():
        y, jv = fwAD.unpack_dual(fn(fwAD.make_dual(x, v), leaf))
        assert jv.requires_grad
        (got,) = torch.autograd.grad((y**2).sum() + (jv**2).sum(), leaf)
    assert_close(got, torch.func.grad(reference_loss)(w), dtype=torch.float32)  # (TE's GELU constants)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_a_random_opaque_function_gets_the_tangent_of_its_own_draw(fused, requires_grad):
    drop = functe.opaque(lambda x: F.dropout(x, 0.5, training=True))
    fn = functe.fuse(lambda x: drop(x) * 2.0) if fused else (lambda x: drop(x) * 2.0)
    x = torch.randn(6, 8, dtype=F64).requires_grad_(requires_grad)
    torch.manual_seed(0)
    with fwAD.dual_level():
        y, tangent = fwAD.unpack_dual(fn(fwAD.make_dual(x, torch.ones_like(x))))
    after = torch.rand(3)
    torch.manual_seed(0)
    plain = F.dropout(x.detach(), 0.5, training=True) * 2.0
    assert torch.equal(y.detach(), plain)
    assert torch.equal(tangent, (plain != 0).to(F64) * 4.0)  # the same mask, times 2 / (1 - p)
    assert torch.equal(after, torch.rand(3))  # and the generator advanced by one draw, as unfused torch


def test_a_captured_dual_is_refused_by_fuse_and_opaque():
    x, w = torch.randn(4, 8, dtype=F64), torch.randn(6, 8, dtype=F64)
    with fwAD.dual_level():
        wd = fwAD.make_dual(w, torch.randn_like(w))
        with pytest.raises(functe.TraceError, match=r"f64\[6,8\].*forward-mode tangent"):
            functe.fuse(lambda x: ops.linear(x, wd))(x.clone().requires_grad_())
        op = functe.opaque(lambda x: x @ wd.T)
        # (refused whether or not the op becomes an autograd node, whose jvp would not run)
        for arg in (x.clone().requires_grad_(), x):
            with pytest.raises(functe.ArgumentError, match=r"opaque_<lambda>: .*f64\[6,8\].*forward-mode tangent"):
                op(arg)
    assert torch.equal(op(x), x @ w.T)  # (after the level: a plain tensor again)
    # under torch.func's transforms too: a captured tensor they differentiate gave zero tangents and
    # gradients (a jvp wrapper requires no grad; an opaque op whose arguments are not differentiated
    # is no autograd node, so its backward's check never ran)
    jvp_of = lambda f: torch.func.jvp(f, (w,), (torch.ones_like(w),))
    with pytest.raises(functe.TraceError, match=r"f64\[6,8\] captured from the enclosing scope"):
        jvp_of(lambda w: functe.fuse(lambda x: ops.linear(x, w))(x))
    with pytest.raises(functe.TraceError, match=r"f64\[6,8\] captured from the enclosing scope"):
        torch.func.jacfwd(lambda w: functe.fuse(lambda x: ops.linear(x, w))(x))(w)
    transformed = r"opaque_<lambda>: the function uses f64\[6,8\], which a torch.func transform differentiates"
    for transform in (jvp_of, lambda f: torch.func.grad(lambda w: f(w).sum())(w), lambda f: torch.func.jacrev(f)(w)):
        with pytest.raises(functe.ArgumentError, match=transformed):
            transform(lambda w: functe.opaque(lambda x: x @ w.T)(x))


def test_a_captured_batched_tensor_is_refused_by_opaque_and_batched_by_fuse():
    # vmap over a tensor the opaque function captures: the op's vmap rule ran the function outside
    # the vmap level, where functorch failed ("escaped"); fuse lifts such a capture to an input.
    x, ws = torch.randn(4, 8, dtype=F64), torch.randn(3, 6, 8, dtype=F64)
    with pytest.raises(
        functe.TransformError, match=r"opaque_<lambda>: the function uses f64\[6,8\], which an enclosing"
    ):
        torch.func.vmap(lambda w: functe.opaque(lambda x: x @ w.T)(x))(ws)
    fused = torch.func.vmap(lambda w: functe.fuse(lambda x: functe.opaque(lambda x: x @ w.T)(x))(x))(ws)
    assert_close(fused, x @ ws.transpose(1, 2))
    # ... but not when an argument of the op is batched too: its vmap rule then runs the function
    # correctly (values and gradients)
    xs = torch.randn(3, 4, 8, dtype=F64)
    assert_close(torch.func.vmap(lambda x, w: functe.opaque(lambda x: x @ w.T)(x))(xs, ws), xs @ ws.transpose(1, 2))
    grad_of = lambda f: torch.func.vmap(
        lambda x, w: torch.func.grad(lambda x: f(lambda x: (x @ w.T).sin())(x).sum())(x)
    )
    assert_close(grad_of(functe.opaque)(xs, ws), grad_of(lambda f: f)(xs, ws))


def _nested(case: str):
    """A nest of vmap ("v") and grad ("g") levels around ``op(lambda x: (x * w).sin())(x)``; the
    ``w`` levels take ``w`` as an argument, the function captures it below them."""
    vmap, grad = torch.func.vmap, torch.func.grad

    def loss(op):
        return lambda x, w: op(lambda x: (x * w).sin())(x).sum()

    return {
        "vmap(grad), w from the vmap": lambda op: vmap(lambda x, w: grad(lambda x: loss(op)(x, w))(x)),
        "vmap(vmap), w from both": lambda op: vmap(vmap(loss(op))),
        "vmap(grad), w from both": lambda op: vmap(grad(loss(op))),
        "grad(vmap), w from the grad": lambda op: grad(lambda x, w: vmap(lambda x: loss(op)(x, w))(x).sum()),
        "grad(vmap), w from both": lambda op: grad(lambda x, w: vmap(loss(op))(x, w).sum()),
    }[case]


@pytest.mark.parametrize(
    "case, works",
    [
        ("vmap(grad), w from the vmap", True),
        ("vmap(vmap), w from both", True),
        ("vmap(grad), w from both", False),
        ("grad(vmap), w from the grad", False),
        ("grad(vmap), w from both", False),
    ],
)
def test_a_capture_wrapped_at_a_grad_level_is_refused_under_the_ops_vmap_rule(case, works):
    # The op's vmap rule runs the function below every grad level and every level its arguments are
    # batched at: functorch failed (INTERNAL ASSERT "wrapper == nullptr") on a capture wrapped at a
    # grad level or at a vmap level above one (vmap(grad(f)) with w an argument of the grad'd
    # function); captures wrapped by vmap levels under every grad level work.
    xs, ws = torch.randn(2, 3, 5, dtype=F64), torch.randn(2, 3, 5, dtype=F64)
    program = _nested(case)
    if works:
        assert_close(program(functe.opaque)(xs, ws), program(lambda f: f)(xs, ws))
    else:
        with pytest.raises(functe.TransformError, match=r"opaque_<lambda>: the function uses f64\[.*grad/jvp level"):
            program(functe.opaque)(xs, ws)
        program(lambda f: f)(xs, ws)  # (plain torch runs it)


def test_an_opaque_function_capturing_a_traced_value_is_refused_by_the_trace():
    # The equation records the op's arguments only: the plan ran the function on the trace's
    # stand-in ("a traced value escaped its trace", an error blaming the caller)
    x, w = torch.randn(3, 4, dtype=F64), torch.randn(3, 4, dtype=F64)
    program = functe.fuse(lambda x, w: functe.opaque(lambda x: x * w)(x))
    with pytest.raises(functe.TraceError, match=r"opaque_<lambda>: the function uses a traced value f64\[3,4\]"):
        program(x, w)
    assert_close(functe.fuse(lambda x, w: functe.opaque(lambda x, w: x * w)(x, w))(x, w), x * w)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "name, fn",
    [
        ("gelu", ops.gelu),
        ("swiglu", ops.swiglu),
        ("layer_norm", lambda x: ops.layer_norm(x, torch.ones(6, dtype=F64), torch.zeros(6, dtype=F64))),
        ("rms_norm", lambda x: ops.rms_norm(x, torch.ones(6, dtype=F64))),
        ("fused gelu", functe.fuse(lambda x: ops.gelu(x) * 2.0)),
    ],
)
def test_tangents_take_the_outputs_layout(backend, name, fn):
    # A transposed primal: a launcher returns a view of a contiguous result, the twin's tangent
    # follows the input's layout; autograd asserts that a view output's tangent has its layout.
    x = torch.randn(6, 5, dtype=F64).t()
    t = torch.randn(6, 5, dtype=F64).t()
    with functe.use_backend(backend), fwAD.dual_level():
        tangent = fwAD.unpack_dual(fn(fwAD.make_dual(x.clone().requires_grad_(), t))).tangent
    assert_close(tangent, torch.func.jvp(fn, (x.contiguous(),), (t.contiguous(),))[1])
    # ... and batched tangents (jacfwd, hessian): the relayout copied them into an unbatched buffer
    with functe.use_backend(backend):
        assert_close(torch.func.jacfwd(fn)(x), torch.func.jacrev(fn)(x.contiguous()))
        loss = lambda x: fn(x).sin().sum()
        assert_close(torch.func.hessian(loss)(x), torch.func.jacrev(torch.func.jacrev(loss))(x.contiguous()))


@pytest.mark.parametrize("op", [ops.identity, ops.make_extra_output, functe.fuse(ops.identity)])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_an_expanded_dual_passes_through_view_ops(op, requires_grad):
    b = torch.randn(8, dtype=F64).requires_grad_(requires_grad)
    tb = torch.randn(8, dtype=F64)
    with fwAD.dual_level():
        out = op(fwAD.make_dual(b, tb).expand(4, 8))
        for o in out if isinstance(out, tuple) else (out,):
            assert torch.equal(fwAD.unpack_dual(o).tangent, tb.expand(4, 8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["geglu", "layer_norm", "rms_norm", "l2_normalize"])
def test_values_inside_a_dual_level_keep_their_bits(dtype, name):
    # The CPU fast paths stay on for tensors without a tangent (inside a Function's forward nothing
    # is dual), so a forward under forward AD, or under torch.func.jvp, rounds as a plain call.
    torch.manual_seed(0)
    x, w = torch.randn(64, 256, dtype=dtype), torch.randn(256, dtype=dtype)
    fn = {
        "geglu": ops.geglu,
        "layer_norm": lambda x: ops.layer_norm(x, w, w),
        "rms_norm": lambda x: ops.rms_norm(x, w),
        "l2_normalize": ops.l2_normalize,
    }[name]
    plain = fn(x)
    t = torch.randn_like(x)
    with fwAD.dual_level():
        dual = fwAD.unpack_dual(fn(fwAD.make_dual(x.clone().requires_grad_(), t))).primal
    assert torch.equal(dual.detach(), plain)
    assert torch.equal(torch.func.jvp(fn, (x,), (t,))[0], plain)


@pytest.mark.parametrize("fused", [False, True])
def test_forward_over_forward_is_refused_not_zero(fused):
    # torch 2.13 gives any autograd.Function's second-order forward term as zero: refused, with the
    # exact alternative named; jacfwd(jacrev) (hessian) stays exact.
    fn = functe.fuse(lambda x: ops.gelu(x) * 2.0) if fused else (lambda x: ops.gelu(x) * 2.0)
    x, v = torch.tensor([0.3, -1.2, 2.0], dtype=F64), torch.ones(3, dtype=F64)
    with pytest.raises(functe.TransformError, match=r"forward-over-forward.*jacfwd\(jacrev\(f\)\)"):
        torch.func.jvp(lambda x: torch.func.jvp(fn, (x,), (v,))[1], (x,), (v,))
    with pytest.raises(functe.TransformError, match="forward-over-forward"):
        torch.func.jacfwd(torch.func.jacfwd(lambda x: fn(x).sum()))(x)
    reference = torch.func.hessian(lambda x: (F.gelu(x, approximate="tanh") * 2.0).sum())(x)
    assert_close(torch.func.jacfwd(torch.func.jacrev(lambda x: fn(x).sum()))(x), reference)


def test_a_complex_output_keeps_its_tangent():
    def rotate(x, theta):  # (RoPE-style: pairs as complex numbers)
        return torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2)) * torch.exp(1j * theta)

    op = functe.opaque(rotate)
    x, theta = torch.randn(4, 8, dtype=F64), torch.randn(4, 4, dtype=F64)
    t = torch.randn_like(x)
    assert_close(
        torch.view_as_real(torch.func.jvp(lambda x: op(x, theta), (x,), (t,))[1]),
        torch.view_as_real(torch.func.jvp(lambda x: rotate(x, theta), (x,), (t,))[1]),
    )


@pytest.mark.filterwarnings(
    "ignore:Attempted to insert a get_attr Node"
)  # (torch.func.linearize's own, plain torch too)
@pytest.mark.parametrize(
    "name, op",
    [
        ("srelu", lambda h: ops.srelu(h)),
        ("swiglu", lambda h: ops.swiglu(h)),
        ("rms_norm", lambda h: ops.rms_norm(h, torch.linspace(0.5, 1.5, h.shape[-1], dtype=h.dtype))),
        ("dropout", lambda h: ops.dropout(h, 0.5, seed=1)),
    ],
)
def test_linearize_and_make_fx_record_the_ops(name, op):
    # make_fx (and torch.func.linearize through it) traced the twins' CPU fast path, whose out= writes
    # into scratch buffers its constant folding moved behind their reads: tangents of uninitialised
    # memory (errors up to 1e31); the threaded path at large shapes was not recorded at all.
    h = torch.randn(3, 8, dtype=F64)
    w = torch.randn_like(op(h))
    tangent = torch.randn_like(w)

    def f(h, w):
        return op(h) * w

    _, pushforward = torch.func.linearize(f, h, w)
    assert_close(pushforward(torch.zeros_like(h), tangent), op(h) * tangent)
    x, other = torch.randn(512, 1024), torch.randn(512, 1024)
    replay = torch.fx.experimental.proxy_tensor.make_fx(op)(x)
    assert_close(replay(other), op(other))


@pytest.mark.filterwarnings(
    "ignore:Attempted to insert a get_attr Node"
)  # (torch.func.linearize's own, plain torch too)
def test_linearize_of_a_fused_program_matches_jvp():
    def program(x, w1, w2, g):
        return ops.linear(ops.srelu(ops.linear(ops.rms_norm(x, g), w1)), w2)

    args = (torch.randn(3, 6, dtype=F64), torch.randn(8, 6, dtype=F64), torch.randn(6, 8, dtype=F64))
    args += (torch.rand(6, dtype=F64) + 0.5,)
    tangents = tuple(torch.randn_like(a) for a in args)
    expected = torch.func.jvp(program, args, tangents)[1]
    for fn in (program, functe.fuse(program)):
        assert_close(torch.func.linearize(fn, *args)[1](*tangents), expected)


def test_a_watching_dispatch_mode_keeps_the_fast_paths_bits():
    # Stepping aside under every dispatch mode (for make_fx) changed the bits under a user's logging
    # mode or FlopCounterMode (rms_norm f32[512,1024]: 9.5e-7): only tracing modes need the formula
    from torch.utils.flop_counter import FlopCounterMode

    x, w = torch.randn(512, 1024), torch.rand(1024) + 0.5
    expected = ops.rms_norm(x, w)
    with FlopCounterMode(display=False):
        assert torch.equal(ops.rms_norm(x, w), expected)


def test_a_capture_batched_at_a_level_that_batches_no_argument_is_refused():
    # vmap(lambda c: vmap(lambda x: opaque(lambda x: x * c)(x))(xs))(cs): the op's vmap rule paired
    # the inner level's members with the outer capture's (xs[j] * cs[j] for every i), or failed on
    # a size mismatch when the batch sizes differ
    xs, cs = torch.arange(3.0, dtype=F64), torch.arange(1.0, 4.0, dtype=F64)
    expected = cs[:, None] * xs[None, :]

    def nest(op):
        return torch.func.vmap(lambda c: torch.func.vmap(lambda x: op(lambda x: x * c)(x))(xs))(cs)

    with pytest.raises(functe.TransformError, match=r"that vmap batches none of its arguments"):
        nest(functe.opaque)
    assert torch.equal(nest(lambda f: f), expected)
    fused = lambda f: functe.fuse(lambda x: functe.opaque(f)(x))
    assert torch.equal(nest(fused), expected)  # (fuse lifts the capture to an input)


@pytest.mark.parametrize(
    "name",
    ["gelu", "srelu", "qgelu", "swiglu", "dropout", "layer_norm", "rms_norm", "l2_normalize"],
)
def test_a_dual_larger_than_one_chunk_runs_the_threaded_fast_path(name):
    # Inside a custom_vjp forward forward AD is off for the calling thread only: the CPU fast path's
    # worker threads read slices of the dual input and their out= ops refused its tangent.
    torch.manual_seed(0)
    x, t, w = torch.randn(512, 512), torch.randn(512, 512), torch.randn(512)
    fns = {
        "dropout": lambda x, w: ops.dropout(x, 0.25, seed=1),
        "layer_norm": lambda x, w: ops.layer_norm(x, w, w),
        "rms_norm": lambda x, w: ops.rms_norm(x, w),
    }
    fn = fns.get(name, lambda x, w: getattr(ops, name)(x))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # (one thread runs the chunks inline, where forward AD is already off)
    try:
        with fwAD.dual_level():
            y, tangent = fwAD.unpack_dual(fn(fwAD.make_dual(x, t), w))
    finally:
        torch.set_num_threads(threads)
    want_y, want_t = torch.func.jvp(lambda x: fn(x, w.double()), (x.double(),), (t.double(),))
    assert_close(y, want_y.float(), dtype=torch.float32)
    assert_close(tangent, want_t.float(), dtype=torch.float32)


@pytest.mark.parametrize("name", ["identity", "make_extra_output", "reshape", "constant_scale", "gelu"])
def test_func_jvp_of_an_expanded_primal_with_an_expanded_tangent(name):
    # The rule's nested jvp ran on a dense copy of the overlapping primal: an output that is a view
    # of the input then got a dense tangent, which functorch wrote into the expanded input's
    # ("more than one element of the written-to tensor refers to a single memory location").
    fns = {
        "make_extra_output": lambda x: ops.make_extra_output(x)[0],
        "reshape": lambda x: ops.reshape(x, (32,)),
        "constant_scale": lambda x: ops.constant_scale(x, 2.0),
    }
    fn = fns.get(name, getattr(ops, name, None))
    x, t = torch.randn(8, dtype=F64).expand(4, 8), torch.randn(8, dtype=F64).expand(4, 8)
    y, tangent = torch.func.jvp(fn, (x,), (t,))
    want_y, want_t = torch.func.jvp(fn, (x.contiguous(),), (t.contiguous(),))
    assert torch.equal(y, want_y) and torch.equal(tangent, want_t)
