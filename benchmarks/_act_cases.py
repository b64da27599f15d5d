"""Benchmark cases for activations, norms and dropout: each op as functe and as plain torch.

A case builds its inputs for a shape and dtype and gives two functions of the
same arguments: the functe op and the torch code a user would write for the
same formula (TransformerEngine's conventions: tanh GELU, first-half gating).
``run_cpu`` times forward+backward of functe, torch eager and torch.compile of
the torch code; ``run_gpu`` measures the bandwidth of functe's Triton kernels
against a device copy. Used by ``bench_activations.py``, ``bench_norms.py`` and
``bench_dropout.py``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from functe import ops
from functe.kernels import activation as act_kernels
from functe.kernels import dropout as dropout_kernels
from functe.kernels import norm as norm_kernels

from ._harness import bench, gpu_kernel_time, gpu_time, machine, table

Tensor = torch.Tensor


@dataclass(frozen=True)
class Case:
    name: str
    functe: Callable
    torch: Callable
    gated: bool = False  # last dim 2H -> H
    scaled: bool = False  # takes a row scale s
    params: int = 0  # norm parameters (weight, bias)
    own_kernels: bool = True  # False: times the same kernels as another case (only its baseline differs)


def _halves(x):
    return x.chunk(2, dim=-1)


def _clamped(x):
    a, b = _halves(x)
    a = a.clamp(max=7.0)
    return a * torch.sigmoid(1.702 * a) * (b.clamp(-7.0, 7.0) + 1.0)


def _qgelu(x):
    return x * torch.sigmoid(1.702 * x)


def _gated(f):
    def fn(x):
        a, b = _halves(x)
        return f(a) * b

    return fn


_GELU = lambda x: F.gelu(x, approximate="tanh")
_SRELU = lambda x: F.relu(x).square()

ACTIVATIONS = [
    Case("gelu", ops.gelu, _GELU),
    Case("qgelu", ops.qgelu, _qgelu),
    Case("relu", ops.relu, F.relu),
    Case("srelu", ops.srelu, _SRELU),
    Case("silu", ops.silu, F.silu),
    Case("glu", ops.glu, _gated(torch.sigmoid), gated=True),
    Case("geglu", ops.geglu, _gated(_GELU), gated=True),
    Case("qgeglu", ops.qgeglu, _gated(_qgelu), gated=True),
    Case("reglu", ops.reglu, _gated(F.relu), gated=True),
    Case("sreglu", ops.sreglu, _gated(_SRELU), gated=True),
    Case("swiglu", ops.swiglu, _gated(F.silu), gated=True),
    Case("clamped_swiglu", ops.clamped_swiglu, _clamped, gated=True),
    Case("scaled_swiglu", ops.scaled_swiglu, lambda x, s: s[..., None] * _gated(F.silu)(x), gated=True, scaled=True),
    Case("scaled_srelu", ops.scaled_srelu, lambda x, s: s[..., None] * _SRELU(x), scaled=True),
    Case(
        "scaled_clamped_qgeglu",
        ops.scaled_clamped_qgeglu,
        lambda x, s: s[..., None] * _clamped(x),
        gated=True,
        scaled=True,
    ),
]

NORMS = [
    Case(
        "layer_norm",
        lambda x, w, b: ops.layer_norm(x, w, b),
        lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, 1e-5),
        params=2,
    ),
    # The same op against eager computing what functe computes for 16-bit inputs: dγ/dβ accumulated
    # in fp32 (torch's own 16-bit LayerNorm backward accumulates them in 16 bits, 7% off at 8192 rows).
    Case(
        "layer_norm_fp32_grads",
        lambda x, w, b: ops.layer_norm(x, w, b),
        lambda x, w, b: F.layer_norm(x.float(), x.shape[-1:], w.float(), b.float(), 1e-5).to(x.dtype),
        params=2,
        own_kernels=False,
    ),
    Case("rms_norm", lambda x, w: ops.rms_norm(x, w), lambda x, w: F.rms_norm(x, x.shape[-1:], w, 1e-5), params=1),
    Case(
        "l2_normalize",
        ops.l2_normalize,
        lambda x: x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6),
    ),
]

DROPOUT = [
    Case(
        "dropout",
        lambda x: ops.dropout(x, 0.1, seed=1234),
        lambda x: F.dropout(x, 0.1, training=True),
    )
]


def make_inputs(case: Case, shape, dtype, device="cpu", requires_grad=True):
    """Inputs (x, then s or the norm parameters) and the output cotangent."""
    rows, cols = shape
    x = torch.randn(rows, cols, dtype=dtype, device=device)
    extra = []
    if case.scaled:
        extra.append(torch.rand(rows, dtype=dtype, device=device))
    extra += [torch.randn(cols, dtype=dtype, device=device) for _ in range(case.params)]
    args = [t.requires_grad_(requires_grad) for t in (x, *extra)]
    dy = torch.randn(rows, cols // 2 if case.gated else cols, dtype=dtype, device=device)
    return args, dy


def fwd_bwd(fn, args, dy, *, func: bool = False):
    """A closure running forward and backward (gradients of every input) once: with
    ``torch.autograd.grad``, or (``func``) with ``torch.func.vjp`` as a functional training loop does."""

    def run():
        return torch.autograd.grad(fn(*args), args, dy)

    def run_func():
        _, pull = torch.func.vjp(fn, *(a.detach() for a in args))
        return pull(dy)

    return run_func if func else run


def best_of(impls: dict[str, Callable], *, reps: int, warmup: int = 2) -> dict[str, float]:
    """Best time of each implementation over ``reps`` interleaved rounds.

    Interleaving and taking the minimum keeps the comparison fair on a shared
    machine, where other processes inflate some samples by large factors.
    """
    for fn in impls.values():
        bench(fn, warmup=warmup - 1, reps=1)
    best = dict.fromkeys(impls, float("inf"))
    for _ in range(reps):
        for name, fn in impls.items():
            best[name] = min(best[name], bench(fn, warmup=0, reps=1))
    return best


def run_cpu(cases, shape, dtypes, *, reps, compile_: bool, func: bool = False) -> str:
    """Forward+backward times of functe vs torch eager (and torch.compile) on the CPU, as a table.

    ``func``: through ``torch.func.vjp`` (functe ops vs the same torch code under the transform;
    no torch.compile column, since compiling a torch.func transform drops custom backward rules).
    """
    tables = []
    for dtype in dtypes:
        rows = []
        for case in cases:
            args, dy = make_inputs(case, shape, dtype)
            impls = {"eager": case.torch, "functe": case.functe}
            if compile_ and not func:
                torch._dynamo.reset()
                impls["compile"] = torch.compile(case.torch)
            times = best_of({k: fwd_bwd(fn, args, dy, func=func) for k, fn in impls.items()}, reps=reps)
            rows.append((case.name, times))
            print(f"  {case.name} {dtype}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in times.items()), flush=True)
        how = "torch.func.vjp fwd+bwd" if func else "fwd+bwd"
        title = f"CPU {how}, {shape[0]}x{shape[1]} {str(dtype).removeprefix('torch.')} (best of {reps}, interleaved)"
        tables.append(table(title, rows, baseline="eager"))
    return "\n\n".join(tables)


# ----------------------------------------------------------------------------- GPU: kernel bandwidth


def _kernel_launches(case: Case, args, dy):
    """{kernel name: (launch closure, bytes moved)} for the case's forward and backward kernels."""
    x = args[0]
    size = lambda *ts: sum(t.numel() * t.element_size() for t in ts)
    if case in DROPOUT:
        seed = torch.tensor(1234, device=x.device)
        return {"dropout": (lambda: dropout_kernels.dropout(x, seed, 0.1), 2 * size(x))}
    if not case.own_kernels:
        return {}
    if case in NORMS:
        name = case.name
        fwd = getattr(norm_kernels, name)
        bwd = getattr(norm_kernels, f"{name}_bwd")
        params = args[1:]
        fwd_args = (x, *params, 1e-5, False) if params else (x, 1e-6)
        if name == "layer_norm":  # its backward takes the forward's row statistics
            stats = fwd(*fwd_args)[1:]
            bwd_args = (dy, x, *stats, params[0], False)
        else:
            stats = ()
            bwd_args = (dy, x, *params[:1], 1e-5, False) if params else (dy, x, 1e-6)
        return {
            f"{name} fwd": (lambda: fwd(*fwd_args), 2 * size(x) + size(*params, *stats)),
            f"{name} bwd": (lambda: bwd(*bwd_args), 3 * size(x) + size(*params, *stats)),
        }
    name = {"scaled_swiglu": "swiglu", "scaled_srelu": "srelu", "scaled_clamped_qgeglu": "clamped_swiglu"}.get(
        case.name, case.name
    )
    params = (name, 0, 7.0, 1.702, 1.0)
    y_bytes = size(dy)
    if case.scaled:
        s = args[1]
        return {
            f"{case.name} fwd": (lambda: act_kernels.activation_scaled(x, s, *params), size(x, s) + y_bytes),
            f"{case.name} bwd": (lambda: act_kernels.dactivation_scaled(dy, x, s, *params), 2 * size(x, s) + y_bytes),
        }
    return {
        f"{case.name} fwd": (lambda: act_kernels.activation(x, *params), size(x) + y_bytes),
        f"{case.name} bwd": (lambda: act_kernels.dactivation(dy, x, *params), 2 * size(x) + y_bytes),
    }


def run_gpu(cases, shape, dtype, *, reps, device="cuda", compile_: bool = True) -> str:
    """Achieved bandwidth of each Triton kernel as a fraction of a device copy, and fwd+bwd vs torch.compile."""
    # (CUDA events where there is a GPU; off one, as the CPU test of this code path runs it, wall time)
    on_gpu = torch.device(device).type == "cuda"
    timed = gpu_time if on_gpu else lambda fn: bench(fn, warmup=1, reps=reps)
    # (a kernel's bandwidth without the host's time to issue it: CUDA-graph replay)
    kernel_timed = gpu_kernel_time if on_gpu else timed
    src = torch.empty(shape[0] * shape[1] * 4, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_s = kernel_timed(lambda: dst.copy_(src))
    copy_bw = 2 * src.numel() / copy_s
    lines = [
        f"### GPU kernel bandwidth, {shape[0]}x{shape[1]} {str(dtype).removeprefix('torch.')} (CUDA-graph replay)",
        "",
        f"device copy: {copy_bw / 1e9:.0f} GB/s",
        "",
        "| kernel | time (ms) | GB/s | fraction of copy |",
        "|---|---|---|---|",
    ]
    rows = []
    for case in cases:
        args, dy = make_inputs(case, shape, dtype, device=device, requires_grad=False)
        for name, (launch, nbytes) in _kernel_launches(case, args, dy).items():
            t = kernel_timed(launch)
            lines.append(f"| {name} | {t * 1e3:.3f} | {nbytes / t / 1e9:.0f} | {nbytes / t / copy_bw:.2f} |")
        args, dy = make_inputs(case, shape, dtype, device=device)
        impls = {"eager": case.torch, "functe": case.functe}
        if compile_:
            torch._dynamo.reset()
            # (functe's op inside a compiled function too: the compiled graph calls its kernels
            # without custom_vjp's per-call Python, which bounds the eager column on a GPU host)
            impls = {"compile": torch.compile(case.torch), **impls, "functe compiled": torch.compile(case.functe)}
        rows.append((case.name, {k: timed(fwd_bwd(fn, args, dy)) for k, fn in impls.items()}))
    title = f"GPU fwd+bwd, {shape[0]}x{shape[1]} {str(dtype).removeprefix('torch.')}"
    return "\n".join(lines) + "\n\n" + table(title, rows, baseline="compile" if compile_ else "eager")


def run_overhead(cases, *, reps: int = 200, func: bool = False) -> str:
    """Per-call forward+backward time at a tiny shape (8x256 fp32): Python dispatch overhead."""
    rows = []
    for case in cases:
        args, dy = make_inputs(case, (8, 256), torch.float32)
        impls = {"eager": case.torch, "functe": case.functe}
        steps = {k: fwd_bwd(fn, args, dy, func=func) for k, fn in impls.items()}
        rows.append((case.name, best_of(steps, reps=reps, warmup=5)))
    how = "torch.func.vjp fwd+bwd" if func else "fwd+bwd"
    return table(f"CPU dispatch overhead: {how} at 8x256 fp32 (best of {reps})", rows, baseline="eager")


def main(cases, description: str):
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], action="append", help="default: both")
    parser.add_argument("--ops", nargs="*", help="case names (default: all)")
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--cols", type=int, default=4096, help="CPU width (GPU: 8192)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile (its compiles take seconds)")
    parser.add_argument("--func", action="store_true", help="CPU: time forward+backward through torch.func.vjp")
    parser.add_argument("--gpu-only", action="store_true", help="with CUDA: only the GPU tables")
    opts = parser.parse_args()
    unknown = sorted(set(opts.ops or ()) - {c.name for c in cases})
    if unknown:
        parser.error(f"unknown --ops {unknown}; choose from {[c.name for c in cases]}")
    selected = [c for c in cases if not opts.ops or c.name in opts.ops]
    dtypes = [getattr(torch, d) for d in (opts.dtype or ["float32", "bfloat16"])]
    print(machine(), flush=True)
    if torch.cuda.is_available():
        # (the GPU table: bf16 at rows x 8192, forward + backward through autograd)
        reps = max(opts.reps, 20)
        print(run_gpu(selected, (opts.rows, 8192), torch.bfloat16, reps=reps, compile_=not opts.no_compile))
        if opts.gpu_only:
            return
    print(
        run_cpu(selected, (opts.rows, opts.cols), dtypes, reps=opts.reps, compile_=not opts.no_compile, func=opts.func)
    )
    print()
    print(run_overhead(selected, func=opts.func))
