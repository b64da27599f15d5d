"""Helpers shared by the op tests: input makers and the torch.func transform suite."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
import torch.autograd.forward_ad as fwAD
from torch.func import grad, jacfwd, jacrev, jvp, vjp, vmap

import functe
from functe.testing import assert_close

F64 = torch.float64
FLOATS = [torch.float32, torch.float16, torch.bfloat16]


def make(shape, dtype=torch.float32, *, scale=1.0, device="cpu", kind="normal"):
    """A test input: normal values (negative included) times ``scale``, rounded to ``dtype``."""
    if kind == "normal":
        t = torch.randn(shape, dtype=F64) * scale
    elif kind == "zeros":
        t = torch.zeros(shape, dtype=F64)
    elif kind == "large":
        t = torch.randn(shape, dtype=F64) * 1e3
    else:
        raise ValueError(kind)
    return t.to(dtype).to(device)


def saved_storages(run) -> tuple[object, dict]:
    """``(run(), {storage pointer: shape})`` of the non-empty tensors autograd saves while ``run()`` records."""
    saved = {}

    def pack(t):
        if t.numel():
            saved[t.untyped_storage().data_ptr()] = tuple(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return out, saved


class GemmCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the matrix products (mm/addmm/bmm) dispatched while active."""

    GEMMS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm")

    def __init__(self):
        super().__init__()
        self.gemms = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.gemms += str(func).startswith(self.GEMMS)
        return func(*args, **(kwargs or {}))


def backward_gemms(fn, args, wrt) -> int:
    """How many GEMMs ``torch.autograd.grad`` of ``fn(*args).sum()`` with respect to ``wrt`` runs."""
    out = fn(*args)
    with GemmCounter() as counter:
        torch.autograd.grad(out.sum(), wrt)
    return counter.gemms


def assert_graph_replay_matches(loss, params) -> None:
    """Capture ``torch.autograd.grad(loss(), params)`` in one CUDA graph, replay it and compare with
    the eager gradients (a whole training step captures only without host synchronisation)."""
    expected = torch.autograd.grad(loss(), params)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm up (Triton compilation and autotuning, allocator) off the capture stream
            torch.autograd.grad(loss(), params)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grads = torch.autograd.grad(loss(), params)
    graph.replay()
    torch.cuda.synchronize()
    for g, e in zip(grads, expected):
        assert_close(g, e)


def as64(*tensors):
    """The float64 copies a reference computes on (from the already-rounded inputs)."""
    return tuple(None if t is None else t.detach().to("cpu", F64) for t in tensors)


def _loss(fn):
    # A non-linear scalar head, so gradients are not all ones.
    def loss(*args):
        out = fn(*args)
        outs = out if isinstance(out, tuple) else (out,)
        return sum((o * torch.sin(o)).sum() for o in outs)

    return loss


def _batched(args, size=3):
    return tuple(a.unsqueeze(0).expand(size, *a.shape) + 0.1 * torch.randn(size, *a.shape, dtype=a.dtype) for a in args)


def _same(actual, expected, what):
    if isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected), what
        for i, (a, e) in enumerate(zip(actual, expected)):
            _same(a, e, f"{what}[{i}]")
    else:
        assert_close(actual, expected, msg=what)


@contextlib.contextmanager
def twin_functions_always():
    """Route every recorded twin call through its Function (normally only large CPU tensors take it)."""
    saved = functe._kernel.TWIN_FUNCTION_MIN_ELEMENTS
    functe._kernel.TWIN_FUNCTION_MIN_ELEMENTS = 0
    try:
        yield
    finally:
        functe._kernel.TWIN_FUNCTION_MIN_ELEMENTS = saved


def _twin_routes():
    """The ways a recorded twin call can run on this backend: directly, and (CPU twins) as a Function."""
    if functe._backend.runs_triton(torch.device("cpu")):
        return (contextlib.nullcontext,)
    return (contextlib.nullcontext, twin_functions_always)


def check_transforms(fn: Callable, ref: Callable, args: Sequence[torch.Tensor], *, higher_order: bool = True):
    """Check ``fn`` against the pure-torch ``ref`` under every torch.func transform, in float64.

    Covers grad, vjp, vmap, vmap(grad) (all args batched, and only the first),
    jacrev, grad(vmap), jvp(vmap), jvp, jacfwd, plain forward_ad, and (if
    ``higher_order``) grad of grad; on the CPU twins both with twins called
    directly and with twins run as Functions.
    """
    for route in _twin_routes():
        with route():
            _check_transforms(fn, ref, args, higher_order=higher_order)


def _check_transforms(fn: Callable, ref: Callable, args: Sequence[torch.Tensor], *, higher_order: bool):
    args = tuple(a.to(F64) for a in args)
    argnums = tuple(range(len(args)))
    _same(fn(*args), ref(*args), "forward")
    _same(grad(_loss(fn), argnums=argnums)(*args), grad(_loss(ref), argnums=argnums)(*args), "grad")
    out, pull = vjp(fn, *args)
    cot = tuple(torch.randn_like(o) for o in out) if isinstance(out, tuple) else torch.randn_like(out)
    _, pull_ref = vjp(ref, *args)
    _same(pull(cot), pull_ref(cot), "vjp")
    batched = _batched(args)
    _same(vmap(fn)(*batched), vmap(ref)(*batched), "vmap")
    g = grad(_loss(fn), argnums=argnums)
    g_ref = grad(_loss(ref), argnums=argnums)
    _same(vmap(g)(*batched), vmap(g_ref)(*batched), "vmap(grad)")
    dims = (0,) + (None,) * (len(args) - 1)
    _same(
        vmap(g, in_dims=dims)(batched[0], *args[1:]),
        vmap(g_ref, in_dims=dims)(batched[0], *args[1:]),
        "vmap(grad) x only",
    )
    _same(jacrev(fn, argnums=argnums)(*args), jacrev(ref, argnums=argnums)(*args), "jacrev")

    # gradients and tangents taken outside a vmap (the op's rules must run there too)
    def grad_of_vmap(f):
        return grad(_loss(vmap(f)), argnums=argnums)(*batched)

    _same(grad_of_vmap(fn), grad_of_vmap(ref), "grad(vmap)")
    batched_tangents = tuple(torch.randn_like(b) for b in batched)
    _same(jvp(vmap(fn), batched, batched_tangents)[1], jvp(vmap(ref), batched, batched_tangents)[1], "jvp(vmap)")
    tangents = tuple(torch.randn_like(a) for a in args)
    _same(jvp(fn, args, tangents)[1], jvp(ref, args, tangents)[1], "jvp")
    _same(forward_ad_tangents(fn, args, tangents), jvp(ref, args, tangents)[1], "forward_ad")
    _same(jacfwd(fn, argnums=argnums)(*args), jacfwd(ref, argnums=argnums)(*args), "jacfwd")
    if higher_order:

        def gsum(f):
            return lambda *a: sum(t.sum() for t in grad(_loss(f), argnums=argnums)(*a))

        _same(grad(gsum(fn), argnums=argnums)(*args), grad(gsum(ref), argnums=argnums)(*args), "grad(grad)")


def forward_ad_tangents(fn: Callable, args: Sequence[torch.Tensor], tangents: Sequence[torch.Tensor]):
    """``fn``'s output tangents through ``torch.autograd.forward_ad`` (not torch.func), with the
    primals requiring grad as in a training step; the backward through the duals must run too."""
    leaves = [a.detach().requires_grad_() for a in args]
    with fwAD.dual_level():
        out = fn(*(fwAD.make_dual(a, t) for a, t in zip(leaves, tangents)))
        outs = out if isinstance(out, tuple) else (out,)
        unpacked = [fwAD.unpack_dual(o) for o in outs]
        tans = tuple(torch.zeros_like(u.primal) if u.tangent is None else u.tangent for u in unpacked)
        grads = torch.autograd.grad(sum(u.primal.sum() for u in unpacked), leaves, allow_unused=True)
    assert any(g is not None for g in grads), "forward_ad: the backward through the duals reached no input"
    return tans if isinstance(out, tuple) else tans[0]


def gradchecks(fn: Callable, args: Sequence[torch.Tensor], *, second_order: bool = True):
    """torch.autograd.gradcheck (and gradgradcheck) in float64.

    Through Triton's interpreter every perturbed evaluation is a kernel launch,
    so there the checks use gradcheck's fast mode (a random projection of the
    Jacobian, still a real check of every entry's contribution).
    """
    args = tuple(a.detach().to(F64).requires_grad_() for a in args)
    fast = functe.get_backend() == "interpret"
    assert torch.autograd.gradcheck(fn, args, fast_mode=fast, check_forward_ad=True)
    if second_order:
        assert torch.autograd.gradgradcheck(fn, args, fast_mode=fast)


def check_kernel(kernel, args, reference, *, out_dtypes=None):
    """Check a :class:`functe._kernel.Kernel`: Triton launcher (interpreted) vs twin vs float64.

    ``reference`` computes the expected results from float64 copies of ``args``
    (non-tensor arguments are passed through). Both implementations must match
    it within the dtype tolerance, and each other.
    """
    with functe.use_backend("interpret"):
        triton_out = kernel.launcher(*args)
    twin_out = kernel.twin(*args)
    ref_args = [a.detach().to("cpu", F64) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    expected = reference(*ref_args)
    outs = triton_out if isinstance(triton_out, tuple) else (triton_out,)
    twins = twin_out if isinstance(twin_out, tuple) else (twin_out,)
    refs = expected if isinstance(expected, tuple) else (expected,)
    for i, (o, t, r) in enumerate(zip(outs, twins, refs)):
        assert o.shape == t.shape == r.shape, f"{kernel.name} output {i}: {o.shape} {t.shape} {r.shape}"
        assert o.dtype == t.dtype, f"{kernel.name} output {i}: {o.dtype} vs twin {t.dtype}"
        if out_dtypes is not None:
            assert o.dtype == out_dtypes[i]
        assert_close(o, t, msg=f"{kernel.name} output {i}: triton vs twin")
        assert_close(o, r, msg=f"{kernel.name} output {i}: triton vs float64")
        assert_close(t, r, msg=f"{kernel.name} output {i}: twin vs float64")
    return triton_out
