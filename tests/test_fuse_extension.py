"""Extending the fuser from outside (the spirit of TransformerEngine's TestCustomOps).

A user defines a basic op with custom_vjp, then fused ops and rules for a forward, a backward and a
joint fusion, passes ``DEFAULT_RULES + my_rules`` to ``functe.fuse``, and checks each rule with
``functe.rules.check``. Nothing is registered globally.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fuse_helpers import F64, assert_matches_float64
from helpers import check_transforms, make, saved_storages

import functe
from functe import ops
from functe.ops import _activation, _core
from functe.rules import DEFAULT_RULES, Pattern, Rule, RuleSet, check
from functe.testing import assert_close

# ----------------------------------------------------------------------------- a user basic op: a learnable scale


def _scale_by_fwd(x, s):
    return x * s, (x, s)


def _scale_by_bwd(res, dy):
    x, s = res
    return dy * s, (dy * x).sum()


scale_by = functe.custom_vjp("scale_by", _scale_by_fwd, _scale_by_bwd)  # y = s·x for a 0-d tensor s


def test_user_basic_op_is_traced_fused_and_differentiated():
    def fn(x, s, w):
        return ops.linear(scale_by(x, s), w)

    args = [make((3, 4), F64), make((), F64), make((5, 4), F64)]
    assert str(functe.trace(fn)(*args)).splitlines()[1] == "    d:f64[3,4] = scale_by a b"
    fused = functe.fuse(fn)
    ref = lambda x, s, w: F.linear(x * s, w)
    assert_matches_float64(fused, ref, args)
    check_transforms(fused, ref, args, higher_order=False)


# ----------------------------------------------------------------------------- a forward fusion: r + s·x in one pass


def _axpy_fwd(s, x, r):
    # r + s·x in one pass; the residuals are exactly what scale_by's and add_extra_input's forwards return
    return torch.addcmul(r, x, s), ((x, s), None)


def _axpy_bwd(res, dy):
    (x, s), _ = res
    dx, ds = _scale_by_bwd((x, s), dy)
    return ds, dx, dy


axpy = functe.custom_vjp("axpy", _axpy_fwd, _axpy_bwd)

# add_extra_input(scale_by(x, s), r) -> axpy(s, x, r)
AXPY = Rule(
    "axpy",
    "forward",
    Pattern(_core._add_extra_input, Pattern(scale_by, "x", "s"), "r", commutative=True),
    lambda m: m.fuse(axpy, [m["s"], m["x"], m["r"]]),
    doc="scale_by + residual add in one pass",
)


# ----------------------------------------------------------------------------- a backward fusion: scale_by -> linear


def _scaled_linear_fwd(x, s, w):
    y, x_s = scale_by.fwd(x, s)
    out, lin = _core._linear_fwd(y, w, None)
    return out, (x_s, lin)


def _scaled_linear_bwd(res, dy):
    # one dgrad GEMM serves both dx and ds: g = dy·W, dx = s·g, ds = Σ g·x
    (x, s), (y, w, _) = res
    g = torch.matmul(dy, w)
    dw = torch.matmul(dy.reshape(-1, dy.shape[-1]).t(), y.reshape(-1, y.shape[-1]))
    return g * s, (g * x).sum(), dw


scaled_linear = functe.custom_vjp("scaled_linear", _scaled_linear_fwd, _scaled_linear_bwd)

# linear(scale_by(x, s), w, None) -> scaled_linear(x, s, w)
SCALED_LINEAR = Rule(
    "scaled_linear",
    "backward",
    Pattern(_core._linear, Pattern(scale_by, "x", "s"), "w", None),
    lambda m: m.fuse(scaled_linear, [m["x"], m["s"], m["w"]]),
)


# ----------------------------------------------------------------------------- a joint fusion: linear -> silu


silu = functe.opaque(F.silu)


def _linear_silu_fwd(x, w, b):
    return F.silu(F.linear(x, w, b)), (x, w, b)  # its own residuals: no activation is kept


def _linear_silu_bwd(res, dy):
    x, w, b = res
    h = F.linear(x, w, b)  # recomputed in the backward
    sig = torch.sigmoid(h)
    dh = dy * sig * (1 + h * (1 - sig))
    dx = torch.matmul(dh, w)
    dw = torch.matmul(dh.reshape(-1, dh.shape[-1]).t(), x.reshape(-1, x.shape[-1]))
    return dx, dw, None if b is None else dh.reshape(-1, dh.shape[-1]).sum(0)


linear_silu = functe.custom_vjp("linear_silu", _linear_silu_fwd, _linear_silu_bwd)

# silu(linear(x, w, b)) -> linear_silu(x, w, b) in both passes
LINEAR_SILU = Rule(
    "linear_silu",
    "joint",
    Pattern(silu, Pattern(_core._linear, "x", "w", "b")),
    lambda m: m.fuse(linear_silu, [m["x"], m["w"], m["b"]]),
)

MY_RULES = RuleSet([AXPY, SCALED_LINEAR, LINEAR_SILU])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, F64])
def test_check_each_user_rule(dtype):
    x, s, r, w, b = (torch.empty(shape, dtype=dtype) for shape in [(3, 4), (), (3, 4), (5, 4), (5,)])
    check(AXPY, {"x": x, "s": s, "r": r})
    check(SCALED_LINEAR, {"x": x, "s": s, "w": w})
    check(LINEAR_SILU, {"x": x, "w": w, "b": b})
    check(LINEAR_SILU, (x, w), fn=lambda x, w: silu(ops.linear(x, w)))


def _model(x, s, w1, b1, w2):
    h = silu(ops.linear(x, w1, b1))  # joint: linear_silu
    h = scale_by(h, s) + h  # forward: axpy
    return ops.linear(scale_by(h, s), w2) + h  # backward: scaled_linear; forward: the default linear + add


def test_default_and_user_rules_together():
    args = [make((3, 4), F64), make((), F64), make((4, 4), F64), make((4,), F64), make((4, 4), F64)]
    fused = functe.fuse(_model, rules=DEFAULT_RULES + MY_RULES)
    plan = fused.plan(*args)
    assert plan.stats["joint"].fired == {"linear_silu": 1}
    assert plan.stats["forward"].fired == {"forward_linear_bias_add": 1, "axpy": 1}
    assert plan.stats["backward"].fired == {"scaled_linear": 1}
    assert "linear_silu a c d" in str(plan.forward) and "linear_silu a c d" in str(plan.backward)
    assert plan.liveness.residuals[0].name == "linear_silu"  # the joint op keeps its own residuals
    assert_matches_float64(fused, _model, args)
    check_transforms(fused, _model, args, higher_order=False)
    # nothing leaked into the defaults: a plain fuse does not know the user's rules
    plain = functe.fuse(_model).plan(*args)
    assert plain.stats["joint"].fired == {} and len(DEFAULT_RULES) == 16


def test_check_catches_a_wrong_forward_fusion():
    wrong = functe.custom_vjp("axpy_wrong", lambda s, x, r: (torch.addcmul(r, x, 2 * s), ((x, s), None)), _axpy_bwd)
    rule = Rule("axpy_wrong", "forward", AXPY.pattern, lambda m: m.fuse(wrong, [m["s"], m["x"], m["r"]]))
    with pytest.raises(AssertionError, match=r"rule axpy_wrong, output 0"):
        check(rule, {"x": torch.empty(3, 4), "s": torch.empty(()), "r": torch.empty(3, 4)})


def test_check_catches_a_wrong_backward_fusion():
    def bad_bwd(res, dy):
        dx, ds, dw = _scaled_linear_bwd(res, dy)
        return dx, ds * 0, dw  # forgets the gradient of the scale

    bad = functe.custom_vjp("scaled_linear_bad", _scaled_linear_fwd, bad_bwd)
    rule = Rule("bad", "backward", SCALED_LINEAR.pattern, lambda m: m.fuse(bad, [m["x"], m["s"], m["w"]]))
    with pytest.raises(AssertionError, match=r"rule bad, gradient of \['s'\] \(fused vs unfused float64\)"):
        check(rule, {"x": torch.empty(3, 4), "s": torch.empty(()), "w": torch.empty(5, 4)})


def _fp8_rule_cases():
    from functe.rules import quantize as q

    current, delayed, block = (
        functe.CurrentScaling(),
        functe.DelayedScaling(amax_history_len=4),
        functe.Float8BlockScaling(),
    )
    x, g, w, b = torch.empty(4, 16), torch.empty(16), torch.empty(32, 16), torch.empty(32)
    xb, gb, wb = torch.empty(4, 128), torch.empty(128), torch.empty(128, 128)
    state = functe.init_linear_scaling_state(delayed)
    return [
        (
            q.FORWARD_NORM_QUANTIZE,
            (x, g, w, b),
            lambda x, g, w, b: ops.fp8_linear(ops.rms_norm(x, g), w, b, None, recipe=current),
        ),
        (
            q.FORWARD_ACTIVATION_QUANTIZE,
            (x, w, state),
            lambda x, w, s: ops.fp8_linear(ops.gelu(x), w, None, s, recipe=delayed),
        ),
        (
            q.BACKWARD_FP8_LINEAR_ACTIVATION,
            (x, w, b),
            lambda x, w, b: ops.gelu(ops.fp8_linear(x, w, b, None, recipe=current)),
        ),
        (
            q.FORWARD_NORM_BLOCK_QUANTIZE,
            (xb, gb, wb),
            lambda x, g, w: ops.fp8_linear(ops.layer_norm(x, g, g), w, None, None, recipe=block),
        ),
        (
            q.FORWARD_ACTIVATION_BLOCK_QUANTIZE,
            (xb, wb),
            lambda x, w: ops.fp8_linear(ops.silu(x), w, None, None, recipe=block),
        ),
    ]


@pytest.mark.parametrize("case", range(5))
def test_check_runs_functes_own_fp8_rules(case):
    # (their float64 reference ran fp8_linear on float64 inputs: "expected dtype f32|f16|bf16, got f64")
    rule, args, fn = _fp8_rule_cases()[case]
    check(rule, args, fn=fn)


def test_check_catches_a_wrong_fp8_fusion():
    from functe.rules.quantize import FORWARD_ACTIVATION_QUANTIZE as right

    def swap_activation(m):  # the fused op applies relu where the program has gelu
        eqn = right.rewrite(m)
        eqn.params = {**eqn.params, "name": "relu"}
        return eqn

    rule = Rule("wrong_activation_quantize", "forward", right.pattern, swap_activation, condition=right.condition)
    recipe = functe.CurrentScaling()
    with pytest.raises(AssertionError, match=r"rule wrong_activation_quantize, output 0 \(fused vs unfused, quantized"):
        check(
            rule,
            (torch.empty(4, 16), torch.empty(8, 16)),
            fn=lambda x, w: ops.fp8_linear(ops.gelu(x), w, None, None, recipe=recipe),
        )


def test_check_reports_a_rule_that_does_not_fire():
    with pytest.raises(AssertionError, match=r"rule axpy did not fire: .*no add_extra_input equation in the program "):
        check(AXPY, (torch.empty(3),), fn=lambda x: x * 2.0)


def test_check_gives_both_orders_of_a_commutative_pattern_that_misses():
    # (the first order's reason alone was reported: "input 0 ... not made by an equation" for a program
    # written r + linear(...), whose real miss is the bias)
    pattern = Pattern(_core._add_extra_input, Pattern(_core._linear, "x", "w", None), "r", commutative=True)
    rule = Rule("linear_add_nobias", "forward", pattern, lambda m: None)
    with pytest.raises(AssertionError) as info:
        check(rule, (torch.empty(4, 3), torch.empty(5, 3), torch.empty(5), torch.empty(4, 5)),
              fn=lambda x, w, b, r: r + ops.linear(x, w, b))  # fmt: skip
    message = str(info.value)
    assert "with its first two inputs swapped, input 2 of linear is f32[5], the pattern wants None" in message, message


def test_a_rewrite_that_forgets_a_static_parameter_is_named():
    # (the error blamed data dependence and named no rule)
    def axpby_fwd(s, x, r, *, beta):
        return torch.addcmul(r * beta, x, s), ((x, s), None)

    axpby = functe.custom_vjp("axpby", axpby_fwd, lambda res, dy, *, beta: _axpy_bwd(res, dy))
    forgetful = Rule("forgetful_axpby", "forward", AXPY.pattern, lambda m: m.fuse(axpby, [m["s"], m["x"], m["r"]]))
    message = (
        r"rule forgetful_axpby: its rewrite made a axpby call \(static parameters: none\) that cannot run: .*"
        r"does the call pass its static parameters\? \(TypeError: .*missing 1 required keyword-only argument: 'beta'"
    )
    with pytest.raises(functe.TraceError, match=message):
        check(forgetful, (torch.empty(3), torch.empty(()), torch.empty(3)), fn=lambda x, s, r: scale_by(x, s) + r)


@pytest.mark.parametrize(
    ("nested", "fn", "why"),
    [
        # a newcomer's linear without its bias slot: linear has 3 inputs (x, w, bias)
        (
            Pattern(_core._linear, "x", "w"),
            lambda x, w, b: ops.gelu(ops.linear(x, w, b)),
            r"the pattern gives linear 2 inputs, the equation has 3 \(f32\[4,3\], f32\[5,3\], f32\[5\]\)",
        ),
        (
            Pattern(_core._linear, "x", "w", None),
            lambda x, w, b: ops.gelu(ops.linear(x, w, b)),
            r"input 2 of linear is f32\[5\], the pattern wants None",
        ),
        (
            Pattern(_core._linear, "x", "w", "b"),
            lambda x, w, b: ops.gelu(ops.bias(ops.linear(x, w), b)),
            r"input 0 of activation is made by bias, the pattern wants linear",
        ),
    ],
)
def test_check_says_where_a_pattern_misses_the_program(nested, fn, why):
    # (the rule silently never fired: check said only "did not fire", explain nothing)
    rule = Rule("my_gelu_linear", "forward", Pattern(_activation._activation, nested, None), lambda m: None)
    with pytest.raises(
        AssertionError,
        match=r"rule my_gelu_linear did not fire: its pattern does not match \(activation -> f32\[4,5\]: " + why,
    ):
        check(rule, (torch.empty(4, 3), torch.empty(5, 3), torch.empty(5)), fn=fn)


# ----------------------------------------------------------------------- a backward fusion that skips unwanted work


def _lean_scaled_linear_bwd(res, dy, *, needs_input_grad, couple=False):
    # Only the wanted gradients, from the residuals _lean_prune kept. ``couple`` is a planted bug:
    # ds computed only when dx is wanted too.
    want_x, want_s, want_w = needs_input_grad
    (x, s), (y, w, _) = res
    g = torch.matmul(dy, w) if want_x or want_s else None
    dx = g * s if want_x else None
    ds = (g * x).sum() if want_s and (want_x or not couple) else None
    dw = torch.matmul(dy.reshape(-1, dy.shape[-1]).t(), y.reshape(-1, y.shape[-1])) if want_w else None
    return dx, ds, dw


def _lean_prune(res, *, needs_input_grad):
    # ds reads x, dx reads s, both read w (through g); dw reads y, the scaled input
    want_x, want_s, want_w = needs_input_grad
    (x, s), (y, w, has_bias) = res
    return (x if want_s else None, s if want_x else None), (
        y if want_w else None,
        w if want_x or want_s else None,
        has_bias,
    )


def _lean_rule(name: str, couple: bool = False) -> Rule:
    op = functe.custom_vjp(
        name,
        _scaled_linear_fwd,
        lambda res, dy, needs_input_grad: _lean_scaled_linear_bwd(
            res, dy, needs_input_grad=needs_input_grad, couple=couple
        ),
        needs_input_grad=True,
        prune_residuals=_lean_prune,
    )
    return Rule(name, "backward", SCALED_LINEAR.pattern, lambda m: m.fuse(op, [m["x"], m["s"], m["w"]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, F64])
def test_a_user_fusion_that_skips_frozen_inputs_work_is_checked_per_frozen_input(dtype):
    x, s, w = (torch.empty(shape, dtype=dtype) for shape in [(3, 4), (), (5, 4)])
    lean = _lean_rule("lean_scaled_linear")
    check(lean, {"x": x, "s": s, "w": w})  # every input trainable, then each frozen in turn
    fused = functe.fuse(lambda x, s, w: ops.linear(scale_by(x, s), w), rules=DEFAULT_RULES + RuleSet([lean]))
    args = make((3, 4), dtype), make((), dtype), make((5, 4), dtype).requires_grad_()
    y, saved = saved_storages(lambda: fused(*args))
    assert fused.plan(*args).stats["backward"].fired == {"lean_scaled_linear": 1}
    assert sorted(saved.values()) == [(3, 4)]  # w alone trains: only the scaled input y, which dw reads
    unfused = ops.linear(scale_by(*args[:2]), args[2])
    assert_close(torch.autograd.grad(y.sum(), args[2])[0], torch.autograd.grad(unfused.sum(), args[2])[0])


def test_check_catches_a_fusion_wrong_only_when_an_input_is_frozen():
    with pytest.raises(AssertionError, match=r"gradient of \['s'\] \(fused with \['x'\] frozen"):
        check(
            _lean_rule("coupled", couple=True), {"x": torch.empty(3, 4), "s": torch.empty(()), "w": torch.empty(5, 4)}
        )


# ----------------------------------------------------------------------------- sibling patterns, names, opaque ops


def _square_fwd(x):
    return x * x, (x,)


def _square_bwd(res, dy):
    return (2 * res[0] * dy,)


def _sine_fwd(x):
    return torch.sin(x), (x,)


def _sine_bwd(res, dy):
    return (torch.cos(res[0]) * dy,)


square = functe.custom_vjp("square", _square_fwd, _square_bwd)
sine = functe.custom_vjp("sine", _sine_fwd, _sine_bwd)


def _square_sine_add_fwd(x, y):
    # residuals in the pattern's order: square's, sine's, then add_extra_input's
    return x * x + torch.sin(y), ((x,), (y,), None)


def _square_sine_add_bwd(res, dy):
    (x,), (y,), _ = res
    return 2 * x * dy, torch.cos(y) * dy


square_sine_add = functe.custom_vjp("square_sine_add", _square_sine_add_fwd, _square_sine_add_bwd)
SQUARE_SINE_ADD = Rule(
    "square_sine_add",
    "forward",
    Pattern(_core._add_extra_input, Pattern(square, "x"), Pattern(sine, "y")),
    lambda m: m.fuse(square_sine_add, [m["x"], m["y"]]),
)


def _square_first(x, y):
    s = square(x)
    return s + sine(y)


def _sine_first(x, y):
    t = sine(y)  # (the same program, the other statement order)
    return square(x) + t


@pytest.mark.parametrize("program", [_square_first, _sine_first])
def test_a_fusion_of_sibling_patterns_gets_its_residuals_in_pattern_order(program):
    # The covered ops (hence the residuals a forward fusion returns) were ordered as the program
    # ran them: a program computing sine(y) first got swapped residuals and wrong gradients, and
    # check, which runs the pattern's order, passed.
    check(SQUARE_SINE_ADD, {"x": torch.empty(3, 4), "y": torch.empty(3, 4)})
    fused = functe.fuse(program, rules=RuleSet([SQUARE_SINE_ADD]))
    x, y = make((3, 4), F64), make((3, 4), F64)
    assert fused.plan(x, y).stats["forward"].fired == {"square_sine_add": 1}
    assert_matches_float64(fused, lambda x, y: x * x + torch.sin(y), [x, y])


def test_a_pattern_with_a_repeated_node_name_is_refused():
    # m.eqn("sq") silently returned the last node of that name (check's static= too)
    with pytest.raises(functe.RuleError, match=r"pattern node names must be unique .* got 'sq' more than once"):
        Rule(
            "twice",
            "forward",
            Pattern(_core._add_extra_input, Pattern(square, "x", name="sq"), Pattern(square, "y", name="sq")),
            lambda m: None,
        )


def test_check_with_fn_refuses_a_dict_of_arguments():
    # fn(*dict) passed the capture names to the user's ops (a TypeError from inside them)
    with pytest.raises(functe.ArgumentError, match=r"with fn, example_args must be a tuple or list"):
        check(SQUARE_SINE_ADD, {"x": torch.empty(3, 4), "y": torch.empty(3, 4)}, fn=_square_first)


def test_a_forward_fusion_over_an_opaque_op_passes_the_residual_check():
    # an opaque op's residuals hold its generator state, a fresh RandomState per run, equal to no
    # other: the rewrite-time residual check refused every forward fusion over one
    opaque_tanh = functe.opaque(torch.tanh)

    def fwd(x, r):
        out, res = opaque_tanh.fwd(x)
        return out + r, (res, None)

    def bwd(res, dy):
        (dx,) = opaque_tanh.bwd(res[0], dy)
        return dx, dy

    tanh_add = functe.custom_vjp("tanh_add", fwd, bwd)
    rule = Rule(
        "tanh_add",
        "forward",
        Pattern(_core._add_extra_input, Pattern(opaque_tanh, "x"), "r"),
        lambda m: m.fuse(tanh_add, [m["x"], m["r"]]),
    )
    fused = functe.fuse(lambda x, r: opaque_tanh(x) + r, rules=RuleSet([rule]))
    x, r = make((3, 4), F64), make((3, 4), F64)
    assert fused.plan(x, r).stats["forward"].fired == {"tanh_add": 1}
    assert_matches_float64(fused, lambda x, r: torch.tanh(x) + r, [x, r])


def test_explain_drops_a_decline_where_the_rule_then_fired():
    # a commutative pattern's first input order declined (two consumers), the swapped one fired:
    # explain listed the rule as both declined and fired at the same place
    square_add = functe.custom_vjp(
        "square_add", lambda x, r: (torch.addcmul(r, x, x), ((x,), None)), lambda res, dy: (2 * res[0][0] * dy, dy)
    )
    rule = Rule(
        "square_add",
        "forward",
        Pattern(_core._add_extra_input, Pattern(square, "x"), "r", commutative=True),
        lambda m: m.fuse(square_add, [m["x"], m["r"]]),
    )

    def program(x, y):
        s, u = square(x), square(y)
        return s + u, s

    fused = functe.fuse(program, rules=RuleSet([rule]))
    x, y = make((3, 4), F64), make((3, 4), F64)
    plan = fused.plan(x, y)
    assert plan.stats["forward"].fired == {"square_add": 1}
    assert plan.stats["forward"].declined == []
    assert_matches_float64(fused, lambda x, y: (x * x + y * y, x * x), [x, y])


def test_a_user_op_given_shapes_that_do_not_fit_is_named_without_torchs_meta_log(capfd):
    # torch's fake-tensor logger printed ~70 lines of traceback before the error, which asked only
    # whether the op was data-dependent
    add_squared = functe.custom_vjp(
        "add_squared", lambda x, r: (torch.addcmul(r, x, x), (x,)), lambda res, dy: (2 * res[0] * dy, dy)
    )
    with pytest.raises(functe.TraceError, match=r"add_squared .* do its inputs \(f32\[3,4\], f32\[3,5\]\) fit"):
        functe.fuse(lambda x, r: add_squared(x, r))(torch.ones(3, 4), torch.ones(3, 5))
    assert "failed while attempting to run meta" not in capfd.readouterr().err


_TANH = functe.opaque(lambda t: torch.tanh(t))
_SIGMOID = functe.opaque(lambda t: torch.sigmoid(t))  # (both print as opaque_<lambda>)


def test_explain_numbers_ops_that_share_a_name_once_for_every_section():
    # Each printout numbered its own ops: with a dead first use of tanh removed, sigmoid became the
    # unsuffixed opaque_<lambda> of the forward plan and tanh its #2; the residual line had no suffixes.
    def program(x, w, r):
        _TANH(x)  # (dead: removed before the rules run)
        return _TANH(ops.linear(_SIGMOID(x), w) + r)

    text = functe.fuse(program).plan(make((4, 8)), make((8, 8)), make((4, 8))).explain()
    traced, rest = text.split("dead code removed")
    assert "= opaque_<lambda>#2 a" in traced and "= opaque_<lambda> g" in traced  # (sigmoid #2, tanh plain)
    plan = rest.split("forward plan:")[1].split("backward plan:")[0]
    assert "= opaque_<lambda>#2 a" in plan and "= opaque_<lambda> e" in plan
    assert text.rstrip().endswith("opaque_<lambda>#2, linear, add_extra_input, opaque_<lambda>")
