"""A fused function that reads a captured tensor through a view (``w.chunk(3)``, ``w.t()``,
``w.data``) follows the tensor when it gets a new storage or a module name gives another tensor."""

from __future__ import annotations

import pytest
import torch

import functe
from functe import ops


class _Qkv(torch.nn.Module):
    """A fused q/k/v weight split per projection: three views of one frozen parameter."""

    def __init__(self, d=8):
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.randn(3 * d, d), requires_grad=False)

    def forward(self, x):
        return _qkv(x, self.qkv)


def _qkv(x, qkv):
    q, k, v = qkv.chunk(3)
    return ops.linear(x, q) + ops.gelu(ops.linear(x, k)) + ops.linear(x, v)


def _fresh_weights(module):
    return {name: torch.randn_like(t) for name, t in module.state_dict().items()}


@pytest.mark.parametrize(
    "swap",
    [
        lambda m: m.load_state_dict(_fresh_weights(m), assign=True),
        lambda m: m.half().float(),  # (round trip: the same dtype, a new storage)
        lambda m: setattr(m.qkv, "data", torch.randn_like(m.qkv)),
    ],
    ids=["load_state_dict-assign", "half-float", "data"],
)
def test_a_view_of_a_module_weight_follows_a_new_storage(swap):
    # The plan held the views of the weight as it was at trace time and never retraced: after a
    # checkpoint swap it computed with the old weights (20.6 off in the review's repro).
    torch.manual_seed(0)
    module, x = _Qkv(), torch.randn(4, 8)
    fused = functe.fuse(module)
    torch.testing.assert_close(fused(x), module(x), rtol=0, atol=0)
    with torch.no_grad():
        module.qkv.mul_(1.0009765625)  # (bf16-exact: the half round trip changes nothing else)
    swap(module)
    torch.testing.assert_close(fused(x), module(x), rtol=0, atol=0)
    assert fused.trace_count == 2


def test_a_view_of_a_closure_tensor_follows_its_new_storage():
    w = torch.randn(8, 8)
    fused = functe.fuse(lambda x: ops.linear(x, w.t()))
    x = torch.randn(2, 8)
    fused(x)
    w.data = torch.randn(8, 8)
    torch.testing.assert_close(fused(x), ops.linear(x, w.t()), rtol=0, atol=0)
    w.add_(1.0)  # (an in-place update: the view reads it live, no retrace)
    torch.testing.assert_close(fused(x), ops.linear(x, w.t()), rtol=0, atol=0)
    assert fused.trace_count == 2


class _FusedQkv(_Qkv):
    """The module fusing its own forward (its parameters stay the module's: functional_call swaps them)."""

    def __init__(self, d=8):
        super().__init__(d)
        self.fused = functe.fuse(self._impl)

    def _impl(self, x):
        return super().forward(x)

    def forward(self, x):
        return self.fused(x)


def test_functional_call_substitutes_a_weight_read_through_a_view():
    # functional_call swaps the module's parameter: the plan kept the old views, and the output
    # (and torch.func.grad through it, all zeros) ignored the substitute.
    torch.manual_seed(0)
    module, x = _FusedQkv(), torch.randn(4, 8)
    module(x)
    substitute = {"qkv": torch.randn(24, 8)}
    got = torch.func.functional_call(module, substitute, (x,))
    torch.testing.assert_close(got, _qkv(x, substitute["qkv"]), rtol=0, atol=0)
    with pytest.raises(functe.TraceError, match=r"captured from the enclosing scope requires gradients"):
        torch.func.grad(lambda p: torch.func.functional_call(module, p, (x,)).sum())(substitute)


def test_a_weight_from_parametrize_cached_is_watched_through_its_original():
    # Inside parametrize.cached() the trace read the cached weight, not the original: updates to
    # the original went unseen for good, and the trace left a Tracer in the cache.
    from torch.nn.utils import parametrize

    class Double(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4).requires_grad_(False)
    parametrize.register_parametrization(lin, "weight", Double())
    fused = functe.fuse(lambda x: ops.linear(x, lin.weight, lin.bias))
    x = torch.randn(2, 4)
    with parametrize.cached():
        lin(x)  # (fills the cache)
        fused(x)
        lin(x)  # (an eager call in the block: it met a Tracer in the cache)
    with torch.no_grad():
        lin.parametrizations.weight.original.mul_(-1)
    torch.testing.assert_close(fused(x), lin(x), rtol=0, atol=0)


def test_a_pruned_weight_set_by_its_hook_is_followed_by_name():
    # prune keeps `weight` as a plain attribute its pre-hook sets anew at each module call:
    # fuse(lin.forward) kept the first one (1.4e3 off after two mask updates).
    from torch.nn.utils import prune

    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8).requires_grad_(False)
    prune.l1_unstructured(lin, "weight", amount=0.25)
    fused, x = functe.fuse(lin.forward), torch.randn(2, 8)
    fused(x)
    with torch.no_grad():
        lin.weight_orig.mul_(3.0)
    lin(x)  # (the hook sets lin.weight from the new original)
    torch.testing.assert_close(fused(x), lin.forward(x), rtol=0, atol=0)
    # an attribute that did not change retraces nothing (the per-call check read parameters and
    # buffers only: every call looked rebound, a retrace storm)
    for _ in range(3):
        fused(x)
    assert fused.trace_count == 2 and fused.stale_retraces == 1


def test_a_trace_inside_another_threads_cached_block_leaves_torchs_counter_balanced():
    # parametrize's cache counter is the process's: a trace that saved and restored it absolutely
    # ended at 1 (or -1) when another thread's cached() block opened (or closed) meanwhile, and
    # every parametrized weight was cached for good. Here the "other thread" opens its block in
    # the middle of the trace, from the traced function itself.
    from torch.nn.utils import parametrize

    w = torch.randn(4, 4)

    def f(x):
        parametrize._cache_enabled += 1  # (another thread's `with parametrize.cached():` begins)
        return ops.linear(x, w)

    functe.fuse(f)(torch.randn(2, 4))
    try:
        assert parametrize._cache_enabled == 1  # (its block is still open)
    finally:
        parametrize._cache_enabled -= 1


def test_a_fold_over_batchnorm_statistics_follows_training_forwards():
    # BatchNorm updates its running statistics in place without a version bump: a BN folded into a
    # weight for inference stayed stale after training forwards (0.23 off in the review's repro).
    torch.manual_seed(0)
    bn, lin = torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 4).requires_grad_(False)

    def folded(x):
        return ops.linear(x, lin.weight * (bn.running_var + bn.eps).rsqrt(), lin.bias)

    fused, x = functe.fuse(folded), torch.randn(2, 4)
    fused(x)
    with torch.no_grad():
        bn(torch.randn(16, 4) * 3)  # (training mode: the statistics move)
    torch.testing.assert_close(fused(x), folded(x), rtol=0, atol=0)
