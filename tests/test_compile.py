"""torch.compile: functe ops compile with fullgraph=True, and compiled torch.func transforms never drop
custom backward rules silently."""

from __future__ import annotations

import pytest
import torch
from helpers import make
from torch.func import grad

import functe
from functe import ops
from functe.testing import assert_close


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _block(x, w1, b1, w2, b2):
    h = ops.linear(x, w1, b1)
    h = ops.constant_scale(torch.tanh(h), 0.5)
    y = ops.add_extra_input(ops.linear(h, w2), x)
    y, skip = ops.make_extra_output(ops.bias(y, b2))
    return (ops.reshape(y, (-1,)) ** 2).sum() + skip.sum()


def _args():
    return [make(s, torch.float32).requires_grad_() for s in [(4, 8), (16, 8), (16,), (8, 16), (8,)]]


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_fullgraph_compile_with_autograd_outside_matches_eager(compiler, backend):
    args = _args()
    expected = torch.autograd.grad(_block(*args), args)
    compiled = torch.compile(_block, fullgraph=True, backend=compiler)
    got = torch.autograd.grad(compiled(*args), args)
    for g, e in zip(got, expected):
        assert_close(g, e)


class _ZeroBackward(torch.autograd.Function):
    """sin with a deliberately 'wrong' (zero) backward, to see whose backward runs."""

    @staticmethod
    def forward(x):
        return torch.sin(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return torch.zeros_like(g)


def test_pin_upstream_compile_of_func_grad_drops_custom_backward():
    """Pins pytorch#193279 as it behaves in torch 2.11-2.13: Dynamo differentiates the forward
    and ignores the Function's backward. When this test fails, upstream fixed it: revisit
    functe._vjp._refuse_compiled_transforms and docs/design.md."""
    x = torch.randn(5)
    f = lambda x: _ZeroBackward.apply(x).sum()
    assert torch.equal(grad(f)(x), torch.zeros(5))
    compiled = torch.compile(grad(f), backend="aot_eager", fullgraph=True)(x)
    assert_close(compiled, torch.cos(x))  # the true derivative: the custom backward was dropped


_zero_bwd = functe.custom_vjp("zero_bwd", lambda x: (torch.sin(x), None), lambda _, g: (torch.zeros_like(g),))


def test_functe_ops_never_drop_backward_rules_under_compiled_transforms(backend):
    x = torch.randn(5)
    f = lambda x: _zero_bwd(x).sum()
    # fullgraph=False: the graph breaks at the op, which then runs eagerly with its own backward.
    assert torch.equal(torch.compile(grad(f), backend="aot_eager")(x), torch.zeros(5))
    # fullgraph=True: an error instead of a silently different gradient.
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"maybe_current_level|functe\.zero_bwd"):
        torch.compile(grad(f), backend="aot_eager", fullgraph=True)(x)
