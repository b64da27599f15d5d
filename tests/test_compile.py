"""torch.compile: functe ops compile with fullgraph=True, and compiled torch.func transforms never drop
custom backward rules silently."""

from __future__ import annotations

import pytest
import torch
from helpers import make
from torch._subclasses.fake_tensor import FakeTensorMode
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
    # The same through functe.fuse: inside the traced transform no tensor requires grad, and the
    # forward plan alone ran, so Dynamo differentiated it (cos(x), silently) in both modes.
    fused = functe.fuse(lambda x: _zero_bwd(x))
    g = lambda x: fused(x).sum()
    torch._dynamo.reset()
    assert torch.equal(torch.compile(grad(g), backend="aot_eager")(x), torch.zeros(5))
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"maybe_current_level|torch\.\* op returned non-Tensor|functe\.fuse"):
        torch.compile(grad(g), backend="aot_eager", fullgraph=True)(x)
    # backend="eager", fullgraph=False: Dynamo evaluates the check inside the transform: functe's error.
    torch._dynamo.reset()
    with pytest.raises(functe.TransformError, match=r"functe\.zero_bwd: torch\.compile of a torch\.func transform"):
        torch.compile(grad(f), backend="eager")(x)


def test_a_compiled_fused_function_recompiles_for_new_shapes_and_static_values():
    # On a recompile Dynamo makes changed sizes and Python numbers symbolic, which the plan lookup
    # (assume_constant_result) refused: a new batch size or a new static float raised.
    fused = functe.fuse(lambda x, w, s, k: ops.constant_scale(ops.gelu(ops.linear(x, w)), s * k))
    compiled = torch.compile(fused, backend="eager", fullgraph=True)
    w = make((8, 8))
    for n, s, k in ((3, 0.5, 1), (5, 0.25, 2), (7, 2.0, 3), (3, 0.5, 1)):
        x = make((n, 8)).requires_grad_()
        got, want = compiled(x, w, s, k), fused(x, w, s, k)
        assert torch.equal(got, want)
        assert torch.equal(torch.autograd.grad(got.sum(), x)[0], torch.autograd.grad(want.sum(), x)[0])
    assert fused.trace_count == 3
    torch._dynamo.reset()
    x = make((4, 8))
    assert torch.equal(
        torch.compile(fused, backend="eager", fullgraph=True, dynamic=True)(x, w, 0.5, 1), fused(x, w, 0.5, 1)
    )


def test_a_compiled_fused_training_step_compiles_once_for_new_tensors_of_one_signature():
    # _distinct compared id()s, on which Dynamo guards: every new batch tensor recompiled, and with
    # fullgraph=True the 9th step hit the recompile limit (fullgraph=False fell back to eager)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    fused = functe.fuse(lambda x, w: ops.linear(x, w) + x)
    compiled = torch.compile(fused, backend="eager", fullgraph=True)
    w = make((8, 8)).requires_grad_()
    for _ in range(10):
        x = make((4, 8))
        got, want = compiled(x, w), fused(x, w)
        assert torch.equal(torch.autograd.grad(got.sum(), w)[0], torch.autograd.grad(want.sum(), w)[0])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_a_new_signature_does_not_recompile_the_graphs_of_the_others():
    # (the plan was read as fused._plans[index], on which Dynamo guards the list's length: every new
    # signature's plan invalidated every graph compiled before it, 3 compiles for 2 shapes, 2k-1 for k)
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("eager")
    fused = functe.fuse(lambda x, w: ops.gelu(ops.linear(x, w)))
    compiled = torch.compile(fused, backend=counter, fullgraph=True)
    w = make((8, 8)).requires_grad_()
    for n in (4, 6, 4, 6, 4, 6):
        x = make((n, 8))
        assert torch.equal(compiled(x, w), fused(x, w))
    assert counter.frame_count == 2 and fused.trace_count == 2


class _FoldingBlock(torch.nn.Module):
    """A frozen buffer the fused forward folds (a cast copy): the plan's constant has it as its source."""

    def __init__(self):
        super().__init__()
        self.register_buffer("w", torch.eye(4))
        self.fused = functe.fuse(self._impl)

    def _impl(self, x):
        return ops.linear(x, self.w.to(torch.float64).to(torch.float32))

    def forward(self, x):
        return self.fused(x)


def test_a_compiled_plan_sees_in_place_updates_of_the_tensors_it_folded():
    # (no Dynamo guard sees a version counter: after load_state_dict the compiled graph kept
    # computing with the trace's weights, where eager retraced)
    block, x = _FoldingBlock(), make((2, 4))
    compiled = torch.compile(block, backend="eager")
    assert torch.equal(compiled(x), x)
    block.load_state_dict({"w": 3.0 * torch.eye(4)})
    assert torch.equal(compiled(x), 3.0 * x) and block.fused.trace_count == 2
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="folded computations on captured tensors"):
        torch.compile(_FoldingBlock(), backend="eager", fullgraph=True)(x)


def test_a_compiled_plan_follows_a_module_weight_replaced_after_the_trace():
    # (the plan holds the weight it captured; eager checks the module's names per call, but the
    # compiled graph kept computing with the replaced weight)
    from torch._dynamo.testing import CompileCounterWithBackend

    class Frozen(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4, bias=False).requires_grad_(False)
            self.fused = functe.fuse(self._impl)

        def _impl(self, x):
            return ops.linear(x, self.lin.weight)

        def forward(self, x):
            return self.fused(x)

    block, x, counter = Frozen(), make((2, 4)), CompileCounterWithBackend("eager")
    compiled = torch.compile(block, backend=counter, fullgraph=True)
    for _ in range(3):
        assert torch.equal(compiled(x), x @ block.lin.weight.T)
    block.lin.weight = torch.nn.Parameter(make((4, 4)), requires_grad=False)
    assert torch.equal(compiled(x), x @ block.lin.weight.T)
    block.lin = torch.nn.Linear(4, 4, bias=False).requires_grad_(False)
    for _ in range(3):
        assert torch.equal(compiled(x), x @ block.lin.weight.T)
    assert counter.frame_count == 3 and block.fused.trace_count == 3


def test_a_compiled_plan_refuses_a_captured_weight_made_trainable_after_the_trace():
    # (building the plan's autograd op for the new call refused it first, with custom_vjp's message
    # about "constant_residuals", naming neither the tensor's origin nor the remedy)
    class Frozen(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.base = torch.nn.Parameter(torch.eye(8), requires_grad=False)
            self.fused = functe.fuse(self._impl)

        def _impl(self, x, w):
            return ops.linear(ops.linear(x, self.base), w)

        def forward(self, x, w):
            return self.fused(x, w)

    block, x, w = Frozen(), make((2, 8)), make((8, 8)).requires_grad_()
    compiled = torch.compile(block, backend="eager")
    compiled(x, w).sum().backward()
    block.base.requires_grad_(True)
    with pytest.raises(functe.TraceError, match=r"captured from the enclosing scope as a constant requires gradients"):
        compiled(x, w).sum().backward()


# (torch's own warning at any graph break whose output requires grad, plain torch's too)
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
def test_an_opaque_op_compiles_with_a_graph_break_and_fullgraph_names_why():
    # An opaque op under torch.compile crashed Dynamo (an internal error loading its function from
    # the forward's closure), and in a fused program each of its checks broke the graph with a
    # warning; fullgraph=True failed with "get_rng_state ... should not be traced", which says
    # nothing of functe.opaque or of fullgraph=False. Now the op runs eagerly: a graph break, exact.
    soft = functe.opaque(lambda q: torch.softmax(q, -1), name="attn")
    fused = functe.fuse(lambda x, w: ops.linear(soft(x), w))
    x, w = make((4, 8)).requires_grad_(), make((8, 8)).requires_grad_()
    for fn in (lambda x, w: ops.linear(soft(x), w), fused):
        loss = lambda x, w, fn=fn: (fn(x, w) ** 2).sum()
        expected = torch.autograd.grad(loss(x, w), (x, w))
        for got, want in zip(torch.autograd.grad(torch.compile(loss)(x, w), (x, w)), expected):
            assert_close(got, want)
        torch._dynamo.reset()  # (else the graph-broken code compiled above serves the next call)
        with pytest.raises(Exception, match=r"functe.opaque.*compile with fullgraph=False"):
            torch.compile(loss, fullgraph=True)(x, w)
        torch._dynamo.reset()


@pytest.mark.parametrize("dynamic", [True, None], ids=["dynamic", "a changed number"])
def test_float_arguments_compile_fullgraph_with_dynamic_shapes(dynamic):
    # Dynamo made eps (or a limit) symbolic under dynamic=True, or once it changed between calls, and
    # the argument check's math.isfinite of it broke the graph: fullgraph=True refused four ops.
    x, g, b = make((3, 8)), make((8,)), make((8,))
    cases = {
        "layer_norm": lambda x, eps: ops.layer_norm(x, g, b, eps=eps),
        "rms_norm": lambda x, eps: ops.rms_norm(x, g, eps=eps),
        "l2_normalize": lambda x, eps: ops.l2_normalize(x, eps=eps),
        "clamped_swiglu": lambda x, eps: ops.clamped_swiglu(x, limit=7.0 + eps),
    }
    for name, fn in cases.items():
        compiled = torch.compile(fn, fullgraph=True, dynamic=dynamic, backend="eager")
        for eps in (1e-5, 1e-3):
            assert_close(compiled(x, eps), fn(x, eps), msg=name)  # (compiled: the twin, an ulp off the fast path)
        torch._dynamo.reset()


def test_an_opaque_op_exports_without_dynamo_and_a_changing_scale_compiles_once():
    # A non-strict export (torch 2.13's default) reports compiling without Dynamo: an opaque op's
    # eager detour called itself forever. And the number check specialised constant_scale's scale,
    # which no check reads: a graph per value (the 9th refused fullgraph) and -0.0 lost its sign.
    soft = functe.opaque(lambda q: torch.softmax(q, -1), name="export_attn")

    class Block(torch.nn.Module):
        def forward(self, x):
            return soft(x) * 2

    x = make((4, 8))
    assert torch.equal(torch.export.export(Block(), (x,)).module()(x), Block()(x))
    counts = torch._dynamo.utils.counters
    counts.clear()
    scaled = torch.compile(lambda x, s: ops.constant_scale(x, s), fullgraph=True, backend="eager")
    zeros, sign = torch.zeros(3), lambda t: t.copysign(torch.ones(3))  # (1 or -1: the zero's sign)
    for s in (0.5, 0.25, 3.0, 1.5, 2.5, 7.0, 9.0, 11.0, 13.0, -0.0):
        assert torch.equal(sign(scaled(zeros, s)), sign(ops.constant_scale(zeros, s)))
    assert counts["stats"]["unique_graphs"] <= 2  # (the first value, then one symbolic scale)


def test_compiled_dropout_with_a_changing_p():
    # The fp32 scale 1/(1-p) is folded by Dynamo (assume_constant_result): a symbolic p raised.
    fn = lambda x, p: ops.dropout(x, p, seed=torch.tensor(3))
    compiled = torch.compile(fn, backend="eager", fullgraph=True)
    x = make((6, 6))
    for p in (0.1, 0.2, 0.5):
        assert torch.equal(compiled(x, p), fn(x, p))


def test_fused_functions_with_pytree_outputs_and_state_arguments_compile_fullgraph():
    # The generated plan code built and indexed pytrees with optree specs made outside the trace,
    # which Dynamo refuses: a dict output, or an fp8_linear taking a delayed-scaling state, failed.
    recipe = functe.DelayedScaling(amax_history_len=4)
    state = functe.init_linear_scaling_state(recipe)

    def fn(x, w, st):
        y = ops.fp8_linear(x, w, None, st, recipe=recipe)
        return {"y": y, "pair": (ops.gelu(y), [y * 2.0])}

    fused = functe.fuse(fn, recipe=recipe)
    x, w = make((4, 16)), make((8, 16))
    compiled = torch.compile(fused, backend="eager", fullgraph=True)
    for f in (fused, compiled):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = f(xs, ws, state)
        assert list(out) == ["y", "pair"] and isinstance(out["pair"][1], list)
        loss = out["y"].sum() + out["pair"][0].sum() + out["pair"][1][0].sum()
        grads = torch.autograd.grad(loss, (xs, ws))
        if f is fused:
            expected = (out, grads)
    assert all(torch.equal(a, b) for a, b in zip(functe.tree_leaves(out), functe.tree_leaves(expected[0])))
    assert all(torch.equal(a, b) for a, b in zip(grads, expected[1]))
    assert "_unflatten(" not in fused.plan(x, w, state).source  # spelled out in Python


@pytest.mark.parametrize("fork", ["identity", "make_extra_output"])
def test_compiled_fused_function_whose_outputs_are_one_tensor_at_run_time(fork):
    # identity and make_extra_output hand back their input object: two distinct variables were one
    # tensor returned twice by the fused Function, and Dynamo failed ("Placeholder node not found").
    def fn(x):
        y = 2.0 * x
        return (y, ops.identity(y)) if fork == "identity" else (y, *ops.make_extra_output(y))

    fused = functe.fuse(fn)
    compiled = torch.compile(fused, backend="eager", fullgraph=True)
    x = make((4, 3)).requires_grad_()
    for f in (compiled, fused):
        got, want = f(x), fn(x)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        cts = [torch.full_like(g, float(i + 1)) for i, g in enumerate(got)]
        (dx,) = torch.autograd.grad(got, x, cts)
        torch.testing.assert_close(dx, torch.autograd.grad(want, x, cts)[0], rtol=0, atol=0)


@pytest.mark.parametrize("wrapper", [functe.value_and_grad, functe.data_parallel_value_and_grad])
def test_a_compiled_training_step_runs_value_and_grad_eagerly_and_exactly(wrapper):
    # Dynamo's optree polyfill, past a graph break inside torch.func.grad_and_value, unflattened the
    # params and state wrongly: "ValueError: length mismatch" (the data-parallel wrapper: "unhashable
    # type: 'list'"). The step now runs value_and_grad eagerly and compiles the rest.
    recipe = functe.DelayedScaling(amax_history_len=3)

    def loss_fn(params, state, x):
        h = ops.fp8_linear(x, params["w"], params["b"], state["fc"], recipe=recipe)
        return ops.gelu(h).square().mean()

    vg = wrapper(loss_fn)

    def train_step(params, state, x):
        loss, grads, state = vg(params, state, x)
        return loss, {k: p - 0.1 * grads[k] for k, p in params.items()}, state

    params = {"w": make((8, 16), torch.float32), "b": make((8,), torch.float32)}
    state = {"fc": functe.init_linear_scaling_state(recipe)}
    with pytest.raises(torch._dynamo.exc.Unsupported, match="compile the loss and take gradients"):
        torch.compile(vg, fullgraph=True, backend="aot_eager")(params, state, make((4, 16), torch.float32))
    torch._dynamo.reset()
    compiled = torch.compile(train_step, backend="aot_eager")
    eager_run, compiled_run = (params, state), (params, state)
    for step in range(3):
        x = make((4, 16), torch.float32, scale=step + 1.0)
        loss, *eager_run = train_step(*eager_run, x)
        compiled_loss, *compiled_run = compiled(*compiled_run, x)
        assert torch.equal(compiled_loss, loss)
    for got, want in zip(functe.tree_leaves(compiled_run), functe.tree_leaves(eager_run), strict=True):
        assert torch.equal(got, want)


def test_a_compiled_step_over_torch_func_compiles_no_functe_frame():
    # The transform graph-breaks and runs eagerly with Dynamo's frame callback still installed: every
    # frame the eager Functions reached was compiled on its own (12 graphs for this step, and the
    # rule wrapper shared by every op recompiled per op until the recompile limit), results off by
    # an ulp and each step slower than eager. Now the step is one graph, exact, and stays one.
    graphs = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def loss(p, x):
        h = ops.gelu(ops.linear(ops.layer_norm(x, p["g"], p["b"]), p["w"]))
        return ops.rms_norm(h, p["g2"]).square().mean()

    def step(p, x):
        g = torch.func.grad(loss)(p, x)
        return {k: v - 0.1 * g[k] for k, v in p.items()}

    torch._dynamo.reset()
    params = {"g": torch.ones(8), "b": torch.zeros(8), "w": make((16, 8), torch.float32), "g2": torch.ones(16)}
    compiled, eager = params, params
    for i in range(3):
        x = make((4, 8), torch.float32, scale=i + 1.0)
        compiled, eager = torch.compile(step, backend=count)(compiled, x), step(eager, x)
        for k in params:
            assert torch.equal(compiled[k], eager[k]), k
    assert len(graphs) == 1


_CAPTURED_W, _CAPTURED_C = make((4, 4), torch.float32), make((4,), torch.float32)


@pytest.mark.parametrize(
    "program",
    [
        lambda x: ops.linear(x, _CAPTURED_W),
        lambda x: {"y": ops.linear(x, _CAPTURED_W) + _CAPTURED_C, "g": ops.gelu(x)},
        lambda x: ops.linear(x, _CAPTURED_W) * 2.0,
        lambda x: {"g": ops.gelu(x), "z": ops.linear(x, _CAPTURED_W) * 2.0},
    ],
    ids=["linear", "dict", "scaled", "scaled dict"],
)
def test_a_compiled_fused_function_with_captured_tensors_differentiates(program):
    # A plan's literal tensors in the closure of the compiled Function's forward (as constant
    # residuals) made Dynamo's trace of its backward fail: RuleError on the cotangent's structure,
    # "unhashable type: 'list'" for a dict output. With a frozen (captured) weight under a fused
    # linear + scale, the residual pruning's `is` between two tuples broke the graph, past which
    # Dynamo's optree polyfill failed the same two ways.
    x = make((3, 4), torch.float32).requires_grad_()
    loss = lambda out: sum(o.square().sum() for o in functe.tree_leaves(out))
    want = torch.autograd.grad(loss(program(x)), x)[0]
    got = torch.autograd.grad(loss(torch.compile(functe.fuse(program), backend="aot_eager")(x)), x)[0]
    assert_close(got, want)


ALIASED_ARGUMENTS = {
    "layer_norm(x, w, w)": lambda x, w, m: ops.layer_norm(x, w, w),
    "linear(m, m, w)": lambda x, w, m: ops.linear(m, m, w),
    "add_extra_input(x, x)": lambda x, w, m: ops.add_extra_input(x, x),
    "bias(w, w)": lambda x, w, m: ops.bias(w, w),
}


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
@pytest.mark.parametrize("case", list(ALIASED_ARGUMENTS))
def test_an_op_given_one_tensor_twice_compiles_and_differentiates(case, compiler):
    # Dynamo hands such a call back to eager with the argument structure its optree polyfill built,
    # which keeps the namespace optree drops: every backward raised "cotangent 0 ... has structure
    # PyTreeSpec(*, NoneIsLeaf), expected ... PyTreeSpec(*, NoneIsLeaf, namespace='functe')".
    fn = ALIASED_ARGUMENTS[case]
    args = [make(s, torch.float32).requires_grad_() for s in ((4, 16), (16,), (16, 16))]
    expected = torch.autograd.grad(fn(*args).sum(), args, allow_unused=True)
    got = torch.autograd.grad(torch.compile(fn, backend=compiler)(*args).sum(), args, allow_unused=True)
    for g, e in zip(got, expected):
        assert (g is None and e is None) or assert_close(g, e) is None


def test_strict_export_with_a_dynamic_batch_and_grad_mode_on():
    # (the backward rule's shape check compared a symbolic shape saved by the forward inside Dynamo:
    # "NotImplementedError: argument of type LazyProxy" for linear and rms_norm)
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w, self.g = torch.nn.Parameter(make((16, 32))), torch.nn.Parameter(make((16,)))

        def forward(self, x):
            return ops.rms_norm(ops.linear(x, self.w), self.g)

    block = Block()
    batch = torch.export.Dim("batch")
    exported = torch.export.export(block, (make((8, 32)),), dynamic_shapes={"x": {0: batch}}, strict=True)
    x = make((5, 32))
    assert_close(exported.module()(x), block(x))


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf Tensor")
def test_a_compiled_backward_rule_returning_a_wrong_rank_is_refused():
    # (the rules' gradient check was skipped whole while compiling: autograd summed the [3,4]
    # gradient of a [4] input silently; under compile only symbolic sizes go unchecked now)
    bad = functe.custom_vjp("bad_rank", lambda x: (x * 2.0, None), lambda _, g: (g.expand(3, *g.shape),))
    x = make((4,)).requires_grad_()
    with pytest.raises(functe.RuleError, match=r"returned f32\[3,4\] for argument 'x', expected f32\[4\]"):
        torch.autograd.grad(bad(x).sum(), x)
    compiled = torch.compile(lambda x: bad(x).sum(), backend="aot_eager", fullgraph=True)
    with pytest.raises((functe.RuleError, torch._dynamo.exc.Unsupported)):
        torch.autograd.grad(compiled(x), x)


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf Tensor")
def test_a_frozen_module_fused_under_autocast_follows_in_place_updates_when_compiled():
    # Autocast's casts of captured frozen weights are folded constants whose sources the compiled
    # call checks outside the graph (a graph break; fullgraph=True refuses): exact after load_state_dict.
    class Frozen(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 16).requires_grad_(False)
            self.fused = functe.fuse(self._impl)

        def _impl(self, x):
            return ops.gelu(ops.linear(x, self.fc.weight, self.fc.bias))

        def forward(self, x):
            return self.fused(x)

    block, x = Frozen(), make((4, 8)).requires_grad_()
    compiled = torch.compile(block, backend="eager")
    for step in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, want = compiled(x), block._impl(x)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), step
        assert torch.equal(torch.autograd.grad(got.float().sum(), x)[0], torch.autograd.grad(want.float().sum(), x)[0])
        block.load_state_dict({k: v * 2.0 for k, v in block.state_dict().items()})


def test_a_fused_function_made_inside_a_compiled_function_runs():
    # (Dynamo built the Fused while tracing, and the plan lookup outside the graph found it without
    # its attributes: InternalTorchDynamoError "'Fused' object has no attribute '_modules_epoch'")
    def step(x):
        return functe.fuse(lambda a: ops.gelu(a) * 2.0)(x)

    x = make((3, 8), torch.float64).requires_grad_()
    compiled = torch.compile(step, backend="eager")
    # (each call makes a new Fused, so each recompiles: past Dynamo's limit, 8, the frame runs
    # eagerly, still right; docs/fusion.md)
    for _ in range(10):
        got = compiled(x)
        assert_close(got, ops.gelu(x) * 2.0)
    assert_close(torch.autograd.grad(got.sum(), x)[0], grad(lambda a: (ops.gelu(a) * 2.0).sum())(x.detach()))


@pytest.mark.parametrize("fullgraph", [False, True])
def test_a_functe_error_in_a_compiled_fused_call_is_the_eager_error(fullgraph):
    # A TraceError raised while Dynamo traced the call reached the caller as InternalTorchDynamoError,
    # which `except functe.TraceError` misses; it now comes from the call run outside the graph,
    # and once the cause is gone (the captured weight frozen) the next call compiles the plan.
    w = make((4, 4)).requires_grad_()
    fused = functe.fuse(lambda x: ops.linear(x, w))
    compiled = torch.compile(fused, backend="eager", fullgraph=fullgraph)
    if fullgraph:  # (no graph break allowed: Dynamo's error, carrying functe's message)
        with pytest.raises(torch._dynamo.exc.Unsupported, match=r"functe\.fuse\(<lambda>\): .*requires gradients"):
            compiled(make((2, 4)))
        return
    with pytest.raises(functe.TraceError, match="requires gradients"):
        compiled(make((2, 4)))
    w.requires_grad_(False)
    for _ in range(4):
        x = make((2, 4))
        assert torch.equal(compiled(x), ops.linear(x, w))
    assert fused._failed_traces == 1  # (one call ran outside the graph; the rest compiled the plan)


def test_an_eager_backward_of_a_fused_function_does_not_recompile_its_compiled_caller():
    # (the generated backward read each step's one-time check flag, on which Dynamo guarded: the
    # first eager backward flipped it and the compiled caller compiled a second graph)
    fused = functe.fuse(lambda x, w: ops.gelu(ops.linear(x, w)) + x)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(lambda x, w: fused(x, w).sum(), backend=backend)
    w = make((8, 8)).requires_grad_()
    for _ in range(3):
        got = torch.autograd.grad(compiled(make((4, 8)).requires_grad_(), w), w)[0]
        want = torch.autograd.grad(fused(make((4, 8)).requires_grad_(), w).sum(), w)[0]
        assert got.shape == want.shape
    assert len(graphs) == 1


def test_compiled_gelu_agrees_with_eager_in_float64():
    # (the twin compiled code runs used TE's fp32 constants in float64 too: 5e-9 off eager geglu)
    x = make((4, 16), torch.float64, scale=2.0)
    scale = torch.rand(4, dtype=torch.float64) + 0.5
    for fn in (ops.gelu, ops.geglu, lambda x: ops.activation(x, "gelu", scale)):
        # (the tolerance table's float64 entry, 1e-7, is for float64 against exact math: too loose here)
        torch.testing.assert_close(torch.compile(fn, backend="eager")(x), fn(x), rtol=1e-13, atol=1e-13)


def test_nvfp4_linear_compiles_with_a_dynamic_batch_of_one_hadamard_block():
    # (the Hadamard twin reshaped through the dynamic size // 16: with a first batch of exactly 16
    # tokens Dynamo could not prove the round trip and specialised the batch, refusing mark_dynamic)
    recipe = functe.NVFP4BlockScaling()
    w = (make((64, 64)) / 8).requires_grad_()
    loss = lambda x, w, s: ops.fp8_linear(x, w, None, None, recipe=recipe, seed=s).square().mean()
    compiled = torch.compile(loss, backend="aot_eager")
    for tokens in (16, 32):
        x = make((tokens, 64))
        torch._dynamo.mark_dynamic(x, 0)
        got = torch.autograd.grad(compiled(x, w, torch.tensor(3)), w)[0]
        assert torch.equal(got, torch.autograd.grad(loss(x, w, torch.tensor(3)), w)[0])


@pytest.mark.parametrize("x_shape", [(6,), (2, 3, 6)])
@pytest.mark.parametrize("fused", [False, True])
def test_a_compiled_linear_output_takes_an_in_place_write_as_eagerly(x_shape, fused):
    # A biased or 1-D linear's output is torch's GEMM result reshaped: a view made inside the
    # Function, which eagerly is un-viewed at its boundary; compiled it was not, and the caller's
    # write raised "Output 0 of CompiledFunction is a view and is being modified inplace".
    def fn(x, w, b):
        return ops.linear(x, w, b) + x if fused else ops.linear(x, w, b)

    args = [make(s, torch.float64).requires_grad_() for s in (x_shape, (6, 6), (6,))]
    compiled = torch.compile(functe.fuse(fn) if fused else fn, backend="aot_eager", fullgraph=True)
    got, want = compiled(*args), fn(*args)
    got.mul_(3.0)
    want.mul_(3.0)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    cts = make(want.shape, torch.float64)
    for g, w in zip(torch.autograd.grad(got, args, cts), torch.autograd.grad(want, args, cts)):
        torch.testing.assert_close(g, w)


def test_compiled_fused_outputs_no_trainable_input_reaches_do_not_require_grad():
    # Compiled, every output of the fused Function required grad once any input did: autograd.grad
    # of such an output gave zeros where unfused it raises, and allow_unused gave zeros for None.
    def fn(x, b):
        return ops.silu(b).reshape(2, -1), ops.gelu(b), ops.gelu(x)

    x, b = make((4, 6), torch.float64).requires_grad_(), make((6,), torch.float64)
    compiled = torch.compile(functe.fuse(fn), backend="aot_eager", fullgraph=True)
    got, want = compiled(x, b), fn(x, b)
    assert [t.requires_grad for t in got] == [t.requires_grad for t in want] == [False, False, True]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="does not require grad"):
        torch.autograd.grad(got[0].sum(), x)
    # the same graph with b trainable is another compile (Dynamo guards requires_grad)
    b.requires_grad_()
    got = compiled(x, b)
    assert all(t.requires_grad for t in got)
    (db,) = torch.autograd.grad(got[0].sum() + got[1].sum(), b)
    torch.testing.assert_close(db, torch.autograd.grad(fn(x, b)[0].sum() + fn(x, b)[1].sum(), b)[0])


def test_a_compiled_fused_function_returns_a_returned_input_itself():
    # Through the fused Function a returned input was a view that compiled code refused to write
    # ("a function that returns multiple views"); unfused, compiled or not, it is the input itself.
    def fn(x, y):
        return y, ops.gelu(x)

    x, y = make((4, 6), torch.float64).requires_grad_(), make((4, 6), torch.float64)
    y0 = y.clone()
    compiled = torch.compile(functe.fuse(fn), backend="aot_eager", fullgraph=True)
    out = compiled(x, y)
    assert out[0] is y
    out[0].mul_(3.0)
    torch.testing.assert_close(y, 3.0 * y0, rtol=0, atol=0)
    (dx,) = torch.autograd.grad(out[1].sum(), x)
    torch.testing.assert_close(dx, torch.autograd.grad(fn(x, y)[1].sum(), x)[0], rtol=0, atol=0)


_TRANSPOSED_CASES = {
    "qgelu": lambda x, w, b: ops.qgelu(x),
    "swiglu": lambda x, w, b: ops.swiglu(x),
    "scaled_srelu": lambda x, w, b: ops.scaled_srelu(x, w[:4].abs()),
    "layer_norm": lambda x, w, b: ops.layer_norm(x, w, b),
    "rms_norm": lambda x, w, b: ops.rms_norm(x, w),
    "l2_normalize": lambda x, w, b: ops.l2_normalize(x),
    "dropout": lambda x, w, b: ops.dropout(x, 0.5, seed=3),
}


@pytest.mark.parametrize("case", sorted(_TRANSPOSED_CASES))
def test_an_op_on_a_transposed_input_lays_out_its_output_alike_compiled_and_as_its_fake(case, backend, device):
    # The twins' formulas keep a transposed input's strides, where the CPU fast paths and the Triton
    # launchers write contiguous outputs: compiled on the CPU `.view(-1)` of the output failed where
    # it works eagerly, and as a custom op's fake the twin disagreed with the launcher, which failed
    # Inductor's assert_size_stride at run time (a GPU's route; here through the interpreter).
    f = _TRANSPOSED_CASES[case]
    x, w, b = (make(s, torch.float64, device=device) for s in ((8, 4), (8,), (8,)))
    x = x.t()
    eager = f(x, w, b)
    assert eager.is_contiguous()
    compiled = torch.compile(lambda x: f(x, w, b).view(-1), backend="aot_eager", fullgraph=True)(x)
    torch.testing.assert_close(compiled, eager.view(-1))  # (eagerly the CPU fast paths: other roundings)
    x.requires_grad_()
    ct = make(eager.shape, torch.float64, device=device)
    (dx_eager,) = torch.autograd.grad(f(x, w, b), x, ct)
    (dx_compiled,) = torch.autograd.grad(torch.compile(f, backend="aot_eager")(x, w, b), x, ct)
    torch.testing.assert_close(dx_compiled, dx_eager)  # (its layout may differ, as torch's own ops' does)
    if backend == "interpret" or device == "cuda":  # (the custom op's route: its fake stands for the launcher)
        mode = FakeTensorMode()
        with mode:
            fake = f(*(mode.from_tensor(t) for t in (x, w, b)))
        assert fake.stride() == eager.stride()
