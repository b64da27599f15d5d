"""Phase-2 fusions: linear+bias+activation, activation+bias backward (plain and FP8), add+norm backward,
norm/activation q-in into the FP8 linear.

Golden printouts, match counters and declined reasons per rule; fused vs unfused numerics with
hypothesis drawing shapes, dtypes and recipes; the FP8 fusions equal the unfused program *bit for
bit* (outputs, gradients and the next scaling states); the CUDA dispatch decisions, exercised with
the interpreter.
"""

from __future__ import annotations

import pytest
import torch
from fuse_helpers import F64, assert_matches_float64, check_forward_residuals, draw, outputs_and_grads, vjp_wrt
from helpers import assert_graph_replay_matches, check_transforms, make
from hypothesis import example, given, settings
from hypothesis import strategies as st

import functe
from functe import ops
from functe.ops import _fused, _fused_fp8
from functe.rules import DEFAULT_RULES, RuleSet, check, rewrite
from functe.rules.activation import BACKWARD_ACTIVATION_BIAS, FORWARD_LINEAR_BIAS_ACTIVATION
from functe.testing import assert_close

BF16 = torch.bfloat16
DELAYED = functe.DelayedScaling(amax_history_len=4)
CURRENT = functe.CurrentScaling()
MXFP8 = functe.MXFP8BlockScaling()
LEADS = [(), (0,), (3,), (2, 5), (2, 1, 3)]
ACT_NAMES = ["gelu", "qgelu", "relu", "srelu", "silu"]


def _rewritten(fn, phase, *args, rules=DEFAULT_RULES, recipe=None):
    program = functe.trace(fn)(*args)
    new, stats = rewrite(program, rules, phase, recipe=recipe)
    functe.check_oplist(new)
    return str(program), str(new), stats


# ----------------------------------------------------------------------------- programs


def linear_act(x, w, b, *, act="gelu"):
    return ops.activation(ops.linear(x, w, b), act)


def linear_bias_op_act(x, w, b, *, act="relu"):
    return ops.activation(ops.bias(ops.linear(x, w), b), act)


def bias_act(h, b, *, act="silu"):
    return ops.activation(ops.bias(h, b), act)


def add_norm(x, g, beta, *, kind="layer"):
    y, skip = ops.make_extra_output(x)
    out = ops.layer_norm(y, g, beta) if kind == "layer" else ops.rms_norm(y, g)
    return out, skip


def block(x, g, beta, w1, b1, w2, b2, s1, s2, *, recipe, act="gelu", kind="layer"):
    """The residual MLP block of the issue, with FP8 linears when a recipe is given."""

    def dense(h, w, b, s):
        return ops.linear(h, w, b) if recipe is None else ops.fp8_linear(h, w, b, s, recipe=recipe)

    y, skip = ops.make_extra_output(x)
    h = ops.layer_norm(y, g, beta) if kind == "layer" else ops.rms_norm(y, g)
    h = ops.activation(dense(h, w1, b1, s1), act)
    return dense(h, w2, b2, s2) + skip


# ----------------------------------------------------------------------------- golden printouts, counters, reasons

HEAD = "{ lambda a:bf16[4,8] b:bf16[6,8] c:bf16[6]. let\n"


def test_forward_linear_bias_activation_golden():
    x, w, b = torch.zeros(4, 8, dtype=BF16), torch.zeros(6, 8, dtype=BF16), torch.zeros(6, dtype=BF16)
    before, after, stats = _rewritten(linear_act, "forward", x, w, b)
    assert before == HEAD + (
        "    d:bf16[4,6] = linear a b c\n"
        "    e:bf16[4,6] = activation[alpha=0.0 interleave=0 limit=0.0 name='gelu' offset=0.0] d None\n"
        "  in (e,) }"
    )
    assert (
        after
        == HEAD + "    d:bf16[4,6] = forward_linear_activation[activation='gelu' bias_op=False] a b c\n  in (d,) }"
    )
    assert stats.fired == {"forward_linear_bias_activation": 1} and stats.declined == []
    _, after, stats = _rewritten(linear_bias_op_act, "forward", x, w, b)
    assert (
        after == HEAD + "    d:bf16[4,6] = forward_linear_activation[activation='relu' bias_op=True] a b c\n  in (d,) }"
    )
    assert stats.fired == {"forward_linear_bias_op_activation": 1}


def test_forward_linear_bias_activation_declines_fp32_and_gated_activations():
    x, w, b = torch.zeros(4, 8), torch.zeros(6, 8), torch.zeros(6)
    _, after, stats = _rewritten(linear_act, "forward", x, w, b)
    assert stats.fired == {} and "forward_linear_activation" not in after
    assert stats.declined == [
        (
            "forward_linear_bias_activation",
            "activation -> f32[4,6]",
            "weight dtype float32: the fused epilogue needs fp16/bf16",
        )
    ]
    gated = lambda x, w, b: ops.swiglu(ops.linear(x, w, b))
    _, _, stats = _rewritten(gated, "forward", x.to(BF16), w.to(BF16), b.to(BF16))
    [(rule, _, reason)] = stats.declined
    assert rule == "forward_linear_bias_activation"
    assert reason == "activation swiglu is gated (2H -> H): the fused kernels apply elementwise activations only"


def test_backward_activation_bias_goldens():
    x, w, b = torch.zeros(4, 8, dtype=BF16), torch.zeros(6, 8, dtype=BF16), torch.zeros(6, dtype=BF16)
    _, after, stats = _rewritten(linear_act, "backward", x, w, b)
    assert after == HEAD + "    d:bf16[4,6] = backward_linear_activation[activation='gelu'] a b c\n  in (d,) }"
    assert stats.fired == {"backward_linear_bias_activation": 1}
    before, after, stats = _rewritten(bias_act, "backward", torch.zeros(4, 6), torch.zeros(6))
    head = "{ lambda a:f32[4,6] b:f32[6]. let\n"
    assert before == head + (
        "    c:f32[4,6] = bias a b\n"
        "    d:f32[4,6] = activation[alpha=0.0 interleave=0 limit=0.0 name='silu' offset=0.0] c None\n"
        "  in (d,) }"
    )
    assert after == head + "    c:f32[4,6] = backward_activation_bias[activation='silu'] a b\n  in (c,) }"
    assert stats.fired == {"backward_activation_bias": 1}


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_backward_add_norm_golden(kind):
    args = torch.zeros(4, 8), torch.zeros(8), torch.zeros(8)
    before, after, stats = _rewritten(lambda *a: add_norm(*a, kind=kind), "backward", *args)
    head = "{ lambda a:f32[4,8] b:f32[8] c:f32[8]. let\n"
    norm = (  # (LayerNorm's statistics are outputs of its op, unused here)
        "f:f32[4,8] g:f32[4] h:f32[4] = layer_norm[eps=1e-05 zero_centered_gamma=False] d b c"
        if kind == "layer"
        else "f:f32[4,8] = rms_norm[eps=1e-05 zero_centered_gamma=False] d b"
    )
    assert before == head + f"    d:f32[4,8] e:f32[4,8] = make_extra_output a\n    {norm}\n  in (f, e) }}"
    beta = "c" if kind == "layer" else "None"
    fused = f"backward_add_norm[eps=1e-05 kind='{kind}' zero_centered_gamma=False] a b {beta}"
    assert after == head + f"    d:f32[4,8] e:f32[4,8] = {fused}\n  in (e, d) }}"
    assert stats.fired == {"backward_add_norm": 1}


def test_forward_q_in_goldens():
    def norm_q(x, g, w, b, s):
        return ops.fp8_linear(ops.rms_norm(x, g), w, b, s, recipe=DELAYED)

    args = (
        torch.zeros(4, 8),
        torch.zeros(8),
        torch.zeros(6, 8),
        torch.zeros(6),
        functe.init_linear_scaling_state(DELAYED),
    )
    before, after, stats = _rewritten(norm_q, "forward", *args)
    head = "{ lambda a:f32[4,8] b:f32[8] c:f32[6,8] d:f32[6] e:f32[] f:f32[4] g:f32[] h:f32[4] i:f32[] j:f32[4]. let\n"
    assert before == head + (
        "    k:f32[4,8] = rms_norm[eps=1e-05 zero_centered_gamma=False] a b\n"
        "    l:f32[4,6] = fp8_linear[recipe=DelayedScaling(amax_history_len=4)] k c d e f g h i j\n"
        "  in (l,) }"
    )
    assert after == head + (
        "    k:f32[4,6] = forward_norm_fp8_linear[eps=1e-05 kind='rms' recipe=DelayedScaling(amax_history_len=4)"
        " zero_centered_gamma=False] a b None c d e f g h i j\n  in (k,) }"
    )
    assert stats.fired == {"forward_norm_quantize": 1}

    act_q = lambda x, w: ops.fp8_linear(ops.swiglu(x), w, None, None, recipe=CURRENT)
    _, after, stats = _rewritten(act_q, "forward", torch.zeros(4, 16), torch.zeros(6, 8))
    assert after == "{ lambda a:f32[4,16] b:f32[6,8]. let\n" + (
        "    c:f32[4,6] = forward_activation_fp8_linear[alpha=0.0 limit=0.0 name='swiglu' offset=0.0"
        " recipe=CurrentScaling()] a b None None\n  in (c,) }"
    )
    assert stats.fired == {"forward_activation_quantize": 1}


def test_backward_fp8_activation_bias_goldens():
    args = torch.zeros(4, 8), torch.zeros(6, 8), torch.zeros(6)
    head = "{ lambda a:f32[4,8] b:f32[6,8] c:f32[6]. let\n"
    fn = lambda x, w, b: ops.gelu(ops.fp8_linear(x, w, b, None, recipe=CURRENT))
    _, after, stats = _rewritten(fn, "backward", *args)
    assert after == head + (
        "    d:f32[4,6] = backward_fp8_linear_activation[activation='gelu' recipe=CurrentScaling()] a b c None None\n"
        "  in (d,) }"
    )
    assert stats.fired == {"backward_fp8_linear_activation": 1}
    window = lambda x, w, b: ops.relu(ops.bias(ops.fp8_linear(x, w, None, None, recipe=CURRENT), b))
    before, after, stats = _rewritten(window, "backward", *args)
    assert before == head + (
        "    d:f32[4,6] = fp8_linear[recipe=CurrentScaling()] a b None None\n"
        "    e:f32[4,6] = bias d c\n"
        "    f:f32[4,6] = activation[alpha=0.0 interleave=0 limit=0.0 name='relu' offset=0.0] e None\n"
        "  in (f,) }"
    )
    assert after == head + (
        "    d:f32[4,6] = backward_fp8_linear_activation[activation='relu' recipe=CurrentScaling()] a b None None c\n"
        "  in (d,) }"
    )
    assert stats.fired == {"backward_fp8_linear_bias_activation": 1}  # before the unquantized bias+act rule


def test_fp8_rules_decline_mxfp8_a_recipe_mismatch_and_interleaving():
    fn = lambda x, w: ops.gelu(ops.fp8_linear(ops.gelu(x), w, None, None, recipe=MXFP8))
    args = torch.zeros(4, 32), torch.zeros(32, 32)
    for phase, rule in [("forward", "forward_activation_quantize"), ("backward", "backward_fp8_linear_activation")]:
        _, _, stats = _rewritten(fn, phase, *args)
        [(name, _, reason)] = stats.declined
        assert name == rule and stats.fired == {}
        assert reason.startswith("MXFP8 recipe: no fused norm/activation + MXFP8 cast kernel (the per-tensor and block")
    current = lambda x, w: ops.fp8_linear(ops.gelu(x), w, None, None, recipe=CURRENT)
    _, _, stats = _rewritten(current, "forward", *args, recipe=DELAYED)
    assert stats.fired == {} and stats.declined[0][2] == (
        "fp8_linear uses CurrentScaling(fp8_format=<Format.HYBRID: 'HYBRID'>, power_2_scales=False, "
        "amax_epsilon=0.0), not the recipe given to fuse (DelayedScaling(margin=0, fp8_format=<Format.HYBRID: "
        "'HYBRID'>, amax_history_len=4, amax_compute_algo='max'))"
    )
    _, _, stats = _rewritten(current, "forward", *args, recipe=CURRENT)
    assert stats.fired == {"forward_activation_quantize": 1}
    inter = lambda x, w: ops.fp8_linear(ops.swiglu(x, interleave=4), w, None, None, recipe=CURRENT)
    _, _, stats = _rewritten(inter, "forward", torch.zeros(4, 16), torch.zeros(6, 8))
    assert stats.declined[0][2] == "interleaved gated layout: the quantizing activation kernel reads the chunked layout"


def test_a_producer_with_two_consumers_is_not_rewritten():
    def fn(x, w, b):
        h = ops.linear(x, w, b)
        return ops.gelu(h), h

    args = torch.zeros(4, 8, dtype=BF16), torch.zeros(6, 8, dtype=BF16), torch.zeros(6, dtype=BF16)
    for phase in ("forward", "backward"):
        before, after, stats = _rewritten(fn, phase, *args)
        assert after == before and stats.fired == {}
        assert stats.declined[0][2] == "the output bf16[4,6] of linear has 2 consumers"


def test_explain_of_the_mlp_block_is_readable(capsys):
    args = _block_args((4,), 8, 16, BF16, None, torch.Generator().manual_seed(0))
    functe.explain(lambda *a: block(*a, recipe=None), *args)
    out = capsys.readouterr().out
    assert "fired: forward_linear_bias_add x1, forward_linear_bias_activation x1" in out
    assert "fired: backward_linear_bias_activation x1, backward_add_norm x1" in out
    assert max(len(line) for line in out.splitlines()) < 140


# ----------------------------------------------------------------------------- numerics: fused vs unfused


def assert_matches(fused, program, args, *, seed=0, what=""):
    """Fused vs unfused numerics. fp32/fp64: ``fused`` against the unfused program in float64 (TE's
    convention). 16-bit: a multi-op program rounds its intermediates, so neither it nor its fusion
    matches a float64 evaluation at 16-bit precision everywhere; the fusion must be *no less accurate
    than the unfused program*: per element, its distance to the float64 evaluation is at most the
    unfused program's plus the dtype's tolerance."""
    if args[0].dtype not in (torch.float16, BF16):
        assert_matches_float64(fused, program, args, seed=seed, what=what)
        return
    gen = torch.Generator().manual_seed(seed)
    got = outputs_and_grads(fused, args, gen=gen)
    cts = got[2]
    unfused = outputs_and_grads(functe.fuse(program, rules=RuleSet()), args, cts)
    wide = [a.detach().to(F64) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    ref = outputs_and_grads(program, wide, [c.to(F64) for c in cts])
    for i, (f, u, r) in enumerate(zip([*got[0], *got[1]], [*unfused[0], *unfused[1]], [*ref[0], *ref[1]])):
        assert (f is None) == (u is None) == (r is None), f"{what} result {i}"
        if f is None:
            continue
        assert f.dtype == u.dtype and f.shape == u.shape == r.shape, f"{what} result {i}"
        rtol, atol = functe.testing.tolerance(f.dtype)
        err_f, err_u = (f.double() - r).abs(), (u.double() - r).abs()
        bad = err_f > err_u + atol + rtol * r.abs()
        assert not bad.any(), (
            f"{what} result {i} (outputs, then gradients): fused error {err_f[bad]} vs unfused {err_u[bad]}"
        )


def _args(name, lead, k, n, dtype, gen):
    if name in ("linear_act", "linear_bias_op_act"):
        return [draw((*lead, k), dtype, gen), draw((n, k), dtype, gen), draw((n,), dtype, gen)]
    if name == "bias_act":
        return [draw((*lead, n), dtype, gen), draw((n,), dtype, gen)]
    return [draw((*lead, k), dtype, gen), draw((k,), dtype, gen), draw((k,), dtype, gen)]  # add_norm


PROGRAMS = {
    "linear_act": (linear_act, {"forward_linear_bias_activation", "backward_linear_bias_activation"}),
    "linear_bias_op_act": (linear_bias_op_act, {"forward_linear_bias_op_activation", "backward_activation_bias"}),
    "bias_act": (bias_act, {"backward_activation_bias"}),
    "add_norm": (add_norm, {"backward_add_norm"}),
}


@pytest.mark.parametrize("name", list(PROGRAMS))
@settings(max_examples=5, deadline=None)
@given(
    lead=st.sampled_from(LEADS),
    k=st.integers(1, 24),
    n=st.integers(1, 24),
    dtype=st.sampled_from([torch.float32, torch.float16, BF16]),
    act=st.sampled_from(ACT_NAMES),
    kind=st.sampled_from(["layer", "rms"]),
    seed=st.integers(0, 2**16),
)
def test_fused_matches_unfused(name, lead, k, n, dtype, act, kind, seed):
    fn, rules = PROGRAMS[name]
    static = {"kind": kind} if name == "add_norm" else {"act": act}
    k = max(k, 2) if name == "add_norm" else k  # (one feature: torch's LayerNorm backward cancels, unfused too)
    args = _args(name, lead, k, n, dtype, torch.Generator().manual_seed(seed))
    program = lambda *a: fn(*a, **static)
    fused = functe.fuse(program)
    fired = {r for stats in fused.plan(*args).stats.values() for r in stats.fired}
    expected = {r for r in rules if dtype != torch.float32 or not r.startswith("forward")}
    assert fired == expected
    assert_matches(fused, program, args, seed=seed, what=name)


def test_every_phase2_rule_on_both_backends(backend):
    gen = torch.Generator().manual_seed(3)
    for name, (fn, rules) in PROGRAMS.items():
        for act in ("gelu", "relu"):
            static = {"kind": "rms"} if name == "add_norm" else {"act": act}
            args = _args(name, (2, 3), 5, 4, BF16, gen)
            program = lambda *a, fn=fn, static=static: fn(*a, **static)
            fused = functe.fuse(program)
            assert {r for s in fused.plan(*args).stats.values() for r in s.fired} == rules
            assert_matches(fused, program, args, what=f"{name} {act}")


@settings(max_examples=6, deadline=None)
@given(
    lead=st.sampled_from([(5,), (2, 3)]),
    k=st.integers(1, 16),
    n=st.integers(1, 16),
    dtype=st.sampled_from([torch.float32, BF16]),
    act=st.sampled_from(ACT_NAMES),
    seed=st.integers(0, 2**16),
)
def test_rules_check_on_the_new_rules(lead, k, n, dtype, act, seed):
    x, w, b = torch.empty(*lead, k, dtype=dtype), torch.empty(n, k, dtype=dtype), torch.empty(n, dtype=dtype)
    h = torch.empty(*lead, n, dtype=dtype)
    check(BACKWARD_ACTIVATION_BIAS, (h, b), fn=lambda h, b: bias_act(h, b, act=act), seed=seed)
    if dtype != torch.float32:
        check(FORWARD_LINEAR_BIAS_ACTIVATION, (x, w, b), fn=lambda x, w, b: linear_act(x, w, b, act=act), seed=seed)


# ----------------------------------------------------------------------------- the MLP block with recipes


def _block_args(lead, k, n, dtype, recipe, gen):
    fp8 = recipe is not None
    x = draw((*lead, k), dtype, gen) * (4 if fp8 else 1)
    args = [x, draw((k,), dtype, gen), draw((k,), dtype, gen), draw((n, k), dtype, gen), draw((n,), dtype, gen)]
    args += [draw((k, n), dtype, gen), draw((k,), dtype, gen)]
    states = [functe.init_linear_scaling_state(recipe) if fp8 else None for _ in range(2)]
    if states[0] is not None:  # states that have seen steps: scales other than 1
        states = [
            functe.LinearScalingState(
                *(functe.ScalingState(torch.tensor(s), torch.rand(4)) for s in (0.5, 64.0, 2.0**10))
            )
            for _ in range(2)
        ]
    return [*args, *states]


def _leaves(tree):
    return [t for t in functe.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _vjp_all(fn, args, ct):
    """Output and the cotangents of every non-None argument (states included: their next values)."""
    return vjp_wrt(fn, args, ct, [i for i, a in enumerate(args) if a is not None])


@settings(max_examples=8, deadline=None)
@given(
    lead=st.sampled_from([(3,), (2, 5), (0,)]),
    k=st.sampled_from([8, 16, 32]),
    n=st.sampled_from([16, 24, 64]),
    dtype=st.sampled_from([torch.float32, BF16]),
    recipe=st.sampled_from([None, DELAYED, CURRENT, MXFP8]),
    act=st.sampled_from(["gelu", "relu", "swiglu"]),
    kind=st.sampled_from(["layer", "rms"]),
    seed=st.integers(0, 2**16),
)
# A gradient entry of 3e-5 among entries up to 27 (float32: off by 1.1e-5 from float64, fused and
# unfused bit-identical): the tolerance's atol has to be on the tensor's scale.
@example(lead=(3,), k=16, n=24, dtype=torch.float32, recipe=None, act="gelu", kind="layer", seed=410)
def test_block_with_recipes_matches_unfused(lead, k, n, dtype, recipe, act, kind, seed):
    if recipe is None:  # (a 16-bit multi-stage block rounds its intermediates: covered stage by stage above)
        act, dtype = ("srelu" if act == "swiglu" else act), torch.float32
    gen = torch.Generator().manual_seed(seed)
    args = _block_args(lead, k, n, dtype, recipe, gen)
    if act == "swiglu":
        args[5] = draw((k, n // 2), dtype, gen)  # fc2 consumes H = n / 2 features
    program = lambda *a: block(*a, recipe=recipe, act=act, kind=kind)
    fused = functe.fuse(program, recipe=recipe)
    plan = fused.plan(*args)
    fired = {r for stats in plan.stats.values() for r in stats.fired}
    assert "backward_add_norm" in fired
    if recipe is None:
        assert {"forward_linear_bias_add", "backward_linear_bias_activation"} <= fired
        assert_matches_float64(fused, program, args, seed=seed)
        return
    per_tensor = not isinstance(recipe, functe.MXFP8BlockScaling)
    assert ("forward_norm_quantize" in fired) == per_tensor
    assert ("forward_activation_quantize" in fired) == per_tensor
    assert ("backward_fp8_linear_activation" in fired) == (per_tensor and act != "swiglu")
    # FP8: fused and unfused agree bit for bit: outputs, every gradient, and the next states. (Without
    # backward_add_norm, which rounds d_extra + dx once instead of twice: covered stage by stage above.)
    fused = functe.fuse(program, rules=RuleSet(r for r in DEFAULT_RULES if r.name != "backward_add_norm"))
    unfused = functe.fuse(program, rules=RuleSet())
    ct = draw((*lead, k), dtype, gen)
    got = _vjp_all(fused, args, ct)
    expected = _vjp_all(unfused, args, ct)
    for i, (a, e) in enumerate(zip(_leaves(got), _leaves(expected))):
        assert torch.equal(a, e), f"leaf {i} differs"


# ----------------------------------------------------------------------------- the scaling-state protocol


@pytest.mark.parametrize(("dtype", "act"), [(BF16, "gelu"), (torch.float32, "silu")], ids=str)
def test_states_come_back_through_the_gradient_exactly_as_unfused(backend, dtype, act):
    # (fp32 sees every ulp of the activation backward: the unfused ops under torch.func once ran the
    # formula where the fused backward ran the fast path, and the grad_output amax differed)
    recipe = functe.DelayedScaling(amax_history_len=4, margin=1)
    gen = torch.Generator().manual_seed(5)
    x, g, beta, w1, b1, w2, b2, _, _ = _block_args((6,), 16, 32, dtype, recipe, gen)
    params = {"g": g, "beta": beta, "w1": w1, "b1": b1, "w2": w2, "b2": b2, "w_dead": draw((4, 16), dtype, gen)}
    unused = functe.init_linear_scaling_state(recipe)  # an fp8_linear whose output nothing uses
    fresh = functe.init_linear_scaling_state(recipe)
    state = {"fc1": fresh, "fc2": functe.init_linear_scaling_state(recipe), "dead": unused}

    def model(p, s, x):
        dead = ops.fp8_linear(x, p["w_dead"], None, s["dead"], recipe=recipe)
        del dead
        return block(
            x, p["g"], p["beta"], p["w1"], p["b1"], p["w2"], p["b2"], s["fc1"], s["fc2"], recipe=recipe, act=act
        )

    results = []
    for rules in (None, RuleSet()):
        fused = functe.fuse(model, rules=rules, recipe=recipe)
        loss_fn = lambda p, s, x, fused=fused: (fused(p, s, x).float() ** 2).mean()
        s = state
        for _ in range(3):  # the delayed scales move: later steps cast with earlier steps' amaxes
            loss, grads, s = functe.value_and_grad(loss_fn)(params, s, x)
        results.append((loss, grads, s))
    (loss, grads, s), (loss_u, grads_u, s_u) = results
    assert torch.equal(loss, loss_u)
    for a, b in zip(_leaves(s), _leaves(s_u)):
        assert torch.equal(a, b)
    for a, b in zip(_leaves(s["dead"]), _leaves(unused)):  # the graph never reached it: kept, not rolled
        assert torch.equal(a, b)
    assert not torch.equal(s["fc1"].input.amax_history, fresh.input.amax_history)
    for key in params:
        assert_close(grads[key], grads_u[key], msg=key)  # (backward_add_norm rounds dx once: not bitwise)


def test_a_returned_but_unused_fp8_output_keeps_its_state_as_unfused():
    # The fused op materialised a zero cotangent for every output, so the side layer's backward ran
    # with dy = 0 and reported its state as used: its input and weight states rolled (unfused: kept).
    recipe = functe.DelayedScaling(amax_history_len=4)
    total = functe.opaque(torch.sum)

    def model(p, s, x):
        main = ops.fp8_linear(x, p["w"], None, s["main"], recipe=recipe)
        side = ops.fp8_linear(x, p["w_side"], None, s["side"], recipe=recipe)
        return main, side

    fused = functe.fuse(model, recipe=recipe)
    gen = torch.Generator().manual_seed(6)
    p = {"w": draw((8, 16), torch.float32, gen), "w_side": draw((8, 16), torch.float32, gen)}
    s = {k: functe.init_linear_scaling_state(recipe) for k in ("main", "side")}
    x = draw((4, 16), torch.float32, gen)
    results = [functe.value_and_grad(lambda p, s, x, f=f: total(f(p, s, x)[0]))(p, s, x) for f in (model, fused)]
    (_, grads, states), (_, grads_f, states_f) = results
    for a, b in zip(_leaves(states), _leaves(states_f)):
        assert torch.equal(a, b)
    assert torch.equal(grads["w"], grads_f["w"])
    for a, b in zip(_leaves(states["side"]), _leaves(s["side"])):
        assert torch.equal(a, b)  # never reached: kept
    assert grads_f["w_side"] is None or not grads_f["w_side"].any()
    tracked = {k: v.clone().requires_grad_() for k, v in p.items()}
    main, _ = fused(tracked, s, x)
    (g,) = torch.autograd.grad(main.sum(), [tracked["w"]])  # plain autograd: the side output unused
    assert torch.equal(g, grads_f["w"])


@pytest.mark.parametrize("act", ["silu", "qgelu"])
def test_fp32_activation_between_fp8_linears_is_bitwise_under_every_api(act):
    # fp8_linear -> act -> fp8_linear in fp32: the fused dact+dbias(+cast) backward, the unfused ops
    # under torch.func (value_and_grad) and under plain autograd must agree to the bit, in the bias
    # gradient and in the grad_output amax. Small recorded twin calls used to run the activation's
    # formula, which rounds differently from its fast path (aten.silu_backward).
    recipe = functe.DelayedScaling(amax_history_len=1)
    total = functe.opaque(lambda y, dy: (y * dy).sum())

    def loss_fn(p, s, x, dy):
        h = ops.activation(ops.fp8_linear(x, p["w1"], p["b1"], s["fc1"], recipe=recipe), act)
        return total(ops.fp8_linear(h, p["w2"], None, s["fc2"], recipe=recipe), dy)

    fused = functe.fuse(loss_fn, recipe=recipe)
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        p = {"w1": draw((16, 16), torch.float32, gen), "b1": draw((16,), torch.float32, gen)}
        p["w2"] = draw((16, 16), torch.float32, gen)
        x, dy = draw((4, 16), torch.float32, gen), draw((4, 16), torch.float32, gen)
        s = {k: functe.init_linear_scaling_state(recipe) for k in ("fc1", "fc2")}
        _, grads, states = functe.value_and_grad(loss_fn)(p, s, x, dy)
        _, grads_f, states_f = functe.value_and_grad(fused)(p, s, x, dy)
        tracked = {k: v.clone().requires_grad_() for k, v in p.items()}
        grads_a = dict(zip(p, torch.autograd.grad(loss_fn(tracked, s, x, dy), list(tracked.values()))))
        for k in p:
            assert torch.equal(grads[k], grads_f[k]) and torch.equal(grads[k], grads_a[k]), (seed, k)
        for a, b in zip(_leaves(states), _leaves(states_f)):
            assert torch.equal(a, b), seed


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
def test_a_separate_bias_op_keeps_the_unfused_bits_on_the_cpu(dtype):
    # linear -> bias -> relu and linear -> bias -> + r: the CPU fused ops passed the bias to the GEMM
    # (one rounding) where the unfused chain rounds the GEMM result first (differences up to 0.03).
    gen = torch.Generator().manual_seed(4)
    x, w, b, r = (draw(s, dtype, gen) for s in ((8, 32), (16, 32), (16,), (8, 16)))
    for fn, rule in [
        (lambda x, w, b, r: ops.relu(ops.bias(ops.linear(x, w), b)) + r, "forward_linear_bias_op_activation"),
        (lambda x, w, b, r: ops.bias(ops.linear(x, w), b) + r, "forward_linear_bias_op_add"),
    ]:
        fused = functe.fuse(fn)
        args = [t.clone().requires_grad_() for t in (x, w, b, r)]
        with functe.use_backend("torch"):
            got, want = fused(*args), fn(*args)
            assert rule in fused.plan(*args).stats["forward"].fired
            assert torch.equal(got, want)
            ct = draw(got.shape, dtype, gen)
            for a, e in zip(torch.autograd.grad(got, args, ct), torch.autograd.grad(want, args, ct)):
                assert torch.equal(a, e)


def test_vmap_of_value_and_grad_keeps_one_state_per_member():
    recipe = functe.DelayedScaling(amax_history_len=4)
    gen = torch.Generator().manual_seed(2)
    x, g, beta, w1, b1, w2, b2, s1, s2 = _block_args((4,), 16, 16, torch.float32, recipe, gen)
    fused = functe.fuse(lambda *a: block(*a, recipe=recipe))
    loss_fn = lambda p, s, x: fused(x, *p, *s).square().mean()
    members = torch.stack([x, 3 * x])
    states = functe.tree_map(lambda t: torch.stack([t, t]), (s1, s2))
    losses, _, next_states = torch.func.vmap(functe.value_and_grad(loss_fn), in_dims=(None, 0, 0))(
        (g, beta, w1, b1, w2, b2), states, members
    )
    for i in range(2):
        loss_i, _, state_i = functe.value_and_grad(loss_fn)((g, beta, w1, b1, w2, b2), (s1, s2), members[i])
        assert_close(losses[i], loss_i)
        for a, b in zip(_leaves(next_states), _leaves(state_i)):
            assert_close(a[i], b)
    assert fused.trace_count == 1


_PER_MEMBER_PROGRAMS = {
    # the activation q-in (ACT_OUTPUT_CAST_AMAX) and the backward dact + dbias + cast
    # (DACT_OUTPUT_DBIAS_CAST_AMAX), per-tensor FP8; NVFP4's activation q-in (ACT_OUTPUT_AMAX)
    "swiglu_q_in": (lambda p, s, x, seed: ops.fp8_linear(ops.swiglu(x), p["w"], p["b"], s, recipe=DELAYED), 32),
    "qgelu_dact": (
        lambda p, s, x, seed: ops.activation(ops.fp8_linear(x, p["w"], p["b"], s, recipe=DELAYED), "qgelu"),
        16,
    ),
    "nvfp4_swiglu_q_in": (
        lambda p, s, x, seed: ops.fp8_linear(
            ops.swiglu(x), p["w"], p["b"], None, recipe=functe.NVFP4BlockScaling(), seed=seed
        ),
        32,
    ),
}


def _member(tree, i: int):
    return None if tree is None else functe.tree_map(lambda t: t[i], tree)


@pytest.mark.parametrize("name", list(_PER_MEMBER_PROGRAMS))
def test_vmapped_fused_fp8_activations_give_each_member_its_unbatched_bits(name):
    # These kernels' amaxes are per member: they vmapped their twins' formulas, which round h or
    # g = dy·act'(z) differently from the activation's row-batched fast path, so the next scale came
    # out an ulp off the unfused program's (qgelu: 19 of 20 seeds). They now run once per member.
    fn, width = _PER_MEMBER_PROGRAMS[name]
    members, stateless = 3, name.startswith("nvfp4")
    results = {}
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        k = width // 2 if "swiglu" in name else width
        params = {"w": torch.randn(members, 16, k, generator=gen) / 3, "b": torch.randn(members, 16, generator=gen) / 8}
        x = torch.randn(members, 5, width, generator=gen) * 2
        cotangent = torch.randn(5, 16, generator=gen)
        states = (
            None
            if stateless
            else functe.tree_map(
                lambda *t: torch.stack(t), *[functe.init_linear_scaling_state(DELAYED) for _ in range(members)]
            )
        )
        seeds = torch.arange(members)
        fused = functe.fuse(fn)
        for label, f in (("unfused", fn), ("fused", fused)):
            step = functe.value_and_grad(
                lambda p, s, x, seed, f=f, ct=cotangent: (f(p, s, x, seed) * ct).sum(), check=False
            )
            in_dims = (0, None if stateless else 0, 0, 0)
            batched = torch.func.vmap(step, in_dims=in_dims, out_dims=(0, 0, None) if stateless else 0)(
                params, states, x, seeds
            )
            results[label] = batched
        # (the unfused program's own batched reductions may not: fp8_linear's bias gradient, a
        # vmapped column sum, differed from the per-member calls by an ulp)
        step = functe.value_and_grad(
            lambda p, s, x, seed, f=fused, ct=cotangent: (f(p, s, x, seed) * ct).sum(), check=False
        )
        for i in range(members):
            alone = step(*(_member(a, i) for a in (params, states, x, seeds)))
            for got, expected in zip(functe.tree_leaves(results["fused"]), functe.tree_leaves(alone)):
                if got is not None:
                    assert torch.equal(got[i], expected), (name, seed, i)
        fired = fused.plan(*(_member(a, 0) for a in (params, states, x, seeds))).stats
        assert any(fired[phase].fired for phase in ("forward", "backward")), name
        if not stateless:  # (the next scaling states: fused and unfused alike)
            for got, expected in zip(
                functe.tree_leaves(results["fused"][2]), functe.tree_leaves(results["unfused"][2])
            ):
                assert torch.equal(got, expected), (name, seed)


def test_a_vmap_over_many_members_vmaps_the_per_member_kernels_twins():
    # Above PerMember's 16 members (per-example gradients) one vmapped call replaces the launches.
    fn, _ = _PER_MEMBER_PROGRAMS["qgelu_dact"]
    members, gen = 17, torch.Generator().manual_seed(5)
    params = {"w": torch.randn(members, 16, 16, generator=gen) / 3, "b": torch.randn(members, 16, generator=gen)}
    x = torch.randn(members, 5, 16, generator=gen)
    states = functe.tree_map(lambda *t: torch.stack(t), *[functe.init_linear_scaling_state(DELAYED)] * members)
    got = {}
    for label, f in (("unfused", fn), ("fused", functe.fuse(fn))):
        step = functe.value_and_grad(lambda p, s, x, f=f: f(p, s, x, None).square().sum(), check=False)
        got[label] = torch.func.vmap(step)(params, states, x)
    for a, b in zip(functe.tree_leaves(got["fused"]), functe.tree_leaves(got["unfused"])):
        assert_close(a, b)


# ----------------------------------------------------------------------------- the residual contract


@pytest.mark.parametrize("recipe", [None, DELAYED, CURRENT])
def test_forward_fusions_return_exactly_the_covered_ops_residuals(recipe):
    """TE's equivalence contract: a forward fusion's residuals are what the unfused forwards return."""
    gen = torch.Generator().manual_seed(4)
    args = _block_args((5,), 16, 32, BF16, recipe, gen)
    program = lambda *a: block(*a, recipe=recipe)
    plan = functe.fuse(program).plan(*args)
    tensors = [t for t in functe.tree_leaves(args) if isinstance(t, torch.Tensor)]
    # (forward_linear_add's GEMM with a bias rounds once: not bitwise)
    checked = check_forward_residuals(plan, tensors, not_bitwise=("forward_linear_add",))
    assert checked == 2  # (the q-in pair, or linear+activation and linear+add)


# ----------------------------------------------------------------------------- dispatch: Triton GEMMs where they pay


class _Spy:
    """Records which kernels a fused op calls (wrapping module globals of functe.ops._fused)."""

    NAMES = ("GEMM", "GEMM_PREACT", "GEMM_DGRAD", "GEMM_DGRAD_DACT", "GEMM_WGRAD", "GEMM_WGRAD_DBIAS", "DACT_DBIAS")

    def __init__(self, monkeypatch):
        self.calls = []
        for name in self.NAMES:
            kernel = getattr(_fused, name)
            monkeypatch.setattr(_fused, name, self._wrap(name, kernel))

    def _wrap(self, name, kernel):
        def call(*args):
            self.calls.append(name)
            return kernel(*args)

        return call

    def take(self):
        calls, self.calls = self.calls, []
        return calls


def _step(fn, args):
    leaves = [a.detach().requires_grad_() for a in args]
    out = fn(*leaves)
    out = out[0] if isinstance(out, tuple) else out
    torch.autograd.grad(out, leaves, torch.ones_like(out))


def test_cuda_dispatch_decisions_through_the_interpreter(monkeypatch):
    spy = _Spy(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    x, w, b = draw((3, 8), BF16, gen), draw((6, 8), BF16, gen), draw((6,), BF16, gen)
    wide = draw((6, 80), BF16, gen)
    with functe.use_backend("interpret"):  # what a GPU runs
        _step(functe.fuse(lambda *a: linear_act(*a, act="relu")), (x, w, b))
        assert spy.take() == ["GEMM_PREACT", "GEMM_DGRAD_DACT", "GEMM_WGRAD_DBIAS"]  # relu: prologue pays
        _step(functe.fuse(lambda *a: linear_act(*a, act="gelu")), (draw((3, 80), BF16, gen), wide, b))
        assert spy.take() == ["GEMM_PREACT", "GEMM_DGRAD", "GEMM_WGRAD_DBIAS"]  # gelu, K = 80 > 64: it does not
        _step(functe.fuse(lambda *a: linear_act(*a, act="gelu")), (x, w, b))
        assert spy.take() == ["GEMM_PREACT", "GEMM_DGRAD_DACT", "GEMM_WGRAD_DBIAS"]  # one column block: it does
        _step(functe.fuse(lambda x, w, b, r: ops.linear(x, w, b) + r), (x, w, b, draw((3, 6), BF16, gen)))
        assert spy.take() == ["GEMM"]  # bias and residual in one epilogue (the backward is unfused)
        fp32 = [t.float() for t in (x, w, b)]
        _step(functe.fuse(lambda *a: linear_act(*a, act="gelu")), fp32)
        assert spy.take() == ["DACT_DBIAS"]  # fp32 GEMMs stay with torch; dact + dbias in one Triton pass
    _step(functe.fuse(lambda *a: linear_act(*a, act="gelu")), (x, w, b))  # CPU: BLAS and the twins
    assert spy.take() == ["DACT_DBIAS"]


# ----------------------------------------------------------------------------- transforms and compile


def test_torch_func_transforms_through_the_phase2_rules():
    args = [make((4, 6), F64), make((6,), F64), make((6,), F64), make((8, 6), F64), make((8,), F64)]
    args += [make((6, 8), F64), make((6,), F64), None, None]
    fn = lambda *a: block(*a, None, None, recipe=None, act="silu")
    fused = functe.fuse(fn)
    assert {r for s in fused.plan(*args[:7]).stats.values() for r in s.fired} == {
        "forward_linear_bias_add",
        "backward_linear_bias_activation",
        "backward_add_norm",
    }
    check_transforms(fused, fn, args[:7], higher_order=False)


def test_compile_the_fused_bf16_block_with_autograd_outside():
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(1)
    args = [a.requires_grad_() for a in _block_args((4,), 8, 16, BF16, None, gen)[:7]]
    fused = functe.fuse(lambda *a: block(*a, None, None, recipe=None))
    loss = lambda *a: fused(*a).float().square().sum()
    expected = torch.autograd.grad(loss(*args), args)
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(*args), args)
    for g, e in zip(got, expected):
        assert torch.equal(g, e)
    assert fused.trace_count == 1
    torch._dynamo.reset()


@pytest.mark.parametrize("recipe", [DELAYED, CURRENT], ids=["delayed", "current"])
def test_fp8_fusions_equal_the_unfused_program_on_both_backends(recipe, backend):
    gen = torch.Generator().manual_seed(8)
    args = _block_args((3,), 16, 32, BF16, recipe, gen)
    program = lambda *a: block(*a, recipe=recipe, act="relu", kind="rms")
    fused = functe.fuse(program, rules=RuleSet(r for r in DEFAULT_RULES if r.name != "backward_add_norm"))
    fired = {r for s in fused.plan(*args).stats.values() for r in s.fired}
    assert {"forward_norm_quantize", "forward_activation_quantize", "backward_fp8_linear_activation"} <= fired
    ct = draw((3, 16), BF16, gen)
    got, expected = _vjp_all(fused, args, ct), _vjp_all(functe.fuse(program, rules=RuleSet()), args, ct)
    for i, (a, e) in enumerate(zip(_leaves(got), _leaves(expected))):
        assert torch.equal(a, e), f"leaf {i} differs"


# ----------------------------------------------------------------------------- the fused ops on their own


def _standalone_cases(dtype):
    gen = torch.Generator().manual_seed(11)
    x, w, b, g, beta = (
        draw((5, 8), dtype, gen),
        draw((6, 8), dtype, gen),
        draw((6,), dtype, gen),
        draw((8,), dtype, gen),
        draw((8,), dtype, gen),
    )
    h = draw((5, 6), dtype, gen)
    yield (
        "forward_linear_activation",
        lambda x, w, b: _fused.forward_linear_activation(x, w, b, activation="silu", bias_op=False),
        lambda x, w, b: linear_act(x, w, b, act="silu"),
        (x, w, b),
    )
    yield (
        "forward_linear_activation bias_op",
        lambda x, w, b: _fused.forward_linear_activation(x, w, b, activation="relu", bias_op=True),
        lambda x, w, b: linear_bias_op_act(x, w, b, act="relu"),
        (x, w, b),
    )
    yield (
        "backward_linear_activation",
        lambda x, w, b: _fused.backward_linear_activation(x, w, b, activation="gelu"),
        linear_act,
        (x, w, b),
    )
    yield (
        "backward_activation_bias",
        lambda h, b: _fused.backward_activation_bias(h, b, activation="silu"),
        bias_act,
        (h, b),
    )
    for kind in ("layer", "rms"):
        yield (
            f"backward_add_norm {kind}",
            lambda x, g, beta, kind=kind: _fused.backward_add_norm(
                x, g, beta if kind == "layer" else None, kind=kind, eps=1e-5, zero_centered_gamma=False
            )[::-1],
            lambda x, g, beta, kind=kind: add_norm(x, g, beta, kind=kind),
            (x, g, beta),
        )


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_every_fused_op_is_an_op_of_its_own(dtype):
    for name, fused_op, unfused, args in _standalone_cases(dtype):
        out, pull = torch.func.vjp(fused_op, *args)
        ref, pull_ref = torch.func.vjp(unfused, *args)
        cts = tuple(torch.randn_like(o) for o in out) if isinstance(out, tuple) else torch.randn_like(out)
        for a, e in zip(functe.tree_leaves((out, pull(cts))), functe.tree_leaves((ref, pull_ref(cts)))):
            assert (a is None) == (e is None), name
            if a is not None:
                assert_close(a, e, dtype=torch.float16 if dtype == torch.float32 else dtype, msg=name)


@pytest.mark.parametrize("recipe", [DELAYED, CURRENT], ids=["delayed", "current"])
def test_every_fused_fp8_op_is_an_op_of_its_own(recipe):
    gen = torch.Generator().manual_seed(12)
    x, g, beta, w1, b1, w2, _, s1, s2 = _block_args((5,), 16, 16, torch.float32, recipe, gen)
    cases = [
        (
            lambda x, g, beta, w, b, s: _fused_fp8.forward_norm_fp8_linear(
                x, g, beta, w, b, s, kind="layer", eps=1e-5, zero_centered_gamma=False, recipe=recipe
            ),
            lambda x, g, beta, w, b, s: ops.fp8_linear(ops.layer_norm(x, g, beta), w, b, s, recipe=recipe),
            (x, g, beta, w1, b1, s1),
        ),
        (
            lambda x, w, b, s: _fused_fp8.forward_activation_fp8_linear(
                x, w, b, s, name="gelu", limit=0.0, alpha=0.0, offset=0.0, recipe=recipe
            ),
            lambda x, w, b, s: ops.fp8_linear(ops.gelu(x), w, b, s, recipe=recipe),
            (x, w2, None, s2),
        ),
        (
            lambda x, w, b, s: _fused_fp8.backward_fp8_linear_activation(
                x, w, b, s, None, activation="relu", recipe=recipe
            ),
            lambda x, w, b, s: ops.relu(ops.fp8_linear(x, w, b, s, recipe=recipe)),
            (x, w1, b1, s1),
        ),
    ]
    for fused_op, unfused, args in cases:
        ct = torch.randn(5, 16)
        got, expected = _vjp_all(fused_op, list(args), ct), _vjp_all(unfused, list(args), ct)
        for a, e in zip(_leaves(got), _leaves(expected)):
            assert torch.equal(a, e)
    with pytest.raises(functe.RecipeError, match="per-tensor recipes only"):
        _fused_fp8.forward_activation_fp8_linear(
            x, w2, None, None, name="gelu", limit=0.0, alpha=0.0, offset=0.0, recipe=MXFP8
        )


# ----------------------------------------------------------------------------- no host synchronisation; CUDA graphs


def test_cached_phase2_calls_never_read_tensor_data_on_the_host():
    from test_fuse import _SyncRecorder

    gen = torch.Generator().manual_seed(9)
    for recipe, dtype in [(None, BF16), (DELAYED, BF16), (CURRENT, torch.float32)]:
        args = _block_args((4,), 16, 32, dtype, recipe, gen)
        args[:7] = [a.requires_grad_() for a in args[:7]]
        fused = functe.fuse(lambda *a, recipe=recipe: block(*a, recipe=recipe, act="gelu"))
        tensors = args[:7]
        torch.autograd.grad(fused(*args).float().sum(), tensors)  # trace and plan
        recorder = _SyncRecorder()
        with recorder:
            out = fused(*args)
            torch.autograd.grad(out, tensors, torch.ones_like(out))
            with torch.no_grad():
                fused(*args)
        assert recorder.seen == [], recipe
        assert fused.trace_count == 1


class _HostTensors(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every aten op given a CPU tensor: on a GPU, a CPU constant reaching a device op is
    copied from pageable host memory, a synchronisation that CUDA-graph capture refuses."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(isinstance(a, torch.Tensor) and a.is_cpu for a in torch.utils._pytree.tree_leaves((args, kwargs))):
            self.seen.append(str(func))
        return func(*args, **kwargs)


@pytest.mark.parametrize("recipe", [CURRENT, DELAYED, functe.MXFP8BlockScaling()], ids=lambda r: type(r).__name__)
def test_quantized_steps_off_the_cpu_use_no_host_constants(recipe):
    # (meta tensors stand for a GPU's: no CPU tensor may reach an op; current scaling's amax pass
    # used a CPU scale of 1 moved with .to(device) in every quantizing cast)
    def rand(*shape):
        return torch.empty(*shape, device="meta", dtype=BF16, requires_grad=True)

    x, w1, b1, w2, g = rand(32, 64), rand(64, 64), rand(64), rand(64, 64), rand(64)
    states = [functe.init_linear_scaling_state(recipe, device="meta") for _ in range(2)]
    leaves = [x, w1, b1, w2, g] + [t.requires_grad_() for t in torch.utils._pytree.tree_leaves(states) if t is not None]

    def step(x, w1, b1, w2, g, states):
        h = ops.fp8_linear(ops.rms_norm(x, g), w1, b1, states[0], recipe=recipe)
        return ops.fp8_linear(ops.gelu(h), w2, None, states[1], recipe=recipe)

    for fn in (step, functe.fuse(step)):
        recorder = _HostTensors()
        with recorder:
            y = fn(x, w1, b1, w2, g, states)
            torch.autograd.grad(y.float().sum(), leaves)
        assert recorder.seen == [], recorder.seen


def test_a_state_cotangents_use_count_is_made_on_the_device():
    # (torch.as_tensor(1.0, device="cuda") copies a host tensor: a synchronisation in every
    # delayed-scaling backward, as_cotangent's use count)
    from torch._subclasses.fake_tensor import FakeTensorMode

    from functe._fp8_state import use_count

    with FakeTensorMode():
        history = torch.zeros(4, device="cuda")
        recorder = _HostTensors()
        with recorder:
            counts = [use_count(1.0, history), use_count(0, history)]
        assert [c.device.type for c in counts] == ["cuda", "cuda"] and counts[0].shape == (1,)
    assert recorder.seen == [], recorder.seen
    assert use_count(2, torch.zeros(3)).tolist() == [2.0]


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", [None, DELAYED], ids=["bf16", "fp8-delayed"])
def test_cuda_graph_capture_of_a_fused_training_step(recipe):
    """The bf16 block (epilogue, dact prologue/wgrad+dbias, add+norm) or its FP8 version (q-in, dact+dbias+cast)
    captured whole in one CUDA graph: possible only without host synchronisation."""
    gen = torch.Generator().manual_seed(10)
    args = _block_args((256,), 256, 1024, BF16, recipe, gen)
    args = [None if a is None else functe.tree_map(lambda t: t.cuda(), a) for a in args]
    params = [a.requires_grad_() for a in args[:7]]
    fused = functe.fuse(lambda *a: block(*a, recipe=recipe))
    assert_graph_replay_matches(lambda: fused(*params, *args[7:]).float().square().sum(), params)
    assert fused.trace_count == 1


@pytest.mark.parametrize("recipe", [DELAYED, CURRENT], ids=["delayed", "current"])
def test_fp8_fusions_on_the_native_fp8_gemm_path(recipe, monkeypatch):
    """The GPU's FP8 path (float8 storage, torch._scaled_mm), run on the CPU as test_fp8_linear does:
    the fused ops feed float8 operands from their own kernels and equal the unfused program."""
    from functe import _fp8_gemm

    gen = torch.Generator().manual_seed(13)
    args = _block_args((16,), 32, 64, BF16, recipe, gen)  # every GEMM dim a multiple of 16
    program = lambda *a: block(*a, recipe=recipe, act="gelu")
    ct = draw((16, 32), BF16, gen)
    monkeypatch.setattr(_fp8_gemm, "_native_device", lambda device: True)
    real, operands = torch._scaled_mm, []
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: operands.append(a[0].dtype) or real(*a, **k))
    fused = functe.fuse(program, rules=RuleSet(r for r in DEFAULT_RULES if r.name != "backward_add_norm"))
    fused.plan(*args)  # (tracing runs the forward rules on meta tensors)
    operands.clear()
    got = _vjp_all(fused, args, ct)
    assert len(operands) == 6 and set(operands) == {torch.float8_e4m3fn, torch.float8_e5m2}
    expected = _vjp_all(functe.fuse(program, rules=RuleSet()), args, ct)
    for i, (a, e) in enumerate(zip(_leaves(got), _leaves(expected))):
        assert torch.equal(a, e), f"leaf {i} differs"


@pytest.mark.parametrize("recipe", [functe.DelayedScaling(amax_history_len=2), functe.CurrentScaling()], ids=str)
def test_forward_mode_through_a_fused_norm_cast_refuses_as_unfused(recipe):
    # The fused norm + FP8 cast kernel was not marked as quantizing: jvp through the fused program
    # differentiated its rounding silently where the unfused program raises.
    state = functe.init_linear_scaling_state(recipe)
    model = lambda x, g, w: ops.fp8_linear(ops.rms_norm(x, g), w, None, state, recipe=recipe)
    fused = functe.fuse(model, recipe=recipe)
    x, g, w = make((4, 16)), make((16,)), make((16, 16))
    assert fused.plan(x, g, w).stats["forward"].fired == {"forward_norm_quantize": 1}
    # (each error names what the user called: the op, or the fused program, before the kernel)
    for fn, called in ((model, r"functe\.fp8_linear"), (fused, r"functe\.fuse\(<lambda>\)")):
        with pytest.raises(functe.TransformError, match=rf"^{called}: functe\.\w+: forward-mode derivatives"):
            torch.func.jvp(lambda x, fn=fn: fn(x, g, w), (x,), (torch.ones_like(x),))
