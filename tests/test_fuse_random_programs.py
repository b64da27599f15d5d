"""Random programs through ``functe.fuse``: fused vs unfused, under autograd, torch.func.grad and vmap.

Hypothesis builds straight-line programs from linear (with or without bias), activations,
LayerNorm/RMSNorm, residual adds, per-feature biases, constant scales and SwiGLU, where any
earlier value may be reused (several consumers) or left unused (dead code), and returns one or two
of them. Whatever the rules do with such a program, the fused function must compute what the
unfused one does. (This search found that a rule matching dead code failed to rewrite.)
"""

from __future__ import annotations

import pytest
import torch
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


def run(program, x, ps):
    """The program on ``x`` and parameters ``ps`` with functe ops (what ``fuse`` traces)."""
    _, _, instrs, _, outs = program
    vals = [x]
    for kind, v, *rest in instrs:
        if kind == "linear":
            pi, has_bias = rest
            vals.append(ops.linear(vals[v], ps[pi], ps[pi + 1] if has_bias else None))
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


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@settings(max_examples=60, deadline=None)
@given(program=programs(), seed=st.integers(0, 2**16))
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
