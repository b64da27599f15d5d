"""The q-in rules under the block recipes (issue 8 item 4): a norm or an activation feeding a
block-scaled linear (``fp8_linear`` with Float8BlockScaling / NVFP4BlockScaling, traced as
``block_linear``) fuses into its row-wise block cast.

Golden printouts and match counters; fused == unfused *bit for bit* (outputs and every gradient, on
the twins and the interpreted Triton kernels): the fused kernels round the producer's value to its
dtype before the block amax and cast, as the unfused producer stores it, so every GEMM operand is the
same; ``explain``; declined matches with their reasons; NVFP4's seed is an input of the fused op.
"""

from __future__ import annotations

import pytest
import torch
from fuse_helpers import check_forward_residuals, draw, vjp_wrt

import functe
from functe import ops
from functe.kernels import _act
from functe.ops import _activation as act_ops
from functe.ops import _block_linear as block_ops
from functe.ops import _fused_block
from functe.ops import _norm as norm_ops
from functe.rules import DEFAULT_RULES, RuleSet, rewrite

BF16 = torch.bfloat16
FP8B = functe.Float8BlockScaling()
NVFP4 = functe.NVFP4BlockScaling()
RECIPES = [FP8B, NVFP4]
IDS = ["fp8_block", "nvfp4"]


def norm_linear(x, g, beta, w, b, seed, *, recipe, kind="layer"):
    h = ops.layer_norm(x, g, beta) if kind == "layer" else ops.rms_norm(x, g)
    return ops.fp8_linear(h, w, b, None, recipe=recipe, seed=seed)


def act_linear(x, w, b, seed, *, recipe, act="gelu"):
    h = ops.clamped_swiglu(x, limit=2.0) if act == "clamped_swiglu" else ops.activation(x, act)
    return ops.fp8_linear(h, w, b, None, recipe=recipe, seed=seed)


def mlp(x, g, beta, w1, b1, w2, b2, s1, s2, *, recipe, act="gelu", kind="rms"):
    """The residual MLP block with block-scaled linears (fc1 after the norm, fc2 after the activation)."""
    y, skip = ops.make_extra_output(x)
    h = ops.activation(norm_linear(y, g, beta, w1, b1, s1, recipe=recipe, kind=kind), act)
    return ops.fp8_linear(h, w2, b2, None, recipe=recipe, seed=s2) + skip


def _seed(recipe, value=7):
    return torch.tensor(value) if getattr(recipe, "uses_seed", False) else None


def _rewritten(fn, *args, recipe=None):
    program = functe.trace(fn)(*args)
    new, stats = rewrite(program, DEFAULT_RULES, "forward", recipe=recipe)
    functe.check_oplist(new)
    return str(program), str(new), stats


def _vjp_all(fn, args, ct):
    """Output and the cotangents of every floating argument."""
    floating = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]
    out, cts = vjp_wrt(fn, args, ct, floating)
    return [out, *cts]


def _assert_bitwise(got, expected, what):
    assert len(got) == len(expected), what
    for i, (a, e) in enumerate(zip(got, expected)):
        assert a.dtype == e.dtype and a.shape == e.shape and torch.equal(a, e), f"{what}: result {i} differs"


def _fired(fused, args):
    return {r for s in fused.plan(*args).stats.values() for r in s.fired}


# ----------------------------------------------------------------------------- golden printouts, counters


def test_block_q_in_goldens():
    x, g, w, b = torch.zeros(4, 32), torch.zeros(32), torch.zeros(16, 32), torch.zeros(16)
    before, after, stats = _rewritten(lambda *a: norm_linear(*a, None, recipe=FP8B, kind="rms"), x, g, None, w, b)
    head = "{ lambda a:f32[4,32] b:f32[32] c:f32[16,32] d:f32[16]. let\n"
    assert before == head + (
        "    e:f32[4,32] = rms_norm[eps=1e-05 zero_centered_gamma=False] a b\n"
        "    f:f32[4,16] = block_linear[recipe=Float8BlockScaling()] e c d None\n"
        "  in (f,) }"
    )
    assert after == head + (
        "    e:f32[4,16] = forward_norm_block_linear[eps=1e-05 kind='rms' recipe=Float8BlockScaling()"
        " zero_centered_gamma=False] a b None c d None\n  in (e,) }"
    )
    assert stats.fired == {"forward_norm_block_quantize": 1} and stats.declined == []

    seed = torch.tensor(3)
    before, after, stats = _rewritten(lambda *a: act_linear(*a, recipe=NVFP4, act="swiglu"), x, w[:, :16], None, seed)
    head = "{ lambda a:f32[4,32] b:f32[16,16] c:i64[]. let\n"
    assert before == head + (
        "    d:f32[4,16] = activation[alpha=0.0 interleave=0 limit=0.0 name='swiglu' offset=0.0] a None\n"
        "    e:f32[4,16] = block_linear[recipe=NVFP4BlockScaling()] d b None c\n"
        "  in (e,) }"
    )
    assert after == head + (
        "    d:f32[4,16] = forward_activation_block_linear[alpha=0.0 limit=0.0 name='swiglu' offset=0.0"
        " recipe=NVFP4BlockScaling()] a b None c\n  in (d,) }"
    )  # the seed is an input of the fused op (never a static parameter)
    assert stats.fired == {"forward_activation_block_quantize": 1} and stats.declined == []


def test_explain_shows_the_block_rules_firing(capsys):
    gen = torch.Generator().manual_seed(0)
    args = [draw(s, BF16, gen) for s in [(4, 32), (32,), (32,), (64, 32), (64,), (32, 64), (32,)]]
    functe.explain(lambda *a: mlp(*a, recipe=NVFP4, kind="layer"), *args, torch.tensor(1), torch.tensor(2))
    out = capsys.readouterr().out
    assert "fired: forward_norm_block_quantize x1, forward_activation_block_quantize x1" in out
    assert "fired: backward_add_norm x1" in out  # (no backward rule covers block_linear)
    assert "forward_norm_block_linear[eps=1e-05 kind='layer' recipe=NVFP4BlockScaling()" in out


# ----------------------------------------------------------------------------- fused == unfused, bit for bit


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_block_q_in_equals_the_unfused_program_bit_for_bit(recipe, backend):
    """Outputs and all gradients, bf16 and fp32, both norms, elementwise/gated/clamped activations, a bias
    or none. Bit for bit: the fused kernels quantize the producer's output rounded to its dtype (what the
    unfused producer stores), and the backward runs block_linear's own rule on the same residuals."""
    gen = torch.Generator().manual_seed(1)
    interp = backend == "interpret"
    cases = [("layer", "gelu", BF16), ("rms", "swiglu", torch.float32)]
    if not interp:
        cases += [("rms", "clamped_swiglu", BF16), ("layer", "relu", torch.float32)]
    for kind, act, dtype in cases:
        rows, k, n = (4, 128, 32) if interp else (6, 160, 48)
        x, g, beta = draw((2, rows // 2, k), dtype, gen), draw((k,), dtype, gen), draw((k,), dtype, gen)
        w1, b1 = draw((n, k), dtype, gen), (draw((n,), dtype, gen) if dtype == BF16 else None)
        gated = act in ("swiglu", "clamped_swiglu")
        w2 = draw((16, n // 2 if gated else n), dtype, gen)
        h = draw((2, rows // 2, n), dtype, gen) * 2 - 1
        ct1, ct2 = draw((2, rows // 2, n), dtype, gen), draw((2, rows // 2, 16), dtype, gen)
        seed = _seed(recipe)
        for fn, args, ct, rule in [
            (lambda *a, kind=kind: norm_linear(*a, recipe=recipe, kind=kind), [x, g, beta, w1, b1, seed], ct1, "norm"),
            (lambda *a, act=act: act_linear(*a, recipe=recipe, act=act), [h, w2, None, seed], ct2, "activation"),
        ]:
            fused = functe.fuse(fn)
            assert _fired(fused, args) == {f"forward_{rule}_block_quantize"}
            got = _vjp_all(fused, args, ct)
            expected = _vjp_all(functe.fuse(fn, rules=RuleSet()), args, ct)
            _assert_bitwise(got, expected, f"{rule} {kind} {act} {dtype}")


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_the_fused_block_ops_are_ops_of_their_own(recipe):
    gen = torch.Generator().manual_seed(2)
    x, g, beta, w, b = (draw(s, BF16, gen) for s in [(5, 48), (48,), (48,), (24, 48), (24,)])
    seed = _seed(recipe)
    cases = [
        (
            lambda x, g, beta, w, b: _fused_block.forward_norm_block_linear(
                x, g, beta, w, b, seed, kind="layer", eps=1e-5, zero_centered_gamma=False, recipe=recipe
            ),
            lambda x, g, beta, w, b: norm_linear(x, g, beta, w, b, seed, recipe=recipe),
            [x, g, beta, w, b],
        ),
        (
            lambda x, w, b: _fused_block.forward_activation_block_linear(
                x, w, b, seed, name="silu", limit=0.0, alpha=0.0, offset=0.0, recipe=recipe
            ),
            lambda x, w, b: act_linear(x, w, b, seed, recipe=recipe, act="silu"),
            [x, w, b],
        ),
    ]
    ct = draw((5, 24), BF16, gen)
    for fused_op, unfused, args in cases:
        _assert_bitwise(_vjp_all(fused_op, args, ct), _vjp_all(unfused, args, ct), "standalone")


def test_nvfp4_seed_is_an_input_of_the_fused_program():
    """Same seed: the fused gradients equal the unfused ones (RHT signs and stochastic rounding drawn
    from the linear's seed, in its backward). Another seed: no retrace, other wgrad bits, still equal
    to the unfused program with that seed. The forward draws nothing."""
    gen = torch.Generator().manual_seed(3)
    x, g, beta, w, b = (draw(s, BF16, gen) for s in [(32, 32), (32,), (32,), (16, 32), (16,)])
    ct = draw((32, 16), BF16, gen)
    fn = lambda *a: norm_linear(*a, recipe=NVFP4)
    fused, unfused = functe.fuse(fn), functe.fuse(fn, rules=RuleSet())
    results = []
    for seed in (torch.tensor(11), torch.tensor(12)):
        args = [x, g, beta, w, b, seed]
        got = _vjp_all(fused, args, ct)
        _assert_bitwise(got, _vjp_all(unfused, args, ct), f"seed {int(seed)}")
        results.append(got)
    assert fused.trace_count == 1
    assert torch.equal(results[0][0], results[1][0])  # y: deterministic
    assert not torch.equal(results[0][4], results[1][4])  # dW: the wgrad copies' randomness follows the seed


# ----------------------------------------------------------------------------- declined matches


def test_block_rules_decline_with_reasons():
    x, g, w = torch.zeros(4, 32), torch.zeros(32), torch.zeros(16, 32)
    seed = torch.tensor(1)
    # a recipe given to fuse that the linear does not use
    _, _, stats = _rewritten(lambda *a: act_linear(*a, recipe=NVFP4), x, w, None, seed, recipe=FP8B)
    assert stats.fired == {} and stats.declined == [
        (
            "forward_activation_block_quantize",
            "block_linear -> f32[4,16]",
            f"block_linear uses {NVFP4!r}, not the recipe given to fuse ({FP8B!r})",
        )
    ]
    _, _, stats = _rewritten(lambda *a: act_linear(*a, recipe=NVFP4), x, w, None, seed, recipe=NVFP4)
    assert stats.fired == {"forward_activation_block_quantize": 1}
    # the interleaved gated layout
    inter = lambda x, w: ops.fp8_linear(ops.swiglu(x, interleave=4), w, None, None, recipe=FP8B)
    _, _, stats = _rewritten(inter, x, w[:, :16])
    assert stats.declined[0][0] == "forward_activation_block_quantize"
    assert stats.declined[0][2] == "interleaved gated layout: the quantizing activation kernel reads the chunked layout"

    # LayerNorm statistics used outside the match (the fused op returns only the linear's output)
    def stats_used(x, g, beta, w):
        y, mean, _ = norm_ops._layer_norm(x, g, beta, eps=1e-5, zero_centered_gamma=False)
        return ops.fp8_linear(y, w, None, None, recipe=FP8B), mean

    _, after, stats = _rewritten(stats_used, x, g, g, w)
    assert "forward_norm_block_linear" not in after
    assert stats.declined[0][2] == "the LayerNorm statistics (mean, rstd) are used outside the match"

    # the producer's output has another consumer
    def two_consumers(x, w):
        h = ops.gelu(x)
        return ops.fp8_linear(h, w, None, None, recipe=FP8B), h

    _, _, stats = _rewritten(two_consumers, x, w)
    assert stats.fired == {} and stats.declined[0][2] == "the output f32[4,32] of activation has 2 consumers"


def test_the_forward_residuals_are_the_covered_ops_residuals():
    """TE's equivalence contract for the two block fusions (see test_fuse_phase2 for the others)."""
    gen = torch.Generator().manual_seed(4)
    args = [draw(s, BF16, gen) for s in [(5, 32), (32,), (32,), (48, 32), (48,), (32, 48), (32,)]]
    args += [torch.tensor(5), torch.tensor(6)]
    plan = functe.fuse(lambda *a: mlp(*a, recipe=NVFP4, kind="layer")).plan(*args)
    assert check_forward_residuals(plan, args) == 2


ACTS = [*_act.ACTIVATIONS, *_act.GATED, "clamped_swiglu"]


@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_activation_block_linear_every_activation_bit_for_bit(recipe, backend):
    """``forward_activation_block_linear`` takes ``h`` from the quantizing kernels (``cast_act_block_keep``):
    its residuals (``h`` among them), output and every gradient equal the activation op followed by
    ``block_linear`` bit for bit, for every activation (elementwise, gated, clamped), fp32 and bf16.
    Through the interpreter the gradients of three of them (equal residuals feed the same backward
    rule; ``test_block_q_in_equals_the_unfused_program_bit_for_bit`` runs two more through fusion)."""
    gen = torch.Generator().manual_seed(5)
    seed = _seed(recipe)
    with_grads = set(ACTS) if backend == "torch" else {"srelu", "geglu", "clamped_swiglu"}
    for i, name in enumerate(ACTS):
        dtype = BF16 if i % 2 else torch.float32
        gated = name in _act.GATED or name == "clamped_swiglu"
        params = {"limit": 2.0, "alpha": 1.702, "offset": 1.0} if name == "clamped_swiglu" else dict.fromkeys(
            ("limit", "alpha", "offset"), 0.0
        )  # fmt: skip
        x = (draw((2, 3, 64 if gated else 32), dtype, gen) * 8 - 4).to(dtype)
        w, b = draw((16, 32), dtype, gen), (draw((16,), dtype, gen) if i % 3 else None)
        ct = draw((2, 3, 16), dtype, gen)

        def fused(x, w, b, name=name, params=params):
            return _fused_block.forward_activation_block_linear(x, w, b, seed, name=name, recipe=recipe, **params)

        def unfused(x, w, b, name=name, params=params):
            h = act_ops._activation(x, None, name=name, interleave=0, **params)
            return block_ops.block_linear(h, w, b, recipe=recipe, seed=seed)

        args = [x, w, b]
        if name in with_grads:
            _assert_bitwise(_vjp_all(fused, args, ct), _vjp_all(unfused, args, ct), f"{name} {dtype}")
        y, res = _fused_block.forward_activation_block_linear.fwd(x, w, b, seed, name=name, recipe=recipe, **params)
        h, act_res = act_ops._activation.fwd(x, None, name=name, interleave=0, **params)
        y_ref, lin_res = block_ops._block_linear.fwd(h, w, b, seed, recipe=recipe)
        got, expected = functe.tree_leaves((y, res)), functe.tree_leaves((y_ref, (act_res, lin_res)))
        assert len(got) == len(expected), name
        for a, e in zip(got, expected):
            assert torch.equal(a, e) if isinstance(a, torch.Tensor) else a == e, f"residual of {name} {dtype}"
