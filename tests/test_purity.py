"""Ops own their outputs and leave their arguments alone: in-place ops on results behave as on torch's
own results, an opaque function may not write into its arguments, and donation never writes where
torch forbids it."""

from __future__ import annotations

import pytest
import torch
from helpers import make

import functe
from functe import ops
from functe.testing import assert_close

# Ops whose kernels return a view of their own buffer (y.view(shape)) on the CPU fast path (large
# inputs) or on the Triton path (small inputs through the interpreter), and the composites around them.
OPS = {
    "dropout": lambda x, w: ops.dropout(x, 0.25, seed=3),
    "srelu": lambda x, w: ops.srelu(x),
    "qgelu": lambda x, w: ops.qgelu(x),
    "gelu": lambda x, w: ops.gelu(x),
    "swiglu": lambda x, w: ops.swiglu(x),
    "clamped_swiglu": lambda x, w: ops.clamped_swiglu(x),
    "layer_norm": lambda x, w: ops.layer_norm(x, w, w),
    "rms_norm": lambda x, w: ops.rms_norm(x, w),
    "l2_normalize": lambda x, w: ops.l2_normalize(x),
    "bias": lambda x, w: ops.bias(x, w),
}


def _grads_after_inplace_scale(fn, x, w, c, *, inplace: bool):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fn(x, w)
    y = y.mul_(2.0) if inplace else y * 2.0
    return (y.detach(), *torch.autograd.grad((y * c).sum(), (x, w), allow_unused=True))


@pytest.mark.parametrize(
    ("backend", "rows"), [("torch", 512), ("interpret", 3)], ids=["cpu-fast-path", "triton-interpreter"]
)
@pytest.mark.parametrize("name", list(OPS))
def test_an_inplace_op_on_a_result_is_differentiated_as_torch_does(name, backend, rows):
    # (autograd refused it: "Output 0 of dropout is a view and is being modified inplace. This view
    # was created inside a custom Function", where y = F.dropout(x); y.mul_(2) works in torch)
    torch.manual_seed(0)
    x, w = make((rows, 512)), make((512,))
    with functe.use_backend(backend):
        c = torch.randn_like(OPS[name](x, w))
        expected = _grads_after_inplace_scale(OPS[name], x, w, c, inplace=False)
        actual = _grads_after_inplace_scale(OPS[name], x, w, c, inplace=True)
    for a, e in zip(actual, expected):
        assert (a is None and e is None) or torch.equal(a, e)


def test_an_inplace_op_on_a_fused_result_is_differentiated_as_unfused():
    def block(x, w, b):
        return ops.swiglu(ops.linear(ops.layer_norm(x, b, b), w, b))

    x, w, b = make((4, 8)), make((8, 8)), make((8,))
    with functe.use_backend("interpret"):
        expected = _grads_after_inplace_scale(lambda x, w: block(x, w, b), x, w, 1.0, inplace=False)
        fused = functe.fuse(block)
        actual = _grads_after_inplace_scale(lambda x, w: fused(x, w, b), x, w, 1.0, inplace=True)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e)


def test_an_inplace_write_into_a_result_the_backward_reads_is_still_refused():
    # layer_norm's statistics are outputs its backward reads: a write into one must raise, as for
    # torch's own ops, not differentiate the written values
    x, w = make((4, 8)).requires_grad_(), make((8,)).requires_grad_()
    from functe.ops._norm import _layer_norm

    y, _, rstd = _layer_norm(x, w, w, eps=1e-5, zero_centered_gamma=False)
    rstd.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_an_opaque_function_that_writes_into_its_argument_is_refused(fused):
    # (fused, the weight gradient came from the written x: max error 2.5, silently)
    act = functe.opaque(torch.nn.SiLU(inplace=True))

    def fn(x, w):
        return ops.linear(x, w) + act(x)

    run = functe.fuse(fn) if fused else fn
    x, w = make((4, 8)), make((8, 8)).requires_grad_()
    wrote = r"opaque_SiLU: the function wrote into its argument 0 \(f32\[4,8\]\)"
    with pytest.raises(functe.ArgumentError, match=wrote):
        torch.func.grad(lambda w: run(x, w).sum())(w)


def test_an_opaque_function_may_update_captured_state():
    norm = torch.nn.BatchNorm1d(8)
    before = norm.running_mean.clone()
    y = functe.opaque(lambda x: norm(x).detach())(make((4, 8)))
    assert y.shape == (4, 8) and not torch.equal(norm.running_mean, before)


@pytest.mark.parametrize("fused", [False, True])
def test_an_opaque_module_updates_its_state_once_per_step(fused):
    # The backward recomputes the function and a trace runs it on meta tensors: BatchNorm's running
    # statistics moved at every run (momentum applied twice per step, batch count 2; 4 fused, and a
    # trace alone moved the count by 2).
    x0 = make((8, 4)) * 3 + 1
    reference = torch.nn.BatchNorm1d(4, momentum=0.5, affine=False)
    x = x0.clone().requires_grad_()
    reference(x).square().sum().backward()
    norm = torch.nn.BatchNorm1d(4, momentum=0.5, affine=False)
    op = functe.opaque(norm)
    run = functe.fuse(lambda x: op(x) * 1.0) if fused else op
    if fused:
        run.plan(x0)  # (a trace computes nothing)
        assert int(norm.num_batches_tracked) == 0 and not norm.running_mean.any()
    leaf = x0.clone().requires_grad_()
    run(leaf).square().sum().backward()
    assert int(norm.num_batches_tracked) == 1
    assert_close(norm.running_mean, reference.running_mean)
    assert_close(norm.running_var, reference.running_var)
    assert_close(leaf.grad, x.grad)


class _NormNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(4, momentum=0.5, affine=False)

    def forward(self, x, w):
        return ops.gelu(functe.opaque(self.norm)(ops.linear(x, w)))


@pytest.mark.parametrize("target", ["module", "forward"])
def test_a_fused_module_updates_its_opaque_state_once_per_step(target):
    # The trace's undo of its shape run was refused as a write by the traced function itself when
    # the fused callable reached the BatchNorm by name ("Tensor.copy_ writes into i64[] captured"),
    # and its reads made the statistics folded constants' sources (a retrace every step).
    reference, net = _NormNet(), _NormNet()
    run = functe.fuse(net if target == "module" else net.forward)
    w0 = make((4, 4))
    for _ in range(3):
        x = make((8, 4)) * 2 + 1
        w, v = w0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = run(x, w)
        expected = reference(x, v)
        (y * expected.detach()).sum().backward()
        (expected * expected.detach()).sum().backward()
        assert_close(y, expected)
        assert_close(w.grad, v.grad)
    assert int(net.norm.num_batches_tracked) == 3 and run.trace_count == 1
    assert_close(net.norm.running_mean, reference.norm.running_mean)
    assert_close(net.norm.running_var, reference.norm.running_var)


def test_a_failed_trace_leaves_opaque_state_as_it_was():
    # (the undo came after a bare yield: a shape run that raised left BatchNorm's update in place)
    norm = torch.nn.BatchNorm1d(4, affine=False)
    op = functe.opaque(lambda x: norm(x)[x > 0])  # (data-dependent: no shape inference)
    with pytest.raises(functe.TraceError, match="cannot infer the output shapes"):
        functe.fuse(lambda x: op(x) * 1.0).plan(make((8, 4)))
    assert int(norm.num_batches_tracked) == 0 and not norm.running_mean.any()


def test_donating_an_inference_tensor_outside_inference_mode_computes_out_of_place():
    # (torch raised "Inplace update to inference tensor outside InferenceMode is not allowed")
    with torch.inference_mode():
        extra = torch.ones(2)
    y = ops.add_extra_input(torch.ones(2), extra, in_place=True)
    assert y.tolist() == [2.0, 2.0] and extra.tolist() == [1.0, 1.0]
    with torch.inference_mode():
        z = ops.add_extra_input(torch.ones(2), extra, in_place=True)
    assert z is extra and extra.tolist() == [2.0, 2.0]  # inside inference mode the donation stands


def test_opaque_accepts_inference_tensors():
    # (the write check read their version counter: "Inference tensors do not track version counter")
    tanh = functe.opaque(torch.tanh)
    with torch.inference_mode():
        x = make((3,))
        assert torch.equal(tanh(x), torch.tanh(x))
    assert torch.equal(tanh(x), torch.tanh(x)) and torch.equal(
        functe.fuse(lambda t: tanh(t) * 2.0)(x), 2 * torch.tanh(x)
    )


def test_an_opaque_write_under_vmap_is_refused():
    # (a vmap wrapper's version counter does not move: vmap(grad) gave dW off by 3.67, silently)
    act = functe.opaque(torch.nn.SiLU(inplace=True))
    w = make((8, 8))
    loss = lambda w, x: (ops.linear(x, w) + act(x)).sum()
    with pytest.raises(functe.ArgumentError, match="wrote into its argument 0"):
        torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(w, make((3, 4, 8)))


@pytest.mark.parametrize(
    "name", ["swiglu", "geglu", "clamped_swiglu", "swiglu_interleaved", "scaled_swiglu", "srelu", "dropout"]
)
def test_an_inplace_op_on_a_result_under_torch_compile(name):
    # Under compile nothing un-views a Function's outputs (Dynamo cannot trace _is_view), so the twin
    # must not return one: the gated twin flattened its product ("Output 0 of ApplyTemplate is a view
    # and is being modified inplace").
    fns = {
        "swiglu_interleaved": lambda x: ops.swiglu(x, interleave=4),
        "scaled_swiglu": lambda x: ops.scaled_swiglu(x, torch.ones(x.shape[:-1])),
        "dropout": lambda x: ops.dropout(x, 0.25, seed=3),
    }
    fn = fns.get(name, getattr(ops, name, None))
    x = make((3, 16))
    c = torch.randn_like(fn(x))
    expected = _grads_after_inplace_scale(lambda x, w: fn(x), x, x[0], c, inplace=False)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, c: (fn(x).mul_(2.0) * c).sum(), backend="aot_eager", fullgraph=True)
    leaf = x.clone().requires_grad_()
    (grad,) = torch.autograd.grad(compiled(leaf, c), leaf)
    assert_close(grad, expected[1], dtype=x.dtype)  # (compiled, the twin's formula runs: not the same bits)


def test_kernels_allocate_their_results_in_the_result_shape():
    # A result that is a view of a kernel's own buffer costs an un-viewing at the Function boundary
    # on every recorded call (_backend.unaliased_outputs): the kernels write through a rows view of a
    # result allocated in its final shape instead.
    from functe.kernels import activation as act_kernels
    from functe.kernels import dropout as dropout_kernels
    from functe.kernels import norm as norm_kernels

    x, w, seed = make((2, 3, 16)), make((16,)), torch.tensor(3)
    results = {
        "activation fast path": act_kernels.activation_ref(x, "swiglu", 0, 7.0, 1.702, 1.0),
        "scaled activation fast path": act_kernels.activation_scaled_ref(
            x, torch.ones(2, 3), "srelu", 0, 7.0, 1.702, 1.0
        ),
        "dropout fast path": dropout_kernels.dropout_ref(x, seed, 0.25),
    }
    with functe.use_backend("interpret"):
        results["activation kernel"] = act_kernels.activation(x, "geglu", 4, 7.0, 1.702, 1.0)
        results["dropout kernel"] = dropout_kernels.dropout(x, seed, 0.25)
        results["rms_norm kernel"] = norm_kernels.rms_norm(x, w, 1e-5, False)
        for i, t in enumerate(norm_kernels.layer_norm(x, w, w, 1e-5, False)):
            results[f"layer_norm kernel output {i}"] = t
    views = [name for name, t in results.items() if t._is_view()]
    assert not views


@pytest.mark.parametrize(
    "returns_x",
    [
        lambda x: ops.all_reduce(x),  # (one rank: the identity)
        lambda x: ops.all_gather(x),
        lambda x: ops.reduce_scatter(x),
        lambda x: ops.dropout(x, 0.0, seed=1),
        lambda x: ops.identity(x),
        functe.fuse(lambda x: ops.identity(x)),  # (identity's forward rule hands back its input)
        lambda x: functe.fuse(lambda x: (ops.gelu(x), ops.identity(x)))(x)[1],
    ],
)
def test_donating_a_result_equal_to_the_argument_leaves_the_caller_tensor_alone(returns_x):
    # An op that returns its argument unchanged returns a view, not the caller's tensor: donating the
    # result (add_extra_input(..., in_place=True)) then computes out of place. Before, the single-rank
    # collectives and a fused identity (no grad) returned x itself, and the donation wrote x. (A
    # function that returns its argument itself returns x, fused as unfused: test_fuse's aliasing
    # test. Left: fused, so does dropout with p = 0 returned as is, whose trace records no op.)
    x = make((4, 16))
    before = x.clone()
    with torch.no_grad():
        y = returns_x(x)
        assert y is not x and torch.equal(y, before)
        out = ops.add_extra_input(torch.ones(4, 16), y, in_place=True)
    assert torch.equal(x, before) and torch.equal(out, before + 1)


def test_a_fused_identity_returned_twice_is_one_view_of_the_argument():
    # (one object twice, as unfused, but not the caller's tensor)
    x = make((4, 16))
    with torch.no_grad():
        first, second = functe.fuse(lambda x: (lambda y: (y, y))(ops.identity(x)))(x)
    assert first is second and first is not x and first.data_ptr() == x.data_ptr()
