"""Random programs through ``functe.fuse``: fused vs unfused, under autograd, torch.func.grad and vmap.

Hypothesis builds straight-line programs from linear (with or without bias), activations,
LayerNorm/RMSNorm, residual adds, per-feature biases, constant scales and SwiGLU, where any
earlier value may be reused (several consumers) or left unused (dead code), and returns one or two
of them. Whatever the rules do with such a program, the fused function must compute what the
unfused one does. (This search found that a rule matching dead code failed to rewrite.) With every
linear an ``fp8_linear`` (block-shaped programs, each recipe), fused and unfused agree bit for bit,
next scaling states included.
"""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from hypothesis import given, settings
from hypothesis import strategies as st

import functe
from functe import ops
from functe.testing import assert_close

ACTIVATIONS = ["gelu", "relu", "srelu", "silu", "qgelu"]


@st.composite
def programs(draw):
    """``(rows, instructions, parameter shapes, output indices)``; value 0 is the input ``x``."""
    dims = [draw(st.sampled_from([8, 16]))]
    instrs, params = [], []
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["linear", "act", "norm", "add", "scale", "bias", "swiglu"]))
        v = draw(st.integers(0, len(dims) - 1))
        d = dims[v]
        if kind == "linear":
            out, has_bias = draw(st.sampled_from([8, 16, 32])), draw(st.booleans())
            instrs.append(("linear", v, len(params), has_bias))
            params += [(out, d), (out,)] if has_bias else [(out, d)]
            dims.append(out)
        elif kind == "act":
            instrs.append(("act", v, draw(st.sampled_from(ACTIVATIONS))))
            dims.append(d)
        elif kind == "norm":
            layer = draw(st.booleans())
            instrs.append(("norm", v, len(params), layer))
            params += [(d,), (d,)] if layer else [(d,)]
            dims.append(d)
        elif kind == "add":
            same = [i for i, other in enumerate(dims) if other == d]
            instrs.append(("add", v, draw(st.sampled_from(same))))
            dims.append(d)
        elif kind == "scale":
            instrs.append(("scale", v, draw(st.sampled_from([0.5, -2.0, 3.0]))))
            dims.append(d)
        elif kind == "bias":
            instrs.append(("bias", v, len(params)))
            params.append((d,))
            dims.append(d)
        else:
            instrs.append(("swiglu", v))
            dims.append(d // 2)
    outs = sorted({len(dims) - 1, draw(st.integers(0, len(dims) - 1))})
    return draw(st.sampled_from([1, 3, 5])), dims[0], instrs, params, outs


def run(program, x, ps, dense=None):
    """The program on ``x`` and parameters ``ps`` with functe ops (what ``fuse`` traces).

    ``dense(h, w, b, i)`` computes the ``i``-th linear (default ``ops.linear``).
    """
    _, _, instrs, _, outs = program
    vals, linears = [x], 0
    for kind, v, *rest in instrs:
        if kind == "linear":
            pi, has_bias = rest
            b = ps[pi + 1] if has_bias else None
            vals.append(ops.linear(vals[v], ps[pi], b) if dense is None else dense(vals[v], ps[pi], b, linears))
            linears += 1
        elif kind == "act":
            vals.append(getattr(ops, rest[0])(vals[v]))
        elif kind == "norm":
            pi, layer = rest
            vals.append(ops.layer_norm(vals[v], ps[pi], ps[pi + 1]) if layer else ops.rms_norm(vals[v], ps[pi]))
        elif kind == "add":
            vals.append(vals[v] + vals[rest[0]])
        elif kind == "scale":
            vals.append(rest[0] * vals[v])
        elif kind == "bias":
            vals.append(vals[v] + ps[rest[0]])
        else:
            vals.append(ops.swiglu(vals[v]))
    return tuple(vals[i] for i in outs)


def _inputs(program, dtype, seed):
    rows, width, _, shapes, _ = program
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape):
        scale = shape[-1] ** -0.5 if len(shape) == 2 else 1.0  # weights keep activations O(1)
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    return draw(rows, width), [draw(*s) for s in shapes]


# Fused ops round like the unfused ones up to the order of a few fp32 operations (a scale moved
# into a GEMM's alpha, a bias added in an epilogue); the float16 entry is TE's for such results.
TOLERANCE = {torch.float64: torch.float64, torch.float32: torch.float16}


# ----------------------------------------------------------------------------- with quantized linears

RECIPES = {
    "delayed": functe.DelayedScaling(amax_history_len=8),
    "current": functe.CurrentScaling(),
    "mxfp8": functe.MXFP8BlockScaling(),
    "fp8 block": functe.Float8BlockScaling(),
    "nvfp4": functe.NVFP4BlockScaling(),
}


@st.composite
def blocks(draw):
    """Programs shaped like transformer blocks, where the FP8 rules have something to match: an
    optional norm, a linear, an optional activation (or SwiGLU), a linear back to the input width,
    an optional residual add, then up to two more instructions on any value."""
    width = draw(st.sampled_from([32, 64]))
    dims, instrs, params = [width], [], []
    if draw(st.booleans()):
        layer = draw(st.booleans())
        instrs.append(("norm", 0, len(params), layer))
        params += [(width,), (width,)] if layer else [(width,)]
        dims.append(width)
    hidden = draw(st.sampled_from([32, 64, 128]))
    for out in (hidden, None):
        if out is None:
            kind = draw(st.sampled_from(["act", "swiglu", "none"]))
            if kind == "act":
                instrs.append(("act", len(dims) - 1, draw(st.sampled_from(ACTIVATIONS))))
                dims.append(dims[-1])
            elif kind == "swiglu":
                instrs.append(("swiglu", len(dims) - 1))
                dims.append(dims[-1] // 2)
            out = width
        has_bias = draw(st.booleans())
        instrs.append(("linear", len(dims) - 1, len(params), has_bias))
        params += [(out, dims[-1]), (out,)] if has_bias else [(out, dims[-1])]
        dims.append(out)
    if draw(st.booleans()):
        instrs.append(("add", len(dims) - 1, 0))
        dims.append(width)
    for _ in range(draw(st.integers(0, 2))):
        v = draw(st.integers(0, len(dims) - 1))
        kind = draw(st.sampled_from(["act", "scale", "add"]))
        if kind == "act":
            instrs.append(("act", v, draw(st.sampled_from(ACTIVATIONS))))
        elif kind == "scale":
            instrs.append(("scale", v, draw(st.sampled_from([0.5, -2.0]))))
        else:
            instrs.append(("add", v, draw(st.sampled_from([i for i, d in enumerate(dims) if d == dims[v]]))))
        dims.append(dims[v])
    outs = sorted({len(dims) - 1, draw(st.integers(0, len(dims) - 1))})
    return draw(st.sampled_from([4, 16])), width, instrs, params, outs


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@settings(max_examples=60, deadline=None)
@given(program=st.one_of(programs(), blocks()), seed=st.integers(0, 2**16))
def test_fused_random_programs_match_unfused(program, seed, dtype):
    x, ps = _inputs(program, dtype, seed)
    fn = lambda x, ps: run(program, x, ps)
    fused = functe.fuse(fn)
    tol = TOLERANCE[dtype]

    def check(got, want, what):
        for i, (g, w) in enumerate(zip(got, want)):
            assert (g is None) == (w is None), f"{what} {i}: one side is None"
            if g is not None:
                assert_close(g, w, dtype=tol, msg=f"{what} {i}", scale_atol=True)

    def autograd(f):
        leaves = [t.clone().requires_grad_() for t in (x, *ps)]
        outs = f(leaves[0], leaves[1:])
        gen = torch.Generator().manual_seed(seed + 1)
        cts = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(dtype) for o in outs]
        return outs, torch.autograd.grad(outs, leaves, cts, allow_unused=True)

    (fused_outs, fused_grads), (outs, grads) = autograd(fused), autograd(fn)
    check(fused_outs, outs, "output")
    check(fused_grads, grads, "gradient")

    def loss(f):
        return lambda ps, x: sum((o * o).sum() for o in f(x, ps))

    fused_func = torch.func.grad(loss(fused), argnums=(0, 1))(ps, x)
    func = torch.func.grad(loss(fn), argnums=(0, 1))(ps, x)
    check([*fused_func[0], fused_func[1]], [*func[0], func[1]], "torch.func.grad")

    batch = torch.stack([x, -2 * x])
    check(torch.func.vmap(lambda x: fused(x, ps))(batch), torch.func.vmap(lambda x: fn(x, ps))(batch), "vmap")

    # gradients taken outside the vmap: every rule's backward must run there too
    def batched_loss(f):
        return lambda ps, batch: sum((o * o).sum() for o in torch.func.vmap(lambda x: f(x, ps))(batch))

    fused_outside = torch.func.grad(batched_loss(fused), argnums=(0, 1))(ps, batch)
    outside = torch.func.grad(batched_loss(fn), argnums=(0, 1))(ps, batch)
    check([*fused_outside[0], fused_outside[1]], [*outside[0], outside[1]], "grad(vmap)")

    # plain forward-mode AD (not torch.func) in a training step: inputs that require grad
    gen = torch.Generator().manual_seed(seed + 2)
    tangents = [torch.randn(t.shape, generator=gen, dtype=torch.float64).to(dtype) for t in (x, *ps)]
    _, want = torch.func.jvp(lambda x, *ps: tuple(fn(x, list(ps))), (x, *ps), tuple(tangents))
    with fwAD.dual_level():
        leaves = [t.clone().requires_grad_() for t in (x, *ps)]
        duals = [fwAD.make_dual(t, d) for t, d in zip(leaves, tangents)]
        got = [fwAD.unpack_dual(o).tangent for o in fused(duals[0], duals[1:])]
    check(got, want, "forward_ad")


@settings(max_examples=30, deadline=None)
@given(
    program=blocks(),
    recipe=st.sampled_from(list(RECIPES)),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_fused_random_quantized_programs_are_bit_identical(program, recipe, dtype, seed):
    """Every linear an ``fp8_linear``: the FP8 rules (q-in norms and activations, dact + dbias + cast)
    change no bit of the outputs, the gradients or the next scaling states."""
    recipe = RECIPES[recipe]
    x, ps = _inputs(program, dtype, seed)
    n_linears = sum(1 for ins in program[2] if ins[0] == "linear")
    gen = torch.Generator().manual_seed(seed)
    if isinstance(recipe, functe.DelayedScaling):  # states that have seen steps: scales other than 1
        states = [
            functe.LinearScalingState(
                *(functe.ScalingState(torch.tensor(s), torch.rand(8, generator=gen)) for s in (0.5, 64.0, 1024.0))
            )
            for _ in range(n_linears)
        ]
    else:
        states = [None] * n_linears

    def fn(x, ps, states):
        def dense(h, w, b, i):
            seed_arg = {"seed": torch.tensor(5 + i)} if isinstance(recipe, functe.NVFP4BlockScaling) else {}
            return ops.fp8_linear(h, w, b, states[i], recipe=recipe, **seed_arg)

        return run(program, x, ps, dense)

    fused = functe.fuse(fn, recipe=recipe)

    def autograd(f):
        leaves = [t.clone().requires_grad_() for t in (x, *ps)]
        st_ = [None if s is None else functe.tree_map(lambda t: t.clone().requires_grad_(), s) for s in states]
        st_leaves = [t for s in st_ if s is not None for t in functe.tree_leaves(s)]
        outs = f(leaves[0], leaves[1:], st_)
        cts_gen = torch.Generator().manual_seed(seed + 1)
        cts = [torch.randn(o.shape, generator=cts_gen).to(o.dtype) for o in outs]
        return outs, torch.autograd.grad(outs, leaves + st_leaves, cts, allow_unused=True)

    (fused_outs, fused_grads), (outs, grads) = autograd(fused), autograd(fn)
    for i, (a, b) in enumerate(zip([*fused_outs, *fused_grads], [*outs, *grads])):
        assert (a is None) == (b is None), f"result {i}: one side is None"
        assert a is None or torch.equal(a, b), f"result {i} differs"
