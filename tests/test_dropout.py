"""Dropout: the mask matches its specification bit for bit on the Triton kernel and the twin,
statistics, scaling, reproducibility, transforms, compile, errors."""

from __future__ import annotations

import math
import threading

import pytest
import torch
import torch._dynamo.testing
from helpers import F64, FLOATS, check_transforms, gradchecks, make

import functe
from functe import ops
from functe.kernels import dropout as dk

SHAPES = [(37,), (2, 13), (32, 1, 32), (0, 13)]
SEEDS = [0, 1, -5, 2**40 + 3, 2**63 - 1]


def _spec_keep(seed: int, n: int, p: float) -> torch.Tensor:
    """The mask from the written specification, one element at a time in Python integers."""
    return torch.tensor([dk.keep_int(seed, i, p) for i in range(n)], dtype=torch.bool)


@pytest.mark.parametrize("dtype", [*FLOATS, F64])
@pytest.mark.parametrize("p", [1 / 16, 0.5, 0.75])
def test_kernel_twin_and_specification_agree_bit_for_bit(p, dtype):
    """The masks agree exactly, and so do the values (the interpreter's fp32 -> bf16 cast is patched to
    round to nearest even, as a GPU does: kernels/_triton.py)."""
    for shape in SHAPES:
        for seed in SEEDS[:3] if len(shape) > 2 else SEEDS:
            x = make(shape, dtype)
            s = torch.tensor(seed)
            with functe.use_backend("interpret"):
                y_triton = ops.dropout(x, p, seed=s)
            with functe.use_backend("torch"):
                y_fast = ops.dropout(x, p, seed=s)  # the chunked CPU path
                y_functional = dk.dropout_ref(x.clone().requires_grad_(), s, p).detach()  # the transformable path
            keep = _spec_keep(seed, x.numel(), p).view(shape)
            expected = torch.where(keep, (x.to(dk.compute_dtype(dtype)) * dk.scale(p)).to(dtype), 0.0).to(dtype)
            for name, y in (("triton", y_triton), ("twin", y_fast), ("twin functional", y_functional)):
                where = f"{name} p={p} {shape} seed={seed}"
                assert y.dtype == dtype and torch.equal(y != 0, keep & (x != 0)), where
                assert torch.equal(y, expected), where


def test_kept_fraction_z_test_and_independence():
    """TE's statistical check (|z| < 2.58) on the kept fraction, and no correlation with the
    neighbouring element or with the next seed."""
    n = 1 << 17
    for p, seed in ((1 / 16, 11), (0.5, 12), (0.75, 13)):
        # (the kernel's masks equal the twin's bit for bit, test above: the interpreter's 2^17-element
        # runs took 30 s of CI here for the same bits)
        for backend in ("torch",):
            with functe.use_backend(backend):
                keep = ops.dropout(torch.ones(n), p, seed=seed) != 0
                other = ops.dropout(torch.ones(n), p, seed=seed + 1) != 0
            q = 1 - p
            z = (keep.float().mean().item() - q) / math.sqrt(p * q / n)
            assert abs(z) < 2.58, (p, backend, z)
            # P(both kept) = q² for independent masks
            for a, b, what in ((keep[1:], keep[:-1], "neighbour"), (keep, other, "next seed")):
                both = (a & b).float().mean().item()
                z = (both - q * q) / math.sqrt(q * q * (1 - q * q) / a.numel())
                assert abs(z) < 2.58 * 1.5, (p, backend, what, z)


def test_scaling_reproducibility_and_seed_forms(backend):
    x = make((64, 33), torch.float32)
    y = ops.dropout(x, 0.2, seed=123)
    kept = y != 0
    assert torch.equal(y[kept], x[kept] * torch.tensor(1 / 0.8, dtype=torch.float32))
    assert torch.equal(y, ops.dropout(x, 0.2, seed=123))
    assert torch.equal(y, ops.dropout(x, 0.2, seed=torch.tensor(123)))
    assert not torch.equal(y, ops.dropout(x, 0.2, seed=124))
    # the mask depends on the logical (row-major) index, not on the memory layout
    xt = x.t().contiguous().t()
    assert torch.equal(ops.dropout(xt, 0.2, seed=123), y)


def test_p_zero_is_the_identity():
    x = make((5, 7), torch.float32)
    assert torch.equal(ops.dropout(x, 0.0, seed=1), x)
    assert torch.equal(torch.func.grad(lambda x: (ops.dropout(x, 0, seed=1) * 3).sum())(x), torch.full_like(x, 3.0))
    # the result was the caller's x itself: an op donated it (in_place=True) and wrote the caller's
    # tensor, where identity's or reshape's result is not written
    before = x.clone()
    out = ops.add_extra_input(torch.ones(5, 7), ops.dropout(x, 0.0, seed=1), in_place=True)
    assert torch.equal(x, before) and torch.equal(out, before + 1)
    assert torch.equal(functe.fuse(lambda x: 2.0 * ops.dropout(x, 0.0, seed=1))(x), 2.0 * before)  # (traced: no op)
    # (a sparse x was returned as it is; every other p, and every other op, failed inside torch)
    dense = r"functe\.dropout: argument 'x' expected a dense tensor, got a sparse_coo f32\[5,7\]"
    with pytest.raises(functe.ArgumentError, match=dense):
        ops.dropout(x.to_sparse(), 0.0, seed=1)


def test_a_zero_dim_input_under_forward_mode_meta_and_compile(backend):
    # The mask's key reshape got no shape for a 0-d seed and x: a raw TypeError from reshape()
    x = torch.tensor(0.7)
    f = lambda t: ops.dropout(t, 0.5, seed=1)
    y = f(x)
    assert y.item() in (0.0, (x / 0.5).item()) and torch.equal(torch.func.jvp(f, (x,), (torch.tensor(1.0),))[0], y)
    assert torch.equal(torch.func.jacfwd(f)(x), torch.func.grad(f)(x))
    assert f(torch.tensor(0.7, device="meta")).shape == ()
    assert torch.equal(torch.compile(f, backend="eager")(x), y)


def test_nan_and_inf_follow_torch(backend):
    """x·0 at dropped positions: NaN stays NaN, inf becomes NaN (as torch.nn.functional.dropout)."""
    x = torch.full((4096,), float("inf"))
    x[::2] = float("nan")
    y = ops.dropout(x, 0.5, seed=3)
    dropped = ~dk.dropout_ref(torch.ones(4096), torch.tensor(3), 0.5).bool()
    assert y[::2].isnan().all()
    assert y[1::2][~dropped[1::2]].isinf().all() and y[1::2][dropped[1::2]].isnan().all()


def test_backward_recomputes_the_same_mask(backend):
    x, dy = make((6, 40), torch.float32), make((6, 40), torch.float32)
    y, pull = torch.func.vjp(lambda x: ops.dropout(x, 0.3, seed=9), x)
    (dx,) = pull(dy)
    factor = ops.dropout(torch.ones_like(x), 0.3, seed=9)
    assert torch.equal(y, x * factor) and torch.equal(dx, dy * factor)
    # the op keeps only the seed (an input) as residual: second derivatives are exact (zero)
    gg = torch.func.grad(lambda x: torch.func.grad(lambda x: (ops.dropout(x, 0.3, seed=9) ** 2).sum())(x).sum())(x)
    assert torch.equal(gg, 2 * factor * factor)


def test_vmap_batched_seed_gives_each_member_its_own_mask(backend):
    x, seeds = make((3, 5, 16), torch.float32), torch.tensor([1, 2, 3])
    out = torch.vmap(lambda x, s: ops.dropout(x, 0.5, seed=s))(x, seeds)
    for i in range(3):
        assert torch.equal(out[i], ops.dropout(x[i], 0.5, seed=int(seeds[i])))
    assert not torch.equal(out[0] != 0, out[1] != 0)
    # an unbatched seed: the same function (and mask) for every member
    same = torch.vmap(lambda x: ops.dropout(x, 0.5, seed=7))(x)
    for i in range(3):
        assert torch.equal(same[i], ops.dropout(x[i], 0.5, seed=7))
    # vmap over the seed only
    masks = torch.vmap(lambda s: ops.dropout(x[0], 0.5, seed=s))(seeds)
    assert torch.equal(masks, torch.stack([ops.dropout(x[0], 0.5, seed=k) for k in (1, 2, 3)]))


def test_vmap_over_zero_members(backend):
    # the CPU fast path viewed x by the number of seeds: zero of them could not say the row length
    x, seeds = torch.ones(0, 5), torch.zeros(0, dtype=torch.int64)
    assert torch.vmap(lambda t, s: ops.dropout(t, 0.5, seed=s))(x, seeds).shape == (0, 5)
    assert torch.vmap(lambda t: ops.dropout(t, 0.5, seed=3), in_dims=0)(x).shape == (0, 5)


def test_torch_func_transforms_and_gradcheck(backend):
    x = make((3, 7), F64)
    factor = torch.where(_spec_keep(42, 21, 0.4).view(3, 7), dk.scale(0.4), 0.0).to(F64)
    check_transforms(lambda x: ops.dropout(x, 0.4, seed=42), lambda x: x * factor, [x])
    gradchecks(lambda x: ops.dropout(x, 0.4, seed=42), [x])


def test_compiled_with_a_tensor_seed_does_not_recompile_per_seed(backend):
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    fn = torch.compile(lambda x, s: ops.dropout(x, 0.5, seed=s) * 2, backend=counter, fullgraph=True)
    x = make((8, 32), torch.float32)
    for seed in (1, 2, 3):
        assert torch.equal(fn(x, torch.tensor(seed)), ops.dropout(x, 0.5, seed=seed) * 2)
    assert counter.frame_count == 1
    torch._dynamo.reset()


def test_argument_errors():
    x = torch.zeros(4)
    for p in (-0.1, 1.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"functe\.dropout: argument 'p' expected a Python number in \[0, 1\)"):
            ops.dropout(x, p, seed=0)
    with pytest.raises(ValueError, match=r"argument 'p'"):
        ops.dropout(x, True, seed=0)
    with pytest.raises(functe.DTypeError, match=r"argument 'seed' expected an i64\[\] tensor, got i32\[\]"):
        ops.dropout(x, 0.5, seed=torch.tensor(1, dtype=torch.int32))
    with pytest.raises(functe.ShapeError, match=r"argument 'seed' expected an i64\[\] tensor .*, got i64\[2\]"):
        ops.dropout(x, 0.5, seed=torch.tensor([1, 2]))
    with pytest.raises(TypeError, match=r"argument 'seed' expected a Python int or an int64 tensor, got 1.5"):
        ops.dropout(x, 0.5, seed=1.5)
    with pytest.raises(ValueError, match=r"64-bit signed integer"):
        ops.dropout(x, 0.5, seed=2**64)


def test_an_int_seed_is_a_graph_input_under_symbolic_make_fx():
    # make_fx's symbolic tracing turns an int argument into a SymInt, which was refused as "not an int"
    from torch.fx.experimental.proxy_tensor import make_fx

    x = make((8, 16), torch.float32)
    graph = make_fx(lambda x, s: ops.dropout(x, 0.5, seed=s), tracing_mode="symbolic")(x, 5)
    for seed in (5, 6):
        assert torch.equal(graph(x, seed), ops.dropout(x, 0.5, seed=seed))


def test_an_int_seed_on_meta_tensors_under_grad():
    # shape-checking a training step on meta tensors: torch.tensor(seed, device="meta") inside
    # torch.func.grad failed in torch ("attempted to call in-place operation")
    x = torch.empty(8, 16, device="meta")
    dx = torch.func.grad(lambda x: ops.dropout(x, 0.5, seed=7).sum())(x)
    assert dx.shape == x.shape and dx.device.type == "meta"


def test_a_cpu_seed_beside_x_elsewhere_is_copied_eagerly_and_named_in_a_fused_function():
    # (meta stands in for an accelerator: the same path. A trace records no copy between devices;
    # the refusal named a Tensor.to the caller never wrote and suggested functe.opaque)
    x, seed = torch.empty(4, 16, device="meta"), torch.tensor(7)
    assert ops.dropout(x, 0.5, seed=seed).device.type == "meta"
    message = r"functe\.dropout: argument 'seed' \(i64\[\] on cpu\) must be on x's device \(meta\) in a traced"
    for transform in (functe.fuse, functe.trace):
        with pytest.raises(functe.DeviceError, match=message):
            transform(lambda x, s: ops.dropout(x, 0.5, seed=s))(x, seed)
    assert functe.fuse(lambda x, s: ops.dropout(x, 0.5, seed=s))(x, seed.to("meta")).device.type == "meta"
    # a seed that is no value of the trace is copied as in eager code: a captured one, or another
    # thread's eager call while this one traces (the check looked at a process-wide flag)
    program = functe.trace(lambda x: ops.dropout(x, 0.5, seed=seed) + ops.dropout(x, 0.5, seed=seed))(x)
    assert len(program.eqns) == 3
    inside, done, eager = threading.Event(), threading.Event(), []

    def tracing(x):
        inside.set()
        done.wait(10)
        return ops.identity(x)

    tracer = threading.Thread(target=lambda: functe.trace(tracing)(torch.ones(4)))
    tracer.start()
    inside.wait(10)
    try:
        eager.append(ops.dropout(x, 0.5, seed=seed).device.type)
    finally:
        done.set()
        tracer.join()
    assert eager == ["meta"]
