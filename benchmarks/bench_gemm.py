"""Fused GEMM benchmarks: functe vs cuBLAS (+ separate GELU) vs torch.compile, and FP8 vs bf16.

GPU (CUDA available): the issue's cases, in one run,

* bf16 ``gelu(x @ Wᵀ + b)`` at 8192³ and at LLM shapes (tokens 4096-16384, hidden
  4096, ffn 16384: fc1 is ``[T, 4096] x [16384, 4096]ᵀ``), against cuBLAS
  ``addmm`` followed by a separate GELU, cuBLAS ``mm`` alone, and
  ``torch.compile(mode="max-autotune")`` of the same code; also fc2 with the
  residual epilogue (``x + h @ W2ᵀ + b``);
* the FP8 GEMM (E4M3 x E4M3 -> bf16, per-tensor scales) at 8192³ against
  cuBLAS FP8 (``torch._scaled_mm``) and cuBLAS bf16;

printing times, ratios, achieved TFLOP/s and the fraction of the *measured*
cuBLAS bf16 8192³ throughput. Goals (issue 6): fused >= 1.1x addmm+GELU and
>= 0.9x the GEMM alone; FP8 >= 1.5x bf16.

CPU: a small smoke run of the same comparisons (functe's twins on CPU vs torch
eager vs torch.compile's default mode), so the script is exercised everywhere.

Run: ``python -m benchmarks.bench_gemm`` (``--quick``: fewer GPU shapes; the CPU run has two small
shapes either way).
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks._harness import bench, machine, table
from functe.kernels import gemm as G

GELU = "gelu"


def _eager_linear_gelu(x, w, b):
    return F.gelu(torch.addmm(b, x, w.t()), approximate="tanh")


def _eager_linear_residual(x, w, b, r):
    return torch.addmm(b, x, w.t()).add_(r)


def _time(impls: dict[str, Callable], args: tuple, reps: int = 10) -> dict[str, float]:
    """Median seconds of each implementation on the same arguments, in one run."""
    # At least a second of samples each: medians of shared CPU machines are noisy otherwise.
    return {name: bench(functools.partial(fn, *args), reps=reps, min_time=1.0) for name, fn in impls.items()}


def _tflops(m: int, n: int, k: int, seconds: float) -> float:
    return 2.0 * m * n * k / seconds / 1e12


def _cases(quick: bool, cuda: bool):
    if not cuda:
        return [("512x1024x1024", 512, 1024, 1024), ("tokens256 fc1 1024->4096", 256, 4096, 1024)]
    llm = [(f"T={t} fc1 4096->16384", t, 16384, 4096) for t in ((4096,) if quick else (4096, 8192, 16384))]
    return [("8192^3", 8192, 8192, 8192), *llm]


def bench_linear_gelu(quick: bool) -> tuple[str, float | None]:
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    compiled = torch.compile(_eager_linear_gelu, mode="max-autotune" if cuda else None)
    rows, flops, peak = [], [], None
    reps = 20 if cuda else 5
    for name, m, n, k in _cases(quick, cuda):
        x = torch.randn(m, k, device=device, dtype=dtype)
        w = torch.randn(n, k, device=device, dtype=dtype) / k**0.5
        b = torch.randn(n, device=device, dtype=dtype)
        impls = {
            "addmm+gelu": _eager_linear_gelu,
            "gemm only": lambda x, w, b: torch.mm(x, w.t()),
            "compile": compiled,
            "functe": lambda x, w, b: G.GEMM(x, w, b, None, 1.0, GELU),
        }
        times = _time(impls, (x, w, b), reps)
        rows.append((f"{name} {str(dtype).removeprefix('torch.')}", times))
        if cuda and (m, n, k) == (8192, 8192, 8192):
            peak = _tflops(m, n, k, times["gemm only"])
        flops.append((name, {impl: _tflops(m, n, k, t) for impl, t in times.items()}))
    title = f"GEMM + bias + GELU ({'bf16, GPU' if cuda else 'fp32, CPU: functe = twin'})"
    unit, scale = ("TFLOP/s", 1.0) if cuda else ("GFLOP/s", 1e3)
    header = unit + (" (fraction of the measured cuBLAS bf16 8192^3 rate)" if peak else "")
    out = [table(title, rows, baseline="addmm+gelu"), "", header]
    for name, tf in flops:
        cells = ", ".join(f"{impl} {v * scale:.1f}" + (f" ({v / peak:.2f})" if peak else "") for impl, v in tf.items())
        out.append(f"- {name}: {cells}")
        goal = " (goal >= 0.9)" if cuda else ""
        out.append(f"  functe / gemm only = {tf['functe'] / tf['gemm only']:.2f}{goal}")
    return "\n".join(out), peak


def bench_linear_residual(quick: bool) -> str:
    """fc2 with the residual epilogue (TE's ForwardLinearBiasAdd): ``r + h @ W2ᵀ + b``."""
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    shapes = [(4096, 4096, 16384)] if cuda else [(256, 1024, 4096)]
    compiled = torch.compile(_eager_linear_residual, mode="max-autotune" if cuda else None)
    rows = []
    for m, n, k in shapes:
        h = torch.randn(m, k, device=device, dtype=dtype)
        w = torch.randn(n, k, device=device, dtype=dtype) / k**0.5
        b, r = torch.randn(n, device=device, dtype=dtype), torch.randn(m, n, device=device, dtype=dtype)
        impls = {"addmm+add": _eager_linear_residual, "compile": compiled, "functe": G.GEMM}
        times = _time(impls, (h, w, b, r))
        rows.append((f"T={m} fc2 {k}->{n}", times))
    return table("fc2 + bias + residual", rows, baseline="addmm+add")


def bench_dgrad_dgelu() -> str:
    """Backward of gelu(linear): dact in dgrad's prologue vs gelu_backward + mm (eager)."""
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    m, n, k = (8192, 16384, 4096) if cuda else (256, 4096, 1024)
    dy = torch.randn(m, n, device=device, dtype=dtype)
    z = torch.randn(m, n, device=device, dtype=dtype)
    w = torch.randn(n, k, device=device, dtype=dtype)

    def eager():
        g = torch.ops.aten.gelu_backward(dy, z, approximate="tanh")
        return g @ w, g

    times = _time({"gelu_bwd+mm": eager, "functe": lambda: G.GEMM_DGRAD_DACT(dy, z, w, None, 1.0, GELU)}, ())
    return table(f"dgrad with the GELU backward as prologue (T={m}, {n}->{k})", [("dgrad+dgelu", times)],
                 baseline="gelu_bwd+mm")  # fmt: skip


def bench_fp8(peak: float | None) -> str:
    """E4M3 x E4M3 -> bf16 at 8192³ (GPU only): functe vs cuBLAS FP8 vs cuBLAS bf16."""
    m = n = k = 8192
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    sx = torch.tensor(448.0 / x.abs().max().item(), device="cuda")
    sw = torch.tensor(448.0 / w.abs().max().item(), device="cuda")
    xq, wq = (x * sx).to(torch.float8_e4m3fn), (w * sw).to(torch.float8_e4m3fn)
    sx_inv, sw_inv = sx.reciprocal(), sw.reciprocal()
    times = {
        "bf16 cuBLAS": bench(lambda: torch.mm(x, w.t()), reps=20),
        "fp8 cuBLAS": bench(
            lambda: torch._scaled_mm(xq, wq.t(), scale_a=sx_inv, scale_b=sw_inv, out_dtype=torch.bfloat16), reps=20
        ),
        "fp8 functe": bench(lambda: G.GEMM(xq, wq, None, None, 1.0, None, sx_inv, sw_inv, torch.bfloat16), reps=20),
    }
    out = [table("FP8 GEMM 8192^3 (E4M3 x E4M3 -> bf16)", [("8192^3", times)], baseline="bf16 cuBLAS"), ""]
    for impl, t in times.items():
        tf = _tflops(m, n, k, t)
        out.append(f"- {impl}: {tf:.1f} TFLOP/s" + (f" ({tf / peak:.2f} of cuBLAS bf16)" if peak else ""))
    out.append(f"  functe fp8 / bf16 cuBLAS = {times['bf16 cuBLAS'] / times['fp8 functe']:.2f}x (goal >= 1.5x)")
    return "\n".join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer GPU shapes (the CPU cases are small already)")
    quick = parser.parse_args().quick
    print(machine())
    text, peak = bench_linear_gelu(quick)
    print(text, end="\n\n")
    print(bench_linear_residual(quick), end="\n\n")
    print(bench_dgrad_dgelu(), end="\n\n")
    if torch.cuda.is_available():
        print(bench_fp8(peak))
    else:
        print("(FP8 GEMM: GPU only; cuBLAS FP8 needs a CUDA device)")


if __name__ == "__main__":
    main()
