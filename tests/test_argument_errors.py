"""Bad arguments get clear functe errors, never a silent wrong answer: ops, custom_vjp, tracing, fusion
rules and the fuse cache (cases an API fuzz found)."""

from __future__ import annotations

import functools
import math
import re
import types

import pytest
import torch
import torch.nn.functional as F
from helpers import make

import functe
from functe import ops
from functe.ops import _core, _fused
from functe.rules import Pattern, Rule, RuleSet, check
from functe.testing import assert_close

X = make((4, 8))

# ----------------------------------------------------------------------------- every error is a FuncteError

_ARGUMENT_ERRORS = {
    "dropout p": lambda: ops.dropout(X, 1.5, seed=0),
    "dropout seed": lambda: ops.dropout(X, 0.5, seed=1.0),
    "interleave": lambda: ops.swiglu(X, interleave=0),
    "eps": lambda: ops.layer_norm(X, torch.ones(8), torch.zeros(8), eps=-1.0),
    "limit": lambda: ops.clamped_swiglu(X, limit=-1.0),
    "scale": lambda: ops.constant_scale(X, torch.tensor(2.0)),
    "activation name": lambda: ops.activation(X, "bogus"),
    "unhashable activation name": lambda: ops.activation(X, ["gelu"]),
    "tensor_parallel_mode": lambda: ops.linear(X, make((3, 8)), tensor_parallel_mode="diag"),
    "zero_centered_gamma": lambda: ops.layer_norm(X, torch.ones(8), torch.zeros(8), zero_centered_gamma="no"),
    "rms zero_centered_gamma": lambda: ops.rms_norm(X, torch.ones(8), zero_centered_gamma=1),
    "scaled_swiglu s": lambda: ops.scaled_swiglu(X, None),
    "scaled_srelu s": lambda: ops.scaled_srelu(X, None),
    "scaled_clamped_qgeglu s": lambda: ops.scaled_clamped_qgeglu(X, None),
    "reshape int dims": lambda: ops.reshape(X, (3.5, 4)),
    "reshape negative dims": lambda: ops.reshape(X, (-2, -16)),
    # (a second API fuzz: each of these was accepted, or failed inside torch or Python)
    "in_place non-bool": lambda: ops.add_extra_input(X, X.clone(), in_place="False"),
    "scale too large for a float": lambda: ops.constant_scale(X, 10**400),
    "eps too large for a float": lambda: ops.layer_norm(X, torch.ones(8), torch.zeros(8), eps=10**400),
    "limit too large for a float": lambda: ops.clamped_swiglu(X, limit=10**400),
    "set_collective_checks non-bool": lambda: functe.set_collective_checks("no"),
    "fuse rules": lambda: functe.fuse(lambda x: x, rules="none"),
    "opaque of a non-function": lambda: functe.opaque(3),
    "explain rules": lambda: functe.explain(lambda x: x, X, rules=[]),
    "rules.check rule": lambda: check("not a rule", {}),
    # (a third sweep: a truthy string averaged where a sum was meant; the others failed deep inside
    # Python, c10d or a trace)
    "all_reduce_gradients average": lambda: functe.all_reduce_gradients({"w": X}, average="False"),
    "value_and_grad has_aux": lambda: functe.value_and_grad(lambda p, s: p.sum(), has_aux="False"),
    "fuse of a non-function": lambda: functe.fuse(3),
    "trace of a non-function": lambda: functe.trace(3),
    "value_and_grad of a non-function": lambda: functe.value_and_grad(3),
    "explain of a non-function": lambda: functe.explain(3, X),
    "Group size": lambda: functe.Group("x", 0),
    "Group name": lambda: functe.Group(3, 2),
    "Group of no process group": lambda: ops.all_reduce(X, group=functe.Group("x", 2)),
    "Group of no process group, backward": lambda: (
        ops.linear(X.requires_grad_(), make((6, 8)), tensor_parallel_mode="column", group=functe.Group("x", 2))
        .sum()
        .backward()
    ),
}


@pytest.mark.parametrize("case", list(_ARGUMENT_ERRORS))
def test_argument_errors_are_functe_errors_and_builtin_ones(case):
    with pytest.raises(functe.ArgumentError, match=r"^functe\.[\w.]+: ") as info:
        _ARGUMENT_ERRORS[case]()
    assert isinstance(info.value, functe.FuncteError)
    assert isinstance(info.value, ValueError) and isinstance(info.value, TypeError)  # what callers caught before


_RULE_ERRORS = {
    # (a public function as a pattern's op was accepted and the rule silently never fired)
    "public function as op": (lambda: Pattern(ops.linear, "x", "w", "b"), r"functe\.rules\.Pattern: argument 'op'"),
    "string as op": (lambda: Pattern("linear", "x"), r"expected a functe op \(CustomVJP\)"),
    "commutative": (lambda: Pattern(_core._linear, "x", "w", commutative="no"), r"'commutative' expected a bool"),
    "RuleSet of ints": (lambda: RuleSet([1]), r"functe\.rules\.RuleSet: a RuleSet holds Rules, got int"),
    "rewrite of None": (lambda: functe.rules.rewrite(None, RuleSet(), "forward"), r"argument 'oplist' expected"),
    "rewrite of a list": (
        lambda: functe.rules.rewrite(functe.trace(lambda x: x * 2.0)(X), [], "forward"),
        r"argument 'rules' expected a RuleSet",
    ),
    "rule without a rewrite": (
        lambda: Rule("r", "forward", Pattern(_core._linear, "x"), None),
        r"rule r: rewrite must be a function",
    ),
    "custom_vjp name": (
        lambda: functe.custom_vjp(3, lambda x: (x, None), lambda r, g: (g,)),
        r"functe\.custom_vjp: argument 'name' expected a non-empty str",
    ),
}


@pytest.mark.parametrize("case", list(_RULE_ERRORS))
def test_rule_building_errors_name_the_function_and_argument(case):
    build, message = _RULE_ERRORS[case]
    with pytest.raises(functe.RuleError, match=r"^functe\.[\w.]+: ") as info:
        build()
    assert info.match(message)


def test_reshape_takes_an_int_as_torch_does():
    assert ops.reshape(X, 32).shape == (32,)
    assert torch.equal(ops.reshape(X, [2, -1]), X.reshape(2, -1))


def test_rule_contract_errors_are_rule_errors():
    twice = functe.custom_vjp("twice", lambda t: (t * 2, None), lambda r, g: (g, g))
    with pytest.raises(functe.RuleError, match=r"functe\.twice: the backward rule must return a tuple of 1"):
        torch.func.grad(lambda t: twice(t).sum())(X)
    bare = functe.custom_vjp("bare", lambda t: t * 2, lambda r, g: (g,))
    with pytest.raises(functe.RuleError, match=r"functe\.bare: the forward rule must return \(out, residuals\)"):
        bare(X)


# ----------------------------------------------------------------------------- custom_vjp static arguments


def test_a_tensor_passed_as_a_static_argument_is_refused():
    # Static values are closed over by the rules: d/ds was silently None, or 0 under torch.func.grad.
    scale = functe.custom_vjp("scale", lambda x, *, s: (x * s, None), lambda _, g, *, s: (g * s,))
    s = torch.tensor(3.0, requires_grad=True)
    with pytest.raises(functe.ArgumentError, match=r"functe\.scale: keyword argument 's' is static .* got f32\[\]"):
        scale(X, s=s)
    assert torch.equal(scale(X, s=3.0), X * 3.0)


# ----------------------------------------------------------------------------- devices


def test_state_and_seed_devices_are_checked():
    recipe = functe.DelayedScaling(amax_history_len=4)
    state = functe.tree_map(lambda t: t.to("meta"), functe.init_linear_scaling_state(recipe))
    with pytest.raises(functe.DeviceError, match=r"fp8_linear: arguments must share one device.*'state\.input\.scale'"):
        ops.fp8_linear(make((4, 16)), make((8, 16)), None, state, recipe=recipe)
    with pytest.raises(functe.DeviceError, match=r"dropout: argument 'seed' is on the meta device"):
        ops.dropout(X, 0.5, seed=torch.tensor(1, device="meta"))


# ----------------------------------------------------------------------------- tracing


def test_to_another_tensor_converts_or_is_refused():
    # x.to(other) takes other's dtype: it was recorded as a no-op (the fused result stayed f32).
    like = torch.zeros(1, dtype=torch.float16)
    printed = str(functe.trace(lambda x, like: ops.gelu(x).to(like))(X, like))
    assert "f16[4,8] = cast[dtype=f16]" in printed, printed
    converted = functe.fuse(lambda x, like: ops.gelu(x).to(like))(X, like)
    assert converted.dtype == torch.float16 and torch.equal(converted, ops.gelu(X).half())
    same = functe.fuse(lambda x, like: ops.gelu(x).to(like))
    assert torch.equal(same(X, torch.zeros(1)), ops.gelu(X))
    with pytest.raises(functe.TraceError, match=r"Tensor\.to\(f32\[4,8\], i32\[1\]\)"):  # (not a float dtype)
        functe.trace(lambda x, like: ops.gelu(x).to(like))(X, torch.zeros(1, dtype=torch.int32))


def test_traced_dtype_errors_keep_their_message():
    # torch's operator methods turn a TypeError (DTypeError is one) into NotImplemented:
    # "unsupported operand type(s) for +: 'Tracer' and 'Tracer'" was all that was left.
    y = X.double()
    for fn in (lambda x, y: x + y, lambda x, y: x - y):
        with pytest.raises(functe.TraceError, match=r"add_extra_input: argument 'extra' expected dtype f32"):
            functe.trace(fn)(X, y)


def test_torch_keywords_are_recorded_or_refused_by_name():
    w, y = make((3, 8)), make((4, 8))
    fused = functe.fuse(lambda x, y, w: F.linear(input=x.sub(y, alpha=2), weight=w))
    assert torch.equal(fused(X, y, w), F.linear(X - 2 * y, w))
    with pytest.raises(
        functe.TraceError, match=r"Tensor\.div\(f32\[4,8\], int, rounding_mode='floor'\) on a traced value cannot be"
    ):
        functe.trace(lambda x: x.div(2, rounding_mode="floor"))(X)
    assert torch.equal(functe.fuse(lambda x: x.reshape(shape=(32,)))(X), X.reshape(32))  # (torch's keyword)
    with pytest.raises(functe.TraceError, match=r"Tensor\.view: functe\.reshape: argument 'shape' expected a tuple"):
        functe.trace(lambda x: x.view(torch.int32))(X)


def test_division_by_zero_follows_torch():
    x = torch.tensor([[2.0, -3.0, 0.0, float("nan")]])
    for zero in (0, 0.0, -0.0):
        got = functe.fuse(lambda x, zero=zero: x / zero)(x)
        assert torch.equal(got.isnan(), (x / zero).isnan()) and torch.equal(got.nan_to_num(), (x / zero).nan_to_num())


# ----------------------------------------------------------------------------- the fuse cache


def test_static_floats_key_the_cache_by_their_bits():
    fused = functe.fuse(lambda x, s: x * s)
    for _ in range(3):
        fused(X, math.nan)
    assert fused.trace_count == 1  # nan != nan: every call retraced and grew the cache
    one = torch.ones(2)
    assert fused(one, 0.0).tolist() == [0.0, 0.0]
    negative = fused(one, -0.0)  # -0.0 == 0.0 reused the 0.0 plan: +0 instead of -0
    assert torch.equal(negative.signbit(), torch.tensor([True, True])) and fused.trace_count == 3


# ----------------------------------------------------------------------------- fusion rule contracts


def _program(x, w, b):
    return ops.bias(ops.linear(x, w), b)


_LINEAR_BIAS = Pattern(_core._bias, Pattern(_core._linear, "x", "w", None), "b")
_ARGS = (make((4, 8)), make((6, 8)), make((6,)))


def _forward_rule(fwd):
    op = functe.custom_vjp("bad_fused", fwd, lambda r, g: (None, None, None))
    return Rule("bad_forward", "forward", _LINEAR_BIAS, rewrite=lambda m: m.fuse(op, [m["x"], m["w"], m["b"]]))


@pytest.mark.parametrize(
    ("residuals", "got"),
    [
        (lambda x, w: ((x, w), None), r"PyTreeSpec\(\(\*, \*\), NoneIsLeaf\) of \(f32\[4,8\], f32\[6,8\]\)"),
        (lambda x, w: (None, (x, w, False)), r"PyTreeSpec\(\*, NoneIsLeaf\) of \(None\)"),
        (lambda x, w: ((w, x, False), None), r".* of \(f32\[6,8\], f32\[4,8\], False\)"),
    ],
    ids=["inner structure", "swapped", "wrong tensors"],
)
def test_a_forward_rule_must_return_each_covered_ops_residuals(residuals, got):
    # Anything else failed deep inside linear's backward rule, naming neither the rule nor the op.
    rule = _forward_rule(lambda x, w, b: (F.linear(x, w) + b, residuals(x, w)))
    msg = r"rule bad_forward: residual \d of the fused op bad_fused must be what \w+'s forward rule returns, .*; got "
    with pytest.raises(functe.TraceError, match=msg + got):
        functe.fuse(_program, rules=RuleSet([rule]))(*_ARGS)
    with pytest.raises(functe.TraceError, match=msg):
        check(rule, _ARGS, fn=_program)


@pytest.mark.parametrize("bad", [lambda g: g.sum(0, keepdim=True), lambda g: g.sum(0).double()], ids=["shape", "dtype"])
def test_a_backward_rule_returning_a_wrong_gradient_is_caught_on_every_path(bad):
    # Plain autograd silently summed a [1,N] gradient to [N] (or cast it), and rules.check passed.
    def bwd(res, g):
        (x, w, _), _ = res  # the covered ops' residuals: linear's, then bias's
        return g @ w, g.reshape(-1, g.shape[-1]).t() @ x, bad(g)

    op = functe.custom_vjp("bad_backward", lambda x, w, b: (F.linear(x, w, b), (x, w)), bwd)
    rule = Rule("bad_backward", "backward", _LINEAR_BIAS, rewrite=lambda m: m.fuse(op, [m["x"], m["w"], m["b"]]))
    fused = functe.fuse(_program, rules=RuleSet([rule]))
    args = [a.clone().requires_grad_() for a in _ARGS]
    # (each path names the op and its input, and that input as the program's caller passed it)
    msg = r"functe\.bad_backward: the backward rule returned f(32|64)\[1?,?6\] for argument 'b' "
    msg += r"\(the fused function's argument 'b'\), expected f32\[6\] \(in a fused plan's backward"
    with pytest.raises(functe.RuleError, match=msg + r"; functe\.rules\.check tests a rule\)$"):
        torch.autograd.grad(fused(*args).sum(), args)
    with pytest.raises(functe.RuleError, match=msg):
        torch.func.grad(lambda *a: fused(*a).sum(), argnums=(0, 1, 2))(*_ARGS)
    # check names the rule, and not check itself as the remedy
    with pytest.raises(functe.RuleError, match=r"functe\.rules\.check: rule bad_backward: " + msg + r"\)$"):
        check(rule, _ARGS, fn=_program)


def test_a_wrong_gradient_inside_a_pytree_or_keyword_argument_is_named_by_its_path():
    # (named "input leaf 1" before: the flat position among the program's tensors)
    op = functe.custom_vjp(
        "bad_bias_grad",
        lambda x, w, b: (F.linear(x, w, b), (x, w)),
        lambda res, g: (g @ res[0][1], g.reshape(-1, 6).t() @ res[0][0], g.sum(0).double()),
    )
    rule = Rule("bad_bias_grad", "backward", _LINEAR_BIAS, rewrite=lambda m: m.fuse(op, [m["x"], m["w"], m["b"]]))
    x, w, b = (a.clone().requires_grad_() for a in _ARGS)

    def nested(x, params, *, scale=1.0):
        return _program(x, params["w"], params["b"]) * scale

    def keyword(x, *, w, b):
        return _program(x, w, b)

    class Module(torch.nn.Module):
        def forward(self, x, params):  # (a module's __call__ takes *args: its forward names them)
            return nested(x, params)

    cases = [
        (nested, (x, {"w": w, "b": b}), {"scale": 2.0}, r"'params'\['b'\]"),
        (keyword, (x,), {"w": w, "b": b}, "'b'"),
        (Module(), (x, {"w": w, "b": b}), {}, r"'params'\['b'\]"),
    ]
    for fn, args, kwargs, label in cases:
        fused = functe.fuse(fn, rules=RuleSet([rule]))
        named = (
            r"returned f64\[6\] for argument 'b' \(the fused function's argument " + label + r"\), expected f32\[6\]"
        )
        with pytest.raises(functe.RuleError, match=named):
            torch.autograd.grad(fused(*args, **kwargs).sum(), (x, w, b))


def test_a_wrong_gradient_for_an_intermediate_is_caught_inside_a_fused_plan():
    # Unfused, custom_vjp refuses an f32[1,8] cotangent for an f32[4,8] input; inside a plan it went on
    # into gelu's backward, broadcast back to [4,8]: a gradient of the right shape and wrong values.
    op = functe.custom_vjp("row_scale", lambda h, w: (h * w, (h, w)), lambda r, g: ((g * r[1])[:1], (g * r[0]).sum(0)))
    x, w = make((4, 8)).requires_grad_(), make((8,)).requires_grad_()

    def fn(x, w):
        return op(ops.gelu(x), w)

    msg = r"functe\.row_scale: the backward rule returned f32\[1,8\] for argument 'h', expected f32\[4,8\]"
    with pytest.raises(functe.RuleError, match=msg + "$"):
        torch.autograd.grad(fn(x, w).sum(), (x, w))
    for rules in (RuleSet(), None):
        fused = functe.fuse(fn) if rules is None else functe.fuse(fn, rules=rules)
        with pytest.raises(functe.RuleError, match=msg + r" \(in a fused plan's backward\)$"):
            torch.autograd.grad(fused(x, w).sum(), (x, w))
        with pytest.raises(functe.RuleError, match=msg):
            torch.func.grad(lambda x, w, f=fused: f(x, w).sum())(x.detach(), w.detach())


def test_a_non_float_state_leaf_through_value_and_grad_names_the_leaf():
    # torch.func refused it first with "only Tensors of floating point dtype can require gradients".
    recipe = functe.DelayedScaling(amax_history_len=4)
    s = functe.init_linear_scaling_state(recipe)
    bad = functe.LinearScalingState(
        input=functe.ScalingState(torch.ones((), dtype=torch.int32), torch.zeros(4)),
        weight=s.weight,
        grad_output=s.grad_output,
    )
    loss = lambda w, st, x: ops.fp8_linear(x, w, None, st, recipe=recipe).sum()
    with pytest.raises(
        functe.StateError, match=r"value_and_grad: state leaf 'input\.scale' expected a float32 .* i32\[\]"
    ):
        functe.value_and_grad(loss)(make((8, 16)), bad, make((4, 16)))


def test_rules_check_names_a_capture_missing_from_example_args():
    rule = Rule(
        "lin_add_any_bias",
        "forward",
        Pattern(_core._add_extra_input, Pattern(_core._linear, "x", "w", "_", name="lin"), "r"),
        lambda m: m.fuse(
            _fused.forward_linear_add, [m["x"], m["w"], m.eqn("lin").inputs[2], m["r"]], scale=None, bias_op=False
        ),
    )
    args = {"x": make((4, 8)), "w": make((6, 8)), "r": make((4, 6))}
    without_r = {"x": args["x"], "w": args["w"], "_": make((6,))}
    for missing, given in (("'_'", args), ("'r'", without_r)):
        with pytest.raises(functe.ArgumentError, match=rf"takes {missing}, which example_args does not give"):
            check(rule, given)
    check(rule, {**args, "_": make((6,))})


def test_value_and_grad_params_take_none_leaves_and_name_a_non_float_leaf():
    # an absent bias (None) and an int leaf reached torch.func, whose errors name nothing
    loss = lambda p, s, x: ops.linear(x, p["w"], p["b"]).square().sum()
    x, w = make((4, 3)), make((2, 3))
    value, grads, state = functe.value_and_grad(loss)({"w": w, "b": None}, None, x)
    assert grads["b"] is None and state is None
    want = torch.func.grad(lambda w: loss({"w": w, "b": None}, None, x))(w)
    assert torch.equal(grads["w"], want) and torch.equal(value, loss({"w": w, "b": None}, None, x))
    for bad, shown in ((torch.tensor(3), r"i64\[\]"), (0.1, "float")):
        with pytest.raises(
            functe.ArgumentError,
            match=rf"value_and_grad: params leaf 'step' expected a floating-point tensor or None, got {shown}",
        ):
            functe.value_and_grad(loss)({"w": w, "b": None, "step": bad}, None, x)


def test_value_and_grad_returns_an_aux_with_non_tensor_leaves_as_given():
    # (torch.func refused an aux holding a number or None, "Expected tensors, got unsupported type
    # <class 'int'>", and a loss without an aux got its message about grad_and_value(f))
    def loss(p, s, x):
        y = ops.linear(x, p["w"])
        return y.square().sum(), {"rows": x.shape[0], "mean": y.mean(), "note": None}

    x, w = make((4, 3)), make((2, 3))
    (value, aux), grads, _ = functe.value_and_grad(loss, has_aux=True)({"w": w}, None, x)
    assert aux["rows"] == 4 and aux["note"] is None and torch.equal(aux["mean"], (x @ w.T).mean())
    assert torch.equal(value, (x @ w.T).square().sum())
    assert torch.equal(grads["w"], torch.func.grad(lambda w: loss({"w": w}, None, x)[0])(w))
    (_, aux), _, _ = functe.data_parallel_value_and_grad(loss, has_aux=True)({"w": w}, None, x)
    assert aux["rows"] == 4 and torch.equal(aux["mean"], (x @ w.T).mean())
    # (an object holding the transform's tensors would come back holding dead wrappers; one holding
    # captured tensors, a frozen head say, comes back as given)
    head = torch.nn.Linear(3, 2)
    (_, aux), _, _ = functe.value_and_grad(lambda p, s, x: (loss(p, s, x)[0], {"head": head}), has_aux=True)(
        {"w": w}, None, x
    )
    assert aux["head"] is head
    hidden = lambda p, s, x: (loss(p, s, x)[0], {"pred": types.SimpleNamespace(y=ops.linear(x, p["w"]))})
    with pytest.raises(
        functe.ArgumentError, match=r"aux leaf 'pred' is a SimpleNamespace, which functe cannot flatten"
    ):
        functe.value_and_grad(hidden, has_aux=True)({"w": w}, None, x)
    with pytest.raises(functe.ArgumentError, match=r"has_aux=True the function must return \(loss, aux\), got f32\[\]"):
        functe.value_and_grad(lambda p, s: p["w"].sum(), has_aux=True)({"w": w}, None)


def test_a_fused_function_under_symbolic_shapes_says_it_needs_concrete_ones():
    # (the plan key holds SymInt sizes, which do not hash: the error blamed "non-tensor arguments",
    # listing none)
    from torch.fx.experimental.proxy_tensor import make_fx

    fused = functe.fuse(lambda x, w: ops.gelu(ops.linear(x, w)))
    with pytest.raises(functe.TraceError, match=r"fuse\(<lambda>\): symbolic shapes \(f32\[s\w+,s\w+\]"):
        make_fx(fused, tracing_mode="symbolic")(make((4, 8)), make((6, 8)))


def test_an_opaque_function_that_loses_a_captured_gradient_raises():
    # The opaque op differentiates its arguments only: q.grad stayed None without a word.
    q = make((4,)).requires_grad_()
    op = functe.opaque(lambda x: x * q)
    x = make((3, 4)).requires_grad_()
    with pytest.raises(
        functe.ArgumentError, match=r"uses f32\[4\] that requires grad without taking it as an argument"
    ):
        op(x).sum().backward()
    module = torch.nn.Linear(4, 2)
    with pytest.raises(functe.ArgumentError, match=r"uses Linear that requires grad"):
        functe.opaque(lambda x: module(x))(x).sum().backward()

    # the module itself, its bound forward, a partial binding the weight, a callable object holding
    # it: only plain functions were looked at, and module.weight.grad stayed None
    class Scaled:
        def __init__(self, q):
            self.q = q

        def __call__(self, x):
            return x * self.q

    for fn, what in [
        (module, "Linear"),
        (module.forward, "Linear"),
        (functools.partial(F.linear, weight=module.weight), r"f32\[2,4\]"),
        (Scaled(q), r"f32\[4\]"),
        (Scaled(q).__call__, r"f32\[4\]"),
    ]:
        with pytest.raises(functe.ArgumentError, match=rf"uses {what} that requires grad"):
            functe.opaque(fn)(x).sum().backward()
        assert module.weight.grad is None and q.grad is None
    frozen = torch.nn.Linear(4, 2).requires_grad_(False)
    assert_close(torch.autograd.grad(functe.opaque(frozen)(x).sum(), x)[0], frozen.weight.sum(0).expand(3, 4))


def test_an_opaque_function_reaching_a_gradient_through_a_container_raises():
    # Parameters usually live in a dict or a list: a trainable tensor reached through one was not
    # seen, and its gradient was lost (None under autograd, 0 under torch.func.grad and value_and_grad).
    w = make((4, 4)).requires_grad_()
    x = make((2, 4)).requires_grad_()
    params, layers = {"w": w}, [("fc", {"w": w})]

    class Holder:
        def __init__(self):
            self.params = params

        def __call__(self, h):
            return h @ self.params["w"]

    for fn in [lambda h: h @ params["w"], lambda h: h @ layers[0][1]["w"], Holder()]:
        with pytest.raises(functe.ArgumentError, match=r"uses f32\[4,4\] that requires grad"):
            functe.opaque(fn)(x).sum().backward()
    assert w.grad is None

    # a state dataclass and a namespace are containers too; a tensor passed as the argument is not
    # a capture even when a container the function reaches holds it
    @functe.pytree_dataclass
    class Params:
        w: torch.Tensor

    for holder in (Params(w), types.SimpleNamespace(w=w)):
        with pytest.raises(functe.ArgumentError, match=r"uses f32\[4,4\] that requires grad"):
            functe.opaque(lambda h, holder=holder: h @ holder.w)(x).sum().backward()
    weights = [w]
    op = functe.opaque(lambda h, v: h @ v if weights else h)
    (got,) = torch.autograd.grad(op(x.detach(), w).sum(), w)
    assert_close(got, x.detach().sum(0)[:, None].expand(4, 4))

    def loss(params, state, x):
        return functe.opaque(lambda h: h @ params["w"])(x).square().sum()

    with pytest.raises(functe.ArgumentError, match=r"which a torch.func transform differentiates"):
        functe.value_and_grad(loss)({"w": w.detach()}, None, x.detach())


def test_an_opaque_function_with_a_captured_constant_traces():
    # Shape inference ran it on meta tensors, which a captured CPU tensor cannot mix with.
    p = make((4,))
    op = functe.opaque(lambda x: x * p)
    x = make((3, 4))
    assert torch.equal(functe.fuse(lambda x: op(x))(x), x * p)


def test_a_rule_may_pass_none_for_an_absent_input():
    # m.fuse(op, [m["x"], m["w"], None]) failed in shape inference with an AttributeError.
    tl = functe.custom_vjp(
        "tanh_linear",
        lambda x, w, b: (torch.tanh(F.linear(x, w, b)), (x, w)),
        lambda r, dy: (lambda x, w: ((g := dy * (1 - torch.tanh(F.linear(x, w)) ** 2)) @ w, g.t() @ x, None))(*r),
    )
    tanh = functe.opaque(torch.tanh)
    rule = Rule(
        "tanh_linear_nobias", "joint", Pattern(tanh, Pattern(_core._linear, "x", "w", None)),
        rewrite=lambda m: m.fuse(tl, [m["x"], m["w"], None]),
    )  # fmt: skip
    check(rule, (make((3, 4)), make((5, 4))), fn=lambda x, w: tanh(ops.linear(x, w)))


# ----------------------------------------------------------------------------- a second API fuzz (states, recipes)


def test_in_place_must_be_a_bool_and_leaves_the_buffer_alone():
    extra = torch.ones(3)
    with pytest.raises(functe.ArgumentError, match=r"add_extra_input: argument 'in_place' expected a bool"):
        ops.add_extra_input(torch.ones(3), extra, in_place="False")  # truthy: it donated extra
    assert torch.equal(extra, torch.ones(3))


def test_numpy_scalars_are_taken_as_the_bools_and_numbers_they_are():
    # (a flag or eps read from a numpy array or a config is a numpy scalar, not a Python bool/float)
    np = pytest.importorskip("numpy")
    x, g, b = make((3, 8)), make((8,)), make((8,))
    expected = ops.layer_norm(x, g, b, eps=1e-3, zero_centered_gamma=True)
    got = ops.layer_norm(x, g, b, eps=np.float32(1e-3), zero_centered_gamma=np.bool_(True))
    assert torch.equal(got, expected)
    assert ops.layer_norm(x, g, b, zero_centered_gamma=np.False_).equal(ops.layer_norm(x, g, b))
    with pytest.raises(functe.ArgumentError, match=r"'zero_centered_gamma' expected a bool, got np.int64\(1\)"):
        ops.layer_norm(x, g, b, zero_centered_gamma=np.int64(1))
    with pytest.raises(functe.ArgumentError, match=r"'eps' expected .*, got np.float32\(nan\)"):
        ops.layer_norm(x, g, b, eps=np.float32("nan"))


def test_numpy_integers_are_taken_where_an_int_is_required():
    # (refused before as "expected a positive int, got np.int64(2)": sizes read from a config or an array)
    np = pytest.importorskip("numpy")
    x = make((4, 8))
    assert ops.swiglu(x, interleave=np.int64(2)).equal(ops.swiglu(x, interleave=2))
    assert ops.reshape(x, (np.int64(2), -1)).shape == (2, 16) and ops.reshape(x, np.int32(32)).shape == (32,)
    assert ops.dropout(x, 0.5, seed=np.int64(3)).equal(ops.dropout(x, 0.5, seed=3))
    assert ops.dropout(x, np.float32(0.25), seed=3).equal(ops.dropout(x, 0.25, seed=3))
    group = functe.Group("g", np.int64(2))
    assert type(group.size) is int and group == functe.Group("g", 2)
    recipe = functe.DelayedScaling(margin=np.int8(1), amax_history_len=np.int64(4))
    assert type(recipe.margin) is int and type(recipe.amax_history_len) is int  # (stored as ints: printed, hashed)
    assert recipe == functe.DelayedScaling(margin=1, amax_history_len=4)
    assert functe.init_scaling_state(np.uint8(3)).amax_history.shape == (3,)
    state = functe.init_linear_scaling_state(recipe)
    assert len(functe.share_state(state, np.int64(2), recipe=recipe)) == 2
    # (still refused: floats and bools, numpy's included)
    for bad in (np.float64(2.0), np.bool_(True), 2.0):
        with pytest.raises(functe.ArgumentError, match=r"'interleave' expected a positive int or None"):
            ops.swiglu(x, interleave=bad)
    with pytest.raises(functe.RecipeError, match=r"margin must be an int"):
        functe.DelayedScaling(margin=np.float32(1.0))


_STATE = functe.init_scaling_state(4)
_DS = functe.DelayedScaling(amax_history_len=4)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: functe.init_linear_scaling_state(functe.DelayedScaling), functe.RecipeError, r"'recipe' expected"),
        (lambda: functe.init_linear_scaling_state("delayed"), functe.RecipeError, r"'recipe' expected"),
        (lambda: functe.init_linear_scaling_state(None), functe.RecipeError, r"'recipe' expected"),
        (
            lambda: functe.init_scaling_state(True),
            functe.StateError,
            r"argument 'history_len' expected an int from 1 to 2\*\*61 - 1, got True",
        ),
        (
            lambda: functe.delayed_scaling_update(
                _STATE, torch.tensor(1.0), recipe=functe.CurrentScaling(), role="input"
            ),
            functe.StateError,
            r"delayed_scaling_update: argument 'recipe' expected a DelayedScaling",
        ),
        (
            lambda: functe.delayed_scaling_update(_STATE, torch.ones(4), recipe=_DS, role="input"),
            functe.StateError,
            r"argument 'amax' expected a float tensor of one value \(f32\[\]\), got f32\[4\]",
        ),
        (
            lambda: functe.delayed_scaling_update(_STATE, 3.0, recipe=_DS, role="input"),
            functe.StateError,
            r"argument 'amax' expected a float tensor of one value",
        ),
        (
            lambda: functe.delayed_scaling_update(
                functe.ScalingState(torch.ones((), dtype=torch.float64), torch.zeros(4)),
                torch.tensor(1.0),
                recipe=_DS,
                role="input",
            ),
            functe.StateError,
            r"argument 'state\.scale' expected float32",
        ),
        (
            lambda: functe.delayed_scaling_update(
                functe.init_scaling_state(8), torch.tensor(1.0), recipe=_DS, role="input"
            ),
            functe.StateError,
            r"'state\.amax_history' expected f32\[4\] \(the recipe's amax_history_len\), got f32\[8\]",
        ),
        (
            lambda: functe.current_scale(torch.tensor(1.0), recipe=_DS, role="input"),
            functe.StateError,
            r"current_scale: argument 'recipe' expected a CurrentScaling",
        ),
        (
            lambda: functe.current_scale(3.0, recipe=functe.CurrentScaling(), role="input"),
            functe.StateError,
            r"current_scale: argument 'amax' expected a float tensor",
        ),
        (
            lambda: functe.quantize(make((4, 8)), _DS, state=functe.init_scaling_state(4, device="meta")),
            functe.FuncteError,
            r"functe\.quantize: .*meta",
        ),
        (lambda: functe.fuse(lambda x: x, recipe="fp8"), functe.RecipeError, r"fuse: argument 'recipe' expected"),
        (lambda: functe.explain(lambda x: x, X, recipe="fp8"), functe.RecipeError, r"explain: argument 'recipe'"),
        (lambda: functe.check_oplist(3), functe.TraceError, r"check_oplist: argument 'oplist' expected an OpList"),
        (
            lambda: functe.custom_vjp("f", 1, 2),
            functe.RuleError,
            r"functe.custom_vjp: op f: fwd must be a function, got int",
        ),
    ],
)
def test_state_and_recipe_helpers_check_their_arguments(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_state_from_gradient_pairs_states_by_key_and_checks_each_gradient():
    s, new = functe.init_scaling_state(4), functe.ScalingState(torch.full((), 7.0), torch.zeros(4))
    # pairing by position gave fc1 fc2's update and left fc2's own state unchanged
    with pytest.raises(functe.StateError, match=r"gradient's structure .* does not match"):
        functe.state_from_gradient({"fc1": s, "fc2": s}, {"fc2": new, "fc9": s})
    with pytest.raises(functe.StateError, match=r"gradient at state\.fc1 expected a ScalingState, got f32\[3\]"):
        functe.state_from_gradient({"fc1": s}, {"fc1": torch.zeros(3)})
    with pytest.raises(
        functe.StateError, match=r"gradient at state\.amax_history expected f32\[4\] \(the state's\), got f32\[8\]"
    ):
        functe.state_from_gradient(s, functe.ScalingState(torch.zeros(()), torch.zeros(8)))
    with pytest.raises(
        functe.StateError, match=r"gradient at state\.scale expected f32\[\] \(the state's\), got f64\[\]"
    ):
        functe.state_from_gradient(s, functe.ScalingState(torch.zeros((), dtype=torch.float64), torch.zeros(4)))
    used = functe.ScalingState(torch.full((), 7.0), torch.tensor([1.0, 0.0, 0.0, 2.0]))
    assert functe.state_from_gradient({"fc1": s, "fc2": s}, {"fc1": used, "fc2": None})["fc1"].scale.item() == 7.0


def test_a_per_tensor_fp8_scalar_dequantizes():
    # quantize accepted a 0-d tensor and dequantize refused its own result
    for recipe in (functe.CurrentScaling(), _DS):
        state = functe.init_scaling_state(4) if recipe is _DS else None
        q, _ = functe.quantize(torch.tensor(-3.0), recipe, state=state)
        assert functe.dequantize(q).item() == -3.0


@pytest.mark.parametrize(
    "call",
    [
        lambda: functe.quantize(torch.randn(4, 32), functe.CurrentScaling(), role="bogus"),
        lambda: functe.dequantize(torch.randn(4)),
        lambda: functe.quantize(torch.randn(4, 32), functe.NVFP4BlockScaling(), role="grad_output"),
        lambda: functe.set_backend("triton"),
        lambda: ops.fp8_linear(
            torch.randn(4, 32),
            torch.randn(16, 32),
            None,
            None,
            recipe=functe.Float8BlockScaling(),
            tensor_parallel_mode="column",
            group=functe.Group("fake", 2),
        ),
    ],
)
def test_argument_errors_are_the_builtin_errors_callers_catch(call):
    # (these raised a bare FuncteError, neither ValueError nor TypeError, against the errors' contract)
    with pytest.raises(functe.ArgumentError) as info:
        call()
    assert isinstance(info.value, ValueError) and isinstance(info.value, TypeError)


def test_quantize_under_a_differentiating_transform_is_refused():
    # (torch.func.grad came out all zeros and jvp's tangent zero, silently; plain autograd leaves a
    # result that does not require grad, and a detached x opts out)
    x = torch.randn(4, 32)
    roundtrip = lambda t: functe.dequantize(functe.quantize(t, functe.CurrentScaling())[0])
    refused = r"functe\.quantize: argument 'x' \(f32\[4,32\]\) is differentiated by a torch\.func transform"
    with pytest.raises(functe.TransformError, match=refused):
        torch.func.grad(lambda t: roundtrip(t).sum())(x)
    with pytest.raises(functe.TransformError, match=refused):
        torch.func.jvp(roundtrip, (x,), (torch.ones_like(x),))
    grad = torch.func.grad(lambda t: roundtrip(t.detach()).sum() + t.sum())(x)
    assert torch.equal(grad, torch.ones_like(x))
    assert torch.equal(torch.func.vmap(roundtrip)(x), torch.stack([roundtrip(row) for row in x]))  # (vmap: fine)
    with pytest.raises(functe.TransformError, match=refused):
        torch.func.vmap(torch.func.grad(lambda t: roundtrip(t).sum()))(x[None])
    # A trainable tensor that no transform differentiates (a module's weight, quantized to inspect it)
    # is autograd's: allowed under vmap and under a grad or jvp over another argument.
    weight = x.clone().requires_grad_()
    y = torch.ones(3)
    expected = roundtrip(weight.detach()).sum().expand(3)
    assert torch.equal(torch.func.grad(lambda y: roundtrip(weight).sum() * y.sum())(y), expected)
    torch.func.vmap(lambda y: roundtrip(weight).sum() * y)(y)
    torch.func.jvp(lambda y: roundtrip(weight).sum() * y, (y,), (y,))


def test_scale_functions_name_a_bad_role():
    # (the error blamed functe.Format, naming neither the function nor the argument)
    state = functe.init_scaling_state(2)
    with pytest.raises(functe.StateError, match=r"functe\.delayed_scaling_update: argument 'role' expected one of"):
        functe.delayed_scaling_update(state, torch.tensor(1.0), recipe=functe.DelayedScaling(), role="grad")
    with pytest.raises(functe.StateError, match=r"functe\.current_scale: argument 'role' expected one of"):
        functe.current_scale(torch.tensor(1.0), recipe=functe.CurrentScaling(), role="grad")
    assert functe.current_scale(torch.tensor([3.0]), recipe=functe.CurrentScaling(), role="input").shape == ()


def _kernel_level_misuse():
    from functe.kernels import activation as act
    from functe.kernels import norm
    from functe.kernels.block_quantize import FP8_BLOCK_DEQUANTIZE
    from functe.kernels.dropout import DROPOUT
    from functe.kernels.elementwise import ADD_BIAS, AXPBY
    from functe.kernels.hadamard import RHT16
    from functe.kernels.norm_block_quantize import NORM_FP8_BLOCK_CAST
    from functe.kernels.norm_quantize import NORM_CAST_AMAX
    from functe.kernels.nvfp4 import NVFP4_CAST, NVFP4_DEQUANTIZE
    from functe.kernels.quantize import DACT_DBIAS

    e4 = torch.float8_e4m3fn

    x, clamp = torch.ones(3, 8), (7.0, 1.702, 1.0)
    return [
        (lambda: norm.LAYER_NORM(x, torch.ones(4), torch.zeros(8), 1e-5, False), r"'weight' expected f32\[8\]"),
        (lambda: norm.RMS_NORM_BWD(torch.ones(3, 7), x, torch.ones(8), 1e-5, False), r"'dy' expected f32\[3,8\]"),
        (lambda: ADD_BIAS(torch.zeros(3, 5), torch.ones(3)), r"'b' expected f32\[5\], got f32\[3\]"),
        (lambda: act.ACTIVATION_SCALED(x, torch.ones(2), "relu", 0, *clamp), r"'s' expected f32\[3\], got f32\[2\]"),
        (lambda: act.ACTIVATION(x, "swiglu", 3, *clamp), r"H divisible by interleave=3"),
        (lambda: act.ACTIVATION(torch.ones(3, 5), "swiglu", 0, *clamp), r"got f32\[3,5\] \(gated 'swiglu'"),
        (lambda: DROPOUT(torch.ones(3, 5), torch.tensor([1, 2, 3, 4]), 0.5), r"'seed' expected .*got i64\[4\]"),
        (lambda: RHT16(torch.ones(2, 24), torch.tensor(1), False, torch.float32), r"'x' expected f32\[\.\.\.,16k\]"),
        (
            lambda: NVFP4_CAST(
                torch.ones(3, 5), torch.tensor(6.0), torch.tensor(7), "", 0.0, 0.0, 0.0, 1, False, torch.uint8
            ),
            r"even number of values to pack \(got 5\)",
        ),
        (lambda: AXPBY(torch.ones(3, 4), torch.ones(4), 1.0, 1.0), r"'e' expected f32\[3,4\], got f32\[4\]"),
        (lambda: DACT_DBIAS(torch.ones(1, 8), x, "gelu"), r"'dy' expected f32\[3,8\], got f32\[1,8\]"),
        (
            lambda: NORM_CAST_AMAX(
                x, torch.ones(2), torch.zeros(8), torch.ones(()), 1e-5, "layer", False, e4, e4, True
            ),
            r"'weight' expected f32\[8\], got f32\[2\]",
        ),
        (
            lambda: NORM_FP8_BLOCK_CAST(x, torch.ones(8), torch.zeros(2), 1e-5, "layer", False, e4, e4, False, 0.0),
            r"'bias' expected f32\[8\], got f32\[2\]",
        ),
        (
            lambda: FP8_BLOCK_DEQUANTIZE(torch.ones(4, 256).to(e4), torch.ones(4, 1), 1, torch.float32),
            r"'scale_inv' expected f32\[4,2\], got f32\[4,1\] \(1x128 blocks",
        ),
        (
            lambda: NVFP4_DEQUANTIZE(
                torch.ones(4, 128, dtype=torch.uint8), torch.ones(4, 4).to(e4), torch.ones(()), 1, torch.float32
            ),
            r"'scales' expected f8e4m3\[4,16\], got f8e4m3\[4,4\]",
        ),
    ]


@pytest.mark.parametrize("on", ["launcher", "twin"])
def test_kernel_level_dequantize_refuses_scales_of_other_blocks_on_both_paths(on):
    # the twins broadcast one row of scales over every row (silently), the launchers read past them
    from functe.kernels.block_quantize import FP8_BLOCK_DEQUANTIZE

    kernel = FP8_BLOCK_DEQUANTIZE.launcher if on == "launcher" else FP8_BLOCK_DEQUANTIZE.twin
    with (
        functe.use_backend("interpret"),
        pytest.raises(functe.ShapeError, match=r"expected f32\[4,2\], got f32\[1,2\]"),
    ):
        kernel(torch.ones(4, 256).to(torch.float8_e4m3fn), torch.ones(1, 2), 1, torch.float32)


def test_kernel_level_negative_interleave_is_refused():
    from functe.kernels import activation as act

    with functe.use_backend("interpret"), pytest.raises(ValueError, match=r"'interleave' expected an int >= 0, got -1"):
        act.ACTIVATION(torch.ones(1, 8), "reglu", -1, 7.0, 1.702, 1.0)


def test_norm_cast_statistics_of_rows_of_nothing_are_the_twins():
    # N = 0: no program runs, and the fused norm + cast launchers returned unwritten statistics
    from functe.kernels.norm_block_quantize import NORM_FP8_BLOCK_CAST, NORM_NVFP4_CAST
    from functe.kernels.norm_quantize import NORM_CAST_AMAX

    x, w, e4 = torch.empty(4, 0), torch.ones(0), torch.float8_e4m3fn
    calls = [
        lambda k: k(x, w, w, torch.ones(()), 1e-5, "layer", False, e4, e4, True)[1:3],
        lambda k: k(x, w, w, 1e-5, "layer", False, e4, e4, False, 0.0)[3:5],
        lambda k: k(x, w, w, torch.tensor(1.0), 1e-5, "layer", False, torch.bfloat16)[3:5],
    ]
    for kernel, call in zip((NORM_CAST_AMAX, NORM_FP8_BLOCK_CAST, NORM_NVFP4_CAST), calls):
        with functe.use_backend("interpret"):
            mean, rstd = call(kernel.launcher)
        twin_mean, twin_rstd = call(kernel.twin)
        assert torch.equal(mean, twin_mean) and mean.eq(0).all() and rstd.isnan().all() and twin_rstd.isnan().all()


@pytest.mark.parametrize("case", range(15))
def test_kernel_level_calls_with_shapes_the_kernels_would_read_past_are_refused(case):
    # The ops check their arguments; the Kernel objects (a documented kernel-level API, what fusion
    # rules call) did not: their launchers read past a short weight, bias or scale, left part of a
    # dropout unwritten, mixed rows of an RHT or packed NVFP4 codes, silently.
    call, message = _kernel_level_misuse()[case]
    with functe.use_backend("interpret"), pytest.raises(functe.ShapeError, match=message):
        call()


@pytest.mark.parametrize("on", ["launcher", "twin"])
def test_kernel_level_random_kernels_refuse_a_32_bit_seed(on):
    # the kernels read 64-bit seeds: an int32 one crashed the interpreter (the ops pass int64)
    from functe.kernels.dropout import DROPOUT
    from functe.kernels.hadamard import RHT16

    seed = torch.tensor(1, dtype=torch.int32)
    calls = [(DROPOUT, (torch.ones(3, 5), seed, 0.5)), (RHT16, (torch.ones(2, 16), seed, False, torch.float32))]
    for kernel, args in calls:
        with functe.use_backend("interpret"), pytest.raises(functe.DTypeError, match=r"'seed' expected an i64 tensor"):
            getattr(kernel, on)(*args)


_LOSS = r"functe\.value_and_grad: fn's loss expected a 0-d floating-point tensor, "


@pytest.mark.parametrize(
    "result, has_aux, message",
    [
        (lambda y: y.sum().long(), False, _LOSS + r"got i64\[\]: an integer or boolean loss has no gradient"),
        (lambda y: y, False, _LOSS + r"got f32\[4,2\]: reduce it to one number"),
        (lambda y: (y.sum(), 1), False, _LOSS + r"got tuple: a \(loss, aux\) pair needs has_aux=True"),
        (lambda y: 3.0, False, _LOSS + r"got float$"),
        (lambda y: (y, None), True, r"fn's loss \(the first item of its result\) expected .* got f32\[4,2\]"),
    ],
)
def test_value_and_grad_refuses_a_loss_that_is_not_a_floating_point_number(result, has_aux, message):
    # (an integer loss gave all-zero gradients silently; the others raised torch.func's message
    # about grad_and_value(f), a function the caller never called)
    x, w = make((4, 3)), make((2, 3))
    with pytest.raises(functe.ArgumentError, match=message):
        functe.value_and_grad(lambda p, s, x: result(ops.linear(x, p["w"])), has_aux=has_aux)({"w": w}, None, x)


# ----------------------------------------------------------------------------- a fifth sweep: raw errors


def test_pytree_helpers_check_their_arguments():
    # (AttributeError: 'int' object has no attribute '__module__', and the like; a raw TypeError)
    for bad, got in ((3, "int"), (lambda: 0, "function")):
        with pytest.raises(
            functe.ArgumentError, match=rf"^functe\.pytree_dataclass: argument 'cls' expected a class, got {got}$"
        ):
            functe.pytree_dataclass(bad)
    with pytest.raises(
        functe.ArgumentError, match=r"^functe\.tree_unflatten: argument 'spec' expected a PyTreeSpec, got str$"
    ):
        functe.tree_unflatten("spec", [X])
    with pytest.raises(functe.ArgumentError, match=r"^functe\.tree_map: argument 'fn' expected a function, got int$"):
        functe.tree_map(3, {"a": X})
    spec = functe.tree_structure({"a": 1, "b": (2, None)})
    assert functe.tree_unflatten(spec, [1, 2, None]) == {"a": 1, "b": (2, None)}
    # (optree's "Too few leaves for PyTreeSpec" named neither function nor argument)
    for leaves in ([1, 2], [1, 2, None, 4]):
        with pytest.raises(
            functe.ArgumentError,
            match=rf"^functe\.tree_unflatten: argument 'leaves' expected 3 leaves \(the spec's\), got {len(leaves)}$",
        ):
            functe.tree_unflatten(spec, leaves)


def test_state_initialisers_check_device_and_history_length():
    # (torch's "Invalid device string" and a raw overflow from torch.zeros, naming neither function)
    device = r"argument 'device' expected a torch\.device or a device string \('cpu', 'cuda:0'\), got 'gpu0'$"
    with pytest.raises(functe.DeviceError, match=rf"^functe\.init_scaling_state: {device}"):
        functe.init_scaling_state(4, device="gpu0")
    for recipe in (functe.DelayedScaling(), functe.CurrentScaling()):
        with pytest.raises(functe.DeviceError, match=rf"^functe\.init_linear_scaling_state: {device}"):
            functe.init_linear_scaling_state(recipe, device="gpu0")
    for bad, got in ((1.5, r"1\.5"), (True, "True"), (-1, "-1")):  # (a bool or -1 is no accelerator index)
        with pytest.raises(functe.DeviceError, match=rf"'device' expected a torch\.device .*, got {got}$"):
            functe.init_scaling_state(4, device=bad)
    too_long = r"^functe\.init_scaling_state: argument 'history_len' expected an int from 1 to 2\*\*61 - 1, got "
    for bad in (10**20, 2**61):
        with pytest.raises(functe.StateError, match=too_long + str(bad)):
            functe.init_scaling_state(bad)
    assert functe.init_scaling_state(2**40, device="meta").amax_history.shape == (2**40,)
    for device in ("cpu", "cpu:0", torch.device("cpu"), None):
        assert functe.init_scaling_state(2, device=device).scale.device.type == "cpu"


def test_rewrite_takes_a_positive_int_max_rewrites():
    # (max_rewrites="3" failed on '>' between int and str; 0 reported "no fixed point after 0 rewrites")
    program = functe.trace(lambda x, w, r: ops.linear(x, w) + r)(make((4, 8)), make((16, 8)), make((4, 16)))
    for bad, got in (("3", "'3'"), (None, "None"), (0, "0"), (2.0, "2.0"), (True, "True")):
        with pytest.raises(
            functe.ArgumentError,
            match=rf"^functe\.rules\.rewrite: argument 'max_rewrites' expected a positive int, got {got}$",
        ):
            functe.rules.rewrite(program, functe.rules.DEFAULT_RULES, "forward", max_rewrites=bad)
    _, stats = functe.rules.rewrite(program, functe.rules.DEFAULT_RULES, "forward", max_rewrites=1)
    assert stats.fired == {"forward_linear_bias_add": 1}


def test_save_and_load_tree_refuse_a_directory(tmp_path):
    # (torch: "[enforce fail at inline_container.cc:747] ... Is a directory"; safetensors: "No such device")
    (tmp_path / "d.safetensors").mkdir()
    for path in (tmp_path, str(tmp_path / "d.safetensors")):
        shown = re.escape(str(path))
        for op, call in (("save_tree", functe.save_tree), ("load_tree", functe.load_tree)):
            with pytest.raises(
                functe.ArgumentError,
                match=rf"^functe\.{op}: argument 'path' expected a file path, got the directory '{shown}'$",
            ):
                call(path, {"a": X})
    functe.save_tree(tmp_path / "t.pt", {"a": X})
    assert torch.equal(functe.load_tree(tmp_path / "t.pt", {"a": X})["a"], X)


def test_save_tree_refuses_a_path_in_a_missing_directory(tmp_path):
    # (safetensors: "I/O error: No such file or directory (os error 2) at path .../.tmpXYZ", a name the
    # caller never gave; torch.save: "Parent directory ... does not exist", naming no function)
    for name in ("t.pt", "t.safetensors"):
        path = tmp_path / "missing" / name
        shown = re.escape(str(path))
        with pytest.raises(
            functe.ArgumentError,
            match=rf"^functe\.save_tree: argument 'path' expected a file in an existing directory, got '{shown}' ",
        ):
            functe.save_tree(path, {"a": X})
        assert not (tmp_path / "missing").exists()


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage:UserWarning")
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state:UserWarning")
def test_sparse_and_nested_tensors_are_refused_by_name():
    # Sparse tensors reached the ops: layer_norm raised "unsupported memory format option Contiguous", gelu
    # and quantize NotImplementedError for SparseCPU; a jagged tensor ran some forwards, whose backward
    # then failed inside torch.
    x = make((4, 16))
    sparse = x.to_sparse()
    dense = r"expected a dense tensor, got a "
    with pytest.raises(functe.ArgumentError, match=rf"^functe\.gelu: argument 'x' {dense}sparse_coo f32\[4,16\]$"):
        ops.gelu(sparse)
    with pytest.raises(functe.ArgumentError, match=rf"^functe\.layer_norm: argument 'x' {dense}sparse_coo"):
        ops.layer_norm(sparse, torch.ones(16), torch.zeros(16))
    with pytest.raises(
        functe.ArgumentError, match=rf"^functe\.linear: argument 'weight' {dense}sparse_csr f32\[8,16\]$"
    ):
        ops.linear(x, make((8, 16)).to_sparse_csr())
    with pytest.raises(functe.ArgumentError, match=rf"^functe\.quantize: argument 'x' {dense}sparse_coo f32\[4,16\]$"):
        functe.quantize(sparse, functe.CurrentScaling())
    rows = [make((2, 16)), make((3, 16))]
    jagged = torch.nested.nested_tensor(rows, layout=torch.jagged)
    with pytest.raises(
        functe.ArgumentError, match=rf"^functe\.layer_norm: argument 'x' {dense}nested f32\[2,j\d+,16\]$"
    ):
        ops.layer_norm(jagged, torch.ones(16), torch.zeros(16))
    with pytest.raises(functe.ArgumentError, match=rf"^functe\.gelu: argument 'x' {dense}nested f32\[\.\.\.\]$"):
        ops.gelu(torch.nested.nested_tensor(rows))
    assert_close(ops.gelu(x), F.gelu(x, approximate="tanh"))


def test_collectives_name_a_dim_that_is_not_an_int():
    # (reported as "argument 'x' expected a tensor with a dimension '0'")
    for op in (ops.all_gather, ops.reduce_scatter):
        for bad, got in (("0", "'0'"), (None, "None"), (True, "True"), (0.0, "0.0")):
            with pytest.raises(
                functe.ArgumentError, match=rf"^functe\.{op.__name__}: argument 'dim' expected an int, got {got}$"
            ):
                op(X, dim=bad)
        with pytest.raises(
            functe.ShapeError, match=rf"^functe\.{op.__name__}: argument 'x' expected a tensor with a dimension 2"
        ):
            op(X, dim=2)
        assert torch.equal(op(X, dim=-1), X)  # (one rank: the identity, as a view)


def test_data_parallel_value_and_grad_names_itself():
    # (its errors named functe.value_and_grad, and a bad group functe.all_reduce_gradients)
    who = r"^functe\.data_parallel_value_and_grad: "
    with pytest.raises(functe.ArgumentError, match=who + r"argument 'fn' expected a function, got int$"):
        functe.data_parallel_value_and_grad(3)
    with pytest.raises(functe.ArgumentError, match=who + r"argument 'has_aux' expected a bool, got 'no'$"):
        functe.data_parallel_value_and_grad(lambda p, s: p.sum(), has_aux="no")
    with pytest.raises(functe.ArgumentError, match=who + r"argument 'check' expected a bool, got 'no'$"):
        functe.data_parallel_value_and_grad(lambda p, s: p.sum(), check="no")
    with pytest.raises(functe.ArgumentError, match=who + r"with has_aux=True the function must return \(loss, aux\)"):
        functe.data_parallel_value_and_grad(lambda p, s: p.sum(), has_aux=True)(X, None)
    with pytest.raises(
        functe.ArgumentError, match=who + r"argument 'group' expected a torch\.distributed\.ProcessGroup"
    ):
        functe.data_parallel_value_and_grad(lambda p, s: p.sum(), group="dp")(X, None)
    with pytest.raises(functe.ArgumentError, match=r"^functe\.value_and_grad: with has_aux=True"):
        functe.value_and_grad(lambda p, s: p.sum(), has_aux=True)(X, None)
    loss, grad, _ = functe.data_parallel_value_and_grad(lambda p, s: p.sum())(X, None)
    assert loss.item() == X.sum().item() and torch.equal(grad, torch.ones_like(X))


def test_recipe_methods_name_themselves_for_a_bad_role():
    # (every one reported "functe.Format: unknown tensor role")
    expected = r"argument 'role' expected one of \('input', 'weight', 'grad_output'\), got 'x'$"
    calls = {
        "DelayedScaling.dtype": lambda: functe.DelayedScaling().dtype("x"),
        "CurrentScaling.max": lambda: functe.CurrentScaling().max("x"),
        "NVFP4BlockScaling.dtype": lambda: functe.NVFP4BlockScaling().dtype("x"),
        "NVFP4BlockScaling.max": lambda: functe.NVFP4BlockScaling().max("x"),
        "NVFP4BlockScaling.block_shape": lambda: functe.NVFP4BlockScaling().block_shape("x"),
        "Format.dtype": lambda: functe.Format.HYBRID.dtype("x"),
    }
    for method, call in calls.items():
        with pytest.raises(functe.RecipeError, match=rf"^functe\.{method}: {expected}"):
            call()
    assert functe.DelayedScaling(fp8_format=functe.Format.HYBRID).max("grad_output") == 57344.0
    assert functe.Float8BlockScaling().block_shape("weight") == (128, 128)


def test_flags_that_read_any_truthy_value_are_refused():
    # (check="no" was taken as True; symbolic_zeros="no" passed None cotangents to a rule expecting zeros,
    # needs_input_grad="no" an unexpected keyword to the backward rule)
    state = functe.init_scaling_state(2)
    with pytest.raises(
        functe.ArgumentError, match=r"^functe\.state_from_gradient: argument 'check' expected a bool, got 'no'$"
    ):
        functe.state_from_gradient({"a": state}, {"a": None}, check="no")
    rules = (lambda x: (x * 2, None), lambda r, g: (2 * g,))
    for flag in ("symbolic_zeros", "needs_input_grad", "keep_autocast"):
        with pytest.raises(
            functe.ArgumentError, match=rf"^functe\.custom_vjp: argument '{flag}' expected a bool, got 'no'$"
        ):
            functe.custom_vjp("twice", *rules, **{flag: "no"})
    np = pytest.importorskip("numpy")
    twice = functe.custom_vjp("twice", *rules, symbolic_zeros=np.bool_(True))
    assert twice.symbolic_zeros is True and torch.equal(
        torch.func.grad(lambda x: twice(x).sum())(X), torch.full_like(X, 2.0)
    )
