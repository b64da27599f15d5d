"""Host cost of one op call, layer by layer: where functe's per-call time goes.

At a tiny shape (8x256 fp32) the GPU work is negligible, so the time per call is the host's: torch
eager, then for GELU the Triton launcher alone, the same through its ``torch.library`` custom op
(what ``torch.compile`` sees), the ``Kernel`` dispatch, and ``functe.ops.gelu`` forward and forward
+ backward (custom_vjp's bookkeeping); LayerNorm forward + backward for comparison. Each row is the
best of 7 rounds of 300 calls, synchronised once per round. The launcher rows need CUDA; on the
CPU only the eager and ``ops`` rows run (the ops then run their PyTorch twins).

Then GELU forward + backward layer by layer (docs/benchmarks.md, "Where a GELU step's host time
goes"): a Python ``autograd.Function`` around torch's own GELU, the same Function launching the two
Triton kernels directly, then through functe's launchers, then through its ``Kernel`` objects, and
``ops.gelu`` itself: each row adds one layer, so the differences are each layer's cost. The Triton
rows need CUDA.

``--proxy`` runs every row on the CPU with functe's Triton path but each ``kernel[grid](...)``
replaced by a no-op (:func:`no_op_launches`), in thread CPU time with the rows' batches taken in
turn (``_harness.per_call_each``): the argument checks, result allocations, launcher
arithmetic, ``Kernel`` dispatch and custom_vjp bookkeeping all run, Triton's own launch and the
kernel's work do not. That is functe's share of a GPU step's host time, measurable without a GPU
(a GPU host ran Python about 3-4x slower per call than this project's CPU machines: compare rows
within one run only). The results it computes are uninitialised memory: it times, it does not check.

Run: ``python -m benchmarks.bench_launch [--proxy]``. Results: docs/benchmarks.md ("GPU: NVIDIA
H100", "Host time without a GPU").
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

import functe
from functe import ops
from functe.kernels import activation as act_kernels
from functe.kernels._triton import _SwitchableJIT, tiled_grid

from ._harness import machine, per_call_each


def host_us_per_call(fn, *, calls: int = 300, rounds: int = 7) -> float:
    """Best over ``rounds`` of the wall time per call of ``calls`` back-to-back calls, in µs."""
    cuda = torch.cuda.is_available()
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(rounds):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def _no_op_launch(*args, **kwargs) -> None:
    return None


@contextlib.contextmanager
def no_op_launches() -> Iterator[None]:
    """functe's kernels on the ``"interpret"`` backend with every ``kernel[grid](...)`` a no-op:
    what runs is functe's host path up to Triton's launch, and nothing after it."""
    original = _SwitchableJIT.__getitem__
    _SwitchableJIT.__getitem__ = lambda self, grid: _no_op_launch
    try:
        with functe.use_backend("interpret"):
            yield
    finally:
        _SwitchableJIT.__getitem__ = original


def _function(forward, backward) -> type[torch.autograd.Function]:
    """A one-input ``autograd.Function`` saving its input: ``forward(a)``, ``backward(g, a)``."""

    def fwd(ctx, a):
        ctx.save_for_backward(a)
        return forward(a)

    def bwd(ctx, g):
        return backward(g, *ctx.saved_tensors)

    return type("Layer", (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})


def gelu_layers(xg: torch.Tensor, dy: torch.Tensor, *, triton: bool) -> dict[str, Callable[[], object]]:
    """GELU forward + backward closures, each adding one layer of functe to the one before."""
    act = (0, 0.0, 0.0, 0.0)  # (interleave, limit, alpha, offset: unused by GELU)
    layers = {
        "Function(torch's gelu)": _function(
            lambda a: F.gelu(a, approximate="tanh"), lambda g, a: torch.ops.aten.gelu_backward(g, a, approximate="tanh")
        )
    }
    if triton:
        n_rows, n_cols = xg.shape
        flags = dict(
            ACT=act_kernels.spec("gelu")[0], GATED_=False, CLAMPED_=False, INTERLEAVED=False, HAS_S=False,
            BLOCK_R=n_rows, BLOCK_C=n_cols, COMPUTE=act_kernels.tl_compute_dtype(xg.dtype),
        )  # fmt: skip
        scalars = (n_rows, n_cols, n_cols, n_cols, 0.0, 0.0, 0.0, 1)
        grid = tiled_grid(1, 1)

        def raw_forward(a):
            y = torch.empty_like(a)
            act_kernels._act_kernel[grid](a, a, y, *scalars, **flags)
            return y

        def raw_backward(g, a):
            dx = torch.empty_like(a)
            act_kernels._dact_kernel[grid](g, a, a, dx, dx, *scalars, **flags)
            return dx

        layers |= {
            "Function(Triton kernel[grid])": _function(raw_forward, raw_backward),
            "Function(functe launchers)": _function(
                lambda a: act_kernels.activation(a, "gelu", *act),
                lambda g, a: act_kernels.dactivation(g, a, "gelu", *act),
            ),
            "Function(functe Kernels)": _function(
                lambda a: act_kernels.ACTIVATION(a, "gelu", *act),
                lambda g, a: act_kernels.DACTIVATION(g, a, "gelu", *act),
            ),
        }
    steps = {name: (lambda f=f: torch.autograd.grad(f.apply(xg), xg, dy)) for name, f in layers.items()}
    steps["ops.gelu (custom_vjp)"] = lambda: torch.autograd.grad(ops.gelu(xg), xg, dy)
    return steps


def main(argv: list[str] | None = None, *, calls: int = 300, rounds: int = 7) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--proxy", action="store_true", help="CPU, Triton launches replaced by no-ops")
    proxy = parser.parse_args(argv).proxy
    cuda = torch.cuda.is_available() and not proxy
    triton_rows = cuda or proxy
    device = "cuda" if cuda else "cpu"
    x = torch.randn(8, 256, device=device)
    xg, dy = x.clone().requires_grad_(), torch.randn(8, 256, device=device)
    w, b = (torch.randn(256, device=device, requires_grad=True) for _ in range(2))
    act_args = (x, "gelu", 0, 0.0, 0.0, 0.0)
    rows = {
        "eager F.gelu fwd": lambda: F.gelu(x, approximate="tanh"),
        "eager F.gelu fwd+bwd": lambda: torch.autograd.grad(F.gelu(xg, approximate="tanh"), xg, dy),
        "eager F.layer_norm fwd+bwd": lambda: torch.autograd.grad(F.layer_norm(xg, (256,), w, b), (xg, w, b), dy),
    }
    if triton_rows:
        rows |= {
            "functe launcher alone (kernels.activation.activation)": lambda: act_kernels.activation(*act_args),
            "launcher through its custom op": lambda: act_kernels.ACTIVATION.op(*act_args),
            "Kernel dispatch (ACTIVATION)": lambda: act_kernels.ACTIVATION(*act_args),
        }
    rows |= {f"GELU fwd+bwd: {name}": fn for name, fn in gelu_layers(xg, dy, triton=triton_rows).items()}
    rows |= {
        "ops.gelu fwd, no grad": lambda: ops.gelu(x),
        "ops.gelu fwd, grad": lambda: ops.gelu(xg),
        "ops.gelu fwd+bwd": lambda: torch.autograd.grad(ops.gelu(xg), xg, dy),
        "ops.layer_norm fwd+bwd": lambda: torch.autograd.grad(ops.layer_norm(xg, w, b), (xg, w, b), dy),
    }
    where = "cpu, Triton launches replaced by no-ops (--proxy; thread CPU time, rows in turn)" if proxy else device
    lines = [
        machine(),
        "",
        f"### Host time per call, x f32[8,256] on {where} (best of {rounds} rounds of {calls} calls)",
        "",
        "| call | µs |",
        "|---|---|",
    ]
    for line in lines:
        print(line)
    with no_op_launches() if proxy else contextlib.nullcontext():
        if proxy:
            # (thread CPU time, the rows' batches in turn: wall time on a shared 2-core box varied
            # 1.5x, and a neighbour's load now reaches every row alike)
            times = {name: t * 1e6 for name, t in per_call_each(rows, calls=calls, rounds=rounds).items()}
        else:
            times = {name: host_us_per_call(fn, calls=calls, rounds=rounds) for name, fn in rows.items()}
    for name, us in times.items():
        lines.append(f"| {name} | {us:.1f} |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


if __name__ == "__main__":
    main()
