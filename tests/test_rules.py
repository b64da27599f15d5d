"""Rules as data: patterns, rule sets, the fixed-point driver, golden printouts of every phase-1 fusion."""

from __future__ import annotations

import re

import pytest
import torch
from fuse_helpers import plan_of

import functe
from functe import ops
from functe.ops import _core, _fused
from functe.rules import DEFAULT_RULES, Pattern, Rule, RuleSet, rewrite
from functe.rules.core import (
    BACKWARD_LINEAR_ADD,
    BACKWARD_LINEAR_SCALE,
    FORWARD_LINEAR_BIAS_ADD,
    FORWARD_LINEAR_BIAS_OP_ADD,
    FORWARD_LINEAR_SCALE_ADD,
)

X, W, B, R = torch.zeros(4, 8), torch.zeros(6, 8), torch.zeros(6), torch.zeros(4, 6)


def _rewritten(fn, phase, *args, rules=DEFAULT_RULES):
    program = functe.trace(fn)(*args)
    new, stats = rewrite(program, rules, phase)
    functe.check_oplist(new)
    return str(program), str(new), stats


HEAD = "{ lambda a:f32[4,8] b:f32[6,8] c:f32[6] d:f32[4,6]. let\n"


def test_forward_linear_bias_add_golden():
    before, after, stats = _rewritten(lambda x, w, b, r: ops.linear(x, w, b) + r, "forward", X, W, B, R)
    assert before == HEAD + "    e:f32[4,6] = linear a b c\n    f:f32[4,6] = add_extra_input e d\n  in (f,) }"
    assert after == HEAD + "    e:f32[4,6] = forward_linear_add[bias_op=False scale=None] a b c d\n  in (e,) }"
    assert stats.fired == {"forward_linear_bias_add": 1} and stats.declined == []


def test_forward_linear_bias_add_matches_either_operand_of_the_add():
    _, after, stats = _rewritten(lambda x, w, b, r: r + ops.linear(x, w, b), "forward", X, W, B, R)
    assert "forward_linear_add[bias_op=False scale=None] a b c d" in after
    assert stats.fired == {"forward_linear_bias_add": 1}


def test_forward_linear_separate_bias_op_add_golden():
    fn = lambda x, w, b, r: ops.add_extra_input(ops.bias(ops.linear(x, w), b), r)
    before, after, stats = _rewritten(fn, "forward", X, W, B, R)
    assert before == HEAD + (
        "    e:f32[4,6] = linear a b None\n    f:f32[4,6] = bias e c\n    g:f32[4,6] = add_extra_input f d\n  in (g,) }"
    )
    assert after == HEAD + "    e:f32[4,6] = forward_linear_add[bias_op=True scale=None] a b c d\n  in (e,) }"
    assert stats.fired == {"forward_linear_bias_op_add": 1}


def test_forward_linear_scale_add_golden():
    fn = lambda x, w, r: ops.linear(x, w) * -2.5 + r
    before, after, stats = _rewritten(fn, "forward", X, W, R)
    head = "{ lambda a:f32[4,8] b:f32[6,8] c:f32[4,6]. let\n"
    assert before == head + (
        "    d:f32[4,6] = linear a b None\n"
        "    e:f32[4,6] = constant_scale[scale=-2.5] d\n"
        "    f:f32[4,6] = add_extra_input e c\n"
        "  in (f,) }"
    )
    assert after == head + "    d:f32[4,6] = forward_linear_add[bias_op=False scale=-2.5] a b None c\n  in (d,) }"
    assert stats.fired == {"forward_linear_scale_add": 1}


def test_forward_linear_scale_add_declines_a_linear_with_bias():
    _, after, stats = _rewritten(lambda x, w, b, r: ops.linear(x, w, b) * -2.5 + r, "forward", X, W, B, R)
    assert stats.fired == {} and "forward_linear_add" not in after
    [(rule, where, reason)] = stats.declined
    assert (rule, where) == ("forward_linear_scale_add", "add_extra_input -> f32[4,6]")
    assert reason.startswith("linear has a bias: without a GEMM epilogue taking both a bias and an accumulator")


def test_backward_linear_add_golden():
    def fn(x, w, b):
        y, extra = ops.make_extra_output(x)
        return ops.linear(y, w, b), extra

    before, after, stats = _rewritten(fn, "backward", torch.zeros(4, 8), torch.zeros(8, 8), torch.zeros(8))
    head = "{ lambda a:f32[4,8] b:f32[8,8] c:f32[8]. let\n"
    assert before == head + (
        "    d:f32[4,8] e:f32[4,8] = make_extra_output a\n    f:f32[4,8] = linear d b c\n  in (f, e) }"
    )
    assert after == head + "    d:f32[4,8] e:f32[4,8] = backward_linear_add a b c\n  in (e, d) }"
    assert stats.fired == {"backward_linear_add": 1}


def test_backward_linear_add_when_the_second_fork_output_feeds_the_linear():
    def fn(x, w):
        y, extra = ops.make_extra_output(x)
        return ops.add_extra_input(ops.linear(extra, w), y)

    _, after, stats = _rewritten(fn, "backward", torch.zeros(4, 8), torch.zeros(8, 8))
    assert "    c:f32[4,8] d:f32[4,8] = backward_linear_add a b None\n    e:f32[4,8] = add_extra_input d c" in after
    assert stats.fired == {"backward_linear_add": 1}


def test_backward_linear_scale_golden():
    before, after, stats = _rewritten(lambda x, w, b: ops.linear(x, w, b) * 0.5, "backward", X, W, B)
    head = "{ lambda a:f32[4,8] b:f32[6,8] c:f32[6]. let\n"
    assert before == head + "    d:f32[4,6] = linear a b c\n    e:f32[4,6] = constant_scale[scale=0.5] d\n  in (e,) }"
    assert after == head + "    d:f32[4,6] = backward_linear_scale[scale=0.5] a b c\n  in (d,) }"
    assert stats.fired == {"backward_linear_scale": 1}


def test_forward_and_backward_plans_are_independent_rewrites():
    def block(x, w1, w2, b2):
        h = ops.linear(x, w1) * 0.5 + x
        y, skip = ops.make_extra_output(h)
        return ops.linear(y, w2, b2) + skip

    sq = torch.zeros(8, 8)
    plan = plan_of(block, torch.zeros(4, 8), sq, sq, torch.zeros(8))
    head = "{ lambda a:f32[4,8] b:f32[8,8] c:f32[8,8] d:f32[8]. let\n"
    assert str(plan.forward) == head + (
        "    e:f32[4,8] = forward_linear_add[bias_op=False scale=0.5] a b None a\n"
        "    f:f32[4,8] g:f32[4,8] = make_extra_output e\n"
        "    h:f32[4,8] = forward_linear_add[bias_op=False scale=None] f c d g\n"
        "  in (h,) }"
    )
    assert str(plan.backward) == head + (
        "    e:f32[4,8] = backward_linear_scale[scale=0.5] a b None\n"
        "    f:f32[4,8] = add_extra_input e a\n"
        "    g:f32[4,8] h:f32[4,8] = backward_linear_add f c d\n"
        "    i:f32[4,8] = add_extra_input h g\n"
        "  in (i,) }"
    )
    assert plan.stats["forward"].fired == {"forward_linear_scale_add": 1, "forward_linear_bias_add": 1}
    assert plan.stats["backward"].fired == {"backward_linear_add": 1, "backward_linear_scale": 1}
    assert plan.stats["joint"].fired == {}


def test_producer_with_two_consumers_is_not_rewritten():
    def fn(x, w, r):
        h = ops.linear(x, w)
        return h + r, h * 2.0

    program = functe.trace(fn)(X, W, R)
    for phase in ("forward", "backward"):
        new, stats = rewrite(program, DEFAULT_RULES, phase)
        assert str(new) == str(program) and stats.fired == {}
    _, stats = rewrite(program, DEFAULT_RULES, "forward")
    assert stats.declined == [("forward_linear_bias_add", "add_extra_input -> f32[4,6]", _TWO)]
    _, stats = rewrite(program, DEFAULT_RULES, "backward")
    assert stats.declined == [("backward_linear_scale", "constant_scale -> f32[4,6]", _TWO)]


_TWO = "the output f32[4,6] of linear has 2 consumers"


def test_a_shared_producer_may_be_allowed_by_the_rule():
    rule = Rule(
        "shared_linear_add",
        "forward",
        Pattern(_core._add_extra_input, Pattern(_core._linear, "x", "w", "b", name="lin", shared=True), "r"),
        lambda m: m.fuse(
            _fused.forward_linear_add, [m["x"], m["w"], m["b"], m["r"]], m.outputs[1:], scale=None, bias_op=False
        ),
    )

    def fn(x, w, r):
        h = ops.linear(x, w)
        return h + r, h * 2.0

    program = functe.trace(fn)(X, W, R)
    with pytest.raises(functe.TraceError, match=r"must define every output used outside the match"):
        rewrite(program, RuleSet([rule]), "forward")


_identity_add = functe.custom_vjp(
    "identity_add", lambda x, r: ((x, x + r), None), lambda _, cts: (cts[0] + cts[1], cts[1])
)


def test_fusing_a_non_convex_match_is_declined():
    rule = Rule(
        "cyclic",
        "joint",
        Pattern(_core._add_extra_input, Pattern(_core._identity, "x", shared=True), "r", name="add"),
        lambda m: m.fuse(_identity_add, [m["x"], m["r"]]),
    )

    def fn(x):
        h = ops.identity(x)
        return ops.add_extra_input(h, h * 2.0)  # the add's other input depends on the identity's output

    program = functe.trace(fn)(torch.zeros(3))
    new, stats = rewrite(program, RuleSet([rule]), "joint")
    assert str(new) == str(program)
    reason = "fusing would create a cycle: an outside op both consumes and feeds the match"
    assert stats.declined == [("cyclic", "add_extra_input -> f32[3]", reason)]

    # Without the feedback the same rule fuses.
    def ok(x, r):
        h = ops.identity(x)
        return h + r, h

    new, stats = rewrite(functe.trace(ok)(torch.zeros(3), torch.zeros(3)), RuleSet([rule]), "joint")
    assert stats.fired == {"cyclic": 1}
    assert str(new).splitlines()[1] == "    c:f32[3] d:f32[3] = identity_add a b"


def test_condition_reason_is_reported_and_the_rule_does_not_fire():
    def needs_half(m):
        w = m["w"]
        if w.dtype not in (torch.float16, torch.bfloat16):
            return f"weight dtype {str(w.dtype).removeprefix('torch.')}: the fused epilogue needs fp16/bf16"
        return None

    rule = Rule(
        "linear_bias_add_half_only",
        "forward",
        FORWARD_LINEAR_BIAS_ADD.pattern,
        FORWARD_LINEAR_BIAS_ADD.rewrite,
        condition=needs_half,
    )
    program = functe.trace(lambda x, w, r: ops.linear(x, w) + r)(X, W, R)
    new, stats = rewrite(program, RuleSet([rule]), "forward")
    assert stats.fired == {} and str(new) == str(program)
    reason = "weight dtype float32: the fused epilogue needs fp16/bf16"
    assert stats.declined == [("linear_bias_add_half_only", "add_extra_input -> f32[4,6]", reason)]
    half = [t.to(torch.bfloat16) for t in (X, W, R)]
    _, stats = rewrite(functe.trace(lambda x, w, r: ops.linear(x, w) + r)(*half), RuleSet([rule]), "forward")
    assert stats.fired == {"linear_bias_add_half_only": 1}


def test_a_failing_condition_or_rewrite_names_the_rule_and_a_bool_or_empty_condition_is_refused():
    # a raising condition escaped as a bare KeyError; True/False were taken as decline reasons, so the
    # rule silently never fired
    program = functe.trace(lambda x, w, r: ops.linear(x, w) + r)(X, W, R)
    base = FORWARD_LINEAR_BIAS_ADD

    def rule(**kw):
        return RuleSet([Rule("mine", "forward", base.pattern, kw.get("rewrite", base.rewrite), kw.get("condition"))])

    at = r"\(matched at add_extra_input -> f32\[4,6\]\)"
    with pytest.raises(functe.RuleError, match=rf"rule mine: its condition raised KeyError: 'lin' {at}"):
        rewrite(program, rule(condition=lambda m: m.params("lin")), "forward")
    with pytest.raises(functe.RuleError, match=rf"rule mine: its rewrite raised ZeroDivisionError: .* {at}"):
        rewrite(program, rule(rewrite=lambda m: 1 / 0), "forward")
    for value in (True, False, "", "  "):
        with pytest.raises(functe.RuleError, match=rf"non-empty reason string .* got {re.escape(repr(value))} {at}"):
            rewrite(program, rule(condition=lambda m, v=value: v), "forward")


def test_earlier_rules_win_and_each_match_counts():
    # Two residual blocks (the first block's output, a match's root, may have many consumers).
    def fn(x, w, r):
        h = ops.linear(x, w) + r
        return ops.linear(h, torch.zeros(6, 6)) + h

    program = functe.trace(fn)(X, W, R)
    alt = Rule("alt", "forward", FORWARD_LINEAR_BIAS_ADD.pattern, FORWARD_LINEAR_BIAS_ADD.rewrite)
    _, stats = rewrite(program, RuleSet([FORWARD_LINEAR_BIAS_ADD, alt]), "forward")
    assert stats.fired == {"forward_linear_bias_add": 2}  # both blocks; the later identical rule never fires
    _, stats = rewrite(
        functe.trace(lambda x, w, r: ops.linear(x, w) + r)(X, W, R), RuleSet([alt]) + FORWARD_LINEAR_BIAS_ADD, "forward"
    )
    assert stats.fired == {"alt": 1}


def test_fixed_point_cap_stops_a_rule_that_matches_its_own_result():
    again = functe.custom_vjp("again", lambda x: (x, (None,)), lambda _, g: (g,))
    loop = Rule("loop", "forward", Pattern((_core._identity, again), "x"), lambda m: m.fuse(again, [m["x"]]))
    program = functe.trace(ops.identity)(torch.zeros(2))
    with pytest.raises(
        functe.FuncteError, match=r"no fixed point after 5 rewrites in the forward phase \(last rule: loop\)"
    ):
        rewrite(program, RuleSet([loop]), "forward", max_rewrites=5)


def test_forward_fusion_must_return_one_residual_per_covered_op():
    bad_op = functe.custom_vjp("bad_fused", lambda x, w, r: (ops.linear(x, w) + r, None), lambda res, g: (g, None, g))
    bad = Rule(
        "bad",
        "forward",
        Pattern(_core._add_extra_input, Pattern(_core._linear, "x", "w", None), "r"),
        lambda m: m.fuse(bad_op, [m["x"], m["w"], m["r"]]),
    )
    program = functe.trace(lambda x, w, r: ops.linear(x, w) + r)(X, W, R)
    with pytest.raises(
        functe.TraceError, match=r"must return one residual per covered op \(2: linear, add_extra_input\)"
    ):
        rewrite(program, RuleSet([bad]), "forward")


def test_fused_output_types_are_checked():
    wrong = Rule(
        "wrong_shape",
        "backward",
        Pattern(_core._constant_scale, "x"),
        lambda m: m.fuse(_core._reshape, [m["x"]], shape=(-1,)),
    )
    program = functe.trace(lambda x: x * 2.0)(torch.zeros(2, 3))
    message = r"rule wrong_shape: the fused op reshape returns \(f32\[6\]\) .* declares \(f32\[2,3\]\)"
    with pytest.raises(functe.TraceError, match=message):
        rewrite(program, RuleSet([wrong]), "backward")


def test_rule_sets_combine_with_plus_and_are_values():
    assert DEFAULT_RULES.names == (
        "forward_linear_bias_add",
        "forward_linear_bias_op_add",
        "forward_linear_scale_add",
        "backward_linear_add",
        "backward_linear_scale",
        "forward_norm_quantize",
        "forward_norm_block_quantize",
        "forward_activation_quantize",
        "forward_activation_block_quantize",
        "backward_fp8_linear_activation",
        "backward_fp8_linear_bias_activation",
        "forward_linear_bias_activation",
        "forward_linear_bias_op_activation",
        "backward_linear_bias_activation",
        "backward_activation_bias",
        "backward_add_norm",
    )
    mine = Rule("mine", "joint", Pattern(_core._identity, "x"), lambda m: m.fuse(_core._identity, [m["x"]]))
    combined = DEFAULT_RULES + mine
    assert combined.names[-1] == "mine" and len(DEFAULT_RULES) == 16  # the default set is unchanged
    assert (mine + DEFAULT_RULES).names[0] == "mine"
    assert combined.phase("joint") == (mine,)
    with pytest.raises(ValueError, match=r"rule names must be unique in a RuleSet; repeated: \['mine'\]"):
        combined + mine
    with pytest.raises(ValueError, match="phase must be one of"):
        Rule("x", "sideways", Pattern(_core._identity, "x"), lambda m: None)
    assert FORWARD_LINEAR_BIAS_OP_ADD.location.endswith(
        "functe/rules/core.py:" + FORWARD_LINEAR_BIAS_OP_ADD.location.split(":")[-1]
    )
    assert {FORWARD_LINEAR_SCALE_ADD.phase, BACKWARD_LINEAR_ADD.phase, BACKWARD_LINEAR_SCALE.phase} == {
        "forward",
        "backward",
    }


def test_pattern_literal_none_and_repeated_capture():
    # linear with a bias does not match the separate-bias-op rule (it requires linear's bias to be None)
    program = functe.trace(lambda x, w, b, r: ops.add_extra_input(ops.bias(ops.linear(x, w, b), b), r))(X, W, B, R)
    _, stats = rewrite(program, RuleSet([FORWARD_LINEAR_BIAS_OP_ADD]), "forward")
    assert stats.fired == {}
    same = Rule(
        "x_plus_x",
        "joint",
        Pattern(_core._add_extra_input, "x", "x"),
        lambda m: m.fuse(_core._constant_scale, [m["x"]], scale=2.0),
    )
    program = functe.trace(lambda x, y: (x + x, x + y))(torch.zeros(3), torch.zeros(3))
    new, stats = rewrite(program, RuleSet([same]), "joint")
    assert stats.fired == {"x_plus_x": 1}
    assert str(new).splitlines()[1:3] == [
        "    c:f32[3] = constant_scale[scale=2.0] a",
        "    d:f32[3] = add_extra_input a b",
    ]


def test_explain_prints_plans_fired_and_declined(capsys):
    def fn(x, w, r):
        h = ops.linear(x, w)
        return h + r, h * 2.0

    functe.explain(fn, X, W, R)
    text = capsys.readouterr().out
    assert (
        "forward plan:\n  fired: none\n  declined: forward_linear_bias_add at add_extra_input -> f32[4,6]: " + _TWO
        in text
    )
    assert (
        "backward plan:\n  fired: none\n  declined: backward_linear_scale at constant_scale -> f32[4,6]: " + _TWO
        in text
    )
    assert text.startswith("functe.fuse(fn): program as traced\n{ lambda a:f32[4,8]")


def test_explain_does_not_take_a_keyword_that_is_also_fns(capsys):
    # explain(block, x, w, recipe=r) took r as fuse's recipe and traced block with recipe=None: it
    # printed a plain linear program while fuse(block)(x, w, recipe=r) runs fp8_linear
    recipe = functe.DelayedScaling()

    def block(x, w, recipe=None):
        if recipe is None:
            return ops.linear(x, w)
        return ops.fp8_linear(x, w, None, functe.init_linear_scaling_state(recipe), recipe=recipe)

    x, w = torch.randn(4, 16), torch.randn(8, 16)
    with pytest.raises(functe.ArgumentError, match=r"recipe= is fuse's recipe, but block also takes 'recipe'"):
        functe.explain(block, x, w, recipe=recipe)
    functe.explain(functe.fuse(block), x, w, recipe=recipe)  # (a fused function passes it on)
    assert "fp8_linear" in capsys.readouterr().out
    with pytest.raises(functe.ArgumentError, match=r"rules= is ignored for the fused function <lambda>"):
        functe.explain(functe.fuse(lambda x, w: ops.linear(x, w)), x, w, rules=DEFAULT_RULES)
