"""What a fused function's plans hold on to: intermediates while a plan runs, folded constants
across plans."""

from __future__ import annotations

import warnings
import weakref

import pytest
import torch

import functe
from functe import ops
from functe._oplist import Literal


def _probed_chain(middle):
    """A fused ``check(middle(keep(x)))`` that records, when its last op runs, whether keep's output
    (an intermediate ``middle`` alone reads) is still alive."""
    refs, alive = [], []

    @functe.opaque
    def keep(x):
        y = x * 2
        refs.append(weakref.ref(y))
        return y

    @functe.opaque
    def check(x):
        alive.append(refs[-1]() is not None)
        return x + 1

    def chain(x):
        return check(middle(keep(x)))

    return chain, functe.fuse(chain), alive


def test_an_intermediate_is_freed_after_its_last_use_in_inference():
    # The generated infer kept every intermediate (and each op's residuals, until the next op's) to
    # its return: a deep block's peak memory under no_grad grew with depth (196 MiB at depth 16
    # against eager's 32).
    _, fused, alive = _probed_chain(ops.gelu)  # (gelu's residual is its input: not kept here)
    with torch.no_grad():
        fused(torch.ones(3))  # (the trace)
        alive.clear()
        fused(torch.ones(3))
    assert alive == [False]


def test_the_forward_frees_what_no_residual_keeps():
    # 2.0 * x saves nothing, so keep's output dies before check runs, as in eager autograd; gelu
    # saves its input, which stays (as a residual, not under the forward's own name)
    for middle, kept in ((lambda t: 2.0 * t, False), (ops.gelu, True)):
        chain, fused, alive = _probed_chain(middle)
        x = torch.ones(3, requires_grad=True)
        fused(x).sum().backward()  # (the trace)
        alive.clear()
        (grad,) = torch.autograd.grad(fused(x).sum(), x)
        assert alive[0] is kept  # (the forward's check; the backward recomputes it)
        torch.testing.assert_close(grad, torch.autograd.grad(chain(x).sum(), x)[0])


def _linear_under_autocast():
    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 16).eval().requires_grad_(False)
    return layer, functe.fuse(lambda x: ops.linear(x, layer.weight, layer.bias))


def _folded_tensors(plan):
    return [a.value for e in plan.program.eqns for a in e.inputs if isinstance(a, Literal) and a.fresh]


def test_plans_of_one_function_share_a_folded_constant():
    # Under autocast every plan folded its own bf16 copy of the captured weights: a served model
    # kept one copy per prompt length (20 lengths: 20 copies).
    layer, fused = _linear_under_autocast()
    xs = [torch.randn(n, 32) for n in (1, 2, 5)]
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        outs = [fused(x) for x in xs]
        plans = [fused.plan(x) for x in xs]
        eager = [ops.linear(x, layer.weight, layer.bias) for x in xs]
    assert fused.trace_count == 3
    folded = [_folded_tensors(p) for p in plans]
    assert len(folded[0]) == 2 and all(t.dtype == torch.bfloat16 for t in folded[0])
    assert all(a is b for other in folded[1:] for a, b in zip(folded[0], other))
    for out, want in zip(outs, eager):
        torch.testing.assert_close(out, want, rtol=0, atol=0)
    # an in-place update still retraces every plan that folded the weight
    with torch.no_grad():
        layer.weight.mul_(-1)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        for x in xs:
            torch.testing.assert_close(fused(x), ops.linear(x, layer.weight, layer.bias), rtol=0, atol=0)


def test_only_bitwise_equal_constants_are_shared():
    # -0.0 == 0.0 for torch.equal: merged, x + c lost the sign of a zero
    zeros = torch.zeros(4)
    fused = functe.fuse(lambda x: (x + zeros * -1.0, x + zeros * 1.0))
    negative, positive = fused(torch.full((4,), -0.0))
    assert negative.signbit().all() and not positive.signbit().any()


def test_a_view_of_a_captured_tensor_is_never_a_stand_in():
    # Equal values, separate storages: a view reads its tensor at every call, so w2's in-place
    # update must show although w1's view of equal values came first.
    w1 = torch.arange(4.0)
    w2 = w1.clone()
    fused = functe.fuse(lambda x: (x + w1.view(-1), x + w2.view(-1)))
    fused(torch.zeros(4))
    w2.add_(10)
    first, second = fused(torch.zeros(4))
    assert torch.equal(first, w1) and torch.equal(second, w1 + 10)


def test_the_retrace_warning_names_changed_shapes():
    fused = functe.fuse(lambda x: ops.gelu(x))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for n in range(1, 16):
            fused(torch.ones(n, 4))
    with pytest.warns(functe.RetraceWarning, match=r"tensor shapes changed: f32\[15,4\] -> f32\[16,4\] \(one plan"):
        fused(torch.ones(16, 4))


def test_a_fold_over_an_inference_tensor_warns():
    # No version counter: a weight synced in place under inference_mode left the plan computing with
    # the old values, silently. A direct use reads the tensor live and is fine; so is a normal tensor.
    with torch.inference_mode():
        frozen = torch.randn(8, 8)
    normal = frozen.clone()
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    folded = functe.fuse(lambda x: ops.linear(x, frozen.to(torch.bfloat16)))
    with torch.inference_mode(), pytest.warns(functe.UnwatchedConstantWarning, match=r"inference tensors \(f32\[8,8\]"):
        folded(x)
    through_a_view = functe.fuse(lambda x: ops.linear(x, (frozen.t() * 2).to(torch.bfloat16)))
    with torch.inference_mode(), pytest.warns(functe.UnwatchedConstantWarning, match=r"inference tensors"):
        through_a_view(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        direct = functe.fuse(lambda x: ops.linear(x, frozen))
        with torch.inference_mode():
            direct(x.float())
            frozen.zero_()
            assert direct(x.float()).abs().max() == 0
        functe.fuse(lambda x: ops.linear(x, normal.to(torch.bfloat16)))(x)


def test_the_retrace_warning_takes_a_static_value_turned_tensor():
    # (the shape wording read a static entry as a tensor's: the warning itself raised TypeError)
    fused = functe.fuse(lambda x, s: ops.gelu(x) if not isinstance(s, torch.Tensor) else ops.gelu(x) + s)
    x = torch.ones(2, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(15):
            fused(x, i)
    with pytest.warns(functe.RetraceWarning, match=r"has traced 16 input signatures"):
        fused(x, torch.ones(2, 4))
