"""Block-scaled quantize benchmarks: FP8 block scaling and NVFP4 against the FP8 per-tensor quantize.

Run from the repository root: ``python -m benchmarks.bench_block`` (``--small`` for a quick run).

CPU (what functe's CI machine has), a 4096 x 4096 bf16 tensor, every quantize complete (amax,
scales, cast, the data in its storage format):

* per case: functe (the twin's chunked CPU path), the same formula in torch eager (the twin's
  whole-tensor path, i.e. plain torch ops) and ``torch.compile`` of that formula;
* the ratio of each functe quantize to functe's FP8 per-tensor quantize (current scaling: amax
  pass, then the cast) — what a block format costs on top of the per-tensor one;
* wall time (2 threads) and single-thread CPU time (``time.thread_time``, which other processes on
  the shared machine cannot inflate).

GPU (only when CUDA is available; not run here: no GPU): every quantize kernel's bandwidth
against a measured copy (``clone``), goal >= 80%.
"""

from __future__ import annotations

import argparse

import torch

import functe
from benchmarks._harness import bench, machine
from benchmarks.bench_fp8 import _interleaved
from functe._quantize import cast
from functe.kernels import block_quantize as bq
from functe.kernels import hadamard as hd
from functe.kernels import nvfp4 as nv
from functe.kernels import quantize as qk

BF16, E4M3 = torch.bfloat16, torch.float8_e4m3fn


def _cases(x: torch.Tensor) -> dict[str, dict]:
    """case -> {implementation: callable}; "functe" is what the library runs."""
    seed, one = torch.tensor(7), torch.ones(())
    fp8_args = ("", 0.0, 0.0, 0.0, E4M3, E4M3, True, 0.0)

    def fp8_formula(x, rows):
        return bq._fp8_block_rows(x, *fp8_args[:6], rows, True, 0.0)

    def nvfp4_formula(x, rows, sr):
        _, amax = qk.cast_amax_ref(x, one, E4M3, E4M3, False)
        ge, gd = nv.global_scales_ref(amax)
        # (the random bits are drawn inside the timed call, as functe's quantize draws them)
        bits = hd.random_bits_ref(seed, torch.arange(x.numel()).view(x.shape)) if sr else None
        return nv._nvfp4_rows(x, bits, ge, gd, "", 0.0, 0.0, 0.0, rows, sr, torch.uint8)

    fp4 = functe.NVFP4BlockScaling()
    cases = {
        "FP8 per-tensor (current scaling)": {
            "functe": lambda: cast(x, functe.CurrentScaling(), "input", None, E4M3),
            "formula": lambda x: torch.clamp(x.float() * (448.0 / x.abs().amax().float()), -448, 448).to(E4M3),
        },
        "FP8 block 1x128": {
            "functe": lambda: bq.FP8_BLOCK_CAST(x, *fp8_args),
            "formula": lambda x: fp8_formula(x, 1),
        },
        "FP8 block 128x128": {
            "functe": lambda: bq.FP8_BLOCK_CAST_2D(x, E4M3, E4M3, True, 0.0),
            "formula": lambda x: fp8_formula(x, 128),
        },
        "NVFP4 1x16": {
            "functe": lambda: functe.quantize(x, fp4, role="input"),
            "formula": lambda x: nvfp4_formula(x, 1, False),
        },
        "NVFP4 1x16, stochastic rounding": {
            "functe": lambda: functe.quantize(x, fp4, role="grad_output", seed=seed),
            "formula": lambda x: nvfp4_formula(x, 1, True),
        },
        "NVFP4 16x16": {
            "functe": lambda: functe.quantize(x, fp4, role="weight"),
            "formula": lambda x: nvfp4_formula(x, 16, False),
        },
    }
    for impls in cases.values():
        formula = impls.pop("formula")
        compiled = torch.compile(formula)
        impls["torch eager"] = lambda f=formula: f(x)
        impls["torch compile"] = lambda f=compiled: f(x)
    return cases


def bench_cpu(n: int, rounds: int, *, cpu_time: bool) -> str:
    x = torch.randn(n, n).to(BF16)
    rows = []
    for case, impls in _cases(x).items():
        if cpu_time:
            impls.pop("torch compile")  # compiled code runs on its own threads
        rows.append((case, _interleaved(impls, rounds, warmup=1, cpu_time=cpu_time)))
    base = rows[0][1]["functe"]
    impls = list(rows[0][1])
    how = "1 thread, CPU time" if cpu_time else "wall time"
    lines = [
        f"### Quantize a {n}x{n} bf16 tensor (cpu, {how})",
        "",
        "| case | " + " | ".join(f"{i} (ms)" for i in impls) + " | functe / FP8 per-tensor | GB/s (functe) |",
        "|" + "---|" * (len(impls) + 3),
    ]
    for case, times in rows:
        out_bytes = 1.0 if case.startswith("FP8") else 0.5 + 1 / 16
        gbs = (2 + out_bytes) * x.numel() / times["functe"] / 1e9
        cells = " | ".join(f"{times[i] * 1e3:.1f}" for i in impls)
        lines.append(f"| {case} | {cells} | {times['functe'] / base:.2f}x | {gbs:.2f} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- activation + block linear


def _act_formula(x: torch.Tensor, act: str) -> torch.Tensor:
    """The activation in plain torch (fp32 math, rounded to x's dtype): tanh GELU or SwiGLU."""
    if act == "swiglu":
        a, b = x.float().chunk(2, dim=-1)
        return (torch.nn.functional.silu(a) * b).to(x.dtype)
    return torch.nn.functional.gelu(x.float(), approximate="tanh").to(x.dtype)


def _act_cases(x: torch.Tensor, w: torch.Tensor, act: str, recipe) -> dict[str, dict]:
    """(activation + block cast, activation + block linear forward) -> {implementation: callable}.

    ``fused`` is what functe.fuse runs (``cast_act_block_keep``: h and q from the quantizing kernels),
    ``unfused`` the activation op then the block cast / ``block_linear``, ``previous fused`` the fused
    op before this change (the activation op writes h, ``cast_act_block`` reads x again).
    """
    from functe._block_quantize import cast_act_block, cast_act_block_keep, cast_block, operand_dtype
    from functe.kernels.activation import ACTIVATION
    from functe.ops import _block_linear, _fused_block

    nvfp4 = isinstance(recipe, functe.NVFP4BlockScaling)
    seed = torch.tensor(7) if nvfp4 else None
    dt, params = operand_dtype(recipe, x.dtype), (0.0, 0.0, 0.0)

    def unfused_cast(x):
        h = ACTIVATION(x, act, 0, *params)
        return h, cast_block(h, recipe, "input", None, dt)

    def previous_cast(x):
        return ACTIVATION(x, act, 0, *params), cast_act_block(x, act, recipe, "input", None, dt, limit=0.0)

    def cast_formula(h, rows):  # the block quantize of h (or w) in plain torch: the twins' whole-tensor formula
        if not nvfp4:
            return bq._fp8_block_rows(h, "", *params, E4M3, dt, rows, True, 0.0)[0], 1.0
        ge, gd = nv.global_scales_ref(h.abs().amax().float())
        return nv._nvfp4_rows(h, None, ge, gd, "", *params, rows, False, dt)[0], gd

    def eager_cast(x):
        h = _act_formula(x, act)
        return h, cast_formula(h, 1)

    def eager_linear(x):
        _, (hq, gh) = eager_cast(x)
        wq, gw = cast_formula(w, 16 if nvfp4 else 128)
        return torch.nn.functional.linear(hq, wq).float().mul(gh * gw).to(x.dtype)

    def fused_linear(x):
        return _fused_block.forward_activation_block_linear(x, w, None, seed, name=act, recipe=recipe, **LIMITS)

    def unfused_linear(x):
        return functe.ops.fp8_linear(functe.ops.activation(x, act), w, None, None, recipe=recipe, seed=seed)

    def previous_linear(x):
        h, (xq, sx, _) = previous_cast(x)
        return _block_linear.forward_quantized(h, xq, sx, w, None, seed, recipe=recipe)[0]

    cases = {
        "activation + block cast": {
            "fused": lambda x: cast_act_block_keep(x, act, recipe, "input", None, dt, limit=0.0),
            "unfused": unfused_cast,
            "previous fused": previous_cast,
            "torch eager": eager_cast,
        },
        "activation + block linear fwd": {
            "fused": fused_linear,
            "unfused": unfused_linear,
            "previous fused": previous_linear,
            "torch eager": eager_linear,
        },
    }
    for impls in cases.values():
        impls["torch compile"] = torch.compile(impls["torch eager"])
        for name, fn in impls.items():
            impls[name] = lambda fn=fn: fn(x)
    return cases


LIMITS = {"limit": 0.0, "alpha": 0.0, "offset": 0.0}


def bench_act_cpu(tokens: int, hidden: int, out: int, rounds: int, *, cpu_time: bool) -> str:
    """Fused activation + block cast / block linear forward vs unfused (and the previous fused op), no grad."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(out, hidden, generator=gen).to(BF16)
    how = "1 thread, CPU time" if cpu_time else "wall time"
    lines = [
        f"### Activation + block-scaled linear forward, {tokens} tokens x {hidden} -> {out}, bf16, no grad "
        f"(cpu, {how})",
        "",
    ]
    header = None
    for recipe in (functe.Float8BlockScaling(), functe.NVFP4BlockScaling()):
        for act in ("gelu", "swiglu"):
            x = torch.randn(tokens, 2 * hidden if act == "swiglu" else hidden, generator=gen).to(BF16)
            for case, impls in _act_cases(x, w, act, recipe).items():
                if cpu_time:
                    impls.pop("torch compile")
                with torch.no_grad():
                    times = _interleaved(impls, rounds, warmup=1, cpu_time=cpu_time)
                if header is None:
                    header = list(times)
                    lines.append(
                        "| recipe | act | case | " + " | ".join(f"{i} (ms)" for i in header) + " | fused / unfused |"
                    )
                    lines.append("|" + "---|" * (len(header) + 4))
                cells = " | ".join(f"{times[i] * 1e3:.1f}" for i in header)
                name = type(recipe).__name__.removesuffix("BlockScaling").replace("Float8", "FP8 block")
                lines.append(f"| {name} | {act} | {case} | {cells} | {times['fused'] / times['unfused']:.2f}x |")
    return "\n".join(lines)


def bench_gpu(n: int) -> str:
    """Each quantize kernel's bandwidth against a copy (CUDA only), goal >= 80%."""
    x = torch.randn(n, n, device="cuda").to(BF16)
    seed = torch.tensor(7, device="cuda")
    _, amax = qk.CAST_AMAX(x, torch.ones((), device="cuda"), E4M3, E4M3, False)
    copy_t = bench(lambda: x.clone(), warmup=5, reps=50)
    copy_bw = 4 * x.numel() / copy_t / 1e9  # read + write 2 B
    kernels = {  # name: (launch, bytes moved per element)
        "FP8 per-tensor cast + amax": (lambda: qk.CAST_AMAX(x, amax, E4M3, E4M3, True), 3.0),
        "amax pass (NVFP4 first pass)": (lambda: qk.CAST_AMAX(x, amax, E4M3, E4M3, False), 2.0),
        "FP8 block 1x128": (lambda: bq.FP8_BLOCK_CAST(x, "", 0.0, 0.0, 0.0, E4M3, E4M3, True, 0.0), 3 + 4 / 128),
        "FP8 block 128x128": (lambda: bq.FP8_BLOCK_CAST_2D(x, E4M3, E4M3, True, 0.0), 3.0),
        "NVFP4 cast 1x16": (lambda: nv.NVFP4_CAST(x, amax, seed, "", 0.0, 0.0, 0.0, 1, False, torch.uint8), 2.5625),
        "NVFP4 cast 1x16, SR": (lambda: nv.NVFP4_CAST(x, amax, seed, "", 0.0, 0.0, 0.0, 1, True, torch.uint8), 2.5625),
        "NVFP4 cast 16x16": (lambda: nv.NVFP4_CAST(x, amax, seed, "", 0.0, 0.0, 0.0, 16, False, torch.uint8), 2.5),
        "RHT (bf16 -> fp32)": (lambda: hd.RHT16(x, seed, False, torch.float32), 6.0),
        # The activation + block cast keeping h (forward_activation_block_linear), gelu: x read, h written.
        "FP8 block 1x128 + gelu, h kept": (
            lambda: bq.FP8_BLOCK_ACT_CAST_KEEP(x, "gelu", 0.0, 0.0, 0.0, E4M3, E4M3, True, 0.0),
            5 + 4 / 128,
        ),
        "NVFP4 amax pass + gelu, h kept": (lambda: qk.ACT_OUTPUT_AMAX(x, "gelu", 0.0, 0.0, 0.0), 4.0),
    }
    lines = [f"### Quantize kernels on {torch.cuda.get_device_name()}, {n}x{n} bf16 (copy: {copy_bw:.0f} GB/s)", ""]
    lines += ["| kernel | ms | GB/s | % of copy (goal >= 80%) |", "|---|---|---|---|"]
    for name, (fn, per_element) in kernels.items():
        t = bench(fn, warmup=5, reps=50)
        bw = per_element * x.numel() / t / 1e9
        lines.append(f"| {name} | {t * 1e3:.3f} | {bw:.0f} | {bw / copy_bw:.0%} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="1024x1024 (a quick check)")
    parser.add_argument("--act", action="store_true", help="only the activation + block linear tables")
    args = parser.parse_args()
    n = 1024 if args.small else 4096
    tokens, hidden, out = (512, 512, 128) if args.small else (2048, 2048, 256)
    print(machine())
    print("(best of 5 interleaved rounds per case; 3 for the CPU-time tables)")
    print()
    with functe.use_backend("torch"):
        if not args.act:
            print(bench_cpu(n, 5, cpu_time=False))
            print()
            print(bench_cpu(n, 3, cpu_time=True))
            print()
        print(bench_act_cpu(tokens, hidden, out, 5, cpu_time=False))
        print()
        print(bench_act_cpu(tokens, hidden, out, 3, cpu_time=True))
    if torch.cuda.is_available():
        print()
        print(bench_gpu(16384))


if __name__ == "__main__":
    main()
