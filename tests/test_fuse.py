"""The fused executor: fused vs unfused numerics for every rule, transforms, compile, caching."""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import math
import os
import sys
import threading
import time
import warnings
import weakref

import optree
import pytest
import torch
from fuse_helpers import F64, assert_matches_float64, draw, plan_of
from helpers import assert_graph_replay_matches, backward_gemms, check_transforms, gradchecks, make, saved_storages
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import functe
from functe import _fuse, _fuse_keys, ops
from functe.rules import DEFAULT_RULES, RuleSet, check
from functe.rules.core import (
    BACKWARD_LINEAR_ADD,
    BACKWARD_LINEAR_SCALE,
    FORWARD_LINEAR_BIAS_ADD,
    FORWARD_LINEAR_BIAS_OP_ADD,
    FORWARD_LINEAR_SCALE_ADD,
)
from functe.testing import assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LEADS = [(), (0,), (3,), (2, 5), (2, 1, 3)]  # 1-D x, empty, rows, and more leading dims


def _linear_add(x, w, b, r):
    return ops.linear(x, w, b) + r


def _linear_bias_op_add(x, w, b, r):
    return ops.add_extra_input(ops.bias(ops.linear(x, w), b), r)


def _linear_scale_add(x, w, b, r, *, scale):
    return r + ops.linear(x, w, b) * scale


def _fork_linear(x, w, b):
    y, extra = ops.make_extra_output(x)
    return ops.linear(y, w, b), extra


def _linear_scale(x, w, b, *, scale):
    return ops.constant_scale(ops.linear(x, w, b), scale)


def _block(x, w1, w2, b2, *, scale):
    """Four rules at once: a scaled residual linear, then a forked residual into a biased linear."""
    h = ops.linear(x, w1) * scale + x
    y, skip = ops.make_extra_output(h)
    return ops.linear(y, w2, b2) + skip


CASES = {
    "forward_linear_bias_add": (_linear_add, True, FORWARD_LINEAR_BIAS_ADD),
    "forward_linear_bias_op_add": (_linear_bias_op_add, True, FORWARD_LINEAR_BIAS_OP_ADD),
    "forward_linear_scale_add": (_linear_scale_add, True, FORWARD_LINEAR_SCALE_ADD),
    "backward_linear_add": (_fork_linear, False, BACKWARD_LINEAR_ADD),
    "backward_linear_scale": (_linear_scale, False, BACKWARD_LINEAR_SCALE),
}


def _args(name, lead, k, n, dtype, gen, *, bias=True):
    x = draw((*lead, k), dtype, gen)
    w = draw((n, k), dtype, gen)
    bias = (bias and name != "forward_linear_scale_add") or name == "forward_linear_bias_op_add"
    b = draw((n,), dtype, gen) if bias else None
    if CASES[name][1]:
        return [x, w, b, draw((*lead, n), dtype, gen)]
    if name == "backward_linear_add":
        return [x, draw((k, k), dtype, gen), None if b is None else draw((k,), dtype, gen)]
    return [x, w, b]


@pytest.mark.parametrize("name", list(CASES))
@settings(max_examples=6, deadline=None)
@given(
    lead=st.sampled_from(LEADS),
    k=st.integers(1, 24),
    n=st.integers(1, 24),
    dtype=st.sampled_from(DTYPES),
    bias=st.booleans(),
    scale=st.sampled_from([1.0, 0.0, -2.5, 3.5]),
    seed=st.integers(0, 2**16),
)
def test_fused_matches_unfused_float64(name, lead, k, n, dtype, bias, scale, seed):
    fn, _, rule = CASES[name]
    gen = torch.Generator().manual_seed(seed)
    args = _args(name, lead, k, n, dtype, gen, bias=bias)
    static = {"scale": scale} if "scale" in name else {}
    fused = functe.fuse(lambda *a: fn(*a, **static))
    plan = fused.plan(*args)
    assert plan.stats[rule.phase].fired == {name: 1}
    assert_matches_float64(fused, lambda *a: fn(*a, **static), args, seed=seed, what=name)


@settings(max_examples=8, deadline=None)
@given(
    lead=st.sampled_from(LEADS),
    k=st.integers(1, 16),
    dtype=st.sampled_from([torch.float32, F64]),
    scale=st.sampled_from([1.0, -2.5, 0.5]),
    seed=st.integers(0, 2**16),
)
def test_block_with_every_rule_matches_unfused_float64(lead, k, dtype, scale, seed):
    # A multi-stage program rounds its intermediates (here h) in the fused and the unfused
    # program alike, so 16-bit dtypes are covered stage by stage by the test above.
    gen = torch.Generator().manual_seed(seed)
    args = [draw((*lead, k), dtype, gen), draw((k, k), dtype, gen), draw((k, k), dtype, gen), draw((k,), dtype, gen)]
    fused = functe.fuse(_block)
    plan = fused.plan(*args, scale=scale)
    assert sum(plan.stats["forward"].fired.values()) == 2 and sum(plan.stats["backward"].fired.values()) == 2
    assert_matches_float64(lambda *a: fused(*a, scale=scale), lambda *a: _block(*a, scale=scale), args, seed=seed)


@pytest.mark.parametrize("rule", [FORWARD_LINEAR_BIAS_ADD, FORWARD_LINEAR_BIAS_OP_ADD, BACKWARD_LINEAR_SCALE])
@settings(max_examples=4, deadline=None)
@given(lead=st.sampled_from(LEADS), k=st.integers(1, 16), n=st.integers(1, 16), dtype=st.sampled_from(DTYPES))
def test_check_on_the_rules_own_pattern(rule, lead, k, n, dtype):
    x, w, b, r = torch.empty(*lead, k), torch.empty(n, k), torch.empty(n), torch.empty(*lead, n)
    example = {"x": x, "w": w, "b": b, "r": r}
    if rule is BACKWARD_LINEAR_SCALE:
        del example["r"]
    example = {key: v.to(dtype) for key, v in example.items()}
    check(rule, example, static={"scale": {"scale": -0.75}})


def test_check_synthesizes_forks_and_scales():
    x, w = torch.empty(3, 5), torch.empty(5, 5)
    check(BACKWARD_LINEAR_ADD, {"x": x, "w": w, "b": None})
    check(FORWARD_LINEAR_SCALE_ADD, {"x": x, "w": w, "b": None, "r": x}, static={"scale": {"scale": 3.5}})
    with pytest.raises(
        AssertionError, match=r"rule forward_linear_scale_add did not fire \(declined: .*linear has a bias"
    ):
        check(FORWARD_LINEAR_SCALE_ADD, {"x": x, "w": w, "b": torch.empty(5), "r": x}, static={"scale": {"scale": 2.0}})


def test_every_rule_on_both_backends(backend):
    gen = torch.Generator().manual_seed(1)
    for name, (fn, _, rule) in CASES.items():
        args = _args(name, (2, 3), 5, 4, torch.float32, gen)
        static = {"scale": -2.5} if "scale" in name else {}
        fused = functe.fuse(lambda *a, fn=fn, static=static: fn(*a, **static))
        assert fused.plan(*args).stats[rule.phase].fired == {name: 1}
        assert_matches_float64(fused, lambda *a, fn=fn, static=static: fn(*a, **static), args, what=name)


# ----------------------------------------------------------------------------- transforms


def _block_args(dtype=F64):
    return [make((4, 6), dtype), make((6, 6), dtype), make((6, 6), dtype), make((6,), dtype)]


def test_torch_func_transforms_through_fuse(backend):
    fused = functe.fuse(_block)
    check_transforms(
        lambda *a: fused(*a, scale=-0.5), lambda *a: _block(*a, scale=-0.5), _block_args(), higher_order=False
    )
    assert fused.trace_count == 1  # vmap sees the same logical shapes


def test_second_order_through_intermediate_residuals_raises():
    fused = functe.fuse(_block)
    args = _block_args()

    def loss(*a):
        return (fused(*a, scale=0.5) ** 2).sum()

    msg = r"functe\.fuse\(_block\): second-order derivatives are not supported: the fused plan.s backward"
    every = (0, 1, 2, 3)  # (with the weights frozen at every level their intermediates are not kept)
    with pytest.raises(functe.TransformError, match=msg):
        torch.func.grad(lambda *a: sum(g.sum() for g in torch.func.grad(loss, argnums=every)(*a)), argnums=every)(*args)
    # x alone differentiated twice: the plan's variant for a trainable x keeps no intermediate, exact
    exact = torch.func.grad(lambda *a: torch.func.grad(loss)(*a).sum())(*args)
    unfused = torch.func.grad(lambda *a: torch.func.grad(lambda *b: (_block(*b, scale=0.5) ** 2).sum())(*a).sum())
    assert_close(exact, unfused(*args))
    xs = [a.clone().requires_grad_() for a in args]
    (g,) = torch.autograd.grad(loss(*xs), xs[:1], create_graph=True)  # first order with a graph: fine
    with pytest.raises(functe.TransformError, match=msg):
        g.sum().backward()


def test_second_order_refused_with_a_plain_sum_loss():
    # The cotangent of .sum() is a constant: the guard must still be on the graph (it returned zeros).
    fused = functe.fuse(_block)
    args = _block_args()
    msg = r"functe\.fuse\(_block\): second-order derivatives are not supported: the fused plan.s backward"
    every = (0, 1, 2, 3)
    with pytest.raises(functe.TransformError, match=msg):
        inner = torch.func.grad(lambda *b: fused(*b, scale=0.5).sum(), argnums=every)
        torch.func.grad(lambda *a: sum(g.sum() for g in inner(*a)), argnums=every)(*args)
    xs = [a.clone().requires_grad_() for a in args]
    (g,) = torch.autograd.grad(fused(*xs, scale=0.5).sum(), xs[:1], create_graph=True)
    with pytest.raises(functe.TransformError, match=msg):
        torch.autograd.grad(g.sum(), xs[1])


_FROZEN = torch.randn(5, 4, dtype=F64)


@pytest.mark.parametrize(
    "program",
    [
        lambda x, b: ops.linear(x, _FROZEN, b),
        lambda x, b: ops.dropout(ops.linear(x, _FROZEN, b), 0.3, seed=11),
        lambda x, b: ops.linear(ops.linear(x, _FROZEN, b), 2.0 * _FROZEN.t()),
    ],
    ids=["frozen weight", "int seed", "folded constant"],
)
def test_second_order_is_exact_when_the_backward_keeps_folded_constants(program, backend):
    # A plan literal kept for the backward (a captured frozen weight, a dropout seed, a constant
    # folded at trace time) was taken for an intermediate: second order refused, while it is exact.
    fused, x, b = functe.fuse(program), make((3, 4), F64), make((5,), F64)
    loss = lambda f: lambda x, b: (f(x, b) ** 2).sin().sum()
    hessians = [torch.func.hessian(loss(f), argnums=(0, 1))(x, b) for f in (fused, program)]
    for got, want in zip(optree.tree_leaves(hessians[0]), optree.tree_leaves(hessians[1]), strict=True):
        assert_close(got, want)
    xs = [x.clone().requires_grad_(), b.clone().requires_grad_()]
    (g,) = torch.autograd.grad(loss(fused)(*xs), xs[:1], create_graph=True)
    ys = [x.clone().requires_grad_(), b.clone().requires_grad_()]
    (g_ref,) = torch.autograd.grad(loss(program)(*ys), ys[:1], create_graph=True)
    for got, want in zip(torch.autograd.grad(g.cos().sum(), xs), torch.autograd.grad(g_ref.cos().sum(), ys)):
        assert_close(got, want)


def test_second_order_is_exact_when_residuals_are_inputs(backend):
    fused = functe.fuse(_linear_scale)
    args = [make((3, 4), F64), make((5, 4), F64), make((5,), F64)]
    check_transforms(lambda *a: fused(*a, scale=2.0), lambda *a: _linear_scale(*a, scale=2.0), args)
    gradchecks(lambda *a: fused(*a, scale=2.0), args)


@pytest.mark.parametrize(
    "program",
    [
        lambda x: ops.gelu(x) * 2.0,
        lambda x: ops.relu(x) + x,
        lambda x: ops.swiglu(x),
        lambda x: ops.qgelu(x) * 0.5 + ops.silu(x),
    ],
    ids=["gelu", "relu+x", "swiglu", "qgelu+silu"],
)
def test_second_order_through_kernels_under_torch_func(program, backend):
    # grad(grad(fuse(gelu))) failed torch's level check (INTERNAL ASSERT "escaped?"): the backward
    # plan, differentiated inside torch.func.vjp in a Function's backward, called a kernel's
    # Function whose own backward opened torch.func.vjp again
    fused, x = functe.fuse(program), make((3, 4), F64)
    g = torch.func.grad

    def grad_grad(f):
        return g(lambda x: g(lambda x: f(x).sin().sum())(x).cos().sum())(x)

    assert_close(grad_grad(fused), grad_grad(program))
    loss = lambda f: lambda x: f(x).sin().sum()
    assert_close(torch.func.hessian(loss(fused))(x), torch.func.hessian(loss(program))(x))


class _Residual(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)

    def forward(self, x):
        h = self.a(x) + x
        return self.b(h) + h


class _FrozenBlock(torch.nn.Module):
    """A frozen module whose forward is a fused bound method reading its weights by name."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(make((8, 8), F64), requires_grad=False)
        self.register_buffer("g", make((8,), F64))
        self.fused = functe.fuse(self._impl)

    def _impl(self, x):
        return ops.rms_norm(ops.linear(x, self.w), self.g)

    def forward(self, x):
        return self.fused(x)


def _frozen_block_reference(w, g, x):
    h = x @ w.T
    return h * torch.rsqrt(h.square().mean(-1, keepdim=True) + 1e-5) * g


class _Frozen(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(make((8, 8)), requires_grad=False)

    def forward(self, x):
        return ops.gelu(ops.linear(x, self.w))


class _Calling(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


@pytest.mark.parametrize(
    "register, kind",
    [
        (lambda m, seen: m.register_forward_hook(lambda mod, a, out: seen.append(out)), "forward hooks"),
        (lambda m, seen: m.register_forward_pre_hook(lambda mod, a: seen.append(a)), "forward pre-hooks"),
        (lambda m, seen: m.register_full_backward_hook(lambda mod, gi, go: seen.append(go)), "backward hooks"),
        (
            lambda m, seen: torch.nn.modules.module.register_module_forward_hook(lambda *a: seen.append(a)),
            "global forward hooks",
        ),
    ],
)
def test_a_module_with_hooks_is_refused_by_the_trace(register, kind):
    # A traced program calls its modules once: a forward hook ran at trace time only, on a Tracer, and
    # never again (activation logging silently stopped); a full backward hook failed on Tensor.view_as.
    module, seen = _Frozen(), []
    handle = register(module, seen)
    try:
        with pytest.raises(functe.TraceError, match=f"module _Frozen has {kind}: a traced"):
            functe.fuse(module)(make((4, 8)))
        with pytest.raises(functe.TraceError, match=f"module _Frozen has {kind}"):
            functe.fuse(lambda x: module(x) * 2.0)(make((4, 8)))
        assert seen == []
    finally:
        handle.remove()
    wrapper = _Calling(functe.fuse(_Frozen()))  # (hooks on a module calling the fused one)
    wrapper.register_forward_hook(lambda mod, a, out: seen.append(out))
    for _ in range(2):
        wrapper(make((4, 8)))
    assert len(seen) == 2 and all(type(out) is torch.Tensor for out in seen)


def test_modules_without_user_hooks_pass_nested_traces_and_derived_weight_hooks():
    # A trace inside a trace took the outer trace's own check for a user's global hook; weight_norm's
    # and pruning's forward pre-hooks only derive the weight from captured tensors (fused as before)
    module = _Frozen()
    x = make((4, 8))

    def inspects_then_calls(x):
        functe.trace(module)(x)  # (an op list of a sub-block, made while tracing)
        return module(x)

    assert torch.equal(functe.fuse(inspects_then_calls)(x), module(x))
    with warnings.catch_warnings():  # (the old weight_norm is deprecated, and still used)
        warnings.simplefilter("ignore", FutureWarning)
        weight_norm = torch.nn.utils.weight_norm(_Frozen(), "w")
    for derive in (
        lambda m: weight_norm,
        lambda m: torch.nn.utils.prune.l1_unstructured(m, "w", amount=0.5),
    ):
        module = derive(_Frozen()).requires_grad_(False)
        fused = functe.fuse(module)
        assert torch.equal(fused(x), module(x))
    assert not torch.nn.modules.module._global_forward_pre_hooks


def test_fake_mode_plans_take_one_slot():
    # each memory estimate under a fresh FakeTensorMode kept a plan holding its mode (a leak), and
    # warned about static arguments changing on every call
    from torch._subclasses.fake_tensor import FakeTensorMode

    fused = functe.fuse(lambda x, w: ops.linear(x, w, torch.zeros(8)))
    x, w = make((4, 16)), make((8, 16))
    expected = fused(x, w)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(_fuse.RETRACE_WARNING + 2):
            with FakeTensorMode() as mode:
                fused(mode.from_tensor(x), mode.from_tensor(w))
    assert len(fused._plans) == 2 and fused.trace_count == _fuse.RETRACE_WARNING + 3
    assert torch.equal(fused(x, w), expected) and fused.trace_count == _fuse.RETRACE_WARNING + 3


def test_concurrent_fake_calls_keep_every_cached_key_on_its_own_plan():
    # Two threads' fake calls read the shared fake slot before either set it: both keys ended on one
    # index, one of them on the other signature's plan (traced for other shapes, under another mode)
    from torch._subclasses.fake_tensor import FakeTensorMode

    def fn(x):
        if threading.current_thread().name == "slow":
            time.sleep(0.5)  # (the first thread traces slowly: the second one looks up meanwhile)
        return ops.gelu(x) * 2.0

    fused = functe.fuse(fn)
    with FakeTensorMode() as mode:
        fused(mode.from_tensor(make((1, 8))))  # (fills the fake slot)

    def call(rows, delay):
        time.sleep(delay)
        with FakeTensorMode() as mode:
            fused(mode.from_tensor(make((rows, 8))))

    threads = [threading.Thread(target=call, args=(2, 0.0), name="slow"), threading.Thread(target=call, args=(3, 0.1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for key, index in fused._index.items():
        assert [v.shape for v in fused._plans[index].program.inputs] == [key[2][0]], key


def test_a_user_op_named_like_a_fused_plan_keeps_its_name_in_the_second_order_error():
    def fwd(x):
        y = torch.sin(x)
        return y, (y * 2,)  # (an intermediate residual: first order only)

    op = functe.custom_vjp("fused_attention", fwd, lambda res, dy: (res[0] * dy / 2,))
    x = make((3,), F64).requires_grad_()
    (g,) = torch.autograd.grad(op(x).sum(), x, create_graph=True)
    with pytest.raises(functe.TransformError, match=r"^functe\.fused_attention: second-order .* its backward rule"):
        g.sum().backward()


def test_a_fused_module_under_functional_call_uses_the_tensors_given():
    # The plan held the weights it captured at its trace: functional_call computed with the module's
    # own weights (or, called first, left the substituted ones in place for later calls), and
    # torch.func.grad through it came out zero, silently.
    block, x = _FrozenBlock(), make((4, 8), F64)
    w, g = make((8, 8), F64), make((8,), F64)
    own = _frozen_block_reference(block.w, block.g, x)
    assert_close(block(x), own)
    out = torch.func.functional_call(block, {"w": w, "g": g}, (x,))
    assert_close(out, _frozen_block_reference(w, g, x))
    assert_close(block(x), own)
    with pytest.raises(functe.TraceError, match="captured from the enclosing scope requires gradients"):
        torch.func.grad(lambda w: torch.func.functional_call(block, {"w": w}, (x,)).sum())(w)
    with torch.no_grad():  # (load_state_dict(assign=True) rebinds the names too)
        block.load_state_dict({"w": torch.nn.Parameter(w, requires_grad=False), "g": g}, assign=True)
    assert_close(block(x), _frozen_block_reference(w, g, x))


def test_a_fused_module_sees_a_replaced_submodule_and_an_untied_weight():
    # (bound by the first name only, rebinding a tied weight's second name went unnoticed)
    enc, dec = torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 8, bias=False)
    dec.weight = enc.weight
    net = torch.nn.ModuleDict({"enc": enc, "dec": dec}).requires_grad_(False)
    fused = functe.fuse(lambda x: ops.linear(ops.linear(x, net["enc"].weight), net["dec"].weight))
    eager = lambda x: x @ net["enc"].weight.T @ net["dec"].weight.T
    x = make((3, 8))
    assert_close(fused(x), eager(x))
    net["dec"].weight = torch.nn.Parameter(make((8, 8)), requires_grad=False)
    assert_close(fused(x), eager(x))
    net["enc"] = torch.nn.Linear(8, 8, bias=False).requires_grad_(False)
    assert_close(fused(x), eager(x))
    assert fused.trace_count == 3


class _DropoutInTraining(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Sequential(torch.nn.Linear(8, 8))

    def forward(self, x, seed):
        h = ops.linear(x, self.inner[0].weight, self.inner[0].bias)
        return ops.dropout(h, 0.5, seed=seed) if self.inner.training else h  # (a submodule's flag)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_fused_module_follows_train_and_eval(compiled):
    # A trace reads `self.training` once: after model.eval() the plan traced in training kept
    # dropping units (and the other way round). Plans are keyed by the modules' training flags.
    torch._dynamo.reset()
    model = _DropoutInTraining().requires_grad_(False)
    for fused in (functe.fuse(model), functe.fuse(lambda x, seed: model(x, seed))):
        run = torch.compile(fused, backend="aot_eager", fullgraph=True) if compiled else fused
        x, seed = make((4, 8)), torch.tensor(7)
        for training in (True, False, True, False):
            model.train(training)
            assert torch.equal(run(x, seed), model(x, seed)), training
        assert fused.trace_count == 2  # (one plan per mode, both kept)
    torch._dynamo.reset()


class _Act(torch.nn.Module):
    def __init__(self, name):
        super().__init__()
        self.name = name

    def forward(self, x):
        return ops.activation(x, self.name)


def test_modules_reached_any_way_key_the_plans_and_a_replaced_one_retraces():
    # The flags keyed only modules the function named (closure, globals): a module passed as an
    # argument, held in a list or reached through a helper kept its training plan after eval(); and
    # a replaced submodule without tensors (an activation module) kept running the old one's code.
    dropout = _DropoutInTraining().requires_grad_(False)
    held = [dropout]
    x, seed = make((4, 8)), torch.tensor(7)
    for fn in (lambda x, m: m(x, seed), lambda x, m: held[0](x, seed)):
        fused = functe.fuse(fn)
        for training in (True, False, True):
            dropout.train(training)
            assert torch.equal(fused(x, dropout), dropout(x, seed)), training
        assert fused.trace_count == 2
    block = torch.nn.Sequential(_Act("gelu"))
    fused = functe.fuse(lambda x: block(x))
    assert torch.equal(fused(x), ops.gelu(x))
    block[0] = _Act("relu")
    assert torch.equal(fused(x), ops.relu(x)) and fused.trace_count == 2


def test_the_retrace_warning_names_changing_training_flags():
    layers = torch.nn.ModuleList(_Act("gelu") for _ in range(_fuse.RETRACE_WARNING))
    fused = functe.fuse(lambda x: layers[0](x))
    with pytest.warns(functe.RetraceWarning, match="the training flags of the modules it reaches changed"):
        for layer in layers:  # (one more module in eval mode each call: a new combination)
            layer.eval()
            fused(make((3,)))


def test_a_deep_copy_of_a_fused_module_computes_with_its_own_weights():
    # (the copied plans' generated functions kept the original's weights in their globals)
    block, x = _FrozenBlock(), make((4, 8), F64)
    block(x)
    twin = copy.deepcopy(block)
    with torch.no_grad():
        twin.w.mul_(-2.0)
    assert_close(twin(x), _frozen_block_reference(twin.w, twin.g, x))
    assert_close(block(x), _frozen_block_reference(block.w, block.g, x))


def test_a_module_converted_after_the_trace_is_checked_as_eager():
    # (module.half() swaps its parameters' .data: the cached plan ran with an f16 weight and failed
    # inside torch, "expected m1 and m2 to have the same dtype")
    norm = torch.nn.LayerNorm(8).requires_grad_(False)
    fused = functe.fuse(lambda x: ops.layer_norm(x, norm.weight, norm.bias))
    x = make((4, 8))
    assert_close(fused(x), torch.nn.functional.layer_norm(x, (8,), norm.weight, norm.bias))
    norm.to(torch.bfloat16)
    with pytest.raises(functe.DTypeError, match=r"layer_norm: argument 'weight' .* got bf16\[8\]"):
        fused(x)
    y = fused(x.bfloat16())
    assert y.dtype == torch.bfloat16 and fused.trace_count == 2  # (the f32 retrace raised)


def test_functional_call_over_a_module_params_dict():
    module = _Residual().double()
    params = {k: v.detach() for k, v in module.named_parameters()}

    @functe.fuse
    def forward(p, x):
        h = ops.linear(x, p["a.weight"], p["a.bias"]) + x
        return ops.linear(h, p["b.weight"], p["b.bias"]) + h

    x = make((5, 6), F64)
    reference = lambda p, x: torch.func.functional_call(module, p, (x,))
    assert_close(forward(params, x), reference(params, x))
    grads = torch.func.grad(lambda p: forward(p, x).sum())(params)
    expected = torch.func.grad(lambda p: reference(p, x).sum())(params)
    for k in params:
        assert_close(grads[k], expected[k], msg=k)
    per_example = torch.func.vmap(torch.func.grad(lambda p, x: forward(p, x[None]).sum()), in_dims=(None, 0))(params, x)
    assert per_example["a.weight"].shape == (5, 6, 6)
    assert_close(per_example["b.bias"].sum(0), grads["b.bias"])
    assert forward.trace_count == 2  # (5, 6) and the per-example (1, 6)


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_compile_fullgraph_with_autograd_outside(compiler, backend):
    if compiler == "inductor" and backend == "interpret":
        pytest.skip("one compiler suffices for the interpreted kernels")
    torch._dynamo.reset()
    fused = functe.fuse(_block)
    args = [a.float().requires_grad_() for a in _block_args()]
    loss = lambda *a: (fused(*a, scale=0.5) * torch.arange(6.0)).sum()
    expected = torch.autograd.grad(loss(*args), args)
    compiled = torch.compile(loss, fullgraph=True, backend=compiler)
    for _ in range(2):
        got = torch.autograd.grad(compiled(*args), args)
        for g, e in zip(got, expected):
            assert_close(g, e)
    assert fused.trace_count == 1  # eager and compiled calls share the plan
    compiled_fused = torch.compile(fused, fullgraph=True, backend=compiler)  # the Fused object itself
    weight = torch.arange(6.0)
    got = torch.autograd.grad((compiled_fused(*args, scale=0.5) * weight).sum(), args)
    for g, e in zip(got, expected):
        assert_close(g, e)
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- the cache and the call paths


def test_a_new_signature_retraces_and_the_same_one_does_not():
    fused = functe.fuse(_linear_scale)
    x, w, b = make((3, 4)), make((5, 4)), make((5,))
    for _ in range(3):
        fused(x, w, b, scale=2.0)
    assert fused.trace_count == 1
    fused(make((7, 4)), w, b, scale=2.0)  # new shape
    fused(x.double(), w.double(), b.double(), scale=2.0)  # new dtypes
    fused(x, w, b, scale=3.0)  # new static argument
    fused(x, w, None, scale=2.0)  # new structure
    assert fused.trace_count == 5
    fused(x.requires_grad_(), w, b, scale=2.0)  # grad requirements do not change the plan
    torch.func.vmap(lambda x: fused(x, w, b, scale=2.0))(make((2, 3, 4)))
    assert fused.trace_count == 5


def test_a_plan_traced_under_a_fake_mode_serves_only_that_mode():
    # A fake call (memory estimation, make_fx's fake tracing) keyed its plan as a real call with the
    # same shapes: the plan's constants (a tensor the function makes, a folded capture, an int
    # seed's tensor) were fake, and the next real step failed in torch; the other way round too.
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    c = make((8, 16))
    fns = [
        lambda x, w: ops.linear(x, w, torch.zeros(8)),
        lambda x, w: ops.linear(x, w + c * 2.0),  # (a captured real tensor: the mode must allow it)
        lambda x, w: ops.dropout(ops.linear(x, w), 0.5, seed=7),
    ]
    x, w = make((4, 16)), make((8, 16))
    for fn in fns:
        expected = fn(x, w)
        for first_fake in (True, False):
            fused = functe.fuse(fn)
            if not first_fake:
                assert torch.equal(fused(x, w), expected)
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                out = fused(mode.from_tensor(x), mode.from_tensor(w))
            assert isinstance(out, FakeTensor) and out.shape == expected.shape
            assert torch.equal(fused(x, w), expected)
            assert fused.trace_count == 2
    # a module found by the trace (passed as an argument) re-keyed the plan: the fake slot's other
    # key kept pointing at the slot, which then held another signature's plan
    linear = torch.nn.Linear(4, 4).requires_grad_(False)
    fused = functe.fuse(lambda m, x: m(x).reshape(x.shape[0] * 4))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        for n in (2, 3, 2):
            assert fused(linear, mode.from_tensor(make((n, 4)))).shape == (n * 4,)


@pytest.mark.parametrize("tracing_mode", ["real", "fake"])
def test_the_callers_dispatch_modes_do_not_see_the_traces_shape_runs(tracing_mode):
    # The trace infers shapes by running forward rules on meta tensors, under the caller's modes:
    # FlopCounterMode counted a first call's GEMMs twice, make_fx put the meta computation into its
    # graph (dead nodes on device "meta").
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils.flop_counter import FlopCounterMode

    def block(x, w, b):
        return ops.activation(ops.linear(x, w, b), "gelu")

    args = [make((4, 8)).requires_grad_(), make((6, 8)).requires_grad_(), make((6,)).requires_grad_()]
    counts = []
    for fn in (block, functe.fuse(block), functe.fuse(block)):
        with FlopCounterMode(display=False) as counter:
            fn(*args).sum().backward()
        counts.append(counter.get_total_flops())
    assert counts[0] > 0 and counts == [counts[0]] * 3, counts
    graph = make_fx(functe.fuse(block), tracing_mode=tracing_mode)(*(a.detach() for a in args)).graph
    targets = [str(node.target) for node in graph.nodes if node.op == "call_function"]
    assert "meta" not in str(graph) and targets.count("aten.addmm.default") == 1, targets
    # (an opaque op's shape run is on fake tensors: under make_fx's fake tracing it was in the graph too)
    tanh = functe.opaque(torch.tanh)
    graph = make_fx(functe.fuse(lambda x: tanh(x)), tracing_mode=tracing_mode)(args[0].detach()).graph
    targets = [str(node.target) for node in graph.nodes if node.op == "call_function"]
    assert targets == ["aten.tanh.default"], targets


def test_the_retrace_warning_names_string_subclasses_it_does_not_take_for_floats():
    # Floats were keyed by their hex bits, and any string under a non-str type was read back as one:
    # the 16th signature of an np.str_ (or StrEnum) static leaf raised ValueError building the warning.
    import enum

    import numpy as np

    Names = enum.StrEnum("Names", [f"n{i}" for i in range(_fuse.RETRACE_WARNING)])
    for kind in (np.str_, Names):
        fused = functe.fuse(lambda x, name: ops.constant_scale(x, 2.0))
        with pytest.warns(functe.RetraceWarning, match="static leaves changed") as caught:
            for i in range(_fuse.RETRACE_WARNING):
                fused(make((3,)), kind(f"n{i}"))
        assert repr(kind(f"n{_fuse.RETRACE_WARNING - 1}")) in str(caught[0].message)
    assert _fuse_keys._shown(_fuse_keys._static_key(np.float32(-0.0))) == "-0.0"


def test_a_static_value_changing_every_call_warns_naming_it_and_again_at_each_doubling():
    # A step count passed as a Python int is static: every step traced a new plan, and kept it.
    # The warning came once, at the 16th trace, while a long run's plans kept piling up.
    fused = functe.fuse(lambda x, step: ops.dropout(x, 0.5, seed=step))
    x = make((2, 3))
    steps = 4 * _fuse.RETRACE_WARNING + 3
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            fused(x, step)
    assert fused.trace_count == steps
    warning, *again = [w for w in caught if issubclass(w.category, functe.RetraceWarning)]
    assert [str(w.message).split(" (")[0] for w in again] == [
        f"functe.fuse(<lambda>) has traced {n} input signatures"
        for n in (2 * _fuse.RETRACE_WARNING, 4 * _fuse.RETRACE_WARNING)
    ]
    assert f"traced {_fuse.RETRACE_WARNING} input signatures" in str(warning.message)
    assert f"static leaves changed: {_fuse.RETRACE_WARNING - 2} -> {_fuse.RETRACE_WARNING - 1}" in str(warning.message)
    assert _fuse_keys._shown(_fuse_keys._static_key(-0.0)) == "-0.0"
    assert _fuse_keys._shown(_fuse_keys._static_key(float("inf"))) == "inf"
    assert warning.filename == __file__  # points at the caller's line
    # the remedy: the seed as a tensor is an input, one plan for every step
    fused = functe.fuse(lambda x, step: ops.dropout(x, 0.5, seed=step))
    for step in range(_fuse.RETRACE_WARNING + 3):
        torch.testing.assert_close(fused(x, torch.tensor(step)), ops.dropout(x, 0.5, seed=step), rtol=0, atol=0)
    assert fused.trace_count == 1


def test_retrace_warnings_come_at_the_threshold_and_its_doublings(monkeypatch):
    for threshold in (16, 10, 24):
        monkeypatch.setattr(_fuse, "RETRACE_WARNING", threshold)
        warned = [n for n in range(1, 8 * threshold + 1) if _fuse._warns_at(n)]
        assert warned == [threshold, 2 * threshold, 4 * threshold, 8 * threshold]


def test_dict_key_order_and_key_types_are_part_of_the_signature():
    # optree's spec equality ignores both: the first plan was reused for {"b", "a"} and for {1.0: ..}.
    def fn(d):
        first, second = d.values()
        return {k: 3.0 * v for k, v in d.items()}, first + -1.0 * second

    fused = functe.fuse(fn)
    x, y = make((2, 3)), make((2, 3))
    for d in ({"a": x, "b": y}, {"b": y, "a": x}, {1: x, "z": y}, {1.0: x, "z": y}, {True: x, "z": y}):
        got, want = fused(d), fn(d)
        assert [(type(k), k) for k in got[0]] == [(type(k), k) for k in want[0]]
        assert torch.equal(got[1], want[1])
    assert fused.trace_count == 5
    # ... and inside other nodes: a pytree_dataclass's field, a deque (only dicts among the builtin
    # containers were walked: the plan for {"a", "b"} served {"b", "a"} with the outputs swapped)
    fused = functe.fuse(lambda p: fn(p.layers[0]))
    for d in ({"a": x, "b": y}, {"b": y, "a": x}, {1: x, "z": y}, {True: x, "z": y}):
        for p in (_Layers(collections.deque([d])), _Layers(collections.deque([d, None]))):
            got, want = fused(p), fn(d)
            assert [(type(k), k) for k in got[0]] == [(type(k), k) for k in want[0]]
            assert torch.equal(got[1], want[1])
    assert fused.trace_count == 8


@functe.pytree_dataclass
class _Layers:
    layers: collections.deque


def test_a_captured_constant_output_is_returned_as_is_and_left_alone():
    # The constant went out through the fused Function: autograd gave the caller's own tensor a
    # grad_fn (and requires_grad), and the next trace refused it as a grad-requiring capture.
    mask = torch.ones(3)
    fused = functe.fuse(lambda x: (x * 2.0, mask))
    for x in (make((3,)).requires_grad_(), make((2, 3)).requires_grad_()):
        y, m = fused(x)
        assert m is mask and not mask.requires_grad and mask.grad_fn is None
        assert torch.equal(torch.autograd.grad(y.sum(), x)[0], torch.full_like(x, 2.0))
    assert torch.equal(torch.func.grad(lambda x: fused(x)[0].sum())(make((3,))), torch.full((3,), 2.0))
    assert torch.func.vmap(lambda x: fused(x)[1])(make((4, 3))).shape == (4, 3)
    only = functe.fuse(lambda x: {"m": mask})  # nothing depends on x
    assert only(make((3,)).requires_grad_())["m"] is mask and not mask.requires_grad


@pytest.mark.parametrize("scale", [0.0, -0.0])
def test_a_zero_constant_scale_keeps_ieee_nan_in_the_fused_gemms(scale):
    # BLAS skips the product at alpha = 0: 0·inf came out 0 instead of NaN from forward_linear_add
    # and from backward_linear_scale (dW also lost its NaN row and the sign of its zeros).
    inf = float("inf")
    forward = lambda x, w, r: scale * ops.linear(x, w) + r
    backward = lambda x, w: scale * ops.linear(x, w)
    x, w, r = torch.tensor([[1.0, inf], [2.0, -3.0]]), make((2, 2)), make((2, 2))
    assert plan_of(forward, x, w, r).stats["forward"].fired == {"forward_linear_scale_add": 1}
    torch.testing.assert_close(functe.fuse(forward)(x, w, r), forward(x, w, r), rtol=0, atol=0, equal_nan=True)
    x, w = make((2, 2)).requires_grad_(), make((2, 2)).requires_grad_()
    assert plan_of(backward, x, w).stats["backward"].fired == {"backward_linear_scale": 1}
    ct = torch.tensor([[inf, 1.0], [-2.0, 0.5]])
    got = torch.autograd.grad(functe.fuse(backward)(x, w), (x, w), ct)
    want = torch.autograd.grad(backward(x, w), (x, w), ct)
    for g, e in zip(got, want):
        assert g.isnan().any()
        torch.testing.assert_close(g, e, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(torch.signbit(g), torch.signbit(e))


@pytest.mark.parametrize("backend", ["torch", "interpret"])
def test_an_fp16_bias_gradient_scaled_down_does_not_overflow_when_fused(backend):
    # backward_linear_scale summed dy in fp16 (Σ = 1e5 > 65504: inf) before applying the 1/8 the
    # unfused chain applies to each element first (12,496)
    f = lambda x, w, b: 0.125 * ops.linear(x, w, b)
    x, w, b = (make(s, torch.float16).requires_grad_() for s in [(100, 8), (3, 8), (3,)])
    ct = torch.full((100, 3), 1000.0, dtype=torch.float16)
    with functe.use_backend(backend):
        assert plan_of(f, x, w, b).stats["backward"].fired == {"backward_linear_scale": 1}
        got = torch.autograd.grad(functe.fuse(f)(x, w, b), (x, w, b), ct)
        want = torch.autograd.grad(f(x, w, b), (x, w, b), ct)
    assert torch.isfinite(got[2]).all()
    for g, e in zip(got, want):
        rtol, atol = functe.testing.tolerance(torch.float16)
        torch.testing.assert_close(g, e, rtol=rtol, atol=atol)


def test_numpy_float_static_arguments_are_keyed_by_their_bits():
    # np.float64 (a float subclass) and np.float32 were keyed by ==: -0.0 reused the 0.0 plan, and
    # each NaN call traced a new plan.
    import numpy as np

    x = make((2,))
    for kind in (np.float64, np.float32):
        fused = functe.fuse(lambda x, c: ops.constant_scale(x, float(c)))
        fused(x, kind(0.0))
        assert torch.equal(torch.signbit(fused(x, kind(-0.0))), torch.signbit(-x))
        for _ in range(3):
            fused(x, kind("nan"))
        assert fused.trace_count == 3
    # a float array is no scalar: unhashable as before (TraceError), not a TypeError from float()
    fused = functe.fuse(lambda x, c: x * 2.0)
    with pytest.raises(functe.TraceError, match="must be hashable"):
        fused(x, np.ones(3))
    with pytest.raises(functe.TraceError, match="must be hashable"):
        fused(x, np.array(0.5))


def test_output_dict_keys_keep_their_exact_types():
    # Spelled-out generated code wrote keys with repr(): an IntEnum key was a SyntaxError, a numpy
    # float a NameError, and an int subclass came back as a plain int.
    import enum

    import numpy as np

    class Key(enum.IntEnum):
        A = 1

    class MyInt(int):
        pass

    for key in (Key.A, np.float64(0.5), MyInt(3), "q'uo\"te", 7):
        got = functe.fuse(lambda x, key=key: {key: ops.gelu(x)})(make((2,)))
        assert [type(k) for k in got] == [type(key)] and list(got) == [key]


def test_a_defaultdict_argument_under_compile():
    import collections

    fused = functe.fuse(lambda d: ops.gelu(d["x"]))
    d = collections.defaultdict(list, {"x": make((2, 3))})
    torch._dynamo.reset()
    assert torch.equal(torch.compile(fused, backend="eager")(d), ops.gelu(d["x"]))


def test_dead_code_is_dropped_before_rewriting(capsys):
    # The dead linear -> scale chain matches backward_linear_scale; a match whose results nobody uses
    # has no outputs to define, so the plan drops dead equations first (found by a random-program fuzz).
    def fn(x, w, b):
        dead = 3.0 * ops.linear(x, w)
        del dead
        return ops.gelu(ops.linear(x, w, b)) + x

    x, w, b = make((3, 8)), make((8, 8)), make((8,))
    fused = functe.fuse(fn)
    plan = fused.plan(x, w, b)
    assert len(plan.traced.eqns) == 5 and len(plan.program.eqns) == 3
    assert "backward_linear_scale" not in plan.stats["backward"].fired
    assert_matches_float64(fused, fn, [x, w, b])
    functe.explain(fused, x, w, b)
    printed = capsys.readouterr().out
    assert "constant_scale[scale=3.0]" in printed  # the program as traced still shows it
    assert "dead code removed: 2 equation(s) whose results reach no output" in printed


def test_static_values_that_compare_equal_but_differ_are_keyed_apart():
    # Keyed by ==, a complex with a signed-zero part, an np.longdouble -0.0 (float() of it would be
    # exact, but it was keyed by its value), a Decimal('-0') and a frozenset({-0.0}) reused the plan
    # traced for the +0 value: fused [1, 1] where unfused gives [-1, -1].
    import decimal

    import numpy as np

    x = make((2,)).abs() + 1.0
    cases = [
        (lambda x, c: x * math.copysign(1.0, c.imag), complex(1, 0.0), complex(1, -0.0)),
        (lambda x, c: x / float(c), np.longdouble(0.0), np.longdouble(-0.0)),
        (lambda x, c: x / float(c), np.complex64(0.0), np.complex64(complex(-0.0, 0.0))),
        (lambda x, c: x / float(c), decimal.Decimal("0"), decimal.Decimal("-0")),
        (lambda x, c: x / next(iter(c)), frozenset({0.0}), frozenset({-0.0})),
    ]
    for fn, positive, negative in cases:
        fused = functe.fuse(fn)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", np.exceptions.ComplexWarning)
            for value in (positive, negative, negative):
                assert torch.equal(fused(x, value), fn(x, value)), (positive, negative)
        assert fused.trace_count == 2, (positive, negative)
    # (np.longdouble's bytes hold x87 padding that differs between equal values: keyed by repr)
    fused = functe.fuse(lambda x, c: x / float(c))
    fused(x, np.longdouble(1.0)), fused(x, np.longdouble(3) / np.longdouble(3))
    assert fused.trace_count == 1
    # (a retrace warning shows the values, not their keys)
    assert _fuse_keys._shown(_fuse_keys._static_key(complex(1, -0.0))) == "(1-0j)"
    assert _fuse_keys._shown(_fuse_keys._static_key(decimal.Decimal("-0"))) == "Decimal('-0')"


def test_unhashable_static_argument_is_a_clear_error():
    # (named by type only, every static leaf listed, hashable ones too: ['None', 'float', 'set', ...])
    fused = functe.fuse(lambda x, p: ops.constant_scale(x, min(p["tags"][1]["k"]) * p["s"]))
    with pytest.raises(
        functe.TraceError,
        match=r"must be hashable, got argument 'p'\['tags'\]\[1\]\['k'\] \(set\): a set as a frozenset",
    ):
        fused(torch.ones(2), {"tags": [None, {"k": {2.0}}], "s": 1.5})

    @dataclasses.dataclass
    class Params:  # (not registered: one opaque leaf, its weights would be captured constants)
        w: torch.Tensor

    with pytest.raises(functe.TraceError, match=r"argument 'p' holds tensors .* functe\.pytree_dataclass"):
        functe.fuse(lambda x, p: x * p.w)(torch.ones(2), Params(torch.ones(2)))
    with pytest.raises(functe.ArgumentError, match=r"params leaf .* is a Params, which functe cannot flatten"):
        functe.value_and_grad(lambda p, s: (p.w.sum(), s))(Params(torch.ones(2)), None)


def test_fuse_as_a_method_decorator_is_refused_clearly():
    class Layer(torch.nn.Module):
        @functe.fuse
        def forward(self, x):
            return ops.gelu(x)

    assert isinstance(Layer.forward, functe.Fused)  # (the class attribute itself is still the fused function)
    with pytest.raises(functe.TraceError, match=r"fuse\(forward\) decorates a method: fuse the bound method"):
        Layer()(torch.ones(2))

    # ... but a fused function shared as a class attribute is itself through an instance, as before
    def mlp(x):
        return ops.gelu(x) * 2.0

    class Block(torch.nn.Module):
        shared = functe.fuse(mlp)
        scaled = functe.fuse(lambda x: x * 3.0)

        def forward(self, x):
            return self.shared(x) + self.scaled(x)

    block, x = Block(), torch.randn(2, 4)
    assert block.shared is Block.shared and hasattr(block, "scaled")
    assert torch.equal(block(x), ops.gelu(x) * 2.0 + x * 3.0)


def test_inference_and_eager_paths_agree_with_the_op_path():
    fused = functe.fuse(_block)
    args = _block_args(torch.float32)
    with torch.no_grad():
        inferred = fused(*args, scale=0.5)
    xs = [a.clone().requires_grad_() for a in args]
    eager = fused(*xs, scale=0.5)
    op_out, _ = torch.func.vjp(lambda *a: fused(*a, scale=0.5), *args)
    assert torch.equal(inferred, eager.detach()) and torch.equal(inferred, op_out)
    assert eager.grad_fn.name() == "fused__block_eagerBackward"


def test_pytree_outputs_passthrough_and_repeated_outputs():
    @functe.fuse
    def fn(x, w):
        y = ops.linear(x, w)
        return {"y": y, "again": y, "x": x, "none": None}

    x, w = make((2, 3), F64).requires_grad_(), make((4, 3), F64).requires_grad_()
    out = fn(x, w)
    assert out["none"] is None and torch.equal(out["x"], x) and torch.equal(out["y"], out["again"])
    gx, gw = torch.autograd.grad(out["y"].sum() + 2 * out["again"].sum() + out["x"].sum(), (x, w))
    assert_close(gx, 3 * torch.ones(2, 4, dtype=F64) @ w + 1)
    assert_close(gw, 3 * torch.ones(4, 2, dtype=F64) @ x)


def _aliases_unread(x, w):
    y = ops.gelu(ops.linear(x, w))
    return {"y": y, "again": y, "flat": y.reshape(-1), "x": x, "xv": x.reshape(-1)}


def _aliasing_outputs(x, w):
    out = _aliases_unread(x, w)
    read = out["y"].reshape(2, -1)  # read by an op: it stays an output of the fused op
    return {**out, "read": read, "g": ops.gelu(read)}


def _aliases(out: dict) -> tuple:
    """Which of y's outputs are the same object, and which output each is a view of (by key)."""
    keys = ("again", "flat", "y")
    same = tuple((a, b) for a in keys for b in keys if a < b and out[a] is out[b])
    bases = tuple(next((k for k in keys if out[a]._base is out[k]), "?" if out[a]._is_view() else None) for a in keys)
    return same, bases


def test_outputs_aliasing_each_other_are_the_unfused_objects_and_views():
    # An autograd.Function returned the second of two aliases as a view of the first, which autograd
    # forbids writing to: an in-place op on one then differentiating raised "Output 1 of fused_g_eager
    # is a view and its base ... has been modified inplace" where the unfused function gives the
    # gradient. Such outputs are now built outside the fused op from its others.
    fused = functe.fuse(_aliasing_outputs)
    plan = fused.plan(make((4, 3)), make((5, 3)))
    positions = {k: i for i, k in enumerate(sorted(_aliasing_outputs(make((4, 3)), make((5, 3)))))}
    # (optree flattens a dict in key order: "again" is the first of y's two positions, "y" the
    # repeat; an input and its reshape stay outputs of the fused op, and a reshape an op reads is
    # returned by it too but built outside from the output it views: shadowed)
    assert plan.outside == {
        positions["flat"]: (positions["again"], ((-1,),)),
        positions["read"]: (positions["again"], ((2, -1),)),
        positions["y"]: (positions["again"], ()),
    }
    assert plan.outside.shadowed == {positions["read"]}
    x0, w0 = make((4, 3), F64), make((5, 3), F64)
    for mode in ("no_grad", "grad", "inplace"):
        results = []
        # (in place: a y that gelu(read) saves would make the one fused node refuse the write)
        unfused = _aliases_unread if mode == "inplace" else _aliasing_outputs
        for fn in (unfused, functe.fuse(unfused)):
            x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
            with torch.set_grad_enabled(mode != "no_grad"):
                out = fn(x, w)
            aliases = _aliases(out)
            if mode == "no_grad":
                results.append((aliases, out["x"] is x))
                continue
            if mode == "inplace":
                out["y"].mul_(3.0)  # reaches "again" and "flat" through the alias and the view
            loss = sum((i + 1) * out[k].pow(2).sum() for i, k in enumerate(sorted(out)))
            results.append((aliases, torch.autograd.grad(loss, (x, w))))
        (eager_aliases, eager_rest), (fused_aliases, fused_rest) = results
        assert fused_aliases == eager_aliases == ((("again", "y"),), (None, "again", None)), mode
        if mode == "no_grad":
            assert eager_rest and fused_rest
        else:
            for a, b in zip(eager_rest, fused_rest):
                assert_close(b, a)


def test_a_chain_of_reshaped_outputs_is_built_outside_as_views():
    # (the middle reshape, read by the last one, stayed an output of the node: an in-place write on y
    # then raised the "is a view ... modified inplace" error for it)
    def g(x):
        y = ops.gelu(x)
        middle = y.reshape(2, -1)
        return y, middle, middle.reshape(-1)

    plan = functe.fuse(g).plan(make((4,)))
    assert plan.outside == {1: (0, ((2, -1),)), 2: (0, ((2, -1), (-1,)))}
    x0 = make((4,), F64)
    grads = []
    for fn in (g, functe.fuse(g)):
        x = x0.clone().requires_grad_()
        y, middle, last = fn(x)
        assert middle._base is y and last._base is y
        y.mul_(3.0)
        grads.append(torch.autograd.grad((y + middle.reshape(-1) + 2 * last).sum(), x)[0])
    assert_close(grads[1], grads[0])


def test_outside_outputs_under_torch_func_and_compile():
    fused = functe.fuse(_aliasing_outputs)
    x, w = make((4, 3), F64), make((5, 3), F64)

    def loss(fn):
        return lambda x, w: sum((i + 1) * t.pow(2).sum() for i, t in enumerate(functe.tree_leaves(fn(x, w))))

    for a, b in zip(torch.func.grad(loss(_aliasing_outputs), (0, 1))(x, w), torch.func.grad(loss(fused), (0, 1))(x, w)):
        assert_close(b, a)
    xs = make((3, 4, 3), F64)
    expected = torch.func.vmap(torch.func.grad(loss(_aliasing_outputs)), (0, None))(xs, w)
    assert_close(torch.func.vmap(torch.func.grad(loss(fused)), (0, None))(xs, w), expected)
    compiled = torch.compile(fused, backend="aot_eager")
    xr = x.clone().requires_grad_()
    out = compiled(xr, w)
    assert out["again"] is out["y"] and out["flat"]._base is out["y"]
    expected = torch.func.grad(loss(_aliasing_outputs))(x, w)
    assert_close(torch.autograd.grad(loss(lambda *_: out)(xr, w), xr)[0], expected)


def _reshaped_intermediate(x):
    h = ops.gelu(x)  # (no output: only its reshapes are)
    flat = h.reshape(-1)
    return flat, h.reshape(2, -1), flat


def test_reshapes_of_an_intermediate_are_views_a_caller_may_write_in_place():
    # Returned from inside the fused op, a reshape of an intermediate was a view torch made inside
    # an autograd.Function; compiled, writing to it raised "Output 0 of CompiledFunction is a view
    # and is being modified inplace" where the unfused function (compiled or not) gives the
    # gradient. The op now carries the intermediate and the caller reshapes it.
    plan = functe.fuse(_reshaped_intermediate).plan(make((4, 3)))
    assert plan.outside == {0: (0, ((-1,),)), 1: (0, ((2, -1),)), 2: (0, ())}
    assert list(plan.outside.carried.items()) == [(0, plan.program.eqns[0].outputs[0])]
    x0 = make((4, 3), F64)
    fused = functe.fuse(_reshaped_intermediate)
    results = []
    for fn in (_reshaped_intermediate, fused, torch.compile(fused, backend="aot_eager")):
        x = x0.clone().requires_grad_()
        flat, rows, again = fn(x)
        assert again is flat and flat._base is rows._base is not None
        flat.mul_(3.0)  # (rows sees it: one storage)
        loss = flat.pow(2).sum() + 2 * rows.pow(3).sum() + again.sum()
        results.append((rows.detach().clone(), torch.autograd.grad(loss, x)[0]))
    for rows, grad in results[1:]:
        assert_close(rows, results[0][0])
        assert_close(grad, results[0][1])
    loss = lambda fn: lambda x: sum((i + 1) * t.pow(2).sum() for i, t in enumerate(fn(x)))
    assert_close(torch.func.grad(loss(fused))(x0), torch.func.grad(loss(_reshaped_intermediate))(x0))
    unused = torch.func.grad(lambda x: fused(x)[1].sum())(x0)  # (the carried position unused)
    assert_close(unused, torch.func.grad(lambda x: _reshaped_intermediate(x)[1].sum())(x0))


def test_a_reshape_chain_through_an_unreturned_reshape_is_built_outside():
    # (from a fuzz: the middle reshape, not returned, kept `flat` inside while the last output was
    # built from the carried intermediate, so the node returned two views of one buffer, and a
    # write on either raised "Output 0 of fused_g_eager is a view ... returns multiple views")
    def g(x):
        flat = ops.gelu(x).reshape(-1)
        return flat, flat.reshape(2, -1).reshape(-1, 3)

    plan = functe.fuse(g).plan(make((4, 3)))
    assert plan.outside == {0: (0, ((-1,),)), 1: (0, ((-1,), (2, -1), (-1, 3)))}
    assert list(plan.outside.carried) == [0]
    x0 = make((4, 3), F64)
    for k in (0, 1):
        grads = []
        for fn in (g, functe.fuse(g)):
            x = x0.clone().requires_grad_()
            out = fn(x)
            out[k].mul_(3.0)
            grads.append(torch.autograd.grad(sum((i + 1) * o.pow(2).sum() for i, o in enumerate(out)), x)[0])
        assert_close(grads[1], grads[0])


def _reshape_read_by_an_op(source, reader):
    def f(x):
        h = ops.gelu(x)
        a = h.reshape(-1)  # (read by an op: made inside)
        return (h.reshape(-1, 2) if source == "carried" else h), a, reader(a)

    return f


def _weighted_loss(out):
    return sum((i + 1) * o.pow(2).sum() for i, o in enumerate(out))


@pytest.mark.parametrize("source", ["carried", "returned"])
def test_a_reshape_an_op_reads_is_built_outside_from_the_output_it_views(source):
    # (from a fuzz: a reshape an op reads stayed an output of the fused op next to the output it
    # views, so the op returned two views of one buffer, and a write on either raised "Output 1 of
    # ... is a view and is being modified inplace")
    f = _reshape_read_by_an_op(source, lambda a: 2.0 * a)
    plan = functe.fuse(f).plan(make((4, 6)))
    a = plan.program.eqns[1].outputs[0]
    assert plan.outside[1] == (0, ((-1,),)) and plan.outside.shadowed == {1}
    assert plan.outside.returned(1, a) is a  # (still returned by the op, see the second order below)
    x0 = make((4, 6), F64)
    for k in (0, 1, 2):
        grads = []
        for fn in (f, functe.fuse(f), torch.compile(functe.fuse(f), backend="aot_eager")):
            x = x0.clone().requires_grad_()
            out = fn(x)
            assert out[1]._base is (out[0] if source == "returned" else out[0]._base)
            out[k].mul_(1.5)
            grads.append(torch.autograd.grad(_weighted_loss(out), x)[0])
        for got in grads[1:]:
            assert_close(got, grads[0])


def test_a_shadowed_output_keeps_the_second_order_through_the_reshape_an_op_saved():
    # The op still returns `a`, which gelu(a) saves: the second order differentiates through it as
    # an output of the fused op; its cotangent (from the second order only) reaches the backward
    # plan. Dropped, the second derivative was silently wrong. A write on `h` or `a` reaches the
    # saved `a`: unfused and fused refuse the backward alike.
    f = _reshape_read_by_an_op("returned", ops.gelu)
    x0 = make((4, 6), F64)

    def loss(fn):
        return lambda x: fn(x)[2].sum() + fn(x)[1].pow(2).sum()

    want = torch.func.grad(lambda x: torch.func.grad(loss(f))(x).sum())(x0)
    assert_close(torch.func.grad(lambda x: torch.func.grad(loss(functe.fuse(f)))(x).sum())(x0), want)
    x = x0.clone().requires_grad_()
    (g,) = torch.autograd.grad(loss(functe.fuse(f))(x), x, create_graph=True)
    assert_close(torch.autograd.grad(g.sum(), x)[0], want)
    for k in (0, 1):
        for fn in (f, functe.fuse(f)):
            x = x0.clone().requires_grad_()
            out = fn(x)
            out[k].mul_(1.5)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                torch.autograd.grad(_weighted_loss(out), x)


def test_only_residuals_of_live_backward_steps_are_kept():
    def fn(x, w1, w2):
        unused = ops.linear(x, w2)  # its backward never runs: no residuals kept for it
        del unused
        return ops.linear(x, w1) * 2.0

    plan = plan_of(fn, make((2, 3)), make((4, 3)), make((5, 3)))
    assert [e.name for e in plan.liveness.residuals] == ["linear", "constant_scale"]
    assert plan.liveness.residuals[0].inputs[1] is plan.program.inputs[1]  # the live linear (w1)
    assert "residuals kept for the backward plan: linear, constant_scale" in plan.explain()


def _saved_bytes(run) -> int:
    """Bytes of distinct storages autograd saves while ``run()`` records its graph."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return sum(storages.values()), out


def _mlp(x, p):
    h = ops.gelu(ops.linear(ops.layer_norm(x, p["g"], p["b"]), p["w1"], p["b1"]))
    return ops.linear(h, p["w2"], p["b2"]) + x


def test_frozen_inputs_keep_no_residuals_for_their_gradients():
    # The fused plan asked every float input for a gradient: with only fc2 trainable it kept the norm's
    # output and statistics, GELU's input and fc1's residuals (2.25x the unfused functe code), and
    # computed gradients autograd then dropped.
    x = make((16, 32))
    p = {"g": make((32,)), "b": make((32,)), "w1": make((64, 32)), "b1": make((64,))}
    p |= {"w2": make((32, 64)).requires_grad_(), "b2": make((32,)).requires_grad_()}
    fused = functe.fuse(_mlp)
    unfused_bytes, want = _saved_bytes(lambda: _mlp(x, p))
    fused_bytes, got = _saved_bytes(lambda: fused(x, p))
    assert fused_bytes <= unfused_bytes
    leaves = [p["w2"], p["b2"]]
    for g, e in zip(torch.autograd.grad(got.sum(), leaves), torch.autograd.grad(want.sum(), leaves)):
        assert_close(g, e)
    # every input trainable: the full plan, one trace for both
    p = {k: v.detach().requires_grad_() for k, v in p.items()}
    full_bytes, _ = _saved_bytes(lambda: fused(x, p))
    assert full_bytes > fused_bytes and fused.trace_count == 1
    # torch.func.grad over fc2 alone sees the other arguments as plain tensors: the same saving
    frozen = {k: v.detach() for k, v in p.items()}
    grads = torch.func.grad(lambda w2: fused(x, frozen | {"w2": w2}).sum())(frozen["w2"])
    assert_close(grads, torch.func.grad(lambda w2: _mlp(x, frozen | {"w2": w2}).sum())(frozen["w2"]))
    names = {k: i for i, k in enumerate(["x", *sorted(p)])}  # (the plan's tensor order: optree's)
    only_w2 = tuple(k == "w2" for k in names)
    assert [e.name for e in fused.plan(x, p).variant(only_w2).liveness.residuals] == ["linear", "add_extra_input"]


def test_a_fused_backward_step_over_a_frozen_op_runs_its_parts():
    # backward_fp8_linear_bias_activation was live as soon as the bias wanted a gradient: the frozen
    # FP8 linear kept its quantized operands (3.5x the unfused bytes) and ran its GEMMs for nothing.
    recipe = functe.CurrentScaling()
    fn = lambda x, w, b: ops.gelu(ops.fp8_linear(x, w, None, None, recipe=recipe) + b)
    fused = functe.fuse(fn)
    x, w, b = make((64, 128)), make((256, 128)) * 0.1, make((256,)).requires_grad_()
    assert fused.plan(x, w, b).stats["backward"].fired == {"backward_fp8_linear_bias_activation": 1}
    fused_bytes, y = _saved_bytes(lambda: fused(x, w, b))
    unfused_bytes, want = _saved_bytes(lambda: fn(x, w, b))
    assert fused_bytes == unfused_bytes
    assert torch.equal(torch.autograd.grad(y.sum(), b)[0], torch.autograd.grad(want.sum(), b)[0])
    only_b = (False, False, True)
    assert [e.name for e in fused.plan(x, w, b).variant(only_b).liveness.residuals] == ["bias", "activation"]


def test_a_fused_fp8_backward_step_skips_a_frozen_weights_wgrad_and_residuals():
    # backward_fp8_linear_bias_activation computed dW and kept x_q whatever was wanted: fused FP8 with
    # frozen weights ran a wgrad GEMM and saved an input copy that unfused fp8_linear skips.
    recipe = functe.CurrentScaling()
    fn = lambda x, w, b: ops.gelu(ops.fp8_linear(x, w, None, None, recipe=recipe) + b)
    fused = functe.fuse(fn)
    x, w, b = make((64, 128)).requires_grad_(), make((256, 128)) * 0.1, make((256,)).requires_grad_()
    assert fused.plan(x, w, b).stats["backward"].fired == {"backward_fp8_linear_bias_activation": 1}
    assert backward_gemms(fused, (x, w, b), (x, b)) == backward_gemms(fn, (x, w, b), (x, b)) == 1
    y, saved = saved_storages(lambda: fused(x, w, b))
    assert (64, 128) not in saved.values()  # no quantized copy of x
    for g, e in zip(torch.autograd.grad(y.sum(), (x, b)), torch.autograd.grad(fn(x, w, b).sum(), (x, b))):
        assert torch.equal(g, e)
    w_only = w.clone().requires_grad_()
    assert backward_gemms(fused, (x.detach(), w_only, b.detach()), w_only) == 1
    assert torch.equal(
        torch.autograd.grad(fused(x.detach(), w_only, b.detach()).sum(), w_only)[0],
        torch.autograd.grad(fn(x.detach(), w_only, b.detach()).sum(), w_only)[0],
    )


@pytest.mark.parametrize(
    ("fn", "rule"),
    [
        (lambda x, w: (lambda a, b: ops.linear(b, w) + a)(*ops.make_extra_output(x)), "backward_linear_add"),
        (lambda x, w: ops.linear(x, w) * 0.5, "backward_linear_scale"),
        (lambda x, w: ops.gelu(ops.linear(x, w)), "backward_linear_bias_activation"),
    ],
)
def test_bias_free_fused_backward_steps_keep_their_fused_path(fn, rule, monkeypatch):
    # An absent bias is flagged "no gradient wanted": the fused rules took their unfused fallback
    # whenever the linear had no bias, everything trainable or not.
    from functe.ops import _fused

    calls = []
    real = _fused._linear_bwd
    monkeypatch.setattr(_fused, "_linear_bwd", lambda *a, **k: calls.append(1) or real(*a, **k))
    x, w = make((4, 4)).requires_grad_(), make((4, 4)).requires_grad_()
    fused = functe.fuse(fn)
    assert plan_of(fn, x, w).stats["backward"].fired == {rule: 1}
    got = torch.autograd.grad(fused(x, w).sum(), (x, w))
    assert not calls
    for g, e in zip(got, torch.autograd.grad(fn(x, w).sum(), (x, w))):
        assert_close(g, e)
    torch.autograd.grad(fused(x, w.detach()).sum(), x)  # a frozen weight: the fallback, dx only
    assert calls


@pytest.mark.parametrize(
    ("fn", "rule"),
    [
        (lambda x, w: (lambda a, b: ops.linear(b, w) + a)(*ops.make_extra_output(x)), "backward_linear_add"),
        (lambda x, w: ops.linear(x, w) * 0.5, "backward_linear_scale"),
        (lambda x, w: ops.gelu(ops.linear(x, w)), "backward_linear_bias_activation"),
        (lambda x, w: ops.linear(x, w) + x, None),
    ],
)
def test_a_frozen_weight_keeps_no_input_alive_in_fused_plans(fn, rule):
    # The plan's backward step (a fused op or linear's own) prunes the residuals it reads: with the
    # weight frozen the linear's input is not saved, as unfused (test_core_ops).
    x, w = make((8, 12)), make((12, 12)) * 0.5
    assert plan_of(fn, x, w).stats["backward"].fired == ({rule: 1} if rule else {})
    fused = functe.fuse(fn)
    for wrt in ((True, False), (False, True), (True, True)):
        args = [t.clone().requires_grad_(r) for t, r in zip((x, w), wrt)]
        saved = saved_storages(functools.partial(fused, *args))[1]
        assert (args[0].untyped_storage().data_ptr() in saved) == wrt[1]  # x, for wgrad only
        got = torch.autograd.grad(fused(*args).float().sum(), [a for a in args if a.requires_grad])
        want = torch.autograd.grad(fn(*args).float().sum(), [a for a in args if a.requires_grad])
        for g, e in zip(got, want):
            assert_close(g, e)


@pytest.mark.parametrize(
    "call",
    [
        lambda f, x, w: f.forward_linear_add(x, w, None, x * 1.0, scale=0.5, bias_op=False),
        lambda f, x, w: f.backward_linear_add(x, w, None)[1],
        lambda f, x, w: f.backward_linear_scale(x, w, None, scale=0.5),
        lambda f, x, w: f.forward_linear_activation(x, w, None, activation="gelu", bias_op=False),
        lambda f, x, w: f.backward_linear_activation(x, w, None, activation="gelu"),
    ],
    ids=["forward_linear_add", "backward_linear_add", "backward_linear_scale", "forward_linear_act", "backward_act"],
)
def test_fused_linear_ops_called_alone_prune_like_linear(call):
    from functe.ops import _fused

    x, w = make((8, 12)), make((12, 12))
    for wrt in ((True, False), (False, True), (True, True)):
        args = [t.clone().requires_grad_(r) for t, r in zip((x, w), wrt)]
        y, saved = saved_storages(functools.partial(call, _fused, *args))
        assert (args[0].untyped_storage().data_ptr() in saved) == wrt[1]
        wanted = [a for a in args if a.requires_grad]
        got = torch.autograd.grad(y.sum(), wanted)
        full = [t.clone().requires_grad_() for t in (x, w)]
        every = torch.autograd.grad(call(_fused, *full).sum(), full)
        for g, e in zip(got, [e for e, r in zip(every, wrt) if r]):
            assert torch.equal(g, e)


def test_only_steps_with_a_frozen_float_input_prune():
    # An absent bias is an unflagged argument too: every bias-free linear's step got a prune call that
    # could drop nothing (a per-call cost of the cached plan).
    fn = lambda x, w, x2, w2: ops.linear(x, w) + ops.linear(x2, w2)
    args = [make((4, 8)), make((8, 8)), make((4, 8)), make((8, 8))]
    plan = functe.fuse(fn).plan(*args)
    source = plan.variant((True, True, True, False)).source
    assert source.count("= _p") == 1 and "needs_input_grad=(True, False, False)" in source


def test_frozen_base_weights_keep_no_linear_inputs():
    # LoRA-style: frozen fc1/fc2 weights under trainable norm parameters and input. fc1's input (the
    # norm's output) and fc2's (GELU's output) stayed saved for wgrads that never run.
    p = {"g": make((32,)), "b": make((32,)), "w1": make((64, 32)), "b1": make((64,))}
    p |= {"w2": make((32, 64)), "b2": make((32,))}
    p = {k: v if k.startswith("w") else v.requires_grad_() for k, v in p.items()}
    x = make((16, 32)).requires_grad_()
    fused = functe.fuse(_mlp)
    for fn in (_mlp, fused):
        y, saved = saved_storages(functools.partial(fn, x, p))
        shapes = sorted(saved.values())
        # the norm's input x and the weights; GELU's input z; no [16, 32] norm output, no [16, 64] h
        assert shapes.count((16, 32)) == 1 and shapes.count((16, 64)) == 1, shapes
        wrt = [x, p["g"], p["b"], p["b1"], p["b2"]]
        for g, e in zip(torch.autograd.grad(y.sum(), wrt), torch.autograd.grad(_mlp(x, p).sum(), wrt)):
            assert_close(g, e)


def test_outputs_no_trainable_input_reaches_do_not_require_grad():
    # One node for the program made every output require grad: .backward() on an output of frozen
    # inputs silently did nothing where unfused raises.
    fused = functe.fuse(lambda x, w, u: (ops.linear(x, w), u * 2.0))
    x, w, u = make((2, 3)), make((4, 3)), make((3,)).requires_grad_()
    y, v = fused(x, w, u)
    assert not y.requires_grad and v.requires_grad
    assert torch.equal(torch.autograd.grad(v.sum(), u)[0], torch.full((3,), 2.0))
    only_y = functe.fuse(lambda x, w, u: ops.linear(x, w))
    assert not only_y(x, w, u).requires_grad


def test_the_fused_backward_frees_each_cotangent_after_its_step():
    # The generated backward held every intermediate cotangent until it returned (a higher peak than
    # autograd, which frees a node's inputs once it has run).
    seen = {}

    def step(name, reads=None):
        def bwd(_, ct):
            seen[name] = weakref.ref(ct)
            if reads is not None:
                seen[f"{reads} alive at {name}"] = seen[reads]() is not None
            return (ct * 2.0,)

        return functe.custom_vjp(name, lambda x: (x * 2.0, None), bwd)

    a, b, c = step("a", reads="b"), step("b"), step("c")
    fused = functe.fuse(lambda x: c(b(a(x))))
    x = make((4,)).requires_grad_()
    torch.autograd.grad(fused(x).sum(), x)
    assert seen["b alive at a"] is False  # b's cotangent (made by c's step) was freed before a's step


@pytest.mark.parametrize("count", [1, 3])
def test_a_backward_rule_returning_the_wrong_number_of_cotangents_is_refused_in_a_plan(count):
    # The generated backward indexed the rule's tuple: one short raised a bare IndexError naming no
    # op, one long dropped its extra cotangent silently. Now the message custom_vjp gives unfused.
    def bwd(res, dy):
        x, y = res
        return (dy * y, dy * x, dy)[:count]

    mul = functe.custom_vjp("user_mul", lambda x, y: (x * y, (x, y)), bwd)
    x, y = make((3,)).requires_grad_(), make((3,)).requires_grad_()
    message = rf"functe.user_mul: the backward rule must return a tuple of 2 cotangents .* of length {count}"
    with pytest.raises(functe.RuleError, match=message):
        torch.autograd.grad(mul(x, y).sum(), (x, y))
    fused = functe.fuse(lambda x, y: mul(x, y) * 2.0)
    with pytest.raises(functe.RuleError, match=message + r" \(in a fused plan's backward"):
        torch.autograd.grad(fused(x, y).sum(), (x, y))
    with pytest.raises(functe.RuleError, match=message):
        torch.func.grad(lambda x, y: fused(x, y).sum())(x.detach(), y.detach())


def test_a_backward_rule_may_return_a_namedtuple_in_a_plan():
    # (custom_vjp takes any tuple; the plan's first count check refused a namedtuple of the right length)
    grads = collections.namedtuple("Grads", "dx dy")
    mul = functe.custom_vjp("user_mul_nt", lambda x, y: (x * y, (x, y)), lambda r, g: grads(g * r[1], g * r[0]))
    x, y = make((3,)).requires_grad_(), make((3,)).requires_grad_()
    fused = functe.fuse(lambda x, y: mul(x, y) * 2.0)
    gx, gy = torch.autograd.grad(fused(x, y).sum(), (x, y))
    assert torch.equal(gx, 2.0 * y) and torch.equal(gy, 2.0 * x)


def test_fuse_inside_a_trace_is_inlined():
    inner = functe.fuse(lambda x, w: ops.linear(x, w) * 2.0)
    text = str(functe.trace(lambda x, w: inner(x, w) + x)(torch.zeros(3, 3), torch.zeros(3, 3)))
    assert "linear a b None" in text and "constant_scale[scale=2.0]" in text and inner.trace_count == 0


def test_opaque_functions_in_a_fused_block():
    gelu = functe.opaque(torch.nn.functional.gelu)

    def mlp(x, w1, b1, w2, b2):
        return ops.linear(gelu(ops.linear(x, w1, b1), approximate="tanh"), w2, b2) + x

    args = [make((4, 6), F64), make((8, 6), F64), make((8,), F64), make((6, 8), F64), make((6,), F64)]
    fused = functe.fuse(mlp)
    assert fused.plan(*args).stats["forward"].fired == {"forward_linear_bias_add": 1}
    assert_matches_float64(fused, mlp, args)
    check_transforms(fused, mlp, args, higher_order=False)


def test_rules_argument_and_empty_rules():
    args = _block_args()
    unfused = functe.fuse(_block, rules=RuleSet())
    plan = unfused.plan(*args, scale=0.5)
    assert str(plan.forward) == str(plan.program) == str(plan.backward)
    assert_close(unfused(*args, scale=0.5), functe.fuse(_block, rules=DEFAULT_RULES)(*args, scale=0.5))


class _SyncRecorder(TorchDispatchMode):
    """Records every aten op that reads tensor data back to the host (a synchronisation on a GPU).

    A dispatch mode sees the ops inside autograd Functions and in the backward pass too; item(),
    bool(), float() and int() of a tensor all reach ``aten._local_scalar_dense``.
    """

    SYNCING = frozenset(
        {"_local_scalar_dense", "nonzero", "equal", "is_nonzero", "allclose", "unique", "masked_select"}
    )

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name.removeprefix("aten::") in self.SYNCING:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def test_cached_calls_never_read_tensor_data_on_the_host():
    fused = functe.fuse(_block)
    args = [a.float().requires_grad_() for a in _block_args()]
    torch.autograd.grad(fused(*args, scale=0.5).sum(), args)  # trace and plan (may inspect anything)
    recorder = _SyncRecorder()
    with recorder:
        out = fused(*args, scale=0.5)
        torch.autograd.grad(out, args, torch.ones_like(out))
        with torch.no_grad():
            fused(*args, scale=0.5)
        torch.func.grad(lambda *a: fused(*a, scale=0.5).sum())(*args)
    assert recorder.seen == [] and fused.trace_count == 1


class _HostReads:
    """Tensor methods that read a value to the host (a synchronisation on a GPU), watched while the
    block runs: each call made by functe's own code is noted with its file and line. Not watched:
    torch's code, and functe/kernels/_triton.py, which runs kernels in Triton's interpreter (an
    emulator that reads values by design; on a GPU that module only launches). Unlike a dispatch mode
    (see _SyncRecorder), this sees into the kernels' launchers (functe/kernels/*.py): with a dispatch
    mode active functe routes launches through custom ops, which the mode cannot see into."""

    METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu")

    def __init__(self, monkeypatch):
        self.seen: list[str] = []
        functe_dir, torch_dir = os.path.dirname(functe.__file__) + os.sep, os.path.dirname(torch.__file__) + os.sep
        launcher = os.path.join(functe_dir, "kernels", "_triton.py")

        def watched(name, original):
            def read(tensor, *args, **kwargs):
                frame = sys._getframe(1)
                while frame is not None and frame.f_code.co_filename.startswith(torch_dir):
                    frame = frame.f_back
                where = "" if frame is None else frame.f_code.co_filename
                if where.startswith(functe_dir) and where != launcher:
                    self.seen.append(f"Tensor.{name} at {os.path.relpath(where, functe_dir)}:{frame.f_lineno}")
                return original(tensor, *args, **kwargs)

            return read

        for name in self.METHODS:
            monkeypatch.setattr(torch.Tensor, name, watched(name, getattr(torch.Tensor, name)))


def test_a_cached_fp8_training_step_on_the_triton_path_reads_nothing_to_the_host(monkeypatch):
    # The GPU's code path (Triton kernels, here interpreted): a fused LayerNorm + FP8 MLP block with
    # its norm+quantize, activation+quantize and backward fusions, stepped by value_and_grad and an
    # SGD update. A CUDA graph can capture it only if nothing reads a value to the host.
    recipe = functe.DelayedScaling(amax_history_len=4)

    def block(p, state, x):
        h = ops.layer_norm(x, p["ln_w"], p["ln_b"])
        h = ops.gelu(ops.fp8_linear(h, p["w1"], p["b1"], state["fc1"], recipe=recipe))
        return ops.fp8_linear(h, p["w2"], p["b2"], state["fc2"], recipe=recipe) + x

    fused = functe.fuse(block)
    step = functe.value_and_grad(lambda p, s, x: fused(p, s, x).square().mean(), check=False)
    shapes = {"ln_w": (16,), "ln_b": (16,), "w1": (32, 16), "b1": (32,), "w2": (16, 32), "b2": (16,)}
    p = {k: (make(shape) / 4).to(torch.bfloat16) for k, shape in shapes.items()}
    state = {k: functe.init_linear_scaling_state(recipe) for k in ("fc1", "fc2")}
    x = make((4, 16)).to(torch.bfloat16)
    with functe.use_backend("interpret"):
        _, _, state = step(p, state, x)  # (the trace and plan may read anything)
        reads = _HostReads(monkeypatch)
        for _ in range(2):
            _, grads, state = step(p, state, x)
            p = {k: v - 0.01 * grads[k] for k, v in p.items()}
    monkeypatch.undo()
    assert reads.seen == [] and fused.trace_count == 1
    plan = fused.plan(p, state, x)
    assert set(plan.stats["forward"].fired) == {"forward_norm_quantize", "forward_activation_quantize"}
    assert set(plan.stats["backward"].fired) == {"backward_fp8_linear_activation"}
    # (the watch itself: the CPU fast path of an fp32 LayerNorm reads its statistics)
    watch = _HostReads(monkeypatch)
    ops.layer_norm(make((4, 16)), torch.ones(16), torch.zeros(16))
    assert any("norm.py" in read for read in watch.seen)


@pytest.mark.gpu
def test_cuda_dispatch_and_graph_capture_of_a_training_step():
    """A whole fwd+bwd step captured in one CUDA graph: possible only without host synchronisation."""
    dev = "cuda"
    fused = functe.fuse(_block)
    args = [a.float().to(dev).requires_grad_() for a in _block_args()]
    assert_graph_replay_matches(lambda: (fused(*args, scale=0.5) ** 2).sum(), args)
    assert fused.trace_count == 1


@pytest.mark.gpu
def test_cuda_graph_capture_of_a_step_with_an_opaque_op():
    # An opaque op's forward saved the CUDA generator's state, which torch refuses to read while a
    # graph is captured: every opaque op (tanh too) made a step uncapturable.
    dev = "cuda"
    tanh = functe.opaque(torch.tanh)
    fused = functe.fuse(lambda x, w: ops.linear(tanh(x), w))
    args = [make((8, 16)).to(dev).requires_grad_(), make((4, 16)).to(dev).requires_grad_()]
    assert_graph_replay_matches(lambda: fused(*args).square().sum(), args)


def test_a_captured_tensor_that_starts_requiring_grad_is_refused_by_the_cached_plan():
    # The trace refuses a captured tensor that requires grad, but requires_grad_() after the first call
    # made the cached plan drop its gradient silently (unfused autograd records it).
    base = make((4, 4))
    fused = functe.fuse(lambda x: ops.linear(x, base))
    x = make((2, 4)).requires_grad_()
    fused(x)
    base.requires_grad_()
    with pytest.raises(functe.TraceError, match=r"captured from the enclosing scope as a constant requires gradients"):
        fused(x)
    # nothing else trainable: infer runs the forward rules, which need not be differentiable (a
    # quantizing kernel is not): refused as well
    with pytest.raises(functe.TraceError, match=r"requires gradients"):
        fused(x.detach())
    with torch.no_grad():
        assert torch.equal(fused(x.detach()), ops.linear(x.detach(), base))


@pytest.mark.parametrize("eval_mode", [torch.no_grad, torch.inference_mode])
def test_an_eval_pass_may_capture_trainable_weights(eval_mode):
    # `fuse(model)` under no_grad / inference_mode (an evaluation) refused the model's trainable
    # parameters as a training call does, though no gradient can be lost there; unfused it runs.
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(16, 4))
    block = lambda x: ops.linear(ops.gelu(ops.linear(x, model[0].weight, model[0].bias)), model[2].weight)
    fused, x = functe.fuse(block), make((3, 8))
    with eval_mode():
        assert torch.equal(fused(x), block(x))
        assert torch.equal(fused(x), block(x)) and fused.trace_count == 1
    # a training call with the cached plan refuses the constants, as a trace under grad mode does
    with pytest.raises(
        functe.TraceError,
        match=r"f32\[16,8\] \(the module.s .0\.weight.\) captured .* as a constant requires gradients; call the",
    ):
        fused(x.requires_grad_())
    with pytest.raises(functe.TraceError, match=r"requires gradients"):
        functe.fuse(block)(x)
    # a folded constant (w.t()) and a frozen model both work after the eval pass
    folded = functe.fuse(lambda x: ops.linear(x, model[0].weight.t().t()))
    with eval_mode():
        assert torch.equal(folded(x), ops.linear(x, model[0].weight))
    model.requires_grad_(False)
    assert torch.equal(fused(x), block(x)) and fused.trace_count == 1


def test_the_trace_names_a_trainable_module_parameter_it_captures():
    # The cached plan's refusal named the module's parameter and a remedy a module can take; the
    # trace's own refusal (the first call under grad mode) said "pass it as an argument", which a
    # module's forward cannot do.
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(16, 4))
    x = make((3, 8))
    named = r"functe\.linear: a tensor f32\[16,8\] \(the module.s .0\.weight.\) captured .* gradients; call the"
    with pytest.raises(functe.TraceError, match=named):
        functe.fuse(model)(x)  # (the module called by the trace)
    block = lambda x: ops.linear(ops.gelu(ops.linear(x, model[0].weight, model[0].bias)), model[2].weight)
    with pytest.raises(functe.TraceError, match=named):
        functe.fuse(block)(x)  # (the module reached by name)
    # a parameter a transform sees (functional_call under grad, a frozen module) keeps the trace's
    # words: "is being transformed", not "freeze it", which the caller did
    frozen = torch.nn.Sequential(torch.nn.Linear(8, 4)).requires_grad_(False)
    holder = torch.nn.Module()
    holder.body, holder.forward = frozen, functe.fuse(frozen)  # (a module calling the fused one)
    params = {f"body.{k}": v.detach() for k, v in frozen.named_parameters()}
    transformed = r"f32\[4,8\] captured .* or is being transformed\); pass it"
    with pytest.raises(functe.TraceError, match=transformed):
        torch.func.grad(lambda p: torch.func.functional_call(holder, p, (x,)).sum())(params)
    # a captured tensor no module holds keeps the argument remedy
    loose = make((16, 8)).requires_grad_()
    with pytest.raises(functe.TraceError, match=r"f32\[16,8\] captured .* pass it to the traced function as an arg"):
        functe.fuse(lambda x: ops.linear(x, loose))(x)


@pytest.mark.parametrize(
    "derive",
    [lambda w: w.t().contiguous(), lambda w: w.to(torch.float64).float(), lambda w: 2.0 * w],
    ids=["contiguous copy", "dtype round trip", "scaled"],
)
def test_constants_folded_from_a_captured_tensor_follow_it(derive):
    # A computation on a captured tensor ran once at trace time and its result became a constant:
    # after an in-place update of the tensor (an optimizer step) the cached plan kept computing with
    # the old values, and it never saw the tensor start requiring grad.
    w = make((8, 16))
    fn = lambda x: ops.linear(x, derive(w).reshape(8, 16))
    fused = functe.fuse(fn)
    x = make((4, 16))
    assert torch.equal(fused(x), fn(x))
    with torch.no_grad():
        w.mul_(-3.0)  # in place: its version counter moves
    assert torch.equal(fused(x), fn(x)) and fused.trace_count == 2  # retraced on the new values
    assert torch.equal(fused(x), fn(x)) and fused.trace_count == 2  # and cached again
    w.requires_grad_()  # a retrace, whose folded constant now carries a gradient: refused as any trace does
    with pytest.raises(functe.TraceError, match=r"captured from the enclosing scope requires gradients"):
        fused(x)


def test_reads_that_carry_no_gradient_survive_a_trainable_capture():
    # Once a trainable captured tensor was a source, every call raised, also for reads that never
    # carry its gradient (a no_grad fold, a number, metadata): they work as unfused.
    p = make((8, 16)).requires_grad_()
    fns = [
        lambda x: ops.linear(x, p.detach() * 2.0),
        lambda x: ops.constant_scale(x, p.norm().item()),
        lambda x: ops.constant_scale(x, float(torch.numel(p) + p.nbytes + p.storage_offset())),
        lambda x: ops.add_extra_input(x, torch.ones(4, 16).view_as(p[:4])),
    ]
    x = make((4, 16)).requires_grad_()
    for fn in fns:
        fused = functe.fuse(fn)
        for _ in range(2):
            assert_close(fused(x), fn(x))
        assert fused.trace_count == 1


def test_reads_through_data_follow_the_tensor():
    # w.data has a version counter of its own: the source must be w
    w = make((8, 16))
    fn = lambda x: ops.linear(x, w.data * 2.0)
    fused, x = functe.fuse(fn), make((4, 16))
    fused(x)
    with torch.no_grad():
        w.mul_(-3.0)
    assert torch.equal(fused(x), fn(x)) and fused.trace_count == 2


def test_a_captured_frozen_weight_keeps_no_input_alive():
    # a captured weight is a literal: its step's prune was skipped, and x was saved for a wgrad that never runs
    w = make((8, 64))
    fused, x = functe.fuse(lambda x: ops.linear(x, w)), make((64, 64)).requires_grad_()
    y, saved = saved_storages(lambda: fused(x))
    assert x.untyped_storage().data_ptr() not in saved
    assert torch.equal(torch.autograd.grad(y.sum(), x)[0], torch.autograd.grad(ops.linear(x, w).sum(), x)[0])


_W, _POS = make((8, 16)), torch.tensor(1)


@pytest.mark.parametrize(
    ("fn", "update"),
    [
        # a read whose result is a number (the only read of _W)
        (lambda x: ops.constant_scale(x, _W[0, 0].item()), lambda: _W.mul_(-2.0)),
        # an index tensor selecting a view: _W's storage stays live, _POS was read
        (lambda x: ops.add_extra_input(x, _W[_POS].expand(4, 16)), lambda: _POS.add_(1)),
        # a torch.func transform over a captured tensor (its wrapper was taken for the source)
        (lambda x: ops.add_extra_input(x, torch.vmap(lambda r: r * 2.0)(_W)[:4]), lambda: _W.mul_(-2.0)),
    ],
    ids=["item", "index view", "vmap"],
)
def test_every_kind_of_folded_read_is_followed(fn, update):
    fused, x = functe.fuse(fn), make((4, 16))
    assert torch.equal(fused(x), fn(x))
    with torch.no_grad():
        update()
    assert torch.equal(fused(x), fn(x)) and fused.trace_count == 2


def test_templates_and_inference_tensors_are_no_sources():
    # x.to(p) reads p's dtype and device only (a trainable p raised on every call); an inference
    # tensor has no version counter (reading it raised)
    p = make((3,)).requires_grad_()
    with torch.inference_mode():
        frozen = make((16, 8))
    fn = lambda x: ops.linear(x, frozen.t().contiguous()) + torch.ones(4, 8).to(p) + torch.ones(4, 8).type_as(p)
    fused, x = functe.fuse(fn), make((4, 16)).requires_grad_()
    # (the fold through a view of the inference tensor is unwatched: said so since stop 30)
    with pytest.warns(functe.UnwatchedConstantWarning, match=r"inference tensors \(f32\[16,8\]"):
        plan = fused.plan(x)
    assert plan.sources == [] and torch.equal(fused(x), fn(x))


def test_a_plan_retraced_on_every_call_warns():
    w = make((8, 16))
    fused, x = functe.fuse(lambda x: ops.linear(x, 2.0 * w)), make((4, 16))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(_fuse.RETRACE_WARNING + 1):
            fused(x)
            with torch.no_grad():
                w.add_(1.0)
    stale = [w for w in caught if issubclass(w.category, functe.RetraceWarning)]
    assert fused.stale_retraces == _fuse.RETRACE_WARNING and len(stale) == 1
    assert "changed in place" in str(stale[0].message) and "f32[8,16]" in str(stale[0].message)


def test_views_of_a_captured_tensor_stay_live_without_retracing():
    w = make((16, 8))
    fused = functe.fuse(lambda x: ops.linear(x, w.t()))  # a view: the plan reads w's storage
    x = make((4, 16))
    fused(x)
    with torch.no_grad():
        w.add_(1.0)
    assert torch.equal(fused(x), ops.linear(x, w.t())) and fused.trace_count == 1
    made = functe.fuse(lambda x: ops.add_extra_input(x, torch.zeros(x.shape) + torch.ones(x.shape)))
    assert made.plan(make((2, 3))).sources == []  # constants made from nothing captured


def test_an_opaque_function_using_a_trainable_captured_tensor_is_refused_when_fused():
    # With its own arguments frozen the opaque step is not live, its forward ran inside the program's
    # node, and W's gradient was lost without a word (unfused, autograd records through fn).
    w = make((4, 4)).requires_grad_()
    proj = functe.opaque(lambda x: torch.tanh(x @ w))
    fused = functe.fuse(lambda x, w2: ops.linear(proj(x), w2))
    x, w2 = make((3, 4)), make((2, 4)).requires_grad_()
    with pytest.raises(functe.ArgumentError, match=r"uses f32\[4,4\] that requires grad without taking it"):
        fused(x, w2)
    # nothing trainable among the arguments: the plan runs without a node and autograd reaches w
    (dw,) = torch.autograd.grad(fused(x, w2.detach()).sum(), w)
    (want,) = torch.autograd.grad(ops.linear(torch.tanh(x @ w), w2.detach()).sum(), w)
    assert_close(dw, want)


def test_threads_tracing_one_fused_function_at_once_get_their_own_plans():
    # Tracing state is global: concurrent first calls recorded into each other's traces (TraceErrors)
    # and published a plan index before its plan, so one signature could run another's plan (a wrong
    # static scale, silently).
    x, w = make((4, 8)), make((8, 8))
    for _ in range(8):
        fused = functe.fuse(lambda x, w, s: ops.linear(x, w) * s)
        barrier, results = threading.Barrier(4), {}

        def run(s, fused=fused, barrier=barrier, results=results):
            barrier.wait()
            try:
                results[s] = fused(x, w, s)
            except Exception as error:  # (reported below, with the scale it failed for)
                results[s] = error

        threads = [threading.Thread(target=run, args=(s,)) for s in (1.0, 2.0, 3.0, 4.0)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for s, got in results.items():
            assert isinstance(got, torch.Tensor), f"scale {s}: {got!r}"
            assert_close(got, ops.linear(x, w) * s)
        assert fused.trace_count == 4  # (a call while another thread traced ran unfused, inline)


def test_a_plan_keeps_neither_the_folded_source_nor_trace_intermediates_alive():
    # Plan.sources held the captured original (kept beside its folded copy after del), and the trace
    # held every tensor it made until it ended
    import gc

    held = {"w": make((64, 64))}
    fused = functe.fuse(lambda x: ops.linear(x, (held["w"] * 2.0).to(torch.float64).float()))
    fused(make((4, 64)))
    ref = weakref.ref(held.pop("w"))
    gc.collect()
    assert ref() is None and fused.trace_count == 1


def test_generated_plan_source_goes_with_its_plan():
    # Each variant put its source in linecache (for tracebacks) and nothing took it out: fusing a
    # new function every step left ~7 KiB per step behind.
    import gc
    import linecache

    def entries():
        return sum(1 for name in linecache.cache if name.startswith("<functe.fuse"))

    gc.collect()
    before = entries()
    x, w = make((4, 8)).requires_grad_(), make((8, 8))
    for _ in range(5):
        functe.fuse(lambda x, w: ops.gelu(ops.linear(x, w)))(x, w).sum().backward()
    gc.collect()
    assert entries() == before


def test_draws_and_writes_inside_a_traced_function_are_refused():
    # they ran once, at trace time: every call reused the same noise, and step.add_(1) counted once
    step = torch.zeros(())
    x = make((4, 8))
    with pytest.raises(functe.TraceError, match=r"torch\.randn draws random numbers inside a traced function"):
        functe.fuse(lambda x: ops.add_extra_input(x, torch.randn(4, 8)))(x)
    with pytest.raises(functe.TraceError, match=r"Tensor\.add_ writes into f32\[\] captured from the enclosing"):
        functe.fuse(lambda x: (step.add_(1), ops.constant_scale(x, 2.0))[1])(x)
    assert step.item() == 0.0
    # a module's buffer, fusing the module or its bound forward (only plain functions were looked at:
    # the buffer counted one call of three)
    counter = _Counter()
    for fn in (counter, counter.forward):
        with pytest.raises(functe.TraceError, match=r"Tensor\.add_ writes into f32\[\] captured from the enclosing"):
            functe.fuse(fn)(x)
    assert counter.steps.item() == 0.0


_CAPTURED_GENERATOR = torch.Generator().manual_seed(0)


@pytest.mark.parametrize(
    "noise",
    [
        lambda: torch.dropout(torch.ones(4, 8), 0.5, True),
        lambda: torch.nn.functional.dropout2d(torch.ones(1, 4, 8, 1), 0.5).reshape(4, 8),
        lambda: torch.nn.init.normal_(torch.empty(4, 8)),
        lambda: torch.nn.functional.gumbel_softmax(torch.ones(4, 8)),  # (its exponential_ is inside torch)
        lambda: (torch.manual_seed(1234), torch.zeros(4, 8))[1],
    ],
    ids=["torch.dropout", "dropout2d", "init.normal_", "gumbel_softmax", "manual_seed"],
)
def test_a_trace_that_moves_a_random_generator_is_refused(noise):
    # The trace knew a list of random functions by name: any other draw ran once, at trace time, and
    # every call reused its noise (unfused, every call draws anew); a reseed happened once.
    state = torch.get_rng_state()
    with pytest.raises(functe.TraceError, match=r"(draws from|reseeded) torch.s default random generator"):
        functe.fuse(lambda x: ops.add_extra_input(x, noise()))(make((4, 8)))
    torch.set_rng_state(state)


def test_another_threads_draws_do_not_fail_a_trace():
    # The default generator's state is the process's: a draw in another thread (a data thread) while
    # this one traced was taken for the traced function's (18 of 20 first calls failed in a loop).
    stop = threading.Event()

    def draw():
        while not stop.is_set():
            torch.randn(16)

    thread = threading.Thread(target=draw)
    thread.start()
    try:
        for _ in range(10):
            functe.fuse(lambda x: ops.gelu(ops.constant_scale(x, 2.0)))(make((4, 8)))
    finally:
        stop.set()
        thread.join()


def test_a_generator_argument_that_moves_is_refused_and_one_the_function_makes_is_its_own():
    x = make((4, 8))
    with pytest.raises(functe.TraceError, match=r"moved a torch\.Generator it captures or takes as an argument"):
        functe.fuse(lambda x, g: ops.add_extra_input(x, torch.rand(4, 8, generator=g)))(x, torch.Generator())
    with pytest.raises(functe.TraceError, match=r"moved a torch\.Generator it captures or takes as an argument"):
        functe.fuse(lambda x: ops.add_extra_input(x, torch.rand(4, 8, generator=_CAPTURED_GENERATOR)))(x)

    def own(x):  # (the same noise on every call, unfused too: a constant)
        return ops.add_extra_input(x, torch.rand(4, 8, generator=torch.Generator().manual_seed(3)))

    fused = functe.fuse(own)
    assert torch.equal(fused(x), own(x)) and torch.equal(fused(x), own(x))
    # an opaque function draws on every call, as unfused
    noisy = functe.fuse(lambda x: functe.opaque(lambda x: torch.dropout(x, 0.5, True))(x))
    torch.manual_seed(5)
    first, second = noisy(torch.ones(64, 64)), noisy(torch.ones(64, 64))
    assert not torch.equal(first, second)


class _Counter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x):
        self.steps.add_(1)
        return ops.constant_scale(x, 2.0)


def test_returned_constants_autocast_inference_mode_fill_values_and_new_storage():
    x = make((4, 8))
    # a constant the function makes and returns: a copy per call (the caller changed the shared one)
    fused = functe.fuse(lambda x: (ops.constant_scale(x, 2.0), torch.zeros(3)))
    fused(x)[1].add_(5.0)
    assert torch.equal(fused(x)[1], torch.zeros(3))
    # traced in an eval pass (inference mode): its folded constants served training calls badly
    w = make((8, 8))
    fn = lambda x: ops.linear(x, 2.0 * w)
    fused = functe.fuse(fn)
    with torch.inference_mode():
        fused(x)
    xg = x.clone().requires_grad_()
    assert torch.equal(torch.autograd.grad(fused(xg).sum(), xg)[0], torch.autograd.grad(fn(xg).sum(), xg)[0])
    # autocast is part of the signature: a bf16 fold traced under it is not reused without it
    fn2 = lambda x: ops.add_extra_input(x, (w @ w).float()[:4])
    fused2 = functe.fuse(fn2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused2(x)
    assert torch.equal(fused2(x), fn2(x)) and fused2.trace_count == 2
    # a captured 0-d fill value is read; a source given a new storage retraces
    s = torch.tensor(3.0)
    fn3 = lambda x: ops.add_extra_input(x, torch.full_like(w[:4], s))
    fused3 = functe.fuse(fn3)
    fused3(x)
    with torch.no_grad():
        s.mul_(5.0)
    assert torch.equal(fused3(x), fn3(x))
    fused4 = functe.fuse(fn)
    fused4(x)
    w.data = make((8, 8))  # no version change: a new storage
    assert torch.equal(fused4(x), fn(x)) and fused4.trace_count == 2


def test_what_a_traced_function_may_still_do():
    # Refusing draws and writes at trace time must not refuse what runs the same on every call:
    # dropout that is off, a generator the function seeds itself, writes into tensors it made (also
    # through torch.from_numpy), and flag setters on captured tensors.
    import numpy as np

    table = make((4, 8))
    x = make((4, 8))

    def fn(x):
        off = torch.nn.functional.dropout(table, p=0.5, training=False)
        g = torch.Generator().manual_seed(0)
        noise = torch.randn(4, 8, generator=g)
        made = torch.from_numpy(np.ones((4, 8), dtype=np.float32))
        made.mul_(2.0)
        table.requires_grad_(False)
        return ops.add_extra_input(x, off + noise + made)

    fused = functe.fuse(fn)
    assert torch.equal(fused(x), fn(x)) and torch.equal(fused(x), fn(x))


def test_fuse_and_explain_take_a_partial_or_a_callable_object(capsys):
    # (Fused read the __name__ that functools.update_wrapper cannot copy from these: AttributeError)
    def scaled(x, w, *, alpha):
        return ops.linear(x, w) * alpha

    class Model:
        def __call__(self, x, w):
            return ops.gelu(ops.linear(x, w))

    x, w = torch.randn(4, 8), torch.randn(6, 8)
    partial = functools.partial(scaled, alpha=2.0)
    assert torch.equal(functe.fuse(partial)(x, w), scaled(x, w, alpha=2.0))
    assert torch.equal(functe.fuse(Model())(x, w), Model()(x, w))
    functe.explain(partial, x, w)
    assert capsys.readouterr().out.startswith("functe.fuse(partial(scaled)): program as traced")
    # (update_wrapper copied a callable's attributes onto the Fused: a `plan` attribute hid Fused.plan)
    model = Model()
    model.plan = "cosine schedule"
    assert functe.fuse(model).plan(x, w).stats["forward"] is not None
    functe.explain(model, x, w)
    assert capsys.readouterr().out.startswith("functe.fuse(Model): program as traced")
