"""Host cost of one op call, layer by layer: where functe's per-call time goes.

At a tiny shape (8x256 fp32) the GPU work is negligible, so the time per call is the host's: torch
eager, then for GELU the Triton launcher alone, the same through its ``torch.library`` custom op
(what ``torch.compile`` sees), the ``Kernel`` dispatch, and ``functe.ops.gelu`` forward and forward
+ backward (custom_vjp's bookkeeping); LayerNorm forward + backward for comparison. Each row is the
best of 7 rounds of 300 calls, synchronised once per round. The launcher rows need CUDA; on the
CPU only the eager and ``ops`` rows run (the ops then run their PyTorch twins).

Run: ``python -m benchmarks.bench_launch``. Results: docs/benchmarks.md ("GPU: NVIDIA H100").
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from functe import ops
from functe.kernels import activation as act_kernels

from ._harness import machine


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


def main() -> None:
    cuda = torch.cuda.is_available()
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
    if cuda:
        rows |= {
            "Triton launcher alone": lambda: act_kernels.activation(*act_args),
            "launcher through its custom op": lambda: act_kernels.ACTIVATION.op(*act_args),
            "Kernel dispatch (ACTIVATION)": lambda: act_kernels.ACTIVATION(*act_args),
        }
    rows |= {
        "ops.gelu fwd, no grad": lambda: ops.gelu(x),
        "ops.gelu fwd, grad": lambda: ops.gelu(xg),
        "ops.gelu fwd+bwd": lambda: torch.autograd.grad(ops.gelu(xg), xg, dy),
        "ops.layer_norm fwd+bwd": lambda: torch.autograd.grad(ops.layer_norm(xg, w, b), (xg, w, b), dy),
    }
    print(machine())
    print()
    print(f"### Host time per call, x f32[8,256] on {device} (best of 7 rounds of 300 calls)")
    print()
    print("| call | µs |")
    print("|---|---|")
    for name, fn in rows.items():
        print(f"| {name} | {host_us_per_call(fn):.1f} |", flush=True)


if __name__ == "__main__":
    main()
